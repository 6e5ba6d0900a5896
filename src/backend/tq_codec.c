/* tq_codec.c - TurboQuant rotation, Lloyd-Max codebooks and the reference
 * vector quantizer (see tq_codec.h for the format and the exactness contract). */
#include "backend/tq_codec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "core/util.h"

/* ---- rotation ---- */

static double gauss(uint64_t *s) { /* Box-Muller on two 53-bit uniforms in (0, 1) */
    const double u1 = ((double)(lethe_splitmix64(s) >> 11) + 0.5) * 0x1p-53;
    const double u2 = ((double)(lethe_splitmix64(s) >> 11) + 0.5) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void lethe_tq_rotation(uint64_t seed, int32_t d, float *rot) {
    LETHE_ASSERT(d > 0 && d <= LETHE_TQ_HEAD_DIM_MAX);
    double *a = lethe_xmalloc((size_t)d * d * sizeof(double));
    uint64_t s = seed ^ 0x7475726271756e74ull; /* "turbqunt" */
    for (size_t i = 0; i < (size_t)d * d; i++) a[i] = gauss(&s);
    /* modified Gram-Schmidt over the rows (twice, for orthogonality to ~1e-16) */
    for (int32_t i = 0; i < d; i++) {
        double *r = a + (size_t)i * d;
        for (int pass = 0; pass < 2; pass++)
            for (int32_t j = 0; j < i; j++) {
                const double *q = a + (size_t)j * d;
                double dot = 0;
                for (int32_t k = 0; k < d; k++) dot += r[k] * q[k];
                for (int32_t k = 0; k < d; k++) r[k] -= dot * q[k];
            }
        double nn = 0;
        for (int32_t k = 0; k < d; k++) nn += r[k] * r[k];
        nn = sqrt(nn);
        LETHE_ASSERT(nn > 1e-12);
        for (int32_t k = 0; k < d; k++) r[k] /= nn;
    }
    for (size_t i = 0; i < (size_t)d * d; i++) rot[i] = (float)a[i];
    free(a);
}

/* ---- Lloyd-Max codebook for the coordinate density on [-1, 1] ---- */

#define TQ_GRID 32768 /* trapezoid intervals over [-1, 1] */

typedef struct tq_density {
    double *f0, *f1, *f2; /* cumulative integrals of f, t f, t^2 f at the grid points */
} tq_density;

static void density_build(int32_t d, tq_density *D) {
    const int n = TQ_GRID;
    D->f0 = lethe_xmalloc((size_t)(n + 1) * sizeof(double));
    D->f1 = lethe_xmalloc((size_t)(n + 1) * sizeof(double));
    D->f2 = lethe_xmalloc((size_t)(n + 1) * sizeof(double));
    const double h = 2.0 / n, ex = 0.5 * (d - 3);
    double prev[3] = {0, 0, 0};
    D->f0[0] = D->f1[0] = D->f2[0] = 0;
    for (int i = 0; i <= n; i++) {
        const double t = -1.0 + h * i;
        const double w = 1.0 - t * t;
        const double f = w > 0 ? (ex == 0 ? 1.0 : pow(w, ex)) : (ex < 0 ? 0.0 : ex == 0 ? 1.0 : 0.0);
        const double cur[3] = {f, t * f, t * t * f};
        if (i > 0) {
            D->f0[i] = D->f0[i - 1] + 0.5 * h * (prev[0] + cur[0]);
            D->f1[i] = D->f1[i - 1] + 0.5 * h * (prev[1] + cur[1]);
            D->f2[i] = D->f2[i - 1] + 0.5 * h * (prev[2] + cur[2]);
        }
        memcpy(prev, cur, sizeof(prev));
    }
    const double z = D->f0[n]; /* normalize to a probability density */
    for (int i = 0; i <= n; i++) D->f0[i] /= z, D->f1[i] /= z, D->f2[i] /= z;
}

static void density_free(tq_density *D) { free(D->f0), free(D->f1), free(D->f2); }

/* cumulative integral k (0: f, 1: t f, 2: t^2 f) at t, linear between grid points */
static double cum(const tq_density *D, int k, double t) {
    const double *F = k == 0 ? D->f0 : k == 1 ? D->f1 : D->f2;
    if (t <= -1.0) return 0.0;
    if (t >= 1.0) return F[TQ_GRID];
    const double x = (t + 1.0) * 0.5 * TQ_GRID;
    const int i = (int)x;
    const double a = x - i;
    return i >= TQ_GRID ? F[TQ_GRID] : F[i] + a * (F[i + 1] - F[i]);
}

/* Lloyd iteration in double; c [K] ascending, symmetric */
static void lloyd(const tq_density *D, int32_t bits, int32_t d, double *c) {
    const int K = 1 << bits;
    const double sigma = 1.0 / sqrt((double)d);
    for (int k = 0; k < K; k++) c[k] = sigma * (-2.5 + 5.0 * (k + 0.5) / K);
    double b[17];
    for (int it = 0; it < 500; it++) {
        b[0] = -1.0, b[K] = 1.0;
        for (int k = 1; k < K; k++) b[k] = 0.5 * (c[k - 1] + c[k]);
        for (int k = 0; k < K; k++) {
            const double m0 = cum(D, 0, b[k + 1]) - cum(D, 0, b[k]);
            const double m1 = cum(D, 1, b[k + 1]) - cum(D, 1, b[k]);
            if (m0 > 0) c[k] = m1 / m0;
        }
    }
    for (int k = 0; k < K / 2; k++) { /* exact symmetry */
        const double v = 0.5 * (c[K - 1 - k] - c[k]);
        c[k] = -v, c[K - 1 - k] = v;
    }
}

void lethe_tq_codebook(int32_t bits, int32_t d, float *centroids, float *bounds) {
    LETHE_ASSERT(bits >= 1 && bits <= LETHE_TQ_BITS_MAX && d >= 2);
    tq_density D;
    density_build(d, &D);
    double c[16];
    lloyd(&D, bits, d, c);
    density_free(&D);
    const int K = 1 << bits;
    for (int k = 0; k < K; k++) centroids[k] = (float)c[k];
    for (int k = 0; k + 1 < K; k++) bounds[k] = 0.5f * (centroids[k] + centroids[k + 1]);
}

double lethe_tq_distortion(int32_t bits, int32_t d) {
    float c[16], b[15];
    lethe_tq_codebook(bits, d, c, b);
    tq_density D;
    density_build(d, &D);
    const int K = 1 << bits;
    double mse = 0;
    for (int k = 0; k < K; k++) { /* int over cell k of (t - c_k)^2 f */
        const double lo = k == 0 ? -1.0 : b[k - 1], hi = k == K - 1 ? 1.0 : b[k];
        const double m0 = cum(&D, 0, hi) - cum(&D, 0, lo), m1 = cum(&D, 1, hi) - cum(&D, 1, lo),
                     m2 = cum(&D, 2, hi) - cum(&D, 2, lo);
        mse += m2 - 2.0 * c[k] * m1 + (double)c[k] * c[k] * m0;
    }
    density_free(&D);
    return mse * d;
}

/* ---- fp16 ---- */

uint16_t lethe_f32_to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return (uint16_t)(sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {                                   /* subnormal half (or zero) */
        if (a < 0x33000000u) return (uint16_t)sign;          /* < 2^-25: rounds to 0 */
        /* x = m 2^(e - 150) = (m 2^(e - 126)) 2^-24: q = m >> (126 - e), rounded to even */
        const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u;
        const uint32_t shift = 126u - e; /* 14 .. 24 */
        uint32_t q = m >> shift;
        const uint32_t r = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
        if (r > halfway || (r == halfway && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias exponent 127 -> 15, round the 13 dropped bits to even */
    uint32_t h = ((a >> 13) - ((127u - 15u) << 10));
    const uint32_t r = a & 0x1FFFu;
    if (r > 0x1000u || (r == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float lethe_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float v;
    if (e == 0) {
        v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    uint32_t u = e == 31 ? (sign | 0x7F800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    memcpy(&v, &u, sizeof(v));
    return v;
}

/* ---- the quantizer ---- */

float lethe_tq_sumsq(const float *x, int32_t d) {
    float v[32];
    for (int l = 0; l < 32; l++) {
        float p = 0.0f;
        for (int32_t j = l; j < d; j += 32) p = fmaf(x[j], x[j], p);
        v[l] = p;
    }
    for (int o = 16; o >= 1; o >>= 1) {
        float w[32];
        for (int l = 0; l < 32; l++) w[l] = v[l] + v[l ^ o];
        memcpy(v, w, sizeof(v));
    }
    return v[0];
}

void lethe_tq_quant_vec(const float *x, int32_t d, int32_t bits, const float *rot,
                        const float *bounds, uint8_t *codes, uint16_t *norm) {
    LETHE_ASSERT(d % 8 == 0 && bits >= 1 && bits <= LETHE_TQ_BITS_MAX);
    const size_t cb = lethe_tq_code_bytes(d, bits);
    memset(codes, 0, cb);
    const float n = sqrtf(lethe_tq_sumsq(x, d));
    if (!(n > 0.0f)) {
        *norm = 0;
        return;
    }
    *norm = lethe_f32_to_f16(n);
    const int K1 = (1 << bits) - 1;
    for (int32_t i = 0; i < d; i++) {
        float y = 0.0f;
        const float *r = rot + (size_t)i * d;
        for (int32_t j = 0; j < d; j++) y = fmaf(r[j], x[j], y);
        const float u = y / n;
        uint32_t q = 0;
        for (int k = 0; k < K1; k++) q += bounds[k] < u;
        const uint32_t bit = (uint32_t)i * (uint32_t)bits;
        codes[bit >> 3] |= (uint8_t)(q << (bit & 7u));
        if ((bit & 7u) + (uint32_t)bits > 8u) codes[(bit >> 3) + 1] |= (uint8_t)(q >> (8u - (bit & 7u)));
    }
}

void lethe_tq_dequant_vec(const uint8_t *codes, uint16_t norm, int32_t d, int32_t bits,
                          const float *rot, const float *centroids, float *out) {
    const float n = lethe_f16_to_f32(norm);
    for (int32_t j = 0; j < d; j++) out[j] = 0.0f;
    for (int32_t i = 0; i < d; i++) {
        const float c = centroids[lethe_tq_code(codes, i, bits)];
        const float *r = rot + (size_t)i * d;
        for (int32_t j = 0; j < d; j++) out[j] = fmaf(r[j], c, out[j]);
    }
    for (int32_t j = 0; j < d; j++) out[j] *= n;
}

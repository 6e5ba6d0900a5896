/* qdot.c - matmul on stored-format weights with 16-bit activations: the
 * quantization of x, the portable C twin of the SIMD kernels
 * (qdot_kernel.h) and the tier dispatch. The design and its error bound are
 * in qdot.h; the portable twin below runs qdot.h's float order (fmaf for
 * the FMA, exact integer unit sums), the very operations of the SIMD body's
 * lanes, so every tier gives the same bits. */
#include <math.h>
#include <string.h>

#include "backend/cpu/qdot.h"
#include "backend/ggml_types.h"
#include "backend/tq_codec.h"
#include "core/util.h"

bool lethe_cpu_qdot_supported(lethe_ggml_type t, int32_t cols) {
    if (cols <= 0 || cols % 32) return false;
    switch (t) {
    case LETHE_GGML_Q4_0:
    case LETHE_GGML_Q4_1:
    case LETHE_GGML_Q5_0:
    case LETHE_GGML_Q5_1:
    case LETHE_GGML_Q8_0: return true;
    case LETHE_GGML_Q4_K:
    case LETHE_GGML_Q5_K:
    case LETHE_GGML_Q6_K: return cols % 256 == 0;
    default: return false;
    }
}

size_t lethe_cpu_qx_bytes(int32_t n, int32_t cols) {
    const size_t q = ((size_t)n * (size_t)cols * 2 + 63) / 64 * 64;
    return q + (size_t)n * (size_t)(cols / 32) * 2 * sizeof(float);
}

void lethe_cpu_qx_layout(int32_t n, int32_t cols, void *scratch, lethe_qx_rows *out) {
    LETHE_ASSERT(n >= 0 && cols > 0 && cols % 32 == 0);
    const int32_t nb = cols / 32;
    int16_t *q = scratch;
    float *d = (float *)((uint8_t *)scratch + ((size_t)n * (size_t)cols * 2 + 63) / 64 * 64);
    *out = (lethe_qx_rows){q, d, d + (size_t)n * nb, n, cols};
}

void lethe_cpu_qx_quantize(lethe_cpu_isa isa, const float *x, int32_t n, int32_t cols,
                           void *scratch, lethe_qx_rows *out) {
    lethe_cpu_qx_layout(n, cols, scratch, out);
    lethe_cpu_qx_quantize_rows(isa, x, out, 0, n);
}

void lethe_cpu_qx_quantize_rows(lethe_cpu_isa isa, const float *x_all, const lethe_qx_rows *out,
                                int32_t r0, int32_t r1) {
    LETHE_ASSERT(0 <= r0 && r0 <= r1 && r1 <= out->n);
    const int32_t cols = out->cols, nb = cols / 32, n = r1 - r0;
    const float *x = x_all + (size_t)r0 * cols;
    /* the rows [r0, r1) of the layout (written through: out owns the scratch) */
    int16_t *q = (int16_t *)out->q + (size_t)r0 * cols;
    float *d = (float *)out->d + (size_t)r0 * nb, *s = (float *)out->s + (size_t)r0 * nb;
    if (isa >= LETHE_ISA_AVX2) {
        lethe_cpu_qx_quantize_avx2(x, n, cols, q, d, s);
        return;
    }
    for (int32_t i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * cols;
        int16_t *qr = q + (size_t)i * cols;
        for (int32_t b = 0; b < nb; b++) {
            const float *xb = xr + 32 * b;
            float amax = 0.0f;
            bool finite = true;
            for (int k = 0; k < 32; k++) {
                finite = finite && isfinite(xb[k]);
                amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
            }
            /* a non-finite x: q = 0 and a NaN scale, so the result is NaN as on
             * the f32 path (and no NaN is converted to an integer) */
            const float db = finite ? amax / 32767.0f : NAN;
            const float id = finite && amax > 0.0f ? 32767.0f / amax : 0.0f;
            int sum = 0;
            for (int k = 0; k < 32; k++) {
                const int v = finite ? (int)nearbyintf(xb[k] * id) : 0;
                qr[32 * b + k] = (int16_t)v;
                sum += v;
            }
            d[(size_t)i * nb + b] = db;
            s[(size_t)i * nb + b] = db * (float)sum;
        }
    }
}

size_t lethe_cpu_qdot_scratch_bytes(int32_t cols) {
    const size_t nb = (size_t)(cols / 32);
    return nb * (16 * QDOT_G * sizeof(int32_t) + 3 * QDOT_G * sizeof(float)) + 64;
}

/* ---- the portable twin ---- */

static float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return lethe_f16_to_f32(h);
}

/* the unit's 32 integers (fixed offsets folded in) and scales, as the
 * QK_UNIT functions of qdot_kernel.h; *mn the min (0 for formats without) */
static void decode_unit(lethe_ggml_type t, const uint8_t *row, int u, int wq[32], float *lo,
                        float *hi, float *mn) {
    switch (t) {
    case LETHE_GGML_Q4_0:
    case LETHE_GGML_Q4_1:
    case LETHE_GGML_Q5_0:
    case LETHE_GGML_Q5_1: {
        static const int bytes[] = {18, 20, 22, 24}, qoff[] = {2, 4, 6, 8}, bias[] = {8, 0, 16, 0};
        const int f = t == LETHE_GGML_Q4_0 ? 0 : t == LETHE_GGML_Q4_1 ? 1 : t == LETHE_GGML_Q5_0 ? 2 : 3;
        const uint8_t *b = row + (size_t)u * bytes[f], *qs = b + qoff[f];
        uint32_t qh = 0;
        if (f == 2) memcpy(&qh, b + 2, 4);
        if (f == 3) memcpy(&qh, b + 4, 4);
        for (int k = 0; k < 16; k++) {
            wq[k] = ((qs[k] & 0xf) | (((qh >> k) & 1) << 4)) - bias[f];
            wq[k + 16] = ((qs[k] >> 4) | (((qh >> (k + 16)) & 1) << 4)) - bias[f];
        }
        *lo = *hi = f16(b);
        *mn = f == 1 || f == 3 ? f16(b + 2) : 0.0f;
        return;
    }
    case LETHE_GGML_Q8_0: {
        const uint8_t *b = row + (size_t)u * 34;
        for (int k = 0; k < 32; k++) wq[k] = (int8_t)b[2 + k];
        *lo = *hi = f16(b), *mn = 0.0f;
        return;
    }
    case LETHE_GGML_Q4_K:
    case LETHE_GGML_Q5_K: {
        const int k5 = t == LETHE_GGML_Q5_K, s = u % 8;
        const uint8_t *b = row + (size_t)(u / 8) * (k5 ? 176 : 144);
        const uint8_t *qs = b + (k5 ? 48 : 16) + 32 * (s / 2), *h = b + 16;
        int sc, m;
        qdot_scale_min_k4(s, b + 4, &sc, &m);
        for (int k = 0; k < 32; k++)
            wq[k] = ((qs[k] >> ((s & 1) * 4)) & 0xf) | (k5 ? ((h[k] >> s) & 1) << 4 : 0);
        *lo = *hi = f16(b) * (float)sc, *mn = -(f16(b + 2) * (float)m);
        return;
    }
    case LETHE_GGML_Q6_K: {
        const int s = u % 8, n = s / 4, tq = s % 4;
        const uint8_t *b = row + (size_t)(u / 8) * 210;
        const uint8_t *ql = b + 64 * n + 32 * (tq & 1), *qh = b + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * n + 2 * tq;
        const float d = f16(b + 208);
        for (int k = 0; k < 32; k++)
            wq[k] = (((ql[k] >> ((tq >> 1) * 4)) & 0xf) | (((qh[k] >> (2 * tq)) & 3) << 4)) - 32;
        *lo = d * (float)sc[0], *hi = d * (float)sc[1], *mn = 0.0f;
        return;
    }
    default: LETHE_ASSERT(!"qdot: format without a decoder");
    }
}

/* x row i . W row `row`, in the order of qdot.h */
static float dot_c(const lethe_cpu_qweight *w, const uint8_t *row, const lethe_qx_rows *x,
                   int32_t i) {
    const int nb = x->cols / 32;
    const int split = w->type == LETHE_GGML_Q6_K;
    const int has_min = w->type == LETHE_GGML_Q4_1 || w->type == LETHE_GGML_Q5_1 ||
                        w->type == LETHE_GGML_Q4_K || w->type == LETHE_GGML_Q5_K;
    const int16_t *xq = x->q + (size_t)i * x->cols;
    const float *xd = x->d + (size_t)i * nb, *xs = x->s + (size_t)i * nb;
    float acc = 0.0f;
    for (int u = 0; u < nb; u++) {
        int wq[32];
        float lo, hi, mn;
        decode_unit(w->type, row, u, wq, &lo, &hi, &mn);
        const int16_t *xu = xq + 32 * u;
        int32_t sum[2] = {0, 0};
        for (int k = 0; k < 32; k++) sum[k / 16] += wq[k] * xu[k];
        if (!split) {
            acc = fmaf((float)(sum[0] + sum[1]), lo * xd[u], acc);
        } else {
            acc = fmaf((float)sum[0], lo * xd[u], acc);
            acc = fmaf((float)sum[1], hi * xd[u], acc);
        }
        if (has_min) acc = fmaf(mn, xs[u], acc);
    }
    return acc;
}

void lethe_cpu_qdot_rows(lethe_cpu_isa isa, const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, void *scratch) {
    LETHE_ASSERT(0 <= j0 && j0 <= j1 && j1 <= w->rows && x->cols == w->cols);
    LETHE_ASSERT(lethe_cpu_qdot_supported(w->type, w->cols));
    if (isa >= LETHE_ISA_AVX2) {
        /* wq [nb][16][QDOT_G] words, ws [nb][2][QDOT_G], wm [nb][QDOT_G] */
        const size_t nb = (size_t)(w->cols / 32);
        uint8_t *p = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
        qdot_scratch sc;
        sc.wq = (int32_t *)p, p += nb * 16 * QDOT_G * sizeof(int32_t);
        sc.ws = (float *)p, p += nb * 2 * QDOT_G * sizeof(float);
        sc.wm = (float *)p;
        if (isa >= LETHE_ISA_AVX2_VNNI) lethe_cpu_qdot_vnni(w, j0, j1, x, y, ldy, &sc);
        else lethe_cpu_qdot_avx2(w, j0, j1, x, y, ldy, &sc);
        return;
    }
    for (int32_t j = j0; j < j1; j++)
        for (int32_t i = 0; i < x->n; i++)
            y[(size_t)i * ldy + (j - j0)] = dot_c(w, w->data + (size_t)j * w->row_bytes, x, i);
}

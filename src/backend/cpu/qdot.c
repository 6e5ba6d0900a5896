/* qdot.c - matmul on stored-format weights with 16-bit activations: the
 * quantization of x, the portable C twin of the SIMD kernels
 * (qdot_kernel.h) and the tier dispatch. The design and its error bound are
 * in qdot.h; the portable twin below runs the very float operations of the
 * SIMD body (lane by lane, fmaf for the FMA, lethe_hsum8's reduction tree),
 * so every tier gives the same bits. */
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

static int32_t ns_of(int32_t cols) { return (cols / 16 + 7) / 8 * 8; }

size_t lethe_cpu_qx_bytes(int32_t n, int32_t cols) {
    const size_t q = ((size_t)n * (size_t)cols * 2 + 63) / 64 * 64;
    return q + (size_t)n * (size_t)(cols / 32 + ns_of(cols)) * sizeof(float);
}

void lethe_cpu_qx_quantize(lethe_cpu_isa isa, const float *x, int32_t n, int32_t cols,
                           void *scratch, lethe_qx_rows *out) {
    LETHE_ASSERT(n >= 0 && cols > 0 && cols % 32 == 0);
    const int32_t nb = cols / 32, ns = ns_of(cols);
    int16_t *q = scratch;
    float *d = (float *)((uint8_t *)scratch + ((size_t)n * (size_t)cols * 2 + 63) / 64 * 64);
    float *s = d + (size_t)n * nb;
    *out = (lethe_qx_rows){q, d, s, n, cols, ns};
    if (isa >= LETHE_ISA_AVX2) {
        lethe_cpu_qx_quantize_avx2(x, n, cols, q, d, s, ns);
        return;
    }
    for (int32_t i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * cols;
        int16_t *qr = q + (size_t)i * cols;
        float *sr = s + (size_t)i * ns;
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
            int sum[2] = {0, 0};
            for (int k = 0; k < 32; k++) {
                const int v = finite ? (int)nearbyintf(xb[k] * id) : 0;
                qr[32 * b + k] = (int16_t)v;
                sum[k / 16] += v;
            }
            d[(size_t)i * nb + b] = db;
            sr[2 * b] = d[(size_t)i * nb + b] * (float)sum[0];
            sr[2 * b + 1] = d[(size_t)i * nb + b] * (float)sum[1];
        }
        for (int32_t h = 2 * nb; h < ns; h++) sr[h] = 0.0f;
    }
}

size_t lethe_cpu_qdot_scratch_bytes(int32_t cols) {
    const size_t nb = (size_t)(cols / 32);
    return (size_t)QDOT_QR * ((size_t)cols * 2 + (size_t)ns_of(cols) * sizeof(float)) +
           nb * 2 * QDOT_QR * (1 + QDOT_XT_MAX) * sizeof(float) + 64;
}

/* ---- the portable twin ---- */

static float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return lethe_f16_to_f32(h);
}

/* the unit's 32 integers and scales, as qk_decode */
static void decode_unit(lethe_ggml_type t, const uint8_t *row, int u, int8_t wq[32], float *lo,
                        float *hi, float *o0, float *o1) {
    switch (t) {
    case LETHE_GGML_Q4_0:
    case LETHE_GGML_Q4_1:
    case LETHE_GGML_Q5_0:
    case LETHE_GGML_Q5_1: {
        static const int bytes[] = {18, 20, 22, 24}, qoff[] = {2, 4, 6, 8};
        const int f = t == LETHE_GGML_Q4_0 ? 0 : t == LETHE_GGML_Q4_1 ? 1 : t == LETHE_GGML_Q5_0 ? 2 : 3;
        const uint8_t *b = row + (size_t)u * bytes[f], *qs = b + qoff[f];
        uint32_t qh = 0;
        if (f == 2) memcpy(&qh, b + 2, 4);
        if (f == 3) memcpy(&qh, b + 4, 4);
        for (int k = 0; k < 16; k++) {
            wq[k] = (int8_t)((qs[k] & 0xf) | (((qh >> k) & 1) << 4));
            wq[k + 16] = (int8_t)((qs[k] >> 4) | (((qh >> (k + 16)) & 1) << 4));
        }
        *lo = *hi = f16(b);
        if (f == 1 || f == 3) *o0 = *o1 = f16(b + 2);
        else *o0 = *o1 = (f == 0 ? -8.0f : -16.0f) * *lo;
        return;
    }
    case LETHE_GGML_Q8_0: {
        const uint8_t *b = row + (size_t)u * 34;
        memcpy(wq, b + 2, 32);
        *lo = *hi = f16(b), *o0 = *o1 = 0.0f;
        return;
    }
    case LETHE_GGML_Q4_K:
    case LETHE_GGML_Q5_K: {
        const int k5 = t == LETHE_GGML_Q5_K, s = u % 8;
        const uint8_t *b = row + (size_t)(u / 8) * (k5 ? 176 : 144);
        const uint8_t *qs = b + (k5 ? 48 : 16) + 32 * (s / 2), *h = b + 16;
        int sc, mn;
        qdot_scale_min_k4(s, b + 4, &sc, &mn);
        for (int k = 0; k < 32; k++)
            wq[k] = (int8_t)(((qs[k] >> ((s & 1) * 4)) & 0xf) | (k5 ? ((h[k] >> s) & 1) << 4 : 0));
        *lo = *hi = f16(b) * (float)sc, *o0 = *o1 = -(f16(b + 2) * (float)mn);
        return;
    }
    case LETHE_GGML_Q6_K: {
        const int s = u % 8, n = s / 4, tq = s % 4;
        const uint8_t *b = row + (size_t)(u / 8) * 210;
        const uint8_t *ql = b + 64 * n + 32 * (tq & 1), *qh = b + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * n + 2 * tq;
        const float d = f16(b + 208);
        for (int k = 0; k < 32; k++)
            wq[k] = (int8_t)(((ql[k] >> ((tq >> 1) * 4)) & 0xf) | (((qh[k] >> (2 * tq)) & 3) << 4));
        *lo = d * (float)sc[0], *hi = d * (float)sc[1];
        *o0 = -32.0f * *lo, *o1 = -32.0f * *hi;
        return;
    }
    default: LETHE_ASSERT(!"qdot: format without a decoder");
    }
}

static float dot_c(const lethe_cpu_qweight *w, const uint8_t *row, const lethe_qx_rows *x,
                   int32_t i) {
    const int nb = x->cols / 32, ns = x->ns;
    const int is_signed = w->type == LETHE_GGML_Q8_0, split = w->type == LETHE_GGML_Q6_K;
    const int16_t *xq = x->q + (size_t)i * x->cols;
    const float *xd = x->d + (size_t)i * nb, *xs = x->s + (size_t)i * ns;
    float acc[8] = {0}, wo[2 * 8192 / 16 + 8];
    LETHE_ASSERT(ns <= (int)LETHE_ARRAY_LEN(wo)); /* rows up to 8192 columns on this tier */
    for (int u = 0; u < nb; u++) {
        int8_t wq[32];
        float lo, hi;
        decode_unit(w->type, row, u, wq, &lo, &hi, &wo[2 * u], &wo[2 * u + 1]);
        const int16_t *xu = xq + 32 * u;
        const float sl = lo * xd[u], sh = hi * xd[u];
        /* lane l of half c: elements 16c + 2l, 16c + 2l + 1 (vpmaddwd's pairs) */
        int iv[2][8];
        for (int c = 0; c < 2; c++)
            for (int l = 0; l < 8; l++) {
                const int k = 16 * c + 2 * l;
                const int w0 = is_signed ? wq[k] : (uint8_t)wq[k];
                const int w1 = is_signed ? wq[k + 1] : (uint8_t)wq[k + 1];
                iv[c][l] = w0 * xu[k] + w1 * xu[k + 1];
            }
        for (int l = 0; l < 8; l++) {
            if (!split) {
                acc[l] = fmaf((float)(iv[0][l] + iv[1][l]), sl, acc[l]);
            } else {
                acc[l] = fmaf((float)iv[0][l], sl, acc[l]);
                acc[l] = fmaf((float)iv[1][l], sh, acc[l]);
            }
        }
    }
    for (int h = 2 * nb; h < ns; h++) wo[h] = 0.0f;
    for (int h = 0; h < ns; h += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(wo[h + l], xs[h + l], acc[l]);
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

void lethe_cpu_qdot_rows(lethe_cpu_isa isa, const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, void *scratch) {
    LETHE_ASSERT(0 <= j0 && j0 <= j1 && j1 <= w->rows && x->cols == w->cols);
    LETHE_ASSERT(lethe_cpu_qdot_supported(w->type, w->cols));
    if (isa >= LETHE_ISA_AVX2) {
        /* QDOT_QR rows: wq [cols] int16 and wo [ns] floats each; then s4, p */
        const int32_t nb = w->cols / 32;
        uint8_t *p = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
        qdot_scratch sc;
        for (int c = 0; c < QDOT_QR; c++) {
            sc.rows[c].wq = (int16_t *)p, p += (size_t)w->cols * 2;
            sc.rows[c].wo = (float *)p, p += (size_t)x->ns * sizeof(float);
        }
        sc.s4 = (float *)p, p += (size_t)nb * 2 * QDOT_QR * sizeof(float);
        sc.p = (float *)p;
        if (isa >= LETHE_ISA_AVX2_VNNI) lethe_cpu_qdot_vnni(w, j0, j1, x, y, ldy, &sc);
        else lethe_cpu_qdot_avx2(w, j0, j1, x, y, ldy, &sc);
        return;
    }
    for (int32_t j = j0; j < j1; j++)
        for (int32_t i = 0; i < x->n; i++)
            y[(size_t)i * ldy + (j - j0)] = dot_c(w, w->data + (size_t)j * w->row_bytes, x, i);
}

/* qdot.h - matmul on stored-format weights with 16-bit activations (qdot.c).
 *
 * The default CPU path for GGUF block formats (--cpu-weights native). x rows
 * are rounded per 32-element block to 16-bit integers with one f32 scale
 * (d = max|x| / 32767, q = round(x / d)); a W block is decoded to small
 * integers plus float scales, and the dot product of a 32-element unit is an
 * exact integer sum (vpmaddwd) times the product of the two scales: integer
 * arithmetic on the weights as stored, as llama.cpp does with 8-bit
 * activations, but with 16 bits, so the rounding of x is ~256x smaller and
 * the logits stay within ~1e-4 of the f32 path. The only error is that
 * rounding:
 *   |y - x.w| <= sum over blocks b of (d_b / 2) * sum_{k in b} |w_k|
 * plus f32 rounding. Results do not depend on n, the thread count or the
 * SIMD tier (integer sums are exact and the float operations are in a fixed
 * order), so the engine's batch-invariance and prefix-reuse guarantees hold
 * within this mode.
 *
 * The float order, for W row j and x row i (every path and tier):
 *   acc = 0; for each unit u (32 elements) in order:
 *     acc = fma((float) isum_u, ws_u * d_u, acc)        (Q6_K: once per half)
 *     acc = fma(wm_u, s_u, acc)                         (formats with a min)
 *   y = acc
 * where isum_u = the exact integer dot of the unit's weight integers (a
 * fixed offset such as Q4_0's -8 is folded in: -8..7) with x's, ws_u the
 * unit's weight scale, d_u x's block scale, wm_u the unit's min (Q4_1, Q5_1,
 * Q4_K, Q5_K) and s_u = d_u * (sum of x's integers over the unit). One
 * scalar chain per (i, j), so the prefill kernel can put 16 W rows in the
 * lanes of one vector and pay one scale multiply-add per unit for all 16. */
#ifndef LETHE_BACKEND_CPU_QDOT_H
#define LETHE_BACKEND_CPU_QDOT_H

#include "backend/cpu/cpu_ops.h"

/* n rows of x, quantized: q [n, cols] int16, d [n, cols/32] block scales,
 * s [n, cols/32] = d * (sum of q over the block) */
typedef struct lethe_qx_rows {
    const int16_t *q;
    const float *d, *s;
    int32_t n, cols;
} lethe_qx_rows;

/* The prefill path decodes QDOT_G rows of W at a time into scratch, pair-
 * interleaved: for unit u and pair k (elements 2k, 2k+1 of the unit),
 *   wq [u][k][g] = int16 pair (w_2k, w_2k+1) of row g, as one 32-bit word,
 * so one 512-bit vector holds pair k of all 16 rows and vpdpwssd with the x
 * pair broadcast adds it into 16 row accumulators; ws [u][2][g] the half
 * scales (equal except for Q6_K), wm [u][g] the mins. Rows past the end
 * repeat the last row. */
#define QDOT_G 16
typedef struct qdot_scratch {
    int32_t *wq;
    float *ws, *wm;
} qdot_scratch;

/* 6-bit scale and min j (0..7) of Q4_K / Q5_K, packed in 12 bytes */
static inline void qdot_scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* the formats with a 16-bit-activation kernel (rows of a multiple of 32) */
bool lethe_cpu_qdot_supported(lethe_ggml_type t, int32_t cols);
/* x [n, cols] f32 -> *out, in caller scratch of lethe_cpu_qx_bytes(n, cols) bytes */
size_t lethe_cpu_qx_bytes(int32_t n, int32_t cols);
void lethe_cpu_qx_quantize(lethe_cpu_isa isa, const float *x, int32_t n, int32_t cols,
                           void *scratch, lethe_qx_rows *out);
/* the same in two steps, so threads can share the rows: *out laid out in
 * scratch for x [n, cols], then rows [r0, r1) of x quantized into it */
void lethe_cpu_qx_layout(int32_t n, int32_t cols, void *scratch, lethe_qx_rows *out);
void lethe_cpu_qx_quantize_rows(lethe_cpu_isa isa, const float *x, const lethe_qx_rows *out,
                                int32_t r0, int32_t r1);
/* scratch for QDOT_G decoded rows of `cols` and their scales */
size_t lethe_cpu_qdot_scratch_bytes(int32_t cols);
/* y[i*ldy + j - j0] = x row i . W row j for i < x->n, j in [j0, j1) */
void lethe_cpu_qdot_rows(lethe_cpu_isa isa, const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, void *scratch);
/* the same with AVX2 (qdot_avx2.c): identical integers and scales */
void lethe_cpu_qx_quantize_avx2(const float *x, int32_t n, int32_t cols, int16_t *q, float *d,
                                float *s);
/* the tiers (qdot_avx2.c, qdot_vnni.c); scratch set up by qdot.c */
void lethe_cpu_qdot_avx2(const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, qdot_scratch *scratch);
void lethe_cpu_qdot_vnni(const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, qdot_scratch *scratch);

#endif /* LETHE_BACKEND_CPU_QDOT_H */

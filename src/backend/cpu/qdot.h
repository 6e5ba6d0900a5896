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
 * within this mode. */
#ifndef LETHE_BACKEND_CPU_QDOT_H
#define LETHE_BACKEND_CPU_QDOT_H

#include "backend/cpu/cpu_ops.h"

#define QDOT_QR 4 /* rows of W decoded at a time */

/* n rows of x, quantized: q [n, cols] int16, d [n, cols/32] block scales,
 * s [n, ns] = d * (sum of q over each 16-element half block), zero-padded to
 * ns = round_up(cols / 16, 8) */
typedef struct lethe_qx_rows {
    const int16_t *q;
    const float *d, *s;
    int32_t n, cols, ns;
} lethe_qx_rows;

/* One decoded W row, per 32-element unit u (nb = cols / 32 units):
 *   wq [32u .. 32u+31]  the unit's integers (0..63; Q8_0: -128..127);
 *   (s4 of qdot_scratch: the scales of its halves, elements 0-15, 16-31;
 *                       equal except for Q6_K);
 *   wo [2u], [2u+1]     the offset coefficient of each half (the m of Q4_1,
 *                       -8 d of Q4_0, ...), zero-padded to ns.
 * So w_k = ws_h * wq_k + wo_h over each half h, and
 *   x.w = sum_u sum_h (int(wq_h . xq_h) * ws_h * d_x) + sum_h wo_h * s_h,
 * where the two halves' integers are summed first when ws_0 == ws_1 by format. */
typedef struct qdot_row {
    int16_t *wq;
    float *wo;
} qdot_row;

#define QDOT_XT_MAX 4 /* x rows per register tile, at most (qdot_kernel.h) */

/* The kernels' scratch (lethe_cpu_qdot_scratch_bytes): QDOT_QR decoded W
 * rows; their half scales unit-major, s4 [nb][2][QDOT_QR]; and p [nb][2]
 * [QDOT_XT_MAX][QDOT_QR], those scales times the block scales of the x rows
 * of the current tile */
typedef struct qdot_scratch {
    qdot_row rows[QDOT_QR];
    float *s4, *p;
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
/* scratch for QDOT_QR decoded rows of `cols` and the tile scales */
size_t lethe_cpu_qdot_scratch_bytes(int32_t cols);
/* y[i*ldy + j - j0] = x row i . W row j for i < x->n, j in [j0, j1) */
void lethe_cpu_qdot_rows(lethe_cpu_isa isa, const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, void *scratch);
/* the same with AVX2 (qdot_avx2.c): identical integers and scales */
void lethe_cpu_qx_quantize_avx2(const float *x, int32_t n, int32_t cols, int16_t *q, float *d,
                                float *s, int32_t ns);
/* the tiers (qdot_avx2.c, qdot_vnni.c); scratch: QDOT_QR rows set up by qdot.c */
void lethe_cpu_qdot_avx2(const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, qdot_scratch *scratch);
void lethe_cpu_qdot_vnni(const lethe_cpu_qweight *w, int32_t j0, int32_t j1,
                         const lethe_qx_rows *x, float *y, int32_t ldy, qdot_scratch *scratch);

#endif /* LETHE_BACKEND_CPU_QDOT_H */

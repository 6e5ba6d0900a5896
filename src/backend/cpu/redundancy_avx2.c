/* redundancy_avx2.c - key_redundancy's pairwise pass (redundancy.c) with
 * AVX2/FMA: compiled with -mavx2 -mfma, called only when cpu_isa.c found them
 * working (LETHE_CPU_ISA=scalar keeps the portable path).
 *
 * Bit-identical to the portable path: lane t of a vector is key j = 8b + t,
 * its dot product one fused multiply-add chain over d in increasing order
 * (the scalar fmaf chain), c = dot / (|k_i| |k_j|) in float, and the double
 * sum of row i kept in 8 lanes by j mod 8 (the portable path sums into the
 * same 8 lanes) combined in one fixed order. Keys come packed into blocks
 * of 8: kt [np / 8][D][8] (np = n rounded up to 8, zero padding), so a
 * vector is one load and one block's D vectors are contiguous (a [D][np]
 * transpose put each d of a block 4 * np bytes apart: D streams, a TLB
 * page each, and a third of the FMA rate at 4K keys); four rows share each
 * load. */
#include <immintrin.h>

#include "backend/cpu/cpu_ops.h"

void lethe_cpu_redundancy_pack_avx2(const float *kc, const int32_t *slots, size_t stride, size_t head_off,
                                    int32_t n, int D, float *kt, int32_t np, float *nrm) {
    for (int32_t j = 0; j < np; j++) {
        const float *k = j < n ? kc + (size_t)slots[j] * stride + head_off : NULL;
        float *blk = kt + (size_t)(j / 8) * D * 8 + (j % 8);
        for (int d = 0; d < D; d++) blk[(size_t)d * 8] = k ? k[d] : 0.0f;
    }
    for (int32_t j = 0; j < np; j += 8) { /* |k_j| + 1e-8: the fmaf chain of k_j . k_j, then sqrtf */
        const float *blk = kt + (size_t)(j / 8) * D * 8;
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 x = _mm256_loadu_ps(blk + (size_t)d * 8);
            acc = _mm256_fmadd_ps(x, x, acc);
        }
        _mm256_storeu_ps(nrm + j, _mm256_add_ps(_mm256_sqrt_ps(acc), _mm256_set1_ps(1e-8f)));
    }
}

/* one 8-key block's cosines c = dot / (|k_i| |k_j|) for row r into the row's
 * lane sums (j == i and padding add +0), and the largest j > i of the block
 * with c > threshold as the row's newest near-copy so far */
static inline __attribute__((always_inline)) void block_epilogue(__m256 dot, __m256 ni, __m256 nj, __m256 jv,
                                                                 __m256 valid, int32_t i, int32_t jb, __m256 thr,
                                                                 __m256d *lo, __m256d *hi, int32_t *last,
                                                                 float *clast) {
    const __m256 iv = _mm256_set1_ps((float)i);
    __m256 c = _mm256_div_ps(dot, _mm256_mul_ps(ni, nj));
    const __m256 keep = _mm256_and_ps(valid, _mm256_cmp_ps(jv, iv, _CMP_NEQ_OQ));
    c = _mm256_and_ps(c, keep);
    *lo = _mm256_add_pd(*lo, _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
    *hi = _mm256_add_pd(*hi, _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)));
    const __m256 near = _mm256_and_ps(_mm256_and_ps(keep, _mm256_cmp_ps(jv, iv, _CMP_GT_OQ)),
                                      _mm256_cmp_ps(c, thr, _CMP_GT_OQ));
    const int mask = _mm256_movemask_ps(near);
    if (mask) { /* the largest such j of this block (later blocks overwrite) */
        const int t = 31 - __builtin_clz((unsigned)mask);
        float cs[8];
        _mm256_storeu_ps(cs, c);
        *last = jb + t, *clast = cs[t];
    }
}

/* rows i0 .. i0 + R - 1 (R <= 4) against every key. Two key blocks at a
 * time where there are two: eight independent FMA chains instead of four
 * hide the FMA latency (each lane's chain over d is unchanged, and the
 * blocks reach the lane sums in key order, so the bits are the same). */
static inline __attribute__((always_inline)) void rows_r(const float *const *ki, int R, int32_t i0,
                                                         const float *kt, int32_t np, int32_t n, int D,
                                                         const float *nrm, float threshold, double *sum,
                                                         int32_t *last, float *clast) {
    __m256d lo[4], hi[4];
    __m256 ni[4];
    for (int r = 0; r < R; r++) {
        lo[r] = hi[r] = _mm256_setzero_pd();
        ni[r] = _mm256_set1_ps(nrm[i0 + r]);
        last[i0 + r] = -1;
    }
    const __m256 thr = _mm256_set1_ps(threshold), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 nf = _mm256_set1_ps((float)n);
    int32_t jb = 0;
    for (; jb + 16 <= np; jb += 16) {
        const float *b0 = kt + (size_t)(jb / 8) * D * 8, *b1 = b0 + (size_t)D * 8;
        __m256 a0[4], a1[4];
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 x0 = _mm256_loadu_ps(b0 + (size_t)d * 8), x1 = _mm256_loadu_ps(b1 + (size_t)d * 8);
            for (int r = 0; r < R; r++) {
                const __m256 q = _mm256_broadcast_ss(ki[r] + d);
                a0[r] = _mm256_fmadd_ps(q, x0, a0[r]);
                a1[r] = _mm256_fmadd_ps(q, x1, a1[r]);
            }
        }
        /* lanes j: valid j < n (exact below 2^24 keys) */
        const __m256 jv0 = _mm256_add_ps(_mm256_set1_ps((float)jb), lane);
        const __m256 jv1 = _mm256_add_ps(_mm256_set1_ps((float)(jb + 8)), lane);
        const __m256 v0 = _mm256_cmp_ps(jv0, nf, _CMP_LT_OQ), v1 = _mm256_cmp_ps(jv1, nf, _CMP_LT_OQ);
        const __m256 nj0 = _mm256_loadu_ps(nrm + jb), nj1 = _mm256_loadu_ps(nrm + jb + 8);
        for (int r = 0; r < R; r++) {
            block_epilogue(a0[r], ni[r], nj0, jv0, v0, i0 + r, jb, thr, &lo[r], &hi[r], &last[i0 + r],
                           &clast[i0 + r]);
            block_epilogue(a1[r], ni[r], nj1, jv1, v1, i0 + r, jb + 8, thr, &lo[r], &hi[r], &last[i0 + r],
                           &clast[i0 + r]);
        }
    }
    for (; jb < np; jb += 8) {
        const float *blk = kt + (size_t)(jb / 8) * D * 8;
        __m256 acc[4];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 x = _mm256_loadu_ps(blk + (size_t)d * 8);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(ki[r] + d), x, acc[r]);
        }
        const __m256 jv = _mm256_add_ps(_mm256_set1_ps((float)jb), lane);
        const __m256 valid = _mm256_cmp_ps(jv, nf, _CMP_LT_OQ), nj = _mm256_loadu_ps(nrm + jb);
        for (int r = 0; r < R; r++)
            block_epilogue(acc[r], ni[r], nj, jv, valid, i0 + r, jb, thr, &lo[r], &hi[r], &last[i0 + r],
                           &clast[i0 + r]);
    }
    for (int r = 0; r < R; r++) { /* lanes (0..3) + (4..7), then ((0+4)+(2+6)) + ((1+5)+(3+7)) */
        double l[4];
        _mm256_storeu_pd(l, _mm256_add_pd(lo[r], hi[r]));
        sum[i0 + r] = (l[0] + l[2]) + (l[1] + l[3]);
    }
}

void lethe_cpu_redundancy_rows_avx2(const float *kc, const int32_t *slots, size_t stride, size_t head_off,
                                    const float *kt, int32_t np, int32_t n, int D, const float *nrm,
                                    float threshold, int32_t i0, int32_t i1, double *sum, int32_t *last,
                                    float *clast) {
    const float *ki[4];
    int32_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        for (int r = 0; r < 4; r++) ki[r] = kc + (size_t)slots[i + r] * stride + head_off;
        rows_r(ki, 4, i, kt, np, n, D, nrm, threshold, sum, last, clast);
    }
    for (; i < i1; i++) {
        ki[0] = kc + (size_t)slots[i] * stride + head_off;
        rows_r(ki, 1, i, kt, np, n, D, nrm, threshold, sum, last, clast);
    }
}

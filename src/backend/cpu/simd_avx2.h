/* simd_avx2.h - helpers shared by the AVX2 kernel files (matmul_avx2.c,
 * qmatmul_avx2.c); include only from files compiled with -mavx2 -mfma. */
#ifndef LETHE_BACKEND_CPU_SIMD_AVX2_H
#define LETHE_BACKEND_CPU_SIMD_AVX2_H

#include <immintrin.h>

/* Fixed-order horizontal sum of the 8 lanes: ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)),
 * the reduction of the f32 GEMM's order (matmul.c). */
static inline float lethe_hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);           /* l0+l4, l1+l5, l2+l6, l3+l7 */
    __m128 sh = _mm_movehl_ps(lo, lo); /* l2+l6, l3+l7 */
    lo = _mm_add_ps(lo, sh);           /* (0+4)+(2+6), (1+5)+(3+7) */
    sh = _mm_shuffle_ps(lo, lo, 1);
    lo = _mm_add_ss(lo, sh);
    return _mm_cvtss_f32(lo);
}

#endif /* LETHE_BACKEND_CPU_SIMD_AVX2_H */

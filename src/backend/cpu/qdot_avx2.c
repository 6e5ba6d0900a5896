/* qdot_avx2.c - the 16-bit-activation matmul on AVX2 (qdot_kernel.h):
 * vpmaddwd multiplies 16-bit pairs and sums each pair into 32 bits, exact
 * (|w| <= 128, |x| <= 32767: a unit's 32 products stay below 2^31). */
#define QDOT_NAME lethe_cpu_qdot_avx2
#define QDOT_ZMM 0
#define QDOT_DOT1(w, x) _mm256_madd_epi16((w), (x))
#define QDOT_DOT2(wl, xl, wh, xh) _mm256_add_epi32(_mm256_madd_epi16((wl), (xl)), _mm256_madd_epi16((wh), (xh)))
#include "backend/cpu/qdot_kernel.h"

#include <math.h>

/* x rows -> 16 bits (qdot.c's lethe_cpu_qx_quantize, the same integers and
 * scales): max |x| per block, d = max / 32767, q = round-to-nearest-even(x *
 * (32767 / max)), with the portable code's handling of zero and non-finite blocks */
void lethe_cpu_qx_quantize_avx2(const float *x, int32_t n, int32_t cols, int16_t *q, float *d,
                                float *s) {
    const int32_t nb = cols / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    for (int32_t i = 0; i < n; i++) {
        const float *xr = x + (size_t)i * cols;
        int16_t *qr = q + (size_t)i * cols;
        float *dr = d + (size_t)i * nb, *sr = s + (size_t)i * nb;
        for (int32_t b = 0; b < nb; b++) {
            __m256 v[4], mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                v[k] = _mm256_loadu_ps(xr + 32 * b + 8 * k);
                const __m256 a = _mm256_and_ps(v[k], absmask);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* inf or NaN */
                mx = _mm256_max_ps(mx, a);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float amax = _mm_cvtss_f32(m4);
            const bool finite = _mm256_movemask_ps(bad) == 0;
            const float db = finite ? amax / 32767.0f : NAN;
            const float id = finite && amax > 0.0f ? 32767.0f / amax : 0.0f;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i iq[4];
            for (int k = 0; k < 4; k++)
                iq[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], idv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            /* the block's sum (exact) */
            const __m256i h = _mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]),
                                               _mm256_add_epi32(iq[2], iq[3]));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
            /* 32 int32 -> 32 int16 (|q| <= 32767: no saturation), in element order */
            const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iq[0], iq[1]), 0xd8);
            const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iq[2], iq[3]), 0xd8);
            _mm256_storeu_si256((__m256i *)(qr + 32 * b), p01);
            _mm256_storeu_si256((__m256i *)(qr + 32 * b + 16), p23);
            dr[b] = db;
            sr[b] = db * (float)_mm_cvtsi128_si32(t);
        }
    }
}

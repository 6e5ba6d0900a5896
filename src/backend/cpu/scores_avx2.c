/* scores_avx2.c - the row-max probability path of attn_scores (scores.c) with
 * AVX2/FMA: compiled with -mavx2 -mfma, called only when cpu_isa.c found them
 * working (LETHE_CPU_ISA=scalar keeps the scalar path).
 *
 * LETHE_SCORES_PROB_MAX | ROW_MAX without CAND_DENOM (KVzip's replay scores,
 * the prefix pruning of engine_prune.c): for query head h and every scored
 * row i, p(i, e) = softmax over the visible keys [0, lim_i] of the raw scores,
 * and v[e] = max over rows of p(i, e) for the candidates. Work per row: the
 * n_keys raw scores and one exp per key, which is where the scalar reference
 * spends its time (two double exp per key and libm's fmaf per multiply).
 *
 * Arithmetic: a raw score is the scalar path's value bit for bit (one fused
 * multiply-add chain over d in increasing order, lane e of the vector is key
 * e, then * scale); the exponentials are float (a Cody-Waite reduction and a
 * degree-6 polynomial, within 2 ulp of expf on [-87, 0], 0 below), the
 * denominator a float sum of 8 lanes in a fixed order. So v agrees with the
 * scalar path's double arithmetic within ~1e-6 relative (test_attn_scores
 * checks every mode against a float64 oracle within 1e-5), not bit for bit. */
#include <immintrin.h>
#include <math.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd_avx2.h"
#include "core/util.h"

/* exp(x) for x <= 0 (lanes below -87.3 give 0) */
static inline __m256 exp_neg_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2 in two steps (ln2 = 0.693359375 - 2.12194440e-4) */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* raw[e] = scale * (fmaf chain over d of q[d] k_e[d]) for e in [0, n): keys
 * kc + off[e] (float offsets), 8 keys per vector (also scores.c's raw scores
 * of every other mode: the same bits as its scalar chain) */
void lethe_cpu_scores_raw_avx2(const float *q, const float *kc, const int32_t *off, int32_t n, int D,
                               float scale, float *raw) {
    int32_t e = 0;
    for (; e + 8 <= n; e += 8) {
        const __m256i idx = _mm256_loadu_si256((const __m256i *)(off + e));
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < D; d++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), _mm256_i32gather_ps(kc + d, idx, 4), acc);
        _mm256_storeu_ps(raw + e, _mm256_mul_ps(acc, _mm256_set1_ps(scale)));
    }
    for (; e < n; e++) {
        const float *k = kc + off[e];
        float acc = 0.0f;
        for (int d = 0; d < D; d++) acc = fmaf(q[d], k[d], acc);
        raw[e] = acc * scale;
    }
}

void lethe_cpu_scores_rowmax_avx2(const float *qh, size_t q_stride, int32_t n_rows,
                                  const float *kc, const int32_t *off, int32_t n_keys, int D,
                                  float scale, int32_t c0, int32_t c1, float *raw, float *v) {
    for (int32_t j = 0; j < c1 - c0; j++) v[j] = 0.0f;
    for (int32_t i = 0; i < n_rows; i++) {
        const int32_t n = n_keys - n_rows + i + 1; /* visible keys [0, n) */
        const int32_t vc1 = LETHE_MIN(c1, n);
        if (n <= 0 || vc1 <= c0) continue;
        lethe_cpu_scores_raw_avx2(qh + (size_t)i * q_stride, kc, off, n, D, scale, raw);
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int32_t e = 0;
        for (; e + 8 <= n; e += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(raw + e));
        float m = -INFINITY;
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int t = 0; t < 8; t++) m = lanes[t] > m ? lanes[t] : m;
        for (; e < n; e++) m = raw[e] > m ? raw[e] : m;
        if (m == -INFINITY) continue;
        const __m256 mm = _mm256_set1_ps(m);
        __m256 lv = _mm256_setzero_ps();
        for (e = 0; e + 8 <= n; e += 8) {
            const __m256 x = exp_neg_ps(_mm256_sub_ps(_mm256_loadu_ps(raw + e), mm));
            _mm256_storeu_ps(raw + e, x);
            lv = _mm256_add_ps(lv, x);
        }
        float l = lethe_hsum8(lv);
        for (; e < n; e++) { /* the tail through the same polynomial, lane 0 */
            const float x = _mm256_cvtss_f32(exp_neg_ps(_mm256_set1_ps(raw[e] - m)));
            raw[e] = x;
            l += x;
        }
        const float inv = 1.0f / l;
        for (int32_t t = c0; t < vc1; t++) {
            const float p = raw[t] * inv;
            if (p > v[t - c0]) v[t - c0] = p;
        }
    }
}

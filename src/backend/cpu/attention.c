/* attention.c - KV store and attention over a slot selection (CPU backend).
 *
 * kv_store: k_cache[slots[i], :] = k[i, :] (same for v); rows of kv_dim.
 *
 * attention (see lethe_attn_args in backend.h): for sequence s with query
 * rows [q_begin[s], q_begin[s+1]) (n_q of them) and selection entries
 * sel_slots[sel_begin[s] .. sel_begin[s+1]) (n_sel of them, the last n_q are
 * the new tokens in order), query j of the sequence and head h attends to
 * entries e in [0, n_sel - n_q + j]:
 *   score[e] = scale * q[row, h, :] . K[sel[e], h / (n_heads/n_kv_heads), :]
 *   out[row, h, :] = sum_e softmax(score)[e] * V[sel[e], kv head, :]
 * The softmax is the numerically stable one in fp32, computed online over
 * blocks of ATT_BLOCK entries (running max m, running sum l; when the max
 * grows, l and the output accumulator are rescaled by exp(m_old - m_new)),
 * so no scratch memory grows with the selection length.
 *
 * Work item = (query row, kv head): the group of n_heads/n_kv_heads query
 * heads sharing a KV head reads each K/V row once. Items are independent and
 * each walks its entries in the same order regardless of the batch or thread
 * count, so outputs are deterministic. With a->scores set, scale*q.k is also
 * written (host float [n_heads, n_tokens, score_stride]) for entries
 * [0, limit] and -INF for entries (limit, n_sel); entries from n_sel to
 * score_stride are left untouched. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define ATT_BLOCK 32       /* selection entries per online-softmax block */
#define ATT_GROUP_MAX 32   /* query heads per KV head */
#define ATT_HEAD_DIM_MAX 512

void lethe_cpu_kv_store(lethe_backend *be, void *k_cache, void *v_cache, const void *k,
                        const void *v, const int32_t *slots, int32_t n, int32_t kv_dim) {
    float *kc = k_cache, *vc = v_cache;
    const float *kk = k, *vv = v;
    const size_t row = (size_t)kv_dim * sizeof(float);
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(slots[i] >= 0);
        memcpy(kc + (size_t)slots[i] * kv_dim, kk + (size_t)i * kv_dim, row);
        memcpy(vc + (size_t)slots[i] * kv_dim, vv + (size_t)i * kv_dim, row);
    }
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float s = hsum8(acc);
    for (; k < n; k++) s = fmaf(a[k], b[k], s);
    return s;
}

/* o[0..n) = o * c + p * v */
static inline void scale_axpy(float *o, float c, float p, const float *v, int n) {
    __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 ov = _mm256_mul_ps(_mm256_loadu_ps(o + k), cv);
        _mm256_storeu_ps(o + k, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + k), ov));
    }
    for (; k < n; k++) o[k] = fmaf(p, v[k], o[k] * c);
}

/* Sequence of batch row i (q_begin is ascending; few sequences per step). */
static int seq_of_row(const lethe_attn_args *a, int32_t i) {
    int lo = 0, hi = a->n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (a->q_begin[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* One work item: query row i, KV head g, its G query heads. */
static void attend_item(const lethe_attn_args *a, int32_t i, int g) {
    const int G = a->n_heads / a->n_kv_heads, hd = a->head_dim;
    const size_t kv_stride = (size_t)a->n_kv_heads * hd;
    const int s = seq_of_row(a, i);
    const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
    const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
    const int32_t j = i - a->q_begin[s];
    const int32_t n_ent = n_sel - n_q + j + 1; /* causal: entries [0, n_sel - n_q + j] */
    const int32_t *sel = a->sel_slots + a->sel_begin[s];
    const float *k_cache = a->k_cache, *v_cache = a->v_cache;
    const float *q = (const float *)a->q + ((size_t)i * a->n_heads + (size_t)g * G) * hd;
    float *out = (float *)a->out + ((size_t)i * a->n_heads + (size_t)g * G) * hd;

    float m[ATT_GROUP_MAX], l[ATT_GROUP_MAX];
    float sc[ATT_GROUP_MAX][ATT_BLOCK];
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        memset(out + (size_t)h * hd, 0, (size_t)hd * sizeof(float));
    }
    for (int32_t e0 = 0; e0 < n_ent; e0 += ATT_BLOCK) {
        const int nb = LETHE_MIN(ATT_BLOCK, n_ent - e0);
        /* scores for this block */
        for (int b = 0; b < nb; b++) {
            const float *k = k_cache + (size_t)sel[e0 + b] * kv_stride + (size_t)g * hd;
            for (int h = 0; h < G; h++) sc[h][b] = a->scale * dot(q + (size_t)h * hd, k, hd);
        }
        if (a->scores)
            for (int h = 0; h < G; h++) {
                float *dst = a->scores + ((size_t)(g * G + h) * a->n_tokens + i) * a->score_stride;
                memcpy(dst + e0, sc[h], (size_t)nb * sizeof(float));
            }
        /* online softmax: new max, rescale factor, probabilities */
        float corr[ATT_GROUP_MAX];
        for (int h = 0; h < G; h++) {
            float mb = m[h];
            for (int b = 0; b < nb; b++) mb = fmaxf(mb, sc[h][b]);
            corr[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mb);
            m[h] = mb;
            float sum = 0.0f;
            for (int b = 0; b < nb; b++) {
                sc[h][b] = expf(sc[h][b] - mb);
                sum += sc[h][b];
            }
            l[h] = l[h] * corr[h] + sum;
        }
        /* accumulate V; the first entry of the block also applies the rescale */
        for (int b = 0; b < nb; b++) {
            const float *v = v_cache + (size_t)sel[e0 + b] * kv_stride + (size_t)g * hd;
            for (int h = 0; h < G; h++)
                scale_axpy(out + (size_t)h * hd, b == 0 ? corr[h] : 1.0f, sc[h][b], v, hd);
        }
    }
    for (int h = 0; h < G; h++) {
        const float inv = 1.0f / l[h];
        for (int d = 0; d < hd; d++) out[(size_t)h * hd + d] *= inv;
    }
    if (a->scores)
        for (int h = 0; h < G; h++) {
            float *dst = a->scores + ((size_t)(g * G + h) * a->n_tokens + i) * a->score_stride;
            for (int32_t e = n_ent; e < n_sel; e++) dst[e] = -INFINITY;
        }
}

void lethe_cpu_attention(lethe_backend *be, const lethe_attn_args *a) {
    LETHE_ASSERT(a->n_heads > 0 && a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0);
    LETHE_ASSERT(a->n_heads / a->n_kv_heads <= ATT_GROUP_MAX);
    LETHE_ASSERT(a->head_dim > 0 && a->head_dim <= ATT_HEAD_DIM_MAX);
    LETHE_ASSERT(a->n_seqs > 0 && a->q_begin[0] == 0 && a->q_begin[a->n_seqs] == a->n_tokens);
    for (int s = 0; s < a->n_seqs; s++) {
        int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
        int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
        LETHE_ASSERT(n_q >= 0 && n_sel >= n_q);
        LETHE_ASSERT(!a->scores || n_sel <= a->score_stride);
    }
    const int n_items = a->n_tokens * a->n_kv_heads;
    const int nt = n_items < 2 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(dynamic, 2) num_threads(nt)
    for (int it = 0; it < n_items; it++) attend_item(a, it / a->n_kv_heads, it % a->n_kv_heads);
}

/* clusters.c - key clusters on the CPU backend (RetroInfer's wave index;
 * semantics: backend.h "key clusters"; CUDA twin cuda/clusters.cu).
 *
 *   cluster_assign     out[h, e] = argmax_c (k[e, h] - mean[h]) . cent[h, c]
 *   cluster_scores     out[e] = scale * mean_{qh in group h} q[qh] . cent[ids[e]]
 *   cluster_attention  exact keys + estimated clusters under one softmax
 *
 * assign runs its dots through the backend's f32 matmul (blocks of 1024
 * keys); scores and attention dot with one left-to-right fmaf chain over
 * head_dim and sum the softmax in double; one task per (query, query head),
 * so results do not depend on the thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

static inline float dotf(const float *a, const float *b, int32_t d) {
    float s = 0.0f;
    for (int32_t i = 0; i < d; i++) s = fmaf(a[i], b[i], s);
    return s;
}

enum { ASSIGN_ROWS = 1024 };

/* per KV head: X = k - mean for blocks of keys, S = X cent_h^T through the
 * backend's f32 matmul (threads, SIMD), then the first argmax of each row */
void lethe_cpu_cluster_assign(lethe_backend *be, int32_t *out, const void *k_cache,
                              const int32_t *slots, int32_t n, const float *cent, const float *mean,
                              int32_t n_c, int32_t n_kv_heads, int32_t head_dim) {
    LETHE_ASSERT(n >= 0 && n_c >= 1 && n_kv_heads >= 1 && head_dim >= 1 && head_dim <= 256);
    if (n == 0) return;
    const float *K = k_cache;
    const int32_t hd = head_dim, rows = LETHE_MIN(n, ASSIGN_ROWS);
    float *x = lethe_xmalloc((size_t)rows * hd * sizeof(float));
    float *sc = lethe_xmalloc((size_t)rows * n_c * sizeof(float));
    for (int32_t h = 0; h < n_kv_heads; h++) {
        const float *mu = mean + (size_t)h * hd, *ch = cent + (size_t)h * n_c * hd;
        for (int32_t e0 = 0; e0 < n; e0 += rows) {
            const int32_t nb = LETHE_MIN(rows, n - e0);
            for (int32_t e = 0; e < nb; e++) {
                const float *k = K + ((size_t)slots[e0 + e] * n_kv_heads + h) * hd;
                for (int32_t i = 0; i < hd; i++) x[(size_t)e * hd + i] = k[i] - mu[i];
            }
            lethe_cpu_matmul(be, sc, x, ch, nb, n_c, hd);
            for (int32_t e = 0; e < nb; e++) {
                const float *r = sc + (size_t)e * n_c;
                int32_t best = 0;
                for (int32_t c = 1; c < n_c; c++)
                    if (r[c] > r[best]) best = c;
                out[(size_t)h * n + e0 + e] = best;
            }
        }
    }
    free(x);
    free(sc);
}

void lethe_cpu_cluster_scores(lethe_backend *be, float *out, const void *q_, const void *cent_,
                              int32_t n_q, const int32_t *q_rows, const int32_t *begin,
                              const int32_t *ids, int32_t n_heads, int32_t n_kv_heads,
                              int32_t head_dim, float scale) {
    (void)be;
    LETHE_ASSERT(n_q >= 0 && n_kv_heads >= 1 && n_heads % n_kv_heads == 0);
    const float *q = q_, *cent = cent_;
    const int32_t g = n_heads / n_kv_heads;
    for (int32_t i = 0; i < n_q; i++)
        for (int32_t h = 0; h < n_kv_heads; h++) {
            const float *qg = q + ((size_t)q_rows[i] * n_heads + (size_t)h * g) * head_dim;
            for (int32_t e = begin[i * n_kv_heads + h]; e < begin[i * n_kv_heads + h + 1]; e++) {
                const float *c = cent + (size_t)ids[e] * head_dim;
                float s = 0.0f;
                for (int32_t j = 0; j < g; j++) s += dotf(qg + (size_t)j * head_dim, c, head_dim);
                out[e] = scale * (s / (float)g);
            }
        }
}

typedef struct cattn_job {
    const lethe_cluster_attn_args *a;
} cattn_job;

/* the key / value row of exact entry x (pool slot or aux row) for KV head h */
static inline const float *xrow(const lethe_cluster_attn_args *a, int32_t x, int32_t h,
                                bool value) {
    const int32_t hd = a->head_dim;
    if (x >= 0)
        return (const float *)(value ? a->v_cache : a->k_cache) +
               ((size_t)x * a->n_kv_heads + h) * hd;
    return (const float *)(value ? a->v_aux : a->k_aux) + (size_t)(-1 - x) * hd;
}

static void cattn_task(void *ctx, int t, int worker) {
    (void)worker;
    const lethe_cluster_attn_args *a = ((const cattn_job *)ctx)->a;
    const int32_t H = a->n_heads, KH = a->n_kv_heads, hd = a->head_dim, g = H / KH;
    const int32_t i = t / H, qh = t % H, h = qh / g;
    const float *q = (const float *)a->q + ((size_t)a->q_rows[i] * H + qh) * hd;
    const float *cent = a->cent, *vsum = a->vsum, *cnt = a->count;
    const int32_t x0 = a->x_begin[i * KH + h], x1 = a->x_begin[i * KH + h + 1];
    const int32_t c0 = a->e_begin[i * KH + h], c1 = a->e_begin[i * KH + h + 1];
    LETHE_ASSERT(x1 > x0);
    /* pass 1: the max logit over both zones */
    float mx = -INFINITY;
    for (int32_t e = x0; e < x1; e++)
        mx = fmaxf(mx, a->scale * dotf(q, xrow(a, a->x_slots[e], h, false), hd));
    for (int32_t e = c0; e < c1; e++)
        mx = fmaxf(mx, a->scale * dotf(q, cent + (size_t)a->e_ids[e] * hd, hd));
    /* pass 2: numerator and denominator */
    double acc[256], den = 0.0;
    for (int32_t d = 0; d < hd; d++) acc[d] = 0.0;
    for (int32_t e = x0; e < x1; e++) {
        const double w = exp(
            (double)(a->scale * dotf(q, xrow(a, a->x_slots[e], h, false), hd) - mx));
        const float *v = xrow(a, a->x_slots[e], h, true);
        den += w;
        for (int32_t d = 0; d < hd; d++) acc[d] += w * v[d];
    }
    for (int32_t e = c0; e < c1; e++) {
        const int32_t c = a->e_ids[e];
        const double w = exp((double)(a->scale * dotf(q, cent + (size_t)c * hd, hd) - mx));
        const float *vs = vsum + (size_t)c * hd;
        den += w * cnt[c];
        for (int32_t d = 0; d < hd; d++) acc[d] += w * vs[d];
    }
    float *o = (float *)a->out + ((size_t)a->q_rows[i] * H + qh) * hd;
    for (int32_t d = 0; d < hd; d++) o[d] = (float)(acc[d] / den);
}

void lethe_cpu_cluster_attention(lethe_backend *be, const lethe_cluster_attn_args *a) {
    LETHE_ASSERT(a->n_q >= 0 && a->n_kv_heads >= 1 && a->n_heads % a->n_kv_heads == 0);
    LETHE_ASSERT(a->head_dim >= 1 && a->head_dim <= 256);
    if (a->n_q == 0) return;
    cattn_job jb = {a};
    const int64_t work = (int64_t)a->x_begin[a->n_q * a->n_kv_heads] * a->head_dim *
                         (a->n_heads / a->n_kv_heads);
    lethe_cpu_parallel(be, work < (1 << 16) ? 1 : lethe_cpu_threads(be), a->n_q * a->n_heads,
                       cattn_task, &jb);
}

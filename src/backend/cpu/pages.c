/* pages.c - Quest page bounds on the CPU backend (twin of cuda/pages.cu).
 *
 *   page_minmax  meta[page_ids[i]] = (min, max) over keys k_cache[slots[j]],
 *                j in [slot_begin[i], slot_begin[i+1])         meta [n_meta, 2, kv_dim]
 *   page_scores  out[i] = max_h sum_c max(q[h,c] min[kh,c], q[h,c] max[kh,c]), the max
 *                over all heads (n_groups 1) or per KV head (n_groups = n_kv_heads:
 *                out[g * n_s + i] for the sequence's page i, backend.h)
 *
 * These are the reference computations, written to be bit-identical to the
 * host helpers the method used before (select_util.c lethe_page_minmax_add and
 * lethe_quest_page_scores): the page starts as a copy of its first key and
 * folds the others in slot-list order with strict < / > compares, and each
 * head's bound is a left-to-right float sum over c. Each output element is
 * computed by one thread in that fixed order, so results do not depend on the
 * thread count or on which other pages / sequences share the call. */
#include <math.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

typedef struct minmax_job {
    float *meta;
    const float *K;
    const int32_t *page_ids, *slot_begin, *slots;
    size_t kd;
} minmax_job;

static void minmax_task(void *ctx, int i, int worker) {
    const minmax_job *jb = ctx;
    const size_t kd = jb->kd;
    const int32_t b = jb->slot_begin[i], e = jb->slot_begin[i + 1];
    float *mn = jb->meta + (size_t)jb->page_ids[i] * 2 * kd, *mx = mn + kd;
    const float *k0 = jb->K + (size_t)jb->slots[b] * kd;
    memcpy(mn, k0, kd * sizeof(float));
    memcpy(mx, k0, kd * sizeof(float));
    for (int32_t j = b + 1; j < e; j++) {
        const float *k = jb->K + (size_t)jb->slots[j] * kd;
        for (size_t c = 0; c < kd; c++) {
            if (k[c] < mn[c]) mn[c] = k[c];
            if (k[c] > mx[c]) mx[c] = k[c];
        }
    }
}

void lethe_cpu_page_minmax(lethe_backend *be, void *meta_, const void *k_cache_,
                           const int32_t *page_ids, const int32_t *slot_begin, const int32_t *slots,
                           int32_t n_pages, int32_t kv_dim) {
    lethe_check_page_minmax(page_ids, slot_begin, n_pages, kv_dim);
    minmax_job jb = {meta_, k_cache_, page_ids, slot_begin, slots, (size_t)kv_dim};
    int nt = (int64_t)slot_begin[n_pages] * kv_dim < 65536 ? 1 : lethe_cpu_threads(be);
    lethe_cpu_parallel(be, nt, n_pages, minmax_task, &jb);
}

typedef struct pscore_job {
    float *out;                 /* the sequence's [n_groups, n_pages] block */
    const float *q, *meta;
    const int32_t *page_ids;    /* the sequence's pages */
    int32_t n_pages, n_heads, g, head_dim, n_groups;
    size_t kd;
} pscore_job;

static void pscore_task(void *ctx, int t, int worker) {
    const pscore_job *jb = ctx;
    const int32_t head_dim = jb->head_dim, per_group = jb->n_heads / jb->n_groups;
    const float *pm = jb->meta + (size_t)jb->page_ids[t] * 2 * jb->kd;
    float best = -INFINITY;
    for (int32_t h = 0; h < jb->n_heads; h++) {
        const float *qh = jb->q + (size_t)h * head_dim;
        const float *mn = pm + (size_t)(h / jb->g) * head_dim, *mx = mn + jb->kd;
        float u = 0.0f;
        for (int32_t c = 0; c < head_dim; c++) {
            float a = qh[c] * mx[c], b = qh[c] * mn[c];
            u += a > b ? a : b;
        }
        if (u > best) best = u;
        if ((h + 1) % per_group == 0) { /* the group's last head */
            jb->out[(size_t)(h / per_group) * jb->n_pages + t] = best;
            best = -INFINITY;
        }
    }
}

void lethe_cpu_page_scores(lethe_backend *be, float *out, const void *q_, const void *meta_,
                           int32_t n_seqs, const int32_t *q_rows, const int32_t *page_begin,
                           const int32_t *page_ids, int32_t n_heads, int32_t n_kv_heads,
                           int32_t head_dim, int32_t n_groups, bool out_on_backend) {
    (void)out_on_backend; /* backend memory is host memory here */
    lethe_check_page_scores(n_seqs, page_begin, n_heads, n_kv_heads, n_groups);
    const float *Q = q_, *meta = meta_;
    const int32_t g = n_heads / n_kv_heads;
    const size_t kd = (size_t)n_kv_heads * head_dim, qd = (size_t)n_heads * head_dim;
    int nt = (int64_t)page_begin[n_seqs] * n_heads * head_dim < 65536 ? 1 : lethe_cpu_threads(be);
    for (int32_t s = 0; s < n_seqs; s++) {
        const int32_t n = page_begin[s + 1] - page_begin[s];
        pscore_job jb = {out + (size_t)n_groups * page_begin[s], Q + (size_t)q_rows[s] * qd, meta,
                         page_ids + page_begin[s], n, n_heads, g, head_dim, n_groups, kd};
        lethe_cpu_parallel(be, nt, n, pscore_task, &jb);
    }
}

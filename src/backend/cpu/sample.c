/* sample.c - the `sample` op on the CPU, and the row function that defines
 * sampling for the whole engine (backend/sample.h states the definition;
 * engine/sampler.c calls lethe_sample_row_f32 for host-side sampling).
 *
 * Row algorithm (V = n_vocab, c = candidates that need an order):
 *   penalised copy l [V]; argmax by (key desc, id asc) -> greedy answer;
 *   q [V] fixed-point weights and their total Q;
 *   top-k: a size-k heap over the rank order, O(V log k), then sorted;
 *   top-p without top-k: candidates = {l >= theta} for theta at weight
 *     levels 1e-3, 1e-5, 1e-7, then everything, until their mass reaches
 *     top_p (a logit threshold set is always a prefix of the rank order, so
 *     the nucleus found inside it is the nucleus of the full order), sorted;
 *   top-p walk, min-p filter, kept ids sorted ascending, integer draw.
 * Without top-k / top-p the draw walks all V ids. Every sum is an integer,
 * so this equals the CUDA kernel's radix-select formulation exactly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/sample.h"
#include "core/util.h"

/* a ranks before b: larger key (logit), then smaller id */
static inline bool ranks_before(uint32_t ka, int32_t a, uint32_t kb, int32_t b) {
    return ka > kb || (ka == kb && a < b);
}

static int cmp_rank(const void *x, const void *y, void *ctx) {
    const float *l = ctx;
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    uint32_t ka = lethe_sample_key(l[a]), kb = lethe_sample_key(l[b]);
    if (ka != kb) return ka > kb ? -1 : 1;
    return (a > b) - (a < b);
}

static int cmp_id(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

/* the k first ids of the rank order into idx[0..k), sorted by rank */
static int32_t select_top_k(const float *l, int32_t V, int32_t k, int32_t *idx) {
    int32_t n = 0; /* min-heap on rank: idx[0] is the worst kept */
#define KEY(j) lethe_sample_key(l[idx[j]])
    for (int32_t i = 0; i < V; i++) {
        const uint32_t ki = lethe_sample_key(l[i]);
        if (n == k) {
            if (!ranks_before(ki, i, KEY(0), idx[0])) continue;
            idx[0] = i;
            for (int32_t j = 0;;) {
                int32_t c = 2 * j + 1;
                if (c >= n) break;
                if (c + 1 < n && ranks_before(KEY(c), idx[c], KEY(c + 1), idx[c + 1])) c++;
                if (!ranks_before(KEY(j), idx[j], KEY(c), idx[c])) break;
                int32_t t = idx[j]; idx[j] = idx[c]; idx[c] = t;
                j = c;
            }
        } else {
            int32_t j = n++;
            idx[j] = i;
            while (j > 0) {
                int32_t pa = (j - 1) / 2;
                if (!ranks_before(KEY(pa), idx[pa], KEY(j), idx[j])) break;
                int32_t t = idx[j]; idx[j] = idx[pa]; idx[pa] = t;
                j = pa;
            }
        }
    }
#undef KEY
    qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_rank, (void *)l);
    return n;
}

/* the non-greedy draw over the penalised row l (max m) */
static int32_t draw(const float *l, int32_t V, const lethe_sample_row *p, float m,
                    lethe_sample_scratch *s) {
    uint64_t *q = s->q;
    int32_t *idx = s->idx;
    const double inv_t = 1.0 / (double)p->temperature;
    uint64_t Q = 0;
    for (int32_t i = 0; i < V; i++) Q += q[i] = lethe_sample_q(l[i], m, inv_t);
    const uint64_t pnum = lethe_sample_pnum(p->top_p);
    const uint64_t qmin = p->min_p > 0.0f ? lethe_sample_qmin(p->min_p) : 0;
    const bool top_k = p->top_k > 0 && p->top_k < V, top_p = pnum < ((uint64_t)1 << 32);
    const uint64_t bits = lethe_sample_bits(p->seed, p->draw);
    if (!top_k && !top_p) { /* every id, in id order */
        uint64_t qs = 0;
        for (int32_t i = 0; i < V; i++)
            if (q[i] >= qmin) qs += q[i];
        const uint64_t t = lethe_sample_mulhi(bits, qs);
        uint64_t cum = 0;
        for (int32_t i = 0; i < V; i++)
            if (q[i] >= qmin && (cum += q[i]) > t) return i;
        LETHE_ASSERT(!"sample: walk ran past the total");
    }
    int32_t n = 0;
    if (top_k) {
        n = select_top_k(l, V, p->top_k, idx);
        Q = 0;
        for (int32_t c = 0; c < n; c++) Q += q[idx[c]];
    } else { /* top-p: a logit-threshold prefix whose mass reaches top_p */
        static const double levels[] = {1e-3, 1e-5, 1e-7};
        for (size_t t = 0; t <= LETHE_ARRAY_LEN(levels); t++) {
            const bool all = t == LETHE_ARRAY_LEN(levels);
            const uint32_t kth = all ? 0 : lethe_sample_key((float)(m + p->temperature * log(levels[t])));
            uint64_t mass = 0;
            n = 0;
            for (int32_t i = 0; i < V; i++)
                if (lethe_sample_key(l[i]) >= kth) idx[n++] = i, mass += q[i];
            if (all || lethe_sample_ge_scaled(mass, Q, pnum)) break;
        }
        qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_rank, (void *)l);
    }
    if (top_p) { /* shortest rank prefix (>= 1) reaching top_p of Q */
        uint64_t cum = 0;
        int32_t k = 0;
        do cum += q[idx[k++]];
        while (k < n && !lethe_sample_ge_scaled(cum, Q, pnum));
        n = k;
    }
    int32_t kept = 0;
    uint64_t qs = 0;
    for (int32_t c = 0; c < n; c++)
        if (q[idx[c]] >= qmin && q[idx[c]] > 0) qs += q[idx[c]], idx[kept++] = idx[c];
    qsort(idx, (size_t)kept, sizeof(int32_t), cmp_id);
    const uint64_t t = lethe_sample_mulhi(bits, qs);
    uint64_t cum = 0;
    for (int32_t c = 0; c < kept; c++)
        if ((cum += q[idx[c]]) > t) return idx[c];
    LETHE_ASSERT(!"sample: walk ran past the total");
    return idx[0];
}

float lethe_sample_logprob_f32(const float *raw, int32_t V, int32_t token) {
    float m = raw[0];
    for (int32_t i = 1; i < V; i++) m = fmaxf(m, raw[i]);
    double sum = 0;
    for (int32_t i = 0; i < V; i++) sum += exp((double)raw[i] - m);
    const double lse = m + log(sum);
    return (float)(raw[token] - lse);
}

int32_t lethe_sample_row_f32(const float *raw, int32_t V, const lethe_sample_row *p,
                             const int32_t *pen_ids, const int32_t *pen_counts, const uint32_t *mask,
                             lethe_sample_scratch *s, float *logprob) {
    LETHE_ASSERT(V > 0);
    float *l = s->l;
    memcpy(l, raw, (size_t)V * sizeof(float));
    if (mask)
        for (int32_t i = 0; i < V; i++)
            if (!lethe_sample_mask_allows(mask, i)) l[i] = -INFINITY;
    for (int32_t e = p->pen_begin; e < p->pen_begin + p->n_pen; e++) {
        const int32_t t = pen_ids[e];
        LETHE_ASSERT(t >= 0 && t < V);
        l[t] = lethe_sample_penalise(l[t], pen_counts[e], p);
    }
    int32_t best = 0;
    uint32_t kb = lethe_sample_key(l[0]);
    for (int32_t i = 1; i < V; i++) {
        const uint32_t k = lethe_sample_key(l[i]);
        if (k > kb) kb = k, best = i; /* strict: the smallest id wins ties */
    }
    int32_t tok = best;
    if (!lethe_sample_is_greedy(p) && isfinite(l[best])) tok = draw(l, V, p, l[best], s);
    if (logprob) *logprob = lethe_sample_logprob_f32(raw, V, tok);
    return tok;
}

/* ---- the op ---------------------------------------------------------------- */

static void scratch_reserve(lethe_cpu_ctx *c, int n, int32_t V) {
    if (n <= c->n_sample && V <= c->sample_vocab) return;
    lethe_cpu_sample_free(c);
    c->sample = lethe_xcalloc((size_t)n, sizeof(lethe_sample_scratch));
    for (int i = 0; i < n; i++) {
        c->sample[i].l = lethe_xmalloc((size_t)V * sizeof(float));
        c->sample[i].q = lethe_xmalloc((size_t)V * sizeof(uint64_t));
        c->sample[i].idx = lethe_xmalloc((size_t)V * sizeof(int32_t));
    }
    c->n_sample = n;
    c->sample_vocab = V;
}

void lethe_cpu_sample_free(lethe_cpu_ctx *c) {
    for (int i = 0; i < c->n_sample; i++) {
        free(c->sample[i].l);
        free(c->sample[i].q);
        free(c->sample[i].idx);
    }
    free(c->sample);
    c->sample = NULL;
    c->n_sample = 0;
    c->sample_vocab = 0;
}

typedef struct sample_job {
    const lethe_sample_args *a;
    lethe_cpu_ctx *c;
} sample_job;

static void sample_task(void *ctx, int i, int worker) {
    const sample_job *j = ctx;
    const lethe_sample_args *a = j->a;
    const lethe_sample_row *p = &a->rows[i];
    const uint32_t *mask =
        p->mask_row ? a->mask + (size_t)(p->mask_row - 1) * (size_t)lethe_sample_mask_words(a->n_vocab) : NULL;
    const float *logits = a->logits;
    a->tokens[i] = lethe_sample_row_f32(logits + (size_t)i * (size_t)a->n_vocab, a->n_vocab, p,
                                        a->pen_ids, a->pen_counts, mask, &j->c->sample[worker],
                                        a->logprobs ? &a->logprobs[i] : NULL);
}

void lethe_cpu_sample(lethe_backend *be, const lethe_sample_args *a) {
    lethe_check_sample(a);
    if (a->n == 0) return;
    lethe_cpu_ctx *c = be->ctx;
    const int nt = LETHE_MIN(lethe_cpu_threads(be), a->n);
    scratch_reserve(c, nt, a->n_vocab); /* grows on first use only */
    sample_job j = {a, c};
    lethe_cpu_parallel(be, nt, a->n, sample_task, &j);
}

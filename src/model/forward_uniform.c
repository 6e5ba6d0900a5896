/* forward_uniform.c - lethe_model_forward with one plan for every layer:
 * staged index arrays and CUDA-graph decode steps (see forward_uniform.h).
 *
 * Step order (lethe_model_forward_graph, which the uniform plan calls with
 * tokens, pos, seq_begin, logit_rows, store_slots, sel_begin, sel_slots):
 * stage_step(the step's arrays) -> graph replay if the batch size has a graph ->
 * else capture it if the size already ran once -> else eager forward. The
 * arch forward passes these exact host pointers to the ops (or sub-ranges of
 * them), which is how the backend finds the staged copies. */
#include "model/forward_uniform.h"

#include <stddef.h>

#include "core/log.h"
#include "core/util.h"

static const int32_t g_buckets[] = {LETHE_GRAPH_BUCKET_LIST};
#define N_BUCKETS ((int32_t)(sizeof(g_buckets) / sizeof(g_buckets[0])))
_Static_assert(sizeof(g_buckets) / sizeof(g_buckets[0]) == 35, "bucket count (header comment)");

int32_t lethe_graph_bucket(int32_t n, int32_t max_bucket) {
    for (int32_t i = 0; i < N_BUCKETS; i++)
        if (g_buckets[i] >= n) return g_buckets[i] <= max_bucket ? g_buckets[i] : 0;
    return 0;
}

int32_t lethe_graph_max_bucket(int32_t max_seqs, int32_t max_rows) {
    int32_t best = 0;
    for (int32_t i = 0; i < N_BUCKETS && g_buckets[i] <= max_rows; i++) {
        best = g_buckets[i];
        if (best >= max_seqs) break;
    }
    return best;
}

typedef struct uniform_ctx {
    const lethe_layer_plan *plan;
} uniform_ctx;

static void copy_dev_logits(lethe_model *m, const lethe_fwd_batch *b, float *dst) {
    m->be->ops->logits_to_host(m->be, dst, m->logits_dev, (size_t)b->n_logits * m->cfg.n_vocab);
}

static void uniform_plan(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                         lethe_layer_plan *out) {
    *out = *((const uniform_ctx *)ctx)->plan;
}

void lethe_model_forward_uniform(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                                 void *const *v_cache, const lethe_layer_plan *plan,
                                 bool use_graph, lethe_graph_state *gs, float *logits_out) {
    LETHE_ASSERT(plan);
    uniform_ctx uc = {plan};
    const lethe_fwd_hooks hooks = {.ctx = &uc, .plan_layer = uniform_plan, .after_attn = NULL};
    const int32_t n = b->n_tokens, S = b->n_seqs;
    /* hybrid models: the sequences' state slots too (the linear-attention ops read them) */
    const int32_t *arrays[8] = {b->tokens,   b->pos,         b->seq_begin, b->logit_rows,
                                plan->store_slots, plan->sel_begin, plan->sel_slots, b->state_slots};
    size_t counts[8] = {(size_t)n, (size_t)n, (size_t)S + 1, (size_t)b->n_logits,
                        (size_t)n, (size_t)S + 1, (size_t)plan->sel_begin[S], (size_t)S};
    lethe_model_forward_graph(m, b, k_cache, v_cache, &hooks, arrays, counts,
                              b->state_slots ? 8 : 7, use_graph, gs, logits_out);
}

void lethe_model_forward_graph(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                               void *const *v_cache, const lethe_fwd_hooks *hooks,
                               const int32_t *const *arrays, const size_t *counts, int n_arrays,
                               bool use_graph, lethe_graph_state *gs, float *logits_out) {
    lethe_backend *be = m->be;
    const lethe_backend_ops *o = be->ops;
    const int32_t n = b->n_tokens, S = b->n_seqs;
    o->stage_step(be, arrays, counts, n_arrays);

    const bool graphable = use_graph && gs && n == S && b->n_logits == S &&
                           S <= LETHE_GRAPH_MAX_BATCH;
    /* Device-resident logits (room for them): the graph never contains the
     * host copy, so one graph per key serves callers that sample on the
     * device (logits_out == NULL) and callers that want host logits (copied
     * eagerly after the replay). */
    const bool dev = b->n_logits <= m->n_logits_dev;
    float *const fwd_out = dev ? NULL : logits_out;
    if (graphable) {
        double t0 = lethe_time_s();
        const bool replayed = o->graph_launch(be, S, fwd_out);
        gs->t_graph += lethe_time_s() - t0;
        if (replayed) {
            gs->n_replays++;
            o->unstage(be);
            if (dev && logits_out) copy_dev_logits(m, b, logits_out);
            return;
        }
        if (gs->warm[S] && o->graph_begin(be)) {
            lethe_model_forward(m, b, k_cache, v_cache, hooks, fwd_out);
            t0 = lethe_time_s();
            lethe_status st = o->graph_end(be, S);
            gs->t_graph += lethe_time_s() - t0;
            if (st == LETHE_OK) {
                gs->n_captures++;
                o->unstage(be);
                if (dev && logits_out) copy_dev_logits(m, b, logits_out);
                return;
            }
            LOG_WARN("decode graph for batch %d not captured (%s); running eagerly", S,
                     lethe_last_error());
        }
        gs->warm[S] = 1;
    }
    if (gs) gs->n_eager++;
    lethe_model_forward(m, b, k_cache, v_cache, hooks, logits_out);
    o->unstage(be);
}

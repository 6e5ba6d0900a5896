/* engine_forward.c - how one engine step's forward runs, and the layer plan.
 *
 * The layer plan (plan_layer, the runner's hook): per layer, where the new
 * tokens' K/V go (their slots, appended to each row by the scheduler) and
 * what attention reads: each sequence's selection, asked from the sparse
 * method (build_prefill_selection / build_decode_selection, or select_layer
 * for the whole step at once). after_attn hands the method the attention's
 * arguments when it needs scores (it scores through the backend's
 * attn_scores op), then layer_end. With check_invariants the engine checks a
 * selection's contents: the new tokens last, every slot resident.
 *
 * Two paths, chosen once at create (eng_forward_init):
 *
 *  - per-layer hooks (every method): runner->forward asks plan_layer at each
 *    layer, so a method may select per layer, read q, get scores and run
 *    after_attn / layer_end. Each layer stages its own index arrays, except
 *    for a method with select_layer (Quest, OmniKV): the step's full rows,
 *    store slots, tokens and positions are staged once (stage_rows) and the
 *    method answers per layer with "read the full rows" or a selection it
 *    built on the backend (no per-layer upload, no host sync).
 *  - uniform plan (methods flagged LETHE_SPARSE_UNIFORM: dense, fp8_kv, on a
 *    runner with forward_uniform): plan_layer is asked once (layer 0, q =
 *    NULL) and that plan serves every layer (lethe_model_forward_uniform):
 *    the step's arrays are staged once, for prefill and mixed steps too. A
 *    pure decode step (one token and one logits row per sequence) of B <=
 *    max_bucket sequences is padded to the smallest graph bucket >= B
 *    (LETHE_GRAPH_BUCKET_LIST) and, with graphs on, replays that bucket's
 *    CUDA graph (captured on the bucket's second step; the first one sizes
 *    the backend's buffers eagerly). Larger decode batches and all other
 *    steps run eagerly.
 *
 * Padding: sequences B .. bucket-1 are dummies: token 0 at position 0, K/V
 * stored into the pool's reserved scratch slot (lethe_kv_scratch_slot, owned
 * by no request) and a selection of only that slot (hybrid models: the
 * scratch state slot, reset every step since the dummies sit at position 0); their logits rows land
 * after the real ones in e->step.logits and are never read. Every op computes a
 * row (or a sequence's attention) independently of the others, so real
 * requests get the same logits as unpadded (bit-identical on the CPU backend,
 * tested by test_engine_real with pad_decode_batches; on CUDA cuBLAS may pick
 * another kernel for another row count, so padded vs unpadded logits agree
 * within bf16 rounding and greedy tokens match, tests/gpu/test_cuda_engine.c).
 * Methods never see the dummies: e->step.batch and e->step.st keep the real B.
 *
 * logits: e->step.logits (host rows), or NULL to leave every row, padding
 * included, in the model's device logits for the sample op (engine_sample.c).
 *
 * Graphs exist on backends with LETHE_BE_GRAPHS (the CPU backend's graph ops
 * are no-op twins); enforce_eager turns them off, pad_decode_batches pads
 * without graphs (tests). */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"

void eng_forward_init(lethe_engine *e) {
    const lethe_sparse_ops *ops = e->method->ops;
    if (ops->flags & LETHE_SPARSE_UNIFORM) /* the flag's contract (sparse.h) */
        LETHE_ASSERT(!(ops->flags & LETHE_SPARSE_PER_LAYER_ROWS) && !ops->needs_scores &&
                     !ops->after_attn && !ops->layer_end);
    e->fwd.uniform = (ops->flags & LETHE_SPARSE_UNIFORM) && e->runner.forward_uniform;
    /* a select_layer method that plans its decode steps for graphs (sparse.h graph_step) */
    e->fwd.graph_sel = !e->fwd.uniform && ops->select_layer && ops->graph_step &&
                       e->runner.forward_graph && e->runner.be;
    /* an evicting method whose decode reads every resident slot (graph_step with rows NULL) */
    e->fwd.graph_rows = !e->fwd.uniform && (ops->flags & LETHE_SPARSE_PER_LAYER_ROWS) &&
                        !(ops->flags & LETHE_SPARSE_HEAD_ROWS) && ops->graph_step &&
                        e->runner.forward_graph && e->runner.be;
    const bool graphed = e->fwd.uniform || e->fwd.graph_sel || e->fwd.graph_rows;
    const bool has_graphs = lethe_backend_has(e->runner.be, LETHE_BE_GRAPHS);
    e->fwd.use_graphs = graphed && has_graphs && !e->p.enforce_eager;
    if (!graphed && has_graphs && !e->p.enforce_eager)
        LOG_INFO("sparse method %s: decode steps run eagerly (its selection is not captured as a "
                 "CUDA graph)", ops->name);
    const bool pad = graphed && (e->fwd.use_graphs || e->p.pad_decode_batches);
    e->fwd.max_bucket = pad ? lethe_graph_max_bucket(e->p.max_num_seqs, e->p.max_num_batched_tokens) : 0;
    e->fwd.scratch_slot = -1;
    e->fwd.gs = lethe_xcalloc(1, sizeof(*e->fwd.gs));
}

void eng_forward_bind(lethe_engine *e) {
    if (e->fwd.max_bucket <= 0) return;
    e->fwd.scratch_slot = lethe_kv_scratch_slot(e->pool);
    LETHE_ASSERT(e->fwd.scratch_slot >= 0);
    /* padding writes rows up to max_bucket: size the step arrays now so a
     * padded step never reallocates arrays the batch already points at */
    eng_ensure_caps(e, e->fwd.max_bucket, e->fwd.max_bucket);
    LETHE_ASSERT(e->step.cap_logits >= e->fwd.max_bucket);
}

/* Appends dummy sequences S .. bucket-1 to the step's arrays (b and plan
 * point into them). */
static void pad_batch(lethe_engine *e, lethe_fwd_batch *b, lethe_layer_plan *plan, int32_t bucket) {
    const int32_t S = b->n_seqs, scratch = e->fwd.scratch_slot;
    LETHE_ASSERT(bucket <= e->step.cap_rows && bucket <= e->step.cap_seqs && scratch >= 0);
    LETHE_ASSERT(b->tokens == e->step.tokens && plan->store_slots == e->plan.store &&
                 plan->sel_begin == e->plan.sel_begin && plan->sel_slots == e->plan.sel);
    int32_t n_sel = e->plan.sel_begin[S];
    if (n_sel + (bucket - S) > e->plan.cap_sel) {
        e->plan.cap_sel = LETHE_MAX(n_sel + (bucket - S), 2 * e->plan.cap_sel);
        e->plan.sel = lethe_xrealloc(e->plan.sel, (size_t)e->plan.cap_sel * sizeof(int32_t));
        plan->sel_slots = e->plan.sel;
    }
    for (int32_t i = S; i < bucket; i++) {
        e->step.tokens[i] = 0;
        e->step.pos[i] = 0;
        e->step.seq_begin[i + 1] = i + 1;
        e->step.logit_rows[i] = i;
        e->plan.store[i] = scratch;
        e->plan.sel[n_sel++] = scratch;
        e->plan.sel_begin[i + 1] = n_sel;
        if (b->state_slots) e->step.state_slots[i] = lethe_kv_scratch_state(e->pool);
    }
    b->n_tokens = b->n_seqs = b->n_logits = bucket;
    e->stats.cur.padded_seqs += bucket - S;
}

/* For a method with select_layer: every sequence's whole row (its select-all
 * selection; rows are shared, so the same in every layer) and the new
 * tokens' store slots, built once and staged with the step's other index
 * arrays. A layer the method reads densely then costs no host work and no
 * upload, and the method builds sparse layers from these rows on the backend. */
static void stage_rows(lethe_engine *e) {
    const int32_t S = e->step.batch.n_seqs;
    const int32_t sp = lethe_kv_space_of(e->pool, 0);
    LETHE_ASSERT(!lethe_kv_per_layer(e->pool));
    int64_t total = 0;
    for (int32_t s = 0; s < S; s++) total += lethe_kv_row_len(e->pool, sp, e->step.seqs[s].row);
    if (total > e->plan.cap_rows) {
        e->plan.cap_rows = LETHE_MAX(total, 2 * e->plan.cap_rows);
        e->plan.rows = lethe_xrealloc(e->plan.rows, (size_t)e->plan.cap_rows * sizeof(int32_t));
    }
    int32_t off = 0;
    for (int32_t s = 0; s < S; s++) {
        const lethe_sparse_seq *sq = &e->step.seqs[s];
        const int32_t len = lethe_kv_row_len(e->pool, sp, sq->row);
        const int32_t *slots = lethe_kv_row_slots(e->pool, sp, sq->row);
        LETHE_ASSERT(len >= sq->n_new);
        memcpy(e->plan.rows + off, slots, (size_t)len * sizeof(int32_t));
        memcpy(e->plan.store + sq->q_row, slots + len - sq->n_new, (size_t)sq->n_new * sizeof(int32_t));
        e->plan.rows_begin[s] = off;
        off += len;
    }
    e->plan.rows_begin[S] = off;
    const lethe_fwd_batch *b = &e->step.batch;
    const int32_t *arrays[7] = {b->tokens, b->pos, b->seq_begin, b->logit_rows,
                                e->plan.store,  e->plan.rows_begin, e->plan.rows};
    size_t counts[7] = {(size_t)b->n_tokens, (size_t)b->n_tokens, (size_t)S + 1, (size_t)b->n_logits,
                        (size_t)b->n_tokens, (size_t)S + 1, (size_t)off};
    if (e->runner.be) e->runner.be->ops->stage_step(e->runner.be, arrays, counts, 7);
    e->plan.rows_staged = true;
}

/* A graph step of a select_layer method (sparse.h graph_step): the step's
 * rows padded to `bucket` sequences (dummies: the scratch slot, as
 * pad_batch), the method's per-step arrays, everything staged once, then
 * the forward through the graph logic (replayed without any hook call once
 * captured). false: not this step (not pure decode, no bucket, the method
 * declines): the caller runs the per-layer path. */
static void plan_layer(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                       lethe_layer_plan *out);
static void after_attn(void *ctx, int32_t layer, const lethe_fwd_batch *b, const lethe_attn_args *a);

static bool graph_sel_forward(lethe_engine *e, float *logits) {
    lethe_sparse_method *m = e->method;
    const lethe_fwd_batch *b0 = &e->step.batch;
    const int32_t S = b0->n_seqs, scratch = e->fwd.scratch_slot;
    if (b0->n_tokens != S || b0->n_logits != S || e->diag.seldump) return false;
    for (int32_t s = 0; s < S; s++)
        if (e->step.seqs[s].is_prefill || e->step.seqs[s].n_new != 1) return false;
    const int32_t bucket = e->fwd.max_bucket > 0 ? lethe_graph_bucket(S, e->fwd.max_bucket) : 0;
    if (bucket == 0) return false;
    LETHE_ASSERT(bucket <= e->step.cap_rows && bucket <= e->step.cap_seqs && scratch >= 0);
    /* full rows of the real sequences, then one scratch entry per dummy */
    const int32_t sp = lethe_kv_space_of(e->pool, 0);
    int64_t total = bucket - S;
    for (int32_t s = 0; s < S; s++) total += lethe_kv_row_len(e->pool, sp, e->step.seqs[s].row);
    if (total > e->plan.cap_rows) {
        e->plan.cap_rows = LETHE_MAX(total, 2 * e->plan.cap_rows);
        e->plan.rows = lethe_xrealloc(e->plan.rows, (size_t)e->plan.cap_rows * sizeof(int32_t));
    }
    int32_t off = 0;
    for (int32_t s = 0; s < bucket; s++) {
        e->plan.rows_begin[s] = off;
        if (s >= S) {
            e->plan.rows[off++] = scratch;
            e->plan.store[s] = scratch;
            continue;
        }
        const lethe_sparse_seq *sq = &e->step.seqs[s];
        const int32_t len = lethe_kv_row_len(e->pool, sp, sq->row);
        memcpy(e->plan.rows + off, lethe_kv_row_slots(e->pool, sp, sq->row), (size_t)len * sizeof(int32_t));
        off += len;
        e->plan.store[sq->q_row] = e->plan.rows[off - 1]; /* the new token: the row's last entry */
    }
    e->plan.rows_begin[bucket] = off;
    const lethe_step_rows rows = {.begin = e->plan.rows_begin, .slots = e->plan.rows};
    lethe_graph_arrays ga = {0};
    if (!m->ops->graph_step(m, &e->step.st, &rows, bucket, &ga)) return false;
    LETHE_ASSERT(ga.n >= 0 && ga.n <= LETHE_GRAPH_MAX_ARRAYS);
    /* the dummies' batch rows (pad_batch's, without a plan: store is done) */
    lethe_fwd_batch b = *b0;
    for (int32_t i = S; i < bucket; i++) {
        e->step.tokens[i] = 0;
        e->step.pos[i] = 0;
        e->step.seq_begin[i + 1] = i + 1;
        e->step.logit_rows[i] = i;
        if (b.state_slots) e->step.state_slots[i] = lethe_kv_scratch_state(e->pool);
    }
    b.n_tokens = b.n_seqs = b.n_logits = bucket;
    e->stats.cur.padded_seqs += bucket - S;
    const int32_t *arrays[8 + LETHE_GRAPH_MAX_ARRAYS] = {
        b.tokens, b.pos, b.seq_begin, b.logit_rows, e->plan.store, e->plan.rows_begin, e->plan.rows,
        b.state_slots};
    size_t counts[8 + LETHE_GRAPH_MAX_ARRAYS] = {
        (size_t)bucket, (size_t)bucket, (size_t)bucket + 1, (size_t)bucket, (size_t)bucket,
        (size_t)bucket + 1, (size_t)off, (size_t)bucket};
    int n = b.state_slots ? 8 : 7;
    for (int32_t i = 0; i < ga.n; i++, n++) arrays[n] = ga.arrays[i], counts[n] = ga.counts[i];
    e->plan.rows_staged = e->plan.graph = true;
    const lethe_fwd_hooks hooks = {.ctx = e, .plan_layer = plan_layer, .after_attn = after_attn};
    lethe_graph_state *gs = e->fwd.gs;
    const int64_t graphs_before = gs->n_replays + gs->n_captures;
    e->runner.forward_graph(e->runner.ctx, &b, &hooks, arrays, counts, n, e->fwd.use_graphs, gs, logits);
    if (gs->n_replays + gs->n_captures == graphs_before) e->stats.cur.eager_steps++;
    e->stats.cur.graph_replays = gs->n_replays;
    e->stats.cur.graph_captures = gs->n_captures;
    e->plan.rows_staged = e->plan.graph = false;
    /* a replay calls no hook: the step's reads come from the method's plan */
    e->stats.sparse.selected_slots += ga.selected;
    e->stats.sparse.resident_slots += (int64_t)e->plan.rows_begin[S] * lethe_kv_n_layers(e->pool);
    return true;
}

/* The plan_layer hook of graph_rows_forward: layer `layer`'s slices of the
 * step's per-layer arrays (staged once; the slices' offsets depend only on
 * the layer and the bucket, so a captured step reads the right ones). */
static void plan_layer_rows(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                            lethe_layer_plan *out) {
    lethe_engine *e = ctx;
    const int32_t B = e->plan.lbucket;
    LETHE_ASSERT(b->n_seqs == B);
    *out = (lethe_layer_plan){.store_slots = e->plan.lstore + (size_t)layer * B,
                              .sel_begin = e->plan.lbegin + (size_t)layer * (B + 1),
                              .sel_slots = e->plan.lslots};
}

/* A graph step of a method with per-layer rows whose decode reads every
 * resident slot (sparse.h graph_step with rows NULL: SnapKV, PyramidKV,
 * StreamingLLM, H2O without decode scoring): its compaction happens in
 * finish_step, between steps, so the step itself is dense attention over
 * each layer's row. Every layer's store slots and selection are built here
 * at once, padded to the bucket (dummies: the scratch slot, in every slot
 * space), staged once, and the step runs through the graph logic with no
 * method hook inside. false: not this step (the caller runs the per-layer
 * path). */
static bool graph_rows_forward(lethe_engine *e, float *logits) {
    lethe_sparse_method *m = e->method;
    lethe_kv_pool *pool = e->pool;
    const lethe_fwd_batch *b0 = &e->step.batch;
    const int32_t S = b0->n_seqs, scratch = e->fwd.scratch_slot, NL = lethe_kv_n_layers(pool);
    if (b0->n_tokens != S || b0->n_logits != S || e->diag.seldump || b0->state_slots) return false;
    for (int32_t s = 0; s < S; s++)
        if (e->step.seqs[s].is_prefill || e->step.seqs[s].n_new != 1) return false;
    const int32_t bucket = e->fwd.max_bucket > 0 ? lethe_graph_bucket(S, e->fwd.max_bucket) : 0;
    if (bucket == 0 || lethe_kv_has_head_masks(pool) || lethe_sparse_kv_path(m)) return false;
    for (int32_t l = 0; l < NL; l++)
        if (lethe_kv_quant_of(pool, l)) return false;
    lethe_graph_arrays ga = {0};
    if (!m->ops->graph_step(m, &e->step.st, NULL, bucket, &ga)) {
        if (!e->fwd.warned_decline)
            LOG_INFO("sparse method %s: this configuration scores during decode, so its decode steps "
                     "run eagerly (no CUDA graph)", m->ops->name);
        e->fwd.warned_decline = true;
        return false;
    }
    LETHE_ASSERT(ga.n == 0 && scratch >= 0 && bucket <= e->step.cap_rows && bucket <= e->step.cap_seqs);
    int64_t total = (int64_t)NL * (bucket - S);
    for (int32_t l = 0; l < NL; l++) {
        const int32_t sp = lethe_kv_space_of(pool, l);
        for (int32_t s = 0; s < S; s++) total += lethe_kv_row_len(pool, sp, e->step.seqs[s].row);
    }
    LETHE_ASSERT(total <= INT32_MAX);
    const int64_t n_store = (int64_t)NL * bucket, n_begin = (int64_t)NL * (bucket + 1);
#define GROW(ptr, cap, need)                                                                           if ((need) > (cap)) {                                                                                  (cap) = LETHE_MAX((need), (cap) + (cap) / 4);                                                      (ptr) = lethe_xrealloc((ptr), (size_t)(cap) * sizeof(int32_t));                                }
    GROW(e->plan.lstore, e->plan.cap_lstore, n_store);
    GROW(e->plan.lbegin, e->plan.cap_lbegin, n_begin);
    GROW(e->plan.lslots, e->plan.cap_lslots, total);
#undef GROW
    int32_t off = 0;
    int64_t real = 0;
    for (int32_t l = 0; l < NL; l++) {
        const int32_t sp = lethe_kv_space_of(pool, l);
        int32_t *store = e->plan.lstore + (size_t)l * bucket, *beg = e->plan.lbegin + (size_t)l * (bucket + 1);
        for (int32_t s = 0; s < bucket; s++) {
            beg[s] = off;
            if (s >= S) {
                e->plan.lslots[off++] = scratch;
                store[s] = scratch;
                continue;
            }
            const int32_t row = e->step.seqs[s].row, len = lethe_kv_row_len(pool, sp, row);
            LETHE_ASSERT(len >= 1);
            memcpy(e->plan.lslots + off, lethe_kv_row_slots(pool, sp, row), (size_t)len * sizeof(int32_t));
            off += len;
            real += len;
            store[s] = e->plan.lslots[off - 1]; /* the new token: the row's last entry */
        }
        beg[bucket] = off;
    }
    e->plan.lbucket = bucket;
    lethe_fwd_batch b = *b0;
    for (int32_t i = S; i < bucket; i++) {
        e->step.tokens[i] = 0;
        e->step.pos[i] = 0;
        e->step.seq_begin[i + 1] = i + 1;
        e->step.logit_rows[i] = i;
    }
    b.n_tokens = b.n_seqs = b.n_logits = bucket;
    e->stats.cur.padded_seqs += bucket - S;
    const int32_t *arrays[7] = {b.tokens,       b.pos,          b.seq_begin, b.logit_rows,
                                e->plan.lstore, e->plan.lbegin, e->plan.lslots};
    size_t counts[7] = {(size_t)bucket, (size_t)bucket, (size_t)bucket + 1, (size_t)bucket,
                        (size_t)n_store, (size_t)n_begin, (size_t)off};
    const lethe_fwd_hooks hooks = {.ctx = e, .plan_layer = plan_layer_rows, .after_attn = NULL};
    lethe_graph_state *gs = e->fwd.gs;
    const int64_t graphs_before = gs->n_replays + gs->n_captures;
    e->runner.forward_graph(e->runner.ctx, &b, &hooks, arrays, counts, 7, e->fwd.use_graphs, gs, logits);
    if (gs->n_replays + gs->n_captures == graphs_before) e->stats.cur.eager_steps++;
    e->stats.cur.graph_replays = gs->n_replays;
    e->stats.cur.graph_captures = gs->n_captures;
    e->stats.sparse.selected_slots += real; /* every resident entry of every layer */
    e->stats.sparse.resident_slots += real;
    return true;
}

/* The uniform plan of a quantized-KV method (FP8): layer `layer` reads the
 * step's one selection from its own codes and scales. */
static void plan_layer_quant(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                             lethe_layer_plan *out) {
    lethe_engine *e = ctx;
    *out = e->plan.uplan;
    out->kvq = lethe_kv_quant_of(e->pool, layer);
    LETHE_ASSERT(out->kvq && (out->kvq->format == LETHE_KV_FP8_E4M3 || out->kvq->format == LETHE_KV_NATIVE));
}

/* ---- the layer plan: where the new K/V go, what attention reads ---- */

/* lethe_engine_sparse_stats: the entries a plan reads and the entries its
 * rows hold; a uniform plan (asked once) stands for every layer */
static void count_reads(lethe_engine *e, int64_t selected, int64_t resident) {
    const int64_t layers = e->fwd.uniform ? lethe_kv_n_layers(e->pool) : 1;
    e->stats.sparse.selected_slots += selected * layers;
    e->stats.sparse.resident_slots += resident * layers;
}

/* The method's select_layer answer as the layer's plan (rows: the step's
 * staged full rows, stage_rows above); false: build per sequence. */
static bool plan_from_select_layer(lethe_engine *e, int32_t layer, const void *q,
                                   lethe_layer_plan *out) {
    lethe_sparse_method *m = e->method;
    const int32_t n_seqs = e->step.st.n_seqs;
    const lethe_step_rows rows = {.begin = e->plan.rows_begin, .slots = e->plan.rows};
    const int32_t *sb = NULL, *ss = NULL;
    lethe_sel_result r = m->ops->select_layer(m, layer, &e->step.st, q, &rows, &sb, &ss);
    if (r == LETHE_SEL_PER_SEQ) return false;
    out->head_sel_begin = out->head_sel_slots = NULL; /* unless LETHE_SEL_BUILT_HEADS (below) */
    out->store_slots = e->plan.store; /* staged: the new tokens' slots, the same in every layer */
    out->kvq = lethe_kv_quant_of(e->pool, layer);
    LETHE_ASSERT(!out->kvq); /* built selections live on the backend: native KV only */
    out->path = lethe_sparse_kv_path(m);
    if (r == LETHE_SEL_FULL) {
        out->sel_begin = e->plan.rows_begin;
        out->sel_slots = e->plan.rows;
        if (!e->plan.graph) count_reads(e, e->plan.rows_begin[n_seqs], e->plan.rows_begin[n_seqs]);
    } else {
        LETHE_ASSERT((r == LETHE_SEL_BUILT || r == LETHE_SEL_BUILT_HEADS) && sb && ss && sb[0] == 0);
        /* per-KV-head lists (BUILT_HEADS): n_lists per sequence, the sequence's
         * own selection is its full row (each list a subsequence of it) */
        const int32_t n_lists = r == LETHE_SEL_BUILT_HEADS ? e->runner.cfg.n_kv_heads : 1;
        /* counts always; the contents live on the backend, readable here when
         * backend memory is host memory (the CPU backend: every test) */
        const bool host_view = e->p.check_invariants &&
                               lethe_backend_has(e->runner.be, LETHE_BE_HOST_MEMORY);
        const int32_t sp = lethe_kv_space_of(e->pool, layer);
        for (int32_t s = 0; s < n_seqs * n_lists; s++) {
            const lethe_sparse_seq *sq = &e->step.seqs[s / n_lists];
            const int32_t n = sb[s + 1] - sb[s],
                          cap = e->plan.rows_begin[s / n_lists + 1] - e->plan.rows_begin[s / n_lists];
            LETHE_ASSERT(n >= sq->n_new && n <= cap);
            if (!host_view) continue;
            const int32_t *sel = ss + sb[s];
            for (int32_t j = 0; j < sq->n_new; j++) /* the new tokens last, in order */
                LETHE_ASSERT(sel[n - sq->n_new + j] == e->plan.store[sq->q_row + j]);
            for (int32_t j = 0; j < n; j++)
                LETHE_ASSERT(lethe_kv_refcount(e->pool, sp, sel[j]) > 0);
        }
        if (n_lists > 1) {
            out->sel_begin = e->plan.rows_begin;
            out->sel_slots = e->plan.rows;
            out->head_sel_begin = sb;
            out->head_sel_slots = ss;
        } else {
            out->sel_begin = sb;
            out->sel_slots = ss;
        }
        /* reads: a KV head's list each, counted as their mean */
        if (!e->plan.graph) count_reads(e, sb[n_seqs * n_lists] / n_lists, e->plan.rows_begin[n_seqs]);
        e->stats.cur.device_selections++;
    }
    e->plan.layer_scores = m->ops->needs_scores && m->ops->needs_scores(m, layer);
    return true;
}

/* Per-KV-head selections (rows with head masks, kv_pool.h): KV head h of
 * sequence s reads the entries of its selection whose mask has bit h. The
 * selection is a subsequence of the row (ascending), so one walk over the row
 * finds each selected entry's mask. NULL head lists when every selected entry
 * is kept by all heads (attention then takes its usual path). */
static void plan_head_lists(lethe_engine *e, int32_t layer, lethe_layer_plan *out) {
    const int32_t sp = lethe_kv_space_of(e->pool, layer), S = e->step.st.n_seqs;
    const int32_t KH = e->runner.cfg.n_kv_heads;
    const uint64_t full = lethe_kv_full_head_mask(e->pool);
    out->head_sel_begin = out->head_sel_slots = NULL;
    bool partial = false;
    for (int32_t s = 0; s < S && !partial; s++) {
        const int32_t len = lethe_kv_row_len(e->pool, sp, e->step.seqs[s].row);
        const uint64_t *mk = lethe_kv_row_head_mask(e->pool, sp, e->step.seqs[s].row);
        for (int32_t i = 0; i < len && !partial; i++) partial = mk[i] != full;
    }
    if (!partial) return;
    const int64_t total = (int64_t)e->plan.sel_begin[S] * KH, nb = (int64_t)S * KH + 1;
    if (total > e->plan.cap_hsel) {
        e->plan.cap_hsel = LETHE_MAX(total, 2 * e->plan.cap_hsel);
        e->plan.hsel = lethe_xrealloc(e->plan.hsel, (size_t)e->plan.cap_hsel * sizeof(int32_t));
    }
    if (nb > e->plan.cap_hsel_begin) {
        e->plan.cap_hsel_begin = LETHE_MAX(nb, 2 * e->plan.cap_hsel_begin);
        e->plan.hsel_begin = lethe_xrealloc(e->plan.hsel_begin, (size_t)e->plan.cap_hsel_begin * sizeof(int32_t));
    }
    int32_t off = 0;
    for (int32_t s = 0; s < S; s++) {
        const int32_t row = e->step.seqs[s].row, len = lethe_kv_row_len(e->pool, sp, row);
        const int32_t *slots = lethe_kv_row_slots(e->pool, sp, row);
        const uint64_t *mk = lethe_kv_row_head_mask(e->pool, sp, row);
        const int32_t *sel = e->plan.sel + e->plan.sel_begin[s];
        const int32_t n = e->plan.sel_begin[s + 1] - e->plan.sel_begin[s];
        for (int32_t h = 0; h < KH; h++) {
            e->plan.hsel_begin[s * KH + h] = off;
            for (int32_t j = 0, i = 0; j < n; j++) {
                while (i < len && slots[i] != sel[j]) i++;
                LETHE_ASSERT(i < len); /* a selection is a subsequence of its row */
                if ((mk[i] >> h) & 1u) e->plan.hsel[off++] = sel[j];
                i++;
            }
        }
    }
    e->plan.hsel_begin[S * KH] = off;
    out->head_sel_begin = e->plan.hsel_begin;
    out->head_sel_slots = e->plan.hsel;
}

/* Every sequence's selection from the method (lethe_sparse_build_selection:
 * its build_prefill_selection / build_decode_selection, or every resident
 * slot), the new tokens' store slots from the rows. */
static void plan_per_seq(lethe_engine *e, int32_t layer, const void *q, lethe_layer_plan *out) {
    lethe_sparse_method *m = e->method;
    const int32_t sp = lethe_kv_space_of(e->pool, layer);
    const int32_t n_seqs = e->step.st.n_seqs;
    int64_t total = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_sparse_seq *sq = &e->step.seqs[s];
        int32_t len = lethe_kv_row_len(e->pool, sp, sq->row);
        const int32_t *slots = lethe_kv_row_slots(e->pool, sp, sq->row);
        LETHE_ASSERT(len >= sq->n_new);
        /* the new tokens are the row's last entries (appended by the scheduler) */
        memcpy(e->plan.store + sq->q_row, slots + len - sq->n_new,
               (size_t)sq->n_new * sizeof(int32_t));
        total += len;
    }
    if (total > e->plan.cap_sel) {
        e->plan.cap_sel = LETHE_MAX(total, 2 * e->plan.cap_sel);
        e->plan.sel = lethe_xrealloc(e->plan.sel, (size_t)e->plan.cap_sel * sizeof(int32_t));
    }
    int32_t off = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_sparse_seq *sq = &e->step.seqs[s];
        int32_t cap = lethe_kv_row_len(e->pool, sp, sq->row);
        int32_t n =
            lethe_sparse_build_selection(m, layer, &e->step.st, s, q, e->plan.sel + off, cap);
        LETHE_ASSERT(n >= sq->n_new && n <= cap);
        if (e->p.check_invariants) {
            for (int32_t j = 0; j < sq->n_new; j++)
                LETHE_ASSERT(e->plan.sel[off + n - sq->n_new + j] == e->plan.store[sq->q_row + j]);
            for (int32_t j = 0; j < n; j++)
                LETHE_ASSERT(lethe_kv_refcount(e->pool, sp, e->plan.sel[off + j]) > 0);
        }
        e->plan.sel_begin[s] = off;
        off += n;
    }
    e->plan.sel_begin[n_seqs] = off;
    count_reads(e, off, total);
    out->store_slots = e->plan.store;
    out->sel_begin = e->plan.sel_begin;
    out->sel_slots = e->plan.sel;
    out->kvq = lethe_kv_quant_of(e->pool, layer);
    out->path = lethe_sparse_kv_path(m); /* the method's payload, or NULL */
    out->head_sel_begin = out->head_sel_slots = NULL;
    if (lethe_kv_has_head_masks(e->pool)) plan_head_lists(e, layer, out);
    /* asked here, while the step's selections are built: after_attn then gets
     * the attention's arguments to score with (backend attn_scores) */
    e->plan.layer_scores = m->ops->needs_scores && m->ops->needs_scores(m, layer);
}

/* The plan_layer hook: what layer `layer` reads and where its new K/V go
 * (the uniform path asks once: layer 0, q = NULL). */
static void plan_layer(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                       lethe_layer_plan *out) {
    lethe_engine *e = ctx;
    const double t0 = e->diag.timed ? lethe_time_s() : 0;
    if (!e->plan.rows_staged || !plan_from_select_layer(e, layer, q, out))
        plan_per_seq(e, layer, q, out);
    out->bsp = e->method->ops->block_sparse ? e->method->ops->block_sparse(e->method, layer, &e->step.st) : NULL;
    eng_seldump_layer(e, layer, out); /* LETHE_DUMP_SELECTIONS (engine_seldump.c) */
    if (e->diag.timed) e->diag.t_plan += lethe_time_s() - t0; /* LETHE_STEP_TIMES, engine_diag.c */
}

/* The after_attn hook: the method scores (with the attention's arguments when
 * it asked for scores) and ends the layer. */
static void after_attn(void *ctx, int32_t layer, const lethe_fwd_batch *b,
                       const lethe_attn_args *a) {
    lethe_engine *e = ctx;
    lethe_sparse_method *m = e->method;
    (void)b;
    if (m->ops->after_attn)
        m->ops->after_attn(m, layer, &e->step.st, e->plan.layer_scores ? a : NULL);
    if (m->ops->layer_end) m->ops->layer_end(m, layer, &e->step.st);
}

/* ---- auxiliary prefill (sparse.h lethe_sparse_aux_prefill) ----
 * Runs inside the method's finish_step, after the step's forward: the step's
 * batch and plan arrays are free again, but the method is iterating the
 * step's sequences, so the aux forward gets its own one-sequence batch and
 * view, swapped into e->step for the plan_layer / after_attn hooks and
 * swapped back afterwards. Hybrid models: the aux tokens must not advance
 * the request's own states, so they run on a copy (a held state slot, the
 * one engine.c keeps spare for this) given back at the end. */
lethe_status eng_aux_prefill(void *ctx, const lethe_sparse_seq *s, const int32_t *tokens, int32_t n) {
    lethe_engine *e = ctx;
    lethe_kv_pool *pool = e->pool;
    if (n <= 0) return LETHE_OK;
    const int32_t nsp = lethe_kv_n_spaces(pool), row = s->row;
    if (lethe_kv_min_free(pool) < n)
        return lethe_errorf(LETHE_ERR_CAPACITY,
                            "auxiliary prefill of %d tokens: only %d free slots (the method must reserve "
                            "them with prefill_peak_slots)", n, lethe_kv_min_free(pool));
    int32_t aux_state = -1;
    if (lethe_kv_has_states(pool)) {
        if ((aux_state = lethe_kv_state_take(pool)) < 0)
            return lethe_errorf(LETHE_ERR_CAPACITY, "auxiliary prefill: no free state slot to copy the "
                                "request's states into");
        lethe_kv_state_copy(pool, aux_state, lethe_kv_row_state(pool, row));
    }
    int32_t *len0 = lethe_xmalloc((size_t)nsp * sizeof(int32_t)), last = -1;
    for (int32_t sp = 0; sp < nsp; sp++) {
        len0[sp] = lethe_kv_row_len(pool, sp, row);
        if (len0[sp] > 0) last = LETHE_MAX(last, lethe_kv_row_pos(pool, sp, row)[len0[sp] - 1]);
    }
    const int32_t chunk = e->p.max_num_batched_tokens;
    eng_ensure_caps(e, LETHE_MIN(n, chunk), 1); /* plan.store; keeps cap_seqs (>= 1 already) */
    lethe_fwd_batch saved_b = e->step.batch; /* the step's arrays may have moved: repoint */
    saved_b.tokens = e->step.tokens;
    saved_b.pos = e->step.pos;
    saved_b.logit_rows = e->step.logit_rows;
    const lethe_sparse_step saved_st = e->step.st;
    lethe_sparse_seq *saved_seqs = e->step.seqs;
    int32_t *pos = lethe_xmalloc((size_t)n * sizeof(int32_t)), seq_begin[2] = {0, 0};
    for (int32_t i = 0; i < n; i++) pos[i] = last + 1 + i;
    lethe_sparse_seq v = *s;
    const lethe_fwd_hooks hooks = {.ctx = e, .plan_layer = plan_layer, .after_attn = after_attn};
    for (int32_t off = 0; off < n; off += chunk) {
        const int32_t k = LETHE_MIN(chunk, n - off);
        const bool ok = lethe_kv_row_append(pool, row, k, pos + off);
        LETHE_ASSERT(ok); /* n free slots were checked above */
        v.q_row = 0;
        v.n_new = k;
        v.first_pos = pos[off];
        v.is_prefill = v.is_aux = true;
        v.is_final_chunk = false;
        seq_begin[1] = k;
        e->step.batch = (lethe_fwd_batch){.n_tokens = k, .tokens = tokens + off, .pos = pos + off,
                                          .n_seqs = 1, .seq_begin = seq_begin, .n_logits = 0,
                                          .state_slots = aux_state >= 0 ? &aux_state : NULL};
        e->step.seqs = &v;
        e->step.st = (lethe_sparse_step){
            .index = saved_st.index, .n_seqs = 1, .seqs = &v, .batch = &e->step.batch};
        e->runner.forward(e->runner.ctx, &e->step.batch, &hooks, NULL);
        e->stats.cur.prefill_tokens_computed += k;
    }
    e->step.batch = saved_b;
    e->step.st = saved_st;
    e->step.seqs = saved_seqs;
    /* drop the appended entries: every slot space back to its length before */
    int32_t max0 = 0;
    for (int32_t sp = 0; sp < nsp; sp++) max0 = LETHE_MAX(max0, len0[sp]);
    int32_t *keep = lethe_xmalloc(((size_t)max0 + 1) * sizeof(int32_t));
    for (int32_t sp = 0; sp < nsp; sp++) {
        for (int32_t i = 0; i < len0[sp]; i++) keep[i] = i;
        const int32_t layer = lethe_kv_per_layer(pool) ? sp : 0;
        lethe_kv_keep(pool, layer, row, keep, len0[sp]);
    }
    free(keep);
    free(pos);
    free(len0);
    if (aux_state >= 0) lethe_kv_state_give(pool, aux_state);
    return LETHE_OK;
}

/* ---- the forward ---- */

lethe_status eng_forward(lethe_engine *e, float *logits) {
    if (!e->fwd.uniform) {
        if (e->fwd.graph_sel && e->fwd.max_bucket > 0 && graph_sel_forward(e, logits))
            return lethe_runner_step_status(&e->runner, &e->step.batch);
        if (e->fwd.graph_rows && e->fwd.max_bucket > 0 && graph_rows_forward(e, logits))
            return lethe_runner_step_status(&e->runner, &e->step.batch);
        if (e->method->ops->select_layer) stage_rows(e);
        const lethe_fwd_hooks hooks = {
            .ctx = e, .plan_layer = plan_layer, .after_attn = after_attn};
        e->runner.forward(e->runner.ctx, &e->step.batch, &hooks, logits);
        if (e->plan.rows_staged && e->runner.be) e->runner.be->ops->unstage(e->runner.be);
        e->plan.rows_staged = false;
        e->stats.cur.eager_steps++;
        return lethe_runner_step_status(&e->runner, &e->step.batch);
    }
    lethe_fwd_batch b = e->step.batch; /* padded below; methods keep seeing e->step.batch */
    lethe_layer_plan plan;
    plan_layer(e, 0, &b, NULL, &plan); /* the same in every layer */
    /* payloads are not uniform; of the quantized formats only FP8 (per-token
     * codes and scales: its store and attention need no host plan, so its
     * steps can be graphs), each layer with its own side arrays */
    LETHE_ASSERT(!plan.path && (!plan.kvq || plan.kvq->format == LETHE_KV_FP8_E4M3 ||
                                plan.kvq->format == LETHE_KV_NATIVE)); /* (hybrid: layer 0 holds states) */
    const int32_t S = b.n_seqs;
    const bool decode = b.n_tokens == S && b.n_logits == S;
    const int32_t bucket = decode && e->fwd.max_bucket > 0 ? lethe_graph_bucket(S, e->fwd.max_bucket) : 0;
    if (bucket > S) pad_batch(e, &b, &plan, bucket);
    lethe_graph_state *gs = e->fwd.gs;
    const int64_t graphs_before = gs->n_replays + gs->n_captures;
    if (plan.kvq) {
        /* the uniform plan with each layer's quantized side arrays */
        e->plan.uplan = plan;
        const int32_t n = b.n_tokens, S2 = b.n_seqs;
        const int32_t *arrays[8] = {b.tokens, b.pos, b.seq_begin, b.logit_rows, plan.store_slots,
                                    plan.sel_begin, plan.sel_slots, b.state_slots};
        size_t counts[8] = {(size_t)n, (size_t)n, (size_t)S2 + 1, (size_t)b.n_logits, (size_t)n,
                            (size_t)S2 + 1, (size_t)plan.sel_begin[S2], (size_t)S2};
        const lethe_fwd_hooks hooks = {.ctx = e, .plan_layer = plan_layer_quant, .after_attn = NULL};
        e->runner.forward_graph(e->runner.ctx, &b, &hooks, arrays, counts, b.state_slots ? 8 : 7,
                                e->fwd.use_graphs && bucket > 0, gs, logits);
    } else {
        e->runner.forward_uniform(e->runner.ctx, &b, &plan, e->fwd.use_graphs && bucket > 0, gs, logits);
    }
    if (gs->n_replays + gs->n_captures == graphs_before) e->stats.cur.eager_steps++;
    e->stats.cur.graph_replays = gs->n_replays;
    e->stats.cur.graph_captures = gs->n_captures;
    /* the real rows, not the padding */
    return lethe_runner_step_status(&e->runner, &e->step.batch);
}

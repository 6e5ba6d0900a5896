/* streamingllm.c - StreamingLLM / attention sinks (methods.md §3), physical eviction.
 *
 * Every layer keeps positions [0, s) and [L - r, L) and frees the rest. The
 * anchor's lifecycle, implemented here: prefill is dense; at the end of the
 * final prompt chunk each layer trims to s + r; during decode a row grows
 * until it reaches 2 (s + r) and is then trimmed back to s + r (amortized
 * compaction at step end). The original paper trims before every step (the
 * cache never exceeds s + r, s = 4) and re-rotates cached keys with
 * cache-relative positions; lethe keeps original positions (post-RoPE keys),
 * as the anchor does. No scores, no per-request state; attention reads every
 * resident slot (the selection hooks' default). */
#include <stdlib.h>

#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

/* the row length finish_step leaves for a row of len tokens */
static int32_t sl_after(const lethe_sparse_method *m, int32_t len, bool prefill, bool final_chunk) {
    int32_t b = m->knobs.sink_keep_tokens + m->knobs.recent_keep_tokens;
    if (prefill) return final_chunk && len > b ? b : len;
    return len >= 2 * b && len > b ? b : len;
}

static void sl_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    int32_t *keep = NULL;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        for (int32_t l = 0; l < m->env.n_layers; l++) {
            int32_t L = lethe_sparse_row_len(m, l, q->row);
            if (sl_after(m, L, q->is_prefill, q->is_final_chunk) == L) continue;
            keep = lethe_xrealloc(keep, (size_t)L * sizeof(*keep));
            int32_t n = lethe_sparse_keep_set(m, l, q->row, NULL, m->knobs.sink_keep_tokens,
                                              m->knobs.recent_keep_tokens, 0, keep);
            lethe_kv_keep(m->env.pool, l, q->row, keep, n);
        }
    }
    free(keep);
}

static int32_t sl_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                               int32_t n_total, int32_t chunk) {
    int32_t b = 2 * (m->knobs.sink_keep_tokens + m->knobs.recent_keep_tokens);
    return LETHE_MIN(n_total, LETHE_MAX(n_prompt, b));
}

/* decode reads every resident slot and no hook runs inside the step: every
 * decode step may be a graph (trimming happens in finish_step, between steps) */
static bool sl_graph_step(lethe_sparse_method *m, const lethe_sparse_step *st,
                          const lethe_step_rows *rows, int32_t n_pad, lethe_graph_arrays *out) {
    return rows == NULL;
}

const lethe_sparse_ops lethe_sparse_streamingllm = {
    .name = "streamingllm",
    .aliases = {"attention-sink", NULL}, /* attention_sink too (lookup treats - and _ alike) */
    .summary = "keep sink + recent tokens; trim at prompt end and when a row reaches 2 (s + r)",
    .kind = LETHE_SPARSE_KIND_EVICTION,
    .flags = LETHE_SPARSE_PER_LAYER_ROWS,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT,
    .test_configs = {.identity = "sink_keep_tokens=4,recent_keep_tokens=1000",
                     .small = "sink_keep_tokens=2,recent_keep_tokens=6"},
    .max_resident = sl_max_resident,
    .finish_step = sl_finish,
    .graph_step = sl_graph_step,
};

/* scored.h - the scored-compaction runtime shared by SnapKV and PyramidKV
 * (the anchor's ScoredCompactionRuntime): window scores of the last w prompt
 * queries over the middle candidates [s, L - r), accumulated with max across
 * chunks, then at prompt end per layer: optional max-pool, top-(B_l - s - r),
 * keep sink + top + recent, free the rest. Optional decode eviction folds each
 * decode query's scores in the same way and compacts when L >= B_l + interval.
 * The methods differ only in their knob tables and the per-layer budgets:
 * each table is LETHE_SCORED_OPS plus its name, summary, knobs, configure
 * (which fills budget[] and decode_eviction) and test configurations. */
#ifndef LETHE_SPARSE_SCORED_H
#define LETHE_SPARSE_SCORED_H

#include "sparse/select_util.h"
#include "sparse/sparse.h"

typedef struct lethe_scored_priv {
    lethe_knob_values kv;
    const lethe_sparse_step *st; /* the current step (prepare .. finish_step) */
    int32_t w, pool_kernel, interval;
    lethe_score_mode mode;
    bool decode_eviction;
    int32_t *budget;            /* [n_layers] retained tokens B_l = s + k_l + r */
} lethe_scored_priv;

/* the ops-table fields SnapKV and PyramidKV share (designated initializers) */
#define LETHE_SCORED_OPS                                                                           \
    .kind = LETHE_SPARSE_KIND_EVICTION, .flags = LETHE_SPARSE_PER_LAYER_ROWS,                      \
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,                         \
    .max_resident = lethe_scored_max_resident, .min_final_chunk = lethe_scored_min_final_chunk,    \
    .init = lethe_scored_init, .destroy = lethe_scored_destroy, .set_knob = lethe_scored_set_knob, \
    .request_init = lethe_scored_request_init, .request_finished = lethe_scored_request_finished,  \
    .prepare = lethe_scored_prepare, .finish_step = lethe_scored_finish,                           \
    .needs_scores = lethe_scored_needs_scores, .after_attn = lethe_scored_after_attn,              \
    .snapshot = lethe_scored_snapshot, .restore = lethe_scored_restore,                           \
    .graph_step = lethe_scored_graph_step

bool lethe_scored_graph_step(lethe_sparse_method *m, const lethe_sparse_step *st,
                             const lethe_step_rows *rows, int32_t n_pad, lethe_graph_arrays *out);
lethe_status lethe_scored_init(lethe_sparse_method *m);
void lethe_scored_destroy(lethe_sparse_method *m);
lethe_status lethe_scored_set_knob(lethe_sparse_method *m, const char *key, const char *value);
/* reads snapkv_window_size, pool_kernel_size, sparse_prefill_score_mode,
 * decode_eviction_interval; the method then fills budget[] and decode_eviction */
lethe_status lethe_scored_configure_common(lethe_sparse_method *m);
lethe_status lethe_scored_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state);
void lethe_scored_request_finished(lethe_sparse_method *m, void *state);
size_t lethe_scored_snapshot(lethe_sparse_method *m, const void *state, void *buf, size_t cap);
lethe_status lethe_scored_restore(lethe_sparse_method *m, void *state, const void *buf, size_t n);
void lethe_scored_prepare(lethe_sparse_method *m, const lethe_sparse_step *st);
bool lethe_scored_needs_scores(lethe_sparse_method *m, int32_t layer);
void lethe_scored_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             const lethe_attn_args *attn);
void lethe_scored_finish(lethe_sparse_method *m, const lethe_sparse_step *st);
int32_t lethe_scored_min_final_chunk(const lethe_sparse_method *m);
int32_t lethe_scored_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk);
/* the row length finish_step leaves in `layer` for a row of len tokens */
int32_t lethe_scored_after(const lethe_sparse_method *m, int32_t layer, int32_t len, bool prefill,
                           bool final_chunk);

#endif /* LETHE_SPARSE_SCORED_H */

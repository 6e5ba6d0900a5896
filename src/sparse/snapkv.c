/* snapkv.c - SnapKV (methods.md §4), physical one-shot prompt compaction.
 *
 * The last snapkv_window_size prompt queries (which must lie in the final
 * chunk: min_final_chunk) score the middle tokens [s, L - r); at prompt end
 * each layer keeps sink + top-(decode_keep_tokens) + recent, budget
 * B = s + keep + r. Anchor defaults: logits scoring (max raw logit over
 * window queries and heads), pool kernel 1, decode appends without
 * re-scoring unless snapkv_decode_eviction. The original instead keeps
 * top-(B - w) per query head with softmax sums, maxpool k = 7, and protects
 * no sink (the window is the protected recent set). Runtime: scored.c. */
#include "sparse/scored.h"

static const lethe_sparse_knob knobs[] = {
    {"snapkv_window_size", LETHE_KNOB_INT, "32", 1, 4096, "observation window: last w prompt queries"},
    {"pool_kernel_size", LETHE_KNOB_INT, "1", 1, 63, "1-D max-pool kernel over middle scores (1 = off)"},
    {"sparse_prefill_score_mode", LETHE_KNOB_STR, "logits", 0, 0, "logits | probability"},
    {"snapkv_decode_eviction", LETHE_KNOB_BOOL, "false", 0, 1, "re-score with decode queries and compact"},
    {"decode_eviction_interval", LETHE_KNOB_INT, "1024", 1, 1 << 24, "compact when L >= B + interval"},
};

static lethe_status snapkv_configure(lethe_sparse_method *m) {
    lethe_status st = lethe_scored_configure_common(m);
    if (st != LETHE_OK) return st;
    lethe_scored_priv *p = m->priv;
    for (int32_t l = 0; l < m->env.n_layers; l++)
        p->budget[l] = m->knobs.sink_keep_tokens + m->knobs.decode_keep_tokens + m->knobs.recent_keep_tokens;
    p->decode_eviction = lethe_knob_num(m->ops, &p->kv, "snapkv_decode_eviction") != 0;
    return LETHE_OK;
}

const lethe_sparse_ops lethe_sparse_snapkv = {
    .name = "snapkv",
    .summary = "observation-window scores at prompt end; keep sink + top-k + recent per layer",
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=100000",
                     .small = "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8"},
    .configure = snapkv_configure,
    LETHE_SCORED_OPS,
};

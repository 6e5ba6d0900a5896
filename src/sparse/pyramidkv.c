/* pyramidkv.c - PyramidKV (methods.md §5), SnapKV scoring with layer budgets.
 *
 * The anchor's schedule: ratios linear from pyramidkv_start_ratio (layer 0)
 * to pyramidkv_least_ratio (last layer); budget_l = s + floor(keep * r_l / r_0)
 * + r (lethe_pyramid_budgets). Probability scoring by default and decode
 * eviction on (compact back to budget_l when L >= budget_l + interval). The
 * original (KVCache-Factory) uses beta = 20 with budgets that average to the
 * SnapKV budget (lethe_pyramid_budgets_original), w = 8, maxpool 7. The
 * anchor's full-prefill staging (per-layer compaction right after attention)
 * is not reproduced: lethe compacts at the end of the final chunk, so a
 * prompt's peak residency is the whole prompt, as for SnapKV. */
#include "sparse/scored.h"

static const lethe_sparse_knob knobs[] = {
    {"pyramidkv_start_ratio", LETHE_KNOB_FLOAT, "0.6", 1e-6, 1, "budget ratio at layer 0"},
    {"pyramidkv_least_ratio", LETHE_KNOB_FLOAT, "0.01", 0, 1, "budget ratio at the last layer"},
    {"snapkv_window_size", LETHE_KNOB_INT, "32", 1, 4096, "observation window: last w prompt queries"},
    {"pool_kernel_size", LETHE_KNOB_INT, "1", 1, 63, "1-D max-pool kernel over middle scores (1 = off)"},
    {"sparse_prefill_score_mode", LETHE_KNOB_STR, "probability", 0, 0, "logits | probability"},
    {"pyramidkv_decode_eviction", LETHE_KNOB_BOOL, "true", 0, 1, "re-score with decode queries and compact"},
    {"decode_eviction_interval", LETHE_KNOB_INT, "1024", 1, 1 << 24, "compact when L >= B_l + interval"},
};

static lethe_status pyramid_configure(lethe_sparse_method *m) {
    lethe_status st = lethe_scored_configure_common(m);
    if (st != LETHE_OK) return st;
    lethe_scored_priv *p = m->priv;
    float r0 = (float)lethe_knob_num(m->ops, &p->kv, "pyramidkv_start_ratio");
    float r1 = (float)lethe_knob_num(m->ops, &p->kv, "pyramidkv_least_ratio");
    if (r1 > r0)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config: pyramidkv_least_ratio %g exceeds "
                            "pyramidkv_start_ratio %g (method pyramidkv)", r1, r0);
    lethe_pyramid_budgets(m->env.n_layers, m->knobs.sink_keep_tokens, m->knobs.decode_keep_tokens,
                          m->knobs.recent_keep_tokens, r0, r1, p->budget);
    p->decode_eviction = lethe_knob_num(m->ops, &p->kv, "pyramidkv_decode_eviction") != 0;
    return LETHE_OK;
}

const lethe_sparse_ops lethe_sparse_pyramidkv = {
    .name = "pyramidkv",
    .summary = "SnapKV scoring with budgets shrinking linearly from the first to the last layer",
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    /* keep >> context: even the last layer's budget keep * 0.01 / 0.6 covers it */
    .test_configs = {.identity = "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=100000",
                     .small = "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8"},
    .configure = pyramid_configure,
    LETHE_SCORED_OPS,
};

/* dense.c - the `dense` method: every layer attends to every resident token.
 *
 * The reference every sparse method is measured against, and the engine's
 * default. It uses the shared row layout (all layers keep the same tokens),
 * allows the radix prefix cache, never evicts and never needs scores, so
 * only the two required selection hooks are implemented. Its selection is
 * the same in every layer and ignores q, hence LETHE_SPARSE_UNIFORM (one plan
 * per step, CUDA-graph decode). */
#include "sparse/sparse.h"

static int32_t dense_prefill(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             int32_t seq, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

static int32_t dense_decode(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            int32_t seq, const void *q, int32_t *sel, int32_t cap) {
    (void)q;
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

const lethe_sparse_ops lethe_sparse_dense = {
    .name = "dense",
    .aliases = {"vanilla", "full", "none", NULL},
    .summary = "full attention over every resident token (the reference; radix prefix cache)",
    .flags = LETHE_SPARSE_PREFIX_CACHE | LETHE_SPARSE_UNIFORM,
    .build_prefill_selection = dense_prefill,
    .build_decode_selection = dense_decode,
};

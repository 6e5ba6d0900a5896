/* dense.c - the `dense` method: every layer attends to every resident token.
 *
 * The reference every sparse method is measured against, and the engine's
 * default. It uses the shared row layout (all layers keep the same tokens),
 * allows the radix prefix cache, never evicts and never needs scores: every
 * hook keeps its default (the selection hooks select every resident slot).
 * Its selection is the same in every layer and ignores q, hence
 * LETHE_SPARSE_UNIFORM (one plan per step, CUDA-graph decode). */
#include "sparse/sparse.h"

const lethe_sparse_ops lethe_sparse_dense = {
    .name = "dense",
    .aliases = {"vanilla", "full", "none", NULL},
    .summary = "full attention over every resident token (the reference; radix prefix cache)",
    .kind = LETHE_SPARSE_KIND_DENSE,
    .flags = LETHE_SPARSE_PREFIX_CACHE | LETHE_SPARSE_UNIFORM,
};

/* dummy.h - deterministic random weights for --load-format dummy.
 *
 * Used by loader.c: every tensor is filled from (seed, tensor name) so that
 * two runs (any thread count) build the same model, without weight files. */
#ifndef LETHE_MODEL_DUMMY_H
#define LETHE_MODEL_DUMMY_H

#include <stddef.h>
#include <stdint.h>

typedef enum lethe_dummy_kind {
    LETHE_DUMMY_NORM,    /* RMSNorm weight: all 1.0 */
    LETHE_DUMMY_MATRIX,  /* [out, in] projection: uniform in +-1/sqrt(in) */
    LETHE_DUMMY_EMBED,   /* [vocab, dim] embedding: uniform in +-1/sqrt(dim) */
    LETHE_DUMMY_BIAS,    /* bias: uniform in +-0.02 */
} lethe_dummy_kind;

/* Fills dst[n]; `in_dim` is the row length (fan-in) for MATRIX / EMBED. */
void lethe_dummy_fill(float *dst, size_t n, lethe_dummy_kind kind, int64_t in_dim, uint64_t seed,
                      const char *name);

#endif /* LETHE_MODEL_DUMMY_H */

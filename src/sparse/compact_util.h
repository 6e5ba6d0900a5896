/* compact_util.h - the bookkeeping of decode-time compaction that R-KV and
 * SkipKV share (methods.md §8, §9).
 *
 * Both keep one token set for every layer (per-layer rows of equal length),
 * compact a decoding row when it reaches L >= B + interval tokens (B = sink +
 * keep + recent, used as a total), accumulate a per-token score vector [L]
 * over the layers of that step (after_attn) and apply the keep set in
 * finish_step. What differs is the score and how the keep set is chosen; that
 * stays in each method's file. */
#ifndef LETHE_SPARSE_COMPACT_UTIL_H
#define LETHE_SPARSE_COMPACT_UTIL_H

#include <stdbool.h>
#include <stdint.h>

#include "sparse/sparse.h"

typedef struct lethe_decode_compact {
    int32_t budget;   /* B = sink + keep + recent */
    int32_t interval; /* compact at L >= B + interval */
    uint8_t *compact; /* [n_seqs] of the current step: this step compacts the sequence */
    int32_t cap;      /* capacity of compact */
} lethe_decode_compact;

/* A request's score vector of the compaction in progress: v[0, n) over its
 * row's entries (n = the row length when the step began; 0: none). */
typedef struct lethe_compact_scores {
    float *v;
    int32_t n;
} lethe_compact_scores;

/* budget from the shared knobs, interval from the method's own knob */
void lethe_decode_compact_configure(const lethe_sparse_method *m, lethe_decode_compact *dc,
                                    int32_t interval);
void lethe_decode_compact_free(lethe_decode_compact *dc);
/* prepare: marks the decoding sequences whose row (layer 0) reached B +
 * interval in dc->compact[0, st->n_seqs) */
void lethe_decode_compact_plan(lethe_sparse_method *m, lethe_decode_compact *dc,
                               const lethe_sparse_step *st);
/* true if this step compacts any sequence */
bool lethe_decode_compact_any(const lethe_decode_compact *dc, const lethe_sparse_step *st);
/* sizes s to the row's length L and zeroes it */
void lethe_compact_scores_reset(lethe_compact_scores *s, int32_t L);
void lethe_compact_scores_free(lethe_compact_scores *s);
/* finish_step: adds the row's pinned entries to keep[0, n) (capacity >= the
 * row's length), then keeps those entries in every layer (the rows are
 * equal: one token set) */
void lethe_decode_compact_apply(lethe_sparse_method *m, int32_t row, int32_t *keep, int32_t n);
/* max_resident: a row never passes B + interval tokens after its prompt */
int32_t lethe_decode_compact_max_resident(const lethe_decode_compact *dc, int32_t n_prompt,
                                          int32_t n_total);

#endif /* LETHE_SPARSE_COMPACT_UTIL_H */

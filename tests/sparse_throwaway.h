/* sparse_throwaway.h - a sparse method that exists only in the tests, to
 * prove the contract's claim that a method is one file plus one registry
 * line: test_sparse_methods and test_sparse_conformance register it with
 * lethe_sparse_register_extra and their generic suites (which iterate the
 * registry and read each method's test_configs) then run it like the
 * built-ins, with no test naming it.
 *
 * `recent_window`: physical eviction keeping only the last r =
 * recent_keep_tokens tokens of every layer: at the end of the prompt a row
 * is cut to r, during decode it grows to 2 r and is cut back to r. Every
 * other hook keeps its default (the selections read every resident slot). */
#ifndef LETHE_TESTS_SPARSE_THROWAWAY_H
#define LETHE_TESTS_SPARSE_THROWAWAY_H

#include <stdlib.h>

#include "core/util.h"
#include "sparse/sparse.h"

static lethe_status rw_configure(lethe_sparse_method *m) {
    if (m->knobs.recent_keep_tokens < 1)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config recent_keep_tokens=%d: recent_window "
                            "keeps at least one token", m->knobs.recent_keep_tokens);
    return LETHE_OK;
}

static void rw_finish_step(lethe_sparse_method *m, const lethe_sparse_step *st) {
    const int32_t r = m->knobs.recent_keep_tokens;
    int32_t *keep = lethe_xmalloc((size_t)r * sizeof(int32_t));
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        for (int32_t l = 0; l < m->env.n_layers; l++) {
            const int32_t L = lethe_sparse_row_len(m, l, q->row);
            const bool cut = q->is_prefill ? q->is_final_chunk && L > r : L >= 2 * r;
            if (!cut) continue;
            for (int32_t j = 0; j < r; j++) keep[j] = L - r + j; /* the last r entries */
            lethe_kv_keep(m->env.pool, l, q->row, keep, r);
        }
    }
    free(keep);
}

static int32_t rw_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                               int32_t n_total, int32_t chunk) {
    return LETHE_MIN(n_total, LETHE_MAX(n_prompt, 2 * m->knobs.recent_keep_tokens));
}

static const lethe_sparse_ops throwaway_recent_window = {
    .name = "recent_window",
    .summary = "keep the last recent_keep_tokens tokens per layer (a test-only method)",
    .kind = LETHE_SPARSE_KIND_EVICTION,
    .flags = LETHE_SPARSE_PER_LAYER_ROWS,
    .shared_knobs = LETHE_USES_RECENT,
    .test_configs = {.identity = "recent_keep_tokens=1000", .small = "recent_keep_tokens=6"},
    .max_resident = rw_max_resident,
    .configure = rw_configure,
    .finish_step = rw_finish_step,
};

#endif /* LETHE_TESTS_SPARSE_THROWAWAY_H */

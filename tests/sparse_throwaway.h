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
 * other hook keeps its default (the selections read every resident slot).
 * `plane_copy` (below) does the same for the payload-layout seam. */
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
    int32_t *keep = NULL;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        for (int32_t l = 0; l < m->env.n_layers; l++) {
            const int32_t L = lethe_sparse_row_len(m, l, q->row);
            const bool cut = q->is_prefill ? q->is_final_chunk && L > r : L >= 2 * r;
            if (!cut) continue;
            /* the last r entries (and any retention-pinned ones: the shared keep-set builder) */
            keep = lethe_xrealloc(keep, (size_t)L * sizeof(int32_t));
            const int32_t n = lethe_sparse_keep_set(m, l, q->row, NULL, 0, r, 0, keep);
            lethe_kv_keep(m->env.pool, l, q->row, keep, n);
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

/* `plane_copy`: a COMPRESSION method whose payload is a layout of its own
 * (backend.h lethe_kv_layout): planes "k" and "v" as the backend stores them
 * plus a "pos" plane of one int32 per slot (the token's position, written by
 * kv_store on a host-memory backend and checked by kv_attend), so a slot costs
 * 2 kv_dim kv_size + 4 bytes per layer and the pool must hold exactly
 * budget / that many slots. kv_store / kv_attend go through the backend's
 * kv_store and attention ops, so outputs are bit-identical to dense: the
 * proof that the engine and the model write and read a declared payload only
 * through the method's path. */
static bool pc_layout(const lethe_sparse_method *m, int32_t layer, lethe_kv_layout *out) {
    if (!m->env.be) return false; /* the fake model: bookkeeping only */
    const size_t kv = (size_t)m->env.n_kv_heads * m->env.head_dim * m->env.be->ops->kv_size;
    *out = (lethe_kv_layout){.n_planes = 3,
                             .planes = {{"k", kv}, {"v", kv}, {"pos", sizeof(int32_t)}}};
    return true;
}
static void pc_store(lethe_sparse_method *m, int32_t layer, const void *k, const void *v,
                     const int32_t *slots, const int32_t *pos, int32_t n) {
    lethe_backend *be = m->env.be;
    lethe_kv_pool *pool = m->env.pool;
    be->ops->kv_store(be, lethe_kv_plane_buf(pool, layer, 0), lethe_kv_plane_buf(pool, layer, 1), k, v,
                      slots, n, m->env.n_kv_heads * m->env.head_dim);
    if (lethe_backend_has(be, LETHE_BE_HOST_MEMORY)) {
        int32_t *tag = lethe_kv_plane_buf(pool, layer, 2);
        for (int32_t i = 0; i < n; i++) tag[slots[i]] = pos[i];
    }
}
static void pc_attend(lethe_sparse_method *m, int32_t layer, const lethe_attn_args *a) {
    lethe_backend *be = m->env.be;
    if (lethe_backend_has(be, LETHE_BE_HOST_MEMORY)) { /* every selected slot was stored */
        const int32_t *tag = lethe_kv_plane_buf(m->env.pool, layer, 2);
        for (int32_t j = 0; j < a->sel_begin[a->n_seqs]; j++) LETHE_ASSERT(tag[a->sel_slots[j]] >= 0);
    }
    LETHE_ASSERT(a->k_cache == lethe_kv_plane_buf(m->env.pool, layer, 0));
    be->ops->attention(be, a);
}

static const lethe_sparse_ops throwaway_plane_copy = {
    .name = "plane_copy",
    .summary = "K and V in a payload layout of its own plus a position plane (a test-only method)",
    .kind = LETHE_SPARSE_KIND_COMPRESSION,
    .kv_layout = pc_layout,
    .kv_store = pc_store,
    .kv_attend = pc_attend,
};

#endif /* LETHE_TESTS_SPARSE_THROWAWAY_H */

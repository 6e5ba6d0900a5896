/* compact_util.c - decode-time compaction bookkeeping of R-KV and SkipKV
 * (compact_util.h). */
#include "sparse/compact_util.h"

#include <stdlib.h>

#include "core/util.h"

void lethe_decode_compact_configure(const lethe_sparse_method *m, lethe_decode_compact *dc,
                                    int32_t interval) {
    dc->budget = m->knobs.sink_keep_tokens + m->knobs.decode_keep_tokens +
                 m->knobs.recent_keep_tokens;
    dc->interval = interval;
}

void lethe_decode_compact_free(lethe_decode_compact *dc) {
    free(dc->compact);
    dc->compact = NULL;
    dc->cap = 0;
}

void lethe_decode_compact_plan(lethe_sparse_method *m, lethe_decode_compact *dc,
                               const lethe_sparse_step *st) {
    if (st->n_seqs > dc->cap) {
        dc->cap = st->n_seqs;
        dc->compact = lethe_xrealloc(dc->compact, (size_t)dc->cap);
    }
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        dc->compact[i] = !q->is_prefill &&
                         lethe_sparse_row_len(m, 0, q->row) >= dc->budget + dc->interval;
    }
}

bool lethe_decode_compact_any(const lethe_decode_compact *dc, const lethe_sparse_step *st) {
    for (int32_t i = 0; st && i < st->n_seqs; i++)
        if (dc->compact[i]) return true;
    return false;
}

void lethe_compact_scores_reset(lethe_compact_scores *s, int32_t L) {
    s->v = lethe_xrealloc(s->v, ((size_t)L + 1) * sizeof(float));
    for (int32_t j = 0; j < L; j++) s->v[j] = 0.0f;
    s->n = L;
}

void lethe_compact_scores_free(lethe_compact_scores *s) {
    free(s->v);
    s->v = NULL;
    s->n = 0;
}

void lethe_decode_compact_apply(lethe_sparse_method *m, int32_t row, int32_t *keep, int32_t n) {
    const int32_t L = lethe_sparse_row_len(m, 0, row);
    n = lethe_sparse_keep_add_pins(m, 0, row, keep, n); /* pinned tokens stay (may exceed B) */
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        LETHE_ASSERT(lethe_sparse_row_len(m, l, row) == L); /* one token set: equal rows */
        lethe_kv_keep(m->env.pool, l, row, keep, n);
    }
}

int32_t lethe_decode_compact_max_resident(const lethe_decode_compact *dc, int32_t n_prompt,
                                          int32_t n_total) {
    return LETHE_MIN(n_total, LETHE_MAX(n_prompt + 1, dc->budget + dc->interval));
}

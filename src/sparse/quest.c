/* quest.c - Quest (methods.md §10), logical query-aware page selection.
 *
 * The row is split into pages of quest_chunk_size (16) tokens. Per page and
 * layer the method keeps the elementwise min and max of the page's keys
 * (post-RoPE, [n_kv_heads, head_dim] each), folded in as pages complete (read
 * back through kv->read_kv). At a decode step, in layers >= quest_skip_layers,
 * a row longer than the budget B = s + keep + r (the knobs only define the
 * total, as in the anchor) reads K = max(3, B / page) pages: the page(s)
 * holding the new token(s) always, plus the top pages among the completed ones
 * by the upper bound U_p = sum_c max(q_c M_c, q_c m_c), max over all query
 * heads (one page set per layer, the anchor; the original selects per head).
 * Prefill is dense; nothing is ever freed. Keys and the query are read on the
 * host (CPU backend); without host-readable KV (the fake runner) every layer
 * reads densely, and on CUDA the page-bound and top-k ops need their twins. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

typedef struct quest_priv {
    lethe_knob_values kv;
    int32_t budget, page, skip;
    float *q;                   /* [n_heads * head_dim] host copy of the decode query */
} quest_priv;
#define PRIV(m) ((quest_priv *)(m)->priv)

typedef struct quest_layer {
    float *kmin, *kmax;         /* [cap_pages, kv_dim] */
    int32_t n_pages, cap_pages; /* complete pages folded */
} quest_layer;

typedef struct quest_state {
    quest_layer *layer;         /* [n_layers] */
} quest_state;

static const lethe_sparse_knob knobs[] = {
    {"quest_chunk_size", LETHE_KNOB_INT, "16", 1, 4096, "page size in tokens"},
    {"quest_skip_layers", LETHE_KNOB_INT, "2", 0, 1 << 16, "first layers stay dense"},
};

static lethe_status quest_init(lethe_sparse_method *m) {
    quest_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    p->q = lethe_xcalloc((size_t)m->env.n_heads * m->env.head_dim, sizeof(float));
    m->priv = p;
    return LETHE_OK;
}
static void quest_destroy(lethe_sparse_method *m) {
    quest_priv *p = PRIV(m);
    if (!p) return;
    free(p->q);
    free(p);
    m->priv = NULL;
}
static lethe_status quest_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status quest_configure(lethe_sparse_method *m) {
    quest_priv *p = PRIV(m);
    p->budget = m->knobs.sink_keep_tokens + m->knobs.decode_keep_tokens + m->knobs.recent_keep_tokens;
    p->page = (int32_t)lethe_knob_num(m->ops, &p->kv, "quest_chunk_size");
    p->skip = (int32_t)lethe_knob_num(m->ops, &p->kv, "quest_skip_layers");
    if (m->env.be && !lethe_sparse_kv_host_ok(m))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "--sparse-method quest: the %s backend's KV is not "
                            "host-readable (the Quest page ops have no twin there yet)",
                            m->env.be->ops->name);
    return LETHE_OK;
}

static lethe_status quest_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    quest_state *qs = lethe_xcalloc(1, sizeof(*qs));
    qs->layer = lethe_xcalloc((size_t)m->env.n_layers, sizeof(quest_layer));
    *state = qs;
    return LETHE_OK;
}

static void quest_request_finished(lethe_sparse_method *m, void *state) {
    quest_state *qs = state;
    if (!qs) return;
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        free(qs->layer[l].kmin);
        free(qs->layer[l].kmax);
    }
    free(qs->layer);
    free(qs);
}

/* folds the complete pages among the first n_stored entries into the bounds */
static void fold_pages(lethe_sparse_method *m, const lethe_sparse_seq *q, int32_t layer, int32_t n_stored) {
    quest_priv *p = PRIV(m);
    quest_layer *ql = &((quest_state *)q->state)->layer[layer];
    int32_t want = n_stored / p->page;
    if (want <= ql->n_pages) return;
    size_t kv_dim = (size_t)m->env.n_kv_heads * m->env.head_dim;
    if (want > ql->cap_pages) {
        int32_t cap = LETHE_MAX(want, 2 * ql->cap_pages);
        ql->kmin = lethe_xrealloc(ql->kmin, (size_t)cap * kv_dim * sizeof(float));
        ql->kmax = lethe_xrealloc(ql->kmax, (size_t)cap * kv_dim * sizeof(float));
        ql->cap_pages = cap;
    }
    const float *K = lethe_sparse_kv_host(m, layer, false);
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, lethe_kv_space_of(m->env.pool, layer), q->row);
    for (int32_t t = ql->n_pages * p->page; t < want * p->page; t++) {
        size_t pg = (size_t)(t / p->page) * kv_dim;
        lethe_page_minmax_add(ql->kmin + pg, ql->kmax + pg, K + (size_t)slots[t] * kv_dim,
                              (int32_t)kv_dim, t % p->page == 0);
    }
    ql->n_pages = want;
}

static int32_t quest_prefill(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             int32_t seq, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

static int32_t quest_decode(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            int32_t seq, const void *qact, int32_t *sel, int32_t cap) {
    quest_priv *p = PRIV(m);
    const lethe_sparse_seq *q = &st->seqs[seq];
    int32_t L = lethe_sparse_row_len(m, layer, q->row);
    if (layer < p->skip || L <= p->budget || !m->env.be)
        return lethe_sparse_select_all(m, layer, q->row, sel, cap);
    int32_t P = p->page, n_stored = L - q->n_new, n_done = n_stored / P;
    int32_t n_pages = LETHE_CEIL_DIV(L, P), n_cur = n_pages - n_done; /* pages holding new tokens */
    int32_t K = LETHE_MAX(3, p->budget / P);
    if (K >= n_pages) return lethe_sparse_select_all(m, layer, q->row, sel, cap);
    fold_pages(m, q, layer, n_stored);
    /* the decode query (the sequence's last new row) to host */
    size_t hd = (size_t)m->env.n_heads * m->env.head_dim;
    lethe_backend *be = m->env.be;
    be->ops->act_to_host(be, p->q, (const char *)qact + (size_t)(q->q_row + q->n_new - 1) * hd * be->ops->act_size, hd);
    quest_layer *ql = &((quest_state *)q->state)->layer[layer];
    float *u = lethe_xmalloc((size_t)n_done * sizeof(float));
    lethe_quest_page_scores(p->q, m->env.n_heads, m->env.n_kv_heads, m->env.head_dim, ql->kmin,
                            ql->kmax, n_done, u);
    int32_t *pages = lethe_xmalloc((size_t)n_done * sizeof(int32_t));
    int32_t np = lethe_topk_indices(u, n_done, LETHE_MAX(0, K - n_cur), pages);
    int32_t n = 0;
    for (int32_t i = 0; i < np; i++)
        for (int32_t t = pages[i] * P; t < (pages[i] + 1) * P; t++) sel[n++] = t;
    for (int32_t t = n_done * P; t < L; t++) sel[n++] = t; /* current page(s) */
    LETHE_ASSERT(n <= cap);
    free(pages);
    free(u);
    lethe_sparse_entries_to_slots(m, layer, q->row, sel, n);
    return n;
}

const lethe_sparse_ops lethe_sparse_quest = {
    .name = "quest",
    .aliases = {NULL},
    .summary = "decode reads the pages with the highest key min/max upper bound; nothing freed",
    .flags = LETHE_SPARSE_PREFIX_CACHE,
    .init = quest_init,
    .destroy = quest_destroy,
    .set_knob = quest_set_knob,
    .request_init = quest_request_init,
    .request_finished = quest_request_finished,
    .build_prefill_selection = quest_prefill,
    .build_decode_selection = quest_decode,
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .configure = quest_configure,
};

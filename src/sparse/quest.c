/* quest.c - Quest (methods.md §10), logical query-aware page selection.
 *
 * The row is split into pages of quest_chunk_size (P = 16) row entries (the
 * slots of a page are arbitrary slot ids). Per page and layer the method keeps
 * the elementwise min and max of the page's keys (post-RoPE, [n_kv_heads,
 * head_dim] each) in a backend buffer it owns, so on CUDA the bounds live and
 * are scored on the device. At a decode step, in layers >= quest_skip_layers,
 * a row longer than the budget B = s + keep + r (the knobs only define the
 * total, as in the anchor) reads K = max(3, B / P) pages: the page(s) holding
 * the new token(s) always, plus the top pages among the completed ones by the
 * upper bound U_p = sum_c max(q_c M_c, q_c m_c), max over all query heads (one
 * page set per layer, the anchor; the original selects per head). Prefill is
 * dense; nothing is ever freed. Without a backend (the fake runner) every
 * layer reads densely.
 *
 * Device state. Per layer >= skip, meta[l] = [n_meta, 2, kv_dim] in the KV
 * element type (backend.h page_minmax), n_meta = n_slots / P, allocated at the
 * first request and counted in the pool budget (slot_overhead_bytes). Rows are
 * shared by all layers, so row page p of a request has ONE meta page id,
 * page_id[p], in every layer (ids from one free stack, returned when the
 * request ends). Only completed pages among the stored entries get bounds:
 * the page holding new tokens is always read, and this step's K is stored
 * after the selection is built.
 *
 * Freshness. n_valid[l] = leading row pages whose bounds are current in
 * layer l. The pool's page_meta_valid watermark (kv_pool.h, 16-entry pages)
 * says where a row last changed (append, compaction, release); prepare()
 * lowers n_valid to the first Quest page at or after that entry and raises
 * the watermark to the row's end. A layer's decode then refreshes only pages
 * [n_valid[l], n_done): one page a step in steady state, every page on the
 * first decode after prefill.
 *
 * Per layer and step, the first decode call does the work of every decode
 * sequence at once: one page_minmax call (the stale pages of all sequences),
 * one page_scores call (each sequence's query against its completed pages,
 * host float [n_pages] per sequence back); each sequence's call then runs the
 * host top-k over its scores and builds its slot list. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

/* a growable host int32 / float array */
typedef struct ivec {
    int32_t *v;
    int32_t cap;
} ivec;
typedef struct fvec {
    float *v;
    int32_t cap;
} fvec;

typedef struct quest_priv {
    lethe_knob_values kv;
    int32_t budget, page, skip;
    bool always;                /* score pages even when the budget covers the row */
    /* page bounds */
    void **meta;                /* [n_layers]: [n_meta, 2, kv_dim] KV type; NULL below skip */
    int32_t n_meta;             /* meta pages per layer (0: not allocated yet / none fit) */
    int32_t *free_ids, n_free;  /* free meta page ids */
    bool meta_ready, warned_full;
    /* one layer's work for the whole step, done at its first decode call */
    int64_t step;               /* prepare() count */
    int64_t done_step;
    int32_t done_layer;
    ivec off, n_done, take;     /* per step sequence: offset into u (-1 = dense), pages, top-k size */
    fvec u;                     /* page scores of every scored sequence */
    /* op arguments (host): page_minmax, page_scores; top-k output */
    ivec mm_ids, mm_beg, mm_slots;
    ivec sc_rows, sc_beg, sc_ids;
    ivec top;
} quest_priv;
#define PRIV(m) ((quest_priv *)(m)->priv)

typedef struct quest_state {
    int32_t *page_id;           /* [cap] meta page id of row page p (all layers) */
    int32_t n_ids, cap;
    int32_t *n_valid;           /* [n_layers] leading row pages with current bounds */
} quest_state;

static const lethe_sparse_knob knobs[] = {
    {"quest_chunk_size", LETHE_KNOB_INT, "16", 1, 4096, "page size in tokens"},
    {"quest_skip_layers", LETHE_KNOB_INT, "2", 0, 1 << 16, "first layers stay dense"},
    {"quest_always_score", LETHE_KNOB_BOOL, "false", 0, 1,
     "score pages even when the budget covers the row (tests, op cost): then every page is read"},
};

/* grows an array to hold at least `need` elements of `elem` bytes */
static void *grow(void *p, int32_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return p;
    LETHE_ASSERT(need <= INT32_MAX / 2);
    int32_t c = LETHE_MAX((int32_t)need, 2 * *cap);
    *cap = c;
    return lethe_xrealloc(p, (size_t)c * elem);
}
static int32_t *iv(ivec *a, int64_t need) { return a->v = grow(a->v, &a->cap, need, sizeof(int32_t)); }

static lethe_status quest_init(lethe_sparse_method *m) {
    quest_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    p->meta = lethe_xcalloc((size_t)m->env.n_layers, sizeof(void *));
    p->done_step = -1;
    m->priv = p;
    return LETHE_OK;
}

static void quest_destroy(lethe_sparse_method *m) {
    quest_priv *p = PRIV(m);
    if (!p) return;
    for (int32_t l = 0; l < m->env.n_layers; l++)
        if (p->meta[l]) m->env.be->ops->release(m->env.be, p->meta[l]);
    free(p->meta);
    free(p->free_ids);
    ivec *arrays[] = {&p->off, &p->n_done, &p->take, &p->mm_ids, &p->mm_beg,
                      &p->mm_slots, &p->sc_rows, &p->sc_beg, &p->sc_ids, &p->top};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(arrays); i++) free(arrays[i]->v);
    free(p->u.v);
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
    p->always = lethe_knob_num(m->ops, &p->kv, "quest_always_score") != 0;
    return LETHE_OK;
}

static int32_t meta_layers(const lethe_sparse_method *m) {
    return LETHE_MAX(0, m->env.n_layers - PRIV(m)->skip);
}

/* n_meta = n_slots / P pages per layer of 2 * kv_dim KV elements */
static size_t quest_slot_overhead(const lethe_sparse_method *m) {
    if (!m->env.be) return 0;
    size_t per_page = (size_t)meta_layers(m) * 2u * (size_t)m->env.n_kv_heads *
                      (size_t)m->env.head_dim * m->env.be->ops->kv_size;
    return LETHE_CEIL_DIV(per_page, (size_t)PRIV(m)->page);
}

/* the page-bounds buffers, at the first request (the pool exists by then) */
static lethe_status meta_init(lethe_sparse_method *m) {
    quest_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    p->meta_ready = true;
    LETHE_ASSERT(!lethe_kv_per_layer(m->env.pool)); /* shared rows: one page id for all layers */
    int32_t n = lethe_kv_n_slots(m->env.pool) / p->page;
    if (!be || n == 0 || meta_layers(m) == 0) return LETHE_OK; /* every layer reads densely */
    size_t bytes = (size_t)n * 2u * (size_t)m->env.n_kv_heads * (size_t)m->env.head_dim * be->ops->kv_size;
    for (int32_t l = p->skip; l < m->env.n_layers; l++) {
        lethe_status st = be->ops->alloc(be, bytes, &p->meta[l]);
        if (st != LETHE_OK) {
            char why[256];
            snprintf(why, sizeof(why), "%s", lethe_last_error());
            for (int32_t j = p->skip; j < l; j++) be->ops->release(be, p->meta[j]), p->meta[j] = NULL;
            p->meta_ready = false; /* the next request tries again */
            return lethe_errorf(st, "quest: page bounds of layer %d (%d pages, %zu bytes): %s", l, n,
                                bytes, why);
        }
    }
    p->n_meta = n;
    p->free_ids = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) p->free_ids[i] = n - 1 - i; /* pops 0 first */
    p->n_free = n;
    return LETHE_OK;
}

static lethe_status quest_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    if (!PRIV(m)->meta_ready) {
        lethe_status st = meta_init(m);
        if (st != LETHE_OK) return st;
    }
    quest_state *qs = lethe_xcalloc(1, sizeof(*qs));
    qs->n_valid = lethe_xcalloc((size_t)m->env.n_layers, sizeof(int32_t));
    *state = qs;
    return LETHE_OK;
}

static void quest_request_finished(lethe_sparse_method *m, void *state) {
    quest_priv *p = PRIV(m);
    quest_state *qs = state;
    if (!qs) return;
    for (int32_t i = qs->n_ids - 1; i >= 0; i--) {
        LETHE_ASSERT(p->n_free < p->n_meta);
        p->free_ids[p->n_free++] = qs->page_id[i];
    }
    free(qs->page_id);
    free(qs->n_valid);
    free(qs);
}

/* gives the request meta page ids for its first n row pages; false when the
 * ids ran out (rows sharing prefix slots can hold more pages than n_slots / P) */
static bool ensure_ids(quest_priv *p, quest_state *qs, int32_t n) {
    if (n <= qs->n_ids) return true;
    if (n - qs->n_ids > p->n_free) return false;
    qs->page_id = grow(qs->page_id, &qs->cap, n, sizeof(int32_t));
    while (qs->n_ids < n) qs->page_id[qs->n_ids++] = p->free_ids[--p->n_free];
    return true;
}

/* consumes the pool's change watermark of the row (see the top comment) */
static void note_changes(lethe_sparse_method *m, const lethe_sparse_seq *q) {
    quest_state *qs = q->state;
    if (!qs) return;
    lethe_kv_pool *pool = m->env.pool;
    int32_t sp = lethe_kv_space_of(pool, 0);
    int32_t first = lethe_kv_page_meta_valid(pool, sp, q->row) * LETHE_KV_PAGE; /* first changed entry */
    int32_t lim = first / PRIV(m)->page;
    for (int32_t l = 0; l < m->env.n_layers; l++)
        if (qs->n_valid[l] > lim) qs->n_valid[l] = lim;
    lethe_kv_page_meta_set_valid(pool, sp, q->row,
                                 LETHE_CEIL_DIV(lethe_kv_row_len(pool, sp, q->row), LETHE_KV_PAGE));
}

static void quest_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    PRIV(m)->step++;
    for (int32_t s = 0; s < st->n_seqs; s++) note_changes(m, &st->seqs[s]);
}

/* Completed pages to score for a decode sequence in `layer` (and how many of
 * them the top-k keeps), or -1: read the row densely. */
static int32_t plan_pages(const lethe_sparse_method *m, int32_t layer, const lethe_sparse_seq *q,
                          int32_t *take) {
    const quest_priv *p = PRIV(m);
    if (layer < p->skip || !p->meta[layer] || !q->state) return -1;
    int32_t L = lethe_sparse_row_len(m, layer, q->row);
    if (L <= p->budget && !p->always) return -1;
    int32_t P = p->page, n_done = (L - q->n_new) / P;
    int32_t n_pages = LETHE_CEIL_DIV(L, P), n_cur = n_pages - n_done; /* pages holding new tokens */
    int32_t K = LETHE_MAX(3, p->budget / P);
    if ((K >= n_pages && !p->always) || n_done == 0) return -1;
    *take = LETHE_MAX(0, K - n_cur);
    return n_done;
}

/* refreshes stale bounds and scores the completed pages of every decode
 * sequence of the step in `layer` (two backend ops) */
static void score_layer(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                        const void *qact) {
    quest_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    lethe_kv_pool *pool = m->env.pool;
    const int32_t P = p->page, n_seqs = st->n_seqs;
    p->done_step = p->step;
    p->done_layer = layer;
    int32_t *off = iv(&p->off, n_seqs), *n_done = iv(&p->n_done, n_seqs), *take = iv(&p->take, n_seqs);
    int32_t n_mm = 0, n_mm_slots = 0, n_sc = 0, n_sc_ids = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_sparse_seq *q = &st->seqs[s];
        quest_state *qs = q->state;
        off[s] = -1;
        if (q->is_prefill) continue;
        int32_t nd = plan_pages(m, layer, q, &take[s]);
        if (nd < 0) continue;
        if (!ensure_ids(p, qs, nd)) {
            if (!p->warned_full)
                LOG_WARN("quest: page-bound pages exhausted (%d per layer; rows sharing prefix slots "
                         "hold more pages than the pool): such rows read densely", p->n_meta);
            p->warned_full = true;
            continue;
        }
        /* stale pages [n_valid, nd) of this layer: their slots in entry order */
        const int32_t v = LETHE_MIN(qs->n_valid[layer], nd);
        const int32_t *row_slots = lethe_kv_row_slots(pool, lethe_kv_space_of(pool, layer), q->row);
        iv(&p->mm_ids, n_mm + (nd - v));
        iv(&p->mm_beg, n_mm + (nd - v) + 1);
        iv(&p->mm_slots, n_mm_slots + (int64_t)(nd - v) * P);
        for (int32_t pg = v; pg < nd; pg++) {
            p->mm_ids.v[n_mm] = qs->page_id[pg];
            p->mm_beg.v[n_mm++] = n_mm_slots;
            memcpy(p->mm_slots.v + n_mm_slots, row_slots + (size_t)pg * P, (size_t)P * sizeof(int32_t));
            n_mm_slots += P;
        }
        qs->n_valid[layer] = nd;
        /* scoring: the sequence's last query row against its pages [0, nd) */
        iv(&p->sc_rows, n_sc + 1);
        iv(&p->sc_beg, n_sc + 2);
        iv(&p->sc_ids, n_sc_ids + nd);
        p->sc_rows.v[n_sc] = q->q_row + q->n_new - 1;
        p->sc_beg.v[n_sc++] = n_sc_ids;
        memcpy(p->sc_ids.v + n_sc_ids, qs->page_id, (size_t)nd * sizeof(int32_t));
        off[s] = n_sc_ids;
        n_done[s] = nd;
        n_sc_ids += nd;
    }
    if (n_mm) {
        p->mm_beg.v[n_mm] = n_mm_slots;
        be->ops->page_minmax(be, p->meta[layer], lethe_kv_k(pool, layer), p->mm_ids.v, p->mm_beg.v,
                             p->mm_slots.v, n_mm, m->env.n_kv_heads * m->env.head_dim);
    }
    if (n_sc) {
        p->sc_beg.v[n_sc] = n_sc_ids;
        p->u.v = grow(p->u.v, &p->u.cap, n_sc_ids, sizeof(float));
        be->ops->page_scores(be, p->u.v, qact, p->meta[layer], n_sc, p->sc_rows.v, p->sc_beg.v,
                             p->sc_ids.v, m->env.n_heads, m->env.n_kv_heads, m->env.head_dim, false);
    }
}

static int32_t quest_prefill(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             int32_t seq, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

static int32_t quest_decode(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            int32_t seq, const void *qact, int32_t *sel, int32_t cap) {
    quest_priv *p = PRIV(m);
    const lethe_sparse_seq *q = &st->seqs[seq];
    if (layer < p->skip || !p->meta[layer]) return lethe_sparse_select_all(m, layer, q->row, sel, cap);
    if (p->done_step != p->step || p->done_layer != layer) score_layer(m, layer, st, qact);
    if (p->off.v[seq] < 0) return lethe_sparse_select_all(m, layer, q->row, sel, cap);
    const int32_t P = p->page, nd = p->n_done.v[seq], L = lethe_sparse_row_len(m, layer, q->row);
    int32_t *top = iv(&p->top, nd);
    int32_t np = lethe_topk_indices(p->u.v + p->off.v[seq], nd, p->take.v[seq], top);
    /* the chosen pages' slots, then the current page(s): whole pages of the
     * row, copied as runs (ascending entries, as entries_to_slots wants) */
    lethe_kv_pool *pool = m->env.pool;
    const int32_t *slots = lethe_kv_row_slots(pool, lethe_kv_space_of(pool, layer), q->row);
    int32_t n = 0;
    for (int32_t i = 0; i < np; i++) {
        LETHE_ASSERT(top[i] < nd && (i == 0 || top[i] > top[i - 1]));
        memcpy(sel + n, slots + (size_t)top[i] * P, (size_t)P * sizeof(int32_t));
        n += P;
    }
    LETHE_ASSERT(n + (L - nd * P) <= cap);
    memcpy(sel + n, slots + (size_t)nd * P, (size_t)(L - nd * P) * sizeof(int32_t));
    return n + (L - nd * P);
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
    .prepare = quest_prepare,
    .build_prefill_selection = quest_prefill,
    .build_decode_selection = quest_decode,
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .configure = quest_configure,
    .slot_overhead_bytes = quest_slot_overhead,
};

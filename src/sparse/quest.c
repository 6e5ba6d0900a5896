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
 * page set per layer, the anchor: quest_granularity=shared), or per KV head
 * (quest_granularity=head: U_p maxed over the KV head's query heads, each KV
 * head reads its own top pages, the GQA form of the paper's per-head
 * selection). Prefill is dense; nothing is ever freed. Without a backend (the
 * fake runner) every layer reads densely.
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
 * Selection on the backend (select_layer, once per layer for the whole
 * step, no host sync), with G = 1 group (shared) or G = n_kv_heads (head):
 * one page_minmax call (the stale pages of every decode sequence), one
 * page_scores call into device scratch u ([G * sum n_done] f32: each
 * sequence's last query row against its completed pages, [G, n_done] per
 * sequence), one topk call (per sequence and group the best min(take,
 * n_done) pages, ascending), one select_expand call (per sequence and group
 * the chosen pages' entries, then the current page(s), mapped to slots
 * through the engine's staged full rows). Shared: one selection per
 * sequence (LETHE_SEL_BUILT). Head: one list per (sequence, KV head)
 * (LETHE_SEL_BUILT_HEADS: attention reads per KV head, the varlen path), all
 * of the same length. A layer where no sequence needs scoring reads the full
 * rows (LETHE_SEL_FULL). Bounds count as current only once their
 * page_minmax is issued: a layer that falls back to the full rows (no
 * scratch memory) leaves them stale, to be refreshed next time. Without a
 * backend (select_layer answers PER_SEQ) the selection hooks keep their
 * default: the whole row. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

/* a growable host int32 array */
typedef struct ivec {
    int32_t *v;
    int32_t cap;
} ivec;

typedef struct quest_priv {
    lethe_knob_values kv;
    int32_t budget, page, skip;
    int32_t groups;             /* page sets per sequence: 1 (shared) or n_kv_heads (head) */
    bool always;                /* score pages even when the budget covers the row */
    /* page bounds */
    void **meta;                /* [n_layers]: [n_meta, 2, kv_dim] KV type; NULL below skip */
    int32_t n_meta;             /* meta pages per layer (0: not allocated yet / none fit) */
    int32_t *free_ids, n_free;  /* free meta page ids */
    bool meta_ready, warned_full;
    /* op arguments (host): page_minmax, page_scores, topk, select_expand;
     * per (sequence, group): sg_beg (score segments), top_beg, ex, sel_beg */
    ivec mm_ids, mm_beg, mm_slots;
    ivec sc_rows, sc_beg, sc_ids, sg_beg, top_beg, sel_beg;
    ivec nd;                    /* eager: each sequence's scored pages this layer (-1: none) */
    lethe_expand_seq *ex;
    int32_t cap_ex;
    /* device scratch: page scores [sum n_done] f32, chosen pages, selections */
    lethe_dev_buf u, top, sel;
    /* graph decode (quest_graph_step): this step's arrays serve every layer */
    bool graph;
    int32_t g_pad;              /* sequences (and page_minmax pages) of the step */
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
    {"quest_granularity", LETHE_KNOB_STR, "shared", 0, 0,
     "shared (one page set per layer, the anchor) | head (each KV head reads its own top pages)"},
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
    ivec *arrays[] = {&p->mm_ids, &p->mm_beg, &p->mm_slots, &p->sc_rows, &p->sc_beg,
                      &p->sc_ids, &p->sg_beg, &p->top_beg, &p->sel_beg, &p->nd};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(arrays); i++) free(arrays[i]->v);
    free(p->ex);
    if (m->env.be) {
        lethe_dev_buf_free(m, &p->u);
        lethe_dev_buf_free(m, &p->top);
        lethe_dev_buf_free(m, &p->sel);
    }
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
    const char *gran = lethe_knob_str(m->ops, &p->kv, "quest_granularity");
    if (strcmp(gran, "shared") && strcmp(gran, "head"))
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config quest_granularity=%s: expected shared or head (method quest)", gran);
    /* one KV head (MQA, latent KV): per KV head is the shared set */
    p->groups = !strcmp(gran, "head") && m->env.n_kv_heads > 1 ? m->env.n_kv_heads : 1;
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
    /* + 1: the scratch page graph steps pad page_minmax with (never read) */
    size_t bytes = (size_t)(n + 1) * 2u * (size_t)m->env.n_kv_heads * (size_t)m->env.head_dim * be->ops->kv_size;
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
    PRIV(m)->graph = false; /* until graph_step plans this step */
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

/* Stale bounds of sequence q's pages [n_valid, nd) in `layer`: appended to
 * the page_minmax arguments (their slots in entry order). The caller marks
 * them current (n_valid = nd) once the page_minmax call is issued. */
static void add_stale_pages(quest_priv *p, quest_state *qs, int32_t layer, int32_t nd,
                            const int32_t *row_slots, int32_t *n_mm, int32_t *n_mm_slots) {
    const int32_t P = p->page, v = LETHE_MIN(qs->n_valid[layer], nd);
    iv(&p->mm_ids, *n_mm + (nd - v));
    iv(&p->mm_beg, *n_mm + (nd - v) + 1);
    iv(&p->mm_slots, *n_mm_slots + (int64_t)(nd - v) * P);
    for (int32_t pg = v; pg < nd; pg++) {
        p->mm_ids.v[*n_mm] = qs->page_id[pg];
        p->mm_beg.v[(*n_mm)++] = *n_mm_slots;
        memcpy(p->mm_slots.v + *n_mm_slots, row_slots + (size_t)pg * P, (size_t)P * sizeof(int32_t));
        *n_mm_slots += P;
    }
}

/* The expand entries of one sequence, one per group g, from `ex` (its
 * pick_begin unused): group g's picks are top_beg[seg0 + g] (seg0 < 0: a
 * sequence read whole, no picks); outputs appended at *n_sel. */
static void add_expands(quest_priv *p, int32_t s, lethe_expand_seq ex, int32_t seg0, int32_t *n_sel) {
    for (int32_t g = 0; g < p->groups; g++) {
        lethe_expand_seq e = ex;
        if (seg0 >= 0) e.pick_begin = p->top_beg.v[seg0 + g];
        e.out_begin = *n_sel;
        p->ex[s * p->groups + g] = e;
        p->sel_beg.v[s * p->groups + g] = *n_sel;
        *n_sel += lethe_expand_count(&e, p->page);
    }
}

/* Score segment i of nd pages from page offset `beg` (its groups' segments in
 * u and their first pick) with k picks each; *n_top advances. */
static void add_segments(quest_priv *p, int32_t i, int32_t beg, int32_t nd, int32_t k, int32_t *n_top) {
    for (int32_t g = 0; g < p->groups; g++) {
        p->sg_beg.v[i * p->groups + g] = p->groups * beg + g * nd;
        p->top_beg.v[i * p->groups + g] = *n_top;
        *n_top += k;
    }
}

/* room for n sequences' per-group arrays (and their expand entries) */
static void reserve_groups(quest_priv *p, int32_t n) {
    const int32_t ng = n * p->groups;
    if (ng > p->cap_ex) {
        p->cap_ex = LETHE_MAX(ng, 2 * p->cap_ex);
        p->ex = lethe_xrealloc(p->ex, (size_t)p->cap_ex * sizeof(*p->ex));
    }
    iv(&p->sg_beg, ng + 1);
    iv(&p->top_beg, ng + 1);
    iv(&p->sel_beg, ng + 1);
}

/* ---- graph decode ----
 * One plan for every layer >= skip (their bounds are refreshed in lockstep:
 * the same stale pages in every layer), built once per step and staged by
 * the engine, so a layer costs four kernels and no host work: page_minmax
 * over exactly g_pad pages (the real stale ones, then copies of one
 * throwaway page: meta page n_meta from the row's first slot), page_scores
 * / topk over g_pad (x G) segments (empty for rows read densely and for
 * padding), select_expand of all g_pad (x G) sequences. A step with more
 * stale pages than g_pad (the first decode after a prefill, a changed row)
 * runs eagerly. */
static bool quest_graph_step(lethe_sparse_method *m, const lethe_sparse_step *st,
                             const lethe_step_rows *rows, int32_t n_pad, lethe_graph_arrays *out) {
    quest_priv *p = PRIV(m);
    if (!m->env.be) return false;
    const int32_t S = st->n_seqs, P = p->page, n_layers = m->env.n_layers, G = p->groups;
    const int32_t n_sparse = p->n_meta > 0 ? meta_layers(m) : 0;
    *out = (lethe_graph_arrays){0};
    if (n_sparse == 0) { /* every layer reads the full rows */
        p->graph = true;
        p->g_pad = n_pad;
        out->selected = (int64_t)rows->begin[S] * n_layers;
        return true;
    }
    /* pass 1: sizes, and whether the step fits (no bound is marked current before) */
    int32_t n_mm = 0;
    int64_t n_sc_all = 0, n_top_all = 0, n_sel_all = (int64_t)G * (rows->begin[n_pad] - rows->begin[S]);
    for (int32_t s = 0; s < S; s++) {
        const lethe_sparse_seq *q = &st->seqs[s];
        quest_state *qs = q->state;
        const int32_t L = rows->begin[s + 1] - rows->begin[s];
        int32_t take = 0, nd = plan_pages(m, p->skip, q, &take);
        if (nd < 0 || !ensure_ids(p, qs, nd)) {
            if (nd >= 0) return false; /* page ids ran out: the eager path warns, reads densely */
            n_sel_all += (int64_t)G * L;
            continue;
        }
        int32_t v = nd;
        for (int32_t l = p->skip; l < n_layers; l++) v = LETHE_MIN(v, qs->n_valid[l]);
        n_mm += nd - v;
        const int32_t k = LETHE_MIN(take, nd);
        n_sc_all += nd;
        n_top_all += (int64_t)G * k;
        n_sel_all += (int64_t)G * ((int64_t)k * P + (L - nd * P));
    }
    if (n_mm > n_pad) return false;
    if (lethe_dev_buf_reserve(m, &p->u, (size_t)(G * n_sc_all + 1) * sizeof(float)) != LETHE_OK ||
        lethe_dev_buf_reserve(m, &p->top, (size_t)(n_top_all + 1) * sizeof(int32_t)) != LETHE_OK ||
        lethe_dev_buf_reserve(m, &p->sel, (size_t)n_sel_all * sizeof(int32_t)) != LETHE_OK) {
        LOG_WARN("quest: no backend memory for the selection scratch (%s); the step runs eagerly",
                 lethe_last_error());
        return false;
    }
    /* pass 2: the arrays */
    reserve_groups(p, n_pad);
    iv(&p->mm_ids, n_pad);
    iv(&p->mm_beg, n_pad + 1);
    iv(&p->sc_rows, n_pad);
    iv(&p->sc_beg, n_pad + 1);
    iv(&p->sc_ids, 1); /* a real pointer even when no page is scored (staged with count 0) */
    int32_t n_mm_slots = 0, n_sc_ids = 0, n_top = 0, n_sel = 0;
    int64_t sel_real = 0;
    n_mm = 0;
    for (int32_t s = 0; s < n_pad; s++) {
        const int32_t L = rows->begin[s + 1] - rows->begin[s];
        lethe_expand_seq ex = {.row_begin = rows->begin[s], .row_len = L};
        p->sc_rows.v[s] = s; /* decode: sequence s is batch row s */
        p->sc_beg.v[s] = n_sc_ids;
        int32_t take = 0, nd = s < S ? plan_pages(m, p->skip, &st->seqs[s], &take) : -1;
        if (nd >= 0) {
            quest_state *qs = st->seqs[s].state;
            int32_t v = nd;
            for (int32_t l = p->skip; l < n_layers; l++) v = LETHE_MIN(v, qs->n_valid[l]);
            for (int32_t l = p->skip; l < n_layers; l++) qs->n_valid[l] = v;
            add_stale_pages(p, qs, p->skip, nd, rows->slots + rows->begin[s], &n_mm, &n_mm_slots);
            /* current in every layer: each layer's graph_select_layer issues this page_minmax */
            for (int32_t l = p->skip; l < n_layers; l++) qs->n_valid[l] = nd;
            iv(&p->sc_ids, n_sc_ids + nd);
            memcpy(p->sc_ids.v + n_sc_ids, qs->page_id, (size_t)nd * sizeof(int32_t));
            const int32_t k = LETHE_MIN(take, nd);
            ex = (lethe_expand_seq){.row_begin = rows->begin[s], .row_len = L, .head = 0,
                                    .n_picks = k, .pick_off = 0, .tail = nd * P};
            add_segments(p, s, n_sc_ids, nd, k, &n_top);
            n_sc_ids += nd;
        } else {
            add_segments(p, s, n_sc_ids, 0, 0, &n_top); /* empty segments */
        }
        const int32_t sel0 = n_sel;
        add_expands(p, s, ex, nd >= 0 ? s * G : -1, &n_sel);
        if (s < S) sel_real += n_sel - sel0;
    }
    p->sc_beg.v[n_pad] = n_sc_ids;
    p->sg_beg.v[n_pad * G] = G * n_sc_ids;
    p->top_beg.v[n_pad * G] = n_top;
    p->sel_beg.v[n_pad * G] = n_sel;
    /* pad page_minmax to n_pad pages: the throwaway page from the row's first slot */
    iv(&p->mm_slots, n_mm_slots + (n_pad - n_mm));
    while (n_mm < n_pad) {
        p->mm_ids.v[n_mm] = p->n_meta;
        p->mm_beg.v[n_mm++] = n_mm_slots;
        p->mm_slots.v[n_mm_slots++] = rows->slots[0];
    }
    p->mm_beg.v[n_pad] = n_mm_slots;
    LETHE_ASSERT(n_sc_ids == n_sc_all && n_top == n_top_all && n_sel == n_sel_all);
    const size_t ng = (size_t)n_pad * (size_t)G;
    const struct { const int32_t *a; size_t n; } list[] = {
        {p->mm_ids.v, (size_t)n_pad},      {p->mm_beg.v, (size_t)n_pad + 1},
        {p->mm_slots.v, (size_t)n_mm_slots}, {p->sc_rows.v, (size_t)n_pad},
        {p->sc_beg.v, (size_t)n_pad + 1},  {p->sc_ids.v, (size_t)n_sc_ids},
        {p->sg_beg.v, ng + 1},             {p->top_beg.v, ng + 1},
        {(const int32_t *)p->ex, ng * 8},  {p->sel_beg.v, ng + 1},
    };
    _Static_assert(sizeof(lethe_expand_seq) == 8 * sizeof(int32_t), "staged as 8 int32 each");
    _Static_assert(LETHE_ARRAY_LEN(list) <= LETHE_GRAPH_MAX_ARRAYS, "graph arrays");
    for (size_t i = 0; i < LETHE_ARRAY_LEN(list); i++) {
        out->arrays[out->n] = list[i].a;
        out->counts[out->n++] = list[i].n;
    }
    /* head lists: each KV head reads its own list; counted as their mean */
    out->selected = sel_real / G * n_sparse + (int64_t)rows->begin[S] * (n_layers - n_sparse);
    p->graph = true;
    p->g_pad = n_pad;
    return true;
}

/* the selection result: one list per sequence, or one per (sequence, KV head) */
static lethe_sel_result built(const quest_priv *p, const int32_t **sel_begin, const int32_t **sel_slots) {
    *sel_begin = p->sel_beg.v;
    *sel_slots = p->sel.p;
    return p->groups > 1 ? LETHE_SEL_BUILT_HEADS : LETHE_SEL_BUILT;
}

/* select_layer of a graph step: the same four ops in every step (above) */
static lethe_sel_result graph_select_layer(lethe_sparse_method *m, int32_t layer, const void *qact,
                                           const lethe_step_rows *rows, const int32_t **sel_begin,
                                           const int32_t **sel_slots) {
    quest_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    if (layer < p->skip || !p->meta[layer] || p->n_meta == 0) return LETHE_SEL_FULL;
    const int32_t n = p->g_pad, G = p->groups;
    be->ops->page_minmax(be, p->meta[layer], lethe_kv_k(m->env.pool, layer), p->mm_ids.v,
                         p->mm_beg.v, p->mm_slots.v, n, m->env.n_kv_heads * m->env.head_dim);
    be->ops->page_scores(be, p->u.p, qact, p->meta[layer], n, p->sc_rows.v, p->sc_beg.v,
                         p->sc_ids.v, m->env.n_heads, m->env.n_kv_heads, m->env.head_dim, G, true);
    be->ops->topk(be, p->top.p, p->u.p, n * G, p->sg_beg.v, p->top_beg.v);
    be->ops->select_expand(be, p->sel.p, rows->slots, p->top.p, p->ex, n * G, p->page);
    return built(p, sel_begin, sel_slots);
}

static lethe_sel_result quest_select_layer(lethe_sparse_method *m, int32_t layer,
                                           const lethe_sparse_step *st, const void *qact,
                                           const lethe_step_rows *rows, const int32_t **sel_begin,
                                           const int32_t **sel_slots) {
    quest_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    if (!be) return LETHE_SEL_PER_SEQ; /* (no page bounds without a backend: reads all) */
    if (p->graph) return graph_select_layer(m, layer, qact, rows, sel_begin, sel_slots);
    if (layer < p->skip || !p->meta[layer]) return LETHE_SEL_FULL;
    lethe_kv_pool *pool = m->env.pool;
    const int32_t P = p->page, n_seqs = st->n_seqs, G = p->groups;
    reserve_groups(p, n_seqs);
    iv(&p->sc_rows, n_seqs);
    iv(&p->sc_beg, n_seqs + 1);
    iv(&p->nd, n_seqs);
    int32_t n_mm = 0, n_mm_slots = 0, n_sc = 0, n_sc_ids = 0, n_top = 0, n_sel = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_sparse_seq *q = &st->seqs[s];
        quest_state *qs = q->state;
        const int32_t L = rows->begin[s + 1] - rows->begin[s];
        LETHE_ASSERT(L == lethe_sparse_row_len(m, layer, q->row));
        /* default: the whole row */
        lethe_expand_seq ex = {.row_begin = rows->begin[s], .row_len = L};
        int32_t take = 0, nd = q->is_prefill ? -1 : plan_pages(m, layer, q, &take);
        if (nd >= 0 && !ensure_ids(p, qs, nd)) {
            if (!p->warned_full)
                LOG_WARN("quest: page-bound pages exhausted (%d per layer; rows sharing prefix slots "
                         "hold more pages than the pool): such rows read densely", p->n_meta);
            p->warned_full = true;
            nd = -1;
        }
        p->nd.v[s] = nd;
        int32_t seg0 = -1;
        if (nd >= 0) {
            add_stale_pages(p, qs, layer, nd, rows->slots + rows->begin[s], &n_mm, &n_mm_slots);
            /* scoring: the sequence's last query row against its pages [0, nd) */
            iv(&p->sc_ids, n_sc_ids + nd);
            p->sc_rows.v[n_sc] = q->q_row + q->n_new - 1;
            p->sc_beg.v[n_sc] = n_sc_ids;
            memcpy(p->sc_ids.v + n_sc_ids, qs->page_id, (size_t)nd * sizeof(int32_t));
            const int32_t k = LETHE_MIN(take, nd);
            ex = (lethe_expand_seq){.row_begin = rows->begin[s], .row_len = L, .head = 0,
                                    .n_picks = k, .pick_off = 0, .tail = nd * P};
            add_segments(p, n_sc, n_sc_ids, nd, k, &n_top);
            seg0 = n_sc * G;
            n_sc++;
            n_sc_ids += nd;
        }
        add_expands(p, s, ex, seg0, &n_sel);
    }
    if (n_sc == 0) return LETHE_SEL_FULL;
    p->sc_beg.v[n_sc] = n_sc_ids;
    p->sg_beg.v[n_sc * G] = G * n_sc_ids;
    p->top_beg.v[n_sc * G] = n_top;
    p->sel_beg.v[n_seqs * G] = n_sel;
    if (lethe_dev_buf_reserve(m, &p->u, (size_t)G * (size_t)n_sc_ids * sizeof(float)) != LETHE_OK ||
        lethe_dev_buf_reserve(m, &p->top, (size_t)(n_top + 1) * sizeof(int32_t)) != LETHE_OK ||
        lethe_dev_buf_reserve(m, &p->sel, (size_t)n_sel * sizeof(int32_t)) != LETHE_OK) {
        /* no device memory for the scratch: this layer reads densely; its stale
         * bounds stay stale (not computed), so a later step refreshes them */
        LOG_WARN("quest: no backend memory for the selection scratch (%s); layer %d reads densely",
                 lethe_last_error(), layer);
        return LETHE_SEL_FULL;
    }
    if (n_mm) {
        p->mm_beg.v[n_mm] = n_mm_slots;
        be->ops->page_minmax(be, p->meta[layer], lethe_kv_k(pool, layer), p->mm_ids.v, p->mm_beg.v,
                             p->mm_slots.v, n_mm, m->env.n_kv_heads * m->env.head_dim);
    }
    for (int32_t s = 0; s < n_seqs; s++) /* the bounds just issued are current now */
        if (p->nd.v[s] >= 0) ((quest_state *)st->seqs[s].state)->n_valid[layer] = p->nd.v[s];
    be->ops->page_scores(be, p->u.p, qact, p->meta[layer], n_sc, p->sc_rows.v, p->sc_beg.v,
                         p->sc_ids.v, m->env.n_heads, m->env.n_kv_heads, m->env.head_dim, G, true);
    be->ops->topk(be, p->top.p, p->u.p, n_sc * G, p->sg_beg.v, p->top_beg.v);
    be->ops->select_expand(be, p->sel.p, rows->slots, p->top.p, p->ex, n_seqs * G, P);
    return built(p, sel_begin, sel_slots);
}

const lethe_sparse_ops lethe_sparse_quest = {
    .name = "quest",
    .aliases = {NULL},
    .summary = "decode reads the pages with the highest key min/max upper bound; nothing freed",
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .flags = LETHE_SPARSE_PREFIX_CACHE,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    /* identity: the page ops run in every layer and select every page */
    .test_configs = {.identity = "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=4096,"
                                 "quest_skip_layers=0,quest_always_score=true",
                     .identity_on_backend = true,
                     .small = "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8,quest_skip_layers=0"},
    .slot_overhead_bytes = quest_slot_overhead,
    .init = quest_init,
    .configure = quest_configure,
    .destroy = quest_destroy,
    .set_knob = quest_set_knob,
    .request_init = quest_request_init,
    .request_finished = quest_request_finished,
    .prepare = quest_prepare,
    .select_layer = quest_select_layer,
    .graph_step = quest_graph_step,
};

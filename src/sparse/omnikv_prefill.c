/* omnikv_prefill.c - OmniKV's token selection applied to chunked prefill
 * (methods.md §18.5, SparseEngine's omnikv_prefill), a prefill-axis method:
 * the KV stays whole, decode is dense.
 *
 * Full layers F as in omnikv (omnikv_full_layers; layer 0 always). For a
 * prefill chunk of n new tokens on a row of L entries (history h = L - n)
 * whose history candidates [s, h - r) exceed K (s, r, K: the
 * omnikv_prefill_* knobs, 8 / 128 / 4096 like the anchor), every filter
 * layer (a full layer followed by a sparse one) scores the candidates by
 *     x_j = max over query heads of (1 / n) sum over the chunk's queries i
 *           of scale * q_i . k_j
 * (the per-head raw-QK sums over the chunk divided by its length; computed
 * as the mean query's logit, attn_scores LETHE_SCORES_QMEAN: nothing
 * n x h is formed), and the following sparse layers, up to the next full
 * layer, attend to [0, s) + top-K(x) + [h - r, h) + the whole chunk (causal
 * inside it). Full layers, decode steps and rows that fit read everything.
 * On a backend the scores, the top-K and the selections stay there
 * (attn_scores on the backend, ops->topk, ops->select_expand), as in
 * omnikv.c; without one every layer reads the whole row. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

lethe_status lethe_omnikv_parse_layers(const char *text, int32_t n_layers, bool *full); /* omnikv.c */

typedef struct op_priv {
    lethe_knob_values kv;
    int32_t sink, recent, keep;
    const lethe_sparse_step *st;
    bool *full;                 /* [n_layers] */
    bool *valid;                /* [cap_seqs]: sequence s has picks in this step */
    int32_t *pick_begin, *score_begin, *top_begin, *sel_begin; /* host, [cap_seqs + 1] */
    lethe_expand_seq *ex;
    int32_t cap_seqs;
    bool built;                 /* `sel` holds the current publication's selection */
    lethe_dev_buf scores, picks, sel;
} op_priv;
#define PRIV(m) ((op_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"omnikv_full_layers", LETHE_KNOB_STR, "auto", 0, 0, "full-attention layers: auto or a list 0:1:2:8"},
    {"omnikv_prefill_keep_tokens", LETHE_KNOB_INT, "4096", 1, 1 << 30,
     "history tokens (top by the filter layer's chunk-mean logits) the sparse layers read"},
    {"omnikv_prefill_sink_tokens", LETHE_KNOB_INT, "8", 0, 1 << 30, "first tokens always read"},
    {"omnikv_prefill_recent_tokens", LETHE_KNOB_INT, "128", 0, 1 << 30,
     "last history tokens before the chunk always read"},
};

static lethe_status op_init(lethe_sparse_method *m) {
    op_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    p->full = lethe_xcalloc((size_t)(m->env.n_layers > 0 ? m->env.n_layers : 1), sizeof(bool));
    m->priv = p;
    return LETHE_OK;
}
static void op_destroy(lethe_sparse_method *m) {
    op_priv *p = PRIV(m);
    if (!p) return;
    free(p->full);
    free(p->valid);
    free(p->pick_begin);
    free(p->score_begin);
    free(p->top_begin);
    free(p->sel_begin);
    free(p->ex);
    if (m->env.be) {
        lethe_dev_buf_free(m, &p->scores);
        lethe_dev_buf_free(m, &p->picks);
        lethe_dev_buf_free(m, &p->sel);
    }
    free(p);
    m->priv = NULL;
}
static lethe_status op_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}
static lethe_status op_configure(lethe_sparse_method *m) {
    op_priv *p = PRIV(m);
    p->keep = (int32_t)lethe_knob_num(m->ops, &p->kv, "omnikv_prefill_keep_tokens");
    p->sink = (int32_t)lethe_knob_num(m->ops, &p->kv, "omnikv_prefill_sink_tokens");
    p->recent = (int32_t)lethe_knob_num(m->ops, &p->kv, "omnikv_prefill_recent_tokens");
    return lethe_omnikv_parse_layers(lethe_knob_str(m->ops, &p->kv, "omnikv_full_layers"), m->env.n_layers,
                                     p->full);
}

static bool is_filter(const lethe_sparse_method *m, int32_t l) {
    const bool *full = PRIV(m)->full;
    return full[l] && l + 1 < m->env.n_layers && !full[l + 1];
}

/* the history of prefill chunk q: the row's entries before its new tokens;
 * candidates [sink, h - recent) */
static bool chunk_is_sparse(const lethe_sparse_method *m, int32_t layer, const lethe_sparse_seq *q, int32_t *h) {
    const op_priv *p = PRIV(m);
    *h = lethe_sparse_row_len(m, layer, q->row) - q->n_new;
    if (!q->is_prefill) return false;
    return *h - p->recent - p->sink > p->keep;
}

static void op_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    op_priv *p = PRIV(m);
    p->st = st;
    p->built = false;
    if (st->n_seqs > p->cap_seqs) {
        p->cap_seqs = LETHE_MAX(st->n_seqs, 2 * p->cap_seqs);
        const size_t n = (size_t)p->cap_seqs + 1;
        p->valid = lethe_xrealloc(p->valid, n * sizeof(bool));
        p->pick_begin = lethe_xrealloc(p->pick_begin, n * sizeof(int32_t));
        p->score_begin = lethe_xrealloc(p->score_begin, n * sizeof(int32_t));
        p->top_begin = lethe_xrealloc(p->top_begin, n * sizeof(int32_t));
        p->sel_begin = lethe_xrealloc(p->sel_begin, n * sizeof(int32_t));
        p->ex = lethe_xrealloc(p->ex, n * sizeof(*p->ex));
    }
    memset(p->valid, 0, (size_t)st->n_seqs * sizeof(bool));
}

static bool op_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const lethe_sparse_step *st = PRIV(m)->st;
    if (!st || !m->env.be || !is_filter(m, layer)) return false;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        int32_t h;
        if (chunk_is_sparse(m, layer, &st->seqs[i], &h)) return true;
    }
    return false;
}

/* A filter layer publishes, for each sparse chunk: the chunk-mean logit of
 * every candidate, max over heads, top K (on the backend, into p->picks). */
static void op_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                          const lethe_attn_args *attn) {
    op_priv *p = PRIV(m);
    if (!attn || !m->env.be) return;
    lethe_score_seq *req = lethe_xmalloc((size_t)st->n_seqs * sizeof(*req));
    int32_t n = 0, n_scores = 0, n_top = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        int32_t h;
        p->pick_begin[i] = n_top;
        p->valid[i] = chunk_is_sparse(m, layer, q, &h);
        if (!p->valid[i]) continue;
        const int32_t L = h + q->n_new;
        LETHE_ASSERT(attn->sel_begin[i + 1] - attn->sel_begin[i] == L); /* a full layer reads all */
        req[n] = (lethe_score_seq){.q_row = q->q_row, .n_rows = q->n_new, .key_begin = attn->sel_begin[i],
                                   .n_keys = L, .c0 = p->sink, .c1 = h - p->recent,
                                   .mode = LETHE_SCORES_LOGIT_MAX | LETHE_SCORES_QMEAN};
        p->score_begin[n] = n_scores;
        p->top_begin[n] = n_top;
        n_scores += req[n].c1 - req[n].c0;
        n_top += p->keep;
        n++;
    }
    p->pick_begin[st->n_seqs] = n_top;
    p->score_begin[n] = n_scores;
    p->top_begin[n] = n_top;
    p->built = false; /* a new publication: the next sparse layer rebuilds */
    bool ok = n > 0 && lethe_dev_buf_reserve(m, &p->scores, (size_t)n_scores * sizeof(float)) == LETHE_OK &&
              lethe_dev_buf_reserve(m, &p->picks, (size_t)n_top * sizeof(int32_t)) == LETHE_OK &&
              lethe_sparse_scores_on_backend(m, attn, req, n, 1, p->scores.p);
    if (ok) m->env.be->ops->topk(m->env.be, p->picks.p, p->scores.p, n, p->score_begin, p->top_begin);
    else memset(p->valid, 0, (size_t)st->n_seqs * sizeof(bool));
    free(req);
}

/* Full layers read the full rows; a sparse layer reads sink + picks + recent
 * history + the chunk of each published sequence (the whole row otherwise). */
static lethe_sel_result op_select_layer(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                        const void *q, const lethe_step_rows *rows, const int32_t **sel_begin,
                                        const int32_t **sel_slots) {
    op_priv *p = PRIV(m);
    if (!m->env.be) return LETHE_SEL_PER_SEQ;
    if (p->full[layer]) return LETHE_SEL_FULL;
    if (!p->built) {
        int32_t n_sel = 0, n_valid = 0;
        for (int32_t i = 0; i < st->n_seqs; i++) {
            const int32_t L = rows->begin[i + 1] - rows->begin[i];
            lethe_expand_seq ex = {.row_begin = rows->begin[i], .row_len = L, .out_begin = n_sel};
            if (p->valid[i]) {
                const int32_t h = L - st->seqs[i].n_new;
                ex.head = p->sink;
                ex.pick_begin = p->pick_begin[i];
                ex.n_picks = p->pick_begin[i + 1] - p->pick_begin[i];
                ex.pick_off = p->sink;
                ex.tail = h - p->recent; /* recent history, then the chunk */
                n_valid++;
            }
            p->ex[i] = ex;
            p->sel_begin[i] = n_sel;
            n_sel += lethe_expand_count(&ex, 1);
        }
        p->sel_begin[st->n_seqs] = n_sel;
        if (n_valid == 0) return LETHE_SEL_FULL;
        if (lethe_dev_buf_reserve(m, &p->sel, (size_t)n_sel * sizeof(int32_t)) != LETHE_OK)
            return LETHE_SEL_FULL; /* (reading more than needed is always correct) */
        m->env.be->ops->select_expand(m->env.be, p->sel.p, rows->slots, p->picks.p, p->ex, st->n_seqs, 1);
        p->built = true;
    }
    *sel_begin = p->sel_begin;
    *sel_slots = p->sel.p;
    return LETHE_SEL_BUILT;
}

static void op_finish(lethe_sparse_method *m, const lethe_sparse_step *st) { PRIV(m)->st = NULL; }

const lethe_sparse_ops lethe_sparse_omnikv_prefill = {
    .name = "omnikv_prefill",
    .aliases = {NULL},
    .summary = "chunked prefill: filter layers pick the top history tokens by chunk-mean logits, the "
               "following sparse layers read sink + them + recent + the chunk; decode dense, KV whole",
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .flags = LETHE_SPARSE_PREFILL_AXIS, /* pairs with decode methods: omnikv_prefill+quest */
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "omnikv_prefill_keep_tokens=4096",
                     .small = "omnikv_prefill_keep_tokens=6,omnikv_prefill_sink_tokens=2,"
                              "omnikv_prefill_recent_tokens=4,omnikv_full_layers=0"},
    .init = op_init,
    .configure = op_configure,
    .destroy = op_destroy,
    .set_knob = op_set_knob,
    .prepare = op_prepare,
    .finish_step = op_finish,
    .needs_scores = op_needs_scores,
    .select_layer = op_select_layer,
    .after_attn = op_after_attn,
};

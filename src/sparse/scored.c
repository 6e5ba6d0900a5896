/* scored.c - scored compaction (SnapKV / PyramidKV), see scored.h.
 *
 * Scores per (request, layer) live in a row-aligned vector (entry i of the
 * row <-> v[i]); new tokens enter with -INF (they are recent anyway), every
 * compaction gathers the vector with the same keep list and then resets it,
 * so decode eviction ranks only with decode-time evidence, as the anchor's
 * cached decode queries do (lethe folds each decode query's scores in when it
 * runs instead of re-scoring cached queries: identical in logits mode, whose
 * max of fixed q.k values does not depend on when it is taken). Probability
 * denominators span the candidates only (the anchor), not the full causal row
 * (original SnapKV). GQA: one token set per layer, max over all query heads
 * (the anchor; the original keeps per query head). */
#include "sparse/scored.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

#define PRIV(m) ((lethe_scored_priv *)(m)->priv)

typedef struct sc_state {
    lethe_rowvec *score;        /* [n_layers] */
} sc_state;

lethe_status lethe_scored_init(lethe_sparse_method *m) {
    lethe_scored_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    p->budget = lethe_xcalloc((size_t)m->env.n_layers, sizeof(int32_t));
    m->priv = p;
    return LETHE_OK;
}

void lethe_scored_destroy(lethe_sparse_method *m) {
    lethe_scored_priv *p = PRIV(m);
    if (!p) return;
    free(p->budget);
    free(p);
    m->priv = NULL;
}

lethe_status lethe_scored_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

lethe_status lethe_scored_configure_common(lethe_sparse_method *m) {
    lethe_scored_priv *p = PRIV(m);
    const char *mode = lethe_knob_str(m->ops, &p->kv, "sparse_prefill_score_mode");
    if (!strcmp(mode, "logits")) p->mode = LETHE_SCORE_LOGITS;
    else if (!strcmp(mode, "probability")) p->mode = LETHE_SCORE_PROBABILITY;
    else
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config sparse_prefill_score_mode=%s: "
                            "expected logits or probability (method %s)", mode, m->ops->name);
    p->w = (int32_t)lethe_knob_num(m->ops, &p->kv, "snapkv_window_size");
    p->pool_kernel = (int32_t)lethe_knob_num(m->ops, &p->kv, "pool_kernel_size");
    p->interval = (int32_t)lethe_knob_num(m->ops, &p->kv, "decode_eviction_interval");
    return LETHE_OK;
}

lethe_status lethe_scored_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    sc_state *ss = lethe_xcalloc(1, sizeof(*ss));
    ss->score = lethe_xcalloc((size_t)m->env.n_layers, sizeof(lethe_rowvec));
    *state = ss;
    return LETHE_OK;
}

void lethe_scored_request_finished(lethe_sparse_method *m, void *state) {
    sc_state *ss = state;
    if (!ss) return;
    for (int32_t l = 0; l < m->env.n_layers; l++) lethe_rowvec_free(&ss->score[l]);
    free(ss->score);
    free(ss);
}

size_t lethe_scored_snapshot(lethe_sparse_method *m, const void *state, void *buf, size_t cap) {
    return lethe_rowvecs_save(((const sc_state *)state)->score, m->env.n_layers, buf, cap);
}

lethe_status lethe_scored_restore(lethe_sparse_method *m, void *state, const void *buf, size_t n) {
    return lethe_rowvecs_load(((sc_state *)state)->score, m->env.n_layers, buf, n);
}

void lethe_scored_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) { PRIV(m)->st = st; }

/* this sequence contributes window scores this step */
static bool seq_scores(const lethe_scored_priv *p, const lethe_sparse_seq *q) {
    return q->is_prefill ? q->is_final_chunk : p->decode_eviction;
}

bool lethe_scored_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const lethe_sparse_step *st = PRIV(m)->st;
    for (int32_t i = 0; st && i < st->n_seqs; i++)
        if (seq_scores(PRIV(m), &st->seqs[i])) return true;
    return false;
}

/* A decode step without scoring (no snapkv_decode_eviction) reads the
 * resident rows and needs no hook inside the step: the score vectors get
 * their -INF entries for the new tokens here, as after_attn would. */
bool lethe_scored_graph_step(lethe_sparse_method *m, const lethe_sparse_step *st,
                             const lethe_step_rows *rows, int32_t n_pad, lethe_graph_arrays *out) {
    lethe_scored_priv *p = PRIV(m);
    if (rows) return false;
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (seq_scores(p, &st->seqs[i])) return false;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        sc_state *ss = st->seqs[i].state;
        for (int32_t l = 0; l < m->env.n_layers; l++)
            lethe_rowvec_resize(&ss->score[l], lethe_sparse_row_len(m, l, st->seqs[i].row), -INFINITY);
    }
    return true;
}

void lethe_scored_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             const lethe_attn_args *attn) {
    lethe_scored_priv *p = PRIV(m);
    int32_t s = m->knobs.sink_keep_tokens, r = m->knobs.recent_keep_tokens;
    lethe_score_seq *req = lethe_xmalloc((size_t)st->n_seqs * sizeof(*req));
    int32_t *who = lethe_xmalloc((size_t)st->n_seqs * sizeof(*who)), n = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        sc_state *ss = q->state;
        int32_t L = lethe_sparse_row_len(m, layer, q->row);
        lethe_rowvec_resize(&ss->score[layer], L, -INFINITY);
        if (!attn || !seq_scores(p, q)) continue;
        /* window: the last min(w, n_new) queries of this step (they lie in the final chunk) */
        int32_t wn = q->is_prefill ? LETHE_MIN(p->w, q->n_new) : q->n_new;
        int32_t c0 = s, c1 = L - r;
        if (c1 <= c0 || wn <= 0) continue;
        /* the default selection (every slot): entry == row position */
        LETHE_ASSERT(attn->sel_begin[i + 1] - attn->sel_begin[i] == L);
        /* logits: max over window rows and heads; probability: per head the
         * window mean of the softmax over the candidates, max over heads */
        req[n] = (lethe_score_seq){
            .q_row = q->q_row + q->n_new - wn, .n_rows = wn, .key_begin = attn->sel_begin[i],
            .n_keys = L, .c0 = c0, .c1 = c1,
            .mode = p->mode == LETHE_SCORE_LOGITS ? LETHE_SCORES_LOGIT_MAX
                                                  : LETHE_SCORES_PROB_MAX | LETHE_SCORES_CAND_DENOM};
        who[n++] = i;
    }
    float *out = lethe_xmalloc((lethe_attn_scores_out_len(req, n, 1) + 1) * sizeof(float));
    if (lethe_sparse_scores(m, attn, req, n, 1, out)) {
        size_t off = 0;
        for (int32_t k = 0; k < n; k++) {
            sc_state *ss = st->seqs[who[k]].state;
            int32_t nc = req[k].c1 - req[k].c0;
            lethe_score_accumulate(ss->score[layer].v + req[k].c0, out + off, nc, LETHE_REDUCE_MAX);
            off += (size_t)nc;
        }
    }
    free(out);
    free(who);
    free(req);
}

int32_t lethe_scored_after(const lethe_sparse_method *m, int32_t layer, int32_t len, bool prefill,
                           bool final_chunk) {
    const lethe_scored_priv *p = PRIV(m);
    int32_t B = p->budget[layer];
    if (prefill) return final_chunk && len > B ? B : len;
    return p->decode_eviction && len >= B + p->interval ? B : len;
}

/* compacts one layer's row to its budget with the accumulated scores */
static void compact(lethe_sparse_method *m, const lethe_sparse_seq *q, int32_t layer, int32_t L) {
    lethe_scored_priv *p = PRIV(m);
    int32_t s = m->knobs.sink_keep_tokens, r = m->knobs.recent_keep_tokens;
    lethe_rowvec *sv = &((sc_state *)q->state)->score[layer];
    lethe_rowvec_resize(sv, L, -INFINITY);
    int32_t B = p->budget[layer];
    float *ranked = lethe_xmalloc((size_t)L * sizeof(float));
    memcpy(ranked, sv->v, (size_t)L * sizeof(float));
    int32_t c0 = s, c1 = L - r;
    if (p->pool_kernel > 1 && c1 > c0) /* pool the middle candidates only */
        lethe_pool1d(sv->v + c0, c1 - c0, p->pool_kernel, LETHE_REDUCE_MAX, ranked + c0);
    int32_t *keep = lethe_xmalloc((size_t)L * sizeof(int32_t));
    int32_t n = lethe_sparse_keep_set(m, layer, q->row, ranked, s, r, B - s - r, keep);
    LETHE_ASSERT(n >= B); /* more when pinned tokens outnumber the budget */
    lethe_kv_keep(m->env.pool, layer, q->row, keep, n);
    lethe_rowvec_keep(sv, keep, n);
    for (int32_t j = 0; j < n; j++) sv->v[j] = -INFINITY; /* decode eviction restarts its evidence */
    free(keep);
    free(ranked);
}

void lethe_scored_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        for (int32_t l = 0; l < m->env.n_layers; l++) {
            int32_t L = lethe_sparse_row_len(m, l, q->row);
            if (lethe_scored_after(m, l, L, q->is_prefill, q->is_final_chunk) < L) compact(m, q, l, L);
        }
    }
    PRIV(m)->st = NULL;
}

int32_t lethe_scored_min_final_chunk(const lethe_sparse_method *m) { return PRIV(m)->w; }

int32_t lethe_scored_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk) {
    const lethe_scored_priv *p = PRIV(m);
    int32_t B = p->budget[layer];
    int32_t decode_peak = p->decode_eviction ? B + p->interval : B + (n_total - n_prompt);
    return LETHE_MIN(n_total, LETHE_MAX(n_prompt, decode_peak));
}

/* h2o.c - H2O heavy hitters (methods.md §6), physical eviction by
 * accumulated attention, with the anchor's prefill-time compaction (h2o_prefill).
 *
 * One cumulative score per (request, layer, row entry), token-shared across
 * heads (the anchor; the original keeps one per head). Each prefill chunk
 * scores its last h2o_prefill_score_window queries (0 = all): logits mode =
 * max raw logit over those queries and heads, softmaxed over the row's tokens
 * into a probability vector; probability mode = per-head softmax mass (mean
 * over queries, max over heads). The vector is ADDED to the cumulative score.
 * After an intermediate chunk a row longer than h2o_prefill_budget is
 * compacted to it (h2o_prefill, on by default; the alias `h2o_prefill` names
 * the same method); at prompt end to h2o_decode_budget B. A compaction keeps
 * recent = max(1, floor(B * h2o_recent_ratio)) newest tokens plus the top
 * B - recent older tokens by cumulative score (no sink: H2O's sinks survive by
 * score). Scores follow the compaction (score_new[i] = score_old[keep[i]]).
 * Decode is score-free unless h2o_decode_eviction: each step adds the head-
 * summed probabilities and compacts back to B at B + interval. The original
 * evicts every step with ratio budgets (heavy 10% + recent 10%). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

typedef struct h2o_priv {
    lethe_knob_values kv;
    const lethe_sparse_step *st;
    int32_t prefill_budget, decode_budget, window, interval;
    float recent_ratio;
    bool prefill_compact, decode_eviction;
    lethe_score_mode mode;
} h2o_priv;
#define PRIV(m) ((h2o_priv *)(m)->priv)

typedef struct h2o_state {
    lethe_rowvec *acc; /* [n_layers] cumulative scores aligned with row entries */
} h2o_state;

static const lethe_sparse_knob knobs[] = {
    {"h2o_prefill_budget", LETHE_KNOB_INT, "8192", 1, 1 << 24, "rows compacted to this after intermediate chunks"},
    {"h2o_decode_budget", LETHE_KNOB_INT, "4096", 1, 1 << 24, "rows compacted to this at prompt end (B)"},
    {"h2o_recent_ratio", LETHE_KNOB_FLOAT, "0.5", 0, 1, "share of B kept as the most recent tokens"},
    {"h2o_prefill_score_window", LETHE_KNOB_INT, "128", 0, 1 << 20, "scoring queries per chunk (0 = whole chunk)"},
    {"h2o_prefill", LETHE_KNOB_BOOL, "true", 0, 1, "compact between prefill chunks"},
    {"sparse_prefill_score_mode", LETHE_KNOB_STR, "logits", 0, 0, "logits | probability"},
    {"h2o_decode_eviction", LETHE_KNOB_BOOL, "false", 0, 1, "accumulate decode scores and compact"},
    {"h2o_decode_eviction_interval", LETHE_KNOB_INT, "128", 1, 1 << 24, "compact when L >= B + interval"},
};

static lethe_status h2o_init(lethe_sparse_method *m) {
    h2o_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void h2o_destroy(lethe_sparse_method *m) {
    free(m->priv);
    m->priv = NULL;
}
static lethe_status h2o_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status h2o_configure(lethe_sparse_method *m) {
    h2o_priv *p = PRIV(m);
    const char *mode = lethe_knob_str(m->ops, &p->kv, "sparse_prefill_score_mode");
    if (strcmp(mode, "logits") && strcmp(mode, "probability"))
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config sparse_prefill_score_mode=%s: "
                            "expected logits or probability (method h2o)", mode);
    p->mode = strcmp(mode, "logits") ? LETHE_SCORE_PROBABILITY : LETHE_SCORE_LOGITS;
    p->prefill_budget = (int32_t)lethe_knob_num(m->ops, &p->kv, "h2o_prefill_budget");
    p->decode_budget = (int32_t)lethe_knob_num(m->ops, &p->kv, "h2o_decode_budget");
    p->recent_ratio = (float)lethe_knob_num(m->ops, &p->kv, "h2o_recent_ratio");
    p->window = (int32_t)lethe_knob_num(m->ops, &p->kv, "h2o_prefill_score_window");
    p->prefill_compact = lethe_knob_num(m->ops, &p->kv, "h2o_prefill") != 0;
    p->decode_eviction = lethe_knob_num(m->ops, &p->kv, "h2o_decode_eviction") != 0;
    p->interval = (int32_t)lethe_knob_num(m->ops, &p->kv, "h2o_decode_eviction_interval");
    return LETHE_OK;
}

static lethe_status h2o_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    h2o_state *hs = lethe_xcalloc(1, sizeof(*hs));
    hs->acc = lethe_xcalloc((size_t)m->env.n_layers, sizeof(lethe_rowvec));
    *state = hs;
    return LETHE_OK;
}

static void h2o_request_finished(lethe_sparse_method *m, void *state) {
    h2o_state *hs = state;
    if (!hs) return;
    for (int32_t l = 0; l < m->env.n_layers; l++) lethe_rowvec_free(&hs->acc[l]);
    free(hs->acc);
    free(hs);
}

static size_t h2o_snapshot(lethe_sparse_method *m, const void *state, void *buf, size_t cap) {
    return lethe_rowvecs_save(((const h2o_state *)state)->acc, m->env.n_layers, buf, cap);
}
static lethe_status h2o_restore(lethe_sparse_method *m, void *state, const void *buf, size_t n) {
    return lethe_rowvecs_load(((h2o_state *)state)->acc, m->env.n_layers, buf, n);
}

static bool seq_scores(const h2o_priv *p, const lethe_sparse_seq *q) {
    return q->is_prefill || p->decode_eviction;
}

static void h2o_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) { PRIV(m)->st = st; }

static bool h2o_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const lethe_sparse_step *st = PRIV(m)->st;
    for (int32_t i = 0; st && i < st->n_seqs; i++)
        if (seq_scores(PRIV(m), &st->seqs[i])) return true;
    return false;
}

/* A decode step without decode scoring reads the resident rows and needs no
 * hook inside the step: the accumulators get the new tokens' 0 entries
 * here, as after_attn would. */
static bool h2o_graph_step(lethe_sparse_method *m, const lethe_sparse_step *st,
                           const lethe_step_rows *rows, int32_t n_pad, lethe_graph_arrays *out) {
    if (rows) return false;
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (seq_scores(PRIV(m), &st->seqs[i])) return false;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        h2o_state *hs = st->seqs[i].state;
        for (int32_t l = 0; l < m->env.n_layers; l++)
            lethe_rowvec_resize(&hs->acc[l], lethe_sparse_row_len(m, l, st->seqs[i].row), 0.0f);
    }
    return true;
}

static void h2o_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           const lethe_attn_args *attn) {
    h2o_priv *p = PRIV(m);
    lethe_score_seq *req = lethe_xmalloc((size_t)st->n_seqs * sizeof(*req));
    int32_t *who = lethe_xmalloc((size_t)st->n_seqs * sizeof(*who)), n = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        h2o_state *hs = q->state;
        int32_t L = lethe_sparse_row_len(m, layer, q->row);
        lethe_rowvec_resize(&hs->acc[layer], L, 0.0f); /* new tokens start at 0 */
        if (!attn || !seq_scores(p, q)) continue;
        int32_t wn = q->n_new;
        if (q->is_prefill && p->window > 0 && p->window < wn) wn = p->window;
        LETHE_ASSERT(attn->sel_begin[i + 1] - attn->sel_begin[i] == L); /* the default: every slot */
        /* every resident token is a candidate; softmax over the full causal row.
         * decode: per-head probabilities summed over heads; prefill logits: max
         * raw logit (softmaxed over the row below); prefill probability: per-head
         * window mean, max over heads */
        int32_t mode = !q->is_prefill ? LETHE_SCORES_PROB_SUM
                       : p->mode == LETHE_SCORE_LOGITS ? LETHE_SCORES_LOGIT_MAX
                                                       : LETHE_SCORES_PROB_MAX;
        req[n] = (lethe_score_seq){.q_row = q->q_row + q->n_new - wn, .n_rows = wn,
                                   .key_begin = attn->sel_begin[i], .n_keys = L, .c0 = 0, .c1 = L,
                                   .mode = mode};
        who[n++] = i;
    }
    float *out = lethe_xmalloc((lethe_attn_scores_out_len(req, n, 1) + 1) * sizeof(float));
    if (lethe_sparse_scores(m, attn, req, n, 1, out)) {
        size_t off = 0;
        for (int32_t k = 0; k < n; k++) {
            h2o_state *hs = st->seqs[who[k]].state;
            int32_t L = req[k].c1;
            if (req[k].mode == LETHE_SCORES_LOGIT_MAX) lethe_softmax_inplace(out + off, L);
            lethe_score_accumulate(hs->acc[layer].v, out + off, L, LETHE_REDUCE_SUM);
            off += (size_t)L;
        }
    }
    free(out);
    free(who);
    free(req);
}

/* the row length finish_step leaves for a row of len tokens */
static int32_t h2o_after(const h2o_priv *p, int32_t len, bool prefill, bool final_chunk) {
    int32_t B;
    if (prefill && !final_chunk) {
        if (!p->prefill_compact) return len;
        B = p->prefill_budget;
    } else if (prefill) {
        B = p->decode_budget;
    } else {
        if (!p->decode_eviction || len < p->decode_budget + p->interval) return len;
        B = p->decode_budget;
    }
    return len > B ? B : len;
}

static void h2o_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    h2o_priv *p = PRIV(m);
    int32_t *keep = NULL;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        h2o_state *hs = q->state;
        for (int32_t l = 0; l < m->env.n_layers; l++) {
            int32_t L = lethe_sparse_row_len(m, l, q->row);
            int32_t B = h2o_after(p, L, q->is_prefill, q->is_final_chunk);
            if (B == L) continue;
            lethe_rowvec_resize(&hs->acc[l], L, 0.0f);
            int32_t recent = LETHE_MIN(B, LETHE_MAX(1, (int32_t)floorf((float)B * p->recent_ratio)));
            keep = lethe_xrealloc(keep, (size_t)L * sizeof(*keep));
            int32_t n = lethe_sparse_keep_set(m, l, q->row, hs->acc[l].v, 0, recent, B - recent,
                                              keep);
            LETHE_ASSERT(n >= B); /* more when pinned tokens outnumber the budget */
            lethe_kv_keep(m->env.pool, l, q->row, keep, n);
            lethe_rowvec_keep(&hs->acc[l], keep, n);
        }
    }
    free(keep);
    p->st = NULL;
}

static int32_t h2o_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                int32_t n_total, int32_t chunk) {
    const h2o_priv *p = PRIV(m);
    int32_t pre = p->prefill_compact ? LETHE_MIN(n_prompt, p->prefill_budget + chunk) : n_prompt;
    int32_t B = LETHE_MIN(n_prompt, p->decode_budget);
    int32_t dec = p->decode_eviction ? p->decode_budget + p->interval : B + (n_total - n_prompt);
    return LETHE_MIN(n_total, LETHE_MAX(pre, dec));
}

const lethe_sparse_ops lethe_sparse_h2o = {
    .name = "h2o",
    .aliases = {"h2o_prefill", "heavy-hitter", NULL},
    .summary = "accumulated-attention heavy hitters + recent; compacts between prefill chunks",
    .kind = LETHE_SPARSE_KIND_EVICTION,
    .flags = LETHE_SPARSE_PER_LAYER_ROWS,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "h2o_prefill_budget=4096,h2o_decode_budget=4096",
                     .small = "h2o_prefill_budget=16,h2o_decode_budget=12"},
    .max_resident = h2o_max_resident,
    .init = h2o_init,
    .configure = h2o_configure,
    .destroy = h2o_destroy,
    .set_knob = h2o_set_knob,
    .request_init = h2o_request_init,
    .request_finished = h2o_request_finished,
    .prepare = h2o_prepare,
    .finish_step = h2o_finish,
    .needs_scores = h2o_needs_scores,
    .after_attn = h2o_after_attn,
    .graph_step = h2o_graph_step,
    .snapshot = h2o_snapshot,
    .restore = h2o_restore,
};

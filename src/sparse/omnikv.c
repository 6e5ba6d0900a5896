/* omnikv.c - OmniKV (methods.md §11), logical cross-layer token selection.
 *
 * A set F of full-attention layers (omnikv_full_layers, layer 0 always in
 * it). At a decode step every full layer whose next layer is sparse (a filter
 * layer) asks for the raw q.k scores of its attention; after it, per head a
 * softmax over the history candidates [s, L - r), the max over heads, and the
 * top decode_keep_tokens positions I. Every following sparse layer, up to the
 * next full layer, reads [0, s) + I + [L - r, L) (the new token included).
 * Prefill is dense, nothing is freed, rows that fit s + keep + r read all.
 * On a backend the whole decode path stays there (no host sync): the filter
 * layer's scores go to device scratch (attn_scores, out_on_backend), ops->topk
 * picks I per sequence into a device buffer, and the first following sparse
 * layer's select_layer expands sink + I + recent through the engine's staged
 * full rows (ops->select_expand); the later sparse layers of the run reuse
 * that selection (rows are shared, so it is the same slot list). Without a
 * backend nothing is scored and every layer reads the whole row.
 * "auto" full layers: the anchor resolves calibrated per-model profiles; for a
 * model without one lethe uses {0, 1, 2, N/4, N/2} (the shape of the DeltaKV
 * LongBench example 0,1,2,8,18 for 32 layers); lethe_omnikv_pick_layers picks
 * F from measured top-k overlaps with the anchor's dynamic program. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

typedef struct omni_priv {
    lethe_knob_values kv;
    const lethe_sparse_step *st;
    bool *full;                 /* [n_layers] */
    /* the step's published picks (device) and the selection built from them */
    int32_t *pick_begin;        /* host [n_seqs + 1]: sequence s's picks (0 when not valid) */
    int32_t *score_begin;       /* host [n_scored + 1] topk segments */
    int32_t *top_begin;         /* host [n_scored + 1] */
    int32_t *sel_begin;         /* host [n_seqs + 1] */
    lethe_expand_seq *ex;
    int32_t cap_seqs;
    int32_t built;              /* selection in `sel` is current for this step (-1: no) */
    lethe_dev_buf scores, picks, sel;
} omni_priv;
#define PRIV(m) ((omni_priv *)(m)->priv)

typedef struct omni_state {
    bool valid;                 /* published in this step */
} omni_state;

static const lethe_sparse_knob knobs[] = {
    {"omnikv_full_layers", LETHE_KNOB_STR, "auto", 0, 0, "full-attention layers: auto or a list 0:1:2:8"},
};

/* "auto" or a ':'-separated list ("," separates knobs) -> full[] (layer 0 always) */
lethe_status lethe_omnikv_parse_layers(const char *text, int32_t n_layers, bool *full);
lethe_status lethe_omnikv_parse_layers(const char *text, int32_t n_layers, bool *full) {
    memset(full, 0, (size_t)n_layers * sizeof(bool));
    if (!strcmp(text, "auto")) {
        int32_t a[5] = {0, 1, 2, n_layers / 4, n_layers / 2};
        for (int i = 0; i < 5; i++)
            if (a[i] < n_layers) full[a[i]] = true;
        return LETHE_OK;
    }
    const char *p = text;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= n_layers || (*end && *end != ':'))
            return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config omnikv_full_layers=%s: expected "
                                "auto or layer indices in [0, %d) separated by ':'", text, n_layers);
        full[v] = true;
        p = *end ? end + 1 : end;
    }
    full[0] = true;
    return LETHE_OK;
}

/* Picks n_full full layers (layer 0 always) maximizing the anchor's
 * calibration objective: sum over each sparse layer b of overlap[a * N + b],
 * a = the last full layer before b (how well a's top-k token set predicts
 * b's), by dynamic programming over segment starts, O(n_full N^2). overlap is
 * [N, N] (only a < b read); collecting it (per-layer top-k sets at decode
 * points of a dense calibration run) is the calibration tool's job. */
void lethe_omnikv_pick_layers(const float *overlap, int32_t N, int32_t n_full, bool *full);
void lethe_omnikv_pick_layers(const float *overlap, int32_t N, int32_t n_full, bool *full) {
    LETHE_ASSERT(N >= 1 && n_full >= 1);
    if (n_full > N) n_full = N;
    /* seg(a, e) = sum_{b = a+1}^{e-1} overlap[a][b] */
    double *dp = lethe_xmalloc((size_t)n_full * N * sizeof(double));
    int32_t *from = lethe_xmalloc((size_t)n_full * N * sizeof(int32_t));
    for (int32_t i = 0; i < n_full * N; i++) dp[i] = -INFINITY, from[i] = -1;
    dp[0] = 0; /* one full layer, at 0 */
    for (int32_t c = 1; c < n_full; c++)
        for (int32_t a = 0; a < N; a++) {
            if (dp[(c - 1) * N + a] == -INFINITY) continue;
            double seg = 0;
            for (int32_t e = a + 1; e < N; e++) { /* next full layer at e */
                double v = dp[(c - 1) * N + a] + seg;
                if (v > dp[c * N + e]) dp[c * N + e] = v, from[c * N + e] = a;
                seg += overlap[(size_t)a * N + e];
            }
        }
    double best = -INFINITY;
    int32_t last = 0;
    for (int32_t a = 0; a < N; a++) {
        if (dp[(n_full - 1) * N + a] == -INFINITY) continue;
        double seg = 0;
        for (int32_t b = a + 1; b < N; b++) seg += overlap[(size_t)a * N + b];
        if (dp[(n_full - 1) * N + a] + seg > best) best = dp[(n_full - 1) * N + a] + seg, last = a;
    }
    memset(full, 0, (size_t)N * sizeof(bool));
    for (int32_t c = n_full - 1, a = last; c >= 0 && a >= 0; a = from[c * N + a], c--) full[a] = true;
    free(from);
    free(dp);
}

static lethe_status omni_init(lethe_sparse_method *m) {
    omni_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    p->full = lethe_xcalloc((size_t)m->env.n_layers, sizeof(bool));
    m->priv = p;
    return LETHE_OK;
}
static void omni_destroy(lethe_sparse_method *m) {
    omni_priv *p = PRIV(m);
    if (!p) return;
    free(p->full);
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
static lethe_status omni_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}
static lethe_status omni_configure(lethe_sparse_method *m) {
    return lethe_omnikv_parse_layers(lethe_knob_str(m->ops, &PRIV(m)->kv, "omnikv_full_layers"),
                                     m->env.n_layers, PRIV(m)->full);
}

static lethe_status omni_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    *state = lethe_xcalloc(1, sizeof(omni_state));
    return LETHE_OK;
}
static void omni_request_finished(lethe_sparse_method *m, void *state) {
    free(state);
}

static bool is_filter(const lethe_sparse_method *m, int32_t l) {
    const bool *full = PRIV(m)->full;
    return full[l] && l + 1 < m->env.n_layers && !full[l + 1];
}

static void omni_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    omni_priv *p = PRIV(m);
    p->st = st;
    p->built = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) ((omni_state *)st->seqs[i].state)->valid = false;
    if (st->n_seqs > p->cap_seqs) {
        p->cap_seqs = LETHE_MAX(st->n_seqs, 2 * p->cap_seqs);
        const size_t n = (size_t)p->cap_seqs + 1;
        p->pick_begin = lethe_xrealloc(p->pick_begin, n * sizeof(int32_t));
        p->score_begin = lethe_xrealloc(p->score_begin, n * sizeof(int32_t));
        p->top_begin = lethe_xrealloc(p->top_begin, n * sizeof(int32_t));
        p->sel_begin = lethe_xrealloc(p->sel_begin, n * sizeof(int32_t));
        p->ex = lethe_xrealloc(p->ex, n * sizeof(*p->ex));
    }
}

static bool omni_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const lethe_sparse_step *st = PRIV(m)->st;
    if (!st || !is_filter(m, layer)) return false;
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (!st->seqs[i].is_prefill) return true;
    return false;
}

/* A filter layer publishes, for every decode sequence whose candidates
 * [s, L - r) exceed K: per head softmax over the candidates, max over heads,
 * top K (all on the backend, into p->picks). */
static void omni_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            const lethe_attn_args *attn) {
    omni_priv *p = PRIV(m);
    if (!attn || !m->env.be) return;
    int32_t s = m->knobs.sink_keep_tokens, r = m->knobs.recent_keep_tokens, K = m->knobs.decode_keep_tokens;
    lethe_score_seq *req = lethe_xmalloc((size_t)st->n_seqs * sizeof(*req));
    int32_t n = 0, n_scores = 0, n_top = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        omni_state *os = q->state;
        p->pick_begin[i] = n_top;
        if (q->is_prefill) continue;
        int32_t L = lethe_sparse_row_len(m, layer, q->row);
        int32_t c0 = s, c1 = L - r;
        os->valid = c1 - c0 > K; /* a row that fits reads every token */
        if (!os->valid) continue;
        LETHE_ASSERT(attn->sel_begin[i + 1] - attn->sel_begin[i] == L); /* a full layer reads all */
        /* the decode query: per head softmax over the candidates, max over heads */
        req[n] = (lethe_score_seq){.q_row = q->q_row + q->n_new - 1, .n_rows = 1,
                                   .key_begin = attn->sel_begin[i], .n_keys = L, .c0 = c0, .c1 = c1,
                                   .mode = LETHE_SCORES_PROB_MAX | LETHE_SCORES_CAND_DENOM};
        p->score_begin[n] = n_scores;
        p->top_begin[n] = n_top;
        n_scores += c1 - c0;
        n_top += K;
        n++;
    }
    p->pick_begin[st->n_seqs] = n_top;
    p->score_begin[n] = n_scores;
    p->top_begin[n] = n_top;
    p->built = 0; /* a new publication: the next sparse layer rebuilds */
    bool ok = n > 0 &&
              lethe_dev_buf_reserve(m, &p->scores, (size_t)n_scores * sizeof(float)) == LETHE_OK &&
              lethe_dev_buf_reserve(m, &p->picks, (size_t)n_top * sizeof(int32_t)) == LETHE_OK &&
              lethe_sparse_scores_on_backend(m, attn, req, n, 1, p->scores.p);
    if (ok) m->env.be->ops->topk(m->env.be, p->picks.p, p->scores.p, n, p->score_begin, p->top_begin);
    else
        for (int32_t i = 0; i < st->n_seqs; i++) ((omni_state *)st->seqs[i].state)->valid = false;
    free(req);
}

/* Full layers read the full rows; a sparse layer reads sink + I + recent of
 * each published sequence (the whole row otherwise), expanded on the backend
 * once per publication. */
static lethe_sel_result omni_select_layer(lethe_sparse_method *m, int32_t layer,
                                          const lethe_sparse_step *st, const void *q,
                                          const lethe_step_rows *rows, const int32_t **sel_begin,
                                          const int32_t **sel_slots) {
    omni_priv *p = PRIV(m);
    if (!m->env.be) return LETHE_SEL_PER_SEQ;
    if (p->full[layer]) return LETHE_SEL_FULL;
    if (p->built) {
        *sel_begin = p->sel_begin;
        *sel_slots = p->sel.p;
        return LETHE_SEL_BUILT;
    }
    const int32_t s = m->knobs.sink_keep_tokens, r = m->knobs.recent_keep_tokens;
    int32_t n_sel = 0, n_valid = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const omni_state *os = st->seqs[i].state;
        const int32_t L = rows->begin[i + 1] - rows->begin[i];
        lethe_expand_seq ex = {.row_begin = rows->begin[i], .row_len = L, .out_begin = n_sel};
        if (os->valid) {
            ex.head = s;
            ex.pick_begin = p->pick_begin[i];
            ex.n_picks = p->pick_begin[i + 1] - p->pick_begin[i];
            ex.pick_off = s;
            ex.tail = LETHE_MAX(s, L - r);
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
    p->built = 1;
    *sel_begin = p->sel_begin;
    *sel_slots = p->sel.p;
    return LETHE_SEL_BUILT;
}

static void omni_finish(lethe_sparse_method *m, const lethe_sparse_step *st) { PRIV(m)->st = NULL; }

const lethe_sparse_ops lethe_sparse_omnikv = {
    .name = "omnikv",
    .aliases = {NULL},
    .summary = "full filter layers pick the top tokens that the following sparse layers read",
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .flags = LETHE_SPARSE_PREFIX_CACHE,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=4096",
                     .small = "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8,omnikv_full_layers=0"},
    .init = omni_init,
    .configure = omni_configure,
    .destroy = omni_destroy,
    .set_knob = omni_set_knob,
    .request_init = omni_request_init,
    .request_finished = omni_request_finished,
    .prepare = omni_prepare,
    .finish_step = omni_finish,
    .needs_scores = omni_needs_scores,
    .select_layer = omni_select_layer,
    .after_attn = omni_after_attn,
};

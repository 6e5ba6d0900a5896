/* omnikv.c - OmniKV (methods.md §11), logical cross-layer token selection.
 *
 * A set F of full-attention layers (omnikv_full_layers, layer 0 always in
 * it). At a decode step every full layer whose next layer is sparse (a filter
 * layer) asks for the raw q.k scores of its attention; after it, per head a
 * softmax over the history candidates [s, L - r), the max over heads, and the
 * top decode_keep_tokens positions I. Every following sparse layer, up to the
 * next full layer, reads [0, s) + I + [L - r, L) (the new token included).
 * Prefill is dense, nothing is freed, rows that fit s + keep + r read all.
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
} omni_priv;
#define PRIV(m) ((omni_priv *)(m)->priv)

typedef struct omni_state {
    int32_t *sel;               /* published entries (ascending), [cap] */
    int32_t n_sel, cap;
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
    omni_state *os = state;
    if (!os) return;
    free(os->sel);
    free(os);
}

static bool is_filter(const lethe_sparse_method *m, int32_t l) {
    const bool *full = PRIV(m)->full;
    return full[l] && l + 1 < m->env.n_layers && !full[l + 1];
}

static void omni_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    PRIV(m)->st = st;
    for (int32_t i = 0; i < st->n_seqs; i++) ((omni_state *)st->seqs[i].state)->valid = false;
}

static bool omni_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const lethe_sparse_step *st = PRIV(m)->st;
    if (!st || !is_filter(m, layer)) return false;
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (!st->seqs[i].is_prefill) return true;
    return false;
}

static int32_t omni_prefill(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            int32_t seq, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

static int32_t omni_decode(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           int32_t seq, const void *qact, int32_t *sel, int32_t cap) {
    const lethe_sparse_seq *q = &st->seqs[seq];
    omni_state *os = q->state;
    if (PRIV(m)->full[layer] || !os->valid) return lethe_sparse_select_all(m, layer, q->row, sel, cap);
    int32_t L = lethe_sparse_row_len(m, layer, q->row), s = m->knobs.sink_keep_tokens;
    int32_t n = 0;
    for (int32_t t = 0; t < s && t < L; t++) sel[n++] = t;
    for (int32_t i = 0; i < os->n_sel; i++) sel[n++] = os->sel[i];
    for (int32_t t = LETHE_MAX(s, L - m->knobs.recent_keep_tokens); t < L; t++) sel[n++] = t;
    LETHE_ASSERT(n <= cap);
    lethe_sparse_entries_to_slots(m, layer, q->row, sel, n);
    return n;
}

static void omni_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            const lethe_attn_args *attn) {
    if (!attn) return;
    int32_t s = m->knobs.sink_keep_tokens, r = m->knobs.recent_keep_tokens, K = m->knobs.decode_keep_tokens;
    lethe_score_seq *req = lethe_xmalloc((size_t)st->n_seqs * sizeof(*req));
    int32_t *who = lethe_xmalloc((size_t)st->n_seqs * sizeof(*who)), n = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        if (q->is_prefill) continue;
        omni_state *os = q->state;
        int32_t L = lethe_sparse_row_len(m, layer, q->row);
        int32_t c0 = s, c1 = L - r;
        os->valid = c1 - c0 > K; /* a row that fits reads every token */
        if (!os->valid) continue;
        LETHE_ASSERT(attn->sel_begin[i + 1] - attn->sel_begin[i] == L); /* a full layer reads all */
        /* the decode query: per head softmax over the candidates, max over heads */
        req[n] = (lethe_score_seq){.q_row = q->q_row + q->n_new - 1, .n_rows = 1,
                                   .key_begin = attn->sel_begin[i], .n_keys = L, .c0 = c0, .c1 = c1,
                                   .mode = LETHE_SCORES_PROB_MAX | LETHE_SCORES_CAND_DENOM};
        who[n++] = i;
    }
    float *out = lethe_xmalloc((lethe_attn_scores_out_len(req, n, 1) + 1) * sizeof(float));
    bool ok = lethe_sparse_scores(m, attn, req, n, 1, out);
    size_t off = 0;
    for (int32_t k = 0; k < n; k++) {
        omni_state *os = st->seqs[who[k]].state;
        int32_t c0 = req[k].c0, nc = req[k].c1 - c0;
        if (!ok) { /* nothing to score with (no backend): read everything */
            os->valid = false;
            continue;
        }
        if (os->cap < K) {
            os->sel = lethe_xrealloc(os->sel, (size_t)K * sizeof(int32_t));
            os->cap = K;
        }
        os->n_sel = lethe_topk_indices(out + off, nc, K, os->sel);
        for (int32_t j = 0; j < os->n_sel; j++) os->sel[j] += c0;
        off += (size_t)nc;
    }
    free(out);
    free(who);
    free(req);
}

static void omni_finish(lethe_sparse_method *m, const lethe_sparse_step *st) { PRIV(m)->st = NULL; }

const lethe_sparse_ops lethe_sparse_omnikv = {
    .name = "omnikv",
    .aliases = {NULL},
    .summary = "full filter layers pick the top tokens that the following sparse layers read",
    .flags = LETHE_SPARSE_PREFIX_CACHE,
    .init = omni_init,
    .destroy = omni_destroy,
    .set_knob = omni_set_knob,
    .request_init = omni_request_init,
    .request_finished = omni_request_finished,
    .prepare = omni_prepare,
    .needs_scores = omni_needs_scores,
    .build_prefill_selection = omni_prefill,
    .build_decode_selection = omni_decode,
    .after_attn = omni_after_attn,
    .finish_step = omni_finish,
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .configure = omni_configure,
};

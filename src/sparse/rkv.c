/* rkv.c - R-KV (methods.md §8): decode-time compaction for long reasoning
 * outputs, importance from the recent queries minus redundancy among the keys.
 *
 * The prompt is not compressed. Every decode step records each layer's query
 * (after RoPE) in a per-request ring of the last w = rkv_observation_tokens
 * queries (backend memory [w, n_heads, head_dim] per layer; the final prompt
 * chunk seeds it with its last w rows). When a row reaches
 * L >= B + rkv_compression_interval tokens (B = sink + keep + recent knobs,
 * used only as a total, as the anchor) the step compacts it to B:
 *
 *   I_l[j] = maxpool_k(mean over the w ring queries and all query heads of
 *            softmax over the prefix keys [0, L - w) of q . k_j / sqrt(d))
 *            (attn_scores PROB_MEAN | CAND_DENOM, then lethe_pool1d, k =
 *            rkv_kernel_size)
 *   R_l[j] = mean over KV heads of softmax_j(r_h[j]), r_h = the mean cosine
 *            similarity of key j to the others where the newest copy of
 *            near-duplicates (cosine > rkv_similarity_threshold) does not
 *            count its older copies (backend key_redundancy: tiles, O(L)
 *            memory), so an older copy is the more redundant one
 *   F[j]   = sum over layers of (alpha I_l[j] - (1 - alpha) R_l[j]),
 *            alpha = rkv_alpha
 *
 * and every layer keeps the top B - w of F among [0, L - w) plus the last w
 * tokens: one token set for all layers and heads (the anchor's global set;
 * the original keeps per KV head with lambda 0.07, budget 128-4096). No sink
 * is protected. The ring's queries are the last w tokens' own queries (the
 * compaction keeps the last w), so their causal mask is the attention's.
 * Ring memory is per request (n_layers x w x n_heads x head_dim activations),
 * outside the KV pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/compact_util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

typedef struct rkv_priv {
    lethe_knob_values kv;
    int32_t w, kernel;
    float alpha, threshold;
    lethe_decode_compact dc; /* budget, interval, which sequences this step compacts */
    const lethe_sparse_step *st;
    lethe_dev_buf qbuf; /* the ring's queries in order, [w, n_heads, head_dim] */
} rkv_priv;
#define PRIV(m) ((rkv_priv *)(m)->priv)

typedef struct rkv_state {
    lethe_dev_buf *ring; /* [n_layers] each [w, n_heads, head_dim] activations */
    int32_t n_rec, head;       /* queries recorded (<= w), next ring slot */
    lethe_compact_scores score; /* [len] F of the compaction in progress */
} rkv_state;

static const lethe_sparse_knob knobs[] = {
    {"rkv_observation_tokens", LETHE_KNOB_INT, "8", 1, 256,
     "recent queries scored; the last w tokens are always kept"},
    {"rkv_compression_interval", LETHE_KNOB_INT, "128", 1, 1 << 20,
     "compact when L >= budget + interval (>= w)"},
    {"rkv_kernel_size", LETHE_KNOB_INT, "7", 1, 63,
     "max-pool kernel over the importance (1 = off)"},
    {"rkv_alpha", LETHE_KNOB_FLOAT, "0.1", 0, 1, "weight of importance vs redundancy (1 - alpha)"},
    {"rkv_similarity_threshold", LETHE_KNOB_FLOAT, "0.5", -1, 1,
     "cosine above which keys are near-copies"},
};

static lethe_status rkv_init(lethe_sparse_method *m) {
    rkv_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void rkv_destroy(lethe_sparse_method *m) {
    rkv_priv *p = PRIV(m);
    if (p->qbuf.p) lethe_dev_buf_free(m, &p->qbuf);
    lethe_decode_compact_free(&p->dc);
    free(p);
    m->priv = NULL;
}
static lethe_status rkv_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status rkv_configure(lethe_sparse_method *m) {
    rkv_priv *p = PRIV(m);
    p->w = (int32_t)lethe_knob_num(m->ops, &p->kv, "rkv_observation_tokens");
    lethe_decode_compact_configure(
        m, &p->dc, (int32_t)lethe_knob_num(m->ops, &p->kv, "rkv_compression_interval"));
    p->kernel = (int32_t)lethe_knob_num(m->ops, &p->kv, "rkv_kernel_size");
    p->alpha = (float)lethe_knob_num(m->ops, &p->kv, "rkv_alpha");
    p->threshold = (float)lethe_knob_num(m->ops, &p->kv, "rkv_similarity_threshold");
    if (p->dc.interval < p->w)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config rkv_compression_interval=%d must be >= "
                            "rkv_observation_tokens=%d (method rkv)",
                            p->dc.interval, p->w);
    if (p->dc.budget <= p->w)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "rkv: budget sink + keep + recent = %d must exceed "
                            "rkv_observation_tokens=%d",
                            p->dc.budget, p->w);
    return LETHE_OK;
}

static lethe_status rkv_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s,
                                     void **state) {
    rkv_state *rs = lethe_xcalloc(1, sizeof(*rs));
    rs->ring = lethe_xcalloc((size_t)m->env.n_layers, sizeof(lethe_dev_buf));
    *state = rs;
    return LETHE_OK;
}
static void rkv_request_finished(lethe_sparse_method *m, void *state) {
    rkv_state *rs = state;
    if (!rs) return;
    for (int32_t l = 0; l < m->env.n_layers; l++)
        if (rs->ring[l].p) lethe_dev_buf_free(m, &rs->ring[l]);
    free(rs->ring);
    lethe_compact_scores_free(&rs->score);
    free(rs);
}

static void rkv_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    rkv_priv *p = PRIV(m);
    p->st = st;
    lethe_decode_compact_plan(m, &p->dc, st);
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        rkv_state *rs = q->state;
        if (p->dc.compact[i])
            lethe_compact_scores_reset(&rs->score, lethe_sparse_row_len(m, 0, q->row));
    }
}

/* queries are recorded at decode steps and from the final prompt chunk */
static bool records(const lethe_sparse_seq *q) { return !q->is_prefill || q->is_final_chunk; }

static bool rkv_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const lethe_sparse_step *st = PRIV(m)->st;
    for (int32_t i = 0; st && i < st->n_seqs; i++)
        if (records(&st->seqs[i])) return true;
    return false;
}

/* copies batch rows [r0, r0 + n) of q into the ring (oldest overwritten) */
static void record(lethe_sparse_method *m, rkv_priv *p, rkv_state *rs, int32_t layer, const void *q,
                   int32_t r0, int32_t n, bool advance) {
    lethe_backend *be = m->env.be;
    const size_t row = (size_t)m->env.n_heads * m->env.head_dim, rb = row * be->ops->act_size;
    if (!rs->ring[layer].p &&
        lethe_dev_buf_reserve(m, &rs->ring[layer], (size_t)p->w * rb) != LETHE_OK)
        return; /* no memory for the ring: importance from fewer queries */
    int32_t head = rs->head;
    for (int32_t t = 0; t < n; t++) {
        const int32_t idx = r0 + t;
        be->ops->gather_rows(be, (char *)rs->ring[layer].p + (size_t)head * rb, q, &idx, 1,
                             (int32_t)row);
        head = (head + 1) % p->w;
    }
    if (advance) { /* the last layer: the step's queries are in every ring */
        rs->head = head;
        rs->n_rec = LETHE_MIN(p->w, rs->n_rec + n);
    }
}

/* this layer's part of F: importance from the ring's queries, redundancy of the keys */
static void score_layer(lethe_sparse_method *m, rkv_priv *p, rkv_state *rs, int32_t layer,
                        int32_t seq, const lethe_attn_args *attn) {
    lethe_backend *be = m->env.be;
    const int32_t L = attn->sel_begin[seq + 1] - attn->sel_begin[seq];
    const int32_t *keys = attn->sel_slots + attn->sel_begin[seq];
    LETHE_ASSERT(L == rs->score.n);
    const int32_t nq = LETHE_MIN(rs->n_rec, p->w), nc = L - p->w;
    if (nc <= 0 || nq <= 0) return;
    /* the ring's queries oldest first (the current one last) */
    const size_t row = (size_t)m->env.n_heads * m->env.head_dim, rb = row * be->ops->act_size;
    if (lethe_dev_buf_reserve(m, &p->qbuf, (size_t)p->w * rb) != LETHE_OK) return;
    int32_t order[256];
    for (int32_t t = 0; t < nq; t++) order[t] = (rs->head - nq + t + 2 * p->w) % p->w;
    be->ops->gather_rows(be, p->qbuf.p, rs->ring[layer].p, order, nq, (int32_t)row);
    lethe_attn_args a = *attn;
    const int32_t qb[2] = {0, nq}, kb[2] = {0, L};
    a.q = p->qbuf.p;
    a.n_tokens = nq;
    a.n_seqs = 1;
    a.q_begin = qb;
    a.sel_begin = kb;
    a.sel_slots = keys;
    a.head_sel_begin = a.head_sel_slots = NULL;
    lethe_score_seq req = {.q_row = 0,
                           .n_rows = nq,
                           .key_begin = 0,
                           .n_keys = L,
                           .c0 = 0,
                           .c1 = nc,
                           .mode = LETHE_SCORES_PROB_MEAN | LETHE_SCORES_CAND_DENOM};
    float *imp = lethe_xmalloc(((size_t)nc + 1) * sizeof(float)),
          *pooled = lethe_xmalloc(((size_t)nc + 1) * sizeof(float));
    const int32_t KH = m->env.n_kv_heads;
    float *red = lethe_xmalloc(((size_t)KH * L + 1) * sizeof(float));
    if (lethe_sparse_scores(m, &a, &req, 1, 1, imp)) {
        lethe_pool1d(imp, nc, p->kernel, LETHE_REDUCE_MAX, pooled);
        be->ops->key_redundancy(be, red, attn->k_cache, keys, L, KH, m->env.head_dim, p->threshold);
        for (int32_t h = 0; h < KH; h++) lethe_softmax_inplace(red + (size_t)h * L, L);
        for (int32_t j = 0; j < nc; j++) {
            float r = 0.0f;
            for (int32_t h = 0; h < KH; h++) r += red[(size_t)h * L + j];
            rs->score.v[j] += p->alpha * pooled[j] - (1.0f - p->alpha) * (r / (float)KH);
        }
    }
    free(red);
    free(pooled);
    free(imp);
}

static void rkv_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           const lethe_attn_args *attn) {
    rkv_priv *p = PRIV(m);
    if (!attn || !attn->q || !m->env.be) return; /* the fake runner: nothing to record or score */
    const bool last_layer = layer == m->env.n_layers - 1;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        rkv_state *rs = q->state;
        if (!records(q)) continue;
        const int32_t n = LETHE_MIN(q->n_new, p->w);
        record(m, p, rs, layer, attn->q, q->q_row + q->n_new - n, n, last_layer);
        if (p->dc.compact[i]) score_layer(m, p, rs, layer, i, attn);
    }
}

static void rkv_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    rkv_priv *p = PRIV(m);
    int32_t *keep = NULL;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        rkv_state *rs = q->state;
        if (!p->dc.compact[i]) continue;
        const int32_t L = rs->score.n, nc = L - p->w, B = p->dc.budget;
        LETHE_ASSERT(nc > 0 && B < L && lethe_sparse_row_len(m, 0, q->row) == L);
        keep = lethe_xrealloc(keep, ((size_t)L + 1) * sizeof(int32_t));
        int32_t k = lethe_topk_indices(rs->score.v, nc, B - p->w, keep);
        for (int32_t j = nc; j < L; j++) keep[k++] = j; /* the last w tokens */
        LETHE_ASSERT(k == B);
        lethe_decode_compact_apply(m, q->row, keep, k);
        rs->score.n = 0;
    }
    free(keep);
    p->st = NULL;
}

static int32_t rkv_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                int32_t n_total, int32_t chunk) {
    return lethe_decode_compact_max_resident(&PRIV(m)->dc, n_prompt, n_total);
}

const lethe_sparse_ops lethe_sparse_rkv = {
    .name = "rkv",
    .aliases = {"r-kv", NULL},
    .summary = "decode-time compaction: importance of recent queries minus key redundancy (keeps "
               "the newest copy)",
    .kind = LETHE_SPARSE_KIND_EVICTION,
    .flags = LETHE_SPARSE_PER_LAYER_ROWS,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "decode_keep_tokens=100000",
                     .small = "sink_keep_tokens=0,recent_keep_tokens=4,decode_keep_tokens=8,"
                              "rkv_observation_tokens=4,rkv_compression_interval=4"},
    .max_resident = rkv_max_resident,
    .init = rkv_init,
    .configure = rkv_configure,
    .destroy = rkv_destroy,
    .set_knob = rkv_set_knob,
    .request_init = rkv_request_init,
    .request_finished = rkv_request_finished,
    .prepare = rkv_prepare,
    .finish_step = rkv_finish,
    .needs_scores = rkv_needs_scores,
    .after_attn = rkv_after_attn,
};

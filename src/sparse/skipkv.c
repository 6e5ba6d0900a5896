/* skipkv.c - SkipKV (methods.md §9): sentence-granularity eviction during
 * decode, near-duplicate sentences removed whole.
 *
 * The prompt is not compressed. When a row reaches L >= B +
 * skipkv_compression_interval (B = sink + keep + recent, one token set for
 * every layer) the step compacts the middle [s, L - r) (sink s and the last r
 * tokens always stay) at sentence granularity:
 *
 *  1. sentences: spans of the resident entries cut after a token whose text
 *     holds '.', '!', '?' or a newline (the committed token ids, decoded with
 *     the model's tokenizer), split at skipkv_max_sentence tokens, spans
 *     shorter than skipkv_min_sentence merged into the next; without a
 *     tokenizer (token-id models) fixed spans of skipkv_segment tokens;
 *  2. sentence embeddings: the mean over the span of the LAST layer's stored
 *     V rows (all KV heads), L2-normalized. The paper uses last-layer hidden
 *     states; the contract gives methods no hidden states, and V = W_v
 *     RMSNorm(h) of the last layer's input is the position-free projection of
 *     them that every resident token already has;
 *  3. a sentence whose cosine to a LATER sentence is >= skipkv_similarity_
 *     threshold is redundant and evicted whole (the later copy stays);
 *  4. if the row is still above B, whole sentences go in increasing order of
 *     importance (mean over the span of the decode query's attention, the
 *     softmax over the middle averaged over query heads, summed over layers;
 *     ties: the earlier sentence first) until it fits: the row may end
 *     below B, never inside a sentence.
 *
 * Activation steering (the paper's second half) needs per-model steering
 * vectors that lethe does not ship: skipkv_steering=true is refused with a
 * clear error (without skipkv_steering_asset, or with one, since the asset
 * format is not implemented). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/compact_util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"
#include "tokenizer/tokenizer.h"

typedef struct skipkv_priv {
    lethe_knob_values kv;
    int32_t segment, min_sent, max_sent;
    float threshold;
    lethe_decode_compact dc; /* budget, interval, which sequences this step compacts */
    const lethe_sparse_step *st;
    lethe_dev_buf vbuf; /* gathered last-layer V rows (device backends) */
} skipkv_priv;
#define PRIV(m) ((skipkv_priv *)(m)->priv)

typedef struct skipkv_state {
    lethe_compact_scores imp; /* [len] importance of the compaction in progress */
} skipkv_state;

static const lethe_sparse_knob knobs[] = {
    {"skipkv_compression_interval", LETHE_KNOB_INT, "128", 1, 1 << 20,
     "compact when L >= budget + interval"},
    {"skipkv_similarity_threshold", LETHE_KNOB_FLOAT, "0.95", -1, 1,
     "sentence cosine at which the earlier copy is evicted"},
    {"skipkv_segment", LETHE_KNOB_INT, "32", 1, 1 << 16,
     "span length without a tokenizer (token-id models)"},
    {"skipkv_min_sentence", LETHE_KNOB_INT, "4", 1, 1 << 16,
     "shorter sentences merge into the next"},
    {"skipkv_max_sentence", LETHE_KNOB_INT, "256", 1, 1 << 16, "longer sentences are split"},
    {"skipkv_steering", LETHE_KNOB_BOOL, "false", 0, 1,
     "activation steering (needs a per-model asset; not available)"},
    {"skipkv_steering_asset", LETHE_KNOB_STR, "none", 0, 0,
     "steering vectors file for skipkv_steering"},
};

static lethe_status skipkv_init(lethe_sparse_method *m) {
    skipkv_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void skipkv_destroy(lethe_sparse_method *m) {
    skipkv_priv *p = PRIV(m);
    if (p->vbuf.p) lethe_dev_buf_free(m, &p->vbuf);
    lethe_decode_compact_free(&p->dc);
    free(p);
    m->priv = NULL;
}
static lethe_status skipkv_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status skipkv_configure(lethe_sparse_method *m) {
    skipkv_priv *p = PRIV(m);
    if (lethe_knob_num(m->ops, &p->kv, "skipkv_steering") != 0) {
        const char *asset = lethe_knob_str(m->ops, &p->kv, "skipkv_steering_asset");
        if (!asset[0] || !strcmp(asset, "none"))
            return lethe_errorf(
                LETHE_ERR_INVALID,
                "--sparse-config skipkv_steering=true needs skipkv_steering_asset=PATH: activation "
                "steering adds per-model steering vectors (SkipKV publishes them for "
                "DeepSeek-R1-Distill Llama-8B / Qwen-7B / Qwen-14B) and lethe ships none");
        return lethe_errorf(
            LETHE_ERR_UNSUPPORTED,
            "--sparse-config skipkv_steering_asset=%s: lethe cannot read steering vector "
            "assets yet; run skipkv with skipkv_steering=false",
            asset);
    }
    lethe_decode_compact_configure(
        m, &p->dc, (int32_t)lethe_knob_num(m->ops, &p->kv, "skipkv_compression_interval"));
    p->threshold = (float)lethe_knob_num(m->ops, &p->kv, "skipkv_similarity_threshold");
    p->segment = (int32_t)lethe_knob_num(m->ops, &p->kv, "skipkv_segment");
    p->min_sent = (int32_t)lethe_knob_num(m->ops, &p->kv, "skipkv_min_sentence");
    p->max_sent = (int32_t)lethe_knob_num(m->ops, &p->kv, "skipkv_max_sentence");
    if (p->min_sent > p->max_sent)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config skipkv_min_sentence=%d > skipkv_max_sentence=%d",
                            p->min_sent, p->max_sent);
    if (m->env.be && m->env.be->ops->act_size != m->env.be->ops->kv_size)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "skipkv: the %s backend's KV and activation types differ "
                            "(sentence embeddings read V rows as activations)",
                            m->env.be->ops->name);
    return LETHE_OK;
}

static lethe_status skipkv_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s,
                                        void **state) {
    *state = lethe_xcalloc(1, sizeof(skipkv_state));
    return LETHE_OK;
}
static void skipkv_request_finished(lethe_sparse_method *m, void *state) {
    skipkv_state *ss = state;
    if (!ss) return;
    lethe_compact_scores_free(&ss->imp);
    free(ss);
}

static void skipkv_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    skipkv_priv *p = PRIV(m);
    p->st = st;
    lethe_decode_compact_plan(m, &p->dc, st);
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        skipkv_state *ss = q->state;
        if (p->dc.compact[i])
            lethe_compact_scores_reset(&ss->imp, lethe_sparse_row_len(m, 0, q->row));
    }
}

static bool skipkv_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const skipkv_priv *p = PRIV(m);
    return lethe_decode_compact_any(&p->dc, p->st);
}

/* importance: the decode query's softmax over the middle, mean over heads, summed over layers */
static void skipkv_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                              const lethe_attn_args *attn) {
    skipkv_priv *p = PRIV(m);
    const int32_t s = m->knobs.sink_keep_tokens, r = m->knobs.recent_keep_tokens;
    for (int32_t i = 0; attn && i < st->n_seqs; i++) {
        if (!p->dc.compact[i]) continue;
        skipkv_state *ss = st->seqs[i].state;
        const int32_t L = attn->sel_begin[i + 1] - attn->sel_begin[i];
        LETHE_ASSERT(L == ss->imp.n);
        const int32_t c0 = LETHE_MIN(s, L), c1 = LETHE_MAX(c0, L - r);
        if (c1 == c0) continue;
        lethe_score_seq req = {.q_row = st->seqs[i].q_row,
                               .n_rows = 1,
                               .key_begin = attn->sel_begin[i],
                               .n_keys = L,
                               .c0 = c0,
                               .c1 = c1,
                               .mode = LETHE_SCORES_PROB_MEAN | LETHE_SCORES_CAND_DENOM};
        float *out = lethe_xmalloc(((size_t)(c1 - c0) + 1) * sizeof(float));
        if (lethe_sparse_scores(m, attn, &req, 1, 1, out))
            for (int32_t j = c0; j < c1; j++) ss->imp.v[j] += out[j - c0];
        free(out);
    }
}

/* does the token's text end a sentence? */
static bool ends_sentence(const lethe_tokenizer *tok, int32_t id) {
    size_t n = 0;
    const char *b = lethe_token_bytes(tok, id, &n);
    for (size_t k = 0; b && k < n; k++)
        if (b[k] == '.' || b[k] == '!' || b[k] == '?' || b[k] == '\n') return true;
    return false;
}

/* sentences of entries [c0, c1) of the row: start entries into sb[0..n], sb[n] = c1 */
static int32_t sentences(const skipkv_priv *p, const lethe_sparse_method *m,
                         const lethe_sparse_seq *q, const int32_t *pos, int32_t c0, int32_t c1,
                         int32_t *sb) {
    int32_t n = 0, start = c0;
    const bool text = m->env.tok && q->tokens;
    for (int32_t e = c0; e < c1; e++) {
        const int32_t len = e + 1 - start;
        bool cut = text ? (ends_sentence(m->env.tok, q->tokens[pos[e]]) && len >= p->min_sent) ||
                              len >= p->max_sent
                        : len >= p->segment;
        if (cut || e + 1 == c1) {
            sb[n++] = start;
            start = e + 1;
        }
    }
    sb[n] = c1;
    return n;
}

/* the last layer's V rows of entries [c0, c1) as host f32 [c1 - c0, kv_dim]; NULL without a backend.
 * Latent KV (MLA: one latent + RoPE-key row per token, no V plane) gives its latent rows
 * instead: the values are decompressed from them, so they stand in as the embedding. */
static float *v_rows(skipkv_priv *p, lethe_sparse_method *m, const int32_t *slots, int32_t c0,
                     int32_t c1) {
    lethe_backend *be = m->env.be;
    const int32_t last = m->env.n_layers - 1, n = c1 - c0,
                  kvd = m->env.n_kv_heads * m->env.head_dim;
    if (!be || n <= 0) return NULL;
    const bool has_v = lethe_kv_v(m->env.pool, last) != NULL;
    float *out = lethe_xmalloc((size_t)n * kvd * sizeof(float));
    const float *host = lethe_sparse_kv_host(m, last, has_v);
    if (host) {
        for (int32_t e = 0; e < n; e++)
            memcpy(out + (size_t)e * kvd, host + (size_t)slots[c0 + e] * kvd, kvd * sizeof(float));
        return out;
    }
    /* device: V rows are kv-type elements, the same size as activations (configure) */
    if (lethe_dev_buf_reserve(m, &p->vbuf, (size_t)n * kvd * be->ops->act_size) != LETHE_OK) {
        free(out);
        return NULL;
    }
    const void *src = has_v ? lethe_kv_v(m->env.pool, last) : lethe_kv_k(m->env.pool, last);
    LETHE_ASSERT(src);
    be->ops->gather_rows(be, p->vbuf.p, src, slots + c0, n, kvd);
    be->ops->act_to_host(be, out, p->vbuf.p, (size_t)n * kvd);
    return out;
}

static void compact_seq(lethe_sparse_method *m, const lethe_sparse_seq *q) {
    skipkv_priv *p = PRIV(m);
    skipkv_state *ss = q->state;
    const int32_t sp0 = lethe_kv_space_of(m->env.pool, 0);
    const int32_t L = lethe_kv_row_len(m->env.pool, sp0, q->row), B = p->dc.budget;
    const int32_t c0 = LETHE_MIN(m->knobs.sink_keep_tokens, L),
                  c1 = LETHE_MAX(c0, L - m->knobs.recent_keep_tokens);
    LETHE_ASSERT(ss->imp.n == L);
    const int32_t *pos = lethe_kv_row_pos(m->env.pool, sp0, q->row);
    const int32_t last = m->env.n_layers - 1;
    const int32_t *slots_last = lethe_kv_row_slots(m->env.pool,
                                                   lethe_kv_space_of(m->env.pool, last), q->row);
    int32_t *sb = lethe_xmalloc(((size_t)(c1 - c0) + 2) * sizeof(int32_t));
    const int32_t ns = sentences(p, m, q, pos, c0, c1, sb);
    uint8_t *drop = lethe_xcalloc((size_t)ns + 1, 1);
    int32_t removed = 0;
    /* near-duplicate sentences: the earlier copy goes */
    const int32_t kvd = m->env.n_kv_heads * m->env.head_dim;
    float *v = v_rows(p, m, slots_last, c0, c1);
    if (v) {
        float *emb = lethe_xcalloc((size_t)ns * kvd + 1, sizeof(float));
        for (int32_t k = 0; k < ns; k++) {
            float *e = emb + (size_t)k * kvd;
            for (int32_t t = sb[k]; t < sb[k + 1]; t++)
                for (int32_t d = 0; d < kvd; d++) e[d] += v[(size_t)(t - c0) * kvd + d];
            double nn = 0;
            for (int32_t d = 0; d < kvd; d++) nn += (double)e[d] * e[d];
            const float inv = nn > 0 ? (float)(1.0 / sqrt(nn)) : 0.0f;
            for (int32_t d = 0; d < kvd; d++) e[d] *= inv;
        }
        for (int32_t a = 0; a < ns; a++)
            for (int32_t b = a + 1; b < ns && !drop[a]; b++) {
                double c = 0;
                for (int32_t d = 0; d < kvd; d++)
                    c += (double)emb[(size_t)a * kvd + d] * emb[(size_t)b * kvd + d];
                if (c >= p->threshold) drop[a] = 1;
            }
        free(emb);
        free(v);
    }
    for (int32_t k = 0; k < ns; k++)
        if (drop[k]) removed += sb[k + 1] - sb[k];
    /* still above the budget: the least important whole sentences */
    if (L - removed > B) {
        float *score = lethe_xmalloc(((size_t)ns + 1) * sizeof(float));
        for (int32_t k = 0; k < ns; k++) {
            double a = 0;
            for (int32_t t = sb[k]; t < sb[k + 1]; t++) a += ss->imp.v[t];
            /* dropped sentences rank first: they are gone already */
            score[k] = drop[k] ? -INFINITY : (float)(a / (sb[k + 1] - sb[k]));
        }
        int32_t *order = lethe_xmalloc(((size_t)ns + 1) * sizeof(int32_t));
        for (int32_t k = 0; k < ns; k++) order[k] = k;
        for (int32_t i = 1; i < ns; i++) /* ascending score, ties: the earlier first (stable) */
            for (int32_t j = i; j > 0 && score[order[j]] < score[order[j - 1]]; j--) {
                int32_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        for (int32_t i = 0; i < ns && L - removed > B; i++) {
            const int32_t k = order[i];
            if (drop[k]) continue;
            drop[k] = 1;
            removed += sb[k + 1] - sb[k];
        }
        free(order);
        free(score);
    }
    if (removed > 0) {
        int32_t *keep = lethe_xmalloc(((size_t)L + 1) * sizeof(int32_t)), n = 0;
        for (int32_t e = 0; e < c0; e++) keep[n++] = e;
        for (int32_t k = 0; k < ns; k++)
            if (!drop[k])
                for (int32_t t = sb[k]; t < sb[k + 1]; t++) keep[n++] = t;
        for (int32_t e = c1; e < L; e++) keep[n++] = e;
        lethe_decode_compact_apply(m, q->row, keep, n);
        free(keep);
    }
    ss->imp.n = 0;
    free(drop);
    free(sb);
}

static void skipkv_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    skipkv_priv *p = PRIV(m);
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (p->dc.compact[i]) compact_seq(m, &st->seqs[i]);
    p->st = NULL;
}

static int32_t skipkv_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                   int32_t n_total, int32_t chunk) {
    return lethe_decode_compact_max_resident(&PRIV(m)->dc, n_prompt, n_total);
}

const lethe_sparse_ops lethe_sparse_skipkv = {
    .name = "skipkv",
    .summary =
        "decode-time eviction of whole sentences: near-duplicates first, then the least attended",
    .kind = LETHE_SPARSE_KIND_EVICTION,
    .flags = LETHE_SPARSE_PER_LAYER_ROWS,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "decode_keep_tokens=100000",
                     .small = "sink_keep_tokens=2,recent_keep_tokens=4,decode_keep_tokens=8,"
                              "skipkv_compression_interval=4,skipkv_segment=4"},
    .max_resident = skipkv_max_resident,
    .init = skipkv_init,
    .configure = skipkv_configure,
    .destroy = skipkv_destroy,
    .set_knob = skipkv_set_knob,
    .request_init = skipkv_request_init,
    .request_finished = skipkv_request_finished,
    .prepare = skipkv_prepare,
    .finish_step = skipkv_finish,
    .needs_scores = skipkv_needs_scores,
    .after_attn = skipkv_after_attn,
};

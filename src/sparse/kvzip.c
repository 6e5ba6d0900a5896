/* kvzip.c - KVzip (methods.md §7): query-agnostic prompt compaction scored by
 * context reconstruction, through the contract's auxiliary prefill.
 *
 * At the end of the prompt (finish_step of the final chunk) the context is
 * the request's resident positions (the union over layers; the whole prompt
 * on a first turn). Its first kvzip_sink_tokens tokens are the sink (always
 * kept); the rest is cut into chunks of kvzip_chunk_size tokens. Chunk i is
 * replayed as an auxiliary prefill (lethe_sparse_aux_prefill: appended to
 * the row, teacher-forced, dropped afterwards):
 *
 *   replay_i = instruction + (i > 0: the last kvzip_postfix tokens of chunk
 *              i - 1) + chunk i's tokens
 *
 * and in every layer the replay queries score chunk i's keys: the softmax of
 * each replay query over the subsampled key set [sink keys, chunk-i keys,
 * the replay keys so far (causal)], max over the replay queries (attn_scores
 * LETHE_SCORES_PROB_MAX | ROW_MAX without CAND_DENOM: the denominator is
 * exactly that subset), max over the query heads of a KV group (pair level,
 * [Hk, n] per layer) or over all heads (shared level, [1, n]).
 *
 * Selection (kvzip_level):
 *   shared (the anchor's variant, default): one prompt-token set for every
 *          layer and head: score(token) = max over layers and heads; keep the
 *          sink + the top kvzip_token_budget - sink candidates.
 *   pair   (the paper's default): one global threshold over all (layer, KV
 *          head, token) entries: keep the top K of them, K = ceil(kvzip_ratio
 *          x entries) or, with kvzip_ratio = 0, (kvzip_token_budget - sink) x
 *          layers x KV heads (the shared level's entry count). Heads and layers
 *          get non-uniform lengths: the pool's per-entry KV-head masks
 *          (LETHE_SPARSE_HEAD_ROWS), so attention reads per KV head; a slot is
 *          freed when no head of its layer keeps the token.
 * Ties rank the smaller index first (lethe_topk_indices), so kept sets nest
 * as the budget grows. Nothing is replayed when the budget keeps every token
 * (identity). Generated tokens append; nothing is scored after the prompt.
 *
 * Differences from the paper / the anchor: no chat-template suffix after the
 * instruction (the method does not know the template; the instruction text is
 * the anchor's); the sink is a fixed count (the paper keeps the system
 * prefix); the anchor's sink / recent knobs are not read. Without a
 * tokenizer (token-id models) the instruction is empty.
 *
 * Memory: the final chunk's prefill_peak_slots adds the longest replay
 * (instruction + postfix + chunk), so admission reserves the replay's slots;
 * max_resident includes it. Cost: about one extra prefill of the context
 * (plus instruction and postfix per chunk) whose queries attend to the whole
 * context, plus the scores pass. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"
#include "tokenizer/tokenizer.h"

#define KVZIP_INSTRUCTION "\nReconstruct the following context span exactly:\n"

/* the replay being scored (finish_step -> aux prefill -> after_attn) */
typedef struct kvzip_cur {
    const lethe_sparse_seq *seq;
    int32_t sink_last; /* last sink position (-1: none) */
    int32_t plo, phi;  /* chunk positions [plo, phi] */
    int32_t *len0;     /* [n_layers] row lengths before the replay */
    float **score;     /* [n_layers] [G, len0[l]] max-accumulated, -INF = not scored */
} kvzip_cur;

typedef struct kvzip_priv {
    lethe_knob_values kv;
    int32_t budget, chunk, postfix, sink;
    float ratio;
    bool pair;
    int32_t *instr; /* instruction token ids */
    int32_t n_instr;
    kvzip_cur cur;
    bool scoring;
    int32_t *keys; /* after_attn scratch: the subsampled key slots */
    int32_t cap_keys;
} kvzip_priv;
#define PRIV(m) ((kvzip_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"kvzip_token_budget", LETHE_KNOB_INT, "4096", 1, 1 << 24,
     "prompt tokens kept (sink included); pair level: the same entry count over (layer, KV head)"},
    {"kvzip_level", LETHE_KNOB_STR, "shared", 0, 0,
     "shared (one token set, the anchor) | pair (per layer and KV head)"},
    {"kvzip_ratio", LETHE_KNOB_FLOAT, "0", 0, 1,
     "pair level: kept fraction of (layer, KV head, token) entries; 0 = from the budget"},
    {"kvzip_chunk_size", LETHE_KNOB_INT, "2048", 1, 1 << 20, "context tokens per replay"},
    {"kvzip_postfix", LETHE_KNOB_INT, "64", 0, 4096,
     "tokens of the previous chunk repeated before a chunk"},
    {"kvzip_sink_tokens", LETHE_KNOB_INT, "4", 0, 1 << 20,
     "first context tokens always kept (and in every score subset)"},
};

static lethe_status kvzip_init(lethe_sparse_method *m) {
    kvzip_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void kvzip_destroy(lethe_sparse_method *m) {
    kvzip_priv *p = PRIV(m);
    free(p->instr);
    free(p->keys);
    free(p);
    m->priv = NULL;
}
static lethe_status kvzip_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status kvzip_configure(lethe_sparse_method *m) {
    kvzip_priv *p = PRIV(m);
    const char *level = lethe_knob_str(m->ops, &p->kv, "kvzip_level");
    if (strcmp(level, "shared") && strcmp(level, "pair"))
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config kvzip_level=%s: expected shared or pair "
                            "(method kvzip)",
                            level);
    p->pair = !strcmp(level, "pair");
    p->budget = (int32_t)lethe_knob_num(m->ops, &p->kv, "kvzip_token_budget");
    p->ratio = (float)lethe_knob_num(m->ops, &p->kv, "kvzip_ratio");
    p->chunk = (int32_t)lethe_knob_num(m->ops, &p->kv, "kvzip_chunk_size");
    p->postfix = (int32_t)lethe_knob_num(m->ops, &p->kv, "kvzip_postfix");
    p->sink = (int32_t)lethe_knob_num(m->ops, &p->kv, "kvzip_sink_tokens");
    if (p->ratio > 0 && !p->pair)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config kvzip_ratio=%g needs kvzip_level=pair "
                            "(the shared level keeps kvzip_token_budget tokens)",
                            (double)p->ratio);
    if (p->sink >= p->budget)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config kvzip_sink_tokens=%d must be below "
                            "kvzip_token_budget=%d (method kvzip)",
                            p->sink, p->budget);
    if (p->pair && m->env.n_kv_heads > LETHE_KV_MAX_HEAD_MASK_HEADS)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "kvzip_level=pair: %d KV heads (at most %d)",
                            m->env.n_kv_heads, LETHE_KV_MAX_HEAD_MASK_HEADS);
    free(p->instr);
    p->instr = NULL;
    p->n_instr = 0;
    if (m->env.tok) {
        lethe_status st = lethe_tokenize(m->env.tok, KVZIP_INSTRUCTION, strlen(KVZIP_INSTRUCTION),
                                         false, false, &p->instr, &p->n_instr);
        if (st != LETHE_OK) return st;
    }
    return LETHE_OK;
}

/* the longest replay of a context of n tokens (0: nothing is replayed) */
static int32_t replay_max(const kvzip_priv *p, const lethe_sparse_method *m, int32_t n) {
    const int32_t cand = n - p->sink;
    if (cand <= 0) return 0;
    /* pair with a ratio: replayed unless every entry stays; else when the budget is exceeded */
    const bool compress = p->pair && p->ratio > 0 ? p->ratio < 1 : n > p->budget;
    if (!compress) return 0;
    const int32_t c = LETHE_MIN(p->chunk, cand);
    return p->n_instr + (cand > p->chunk ? p->postfix : 0) + c;
}

static int32_t kvzip_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                          int32_t n_resident, int32_t n_chunk) {
    if (!s->is_final_chunk || s->is_aux) return n_chunk;
    return n_chunk + replay_max(PRIV(m), m, n_resident + n_chunk);
}

static int32_t kvzip_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk) {
    const kvzip_priv *p = PRIV(m);
    const int32_t prefill = n_prompt + replay_max(p, m, n_prompt);
    /* shared: budget tokens per layer after the prompt; pair: a layer may keep
     * up to every token (the threshold is global) */
    const int32_t kept = p->pair ? n_prompt : LETHE_MIN(n_prompt, p->budget);
    return LETHE_MAX(prefill, kept + (n_total - n_prompt));
}

/* ---- scoring: after_attn of the replay's forwards ---- */

static bool kvzip_needs_scores(lethe_sparse_method *m, int32_t layer) { return PRIV(m)->scoring; }

static void kvzip_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             const lethe_attn_args *attn) {
    kvzip_priv *p = PRIV(m);
    if (!p->scoring || !attn) return;
    LETHE_ASSERT(st->n_seqs == 1 && st->seqs[0].is_aux);
    const lethe_sparse_seq *q = &st->seqs[0];
    const int32_t sp = lethe_kv_space_of(m->env.pool, layer);
    const int32_t len = lethe_kv_row_len(m->env.pool, sp, q->row), len0 = p->cur.len0[layer];
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, sp, q->row);
    const int32_t *pos = lethe_kv_row_pos(m->env.pool, sp, q->row);
    LETHE_ASSERT(attn->sel_begin[1] == len); /* the default selection: every resident entry */
    if (len > p->cap_keys) {
        p->cap_keys = LETHE_MAX(len, 2 * p->cap_keys);
        p->keys = lethe_xrealloc(p->keys, (size_t)p->cap_keys * sizeof(int32_t));
    }
    /* keys: [sink entries][chunk entries][replay entries so far] */
    int32_t nk = 0, c_first = -1;
    for (int32_t i = 0; i < len0 && pos[i] <= p->cur.sink_last; i++) p->keys[nk++] = slots[i];
    const int32_t ns = nk;
    for (int32_t i = 0; i < len0; i++)
        if (pos[i] >= p->cur.plo && pos[i] <= p->cur.phi) {
            if (c_first < 0) c_first = i;
            p->keys[nk++] = slots[i];
        }
    const int32_t nc = nk - ns;
    if (nc == 0) return; /* this layer holds none of the chunk (an earlier compaction) */
    for (int32_t i = len0; i < len; i++) p->keys[nk++] = slots[i];
    const int32_t G = p->pair ? m->env.n_kv_heads : 1;
    lethe_score_seq req = {.q_row = q->q_row,
                           .n_rows = q->n_new,
                           .key_begin = 0,
                           .n_keys = nk,
                           .c0 = ns,
                           .c1 = ns + nc,
                           .mode = LETHE_SCORES_PROB_MAX | LETHE_SCORES_ROW_MAX};
    lethe_attn_args a = *attn;
    const int32_t kb[2] = {0, nk};
    a.sel_begin = kb;
    a.sel_slots = p->keys;
    a.head_sel_begin = a.head_sel_slots = NULL;
    float *out = lethe_xmalloc((size_t)G * (size_t)nc * sizeof(float));
    if (lethe_sparse_scores(m, &a, &req, 1, G, out)) {
        /* the chunk's entries are consecutive in the row: [c_first, c_first + nc) */
        float *sc = p->cur.score[layer];
        for (int32_t g = 0; g < G; g++)
            for (int32_t j = 0; j < nc; j++) {
                float *d = &sc[(size_t)g * len0 + c_first + j];
                const float v = out[(size_t)g * nc + j];
                if (v > *d) *d = v;
            }
    }
    free(out);
}

/* ---- the replay and the selection (finish_step) ---- */

/* the context: ascending union of the resident positions over layers */
static int32_t *context_positions(const lethe_sparse_method *m, int32_t row, int32_t *n_out) {
    const lethe_kv_pool *pool = m->env.pool;
    int32_t n = 0, *ctx = NULL;
    for (int32_t sp = 0; sp < lethe_kv_n_spaces(pool); sp++) {
        const int32_t len = lethe_kv_row_len(pool, sp, row);
        const int32_t *pos = lethe_kv_row_pos(pool, sp, row);
        int32_t *mg = lethe_xmalloc(((size_t)n + (size_t)len + 1) * sizeof(int32_t)), k = 0, i = 0,
                j = 0;
        while (i < n || j < len) {
            int32_t v = j >= len || (i < n && ctx[i] <= pos[j]) ? ctx[i] : pos[j];
            if (i < n && ctx[i] == v) i++;
            if (j < len && pos[j] == v) j++;
            mg[k++] = v;
        }
        free(ctx);
        ctx = mg;
        n = k;
    }
    *n_out = n;
    return ctx;
}

/* index of position v in the ascending ctx[0..n) (present) */
static int32_t ctx_index(const int32_t *ctx, int32_t n, int32_t v) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t mid = (lo + hi) / 2;
        if (ctx[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    LETHE_ASSERT(ctx[lo] == v);
    return lo;
}

/* runs every chunk's replay; false when an auxiliary prefill failed */
static bool replay_all(lethe_sparse_method *m, const lethe_sparse_seq *q, const int32_t *ctx,
                       int32_t n) {
    kvzip_priv *p = PRIV(m);
    const int32_t s = LETHE_MIN(p->sink, n);
    int32_t *rep = lethe_xmalloc(((size_t)p->n_instr + (size_t)p->postfix + (size_t)p->chunk) *
                                 sizeof(int32_t));
    bool ok = true;
    for (int32_t c0 = s; c0 < n && ok; c0 += p->chunk) {
        const int32_t c1 = LETHE_MIN(n, c0 + p->chunk);
        int32_t nr = 0;
        memcpy(rep, p->instr, (size_t)p->n_instr * sizeof(int32_t));
        nr += p->n_instr;
        if (c0 > s)
            for (int32_t i = LETHE_MAX(s, c0 - p->postfix); i < c0; i++)
                rep[nr++] = q->tokens[ctx[i]];
        for (int32_t i = c0; i < c1; i++) rep[nr++] = q->tokens[ctx[i]];
        p->cur.plo = ctx[c0];
        p->cur.phi = ctx[c1 - 1];
        p->scoring = true;
        lethe_status st = lethe_sparse_aux_prefill(m, q, rep, nr);
        p->scoring = false;
        if (st != LETHE_OK) {
            LOG_WARN(
                "kvzip: request %llu: context replay failed (%s); the prompt stays uncompressed",
                (unsigned long long)q->request_id, lethe_last_error());
            ok = false;
        }
    }
    free(rep);
    return ok;
}

/* shared level: one token set for every layer */
static void select_shared(lethe_sparse_method *m, const lethe_sparse_seq *q, const int32_t *ctx,
                          int32_t n) {
    kvzip_priv *p = PRIV(m);
    const int32_t s = LETHE_MIN(p->sink, n), nc = n - s;
    float *g = lethe_xmalloc(((size_t)nc + 1) * sizeof(float));
    for (int32_t j = 0; j < nc; j++) g[j] = -INFINITY;
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        const int32_t *pos = lethe_kv_row_pos(m->env.pool, lethe_kv_space_of(m->env.pool, l),
                                              q->row);
        for (int32_t i = 0; i < p->cur.len0[l]; i++) {
            const int32_t c = ctx_index(ctx, n, pos[i]) - s;
            if (c >= 0 && p->cur.score[l][i] > g[c]) g[c] = p->cur.score[l][i];
        }
    }
    int32_t *top = lethe_xmalloc(((size_t)nc + 1) * sizeof(int32_t));
    const int32_t nt = lethe_topk_indices(g, nc, p->budget - s, top);
    uint8_t *kept = lethe_xcalloc((size_t)n, 1);
    for (int32_t i = 0; i < s; i++) kept[i] = 1;
    for (int32_t i = 0; i < nt; i++) kept[s + top[i]] = 1;
    int32_t *keep = top; /* reused: row entries to keep, <= len0 */
    keep = lethe_xrealloc(keep, ((size_t)n + 1) * sizeof(int32_t));
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        const int32_t *pos = lethe_kv_row_pos(m->env.pool, lethe_kv_space_of(m->env.pool, l),
                                              q->row);
        int32_t k = 0;
        for (int32_t i = 0; i < p->cur.len0[l]; i++) /* retention-pinned entries stay too */
            if (kept[ctx_index(ctx, n, pos[i])] ||
                lethe_kv_pos_protected(m->env.pool, q->row, pos[i]))
                keep[k++] = i;
        lethe_kv_keep(m->env.pool, l, q->row, keep, k);
    }
    free(keep);
    free(kept);
    free(g);
}

/* pair level: one global threshold over (layer, KV head, token) entries */
static void select_pair(lethe_sparse_method *m, const lethe_sparse_seq *q, const int32_t *ctx,
                        int32_t n) {
    kvzip_priv *p = PRIV(m);
    const int32_t KH = m->env.n_kv_heads, NL = m->env.n_layers, s = LETHE_MIN(p->sink, n);
    int64_t total = 0, cand = 0;
    for (int32_t l = 0; l < NL; l++) total += (int64_t)KH * p->cur.len0[l];
    LETHE_ASSERT(total < INT32_MAX);
    /* flat [layer][head][entry]; sink entries and entries a head already
     * dropped are not candidates (NaN ranks last and is never needed) */
    float *flat = lethe_xmalloc(((size_t)total + 1) * sizeof(float));
    int64_t off = 0;
    for (int32_t l = 0; l < NL; l++) {
        const int32_t sp = lethe_kv_space_of(m->env.pool, l), L = p->cur.len0[l];
        const int32_t *pos = lethe_kv_row_pos(m->env.pool, sp, q->row);
        const uint64_t *mk = lethe_kv_row_head_mask(m->env.pool, sp, q->row);
        for (int32_t h = 0; h < KH; h++)
            for (int32_t i = 0; i < L; i++, off++) {
                const bool c = ctx_index(ctx, n, pos[i]) >= s && ((mk[i] >> h) & 1u);
                flat[off] = c ? p->cur.score[l][(size_t)h * L + i] : NAN;
                cand += c;
            }
    }
    int64_t K = p->ratio > 0 ? (int64_t)ceil((double)p->ratio * (double)cand)
                             : (int64_t)(p->budget - s) * NL * KH;
    K = LETHE_MIN(K, cand);
    int32_t *top = lethe_xmalloc(((size_t)K + 1) * sizeof(int32_t));
    const int32_t nt = lethe_topk_indices(flat, (int32_t)total, (int32_t)K, top);
    LETHE_ASSERT(nt == K);
    uint64_t *mask = NULL;
    int32_t t = 0;
    off = 0;
    for (int32_t l = 0; l < NL; l++) {
        const int32_t sp = lethe_kv_space_of(m->env.pool, l), L = p->cur.len0[l];
        const int32_t *pos = lethe_kv_row_pos(m->env.pool, sp, q->row);
        const uint64_t *mk = lethe_kv_row_head_mask(m->env.pool, sp, q->row);
        mask = lethe_xrealloc(mask, ((size_t)L + 1) * sizeof(uint64_t));
        for (int32_t i = 0; i < L; i++) /* sink and retention-pinned entries keep every head */
            mask[i] = ctx_index(ctx, n, pos[i]) < s ||
                              lethe_kv_pos_protected(m->env.pool, q->row, pos[i])
                          ? mk[i]
                          : 0;
        for (; t < nt && top[t] < off + (int64_t)KH * L; t++) {
            const int64_t e = top[t] - off;
            mask[e % L] |= (uint64_t)1 << (e / L);
        }
        off += (int64_t)KH * L;
        lethe_kv_keep_heads(m->env.pool, l, q->row, mask);
    }
    free(mask);
    free(top);
    free(flat);
}

static void compress(lethe_sparse_method *m, const lethe_sparse_seq *q) {
    kvzip_priv *p = PRIV(m);
    /* no engine to replay with (the contract harness): the prompt stays whole */
    if (!m->env.aux_prefill || !q->tokens) return;
    int32_t n = 0;
    int32_t *ctx = context_positions(m, q->row, &n);
    if (replay_max(p, m, n) == 0) {
        free(ctx);
        return; /* the budget keeps every token */
    }
    const int32_t NL = m->env.n_layers, G = p->pair ? m->env.n_kv_heads : 1;
    p->cur.seq = q;
    p->cur.sink_last = LETHE_MIN(p->sink, n) > 0 ? ctx[LETHE_MIN(p->sink, n) - 1] : -1;
    p->cur.len0 = lethe_xmalloc((size_t)NL * sizeof(int32_t));
    p->cur.score = lethe_xcalloc((size_t)NL, sizeof(float *));
    for (int32_t l = 0; l < NL; l++) {
        p->cur.len0[l] = lethe_sparse_row_len(m, l, q->row);
        const size_t ne = (size_t)G * (size_t)p->cur.len0[l];
        p->cur.score[l] = lethe_xmalloc((ne + 1) * sizeof(float));
        /* unscored = 0 (not -INF): with no backend to score on (the fake
         * runner) every candidate ties and the smaller index wins */
        for (size_t i = 0; i < ne; i++) p->cur.score[l][i] = 0.0f;
    }
    if (replay_all(m, q, ctx, n)) {
        for (int32_t l = 0; l < NL; l++)
            LETHE_ASSERT(lethe_sparse_row_len(m, l, q->row) == p->cur.len0[l]);
        if (p->pair) select_pair(m, q, ctx, n);
        else select_shared(m, q, ctx, n);
    }
    for (int32_t l = 0; l < NL; l++) free(p->cur.score[l]);
    free(p->cur.score);
    free(p->cur.len0);
    memset(&p->cur, 0, sizeof(p->cur));
    free(ctx);
}

static void kvzip_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        if (q->is_prefill && q->is_final_chunk && !q->is_aux) compress(m, q);
    }
}

const lethe_sparse_ops lethe_sparse_kvzip = {
    .name = "kvzip",
    .summary = "context-reconstruction scores from a replay of the prompt; keep the top tokens (or "
               "per-head entries)",
    .kind = LETHE_SPARSE_KIND_EVICTION,
    .flags = LETHE_SPARSE_PER_LAYER_ROWS | LETHE_SPARSE_HEAD_ROWS,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs =
        {.identity = "kvzip_token_budget=100000",
         .small = "kvzip_token_budget=12,kvzip_chunk_size=16,kvzip_postfix=4,kvzip_sink_tokens=2"},
    .max_resident = kvzip_max_resident,
    .prefill_peak_slots = kvzip_peak,
    .init = kvzip_init,
    .configure = kvzip_configure,
    .destroy = kvzip_destroy,
    .set_knob = kvzip_set_knob,
    .finish_step = kvzip_finish,
    .needs_scores = kvzip_needs_scores,
    .after_attn = kvzip_after_attn,
};

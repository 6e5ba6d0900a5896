/* runner_fake.c - a deterministic fake model for scheduler/KV/engine tests.
 *
 * Per token, per layer l (h = the token's running state, p = its position):
 *   h_0        = mix(seed, token)
 *   kv_l       = mix(mix(h_l, p), l)            stored in the token's slot
 *   acc        = running hash of the kv_l of the selection entries, in
 *                selection order, up to the token's own (causal) entry
 *   h_{l+1}    = mix(h_l, acc)
 * and logits = a fixed pseudo-random vector seeded by h_L. So each output
 * depends on every selected slot's content and order, like attention does,
 * but costs O(selection) per sequence per layer. A wrong, stale or missing
 * slot changes the tokens; lethe_fake_reference() recomputes the dense
 * model from the token list alone (no slots) to compare against.
 *
 * With check_dense the runner also asserts, per selection, that the stored
 * positions are exactly 0..n-1 and that the last entries are the new
 * tokens' slots (the dense method's contract). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "engine/runner.h"

static inline uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t z = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct fake_ctx {
    lethe_fake_params p;
    lethe_kv_pool *pool;
    int32_t n_slots;
    uint64_t *kv;        /* [n_layers][n_slots] */
    int32_t *kv_pos;     /* [n_layers][n_slots], -1 = never written */
    uint64_t *h, *h_next;/* [n_tokens_max] */
    int32_t n_tokens_max;
} fake_ctx;

void lethe_fake_default_params(lethe_fake_params *p) {
    memset(p, 0, sizeof(*p));
    p->n_layers = 2;
    p->n_vocab = 64;
    p->max_pos = 4096;
    p->eos = -1;
    p->seed = 1234;
}

void lethe_fake_logits(const lethe_fake_params *p, uint64_t state, float *logits) {
    for (int32_t v = 0; v < p->n_vocab; v++) {
        uint64_t x = mix(state, (uint64_t)v + 1);
        logits[v] = (float)((double)(x >> 11) * (1.0 / 9007199254740992.0) * 8.0 - 4.0);
    }
}

static lethe_status fake_bind(void *vctx, lethe_kv_pool *pool, int32_t n_tokens_max) {
    fake_ctx *c = vctx;
    c->pool = pool;
    c->n_slots = lethe_kv_n_slots(pool);
    size_t n = (size_t)c->p.n_layers * (size_t)c->n_slots;
    c->kv = calloc(n, sizeof(uint64_t));
    c->kv_pos = malloc(n * sizeof(int32_t));
    c->h = malloc((size_t)n_tokens_max * sizeof(uint64_t));
    c->h_next = malloc((size_t)n_tokens_max * sizeof(uint64_t));
    if (!c->kv || !c->kv_pos || !c->h || !c->h_next)
        return lethe_errorf(LETHE_ERR_NOMEM, "fake runner: out of memory");
    for (size_t i = 0; i < n; i++) c->kv_pos[i] = -1;
    c->n_tokens_max = n_tokens_max;
    return LETHE_OK;
}

static void fake_forward(void *vctx, const lethe_fwd_batch *b, const lethe_fwd_hooks *hooks,
                         float *logits) {
    fake_ctx *c = vctx;
    LETHE_ASSERT(b->n_tokens <= c->n_tokens_max);
    for (int32_t i = 0; i < b->n_tokens; i++) {
        LETHE_ASSERT(b->tokens[i] >= 0 && b->tokens[i] < c->p.n_vocab);
        c->h[i] = mix(c->p.seed, (uint64_t)b->tokens[i]);
    }
    for (int32_t l = 0; l < c->p.n_layers; l++) {
        lethe_layer_plan plan = {0};
        hooks->plan_layer(hooks->ctx, l, b, NULL, &plan);
        uint64_t *kv = c->kv + (size_t)l * (size_t)c->n_slots;
        int32_t *kv_pos = c->kv_pos + (size_t)l * (size_t)c->n_slots;
        for (int32_t i = 0; i < b->n_tokens; i++) {
            int32_t slot = plan.store_slots[i];
            LETHE_ASSERT(slot >= 0 && slot < c->n_slots);
            kv[slot] = mix(mix(c->h[i], (uint64_t)b->pos[i]), (uint64_t)l);
            kv_pos[slot] = b->pos[i];
        }
        LETHE_ASSERT(plan.sel_begin[0] == 0);
        for (int32_t s = 0; s < b->n_seqs; s++) {
            int32_t q0 = b->seq_begin[s], nq = b->seq_begin[s + 1] - q0;
            const int32_t *sel = plan.sel_slots + plan.sel_begin[s];
            int32_t ns = plan.sel_begin[s + 1] - plan.sel_begin[s];
            LETHE_ASSERT(nq >= 1 && ns >= nq);
            for (int32_t j = 0; j < nq; j++) LETHE_ASSERT(sel[ns - nq + j] == plan.store_slots[q0 + j]);
            uint64_t acc = mix(0x5eedull, (uint64_t)l);
            int32_t prev_pos = -1;
            for (int32_t e = 0; e < ns; e++) {
                int32_t slot = sel[e];
                LETHE_ASSERT(slot >= 0 && slot < c->n_slots);
                LETHE_ASSERT(kv_pos[slot] > prev_pos); /* written, ascending positions */
                prev_pos = kv_pos[slot];
                if (c->p.check_dense) LETHE_ASSERT(kv_pos[slot] == e);
                acc = mix(acc, kv[slot]);
                int32_t j = e - (ns - nq);
                if (j >= 0) c->h_next[q0 + j] = mix(c->h[q0 + j], acc);
            }
        }
        uint64_t *t = c->h;
        c->h = c->h_next;
        c->h_next = t;
        if (hooks->after_attn) { /* no q / K here: methods cannot score (lethe_sparse_scores) */
            lethe_attn_args a = {.n_tokens = b->n_tokens, .n_seqs = b->n_seqs, .q_begin = b->seq_begin,
                                 .sel_begin = plan.sel_begin, .sel_slots = plan.sel_slots,
                                 .n_heads = 1, .n_kv_heads = 1, .head_dim = 1, .scale = 1.0f};
            hooks->after_attn(hooks->ctx, l, b, &a);
        }
    }
    for (int32_t k = 0; k < b->n_logits; k++)
        lethe_fake_logits(&c->p, c->h[b->logit_rows[k]], logits + (size_t)k * (size_t)c->p.n_vocab);
}

static void fake_destroy(void *vctx) {
    fake_ctx *c = vctx;
    if (!c) return;
    free(c->kv);
    free(c->kv_pos);
    free(c->h);
    free(c->h_next);
    free(c);
}

lethe_status lethe_runner_fake(const lethe_fake_params *p, lethe_runner *out) {
    memset(out, 0, sizeof(*out));
    if (p->n_layers <= 0 || p->n_vocab <= 1 || p->max_pos <= 1)
        return lethe_errorf(LETHE_ERR_INVALID, "fake runner: bad params");
    fake_ctx *c = lethe_xcalloc(1, sizeof(*c));
    c->p = *p;
    out->ctx = c;
    out->kind = "fake";
    lethe_model_config_init(&out->cfg);
    snprintf(out->cfg.arch, sizeof(out->cfg.arch), "fake");
    out->cfg.n_vocab = p->n_vocab;
    out->cfg.n_layers = p->n_layers;
    out->cfg.n_heads = 1;
    out->cfg.n_kv_heads = 1;
    out->cfg.head_dim = 1;
    out->cfg.dim = 1;
    out->cfg.max_pos = p->max_pos;
    if (p->eos >= 0) {
        out->cfg.eos_ids[0] = p->eos;
        out->cfg.n_eos_ids = 1;
    }
    out->bind = fake_bind;
    out->forward = fake_forward;
    out->destroy = fake_destroy;
    return LETHE_OK;
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* the dense fake model's per-layer running hashes, advanced by one token */
static uint64_t ref_advance(const lethe_fake_params *p, uint64_t *acc, int32_t tok, int32_t pos) {
    uint64_t h = mix(p->seed, (uint64_t)tok);
    for (int32_t l = 0; l < p->n_layers; l++) {
        acc[l] = mix(acc[l], mix(mix(h, (uint64_t)pos), (uint64_t)l));
        h = mix(h, acc[l]);
    }
    return h;
}

static uint64_t *ref_init(const lethe_fake_params *p) {
    uint64_t *acc = lethe_xmalloc((size_t)p->n_layers * sizeof(uint64_t));
    for (int32_t l = 0; l < p->n_layers; l++) acc[l] = mix(0x5eedull, (uint64_t)l);
    return acc;
}

void lethe_fake_reference_logits(const lethe_fake_params *p, const int32_t *tokens, int32_t n,
                                 float *logits) {
    uint64_t *acc = ref_init(p), h = 0;
    for (int32_t i = 0; i < n; i++) h = ref_advance(p, acc, tokens[i], i);
    lethe_fake_logits(p, h, logits);
    free(acc);
}

int32_t lethe_fake_reference(const lethe_fake_params *p, const int32_t *tokens, int32_t n_prompt,
                             int32_t n_gen, bool ignore_eos, int32_t *out) {
    uint64_t *acc = ref_init(p), h = 0;
    float *logits = lethe_xmalloc((size_t)p->n_vocab * sizeof(float));
    int32_t pos = 0, n_out = 0;
    for (; pos < n_prompt; pos++) h = ref_advance(p, acc, tokens[pos], pos);
    while (n_out < n_gen) {
        lethe_fake_logits(p, h, logits);
        int32_t tok = argmax(logits, p->n_vocab);
        out[n_out++] = tok;
        if (!ignore_eos && tok == p->eos) break;
        h = ref_advance(p, acc, tok, pos++);
    }
    free(acc);
    free(logits);
    return n_out;
}

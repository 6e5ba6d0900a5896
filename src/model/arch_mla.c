/* arch_mla.c - multi-head latent attention + mixture of experts:
 * glm4_moe_lite (GLM-4.7-Flash; GGUF spelling deepseek2).
 *
 * Dimensions: H heads, C = kv_lora_rank, R = qk_rope_dim, N = qk_nope_dim,
 * Vd = v_head_dim, Dk = C + R. The KV of a token (one cache slot, the model's
 * KV geometry: 1 "KV head" of Dk, config.h) is [c | k_pe]: the normed latent
 * and the RoPE key every head shares. Per layer, for the n batch rows:
 *   xn = rmsnorm(x)
 *   qa = rmsnorm(xn Wqa^T) [n, q_lora]        (or qa = xn without q_lora_rank)
 *   q_nope = qa Wqb_nope^T [n, H, N], q_pe = RoPE(qa Wqb_pe^T) [n, H, R]
 *   q_abs[t, h] = [W_kb[h]^T q_nope[t, h] | q_pe[t, h]]  [n, H, Dk]   absorbed query
 *   c = rmsnorm(xn Wkv_lat^T) [n, C], k_pe = RoPE(xn Wkv_pe^T) [n, R]
 *   plan = hooks->plan_layer(l, q_abs); slot <- [c | k_pe]
 *   o_lat[t, h] = sum_s softmax_s(scale q_abs[t, h] . slot_s) c_s   [n, H, C]
 *       (attention with V = the first C columns of each slot: one slot read
 *        serves every head; scores equal the expanded form's q . k exactly)
 *   x += (W_vb[h] o_lat[t, h])_h Wo^T                 [n, H, Vd] -> [n, dim]
 *   xn = rmsnorm(x); x += MoE(xn) (shared expert included) or the dense MLP
 * scale = (N + R)^-1/2. The reference's RoPE pairs are interleaved (rope_interleave);
 * the loader permutes the rows of Wqb_pe and Wkv_pe into rotate-half order,
 * which gives the same q_pe . k_pe. The latent norms use eps 1e-6 (the
 * reference constructs them without the config's eps).
 *
 * Expanded form (long prefill): absorbed attention costs (2C + R) per query,
 * key and head, every one on the attention kernel; decompressing the keys
 * costs C (Nd + Vd) per key and head once, as GEMMs, after which a query-key
 * pair costs Nd + R + Vd (GLM-4.7-Flash: 1088 vs 512, the decompression
 * paid back at ~200 queries per key in multiply-adds, sooner on tensor
 * cores). A layer whose batch averages at least LETHE_MLA_EXPAND_MIN_Q
 * queries per selected key (env.h, default 64; 0: never), with at most
 * MLA_EXPAND_MAX_KEYS selected slots, runs (decode steps, one query per
 * sequence, always run absorbed):
 *   g = k_cache[l][sel]                          [M, Dk]  M = all selected slots
 *   K[j, h] = [W_kb[h] g_j[:C] | g_j[C:]]        [M, H, De]  (Nd + R used)
 *   V[j, h] = W_vb[h] g_j[:C]                    [M, H, De]  (Vd used)
 *   Q[t, h] = [q_nope[t, h] | q_pe[t, h]]        [n, H, De]
 *   att = attention(Q, K, V, identity selection: sel_dense) [n, H, Vd]
 * De = max(Nd + R, Vd); the padding columns stay zero (zero q / k columns
 * add nothing; extra V columns only reach output columns that are dropped).
 * The scores are those of the absorbed form (q_abs . slot = q . k exactly),
 * so plan_layer / after_attn see the absorbed query and the latent cache,
 * and sparse methods score as in decode. Multi-token-prediction layers after
 * n_layers are not loaded. */
#include <math.h>
#include <string.h>

#include "core/env.h"
#include "core/log.h"
#include "core/util.h"
#include "model/model.h"
#include "model/moe.h"

#define LOGIT_CHUNK 64
#define LATENT_NORM_EPS 1e-6f
#define MLA_EXPAND_MAX_KEYS 65536 /* selected slots of one expanded layer (scratch bound) */

typedef struct mla_ws {
    void *x, *xn;    /* [N, dim] */
    void *qa;        /* [N, max(q_lora, 1)] */
    void *q_nope;    /* [N, H, nope] */
    void *q_pe;      /* [N, H, rope] */
    void *q_abs;     /* [N, H, Dk] */
    void *lat;       /* [N, C] */
    void *kpe;       /* [N, rope] */
    void *o_lat;     /* [N, H, C] */
    void *att;       /* [N, H, Vd] */
    void *gate, *up; /* [N, ffn_dim] dense layers */
    void *rows;      /* [LOGIT_CHUNK, dim] */
    void *logits;    /* [max(LOGIT_CHUNK, n_logits_dev), n_vocab] */
    lethe_moe_bufs moe;
    /* expanded form (see the top): queries per key from which it runs (0: never) */
    int64_t expand_min_q;
    void *q_exp, *o_exp;  /* [N, H, De] (o_exp only when Vd < De; else att is the output) */
    void *g, *k_exp, *v_exp; /* [M, Dk], [M, H, De] x 2, M <= exp_cap; grown on use */
    int32_t *iota;           /* host [exp_cap]: the identity selection */
    int32_t exp_cap;
} mla_ws;

static int32_t mla_de(const lethe_model_config *c) {
    return LETHE_MAX(c->qk_nope_dim + c->qk_rope_dim, c->v_head_dim);
}

static lethe_status mla_check(const lethe_model_config *c) {
    if (c->kv_lora_rank <= 0 || c->qk_rope_dim <= 0 || c->qk_nope_dim <= 0 || c->v_head_dim <= 0)
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: latent attention needs kv_lora_rank, "
                            "qk_rope_head_dim, qk_nope_head_dim and v_head_dim > 0 (got %d, %d, "
                            "%d, %d)",
                            c->arch, c->kv_lora_rank, c->qk_rope_dim, c->qk_nope_dim,
                            c->v_head_dim);
    if (c->qk_rope_dim % 2)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: qk_rope_head_dim %d must be even", c->arch,
                            c->qk_rope_dim);
    if (c->n_kv_heads != 1 || c->head_dim != c->kv_lora_rank + c->qk_rope_dim)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: latent KV geometry must be 1 x %d (got %d x %d)",
                            c->arch, c->kv_lora_rank + c->qk_rope_dim, c->n_kv_heads, c->head_dim);
    if (c->rope.scaling != LETHE_ROPE_SCALING_NONE)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: RoPE scaling is not supported with latent "
                            "attention (yarn's attention scale is not built)",
                            c->arch);
    if (c->n_experts > LETHE_MOE_MAX_EXPERTS)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: %d experts > %d", c->arch, c->n_experts,
                            LETHE_MOE_MAX_EXPERTS);
    bool dense = false;
    for (int32_t l = 0; l < c->n_layers; l++) dense |= !lethe_layer_is_moe(c, l);
    if (c->n_layers <= 0 || c->dim <= 0 || c->n_heads <= 0 || c->n_vocab <= 0 ||
        (dense && c->ffn_dim <= 0))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: config has a non-positive dimension", c->arch);
    return LETHE_OK;
}

static void mla_workspace_free(lethe_model *m) {
    mla_ws *ws = m->ws;
    if (!ws) return;
    lethe_backend *be = m->be;
    void *bufs[] = {ws->x,     ws->xn,    ws->qa,   ws->q_nope, ws->q_pe,  ws->q_abs,
                    ws->lat,   ws->kpe,   ws->o_lat, ws->att,   ws->gate,  ws->up,
                    ws->rows,  ws->logits, ws->q_exp, ws->o_exp, ws->g,     ws->k_exp,
                    ws->v_exp};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++)
        if (bufs[i]) be->ops->release(be, bufs[i]);
    lethe_moe_bufs_free(m, &ws->moe);
    free(ws->iota);
    free(ws);
    m->ws = NULL;
    m->logits_dev = NULL;
}

static lethe_status mla_workspace_init(lethe_model *m, int32_t n) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    if (!be->ops->matmul_heads || !be->ops->copy_block)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: the %s backend has no latent-attention ops",
                            c->arch, be->ops->name);
    mla_ws *ws = calloc(1, sizeof(*ws));
    if (!ws) return lethe_errorf(LETHE_ERR_NOMEM, "forward workspace: out of memory");
    m->ws = ws;
    const size_t a = be->ops->act_size, N = (size_t)n, H = (size_t)c->n_heads;
    const size_t C = (size_t)c->kv_lora_rank, R = (size_t)c->qk_rope_dim, Dk = C + R;
    const size_t chunk = (size_t)LETHE_MIN(n, LOGIT_CHUNK);
    struct {
        void **p;
        size_t n;
    } plan[] = {
        {&ws->x, N * c->dim},
        {&ws->xn, N * c->dim},
        {&ws->qa, N * (size_t)LETHE_MAX(c->q_lora_rank, 1)},
        {&ws->q_nope, N * H * c->qk_nope_dim},
        {&ws->q_pe, N * H * R},
        {&ws->q_abs, N * H * Dk},
        {&ws->lat, N * C},
        {&ws->kpe, N * R},
        {&ws->o_lat, N * H * C},
        {&ws->att, N * H * c->v_head_dim},
        {&ws->gate, N * (size_t)LETHE_MAX(c->ffn_dim, 1)},
        {&ws->up, N * (size_t)LETHE_MAX(c->ffn_dim, 1)},
        {&ws->rows, chunk * c->dim},
        {&ws->logits, LETHE_MAX(chunk, (size_t)m->n_logits_dev) * c->n_vocab},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(plan); i++) {
        lethe_status st = lethe_model_ws_alloc(be, plan[i].n * a, plan[i].p);
        if (st != LETHE_OK) {
            mla_workspace_free(m);
            return st;
        }
    }
    lethe_status st = lethe_moe_bufs_alloc(m, n, &ws->moe);
    if (st == LETHE_OK) st = lethe_env_uint(LETHE_ENV_MLA_EXPAND_MIN_Q, &ws->expand_min_q);
    if (st != LETHE_OK) {
        mla_workspace_free(m);
        return st;
    }
    m->logits_dev = ws->logits;
    if (c->n_nextn_layers > 0)
        LOG_INFO("%s: %d multi-token-prediction layer(s) in the checkpoint are not used for "
                 "generation (not loaded)",
                 c->arch, c->n_nextn_layers);
    return LETHE_OK;
}

/* zeroes n activations at p (the expanded buffers' padding columns) */
static lethe_status mla_zero(lethe_backend *be, void *p, size_t n) {
    const size_t chunk = (size_t)1 << 20;
    float *z = calloc(LETHE_MIN(n, chunk), sizeof(float));
    if (!z) return lethe_errorf(LETHE_ERR_NOMEM, "latent attention: out of host memory");
    for (size_t i = 0; i < n; i += chunk)
        be->ops->act_from_host(be, (char *)p + i * be->ops->act_size, z, LETHE_MIN(chunk, n - i));
    free(z);
    return LETHE_OK;
}

/* the expanded form's buffers for n rows and M selected slots; false when
 * they cannot be had (the layer then runs absorbed) */
static bool mla_expand_reserve(lethe_model *m, int32_t n_rows, int32_t M) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    mla_ws *ws = m->ws;
    const size_t a = be->ops->act_size, H = (size_t)c->n_heads, De = (size_t)mla_de(c);
    const bool pad = (int32_t)De != c->qk_nope_dim + c->qk_rope_dim || (int32_t)De != c->v_head_dim;
    const size_t nq = (size_t)n_rows * H * De;
    if (!ws->q_exp) {
        const bool ok = be->ops->alloc(be, nq * a, &ws->q_exp) == LETHE_OK &&
                        (!pad || mla_zero(be, ws->q_exp, nq) == LETHE_OK) &&
                        ((int32_t)De == c->v_head_dim ||
                         be->ops->alloc(be, nq * a, &ws->o_exp) == LETHE_OK);
        if (!ok) {
            if (ws->q_exp) be->ops->release(be, ws->q_exp);
            if (ws->o_exp) be->ops->release(be, ws->o_exp);
            ws->q_exp = ws->o_exp = NULL;
            return false;
        }
    }
    if (M <= ws->exp_cap) return true;
    const int32_t cap = LETHE_MIN(MLA_EXPAND_MAX_KEYS, LETHE_MAX(M, ws->exp_cap * 2));
    void **bufs[] = {&ws->g, &ws->k_exp, &ws->v_exp};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++)
        if (*bufs[i]) be->ops->release(be, *bufs[i]), *bufs[i] = NULL;
    ws->exp_cap = 0;
    int32_t *iota = realloc(ws->iota, (size_t)cap * sizeof(int32_t));
    if (!iota) return false;
    ws->iota = iota;
    for (int32_t i = 0; i < cap; i++) iota[i] = i;
    const size_t kv = (size_t)cap * H * De;
    if (be->ops->alloc(be, (size_t)cap * (c->kv_lora_rank + c->qk_rope_dim) * a, &ws->g) ||
        be->ops->alloc(be, kv * a, &ws->k_exp) || be->ops->alloc(be, kv * a, &ws->v_exp))
        return false;
    if (pad && (mla_zero(be, ws->k_exp, kv) || mla_zero(be, ws->v_exp, kv))) return false;
    ws->exp_cap = cap;
    return true;
}

/* whether layer attention `a` (absorbed arguments) runs expanded: enough
 * queries per selected key, and its scratch at hand */
static bool mla_expand_wanted(lethe_model *m, const lethe_attn_args *a) {
    const mla_ws *ws = m->ws;
    if (ws->expand_min_q <= 0 || a->n_tokens == a->n_seqs) return false; /* decode: absorbed */
    int64_t pairs = 0;
    const int64_t M = a->sel_begin[a->n_seqs];
    for (int32_t s = 0; s < a->n_seqs; s++)
        pairs += (int64_t)(a->q_begin[s + 1] - a->q_begin[s]) *
                 (a->sel_begin[s + 1] - a->sel_begin[s]);
    if (M == 0 || M > MLA_EXPAND_MAX_KEYS || pairs < ws->expand_min_q * M) return false;
    return mla_expand_reserve(m, m->n_tokens_max, (int32_t)M);
}

/* the layer's attention in the expanded form (see the top): ws->att [n, H, Vd] */
static void mla_attend_expanded(lethe_model *m, const lethe_layer_weights *L,
                                const lethe_attn_args *ab) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    const lethe_backend_ops *o = be->ops;
    mla_ws *ws = m->ws;
    const int32_t n = ab->n_tokens, H = c->n_heads, C = c->kv_lora_rank, R = c->qk_rope_dim;
    const int32_t Nd = c->qk_nope_dim, Vd = c->v_head_dim, Dk = C + R, De = mla_de(c);
    const int32_t M = ab->sel_begin[ab->n_seqs];
    const size_t a = o->act_size;
    o->gather_rows(be, ws->g, ab->k_cache, ab->sel_slots, M, Dk);
    /* x head stride 0: every head reads the row's latent */
    o->matmul_heads(be, ws->k_exp, H * De, De, ws->g, Dk, 0, L->w_kb, M, H, Nd, C);
    for (int32_t h = 0; h < H; h++)
        o->copy_block(be, (char *)ws->k_exp + (size_t)h * De * a, H * De, Nd, NULL,
                      (const char *)ws->g + (size_t)C * a, Dk, M, R);
    o->matmul_heads(be, ws->v_exp, H * De, De, ws->g, Dk, 0, L->w_vb, M, H, Vd, C);
    o->copy_block(be, ws->q_exp, De, 0, NULL, ws->q_nope, Nd, n * H, Nd);
    o->copy_block(be, ws->q_exp, De, Nd, NULL, ws->q_pe, R, n * H, R);
    lethe_attn_args e = {
        .out = ws->o_exp ? ws->o_exp : ws->att,
        .q = ws->q_exp,
        .k_cache = ws->k_exp,
        .v_cache = ws->v_exp,
        .n_tokens = n,
        .n_seqs = ab->n_seqs,
        .q_begin = ab->q_begin,
        .sel_begin = ab->sel_begin,
        .sel_slots = ws->iota,
        .n_heads = H,
        .n_kv_heads = H,
        .head_dim = De,
        .scale = ab->scale,
        .sel_dense = true,
    };
    o->attention(be, &e);
    if (ws->o_exp) o->copy_block(be, ws->att, Vd, 0, NULL, ws->o_exp, De, n * H, Vd);
}

static void mla_forward(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                        void *const *v_cache, const lethe_fwd_hooks *hooks, float *logits_out) {
    const lethe_model_config *c = &m->cfg;
    const lethe_backend_ops *o = m->be->ops;
    lethe_backend *be = m->be;
    mla_ws *ws = m->ws;
    const int32_t n = b->n_tokens, H = c->n_heads, C = c->kv_lora_rank, R = c->qk_rope_dim;
    const int32_t Nd = c->qk_nope_dim, Vd = c->v_head_dim, Dk = C + R;
    const int32_t q_in = c->q_lora_rank > 0 ? c->q_lora_rank : c->dim;
    const float scale = (float)(1.0 / sqrt((double)(Nd + R)));

    o->embed(be, ws->x, m->w.tok_embd, b->tokens, n, c->dim);
    for (int32_t l = 0; l < c->n_layers; l++) {
        const lethe_layer_weights *L = &m->w.layers[l];
        o->rmsnorm(be, ws->xn, ws->x, L->attn_norm, n, c->dim, c->rms_eps);
        const void *qin = ws->xn;
        if (c->q_lora_rank > 0) {
            o->matmul(be, ws->qa, ws->xn, L->q_a, n, c->q_lora_rank, c->dim);
            o->rmsnorm(be, ws->qa, ws->qa, L->q_a_norm, n, c->q_lora_rank, LATENT_NORM_EPS);
            qin = ws->qa;
        }
        o->matmul(be, ws->q_nope, qin, L->q_b_nope, n, H * Nd, q_in);
        o->matmul(be, ws->q_pe, qin, L->q_b_pe, n, H * R, q_in);
        o->rope(be, ws->q_pe, b->pos, n, H, R, &c->rope);
        o->matmul_heads(be, ws->q_abs, H * Dk, Dk, ws->q_nope, H * Nd, Nd, L->w_kbt, n, H, C, Nd);
        o->copy_block(be, ws->q_abs, Dk, C, NULL, ws->q_pe, R, n * H, R);
        o->matmul(be, ws->lat, ws->xn, L->kv_a_lat, n, C, c->dim);
        o->rmsnorm(be, ws->lat, ws->lat, L->kv_a_norm, n, C, LATENT_NORM_EPS);
        o->matmul(be, ws->kpe, ws->xn, L->kv_a_pe, n, R, c->dim);
        o->rope(be, ws->kpe, b->pos, n, 1, R, &c->rope);

        lethe_layer_plan plan = {0};
        hooks->plan_layer(hooks->ctx, l, b, ws->q_abs, &plan);
        LETHE_ASSERT(plan.store_slots && plan.sel_begin && plan.sel_slots);
        LETHE_ASSERT(!plan.kvq || plan.kvq->format == LETHE_KV_NATIVE); /* refused at start-up */
        o->copy_block(be, k_cache[l], Dk, 0, plan.store_slots, ws->lat, C, n, C);
        o->copy_block(be, k_cache[l], Dk, C, plan.store_slots, ws->kpe, R, n, R);
        lethe_attn_args args = {
            .out = ws->o_lat,
            .q = ws->q_abs,
            .k_cache = k_cache[l],
            .v_cache = NULL,
            .n_tokens = n,
            .n_seqs = b->n_seqs,
            .q_begin = b->seq_begin,
            .sel_begin = plan.sel_begin,
            .sel_slots = plan.sel_slots,
            .n_heads = H,
            .n_kv_heads = 1,
            .head_dim = Dk,
            .scale = scale,
            .v_dim = C,
        };
        if (L->w_kb && mla_expand_wanted(m, &args)) {
            mla_attend_expanded(m, L, &args);
            if (hooks->after_attn) hooks->after_attn(hooks->ctx, l, b, &args);
        } else {
            o->attention(be, &args);
            if (hooks->after_attn) hooks->after_attn(hooks->ctx, l, b, &args);
            o->matmul_heads(be, ws->att, H * Vd, Vd, ws->o_lat, H * C, C, L->w_vb, n, H, Vd, C);
        }
        o->matmul(be, ws->xn, ws->att, L->wo, n, c->dim, H * Vd);
        o->add(be, ws->x, ws->xn, (size_t)n * c->dim);

        o->rmsnorm(be, ws->xn, ws->x, L->ffn_norm, n, c->dim, c->rms_eps);
        if (L->exp_gate) {
            lethe_moe_forward(m, L, &ws->moe, ws->xn, ws->x, n);
            continue;
        }
        o->matmul(be, ws->gate, ws->xn, L->w_gate, n, c->ffn_dim, c->dim);
        o->matmul(be, ws->up, ws->xn, L->w_up, n, c->ffn_dim, c->dim);
        o->swiglu(be, ws->gate, ws->gate, ws->up, (size_t)n * c->ffn_dim);
        o->matmul(be, ws->xn, ws->gate, L->w_down, n, c->dim, c->ffn_dim);
        o->add(be, ws->x, ws->xn, (size_t)n * c->dim);
    }
    (void)v_cache; /* latent KV: one buffer per layer */
    for (int32_t r0 = 0; r0 < b->n_logits; r0 += LOGIT_CHUNK) {
        const int32_t nr = LETHE_MIN(LOGIT_CHUNK, b->n_logits - r0);
        o->gather_rows(be, ws->rows, ws->x, b->logit_rows + r0, nr, c->dim);
        o->rmsnorm(be, ws->rows, ws->rows, m->w.out_norm, nr, c->dim, c->rms_eps);
        if (!logits_out) {
            void *dst = (char *)ws->logits + (size_t)r0 * c->n_vocab * be->ops->act_size;
            o->matmul(be, dst, ws->rows, m->w.lm_head, nr, c->n_vocab, c->dim);
            continue;
        }
        o->matmul(be, ws->logits, ws->rows, m->w.lm_head, nr, c->n_vocab, c->dim);
        o->logits_to_host(be, logits_out + (size_t)r0 * c->n_vocab, ws->logits,
                          (size_t)nr * c->n_vocab);
    }
}

const lethe_arch lethe_arch_mla = {
    .names = {"glm4_moe_lite", "deepseek2", NULL},
    .check = mla_check,
    .workspace_init = mla_workspace_init,
    .workspace_free = mla_workspace_free,
    .forward = mla_forward,
};

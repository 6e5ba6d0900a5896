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
 * reference constructs them without the config's eps). Prefill runs the same
 * absorbed form (the expanded form, decompressing the context's K / V per head,
 * is not built). Multi-token-prediction layers after n_layers are not loaded. */
#include <math.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "model/model.h"
#include "model/moe.h"

#define LOGIT_CHUNK 64
#define LATENT_NORM_EPS 1e-6f

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
} mla_ws;

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
    void *bufs[] = {ws->x,   ws->xn,    ws->qa,  ws->q_nope, ws->q_pe, ws->q_abs, ws->lat,
                    ws->kpe, ws->o_lat, ws->att, ws->gate,   ws->up,   ws->rows,  ws->logits};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++)
        if (bufs[i]) be->ops->release(be, bufs[i]);
    lethe_moe_bufs_free(m, &ws->moe);
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
        o->attention(be, &args);
        if (hooks->after_attn) hooks->after_attn(hooks->ctx, l, b, &args);
        o->matmul_heads(be, ws->att, H * Vd, Vd, ws->o_lat, H * C, C, L->w_vb, n, H, Vd, C);
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

/* arch_hybrid.c - hybrid linear attention: qwen3_5 (Qwen3.5 / Qwen3.6; the
 * multimodal checkpoints' text model, model_type qwen3_5_text inside).
 *
 * Gated DeltaNet layers (lethe_layer_is_linear) interleave with gated
 * full-attention layers (every 4th in the published configs); every layer
 * has the dense SwiGLU MLP. Norms are zero-centred RMSNorms (the loader adds
 * the 1 back: cfg.norm_unit_offset). Per layer, for the n batch rows:
 *   xn = rmsnorm(x)
 * DeltaNet layer (Hk / Hv heads of dk / dv, C = 2 Hk dk + Hv dv channels):
 *   mix = xn Wqkv^T [n, C], z = xn Wz^T [n, Hv dv], a = xn Wa^T, b = xn Wb^T [n, Hv]
 *   xc  = silu(causal depthwise conv of mix, K taps, with the request's conv state)
 *   o   = gated delta rule(q, k, v from xc; a, b; the request's recurrent state)
 *                                                        [n, Hv, dv] (lethe_gdn_args)
 *   o   = rmsnorm(o per head) * w * silu(z)             (gated output norm)
 *   x  += o Wout^T
 * full-attention layer (qwen3 attention with an output gate and partial RoPE):
 *   [q | gate] = xn Wq^T per head (the loader splits q_proj into wq, wq_gate)
 *   q, k = rmsnorm over each head (q_norm / k_norm); RoPE on the first
 *   rot_dim = head_dim * partial_rotary_factor values of each head
 *   plan = hooks->plan_layer(l, q); kv_store; att = attention(plan selection)
 *   x  += (att * sigmoid(gate)) Wo^T
 * then xn = rmsnorm(x); x += swiglu MLP(xn). Final norm + lm_head as llama.
 * A DeltaNet layer keeps no KV: its k_cache[l] / v_cache[l] are the state
 * buffers and b->state_slots says which slot each sequence owns (model.h).
 * plan_layer is asked only for the full-attention layers, numbered among
 * themselves (0 .. n_layers - n_linear_layers - 1): the layer index the
 * hooks, the KV pool and sparse methods see. */
#include <math.h>
#include <string.h>

#include "core/util.h"
#include "model/model.h"

#define LOGIT_CHUNK 64
#define GQA_GROUP_MAX 32
#define HEAD_DIM_MAX 512

typedef struct hybrid_ws {
    void *x, *xn;     /* [N, dim] */
    void *q, *gate;   /* [N, H*hd] */
    void *k, *v;      /* [N, KH*hd] */
    void *att;        /* [N, max(H*hd, Hv*dv)] */
    void *mix, *mixc; /* [N, C] */
    void *z;          /* [N, Hv*dv] */
    void *la, *lb;    /* [N, Hv] */
    void *ffa, *ffb;  /* [N, ffn] */
    void *rows;       /* [LOGIT_CHUNK, dim] */
    void *logits;     /* [max(LOGIT_CHUNK, n_logits_dev), n_vocab] */
} hybrid_ws;

size_t lethe_model_state_rec_bytes(const lethe_model_config *c, int32_t n_slots) {
    return (size_t)n_slots * c->lin_v_heads * c->lin_k_dim * c->lin_v_dim * sizeof(float);
}
size_t lethe_model_state_conv_bytes(const lethe_model_config *c, int32_t n_slots) {
    return (size_t)n_slots * (c->lin_conv - 1) * lethe_lin_conv_dim(c) * sizeof(float);
}

static lethe_status hybrid_check(const lethe_model_config *c) {
    if (c->n_linear_layers <= 0 || c->n_experts > 0 || c->kv_lora_rank > 0)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: needs linear-attention layers and no experts / latent attention "
                            "(got %d linear layers, %d experts)",
                            c->arch, c->n_linear_layers, c->n_experts);
    if (c->n_layers <= 0 || c->dim <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 ||
        c->head_dim <= 0 || c->ffn_dim <= 0 || c->n_vocab <= 0)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: config has a non-positive dimension", c->arch);
    if (c->n_heads % c->n_kv_heads || c->n_heads / c->n_kv_heads > GQA_GROUP_MAX)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: %d query heads over %d KV heads unsupported",
                            c->arch, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 || c->head_dim > HEAD_DIM_MAX)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: head_dim %d unsupported (even, <= %d)",
                            c->arch, c->head_dim, HEAD_DIM_MAX);
    if (c->rope.scaling != LETHE_ROPE_SCALING_NONE)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: RoPE scaling is not supported", c->arch);
    if (c->qkv_bias)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: attention_bias is not supported", c->arch);
    if (c->lin_k_dim > 256 || c->lin_v_dim > 256)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: DeltaNet head dims %d / %d > 256 are not supported", c->arch,
                            c->lin_k_dim, c->lin_v_dim);
    return LETHE_OK;
}

static void hybrid_workspace_free(lethe_model *m) {
    hybrid_ws *ws = m->ws;
    if (!ws) return;
    void *bufs[] = {ws->x,   ws->xn, ws->q,  ws->gate, ws->k,   ws->v,    ws->att,  ws->mix,
                    ws->mixc, ws->z, ws->la, ws->lb,   ws->ffa, ws->ffb,  ws->rows, ws->logits};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++)
        if (bufs[i]) m->be->ops->release(m->be, bufs[i]);
    free(ws);
    m->ws = NULL;
    m->logits_dev = NULL;
}

static lethe_status hybrid_workspace_init(lethe_model *m, int32_t n) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    const lethe_backend_ops *o = be->ops;
    if (!o->gdn_conv || !o->gdn_rule || !o->rmsnorm_gated || !o->sigmoid_mul)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: the %s backend has no linear-attention ops",
                            c->arch, o->name);
    hybrid_ws *ws = calloc(1, sizeof(*ws));
    if (!ws) return lethe_errorf(LETHE_ERR_NOMEM, "forward workspace: out of memory");
    m->ws = ws;
    const size_t a = o->act_size, N = (size_t)n, qd = (size_t)c->n_heads * c->head_dim;
    const size_t kvd = (size_t)c->n_kv_heads * c->head_dim;
    const size_t vd = (size_t)c->lin_v_heads * c->lin_v_dim, C = (size_t)lethe_lin_conv_dim(c);
    const size_t chunk = (size_t)LETHE_MIN(n, LOGIT_CHUNK);
    struct {
        void **p;
        size_t n;
    } plan[] = {
        {&ws->x, N * c->dim},      {&ws->xn, N * c->dim},
        {&ws->q, N * qd},          {&ws->gate, N * qd},
        {&ws->k, N * kvd},         {&ws->v, N * kvd},
        {&ws->att, N * LETHE_MAX(qd, vd)},
        {&ws->mix, N * C},         {&ws->mixc, N * C},
        {&ws->z, N * vd},          {&ws->la, N * c->lin_v_heads},
        {&ws->lb, N * c->lin_v_heads},
        {&ws->ffa, N * c->ffn_dim}, {&ws->ffb, N * c->ffn_dim},
        {&ws->rows, chunk * c->dim},
        {&ws->logits, LETHE_MAX(chunk, (size_t)m->n_logits_dev) * c->n_vocab},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(plan); i++) {
        lethe_status st = lethe_model_ws_alloc(be, plan[i].n * a, plan[i].p);
        if (st != LETHE_OK) {
            hybrid_workspace_free(m);
            return st;
        }
    }
    m->logits_dev = ws->logits;
    return LETHE_OK;
}

/* one DeltaNet layer: x += token mixer(xn) (file comment) */
static void hybrid_linear(lethe_model *m, const lethe_layer_weights *L, const lethe_fwd_batch *b,
                          void *rec_state, void *conv_state) {
    const lethe_model_config *c = &m->cfg;
    const lethe_backend_ops *o = m->be->ops;
    lethe_backend *be = m->be;
    hybrid_ws *ws = m->ws;
    const int32_t n = b->n_tokens, C = lethe_lin_conv_dim(c), Hv = c->lin_v_heads;
    const int32_t vd = Hv * c->lin_v_dim;
    LETHE_ASSERT(b->state_slots && rec_state && conv_state);
    o->matmul(be, ws->mix, ws->xn, L->lin_qkv, n, C, c->dim);
    o->matmul(be, ws->z, ws->xn, L->lin_z, n, vd, c->dim);
    o->matmul(be, ws->la, ws->xn, L->lin_a, n, Hv, c->dim);
    o->matmul(be, ws->lb, ws->xn, L->lin_b, n, Hv, c->dim);
    lethe_gdn_args g = {
        .n_tokens = n, .n_seqs = b->n_seqs, .q_begin = b->seq_begin,
        .state_slots = b->state_slots, .pos = b->pos,
        .x = ws->mix, .xc = ws->mixc, .conv_w = L->lin_conv, .conv_state = conv_state,
        .conv_dim = C, .kernel = c->lin_conv,
        .a = ws->la, .b = ws->lb, .A = L->lin_A, .dt_bias = L->lin_dt_bias,
        .state = rec_state, .out = ws->att,
        .n_k_heads = c->lin_k_heads, .n_v_heads = Hv, .k_dim = c->lin_k_dim, .v_dim = c->lin_v_dim,
    };
    o->gdn_conv(be, &g);
    o->gdn_rule(be, &g);
    o->rmsnorm_gated(be, ws->att, ws->att, ws->z, L->lin_norm, n * Hv, c->lin_v_dim, c->rms_eps);
    o->matmul(be, ws->xn, ws->att, L->lin_out, n, c->dim, vd);
    o->add(be, ws->x, ws->xn, (size_t)n * c->dim);
}

/* one gated full-attention layer: x += attention(xn). kl: its index among
 * the full-attention layers, the layer the hooks, the KV pool, the method
 * and its path see (linear-attention layers have no KV and are not counted) */
static void hybrid_attention(lethe_model *m, int32_t kl, const lethe_layer_weights *L,
                             const lethe_fwd_batch *b, void *k_cache, void *v_cache,
                             const lethe_fwd_hooks *hooks) {
    const lethe_model_config *c = &m->cfg;
    const lethe_backend_ops *o = m->be->ops;
    lethe_backend *be = m->be;
    hybrid_ws *ws = m->ws;
    const int32_t n = b->n_tokens, qd = c->n_heads * c->head_dim;
    const int32_t kvd = c->n_kv_heads * c->head_dim;
    o->matmul(be, ws->q, ws->xn, L->wq, n, qd, c->dim);
    if (c->attn_out_gate) o->matmul(be, ws->gate, ws->xn, L->wq_gate, n, qd, c->dim);
    o->matmul(be, ws->k, ws->xn, L->wk, n, kvd, c->dim);
    o->matmul(be, ws->v, ws->xn, L->wv, n, kvd, c->dim);
    o->rmsnorm(be, ws->q, ws->q, L->q_norm, n * c->n_heads, c->head_dim, c->rms_eps);
    o->rmsnorm(be, ws->k, ws->k, L->k_norm, n * c->n_kv_heads, c->head_dim, c->rms_eps);
    o->rope(be, ws->q, b->pos, n, c->n_heads, c->head_dim, &c->rope);

    lethe_layer_plan plan = {0};
    hooks->plan_layer(hooks->ctx, kl, b, ws->q, &plan);
    LETHE_ASSERT(plan.store_slots && plan.sel_begin && plan.sel_slots);
    const lethe_kv_path *path = plan.path;
    /* the output gate multiplies the heads' outputs: a path must keep them */
    LETHE_ASSERT(!plan.kvq || !path);
    LETHE_ASSERT(!path || !path->out_dim || path->out_dim == qd || !c->attn_out_gate);
    if (!path || !path->k_pre_rope) o->rope(be, ws->k, b->pos, n, c->n_kv_heads, c->head_dim, &c->rope);
    if (path)
        path->store(path->ctx, kl, ws->k, ws->v, plan.store_slots, b->pos, n);
    else if (plan.kvq && plan.kvq->format != LETHE_KV_NATIVE)
        o->kv_store_quant(be, plan.kvq, k_cache, v_cache, ws->k, ws->v, plan.store_slots, n,
                          c->n_kv_heads, c->head_dim);
    else
        o->kv_store(be, k_cache, v_cache, ws->k, ws->v, plan.store_slots, n, kvd);
    lethe_attn_args args = {
        .out = ws->att, .q = ws->q, .k_cache = k_cache, .v_cache = v_cache,
        .n_tokens = n, .n_seqs = b->n_seqs, .q_begin = b->seq_begin,
        .sel_begin = plan.sel_begin, .sel_slots = plan.sel_slots,
        .head_sel_begin = plan.head_sel_begin, .head_sel_slots = plan.head_sel_slots,
        .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
        .scale = (float)(1.0 / sqrt((double)c->head_dim)), .kvq = plan.kvq, .bsp = plan.bsp,
    };
    const void *wo = L->wo;
    int32_t att_dim = qd;
    if (path) {
        path->attend(path->ctx, kl, &args);
        const void *w = path->out_proj ? path->out_proj(path->ctx, kl) : NULL;
        if (w) wo = w;
        if (path->out_dim) att_dim = path->out_dim;
    } else {
        o->attention(be, &args);
    }
    if (hooks->after_attn) hooks->after_attn(hooks->ctx, kl, b, &args);
    if (c->attn_out_gate) o->sigmoid_mul(be, ws->att, ws->gate, (size_t)n * qd);
    o->matmul(be, ws->xn, ws->att, wo, n, c->dim, att_dim);
    o->add(be, ws->x, ws->xn, (size_t)n * c->dim);
}

static void hybrid_forward(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                           void *const *v_cache, const lethe_fwd_hooks *hooks, float *logits_out) {
    const lethe_model_config *c = &m->cfg;
    const lethe_backend_ops *o = m->be->ops;
    lethe_backend *be = m->be;
    hybrid_ws *ws = m->ws;
    const int32_t n = b->n_tokens;

    o->embed(be, ws->x, m->w.tok_embd, b->tokens, n, c->dim);
    for (int32_t l = 0, kl = 0; l < c->n_layers; l++) {
        const lethe_layer_weights *L = &m->w.layers[l];
        o->rmsnorm(be, ws->xn, ws->x, L->attn_norm, n, c->dim, c->rms_eps);
        if (lethe_layer_is_linear(c, l))
            hybrid_linear(m, L, b, k_cache[l], v_cache[l]);
        else
            hybrid_attention(m, kl++, L, b, k_cache[l], v_cache[l], hooks);
        o->rmsnorm(be, ws->xn, ws->x, L->ffn_norm, n, c->dim, c->rms_eps);
        o->matmul(be, ws->ffa, ws->xn, L->w_gate, n, c->ffn_dim, c->dim);
        o->matmul(be, ws->ffb, ws->xn, L->w_up, n, c->ffn_dim, c->dim);
        o->swiglu(be, ws->ffa, ws->ffa, ws->ffb, (size_t)n * c->ffn_dim);
        o->matmul(be, ws->xn, ws->ffa, L->w_down, n, c->dim, c->ffn_dim);
        o->add(be, ws->x, ws->xn, (size_t)n * c->dim);
    }
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

const lethe_arch lethe_arch_hybrid = {
    .names = {"qwen3_5", "qwen3_5_text", NULL},
    .check = hybrid_check,
    .workspace_init = hybrid_workspace_init,
    .workspace_free = hybrid_workspace_free,
    .forward = hybrid_forward,
};

/* arch_llama.c - the Llama family forward: llama, qwen2, qwen3, qwen3_moe.
 *
 * They differ only in switches read from the config:
 *   qwen2: q/k/v projections carry a bias (cfg.qkv_bias);
 *   qwen3: q and k get a per-head RMSNorm over head_dim (cfg.qk_norm,
 *          weights q_norm/k_norm [head_dim]) before RoPE, and head_dim is
 *          explicit (n_heads * head_dim may differ from dim);
 *   llama: Llama 3.1 RoPE frequency scaling comes with cfg.rope;
 *   qwen3_moe (GGUF: qwen3moe): qwen3 attention; the MLP of every layer with
 *          lethe_layer_is_moe is routed experts (model/moe.h) instead.
 * Per layer (HF LlamaDecoderLayer order), for the n batch rows:
 *   xn = rmsnorm(x)                                   [n, dim]
 *   q = xn Wq^T (+bq), k = xn Wk^T (+bk), v = xn Wv^T (+bv)
 *                                                     [n, H*hd], [n, KH*hd] x2
 *   (qwen3) q, k = rmsnorm over each head's hd values
 *   q = RoPE(pos)
 *   plan = hooks->plan_layer(l, q)     caller picks store slots + selection
 *   k = RoPE(pos) unless the plan's payload path stores pre-RoPE keys
 *   kv_store(k, v -> plan.store_slots); att = attention(q, plan selection)
 *     (or the plan's lethe_kv_path: store, attend, its output projection)
 *   hooks->after_attn (optional)
 *   x += att Wo^T
 *   xn = rmsnorm(x); x += (silu(xn Wg^T) * (xn Wu^T)) Wd^T   (or x += MoE(xn))
 * then for the wanted rows: logits = rmsnorm(x[row]) lm_head^T, produced in
 * chunks of LOGIT_CHUNK rows so the logits buffer stays small with big vocabs.
 * With logits_out == NULL the chunks land side by side in the logits buffer
 * (sized for m->n_logits_dev rows) and stay on the device for ops->sample.
 * Only be->ops is used: the same code drives the CPU and CUDA backends. */
#include <math.h>
#include <string.h>

#include "core/util.h"
#include "model/model.h"
#include "model/moe.h"

#define LOGIT_CHUNK 64        /* rows per lm_head call */
#define GQA_GROUP_MAX 32      /* backend attention limits (backend/cpu/attention.c) */
#define HEAD_DIM_MAX 512

typedef struct llama_ws {
    void *x;        /* [N, dim] residual stream */
    void *xn;       /* [N, dim] normed input / projection outputs */
    void *q;        /* [N, H*hd] */
    void *k, *v;    /* [N, KH*hd] */
    void *att;      /* [N, H*hd] attention output */
    void *gate, *up;/* [N, ffn] */
    void *rows;     /* [LOGIT_CHUNK, dim] gathered logit rows */
    void *logits;   /* [max(LOGIT_CHUNK, n_logits_dev), n_vocab] */
    lethe_moe_bufs moe; /* qwen3_moe */
} llama_ws;

static lethe_status llama_check(const lethe_model_config *c) {
    const bool moe = !strcmp(c->arch, "qwen3_moe") || !strcmp(c->arch, "qwen3moe");
    if (c->n_experts > 0 && !moe)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: mixture-of-experts layers (%d experts) are not supported by the "
                            "llama family", c->arch, c->n_experts);
    if (moe && (c->n_experts <= 0 || c->n_experts > LETHE_MOE_MAX_EXPERTS || c->n_shared_experts ||
                c->moe_scoring != LETHE_MOE_SOFTMAX))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: needs 1..%d routed experts with softmax routing and no shared "
                            "experts (got %d experts, %d shared)",
                            c->arch, LETHE_MOE_MAX_EXPERTS, c->n_experts, c->n_shared_experts);
    bool dense_layers = !moe;
    for (int32_t l = 0; l < c->n_layers; l++) dense_layers |= !lethe_layer_is_moe(c, l);
    if (c->n_layers <= 0 || c->dim <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 ||
        c->head_dim <= 0 || (dense_layers && c->ffn_dim <= 0) || c->n_vocab <= 0)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: config has a non-positive dimension", c->arch);
    if (c->n_heads % c->n_kv_heads)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: n_heads %d is not a multiple of n_kv_heads %d",
                            c->arch, c->n_heads, c->n_kv_heads);
    if (c->n_heads / c->n_kv_heads > GQA_GROUP_MAX)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: GQA group %d > %d is not supported",
                            c->arch, c->n_heads / c->n_kv_heads, GQA_GROUP_MAX);
    if (c->head_dim % 2 || c->head_dim > HEAD_DIM_MAX)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: head_dim %d unsupported (must be even and <= %d)", c->arch,
                            c->head_dim, HEAD_DIM_MAX);
    if (c->rope.theta <= 0)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: rope theta %g must be > 0", c->arch,
                            (double)c->rope.theta);
    if (c->rope.scaling == LETHE_ROPE_SCALING_LINEAR && !(c->rope.factor > 0))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: linear rope scaling needs factor > 0", c->arch);
    if (c->rope.scaling == LETHE_ROPE_SCALING_LLAMA3 &&
        !(c->rope.factor > 0 && c->rope.low_freq_factor > 0 &&
          c->rope.high_freq_factor > c->rope.low_freq_factor && c->rope.original_max_pos > 0))
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: llama3 rope scaling needs factor > 0, high_freq_factor > "
                            "low_freq_factor > 0 and original_max_position_embeddings > 0",
                            c->arch);
    return LETHE_OK;
}

static void llama_workspace_free(lethe_model *m) {
    llama_ws *ws = m->ws;
    if (!ws) return;
    lethe_backend *be = m->be;
    void *bufs[] = {ws->x, ws->xn, ws->q, ws->k, ws->v, ws->att, ws->gate, ws->up, ws->rows, ws->logits};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++)
        if (bufs[i]) be->ops->release(be, bufs[i]);
    lethe_moe_bufs_free(m, &ws->moe);
    free(ws);
    m->ws = NULL;
    m->logits_dev = NULL;
}

static lethe_status llama_workspace_init(lethe_model *m, int32_t n) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    llama_ws *ws = calloc(1, sizeof(*ws));
    if (!ws) return lethe_errorf(LETHE_ERR_NOMEM, "forward workspace: out of memory");
    m->ws = ws;
    const size_t a = be->ops->act_size, N = (size_t)n;
    const size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    const size_t chunk = (size_t)LETHE_MIN(n, LOGIT_CHUNK);
    struct { void **p; size_t n; } plan[] = {
        {&ws->x, N * c->dim},      {&ws->xn, N * c->dim},      {&ws->q, N * q_dim},
        {&ws->k, N * kv_dim},      {&ws->v, N * kv_dim},       {&ws->att, N * q_dim},
        {&ws->gate, N * c->ffn_dim}, {&ws->up, N * c->ffn_dim}, {&ws->rows, chunk * c->dim},
        {&ws->logits, LETHE_MAX(chunk, (size_t)m->n_logits_dev) * c->n_vocab},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(plan); i++) {
        lethe_status st = lethe_model_ws_alloc(be, plan[i].n * a, plan[i].p);
        if (st != LETHE_OK) {
            llama_workspace_free(m);
            return st; /* the backend's message names the size */
        }
    }
    lethe_status st = lethe_moe_bufs_alloc(m, n, &ws->moe);
    if (st != LETHE_OK) {
        llama_workspace_free(m);
        return st;
    }
    m->logits_dev = ws->logits;
    return LETHE_OK;
}

/* q, k, v for the batch rows, normed and rotated; returns through ws. */
static void llama_qkv(lethe_model *m, const lethe_layer_weights *L, const lethe_fwd_batch *b) {
    const lethe_model_config *c = &m->cfg;
    const lethe_backend_ops *o = m->be->ops;
    lethe_backend *be = m->be;
    llama_ws *ws = m->ws;
    const int32_t n = b->n_tokens, q_dim = c->n_heads * c->head_dim;
    const int32_t kv_dim = c->n_kv_heads * c->head_dim;
    o->rmsnorm(be, ws->xn, ws->x, L->attn_norm, n, c->dim, c->rms_eps);
    o->matmul(be, ws->q, ws->xn, L->wq, n, q_dim, c->dim);
    o->matmul(be, ws->k, ws->xn, L->wk, n, kv_dim, c->dim);
    o->matmul(be, ws->v, ws->xn, L->wv, n, kv_dim, c->dim);
    if (c->qkv_bias) {
        o->add_bias(be, ws->q, L->bq, n, q_dim);
        o->add_bias(be, ws->k, L->bk, n, kv_dim);
        o->add_bias(be, ws->v, L->bv, n, kv_dim);
    }
    if (c->qk_norm) {
        o->rmsnorm(be, ws->q, ws->q, L->q_norm, n * c->n_heads, c->head_dim, c->rms_eps);
        o->rmsnorm(be, ws->k, ws->k, L->k_norm, n * c->n_kv_heads, c->head_dim, c->rms_eps);
    }
    o->rope(be, ws->q, b->pos, n, c->n_heads, c->head_dim, &c->rope);
    /* k is rotated after plan_layer: a payload path may store it pre-RoPE */
}

static void llama_forward(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                          void *const *v_cache, const lethe_fwd_hooks *hooks, float *logits_out) {
    const lethe_model_config *c = &m->cfg;
    const lethe_backend_ops *o = m->be->ops;
    lethe_backend *be = m->be;
    llama_ws *ws = m->ws;
    const int32_t n = b->n_tokens, q_dim = c->n_heads * c->head_dim;
    const int32_t kv_dim = c->n_kv_heads * c->head_dim;
    const float scale = (float)(1.0 / sqrt((double)c->head_dim));

    o->embed(be, ws->x, m->w.tok_embd, b->tokens, n, c->dim);
    for (int32_t l = 0; l < c->n_layers; l++) {
        const lethe_layer_weights *L = &m->w.layers[l];
        llama_qkv(m, L, b);

        lethe_layer_plan plan = {0};
        hooks->plan_layer(hooks->ctx, l, b, ws->q, &plan);
        LETHE_ASSERT(plan.store_slots && plan.sel_begin && plan.sel_slots);
        const lethe_kv_path *path = plan.path;
        LETHE_ASSERT(!path || !plan.kvq);
        if (!path || !path->k_pre_rope) o->rope(be, ws->k, b->pos, n, c->n_kv_heads, c->head_dim, &c->rope);
        if (path)
            path->store(path->ctx, l, ws->k, ws->v, plan.store_slots, b->pos, n);
        else if (plan.kvq && plan.kvq->format != LETHE_KV_NATIVE)
            o->kv_store_quant(be, plan.kvq, k_cache[l], v_cache[l], ws->k, ws->v, plan.store_slots, n,
                              c->n_kv_heads, c->head_dim);
        else
            o->kv_store(be, k_cache[l], v_cache[l], ws->k, ws->v, plan.store_slots, n, kv_dim);
        lethe_attn_args args = {
            .out = ws->att, .q = ws->q, .k_cache = k_cache[l], .v_cache = v_cache[l],
            .n_tokens = n, .n_seqs = b->n_seqs, .q_begin = b->seq_begin,
            .sel_begin = plan.sel_begin, .sel_slots = plan.sel_slots,
            .head_sel_begin = plan.head_sel_begin, .head_sel_slots = plan.head_sel_slots, .n_heads = c->n_heads,
            .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .scale = scale,
            .kvq = plan.kvq, .bsp = plan.bsp,
        };
        const void *wo = L->wo;
        int32_t att_dim = q_dim;
        if (path) {
            path->attend(path->ctx, l, &args);
            const void *w = path->out_proj ? path->out_proj(path->ctx, l) : NULL;
            if (w) wo = w;
            if (path->out_dim) att_dim = path->out_dim;
            LETHE_ASSERT(att_dim <= q_dim); /* the att workspace holds n x q_dim */
        } else {
            o->attention(be, &args);
        }
        if (hooks->after_attn) hooks->after_attn(hooks->ctx, l, b, &args);

        o->matmul(be, ws->xn, ws->att, wo, n, c->dim, att_dim);
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
    /* final norm + lm_head only for the rows whose logits are wanted */
    for (int32_t r0 = 0; r0 < b->n_logits; r0 += LOGIT_CHUNK) {
        const int32_t nr = LETHE_MIN(LOGIT_CHUNK, b->n_logits - r0);
        o->gather_rows(be, ws->rows, ws->x, b->logit_rows + r0, nr, c->dim);
        o->rmsnorm(be, ws->rows, ws->rows, m->w.out_norm, nr, c->dim, c->rms_eps);
        if (!logits_out) { /* device-resident: row r0 of the logits buffer */
            void *dst = (char *)ws->logits + (size_t)r0 * c->n_vocab * be->ops->act_size;
            o->matmul(be, dst, ws->rows, m->w.lm_head, nr, c->n_vocab, c->dim);
            continue;
        }
        o->matmul(be, ws->logits, ws->rows, m->w.lm_head, nr, c->n_vocab, c->dim);
        o->logits_to_host(be, logits_out + (size_t)r0 * c->n_vocab, ws->logits,
                          (size_t)nr * c->n_vocab);
    }
}

const lethe_arch lethe_arch_llama = {
    .names = {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3moe", NULL},
    .check = llama_check,
    .workspace_init = llama_workspace_init,
    .workspace_free = llama_workspace_free,
    .forward = llama_forward,
};

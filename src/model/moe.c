/* moe.c - the mixture-of-experts feed-forward block (see moe.h). */
#include "model/moe.h"

#include <string.h>

#include "core/util.h"

lethe_status lethe_moe_bufs_alloc(lethe_model *m, int32_t n, lethe_moe_bufs *b) {
    memset(b, 0, sizeof(*b));
    const lethe_model_config *c = &m->cfg;
    if (c->n_experts <= 0) return LETHE_OK;
    lethe_backend *be = m->be;
    const size_t a = be->ops->act_size, N = (size_t)n;
    const size_t sh = (size_t)c->n_shared_experts * c->moe_ffn_dim;
    b->ws_bytes = lethe_moe_ws_bytes(be, n, c->n_experts_used, c->dim, c->moe_ffn_dim,
                                     c->n_experts);
    struct {
        void **p;
        size_t bytes;
    } plan[] = {
        {&b->logits, N * c->n_experts * a},
        {&b->out, N * c->dim * a},
        {&b->gate, N * sh * a},
        {&b->up, N * sh * a},
        {&b->ws, b->ws_bytes},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(plan); i++) {
        if (!plan[i].bytes) continue;
        lethe_status st = lethe_model_ws_alloc(be, plan[i].bytes, plan[i].p);
        if (st != LETHE_OK) {
            lethe_moe_bufs_free(m, b);
            return st;
        }
    }
    return LETHE_OK;
}

void lethe_moe_bufs_free(lethe_model *m, lethe_moe_bufs *b) {
    void *bufs[] = {b->logits, b->out, b->gate, b->up, b->ws};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++)
        if (bufs[i]) m->be->ops->release(m->be, bufs[i]);
    memset(b, 0, sizeof(*b));
}

void lethe_moe_forward(lethe_model *m, const lethe_layer_weights *L, const lethe_moe_bufs *b,
                       const void *xn, void *x, int32_t n) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    const lethe_backend_ops *o = be->ops;
    LETHE_ASSERT(b->ws && L->router && L->exp_gate && L->exp_up && L->exp_down);
    o->matmul(be, b->logits, xn, L->router, n, c->n_experts, c->dim);
    lethe_moe_args a = {
        .out = x, /* the residual stream: x += the routed experts' sum */
        .x = xn,
        .logits = b->logits,
        .bias = L->router_bias,
        .w_gate = L->exp_gate,
        .w_up = L->exp_up,
        .w_down = L->exp_down,
        .n = n,
        .dim = c->dim,
        .ffn = c->moe_ffn_dim,
        .n_experts = c->n_experts,
        .k = c->n_experts_used,
        .scoring = c->moe_scoring,
        .norm_topk = c->moe_norm_topk,
        .scale = c->moe_scale,
        .n_group = c->moe_n_group,
        .topk_group = c->moe_topk_group,
        .accumulate = true,
        .ws = b->ws,
        .ws_bytes = b->ws_bytes,
    };
    o->moe(be, &a);
    if (c->n_shared_experts > 0) {
        const int32_t sf = c->n_shared_experts * c->moe_ffn_dim;
        o->matmul(be, b->gate, xn, L->sh_gate, n, sf, c->dim);
        o->matmul(be, b->up, xn, L->sh_up, n, sf, c->dim);
        o->swiglu(be, b->gate, b->gate, b->up, (size_t)n * sf);
        o->matmul(be, b->out, b->gate, L->sh_down, n, c->dim, sf);
        o->add(be, x, b->out, (size_t)n * c->dim);
    }
}

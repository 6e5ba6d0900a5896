/* runner.c - the real runner: lethe_model_forward over the KV pool's buffers.
 *
 * workspace() sizes the model's forward workspace for the step token budget
 * (before the KV pool, so the pool gets what is left); bind() collects the
 * pool's per-layer K/V buffers (backend memory, one [n_slots, n_kv_heads,
 * head_dim] pair per layer); forward() hands the engine's hooks straight to
 * the model. The model is owned by the runner; the backend
 * is owned by the engine (it must outlive the KV pool). */
#include <stdlib.h>
#include <string.h>

#include "backend/sample.h"
#include "core/util.h"
#include "engine/runner.h"

typedef struct model_runner {
    lethe_model model;
    void **k, **v;  /* [n_layers] */
} model_runner;

static lethe_status mr_bind(void *ctx, lethe_kv_pool *pool, int32_t n_tokens_max) {
    model_runner *mr = ctx;
    const lethe_model_config *c = &mr->model.cfg;
    const int32_t L = c->n_layers;
    LETHE_ASSERT(lethe_kv_n_layers(pool) == L - c->n_linear_layers &&
                 lethe_kv_n_state_layers(pool) == c->n_linear_layers);
    mr->k = lethe_xcalloc((size_t)L, sizeof(void *));
    mr->v = lethe_xcalloc((size_t)L, sizeof(void *));
    /* the model indexes k / v by its own layer: a linear-attention layer's
     * are its states (recurrent, conv), the others the pool's KV layers in order */
    for (int32_t l = 0, kl = 0, sl = 0; l < L; l++) {
        if (lethe_layer_is_linear(c, l)) {
            mr->k[l] = lethe_kv_state_rec(pool, sl);
            mr->v[l] = lethe_kv_state_conv(pool, sl++);
            LETHE_ASSERT(mr->k[l] && mr->v[l]);
            continue;
        }
        mr->k[l] = lethe_kv_k(pool, kl);
        mr->v[l] = lethe_kv_v(pool, kl++);
        /* a latent-KV model (lethe_kv_k_only) has no V buffers, nor has a
         * method payload layer of one plane (DeltaKV's latents: its path reads it) */
        LETHE_ASSERT(mr->k[l] && (mr->v[l] || lethe_kv_k_only(&mr->model.cfg) || lethe_kv_has_layout(pool)));
    }
    (void)n_tokens_max; /* the workspace was sized by mr_workspace */
    return LETHE_OK;
}

static lethe_status mr_workspace(void *ctx, int32_t n_tokens_max, int32_t n_logits_max) {
    model_runner *mr = ctx;
    return lethe_model_workspace_init_dev(&mr->model, n_tokens_max,
                                          mr->model.be->ops->sample ? n_logits_max : 0);
}

static void mr_sample(void *ctx, lethe_sample_args *a) {
    model_runner *mr = ctx;
    lethe_backend *be = mr->model.be;
    LETHE_ASSERT(a->n <= mr->model.n_logits_dev && a->n_vocab == mr->model.cfg.n_vocab);
    a->logits = mr->model.logits_dev;
    be->ops->sample(be, a);
}

static void mr_forward(void *ctx, const lethe_fwd_batch *b, const lethe_fwd_hooks *hooks, float *logits) {
    model_runner *mr = ctx;
    lethe_model_forward(&mr->model, b, mr->k, mr->v, hooks, logits);
}

static void mr_forward_uniform(void *ctx, const lethe_fwd_batch *b, const lethe_layer_plan *plan,
                               bool use_graph, lethe_graph_state *gs, float *logits) {
    model_runner *mr = ctx;
    lethe_model_forward_uniform(&mr->model, b, mr->k, mr->v, plan, use_graph, gs, logits);
}

static void mr_forward_graph(void *ctx, const lethe_fwd_batch *b, const lethe_fwd_hooks *hooks,
                             const int32_t *const *arrays, const size_t *counts, int n_arrays,
                             bool use_graph, lethe_graph_state *gs, float *logits) {
    model_runner *mr = ctx;
    lethe_model_forward_graph(&mr->model, b, mr->k, mr->v, hooks, arrays, counts, n_arrays,
                              use_graph, gs, logits);
}

static void mr_destroy(void *ctx) {
    model_runner *mr = ctx;
    if (!mr) return;
    lethe_model_free(&mr->model);
    free(mr->k);
    free(mr->v);
    free(mr);
}

lethe_status lethe_runner_model(lethe_model *model, lethe_backend *be, lethe_runner *out) {
    memset(out, 0, sizeof(*out));
    model_runner *mr = lethe_xcalloc(1, sizeof(*mr));
    mr->model = *model;
    memset(model, 0, sizeof(*model));
    out->ctx = mr;
    out->kind = "model";
    out->cfg = mr->model.cfg;
    out->be = be;
    out->workspace = mr_workspace;
    out->bind = mr_bind;
    out->forward = mr_forward;
    out->forward_uniform = mr_forward_uniform;
    out->forward_graph = mr_forward_graph;
    out->sample = be->ops->sample ? mr_sample : NULL;
    out->destroy = mr_destroy;
    return LETHE_OK;
}

lethe_status lethe_runner_step_status(const lethe_runner *r, const lethe_fwd_batch *b) {
    if (r->fault_token <= 0) return LETHE_OK;
    for (int32_t i = 0; i < b->n_tokens; i++)
        if (b->tokens[i] == r->fault_token)
            return lethe_errorf(LETHE_ERR_BACKEND,
                                "backend error in the model step (injected: LETHE_FAULT_TOKEN=%d)",
                                r->fault_token);
    return LETHE_OK;
}

lethe_model *lethe_runner_model_of(const lethe_runner *r) {
    if (!r || !r->ctx || !r->kind || strcmp(r->kind, "model") != 0) return NULL;
    return &((model_runner *)r->ctx)->model;
}

/* forward.c - the model-level entry points of the forward pass.
 *
 * Checks the batch contract once (rows grouped by sequence, logit rows in
 * range, capacity), then dispatches to the family's forward (arch_*.c),
 * which only uses be->ops so the same code runs on every backend. The
 * workspace is allocated once per model for n_tokens_max rows. */
#include <string.h>

#include "core/util.h"
#include "model/model.h"

lethe_status lethe_model_ws_alloc(lethe_backend *be, size_t n_bytes, void **out) {
    lethe_status st = be->ops->alloc(be, n_bytes, out);
    if (st == LETHE_OK && (be->ops->caps & LETHE_BE_HOST_MEMORY)) memset(*out, 0, n_bytes);
    return st;
}

lethe_status lethe_model_workspace_init(lethe_model *m, int32_t n_tokens_max) {
    return lethe_model_workspace_init_dev(m, n_tokens_max, 0);
}

lethe_status lethe_model_workspace_init_dev(lethe_model *m, int32_t n_tokens_max,
                                            int32_t n_logits_dev) {
    if (n_tokens_max <= 0 || n_logits_dev < 0)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "forward workspace: n_tokens_max %d must be > 0, n_logits_dev %d >= 0",
                            n_tokens_max, n_logits_dev);
    LETHE_ASSERT(m->arch && m->be);
    lethe_model_workspace_free(m);
    m->n_logits_dev = LETHE_MIN(n_logits_dev, n_tokens_max); /* read by workspace_init */
    lethe_status st = m->arch->workspace_init(m, n_tokens_max);
    if (st != LETHE_OK) m->n_logits_dev = 0;
    if (st != LETHE_OK) return st;
    m->n_tokens_max = n_tokens_max;
    return LETHE_OK;
}

void lethe_model_workspace_free(lethe_model *m) {
    if (m && m->ws && m->arch) m->arch->workspace_free(m);
    if (m) {
        m->ws = NULL;
        m->n_tokens_max = 0;
        m->n_logits_dev = 0;
        m->logits_dev = NULL;
    }
}

void lethe_model_forward(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                         void *const *v_cache, const lethe_fwd_hooks *hooks, float *logits_out) {
    /* the batch contract (model.h): violations are caller bugs */
    LETHE_ASSERT(m->ws && hooks && hooks->plan_layer);
    LETHE_ASSERT(b->n_tokens > 0 && b->n_tokens <= m->n_tokens_max);
    LETHE_ASSERT(b->n_seqs > 0 && b->seq_begin[0] == 0 && b->seq_begin[b->n_seqs] == b->n_tokens);
    for (int32_t s = 0; s < b->n_seqs; s++) LETHE_ASSERT(b->seq_begin[s] <= b->seq_begin[s + 1]);
    LETHE_ASSERT(b->n_logits >= 0 && (logits_out || b->n_logits <= m->n_logits_dev));
    for (int32_t i = 0; i < b->n_logits; i++)
        LETHE_ASSERT(b->logit_rows[i] >= 0 && b->logit_rows[i] < b->n_tokens);
    for (int32_t i = 0; i < b->n_tokens; i++)
        LETHE_ASSERT(b->tokens[i] >= 0 && b->tokens[i] < m->cfg.n_vocab && b->pos[i] >= 0);
    m->arch->forward(m, b, k_cache, v_cache, hooks, logits_out);
}

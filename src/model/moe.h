/* moe.h - the feed-forward block of a mixture-of-experts layer, shared by the
 * families that have one (arch_llama.c: qwen3_moe; arch_mla.c: glm4_moe_lite).
 *
 *   logits = xn Router^T                          [n, n_experts]
 *   x     += ops->moe(xn, logits)                routed experts, weighted (backend.h;
 *                                                 the op adds into x: accumulate)
 *   x     += shared(xn)  (SwiGLU of n_shared * moe_ffn_dim, when the model has them)
 * The buffers live in the family's workspace, sized once for its n_tokens_max. */
#ifndef LETHE_MODEL_MOE_H
#define LETHE_MODEL_MOE_H

#include "model/model.h"

typedef struct lethe_moe_bufs {
    void *logits;    /* [N, n_experts] */
    void *out;       /* [N, dim] */
    void *gate, *up; /* [N, n_shared * moe_ffn_dim] (NULL without shared experts) */
    void *ws;        /* ops->moe scratch */
    size_t ws_bytes;
} lethe_moe_bufs;

/* Allocates the buffers for up to n tokens (all NULL for a dense model). */
lethe_status lethe_moe_bufs_alloc(lethe_model *m, int32_t n, lethe_moe_bufs *b);
void lethe_moe_bufs_free(lethe_model *m, lethe_moe_bufs *b); /* NULL-safe members */

/* x [n, dim] += MoE(xn [n, dim]) for layer L (lethe_layer_is_moe). */
void lethe_moe_forward(lethe_model *m, const lethe_layer_weights *L, const lethe_moe_bufs *b,
                       const void *xn, void *x, int32_t n);

#endif /* LETHE_MODEL_MOE_H */

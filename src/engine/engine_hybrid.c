/* engine_hybrid.c - what the engine does differently for hybrid models
 * (linear-attention layers with per-request states, model/config.h).
 *
 * The states live in the KV pool (kv_pool.h, "per-request states"): one
 * state slot per row, taken at admission and released with the row, so
 * finish, abort and preemption by recompute (which restarts at position 0,
 * and a sequence at position 0 starts from zero states) need nothing extra.
 * One more slot stays spare for the auxiliary prefill's copy of a request's
 * states (engine_forward.c). The state memory is taken off the KV budget
 * before token slots (engine.c size_pool).
 *
 * Sparse methods act on the full-attention layers only, and see nothing
 * else: the pool's layers, the hooks' layer index and the method's
 * env.n_layers count the full-attention layers alone, in model order
 * (arch_hybrid.c numbers them), so rows per layer or per KV head, per-layer
 * budgets (PyramidKV's schedule runs over the attention layers) and payloads
 * of a method's own apply unchanged. Refused, with the reason
 * (lethe_sparse_hybrid_refusal, also printed by `lethe methods`), before the
 * method is built: a method with its own output projection (the gated
 * attention's output gate multiplies the per-head outputs it never forms).
 *
 * Prefill chunks that do not reach the prompt's end stop at multiples of
 * LETHE_GDN_CHUNK positions (the scheduler's chunk_align), so the
 * linear-attention layers run the same segments however the prompt is split
 * and a request's logits do not depend on its batch, as with every model.
 *
 * Prefix caching is off for hybrid models: a shared prefix would need the
 * states at its end, and the radix / chain caches keep token KV only; a
 * request of a hybrid model always prefills its whole prompt. */
#include <string.h>

#include "core/log.h"
#include "engine/engine_internal.h"

lethe_status eng_check_hybrid(lethe_engine *e) {
    const lethe_model_config *c = &e->runner.cfg;
    if (e->p.max_num_batched_tokens < LETHE_GDN_CHUNK)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--max-num-batched-tokens %d: hybrid model %s needs at least %d (prefill "
                            "chunks of its linear-attention layers end at multiples of %d positions)",
                            e->p.max_num_batched_tokens, c->arch, LETHE_GDN_CHUNK, LETHE_GDN_CHUNK);
    const lethe_sparse_ops *ops = lethe_sparse_find(e->sparse_method); /* NULL: create names the error */
    const char *why = ops ? lethe_sparse_hybrid_refusal(ops) : NULL;
    if (why)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "model %s (%s: %d of %d layers are linear attention with per-request "
                            "states) cannot use method %s: %s",
                            e->model_path ? e->model_path : c->arch, c->arch, c->n_linear_layers,
                            c->n_layers, ops->name, why);
    const char *mode = e->p.prefix_cache_mode && e->p.prefix_cache_mode[0] ? e->p.prefix_cache_mode : "auto";
    if (e->p.enable_prefix_caching && strcmp(mode, "auto"))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "--prefix-cache-mode %s: prefix caching is not available for hybrid model %s "
                            "(its linear-attention layers keep states, not per-token KV)",
                            mode, c->arch);
    if (e->p.enable_prefix_caching)
        LOG_INFO("engine: prefix caching off for hybrid model %s (linear-attention states)", c->arch);
    e->p.enable_prefix_caching = false;
    return LETHE_OK;
}

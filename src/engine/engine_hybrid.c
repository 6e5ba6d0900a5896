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
 * of a method's own apply unchanged. Refused, with the reason the method
 * declares (ops->hybrid_refusal, also printed by `lethe methods`), before it
 * is built, for every method the name holds (both of a PREFILL+DECODE pair):
 * a method with its own output projection (the gated attention's output gate
 * multiplies the per-head outputs it never forms).
 *
 * Prefill chunks that do not reach the prompt's end stop at multiples of
 * LETHE_GDN_CHUNK positions (the scheduler's chunk_align), so the
 * linear-attention layers run the same segments however the prompt is split
 * and a request's logits do not depend on its batch, as with every model.
 *
 * Prefix caching: a shared prefix needs the states at its end, which a
 * longer computation cannot give back. The radix cache keeps state
 * snapshots at chosen points of a prompt (radix_cache.c: every
 * state_snapshot_interval tokens and the prompt's last multiple of
 * LETHE_GDN_CHUNK) in state slots the engine adds to the pool for them
 * (state_snapshot_bytes, engine.c size_pool), and a hit resumes from the
 * deepest snapshot of the matched blocks. The Chain Cache keeps each idle
 * chain's row, and a row owns its state slot, so a turn continues from the
 * states after the chain's boundary; the same budget gives the state slots
 * of idle chains (chain_cache.c, LRU beyond it). The host tier
 * (--host-cache-bytes) holds states too: a demoted radix block's blob
 * carries its snapshot, a hit on demoted blocks restores both (radix.h);
 * an idle chain reclaimed beyond the budget (or for KV room) is demoted
 * with its row's states, and its next turn restores them (chain_cache.c).
 * Refused: branching chains (a shared prefix's blocks come without the
 * states at their end). */
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
    /* the refusal: every method the name holds (both of a pair); unknown names: create names
     * the error */
    const lethe_sparse_ops *who = NULL;
    const char *why = lethe_sparse_hybrid_refusal_of(e->sparse_method, &who);
    if (why) {
        const bool pair = strchr(e->sparse_method, '+') != NULL;
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "model %s (%s: %d of %d layers are linear attention with per-request "
                            "states) cannot use method %s: %s%s%s",
                            e->model_path ? e->model_path : c->arch, c->arch, c->n_linear_layers,
                            c->n_layers, pair ? e->sparse_method : who->name, pair ? who->name : "",
                            pair ? ": " : "", why);
    }
    /* default: the step budget, so a long prompt prefilled alone is cut nowhere it
     * would not be anyway (its chunks end at multiples of the budget) */
    const int32_t every = e->p.state_snapshot_interval
                              ? e->p.state_snapshot_interval
                              : e->p.max_num_batched_tokens / LETHE_GDN_CHUNK * LETHE_GDN_CHUNK;
    if (every < 0 || every % LETHE_GDN_CHUNK)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--state-snapshot-interval %d: must be a positive multiple of %d (the "
                            "linear-attention layers' prefill segments)",
                            e->p.state_snapshot_interval, LETHE_GDN_CHUNK);
    if (!e->p.enable_prefix_caching) return LETHE_OK;
    /* the radix cache snapshots every `every` tokens; the Chain Cache keeps rows instead */
    e->cache_states = true;
    e->snap_every = every;
    return LETHE_OK;
}

/* engine_introspect.h - what in-tree tools (tools/bench_sparse.c) read from an
 * engine beyond the public API (include/lethe.h), so that no tool includes
 * engine_internal.h. Not a public interface: these expose the KV pool's and
 * the model's layout, which change with the implementation.
 *
 * Call from the thread that steps the engine (synchronous mode, or an event
 * callback): they read engine-thread state. */
#ifndef LETHE_ENGINE_INTROSPECT_H
#define LETHE_ENGINE_INTROSPECT_H

#include <stddef.h>
#include <stdint.h>

#include "lethe.h"
#include "model/model.h"

/* The engine's sizes as created (limits after the engine's own adjustments,
 * e.g. KIVI lowering max_num_seqs). */
typedef struct lethe_engine_layout {
    int32_t n_vocab, n_layers;
    int32_t kv_slots_per_layer; /* lethe_kv_n_slots: per slot space, the scratch slot included */
    size_t kv_token_bytes;      /* KV bytes of one token over all layers, in the method's format */
    size_t kv_slot_overhead_bytes; /* the method's per-slot buffers besides the payload (slot_overhead_bytes) */
    size_t kv_reserve_bytes;    /* the method's fixed reserve for running requests (kv_reserve_bytes) */
    int32_t max_num_seqs, max_num_batched_tokens;
} lethe_engine_layout;

void lethe_engine_get_layout(const lethe_engine *e, lethe_engine_layout *out);

/* Slots request `id` holds at `layer` now (after an evicting method's
 * compaction), or -1 when it is not live or holds no KV row. */
int32_t lethe_engine_request_resident(lethe_engine *e, uint64_t id, int32_t layer);

/* The method's bound on the slots one request keeps at `layer` while
 * prefilling n_prompt tokens of n_total in chunks of `chunk` tokens
 * (lethe_sparse_max_resident). */
int32_t lethe_engine_max_resident(const lethe_engine *e, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk);

/* The engine's model and its per-layer KV buffers (k[l], v[l]: the pool's
 * storage of layer l, lethe_kv_k / lethe_kv_v), for a synthetic forward
 * over the engine's own memory; NULL when the engine has no real model (the
 * fake runner). */
lethe_model *lethe_engine_model(const lethe_engine *e);
/* state slots of a hybrid model's pool (0 for others) */
int32_t lethe_engine_n_state_slots(const lethe_engine *e);
/* [n_layers] each, per model layer: K / V of an attention layer, the
 * recurrent / conv state buffers of a linear-attention layer (state slot s =
 * row s of them) */
void lethe_engine_kv_buffers(const lethe_engine *e, void **k, void **v);

#endif /* LETHE_ENGINE_INTROSPECT_H */

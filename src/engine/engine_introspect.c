/* engine_introspect.c - the in-tree tools' view of an engine (engine_introspect.h). */
#include "engine/engine_introspect.h"

#include "engine/engine_internal.h"

void lethe_engine_get_layout(const lethe_engine *e, lethe_engine_layout *out) {
    const lethe_model_config *c = &e->runner.cfg;
    const size_t kv_size = e->runner.be ? e->runner.be->ops->kv_size : sizeof(float);
    *out = (lethe_engine_layout){
        .n_vocab = e->n_vocab,
        .n_layers = c->n_layers,
        .kv_slots_per_layer = lethe_kv_n_slots(e->pool),
        .kv_token_bytes = e->kv_layouts ? lethe_kv_layouts_token_bytes(e->kv_layouts, c->n_layers - c->n_linear_layers)
                                        : lethe_kv_token_bytes(c->n_layers - c->n_linear_layers, c->n_kv_heads,
                                                               c->head_dim, kv_size,
                                                               lethe_kv_format_of(e->pool)),
        .kv_slot_overhead_bytes = lethe_sparse_slot_overhead(e->method),
        .kv_reserve_bytes = e->kv_reserve,
        .max_num_seqs = e->p.max_num_seqs,
        .max_num_batched_tokens = e->p.max_num_batched_tokens,
    };
}

int32_t lethe_engine_request_resident(lethe_engine *e, uint64_t id, int32_t layer) {
    const eng_req *q = eng_find(e, id);
    if (!q || q->r.row < 0 || layer < 0 || layer >= lethe_kv_n_layers(e->pool)) return -1;
    return lethe_kv_row_len(e->pool, lethe_kv_space_of(e->pool, layer), q->r.row);
}

int32_t lethe_engine_max_resident(const lethe_engine *e, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk) {
    return lethe_sparse_max_resident(e->method, layer, n_prompt, n_total, chunk);
}

int32_t lethe_engine_n_state_slots(const lethe_engine *e) { return lethe_kv_n_state_slots(e->pool); }

lethe_model *lethe_engine_model(const lethe_engine *e) { return lethe_runner_model_of(&e->runner); }

void lethe_engine_kv_buffers(const lethe_engine *e, void **k, void **v) {
    const lethe_model_config *c = &e->runner.cfg;
    for (int32_t l = 0, kl = 0, sl = 0; l < c->n_layers; l++) { /* as runner.c binds them */
        if (lethe_layer_is_linear(c, l)) {
            k[l] = lethe_kv_state_rec(e->pool, sl);
            v[l] = lethe_kv_state_conv(e->pool, sl++);
        } else {
            k[l] = lethe_kv_k(e->pool, kl);
            v[l] = lethe_kv_v(e->pool, kl++);
        }
    }
}

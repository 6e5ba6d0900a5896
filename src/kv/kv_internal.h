/* kv_internal.h - the KV pool's data layout, shared by kv_pool.c and the
 * ownership checker kv_check.c. Nothing outside src/kv/ includes this. */
#ifndef LETHE_KV_INTERNAL_H
#define LETHE_KV_INTERNAL_H

#include "kv/kv_pool.h"

/* One row in one slot space: entries ascending by logical position. */
typedef struct kv_rowtab {
    int32_t *slot;       /* [cap] slot ids */
    int32_t *pos;        /* [cap] logical positions */
    uint64_t *hmask;     /* [cap] KV heads that keep each entry (pool param head_masks), else NULL */
    int32_t len, cap;
    float *meta;         /* [meta_cap_pages * page_meta_floats] or NULL */
    int32_t meta_cap_pages;
    int32_t meta_valid;  /* leading pages whose metadata is current */
} kv_rowtab;

/* A slot space: free stack + per-slot reference counts. */
typedef struct kv_space {
    int32_t *free_stack; /* [n_slots], top at n_free - 1 */
    int32_t n_free;
    int32_t *ref;        /* [n_slots] */
} kv_space;

/* A backend buffer the pool allocated (K/V planes, a format's side arrays). */
typedef struct kv_buf {
    void *p;
    size_t n;
} kv_buf;

struct lethe_kv_pool {
    lethe_kv_pool_params p;
    int32_t n_spaces;
    kv_space *spaces;    /* [n_spaces] */
    lethe_kv_layout *layout; /* [n_layers]: declared, or the format's K / V planes */
    bool has_layout;     /* layout was declared (params.layouts) */
    void **plane;        /* [n_layers * LETHE_KV_MAX_PLANES] backend buffers (NULL without a backend);
                          * K[l] = plane[l * MAX + 0], V[l] = plane[l * MAX + 1] */
    lethe_kv_quant *q;   /* [n_layers] quantized side arrays (format != NATIVE), else NULL */
    float *tq_tables;    /* TURBOQUANT: backend f32 tables every layer's q.tq points at */
    lethe_kivi_plan kplan; /* KIVI: host slot index + the step's pack plan (the method fills it) */
    kv_buf *bufs;        /* [n_bufs] every backend buffer above, in allocation order */
    int32_t n_bufs, cap_bufs;
    /* rows: tabs[row * n_spaces + sp] */
    kv_rowtab *tabs;
    bool *row_used;      /* [max_rows] */
    int32_t max_rows;
    int32_t *free_rows;  /* stack of unused row ids */
    int32_t n_free_rows;
    int64_t n_dropped;   /* row entries lethe_kv_keep dropped, over every space */
    struct kv_prot **prot; /* [n_prot] per row: protected positions (kv_protect.c), NULL = none */
    int32_t n_prot;
    /* per-request states (kv_pool.h): the buffers of each state layer, the
     * free stack of state slots, each row's slot */
    void **state_k, **state_v;   /* [n_state_layers] recurrent / conv states */
    int32_t *state_free;         /* [n_state_slots], top at n_state_free - 1 */
    int32_t n_state_free;
    int32_t *row_state;          /* [max_rows], -1 = none */
    /* host copies (kv_host.c), cumulative: bytes and seconds of lethe_kv_slots_save / _load */
    int64_t host_saved_bytes, host_loaded_bytes;
    double host_save_s, host_load_s;
    uint8_t *state_held;         /* [n_state_slots] taken by lethe_kv_state_take */
    int32_t n_state_held;
};

/* kv_protect.c: a released row drops its protection; destroy frees the table */
void lethe_kv_row_unprotect(lethe_kv_pool *pool, int32_t row);
void lethe_kv_protect_free(lethe_kv_pool *pool);

#endif /* LETHE_KV_INTERNAL_H */

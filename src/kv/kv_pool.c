/* kv_pool.c - token-slot KV pool: free lists, rows, compaction, references.
 *
 * See kv_pool.h for the model. Implementation notes:
 *  - free lists are stacks of slot ids; a fresh pool pops slot 0 first, so
 *    tests and small workloads see deterministic slot numbers;
 *  - rows grow by doubling (host bookkeeping only; the K/V buffers never
 *    move), so a pool sized for 256 requests x 8K context does not pay
 *    256 x 8K x n_layers int32 up front as a preallocated table would;
 *  - all mutations keep the reference counts exact; lethe_kv_check() can
 *    therefore recount everything from scratch and compare. */
#include "kv/kv_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/tq_codec.h"
#include "core/util.h"

/* bytes of one slot of one layer's K (or V) buffer, and of its per-slot side
 * arrays (FP8: the scale; KIVI: V group params + this slot's share of the K
 * group table, counted for K and V together, so halved here) */
static size_t code_bytes(int32_t n_kv_heads, int32_t head_dim, size_t kv_elem_size,
                         lethe_kv_format f) {
    size_t n = (size_t)n_kv_heads * (size_t)head_dim;
    switch (lethe_kv_format_kind(f)) {
    case LETHE_KV_FP8_E4M3: return n;
    case LETHE_KV_KIVI: return (n * (size_t)lethe_kv_kivi_bits(f) + 7) / 8;
    case LETHE_KV_TURBOQUANT: return (size_t)n_kv_heads * lethe_tq_code_bytes(head_dim, lethe_kv_tq_bits(f));
    default: return n * kv_elem_size;
    }
}
static size_t side_bytes(int32_t n_kv_heads, int32_t head_dim, lethe_kv_format f) {
    switch (lethe_kv_format_kind(f)) {
    case LETHE_KV_FP8_E4M3: return (size_t)n_kv_heads * sizeof(float);
    case LETHE_KV_KIVI: /* (V params 8 C / G + K table 8 C / G) / 2 */
        return 8u * (size_t)n_kv_heads * (size_t)head_dim / (size_t)lethe_kv_kivi_group(f);
    case LETHE_KV_TURBOQUANT: return (size_t)n_kv_heads * sizeof(uint16_t); /* fp16 norm */
    default: return 0;
    }
}

size_t lethe_kv_token_bytes(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                            size_t kv_elem_size, lethe_kv_format format) {
    size_t b = (size_t)n_layers * 2u *
               (code_bytes(n_kv_heads, head_dim, kv_elem_size, format) + side_bytes(n_kv_heads, head_dim, format));
    if (lethe_kv_format_kind(format) == LETHE_KV_KIVI) b += sizeof(int32_t); /* host slot_aux */
    return b;
}

size_t lethe_kv_layouts_token_bytes(const lethe_kv_layout *layouts, int32_t n_layers) {
    size_t b = 0;
    for (int32_t l = 0; l < n_layers; l++) b += lethe_kv_layout_slot_bytes(&layouts[l]);
    return b;
}

static lethe_kv_layout format_layout(const lethe_kv_pool_params *p, size_t kv_elem_size) {
    lethe_kv_layout L = {.n_planes = 2};
    const size_t cb = code_bytes(p->n_kv_heads, p->head_dim, kv_elem_size, p->format);
    snprintf(L.planes[0].name, sizeof(L.planes[0].name), "k");
    snprintf(L.planes[1].name, sizeof(L.planes[1].name), "v");
    L.planes[0].slot_bytes = L.planes[1].slot_bytes = cb;
    return L;
}

static lethe_status check_layout(const lethe_kv_layout *L, int32_t layer) {
    if (L->n_planes < 1 || L->n_planes > LETHE_KV_MAX_PLANES)
        return lethe_errorf(LETHE_ERR_INVALID, "kv pool: layer %d layout has %d planes (1 .. %d)", layer,
                            L->n_planes, LETHE_KV_MAX_PLANES);
    for (int32_t i = 0; i < L->n_planes; i++)
        if (L->planes[i].slot_bytes == 0)
            return lethe_errorf(LETHE_ERR_INVALID, "kv pool: layer %d plane %d (%.16s) has 0 bytes per slot",
                                layer, i, L->planes[i].name);
    return LETHE_OK;
}

size_t lethe_kv_kivi_res_bytes(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim,
                               size_t kv_elem_size, lethe_kv_format format, int32_t res_blocks) {
    if (lethe_kv_format_kind(format) != LETHE_KV_KIVI) return 0;
    return (size_t)n_layers * 2u * (size_t)res_blocks * (size_t)lethe_kv_kivi_group(format) *
           (size_t)n_kv_heads * (size_t)head_dim * kv_elem_size;
}

const char *lethe_kv_format_name(lethe_kv_format f) {
    switch (lethe_kv_format_kind(f)) {
    case LETHE_KV_NATIVE: return "native";
    case LETHE_KV_FP8_E4M3: return "fp8_e4m3";
    case LETHE_KV_KIVI:
        switch (lethe_kv_kivi_bits(f)) {
        case 2: return "kivi2";
        case 4: return "kivi4";
        case 8: return "kivi8";
        }
        return "kivi?";
    case LETHE_KV_TURBOQUANT:
        switch (lethe_kv_tq_bits(f)) {
        case 2: return "turboquant2";
        case 3: return "turboquant3";
        case 4: return "turboquant4";
        }
        return "turboquant?";
    default: break;
    }
    return "?";
}

/* Every backend buffer of the pool goes through here: (pointer, bytes) is
 * kept for lethe_kv_host_memory. */
static lethe_status pool_alloc(lethe_kv_pool *pool, size_t bytes, void **out) {
    lethe_status st = pool->p.be->ops->alloc(pool->p.be, bytes, out);
    if (st != LETHE_OK) return st;
    if (pool->n_bufs == pool->cap_bufs) {
        pool->cap_bufs = pool->cap_bufs ? 2 * pool->cap_bufs : 64;
        pool->bufs = lethe_xrealloc(pool->bufs, (size_t)pool->cap_bufs * sizeof(*pool->bufs));
    }
    pool->bufs[pool->n_bufs++] = (kv_buf){*out, bytes};
    return LETHE_OK;
}

/* TurboQuant's rotation and codebook (tq_codec.c), once per pool, shared by every layer */
static lethe_status upload_tq_tables(lethe_kv_pool *pool) {
    const lethe_kv_pool_params *p = &pool->p;
    const int32_t hd = p->head_dim, b = lethe_kv_tq_bits(p->format);
    const size_t n = lethe_tq_tables_floats(hd);
    float *t = lethe_xcalloc(n, sizeof(float));
    lethe_tq_rotation((uint64_t)lethe_kv_tq_seed(p->format), hd, t);
    for (int32_t i = 0; i < hd; i++)
        for (int32_t j = 0; j < hd; j++) t[lethe_tq_off_rot_t(hd) + (size_t)j * hd + i] = t[(size_t)i * hd + j];
    lethe_tq_codebook(b, hd, t + lethe_tq_off_centroids(hd), t + lethe_tq_off_bounds(hd));
    void *dev = NULL;
    lethe_status st = pool_alloc(pool, n * sizeof(float), &dev);
    if (st == LETHE_OK) p->be->ops->copy_from_host(p->be, dev, t, n * sizeof(float));
    free(t);
    pool->tq_tables = dev;
    return st;
}

static lethe_status alloc_kivi(lethe_kv_pool *pool, lethe_kv_quant *q) {
    const lethe_kv_pool_params *p = &pool->p;
    lethe_backend *be = p->be;
    const size_t C = (size_t)p->n_kv_heads * (size_t)p->head_dim;
    const int32_t G = lethe_kv_kivi_group(p->format);
    q->n_groups = LETHE_MAX(1, p->n_slots / G);
    q->n_res = LETHE_MAX(1, p->kivi_res_blocks) * G;
    q->kivi = &pool->kplan;
    lethe_status st = pool_alloc(pool, (size_t)p->n_slots * 2u * (C / (size_t)G) * sizeof(float), &q->v_param);
    if (st == LETHE_OK) st = pool_alloc(pool, (size_t)q->n_groups * 2u * C * sizeof(float), &q->k_group);
    if (st == LETHE_OK) st = pool_alloc(pool, (size_t)q->n_res * C * be->ops->kv_size, &q->k_res);
    if (st == LETHE_OK) st = pool_alloc(pool, (size_t)q->n_res * C * be->ops->kv_size, &q->v_res);
    return st;
}

lethe_status lethe_kv_pool_create(const lethe_kv_pool_params *p, lethe_kv_pool **out) {
    *out = NULL;
    if (p->n_layers <= 0 || p->n_kv_heads <= 0 || p->head_dim <= 0)
        return lethe_errorf(LETHE_ERR_INVALID, "kv pool: bad shape (layers %d, kv heads %d, head dim %d)",
                            p->n_layers, p->n_kv_heads, p->head_dim);
    if (p->n_slots <= 0)
        return lethe_errorf(LETHE_ERR_CAPACITY, "kv pool: no KV slots fit the memory budget");
    if (p->scratch_slot && p->n_slots < 2)
        return lethe_errorf(LETHE_ERR_CAPACITY, "kv pool: %d slots leave none besides the scratch slot",
                            p->n_slots);
    if (p->page_meta_floats < 0)
        return lethe_errorf(LETHE_ERR_INVALID, "kv pool: page_meta_floats < 0");
    const lethe_kv_format kind = lethe_kv_format_kind(p->format);
    if (kind != LETHE_KV_NATIVE && kind != LETHE_KV_FP8_E4M3 && kind != LETHE_KV_KIVI && kind != LETHE_KV_TURBOQUANT)
        return lethe_errorf(LETHE_ERR_INVALID, "kv pool: unknown KV format %d", (int)p->format);
    if (kind == LETHE_KV_KIVI) {
        const int32_t b = lethe_kv_kivi_bits(p->format), G = lethe_kv_kivi_group(p->format);
        if ((b != 2 && b != 4 && b != 8) || G <= 0 || p->head_dim % G || (G * b) % 8 || p->per_layer)
            return lethe_errorf(LETHE_ERR_INVALID, "kv pool: bad KIVI format (bits %d, group %d, head_dim %d%s)",
                                b, G, p->head_dim, p->per_layer ? ", per-layer rows" : "");
    }
    if (kind == LETHE_KV_TURBOQUANT) {
        const int32_t b = lethe_kv_tq_bits(p->format);
        if (b < 2 || b > LETHE_TQ_BITS_MAX || p->head_dim % 8 || p->head_dim > LETHE_TQ_HEAD_DIM_MAX)
            return lethe_errorf(LETHE_ERR_INVALID, "kv pool: bad TurboQuant format (bits %d, head_dim %d: "
                                "needs 2..4 bits and a head_dim multiple of 8 up to %d)",
                                b, p->head_dim, LETHE_TQ_HEAD_DIM_MAX);
        if (p->be && !p->be->ops->copy_from_host)
            return lethe_errorf(LETHE_ERR_UNSUPPORTED, "kv pool: the %s backend cannot upload TurboQuant tables",
                                p->be->ops->name);
    }
    if (p->layouts && p->format != LETHE_KV_NATIVE)
        return lethe_errorf(LETHE_ERR_INVALID, "kv pool: a declared payload layout needs the native format, not %s",
                            lethe_kv_format_name(p->format));
    for (int32_t l = 0; p->layouts && l < p->n_layers; l++) {
        lethe_status st = check_layout(&p->layouts[l], l);
        if (st != LETHE_OK) return st;
    }
    if (p->head_masks && (p->n_kv_heads > LETHE_KV_MAX_HEAD_MASK_HEADS || p->format != LETHE_KV_NATIVE || p->layouts))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "kv pool: per-head row lengths need native KV and at most %d KV heads (%d, %s)",
                            LETHE_KV_MAX_HEAD_MASK_HEADS, p->n_kv_heads, lethe_kv_format_name(p->format));
    if (p->n_state_layers < 0 ||
        (p->n_state_layers > 0 && (p->n_state_slots < 1 + (p->scratch_slot ? 1 : 0) ||
                                   p->state_k_bytes == 0 || p->state_v_bytes == 0)))
        return lethe_errorf(LETHE_ERR_INVALID,
                            "kv pool: per-request states of %d layers need at least one state slot (%d) "
                            "and non-empty state rows", p->n_state_layers, p->n_state_slots);
    if (p->format != LETHE_KV_NATIVE && p->be && !p->be->ops->kv_store_quant)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "kv pool: the %s backend has no %s KV",
                            p->be->ops->name, lethe_kv_format_name(p->format));
    lethe_kv_pool *pool = lethe_xcalloc(1, sizeof(*pool));
    pool->p = *p;
    pool->n_spaces = p->per_layer ? p->n_layers : 1;
    pool->spaces = lethe_xcalloc((size_t)pool->n_spaces, sizeof(kv_space));
    for (int32_t s = 0; s < pool->n_spaces; s++) {
        kv_space *sp = &pool->spaces[s];
        sp->free_stack = malloc((size_t)p->n_slots * sizeof(int32_t));
        sp->ref = calloc((size_t)p->n_slots, sizeof(int32_t));
        if (!sp->free_stack || !sp->ref) {
            lethe_kv_pool_destroy(pool);
            return lethe_errorf(LETHE_ERR_NOMEM, "kv pool: %d slots: out of host memory", p->n_slots);
        }
        /* the scratch slot (last id) stays off the free list with the pool's reference */
        const int32_t n_free = p->scratch_slot ? p->n_slots - 1 : p->n_slots;
        for (int32_t i = 0; i < n_free; i++) sp->free_stack[i] = n_free - 1 - i;
        sp->n_free = n_free;
        if (p->scratch_slot) sp->ref[p->n_slots - 1] = 1;
    }
    pool->p.layouts = NULL; /* the caller's array is copied into pool->layout */
    pool->layout = lethe_xcalloc((size_t)p->n_layers, sizeof(lethe_kv_layout));
    for (int32_t l = 0; l < p->n_layers; l++)
        pool->layout[l] = p->layouts ? p->layouts[l] : format_layout(p, p->be ? p->be->ops->kv_size : sizeof(float));
    if (p->n_state_layers > 0) {
        pool->state_k = lethe_xcalloc((size_t)p->n_state_layers, sizeof(void *));
        pool->state_v = lethe_xcalloc((size_t)p->n_state_layers, sizeof(void *));
        pool->state_free = lethe_xmalloc((size_t)p->n_state_slots * sizeof(int32_t));
        pool->state_held = lethe_xcalloc((size_t)p->n_state_slots, 1);
        const int32_t n_free = p->n_state_slots - (p->scratch_slot ? 1 : 0);
        for (int32_t i = 0; i < n_free; i++) pool->state_free[i] = n_free - 1 - i;
        pool->n_state_free = n_free;
    }
    pool->has_layout = p->layouts != NULL;
    pool->plane = lethe_xcalloc((size_t)p->n_layers * LETHE_KV_MAX_PLANES, sizeof(void *));
    if (p->be && p->format != LETHE_KV_NATIVE)
        pool->q = lethe_xcalloc((size_t)p->n_layers, sizeof(lethe_kv_quant));
    if (p->be && kind == LETHE_KV_KIVI) {
        pool->kplan.slot_aux = malloc((size_t)p->n_slots * sizeof(int32_t));
        if (!pool->kplan.slot_aux) {
            lethe_kv_pool_destroy(pool);
            return lethe_errorf(LETHE_ERR_NOMEM, "kv pool: KIVI slot index: out of host memory");
        }
        for (int32_t i = 0; i < p->n_slots; i++) pool->kplan.slot_aux[i] = INT32_MIN; /* never stored */
    }
    if (p->be) {
        size_t bytes = (size_t)p->n_slots * code_bytes(p->n_kv_heads, p->head_dim, p->be->ops->kv_size, p->format);
        size_t side = (size_t)p->n_slots * side_bytes(p->n_kv_heads, p->head_dim, p->format);
        for (int32_t i = 0; i < p->n_state_layers; i++) {
            lethe_status st = pool_alloc(pool, (size_t)p->n_state_slots * p->state_k_bytes, &pool->state_k[i]);
            if (st == LETHE_OK)
                st = pool_alloc(pool, (size_t)p->n_state_slots * p->state_v_bytes, &pool->state_v[i]);
            if (st != LETHE_OK) {
                char why[256];
                snprintf(why, sizeof(why), "%s", lethe_last_error());
                lethe_kv_pool_destroy(pool);
                return lethe_errorf(st, "kv pool: allocating the states of state layer %d (%d slots): %s", i,
                                    p->n_state_slots, why);
            }
        }
        for (int32_t l = 0; l < p->n_layers; l++) {
            lethe_status st = LETHE_OK;
            const lethe_kv_layout *L = &pool->layout[l];
            for (int32_t i = 0; i < L->n_planes && st == LETHE_OK; i++) {
                bytes = (size_t)p->n_slots * L->planes[i].slot_bytes;
                st = pool_alloc(pool, bytes, &pool->plane[(size_t)l * LETHE_KV_MAX_PLANES + i]);
            }
            if (st == LETHE_OK && pool->q && kind == LETHE_KV_KIVI) {
                pool->q[l].format = p->format;
                st = alloc_kivi(pool, &pool->q[l]);
            } else if (st == LETHE_OK && pool->q && kind == LETHE_KV_TURBOQUANT) {
                pool->q[l].format = p->format;
                if (!pool->tq_tables) st = upload_tq_tables(pool);
                pool->q[l].tq = pool->tq_tables;
                if (st == LETHE_OK) st = pool_alloc(pool, side, &pool->q[l].k_norm);
                if (st == LETHE_OK) st = pool_alloc(pool, side, &pool->q[l].v_norm);
            } else if (st == LETHE_OK && pool->q) {
                pool->q[l].format = p->format;
                st = pool_alloc(pool, side, &pool->q[l].k_scale);
                if (st == LETHE_OK) st = pool_alloc(pool, side, &pool->q[l].v_scale);
            }
            if (st != LETHE_OK) {
                char why[256];
                snprintf(why, sizeof(why), "%s", lethe_last_error());
                lethe_kv_pool_destroy(pool);
                return lethe_errorf(st, "kv pool: allocating K/V of layer %d (%zu bytes each, %d slots): %s",
                                    l, bytes, p->n_slots, why);
            }
        }
    }
    *out = pool;
    return LETHE_OK;
}

static void rowtab_free(kv_rowtab *t) {
    free(t->slot);
    free(t->pos);
    free(t->hmask);
    free(t->meta);
    memset(t, 0, sizeof(*t));
}

void lethe_kv_pool_destroy(lethe_kv_pool *pool) {
    if (!pool) return;
    lethe_kv_protect_free(pool);
    for (int32_t i = 0; i < pool->n_bufs; i++) pool->p.be->ops->release(pool->p.be, pool->bufs[i].p);
    free(pool->bufs);
    free(pool->state_k);
    free(pool->state_v);
    free(pool->state_free);
    free(pool->state_held);
    free(pool->row_state);
    free(pool->q);
    free(pool->kplan.slot_aux);
    free(pool->plane);
    free(pool->layout);
    for (int32_t s = 0; s < pool->n_spaces && pool->spaces; s++) {
        free(pool->spaces[s].free_stack);
        free(pool->spaces[s].ref);
    }
    free(pool->spaces);
    for (int64_t i = 0; i < (int64_t)pool->max_rows * pool->n_spaces; i++) rowtab_free(&pool->tabs[i]);
    free(pool->tabs);
    free(pool->row_used);
    free(pool->free_rows);
    free(pool);
}

int32_t lethe_kv_n_layers(const lethe_kv_pool *pool) { return pool->p.n_layers; }
int32_t lethe_kv_n_slots(const lethe_kv_pool *pool) { return pool->p.n_slots; }
int32_t lethe_kv_n_spaces(const lethe_kv_pool *pool) { return pool->n_spaces; }
int32_t lethe_kv_scratch_slot(const lethe_kv_pool *pool) {
    return pool->p.scratch_slot ? pool->p.n_slots - 1 : -1;
}
bool lethe_kv_per_layer(const lethe_kv_pool *pool) { return pool->p.per_layer; }

int32_t lethe_kv_space_of(const lethe_kv_pool *pool, int32_t layer) {
    LETHE_ASSERT(layer >= 0 && layer < pool->p.n_layers);
    return lethe_kv_space_of_(pool->p.per_layer, layer);
}

int32_t lethe_kv_n_free(const lethe_kv_pool *pool, int32_t sp) {
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces);
    return pool->spaces[sp].n_free;
}

int32_t lethe_kv_min_free(const lethe_kv_pool *pool) {
    int32_t m = pool->spaces[0].n_free;
    for (int32_t s = 1; s < pool->n_spaces; s++) m = LETHE_MIN(m, pool->spaces[s].n_free);
    return m;
}

int64_t lethe_kv_dropped(const lethe_kv_pool *pool) { return pool->n_dropped; }

/* Bytes of the pages covering [p, p + n) that are in RAM now (mincore;
 * whole pages, so up to a page more at either end); -1 if not mapped. */
static int64_t host_resident_bytes(const void *p, size_t n) {
    if (n == 0) return 0;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = (uintptr_t)p & ~(page - 1), b = ((uintptr_t)p + n + page - 1) & ~(page - 1);
    int64_t total = 0;
    unsigned char vec[4096];
    for (uintptr_t s = a; s < b; s += sizeof(vec) * page) { /* 4096 pages at a time */
        const size_t len = LETHE_MIN((size_t)(b - s), sizeof(vec) * (size_t)page);
        if (mincore((void *)s, len, vec) != 0) return -1;
        for (size_t i = 0; i < (len + page - 1) / page; i++) total += vec[i] & 1;
    }
    return total * (int64_t)page;
}

bool lethe_kv_host_memory(const lethe_kv_pool *pool, int64_t *resident, int64_t *allocated) {
    *resident = *allocated = 0;
    if (!pool->p.be || !(pool->p.be->ops->caps & LETHE_BE_HOST_MEMORY)) return false;
    for (int32_t i = 0; i < pool->n_bufs; i++) {
        int64_t r = host_resident_bytes(pool->bufs[i].p, pool->bufs[i].n);
        LETHE_ASSERT(r >= 0 && "mincore on a buffer of the pool");
        *resident += LETHE_MIN(r, (int64_t)pool->bufs[i].n);
        *allocated += (int64_t)pool->bufs[i].n;
    }
    return true;
}

int64_t lethe_kv_total_free(const lethe_kv_pool *pool) {
    int64_t t = 0;
    for (int32_t s = 0; s < pool->n_spaces; s++) t += pool->spaces[s].n_free;
    return t;
}

void *lethe_kv_plane_buf(const lethe_kv_pool *pool, int32_t layer, int32_t i) {
    LETHE_ASSERT(layer >= 0 && layer < pool->p.n_layers);
    LETHE_ASSERT(i >= 0 && i < pool->layout[layer].n_planes);
    return pool->plane[(size_t)layer * LETHE_KV_MAX_PLANES + i];
}
void *lethe_kv_k(const lethe_kv_pool *pool, int32_t layer) { return lethe_kv_plane_buf(pool, layer, 0); }
void *lethe_kv_v(const lethe_kv_pool *pool, int32_t layer) {
    LETHE_ASSERT(layer >= 0 && layer < pool->p.n_layers);
    return pool->layout[layer].n_planes > 1 ? lethe_kv_plane_buf(pool, layer, 1) : NULL;
}
bool lethe_kv_has_layout(const lethe_kv_pool *pool) { return pool->has_layout; }
const lethe_kv_layout *lethe_kv_layout_of(const lethe_kv_pool *pool, int32_t layer) {
    LETHE_ASSERT(layer >= 0 && layer < pool->p.n_layers);
    return &pool->layout[layer];
}

lethe_kv_format lethe_kv_format_of(const lethe_kv_pool *pool) { return pool->p.format; }

lethe_kivi_plan *lethe_kv_kivi_plan(lethe_kv_pool *pool) {
    return pool->kplan.slot_aux ? &pool->kplan : NULL;
}

const lethe_kv_quant *lethe_kv_quant_of(const lethe_kv_pool *pool, int32_t layer) {
    LETHE_ASSERT(layer >= 0 && layer < pool->p.n_layers);
    return pool->q ? &pool->q[layer] : NULL;
}

/* ---- per-request states ---- */

bool lethe_kv_has_states(const lethe_kv_pool *pool) { return pool->p.n_state_layers > 0; }
int32_t lethe_kv_n_state_layers(const lethe_kv_pool *pool) { return pool->p.n_state_layers; }
void *lethe_kv_state_rec(const lethe_kv_pool *pool, int32_t i) {
    LETHE_ASSERT(i >= 0 && i < pool->p.n_state_layers);
    return pool->state_k[i];
}
void *lethe_kv_state_conv(const lethe_kv_pool *pool, int32_t i) {
    LETHE_ASSERT(i >= 0 && i < pool->p.n_state_layers);
    return pool->state_v[i];
}
int32_t lethe_kv_state_n_free(const lethe_kv_pool *pool) {
    return lethe_kv_has_states(pool) ? pool->n_state_free : INT32_MAX;
}
int32_t lethe_kv_n_state_slots(const lethe_kv_pool *pool) {
    return lethe_kv_has_states(pool) ? pool->p.n_state_slots : 0;
}
int32_t lethe_kv_row_state(const lethe_kv_pool *pool, int32_t row) {
    LETHE_ASSERT(row >= 0 && row < pool->max_rows && pool->row_used[row]);
    return pool->row_state ? pool->row_state[row] : -1;
}
int32_t lethe_kv_scratch_state(const lethe_kv_pool *pool) {
    return lethe_kv_has_states(pool) && pool->p.scratch_slot ? pool->p.n_state_slots - 1 : -1;
}
int32_t lethe_kv_state_take(lethe_kv_pool *pool) {
    if (!lethe_kv_has_states(pool) || pool->n_state_free == 0) return -1;
    const int32_t x = pool->state_free[--pool->n_state_free];
    LETHE_ASSERT(!pool->state_held[x]);
    pool->state_held[x] = 1;
    pool->n_state_held++;
    return x;
}
void lethe_kv_state_give(lethe_kv_pool *pool, int32_t slot) {
    LETHE_ASSERT(lethe_kv_has_states(pool) && slot >= 0 && slot < pool->p.n_state_slots &&
                 pool->state_held[slot] && pool->n_state_free < pool->p.n_state_slots);
    pool->state_held[slot] = 0;
    pool->n_state_held--;
    pool->state_free[pool->n_state_free++] = slot;
}
int32_t lethe_kv_state_n_held(const lethe_kv_pool *pool) { return pool->n_state_held; }
void lethe_kv_state_copy(lethe_kv_pool *pool, int32_t dst, int32_t src) {
    LETHE_ASSERT(lethe_kv_has_states(pool) && dst >= 0 && src >= 0 && dst < pool->p.n_state_slots &&
                 src < pool->p.n_state_slots);
    lethe_backend *be = pool->p.be;
    if (!be || dst == src) return;
    for (int32_t i = 0; i < pool->p.n_state_layers; i++) {
        be->ops->state_copy(be, pool->state_k[i], pool->p.state_k_bytes, dst, src);
        be->ops->state_copy(be, pool->state_v[i], pool->p.state_v_bytes, dst, src);
    }
}

/* ---- slot references ---- */

static inline void slot_ref(lethe_kv_pool *pool, int32_t sp, int32_t slot) {
    kv_space *s = &pool->spaces[sp];
    LETHE_ASSERT(slot >= 0 && slot < pool->p.n_slots && s->ref[slot] > 0);
    s->ref[slot]++;
}

static inline void slot_unref(lethe_kv_pool *pool, int32_t sp, int32_t slot) {
    kv_space *s = &pool->spaces[sp];
    LETHE_ASSERT(slot >= 0 && slot < pool->p.n_slots && s->ref[slot] > 0);
    if (--s->ref[slot] == 0) {
        LETHE_ASSERT(s->n_free < pool->p.n_slots);
        s->free_stack[s->n_free++] = slot;
    }
}

void lethe_kv_ref(lethe_kv_pool *pool, int32_t sp, int32_t slot) {
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces);
    slot_ref(pool, sp, slot);
}
void lethe_kv_unref(lethe_kv_pool *pool, int32_t sp, int32_t slot) {
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces);
    slot_unref(pool, sp, slot);
}
int32_t lethe_kv_refcount(const lethe_kv_pool *pool, int32_t sp, int32_t slot) {
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces && slot >= 0 && slot < pool->p.n_slots);
    return pool->spaces[sp].ref[slot];
}

/* ---- rows ---- */

static kv_rowtab *tab(const lethe_kv_pool *pool, int32_t sp, int32_t row) {
    LETHE_ASSERT(row >= 0 && row < pool->max_rows && pool->row_used[row]);
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces);
    return &pool->tabs[(size_t)row * (size_t)pool->n_spaces + (size_t)sp];
}

int32_t lethe_kv_row_alloc(lethe_kv_pool *pool) {
    if (pool->n_free_rows == 0) {
        int32_t old = pool->max_rows, nw = old ? old * 2 : 16;
        pool->tabs = lethe_xrealloc(pool->tabs, (size_t)nw * (size_t)pool->n_spaces * sizeof(kv_rowtab));
        memset(pool->tabs + (size_t)old * (size_t)pool->n_spaces, 0,
               (size_t)(nw - old) * (size_t)pool->n_spaces * sizeof(kv_rowtab));
        pool->row_used = lethe_xrealloc(pool->row_used, (size_t)nw * sizeof(bool));
        memset(pool->row_used + old, 0, (size_t)(nw - old) * sizeof(bool));
        pool->free_rows = lethe_xrealloc(pool->free_rows, (size_t)nw * sizeof(int32_t));
        for (int32_t r = nw - 1; r >= old; r--) pool->free_rows[pool->n_free_rows++] = r;
        if (lethe_kv_has_states(pool)) {
            pool->row_state = lethe_xrealloc(pool->row_state, (size_t)nw * sizeof(int32_t));
            for (int32_t r = old; r < nw; r++) pool->row_state[r] = -1;
        }
        pool->max_rows = nw;
    }
    int32_t row = pool->free_rows[--pool->n_free_rows];
    LETHE_ASSERT(!pool->row_used[row]);
    pool->row_used[row] = true;
    if (lethe_kv_has_states(pool)) { /* the caller checked lethe_kv_state_n_free */
        LETHE_ASSERT(pool->n_state_free > 0 && pool->row_state[row] == -1);
        pool->row_state[row] = pool->state_free[--pool->n_state_free];
    }
    return row;
}

void lethe_kv_row_release(lethe_kv_pool *pool, int32_t row) {
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        kv_rowtab *t = tab(pool, sp, row);
        for (int32_t i = 0; i < t->len; i++) slot_unref(pool, sp, t->slot[i]);
        t->len = 0;
        t->meta_valid = 0;
    }
    lethe_kv_row_unprotect(pool, row);
    if (lethe_kv_has_states(pool)) {
        LETHE_ASSERT(pool->row_state[row] >= 0 && pool->n_state_free < pool->p.n_state_slots);
        pool->state_free[pool->n_state_free++] = pool->row_state[row];
        pool->row_state[row] = -1;
    }
    pool->row_used[row] = false;
    pool->free_rows[pool->n_free_rows++] = row;
}

bool lethe_kv_row_in_use(const lethe_kv_pool *pool, int32_t row) {
    return row >= 0 && row < pool->max_rows && pool->row_used[row];
}
int32_t lethe_kv_max_rows(const lethe_kv_pool *pool) { return pool->max_rows; }

int32_t lethe_kv_row_len(const lethe_kv_pool *pool, int32_t sp, int32_t row) {
    return tab(pool, sp, row)->len;
}
const int32_t *lethe_kv_row_slots(const lethe_kv_pool *pool, int32_t sp, int32_t row) {
    return tab(pool, sp, row)->slot;
}
const int32_t *lethe_kv_row_pos(const lethe_kv_pool *pool, int32_t sp, int32_t row) {
    return tab(pool, sp, row)->pos;
}

static void tab_reserve(kv_rowtab *t, int32_t need) {
    if (need <= t->cap) return;
    int32_t cap = t->cap ? t->cap : 64;
    while (cap < need) cap *= 2;
    t->slot = lethe_xrealloc(t->slot, (size_t)cap * sizeof(int32_t));
    t->pos = lethe_xrealloc(t->pos, (size_t)cap * sizeof(int32_t));
    t->cap = cap;
}
/* with head masks the mask array follows the capacity */
static void tab_reserve_pool(const lethe_kv_pool *pool, kv_rowtab *t, int32_t need) {
    const int32_t cap0 = t->cap;
    tab_reserve(t, need);
    if (pool->p.head_masks && (!t->hmask || t->cap != cap0))
        t->hmask = lethe_xrealloc(t->hmask, (size_t)LETHE_MAX(t->cap, 1) * sizeof(uint64_t));
}

static void meta_invalidate_from(kv_rowtab *t, int32_t first_entry) {
    int32_t page = first_entry / LETHE_KV_PAGE;
    if (t->meta_valid > page) t->meta_valid = page;
}

bool lethe_kv_row_append(lethe_kv_pool *pool, int32_t row, int32_t n, const int32_t *pos) {
    LETHE_ASSERT(n >= 0);
    for (int32_t sp = 0; sp < pool->n_spaces; sp++)
        if (pool->spaces[sp].n_free < n) return false;
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        kv_rowtab *t = tab(pool, sp, row);
        kv_space *s = &pool->spaces[sp];
        tab_reserve_pool(pool, t, t->len + n);
        int32_t prev = t->len ? t->pos[t->len - 1] : -1;
        meta_invalidate_from(t, t->len);
        for (int32_t i = 0; i < n; i++) {
            LETHE_ASSERT(pos[i] > prev);
            prev = pos[i];
            int32_t slot = s->free_stack[--s->n_free];
            LETHE_ASSERT(s->ref[slot] == 0);
            s->ref[slot] = 1;
            t->slot[t->len] = slot;
            t->pos[t->len] = pos[i];
            if (t->hmask) t->hmask[t->len] = lethe_kv_full_head_mask(pool);
            t->len++;
        }
    }
    return true;
}

void lethe_kv_row_attach(lethe_kv_pool *pool, int32_t row, const int32_t *slots,
                         const int32_t *pos, int32_t n) {
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        kv_rowtab *t = tab(pool, sp, row);
        tab_reserve_pool(pool, t, t->len + n);
        int32_t prev = t->len ? t->pos[t->len - 1] : -1;
        meta_invalidate_from(t, t->len);
        for (int32_t i = 0; i < n; i++) {
            int32_t slot = slots[(size_t)sp * (size_t)n + (size_t)i];
            if (t->hmask) t->hmask[t->len] = lethe_kv_full_head_mask(pool);
            LETHE_ASSERT(pos[i] > prev);
            prev = pos[i];
            slot_ref(pool, sp, slot);
            t->slot[t->len] = slot;
            t->pos[t->len] = pos[i];
            t->len++;
        }
    }
}

void lethe_kv_row_attach_space(lethe_kv_pool *pool, int32_t row, int32_t sp, const int32_t *slots,
                               const int32_t *pos, int32_t n) {
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces && n >= 0);
    kv_rowtab *t = tab(pool, sp, row);
    tab_reserve_pool(pool, t, t->len + n);
    int32_t prev = t->len ? t->pos[t->len - 1] : -1;
    meta_invalidate_from(t, t->len);
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(pos[i] > prev);
        prev = pos[i];
        if (t->hmask) t->hmask[t->len] = lethe_kv_full_head_mask(pool);
        slot_ref(pool, sp, slots[i]);
        t->slot[t->len] = slots[i];
        t->pos[t->len] = pos[i];
        t->len++;
    }
}

void lethe_kv_keep(lethe_kv_pool *pool, int32_t layer, int32_t row, const int32_t *keep,
                   int32_t n) {
    int32_t sp = lethe_kv_space_of(pool, layer);
    kv_rowtab *t = tab(pool, sp, row);
    LETHE_ASSERT(n >= 0 && n <= t->len);
    /* keep[] ascending, so entry keep[i] >= i: compacting in place is safe. */
    int32_t next = 0, first_change = -1;
    const int32_t *prot = NULL;
    const bool guarded = lethe_kv_row_protected(pool, row, &prot) > 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t k = keep[i];
        LETHE_ASSERT(k >= next && k < t->len);
        for (int32_t d = next; d < k; d++) {
            /* the one rule of the protected mask: nothing drops a pinned entry
             * (methods build their keep sets with lethe_sparse_keep_set) */
            LETHE_ASSERT(!guarded || !lethe_kv_pos_protected(pool, row, t->pos[d]));
            slot_unref(pool, sp, t->slot[d]);
        }
        if (k != i && first_change < 0) first_change = i;
        t->slot[i] = t->slot[k];
        t->pos[i] = t->pos[k];
        if (t->hmask) t->hmask[i] = t->hmask[k];
        next = k + 1;
    }
    for (int32_t d = next; d < t->len; d++) {
        LETHE_ASSERT(!guarded || !lethe_kv_pos_protected(pool, row, t->pos[d]));
        slot_unref(pool, sp, t->slot[d]);
    }
    if (n < t->len && first_change < 0) first_change = n;
    pool->n_dropped += t->len - n;
    t->len = n;
    if (first_change >= 0) meta_invalidate_from(t, first_change);
}

/* ---- page metadata ---- */

bool lethe_kv_has_head_masks(const lethe_kv_pool *pool) { return pool->p.head_masks; }
uint64_t lethe_kv_full_head_mask(const lethe_kv_pool *pool) {
    return pool->p.n_kv_heads >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << pool->p.n_kv_heads) - 1;
}
const uint64_t *lethe_kv_row_head_mask(const lethe_kv_pool *pool, int32_t sp, int32_t row) {
    const kv_rowtab *t = tab(pool, sp, row);
    return pool->p.head_masks ? t->hmask : NULL;
}
int32_t lethe_kv_head_len(const lethe_kv_pool *pool, int32_t sp, int32_t row, int32_t head) {
    const kv_rowtab *t = tab(pool, sp, row);
    LETHE_ASSERT(head >= 0 && head < pool->p.n_kv_heads);
    if (!pool->p.head_masks) return t->len;
    int32_t n = 0;
    for (int32_t i = 0; i < t->len; i++) n += (int32_t)((t->hmask[i] >> head) & 1u);
    return n;
}
void lethe_kv_keep_heads(lethe_kv_pool *pool, int32_t layer, int32_t row, const uint64_t *mask) {
    LETHE_ASSERT(pool->p.head_masks);
    kv_rowtab *t = tab(pool, lethe_kv_space_of(pool, layer), row);
    int32_t *keep = lethe_xmalloc(((size_t)t->len + 1) * sizeof(int32_t)), n = 0;
    for (int32_t i = 0; i < t->len; i++) {
        LETHE_ASSERT((mask[i] & ~t->hmask[i]) == 0); /* heads only ever drop an entry */
        /* a retention-pinned entry keeps every head (kv_protect.c) */
        LETHE_ASSERT(mask[i] == t->hmask[i] || !lethe_kv_pos_protected(pool, row, t->pos[i]));
        t->hmask[i] = mask[i];
        if (mask[i]) keep[n++] = i;
    }
    if (n < t->len) lethe_kv_keep(pool, layer, row, keep, n);
    free(keep);
}

int32_t lethe_kv_page_meta_floats(const lethe_kv_pool *pool) { return pool->p.page_meta_floats; }

float *lethe_kv_page_meta(lethe_kv_pool *pool, int32_t sp, int32_t row, int32_t page) {
    int32_t f = pool->p.page_meta_floats;
    LETHE_ASSERT(f > 0);
    kv_rowtab *t = tab(pool, sp, row);
    int32_t n_pages = LETHE_CEIL_DIV(t->len, LETHE_KV_PAGE);
    LETHE_ASSERT(page >= 0 && page < n_pages);
    if (page >= t->meta_cap_pages) {
        int32_t cap = t->meta_cap_pages ? t->meta_cap_pages : 8;
        while (cap <= page) cap *= 2;
        t->meta = lethe_xrealloc(t->meta, (size_t)cap * (size_t)f * sizeof(float));
        t->meta_cap_pages = cap;
    }
    return t->meta + (size_t)page * (size_t)f;
}

int32_t lethe_kv_page_meta_valid(const lethe_kv_pool *pool, int32_t sp, int32_t row) {
    return tab(pool, sp, row)->meta_valid;
}

void lethe_kv_page_meta_set_valid(lethe_kv_pool *pool, int32_t sp, int32_t row, int32_t n_pages) {
    kv_rowtab *t = tab(pool, sp, row);
    LETHE_ASSERT(n_pages >= 0 && n_pages <= LETHE_CEIL_DIV(t->len, LETHE_KV_PAGE));
    t->meta_valid = n_pages;
}

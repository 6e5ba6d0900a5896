/* kv_host.c - a slot's KV payload to and from host memory, for the host
 * tier of the prefix caches (src/cache/host_tier.h): what a demoted block
 * needs to be restored bit for bit into other slots.
 *
 * A slot of slot space sp holds, for every layer l of the space (all layers
 * in the shared layout, layer sp alone per layer) and every payload plane i
 * of that layer, slot_bytes(l, i) bytes at plane[l][i] + slot * slot_bytes.
 * The host image of n slots is, in that order, [layer][plane][n][slot_bytes]:
 * one backend copy per (layer, plane) moves all n slots (rows_to_host /
 * rows_from_host, synchronous). Only formats whose whole payload lives in the
 * planes can be copied: NATIVE, with or without a declared layout (FP8's
 * scales, KIVI's group tables and host slot index, TurboQuant's norms live
 * beside them). */
#include <string.h>

#include "core/util.h"
#include "kv/kv_internal.h"

static int32_t first_layer(const lethe_kv_pool *pool, int32_t sp) { return pool->p.per_layer ? sp : 0; }
static int32_t end_layer(const lethe_kv_pool *pool, int32_t sp) {
    return pool->p.per_layer ? sp + 1 : pool->p.n_layers;
}

lethe_status lethe_kv_host_copy_check(const lethe_kv_pool *pool) {
    const lethe_backend *be = pool->p.be;
    if (!be)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "host KV tier: the KV pool has no backend memory");
    if (pool->p.format != LETHE_KV_NATIVE)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "host KV tier: KV format %s keeps side arrays outside the slot planes; "
                            "only native KV can be demoted to host memory",
                            lethe_kv_format_name(pool->p.format));
    if (pool->p.head_masks)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "host KV tier: per-head row masks are not part of a slot's payload");
    if (!(be->ops->caps & LETHE_BE_HOST_MEMORY) && (!be->ops->rows_to_host || !be->ops->rows_from_host))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "host KV tier: the %s backend cannot copy KV rows to the host",
                            be->ops->name);
    return LETHE_OK;
}

size_t lethe_kv_space_slot_bytes(const lethe_kv_pool *pool, int32_t sp) {
    LETHE_ASSERT(sp >= 0 && sp < pool->n_spaces);
    size_t n = 0;
    for (int32_t l = first_layer(pool, sp); l < end_layer(pool, sp); l++)
        for (int32_t i = 0; i < pool->layout[l].n_planes; i++) n += pool->layout[l].planes[i].slot_bytes;
    return n;
}

/* one (layer, plane): host[n][sb] <-> plane[slots[i]] */
static void copy_rows(lethe_kv_pool *pool, int32_t l, int32_t i, const int32_t *slots, int32_t n,
                      uint8_t *host, bool to_host) {
    lethe_backend *be = pool->p.be;
    const size_t sb = pool->layout[l].planes[i].slot_bytes;
    uint8_t *buf = pool->plane[(size_t)l * LETHE_KV_MAX_PLANES + i];
    if (be->ops->caps & LETHE_BE_HOST_MEMORY) { /* plain host memory: no transfer op */
        for (int32_t k = 0; k < n; k++) {
            uint8_t *dev = buf + (size_t)slots[k] * sb;
            if (to_host) memcpy(host + (size_t)k * sb, dev, sb);
            else memcpy(dev, host + (size_t)k * sb, sb);
        }
    } else if (to_host) {
        be->ops->rows_to_host(be, host, buf, sb, slots, n);
    } else {
        be->ops->rows_from_host(be, buf, sb, slots, n, host);
    }
}

/* the copy statistics: the copies are synchronous, so the wall time since t0
 * is transfer time */
static void count_copy(lethe_kv_pool *pool, size_t bytes, double t0, bool to_host) {
    const double dt = lethe_time_s() - t0;
    if (to_host) {
        pool->host_saved_bytes += (int64_t)bytes;
        pool->host_save_s += dt;
    } else {
        pool->host_loaded_bytes += (int64_t)bytes;
        pool->host_load_s += dt;
    }
}

static void copy_space(lethe_kv_pool *pool, int32_t sp, const int32_t *slots, int32_t n, uint8_t *host,
                       bool to_host) {
    LETHE_ASSERT(lethe_kv_host_copy_check(pool) == LETHE_OK && n >= 0);
    const double t0 = lethe_time_s();
    for (int32_t k = 0; k < n; k++)
        LETHE_ASSERT(slots[k] >= 0 && slots[k] < pool->p.n_slots && pool->spaces[sp].ref[slots[k]] > 0);
    size_t off = 0;
    for (int32_t l = first_layer(pool, sp); l < end_layer(pool, sp); l++)
        for (int32_t i = 0; i < pool->layout[l].n_planes; i++) {
            copy_rows(pool, l, i, slots, n, host + off, to_host);
            off += (size_t)n * pool->layout[l].planes[i].slot_bytes;
        }
    count_copy(pool, off, t0, to_host);
}

void lethe_kv_host_copy_stats(const lethe_kv_pool *pool, lethe_kv_host_copies *out) {
    *out = (lethe_kv_host_copies){.saved_bytes = pool->host_saved_bytes,
                                  .loaded_bytes = pool->host_loaded_bytes,
                                  .save_s = pool->host_save_s,
                                  .load_s = pool->host_load_s};
}

void lethe_kv_slots_save(lethe_kv_pool *pool, int32_t sp, const int32_t *slots, int32_t n, void *dst) {
    copy_space(pool, sp, slots, n, dst, true);
}

void lethe_kv_slots_load(lethe_kv_pool *pool, int32_t sp, const int32_t *slots, int32_t n, const void *src) {
    copy_space(pool, sp, slots, n, (uint8_t *)src, false);
}

size_t lethe_kv_state_host_bytes(const lethe_kv_pool *pool) {
    return (size_t)pool->p.n_state_layers * (pool->p.state_k_bytes + pool->p.state_v_bytes);
}

/* one state row of buf (row_bytes each) <-> host[row_bytes] */
static void copy_state_row(lethe_kv_pool *pool, void *buf, size_t row_bytes, int32_t slot, uint8_t *host,
                           bool to_host) {
    lethe_backend *be = pool->p.be;
    uint8_t *dev = (uint8_t *)buf + (size_t)slot * row_bytes;
    if (be->ops->caps & LETHE_BE_HOST_MEMORY) {
        if (to_host) memcpy(host, dev, row_bytes);
        else memcpy(dev, host, row_bytes);
    } else if (to_host) {
        be->ops->rows_to_host(be, host, buf, row_bytes, &slot, 1);
    } else {
        be->ops->rows_from_host(be, buf, row_bytes, &slot, 1, host);
    }
}

static void copy_state(lethe_kv_pool *pool, int32_t slot, uint8_t *host, bool to_host) {
    LETHE_ASSERT(lethe_kv_has_states(pool) && lethe_kv_host_copy_check(pool) == LETHE_OK);
    LETHE_ASSERT(slot >= 0 && slot < pool->p.n_state_slots);
    const double t0 = lethe_time_s();
    size_t off = 0;
    for (int32_t i = 0; i < pool->p.n_state_layers; i++) {
        copy_state_row(pool, pool->state_k[i], pool->p.state_k_bytes, slot, host + off, to_host);
        off += pool->p.state_k_bytes;
        copy_state_row(pool, pool->state_v[i], pool->p.state_v_bytes, slot, host + off, to_host);
        off += pool->p.state_v_bytes;
    }
    count_copy(pool, off, t0, to_host);
}

void lethe_kv_state_save(lethe_kv_pool *pool, int32_t slot, void *dst) { copy_state(pool, slot, dst, true); }

void lethe_kv_state_load(lethe_kv_pool *pool, int32_t slot, const void *src) {
    copy_state(pool, slot, (uint8_t *)src, false);
}

bool lethe_kv_slots_take(lethe_kv_pool *pool, int32_t sp, int32_t n, int32_t *out) {
    kv_space *s = &pool->spaces[sp];
    if (n < 0 || s->n_free < n) return false;
    for (int32_t k = 0; k < n; k++) {
        const int32_t slot = s->free_stack[--s->n_free];
        LETHE_ASSERT(s->ref[slot] == 0);
        s->ref[slot] = 1;
        out[k] = slot;
    }
    return true;
}

/* host_tier.h - the host-memory tier under the KV pool: opaque blobs, each
 * with a size, under (owner, key), least recently used first out when the
 * byte cap (--host-cache-bytes) would be exceeded.
 *
 * What goes in is the owner's business: the radix trees (radix.c) put a
 * block they evict from the pool (its header and its slots' payload, the
 * same bytes the pool held) and take it back when a later prompt matches it,
 * so a hit after demotion is restored instead of recomputed and bit-identical
 * to a hit that never left the pool. Other users (a hybrid model's recurrent
 * state snapshots, say) use their own owner tag, so keys never collide; all
 * share the one byte cap and the one LRU order.
 *
 * Exclusive with the pool: a promoted blob leaves the tier (take). Blobs are
 * plain heap memory (copies to and from the device go through the backend's
 * own pinned staging, backend.h rows_to_host / rows_from_host).
 *
 * Thread-safe (one mutex): the engine thread puts and takes, the server's
 * metrics read the stats. */
#ifndef LETHE_HOST_TIER_H
#define LETHE_HOST_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    LETHE_HOST_TIER_RADIX = 1, /* radix prefix-cache blocks (radix.c): key = block hash */
    LETHE_HOST_TIER_CHAIN = 2, /* idle chains' private KV (chain_cache.c): key = the payload's address */
};

typedef struct lethe_host_tier lethe_host_tier;

typedef struct lethe_host_tier_stats {
    size_t cap_bytes, used_bytes;
    int64_t entries;
    int64_t puts, refused;      /* blobs stored / refused (larger than the cap) */
    int64_t hits, misses;       /* take found / did not find the key */
    int64_t evictions;          /* blobs dropped for room (LRU) */
    int64_t bytes_in, bytes_out; /* put / taken back, cumulative */
} lethe_host_tier_stats;

lethe_host_tier *lethe_host_tier_create(size_t cap_bytes); /* cap_bytes > 0 */
void lethe_host_tier_destroy(lethe_host_tier *t);            /* frees every blob; NULL-safe */

/* Stores blob[0..n) (malloc'd; the tier owns it from now on) under (owner,
 * key), replacing an entry with the same key, after dropping least recently
 * used entries until it fits. A blob larger than the cap is freed and
 * refused (false). */
bool lethe_host_tier_put(lethe_host_tier *t, uint32_t owner, uint64_t key, void *blob, size_t n);
/* Removes the entry and hands its blob over (the caller frees it); NULL
 * when absent. */
void *lethe_host_tier_take(lethe_host_tier *t, uint32_t owner, uint64_t key, size_t *n);
/* Copies up to cap bytes of the entry from its start into dst without
 * changing the LRU order; returns the blob's size, 0 when absent. */
size_t lethe_host_tier_read(lethe_host_tier *t, uint32_t owner, uint64_t key, void *dst, size_t cap);
/* Drops the entry (false when absent). */
bool lethe_host_tier_drop(lethe_host_tier *t, uint32_t owner, uint64_t key);
/* The keys of an owner's entries (copies up to cap); returns how many there are. */
int64_t lethe_host_tier_keys(lethe_host_tier *t, uint32_t owner, uint64_t *out, int64_t cap);
void lethe_host_tier_get_stats(lethe_host_tier *t, lethe_host_tier_stats *out);
/* Invariants: the LRU list, the table and the byte count agree, used <= cap. */
bool lethe_host_tier_check(lethe_host_tier *t);

#endif /* LETHE_HOST_TIER_H */

/* radix.h - block-level prefix cache over the token-slot KV pool.
 *
 * Prompts are cut into full blocks of LETHE_RADIX_BLOCK (16) tokens. A block
 * is identified by a hash chain: id = H(tokens, seed = parent id, or the
 * engine fingerprint for the first block), so equal ids mean equal prefixes
 * up to that block (ids are verified against stored tokens and the parent
 * pointer, so a 64-bit collision can never attach wrong KV). The blocks form
 * a tree (a radix tree at block granularity): each block knows its parent and
 * how many children it has.
 *
 * A block holds one reference on each of its slots: 16 slots per slot space
 * (in the per-layer layout one slot per layer per token). Requests that use a
 * block hold a request reference (req_ref) on it and every ancestor. Blocks
 * with req_ref == 0 are "unreferenced": their slots are held by the cache
 * alone, so evicting them frees block-size slots in every slot space.
 * Eviction takes least-recently-used unreferenced LEAVES first (a block with
 * children is never evicted before them), under memory pressure only.
 *
 * Life of a block: lethe_radix_match() finds the longest cached prefix (read
 * only); lethe_radix_acquire() attaches it to a request row (shared slots,
 * req_ref++); after the step that computed a new full block
 * lethe_radix_insert() is called with the row's slots, which publishes it (or
 * finds that another request published the same content first); when the
 * request ends or is preempted lethe_radix_release() drops its req_refs.
 * radix_cache.c makes these calls: the tree as a prefix cache
 * (prefix_cache.h). */
#ifndef LETHE_RADIX_H
#define LETHE_RADIX_H

#include <stdbool.h>
#include <stdint.h>

#include "kv/kv_pool.h"

#define LETHE_RADIX_BLOCK 16

typedef struct lethe_radix lethe_radix;
typedef struct lethe_radix_block lethe_radix_block;

/* fingerprint: covers everything that changes KV content for the same tokens
 * (model, method and its knobs, block size); folded into the first block. */
lethe_radix *lethe_radix_create(lethe_kv_pool *pool, uint64_t fingerprint);
void lethe_radix_destroy(lethe_radix *r); /* returns every block's slots; NULL-safe */

/* Longest cached prefix of tokens[0..n) in full blocks, capped so that at
 * least one token is left to compute: at most floor((n - 1) / 16) blocks.
 * Writes the chain into out[] (root first) and returns its length. Read-only. */
int32_t lethe_radix_match(const lethe_radix *r, const int32_t *tokens, int32_t n,
                          lethe_radix_block **out, int32_t max_blocks);

/* Slots per slot space that evicting every unreferenced block would free
 * (their resident slots). */
int64_t lethe_radix_reclaimable(const lethe_radix *r);
/* Of the chain blocks[0..n), how many are unreferenced now (acquiring them
 * makes their slots non-reclaimable: the scheduler subtracts this). */
int32_t lethe_radix_count_unreferenced(lethe_radix_block *const *blocks, int32_t n);

/* Takes request references on blocks[0..n) (a chain from the root) and
 * appends their resident slots to `row` at their logical positions in [0, n *
 * 16) (the row must be empty). */
void lethe_radix_acquire(lethe_radix *r, lethe_radix_block *const *blocks, int32_t n, int32_t row);
/* Drops request references (any order). */
void lethe_radix_release(lethe_radix *r, lethe_radix_block *const *blocks, int32_t n);

/* Publishes the block after `parent` (NULL = first block) with tokens[16]
 * whose KV sits in row entries [first, first + 16) of `row` (every slot
 * space). Returns the block (new, or the existing one with the same content)
 * with one request reference taken for the caller. */
lethe_radix_block *lethe_radix_insert(lethe_radix *r, lethe_radix_block *parent,
                                      const int32_t *tokens, int32_t row, int32_t first);

/* Evicts LRU unreferenced leaves until every slot space has at least
 * `want_free` free slots or nothing is left to evict. Returns blocks evicted. */
int32_t lethe_radix_evict(lethe_radix *r, int32_t want_free);

/* Resident slots per space of the unreferenced blocks among blocks[0..n). */
int64_t lethe_radix_unreferenced_slots(lethe_radix_block *const *blocks, int32_t n);
/* Row entries blocks[0..n) occupy once attached: 16 each, fewer when pruned. */
int32_t lethe_radix_resident_tokens(lethe_radix_block *const *blocks, int32_t n);

/* ---- control (the engine thread; prefix-cache control and pruning) ----
 * A pruned block keeps its id, tokens and place in the tree (so the logical
 * prefix still matches) but only `resident` of its 16 slots, at `offsets`
 * inside the block; acquire attaches just those at their logical positions. */
typedef struct lethe_radix_block_info {
    uint64_t hash, parent_hash; /* parent_hash 0 for a first block */
    int32_t depth;              /* tokens [16 depth, 16 depth + 16) of the prefix */
    int32_t resident;           /* slots it holds per space (16 unless pruned) */
    int32_t req_refs, n_children;
    int32_t priority;  /* lower evicted first; < 0 pinned */
    uint32_t prune_id; /* 0: never pruned */
    uint32_t pin;      /* bit o: token o retention-pinned (a publishing row protected it) */
    uint8_t offsets[LETHE_RADIX_BLOCK]; /* [resident] */
} lethe_radix_block_info;
void lethe_radix_block_get_info(const lethe_radix_block *b, lethe_radix_block_info *out);
void lethe_radix_for_each_block(const lethe_radix *r, void (*fn)(void *, const lethe_radix_block *),
                                void *ctx);
/* The block ending the chain tokens[0 .. 16 n_blocks) (the chain in chain[]
 * when non-NULL), or NULL when some block of it is not cached. */
lethe_radix_block *lethe_radix_find(const lethe_radix *r, const int32_t *tokens, int32_t n_blocks,
                                    lethe_radix_block **chain);
/* Eviction priority: unreferenced leaves go lowest priority first, LRU among
 * equals; a negative priority pins the block (never evicted, not counted as
 * reclaimable). Pins are closed under ancestors: pinning a block pins its
 * unpinned ancestors (with the same priority), unpinning one unpins every
 * pinned block below it. */
void lethe_radix_set_priority(lethe_radix *r, lethe_radix_block *b, int32_t priority);
/* Deletes b and every block below it, leaves first, freeing their slots.
 * Returns the number deleted, or -1 (nothing deleted) when a request holds
 * one of them. */
int32_t lethe_radix_delete_subtree(lethe_radix *r, lethe_radix_block *b);
/* Keeps the resident tokens whose offset o has keep[o] and frees the others'
 * slots in every space (the block must be unreferenced; pinned tokens must be
 * kept). Returns the slots freed per space. */
int32_t lethe_radix_prune_block(lethe_radix *r, lethe_radix_block *b,
                                const bool keep[LETHE_RADIX_BLOCK], uint32_t prune_id);
/* Request references without a row (a prune job's scoring pass holds its
 * prefix with these); dropped with lethe_radix_release. */
void lethe_radix_acquire_refs(lethe_radix *r, lethe_radix_block *const *blocks, int32_t n);

/* ---- host tier (host_tier.h) ----
 * With a tier, blocks evicted under memory pressure are demoted (header +
 * their slots' payload) instead of dropped; deletion drops them and their
 * demoted descendants. The pool must pass lethe_kv_host_copy_check.
 * A block's state snapshot (hybrid models, below) goes with it: its states
 * follow the KV payload in the blob (lethe_kv_state_save), so the tier's
 * byte cap and LRU order cover both, and promotion restores it into a fresh
 * snapshot slot (the least recently used snapshot makes room). */
typedef struct lethe_host_tier lethe_host_tier;
void lethe_radix_set_host_tier(lethe_radix *r, lethe_host_tier *t); /* NULL: none */
/* After a match blocks[0..n_dev) of tokens[0..n): how many of the next
 * blocks the tier holds, consecutively (n_dev + result <= max_blocks and <=
 * floor((n - 1) / 16)); *resident = their resident slots per space. Read-only. */
int32_t lethe_radix_match_host(const lethe_radix *r, const int32_t *tokens, int32_t n,
                               lethe_radix_block *const *blocks, int32_t n_dev, int32_t max_blocks,
                               int32_t *resident);
/* The same for a hybrid model, whose hits need a snapshot: the next host
 * blocks up to and including the deepest one that carries a snapshot (0
 * when none does), *resident their slots; *n_seen = every consecutive host
 * block (for the recomputed-token count). Read-only. */
int32_t lethe_radix_match_host_snap(const lethe_radix *r, const int32_t *tokens, int32_t n,
                                    lethe_radix_block *const *blocks, int32_t n_dev, int32_t max_blocks,
                                    int32_t *resident, int32_t *n_seen);
/* Restores those n_host blocks from the tier into fresh slots (evicting
 * other unreferenced blocks for room: the caller counted their slots as
 * needed), back in the tree as unreferenced blocks at blocks[n_dev ..];
 * returns how many were restored (n_host unless the pool had no room). */
int32_t lethe_radix_promote(lethe_radix *r, const int32_t *tokens, lethe_radix_block **blocks,
                            int32_t n_dev, int32_t n_host);
/* cumulative: blocks demoted, blocks promoted, tokens they cover */
void lethe_radix_host_counts(const lethe_radix *r, int64_t *demoted, int64_t *promoted,
                             int64_t *promoted_tokens);
/* cumulative: state snapshots demoted with their blocks, restored with them */
void lethe_radix_host_snapshot_counts(const lethe_radix *r, int64_t *demoted, int64_t *restored);

/* ---- state snapshots (hybrid models: kv_pool.h "per-request states") ----
 * A block may hold a snapshot: one state slot held from the pool
 * (lethe_kv_state_take) with every linear-attention layer's recurrent and
 * conv state after the block's last token, copied from the row that computed
 * it. At most max_snaps are held (the engine sized the state pool for them);
 * taking one past the cap first drops the least recently used (taken or
 * resumed from). A snapshot goes with its block (eviction, deletion,
 * destroy); demotion to the host tier drops it. */
void lethe_radix_set_snapshots(lethe_radix *r, int32_t max_snaps); /* before any is taken */
int32_t lethe_radix_max_snapshots(const lethe_radix *r);
int32_t lethe_radix_n_snapshots(const lethe_radix *r);
/* b's snapshot state slot, -1 when it has none */
int32_t lethe_radix_block_snapshot(const lethe_radix_block *b);
/* state slot `state` (a row's, after b's last token) becomes b's snapshot;
 * a block that already has one keeps it (equal content). False when
 * snapshots are off (max_snaps 0). */
bool lethe_radix_snapshot(lethe_radix *r, lethe_radix_block *b, int32_t state);
/* state slot `state` := b's snapshot (b must have one) */
void lethe_radix_snapshot_restore(lethe_radix *r, lethe_radix_block *b, int32_t state);
/* cumulative: snapshots taken, dropped for room (LRU), resumed from */
void lethe_radix_snapshot_counts(const lethe_radix *r, int64_t *taken, int64_t *evicted,
                                 int64_t *hits);

int32_t lethe_radix_n_blocks(const lethe_radix *r);
int32_t lethe_radix_n_unreferenced(const lethe_radix *r);
uint64_t lethe_radix_block_hash(const lethe_radix_block *b);
int32_t lethe_radix_block_req_refs(const lethe_radix_block *b);

/* A holder for lethe_kv_check(): enumerates the slot references of all
 * blocks and the state slots of their snapshots. */
lethe_kv_holder lethe_radix_holder(lethe_radix *r);
/* The cache's own invariants (tree links, child counts, req_refs of
 * ancestors >= descendants, unreferenced blocks own their slots alone,
 * snapshots listed once each on live blocks, at most max_snaps). */
lethe_status lethe_radix_check(const lethe_radix *r);

#endif /* LETHE_RADIX_H */

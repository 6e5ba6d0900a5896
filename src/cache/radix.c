/* radix.c - block-level prefix cache: hash-chained 16-token blocks in a tree,
 * reference-counted shared slots, LRU eviction of unreferenced leaves.
 *
 * Data structures:
 *  - blocks live in an id table (blocks[id]); ids are recycled, and a
 *    generation number per id makes stale heap entries detectable;
 *  - a chained hash table maps block hash -> blocks (verified by parent
 *    pointer and tokens, so collisions cannot return wrong KV);
 *  - a binary min-heap of (last_access, id, gen) candidates for eviction
 *    with lazy deletion: an entry is acted on only if the block is still
 *    alive, still an unreferenced leaf and was not touched since the push.
 * last_access is a logical clock bumped when a request acquires or releases
 * a block, so "least recently used" means least recently held by a request.
 *
 * Host tier (lethe_radix_set_host_tier): an evicted block is demoted instead
 * of dropped: its header (hash, parent hash, depth, tokens, resident offsets,
 * pins, prune id) and its slots' payload (kv_host.c) become one blob keyed by
 * the block hash. A later match continues past the cached chain through the
 * tier (the next block's hash is computable from its parent's and its
 * tokens, then verified against the header), and promotion restores those
 * blocks into fresh slots, bit for bit, before the request attaches them. The
 * tier is exclusive: a promoted blob leaves it. LRU spans both tiers: the
 * pool's least recently used leaf goes to the host, the host's least
 * recently used blob is dropped. Deleting a subtree drops its demoted
 * descendants too. A block's state snapshot (hybrid models) rides in its
 * blob after the payload (host_hdr.snap) and is restored with it into a
 * fresh snapshot slot. */
#include "cache/radix.h"

#include <stdlib.h>
#include <string.h>

#include "cache/host_tier.h"
#include "core/util.h"

struct lethe_radix_block {
    uint64_t hash;
    lethe_radix_block *parent;
    lethe_radix_block *hnext;   /* hash bucket chain */
    uint64_t last_access;
    int32_t id;
    uint32_t gen;
    int32_t req_ref;
    int32_t n_children;
    int32_t depth;              /* 0 for a first block */
    int32_t priority;  /* eviction priority: lower goes first; < 0 = pinned, never evicted */
    int32_t n_res;     /* resident tokens: 16, fewer once pruned */
    uint32_t prune_id; /* the prune job that shrank it (0: never pruned) */
    uint32_t pin;      /* bit o: token o is retention-pinned (pruning keeps it) */
    int32_t snap;      /* state snapshot after its last token: a held state slot, -1 none */
    uint64_t snap_access; /* the snapshot's LRU stamp (taken, or resumed from) */
    int32_t tokens[LETHE_RADIX_BLOCK];
    uint8_t offs[LETHE_RADIX_BLOCK]; /* offsets in the block of the resident tokens, ascending */
    int32_t slots[]; /* [n_spaces][LETHE_RADIX_BLOCK], the first n_res of each used */
};

typedef struct heap_ent {
    uint64_t key; /* last_access when pushed */
    int32_t prio; /* priority when pushed: lower priorities go first */
    int32_t id;
    uint32_t gen;
} heap_ent;

struct lethe_radix {
    lethe_kv_pool *pool;
    int32_t n_spaces;
    uint64_t fingerprint;
    uint64_t clock;
    /* id table */
    lethe_radix_block **blocks;
    uint32_t *gens;             /* generation per id (survives the block) */
    int32_t cap_ids, n_ids_used;
    int32_t *free_ids;
    int32_t n_free_ids;
    int32_t n_blocks, n_unref;
    int64_t unref_slots;        /* resident slots (per space) of unreferenced blocks */
    int64_t pinned_unref_slots; /* of those, in pinned blocks (never evicted: not reclaimable) */
    /* hash table */
    lethe_radix_block **buckets;
    uint64_t n_buckets;         /* power of two */
    /* eviction heap */
    heap_ent *heap;
    int32_t heap_len, heap_cap;
    /* host tier (NULL: evicted blocks are dropped) */
    lethe_host_tier *tier;
    int64_t n_demoted, n_promoted, promoted_tokens;
    /* state snapshots (hybrid models): the blocks holding one, at most max_snaps */
    lethe_radix_block **snaps;
    int32_t n_snaps, max_snaps;
    int64_t n_snap_taken, n_snap_evicted, n_snap_hits;
    int64_t n_snap_demoted, n_snap_restored; /* with their blocks, to / from the host tier */
};

/* a demoted block's header; its payload follows: per slot space the host
 * image of its n_res slots (kv_host.c) */
typedef struct host_hdr {
    uint64_t hash, parent_hash; /* parent_hash 0 for a first block */
    int32_t depth, n_res, priority;
    uint32_t pin, prune_id;
    int32_t snap; /* 1: the block's state snapshot follows the KV payload (kv_pool.h host image) */
    int32_t tokens[LETHE_RADIX_BLOCK];
    uint8_t offs[LETHE_RADIX_BLOCK];
} host_hdr;

static uint64_t block_hash(uint64_t seed, const int32_t *tokens) {
    return lethe_hash64(tokens, sizeof(int32_t) * LETHE_RADIX_BLOCK, seed);
}

lethe_radix *lethe_radix_create(lethe_kv_pool *pool, uint64_t fingerprint) {
    lethe_radix *r = lethe_xcalloc(1, sizeof(*r));
    r->pool = pool;
    r->n_spaces = lethe_kv_n_spaces(pool);
    r->fingerprint = fingerprint;
    r->n_buckets = 1024;
    r->buckets = lethe_xcalloc(r->n_buckets, sizeof(*r->buckets));
    return r;
}

static void snap_drop(lethe_radix *r, lethe_radix_block *b);

/* the block's slot references and its snapshot go back to the pool */
static void block_free_slots(lethe_radix *r, lethe_radix_block *b) {
    for (int32_t sp = 0; sp < r->n_spaces; sp++)
        for (int32_t i = 0; i < b->n_res; i++)
            lethe_kv_unref(r->pool, sp, b->slots[sp * LETHE_RADIX_BLOCK + i]);
    if (b->snap >= 0) snap_drop(r, b);
}

void lethe_radix_destroy(lethe_radix *r) {
    if (!r) return;
    for (int32_t id = 0; id < r->n_ids_used; id++) {
        if (!r->blocks[id]) continue;
        block_free_slots(r, r->blocks[id]);
        free(r->blocks[id]);
    }
    free(r->blocks);
    free(r->gens);
    free(r->free_ids);
    free(r->buckets);
    free(r->heap);
    free(r->snaps);
    free(r);
}

/* ---- hash table ---- */

static lethe_radix_block *lookup(const lethe_radix *r, uint64_t h, const lethe_radix_block *parent,
                                 const int32_t *tokens) {
    for (lethe_radix_block *b = r->buckets[h & (r->n_buckets - 1)]; b; b = b->hnext)
        if (b->hash == h && b->parent == parent &&
            !memcmp(b->tokens, tokens, sizeof(b->tokens)))
            return b;
    return NULL;
}

static void table_insert(lethe_radix *r, lethe_radix_block *b) {
    if ((uint64_t)r->n_blocks + 1 > r->n_buckets) {
        uint64_t nb = r->n_buckets * 2;
        lethe_radix_block **nbk = lethe_xcalloc(nb, sizeof(*nbk));
        for (uint64_t i = 0; i < r->n_buckets; i++) {
            lethe_radix_block *x = r->buckets[i];
            while (x) {
                lethe_radix_block *next = x->hnext;
                x->hnext = nbk[x->hash & (nb - 1)];
                nbk[x->hash & (nb - 1)] = x;
                x = next;
            }
        }
        free(r->buckets);
        r->buckets = nbk;
        r->n_buckets = nb;
    }
    lethe_radix_block **head = &r->buckets[b->hash & (r->n_buckets - 1)];
    b->hnext = *head;
    *head = b;
}

static void table_remove(lethe_radix *r, lethe_radix_block *b) {
    lethe_radix_block **p = &r->buckets[b->hash & (r->n_buckets - 1)];
    while (*p && *p != b) p = &(*p)->hnext;
    LETHE_ASSERT(*p == b);
    *p = b->hnext;
}

/* ---- eviction heap ---- */

static bool ent_less(heap_ent a, heap_ent b) {
    if (a.prio != b.prio) return a.prio < b.prio;
    return a.key != b.key ? a.key < b.key : a.id < b.id;
}

static void heap_push(lethe_radix *r, const lethe_radix_block *b) {
    if (r->heap_len == r->heap_cap) {
        r->heap_cap = r->heap_cap ? r->heap_cap * 2 : 256;
        r->heap = lethe_xrealloc(r->heap, (size_t)r->heap_cap * sizeof(heap_ent));
    }
    heap_ent e = {b->last_access, b->priority, b->id, b->gen};
    int32_t i = r->heap_len++;
    while (i > 0) {
        int32_t p = (i - 1) / 2;
        if (!ent_less(e, r->heap[p])) break;
        r->heap[i] = r->heap[p];
        i = p;
    }
    r->heap[i] = e;
}

static void heap_sift_down(lethe_radix *r, int32_t i) {
    heap_ent e = r->heap[i];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= r->heap_len) break;
        if (c + 1 < r->heap_len && ent_less(r->heap[c + 1], r->heap[c])) c++;
        if (!ent_less(r->heap[c], e)) break;
        r->heap[i] = r->heap[c];
        i = c;
    }
    r->heap[i] = e;
}

static heap_ent heap_pop(lethe_radix *r) {
    heap_ent top = r->heap[0];
    r->heap[0] = r->heap[--r->heap_len];
    if (r->heap_len > 0) heap_sift_down(r, 0);
    return top;
}

static bool evictable(const lethe_radix_block *b) {
    return b->req_ref == 0 && b->n_children == 0 && b->priority >= 0;
}

/* the block an entry names, if the entry is still current */
static lethe_radix_block *ent_block(const lethe_radix *r, heap_ent e) {
    if (e.id < 0 || e.id >= r->n_ids_used) return NULL;
    lethe_radix_block *b = r->blocks[e.id];
    if (!b || b->gen != e.gen || !evictable(b) || b->last_access != e.key || b->priority != e.prio)
        return NULL;
    return b;
}

/* drops stale entries when they outnumber live blocks (keeps memory bounded) */
static void heap_compact(lethe_radix *r) {
    if (r->heap_len <= 2 * r->n_blocks + 1024) return;
    int32_t n = 0;
    for (int32_t i = 0; i < r->heap_len; i++)
        if (ent_block(r, r->heap[i])) r->heap[n++] = r->heap[i];
    r->heap_len = n;
    for (int32_t i = n / 2 - 1; i >= 0; i--) heap_sift_down(r, i);
}

/* ---- queries ---- */

int32_t lethe_radix_match(const lethe_radix *r, const int32_t *tokens, int32_t n,
                          lethe_radix_block **out, int32_t max_blocks) {
    if (n <= 0) return 0;
    int32_t limit = LETHE_MIN((n - 1) / LETHE_RADIX_BLOCK, max_blocks);
    lethe_radix_block *parent = NULL;
    int32_t k = 0;
    for (; k < limit; k++) {
        const int32_t *t = tokens + (size_t)k * LETHE_RADIX_BLOCK;
        uint64_t h = block_hash(parent ? parent->hash : r->fingerprint, t);
        lethe_radix_block *b = lookup(r, h, parent, t);
        if (!b) break;
        out[k] = b;
        parent = b;
    }
    return k;
}

int64_t lethe_radix_reclaimable(const lethe_radix *r) {
    return r->unref_slots - r->pinned_unref_slots;
}

int32_t lethe_radix_count_unreferenced(lethe_radix_block *const *blocks, int32_t n) {
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++) c += blocks[i]->req_ref == 0;
    return c;
}

int64_t lethe_radix_unreferenced_slots(lethe_radix_block *const *blocks, int32_t n) {
    int64_t c = 0;
    for (int32_t i = 0; i < n; i++)
        if (blocks[i]->req_ref == 0) c += blocks[i]->n_res;
    return c;
}

int32_t lethe_radix_resident_tokens(lethe_radix_block *const *blocks, int32_t n) {
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++) c += blocks[i]->n_res;
    return c;
}

/* one more / one fewer request reference, keeping the unreferenced counters */
static void ref_up(lethe_radix *r, lethe_radix_block *b) {
    if (b->req_ref++ == 0) {
        r->n_unref--;
        r->unref_slots -= b->n_res;
        if (b->priority < 0) r->pinned_unref_slots -= b->n_res;
    }
}

static void ref_down(lethe_radix *r, lethe_radix_block *b) {
    LETHE_ASSERT(b->req_ref > 0);
    if (--b->req_ref == 0) {
        r->n_unref++;
        r->unref_slots += b->n_res;
        if (b->priority < 0) r->pinned_unref_slots += b->n_res;
        if (b->n_children == 0 && b->priority >= 0) heap_push(r, b);
    }
}

void lethe_radix_acquire(lethe_radix *r, lethe_radix_block *const *blocks, int32_t n, int32_t row) {
    if (n <= 0) return;
    LETHE_ASSERT(lethe_kv_row_len(r->pool, 0, row) == 0);
    /* only the resident tokens of pruned blocks, at their logical positions */
    const size_t nt = (size_t)lethe_radix_resident_tokens(blocks, n);
    int32_t *slots = lethe_xmalloc(LETHE_MAX(nt, 1) * (size_t)r->n_spaces * sizeof(int32_t));
    int32_t *pos = lethe_xmalloc(LETHE_MAX(nt, 1) * sizeof(int32_t));
    uint64_t now = ++r->clock;
    size_t at = 0;
    for (int32_t k = 0; k < n; k++) {
        lethe_radix_block *b = blocks[k];
        LETHE_ASSERT(b->depth == k && (k == 0 ? b->parent == NULL : b->parent == blocks[k - 1]));
        ref_up(r, b);
        b->last_access = now;
        for (int32_t sp = 0; sp < r->n_spaces; sp++)
            memcpy(slots + (size_t)sp * nt + at, b->slots + sp * LETHE_RADIX_BLOCK,
                   (size_t)b->n_res * sizeof(int32_t));
        for (int32_t i = 0; i < b->n_res; i++) pos[at + i] = k * LETHE_RADIX_BLOCK + b->offs[i];
        at += (size_t)b->n_res;
    }
    if (nt > 0) lethe_kv_row_attach(r->pool, row, slots, pos, (int32_t)nt);
    free(slots);
    free(pos);
}

void lethe_radix_release(lethe_radix *r, lethe_radix_block *const *blocks, int32_t n) {
    uint64_t now = ++r->clock;
    for (int32_t k = 0; k < n; k++) {
        lethe_radix_block *b = blocks[k];
        b->last_access = now;
        ref_down(r, b);
    }
    heap_compact(r);
}

static lethe_radix_block *block_new(lethe_radix *r, lethe_radix_block *parent, uint64_t h,
                                    const int32_t *tokens);

lethe_radix_block *lethe_radix_insert(lethe_radix *r, lethe_radix_block *parent,
                                      const int32_t *tokens, int32_t row, int32_t first) {
    uint64_t h = block_hash(parent ? parent->hash : r->fingerprint, tokens);
    lethe_radix_block *b = lookup(r, h, parent, tokens);
    uint64_t now = ++r->clock;
    uint32_t pin = 0; /* the row's protected positions inside this block */
    for (int32_t i = 0; i < LETHE_RADIX_BLOCK; i++)
        if (lethe_kv_pos_protected(r->pool, row,
                                   (parent ? parent->depth + 1 : 0) * LETHE_RADIX_BLOCK + i))
            pin |= 1u << i;
    if (b) {
        ref_up(r, b);
        b->last_access = now;
        b->pin |= pin; /* pins are hints about content: any request's count */
        return b;
    }
    b = block_new(r, parent, h, tokens);
    b->req_ref = 1;
    b->last_access = now;
    b->n_res = LETHE_RADIX_BLOCK;
    b->pin = pin;
    for (int32_t i = 0; i < LETHE_RADIX_BLOCK; i++) b->offs[i] = (uint8_t)i;
    for (int32_t sp = 0; sp < r->n_spaces; sp++) {
        LETHE_ASSERT(lethe_kv_row_len(r->pool, sp, row) >= first + LETHE_RADIX_BLOCK);
        const int32_t *rs = lethe_kv_row_slots(r->pool, sp, row);
        const int32_t *rp = lethe_kv_row_pos(r->pool, sp, row);
        for (int32_t i = 0; i < LETHE_RADIX_BLOCK; i++) {
            /* a block is only published from an uncompacted row: entry == position */
            LETHE_ASSERT(rp[first + i] == b->depth * LETHE_RADIX_BLOCK + i);
            b->slots[sp * LETHE_RADIX_BLOCK + i] = rs[first + i];
            lethe_kv_ref(r->pool, sp, rs[first + i]);
        }
    }
    return b;
}

/* a new block in the tree after `parent` with no slots and no references */
static lethe_radix_block *block_new(lethe_radix *r, lethe_radix_block *parent, uint64_t h,
                                    const int32_t *tokens) {
    lethe_radix_block *b =
        lethe_xcalloc(1, sizeof(*b) + sizeof(int32_t) * (size_t)r->n_spaces * LETHE_RADIX_BLOCK);
    b->hash = h;
    b->parent = parent;
    b->depth = parent ? parent->depth + 1 : 0;
    b->snap = -1;
    memcpy(b->tokens, tokens, sizeof(b->tokens));
    if (parent) parent->n_children++;
    /* id */
    if (r->n_free_ids > 0) {
        b->id = r->free_ids[--r->n_free_ids];
    } else {
        if (r->n_ids_used == r->cap_ids) {
            r->cap_ids = r->cap_ids ? r->cap_ids * 2 : 256;
            r->blocks = lethe_xrealloc(r->blocks, (size_t)r->cap_ids * sizeof(*r->blocks));
            r->gens = lethe_xrealloc(r->gens, (size_t)r->cap_ids * sizeof(*r->gens));
            r->free_ids = lethe_xrealloc(r->free_ids, (size_t)r->cap_ids * sizeof(*r->free_ids));
        }
        b->id = r->n_ids_used++;
        r->gens[b->id] = 0;
    }
    b->gen = ++r->gens[b->id];
    r->blocks[b->id] = b;
    r->n_blocks++;
    table_insert(r, b);
    return b;
}

/* ---- host tier ---- */

static size_t payload_bytes(const lethe_radix *r, int32_t n_res) {
    size_t n = 0;
    for (int32_t sp = 0; sp < r->n_spaces; sp++) n += (size_t)n_res * lethe_kv_space_slot_bytes(r->pool, sp);
    return n;
}

/* a demoted block's blob: header, KV payload, its snapshot's states */
static size_t blob_bytes(const lethe_radix *r, const host_hdr *h) {
    return sizeof(*h) + payload_bytes(r, h->n_res) + (h->snap ? lethe_kv_state_host_bytes(r->pool) : 0);
}

/* copies b (header + slots' payload + its snapshot) into the host tier */
static void demote(lethe_radix *r, const lethe_radix_block *b) {
    host_hdr h = {.hash = b->hash,
                  .parent_hash = b->parent ? b->parent->hash : 0,
                  .depth = b->depth,
                  .n_res = b->n_res,
                  .priority = b->priority,
                  .pin = b->pin,
                  .prune_id = b->prune_id,
                  .snap = b->snap >= 0};
    const size_t n = blob_bytes(r, &h);
    uint8_t *blob = lethe_xmalloc(n);
    memcpy(h.tokens, b->tokens, sizeof(h.tokens));
    memcpy(h.offs, b->offs, sizeof(h.offs));
    memcpy(blob, &h, sizeof(h));
    size_t off = sizeof(h);
    for (int32_t sp = 0; sp < r->n_spaces; sp++) {
        lethe_kv_slots_save(r->pool, sp, b->slots + sp * LETHE_RADIX_BLOCK, b->n_res, blob + off);
        off += (size_t)b->n_res * lethe_kv_space_slot_bytes(r->pool, sp);
    }
    if (h.snap) lethe_kv_state_save(r->pool, b->snap, blob + off);
    if (lethe_host_tier_put(r->tier, LETHE_HOST_TIER_RADIX, b->hash, blob, n)) {
        r->n_demoted++;
        r->n_snap_demoted += h.snap;
    }
}

/* the header of the host block after `parent_hash` (0: first) with these
 * tokens at depth `depth`, verified; false when the tier has none */
static bool host_find(const lethe_radix *r, uint64_t parent_hash, int32_t depth, const int32_t *tokens,
                      host_hdr *out) {
    const uint64_t h = block_hash(depth ? parent_hash : r->fingerprint, tokens);
    if (lethe_host_tier_read(r->tier, LETHE_HOST_TIER_RADIX, h, out, sizeof(*out)) < sizeof(*out))
        return false;
    return out->hash == h && out->parent_hash == (depth ? parent_hash : 0) && out->depth == depth &&
           !memcmp(out->tokens, tokens, sizeof(out->tokens));
}

void lethe_radix_set_host_tier(lethe_radix *r, lethe_host_tier *t) {
    LETHE_ASSERT(!t || lethe_kv_host_copy_check(r->pool) == LETHE_OK);
    r->tier = t;
}

/* consecutive host blocks after blocks[0..n_dev); snap: only up to the
 * deepest one carrying a snapshot */
static int32_t match_host(const lethe_radix *r, const int32_t *tokens, int32_t n,
                          lethe_radix_block *const *blocks, int32_t n_dev, int32_t max_blocks, bool snap,
                          int32_t *resident, int32_t *n_seen) {
    *resident = 0;
    if (n_seen) *n_seen = 0;
    if (!r->tier || n <= 0) return 0;
    const int32_t limit = LETHE_MIN((n - 1) / LETHE_RADIX_BLOCK, max_blocks);
    uint64_t parent = n_dev ? blocks[n_dev - 1]->hash : 0;
    int32_t k = n_dev, res = 0, upto = n_dev, res_upto = 0;
    for (host_hdr h; k < limit; k++) {
        if (!host_find(r, parent, k, tokens + (size_t)k * LETHE_RADIX_BLOCK, &h)) break;
        res += h.n_res;
        parent = h.hash;
        if (!snap || h.snap) {
            upto = k + 1;
            res_upto = res;
        }
    }
    if (n_seen) *n_seen = k - n_dev;
    *resident = res_upto;
    return upto - n_dev;
}

int32_t lethe_radix_match_host(const lethe_radix *r, const int32_t *tokens, int32_t n,
                               lethe_radix_block *const *blocks, int32_t n_dev, int32_t max_blocks,
                               int32_t *resident) {
    return match_host(r, tokens, n, blocks, n_dev, max_blocks, false, resident, NULL);
}

int32_t lethe_radix_match_host_snap(const lethe_radix *r, const int32_t *tokens, int32_t n,
                                    lethe_radix_block *const *blocks, int32_t n_dev, int32_t max_blocks,
                                    int32_t *resident, int32_t *n_seen) {
    return match_host(r, tokens, n, blocks, n_dev, max_blocks, true, resident, n_seen);
}

static int32_t snap_slot_new(lethe_radix *r);
static void snap_list(lethe_radix *r, lethe_radix_block *b);

int32_t lethe_radix_promote(lethe_radix *r, const int32_t *tokens, lethe_radix_block **blocks,
                            int32_t n_dev, int32_t n_host) {
    if (!r->tier || n_host <= 0) return 0;
    /* 1. the blobs leave the tier first: making room below demotes other blocks */
    uint8_t **blob = lethe_xcalloc((size_t)n_host, sizeof(*blob));
    int32_t got = 0, need = 0;
    uint64_t parent = n_dev ? blocks[n_dev - 1]->hash : 0;
    for (host_hdr h; got < n_host; got++) {
        const int32_t k = n_dev + got;
        if (!host_find(r, parent, k, tokens + (size_t)k * LETHE_RADIX_BLOCK, &h)) break;
        size_t nb = 0;
        blob[got] = lethe_host_tier_take(r->tier, LETHE_HOST_TIER_RADIX, h.hash, &nb);
        LETHE_ASSERT(blob[got] && nb == blob_bytes(r, &h));
        need += h.n_res;
        parent = h.hash;
    }
    /* 2. room in every slot space, the matched chain held meanwhile */
    lethe_radix_acquire_refs(r, blocks, n_dev);
    if (lethe_kv_min_free(r->pool) < need) lethe_radix_evict(r, need);
    /* 3. fresh slots, the payload, the block back in the tree */
    int32_t done = 0;
    for (; done < got; done++) {
        host_hdr h;
        memcpy(&h, blob[done], sizeof(h));
        if (lethe_kv_min_free(r->pool) < h.n_res) break; /* the caller asked for more than it has */
        lethe_radix_block *b = block_new(r, n_dev + done ? blocks[n_dev + done - 1] : NULL, h.hash,
                                         h.tokens);
        b->n_res = h.n_res;
        b->pin = h.pin;
        b->prune_id = h.prune_id;
        b->priority = LETHE_MAX(h.priority, 0);
        memcpy(b->offs, h.offs, sizeof(b->offs));
        size_t off = sizeof(h);
        for (int32_t sp = 0; sp < r->n_spaces; sp++) {
            int32_t *sl = b->slots + sp * LETHE_RADIX_BLOCK;
            LETHE_ASSERT(lethe_kv_slots_take(r->pool, sp, h.n_res, sl));
            lethe_kv_slots_load(r->pool, sp, sl, h.n_res, blob[done] + off);
            off += (size_t)h.n_res * lethe_kv_space_slot_bytes(r->pool, sp);
        }
        /* its snapshot into a fresh snapshot slot (the LRU one makes room) */
        if (h.snap && r->max_snaps > 0) {
            const int32_t slot = snap_slot_new(r);
            lethe_kv_state_load(r->pool, slot, blob[done] + off);
            b->snap = slot;
            snap_list(r, b);
            r->n_snap_restored++;
        }
        b->last_access = ++r->clock;
        r->n_unref++;
        r->unref_slots += b->n_res;
        blocks[n_dev + done] = b;
        r->n_promoted++;
        r->promoted_tokens += LETHE_RADIX_BLOCK;
        free(blob[done]);
        blob[done] = NULL;
    }
    /* what could not be restored goes back to the tier */
    for (int32_t i = done; i < got; i++) {
        host_hdr h;
        memcpy(&h, blob[i], sizeof(h));
        lethe_host_tier_put(r->tier, LETHE_HOST_TIER_RADIX, h.hash, blob[i], blob_bytes(r, &h));
    }
    free(blob);
    /* the new leaf is evictable; the temporary references go */
    if (done > 0 && evictable(blocks[n_dev + done - 1])) heap_push(r, blocks[n_dev + done - 1]);
    lethe_radix_release(r, blocks, n_dev);
    return done;
}

void lethe_radix_host_counts(const lethe_radix *r, int64_t *demoted, int64_t *promoted,
                             int64_t *promoted_tokens) {
    *demoted = r->n_demoted;
    *promoted = r->n_promoted;
    *promoted_tokens = r->promoted_tokens;
}

void lethe_radix_host_snapshot_counts(const lethe_radix *r, int64_t *demoted, int64_t *restored) {
    *demoted = r->n_snap_demoted;
    *restored = r->n_snap_restored;
}

/* drops the demoted blocks below the deleted hashes del[0..n) (transitively) */
static void host_drop_below(lethe_radix *r, uint64_t *del, int32_t n) {
    int64_t nk = lethe_host_tier_keys(r->tier, LETHE_HOST_TIER_RADIX, NULL, 0);
    if (nk == 0 || n == 0) return;
    uint64_t *keys = lethe_xmalloc((size_t)nk * sizeof(*keys));
    nk = LETHE_MIN(nk, lethe_host_tier_keys(r->tier, LETHE_HOST_TIER_RADIX, keys, nk));
    uint64_t *set = lethe_xmalloc((size_t)(n + nk) * sizeof(*set));
    memcpy(set, del, (size_t)n * sizeof(*set));
    int32_t ns = n;
    for (bool changed = true; changed;) {
        changed = false;
        for (int64_t i = 0; i < nk; i++) {
            host_hdr h;
            if (!keys[i] ||
                lethe_host_tier_read(r->tier, LETHE_HOST_TIER_RADIX, keys[i], &h, sizeof(h)) < sizeof(h))
                continue;
            for (int32_t j = 0; j < ns; j++)
                if (h.depth > 0 && h.parent_hash == set[j]) {
                    lethe_host_tier_drop(r->tier, LETHE_HOST_TIER_RADIX, keys[i]);
                    set[ns++] = keys[i];
                    keys[i] = 0;
                    changed = true;
                    break;
                }
        }
    }
    free(set);
    free(keys);
}

static void evict_one(lethe_radix *r, lethe_radix_block *b, bool to_host) {
    LETHE_ASSERT(evictable(b));
    if (to_host && r->tier) demote(r, b);
    block_free_slots(r, b);
    table_remove(r, b);
    r->blocks[b->id] = NULL;
    r->free_ids[r->n_free_ids++] = b->id;
    r->n_blocks--;
    r->n_unref--;
    r->unref_slots -= b->n_res;
    lethe_radix_block *p = b->parent;
    free(b);
    if (p && --p->n_children == 0 && p->req_ref == 0 && p->priority >= 0) heap_push(r, p);
}

int32_t lethe_radix_evict(lethe_radix *r, int32_t want_free) {
    int32_t n = 0;
    while (lethe_kv_min_free(r->pool) < want_free && r->heap_len > 0) {
        lethe_radix_block *b = ent_block(r, heap_pop(r));
        if (!b) continue;
        evict_one(r, b, true);
        n++;
    }
    return n;
}

/* ---- state snapshots ---- */

void lethe_radix_set_snapshots(lethe_radix *r, int32_t max_snaps) {
    LETHE_ASSERT(r->n_snaps == 0 && max_snaps >= 0);
    LETHE_ASSERT(max_snaps == 0 || lethe_kv_has_states(r->pool));
    r->max_snaps = max_snaps;
    free(r->snaps);
    r->snaps = max_snaps ? lethe_xcalloc((size_t)max_snaps, sizeof(*r->snaps)) : NULL;
}

int32_t lethe_radix_max_snapshots(const lethe_radix *r) { return r->max_snaps; }
int32_t lethe_radix_n_snapshots(const lethe_radix *r) { return r->n_snaps; }
int32_t lethe_radix_block_snapshot(const lethe_radix_block *b) { return b->snap; }

/* b's snapshot slot goes back to the pool (b stays in the tree) */
static void snap_drop(lethe_radix *r, lethe_radix_block *b) {
    int32_t i = 0;
    while (i < r->n_snaps && r->snaps[i] != b) i++;
    LETHE_ASSERT(i < r->n_snaps);
    r->snaps[i] = r->snaps[--r->n_snaps];
    lethe_kv_state_give(r->pool, b->snap);
    b->snap = -1;
}

/* a held state slot listed as a snapshot (the caller sets b->snap = it and
 * fills it; listed at snaps[n_snaps - 1]): the least recently used snapshot
 * makes room when max_snaps are held */
static int32_t snap_slot_new(lethe_radix *r) {
    LETHE_ASSERT(r->max_snaps > 0);
    if (r->n_snaps == r->max_snaps) {
        lethe_radix_block *v = r->snaps[0];
        for (int32_t i = 1; i < r->n_snaps; i++)
            if (r->snaps[i]->snap_access < v->snap_access) v = r->snaps[i];
        snap_drop(r, v);
        r->n_snap_evicted++;
    }
    const int32_t slot = lethe_kv_state_take(r->pool);
    LETHE_ASSERT(slot >= 0); /* the engine sized the state pool for max_snaps of them */
    return slot;
}

/* b (its snap set) joins the snapshot list as the most recently used */
static void snap_list(lethe_radix *r, lethe_radix_block *b) {
    b->snap_access = ++r->clock;
    r->snaps[r->n_snaps++] = b;
}

bool lethe_radix_snapshot(lethe_radix *r, lethe_radix_block *b, int32_t state) {
    if (b->snap >= 0) { /* the same content's states: the one held stays */
        b->snap_access = ++r->clock;
        return true;
    }
    if (r->max_snaps == 0) return false;
    const int32_t slot = snap_slot_new(r);
    lethe_kv_state_copy(r->pool, slot, state);
    b->snap = slot;
    snap_list(r, b);
    r->n_snap_taken++;
    return true;
}

void lethe_radix_snapshot_restore(lethe_radix *r, lethe_radix_block *b, int32_t state) {
    LETHE_ASSERT(b->snap >= 0);
    lethe_kv_state_copy(r->pool, state, b->snap);
    b->snap_access = ++r->clock;
    r->n_snap_hits++;
}

void lethe_radix_snapshot_counts(const lethe_radix *r, int64_t *taken, int64_t *evicted,
                                 int64_t *hits) {
    *taken = r->n_snap_taken;
    *evicted = r->n_snap_evicted;
    *hits = r->n_snap_hits;
}

int32_t lethe_radix_n_blocks(const lethe_radix *r) { return r->n_blocks; }
int32_t lethe_radix_n_unreferenced(const lethe_radix *r) { return r->n_unref; }
uint64_t lethe_radix_block_hash(const lethe_radix_block *b) { return b->hash; }
int32_t lethe_radix_block_req_refs(const lethe_radix_block *b) { return b->req_ref; }

/* ---- checking ---- */

static void holder_for_each(void *ctx, void (*visit)(void *, int32_t, int32_t), void *vctx) {
    lethe_radix *r = ctx;
    for (int32_t id = 0; id < r->n_ids_used; id++) {
        const lethe_radix_block *b = r->blocks[id];
        if (!b) continue;
        for (int32_t sp = 0; sp < r->n_spaces; sp++)
            for (int32_t i = 0; i < b->n_res; i++)
                visit(vctx, sp, b->slots[sp * LETHE_RADIX_BLOCK + i]);
    }
}

static void holder_for_each_state(void *ctx, void (*visit)(void *, int32_t), void *vctx) {
    const lethe_radix *r = ctx;
    for (int32_t i = 0; i < r->n_snaps; i++) visit(vctx, r->snaps[i]->snap);
}

lethe_kv_holder lethe_radix_holder(lethe_radix *r) {
    return (lethe_kv_holder){
        .ctx = r, .for_each = holder_for_each, .for_each_state = holder_for_each_state};
}

lethe_status lethe_radix_check(const lethe_radix *r) {
    int32_t n_live = 0, n_unref = 0;
    int64_t unref_slots = 0, pinned_slots = 0;
    int32_t *children = lethe_xcalloc((size_t)LETHE_MAX(r->n_ids_used, 1), sizeof(int32_t));
    lethe_status st = LETHE_OK;
    for (int32_t id = 0; id < r->n_ids_used && st == LETHE_OK; id++) {
        const lethe_radix_block *b = r->blocks[id];
        if (!b) continue;
        n_live++;
        n_unref += b->req_ref == 0;
        if (b->req_ref == 0) unref_slots += b->n_res;
        if (b->req_ref == 0 && b->priority < 0) pinned_slots += b->n_res;
        bool offs_ok = b->n_res >= 0 && b->n_res <= LETHE_RADIX_BLOCK;
        for (int32_t i = 1; offs_ok && i < b->n_res; i++) offs_ok = b->offs[i] > b->offs[i - 1];
        if (offs_ok && b->n_res > 0) offs_ok = b->offs[b->n_res - 1] < LETHE_RADIX_BLOCK;
        if (!offs_ok)
            st = lethe_errorf(LETHE_ERR_INVALID,
                              "radix check: block %d: %d resident offsets not ascending in [0, 16)",
                              id, b->n_res);
        else if (b->priority < 0 && b->parent && b->parent->priority >= 0)
            st = lethe_errorf(LETHE_ERR_INVALID,
                              "radix check: block %d is pinned, its parent is not", id);
        else if (b->n_res < LETHE_RADIX_BLOCK && b->prune_id == 0)
            st = lethe_errorf(LETHE_ERR_INVALID,
                              "radix check: block %d holds %d tokens but was never pruned", id,
                              b->n_res);
        else if (b->id != id || b->gen != r->gens[id] || b->req_ref < 0)
            st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d: bad id/generation/req_ref", id);
        else if (b->hash != block_hash(b->parent ? b->parent->hash : r->fingerprint, b->tokens))
            st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d: hash does not match its chain", id);
        else if (lookup(r, b->hash, b->parent, b->tokens) != b)
            st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d is not reachable through the table", id);
        else if (b->parent) {
            const lethe_radix_block *p = b->parent;
            if (p->id < 0 || p->id >= r->n_ids_used || r->blocks[p->id] != p)
                st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d has an evicted parent", id);
            else if (p->req_ref < b->req_ref)
                st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d has %d request refs, its parent %d",
                                  id, b->req_ref, p->req_ref);
            else if (b->depth != p->depth + 1)
                st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d: depth %d under parent depth %d", id, b->depth, p->depth);
            else
                children[p->id]++;
        }
        if (st == LETHE_OK && b->req_ref == 0) {
            for (int32_t sp = 0; sp < r->n_spaces && st == LETHE_OK; sp++)
                for (int32_t i = 0; i < b->n_res; i++) {
                    int32_t c = lethe_kv_refcount(r->pool, sp, b->slots[sp * LETHE_RADIX_BLOCK + i]);
                    if (c != 1) {
                        st = lethe_errorf(LETHE_ERR_INVALID,
                                          "radix check: unreferenced block %d: slot %d has count %d (expected 1)",
                                          id, b->slots[sp * LETHE_RADIX_BLOCK + i], c);
                        break;
                    }
                }
        }
    }
    for (int32_t id = 0; id < r->n_ids_used && st == LETHE_OK; id++) {
        const lethe_radix_block *b = r->blocks[id];
        if (b && b->n_children != children[id])
            st = lethe_errorf(LETHE_ERR_INVALID, "radix check: block %d counts %d children, has %d", id,
                              b->n_children, children[id]);
    }
    /* snapshots: each listed once, on a live block that names it, at most max_snaps */
    int32_t n_snap_blocks = 0;
    for (int32_t id = 0; id < r->n_ids_used && st == LETHE_OK; id++)
        if (r->blocks[id] && r->blocks[id]->snap >= 0) n_snap_blocks++;
    if (st == LETHE_OK && (n_snap_blocks != r->n_snaps || r->n_snaps > r->max_snaps))
        st = lethe_errorf(LETHE_ERR_INVALID,
                          "radix check: %d blocks hold a state snapshot, %d listed (at most %d)",
                          n_snap_blocks, r->n_snaps, r->max_snaps);
    for (int32_t i = 0; i < r->n_snaps && st == LETHE_OK; i++) {
        const lethe_radix_block *b = r->snaps[i];
        if (b->id < 0 || b->id >= r->n_ids_used || r->blocks[b->id] != b || b->snap < 0)
            st = lethe_errorf(LETHE_ERR_INVALID,
                              "radix check: snapshot %d is listed on a dead block or names no slot", i);
        for (int32_t j = 0; j < i && st == LETHE_OK; j++)
            if (r->snaps[j] == b || r->snaps[j]->snap == b->snap)
                st = lethe_errorf(LETHE_ERR_INVALID,
                                  "radix check: snapshot state slot %d listed twice", b->snap);
    }
    /* demoted blocks: each blob is its header, KV payload and (flagged) snapshot */
    if (st == LETHE_OK && r->tier) {
        int64_t nk = lethe_host_tier_keys(r->tier, LETHE_HOST_TIER_RADIX, NULL, 0);
        uint64_t *keys = lethe_xmalloc((size_t)LETHE_MAX(nk, 1) * sizeof(*keys));
        nk = LETHE_MIN(nk, lethe_host_tier_keys(r->tier, LETHE_HOST_TIER_RADIX, keys, nk));
        for (int64_t i = 0; i < nk && st == LETHE_OK; i++) {
            host_hdr h;
            const size_t n = lethe_host_tier_read(r->tier, LETHE_HOST_TIER_RADIX, keys[i], &h, sizeof(h));
            if (n < sizeof(h) || h.hash != keys[i] || (h.snap != 0 && h.snap != 1))
                st = lethe_errorf(LETHE_ERR_INVALID, "radix check: host block %016llx: bad header",
                                  (unsigned long long)keys[i]);
            else if (h.snap && !lethe_kv_has_states(r->pool))
                st = lethe_errorf(LETHE_ERR_INVALID,
                                  "radix check: host block %016llx carries a state snapshot, the pool "
                                  "has no states", (unsigned long long)keys[i]);
            else if (n != blob_bytes(r, &h))
                st = lethe_errorf(LETHE_ERR_INVALID,
                                  "radix check: host block %016llx: %zu bytes, expected %zu (%d tokens%s)",
                                  (unsigned long long)keys[i], n, blob_bytes(r, &h), h.n_res,
                                  h.snap ? " + a state snapshot" : "");
        }
        free(keys);
    }
    if (st == LETHE_OK && pinned_slots != r->pinned_unref_slots)
        st = lethe_errorf(LETHE_ERR_INVALID,
                          "radix check: %lld pinned unreferenced slots, the counter says %lld",
                          (long long)pinned_slots, (long long)r->pinned_unref_slots);
    if (st == LETHE_OK &&
        (n_live != r->n_blocks || n_unref != r->n_unref || unref_slots != r->unref_slots))
        st = lethe_errorf(LETHE_ERR_INVALID,
                          "radix check: %d blocks / %d unreferenced / %lld unreferenced slots, "
                          "counters say %d / %d / %lld",
                          n_live, n_unref, (long long)unref_slots, r->n_blocks, r->n_unref,
                          (long long)r->unref_slots);
    /* every evictable block must have a current heap entry, or it could never be evicted */
    if (st == LETHE_OK) {
        bool *has = lethe_xcalloc((size_t)LETHE_MAX(r->n_ids_used, 1), sizeof(bool));
        for (int32_t i = 0; i < r->heap_len; i++) {
            const lethe_radix_block *b = ent_block(r, r->heap[i]);
            if (b) has[b->id] = true;
        }
        for (int32_t id = 0; id < r->n_ids_used && st == LETHE_OK; id++) {
            const lethe_radix_block *b = r->blocks[id];
            if (b && evictable(b) && !has[id])
                st = lethe_errorf(LETHE_ERR_INVALID, "radix check: evictable block %d has no LRU entry", id);
        }
        free(has);
    }
    free(children);
    return st;
}

/* ---- control: inspection, priorities, deletion, pruning ---- */

void lethe_radix_block_get_info(const lethe_radix_block *b, lethe_radix_block_info *out) {
    *out = (lethe_radix_block_info){.hash = b->hash,
                                    .parent_hash = b->parent ? b->parent->hash : 0,
                                    .depth = b->depth,
                                    .resident = b->n_res,
                                    .req_refs = b->req_ref,
                                    .n_children = b->n_children,
                                    .priority = b->priority,
                                    .prune_id = b->prune_id,
                                    .pin = b->pin};
    for (int32_t i = 0; i < b->n_res; i++) out->offsets[i] = b->offs[i];
}

void lethe_radix_for_each_block(const lethe_radix *r, void (*fn)(void *, const lethe_radix_block *),
                                void *ctx) {
    for (int32_t id = 0; id < r->n_ids_used; id++)
        if (r->blocks[id]) fn(ctx, r->blocks[id]);
}

static void set_one(lethe_radix *r, lethe_radix_block *b, int32_t priority) {
    if (b->req_ref == 0 && (b->priority < 0) != (priority < 0))
        r->pinned_unref_slots += priority < 0 ? b->n_res : -b->n_res;
    b->priority = priority;
    /* a fresh heap entry under the new key (older entries no longer match it) */
    if (evictable(b)) heap_push(r, b);
}

static bool is_descendant(const lethe_radix_block *b, const lethe_radix_block *root) {
    for (; b; b = b->parent)
        if (b == root) return true;
    return false;
}

void lethe_radix_set_priority(lethe_radix *r, lethe_radix_block *b, int32_t priority) {
    if (priority < 0) { /* a pinned block keeps its prefix: pinned ancestors */
        for (lethe_radix_block *a = b->parent; a; a = a->parent)
            if (a->priority >= 0) set_one(r, a, priority);
    } else if (b->priority < 0) { /* unpinned: nothing below it stays pinned */
        for (int32_t id = 0; id < r->n_ids_used; id++) {
            lethe_radix_block *d = r->blocks[id];
            if (d && d != b && d->priority < 0 && is_descendant(d, b)) set_one(r, d, priority);
        }
    }
    set_one(r, b, priority);
}

static int cmp_depth_desc(const void *a, const void *b) {
    const lethe_radix_block *x = *(lethe_radix_block *const *)a,
                            *y = *(lethe_radix_block *const *)b;
    return x->depth != y->depth ? (x->depth < y->depth ? 1 : -1)
                                : (x->id > y->id) - (x->id < y->id);
}

int32_t lethe_radix_delete_subtree(lethe_radix *r, lethe_radix_block *root) {
    int32_t n = 0;
    lethe_radix_block **sub = lethe_xmalloc((size_t)LETHE_MAX(r->n_blocks, 1) * sizeof(*sub));
    for (int32_t id = 0; id < r->n_ids_used; id++) {
        lethe_radix_block *b = r->blocks[id];
        if (b && is_descendant(b, root)) {
            if (b->req_ref > 0) { /* a running request reads it: nothing is deleted */
                free(sub);
                return -1;
            }
            sub[n++] = b;
        }
    }
    qsort(sub, (size_t)n, sizeof(*sub), cmp_depth_desc); /* leaves first */
    uint64_t *del = lethe_xmalloc((size_t)LETHE_MAX(n, 1) * sizeof(*del));
    for (int32_t i = 0; i < n; i++) {
        if (sub[i]->priority < 0) set_one(r, sub[i], 0); /* deletion overrides a pin */
        del[i] = sub[i]->hash;
        evict_one(r, sub[i], false); /* deleted, not demoted */
    }
    if (r->tier) host_drop_below(r, del, n); /* nor do demoted descendants come back */
    free(del);
    free(sub);
    return n;
}

int32_t lethe_radix_prune_block(lethe_radix *r, lethe_radix_block *b,
                                const bool keep[LETHE_RADIX_BLOCK], uint32_t prune_id) {
    LETHE_ASSERT(b->req_ref == 0 && prune_id != 0);
    for (int32_t o = 0; o < LETHE_RADIX_BLOCK; o++) LETHE_ASSERT(!(b->pin >> o & 1) || keep[o]);
    int32_t n = 0, freed = 0;
    for (int32_t i = 0; i < b->n_res; i++) {
        const bool k = keep[b->offs[i]];
        for (int32_t sp = 0; sp < r->n_spaces; sp++) {
            int32_t *s = b->slots + sp * LETHE_RADIX_BLOCK;
            if (k) s[n] = s[i];
            else lethe_kv_unref(r->pool, sp, s[i]);
        }
        if (k) b->offs[n++] = b->offs[i];
        else freed++;
    }
    r->unref_slots -= b->n_res - n;
    if (b->priority < 0) r->pinned_unref_slots -= b->n_res - n;
    b->n_res = n;
    b->prune_id = prune_id;
    return freed;
}

lethe_radix_block *lethe_radix_find(const lethe_radix *r, const int32_t *tokens, int32_t n_blocks,
                                    lethe_radix_block **chain) {
    lethe_radix_block *parent = NULL;
    for (int32_t k = 0; k < n_blocks; k++) {
        const int32_t *t = tokens + (size_t)k * LETHE_RADIX_BLOCK;
        lethe_radix_block *b = lookup(r, block_hash(parent ? parent->hash : r->fingerprint, t),
                                      parent, t);
        if (!b) return NULL;
        if (chain) chain[k] = b;
        parent = b;
    }
    return parent;
}

void lethe_radix_acquire_refs(lethe_radix *r, lethe_radix_block *const *blocks, int32_t n) {
    for (int32_t k = 0; k < n; k++) ref_up(r, blocks[k]);
}

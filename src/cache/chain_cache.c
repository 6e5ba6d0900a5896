/* chain_cache.c - the Chain Cache table (chain.c) as a prefix cache.
 *
 * A chain's payload is {row, method state}: the KV row of the last turn
 * (possibly compacted per layer by the method) and the method's per-request
 * state (SnapKV's score vectors...), kept as they were when the turn ended:
 * nothing is copied or serialized. A turn's request carries a chain_ref
 * (chain id, reused tokens). Its life:
 *
 *   begin_turn (any thread)  lethe_chain_begin: lookup, state, fingerprint,
 *                            digest, capacity (may reclaim IDLE chains: their
 *                            payloads are queued for release); the full prompt
 *                            (history + appended tokens) becomes the request.
 *   drain (engine thread)    queued payloads are freed (row + method state);
 *                            the engine drains before it admits new turns, so
 *                            a turn that made room finds it free.
 *   match / acquire          a resumed turn's payload is handed to the request
 *                            at its first admission: the scheduler runs it on
 *                            that row with n_computed = the processed
 *                            boundary, so only the suffix is prefilled and the
 *                            method continues from its state.
 *   release OK               row and state are detached from the request
 *                            before the scheduler frees it; boundary =
 *                            n_computed (the last sampled token has no KV
 *                            yet), history = all tokens, resident = row length
 *                            per slot space.
 *   release FAILED           the chain is invalidated (tombstone) and its KV
 *                            freed at once.
 *   release PREEMPTED        nothing: the request loses its row like any other
 *                            and recomputes its whole prompt; the chain then
 *                            continues from the recomputed KV.
 *
 * Branching (a chain created with a shared prefix of S tokens, whole 16-token
 * blocks): the cache keeps a radix tree (radix.c) of shared prefixes beside
 * the table. The row of such a chain is [shared prefix | private
 * continuation]: a new turn attaches the longest cached part of [0, S) from
 * the tree read-only (request references on its blocks, slots shared by
 * every chain that attached them), computes the rest, and commit publishes
 * each block of [0, S) the row completes. Positions [0, S) are protected in
 * the row (kv_protect.c), so every eviction method compacts only the private
 * part and the shared slots are never dropped from under the other chains;
 * the KV of [0, S) is therefore the exact prefill of those tokens whichever
 * chain computed it. The chain holds its block references while it lives
 * (in the payload when IDLE, in its request's record when ACTIVE), so no
 * shared block is evicted under a chain; unreferenced shared blocks are
 * reclaimable and evicted LRU like radix blocks. The table counts a shared
 * prefix once (chain.c) and each chain's private slots only.
 *
 * Host tier (--host-cache-bytes): an IDLE chain the table reclaims is
 * demoted, not dropped: drain copies its private entries, pins and method
 * state into one blob (demote_kv) and frees its row; the chain keeps its
 * shared-block references. Its next turn claims the blob (the table's
 * claim callback, at admission) and acquire restores it into a fresh row
 * before the suffix runs (restore_kv), bit for bit. A hybrid model's
 * chain takes its row's linear-attention states along (the blob's tail).
 *
 * Hybrid models (the pool has per-request states, kv_pool.h): a row owns
 * its state slot, so a chain's payload row keeps the linear-attention states
 * after its processed boundary with its KV, and a resumed turn continues
 * from them without recompute. The pool has max_idle_states state slots for
 * IDLE chains besides the running requests' (the engine sizes them with
 * --state-snapshot-bytes); when a finished turn would leave more IDLE chains
 * with a row, the least recently used ones are reclaimed as by capacity
 * reclaim: demoted with their states when there is a host tier, else
 * tombstoned. The engine refuses branching for these models (a shared
 * prefix's blocks come without the states at their end). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/host_tier.h"
#include "cache/prefix_cache.h"
#include "cache/radix.h"
#include "core/util.h"

/* shared-prefix blocks a chain holds request references on: [0, 16 n) */
typedef struct chain_blocks {
    lethe_radix_block **b;
    int32_t n, cap;
} chain_blocks;

typedef struct chain_kv {
    int32_t row;    /* -1 while on the host */
    void *state;
    chain_blocks shared;
    /* demoted: the private KV, positions, pins and method state are one blob
     * in the host tier under (LETHE_HOST_TIER_CHAIN, address of this record),
     * or in `blob` once a turn claimed it back; the shared blocks stay held */
    bool on_host;
    void *blob;
    size_t blob_n;
} chain_kv;

/* the blob: header, then per slot space [n_priv] positions and the slots'
 * payload (kv_host.c), then [2 n_prot] protected ranges, then the method
 * state, then (hybrid models) the row's linear-attention states */
typedef struct chain_blob_hdr {
    uint32_t magic;
    int32_t n_spaces, n_shared, n_prot;
    uint64_t state_bytes; /* UINT64_MAX: no state */
    uint64_t lin_bytes;   /* the row's states (lethe_kv_state_save), 0: the pool has none */
} chain_blob_hdr;
#define CHAIN_BLOB_MAGIC 0x6c434b56u

typedef struct chain_ref {
    char id[LETHE_CHAIN_ID_CAP];
    int32_t reused; /* tokens with resident KV at the turn's start */
    int32_t share;  /* shared prefix tokens (0: not branching) */
    bool admitted;  /* admitted once: a readmission (after preemption) recomputes */
    chain_blocks shared; /* held while the turn runs */
} chain_ref;

typedef struct chain_cache {
    lethe_prefix_cache base; /* must stay first */
    lethe_chain_table *t;
    uint8_t fp[LETHE_CHAIN_FP_BYTES];
    lethe_radix *tree;  /* shared prefixes of branching chains */
    int64_t refs_held;  /* request references on tree blocks held by chains (the checker) */
    int64_t shared_hit_tokens; /* prompt tokens attached from shared prefixes */
    lethe_host_tier *tier;     /* NULL: none */
    int64_t restored_entries;  /* row entries restored from demoted chains */
    int64_t tier_evictions;    /* the tier's eviction count at the last sweep */
    /* the last match, for the acquire that follows it: n_match shared blocks
     * in the pool, then n_host in the host tier */
    lethe_radix_block **match;
    int32_t n_match, n_host, cap_match;
    uint64_t match_id;
    bool states;             /* hybrid model: rows own state slots (file comment) */
    int32_t max_idle_states; /* IDLE chains that may keep a row (and its states) */
} chain_cache;

static chain_cache *cc_of(lethe_prefix_cache *pc) { return (chain_cache *)pc; }

static void blocks_push(chain_blocks *cb, lethe_radix_block *b) {
    if (cb->n == cb->cap) {
        cb->cap = cb->cap ? 2 * cb->cap : 16;
        cb->b = lethe_xrealloc(cb->b, (size_t)cb->cap * sizeof(*cb->b));
    }
    cb->b[cb->n++] = b;
}

static void blocks_drop(chain_cache *cc, chain_blocks *cb) {
    if (cb->n > 0) lethe_radix_release(cc->tree, cb->b, cb->n);
    cc->refs_held -= cb->n;
    free(cb->b);
    *cb = (chain_blocks){0};
}

static uint64_t host_key(const chain_kv *k) { return (uint64_t)(uintptr_t)k; }

static void kv_free(chain_cache *cc, chain_kv *k) {
    if (!k) return;
    if (k->on_host) { /* claimed back (blob) or still in the tier */
        if (k->blob) free(k->blob);
        else lethe_host_tier_drop(cc->tier, LETHE_HOST_TIER_CHAIN, host_key(k));
    }
    blocks_drop(cc, &k->shared);
    if (k->row >= 0) lethe_kv_row_release(cc->base.pool, k->row);
    if (k->state) {
        LETHE_ASSERT(cc->base.release_state);
        cc->base.release_state(cc->base.release_ctx, k->state);
    }
    free(k);
}

static int32_t row_resident(const lethe_kv_pool *pool, int32_t row) {
    int32_t m = 0;
    for (int32_t sp = 0; sp < lethe_kv_n_spaces(pool); sp++)
        m = LETHE_MAX(m, lethe_kv_row_len(pool, sp, row));
    return m;
}

/* ---- host tier: an idle chain's private KV out of the pool and back ---- */

/* the blob's per-space part: n_priv entries at *at, positions then payload */
static const uint8_t *blob_space(const lethe_kv_pool *pool, const uint8_t *at, int32_t sp,
                                 int32_t *n_priv, const int32_t **pos, const uint8_t **payload) {
    memcpy(n_priv, at, sizeof(int32_t));
    at += sizeof(int32_t);
    *pos = (const int32_t *)at;
    at += (size_t)*n_priv * sizeof(int32_t);
    *payload = at;
    return at + (size_t)*n_priv * lethe_kv_space_slot_bytes(pool, sp);
}

/* bytes of a row's linear-attention states in a blob (0: the pool has none) */
static size_t blob_lin_bytes(const chain_cache *cc) {
    return cc->states ? lethe_kv_state_host_bytes(cc->base.pool) : 0;
}

/* Copies k's private entries ([n_shared, len) of each space: the shared
 * prefix [0, n_shared) is uncompacted and stays with its blocks), its pins
 * and its method state into one blob in the host tier, then frees the row
 * and the state. False (nothing changed) when the state cannot be saved or
 * the tier refuses the blob. Engine thread. */
static bool demote_kv(chain_cache *cc, chain_kv *k) {
    lethe_kv_pool *pool = cc->base.pool;
    const int32_t n_sp = lethe_kv_n_spaces(pool), nsh = k->shared.n * LETHE_RADIX_BLOCK;
    uint64_t state_bytes = UINT64_MAX;
    if (k->state) {
        if (!cc->base.snapshot_state) return false;
        size_t n = cc->base.snapshot_state(cc->base.release_ctx, k->state, NULL, 0);
        if (n == SIZE_MAX) return false;
        state_bytes = n;
    }
    const int32_t *prot = NULL;
    const int32_t n_prot = lethe_kv_row_protected(pool, k->row, &prot);
    const size_t lin = blob_lin_bytes(cc);
    size_t size = sizeof(chain_blob_hdr) + (size_t)n_prot * 2 * sizeof(int32_t) +
                  (state_bytes == UINT64_MAX ? 0 : (size_t)state_bytes) + lin;
    for (int32_t sp = 0; sp < n_sp; sp++) {
        const int32_t n = lethe_kv_row_len(pool, sp, k->row) - nsh;
        LETHE_ASSERT(n >= 0 && (nsh == 0 || lethe_kv_row_pos(pool, sp, k->row)[nsh - 1] == nsh - 1));
        size += sizeof(int32_t) + (size_t)n * (sizeof(int32_t) + lethe_kv_space_slot_bytes(pool, sp));
    }
    uint8_t *blob = lethe_xmalloc(size), *at = blob;
    const chain_blob_hdr h = {.magic = CHAIN_BLOB_MAGIC, .n_spaces = n_sp, .n_shared = nsh,
                              .n_prot = n_prot, .state_bytes = state_bytes, .lin_bytes = lin};
    memcpy(at, &h, sizeof(h));
    at += sizeof(h);
    for (int32_t sp = 0; sp < n_sp; sp++) {
        const int32_t n = lethe_kv_row_len(pool, sp, k->row) - nsh;
        memcpy(at, &n, sizeof(n));
        at += sizeof(n);
        memcpy(at, lethe_kv_row_pos(pool, sp, k->row) + nsh, (size_t)n * sizeof(int32_t));
        at += (size_t)n * sizeof(int32_t);
        lethe_kv_slots_save(pool, sp, lethe_kv_row_slots(pool, sp, k->row) + nsh, n, at);
        at += (size_t)n * lethe_kv_space_slot_bytes(pool, sp);
    }
    memcpy(at, prot, (size_t)n_prot * 2 * sizeof(int32_t));
    at += (size_t)n_prot * 2 * sizeof(int32_t);
    if (state_bytes != UINT64_MAX)
        LETHE_ASSERT(cc->base.snapshot_state(cc->base.release_ctx, k->state, at, state_bytes) ==
                     state_bytes);
    at += state_bytes == UINT64_MAX ? 0 : state_bytes;
    if (lin) lethe_kv_state_save(pool, lethe_kv_row_state(pool, k->row), at);
    at += lin;
    LETHE_ASSERT((size_t)(at - blob) == size);
    if (!lethe_host_tier_put(cc->tier, LETHE_HOST_TIER_CHAIN, host_key(k), blob, size)) return false;
    lethe_kv_row_release(pool, k->row); /* the shared slots stay with their blocks */
    k->row = -1;
    if (k->state) cc->base.release_state(cc->base.release_ctx, k->state);
    k->state = NULL;
    k->on_host = true;
    return true;
}

/* max over spaces of the entries a claimed blob restores (*priv: private only) */
static int32_t blob_entries(const lethe_kv_pool *pool, const chain_kv *k, int32_t *priv) {
    const uint8_t *at = (const uint8_t *)k->blob + sizeof(chain_blob_hdr);
    chain_blob_hdr h;
    memcpy(&h, k->blob, sizeof(h));
    *priv = 0;
    for (int32_t sp = 0; sp < h.n_spaces; sp++) {
        int32_t n;
        const int32_t *pos;
        const uint8_t *payload;
        at = blob_space(pool, at, sp, &n, &pos, &payload);
        *priv = LETHE_MAX(*priv, n);
    }
    return h.n_shared + *priv;
}

/* The reverse of demote_kv into a fresh row, bit for bit: the shared blocks
 * the chain kept are attached again, the private entries restored into
 * fresh slots at their positions, the pins and the method state rebuilt.
 * The scheduler counted the slots (match.pinned). Engine thread. */
static void restore_kv(chain_cache *cc, chain_kv *k) {
    lethe_kv_pool *pool = cc->base.pool;
    LETHE_ASSERT(k->on_host && k->blob && k->row < 0 && !k->state);
    chain_blob_hdr h;
    memcpy(&h, k->blob, sizeof(h));
    LETHE_ASSERT(h.magic == CHAIN_BLOB_MAGIC && h.n_spaces == lethe_kv_n_spaces(pool) &&
                 h.n_shared == k->shared.n * LETHE_RADIX_BLOCK &&
                 h.lin_bytes == blob_lin_bytes(cc));
    int32_t priv = 0;
    blob_entries(pool, k, &priv);
    if (lethe_kv_min_free(pool) < priv) lethe_radix_evict(cc->tree, priv);
    LETHE_ASSERT(lethe_kv_min_free(pool) >= priv);
    LETHE_ASSERT(lethe_kv_state_n_free(pool) > 0); /* admission checked it (a row owns a state slot) */
    k->row = lethe_kv_row_alloc(pool);
    /* the shared prefix: the chain's references move from the payload to the row's attach */
    lethe_radix_release(cc->tree, k->shared.b, k->shared.n);
    lethe_radix_acquire(cc->tree, k->shared.b, k->shared.n, k->row);
    const uint8_t *at = (const uint8_t *)k->blob + sizeof(h);
    int32_t *slots = lethe_xmalloc((size_t)LETHE_MAX(priv, 1) * sizeof(int32_t));
    for (int32_t sp = 0; sp < h.n_spaces; sp++) {
        int32_t n;
        const int32_t *pos;
        const uint8_t *payload;
        at = blob_space(pool, at, sp, &n, &pos, &payload);
        LETHE_ASSERT(lethe_kv_slots_take(pool, sp, n, slots));
        lethe_kv_slots_load(pool, sp, slots, n, payload);
        lethe_kv_row_attach_space(pool, k->row, sp, slots, pos, n);
        for (int32_t i = 0; i < n; i++) lethe_kv_unref(pool, sp, slots[i]); /* the row holds them */
        cc->restored_entries += n;
    }
    free(slots);
    if (h.n_prot > 0) lethe_kv_row_protect(pool, k->row, (const int32_t *)at, h.n_prot);
    at += (size_t)h.n_prot * 2 * sizeof(int32_t);
    if (h.state_bytes != UINT64_MAX) {
        LETHE_ASSERT(cc->base.restore_state);
        lethe_status st = cc->base.restore_state(cc->base.release_ctx, at, (size_t)h.state_bytes, &k->state);
        LETHE_ASSERT(st == LETHE_OK); /* the bytes are the ones its snapshot wrote */
        at += h.state_bytes;
    }
    /* hybrid: the states after the chain's boundary, into the fresh row's slot */
    if (h.lin_bytes) lethe_kv_state_load(pool, lethe_kv_row_state(pool, k->row), at);
    at += h.lin_bytes;
    LETHE_ASSERT((size_t)(at - (const uint8_t *)k->blob) == k->blob_n);
    free(k->blob);
    k->blob = NULL;
    k->blob_n = 0;
    k->on_host = false;
}

/* the table's callbacks (under its lock, any thread) */
static bool host_claim(void *ctx, void *payload) {
    chain_cache *cc = ctx;
    chain_kv *k = payload;
    LETHE_ASSERT(k->on_host && !k->blob);
    k->blob = lethe_host_tier_take(cc->tier, LETHE_HOST_TIER_CHAIN, host_key(k), &k->blob_n);
    return k->blob != NULL;
}

static bool host_present(void *ctx, void *payload) {
    chain_cache *cc = ctx;
    return lethe_host_tier_read(cc->tier, LETHE_HOST_TIER_CHAIN, host_key(payload), NULL, 0) > 0;
}

static void cc_match(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_match *out) {
    chain_cache *cc = cc_of(pc);
    const chain_ref *c = *s->ref;
    cc->n_match = cc->n_host = 0;
    cc->match_id = s->id;
    const chain_kv *k = c && !c->admitted ? lethe_chain_turn_payload(cc->t, c->id) : NULL;
    if (k) { /* a resumed turn: its row, shared prefix included */
        out->tokens = c->reused;
        out->resume = true;
        if (k->on_host) { /* restored by acquire into fresh slots */
            int32_t priv = 0;
            out->resident = blob_entries(pc->pool, k, &priv);
            out->pinned = priv;
        } else {
            out->resident = row_resident(pc->pool, k->row);
        }
        return;
    }
    if (!c || c->share <= 0) return; /* a new, recreated or readmitted turn computes from 0 */
    /* branching: the cached part of the shared prefix */
    int32_t max_blocks = c->share / LETHE_RADIX_BLOCK;
    if (max_blocks > cc->cap_match) {
        cc->cap_match = LETHE_MAX(max_blocks, 2 * cc->cap_match);
        cc->match = lethe_xrealloc(cc->match, (size_t)cc->cap_match * sizeof(*cc->match));
    }
    cc->n_match = lethe_radix_match(cc->tree, s->tokens, s->n_tokens, cc->match, max_blocks);
    int32_t host_res = 0; /* demoted shared blocks: restored by acquire */
    cc->n_host = lethe_radix_match_host(cc->tree, s->tokens, s->n_tokens, cc->match, cc->n_match,
                                        max_blocks, &host_res);
    out->tokens = out->resident = (cc->n_match + cc->n_host) * LETHE_RADIX_BLOCK;
    out->pinned = lethe_radix_unreferenced_slots(cc->match, cc->n_match) + host_res;
    out->queried = c->share;
    out->shareable = max_blocks * LETHE_RADIX_BLOCK;
    out->share_block = LETHE_RADIX_BLOCK;
}

/* a branching chain's turn publishes its shared prefix (cc_commit) */
static int32_t cc_publishes(lethe_prefix_cache *pc, const lethe_pc_seq *s) {
    (void)pc;
    const chain_ref *c = *s->ref;
    return c && c->share > 0 ? c->share : 0;
}

static void cc_acquire(lethe_prefix_cache *pc, const lethe_pc_seq *s, const lethe_pc_match *m) {
    chain_cache *cc = cc_of(pc);
    chain_ref *c = *s->ref;
    if (c) c->admitted = true;
    if (!m->resume) {
        if (!c || c->share <= 0) return;
        LETHE_ASSERT(cc->match_id == s->id &&
                     m->tokens == (cc->n_match + cc->n_host) * LETHE_RADIX_BLOCK && c->shared.n == 0);
        if (cc->n_host > 0) {
            int32_t got = lethe_radix_promote(cc->tree, s->tokens, cc->match, cc->n_match, cc->n_host);
            LETHE_ASSERT(got == cc->n_host);
            cc->n_match += got;
            cc->n_host = 0;
        }
        lethe_radix_acquire(cc->tree, cc->match, cc->n_match, *s->row);
        for (int32_t i = 0; i < cc->n_match; i++) blocks_push(&c->shared, cc->match[i]);
        cc->refs_held += cc->n_match;
        cc->shared_hit_tokens += m->tokens;
        /* the shared part is never compacted: every method keeps protected positions */
        const int32_t range[2] = {0, c->share};
        lethe_kv_row_protect(pc->pool, *s->row, range, 1);
        return;
    }
    LETHE_ASSERT(c && *s->row < 0 && !*s->method_state);
    chain_kv *k = lethe_chain_take_payload(cc->t, c->id);
    LETHE_ASSERT(k);
    if (k->on_host) restore_kv(cc, k); /* back from the host tier before the suffix runs */
    *s->row = k->row;
    *s->method_state = k->state;
    LETHE_ASSERT(c->shared.n == 0);
    c->shared = k->shared; /* the references ride with the turn */
    free(k);
}

/* publishes the blocks of the shared prefix the row has completed */
static void cc_commit(lethe_prefix_cache *pc, const lethe_pc_seq *s) {
    chain_cache *cc = cc_of(pc);
    chain_ref *c = *s->ref;
    if (!c || c->share <= 0) return;
    const int32_t limit = LETHE_MIN(s->n_computed, c->share);
    for (int32_t n = c->shared.n; (n + 1) * LETHE_RADIX_BLOCK <= limit; n = c->shared.n) {
        /* [0, share) is protected and uncompacted: row entry == position */
        lethe_radix_block *parent = n ? c->shared.b[n - 1] : NULL;
        blocks_push(&c->shared, lethe_radix_insert(cc->tree, parent, s->tokens + n * LETHE_RADIX_BLOCK,
                                                   *s->row, n * LETHE_RADIX_BLOCK));
        cc->refs_held++;
    }
}

static void cc_drain(lethe_prefix_cache *pc) {
    chain_cache *cc = cc_of(pc);
    void *buf[64];
    int32_t n;
    if (cc->tier) { /* idle chains reclaim picked: to the host tier; chains it dropped: gone */
        do {
            n = lethe_chain_take_demotions(cc->t, buf, 64);
            for (int32_t i = 0; i < n; i++) lethe_chain_demoted(cc->t, buf[i], demote_kv(cc, buf[i]));
        } while (n == 64);
        lethe_host_tier_stats hs;
        lethe_host_tier_get_stats(cc->tier, &hs);
        if (hs.evictions != cc->tier_evictions) {
            cc->tier_evictions = hs.evictions;
            lethe_chain_sweep_host(cc->t);
        }
    }
    do {
        n = lethe_chain_take_released(cc->t, buf, 64);
        for (int32_t i = 0; i < n; i++) kv_free(cc, buf[i]);
    } while (n == 64);
}

static void cc_release(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_end how) {
    chain_cache *cc = cc_of(pc);
    chain_ref *c = *s->ref;
    if (!c) return;
    if (how == LETHE_PC_END_PREEMPTED) { /* the row goes; a readmission attaches the prefix again */
        blocks_drop(cc, &c->shared);
        return;
    }
    chain_kv *k = NULL;
    if (*s->row >= 0) { /* running: detach the row and state before the scheduler frees them */
        k = lethe_xcalloc(1, sizeof(*k));
        k->row = *s->row;
        k->state = *s->method_state;
        k->shared = c->shared;
        c->shared = (chain_blocks){0};
        *s->row = -1;
        *s->method_state = NULL;
    }
    blocks_drop(cc, &c->shared); /* (none left when a row was kept) */
    if (how == LETHE_PC_END_OK && k && cc->states && cc->max_idle_states == 0 && !cc->tier) {
        kv_free(cc, k); /* no state slot for an idle chain: its next turn recomputes */
        k = NULL;       /* (with a host tier it is demoted below, its states with it) */
    }
    if (how == LETHE_PC_END_FAILED) { /* on the engine thread: the KV goes now */
        lethe_chain_abandon(cc->t, c->id, NULL);
        kv_free(cc, k);
        cc_drain(pc);
    } else {
        int32_t n_sp = lethe_kv_n_spaces(pc->pool);
        int32_t *resident = lethe_xcalloc((size_t)n_sp, sizeof(int32_t));
        /* private slots only: the shared prefix [0, share) is counted once by the table */
        if (k)
            for (int32_t sp = 0; sp < n_sp; sp++)
                resident[sp] = LETHE_MAX(0, lethe_kv_row_len(pc->pool, sp, k->row) - c->share);
        LETHE_ASSERT(s->n_computed <= s->n_tokens);
        lethe_chain_finish(cc->t, c->id, s->tokens, s->n_tokens, k ? s->n_computed : 0, resident,
                           k);
        free(resident);
        /* hybrid: at most max_idle_states idle rows hold states; LRU ones go now */
        if (cc->states && lethe_chain_limit_idle(cc->t, cc->max_idle_states) > 0) cc_drain(pc);
    }
    free(c);
    *s->ref = NULL;
}

static void cc_begin_turn(lethe_prefix_cache *pc, const lethe_chain_begin_args *a,
                          lethe_chain_turn *out, void **ref) {
    chain_cache *cc = cc_of(pc);
    lethe_chain_begin_args b = *a;
    b.fingerprint = cc->fp;
    lethe_chain_begin(cc->t, &b, out);
    if (out->code != LETHE_CHAIN_OK) return;
    chain_ref *c = lethe_xcalloc(1, sizeof(*c));
    snprintf(c->id, sizeof(c->id), "%s", out->id);
    c->reused = out->reused;
    c->share = out->shared;
    *ref = c;
}

static void cc_cancel_turn(lethe_prefix_cache *pc, void *ref) {
    chain_ref *c = ref;
    LETHE_ASSERT(c->shared.n == 0); /* never admitted */
    lethe_chain_abandon(cc_of(pc)->t, c->id, NULL); /* an untaken payload is queued for drain */
    free(c);
}

static lethe_status cc_control(lethe_prefix_cache *pc, lethe_pc_ctl *c) {
    chain_cache *cc = cc_of(pc);
    if (c->kind == LETHE_PC_CTL_CHAIN_LIST) {
        c->n_out = lethe_chain_list(cc->t, c->entries, c->cap);
        return LETHE_OK;
    }
    if (!c->chain_id) return LETHE_OK; /* n_out = -1: unknown */
    switch (c->kind) {
    case LETHE_PC_CTL_CHAIN_LIST: break; /* above */
    case LETHE_PC_CTL_CHAIN_HISTORY:
        c->n_out = lethe_chain_history(cc->t, c->chain_id, c->out, c->cap);
        return LETHE_OK;
    case LETHE_PC_CTL_CHAIN_POSITIONS: {
        if (c->layer < 0 || c->layer >= lethe_kv_n_layers(pc->pool)) return LETHE_OK;
        const chain_kv *k = lethe_chain_peek_payload(cc->t, c->chain_id);
        if (!k) return LETHE_OK;
        if (k->on_host) { /* nothing resident: its KV is in the host tier */
            c->n_out = 0;
            return LETHE_OK;
        }
        int32_t sp = lethe_kv_space_of(pc->pool, c->layer);
        int32_t n = lethe_kv_row_len(pc->pool, sp, k->row);
        if (c->out)
            memcpy(c->out, lethe_kv_row_pos(pc->pool, sp, k->row),
                   (size_t)LETHE_MIN(n, c->cap) * sizeof(int32_t));
        c->n_out = n;
        return LETHE_OK;
    }
    }
    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "prefix cache chain: no control operation %d",
                        (int)c->kind);
}

static void cc_stats(lethe_prefix_cache *pc, lethe_pc_stats *out) {
    chain_cache *cc = cc_of(pc);
    lethe_chain_get_stats(cc->t, &out->chain);
    out->shared_blocks = lethe_radix_n_blocks(cc->tree);
    out->shared_hit_tokens = cc->shared_hit_tokens;
    lethe_radix_host_counts(cc->tree, &out->host_demoted, &out->host_promoted,
                            &out->host_promoted_tokens);
    out->chain_restored_tokens = cc->restored_entries;
}

static int64_t cc_reclaimable(const lethe_prefix_cache *pc) {
    return lethe_radix_reclaimable(((const chain_cache *)pc)->tree);
}

static void cc_evict(lethe_prefix_cache *pc, int64_t want_free) {
    lethe_radix_evict(cc_of(pc)->tree, (int32_t)LETHE_MIN(want_free, (int64_t)INT32_MAX));
}

static void cc_holder_for_each(void *pc, void (*visit)(void *, int32_t, int32_t), void *vctx) {
    lethe_kv_holder h = lethe_radix_holder(cc_of(pc)->tree);
    h.for_each(h.ctx, visit, vctx);
}

static void count_rows(void *ctx, void *payload) { *(int32_t *)ctx += ((chain_kv *)payload)->row >= 0; }

/* payloads with a row (a demoted chain's is in the host tier) */
static int32_t cc_rows_held(lethe_prefix_cache *pc) {
    int32_t n = 0;
    lethe_chain_for_each_payload(cc_of(pc)->t, count_rows, &n);
    return n;
}

typedef struct check_ctx {
    chain_cache *cc;
    const lethe_kv_pool *pool;
    uint8_t *seen; /* [max_rows] */
    int32_t bad_row;
    const char *why;
    int64_t payload_refs; /* shared-block references held by payloads */
} check_ctx;

static void check_payload(void *vctx, void *payload) {
    check_ctx *x = vctx;
    const chain_kv *k = payload;
    x->payload_refs += k->shared.n;
    if (x->why) return;
    if (k->on_host) { /* no row, no state: the KV is in the host tier or claimed back */
        if (k->row >= 0 || k->state) x->why = "is demoted but still holds a row or a state";
        x->bad_row = k->row;
        /* its blob (still in the tier or claimed) carries the row's states exactly when the
         * pool has states */
        chain_blob_hdr h;
        size_t n = 0;
        if (k->blob && k->blob_n >= sizeof(h)) {
            memcpy(&h, k->blob, sizeof(h));
            n = k->blob_n;
        } else if (!k->blob) {
            n = lethe_host_tier_read(x->cc->tier, LETHE_HOST_TIER_CHAIN, host_key(k), &h, sizeof(h));
        }
        const size_t lin = blob_lin_bytes(x->cc);
        if (!x->why && n >= sizeof(h) &&
            (h.magic != CHAIN_BLOB_MAGIC || h.lin_bytes != lin || n < sizeof(h) + lin))
            x->why = "is demoted to a blob without the row's linear-attention states";
        return;
    }
    if (k->row < 0 || k->row >= lethe_kv_max_rows(x->pool) || !lethe_kv_row_in_use(x->pool, k->row))
        x->why = "is not a KV row in use";
    else if (x->seen[k->row]++) x->why = "is held by two payloads";
    x->bad_row = k->row;
}

static void sum_refs(void *ctx, const lethe_radix_block *b) {
    *(int64_t *)ctx += lethe_radix_block_req_refs(b);
}

/* every payload owns a distinct live row (the engine checks that rows in use
 * = running requests + rows_held, and the pool recounts the slots, shared
 * prefix slots through the holder); the shared tree is consistent and its
 * request references are exactly the ones chains hold */
static lethe_status cc_check(lethe_prefix_cache *pc) {
    chain_cache *cc = cc_of(pc);
    check_ctx x = {.cc = cc, .pool = pc->pool, .seen = lethe_xcalloc((size_t)lethe_kv_max_rows(pc->pool), 1)};
    lethe_chain_for_each_payload(cc->t, check_payload, &x);
    free(x.seen);
    if (x.why)
        return lethe_errorf(LETHE_ERR_INVALID, "chain cache check: a payload's row %d %s",
                            x.bad_row, x.why);
    lethe_status st = lethe_radix_check(cc->tree);
    if (st != LETHE_OK) return st;
    int64_t refs = 0;
    lethe_radix_for_each_block(cc->tree, sum_refs, &refs);
    if (refs != cc->refs_held || x.payload_refs > cc->refs_held)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "chain cache check: shared blocks carry %lld request references, chains "
                            "hold %lld (%lld in idle payloads)",
                            (long long)refs, (long long)cc->refs_held, (long long)x.payload_refs);
    return LETHE_OK;
}

static void cc_destroy(lethe_prefix_cache *pc) {
    chain_cache *cc = cc_of(pc);
    void *buf[64];
    int32_t n;
    do {
        n = lethe_chain_drain_all(cc->t, buf, 64);
        for (int32_t i = 0; i < n; i++) kv_free(cc, buf[i]);
    } while (n == 64);
    lethe_chain_destroy(cc->t);
    LETHE_ASSERT(cc->refs_held == 0);
    lethe_radix_destroy(cc->tree);
    free(cc->match);
    free(cc);
}

static const lethe_prefix_cache_ops chain_ops = {
    .name = "chain",
    .match = cc_match,
    .acquire = cc_acquire,
    .commit = cc_commit,
    .publishes = cc_publishes,
    .release = cc_release,
    .reclaimable = cc_reclaimable,
    .evict = cc_evict,
    .drain = cc_drain,
    .begin_turn = cc_begin_turn,
    .cancel_turn = cc_cancel_turn,
    .control = cc_control,
    .stats = cc_stats,
    .holder_for_each = cc_holder_for_each,
    .rows_held = cc_rows_held,
    .check = cc_check,
    .destroy = cc_destroy,
};

lethe_prefix_cache *lethe_chain_cache_create(const lethe_pc_params *p) {
    chain_cache *cc = lethe_xcalloc(1, sizeof(*cc));
    cc->base = (lethe_prefix_cache){.ops = &chain_ops,
                                    .pool = p->pool,
                                    .release_state = p->release_state,
                                    .release_ctx = p->release_ctx,
                                    .snapshot_state = p->snapshot_state,
                                    .restore_state = p->restore_state};
    cc->tier = p->host_tier;
    cc->states = lethe_kv_has_states(p->pool);
    cc->max_idle_states = p->snapshot_slots;
    lethe_chain_table_params cp = {.n_spaces = lethe_kv_n_spaces(p->pool),
                                   .slots_per_space = lethe_kv_n_slots(p->pool),
                                   .share_block = LETHE_RADIX_BLOCK,
                                   .demote = p->host_tier != NULL,
                                   .claim = host_claim,
                                   .present = host_present,
                                   .host_ctx = cc};
    cc->t = lethe_chain_create(&cp);
    const char *d = p->kv_description ? p->kv_description : "";
    lethe_chain_fingerprint(d, cc->fp);
    /* shared prefixes are the exact prefill of their tokens: the radix cache's seed */
    int32_t block = LETHE_RADIX_BLOCK;
    cc->tree = lethe_radix_create(p->pool, lethe_hash64(&block, sizeof(block),
                                                        lethe_hash64(d, strlen(d), 0x1e7e)));
    lethe_radix_set_host_tier(cc->tree, p->host_tier);
    return &cc->base;
}

/* prefix_cache.h - the one seam between requests and whatever keeps KV
 * across requests: the radix prefix cache (radix_cache.c over radix.c) and
 * the Chain Cache (chain_cache.c over chain.c) are two implementations of
 * lethe_prefix_cache_ops; the scheduler and the engine call the lethe_pcache_*
 * wrappers below and never learn which one is active. A NULL cache is
 * "off": every wrapper accepts it and answers "nothing cached".
 *
 * The model: a request's KV row is [prefix the cache supplied | continuation
 * the request computes]. The cache is asked, in order:
 *
 *   match     (read-only) how much of the prompt it can supply: logical
 *             tokens, the row entries they occupy (fewer when pruned or
 *             compacted), slots attaching would pin; whether it hands over
 *             a whole resident row with the method's state (a resumed chain);
 *   acquire   attach it: shared read-only slots into the fresh row (radix),
 *             or the resident row + state themselves (chain);
 *   commit    after every step: publish what the request computed that others
 *             may share (radix: newly completed 16-token blocks);
 *   release   when the request is preempted, finishes or fails: drop shared
 *             references; a finished chain turn keeps its row and state as
 *             the chain's payload, a failed one invalidates the chain.
 *
 * Capacity: `reclaimable` is what the cache would give back under pressure
 * (the scheduler counts it as available), `evict` gives it back. Payloads the
 * cache let go of from another thread (a chain reclaimed by a new turn's
 * admission) are freed by `drain`, on the engine thread, before new work is
 * admitted.
 *
 * Threads: match/acquire/commit/release/reclaimable/evict/drain/holder/
 * rows_held/check run on the engine thread (they touch the KV pool);
 * begin_turn, cancel_turn and stats may run on any thread; control says per
 * kind.
 *
 * lethe_pc_match.resident < tokens carries a prefix whose physical payload
 * is smaller than its logical length: pruned radix blocks, a compacted chain
 * row. Pruning and radix control (src/engine/engine_prune.c, engine_pcctl.c)
 * are operations of the radix tree alone and reach it through
 * lethe_radix_cache_tree. Chains that branch from a shared prefix are the
 * Chain Cache's (chain_cache.c: a radix tree of shared prefixes beside the
 * table; match returns the shared blocks, the row is [shared | private]). */
#ifndef LETHE_PREFIX_CACHE_H
#define LETHE_PREFIX_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/chain.h"
#include "core/status.h"
#include "kv/kv_pool.h"

typedef struct lethe_prefix_cache lethe_prefix_cache;

/* What the cache sees of a request (the scheduler fills it from lethe_req):
 * the token history, progress, and the fields the cache may hand over or
 * take (row, method state) plus its own per-request record. */
typedef struct lethe_pc_seq {
    uint64_t id;
    const int32_t *tokens;      /* [n_tokens] prompt then generated */
    int32_t n_tokens;
    int32_t n_computed;         /* tokens with KV in *row */
    int32_t n_prompt;           /* the user's prompt; tokens past it (generated) were computed
                                 * one per step, also when re-prefilled after a preemption */
    int32_t *row;               /* KV row, -1 when none */
    void **method_state;        /* the sparse method's per-request state */
    void **ref;                 /* the cache's record for this request (NULL: none) */
} lethe_pc_seq;

/* The answer of match; valid until the next match call. */
typedef struct lethe_pc_match {
    int32_t tokens;             /* logical tokens supplied: computing starts there */
    int32_t resident;           /* row entries they occupy, max over slot spaces (<= tokens) */
    int64_t pinned;             /* slots per space acquiring takes out of `reclaimable` */
    int32_t queried;            /* prompt tokens looked up in a shared index (hit-rate
                                 * statistics; 0 for a chain turn, which is not a lookup) */
    bool resume;                /* a resident row + method state is handed over: the
                                 * scheduler allocates no row and skips request_init */
    int32_t shareable;          /* prompt tokens [0, shareable) this request could attach
                                 * from shared blocks once they are published (radix: the
                                 * whole usable prompt; a new branching chain: its shared
                                 * prefix; 0: none): the scheduler lets it wait for another
                                 * request that is computing them (in-flight sharing) */
    int32_t share_block;        /* shared blocks are whole multiples of this many tokens */
} lethe_pc_match;

typedef enum lethe_pc_end {
    LETHE_PC_END_OK = 0,        /* finished: the cache may keep what it computed */
    LETHE_PC_END_FAILED,        /* aborted or failed: nothing of it is kept */
    LETHE_PC_END_PREEMPTED,     /* preempted by recompute: it will be admitted again */
} lethe_pc_end;

/* Operations addressed to the active cache by kind (inspection, control).
 * An implementation answers the kinds it knows; the others are
 * LETHE_ERR_UNSUPPORTED. */
typedef enum lethe_pc_ctl_kind {
    LETHE_PC_CTL_CHAIN_HISTORY = 1, /* any thread: a chain's logical token history */
    LETHE_PC_CTL_CHAIN_POSITIONS,   /* engine thread: an IDLE chain's resident positions
                                     * in `layer` */
    LETHE_PC_CTL_CHAIN_LIST,        /* any thread: every chain into `entries`, most
                                     * recently used first (chain_id unused) */
} lethe_pc_ctl_kind;

typedef struct lethe_pc_ctl {
    lethe_pc_ctl_kind kind;
    const char *chain_id;
    int32_t layer;
    int32_t *out;               /* copies up to cap values (may be NULL) */
    lethe_chain_entry *entries; /* CHAIN_LIST: copies up to cap entries (may be NULL) */
    int32_t cap;
    int32_t n_out;              /* result: full length (-1 when the id is unknown) */
} lethe_pc_ctl;

/* Whether a control kind needs the engine thread (the pool) or runs anywhere. */
bool lethe_pcache_ctl_engine_thread(lethe_pc_ctl_kind kind);

/* Counters a cache publishes; fields that do not apply stay 0. Chain
 * counters are those of lethe_chain_get_stats. */
typedef struct lethe_pc_stats {
    lethe_chain_stats chain;
    int32_t shared_blocks;      /* chain mode: blocks of the shared-prefix tree (branching) */
    int64_t shared_hit_tokens;  /* chain mode: prompt tokens attached from shared prefixes */
    /* host tier (cumulative): blocks demoted / promoted back, tokens promoted */
    int64_t host_demoted, host_promoted, host_promoted_tokens;
    int64_t chain_restored_tokens; /* chain mode: KV entries restored from demoted chains */
    /* radix cache of a hybrid model: state snapshots held now, taken, dropped
     * for room (LRU), resumed from, and the matched tokens after the snapshot
     * a hit resumed from, which it recomputed (cumulative) */
    int32_t snapshots;
    int64_t snapshots_taken, snapshots_evicted, snapshot_hits, snapshot_recomputed_tokens;
    int64_t snapshots_demoted, snapshots_restored; /* with their blocks, to / from the host tier */
} lethe_pc_stats;

typedef struct lethe_prefix_cache_ops {
    const char *name;           /* "radix" | "chain" (lethe_engine_prefix_cache_mode) */

    /* ---- a request's life (engine thread) ---- */
    void (*match)(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_match *out);
    /* right after match for the same request, row allocated unless m->resume */
    void (*acquire)(lethe_prefix_cache *pc, const lethe_pc_seq *s, const lethe_pc_match *m);
    void (*commit)(lethe_prefix_cache *pc, const lethe_pc_seq *s); /* NULL: nothing to publish */
    /* tokens [0, n) of a running request's history that commit publishes as
     * shared blocks once computed (radix: all of them; a branching chain:
     * its shared prefix); NULL: 0 */
    int32_t (*publishes)(lethe_prefix_cache *pc, const lethe_pc_seq *s);
    /* the most tokens of a prefill chunk from token `start` (n asked, >= 1):
     * the radix cache of a hybrid model ends chunks where it takes state
     * snapshots (NULL: n) */
    int32_t (*chunk_end)(lethe_prefix_cache *pc, const lethe_pc_seq *s, int32_t start, int32_t n);
    /* before the scheduler frees *row and *method_state (what the cache took is -1 / NULL then) */
    void (*release)(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_end how);

    /* ---- capacity (engine thread) ---- */
    int64_t (*reclaimable)(const lethe_prefix_cache *pc);  /* NULL: 0 slots per space */
    void (*evict)(lethe_prefix_cache *pc, int64_t want_free); /* NULL: nothing to evict */
    void (*drain)(lethe_prefix_cache *pc);                 /* NULL: nothing is released late */

    /* ---- conversation turns (any thread; NULL: LETHE_CHAIN_MODE_DISABLED) ---- */
    void (*begin_turn)(lethe_prefix_cache *pc, const lethe_chain_begin_args *a,
                       lethe_chain_turn *out, void **ref);
    /* a begun turn that never reached the scheduler */
    void (*cancel_turn)(lethe_prefix_cache *pc, void *ref);

    /* ---- inspection ---- */
    lethe_status (*control)(lethe_prefix_cache *pc, lethe_pc_ctl *c); /* NULL: nothing supported */
    void (*stats)(lethe_prefix_cache *pc, lethe_pc_stats *out);        /* NULL: zeros */
    /* slot references held outside rows, for lethe_kv_check (NULL: none) */
    void (*holder_for_each)(void *pc, void (*visit)(void *, int32_t, int32_t), void *vctx);
    /* state slots it holds (snapshots), for lethe_kv_check (NULL: none) */
    void (*holder_for_each_state)(void *pc, void (*visit)(void *, int32_t), void *vctx);
    int32_t (*rows_held)(lethe_prefix_cache *pc);  /* KV rows held outside requests (NULL: 0) */
    lethe_status (*check)(lethe_prefix_cache *pc);         /* own invariants (NULL: none) */

    void (*destroy)(lethe_prefix_cache *pc);               /* frees every payload it holds */
} lethe_prefix_cache_ops;

/* Frees a method state the cache holds (a chain's payload): the engine
 * passes the sparse method's request_finished. */
typedef void (*lethe_pc_release_state_fn)(void *ctx, void *state);
/* A chain demoted to the host tier takes its method state along: snapshot
 * writes state into buf[0..cap) and returns its size (buf NULL: the size
 * only; SIZE_MAX: this state cannot be saved, the chain is not demoted);
 * restore builds a fresh state from those bytes (the method's snapshot /
 * restore hooks). NULL state: nothing to save. */
typedef size_t (*lethe_pc_snapshot_fn)(void *ctx, const void *state, void *buf, size_t cap);
typedef lethe_status (*lethe_pc_restore_fn)(void *ctx, const void *buf, size_t n, void **state);

/* The part every implementation embeds first. */
struct lethe_prefix_cache {
    const lethe_prefix_cache_ops *ops;
    lethe_kv_pool *pool;
    lethe_pc_release_state_fn release_state;
    void *release_ctx;
    lethe_pc_snapshot_fn snapshot_state; /* NULL: states cannot be saved */
    lethe_pc_restore_fn restore_state;
};

typedef struct lethe_pc_params {
    const char *mode;           /* "auto" (NULL, "") | "radix" | "chain" */
    bool enabled;               /* prefix caching on (--enable-prefix-caching) */
    bool shareable;             /* the method's per-token KV does not depend on history:
                                 * blocks can be shared (LETHE_SPARSE_PREFIX_CACHE) */
    const char *method;         /* method name, for messages */
    lethe_kv_pool *pool;
    /* everything that shapes KV content for the same tokens (model, dtype,
     * method and knobs, ...): hashed into block ids and chain fingerprints */
    const char *kv_description;
    lethe_pc_release_state_fn release_state; /* NULL: requests carry no method state */
    void *release_ctx;                       /* also the context of the two below */
    lethe_pc_snapshot_fn snapshot_state;     /* NULL: chains with a method state stay in the pool */
    lethe_pc_restore_fn restore_state;
    /* host-memory tier for evicted prefix blocks and, in chain mode, idle
     * chains' KV (--host-cache-bytes), NULL = none; the engine owns it (it
     * outlives the cache) */
    struct lethe_host_tier *host_tier;
    /* Hybrid models (the pool has per-request states): the radix cache keeps
     * at most snapshot_slots state snapshots (state slots the engine added to
     * the pool for them), one every snapshot_every tokens of a prompt (a
     * multiple of LETHE_GDN_CHUNK) and one at the prompt's last multiple of
     * LETHE_GDN_CHUNK; a hit resumes from the deepest snapshot of the match. */
    int32_t snapshot_slots;
    int32_t snapshot_every;
} lethe_pc_params;

/* The mode choice: auto = radix when the method's KV is shareable, else the
 * Chain Cache; an explicit mode that cannot work is an error with the flag
 * named. *out = NULL (LETHE_OK) when prefix caching is off. */
lethe_status lethe_pcache_create(const lethe_pc_params *p, lethe_prefix_cache **out);
void lethe_pcache_destroy(lethe_prefix_cache *pc); /* NULL-safe; needs the pool and method alive */

/* the implementations (chosen by lethe_pcache_create) */
lethe_prefix_cache *lethe_radix_cache_create(const lethe_pc_params *p);
lethe_prefix_cache *lethe_chain_cache_create(const lethe_pc_params *p);
/* The tree behind a radix prefix cache (tests, inspection); NULL for another kind. */
typedef struct lethe_radix lethe_radix;
lethe_radix *lethe_radix_cache_tree(lethe_prefix_cache *pc);

const char *lethe_pcache_mode(const lethe_prefix_cache *pc); /* "radix" | "chain" | "off" */
/* whether begin_turn works (the engine takes chain turns) */
bool lethe_pcache_takes_turns(const lethe_prefix_cache *pc);

void lethe_pcache_match(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_match *out);
void lethe_pcache_acquire(lethe_prefix_cache *pc, const lethe_pc_seq *s, const lethe_pc_match *m);
void lethe_pcache_commit(lethe_prefix_cache *pc, const lethe_pc_seq *s);
int32_t lethe_pcache_publishes(lethe_prefix_cache *pc, const lethe_pc_seq *s);
int32_t lethe_pcache_chunk_end(lethe_prefix_cache *pc, const lethe_pc_seq *s, int32_t start, int32_t n);
void lethe_pcache_release(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_end how);
int64_t lethe_pcache_reclaimable(const lethe_prefix_cache *pc);
void lethe_pcache_evict(lethe_prefix_cache *pc, int64_t want_free);
void lethe_pcache_drain(lethe_prefix_cache *pc);
/* out->code = LETHE_CHAIN_MODE_DISABLED (message empty) when the cache takes
 * no turns; on OK *ref goes into the request (lethe_req.cache_ref). */
void lethe_pcache_begin_turn(lethe_prefix_cache *pc, const lethe_chain_begin_args *a,
                             lethe_chain_turn *out, void **ref);
void lethe_pcache_cancel_turn(lethe_prefix_cache *pc, void *ref);
lethe_status lethe_pcache_control(lethe_prefix_cache *pc, lethe_pc_ctl *c);
void lethe_pcache_stats(lethe_prefix_cache *pc, lethe_pc_stats *out);
/* always usable (visits nothing when the cache holds no slot outside rows) */
lethe_kv_holder lethe_pcache_holder(lethe_prefix_cache *pc);
int32_t lethe_pcache_rows_held(lethe_prefix_cache *pc);
lethe_status lethe_pcache_check(lethe_prefix_cache *pc);

#endif /* LETHE_PREFIX_CACHE_H */

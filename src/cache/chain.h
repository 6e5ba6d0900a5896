/* chain.h - the Chain Cache table: one record per multi-turn conversation
 * whose KV (possibly compacted by an eviction method) stays resident between
 * turns, so a turn only prefills the tokens appended since the last one.
 *
 * Why: an eviction method's KV depends on the whole history and on the chunk
 * partition, so a block-hash prefix cache cannot reuse it; a chain is one
 * exclusive, mutable, non-branching continuation instead.
 *
 * The table owns the logical lifecycle only (ids, states, boundaries,
 * digests, token history, capacity planning, LRU, tombstones). What is
 * resident (a KV row, the method's per-request state) is an opaque payload
 * owned by the prefix-cache implementation over this table (chain_cache.c);
 * the table keeps it while the chain is IDLE, hands it over when the turn's
 * request is admitted, takes it back at the end, and queues the payloads of
 * reclaimed or invalidated chains for the engine thread to free
 * (lethe_chain_take_released).
 *
 * Capacity: the pool has n_spaces slot spaces of `slots_per_space` slots
 * each (1 shared space, or one per layer: never summed). An IDLE chain
 * occupies its resident slots, an ACTIVE one its reservation (resident +
 * suffix + decode peak, per space). A turn fits when every space's usage
 * stays within capacity; otherwise IDLE chains are reclaimed in strict LRU
 * order (logical clock, no ties); ACTIVE chains never; if even reclaiming
 * every IDLE chain is not enough the turn fails with CAPACITY and nothing
 * is reclaimed. Reclaimed or invalidated ids are remembered in a bounded
 * FIFO of tombstones so later requests get GONE, not NOT_FOUND. With a host
 * tier (params.demote) reclaim demotes instead: the chain keeps its record
 * and history, its payload goes to host memory, and its next turn is
 * admitted with the slots it will need again (the KV is restored before the
 * suffix is processed); a chain the tier has dropped is GONE. A branching
 * chain's shared prefix (begin_args.share_tokens) is not part of its
 * resident or reserved slots: each distinct shared prefix counts once, while
 * any chain holds it.
 *
 * All functions are thread-safe (one mutex): the server thread begins turns,
 * the engine thread finishes them. The prefix-cache seam (prefix_cache.h)
 * is how the engine reaches them. */
#ifndef LETHE_CHAIN_H
#define LETHE_CHAIN_H

#include <stdbool.h>
#include <stdint.h>

#define LETHE_CHAIN_ID_CAP 48          /* "chain_" + 32 base64url chars (192 bits) + NUL */
#define LETHE_CHAIN_FP_BYTES 32        /* SHA-256 */
#define LETHE_CHAIN_DEFAULT_TOMBSTONES 1024
#define LETHE_CHAIN_OWNER_CAP 72         /* tenant name + NUL (longer names are refused upstream) */

/* lethe_chain_code (the outcome of a turn) is public: include/lethe.h. The
 * HTTP server maps codes onto statuses and code strings (chain_api.c). */
#include "core/status.h"

/* The C API status a refused turn returns (CAPACITY, NOT_FOUND, INVALID, BUSY). */
lethe_status lethe_chain_code_status(lethe_chain_code c);

typedef enum lethe_chain_status {
    LETHE_CHAIN_CREATED = 0,
    LETHE_CHAIN_RESUMED,
    LETHE_CHAIN_RECREATED,
} lethe_chain_status;
const char *lethe_chain_status_name(lethe_chain_status s); /* "created" | "resumed" | "recreated" */

typedef enum lethe_chain_state { LETHE_CHAIN_IDLE = 0, LETHE_CHAIN_ACTIVE } lethe_chain_state;

typedef struct lethe_chain_table_params {
    int32_t n_spaces;          /* slot spaces of the KV pool (1 shared or n_layers) */
    int32_t slots_per_space;
    int32_t max_tombstones;    /* 0 = LETHE_CHAIN_DEFAULT_TOMBSTONES */
    int32_t share_block;       /* shared prefixes are whole blocks of this many tokens (0 = 1) */
    /* Host tier (chain_cache.c): reclaim demotes an IDLE chain's payload
     * instead of dropping it (the payload is queued for the engine thread,
     * lethe_chain_take_demotions, and the chain stays IDLE with no resident
     * slots); a later turn claims it back. claim runs under the table's lock
     * when such a turn is admitted: it takes the payload's KV out of the host
     * tier (false: the tier dropped it, the chain is gone); present says,
     * without taking, whether the tier still holds it (sweeps). */
    bool demote;
    bool (*claim)(void *ctx, void *payload);
    bool (*present)(void *ctx, void *payload);
    void *host_ctx;
} lethe_chain_table_params;

typedef struct lethe_chain_table lethe_chain_table;

lethe_chain_table *lethe_chain_create(const lethe_chain_table_params *p);
/* Frees records and tombstones. Payloads still held (IDLE chains, pending
 * releases) are NOT freed: drain them first with lethe_chain_drain_all. */
void lethe_chain_destroy(lethe_chain_table *t);

/* ---- hashing and ids ---- */
/* SHA-256 over the int64 little-endian token ids. */
void lethe_chain_digest(const int32_t *tokens, int32_t n, uint8_t out[LETHE_CHAIN_FP_BYTES]);
/* SHA-256 of a description of everything that shapes KV (model, dtype,
 * method and knobs, max length, ...). */
void lethe_chain_fingerprint(const char *description, uint8_t out[LETHE_CHAIN_FP_BYTES]);
/* "chain_" + base64url(24 bytes from getrandom()); 0 on success. */
int lethe_chain_new_id(char out[LETHE_CHAIN_ID_CAP]);
/* An id a client or a load balancer may name a new chain with: 8 to
 * LETHE_CHAIN_ID_CAP - 1 bytes of [A-Za-z0-9_.-] (so it is safe in a header,
 * a log line and a label). */
bool lethe_chain_id_valid(const char *id);

/* ---- a turn ---- */

typedef struct lethe_chain_begin_args {
    const char *chain_id;      /* NULL or "": create a new chain */
    const char *new_id;        /* creating: use this id (lethe_chain_id_valid, not in use nor
                                * tombstoned for any owner) instead of lethe_chain_new_id's */
    const char *owner;         /* tenant (NULL = ""): a chain of another owner is NOT_FOUND (and its
                                * tombstone too), as if it did not exist */
    const uint8_t *fingerprint; /* [LETHE_CHAIN_FP_BYTES] of the engine serving the turn
                                * (lethe_pcache_begin_turn fills in the cache's own) */
    const int32_t *tokens;     /* full prompt, or (append) the appended tokens only */
    int32_t n_tokens;
    bool append;               /* tokens continue the chain's history (requires chain_id) */
    int32_t gen_peak;          /* extra slots per space the turn may add after the prompt
                                * (max new tokens + method staging; capped by max_len) */
    int32_t max_len;           /* full prompt + gen must stay within this (0 = no check) */
    /* chat bookkeeping (0 for token prompts): messages in the conversation
     * this turn sends (its history included), and in append mode the index of
     * the first appended message, which must equal the number of messages the
     * chain already covers (its last one being the assistant response) */
    int32_t n_messages;
    int32_t append_start;
    /* creating (or recreating) a chain: its first share_tokens prompt tokens
     * (rounded down to whole share_block blocks, at most up to the last whole
     * block before the prompt's last token) are a prefix it shares with other
     * chains (branching): counted once per distinct prefix in the capacity
     * plan, not in the chain's own resident/reserved slots. Ignored when the
     * turn resumes a chain (it keeps its own). */
    int32_t share_tokens;
} lethe_chain_begin_args;

typedef struct lethe_chain_turn {
    lethe_chain_code code;     /* != OK: nothing changed except tombstone lookups */
    char message[192];         /* why, when code != OK */
    char id[LETHE_CHAIN_ID_CAP];
    lethe_chain_status status;
    int32_t reused;            /* prompt tokens with resident KV (0 unless resumed) */
    int32_t *tokens;           /* full prompt of the turn (malloc'd; caller frees) */
    int32_t n_tokens;
    int32_t n_reclaimed;       /* IDLE chains reclaimed to make room */
    int32_t shared;            /* the chain's shared prefix (tokens; 0: none) */
} lethe_chain_turn;

/* Admission of a turn (lookup, state, fingerprint, digest, capacity with LRU
 * reclaim). On OK the chain is ACTIVE with its reservation held. */
void lethe_chain_begin(lethe_chain_table *t, const lethe_chain_begin_args *a, lethe_chain_turn *out);

/* The resident KV handle of a resumed turn's chain (NULL if none), handed to
 * the caller (the engine thread, when it admits the turn's request); it
 * stays in the record until then, so reclaim/count see it. */
void *lethe_chain_take_payload(lethe_chain_table *t, const char *id);
/* The payload of an IDLE chain without taking it (NULL otherwise). */
void *lethe_chain_peek_payload(lethe_chain_table *t, const char *id);
/* The payload an ACTIVE (resumed) turn has not taken yet, without taking it
 * (NULL if none, already taken, or the chain is not ACTIVE). */
void *lethe_chain_turn_payload(lethe_chain_table *t, const char *id);
/* Payloads the table holds (records + pending releases). */
int32_t lethe_chain_count_payloads(lethe_chain_table *t);
/* Calls visit(ctx, payload) for every payload the table holds (records and
 * pending releases), under the table's lock (visit must not call back). */
void lethe_chain_for_each_payload(lethe_chain_table *t, void (*visit)(void *ctx, void *payload), void *ctx);

/* End of a successful turn: history = the request's tokens (prompt +
 * generated), processed = tokens with KV (n_tokens - 1: the last sampled
 * token has none), resident = slots per space now held (its private part:
 * a shared prefix is counted once for all the chains that share it),
 * payload = the KV handle (NULL: nothing resident, the next turn recomputes
 * from 0). */
void lethe_chain_finish(lethe_chain_table *t, const char *id, const int32_t *tokens, int32_t n_tokens,
                        int32_t processed, const int32_t *resident, void *payload);

/* Reclaims IDLE chains holding a resident payload, least recently used
 * first, until at most max_idle are left (a hybrid model's chains each hold
 * one state slot of a fixed number, chain_cache.c); returns how many. The
 * victims go as by capacity reclaim: queued for demotion with a host tier
 * (lethe_chain_take_demotions), else tombstoned with their payloads queued
 * for release. */
int32_t lethe_chain_limit_idle(lethe_chain_table *t, int32_t max_idle);

/* The turn failed or was aborted: the chain is invalidated (tombstoned) and
 * payload (may be NULL) is queued for release. */
void lethe_chain_abandon(lethe_chain_table *t, const char *id, void *payload);

/* ---- host tier (params.demote) ---- */
/* Payloads reclaim chose to demote, for the engine thread to copy to the
 * host tier (call until it returns < cap); their chains are marked as being
 * moved: a turn for one waits until lethe_chain_demoted. */
int32_t lethe_chain_take_demotions(lethe_chain_table *t, void **out, int32_t cap);
/* The payload's KV is in the host tier (ok), or it could not be put there
 * (!ok: the chain is invalidated and the payload queued for release). */
void lethe_chain_demoted(lethe_chain_table *t, void *payload, bool ok);
/* Chains whose demoted KV the host tier no longer holds (params.present)
 * are invalidated (tombstoned, payloads queued for release); returns how many. */
int32_t lethe_chain_sweep_host(lethe_chain_table *t);

/* Payloads of reclaimed/invalidated chains the engine must free now;
 * returns how many were written (call until it returns < cap). */
int32_t lethe_chain_take_released(lethe_chain_table *t, void **out, int32_t cap);
/* Every payload (IDLE chains and pending releases): for engine shutdown. */
int32_t lethe_chain_drain_all(lethe_chain_table *t, void **out, int32_t cap);

/* ---- inspection ---- */

typedef struct lethe_chain_info {
    lethe_chain_state state;
    int32_t processed;         /* tokens with KV */
    int32_t n_history;         /* logical token history length */
    int32_t n_messages;        /* chat messages covered (incl. the last response) */
    uint64_t last_access;      /* logical LRU clock */
    int64_t resident_total;    /* resident private slots summed over spaces */
    int32_t resident_max;      /* max over spaces */
    int32_t shared;            /* tokens of its shared prefix (0: none) */
    bool on_host;              /* its KV is (being) demoted to the host tier: resident 0 */
    uint8_t digest[LETHE_CHAIN_FP_BYTES];
} lethe_chain_info;

/* LETHE_CHAIN_OK, NOT_FOUND or GONE. */
lethe_chain_code lethe_chain_lookup(lethe_chain_table *t, const char *id, lethe_chain_info *out);

/* Every chain, most recently used first (copies up to cap); returns how many
 * chains there are. */
typedef struct lethe_chain_entry {
    char id[LETHE_CHAIN_ID_CAP];
    lethe_chain_info info;
} lethe_chain_entry;
int32_t lethe_chain_list(lethe_chain_table *t, lethe_chain_entry *out, int32_t cap);
/* Copies the history (up to cap tokens); returns its length, -1 if unknown. */
int32_t lethe_chain_history(lethe_chain_table *t, const char *id, int32_t *out, int32_t cap);

typedef struct lethe_chain_stats {
    int32_t n_chains, n_active, n_idle, n_tombstones;
    int64_t n_created, n_resumed, n_recreated;
    int64_t n_reclaimed, n_invalidated;
    int64_t n_rejected;        /* turns refused (any code) */
    int64_t n_capacity_rejected;
    int64_t reused_tokens, prompt_tokens; /* summed over admitted turns */
    int64_t resident_slots;    /* IDLE + ACTIVE resident, summed over spaces */
    int64_t reserved_slots;    /* usage incl. ACTIVE reservations, summed over spaces */
    int32_t n_branched;        /* chains with a shared prefix */
    int32_t n_shared_prefixes; /* distinct shared prefixes they hold */
    int64_t shared_slots;      /* slots of those prefixes, counted once, summed over spaces */
    /* host tier: chains whose KV is there now; demoted / claimed back by a
     * turn / lost (the tier dropped them: their ids answer GONE), cumulative */
    int32_t n_on_host;
    int64_t n_demoted, n_restored, n_lost;
} lethe_chain_stats;
void lethe_chain_get_stats(lethe_chain_table *t, lethe_chain_stats *out);

#endif /* LETHE_CHAIN_H */

/* request.h - the scheduler's view of one request.
 *
 * The token list is the request's whole history: prompt tokens followed by
 * generated ones. n_computed tokens have KV in the request's row; the rest
 * (at least one: the last sampled token, or the prompt) still have to go
 * through the forward. A step computes tokens[n_computed .. n_computed + n).
 *
 * Preemption by recompute: the row and prefix-cache references are dropped,
 * n_computed goes back to 0 and the request waits again at the head of the queue; on
 * re-admission prompt + generated tokens are prefilled as one prompt
 * (n_prefill = n_tokens then) and decoding continues where it stopped.
 *
 * The engine embeds this struct as the first member of its own request
 * record (engine_internal.h) and adds sampling, callbacks and detokenizer
 * state; the scheduler never looks past it. */
#ifndef LETHE_SCHED_REQUEST_H
#define LETHE_SCHED_REQUEST_H

#include <stdbool.h>
#include <stdint.h>

typedef enum lethe_req_state {
    LETHE_REQ_NEW = 0,      /* not yet handed to the scheduler */
    LETHE_REQ_WAITING,      /* queued (never admitted, or preempted) */
    LETHE_REQ_RUNNING,      /* owns a KV row */
    LETHE_REQ_FINISHED,
} lethe_req_state;

typedef struct lethe_req {
    uint64_t id;
    lethe_req_state state;

    int32_t *tokens;        /* [cap_tokens] prompt then generated tokens */
    int32_t n_tokens, cap_tokens;
    int32_t n_prompt;       /* the user's prompt length */
    int32_t n_prefill;      /* prompt tokens of the current admission (n_tokens at admission) */
    int32_t n_computed;     /* tokens whose KV is in the row */
    int32_t n_absent;       /* of those, supplied by the prefix cache without a row entry
                             * (pruned blocks): row length = n_computed - n_absent */
    int32_t *pinned;        /* [2 n_pinned] retention-pinned position ranges (start, end),
                             * protected in the row at admission (lethe_kv_row_protect) */
    int32_t n_pinned;
    int32_t protect_from; /* pins below this came with a shared prefix (not checked) */

    /* KV */
    int32_t row;            /* KV row id, -1 when none */
    void *cache_ref;        /* the prefix cache's record of what this request holds or
                             * continues (src/cache/prefix_cache.h): radix blocks, a chain
                             * turn; NULL when none */
    int32_t cached_tokens;  /* prompt tokens reused from the prefix cache at first admission */
    bool admitted_once;
    bool is_recompute;      /* current admission re-prefills after a preemption */
    int32_t n_preemptions;
    void *method_state;     /* the sparse method's per-request state */
    char fail_reason[192];  /* why the scheduler gave up on it (lethe_sched_out.failed) */

    /* scheduler bookkeeping */
    struct lethe_req *prev, *next; /* waiting list links */
    uint64_t arrival;       /* FCFS order */
} lethe_req;

/* Appends a token (grows the array). */
void lethe_req_push_token(lethe_req *r, int32_t tok);

#endif /* LETHE_SCHED_REQUEST_H */

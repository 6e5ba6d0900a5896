/* scheduler.h - continuous batching with chunked prefill, FCFS admission,
 * prefix-cache attach/publish and preemption by recompute.
 *
 * One call to lethe_sched_schedule() plans one engine step under two limits:
 * max_num_batched_tokens (tokens through the forward this step) and
 * max_num_seqs (requests holding KV at once). Order of decisions:
 *
 *  1. Running requests, oldest first: a decoding request takes 1 token, a
 *     prefilling one takes min(remaining prompt, tokens left in the budget).
 *     Before any slot is taken the sparse method is asked the peak slots per
 *     layer the work needs (lethe_sparse_*_peak); if free + reclaimable
 *     prefix-cache slots cannot cover it, a prefill chunk shrinks to what is
 *     available, else the NEWEST running request is preempted (its KV freed,
 *     it re-queues at the head of the waiting list) until it fits.
 *  2. Waiting requests, strictly FCFS (the head blocks the rest): the prefix
 *     cache is matched (shared blocks, or a chain turn's resident row), the
 *     first chunk's peak is checked against capacity (minus cached slots the
 *     match would pin) and only then are the row, the cached prefix and the
 *     new slots taken. No admission in a step that preempted (the memory is
 *     contended).
 *
 * Mixed steps (default, as vLLM): decode tokens and prefill chunks share a
 * step. With split_prefill_decode (the anchor's rule) a step is all prefill
 * (if any prefill work can run) or all decode. docs/architecture.md has the
 * CPU measurement behind the default.
 *
 * After the forward, lethe_sched_commit() advances n_computed and lets the
 * prefix cache publish what became shareable (newly completed 16-token
 * blocks for the radix cache). */
#ifndef LETHE_SCHEDULER_H
#define LETHE_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/prefix_cache.h"
#include "kv/kv_pool.h"
#include "sched/request.h"
#include "sparse/sparse.h"

typedef struct lethe_sched_params {
    int32_t max_num_seqs;
    int32_t max_num_batched_tokens;
    bool split_prefill_decode;
    /* > 1 (hybrid models: LETHE_GDN_CHUNK): a prefill chunk inside the
     * user's prompt ends at its end or at a multiple of this many positions,
     * past it (a recompute after preemption) one token per step */
    int32_t chunk_align;
} lethe_sched_params;

typedef struct lethe_sched_item {
    lethe_req *req;
    int32_t start;          /* first token index computed (== n_computed before the step) */
    int32_t n;              /* tokens computed this step */
    bool is_prefill;
    bool wants_logits;      /* the chunk reaches the last token: sample after the step */
} lethe_sched_item;

typedef struct lethe_sched_out {
    lethe_sched_item *items;   /* running order */
    int32_t n_items;
    int32_t n_tokens, n_prefill_tokens, n_decode_tokens;
    lethe_req **preempted;     /* preempted this step (already back in the waiting queue) */
    int32_t n_preempted;
    lethe_req **failed;        /* can never fit, removed from the queues: finish with an error */
    int32_t n_failed;
} lethe_sched_out;

typedef struct lethe_sched_stats {
    int64_t n_preemptions;
    int64_t prefix_queries_tokens, prefix_hit_tokens;
    int64_t n_inflight_waits; /* admissions put off to attach a prefix another request computes */
} lethe_sched_stats;

typedef struct lethe_sched lethe_sched;

/* pc may be NULL (prefix caching off); method may be NULL (dense defaults).
 * The scheduler drives the cache through lethe_pcache_* without knowing its
 * kind: match/acquire at admission, commit after each step, release at
 * preemption and removal, reclaimable/evict for capacity. */
lethe_sched *lethe_sched_create(const lethe_sched_params *p, lethe_kv_pool *pool, lethe_prefix_cache *pc,
                                lethe_sparse_method *method);
void lethe_sched_destroy(lethe_sched *s); /* the caller removes its requests first */

/* Queues a request (state NEW, n_tokens >= 1) at the tail of the waiting list. */
void lethe_sched_add(lethe_sched *s, lethe_req *r);
/* Plans one step; out stays valid until the next call. */
void lethe_sched_schedule(lethe_sched *s, lethe_sched_out *out);
/* After the forward of `out`: n_computed += n, then the prefix cache's commit
 * (the radix cache publishes newly completed blocks). */
void lethe_sched_commit(lethe_sched *s, const lethe_sched_out *out);
/* Removes a request wherever it is and frees its KV, prefix-cache references
 * and method state. ok: it finished normally (the prefix cache may keep what
 * it computed: a chain turn keeps its row); otherwise (abort, error) the
 * cache keeps nothing of it. State becomes FINISHED. */
void lethe_sched_remove(lethe_sched *s, lethe_req *r, bool ok);

bool lethe_sched_has_work(const lethe_sched *s);
int32_t lethe_sched_n_running(const lethe_sched *s);
int32_t lethe_sched_n_waiting(const lethe_sched *s);
lethe_req *lethe_sched_running_at(const lethe_sched *s, int32_t i);
const lethe_sched_stats *lethe_sched_get_stats(const lethe_sched *s);

/* Slots every slot space can still provide: free + what the prefix cache can reclaim. */
int64_t lethe_sched_available(const lethe_sched *s);

/* The method's view of a request for capacity questions and step hooks. */
void lethe_sched_seq_view(const lethe_req *r, int32_t n_new, int32_t q_row, lethe_sparse_seq *out);

#endif /* LETHE_SCHEDULER_H */

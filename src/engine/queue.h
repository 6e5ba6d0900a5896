/* queue.h - the engine's inbox: bounded submissions + unbounded cancels,
 * and calls to run on the engine thread (prefix-cache control, pruning).
 *
 * Any thread pushes; only the engine thread drains. Submissions are bounded
 * (a full queue answers LETHE_ERR_BUSY: back-pressure instead of unbounded
 * memory). Cancels are never refused or lost: they go to a separate growing
 * list. Both sit under one mutex and are drained together, so a cancel can
 * never overtake the submission it refers to (drain order: submissions, then
 * cancels). A condition variable wakes the idle engine thread. */
#ifndef LETHE_ENGINE_QUEUE_H
#define LETHE_ENGINE_QUEUE_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

typedef struct lethe_queue {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    void **items;          /* ring of submissions */
    int32_t cap, head, len;
    uint64_t *cancels;     /* pending cancel ids */
    int32_t n_cancels, cap_cancels;
    void **calls; /* pending engine-thread calls (never refused) */
    int32_t n_calls, cap_calls;
    bool stop;             /* wakes a waiting engine thread for shutdown */
} lethe_queue;

void lethe_queue_init(lethe_queue *q, int32_t cap);
void lethe_queue_destroy(lethe_queue *q); /* items left inside are the caller's to free first */

/* LETHE_OK, or LETHE_ERR_BUSY when cap submissions are already waiting. */
lethe_status lethe_queue_push(lethe_queue *q, void *item);
void lethe_queue_cancel(lethe_queue *q, uint64_t id);
void lethe_queue_set_stop(lethe_queue *q, bool stop);
/* A call for the engine thread (never refused; drained by drain_calls). */
void lethe_queue_call(lethe_queue *q, void *item);
void lethe_queue_drain_calls(lethe_queue *q, void ***items, int32_t *n_items);

/* Moves everything out: submissions into *items (malloc'd, *n_items), cancels
 * into *ids (malloc'd, *n_ids); NULL/0 when empty. */
void lethe_queue_drain(lethe_queue *q, void ***items, int32_t *n_items, uint64_t **ids,
                       int32_t *n_ids);
/* Blocks until something is queued or stop is set; returns !stop. */
bool lethe_queue_wait(lethe_queue *q);
int32_t lethe_queue_pending(lethe_queue *q); /* submissions + cancels + calls waiting */

#endif /* LETHE_ENGINE_QUEUE_H */

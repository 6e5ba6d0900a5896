/* queue.c - bounded submission ring + cancel list under one mutex (queue.h). */
#include "engine/queue.h"

#include <stdlib.h>
#include <string.h>

#include "core/util.h"

void lethe_queue_init(lethe_queue *q, int32_t cap) {
    memset(q, 0, sizeof(*q));
    LETHE_ASSERT(cap > 0);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->cap = cap;
    q->items = lethe_xcalloc((size_t)cap, sizeof(void *));
}

void lethe_queue_destroy(lethe_queue *q) {
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q->items);
    free(q->cancels);
    free(q->calls);
    memset(q, 0, sizeof(*q));
}

lethe_status lethe_queue_push(lethe_queue *q, void *item) {
    pthread_mutex_lock(&q->mu);
    if (q->len == q->cap) {
        pthread_mutex_unlock(&q->mu);
        return lethe_errorf(LETHE_ERR_BUSY, "engine queue full (%d submissions waiting); retry later", q->cap);
    }
    q->items[(q->head + q->len) % q->cap] = item;
    q->len++;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return LETHE_OK;
}

void lethe_queue_cancel(lethe_queue *q, uint64_t id) {
    pthread_mutex_lock(&q->mu);
    if (q->n_cancels == q->cap_cancels) {
        q->cap_cancels = q->cap_cancels ? 2 * q->cap_cancels : 64;
        q->cancels = lethe_xrealloc(q->cancels, (size_t)q->cap_cancels * sizeof(uint64_t));
    }
    q->cancels[q->n_cancels++] = id;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

void lethe_queue_call(lethe_queue *q, void *item) {
    pthread_mutex_lock(&q->mu);
    if (q->n_calls == q->cap_calls) {
        q->cap_calls = q->cap_calls ? 2 * q->cap_calls : 16;
        q->calls = lethe_xrealloc(q->calls, (size_t)q->cap_calls * sizeof(void *));
    }
    q->calls[q->n_calls++] = item;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

void lethe_queue_drain_calls(lethe_queue *q, void ***items, int32_t *n_items) {
    pthread_mutex_lock(&q->mu);
    *items = q->calls;
    *n_items = q->n_calls;
    q->calls = NULL;
    q->n_calls = q->cap_calls = 0;
    pthread_mutex_unlock(&q->mu);
}

void lethe_queue_set_stop(lethe_queue *q, bool stop) {
    pthread_mutex_lock(&q->mu);
    q->stop = stop;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

void lethe_queue_drain(lethe_queue *q, void ***items, int32_t *n_items, uint64_t **ids,
                       int32_t *n_ids) {
    *items = NULL;
    *ids = NULL;
    *n_items = *n_ids = 0;
    pthread_mutex_lock(&q->mu);
    if (q->len > 0) {
        *items = lethe_xmalloc((size_t)q->len * sizeof(void *));
        for (int32_t i = 0; i < q->len; i++) (*items)[i] = q->items[(q->head + i) % q->cap];
        *n_items = q->len;
        q->head = (q->head + q->len) % q->cap;
        q->len = 0;
    }
    if (q->n_cancels > 0) {
        *ids = q->cancels;
        *n_ids = q->n_cancels;
        q->cancels = NULL;
        q->n_cancels = q->cap_cancels = 0;
    }
    pthread_mutex_unlock(&q->mu);
}

bool lethe_queue_wait(lethe_queue *q) {
    pthread_mutex_lock(&q->mu);
    while (!q->stop && q->len == 0 && q->n_cancels == 0 && q->n_calls == 0)
        pthread_cond_wait(&q->cv, &q->mu);
    bool go = !q->stop;
    pthread_mutex_unlock(&q->mu);
    return go;
}

int32_t lethe_queue_pending(lethe_queue *q) {
    pthread_mutex_lock(&q->mu);
    int32_t n = q->len + q->n_cancels + q->n_calls;
    pthread_mutex_unlock(&q->mu);
    return n;
}

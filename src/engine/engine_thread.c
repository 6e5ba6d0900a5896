/* engine_thread.c - threaded mode: one engine thread owns all engine state;
 * other threads only validate and enqueue (submit) or enqueue a cancel.
 *
 * The thread sleeps on the inbox while there is no work, runs steps while
 * there is, and applies the inbox at the start of every step (so a cancel
 * frees the request's KV within one step). A broken invariant with
 * --check-invariants stops the process with a message: continuing would
 * corrupt other requests' outputs. */
#include <stdlib.h>

#include "core/log.h"
#include "engine/engine_internal.h"

static void *engine_main(void *arg) {
    lethe_engine *e = arg;
    while (!atomic_load(&e->thr.stop)) {
        if (!lethe_sched_has_work(e->sched) && !lethe_queue_wait(&e->thr.inbox)) break;
        if (eng_step(e) != LETHE_OK) {
            LOG_ERROR("engine thread: %s", lethe_last_error());
            abort();
        }
    }
    return NULL;
}

int lethe_engine_start(lethe_engine *e) {
    if (e->thr.running) return lethe_errorf(LETHE_ERR_BUSY, "lethe_engine_start: already running");
    atomic_store(&e->thr.stop, false);
    lethe_queue_set_stop(&e->thr.inbox, false);
    e->thr.running = true;
    if (pthread_create(&e->thr.thread, NULL, engine_main, e) != 0) {
        e->thr.running = false;
        return lethe_errorf(LETHE_ERR_BACKEND, "lethe_engine_start: pthread_create failed");
    }
    return LETHE_OK;
}

void lethe_engine_stop(lethe_engine *e) {
    if (!e || !e->thr.running) return;
    atomic_store(&e->thr.stop, true);
    lethe_queue_set_stop(&e->thr.inbox, true);
    pthread_join(e->thr.thread, NULL);
    e->thr.running = false;
    lethe_queue_set_stop(&e->thr.inbox, false);
}

int lethe_engine_submit(lethe_engine *e, const lethe_request_params *p, uint64_t *id_out) {
    lethe_status st = eng_validate(e, p);
    if (st != LETHE_OK) return st;
    eng_req *q = eng_req_new(e, p);
    uint64_t id = q->r.id;
    st = lethe_queue_push(&e->thr.inbox, q);
    if (st != LETHE_OK) {
        eng_req_free(q);
        return st;
    }
    if (id_out) *id_out = id;
    return LETHE_OK;
}

void lethe_engine_cancel(lethe_engine *e, uint64_t id) { lethe_queue_cancel(&e->thr.inbox, id); }

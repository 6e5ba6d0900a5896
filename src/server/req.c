/* req.c - per-request event queues between the engine thread and the HTTP
 * connection threads (see req.h). The engine side never blocks on a client:
 * it only copies, appends and signals. Latency metrics are taken here, at the
 * moment the engine produces each token, like vLLM's engine-core timestamps. */
#include "server/req.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/util.h"
#include "server/metrics.h"

srv_req *srv_req_new(srv_metrics *m, double t_arrival, bool want_top) {
    srv_req *r = lethe_xcalloc(1, sizeof(*r));
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    r->refs = 1;
    r->metrics = m;
    r->t_arrival = t_arrival;
    r->want_top = want_top;
    return r;
}

void srv_req_ref(srv_req *r) {
    pthread_mutex_lock(&r->mu);
    r->refs++;
    pthread_mutex_unlock(&r->mu);
}

void srv_req_unref(srv_req *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    int left = --r->refs;
    pthread_mutex_unlock(&r->mu);
    LETHE_ASSERT(left >= 0);
    if (left > 0) return;
    srv_event_free_list(r->head);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

void srv_event_free_list(srv_event *e) {
    while (e) {
        srv_event *n = e->next;
        free(e->text);
        free(e->error);
        free(e);
        e = n;
    }
}

void srv_req_on_event(void *user, const lethe_event *ev) {
    srv_req *r = user;
    double now = lethe_time_s();
    srv_event *e = lethe_xcalloc(1, sizeof(*e));
    e->n_tokens = ev->n_tokens;
    e->token = ev->token;
    e->text = lethe_xstrdup(ev->text ? ev->text : "");
    e->logprob = ev->logprob;
    if (r->want_top && ev->top && ev->n_top > 0) {
        e->n_top = LETHE_MIN(ev->n_top, LETHE_MAX_TOP_LOGPROBS);
        memcpy(e->top, ev->top, (size_t)e->n_top * sizeof(e->top[0]));
    }
    e->finished = ev->finished;
    e->finish_reason = ev->finish_reason;
    if (ev->error) e->error = lethe_xstrdup(ev->error);
    e->error_status = ev->error_internal ? 500 : 400;

    pthread_mutex_lock(&r->mu);
    if (r->metrics && ev->n_tokens > 0) {
        if (!r->got_first) srv_metrics_observe(r->metrics, SRV_HIST_TTFT, now - r->t_arrival);
        else srv_metrics_observe(r->metrics, SRV_HIST_ITL, now - r->t_last_token);
        r->got_first = true;
        r->t_last_token = now;
    }
    if (r->metrics && ev->finished) {
        srv_metrics_finished(r->metrics, ev->finish_reason);
        if (ev->finish_reason != LETHE_FINISH_ERROR)
            srv_metrics_observe(r->metrics, SRV_HIST_E2E, now - r->t_arrival);
    }
    r->prompt_tokens = ev->prompt_tokens;
    r->completion_tokens = ev->completion_tokens;
    r->cached_tokens = ev->cached_tokens;
    if (r->tail) r->tail->next = e;
    else r->head = e;
    r->tail = e;
    if (ev->finished) {
        r->done = true;
        r->finish = ev->finish_reason;
    }
    pthread_cond_broadcast(&r->cv);
    srv_wake w = r->wake;
    pthread_mutex_unlock(&r->mu);
    if (ev->finished) {
        if (r->in_flight) atomic_fetch_sub(r->in_flight, 1);
        srv_req_unref(r); /* the engine's reference */
    }
    srv_wake_up(w); /* after the unref: the loop may free the request right away */
}

void srv_req_set_wake(srv_req *r, srv_wake w) {
    pthread_mutex_lock(&r->mu);
    r->wake = w;
    pthread_mutex_unlock(&r->mu);
}

srv_event *srv_req_take(srv_req *r, int timeout_ms) {
    pthread_mutex_lock(&r->mu);
    if (!r->head && timeout_ms > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_sec += timeout_ms / 1000;
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        while (!r->head) {
            int rc = pthread_cond_timedwait(&r->cv, &r->mu, &ts);
            if (rc == ETIMEDOUT) break;
        }
    }
    srv_event *e = r->head;
    r->head = r->tail = NULL;
    pthread_mutex_unlock(&r->mu);
    return e;
}

void srv_req_usage(srv_req *r, int32_t *prompt, int32_t *completion, int32_t *cached, bool *done) {
    pthread_mutex_lock(&r->mu);
    if (prompt) *prompt = r->prompt_tokens;
    if (completion) *completion = r->completion_tokens;
    if (cached) *cached = r->cached_tokens;
    if (done) *done = r->done;
    pthread_mutex_unlock(&r->mu);
}

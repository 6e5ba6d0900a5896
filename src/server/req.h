/* req.h - one in-flight generation as seen by the server: a queue of events
 * from the engine thread to the connection thread that waits for them.
 *
 * The engine callback (srv_req_on_event) runs on the engine thread: it copies
 * the event (the engine's text/top pointers die with the callback), appends
 * it under the request's mutex, records latency metrics, signals the
 * condvar and wakes the request's connection in the HTTP loop (conn.h),
 * which takes whole batches (srv_req_take) so a slow client never blocks
 * the engine. A request is reference counted: one
 * reference for the engine (dropped at the final event), one per server-side
 * holder (connection context, stream reader). */
#ifndef LETHE_SERVER_REQ_H
#define LETHE_SERVER_REQ_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "lethe.h"
#include "server/conn.h"

typedef struct srv_metrics srv_metrics;

typedef struct srv_event {
    struct srv_event *next;
    int32_t n_tokens;           /* 0 or 1 */
    int32_t token;
    char *text;                 /* owned, never NULL */
    float logprob;
    int32_t n_top;              /* top[0..n_top) valid (0 unless logprobs were asked) */
    lethe_top_logprob top[LETHE_MAX_TOP_LOGPROBS];
    bool finished;
    lethe_finish_reason finish_reason;
    char *error;                /* owned; finish_reason == ERROR */
    int error_status;           /* HTTP status for an error: 400 refused as asked, 500 failed inside */
} srv_event;

typedef struct srv_req {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    srv_event *head, *tail;     /* events not yet taken by the connection */
    int refs;
    bool done;                  /* the final event has arrived */
    bool submitted;             /* the engine holds a reference and knows `id` */
    uint64_t id;                /* engine request id */
    srv_metrics *metrics;       /* NULL: no metrics */
    atomic_int *in_flight;      /* decremented at the final event when submitted; may be NULL */
    double t_arrival;           /* lethe_time_s() when the HTTP request arrived */
    double t_last_token;
    bool got_first;
    bool want_top;              /* copy top logprobs */
    /* usage as of the latest event (read under mu) */
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    lethe_finish_reason finish;
    srv_wake wake;              /* the connection to wake after each event (under mu); zero: none */
} srv_req;

srv_req *srv_req_new(srv_metrics *m, double t_arrival, bool want_top); /* refs = 1 */
void srv_req_ref(srv_req *r);
void srv_req_unref(srv_req *r);

/* lethe_event_cb: user = the srv_req; the final event drops the engine's reference. */
void srv_req_on_event(void *user, const lethe_event *ev);

/* Detaches every queued event (oldest first). Waits up to timeout_ms for one
 * when the queue is empty; returns NULL on timeout. */
srv_event *srv_req_take(srv_req *r, int timeout_ms);
/* Which connection the engine callback wakes; {0} detaches (the response is gone). */
void srv_req_set_wake(srv_req *r, srv_wake w);
void srv_event_free_list(srv_event *e);

/* Snapshot of usage and state under the lock. */
void srv_req_usage(srv_req *r, int32_t *prompt, int32_t *completion, int32_t *cached, bool *done);

#endif /* LETHE_SERVER_REQ_H */

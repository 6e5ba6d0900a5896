/* http.c - libmicrohttpd glue: listener, routing, auth, request bodies,
 * streaming (SSE), client disconnects, request log, startup and shutdown.
 *
 * libmicrohttpd runs one thread per connection, so a handler may block: a
 * non-streaming request waits on its srv_req queue inside the access handler;
 * a streaming one returns a chunked response whose content reader blocks for
 * the next batch of events. Both wait in short slices (POLL_MS) and between
 * slices peek at the socket: a peer that closed (recv returns 0) or reset has
 * its request cancelled with lethe_engine_cancel(), which the engine applies
 * at the start of its next step (KV freed there). A failed write ends the
 * response the same way through the reader's free callback, and the request-
 * completed callback cancels anything still running as a last resort.
 *
 * Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions,
 * POST /v1/chat/completions, POST /tokenize and /detokenize (vLLM's). All
 * but /health and /metrics need "Authorization: Bearer KEY" when --api-key
 * is set. Bodies above max_body_bytes are drained and answered 413;
 * everything except /health and /metrics answers 503 until the model is
 * loaded, and completions answer 503 when more than max_num_seqs +
 * max_queued_requests are in flight. */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "core/util.h"
#include "server/buf.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/chain_api.h"
#include "server/req.h"
#include "server/server.h"

#define POLL_MS 50

enum { PHASE_LOADING = 0, PHASE_READY, PHASE_FAILED, PHASE_STOPPING };

typedef struct srv_state {
    const lethe_server_config *cfg;
    struct MHD_Daemon *daemon;
    atomic_int phase;
    lethe_engine *engine;
    srv_api api;
    srv_metrics metrics;
    atomic_int in_flight;      /* submitted and not finished */
    int max_in_flight;
    char *served_name;
    char host[256];
    int port;
    pthread_t main_thread;
} srv_state;

typedef struct conn_ctx {
    srv_state *s;
    char method[16];
    char path[160];
    srv_buf body;
    bool too_large;
    bool disconnected;
    double t_start;
    int status;
    srv_req *req;              /* our reference, for the log line and last-resort cancel */
} conn_ctx;

typedef struct stream_ctx {
    srv_state *s;
    srv_req *req;              /* reference */
    srv_gen gen;
    srv_buf out;               /* formatted bytes not yet handed to MHD */
    size_t text_len;           /* completion text emitted so far (logprobs text_offset) */
    bool closed;               /* [DONE] is in `out` */
    int fd;
    conn_ctx *cx;              /* for marking a disconnect in the log (valid until completed) */
} stream_ctx;

/* ---- small helpers ---- */

static bool peer_gone(int fd) {
    if (fd < 0) return false;
    char ch;
    ssize_t n = recv(fd, &ch, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

static int conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

static enum MHD_Result queue_body(struct MHD_Connection *c, conn_ctx *cx, int status, char *body,
                                  const char *content_type) {
    size_t n = body ? strlen(body) : 0;
    struct MHD_Response *r =
        MHD_create_response_from_buffer(n, body ? body : (char *)"", body ? MHD_RESPMEM_MUST_FREE
                                                                          : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    if (content_type) MHD_add_response_header(r, "Content-Type", content_type);
    cx->status = status;
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result queue_json(struct MHD_Connection *c, conn_ctx *cx, int status, char *json) {
    return queue_body(c, cx, status, json, "application/json");
}

static enum MHD_Result queue_error(struct MHD_Connection *c, conn_ctx *cx, const srv_error *e) {
    return queue_json(c, cx, e->status, srv_error_json(e));
}

__attribute__((format(printf, 5, 6))) static enum MHD_Result
fail(struct MHD_Connection *c, conn_ctx *cx, int status, const char *param, const char *fmt, ...) {
    srv_error e = {.status = status};
    snprintf(e.param, sizeof(e.param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof(e.message), fmt, ap);
    va_end(ap);
    return queue_error(c, cx, &e);
}

/* Constant-time comparison of the bearer token. */
static bool auth_ok(const srv_state *s, struct MHD_Connection *c) {
    if (!s->cfg->api_key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    const char *got = h + 7, *want = s->cfg->api_key;
    size_t gl = strlen(got), wl = strlen(want);
    unsigned diff = (unsigned)(gl != wl);
    for (size_t i = 0; i < wl; i++) diff |= (unsigned char)want[i] ^ (unsigned char)(i < gl ? got[i] : 0);
    return diff == 0;
}

static enum MHD_Result submit_error(struct MHD_Connection *c, conn_ctx *cx, int rc) {
    const char *msg = lethe_engine_last_error();
    if (rc == LETHE_ERR_CAPACITY || rc == LETHE_ERR_BUSY)
        return fail(c, cx, 503, NULL, "the server is overloaded, retry later (%s)", msg);
    if (rc == LETHE_ERR_INVALID) return fail(c, cx, 400, NULL, "%s", msg);
    return fail(c, cx, 500, NULL, "the engine refused the request: %s", msg);
}

/* Takes a slot in the in-flight budget, creates the srv_req and submits it. */
static int start_request(srv_state *s, conn_ctx *cx, srv_gen *g, srv_req **out, int *rc_out) {
    *rc_out = 0;
    if (atomic_fetch_add(&s->in_flight, 1) >= s->max_in_flight) {
        atomic_fetch_sub(&s->in_flight, 1);
        return 503;
    }
    srv_req *r = srv_req_new(&s->metrics, cx->t_start, g->logprobs > 0);
    r->in_flight = &s->in_flight;
    lethe_request_params p = {0};
    p.prompt = g->prompt;
    p.n_prompt = g->n_prompt;
    p.sampling = g->sp;
    p.forced = g->forced;
    p.n_forced = g->n_forced;
    p.cb = srv_req_on_event;
    p.user = r;
    srv_req_ref(r); /* the engine's reference, dropped by the final event */
    uint64_t id = 0;
    int rc = g->chain ? srv_chain_submit(s->engine, &p, g, &id) : lethe_engine_submit(s->engine, &p, &id);
    if (rc != 0) {
        atomic_fetch_sub(&s->in_flight, 1);
        srv_req_unref(r); /* the engine's */
        srv_req_unref(r); /* ours */
        *rc_out = rc;
        return -1;
    }
    pthread_mutex_lock(&r->mu);
    r->id = id;
    r->submitted = true;
    pthread_mutex_unlock(&r->mu);
    *out = r;
    return 0;
}

static void cancel_if_running(srv_state *s, srv_req *r) {
    if (!r) return;
    bool done, submitted;
    uint64_t id;
    pthread_mutex_lock(&r->mu);
    done = r->done;
    submitted = r->submitted;
    id = r->id;
    pthread_mutex_unlock(&r->mu);
    if (submitted && !done && s->engine) lethe_engine_cancel(s->engine, id);
}

/* ---- streaming ---- */

static void stream_finish(stream_ctx *st, const srv_event *ev) {
    if (ev->finish_reason == LETHE_FINISH_ERROR) {
        srv_error e = {.status = 400};
        snprintf(e.message, sizeof(e.message), "%s", ev->error ? ev->error : "request failed");
        srv_sse_error(&e, &st->out);
    } else if (st->gen.include_usage) {
        int32_t p, cpl, cached;
        srv_req_usage(st->req, &p, &cpl, &cached, NULL);
        srv_sse_usage(&st->s->api, &st->gen, p, cpl, cached, &st->out);
    }
    srv_sse_done(&st->out);
    st->closed = true;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    stream_ctx *st = cls;
    (void)pos;
    for (;;) {
        /* a closed peer is noticed before each write and every POLL_MS while idle */
        if (peer_gone(st->fd) || atomic_load(&st->s->phase) == PHASE_STOPPING) {
            cancel_if_running(st->s, st->req);
            if (st->cx) st->cx->disconnected = true;
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (st->out.len > 0) break;
        if (st->closed) return MHD_CONTENT_READER_END_OF_STREAM;
        srv_event *evs = srv_req_take(st->req, POLL_MS);
        for (srv_event *e = evs; e; e = e->next) {
            if (st->closed) break;
            if (e->finished && e->finish_reason == LETHE_FINISH_ERROR) {
                stream_finish(st, e);
                break;
            }
            srv_sse_event(&st->s->api, &st->gen, e, st->text_len, &st->out);
            st->text_len += strlen(e->text);
            if (e->finished) stream_finish(st, e);
        }
        srv_event_free_list(evs);
    }
    size_t n = LETHE_MIN(max, st->out.len);
    memcpy(buf, st->out.data, n);
    srv_buf_consume(&st->out, n);
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    stream_ctx *st = cls;
    cancel_if_running(st->s, st->req);
    srv_req_unref(st->req);
    srv_gen_free(&st->gen);
    srv_buf_free(&st->out);
    free(st);
}

/* ---- completions ---- */

static enum MHD_Result handle_generate(struct MHD_Connection *c, conn_ctx *cx, srv_kind kind) {
    srv_state *s = cx->s;
    srv_gen g;
    srv_error err = {0};
    if (srv_parse_request(&s->api, kind, cx->body.data ? cx->body.data : "", cx->body.len, &g,
                          &err) != 0)
        return queue_error(c, cx, &err);
    srv_req *r = NULL;
    int rc = 0;
    int st = start_request(s, cx, &g, &r, &rc);
    if (st != 0) {
        if (g.chain && g.chain_res.http_status >= 400) { /* refused by the chain table */
            int code = g.chain_res.http_status;
            char *body = srv_chain_error_json(&g);
            srv_gen_free(&g);
            return queue_json(c, cx, code, body);
        }
        srv_gen_free(&g);
        if (st == 503)
            return fail(c, cx, 503, NULL,
                        "the server is overloaded: %d requests in flight (max-num-seqs + "
                        "max-queued-requests); retry later",
                        s->max_in_flight);
        return submit_error(c, cx, rc);
    }
    cx->req = r;
    srv_req_ref(r);
    int fd = conn_fd(c);

    if (g.stream) {
        stream_ctx *sc = lethe_xcalloc(1, sizeof(*sc));
        sc->s = s;
        sc->req = r; /* takes the reference from start_request */
        sc->gen = g;
        sc->fd = fd;
        sc->cx = cx;
        if (kind == SRV_CHAT) srv_sse_role(&s->api, &g, &sc->out);
        struct MHD_Response *resp =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, sc, stream_free);
        if (!resp) {
            stream_free(sc);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream; charset=utf-8");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        cx->status = 200;
        enum MHD_Result ret = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return ret;
    }

    srv_acc acc = {0};
    bool done = false;
    while (!done) {
        srv_event *evs = srv_req_take(r, POLL_MS);
        /* checked after every batch, not only when idle: tokens may flow steadily */
        if (peer_gone(fd) || atomic_load(&s->phase) == PHASE_STOPPING) {
            srv_event_free_list(evs);
            cancel_if_running(s, r);
            cx->disconnected = true;
            cx->status = 499; /* nginx's "client closed request", for the log line */
            srv_acc_free(&acc);
            srv_gen_free(&g);
            srv_req_unref(r);
            return MHD_NO; /* closes the connection */
        }
        for (srv_event *e = evs; e; e = e->next) {
            srv_acc_add(&s->api, &g, &acc, e);
            if (e->finished) done = true;
        }
        srv_event_free_list(evs);
    }
    enum MHD_Result ret;
    if (acc.finish == LETHE_FINISH_ERROR) {
        ret = fail(c, cx, 400, NULL, "%s", acc.error ? acc.error : "request failed");
    } else {
        int32_t p, cpl, cached;
        srv_req_usage(r, &p, &cpl, &cached, NULL);
        ret = queue_json(c, cx, 200, srv_response_json(&s->api, &g, &acc, p, cpl, cached));
    }
    srv_acc_free(&acc);
    srv_gen_free(&g);
    srv_req_unref(r);
    return ret;
}

/* ---- routing ---- */

static enum MHD_Result dispatch(struct MHD_Connection *c, conn_ctx *cx) {
    srv_state *s = cx->s;
    const char *path = cx->path;
    bool get = !strcmp(cx->method, "GET") || !strcmp(cx->method, "HEAD");
    bool post = !strcmp(cx->method, "POST");
    int phase = atomic_load(&s->phase);

    if (!strcmp(path, "/health")) {
        if (!get) return fail(c, cx, 405, NULL, "use GET %s", path);
        if (phase != PHASE_READY)
            return fail(c, cx, 503, NULL, "the model is %s", phase == PHASE_LOADING ? "loading" : "not available");
        return queue_body(c, cx, 200, NULL, NULL);
    }
    if (!strcmp(path, "/metrics")) {
        if (!get) return fail(c, cx, 405, NULL, "use GET %s", path);
        lethe_engine_stats st;
        bool ready = phase == PHASE_READY;
        if (ready) lethe_engine_get_stats(s->engine, &st);
        char *text = srv_metrics_render(&s->metrics, ready ? &st : NULL, s->served_name);
        if (ready) { /* chain cache series */
            srv_buf mb = {0};
            srv_buf_puts(&mb, text);
            srv_chain_metrics(s->engine, s->served_name, &mb);
            free(text);
            text = mb.data;
        }
        return queue_body(c, cx, 200, text, "text/plain; version=0.0.4; charset=utf-8");
    }
    bool is_tok = !strcmp(path, "/tokenize"), is_detok = !strcmp(path, "/detokenize");
    if (is_tok || is_detok) {
        if (!auth_ok(s, c)) return fail(c, cx, 401, NULL, "invalid or missing API key (Authorization: Bearer KEY)");
        if (!post) return fail(c, cx, 405, NULL, "use POST %s", path);
        if (phase != PHASE_READY) return fail(c, cx, 503, NULL, "the model is not loaded");
        srv_error err = {0};
        const char *b = cx->body.data ? cx->body.data : "";
        char *out = is_tok ? srv_tokenize_json(&s->api, b, cx->body.len, &err)
                           : srv_detokenize_json(&s->api, b, cx->body.len, &err);
        return out ? queue_json(c, cx, 200, out) : queue_error(c, cx, &err);
    }
    bool is_models = !strcmp(path, "/v1/models");
    bool is_cmpl = !strcmp(path, "/v1/completions");
    bool is_chat = !strcmp(path, "/v1/chat/completions");
    if (!is_models && !is_cmpl && !is_chat)
        return fail(c, cx, 404, NULL, "no route %s %s", cx->method, path);
    if (!auth_ok(s, c)) return fail(c, cx, 401, NULL, "invalid or missing API key (Authorization: Bearer KEY)");
    if (is_models ? !get : !post)
        return fail(c, cx, 405, NULL, "use %s %s", is_models ? "GET" : "POST", path);
    if (phase != PHASE_READY)
        return fail(c, cx, 503, NULL, "the model is %s", phase == PHASE_LOADING ? "still loading" : "not available");
    if (is_models) return queue_json(c, cx, 200, srv_models_json(&s->api));
    return handle_generate(c, cx, is_chat ? SRV_CHAT : SRV_COMPLETION);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
    srv_state *s = cls;
    (void)version;
    conn_ctx *cx = *con_cls;
    if (!cx) {
        cx = lethe_xcalloc(1, sizeof(*cx));
        cx->s = s;
        cx->t_start = lethe_time_s();
        snprintf(cx->method, sizeof(cx->method), "%s", method);
        snprintf(cx->path, sizeof(cx->path), "%s", url);
        *con_cls = cx;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > s->cfg->max_body_bytes) {
            cx->too_large = true;
            /* a client waiting for "100 Continue" gets the 413 before sending the body */
            const char *ex = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Expect");
            if (ex && !strcasecmp(ex, "100-continue"))
                return fail(c, cx, 413, NULL, "request body larger than %zu bytes", s->cfg->max_body_bytes);
        }
        return MHD_YES;
    }
    if (*upload_size > 0) {
        if (!cx->too_large) {
            if (cx->body.len + *upload_size > s->cfg->max_body_bytes) {
                cx->too_large = true; /* keep draining so the client reads our 413 */
                srv_buf_free(&cx->body);
            } else {
                srv_buf_add(&cx->body, upload, *upload_size);
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cx->too_large)
        return fail(c, cx, 413, NULL, "request body larger than %zu bytes", s->cfg->max_body_bytes);
    return dispatch(c, cx);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    srv_state *s = cls;
    (void)c;
    conn_ctx *cx = *con_cls;
    if (!cx) return;
    *con_cls = NULL;
    bool aborted = toe != MHD_REQUEST_TERMINATED_COMPLETED_OK || cx->disconnected;
    int32_t p = 0, cpl = 0, cached = 0;
    if (cx->req) {
        if (aborted) cancel_if_running(s, cx->req);
        srv_req_usage(cx->req, &p, &cpl, &cached, NULL);
    }
    if (cx->req)
        LOG_INFO("%s %s %d prompt_tokens=%d completion_tokens=%d cached_tokens=%d %.3fs%s", cx->method,
                 cx->path, cx->status, p, cpl, cached, lethe_time_s() - cx->t_start,
                 aborted ? " (client disconnected)" : "");
    else
        LOG_INFO("%s %s %d %.3fs%s", cx->method, cx->path, cx->status ? cx->status : 0,
                 lethe_time_s() - cx->t_start, aborted && cx->status == 0 ? " (no response)" : "");
    srv_req_unref(cx->req);
    srv_buf_free(&cx->body);
    free(cx);
}

/* ---- startup / shutdown ---- */

static void *loader_main(void *arg) {
    srv_state *s = arg;
    if (s->cfg->load_delay_ms > 0) {
        struct timespec ts = {s->cfg->load_delay_ms / 1000, (long)(s->cfg->load_delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    double t0 = lethe_time_s();
    lethe_engine *e = NULL;
    int rc = lethe_engine_create(&s->cfg->engine, &e);
    if (rc == 0 && (rc = lethe_engine_start(e)) != 0) {
        lethe_engine_destroy(e);
        e = NULL;
    }
    if (rc != 0) {
        LOG_ERROR("cannot load %s: %s", s->cfg->engine.model, lethe_engine_last_error());
        atomic_store(&s->phase, PHASE_FAILED);
    } else {
        s->engine = e;
        s->api.engine = e;
        s->api.served_name = s->served_name;
        s->api.model_path = s->cfg->engine.model;
        s->api.max_model_len = lethe_engine_max_model_len(e);
        s->api.created = (int64_t)time(NULL);
        size_t nb = 0;
        s->api.has_tokenizer = lethe_engine_token_text(e, 0, &nb) != NULL;
        atomic_store(&s->phase, PHASE_READY);
        LOG_INFO("ready: model %s (max-model-len %d) loaded in %.2fs; serving on http://%s:%d", s->served_name,
                 s->api.max_model_len, lethe_time_s() - t0, s->host, s->port);
    }
    pthread_kill(s->main_thread, SIGUSR1);
    return NULL;
}

/* libmicrohttpd's own messages. It reports an "application error" when a
 * handler returns MHD_NO or a stream reader ends with an error, which we do
 * on purpose to drop the connection of a client that went away (the request
 * log line already says so): those go to debug. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    if (strstr(msg, "Application reported internal error") || strstr(msg, "application error"))
        LOG_DEBUG("libmicrohttpd: %s", msg);
    else LOG_WARN("libmicrohttpd: %s", msg);
}

static struct MHD_Daemon *start_daemon(srv_state *s) {
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char port[16];
    snprintf(port, sizeof(port), "%d", s->cfg->port);
    int grc = getaddrinfo(s->cfg->host, port, &hints, &ai);
    if (grc != 0 || !ai) {
        LOG_ERROR("--host %s: %s", s->cfg->host, gai_strerror(grc));
        return NULL;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, (uint16_t)s->cfg->port, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log,
        NULL, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)4096, MHD_OPTION_LISTEN_BACKLOG_SIZE, (unsigned)1024,
        MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512 * 1024), MHD_OPTION_END);
    char host[INET6_ADDRSTRLEN] = "";
    if (ai->ai_family == AF_INET6) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr, host, sizeof(host));
        snprintf(s->host, sizeof(s->host), "[%s]", host);
    } else {
        inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, host, sizeof(host));
        snprintf(s->host, sizeof(s->host), "%s", host);
    }
    freeaddrinfo(ai);
    if (!d) {
        LOG_ERROR("cannot listen on %s:%d: %s", s->host, s->cfg->port, strerror(errno));
        return NULL;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : s->cfg->port;
    return d;
}

/* --served-model-name, else the model path's last component (like the engine's model name). */
static char *served_name_of(const lethe_server_config *cfg) {
    if (cfg->served_model_name) return lethe_xstrdup(cfg->served_model_name);
    const char *m = cfg->engine.model ? cfg->engine.model : "model";
    size_t n = strlen(m);
    while (n > 1 && m[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && m[b - 1] != '/') b--;
    char *out = lethe_xmalloc(n - b + 1);
    memcpy(out, m + b, n - b);
    out[n - b] = '\0';
    return out;
}

void lethe_server_default_config(lethe_server_config *c) {
    memset(c, 0, sizeof(*c));
    lethe_engine_default_params(&c->engine);
    c->engine.model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    c->host = "127.0.0.1";
    c->port = 8000;
    c->max_body_bytes = (size_t)8 << 20;
    c->max_queued_requests = 1024;
}

int lethe_server_run(const lethe_server_config *cfg) {
    static srv_state s; /* one server per process; callbacks get &s */
    memset(&s, 0, sizeof(s));
    s.cfg = cfg;
    s.main_thread = pthread_self();
    s.max_in_flight = cfg->engine.max_num_seqs + cfg->max_queued_requests;
    atomic_init(&s.phase, PHASE_LOADING);
    atomic_init(&s.in_flight, 0);
    srv_metrics_init(&s.metrics);
    s.served_name = served_name_of(cfg);

    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread started below inherits this */

    s.daemon = start_daemon(&s);
    if (!s.daemon) return 1;
    LOG_INFO("listening on http://%s:%d (loading %s; /health is 503 until ready)", s.host, s.port,
             cfg->engine.model);
    pthread_t loader;
    if (pthread_create(&loader, NULL, loader_main, &s) != 0) {
        LOG_ERROR("cannot start the loader thread");
        MHD_stop_daemon(s.daemon);
        return 1;
    }
    bool loader_done = false;
    int code = 0;
    for (;;) {
        int sig = 0;
        if (sigwait(&set, &sig) != 0) continue;
        if (sig == SIGUSR1) {
            loader_done = true;
            if (atomic_load(&s.phase) == PHASE_FAILED) {
                code = 1;
                break;
            }
            continue;
        }
        LOG_INFO("%s received, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
        if (!loader_done) {
            /* engine creation cannot be interrupted; do not wait for it */
            MHD_stop_daemon(s.daemon);
            fflush(NULL);
            _exit(130);
        }
        break;
    }
    atomic_store(&s.phase, PHASE_STOPPING);
    pthread_join(loader, NULL);
    MHD_stop_daemon(s.daemon); /* waits for connection threads; their waits see STOPPING */
    if (s.engine) {
        lethe_engine_stop(s.engine);
        lethe_engine_destroy(s.engine);
    }
    srv_metrics_destroy(&s.metrics);
    free(s.served_name);
    return code;
}

/* http.c - the server's routes, auth, tenancy, generation responses, request
 * log, startup and shutdown, on top of the connection layer (conn.c).
 *
 * handle() runs on a worker thread of the connection layer: it routes,
 * authenticates, parses the request (openai.c), tokenizes and submits it to
 * the engine, and returns either a whole response or a generation (gen_ops):
 * an async object the loop pumps whenever the engine callback (req.c) wakes
 * the connection. A streaming generation formats SSE chunks as events
 * arrive; a whole one folds them and answers when the request finishes. A
 * client that disconnects is seen by the loop, which cancels the request
 * (lethe_engine_cancel: the engine frees its KV at the start of its next
 * step).
 *
 * Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions,
 * POST /v1/chat/completions, POST /tokenize and /detokenize (vLLM's),
 * GET /v1/worker/load (running/waiting requests, KV use, chains held). All
 * but /health (and /metrics unless --metrics-require-key) need
 * "Authorization: Bearer KEY" when API keys are set. Everything except
 * /health and /metrics answers 503 until the model is loaded, and
 * completions answer 503 when more than max_num_seqs + max_queued_requests
 * are in flight.
 *
 * Tenancy: a chain (Chain Cache) belongs to the tenant that created it: the
 * API key it was created with (its SHA-256, never the key), or with keys off
 * the --tenant-header value an authenticating proxy in front sets. Another
 * tenant asking for it gets 404, as if it did not exist. */
#include <arpa/inet.h>
#include <errno.h>
#include <malloc.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cache/chain.h"
#include "core/log.h"
#include "core/util.h"
#include "server/buf.h"
#include "server/chain_api.h"
#include "server/conn.h"
#include "server/dashboard.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/prefix_api.h"
#include "server/agent.h"
#include "server/req.h"
#include "server/server.h"

enum { PHASE_LOADING = 0, PHASE_READY, PHASE_FAILED, PHASE_STOPPING };

typedef struct srv_state {
    const lethe_server_config *cfg;
    srv_http *http;
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
    char **keys;               /* API keys (--api-key, --api-key-file); none: no auth */
    char (*key_tenant)[24];    /* per key: "key-" + 16 hex of its SHA-256 */
    int n_keys;
    srv_prune_jobs *prune_jobs; /* /v1/prefix_cache/prune jobs (prefix_api.c) */
} srv_state;

/* ---- responses ---- */

static void set_body(srv_response *r, int status, char *body, const char *ctype) {
    r->status = status;
    r->body = body;
    r->content_type = ctype;
}

static void set_error(srv_response *r, const srv_error *e) {
    set_body(r, e->status, srv_error_json(e), "application/json");
}

__attribute__((format(printf, 4, 5))) static void fail(srv_response *r, int status, const char *param,
                                                       const char *fmt, ...) {
    srv_error e = {.status = status};
    snprintf(e.param, sizeof(e.param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof(e.message), fmt, ap);
    va_end(ap);
    set_error(r, &e);
}

/* The connection layer's own errors (400, 408, 411, 413, 414, 429, 431, 503, 505). */
static char *layer_error(int status, const char *message) {
    srv_error e = {.status = status};
    snprintf(e.message, sizeof(e.message), "%s", message);
    return srv_error_json(&e);
}

/* ---- auth and tenancy ---- */

/* Constant-time over every key (which one matched does not show in timing).
 * Sets *tenant to the matching key's tenant (or "" when keys are off). */
static bool auth_ok(const srv_state *s, const srv_request *rq, const char **tenant) {
    *tenant = "";
    if (s->n_keys == 0) {
        if (s->cfg->tenant_header) {
            const char *t = srv_request_header(rq, s->cfg->tenant_header);
            *tenant = t ? t : "";
        }
        return true;
    }
    const char *h = srv_request_header(rq, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    const char *got = h + 7;
    size_t gl = strlen(got);
    int match = -1;
    for (int k = 0; k < s->n_keys; k++) {
        const char *want = s->keys[k];
        size_t wl = strlen(want);
        unsigned diff = (unsigned)(gl != wl);
        for (size_t i = 0; i < wl; i++) diff |= (unsigned char)want[i] ^ (unsigned char)(i < gl ? got[i] : 0);
        if (diff == 0) match = k;
    }
    if (match < 0) return false;
    *tenant = s->key_tenant[match];
    return true;
}

static void unauthorized(srv_response *r) {
    fail(r, 401, NULL, "invalid or missing API key (Authorization: Bearer KEY)");
}

/* ---- generations (async responses) ---- */

typedef struct gen_ctx {
    srv_state *s;
    srv_req *r;
    srv_gen g;
    srv_acc acc;
    srv_buf pending;           /* SSE bytes formatted before the first pump (chat role) */
    size_t text_len;           /* completion text emitted so far (logprobs text_offset) */
    bool closed;               /* the stream's [DONE] was written / the response was built */
    bool aborted;
    int status;
    double t_start;
    char method[16], path[64];
} gen_ctx;

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

/* An error event: the engine's message (a failure mid-request is 500, a
 * refusal of the request itself 400). */
static int error_status(const srv_event *e) { return e->error_status ? e->error_status : 500; }

static void stream_finish(gen_ctx *x, const srv_event *ev, srv_buf *out) {
    if (ev->finish_reason == LETHE_FINISH_ERROR) {
        srv_error e = {.status = error_status(ev)};
        snprintf(e.message, sizeof(e.message), "%s", ev->error ? ev->error : "request failed");
        srv_sse_error(&e, out);
    } else if (x->g.include_usage) {
        int32_t p, cpl, cached;
        srv_req_usage(x->r, &p, &cpl, &cached, NULL);
        srv_sse_usage(&x->s->api, &x->g, p, cpl, cached, out);
    }
    srv_sse_done(out);
    x->closed = true;
}

static bool gen_pump(void *ctx, srv_buf *out, int *status, const char **ctype) {
    gen_ctx *x = ctx;
    if (x->closed) return true;
    if (x->pending.len) {
        srv_buf_add(out, x->pending.data, x->pending.len);
        srv_buf_free(&x->pending);
    }
    srv_event *evs = srv_req_take(x->r, 0);
    bool finished = false;
    srv_event *last = NULL;
    for (srv_event *e = evs; e && !finished; e = e->next) {
        if (x->g.stream) {
            if (!(e->finished && e->finish_reason == LETHE_FINISH_ERROR)) {
                srv_sse_event(&x->s->api, &x->g, e, x->text_len, out);
                x->text_len += strlen(e->text);
            }
        } else {
            srv_acc_add(&x->s->api, &x->g, &x->acc, e);
        }
        if (e->finished) {
            finished = true;
            last = e;
        }
    }
    if (finished && x->g.stream) {
        stream_finish(x, last, out);
        x->status = 200;
    } else if (finished) {
        x->closed = true;
        *ctype = "application/json";
        if (x->acc.finish == LETHE_FINISH_ERROR) {
            srv_error e = {.status = error_status(last)};
            snprintf(e.message, sizeof(e.message), "%s", x->acc.error ? x->acc.error : "request failed");
            char *body = srv_error_json(&e);
            srv_buf_puts(out, body);
            free(body);
            *status = x->status = e.status;
        } else {
            int32_t p, cpl, cached;
            srv_req_usage(x->r, &p, &cpl, &cached, NULL);
            char *body = srv_response_json(&x->s->api, &x->g, &x->acc, p, cpl, cached);
            srv_buf_puts(out, body);
            free(body);
            *status = x->status = 200;
        }
    }
    srv_event_free_list(evs);
    return finished;
}

static void gen_cancel(void *ctx) {
    gen_ctx *x = ctx;
    x->aborted = true;
    cancel_if_running(x->s, x->r);
}

static void gen_destroy(void *ctx) {
    gen_ctx *x = ctx;
    int32_t p = 0, cpl = 0, cached = 0;
    srv_req_usage(x->r, &p, &cpl, &cached, NULL);
    LOG_INFO("%s %s %d prompt_tokens=%d completion_tokens=%d cached_tokens=%d %.3fs%s", x->method, x->path,
             x->aborted ? 499 : x->status, p, cpl, cached, lethe_time_s() - x->t_start,
             x->aborted ? " (client disconnected)" : "");
    srv_req_set_wake(x->r, (srv_wake){0});
    srv_req_unref(x->r);
    srv_gen_free(&x->g);
    srv_acc_free(&x->acc);
    srv_buf_free(&x->pending);
    free(x);
}

static const srv_async_ops gen_ops = {gen_pump, gen_cancel, gen_destroy};

static void submit_error(srv_response *resp, int rc) {
    const char *msg = lethe_engine_last_error();
    if (rc == LETHE_ERR_CAPACITY || rc == LETHE_ERR_BUSY)
        fail(resp, 503, NULL, "the server is overloaded, retry later (%s)", msg);
    else if (rc == LETHE_ERR_INVALID) fail(resp, 400, NULL, "%s", msg);
    else fail(resp, 500, NULL, "the engine refused the request: %s", msg);
}

static void handle_generate(srv_state *s, const srv_request *rq, const char *tenant, srv_kind kind,
                            srv_response *resp) {
    double t0 = lethe_time_s();
    gen_ctx *x = lethe_xcalloc(1, sizeof(*x));
    x->s = s;
    x->t_start = t0;
    snprintf(x->method, sizeof(x->method), "%s", rq->method);
    snprintf(x->path, sizeof(x->path), "%s", rq->path);
    srv_error err = {0};
    srv_chain_headers hdr = {.chain_id = srv_request_header(rq, SRV_CHAIN_ID_HEADER),
                             .new_chain_id = srv_request_header(rq, SRV_NEW_CHAIN_ID_HEADER)};
    if (srv_parse_request(&s->api, kind, rq->body, rq->body_len, &hdr, &x->g, &err) != 0) {
        free(x);
        set_error(resp, &err);
        return;
    }
    srv_gen *g = &x->g;
    g->tenant = tenant;
    if (atomic_fetch_add(&s->in_flight, 1) >= s->max_in_flight) {
        atomic_fetch_sub(&s->in_flight, 1);
        srv_gen_free(g);
        free(x);
        fail(resp, 503, NULL,
             "the server is overloaded: %d requests in flight (max-num-seqs + max-queued-requests); retry later",
             s->max_in_flight);
        return;
    }
    srv_req *r = srv_req_new(&s->metrics, t0, g->logprobs > 0);
    r->in_flight = &s->in_flight;
    srv_req_set_wake(r, rq->wake);
    lethe_request_params p = {0};
    p.prompt = g->prompt;
    p.n_prompt = g->n_prompt;
    p.sampling = g->sp;
    p.forced = g->forced;
    p.n_forced = g->n_forced;
    p.pinned = g->pinned;
    p.n_pinned = g->n_pinned;
    p.prunable = g->prunable;
    p.n_prunable = g->n_prunable;
    p.grammar = g->agent ? g->agent->grammar : NULL; /* the engine takes its own reference */
    p.cb = srv_req_on_event;
    p.user = r;
    srv_req_ref(r); /* the engine's reference, dropped by the final event */
    uint64_t id = 0;
    int rc = g->chain ? srv_chain_submit(&s->api, &p, g, &id)
                      : lethe_engine_submit(s->engine, &p, &id);
    /* X-Lethe-Chain-Id (+ status), for a load balancer and the client */
    srv_chain_headers_out(g, resp->headers, sizeof(resp->headers));
    g->hdr = (srv_chain_headers){0}; /* it points into the request, which ends with this call */
    if (rc != 0) {
        atomic_fetch_sub(&s->in_flight, 1);
        srv_req_set_wake(r, (srv_wake){0});
        srv_req_unref(r); /* the engine's */
        srv_req_unref(r); /* ours */
        int code = srv_chain_refusal_status(g);
        if (code) { /* refused by the chain cache */
            srv_metrics_chain_refused(&s->metrics, g->chain_res.code);
            set_body(resp, code, srv_chain_error_json(g), "application/json");
        } else {
            submit_error(resp, rc);
        }
        srv_gen_free(g);
        free(x);
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->id = id;
    r->submitted = true;
    pthread_mutex_unlock(&r->mu);
    x->r = r;
    x->status = 200;
    resp->async_ops = &gen_ops;
    resp->async_ctx = x;
    if (g->stream) {
        resp->streaming = true;
        resp->status = 200;
        resp->content_type = "text/event-stream; charset=utf-8";
        resp->extra_headers = "Cache-Control: no-cache\r\n";
        if (kind == SRV_CHAT) srv_sse_role(&s->api, g, &x->pending);
    }
}

/* ---- metrics ---- */

static char *render_metrics(srv_state *s, bool ready) {
    lethe_engine_stats st;
    if (ready) lethe_engine_get_stats(s->engine, &st);
    char *text = srv_metrics_render(&s->metrics, ready ? &st : NULL, s->served_name);
    srv_buf mb = {0};
    srv_buf_puts(&mb, text);
    free(text);
    if (ready) { /* chain cache series */
        uint64_t refused[LETHE_CHAIN_ENGINE_BUSY + 1];
        srv_metrics_chain_refusals(&s->metrics, refused);
        srv_chain_metrics(s->engine, refused, s->served_name, &mb);
    }
    if (ready) srv_dashboard_metrics(s->engine, s->served_name, &s->cfg->engine, &mb); /* dashboard.c */
    int64_t kv_resident, kv_host;
    if (ready && lethe_engine_kv_host_memory(s->engine, &kv_resident, &kv_host)) { /* CPU backend */
        srv_buf_printf(&mb,
                       "# HELP lethe:kv_cache_host_bytes KV pool buffers in host memory, bytes allocated.\n"
                       "# TYPE lethe:kv_cache_host_bytes gauge\n"
                       "lethe:kv_cache_host_bytes{model_name=\"%s\"} %lld\n"
                       "# HELP lethe:kv_cache_host_resident_bytes Of those, bytes in RAM now (pages of "
                       "slots written at least once).\n"
                       "# TYPE lethe:kv_cache_host_resident_bytes gauge\n"
                       "lethe:kv_cache_host_resident_bytes{model_name=\"%s\"} %lld\n",
                       s->served_name, (long long)kv_host, s->served_name, (long long)kv_resident);
    }
#ifdef __GLIBC__
    /* the allocator's view (all arenas): a leak grows in_use, fragmentation free */
    const struct mallinfo2 mi = mallinfo2();
    srv_buf_printf(&mb,
                   "# HELP lethe:process_heap_bytes malloc heap: bytes in allocated chunks (in_use), in free "
                   "chunks kept by the arenas (free), in chunks mapped on their own (mmapped).\n"
                   "# TYPE lethe:process_heap_bytes gauge\n");
    const struct { const char *state; size_t v; } heap[] = {
        {"in_use", mi.uordblks}, {"free", mi.fordblks}, {"mmapped", mi.hblkhd}};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(heap); i++)
        srv_buf_printf(&mb, "lethe:process_heap_bytes{model_name=\"%s\",state=\"%s\"} %zu\n", s->served_name,
                       heap[i].state, heap[i].v);
#endif
    srv_http_stats hs;
    srv_http_stats_get(s->http, &hs);
    const struct { const char *name, *type, *help, *label; double v; } rows[] = {
        {"http_connections", "gauge", "Open HTTP connections.", NULL, (double)hs.open},
        {"http_connections_total", "counter", "HTTP connections accepted.", NULL, (double)hs.accepted},
        {"http_connections_refused_total", "counter", "HTTP connections refused at accept.", "client_cap",
         (double)hs.refused_client_cap},
        {"http_connections_refused_total", NULL, NULL, "total_cap", (double)hs.refused_total_cap},
        {"http_timeouts_total", "counter", "Connections closed for a header, body, idle or write timeout.", NULL,
         (double)hs.timeouts},
        {"http_bad_requests_total", "counter", "Requests the HTTP layer refused (malformed, too large).", NULL,
         (double)hs.bad_requests},
        {"requests_in_flight", "gauge", "Generation requests submitted and not finished.", NULL,
         (double)atomic_load(&s->in_flight)},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        if (rows[i].type)
            srv_buf_printf(&mb, "# HELP lethe:%s %s\n# TYPE lethe:%s %s\n", rows[i].name, rows[i].help,
                           rows[i].name, rows[i].type);
        srv_buf_printf(&mb, "lethe:%s{model_name=\"%s\"%s%s%s} %.17g\n", rows[i].name, s->served_name,
                       rows[i].label ? ",reason=\"" : "", rows[i].label ? rows[i].label : "",
                       rows[i].label ? "\"" : "", rows[i].v);
    }
    return mb.data;
}

/* GET /v1/worker/load: what a load balancer or an autoscaler polls. Every
 * number is also a /metrics series, from the same source: requests_running
 * lethe:num_requests_running, requests_waiting lethe:num_requests_waiting,
 * requests_in_flight lethe:requests_in_flight, kv_cache_usage
 * lethe:kv_cache_usage_perc, kv_slots_used / kv_slots_total
 * lethe:kv_cache_used_slots / kv_cache_total_slots, chains.held / active /
 * idle / resident_slots lethe:chain_cache_chains / _active / _idle /
 * _resident_slots ("chains" is null outside chain mode). */
static char *worker_load_json(srv_state *s) {
    lethe_engine_stats st;
    lethe_engine_get_stats(s->engine, &st);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "worker.load");
    cJSON_AddStringToObject(root, "model", s->served_name);
    cJSON_AddNumberToObject(root, "requests_running", st.n_running);
    cJSON_AddNumberToObject(root, "requests_waiting", st.n_waiting);
    cJSON_AddNumberToObject(root, "requests_in_flight", atomic_load(&s->in_flight));
    cJSON_AddNumberToObject(root, "max_num_seqs", s->cfg->engine.max_num_seqs);
    cJSON_AddNumberToObject(root, "kv_cache_usage", st.kv_usage);
    cJSON_AddNumberToObject(root, "kv_slots_used", (double)st.kv_slots_used);
    cJSON_AddNumberToObject(root, "kv_slots_total", (double)st.kv_slots_total);
    cJSON_AddStringToObject(root, "prefix_cache_mode", lethe_engine_prefix_cache_mode(s->engine));
    if (lethe_engine_chain_mode(s->engine)) {
        lethe_engine_chain_stats cs;
        lethe_engine_get_chain_stats(s->engine, &cs);
        cJSON *c = cJSON_AddObjectToObject(root, "chains");
        cJSON_AddNumberToObject(c, "held", cs.n_chains);
        cJSON_AddNumberToObject(c, "active", cs.n_active);
        cJSON_AddNumberToObject(c, "idle", cs.n_idle);
        cJSON_AddNumberToObject(c, "resident_slots", (double)cs.resident_slots);
    } else {
        cJSON_AddNullToObject(root, "chains");
    }
    char *out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

/* ---- routing (a worker thread) ---- */

static void handle(void *user, const srv_request *rq, srv_response *resp) {
    srv_state *s = user;
    const char *path = rq->path;
    bool get = !strcmp(rq->method, "GET") || !strcmp(rq->method, "HEAD");
    bool post = !strcmp(rq->method, "POST");
    int phase = atomic_load(&s->phase);
    const char *tenant = "";
    char clip[80];

    if (!strcmp(path, "/health")) {
        if (!get) return fail(resp, 405, NULL, "use GET %s", path);
        if (phase != PHASE_READY)
            return fail(resp, 503, NULL, "the model is %s", phase == PHASE_LOADING ? "loading" : "not available");
        return set_body(resp, 200, NULL, NULL);
    }
    if (!strcmp(path, "/") && !s->cfg->no_ui) { /* the dashboard (dashboard.html) */
        if (!get) return fail(resp, 405, NULL, "use GET %s", path);
        return set_body(resp, 200, srv_dashboard_page(), "text/html; charset=utf-8");
    }
    if (!strcmp(path, "/metrics")) {
        if (s->cfg->metrics_require_key && !auth_ok(s, rq, &tenant)) return unauthorized(resp);
        if (!get) return fail(resp, 405, NULL, "use GET %s", path);
        return set_body(resp, 200, render_metrics(s, phase == PHASE_READY),
                        "text/plain; version=0.0.4; charset=utf-8");
    }
    bool is_tok = !strcmp(path, "/tokenize"), is_detok = !strcmp(path, "/detokenize");
    if (is_tok || is_detok) {
        if (!auth_ok(s, rq, &tenant)) return unauthorized(resp);
        if (!post) return fail(resp, 405, NULL, "use POST %s", path);
        if (phase != PHASE_READY) return fail(resp, 503, NULL, "the model is not loaded");
        srv_error err = {0};
        char *out = is_tok ? srv_tokenize_json(&s->api, rq->body, rq->body_len, &err)
                           : srv_detokenize_json(&s->api, rq->body, rq->body_len, &err);
        if (out) return set_body(resp, 200, out, "application/json");
        return set_error(resp, &err);
    }
    if (!strncmp(path, SRV_PREFIX_CACHE_ROUTE, strlen(SRV_PREFIX_CACHE_ROUTE))) {
        if (!auth_ok(s, rq, &tenant)) return unauthorized(resp);
        if (phase != PHASE_READY) return fail(resp, 503, NULL, "the model is not loaded");
        srv_error err = {0};
        int status = 200;
        char *out = srv_prefix_cache_route(s->prune_jobs, &s->api, post, path, rq->body,
                                           rq->body_len, &status, &err);
        if (out) return set_body(resp, status, out, "application/json");
        return set_error(resp, &err);
    }
    bool is_models = !strcmp(path, "/v1/models");
    bool is_cmpl = !strcmp(path, "/v1/completions");
    bool is_chat = !strcmp(path, "/v1/chat/completions");
    bool is_load = !strcmp(path, "/v1/worker/load");
    if (!is_models && !is_cmpl && !is_chat && !is_load)
        return fail(resp, 404, NULL, "no route %s %s", rq->method, srv_clip(path, clip, sizeof(clip)));
    if (!auth_ok(s, rq, &tenant)) return unauthorized(resp);
    if (strlen(tenant) > 64)
        return fail(resp, 400, NULL, "the %s header is longer than 64 bytes", s->cfg->tenant_header);
    bool wants_get = is_models || is_load;
    if (wants_get ? !get : !post)
        return fail(resp, 405, NULL, "use %s %s", wants_get ? "GET" : "POST", path);
    if (phase != PHASE_READY)
        return fail(resp, 503, NULL, "the model is %s", phase == PHASE_LOADING ? "still loading" : "not available");
    if (is_models) return set_body(resp, 200, srv_models_json(&s->api), "application/json");
    if (is_load) return set_body(resp, 200, worker_load_json(s), "application/json");
    handle_generate(s, rq, tenant, is_chat ? SRV_CHAT : SRV_COMPLETION, resp);
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
        s->api.tool_parser = s->cfg->tool_call_parser;
        s->api.replica = s->cfg->replica;
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

static int open_listener(srv_state *s) {
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char port[16];
    snprintf(port, sizeof(port), "%d", s->cfg->port);
    int grc = getaddrinfo(s->cfg->host, port, &hints, &ai);
    if (grc != 0 || !ai) {
        LOG_ERROR("--host %s: %s", s->cfg->host, gai_strerror(grc));
        return -1;
    }
    char host[INET6_ADDRSTRLEN] = "";
    if (ai->ai_family == AF_INET6) {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr, host, sizeof(host));
        snprintf(s->host, sizeof(s->host), "[%s]", host);
    } else {
        inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, host, sizeof(host));
        snprintf(s->host, sizeof(s->host), "%s", host);
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 4096) != 0) {
        LOG_ERROR("cannot listen on %s:%d: %s", s->host, s->cfg->port, strerror(errno));
        if (fd >= 0) close(fd);
        freeaddrinfo(ai);
        return -1;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof(sa);
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    s->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                             : ((struct sockaddr_in *)&sa)->sin_port);
    return fd;
}

/* Every connection needs a descriptor: raise the soft limit to the hard one
 * and keep the connection cap below it. */
static int connection_cap(const lethe_server_config *cfg) {
    struct rlimit rl;
    int cap = cfg->max_connections;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        if (rl.rlim_cur < rl.rlim_max) {
            rl.rlim_cur = rl.rlim_max;
            setrlimit(RLIMIT_NOFILE, &rl);
            getrlimit(RLIMIT_NOFILE, &rl);
        }
        long usable = (long)(rl.rlim_cur == RLIM_INFINITY ? 1 << 20 : rl.rlim_cur) - 256;
        if (usable < 16) usable = 16;
        if (cap > usable) {
            LOG_WARN("--max-connections %d exceeds the file descriptor limit; using %ld", cap, usable);
            cap = (int)usable;
        }
    }
    return cap;
}

/* --api-key (repeatable) and --api-key-file (one key per line, # comments). */
static int load_keys(srv_state *s) {
    const lethe_server_config *cfg = s->cfg;
    int cap = LETHE_MAX_STOP;
    s->keys = lethe_xcalloc((size_t)cap, sizeof(char *));
    for (int i = 0; i < LETHE_MAX_STOP && cfg->api_keys[i]; i++) s->keys[s->n_keys++] = lethe_xstrdup(cfg->api_keys[i]);
    if (cfg->api_key_file) {
        FILE *f = fopen(cfg->api_key_file, "r");
        if (!f) {
            LOG_ERROR("--api-key-file %s: %s", cfg->api_key_file, strerror(errno));
            return -1;
        }
        char line[1024];
        while (fgets(line, sizeof(line), f)) {
            size_t n = strlen(line);
            while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ')) line[--n] = '\0';
            char *k = line;
            while (*k == ' ' || *k == '\t') k++;
            if (!*k || *k == '#') continue;
            if (s->n_keys == cap) {
                cap *= 2;
                s->keys = lethe_xrealloc(s->keys, (size_t)cap * sizeof(char *));
            }
            s->keys[s->n_keys++] = lethe_xstrdup(k);
        }
        fclose(f);
        if (s->n_keys == 0) {
            LOG_ERROR("--api-key-file %s: no keys in it", cfg->api_key_file);
            return -1;
        }
    }
    s->key_tenant = lethe_xcalloc((size_t)(s->n_keys ? s->n_keys : 1), sizeof(*s->key_tenant));
    for (int k = 0; k < s->n_keys; k++) {
        uint8_t d[LETHE_CHAIN_FP_BYTES];
        lethe_chain_fingerprint(s->keys[k], d);
        snprintf(s->key_tenant[k], sizeof(s->key_tenant[k]), "key-%02x%02x%02x%02x%02x%02x%02x%02x", d[0], d[1],
                 d[2], d[3], d[4], d[5], d[6], d[7]);
    }
    if (s->n_keys > 0 && cfg->tenant_header)
        LOG_WARN("--tenant-header is ignored: with API keys the key is the tenant");
    return 0;
}

static void free_keys(srv_state *s) {
    for (int k = 0; k < s->n_keys; k++) {
        memset(s->keys[k], 0, strlen(s->keys[k]));
        free(s->keys[k]);
    }
    free(s->keys);
    free(s->key_tenant);
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
    c->max_connections = 8192;
    c->max_connections_per_client = 256;
    c->http_workers = 4;
    c->header_timeout_s = 10;
    c->body_timeout_s = 60;
    c->idle_timeout_s = 30;
    c->write_timeout_s = 60;
}

int lethe_server_run(const lethe_server_config *cfg) {
    static srv_state s; /* one server per process; callbacks get &s */
    memset(&s, 0, sizeof(s));
    s.cfg = cfg;
    s.main_thread = pthread_self();
    s.max_in_flight = cfg->engine.max_num_seqs + cfg->max_queued_requests;
    atomic_init(&s.phase, PHASE_LOADING);
    atomic_init(&s.in_flight, 0);
    if (load_keys(&s) != 0) {
        free_keys(&s);
        return 1;
    }
    srv_metrics_init(&s.metrics);
    s.served_name = served_name_of(cfg);
    s.prune_jobs = srv_prune_jobs_new();

    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread started below inherits this */

    int lfd = open_listener(&s);
    if (lfd < 0) return 1;
    srv_http_config hc = {
        .listen_fd = lfd,
        .n_workers = cfg->http_workers,
        .max_conns = connection_cap(cfg),
        .max_conns_per_client = cfg->max_connections_per_client,
        .max_body_bytes = cfg->max_body_bytes,
        .max_url_bytes = 8192,
        .max_header_bytes = 32768,
        .header_timeout_s = cfg->header_timeout_s,
        .body_timeout_s = cfg->body_timeout_s,
        .idle_timeout_s = cfg->idle_timeout_s,
        .write_timeout_s = cfg->write_timeout_s,
        .handler = handle,
        .error_body = layer_error,
        .user = &s,
    };
    s.http = srv_http_start(&hc);
    if (!s.http) {
        close(lfd);
        return 1;
    }
    LOG_INFO("listening on http://%s:%d (loading %s; /health is 503 until ready)", s.host, s.port,
             cfg->engine.model);
    pthread_t loader;
    if (pthread_create(&loader, NULL, loader_main, &s) != 0) {
        LOG_ERROR("cannot start the loader thread");
        srv_http_stop(s.http);
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
            fflush(NULL);
            _exit(130);
        }
        break;
    }
    atomic_store(&s.phase, PHASE_STOPPING);
    pthread_join(loader, NULL);
    srv_http_stop(s.http); /* cancels every generation; no handler runs after this */
    if (s.engine) {
        lethe_engine_stop(s.engine);
        lethe_engine_destroy(s.engine);
    }
    srv_http_free(s.http); /* the engine (and its callbacks) are gone */
    close(lfd);
    srv_metrics_destroy(&s.metrics);
    srv_prune_jobs_free(s.prune_jobs); /* no engine callback can come now */
    free(s.served_name);
    free_keys(&s);
    return code;
}

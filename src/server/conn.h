/* conn.h - the HTTP/1.1 connection layer of `lethe serve`: one event-loop
 * thread owns every socket, a small worker pool runs the handlers.
 *
 * Why not a thread per connection: a few thousand half-open connections (a
 * request line and never the end of the headers) used to hold every thread
 * and connection slot, so /health and every other client were refused. Here
 * an idle or slow connection costs a file descriptor and a small buffer, and
 * it is bounded in time and number:
 *   - the headers must be complete within header_timeout_s of the first byte
 *     (or of the accept), the body within body_timeout_s after the headers,
 *     and an idle keep-alive connection closes after idle_timeout_s; a client
 *     that does not read its response for write_timeout_s is dropped;
 *   - at most max_conns_per_client connections per peer address (the excess
 *     gets 429) and max_conns in all (503);
 *   - a declared Content-Length above max_body_bytes gets 413 at once;
 *     request lines above max_url_bytes 414, headers above max_header_bytes
 *     431, malformed requests 400, chunked uploads 411, other HTTP versions
 *     505, timeouts 408 - every one a JSON error body (conn_error_fn).
 *
 * Flow: the loop reads and parses a request, hands it to a worker
 * (handler_fn: routing, JSON parsing, tokenizing, engine submission), and
 * writes the srv_response the worker returns. A response is either whole
 * (status + body) or asynchronous (srv_async): a generation whose events the
 * engine thread delivers later. The engine callback calls srv_wake_up(), and
 * the loop then pumps the async object on its own thread: a non-streaming
 * one returns its whole response when finished, a streaming one appends
 * bytes that go out as HTTP chunks. A client that closes (or resets) its
 * connection is noticed by the loop (EPOLLRDHUP, read() == 0) and the async
 * object is cancelled at once. Pipelined and keep-alive requests are served
 * in order, one at a time per connection. */
#ifndef LETHE_SERVER_CONN_H
#define LETHE_SERVER_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server/buf.h"

typedef struct srv_http srv_http;

/* Identifies one connection to srv_wake_up (a slot and its generation). */
typedef struct srv_wake {
    srv_http *h;
    uint64_t conn_id;
} srv_wake;

/* Thread-safe, cheap, never blocks on a client: the loop pumps that
 * connection's async response soon after. A stale id (closed) is ignored. */
void srv_wake_up(srv_wake w);

typedef struct srv_header {
    const char *name, *value; /* NUL-terminated, inside the request's buffer */
} srv_header;

typedef struct srv_request {
    const char *method;       /* "GET", "POST", ... */
    const char *path;         /* target without the query string */
    const srv_header *headers;
    int n_headers;
    const char *body;         /* NUL-terminated; body_len bytes */
    size_t body_len;
    const char *peer;         /* peer address as text */
    srv_wake wake;            /* for an async response */
} srv_request;

/* Case-insensitive header lookup; NULL if absent. */
const char *srv_request_header(const srv_request *rq, const char *name);

/* An asynchronous response, pumped on the loop thread (never concurrently). */
typedef struct srv_async_ops {
    /* Called after srv_wake_up (and once right after the response is taken).
     * Streaming: append body bytes to *out, return true when the stream is
     * complete. Whole: when finished, set *status, *content_type and the body
     * in *out and return true; until then return false and leave out empty. */
    bool (*pump)(void *ctx, srv_buf *out, int *status, const char **content_type);
    void (*cancel)(void *ctx);  /* the client went away / the server stops; then destroy */
    void (*destroy)(void *ctx); /* always called exactly once; writes the request's log line */
} srv_async_ops;

#define SRV_RESPONSE_HEADERS_CAP 160

typedef struct srv_response {
    int status;
    const char *content_type;   /* static string */
    char *body;                 /* malloc'd (owned by the layer), may be NULL */
    size_t body_len;            /* 0: strlen(body) */
    const char *extra_headers;  /* static, "Name: value\r\n" lines, or NULL */
    char headers[SRV_RESPONSE_HEADERS_CAP]; /* more such lines made for this response ("": none;
                                 * the layer copies them when it takes the response) */
    /* async: non-NULL ops; streaming responses send status/content_type now
     * and the body in chunks; whole ones wait for pump to finish */
    const srv_async_ops *async_ops;
    void *async_ctx;
    bool streaming;
} srv_response;

/* Runs on a worker thread; fills *resp (zeroed before the call). */
typedef void (*srv_handler_fn)(void *user, const srv_request *rq, srv_response *resp);
/* JSON error body for an error the layer itself answers (malloc'd). */
typedef char *(*srv_conn_error_fn)(int status, const char *message);

typedef struct srv_http_config {
    int listen_fd;              /* bound, listening socket (the layer makes it non-blocking) */
    int n_workers;              /* handler threads */
    int max_conns;
    int max_conns_per_client;   /* 0 = no per-client limit */
    size_t max_body_bytes;
    size_t max_url_bytes;       /* request line */
    size_t max_header_bytes;    /* request line + headers */
    double header_timeout_s, body_timeout_s, idle_timeout_s, write_timeout_s;
    srv_handler_fn handler;
    srv_conn_error_fn error_body;
    void *user;
} srv_http_config;

typedef struct srv_http_stats {
    int64_t open;               /* connections now */
    int64_t accepted, refused_client_cap, refused_total_cap, timeouts, bad_requests;
} srv_http_stats;

srv_http *srv_http_start(const srv_http_config *cfg); /* NULL + log on failure */
void srv_http_stats_get(srv_http *h, srv_http_stats *out);
/* Stops accepting, cancels every async response, closes every connection
 * and joins the threads. srv_wake_up stays safe until srv_http_free, which
 * is called once nothing can call it any more (the engine has stopped). */
void srv_http_stop(srv_http *h);
void srv_http_free(srv_http *h);

#endif /* LETHE_SERVER_CONN_H */

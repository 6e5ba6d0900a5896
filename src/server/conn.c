/* conn.c - the HTTP/1.1 event loop and worker pool (see conn.h).
 *
 * One loop thread: epoll over the listening socket, every connection, and an
 * eventfd that workers and the engine callback write to. Connections live in
 * a fixed slot array (max_conns); a connection's id is (generation << 32 |
 * slot), so a wake-up or a worker result for a connection that closed in
 * the meantime is recognised and dropped. Deadlines are checked every
 * TICK_MS over all slots.
 *
 * Per connection, one request at a time:
 *   HEAD  reading the request line + headers (header deadline, size limits)
 *   BODY  reading Content-Length bytes (body deadline)
 *   WORK  a worker runs the handler (the loop only watches for a hangup)
 *   WAIT  an async whole response: pumped on wake-ups until it finishes
 *   STREAM an async streaming response: pumped bytes go out as chunks
 *   WRITE the rest of a response is being written
 *   LINGER a response that closes the connection was written: drain what
 *         the client still sends for a moment, so our answer is not lost
 *         to a TCP reset (413 before the body, errors mid-upload). */
#include "server/conn.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/log.h"
#include "core/util.h"

#define TICK_MS 100
#define MAX_HEADERS 100
#define READ_CHUNK 16384
#define MAX_READ_PER_EVENT (256 * 1024)
#define MAX_PENDING_OUT ((size_t)32 << 20) /* a client this far behind is dropped */
#define LINGER_S 2.0
#define CLIENT_BUCKETS 4096

enum { C_FREE = 0, C_HEAD, C_BODY, C_WORK, C_WAIT, C_STREAM, C_WRITE, C_LINGER };

typedef struct conn {
    int state;
    int fd;
    uint32_t gen;
    uint32_t events;               /* registered epoll mask */
    char peer[48];
    uint8_t peer_key[16];
    srv_buf in;                    /* bytes read and not yet consumed */
    size_t head_len;               /* bytes of the request head once complete */
    size_t content_length;
    bool keep_alive, is_head, got_bytes;
    bool was_async;                /* the async object logged the request */
    bool out_pending;              /* output was waiting at the last flush */
    double deadline;               /* of the current read phase / linger; 0 none */
    double t_start;                /* first byte of the request (log line) */
    char method[16], path[160];    /* for the log line */
    srv_buf out;
    size_t out_off;
    double last_progress;          /* last write that made progress */
    bool close_after;
    int status;
    const srv_async_ops *ops;
    void *actx;
    char headers[256]; /* the response's header lines (static + its own) */
} conn;

typedef struct job {
    struct job *next;
    uint64_t conn_id;
    srv_request rq;
    srv_header hdr[MAX_HEADERS];
    char *mem;                     /* head copy (parsed in place) + body */
    srv_response resp;
} job;

typedef struct client {
    struct client *next;
    uint8_t key[16];
    int count;
} client;

struct srv_http {
    srv_http_config cfg;
    int ep, evfd;
    pthread_t loop;
    pthread_t *workers;
    int n_workers_started;
    atomic_int stopping;
    atomic_int workers_done;
    conn *conns;
    int *free_slots, n_free;
    client *clients[CLIENT_BUCKETS];
    /* worker queue */
    pthread_mutex_t jmu;
    pthread_cond_t jcv;
    job *jhead, *jtail;
    /* results and wake-ups for the loop */
    pthread_mutex_t wmu;
    job *dhead, *dtail;
    uint64_t *wakes;
    size_t n_wakes, cap_wakes;
    /* stats */
    pthread_mutex_t smu;
    srv_http_stats st;
};

static void stat_add(srv_http *h, int64_t *field, int64_t d) {
    pthread_mutex_lock(&h->smu);
    *field += d;
    pthread_mutex_unlock(&h->smu);
}

void srv_http_stats_get(srv_http *h, srv_http_stats *out) {
    pthread_mutex_lock(&h->smu);
    *out = h->st;
    pthread_mutex_unlock(&h->smu);
}

static void kick(srv_http *h) {
    uint64_t one = 1;
    ssize_t rc = write(h->evfd, &one, sizeof(one));
    (void)rc; /* EAGAIN: the counter is already non-zero, the loop will wake */
}

void srv_wake_up(srv_wake w) {
    if (!w.h) return;
    srv_http *h = w.h;
    pthread_mutex_lock(&h->wmu);
    if (h->n_wakes == h->cap_wakes) {
        h->cap_wakes = h->cap_wakes ? 2 * h->cap_wakes : 256;
        h->wakes = lethe_xrealloc(h->wakes, h->cap_wakes * sizeof(uint64_t));
    }
    h->wakes[h->n_wakes++] = w.conn_id;
    pthread_mutex_unlock(&h->wmu);
    kick(h);
}

const char *srv_request_header(const srv_request *rq, const char *name) {
    for (int i = 0; i < rq->n_headers; i++)
        if (!strcasecmp(rq->headers[i].name, name)) return rq->headers[i].value;
    return NULL;
}

/* ---- per-client connection counts ---- */

static client **client_slot(srv_http *h, const uint8_t key[16]) {
    uint64_t hv = lethe_hash64(key, 16, 11);
    client **p = &h->clients[hv & (CLIENT_BUCKETS - 1)];
    while (*p && memcmp((*p)->key, key, 16)) p = &(*p)->next;
    return p;
}

static int client_count(srv_http *h, const uint8_t key[16]) {
    client *c = *client_slot(h, key);
    return c ? c->count : 0;
}

static void client_add(srv_http *h, const uint8_t key[16], int d) {
    client **p = client_slot(h, key);
    if (!*p) {
        LETHE_ASSERT(d > 0);
        *p = lethe_xcalloc(1, sizeof(client));
        memcpy((*p)->key, key, 16);
    }
    (*p)->count += d;
    LETHE_ASSERT((*p)->count >= 0);
    if ((*p)->count == 0) {
        client *dead = *p;
        *p = dead->next;
        free(dead);
    }
}

/* ---- responses ---- */

static const char *reason(int status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
    }
}

static void put_head(conn *c, int status, const char *ctype, const char *extra, long long clen) {
    srv_buf_printf(&c->out, "HTTP/1.1 %d %s\r\n", status, reason(status));
    if (ctype) srv_buf_printf(&c->out, "Content-Type: %s\r\n", ctype);
    if (extra) srv_buf_puts(&c->out, extra);
    if (clen >= 0) srv_buf_printf(&c->out, "Content-Length: %lld\r\n", clen);
    else srv_buf_puts(&c->out, "Transfer-Encoding: chunked\r\n");
    srv_buf_puts(&c->out, c->close_after ? "Connection: close\r\n\r\n" : "Connection: keep-alive\r\n\r\n");
    c->status = status;
}

static void put_whole(conn *c, int status, const char *ctype, const char *extra, const char *body, size_t n) {
    put_head(c, status, ctype, extra, (long long)n);
    if (!c->is_head && n) srv_buf_add(&c->out, body, n);
}

/* An error the layer answers itself; the connection closes after it. */
static void put_error(srv_http *h, conn *c, int status, const char *msg) {
    c->close_after = true;
    char *body = h->cfg.error_body(status, msg);
    put_whole(c, status, "application/json", NULL, body, strlen(body));
    free(body);
    c->state = C_WRITE;
    if (status != 408) stat_add(h, &h->st.bad_requests, 1);
}

/* ---- connection lifecycle ---- */

static uint64_t conn_id(srv_http *h, conn *c) {
    uint32_t slot = (uint32_t)(c - h->conns);
    return ((uint64_t)c->gen << 32) | slot;
}

static conn *conn_by_id(srv_http *h, uint64_t id) {
    uint32_t slot = (uint32_t)id;
    if (slot >= (uint32_t)h->cfg.max_conns) return NULL;
    conn *c = &h->conns[slot];
    return c->state != C_FREE && c->gen == (uint32_t)(id >> 32) ? c : NULL;
}

static void set_events(srv_http *h, conn *c) {
    uint32_t ev = EPOLLRDHUP;
    if (c->state == C_HEAD || c->state == C_BODY || c->state == C_LINGER) ev |= EPOLLIN;
    if (c->out.len > c->out_off) ev |= EPOLLOUT;
    if (ev == c->events) return;
    struct epoll_event e = {.events = ev, .data.u64 = conn_id(h, c)};
    if (epoll_ctl(h->ep, EPOLL_CTL_MOD, c->fd, &e) == 0) c->events = ev;
}

static void log_line(conn *c, bool aborted) {
    if (!c->method[0]) return;
    LOG_INFO("%s %s %d %.3fs%s", c->method, c->path, c->status, lethe_time_s() - c->t_start,
             aborted ? " (client disconnected)" : "");
}

static void drop_async(conn *c, bool cancel) {
    if (!c->ops) return;
    if (cancel) c->ops->cancel(c->actx);
    c->ops->destroy(c->actx);
    c->ops = NULL;
    c->actx = NULL;
}

static void conn_close(srv_http *h, conn *c, bool aborted) {
    if (c->state == C_FREE) return;
    if (c->ops) {
        drop_async(c, true); /* the async object logs its own line */
    } else if (aborted && c->state == C_WRITE && c->status && !c->was_async) {
        log_line(c, true);
    }
    epoll_ctl(h->ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    client_add(h, c->peer_key, -1);
    srv_buf_free(&c->in);
    srv_buf_free(&c->out);
    c->state = C_FREE;
    c->gen++;
    h->free_slots[h->n_free++] = (int)(c - h->conns);
    stat_add(h, &h->st.open, -1);
}

static void refuse(int fd, srv_http *h, int status, const char *msg) {
    char *body = h->cfg.error_body(status, msg);
    char head[256];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n\r\n",
                     status, reason(status), strlen(body));
    ssize_t w = send(fd, head, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w == n) w = send(fd, body, strlen(body), MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;
    free(body);
    shutdown(fd, SHUT_WR);
    close(fd);
}

static void peer_of(const struct sockaddr_storage *sa, char *text, size_t cap, uint8_t key[16]) {
    memset(key, 0, 16);
    if (sa->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &a->sin_addr, text, (socklen_t)cap);
        key[10] = key[11] = 0xff; /* IPv4-mapped form, so both families share the table */
        memcpy(key + 12, &a->sin_addr, 4);
    } else if (sa->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &a->sin6_addr, text, (socklen_t)cap);
        memcpy(key, &a->sin6_addr, 16);
    } else {
        snprintf(text, cap, "unknown");
    }
}

static void reset_for_request(srv_http *h, conn *c, double now) {
    c->state = C_HEAD;
    c->head_len = c->content_length = 0;
    c->is_head = false;
    c->got_bytes = c->in.len > 0;
    c->deadline = now + (c->got_bytes ? h->cfg.header_timeout_s : h->cfg.idle_timeout_s);
    c->t_start = now;
    c->method[0] = c->path[0] = '\0';
    c->status = 0;
    c->was_async = false;
}

static void do_accept(srv_http *h, double now) {
    for (int k = 0; k < 256; k++) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof(sa);
        int fd = accept4(h->cfg.listen_fd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) LOG_WARN("accept: %s", strerror(errno));
            return;
        }
        char peer[48];
        uint8_t key[16];
        peer_of(&sa, peer, sizeof(peer), key);
        if (h->n_free == 0) {
            stat_add(h, &h->st.refused_total_cap, 1);
            refuse(fd, h, 503, "the server has too many open connections; retry later");
            continue;
        }
        if (h->cfg.max_conns_per_client > 0 && client_count(h, key) >= h->cfg.max_conns_per_client) {
            stat_add(h, &h->st.refused_client_cap, 1);
            char msg[160];
            snprintf(msg, sizeof(msg), "too many connections from this client (at most %d); close some or retry later",
                     h->cfg.max_conns_per_client);
            refuse(fd, h, 429, msg);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        conn *c = &h->conns[h->free_slots[--h->n_free]];
        uint32_t gen = c->gen;
        memset(c, 0, sizeof(*c));
        c->gen = gen;
        c->fd = fd;
        snprintf(c->peer, sizeof(c->peer), "%s", peer);
        memcpy(c->peer_key, key, 16);
        client_add(h, key, 1);
        reset_for_request(h, c, now);
        c->deadline = now + h->cfg.header_timeout_s; /* a new connection must send its request promptly */
        struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP, .data.u64 = conn_id(h, c)};
        c->events = e.events;
        if (epoll_ctl(h->ep, EPOLL_CTL_ADD, fd, &e) != 0) {
            LOG_WARN("epoll_ctl: %s", strerror(errno));
            client_add(h, key, -1);
            close(fd);
            c->state = C_FREE;
            h->free_slots[h->n_free++] = (int)(c - h->conns);
            continue;
        }
        stat_add(h, &h->st.accepted, 1);
        stat_add(h, &h->st.open, 1);
    }
}

/* ---- parsing ---- */

static bool tchar(unsigned char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

/* End of the head ("\r\n\r\n" or a bare "\n\n"), or 0 if not there yet. */
static size_t head_end(const char *s, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (s[i] != '\n') continue;
        if (s[i + 1] == '\n') return i + 2;
        if (s[i + 1] == '\r' && i + 2 < n && s[i + 2] == '\n') return i + 3;
    }
    return 0;
}

/* Cuts the line at *p (ending in \n or \r\n) and returns it; NULL at the end. */
static char *next_line(char **p, char *end) {
    if (*p >= end) return NULL;
    char *line = *p, *nl = memchr(line, '\n', (size_t)(end - line));
    if (!nl) nl = end;
    char *e = nl;
    if (e > line && e[-1] == '\r') e--;
    *e = '\0';
    *p = nl + 1;
    return line;
}

/* Parses the head in j->mem (head_len bytes, NUL added). 0, or an HTTP status
 * with *msg. Sets keep_alive / content length / expect-continue. */
static int parse_head(srv_http *h, conn *c, job *j, size_t head_len, bool *expect_continue, const char **msg) {
    char *p = j->mem, *end = j->mem + head_len;
    char *line = next_line(&p, end);
    *expect_continue = false;
    if (!line) return *msg = "empty request", 400;
    char *sp1 = strchr(line, ' '), *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
    if (!sp1 || !sp2 || strchr(sp2 + 1, ' ')) return *msg = "malformed request line", 400;
    *sp1 = *sp2 = '\0';
    char *method = line, *target = sp1 + 1, *version = sp2 + 1;
    if (!method[0] || strlen(method) >= sizeof(c->method)) return *msg = "malformed request method", 400;
    for (char *m = method; *m; m++)
        if (!tchar((unsigned char)*m)) return *msg = "malformed request method", 400;
    bool v11 = !strcmp(version, "HTTP/1.1");
    if (!v11 && strcmp(version, "HTTP/1.0")) {
        if (strncmp(version, "HTTP/", 5)) return *msg = "malformed request line", 400;
        return *msg = "only HTTP/1.0 and HTTP/1.1 are supported", 505;
    }
    if (target[0] != '/') return *msg = "the request target must be an absolute path", 400;
    for (unsigned char *t = (unsigned char *)target; *t; t++)
        if (*t <= 0x20 || *t >= 0x7f) return *msg = "the request target has invalid characters", 400;
    char *q = strchr(target, '?');
    if (q) *q = '\0';
    snprintf(c->method, sizeof(c->method), "%s", method);
    snprintf(c->path, sizeof(c->path), "%s", target);
    j->rq.method = method;
    j->rq.path = target;
    c->is_head = !strcmp(method, "HEAD");
    c->keep_alive = v11;
    bool have_cl = false, have_te = false;
    unsigned long long cl = 0;
    int n = 0;
    while ((line = next_line(&p, end)) != NULL && line[0]) {
        if (line[0] == ' ' || line[0] == '\t') return *msg = "obsolete header line folding is not accepted", 400;
        char *colon = strchr(line, ':');
        if (!colon || colon == line) return *msg = "malformed header line", 400;
        for (char *k = line; k < colon; k++)
            if (!tchar((unsigned char)*k)) return *msg = "malformed header name", 400;
        if (n == MAX_HEADERS) return *msg = "too many header fields", 431;
        *colon = '\0';
        char *v = colon + 1;
        while (*v == ' ' || *v == '\t') v++;
        char *ve = v + strlen(v);
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) *--ve = '\0';
        for (unsigned char *t = (unsigned char *)v; *t; t++)
            if ((*t < 0x20 && *t != '\t') || *t == 0x7f) return *msg = "invalid character in a header value", 400;
        j->hdr[n].name = line;
        j->hdr[n].value = v;
        n++;
        if (!strcasecmp(line, "Content-Length")) {
            if (!v[0] || strspn(v, "0123456789") != strlen(v) || strlen(v) > 18)
                return *msg = "invalid Content-Length", 400;
            unsigned long long x = strtoull(v, NULL, 10);
            if (have_cl && x != cl) return *msg = "conflicting Content-Length headers", 400;
            cl = x;
            have_cl = true;
        } else if (!strcasecmp(line, "Transfer-Encoding")) {
            have_te = true;
        } else if (!strcasecmp(line, "Connection")) {
            if (strcasestr(v, "close")) c->keep_alive = false;
            else if (strcasestr(v, "keep-alive")) c->keep_alive = true;
        } else if (!strcasecmp(line, "Expect")) {
            if (strcasecmp(v, "100-continue")) return *msg = "unsupported Expect header", 417;
            *expect_continue = v11;
        }
    }
    j->rq.n_headers = n;
    if (have_te && have_cl) return *msg = "both Transfer-Encoding and Content-Length", 400;
    if (have_te) return *msg = "chunked request bodies are not supported; send a Content-Length", 411;
    if (cl > h->cfg.max_body_bytes) {
        static _Thread_local char m[96];
        snprintf(m, sizeof(m), "request body larger than %zu bytes", h->cfg.max_body_bytes);
        return *msg = m, 413;
    }
    c->content_length = (size_t)cl;
    return 0;
}

/* ---- the worker pool ---- */

static void *worker_main(void *arg) {
    srv_http *h = arg;
    for (;;) {
        pthread_mutex_lock(&h->jmu);
        while (!h->jhead && !atomic_load(&h->stopping)) pthread_cond_wait(&h->jcv, &h->jmu);
        job *j = h->jhead;
        if (j) {
            h->jhead = j->next;
            if (!h->jhead) h->jtail = NULL;
        }
        pthread_mutex_unlock(&h->jmu);
        if (!j) break; /* stopping and nothing queued */
        memset(&j->resp, 0, sizeof(j->resp));
        h->cfg.handler(h->cfg.user, &j->rq, &j->resp);
        j->next = NULL;
        pthread_mutex_lock(&h->wmu);
        if (h->dtail) h->dtail->next = j;
        else h->dhead = j;
        h->dtail = j;
        pthread_mutex_unlock(&h->wmu);
        kick(h);
    }
    return NULL;
}

static void job_free(job *j) {
    free(j->resp.body);
    free(j->mem);
    free(j);
}

/* ---- the loop ---- */

static void flush_out(srv_http *h, conn *c, double now);
static void process_input(srv_http *h, conn *c, double now);

static void finish_response(srv_http *h, conn *c, double now) {
    if (!c->was_async) log_line(c, false);
    srv_buf_free(&c->out);
    c->out_off = 0;
    if (c->close_after || !c->keep_alive || atomic_load(&h->stopping)) {
        shutdown(c->fd, SHUT_WR);
        c->state = C_LINGER;
        c->deadline = now + LINGER_S;
        set_events(h, c);
        return;
    }
    /* drop the served request's bytes; pipelined ones stay */
    reset_for_request(h, c, now);
    set_events(h, c);
    if (c->in.len > 0) process_input(h, c, now);
}

static void pump(srv_http *h, conn *c, double now) {
    if (!c->ops) return;
    srv_buf tmp = {0};
    int status = 200;
    const char *ctype = "application/json";
    bool done = c->ops->pump(c->actx, &tmp, &status, &ctype);
    if (c->state == C_STREAM) {
        if (tmp.len > 0) {
            srv_buf_printf(&c->out, "%zx\r\n", tmp.len);
            srv_buf_add(&c->out, tmp.data, tmp.len);
            srv_buf_puts(&c->out, "\r\n");
        }
        if (done) srv_buf_puts(&c->out, "0\r\n\r\n");
    } else if (done) {
        put_whole(c, status, ctype, c->headers, tmp.data ? tmp.data : "", tmp.len);
    }
    srv_buf_free(&tmp);
    if (done) {
        drop_async(c, false);
        c->state = C_WRITE;
    }
    flush_out(h, c, now);
}

static void flush_out(srv_http *h, conn *c, double now) {
    if (!c->out_pending) c->last_progress = now; /* the write-stall clock starts with new output */
    while (c->out.len > c->out_off) {
        ssize_t w = send(c->fd, c->out.data + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            c->out_off += (size_t)w;
            c->last_progress = now;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        conn_close(h, c, true); /* reset or broken pipe */
        return;
    }
    if (c->out_off == c->out.len) {
        c->out.len = c->out_off = 0;
        if (c->state == C_WRITE) {
            finish_response(h, c, now);
            return;
        }
    } else if (c->out_off > (1u << 20)) { /* compact */
        srv_buf_consume(&c->out, c->out_off);
        c->out_off = 0;
    }
    if (c->out.len - c->out_off > MAX_PENDING_OUT) {
        LOG_WARN("%s: client is not reading its response; closing the connection", c->peer);
        conn_close(h, c, true);
        return;
    }
    c->out_pending = c->out.len > c->out_off;
    set_events(h, c);
}

static void start_response(srv_http *h, conn *c, job *j, double now) {
    srv_response *r = &j->resp;
    snprintf(c->headers, sizeof(c->headers), "%s%.*s", r->extra_headers ? r->extra_headers : "",
             SRV_RESPONSE_HEADERS_CAP, r->headers);
    if (r->async_ops) {
        c->was_async = true;
        c->ops = r->async_ops;
        c->actx = r->async_ctx;
        if (r->streaming) {
            put_head(c, r->status ? r->status : 200, r->content_type, c->headers, -1);
            c->state = C_STREAM;
        } else {
            c->state = C_WAIT;
        }
        pump(h, c, now);
        return;
    }
    size_t n = r->body ? (r->body_len ? r->body_len : strlen(r->body)) : 0;
    put_whole(c, r->status, r->content_type, c->headers, r->body, n);
    c->state = C_WRITE;
    flush_out(h, c, now);
}

/* A complete head (and body) is in c->in: hand it to a worker. */
static void dispatch(srv_http *h, conn *c) {
    job *j = lethe_xcalloc(1, sizeof(*j));
    size_t total = c->head_len + c->content_length;
    j->mem = lethe_xmalloc(total + 2);
    memcpy(j->mem, c->in.data, c->head_len);
    j->mem[c->head_len] = '\0';
    char *body = j->mem + c->head_len + 1;
    memcpy(body, c->in.data + c->head_len, c->content_length);
    body[c->content_length] = '\0';
    srv_buf_consume(&c->in, total);
    bool ec;
    const char *msg = NULL;
    int st = parse_head(h, c, j, c->head_len, &ec, &msg); /* parsed before: cannot fail now */
    LETHE_ASSERT(st == 0);
    j->rq.headers = j->hdr;
    j->rq.body = body;
    j->rq.body_len = c->content_length;
    j->rq.peer = c->peer;
    j->conn_id = conn_id(h, c);
    j->rq.wake = (srv_wake){h, j->conn_id};
    c->state = C_WORK;
    c->deadline = 0;
    set_events(h, c);
    pthread_mutex_lock(&h->jmu);
    if (h->jtail) h->jtail->next = j;
    else h->jhead = j;
    h->jtail = j;
    pthread_cond_signal(&h->jcv);
    pthread_mutex_unlock(&h->jmu);
}

static void process_input(srv_http *h, conn *c, double now) {
    if (c->state == C_HEAD) {
        if (c->in.len > 0 && !c->got_bytes) {
            c->got_bytes = true;
            c->t_start = now;
            c->deadline = now + h->cfg.header_timeout_s;
        }
        /* a lone CRLF between requests is allowed (RFC 9112 2.2) */
        while (c->in.len >= 1 && (c->in.data[0] == '\r' || c->in.data[0] == '\n') && c->head_len == 0)
            srv_buf_consume(&c->in, 1);
        size_t e = head_end(c->in.data ? c->in.data : "", c->in.len);
        const char *nl = c->in.len ? memchr(c->in.data, '\n', c->in.len) : NULL;
        size_t line_len = nl ? (size_t)(nl - c->in.data) : c->in.len;
        if (line_len > h->cfg.max_url_bytes) {
            char m[96];
            snprintf(m, sizeof(m), "request line longer than %zu bytes", h->cfg.max_url_bytes);
            put_error(h, c, 414, m);
            flush_out(h, c, now);
            return;
        }
        if (!e) {
            if (c->in.len > h->cfg.max_header_bytes) {
                char m[96];
                snprintf(m, sizeof(m), "request headers larger than %zu bytes", h->cfg.max_header_bytes);
                put_error(h, c, 431, m);
                flush_out(h, c, now);
            }
            return;
        }
        if (e > h->cfg.max_header_bytes) {
            char m[96];
            snprintf(m, sizeof(m), "request headers larger than %zu bytes", h->cfg.max_header_bytes);
            put_error(h, c, 431, m);
            flush_out(h, c, now);
            return;
        }
        /* validate now (the copy in dispatch parses again for the worker) */
        job tmp;
        memset(&tmp, 0, sizeof(tmp));
        tmp.mem = lethe_xmalloc(e + 1);
        memcpy(tmp.mem, c->in.data, e);
        tmp.mem[e] = '\0';
        bool ec = false;
        const char *msg = NULL;
        int st = parse_head(h, c, &tmp, e, &ec, &msg);
        free(tmp.mem);
        if (st) {
            put_error(h, c, st, msg);
            flush_out(h, c, now);
            return;
        }
        c->head_len = e;
        c->state = C_BODY;
        c->deadline = now + h->cfg.body_timeout_s;
        if (ec && c->in.len < e + c->content_length) srv_buf_puts(&c->out, "HTTP/1.1 100 Continue\r\n\r\n");
    }
    if (c->state == C_BODY) {
        if (c->in.len < c->head_len + c->content_length) {
            flush_out(h, c, now);
            return;
        }
        /* a 100 Continue still going out stays ahead of the response (clients skip 1xx) */
        dispatch(h, c);
    }
}

static void on_readable(srv_http *h, conn *c, double now) {
    size_t total = 0;
    while (total < MAX_READ_PER_EVENT) {
        srv_buf_reserve(&c->in, READ_CHUNK);
        ssize_t r = recv(c->fd, c->in.data + c->in.len, READ_CHUNK, MSG_DONTWAIT);
        if (r > 0) {
            if (c->state == C_LINGER) continue; /* discard */
            c->in.len += (size_t)r;
            c->in.data[c->in.len] = '\0';
            total += (size_t)r;
            /* never buffer more than one request's worth ahead */
            if (c->in.len > h->cfg.max_header_bytes + h->cfg.max_body_bytes + READ_CHUNK) break;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        /* EOF or error: a request cut short gets no answer */
        conn_close(h, c, c->state != C_LINGER && c->got_bytes);
        return;
    }
    if (c->state == C_LINGER) {
        srv_buf_free(&c->in);
        return;
    }
    process_input(h, c, now);
}

static void on_event(srv_http *h, uint64_t id, uint32_t ev, double now) {
    conn *c = conn_by_id(h, id);
    if (!c) return;
    if (ev & EPOLLERR) {
        conn_close(h, c, true);
        return;
    }
    bool reading = c->state == C_HEAD || c->state == C_BODY || c->state == C_LINGER;
    if (reading && (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP))) {
        on_readable(h, c, now);
        return;
    }
    if (ev & (EPOLLRDHUP | EPOLLHUP)) { /* the client went away while we work or answer */
        conn_close(h, c, true);
        return;
    }
    if (ev & EPOLLOUT) flush_out(h, c, now);
}

static void tick(srv_http *h, double now) {
    for (int i = 0; i < h->cfg.max_conns; i++) {
        conn *c = &h->conns[i];
        if (c->state == C_FREE) continue;
        if (c->state == C_LINGER) {
            if (now > c->deadline) conn_close(h, c, false);
            continue;
        }
        if ((c->state == C_HEAD || c->state == C_BODY) && c->deadline > 0 && now > c->deadline) {
            if (c->state == C_HEAD && !c->got_bytes) { /* idle: close quietly */
                stat_add(h, &h->st.timeouts, 1);
                conn_close(h, c, false);
                continue;
            }
            stat_add(h, &h->st.timeouts, 1);
            put_error(h, c, 408,
                      c->state == C_HEAD ? "the request headers did not arrive in time"
                                         : "the request body did not arrive in time");
            flush_out(h, c, now);
            continue;
        }
        if (c->out.len > c->out_off && now - c->last_progress > h->cfg.write_timeout_s) {
            LOG_WARN("%s: client read nothing for %.0fs; closing the connection", c->peer, h->cfg.write_timeout_s);
            stat_add(h, &h->st.timeouts, 1);
            conn_close(h, c, true);
        }
    }
}

static void drain_queues(srv_http *h, double now) {
    uint64_t cnt;
    ssize_t rc = read(h->evfd, &cnt, sizeof(cnt));
    (void)rc;
    pthread_mutex_lock(&h->wmu);
    job *done = h->dhead;
    h->dhead = h->dtail = NULL;
    uint64_t *w = h->wakes;
    size_t nw = h->n_wakes;
    h->wakes = NULL;
    h->n_wakes = h->cap_wakes = 0;
    pthread_mutex_unlock(&h->wmu);
    while (done) {
        job *j = done;
        done = j->next;
        conn *c = conn_by_id(h, j->conn_id);
        if (c && c->state == C_WORK && !atomic_load(&h->stopping)) {
            start_response(h, c, j, now);
        } else if (j->resp.async_ops) { /* the client left while the handler ran */
            j->resp.async_ops->cancel(j->resp.async_ctx);
            j->resp.async_ops->destroy(j->resp.async_ctx);
        }
        job_free(j);
    }
    for (size_t i = 0; i < nw; i++) {
        conn *c = conn_by_id(h, w[i]);
        if (c && c->ops) pump(h, c, now);
    }
    free(w);
}

static void *loop_main(void *arg) {
    srv_http *h = arg;
    struct epoll_event evs[256];
    double last_tick = lethe_time_s();
    while (!atomic_load(&h->workers_done)) {
        int n = epoll_wait(h->ep, evs, 256, TICK_MS);
        double now = lethe_time_s();
        for (int i = 0; i < n; i++) {
            uint64_t id = evs[i].data.u64;
            if (id == UINT64_MAX) do_accept(h, now);
            else if (id == UINT64_MAX - 1) drain_queues(h, now);
            else on_event(h, id, evs[i].events, now);
        }
        if (now - last_tick >= TICK_MS / 1000.0) {
            tick(h, now);
            last_tick = now;
        }
    }
    /* the workers have exited: answer nothing more, cancel what runs */
    drain_queues(h, lethe_time_s());
    for (int i = 0; i < h->cfg.max_conns; i++) conn_close(h, &h->conns[i], true);
    return NULL;
}

srv_http *srv_http_start(const srv_http_config *cfg) {
    srv_http *h = lethe_xcalloc(1, sizeof(*h));
    h->cfg = *cfg;
    if (h->cfg.n_workers < 1) h->cfg.n_workers = 1;
    pthread_mutex_init(&h->jmu, NULL);
    pthread_cond_init(&h->jcv, NULL);
    pthread_mutex_init(&h->wmu, NULL);
    pthread_mutex_init(&h->smu, NULL);
    atomic_init(&h->stopping, 0);
    atomic_init(&h->workers_done, 0);
    h->conns = lethe_xcalloc((size_t)cfg->max_conns, sizeof(conn));
    h->free_slots = lethe_xmalloc((size_t)cfg->max_conns * sizeof(int));
    for (int i = cfg->max_conns - 1; i >= 0; i--) h->free_slots[h->n_free++] = i;
    h->ep = epoll_create1(EPOLL_CLOEXEC);
    h->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (h->ep < 0 || h->evfd < 0) {
        LOG_ERROR("epoll/eventfd: %s", strerror(errno));
        goto fail;
    }
    int nb = 1;
    if (ioctl(cfg->listen_fd, FIONBIO, &nb) != 0) {
        LOG_ERROR("listening socket: %s", strerror(errno));
        goto fail;
    }
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = UINT64_MAX};
    struct epoll_event e2 = {.events = EPOLLIN, .data.u64 = UINT64_MAX - 1};
    if (epoll_ctl(h->ep, EPOLL_CTL_ADD, cfg->listen_fd, &e) || epoll_ctl(h->ep, EPOLL_CTL_ADD, h->evfd, &e2)) {
        LOG_ERROR("epoll_ctl: %s", strerror(errno));
        goto fail;
    }
    h->workers = lethe_xcalloc((size_t)h->cfg.n_workers, sizeof(pthread_t));
    for (int i = 0; i < h->cfg.n_workers; i++) {
        if (pthread_create(&h->workers[i], NULL, worker_main, h) != 0) break;
        h->n_workers_started++;
    }
    if (h->n_workers_started == 0 || pthread_create(&h->loop, NULL, loop_main, h) != 0) {
        LOG_ERROR("cannot start the HTTP threads");
        atomic_store(&h->stopping, 1);
        pthread_mutex_lock(&h->jmu);
        pthread_cond_broadcast(&h->jcv);
        pthread_mutex_unlock(&h->jmu);
        for (int i = 0; i < h->n_workers_started; i++) pthread_join(h->workers[i], NULL);
        goto fail;
    }
    return h;
fail:
    if (h->ep >= 0) close(h->ep);
    if (h->evfd >= 0) close(h->evfd);
    free(h->workers);
    free(h->conns);
    free(h->free_slots);
    free(h);
    return NULL;
}

void srv_http_stop(srv_http *h) {
    if (!h) return;
    atomic_store(&h->stopping, 1);
    pthread_mutex_lock(&h->jmu);
    pthread_cond_broadcast(&h->jcv);
    job *pending = h->jhead; /* requests no worker took: dropped */
    h->jhead = h->jtail = NULL;
    pthread_mutex_unlock(&h->jmu);
    while (pending) {
        job *n = pending->next;
        job_free(pending);
        pending = n;
    }
    for (int i = 0; i < h->n_workers_started; i++) pthread_join(h->workers[i], NULL);
    atomic_store(&h->workers_done, 1);
    kick(h);
    pthread_join(h->loop, NULL);
}

void srv_http_free(srv_http *h) {
    if (!h) return;
    close(h->ep);
    close(h->evfd);
    for (int i = 0; i < CLIENT_BUCKETS; i++)
        while (h->clients[i]) {
            client *n = h->clients[i]->next;
            free(h->clients[i]);
            h->clients[i] = n;
        }
    free(h->wakes);
    free(h->workers);
    free(h->conns);
    free(h->free_slots);
    pthread_mutex_destroy(&h->jmu);
    pthread_cond_destroy(&h->jcv);
    pthread_mutex_destroy(&h->wmu);
    pthread_mutex_destroy(&h->smu);
    free(h);
}

/* buf.h - a growable byte buffer for building response bodies, SSE output
 * and the Prometheus text (static inline: tiny and used by several files). */
#ifndef LETHE_SERVER_BUF_H
#define LETHE_SERVER_BUF_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

typedef struct srv_buf {
    char *data;   /* NUL-terminated when non-NULL */
    size_t len, cap;
} srv_buf;

static inline void srv_buf_reserve(srv_buf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    b->data = lethe_xrealloc(b->data, cap);
    b->cap = cap;
}

static inline void srv_buf_add(srv_buf *b, const char *s, size_t n) {
    srv_buf_reserve(b, n);
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static inline void srv_buf_puts(srv_buf *b, const char *s) { srv_buf_add(b, s, strlen(s)); }

__attribute__((format(printf, 2, 3))) static inline void srv_buf_printf(srv_buf *b,
                                                                        const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n <= 0) return;
    srv_buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Drops the first n bytes. */
static inline void srv_buf_consume(srv_buf *b, size_t n) {
    if (n >= b->len) {
        b->len = 0;
        if (b->data) b->data[0] = '\0';
        return;
    }
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
    b->data[b->len] = '\0';
}

static inline void srv_buf_free(srv_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

#endif /* LETHE_SERVER_BUF_H */

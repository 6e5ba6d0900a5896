/* util.c - checked allocation, whole-file reads, clocks, hashing. */
#define _POSIX_C_SOURCE 200809L
#include "core/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void *lethe_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) lethe_assert_fail_("malloc", __FILE__, __LINE__);
    return p;
}

void *lethe_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) lethe_assert_fail_("calloc", __FILE__, __LINE__);
    return p;
}

void *lethe_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) lethe_assert_fail_("realloc", __FILE__, __LINE__);
    return q;
}

char *lethe_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = lethe_xmalloc(n);
    memcpy(d, s, n);
    return d;
}

lethe_status lethe_read_file(const char *path, char **out, size_t *out_len) {
    FILE *f = fopen(path, "rb");
    if (!f) return lethe_errorf(LETHE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) goto out_io;
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) goto out_io;
    char *buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        return lethe_errorf(LETHE_ERR_NOMEM, "%s: cannot allocate %ld bytes", path, n);
    }
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        goto out_io;
    }
    buf[n] = '\0';
    fclose(f);
    *out = buf;
    if (out_len) *out_len = (size_t)n;
    return LETHE_OK;
out_io:
    fclose(f);
    return lethe_errorf(LETHE_ERR_IO, "%s: read failed: %s", path, strerror(errno));
}

double lethe_time_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t lethe_hash64(const void *data, size_t n, uint64_t seed) {
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    /* final avalanche so that short inputs spread over all bits */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

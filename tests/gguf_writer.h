/* gguf_writer.h - a minimal GGUF v3 writer for tests (header-only).
 *
 * Builds small synthetic GGUF files (metadata of any scalar type, string
 * arrays, f32 / quantized tensors) so that tests can exercise config parsing,
 * weight mapping and error paths without large fixtures. Alignment is 32. */
#ifndef LETHE_TEST_GGUF_WRITER_H
#define LETHE_TEST_GGUF_WRITER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct gw_buf {
    uint8_t *p;
    size_t n, cap;
} gw_buf;

typedef struct gw_tensor {
    char name[128];
    uint32_t n_dims, type;
    uint64_t ne[4];
    const void *data;
    size_t n_bytes;
} gw_tensor;

typedef struct gw {
    gw_buf kv;
    uint64_t n_kv;
    gw_tensor *t;
    int n_t, cap_t;
} gw;

static inline void gw_put(gw_buf *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static inline void gw_u32(gw_buf *b, uint32_t v) { gw_put(b, &v, 4); }
static inline void gw_u64(gw_buf *b, uint64_t v) { gw_put(b, &v, 8); }
static inline void gw_str(gw_buf *b, const char *s) {
    gw_u64(b, strlen(s));
    gw_put(b, s, strlen(s));
}

static inline void gw_key(gw *w, const char *key, uint32_t type) {
    gw_str(&w->kv, key);
    gw_u32(&w->kv, type);
    w->n_kv++;
}
static inline void gw_kv_u32(gw *w, const char *key, uint32_t v) { gw_key(w, key, 4); gw_u32(&w->kv, v); }
static inline void gw_kv_i32(gw *w, const char *key, int32_t v) { gw_key(w, key, 5); gw_put(&w->kv, &v, 4); }
static inline void gw_kv_f32(gw *w, const char *key, float v) { gw_key(w, key, 6); gw_put(&w->kv, &v, 4); }
static inline void gw_kv_bool(gw *w, const char *key, int v) {
    uint8_t b = (uint8_t)v;
    gw_key(w, key, 7);
    gw_put(&w->kv, &b, 1);
}
static inline void gw_kv_str(gw *w, const char *key, const char *v) { gw_key(w, key, 8); gw_str(&w->kv, v); }
static inline void gw_kv_arr_str(gw *w, const char *key, const char *const *v, int n) {
    gw_key(w, key, 9);
    gw_u32(&w->kv, 8);
    gw_u64(&w->kv, (uint64_t)n);
    for (int i = 0; i < n; i++) gw_str(&w->kv, v[i]);
}

/* data must stay valid until gw_write; n_bytes is the raw size of the tensor data */
static inline void gw_tensor_add(gw *w, const char *name, uint32_t type, uint32_t n_dims,
                                 const uint64_t *ne, const void *data, size_t n_bytes) {
    if (w->n_t == w->cap_t) {
        w->cap_t = w->cap_t * 2 + 16;
        w->t = realloc(w->t, (size_t)w->cap_t * sizeof(gw_tensor));
    }
    gw_tensor *t = &w->t[w->n_t++];
    memset(t, 0, sizeof(*t));
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->type = type;
    t->n_dims = n_dims;
    for (uint32_t i = 0; i < n_dims; i++) t->ne[i] = ne[i];
    t->data = data;
    t->n_bytes = n_bytes;
}

static inline size_t gw_align(size_t x) { return (x + 31) / 32 * 32; }

/* Serializes to a malloc'd buffer (*n bytes). */
static inline uint8_t *gw_build(const gw *w, size_t *n) {
    gw_buf b = {0};
    gw_put(&b, "GGUF", 4);
    gw_u32(&b, 3);
    gw_u64(&b, (uint64_t)w->n_t);
    gw_u64(&b, w->n_kv);
    gw_put(&b, w->kv.p, w->kv.n);
    size_t off = 0;
    for (int i = 0; i < w->n_t; i++) {
        const gw_tensor *t = &w->t[i];
        gw_str(&b, t->name);
        gw_u32(&b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) gw_u64(&b, t->ne[d]);
        gw_u32(&b, t->type);
        gw_u64(&b, off);
        off = gw_align(off + t->n_bytes);
    }
    static const uint8_t zeros[32] = {0};
    gw_put(&b, zeros, gw_align(b.n) - b.n);
    for (int i = 0; i < w->n_t; i++) {
        gw_put(&b, w->t[i].data, w->t[i].n_bytes);
        gw_put(&b, zeros, gw_align(w->t[i].n_bytes) - w->t[i].n_bytes);
    }
    *n = b.n;
    return b.p;
}

static inline void gw_free(gw *w) {
    free(w->kv.p);
    free(w->t);
    memset(w, 0, sizeof(*w));
}

/* Writes bytes to a fresh /tmp file; returns its path (caller unlinks and frees). */
static inline char *tmp_write(const void *data, size_t n, const char *suffix) {
    char *path = malloc(256);
    snprintf(path, 256, "/tmp/lethe_test_XXXXXX%s", suffix ? suffix : "");
    int fd = mkstemps(path, suffix ? (int)strlen(suffix) : 0);
    if (fd < 0) {
        perror("mkstemps");
        exit(1);
    }
    FILE *f = fdopen(fd, "wb");
    if (n && fwrite(data, 1, n, f) != n) {
        perror("fwrite");
        exit(1);
    }
    fclose(f);
    return path;
}

#endif /* LETHE_TEST_GGUF_WRITER_H */

/* gguf.c - read-only GGUF v2/v3 parser over an mmapped file.
 *
 * Layout (little endian): "GGUF" magic, u32 version, u64 n_tensors, u64 n_kv,
 * then n_kv key/values (string key, u32 type, value), then n_tensors infos
 * (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset), then
 * padding to general.alignment (default 32) and the data section.
 *
 * Every length read from the file is checked against the bytes that remain
 * before it is used, so a truncated or hostile file yields LETHE_ERR_FORMAT
 * naming the file, the item being read and the offset; the accessors after a
 * successful open never fail. Arrays of strings (the vocabulary) get an offset
 * index so element i is O(1). Keys and tensor names get hash indexes so that
 * a loader looking up thousands of tensors stays linear. */
#include "model/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/util.h"

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ARRAY_DEPTH 4

/* A cursor over the mapping; `ctx` names the item being parsed for messages. */
typedef struct rd {
    const uint8_t *p;
    size_t size;
    size_t pos;
    const char *path;
    char ctx[192];
} rd;

static const char *value_type_name(uint32_t t) {
    static const char *names[] = {"uint8", "int8",   "uint16", "int16", "uint32",
                                  "int32", "float32", "bool",  "string", "array",
                                  "uint64", "int64", "float64"};
    return t < LETHE_ARRAY_LEN(names) ? names[t] : "unknown";
}

/* Size of one scalar of value type t; 0 for string/array/unknown. */
static size_t scalar_size(uint32_t t) {
    switch (t) {
    case LETHE_GGUF_UINT8: case LETHE_GGUF_INT8: case LETHE_GGUF_BOOL: return 1;
    case LETHE_GGUF_UINT16: case LETHE_GGUF_INT16: return 2;
    case LETHE_GGUF_UINT32: case LETHE_GGUF_INT32: case LETHE_GGUF_FLOAT32: return 4;
    case LETHE_GGUF_UINT64: case LETHE_GGUF_INT64: case LETHE_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static lethe_status need(rd *r, uint64_t n, const char *what) {
    if (n > r->size - r->pos)
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: truncated GGUF: %s%s%s needs %" PRIu64
                            " bytes at offset %zu but the file has %zu bytes",
                            r->path, r->ctx, r->ctx[0] ? ": " : "", what, n, r->pos, r->size);
    return LETHE_OK;
}

static lethe_status rd_u32(rd *r, uint32_t *v, const char *what) {
    lethe_status s = need(r, 4, what);
    if (s) return s;
    memcpy(v, r->p + r->pos, 4);
    r->pos += 4;
    return LETHE_OK;
}

static lethe_status rd_u64(rd *r, uint64_t *v, const char *what) {
    lethe_status s = need(r, 8, what);
    if (s) return s;
    memcpy(v, r->p + r->pos, 8);
    r->pos += 8;
    return LETHE_OK;
}

static lethe_status rd_str(rd *r, lethe_gguf_str *out, const char *what) {
    uint64_t len;
    lethe_status s = rd_u64(r, &len, what);
    if (s) return s;
    if ((s = need(r, len, what))) return s;
    out->len = len;
    out->data = (const char *)r->p + r->pos;
    r->pos += (size_t)len;
    return LETHE_OK;
}

/* Widens a scalar at p of type t into kv->v. */
static void read_scalar(const uint8_t *p, uint32_t t, lethe_gguf_kv *kv) {
    switch (t) {
    case LETHE_GGUF_UINT8: kv->v.u64 = p[0]; break;
    case LETHE_GGUF_BOOL: kv->v.u64 = p[0] != 0; break;
    case LETHE_GGUF_INT8: kv->v.i64 = (int8_t)p[0]; break;
    case LETHE_GGUF_UINT16: { uint16_t x; memcpy(&x, p, 2); kv->v.u64 = x; break; }
    case LETHE_GGUF_INT16: { int16_t x; memcpy(&x, p, 2); kv->v.i64 = x; break; }
    case LETHE_GGUF_UINT32: { uint32_t x; memcpy(&x, p, 4); kv->v.u64 = x; break; }
    case LETHE_GGUF_INT32: { int32_t x; memcpy(&x, p, 4); kv->v.i64 = x; break; }
    case LETHE_GGUF_FLOAT32: { float x; memcpy(&x, p, 4); kv->v.f64 = x; break; }
    case LETHE_GGUF_UINT64: memcpy(&kv->v.u64, p, 8); break;
    case LETHE_GGUF_INT64: memcpy(&kv->v.i64, p, 8); break;
    case LETHE_GGUF_FLOAT64: memcpy(&kv->v.f64, p, 8); break;
    default: break;
    }
}

/* Skips the body of an array (after its type and count), validating it. */
static lethe_status skip_array(rd *r, uint32_t et, uint64_t n, int depth) {
    if (depth > GGUF_MAX_ARRAY_DEPTH)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: %s: arrays nested deeper than %d", r->path,
                            r->ctx, GGUF_MAX_ARRAY_DEPTH);
    size_t es = scalar_size(et);
    if (es) {
        if (n > (r->size - r->pos) / es)
            return lethe_errorf(LETHE_ERR_FORMAT,
                                "%s: truncated GGUF: %s: %" PRIu64 " %s elements at offset %zu "
                                "do not fit in the file (%zu bytes)",
                                r->path, r->ctx, n, value_type_name(et), r->pos, r->size);
        r->pos += (size_t)(n * es);
        return LETHE_OK;
    }
    lethe_status s;
    for (uint64_t i = 0; i < n; i++) {
        if (et == LETHE_GGUF_STRING) {
            lethe_gguf_str str;
            if ((s = rd_str(r, &str, "array string"))) return s;
        } else if (et == LETHE_GGUF_ARRAY) {
            uint32_t t2;
            uint64_t n2;
            if ((s = rd_u32(r, &t2, "nested array type"))) return s;
            if ((s = rd_u64(r, &n2, "nested array length"))) return s;
            if ((s = skip_array(r, t2, n2, depth + 1))) return s;
        } else {
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: %s: unknown array element type %u",
                                r->path, r->ctx, et);
        }
    }
    return LETHE_OK;
}

static lethe_status parse_kv(rd *r, lethe_gguf_kv *kv) {
    lethe_status s;
    uint32_t t;
    if ((s = rd_str(r, &kv->key, "key"))) return s;
    snprintf(r->ctx, sizeof(r->ctx), "key '%.*s'", (int)LETHE_MIN(kv->key.len, 120),
             kv->key.data);
    if ((s = rd_u32(r, &t, "value type"))) return s;
    kv->type = (lethe_gguf_type)t;
    if (t == LETHE_GGUF_STRING) return rd_str(r, &kv->str, "string value");
    if (t == LETHE_GGUF_ARRAY) {
        uint32_t et;
        if ((s = rd_u32(r, &et, "array element type"))) return s;
        if ((s = rd_u64(r, &kv->arr_n, "array length"))) return s;
        if (et > LETHE_GGUF_FLOAT64)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: %s: unknown array element type %u",
                                r->path, r->ctx, et);
        kv->arr_type = (lethe_gguf_type)et;
        kv->arr_data = r->p + r->pos;
        if (et == LETHE_GGUF_STRING) {
            /* each string takes at least its 8-byte length: bound n before allocating */
            if (kv->arr_n > (r->size - r->pos) / 8)
                return lethe_errorf(LETHE_ERR_FORMAT,
                                    "%s: truncated GGUF: %s: %" PRIu64 " strings at offset %zu "
                                    "do not fit in the file (%zu bytes)",
                                    r->path, r->ctx, kv->arr_n, r->pos, r->size);
            kv->arr_str_off = malloc((size_t)(kv->arr_n ? kv->arr_n : 1) * sizeof(uint64_t));
            if (!kv->arr_str_off)
                return lethe_errorf(LETHE_ERR_NOMEM, "%s: %s: cannot index %" PRIu64 " strings",
                                    r->path, r->ctx, kv->arr_n);
            for (uint64_t i = 0; i < kv->arr_n; i++) {
                lethe_gguf_str str;
                kv->arr_str_off[i] = r->pos;
                if ((s = rd_str(r, &str, "array string"))) return s;
            }
            return LETHE_OK;
        }
        return skip_array(r, et, kv->arr_n, 1);
    }
    size_t es = scalar_size(t);
    if (!es)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: %s: unknown value type %u", r->path, r->ctx,
                            t);
    if ((s = need(r, es, value_type_name(t)))) return s;
    read_scalar(r->p + r->pos, t, kv);
    r->pos += es;
    return LETHE_OK;
}

static lethe_status parse_tensor_info(rd *r, lethe_gguf_tensor *ti, uint64_t idx) {
    lethe_status s;
    lethe_gguf_str name;
    snprintf(r->ctx, sizeof(r->ctx), "tensor info #%" PRIu64, idx);
    if ((s = rd_str(r, &name, "name"))) return s;
    if (name.len >= sizeof(ti->name))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor info #%" PRIu64
                            ": name of %" PRIu64 " bytes is too long (max %zu)",
                            r->path, idx, name.len, sizeof(ti->name) - 1);
    memcpy(ti->name, name.data, (size_t)name.len);
    ti->name[name.len] = '\0';
    if (memchr(ti->name, '\0', (size_t)name.len))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor info #%" PRIu64 ": name contains NUL",
                            r->path, idx);
    snprintf(r->ctx, sizeof(r->ctx), "tensor '%s'", ti->name);
    if ((s = rd_u32(r, &ti->n_dims, "n_dims"))) return s;
    if (ti->n_dims == 0 || ti->n_dims > LETHE_GGUF_MAX_DIMS)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': %u dimensions (expected 1..%d)",
                            r->path, ti->name, ti->n_dims, LETHE_GGUF_MAX_DIMS);
    uint64_t n_elems = 1;
    for (uint32_t d = 0; d < LETHE_GGUF_MAX_DIMS; d++) ti->ne[d] = 1;
    for (uint32_t d = 0; d < ti->n_dims; d++) {
        if ((s = rd_u64(r, &ti->ne[d], "shape"))) return s;
        if (ti->ne[d] == 0 || ti->ne[d] > (uint64_t)INT64_MAX / n_elems)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': invalid dimension ne[%u] = %"
                                PRIu64, r->path, ti->name, d, ti->ne[d]);
        n_elems *= ti->ne[d];
    }
    uint32_t type;
    if ((s = rd_u32(r, &type, "type"))) return s;
    if ((s = rd_u64(r, &ti->offset, "data offset"))) return s;
    ti->type = (lethe_ggml_type)type;
    if (!strcmp(lethe_ggml_type_name(ti->type), "unknown"))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: tensor '%s': unknown ggml type id %u",
                            r->path, ti->name, type);
    ti->n_bytes = lethe_ggml_type_size(ti->type, ti->ne[0]);
    if (ti->n_bytes == 0)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': row length %" PRIu64
                            " is not a multiple of the %s block size",
                            r->path, ti->name, ti->ne[0], lethe_ggml_type_name(ti->type));
    uint64_t rows = n_elems / ti->ne[0];
    if (rows > SIZE_MAX / ti->n_bytes)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': size overflows", r->path,
                            ti->name);
    ti->n_bytes *= (size_t)rows;
    return LETHE_OK;
}

/* ---- name indexes (open addressing, slot holds index + 1) ---- */

static uint64_t *index_build(uint64_t n, uint64_t *mask) {
    uint64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    *mask = cap - 1;
    return calloc((size_t)cap, sizeof(uint64_t));
}

/* Inserts item i named (s, len); returns false if the name is already present. */
static bool index_insert(uint64_t *tab, uint64_t mask, const char *s, size_t len, uint64_t i,
                         const lethe_gguf *g, bool tensors) {
    uint64_t h = lethe_hash64(s, len, 0) & mask;
    for (;; h = (h + 1) & mask) {
        if (!tab[h]) {
            tab[h] = i + 1;
            return true;
        }
        uint64_t j = tab[h] - 1;
        if (tensors) {
            if (strlen(g->tensors[j].name) == len && !memcmp(g->tensors[j].name, s, len))
                return false;
        } else if (g->kv[j].key.len == len && !memcmp(g->kv[j].key.data, s, len)) {
            return false;
        }
    }
}

static lethe_status gguf_fail(lethe_gguf *g, lethe_status s) {
    lethe_gguf_close(g);
    return s;
}

lethe_status lethe_gguf_open(const char *path, lethe_gguf *out) {
    memset(out, 0, sizeof(*out));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return lethe_errorf(LETHE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return lethe_errorf(LETHE_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return lethe_errorf(LETHE_ERR_IO, "%s: not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    if (size < 24) {
        close(fd);
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: truncated GGUF: %zu bytes is shorter than the 24-byte header",
                            path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return lethe_errorf(LETHE_ERR_IO, "%s: mmap failed: %s", path, strerror(e));

    lethe_gguf *g = out;
    g->path = lethe_xstrdup(path);
    g->map = map;
    g->map_size = size;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    rd r = {.p = map, .size = size, .pos = 0, .path = g->path};
    lethe_status s;

    if (memcmp(r.p, "GGUF", 4) != 0)
        return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT,
                                         "%s: not a GGUF file (bad magic %02x %02x %02x %02x)",
                                         path, r.p[0], r.p[1], r.p[2], r.p[3]));
    r.pos = 4;
    if ((s = rd_u32(&r, &g->version, "version"))) return gguf_fail(g, s);
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return gguf_fail(g, lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                         "%s: big-endian GGUF files are not supported", path));
    if (g->version != 2 && g->version != 3)
        return gguf_fail(g, lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                         "%s: GGUF version %u is not supported (expected 2 or 3)",
                                         path, g->version));
    if ((s = rd_u64(&r, &g->n_tensors, "tensor count"))) return gguf_fail(g, s);
    if ((s = rd_u64(&r, &g->n_kv, "key/value count"))) return gguf_fail(g, s);
    /* a key/value takes >= 13 bytes (8 length + 1 key byte + 4 type), a tensor info >= 29 */
    if (g->n_kv > (size - r.pos) / 12)
        return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT,
                                         "%s: truncated GGUF: %" PRIu64
                                         " key/values cannot fit in %zu bytes", path, g->n_kv, size));
    if (g->n_tensors > (size - r.pos) / 28)
        return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT,
                                         "%s: truncated GGUF: %" PRIu64
                                         " tensor infos cannot fit in %zu bytes", path,
                                         g->n_tensors, size));
    g->kv = calloc((size_t)(g->n_kv ? g->n_kv : 1), sizeof(*g->kv));
    g->tensors = calloc((size_t)(g->n_tensors ? g->n_tensors : 1), sizeof(*g->tensors));
    g->kv_index = index_build(g->n_kv, &g->kv_index_mask);
    g->tensor_index = index_build(g->n_tensors, &g->tensor_index_mask);
    if (!g->kv || !g->tensors || !g->kv_index || !g->tensor_index)
        return gguf_fail(g, lethe_errorf(LETHE_ERR_NOMEM, "%s: out of memory for metadata", path));

    for (uint64_t i = 0; i < g->n_kv; i++) {
        snprintf(r.ctx, sizeof(r.ctx), "key/value #%" PRIu64, i);
        if ((s = parse_kv(&r, &g->kv[i]))) return gguf_fail(g, s);
        if (!index_insert(g->kv_index, g->kv_index_mask, g->kv[i].key.data,
                          (size_t)g->kv[i].key.len, i, g, false))
            return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT, "%s: duplicate %s", path, r.ctx));
    }
    r.ctx[0] = '\0';

    const lethe_gguf_kv *al = lethe_gguf_find(g, "general.alignment");
    if (al) {
        int64_t a;
        if (lethe_gguf_get_int(g, "general.alignment", &a) != LETHE_OK || a <= 0 ||
            (a & (a - 1)) != 0)
            return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT,
                                             "%s: general.alignment must be a power-of-two "
                                             "integer", path));
        g->alignment = (uint64_t)a;
    }

    for (uint64_t i = 0; i < g->n_tensors; i++) {
        lethe_gguf_tensor *ti = &g->tensors[i];
        if ((s = parse_tensor_info(&r, ti, i))) return gguf_fail(g, s);
        if (!index_insert(g->tensor_index, g->tensor_index_mask, ti->name, strlen(ti->name), i,
                          g, true))
            return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT, "%s: duplicate tensor '%s'", path,
                                             ti->name));
        if (ti->offset % g->alignment != 0)
            return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT,
                                             "%s: tensor '%s': offset %" PRIu64
                                             " is not a multiple of the alignment %" PRIu64,
                                             path, ti->name, ti->offset, g->alignment));
    }
    r.ctx[0] = '\0';

    uint64_t data = (r.pos + g->alignment - 1) / g->alignment * g->alignment;
    g->data_offset = data;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        lethe_gguf_tensor *ti = &g->tensors[i];
        uint64_t avail = data <= size ? size - data : 0;
        if (ti->offset > avail || ti->n_bytes > avail - ti->offset)
            return gguf_fail(g, lethe_errorf(LETHE_ERR_FORMAT,
                                             "%s: tensor '%s': data [%" PRIu64 ", +%zu) lies "
                                             "outside the file (%zu bytes; truncated?)",
                                             path, ti->name, data + ti->offset, ti->n_bytes, size));
        ti->data = (const uint8_t *)map + data + ti->offset;
    }
    return LETHE_OK;
}

void lethe_gguf_close(lethe_gguf *g) {
    if (!g) return;
    if (g->map) munmap(g->map, g->map_size);
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) free(g->kv[i].arr_str_off);
    free(g->kv);
    free(g->tensors);
    free(g->kv_index);
    free(g->tensor_index);
    free(g->path);
    memset(g, 0, sizeof(*g));
}

const lethe_gguf_kv *lethe_gguf_find(const lethe_gguf *g, const char *key) {
    if (!g->kv_index) return NULL;
    size_t len = strlen(key);
    for (uint64_t h = lethe_hash64(key, len, 0) & g->kv_index_mask;; h = (h + 1) & g->kv_index_mask) {
        uint64_t slot = g->kv_index[h];
        if (!slot) return NULL;
        const lethe_gguf_kv *kv = &g->kv[slot - 1];
        if (kv->key.len == len && !memcmp(kv->key.data, key, len)) return kv;
    }
}

const lethe_gguf_tensor *lethe_gguf_find_tensor(const lethe_gguf *g, const char *name) {
    if (!g->tensor_index) return NULL;
    size_t len = strlen(name);
    for (uint64_t h = lethe_hash64(name, len, 0) & g->tensor_index_mask;;
         h = (h + 1) & g->tensor_index_mask) {
        uint64_t slot = g->tensor_index[h];
        if (!slot) return NULL;
        const lethe_gguf_tensor *t = &g->tensors[slot - 1];
        if (!strcmp(t->name, name)) return t;
    }
}

static bool is_signed_int(lethe_gguf_type t) {
    return t == LETHE_GGUF_INT8 || t == LETHE_GGUF_INT16 || t == LETHE_GGUF_INT32 ||
           t == LETHE_GGUF_INT64;
}
static bool is_unsigned_int(lethe_gguf_type t) {
    return t == LETHE_GGUF_UINT8 || t == LETHE_GGUF_UINT16 || t == LETHE_GGUF_UINT32 ||
           t == LETHE_GGUF_UINT64 || t == LETHE_GGUF_BOOL;
}

lethe_status lethe_gguf_get_int(const lethe_gguf *g, const char *key, int64_t *out) {
    const lethe_gguf_kv *kv = lethe_gguf_find(g, key);
    if (!kv) return lethe_errorf(LETHE_ERR_NOT_FOUND, "%s: missing key '%s'", g->path, key);
    if (is_signed_int(kv->type)) {
        *out = kv->v.i64;
        return LETHE_OK;
    }
    if (is_unsigned_int(kv->type)) {
        if (kv->v.u64 > (uint64_t)INT64_MAX)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s': value %" PRIu64 " is too large",
                                g->path, key, kv->v.u64);
        *out = (int64_t)kv->v.u64;
        return LETHE_OK;
    }
    return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' has type %s, expected an integer",
                        g->path, key, value_type_name(kv->type));
}

lethe_status lethe_gguf_get_float(const lethe_gguf *g, const char *key, double *out) {
    const lethe_gguf_kv *kv = lethe_gguf_find(g, key);
    if (!kv) return lethe_errorf(LETHE_ERR_NOT_FOUND, "%s: missing key '%s'", g->path, key);
    if (kv->type == LETHE_GGUF_FLOAT32 || kv->type == LETHE_GGUF_FLOAT64) {
        *out = kv->v.f64;
        return LETHE_OK;
    }
    if (is_signed_int(kv->type)) {
        *out = (double)kv->v.i64;
        return LETHE_OK;
    }
    if (is_unsigned_int(kv->type) && kv->type != LETHE_GGUF_BOOL) {
        *out = (double)kv->v.u64;
        return LETHE_OK;
    }
    return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' has type %s, expected a number", g->path,
                        key, value_type_name(kv->type));
}

lethe_status lethe_gguf_get_str(const lethe_gguf *g, const char *key, lethe_gguf_str *out) {
    const lethe_gguf_kv *kv = lethe_gguf_find(g, key);
    if (!kv) return lethe_errorf(LETHE_ERR_NOT_FOUND, "%s: missing key '%s'", g->path, key);
    if (kv->type != LETHE_GGUF_STRING)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' has type %s, expected a string",
                            g->path, key, value_type_name(kv->type));
    *out = kv->str;
    return LETHE_OK;
}

lethe_gguf_str lethe_gguf_arr_str(const lethe_gguf *g, const lethe_gguf_kv *kv, uint64_t i) {
    LETHE_ASSERT(kv->type == LETHE_GGUF_ARRAY && kv->arr_type == LETHE_GGUF_STRING);
    LETHE_ASSERT(i < kv->arr_n && kv->arr_str_off);
    const uint8_t *p = (const uint8_t *)g->map + kv->arr_str_off[i];
    lethe_gguf_str s;
    memcpy(&s.len, p, 8);
    s.data = (const char *)p + 8;
    return s;
}

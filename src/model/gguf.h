/* gguf.h - read-only GGUF v3 (also v2) parser.
 *
 * The file is mmapped; metadata values and tensor infos are validated up
 * front (every length against the file size), after which accessors never
 * fail on a well-formed handle. Tensor data pointers point into the mapping.
 * See the GGUF spec: header, n_kv key/values, n_tensors infos, alignment
 * (general.alignment, default 32), then the data section. */
#ifndef LETHE_GGUF_H
#define LETHE_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "backend/ggml_types.h"
#include "core/status.h"

typedef enum lethe_gguf_type { /* metadata value types, numbered as in the spec */
    LETHE_GGUF_UINT8 = 0, LETHE_GGUF_INT8 = 1, LETHE_GGUF_UINT16 = 2, LETHE_GGUF_INT16 = 3,
    LETHE_GGUF_UINT32 = 4, LETHE_GGUF_INT32 = 5, LETHE_GGUF_FLOAT32 = 6, LETHE_GGUF_BOOL = 7,
    LETHE_GGUF_STRING = 8, LETHE_GGUF_ARRAY = 9, LETHE_GGUF_UINT64 = 10, LETHE_GGUF_INT64 = 11,
    LETHE_GGUF_FLOAT64 = 12,
} lethe_gguf_type;


typedef struct lethe_gguf_str {
    uint64_t len;
    const char *data; /* points into the mapping, NOT NUL-terminated */
} lethe_gguf_str;

typedef struct lethe_gguf_kv {
    lethe_gguf_str key;
    lethe_gguf_type type;
    /* scalar value (for non-array, non-string types), widened */
    union { uint64_t u64; int64_t i64; double f64; } v;
    lethe_gguf_str str;          /* type == STRING */
    lethe_gguf_type arr_type;    /* type == ARRAY: element type */
    uint64_t arr_n;              /* type == ARRAY: element count */
    const void *arr_data;        /* type == ARRAY: first element in the mapping */
    uint64_t *arr_str_off;       /* owned; ARRAY of STRING: offset of element i's length prefix
                                    in the mapping (built at open) */
} lethe_gguf_kv;

#define LETHE_GGUF_MAX_DIMS 4
typedef struct lethe_gguf_tensor {
    char name[128];                  /* NUL-terminated copy */
    uint32_t n_dims;
    uint64_t ne[LETHE_GGUF_MAX_DIMS]; /* ggml order: ne[0] is the fastest-varying (row length) */
    lethe_ggml_type type;
    uint64_t offset;                 /* relative to the data section */
    size_t n_bytes;
    const void *data;                /* into the mapping */
} lethe_gguf_tensor;

typedef struct lethe_gguf {
    char *path;            /* owned copy, for error messages */
    void *map;             /* mmap base */
    size_t map_size;
    uint32_t version;
    uint64_t n_kv;
    lethe_gguf_kv *kv;     /* owned, [n_kv] */
    uint64_t n_tensors;
    lethe_gguf_tensor *tensors; /* owned, [n_tensors] */
    uint64_t alignment;
    uint64_t data_offset;  /* start of the data section in the file */
    /* open-addressing name indexes (slot = index + 1, 0 = empty), built at open */
    uint64_t *kv_index, *tensor_index;
    uint64_t kv_index_mask, tensor_index_mask;
} lethe_gguf;

/* Opens and validates `path`. On failure nothing is left allocated and the
 * last error names the file and the problem (truncated, bad magic, ...). */
lethe_status lethe_gguf_open(const char *path, lethe_gguf *out);
void lethe_gguf_close(lethe_gguf *g); /* NULL-safe, idempotent */

const lethe_gguf_kv *lethe_gguf_find(const lethe_gguf *g, const char *key); /* NULL if absent */
const lethe_gguf_tensor *lethe_gguf_find_tensor(const lethe_gguf *g, const char *name);

/* Typed getters: return LETHE_ERR_NOT_FOUND if absent, LETHE_ERR_FORMAT if the type does not
 * convert. Integers of any width convert to int64; floats of any width to double. */
lethe_status lethe_gguf_get_int(const lethe_gguf *g, const char *key, int64_t *out);
lethe_status lethe_gguf_get_float(const lethe_gguf *g, const char *key, double *out);
lethe_status lethe_gguf_get_str(const lethe_gguf *g, const char *key, lethe_gguf_str *out);
/* Array of strings: element i (bounds-checked by the caller against kv->arr_n).
 * Strings in an array are length-prefixed; the parser builds an offset index at open. */
lethe_gguf_str lethe_gguf_arr_str(const lethe_gguf *g, const lethe_gguf_kv *kv, uint64_t i);

#endif /* LETHE_GGUF_H */

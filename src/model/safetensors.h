/* safetensors.h - read-only safetensors checkpoints (single file or sharded).
 *
 * A file is: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [b, e]}, ...,
 *  "__metadata__": {...}}, then the data section (offsets relative to 8 + N).
 * Files are mmapped; every header field is validated at open (offsets inside
 * the file, e - b == elements * dtype size). A sharded checkpoint is a folder
 * with model.safetensors.index.json whose "weight_map" names the shard of
 * every tensor. Shapes are in PyTorch order (shape[0] outermost). */
#ifndef LETHE_SAFETENSORS_H
#define LETHE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#define LETHE_ST_MAX_DIMS 8

typedef struct lethe_st_tensor {
    char *name;                   /* owned */
    char dtype[16];               /* as written: "F32", "BF16", "I64", ... */
    int n_dims;
    int64_t shape[LETHE_ST_MAX_DIMS];
    uint64_t n_elems;
    size_t n_bytes;
    const void *data;             /* into the shard's mapping */
    int file;                     /* shard index */
} lethe_st_tensor;

typedef struct lethe_st_file {
    char *path;                   /* owned */
    void *map;
    size_t size;
} lethe_st_file;

typedef struct lethe_safetensors {
    lethe_st_file *files;         /* owned, [n_files] */
    int n_files;
    lethe_st_tensor *tensors;     /* owned, [n_tensors] */
    size_t n_tensors, cap_tensors;
    uint64_t *index;              /* name hash index: slot = tensor index + 1 */
    uint64_t index_mask;
} lethe_safetensors;

/* Opens one .safetensors file. */
lethe_status lethe_st_open_file(const char *path, lethe_safetensors *out);
/* Opens a folder: model.safetensors.index.json (sharded) or model.safetensors. */
lethe_status lethe_st_open_dir(const char *dir, lethe_safetensors *out);
void lethe_st_close(lethe_safetensors *st); /* NULL-safe, idempotent */

const lethe_st_tensor *lethe_st_find(const lethe_safetensors *st, const char *name);

/* Converts a tensor to f32 (dst holds t->n_elems floats). F32, F16 and BF16
 * are supported; any other dtype is LETHE_ERR_UNSUPPORTED naming the tensor. */
lethe_status lethe_st_to_f32(const lethe_safetensors *st, const lethe_st_tensor *t, float *dst);

#endif /* LETHE_SAFETENSORS_H */

/* safetensors.c - safetensors parsing (cJSON header) over mmapped shards.
 *
 * Validation at open, so that later reads never go out of bounds:
 *   header length <= file size - 8 (and <= 256 MiB), header is a JSON object,
 *   each entry has a known dtype string, a shape of <= 8 non-negative ints,
 *   data_offsets [b, e] with b <= e <= data section size and
 *   e - b == prod(shape) * dtype size.
 * Dtypes that the spec defines but lethe does not convert (I64, F8_E4M3...)
 * are accepted at open and refused by lethe_st_to_f32 naming the tensor, so a
 * checkpoint with unused integer buffers still opens. Sharded checkpoints:
 * every shard named in model.safetensors.index.json's weight_map is opened
 * once, and each mapped tensor must be present in its shard. */
#include "model/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/util.h"
#include "model/gguf.h"

#define ST_MAX_HEADER (256u << 20)

static int dtype_size(const char *d) {
    static const struct { const char *name; int size; } t[] = {
        {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"U64", 8},
        {"I32", 4}, {"U32", 4}, {"I16", 2}, {"U16", 2}, {"I8", 1}, {"U8", 1},
        {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(t); i++)
        if (!strcmp(t[i].name, d)) return t[i].size;
    return 0;
}

static void index_put(lethe_safetensors *st, size_t i) {
    const char *name = st->tensors[i].name;
    uint64_t h = lethe_hash64(name, strlen(name), 0) & st->index_mask;
    while (st->index[h]) h = (h + 1) & st->index_mask;
    st->index[h] = i + 1;
}

static void index_rebuild(lethe_safetensors *st) {
    uint64_t cap = 16;
    while (cap < 2 * st->n_tensors) cap <<= 1;
    free(st->index);
    st->index = lethe_xcalloc((size_t)cap, sizeof(uint64_t));
    st->index_mask = cap - 1;
    for (size_t i = 0; i < st->n_tensors; i++) index_put(st, i);
}

const lethe_st_tensor *lethe_st_find(const lethe_safetensors *st, const char *name) {
    if (!st->index) return NULL;
    uint64_t h = lethe_hash64(name, strlen(name), 0) & st->index_mask;
    for (; st->index[h]; h = (h + 1) & st->index_mask) {
        const lethe_st_tensor *t = &st->tensors[st->index[h] - 1];
        if (!strcmp(t->name, name)) return t;
    }
    return NULL;
}

static lethe_status parse_entry(const char *path, const cJSON *e, const uint8_t *data,
                                uint64_t data_size, lethe_st_tensor *t) {
    const char *name = t->name;
    if (!cJSON_IsObject(e))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': entry is not an object", path, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': needs string 'dtype', array "
                            "'shape' and array 'data_offsets'", path, name);
    int es = dtype_size(dt->valuestring);
    if (!es || strlen(dt->valuestring) >= sizeof(t->dtype))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%.32s'", path, name,
                            dt->valuestring);
    strcpy(t->dtype, dt->valuestring);
    int nd = cJSON_GetArraySize(sh);
    if (nd > LETHE_ST_MAX_DIMS)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': %d dimensions (max %d)", path, name,
                            nd, LETHE_ST_MAX_DIMS);
    t->n_dims = nd;
    uint64_t n = 1;
    for (int d = 0; d < nd; d++) {
        const cJSON *x = cJSON_GetArrayItem(sh, d);
        double v = cJSON_IsNumber(x) ? x->valuedouble : -1;
        if (!(v >= 0 && v < 9.0e15) || v != (double)(int64_t)v)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': invalid shape[%d]", path, name, d);
        t->shape[d] = (int64_t)v;
        if (t->shape[d] && n > UINT64_MAX / 8 / (uint64_t)t->shape[d])
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': shape overflows", path, name);
        n *= (uint64_t)t->shape[d];
    }
    t->n_elems = n;
    if (cJSON_GetArraySize(off) != 2)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': data_offsets needs 2 entries", path,
                            name);
    double b = cJSON_GetArrayItem(off, 0)->valuedouble, en = cJSON_GetArrayItem(off, 1)->valuedouble;
    if (!cJSON_IsNumber(cJSON_GetArrayItem(off, 0)) || !cJSON_IsNumber(cJSON_GetArrayItem(off, 1)) ||
        !(b >= 0 && en >= b && en <= (double)data_size))
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets [%.0f, %.0f] outside the data section "
                            "(%" PRIu64 " bytes; truncated file?)", path, name, b, en, data_size);
    uint64_t ub = (uint64_t)b, ue = (uint64_t)en;
    if (ue - ub != n * (uint64_t)es)
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets span %" PRIu64 " bytes but shape x %s "
                            "needs %" PRIu64, path, name, ue - ub, t->dtype, n * (uint64_t)es);
    t->n_bytes = (size_t)(ue - ub);
    t->data = data + ub;
    return LETHE_OK;
}

/* Maps `path` and appends its tensors to st. */
static lethe_status add_file(lethe_safetensors *st, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return lethe_errorf(LETHE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return lethe_errorf(LETHE_ERR_IO, "%s: not a regular file", path);
    }
    size_t size = (size_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: truncated safetensors file: %zu bytes, the "
                            "header length alone needs 8", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return lethe_errorf(LETHE_ERR_IO, "%s: mmap failed: %s", path, strerror(e));
    st->files = lethe_xrealloc(st->files, (size_t)(st->n_files + 1) * sizeof(lethe_st_file));
    int fi = st->n_files++;
    st->files[fi] = (lethe_st_file){.path = lethe_xstrdup(path), .map = map, .size = size};

    uint64_t hlen;
    memcpy(&hlen, map, 8);
    if (hlen > size - 8 || hlen > ST_MAX_HEADER)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: truncated safetensors file: header of %" PRIu64
                            " bytes but only %zu bytes follow", path, hlen, size - 8);
    const char *hdr = (const char *)map + 8;
    cJSON *root = cJSON_ParseWithLength(hdr, (size_t)hlen);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: safetensors header is not a valid JSON object",
                            path);
    }
    const uint8_t *data = (const uint8_t *)map + 8 + hlen;
    uint64_t data_size = size - 8 - hlen;
    lethe_status s = LETHE_OK;
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (!strcmp(it->string, "__metadata__")) continue;
        if (st->n_tensors == st->cap_tensors) {
            st->cap_tensors = st->cap_tensors * 2 + 64;
            st->tensors = lethe_xrealloc(st->tensors, st->cap_tensors * sizeof(lethe_st_tensor));
        }
        lethe_st_tensor *t = &st->tensors[st->n_tensors];
        memset(t, 0, sizeof(*t));
        t->name = lethe_xstrdup(it->string);
        t->file = fi;
        st->n_tensors++;
        if ((s = parse_entry(path, it, data, data_size, t))) break;
    }
    cJSON_Delete(root);
    return s;
}

static lethe_status st_fail(lethe_safetensors *st, lethe_status s) {
    lethe_st_close(st);
    return s;
}

static lethe_status check_duplicates(lethe_safetensors *st) {
    index_rebuild(st);
    for (size_t i = 0; i < st->n_tensors; i++)
        if (lethe_st_find(st, st->tensors[i].name) != &st->tensors[i])
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s' appears twice in the checkpoint",
                                st->files[st->tensors[i].file].path, st->tensors[i].name);
    return LETHE_OK;
}

lethe_status lethe_st_open_file(const char *path, lethe_safetensors *out) {
    memset(out, 0, sizeof(*out));
    lethe_status s = add_file(out, path);
    if (!s) s = check_duplicates(out);
    return s ? st_fail(out, s) : LETHE_OK;
}

/* true when path is ".../<name>" */
static bool path_is_file(const char *path, const char *name) {
    size_t pl = strlen(path), nl = strlen(name);
    return pl > nl && path[pl - nl - 1] == '/' && !strcmp(path + pl - nl, name);
}

static bool file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

lethe_status lethe_st_open_dir(const char *dir, lethe_safetensors *out) {
    memset(out, 0, sizeof(*out));
    size_t dl = strlen(dir);
    char *p = lethe_xmalloc(dl + 300);
    snprintf(p, dl + 300, "%s/model.safetensors.index.json", dir);
    if (!file_exists(p)) {
        snprintf(p, dl + 300, "%s/model.safetensors", dir);
        if (!file_exists(p)) {
            free(p);
            return lethe_errorf(LETHE_ERR_NOT_FOUND, "%s: no model.safetensors or "
                                "model.safetensors.index.json in this folder", dir);
        }
        lethe_status s = lethe_st_open_file(p, out);
        free(p);
        return s;
    }
    char *text;
    lethe_status s = lethe_read_file(p, &text, NULL);
    if (s) {
        free(p);
        return s;
    }
    cJSON *root = cJSON_Parse(text);
    free(text);
    const cJSON *wm = root ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(root);
        s = lethe_errorf(LETHE_ERR_FORMAT, "%s: invalid JSON or no \"weight_map\" object", p);
        free(p);
        return s;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, wm) {
        if (!cJSON_IsString(it) || !it->valuestring[0] || strchr(it->valuestring, '/') ||
            strlen(it->valuestring) > 255) {
            s = lethe_errorf(LETHE_ERR_FORMAT, "%s: weight_map['%s'] must be a file name in the "
                             "same folder", p, it->string);
            break;
        }
        bool seen = false;
        for (int f = 0; f < out->n_files && !seen; f++)
            seen = path_is_file(out->files[f].path, it->valuestring);
        if (seen) continue;
        char *shard = lethe_xmalloc(dl + 300);
        snprintf(shard, dl + 300, "%s/%s", dir, it->valuestring);
        s = add_file(out, shard);
        free(shard);
        if (s) break;
    }
    if (!s) s = check_duplicates(out);
    /* every tensor the index lists must be in the shard it names */
    if (!s) {
        cJSON_ArrayForEach(it, wm) {
            const lethe_st_tensor *t = lethe_st_find(out, it->string);
            if (!t || !path_is_file(out->files[t->file].path, it->valuestring)) {
                s = lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s' is listed in %s but missing "
                                 "from it", p, it->string, it->valuestring);
                break;
            }
        }
    }
    cJSON_Delete(root);
    free(p);
    return s ? st_fail(out, s) : LETHE_OK;
}

void lethe_st_close(lethe_safetensors *st) {
    if (!st) return;
    for (int i = 0; i < st->n_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    for (size_t i = 0; i < st->n_tensors; i++) free(st->tensors[i].name);
    free(st->files);
    free(st->tensors);
    free(st->index);
    memset(st, 0, sizeof(*st));
}

lethe_status lethe_st_to_f32(const lethe_safetensors *st, const lethe_st_tensor *t, float *dst) {
    lethe_ggml_type gt;
    if (!strcmp(t->dtype, "F32")) gt = LETHE_GGML_F32;
    else if (!strcmp(t->dtype, "F16")) gt = LETHE_GGML_F16;
    else if (!strcmp(t->dtype, "BF16")) gt = LETHE_GGML_BF16;
    else
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: tensor '%s' has dtype %s, which lethe does not load (supported: "
                            "F32, F16, BF16)", st->files[t->file].path, t->name, t->dtype);
    return lethe_ggml_dequantize(gt, t->data, dst, t->n_elems);
}

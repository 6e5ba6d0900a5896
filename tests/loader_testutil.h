/* loader_testutil.h - test doubles and writers for the loader tests.
 *
 * - capture backend: a lethe_backend whose weight_upload records each tensor
 *   (element count, order-sensitive checksum sum x_i * (i % 97 + 1), first
 *   values) instead of storing it, and counts live allocations so tests can
 *   prove that failures release everything. It can be told to fail the k-th
 *   upload (out of memory).
 * - a model-family registry double (lethe_arch_find) serving llama, qwen2 and
 *   qwen3 with no forward, so the loader is tested on its own; a test binary
 *   that includes this header links this definition instead of the library's.
 * - st_writer: builds safetensors files (F32 / BF16) for synthetic checkpoints;
 *   make_tiny writes a tiny HF folder (config.json + model.safetensors). */
#ifndef LETHE_TEST_LOADER_UTIL_H
#define LETHE_TEST_LOADER_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/model.h"
#include "test.h"
#include <stdbool.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct cap_rec {
    size_t n;
    double checksum;
    float first[4];
} cap_rec;

static int g_cap_live __attribute__((unused));          /* live allocations */
static int g_cap_uploads __attribute__((unused));       /* uploads so far */
static int g_cap_fail_at __attribute__((unused)) = -1;  /* fail this upload index (-1 = never) */

static inline double weighted_sum(const float *x, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * (double)(i % 97 + 1);
    return s;
}

static inline lethe_status cap_alloc(lethe_backend *be, size_t n, void **out) {
    *out = calloc(1, n ? n : 1);
    g_cap_live++;
    return LETHE_OK;
}
static inline void cap_release(lethe_backend *be, void *p) {
    free(p);
    g_cap_live--;
}
static inline lethe_status cap_upload(lethe_backend *be, const float *host, size_t n, void **out) {
    if (g_cap_uploads++ == g_cap_fail_at)
        return lethe_errorf(LETHE_ERR_NOMEM, "capture backend: simulated out of memory");
    cap_rec *r = calloc(1, sizeof(cap_rec));
    r->n = n;
    r->checksum = weighted_sum(host, n);
    memcpy(r->first, host, (n < 4 ? n : 4) * sizeof(float));
    g_cap_live++;
    *out = r;
    return LETHE_OK;
}
static inline void cap_destroy(lethe_backend *be) {}

static const lethe_backend_ops cap_ops = {
    .name = "capture", .act_size = 4, .kv_size = 4, .destroy = cap_destroy,
    .alloc = cap_alloc, .release = cap_release, .weight_upload = cap_upload,
};
static lethe_backend g_cap_be __attribute__((unused)) = {.ops = &cap_ops};

static inline const cap_rec *rec(const void *w) { return (const cap_rec *)w; }

/* ---- registry double ---- */

static inline lethe_status fake_check(const lethe_model_config *c) { return LETHE_OK; }
static const lethe_arch g_fake_arch = {.names = {"llama", "qwen2", "qwen3", NULL},
                                       .check = fake_check};

const lethe_arch *lethe_arch_find(const char *arch) {
    for (int i = 0; g_fake_arch.names[i]; i++)
        if (!strcmp(arch, g_fake_arch.names[i])) return &g_fake_arch;
    lethe_errorf(LETHE_ERR_UNSUPPORTED,
                 "model architecture '%s' is not supported by lethe (supported: llama, qwen2, "
                 "qwen3)", arch);
    return NULL;
}

/* ---- safetensors writer ---- */

typedef struct st_writer {
    char hdr[1 << 16];
    size_t hlen;
    uint8_t *data;
    size_t n, cap;
} st_writer;

static inline void stw_init(st_writer *w) {
    memset(w, 0, sizeof(*w));
    w->hlen = (size_t)snprintf(w->hdr, sizeof(w->hdr), "{\"__metadata__\":{\"format\":\"pt\"}");
}

/* adds a tensor of shape [d0] (d1 == 0) or [d0, d1]; bf16 stores the top 16 bits */
static inline void stw_add(st_writer *w, const char *name, const float *x, int64_t d0, int64_t d1,
                    int bf16) {
    size_t n = (size_t)d0 * (size_t)(d1 ? d1 : 1), es = bf16 ? 2 : 4;
    if (w->n + n * es > w->cap) {
        w->cap = (w->n + n * es) * 2;
        w->data = realloc(w->data, w->cap);
    }
    size_t begin = w->n;
    for (size_t i = 0; i < n; i++) {
        if (bf16) {
            uint32_t b;
            memcpy(&b, &x[i], 4);
            uint16_t h = (uint16_t)(b >> 16);
            memcpy(w->data + w->n + 2 * i, &h, 2);
        } else {
            memcpy(w->data + w->n + 4 * i, &x[i], 4);
        }
    }
    w->n += n * es;
    char shape[64];
    if (d1) snprintf(shape, sizeof(shape), "[%lld,%lld]", (long long)d0, (long long)d1);
    else snprintf(shape, sizeof(shape), "[%lld]", (long long)d0);
    w->hlen += (size_t)snprintf(w->hdr + w->hlen, sizeof(w->hdr) - w->hlen,
                                ",\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                                name, bf16 ? "BF16" : "F32", shape, begin, w->n);
}

/* writes the file; returns malloc'd bytes and size (for truncation tests) */
static inline uint8_t *stw_build(st_writer *w, size_t *n) {
    char hdr[(1 << 16) + 8];
    size_t hl = (size_t)snprintf(hdr, sizeof(hdr), "%s}", w->hdr);
    while (hl % 8) hdr[hl++] = ' ';
    uint64_t h64 = hl;
    *n = 8 + hl + w->n;
    uint8_t *b = malloc(*n);
    memcpy(b, &h64, 8);
    memcpy(b + 8, hdr, hl);
    if (w->n) memcpy(b + 8 + hl, w->data, w->n);
    return b;
}

static inline void stw_free(st_writer *w) { free(w->data); }

/* ---- synthetic HF folders ---- */

static char g_dir[64] __attribute__((unused));
/* make_tiny fault injection: leave this tensor out / write it with one extra row */
static const char *g_tiny_skip __attribute__((unused));
static const char *g_tiny_reshape __attribute__((unused));

static inline void write_file(const char *dir, const char *name, const void *d, size_t n) {
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    CHECK(f && fwrite(d, 1, n, f) == n);
    fclose(f);
}

static inline void rm_dir(const char *dir) {
    const char *names[] = {"config.json", "model.safetensors", "generation_config.json"};
    char p[256];
    for (size_t i = 0; i < 3; i++) {
        snprintf(p, sizeof(p), "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
}

/* value j of tensor t: distinct per tensor, exact in bf16 */
static inline float val(int t, size_t j) { return (float)((int)((t * 131 + j * 7) % 61) - 30) / 16.0f; }

typedef struct syn {
    char name[96];
    int64_t d0, d1;
    double checksum;
} syn;

/* Builds a tiny HF checkpoint of `arch`; returns the tensor list. */
static inline int make_tiny(const char *arch, bool bias, bool qk_norm, bool tie, syn *out) {
    const int dim = 32, heads = 4, kv = 2, hd = 8, ff = 48, vocab = 40, layers = 2;
    snprintf(g_dir, sizeof(g_dir), "/tmp/lethe_hf_XXXXXX");
    CHECK(mkdtemp(g_dir));
    char cfg[1024];
    int n = snprintf(cfg, sizeof(cfg),
                     "{\"model_type\": \"%s\", \"hidden_size\": %d, \"num_hidden_layers\": %d, "
                     "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, "
                     "\"intermediate_size\": %d, \"vocab_size\": %d, \"max_position_embeddings\": 64,"
                     " \"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": %s, \"attention_bias\": %s}",
                     arch, dim, layers, heads, kv, hd, ff, vocab, tie ? "true" : "false",
                     bias ? "true" : "false");
    write_file(g_dir, "config.json", cfg, (size_t)n);
    int k = 0;
#define T(nm, a, b) (snprintf(out[k].name, 96, "%s", nm), out[k].d0 = a, out[k].d1 = b, k++)
    T("model.embed_tokens.weight", vocab, dim);
    T("model.norm.weight", dim, 0);
    if (!tie) T("lm_head.weight", vocab, dim);
    char b[96];
    for (int l = 0; l < layers; l++) {
#define L(suffix, a, bb) (snprintf(b, sizeof(b), "model.layers.%d.%s", l, suffix), T(b, a, bb))
        L("input_layernorm.weight", dim, 0);
        L("self_attn.q_proj.weight", heads * hd, dim);
        L("self_attn.k_proj.weight", kv * hd, dim);
        L("self_attn.v_proj.weight", kv * hd, dim);
        if (bias) {
            L("self_attn.q_proj.bias", heads * hd, 0);
            L("self_attn.k_proj.bias", kv * hd, 0);
            L("self_attn.v_proj.bias", kv * hd, 0);
        }
        if (qk_norm) {
            L("self_attn.q_norm.weight", hd, 0);
            L("self_attn.k_norm.weight", hd, 0);
        }
        L("self_attn.o_proj.weight", dim, heads * hd);
        L("post_attention_layernorm.weight", dim, 0);
        L("mlp.gate_proj.weight", ff, dim);
        L("mlp.up_proj.weight", ff, dim);
        L("mlp.down_proj.weight", dim, ff);
#undef L
    }
#undef T
    st_writer w;
    stw_init(&w);
    for (int t = 0; t < k; t++) {
        if (g_tiny_skip && !strcmp(out[t].name, g_tiny_skip)) continue;
        int64_t d0 = out[t].d0 + (g_tiny_reshape && !strcmp(out[t].name, g_tiny_reshape));
        size_t e = (size_t)d0 * (size_t)(out[t].d1 ? out[t].d1 : 1);
        float *x = malloc(e * sizeof(float));
        for (size_t j = 0; j < e; j++) x[j] = val(t, j);
        out[t].checksum = weighted_sum(x, e);
        stw_add(&w, out[t].name, x, d0, out[t].d1, t % 2); /* alternate F32 / BF16 */
        free(x);
    }
    size_t nb;
    uint8_t *bytes = stw_build(&w, &nb);
    write_file(g_dir, "model.safetensors", bytes, nb);
    free(bytes);
    stw_free(&w);
    return k;
}

#endif /* LETHE_TEST_LOADER_UTIL_H */

/* test_loader.c - lethe_model_load on real and synthetic checkpoints.
 *
 * - SmolLM2 Q4_1 GGUF: every weight uploaded to the (capture) backend is
 *   checked against HF transformers' own GGUF import (order-sensitive
 *   checksums in tests/data/loader/, tests/gen/gen_loader_fixtures.py), which
 *   proves the name mapping, the dequantization and the undoing of
 *   llama.cpp's Q/K row permutation; tied lm_head shares tok_embd.
 * - synthetic HF folders (qwen2 with q/k/v bias, F32 + BF16; qwen3 with q/k
 *   norm and tied embeddings): each slot receives exactly its tensor.
 * - dummy weights: deterministic in (seed, name), independent of the OpenMP
 *   thread count, in the documented ranges.
 * - format parsing and auto-detection; progress output; nothing leaks. */
#include <math.h>
#include <stddef.h>
#include <omp.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/util.h"
#include "loader_testutil.h"
#include "model/dummy.h"
#include "test.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* HF name -> uploaded handle of model m */
static void *slot_of(const lethe_model *m, const char *name) {
    if (!strcmp(name, "model.embed_tokens.weight")) return m->w.tok_embd;
    if (!strcmp(name, "model.norm.weight")) return m->w.out_norm;
    if (!strcmp(name, "lm_head.weight")) return m->w.lm_head;
    int l;
    char rest[96];
    if (sscanf(name, "model.layers.%d.%95s", &l, rest) != 2 || l < 0 || l >= m->cfg.n_layers)
        return NULL;
    const lethe_layer_weights *L = &m->w.layers[l];
    static const struct { const char *n; size_t off; } map[] = {
        {"input_layernorm.weight", offsetof(lethe_layer_weights, attn_norm)},
        {"self_attn.q_proj.weight", offsetof(lethe_layer_weights, wq)},
        {"self_attn.k_proj.weight", offsetof(lethe_layer_weights, wk)},
        {"self_attn.v_proj.weight", offsetof(lethe_layer_weights, wv)},
        {"self_attn.q_proj.bias", offsetof(lethe_layer_weights, bq)},
        {"self_attn.k_proj.bias", offsetof(lethe_layer_weights, bk)},
        {"self_attn.v_proj.bias", offsetof(lethe_layer_weights, bv)},
        {"self_attn.q_norm.weight", offsetof(lethe_layer_weights, q_norm)},
        {"self_attn.k_norm.weight", offsetof(lethe_layer_weights, k_norm)},
        {"self_attn.o_proj.weight", offsetof(lethe_layer_weights, wo)},
        {"post_attention_layernorm.weight", offsetof(lethe_layer_weights, ffn_norm)},
        {"mlp.gate_proj.weight", offsetof(lethe_layer_weights, w_gate)},
        {"mlp.up_proj.weight", offsetof(lethe_layer_weights, w_up)},
        {"mlp.down_proj.weight", offsetof(lethe_layer_weights, w_down)},
    };
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (!strcmp(rest, map[i].n)) return *(void *const *)((const char *)L + map[i].off);
    return NULL;
}

static void test_gguf_smollm2_vs_transformers(void) {
    lethe_model m;
    lethe_model_load_params p = {.path = MODEL, .format = LETHE_LOAD_AUTO, .progress = true};
    double t0 = lethe_time_s();
    lethe_status s = lethe_model_load(&p, &g_cap_be, &m);
    CHECK_MSG(s == LETHE_OK, "%s (run `make model`)", lethe_last_error());
    fprintf(stderr, "    loaded in %.2fs\n", lethe_time_s() - t0);
    CHECK(!strcmp(m.cfg.arch, "llama") && m.cfg.n_layers == 30);
    CHECK(m.w.lm_head == m.w.tok_embd);
    CHECK(m.w.layers[0].bq == NULL && m.w.layers[0].q_norm == NULL);
    CHECK_EQ_INT(g_cap_live, 30 * 9 + 2); /* 9 tensors per layer + embd + norm */

    FILE *f = fopen("tests/data/loader/smollm2_q4_1_checksums.txt", "r");
    CHECK(f);
    char name[128];
    unsigned long long n;
    double want;
    int lines = 0;
    while (fscanf(f, "%127s %llu %lf", name, &n, &want) == 3) {
        const cap_rec *r = rec(slot_of(&m, name));
        CHECK_MSG(r, "no slot for %s", name);
        CHECK_MSG(r->n == n, "%s: %zu elements vs %llu", name, r->n, n);
        CHECK_MSG(fabs(r->checksum - want) <= 1e-9 * (fabs(want) + 1e3), "%s: checksum %.17g vs %.17g",
                  name, r->checksum, want);
        lines++;
    }
    fclose(f);
    CHECK_EQ_INT(lines, 273);
    lethe_model_free(&m);
    CHECK_EQ_INT(g_cap_live, 0);
    lethe_model_free(&m); /* idempotent */
    lethe_model_free(NULL);
}

static void check_tiny(const char *arch, bool bias, bool qk_norm, bool tie) {
    syn t[64];
    int k = make_tiny(arch, bias, qk_norm, tie, t);
    lethe_model m;
    lethe_model_load_params p = {.path = g_dir};
    lethe_status s = lethe_model_load(&p, &g_cap_be, &m);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    CHECK(!strcmp(m.cfg.arch, arch));
    CHECK_EQ_INT(g_cap_live, k);
    for (int i = 0; i < k; i++) {
        const cap_rec *r = rec(slot_of(&m, t[i].name));
        CHECK_MSG(r && r->checksum == t[i].checksum, "%s: wrong data in its slot", t[i].name);
    }
    CHECK((m.w.lm_head == m.w.tok_embd) == tie);
    CHECK((m.w.layers[1].bv != NULL) == bias);
    CHECK((m.w.layers[1].k_norm != NULL) == qk_norm);
    lethe_model_free(&m);
    CHECK_EQ_INT(g_cap_live, 0);
    rm_dir(g_dir);
}

static void test_hf_tiny(void) {
    check_tiny("qwen2", true, false, false);
    check_tiny("qwen3", false, true, true);
    check_tiny("llama", false, false, false);
}

/* ---- dummy ---- */

static char *write_tiny_config(void) {
    syn t[64];
    make_tiny("llama", false, false, false, t);
    char p[256];
    snprintf(p, sizeof(p), "%s/model.safetensors", g_dir);
    unlink(p); /* dummy reads config.json only */
    snprintf(p, sizeof(p), "%s/config.json", g_dir);
    return lethe_xstrdup(p);
}

static void test_dummy(void) {
    char *cfg = write_tiny_config();
    lethe_model a, b, c;
    lethe_model_load_params p = {.path = cfg, .format = LETHE_LOAD_DUMMY, .seed = 7};
    omp_set_num_threads(1);
    CHECK_MSG(lethe_model_load(&p, &g_cap_be, &a) == LETHE_OK, "%s", lethe_last_error());
    omp_set_num_threads(2);
    p.path = g_dir; /* the folder works too */
    CHECK(lethe_model_load(&p, &g_cap_be, &b) == LETHE_OK);
    p.seed = 8;
    CHECK(lethe_model_load(&p, &g_cap_be, &c) == LETHE_OK);
    CHECK(rec(a.w.tok_embd)->checksum == rec(b.w.tok_embd)->checksum);
    CHECK(rec(a.w.layers[1].w_down)->checksum == rec(b.w.layers[1].w_down)->checksum);
    CHECK(rec(a.w.layers[1].w_down)->checksum != rec(c.w.layers[1].w_down)->checksum);
    CHECK(rec(a.w.layers[0].wq)->checksum != rec(a.w.layers[1].wq)->checksum); /* per name */
    CHECK(rec(a.w.out_norm)->first[0] == 1.0f);
    lethe_model_free(&a);
    lethe_model_free(&b);
    lethe_model_free(&c);
    CHECK_EQ_INT(g_cap_live, 0);
    free(cfg);
    rm_dir(g_dir);

    /* ranges, and thread-count independence on a multi-chunk tensor */
    size_t n = 300000;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    omp_set_num_threads(1);
    lethe_dummy_fill(x, n, LETHE_DUMMY_MATRIX, 400, 3, "w");
    omp_set_num_threads(2);
    lethe_dummy_fill(y, n, LETHE_DUMMY_MATRIX, 400, 3, "w");
    CHECK(!memcmp(x, y, n * sizeof(float)));
    double mean = 0, lim = 1.0 / sqrt(400.0);
    for (size_t i = 0; i < n; i++) {
        CHECK(fabs(x[i]) <= lim);
        mean += x[i];
    }
    CHECK(fabs(mean / n) < 0.01 * lim);
    lethe_dummy_fill(y, n, LETHE_DUMMY_BIAS, 0, 3, "b");
    for (size_t i = 0; i < n; i++) CHECK(fabsf(y[i]) <= 0.02f);
    free(x);
    free(y);
}

static void test_formats(void) {
    lethe_load_format f;
    CHECK(lethe_load_format_parse("auto", &f) == LETHE_OK && f == LETHE_LOAD_AUTO);
    CHECK(lethe_load_format_parse("gguf", &f) == LETHE_OK && f == LETHE_LOAD_GGUF);
    CHECK(lethe_load_format_parse("hf", &f) == LETHE_OK && f == LETHE_LOAD_HF);
    CHECK(lethe_load_format_parse("safetensors", &f) == LETHE_OK && f == LETHE_LOAD_HF);
    CHECK(lethe_load_format_parse("dummy", &f) == LETHE_OK && f == LETHE_LOAD_DUMMY);
    CHECK(lethe_load_format_parse("onnx", &f) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "--load-format onnx: unknown format");

    lethe_model m;
    lethe_model_load_params p = {.path = "configs/llama-3.1-8b-instruct/config.json"};
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "use --load-format dummy");
    p.path = "configs/llama-3.1-8b-instruct"; /* folder without safetensors */
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_last_error(), "no model.safetensors");
    p.path = "tests";
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_last_error(), "tests: folder has no config.json");
    p.path = "no/such/model.gguf";
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_IO);
    CHECK_STR_CONTAINS(lethe_last_error(), "no/such/model.gguf: no such file");
    p.path = "configs/qwen3-30b-a3b/config.json";
    p.format = LETHE_LOAD_DUMMY;
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "'qwen3_moe' is not supported");
    CHECK_EQ_INT(g_cap_live, 0);
}

int main(void) {
    TEST_RUN(test_gguf_smollm2_vs_transformers);
    TEST_RUN(test_hf_tiny);
    TEST_RUN(test_dummy);
    TEST_RUN(test_formats);
    return 0;
}

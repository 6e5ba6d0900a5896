/* test_loader_errors.c - every loader error path, with its message.
 *
 * Bad input must give a status and a message naming the file and the
 * problem, never a crash (this binary also runs under ASan + UBSan through
 * `make test-asan`). Covered: GGUF truncated at many points of the real model
 * (header, key/values, tensor infos, data), bad magic, unsupported / big-endian
 * versions, hostile counts, unknown value / tensor types, misaligned or
 * out-of-bounds data, duplicate keys / tensors, bad dimensions, missing or
 * mistyped metadata; config.json missing key / invalid JSON / wrong types /
 * unsupported RoPE; safetensors truncated header, bad JSON, unknown dtype,
 * offsets out of range or inconsistent, broken shard index; missing tensor,
 * shape mismatch and upload failure during a model load (nothing leaks).
 * Temp files are created with mkstemp under /tmp and removed. */
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/util.h"
#include "gguf_writer.h"
#include "loader_testutil.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/safetensors.h"
#include "test.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static uint8_t *g_model;   /* first MODEL_HEAD bytes of the real model */
static size_t g_model_n;
#define MODEL_HEAD (1785664 + 4096) /* metadata + tensor infos + a little data */

/* GGUF bytes -> open -> expect status and message parts (path always included) */
static void expect_gguf(const void *bytes, size_t n, lethe_status want, const char *msg1,
                        const char *msg2) {
    char *path = tmp_write(bytes, n, ".gguf");
    lethe_gguf g;
    lethe_status s = lethe_gguf_open(path, &g);
    CHECK_MSG(s == want, "size %zu: status %d (%s), wanted %d", n, s, lethe_last_error(), want);
    CHECK_STR_CONTAINS(lethe_last_error(), path);
    if (msg1) CHECK_STR_CONTAINS(lethe_last_error(), msg1);
    if (msg2) CHECK_STR_CONTAINS(lethe_last_error(), msg2);
    CHECK(g.map == NULL && g.kv == NULL && g.tensors == NULL); /* nothing left allocated */
    unlink(path);
    free(path);
}

static void test_gguf_truncated(void) {
    FILE *f = fopen(MODEL, "rb");
    CHECK_MSG(f, "%s is missing: run `make model`", MODEL);
    g_model = malloc(MODEL_HEAD);
    g_model_n = fread(g_model, 1, MODEL_HEAD, f);
    fclose(f);
    CHECK_EQ_INT(g_model_n, MODEL_HEAD);
    /* inside the header */
    expect_gguf(g_model, 0, LETHE_ERR_FORMAT, "truncated GGUF", "shorter than the 24-byte header");
    expect_gguf(g_model, 10, LETHE_ERR_FORMAT, "truncated GGUF", NULL);
    expect_gguf(g_model, 24, LETHE_ERR_FORMAT, "truncated GGUF", "cannot fit");
    /* inside key/values: a key, a string value, the token array, the merges */
    size_t kv_points[] = {40, 60, 100, 400, 2000, 300000, 900000, 1500000};
    for (size_t i = 0; i < sizeof(kv_points) / sizeof(kv_points[0]); i++)
        expect_gguf(g_model, kv_points[i], LETHE_ERR_FORMAT, "truncated GGUF", NULL);
    expect_gguf(g_model, 2000, LETHE_ERR_FORMAT, "272 tensor infos cannot fit in 2000 bytes", NULL);
    expect_gguf(g_model, 300000, LETHE_ERR_FORMAT, "key 'tokenizer.ggml.tokens'",
                "49152 strings at offset 1107 do not fit");
    expect_gguf(g_model, 500000, LETHE_ERR_FORMAT, "key 'tokenizer.ggml.tokens': array string",
                "at offset");
    expect_gguf(g_model, 1500000, LETHE_ERR_FORMAT, "key 'tokenizer.ggml.merges'", NULL);
    /* inside tensor infos (they end at the data section, offset 1785664) */
    expect_gguf(g_model, 1785664 - 3000, LETHE_ERR_FORMAT, "truncated GGUF", "tensor");
    expect_gguf(g_model, 1785664 - 17, LETHE_ERR_FORMAT, "truncated GGUF", "tensor");
    /* inside the data */
    expect_gguf(g_model, 1785664 + 100, LETHE_ERR_FORMAT, "tensor 'token_embd.weight': data",
                "lies outside the file");
    expect_gguf(g_model, MODEL_HEAD, LETHE_ERR_FORMAT, "outside the file", "truncated?");
}

static void test_gguf_header_errors(void) {
    uint8_t *b = malloc(g_model_n);
    memcpy(b, g_model, g_model_n);
    memcpy(b, "GGML", 4);
    expect_gguf(b, g_model_n, LETHE_ERR_FORMAT, "not a GGUF file (bad magic 47 47 4d 4c)", NULL);
    memcpy(b, "GGUF", 4);
    uint32_t v = 1;
    memcpy(b + 4, &v, 4);
    expect_gguf(b, g_model_n, LETHE_ERR_UNSUPPORTED, "GGUF version 1 is not supported", NULL);
    v = 4;
    memcpy(b + 4, &v, 4);
    expect_gguf(b, g_model_n, LETHE_ERR_UNSUPPORTED, "GGUF version 4 is not supported", NULL);
    v = 0x03000000u;
    memcpy(b + 4, &v, 4);
    expect_gguf(b, g_model_n, LETHE_ERR_UNSUPPORTED, "big-endian GGUF", NULL);
    v = 3;
    memcpy(b + 4, &v, 4);
    uint64_t huge = UINT64_MAX / 2;
    memcpy(b + 16, &huge, 8); /* n_kv */
    expect_gguf(b, g_model_n, LETHE_ERR_FORMAT, "key/values cannot fit", NULL);
    memcpy(b + 16, g_model + 16, 8);
    memcpy(b + 8, &huge, 8); /* n_tensors */
    expect_gguf(b, g_model_n, LETHE_ERR_FORMAT, "tensor infos cannot fit", NULL);
    memcpy(b + 8, g_model + 8, 8);
    /* first key length made enormous */
    memcpy(b + 24, &huge, 8);
    expect_gguf(b, g_model_n, LETHE_ERR_FORMAT, "key/value #0: key needs", NULL);
    free(b);
    /* a directory is not a model */
    lethe_gguf g;
    CHECK(lethe_gguf_open("tests", &g) == LETHE_ERR_IO);
    CHECK_STR_CONTAINS(lethe_last_error(), "tests: not a regular file");
    CHECK(lethe_gguf_open("/nonexistent/x.gguf", &g) == LETHE_ERR_IO);
    CHECK_STR_CONTAINS(lethe_last_error(), "/nonexistent/x.gguf: cannot open");
}

/* synthetic files: a tiny valid base that each case breaks in one way */
static void base_kv_novocab(gw *w) {
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_u32(w, "llama.embedding_length", 64);
    gw_kv_u32(w, "llama.block_count", 1);
    gw_kv_u32(w, "llama.attention.head_count", 4);
    gw_kv_u32(w, "llama.context_length", 128);
    gw_kv_u32(w, "llama.feed_forward_length", 128);
    gw_kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
}

static void base_kv(gw *w) {
    base_kv_novocab(w);
    gw_kv_u32(w, "llama.vocab_size", 100);
}

static void expect_gw(gw *w, lethe_status want, const char *m1, const char *m2) {
    size_t n;
    uint8_t *b = gw_build(w, &n);
    expect_gguf(b, n, want, m1, m2);
    free(b);
    gw_free(w);
}

static float g_f32[8192];

static void test_gguf_synthetic_errors(void) {
    gw w = {0};
    uint64_t ne[4] = {64, 2, 1, 1};
    base_kv(&w);
    gw_tensor_add(&w, "t", 99, 2, ne, g_f32, 512);
    expect_gw(&w, LETHE_ERR_UNSUPPORTED, "tensor 't': unknown ggml type id 99", NULL);

    base_kv(&w);
    gw_tensor_add(&w, "t", LETHE_GGML_Q4_0, 2, (uint64_t[]){48, 2}, g_f32, 54);
    expect_gw(&w, LETHE_ERR_FORMAT, "row length 48 is not a multiple of the q4_0 block size",
              NULL);

    base_kv(&w); /* n_dims patched to 5 below */
    gw_tensor_add(&w, "t", LETHE_GGML_F32, 1, ne, g_f32, 256);
    size_t nb;
    uint8_t *bb = gw_build(&w, &nb);
    uint32_t five = 5;
    memcpy(bb + 24 + w.kv.n + 8 + 1, &five, 4);
    expect_gguf(bb, nb, LETHE_ERR_FORMAT, "tensor 't': 5 dimensions (expected 1..4)", NULL);
    free(bb);
    gw_free(&w);

    base_kv(&w);
    gw_tensor_add(&w, "t", LETHE_GGML_F32, 2, (uint64_t[]){0, 2}, g_f32, 0);
    expect_gw(&w, LETHE_ERR_FORMAT, "tensor 't': invalid dimension ne[0] = 0", NULL);

    base_kv(&w);
    gw_tensor_add(&w, "t", LETHE_GGML_F32, 2, (uint64_t[]){1ull << 40, 1ull << 40}, g_f32, 4);
    expect_gw(&w, LETHE_ERR_FORMAT, "tensor 't': invalid dimension ne[1]", NULL);

    base_kv(&w);
    gw_tensor_add(&w, "dup", LETHE_GGML_F32, 1, ne, g_f32, 256);
    gw_tensor_add(&w, "dup", LETHE_GGML_F32, 1, ne, g_f32, 256);
    expect_gw(&w, LETHE_ERR_FORMAT, "duplicate tensor 'dup'", NULL);

    base_kv(&w);
    gw_kv_u32(&w, "llama.block_count", 2);
    expect_gw(&w, LETHE_ERR_FORMAT, "duplicate key 'llama.block_count'", NULL);

    base_kv(&w);
    gw_kv_u32(&w, "general.alignment", 24);
    expect_gw(&w, LETHE_ERR_FORMAT, "general.alignment must be a power-of-two", NULL);

    /* unknown value type */
    base_kv(&w);
    gw_key(&w, "weird", 13);
    gw_u32(&w.kv, 0);
    expect_gw(&w, LETHE_ERR_FORMAT, "key 'weird': unknown value type 13", NULL);

    /* array claiming 2^60 strings / elements */
    base_kv(&w);
    gw_key(&w, "arr", 9);
    gw_u32(&w.kv, 8);
    gw_u64(&w.kv, 1ull << 60);
    expect_gw(&w, LETHE_ERR_FORMAT, "key 'arr': 1152921504606846976 strings at offset", NULL);
    base_kv(&w);
    gw_key(&w, "arr", 9);
    gw_u32(&w.kv, 6);
    gw_u64(&w.kv, 1ull << 60);
    expect_gw(&w, LETHE_ERR_FORMAT, "float32 elements at offset", NULL);
    base_kv(&w);
    gw_key(&w, "arr", 9);
    gw_u32(&w.kv, 77);
    gw_u64(&w.kv, 1);
    expect_gw(&w, LETHE_ERR_FORMAT, "key 'arr': unknown array element type 77", NULL);

    /* misaligned tensor offset: patch the offset field of the only tensor info */
    base_kv(&w);
    gw_tensor_add(&w, "t", LETHE_GGML_F32, 1, ne, g_f32, 256);
    size_t n;
    uint8_t *b = gw_build(&w, &n);
    size_t off_pos = 24 + w.kv.n + 8 + 1 + 4 + 8 + 4; /* name len + "t" + n_dims + ne[0] + type */
    uint64_t bad = 8;
    memcpy(b + off_pos, &bad, 8);
    expect_gguf(b, n, LETHE_ERR_FORMAT, "tensor 't': offset 8 is not a multiple of the alignment 32",
                NULL);
    /* data out of bounds: offset pushed past the end */
    bad = 1 << 20;
    memcpy(b + off_pos, &bad, 8);
    expect_gguf(b, n, LETHE_ERR_FORMAT, "tensor 't': data", "lies outside the file");
    free(b);
    gw_free(&w);
}

static void expect_config(gw *w, lethe_status want, const char *msg) {
    size_t n;
    uint8_t *b = gw_build(w, &n);
    char *path = tmp_write(b, n, ".gguf");
    lethe_gguf g;
    CHECK_MSG(lethe_gguf_open(path, &g) == LETHE_OK, "%s", lethe_last_error());
    lethe_model_config c;
    lethe_status s = lethe_gguf_config_load(&g, &c);
    CHECK_MSG(s == want, "status %d: %s", s, lethe_last_error());
    CHECK_STR_CONTAINS(lethe_last_error(), path);
    CHECK_STR_CONTAINS(lethe_last_error(), msg);
    lethe_gguf_close(&g);
    unlink(path);
    free(path);
    free(b);
    gw_free(w);
}

static void test_gguf_metadata_errors(void) {
    gw w = {0};
    gw_kv_u32(&w, "llama.block_count", 1);
    expect_config(&w, LETHE_ERR_FORMAT, "missing required metadata key 'general.architecture'");
    const char *keys[] = {"llama.embedding_length", "llama.block_count",
                          "llama.attention.head_count", "llama.context_length",
                          "llama.feed_forward_length", "llama.attention.layer_norm_rms_epsilon"};
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
        /* the base minus one key */
        gw_kv_str(&w, "general.architecture", "llama");
        if (k != 0) gw_kv_u32(&w, "llama.embedding_length", 64);
        if (k != 1) gw_kv_u32(&w, "llama.block_count", 1);
        if (k != 2) gw_kv_u32(&w, "llama.attention.head_count", 4);
        if (k != 3) gw_kv_u32(&w, "llama.context_length", 128);
        if (k != 4) gw_kv_u32(&w, "llama.feed_forward_length", 128);
        if (k != 5) gw_kv_f32(&w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
        char msg[128];
        snprintf(msg, sizeof(msg), "missing required metadata key '%s'", keys[k]);
        expect_config(&w, LETHE_ERR_FORMAT, msg);
    }
    /* wrong types */
    gw_kv_str(&w, "general.architecture", "llama");
    gw_kv_str(&w, "llama.embedding_length", "sixty-four");
    expect_config(&w, LETHE_ERR_FORMAT, "key 'llama.embedding_length' has type string, expected an integer");
    gw_kv_u32(&w, "general.architecture", 7);
    expect_config(&w, LETHE_ERR_FORMAT, "key 'general.architecture' has type uint32, expected a string");
    base_kv(&w);
    gw_kv_str(&w, "llama.rope.freq_base", "high");
    expect_config(&w, LETHE_ERR_FORMAT, "key 'llama.rope.freq_base' has type string, expected a number");
    /* values the config rejects */
    base_kv(&w);
    gw_kv_u32(&w, "llama.attention.head_count_kv", 3);
    expect_config(&w, LETHE_ERR_FORMAT, "n_heads (4) is not a multiple of n_kv_heads (3)");
    base_kv_novocab(&w);
    gw_kv_i32(&w, "llama.vocab_size", -5);
    expect_config(&w, LETHE_ERR_FORMAT, "n_vocab (vocab_size) = -5");
    base_kv(&w);
    gw_kv_str(&w, "llama.rope.scaling.type", "yarn");
    expect_config(&w, LETHE_ERR_UNSUPPORTED, "rope scaling type 'yarn' is not supported");
}

/* ---- config.json ---- */

static void expect_hf(const char *json, lethe_status want, const char *msg) {
    char *path = tmp_write(json, strlen(json), ".json");
    lethe_model_config c;
    lethe_status s = lethe_hf_config_load(path, &c);
    CHECK_MSG(s == want, "status %d: %s", s, lethe_last_error());
    if (want != LETHE_OK) {
        CHECK_STR_CONTAINS(lethe_last_error(), path);
        CHECK_STR_CONTAINS(lethe_last_error(), msg);
    }
    unlink(path);
    free(path);
}

#define OK_CFG "\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2, " \
               "\"num_attention_heads\": 4, \"vocab_size\": 100, \"max_position_embeddings\": 128, " \
               "\"rms_norm_eps\": 1e-6, \"intermediate_size\": 128"

static void test_hf_config_errors(void) {
    expect_hf("{" OK_CFG "}", LETHE_OK, ""); /* the base is valid */
    expect_hf("{\"model_type\": \"llama\"}", LETHE_ERR_FORMAT, ": missing key 'hidden_size'");
    expect_hf("{\"hidden_size\": 64}", LETHE_ERR_FORMAT, "missing key 'model_type'");
    expect_hf("{" OK_CFG ",}", LETHE_ERR_FORMAT, "invalid JSON near line 1");
    expect_hf("{\n\"a\": 1,\n\"b\": [1, 2\n}", LETHE_ERR_FORMAT, "invalid JSON near line 4");
    expect_hf("[1, 2]", LETHE_ERR_FORMAT, "top level must be a JSON object");
    expect_hf("", LETHE_ERR_FORMAT, "invalid JSON");
    expect_hf("{" OK_CFG ", \"num_key_value_heads\": \"two\"}", LETHE_ERR_FORMAT,
              "key 'num_key_value_heads' must be an integer (got string)");
    expect_hf("{" OK_CFG ", \"head_dim\": 16.5}", LETHE_ERR_FORMAT,
              "key 'head_dim' must be an integer (got number)");
    expect_hf("{" OK_CFG ", \"rope_theta\": \"big\"}", LETHE_ERR_FORMAT,
              "key 'rope_theta' must be a number (got string)");
    expect_hf("{" OK_CFG ", \"tie_word_embeddings\": 1}", LETHE_ERR_FORMAT,
              "key 'tie_word_embeddings' must be true or false (got number)");
    expect_hf("{\"model_type\": 3, \"hidden_size\": 64}", LETHE_ERR_FORMAT,
              "key 'model_type' must be a string (got number)");
    expect_hf("{" OK_CFG ", \"eos_token_id\": [1, \"x\"]}", LETHE_ERR_FORMAT,
              "key 'eos_token_id' must be an integer or a list of integers");
    expect_hf("{" OK_CFG ", \"eos_token_id\": [1,2,3,4,5,6,7,8,9]}", LETHE_ERR_UNSUPPORTED,
              "more than 8 eos_token_id values");
    expect_hf("{" OK_CFG ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}}",
              LETHE_ERR_UNSUPPORTED, "rope_scaling type 'yarn' is not supported");
    expect_hf("{" OK_CFG ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8}}",
              LETHE_ERR_FORMAT, "missing key 'low_freq_factor'");
    expect_hf("{" OK_CFG ", \"rope_scaling\": 5}", LETHE_ERR_FORMAT,
              "key 'rope_scaling' must be an object (got number)");
    expect_hf("{" OK_CFG ", \"num_key_value_heads\": 3}", LETHE_ERR_FORMAT,
              "n_heads (4) is not a multiple of n_kv_heads (3)");
    expect_hf("{\"model_type\": \"llama\", \"hidden_size\": 66, \"num_hidden_layers\": 2, "
              "\"num_attention_heads\": 4, \"vocab_size\": 100, \"max_position_embeddings\": 128, "
              "\"rms_norm_eps\": 1e-6, \"intermediate_size\": 128}", LETHE_ERR_FORMAT,
              "hidden_size 66 is not a multiple of num_attention_heads 4");
    lethe_model_config c;
    CHECK(lethe_hf_config_load("/nonexistent/config.json", &c) == LETHE_ERR_IO);
    CHECK_STR_CONTAINS(lethe_last_error(), "/nonexistent/config.json: cannot open");
}

/* ---- safetensors ---- */

static void expect_st(const void *bytes, size_t n, lethe_status want, const char *msg) {
    char *path = tmp_write(bytes, n, ".safetensors");
    lethe_safetensors st;
    lethe_status s = lethe_st_open_file(path, &st);
    CHECK_MSG(s == want, "status %d: %s", s, lethe_last_error());
    CHECK_STR_CONTAINS(lethe_last_error(), path);
    CHECK_STR_CONTAINS(lethe_last_error(), msg);
    CHECK(st.files == NULL && st.tensors == NULL);
    unlink(path);
    free(path);
}

/* raw file from a header string and n_data zero bytes */
static uint8_t *st_raw(const char *hdr, size_t n_data, size_t *n) {
    uint64_t hl = strlen(hdr);
    *n = 8 + hl + n_data;
    uint8_t *b = calloc(1, *n);
    memcpy(b, &hl, 8);
    memcpy(b + 8, hdr, hl);
    return b;
}

static void test_safetensors_errors(void) {
    size_t n;
    expect_st("\x10\0\0", 3, LETHE_ERR_FORMAT, "truncated safetensors file: 3 bytes");
    uint8_t *b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &n);
    expect_st(b, 20, LETHE_ERR_FORMAT, "truncated safetensors file: header of"); /* cut header */
    expect_st(b, n - 2, LETHE_ERR_FORMAT, "tensor 'a': data_offsets [0, 4] outside the data section");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],", 0, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "header is not a valid JSON object");
    free(b);
    b = st_raw("[1,2,3]", 0, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "header is not a valid JSON object");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "tensor 'a': unknown dtype 'Q4'");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "data_offsets span 4 bytes but shape x F32 needs 8");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 8, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "data_offsets [8, 4] outside");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,1e30]}}", 8, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "outside the data section");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "tensor 'a': invalid shape[0]");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "tensor 'a': 9 dimensions");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "needs string 'dtype', array 'shape' and array 'data_offsets'");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "data_offsets needs 2 entries");
    free(b);
    b = st_raw("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &n);
    expect_st(b, n, LETHE_ERR_FORMAT, "tensor 'a' appears twice");
    free(b);
    uint64_t huge = UINT64_MAX;
    expect_st(&huge, 8, LETHE_ERR_FORMAT, "truncated safetensors file: header of 18446744073709551615");
}

static void write_text(const char *dir, const char *name, const char *text) {
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
}

static void test_shard_index_errors(void) {
    char dir[] = "/tmp/lethe_idx_XXXXXX";
    CHECK(mkdtemp(dir));
    char idx[300], shard[300];
    snprintf(idx, sizeof(idx), "%s/model.safetensors.index.json", dir);
    snprintf(shard, sizeof(shard), "%s/s1.safetensors", dir);
    size_t n;
    uint8_t *b = st_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &n);
    FILE *f = fopen(shard, "wb");
    fwrite(b, 1, n, f);
    fclose(f);
    free(b);
    lethe_safetensors st;
    struct { const char *json; lethe_status want; const char *msg; } cases[] = {
        {"{\"weight_map\": {\"x\": \"s1.safetensors\"}}", LETHE_OK, ""},
        {"{\"weight_map\": {\"x\": \"s1.safetensors\", \"y\": \"s1.safetensors\"}}",
         LETHE_ERR_FORMAT, "tensor 'y' is listed in s1.safetensors but missing from it"},
        {"{\"weight_map\": {\"x\": \"s2.safetensors\"}}", LETHE_ERR_IO, "s2.safetensors: cannot open"},
        {"{\"weight_map\": {\"x\": \"../s1.safetensors\"}}", LETHE_ERR_FORMAT,
         "weight_map['x'] must be a file name in the same folder"},
        {"{\"weight_map\": [1]}", LETHE_ERR_FORMAT, "no \"weight_map\" object"},
        {"{\"weight_map\": ", LETHE_ERR_FORMAT, "invalid JSON"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        write_text(dir, "model.safetensors.index.json", cases[i].json);
        lethe_status s = lethe_st_open_dir(dir, &st);
        CHECK_MSG(s == cases[i].want, "case %zu: %d %s", i, s, lethe_last_error());
        if (s == LETHE_OK) lethe_st_close(&st);
        else CHECK_STR_CONTAINS(lethe_last_error(), cases[i].msg);
    }
    unlink(idx);
    unlink(shard);
    rmdir(dir);
}

/* ---- model load: missing tensor, shape mismatch, failing upload ---- */

static void expect_load(lethe_status want, const char *m1, const char *m2) {
    lethe_model m;
    lethe_model_load_params p = {.path = g_dir};
    lethe_status s = lethe_model_load(&p, &g_cap_be, &m);
    CHECK_MSG(s == want, "status %d: %s", s, lethe_last_error());
    CHECK_STR_CONTAINS(lethe_last_error(), g_dir);
    CHECK_STR_CONTAINS(lethe_last_error(), m1);
    if (m2) CHECK_STR_CONTAINS(lethe_last_error(), m2);
    CHECK_EQ_INT(g_cap_live, 0); /* everything uploaded before the failure was released */
    CHECK(m.w.layers == NULL && m.path == NULL);
}

static void test_load_errors(void) {
    syn t[64];
    g_tiny_skip = "model.layers.1.mlp.up_proj.weight";
    make_tiny("llama", false, false, false, t);
    expect_load(LETHE_ERR_FORMAT, "missing tensor 'model.layers.1.mlp.up_proj.weight'", NULL);
    rm_dir(g_dir);
    g_tiny_skip = NULL;

    g_tiny_reshape = "model.layers.0.self_attn.k_proj.weight";
    make_tiny("llama", false, false, false, t);
    expect_load(LETHE_ERR_FORMAT, "tensor 'model.layers.0.self_attn.k_proj.weight' has shape "
                "[17, 32], expected [16, 32]", NULL);
    rm_dir(g_dir);
    g_tiny_reshape = NULL;

    /* a tied config whose checkpoint lacks lm_head is fine; untied is not */
    g_tiny_skip = "lm_head.weight";
    make_tiny("llama", false, false, false, t);
    expect_load(LETHE_ERR_FORMAT, "missing tensor 'lm_head.weight'", NULL);
    rm_dir(g_dir);
    g_tiny_skip = NULL;

    make_tiny("llama", false, false, false, t);
    g_cap_uploads = 0;
    g_cap_fail_at = 5;
    lethe_model m;
    lethe_model_load_params p = {.path = g_dir};
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_NOMEM);
    CHECK_STR_CONTAINS(lethe_last_error(), "simulated out of memory");
    CHECK_EQ_INT(g_cap_live, 0);
    g_cap_fail_at = -1;
    rm_dir(g_dir);

    /* a family the registry does not serve */
    make_tiny("qwen3_moe", false, false, false, t);
    expect_load(LETHE_ERR_UNSUPPORTED, "'qwen3_moe' is not supported", NULL);
    rm_dir(g_dir);

    /* GGUF: wrong shape, then a missing tensor (tensors are checked in table order) */
    gw w = {0};
    base_kv(&w);
    gw_tensor_add(&w, "token_embd.weight", LETHE_GGML_F32, 2, (uint64_t[]){64, 101}, g_f32, 64 * 101 * 4);
    size_t n;
    uint8_t *b = gw_build(&w, &n);
    char *path = tmp_write(b, n, ".gguf");
    p.path = path;
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), path);
    CHECK_STR_CONTAINS(lethe_last_error(), "tensor 'token_embd.weight' has shape [101, 64], "
                       "expected [100, 64]");
    unlink(path);
    free(path);
    free(b);
    gw_free(&w);
    base_kv(&w);
    gw_tensor_add(&w, "token_embd.weight", LETHE_GGML_F32, 2, (uint64_t[]){64, 100}, g_f32, 64 * 100 * 4);
    b = gw_build(&w, &n);
    path = tmp_write(b, n, ".gguf");
    p.path = path;
    CHECK(lethe_model_load(&p, &g_cap_be, &m) == LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "missing tensor 'output_norm.weight'");
    CHECK_EQ_INT(g_cap_live, 0);
    unlink(path);
    free(path);
    free(b);
    gw_free(&w);
}

int main(void) {
    TEST_RUN(test_gguf_truncated);
    TEST_RUN(test_gguf_header_errors);
    TEST_RUN(test_gguf_synthetic_errors);
    TEST_RUN(test_gguf_metadata_errors);
    TEST_RUN(test_hf_config_errors);
    TEST_RUN(test_safetensors_errors);
    TEST_RUN(test_shard_index_errors);
    TEST_RUN(test_load_errors);
    free(g_model);
    return 0;
}

/* test_gguf.c - the GGUF parser against the default model file.
 *
 * Opens models/SmolLM2-135M-Instruct.Q4_1.gguf (fetched by `make model`) and
 * checks metadata of every kind (string, u32, f32, bool, string arrays with
 * their offset index), tensor infos (shape in ggml order, type, size) and
 * dequantized tensor data against values computed with the `gguf` Python
 * package (gguf.quants.dequantize) on the same file. */
#include <stdint.h>
#include <string.h>

#include "model/gguf.h"
#include "test.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static lethe_gguf g;

static int str_eq(lethe_gguf_str s, const char *c) {
    return s.len == strlen(c) && !memcmp(s.data, c, s.len);
}

static void test_open(void) {
    FILE *f = fopen(MODEL, "rb");
    CHECK_MSG(f, "%s is missing: run `make model` (make test fetches it first)", MODEL);
    fclose(f);
    lethe_status s = lethe_gguf_open(MODEL, &g);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    CHECK_EQ_INT(g.version, 3);
    CHECK_EQ_INT(g.n_kv, 33);
    CHECK_EQ_INT(g.n_tensors, 272);
    CHECK_EQ_INT(g.alignment, 32);
    CHECK_EQ_INT(g.data_offset, 1785664);
}

static void test_scalars(void) {
    lethe_gguf_str s;
    CHECK(lethe_gguf_get_str(&g, "general.architecture", &s) == LETHE_OK);
    CHECK(str_eq(s, "llama"));
    int64_t v;
    CHECK(lethe_gguf_get_int(&g, "llama.block_count", &v) == LETHE_OK);
    CHECK_EQ_INT(v, 30);
    CHECK(lethe_gguf_get_int(&g, "llama.embedding_length", &v) == LETHE_OK);
    CHECK_EQ_INT(v, 576);
    CHECK(lethe_gguf_get_int(&g, "tokenizer.ggml.eos_token_id", &v) == LETHE_OK);
    CHECK_EQ_INT(v, 2);
    double d;
    CHECK(lethe_gguf_get_float(&g, "llama.rope.freq_base", &d) == LETHE_OK);
    CHECK(d == 100000.0);
    CHECK(lethe_gguf_get_float(&g, "llama.attention.layer_norm_rms_epsilon", &d) == LETHE_OK);
    CHECK(fabs(d - 1e-5) < 1e-12);
    /* bool */
    CHECK(lethe_gguf_get_int(&g, "tokenizer.ggml.add_bos_token", &v) == LETHE_OK);
    CHECK_EQ_INT(v, 0);
    const lethe_gguf_kv *kv = lethe_gguf_find(&g, "tokenizer.ggml.add_bos_token");
    CHECK(kv && kv->type == LETHE_GGUF_BOOL);
    /* long string */
    CHECK(lethe_gguf_get_str(&g, "tokenizer.chat_template", &s) == LETHE_OK);
    CHECK(s.len > 40 && !memcmp(s.data, "{% for message in messages %}{% if loop.", 40));
}

static void test_getter_errors(void) {
    int64_t v;
    lethe_gguf_str s;
    double d;
    CHECK(lethe_gguf_find(&g, "no.such.key") == NULL);
    CHECK(lethe_gguf_get_int(&g, "no.such.key", &v) == LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_last_error(), "missing key 'no.such.key'");
    CHECK(lethe_gguf_get_int(&g, "general.architecture", &v) == LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "has type string, expected an integer");
    CHECK(lethe_gguf_get_str(&g, "llama.block_count", &s) == LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "has type uint32, expected a string");
    CHECK(lethe_gguf_get_float(&g, "tokenizer.ggml.tokens", &d) == LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), MODEL);
}

static void test_arrays(void) {
    const lethe_gguf_kv *kv = lethe_gguf_find(&g, "tokenizer.ggml.tokens");
    CHECK(kv && kv->type == LETHE_GGUF_ARRAY && kv->arr_type == LETHE_GGUF_STRING);
    CHECK_EQ_INT(kv->arr_n, 49152);
    CHECK(str_eq(lethe_gguf_arr_str(&g, kv, 0), "<|endoftext|>"));
    CHECK(str_eq(lethe_gguf_arr_str(&g, kv, 1), "<|im_start|>"));
    CHECK(str_eq(lethe_gguf_arr_str(&g, kv, 2), "<|im_end|>"));
    CHECK(str_eq(lethe_gguf_arr_str(&g, kv, 100), "t"));
    CHECK(str_eq(lethe_gguf_arr_str(&g, kv, 49151), "ectable"));
    kv = lethe_gguf_find(&g, "tokenizer.ggml.merges");
    CHECK(kv && kv->arr_n == 48900);
    CHECK(str_eq(lethe_gguf_arr_str(&g, kv, 0), "\xc4\xa0 t"));
    kv = lethe_gguf_find(&g, "tokenizer.ggml.token_type");
    CHECK(kv && kv->arr_type == LETHE_GGUF_INT32 && kv->arr_n == 49152);
    int32_t tt0;
    memcpy(&tt0, kv->arr_data, 4);
    CHECK_EQ_INT(tt0, 3); /* <|endoftext|> is a control token */
}

static double sum_tensor(const lethe_gguf_tensor *t, float *first4) {
    uint64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    float *buf = malloc(n * sizeof(float));
    CHECK(buf);
    CHECK(lethe_ggml_dequantize(t->type, t->data, buf, n) == LETHE_OK);
    double s = 0;
    for (uint64_t i = 0; i < n; i++) s += buf[i];
    memcpy(first4, buf, 4 * sizeof(float));
    free(buf);
    return s;
}

static void test_tensors(void) {
    const lethe_gguf_tensor *t = lethe_gguf_find_tensor(&g, "token_embd.weight");
    CHECK(t);
    CHECK_EQ_INT(t->type, LETHE_GGML_Q8_0);
    CHECK_EQ_INT(t->n_dims, 2);
    CHECK_EQ_INT(t->ne[0], 576);
    CHECK_EQ_INT(t->ne[1], 49152);
    CHECK_EQ_INT(t->n_bytes, 30081024);
    CHECK((const char *)t->data == (const char *)g.map + 1785664);
    CHECK(lethe_gguf_find_tensor(&g, "output.weight") == NULL); /* tied */
    CHECK(lethe_gguf_find_tensor(&g, "blk.30.attn_q.weight") == NULL);
    const lethe_gguf_tensor *k = lethe_gguf_find_tensor(&g, "blk.29.attn_k.weight");
    CHECK(k && k->ne[0] == 576 && k->ne[1] == 192 && k->type == LETHE_GGML_Q4_1);
    CHECK_EQ_INT(k->n_bytes, 576 / 32 * 20 * 192);
    CHECK(!strcmp(lethe_ggml_type_name(k->type), "q4_1"));

    /* reference values: gguf.quants.dequantize on this file */
    struct { const char *name; float first[4]; double sum; } ref[] = {
        {"token_embd.weight", {-0.10654449462890625f, 0.032978057861328125f,
                               0.048198699951171875f, -0.022830963134765625f}, -15353.04449415207},
        {"blk.0.attn_norm.weight", {0.01397705078125f, 0.0238037109375f, -0.019775390625f,
                                    -0.0302734375f}, 0.6129436492919922},
        {"blk.0.ffn_down.weight", {-0.330810546875f, 0.3460693359375f, 0.0753173828125f,
                                   -0.4661865234375f}, 150.63577270507812},
        {"output_norm.weight", {1.7578125f, 1.8203125f, 1.78125f, 1.6015625f}, 1038.33203125},
    };
    for (size_t i = 0; i < sizeof(ref) / sizeof(ref[0]); i++) {
        const lethe_gguf_tensor *ti = lethe_gguf_find_tensor(&g, ref[i].name);
        CHECK_MSG(ti, "%s", ref[i].name);
        float f4[4];
        double s = sum_tensor(ti, f4);
        CHECK_CLOSE(f4, ref[i].first, 4, 0.0f, 0.0f);
        CHECK_MSG(fabs(s - ref[i].sum) <= 1e-6 * (fabs(ref[i].sum) + 1.0), "%s: sum %.10g vs %.10g",
                  ref[i].name, s, ref[i].sum);
    }
}

static void test_close_idempotent(void) {
    lethe_gguf_close(&g);
    CHECK(g.map == NULL && g.kv == NULL);
    lethe_gguf_close(&g);
    lethe_gguf_close(NULL);
}

int main(void) {
    TEST_RUN(test_open);
    TEST_RUN(test_scalars);
    TEST_RUN(test_getter_errors);
    TEST_RUN(test_arrays);
    TEST_RUN(test_tensors);
    TEST_RUN(test_close_idempotent);
    return 0;
}

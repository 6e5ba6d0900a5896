/* test_model_config.c - model config from HF config.json and GGUF metadata.
 *
 * Parses the committed configs/ (real model hyper-parameters) and the default
 * SmolLM2 GGUF, checks family defaults (qwen2 bias, qwen3 qk-norm), the
 * transformers v5 rope_parameters spelling, generation_config.json override,
 * GGUF llama3 RoPE recovery from a rope_freqs.weight tensor, and every
 * validation rule of lethe_model_config_validate. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "gguf_writer.h"
#include "model/config.h"
#include "model/gguf.h"
#include "test.h"

static lethe_model_config load_hf(const char *path) {
    lethe_model_config c;
    lethe_status s = lethe_hf_config_load(path, &c);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    return c;
}

static void test_llama31(void) {
    lethe_model_config c = load_hf("configs/llama-3.1-8b-instruct/config.json");
    CHECK(!strcmp(c.arch, "llama"));
    CHECK_EQ_INT(c.dim, 4096);
    CHECK_EQ_INT(c.n_layers, 32);
    CHECK_EQ_INT(c.n_heads, 32);
    CHECK_EQ_INT(c.n_kv_heads, 8);
    CHECK_EQ_INT(c.head_dim, 128);
    CHECK_EQ_INT(c.ffn_dim, 14336);
    CHECK_EQ_INT(c.n_vocab, 128256);
    CHECK_EQ_INT(c.max_pos, 131072);
    CHECK(c.rms_eps == 1e-5f);
    CHECK(c.rope.theta == 500000.0f);
    CHECK(c.rope.scaling == LETHE_ROPE_SCALING_LLAMA3);
    CHECK(c.rope.factor == 8.0f && c.rope.low_freq_factor == 1.0f && c.rope.high_freq_factor == 4.0f);
    CHECK_EQ_INT(c.rope.original_max_pos, 8192);
    CHECK(!c.tie_embeddings && !c.qkv_bias && !c.qk_norm);
    CHECK_EQ_INT(c.bos_id, 128000);
    CHECK_EQ_INT(c.n_eos_ids, 3);
    CHECK(c.eos_ids[0] == 128001 && c.eos_ids[1] == 128008 && c.eos_ids[2] == 128009);
    CHECK(!strcmp(c.torch_dtype, "bfloat16"));
}

static void test_qwen_family(void) {
    lethe_model_config c = load_hf("configs/qwen3-4b/config.json");
    CHECK(!strcmp(c.arch, "qwen3"));
    CHECK_EQ_INT(c.dim, 2560);
    CHECK_EQ_INT(c.head_dim, 128); /* explicit: 32 * 128 != 2560 */
    CHECK(c.qk_norm && c.tie_embeddings && !c.qkv_bias);
    CHECK(c.rope.scaling == LETHE_ROPE_SCALING_NONE && c.rope.theta == 1e6f);
    CHECK_EQ_INT(c.n_eos_ids, 1);
    CHECK_EQ_INT(c.eos_ids[0], 151645);

    c = load_hf("configs/qwen3-30b-a3b/config.json");
    CHECK(!strcmp(c.arch, "qwen3_moe"));
    CHECK_EQ_INT(c.n_experts, 128);
    CHECK_EQ_INT(c.n_experts_used, 8);
    CHECK_EQ_INT(c.moe_ffn_dim, 768);
    CHECK_EQ_INT(c.n_kv_heads, 4);

    c = load_hf("configs/glm-4.7-flash/config.json");
    CHECK(!strcmp(c.arch, "glm4_moe_lite"));
    CHECK_EQ_INT(c.n_experts, 64);
    CHECK_EQ_INT(c.n_experts_used, 4);
    CHECK_EQ_INT(c.n_layers, 47);
    CHECK_EQ_INT(c.n_vocab, 154880);

    c = load_hf("configs/qwen3.6-27b/config.json"); /* language model under text_config */
    CHECK(!strcmp(c.arch, "qwen3_5_text"));
    CHECK_EQ_INT(c.dim, 5120);
    CHECK_EQ_INT(c.n_layers, 64);
    CHECK_EQ_INT(c.head_dim, 256);
    CHECK(c.rope.theta == 1e7f); /* from rope_parameters */
    /* hybrid: 16 x (3 DeltaNet + 1 gated attention), partial rotary 0.25 */
    CHECK_EQ_INT(c.n_linear_layers, 48);
    for (int32_t l = 0; l < c.n_layers; l++) CHECK(lethe_layer_is_linear(&c, l) == ((l + 1) % 4 != 0));
    CHECK_EQ_INT(c.lin_k_heads, 16);
    CHECK_EQ_INT(c.lin_v_heads, 48);
    CHECK_EQ_INT(c.lin_k_dim, 128);
    CHECK_EQ_INT(c.lin_v_dim, 128);
    CHECK_EQ_INT(c.lin_conv, 4);
    CHECK_EQ_INT(lethe_lin_conv_dim(&c), 10240);
    CHECK_EQ_INT(c.rope.rot_dim, 64);
    CHECK(c.attn_out_gate && c.norm_unit_offset && c.qk_norm && !c.tie_embeddings);
    CHECK_EQ_INT(c.n_kv_heads, 4);
    CHECK_EQ_INT(c.eos_ids[0], 248046);
}

/* writes `json` as <dir>/config.json in a fresh temp dir; returns the config path */
static char *write_config_dir(const char *json, const char *gen_json) {
    char tmpl[] = "/tmp/lethe_cfg_XXXXXX";
    char *dir = mkdtemp(tmpl);
    CHECK(dir);
    char *path = malloc(300);
    snprintf(path, 300, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs(json, f);
    fclose(f);
    if (gen_json) {
        char g[300];
        snprintf(g, sizeof(g), "%s/generation_config.json", dir);
        f = fopen(g, "w");
        fputs(gen_json, f);
        fclose(f);
    }
    return path;
}

static void remove_config_dir(char *path) {
    unlink(path);
    char *slash = strrchr(path, '/');
    char g[300];
    *slash = '\0';
    snprintf(g, sizeof(g), "%s/generation_config.json", path);
    unlink(g);
    rmdir(path);
    free(path);
}

#define BASE "\"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, " \
             "\"vocab_size\": 100, \"max_position_embeddings\": 128, \"rms_norm_eps\": 1e-6, " \
             "\"intermediate_size\": 128"

static void test_family_defaults_and_v5(void) {
    char *p = write_config_dir("{\"model_type\": \"qwen2\", " BASE ", \"eos_token_id\": 5, "
                               "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2.0, "
                               "\"rope_theta\": 20000}}",
                               "{\"bos_token_id\": 1, \"eos_token_id\": [7, 9]}");
    lethe_model_config c = load_hf(p);
    CHECK(c.qkv_bias && !c.qk_norm);
    CHECK_EQ_INT(c.n_kv_heads, 4); /* defaults to num_attention_heads */
    CHECK_EQ_INT(c.head_dim, 16);
    CHECK(c.rope.scaling == LETHE_ROPE_SCALING_LINEAR && c.rope.factor == 2.0f);
    CHECK(c.rope.theta == 20000.0f);
    CHECK_EQ_INT(c.bos_id, 1); /* generation_config.json wins */
    CHECK_EQ_INT(c.n_eos_ids, 2);
    CHECK(c.eos_ids[0] == 7 && c.eos_ids[1] == 9);
    remove_config_dir(p);

    p = write_config_dir("{\"model_type\": \"llama\", " BASE ", \"attention_bias\": true, "
                         "\"tie_word_embeddings\": true}", NULL);
    c = load_hf(p);
    CHECK(c.qkv_bias && c.tie_embeddings && c.bos_id == -1 && c.n_eos_ids == 0);
    remove_config_dir(p);
}

static void test_gguf_smollm2(void) {
    lethe_gguf g;
    lethe_status s = lethe_gguf_open("models/SmolLM2-135M-Instruct.Q4_1.gguf", &g);
    CHECK_MSG(s == LETHE_OK, "%s (run `make model`)", lethe_last_error());
    lethe_model_config c;
    s = lethe_gguf_config_load(&g, &c);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    CHECK(!strcmp(c.arch, "llama"));
    CHECK_EQ_INT(c.dim, 576);
    CHECK_EQ_INT(c.n_layers, 30);
    CHECK_EQ_INT(c.n_heads, 9);
    CHECK_EQ_INT(c.n_kv_heads, 3);
    CHECK_EQ_INT(c.head_dim, 64);
    CHECK_EQ_INT(c.ffn_dim, 1536);
    CHECK_EQ_INT(c.n_vocab, 49152);
    CHECK_EQ_INT(c.max_pos, 8192);
    CHECK(c.rope.theta == 100000.0f && c.rope.scaling == LETHE_ROPE_SCALING_NONE);
    CHECK(c.rms_eps == 1e-5f);
    CHECK(c.tie_embeddings && !c.qkv_bias && !c.qk_norm);
    CHECK_EQ_INT(c.bos_id, 1);
    CHECK_EQ_INT(c.n_eos_ids, 1);
    CHECK_EQ_INT(c.eos_ids[0], 2);
    lethe_gguf_close(&g);
}

/* llama.cpp's converter stores Llama-3.1 RoPE scaling as rope_freqs.weight */
static void test_gguf_llama3_rope_freqs(void) {
    const int head_dim = 128;
    const double theta = 500000.0, factor = 8.0, low = 1.0, high = 4.0, orig = 8192.0;
    float rf[64];
    for (int i = 0; i < head_dim / 2; i++) {
        double inv = pow(theta, -2.0 * i / head_dim), wl = 2 * M_PI / inv;
        if (wl < orig / high) rf[i] = 1.0f;
        else if (wl > orig / low) rf[i] = (float)factor;
        else {
            double sm = (orig / wl - low) / (high - low);
            rf[i] = (float)(1.0 / ((1 - sm) / factor + sm));
        }
    }
    gw w = {0};
    gw_kv_str(&w, "general.architecture", "llama");
    gw_kv_u32(&w, "llama.embedding_length", 4096);
    gw_kv_u32(&w, "llama.block_count", 32);
    gw_kv_u32(&w, "llama.attention.head_count", 32);
    gw_kv_u32(&w, "llama.attention.head_count_kv", 8);
    gw_kv_u32(&w, "llama.context_length", 131072);
    gw_kv_u32(&w, "llama.feed_forward_length", 14336);
    gw_kv_u32(&w, "llama.vocab_size", 128256);
    gw_kv_f32(&w, "llama.rope.freq_base", (float)theta);
    gw_kv_f32(&w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", 128000);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", 128009);
    gw_kv_u32(&w, "tokenizer.ggml.eot_token_id", 128009); /* duplicate: listed once */
    gw_kv_u32(&w, "tokenizer.ggml.eom_token_id", 128008);
    uint64_t ne[1] = {64};
    gw_tensor_add(&w, "rope_freqs.weight", LETHE_GGML_F32, 1, ne, rf, sizeof(rf));
    size_t n;
    uint8_t *bytes = gw_build(&w, &n);
    char *path = tmp_write(bytes, n, ".gguf");
    lethe_gguf g;
    CHECK_MSG(lethe_gguf_open(path, &g) == LETHE_OK, "%s", lethe_last_error());
    lethe_model_config c;
    lethe_status s = lethe_gguf_config_load(&g, &c);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    CHECK(c.rope.scaling == LETHE_ROPE_SCALING_LLAMA3);
    CHECK(c.rope.factor == 8.0f);
    CHECK_EQ_INT(c.rope.original_max_pos, 8192);
    CHECK_MSG(fabsf(c.rope.low_freq_factor - 1.0f) < 1e-3f && fabsf(c.rope.high_freq_factor - 4.0f) < 1e-3f,
              "low %g high %g", (double)c.rope.low_freq_factor, (double)c.rope.high_freq_factor);
    CHECK(c.tie_embeddings); /* no output.weight */
    CHECK_EQ_INT(c.n_eos_ids, 2);
    CHECK(c.eos_ids[0] == 128009 && c.eos_ids[1] == 128008);
    lethe_gguf_close(&g);

    /* a rope_freqs table that is not llama3-shaped is refused, not guessed */
    rf[1] = 3.0f;
    rf[2] = 1.0f;
    free(bytes);
    bytes = gw_build(&w, &n);
    unlink(path);
    free(path);
    path = tmp_write(bytes, n, ".gguf");
    CHECK(lethe_gguf_open(path, &g) == LETHE_OK);
    CHECK(lethe_gguf_config_load(&g, &c) == LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "rope_freqs.weight");
    lethe_gguf_close(&g);
    unlink(path);
    free(path);
    free(bytes);
    gw_free(&w);
}

static lethe_model_config good(void) {
    lethe_model_config c;
    lethe_model_config_init(&c);
    strcpy(c.arch, "llama");
    c.n_vocab = 100, c.dim = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 16, c.ffn_dim = 128, c.max_pos = 256;
    return c;
}

#define EXPECT_INVALID(mutation, text)                                                  \
    do {                                                                                \
        lethe_model_config c_ = good();                                                 \
        mutation;                                                                       \
        CHECK(lethe_model_config_validate(&c_, "src.json") == LETHE_ERR_FORMAT);        \
        CHECK_STR_CONTAINS(lethe_last_error(), "src.json: ");                           \
        CHECK_STR_CONTAINS(lethe_last_error(), text);                                   \
    } while (0)

static void test_validate(void) {
    lethe_model_config c = good();
    lethe_model_config_init(&c);
    CHECK_EQ_INT(c.bos_id, -1);
    CHECK_EQ_INT(c.eos_ids[0], -1);
    c = good();
    CHECK(lethe_model_config_validate(&c, "x") == LETHE_OK);
    EXPECT_INVALID(c_.arch[0] = 0, "architecture name is missing");
    EXPECT_INVALID(c_.n_vocab = 0, "n_vocab (vocab_size) = 0");
    EXPECT_INVALID(c_.dim = -1, "dim (hidden_size) = -1");
    EXPECT_INVALID(c_.n_layers = 0, "n_layers");
    EXPECT_INVALID(c_.n_heads = 0, "n_heads");
    EXPECT_INVALID(c_.n_kv_heads = 3, "n_heads (4) is not a multiple of n_kv_heads (3)");
    EXPECT_INVALID(c_.head_dim = 15, "head_dim = 15: must be even");
    EXPECT_INVALID(c_.ffn_dim = 0, "ffn_dim (intermediate_size) = 0");
    EXPECT_INVALID(c_.max_pos = 0, "max_pos");
    EXPECT_INVALID(c_.dim = 1 << 25, "must be in 1..16777216");
    EXPECT_INVALID(c_.rms_eps = 0, "rms_eps = 0");
    EXPECT_INVALID(c_.rope.theta = 0, "rope theta = 0");
    EXPECT_INVALID((c_.rope.scaling = LETHE_ROPE_SCALING_LINEAR, c_.rope.factor = 0),
                   "rope scaling factor = 0");
    EXPECT_INVALID((c_.rope.scaling = LETHE_ROPE_SCALING_LLAMA3, c_.rope.factor = 8),
                   "original_max_position_embeddings = 0");
    EXPECT_INVALID((c_.rope.scaling = LETHE_ROPE_SCALING_LLAMA3, c_.rope.factor = 8,
                    c_.rope.original_max_pos = 8192, c_.rope.low_freq_factor = 4,
                    c_.rope.high_freq_factor = 1), "0 < low_freq_factor (4) < high_freq_factor (1)");
    EXPECT_INVALID((c_.n_experts = 8, c_.n_experts_used = 9), "n_experts_used");
    EXPECT_INVALID((c_.n_experts = 8, c_.n_experts_used = 2), "moe_ffn_dim");
    EXPECT_INVALID(c_.bos_id = 100, "bos_token_id = 100: outside the vocabulary");
    EXPECT_INVALID((c_.n_eos_ids = 1, c_.eos_ids[0] = 1000), "eos_token_id = 1000");
    /* MoE configs need no dense ffn_dim */
    c = good();
    c.ffn_dim = 0, c.n_experts = 8, c.n_experts_used = 2, c.moe_ffn_dim = 32;
    CHECK(lethe_model_config_validate(&c, "x") == LETHE_OK);
}

int main(void) {
    TEST_RUN(test_llama31);
    TEST_RUN(test_qwen_family);
    TEST_RUN(test_family_defaults_and_v5);
    TEST_RUN(test_gguf_smollm2);
    TEST_RUN(test_gguf_llama3_rope_freqs);
    TEST_RUN(test_validate);
    return 0;
}

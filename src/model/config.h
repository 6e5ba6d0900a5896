/* config.h - model hyper-parameters, one spelling for every loader.
 *
 * Filled from GGUF metadata (gguf_config.c), from an HF config.json
 * (hf_config.c), or from config.json alone for dummy weights. Families that
 * are not implemented yet (MoE, MLA, hybrid linear attention) still parse,
 * so that `lethe` can name what is missing instead of failing obscurely;
 * lethe_arch_find() is what decides whether a family can run. */
#ifndef LETHE_MODEL_CONFIG_H
#define LETHE_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

typedef enum lethe_rope_scaling_type {
    LETHE_ROPE_SCALING_NONE = 0,
    LETHE_ROPE_SCALING_LINEAR,   /* positions divided by factor */
    LETHE_ROPE_SCALING_LLAMA3,   /* Llama 3.1 frequency-dependent scaling */
} lethe_rope_scaling_type;

typedef struct lethe_rope_config {
    float theta;                       /* base, e.g. 10000 or 500000 */
    lethe_rope_scaling_type scaling;
    float factor;                      /* linear / llama3 */
    float low_freq_factor;             /* llama3 */
    float high_freq_factor;            /* llama3 */
    int32_t original_max_pos;          /* llama3: original_max_position_embeddings */
} lethe_rope_config;

#define LETHE_ARCH_NAME_MAX 64
#define LETHE_MAX_EOS_IDS 8

typedef struct lethe_model_config {
    char arch[LETHE_ARCH_NAME_MAX]; /* "llama", "qwen2", "qwen3", "qwen3_moe", ... (GGUF spelling) */
    int32_t n_vocab;
    int32_t dim;           /* hidden size */
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;      /* usually dim / n_heads; Qwen3 sets it explicitly */
    int32_t ffn_dim;       /* intermediate size of the dense MLP */
    int32_t max_pos;       /* max_position_embeddings / context_length */
    float rms_eps;
    lethe_rope_config rope;
    bool tie_embeddings;   /* lm_head shares tok_embd */
    bool qkv_bias;         /* qwen2 */
    bool qk_norm;          /* qwen3: RMSNorm over head_dim of q and k before RoPE */
    /* MoE (parsed for later families; 0 when dense) */
    int32_t n_experts;
    int32_t n_experts_used;
    int32_t moe_ffn_dim;
    /* special tokens from generation_config.json / GGUF metadata; -1 when unknown */
    int32_t bos_id;
    int32_t eos_ids[LETHE_MAX_EOS_IDS];
    int32_t n_eos_ids;
    char torch_dtype[16];  /* informational: "bfloat16", "float32", ... */
} lethe_model_config;

void lethe_model_config_init(lethe_model_config *c); /* zero + sane defaults (-1 ids) */

/* Checks that every field the forward needs is present and consistent.
 * Returns LETHE_ERR_FORMAT naming `source` and the field otherwise. */
lethe_status lethe_model_config_validate(const lethe_model_config *c, const char *source);

/* Reads GGUF metadata ({arch}.* keys, tokenizer.ggml.* ids) and probes tensors for
 * tied embeddings / qkv bias / qk norm. Llama-3 RoPE scaling stored as a
 * rope_freqs.weight tensor is converted back to its parameters. */
typedef struct lethe_gguf lethe_gguf;
lethe_status lethe_gguf_config_load(const lethe_gguf *g, lethe_model_config *out);

/* Reads an HF config.json (and, if present beside it, generation_config.json). */
lethe_status lethe_hf_config_load(const char *config_path, lethe_model_config *out);

#endif /* LETHE_MODEL_CONFIG_H */

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
    /* partial rotary (qwen3_5: partial_rotary_factor 0.25): only the first
     * rot_dim values of each head are rotated, with frequencies computed for
     * rot_dim; the rest pass through. 0 = the whole head. */
    int32_t rot_dim;
} lethe_rope_config;

#define LETHE_ARCH_NAME_MAX 64
#define LETHE_MAX_EOS_IDS 8
#define LETHE_MAX_MLP_ONLY 64
#define LETHE_MAX_LAYERS 512 /* layer_linear[] bound (hybrid layer types) */

enum { LETHE_MOE_SOFTMAX = 0, LETHE_MOE_SIGMOID = 1 };

typedef struct lethe_model_config {
    char arch[LETHE_ARCH_NAME_MAX]; /* "llama", "qwen2", "qwen3", "qwen3_moe", ... (GGUF spelling) */
    int32_t n_vocab;
    int32_t dim;           /* hidden size */
    int32_t n_layers;
    int32_t n_heads;
    /* the KV slot geometry: n_kv_heads x head_dim per K (and V) row; latent
     * attention (kv_lora_rank > 0) stores 1 x (kv_lora_rank + qk_rope_dim) and no V */
    int32_t n_kv_heads;
    int32_t head_dim;      /* usually dim / n_heads; Qwen3 sets it explicitly */
    int32_t ffn_dim;       /* intermediate size of the dense MLP */
    int32_t max_pos;       /* max_position_embeddings / context_length */
    float rms_eps;
    lethe_rope_config rope;
    bool tie_embeddings;   /* lm_head shares tok_embd */
    bool qkv_bias;         /* qwen2 */
    bool qk_norm;          /* qwen3: RMSNorm over head_dim of q and k before RoPE */
    /* MoE (0 experts when dense). Layer l has routed experts when
     * lethe_layer_is_moe(c, l): l >= moe_first_layer (GLM first_k_dense_replace),
     * not in mlp_only (qwen3_moe mlp_only_layers) and (l + 1) % moe_step == 0
     * (qwen3_moe decoder_sparse_step); the other layers run the dense MLP (ffn_dim). */
    int32_t n_experts;
    int32_t n_experts_used;
    int32_t moe_ffn_dim; /* one expert's intermediate size */
    int32_t
        n_shared_experts; /* GLM: a dense MLP of n_shared * moe_ffn_dim beside the routed ones */
    int32_t moe_first_layer;
    int32_t moe_step; /* >= 1 */
    int32_t n_mlp_only;
    int32_t mlp_only[LETHE_MAX_MLP_ONLY];
    int32_t moe_scoring; /* LETHE_MOE_SOFTMAX (qwen3_moe) / LETHE_MOE_SIGMOID (glm, noaux_tc) */
    bool moe_norm_topk;  /* norm_topk_prob: chosen weights divided by their sum */
    float moe_scale;     /* routed_scaling_factor (1 when absent) */
    int32_t moe_n_group, moe_topk_group; /* group-limited routing (1, 1: none) */
    /* MLA (glm4_moe_lite; kv_lora_rank 0 = ordinary attention). The KV of a token
     * is the normed latent [kv_lora_rank] + the RoPE key [qk_rope_dim] shared by
     * all heads; q/k heads are qk_nope_dim + qk_rope_dim wide, v heads v_head_dim. */
    int32_t q_lora_rank; /* 0: q = x Wq^T directly */
    int32_t kv_lora_rank;
    int32_t qk_nope_dim, qk_rope_dim, v_head_dim;
    int32_t n_nextn_layers; /* multi-token-prediction layers after n_layers (ignored) */
    bool rope_interleave;   /* the checkpoint's RoPE pairs are (2j, 2j+1) (MLA) */
    /* Hybrid linear attention (qwen3_5: Gated DeltaNet layers between gated
     * full-attention layers; 0 linear layers = none). Layer l is a DeltaNet
     * layer when layer_linear[l]: it keeps a recurrent state [lin_v_heads,
     * lin_k_dim, lin_v_dim] (f32) and a causal-conv state [lin_conv - 1,
     * conv_dim] per request, and no KV. conv_dim = 2 lin_k_heads lin_k_dim +
     * lin_v_heads lin_v_dim. */
    int32_t n_linear_layers;
    uint8_t layer_linear[LETHE_MAX_LAYERS];
    int32_t lin_k_heads, lin_v_heads, lin_k_dim, lin_v_dim, lin_conv;
    bool attn_out_gate;     /* q_proj also yields a per-head gate: att *= sigmoid(gate) */
    bool norm_unit_offset;  /* RMSNorm weights are stored as w - 1 (applied as 1 + w) */
    /* special tokens from generation_config.json / GGUF metadata; -1 when unknown */
    int32_t bos_id;
    int32_t eos_ids[LETHE_MAX_EOS_IDS];
    int32_t n_eos_ids;
    char torch_dtype[16];  /* informational: "bfloat16", "float32", ... */
} lethe_model_config;

void lethe_model_config_init(lethe_model_config *c); /* zero + sane defaults (-1 ids) */

/* the KV of a slot is one K row (latent attention), no V buffer */
static inline bool lethe_kv_k_only(const lethe_model_config *c) { return c->kv_lora_rank > 0; }

/* true when layer l is a linear-attention (DeltaNet) layer: state, no KV */
static inline bool lethe_layer_is_linear(const lethe_model_config *c, int32_t l) {
    return c->n_linear_layers > 0 && c->layer_linear[l];
}
/* channels of a DeltaNet layer's causal conv: q, k and v projections */
static inline int32_t lethe_lin_conv_dim(const lethe_model_config *c) {
    return 2 * c->lin_k_heads * c->lin_k_dim + c->lin_v_heads * c->lin_v_dim;
}
/* bytes of one request's state in one DeltaNet layer (recurrent + conv, f32) */
static inline size_t lethe_lin_state_bytes(const lethe_model_config *c) {
    return 4u * ((size_t)c->lin_v_heads * c->lin_k_dim * c->lin_v_dim +
                 (size_t)(c->lin_conv - 1) * lethe_lin_conv_dim(c));
}

/* true when layer l has routed experts (see the MoE fields) */
bool lethe_layer_is_moe(const lethe_model_config *c, int32_t l);

/* Matmul weight elements one token multiplies with (attention and FFN
 * projections of every layer; a MoE layer counts its router, its k chosen
 * experts and the shared ones; no lm_head): FLOPs per token = 2 x this. */
double lethe_model_params_per_token(const lethe_model_config *c);
/* Weight elements a forward step of n_tokens reads (once each): attention and
 * dense weights, the lm_head, and per MoE layer the experts the n tokens
 * choose, counted as the expected number of distinct experts under uniform
 * routing, E (1 - (1 - k / E)^n) (k at n = 1: decode at batch 1 reads only
 * the active experts). */
double lethe_model_params_read(const lethe_model_config *c, double n_tokens);

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

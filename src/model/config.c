/* config.c - defaults and validation of lethe_model_config.
 *
 * Both loaders (GGUF metadata, HF config.json) fill the same struct; this file
 * holds the one set of rules every forward relies on: positive sizes, query
 * heads a multiple of KV heads, an even head_dim (RoPE rotates pairs),
 * consistent RoPE scaling parameters, MoE counts that make sense, and token
 * ids inside the vocabulary. Sizes are also bounded so that products such as
 * n_vocab * dim cannot overflow while allocating. Errors name the source file
 * and the field. */
#include <math.h>
#include <string.h>

#include "model/config.h"

void lethe_model_config_init(lethe_model_config *c) {
    memset(c, 0, sizeof(*c));
    c->rms_eps = 1e-5f;
    c->rope.theta = 10000.0f;
    c->rope.scaling = LETHE_ROPE_SCALING_NONE;
    c->rope.factor = 1.0f;
    c->bos_id = -1;
    c->moe_step = 1;
    c->moe_scale = 1.0f;
    c->moe_n_group = c->moe_topk_group = 1;
    for (int i = 0; i < LETHE_MAX_EOS_IDS; i++) c->eos_ids[i] = -1;
}

bool lethe_layer_is_moe(const lethe_model_config *c, int32_t l) {
    if (c->n_experts <= 0 || l < c->moe_first_layer) return false;
    for (int32_t i = 0; i < c->n_mlp_only; i++)
        if (c->mlp_only[i] == l) return false;
    return (l + 1) % c->moe_step == 0;
}

/* attention projections of layer l (MLA: the low-rank factors; a DeltaNet
 * layer: its q/k/v, z, a, b and output projections; a gated attention layer:
 * q_proj is twice as wide) */
static double attn_params(const lethe_model_config *c, int32_t l) {
    const double dim = c->dim, H = c->n_heads;
    if (lethe_layer_is_linear(c, l)) {
        const double vd = (double)c->lin_v_heads * c->lin_v_dim;
        return dim * (lethe_lin_conv_dim(c) + vd + 2.0 * c->lin_v_heads) + vd * dim;
    }
    if (c->kv_lora_rank > 0) {
        const double qk = c->qk_nope_dim + c->qk_rope_dim;
        const double q = c->q_lora_rank > 0 ? dim * c->q_lora_rank + c->q_lora_rank * H * qk
                                            : dim * H * qk;
        return q + dim * (c->kv_lora_rank + c->qk_rope_dim) +
               c->kv_lora_rank * H * (c->qk_nope_dim + c->v_head_dim) + H * c->v_head_dim * dim;
    }
    const double qd = H * c->head_dim, kvd = (double)c->n_kv_heads * c->head_dim;
    return dim * qd * (c->attn_out_gate ? 2 : 1) + 2 * dim * kvd + qd * dim;
}

/* FFN of layer l: fixed part (dense MLP, or router + shared experts) and one expert */
static void ffn_params(const lethe_model_config *c, int32_t l, double *fixed, double *expert) {
    if (!lethe_layer_is_moe(c, l)) {
        *fixed = 3.0 * c->dim * c->ffn_dim, *expert = 0;
        return;
    }
    *expert = 3.0 * c->dim * c->moe_ffn_dim;
    *fixed = (double)c->dim * c->n_experts + c->n_shared_experts * *expert;
}

double lethe_model_params_per_token(const lethe_model_config *c) {
    double p = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        double fixed, expert;
        ffn_params(c, l, &fixed, &expert);
        p += attn_params(c, l) + fixed + c->n_experts_used * expert;
    }
    return p;
}

double lethe_model_params_read(const lethe_model_config *c, double n_tokens) {
    double p = (double)c->n_vocab * c->dim;
    for (int32_t l = 0; l < c->n_layers; l++) {
        double fixed, expert;
        ffn_params(c, l, &fixed, &expert);
        double used = 0;
        if (expert > 0) {
            const double E = c->n_experts, k = c->n_experts_used;
            used = n_tokens <= 1 ? k : E * (1.0 - pow(1.0 - k / E, n_tokens));
        }
        p += attn_params(c, l) + fixed + used * expert;
    }
    return p;
}

#define SIZE_LIMIT (1 << 24) /* any single dimension: 16M */

static lethe_status bad(const char *source, const char *field, long long v, const char *why) {
    return lethe_errorf(LETHE_ERR_FORMAT, "%s: %s = %lld: %s", source, field, v, why);
}

lethe_status lethe_model_config_validate(const lethe_model_config *c, const char *source) {
    if (!source) source = "model config";
    if (!c->arch[0]) return lethe_errorf(LETHE_ERR_FORMAT, "%s: architecture name is missing", source);
    struct { const char *name; int32_t v; } req[] = {
        {"n_vocab (vocab_size)", c->n_vocab},
        {"dim (hidden_size)", c->dim},
        {"n_layers (num_hidden_layers)", c->n_layers},
        {"n_heads (num_attention_heads)", c->n_heads},
        {"n_kv_heads (num_key_value_heads)", c->n_kv_heads},
        {"head_dim", c->head_dim},
        {"max_pos (max_position_embeddings)", c->max_pos},
    };
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++)
        if (req[i].v <= 0 || req[i].v > SIZE_LIMIT)
            return bad(source, req[i].name, req[i].v, "must be in 1..16777216");
    if (c->n_heads % c->n_kv_heads != 0)
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: n_heads (%d) is not a multiple of n_kv_heads (%d)", source,
                            c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 != 0) return bad(source, "head_dim", c->head_dim, "must be even (RoPE)");
    if ((long long)c->n_heads * c->head_dim > SIZE_LIMIT)
        return bad(source, "n_heads * head_dim", (long long)c->n_heads * c->head_dim, "too large");
    if (c->n_experts < 0 || c->n_experts > 65536)
        return bad(source, "n_experts", c->n_experts, "must be in 0..65536");
    if (c->n_experts > 0) {
        if (c->n_experts_used <= 0 || c->n_experts_used > c->n_experts)
            return bad(source, "n_experts_used (num_experts_per_tok)", c->n_experts_used,
                       "must be in 1..n_experts");
        if (c->moe_ffn_dim <= 0 || c->moe_ffn_dim > SIZE_LIMIT)
            return bad(source, "moe_ffn_dim (moe_intermediate_size)", c->moe_ffn_dim,
                       "must be in 1..16777216");
        if (c->ffn_dim < 0 || c->ffn_dim > SIZE_LIMIT)
            return bad(source, "ffn_dim (intermediate_size)", c->ffn_dim, "out of range");
        if (c->moe_step < 1 || c->moe_step > c->n_layers)
            return bad(source, "decoder_sparse_step", c->moe_step, "must be in 1..n_layers");
        if (c->moe_first_layer < 0 || c->moe_first_layer > c->n_layers)
            return bad(source, "first_k_dense_replace", c->moe_first_layer,
                       "must be in 0..n_layers");
        if (c->n_shared_experts < 0 || c->n_shared_experts > 64)
            return bad(source, "n_shared_experts", c->n_shared_experts, "must be in 0..64");
        if (c->moe_scoring != LETHE_MOE_SOFTMAX && c->moe_scoring != LETHE_MOE_SIGMOID)
            return bad(source, "moe scoring function", c->moe_scoring, "unknown");
        if (!(c->moe_scale > 0.0f && c->moe_scale < 1e4f))
            return lethe_errorf(LETHE_ERR_FORMAT,
                                "%s: routed_scaling_factor = %g: must be in "
                                "(0, 1e4)",
                                source, (double)c->moe_scale);
        if (c->moe_n_group < 1 || c->n_experts % c->moe_n_group || c->moe_topk_group < 1 ||
            c->moe_topk_group > c->moe_n_group)
            return lethe_errorf(LETHE_ERR_FORMAT,
                                "%s: n_group %d / topk_group %d: n_group must "
                                "divide n_experts %d and 1 <= topk_group <= n_group",
                                source, c->moe_n_group, c->moe_topk_group, c->n_experts);
        if (c->n_experts_used > c->n_experts / c->moe_n_group * c->moe_topk_group)
            return bad(source, "n_experts_used", c->n_experts_used,
                       "more than the experts of topk_group groups");
        for (int32_t i = 0; i < c->n_mlp_only; i++)
            if (c->mlp_only[i] < 0 || c->mlp_only[i] >= c->n_layers)
                return bad(source, "mlp_only_layers", c->mlp_only[i], "not a layer index");
        bool any_dense = c->moe_first_layer > 0 || c->n_mlp_only > 0 || c->moe_step > 1;
        if (any_dense && c->ffn_dim <= 0)
            return bad(source, "ffn_dim (intermediate_size)", c->ffn_dim,
                       "must be positive: some layers are dense");
    } else if (c->ffn_dim <= 0 || c->ffn_dim > SIZE_LIMIT) {
        return bad(source, "ffn_dim (intermediate_size)", c->ffn_dim, "must be in 1..16777216");
    }
    if (!(c->rms_eps > 0.0f && c->rms_eps < 1.0f))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: rms_eps = %g: must be in (0, 1)", source,
                            (double)c->rms_eps);
    if (!(c->rope.theta > 0.0f))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: rope theta = %g: must be positive", source,
                            (double)c->rope.theta);
    if (c->rope.scaling != LETHE_ROPE_SCALING_NONE && !(c->rope.factor > 0.0f))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: rope scaling factor = %g: must be positive",
                            source, (double)c->rope.factor);
    if (c->rope.scaling == LETHE_ROPE_SCALING_LLAMA3) {
        if (c->rope.original_max_pos <= 0)
            return bad(source, "rope original_max_position_embeddings", c->rope.original_max_pos,
                       "must be positive for llama3 scaling");
        if (!(c->rope.low_freq_factor > 0.0f && c->rope.high_freq_factor > c->rope.low_freq_factor))
            return lethe_errorf(LETHE_ERR_FORMAT,
                                "%s: llama3 rope scaling needs 0 < low_freq_factor (%g) < "
                                "high_freq_factor (%g)", source,
                                (double)c->rope.low_freq_factor, (double)c->rope.high_freq_factor);
    }
    if (c->rope.rot_dim < 0 || c->rope.rot_dim > c->head_dim || c->rope.rot_dim % 2)
        return bad(source, "rotary dim (head_dim * partial_rotary_factor)", c->rope.rot_dim,
                   "must be even and at most head_dim");
    if (c->n_linear_layers < 0 || c->n_linear_layers > c->n_layers ||
        (c->n_linear_layers > 0 && c->n_layers > LETHE_MAX_LAYERS))
        return bad(source, "linear-attention layers", c->n_linear_layers, "out of range");
    if (c->n_linear_layers > 0) {
        struct { const char *name; int32_t v; } lin[] = {
            {"linear_num_key_heads", c->lin_k_heads}, {"linear_num_value_heads", c->lin_v_heads},
            {"linear_key_head_dim", c->lin_k_dim},    {"linear_value_head_dim", c->lin_v_dim},
        };
        for (size_t i = 0; i < sizeof(lin) / sizeof(lin[0]); i++)
            if (lin[i].v <= 0 || lin[i].v > 4096) return bad(source, lin[i].name, lin[i].v, "must be in 1..4096");
        if (c->lin_v_heads % c->lin_k_heads)
            return bad(source, "linear_num_value_heads", c->lin_v_heads,
                       "must be a multiple of linear_num_key_heads");
        if (c->lin_conv < 2 || c->lin_conv > 16)
            return bad(source, "linear_conv_kernel_dim", c->lin_conv, "must be in 2..16");
    }
    if (c->bos_id < -1 || c->bos_id >= c->n_vocab)
        return bad(source, "bos_token_id", c->bos_id, "outside the vocabulary");
    if (c->n_eos_ids < 0 || c->n_eos_ids > LETHE_MAX_EOS_IDS)
        return bad(source, "n_eos_ids", c->n_eos_ids, "out of range");
    for (int i = 0; i < c->n_eos_ids; i++)
        if (c->eos_ids[i] < 0 || c->eos_ids[i] >= c->n_vocab)
            return bad(source, "eos_token_id", c->eos_ids[i], "outside the vocabulary");
    return LETHE_OK;
}

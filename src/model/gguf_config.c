/* gguf_config.c - lethe_model_config from GGUF metadata.
 *
 * Keys are prefixed by general.architecture ("llama.block_count", ...). What
 * the metadata does not say is read off the tensors: no output.weight means
 * tied embeddings, blk.0.attn_q.bias means qkv bias, blk.0.attn_q_norm.weight
 * means per-head q/k RMSNorm. The vocabulary size comes from {arch}.vocab_size,
 * else the tokenizer.ggml.tokens length, else token_embd.weight's ne[1].
 *
 * Llama-3.1 RoPE scaling: llama.cpp's converter writes no scaling keys but a
 * rope_freqs.weight tensor [head_dim/2] of per-frequency divisors
 *   r_i = 1 / ((1 - s_i) / factor + s_i),  s_i = (orig / wavelen_i - low) / (high - low)
 * for the "medium" frequencies (1 above, factor below). The rope config
 * wants (factor, low, high, orig); s_i is linear in 1/wavelen_i, so a least
 * squares line through the medium points recovers a = orig / (high - low) and
 * b = low / (high - low), which fix the HF formula completely; orig is taken
 * from {arch}.rope.scaling.original_context_length (8192 if absent) and
 * low/high follow. The fit is checked against every entry. */
#include <math.h>
#include <string.h>

#include "model/config.h"
#include "core/util.h"
#include "model/gguf.h"

/* optional integer key -> *out (left unchanged if absent); error if present with a bad type */
static lethe_status opt_int(const lethe_gguf *g, const char *key, int32_t *out) {
    int64_t v;
    lethe_status s = lethe_gguf_get_int(g, key, &v);
    if (s == LETHE_ERR_NOT_FOUND) return LETHE_OK;
    if (s) return s;
    if (v < INT32_MIN || v > INT32_MAX)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' = %lld is out of range", g->path, key,
                            (long long)v);
    *out = (int32_t)v;
    return LETHE_OK;
}

static lethe_status req_int(const lethe_gguf *g, const char *key, int32_t *out) {
    if (!lethe_gguf_find(g, key))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing required metadata key '%s'", g->path,
                            key);
    return opt_int(g, key, out);
}

static lethe_status opt_float(const lethe_gguf *g, const char *key, float *out) {
    double v;
    lethe_status s = lethe_gguf_get_float(g, key, &v);
    if (s == LETHE_ERR_NOT_FOUND) return LETHE_OK;
    if (s) return s;
    *out = (float)v;
    return LETHE_OK;
}

/* optional bool key (a BOOL, or an integer 0 / 1) -> *out */
static lethe_status opt_bool(const lethe_gguf *g, const char *key, bool *out) {
    const lethe_gguf_kv *kv = lethe_gguf_find(g, key);
    if (!kv) return LETHE_OK;
    if (kv->type == LETHE_GGUF_BOOL) {
        *out = kv->v.u64 != 0;
        return LETHE_OK;
    }
    int32_t v = 0;
    lethe_status s = opt_int(g, key, &v);
    if (s) return s;
    *out = v != 0;
    return LETHE_OK;
}

/* llama.cpp's MoE and MLA keys (qwen3moe, deepseek2 which also carries GLM-4.7-Flash) */
static lethe_status read_moe_keys(const lethe_gguf *g, lethe_model_config *c) {
    char key[LETHE_ARCH_NAME_MAX + 64];
#define K(suffix) (snprintf(key, sizeof(key), "%s." suffix, c->arch), key)
    lethe_status s;
    /* llama.cpp normalizes qwen3moe's top-k weights unconditionally */
    c->moe_norm_topk = !strcmp(c->arch, "qwen3moe");
    if ((s = opt_bool(g, K("expert_weights_norm"), &c->moe_norm_topk))) return s;
    if ((s = opt_float(g, K("expert_weights_scale"), &c->moe_scale))) return s;
    if (c->moe_scale == 0.0f) c->moe_scale = 1.0f; /* written as 0 when unused */
    if ((s = opt_int(g, K("expert_shared_count"), &c->n_shared_experts))) return s;
    if ((s = opt_int(g, K("leading_dense_block_count"), &c->moe_first_layer))) return s;
    if ((s = opt_int(g, K("expert_group_count"), &c->moe_n_group))) return s;
    if ((s = opt_int(g, K("expert_group_used_count"), &c->moe_topk_group))) return s;
    if (c->moe_n_group <= 0) c->moe_n_group = c->moe_topk_group = 1;
    int32_t gating = 0; /* llama.cpp: 1 softmax, 2 sigmoid */
    if ((s = opt_int(g, K("expert_gating_func"), &gating))) return s;
    if (gating == 2) c->moe_scoring = LETHE_MOE_SIGMOID;
    else if (gating > 2)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: %s = %d is not supported (1 softmax, "
                            "2 sigmoid)",
                            g->path, key, gating);
    if ((s = opt_int(g, K("attention.q_lora_rank"), &c->q_lora_rank))) return s;
    if ((s = opt_int(g, K("attention.kv_lora_rank"), &c->kv_lora_rank))) return s;
    if (c->kv_lora_rank > 0) {
        /* key_length = nope + rope, value_length = v head, rope.dimension_count = rope
         * (the *_mla variants when the file splits kv_b into k_b / v_b) */
        int32_t kl = 0, vl = 0, rd = 0;
        if ((s = opt_int(g, K("attention.key_length"), &kl))) return s;
        if ((s = opt_int(g, K("attention.key_length_mla"), &kl))) return s;
        if ((s = opt_int(g, K("attention.value_length"), &vl))) return s;
        if ((s = opt_int(g, K("attention.value_length_mla"), &vl))) return s;
        if ((s = opt_int(g, K("rope.dimension_count"), &rd))) return s;
        c->qk_rope_dim = rd;
        c->qk_nope_dim = kl - rd;
        c->v_head_dim = vl;
        c->n_kv_heads = 1; /* latent KV: one slot row of latent + RoPE key */
        c->head_dim = c->kv_lora_rank + rd;
        c->rope_interleave = true; /* llama.cpp keeps the checkpoint's interleaved pairs */
        if ((s = opt_int(g, K("nextn_predict_layers"), &c->n_nextn_layers))) return s;
    }
#undef K
    return LETHE_OK;
}

static void push_eos(lethe_model_config *c, int32_t id) {
    if (id < 0) return;
    for (int i = 0; i < c->n_eos_ids; i++)
        if (c->eos_ids[i] == id) return;
    if (c->n_eos_ids < LETHE_MAX_EOS_IDS) c->eos_ids[c->n_eos_ids++] = id;
}

/* llama3 factor for inverse frequency inv (HF formula), as a divisor of inv */
static double llama3_divisor(double inv, const lethe_rope_config *r) {
    double wavelen = 2.0 * M_PI / inv;
    double low_wl = r->original_max_pos / r->low_freq_factor;
    double high_wl = r->original_max_pos / r->high_freq_factor;
    if (wavelen < high_wl) return 1.0;
    if (wavelen > low_wl) return r->factor;
    double s = (r->original_max_pos / wavelen - r->low_freq_factor) /
               (r->high_freq_factor - r->low_freq_factor);
    return 1.0 / ((1.0 - s) / r->factor + s);
}

static lethe_status rope_from_freqs(const lethe_gguf *g, const lethe_gguf_tensor *t,
                                    lethe_model_config *c) {
    int32_t half = c->head_dim / 2;
    if (t->type != LETHE_GGML_F32 || t->n_dims != 1 || t->ne[0] != (uint64_t)half)
        return lethe_errorf(LETHE_ERR_FORMAT,
                            "%s: tensor 'rope_freqs.weight': expected f32 [%d], found %s [%llu]",
                            g->path, half, lethe_ggml_type_name(t->type),
                            (unsigned long long)t->ne[0]);
    const float *r = t->data;
    double f = 1.0;
    for (int i = 0; i < half; i++) {
        if (!(r[i] >= 1.0f) || !isfinite(r[i]))
            return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                "%s: rope_freqs.weight[%d] = %g is not a llama3 scaling factor",
                                g->path, i, (double)r[i]);
        if (r[i] > f) f = r[i];
    }
    if (f == 1.0) return LETHE_OK; /* all ones: no scaling */
    /* regression s = a * x - b over the medium frequencies, x = 1 / wavelen */
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    int n = 0;
    for (int i = 0; i < half; i++) {
        if (r[i] <= 1.0f + 1e-6f || r[i] >= (float)f * (1.0f - 1e-6f)) continue;
        double x = pow(c->rope.theta, -2.0 * i / c->head_dim) / (2.0 * M_PI);
        double s = (1.0 / r[i] - 1.0 / f) / (1.0 - 1.0 / f);
        sx += x, sy += s, sxx += x * x, sxy += x * s;
        n++;
    }
    double den = n * sxx - sx * sx;
    if (n < 2 || !(fabs(den) > 0))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: rope_freqs.weight has %d intermediate frequencies; cannot recover "
                            "the llama3 scaling parameters", g->path, n);
    double a = (n * sxy - sx * sy) / den;
    double b = -(sy - a * sx) / n;
    lethe_rope_config rc = c->rope;
    rc.scaling = LETHE_ROPE_SCALING_LLAMA3;
    rc.factor = (float)f;
    if (rc.original_max_pos <= 0) rc.original_max_pos = 8192;
    double k = rc.original_max_pos / a;
    rc.low_freq_factor = (float)(b * k);
    rc.high_freq_factor = (float)(b * k + k);
    for (int i = 0; i < half; i++) {
        double inv = pow(c->rope.theta, -2.0 * i / c->head_dim);
        double want = llama3_divisor(inv, &rc);
        if (fabs(want - r[i]) > 1e-3 * r[i])
            return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                "%s: rope_freqs.weight[%d] = %g does not follow llama3 scaling "
                                "(fit gives %g)", g->path, i, (double)r[i], want);
    }
    c->rope = rc;
    return LETHE_OK;
}

lethe_status lethe_gguf_config_load(const lethe_gguf *g, lethe_model_config *c) {
    lethe_model_config_init(c);
    lethe_gguf_str arch;
    lethe_status s = lethe_gguf_get_str(g, "general.architecture", &arch);
    if (s == LETHE_ERR_NOT_FOUND)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing required metadata key "
                            "'general.architecture'", g->path);
    if (s) return s;
    if (arch.len == 0 || arch.len >= LETHE_ARCH_NAME_MAX || memchr(arch.data, '\0', arch.len))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: general.architecture is not a valid name",
                            g->path);
    memcpy(c->arch, arch.data, arch.len);
    c->arch[arch.len] = '\0';

    char key[LETHE_ARCH_NAME_MAX + 64];
#define K(suffix) (snprintf(key, sizeof(key), "%s." suffix, c->arch), key)
    if ((s = req_int(g, K("embedding_length"), &c->dim))) return s;
    if ((s = req_int(g, K("block_count"), &c->n_layers))) return s;
    if ((s = req_int(g, K("attention.head_count"), &c->n_heads))) return s;
    if ((s = req_int(g, K("context_length"), &c->max_pos))) return s;
    c->n_kv_heads = c->n_heads;
    if ((s = opt_int(g, K("attention.head_count_kv"), &c->n_kv_heads))) return s;
    if ((s = opt_int(g, K("expert_count"), &c->n_experts))) return s;
    if ((s = opt_int(g, K("expert_used_count"), &c->n_experts_used))) return s;
    if ((s = opt_int(g, K("expert_feed_forward_length"), &c->moe_ffn_dim))) return s;
    if (c->n_experts > 0) {
        if ((s = opt_int(g, K("feed_forward_length"), &c->ffn_dim))) return s;
    } else if ((s = req_int(g, K("feed_forward_length"), &c->ffn_dim))) {
        return s;
    }
    if (c->n_heads > 0 && c->dim % c->n_heads == 0) c->head_dim = c->dim / c->n_heads;
    if ((s = opt_int(g, K("attention.key_length"), &c->head_dim))) return s;
    if ((s = read_moe_keys(g, c))) return s;
    if (c->head_dim <= 0)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: embedding_length %d is not a multiple of "
                            "head_count %d and %s is absent", g->path, c->dim, c->n_heads,
                            K("attention.key_length"));
    if (!lethe_gguf_find(g, K("attention.layer_norm_rms_epsilon")))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing required metadata key '%s'", g->path,
                            key);
    if ((s = opt_float(g, key, &c->rms_eps))) return s;
    if ((s = opt_float(g, K("rope.freq_base"), &c->rope.theta))) return s;

    /* RoPE scaling */
    if ((s = opt_int(g, K("rope.scaling.original_context_length"), &c->rope.original_max_pos)))
        return s;
    lethe_gguf_str st = {0};
    s = lethe_gguf_get_str(g, K("rope.scaling.type"), &st);
    if (s && s != LETHE_ERR_NOT_FOUND) return s;
    if (st.len) {
        float factor = 0.0f;
        if ((s = opt_float(g, K("rope.scaling.factor"), &factor))) return s;
        if (st.len == 4 && !memcmp(st.data, "none", 4)) {
        } else if (st.len == 6 && !memcmp(st.data, "linear", 6)) {
            c->rope.scaling = LETHE_ROPE_SCALING_LINEAR;
            c->rope.factor = factor;
        } else if (st.len == 6 && !memcmp(st.data, "llama3", 6)) {
            c->rope.scaling = LETHE_ROPE_SCALING_LLAMA3;
            c->rope.factor = factor;
            if ((s = opt_float(g, K("rope.scaling.low_freq_factor"), &c->rope.low_freq_factor)))
                return s;
            if ((s = opt_float(g, K("rope.scaling.high_freq_factor"), &c->rope.high_freq_factor)))
                return s;
        } else {
            return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                "%s: rope scaling type '%.*s' is not supported (supported: none, "
                                "linear, llama3)", g->path, (int)LETHE_MIN(st.len, 32), st.data);
        }
    } else {
        float lin = 0.0f; /* older files: {arch}.rope.scale_linear */
        if ((s = opt_float(g, K("rope.scale_linear"), &lin))) return s;
        if (lin > 0.0f && lin != 1.0f) {
            c->rope.scaling = LETHE_ROPE_SCALING_LINEAR;
            c->rope.factor = lin;
        }
    }
    const lethe_gguf_tensor *rf = lethe_gguf_find_tensor(g, "rope_freqs.weight");
    if (rf && c->rope.scaling == LETHE_ROPE_SCALING_NONE) {
        if ((s = rope_from_freqs(g, rf, c))) return s;
    }

    /* vocabulary */
    if ((s = opt_int(g, K("vocab_size"), &c->n_vocab))) return s;
#undef K
    if (c->n_vocab <= 0) {
        const lethe_gguf_kv *tok = lethe_gguf_find(g, "tokenizer.ggml.tokens");
        const lethe_gguf_tensor *emb = lethe_gguf_find_tensor(g, "token_embd.weight");
        if (tok && tok->type == LETHE_GGUF_ARRAY && tok->arr_n <= INT32_MAX)
            c->n_vocab = (int32_t)tok->arr_n;
        else if (emb && emb->n_dims == 2 && emb->ne[1] <= INT32_MAX)
            c->n_vocab = (int32_t)emb->ne[1];
    }

    /* a MoE file's layer without a router but with a dense FFN is dense (HF
     * mlp_only_layers; llama.cpp's own files route every layer after the
     * leading dense blocks) */
    for (int32_t l = c->moe_first_layer; c->n_experts > 0 && l < c->n_layers; l++) {
        char r[64], d[64];
        snprintf(r, sizeof(r), "blk.%d.ffn_gate_inp.weight", l);
        snprintf(d, sizeof(d), "blk.%d.ffn_gate.weight", l);
        if (!lethe_gguf_find_tensor(g, r) && lethe_gguf_find_tensor(g, d)) {
            if (c->n_mlp_only == LETHE_MAX_MLP_ONLY)
                return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                    "%s: more than %d dense layers among "
                                    "the MoE layers",
                                    g->path, LETHE_MAX_MLP_ONLY);
            c->mlp_only[c->n_mlp_only++] = l;
        }
    }
    c->tie_embeddings = lethe_gguf_find_tensor(g, "output.weight") == NULL;
    c->qkv_bias = lethe_gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    c->qk_norm = lethe_gguf_find_tensor(g, "blk.0.attn_q_norm.weight") != NULL;

    int32_t id = -1;
    if ((s = opt_int(g, "tokenizer.ggml.bos_token_id", &c->bos_id))) return s;
    static const char *eos_keys[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id"};
    for (size_t i = 0; i < sizeof(eos_keys) / sizeof(eos_keys[0]); i++) {
        id = -1;
        if ((s = opt_int(g, eos_keys[i], &id))) return s;
        push_eos(c, id);
    }
    snprintf(c->torch_dtype, sizeof(c->torch_dtype), "gguf");
    return lethe_model_config_validate(c, g->path);
}

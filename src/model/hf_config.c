/* hf_config.c - lethe_model_config from a Hugging Face config.json.
 *
 * Reads the transformers field names (hidden_size, num_hidden_layers, ...),
 * RoPE scaling from `rope_scaling` or transformers v5's `rope_parameters`
 * (rope_type|type: default, linear, llama3), MoE counts, and special token ids
 * from config.json, overridden by generation_config.json beside it when that
 * file exists (it is what generation uses: Llama-3.1 lists three EOS ids).
 * Multimodal wrappers that keep the language model under "text_config" are
 * read from there. Family defaults that the file leaves implicit: qwen2 has
 * q/k/v biases, qwen3 has per-head q/k RMSNorm.
 * Errors name the file and key: "<path>: missing key 'hidden_size'". */
#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

#include "core/util.h"
#include "model/config.h"

static const char *json_type_name(const cJSON *j) {
    if (cJSON_IsNumber(j)) return "number";
    if (cJSON_IsString(j)) return "string";
    if (cJSON_IsBool(j)) return "bool";
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsArray(j)) return "array";
    if (cJSON_IsObject(j)) return "object";
    return "invalid";
}

static const cJSON *get(const cJSON *o, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(o, key);
}

/* Integer field; absent or null leaves *out unchanged unless required. */
static lethe_status jint(const cJSON *o, const char *key, bool required, const char *path,
                         int32_t *out) {
    const cJSON *j = get(o, key);
    if (!j || cJSON_IsNull(j)) {
        if (required) return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing key '%s'", path, key);
        return LETHE_OK;
    }
    double v = j->valuedouble;
    if (!cJSON_IsNumber(j) || v != floor(v) || v < INT32_MIN || v > INT32_MAX)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' must be an integer (got %s)", path,
                            key, json_type_name(j));
    *out = (int32_t)v;
    return LETHE_OK;
}

static lethe_status jfloat(const cJSON *o, const char *key, bool required, const char *path,
                           float *out) {
    const cJSON *j = get(o, key);
    if (!j || cJSON_IsNull(j)) {
        if (required) return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing key '%s'", path, key);
        return LETHE_OK;
    }
    if (!cJSON_IsNumber(j))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' must be a number (got %s)", path, key,
                            json_type_name(j));
    *out = (float)j->valuedouble;
    return LETHE_OK;
}

static lethe_status jbool(const cJSON *o, const char *key, const char *path, bool *out) {
    const cJSON *j = get(o, key);
    if (!j || cJSON_IsNull(j)) return LETHE_OK;
    if (!cJSON_IsBool(j))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' must be true or false (got %s)", path,
                            key, json_type_name(j));
    *out = cJSON_IsTrue(j);
    return LETHE_OK;
}

static lethe_status parse_json_file(const char *path, cJSON **out) {
    char *text;
    size_t len;
    lethe_status s = lethe_read_file(path, &text, &len);
    if (s) return s;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, false);
    if (!root) {
        size_t off = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        int line = 1, col = 1;
        for (size_t i = 0; i < off; i++, col++)
            if (text[i] == '\n') line++, col = 0;
        free(text);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: invalid JSON near line %d, column %d", path,
                            line, col);
    }
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: top level must be a JSON object", path);
    }
    *out = root;
    return LETHE_OK;
}

/* bos_token_id (int) and eos_token_id (int or list) from o; absent keys keep c's values. */
static lethe_status read_token_ids(const cJSON *o, const char *path, lethe_model_config *c) {
    lethe_status s = jint(o, "bos_token_id", false, path, &c->bos_id);
    if (s) return s;
    const cJSON *e = get(o, "eos_token_id");
    if (!e || cJSON_IsNull(e)) return LETHE_OK;
    const cJSON *items[LETHE_MAX_EOS_IDS];
    int n = 0;
    if (cJSON_IsArray(e)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, e) {
            if (n == LETHE_MAX_EOS_IDS)
                return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: more than %d eos_token_id values",
                                    path, LETHE_MAX_EOS_IDS);
            items[n++] = it;
        }
    } else {
        items[n++] = e;
    }
    for (int i = 0; i < n; i++) {
        double v = items[i]->valuedouble;
        if (!cJSON_IsNumber(items[i]) || v != floor(v) || v < 0 || v > INT32_MAX)
            return lethe_errorf(LETHE_ERR_FORMAT,
                                "%s: key 'eos_token_id' must be an integer or a list of integers",
                                path);
        c->eos_ids[i] = (int32_t)v;
    }
    for (int i = n; i < LETHE_MAX_EOS_IDS; i++) c->eos_ids[i] = -1;
    c->n_eos_ids = n;
    return LETHE_OK;
}

static lethe_status read_rope(const cJSON *o, const char *path, lethe_model_config *c) {
    lethe_status s = jfloat(o, "rope_theta", false, path, &c->rope.theta);
    if (s) return s;
    const char *rs_key = "rope_scaling";
    const cJSON *rs = get(o, rs_key);
    const cJSON *rp = get(o, "rope_parameters"); /* transformers v5 */
    if ((!rs || cJSON_IsNull(rs)) && rp && !cJSON_IsNull(rp)) rs = rp, rs_key = "rope_parameters";
    if (!rs || cJSON_IsNull(rs)) return LETHE_OK;
    if (!cJSON_IsObject(rs))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key '%s' must be an object (got %s)", path,
                            rs_key, json_type_name(rs));
    if ((s = jfloat(rs, "rope_theta", false, path, &c->rope.theta))) return s;
    const cJSON *t = get(rs, "rope_type");
    if (!t) t = get(rs, "type");
    if (!t || cJSON_IsNull(t)) return LETHE_OK;
    if (!cJSON_IsString(t))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: %s.rope_type must be a string (got %s)", path,
                            rs_key, json_type_name(t));
    const char *type = t->valuestring;
    if (!strcmp(type, "default")) return LETHE_OK;
    if (!strcmp(type, "linear")) {
        c->rope.scaling = LETHE_ROPE_SCALING_LINEAR;
        return jfloat(rs, "factor", true, path, &c->rope.factor);
    }
    if (!strcmp(type, "llama3")) {
        c->rope.scaling = LETHE_ROPE_SCALING_LLAMA3;
        if ((s = jfloat(rs, "factor", true, path, &c->rope.factor))) return s;
        if ((s = jfloat(rs, "low_freq_factor", true, path, &c->rope.low_freq_factor))) return s;
        if ((s = jfloat(rs, "high_freq_factor", true, path, &c->rope.high_freq_factor))) return s;
        return jint(rs, "original_max_position_embeddings", true, path,
                    &c->rope.original_max_pos);
    }
    return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                        "%s: %s type '%s' is not supported (supported: default, linear, llama3)",
                        path, rs_key, type);
}

/* routing details and the layers that stay dense (qwen3_moe, glm4_moe_lite),
 * and the MLA dimensions (glm4_moe_lite) */
static lethe_status read_moe(const cJSON *o, const char *path, lethe_model_config *c) {
    lethe_status s;
    if ((s = jint(o, "decoder_sparse_step", false, path, &c->moe_step))) return s;
    if ((s = jint(o, "first_k_dense_replace", false, path, &c->moe_first_layer))) return s;
    if ((s = jint(o, "n_shared_experts", false, path, &c->n_shared_experts))) return s;
    if ((s = jbool(o, "norm_topk_prob", path, &c->moe_norm_topk))) return s;
    if ((s = jfloat(o, "routed_scaling_factor", false, path, &c->moe_scale))) return s;
    if ((s = jint(o, "n_group", false, path, &c->moe_n_group))) return s;
    if ((s = jint(o, "topk_group", false, path, &c->moe_topk_group))) return s;
    const cJSON *ml = get(o, "mlp_only_layers");
    if (ml && !cJSON_IsNull(ml)) {
        if (!cJSON_IsArray(ml))
            return lethe_errorf(LETHE_ERR_FORMAT,
                                "%s: key 'mlp_only_layers' must be a list of "
                                "layer indices (got %s)",
                                path, json_type_name(ml));
        const cJSON *it;
        cJSON_ArrayForEach(it, ml) {
            if (c->n_mlp_only == LETHE_MAX_MLP_ONLY)
                return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: more than %d mlp_only_layers", path,
                                    LETHE_MAX_MLP_ONLY);
            if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble))
                return lethe_errorf(LETHE_ERR_FORMAT,
                                    "%s: key 'mlp_only_layers' must be a list "
                                    "of integers",
                                    path);
            c->mlp_only[c->n_mlp_only++] = (int32_t)it->valuedouble;
        }
    }
    const cJSON *sf = get(o, "scoring_func");
    if (cJSON_IsString(sf)) {
        if (!strcmp(sf->valuestring, "sigmoid")) c->moe_scoring = LETHE_MOE_SIGMOID;
        else if (!strcmp(sf->valuestring, "softmax")) c->moe_scoring = LETHE_MOE_SOFTMAX;
        else
            return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                "%s: scoring_func '%s' is not supported "
                                "(supported: softmax, sigmoid)",
                                path, sf->valuestring);
    } else if (!strcmp(c->arch, "glm4_moe_lite") || !strcmp(c->arch, "glm4_moe") ||
               !strcmp(c->arch, "deepseek_v3")) {
        c->moe_scoring = LETHE_MOE_SIGMOID; /* the family's router, also without the key */
    }
    const cJSON *tm = get(o, "topk_method");
    if (cJSON_IsString(tm) && strcmp(tm->valuestring, "noaux_tc") &&
        strcmp(tm->valuestring, "greedy"))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "%s: topk_method '%s' is not supported "
                            "(supported: noaux_tc, greedy)",
                            path, tm->valuestring);
    if ((s = jint(o, "q_lora_rank", false, path, &c->q_lora_rank))) return s;
    if ((s = jint(o, "kv_lora_rank", false, path, &c->kv_lora_rank))) return s;
    if ((s = jint(o, "qk_nope_head_dim", false, path, &c->qk_nope_dim))) return s;
    if ((s = jint(o, "qk_rope_head_dim", false, path, &c->qk_rope_dim))) return s;
    if ((s = jint(o, "v_head_dim", false, path, &c->v_head_dim))) return s;
    if ((s = jint(o, "num_nextn_predict_layers", false, path, &c->n_nextn_layers))) return s;
    const bool glm = !strcmp(c->arch, "glm4_moe_lite");
    c->rope_interleave = glm; /* transformers' default for the family */
    if ((s = jbool(o, "rope_interleave", path, &c->rope_interleave))) return s;
    /* glm4_moe_lite: mlp_layer_types (transformers 5) lists dense / sparse per layer;
     * without it the first layer is dense (first_k_dense_replace of the published file) */
    const cJSON *lt = get(o, "mlp_layer_types");
    if (cJSON_IsArray(lt)) {
        int32_t l = 0;
        const cJSON *it;
        c->moe_first_layer = 0;
        cJSON_ArrayForEach(it, lt) {
            if (!cJSON_IsString(it) ||
                (strcmp(it->valuestring, "dense") && strcmp(it->valuestring, "sparse")))
                return lethe_errorf(LETHE_ERR_FORMAT,
                                    "%s: mlp_layer_types[%d] must be \"dense\" "
                                    "or \"sparse\"",
                                    path, l);
            if (!strcmp(it->valuestring, "dense")) {
                if (c->n_mlp_only == LETHE_MAX_MLP_ONLY)
                    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: more than %d dense layers",
                                        path, LETHE_MAX_MLP_ONLY);
                c->mlp_only[c->n_mlp_only++] = l;
            }
            l++;
        }
    } else if (glm && !get(o, "first_k_dense_replace")) {
        c->moe_first_layer = 1;
    }
    if (c->kv_lora_rank > 0) { /* latent KV: one slot row of latent + RoPE key */
        c->n_kv_heads = 1;
        c->head_dim = c->kv_lora_rank + c->qk_rope_dim;
    }
    return LETHE_OK;
}

/* Hybrid linear attention (qwen3_5): the layer types (layer_types, else every
 * full_attention_interval-th layer is full attention), the DeltaNet sizes,
 * the attention output gate, partial rotary and the zero-centred norms. */
static lethe_status read_hybrid(const cJSON *o, const char *path, lethe_model_config *c) {
    lethe_status s;
    const cJSON *lt = get(o, "layer_types");
    int32_t interval = 4;
    if ((s = jint(o, "full_attention_interval", false, path, &interval))) return s;
    if (c->n_layers > LETHE_MAX_LAYERS)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: %d layers > %d (hybrid layer table)", path,
                            c->n_layers, LETHE_MAX_LAYERS);
    if (cJSON_IsArray(lt)) {
        if (cJSON_GetArraySize(lt) != c->n_layers)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: 'layer_types' has %d entries for %d layers",
                                path, cJSON_GetArraySize(lt), c->n_layers);
        int32_t l = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, lt) {
            const bool lin = cJSON_IsString(it) && !strcmp(it->valuestring, "linear_attention");
            if (!lin && !(cJSON_IsString(it) && !strcmp(it->valuestring, "full_attention")))
                return lethe_errorf(LETHE_ERR_FORMAT,
                                    "%s: layer_types[%d] must be \"linear_attention\" or "
                                    "\"full_attention\"",
                                    path, l);
            c->layer_linear[l++] = lin;
        }
    } else {
        if (interval < 1)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: full_attention_interval %d must be >= 1",
                                path, interval);
        for (int32_t l = 0; l < c->n_layers; l++) c->layer_linear[l] = (l + 1) % interval != 0;
    }
    c->n_linear_layers = 0;
    for (int32_t l = 0; l < c->n_layers; l++) c->n_linear_layers += c->layer_linear[l];
    c->lin_conv = 4;
    if ((s = jint(o, "linear_num_key_heads", true, path, &c->lin_k_heads))) return s;
    if ((s = jint(o, "linear_num_value_heads", true, path, &c->lin_v_heads))) return s;
    if ((s = jint(o, "linear_key_head_dim", true, path, &c->lin_k_dim))) return s;
    if ((s = jint(o, "linear_value_head_dim", true, path, &c->lin_v_dim))) return s;
    if ((s = jint(o, "linear_conv_kernel_dim", false, path, &c->lin_conv))) return s;
    c->attn_out_gate = true;
    if ((s = jbool(o, "attn_output_gate", path, &c->attn_out_gate))) return s;
    float prf = 1.0f;
    if ((s = jfloat(o, "partial_rotary_factor", false, path, &prf))) return s;
    const cJSON *rp = get(o, "rope_parameters");
    if (cJSON_IsObject(rp) && (s = jfloat(rp, "partial_rotary_factor", false, path, &prf))) return s;
    if (!(prf > 0.0f && prf <= 1.0f))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: partial_rotary_factor %g must be in (0, 1]", path,
                            (double)prf);
    c->rope.rot_dim = (int32_t)((float)c->head_dim * prf); /* HF: int(head_dim * factor) */
    if (c->rope.rot_dim == c->head_dim) c->rope.rot_dim = 0;
    c->norm_unit_offset = true;
    c->qk_norm = true;
    return LETHE_OK;
}

static bool is_hybrid_arch(const char *a) { return !strcmp(a, "qwen3_5") || !strcmp(a, "qwen3_5_text"); }

static lethe_status read_config(const cJSON *root, const char *path, lethe_model_config *c) {
    const cJSON *mt = get(root, "model_type");
    if (!mt) return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing key 'model_type'", path);
    if (!cJSON_IsString(mt))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key 'model_type' must be a string (got %s)",
                            path, json_type_name(mt));
    if (!mt->valuestring[0] || strlen(mt->valuestring) >= LETHE_ARCH_NAME_MAX)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: key 'model_type' is not a valid name", path);
    snprintf(c->arch, sizeof(c->arch), "%s", mt->valuestring);

    /* language-model fields may sit under text_config (multimodal wrappers) */
    const cJSON *o = root;
    const cJSON *tc = get(root, "text_config");
    if (!get(root, "hidden_size") && cJSON_IsObject(tc)) {
        o = tc;
        const cJSON *tmt = get(tc, "model_type");
        if (cJSON_IsString(tmt) && tmt->valuestring[0] &&
            strlen(tmt->valuestring) < LETHE_ARCH_NAME_MAX)
            snprintf(c->arch, sizeof(c->arch), "%s", tmt->valuestring);
    }

    lethe_status s;
    if ((s = jint(o, "hidden_size", true, path, &c->dim))) return s;
    if ((s = jint(o, "num_hidden_layers", true, path, &c->n_layers))) return s;
    if ((s = jint(o, "num_attention_heads", true, path, &c->n_heads))) return s;
    if ((s = jint(o, "vocab_size", true, path, &c->n_vocab))) return s;
    if ((s = jint(o, "max_position_embeddings", true, path, &c->max_pos))) return s;
    if ((s = jfloat(o, "rms_norm_eps", true, path, &c->rms_eps))) return s;
    c->n_kv_heads = c->n_heads;
    if ((s = jint(o, "num_key_value_heads", false, path, &c->n_kv_heads))) return s;
    if (c->n_heads > 0 && c->dim % c->n_heads == 0) c->head_dim = c->dim / c->n_heads;
    if ((s = jint(o, "head_dim", false, path, &c->head_dim))) return s;
    if (c->head_dim <= 0)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: hidden_size %d is not a multiple of "
                            "num_attention_heads %d and 'head_dim' is absent",
                            path, c->dim, c->n_heads);
    /* MoE: qwen3_moe spells num_experts, deepseek/glm n_routed_experts, files written by
     * transformers 5 num_local_experts */
    if ((s = jint(o, "num_experts", false, path, &c->n_experts))) return s;
    if ((s = jint(o, "n_routed_experts", false, path, &c->n_experts))) return s;
    if ((s = jint(o, "num_local_experts", false, path, &c->n_experts)))
        return s; /* transformers 5 */
    if ((s = jint(o, "num_experts_per_tok", false, path, &c->n_experts_used))) return s;
    if ((s = jint(o, "moe_intermediate_size", false, path, &c->moe_ffn_dim))) return s;
    if ((s = jint(o, "intermediate_size", c->n_experts == 0, path, &c->ffn_dim))) return s;
    if ((s = read_moe(o, path, c))) return s;
    if ((s = read_rope(o, path, c))) return s;

    if (!strcmp(c->arch, "qwen2")) c->qkv_bias = true;
    if (!strcmp(c->arch, "qwen3") || !strcmp(c->arch, "qwen3_moe")) c->qk_norm = true;
    if ((s = jbool(o, "attention_bias", path, &c->qkv_bias))) return s;
    if (is_hybrid_arch(c->arch) && (s = read_hybrid(o, path, c))) return s;
    if ((s = jbool(root, "tie_word_embeddings", path, &c->tie_embeddings))) return s;
    if (o != root && (s = jbool(o, "tie_word_embeddings", path, &c->tie_embeddings))) return s;

    const cJSON *dt = get(root, "torch_dtype");
    if (!dt) dt = get(root, "dtype"); /* transformers v5 */
    if (cJSON_IsString(dt)) snprintf(c->torch_dtype, sizeof(c->torch_dtype), "%s", dt->valuestring);
    if ((s = read_token_ids(root, path, c))) return s;
    if (o != root && (s = read_token_ids(o, path, c))) return s;
    return LETHE_OK;
}

lethe_status lethe_hf_config_load(const char *config_path, lethe_model_config *out) {
    lethe_model_config_init(out);
    cJSON *root;
    lethe_status s = parse_json_file(config_path, &root);
    if (s) return s;
    s = read_config(root, config_path, out);
    cJSON_Delete(root);
    if (s) return s;

    /* generation_config.json beside config.json */
    size_t n = strlen(config_path);
    const char *slash = strrchr(config_path, '/');
    size_t dir_len = slash ? (size_t)(slash - config_path) + 1 : 0;
    char *gen = lethe_xmalloc(n + 32);
    memcpy(gen, config_path, dir_len);
    strcpy(gen + dir_len, "generation_config.json");
    FILE *f = fopen(gen, "rb");
    if (f) {
        fclose(f);
        s = parse_json_file(gen, &root);
        if (!s) {
            s = read_token_ids(root, gen, out);
            cJSON_Delete(root);
        }
    }
    free(gen);
    if (s) return s;
    return lethe_model_config_validate(out, config_path);
}

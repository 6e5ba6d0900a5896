/* loader.c - lethe_model_load: config + weights from GGUF, HF safetensors or
 * a seed (dummy), uploaded to a backend.
 *
 * One table of weights per model (weight_spec: backend slot, GGUF name, HF
 * name, shape [rows, cols] in HF order) drives all three sources. Shapes are
 * checked against the config (GGUF ne = {cols, rows}); a mismatch names the
 * tensor, the expected and the found shape. Each tensor is converted into
 * one reused f32 host buffer (sized for the largest tensor) and handed to
 * be->ops->weight_upload, so the model never sits in host f32 memory twice.
 * Matrices stored as GGUF blocks, f16 or bf16 go to ops->weight_upload_raw
 * first when the backend has it (the CPU keeps them as stored, qmatmul.c),
 * and take the f32 path when it declines.
 *
 * llama.cpp's converter permutes the rows of Q and K of arch "llama" so that
 * RoPE pairs are interleaved: within each head (n rows = head_dim), GGUF row
 * 2j + i holds HF row i*head_dim/2 + j (i in {0,1}). The forward uses HF
 * rotate-half RoPE, so those rows are put back on load. qwen2/qwen3 GGUFs are
 * not permuted. Tied embeddings: lm_head is the tok_embd pointer. */
#include <inttypes.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/log.h"
#include "core/util.h"
#include "model/dummy.h"
#include "model/gguf.h"
#include "model/model.h"
#include "model/safetensors.h"

lethe_status lethe_load_format_parse(const char *s, lethe_load_format *out) {
    static const struct { const char *name; lethe_load_format f; } t[] = {
        {"auto", LETHE_LOAD_AUTO}, {"gguf", LETHE_LOAD_GGUF}, {"hf", LETHE_LOAD_HF},
        {"safetensors", LETHE_LOAD_HF}, {"dummy", LETHE_LOAD_DUMMY},
    };
    for (size_t i = 0; s && i < LETHE_ARRAY_LEN(t); i++)
        if (!strcmp(s, t[i].name)) {
            *out = t[i].f;
            return LETHE_OK;
        }
    return lethe_errorf(LETHE_ERR_INVALID,
                        "--load-format %s: unknown format (expected auto, gguf, hf or dummy)",
                        s ? s : "(null)");
}

typedef struct weight_spec {
    void **slot;
    char gguf[64];
    char hf[96];
    int64_t rows, cols;     /* cols == 0: vector [rows] */
    lethe_dummy_kind kind;
    int32_t permute_heads;  /* GGUF llama Q/K: heads to un-permute (0 = none) */
    int64_t stack;          /* > 0: experts [stack, rows, cols]; HF name has a %d for the
                             * expert (one tensor each), GGUF one 3-D tensor */
    /* part of a larger tensor [src_rows, src_cols] (src_rows 0: the whole tensor):
     * from each block of sel_block rows, rows [sel_off, sel_off + sel_len), in order;
     * sel_unperm: those rows are interleaved RoPE pairs, put into rotate-half order;
     * sel_transpose: each taken [sel_len, src_cols] block is stored transposed
     * (rows = blocks * src_cols, cols = sel_len) */
    int64_t src_rows, src_cols;
    int32_t sel_block, sel_off, sel_len;
    bool sel_unperm, sel_transpose;
    /* value conversion after reading a checkpoint (qwen3_5): PLUS_ONE for
     * norms stored as w - 1 (not for dummy weights, which are the applied
     * values already); NEG_EXP for A_log -> A = -exp(A_log) (dummy too) */
    enum { XF_NONE = 0, XF_PLUS_ONE, XF_NEG_EXP } xform;
    bool squeeze_mid;       /* HF tensor [rows, 1, cols] (a depthwise conv's taps) */
    /* GGUF stack stored transposed: the file holds [stack, cols, rows], each
     * matrix is transposed into [rows, cols] on load */
    bool stack_t;
} weight_spec;

typedef struct source {
    lethe_load_format fmt;
    const char *path;       /* for messages */
    lethe_gguf gguf;
    lethe_safetensors st;
    uint64_t seed;
    bool permute;           /* GGUF of arch llama */
} source;

static bool is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}
static bool is_file(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}
static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}
static bool has_gguf_magic(const char *p) {
    FILE *f = fopen(p, "rb");
    char m[4] = {0};
    bool ok = f && fread(m, 1, 4, f) == 4 && !memcmp(m, "GGUF", 4);
    if (f) fclose(f);
    return ok;
}

/* path/config.json (or path itself if it is a file) -> malloc'd config path */
static char *config_path_of(const char *path) {
    if (is_file(path)) return lethe_xstrdup(path);
    size_t n = strlen(path) + 16;
    char *c = lethe_xmalloc(n);
    snprintf(c, n, "%s/config.json", path);
    return c;
}

static lethe_status resolve_format(const char *path, lethe_load_format *f) {
    if (*f != LETHE_LOAD_AUTO) return LETHE_OK;
    if (is_file(path)) {
        if (ends_with(path, ".gguf") || has_gguf_magic(path)) {
            *f = LETHE_LOAD_GGUF;
            return LETHE_OK;
        }
        if (ends_with(path, ".json"))
            return lethe_errorf(LETHE_ERR_INVALID,
                                "%s: a config.json alone has no weights; use --load-format dummy "
                                "for random weights, or pass the folder holding config.json and "
                                "*.safetensors", path);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: not a GGUF file (expected a .gguf file or an "
                            "HF model folder)", path);
    }
    if (is_dir(path)) {
        char *c = config_path_of(path);
        bool ok = is_file(c);
        free(c);
        if (ok) {
            *f = LETHE_LOAD_HF;
            return LETHE_OK;
        }
        return lethe_errorf(LETHE_ERR_NOT_FOUND, "%s: folder has no config.json (expected a "
                            ".gguf file or an HF model folder)", path);
    }
    return lethe_errorf(LETHE_ERR_IO, "%s: no such file or folder", path);
}

/* ---- the weight table ---- */

static int add_spec(weight_spec *s, int n, void **slot, const char *gguf, const char *hf,
                    int64_t rows, int64_t cols, lethe_dummy_kind kind, int32_t permute) {
    s[n] = (weight_spec){.slot = slot, .rows = rows, .cols = cols, .kind = kind,
                         .permute_heads = permute};
    snprintf(s[n].gguf, sizeof(s[n].gguf), "%s", gguf);
    snprintf(s[n].hf, sizeof(s[n].hf), "%s", hf);
    return n + 1;
}

static int64_t spec_elems(const weight_spec *w) {
    return (w->stack ? w->stack : 1) * w->rows * (w->cols ? w->cols : 1);
}

/* the feed-forward part of layer l: dense SwiGLU, or router + experts (+ shared experts) */
static int add_ffn_specs(weight_spec *s, int n, const lethe_model_config *c, int32_t l,
                         lethe_layer_weights *L) {
    const int64_t dim = c->dim, E = c->n_experts, mf = c->moe_ffn_dim;
    char g[64], h[96];
#define F(slot, gn, hn, r, cc, kind, st)                             \
    do {                                                             \
        snprintf(g, sizeof(g), "blk.%d." gn, l);                     \
        snprintf(h, sizeof(h), "model.layers.%d." hn, l);            \
        n = add_spec(s, n, (void **)&L->slot, g, h, r, cc, kind, 0); \
        s[n - 1].stack = st;                                         \
    } while (0)
    if (!lethe_layer_is_moe(c, l)) {
        F(w_gate, "ffn_gate.weight", "mlp.gate_proj.weight", c->ffn_dim, dim, LETHE_DUMMY_MATRIX,
          0);
        F(w_up, "ffn_up.weight", "mlp.up_proj.weight", c->ffn_dim, dim, LETHE_DUMMY_MATRIX, 0);
        F(w_down, "ffn_down.weight", "mlp.down_proj.weight", dim, c->ffn_dim, LETHE_DUMMY_MATRIX,
          0);
        return n;
    }
    F(router, "ffn_gate_inp.weight", "mlp.gate.weight", E, dim, LETHE_DUMMY_MATRIX, 0);
    if (c->moe_scoring == LETHE_MOE_SIGMOID)
        F(router_bias, "exp_probs_b.bias", "mlp.gate.e_score_correction_bias", E, 0,
          LETHE_DUMMY_BIAS, 0);
    /* %%d survives the first snprintf as the expert's %d */
    F(exp_gate, "ffn_gate_exps.weight", "mlp.experts.%%d.gate_proj.weight", mf, dim,
      LETHE_DUMMY_MATRIX, E);
    F(exp_up, "ffn_up_exps.weight", "mlp.experts.%%d.up_proj.weight", mf, dim, LETHE_DUMMY_MATRIX,
      E);
    F(exp_down, "ffn_down_exps.weight", "mlp.experts.%%d.down_proj.weight", dim, mf,
      LETHE_DUMMY_MATRIX, E);
    if (c->n_shared_experts > 0) {
        const int64_t sf = mf * c->n_shared_experts;
        F(sh_gate, "ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight", sf, dim,
          LETHE_DUMMY_MATRIX, 0);
        F(sh_up, "ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight", sf, dim,
          LETHE_DUMMY_MATRIX, 0);
        F(sh_down, "ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight", dim, sf,
          LETHE_DUMMY_MATRIX, 0);
    }
#undef F
    return n;
}

/* a selection of rows of a source tensor (weight_spec) */
static int add_sel(weight_spec *s, int n, void **slot, const char *gguf, const char *hf,
                   int64_t src_rows, int64_t src_cols, int32_t block, int32_t off, int32_t len,
                   bool unperm, bool transpose) {
    const int64_t blocks = src_rows / block;
    n = add_spec(s, n, slot, gguf, hf, transpose ? blocks * src_cols : blocks * len,
                 transpose ? len : src_cols, LETHE_DUMMY_MATRIX, 0);
    weight_spec *w = &s[n - 1];
    w->src_rows = src_rows, w->src_cols = src_cols;
    w->sel_block = block, w->sel_off = off, w->sel_len = len;
    w->sel_unperm = unperm, w->sel_transpose = transpose;
    return n;
}

/* latent attention (arch_mla.c): q / kv low-rank factors split into their
 * no-RoPE and RoPE rows, kv_b split per head into W_kb^T and W_vb. kv_split:
 * the GGUF stores them split already (llama.cpp's converter since MLA
 * absorption: blk.<l>.attn_k_b [H, C, Nd] = W_kb^T per head, attn_v_b
 * [H, Vd, C], no attn_kv_b), read as head stacks in the layout the forward
 * uses. */
static int add_mla_specs(weight_spec *s, int n, const lethe_model_config *c, int32_t l,
                         lethe_layer_weights *L, bool kv_split) {
    const int64_t dim = c->dim, H = c->n_heads, C = c->kv_lora_rank, R = c->qk_rope_dim;
    const int64_t Nd = c->qk_nope_dim, Vd = c->v_head_dim, qk = Nd + R;
    const int64_t q_in = c->q_lora_rank > 0 ? c->q_lora_rank : dim;
    char g[64], h[96];
#define NM(gn, hn) \
    (snprintf(g, sizeof(g), "blk.%d." gn, l), snprintf(h, sizeof(h), "model.layers.%d." hn, l))
    NM("attn_norm.weight", "input_layernorm.weight");
    n = add_spec(s, n, &L->attn_norm, g, h, dim, 0, LETHE_DUMMY_NORM, 0);
    if (c->q_lora_rank > 0) {
        NM("attn_q_a.weight", "self_attn.q_a_proj.weight");
        n = add_spec(s, n, &L->q_a, g, h, c->q_lora_rank, dim, LETHE_DUMMY_MATRIX, 0);
        NM("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight");
        n = add_spec(s, n, &L->q_a_norm, g, h, c->q_lora_rank, 0, LETHE_DUMMY_NORM, 0);
        NM("attn_q_b.weight", "self_attn.q_b_proj.weight");
    } else {
        NM("attn_q.weight", "self_attn.q_proj.weight");
    }
    n = add_sel(s, n, &L->q_b_nope, g, h, H * qk, q_in, (int32_t)qk, 0, (int32_t)Nd, false, false);
    n = add_sel(s, n, &L->q_b_pe, g, h, H * qk, q_in, (int32_t)qk, (int32_t)Nd, (int32_t)R,
                c->rope_interleave, false);
    NM("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight");
    n = add_sel(s, n, &L->kv_a_lat, g, h, C + R, dim, (int32_t)(C + R), 0, (int32_t)C, false,
                false);
    n = add_sel(s, n, &L->kv_a_pe, g, h, C + R, dim, (int32_t)(C + R), (int32_t)C, (int32_t)R,
                c->rope_interleave, false);
    NM("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight");
    n = add_spec(s, n, &L->kv_a_norm, g, h, C, 0, LETHE_DUMMY_NORM, 0);
    /* W_kb^T [H, C, Nd] absorbs the key into the query; W_kb [H, Nd, C] and
     * W_vb [H, Vd, C] decompress the latent into per-head K / V (the expanded
     * prefill, arch_mla.c) */
    if (kv_split) {
        NM("attn_k_b.weight", "self_attn.kv_b_proj.weight");
        n = add_spec(s, n, &L->w_kbt, g, h, C, Nd, LETHE_DUMMY_MATRIX, 0);
        s[n - 1].stack = H;
        n = add_spec(s, n, &L->w_kb, g, h, Nd, C, LETHE_DUMMY_MATRIX, 0);
        s[n - 1].stack = H;
        s[n - 1].stack_t = true;
        NM("attn_v_b.weight", "self_attn.kv_b_proj.weight");
        n = add_spec(s, n, &L->w_vb, g, h, Vd, C, LETHE_DUMMY_MATRIX, 0);
        s[n - 1].stack = H;
    } else {
        NM("attn_kv_b.weight", "self_attn.kv_b_proj.weight");
        n = add_sel(s, n, &L->w_kbt, g, h, H * (Nd + Vd), C, (int32_t)(Nd + Vd), 0, (int32_t)Nd,
                    false, true);
        n = add_sel(s, n, &L->w_kb, g, h, H * (Nd + Vd), C, (int32_t)(Nd + Vd), 0, (int32_t)Nd,
                    false, false);
        n = add_sel(s, n, &L->w_vb, g, h, H * (Nd + Vd), C, (int32_t)(Nd + Vd), (int32_t)Nd,
                    (int32_t)Vd, false, false);
    }
    NM("attn_output.weight", "self_attn.o_proj.weight");
    n = add_spec(s, n, &L->wo, g, h, dim, H * Vd, LETHE_DUMMY_MATRIX, 0);
    NM("ffn_norm.weight", "post_attention_layernorm.weight");
    n = add_spec(s, n, &L->ffn_norm, g, h, dim, 0, LETHE_DUMMY_NORM, 0);
#undef NM
    return add_ffn_specs(s, n, c, l, L);
}

/* hybrid linear attention (arch_hybrid.c): a DeltaNet layer, or a gated
 * attention layer whose q_proj rows hold per head [query hd | gate hd] */
static int add_hybrid_specs(weight_spec *s, int n, const lethe_model_config *c, int32_t l,
                            lethe_layer_weights *L) {
    const int64_t dim = c->dim, hd = c->head_dim, H = c->n_heads, kvd = (int64_t)c->n_kv_heads * hd;
    const int64_t C = lethe_lin_conv_dim(c), Hv = c->lin_v_heads, vd = Hv * c->lin_v_dim;
    char g[64], h[96];
#define NM(gn, hn) \
    (snprintf(g, sizeof(g), "blk.%d." gn, l), snprintf(h, sizeof(h), "model.layers.%d." hn, l))
    NM("attn_norm.weight", "input_layernorm.weight");
    n = add_spec(s, n, &L->attn_norm, g, h, dim, 0, LETHE_DUMMY_NORM, 0);
    if (lethe_layer_is_linear(c, l)) {
        NM("ssm_qkv.weight", "linear_attn.in_proj_qkv.weight");
        n = add_spec(s, n, &L->lin_qkv, g, h, C, dim, LETHE_DUMMY_MATRIX, 0);
        NM("ssm_z.weight", "linear_attn.in_proj_z.weight");
        n = add_spec(s, n, &L->lin_z, g, h, vd, dim, LETHE_DUMMY_MATRIX, 0);
        NM("ssm_b.weight", "linear_attn.in_proj_b.weight");
        n = add_spec(s, n, &L->lin_b, g, h, Hv, dim, LETHE_DUMMY_MATRIX, 0);
        NM("ssm_a.weight", "linear_attn.in_proj_a.weight");
        n = add_spec(s, n, &L->lin_a, g, h, Hv, dim, LETHE_DUMMY_MATRIX, 0);
        NM("ssm_conv1d.weight", "linear_attn.conv1d.weight");
        n = add_spec(s, n, &L->lin_conv, g, h, C, c->lin_conv, LETHE_DUMMY_MATRIX, 0);
        s[n - 1].squeeze_mid = true;
        NM("ssm_dt.bias", "linear_attn.dt_bias");
        n = add_spec(s, n, &L->lin_dt_bias, g, h, Hv, 0, LETHE_DUMMY_BIAS, 0);
        NM("ssm_a_log", "linear_attn.A_log");
        n = add_spec(s, n, &L->lin_A, g, h, Hv, 0, LETHE_DUMMY_BIAS, 0);
        s[n - 1].xform = XF_NEG_EXP;
        NM("ssm_norm.weight", "linear_attn.norm.weight");
        n = add_spec(s, n, &L->lin_norm, g, h, c->lin_v_dim, 0, LETHE_DUMMY_NORM, 0);
        NM("ssm_out.weight", "linear_attn.out_proj.weight");
        n = add_spec(s, n, &L->lin_out, g, h, dim, vd, LETHE_DUMMY_MATRIX, 0);
    } else {
        NM("attn_q.weight", "self_attn.q_proj.weight");
        if (c->attn_out_gate) {
            n = add_sel(s, n, &L->wq, g, h, H * 2 * hd, dim, (int32_t)(2 * hd), 0, (int32_t)hd,
                        false, false);
            n = add_sel(s, n, &L->wq_gate, g, h, H * 2 * hd, dim, (int32_t)(2 * hd), (int32_t)hd,
                        (int32_t)hd, false, false);
        } else {
            n = add_spec(s, n, &L->wq, g, h, H * hd, dim, LETHE_DUMMY_MATRIX, 0);
        }
        NM("attn_k.weight", "self_attn.k_proj.weight");
        n = add_spec(s, n, &L->wk, g, h, kvd, dim, LETHE_DUMMY_MATRIX, 0);
        NM("attn_v.weight", "self_attn.v_proj.weight");
        n = add_spec(s, n, &L->wv, g, h, kvd, dim, LETHE_DUMMY_MATRIX, 0);
        NM("attn_q_norm.weight", "self_attn.q_norm.weight");
        n = add_spec(s, n, &L->q_norm, g, h, hd, 0, LETHE_DUMMY_NORM, 0);
        NM("attn_k_norm.weight", "self_attn.k_norm.weight");
        n = add_spec(s, n, &L->k_norm, g, h, hd, 0, LETHE_DUMMY_NORM, 0);
        NM("attn_output.weight", "self_attn.o_proj.weight");
        n = add_spec(s, n, &L->wo, g, h, dim, H * hd, LETHE_DUMMY_MATRIX, 0);
    }
    NM("ffn_norm.weight", "post_attention_layernorm.weight");
    n = add_spec(s, n, &L->ffn_norm, g, h, dim, 0, LETHE_DUMMY_NORM, 0);
#undef NM
    return add_ffn_specs(s, n, c, l, L);
}

/* a GGUF that stores layer l's kv_b as attn_k_b / attn_v_b (see add_mla_specs) */
static bool gguf_kv_split(const source *src, int32_t l) {
    if (src->fmt != LETHE_LOAD_GGUF) return false;
    char k[64], kv[64];
    snprintf(k, sizeof(k), "blk.%d.attn_k_b.weight", l);
    snprintf(kv, sizeof(kv), "blk.%d.attn_kv_b.weight", l);
    return !lethe_gguf_find_tensor(&src->gguf, kv) && lethe_gguf_find_tensor(&src->gguf, k);
}

static weight_spec *build_specs(lethe_model *m, const source *src, int *n_out) {
    const bool permute = src->permute;
    const lethe_model_config *c = &m->cfg;
    const int64_t dim = c->dim, hd = c->head_dim, qd = (int64_t)c->n_heads * hd,
                  kvd = (int64_t)c->n_kv_heads * hd;
    weight_spec *s = lethe_xcalloc((size_t)c->n_layers * 24 + 3, sizeof(weight_spec));
    int n = 0;
    n = add_spec(s, n, &m->w.tok_embd, "token_embd.weight", "model.embed_tokens.weight",
                 c->n_vocab, dim, LETHE_DUMMY_EMBED, 0);
    n = add_spec(s, n, &m->w.out_norm, "output_norm.weight", "model.norm.weight", dim, 0,
                 LETHE_DUMMY_NORM, 0);
    if (!c->tie_embeddings)
        n = add_spec(s, n, &m->w.lm_head, "output.weight", "lm_head.weight", c->n_vocab, dim,
                     LETHE_DUMMY_MATRIX, 0);
    for (int32_t l = 0; l < c->n_layers; l++) {
        lethe_layer_weights *L = &m->w.layers[l];
        if (c->kv_lora_rank > 0) {
            n = add_mla_specs(s, n, c, l, L, gguf_kv_split(src, l));
            continue;
        }
        if (c->n_linear_layers > 0) {
            n = add_hybrid_specs(s, n, c, l, L);
            continue;
        }
        char g[64], h[96];
#define W(slot, gn, hn, r, cc, kind, perm)                                         \
    do {                                                                           \
        snprintf(g, sizeof(g), "blk.%d." gn, l);                                   \
        snprintf(h, sizeof(h), "model.layers.%d." hn, l);                          \
        n = add_spec(s, n, (void **)&L->slot, g, h, r, cc, kind, perm);            \
    } while (0)
        W(attn_norm, "attn_norm.weight", "input_layernorm.weight", dim, 0, LETHE_DUMMY_NORM, 0);
        W(wq, "attn_q.weight", "self_attn.q_proj.weight", qd, dim, LETHE_DUMMY_MATRIX,
          permute ? c->n_heads : 0);
        W(wk, "attn_k.weight", "self_attn.k_proj.weight", kvd, dim, LETHE_DUMMY_MATRIX,
          permute ? c->n_kv_heads : 0);
        W(wv, "attn_v.weight", "self_attn.v_proj.weight", kvd, dim, LETHE_DUMMY_MATRIX, 0);
        if (c->qkv_bias) {
            W(bq, "attn_q.bias", "self_attn.q_proj.bias", qd, 0, LETHE_DUMMY_BIAS, 0);
            W(bk, "attn_k.bias", "self_attn.k_proj.bias", kvd, 0, LETHE_DUMMY_BIAS, 0);
            W(bv, "attn_v.bias", "self_attn.v_proj.bias", kvd, 0, LETHE_DUMMY_BIAS, 0);
        }
        if (c->qk_norm) {
            W(q_norm, "attn_q_norm.weight", "self_attn.q_norm.weight", hd, 0, LETHE_DUMMY_NORM, 0);
            W(k_norm, "attn_k_norm.weight", "self_attn.k_norm.weight", hd, 0, LETHE_DUMMY_NORM, 0);
        }
        W(wo, "attn_output.weight", "self_attn.o_proj.weight", dim, qd, LETHE_DUMMY_MATRIX, 0);
        W(ffn_norm, "ffn_norm.weight", "post_attention_layernorm.weight", dim, 0,
          LETHE_DUMMY_NORM, 0);
        n = add_ffn_specs(s, n, c, l, L);
#undef W
    }
    /* zero-centred norms (qwen3_5): every RMSNorm but the DeltaNet output norm */
    for (int i = 0; c->norm_unit_offset && i < n; i++) {
        bool gated = false;
        for (int32_t l = 0; l < c->n_layers && !gated; l++) gated = s[i].slot == &m->w.layers[l].lin_norm;
        if (s[i].kind == LETHE_DUMMY_NORM && !gated) s[i].xform = XF_PLUS_ONE;
    }
    *n_out = n;
    return s;
}

static void shape_str(char *buf, size_t n, int nd, const int64_t *d) {
    int k = snprintf(buf, n, "[");
    for (int i = 0; i < nd && k < (int)n; i++)
        k += snprintf(buf + k, n - (size_t)k, "%s%" PRId64, i ? ", " : "", d[i]);
    if (k < (int)n) snprintf(buf + k, n - (size_t)k, "]");
}

static lethe_status shape_mismatch(const char *path, const char *name, const weight_spec *w,
                                   int nd, const int64_t *found) {
    char e[64], f[96];
    int64_t exp[3] = {w->stack, w->stack_t ? w->cols : w->rows, w->stack_t ? w->rows : w->cols};
    const bool stacked = w->stack && nd == 3; /* a GGUF expert tensor: [experts, rows, cols] */
    shape_str(e, sizeof(e), stacked ? 3 : w->cols ? 2 : 1, stacked ? exp : exp + 1);
    shape_str(f, sizeof(f), nd, found);
    return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s from the "
                        "config", path, name, f, e);
}

/* GGUF llama row order -> HF: within each head, row 2j+i -> i*half + j */
static void unpermute_rows(float *dst, const float *src, int64_t rows, int64_t cols,
                           int32_t heads) {
    int64_t hd = rows / heads, half = hd / 2;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        int64_t h = r / hd, k = r % hd, i = k % 2, j = k / 2;
        memcpy(dst + (h * hd + i * half + j) * cols, src + r * cols, (size_t)cols * sizeof(float));
    }
}

/* Fills buf (n = rows * max(cols,1) floats) with tensor w from the source. */
/* stacked experts from one tensor per expert (HF) into buf [stack, rows, cols] */
static lethe_status fetch_hf_stack(source *src, const weight_spec *w, float *buf) {
    const uint64_t per = (uint64_t)w->rows * (uint64_t)w->cols;
    for (int64_t e = 0; e < w->stack; e++) {
        char name[128];
        snprintf(name, sizeof(name), w->hf, (int)e);
        const lethe_st_tensor *t = lethe_st_find(&src->st, name);
        if (!t) return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing tensor '%s'", src->path, name);
        if (!(t->n_dims == 2 && t->shape[0] == w->rows && t->shape[1] == w->cols))
            return shape_mismatch(src->path, name, w, t->n_dims, t->shape);
        lethe_status s = lethe_st_to_f32(&src->st, t, buf + (uint64_t)e * per);
        if (s) return s;
    }
    return LETHE_OK;
}

static lethe_status fetch(source *src, const weight_spec *w, float *buf, float *tmp);

/* the selected rows of w's source tensor (fetched whole into tmp) into buf */
static lethe_status fetch_sel(source *src, const weight_spec *w, float *buf, float *tmp) {
    weight_spec whole = *w;
    whole.rows = w->src_rows, whole.cols = w->src_cols;
    whole.src_rows = 0, whole.permute_heads = 0;
    lethe_status s = fetch(src, &whole, tmp, NULL);
    if (s) return s;
    const int64_t blocks = w->src_rows / w->sel_block, cols = w->src_cols, len = w->sel_len;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < len; i++) {
            /* interleaved pairs (2j, 2j+1) -> rows j and len/2 + j */
            const int64_t from = w->sel_unperm ? (i < len / 2 ? 2 * i : 2 * (i - len / 2) + 1) : i;
            const float *row = tmp + (b * w->sel_block + w->sel_off + from) * cols;
            if (!w->sel_transpose) {
                memcpy(buf + (b * len + i) * cols, row, (size_t)cols * sizeof(float));
                continue;
            }
            for (int64_t j = 0; j < cols; j++) buf[(b * cols + j) * len + i] = row[j];
        }
    return LETHE_OK;
}

static lethe_status fetch_raw(source *src, const weight_spec *w, float *buf, float *tmp);

static lethe_status fetch(source *src, const weight_spec *w, float *buf, float *tmp) {
    lethe_status s = fetch_raw(src, w, buf, tmp);
    const uint64_t n = (uint64_t)spec_elems(w);
    if (s || w->xform == XF_NONE) return s;
    if (w->xform == XF_NEG_EXP)
        for (uint64_t i = 0; i < n; i++) buf[i] = -expf(buf[i]);
    else if (src->fmt != LETHE_LOAD_DUMMY)
        for (uint64_t i = 0; i < n; i++) buf[i] = 1.0f + buf[i];
    return LETHE_OK;
}

static lethe_status fetch_raw(source *src, const weight_spec *w, float *buf, float *tmp) {
    uint64_t n = (uint64_t)spec_elems(w);
    if (w->src_rows && src->fmt != LETHE_LOAD_DUMMY) return fetch_sel(src, w, buf, tmp);
    if (src->fmt == LETHE_LOAD_DUMMY) {
        lethe_dummy_fill(buf, n, w->kind, w->cols ? w->cols : w->rows, src->seed, w->hf);
        return LETHE_OK;
    }
    lethe_status s;
    if (src->fmt == LETHE_LOAD_GGUF) {
        const lethe_gguf_tensor *t = lethe_gguf_find_tensor(&src->gguf, w->gguf);
        if (!t)
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing tensor '%s'", src->path, w->gguf);
        int64_t found[4];
        int nd = (int)t->n_dims;
        for (int i = 0; i < nd; i++) found[i] = (int64_t)t->ne[nd - 1 - i]; /* to [rows, cols] */
        const int64_t r = w->stack_t ? w->cols : w->rows, cc = w->stack_t ? w->rows : w->cols;
        bool ok = w->stack  ? (nd == 3 && found[0] == w->stack && found[1] == r && found[2] == cc)
                  : w->cols ? (nd == 2 && found[0] == w->rows && found[1] == w->cols)
                            : (nd == 1 && found[0] == w->rows);
        if (!ok) return shape_mismatch(src->path, w->gguf, w, nd, found);
        float *dst = w->permute_heads || w->stack_t ? tmp : buf;
        if ((s = lethe_ggml_dequantize(t->type, t->data, dst, n))) {
            char why[512];
            snprintf(why, sizeof(why), "%s", lethe_last_error());
            return lethe_errorf(s, "%s: tensor '%s': %s", src->path, w->gguf, why);
        }
        if (w->permute_heads) {
            if (w->rows % w->permute_heads || (w->rows / w->permute_heads) % 2)
                return lethe_errorf(LETHE_ERR_FORMAT, "%s: tensor '%s': %" PRId64 " rows do not "
                                    "split into %d heads of even size", src->path, w->gguf,
                                    w->rows, w->permute_heads);
            unpermute_rows(buf, tmp, w->rows, w->cols, w->permute_heads);
        }
        for (int64_t e = 0; w->stack_t && e < w->stack; e++) {
            const float *from = tmp + (uint64_t)e * w->rows * w->cols; /* [cols, rows] */
            float *to = buf + (uint64_t)e * w->rows * w->cols;          /* [rows, cols] */
            for (int64_t i = 0; i < w->rows; i++)
                for (int64_t j = 0; j < w->cols; j++) to[i * w->cols + j] = from[j * w->rows + i];
        }
        return LETHE_OK;
    }
    if (w->stack) return fetch_hf_stack(src, w, buf);
    const lethe_st_tensor *t = lethe_st_find(&src->st, w->hf);
    if (!t) return lethe_errorf(LETHE_ERR_FORMAT, "%s: missing tensor '%s'", src->path, w->hf);
    bool ok = w->cols ? (t->n_dims == 2 && t->shape[0] == w->rows && t->shape[1] == w->cols)
                      : (t->n_dims == 1 && t->shape[0] == w->rows);
    if (w->squeeze_mid)
        ok = t->n_dims == 3 && t->shape[0] == w->rows && t->shape[1] == 1 && t->shape[2] == w->cols;
    if (!ok) return shape_mismatch(src->path, w->hf, w, t->n_dims, t->shape);
    return lethe_st_to_f32(&src->st, t, buf);
}

/* Matrices in a stored format the backend keeps as they are
 * (ops->weight_upload_raw: GGUF blocks, f16 / bf16): rows un-permuted as
 * whole byte ranges (a row is whole blocks). LETHE_ERR_UNSUPPORTED: not
 * such a tensor or not taken by the backend, the caller uploads f32 instead. */
static lethe_status upload_raw(source *src, const weight_spec *w, lethe_backend *be,
                               void **slot, size_t *bytes) {
    /* whole 2-D tensors only: not expert stacks, not row selections (MLA's kv_b parts) */
    if (!be->ops->weight_upload_raw || !w->cols || w->stack || w->src_rows || w->xform ||
        w->squeeze_mid || src->fmt == LETHE_LOAD_DUMMY)
        return LETHE_ERR_UNSUPPORTED;
    lethe_weight_raw r = {.rows = w->rows, .cols = w->cols};
    if (src->fmt == LETHE_LOAD_GGUF) {
        const lethe_gguf_tensor *t = lethe_gguf_find_tensor(&src->gguf, w->gguf);
        if (!t || t->n_dims != 2 || (int64_t)t->ne[0] != w->cols || (int64_t)t->ne[1] != w->rows)
            return LETHE_ERR_UNSUPPORTED; /* fetch() names the problem */
        r.type = t->type, r.data = t->data;
    } else {
        const lethe_st_tensor *t = lethe_st_find(&src->st, w->hf);
        if (!t || t->n_dims != 2 || t->shape[0] != w->rows || t->shape[1] != w->cols)
            return LETHE_ERR_UNSUPPORTED;
        if (!strcmp(t->dtype, "BF16")) r.type = LETHE_GGML_BF16;
        else if (!strcmp(t->dtype, "F16")) r.type = LETHE_GGML_F16;
        else return LETHE_ERR_UNSUPPORTED;
        r.data = t->data;
    }
    if (r.type == LETHE_GGML_F32) return LETHE_ERR_UNSUPPORTED;
    const size_t rb = lethe_ggml_type_size(r.type, (uint64_t)w->cols);
    if (!rb) return LETHE_ERR_UNSUPPORTED;
    uint8_t *perm = NULL;
    if (w->permute_heads) {
        if (w->rows % w->permute_heads || (w->rows / w->permute_heads) % 2)
            return LETHE_ERR_UNSUPPORTED; /* fetch() names the problem */
        perm = malloc(rb * (size_t)w->rows);
        if (!perm)
            return lethe_errorf(LETHE_ERR_NOMEM, "%s: cannot allocate %zu bytes", src->path,
                                rb * (size_t)w->rows);
        const int64_t hd = w->rows / w->permute_heads, half = hd / 2;
        for (int64_t row = 0; row < w->rows; row++) {
            int64_t h = row / hd, k = row % hd, i = k % 2, j = k / 2;
            memcpy(perm + (size_t)(h * hd + i * half + j) * rb,
                   (const uint8_t *)r.data + (size_t)row * rb, rb);
        }
        r.data = perm;
    }
    lethe_status s = be->ops->weight_upload_raw(be, &r, slot);
    free(perm);
    if (!s) *bytes = rb * (size_t)w->rows;
    return s;
}

static void progress(int done, int total, double mb, double total_mb, double t0) {
    int width = 30, fill = total ? done * width / total : width;
    char bar[40];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '=' : ' ';
    bar[width] = '\0';
    fprintf(stderr, "\rloading weights [%s] %d/%d tensors, %.0f/%.0f MB, %.1fs", bar, done, total,
            mb, total_mb, lethe_time_s() - t0);
    if (done == total) fputc('\n', stderr);
    fflush(stderr);
}

/* A multimodal checkpoint (Qwen3_5ForConditionalGeneration) keeps the text
 * model under model.language_model.; its vision tower (model.visual.) and
 * multi-token-prediction head (mtp.) are not loaded. */
static void hf_text_prefix(source *src, weight_spec *specs, int n) {
    if (src->fmt != LETHE_LOAD_HF) return;
    if (lethe_st_find(&src->st, "model.language_model.embed_tokens.weight")) {
        for (int i = 0; i < n; i++) {
            if (strncmp(specs[i].hf, "model.", 6)) continue;
            char name[sizeof(specs[i].hf)];
            snprintf(name, sizeof(name), "model.language_model.%s", specs[i].hf + 6);
            snprintf(specs[i].hf, sizeof(specs[i].hf), "%s", name);
        }
    }
    size_t vision = 0, mtp = 0;
    for (size_t i = 0; i < src->st.n_tensors; i++) {
        const char *t = src->st.tensors[i].name;
        if (!strncmp(t, "model.visual.", 13) || !strncmp(t, "visual.", 7)) vision++;
        if (!strncmp(t, "mtp.", 4)) mtp++;
    }
    if (vision)
        LOG_INFO("%s: %zu vision-tower tensors skipped (lethe serves the text model only)",
                 src->path, vision);
    if (mtp) LOG_INFO("%s: %zu multi-token-prediction tensors skipped", src->path, mtp);
}

static lethe_status load_weights(lethe_model *m, source *src, bool show) {
    int n;
    weight_spec *specs = build_specs(m, src, &n);
    hf_text_prefix(src, specs, n);
    uint64_t max_n = 0, max_perm = 0;
    double total_mb = 0;
    for (int i = 0; i < n; i++) {
        uint64_t e = (uint64_t)spec_elems(&specs[i]);
        max_n = LETHE_MAX(max_n, e);
        if (specs[i].permute_heads || specs[i].stack_t) max_perm = LETHE_MAX(max_perm, e);
        if (specs[i].src_rows)
            max_perm = LETHE_MAX(max_perm, (uint64_t)specs[i].src_rows * specs[i].src_cols);
        total_mb += (double)e * 4 / 1e6;
    }
    float *buf = malloc(max_n * sizeof(float));
    float *tmp = max_perm ? malloc(max_perm * sizeof(float)) : NULL;
    lethe_status s = LETHE_OK;
    if (!buf || (max_perm && !tmp))
        s = lethe_errorf(LETHE_ERR_NOMEM, "%s: cannot allocate a %.0f MB staging buffer",
                         src->path, (double)max_n * 4 / 1e6);
    double t0 = lethe_time_s(), last = 0, mb = 0;
    for (int i = 0; i < n && !s; i++) {
        const weight_spec *w = &specs[i];
        size_t e = (size_t)spec_elems(w);
        size_t bytes = e * m->be->ops->act_size; /* f32 path: the backend's weight type */
        s = upload_raw(src, w, m->be, w->slot, &bytes);
        if (s == LETHE_ERR_UNSUPPORTED) {
            if ((s = fetch(src, w, buf, tmp))) break;
            s = m->be->ops->weight_upload(m->be, buf, e, w->slot);
        }
        if (s) break;
        if (w->cols) m->matrix_bytes += bytes;
        mb += (double)e * 4 / 1e6;
        if (show && (i + 1 == n || lethe_time_s() - last > 0.2)) {
            progress(i + 1, n, mb, total_mb, t0);
            last = lethe_time_s();
        }
    }
    if (show && s) fputc('\n', stderr);
    if (!s && m->cfg.tie_embeddings) m->w.lm_head = m->w.tok_embd;
    free(buf);
    free(tmp);
    free(specs);
    return s;
}

/* family lookup + its own config check; messages get the model path in front */
static lethe_status check_arch(lethe_model *m, const char *path) {
    lethe_status s = LETHE_OK;
    m->arch = lethe_arch_find(m->cfg.arch);
    if (!m->arch) s = LETHE_ERR_UNSUPPORTED;
    else if (m->arch->check) s = m->arch->check(&m->cfg);
    if (s) {
        char why[512];
        snprintf(why, sizeof(why), "%s", lethe_last_error());
        lethe_errorf(s, "%s: %s", path, why);
    }
    return s;
}

lethe_status lethe_model_load(const lethe_model_load_params *p, lethe_backend *be,
                              lethe_model *out) {
    memset(out, 0, sizeof(*out));
    if (!p || !p->path || !p->path[0])
        return lethe_errorf(LETHE_ERR_INVALID, "--model: no model path given");
    lethe_load_format fmt = p->format;
    lethe_status s = resolve_format(p->path, &fmt);
    if (s) return s;
    out->be = be;
    out->path = lethe_xstrdup(p->path);
    source src = {.fmt = fmt, .path = p->path, .seed = p->seed};

    if (fmt == LETHE_LOAD_GGUF) {
        if ((s = lethe_gguf_open(p->path, &src.gguf))) goto fail;
        if ((s = lethe_gguf_config_load(&src.gguf, &out->cfg))) goto fail;
        src.permute = !strcmp(out->cfg.arch, "llama");
    } else {
        char *cp = config_path_of(p->path);
        if (fmt == LETHE_LOAD_HF && !is_dir(p->path)) {
            s = lethe_errorf(LETHE_ERR_INVALID, "%s: --load-format hf expects the model folder "
                             "(config.json + *.safetensors)", p->path);
            free(cp);
            goto fail;
        }
        s = lethe_hf_config_load(cp, &out->cfg);
        free(cp);
        if (s) goto fail;
    }
    if ((s = check_arch(out, p->path))) goto fail;
    if (fmt == LETHE_LOAD_GGUF && out->cfg.n_linear_layers > 0) {
        s = lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: hybrid linear-attention models load from HF "
                         "safetensors folders only (not GGUF)", p->path);
        goto fail;
    }
    if (fmt == LETHE_LOAD_HF && (s = lethe_st_open_dir(p->path, &src.st))) goto fail;
    out->w.layers = lethe_xcalloc((size_t)out->cfg.n_layers, sizeof(lethe_layer_weights));
    if ((s = load_weights(out, &src, p->progress))) goto fail;
    lethe_gguf_close(&src.gguf);
    lethe_st_close(&src.st);
    return LETHE_OK;
fail:
    lethe_gguf_close(&src.gguf);
    lethe_st_close(&src.st);
    lethe_model_free(out);
    return s;
}

void lethe_model_free(lethe_model *m) {
    if (!m) return;
    lethe_model_workspace_free(m);
    lethe_backend *be = m->be;
    if (be) {
        void *tied = m->w.lm_head == m->w.tok_embd ? m->w.lm_head : NULL;
        void *g[] = {m->w.tok_embd, m->w.out_norm, tied ? NULL : m->w.lm_head};
        for (size_t i = 0; i < LETHE_ARRAY_LEN(g); i++)
            if (g[i]) be->ops->release(be, g[i]);
        for (int32_t l = 0; m->w.layers && l < m->cfg.n_layers; l++) {
            lethe_layer_weights *L = &m->w.layers[l];
            void *lw[] = {L->attn_norm,   L->wq,       L->wk,      L->wv,        L->bq,
                          L->bk,          L->bv,       L->q_norm,  L->k_norm,    L->wo,
                          L->ffn_norm,    L->w_gate,   L->w_up,    L->w_down,    L->router,
                          L->router_bias, L->exp_gate, L->exp_up,  L->exp_down,  L->sh_gate,
                          L->sh_up,       L->sh_down,  L->q_a,     L->q_a_norm,  L->q_b_nope,
                          L->q_b_pe,      L->kv_a_lat, L->kv_a_pe, L->kv_a_norm, L->w_kbt,
                          L->w_vb,        L->wq_gate,  L->lin_qkv, L->lin_z,     L->lin_a,
                          L->lin_b,       L->lin_conv, L->lin_A,   L->lin_dt_bias, L->lin_norm,
                          L->lin_out,     L->w_kb};
            for (size_t i = 0; i < LETHE_ARRAY_LEN(lw); i++)
                if (lw[i]) be->ops->release(be, lw[i]);
        }
    }
    free(m->w.layers);
    free(m->path);
    memset(m, 0, sizeof(*m));
}

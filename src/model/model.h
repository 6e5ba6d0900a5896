/* model.h - a loaded model: config, backend weights, and the forward pass.
 *
 * The forward pass is one fixed execution path per architecture family
 * (arch_<family>.c). It never decides which KV a layer reads: at each layer
 * it asks the caller (the engine, through lethe_fwd_hooks) where to store the
 * new tokens' K/V and which slots attention reads. That is where KV layouts,
 * prefix reuse and sparse methods step in without the model code changing.
 *
 * Life of one forward call, per layer l:
 *   x -> rmsnorm -> q,k,v projections (+bias) (+q/k head norm) -> RoPE(pos)
 *     -> hooks->plan_layer(l, q)  : store slots + attention selection
 *     -> kv_store, attention(selection) -> hooks->after_attn (optional)
 *     -> o projection + residual -> rmsnorm -> SwiGLU MLP + residual
 * then final norm and the lm_head for the rows that want logits. */
#ifndef LETHE_MODEL_H
#define LETHE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/config.h"

/* Backend pointers (see backend.h); NULL when the family has no such tensor. */
typedef struct lethe_layer_weights {
    void *attn_norm;            /* [dim] */
    void *wq, *wk, *wv;         /* [n_heads*head_dim, dim], [n_kv_heads*head_dim, dim] x2 */
    void *bq, *bk, *bv;         /* qkv bias (qwen2) [n_heads*head_dim] / [kv_dim] */
    void *q_norm, *k_norm;      /* qwen3 per-head RMSNorm weights [head_dim] */
    void *wo;                   /* [dim, n_heads*head_dim] */
    void *ffn_norm;             /* [dim] */
    void *w_gate, *w_up;        /* [ffn_dim, dim] */
    void *w_down;               /* [dim, ffn_dim] */
    /* MoE layers (lethe_layer_is_moe) have these instead of w_gate/w_up/w_down */
    void *router;            /* [n_experts, dim] */
    void *router_bias;       /* [n_experts] sigmoid routing's selection bias */
    void *exp_gate, *exp_up; /* [n_experts, moe_ffn_dim, dim] */
    void *exp_down;          /* [n_experts, dim, moe_ffn_dim] */
    void *sh_gate, *sh_up;   /* shared experts [n_shared * moe_ffn_dim, dim] */
    void *sh_down;           /* [dim, n_shared * moe_ffn_dim] */
    /* latent attention (arch_mla.c; H heads, C kv_lora_rank, R / Nd / Vd rope /
     * nope / v head dims) instead of wq / wk / wv */
    void *q_a, *q_a_norm;     /* [q_lora, dim], [q_lora] (q_lora_rank > 0) */
    void *q_b_nope, *q_b_pe;  /* [H * Nd, q_in], [H * R, q_in] (q_in = q_lora or dim) */
    void *kv_a_lat, *kv_a_pe; /* [C, dim], [R, dim] */
    void *kv_a_norm;          /* [C] */
    void *w_kbt;              /* [H, C, Nd]: W_kb[h]^T, absorbs the key into the query */
    void *w_kb;               /* [H, Nd, C]: W_kb[h], decompresses latents into keys */
    void *w_vb;               /* [H, Vd, C] */
    /* hybrid linear attention (arch_hybrid.c). Gated attention layers: the
     * gate half of q_proj [n_heads*head_dim, dim] (wq holds the query half).
     * DeltaNet layers (lethe_layer_is_linear; Hv v heads of dv, C conv
     * channels, K conv taps) instead of wq / wk / wv / wo: */
    void *wq_gate;
    void *lin_qkv;            /* [C, dim] q | k | v projections (in_proj_qkv) */
    void *lin_z;              /* [Hv*dv, dim] output-norm gate (in_proj_z) */
    void *lin_a, *lin_b;      /* [Hv, dim] decay / beta inputs (in_proj_a, in_proj_b) */
    void *lin_conv;           /* [C, K] depthwise conv taps */
    void *lin_A, *lin_dt_bias;/* [Hv]: A = -exp(A_log) (converted on load), dt_bias */
    void *lin_norm;           /* [dv] gated RMSNorm weight */
    void *lin_out;            /* [dim, Hv*dv] out_proj */
} lethe_layer_weights;

typedef struct lethe_weights {
    void *tok_embd;             /* [n_vocab, dim] */
    void *out_norm;             /* [dim] */
    void *lm_head;              /* [n_vocab, dim]; == tok_embd when tied */
    lethe_layer_weights *layers;/* owned, [n_layers] */
} lethe_weights;

/* One step's tokens: several sequences, each a contiguous run of rows. */
typedef struct lethe_fwd_batch {
    int32_t n_tokens;
    const int32_t *tokens;      /* [n_tokens] */
    const int32_t *pos;         /* [n_tokens] logical positions (RoPE) */
    int32_t n_seqs;
    const int32_t *seq_begin;   /* [n_seqs + 1] rows of sequence s: [seq_begin[s], seq_begin[s+1]) */
    int32_t n_logits;
    const int32_t *logit_rows;  /* [n_logits] rows whose next-token logits are wanted */
    /* models with linear-attention layers (lethe_layer_is_linear): the state
     * slot of each sequence [n_seqs]; NULL otherwise. The per-layer "KV
     * cache" of such a layer is its state: k_cache[l] = recurrent states f32
     * [n_state_slots, Hv, dk, dv], v_cache[l] = conv states f32
     * [n_state_slots, K - 1, C] (backend.h lethe_gdn_args). A sequence whose
     * first row is at position 0 starts from zero states. */
    const int32_t *state_slots;
} lethe_fwd_batch;

/* How a layer whose KV payload is not the backend's K / V (a method's
 * lethe_kv_layout, backend.h) is written and read. The model computes q, k, v
 * as always and then, instead of kv_store / attention / its own wo:
 *   path->store(ctx, layer, k, v, slots, pos, n)   k (pre-RoPE with
 *       k_pre_rope, else after RoPE), v: [n, n_kv_heads * head_dim]
 *       activations; slots = plan.store_slots, pos = the batch positions
 *   path->attend(ctx, layer, a)   a as for attention (k_cache / v_cache =
 *       planes 0 / 1 of the layer); writes a->out [n_tokens, out_dim]
 *   out projection: x += a->out W^T with W = path->out_proj(ctx, layer) when
 *       the hook exists and returns non-NULL ([dim, out_dim], e.g. values
 *       absorbed into wo), else the layer's wo (out_dim = n_heads * head_dim).
 * A model-declared payload (MLA) is handled by its architecture's forward
 * itself and needs no path. */
typedef struct lethe_kv_path {
    void *ctx;
    bool k_pre_rope;
    int32_t out_dim;             /* width of attend's output rows; 0 = n_heads * head_dim */
    void (*store)(void *ctx, int32_t layer, const void *k, const void *v, const int32_t *slots,
                  const int32_t *pos, int32_t n);
    void (*attend)(void *ctx, int32_t layer, const lethe_attn_args *a);
    const void *(*out_proj)(void *ctx, int32_t layer); /* optional */
} lethe_kv_path;

/* The caller's answer for one layer (host arrays valid until the next call). */
typedef struct lethe_layer_plan {
    const int32_t *store_slots; /* [n_tokens] cache slot receiving each new token */
    const int32_t *sel_begin;   /* [n_seqs + 1] see lethe_attn_args */
    const int32_t *sel_slots;   /* selection, last n_q(s) entries = the new tokens */
    /* per-KV-head selections (lethe_attn_args.head_sel_*) or NULL */
    const int32_t *head_sel_begin, *head_sel_slots;
    /* the layer's KV storage format (kv_pool.h); NULL = the backend's kv type.
     * Non-NULL: kv_store_quant instead of kv_store, and attention reads codes. */
    const lethe_kv_quant *kvq;
    /* the layer's payload path (lethe_kv_path); NULL = the backend's K / V
     * (kvq above). Non-NULL: kvq is NULL and the path stores and attends. */
    const lethe_kv_path *path;
    /* block-sparse prefill attention (lethe_attn_args.bsp) or NULL = dense */
    const lethe_block_sparse *bsp;
} lethe_layer_plan;

typedef struct lethe_fwd_hooks {
    void *ctx;
    /* required. q: backend activations [n_tokens, n_heads, head_dim] after RoPE,
     * for methods that select with the current query (read with act_to_host). */
    void (*plan_layer)(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                       lethe_layer_plan *out);
    /* optional: after the layer's attention ran; a = exactly what it read (q,
     * this layer's K/V cache, the plan's selections), valid during the call,
     * e.g. for sparse methods that score queries against keys (attn_scores). */
    void (*after_attn)(void *ctx, int32_t layer, const lethe_fwd_batch *b,
                       const lethe_attn_args *a);
} lethe_fwd_hooks;

typedef struct lethe_arch lethe_arch;

typedef struct lethe_model {
    lethe_model_config cfg;
    const lethe_arch *arch;
    lethe_backend *be;          /* not owned */
    lethe_weights w;
    char *path;                 /* owned copy */
    size_t matrix_bytes;        /* bytes of the weight matrices as the backend holds them
                                 * (stored formats or its weight type): what decode reads */
    /* per-layer KV cache buffers, allocated by the KV pool (kv/), not by the model */
    /* forward workspace, sized for n_tokens_max at lethe_model_workspace_init */
    int32_t n_tokens_max;
    void *ws;                   /* arch-private workspace struct */
    /* device-resident logits (lethe_model_workspace_init_dev): after a forward
     * with logits_out == NULL, logits_dev holds the b->n_logits rows
     * [n_logits, n_vocab] in backend activations, for ops->sample */
    int32_t n_logits_dev;
    void *logits_dev;
} lethe_model;

typedef enum lethe_load_format {
    LETHE_LOAD_AUTO = 0,        /* .gguf file -> gguf; folder with config.json -> hf */
    LETHE_LOAD_GGUF,
    LETHE_LOAD_HF,              /* config.json + *.safetensors (+ index) */
    LETHE_LOAD_DUMMY,           /* config.json only; weights from a seed */
} lethe_load_format;

typedef struct lethe_model_load_params {
    const char *path;           /* .gguf file, HF folder, or config.json / folder for dummy */
    lethe_load_format format;
    uint64_t seed;              /* dummy weights */
    bool progress;              /* progress bar on stderr while loading */
} lethe_model_load_params;

lethe_status lethe_load_format_parse(const char *s, lethe_load_format *out);

/* Loads config and weights into `be` (the tokenizer is loaded separately by
 * lethe_tokenizer_load, so the two modules do not depend on each other). On failure nothing stays
 * allocated and lethe_last_error() names the file and the problem. */
lethe_status lethe_model_load(const lethe_model_load_params *p, lethe_backend *be,
                              lethe_model *out);
void lethe_model_free(lethe_model *m); /* NULL-safe */

/* Allocates forward activations for up to n_tokens_max rows per call (frees a previous one). */
lethe_status lethe_model_workspace_init(lethe_model *m, int32_t n_tokens_max);
/* Same, and keeps room for n_logits_dev rows of logits on the device (0: only
 * the host path, whose lm_head runs in small row chunks). */
lethe_status lethe_model_workspace_init_dev(lethe_model *m, int32_t n_tokens_max,
                                            int32_t n_logits_dev);
/* One buffer of a family's forward workspace (arch_*.c, moe.c): be->ops->alloc,
 * and in host memory (LETHE_BE_HOST_MEMORY) written once now. Sized for the
 * largest step, an untouched buffer would join the process RSS page by page
 * whenever a step is longer than every step before, so the server's memory
 * would keep rising long after start-up; written here, it is resident from
 * the start and the RSS under load stays flat. */
lethe_status lethe_model_ws_alloc(lethe_backend *be, size_t n_bytes, void **out);
/* Frees the forward workspace (NULL-safe, idempotent); lethe_model_free calls it. */
void lethe_model_workspace_free(lethe_model *m);

/* Runs the forward pass; logits_out is HOST [b->n_logits, n_vocab] f32, or
 * NULL to leave the rows on the device in m->logits_dev (needs b->n_logits <=
 * m->n_logits_dev).
 * k_cache[l] / v_cache[l] are the per-layer KV buffers (backend memory). */
void lethe_model_forward(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                         void *const *v_cache, const lethe_fwd_hooks *hooks, float *logits_out);

/* Bytes of the per-layer state buffers of a linear-attention layer for
 * n_slots state slots: recurrent (k_cache) and conv (v_cache), f32. */
size_t lethe_model_state_rec_bytes(const lethe_model_config *c, int32_t n_slots);
size_t lethe_model_state_conv_bytes(const lethe_model_config *c, int32_t n_slots);

/* Families: one file each (arch_llama.c serves llama, qwen2, qwen3, qwen3_moe). */
struct lethe_arch {
    const char *names[8]; /* GGUF/HF spellings this family serves, NULL-terminated */
    /* checks config fields the family needs; names what is unsupported otherwise */
    lethe_status (*check)(const lethe_model_config *c);
    lethe_status (*workspace_init)(lethe_model *m, int32_t n_tokens_max);
    void (*workspace_free)(lethe_model *m);
    void (*forward)(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                    void *const *v_cache, const lethe_fwd_hooks *hooks, float *logits_out);
};

/* NULL (with a clear error set) when no family serves `arch`. */
const lethe_arch *lethe_arch_find(const char *arch);

#endif /* LETHE_MODEL_H */

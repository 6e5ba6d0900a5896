/* test_model_hf.c - the model forward on the CPU backend vs HF transformers.
 *
 * References come from tests/gen/gen_model_fixtures.py (format documented
 * there): fp32 eager transformers logits.
 *  - tiny-llama / tiny-qwen2 / tiny-qwen3 (HF safetensors checkpoints): full
 *    logits of 3 sequences. Each sequence runs alone in chunks (a prefix,
 *    then new chunks reading it from the KV cache), and all three run again
 *    together in one ragged batch; both must match HF (top-1 at every
 *    position, ||ours - ref|| / ||ref|| <= 1e-4) and be bit-identical to each
 *    other (the engine's batch-invariance promise).
 *  - tiny-qwen3-moe (routed experts, one dense layer): the same, plus 64 greedy
 *    tokens decoded one at a time vs HF generate; and the same checkpoint
 *    written as a qwen3moe GGUF with llama.cpp's names (stacked expert tensors).
 *  - tiny-glm4-moe-lite (latent attention, sigmoid group routing, a shared
 *    expert, an unused multi-token-prediction layer): the same three checks,
 *    the GGUF as llama.cpp's deepseek2, once with kv_b whole and once split
 *    into attn_k_b / attn_v_b as its converter writes it; and with the
 *    expanded (decompressed K / V) prefill forced, vs HF and vs the absorbed form.
 *  - tiny-qwen3_5 (hybrid: Gated DeltaNet + gated attention with partial
 *    RoPE, zero-centred norms, the multimodal layout with a vision tensor to
 *    skip): the short sequences split at 7/16 and at 64 tokens vs HF and
 *    bit-identical batched; a 2,000-token sequence (32 delta-rule chunks):
 *    top-1 everywhere, rel err, one call == chunks of 512; 64 greedy tokens
 *    after it and after seq0 (the one-step decode update) vs HF generate.
 *  - SmolLM2-135M-Instruct (the default GGUF, Q4_1 blocks kept as stored;
 *    first checked bit-identical to the same file dequantized at load): 3 chat
 *    prompts, one of 2,200 tokens, prefilled in chunks of up to 512 tokens:
 *    top-1 at every position (a mismatch is tolerated only where HF's top-2
 *    gap is a near-tie < 1e-3 and ours agrees it is one), relative error over
 *    the stored top-k logits + the full last-position logits <= 1e-4, and
 *    64 greedy tokens decoded one at a time reusing the KV cache (the three
 *    prompts together, a ragged decode batch), identical to HF generate.
 * KV layout here: a dense contiguous cache, slot = position; the selection of
 * each sequence is every slot 0..pos (what the dense method selects). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"
#include "gguf_writer.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test.h"

/* ---- reference files ("named arrays", see gen_model_fixtures.py) --------------- */

typedef struct ref_array {
    char name[64];
    uint32_t dtype; /* 0 f32, 1 i32 */
    uint32_t ndim, shape[4];
    size_t n;
    const void *data; /* 4-byte aligned copy (owned): the file packs arrays unaligned */
} ref_array;

typedef struct ref_file {
    char *buf;
    int n;
    ref_array arr[64];
} ref_file;

static void ref_load(ref_file *f, const char *path) {
    size_t len = 0;
    CHECK_MSG(lethe_read_file(path, &f->buf, &len) == LETHE_OK, "%s", lethe_last_error());
    CHECK_MSG(len >= 12 && !memcmp(f->buf, "LTHREF01", 8), "%s: bad magic", path);
    const char *p = f->buf + 8, *end = f->buf + len;
    uint32_t n;
    memcpy(&n, p, 4), p += 4;
    CHECK(n <= 64);
    for (uint32_t i = 0; i < n; i++) {
        ref_array *a = &f->arr[i];
        uint32_t nl;
        memcpy(&nl, p, 4), p += 4;
        CHECK(nl < sizeof(a->name) && p + nl + 8 <= end);
        memcpy(a->name, p, nl), a->name[nl] = 0, p += nl;
        memcpy(&a->dtype, p, 4), memcpy(&a->ndim, p + 4, 4), p += 8;
        CHECK(a->ndim <= 4 && a->dtype <= 1);
        a->n = 1;
        for (uint32_t d = 0; d < a->ndim; d++) memcpy(&a->shape[d], p, 4), p += 4, a->n *= a->shape[d];
        CHECK(p + a->n * 4 <= end);
        void *copy = lethe_xmalloc(a->n * 4);
        memcpy(copy, p, a->n * 4);
        a->data = copy, p += a->n * 4;
    }
    f->n = (int)n;
}

static void ref_free(ref_file *f) {
    for (int i = 0; i < f->n; i++) free((void *)f->arr[i].data);
    free(f->buf);
}

static const ref_array *ref_get(const ref_file *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->arr[i].name, name)) return &f->arr[i];
    CHECK_MSG(0, "reference array %s missing", name);
    return NULL;
}

/* ---- a model with a dense contiguous KV cache ------------------------------------- */

#define HARNESS_STATES 8

typedef struct harness {
    lethe_backend *be;
    lethe_model m;
    int32_t n_slots;
    void **k, **v;        /* per-layer caches [n_slots, kv_dim]; linear-attention layers:
                           * their recurrent / conv states [HARNESS_STATES] */
    int32_t state_slots[8]; /* sequence s of a batch owns state slot s */
    /* the plan of the current forward (same for every layer) */
    int32_t *store, *sel, sel_begin[8];
} harness;

static void plan_layer(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                       lethe_layer_plan *out) {
    harness *h = ctx;
    out->store_slots = h->store;
    out->sel_begin = h->sel_begin;
    out->sel_slots = h->sel;
}

static void harness_open_w(harness *h, const char *path, int32_t n_slots, int32_t n_tokens_max,
                           int cpu_weights) {
    memset(h, 0, sizeof(*h));
    lethe_backend_params bp = {.device = "cpu", .n_threads = 0, .cpu_weights = cpu_weights};
    CHECK(lethe_backend_cpu_create(&bp, &h->be) == LETHE_OK);
    lethe_model_load_params lp = {.path = path, .format = LETHE_LOAD_AUTO};
    CHECK_MSG(lethe_model_load(&lp, h->be, &h->m) == LETHE_OK, "%s: %s", path, lethe_last_error());
    CHECK(lethe_model_workspace_init(&h->m, n_tokens_max) == LETHE_OK);
    const lethe_model_config *c = &h->m.cfg;
    size_t kv_bytes = (size_t)n_slots * c->n_kv_heads * c->head_dim * h->be->ops->kv_size;
    h->n_slots = n_slots;
    h->k = lethe_xcalloc(c->n_layers, sizeof(void *));
    h->v = lethe_xcalloc(c->n_layers, sizeof(void *));
    for (int l = 0; l < c->n_layers; l++) {
        const bool lin = lethe_layer_is_linear(c, l);
        CHECK(h->be->ops->alloc(h->be, lin ? lethe_model_state_rec_bytes(c, HARNESS_STATES) : kv_bytes,
                                &h->k[l]) == LETHE_OK);
        CHECK(h->be->ops->alloc(h->be, lin ? lethe_model_state_conv_bytes(c, HARNESS_STATES) : kv_bytes,
                                &h->v[l]) == LETHE_OK);
    }
    for (int s = 0; s < 8; s++) h->state_slots[s] = s;
    h->store = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    h->sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
}

static void harness_open(harness *h, const char *path, int32_t n_slots, int32_t n_tokens_max) {
    /* exact: stored-format weights, f32 activations (bit-identical to fp32) */
    harness_open_w(h, path, n_slots, n_tokens_max, LETHE_CPU_WEIGHTS_EXACT);
}

static void harness_close(harness *h) {
    for (int l = 0; l < h->m.cfg.n_layers; l++) {
        h->be->ops->release(h->be, h->k[l]);
        h->be->ops->release(h->be, h->v[l]);
    }
    free(h->k), free(h->v), free(h->store), free(h->sel);
    lethe_model_free(&h->m);
    h->be->ops->destroy(h->be);
}

/* One forward of several sequences: sequence s feeds tokens[s][start[s] .. start[s]+len[s])
 * at positions start[s].., its KV living in slots base[s] + position. Logits of every row. */
static void run_batch(harness *h, int n_seqs, const int32_t *const *tokens, const int32_t *start,
                      const int32_t *len, const int32_t *base, float *logits) {
    int32_t n = 0, seq_begin[8] = {0};
    for (int s = 0; s < n_seqs; s++) n += len[s];
    int32_t *tok = lethe_xmalloc((size_t)n * 4), *pos = lethe_xmalloc((size_t)n * 4);
    int32_t *rows = lethe_xmalloc((size_t)n * 4);
    int32_t r = 0, e = 0;
    h->sel_begin[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        for (int32_t i = 0; i < len[s]; i++, r++) {
            tok[r] = tokens[s][start[s] + i];
            pos[r] = start[s] + i;
            h->store[r] = base[s] + start[s] + i;
            rows[r] = r;
        }
        seq_begin[s + 1] = r;
        for (int32_t p = 0; p < start[s] + len[s]; p++) h->sel[e++] = base[s] + p;
        h->sel_begin[s + 1] = e;
        CHECK(e <= h->n_slots);
    }
    lethe_fwd_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .n_seqs = n_seqs,
                         .seq_begin = seq_begin, .n_logits = n, .logit_rows = rows,
                         .state_slots = h->m.cfg.n_linear_layers > 0 ? h->state_slots : NULL};
    lethe_fwd_hooks hooks = {.ctx = h, .plan_layer = plan_layer};
    lethe_model_forward(&h->m, &b, h->k, h->v, &hooks, logits);
    free(tok), free(pos), free(rows);
}

static int32_t argmax_row(const float *l, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (l[i] > l[best]) best = i;
    return best;
}

/* ---- tiny checkpoints ------------------------------------------------------------- */

static void check_tiny_at(const char *family, const char *path);
static void check_tiny(const char *family) {
    char path[256];
    snprintf(path, sizeof(path), "tests/data/tiny-%s", family);
    check_tiny_at(family, path);
}

static void check_tiny_at(const char *family, const char *path) {
    char ref_path[256];
    snprintf(ref_path, sizeof(ref_path), "tests/data/hf-ref/tiny-%s.bin", family);
    ref_file rf;
    ref_load(&rf, ref_path);
    harness h;
    harness_open(&h, path, 3 * 128, 160);
    const int32_t V = h.m.cfg.n_vocab;
    const int32_t *tokens[3];
    int32_t T[3], total = 0;
    const float *ref[3];
    for (int s = 0; s < 3; s++) {
        char name[32];
        snprintf(name, sizeof(name), "seq%d.tokens", s);
        const ref_array *a = ref_get(&rf, name);
        tokens[s] = a->data, T[s] = (int32_t)a->n, total += T[s];
        snprintf(name, sizeof(name), "seq%d.logits", s);
        a = ref_get(&rf, name);
        CHECK(a->shape[0] == (uint32_t)T[s] && a->shape[1] == (uint32_t)V);
        ref[s] = a->data;
    }
    /* (a) each sequence alone, chunks of 7 then 16 tokens */
    float *alone = lethe_xmalloc((size_t)total * V * 4), *out = alone;
    for (int s = 0; s < 3; s++) {
        for (int32_t at = 0; at < T[s];) {
            int32_t len = LETHE_MIN(at == 0 ? 7 : 16, T[s] - at), base = 0;
            run_batch(&h, 1, &tokens[s], &at, &len, &base, out + (size_t)at * V);
            at += len;
        }
        for (int32_t i = 0; i < T[s]; i++)
            CHECK_MSG(argmax_row(out + (size_t)i * V, V) == argmax_row(ref[s] + (size_t)i * V, V),
                      "%s seq %d pos %d: top-1 differs", family, s, i);
        double err = rel_err(out, ref[s], (size_t)T[s] * V);
        fprintf(stderr, "    %s seq %d (%d tokens): rel err %.2e\n", family, s, T[s], err);
        CHECK_MSG(err <= 1e-4, "%s seq %d: rel err %g", family, s, err);
        out += (size_t)T[s] * V;
    }
    /* (b) all three in one ragged batch, separate slot ranges: bit-identical */
    float *batched = lethe_xmalloc((size_t)total * V * 4);
    int32_t start[3] = {0, 0, 0}, base[3] = {0, 128, 256};
    run_batch(&h, 3, tokens, start, T, base, batched);
    CHECK_MSG(!memcmp(batched, alone, (size_t)total * V * 4), "%s: batched != alone", family);
    free(alone), free(batched);
    ref_free(&rf);
    harness_close(&h);
}

/* greedy continuation of seq0, one token per forward reusing the KV cache, vs HF generate */
static void check_tiny_greedy(const char *family) {
    char path[256], ref_path[256];
    snprintf(path, sizeof(path), "tests/data/tiny-%s", family);
    snprintf(ref_path, sizeof(ref_path), "tests/data/hf-ref/tiny-%s.bin", family);
    ref_file rf;
    ref_load(&rf, ref_path);
    const ref_array *tok_a = ref_get(&rf, "seq0.tokens"), *want = ref_get(&rf, "greedy");
    const ref_array *gap = ref_get(&rf, "greedy_gap");
    const int32_t T = (int32_t)tok_a->n, G = (int32_t)want->n;
    harness h;
    harness_open(&h, path, T + G, 160);
    const int32_t V = h.m.cfg.n_vocab;
    int32_t *seq = lethe_xmalloc((size_t)(T + G) * 4);
    memcpy(seq, tok_a->data, (size_t)T * 4);
    float *logits = lethe_xmalloc((size_t)T * V * 4);
    const int32_t *tp = seq;
    int32_t at = 0, len = T, base = 0;
    run_batch(&h, 1, &tp, &at, &len, &base, logits);
    seq[T] = argmax_row(logits + (size_t)(T - 1) * V, V);
    for (int32_t g = 1; g < G; g++) {
        at = T + g - 1, len = 1;
        run_batch(&h, 1, &tp, &at, &len, &base, logits);
        seq[T + g] = argmax_row(logits, V);
    }
    const int32_t *w = want->data;
    const float *gp = gap->data;
    for (int32_t g = 0; g < G; g++)
        CHECK_MSG(seq[T + g] == w[g], "%s: greedy token %d is %d, HF %d (HF gap %g)", family, g,
                  seq[T + g], w[g], gp[g]);
    fprintf(stderr, "    %s: %d greedy tokens identical to HF\n", family, G);
    free(seq), free(logits);
    ref_free(&rf);
    harness_close(&h);
}

/* ---- the same checkpoint as a GGUF file with llama.cpp's tensor names ---------------- */

/* HF tensor suffix (after model.layers.<l>.) -> GGUF suffix (after blk.<l>.) */
static const char *const g_gguf_names[][2] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate.weight", "ffn_gate_inp.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
    {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
    {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
    {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
    {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
    {"self_attn.kv_b_proj.weight", "attn_kv_b.weight"},
    {"mlp.gate.e_score_correction_bias", "exp_probs_b.bias"},
    {"mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
    {"mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
    {"mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
};

/* Writes hf_dir's f32 tensors as a GGUF of architecture `arch` (qwen3moe, or
 * deepseek2 for glm4_moe_lite with its MLA and routing keys), routed experts
 * stacked into blk.<l>.ffn_{gate,up,down}_exps [E, rows, cols], as llama.cpp's
 * converter lays them out; tensors of layers past n_layers (multi-token
 * prediction) are left out. kv_split (MLA): kv_b is written the way llama.cpp's
 * converter writes it for absorbed attention, split per head into attn_k_b
 * [H, C, Nd] (W_kb transposed) and attn_v_b [H, Vd, C], with no attn_kv_b, and
 * that converter's metadata for such files (key_length C + R, value_length C,
 * the head's own sizes in key_length_mla / value_length_mla, head_count_kv 1).
 * Returns the file path (caller frees). */
static char *write_moe_gguf(const char *hf_dir, const char *arch, bool kv_split) {
    char cp[256];
    snprintf(cp, sizeof(cp), "%s/config.json", hf_dir);
    lethe_model_config c;
    CHECK_MSG(lethe_hf_config_load(cp, &c) == LETHE_OK, "%s", lethe_last_error());
    lethe_safetensors st;
    CHECK_MSG(lethe_st_open_dir(hf_dir, &st) == LETHE_OK, "%s", lethe_last_error());
    gw w = {0};
    char key[128];
#define KEY(suffix) (snprintf(key, sizeof(key), "%s." suffix, arch), key)
    gw_kv_str(&w, "general.architecture", arch);
    gw_kv_u32(&w, KEY("embedding_length"), (uint32_t)c.dim);
    gw_kv_u32(&w, KEY("block_count"), (uint32_t)c.n_layers);
    gw_kv_u32(&w, KEY("attention.head_count"), (uint32_t)c.n_heads);
    if (c.kv_lora_rank == 0) { /* MLA spells its own below (head_dim is the latent slot) */
        gw_kv_u32(&w, KEY("attention.head_count_kv"), (uint32_t)c.n_kv_heads);
        gw_kv_u32(&w, KEY("attention.key_length"), (uint32_t)c.head_dim);
    }
    gw_kv_u32(&w, KEY("context_length"), (uint32_t)c.max_pos);
    gw_kv_u32(&w, KEY("feed_forward_length"), (uint32_t)c.ffn_dim);
    gw_kv_u32(&w, KEY("expert_count"), (uint32_t)c.n_experts);
    gw_kv_u32(&w, KEY("expert_used_count"), (uint32_t)c.n_experts_used);
    gw_kv_u32(&w, KEY("expert_feed_forward_length"), (uint32_t)c.moe_ffn_dim);
    gw_kv_u32(&w, KEY("vocab_size"), (uint32_t)c.n_vocab);
    gw_kv_f32(&w, KEY("attention.layer_norm_rms_epsilon"), c.rms_eps);
    gw_kv_f32(&w, KEY("rope.freq_base"), c.rope.theta);
    if (c.kv_lora_rank > 0) {
        gw_kv_u32(&w, KEY("attention.q_lora_rank"), (uint32_t)c.q_lora_rank);
        gw_kv_u32(&w, KEY("attention.kv_lora_rank"), (uint32_t)c.kv_lora_rank);
        const uint32_t kl = (uint32_t)(c.qk_nope_dim + c.qk_rope_dim), vl = (uint32_t)c.v_head_dim;
        if (kv_split) {
            gw_kv_u32(&w, KEY("attention.key_length"), (uint32_t)c.head_dim);
            gw_kv_u32(&w, KEY("attention.value_length"), (uint32_t)c.kv_lora_rank);
            gw_kv_u32(&w, KEY("attention.key_length_mla"), kl);
            gw_kv_u32(&w, KEY("attention.value_length_mla"), vl);
        } else {
            gw_kv_u32(&w, KEY("attention.key_length"), kl);
            gw_kv_u32(&w, KEY("attention.value_length"), vl);
        }
        gw_kv_u32(&w, KEY("rope.dimension_count"), (uint32_t)c.qk_rope_dim);
        gw_kv_u32(&w, KEY("attention.head_count_kv"), kv_split ? 1u : (uint32_t)c.n_heads);
        gw_kv_u32(&w, KEY("expert_shared_count"), (uint32_t)c.n_shared_experts);
        gw_kv_u32(&w, KEY("leading_dense_block_count"), (uint32_t)c.moe_first_layer);
        gw_kv_f32(&w, KEY("expert_weights_scale"), c.moe_scale);
        gw_kv_bool(&w, KEY("expert_weights_norm"), c.moe_norm_topk);
        gw_kv_u32(&w, KEY("expert_gating_func"), c.moe_scoring == LETHE_MOE_SIGMOID ? 2 : 1);
        gw_kv_u32(&w, KEY("expert_group_count"), (uint32_t)c.moe_n_group);
        gw_kv_u32(&w, KEY("expert_group_used_count"), (uint32_t)c.moe_topk_group);
        gw_kv_u32(&w, KEY("nextn_predict_layers"), (uint32_t)c.n_nextn_layers);
    }
#undef KEY
    float **bufs = lethe_xcalloc((size_t)st.n_tensors + 4 * (size_t)c.n_layers, sizeof(float *));
    int nb = 0;
    const size_t E = (size_t)c.n_experts, F = (size_t)c.moe_ffn_dim, D = (size_t)c.dim;
    for (size_t i = 0; i < st.n_tensors; i++) {
        const lethe_st_tensor *t = &st.tensors[i];
        char name[160] = "";
        int l = -1, e = -1, used = 0;
        char rest[128], proj[32];
        if (!strcmp(t->name, "model.embed_tokens.weight"))
            snprintf(name, sizeof(name), "token_embd.weight");
        else if (!strcmp(t->name, "model.norm.weight"))
            snprintf(name, sizeof(name), "output_norm.weight");
        else if (!strcmp(t->name, "lm_head.weight")) snprintf(name, sizeof(name), "output.weight");
        else if (sscanf(t->name, "model.layers.%d.mlp.experts.%d.%31[a-z_].weight%n", &l, &e, proj,
                        &used) == 3) {
            continue; /* stacked below */
        } else if (sscanf(t->name, "model.layers.%d.%127s", &l, rest) == 2) {
            if (l >= c.n_layers) continue; /* multi-token prediction: not for generation */
            if (kv_split && !strcmp(rest, "self_attn.kv_b_proj.weight")) {
                /* [H * (Nd + Vd), C] -> k_b [H, C, Nd] (transposed), v_b [H, Vd, C] */
                const size_t H = (size_t)c.n_heads, C = (size_t)c.kv_lora_rank;
                const size_t Nd = (size_t)c.qk_nope_dim, Vd = (size_t)c.v_head_dim;
                CHECK(t->n_elems == H * (Nd + Vd) * C);
                float *kv = lethe_xmalloc(t->n_elems * sizeof(float));
                CHECK(lethe_st_to_f32(&st, t, kv) == LETHE_OK);
                float *kb = bufs[nb++] = lethe_xmalloc(H * C * Nd * sizeof(float));
                float *vb = bufs[nb++] = lethe_xmalloc(H * Vd * C * sizeof(float));
                for (size_t h = 0; h < H; h++) {
                    const float *blk = kv + h * (Nd + Vd) * C;
                    for (size_t i = 0; i < Nd; i++)
                        for (size_t j = 0; j < C; j++) kb[(h * C + j) * Nd + i] = blk[i * C + j];
                    memcpy(vb + h * Vd * C, blk + Nd * C, Vd * C * sizeof(float));
                }
                free(kv);
                char kn[64], vn[64];
                snprintf(kn, sizeof(kn), "blk.%d.attn_k_b.weight", l);
                snprintf(vn, sizeof(vn), "blk.%d.attn_v_b.weight", l);
                const uint64_t ke[3] = {Nd, C, H}, ve[3] = {C, Vd, H};
                gw_tensor_add(&w, kn, 0, 3, ke, kb, H * C * Nd * sizeof(float));
                gw_tensor_add(&w, vn, 0, 3, ve, vb, H * Vd * C * sizeof(float));
                continue;
            }
            for (size_t k = 0; k < LETHE_ARRAY_LEN(g_gguf_names); k++)
                if (!strcmp(rest, g_gguf_names[k][0]))
                    snprintf(name, sizeof(name), "blk.%d.%s", l, g_gguf_names[k][1]);
        }
        CHECK_MSG(name[0], "no GGUF name for %s", t->name);
        float *f = bufs[nb++] = lethe_xmalloc(t->n_elems * sizeof(float));
        CHECK(lethe_st_to_f32(&st, t, f) == LETHE_OK);
        uint64_t ne[2] = {(uint64_t)t->shape[t->n_dims - 1],
                          t->n_dims == 2 ? (uint64_t)t->shape[0] : 1};
        gw_tensor_add(&w, name, 0 /* F32 */, (uint32_t)t->n_dims, ne, f,
                      t->n_elems * sizeof(float));
    }
    static const char *const projs[3][2] = {
        {"gate_proj", "ffn_gate_exps"}, {"up_proj", "ffn_up_exps"}, {"down_proj", "ffn_down_exps"}};
    for (int32_t l = 0; l < c.n_layers; l++) {
        if (!lethe_layer_is_moe(&c, l)) continue;
        for (int p = 0; p < 3; p++) {
            const uint64_t rows = p == 2 ? D : F, cols = p == 2 ? F : D;
            float *f = bufs[nb++] = lethe_xmalloc(E * rows * cols * sizeof(float));
            for (size_t e = 0; e < E; e++) {
                char hn[128];
                snprintf(hn, sizeof(hn), "model.layers.%d.mlp.experts.%zu.%s.weight", l, e,
                         projs[p][0]);
                const lethe_st_tensor *t = lethe_st_find(&st, hn);
                CHECK_MSG(t && t->n_elems == rows * cols, "%s", hn);
                CHECK(lethe_st_to_f32(&st, t, f + e * rows * cols) == LETHE_OK);
            }
            char gn[64];
            snprintf(gn, sizeof(gn), "blk.%d.%s.weight", l, projs[p][1]);
            uint64_t ne[3] = {cols, rows, E};
            gw_tensor_add(&w, gn, 0, 3, ne, f, E * rows * cols * sizeof(float));
        }
    }
    size_t n;
    uint8_t *data = gw_build(&w, &n);
    char *path = tmp_write(data, n, ".gguf");
    free(data);
    for (int i = 0; i < nb; i++) free(bufs[i]);
    free(bufs);
    gw_free(&w);
    lethe_st_close(&st);
    return path;
}

static void test_tiny_qwen3_moe_gguf(void) {
    char *path = write_moe_gguf("tests/data/tiny-qwen3-moe", "qwen3moe", false);
    check_tiny_at("qwen3-moe", path);
    unlink(path);
    free(path);
}

static void test_tiny_glm4_moe_lite(void) {
    check_tiny("glm4-moe-lite");
    check_tiny_greedy("glm4-moe-lite");
}

static void test_tiny_glm4_moe_lite_gguf(void) {
    char *path = write_moe_gguf("tests/data/tiny-glm4-moe-lite", "deepseek2", false);
    check_tiny_at("glm4-moe-lite", path);
    unlink(path);
    free(path);
}

/* latent attention's expanded prefill forced (every step with more than one
 * query per sequence): vs HF and batch-invariant as the absorbed form, the
 * greedy continuation (prefill expanded, decode absorbed) as HF's; then the
 * 70-token sequence both ways: a different computation (not bit-identical)
 * of the same logits (rel <= 1e-5) */
static void test_tiny_glm4_moe_lite_expanded(void) {
    setenv("LETHE_MLA_EXPAND_MIN_Q", "1", 1);
    check_tiny("glm4-moe-lite");
    check_tiny_greedy("glm4-moe-lite");
    ref_file rf;
    ref_load(&rf, "tests/data/hf-ref/tiny-glm4-moe-lite.bin");
    const ref_array *ta = ref_get(&rf, "seq2.tokens");
    const int32_t *tokens = ta->data, T = (int32_t)ta->n, start = 0, base = 0;
    float *out[2] = {NULL, NULL};
    for (int mode = 0; mode < 2; mode++) {
        setenv("LETHE_MLA_EXPAND_MIN_Q", mode ? "1" : "0", 1);
        harness h;
        harness_open(&h, "tests/data/tiny-glm4-moe-lite", 128, 128);
        out[mode] = lethe_xmalloc((size_t)T * h.m.cfg.n_vocab * 4);
        run_batch(&h, 1, &tokens, &start, &T, &base, out[mode]);
        if (mode) {
            const size_t n = (size_t)T * h.m.cfg.n_vocab;
            double e = rel_err(out[1], out[0], n);
            fprintf(stderr, "    expanded vs absorbed (%d tokens): rel err %.2e\n", T, e);
            CHECK_MSG(memcmp(out[0], out[1], n * 4) != 0, "expanded form did not run");
            CHECK_MSG(e <= 1e-5, "expanded vs absorbed: rel err %g", e);
        }
        harness_close(&h);
    }
    unsetenv("LETHE_MLA_EXPAND_MIN_Q");
    free(out[0]), free(out[1]);
    ref_free(&rf);
}

/* kv_b stored as llama.cpp's attn_k_b / attn_v_b pair */
static void test_tiny_glm4_moe_lite_gguf_kv_split(void) {
    char *path = write_moe_gguf("tests/data/tiny-glm4-moe-lite", "deepseek2", true);
    check_tiny_at("glm4-moe-lite", path);
    unlink(path);
    free(path);
}

static void test_tiny_llama(void) { check_tiny("llama"); }
static void test_tiny_qwen3_moe(void) {
    check_tiny("qwen3-moe");
    check_tiny_greedy("qwen3-moe");
}
static void test_tiny_qwen2(void) { check_tiny("qwen2"); }
static void test_tiny_qwen3(void) { check_tiny("qwen3"); }

/* ---- hybrid linear attention (qwen3_5) --------------------------------------------- */

/* The three short sequences: (a) alone in chunks of 7 then 16 tokens (the
 * DeltaNet state and conv state carried across calls, a chunk boundary of
 * the delta rule inside a call) vs HF; (b) alone in chunks of 64 and (c) all
 * three in one ragged batch: bit-identical to each other (calls split at
 * multiples of LETHE_GDN_CHUNK run the same arithmetic) and to HF. */
static void test_tiny_qwen3_5(void) {
    ref_file rf;
    ref_load(&rf, "tests/data/hf-ref/tiny-qwen3_5.bin");
    harness h;
    harness_open(&h, "tests/data/tiny-qwen3_5", 3 * 128, 160);
    const lethe_model_config *c = &h.m.cfg;
    CHECK(c->n_linear_layers == 3 && !lethe_layer_is_linear(c, 2) && c->rope.rot_dim == 8);
    CHECK(h.m.w.layers[0].wq == NULL && h.m.w.layers[2].wq_gate != NULL);
    const int32_t V = c->n_vocab;
    const int32_t *tokens[3];
    int32_t T[3], total = 0;
    const float *ref[3];
    for (int s = 0; s < 3; s++) {
        char name[32];
        snprintf(name, sizeof(name), "seq%d.tokens", s);
        const ref_array *a = ref_get(&rf, name);
        tokens[s] = a->data, T[s] = (int32_t)a->n, total += T[s];
        snprintf(name, sizeof(name), "seq%d.logits", s);
        ref[s] = ref_get(&rf, name)->data;
    }
    float *split = lethe_xmalloc((size_t)total * V * 4), *alone = lethe_xmalloc((size_t)total * V * 4);
    for (int pass = 0; pass < 2; pass++) {
        float *out = pass ? alone : split;
        for (int s = 0; s < 3; s++) {
            for (int32_t at = 0; at < T[s];) {
                int32_t len = LETHE_MIN(pass ? LETHE_GDN_CHUNK : at == 0 ? 7 : 16, T[s] - at);
                int32_t base = 0;
                run_batch(&h, 1, &tokens[s], &at, &len, &base, out + (size_t)at * V);
                at += len;
            }
            for (int32_t i = 0; i < T[s]; i++)
                CHECK_MSG(argmax_row(out + (size_t)i * V, V) == argmax_row(ref[s] + (size_t)i * V, V),
                          "qwen3_5 seq %d pos %d: top-1 differs", s, i);
            double err = rel_err(out, ref[s], (size_t)T[s] * V);
            fprintf(stderr, "    qwen3_5 seq %d (%d tokens, chunks of %s): rel err %.2e\n", s, T[s],
                    pass ? "64" : "7/16", err);
            CHECK_MSG(err <= 1e-4, "qwen3_5 seq %d: rel err %g", s, err);
            out += (size_t)T[s] * V;
        }
    }
    float *batched = lethe_xmalloc((size_t)total * V * 4);
    int32_t start[3] = {0, 0, 0}, base[3] = {0, 128, 256};
    run_batch(&h, 3, tokens, start, T, base, batched);
    CHECK_MSG(!memcmp(batched, alone, (size_t)total * V * 4), "qwen3_5: batched != alone");
    free(split), free(alone), free(batched);
    ref_free(&rf);
    harness_close(&h);
}

/* Greedy decode of `n_gen` tokens after tokens[0..T) (prefilled in chunks of
 * `chunk`), one token per forward through the one-step delta rule, vs HF. */
static void hybrid_greedy(harness *h, const int32_t *prompt, int32_t T, int32_t chunk,
                          const ref_array *want, const ref_array *gap, const char *what) {
    const int32_t V = h->m.cfg.n_vocab, G = (int32_t)want->n;
    int32_t *seq = lethe_xmalloc((size_t)(T + G) * 4);
    memcpy(seq, prompt, (size_t)T * 4);
    float *logits = lethe_xmalloc((size_t)chunk * V * 4);
    const int32_t *tp = seq;
    int32_t base = 0;
    for (int32_t at = 0; at < T;) {
        int32_t len = LETHE_MIN(chunk, T - at);
        run_batch(h, 1, &tp, &at, &len, &base, logits);
        at += len;
        if (at == T) seq[T] = argmax_row(logits + (size_t)(len - 1) * V, V);
    }
    for (int32_t g = 1; g < G; g++) {
        int32_t at = T + g - 1, len = 1;
        run_batch(h, 1, &tp, &at, &len, &base, logits);
        seq[T + g] = argmax_row(logits, V);
    }
    const int32_t *w = want->data;
    for (int32_t g = 0; g < G; g++)
        CHECK_MSG(seq[T + g] == w[g], "qwen3_5 %s: greedy token %d is %d, HF %d (HF gap %g)", what,
                  g, seq[T + g], w[g], ((const float *)gap->data)[g]);
    fprintf(stderr, "    qwen3_5 %s: %d greedy tokens identical to HF\n", what, G);
    free(seq), free(logits);
}

/* The 2,000-token sequence: prefilled in chunks of 512 (32 delta-rule chunks
 * in all), top-1 identical to HF at every position and rel err <= 1e-4 over
 * the stored rows; the same prompt in one call is bit-identical; then 64
 * greedy tokens after it and after seq0, identical to HF generate. */
static void test_tiny_qwen3_5_long(void) {
    ref_file rf;
    ref_load(&rf, "tests/data/hf-ref/tiny-qwen3_5.bin");
    const ref_array *tok_a = ref_get(&rf, "long.tokens"), *top1 = ref_get(&rf, "long.top1");
    const ref_array *gap = ref_get(&rf, "long.gap"), *pos_a = ref_get(&rf, "long.pos");
    const ref_array *lg = ref_get(&rf, "long.logits");
    const int32_t T = (int32_t)tok_a->n, P = (int32_t)pos_a->n, CH = 512;
    CHECK(T == 2000 && T > 30 * LETHE_GDN_CHUNK);
    harness h;
    harness_open(&h, "tests/data/tiny-qwen3_5", T + 64, T);
    const int32_t V = h.m.cfg.n_vocab;
    float *chunked = lethe_xmalloc((size_t)T * V * 4), *whole = lethe_xmalloc((size_t)T * V * 4);
    const int32_t *tp = tok_a->data;
    int32_t base = 0;
    for (int32_t at = 0; at < T;) {
        int32_t len = LETHE_MIN(CH, T - at);
        run_batch(&h, 1, &tp, &at, &len, &base, chunked + (size_t)at * V);
        at += len;
    }
    int32_t at = 0, len = T;
    run_batch(&h, 1, &tp, &at, &len, &base, whole);
    CHECK_MSG(!memcmp(chunked, whole, (size_t)T * V * 4), "qwen3_5 long: chunked != one call");
    const int32_t *r1 = top1->data, *pos = pos_a->data;
    float min_gap = 1e30f;
    for (int32_t i = 0; i < T; i++) {
        const int32_t t = argmax_row(chunked + (size_t)i * V, V);
        CHECK_MSG(t == r1[i], "qwen3_5 long pos %d: top-1 %d vs HF %d (HF gap %g)", i, t, r1[i],
                  ((const float *)gap->data)[i]);
        min_gap = LETHE_MIN(min_gap, ((const float *)gap->data)[i]);
    }
    float *ours = lethe_xmalloc((size_t)P * V * 4);
    for (int32_t i = 0; i < P; i++) memcpy(ours + (size_t)i * V, chunked + (size_t)pos[i] * V, (size_t)V * 4);
    double err = rel_err(ours, lg->data, (size_t)P * V);
    fprintf(stderr, "    qwen3_5 long: %d tokens, top-1 identical everywhere (HF min gap %.2e), "
            "rel err %.2e over %d rows\n", T, min_gap, err, P);
    CHECK_MSG(err <= 1e-4, "qwen3_5 long: rel err %g", err);
    hybrid_greedy(&h, tok_a->data, T, CH, ref_get(&rf, "long.greedy"), ref_get(&rf, "long.greedy_gap"),
                  "after 2,000 tokens");
    const ref_array *s0 = ref_get(&rf, "seq0.tokens");
    hybrid_greedy(&h, s0->data, (int32_t)s0->n, CH, ref_get(&rf, "greedy"), ref_get(&rf, "greedy_gap"),
                  "after seq0");
    free(chunked), free(whole), free(ours);
    ref_free(&rf);
    harness_close(&h);
}

/* ---- SmolLM2-135M ------------------------------------------------------------------ */

#define SMOL_CHUNK 512
#define SMOL_GEN 64

/* One prompt of the SmolLM2 reference, and our decode state for it. */
typedef struct smol_prompt {
    int32_t T, base;            /* prompt length, first KV slot */
    int32_t *seq;               /* [T + SMOL_GEN] prompt + our greedy tokens */
    const int32_t *want;        /* HF greedy [SMOL_GEN] */
    const float *want_gap;
} smol_prompt;

/* Prefill in chunks; checks top-1 everywhere and the relative error; sets seq[T]. */
static void smol_prefill(harness *h, const ref_file *rf, int p, smol_prompt *sp, float *logits) {
    const int32_t V = h->m.cfg.n_vocab;
    char name[64];
#define REF(field) (snprintf(name, sizeof(name), "p%d." field, p), ref_get(rf, name))
    const ref_array *tok_a = REF("tokens"), *top1 = REF("top1"), *gap = REF("gap");
    const ref_array *kpos = REF("topk_pos"), *kids = REF("topk_ids"), *kvals = REF("topk_vals");
    const ref_array *last = REF("last_logits"), *greedy = REF("greedy"), *ggap = REF("greedy_gap");
#undef REF
    const int32_t T = (int32_t)tok_a->n, K = (int32_t)kids->shape[1];
    CHECK(last->n == (size_t)V && greedy->n == SMOL_GEN);
    sp->T = T;
    sp->want = greedy->data;
    sp->want_gap = ggap->data;
    sp->seq = lethe_xmalloc((size_t)(T + SMOL_GEN) * 4);
    memcpy(sp->seq, tok_a->data, (size_t)T * 4);
    const int32_t *ref_top1 = top1->data, *pos_k = kpos->data, *ids_k = kids->data;
    const float *gaps = gap->data, *vals_k = kvals->data;
    /* ours vs ref values at the stored top-k ids + the whole last row */
    float *ours_v = lethe_xmalloc(((size_t)kpos->n * K + V) * 4);
    float *ref_v = lethe_xmalloc(((size_t)kpos->n * K + V) * 4);
    size_t nv = 0;
    int32_t n_ties = 0, ki = 0;
    const int32_t first = T < 100 ? T / 2 : SMOL_CHUNK; /* short prompts: 2 chunks */
    double t0 = lethe_time_s();
    for (int32_t at = 0; at < T;) {
        int32_t len = LETHE_MIN(at == 0 ? first : SMOL_CHUNK, T - at);
        const int32_t *tp = sp->seq;
        run_batch(h, 1, &tp, &at, &len, &sp->base, logits);
        for (int32_t i = 0; i < len; i++) {
            const float *row = logits + (size_t)i * V;
            int32_t pos = at + i, top = argmax_row(row, V);
            if (top != ref_top1[pos]) {
                /* only a near-tie in HF that is a near-tie here too may flip */
                float d = row[top] - row[ref_top1[pos]];
                CHECK_MSG(gaps[pos] < 1e-3f && d < 2e-3f,
                          "prompt %d pos %d: top-1 %d vs HF %d (HF gap %g, ours %g)", p, pos, top,
                          ref_top1[pos], gaps[pos], d);
                n_ties++;
            }
            if (ki < (int32_t)kpos->n && pos_k[ki] == pos) {
                for (int32_t k = 0; k < K; k++) {
                    ours_v[nv] = row[ids_k[(size_t)ki * K + k]];
                    ref_v[nv++] = vals_k[(size_t)ki * K + k];
                }
                ki++;
            }
            if (pos == T - 1) {
                memcpy(ours_v + nv, row, (size_t)V * 4);
                memcpy(ref_v + nv, last->data, (size_t)V * 4);
                nv += V;
                sp->seq[T] = top; /* the first greedy token */
            }
        }
        at += len;
    }
    double dt = lethe_time_s() - t0;
    CHECK_EQ_INT(ki, kpos->n);
    double err = rel_err(ours_v, ref_v, nv);
    fprintf(stderr, "    prompt %d: %d tokens, prefill %.2fs (%.0f tok/s incl. all-row lm_head), "
            "rel err %.2e, near-tie flips %d\n", p, T, dt, T / dt, err, n_ties);
    CHECK_MSG(err <= 1e-4, "prompt %d: rel err %g", p, err);
    free(ours_v), free(ref_v);
}

static void test_smollm2(void) {
    ref_file rf;
    ref_load(&rf, "tests/data/hf-ref/smollm2-135m.bin");
    harness h;
    harness_open(&h, "models/SmolLM2-135M-Instruct.Q4_1.gguf", 2600, SMOL_CHUNK);
    const int32_t V = h.m.cfg.n_vocab;
    CHECK(V == 49152 && h.m.cfg.n_layers == 30);
    float *logits = lethe_xmalloc((size_t)SMOL_CHUNK * V * 4);
    /* KV regions: prompts 0 and 1 are short, prompt 2 has ~2,200 tokens */
    smol_prompt sp[3] = {{.base = 0}, {.base = 160}, {.base = 320}};
    for (int p = 0; p < 3; p++) smol_prefill(&h, &rf, p, &sp[p], logits);
    CHECK(sp[0].T + SMOL_GEN <= 160 && sp[1].T + SMOL_GEN <= 160 && 320 + sp[2].T + SMOL_GEN <= 2600);
    /* greedy decode of the three prompts together, one token each per forward */
    double t0 = lethe_time_s();
    for (int32_t g = 0; g < SMOL_GEN; g++) {
        for (int p = 0; p < 3; p++)
            CHECK_MSG(sp[p].seq[sp[p].T + g] == sp[p].want[g],
                      "prompt %d: greedy token %d is %d, HF %d (HF gap %g)", p, g,
                      sp[p].seq[sp[p].T + g], sp[p].want[g], sp[p].want_gap[g]);
        if (g == SMOL_GEN - 1) break;
        const int32_t *toks[3] = {sp[0].seq, sp[1].seq, sp[2].seq};
        int32_t start[3], len[3] = {1, 1, 1}, base[3];
        for (int p = 0; p < 3; p++) start[p] = sp[p].T + g, base[p] = sp[p].base;
        run_batch(&h, 3, toks, start, len, base, logits);
        for (int p = 0; p < 3; p++) sp[p].seq[sp[p].T + g + 1] = argmax_row(logits + (size_t)p * V, V);
    }
    double dt = lethe_time_s() - t0;
    fprintf(stderr, "    %d greedy tokens x 3 prompts identical to HF (batched decode, %.1f steps/s)\n",
            SMOL_GEN, (SMOL_GEN - 1) / dt);
    for (int p = 0; p < 3; p++) free(sp[p].seq);
    free(logits);
    ref_free(&rf);
    harness_close(&h);
}

/* The SmolLM2 GGUF with its Q4_1 blocks kept as stored and f32 activations
 * (--cpu-weights exact, used by test_smollm2) vs dequantized to f32 at load
 * (--cpu-weights fp32, the reference): prompt 1 prefilled in one chunk, then
 * 24 greedy steps; every logit row must be bit-identical (the stored-format
 * matmul's contract). */
static void test_smollm2_weight_paths(void) {
    ref_file rf;
    ref_load(&rf, "tests/data/hf-ref/smollm2-135m.bin");
    const ref_array *tok_a = ref_get(&rf, "p1.tokens");
    const int32_t T = (int32_t)tok_a->n, G = 24;
    harness hn, hf;
    harness_open_w(&hn, "models/SmolLM2-135M-Instruct.Q4_1.gguf", T + G, T,
                   LETHE_CPU_WEIGHTS_EXACT);
    harness_open_w(&hf, "models/SmolLM2-135M-Instruct.Q4_1.gguf", T + G, T, LETHE_CPU_WEIGHTS_FP32);
    CHECK(lethe_cpu_qweight_find(hn.be, hn.m.w.layers[0].wq) != NULL);
    CHECK(lethe_cpu_qweight_find(hf.be, hf.m.w.layers[0].wq) == NULL);
    const int32_t V = hn.m.cfg.n_vocab;
    float *ln = lethe_xmalloc((size_t)T * V * 4), *lf = lethe_xmalloc((size_t)T * V * 4);
    int32_t *seq = lethe_xmalloc((size_t)(T + G) * 4);
    memcpy(seq, tok_a->data, (size_t)T * 4);
    int32_t rows = 0, at = 0, len = T, base = 0;
    const int32_t *tp = seq;
    for (int32_t g = 0; g <= G; g++) {
        run_batch(&hn, 1, &tp, &at, &len, &base, ln);
        run_batch(&hf, 1, &tp, &at, &len, &base, lf);
        CHECK_MSG(!memcmp(ln, lf, (size_t)len * V * 4), "step %d: exact logits differ from fp32", g);
        rows += len;
        if (g == G) break;
        seq[at + len] = argmax_row(ln + (size_t)(len - 1) * V, V);
        at += len, len = 1;
    }
    fprintf(stderr, "    exact Q4_1 vs fp32: %d logit rows bit-identical\n", rows);
    free(ln), free(lf), free(seq);
    harness_close(&hn);
    harness_close(&hf);
    ref_free(&rf);
}

/* The default CPU path (--cpu-weights native: Q4_1 / Q8_0 blocks multiplied
 * with 16-bit activations, backend/cpu/qdot.h) against HF on the SmolLM2
 * fixtures: the three prompts (incl. the ~2,200-token one, in 512-token
 * chunks) prefilled; top-1 at every position must agree with HF's at >= 99%
 * of the positions, and the last row's logits stay within rel err 1e-3. */
static void test_smollm2_native(void) {
    ref_file rf;
    ref_load(&rf, "tests/data/hf-ref/smollm2-135m.bin");
    harness h;
    harness_open_w(&h, "models/SmolLM2-135M-Instruct.Q4_1.gguf", 2600, SMOL_CHUNK,
                   LETHE_CPU_WEIGHTS_NATIVE);
    const int32_t V = h.m.cfg.n_vocab;
    float *logits = lethe_xmalloc((size_t)SMOL_CHUNK * V * 4);
    int32_t agree = 0, total = 0, base = 0;
    double num = 0, den = 0;
    for (int p = 0; p < 3; p++) {
        char name[64];
        snprintf(name, sizeof(name), "p%d.tokens", p);
        const ref_array *tok_a = ref_get(&rf, name);
        snprintf(name, sizeof(name), "p%d.top1", p);
        const int32_t *top1 = ref_get(&rf, name)->data;
        snprintf(name, sizeof(name), "p%d.last_logits", p);
        const float *last = ref_get(&rf, name)->data;
        const int32_t T = (int32_t)tok_a->n, *seq = tok_a->data;
        CHECK(base + T <= 2600);
        for (int32_t at = 0; at < T;) {
            int32_t len = LETHE_MIN(SMOL_CHUNK, T - at);
            run_batch(&h, 1, &seq, &at, &len, &base, logits);
            for (int32_t i = 0; i < len; i++, total++)
                agree += argmax_row(logits + (size_t)i * V, V) == top1[at + i];
            if (at + len == T)
                for (int32_t k = 0; k < V; k++) {
                    const double d = logits[(size_t)(len - 1) * V + k] - last[k];
                    num += d * d, den += (double)last[k] * last[k];
                }
            at += len;
        }
        base += T;
    }
    const double rel = sqrt(num / den);
    fprintf(stderr, "    native (16-bit activations) vs HF: top-1 agreement %d/%d (%.2f%%), "
            "last-row logits rel err %.2e\n", agree, total, 100.0 * agree / total, rel);
    CHECK_MSG(agree * 100 >= total * 99, "top-1 agreement %d/%d < 99%%", agree, total);
    CHECK_MSG(rel <= 1e-3, "last-row logits rel err %g", rel);
    free(logits);
    ref_free(&rf);
    harness_close(&h);
}

int main(void) {
    TEST_RUN(test_smollm2_weight_paths);
    TEST_RUN(test_smollm2_native);
    TEST_RUN(test_tiny_llama);
    TEST_RUN(test_tiny_qwen2);
    TEST_RUN(test_tiny_qwen3);
    TEST_RUN(test_tiny_qwen3_moe);
    TEST_RUN(test_tiny_qwen3_moe_gguf);
    TEST_RUN(test_tiny_glm4_moe_lite);
    TEST_RUN(test_tiny_glm4_moe_lite_gguf);
    TEST_RUN(test_tiny_qwen3_5);
    TEST_RUN(test_tiny_qwen3_5_long);
    TEST_RUN(test_tiny_glm4_moe_lite_gguf_kv_split);
    TEST_RUN(test_tiny_glm4_moe_lite_expanded);
    TEST_RUN(test_smollm2);
    fprintf(stderr, "test_model_hf: ok\n");
    return 0;
}

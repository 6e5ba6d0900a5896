/* backend.h - the compute backend interface: an ops table + private state.
 *
 * The model forward (model/arch_*.c) is written once against these ops; the
 * CPU backend (backend/cpu/, fp32, the reference) and the CUDA backend
 * (backend/cuda/, bf16 weights, fp32 accumulation) implement them. Every op
 * has a CPU twin with the same name and a row in the CUDA comparison test.
 *
 * Memory model: pointers handed to ops (`void *`) are backend memory
 * ("device pointers"): activations in the backend's activation type
 * (ops->act_size bytes per element), weights in its weight type, KV in its KV
 * type. Index arrays (tokens, positions, slots, selections) are HOST int32
 * arrays, which a device backend stages itself, or int32 backend memory
 * (ops->alloc) that an op wrote (topk, select_expand): those are read where
 * they are, so a selection built on the device never visits the host. Only
 * the host-transfer ops move data between the two worlds.
 *
 * Layout conventions (row-major, last index fastest):
 *   activations x      [n_tokens, dim]
 *   q                  [n_tokens, n_heads, head_dim]
 *   k, v (new)         [n_tokens, n_kv_heads, head_dim]
 *   weight W           [out_dim, in_dim]  (HF nn.Linear layout; y = x W^T)
 *   KV cache per layer K, V: [n_slots, n_kv_heads, head_dim], a slot = one token
 *
 * Ops never allocate after init and never fail: invalid arguments are bugs
 * (asserted). Failures that can happen (allocation, device errors at init)
 * surface through alloc / weight_upload / the backend constructor. */
#ifndef LETHE_BACKEND_H
#define LETHE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/ggml_types.h"
#include "core/status.h"
#include "model/config.h"

typedef struct lethe_backend lethe_backend;

/* A weight matrix [rows, cols] in a stored element format: row r is the
 * lethe_ggml_type_size(type, cols) bytes at data + r * that (ops->weight_upload_raw). */
typedef struct lethe_weight_raw {
    lethe_ggml_type type;
    int64_t rows, cols;
    const void *data;
} lethe_weight_raw;
typedef struct lethe_sample_args lethe_sample_args; /* backend/sample.h */

/* ---- quantized KV storage ----
 * A KV layer is stored in one of these formats (the pool's, chosen by the
 * sparse method; src/kv/kv_pool.h). NATIVE: k_cache / v_cache hold the
 * backend's kv type (ops->kv_size bytes per element: f32 CPU, bf16 CUDA).
 *   FP8_E4M3  k_cache / v_cache: uint8 E4M3 codes [n_slots, n_kv_heads, head_dim]
 *             (src/backend/kv_codec.h), plus k_scale / v_scale: f32
 *             [n_slots, n_kv_heads] (amax / 448 of that token's head vector;
 *             x^ = e4m3(code) * scale). Backend memory, like the caches.
 *   KIVI      packed 2/4/8-bit codes + group params + full-precision residual (below).
 *   TURBOQUANT  packed b-bit Lloyd-Max codes of the rotated unit vector per
 *             (slot, KV head) [n_slots][n_kv_heads][head_dim b / 8] in k_cache /
 *             v_cache, fp16 norms k_norm / v_norm [n_slots, n_kv_heads], and
 *             the shared tables tq (rotation, codebook; src/backend/tq_codec.h). */
typedef enum lethe_kv_format {
    LETHE_KV_NATIVE = 0,
    LETHE_KV_FP8_E4M3 = 1,
    LETHE_KV_KIVI = 2,           /* kind; bits and group size ride in the value, see below */
    LETHE_KV_TURBOQUANT = 3,     /* kind; bits and rotation seed ride in the value */
    LETHE_KV_FORMAT_INT_ = 0x7fffffff, /* keeps the enum int-sized (KIVI packs fields) */
} lethe_kv_format;

/* KIVI (methods.md §15, src/backend/kv_codec.h), C = n_kv_heads * head_dim, b bits,
 * G tokens per K group = channels per V group. A KIVI format value is
 * LETHE_KV_KIVI_FORMAT(b, G); lethe_kv_format_kind() strips b and G.
 *   k_cache / v_cache  uint8 packed b-bit codes [n_slots][C b / 8] (element
 *                      i of a slot row at bit i b), meaningful once the slot's
 *                      group is complete;
 *   v_param            f32 [n_slots][2][C / G]: per-token V group scale, zero;
 *   k_group            f32 [n_groups][2][C]: per-channel K scale, zero of one
 *                      complete group of G tokens of a row (n_groups = n_slots / G);
 *   k_res / v_res      native kv type [n_res][C]: full-precision residual
 *                      (each row's incomplete tail group), n_res = res blocks * G;
 *   kivi               HOST step plan (below), shared by all layers.
 * Slot s reads: aux = kivi->slot_aux[s]; aux >= 0: codes of slot s with K group
 * entry aux and V params of slot s; aux < 0: residual entry -(1 + aux). */
#define LETHE_KV_KIVI_FORMAT(bits, group) \
    ((lethe_kv_format)(LETHE_KV_KIVI | ((bits) << 8) | ((group) << 16)))
static inline lethe_kv_format lethe_kv_format_kind(lethe_kv_format f) { return (lethe_kv_format)(f & 0xFF); }
static inline int32_t lethe_kv_kivi_bits(lethe_kv_format f) { return (int32_t)((f >> 8) & 0xFF); }
static inline int32_t lethe_kv_kivi_group(lethe_kv_format f) { return (int32_t)((f >> 16) & 0x7FFF); }
/* TURBOQUANT: LETHE_KV_TQ_FORMAT(b, seed), b in {2, 3, 4}, seed < 2^15 */
#define LETHE_KV_TQ_FORMAT(bits, seed) \
    ((lethe_kv_format)(LETHE_KV_TURBOQUANT | ((bits) << 8) | ((seed) << 16)))
static inline int32_t lethe_kv_tq_bits(lethe_kv_format f) { return (int32_t)((f >> 8) & 0xFF); }
static inline int32_t lethe_kv_tq_seed(lethe_kv_format f) { return (int32_t)((f >> 16) & 0x7FFF); }

/* What kv_store_quant does for KIVI this step (host memory, written by the
 * method in its prepare hook before the forward, same for every layer):
 * first the n_pack groups completed this step are quantized (member t of group
 * p: pack_src >= 0 = new token row i of this store's k / v, < 0 = residual
 * entry -(1 + r); its slot pack_slot; the group's K params go to k_group
 * entry pack_entry[p]); then every new token whose slot_aux is < 0 is written
 * to its residual entry. So residual entries a completed group frees can be
 * reused by the same step's newer tokens. */
typedef struct lethe_kivi_plan {
    int32_t *slot_aux;           /* [n_slots] */
    int32_t n_pack;
    const int32_t *pack_src;     /* [n_pack * G] */
    const int32_t *pack_slot;    /* [n_pack * G] */
    const int32_t *pack_entry;   /* [n_pack] */
} lethe_kivi_plan;

typedef struct lethe_kv_quant {
    lethe_kv_format format;
    void *k_scale, *v_scale;     /* FP8_E4M3: f32 [n_slots, n_kv_heads] backend memory */
    /* KIVI (backend memory, layouts above) */
    void *v_param, *k_group, *k_res, *v_res;
    int32_t n_groups, n_res;
    const lethe_kivi_plan *kivi;
    /* TURBOQUANT (backend memory): fp16 norms [n_slots, n_kv_heads]; tables
     * f32 [rot: hd x hd][rot^T: hd x hd][centroids: 16][bounds: 16] (rot[i][j]
     * row-major; rot^T for coalesced device reads), shared by all layers */
    void *k_norm, *v_norm;
    const float *tq;
} lethe_kv_quant;
/* offsets (floats) of the TURBOQUANT tables in lethe_kv_quant.tq */
static inline size_t lethe_tq_off_rot_t(int32_t hd) { return (size_t)hd * hd; }
static inline size_t lethe_tq_off_centroids(int32_t hd) { return 2u * (size_t)hd * hd; }
static inline size_t lethe_tq_off_bounds(int32_t hd) { return 2u * (size_t)hd * hd + 16u; }
static inline size_t lethe_tq_tables_floats(int32_t hd) { return 2u * (size_t)hd * hd + 32u; }

/* ---- KV payload layouts ----
 * What one slot of one layer holds, as a list of planes: plane i is a backend
 * buffer [n_slots][planes[i].slot_bytes] the KV pool allocates per layer.
 * Whoever decides the payload declares it: a sparse method (its kv_layout
 * hook: latents, codes, norms), a model (MLA: a latent + a RoPE key per
 * token), or the storage format (NATIVE: planes "k" and "v" of n_kv_heads x
 * head_dim kv elements; FP8 / KIVI: codes in planes 0 / 1 plus the side
 * arrays of lethe_kv_quant). The pool is sized by the planes' real bytes
 * summed over layers, so a smaller payload means more slots. A payload other
 * than the format's is written and read through a lethe_kv_path
 * (model/model.h), never by kv_store / attention directly. */
#define LETHE_KV_MAX_PLANES 6
typedef struct lethe_kv_plane {
    char name[16];               /* for messages: "k", "latent", "k_norm", ... */
    size_t slot_bytes;           /* bytes per slot of this layer (> 0) */
} lethe_kv_plane;
typedef struct lethe_kv_layout {
    int32_t n_planes;            /* 1 .. LETHE_KV_MAX_PLANES */
    lethe_kv_plane planes[LETHE_KV_MAX_PLANES];
} lethe_kv_layout;
/* bytes one slot of this layer costs (sum over planes) */
static inline size_t lethe_kv_layout_slot_bytes(const lethe_kv_layout *l) {
    size_t b = 0;
    for (int32_t i = 0; i < l->n_planes; i++) b += l->planes[i].slot_bytes;
    return b;
}

/* What one layer's attention reads, for every sequence of the step.
 *
 * For sequence s the query tokens are batch rows [q_begin[s], q_begin[s+1]) and
 * the keys are the slots sel_slots[sel_begin[s] .. sel_begin[s+1]). The LAST
 * n_q(s) entries of a sequence's selection are its new tokens, in order, so
 * causality is positional: query j (0-based within the sequence) attends to
 * selection entries [0, n_sel(s) - n_q(s) + j]. Dense attention selects every
 * resident slot; sparse methods pass subsets (ascending logical position). */
/* Block-sparse prefill attention (lethe_attn_args.bsp; methods.md §18.5
 * flashprefill). For a sequence with n_q >= min_q (shorter ones, decode rows
 * included, attend densely) let B = block: query block t = the sequence's
 * queries [tB, tB + B) (aligned at its first new token), key block b = its
 * selection entries [bB, bB + B) (aligned at entry 0). Per query head h:
 *   qm(t, h) = mean of q over the block's queries, km(b, g) = mean of K over
 *   the block's entries (g = h's KV head), for the blocks b that t's last
 *   query sees; s(b) = scale * qm . km, p_h(b) = softmax_b(s)[b];
 *   p(t, g, b) = max over the query heads of KV head g of p_h(b).
 * KV head g's queries of block t then read key block b when
 *   b < sink_blocks, or b is among the last window_blocks blocks t sees, or
 *   some query of t sees only part of b (the diagonal), or t is among the
 *   last last_q_blocks query blocks of the chunk and the chunk ends the
 *   prompt (prompt_end[s]; every chunk when prompt_end is NULL), or
 *   p(t, g, b) >= threshold;
 * inside a read block the usual causal rule holds. With mean_correction every
 * skipped block (all of it visible to all of t: never a diagonal block) adds
 * one pseudo-entry per query: key km(b, g), value vm(b, g) (the mean V) and
 * logit scale * q . km + ln(B), the block's B entries approximated by their
 * mean. threshold 0 reads every block: the output equals dense attention
 * exactly (the same operations in the same order on both backends). Native
 * KV only (no kvq, no head_sel, no latent KV: those paths ignore bsp; CUDA:
 * head_dim 64 / 128, the tensor-core kernel's shapes, others ignore it). */
typedef struct lethe_block_sparse {
    int32_t block;               /* B: 128 (the CUDA kernel's tile; CPU: a multiple of 32) */
    int32_t sink_blocks, window_blocks, last_q_blocks; /* >= 1, >= 2, >= 0 */
    int32_t min_q;               /* sequences with fewer new tokens attend densely */
    float threshold;             /* in [0, 1] */
    bool mean_correction;
    /* host [n_seqs of the call] or NULL: whether sequence s's chunk is the
     * last of its prompt (its last query blocks, whose outputs give the
     * logits, attend densely only there); NULL = every chunk's do */
    const bool *prompt_end;
} lethe_block_sparse;

typedef struct lethe_attn_args {
    void *out;                   /* [n_tokens, n_heads, head_dim] activations */
    const void *q;               /* [n_tokens, n_heads, head_dim] after RoPE */
    const void *k_cache;         /* [n_slots, n_kv_heads, head_dim] this layer */
    const void *v_cache;
    int32_t n_tokens;
    int32_t n_seqs;
    const int32_t *q_begin;      /* host [n_seqs + 1] */
    const int32_t *sel_begin;    /* host [n_seqs + 1] */
    const int32_t *sel_slots;    /* host [sel_begin[n_seqs]] */
    /* Per-KV-head selections (varlen per head: rows with per-(layer, KV head)
     * lengths, kv_pool.h head masks): NULL = every head reads the selection
     * above. Otherwise KV head h of sequence s (and its query heads) reads
     * head_sel_slots[head_sel_begin[s * n_kv_heads + h] .. [.. + 1]), same
     * convention (ascending, the LAST n_q entries are the new tokens), each a
     * subsequence of the sequence's selection above (which attn_scores and
     * the methods keep reading). Native KV only. */
    const int32_t *head_sel_begin; /* host [n_seqs * n_kv_heads + 1] */
    const int32_t *head_sel_slots; /* host [head_sel_begin[n_seqs * n_kv_heads]] */
    int32_t n_heads, n_kv_heads, head_dim;
    float scale;                 /* usually 1/sqrt(head_dim) */
    /* ---- quantized KV (kvquant): NULL or format NATIVE = k_cache / v_cache
     * hold the backend's kv type; otherwise they hold that format's codes and
     * kvq its side arrays. Read by attention_quant.{c,cu}. ---- */
    const lethe_kv_quant *kvq;
    /* latent KV (multi-head latent attention): v_cache == NULL, n_kv_heads 1,
     * and V of a slot is the first v_dim of its head_dim K values; out is
     * [n_tokens, n_heads, v_dim]. 0 with a v_cache. (cpu/mla.c, cuda/mla.cu) */
    int32_t v_dim;
    /* block-sparse prefill (lethe_block_sparse above); NULL = dense */
    const lethe_block_sparse *bsp;
    /* the selection is the identity (sel_slots[i] == i): sequence s's keys are
     * the cache rows sel_begin[s] .. sel_begin[s + 1] - 1, e.g. latent
     * attention's expanded prefill over its decompressed K / V (arch_mla.c). A
     * device backend may then run the attention as GEMMs (cuda/attention_gemm.cu);
     * the result is the same attention. Native KV, no per-head selections. */
    bool sel_dense;
} lethe_attn_args;

/* ---- attention scores for sparse methods (ops->attn_scores) ----
 *
 * Per-key scores of a few query rows, reduced ON the backend to what the
 * methods consume, so nothing of size rows x keys ever exists in full
 * (SnapKV / PyramidKV / H2O / OmniKV, methods.md §2.4 K1/K2). For sequence s
 * (lethe_score_seq): the scored queries are batch rows [q_row, q_row +
 * n_rows); its keys are key_slots[key_begin .. key_begin + n_keys), ascending
 * logical position, the LAST n_rows of them being the scored rows' own
 * tokens (the attention convention), so scored row i (0-based) sees keys
 * [0, lim_i], lim_i = n_keys - n_rows + i. With raw(h, i, e) = scale *
 * q[q_row + i, h] . K[key_slots[key_begin + e], h / (n_heads / n_kv_heads)]
 * for visible e (-INF otherwise) and the candidates e in [c0, c1):
 *
 *   LETHE_SCORES_LOGIT_MAX   v(h, e) = max over rows i of raw(h, i, e)
 *   LETHE_SCORES_PROB_*      v(h, e) = (1 / n_rows) * sum over rows i of
 *                            softmax_e'(raw(h, i, e'))[e], the denominator
 *                            over the visible e' in [c0, c1) with
 *                            LETHE_SCORES_CAND_DENOM (the anchor), else over
 *                            the row's whole causal selection [0, lim_i]
 *                            (original SnapKV / H2O); a row with no visible
 *                            key in its denominator contributes 0
 *
 * then the heads are reduced in n_groups groups of n_heads / n_groups
 * consecutive query heads (1 = all heads, the anchor's token-shared set;
 * n_kv_heads = per KV head, methods.md §2.3 (b)): LOGIT_MAX and PROB_MAX take
 * the max over the group's heads, PROB_SUM the sum, PROB_MEAN the mean.
 * Output: HOST float, the sequences one after another, each [n_groups, c1 -
 * c0] (row g = group g, column j = candidate c0 + j). Device scratch is
 * O(n_heads x (candidates + rows)) floats per sequence; the CPU twin
 * (backend/cpu/scores.c) computes each raw score exactly as the CPU attention
 * does (one fmaf chain over d, then * scale) and the softmax in double. */
enum {
    LETHE_SCORES_LOGIT_MAX = 0,
    LETHE_SCORES_PROB_MAX = 1,
    LETHE_SCORES_PROB_SUM = 2,
    LETHE_SCORES_PROB_MEAN = 3,
    LETHE_SCORES_KIND_MASK = 3,
    LETHE_SCORES_CAND_DENOM = 1 << 2, /* flag: softmax denominator over the candidates only */
    /* flag (PROB_* modes): reduce the rows by max instead of the mean (KVzip:
     * max over replay queries), v(h, e) = max over rows i of softmax(...)[e] */
    LETHE_SCORES_ROW_MAX = 1 << 3,
    /* flag (with LOGIT_MAX; omnikv_prefill): the rows are first averaged per
     * head into one mean query (in the backend's activation type), which is
     * scored as one row seeing all n_keys keys: v(h, e) = scale * mean_i(q_i,h)
     * . K_e = the mean over the rows of raw(h, i, e) (up to rounding). Needs
     * c1 <= n_keys - n_rows + 1 (every candidate visible to every row), and
     * every sequence of the call flagged alike. */
    LETHE_SCORES_QMEAN = 1 << 4,
};

/* The largest head_dim a device backend's score kernels take (attn_scores,
 * page_scores, key_redundancy): latent KV rows (MLA: GLM-4.7-Flash's 512
 * latent + 64 RoPE = 576) fit. The CPU twins take any head_dim. */
#define LETHE_SCORES_HEAD_DIM_MAX 640

/* One sequence's request; int32 fields only (a device backend stages it as an index array). */
typedef struct lethe_score_seq {
    int32_t q_row, n_rows;       /* scored batch rows [q_row, q_row + n_rows), n_rows >= 1 */
    int32_t key_begin, n_keys;   /* keys: key_slots[key_begin ..], n_keys >= n_rows */
    int32_t c0, c1;              /* candidate keys [c0, c1), 0 <= c0 <= c1 <= n_keys */
    int32_t mode;                /* LETHE_SCORES_* kind | flags */
} lethe_score_seq;

typedef struct lethe_attn_scores_args {
    float *out;                  /* HOST, sum over s of n_groups * (c1 - c0) floats; backend
                                  * f32 memory when out_on_backend */
    bool out_on_backend;         /* asynchronous: no host copy, no sync (feeds ops->topk) */
    const void *q;               /* [n_tokens, n_heads, head_dim] after RoPE (backend) */
    const void *k_cache;         /* [n_slots, n_kv_heads, head_dim] this layer, backend kv type
                                  * (not a quantized format) */
    int32_t n_tokens;            /* rows of q */
    int32_t n_seqs;
    const lethe_score_seq *seqs; /* host [n_seqs] */
    const int32_t *key_slots;    /* host, indexed by key_begin (e.g. the attention's sel_slots) */
    int32_t n_key_slots;         /* its length */
    int32_t n_heads, n_kv_heads, head_dim;
    int32_t n_groups;            /* divides n_heads */
    float scale;
} lethe_attn_scores_args;

/* floats attn_scores writes for these requests */
size_t lethe_attn_scores_out_len(const lethe_score_seq *seqs, int32_t n_seqs, int32_t n_groups);

/* ---- selections built on the backend (ops->select_expand) ----
 * One sequence's selection assembled from its row (row entries in logical
 * order -> slot ids: rows[row_begin .. row_begin + row_len)) and the units a
 * top-k picked: the entries
 *     [0, head)
 *     pick_off + u * unit + [0, unit)   for u = picks[pick_begin .. + n_picks)
 *     [tail, row_len)
 * in that order, written as slot ids to out[out_begin ..]. The picks are
 * ascending and the three parts must not overlap (head <= pick_off + u * unit,
 * the last unit ends <= tail), so the selection stays ascending, as attention
 * wants. Quest: head 0, unit = page size, pick_off 0, tail = the first page
 * holding new tokens; OmniKV: head = sink, unit 1, pick_off = sink, tail = the
 * first recent entry. int32 fields only (staged as an index array). */
typedef struct lethe_expand_seq {
    int32_t row_begin, row_len;
    int32_t head;
    int32_t pick_begin, n_picks, pick_off;
    int32_t tail;
    int32_t out_begin;           /* its count: lethe_expand_count */
} lethe_expand_seq;

/* slot ids select_expand writes for one sequence */
static inline int32_t lethe_expand_count(const lethe_expand_seq *q, int32_t unit) {
    return q->head + q->n_picks * unit + (q->row_len - q->tail);
}

/* ---- key clusters (RetroInfer, methods.md §12; ops->cluster_*; CPU twin
 * backend/cpu/clusters.c, CUDA backend/cuda/clusters.cu) ----
 * cluster_assign: one assignment round of spherical k-means over keys, all KV
 * heads at once. For KV head h and key e in [0, n) (row slots[e] of k_cache
 * [n_slots, n_kv_heads, head_dim], backend kv type; host slots):
 *   out[h * n + e] = argmax over c in [0, n_c) of (k[e, h] - mean[h]) . cent[h, c]
 * (f32 dots, ties to the smaller c); cent HOST f32 [n_kv_heads, n_c, head_dim]
 * (unit centroids), mean HOST f32 [n_kv_heads, head_dim], out HOST int32
 * [n_kv_heads, n], written when the op returns (synchronous).
 *
 * cluster_scores: for query i in [0, n_q) (batch row q_rows[i] of q [n_tokens,
 * n_heads, head_dim], after RoPE) and KV head h, the clusters
 * ids[begin[i * n_kv_heads + h] .. begin[.. + 1]) (rows of cent, backend f32
 * [n_rows, head_dim]):  out[e] = scale * mean over the g = n_heads / n_kv_heads
 * query heads of h's group of q_head . cent[ids[e]].  out HOST f32
 * [begin[n_q * n_kv_heads]], written when the op returns.
 *
 * cluster_attention: three-zone decode attention, one shared softmax. For
 * query i (batch row q_rows[i]) and query head qh of KV head h: the exact keys
 * x_slots[x_begin[i KH + h] .. [.. + 1]), each a pool slot s >= 0 (k_cache /
 * v_cache [n_slots, n_kv_heads, head_dim], head h) or an aux row -(1 + r)
 * (k_aux / v_aux [n_aux, head_dim] activations: clusters fetched into a device
 * cache), and the estimated clusters c in ids[e_begin[i KH + h] .. [.. + 1])
 * (cent / vsum backend f32 [n_rows, head_dim], count f32 [n_rows]):
 *   s_j = scale q . k_j,  s_c = scale q . cent[c]
 *   out[q_rows[i], qh] = (sum_j e^{s_j} v_j + sum_c e^{s_c} vsum[c])
 *                      / (sum_j e^{s_j} + sum_c count[c] e^{s_c})
 * (the estimation zone counts each cluster as count[c] keys at its mean key,
 * with the cluster's mean value). Other rows of out are not touched; every
 * (i, h) needs at least one exact key. Asynchronous like attention. */
typedef struct lethe_cluster_attn_args {
    void *out;                       /* [n_tokens, n_heads, head_dim] activations */
    const void *q;                   /* [n_tokens, n_heads, head_dim] after RoPE */
    const void *k_cache, *v_cache;   /* native KV of this layer */
    const void *k_aux, *v_aux;       /* [n_aux, head_dim] activations, or NULL (no aux rows) */
    const void *cent, *vsum, *count; /* f32 cluster tables (backend memory) */
    int32_t n_q;
    const int32_t *q_rows;            /* host [n_q] */
    const int32_t *x_begin, *x_slots; /* host [n_q KH + 1], [x_begin[n_q KH]] */
    const int32_t *e_begin, *e_ids;   /* host [n_q KH + 1], [e_begin[n_q KH]] */
    int32_t n_heads, n_kv_heads, head_dim;
    float scale;
} lethe_cluster_attn_args;

/* ---- mixture-of-experts FFN (ops->moe; backend/cpu/moe.c, backend/cuda/moe.cu) ----
 * For each token t of n (x [n, dim] activations), from its router logits
 * logits[t] ([n, n_experts] activations):
 *   SOFTMAX (qwen3_moe):  p = softmax(logits[t]) in f32, choice = p;
 *   SIGMOID (glm4_moe_lite, DeepSeek-V3 noaux_tc): p = sigmoid(logits[t]),
 *       choice = p + bias (bias [n_experts] weights, NULL = 0); with n_group
 *       > 1 only the topk_group groups (n_experts / n_group consecutive
 *       experts each) with the largest sums of their two best choice values
 *       compete (ties to the smaller group);
 *   ids[t, 0..k) = the k experts of largest choice, descending (ties to the
 *       smaller id), w[t, j] = p[ids[t, j]], divided by their sum (+ 1e-20
 *       for SIGMOID) when norm_topk, times scale;
 *   out[t] = sum over j = 0..k-1 in order of w[t, j] * E_ids[t,j](x[t]),
 *       E_e(x) = W_down[e] (silu(W_gate[e] x) * W_up[e] x)
 * with W_gate, W_up [n_experts, ffn, dim] and W_down [n_experts, dim, ffn]
 * (weights, expert e at offset e * ffn * dim). Only the chosen experts'
 * weights are read. ws: backend scratch of lethe_moe_ws_bytes(be, n, ...)
 * bytes (the caller allocates it once for its largest n; the op never
 * allocates, so a decode step with it is graph-capturable). With accumulate,
 * out[t] += that sum instead (out is then the residual stream: the layer's
 * residual add is part of the op, one rounding per element). out may not
 * alias x. Every output row depends only on its own token (batch-invariant
 * on the CPU). */
typedef struct lethe_moe_args {
    void *out;          /* [n, dim] activations, overwritten (accumulate: added to) */
    const void *x;      /* [n, dim] */
    const void *logits; /* [n, n_experts] router logits */
    const void *bias;   /* [n_experts] weights or NULL (SIGMOID only) */
    const void *w_gate, *w_up, *w_down;
    int32_t n, dim, ffn, n_experts, k;
    int32_t scoring; /* LETHE_MOE_SOFTMAX / LETHE_MOE_SIGMOID (model/config.h) */
    bool norm_topk;
    float scale;
    int32_t n_group, topk_group;
    bool accumulate; /* out += the routed sum (else out = it) */
    void *ws;
    size_t ws_bytes;
} lethe_moe_args;

/* Scratch bytes ops->moe needs for up to n tokens (both backends: ids, weights,
 * the expert-sorted order, gathered rows and the intermediate activations). */
size_t lethe_moe_ws_bytes(const lethe_backend *be, int32_t n, int32_t k, int32_t dim, int32_t ffn,
                          int32_t n_experts);

/* ---- hybrid linear attention: Gated DeltaNet (ops->gdn_conv, ops->gdn_rule;
 * backend/cpu/gdn.c, backend/cuda/gdn.cu) ----
 * Hk = n_k_heads, Hv = n_v_heads (a multiple of Hk: k head h / (Hv / Hk)
 * serves v head h), dk = k_dim, dv = v_dim, C = conv_dim = 2 Hk dk + Hv dv,
 * K = kernel. Sequence s is batch rows [q_begin[s], q_begin[s+1]) at
 * consecutive positions, with state slot state_slots[s]; a sequence whose
 * first row is at position 0 starts from zero states (a new request), any
 * other continues from its slot's states. Both states are f32 backend memory.
 *
 * gdn_conv: depthwise causal conv + SiLU over x [n_tokens, C] (q | k | v
 *   projections), each channel c of a sequence's rows preceded by the K - 1
 *   inputs of its conv state (oldest first):
 *     xc[t, c] = silu(sum_j conv_w[c, j] win[t + j]),  win = state | x rows
 *   then the state becomes the last K - 1 entries of win.
 *   conv_state f32 [n_slots, K - 1, C]; conv_w [C, K] weights.
 * gdn_rule: the gated delta rule over q = xc[:, 0:Hk dk], k = xc[:, Hk dk:
 *   2 Hk dk], v = xc[:, 2 Hk dk:] (per head), with q, k L2-normalised (eps
 *   1e-6 inside the rsqrt), q scaled by dk^-1/2, beta = sigmoid(b), g =
 *   A softplus(a + dt_bias) (A = -exp(A_log) < 0, per v head); per token:
 *     S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q
 *   S = state[slot][h] f32 [dk, dv]. Rows are processed in segments cut at
 *   positions that are multiples of LETHE_GDN_CHUNK: a segment of one row
 *   takes the one-step update above; longer segments the chunked form
 *   (parallel within the segment: a triangular solve for the in-chunk delta
 *   corrections, then one state read and one state update per chunk), equal
 *   up to rounding. Cutting at absolute positions makes the arithmetic of a
 *   row independent of how a prompt is split into steps at chunk boundaries.
 *   out [n_tokens, Hv, dv] activations; a, b [n_tokens, Hv] activations;
 *   A, dt_bias [Hv] weights. */
#define LETHE_GDN_CHUNK 64
typedef struct lethe_gdn_args {
    int32_t n_tokens, n_seqs;
    const int32_t *q_begin;     /* host [n_seqs + 1] */
    const int32_t *state_slots; /* host [n_seqs] */
    const int32_t *pos;         /* host [n_tokens] */
    const void *x;              /* gdn_conv input [n_tokens, C] */
    void *xc;                   /* gdn_conv output, gdn_rule input [n_tokens, C] */
    const void *conv_w;         /* [C, K] */
    void *conv_state;           /* f32 [n_slots, K - 1, C] */
    int32_t conv_dim, kernel;
    const void *a, *b;          /* [n_tokens, Hv] */
    const void *A, *dt_bias;    /* [Hv] */
    void *state;                /* f32 [n_slots, Hv, dk, dv] */
    void *out;                  /* [n_tokens, Hv, dv] */
    int32_t n_k_heads, n_v_heads, k_dim, v_dim;
} lethe_gdn_args;

/* ---- capabilities (ops->caps) ----
 * What a backend is, as bits, so that code above the backend asks for a
 * property instead of testing the backend's name (ops->name is for messages).
 *   HOST_MEMORY  backend memory is host memory: what alloc returns, the KV
 *                caches and the outputs of ops (topk, select_expand) can be
 *                read and written through plain pointers, with no transfer op
 *                and no sync (the CPU backend; KV is then host memory of
 *                kv_size bytes per element, f32 on the CPU).
 *   GRAPHS       graph_begin can capture: decode steps may be recorded once
 *                and replayed (graph_end / graph_launch). Without it the graph
 *                ops are no-ops that report "unsupported" (graph_begin false).
 *   PROFILER     profile_range drives a device profiler's capture range
 *                (CUDA: cudaProfilerStart/Stop). Without it it is a no-op. */
enum {
    LETHE_BE_HOST_MEMORY = 1u << 0,
    LETHE_BE_GRAPHS = 1u << 1,
    LETHE_BE_PROFILER = 1u << 2,
};

typedef struct lethe_backend_ops {
    const char *name;            /* "cpu", "cuda": messages and logs only */
    unsigned caps;               /* LETHE_BE_* bits */
    size_t act_size;             /* bytes per activation element */
    size_t kv_size;              /* bytes per K/V cache element */
    void (*destroy)(lethe_backend *be);

    /* memory: init/load time only */
    lethe_status (*alloc)(lethe_backend *be, size_t n_bytes, void **out);
    void (*release)(lethe_backend *be, void *p);
    /* f32 host weights -> backend weight memory (converted to the weight type) */
    lethe_status (*weight_upload)(lethe_backend *be, const float *host, size_t n, void **out);
    void (*act_to_host)(lethe_backend *be, float *dst, const void *src, size_t n);
    void (*act_from_host)(lethe_backend *be, void *dst, const float *src, size_t n);
    void (*sync)(lethe_backend *be);
    size_t (*free_memory)(lethe_backend *be); /* device bytes free; CPU returns 0 */

    /* ops */
    void (*embed)(lethe_backend *be, void *x, const void *table, const int32_t *tokens,
                  int32_t n, int32_t dim);
    void (*rmsnorm)(lethe_backend *be, void *out, const void *x, const void *w, int32_t n_rows,
                    int32_t dim, float eps);
    void (*add)(lethe_backend *be, void *x, const void *y, size_t n); /* x += y */
    void (*matmul)(lethe_backend *be, void *y, const void *x, const void *w, int32_t n,
                   int32_t out_dim, int32_t in_dim); /* y[n,out] = x[n,in] W[out,in]^T */
    void (*add_bias)(lethe_backend *be, void *y, const void *b, int32_t n, int32_t dim);
    /* HF rotate-half RoPE in place on x [n, n_heads, head_dim] at host positions pos[n] */
    void (*rope)(lethe_backend *be, void *x, const int32_t *pos, int32_t n, int32_t n_heads,
                 int32_t head_dim, const lethe_rope_config *rope);
    void (*swiglu)(lethe_backend *be, void *out, const void *gate, const void *up, size_t n);
    /* writes new k/v [n, kv_dim] into cache rows slots[n] */
    void (*kv_store)(lethe_backend *be, void *k_cache, void *v_cache, const void *k,
                     const void *v, const int32_t *slots, int32_t n, int32_t kv_dim);
    void (*attention)(lethe_backend *be, const lethe_attn_args *a);
    /* logits to host: out[n, n_vocab] f32 */
    void (*logits_to_host)(lethe_backend *be, float *dst, const void *src, size_t n);
    /* copy activation rows: dst row i = src row idx[i] (host idx), rows of `dim` elements */
    void (*gather_rows)(lethe_backend *be, void *dst, const void *src, const int32_t *idx,
                        int32_t n, int32_t dim);

    /* ---- step staging and CUDA graphs (the CPU backend has no-op twins,
     * so callers need no backend checks; caps LETHE_BE_GRAPHS says whether
     * graph_begin can capture at all) ---- */
    /* Pre-stages a step's host index arrays: until the next stage_step or
     * unstage, an op handed exactly arrays[i] (same pointer, counts[i]
     * elements) reads the backend's copy instead of staging it again. The
     * caller must not modify the arrays meanwhile. Lets one upload serve all
     * layers when their plans are identical, and is what graph capture needs. */
    void (*stage_step)(lethe_backend *be, const int32_t *const *arrays, const size_t *counts,
                       int n);
    void (*unstage)(lethe_backend *be);
    /* Graphs of whole forward steps, keyed by an int (e.g. the decode batch size).
     * graph_begin: start capturing the ops that follow (false: unsupported, run
     * eagerly); every host index array they get must be pre-staged, and the
     * only host transfer allowed is logits_to_host. graph_end: stop, keep the
     * graph under key, and run it once (logits land where logits_to_host said).
     * graph_launch: replay key's graph (after re-staging the step's arrays:
     * same counts for the fixed-size ones) and copy its logits into logits_dst;
     * false if no graph has that key. graph_reset drops every graph. */
    bool (*graph_begin)(lethe_backend *be);
    lethe_status (*graph_end)(lethe_backend *be, int32_t key);
    bool (*graph_launch)(lethe_backend *be, int32_t key, float *logits_dst);
    void (*graph_reset)(lethe_backend *be);
    /* Measures the device's ceilings for roofline reports (benchmarks only):
     * copy bandwidth (bytes read + written per second, large device copy) and
     * bf16 (CPU: f32) GEMM rate in FLOP/s on random data. */
    lethe_status (*measure_peaks)(lethe_backend *be, double *copy_bytes_per_s,
                                  double *gemm_flops_per_s);

    /* ---- quantized KV (kvquant) ----
     * kv_store into a quantized layer (kvq->format != NATIVE): quantizes the
     * new k/v [n, n_kv_heads, head_dim] (activations) per token and KV head
     * and writes codes + scales of cache rows slots[n] (host). */
    void (*kv_store_quant)(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                           void *v_cache, const void *k, const void *v, const int32_t *slots,
                           int32_t n, int32_t n_kv_heads, int32_t head_dim);
    /* ---- attention scores for sparse methods (see lethe_attn_scores_args): reduced per-key scores of a few
     * query rows, written to a HOST array; synchronous (returns when `out`
     * is filled). Not allowed during graph capture. ---- */
    void (*attn_scores)(lethe_backend *be, const lethe_attn_scores_args *a);

    /* ---- Quest page bounds (CPU twin
     * backend/cpu/pages.c, CUDA backend/cuda/pages.cu) ----
     * A page-bounds buffer (allocated by the caller with alloc) holds meta
     * pages [n_meta, 2, kv_dim] in the KV element type (kv_size bytes): the
     * elementwise min, then the max, of a page's keys. Storing them in the KV
     * type is exact: a min or max of stored keys is a stored key value.
     * page_minmax: for i in [0, n_pages), meta page page_ids[i] := min / max
     * over the keys k_cache[slots[j]] ([n_slots, kv_dim]) for j in
     * [slot_begin[i], slot_begin[i+1]) (at least one slot each; arbitrary slot
     * ids, any count, so partial pages too; page_ids distinct within a call).
     * Host arrays: page_ids [n_pages], slot_begin [n_pages + 1], slots
     * [slot_begin[n_pages]]. */
    void (*page_minmax)(lethe_backend *be, void *meta, const void *k_cache, const int32_t *page_ids,
                        const int32_t *slot_begin, const int32_t *slots, int32_t n_pages,
                        int32_t kv_dim);
    /* page_scores: Quest upper bounds of sequence s in [0, n_seqs): its query
     * row q_rows[s] of q ([n_tokens, n_heads, head_dim] activations) against
     * meta pages page_ids[page_begin[s] .. page_begin[s+1]) (n_s of them):
     *   U(h, i) = sum_c max(q[h,c] * min[kh,c], q[h,c] * max[kh,c]),
     * kh = h / (n_heads / n_kv_heads), reduced by max over the query heads of
     * each of n_groups groups: n_groups 1 = all heads (one page set per layer),
     * n_groups = n_kv_heads = the heads of each KV head (per-KV-head sets).
     * Sequence s's outputs are [n_groups, n_s] from out[n_groups * page_begin[s]]
     * (row g = group g); n_groups 1: out[i] for page i. out: HOST float
     * [n_groups * page_begin[n_seqs]], written when the op returns (a host sync
     * on a device backend). Host arrays: q_rows [n_seqs], page_begin [n_seqs +
     * 1], page_ids. */
    void (*page_scores)(lethe_backend *be, float *out, const void *q, const void *meta,
                        int32_t n_seqs, const int32_t *q_rows, const int32_t *page_begin,
                        const int32_t *page_ids, int32_t n_heads, int32_t n_kv_heads,
                        int32_t head_dim, int32_t n_groups, bool out_on_backend);
    /* (out_on_backend: out is backend f32 memory, no host copy and no sync.) */
    /* Optional (NULL = not offered; benchmarks and tests only). profile_range:
     * starts/stops the device profiler's capture range (CUDA:
     * cudaProfilerStart/Stop, for `ncu --profile-from-start off`); a no-op
     * unless caps has LETHE_BE_PROFILER. */
    void (*profile_range)(lethe_backend *be, bool start);
    /* ---- sampling on the backend (backend/sample.h defines the arguments
     * and the exact semantics; cpu/sample.c, cuda/sample.cu) ---- */
    /* Picks one token per logits row: a->logits are backend activations
     * [a->n, n_vocab] (e.g. the model's device logits rows), per-row params
     * and penalty lists are host arrays, a->tokens (and a->logprobs if not
     * NULL) are host outputs, valid when the call returns (it syncs). Same
     * tokens on every backend for the same logits. Not graph-capturable. */
    void (*sample)(lethe_backend *be, const lethe_sample_args *a);
    /* ---- device-side selection (sparse methods' select_layer hook; CPU twin
     * backend/cpu/select.c, CUDA backend/cuda/select.cu). Asynchronous: no
     * host sync, outputs are backend memory that later ops read as index
     * arrays. ----
     * topk: segmented top-k. Segment s is scores[seg_begin[s] .. seg_begin[s+1])
     * (backend f32); its k_s = out_begin[s+1] - out_begin[s] best entries
     * (0 <= k_s <= the segment's length) are written as indices relative to
     * the segment start, ASCENDING, to out[out_begin[s] ..] (backend int32).
     * "Best" is lethe_rank_before (backend/topk.h): higher score first,
     * ties to the smaller index, NaN last; -0.0 ties with +0.0. So the result
     * equals lethe_topk_indices on every backend. Host arrays seg_begin,
     * out_begin [n_segs + 1]. */
    void (*topk)(lethe_backend *be, int32_t *out, const float *scores, int32_t n_segs,
                 const int32_t *seg_begin, const int32_t *out_begin);
    /* select_expand: the selections of n_seqs sequences (lethe_expand_seq, host
     * [n_seqs]) into out (backend int32); rows: index array of every
     * sequence's row slots (host or backend), picks: backend int32 (topk's
     * out). */
    void (*select_expand)(lethe_backend *be, int32_t *out, const int32_t *rows, const int32_t *picks,
                          const lethe_expand_seq *seqs, int32_t n_seqs, int32_t unit);
    /* ---- mixture of experts (lethe_moe_args): routing + the chosen experts'
     * SwiGLU FFNs + their weighted sum, asynchronous (no host sync on CUDA,
     * so steps stay in graphs) ---- */
    void (*moe)(lethe_backend *be, const lethe_moe_args *a);
    /* ---- multi-head latent attention (cpu/mla.c, cuda/mla.cu) ----
     * matmul_heads: y[t, h, o] = sum_i W[h][o, i] x[t, h, i] for t < n, h <
     * n_heads, with W [n_heads, out, in] weights and strided activations:
     * x[t, h, i] at x + t x_ld + h x_hs + i, y[t, h, o] at y + t y_ld + h y_hs + o
     * (elements; x_hs may be 0: every head reads the same row). */
    void (*matmul_heads)(lethe_backend *be, void *y, int32_t y_ld, int32_t y_hs, const void *x,
                         int32_t x_ld, int32_t x_hs, const void *w, int32_t n, int32_t n_heads,
                         int32_t out, int32_t in);
    /* copy_block: dst[d_r, dst_off + c] = src[r, c] for r < n_rows, c < width, rows of
     * dst_ld / src_ld elements, d_r = rows[r] (host index array, e.g. cache slots)
     * or r when rows is NULL; activations or native KV (same element type). */
    void (*copy_block)(lethe_backend *be, void *dst, int32_t dst_ld, int32_t dst_off,
                       const int32_t *rows, const void *src, int32_t src_ld, int32_t n_rows,
                       int32_t width);
    /* raw bytes host -> backend memory (tables that must keep their exact
     * values: TurboQuant's f32 rotation and codebook); synchronous, init time */
    void (*copy_from_host)(lethe_backend *be, void *dst, const void *src, size_t n_bytes);
    /* ---- key redundancy (R-KV, methods.md §8; CPU twin
     * backend/cpu/redundancy.c, CUDA backend/cuda/redundancy.cu) ----
     * For every KV head h and keys e in [0, n) (rows slots[e] of k_cache
     * [n_slots, n_kv_heads, head_dim], backend kv type; host slots):
     *   c(i, j)  = k_i . k_j / ((|k_i| + 1e-8) (|k_j| + 1e-8)), i != j
     *   last(i)  = the largest j > i with c(i, j) > threshold (i's newest
     *              near-copy), none if there is no such j
     *   out[h, i] = (sum over j != i of c(i, j)  -  sum over the j with
     *              last(j) = i of c(i, j)) / n
     * i.e. the mean similarity of a key to the others, where the newest copy
     * of near-duplicates does not count its older copies (R-KV keeps the
     * newest). out: HOST float [n_kv_heads, n], written when the op returns
     * (synchronous). O(n^2 head_dim) per head in tiles; no n x n matrix
     * exists (the CPU holds O(n d), CUDA a fixed-size tile of dots). */
    void (*key_redundancy)(lethe_backend *be, float *out, const void *k_cache, const int32_t *slots,
                           int32_t n, int32_t n_kv_heads, int32_t head_dim, float threshold);
    /* ---- key clusters (lethe_cluster_attn_args above) ---- */
    void (*cluster_assign)(lethe_backend *be, int32_t *out, const void *k_cache,
                           const int32_t *slots, int32_t n, const float *cent, const float *mean,
                           int32_t n_c, int32_t n_kv_heads, int32_t head_dim);
    void (*cluster_scores)(lethe_backend *be, float *out, const void *q, const void *cent,
                           int32_t n_q, const int32_t *q_rows, const int32_t *begin,
                           const int32_t *ids, int32_t n_heads, int32_t n_kv_heads,
                           int32_t head_dim, float scale);
    void (*cluster_attention)(lethe_backend *be, const lethe_cluster_attn_args *a);
    /* ---- residual bases (DeltaKV, methods.md §13; CPU twin cpu/elementwise.c,
     * CUDA cuda/elementwise.cu) ----
     * out[i, :] += scale * sum over k < n_idx of src[idx[i n_idx + k], :] for
     * i < n: rows of `dim` activations (out [n, dim], src [rows, dim]), idx a
     * HOST int32 array [n n_idx] of src rows; f32 accumulation, one rounding
     * to the activation type per element. scale = -1 / n_idx subtracts the
     * mean of the indexed rows (a token's fathers), +1 / n_idx adds it back. */
    void (*gather_sum)(lethe_backend *be, void *out, const void *src, const int32_t *idx, int32_t n,
                       int32_t n_idx, int32_t dim, float scale);
    /* ---- hybrid linear attention (lethe_gdn_args; cpu/gdn.c, cuda/gdn.cu) ----
     * gdn_conv / gdn_rule: see lethe_gdn_args. rmsnorm_gated: out = rmsnorm(x)
     * * w * silu(z) over rows of dim (the DeltaNet output norm; x, z, out
     * [n_rows, dim], out may alias x). sigmoid_mul: x[i] *= sigmoid(g[i])
     * (the gated attention's output gate). state_copy: row dst := row src of
     * a state buffer of rows of row_bytes (snapshots of a request's states). */
    void (*gdn_conv)(lethe_backend *be, const lethe_gdn_args *a);
    void (*gdn_rule)(lethe_backend *be, const lethe_gdn_args *a);
    void (*rmsnorm_gated)(lethe_backend *be, void *out, const void *x, const void *z,
                          const void *w, int32_t n_rows, int32_t dim, float eps);
    void (*sigmoid_mul)(lethe_backend *be, void *x, const void *g, size_t n);
    void (*state_copy)(lethe_backend *be, void *buf, size_t row_bytes, int32_t dst, int32_t src);
    /* ---- weights in their stored format (optional, NULL = not offered) ----
     * A matrix weight as the file stores it (w->type: a GGUF block format,
     * f16 or bf16; rows in HF order). On LETHE_OK *out is backend weight
     * memory that matmul (and embed, for the token table) accept like an
     * uploaded f32 weight; LETHE_ERR_UNSUPPORTED (no error message set) means
     * "not this one, upload f32 instead", which the loader then does. The CPU
     * backend keeps the blocks and computes on them (cpu/qmatmul.c); kept
     * last in the table, CUDA leaves it NULL and dequantizes on upload. */
    lethe_status (*weight_upload_raw)(lethe_backend *be, const lethe_weight_raw *w, void **out);
    /* ---- rows of backend buffers to / from the host (the host KV tier,
     * kv/kv_host.c; CPU twin backend/cpu/transfer.c, CUDA backend/cuda/transfer.cu) ----
     * rows_to_host: host[i * row_bytes ..+ row_bytes) = buf[rows[i] * row_bytes ..) for
     * i < n; rows_from_host: the reverse. rows: host int32 array; raw bytes (any
     * payload plane); synchronous: host may be reused when the call returns. */
    void (*rows_to_host)(lethe_backend *be, void *host, const void *buf, size_t row_bytes,
                         const int32_t *rows, int32_t n);
    void (*rows_from_host)(lethe_backend *be, void *buf, size_t row_bytes, const int32_t *rows,
                           int32_t n, const void *host);
    /* ---- per-row top-k under a column limit (DeltaKV's father search;
     * CPU twin backend/cpu/select.c, CUDA backend/cuda/select.cu) ----
     * row_topk: for each row i < n of scores ([n, m] activations, row-major,
     * backend memory), the k best columns c < lim[i] of
     *   s(i, c) = alpha * (float)scores[i, c] + bias[c]
     * (f32, the product and the sum each rounded once: no fused multiply-add,
     * so every backend ranks bit-identical values; bias NULL: + 0), written
     * best-first to out[i k .. i k + k) (HOST int32 [n, k]); "best" is
     * lethe_rank_before (backend/topk.h: higher first, ties to the smaller
     * column, NaN last). Entries j >= lim[i] are -1 (lim[i] 0: the whole row).
     * lim: HOST int32 [n], each in [0, m]; bias: HOST f32 [m] or NULL;
     * 1 <= k <= LETHE_ROW_TOPK_MAX. Synchronous: out is filled when the call
     * returns (a host sync on a device backend); only out [n, k] crosses to
     * the host, never the [n, m] scores. Not allowed during graph capture. */
    void (*row_topk)(lethe_backend *be, int32_t *out, const void *scores, int32_t n, int32_t m,
                     const int32_t *lim, int32_t k, float alpha, const float *bias);
} lethe_backend_ops;

/* the largest k of ops->row_topk */
#define LETHE_ROW_TOPK_MAX 16

/* most experts a model may have (routing keeps per-token arrays on the stack) */
#define LETHE_MOE_MAX_EXPERTS 512
/* ops->moe token count up to which the CUDA twin streams the experts'
 * weights with GEMV kernels (decode); above it, a grouped GEMM */
#define LETHE_MOE_SMALL_N 256

struct lethe_backend {
    const lethe_backend_ops *ops;
    int n_threads;   /* CPU worker threads (0 = all cores) */
    void *ctx;       /* backend-private */
};

typedef struct lethe_backend_params {
    const char *device;        /* "cpu" or "cuda" */
    int n_threads;             /* CPU: 0 = all cores */
    int device_index;          /* CUDA ordinal */
    /* CPU weights: LETHE_CPU_WEIGHTS_NATIVE keeps GGUF blocks / f16 / bf16 as
     * stored (weight_upload_raw) and multiplies block formats with 8-bit
     * activations (qdot.c); _EXACT keeps them as stored with f32 activations
     * (bit-identical to _FP32); _FP32 dequantizes at load (the reference) */
    int cpu_weights;
} lethe_backend_params;

enum { LETHE_CPU_WEIGHTS_NATIVE = 0, LETHE_CPU_WEIGHTS_FP32 = 1, LETHE_CPU_WEIGHTS_EXACT = 2 };
/* "native" / "exact" / "fp32" -> LETHE_CPU_WEIGHTS_* (a clear error otherwise) */
lethe_status lethe_cpu_weights_parse(const char *s, int *out);

/* true when the backend has every capability bit of `caps` (NULL: none) */
static inline bool lethe_backend_has(const lethe_backend *be, unsigned caps) {
    return be && be->ops && (be->ops->caps & caps) == caps;
}

/* Creates the named backend. "cuda" returns LETHE_ERR_UNSUPPORTED with a clear
 * message when lethe was built without CUDA or no device is present. */
lethe_status lethe_backend_create(const lethe_backend_params *p, lethe_backend **out);
void lethe_backend_destroy(lethe_backend *be); /* NULL-safe */

/* Implemented in backend/cpu/backend_cpu.c and backend/cuda/backend_cuda.cu. */
lethe_status lethe_backend_cpu_create(const lethe_backend_params *p, lethe_backend **out);
lethe_status lethe_backend_cuda_create(const lethe_backend_params *p, lethe_backend **out);

#endif /* LETHE_BACKEND_H */

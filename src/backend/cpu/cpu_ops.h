/* cpu_ops.h - the CPU reference backend's op functions (internal).
 *
 * The CPU backend computes everything in fp32 on host memory: activations
 * and KV are plain float arrays, so a "device pointer" is a host pointer;
 * weights are float arrays or, for matrices uploaded in their stored format
 * (weight_upload_raw), GGUF blocks / f16 / bf16 that matmul and embed decode
 * to the same floats (qmatmul.c). One file per op family, mirrored by name
 * in backend/cuda/ (.cu files):
 *   backend_cpu.c  ops table, memory, host transfers
 *   matmul.c       y = x W^T (deterministic register-tiled GEMM; tiles in matmul_avx2.c)
 *   qmatmul.c      the same on stored-format weights (kernels in qmatmul_avx2.c)
 *   pool.c         the worker threads every parallel op runs on
 *   cpu_isa.c      which SIMD tier the CPU runs (CPUID + executing probe)
 *   norm.c         rmsnorm
 *   rope.c         rotate-half RoPE with NONE / LINEAR / LLAMA3 scaling
 *   attention.c    kv_store + attention over a slot selection
 *   attention_quant.c  the same over quantized KV (FP8 E4M3 codes + scales, KIVI)
 *   attention_tq.c the same over TurboQuant KV (rotated codebook codes + norms)
 *   scores.c       attn_scores: reduced per-key scores for the sparse methods
 *   elementwise.c  embed, gather_rows, gather_sum, add, add_bias, swiglu
 *   pages.c        Quest page bounds: page_minmax, page_scores
 *   clusters.c     RetroInfer key clusters: cluster_assign, cluster_scores, cluster_attention
 *   sample.c       the sample op (and the row function the host sampler uses)
 *   moe.c          mixture-of-experts FFN: routing, expert-sorted SwiGLU, weighted sum
 *   mla.c          latent attention: per-head matmul, column-block copy, latent-V attention
 *   gdn.c          Gated DeltaNet: causal conv, delta rule (one-step, chunked), gated norm
 *
 * Every op with a parallel loop uses at most cpu_threads(be) threads (pool.c),
 * and each output element is computed by the same sequence of float
 * operations whatever the thread count or batch composition: a request's
 * results are bit-identical alone or inside a batch. */
#ifndef LETHE_BACKEND_CPU_OPS_H
#define LETHE_BACKEND_CPU_OPS_H

#include "backend/backend.h"

#include "backend/sample.h"

typedef struct lethe_cpu_pool lethe_cpu_pool; /* pool.c */

#define LETHE_CPU_MAX_THREADS 256 /* pool threads per backend (caller included) */

/* SIMD tier of the matmul kernels (cpu_isa.c: CPUID + a probe that executes) */
/* AVX2_VNNI: AVX2 plus AVX-512 VNNI on 256-bit vectors (vpdpbusd, AVX512VL) */
typedef enum lethe_cpu_isa {
    LETHE_ISA_SCALAR = 0,
    LETHE_ISA_AVX2 = 1,
    LETHE_ISA_AVX2_VNNI = 2
} lethe_cpu_isa;
lethe_cpu_isa lethe_cpu_isa_detect(void);
const char *lethe_cpu_isa_name(lethe_cpu_isa isa);

/* A weight matrix kept in its stored format (weight_upload_raw, qmatmul.c):
 * rows [rows] of row_bytes each at data, row r = cols elements of `type` in
 * ggml's block layout (ggml_types.c). */
typedef struct lethe_cpu_qweight {
    uint8_t *data;                /* owned, 64-byte aligned */
    lethe_ggml_type type;
    int32_t rows, cols;
    size_t row_bytes;
} lethe_cpu_qweight;

/* be->ctx of the CPU backend: scratch that ops grow on first use */
typedef struct lethe_cpu_ctx {
    lethe_sample_scratch *sample; /* [n_sample] one per pool worker */
    int n_sample;
    int32_t sample_vocab;
    lethe_cpu_isa isa;            /* tier the matmul kernels use */
    lethe_cpu_pool *pool;         /* worker threads, spawned on first use */
    /* qmatmul's per-worker f32 weight panels, grown on first use */
    float *panel[LETHE_CPU_MAX_THREADS];
    size_t panel_cap[LETHE_CPU_MAX_THREADS];
    int cpu_weights;              /* LETHE_CPU_WEIGHTS_* */
    /* qmatmul's x rounded to 16 bits (qdot.c), grown on first use */
    void *qx;
    size_t qx_cap;
    /* the stored-format weights, sorted by data pointer: matmul and embed
     * look their weight pointer up here (absent = plain f32) */
    lethe_cpu_qweight *qw;
    int n_qw, cap_qw;
} lethe_cpu_ctx;

/* pool.c: the worker threads (futex wake, bounded spin; no OpenMP).
 * fn(ctx, task, worker) runs for every task in [0, n_tasks) on at most
 * n_threads threads (the caller is worker 0; worker < n_threads selects
 * per-thread scratch); returns when all ran. Nested calls run inline. */
typedef void (*lethe_cpu_task_fn)(void *ctx, int task, int worker);
lethe_cpu_pool *lethe_cpu_pool_create(void);
void lethe_cpu_pool_destroy(lethe_cpu_pool *p); /* NULL-safe */
void lethe_cpu_pool_run(lethe_cpu_pool *p, int n_threads, int n_tasks, lethe_cpu_task_fn fn,
                        void *ctx);
/* the backend's pool: lethe_cpu_pool_run(ctx->pool, ...) */
void lethe_cpu_parallel(lethe_backend *be, int n_threads, int n_tasks, lethe_cpu_task_fn fn,
                        void *ctx);

/* qmatmul.c: the stored-format weight registry */
lethe_status lethe_cpu_weight_upload_raw(lethe_backend *be, const lethe_weight_raw *w,
                                         void **out);
/* the stored-format weight whose data is p, NULL when p is not one (an f32
 * weight or activation); a pointer INSIDE one is a bug (asserted) */
const lethe_cpu_qweight *lethe_cpu_qweight_find(const lethe_backend *be, const void *p);
/* removes p from the registry and frees it; false when p is not one */
bool lethe_cpu_qweight_release(lethe_backend *be, void *p);
void lethe_cpu_qweight_free_all(lethe_cpu_ctx *c);
/* y [n, rows] = x [n, cols] W^T for a stored-format W. With cpu_weights
 * EXACT (and for f16 / bf16 / formats without a qdot kernel) every element
 * is bit-identical to the f32 matmul on lethe_ggml_dequantize(W); with
 * NATIVE, block formats use 16-bit activations (qdot.h: error bound there) */
void lethe_cpu_qmatmul(lethe_backend *be, const lethe_cpu_qweight *w, float *y, const float *x,
                       int32_t n);
/* f32 rows [r0, r1) of W into dst [(r1 - r0), cols] */
void lethe_cpu_qweight_rows(const lethe_cpu_qweight *w, int32_t r0, int32_t r1, float *dst);

/* matmul.c: y[i*ldy + j] = dot(x row i, w row j) for i < m, j < nw (x, w
 * rows of `in` floats, contiguous), in the fixed order of the file comment */
void lethe_cpu_gemm_block(lethe_cpu_isa isa, const float *x, const float *w, float *y,
                          int32_t in, int32_t ldy, int32_t m, int32_t nw);
/* matmul_avx2.c: the same with AVX2/FMA (compiled with -mavx2 -mfma) */
void lethe_cpu_gemm_block_avx2(const float *x, const float *w, float *y, int32_t in,
                               int32_t ldy, int32_t m, int32_t nw);
/* scores_avx2.c: attn_scores' PROB_MAX | ROW_MAX path for one query head:
 * rows i < n_rows at qh + i * q_stride, keys kc + off[e] (float offsets) for
 * e < n_keys, row i seeing keys [0, n_keys - n_rows + i]; v [c1 - c0] = max
 * over rows of the softmax probability of keys [c0, c1); raw: scratch of
 * n_keys + 8 floats (compiled with -mavx2 -mfma) */
void lethe_cpu_scores_rowmax_avx2(const float *qh, size_t q_stride, int32_t n_rows,
                                  const float *kc, const int32_t *off, int32_t n_keys, int D,
                                  float scale, int32_t c0, int32_t c1, float *raw, float *v);
/* scores_avx2.c: raw[e] = scale * q . k_e for e < n, keys at kc + off[e]
 * (float offsets), each one fmaf chain over d as scores.c's scalar path */
void lethe_cpu_scores_raw_avx2(const float *q, const float *kc, const int32_t *off, int32_t n, int D,
                               float scale, float *raw);
/* redundancy_avx2.c: key_redundancy's AVX2 tier for one KV head (keys at
 * kc + slots[j] * stride + head_off). pack: kt [np / 8][D][8] (blocks of 8
 * keys, np = n rounded up to 8, zero padding) and nrm [np] = |k_j| + 1e-8; rows: for rows
 * [i0, i1) the lane sums sum[i], last[i] (-1: none) and clast[i], bit-identical
 * to redundancy.c's portable pass (compiled with -mavx2 -mfma) */
void lethe_cpu_redundancy_pack_avx2(const float *kc, const int32_t *slots, size_t stride, size_t head_off,
                                    int32_t n, int D, float *kt, int32_t np, float *nrm);
void lethe_cpu_redundancy_rows_avx2(const float *kc, const int32_t *slots, size_t stride, size_t head_off,
                                    const float *kt, int32_t np, int32_t n, int D, const float *nrm,
                                    float threshold, int32_t i0, int32_t i1, double *sum, int32_t *last,
                                    float *clast);
/* qmatmul_avx2.c: y[i*ldy + j - j0] = dot(x row i, W row j) for i < m <= 2,
 * j in [j0, j1), decoding the blocks in registers; false if the format has
 * no AVX2 kernel (the caller dequantizes rows instead) */
bool lethe_cpu_qrows_avx2(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const float *x,
                          int32_t m, float *y, int32_t ldy);

/* thread count for ops: be->n_threads, or all cores the process may use when 0 */
int lethe_cpu_threads(const lethe_backend *be);

void lethe_cpu_matmul(lethe_backend *be, void *y, const void *x, const void *w, int32_t n,
                      int32_t out_dim, int32_t in_dim);
void lethe_cpu_rmsnorm(lethe_backend *be, void *out, const void *x, const void *w, int32_t n_rows,
                       int32_t dim, float eps);
void lethe_cpu_rope(lethe_backend *be, void *x, const int32_t *pos, int32_t n, int32_t n_heads,
                    int32_t head_dim, const lethe_rope_config *rope);
void lethe_cpu_kv_store(lethe_backend *be, void *k_cache, void *v_cache, const void *k,
                        const void *v, const int32_t *slots, int32_t n, int32_t kv_dim);
void lethe_cpu_attention(lethe_backend *be, const lethe_attn_args *a);
/* attention_bsp.c: the block choice of block-sparse prefill (a->bsp), per
 * sequence (entries of dense sequences stay zero; NULL when none is sparse) */
typedef struct lethe_cpu_bsp {
    int32_t nqb, nkb;          /* query blocks, key blocks */
    uint8_t *keep;             /* [nqb, n_kv_heads, nkb]: 1 = read the key block */
    float *km, *vm;            /* [nkb, n_kv_heads, head_dim] mean K / V of each key block */
} lethe_cpu_bsp;
lethe_cpu_bsp *lethe_cpu_bsp_plan(const lethe_attn_args *a);
void lethe_cpu_bsp_free(lethe_cpu_bsp *p, int32_t n_seqs);
/* attention_quant.c: quantized KV formats (a->kvq), dispatched from lethe_cpu_attention */
void lethe_cpu_kv_store_quant(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                              void *v_cache, const void *k, const void *v, const int32_t *slots,
                              int32_t n, int32_t n_kv_heads, int32_t head_dim);
void lethe_cpu_attention_quant(lethe_backend *be, const lethe_attn_args *a);
/* attention_tq.c: TurboQuant KV (dispatched from the two above) */
void lethe_cpu_kv_store_tq(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                           void *v_cache, const void *k, const void *v, const int32_t *slots,
                           int32_t n, int32_t n_kv_heads, int32_t head_dim);
void lethe_cpu_attention_tq(lethe_backend *be, const lethe_attn_args *a);
void lethe_cpu_attn_scores(lethe_backend *be, const lethe_attn_scores_args *a);
void lethe_cpu_key_redundancy(lethe_backend *be, float *out, const void *k_cache, const int32_t *slots,
                              int32_t n, int32_t n_kv_heads, int32_t head_dim, float threshold);
void lethe_cpu_embed(lethe_backend *be, void *x, const void *table, const int32_t *tokens,
                     int32_t n, int32_t dim);
void lethe_cpu_gather_sum(lethe_backend *be, void *out, const void *src, const int32_t *idx, int32_t n,
                          int32_t n_idx, int32_t dim, float scale);
void lethe_cpu_gather_rows(lethe_backend *be, void *dst, const void *src, const int32_t *idx,
                           int32_t n, int32_t dim);
void lethe_cpu_add(lethe_backend *be, void *x, const void *y, size_t n);
void lethe_cpu_add_bias(lethe_backend *be, void *y, const void *b, int32_t n, int32_t dim);
void lethe_cpu_swiglu(lethe_backend *be, void *out, const void *gate, const void *up, size_t n);
/* clusters.c: RetroInfer's key clusters (backend.h "key clusters") */
void lethe_cpu_cluster_assign(lethe_backend *be, int32_t *out, const void *k_cache,
                              const int32_t *slots, int32_t n, const float *cent, const float *mean,
                              int32_t n_c, int32_t n_kv_heads, int32_t head_dim);
void lethe_cpu_cluster_scores(lethe_backend *be, float *out, const void *q, const void *cent,
                              int32_t n_q, const int32_t *q_rows, const int32_t *begin,
                              const int32_t *ids, int32_t n_heads, int32_t n_kv_heads,
                              int32_t head_dim, float scale);
void lethe_cpu_cluster_attention(lethe_backend *be, const lethe_cluster_attn_args *a);
void lethe_cpu_page_minmax(lethe_backend *be, void *meta, const void *k_cache,
                           const int32_t *page_ids, const int32_t *slot_begin, const int32_t *slots,
                           int32_t n_pages, int32_t kv_dim);
void lethe_cpu_page_scores(lethe_backend *be, float *out, const void *q, const void *meta,
                           int32_t n_seqs, const int32_t *q_rows, const int32_t *page_begin,
                           const int32_t *page_ids, int32_t n_heads, int32_t n_kv_heads,
                           int32_t head_dim, int32_t n_groups, bool out_on_backend);
/* select.c: device-side selection twins */
void lethe_cpu_topk(lethe_backend *be, int32_t *out, const float *scores, int32_t n_segs,
                    const int32_t *seg_begin, const int32_t *out_begin);
void lethe_cpu_select_expand(lethe_backend *be, int32_t *out, const int32_t *rows,
                             const int32_t *picks, const lethe_expand_seq *seqs, int32_t n_seqs,
                             int32_t unit);
void lethe_cpu_row_topk(lethe_backend *be, int32_t *out, const void *scores, int32_t n, int32_t m,
                        const int32_t *lim, int32_t k, float alpha, const float *bias);
void lethe_cpu_sample(lethe_backend *be, const lethe_sample_args *a);
/* moe.c: routing + expert FFNs (backend.h lethe_moe_args); the routing of one
 * token alone (ids, wts [k]), also the reference of the CUDA comparison test */
void lethe_cpu_moe(lethe_backend *be, const lethe_moe_args *a);
/* mla.c: latent attention (backend.h); attention_latent is reached through
 * lethe_cpu_attention when v_cache is NULL */
void lethe_cpu_matmul_heads(lethe_backend *be, void *y, int32_t y_ld, int32_t y_hs, const void *x,
                            int32_t x_ld, int32_t x_hs, const void *w, int32_t n, int32_t n_heads,
                            int32_t out, int32_t in);
void lethe_cpu_copy_block(lethe_backend *be, void *dst, int32_t dst_ld, int32_t dst_off,
                          const int32_t *rows, const void *src, int32_t src_ld, int32_t n_rows,
                          int32_t width);
void lethe_cpu_attention_latent(lethe_backend *be, const lethe_attn_args *a);
/* transfer.c: rows to / from the host (the host KV tier; memcpy) */
void lethe_cpu_rows_to_host(lethe_backend *be, void *host, const void *buf, size_t row_bytes,
                            const int32_t *rows, int32_t n);
void lethe_cpu_rows_from_host(lethe_backend *be, void *buf, size_t row_bytes, const int32_t *rows,
                              int32_t n, const void *host);
void lethe_cpu_moe_route_row(const float *logits, const float *bias, int32_t n_experts, int32_t k,
                             int32_t scoring, bool norm_topk, float scale, int32_t n_group,
                             int32_t topk_group, int32_t *ids, float *wts);
void lethe_cpu_sample_free(lethe_cpu_ctx *c);
/* gdn.c: hybrid linear attention (backend.h lethe_gdn_args) */
void lethe_cpu_gdn_conv(lethe_backend *be, const lethe_gdn_args *a);
void lethe_cpu_gdn_rule(lethe_backend *be, const lethe_gdn_args *a);
void lethe_cpu_rmsnorm_gated(lethe_backend *be, void *out, const void *x, const void *z,
                             const void *w, int32_t n_rows, int32_t dim, float eps);
void lethe_cpu_sigmoid_mul(lethe_backend *be, void *x, const void *g, size_t n);
void lethe_cpu_state_copy(lethe_backend *be, void *buf, size_t row_bytes, int32_t dst, int32_t src);

/* RoPE inverse frequencies [head_dim/2] exactly as HF computes them in fp32
 * (rope_type default / linear / llama3). Shared with tests and the CUDA
 * backend's host-side setup. */
void lethe_rope_inv_freq(const lethe_rope_config *rope, int32_t head_dim, float *inv_freq);

#endif /* LETHE_BACKEND_CPU_OPS_H */

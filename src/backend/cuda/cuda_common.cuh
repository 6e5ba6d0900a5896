/* cuda_common.cuh - shared state and helpers of the CUDA backend (internal).
 *
 * The CUDA backend keeps weights, activations and KV in bf16 on the device
 * (act_size = kv_size = 2) and accumulates in fp32. Everything runs on one
 * stream owned by the backend, so ops are ordered without host syncs; only
 * the host-transfer ops (act_to_host, logits_to_host, sync) wait.
 *
 * Index arrays (tokens, positions, slots, selections) that are already int32
 * device memory (written by an op such as topk / select_expand) are read in
 * place; host index arrays reach kernels in one of two ways:
 *   - staged per op through a pinned host ring + device ring (eager path):
 *     memcpy into pinned memory, one cudaMemcpyAsync; a full ring syncs the
 *     stream once and starts over, so nothing is allocated per op;
 *   - pre-staged once per step by ops->stage_step (one device buffer per
 *     array, stable addresses): an op whose host pointer and length match a
 *     pre-staged array reads the device copy. This is what lets a decode step
 *     be captured in a CUDA graph and replayed after re-staging new values.
 *
 * Files (one per op family, mirroring backend/cpu/):
 *   backend_cuda.cu  ops table, memory, transfers, staging, graphs
 *   matmul.cu        cuBLAS bf16 GEMM (fp32 accumulation), small-batch GEMV
 *   norm.cu          RMSNorm (also per-head q/k norm)
 *   rope.cu          rotate-half RoPE with NONE / LINEAR / LLAMA3 scaling
 *   attention.cu     dispatch, generic split-K flash attention (any head_dim), LSE merge
 *   attention_v2.cu  v2: mma.sync + cp.async decode and prefill (head_dim 64/128)
 *   attention_quant.cu  kv_store + attention over quantized KV (FP8 E4M3, KIVI)
 *   attention_fp8.cu FP8 E4M3 decode attention on tensor cores (head_dim 64/128)
 *   attention_tq.cu  kv_store + attention over TurboQuant KV (rotated codebook codes)
 *   scores.cu        attn_scores: reduced per-key scores for the sparse methods
 *   elementwise.cu   embed, gather_rows, gather_sum, add, add_bias, swiglu, kv_store, casts
 *   pages.cu         Quest page bounds: page_minmax, page_scores
 *   clusters.cu      RetroInfer key clusters: cluster_assign, cluster_scores, cluster_attention
 *   sample.cu        GPU sampling (greedy / temperature / top-k / top-p / min-p)
 *   select.cu        device-side selection: segmented exact top-k, select_expand, row_topk
 *   moe.cu           mixture-of-experts FFN: routing, expert sort, expert GEMV / cuBLAS GEMMs
 *   mla.cu           latent attention: per-head batched GEMM, block copy, latent-V split-K
 *   gdn.cu           Gated DeltaNet: causal conv, chunked / one-step delta rule, gated norm */
#ifndef LETHE_BACKEND_CUDA_COMMON_CUH
#define LETHE_BACKEND_CUDA_COMMON_CUH

/* the C headers' _Noreturn is C11; C++ spells it [[noreturn]] */
#ifndef _Noreturn
#define _Noreturn [[noreturn]]
#endif

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "backend/backend.h"
}

typedef __nv_bfloat16 bf16;

/* Checks a CUDA runtime call in an op: ops cannot fail, so an error here is a
 * device fault or a bug; it aborts with file:line and the CUDA message. */
#define CU_CHECK(call)                                                                     \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) lethe_cuda_fatal_(#call, cudaGetErrorString(e_), __FILE__, __LINE__); \
    } while (0)
#define CU_LAUNCH_CHECK() CU_CHECK(cudaGetLastError())

extern "C" [[noreturn]] void lethe_cuda_fatal_(const char *what, const char *msg, const char *file,
                                            int line);

#define LETHE_CUDA_MAX_STAGED 24
#define LETHE_CUDA_MAX_GRAPHS 64

typedef struct cuda_staged {
    const int32_t *host;   /* host pointer the caller staged (identity key) */
    size_t n;              /* elements */
    int32_t *dev;          /* device copy (stable address while capacity holds) */
    size_t cap;            /* elements */
} cuda_staged;

/* an index array staged through the ring earlier (lethe_cuda_stage_idx
 * reuses its device copy when the same contents come again: the per-layer
 * arrays of a sparse method are the same in every layer of a step) */
#define LETHE_CUDA_RECENT 16
typedef struct cuda_recent {
    const int32_t *h;      /* the ring's pinned copy (holds the contents) */
    const int32_t *dev;    /* the ring's device copy */
    size_t n;              /* elements (0: empty entry) */
    uint64_t gen;          /* ring generation it lives in */
} cuda_recent;

typedef struct cuda_graph_rec {
    int32_t key;
    cudaGraphExec_t exec;
    size_t logits_n;       /* floats copied from the pinned logits buffer after replay */
} cuda_graph_rec;

typedef struct cuda_ctx {
    int device;
    int n_sms;
    size_t smem_optin;           /* max dynamic shared memory per block */
    bool matmul_cublas_only;     /* LETHE_MATMUL=cublas (matmul.cu) */
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *cublas_ws;
    size_t cublas_ws_size;

    /* eager staging ring: pinned host + device, same offsets */
    char *ring_h, *ring_d;
    size_t ring_cap, ring_off;
    uint64_t ring_gen;           /* bumped when the ring wraps or grows (old copies die) */
    cuda_recent recent[LETHE_CUDA_RECENT];
    int recent_next;             /* round-robin replacement */

    /* pre-staged step arrays */
    cuda_staged staged[LETHE_CUDA_MAX_STAGED];
    int n_staged;
    int32_t *stage_h;            /* pinned scratch used to upload staged arrays */
    size_t stage_h_cap;          /* elements */

    /* fp32 device scratch (casts for host transfers, scores) + pinned output */
    float *f32_d;
    size_t f32_cap;
    float *f32_h;                /* pinned, for captured logits */
    size_t f32_h_cap;

    /* attention split-K workspace: partial O [.., D] and LSE, fp32 */
    float *attn_ws;
    size_t attn_ws_cap;          /* floats */

    /* split-K workspace of the quantized-KV attention (attention_quant.cu), fp32 */
    float *qattn_ws;
    size_t qattn_ws_cap;         /* bytes */

    /* TurboQuant prefill scratch (attention_tq.cu): dequantized K / V of a
     * step's selection, bf16, and the host identity selection */
    void *tq_ws;
    size_t tq_ws_cap;            /* bytes */
    int32_t *tq_iota;
    size_t tq_iota_n;

    /* block-sparse prefill plan (attention_bsp.cu): block means, lists */
    void *bsp_ws;
    size_t bsp_ws_cap;           /* bytes */

    /* GEMM attention scratch (attention_gemm.cu): S fp32 + P bf16 of a row block */
    void *gemm_attn_ws;
    size_t gemm_attn_ws_cap;     /* bytes */

    /* attn_scores scratch (scores.cu), fp32; mean queries (LETHE_SCORES_QMEAN), bf16 */
    float *scores_d;
    size_t scores_cap;           /* bytes */
    void *qmean_ws;
    size_t qmean_ws_cap;         /* bytes */

    /* cluster_assign scratch (clusters.cu): centroids, means, assignments */
    void *clu_d;
    size_t clu_cap; /* bytes */

    /* sampling scratch */
    void *sample_ws;
    size_t sample_ws_cap;

    /* host KV tier staging (transfer.cu): device rows gathered / to scatter, pinned host copy */
    void *xfer_d;
    size_t xfer_d_cap;
    void *xfer_h;
    size_t xfer_h_cap;

    /* CUDA graphs */
    size_t step_logits_n;        /* logits floats sent to the host since stage_step */
    bool capturing;
    float *capture_logits_dst;   /* host dst seen by logits_to_host during capture */
    size_t capture_logits_n;
    cuda_graph_rec graphs[LETHE_CUDA_MAX_GRAPHS];
    int n_graphs;
} cuda_ctx;

static inline cuda_ctx *cuda_ctx_of(lethe_backend *be) { return (cuda_ctx *)be->ctx; }

/* Device view of an index array of n int32: the pre-staged copy when (host,
 * n) lies within one (checked first: no runtime call); the pointer itself
 * when it is device (or managed) memory, e.g. a topk / select_expand output
 * (cudaPointerGetAttributes); otherwise a host array, staged now through the
 * ring (not allowed during graph capture: captured kernels must read stable
 * pre-staged buffers). */
const int32_t *lethe_cuda_stage_idx(cuda_ctx *c, const int32_t *host, size_t n);
/* Device scratch of at least n_bytes from the eager ring (valid until the
 * ring wraps, i.e. for the ops enqueued right after). */
void *lethe_cuda_ring_alloc(cuda_ctx *c, size_t n_bytes, void **host_view);
/* Grows a device buffer (stream synced first; never during capture). */
void lethe_cuda_reserve(cuda_ctx *c, void **buf, size_t *cap_bytes, size_t need_bytes);

static inline unsigned lethe_cuda_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 0x7fffffff ? 0x7fffffff : (b ? b : 1));
}

/* Launchers (one extern "C" entry per op, all on c->stream). */
extern "C" {
void lethe_cuda_matmul(lethe_backend *be, void *y, const void *x, const void *w, int32_t n,
                       int32_t out_dim, int32_t in_dim);
void lethe_cuda_rmsnorm(lethe_backend *be, void *out, const void *x, const void *w,
                        int32_t n_rows, int32_t dim, float eps);
void lethe_cuda_rope(lethe_backend *be, void *x, const int32_t *pos, int32_t n, int32_t n_heads,
                     int32_t head_dim, const lethe_rope_config *rope);
void lethe_cuda_attention(lethe_backend *be, const lethe_attn_args *a);
void lethe_cuda_attn_scores(lethe_backend *be, const lethe_attn_scores_args *a);
void lethe_cuda_key_redundancy(lethe_backend *be, float *out, const void *k_cache, const int32_t *slots,
                               int32_t n, int32_t n_kv_heads, int32_t head_dim, float threshold);
void lethe_cuda_embed(lethe_backend *be, void *x, const void *table, const int32_t *tokens,
                      int32_t n, int32_t dim);
void lethe_cuda_gather_rows(lethe_backend *be, void *dst, const void *src, const int32_t *idx,
                            int32_t n, int32_t dim);
void lethe_cuda_gather_sum(lethe_backend *be, void *out, const void *src, const int32_t *idx, int32_t n,
                           int32_t n_idx, int32_t dim, float scale);
void lethe_cuda_add(lethe_backend *be, void *x, const void *y, size_t n);
void lethe_cuda_add_bias(lethe_backend *be, void *y, const void *b, int32_t n, int32_t dim);
void lethe_cuda_swiglu(lethe_backend *be, void *out, const void *gate, const void *up, size_t n);
void lethe_cuda_kv_store(lethe_backend *be, void *k_cache, void *v_cache, const void *k,
                         const void *v, const int32_t *slots, int32_t n, int32_t kv_dim);
/* attention_quant.cu: quantized KV formats (backend.h lethe_kv_format) */
void lethe_cuda_kv_store_quant(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                               void *v_cache, const void *k, const void *v, const int32_t *slots,
                               int32_t n, int32_t n_kv_heads, int32_t head_dim);
void lethe_cuda_attention_quant(lethe_backend *be, const lethe_attn_args *a);
/* attention_fp8.cu: FP8 E4M3 decode (every sequence one query) at head_dim 64
 * / 128 on tensor cores; fits: the kernel's shared memory fits this device */
bool lethe_cuda_attn_fp8_fits(const cuda_ctx *c, int D);
void lethe_cuda_attn_decode_fp8(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                const int32_t *d_sb, const int32_t *d_sel);
/* attention_tq.cu: TurboQuant KV (dispatched from the two above) */
void lethe_cuda_kv_store_tq(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                            void *v_cache, const void *k, const void *v, const int32_t *slots,
                            int32_t n, int32_t n_kv_heads, int32_t head_dim);
void lethe_cuda_attention_tq(lethe_backend *be, const lethe_attn_args *a);
/* Quest page bounds (pages.cu) */
void lethe_cuda_page_minmax(lethe_backend *be, void *meta, const void *k_cache,
                            const int32_t *page_ids, const int32_t *slot_begin,
                            const int32_t *slots, int32_t n_pages, int32_t kv_dim);
void lethe_cuda_page_scores(lethe_backend *be, float *out, const void *q, const void *meta,
                            int32_t n_seqs, const int32_t *q_rows, const int32_t *page_begin,
                            const int32_t *page_ids, int32_t n_heads, int32_t n_kv_heads,
                            int32_t head_dim, int32_t n_groups, bool out_on_backend);
/* RetroInfer key clusters (clusters.cu) */
void lethe_cuda_cluster_assign(lethe_backend *be, int32_t *out, const void *k_cache,
                               const int32_t *slots, int32_t n, const float *cent,
                               const float *mean, int32_t n_c, int32_t n_kv_heads,
                               int32_t head_dim);
void lethe_cuda_cluster_scores(lethe_backend *be, float *out, const void *q, const void *cent,
                               int32_t n_q, const int32_t *q_rows, const int32_t *begin,
                               const int32_t *ids, int32_t n_heads, int32_t n_kv_heads,
                               int32_t head_dim, float scale);
void lethe_cuda_cluster_attention(lethe_backend *be, const lethe_cluster_attn_args *a);
void lethe_cuda_sample(lethe_backend *be, const lethe_sample_args *a); /* sample.cu */
/* device-side selection (select.cu) */
void lethe_cuda_topk(lethe_backend *be, int32_t *out, const float *scores, int32_t n_segs,
                     const int32_t *seg_begin, const int32_t *out_begin);
void lethe_cuda_row_topk(lethe_backend *be, int32_t *out, const void *scores, int32_t n, int32_t m,
                         const int32_t *lim, int32_t k, float alpha, const float *bias);
void lethe_cuda_select_expand(lethe_backend *be, int32_t *out, const int32_t *rows,
                              const int32_t *picks, const lethe_expand_seq *seqs, int32_t n_seqs,
                              int32_t unit);
void lethe_cuda_moe(lethe_backend *be, const lethe_moe_args *a); /* moe.cu */
/* gdn.cu: hybrid linear attention (backend.h lethe_gdn_args) */
void lethe_cuda_gdn_conv(lethe_backend *be, const lethe_gdn_args *a);
void lethe_cuda_gdn_rule(lethe_backend *be, const lethe_gdn_args *a);
void lethe_cuda_rmsnorm_gated(lethe_backend *be, void *out, const void *x, const void *z,
                              const void *w, int32_t n_rows, int32_t dim, float eps);
void lethe_cuda_sigmoid_mul(lethe_backend *be, void *x, const void *g, size_t n);
void lethe_cuda_state_copy(lethe_backend *be, void *buf, size_t row_bytes, int32_t dst, int32_t src);
/* mla.cu: latent attention */
void lethe_cuda_matmul_heads(lethe_backend *be, void *y, int32_t y_ld, int32_t y_hs, const void *x,
                             int32_t x_ld, int32_t x_hs, const void *w, int32_t n, int32_t n_heads,
                             int32_t out, int32_t in);
void lethe_cuda_copy_block(lethe_backend *be, void *dst, int32_t dst_ld, int32_t dst_off,
                           const int32_t *rows, const void *src, int32_t src_ld, int32_t n_rows,
                           int32_t width);
void lethe_cuda_attention_latent(lethe_backend *be, const lethe_attn_args *a);
/* transfer.cu: rows to / from the host (the host KV tier) */
void lethe_cuda_rows_to_host(lethe_backend *be, void *host, const void *buf, size_t row_bytes,
                             const int32_t *rows, int32_t n);
void lethe_cuda_rows_from_host(lethe_backend *be, void *buf, size_t row_bytes, const int32_t *rows,
                               int32_t n, const void *host);
/* casts on c->stream */
void lethe_cuda_bf16_to_f32(cuda_ctx *c, float *dst, const void *src, size_t n);
void lethe_cuda_f32_to_bf16(cuda_ctx *c, void *dst, const float *src, size_t n);
}

#endif /* LETHE_BACKEND_CUDA_COMMON_CUH */

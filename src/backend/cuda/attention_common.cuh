/* attention_common.cuh - helpers shared by the attention kernels (internal).
 *
 * attention.cu holds the dispatcher, the generic split-K kernel (decode at any
 * head_dim the v2 kernels do not take) and the LSE merge; attention_gemm.cu
 * prefill at those head_dims as cuBLAS GEMMs; attention_v2.cu the v2
 * kernels (mma.sync bf16 + cp.async pipelines, head_dim 64 / 128). Both
 * follow backend.h's lethe_attn_args semantics (the CPU twin is
 * backend/cpu/attention.c). dev/cuda/ builds on these launchers to compare
 * the kernel generations (the v1 prefill kernel lives there). */
#ifndef LETHE_BACKEND_CUDA_ATTENTION_COMMON_CUH
#define LETHE_BACKEND_CUDA_ATTENTION_COMMON_CUH

#include "backend/cuda/cuda_common.cuh"

#define LOG2E 1.4426950408889634f
#define SPLIT_MAX 64 /* most split-K chunks per (row, KV head) */

__device__ __forceinline__ int seq_of_row(const int32_t *q_begin, int n_seqs, int32_t r) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (q_begin[mid] <= r) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Key range of item (query row) r: sel + [0, n_ent). */
__device__ __forceinline__ void item_range(const int32_t *q_begin, const int32_t *sel_begin,
                                           int n_seqs, bool decode, int32_t r, int32_t *base,
                                           int32_t *n_ent) {
    int s = decode ? r : seq_of_row(q_begin, n_seqs, r);
    int32_t n_sel = sel_begin[s + 1] - sel_begin[s];
    int32_t n_q = decode ? 1 : q_begin[s + 1] - q_begin[s];
    int32_t j = decode ? 0 : r - q_begin[s];
    *base = sel_begin[s];
    *n_ent = n_sel - n_q + j + 1;
}

/* Keys per split-K chunk of a row with n_ent keys: whole multiples of gran.
 * The grid has n_splits chunks per row (fixed from the batch size, so it can
 * be captured); a row's effective count ceil(n_ent / chunk) comes from its
 * device-resident length, and blocks past it exit. */
__device__ __forceinline__ int32_t split_chunk(int32_t n_ent, int n_splits, int gran) {
    int32_t per = (n_ent + n_splits - 1) / n_splits;
    per = (per + gran - 1) / gran * gran;
    return per < gran ? gran : per;
}

/* Merges the split-K partials ws_o [items, n_heads, n_splits, D] (each
 * normalized) and ws_lse [items, n_heads, n_splits] (log2 domain) into out
 * rows [n_heads, D] bf16: item i is query row d_items[i] (d_items NULL: row
 * i). skip_single: rows with one effective split were written to out
 * directly by the split kernel and are left alone. */
void lethe_cuda_attn_merge(cuda_ctx *c, void *out, const int32_t *d_qb, const int32_t *d_sb,
                           int n_seqs, bool decode, int32_t n_items, int n_heads, int D,
                           int n_splits, int gran, bool skip_single, const int32_t *d_items,
                           const float *ws_o, const float *ws_lse);

/* The generic split-K attention (attention.cu) for any head_dim in 8..256,
 * D % 8 == 0, decode (every sequence one query) or not: split_kernel + the
 * merge. The dispatcher's path for shapes v2 does not take. */
void lethe_cuda_attn_split(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                           const int32_t *d_sb, const int32_t *d_sel, bool decode);
/* the same over n_items query rows only: item i is row d_items[i] (device;
 * d_items NULL: rows 0 .. n_items - 1, n_items == a->n_tokens); the other
 * rows of out are left alone */
void lethe_cuda_attn_split_items(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                 const int32_t *d_sb, const int32_t *d_sel, bool decode,
                                 int32_t n_items, const int32_t *d_items);

/* v2 launchers (attention_v2.cu); D is 64 or 128 (decode also 256). v2_fits: the shape is one
 * v2 takes (D 64/128) and both v2 kernels' shared memory fits this device's
 * opt-in limit. decode_v2: every sequence has one query (a->n_tokens ==
 * a->n_seqs). prefill_v2: any batch; sequences with a single query go to the
 * decode kernel (one block per KV head group and split instead of a 128-row
 * tile per head), the rest to the prefill kernel. */
bool lethe_cuda_attn_v2_fits(const cuda_ctx *c, int D);
/* decode_v2 alone also takes D 256 (two pipeline stages a warp, no prefill
 * kernel): true for 64 / 128 where v2_fits, and 256 where its shared memory
 * fits the opt-in limit */
bool lethe_cuda_attn_decode_v2_fits(const cuda_ctx *c, int D);
/* prefill / extend as cuBLAS GEMMs (attention_gemm.cu): any GQA group, any
 * selection (gathered into contiguous scratch), no per-head selections, not
 * in graph capture; sequences with few queries (decode rows of a mixed call)
 * go to split_kernel by item list. d_qb / d_sb / d_sel: the staged q_begin,
 * sel_begin, sel_slots. */
void lethe_cuda_attn_gemm(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                          const int32_t *d_sb, const int32_t *d_sel);
/* per-KV-head selections (attention_varlen.cu); d_qb: staged q_begin */
void lethe_cuda_attn_varlen(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb);
void lethe_cuda_attn_decode_v2(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                               const int32_t *d_sb, const int32_t *d_sel);
void lethe_cuda_attn_prefill_v2(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                const int32_t *d_sb, const int32_t *d_sel);

/* Block-sparse prefill (backend.h lethe_block_sparse; attention_bsp.cu builds
 * the plan, prefill_v2_kernel<D, true> reads it). Per (query block, KV head)
 * item = qblk * n_kv + kvh: */
typedef struct lethe_cuda_bsp_dev {
    const int32_t *counts;       /* [items, 2]: listed 64-key tiles, skipped key blocks */
    const int32_t *tiles;        /* [items, tiles_stride]: the 64-key tiles read, ascending */
    const int32_t *skips;        /* [items, skips_stride]: rows of km / vm (mean correction) */
    const bf16 *km, *vm;         /* [key blocks, n_kv, D]: mean K / V of each key block */
    int64_t tiles_stride, skips_stride;
} lethe_cuda_bsp_dev;
typedef struct lethe_cuda_bsp_plan {
    const int32_t *qblk_base;    /* host [n_seqs]: the sequence's first query block, -1 = dense */
    lethe_cuda_bsp_dev dev;
} lethe_cuda_bsp_plan;
/* prefill_v2 with a block-sparse plan (NULL = dense, lethe_cuda_attn_prefill_v2) */
void lethe_cuda_attn_prefill_v2_bsp(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                    const int32_t *d_sb, const int32_t *d_sel,
                                    const lethe_cuda_bsp_plan *bp);
/* the block-sparse entry of the dispatcher: builds the plan (attention_bsp.cu)
 * and runs prefill_v2 with it; head_dim 64 / 128 */
void lethe_cuda_attn_bsp(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                         const int32_t *d_sb, const int32_t *d_sel);

#endif /* LETHE_BACKEND_CUDA_ATTENTION_COMMON_CUH */

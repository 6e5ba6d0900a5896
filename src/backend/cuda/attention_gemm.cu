/* attention_gemm.cu - attention over dense per-sequence K / V rows as tensor-
 * core GEMMs (the dispatcher's path for lethe_attn_args.sel_dense prefill;
 * semantics and CPU twin as every attention: backend.h, cpu/attention.c).
 *
 * With sel_dense the keys of sequence s are the cache rows sel_begin[s] ..
 * sel_begin[s + 1] - 1 in order (latent attention's expanded prefill writes
 * its decompressed K / V that way, arch_mla.c), so a head's scores are one
 * GEMM. Per sequence (n_q queries over n_k keys), in blocks of rb query rows
 * sized so the scratch stays within GEMM_WS_BYTES:
 *   S[h, i, j] = scale * q[q0 + i, h] . K[k0 + j, h / G]   cuBLAS strided
 *                batched over the heads, bf16 in, fp32 out [H, rb, nk]
 *   P[h, i, j] = softmax_j(S[h, i, 0 .. lim_i]) (0 past lim_i, the causal
 *                limit n_k - n_q + i), fp32 max / sum, written bf16
 *   out[q0 + i, h] = sum_j P[h, i, j] V[k0 + j, h / G]    batched GEMM, fp32
 *                accumulation, bf16 out
 * nk = the block's last visible key + 1 (the causal part of the block only).
 * Heads share K / V by stride: G == 1 (a K row per head) or n_kv_heads == 1
 * (every head reads the same row: stride 0). Differences from the CPU: P is
 * rounded to bf16 before the PV product (as flash attention's bf16 P), and
 * the GEMMs sum in another order. Never inside graph capture (the scratch
 * may grow; decode rows never come here). */
#include "backend/cuda/attention_common.cuh"
#include "backend/args.h"

#include <stdio.h>

#define GEMM_WS_BYTES ((size_t)256 << 20) /* S fp32 + P bf16 of one row block */
#define SM_THREADS 256

/* one block per (row i of the block, head h): P = softmax of S over j <= lim */
__global__ void __launch_bounds__(SM_THREADS)
    gemm_softmax_kernel(const float *__restrict__ S, bf16 *__restrict__ P, int32_t rb,
                        int32_t nk, int32_t lim0) {
    __shared__ float red[SM_THREADS / 32];
    const int32_t i = blockIdx.x, h = blockIdx.y;
    const size_t row = ((size_t)h * rb + i) * nk;
    const int32_t lim = min(nk - 1, lim0 + i); /* keys 0 .. lim visible */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m = -INFINITY;
    for (int32_t j = threadIdx.x; j <= lim; j += SM_THREADS) m = fmaxf(m, S[row + j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < SM_THREADS / 32; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float l = 0.0f;
    for (int32_t j = threadIdx.x; j <= lim; j += SM_THREADS) l += expf(S[row + j] - m);
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    l = 0.0f;
    for (int w = 0; w < SM_THREADS / 32; w++) l += red[w];
    const float inv = 1.0f / l; /* lim >= 0: the row sees at least key 0 */
    for (int32_t j = threadIdx.x; j < nk; j += SM_THREADS)
        P[row + j] = __float2bfloat16(j <= lim ? expf(S[row + j] - m) * inv : 0.0f);
}

static void gemm_ok(cublasStatus_t st, const char *what, int32_t m, int32_t n, int32_t k) {
    if (st == CUBLAS_STATUS_SUCCESS) return;
    char buf[160];
    snprintf(buf, sizeof buf, "attention_gemm %s cublasGemmStridedBatchedEx(m=%d, n=%d, k=%d)",
             what, m, n, k);
    lethe_cuda_fatal_(buf, cublasGetStatusString(st), __FILE__, __LINE__);
}

void lethe_cuda_attn_gemm(cuda_ctx *c, const lethe_attn_args *a) {
    const int H = a->n_heads, KV = a->n_kv_heads, D = a->head_dim, G = H / KV;
    LETHE_ASSERT(a->sel_dense && !a->head_sel_begin && !c->capturing && (G == 1 || KV == 1));
    for (int32_t i = 0; i < a->sel_begin[a->n_seqs]; i++)
        LETHE_ASSERT(a->sel_slots[i] == i && "sel_dense: the selection must be the identity");
    const bf16 *q = (const bf16 *)a->q, *kc = (const bf16 *)a->k_cache;
    const bf16 *vc = (const bf16 *)a->v_cache;
    bf16 *out = (bf16 *)a->out;
    /* per-head strides of K / V rows [n, KV, D] (0: one row shared by every head) */
    const long long kv_hs = KV == 1 ? 0 : D;
    const int kv_ld = KV * D, q_ld = H * D;
    const float one = 1.0f, zero = 0.0f;
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const int32_t q0 = a->q_begin[s], n_q = a->q_begin[s + 1] - q0;
        const int32_t k0 = a->sel_begin[s], n_k = a->sel_begin[s + 1] - k0;
        if (n_q == 0) continue;
        LETHE_ASSERT(n_k >= n_q);
        const size_t per_row = (size_t)H * n_k * (sizeof(float) + sizeof(bf16));
        int32_t rb = (int32_t)(GEMM_WS_BYTES / per_row);
        rb = rb < 1 ? 1 : rb > n_q ? n_q : rb;
        lethe_cuda_reserve(c, &c->gemm_attn_ws, &c->gemm_attn_ws_cap, (size_t)rb * per_row + 256);
        for (int32_t i0 = 0; i0 < n_q; i0 += rb) {
            const int32_t nr = min(rb, n_q - i0);
            const int32_t lim0 = n_k - n_q + i0;      /* last key row i0 sees */
            const int32_t nk = min(n_k, lim0 + nr);   /* keys any row of the block sees */
            float *S = (float *)c->gemm_attn_ws;
            bf16 *P = (bf16 *)((char *)c->gemm_attn_ws + ((size_t)H * nr * nk * sizeof(float) + 255) / 256 * 256);
            /* column-major: S_h^T [nk, nr] = K_h [nk, D] q_h^T [D, nr] */
            gemm_ok(cublasGemmStridedBatchedEx(
                        c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, nk, nr, D, &a->scale,
                        kc + (size_t)k0 * kv_ld, CUDA_R_16BF, kv_ld, kv_hs,
                        q + (size_t)(q0 + i0) * q_ld, CUDA_R_16BF, q_ld, (long long)D, &zero, S,
                        CUDA_R_32F, nk, (long long)nr * nk, H, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT),
                    "scores", nk, nr, D);
            gemm_softmax_kernel<<<dim3((unsigned)nr, (unsigned)H), SM_THREADS, 0, c->stream>>>(
                S, P, nr, nk, lim0);
            CU_LAUNCH_CHECK();
            /* out_h^T [D, nr] = V_h^T [D, nk] P_h^T [nk, nr] */
            gemm_ok(cublasGemmStridedBatchedEx(
                        c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, D, nr, nk, &one,
                        vc + (size_t)k0 * kv_ld, CUDA_R_16BF, kv_ld, kv_hs, P, CUDA_R_16BF, nk,
                        (long long)nr * nk, &zero, out + (size_t)(q0 + i0) * q_ld, CUDA_R_16BF,
                        q_ld, (long long)D, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "pv", D, nr, nk);
        }
    }
}

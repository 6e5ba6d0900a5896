/* matmul.cu - y[n, out] = x[n, in] W[out, in]^T on the CUDA backend.
 *
 * bf16 inputs and output, fp32 accumulation (CUBLAS_COMPUTE_32F), through
 * cuBLAS. In cuBLAS's column-major terms the row-major product is
 *   Y^T[out, n] = W^T'[out, in] X^T[in, n]
 * i.e. gemm(op_T, op_N, m = out, n = n, k = in, A = W (ld in), B = x (ld in),
 * C = y (ld out)). cuBLAS picks its tensor-core kernels (Hopper: wgmma);
 * its workspace is fixed at backend creation so the call is safe inside
 * graph capture. Decode-sized n (<= 4) takes the GEMV kernel below
 * (LETHE_MATMUL=cublas sends those to cuBLAS as well).
 *
 * Tried and measured (H200, dummy Llama-3.1-8B decode at batch 8, 4K
 * context, CUDA graphs, 3 alternating repeats; a13a00a): a skinny
 * tensor-core kernel for 4 < n <= 16 (mma m16n8k16 with the weights as A,
 * double-buffered 16-byte loads, split-K across blocks reduced in-kernel)
 * reached 1107-1124 tok/s against cuBLAS's 1176-1192 (batch 16: 1681-1754
 * vs 1866-1895), so cuBLAS keeps those sizes; the kernel is in git history. */
#include "backend/cuda/cuda_common.cuh"

#include <stdio.h>

/* Small-batch path (n <= GEMV_MAX_N, decode): one warp per output row
 * streams W's row with 16-byte loads (all issued before use) and reuses each
 * W element for the n input rows; x rows come through L1. cuBLAS picks
 * kernels tuned for larger n; at n = 1..4 the step is pure weight streaming,
 * and this keeps it at the memory roofline. Needs in_dim % 8 == 0. */
#define GEMV_MAX_N 4
#define GEMV_WARPS 8
#define GEMV_UNROLL 4

__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ x, const bf16 *__restrict__ w,
            int32_t n, int32_t out_dim, int32_t in_dim) {
    const int lane = threadIdx.x % 32;
    const int32_t row = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (row >= out_dim) return;
    const uint4 *wr = (const uint4 *)(w + (size_t)row * in_dim);
    const int32_t nv = in_dim / 8;
    float acc[GEMV_MAX_N] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int32_t v0 = 0; v0 < nv; v0 += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int32_t v = v0 + u * 32 + lane;
            wv[u] = v < nv ? __ldcs(wr + v) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int32_t v = v0 + u * 32 + lane;
            if (v >= nv) break;
            const __nv_bfloat162 *w2 = (const __nv_bfloat162 *)&wv[u];
#pragma unroll
            for (int r = 0; r < GEMV_MAX_N; r++) {
                if (r >= n) break;
                uint4 xv = __ldg((const uint4 *)(x + (size_t)r * in_dim) + v);
                const __nv_bfloat162 *x2 = (const __nv_bfloat162 *)&xv;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float2 a = __bfloat1622float2(w2[k]), b = __bfloat1622float2(x2[k]);
                    acc[r] += a.x * b.x + a.y * b.y;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_N; r++) {
        if (r >= n) break;
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) y[(size_t)r * out_dim + row] = __float2bfloat16(v);
    }
}

extern "C" void lethe_cuda_matmul(lethe_backend *be, void *y, const void *x, const void *w,
                                  int32_t n, int32_t out_dim, int32_t in_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && out_dim > 0 && in_dim > 0);
    if (!n) return;
    if (n <= GEMV_MAX_N && in_dim % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)w % 16 == 0 &&
        !c->matmul_cublas_only) {
        gemv_kernel<<<(unsigned)((out_dim + GEMV_WARPS - 1) / GEMV_WARPS), GEMV_WARPS * 32, 0,
                      c->stream>>>((bf16 *)y, (const bf16 *)x, (const bf16 *)w, n, out_dim, in_dim);
        CU_LAUNCH_CHECK();
        return;
    }
    const float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t st = cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out_dim, n, in_dim,
                                     &alpha, w, CUDA_R_16BF, in_dim, x, CUDA_R_16BF, in_dim, &beta,
                                     y, CUDA_R_16BF, out_dim, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cublasGemmEx(n=%d, out=%d, in=%d)", n, out_dim, in_dim);
        lethe_cuda_fatal_(what, cublasGetStatusString(st), __FILE__, __LINE__);
    }
}

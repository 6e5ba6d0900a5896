/* matmul.cu - y[n, out] = x[n, in] W[out, in]^T on the CUDA backend.
 *
 * bf16 inputs and output, fp32 accumulation (CUBLAS_COMPUTE_32F), through
 * cuBLAS. In cuBLAS's column-major terms the row-major product is
 *   Y^T[out, n] = W^T'[out, in] X^T[in, n]
 * i.e. gemm(op_T, op_N, m = out, n = n, k = in, A = W (ld in), B = x (ld in),
 * C = y (ld out)). cuBLAS picks its tensor-core kernels (Hopper: wgmma) for
 * both prefill-sized and decode-sized n; its workspace is fixed at backend
 * creation so the call is safe inside graph capture. */
#include "backend/cuda/cuda_common.cuh"

#include <stdio.h>

extern "C" void lethe_cuda_matmul(lethe_backend *be, void *y, const void *x, const void *w,
                                  int32_t n, int32_t out_dim, int32_t in_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && out_dim > 0 && in_dim > 0);
    if (!n) return;
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

/* matmul.cu - y[n, out] = x[n, in] W[out, in]^T on the CUDA backend.
 *
 * bf16 inputs and output, fp32 accumulation (CUBLAS_COMPUTE_32F), through
 * cuBLAS. In cuBLAS's column-major terms the row-major product is
 *   Y^T[out, n] = W^T'[out, in] X^T[in, n]
 * i.e. gemm(op_T, op_N, m = out, n = n, k = in, A = W (ld in), B = x (ld in),
 * C = y (ld out)). cuBLAS picks its tensor-core kernels (Hopper: wgmma);
 * its workspace is fixed at backend creation so the call is safe inside
 * graph capture. Decode-sized n takes a kernel of its own: n <= 4 the GEMV
 * kernel (CUDA cores), 4 < n <= 16 the skinny tensor-core kernel. */
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

/* ---- skinny tensor-core path (4 < n <= 16, decode batches) ---------------
 *
 * Why: at n = 8 cuBLAS(Lt) picks split-K kernels plus separate reduce
 * kernels and streams the weights at 30-80 % of DRAM bandwidth (ncu, H200,
 * Llama-3.1-8B decode: 147 us of GEMM per layer for 91 us of weight bytes).
 * The product is weight streaming; this kernel keeps many 16-byte weight
 * loads in flight and does the math on tensor cores, "swapped": the weight
 * tile is the mma's A (16 output rows x 16 k), the activations its B
 * (16 k x 8 batch rows), so one m16n8k16 covers 8 batch rows at once.
 *
 * Block = SK_WARPS warps over one tile of 16 * RT output rows; the warps
 * split K (warp w takes the 32-element k chunks w, w + SK_WARPS, ...) and
 * meet in shared memory at the end (summed in warp order: deterministic).
 * In a chunk, lane (g = lane / 4, t = lane % 4) loads W[row g][k0 + 8t, +8)
 * and W[row g + 8][...] (16 bytes each) and x[batch g][k0 + 8t, +8). The sum
 * over k does not care about the order of k, so the mma's logical k slots
 * {2t, 2t+1, 2t+8, 2t+9} of thread t are fed physical k {8t..8t+3} (first
 * mma of the chunk) and {8t+4..8t+7} (second), the same permutation for A
 * and B. Accumulation is fp32. Needs in_dim % 8 == 0, 16-byte aligned x and
 * w; rows past out_dim and batch rows past n read zeros. */
#define SK_WARPS 8
#define SK_UNROLL 4
#define SK_MAX_N 16

__device__ __forceinline__ void mma_bf16_16816(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
    asm(/* pure: lets the scheduler keep the loads ahead of the mmas */
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* RT: 16-row tiles per block; NT: 8-row batch tiles (n <= 8 * NT) */
template <int RT, int NT>
__global__ void __launch_bounds__(SK_WARPS * 32)
skinny_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ x, const bf16 *__restrict__ w,
              int32_t n, int32_t out_dim, int32_t in_dim) {
    __shared__ float red[SK_WARPS][RT * 16][NT * 8 + 1]; /* [warp][row][batch] partial sums */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int32_t row0 = blockIdx.x * RT * 16;
    const int32_t n_chunks = (in_dim + 31) / 32;
    /* this lane's weight rows (NULL: past out_dim) and batch rows */
    const uint4 *wr[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int32_t r = row0 + rt * 16 + h * 8 + g;
            wr[rt][h] = r < out_dim ? (const uint4 *)(w + (size_t)r * in_dim) : NULL;
        }
    const uint4 *xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int32_t b = nt * 8 + g;
        xr[nt] = b < n ? (const uint4 *)(x + (size_t)b * in_dim) : NULL;
    }
    const int32_t nv = in_dim / 8; /* 16-byte pieces per row */
    float acc[RT][NT][4];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[rt][nt][i] = 0.0f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int32_t c0 = warp; c0 < n_chunks; c0 += SK_WARPS * SK_UNROLL) {
        uint4 wv[SK_UNROLL][RT][2], xv[SK_UNROLL][NT];
        /* every load of the SK_UNROLL chunks first */
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
            const int32_t v = (c0 + u * SK_WARPS) * 4 + t; /* piece index */
            const bool in = v < nv;
#pragma unroll
            for (int rt = 0; rt < RT; rt++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    wv[u][rt][h] = in && wr[rt][h] ? __ldcs(wr[rt][h] + v) : zero;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) xv[u][nt] = in && xr[nt] ? __ldg(xr[nt] + v) : zero;
        }
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
#pragma unroll
            for (int rt = 0; rt < RT; rt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 a = wv[u][rt][0], b = wv[u][rt][1], q = xv[u][nt];
                    mma_bf16_16816(acc[rt][nt], a.x, b.x, a.y, b.y, q.x, q.y);
                    mma_bf16_16816(acc[rt][nt], a.z, b.z, a.w, b.w, q.z, q.w);
                }
        }
    }
    /* C fragment: c0, c1 = (row g, batch 2t, 2t+1), c2, c3 = (row g + 8, ...) */
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                red[warp][rt * 16 + g + (i >> 1) * 8][nt * 8 + 2 * t + (i & 1)] = acc[rt][nt][i];
    __syncthreads();
    for (int e = threadIdx.x; e < RT * 16 * NT * 8; e += SK_WARPS * 32) {
        const int r = e % (RT * 16), b = e / (RT * 16); /* consecutive threads: consecutive rows */
        const int32_t row = row0 + r;
        if (row >= out_dim || b >= n) continue;
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < SK_WARPS; k++) v += red[k][r][b];
        y[(size_t)b * out_dim + row] = __float2bfloat16(v);
    }
}

template <int NT>
static void launch_skinny(cuda_ctx *c, bf16 *y, const bf16 *x, const bf16 *w, int32_t n,
                          int32_t out_dim, int32_t in_dim) {
    /* two row tiles per block when that still gives two blocks per SM:
     * halves the activation reads per weight byte */
    if ((int64_t)out_dim >= (int64_t)32 * 2 * c->n_sms) {
        skinny_kernel<2, NT><<<(unsigned)((out_dim + 31) / 32), SK_WARPS * 32, 0, c->stream>>>(
            y, x, w, n, out_dim, in_dim);
    } else {
        skinny_kernel<1, NT><<<(unsigned)((out_dim + 15) / 16), SK_WARPS * 32, 0, c->stream>>>(
            y, x, w, n, out_dim, in_dim);
    }
    CU_LAUNCH_CHECK();
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
    if (n <= SK_MAX_N && in_dim % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)w % 16 == 0 &&
        !c->matmul_cublas_only) {
        if (n <= 8)
            launch_skinny<1>(c, (bf16 *)y, (const bf16 *)x, (const bf16 *)w, n, out_dim, in_dim);
        else
            launch_skinny<2>(c, (bf16 *)y, (const bf16 *)x, (const bf16 *)w, n, out_dim, in_dim);
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

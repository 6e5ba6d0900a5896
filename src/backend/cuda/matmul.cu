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
 * Why: at n = 8 cuBLAS picks split-K kernels plus separate reduce kernels
 * and streams the weights at 30-80 % of DRAM bandwidth (ncu, H200, Llama-
 * 3.1-8B decode: 147 us of GEMM per layer for 91 us of weight bytes). The
 * product is weight streaming; this kernel keeps many 16-byte weight loads
 * in flight and does the math on tensor cores, "swapped": the weight tile is
 * the mma's A (16 output rows x 16 k), the activations its B (16 k x 8 batch
 * rows), so one m16n8k16 covers 8 batch rows at once.
 *
 * Grid (row tiles of 16, K splits S). Block = SK_WARPS warps over its tile's
 * k chunks (32 elements) [s * cps, (s + 1) * cps): warp w takes chunks
 * w, w + SK_WARPS, ..., SK_UNROLL chunks' loads issued before their mmas.
 * In a chunk, lane (g = lane / 4, t = lane % 4) loads W[row g][k0 + 8t, +8)
 * and W[row g + 8][...] (16 bytes each) and x[batch g][k0 + 8t, +8). The sum
 * over k does not care about the order of k, so the mma's logical k slots
 * {2t, 2t+1, 2t+8, 2t+9} of thread t are fed physical k {8t..8t+3} (first
 * mma of the chunk) and {8t+4..8t+7} (second), the same permutation for A
 * and B. The warps meet in shared memory (summed in warp order). With S > 1
 * each block stores its fp32 partial tile in c->skinny_ws, and the last
 * block of a tile to finish (a counter per tile, reset by that block, so a
 * graph replay finds zeros) sums the S partials in split order: one kernel,
 * deterministic. S is chosen so that small products (k / v projections)
 * still spread over every SM. Accumulation is fp32. Needs in_dim % 8 == 0,
 * 16-byte aligned x and w; rows past out_dim and batch rows past n read
 * zeros. */
#define SK_WARPS 4
#define SK_UNROLL 4
#define SK_MAX_N 16
#define SK_BLOCKS_PER_SM 4 /* target resident blocks: sizes S */
#define SK_MAX_SPLIT 8

__device__ __forceinline__ void mma_bf16_16816(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
    asm(/* pure: lets the scheduler keep the loads ahead of the mmas */
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* NT: 8-row batch tiles (n <= 8 * NT) */
template <int NT>
__global__ void __launch_bounds__(SK_WARPS * 32)
skinny_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ x, const bf16 *__restrict__ w,
              int32_t n, int32_t out_dim, int32_t in_dim, int32_t cps, float *__restrict__ ws,
              int32_t *__restrict__ tile_count) {
    __shared__ float red[SK_WARPS][16][NT * 8 + 1]; /* [warp][row][batch] partial sums */
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int32_t tile = blockIdx.x, S = gridDim.y, s = blockIdx.y, row0 = tile * 16;
    const int32_t n_chunks = (in_dim + 31) / 32;
    const int32_t ch_end = min(n_chunks, (s + 1) * cps);
    /* this lane's weight rows and batch rows, clamped to real ones: every
     * load is unconditional (a branch per load would serialize them), and
     * the results of rows past out_dim / batch rows past n are not stored */
    const uint4 *wr[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
        wr[h] = (const uint4 *)(w + (size_t)min(row0 + h * 8 + g, out_dim - 1) * in_dim);
    const uint4 *xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = (const uint4 *)(x + (size_t)min(nt * 8 + g, n - 1) * in_dim);
    const int32_t nv = in_dim / 8; /* 16-byte pieces per row */
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.0f;
    /* Double-buffered: the loads of the next SK_UNROLL chunks are issued
     * before the mmas of the current ones. (Written as one loop of loads
     * then mmas, ptxas interleaved them load-use and a warp had one chunk
     * in flight; warps issue in order, so the mma stalled the next loads.) */
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 wv[SK_UNROLL][2], xv[SK_UNROLL][NT];
    auto load = [&](int32_t c0) {
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
            const int32_t ch = c0 + u * SK_WARPS, v = ch * 4 + t; /* piece index */
            const bool in = ch < ch_end && v < nv;
            const int32_t vc = in ? v : 0; /* a k tail loads piece 0 and zeroes x's */
#pragma unroll
            for (int h = 0; h < 2; h++) wv[u][h] = __ldcs(wr[h] + vc);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 q = __ldg(xr[nt] + vc);
                xv[u][nt] = in ? q : zero;
            }
        }
    };
    int32_t c0 = s * cps + warp;
    load(c0);
    for (; c0 < ch_end; c0 += SK_WARPS * SK_UNROLL) {
        uint4 cw[SK_UNROLL][2], cx[SK_UNROLL][NT];
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
            cw[u][0] = wv[u][0], cw[u][1] = wv[u][1];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) cx[u][nt] = xv[u][nt];
        }
        if (c0 + SK_WARPS * SK_UNROLL < ch_end) load(c0 + SK_WARPS * SK_UNROLL);
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 a = cw[u][0], b = cw[u][1], q = cx[u][nt];
                mma_bf16_16816(acc[nt], a.x, b.x, a.y, b.y, q.x, q.y);
                mma_bf16_16816(acc[nt], a.z, b.z, a.w, b.w, q.z, q.w);
            }
        }
    }
    /* C fragment: c0, c1 = (row g, batch 2t, 2t+1), c2, c3 = (row g + 8, ...) */
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][g + (i >> 1) * 8][nt * 8 + 2 * t + (i & 1)] = acc[nt][i];
    __syncthreads();
    constexpr int TILE = 16 * NT * 8; /* partial tile [batch][row] */
    if (S == 1) {
        for (int e = threadIdx.x; e < TILE; e += SK_WARPS * 32) {
            const int r = e % 16, b = e / 16; /* consecutive threads: consecutive rows */
            if (row0 + r >= out_dim || b >= n) continue;
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < SK_WARPS; k++) v += red[k][r][b];
            y[(size_t)b * out_dim + row0 + r] = __float2bfloat16(v);
        }
        return;
    }
    float *part = ws + ((size_t)tile * S + s) * TILE;
    for (int e = threadIdx.x; e < TILE; e += SK_WARPS * 32) {
        const int r = e % 16, b = e / 16;
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < SK_WARPS; k++) v += red[k][r][b];
        part[e] = v;
    }
    __threadfence(); /* the partial is visible device-wide before the count says so */
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&tile_count[tile], 1) == S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float *parts = ws + (size_t)tile * S * TILE;
    for (int e = threadIdx.x; e < TILE; e += SK_WARPS * 32) {
        const int r = e % 16, b = e / 16;
        if (row0 + r >= out_dim || b >= n) continue;
        float v = 0.0f;
        for (int k = 0; k < S; k++) v += __ldcg(parts + (size_t)k * TILE + e); /* L2: other blocks' */
        y[(size_t)b * out_dim + row0 + r] = __float2bfloat16(v);
    }
    if (threadIdx.x == 0) tile_count[tile] = 0; /* ready for the next call (or graph replay) */
}

/* workspace for S > 1: S * n_tiles < SK_BLOCKS_PER_SM * n_sms + n_tiles and
 * n_tiles < SK_BLOCKS_PER_SM * n_sms there, so a fixed size covers every call */
static void skinny_ws(cuda_ctx *c) {
    if (c->skinny_ws) return;
    LETHE_ASSERT(!c->capturing);
    const size_t tiles = (size_t)SK_BLOCKS_PER_SM * c->n_sms;
    CU_CHECK(cudaMalloc((void **)&c->skinny_ws, 2 * tiles * 16 * SK_MAX_N * sizeof(float)));
    CU_CHECK(cudaMalloc((void **)&c->skinny_count, tiles * sizeof(int32_t)));
    CU_CHECK(cudaMemsetAsync(c->skinny_count, 0, tiles * sizeof(int32_t), c->stream));
}

template <int NT>
static void launch_skinny(cuda_ctx *c, bf16 *y, const bf16 *x, const bf16 *w, int32_t n,
                          int32_t out_dim, int32_t in_dim) {
    const int32_t tiles = (out_dim + 15) / 16, n_chunks = (in_dim + 31) / 32;
    const int32_t target = SK_BLOCKS_PER_SM * c->n_sms;
    int32_t S = tiles >= target ? 1 : (target + tiles - 1) / tiles;
    S = min(S, min(SK_MAX_SPLIT, max(1, n_chunks / (SK_WARPS * 2)))); /* >= 2 chunks per warp */
    const int32_t cps = (n_chunks + S - 1) / S;
    S = (n_chunks + cps - 1) / cps; /* no empty split */
    if (S > 1) skinny_ws(c);
    LETHE_ASSERT(S == 1 || (tiles < target && (size_t)tiles * S <= 2 * (size_t)target));
    skinny_kernel<NT><<<dim3((unsigned)tiles, (unsigned)S), SK_WARPS * 32, 0, c->stream>>>(
        y, x, w, n, out_dim, in_dim, cps, c->skinny_ws, c->skinny_count);
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

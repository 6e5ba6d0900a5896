/* norm.cu - RMSNorm for the CUDA backend (HF LlamaRMSNorm semantics):
 *
 *   r      = 1 / sqrt(mean(x^2) + eps)      (fp32 sum of squares)
 *   out[i] = w[i] * (x[i] * r)               (fp32 math, one bf16 rounding)
 *
 * x, out: [n_rows, dim] bf16, w: [dim] bf16; out may alias x (each thread
 * rewrites only the elements it read). One block per row, 16-byte loads when
 * dim % 8 == 0. Also serves Qwen3's per-head q/k norm (rows = tokens*heads,
 * dim = head_dim), where a block is one warp. */
#include "backend/cuda/cuda_common.cuh"

__device__ __forceinline__ float block_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    if (n_warps == 1) return v;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

template <bool VEC>
__global__ void rmsnorm_kernel(bf16 *out, const bf16 *x, const bf16 *__restrict__ w, int32_t dim,
                               float eps) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const bf16 *xr = x + row * dim;
    bf16 *outr = out + row * dim;
    float ss = 0.0f;
    if (VEC) {
        for (int32_t j = threadIdx.x * 8; j < dim; j += blockDim.x * 8) {
            uint4 u = *(const uint4 *)(xr + j);
            const __nv_bfloat162 *p = (const __nv_bfloat162 *)&u;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float2 f = __bfloat1622float2(p[k]);
                ss += f.x * f.x + f.y * f.y;
            }
        }
    } else {
        for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) {
            float f = __bfloat162float(xr[j]);
            ss += f * f;
        }
    }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)dim + eps);
    if (VEC) {
        for (int32_t j = threadIdx.x * 8; j < dim; j += blockDim.x * 8) {
            uint4 u = *(const uint4 *)(xr + j), wu = *(const uint4 *)(w + j), o;
            const __nv_bfloat162 *p = (const __nv_bfloat162 *)&u, *wp = (const __nv_bfloat162 *)&wu;
            __nv_bfloat162 *op = (__nv_bfloat162 *)&o;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float2 f = __bfloat1622float2(p[k]), g = __bfloat1622float2(wp[k]);
                op[k] = __floats2bfloat162_rn(g.x * (f.x * r), g.y * (f.y * r));
            }
            *(uint4 *)(outr + j) = o;
        }
    } else {
        for (int32_t j = threadIdx.x; j < dim; j += blockDim.x)
            outr[j] = __float2bfloat16(__bfloat162float(w[j]) * (__bfloat162float(xr[j]) * r));
    }
}

extern "C" void lethe_cuda_rmsnorm(lethe_backend *be, void *out, const void *x, const void *w,
                                   int32_t n_rows, int32_t dim, float eps) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n_rows >= 0 && dim > 0);
    if (!n_rows) return;
    bool vec = dim % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)out % 16 == 0 &&
               (uintptr_t)w % 16 == 0;
    int per = vec ? dim / 8 : dim;
    int threads = (per + 31) / 32 * 32;
    if (threads > 1024) threads = 1024;
    if (vec)
        rmsnorm_kernel<true><<<n_rows, threads, 0, c->stream>>>((bf16 *)out, (const bf16 *)x,
                                                                (const bf16 *)w, dim, eps);
    else
        rmsnorm_kernel<false><<<n_rows, threads, 0, c->stream>>>((bf16 *)out, (const bf16 *)x,
                                                                 (const bf16 *)w, dim, eps);
    CU_LAUNCH_CHECK();
}

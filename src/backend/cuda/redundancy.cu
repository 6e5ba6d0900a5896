/* redundancy.cu - key_redundancy on the CUDA backend (R-KV's redundancy term;
 * semantics: backend.h ops->key_redundancy; CPU twin cpu/redundancy.c).
 *
 * Two kernels per call, all KV heads at once:
 *  1. norms: a thread per (key, KV head): |k| + 1e-8 (fp32 fmaf chain).
 *  2. rows: block = (RD_ROWS keys i, KV head), a warp per key i with k_i in
 *     shared memory (fp32); the lanes stride over the keys j (each lane one
 *     fp32 dot over head_dim from the bf16 K row), keep a partial sum of
 *     c(i, j) and the largest j > i with c > threshold; warp reductions give
 *     the row's sum and last(i) (with its c).
 * The [3, n_kv_heads, n] results (sum, last, c) come to the host, where the
 * newest-copy rule (out[last(i)] -= c(i, last(i))) and the division by n
 * run exactly as on the CPU. Differences from the CPU twin: fp32 sums in
 * another order (CPU: double in j order), so ~1e-6 relative; a cosine within
 * rounding of the threshold may pick another last(i). Work O(n^2 d) per head
 * on CUDA cores; scratch O(n) (the attn_scores scratch, c->scores_d). */
#include "backend/cuda/cuda_common.cuh"

#include <stdlib.h>

#define RD_ROWS 8 /* warps (keys i) per block */
#define RD_DMAX LETHE_SCORES_HEAD_DIM_MAX /* latent KV rows (576) fit */

__global__ void rd_norms_kernel(const bf16 *__restrict__ kc, const int32_t *__restrict__ slots,
                                int32_t n, int n_kv, int D, float *__restrict__ nrm) {
    const int32_t e = blockIdx.x * blockDim.x + threadIdx.x;
    const int h = blockIdx.y;
    if (e >= n) return;
    const bf16 *k = kc + ((size_t)slots[e] * n_kv + h) * D;
    float acc = 0.0f;
    for (int d = 0; d < D; d++) {
        const float x = __bfloat162float(k[d]);
        acc = fmaf(x, x, acc);
    }
    nrm[(size_t)h * n + e] = sqrtf(acc) + 1e-8f;
}

__global__ void __launch_bounds__(RD_ROWS * 32)
    rd_rows_kernel(const bf16 *__restrict__ kc, const int32_t *__restrict__ slots, int32_t n,
                   int n_kv, int D, float thr, const float *__restrict__ nrm,
                   float *__restrict__ sum, int32_t *__restrict__ last, float *__restrict__ clast) {
    __shared__ float ks[RD_ROWS][RD_DMAX];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, h = blockIdx.y;
    const int32_t i = blockIdx.x * RD_ROWS + w;
    if (i < n) {
        const bf16 *k = kc + ((size_t)slots[i] * n_kv + h) * D;
        for (int d = lane; d < D; d += 32) ks[w][d] = __bfloat162float(k[d]);
    }
    __syncthreads();
    if (i >= n) return;
    const float ni = nrm[(size_t)h * n + i];
    float s = 0.0f, cl = 0.0f;
    int32_t jl = -1;
    for (int32_t j = lane; j < n; j += 32) {
        if (j == i) continue;
        const bf16 *kj = kc + ((size_t)slots[j] * n_kv + h) * D;
        float acc = 0.0f;
        for (int d = 0; d < D; d++) acc = fmaf(ks[w][d], __bfloat162float(kj[d]), acc);
        const float c = acc / (ni * nrm[(size_t)h * n + j]);
        s += c;
        if (j > i && c > thr) jl = j, cl = c; /* j ascends per lane: the lane's largest */
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        const int32_t oj = __shfl_xor_sync(0xffffffffu, jl, o);
        const float oc = __shfl_xor_sync(0xffffffffu, cl, o);
        if (oj > jl) jl = oj, cl = oc;
    }
    if (lane == 0) {
        sum[(size_t)h * n + i] = s;
        last[(size_t)h * n + i] = jl;
        clast[(size_t)h * n + i] = cl;
    }
}

extern "C" void lethe_cuda_key_redundancy(lethe_backend *be, float *out, const void *k_cache,
                                          const int32_t *slots, int32_t n, int32_t n_kv_heads,
                                          int32_t head_dim, float threshold) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && n_kv_heads > 0 && head_dim > 0 && head_dim <= RD_DMAX && !c->capturing);
    if (n == 0) return;
    const size_t m = (size_t)n_kv_heads * n;
    size_t cap = c->scores_cap;
    lethe_cuda_reserve(c, (void **)&c->scores_d, &cap, 4 * m * sizeof(float));
    c->scores_cap = cap;
    float *nrm = c->scores_d, *sum = nrm + m, *clast = sum + m;
    int32_t *last = (int32_t *)(clast + m);
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)n);
    const bf16 *kc = (const bf16 *)k_cache;
    rd_norms_kernel<<<dim3(lethe_cuda_blocks((size_t)n, 256), (unsigned)n_kv_heads), 256, 0,
                      c->stream>>>(kc, d_slots, n, n_kv_heads, head_dim, nrm);
    CU_LAUNCH_CHECK();
    rd_rows_kernel<<<dim3((unsigned)((n + RD_ROWS - 1) / RD_ROWS), (unsigned)n_kv_heads),
                     RD_ROWS * 32, 0, c->stream>>>(kc, d_slots, n, n_kv_heads, head_dim, threshold,
                                                   nrm, sum, last, clast);
    CU_LAUNCH_CHECK();
    float *h = (float *)malloc(3 * m * sizeof(float));
    LETHE_ASSERT(h);
    CU_CHECK(cudaMemcpyAsync(h, sum, 3 * m * sizeof(float), cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    const float *hs = h, *hc = h + m;
    const int32_t *hl = (const int32_t *)(h + 2 * m);
    /* the newest-copy rule and the mean, as on the CPU (cpu/redundancy.c) */
    double *acc = (double *)malloc((size_t)n * sizeof(double));
    LETHE_ASSERT(acc);
    for (int32_t k = 0; k < n_kv_heads; k++) {
        const size_t o = (size_t)k * n;
        for (int32_t i = 0; i < n; i++) acc[i] = hs[o + i];
        for (int32_t i = 0; i < n; i++)
            if (hl[o + i] >= 0) acc[hl[o + i]] -= hc[o + i];
        for (int32_t i = 0; i < n; i++) out[o + i] = (float)(acc[i] / n);
    }
    free(acc);
    free(h);
}

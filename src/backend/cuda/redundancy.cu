/* redundancy.cu - key_redundancy on the CUDA backend (R-KV's redundancy term;
 * semantics: backend.h ops->key_redundancy; CPU twin cpu/redundancy.c).
 *
 * The O(n^2 d) dots run on tensor cores; everything else is O(n) or a read
 * of the dots:
 *  1. gather: the keys of every KV head into contiguous rows, kg [n_kv, n, d]
 *     bf16 (the cache rows slots[e] are scattered and interleave the heads),
 *     with the norms |k| + 1e-8 (fp32 fmaf chain) [n_kv, n].
 *  2. per tile of T query keys i (T sized so the tile's scores stay within
 *     RD_TILE_BYTES): one strided-batched cuBLAS GEMM over the heads,
 *     S [n_kv, T, n] fp32 = kg[h, i0 .. i0 + T) . kg[h]^T (bf16 products are
 *     exact in fp32, fp32 accumulation), then a warp per (row i, head) reads
 *     its row of S coalesced: c(i, j) = S / (|k_i| |k_j|), the sum over j != i
 *     and the largest j > i with c > threshold (with its c).
 * The [3, n_kv_heads, n] results (sum, last, c) come to the host, where the
 * newest-copy rule (out[last(i)] -= c(i, last(i))) and the division by n
 * run exactly as on the CPU. Differences from the CPU twin: dots and sums in
 * another fp32 order (CPU: one fmaf chain per dot, double sums in j order),
 * so ~1e-6 relative; a cosine within rounding of the threshold may pick
 * another last(i). Scratch O(n d + RD_TILE_BYTES) (the attn_scores scratch,
 * c->scores_d); no n x n matrix exists. */
#include "backend/cuda/cuda_common.cuh"

#include <stdio.h>
#include <stdlib.h>

#define RD_ROWS 8                      /* warps (rows i) per block of the row pass */
#define RD_DMAX LETHE_SCORES_HEAD_DIM_MAX /* latent KV rows (576) fit */
#define RD_TILE_BYTES ((size_t)256 << 20)  /* fp32 scores of one tile, all heads */

/* kg[h, e, :] = k_cache[slots[e], h, :]; nrm[h, e] = |k| + 1e-8. A warp per
 * (key e, head h). */
__global__ void rd_gather_kernel(const bf16 *__restrict__ kc, const int32_t *__restrict__ slots,
                                 int32_t n, int n_kv, int D, bf16 *__restrict__ kg,
                                 float *__restrict__ nrm) {
    const int lane = threadIdx.x & 31, h = blockIdx.y;
    const int32_t e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (e >= n) return;
    const bf16 *k = kc + ((size_t)slots[e] * n_kv + h) * D;
    bf16 *o = kg + ((size_t)h * n + e) * D;
    for (int d = lane; d < D; d += 32) o[d] = k[d];
    if (lane == 0) { /* the CPU twin's fmaf chain in d order */
        float acc = 0.0f;
        for (int d = 0; d < D; d++) {
            const float x = __bfloat162float(k[d]);
            acc = fmaf(x, x, acc);
        }
        nrm[(size_t)h * n + e] = sqrtf(acc) + 1e-8f;
    }
}

/* rows [i0, i0 + T) of one tile: S [n_kv, T, n] fp32 dots; a warp per (row, head) */
__global__ void __launch_bounds__(RD_ROWS * 32)
    rd_rows_kernel(const float *__restrict__ S, int32_t i0, int32_t T, int32_t n, float thr,
                   const float *__restrict__ nrm, float *__restrict__ sum,
                   int32_t *__restrict__ last, float *__restrict__ clast) {
    const int lane = threadIdx.x & 31, h = blockIdx.y;
    const int32_t r = blockIdx.x * RD_ROWS + (threadIdx.x >> 5), i = i0 + r;
    if (r >= T) return;
    const float *srow = S + ((size_t)h * T + r) * n;
    const float *nh = nrm + (size_t)h * n;
    const float ni = nh[i];
    float s = 0.0f, cl = 0.0f;
    int32_t jl = -1;
    for (int32_t j = lane; j < n; j += 32) {
        if (j == i) continue;
        const float c = srow[j] / (ni * nh[j]);
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
    /* T rows per tile: the tile's scores within RD_TILE_BYTES (at least 32 rows) */
    const size_t row_bytes = m * sizeof(float);
    size_t tr = RD_TILE_BYTES / row_bytes;
    tr = tr < 32 ? 32 : tr;
    const int32_t T = (int32_t)(tr < (size_t)n ? tr : (size_t)n);
    /* scratch: nrm, sum, clast, last [m] each | kg [m, D] bf16 | S [n_kv, T, n] fp32 */
    const size_t kg_off = 4 * m * sizeof(float), kg_bytes = (m * head_dim * sizeof(bf16) + 255) & ~(size_t)255;
    const size_t s_off = kg_off + kg_bytes, need = s_off + (size_t)T * row_bytes;
    size_t cap = c->scores_cap;
    lethe_cuda_reserve(c, (void **)&c->scores_d, &cap, need);
    c->scores_cap = cap;
    float *nrm = c->scores_d, *sum = nrm + m, *clast = sum + m;
    int32_t *last = (int32_t *)(clast + m);
    bf16 *kg = (bf16 *)((char *)c->scores_d + kg_off);
    float *S = (float *)((char *)c->scores_d + s_off);
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)n);
    rd_gather_kernel<<<dim3((unsigned)((n + 7) / 8), (unsigned)n_kv_heads), 256, 0, c->stream>>>(
        (const bf16 *)k_cache, d_slots, n, n_kv_heads, head_dim, kg, nrm);
    CU_LAUNCH_CHECK();
    const float one = 1.0f, zero = 0.0f;
    const long long kstride = (long long)n * head_dim;
    for (int32_t i0 = 0; i0 < n; i0 += T) {
        const int32_t t = T < n - i0 ? T : n - i0;
        /* column-major view: S_h^T [n, t] (ld n) = kg_h [n, D] . kg_h[i0 .. i0 + t)^T */
        const cublasStatus_t st = cublasGemmStridedBatchedEx(
            c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, t, head_dim, &one, kg, CUDA_R_16BF, head_dim, kstride,
            kg + (size_t)i0 * head_dim, CUDA_R_16BF, head_dim, kstride, &zero, S, CUDA_R_32F, n,
            (long long)t * n, n_kv_heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS) {
            char what[112];
            snprintf(what, sizeof what, "key_redundancy cublasGemmStridedBatchedEx(n=%d, t=%d, d=%d, heads=%d)", n,
                     t, head_dim, n_kv_heads);
            lethe_cuda_fatal_(what, cublasGetStatusString(st), __FILE__, __LINE__);
        }
        rd_rows_kernel<<<dim3((unsigned)((t + RD_ROWS - 1) / RD_ROWS), (unsigned)n_kv_heads), RD_ROWS * 32, 0,
                         c->stream>>>(S, i0, t, n, threshold, nrm, sum, last, clast);
        CU_LAUNCH_CHECK();
    }
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

/* clusters.cu - key clusters on the CUDA backend (RetroInfer's wave index;
 * semantics: backend.h "key clusters"; CPU twin cpu/clusters.c).
 *
 *  cluster_assign: block = (CA_WARPS keys, KV head), a warp per key whose
 *    centred key (k - mean, fp32) the lanes hold in registers (head_dim / 32
 *    each); unit centroids pass through shared memory in tiles of CA_TILE,
 *    each warp reduces its dot per centroid with shuffles and keeps the first
 *    best (ties to the smaller c, as the CPU). fp32 in another order than the
 *    CPU's fmaf chain: a centroid within rounding of the best may win.
 *  cluster_scores: a warp per (query, cluster) entry, lanes over head_dim,
 *    the g query heads of the group summed in turn, then the mean and scale.
 *  cluster_attention: block = (query, query head), CW_WARPS warps; each warp
 *    walks its share of the exact keys and then the estimated clusters with
 *    an online softmax (running max m, denominator l, the lanes' slices of
 *    the numerator), an estimated cluster weighing count[c] in l and adding
 *    its value sum; the warps' states merge in shared memory. Work O(keys x
 *    head_dim) per query head on CUDA cores; reads every query head's keys
 *    separately (no GQA reuse).
 * Host index arrays are staged through the ring (lethe_cuda_stage_idx); the
 * centroids / means of assign go up through the backend's scratch
 * (c->clu_d), results of assign / scores come back synchronously. */
#include "backend/cuda/cuda_common.cuh"

#include <stdlib.h>
#include <string.h>

#define CA_WARPS 8
#define CA_TILE 16
#define CL_DMAX 256
#define CL_PER_LANE (CL_DMAX / 32)
#define CW_WARPS 4

__global__ void __launch_bounds__(CA_WARPS * 32)
    ca_kernel(const bf16 *__restrict__ kc, const int32_t *__restrict__ slots, int32_t n, int n_kv,
              int D, const float *__restrict__ cent, const float *__restrict__ mean, int32_t n_c,
              int32_t *__restrict__ out) {
    __shared__ float tile[CA_TILE][CL_DMAX];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, h = blockIdx.y;
    const int32_t e = blockIdx.x * CA_WARPS + w;
    float x[CL_PER_LANE];
    for (int j = 0; j < CL_PER_LANE; j++) {
        const int d = lane + 32 * j;
        x[j] = (e < n && d < D) ? __bfloat162float(kc[((size_t)slots[e] * n_kv + h) * D + d]) -
                                      mean[(size_t)h * D + d]
                                : 0.0f;
    }
    const float *ch = cent + (size_t)h * n_c * D;
    float best_s = -INFINITY;
    int32_t best = 0;
    for (int32_t c0 = 0; c0 < n_c; c0 += CA_TILE) {
        const int nt = min(CA_TILE, n_c - c0);
        __syncthreads();
        for (int i = threadIdx.x; i < nt * D; i += blockDim.x)
            tile[i / D][i % D] = ch[(size_t)c0 * D + i];
        __syncthreads();
        for (int t = 0; t < nt; t++) {
            float s = 0.0f;
            for (int j = 0; j < CL_PER_LANE; j++) {
                const int d = lane + 32 * j;
                if (d < D) s = fmaf(x[j], tile[t][d], s);
            }
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (s > best_s) best_s = s, best = c0 + t;
        }
    }
    if (e < n && lane == 0) out[(size_t)h * n + e] = best;
}

extern "C" void lethe_cuda_cluster_assign(lethe_backend *be, int32_t *out, const void *k_cache,
                                          const int32_t *slots, int32_t n, const float *cent,
                                          const float *mean, int32_t n_c, int32_t n_kv_heads,
                                          int32_t head_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && n_c >= 1 && n_kv_heads >= 1 && head_dim >= 1 && head_dim <= CL_DMAX &&
                 !c->capturing);
    if (n == 0) return;
    const size_t nc_f = (size_t)n_kv_heads * n_c * head_dim, mu_f = (size_t)n_kv_heads * head_dim;
    const size_t bytes = (nc_f + mu_f) * sizeof(float) + (size_t)n_kv_heads * n * sizeof(int32_t);
    size_t cap = c->clu_cap;
    lethe_cuda_reserve(c, &c->clu_d, &cap, bytes);
    c->clu_cap = cap;
    float *d_cent = (float *)c->clu_d, *d_mean = d_cent + nc_f;
    int32_t *d_out = (int32_t *)(d_mean + mu_f);
    CU_CHECK(
        cudaMemcpyAsync(d_cent, cent, nc_f * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    CU_CHECK(
        cudaMemcpyAsync(d_mean, mean, mu_f * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)n);
    ca_kernel<<<dim3((unsigned)((n + CA_WARPS - 1) / CA_WARPS), (unsigned)n_kv_heads),
                CA_WARPS * 32, 0, c->stream>>>((const bf16 *)k_cache, d_slots, n, n_kv_heads,
                                               head_dim, d_cent, d_mean, n_c, d_out);
    CU_LAUNCH_CHECK();
    CU_CHECK(cudaMemcpyAsync(out, d_out, (size_t)n_kv_heads * n * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
}

__global__ void cs_kernel(float *__restrict__ out, const bf16 *__restrict__ q,
                          const float *__restrict__ cent, const int32_t *__restrict__ owner,
                          const int32_t *__restrict__ q_rows, const int32_t *__restrict__ ids,
                          int32_t n_e, int H, int KH, int D, float scale) {
    const int lane = threadIdx.x & 31;
    const int32_t e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (e >= n_e) return;
    const int32_t i = owner[e] / KH, h = owner[e] % KH, g = H / KH;
    const float *cv = cent + (size_t)ids[e] * D;
    float s = 0.0f;
    for (int j = 0; j < g; j++) {
        const bf16 *qh = q + ((size_t)q_rows[i] * H + (size_t)h * g + j) * D;
        for (int d = lane; d < D; d += 32) s = fmaf(__bfloat162float(qh[d]), cv[d], s);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[e] = scale * (s / (float)g);
}

extern "C" void lethe_cuda_cluster_scores(lethe_backend *be, float *out, const void *q,
                                          const void *cent, int32_t n_q, const int32_t *q_rows,
                                          const int32_t *begin, const int32_t *ids, int32_t n_heads,
                                          int32_t n_kv_heads, int32_t head_dim, float scale) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n_q >= 0 && n_kv_heads >= 1 && n_heads % n_kv_heads == 0 && !c->capturing);
    const int32_t n_e = n_q ? begin[n_q * n_kv_heads] : 0;
    if (n_e == 0) return;
    int32_t *owner = (int32_t *)malloc((size_t)n_e * sizeof(int32_t));
    LETHE_ASSERT(owner);
    for (int32_t o = 0; o < n_q * n_kv_heads; o++)
        for (int32_t e = begin[o]; e < begin[o + 1]; e++) owner[e] = o;
    size_t cap = c->scores_cap;
    lethe_cuda_reserve(c, (void **)&c->scores_d, &cap, (size_t)n_e * sizeof(float));
    c->scores_cap = cap;
    const int32_t *d_owner = lethe_cuda_stage_idx(c, owner, (size_t)n_e);
    const int32_t *d_rows = lethe_cuda_stage_idx(c, q_rows, (size_t)n_q);
    const int32_t *d_ids = lethe_cuda_stage_idx(c, ids, (size_t)n_e);
    cs_kernel<<<lethe_cuda_blocks((size_t)n_e, 8), 256, 0, c->stream>>>(
        c->scores_d, (const bf16 *)q, (const float *)cent, d_owner, d_rows, d_ids, n_e, n_heads,
        n_kv_heads, head_dim, scale);
    CU_LAUNCH_CHECK();
    CU_CHECK(cudaMemcpyAsync(out, c->scores_d, (size_t)n_e * sizeof(float), cudaMemcpyDeviceToHost,
                             c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    free(owner);
}

/* one online-softmax step of a warp: logit s, weight wgt in the denominator, value row v (bf16 or f32) */
template <typename T>
__device__ __forceinline__ void cw_step(float s, float wgt, const T *v, int D, int lane, float &m,
                                        float &l, float *acc) {
    const float mn = fmaxf(m, s), corr = __expf(m - mn), p = __expf(s - mn);
    l = l * corr + wgt * p;
    for (int j = 0; j < CL_PER_LANE; j++) {
        const int d = lane + 32 * j;
        if (d < D) acc[j] = acc[j] * corr + p * (float)v[d];
    }
    m = mn;
}

__device__ __forceinline__ float cw_dot(const float *qs, const bf16 *k, int D, int lane) {
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s = fmaf(qs[d], __bfloat162float(k[d]), s);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}
__device__ __forceinline__ float cw_dotf(const float *qs, const float *k, int D, int lane) {
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s = fmaf(qs[d], k[d], s);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

__global__ void __launch_bounds__(CW_WARPS * 32)
    cw_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
              const bf16 *__restrict__ vc, const bf16 *__restrict__ ka, const bf16 *__restrict__ va,
              const float *__restrict__ cent, const float *__restrict__ vsum,
              const float *__restrict__ cnt, const int32_t *__restrict__ q_rows,
              const int32_t *__restrict__ xb, const int32_t *__restrict__ xs,
              const int32_t *__restrict__ eb, const int32_t *__restrict__ ei, int H, int KH, int D,
              float scale) {
    __shared__ float qs[CL_DMAX];
    __shared__ float sm[CW_WARPS], sl[CW_WARPS], sacc[CW_WARPS][CL_DMAX];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int32_t i = blockIdx.x, qh = blockIdx.y, g = H / KH, h = qh / g;
    const size_t qoff = ((size_t)q_rows[i] * H + qh) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = __bfloat162float(q[qoff + d]);
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[CL_PER_LANE];
    for (int j = 0; j < CL_PER_LANE; j++) acc[j] = 0.0f;
    const int32_t x0 = xb[i * KH + h], x1 = xb[i * KH + h + 1];
    for (int32_t e = x0 + w; e < x1; e += CW_WARPS) {
        const int32_t x = xs[e];
        const bf16 *k = x >= 0 ? kc + ((size_t)x * KH + h) * D : ka + (size_t)(-1 - x) * D;
        const bf16 *v = x >= 0 ? vc + ((size_t)x * KH + h) * D : va + (size_t)(-1 - x) * D;
        cw_step(scale * cw_dot(qs, k, D, lane), 1.0f, v, D, lane, m, l, acc);
    }
    const int32_t c0 = eb[i * KH + h], c1 = eb[i * KH + h + 1];
    for (int32_t e = c0 + w; e < c1; e += CW_WARPS) {
        const int32_t cl = ei[e];
        cw_step(scale * cw_dotf(qs, cent + (size_t)cl * D, D, lane), cnt[cl], vsum + (size_t)cl * D,
                D, lane, m, l, acc);
    }
    if (lane == 0) sm[w] = m, sl[w] = l;
    for (int j = 0; j < CL_PER_LANE; j++) {
        const int d = lane + 32 * j;
        if (d < D) sacc[w][d] = acc[j];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int k = 0; k < CW_WARPS; k++) M = fmaxf(M, sm[k]);
    float L = 0.0f;
    for (int k = 0; k < CW_WARPS; k++)
        if (sm[k] > -INFINITY) L += sl[k] * __expf(sm[k] - M);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int k = 0; k < CW_WARPS; k++)
            if (sm[k] > -INFINITY) a += sacc[k][d] * __expf(sm[k] - M);
        out[qoff + d] = __float2bfloat16(a / L);
    }
}

extern "C" void lethe_cuda_cluster_attention(lethe_backend *be, const lethe_cluster_attn_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(a->n_q >= 0 && a->n_kv_heads >= 1 && a->n_heads % a->n_kv_heads == 0);
    LETHE_ASSERT(a->head_dim >= 1 && a->head_dim <= CL_DMAX);
    if (a->n_q == 0) return;
    const size_t nb = (size_t)a->n_q * a->n_kv_heads + 1;
    const int32_t *d_rows = lethe_cuda_stage_idx(c, a->q_rows, (size_t)a->n_q);
    const int32_t *d_xb = lethe_cuda_stage_idx(c, a->x_begin, nb);
    const int32_t *d_xs = lethe_cuda_stage_idx(c, a->x_slots, (size_t)a->x_begin[nb - 1]);
    const int32_t *d_eb = lethe_cuda_stage_idx(c, a->e_begin, nb);
    const int32_t *d_ei = a->e_begin[nb - 1]
                              ? lethe_cuda_stage_idx(c, a->e_ids, (size_t)a->e_begin[nb - 1])
                              : NULL;
    cw_kernel<<<dim3((unsigned)a->n_q, (unsigned)a->n_heads), CW_WARPS * 32, 0, c->stream>>>(
        (bf16 *)a->out, (const bf16 *)a->q, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache,
        (const bf16 *)a->k_aux, (const bf16 *)a->v_aux, (const float *)a->cent,
        (const float *)a->vsum, (const float *)a->count, d_rows, d_xb, d_xs, d_eb, d_ei, a->n_heads,
        a->n_kv_heads, a->head_dim, a->scale);
    CU_LAUNCH_CHECK();
}

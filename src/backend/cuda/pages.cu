/* pages.cu - Quest page bounds on the CUDA backend (twin of cpu/pages.c).
 *
 *   page_minmax  meta[page_ids[i]] = (min, max) over keys k_cache[slots[j]],
 *                j in [slot_begin[i], slot_begin[i+1])   meta [n_meta, 2, kv_dim] bf16
 *   page_scores  out[i] = max_h sum_c max(q[h,c] min[kh,c], q[h,c] max[kh,c])  (host f32)
 *
 * page_minmax: one block per page, each thread owns VEC channels and folds
 * the page's slots in list order with strict < / > compares in fp32, the CPU
 * twin's rule; the result is a stored bf16 key value, so it is bit-identical
 * to the CPU twin on the same (bf16-representable) keys.
 *
 * page_scores: the decode-time cost of Quest, a pass over 2 / P of the keys
 * (bf16 bounds: 1/8 of K at P = 16). Grid (page tiles, sequences); the block
 * stages its sequence's query row [n_heads, head_dim] in shared memory as
 * fp32; a thread per (page, KV head) sums the group's query heads over the
 * channels in the CPU twin's order with the same float expressions, so the
 * scores are the CPU twin's (max is order-free). The op ends with a host sync
 * when its output is host;
 * with out_on_backend it is asynchronous. */
#include "backend/cuda/cuda_common.cuh"

#include <string.h>

/* ---- page_minmax ------------------------------------------------------- */

template <int VEC>
__device__ __forceinline__ void load_vec(bf16 *v, const bf16 *k) {
    if constexpr (VEC == 8) {
        *(uint4 *)v = *(const uint4 *)k;
    } else {
#pragma unroll
        for (int u = 0; u < VEC; u++) v[u] = k[u];
    }
}

template <int VEC>
__global__ void page_minmax_kernel(bf16 *__restrict__ meta, const bf16 *__restrict__ K,
                                   const int32_t *__restrict__ page_ids,
                                   const int32_t *__restrict__ slot_begin,
                                   const int32_t *__restrict__ slots, int32_t kv_dim) {
    const int32_t i = blockIdx.x, b = slot_begin[i], e = slot_begin[i + 1];
    bf16 *mn_out = meta + (size_t)page_ids[i] * 2 * kv_dim, *mx_out = mn_out + kv_dim;
    for (int32_t c0 = threadIdx.x * VEC; c0 < kv_dim; c0 += blockDim.x * VEC) {
        float mn[VEC], mx[VEC];
        {
            const bf16 *k = K + (size_t)slots[b] * kv_dim + c0;
            alignas(16) bf16 v[VEC];
            load_vec<VEC>(v, k);
#pragma unroll
            for (int u = 0; u < VEC; u++) mn[u] = mx[u] = __bfloat162float(v[u]);
        }
        for (int32_t j = b + 1; j < e; j++) {
            const bf16 *k = K + (size_t)slots[j] * kv_dim + c0;
            alignas(16) bf16 v[VEC];
            load_vec<VEC>(v, k);
#pragma unroll
            for (int u = 0; u < VEC; u++) {
                float x = __bfloat162float(v[u]);
                if (x < mn[u]) mn[u] = x;
                if (x > mx[u]) mx[u] = x;
            }
        }
#pragma unroll
        for (int u = 0; u < VEC; u++) { /* exact: both are bf16 values */
            mn_out[c0 + u] = __float2bfloat16_rn(mn[u]);
            mx_out[c0 + u] = __float2bfloat16_rn(mx[u]);
        }
    }
}

extern "C" void lethe_cuda_page_minmax(lethe_backend *be, void *meta, const void *k_cache,
                                       const int32_t *page_ids, const int32_t *slot_begin,
                                       const int32_t *slots, int32_t n_pages, int32_t kv_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n_pages >= 0 && kv_dim > 0);
    if (n_pages == 0) return;
    LETHE_ASSERT(n_pages <= 0x7fffffff && slot_begin[0] == 0);
    const int32_t *d_ids = lethe_cuda_stage_idx(c, page_ids, (size_t)n_pages);
    const int32_t *d_beg = lethe_cuda_stage_idx(c, slot_begin, (size_t)n_pages + 1);
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)slot_begin[n_pages]);
    const bool vec = kv_dim % 8 == 0 && (uintptr_t)meta % 16 == 0 && (uintptr_t)k_cache % 16 == 0;
    const int32_t per = vec ? kv_dim / 8 : kv_dim;
    const unsigned threads = per >= 256 ? 256 : (unsigned)((per + 31) / 32 * 32);
    if (vec)
        page_minmax_kernel<8><<<(unsigned)n_pages, threads, 0, c->stream>>>(
            (bf16 *)meta, (const bf16 *)k_cache, d_ids, d_beg, d_slots, kv_dim);
    else
        page_minmax_kernel<1><<<(unsigned)n_pages, threads, 0, c->stream>>>(
            (bf16 *)meta, (const bf16 *)k_cache, d_ids, d_beg, d_slots, kv_dim);
    CU_LAUNCH_CHECK();
}

/* ---- page_scores ------------------------------------------------------- */

#define PS_THREADS 256

/* grid: x = tile of PS_THREADS / n_kv_heads pages of sequence y. Thread t
 * takes page t / n_kv_heads of the tile and KV head kh = t % n_kv_heads: for
 * each query head h of that KV group, u_h = sum_c max(q_c mx_c, q_c mn_c)
 * over c in order (the CPU twin's expression and order: the same floats),
 * keeping the max over its heads; one thread per page then takes the max
 * over the KV heads. One (page, KV head) per thread gives the launch
 * n_pages x n_kv_heads threads (128K at 8 x 2048 pages x 8 KV heads) and no
 * shuffles; a thread's min / max rows (2 x head_dim) stream from L1 once per
 * query head of its group. */
__global__ void __launch_bounds__(PS_THREADS)
page_scores_kernel(float *__restrict__ out, const bf16 *__restrict__ Q,
                   const bf16 *__restrict__ meta, const int32_t *__restrict__ q_rows,
                   const int32_t *__restrict__ page_begin, const int32_t *__restrict__ page_ids,
                   int32_t n_heads, int32_t n_kv_heads, int32_t head_dim) {
    extern __shared__ float q_s[]; /* [n_heads * head_dim] */
    __shared__ float part[PS_THREADS];
    const int32_t s = blockIdx.y, ppb = PS_THREADS / n_kv_heads;
    const int32_t p0 = page_begin[s] + blockIdx.x * ppb;
    const int32_t p1 = min(p0 + ppb, page_begin[s + 1]);
    if (p0 >= p1) return; /* uniform over the block */
    const int32_t qd = n_heads * head_dim, kd = n_kv_heads * head_dim, g = n_heads / n_kv_heads;
    const bf16 *q = Q + (size_t)q_rows[s] * qd;
    for (int32_t i = threadIdx.x; i < qd; i += blockDim.x) q_s[i] = __bfloat162float(q[i]);
    __syncthreads();
    const int t = threadIdx.x, pl = t / n_kv_heads, kh = t - pl * n_kv_heads;
    float best = -INFINITY;
    if (pl < ppb && p0 + pl < p1) {
        const bf16 *pm = meta + (size_t)page_ids[p0 + pl] * 2 * kd + (size_t)kh * head_dim;
        const __nv_bfloat162 *mn = (const __nv_bfloat162 *)pm, *mx = (const __nv_bfloat162 *)(pm + kd);
        for (int32_t h = kh * g; h < (kh + 1) * g; h++) {
            const float *qh = q_s + h * head_dim;
            float u = 0.0f;
            for (int32_t cp = 0; cp < head_dim / 2; cp++) {
                const float2 lo = __bfloat1622float2(mn[cp]), hi = __bfloat1622float2(mx[cp]);
                const float a0 = qh[2 * cp] * hi.x, b0 = qh[2 * cp] * lo.x;
                u += a0 > b0 ? a0 : b0;
                const float a1 = qh[2 * cp + 1] * hi.y, b1 = qh[2 * cp + 1] * lo.y;
                u += a1 > b1 ? a1 : b1;
            }
            if (u > best) best = u;
        }
    }
    part[t] = best;
    __syncthreads();
    if (t < ppb && p0 + t < p1) {
        float b = -INFINITY;
        for (int32_t k = 0; k < n_kv_heads; k++) {
            const float v = part[t * n_kv_heads + k];
            if (v > b) b = v;
        }
        out[p0 + t] = b;
    }
}

extern "C" void lethe_cuda_page_scores(lethe_backend *be, float *out, const void *q,
                                       const void *meta, int32_t n_seqs, const int32_t *q_rows,
                                       const int32_t *page_begin, const int32_t *page_ids,
                                       int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                       bool out_on_backend) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing && "graph capture: page_scores stages its arguments");
    LETHE_ASSERT(n_seqs >= 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    LETHE_ASSERT(head_dim % 2 == 0 && n_kv_heads <= PS_THREADS);
    if (n_seqs == 0) return;
    LETHE_ASSERT(page_begin[0] == 0 && n_seqs <= 65535);
    const int32_t total = page_begin[n_seqs];
    if (total == 0) return;
    int32_t max_pages = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        LETHE_ASSERT(page_begin[s + 1] >= page_begin[s]);
        max_pages = max(max_pages, page_begin[s + 1] - page_begin[s]);
    }
    const size_t smem = (size_t)n_heads * head_dim * sizeof(float);
    LETHE_ASSERT(smem + PS_THREADS * sizeof(float) <= c->smem_optin &&
                 "page_scores: the query row does not fit in shared memory");
    if (smem > 48 * 1024) /* above the default: opt in (a cheap host call) */
        CU_CHECK(cudaFuncSetAttribute(page_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)smem));
    const int32_t *d_rows = lethe_cuda_stage_idx(c, q_rows, (size_t)n_seqs);
    const int32_t *d_beg = lethe_cuda_stage_idx(c, page_begin, (size_t)n_seqs + 1);
    const int32_t *d_ids = lethe_cuda_stage_idx(c, page_ids, (size_t)total);
    void *h_out = NULL;
    float *d_out = out_on_backend
                       ? out
                       : (float *)lethe_cuda_ring_alloc(c, (size_t)total * sizeof(float), &h_out);
    const int32_t ppb = PS_THREADS / n_kv_heads;
    dim3 grid((unsigned)((max_pages + ppb - 1) / ppb), (unsigned)n_seqs);
    page_scores_kernel<<<grid, PS_THREADS, smem, c->stream>>>(
        d_out, (const bf16 *)q, (const bf16 *)meta, d_rows, d_beg, d_ids, n_heads, n_kv_heads,
        head_dim);
    CU_LAUNCH_CHECK();
    if (out_on_backend) return; /* stays on the device (feeds topk): no sync */
    CU_CHECK(cudaMemcpyAsync(h_out, d_out, (size_t)total * sizeof(float), cudaMemcpyDeviceToHost,
                             c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(out, h_out, (size_t)total * sizeof(float));
}

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
 * stages its sequence's query row [n_heads, head_dim] and a tile of pages'
 * bounds in shared memory; a thread per (page, query head) sums over the
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

/* Shared memory of a page_scores block: q [n_heads][head_dim + 1] f32, the
 * tile's bounds [pp][2][n_kv][head_dim / 2 + 1] bf16 pairs, partial scores
 * [pp][n_heads] f32 (the +1 pads keep rows on distinct banks). */
static size_t ps_smem(int32_t pp, int32_t n_heads, int32_t n_kv, int32_t head_dim) {
    return ((size_t)n_heads * (head_dim + 1) + (size_t)pp * 2 * n_kv * (head_dim / 2 + 1) +
            (size_t)pp * n_heads) * 4;
}

/* grid: x = tile of pp pages of sequence y. The block stages its query row
 * and the tile's min / max rows in shared memory (coalesced loads, each
 * bound read from DRAM once), then a thread per (page, query head) sums
 * max(q_c mx_c, q_c mn_c) over the channels in the CPU twin's order with the
 * same float expressions (the scores are the CPU twin's; the max over heads
 * is order-free). Threads of one page's KV group read the same bound words
 * (shared-memory broadcast). */
__global__ void __launch_bounds__(PS_THREADS)
page_scores_kernel(float *__restrict__ out, const bf16 *__restrict__ Q,
                   const bf16 *__restrict__ meta, const int32_t *__restrict__ q_rows,
                   const int32_t *__restrict__ page_begin, const int32_t *__restrict__ page_ids,
                   int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t pp) {
    extern __shared__ float ps_s[];
    const int32_t s = blockIdx.y;
    const int32_t p0 = page_begin[s] + blockIdx.x * pp;
    const int32_t np = min(pp, page_begin[s + 1] - p0);
    if (np <= 0) return; /* uniform over the block */
    const int32_t H = n_heads, D = head_dim, P2 = D / 2, kd = n_kv_heads * D, g = H / n_kv_heads;
    float *q_s = ps_s;                                                 /* [H][D + 1] */
    __nv_bfloat162 *m_s = (__nv_bfloat162 *)(ps_s + (size_t)H * (D + 1)); /* [pp][2 n_kv][P2 + 1] */
    float *part = (float *)(m_s + (size_t)pp * 2 * n_kv_heads * (P2 + 1)); /* [pp][H] */
    const bf16 *q = Q + (size_t)q_rows[s] * H * D;
    for (int32_t i = threadIdx.x; i < H * D; i += blockDim.x)
        q_s[(i / D) * (D + 1) + i % D] = __bfloat162float(q[i]);
    const int32_t words = 2 * n_kv_heads * P2; /* bf16 pairs of one page's bounds */
    for (int32_t i = threadIdx.x; i < np * words; i += blockDim.x) {
        const int32_t p = i / words, w = i - p * words, r = w / P2, c = w - r * P2;
        const __nv_bfloat162 *pm = (const __nv_bfloat162 *)(meta + (size_t)page_ids[p0 + p] * 2 * kd);
        m_s[((size_t)p * 2 * n_kv_heads + r) * (P2 + 1) + c] = pm[w];
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < np * H; i += blockDim.x) {
        const int32_t p = i / H, h = i - p * H, kh = h / g;
        const __nv_bfloat162 *mn = m_s + ((size_t)p * 2 * n_kv_heads + kh) * (P2 + 1);
        const __nv_bfloat162 *mx = mn + (size_t)n_kv_heads * (P2 + 1);
        const float *qh = q_s + (size_t)h * (D + 1);
        float u = 0.0f;
        for (int32_t cp = 0; cp < P2; cp++) {
            const float2 lo = __bfloat1622float2(mn[cp]), hi = __bfloat1622float2(mx[cp]);
            const float a0 = qh[2 * cp] * hi.x, b0 = qh[2 * cp] * lo.x;
            u += a0 > b0 ? a0 : b0;
            const float a1 = qh[2 * cp + 1] * hi.y, b1 = qh[2 * cp + 1] * lo.y;
            u += a1 > b1 ? a1 : b1;
        }
        part[i] = u;
    }
    __syncthreads();
    for (int32_t p = threadIdx.x; p < np; p += blockDim.x) {
        float best = -INFINITY;
        for (int32_t h = 0; h < H; h++) {
            const float u = part[p * H + h];
            if (u > best) best = u;
        }
        out[p0 + p] = best;
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
    LETHE_ASSERT(head_dim % 2 == 0);
    if (n_seqs == 0) return;
    LETHE_ASSERT(page_begin[0] == 0 && n_seqs <= 65535);
    const int32_t total = page_begin[n_seqs];
    if (total == 0) return;
    int32_t max_pages = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        LETHE_ASSERT(page_begin[s + 1] >= page_begin[s]);
        max_pages = max(max_pages, page_begin[s + 1] - page_begin[s]);
    }
    /* pages per block: a thread per (page, head), fewer if shared memory is short */
    int32_t pp = max(1, PS_THREADS / n_heads);
    while (pp > 1 && ps_smem(pp, n_heads, n_kv_heads, head_dim) > c->smem_optin) pp /= 2;
    const size_t smem = ps_smem(pp, n_heads, n_kv_heads, head_dim);
    LETHE_ASSERT(smem <= c->smem_optin && "page_scores: the query row does not fit in shared memory");
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
    dim3 grid((unsigned)((max_pages + pp - 1) / pp), (unsigned)n_seqs);
    page_scores_kernel<<<grid, PS_THREADS, smem, c->stream>>>(
        d_out, (const bf16 *)q, (const bf16 *)meta, d_rows, d_beg, d_ids, n_heads, n_kv_heads,
        head_dim, pp);
    CU_LAUNCH_CHECK();
    if (out_on_backend) return; /* stays on the device (feeds topk): no sync */
    CU_CHECK(cudaMemcpyAsync(h_out, d_out, (size_t)total * sizeof(float), cudaMemcpyDeviceToHost,
                             c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(out, h_out, (size_t)total * sizeof(float));
}

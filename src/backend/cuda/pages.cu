/* pages.cu - Quest page bounds on the CUDA backend (twin of cpu/pages.c).
 *
 *   page_minmax  meta[page_ids[i]] = (min, max) over keys k_cache[slots[j]],
 *                j in [slot_begin[i], slot_begin[i+1])   meta [n_meta, 2, kv_dim] bf16
 *   page_scores  out[i] = max_h sum_c max(q[h,c] min[kh,c], q[h,c] max[kh,c])  (host f32),
 *                the max over all heads (n_groups 1) or per KV head (n_groups =
 *                n_kv_heads: out[n_groups * base + kh * n_s + (i - base)], backend.h)
 *
 * page_minmax: one block per page, each thread owns VEC channels and folds
 * the page's slots in list order with strict < / > compares in fp32, the CPU
 * twin's rule; the result is a stored bf16 key value, so it is bit-identical
 * to the CPU twin on the same (bf16-representable) keys.
 *
 * page_scores: the decode-time cost of Quest, a pass over 2 / P of the keys
 * (bf16 bounds: 1/8 of K at P = 16), so it must run at DRAM bandwidth. Grid
 * (page tiles of PS_PAGES_PER_BLOCK, striding when there are more tiles than
 * blocks: ps_next; sequences); the block stages its
 * sequence's query row [n_heads, head_dim] in shared memory and each warp
 * takes pages of the tile, one at a time. Two kernels:
 *  - page_scores_vec_kernel<R> (head_dim a power of two in [8, 256], kv_dim
 *    <= 32 * 8 * PS_VEC_MAX_R, 16-byte aligned q and meta): a meta row is
 *    n_chunks = kv_dim / 8 chunks of 8 channels (16 bytes), chunk c of KV head
 *    c / cph (cph = head_dim / 8 chunks per head, a divisor of 32). Lane l
 *    owns chunks l + 32 r, r < R: the warp issues all 2 R uint4 loads of a
 *    page (min and max rows) at once, and those of its next page before the
 *    math of the current one, so 4 - 8 KiB per warp are in flight. Per query
 *    head j of the group: a lane's partial sum over its 8 channels, then xor
 *    shuffles over the cph lanes of the head (offsets cph/2 .. 1 stay in the
 *    group), max over (r, j); the max across heads takes the offsets cph .. 16.
 *    Per KV head (n_groups = n_kv_heads) the max stops at (r, j): lane l with
 *    l % cph == 0 holds KV head (l + 32 r) / cph's bound and writes it.
 *    The query row stays bf16 in shared memory (16-byte reads by consecutive
 *    lanes: conflict-free for cph >= 8), converted on use (exact).
 *  - page_scores_kernel (any other shape, head_dim <= 640, e.g. MLA's latent
 *    rows of 576): per KV head the
 *    lanes hold channel pairs of min / max in registers, then for every query
 *    head of the group a per-lane partial sum and a warp all-reduce; query
 *    row in shared memory as fp32.
 * fp32 throughout; the sum order differs from the CPU's left-to-right one
 * (float reassociation only: exact on integer inputs). The op ends with a
 * host sync when its output is host; with out_on_backend it is
 * asynchronous. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/args.h"

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
    lethe_check_page_minmax(page_ids, slot_begin, n_pages, kv_dim);
    if (n_pages == 0) return;
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

#define PS_WARPS 8
#define PS_PAGES_PER_BLOCK 32 /* a tile: 4 pages per warp */
#define PS_MAX_PAIRS 10       /* channel pairs per lane: head_dim <= 2 * 32 * 10 (latent KV: 576) */
#define PS_VEC_MAX_R 4        /* vector kernel: chunks per lane, kv_dim <= 8 * 32 * 4 */

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* The pages a warp scores, in order: tiles blockIdx.x, blockIdx.x +
 * gridDim.x, ... of PS_PAGES_PER_BLOCK pages of its sequence, in each tile
 * the pages warp, warp + PS_WARPS, ... . So any grid covers every page (a
 * graph captures a grid fixed by the batch size, not by the page counts),
 * and each page is scored by one warp in the same way whatever the grid.
 * Returns the page after i (base = the sequence's first page), >= end when
 * none is left; the order is increasing. */
__device__ __forceinline__ int32_t ps_next(int32_t i, int32_t base) {
    const int32_t r = i - base;
    int32_t tile = r / PS_PAGES_PER_BLOCK, off = r % PS_PAGES_PER_BLOCK + PS_WARPS;
    if (off >= PS_PAGES_PER_BLOCK) tile += (int32_t)gridDim.x, off -= PS_PAGES_PER_BLOCK;
    return base + tile * PS_PAGES_PER_BLOCK + off;
}

__global__ void page_scores_kernel(float *__restrict__ out, const bf16 *__restrict__ Q,
                                   const bf16 *__restrict__ meta,
                                   const int32_t *__restrict__ q_rows,
                                   const int32_t *__restrict__ page_begin,
                                   const int32_t *__restrict__ page_ids, int32_t n_heads,
                                   int32_t n_kv_heads, int32_t head_dim, int32_t n_groups) {
    extern __shared__ float q_s[]; /* [n_heads * head_dim] */
    const int32_t s = blockIdx.y;
    const int32_t base = page_begin[s], end = page_begin[s + 1];
    if (base + (int32_t)blockIdx.x * PS_PAGES_PER_BLOCK >= end) return; /* uniform over the block */
    const int32_t qd = n_heads * head_dim, kd = n_kv_heads * head_dim, g = n_heads / n_kv_heads;
    const bf16 *q = Q + (size_t)q_rows[s] * qd;
    for (int32_t i = threadIdx.x; i < qd; i += blockDim.x) q_s[i] = __bfloat162float(q[i]);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t n_pairs = head_dim / 2;
    for (int32_t i = base + (int32_t)blockIdx.x * PS_PAGES_PER_BLOCK + warp; i < end; i = ps_next(i, base)) {
        const bf16 *pm = meta + (size_t)page_ids[i] * 2 * kd;
        float best = -INFINITY;
        for (int32_t kh = 0; kh < n_kv_heads; kh++) {
            if (n_groups > 1) best = -INFINITY; /* per KV head: this head's group only */
            float2 mn[PS_MAX_PAIRS], mx[PS_MAX_PAIRS];
#pragma unroll
            for (int r = 0; r < PS_MAX_PAIRS; r++) {
                const int32_t cp = lane + 32 * r;
                if (cp < n_pairs) {
                    mn[r] = __bfloat1622float2(((const __nv_bfloat162 *)(pm + kh * head_dim))[cp]);
                    mx[r] = __bfloat1622float2(((const __nv_bfloat162 *)(pm + kd + kh * head_dim))[cp]);
                } else {
                    mn[r] = mx[r] = make_float2(0.0f, 0.0f);
                }
            }
            for (int32_t h = kh * g; h < (kh + 1) * g; h++) {
                const float2 *qh = (const float2 *)(q_s + h * head_dim);
                float u = 0.0f;
#pragma unroll
                for (int r = 0; r < PS_MAX_PAIRS; r++) {
                    const int32_t cp = lane + 32 * r;
                    if (cp < n_pairs) {
                        const float2 qv = qh[cp];
                        u += fmaxf(qv.x * mn[r].x, qv.x * mx[r].x);
                        u += fmaxf(qv.y * mn[r].y, qv.y * mx[r].y);
                    }
                }
                u = warp_sum(u);
                if (u > best) best = u;
            }
            if (n_groups > 1 && lane == 0) out[(size_t)n_groups * base + (size_t)kh * (end - base) + (i - base)] = best;
        }
        if (n_groups == 1 && lane == 0) out[i] = best;
    }
}

/* bf16 halves of a packed pair -> fp32 (exact) */
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

/* sum over 8 channels (in order) of max(q mn, q mx); q, mn, mx packed bf16 x 8.
 * max(q mn, q mx) is q times the bound the sign of q picks (mn <= mx: the
 * same rounded product), one multiply-add instead of two products and a max;
 * it differs from fmaxf only for an infinite bound times q = 0. */
__device__ __forceinline__ float chunk_bound(uint4 q, uint4 mn, uint4 mx) {
    const uint32_t qw[4] = {q.x, q.y, q.z, q.w}, nw[4] = {mn.x, mn.y, mn.z, mn.w},
                   xw[4] = {mx.x, mx.y, mx.z, mx.w};
    float u = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float a = bf_lo(qw[k]);
        u = fmaf(a, a >= 0.0f ? bf_lo(xw[k]) : bf_lo(nw[k]), u);
        a = bf_hi(qw[k]);
        u = fmaf(a, a >= 0.0f ? bf_hi(xw[k]) : bf_hi(nw[k]), u);
    }
    return u;
}

/* the lane's 2 R chunks of one meta page [2, n_chunks] (uint4 units); chunks
 * past n_chunks are not read */
template <int R>
__device__ __forceinline__ void load_page(uint4 *mn, uint4 *mx, const uint4 *__restrict__ pm,
                                          int32_t n_chunks, int lane) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int32_t ch = lane + 32 * r;
        if (ch < n_chunks) {
            mn[r] = __ldcs(pm + ch);
            mx[r] = __ldcs(pm + n_chunks + ch);
        } else {
            mn[r] = mx[r] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

/* grid (page tiles, sequences), PS_WARPS warps; dynamic smem: the query row
 * [n_heads * head_dim] bf16. R = ceil(n_chunks / 32) <= PS_VEC_MAX_R.
 * CPH_T / G_T: chunks per head and group size fixed at compile time (0:
 * read from the arguments); fixed, the head and shuffle loops unroll and the
 * group's independent shuffle chains overlap (the common Llama shapes). */
template <int R, int CPH_T, int G_T>
__global__ void __launch_bounds__(PS_WARPS * 32)
page_scores_vec_kernel(float *__restrict__ out, const bf16 *__restrict__ Q,
                       const bf16 *__restrict__ meta, const int32_t *__restrict__ q_rows,
                       const int32_t *__restrict__ page_begin, const int32_t *__restrict__ page_ids,
                       int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t n_groups) {
    extern __shared__ uint4 q8[]; /* [n_heads * head_dim / 8] */
    const int32_t s = blockIdx.y;
    const int32_t base = page_begin[s], end = page_begin[s + 1];
    if (base + (int32_t)blockIdx.x * PS_PAGES_PER_BLOCK >= end) return; /* uniform over the block */
    const int32_t qd8 = n_heads * head_dim / 8, n_chunks = n_kv_heads * head_dim / 8;
    const int32_t cph = CPH_T ? CPH_T : head_dim / 8, g = G_T ? G_T : n_heads / n_kv_heads;
    const uint4 *q = (const uint4 *)(Q + (size_t)q_rows[s] * n_heads * head_dim);
    for (int32_t i = threadIdx.x; i < qd8; i += blockDim.x) q8[i] = q[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint4 *meta8 = (const uint4 *)meta; /* a page: 2 * n_chunks uint4 */
    int32_t i = base + (int32_t)blockIdx.x * PS_PAGES_PER_BLOCK + warp;
    if (i >= end) return;
    /* per r: the lane's chunk, its KV head's first query head, its offset in the head */
    int32_t qoff[R];
    bool valid[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int32_t ch = lane + 32 * r;
        valid[r] = ch < n_chunks; /* uniform over the cph lanes of a head */
        qoff[r] = (ch / cph) * g * cph + ch % cph;
    }
    uint4 mn[R], mx[R];
    load_page<R>(mn, mx, meta8 + (size_t)page_ids[i] * 2 * n_chunks, n_chunks, lane);
    for (int32_t ni; i < end; i = ni) {
        uint4 nmn[R], nmx[R]; /* the warp's next page, in flight during this one's math */
        ni = ps_next(i, base);
        if (ni < end) {
            load_page<R>(nmn, nmx, meta8 + (size_t)page_ids[ni] * 2 * n_chunks, n_chunks, lane);
        } else {
#pragma unroll
            for (int r = 0; r < R; r++) nmn[r] = nmx[r] = make_uint4(0u, 0u, 0u, 0u);
        }
        float best_r[R]; /* per chunk r: the max over the group's heads j */
#pragma unroll
        for (int r = 0; r < R; r++) best_r[r] = -INFINITY;
#pragma unroll
        for (int32_t j = 0; j < g; j++) {
            float u[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                u[r] = 0.0f; /* out of range: 0 in the sums, never in the max */
                if (valid[r]) u[r] = chunk_bound(q8[qoff[r] + j * cph], mn[r], mx[r]);
            }
#pragma unroll
            for (int o = cph >> 1; o > 0; o >>= 1) {
#pragma unroll
                for (int r = 0; r < R; r++) u[r] += __shfl_xor_sync(0xffffffffu, u[r], o);
            }
#pragma unroll
            for (int r = 0; r < R; r++)
                if (valid[r]) best_r[r] = fmaxf(best_r[r], u[r]);
        }
        if (n_groups > 1) { /* per KV head: lane ch % cph == 0 holds KV head ch / cph's bound */
            const size_t o0 = (size_t)n_groups * base + (size_t)(i - base);
#pragma unroll
            for (int r = 0; r < R; r++)
                if (valid[r] && lane % cph == 0) out[o0 + (size_t)((lane + 32 * r) / cph) * (end - base)] = best_r[r];
        } else {
            float best = -INFINITY;
#pragma unroll
            for (int r = 0; r < R; r++) best = fmaxf(best, best_r[r]);
#pragma unroll
            for (int o = cph; o < 32; o <<= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
            if (lane == 0) out[i] = best;
        }
#pragma unroll
        for (int r = 0; r < R; r++) mn[r] = nmn[r], mx[r] = nmx[r];
    }
}

/* shared memory above the 48 KiB default needs a (cheap) per-kernel opt-in */
static void ps_smem_optin(const void *kernel, size_t smem) {
    if (smem > 48 * 1024)
        CU_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

extern "C" void lethe_cuda_page_scores(lethe_backend *be, float *out, const void *q,
                                       const void *meta, int32_t n_seqs, const int32_t *q_rows,
                                       const int32_t *page_begin, const int32_t *page_ids,
                                       int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                       int32_t n_groups, bool out_on_backend) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT((out_on_backend || !c->capturing) && "graph capture: page_scores to the host syncs");
    lethe_check_page_scores(n_seqs, page_begin, n_heads, n_kv_heads, n_groups);
    LETHE_ASSERT(head_dim % 2 == 0 && head_dim <= 2 * 32 * PS_MAX_PAIRS);
    static_assert(2 * 32 * PS_MAX_PAIRS >= LETHE_SCORES_HEAD_DIM_MAX, "page_scores head_dim");
    if (n_seqs == 0) return;
    LETHE_ASSERT(n_seqs <= 65535);
    const int32_t total = page_begin[n_seqs];
    if (total == 0 && !c->capturing) return; /* captured: a replay may have pages */
    int32_t max_pages = 0;
    for (int32_t s = 0; s < n_seqs; s++) max_pages = max(max_pages, page_begin[s + 1] - page_begin[s]);
    /* page tiles per sequence: what the pages need, at most ~8 blocks per SM
     * in all (the blocks then stride, ps_next); captured, the most, since a
     * replay's page counts are not known now */
    const int32_t cap_x = max(1, (8 * c->n_sms + n_seqs - 1) / n_seqs);
    int32_t grid_x = (max_pages + PS_PAGES_PER_BLOCK - 1) / PS_PAGES_PER_BLOCK;
    if (c->capturing || grid_x > cap_x) grid_x = cap_x;
    /* the vector kernel: chunks of 8 channels, cph = head_dim / 8 a divisor of 32 */
    const int32_t n_chunks = n_kv_heads * head_dim / 8, R = (n_chunks + 31) / 32;
    const bool vec = head_dim >= 8 && head_dim <= 256 && (head_dim & (head_dim - 1)) == 0 &&
                     R <= PS_VEC_MAX_R && (uintptr_t)q % 16 == 0 && (uintptr_t)meta % 16 == 0;
    const size_t smem = (size_t)n_heads * head_dim * (vec ? sizeof(bf16) : sizeof(float));
    LETHE_ASSERT(smem <= c->smem_optin && "page_scores: the query row does not fit in shared memory");
    const int32_t *d_rows = lethe_cuda_stage_idx(c, q_rows, (size_t)n_seqs);
    const int32_t *d_beg = lethe_cuda_stage_idx(c, page_begin, (size_t)n_seqs + 1);
    const int32_t *d_ids = lethe_cuda_stage_idx(c, page_ids, (size_t)total);
    void *h_out = NULL;
    float *d_out = out_on_backend
                       ? out
                       : (float *)lethe_cuda_ring_alloc(c, (size_t)n_groups * total * sizeof(float), &h_out);
    dim3 grid((unsigned)grid_x, (unsigned)n_seqs);
#define PS_VEC_LAUNCH(RR, CC, GG)                                                                   \
    do {                                                                                           \
        ps_smem_optin((const void *)page_scores_vec_kernel<RR, CC, GG>, smem);                     \
        page_scores_vec_kernel<RR, CC, GG><<<grid, PS_WARPS * 32, smem, c->stream>>>(              \
            d_out, (const bf16 *)q, (const bf16 *)meta, d_rows, d_beg, d_ids, n_heads, n_kv_heads, \
            head_dim, n_groups);                                                                   \
    } while (0)
    const int32_t cph = head_dim / 8, g = n_heads / n_kv_heads;
    if (vec && R == 4 && cph == 16 && g == 4) PS_VEC_LAUNCH(4, 16, 4);      /* Llama-3 8B */
    else if (vec && R == 4 && cph == 16 && g == 8) PS_VEC_LAUNCH(4, 16, 8); /* Llama-3 70B */
    else if (vec && R == 1) PS_VEC_LAUNCH(1, 0, 0);
    else if (vec && R == 2) PS_VEC_LAUNCH(2, 0, 0);
    else if (vec && R == 3) PS_VEC_LAUNCH(3, 0, 0);
    else if (vec) PS_VEC_LAUNCH(4, 0, 0);
    else {
        ps_smem_optin((const void *)page_scores_kernel, smem);
        page_scores_kernel<<<grid, PS_WARPS * 32, smem, c->stream>>>(
            d_out, (const bf16 *)q, (const bf16 *)meta, d_rows, d_beg, d_ids, n_heads, n_kv_heads,
            head_dim, n_groups);
    }
#undef PS_VEC_LAUNCH
    CU_LAUNCH_CHECK();
    if (out_on_backend) return; /* stays on the device (feeds topk): no sync */
    CU_CHECK(cudaMemcpyAsync(h_out, d_out, (size_t)n_groups * total * sizeof(float), cudaMemcpyDeviceToHost,
                             c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(out, h_out, (size_t)n_groups * total * sizeof(float));
}

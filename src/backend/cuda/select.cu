/* select.cu - device-side selection on the CUDA backend (twin of cpu/select.c):
 *
 *   topk           segmented top-k: segment s = scores[seg_begin[s] ..
 *                  seg_begin[s+1]) (f32), its k_s = out_begin[s+1] -
 *                  out_begin[s] best entries as ascending segment-relative
 *                  indices to out[out_begin[s] ..] (int32)
 *   select_expand  lethe_expand_seq head / picked units / tail -> slot ids
 *   row_topk       per row of a bf16 score matrix, the k best columns below
 *                  the row's limit of alpha x + bias, best-first, to the host
 *
 * topk and select_expand are asynchronous on the backend stream and allocate
 * nothing: the host arrays (segment bounds, expand requests) go through the
 * staging ring, or are read in place when they are backend memory
 * (lethe_cuda_stage_idx). row_topk is synchronous (its output is a host
 * array); its limits, bias and output share one region of the ring.
 *
 * topk must equal lethe_topk_indices (backend/topk.c) exactly, ties included, so it is
 * an exact selection, not an approximate one. Each float maps to a uint32
 * key whose unsigned order is lethe_rank_before's score order: NaN -> 0
 * (below every number), -0.0 -> +0.0 (they tie), otherwise the sign-flip
 * trick (negative: all bits flipped; positive: sign bit set). One CTA per
 * segment (segments: Quest's pages, a few thousand; OmniKV's context, up to
 * ~2^20 candidates):
 *   1. radix select, 4 passes of 8 bits from the top: a shared histogram of
 *      the next digit over the keys matching the prefix chosen so far, then a
 *      one-warp scan from digit 255 down picks the digit holding the k-th
 *      largest key. After the passes, T = that key and r = how many keys == T
 *      the top-k takes (k - #keys > T). A pass whose chosen digit bin is
 *      taken whole stops early: then T is a masked prefix and r its count.
 *   2. ordered compaction in index order, one element per thread per tile:
 *      take key > T, and key == T while the running count of == T keys (over
 *      earlier tiles + a block exclusive scan within the tile) is below r.
 *      Positions come from the same scan, so the output is ascending.
 * Each pass re-reads the segment (4 B per candidate, L2-resident at these
 * sizes); histogram increments are warp-aggregated (__match_any_sync), since
 * real scores crowd a few bins (same exponent) and shared atomics on one
 * address serialize. */
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/args.h"

#define TOPK_THREADS 1024
#define TOPK_WARPS (TOPK_THREADS / 32)
#define FULL_MASK 0xffffffffu

/* lethe_rank_before's order as an unsigned key: a ranks before b (ignoring
 * the index tie-break) iff key(a) > key(b); NaN (any payload) is 0 and no
 * number maps to 0 (-inf -> 0x007fffff). */
__device__ __forceinline__ uint32_t rank_key(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0;  /* NaN (bit test: fast-math proof) */
    if (u == 0x80000000u) u = 0;                     /* -0.0 ties with +0.0 */
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Inclusive warp scan of v. */
__device__ __forceinline__ uint32_t warp_incl_scan(uint32_t v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        uint32_t y = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

/* Block-wide exclusive scan of v (every thread of the TOPK_THREADS block
 * calls it); *total = the block sum. warp_tot: shared [TOPK_WARPS]. Ends with
 * a barrier, so the next call may reuse warp_tot. */
__device__ __forceinline__ uint32_t block_excl_scan(uint32_t v, uint32_t *warp_tot,
                                                    uint32_t *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t incl = warp_incl_scan(v, lane);
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        uint32_t t = warp_incl_scan(lane < TOPK_WARPS ? warp_tot[lane] : 0u, lane);
        if (lane < TOPK_WARPS) warp_tot[lane] = t; /* each lane its own entry: no race */
    }
    __syncthreads();
    const uint32_t before = warp ? warp_tot[warp - 1] : 0u;
    *total = warp_tot[TOPK_WARPS - 1];
    __syncthreads();
    return before + incl - v;
}

/* grid: one block per segment; block: TOPK_THREADS. */
__global__ void __launch_bounds__(TOPK_THREADS)
topk_kernel(int32_t *__restrict__ out, const float *__restrict__ scores,
            const int32_t *__restrict__ seg_begin, const int32_t *__restrict__ out_begin) {
    __shared__ uint32_t hist[256];
    __shared__ uint32_t warp_tot[TOPK_WARPS];
    __shared__ uint32_t s_prefix, s_rem, s_bin;
    const int32_t seg = blockIdx.x;
    const int32_t n = seg_begin[seg + 1] - seg_begin[seg];
    const uint32_t k = (uint32_t)(out_begin[seg + 1] - out_begin[seg]);
    if (k == 0) return; /* uniform over the block */
    const float *x = scores + seg_begin[seg];
    int32_t *o = out + out_begin[seg];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    /* ---- 1. radix select of the k-th largest key ---- */
    uint32_t prefix = 0, mask = 0, rem = k; /* rem >= 1: keys == the target still to take */
    if (tid == 0) s_prefix = 0, s_rem = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
        /* whole warps iterate together (base is block-uniform) for the warp votes */
        for (int32_t base = 0; base < n; base += TOPK_THREADS) {
            const int32_t i = base + tid;
            uint32_t key = 0;
            bool cand = false;
            if (i < n) {
                key = rank_key(x[i]);
                cand = (key & mask) == prefix;
            }
            const unsigned act = __ballot_sync(FULL_MASK, cand);
            if (cand) {
                const uint32_t d = (key >> shift) & 0xffu;
                const unsigned peers = __match_any_sync(act, d);
                if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        if (warp == 0) {
            /* lane l owns digits 255 - 8l down to 248 - 8l: a scan over lanes
             * counts the keys above each lane's digits */
            uint32_t cnt[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) sum += cnt[j] = hist[255 - 8 * lane - j];
            const uint32_t incl = warp_incl_scan(sum, lane);
            uint32_t above = incl - sum;
            if (above < rem && rem <= incl) { /* exactly one lane: the candidates number >= rem */
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (rem <= above + cnt[j]) {
                        s_prefix = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                        s_rem = rem - above;
                        s_bin = cnt[j];
                        break;
                    }
                    above += cnt[j];
                }
            }
        }
        __syncthreads();
        prefix = s_prefix;
        rem = s_rem;
        mask |= 0xffu << shift;
        if (s_bin == rem) break; /* the whole bin is taken: no need to split it further */
    }

    /* ---- 2. ordered compaction: key > T, then the first rem keys == T ---- */
    uint32_t taken = 0, eq_seen = 0; /* block-uniform running counts */
    for (int32_t base = 0; base < n && taken < k; base += TOPK_THREADS) {
        const int32_t i = base + tid;
        uint32_t gt = 0, eq = 0;
        if (i < n) {
            const uint32_t mk = rank_key(x[i]) & mask;
            gt = mk > prefix;
            eq = mk == prefix;
        }
        /* both counts in one scan: per tile each is <= TOPK_THREADS < 2^16 */
        uint32_t total;
        const uint32_t ex = block_excl_scan(gt | (eq << 16), warp_tot, &total);
        const uint32_t quota = rem > eq_seen ? rem - eq_seen : 0u; /* == T keys still to take */
        const uint32_t ex_gt = ex & 0xffffu, ex_eq = ex >> 16;
        if (gt || (eq && ex_eq < quota)) o[taken + ex_gt + min(ex_eq, quota)] = i;
        taken += (total & 0xffffu) + min(total >> 16, quota);
        eq_seen += total >> 16;
    }
}

extern "C" void lethe_cuda_topk(lethe_backend *be, int32_t *out, const float *scores,
                                int32_t n_segs, const int32_t *seg_begin,
                                const int32_t *out_begin) {
    cuda_ctx *c = cuda_ctx_of(be);
    /* no segment asks for k > 0: nothing to do, unless captured (a replay's k may not be 0) */
    if (!lethe_check_topk(n_segs, seg_begin, out_begin) && (!c->capturing || n_segs == 0)) return;
    const int32_t *d_seg = lethe_cuda_stage_idx(c, seg_begin, (size_t)n_segs + 1);
    const int32_t *d_out = lethe_cuda_stage_idx(c, out_begin, (size_t)n_segs + 1);
    topk_kernel<<<(unsigned)n_segs, TOPK_THREADS, 0, c->stream>>>(out, scores, d_seg, d_out);
    CU_LAUNCH_CHECK();
}

/* ---- select_expand ------------------------------------------------------ */

#define EXPAND_THREADS 256

static_assert(sizeof(lethe_expand_seq) == 8 * sizeof(int32_t), "staged as 8 int32 per sequence");

/* grid (output tiles of EXPAND_THREADS, sequences): one thread per output
 * entry o of sequence s, in [0, head + n_picks * unit + row_len - tail),
 * striding by the grid when the tiles are fewer than the entries (a graph's
 * grid is fixed by the batch size, not by this step's selection sizes). */
__global__ void select_expand_kernel(int32_t *__restrict__ out, const int32_t *__restrict__ rows,
                                     const int32_t *__restrict__ picks,
                                     const lethe_expand_seq *__restrict__ seqs, int32_t unit) {
    const lethe_expand_seq q = seqs[blockIdx.y];
    const int32_t n_mid = q.n_picks * unit;
    const int32_t n_out = q.head + n_mid + (q.row_len - q.tail);
    for (int32_t o = blockIdx.x * EXPAND_THREADS + threadIdx.x; o < n_out;
         o += (int32_t)gridDim.x * EXPAND_THREADS) {
        int32_t e; /* row entry */
        if (o < q.head) {
            e = o;
        } else if (o < q.head + n_mid) {
            const int32_t p = (o - q.head) / unit, j = (o - q.head) - p * unit;
            e = q.pick_off + picks[q.pick_begin + p] * unit + j;
            /* a pick outside (head, tail) is a caller bug (the CPU twin asserts);
             * trap instead of reading past the row */
            if (e < q.head || e >= q.tail) __trap();
        } else {
            e = q.tail + (o - q.head - n_mid);
        }
        out[q.out_begin + o] = rows[q.row_begin + e];
    }
}

extern "C" void lethe_cuda_select_expand(lethe_backend *be, int32_t *out, const int32_t *rows,
                                         const int32_t *picks, const lethe_expand_seq *seqs,
                                         int32_t n_seqs, int32_t unit) {
    cuda_ctx *c = cuda_ctx_of(be);
    /* host-side checks of the request (the picks themselves live on the device) */
    const lethe_expand_extent x = lethe_check_select_expand(seqs, n_seqs, unit);
    LETHE_ASSERT(n_seqs <= 65535); /* grid y */
    if (x.max_out == 0 && (!c->capturing || n_seqs == 0)) return;
    const int64_t max_out = x.max_out, n_rows = x.rows_end, n_picks = x.picks_end;
    const int32_t *d_seqs = lethe_cuda_stage_idx(c, (const int32_t *)seqs, (size_t)n_seqs * 8);
    const int32_t *d_rows = lethe_cuda_stage_idx(c, rows, (size_t)n_rows);
    /* picks are backend memory (topk's out); a host array is staged all the same */
    const int32_t *d_picks = n_picks ? lethe_cuda_stage_idx(c, picks, (size_t)n_picks) : picks;
    /* at most ~8 blocks per SM in all; captured, that many (a replay's sizes are unknown) */
    const unsigned cap_x = (unsigned)max(1, (8 * c->n_sms + n_seqs - 1) / n_seqs);
    unsigned grid_x = lethe_cuda_blocks((size_t)max_out, EXPAND_THREADS);
    if (c->capturing || grid_x > cap_x) grid_x = cap_x;
    dim3 grid(grid_x, (unsigned)n_seqs);
    select_expand_kernel<<<grid, EXPAND_THREADS, 0, c->stream>>>(
        out, d_rows, d_picks, (const lethe_expand_seq *)d_seqs, unit);
    CU_LAUNCH_CHECK();
}

/* ---- row_topk ----------------------------------------------------------- */

/* One block of ROWTOPK_THREADS per row (DeltaKV's tiles: n 1024 rows of up to
 * ~16K columns, k 4): thread t keeps the best KM of columns t, t + T, .. in
 * registers (a sorted list, insertion by compare-swap down the unrolled list;
 * KM >= k, so the k best of the row are among the threads' lists), then k
 * rounds pick the row's next best among the threads' list heads (a warp
 * butterfly, then the warps' winners through shared memory); the owner pops
 * its head. Empty list entries are (NaN, INT32_MAX): after every real entry,
 * NaN ones included, and never a winner while a real entry is left. */
#define ROWTOPK_THREADS 128
#define ROWTOPK_WARPS (ROWTOPK_THREADS / 32)
#define ROWTOPK_EMPTY 0x7fffffff

/* lethe_rank_before on the device (NaN by a bit test: fast-math proof) */
__device__ __forceinline__ bool rank_before_dev(float a, int32_t ia, float b, int32_t ib) {
    const bool na = (__float_as_uint(a) & 0x7fffffffu) > 0x7f800000u;
    const bool nb = (__float_as_uint(b) & 0x7fffffffu) > 0x7f800000u;
    if (na != nb) return nb;
    if (!na && a != b) return a > b;
    return ia < ib;
}

template <int KM>
__global__ void __launch_bounds__(ROWTOPK_THREADS)
row_topk_kernel(int32_t *__restrict__ out, const bf16 *__restrict__ scores, int32_t m,
                const int32_t *__restrict__ lim, int32_t k, float alpha,
                const float *__restrict__ bias) {
    __shared__ float s_v[ROWTOPK_WARPS];
    __shared__ int32_t s_i[ROWTOPK_WARPS];
    const int32_t row = blockIdx.x, L = lim[row];
    const bf16 *x = scores + (size_t)row * m;
    const float empty_v = __uint_as_float(0x7fffffffu);
    float bv[KM];
    int32_t bi[KM];
#pragma unroll
    for (int j = 0; j < KM; j++) bv[j] = empty_v, bi[j] = ROWTOPK_EMPTY;
    for (int32_t c = threadIdx.x; c < L; c += ROWTOPK_THREADS) {
        /* two rounded operations, as the CPU twin computes them */
        const float ax = __fmul_rn(alpha, __bfloat162float(x[c]));
        float v = __fadd_rn(ax, bias ? bias[c] : 0.0f);
        int32_t id = c;
        if (!rank_before_dev(v, id, bv[KM - 1], bi[KM - 1])) continue;
#pragma unroll
        for (int j = 0; j < KM; j++)
            if (rank_before_dev(v, id, bv[j], bi[j])) {
                const float tv = bv[j];
                const int32_t ti = bi[j];
                bv[j] = v, bi[j] = id, v = tv, id = ti;
            }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int32_t r = 0; r < k; r++) {
        float v = bv[0];
        int32_t id = bi[0];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) { /* every lane ends with the warp's best */
            const float v2 = __shfl_xor_sync(FULL_MASK, v, o);
            const int32_t i2 = __shfl_xor_sync(FULL_MASK, id, o);
            if (rank_before_dev(v2, i2, v, id)) v = v2, id = i2;
        }
        if (lane == 0) s_v[warp] = v, s_i[warp] = id;
        __syncthreads();
        v = s_v[0], id = s_i[0];
#pragma unroll
        for (int w = 1; w < ROWTOPK_WARPS; w++)
            if (rank_before_dev(s_v[w], s_i[w], v, id)) v = s_v[w], id = s_i[w];
        if (threadIdx.x == 0) out[(size_t)row * k + r] = id == ROWTOPK_EMPTY ? -1 : id;
        if (id != ROWTOPK_EMPTY && bi[0] == id) { /* the owner pops its head (columns are unique) */
#pragma unroll
            for (int j = 0; j + 1 < KM; j++) bv[j] = bv[j + 1], bi[j] = bi[j + 1];
            bv[KM - 1] = empty_v, bi[KM - 1] = ROWTOPK_EMPTY;
        }
        __syncthreads(); /* s_v / s_i are rewritten by the next round */
    }
}

extern "C" void lethe_cuda_row_topk(lethe_backend *be, int32_t *out, const void *scores, int32_t n,
                                    int32_t m, const int32_t *lim, int32_t k, float alpha,
                                    const float *bias) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing && "row_topk is synchronous");
    const int32_t max_lim = lethe_check_row_topk(n, m, lim, k);
    if (max_lim == 0) { /* no row has a column: nothing to rank */
        for (size_t i = 0; i < (size_t)n * k; i++) out[i] = -1;
        return;
    }
    /* one ring region: lim [n] and bias [max_lim] up, out [n, k] down (one
     * allocation, so no later one of this call can wrap the ring over it) */
    const size_t lim_bytes = (size_t)n * sizeof(int32_t), bias_bytes = bias ? (size_t)max_lim * sizeof(float) : 0;
    const size_t out_bytes = (size_t)n * k * sizeof(int32_t);
    void *h;
    char *d = (char *)lethe_cuda_ring_alloc(c, lim_bytes + bias_bytes + out_bytes, &h);
    memcpy(h, lim, lim_bytes);
    if (bias) memcpy((char *)h + lim_bytes, bias, bias_bytes); /* only the columns some row reads */
    CU_CHECK(cudaMemcpyAsync(d, h, lim_bytes + bias_bytes, cudaMemcpyHostToDevice, c->stream));
    const int32_t *d_lim = (const int32_t *)d;
    const float *d_bias = bias ? (const float *)(d + lim_bytes) : NULL;
    int32_t *d_out = (int32_t *)(d + lim_bytes + bias_bytes);
    void *h_out = (char *)h + lim_bytes + bias_bytes;
    const bf16 *x = (const bf16 *)scores;
    if (k <= 4)
        row_topk_kernel<4><<<(unsigned)n, ROWTOPK_THREADS, 0, c->stream>>>(d_out, x, m, d_lim, k, alpha, d_bias);
    else if (k <= 8)
        row_topk_kernel<8><<<(unsigned)n, ROWTOPK_THREADS, 0, c->stream>>>(d_out, x, m, d_lim, k, alpha, d_bias);
    else
        row_topk_kernel<16><<<(unsigned)n, ROWTOPK_THREADS, 0, c->stream>>>(d_out, x, m, d_lim, k, alpha, d_bias);
    CU_LAUNCH_CHECK();
    CU_CHECK(cudaMemcpyAsync(h_out, d_out, out_bytes, cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(out, h_out, out_bytes);
}

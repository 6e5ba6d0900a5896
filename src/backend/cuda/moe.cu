/* moe.cu - the mixture-of-experts FFN on the CUDA backend (ops->moe; the
 * definition is in backend.h, the CPU twin backend/cpu/moe.c).
 *
 * bf16 activations and expert weights, fp32 routing and accumulation. The
 * scratch (lethe_moe_args.ws) is carved as backend/moe_layout.h says.
 *   route_kernel   one warp per token: p = softmax / sigmoid of its logits,
 *                  (group-limited) top-k by warp argmax (ties to the smaller
 *                  id), weights normalized and scaled -> ids, wts [n, k]
 *   sort_kernel    one block, a thread per expert: counts, offsets, the
 *                  active experts, and the pairs sorted by expert (stable, so
 *                  the result does not depend on thread timing) -> perm, inv
 *   (up to ROUTE_WARPS tokens, e.g. decode at batch 1-4, route_sort_kernel
 *   does both in one launch)
 * then, for n <= LETHE_MOE_SMALL_N tokens (decode; no host sync, so a graph
 * can hold it):
 *   gate_up_kernel grid (ffn / 8 rows, active expert): a warp streams one row
 *                  of W_gate[e] and W_up[e] once per 8 of the expert's pairs
 *                  and writes h = silu(x Wg^T) * (x Wu^T) [P, ffn] (bf16)
 *   down_kernel    the same over W_down[e]: ys = h W_down[e]^T [P, dim]
 *   (with 4 P <= E, e.g. batch 1, down_combine_kernel instead does the down
 *   projection, the weighted sum and the residual add in one pass)
 * Only the active experts' weights are read: at batch 1 that is the k
 * experts the token chose. For more tokens (prefill), a grouped GEMM on
 * tensor cores (WMMA bf16, fp32 accumulation) over all experts at once, its
 * grid fixed from n (no host sync, graph-capturable):
 *   grid y = row tiles: expert e owns tiles [tiles[e], tiles[e+1]) of
 *            LETHE_MOE_TILE_M sorted pairs (sort_kernel's prefix sum), at
 *            most ceil(P / TILE_M) + min(P, E) in all (blocks past tiles[E]
 *            exit); grid x = GG_BN output columns
 *   gg_gate_up_kernel  h = silu(x Wg[e]^T) * (x Wu[e]^T) [P, ffn], the x rows
 *                      gathered through perm as the A tile loads, both
 *                      products from one A tile, SwiGLU in fp32 in the epilogue
 *   gg_down_kernel     ys = h W_down[e]^T [P, dim]
 *   combine_kernel out[t] (+)= sum_j wts[t, j] * ys[inv[t k + j]] (fp32, j ascending;
 *                  += with lethe_moe_args.accumulate). */
#include "backend/cuda/cuda_common.cuh"

#include <mma.h>
#include <stdio.h>

extern "C" {
#include "backend/moe_layout.h"
}

#define ROUTE_WARPS 4
#define MV_WARPS 8 /* output rows per block of the expert GEMV kernels */
#define MV_TOK 8   /* pairs per pass over a weight row */
#define DC_UNROLL 6 /* down_combine_kernel: 16-byte weight loads in flight per lane */

/* warp argmax of v[i] over i < n with !taken[i]; ties to the smaller i; -1 if none */
__device__ static int warp_argmax(const float *v, const unsigned char *taken, int n) {
    const int lane = threadIdx.x % 32;
    float best = -INFINITY;
    int bi = -1;
    for (int i = lane; i < n; i += 32)
        if (!taken[i] && (bi < 0 || v[i] > best)) best = v[i], bi = i;
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ob > best || (ob == best && oi < bi))) best = ob, bi = oi;
    }
    return bi;
}

/* the calling warp routes token t: ids, wts [t k .. t k + k); p, ch, tk are
 * the warp's shared scratch of E entries */
__device__ static void route_token(int32_t *ids, float *wts, const bf16 *__restrict__ logits,
                                   const bf16 *__restrict__ bias, int32_t t, int32_t E, int32_t k,
                                   int32_t scoring, int32_t norm_topk, float scale,
                                   int32_t n_group, int32_t topk_group, float *p, float *ch,
                                   unsigned char *tk) {
    const int lane = threadIdx.x % 32;
    const bf16 *lg = logits + (size_t)t * E;
    if (scoring == LETHE_MOE_SOFTMAX) {
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, __bfloat162float(lg[e]));
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.0f;
        for (int e = lane; e < E; e += 32) {
            p[e] = expf(__bfloat162float(lg[e]) - mx);
            sum += p[e];
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        for (int e = lane; e < E; e += 32) ch[e] = p[e] = p[e] / sum;
    } else {
        for (int e = lane; e < E; e += 32) {
            p[e] = 1.0f / (1.0f + expf(-__bfloat162float(lg[e])));
            ch[e] = p[e] + (bias ? __bfloat162float(bias[e]) : 0.0f);
        }
    }
    for (int e = lane; e < E; e += 32) tk[e] = 0;
    __syncwarp();
    if (n_group > 1) {
        /* group score = sum of its two best choices; groups not kept are out */
        if (lane == 0) {
            const int gs = E / n_group;
            float gscore[64];
            unsigned char keep[64] = {0};
            for (int g = 0; g < n_group; g++) {
                const float *cg = ch + g * gs;
                int a = 0, b = -1;
                for (int i = 1; i < gs; i++) {
                    if (cg[i] > cg[a]) b = a, a = i;
                    else if (b < 0 || cg[i] > cg[b]) b = i;
                }
                gscore[g] = cg[a] + (b >= 0 ? cg[b] : 0.0f);
            }
            for (int i = 0; i < topk_group; i++) {
                int best = -1;
                for (int g = 0; g < n_group; g++)
                    if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
                keep[best] = 1;
            }
            for (int e = 0; e < E; e++)
                if (!keep[e / gs]) ch[e] = -INFINITY;
        }
        __syncwarp();
    }
    float sum = 0.0f, mine = 0.0f;
    int my_id = 0;
    for (int j = 0; j < k; j++) {
        const int e = warp_argmax(ch, tk, E);
        if (lane == 0) tk[e] = 1;
        __syncwarp();
        sum += p[e];
        if (lane == j % 32 && j < 32) my_id = e, mine = p[e];
        if (j >= 32 && lane == 0) {
            ids[(size_t)t * k + j] = e;
            wts[(size_t)t * k + j] = p[e];
        }
    }
    const float denom = norm_topk ? sum + (scoring == LETHE_MOE_SIGMOID ? 1e-20f : 0.0f) : 1.0f;
    if (lane < k && lane < 32) {
        ids[(size_t)t * k + lane] = my_id;
        wts[(size_t)t * k + lane] = mine / denom * scale;
    }
    if (k > 32 && lane == 0)
        for (int j = 32; j < k; j++)
            wts[(size_t)t * k + j] = wts[(size_t)t * k + j] / denom * scale;
}

__global__ void __launch_bounds__(ROUTE_WARPS * 32)
    route_kernel(int32_t *__restrict__ ids, float *__restrict__ wts,
                 const bf16 *__restrict__ logits, const bf16 *__restrict__ bias, int32_t n,
                 int32_t E, int32_t k, int32_t scoring, int32_t norm_topk, float scale,
                 int32_t n_group, int32_t topk_group) {
    __shared__ float sp[ROUTE_WARPS][LETHE_MOE_MAX_EXPERTS], sc[ROUTE_WARPS][LETHE_MOE_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTE_WARPS][LETHE_MOE_MAX_EXPERTS];
    const int w = threadIdx.x / 32;
    const int32_t t = blockIdx.x * ROUTE_WARPS + w;
    if (t >= n) return;
    route_token(ids, wts, logits, bias, t, E, k, scoring, norm_topk, scale, n_group, topk_group,
                sp[w], sc[w], taken[w]);
}

/* the calling block (at least E threads: thread e owns expert e) sorts the
 * P pairs of ids by expert. ids are read through L2 (__ldcg): in the fused
 * kernel this block wrote them a moment ago, so no read-only-cache load. */
__device__ static void sort_pairs(const int32_t *ids, int32_t P, int32_t E,
                                  int32_t *__restrict__ counts, int32_t *__restrict__ offsets,
                                  int32_t *__restrict__ active, int32_t *__restrict__ perm,
                                  int32_t *__restrict__ inv, int32_t *__restrict__ tiles) {
    __shared__ int32_t chunk[2048];
    __shared__ int32_t scan[LETHE_MOE_MAX_EXPERTS + 1], ascan[LETHE_MOE_MAX_EXPERTS + 1];
    const int e = threadIdx.x;
    int32_t cnt = 0;
    for (int32_t c0 = 0; c0 < P; c0 += 2048) {
        const int32_t m = min(2048, P - c0);
        __syncthreads();
        for (int32_t i = threadIdx.x; i < m; i += blockDim.x) chunk[i] = __ldcg(ids + c0 + i);
        __syncthreads();
        for (int32_t i = 0; i < m; i++) cnt += chunk[i] == e;
    }
    if (e < E) scan[e] = cnt, ascan[e] = cnt > 0;
    __syncthreads();
    if (threadIdx.x == 0) { /* E <= 512: a serial scan is a few hundred adds */
        int32_t s = 0, a = 0, tl = 0;
        for (int i = 0; i < E; i++) {
            const int32_t c = scan[i], f = ascan[i];
            scan[i] = s, ascan[i] = a;
            tiles[i] = tl;
            s += c, a += f, tl += (c + LETHE_MOE_TILE_M - 1) / LETHE_MOE_TILE_M;
        }
        scan[E] = s, ascan[E] = a;
        offsets[E] = s;
        active[E] = a;
        tiles[E] = tl;
    }
    __syncthreads();
    if (e < E) {
        counts[e] = cnt;
        offsets[e] = scan[e];
        if (cnt) active[ascan[e]] = e;
    }
    int32_t at = e < E ? scan[e] : 0;
    for (int32_t c0 = 0; c0 < P; c0 += 2048) {
        const int32_t m = min(2048, P - c0);
        __syncthreads();
        for (int32_t i = threadIdx.x; i < m; i += blockDim.x) chunk[i] = __ldcg(ids + c0 + i);
        __syncthreads();
        if (e < E)
            for (int32_t i = 0; i < m; i++)
                if (chunk[i] == e) {
                    perm[at] = c0 + i;
                    inv[c0 + i] = at;
                    at++;
                }
    }
}

/* one block of E (rounded up to 32) threads */
__global__ void sort_kernel(const int32_t *ids, int32_t P, int32_t E, int32_t *__restrict__ counts,
                            int32_t *__restrict__ offsets, int32_t *__restrict__ active,
                            int32_t *__restrict__ perm, int32_t *__restrict__ inv,
                            int32_t *__restrict__ tiles) {
    sort_pairs(ids, P, E, counts, offsets, active, perm, inv, tiles);
}

/* n <= ROUTE_WARPS tokens (decode): route (warp w: token w) and sort in one
 * launch; one block of max(ROUTE_WARPS * 32, E rounded up to 32) threads */
__global__ void route_sort_kernel(int32_t *ids, float *__restrict__ wts,
                                  const bf16 *__restrict__ logits, const bf16 *__restrict__ bias,
                                  int32_t n, int32_t E, int32_t k, int32_t scoring,
                                  int32_t norm_topk, float scale, int32_t n_group,
                                  int32_t topk_group, int32_t *__restrict__ counts,
                                  int32_t *__restrict__ offsets, int32_t *__restrict__ active,
                                  int32_t *__restrict__ perm, int32_t *__restrict__ inv,
                                  int32_t *__restrict__ tiles) {
    __shared__ float sp[ROUTE_WARPS][LETHE_MOE_MAX_EXPERTS], sc[ROUTE_WARPS][LETHE_MOE_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTE_WARPS][LETHE_MOE_MAX_EXPERTS];
    const int w = threadIdx.x / 32;
    if (w < n) /* warp-uniform */
        route_token(ids, wts, logits, bias, w, E, k, scoring, norm_topk, scale, n_group,
                    topk_group, sp[w], sc[w], taken[w]);
    __syncthreads(); /* the block's ids writes are visible to the block */
    sort_pairs(ids, n * k, E, counts, offsets, active, perm, inv, tiles);
}

/* acc[r] += dot(w row (uint4 vectors wr), x row of pair r) for the pairs' x rows xr[r] */
__device__ static inline void dot8(float *acc, const uint4 wv, const uint4 *const *xr, int m,
                                   int32_t v) {
    const __nv_bfloat162 *w2 = (const __nv_bfloat162 *)&wv;
#pragma unroll
    for (int r = 0; r < MV_TOK; r++) {
        if (r >= m) break;
        const uint4 xv = __ldg(xr[r] + v);
        const __nv_bfloat162 *x2 = (const __nv_bfloat162 *)&xv;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float2 a = __bfloat1622float2(w2[q]), b = __bfloat1622float2(x2[q]);
            acc[r] += a.x * b.x + a.y * b.y;
        }
    }
}

/* dot8 for two weight rows at once (gate and up): each x vector is loaded
 * once for both (at batch 64 the x loads, not the weights, bound the kernel
 * through L1 when they are repeated) */
__device__ static inline void dot8x2(float *acc_a, float *acc_b, const uint4 av, const uint4 bv,
                                     const uint4 *const *xr, int m, int32_t v) {
    const __nv_bfloat162 *a2 = (const __nv_bfloat162 *)&av, *b2 = (const __nv_bfloat162 *)&bv;
#pragma unroll
    for (int r = 0; r < MV_TOK; r++) {
        if (r >= m) break;
        const uint4 xv = __ldg(xr[r] + v);
        const __nv_bfloat162 *x2 = (const __nv_bfloat162 *)&xv;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float2 xf = __bfloat1622float2(x2[q]);
            const float2 a = __bfloat1622float2(a2[q]), b = __bfloat1622float2(b2[q]);
            acc_a[r] += a.x * xf.x + a.y * xf.y;
            acc_b[r] += b.x * xf.x + b.y * xf.y;
        }
    }
}

/* h[sorted pair] = silu(x Wg[e]^T) * (x Wu[e]^T) for the pairs of active expert
 * blockIdx.y; warp = one of the ffn rows; x rows read in place (pair -> token) */
__global__ void __launch_bounds__(MV_WARPS * 32)
    gate_up_kernel(bf16 *__restrict__ h, const bf16 *__restrict__ x, const bf16 *__restrict__ wg,
                   const bf16 *__restrict__ wu, const int32_t *__restrict__ offsets,
                   const int32_t *__restrict__ active, const int32_t *__restrict__ perm, int32_t E,
                   int32_t k, int32_t dim, int32_t ffn) {
    if ((int32_t)blockIdx.y >= active[E]) return;
    const int32_t e = active[blockIdx.y], o = offsets[e], m_all = offsets[e + 1] - o;
    const int lane = threadIdx.x % 32;
    const int32_t row = blockIdx.x * MV_WARPS + threadIdx.x / 32;
    if (row >= ffn) return;
    const uint4 *wgr = (const uint4 *)(wg + ((size_t)e * ffn + row) * dim);
    const uint4 *wur = (const uint4 *)(wu + ((size_t)e * ffn + row) * dim);
    const int32_t nv = dim / 8;
    for (int32_t c0 = 0; c0 < m_all; c0 += MV_TOK) {
        const int m = min(MV_TOK, m_all - c0);
        const uint4 *xr[MV_TOK];
#pragma unroll
        for (int r = 0; r < MV_TOK; r++)
            xr[r] = (const uint4 *)(x + (size_t)(perm[o + c0 + min(r, m - 1)] / k) * dim);
        float ag[MV_TOK] = {0}, au[MV_TOK] = {0};
#pragma unroll 4
        for (int32_t v = lane; v < nv; v += 32) {
            const uint4 gv = __ldg(wgr + v), uv = __ldg(wur + v);
            dot8x2(ag, au, gv, uv, xr, m, v);
        }
#pragma unroll
        for (int r = 0; r < MV_TOK; r++) {
            if (r >= m) break;
            float g = ag[r], u = au[r];
            for (int q = 16; q > 0; q >>= 1) {
                g += __shfl_xor_sync(0xffffffffu, g, q);
                u += __shfl_xor_sync(0xffffffffu, u, q);
            }
            if (lane == 0)
                h[(size_t)(o + c0 + r) * ffn + row] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
        }
    }
}

/* ys[sorted pair] = h[sorted pair] W_down[e]^T; warp = one of the dim rows */
__global__ void __launch_bounds__(MV_WARPS * 32)
    down_kernel(bf16 *__restrict__ ys, const bf16 *__restrict__ h, const bf16 *__restrict__ wd,
                const int32_t *__restrict__ offsets, const int32_t *__restrict__ active, int32_t E,
                int32_t dim, int32_t ffn) {
    if ((int32_t)blockIdx.y >= active[E]) return;
    const int32_t e = active[blockIdx.y], o = offsets[e], m_all = offsets[e + 1] - o;
    const int lane = threadIdx.x % 32;
    const int32_t row = blockIdx.x * MV_WARPS + threadIdx.x / 32;
    if (row >= dim) return;
    const uint4 *wr = (const uint4 *)(wd + ((size_t)e * dim + row) * ffn);
    const int32_t nv = ffn / 8;
    for (int32_t c0 = 0; c0 < m_all; c0 += MV_TOK) {
        const int m = min(MV_TOK, m_all - c0);
        const uint4 *xr[MV_TOK];
#pragma unroll
        for (int r = 0; r < MV_TOK; r++)
            xr[r] = (const uint4 *)(h + (size_t)(o + c0 + min(r, m - 1)) * ffn);
        float acc[MV_TOK] = {0};
#pragma unroll 4
        for (int32_t v = lane; v < nv; v += 32) dot8(acc, __ldg(wr + v), xr, m, v);
#pragma unroll
        for (int r = 0; r < MV_TOK; r++) {
            if (r >= m) break;
            float a = acc[r];
            for (int q = 16; q > 0; q >>= 1) a += __shfl_xor_sync(0xffffffffu, a, q);
            if (lane == 0) ys[(size_t)(o + c0 + r) * dim + row] = __float2bfloat16(a);
        }
    }
}

/* ---- the grouped GEMM (prefill) ----
 * A block computes a GG_BM x GG_BN tile of one expert's output rows (sorted
 * pairs) with 4 warps of 32 x 32 (2 x 2 WMMA 16 x 16 x 16 fragments), K in
 * steps of GG_BK through shared memory (rows padded by 8 bf16: 80-byte rows
 * keep the fragments' 32-byte alignment and spread the banks). Rows past the
 * expert's pairs and columns past the output width load zeros and are not
 * stored. */
#define GG_BM LETHE_MOE_TILE_M
#define GG_BN 64
#define GG_BK 32
#define GG_LD (GG_BK + 8)
#define GG_THREADS 128

namespace wmma = nvcuda::wmma;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> gg_frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> gg_frag_b;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> gg_frag_c;

/* the block's expert (tiles[e] <= tile < tiles[e + 1]) and its first row; false past the last tile */
__device__ static bool gg_tile(const int32_t *tiles, int32_t E, int32_t tile, int32_t *e_out,
                               int32_t *m0) {
    if (tile >= tiles[E]) return false;
    int32_t lo = 0, hi = E - 1;
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (tiles[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    *e_out = lo;
    *m0 = (tile - tiles[lo]) * GG_BM;
    return true;
}

/* rows [n0, n0 + GG_BN) x columns [k0, k0 + GG_BK) of W [n_rows, K] into Bs (zeros past the edges) */
__device__ static inline void gg_load_b(bf16 (*Bs)[GG_LD], const bf16 *__restrict__ w, int32_t n0,
                                        int32_t n_rows, int32_t k0, int32_t K) {
    for (int i = threadIdx.x; i < GG_BN * (GG_BK / 8); i += GG_THREADS) {
        const int r = i / (GG_BK / 8), v = i % (GG_BK / 8);
        const int32_t kk = k0 + v * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (n0 + r < n_rows && kk < K) val = __ldg((const uint4 *)(w + (size_t)(n0 + r) * K + kk));
        *(uint4 *)&Bs[r][v * 8] = val;
    }
}

/* A tile rows: sorted pair rows [m0, m0 + GG_BM) of an expert with m pairs;
 * row r is src + row_of(r) * K (gather: the token's x row; else the pair's own) */
__device__ static inline void gg_load_a(bf16 (*As)[GG_LD], const bf16 *__restrict__ src,
                                        const int32_t *__restrict__ perm, int32_t k, int32_t o,
                                        int32_t m0, int32_t m, int32_t k0, int32_t K) {
    for (int i = threadIdx.x; i < GG_BM * (GG_BK / 8); i += GG_THREADS) {
        const int r = i / (GG_BK / 8), v = i % (GG_BK / 8);
        const int32_t kk = k0 + v * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (m0 + r < m && kk < K) {
            const int32_t row = perm ? perm[o + m0 + r] / k : o + m0 + r;
            val = __ldg((const uint4 *)(src + (size_t)row * K + kk));
        }
        *(uint4 *)&As[r][v * 8] = val;
    }
}

/* acc[i][j] += A rows (warp's 32) x B rows (warp's 32)^T over one GG_BK step */
__device__ static inline void gg_mma(gg_frag_c (*acc)[2], const bf16 (*As)[GG_LD],
                                     const bf16 (*Bs)[GG_LD], int wm, int wn) {
#pragma unroll
    for (int kf = 0; kf < GG_BK; kf += 16) {
        gg_frag_a a[2];
        gg_frag_b b[2];
#pragma unroll
        for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], &As[wm * 32 + i * 16][kf], GG_LD);
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::load_matrix_sync(b[j], &Bs[wn * 32 + j * 16][kf], GG_LD);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
}

/* h[o + row] = silu(x Wg[e]^T) * (x Wu[e]^T) for the block's tile (grid: x = ffn / GG_BN, y = tiles) */
__global__ void __launch_bounds__(GG_THREADS)
    gg_gate_up_kernel(bf16 *__restrict__ h, const bf16 *__restrict__ x, const bf16 *__restrict__ wg,
                      const bf16 *__restrict__ wu, const int32_t *__restrict__ offsets,
                      const int32_t *__restrict__ tiles, const int32_t *__restrict__ perm, int32_t E,
                      int32_t k, int32_t dim, int32_t ffn) {
    __shared__ __align__(32) bf16 As[GG_BM][GG_LD];
    __shared__ __align__(32) bf16 Bg[GG_BN][GG_LD];
    __shared__ __align__(32) bf16 Bu[GG_BN][GG_LD];
    __shared__ __align__(32) float stage[GG_THREADS / 32][2][16 * 16];
    int32_t e, m0;
    if (!gg_tile(tiles, E, blockIdx.y, &e, &m0)) return;
    const int32_t o = offsets[e], m = offsets[e + 1] - o, n0 = blockIdx.x * GG_BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp / 2, wn = warp % 2;
    gg_frag_c cg[2][2], cu[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(cg[i][j], 0.0f), wmma::fill_fragment(cu[i][j], 0.0f);
    const bf16 *wge = wg + (size_t)e * ffn * dim, *wue = wu + (size_t)e * ffn * dim;
    for (int32_t k0 = 0; k0 < dim; k0 += GG_BK) {
        gg_load_a(As, x, perm, k, o, m0, m, k0, dim);
        gg_load_b(Bg, wge, n0, ffn, k0, dim);
        gg_load_b(Bu, wue, n0, ffn, k0, dim);
        __syncthreads();
        gg_mma(cg, As, Bg, wm, wn);
        gg_mma(cu, As, Bu, wm, wn);
        __syncthreads();
    }
    float *sg = stage[warp][0], *su = stage[warp][1];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(sg, cg[i][j], 16, wmma::mem_row_major);
            wmma::store_matrix_sync(su, cu[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int q = lane; q < 256; q += 32) {
                const int32_t row = m0 + wm * 32 + i * 16 + q / 16;
                const int32_t col = n0 + wn * 32 + j * 16 + q % 16;
                if (row < m && col < ffn) {
                    const float g = sg[q], u = su[q];
                    h[(size_t)(o + row) * ffn + col] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
                }
            }
            __syncwarp();
        }
}

/* ys[o + row] = h[o + row] W_down[e]^T for the block's tile (grid: x = dim / GG_BN, y = tiles) */
__global__ void __launch_bounds__(GG_THREADS)
    gg_down_kernel(bf16 *__restrict__ ys, const bf16 *__restrict__ h, const bf16 *__restrict__ wd,
                   const int32_t *__restrict__ offsets, const int32_t *__restrict__ tiles, int32_t E,
                   int32_t dim, int32_t ffn) {
    __shared__ __align__(32) bf16 As[GG_BM][GG_LD];
    __shared__ __align__(32) bf16 Bs[GG_BN][GG_LD];
    __shared__ __align__(32) float stage[GG_THREADS / 32][16 * 16];
    int32_t e, m0;
    if (!gg_tile(tiles, E, blockIdx.y, &e, &m0)) return;
    const int32_t o = offsets[e], m = offsets[e + 1] - o, n0 = blockIdx.x * GG_BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp / 2, wn = warp % 2;
    gg_frag_c acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    const bf16 *wde = wd + (size_t)e * dim * ffn;
    for (int32_t k0 = 0; k0 < ffn; k0 += GG_BK) {
        gg_load_a(As, h, NULL, 1, o, m0, m, k0, ffn);
        gg_load_b(Bs, wde, n0, dim, k0, ffn);
        __syncthreads();
        gg_mma(acc, As, Bs, wm, wn);
        __syncthreads();
    }
    float *st = stage[warp];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(st, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int q = lane; q < 256; q += 32) {
                const int32_t row = m0 + wm * 32 + i * 16 + q / 16;
                const int32_t col = n0 + wn * 32 + j * 16 + q % 16;
                if (row < m && col < dim) ys[(size_t)(o + row) * dim + col] = __float2bfloat16(st[q]);
            }
            __syncwarp();
        }
}

/* out[t, d] (+)= sum_j wts[t, j] * ys[inv[t k + j], d], j ascending, fp32, one rounding */
__global__ void combine_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ ys,
                               const float *__restrict__ wts, const int32_t *__restrict__ inv,
                               int32_t n, int32_t k, int32_t dim, int32_t accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n * dim;
         i += (size_t)gridDim.x * blockDim.x) {
        const int32_t t = (int32_t)(i / dim), d = (int32_t)(i % dim);
        float acc = 0.0f;
        for (int32_t j = 0; j < k; j++)
            acc += wts[(size_t)t * k + j] *
                   __bfloat162float(ys[(size_t)inv[(size_t)t * k + j] * dim + d]);
        out[i] = __float2bfloat16(accumulate ? __bfloat162float(out[i]) + acc : acc);
    }
}

/* Few pairs (4 P <= E: nearly every active expert has one pair, so reading a
 * weight row once per pair is reading it once), down projection and combine
 * in one pass: out[t, d] (+)= sum_j wts[t, j] * (h[inv[t k + j]] . W_down[e_j][d, :]),
 * e_j = ids[t k + j]. Grid (dim / MV_WARPS, n): warp = output row d of token
 * t; its k * ffn / 8 (choice, 16-byte vector) products are strided over the
 * lanes (k weight rows in flight at once, not one), fp32, one rounding. The
 * token's choices are staged in shared memory first. */
__global__ void __launch_bounds__(MV_WARPS * 32)
    down_combine_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ h,
                        const bf16 *__restrict__ wd, const int32_t *__restrict__ ids,
                        const float *__restrict__ wts, const int32_t *__restrict__ inv, int32_t k,
                        int32_t dim, int32_t ffn, int32_t accumulate) {
    __shared__ const uint4 *s_w[LETHE_MOE_MAX_EXPERTS], *s_h[LETHE_MOE_MAX_EXPERTS];
    __shared__ float s_wt[LETHE_MOE_MAX_EXPERTS];
    const int32_t t = blockIdx.y, d0 = blockIdx.x * MV_WARPS;
    for (int32_t j = threadIdx.x; j < k; j += blockDim.x) {
        const int32_t p = t * k + j;
        s_w[j] = (const uint4 *)(wd + ((size_t)ids[p] * dim + d0) * ffn);
        s_h[j] = (const uint4 *)(h + (size_t)inv[p] * ffn);
        s_wt[j] = wts[p];
    }
    __syncthreads();
    const int lane = threadIdx.x % 32, r = threadIdx.x / 32;
    if (d0 + r >= dim) return;
    const int32_t nv = ffn / 8, total = k * nv;
    const size_t row_off = (size_t)r * nv; /* row d0 + r of each expert's block, in vectors */
    float acc = 0.0f;
    for (int32_t i0 = lane; i0 < total; i0 += 32 * DC_UNROLL) {
        uint4 wv[DC_UNROLL], hv[DC_UNROLL];
        float wt[DC_UNROLL];
#pragma unroll
        for (int u = 0; u < DC_UNROLL; u++) { /* every load issued before any use */
            const int32_t i = i0 + u * 32;
            wv[u] = hv[u] = make_uint4(0u, 0u, 0u, 0u);
            wt[u] = 0.0f;
            if (i < total) {
                const int32_t j = i / nv, v = i - j * nv;
                wv[u] = __ldg(s_w[j] + row_off + v);
                hv[u] = __ldg(s_h[j] + v);
                wt[u] = s_wt[j];
            }
        }
#pragma unroll
        for (int u = 0; u < DC_UNROLL; u++) {
            const __nv_bfloat162 *w2 = (const __nv_bfloat162 *)&wv[u];
            const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&hv[u];
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float2 a = __bfloat1622float2(w2[q]), b = __bfloat1622float2(h2[q]);
                s += a.x * b.x + a.y * b.y;
            }
            acc += wt[u] * s;
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
        bf16 *y = out + (size_t)t * dim + d0 + r;
        *y = __float2bfloat16(accumulate ? __bfloat162float(*y) + acc : acc);
    }
}

extern "C" void lethe_cuda_moe(lethe_backend *be, const lethe_moe_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    const int32_t n = a->n, k = a->k, E = a->n_experts, dim = a->dim, ffn = a->ffn;
    LETHE_ASSERT(n >= 0 && k > 0 && k <= E && E <= LETHE_MOE_MAX_EXPERTS && a->out != a->x);
    LETHE_ASSERT(a->n_group >= 1 && a->n_group <= 64 && dim % 8 == 0 && ffn % 8 == 0);
    if (!n) return;
    const lethe_moe_layout L = lethe_moe_layout_of(sizeof(bf16), n, k, dim, ffn, E);
    LETHE_ASSERT(a->ws && a->ws_bytes >= L.total);
    char *ws = (char *)a->ws;
    int32_t *ids = (int32_t *)(ws + L.ids), *counts = (int32_t *)(ws + L.counts);
    int32_t *offsets = (int32_t *)(ws + L.offsets), *active = (int32_t *)(ws + L.active);
    int32_t *perm = (int32_t *)(ws + L.perm), *inv = (int32_t *)(ws + L.inv);
    int32_t *tiles = (int32_t *)(ws + L.tiles);
    float *wts = (float *)(ws + L.wts);
    bf16 *hg = (bf16 *)(ws + L.hg), *ys = (bf16 *)(ws + L.ys);
    const int32_t P = n * k;

    if (n <= ROUTE_WARPS) { /* decode: one launch */
        const int32_t e32 = (E + 31) / 32 * 32;
        route_sort_kernel<<<1, (unsigned)(e32 > ROUTE_WARPS * 32 ? e32 : ROUTE_WARPS * 32), 0,
                            c->stream>>>(ids, wts, (const bf16 *)a->logits,
                                         (const bf16 *)a->bias, n, E, k, a->scoring, a->norm_topk,
                                         a->scale, a->n_group, a->topk_group, counts, offsets,
                                         active, perm, inv, tiles);
        CU_LAUNCH_CHECK();
    } else {
        route_kernel<<<(unsigned)((n + ROUTE_WARPS - 1) / ROUTE_WARPS), ROUTE_WARPS * 32, 0,
                       c->stream>>>(ids, wts, (const bf16 *)a->logits, (const bf16 *)a->bias, n, E,
                                    k, a->scoring, a->norm_topk, a->scale, a->n_group,
                                    a->topk_group);
        CU_LAUNCH_CHECK();
        sort_kernel<<<1, (unsigned)((E + 31) / 32 * 32), 0, c->stream>>>(ids, P, E, counts,
                                                                         offsets, active, perm,
                                                                         inv, tiles);
        CU_LAUNCH_CHECK();
    }
    const bf16 *wg = (const bf16 *)a->w_gate, *wu = (const bf16 *)a->w_up;
    const bf16 *wd = (const bf16 *)a->w_down;
    if (n <= LETHE_MOE_SMALL_N) {
        const unsigned ny = (unsigned)(P < E ? P : E); /* active experts <= min(P, E) */
        dim3 g1((unsigned)((ffn + MV_WARPS - 1) / MV_WARPS), ny);
        gate_up_kernel<<<g1, MV_WARPS * 32, 0, c->stream>>>(hg, (const bf16 *)a->x, wg, wu, offsets,
                                                            active, perm, E, k, dim, ffn);
        CU_LAUNCH_CHECK();
        if ((int64_t)P * 4 <= E) { /* down + combine (+ residual) in one pass */
            dim3 g2((unsigned)((dim + MV_WARPS - 1) / MV_WARPS), (unsigned)n);
            down_combine_kernel<<<g2, MV_WARPS * 32, 0, c->stream>>>(
                (bf16 *)a->out, hg, wd, ids, wts, inv, k, dim, ffn, a->accumulate ? 1 : 0);
            CU_LAUNCH_CHECK();
            return;
        }
        dim3 g2((unsigned)((dim + MV_WARPS - 1) / MV_WARPS), ny);
        down_kernel<<<g2, MV_WARPS * 32, 0, c->stream>>>(ys, hg, wd, offsets, active, E, dim, ffn);
        CU_LAUNCH_CHECK();
    } else {
        /* row tiles: each expert's last one may be partial */
        const int64_t max_tiles = ((int64_t)P + GG_BM - 1) / GG_BM + (P < E ? P : E);
        LETHE_ASSERT(max_tiles <= 65535 && "moe: too many tokens for one grouped GEMM grid");
        dim3 g1((unsigned)((ffn + GG_BN - 1) / GG_BN), (unsigned)max_tiles);
        gg_gate_up_kernel<<<g1, GG_THREADS, 0, c->stream>>>(hg, (const bf16 *)a->x, wg, wu, offsets,
                                                             tiles, perm, E, k, dim, ffn);
        CU_LAUNCH_CHECK();
        dim3 g2((unsigned)((dim + GG_BN - 1) / GG_BN), (unsigned)max_tiles);
        gg_down_kernel<<<g2, GG_THREADS, 0, c->stream>>>(ys, hg, wd, offsets, tiles, E, dim, ffn);
        CU_LAUNCH_CHECK();
    }
    const size_t total = (size_t)n * dim;
    unsigned blocks = lethe_cuda_blocks(total, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    combine_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)a->out, ys, wts, inv, n, k, dim,
                                                  a->accumulate ? 1 : 0);
    CU_LAUNCH_CHECK();
}

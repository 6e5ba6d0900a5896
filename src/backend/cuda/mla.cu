/* mla.cu - the ops of multi-head latent attention on the CUDA backend (CPU
 * twins in backend/cpu/mla.c; definitions in backend.h).
 *
 *   matmul_heads      cuBLAS strided-batched bf16 GEMM, one batch entry per
 *                     head (fp32 accumulation); decode-sized n (<= 4) a GEMV
 *                     kernel instead (heads_gemv_kernel: one launch reads
 *                     each head's weights once at the memory rate)
 *   copy_block        a column block of rows (optionally scattered to slots)
 *   attention_latent  split-K flash decoding with V = the first v_dim columns
 *                     of each slot. A block = (query row, split) and holds ALL
 *                     heads: each tile of LT slots is read from memory once
 *                     into shared memory and serves every head (warp w takes
 *                     heads w, w + 16), so decode reads one latent per token,
 *                     not one per head. Partials are merged by
 *                     lethe_cuda_attn_merge (attention.cu), the grid is fixed
 *                     from the batch size (graph-capturable). Prefill rows run
 *                     the same kernel (rows are items). */
#include "backend/cuda/attention_common.cuh"
#include "backend/args.h"

#include <stdio.h>

#define LAT_WARPS 16
#define LAT_THREADS (LAT_WARPS * 32)
#define LAT_TILE 16 /* slots per shared-memory tile */
#define LAT_GRAN 64 /* keys per split-K granule (multiple of LAT_TILE) */
#define LAT_HPW 2   /* heads per warp: n_heads <= 32 */
#define LAT_DKL 20  /* key dims per lane: head_dim <= 640 */
#define LAT_DVL 16  /* value dims per lane: v_dim <= 512 */

__global__ void __launch_bounds__(LAT_THREADS)
    latent_kernel(const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                  const int32_t *__restrict__ q_begin, const int32_t *__restrict__ sel_begin,
                  const int32_t *__restrict__ sel, int n_seqs, int decode, int H, int D, int Dv,
                  float scale_log2, int n_splits, float *__restrict__ ws_o,
                  float *__restrict__ ws_lse) {
    __shared__ __align__(16) bf16 kt[LAT_TILE][LAT_DKL * 32];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int32_t r = blockIdx.x;
    const int split = blockIdx.z;
    int32_t base, n_ent;
    item_range(q_begin, sel_begin, n_seqs, decode != 0, r, &base, &n_ent);
    const int32_t chunk = split_chunk(n_ent, n_splits, LAT_GRAN);
    const int32_t k_begin = split * chunk;
    if (k_begin >= n_ent) return;
    const int32_t k_end = min(n_ent, k_begin + chunk);

    float qv[LAT_HPW][LAT_DKL], acc[LAT_HPW][LAT_DVL], m[LAT_HPW], l[LAT_HPW];
#pragma unroll
    for (int hh = 0; hh < LAT_HPW; hh++) {
        const int h = warp + hh * LAT_WARPS;
#pragma unroll
        for (int i = 0; i < LAT_DKL; i++) {
            const int d = lane + 32 * i;
            qv[hh][i] = h < H && d < D
                            ? __bfloat162float(q[((size_t)r * H + h) * D + d]) * scale_log2
                            : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < LAT_DVL; i++) acc[hh][i] = 0.0f;
        m[hh] = -INFINITY, l[hh] = 0.0f;
    }
    const int nv = D / 8; /* 16-byte vectors per slot */
    for (int32_t t0 = k_begin; t0 < k_end; t0 += LAT_TILE) {
        const int nt = min(LAT_TILE, k_end - t0);
        __syncthreads();
        for (int i = tid; i < nt * nv; i += LAT_THREADS) {
            const int kk = i / nv, v = i % nv;
            const size_t slot = (size_t)sel[base + t0 + kk];
            *(uint4 *)&kt[kk][v * 8] = __ldg((const uint4 *)(kc + slot * D) + v);
        }
        __syncthreads();
        for (int kk = 0; kk < nt; kk++) {
#pragma unroll
            for (int hh = 0; hh < LAT_HPW; hh++) {
                if (warp + hh * LAT_WARPS >= H) break;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < LAT_DKL; i++) {
                    const int d = lane + 32 * i;
                    if (d < D) s += qv[hh][i] * __bfloat162float(kt[kk][d]);
                }
                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                const float mn = fmaxf(m[hh], s);
                const float c = exp2f(m[hh] - mn), p = exp2f(s - mn);
                l[hh] = l[hh] * c + p;
                m[hh] = mn;
#pragma unroll
                for (int i = 0; i < LAT_DVL; i++) {
                    const int d = lane + 32 * i;
                    const float v = d < Dv ? __bfloat162float(kt[kk][d]) : 0.0f;
                    acc[hh][i] = acc[hh][i] * c + p * v;
                }
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < LAT_HPW; hh++) {
        const int h = warp + hh * LAT_WARPS;
        if (h >= H) break;
        const size_t idx = ((size_t)r * H + h) * n_splits + split;
#pragma unroll
        for (int i = 0; i < LAT_DVL; i++) {
            const int d = lane + 32 * i;
            if (d < Dv) ws_o[idx * Dv + d] = acc[hh][i] / l[hh];
        }
        if (lane == 0) ws_lse[idx] = m[hh] + log2f(l[hh]);
    }
}

extern "C" void lethe_cuda_attention_latent(lethe_backend *be, const lethe_attn_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    lethe_check_attention(a);
    const int H = a->n_heads, D = a->head_dim, Dv = a->v_dim;
    LETHE_ASSERT(a->n_kv_heads == 1 && !a->v_cache && Dv > 0 && Dv <= D);
    LETHE_ASSERT(H <= LAT_WARPS * LAT_HPW && D % 8 == 0 && D <= LAT_DKL * 32 && Dv <= LAT_DVL * 32);
    if (a->n_tokens == 0) return;
    bool decode = a->n_tokens == a->n_seqs;
    for (int s = 0; s < a->n_seqs && decode; s++)
        if (a->q_begin[s + 1] - a->q_begin[s] != 1) decode = false;
    const int32_t *d_qb = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sb = lethe_cuda_stage_idx(c, a->sel_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)a->sel_begin[a->n_seqs]);
    const int32_t n_items = a->n_tokens;
    int64_t want = ((int64_t)c->n_sms * 2 + n_items - 1) / n_items;
    const int n_splits = (int)(want < 1 ? 1 : want > SPLIT_MAX ? SPLIT_MAX : want);
    const size_t n_part = (size_t)n_items * H * n_splits;
    size_t cap = c->attn_ws_cap * sizeof(float);
    lethe_cuda_reserve(c, (void **)&c->attn_ws, &cap, n_part * (Dv + 1) * sizeof(float));
    c->attn_ws_cap = cap / sizeof(float);
    float *ws_o = c->attn_ws, *ws_lse = c->attn_ws + n_part * Dv;
    dim3 grid((unsigned)n_items, 1, (unsigned)n_splits);
    latent_kernel<<<grid, LAT_THREADS, 0, c->stream>>>(
        (const bf16 *)a->q, (const bf16 *)a->k_cache, d_qb, d_sb, d_sel, a->n_seqs, decode ? 1 : 0,
        H, D, Dv, a->scale * LOG2E, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
    lethe_cuda_attn_merge(c, a->out, d_qb, d_sb, a->n_seqs, decode, n_items, H, Dv, n_splits,
                          LAT_GRAN, false, NULL, ws_o, ws_lse);
}

/* matmul_heads for decode-sized n (<= HG_MAX_N): grid (out / HG_WARPS, heads),
 * warp = output row o of head h; it streams W[h] row o once with 16-byte
 * loads (HG_UNROLL issued before use) and reuses each element for the n
 * rows x[t, h, :] (read through L1); fp32, one rounding. Needs in, x_ld and
 * x_hs multiples of 8 and 16-byte aligned x and W. */
#define HG_MAX_N 4
#define HG_WARPS 8
#define HG_UNROLL 4

__global__ void __launch_bounds__(HG_WARPS * 32)
    heads_gemv_kernel(bf16 *__restrict__ y, int32_t y_ld, int32_t y_hs, const bf16 *__restrict__ x,
                      int32_t x_ld, int32_t x_hs, const bf16 *__restrict__ w, int32_t n,
                      int32_t out, int32_t in) {
    const int lane = threadIdx.x % 32;
    const int32_t h = blockIdx.y, o = blockIdx.x * HG_WARPS + threadIdx.x / 32;
    if (o >= out) return;
    const uint4 *wr = (const uint4 *)(w + ((size_t)h * out + o) * in);
    const bf16 *xh = x + (size_t)h * x_hs;
    const int32_t nv = in / 8;
    float acc[HG_MAX_N] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int32_t v0 = 0; v0 < nv; v0 += 32 * HG_UNROLL) {
        uint4 wv[HG_UNROLL];
#pragma unroll
        for (int u = 0; u < HG_UNROLL; u++) {
            const int32_t v = v0 + u * 32 + lane;
            wv[u] = v < nv ? __ldg(wr + v) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < HG_UNROLL; u++) {
            const int32_t v = v0 + u * 32 + lane;
            if (v >= nv) break;
            const __nv_bfloat162 *w2 = (const __nv_bfloat162 *)&wv[u];
#pragma unroll
            for (int r = 0; r < HG_MAX_N; r++) {
                if (r >= n) break;
                const uint4 xv = __ldg((const uint4 *)(xh + (size_t)r * x_ld) + v);
                const __nv_bfloat162 *x2 = (const __nv_bfloat162 *)&xv;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const float2 a = __bfloat1622float2(w2[q]), b = __bfloat1622float2(x2[q]);
                    acc[r] += a.x * b.x + a.y * b.y;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < HG_MAX_N; r++) {
        if (r >= n) break;
        float v = acc[r];
        for (int q = 16; q > 0; q >>= 1) v += __shfl_xor_sync(0xffffffffu, v, q);
        if (lane == 0) y[(size_t)r * y_ld + (size_t)h * y_hs + o] = __float2bfloat16(v);
    }
}

extern "C" void lethe_cuda_matmul_heads(lethe_backend *be, void *y, int32_t y_ld, int32_t y_hs,
                                        const void *x, int32_t x_ld, int32_t x_hs, const void *w,
                                        int32_t n, int32_t n_heads, int32_t out, int32_t in) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && n_heads > 0 && out > 0 && in > 0 && x_ld >= in && y_ld >= out);
    if (!n) return;
    if (n <= HG_MAX_N && in % 8 == 0 && x_ld % 8 == 0 && x_hs % 8 == 0 &&
        (uintptr_t)x % 16 == 0 && (uintptr_t)w % 16 == 0 && !c->matmul_cublas_only) {
        dim3 grid((unsigned)((out + HG_WARPS - 1) / HG_WARPS), (unsigned)n_heads);
        heads_gemv_kernel<<<grid, HG_WARPS * 32, 0, c->stream>>>(
            (bf16 *)y, y_ld, y_hs, (const bf16 *)x, x_ld, x_hs, (const bf16 *)w, n, out, in);
        CU_LAUNCH_CHECK();
        return;
    }
    const float alpha = 1.0f, beta = 0.0f;
    /* column-major: Y_h^T [out, n] = W_h^T' [out, in] X_h^T [in, n] (matmul.cu's form) */
    cublasStatus_t st = cublasGemmStridedBatchedEx(
        c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w, CUDA_R_16BF, in,
        (long long)out * in, x, CUDA_R_16BF, x_ld, (long long)x_hs, &beta, y, CUDA_R_16BF, y_ld,
        (long long)y_hs, n_heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
        char what[128];
        snprintf(what, sizeof what, "cublasGemmStridedBatchedEx(heads=%d, n=%d, out=%d, in=%d)",
                 n_heads, n, out, in);
        lethe_cuda_fatal_(what, cublasGetStatusString(st), __FILE__, __LINE__);
    }
}

__global__ void copy_block_kernel(bf16 *__restrict__ dst, int32_t dst_ld, int32_t dst_off,
                                  const int32_t *__restrict__ rows, const bf16 *__restrict__ src,
                                  int32_t src_ld, int32_t n_rows, int32_t width) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n_rows * width;
         i += (size_t)gridDim.x * blockDim.x) {
        const int32_t r = (int32_t)(i / width), col = (int32_t)(i % width);
        const int32_t d = rows ? rows[r] : r;
        dst[(size_t)d * dst_ld + dst_off + col] = src[(size_t)r * src_ld + col];
    }
}

extern "C" void lethe_cuda_copy_block(lethe_backend *be, void *dst, int32_t dst_ld, int32_t dst_off,
                                      const int32_t *rows, const void *src, int32_t src_ld,
                                      int32_t n_rows, int32_t width) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n_rows >= 0 && width >= 0 && dst_off >= 0 && dst_off + width <= dst_ld);
    if (!n_rows || !width) return;
    const int32_t *d_rows = rows ? lethe_cuda_stage_idx(c, rows, (size_t)n_rows) : NULL;
    unsigned blocks = lethe_cuda_blocks((size_t)n_rows * width, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    copy_block_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)dst, dst_ld, dst_off, d_rows,
                                                     (const bf16 *)src, src_ld, n_rows, width);
    CU_LAUNCH_CHECK();
}

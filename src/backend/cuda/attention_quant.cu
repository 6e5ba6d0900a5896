/* attention_quant.cu - KV store and attention over QUANTIZED KV (CUDA backend).
 *
 * The twin of backend/cpu/attention_quant.c; formats are backend.h's
 * lethe_kv_format:
 *   FP8_E4M3  K/V caches: uint8 E4M3 codes [n_slots, n_kv_heads, D];
 *             kvq->k_scale / v_scale: f32 [n_slots, n_kv_heads];
 *             x^ = e4m3(code) * scale (src/sparse/quant.h).
 *
 * kv_store_quant (fp8_store_kernel): one warp per (token, KV head, K or V):
 * amax over the head's D bf16 values (exact in fp32), scale = amax / 448
 * (IEEE division), code = e4m3_rn(x / scale) written by the same steps as the
 * CPU reference lethe_fp8_e4m3_from_float (frexpf / rintf = round half to
 * even), so for the same bf16 inputs the codes and scales are bit-identical
 * to the CPU backend's (checked in tests/gpu/test_cuda_ops.c).
 *
 * attention (qsplit_kernel + qmerge_kernel): split-K flash attention on CUDA
 * cores for decode AND prefill/extend (items are query rows; a row's causal
 * limit comes from its sequence). A block = (query row, KV head, chunk of up
 * to QA_GMAX query heads, split); a tile of 128 selection entries is read
 * straight from the codes: each thread dequantizes one key row in registers
 * (code * scale) for the QK dot products, then each warp dequantizes the V
 * rows of its 32 keys (a lane owns D/32 dims) for P V. Partial outputs and
 * log-sum-exps of the splits are merged by qmerge_kernel. The grid is fixed by
 * the batch shape (effective split count from the row length on the device),
 * so the decode step stays capturable in a CUDA graph. Prefill reads each key
 * tile once per query row (no tensor cores): correct but slower than the
 * dense WMMA prefill; see docs/sparse-methods.md. */
#include "backend/cuda/cuda_common.cuh"

#include <math.h>

#define QA_THREADS 128
#define QA_TILE 128
#define QA_GMAX 8
#define QA_SPLIT_MAX 64
#define QA_LOG2E 1.4426950408889634f

/* ---- E4M3 conversions (same steps as src/sparse/quant.c) ---------------- */

__device__ __forceinline__ uint32_t e4m3_from_float_dev(float x) {
    if (isnan(x)) return 0x7Fu;
    const uint32_t sign = signbit(x) ? 0x80u : 0u;
    const float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7Eu;
    uint32_t code;
    if (a < 0x1p-6f) {
        code = (uint32_t)rintf(a * 0x1p9f); /* subnormal m * 2^-9; m == 8 is the smallest normal */
    } else {
        int e2;
        const float f = frexpf(a, &e2); /* a = f 2^e2, f in [0.5, 1) */
        const uint32_t m = (uint32_t)rintf((2.0f * f - 1.0f) * 8.0f);
        code = (uint32_t)(e2 - 1 + 7) * 8u + m;
    }
    if (code > 0x7Eu) code = 0x7Eu;
    return sign | code;
}

__device__ __forceinline__ float e4m3_value_dev(uint32_t b) {
    const uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
    const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0x1p-9f;
    return (b & 0x80u) ? -v : v;
}

/* ---- kv_store_quant -------------------------------------------------------- */

/* grid-stride over warps; warp w = ((token * n_kv) + head) * 2 + (0: K, 1: V) */
__global__ void fp8_store_kernel(uint8_t *__restrict__ kc, uint8_t *__restrict__ vc,
                                 float *__restrict__ ks, float *__restrict__ vs,
                                 const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                 const int32_t *__restrict__ slots, int32_t n, int n_kv, int D) {
    const int lane = threadIdx.x % 32;
    const int64_t n_warps = (int64_t)n * n_kv * 2;
    const int64_t stride = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < n_warps; w += stride) {
        const int which = (int)(w % 2);
        const int h = (int)((w / 2) % n_kv);
        const int32_t i = (int32_t)(w / 2 / n_kv);
        const bf16 *src = (which ? v : k) + ((size_t)i * n_kv + h) * D;
        float x[8]; /* D <= 256 */
        float amax = 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int d = lane + 32 * u;
            x[u] = d < D ? __bfloat162float(src[d]) : 0.0f;
            amax = fmaxf(amax, fabsf(x[u]));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = amax / 448.0f;
        const int32_t slot = slots[i];
        uint8_t *dst = (which ? vc : kc) + ((size_t)slot * n_kv + h) * D;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int d = lane + 32 * u;
            if (d < D) dst[d] = (uint8_t)(s > 0.0f ? e4m3_from_float_dev(x[u] / s) : 0u);
        }
        if (lane == 0) (which ? vs : ks)[(size_t)slot * n_kv + h] = s;
    }
}

extern "C" void lethe_cuda_kv_store_quant(lethe_backend *be, const lethe_kv_quant *kvq,
                                          void *k_cache, void *v_cache, const void *k,
                                          const void *v, const int32_t *slots, int32_t n,
                                          int32_t n_kv_heads, int32_t head_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(kvq && kvq->format == LETHE_KV_FP8_E4M3);
    LETHE_ASSERT(head_dim > 0 && head_dim <= 256);
    if (n <= 0) return;
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)n);
    const size_t warps = (size_t)n * n_kv_heads * 2;
    unsigned blocks = lethe_cuda_blocks(warps, 4); /* 4 warps per block of 128 */
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    fp8_store_kernel<<<blocks, 128, 0, c->stream>>>((uint8_t *)k_cache, (uint8_t *)v_cache,
                                                    (float *)kvq->k_scale, (float *)kvq->v_scale,
                                                    (const bf16 *)k, (const bf16 *)v, d_slots, n,
                                                    n_kv_heads, head_dim);
    CU_LAUNCH_CHECK();
}

/* ---- attention ------------------------------------------------------------- */

/* Entry range of query row r: selection entries sel[base, base + n_ent). */
__device__ __forceinline__ void qa_row_range(const int32_t *q_begin, const int32_t *sel_begin,
                                             int n_seqs, int32_t r, int32_t *base, int32_t *n_ent) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (q_begin[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const int32_t n_sel = sel_begin[lo + 1] - sel_begin[lo];
    const int32_t n_q = q_begin[lo + 1] - q_begin[lo];
    *base = sel_begin[lo];
    *n_ent = n_sel - n_q + (r - q_begin[lo]) + 1;
}

__device__ __forceinline__ int32_t qa_chunk(int32_t n_ent, int n_splits) {
    int32_t per = (n_ent + n_splits - 1) / n_splits;
    per = (per + QA_TILE - 1) / QA_TILE * QA_TILE;
    return per < QA_TILE ? QA_TILE : per;
}

/* grid: x = query row, y = KV head * head chunks, z = split.
 * ws_o [rows, n_heads, n_splits, D], ws_lse [rows, n_heads, n_splits] (log2 domain).
 * D % 8 == 0, D <= DMAX. */
template <int DMAX>
__global__ void __launch_bounds__(QA_THREADS)
qsplit_kernel(int D, const bf16 *__restrict__ q, const uint8_t *__restrict__ kc,
              const uint8_t *__restrict__ vc, const float *__restrict__ ks,
              const float *__restrict__ vs, const int32_t *__restrict__ q_begin,
              const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel, int n_seqs,
              int n_heads, int n_kv, float scale_log2, int n_splits, float *__restrict__ ws_o,
              float *__restrict__ ws_lse) {
    constexpr int DPL = DMAX / 32; /* dims per lane in P V: 2, 4 or 8 */
    __shared__ float qs[QA_GMAX][DMAX];
    __shared__ float ps[QA_TILE][QA_GMAX];
    __shared__ int32_t slot_s[QA_TILE];
    __shared__ float red[QA_THREADS / 32][QA_GMAX];
    __shared__ float accs[QA_THREADS / 32][QA_GMAX][DMAX];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int32_t r = blockIdx.x;
    const int G_all = n_heads / n_kv, n_chunks = (G_all + QA_GMAX - 1) / QA_GMAX;
    const int kvh = blockIdx.y / n_chunks, h0 = kvh * G_all + (blockIdx.y % n_chunks) * QA_GMAX;
    const int G = min(QA_GMAX, kvh * G_all + G_all - h0);
    const int split = blockIdx.z;

    int32_t base, n_ent;
    qa_row_range(q_begin, sel_begin, n_seqs, r, &base, &n_ent);
    const int32_t chunk = qa_chunk(n_ent, n_splits);
    const int32_t k_begin = split * chunk;
    if (k_begin >= n_ent) return; /* past this row's effective split count (uniform per block) */
    const int32_t k_end = min(n_ent, k_begin + chunk);

    for (int i = tid; i < QA_GMAX * DMAX; i += QA_THREADS) {
        const int g = i / DMAX, d = i % DMAX;
        qs[g][d] = g < G && d < D ? __bfloat162float(q[((size_t)r * n_heads + h0 + g) * D + d]) * scale_log2
                                  : 0.0f;
    }
    __syncthreads();

    float m_run[QA_GMAX], l_t[QA_GMAX], acc[QA_GMAX][DPL];
#pragma unroll
    for (int g = 0; g < QA_GMAX; g++) {
        m_run[g] = -INFINITY;
        l_t[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.0f;
    }
    const bool lane_ok = lane * DPL < D; /* D % 8 == 0: a lane's dims are all in or all out */

    for (int32_t k0 = k_begin; k0 < k_end; k0 += QA_TILE) {
        const int32_t e = k0 + tid;
        const bool valid = e < k_end;
        const int32_t slot = valid ? sel[base + e] : 0;
        slot_s[tid] = slot;
        float s[QA_GMAX];
#pragma unroll
        for (int g = 0; g < QA_GMAX; g++) s[g] = 0.0f;
        if (valid) {
            const size_t row = (size_t)slot * n_kv + kvh;
            const float sc = ks[row];
            const uint2 *kp = (const uint2 *)(kc + row * D); /* 8 codes per load; D % 8 == 0 */
            for (int c8 = 0; c8 < D / 8; c8++) {
                const uint2 raw = __ldg(kp + c8);
#pragma unroll
                for (int b = 0; b < 8; b++) {
                    const uint32_t code = ((b < 4 ? raw.x : raw.y) >> (8 * (b % 4))) & 0xFFu;
                    const float kf = e4m3_value_dev(code) * sc;
                    const int d = c8 * 8 + b;
#pragma unroll
                    for (int g = 0; g < QA_GMAX; g++)
                        if (g < G) s[g] += qs[g][d] * kf;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < QA_GMAX; g++) {
            float v = valid ? s[g] : -INFINITY;
            for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
            if (lane == 0) red[warp][g] = v;
        }
        __syncthreads();
        float alpha[QA_GMAX];
#pragma unroll
        for (int g = 0; g < QA_GMAX; g++) {
            float mt = red[0][g];
#pragma unroll
            for (int w = 1; w < QA_THREADS / 32; w++) mt = fmaxf(mt, red[w][g]);
            const float m_new = fmaxf(m_run[g], mt); /* finite: the tile has a valid key */
            alpha[g] = exp2f(m_run[g] - m_new);      /* 0 on the first tile */
            const float p = valid && g < G ? exp2f(s[g] - m_new) : 0.0f;
            ps[tid][g] = p;
            l_t[g] = l_t[g] * alpha[g] + p;
            m_run[g] = m_new;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < QA_GMAX; g++)
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= alpha[g];
        const int32_t n_here = min(32, k_end - (k0 + warp * 32));
        if (lane_ok) {
            for (int u = 0; u < n_here; u++) {
                const int t = warp * 32 + u;
                const size_t row = (size_t)slot_s[t] * n_kv + kvh;
                const float sc = vs[row];
                const uint8_t *vp = vc + row * D + lane * DPL;
                float vf[DPL];
                if constexpr (DPL == 8) {
                    const uint2 raw = __ldg((const uint2 *)vp);
#pragma unroll
                    for (int b = 0; b < 8; b++)
                        vf[b] = e4m3_value_dev(((b < 4 ? raw.x : raw.y) >> (8 * (b % 4))) & 0xFFu) * sc;
                } else if constexpr (DPL == 4) {
                    const uint32_t raw = __ldg((const unsigned int *)vp);
#pragma unroll
                    for (int b = 0; b < 4; b++) vf[b] = e4m3_value_dev((raw >> (8 * b)) & 0xFFu) * sc;
                } else {
#pragma unroll
                    for (int b = 0; b < DPL; b++) vf[b] = e4m3_value_dev(vp[b]) * sc;
                }
#pragma unroll
                for (int g = 0; g < QA_GMAX; g++) {
                    const float p = ps[t][g];
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[g][i] += p * vf[i];
                }
            }
        }
        __syncthreads(); /* ps / slot_s are rewritten by the next tile */
    }

#pragma unroll
    for (int g = 0; g < QA_GMAX; g++) {
        float v = l_t[g];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[warp][g] = v;
#pragma unroll
        for (int i = 0; i < DPL; i++) accs[warp][g][lane * DPL + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += QA_THREADS) {
        const int g = i / D, d = i % D;
        float l = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < QA_THREADS / 32; w++) {
            l += red[w][g];
            o += accs[w][g][d];
        }
        const size_t idx = ((size_t)r * n_heads + h0 + g) * n_splits + split;
        ws_o[idx * D + d] = o / l;
        if (d == 0) ws_lse[idx] = m_run[g] + log2f(l);
    }
}

/* grid: x = query row, y = head; combines the row's effective splits */
__global__ void qmerge_kernel(bf16 *__restrict__ out, const int32_t *__restrict__ q_begin,
                              const int32_t *__restrict__ sel_begin, int n_seqs, int n_heads, int D,
                              int n_splits, const float *__restrict__ ws_o,
                              const float *__restrict__ ws_lse) {
    const int32_t r = blockIdx.x;
    const int h = blockIdx.y;
    int32_t base, n_ent;
    qa_row_range(q_begin, sel_begin, n_seqs, r, &base, &n_ent);
    const int32_t chunk = qa_chunk(n_ent, n_splits);
    const int n_eff = (n_ent + chunk - 1) / chunk;
    const size_t idx0 = ((size_t)r * n_heads + h) * n_splits;
    float mx = -INFINITY;
    for (int i = 0; i < n_eff; i++) mx = fmaxf(mx, ws_lse[idx0 + i]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int i = 0; i < n_eff; i++) {
            const float w = exp2f(ws_lse[idx0 + i] - mx);
            num += w * ws_o[(idx0 + i) * D + d];
            den += w;
        }
        out[((size_t)r * n_heads + h) * D + d] = __float2bfloat16(num / den);
    }
}

template <int DMAX>
static void launch_qsplit(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                          const int32_t *d_sb, const int32_t *d_sel) {
    const int D = a->head_dim;
    const int32_t n_rows = a->n_tokens;
    const int G = a->n_heads / a->n_kv_heads;
    const int n_chunks = (G + QA_GMAX - 1) / QA_GMAX;
    const int64_t base_blocks = (int64_t)n_rows * a->n_kv_heads * n_chunks;
    int64_t ns = ((int64_t)c->n_sms * 4 + base_blocks - 1) / base_blocks;
    const int n_splits = (int)(ns < 1 ? 1 : ns > QA_SPLIT_MAX ? QA_SPLIT_MAX : ns);
    const size_t n_part = (size_t)n_rows * a->n_heads * n_splits;
    lethe_cuda_reserve(c, (void **)&c->qattn_ws, &c->qattn_ws_cap, n_part * (D + 1) * sizeof(float));
    float *ws_o = c->qattn_ws, *ws_lse = c->qattn_ws + n_part * D;
    dim3 grid((unsigned)n_rows, (unsigned)(a->n_kv_heads * n_chunks), (unsigned)n_splits);
    qsplit_kernel<DMAX><<<grid, QA_THREADS, 0, c->stream>>>(
        D, (const bf16 *)a->q, (const uint8_t *)a->k_cache, (const uint8_t *)a->v_cache,
        (const float *)a->kvq->k_scale, (const float *)a->kvq->v_scale, d_qb, d_sb, d_sel,
        a->n_seqs, a->n_heads, a->n_kv_heads, a->scale * QA_LOG2E, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
    qmerge_kernel<<<dim3((unsigned)n_rows, (unsigned)a->n_heads), D < 256 ? D : 256, 0, c->stream>>>(
        (bf16 *)a->out, d_qb, d_sb, a->n_seqs, a->n_heads, D, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_attention_quant(lethe_backend *be, const lethe_attn_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(a->kvq && a->kvq->format == LETHE_KV_FP8_E4M3);
    LETHE_ASSERT(a->n_heads > 0 && a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0);
    LETHE_ASSERT(a->n_seqs > 0 && a->q_begin[0] == 0 && a->q_begin[a->n_seqs] == a->n_tokens);
    const int D = a->head_dim;
    LETHE_ASSERT(D % 8 == 0 && D >= 8 && D <= 256);
    for (int s = 0; s < a->n_seqs; s++)
        LETHE_ASSERT(a->q_begin[s + 1] - a->q_begin[s] >= 0 &&
                     a->sel_begin[s + 1] - a->sel_begin[s] >= a->q_begin[s + 1] - a->q_begin[s]);
    if (a->n_tokens == 0) return;
    const int32_t *d_qb = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sb = lethe_cuda_stage_idx(c, a->sel_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)a->sel_begin[a->n_seqs]);
    if (D <= 64) launch_qsplit<64>(c, a, d_qb, d_sb, d_sel);
    else if (D <= 128) launch_qsplit<128>(c, a, d_qb, d_sb, d_sel);
    else launch_qsplit<256>(c, a, d_qb, d_sb, d_sel);
}

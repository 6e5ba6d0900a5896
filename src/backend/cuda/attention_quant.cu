/* attention_quant.cu - KV store and attention over QUANTIZED KV (CUDA backend).
 *
 * The twin of backend/cpu/attention_quant.c; formats are backend.h's
 * lethe_kv_format:
 *   FP8_E4M3  K/V caches: uint8 E4M3 codes [n_slots, n_kv_heads, D];
 *             kvq->k_scale / v_scale: f32 [n_slots, n_kv_heads];
 *             x^ = e4m3(code) * scale (src/backend/kv_codec.h).
 *   KIVI      packed b-bit codes per slot [n_slots][C b / 8], V group params
 *             per slot, K group table, bf16 residual (backend.h); slots are
 *             addressed through the HOST slot index kvq->kivi->slot_aux,
 *             gathered per call (new tokens for the store, selection entries
 *             for attention) into the pinned ring and copied like any index
 *             array. kivi is not a uniform method, so these steps are never
 *             graph-captured.
 *
 * KIVI store: kivi_kpack_kernel (one thread per (group, code byte column):
 * per-channel min / max over the group's G tokens, from this store's rows or
 * the residual as the method's plan says), kivi_vpack_kernel (one thread per
 * (token, V group of G channels)), then kivi_res_kernel writes the new tokens
 * that stay full precision (after the packs: a completed group may free
 * residual entries the same step reuses). Min / max scans, IEEE subtraction
 * and division (__fsub_rn / __fdiv_rn) and rintf repeat lethe_quant_asym, so
 * for the same bf16 inputs codes and params are bit-identical to the CPU
 * (tests/gpu/test_cuda_kvquant.c). KIVI attention is qsplit_kernel<.., true>:
 * a key row is either its residual entry (bf16) or codes * K group scale +
 * zero, V likewise with the slot's per-token params.
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
 * so the decode step stays capturable in a CUDA graph. FP8 decode batches at
 * head_dim 64 / 128 go to the tensor-core kernel of attention_fp8.cu instead;
 * this kernel keeps FP8 prefill / extend / mixed rows, other head dims and
 * KIVI. Prefill reads each key
 * tile once per query row (no tensor cores): correct but slower than the
 * dense WMMA prefill; see docs/sparse-methods.md. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/args.h"

#include <math.h>

#define QA_THREADS 128
#define QA_TILE 128
#define QA_GMAX 8
#define QA_SPLIT_MAX 64
#define QA_LOG2E 1.4426950408889634f

/* ---- E4M3 conversions (same steps as src/backend/kv_codec.c) ---------------- */

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

/* ---- KIVI store ------------------------------------------------------------ */

/* Asymmetric b-bit code of x in a group with min mn and scale s, the steps of
 * lethe_quant_asym (IEEE subtraction and division, rintf = round half to even)
 * so codes are bit-identical to the CPU reference. */
__device__ __forceinline__ uint32_t kivi_code_dev(float x, float mn, float s, uint32_t qmax) {
    if (!(s > 0.0f)) return 0u;
    const float f = rintf(__fdiv_rn(__fsub_rn(x, mn), s));
    return f <= 0.0f ? 0u : f >= (float)qmax ? qmax : (uint32_t)f;
}

/* member j of packed group p: row of this store's k (src >= 0) or residual entry -(1 + src) */
__device__ __forceinline__ const bf16 *kivi_src_row(const bf16 *x, const bf16 *res, int32_t src, int C) {
    return src >= 0 ? x + (size_t)src * C : res + (size_t)(-1 - src) * C;
}

/* K groups, per CHANNEL over the group's G tokens. One thread per (group p,
 * byte column j of a token row): channels j * 8 / b .. + 8 / b, so each
 * thread writes whole code bytes. The min / max scan mirrors lethe_quant_asym
 * (first value, then strict < / >), which keeps -0 / +0 zeros bit-equal. */
__global__ void kivi_kpack_kernel(uint8_t *__restrict__ kc, float *__restrict__ kgrp,
                                  const bf16 *__restrict__ k, const bf16 *__restrict__ kres,
                                  const int32_t *__restrict__ src, const int32_t *__restrict__ dst,
                                  const int32_t *__restrict__ entry, int n_pack, int C, int b, int G) {
    const int cb = C * b / 8, per = 8 / b; /* code bytes per row, channels per byte */
    const uint32_t qmax = (1u << b) - 1u;
    const int64_t n_items = (int64_t)n_pack * cb;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < n_items;
         it += (int64_t)gridDim.x * blockDim.x) {
        const int p = (int)(it / cb), j = (int)(it % cb);
        const int32_t *ps = src + (size_t)p * G, *pd = dst + (size_t)p * G;
        float *ks = kgrp + (size_t)entry[p] * 2 * C, *kz = ks + C;
        float mn[4], sc[4];
        for (int u = 0; u < per; u++) {
            const int c = j * per + u;
            float lo = __bfloat162float(kivi_src_row(k, kres, ps[0], C)[c]), hi = lo;
            for (int t = 1; t < G; t++) {
                const float x = __bfloat162float(kivi_src_row(k, kres, ps[t], C)[c]);
                if (x < lo) lo = x;
                if (x > hi) hi = x;
            }
            mn[u] = lo;
            sc[u] = __fdiv_rn(__fsub_rn(hi, lo), (float)qmax);
            ks[c] = sc[u];
            kz[c] = lo;
        }
        for (int t = 0; t < G; t++) {
            const bf16 *row = kivi_src_row(k, kres, ps[t], C);
            uint32_t byte = 0;
            for (int u = 0; u < per; u++)
                byte |= kivi_code_dev(__bfloat162float(row[j * per + u]), mn[u], sc[u], qmax) << (u * b);
            kc[(size_t)pd[t] * cb + j] = (uint8_t)byte;
        }
    }
}

/* V params, per TOKEN in groups of G channels. One thread per (packed token,
 * V group): G channels -> G b / 8 whole bytes (G >= 16). */
__global__ void kivi_vpack_kernel(uint8_t *__restrict__ vc, float *__restrict__ vpar,
                                  const bf16 *__restrict__ v, const bf16 *__restrict__ vres,
                                  const int32_t *__restrict__ src, const int32_t *__restrict__ dst,
                                  int n_tok, int C, int b, int G) {
    const int cb = C * b / 8, np = C / G, per = 8 / b;
    const uint32_t qmax = (1u << b) - 1u;
    const int64_t n_items = (int64_t)n_tok * np;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < n_items;
         it += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(it / np), g = (int)(it % np);
        const bf16 *x = kivi_src_row(v, vres, src[i], C) + (size_t)g * G;
        float lo = __bfloat162float(x[0]), hi = lo;
        for (int c = 1; c < G; c++) {
            const float f = __bfloat162float(x[c]);
            if (f < lo) lo = f;
            if (f > hi) hi = f;
        }
        const float s = __fdiv_rn(__fsub_rn(hi, lo), (float)qmax);
        const int32_t slot = dst[i];
        vpar[(size_t)slot * 2 * np + g] = s;
        vpar[(size_t)slot * 2 * np + np + g] = lo;
        uint8_t *out = vc + (size_t)slot * cb + (size_t)g * G * b / 8;
        for (int byte_i = 0; byte_i < G * b / 8; byte_i++) {
            uint32_t byte = 0;
            for (int u = 0; u < per; u++)
                byte |= kivi_code_dev(__bfloat162float(x[byte_i * per + u]), lo, s, qmax) << (u * b);
            out[byte_i] = (uint8_t)byte;
        }
    }
}

/* new tokens that stay full precision: aux[i] < 0 -> residual entry -(1 + aux[i]) */
__global__ void kivi_res_kernel(bf16 *__restrict__ kres, bf16 *__restrict__ vres,
                                const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                const int32_t *__restrict__ aux, int32_t n, int C) {
    const int64_t n_items = (int64_t)n * C;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < n_items;
         it += (int64_t)gridDim.x * blockDim.x) {
        const int32_t i = (int32_t)(it / C);
        const int c = (int)(it % C);
        const int32_t a = aux[i];
        if (a >= 0) continue;
        const size_t r = (size_t)(-1 - a);
        kres[r * C + c] = k[(size_t)i * C + c];
        vres[r * C + c] = v[(size_t)i * C + c];
    }
}

static unsigned grid_for(const cuda_ctx *c, int64_t n_items) {
    unsigned blocks = lethe_cuda_blocks((size_t)n_items, 256);
    const unsigned cap = (unsigned)c->n_sms * 16;
    return blocks < 1 ? 1 : blocks > cap ? cap : blocks;
}

/* slot_aux[idx[i]] for i < n, gathered on the host (the plan is host memory
 * and changes every step) straight into the pinned ring, then copied to the
 * device like any staged index array (eager steps only: kivi is never a
 * uniform, graph-captured method). */
static const int32_t *kivi_gather_aux(cuda_ctx *c, const lethe_kv_quant *kvq, const int32_t *idx, size_t n) {
    const int32_t *aux = kvq->kivi->slot_aux;
    void *h;
    void *d = lethe_cuda_ring_alloc(c, n * sizeof(int32_t), &h);
    int32_t *hv = (int32_t *)h;
    for (size_t i = 0; i < n; i++) {
        hv[i] = aux[idx[i]];
        LETHE_ASSERT(hv[i] != INT32_MIN && (hv[i] >= 0 ? hv[i] < kvq->n_groups : -1 - hv[i] < kvq->n_res));
    }
    if (n) CU_CHECK(cudaMemcpyAsync(d, h, n * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream));
    return (const int32_t *)d;
}

/* The plan's completed groups are packed first (they may read residual
 * entries), then the residual writes (which may reuse entries those groups
 * freed): stream order keeps the CPU's sequence. */
static void kivi_store(cuda_ctx *c, const lethe_kv_quant *kvq, uint8_t *kc, uint8_t *vc, const bf16 *k,
                       const bf16 *v, const int32_t *slots, int32_t n, int C) {
    lethe_check_kv_store_kivi(kvq, n, C);
    const lethe_kivi_plan *pl = kvq->kivi;
    const int b = lethe_kv_kivi_bits(kvq->format), G = lethe_kv_kivi_group(kvq->format);
    LETHE_ASSERT(G >= 16); /* the pack kernels read 8 codes per load */
    if (pl->n_pack > 0) {
        const size_t nm = (size_t)pl->n_pack * G;
        const int32_t *d_src = lethe_cuda_stage_idx(c, pl->pack_src, nm);
        const int32_t *d_dst = lethe_cuda_stage_idx(c, pl->pack_slot, nm);
        const int32_t *d_ent = lethe_cuda_stage_idx(c, pl->pack_entry, (size_t)pl->n_pack);
        const int cb = C * b / 8;
        kivi_kpack_kernel<<<grid_for(c, (int64_t)pl->n_pack * cb), 256, 0, c->stream>>>(
            kc, (float *)kvq->k_group, k, (const bf16 *)kvq->k_res, d_src, d_dst, d_ent, pl->n_pack, C, b, G);
        CU_LAUNCH_CHECK();
        kivi_vpack_kernel<<<grid_for(c, (int64_t)nm * (C / G)), 256, 0, c->stream>>>(
            vc, (float *)kvq->v_param, v, (const bf16 *)kvq->v_res, d_src, d_dst, (int)nm, C, b, G);
        CU_LAUNCH_CHECK();
    }
    if (n <= 0) return;
    const int32_t *d_aux = kivi_gather_aux(c, kvq, slots, (size_t)n);
    kivi_res_kernel<<<grid_for(c, (int64_t)n * C), 256, 0, c->stream>>>(
        (bf16 *)kvq->k_res, (bf16 *)kvq->v_res, k, v, d_aux, n, C);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_kv_store_quant(lethe_backend *be, const lethe_kv_quant *kvq,
                                          void *k_cache, void *v_cache, const void *k,
                                          const void *v, const int32_t *slots, int32_t n,
                                          int32_t n_kv_heads, int32_t head_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (kvq && lethe_kv_format_kind(kvq->format) == LETHE_KV_TURBOQUANT) {
        lethe_cuda_kv_store_tq(be, kvq, k_cache, v_cache, k, v, slots, n, n_kv_heads, head_dim);
        return;
    }
    if (kvq && lethe_kv_format_kind(kvq->format) == LETHE_KV_KIVI) {
        kivi_store(c, kvq, (uint8_t *)k_cache, (uint8_t *)v_cache, (const bf16 *)k, (const bf16 *)v, slots, n,
                   n_kv_heads * head_dim);
        return;
    }
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

/* KIVI side arrays for the attention kernel (unused by FP8). aux[e] is
 * slot_aux[sel[e]] for every selection entry (gathered on the host). */
struct qa_kivi {
    const float *kgrp, *vpar;   /* K group table [n_groups][2][C], V params [n_slots][2][C / G] */
    const bf16 *kres, *vres;    /* residual [n_res][C] */
    const int32_t *aux;         /* [n_sel] */
    int b, G, C, cb, np;        /* bits, group, channels, code bytes per slot, V groups per slot */
};

/* the 8 codes of channels c .. c + 7 (c % 8 == 0) of a packed row: b bytes,
 * aligned to b (rows are C b / 8 bytes with C % 8 == 0) */
__device__ __forceinline__ unsigned long long kivi_load8(const uint8_t *row, int c, int b) {
    const uint8_t *p = row + (size_t)c * b / 8;
    if (b == 2) return __ldg((const unsigned short *)p);
    if (b == 4) return __ldg((const unsigned int *)p);
    const uint2 r = __ldg((const uint2 *)p);
    return (unsigned long long)r.x | ((unsigned long long)r.y << 32);
}

__device__ __forceinline__ uint32_t kivi_code_at(const uint8_t *row, int c, int b) {
    const int bit = c * b;
    return ((uint32_t)__ldg(row + (bit >> 3)) >> (bit & 7)) & ((1u << b) - 1u);
}

/* grid: x = query row, y = KV head * head chunks, z = split.
 * ws_o [rows, n_heads, n_splits, D], ws_lse [rows, n_heads, n_splits] (log2 domain).
 * D % 8 == 0, D <= DMAX. */
template <int DMAX, bool KIVI>
__global__ void __launch_bounds__(QA_THREADS)
qsplit_kernel(int D, qa_kivi kv, const bf16 *__restrict__ q, const uint8_t *__restrict__ kc,
              const uint8_t *__restrict__ vc, const float *__restrict__ ks,
              const float *__restrict__ vs, const int32_t *__restrict__ q_begin,
              const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel, int n_seqs,
              int n_heads, int n_kv, float scale_log2, int n_splits, float *__restrict__ ws_o,
              float *__restrict__ ws_lse) {
    constexpr int DPL = DMAX / 32; /* dims per lane in P V: 2, 4 or 8 */
    __shared__ float qs[QA_GMAX][DMAX];
    __shared__ float ps[QA_TILE][QA_GMAX];
    __shared__ int32_t slot_s[QA_TILE];
    __shared__ int32_t aux_s[KIVI ? QA_TILE : 1];
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
        if constexpr (KIVI) {
            const int32_t ax = valid ? kv.aux[base + e] : 0;
            aux_s[tid] = ax;
            const int c0 = kvh * D;
            if (valid && ax < 0) { /* residual entry: full precision */
                const bf16 *kr = kv.kres + (size_t)(-1 - ax) * kv.C + c0;
                for (int d = 0; d < D; d++) {
                    const float kf = __bfloat162float(kr[d]);
#pragma unroll
                    for (int g = 0; g < QA_GMAX; g++)
                        if (g < G) s[g] += qs[g][d] * kf;
                }
            } else if (valid) { /* codes of the slot, K params of its group entry */
                const uint8_t *cr = kc + (size_t)slot * kv.cb;
                const float *ksc = kv.kgrp + (size_t)ax * 2 * kv.C + c0, *kz = ksc + kv.C;
                const uint32_t mask = (1u << kv.b) - 1u;
                for (int d0 = 0; d0 < D; d0 += 8) {
                    const unsigned long long raw = kivi_load8(cr, c0 + d0, kv.b);
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        const int d = d0 + u;
                        const float kf = (float)((uint32_t)(raw >> (u * kv.b)) & mask) * __ldg(ksc + d) + __ldg(kz + d);
#pragma unroll
                        for (int g = 0; g < QA_GMAX; g++)
                            if (g < G) s[g] += qs[g][d] * kf;
                    }
                }
            }
        } else if (valid) {
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
                float vf[DPL];
                if constexpr (KIVI) {
                    const int32_t ax = aux_s[t];
                    const int c = kvh * D + lane * DPL;
                    if (ax < 0) {
                        const bf16 *vr = kv.vres + (size_t)(-1 - ax) * kv.C + c;
#pragma unroll
                        for (int i = 0; i < DPL; i++) vf[i] = __bfloat162float(vr[i]);
                    } else {
                        /* a lane's DPL <= 8 channels lie in one V group (G >= 16, both powers of two) */
                        const float *vp = kv.vpar + (size_t)slot_s[t] * 2 * kv.np;
                        const float sc = __ldg(vp + c / kv.G), z = __ldg(vp + kv.np + c / kv.G);
                        const uint8_t *cr = vc + (size_t)slot_s[t] * kv.cb;
#pragma unroll
                        for (int i = 0; i < DPL; i++) vf[i] = (float)kivi_code_at(cr, c + i, kv.b) * sc + z;
                    }
                } else if constexpr (DPL == 8) {
                    const size_t row = (size_t)slot_s[t] * n_kv + kvh;
                    const float sc = vs[row];
                    const uint8_t *vp = vc + row * D + lane * DPL;
                    const uint2 raw = __ldg((const uint2 *)vp);
#pragma unroll
                    for (int b = 0; b < 8; b++)
                        vf[b] = e4m3_value_dev(((b < 4 ? raw.x : raw.y) >> (8 * (b % 4))) & 0xFFu) * sc;
                } else if constexpr (DPL == 4) {
                    const size_t row = (size_t)slot_s[t] * n_kv + kvh;
                    const float sc = vs[row];
                    const uint8_t *vp = vc + row * D + lane * DPL;
                    const uint32_t raw = __ldg((const unsigned int *)vp);
#pragma unroll
                    for (int b = 0; b < 4; b++) vf[b] = e4m3_value_dev((raw >> (8 * b)) & 0xFFu) * sc;
                } else {
                    const size_t row = (size_t)slot_s[t] * n_kv + kvh;
                    const float sc = vs[row];
                    const uint8_t *vp = vc + row * D + lane * DPL;
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

template <int DMAX, bool KIVI>
static void launch_qsplit(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                          const int32_t *d_sb, const int32_t *d_sel, const qa_kivi &kv) {
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
    qsplit_kernel<DMAX, KIVI><<<grid, QA_THREADS, 0, c->stream>>>(
        D, kv, (const bf16 *)a->q, (const uint8_t *)a->k_cache, (const uint8_t *)a->v_cache,
        (const float *)a->kvq->k_scale, (const float *)a->kvq->v_scale, d_qb, d_sb, d_sel,
        a->n_seqs, a->n_heads, a->n_kv_heads, a->scale * QA_LOG2E, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
    qmerge_kernel<<<dim3((unsigned)n_rows, (unsigned)a->n_heads), D < 256 ? D : 256, 0, c->stream>>>(
        (bf16 *)a->out, d_qb, d_sb, a->n_seqs, a->n_heads, D, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_attention_quant(lethe_backend *be, const lethe_attn_args *a) {
    if (a->kvq && lethe_kv_format_kind(a->kvq->format) == LETHE_KV_TURBOQUANT) {
        lethe_cuda_attention_tq(be, a);
        return;
    }
    cuda_ctx *c = cuda_ctx_of(be);
    const bool kivi = a->kvq && lethe_kv_format_kind(a->kvq->format) == LETHE_KV_KIVI;
    lethe_check_attention_quant(a);
    const int D = a->head_dim;
    LETHE_ASSERT(D % 8 == 0 && D >= 8 && D <= 256);
    if (a->n_tokens == 0) return;
    const int32_t *d_qb = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sb = lethe_cuda_stage_idx(c, a->sel_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)a->sel_begin[a->n_seqs]);
    qa_kivi kv = {};
    if (kivi) {
        const lethe_kv_quant *q = a->kvq;
        kv.b = lethe_kv_kivi_bits(q->format), kv.G = lethe_kv_kivi_group(q->format);
        kv.C = a->n_kv_heads * D;
        LETHE_ASSERT((kv.b == 2 || kv.b == 4 || kv.b == 8) && kv.G >= 16 && D % kv.G == 0 && q->kivi);
        kv.cb = kv.C * kv.b / 8, kv.np = kv.C / kv.G;
        kv.kgrp = (const float *)q->k_group, kv.vpar = (const float *)q->v_param;
        kv.kres = (const bf16 *)q->k_res, kv.vres = (const bf16 *)q->v_res;
        kv.aux = kivi_gather_aux(c, q, a->sel_slots, (size_t)a->sel_begin[a->n_seqs]);
        if (D <= 64) launch_qsplit<64, true>(c, a, d_qb, d_sb, d_sel, kv);
        else if (D <= 128) launch_qsplit<128, true>(c, a, d_qb, d_sb, d_sel, kv);
        else launch_qsplit<256, true>(c, a, d_qb, d_sb, d_sel, kv);
        return;
    }
    bool decode = a->n_tokens == a->n_seqs; /* every sequence one query */
    for (int s = 0; decode && s < a->n_seqs; s++) decode = a->q_begin[s + 1] - a->q_begin[s] == 1;
    if (decode && lethe_cuda_attn_fp8_fits(c, D)) { /* tensor cores: attention_fp8.cu */
        lethe_cuda_attn_decode_fp8(c, a, d_qb, d_sb, d_sel);
        return;
    }
    if (D <= 64) launch_qsplit<64, false>(c, a, d_qb, d_sb, d_sel, kv);
    else if (D <= 128) launch_qsplit<128, false>(c, a, d_qb, d_sb, d_sel, kv);
    else launch_qsplit<256, false>(c, a, d_qb, d_sb, d_sel, kv);
}

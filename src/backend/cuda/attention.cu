/* attention.cu - attention over a slot selection on the CUDA backend: the
 * dispatcher, the generic split-K kernel and the LSE merge.
 *
 * Semantics are backend.h's lethe_attn_args (same as backend/cpu/attention.c):
 * query j of sequence s, head h, attends to selection entries
 * [0, n_sel - n_q + j] of its sequence, keys/values K/V[sel[e], h / G, :]
 * with G = n_heads / n_kv_heads; q, out [n_tokens, n_heads, D], caches
 * [n_slots, n_kv_heads, D], all bf16; softmax and accumulation in fp32.
 *
 * Dispatch (lethe_cuda_attention): latent KV to mla.cu; quantized KV to
 * attention_quant.cu; per-KV-head selections (head_sel_begin) to
 * attention_varlen.cu; head_dim 64 / 128 where the v2 kernels' shared memory
 * fits the device to attention_v2.cu (tensor-core decode and prefill;
 * block-sparse prefill, a->bsp, through attention_bsp.cu's plan into the same
 * kernel). Every other head_dim (8..256 in steps of 8):
 *  - prefill / extend outside graph capture: attention_gemm.cu (cuBLAS
 *    S = QK^T, fp32 causal softmax to bf16 P, PV, over the selection read in
 *    place or gathered; any GQA group). It hands sequences with few queries
 *    (the decode rows of a mixed call) back to split_kernel by item list. A
 *    block-sparse plan is ignored at these head_dims (dense, backend.h).
 *  - decode at head_dim 256: decode_v2_kernel (attention_v2.cu) where its
 *    shared memory fits; other decode, and prefill inside capture: the
 *    generic kernel here.
 * The kernels of this file:
 *  - split_kernel: flash-decoding over query rows. A block = (query row, KV
 *    head, split); its G query heads share every K/V row it reads. The
 *    selection is cut into n_splits chunks of whole 128-key tiles; each block
 *    writes a partial output and its log-sum-exp, merge_kernel combines them.
 *    The grid (n_splits) is fixed from the batch size and the device, so a
 *    decode step can live in a CUDA graph; the effective split count of a
 *    row comes from its length, read on the device (blocks past it exit).
 *    Prefill/extend rows are items like decode rows (the "row path"); an
 *    item list (lethe_cuda_attn_split_items) runs a subset of the rows.
 *  - merge_kernel: the split-K LSE merge, also used by attention_v2.cu.
 *
 * split_kernel is the first generation's decode kernel; that generation's
 * WMMA prefill kernel and the v1-vs-v2 comparison against the CPU twin live
 * in dev/cuda/ (not built into lethe).
 *
 * Index arrays are staged once per call (or pre-staged per step). */
#include "backend/cuda/attention_common.cuh"
#include "backend/args.h"

#include <math.h>

#define SPLIT_THREADS 128
#define SPLIT_TILE 128      /* keys per tile = threads */
#define SPLIT_GMAX 8        /* query heads per block (larger groups use several blocks) */

__device__ __forceinline__ int32_t split_chunk(int32_t n_ent, int n_splits) {
    return split_chunk(n_ent, n_splits, SPLIT_TILE);
}

/* grid: x = item, y = KV head * head chunks, z = split. Item i is query row
 * items[i] (items NULL: row i). ws_o [items, n_heads, n_splits, D], ws_lse
 * [items, n_heads, n_splits] (log2 domain) */
template <int DMAX, bool EXACT>
__global__ void __launch_bounds__(SPLIT_THREADS, DMAX <= 128 ? 4 : 2)
split_kernel(int d_rt, const bf16 *__restrict__ q, const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,
             const int32_t *__restrict__ q_begin, const int32_t *__restrict__ sel_begin,
             const int32_t *__restrict__ sel, const int32_t *__restrict__ items, int n_seqs,
             int decode, int n_heads, int n_kv,
             float scale_log2, int n_splits, float *__restrict__ ws_o, float *__restrict__ ws_lse) {
    /* D == DMAX when EXACT (the fast instantiations), else any D <= DMAX, D % 8 == 0 */
    const int D = EXACT ? DMAX : d_rt;
    constexpr int NVMAX = DMAX / 8; /* 16-byte vectors per K row */
    constexpr int DPL = DMAX / 32;  /* dims per lane in the PV phase */
    const int NV = D / 8;
    __shared__ float qs[SPLIT_GMAX][DMAX];
    __shared__ __align__(16) float ps[SPLIT_TILE][SPLIT_GMAX]; /* p of key t, all heads */
    __shared__ int32_t slot_s[SPLIT_TILE];
    __shared__ float red[SPLIT_THREADS / 32][SPLIT_GMAX];
    __shared__ float accs[SPLIT_THREADS / 32][SPLIT_GMAX][DMAX];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int32_t it = blockIdx.x, r = items ? items[it] : it;
    const int G_all = n_heads / n_kv, n_chunks = (G_all + SPLIT_GMAX - 1) / SPLIT_GMAX;
    const int kvh = blockIdx.y / n_chunks, h0 = kvh * G_all + (blockIdx.y % n_chunks) * SPLIT_GMAX;
    const int G = min(SPLIT_GMAX, kvh * G_all + G_all - h0);
    const int split = blockIdx.z;

    int32_t base, n_ent;
    item_range(q_begin, sel_begin, n_seqs, decode != 0, r, &base, &n_ent);
    const int32_t chunk = split_chunk(n_ent, n_splits);
    const int32_t k_begin = split * chunk;
    if (k_begin >= n_ent) return; /* past this row's effective split count */
    const int32_t k_end = min(n_ent, k_begin + chunk);

    for (int i = tid; i < SPLIT_GMAX * D; i += SPLIT_THREADS) {
        int g = i / D, d = i % D;
        qs[g][d] = g < G ? __bfloat162float(q[((size_t)r * n_heads + h0 + g) * D + d]) * scale_log2
                         : 0.0f;
    }
    __syncthreads();

    float m_run[SPLIT_GMAX], l_t[SPLIT_GMAX], acc[SPLIT_GMAX][DPL];
#pragma unroll
    for (int g = 0; g < SPLIT_GMAX; g++) {
        m_run[g] = -INFINITY;
        l_t[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.0f;
    }
    const size_t row_stride = (size_t)n_kv * D;

    for (int32_t k0 = k_begin; k0 < k_end; k0 += SPLIT_TILE) {
        const int32_t e = k0 + tid;
        const bool valid = e < k_end;
        const int32_t slot = valid ? sel[base + e] : 0;
        slot_s[tid] = slot;
        /* QK: this thread's key against the G query heads */
        float s[SPLIT_GMAX];
#pragma unroll
        for (int g = 0; g < SPLIT_GMAX; g++) s[g] = 0.0f;
        if (valid) {
            const uint4 *kp = (const uint4 *)(kc + (size_t)slot * row_stride + (size_t)kvh * D);
            constexpr int CH = NVMAX < 16 ? NVMAX : 16;
#pragma unroll
            for (int c0 = 0; c0 < NVMAX; c0 += CH) {
                uint4 kv[CH];
#pragma unroll
                for (int i = 0; i < CH; i++)
                    kv[i] = (EXACT || c0 + i < NV) ? __ldg(kp + c0 + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int i = 0; i < CH; i++) {
                    if (!EXACT && c0 + i >= NV) break;
                    const __nv_bfloat162 *p2 = (const __nv_bfloat162 *)&kv[i];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        float2 f = __bfloat1622float2(p2[k]);
                        const int d = (c0 + i) * 8 + 2 * k;
#pragma unroll
                        for (int g = 0; g < SPLIT_GMAX; g++)
                            if (g < G) s[g] += qs[g][d] * f.x + qs[g][d + 1] * f.y;
                    }
                }
            }
        }
        /* tile max per head */
#pragma unroll
        for (int g = 0; g < SPLIT_GMAX; g++) {
            float v = valid ? s[g] : -INFINITY;
            for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
            if (lane == 0) red[warp][g] = v;
        }
        __syncthreads();
        float alpha[SPLIT_GMAX];
#pragma unroll
        for (int g = 0; g < SPLIT_GMAX; g++) {
            float mt = red[0][g];
#pragma unroll
            for (int w = 1; w < SPLIT_THREADS / 32; w++) mt = fmaxf(mt, red[w][g]);
            const float m_new = fmaxf(m_run[g], mt); /* finite: the tile has a valid key */
            alpha[g] = exp2f(m_run[g] - m_new);      /* 0 on the first tile */
            const float p = valid && g < G ? exp2f(s[g] - m_new) : 0.0f;
            ps[tid][g] = p;
            l_t[g] = l_t[g] * alpha[g] + p;
            m_run[g] = m_new;
        }
        __syncthreads();
        /* PV: warp w takes keys [32w, 32w+32) of the tile, lane owns DPL dims */
#pragma unroll
        for (int g = 0; g < SPLIT_GMAX; g++)
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= alpha[g];
        const int32_t n_here = min(32, k_end - (k0 + warp * 32));
        const bf16 *vbase = vc + (size_t)kvh * D + lane * DPL;
        const bool lane_ok = EXACT || lane * DPL < D; /* D % 8 == 0: a lane's dims are all in or out */
        /* batches of PV_BATCH keys: every V load of the batch is issued
         * (predicated) before the first use, so many rows are in flight */
        constexpr int PV_BATCH = DPL <= 4 ? 16 : 8;
#pragma unroll
        for (int kb = 0; kb < 32; kb += PV_BATCH) {
            bf16 vraw[PV_BATCH][DPL];
#pragma unroll
            for (int u = 0; u < PV_BATCH; u++) {
                const bool ok = lane_ok && kb + u < n_here;
                const bf16 *vp = vbase + (size_t)slot_s[warp * 32 + kb + u] * row_stride;
                if constexpr (DPL % 4 == 0) {
#pragma unroll
                    for (int i = 0; i < DPL; i += 4) {
                        uint2 raw = ok ? __ldg((const uint2 *)(vp + i)) : make_uint2(0, 0);
                        memcpy(&vraw[u][i], &raw, 8);
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < DPL; i++) vraw[u][i] = ok ? vp[i] : __float2bfloat16(0.0f);
                }
            }
#pragma unroll
            for (int u = 0; u < PV_BATCH; u++) {
                const int t = warp * 32 + kb + u;
                float p[SPLIT_GMAX];
                const float4 *p4 = (const float4 *)&ps[t][0];
#pragma unroll
                for (int g4 = 0; g4 < SPLIT_GMAX / 4; g4++) {
                    float4 v4 = p4[g4];
                    p[4 * g4] = v4.x, p[4 * g4 + 1] = v4.y, p[4 * g4 + 2] = v4.z, p[4 * g4 + 3] = v4.w;
                }
#pragma unroll
                for (int i = 0; i < DPL; i++) {
                    const float vf = __bfloat162float(vraw[u][i]);
#pragma unroll
                    for (int g = 0; g < SPLIT_GMAX; g++) acc[g][i] += p[g] * vf;
                }
            }
        }
        __syncthreads(); /* ps / slot_s are rewritten by the next tile */
    }

    /* reduce l over threads and acc over warps */
#pragma unroll
    for (int g = 0; g < SPLIT_GMAX; g++) {
        float v = l_t[g];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[warp][g] = v;
#pragma unroll
        for (int i = 0; i < DPL; i++) accs[warp][g][lane * DPL + i] = acc[g][i]; /* < DMAX */
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += SPLIT_THREADS) {
        const int g = i / D, d = i % D;
        float l = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < SPLIT_THREADS / 32; w++) {
            l += red[w][g];
            o += accs[w][g][d];
        }
        const size_t idx = ((size_t)it * n_heads + h0 + g) * n_splits + split;
        ws_o[idx * D + d] = o / l;
        if (d == 0) ws_lse[idx] = m_run[g] + log2f(l);
    }
}

/* grid: x = item, y = head; block D threads (<= 256) */
__global__ void merge_kernel(bf16 *__restrict__ out, const int32_t *__restrict__ q_begin,
                             const int32_t *__restrict__ sel_begin, int n_seqs, int decode,
                             int n_heads, int D, int n_splits, int gran, int skip_single,
                             const int32_t *__restrict__ items, const float *__restrict__ ws_o,
                             const float *__restrict__ ws_lse) {
    const int32_t it = blockIdx.x, r = items ? items[it] : it; /* partial index, query row */
    const int h = blockIdx.y;
    int32_t base, n_ent;
    item_range(q_begin, sel_begin, n_seqs, decode != 0, r, &base, &n_ent);
    const int32_t chunk = split_chunk(n_ent, n_splits, gran);
    const int n_eff = (n_ent + chunk - 1) / chunk;
    if (skip_single && n_eff == 1) return; /* the split kernel wrote this row */
    const size_t idx0 = ((size_t)it * n_heads + h) * n_splits;
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

/* ---- launcher ------------------------------------------------------------ */

static int pick_splits(const cuda_ctx *c, int64_t base_blocks) {
    int64_t target = (int64_t)c->n_sms * 4;
    int64_t n = (target + base_blocks - 1) / base_blocks;
    return (int)(n < 1 ? 1 : n > SPLIT_MAX ? SPLIT_MAX : n);
}

template <int DMAX, bool EXACT>
static void launch_split(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                         const int32_t *d_sb, const int32_t *d_sel, bool decode,
                         int32_t n_items, const int32_t *d_items) {
    const int D = a->head_dim;
    const int G = a->n_heads / a->n_kv_heads;
    const int n_chunks = (G + SPLIT_GMAX - 1) / SPLIT_GMAX;
    const int n_splits = pick_splits(c, (int64_t)n_items * a->n_kv_heads * n_chunks);
    const size_t n_part = (size_t)n_items * a->n_heads * n_splits;
    size_t cap = c->attn_ws_cap * sizeof(float);
    lethe_cuda_reserve(c, (void **)&c->attn_ws, &cap, n_part * (D + 1) * sizeof(float));
    c->attn_ws_cap = cap / sizeof(float);
    float *ws_o = c->attn_ws, *ws_lse = c->attn_ws + n_part * D;
    dim3 grid((unsigned)n_items, (unsigned)(a->n_kv_heads * n_chunks), (unsigned)n_splits);
    split_kernel<DMAX, EXACT><<<grid, SPLIT_THREADS, 0, c->stream>>>(
        D, (const bf16 *)a->q, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache, d_qb, d_sb, d_sel,
        d_items, a->n_seqs, decode ? 1 : 0, a->n_heads, a->n_kv_heads, a->scale * LOG2E, n_splits, ws_o,
        ws_lse);
    CU_LAUNCH_CHECK();
    lethe_cuda_attn_merge(c, a->out, d_qb, d_sb, a->n_seqs, decode, n_items, a->n_heads, D,
                          n_splits, SPLIT_TILE, false, d_items, ws_o, ws_lse);
}

void lethe_cuda_attn_split_items(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                 const int32_t *d_sb, const int32_t *d_sel, bool decode,
                                 int32_t n_items, const int32_t *d_items) {
    const int D = a->head_dim;
    LETHE_ASSERT(n_items > 0 && (d_items || n_items == a->n_tokens));
    if (D == 64) launch_split<64, true>(c, a, d_qb, d_sb, d_sel, decode, n_items, d_items);
    else if (D == 128) launch_split<128, true>(c, a, d_qb, d_sb, d_sel, decode, n_items, d_items);
    else if (D == 256) launch_split<256, true>(c, a, d_qb, d_sb, d_sel, decode, n_items, d_items);
    else if (D < 64) launch_split<64, false>(c, a, d_qb, d_sb, d_sel, decode, n_items, d_items);
    else if (D < 128) launch_split<128, false>(c, a, d_qb, d_sb, d_sel, decode, n_items, d_items);
    else launch_split<256, false>(c, a, d_qb, d_sb, d_sel, decode, n_items, d_items);
}

void lethe_cuda_attn_split(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                           const int32_t *d_sb, const int32_t *d_sel, bool decode) {
    lethe_cuda_attn_split_items(c, a, d_qb, d_sb, d_sel, decode, a->n_tokens, NULL);
}

void lethe_cuda_attn_merge(cuda_ctx *c, void *out, const int32_t *d_qb, const int32_t *d_sb,
                           int n_seqs, bool decode, int32_t n_items, int n_heads, int D,
                           int n_splits, int gran, bool skip_single, const int32_t *d_items,
                           const float *ws_o, const float *ws_lse) {
    merge_kernel<<<dim3((unsigned)n_items, (unsigned)n_heads), D < 256 ? D : 256, 0, c->stream>>>(
        (bf16 *)out, d_qb, d_sb, n_seqs, decode ? 1 : 0, n_heads, D, n_splits, gran,
        skip_single ? 1 : 0, d_items, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_attention(lethe_backend *be, const lethe_attn_args *a) {
    if (!a->v_cache) { /* latent KV: mla.cu */
        lethe_cuda_attention_latent(be, a);
        return;
    }
    if (a->kvq && a->kvq->format != LETHE_KV_NATIVE) { /* quantized KV: attention_quant.cu */
        lethe_cuda_attention_quant(be, a);
        return;
    }
    cuda_ctx *c = cuda_ctx_of(be);
    lethe_check_attention(a);
    const int D = a->head_dim;
    LETHE_ASSERT(D % 8 == 0 && D >= 8 && D <= 256);
    bool decode = a->n_tokens == a->n_seqs;
    for (int s = 0; s < a->n_seqs; s++)
        if (a->q_begin[s + 1] - a->q_begin[s] != 1) decode = false;
    if (a->n_tokens == 0) return;
    const int32_t *d_qb = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    if (a->head_sel_begin) { /* per-KV-head selections: attention_varlen.cu */
        lethe_cuda_attn_varlen(c, a, d_qb);
        return;
    }
    const int32_t *d_sb = lethe_cuda_stage_idx(c, a->sel_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)a->sel_begin[a->n_seqs]);
    /* prefill / extend at head_dims v2 does not take: tensor-core GEMMs
     * (attention_gemm.cu; it hands short sequences, decode rows included, to
     * split_kernel by item list). Outside graph capture only: its scratch may
     * grow. Block-sparse plans exist for the v2 shapes only (backend.h): at
     * these head_dims a->bsp is ignored (dense), as the generic kernel did. */
    if (!decode && !c->capturing && !lethe_cuda_attn_v2_fits(c, D)) {
        lethe_cuda_attn_gemm(c, a, d_qb, d_sb, d_sel);
        return;
    }
    if (decode && D == 256 && lethe_cuda_attn_decode_v2_fits(c, D)) {
        lethe_cuda_attn_decode_v2(c, a, d_qb, d_sb, d_sel);
        return;
    }
    if (lethe_cuda_attn_v2_fits(c, D)) {
        bool bsp = false; /* block-sparse prefill (attention_bsp.cu) for some sequence */
        for (int s = 0; a->bsp && !decode && !bsp && s < a->n_seqs; s++) bsp = lethe_bsp_seq_sparse(a, s);
        if (bsp) lethe_cuda_attn_bsp(c, a, d_qb, d_sb, d_sel);
        else if (decode) lethe_cuda_attn_decode_v2(c, a, d_qb, d_sb, d_sel);
        else lethe_cuda_attn_prefill_v2(c, a, d_qb, d_sb, d_sel);
        return;
    }
    lethe_cuda_attn_split(c, a, d_qb, d_sb, d_sel, decode);
}

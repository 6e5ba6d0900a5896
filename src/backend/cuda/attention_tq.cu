/* attention_tq.cu - KV store and attention over TurboQuant KV (CUDA backend).
 *
 * The twin of backend/cpu/attention_tq.c; format: backend.h
 * LETHE_KV_TURBOQUANT and src/backend/tq_codec.h (per (slot, KV head) b-bit
 * codes of the rotated unit vector + an fp16 norm; kvq->tq = [P][P^T]
 * [centroids 16][bounds 16] f32).
 *
 * kv_store (tq_store_kernel): one warp per (token, KV head, K or V). The
 * steps of lethe_tq_quant_vec with IEEE intrinsics (no contraction): lane l
 * sums x_j^2 for j = l, l + 32, .. (__fmaf_rn), five xor-butterfly adds, n =
 * __fsqrt_rn; lane l then owns coordinates i = l + 32 u: y_i = fmaf chain over
 * j ascending of P[i][j] x_j (P^T read coalesced, x from shared memory), u_i =
 * __fdiv_rn(y_i, n), code_i = #{bounds < u_i}; the codes are packed into
 * bytes through shared memory and the norm stored with __float2half_rn. So for
 * the same bf16 inputs the codes and norms are bit-identical to the CPU's
 * (tests/gpu/test_cuda_kvquant.c).
 *
 * attention, pure decode steps (every sequence one query: the fused path):
 * tq_decode_kernel, block = (sequence, KV head, split) of TQ_WARPS warps: the
 * G query heads of the KV head are rotated once (q' = P q scale log2 e, in
 * shared memory), each warp walks its keys of the split; a lane owns
 * head_dim / 32 coordinates, decodes their codes (n_k c[code]) and the warp
 * reduces the G dot products; an online softmax per head accumulates o' =
 * sum p n_v c[vcode] in the rotated basis in registers. The warps' (max, sum,
 * o') are combined in shared memory and written per split; tq_merge_kernel
 * merges the splits (log-sum-exp) and rotates back, o = P^T o' / l. Nothing
 * is dequantized into memory.
 *
 * attention, steps with prefill or extend rows: each selected row is
 * dequantized (tq_dequant_kernel: x^ = n P^T c[code], one warp per entry and
 * KV head) into a bf16 scratch laid out by selection entry, and the dense
 * attention (attention.cu, tensor cores) runs over it with the identity
 * selection: prefill is a pass over O(n) tokens per chunk, and per-row
 * lookups over O(n^2) (query, key) pairs would cost more than one
 * dequantization per key. The scratch is transient (one layer), the pool
 * holds codes only. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/args.h"
#include "backend/tq_codec.h"

#include <cuda_fp16.h>
#include <math.h>
#include <stdlib.h>

#define TQ_WARPS 4
#define TQ_GMAX 8
#define TQ_DMAX 256
#define TQ_UMAX (TQ_DMAX / 32)
#define TQ_SPLIT_MAX 64
#define TQ_LOG2E 1.4426950408889634f

__device__ __forceinline__ uint32_t tq_code_dev(const uint8_t *codes, int i, int b) {
    const uint32_t bit = (uint32_t)i * (uint32_t)b, byte = bit >> 3, sh = bit & 7u;
    uint32_t w = codes[byte];
    if (sh + (uint32_t)b > 8u) w |= (uint32_t)codes[byte + 1] << 8;
    return (w >> sh) & ((1u << b) - 1u);
}

/* ---- store ------------------------------------------------------------------ */

__global__ void tq_store_kernel(uint8_t *__restrict__ kc, uint8_t *__restrict__ vc,
                                uint16_t *__restrict__ kn, uint16_t *__restrict__ vn,
                                const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                const int32_t *__restrict__ slots, const float *__restrict__ tq,
                                int32_t n, int n_kv, int D, int b) {
    __shared__ float xs[TQ_WARPS][TQ_DMAX];
    __shared__ uint8_t cs[TQ_WARPS][TQ_DMAX];
    const int lane = threadIdx.x % 32, wi = threadIdx.x / 32;
    const float *rot_t = tq + (size_t)D * D, *bounds = tq + 2 * (size_t)D * D + 16;
    const int K1 = (1 << b) - 1;
    const int cb = D * b / 8;
    const int64_t n_warps = (int64_t)n * n_kv * 2;
    for (int64_t w = (int64_t)blockIdx.x * TQ_WARPS + wi; w < n_warps; w += (int64_t)gridDim.x * TQ_WARPS) {
        const int which = (int)(w % 2), h = (int)((w / 2) % n_kv);
        const int32_t i = (int32_t)(w / 2 / n_kv);
        const bf16 *src = (which ? v : k) + ((size_t)i * n_kv + h) * D;
        float p = 0.0f;
        for (int d = lane; d < D; d += 32) {
            const float x = __bfloat162float(src[d]);
            xs[wi][d] = x;
            p = __fmaf_rn(x, x, p);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, o));
        __syncwarp();
        const float nrm = __fsqrt_rn(p);
        const int32_t slot = slots[i];
        const size_t row = (size_t)slot * n_kv + h;
        uint8_t *dst = (which ? vc : kc) + row * cb;
        if (!(nrm > 0.0f)) {
            for (int B = lane; B < cb; B += 32) dst[B] = 0;
            if (lane == 0) (which ? vn : kn)[row] = 0;
            __syncwarp();
            continue;
        }
        for (int c = lane; c < D; c += 32) {
            float y = 0.0f;
            for (int j = 0; j < D; j++) y = __fmaf_rn(rot_t[(size_t)j * D + c], xs[wi][j], y);
            const float u = __fdiv_rn(y, nrm);
            uint32_t q = 0;
            for (int t = 0; t < K1; t++) q += bounds[t] < u;
            cs[wi][c] = (uint8_t)q;
        }
        __syncwarp();
        for (int B = lane; B < cb; B += 32) { /* byte B holds bits [8 B, 8 B + 8) */
            uint32_t byte = 0;
            const int first = (8 * B) / b, last = (8 * B + 7) / b;
            for (int e = first; e <= last && e < D; e++) {
                const int sh = e * b - 8 * B; /* may be negative for the first element */
                const uint32_t q = cs[wi][e];
                byte |= sh >= 0 ? (q << sh) : (q >> -sh);
            }
            dst[B] = (uint8_t)byte;
        }
        if (lane == 0) (which ? vn : kn)[row] = __half_as_ushort(__float2half_rn(nrm));
        __syncwarp();
    }
}

static void tq_store(cuda_ctx *c, const lethe_kv_quant *kvq, uint8_t *kc, uint8_t *vc, const bf16 *k,
                     const bf16 *v, const int32_t *slots, int32_t n, int n_kv, int D) {
    const int b = lethe_kv_tq_bits(kvq->format);
    LETHE_ASSERT(b >= 2 && b <= 4 && D % 8 == 0 && D <= TQ_DMAX && kvq->tq);
    if (n <= 0) return;
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)n);
    const int64_t warps = (int64_t)n * n_kv * 2;
    const unsigned blocks = (unsigned)((warps + TQ_WARPS - 1) / TQ_WARPS < 65535 ? (warps + TQ_WARPS - 1) / TQ_WARPS
                                                                                 : 65535);
    tq_store_kernel<<<blocks, TQ_WARPS * 32, 0, c->stream>>>(kc, vc, (uint16_t *)kvq->k_norm,
                                                             (uint16_t *)kvq->v_norm, k, v, d_slots, kvq->tq,
                                                             n, n_kv, D, b);
    CU_LAUNCH_CHECK();
}

/* ---- fused decode ------------------------------------------------------------ */

/* one query per sequence: row s = sequence s */
__global__ void tq_decode_kernel(const bf16 *__restrict__ q, const uint8_t *__restrict__ kc,
                                 const uint8_t *__restrict__ vc, const uint16_t *__restrict__ kn,
                                 const uint16_t *__restrict__ vn, const float *__restrict__ tq,
                                 const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel,
                                 int n_heads, int n_kv, int D, int b, float scale_log2,
                                 int n_splits, float *__restrict__ ws_o, float *__restrict__ ws_ml) {
    /* 40 KiB static: the raw q rows share their buffer with the warps' outputs */
    __shared__ float buf[TQ_WARPS * TQ_GMAX * TQ_DMAX];
    __shared__ float qr[TQ_GMAX][TQ_DMAX];
    __shared__ float wm[TQ_WARPS][TQ_GMAX], wl[TQ_WARPS][TQ_GMAX];
    float(*qs)[TQ_DMAX] = (float(*)[TQ_DMAX])buf;                 /* [G][D] before the key loop */
    float(*wo)[TQ_GMAX][TQ_DMAX] = (float(*)[TQ_GMAX][TQ_DMAX])buf; /* [warp][G][D] after it */
    const int s = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
    const int G = n_heads / n_kv, lane = threadIdx.x % 32, wi = threadIdx.x / 32;
    const float *rot_t = tq + (size_t)D * D, *cent = tq + 2 * (size_t)D * D;
    for (int t = threadIdx.x; t < G * D; t += blockDim.x)
        qs[t / D][t % D] = __bfloat162float(q[((size_t)s * n_heads + (size_t)g * G + t / D) * D + t % D]);
    __syncthreads();
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) { /* q'_i = sum_j P[i][j] q_j */
        const int hh = t / D, i = t % D;
        float y = 0.0f;
        for (int j = 0; j < D; j++) y = fmaf(rot_t[(size_t)j * D + i], qs[hh][j], y);
        qr[hh][i] = y * scale_log2;
    }
    __syncthreads();
    const int32_t base = sel_begin[s], n_ent = sel_begin[s + 1] - base;
    const int32_t chunk = (n_ent + n_splits - 1) / n_splits;
    const int32_t e0 = split * chunk, e1 = min(n_ent, e0 + chunk);
    const int cb = D * b / 8, nu = (D + 31) / 32;
    float m[TQ_GMAX], l[TQ_GMAX], acc[TQ_GMAX][TQ_UMAX];
#pragma unroll
    for (int hh = 0; hh < TQ_GMAX; hh++) {
        m[hh] = -INFINITY, l[hh] = 0.0f;
#pragma unroll
        for (int u = 0; u < TQ_UMAX; u++) acc[hh][u] = 0.0f;
    }
    for (int32_t e = e0 + wi; e < e1; e += TQ_WARPS) {
        const size_t row = (size_t)sel[base + e] * n_kv + g;
        const uint8_t *kr = kc + row * cb, *vr = vc + row * cb;
        const float nk = __half2float(__ushort_as_half(kn[row])), nv = __half2float(__ushort_as_half(vn[row]));
        float kval[TQ_UMAX], vval[TQ_UMAX];
#pragma unroll
        for (int u = 0; u < TQ_UMAX; u++) {
            const int d = lane + 32 * u;
            const bool in = u < nu && d < D;
            kval[u] = in ? cent[tq_code_dev(kr, d, b)] : 0.0f;
            vval[u] = in ? nv * cent[tq_code_dev(vr, d, b)] : 0.0f;
        }
#pragma unroll
        for (int hh = 0; hh < TQ_GMAX; hh++) {
            if (hh >= G) break;
            float part = 0.0f;
#pragma unroll
            for (int u = 0; u < TQ_UMAX; u++) {
                const int d = lane + 32 * u;
                if (u < nu && d < D) part = fmaf(qr[hh][d], kval[u], part);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            const float sc = part * nk;
            const float mn = fmaxf(m[hh], sc);
            const float corr = exp2f(m[hh] - mn), p = exp2f(sc - mn);
            m[hh] = mn;
            l[hh] = l[hh] * corr + p;
#pragma unroll
            for (int u = 0; u < TQ_UMAX; u++) acc[hh][u] = fmaf(p, vval[u], acc[hh][u] * corr);
        }
    }
    /* combine the warps of the block */
#pragma unroll
    for (int hh = 0; hh < TQ_GMAX; hh++) { /* static indices: the arrays stay in registers */
        if (hh >= G) break;
        if (lane == 0) wm[wi][hh] = m[hh], wl[wi][hh] = l[hh];
#pragma unroll
        for (int u = 0; u < TQ_UMAX; u++) {
            const int d = lane + 32 * u;
            if (u < nu && d < D) wo[wi][hh][d] = acc[hh][u];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int hh = t / D, d = t % D;
        float M = -INFINITY;
        for (int w = 0; w < TQ_WARPS; w++) M = fmaxf(M, wm[w][hh]);
        float L = 0.0f, O = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < TQ_WARPS; w++) {
                const float f = exp2f(wm[w][hh] - M);
                L += wl[w][hh] * f;
                O += wo[w][hh][d] * f;
            }
        const size_t idx = ((size_t)s * n_heads + (size_t)g * G + hh) * n_splits + split;
        ws_o[idx * D + d] = O;
        if (d == 0) ws_ml[2 * idx] = M, ws_ml[2 * idx + 1] = L;
    }
}

/* block = (sequence, query head): merge the splits, o = P^T o' / L */
__global__ void tq_merge_kernel(bf16 *__restrict__ out, const float *__restrict__ tq, int n_heads, int D,
                                int n_splits, const float *__restrict__ ws_o, const float *__restrict__ ws_ml) {
    __shared__ float os[TQ_DMAX];
    const int s = blockIdx.x, h = blockIdx.y;
    const size_t idx0 = ((size_t)s * n_heads + h) * n_splits;
    float M = -INFINITY;
    for (int i = 0; i < n_splits; i++) M = fmaxf(M, ws_ml[2 * (idx0 + i)]);
    float L = 0.0f;
    for (int i = 0; i < n_splits; i++)
        if (ws_ml[2 * (idx0 + i)] != -INFINITY) L += ws_ml[2 * (idx0 + i) + 1] * exp2f(ws_ml[2 * (idx0 + i)] - M);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float O = 0.0f;
        for (int i = 0; i < n_splits; i++)
            if (ws_ml[2 * (idx0 + i)] != -INFINITY) O += ws_o[(idx0 + i) * D + d] * exp2f(ws_ml[2 * (idx0 + i)] - M);
        os[d] = O / L;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < D; j += blockDim.x) { /* o_j = sum_i P[i][j] o'_i */
        float y = 0.0f;
        for (int i = 0; i < D; i++) y = fmaf(tq[(size_t)i * D + j], os[i], y);
        out[((size_t)s * n_heads + h) * D + j] = __float2bfloat16(y);
    }
}

/* ---- prefill / extend: dequantize the selection, dense attention ------------- */

/* warp per (entry, KV head, K|V): dst[(e * n_kv + h) * D + j] = n sum_i P[i][j] c[code_i] */
__global__ void tq_dequant_kernel(bf16 *__restrict__ kd, bf16 *__restrict__ vd, const uint8_t *__restrict__ kc,
                                  const uint8_t *__restrict__ vc, const uint16_t *__restrict__ kn,
                                  const uint16_t *__restrict__ vn, const float *__restrict__ tq,
                                  const int32_t *__restrict__ sel, int32_t n_ent, int n_kv, int D, int b) {
    __shared__ float cs[TQ_WARPS][TQ_DMAX];
    const int lane = threadIdx.x % 32, wi = threadIdx.x / 32;
    const float *cent = tq + 2 * (size_t)D * D;
    const int cb = D * b / 8;
    const int64_t n_warps = (int64_t)n_ent * n_kv * 2;
    for (int64_t w = (int64_t)blockIdx.x * TQ_WARPS + wi; w < n_warps; w += (int64_t)gridDim.x * TQ_WARPS) {
        const int which = (int)(w % 2), h = (int)((w / 2) % n_kv);
        const int32_t e = (int32_t)(w / 2 / n_kv);
        const size_t row = (size_t)sel[e] * n_kv + h;
        const uint8_t *cr = (which ? vc : kc) + row * cb;
        const float nn = __half2float(__ushort_as_half((which ? vn : kn)[row]));
        for (int i = lane; i < D; i += 32) cs[wi][i] = cent[tq_code_dev(cr, i, b)];
        __syncwarp();
        bf16 *dst = (which ? vd : kd) + ((size_t)e * n_kv + h) * D;
        for (int j = lane; j < D; j += 32) {
            float y = 0.0f;
            for (int i = 0; i < D; i++) y = fmaf(tq[(size_t)i * D + j], cs[wi][i], y);
            dst[j] = __float2bfloat16(y * nn);
        }
        __syncwarp();
    }
}

static void tq_attention_dequant(lethe_backend *be, cuda_ctx *c, const lethe_attn_args *a) {
    const int D = a->head_dim, n_kv = a->n_kv_heads, b = lethe_kv_tq_bits(a->kvq->format);
    const int32_t n_ent = a->sel_begin[a->n_seqs];
    const size_t half = (size_t)n_ent * n_kv * D * sizeof(bf16);
    lethe_cuda_reserve(c, &c->tq_ws, &c->tq_ws_cap, 2 * half);
    if (c->tq_iota_n < (size_t)n_ent) { /* host 0, 1, .. : the identity selection */
        free(c->tq_iota);
        c->tq_iota_n = (size_t)n_ent + n_ent / 4;
        c->tq_iota = (int32_t *)malloc(c->tq_iota_n * sizeof(int32_t));
        LETHE_ASSERT(c->tq_iota);
        for (size_t i = 0; i < c->tq_iota_n; i++) c->tq_iota[i] = (int32_t)i;
    }
    bf16 *kd = (bf16 *)c->tq_ws, *vd = (bf16 *)((char *)c->tq_ws + half);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)n_ent);
    const int64_t warps = (int64_t)n_ent * n_kv * 2;
    const unsigned blocks = (unsigned)((warps + TQ_WARPS - 1) / TQ_WARPS < 65535 ? (warps + TQ_WARPS - 1) / TQ_WARPS
                                                                                 : 65535);
    tq_dequant_kernel<<<blocks, TQ_WARPS * 32, 0, c->stream>>>(
        kd, vd, (const uint8_t *)a->k_cache, (const uint8_t *)a->v_cache, (const uint16_t *)a->kvq->k_norm,
        (const uint16_t *)a->kvq->v_norm, a->kvq->tq, d_sel, n_ent, n_kv, D, b);
    CU_LAUNCH_CHECK();
    lethe_attn_args d = *a; /* the same sequences over the scratch rows 0 .. n_ent - 1 */
    d.k_cache = kd;
    d.v_cache = vd;
    d.sel_slots = c->tq_iota;
    d.kvq = NULL;
    lethe_cuda_attention(be, &d);
}

extern "C" void lethe_cuda_kv_store_tq(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                                       void *v_cache, const void *k, const void *v, const int32_t *slots,
                                       int32_t n, int32_t n_kv_heads, int32_t head_dim) {
    tq_store(cuda_ctx_of(be), kvq, (uint8_t *)k_cache, (uint8_t *)v_cache, (const bf16 *)k, (const bf16 *)v,
             slots, n, n_kv_heads, head_dim);
}

extern "C" void lethe_cuda_attention_tq(lethe_backend *be, const lethe_attn_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    lethe_check_attention_quant(a);
    const int D = a->head_dim, G = a->n_heads / a->n_kv_heads;
    LETHE_ASSERT(D % 8 == 0 && D <= TQ_DMAX && G <= TQ_GMAX);
    if (a->n_tokens == 0) return;
    if (a->n_tokens != a->n_seqs) { /* prefill / extend rows in the step */
        tq_attention_dequant(be, c, a);
        return;
    }
    const int S = a->n_seqs;
    const int64_t base_blocks = (int64_t)S * a->n_kv_heads;
    int64_t ns = ((int64_t)c->n_sms * 4 + base_blocks - 1) / base_blocks;
    const int n_splits = (int)(ns < 1 ? 1 : ns > TQ_SPLIT_MAX ? TQ_SPLIT_MAX : ns);
    const size_t n_part = (size_t)S * a->n_heads * n_splits;
    lethe_cuda_reserve(c, (void **)&c->qattn_ws, &c->qattn_ws_cap, n_part * (D + 2) * sizeof(float));
    float *ws_o = c->qattn_ws, *ws_ml = c->qattn_ws + n_part * D;
    const int32_t *d_sb = lethe_cuda_stage_idx(c, a->sel_begin, (size_t)S + 1);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)a->sel_begin[S]);
    dim3 grid((unsigned)S, (unsigned)a->n_kv_heads, (unsigned)n_splits);
    tq_decode_kernel<<<grid, TQ_WARPS * 32, 0, c->stream>>>(
        (const bf16 *)a->q, (const uint8_t *)a->k_cache, (const uint8_t *)a->v_cache,
        (const uint16_t *)a->kvq->k_norm, (const uint16_t *)a->kvq->v_norm, a->kvq->tq, d_sb, d_sel, a->n_heads,
        a->n_kv_heads, D, lethe_kv_tq_bits(a->kvq->format), a->scale * TQ_LOG2E, n_splits, ws_o, ws_ml);
    CU_LAUNCH_CHECK();
    tq_merge_kernel<<<dim3((unsigned)S, (unsigned)a->n_heads), D < 128 ? D : 128, 0, c->stream>>>(
        (bf16 *)a->out, a->kvq->tq, a->n_heads, D, n_splits, ws_o, ws_ml);
    CU_LAUNCH_CHECK();
}

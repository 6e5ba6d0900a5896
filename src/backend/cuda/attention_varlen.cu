/* attention_varlen.cu - attention with per-KV-head selections (varlen per
 * head) on the CUDA backend: rows whose layers keep different tokens per KV
 * head (kv_pool.h head masks; KVzip's pair level, per-head SnapKV / Ada-KV).
 *
 * Semantics: backend.h lethe_attn_args with head_sel_begin set; the CPU twin
 * is backend/cpu/attention.c (attend_tile reads the KV head's own list).
 * Query j of sequence s, head h (KV head g = h / G) attends to entries
 * [0, n_g - n_q + j] of head_sel_slots[head_sel_begin[s * n_kv + g] ..], n_g
 * that list's length; bf16 q / K / V / out, fp32 softmax and accumulation.
 *
 * Kernel: block = (query row, query head), VL_WARPS warps. Warp w takes the
 * keys w, w + VL_WARPS, ...; a lane holds dims lane, lane + 32, ... (head_dim
 * <= 256 -> <= 8 per lane), the q . k dot is a warp shuffle reduction, and
 * each warp keeps its own online softmax (running max m, sum l, output acc);
 * the warps' states merge through shared memory at the end. Every query head
 * reads its K / V rows itself (no sharing across the GQA group, no tensor
 * cores): a first version for correctness, not tuned; dense rows and rows
 * every head keeps whole take the regular kernels (attention.cu). */
#include "backend/cuda/attention_common.cuh"

#define VL_WARPS 4
#define VL_DPL 8 /* dims per lane: head_dim <= 256 */

__global__ void __launch_bounds__(VL_WARPS * 32)
    varlen_kernel(const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                  const bf16 *__restrict__ vc, const int32_t *__restrict__ q_begin,
                  const int32_t *__restrict__ hsel_begin, const int32_t *__restrict__ hsel,
                  int n_seqs, int n_heads, int n_kv, int D, float scale, bf16 *__restrict__ out) {
    const int32_t r = blockIdx.x;
    const int h = blockIdx.y, G = n_heads / n_kv, g = h / G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s = seq_of_row(q_begin, n_seqs, r);
    const int32_t n_q = q_begin[s + 1] - q_begin[s], j = r - q_begin[s];
    const int32_t b0 = hsel_begin[s * n_kv + g], n = hsel_begin[s * n_kv + g + 1] - b0;
    const int32_t n_ent = n - n_q + j + 1; /* causal limit of this query in its head's list */
    float qv[VL_DPL], acc[VL_DPL];
    const bf16 *qr = q + ((size_t)r * n_heads + h) * D;
#pragma unroll
    for (int k = 0; k < VL_DPL; k++) {
        const int d = lane + 32 * k;
        qv[k] = d < D ? __bfloat162float(qr[d]) : 0.0f;
        acc[k] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int32_t e = warp; e < n_ent; e += VL_WARPS) {
        const size_t row = ((size_t)hsel[b0 + e] * n_kv + g) * D;
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < VL_DPL; k++) {
            const int d = lane + 32 * k;
            if (d < D) dot = fmaf(qv[k], __bfloat162float(kc[row + d]), dot);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float sc = dot * scale, mn = fmaxf(m, sc);
        const float corr = m == -INFINITY ? 0.0f : __expf(m - mn), p = __expf(sc - mn);
        l = l * corr + p;
#pragma unroll
        for (int k = 0; k < VL_DPL; k++) {
            const int d = lane + 32 * k;
            acc[k] = acc[k] * corr + (d < D ? p * __bfloat162float(vc[row + d]) : 0.0f);
        }
        m = mn;
    }
    __shared__ float sm[VL_WARPS], sl[VL_WARPS];
    __shared__ float sacc[VL_WARPS][32 * VL_DPL];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int k = 0; k < VL_DPL; k++) sacc[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    float mx = -INFINITY;
    for (int w = 0; w < VL_WARPS; w++) mx = fmaxf(mx, sm[w]);
    for (int d = threadIdx.x; d < D; d += VL_WARPS * 32) {
        float num = 0.0f, den = 0.0f;
        for (int w = 0; w < VL_WARPS; w++) {
            if (sm[w] == -INFINITY) continue; /* a warp that saw no key */
            const float c = __expf(sm[w] - mx);
            num += c * sacc[w][d];
            den += c * sl[w];
        }
        out[((size_t)r * n_heads + h) * D + d] = __float2bfloat16(num / den);
    }
}

void lethe_cuda_attn_varlen(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb) {
    const int D = a->head_dim;
    LETHE_ASSERT(D <= 32 * VL_DPL);
    const size_t nb = (size_t)a->n_seqs * a->n_kv_heads + 1;
    const int32_t *d_hb = lethe_cuda_stage_idx(c, a->head_sel_begin, nb);
    const int32_t *d_hs = lethe_cuda_stage_idx(c, a->head_sel_slots,
                                               (size_t)a->head_sel_begin[nb - 1]);
    dim3 grid((unsigned)a->n_tokens, (unsigned)a->n_heads);
    varlen_kernel<<<grid, VL_WARPS * 32, 0, c->stream>>>(
        (const bf16 *)a->q, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache, d_qb, d_hb, d_hs,
        a->n_seqs, a->n_heads, a->n_kv_heads, D, a->scale, (bf16 *)a->out);
    CU_LAUNCH_CHECK();
}

/* attention_v1.cu - the first-generation CUDA attention kernels, kept out of
 * lethe for comparison (dev/cuda/README.md), and one entry that runs a
 * lethe_attn_args call with either generation's kernels.
 *
 *  - v1 prefill/extend (prefill_kernel, head_dim 64 or 128): tensor-core
 *    flash attention through WMMA bf16 16x16x16 fragments (fp32
 *    accumulate). A block = 64 query rows of one sequence and one head; keys
 *    in tiles of 64 gathered through the slot table, causal mask per row,
 *    online softmax with O kept in shared memory (S round-trips through
 *    shared memory between the two products).
 *  - v1 decode is split_kernel, which stays in lethe as the generic kernel
 *    for the head dims v2 does not take (src/backend/cuda/attention.cu,
 *    lethe_cuda_attn_split); here it runs at head_dim 64 / 128 too.
 *  - v2 is lethe's kernels (src/backend/cuda/attention_v2.cu), called
 *    through their launchers.
 *
 * Semantics are backend.h's lethe_attn_args (the CPU twin is
 * src/backend/cpu/attention.c); native bf16 KV only. */
#include "backend/cuda/attention_common.cuh"
#include "attention_gen.h"
#include "backend/args.h"

#include <math.h>
#include <mma.h>

/* ---- v1 prefill / extend: WMMA flash attention ---------------------------- */

#define PF_BM 64
#define PF_BN 64
#define PF_THREADS 128

template <int D>
struct pf_layout {
    static constexpr int LDQ = D + 8;      /* bf16 elements */
    static constexpr int LDS = PF_BN + 4;  /* floats */
    static constexpr int LDO = D + 4;      /* floats */
    static constexpr size_t q_bytes = (size_t)PF_BM * LDQ * 2;
    static constexpr size_t s_bytes = (size_t)PF_BM * LDS * 4;
    static constexpr size_t o_bytes = (size_t)PF_BM * LDO * 4;
    static constexpr size_t total = 3 * q_bytes + s_bytes + o_bytes;
};

/* grid: x = query tile (tiles[x] = {seq, first row within seq}), y = head */
template <int D>
__global__ void __launch_bounds__(PF_THREADS)
prefill_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
               const bf16 *__restrict__ vc, const int32_t *__restrict__ q_begin,
               const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel,
               const int32_t *__restrict__ tiles, int n_heads, int n_kv, float scale_log2) {
    using namespace nvcuda;
    typedef pf_layout<D> L;
    extern __shared__ __align__(128) char smem[];
    bf16 *Qs = (bf16 *)smem;
    bf16 *Ks = (bf16 *)(smem + L::q_bytes);
    bf16 *Vs = (bf16 *)(smem + 2 * L::q_bytes);
    float *Ss = (float *)(smem + 3 * L::q_bytes);
    float *Os = (float *)(smem + 3 * L::q_bytes + L::s_bytes);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int s = tiles[2 * blockIdx.x], qt0 = tiles[2 * blockIdx.x + 1];
    const int h = blockIdx.y, kvh = h / (n_heads / n_kv);
    const int32_t qb = q_begin[s], n_q = q_begin[s + 1] - qb;
    const int32_t sb = sel_begin[s], n_sel = sel_begin[s + 1] - sb, n_pre = n_sel - n_q;
    const int rows_here = min(PF_BM, n_q - qt0);
    const int32_t kend = n_pre + qt0 + rows_here; /* exclusive bound of entries this tile reads */
    constexpr int VPR = D / 8;                     /* 16-byte vectors per row */
    const size_t row_stride = (size_t)n_kv * D;

    for (int c = tid; c < PF_BM * VPR; c += PF_THREADS) {
        const int rr = c / VPR, cc = c % VPR;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (rr < rows_here) v = *(const uint4 *)(q + ((size_t)(qb + qt0 + rr) * n_heads + h) * D + cc * 8);
        *(uint4 *)(Qs + rr * L::LDQ + cc * 8) = v;
    }
    for (int i = tid; i < PF_BM * L::LDO; i += PF_THREADS) Os[i] = 0.0f;

    const int my_row = warp * 16 + lane / 2, half = lane & 1;
    const int32_t my_limit = n_pre + qt0 + my_row; /* inclusive */
    const bool row_ok = my_row < rows_here;
    float m = -INFINITY, l = 0.0f;
    __syncthreads();

    for (int32_t k0 = 0; k0 < kend; k0 += PF_BN) {
        for (int c = tid; c < PF_BN * VPR; c += PF_THREADS) {
            const int rr = c / VPR, cc = c % VPR;
            const int32_t e = k0 + rr;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (e < kend) {
                const size_t off = (size_t)sel[sb + e] * row_stride + (size_t)kvh * D + cc * 8;
                kv = *(const uint4 *)(kc + off);
                vv = *(const uint4 *)(vc + off);
            }
            *(uint4 *)(Ks + rr * L::LDQ + cc * 8) = kv;
            *(uint4 *)(Vs + rr * L::LDQ + cc * 8) = vv;
        }
        __syncthreads();

        /* S[16 rows of this warp, 64 keys] = Q K^T */
#pragma unroll
        for (int nf = 0; nf < PF_BN / 16; nf++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc;
            wmma::fill_fragment(sacc, 0.0f);
#pragma unroll
            for (int kf = 0; kf < D / 16; kf++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;
                wmma::load_matrix_sync(a, Qs + warp * 16 * L::LDQ + kf * 16, L::LDQ);
                wmma::load_matrix_sync(b, Ks + nf * 16 * L::LDQ + kf * 16, L::LDQ);
                wmma::mma_sync(sacc, a, b, sacc);
            }
            wmma::store_matrix_sync(Ss + warp * 16 * L::LDS + nf * 16, sacc, L::LDS,
                                    wmma::mem_row_major);
        }
        __syncwarp();

        /* online softmax: two lanes per row, 32 columns each */
        float sv[32];
        const float *srow = Ss + my_row * L::LDS + half * 32;
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const int32_t e = k0 + half * 32 + i;
            sv[i] = (row_ok && e <= my_limit) ? srow[i] * scale_log2 : -INFINITY;
            mx = fmaxf(mx, sv[i]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            sv[i] = sv[i] == -INFINITY ? 0.0f : exp2f(sv[i] - m_new);
            sum += sv[i];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();
        bf16 *prow = (bf16 *)(Ss + my_row * L::LDS) + half * 32;
#pragma unroll
        for (int i = 0; i < 32; i += 2)
            *(__nv_bfloat162 *)(prow + i) = __floats2bfloat162_rn(sv[i], sv[i + 1]);
        float *orow = Os + my_row * L::LDO + half * (D / 2);
#pragma unroll
        for (int i = 0; i < D / 2; i++) orow[i] *= alpha;
        __syncwarp();

        /* O[16 rows, D] += P[16, 64] V[64, D] */
        const bf16 *Pw = (const bf16 *)(Ss + warp * 16 * L::LDS);
#pragma unroll
        for (int df = 0; df < D / 16; df++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> oacc;
            float *optr = Os + warp * 16 * L::LDO + df * 16;
            wmma::load_matrix_sync(oacc, optr, L::LDO, wmma::mem_row_major);
#pragma unroll
            for (int kf = 0; kf < PF_BN / 16; kf++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
                wmma::load_matrix_sync(a, Pw + kf * 16, 2 * L::LDS);
                wmma::load_matrix_sync(b, Vs + kf * 16 * L::LDQ + df * 16, L::LDQ);
                wmma::mma_sync(oacc, a, b, oacc);
            }
            wmma::store_matrix_sync(optr, oacc, L::LDO, wmma::mem_row_major);
        }
        __syncthreads(); /* K/V tiles are reloaded next */
    }

    if (row_ok) {
        const float inv = 1.0f / l;
        const float *orow = Os + my_row * L::LDO + half * (D / 2);
        bf16 *dst = out + ((size_t)(qb + qt0 + my_row) * n_heads + h) * D + half * (D / 2);
        for (int i = 0; i < D / 2; i += 2)
            *(__nv_bfloat162 *)(dst + i) = __floats2bfloat162_rn(orow[i] * inv, orow[i + 1] * inv);
    }
}

/* grid: x = query tile, y = head; tiles[] = {seq, first row} built on the host */
template <int D>
static void launch_prefill(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                           const int32_t *d_sb, const int32_t *d_sel) {
    int32_t n_tiles = 0;
    for (int s = 0; s < a->n_seqs; s++)
        n_tiles += (a->q_begin[s + 1] - a->q_begin[s] + PF_BM - 1) / PF_BM;
    if (!n_tiles) return;
    void *h;
    int32_t *d_tiles = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)n_tiles * 2 * sizeof(int32_t), &h);
    int32_t *ht = (int32_t *)h, t = 0;
    for (int s = 0; s < a->n_seqs; s++)
        for (int32_t r0 = 0; r0 < a->q_begin[s + 1] - a->q_begin[s]; r0 += PF_BM) {
            ht[2 * t] = s;
            ht[2 * t + 1] = r0;
            t++;
        }
    CU_CHECK(cudaMemcpyAsync(d_tiles, ht, (size_t)n_tiles * 2 * sizeof(int32_t),
                             cudaMemcpyHostToDevice, c->stream));
    const size_t smem = pf_layout<D>::total;
    static bool attr_set[2];
    bool *done = &attr_set[D == 128];
    if (!*done) {
        CU_CHECK(cudaFuncSetAttribute(prefill_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)smem));
        *done = true;
    }
    prefill_kernel<D><<<dim3((unsigned)n_tiles, (unsigned)a->n_heads), PF_THREADS, smem,
                        c->stream>>>((bf16 *)a->out, (const bf16 *)a->q, (const bf16 *)a->k_cache,
                                     (const bf16 *)a->v_cache, d_qb, d_sb, d_sel, d_tiles,
                                     a->n_heads, a->n_kv_heads, a->scale * LOG2E);
    CU_LAUNCH_CHECK();
}

/* ---- one entry per generation ---------------------------------------------- */

extern "C" bool dev_cuda_attention(lethe_backend *be, const lethe_attn_args *a, int gen) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!a->kvq || a->kvq->format == LETHE_KV_NATIVE);
    lethe_check_attention(a);
    const int D = a->head_dim;
    LETHE_ASSERT(D % 8 == 0 && D >= 8 && D <= 256);
    bool decode = a->n_tokens == a->n_seqs;
    for (int s = 0; s < a->n_seqs; s++)
        if (a->q_begin[s + 1] - a->q_begin[s] != 1) decode = false;
    const size_t pf_smem = D == 64 ? pf_layout<64>::total : pf_layout<128>::total;
    const bool v1_prefill = !decode && (D == 64 || D == 128) && pf_smem <= c->smem_optin;
    if (gen == DEV_ATTN_V2 && !lethe_cuda_attn_v2_fits(c, D)) return false;
    if (gen == DEV_ATTN_V1 && !decode && (D == 64 || D == 128) && !v1_prefill) return false;
    LETHE_ASSERT(gen == DEV_ATTN_V1 || gen == DEV_ATTN_V2);
    if (a->n_tokens == 0) return true;
    const int32_t *d_qb = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sb = lethe_cuda_stage_idx(c, a->sel_begin, (size_t)a->n_seqs + 1);
    const int32_t *d_sel = lethe_cuda_stage_idx(c, a->sel_slots, (size_t)a->sel_begin[a->n_seqs]);
    if (gen == DEV_ATTN_V2) {
        if (decode) lethe_cuda_attn_decode_v2(c, a, d_qb, d_sb, d_sel);
        else lethe_cuda_attn_prefill_v2(c, a, d_qb, d_sb, d_sel);
    } else if (v1_prefill) {
        if (D == 64) launch_prefill<64>(c, a, d_qb, d_sb, d_sel);
        else launch_prefill<128>(c, a, d_qb, d_sb, d_sel);
    } else {
        lethe_cuda_attn_split(c, a, d_qb, d_sb, d_sel, decode);
    }
    return true;
}

/* attention_gemm.cu - prefill / extend attention as tensor-core GEMMs: the
 * dispatcher's path for every head_dim the v2 kernels do not take (e.g. 256:
 * Qwen3.5/3.6's gated attention; 96, 32, latent attention's expanded 192);
 * semantics and CPU twin as every attention: backend.h, cpu/attention.c.
 *
 * Per sequence s (n_q queries, its last n_q keys being their own tokens; n_k
 * selection entries, any slots), for any group size G = n_heads / n_kv_heads:
 *   K / V view: the selection's rows in key order. A selection that is a run
 *     of consecutive slots (latent attention's expanded prefill, sel_dense; a
 *     freshly allocated prompt) is read in place (row stride n_kv * D);
 *     otherwise the rows of a group of nh KV heads are gathered into
 *     contiguous scratch Kg / Vg [n_k, nh, D] bf16 (nh as many as fit
 *     GEMM_GATHER_BYTES, 1 at the least).
 *   Per block of rb query rows (S and P of a block fit GEMM_SP_BYTES) and per
 *     batched GEMM over nb heads of the group:
 *   S[b, i, j] = scale * q[q0 + i, h_b] . K[j, kv(h_b)]   cuBLAS strided
 *                batched, bf16 in, fp32 out [nb, rb, ld] (ld: nk rounded up
 *                to 8, P rows 16-byte aligned)
 *   P[b, i, j] = softmax_j(S[b, i, 0 .. lim_i]) (0 past lim_i, the causal
 *                limit n_k - n_q + i), fp32 max / sum, written bf16
 *   out[q0 + i, h_b] = sum_j P[b, i, j] V[j, kv(h_b)]  batched GEMM, fp32
 *                accumulation, bf16 out
 *   nk = the block's last visible key + 1 (the causal part of the block only).
 *   The batch runs over the group's KV heads for one member g of each group
 *   (q stride G * D, K stride D; G units) when G <= nh, else over the G query
 *   heads of one KV head (q stride D, K stride 0: they read the same rows; nh
 *   units) -- one unit for MHA (G = 1) and for one KV head (MQA / latent).
 *   A unit's batch is cut into equal chunks when all of it would leave fewer
 *   than GEMM_RB_TARGET rows a block (long n_k): every row block re-reads K,
 *   so wide blocks keep the K traffic below the S traffic.
 * LETHE_ATTN_GEMM_SP_BYTES / _GATHER_BYTES lower the two bounds (tests).
 * Sequences with fewer than GEMM_MIN_Q queries (the decode rows of a mixed
 * call, short verify chunks), or whose scratch would pass the bounds above,
 * go to split_kernel by item list (attention.cu): the same attention.
 * Differences from the CPU: P is rounded to bf16 before the PV product (as
 * flash attention's bf16 P), and the GEMMs sum in another order. Never inside
 * graph capture (the scratch may grow; the dispatcher keeps capture off this
 * path). Scratch: one buffer, at most GEMM_GATHER_BYTES + GEMM_SP_BYTES. */
#include "backend/cuda/attention_common.cuh"
#include "backend/args.h"

#include <stdio.h>
#include <stdlib.h>

#define GEMM_SP_BYTES ((size_t)256 << 20)     /* S fp32 + P bf16 of one row block */
#define GEMM_GATHER_BYTES ((size_t)256 << 20) /* Kg + Vg of one group of KV heads */
#define GEMM_MIN_Q 8                          /* fewer queries: split_kernel */
#define GEMM_RB_TARGET 256 /* rows per block the batch width gives way to (K reads per S element) */
#define SM_THREADS 256
#define GATHER_THREADS 256

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* a scratch bound: the default, or a smaller one from the environment
 * (LETHE_ATTN_GEMM_SP_BYTES / LETHE_ATTN_GEMM_GATHER_BYTES: tests use it to
 * reach the row blocks, batch chunks and KV head groups at small sizes) */
static size_t gemm_bound(const char *env, size_t dflt) {
    const char *v = getenv(env);
    if (!v || !*v) return dflt;
    char *end;
    unsigned long long n = strtoull(v, &end, 10);
    return *end == 0 && n >= 4096 && n < dflt ? (size_t)n : dflt;
}

/* leading dimension of S / P rows of nk keys: a multiple of 8, so every P
 * row (the PV GEMM's operand) is 16-byte aligned for the tensor cores */
static int32_t sp_ld(int32_t nk) { return (nk + 7) / 8 * 8; }

/* (m, l) += (m2, l2): running max and sum of exp(x - m) of two parts (either may be empty: m = -inf) */
__device__ __forceinline__ void ml_merge(float &m, float &l, float m2, float l2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
        m = m2, l = l2;
        return;
    }
    const float mn = fmaxf(m, m2);
    l = l * expf(m - mn) + l2 * expf(m2 - mn);
    m = mn;
}

/* one block per (row i of the block, batch entry b): P = softmax of S over
 * j <= lim; S / P [nb, rb, ld], the first nk of each row used. One pass over
 * S for the max and the sum (online rescaling), one to write P. */
__global__ void __launch_bounds__(SM_THREADS)
    gemm_softmax_kernel(const float *__restrict__ S, bf16 *__restrict__ P, int32_t rb,
                        int32_t nk, int32_t ld, int32_t lim0) {
    __shared__ float red_m[SM_THREADS / 32], red_l[SM_THREADS / 32];
    const int32_t i = blockIdx.x, b = blockIdx.y;
    const size_t row = ((size_t)b * rb + i) * ld;
    const int32_t lim = min(nk - 1, lim0 + i); /* keys 0 .. lim visible */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m = -INFINITY, l = 0.0f;
    for (int32_t j = threadIdx.x; j <= lim; j += SM_THREADS) {
        const float x = S[row + j];
        if (x > m) {
            l = l * expf(m - x) + 1.0f; /* m = -inf: l = 0, expf(-inf) = 0 */
            m = x;
        } else {
            l += expf(x - m);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        ml_merge(m, l, m2, l2);
    }
    if (lane == 0) red_m[warp] = m, red_l[warp] = l;
    __syncthreads();
    m = red_m[0], l = red_l[0];
    for (int w = 1; w < SM_THREADS / 32; w++) ml_merge(m, l, red_m[w], red_l[w]);
    const float inv = 1.0f / l; /* lim >= 0: the row sees at least key 0, m finite */
    for (int32_t j = threadIdx.x; j < nk; j += SM_THREADS)
        P[row + j] = __float2bfloat16(j <= lim ? expf(S[row + j] - m) * inv : 0.0f);
}

/* Kg / Vg [n, nh, D] = K / V[sel[j], h0 + hh, :] for hh < nh; caches [*, n_kv, D].
 * One thread per 16-byte vector (D % 8 == 0: rows are 16-byte aligned). */
__global__ void __launch_bounds__(GATHER_THREADS)
    gemm_gather_kernel(uint4 *__restrict__ kg, uint4 *__restrict__ vg, const uint4 *__restrict__ kc,
                       const uint4 *__restrict__ vc, const int32_t *__restrict__ sel, int32_t n,
                       int n_kv, int h0, int nh, int D) {
    const int nv = D / 8;
    const size_t total = (size_t)n * nh * nv;
    for (size_t i = (size_t)blockIdx.x * GATHER_THREADS + threadIdx.x; i < total;
         i += (size_t)gridDim.x * GATHER_THREADS) {
        const int v = (int)(i % nv);
        const size_t t = i / nv;
        const int hh = (int)(t % nh);
        const size_t j = t / nh;
        const size_t src = ((size_t)sel[j] * n_kv + h0 + hh) * nv + v;
        kg[i] = __ldg(kc + src);
        vg[i] = __ldg(vc + src);
    }
}

static void gemm_ok(cublasStatus_t st, const char *what, int32_t m, int32_t n, int32_t k) {
    if (st == CUBLAS_STATUS_SUCCESS) return;
    char buf[160];
    snprintf(buf, sizeof buf, "attention_gemm %s cublasGemmStridedBatchedEx(m=%d, n=%d, k=%d)",
             what, m, n, k);
    lethe_cuda_fatal_(buf, cublasGetStatusString(st), __FILE__, __LINE__);
}

/* how one sequence runs on this path */
typedef struct gemm_plan {
    bool contig;        /* the selection is consecutive slots: K / V read in place */
    int nh;             /* KV heads per group (n_kv when contig) */
    int nb;             /* heads per batched GEMM (at most max(G, nh)) */
    int32_t rb;         /* query rows per block */
    size_t gather_bytes, sp_bytes; /* Kg + Vg of a group; S + P of a block */
} gemm_plan;

/* false: the sequence goes to split_kernel (few queries, or past the scratch bounds) */
static bool gemm_plan_seq(const lethe_attn_args *a, int s, size_t sp_cap, size_t gather_cap,
                          gemm_plan *p) {
    const int KV = a->n_kv_heads, D = a->head_dim, G = a->n_heads / KV;
    const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
    const int32_t k0 = a->sel_begin[s], n_k = a->sel_begin[s + 1] - k0;
    if (n_q < GEMM_MIN_Q) return false;
    LETHE_ASSERT(n_k >= n_q);
    const int32_t *sel = a->sel_slots + k0;
    p->contig = true;
    for (int32_t j = 1; j < n_k && p->contig; j++) p->contig = sel[j] == sel[0] + j;
    const size_t head_gather = 2 * (size_t)n_k * D * sizeof(bf16); /* K + V of one KV head */
    if (p->contig) {
        p->nh = KV;
        p->gather_bytes = 0;
    } else {
        if (head_gather > gather_cap) return false;
        const size_t fit = gather_cap / head_gather;
        p->nh = fit < (size_t)KV ? (int)fit : KV;
        p->gather_bytes = align256(head_gather * (size_t)p->nh);
    }
    /* batch width: all max(G, nh) heads of a unit (see gemm_group) unless that
     * leaves fewer than min(n_q, GEMM_RB_TARGET) rows a block; then as many
     * as keep that many rows, in equal chunks */
    const int width = G > p->nh ? G : p->nh;
    const size_t per_head_row = (size_t)sp_ld(n_k) * (sizeof(float) + sizeof(bf16));
    if (per_head_row + 256 > sp_cap) return false;
    const size_t avail = sp_cap - 256;
    const size_t want_rows = (size_t)(n_q < GEMM_RB_TARGET ? n_q : GEMM_RB_TARGET);
    size_t nb = avail / (per_head_row * want_rows);
    nb = nb < 1 ? 1 : nb > (size_t)width ? (size_t)width : nb;
    const int n_chunks = (int)((width + nb - 1) / nb);
    p->nb = (width + n_chunks - 1) / n_chunks;
    const size_t rb = avail / ((size_t)p->nb * per_head_row);
    p->rb = rb > (size_t)n_q ? n_q : (int32_t)rb; /* >= 1: nb * per_head_row <= avail */
    p->sp_bytes = (size_t)p->rb * p->nb * per_head_row + 256;
    return true;
}

/* sequence s over KV heads [kv0, kv0 + nh): kv points at head kv0's K of key
 * 0 (V at vv), row stride ld_kv elements. The group's nh * G query heads are
 * (kv0 + hh) * G + g; a unit fixes the shorter of the two indices (g when
 * G <= nh, else hh) and its heads along the other run in batched GEMMs of at
 * most p->nb: along hh (q stride G * D, K stride D) or along g (q stride D,
 * K stride 0: the G heads read the same rows). */
static void gemm_group(cuda_ctx *c, const lethe_attn_args *a, int s, const gemm_plan *p, int kv0,
                       int nh, const bf16 *kv, const bf16 *vv, int ld_kv, char *sp) {
    const int H = a->n_heads, D = a->head_dim, G = H / a->n_kv_heads;
    const bf16 *q = (const bf16 *)a->q;
    bf16 *out = (bf16 *)a->out;
    const int q_ld = H * D;
    const int32_t q0 = a->q_begin[s], n_q = a->q_begin[s + 1] - q0;
    const int32_t n_k = a->sel_begin[s + 1] - a->sel_begin[s];
    const bool by_g = G <= nh;
    const int n_units = by_g ? G : nh, n_along = by_g ? nh : G;
    const long long q_bs = by_g ? (long long)G * D : (long long)D, k_bs = by_g ? (long long)D : 0;
    const float one = 1.0f, zero = 0.0f;
    for (int32_t i0 = 0; i0 < n_q; i0 += p->rb) {
        const int32_t nr = min(p->rb, n_q - i0);
        const int32_t lim0 = n_k - n_q + i0;    /* last key row i0 sees */
        const int32_t nk = min(n_k, lim0 + nr); /* keys any row of the block sees */
        const int32_t ld = sp_ld(nk);
        for (int u = 0; u < n_units; u++)
            for (int b0 = 0; b0 < n_along; b0 += p->nb) {
                const int nb = min(p->nb, n_along - b0);
                float *S = (float *)sp;
                bf16 *P = (bf16 *)(sp + align256((size_t)nb * nr * ld * sizeof(float)));
                /* the first head of the batch: (hh, g) = (b0, u) or (u, b0) */
                const int hh = by_g ? b0 : u, g = by_g ? u : b0;
                const size_t q_off = ((size_t)(kv0 + hh) * G + g) * D;
                const size_t k_off = (size_t)hh * D;
                const size_t row_off = (size_t)(q0 + i0) * q_ld + q_off;
                /* column-major: S_b^T [nk, nr] (ld) = K_b [nk, D] q_b^T [D, nr] */
                gemm_ok(cublasGemmStridedBatchedEx(
                            c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, nk, nr, D, &a->scale, kv + k_off,
                            CUDA_R_16BF, ld_kv, k_bs, q + row_off, CUDA_R_16BF, q_ld, q_bs, &zero,
                            S, CUDA_R_32F, ld, (long long)nr * ld, nb, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
                        "scores", nk, nr, D);
                gemm_softmax_kernel<<<dim3((unsigned)nr, (unsigned)nb), SM_THREADS, 0,
                                      c->stream>>>(S, P, nr, nk, ld, lim0);
                CU_LAUNCH_CHECK();
                /* out_b^T [D, nr] = V_b^T [D, nk] P_b^T [nk, nr] (ld) */
                gemm_ok(cublasGemmStridedBatchedEx(
                            c->cublas, CUBLAS_OP_N, CUBLAS_OP_N, D, nr, nk, &one, vv + k_off,
                            CUDA_R_16BF, ld_kv, k_bs, P, CUDA_R_16BF, ld, (long long)nr * ld,
                            &zero, out + row_off, CUDA_R_16BF, q_ld, q_bs, nb,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                        "pv", D, nr, nk);
            }
    }
}

void lethe_cuda_attn_gemm(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                          const int32_t *d_sb, const int32_t *d_sel) {
    const int KV = a->n_kv_heads, D = a->head_dim;
    LETHE_ASSERT(!a->head_sel_begin && !c->capturing && a->n_heads % KV == 0 && D % 8 == 0);
    const int S_n = a->n_seqs;
    gemm_plan *plan = (gemm_plan *)malloc((size_t)S_n * sizeof(gemm_plan));
    bool *on = (bool *)malloc((size_t)S_n * sizeof(bool));
    LETHE_ASSERT(plan && on);
    const size_t sp_cap = gemm_bound("LETHE_ATTN_GEMM_SP_BYTES", GEMM_SP_BYTES);
    const size_t gather_cap = gemm_bound("LETHE_ATTN_GEMM_GATHER_BYTES", GEMM_GATHER_BYTES);
    int32_t n_split = 0;
    size_t ws_need = 0;
    for (int s = 0; s < S_n; s++) {
        on[s] = gemm_plan_seq(a, s, sp_cap, gather_cap, &plan[s]);
        if (on[s]) {
            const size_t need = plan[s].gather_bytes + plan[s].sp_bytes;
            if (need > ws_need) ws_need = need;
        } else {
            n_split += a->q_begin[s + 1] - a->q_begin[s];
        }
    }
    /* the other rows: split_kernel over their item list (written to out by row) */
    if (n_split) {
        void *hv;
        int32_t *d_items = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)n_split * sizeof(int32_t), &hv);
        int32_t *hi = (int32_t *)hv, k = 0;
        for (int s = 0; s < S_n; s++)
            if (!on[s])
                for (int32_t r = a->q_begin[s]; r < a->q_begin[s + 1]; r++) hi[k++] = r;
        LETHE_ASSERT(k == n_split);
        CU_CHECK(cudaMemcpyAsync(d_items, hi, (size_t)n_split * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, c->stream));
        lethe_cuda_attn_split_items(c, a, d_qb, d_sb, d_sel, false, n_split, d_items);
    }
    if (ws_need) lethe_cuda_reserve(c, &c->gemm_attn_ws, &c->gemm_attn_ws_cap, ws_need);
    const bf16 *kc = (const bf16 *)a->k_cache, *vc = (const bf16 *)a->v_cache;
    for (int s = 0; s < S_n; s++) {
        if (!on[s]) continue;
        const gemm_plan *p = &plan[s];
        const int32_t k0 = a->sel_begin[s], n_k = a->sel_begin[s + 1] - k0;
        char *ws = (char *)c->gemm_attn_ws;
        for (int kv0 = 0; kv0 < KV; kv0 += p->nh) {
            const int nh = min(p->nh, KV - kv0);
            if (p->contig) {
                const size_t row0 = ((size_t)a->sel_slots[k0] * KV + kv0) * D;
                gemm_group(c, a, s, p, kv0, nh, kc + row0, vc + row0, KV * D, ws);
                continue;
            }
            bf16 *kg = (bf16 *)ws, *vg = kg + (size_t)n_k * nh * D;
            const size_t n_vec = (size_t)n_k * nh * (D / 8);
            gemm_gather_kernel<<<lethe_cuda_blocks(n_vec, GATHER_THREADS), GATHER_THREADS, 0,
                                 c->stream>>>((uint4 *)kg, (uint4 *)vg, (const uint4 *)kc,
                                              (const uint4 *)vc, d_sel + k0, n_k, KV, kv0, nh, D);
            CU_LAUNCH_CHECK();
            gemm_group(c, a, s, p, kv0, nh, kg, vg, nh * D, ws + p->gather_bytes);
        }
    }
    free(plan);
    free(on);
}

/* attention_bsp.cu - block-sparse prefill attention on the CUDA backend
 * (backend.h lethe_block_sparse; the CPU twin is backend/cpu/attention_bsp.c
 * + attention.c): the block choice, then attention_v2.cu's prefill kernel
 * reading only the chosen key tiles (prefill_v2_kernel<D, true>).
 *
 * For the block-sparse sequences of the call (lethe_bsp_seq_sparse), with
 * B = 128 (the prefill kernel's query tile; two 64-key tiles per key block):
 *   bsp_qmean_kernel  qm [query blocks, n_heads, D] f32: mean query per block and head
 *   bsp_kmean_kernel  km, vm [key blocks, n_kv, D] bf16: mean K / V per key block
 *                     (entries gathered through the selection)
 *   bsp_select_kernel one block per (query block, KV head): per query head
 *                     the softmax over the visible key blocks of scale * qm . km
 *                     (two passes: max and sum, then the probabilities, max over
 *                     the group's heads), the forced blocks (lethe_bsp_forced),
 *                     the threshold; writes the 64-key tiles to read (ascending,
 *                     a key block's second tile only when the query block
 *                     reaches it) and, with mean correction, the skipped blocks
 *                     (rows of km / vm), compacted by block-wide prefix sums.
 * Dense sequences of the same call (short chunks) get no plan (query block
 * -1) and their tiles run the dense iteration; single-query sequences go to
 * the decode kernel as in prefill_v2. The block scores use bf16 means (the
 * CPU twin f32), so a block whose score lies within rounding of the
 * threshold may be chosen differently; threshold 0 and 1 choose exactly the
 * same blocks on both (every block; only the forced ones). */
#include "backend/cuda/attention_common.cuh"
#include "backend/args.h"

#define BSP_B 128
#define BSP_THREADS 128
#define BSP_GMAX 32 /* query heads per KV head */

/* query block descriptor (host-built), QD_N ints: its first batch row and
 * rows, the first key block of its sequence in km / vm, the last key block
 * it sees, the key blocks all of whose entries its first query sees, the
 * entries its last query sees (kend), whether every block is read */
enum { QD_ROW0, QD_NROWS, QD_KB_BASE, QD_KB_LAST, QD_N_FULL, QD_KEND, QD_ALL, QD_N };
/* key block descriptor: its first index into the selection (d_sel) and entries */
enum { KD_E0, KD_N, KD_NI };

__global__ void bsp_qmean_kernel(float *__restrict__ qm, const bf16 *__restrict__ q,
                                 const int32_t *__restrict__ qd, int n_heads, int D) {
    const int32_t blk = blockIdx.x, h = blockIdx.y;
    const int32_t row0 = qd[blk * QD_N + QD_ROW0], n = qd[blk * QD_N + QD_NROWS];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int32_t r = 0; r < n; r++) acc += __bfloat162float(q[((size_t)(row0 + r) * n_heads + h) * D + d]);
        qm[((size_t)blk * n_heads + h) * D + d] = acc / (float)n;
    }
}

__global__ void bsp_kmean_kernel(bf16 *__restrict__ km, bf16 *__restrict__ vm,
                                 const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,
                                 const int32_t *__restrict__ sel, const int32_t *__restrict__ kd,
                                 int n_kv, int D) {
    const int32_t blk = blockIdx.x, g = blockIdx.y;
    const int32_t e0 = kd[blk * KD_NI + KD_E0], n = kd[blk * KD_NI + KD_N];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float ak = 0.0f, av = 0.0f;
        for (int32_t e = 0; e < n; e++) {
            const size_t off = ((size_t)__ldg(sel + e0 + e) * n_kv + g) * D + d;
            ak += __bfloat162float(kc[off]);
            av += __bfloat162float(vc[off]);
        }
        const size_t o = ((size_t)blk * n_kv + g) * D + d;
        km[o] = __float2bfloat16(ak / (float)n);
        vm[o] = __float2bfloat16(av / (float)n);
    }
}

__device__ __forceinline__ float bsp_dot(const float *__restrict__ qv, const bf16 *__restrict__ kv, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc = fmaf(qv[d], __bfloat162float(kv[d]), acc);
    return acc;
}

/* block-wide reductions over BSP_THREADS threads (red: shared [BSP_THREADS / 32]) */
__device__ float bsp_block_max(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < BSP_THREADS / 32; w++) m = fmaxf(m, red[w]);
    return m;
}
__device__ float bsp_block_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < BSP_THREADS / 32; w++) s += red[w];
    return s;
}
/* exclusive prefix sum of v over the block (in thread order); *total = the sum */
__device__ int bsp_block_scan(int v, int *red, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) red[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < BSP_THREADS / 32; w++) {
        if (w < warp) before += red[w];
        all += red[w];
    }
    *total = all;
    return before + x - v;
}

/* grid: x = query block, y = KV head */
__global__ void __launch_bounds__(BSP_THREADS)
bsp_select_kernel(int32_t *__restrict__ counts, int32_t *__restrict__ tiles,
                  int32_t *__restrict__ skips, const float *__restrict__ qm,
                  const bf16 *__restrict__ km, const int32_t *__restrict__ qd, int n_heads, int n_kv,
                  int D, float scale, float threshold, int mean_corr, int64_t tiles_stride,
                  int64_t skips_stride, int sink_blocks, int window_blocks) {
    const int32_t blk = blockIdx.x, g = blockIdx.y, G = n_heads / n_kv;
    const int32_t *d = qd + blk * QD_N;
    const int32_t kb_base = d[QD_KB_BASE], kb_last = d[QD_KB_LAST], n_full = d[QD_N_FULL];
    const int32_t kend = d[QD_KEND];
    const bool all = d[QD_ALL] != 0;
    __shared__ float red[BSP_THREADS / 32];
    __shared__ float hm[BSP_GMAX], hl[BSP_GMAX];
    __shared__ int ired[BSP_THREADS / 32];
    const size_t item = (size_t)blk * n_kv + g;
    auto score = [&](int gi, int32_t b) -> float {
        const float *qv = qm + ((size_t)blk * n_heads + g * G + gi) * D;
        return scale * bsp_dot(qv, km + ((size_t)(kb_base + b) * n_kv + g) * D, D);
    };
    if (!all) { /* per query head: max and sum of the block softmax */
        for (int gi = 0; gi < G; gi++) {
            float mx = -INFINITY;
            for (int32_t b = threadIdx.x; b <= kb_last; b += BSP_THREADS) mx = fmaxf(mx, score(gi, b));
            mx = bsp_block_max(mx, red);
            float sum = 0.0f;
            for (int32_t b = threadIdx.x; b <= kb_last; b += BSP_THREADS) sum += __expf(score(gi, b) - mx);
            sum = bsp_block_sum(sum, red);
            if (threadIdx.x == 0) hm[gi] = mx, hl[gi] = sum;
        }
        __syncthreads();
    }
    int n_t = 0, n_s = 0; /* list lengths so far */
    for (int32_t base = 0; base <= kb_last; base += BSP_THREADS) {
        const int32_t b = base + threadIdx.x;
        bool keep = false;
        if (b <= kb_last) {
            keep = all || b < sink_blocks || b > kb_last - window_blocks || b >= n_full;
            if (!keep) {
                float p = 0.0f;
                for (int gi = 0; gi < G; gi++) p = fmaxf(p, __expf(score(gi, b) - hm[gi]) / hl[gi]);
                keep = p >= threshold;
            }
        }
        const bool skip = b <= kb_last && !keep && mean_corr; /* (never a diagonal block) */
        /* a kept block's 64-key tiles that hold entries the query block reads */
        const int nt = keep ? ((2 * b + 1) * (BSP_B / 2) < kend ? 2 : 1) : 0;
        int tot_t, tot_s;
        const int off_t = bsp_block_scan(nt, ired, &tot_t);
        const int off_s = bsp_block_scan(skip ? 1 : 0, ired, &tot_s);
        int32_t *tl = tiles + item * tiles_stride + n_t + off_t;
        if (nt >= 1) tl[0] = 2 * b;
        if (nt == 2) tl[1] = 2 * b + 1;
        if (skip) skips[item * skips_stride + n_s + off_s] = kb_base + b;
        n_t += tot_t;
        n_s += tot_s;
    }
    if (threadIdx.x == 0) {
        counts[2 * item] = n_t;
        counts[2 * item + 1] = n_s;
    }
}

/* ---- host ---- */

void lethe_cuda_attn_bsp(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                         const int32_t *d_sb, const int32_t *d_sel) {
    const lethe_block_sparse *p = a->bsp;
    lethe_check_block_sparse(p);
    LETHE_ASSERT(p->block == BSP_B && "CUDA block-sparse prefill: 128-token blocks");
    const int H = a->n_heads, KH = a->n_kv_heads, G = H / KH, D = a->head_dim;
    LETHE_ASSERT(G <= BSP_GMAX);
    /* the plan's geometry: query blocks and key blocks of the sparse sequences */
    int32_t *qblk_base = (int32_t *)malloc((size_t)a->n_seqs * sizeof(int32_t));
    LETHE_ASSERT(qblk_base);
    int32_t n_qb = 0, n_kb = 0, max_kb = 0;
    for (int s = 0; s < a->n_seqs; s++) {
        qblk_base[s] = -1;
        if (!lethe_bsp_seq_sparse(a, s)) continue;
        const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
        const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
        qblk_base[s] = n_qb;
        n_qb += (n_q + BSP_B - 1) / BSP_B;
        const int32_t nk = (n_sel + BSP_B - 1) / BSP_B;
        n_kb += nk;
        if (nk > max_kb) max_kb = nk;
    }
    LETHE_ASSERT(n_qb > 0);
    void *hq, *hk;
    int32_t *d_qd = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)n_qb * QD_N * sizeof(int32_t), &hq);
    int32_t *d_kd = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)n_kb * KD_NI * sizeof(int32_t), &hk);
    int32_t *qd = (int32_t *)hq, *kd = (int32_t *)hk;
    for (int s = 0, kb = 0; s < a->n_seqs; s++) {
        if (qblk_base[s] < 0) continue;
        const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
        const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s], n_pre = n_sel - n_q;
        const int32_t nqb = (n_q + BSP_B - 1) / BSP_B, nk = (n_sel + BSP_B - 1) / BSP_B;
        for (int32_t t = 0; t < nqb; t++) {
            int32_t *x = qd + (size_t)(qblk_base[s] + t) * QD_N;
            int32_t kb_last, n_full;
            lethe_bsp_block_range(p, n_q, n_sel, t, &kb_last, &n_full);
            const int32_t rows = n_q - t * BSP_B < BSP_B ? n_q - t * BSP_B : BSP_B;
            x[QD_ROW0] = a->q_begin[s] + t * BSP_B;
            x[QD_NROWS] = rows;
            x[QD_KB_BASE] = kb;
            x[QD_KB_LAST] = kb_last;
            x[QD_N_FULL] = n_full;
            x[QD_KEND] = n_pre + t * BSP_B + rows;
            x[QD_ALL] = t >= nqb - lethe_bsp_last_q(a, s);
        }
        for (int32_t b = 0; b < nk; b++, kb++) {
            kd[(size_t)kb * KD_NI + KD_E0] = a->sel_begin[s] + b * BSP_B;
            kd[(size_t)kb * KD_NI + KD_N] = (n_sel - b * BSP_B < BSP_B ? n_sel - b * BSP_B : BSP_B);
        }
    }
    CU_CHECK(cudaMemcpyAsync(d_qd, qd, (size_t)n_qb * QD_N * sizeof(int32_t), cudaMemcpyHostToDevice,
                             c->stream));
    CU_CHECK(cudaMemcpyAsync(d_kd, kd, (size_t)n_kb * KD_NI * sizeof(int32_t), cudaMemcpyHostToDevice,
                             c->stream));
    /* device scratch: qm (f32), km / vm (bf16), counts, tile and skip lists */
    const int64_t items = (int64_t)n_qb * KH, t_stride = 2 * (int64_t)max_kb, s_stride = max_kb;
    const size_t qm_b = (size_t)n_qb * H * D * sizeof(float);
    const size_t kvm_b = (size_t)n_kb * KH * D * sizeof(bf16);
    const size_t cnt_b = (size_t)items * 2 * sizeof(int32_t);
    const size_t tl_b = (size_t)items * t_stride * sizeof(int32_t);
    const size_t sk_b = (size_t)items * s_stride * sizeof(int32_t);
    auto al = [](size_t x) { return (x + 255) & ~(size_t)255; };
    const size_t need = al(qm_b) + 2 * al(kvm_b) + al(cnt_b) + al(tl_b) + al(sk_b);
    lethe_cuda_reserve(c, &c->bsp_ws, &c->bsp_ws_cap, need);
    char *w = (char *)c->bsp_ws;
    float *qm = (float *)w;
    w += al(qm_b);
    bf16 *km = (bf16 *)w;
    w += al(kvm_b);
    bf16 *vm = (bf16 *)w;
    w += al(kvm_b);
    int32_t *counts = (int32_t *)w;
    w += al(cnt_b);
    int32_t *tl = (int32_t *)w;
    w += al(tl_b);
    int32_t *sk = (int32_t *)w;

    const unsigned th = D < 128 ? (unsigned)D : 128u;
    bsp_qmean_kernel<<<dim3((unsigned)n_qb, (unsigned)H), th, 0, c->stream>>>(qm, (const bf16 *)a->q, d_qd, H, D);
    CU_LAUNCH_CHECK();
    bsp_kmean_kernel<<<dim3((unsigned)n_kb, (unsigned)KH), th, 0, c->stream>>>(
        km, vm, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache, d_sel, d_kd, KH, D);
    CU_LAUNCH_CHECK();
    bsp_select_kernel<<<dim3((unsigned)n_qb, (unsigned)KH), BSP_THREADS, 0, c->stream>>>(
        counts, tl, sk, qm, km, d_qd, H, KH, D, a->scale, p->threshold, p->mean_correction ? 1 : 0,
        t_stride, s_stride, p->sink_blocks, p->window_blocks);
    CU_LAUNCH_CHECK();
    lethe_cuda_bsp_plan plan;
    plan.qblk_base = qblk_base;
    plan.dev.counts = counts;
    plan.dev.tiles = tl;
    plan.dev.skips = sk;
    plan.dev.km = km;
    plan.dev.vm = vm;
    plan.dev.tiles_stride = t_stride;
    plan.dev.skips_stride = s_stride;
    lethe_cuda_attn_prefill_v2_bsp(c, a, d_qb, d_sb, d_sel, &plan);
    free(qblk_base);
}

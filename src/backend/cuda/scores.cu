/* scores.cu - attn_scores on the CUDA backend: reduced per-key scores of a
 * few query rows for the sparse methods (semantics: lethe_attn_scores_args in
 * backend.h; CPU twin: backend/cpu/scores.c).
 *
 * Nothing of size rows x keys is materialized (methods.md §2.4 K1, flash-
 * style two passes). Three kernels on the backend stream, then one small
 * device -> host copy of the reduced output (none with out_on_backend):
 *
 *  1. stats (probability modes only): block = (sequence, up to SC_RB scored
 *     rows, query head); its threads stride over the row's denominator keys
 *     (candidates, or the whole causal selection), each keeping an online
 *     (max m, sum l of exp(s - m)) per row, merged across the block.
 *     Output stats [n_heads, n_rows] (m, l) per sequence.
 *  2. values: block = (sequence, tile of SC_THREADS candidates, query head),
 *     a thread per candidate key; the scored rows' q vectors pass through
 *     shared memory SC_RB at a time; per key it keeps the max raw score
 *     (LOGIT_MAX) or the sum over rows of exp(s - m_i) / l_i, divided by
 *     n_rows. Output v [n_heads, n_cand] per sequence.
 *  3. reduce: a thread per (group, candidate) folds the group's heads in
 *     head order (max / sum / mean) into the output [n_groups, n_cand].
 *
 * Raw scores are fp32 FMA chains over d in increasing order of the bf16 q
 * and K (the CPU twin's order), so with identical inputs they match the CPU
 * up to the rounding of q/K to bf16; exp is expf and sums are fp32
 * (the CPU uses double), hence the tolerances in test_cuda_ops.
 *
 * Scratch (c->scores_d, grows outside capture): n_heads * (n_cand + 2 *
 * n_rows) + n_groups * n_cand floats summed over the sequences, i.e.
 * O(n_heads * n_cand) per sequence. Work: O(n_heads * n_rows * n_keys * D)
 * FMAs per pass, the cost of the window scorer itself. LETHE_SCORES_QMEAN
 * first averages each sequence's rows into one bf16 mean query
 * (sc_qmean_kernel, scratch c->qmean_ws), then scores that single row. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/args.h"

#include <math.h>

#define SC_THREADS 128
#define SC_RB 16     /* scored rows per register block (each K row read once per 16 rows) */

/* per-sequence device descriptor (offsets in floats into the scratch) */
typedef struct sc_desc {
    int32_t q_row, n_rows, key_begin, n_keys, c0, c1, mode, pad;
    int64_t hv_off;    /* v [n_heads, n_cand] */
    int64_t st_off;    /* stats [n_heads, n_rows] as float2 (m, l), in float2 units */
    int64_t out_off;   /* output [n_groups, n_cand] */
} sc_desc;

/* Loads up to SC_RB query rows [r0, r0 + nr) of head h into Qs [nr, D] (fp32). */
__device__ __forceinline__ void load_rows(float *Qs, const bf16 *__restrict__ q, const sc_desc &sd,
                                          int r0, int nr, int h, int H, int D) {
    for (int idx = threadIdx.x; idx < nr * D; idx += blockDim.x) {
        const int r = idx / D, d = idx - r * D;
        Qs[idx] = __bfloat162float(q[((size_t)(sd.q_row + r0 + r) * H + h) * D + d]);
    }
}

/* acc[r] = sum_d Qs[r][d] * k[d] for r < nr: one fmaf chain over d in order.
 * head_dim % 8 == 0 (every model's): the key row is read 16 bytes at a time
 * and the rows' queries as float4 broadcasts from shared memory (Qs and k
 * 16-byte aligned), one load per 8 (key) / 4 (query) channels instead of
 * per 2 / 1; the chain per (row, key) is the same fmaf sequence in d order,
 * so the values are bit-identical to the 2-channel loop below. */
__device__ __forceinline__ void row_dots(const float *Qs, const bf16 *__restrict__ k, int D, int nr,
                                         float *acc) {
#pragma unroll
    for (int r = 0; r < SC_RB; r++) acc[r] = 0.0f;
    if ((D & 7) == 0) {
        const uint4 *k8 = (const uint4 *)k;
        const float4 *Q4 = (const float4 *)Qs;
        const int D4 = D / 4;
        for (int c8 = 0; c8 < D / 8; c8++) {
            const uint4 kv = __ldg(k8 + c8);
            const __nv_bfloat162 *kb = (const __nv_bfloat162 *)&kv;
            const float2 k01 = __bfloat1622float2(kb[0]), k23 = __bfloat1622float2(kb[1]);
            const float2 k45 = __bfloat1622float2(kb[2]), k67 = __bfloat1622float2(kb[3]);
#pragma unroll
            for (int r = 0; r < SC_RB; r++) {
                if (r < nr) {
                    const float4 qa = Q4[r * D4 + 2 * c8], qb = Q4[r * D4 + 2 * c8 + 1];
                    float x = acc[r];
                    x = fmaf(qa.x, k01.x, x);
                    x = fmaf(qa.y, k01.y, x);
                    x = fmaf(qa.z, k23.x, x);
                    x = fmaf(qa.w, k23.y, x);
                    x = fmaf(qb.x, k45.x, x);
                    x = fmaf(qb.y, k45.y, x);
                    x = fmaf(qb.z, k67.x, x);
                    x = fmaf(qb.w, k67.y, x);
                    acc[r] = x;
                }
            }
        }
        return;
    }
    const __nv_bfloat162 *k2 = (const __nv_bfloat162 *)k;
    for (int d = 0; d < D; d += 2) {
        const float2 kf = __bfloat1622float2(k2[d / 2]);
#pragma unroll
        for (int r = 0; r < SC_RB; r++) {
            if (r < nr) {
                acc[r] = fmaf(Qs[r * D + d], kf.x, acc[r]);
                acc[r] = fmaf(Qs[r * D + d + 1], kf.y, acc[r]);
            }
        }
    }
}

__device__ __forceinline__ void ml_merge(float &m, float &l, float m2, float l2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return; /* both empty */
    l = l * expf(m - M) + l2 * expf(m2 - M);
    m = M;
}

/* grid: x = work item (seq, r0), y = query head */
__global__ void sc_stats_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                                const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                                const int32_t *__restrict__ slots, int H, int n_kv, int D,
                                float scale, float2 *__restrict__ stats) {
    extern __shared__ float4 Qs_st4[]; /* 16-byte aligned for row_dots' float4 reads */
    float *Qs = (float *)Qs_st4;
    __shared__ float red_m[SC_RB][SC_THREADS / 32], red_l[SC_RB][SC_THREADS / 32];
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int r0 = work[2 * blockIdx.x + 1], h = blockIdx.y, kvh = h / (H / n_kv);
    const int nr = min(SC_RB, sd.n_rows - r0);
    load_rows(Qs, q, sd, r0, nr, h, H, D);
    __syncthreads();
    const bool cand = (sd.mode & LETHE_SCORES_CAND_DENOM) != 0;
    const int32_t lim0 = sd.n_keys - sd.n_rows + r0; /* last key visible to row r0 */
    const int32_t lo = cand ? sd.c0 : 0;
    const int32_t hi = cand ? min(sd.c1, lim0 + nr) : lim0 + nr;
    float m[SC_RB], l[SC_RB], acc[SC_RB];
#pragma unroll
    for (int r = 0; r < SC_RB; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int32_t e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const bf16 *k = kc + ((size_t)slots[sd.key_begin + e] * n_kv + kvh) * D;
        row_dots(Qs, k, D, nr, acc);
#pragma unroll
        for (int r = 0; r < SC_RB; r++) {
            if (r < nr && e <= lim0 + r) {
                const float s = acc[r] * scale;
                if (s > m[r]) {
                    l[r] = l[r] * expf(m[r] - s) + 1.0f;
                    m[r] = s;
                } else {
                    l[r] += expf(s - m[r]);
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < SC_RB; r++) {
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[r], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[r], o);
            ml_merge(m[r], l[r], m2, l2);
        }
        if (lane == 0) red_m[r][warp] = m[r], red_l[r][warp] = l[r];
    }
    __syncthreads();
    if (threadIdx.x < nr) {
        const int r = threadIdx.x;
        float mm = red_m[r][0], ll = red_l[r][0];
        for (int w = 1; w < SC_THREADS / 32; w++) ml_merge(mm, ll, red_m[r][w], red_l[r][w]);
        stats[sd.st_off + (int64_t)h * sd.n_rows + r0 + r] = make_float2(mm, ll);
    }
}

/* grid: x = work item (seq, j0), y = query head */
__global__ void sc_values_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                                 const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                                 const int32_t *__restrict__ slots, int H, int n_kv, int D,
                                 float scale, const float2 *__restrict__ stats,
                                 float *__restrict__ hv) {
    extern __shared__ float4 Qs_va4[]; /* 16-byte aligned for row_dots' float4 reads */
    float *Qs = (float *)Qs_va4;
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int32_t j = work[2 * blockIdx.x + 1] + threadIdx.x, nc = sd.c1 - sd.c0;
    const int h = blockIdx.y, kvh = h / (H / n_kv);
    const int kind = sd.mode & LETHE_SCORES_KIND_MASK;
    const bool row_max = (sd.mode & LETHE_SCORES_ROW_MAX) != 0; /* rows reduced by max (KVzip) */
    const bool valid = j < nc;
    const int32_t e = sd.c0 + j;
    const bf16 *k = valid ? kc + ((size_t)slots[sd.key_begin + e] * n_kv + kvh) * D : kc;
    float v = kind == LETHE_SCORES_LOGIT_MAX ? -INFINITY : 0.0f, acc[SC_RB];
    for (int r0 = 0; r0 < sd.n_rows; r0 += SC_RB) {
        const int nr = min(SC_RB, sd.n_rows - r0);
        const int32_t lim0 = sd.n_keys - sd.n_rows + r0;
        __syncthreads(); /* the previous rows' Qs are no longer read */
        load_rows(Qs, q, sd, r0, nr, h, H, D);
        __syncthreads();
        if (!valid || e > lim0 + nr - 1) continue; /* not visible to any row of the chunk */
        row_dots(Qs, k, D, nr, acc);
#pragma unroll
        for (int r = 0; r < SC_RB; r++) {
            if (r < nr && e <= lim0 + r) {
                const float s = acc[r] * scale;
                if (kind == LETHE_SCORES_LOGIT_MAX) {
                    v = s > v ? s : v;
                } else {
                    const float2 st = stats[sd.st_off + (int64_t)h * sd.n_rows + r0 + r];
                    if (st.x != -INFINITY) {
                        const float p = expf(s - st.x) / st.y;
                        v = row_max ? (p > v ? p : v) : v + p;
                    }
                }
            }
        }
    }
    if (valid)
        hv[sd.hv_off + (int64_t)h * nc + j] = kind == LETHE_SCORES_LOGIT_MAX || row_max ? v : v / (float)sd.n_rows;
}

/* grid: x = work item (seq, j0), y = group */
__global__ void sc_reduce_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                                 const float *__restrict__ hv, float *__restrict__ out, int H,
                                 int n_groups) {
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int32_t j = work[2 * blockIdx.x + 1] + threadIdx.x, nc = sd.c1 - sd.c0;
    if (j >= nc) return;
    const int g = blockIdx.y, per = H / n_groups;
    const int kind = sd.mode & LETHE_SCORES_KIND_MASK;
    const bool is_max = kind == LETHE_SCORES_LOGIT_MAX || kind == LETHE_SCORES_PROB_MAX;
    float acc = is_max ? -INFINITY : 0.0f;
    for (int h = g * per; h < (g + 1) * per; h++) {
        const float x = hv[sd.hv_off + (int64_t)h * nc + j];
        acc = is_max ? (x > acc ? x : acc) : acc + x;
    }
    out[sd.out_off + (int64_t)g * nc + j] = kind == LETHE_SCORES_PROB_MEAN ? acc / (float)per : acc;
}

/* ---- single scored row per sequence (decode: OmniKV's filter layers,
 * H2O's decode eviction) ---------------------------------------------------
 * The general kernels above give each (query head, 128 candidates) its own
 * block and re-read K once per query head; with one row per sequence the
 * stats pass is then one block per (sequence, head) walking the whole
 * context, which at 8 x 32K keys costs milliseconds per layer. Here:
 *  L. logits: block = (sequence, SC1_KEYS keys of the raw range, KV head):
 *     each thread owns one key and computes its raw score for every query
 *     head of the KV group (the same fmaf chain over d as row_dots, so the
 *     same raw values as the general path), its K row read once from DRAM
 *     (head_dim 64 / 128 with g <= 8: all of the row's 16-byte loads in
 *     flight at once, sc1_logits_d_kernel; other shapes: sc1_logits_kernel).
 *     Raw range [lo, hi) = the denominator keys (candidates with
 *     CAND_DENOM, else the whole row: its last key is the row itself, so
 *     every key is visible) or just the candidates (LOGIT_MAX). Output raw
 *     [n_heads, hi - lo] per sequence.
 *  S. stats (probability modes): block = (sequence, head): max, then the sum
 *     of expf(raw - max), over the raw range.
 *  V. values: a thread per (group, candidate) folds the group's heads in
 *     head order, as sc_values + sc_reduce do for one row.
 * K is read once per KV head instead of once per query head and pass.
 * head_dim up to LETHE_SCORES_HEAD_DIM_MAX (latent KV rows, 576 for MLA:
 * scored from the absorbed queries' latent-space logits). */
#define SC1_KEYS 256         /* keys (threads) per logits block */
#define SC1_STAT_THREADS 512

/* raw range [lo, hi) of a one-row sequence (see L. above): the whole row
 * with a whole-row denominator, else the candidates. S is sc_desc on the
 * device and lethe_score_seq on the host (same field names). */
template <typename S>
__host__ __device__ __forceinline__ void sc1_range(const S &sd, int32_t *lo, int32_t *hi) {
    const int kind = sd.mode & LETHE_SCORES_KIND_MASK;
    const bool whole = kind != LETHE_SCORES_LOGIT_MAX && !(sd.mode & LETHE_SCORES_CAND_DENOM);
    *lo = whole ? 0 : sd.c0;
    *hi = whole ? sd.n_keys : sd.c1;
}

/* grid: x = work item (seq, e0: offset into the raw range), y = KV head;
 * SC1_KEYS threads, one key each. The key's K row (head_dim bf16, 16-byte
 * aligned: head_dim % 8 == 0) is read 8 channels at a time; for each query
 * head of the group the thread runs the fmaf chain over d (row_dots' order),
 * so the row is fetched from DRAM once and re-read from L1 per head; the
 * group's queries come from shared memory as float4 broadcasts. */
__global__ void __launch_bounds__(SC1_KEYS)
sc1_logits_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                  const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                  const int32_t *__restrict__ slots, int H, int n_kv, int D, float scale,
                  float *__restrict__ raw) {
    extern __shared__ float4 Qs4[]; /* [g][D / 4] */
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int32_t e0 = work[2 * blockIdx.x + 1];
    const int kvh = blockIdx.y, g = H / n_kv;
    int32_t lo, hi;
    sc1_range(sd, &lo, &hi);
    const int32_t n_raw = hi - lo, nk = min(SC1_KEYS, n_raw - e0);
    float *Qs = (float *)Qs4;
    for (int idx = threadIdx.x; idx < g * D; idx += blockDim.x)
        Qs[idx] = __bfloat162float(q[((size_t)sd.q_row * H + kvh * g) * D + idx]);
    __syncthreads();
    const int t = threadIdx.x;
    if (t >= nk) return;
    const int32_t slot = slots[sd.key_begin + lo + e0 + t];
    const uint4 *k8 = (const uint4 *)(kc + ((size_t)slot * n_kv + kvh) * D);
    for (int h = 0; h < g; h++) {
        const float4 *qh = Qs4 + h * (D / 4);
        float acc = 0.0f;
        for (int c8 = 0; c8 < D / 8; c8++) {
            const uint4 kv = k8[c8];
            const __nv_bfloat162 *k2 = (const __nv_bfloat162 *)&kv;
            const float4 qa = qh[2 * c8], qb = qh[2 * c8 + 1];
            float2 kf = __bfloat1622float2(k2[0]);
            acc = fmaf(qa.x, kf.x, acc);
            acc = fmaf(qa.y, kf.y, acc);
            kf = __bfloat1622float2(k2[1]);
            acc = fmaf(qa.z, kf.x, acc);
            acc = fmaf(qa.w, kf.y, acc);
            kf = __bfloat1622float2(k2[2]);
            acc = fmaf(qb.x, kf.x, acc);
            acc = fmaf(qb.y, kf.y, acc);
            kf = __bfloat1622float2(k2[3]);
            acc = fmaf(qb.z, kf.x, acc);
            acc = fmaf(qb.w, kf.y, acc);
        }
        raw[sd.hv_off + (int64_t)(kvh * g + h) * n_raw + e0 + t] = acc * scale;
    }
}

/* sc1_logits_kernel for a compile-time head_dim D (64, 128) and KV group
 * size g <= G (4, 8): the key's row is D / 8 independent 16-byte streaming
 * loads issued back to back into registers (D / 2 registers at D = 128), so
 * a warp has 32 x D x 2 bytes in flight instead of 512; then one pass over
 * the row: each 8-channel chunk converted once, then the G heads' fmaf chains
 * advance in d order (row_dots' order per head: the same values as
 * sc1_logits_kernel). Shared memory: the group's queries [G][D] fp32, rows g..G-1
 * zero (their chains are computed and dropped: no guards in the loop). One
 * pass over all heads (not a loop over head blocks) keeps the registers at
 * the raw row: a loop lets the compiler hoist the conversions, D floats. */
template <int D, int G>
__global__ void __launch_bounds__(SC1_KEYS, 2)
sc1_logits_d_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                    const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                    const int32_t *__restrict__ slots, int H, int n_kv, float scale,
                    float *__restrict__ raw) {
    extern __shared__ float4 Qs4[]; /* [G][D / 4] */
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int32_t e0 = work[2 * blockIdx.x + 1];
    const int kvh = blockIdx.y, g = H / n_kv;
    int32_t lo, hi;
    sc1_range(sd, &lo, &hi);
    const int32_t n_raw = hi - lo, nk = min(SC1_KEYS, n_raw - e0);
    float *Qs = (float *)Qs4;
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x)
        Qs[idx] = idx < g * D ? __bfloat162float(q[((size_t)sd.q_row * H + kvh * g) * D + idx]) : 0.0f;
    __syncthreads();
    const int t = threadIdx.x;
    if (t >= nk) return;
    const int32_t slot = slots[sd.key_begin + lo + e0 + t];
    const uint4 *k8 = (const uint4 *)(kc + ((size_t)slot * n_kv + kvh) * D);
    uint4 kr[D / 8];
    /* __ldg (L1-allocating): a lane reads its own row, so each 32-byte
     * sector serves two consecutive 16-byte loads; the second hits L1 */
#pragma unroll
    for (int c8 = 0; c8 < D / 8; c8++) kr[c8] = __ldg(k8 + c8);
    float acc[G];
#pragma unroll
    for (int h = 0; h < G; h++) acc[h] = 0.0f;
#pragma unroll
    for (int c8 = 0; c8 < D / 8; c8++) {
        /* channels 8 c8 .. 8 c8 + 7 (bf16 -> fp32 is exact), once for all heads */
        const uint32_t kw[4] = {kr[c8].x, kr[c8].y, kr[c8].z, kr[c8].w};
        float kf[8];
#pragma unroll
        for (int p = 0; p < 4; p++)
            kf[2 * p] = __uint_as_float(kw[p] << 16), kf[2 * p + 1] = __uint_as_float(kw[p] & 0xffff0000u);
#pragma unroll
        for (int h = 0; h < G; h++) {
            const float4 qa = Qs4[h * (D / 4) + 2 * c8], qb = Qs4[h * (D / 4) + 2 * c8 + 1];
            float x = acc[h];
            x = fmaf(qa.x, kf[0], x);
            x = fmaf(qa.y, kf[1], x);
            x = fmaf(qa.z, kf[2], x);
            x = fmaf(qa.w, kf[3], x);
            x = fmaf(qb.x, kf[4], x);
            x = fmaf(qb.y, kf[5], x);
            x = fmaf(qb.z, kf[6], x);
            x = fmaf(qb.w, kf[7], x);
            acc[h] = x;
        }
    }
    float *o = raw + sd.hv_off + (int64_t)kvh * g * n_raw + e0 + t;
#pragma unroll
    for (int h = 0; h < G; h++)
        if (h < g) o[(int64_t)h * n_raw] = acc[h] * scale;
}

/* sc1_logits_kernel for latent KV (one KV head shared by G >= g query heads,
 * MLA: 20 heads over a 576-wide row): each thread streams its key's row in
 * 16-byte chunks (the next one in flight during the current one's math), and
 * every chunk, converted once, advances the g heads' fmaf chains in d order
 * (row_dots' order: the same values as sc1_logits_kernel), so the row is
 * read from memory once for all heads instead of once per head. Shared
 * memory: the queries [G][D] fp32, rows g..G-1 zero (computed and dropped). */
template <int G>
__global__ void __launch_bounds__(SC1_KEYS)
sc1_logits_lat_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                      const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                      const int32_t *__restrict__ slots, int H, int D, float scale,
                      float *__restrict__ raw) {
    extern __shared__ float4 Qs4[]; /* [G][D / 4] */
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int32_t e0 = work[2 * blockIdx.x + 1];
    int32_t lo, hi;
    sc1_range(sd, &lo, &hi);
    const int32_t n_raw = hi - lo, nk = min(SC1_KEYS, n_raw - e0);
    float *Qs = (float *)Qs4;
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x)
        Qs[idx] = idx < H * D ? __bfloat162float(q[(size_t)sd.q_row * H * D + idx]) : 0.0f;
    __syncthreads();
    const int t = threadIdx.x;
    if (t >= nk) return;
    const int32_t slot = slots[sd.key_begin + lo + e0 + t];
    const uint4 *k8 = (const uint4 *)(kc + (size_t)slot * D);
    const int nc = D / 8, d4 = D / 4;
    float acc[G];
#pragma unroll
    for (int h = 0; h < G; h++) acc[h] = 0.0f;
    uint4 cur = __ldg(k8);
    for (int c8 = 0; c8 < nc; c8++) {
        const uint4 nxt = c8 + 1 < nc ? __ldg(k8 + c8 + 1) : cur;
        const uint32_t kw[4] = {cur.x, cur.y, cur.z, cur.w};
        float kf[8];
#pragma unroll
        for (int p = 0; p < 4; p++)
            kf[2 * p] = __uint_as_float(kw[p] << 16), kf[2 * p + 1] = __uint_as_float(kw[p] & 0xffff0000u);
#pragma unroll
        for (int h = 0; h < G; h++) {
            const float4 qa = Qs4[h * d4 + 2 * c8], qb = Qs4[h * d4 + 2 * c8 + 1];
            float x = acc[h];
            x = fmaf(qa.x, kf[0], x);
            x = fmaf(qa.y, kf[1], x);
            x = fmaf(qa.z, kf[2], x);
            x = fmaf(qa.w, kf[3], x);
            x = fmaf(qb.x, kf[4], x);
            x = fmaf(qb.y, kf[5], x);
            x = fmaf(qb.z, kf[6], x);
            x = fmaf(qb.w, kf[7], x);
            acc[h] = x;
        }
        cur = nxt;
    }
    float *o = raw + sd.hv_off + e0 + t;
#pragma unroll
    for (int h = 0; h < G; h++)
        if (h < H) o[(int64_t)h * n_raw] = acc[h] * scale;
}

/* grid: x = sequence, y = query head; SC1_STAT_THREADS threads */
__global__ void __launch_bounds__(SC1_STAT_THREADS)
sc1_stats_kernel(const sc_desc *__restrict__ descs, const float *__restrict__ raw,
                 float2 *__restrict__ stats) {
    __shared__ float red[SC1_STAT_THREADS / 32];
    const sc_desc sd = descs[blockIdx.x];
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if ((sd.mode & LETHE_SCORES_KIND_MASK) == LETHE_SCORES_LOGIT_MAX || sd.c1 == sd.c0) return;
    int32_t lo, hi;
    sc1_range(sd, &lo, &hi);
    const int32_t n = hi - lo;
    const float *x = raw + sd.hv_off + (int64_t)h * n;
    float m = -INFINITY;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, x[i]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < SC1_STAT_THREADS / 32; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float l = 0.0f;
    if (m != -INFINITY)
        for (int32_t i = threadIdx.x; i < n; i += blockDim.x) l += expf(x[i] - m);
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    if (threadIdx.x == 0) {
        float tot = 0.0f;
        for (int w = 0; w < SC1_STAT_THREADS / 32; w++) tot += red[w];
        stats[sd.st_off + h] = make_float2(m, tot);
    }
}

/* grid: x = work item (seq, j0), y = group */
__global__ void sc1_values_kernel(const sc_desc *__restrict__ descs, const int32_t *__restrict__ work,
                                  const float *__restrict__ raw, const float2 *__restrict__ stats,
                                  float *__restrict__ out, int H, int n_groups) {
    const sc_desc sd = descs[work[2 * blockIdx.x]];
    const int32_t j = work[2 * blockIdx.x + 1] + threadIdx.x, nc = sd.c1 - sd.c0;
    if (j >= nc) return;
    int32_t lo, hi;
    sc1_range(sd, &lo, &hi);
    const int32_t n = hi - lo, col = sd.c0 + j - lo;
    const int g = blockIdx.y, per = H / n_groups;
    const int kind = sd.mode & LETHE_SCORES_KIND_MASK;
    const bool is_max = kind == LETHE_SCORES_LOGIT_MAX || kind == LETHE_SCORES_PROB_MAX;
    float acc = is_max ? -INFINITY : 0.0f;
    for (int h = g * per; h < (g + 1) * per; h++) {
        const float s = raw[sd.hv_off + (int64_t)h * n + col];
        float v = s;
        if (kind != LETHE_SCORES_LOGIT_MAX) {
            const float2 st = stats[sd.st_off + h];
            v = st.x != -INFINITY ? expf(s - st.x) / st.y : 0.0f;
        }
        acc = is_max ? (v > acc ? v : acc) : acc + v;
    }
    out[sd.out_off + (int64_t)g * nc + j] = kind == LETHE_SCORES_PROB_MEAN ? acc / (float)per : acc;
}

/* dynamic shared memory above the 48 KiB default needs a (cheap) per-kernel opt-in */
static void sc_smem_optin(const void *kernel, size_t smem) {
    if (smem > 48 * 1024)
        CU_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

/* The host side of one attn_scores call, shared by both paths: the
 * per-sequence descriptors and two work lists of (sequence, offset) pairs,
 * staged in one ring copy, and the split of the scratch. List 0 is the first
 * pass: general path, stats blocks of SC_RB scored rows (probability modes
 * only); single-row path, logits blocks of SC1_KEYS keys of the raw range.
 * List 1 is the values blocks of SC_THREADS candidates. */
typedef struct sc_plan {
    const int32_t *slots;      /* key_slots (device) */
    const sc_desc *desc;       /* [n_seqs] (device) */
    const int32_t *work[2];    /* [2 * n_items[i]] (device) */
    int32_t n_items[2];
    float *hv;                 /* per sequence [n_heads, n_cand] (general) or raw [n_heads, hi - lo] */
    float *out;                /* reduced output [n_out]: scratch, or a->out with out_on_backend */
    float2 *stats;             /* per sequence [n_heads, n_rows] (m, l), probability modes */
    int64_t n_out;
} sc_plan;

/* list-0 extent of a sequence with candidates: *len entries in blocks of
 * *step; *per_head: its floats per head in hv */
static void sc_first_pass(const lethe_score_seq *sq, bool single, int32_t *len, int32_t *step,
                          int32_t *per_head) {
    if (single) {
        int32_t lo, hi;
        sc1_range(*sq, &lo, &hi);
        *len = *per_head = hi - lo;
        *step = SC1_KEYS;
        return;
    }
    *len = (sq->mode & LETHE_SCORES_KIND_MASK) != LETHE_SCORES_LOGIT_MAX ? sq->n_rows : 0;
    *step = SC_RB;
    *per_head = sq->c1 - sq->c0;
}

/* Builds and stages the plan; false when no sequence has a candidate (the
 * call writes nothing). */
static bool sc_plan_build(cuda_ctx *c, const lethe_attn_scores_args *a, bool single, sc_plan *p) {
    const int H = a->n_heads;
    int32_t n0 = 0, n1 = 0, len, step, per_head;
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const lethe_score_seq *sq = &a->seqs[s];
        const int32_t nc = sq->c1 - sq->c0;
        if (nc == 0) continue;
        sc_first_pass(sq, single, &len, &step, &per_head);
        n0 += (len + step - 1) / step;
        n1 += (nc + SC_THREADS - 1) / SC_THREADS;
    }
    if (n1 == 0) return false;
    /* keys first: the descriptors below then take the ring's next bytes */
    p->slots = lethe_cuda_stage_idx(c, a->key_slots, (size_t)a->n_key_slots);
    const size_t desc_bytes = ((size_t)a->n_seqs * sizeof(sc_desc) + 255) & ~(size_t)255;
    const size_t work_bytes = (size_t)(n0 + n1) * 2 * sizeof(int32_t);
    void *hview;
    char *dbase = (char *)lethe_cuda_ring_alloc(c, desc_bytes + work_bytes, &hview);
    sc_desc *hd = (sc_desc *)hview;
    int32_t *hw0 = (int32_t *)((char *)hview + desc_bytes), *hw1 = hw0 + 2 * n0;
    int64_t n_hv = 0, n_st = 0, n_out = 0;
    int32_t k0 = 0, k1 = 0;
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const lethe_score_seq *sq = &a->seqs[s];
        const int32_t nc = sq->c1 - sq->c0;
        sc_desc d = {sq->q_row, sq->n_rows, sq->key_begin, sq->n_keys, sq->c0, sq->c1, sq->mode, 0,
                     n_hv, n_st, n_out};
        hd[s] = d;
        if (nc == 0) continue;
        sc_first_pass(sq, single, &len, &step, &per_head);
        n_hv += (int64_t)H * per_head;
        n_out += (int64_t)a->n_groups * nc;
        if ((sq->mode & LETHE_SCORES_KIND_MASK) != LETHE_SCORES_LOGIT_MAX) n_st += (int64_t)H * sq->n_rows;
        for (int32_t o = 0; o < len; o += step) hw0[2 * k0] = s, hw0[2 * k0 + 1] = o, k0++;
        for (int32_t j0 = 0; j0 < nc; j0 += SC_THREADS) hw1[2 * k1] = s, hw1[2 * k1 + 1] = j0, k1++;
    }
    LETHE_ASSERT(k0 == n0 && k1 == n1);
    LETHE_ASSERT((size_t)n_out == lethe_attn_scores_out_len(a->seqs, a->n_seqs, a->n_groups));
    CU_CHECK(cudaMemcpyAsync(dbase, hview, desc_bytes + work_bytes, cudaMemcpyHostToDevice, c->stream));
    p->desc = (const sc_desc *)dbase;
    p->work[0] = (const int32_t *)(dbase + desc_bytes);
    p->work[1] = p->work[0] + 2 * n0;
    p->n_items[0] = n0, p->n_items[1] = n1;

    /* scratch: hv [n_hv] | out [n_out] | stats [n_st] float2 (8-byte aligned: n_hv + n_out even) */
    const size_t n_f = (size_t)(n_hv + n_out + 1) & ~(size_t)1;
    size_t cap = c->scores_cap;
    lethe_cuda_reserve(c, (void **)&c->scores_d, &cap, (n_f + 2 * (size_t)n_st) * sizeof(float));
    c->scores_cap = cap;
    p->hv = c->scores_d;
    p->out = a->out_on_backend ? a->out : c->scores_d + n_hv;
    p->stats = (float2 *)(c->scores_d + n_f);
    p->n_out = n_out;
    return true;
}

/* attn_scores when every sequence scores one row (see above) */
static void attn_scores_single_rows(cuda_ctx *c, const lethe_attn_scores_args *a, const sc_plan *p) {
    const int H = a->n_heads, D = a->head_dim, n_kv = a->n_kv_heads, g = H / n_kv;
    const sc_desc *d_desc = p->desc;
    const int32_t *d_slots = p->slots, *d_l = p->work[0], *d_v = p->work[1];
    float *raw = p->hv;

    /* logits: head_dim 64 / 128 with KV groups up to 8 take the unrolled kernel
     * (queries padded to G = 4 or 8 heads); one KV head of a wide row (latent
     * KV) with up to 32 query heads the streaming one (padded to G = 8 .. 32
     * in steps of 8); other shapes the generic one */
    const bf16 *q = (const bf16 *)a->q, *kc = (const bf16 *)a->k_cache;
    const dim3 l_grid((unsigned)p->n_items[0], (unsigned)n_kv);
    const int GL = n_kv == 1 && D > 128 && g <= 32 ? (g + 7) / 8 * 8 : 0;
    const int G = (D == 64 || D == 128) && g <= 8 ? (g <= 4 ? 4 : 8) : GL;
    const size_t smem = (size_t)(G ? G : g) * D * sizeof(float);
    LETHE_ASSERT(smem <= c->smem_optin && "attn_scores: a KV group's queries do not fit in shared memory");
#define SC1_D_LAUNCH(DD, GG)                                                                        \
    do {                                                                                           \
        sc_smem_optin((const void *)sc1_logits_d_kernel<DD, GG>, smem);                            \
        sc1_logits_d_kernel<DD, GG><<<l_grid, SC1_KEYS, smem, c->stream>>>(                        \
            d_desc, d_l, q, kc, d_slots, H, n_kv, a->scale, raw);                                  \
    } while (0)
#define SC1_LAT_LAUNCH(GG)                                                                          \
    do {                                                                                           \
        sc_smem_optin((const void *)sc1_logits_lat_kernel<GG>, smem);                              \
        sc1_logits_lat_kernel<GG><<<l_grid, SC1_KEYS, smem, c->stream>>>(d_desc, d_l, q, kc,       \
                                                                         d_slots, H, D, a->scale,  \
                                                                         raw);                     \
    } while (0)
    if (GL == 8) SC1_LAT_LAUNCH(8);
    else if (GL == 16) SC1_LAT_LAUNCH(16);
    else if (GL == 24) SC1_LAT_LAUNCH(24);
    else if (GL == 32) SC1_LAT_LAUNCH(32);
    else if (D == 128 && G == 4) SC1_D_LAUNCH(128, 4);
    else if (D == 128 && G == 8) SC1_D_LAUNCH(128, 8);
    else if (D == 64 && G == 4) SC1_D_LAUNCH(64, 4);
    else if (D == 64 && G == 8) SC1_D_LAUNCH(64, 8);
    else {
        sc_smem_optin((const void *)sc1_logits_kernel, smem);
        sc1_logits_kernel<<<l_grid, SC1_KEYS, smem, c->stream>>>(d_desc, d_l, q, kc, d_slots, H, n_kv,
                                                                  D, a->scale, raw);
    }
#undef SC1_D_LAUNCH
#undef SC1_LAT_LAUNCH
    CU_LAUNCH_CHECK();
    sc1_stats_kernel<<<dim3((unsigned)a->n_seqs, (unsigned)H), SC1_STAT_THREADS, 0, c->stream>>>(
        d_desc, raw, p->stats);
    CU_LAUNCH_CHECK();
    sc1_values_kernel<<<dim3((unsigned)p->n_items[1], (unsigned)a->n_groups), SC_THREADS, 0, c->stream>>>(
        d_desc, d_v, raw, p->stats, p->out, H, a->n_groups);
    CU_LAUNCH_CHECK();
}

/* attn_scores, any number of scored rows (the three kernels at the top) */
static void attn_scores_general(cuda_ctx *c, const lethe_attn_scores_args *a, const sc_plan *p) {
    const int H = a->n_heads, D = a->head_dim;
    const sc_desc *d_desc = p->desc;
    const int32_t *d_slots = p->slots, *d_stat = p->work[0], *d_val = p->work[1];
    const size_t smem = (size_t)SC_RB * D * sizeof(float);
    const bf16 *q = (const bf16 *)a->q, *kc = (const bf16 *)a->k_cache;
    if (p->n_items[0] > 0) {
        sc_stats_kernel<<<dim3((unsigned)p->n_items[0], (unsigned)H), SC_THREADS, smem, c->stream>>>(
            d_desc, d_stat, q, kc, d_slots, H, a->n_kv_heads, D, a->scale, p->stats);
        CU_LAUNCH_CHECK();
    }
    sc_values_kernel<<<dim3((unsigned)p->n_items[1], (unsigned)H), SC_THREADS, smem, c->stream>>>(
        d_desc, d_val, q, kc, d_slots, H, a->n_kv_heads, D, a->scale, p->stats, p->hv);
    CU_LAUNCH_CHECK();
    sc_reduce_kernel<<<dim3((unsigned)p->n_items[1], (unsigned)a->n_groups), SC_THREADS, 0, c->stream>>>(
        d_desc, d_val, p->hv, p->out, H, a->n_groups);
    CU_LAUNCH_CHECK();
}

/* LETHE_SCORES_QMEAN: out [n_seqs, H, D] bf16 = the mean over each sequence's
 * rows (rows: [q_row, n_rows] per sequence); grid (sequence, head) */
__global__ void sc_qmean_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ q,
                                const int32_t *__restrict__ rows, int H, int D) {
    const int s = blockIdx.x, h = blockIdx.y;
    const int32_t r0 = rows[2 * s], n = rows[2 * s + 1];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int32_t r = 0; r < n; r++) acc += __bfloat162float(q[((size_t)(r0 + r) * H + h) * D + d]);
        out[((size_t)s * H + h) * D + d] = __float2bfloat16(acc / (float)n);
    }
}

extern "C" void lethe_cuda_attn_scores(lethe_backend *be, const lethe_attn_scores_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing && "graph capture: attn_scores stages its descriptors");
    lethe_check_attn_scores(a);
    if (a->n_seqs > 0 && (a->seqs[0].mode & LETHE_SCORES_QMEAN)) {
        /* mean queries into c->qmean_ws, then one row per sequence over all its keys */
        const int H = a->n_heads, D = a->head_dim;
        void *hv;
        int32_t *d_rows = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)a->n_seqs * 2 * sizeof(int32_t), &hv);
        int32_t *hr = (int32_t *)hv;
        lethe_score_seq *sq = (lethe_score_seq *)malloc((size_t)a->n_seqs * sizeof(*sq));
        LETHE_ASSERT(sq);
        for (int32_t s = 0; s < a->n_seqs; s++) {
            hr[2 * s] = a->seqs[s].q_row, hr[2 * s + 1] = a->seqs[s].n_rows;
            sq[s] = a->seqs[s];
            sq[s].q_row = s, sq[s].n_rows = 1, sq[s].mode &= ~LETHE_SCORES_QMEAN;
        }
        CU_CHECK(cudaMemcpyAsync(d_rows, hr, (size_t)a->n_seqs * 2 * sizeof(int32_t), cudaMemcpyHostToDevice,
                                 c->stream));
        lethe_cuda_reserve(c, &c->qmean_ws, &c->qmean_ws_cap, (size_t)a->n_seqs * H * D * sizeof(bf16));
        sc_qmean_kernel<<<dim3((unsigned)a->n_seqs, (unsigned)H), D < 128 ? D : 128, 0, c->stream>>>(
            (bf16 *)c->qmean_ws, (const bf16 *)a->q, d_rows, H, D);
        CU_LAUNCH_CHECK();
        lethe_attn_scores_args b = *a;
        b.q = c->qmean_ws, b.n_tokens = a->n_seqs, b.seqs = sq;
        lethe_cuda_attn_scores(be, &b);
        free(sq);
        return;
    }
    LETHE_ASSERT(a->head_dim >= 2 && a->head_dim % 2 == 0 && a->head_dim <= LETHE_SCORES_HEAD_DIM_MAX);
    /* sc1_logits reads K rows 8 channels (16 bytes) at a time */
    bool single = a->n_seqs > 0 && a->head_dim % 8 == 0;
    for (int32_t s = 0; s < a->n_seqs; s++) single &= a->seqs[s].n_rows == 1;
    sc_plan p;
    if (!sc_plan_build(c, a, single, &p)) return;
    if (single) attn_scores_single_rows(c, a, &p);
    else attn_scores_general(c, a, &p);
    if (a->out_on_backend) return; /* stays on the device (feeds topk): no sync */
    CU_CHECK(cudaMemcpyAsync(a->out, p.out, (size_t)p.n_out * sizeof(float), cudaMemcpyDeviceToHost,
                             c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
}

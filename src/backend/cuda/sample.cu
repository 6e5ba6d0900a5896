/* sample.cu - the sample op on the GPU: one block per logits row.
 *
 * The definition (penalties, greedy, fixed-point weights q, top-k, top-p,
 * min-p, integer draw in id order) is backend/sample.h; the CPU twin is
 * backend/cpu/sample.c. This kernel computes the same sets without sorting:
 *
 *   1. row -> f32 scratch l [V] (bf16 -> f32 is exact; -inf where the row's
 *      token mask clears the bit), penalties scattered
 *      (the entries of a row are distinct ids, so no two threads collide);
 *   2. block argmax of (key, -id) -> the greedy token and the max m;
 *   3. top-k: radix select on the 32-bit order key, 8 bits per pass (4
 *      passes, a 256-bin count histogram each), gives the key K_k of the
 *      k-th ranked token and its position r among the tokens with that key;
 *      the r-th such id in id order (block scan of per-thread counts over
 *      contiguous id chunks) closes the set: key > K_k, or key == K_k and
 *      id <= I_k;
 *   4. Q = sum of q over that set; top-p: the same radix select with a mass
 *      histogram next to the count one (u64 atomics: integer sums do not
 *      depend on order) finds the key group where the running mass in rank
 *      order reaches top_p * Q, then how many of the group's (equal) weights
 *      are needed, then that id;
 *   5. survivors (in top-k, in top-p, q >= min-p threshold): per-thread sums
 *      over contiguous id chunks, a block exclusive scan, and the thread whose
 *      range holds T = mulhi(bits, Qs) walks its chunk.
 * Everything the token depends on is integer or a deterministic IEEE op
 * (lethe_sample_q), so the result equals the CPU twin's for the same
 * logits. Weights are recomputed from l in each pass (double exp, ~30 FLOP)
 * instead of being stored: scratch stays at 4 bytes per logit.
 *
 * Cost per row, V = 128K: ~8-12 passes over 512 KB of f32 scratch by one
 * block of 512 threads. Not captured in CUDA graphs (host params, host
 * outputs): it runs right after the forward or its graph replay. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/args.h"

#include <string.h>

extern "C" {
#include "backend/sample.h"
}

#define SNT 512
#define SNWARP (SNT / 32)
#define FULL 0xffffffffu

struct sample_smem {
    unsigned long long red[SNWARP];
    unsigned int hc[256];
    unsigned long long hm[256];
    unsigned long long b0, b1, b2, b3; /* broadcasts */
};

__device__ static unsigned long long block_sum(unsigned long long v, sample_smem *sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(FULL, v, o);
    if (lane == 0) sm->red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < SNWARP ? sm->red[lane] : 0;
        for (int o = 16; o; o >>= 1) v += __shfl_down_sync(FULL, v, o);
        if (lane == 0) sm->b0 = v;
    }
    __syncthreads();
    unsigned long long r = sm->b0;
    __syncthreads();
    return r;
}

__device__ static unsigned long long block_max(unsigned long long v, sample_smem *sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) {
        unsigned long long y = __shfl_down_sync(FULL, v, o);
        v = y > v ? y : v;
    }
    if (lane == 0) sm->red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < SNWARP ? sm->red[lane] : 0;
        for (int o = 16; o; o >>= 1) {
            unsigned long long y = __shfl_down_sync(FULL, v, o);
            v = y > v ? y : v;
        }
        if (lane == 0) sm->b0 = v;
    }
    __syncthreads();
    unsigned long long r = sm->b0;
    __syncthreads();
    return r;
}

__device__ static double block_sum_f64(double v, sample_smem *sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(FULL, v, o);
    double *red = (double *)sm->red;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < SNWARP ? red[lane] : 0.0;
        for (int o = 16; o; o >>= 1) v += __shfl_down_sync(FULL, v, o);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    double r = red[0];
    __syncthreads();
    return r;
}

/* exclusive prefix of v over threads in thread order; *total = the sum */
__device__ static unsigned long long block_exscan(unsigned long long v, sample_smem *sm,
                                                  unsigned long long *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned long long y = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sm->red[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned long long w = lane < SNWARP ? sm->red[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            unsigned long long y = __shfl_up_sync(FULL, w, o);
            if (lane >= o) w += y;
        }
        if (lane < SNWARP) sm->red[lane] = w;
    }
    __syncthreads();
    unsigned long long before = warp ? sm->red[warp - 1] : 0;
    *total = sm->red[SNWARP - 1];
    __syncthreads();
    return before + x - v;
}

/* the row's sets: top-k (key > kk, or == kk and id <= ik) and top-p (same with kp, ip) */
struct sets {
    bool has_k, has_p;
    uint32_t kk, kp;
    int32_t ik, ip;
};

__device__ static inline bool in_k(const sets &s, uint32_t k, int32_t i) {
    return !s.has_k || k > s.kk || (k == s.kk && i <= s.ik);
}
__device__ static inline bool in_p(const sets &s, uint32_t k, int32_t i) {
    return !s.has_p || k > s.kp || (k == s.kp && i <= s.ip);
}

/* The n-th (1-based) id in id order with key == key_eq inside the top-k set. */
__device__ static int32_t nth_id(const float *l, int32_t V, const sets &s, uint32_t key_eq,
                                 unsigned long long n, sample_smem *sm) {
    const int32_t C = (V + SNT - 1) / SNT, c0 = min(V, (int32_t)threadIdx.x * C), c1 = min(V, c0 + C);
    unsigned long long cnt = 0, total;
    for (int32_t i = c0; i < c1; i++) {
        uint32_t k = lethe_sample_key(l[i]);
        cnt += k == key_eq && in_k(s, k, i);
    }
    const unsigned long long pre = block_exscan(cnt, sm, &total);
    if (pre < n && n <= pre + cnt) {
        unsigned long long c = pre;
        for (int32_t i = c0; i < c1; i++) {
            uint32_t k = lethe_sample_key(l[i]);
            if (k == key_eq && in_k(s, k, i) && ++c == n) {
                sm->b1 = (unsigned long long)i;
                break;
            }
        }
    }
    __syncthreads();
    int32_t id = (int32_t)sm->b1;
    __syncthreads();
    return id;
}

/* Radix select over the order key, high bits first, among the top-k set
 * (when s.has_k). Count mode (mass == false): the group holding the
 * need-th ranked element; *rest = its position inside the group (1-based).
 * Mass mode: the group where the running mass first reaches top_p of Q;
 * *rest = the mass ranked above the group, *cnt / *qt = the group's size and
 * (common) weight. Returns the group's key. */
__device__ static uint32_t radix_select(const float *l, int32_t V, const sets &s, bool mass,
                                        unsigned long long need, unsigned long long Q,
                                        unsigned long long pnum, float m, double inv_t,
                                        unsigned long long *rest, unsigned long long *cnt,
                                        unsigned long long *qt, sample_smem *sm) {
    uint32_t prefix = 0, mask = 0;
    unsigned long long acc = mass ? 0 : need;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += SNT) sm->hc[j] = 0, sm->hm[j] = 0;
        __syncthreads();
        for (int32_t i = threadIdx.x; i < V; i += SNT) {
            const uint32_t k = lethe_sample_key(l[i]);
            if ((k & mask) != prefix || !in_k(s, k, i)) continue;
            const int d = (k >> shift) & 255;
            atomicAdd(&sm->hc[d], 1u);
            if (mass) atomicAdd(&sm->hm[d], (unsigned long long)lethe_sample_q(l[i], m, inv_t));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d > 0; d--) { /* d == 0 is the last resort (never reached with a valid target) */
                if (!sm->hc[d]) continue;
                if (!mass) {
                    if (sm->hc[d] >= acc) break;
                    acc -= sm->hc[d];
                } else {
                    if (lethe_sample_ge_scaled(acc + sm->hm[d], Q, pnum)) break;
                    acc += sm->hm[d];
                }
            }
            sm->b0 = (unsigned long long)d;
            sm->b2 = acc;
            sm->b3 = sm->hc[d];
            sm->b1 = sm->hc[d] ? sm->hm[d] / sm->hc[d] : 0;
        }
        __syncthreads();
        const uint32_t d = (uint32_t)sm->b0;
        acc = sm->b2;
        *cnt = sm->b3;
        *qt = sm->b1;
        prefix |= d << shift;
        mask |= 0xffu << shift;
        __syncthreads();
    }
    *rest = acc;
    return prefix;
}

__global__ void __launch_bounds__(SNT)
sample_kernel(const bf16 *__restrict__ logits, int32_t V, const lethe_sample_row *rows,
              const int32_t *pen_ids, const int32_t *pen_counts, const uint32_t *__restrict__ mask,
              float *scratch, int32_t *out_tok, float *out_lp) {
    __shared__ sample_smem sm;
    const int32_t row = blockIdx.x;
    const lethe_sample_row p = rows[row];
    const bf16 *raw = logits + (size_t)row * V;
    float *l = scratch + (size_t)row * V;
    /* step 0, the token mask: a disallowed token's logit is -inf (q = 0) */
    const uint32_t *mk = p.mask_row ? mask + (size_t)(p.mask_row - 1) * (size_t)lethe_sample_mask_words(V) : NULL;
    for (int32_t i = threadIdx.x; i < V; i += SNT)
        l[i] = (mk && !lethe_sample_mask_allows(mk, i)) ? -INFINITY : __bfloat162float(raw[i]);
    __syncthreads();
    for (int32_t e = threadIdx.x; e < p.n_pen; e += SNT) {
        const int32_t id = pen_ids[p.pen_begin + e];
        l[id] = lethe_sample_penalise(l[id], pen_counts[p.pen_begin + e], &p);
    }
    __syncthreads();

    /* argmax: max of (key, ~id) packed, so the smallest id wins ties */
    unsigned long long best = 0;
    for (int32_t i = threadIdx.x; i < V; i += SNT) {
        unsigned long long pk = ((unsigned long long)lethe_sample_key(l[i]) << 32) | (uint32_t)(~(uint32_t)i);
        best = pk > best ? pk : best;
    }
    best = block_max(best, &sm);
    int32_t tok = (int32_t)(~(uint32_t)best);
    const float m = l[tok];

    if (!lethe_sample_is_greedy(&p) && isfinite(m)) {
        const double inv_t = __ddiv_rn(1.0, (double)p.temperature);
        const unsigned long long pnum = lethe_sample_pnum(p.top_p);
        const unsigned long long qmin = p.min_p > 0.0f ? lethe_sample_qmin(p.min_p) : 0;
        sets s;
        s.has_k = p.top_k > 0 && p.top_k < V;
        s.has_p = false;
        s.kk = s.kp = 0;
        s.ik = s.ip = V;
        unsigned long long rest, cnt, qt;
        if (s.has_k) {
            s.has_k = false; /* select over everything */
            s.kk = radix_select(l, V, s, false, (unsigned long long)p.top_k, 0, 0, m, inv_t, &rest,
                                &cnt, &qt, &sm);
            s.ik = nth_id(l, V, s, s.kk, rest, &sm);
            s.has_k = true;
        }
        unsigned long long part = 0;
        for (int32_t i = threadIdx.x; i < V; i += SNT)
            if (in_k(s, lethe_sample_key(l[i]), i)) part += lethe_sample_q(l[i], m, inv_t);
        const unsigned long long Q = block_sum(part, &sm);
        if (pnum < (1ull << 32)) {
            s.kp = radix_select(l, V, s, true, 0, Q, pnum, m, inv_t, &rest, &cnt, &qt, &sm);
            /* smallest j in [1, cnt] with rest + j * qt reaching the target */
            unsigned long long lo = 1, hi = cnt ? cnt : 1;
            while (lo < hi) {
                unsigned long long mid = lo + (hi - lo) / 2;
                if (lethe_sample_ge_scaled(rest + mid * qt, Q, pnum)) hi = mid;
                else lo = mid + 1;
            }
            s.ip = nth_id(l, V, s, s.kp, lo, &sm);
            s.has_p = true;
        }
        /* survivors in id order: contiguous chunks, exclusive scan, one walker */
        const int32_t C = (V + SNT - 1) / SNT, c0 = min(V, (int32_t)threadIdx.x * C), c1 = min(V, c0 + C);
        unsigned long long local = 0, qs;
        for (int32_t i = c0; i < c1; i++) {
            const uint32_t k = lethe_sample_key(l[i]);
            if (!in_k(s, k, i) || !in_p(s, k, i)) continue;
            const unsigned long long q = lethe_sample_q(l[i], m, inv_t);
            if (q >= qmin) local += q;
        }
        const unsigned long long pre = block_exscan(local, &sm, &qs);
        const unsigned long long T = lethe_sample_mulhi(lethe_sample_bits(p.seed, p.draw), qs);
        if (pre <= T && T < pre + local) {
            unsigned long long cum = pre;
            for (int32_t i = c0; i < c1; i++) {
                const uint32_t k = lethe_sample_key(l[i]);
                if (!in_k(s, k, i) || !in_p(s, k, i)) continue;
                const unsigned long long q = lethe_sample_q(l[i], m, inv_t);
                if (q >= qmin && (cum += q) > T) {
                    sm.b1 = (unsigned long long)i;
                    break;
                }
            }
        }
        __syncthreads();
        tok = (int32_t)sm.b1;
        __syncthreads();
    }

    if (out_lp) { /* raw log-softmax of the token (lethe_sampler_logprobs's formula) */
        unsigned long long mk = 0;
        for (int32_t i = threadIdx.x; i < V; i += SNT) {
            unsigned long long k = lethe_sample_key(__bfloat162float(raw[i]));
            mk = k > mk ? k : mk;
        }
        mk = block_max(mk, &sm);
        /* the float behind the max key (the key map is a bijection) */
        const uint32_t kx = (uint32_t)mk;
        const float mx = kx & 0x80000000u ? __uint_as_float(kx & 0x7fffffffu) : __uint_as_float(~kx);
        double sum = 0.0;
        for (int32_t i = threadIdx.x; i < V; i += SNT) sum += exp((double)__bfloat162float(raw[i]) - mx);
        sum = block_sum_f64(sum, &sm);
        if (threadIdx.x == 0) out_lp[row] = (float)((double)__bfloat162float(raw[tok]) - (mx + log(sum)));
    }
    if (threadIdx.x == 0) out_tok[row] = tok;
}

extern "C" void lethe_cuda_sample(lethe_backend *be, const lethe_sample_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing && "sample is not graph-capturable (host params and outputs)");
    lethe_check_sample(a);
    if (a->n == 0) return;
    const size_t V = (size_t)a->n_vocab, n = (size_t)a->n;
    /* f32 scratch for the penalised rows; grows on first use (never captured,
     * so growing it need not drop the decode graphs) */
    const size_t need = n * V * sizeof(float);
    if (need > c->sample_ws_cap) {
        CU_CHECK(cudaStreamSynchronize(c->stream));
        if (c->sample_ws) CU_CHECK(cudaFree(c->sample_ws));
        c->sample_ws_cap = need + need / 4;
        CU_CHECK(cudaMalloc(&c->sample_ws, c->sample_ws_cap));
    }
    void *h;
    lethe_sample_row *rows_d = (lethe_sample_row *)lethe_cuda_ring_alloc(c, n * sizeof(lethe_sample_row), &h);
    memcpy(h, a->rows, n * sizeof(lethe_sample_row));
    CU_CHECK(cudaMemcpyAsync(rows_d, h, n * sizeof(lethe_sample_row), cudaMemcpyHostToDevice, c->stream));
    uint32_t *mask_d = NULL;
    if (a->n_mask > 0) { /* the rows' token masks, uploaded with the other host params */
        const size_t nb = (size_t)a->n_mask * (size_t)lethe_sample_mask_words(a->n_vocab) * sizeof(uint32_t);
        mask_d = (uint32_t *)lethe_cuda_ring_alloc(c, nb, &h);
        memcpy(h, a->mask, nb);
        CU_CHECK(cudaMemcpyAsync(mask_d, h, nb, cudaMemcpyHostToDevice, c->stream));
    }
    int32_t *ids_d = NULL, *counts_d = NULL;
    if (a->n_pen > 0) {
        const size_t nb = (size_t)a->n_pen * sizeof(int32_t);
        ids_d = (int32_t *)lethe_cuda_ring_alloc(c, nb, &h);
        memcpy(h, a->pen_ids, nb);
        CU_CHECK(cudaMemcpyAsync(ids_d, h, nb, cudaMemcpyHostToDevice, c->stream));
        counts_d = (int32_t *)lethe_cuda_ring_alloc(c, nb, &h);
        memcpy(h, a->pen_counts, nb);
        CU_CHECK(cudaMemcpyAsync(counts_d, h, nb, cudaMemcpyHostToDevice, c->stream));
    }
    /* outputs: tokens then logprobs, one ring block, one copy back */
    void *out_h;
    char *out_d = (char *)lethe_cuda_ring_alloc(c, n * (sizeof(int32_t) + sizeof(float)), &out_h);
    int32_t *tok_d = (int32_t *)out_d;
    float *lp_d = a->logprobs ? (float *)(out_d + n * sizeof(int32_t)) : NULL;
    sample_kernel<<<a->n, SNT, 0, c->stream>>>((const bf16 *)a->logits, a->n_vocab, rows_d, ids_d,
                                               counts_d, mask_d, (float *)c->sample_ws, tok_d, lp_d);
    CU_LAUNCH_CHECK();
    CU_CHECK(cudaMemcpyAsync(out_h, out_d, n * (sizeof(int32_t) + sizeof(float)),
                             cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(a->tokens, out_h, n * sizeof(int32_t));
    if (a->logprobs) memcpy(a->logprobs, (char *)out_h + n * sizeof(int32_t), n * sizeof(float));
}

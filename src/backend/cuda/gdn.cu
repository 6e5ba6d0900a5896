/* gdn.cu - Gated DeltaNet on the CUDA backend (definitions: backend.h
 * lethe_gdn_args; the CPU twin is backend/cpu/gdn.c). Activations and
 * weights bf16, both states f32, all math f32.
 *
 * gdn_conv: one thread per (row, channel): the K-tap causal window reads the
 *   sequence's own rows or, before its first row, the conv state (zeros for
 *   a sequence at position 0); a second kernel then writes each sequence's
 *   new state (its last K - 1 inputs), after every read of the old one.
 * gdn_rule: one block per (sequence, v head, column tile of TC <= 128 state
 *   columns); thread c keeps state column S[:, c] (DK floats) in registers
 *   for the whole call. Rows go in the CPU's segments (cut at multiples of
 *   LETHE_GDN_CHUNK); a one-row segment takes the one-step update, a longer
 *   one is processed in sub-chunks of CH = 32 rows (cut at multiples of 32,
 *   so the arithmetic stays a function of absolute positions):
 *     shared: q, k of the sub-chunk (L2-normalised, q scaled) [L, DK], the
 *             decays cum, beta, M[i,j] = beta_i (k_i.k_j) e^(cum_i - cum_j)
 *             (j < i) and A[i,j] = (q_i.k_j) e^(cum_i - cum_j) (j <= i);
 *     column c: vn = (I + M)^-1 (beta (v - e^cum (K S)))   (forward substitution;
 *               the same delta corrections as the CPU's u - S^T w)
 *               out_i = e^cum_i q_i.S + sum_{j<=i} A[i,j] vn_j
 *               S = e^cum_last S + sum_j e^(cum_last - cum_j) k_j vn_j
 *   so the per-token recurrence is unrolled L rows at a time with one state
 *   read and write per call. Equal to the CPU up to rounding (different
 *   summation order), checked by tests/gpu/test_cuda_gdn.c. */
#include "backend/cuda/cuda_common.cuh"

#define GDN_CH 32      /* rows per sub-chunk */
#define GDN_TC_MAX 128 /* state columns per block */
#define GDN_K_MAX 16

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* sequence of row t: the largest s with q_begin[s] <= t (q_begin ascending) */
__device__ __forceinline__ int32_t seq_of(const int32_t *q_begin, int32_t n_seqs, int32_t t) {
    int32_t lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int32_t mid = (lo + hi + 1) / 2;
        if (q_begin[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    while (lo + 1 < n_seqs && q_begin[lo + 1] <= t) lo++; /* empty sequences before t */
    return lo;
}

/* ---- causal conv ---- */

__global__ void gdn_conv_kernel(bf16 *__restrict__ xc, const bf16 *__restrict__ x,
                                const bf16 *__restrict__ w, const float *__restrict__ state,
                                const int32_t *__restrict__ q_begin, const int32_t *__restrict__ slots,
                                const int32_t *__restrict__ pos, int32_t n_tokens, int32_t n_seqs,
                                int32_t C, int32_t K) {
    const size_t total = (size_t)n_tokens * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const int32_t t = (int32_t)(e / C), c = (int32_t)(e % C);
        const int32_t s = seq_of(q_begin, n_seqs, t), t0 = q_begin[s];
        const bool fresh = pos[t0] == 0;
        const float *st = state + (size_t)slots[s] * (K - 1) * C;
        float acc = 0.0f;
        for (int32_t j = 0; j < K; j++) {
            const int32_t u = t - t0 - (K - 1) + j; /* input index within the sequence */
            float in = u >= 0 ? __bfloat162float(x[(size_t)(t0 + u) * C + c])
                              : fresh ? 0.0f : st[(size_t)(K - 1 + u) * C + c];
            acc += __bfloat162float(w[(size_t)c * K + j]) * in;
        }
        xc[e] = __float2bfloat16(silu_f(acc));
    }
}

/* the new conv state: the last K - 1 inputs of each sequence (ascending i:
 * entry i may read old entry i + n > i, not yet overwritten) */
__global__ void gdn_conv_state_kernel(float *__restrict__ state, const bf16 *__restrict__ x,
                                      const int32_t *__restrict__ q_begin,
                                      const int32_t *__restrict__ slots,
                                      const int32_t *__restrict__ pos, int32_t n_seqs, int32_t C,
                                      int32_t K) {
    const size_t total = (size_t)n_seqs * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const int32_t s = (int32_t)(e / C), c = (int32_t)(e % C);
        const int32_t t0 = q_begin[s], n = q_begin[s + 1] - t0;
        if (n == 0) continue;
        const bool fresh = pos[t0] == 0;
        float *st = state + (size_t)slots[s] * (K - 1) * C;
        for (int32_t i = 0; i < K - 1; i++) {
            const int32_t u = n - (K - 1) + i;
            float v = u >= 0 ? __bfloat162float(x[(size_t)(t0 + u) * C + c])
                             : fresh ? 0.0f : st[(size_t)(K - 1 + u) * C + c];
            st[(size_t)i * C + c] = v;
        }
    }
}

extern "C" void lethe_cuda_gdn_conv(lethe_backend *be, const lethe_gdn_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(a->kernel >= 2 && a->kernel <= GDN_K_MAX && a->conv_dim > 0);
    if (a->n_tokens <= 0 || a->n_seqs <= 0) return;
    const int32_t *qb = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    const int32_t *sl = lethe_cuda_stage_idx(c, a->state_slots, (size_t)a->n_seqs);
    const int32_t *ps = lethe_cuda_stage_idx(c, a->pos, (size_t)a->n_tokens);
    const size_t total = (size_t)a->n_tokens * a->conv_dim;
    unsigned blocks = lethe_cuda_blocks(total, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    gdn_conv_kernel<<<blocks, 256, 0, c->stream>>>(
        (bf16 *)a->xc, (const bf16 *)a->x, (const bf16 *)a->conv_w, (const float *)a->conv_state,
        qb, sl, ps, a->n_tokens, a->n_seqs, a->conv_dim, a->kernel);
    CU_LAUNCH_CHECK();
    blocks = lethe_cuda_blocks((size_t)a->n_seqs * a->conv_dim, 256);
    gdn_conv_state_kernel<<<blocks, 256, 0, c->stream>>>((float *)a->conv_state, (const bf16 *)a->x,
                                                         qb, sl, ps, a->n_seqs, a->conv_dim,
                                                         a->kernel);
    CU_LAUNCH_CHECK();
}

/* ---- the delta rule ---- */

struct gdn_rule_params {
    const bf16 *xc, *a, *b, *A, *dt_bias;
    float *state;
    bf16 *out;
    const int32_t *q_begin, *slots, *pos;
    int32_t C, Hk, Hv, dv, tc;
};

/* rows [t, t + L) of v head h (k head kh) into shared: q, k normalised (q * dk^-1/2),
 * beta, cum (in-chunk cumulative log decay) */
template <int DK>
__device__ void load_rows(const gdn_rule_params &P, int32_t t, int32_t L, int32_t h, int32_t kh,
                          float *qs, float *ks, float *beta, float *cum) {
    const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    const float qscale = rsqrtf((float)DK);
    for (int32_t i = warp; i < L; i += n_warps) {
        const bf16 *row = P.xc + (size_t)(t + i) * P.C;
        float sq = 0.0f, sk = 0.0f;
        for (int32_t r = lane; r < DK; r += 32) {
            float q = __bfloat162float(row[(size_t)kh * DK + r]);
            float k = __bfloat162float(row[(size_t)P.Hk * DK + (size_t)kh * DK + r]);
            qs[i * DK + r] = q, ks[i * DK + r] = k;
            sq += q * q, sk += k * k;
        }
        for (int o = 16; o > 0; o >>= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
            sk += __shfl_xor_sync(0xffffffffu, sk, o);
        }
        const float rq = rsqrtf(sq + 1e-6f) * qscale, rk = rsqrtf(sk + 1e-6f);
        for (int32_t r = lane; r < DK; r += 32) qs[i * DK + r] *= rq, ks[i * DK + r] *= rk;
        if (lane == 0) {
            const size_t ab = (size_t)(t + i) * P.Hv + h;
            beta[i] = sigmoid_f(__bfloat162float(P.b[ab]));
            cum[i] = __bfloat162float(P.A[h]) *
                     softplus_f(__bfloat162float(P.a[ab]) + __bfloat162float(P.dt_bias[h]));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int32_t i = 1; i < L; i++) cum[i] += cum[i - 1];
    __syncthreads();
}

template <int DK>
__global__ void __launch_bounds__(GDN_TC_MAX) gdn_rule_kernel(const gdn_rule_params P) {
    extern __shared__ float sm[];
    float *qs = sm, *ks = qs + GDN_CH * DK, *M = ks + GDN_CH * DK, *Am = M + GDN_CH * GDN_CH;
    float *vns = Am + GDN_CH * GDN_CH, *beta = vns + GDN_CH * P.tc, *cum = beta + GDN_CH;
    const int32_t s = blockIdx.z, h = blockIdx.y, kh = h / (P.Hv / P.Hk);
    const int32_t col = blockIdx.x * P.tc + threadIdx.x;
    const bool active = threadIdx.x < P.tc && col < P.dv;
    const int32_t t0 = P.q_begin[s], n = P.q_begin[s + 1] - t0;
    if (n == 0) return;
    float *Sg = P.state + ((size_t)P.slots[s] * P.Hv + h) * DK * P.dv + col;
    const bool fresh = P.pos[t0] == 0;
    float S[DK];
#pragma unroll
    for (int r = 0; r < DK; r++) S[r] = active && !fresh ? Sg[(size_t)r * P.dv] : 0.0f;
    for (int32_t i = 0; i < n;) {
        const int32_t p = P.pos[t0 + i];
        const int32_t seg = min(n - i, LETHE_GDN_CHUNK - p % LETHE_GDN_CHUNK);
        const int32_t L = seg == 1 ? 1 : min(seg, GDN_CH - p % GDN_CH);
        const int32_t t = t0 + i;
        load_rows<DK>(P, t, L, h, kh, qs, ks, beta, cum);
        if (seg == 1) { /* one-step update: S = e^g S; S += k beta (v - S^T k); out = S^T q */
            if (active) {
                const float dec = expf(cum[0]);
                float kv = 0.0f;
#pragma unroll
                for (int r = 0; r < DK; r++) S[r] *= dec, kv += S[r] * ks[r];
                const float v = __bfloat162float(P.xc[(size_t)t * P.C + 2 * P.Hk * DK + (size_t)h * P.dv + col]);
                const float d = (v - kv) * beta[0];
                float o = 0.0f;
#pragma unroll
                for (int r = 0; r < DK; r++) S[r] += ks[r] * d, o += S[r] * qs[r];
                P.out[((size_t)t * P.Hv + h) * P.dv + col] = __float2bfloat16(o);
            }
            __syncthreads();
            i += 1;
            continue;
        }
        /* M (j < i) and A (j <= i) of the sub-chunk */
        for (int32_t e = threadIdx.x; e < L * L; e += blockDim.x) {
            const int32_t r = e / L, q = e % L;
            float kk = 0.0f, qk = 0.0f;
            if (q <= r) {
                for (int32_t d = 0; d < DK; d++) {
                    kk += ks[r * DK + d] * ks[q * DK + d];
                    qk += qs[r * DK + d] * ks[q * DK + d];
                }
            }
            const float dec = q <= r ? expf(cum[r] - cum[q]) : 0.0f;
            M[r * GDN_CH + q] = q < r ? beta[r] * kk * dec : 0.0f;
            Am[r * GDN_CH + q] = qk * dec;
        }
        __syncthreads();
        if (active) {
            float *vn = vns + threadIdx.x;
            for (int32_t r = 0; r < L; r++) {
                float ks_dot = 0.0f;
#pragma unroll
                for (int d = 0; d < DK; d++) ks_dot += ks[r * DK + d] * S[d];
                const float v =
                    __bfloat162float(P.xc[(size_t)(t + r) * P.C + 2 * P.Hk * DK + (size_t)h * P.dv + col]);
                float x = beta[r] * (v - expf(cum[r]) * ks_dot);
                for (int32_t j = 0; j < r; j++) x -= M[r * GDN_CH + j] * vn[j * P.tc];
                vn[r * P.tc] = x;
            }
            for (int32_t r = 0; r < L; r++) {
                float qs_dot = 0.0f;
#pragma unroll
                for (int d = 0; d < DK; d++) qs_dot += qs[r * DK + d] * S[d];
                float o = expf(cum[r]) * qs_dot;
                for (int32_t j = 0; j <= r; j++) o += Am[r * GDN_CH + j] * vn[j * P.tc];
                P.out[((size_t)(t + r) * P.Hv + h) * P.dv + col] = __float2bfloat16(o);
            }
            const float last = cum[L - 1], el = expf(last);
#pragma unroll
            for (int d = 0; d < DK; d++) S[d] *= el;
            for (int32_t j = 0; j < L; j++) {
                const float wj = expf(last - cum[j]) * vn[j * P.tc];
#pragma unroll
                for (int d = 0; d < DK; d++) S[d] += ks[j * DK + d] * wj;
            }
        }
        __syncthreads();
        i += L;
    }
    if (active) {
#pragma unroll
        for (int r = 0; r < DK; r++) Sg[(size_t)r * P.dv] = S[r];
    }
}

template <int DK>
static void launch_rule(cuda_ctx *c, const gdn_rule_params &P, int32_t n_seqs, int32_t Hv, int32_t dv) {
    const int32_t tc = P.tc, threads = (tc + 31) / 32 * 32;
    const size_t smem = sizeof(float) * ((size_t)2 * GDN_CH * DK + 2 * GDN_CH * GDN_CH +
                                         (size_t)GDN_CH * tc + 2 * GDN_CH);
    static bool attr_set = false; /* per instantiation; a host call, outside any stream */
    if (!attr_set) {
        CU_CHECK(cudaFuncSetAttribute(gdn_rule_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)c->smem_optin));
        attr_set = true;
    }
    LETHE_ASSERT(smem <= c->smem_optin);
    dim3 grid((unsigned)((dv + tc - 1) / tc), (unsigned)Hv, (unsigned)n_seqs);
    gdn_rule_kernel<DK><<<grid, threads, smem, c->stream>>>(P);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_gdn_rule(lethe_backend *be, const lethe_gdn_args *a) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(a->n_k_heads > 0 && a->n_v_heads % a->n_k_heads == 0 && a->v_dim > 0 &&
                 a->conv_dim == 2 * a->n_k_heads * a->k_dim + a->n_v_heads * a->v_dim);
    LETHE_ASSERT(a->n_seqs <= 65535 && a->n_v_heads <= 65535);
    if (a->n_tokens <= 0 || a->n_seqs <= 0) return;
    gdn_rule_params P;
    P.xc = (const bf16 *)a->xc, P.a = (const bf16 *)a->a, P.b = (const bf16 *)a->b;
    P.A = (const bf16 *)a->A, P.dt_bias = (const bf16 *)a->dt_bias;
    P.state = (float *)a->state, P.out = (bf16 *)a->out;
    P.q_begin = lethe_cuda_stage_idx(c, a->q_begin, (size_t)a->n_seqs + 1);
    P.slots = lethe_cuda_stage_idx(c, a->state_slots, (size_t)a->n_seqs);
    P.pos = lethe_cuda_stage_idx(c, a->pos, (size_t)a->n_tokens);
    P.C = a->conv_dim, P.Hk = a->n_k_heads, P.Hv = a->n_v_heads, P.dv = a->v_dim;
    P.tc = a->v_dim < GDN_TC_MAX ? a->v_dim : GDN_TC_MAX;
    switch (a->k_dim) {
    case 16: launch_rule<16>(c, P, a->n_seqs, a->n_v_heads, a->v_dim); break;
    case 32: launch_rule<32>(c, P, a->n_seqs, a->n_v_heads, a->v_dim); break;
    case 64: launch_rule<64>(c, P, a->n_seqs, a->n_v_heads, a->v_dim); break;
    case 128: launch_rule<128>(c, P, a->n_seqs, a->n_v_heads, a->v_dim); break;
    case 256: launch_rule<256>(c, P, a->n_seqs, a->n_v_heads, a->v_dim); break;
    default: LETHE_ASSERT(!"gdn_rule: k_dim must be 16, 32, 64, 128 or 256");
    }
}

/* ---- gated norm, sigmoid gate, state copy ---- */

__global__ void rmsnorm_gated_kernel(bf16 *out, const bf16 *x, const bf16 *__restrict__ z,
                                     const bf16 *__restrict__ w, int32_t dim, float eps) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const bf16 *xr = x + row * dim, *zr = z + row * dim;
    float ss = 0.0f;
    for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) {
        float f = __bfloat162float(xr[j]);
        ss += f * f;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    if (n_warps > 1) {
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        ss = lane < n_warps ? red[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    const float r = rsqrtf(ss / (float)dim + eps);
    __syncthreads(); /* every read of x before out (may alias) is written */
    for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) {
        const float v = __bfloat162float(w[j]) * (__bfloat162float(xr[j]) * r);
        out[row * dim + j] = __float2bfloat16(v * silu_f(__bfloat162float(zr[j])));
    }
}

extern "C" void lethe_cuda_rmsnorm_gated(lethe_backend *be, void *out, const void *x, const void *z,
                                         const void *w, int32_t n_rows, int32_t dim, float eps) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (n_rows <= 0) return;
    int threads = (dim + 31) / 32 * 32;
    if (threads > 1024) threads = 1024;
    rmsnorm_gated_kernel<<<n_rows, threads, 0, c->stream>>>((bf16 *)out, (const bf16 *)x,
                                                           (const bf16 *)z, (const bf16 *)w, dim, eps);
    CU_LAUNCH_CHECK();
}

__global__ void sigmoid_mul_kernel(bf16 *__restrict__ x, const bf16 *__restrict__ g, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(__bfloat162float(x[i]) * sigmoid_f(__bfloat162float(g[i])));
}

extern "C" void lethe_cuda_sigmoid_mul(lethe_backend *be, void *x, const void *g, size_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (!n) return;
    unsigned blocks = lethe_cuda_blocks(n, 256);
    if (blocks > (unsigned)c->n_sms * 8) blocks = (unsigned)c->n_sms * 8;
    sigmoid_mul_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)x, (const bf16 *)g, n);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_state_copy(lethe_backend *be, void *buf, size_t row_bytes, int32_t dst,
                                      int32_t src) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (dst == src) return;
    CU_CHECK(cudaMemcpyAsync((char *)buf + (size_t)dst * row_bytes,
                             (const char *)buf + (size_t)src * row_bytes, row_bytes,
                             cudaMemcpyDeviceToDevice, c->stream));
}

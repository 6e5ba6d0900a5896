/* elementwise.cu - row copies, pointwise ops and casts of the CUDA backend.
 *
 *   embed       x[i, :] = table[tokens[i], :]         table [n_vocab, dim] bf16
 *   gather_rows dst[i, :] = src[idx[i], :]            (in place allowed, like memmove row by row)
 *   gather_sum  out[i, :] += scale * sum_k src[idx[i K + k], :]   (DeltaKV's father means)
 *   add         x += y                                 (residual, fp32 add, bf16 store)
 *   add_bias    y[i, :] += b
 *   swiglu      out = silu(gate) * up                  (fp32 math)
 *   kv_store    k_cache[slots[i], :] = k[i, :], same for v   caches [n_slots, kv_dim]
 *   casts       bf16 <-> f32 for host transfers and weight upload
 *
 * Row kernels move 16-byte vectors (8 bf16) when the row length allows it,
 * else single elements. Host index arrays are staged by lethe_cuda_stage_idx. */
#include "backend/cuda/cuda_common.cuh"

/* ---- row copies -------------------------------------------------------- */

/* dst row i <- src row idx[i]; rows of `dim` bf16; grid-stride over n*vec */
template <int VEC>
__global__ void gather_rows_kernel(bf16 *__restrict__ dst, const bf16 *__restrict__ src,
                                   const int32_t *__restrict__ idx, int32_t n, int32_t dim) {
    const int32_t per_row = dim / VEC;
    const size_t total = (size_t)n * per_row;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
         t += (size_t)gridDim.x * blockDim.x) {
        int32_t i = (int32_t)(t / per_row), j = (int32_t)(t % per_row);
        size_t s = (size_t)idx[i] * dim + (size_t)j * VEC, d = (size_t)i * dim + (size_t)j * VEC;
        if (VEC == 8)
            *(uint4 *)(dst + d) = *(const uint4 *)(src + s);
        else
            dst[d] = src[s];
    }
}

/* in-place / overlapping gather: rows in order within one block, like the
 * CPU's row-by-row memmove (each row read fully before it is written) */
__global__ void gather_rows_seq_kernel(bf16 *dst, const bf16 *src, const int32_t *idx, int32_t n,
                                       int32_t dim) {
    extern __shared__ bf16 row[];
    for (int32_t i = 0; i < n; i++) {
        const bf16 *s = src + (size_t)idx[i] * dim;
        for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) row[j] = s[j];
        __syncthreads();
        for (int32_t j = threadIdx.x; j < dim; j += blockDim.x) dst[(size_t)i * dim + j] = row[j];
        __syncthreads();
    }
}

static void launch_gather(cuda_ctx *c, bf16 *dst, const bf16 *src, const int32_t *d_idx, int32_t n,
                          int32_t dim) {
    if (n <= 0) return;
    bool vec = dim % 8 == 0 && ((uintptr_t)dst % 16 == 0) && ((uintptr_t)src % 16 == 0);
    size_t work = (size_t)n * (vec ? dim / 8 : dim);
    unsigned blocks = lethe_cuda_blocks(work, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    if (vec)
        gather_rows_kernel<8><<<blocks, 256, 0, c->stream>>>(dst, src, d_idx, n, dim);
    else
        gather_rows_kernel<1><<<blocks, 256, 0, c->stream>>>(dst, src, d_idx, n, dim);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_embed(lethe_backend *be, void *x, const void *table,
                                 const int32_t *tokens, int32_t n, int32_t dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    const int32_t *d_tok = lethe_cuda_stage_idx(c, tokens, (size_t)n);
    launch_gather(c, (bf16 *)x, (const bf16 *)table, d_tok, n, dim);
}

extern "C" void lethe_cuda_gather_rows(lethe_backend *be, void *dst, const void *src,
                                       const int32_t *idx, int32_t n, int32_t dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (n <= 0) return;
    const int32_t *d_idx = lethe_cuda_stage_idx(c, idx, (size_t)n);
    /* the rows read span src rows [0, max idx]; overlapping dst means in place */
    int32_t max_idx = 0;
    for (int32_t i = 0; i < n; i++) max_idx = idx[i] > max_idx ? idx[i] : max_idx;
    const char *s0 = (const char *)src, *d0 = (const char *)dst;
    bool overlap = d0 < s0 + ((size_t)max_idx + 1) * dim * sizeof(bf16) &&
                   s0 < d0 + (size_t)n * dim * sizeof(bf16);
    if (overlap) {
        gather_rows_seq_kernel<<<1, 256, (size_t)dim * sizeof(bf16), c->stream>>>(
            (bf16 *)dst, (const bf16 *)src, d_idx, n, dim);
        CU_LAUNCH_CHECK();
    } else {
        launch_gather(c, (bf16 *)dst, (const bf16 *)src, d_idx, n, dim);
    }
}

/* out[i, :] += scale * sum_k src[idx[i n_idx + k], :]: one thread per output
 * element, the n_idx rows summed in f32 in index order (as the CPU twin),
 * one bf16 rounding of out + scale * sum */
__global__ void gather_sum_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ src,
                                  const int32_t *__restrict__ idx, int32_t n, int32_t n_idx,
                                  int32_t dim, float scale) {
    const size_t total = (size_t)n * dim;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
         t += (size_t)gridDim.x * blockDim.x) {
        const int32_t i = (int32_t)(t / dim), j = (int32_t)(t % dim);
        float acc = 0.0f;
        for (int32_t k = 0; k < n_idx; k++)
            acc += __bfloat162float(src[(size_t)idx[(size_t)i * n_idx + k] * dim + j]);
        out[t] = __float2bfloat16(__bfloat162float(out[t]) + scale * acc);
    }
}

extern "C" void lethe_cuda_gather_sum(lethe_backend *be, void *out, const void *src,
                                      const int32_t *idx, int32_t n, int32_t n_idx, int32_t dim,
                                      float scale) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (n <= 0 || n_idx <= 0) return;
    const int32_t *d_idx = lethe_cuda_stage_idx(c, idx, (size_t)n * n_idx);
    unsigned blocks = lethe_cuda_blocks((size_t)n * dim, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    gather_sum_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)out, (const bf16 *)src, d_idx, n, n_idx, dim,
                                                     scale);
    CU_LAUNCH_CHECK();
}

/* ---- pointwise --------------------------------------------------------- */

__global__ void add_kernel(bf16 *__restrict__ x, const bf16 *__restrict__ y, size_t n) {
    size_t n2 = n / 2;
    __nv_bfloat162 *x2 = (__nv_bfloat162 *)x;
    const __nv_bfloat162 *y2 = (const __nv_bfloat162 *)y;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n2;
         i += (size_t)gridDim.x * blockDim.x) {
        float2 a = __bfloat1622float2(x2[i]), b = __bfloat1622float2(y2[i]);
        x2[i] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
    }
    if ((n & 1) && blockIdx.x == 0 && threadIdx.x == 0)
        x[n - 1] = __float2bfloat16(__bfloat162float(x[n - 1]) + __bfloat162float(y[n - 1]));
}

extern "C" void lethe_cuda_add(lethe_backend *be, void *x, const void *y, size_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (!n) return;
    LETHE_ASSERT((uintptr_t)x % 4 == 0 && (uintptr_t)y % 4 == 0);
    unsigned blocks = lethe_cuda_blocks(n / 2 + 1, 256);
    if (blocks > (unsigned)c->n_sms * 8) blocks = (unsigned)c->n_sms * 8;
    add_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)x, (const bf16 *)y, n);
    CU_LAUNCH_CHECK();
}

__global__ void add_bias_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ b, int32_t n,
                                int32_t dim) {
    size_t total = (size_t)n * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(__bfloat162float(y[i]) + __bfloat162float(b[i % dim]));
}

extern "C" void lethe_cuda_add_bias(lethe_backend *be, void *y, const void *b, int32_t n,
                                    int32_t dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (n <= 0) return;
    unsigned blocks = lethe_cuda_blocks((size_t)n * dim, 256);
    if (blocks > (unsigned)c->n_sms * 8) blocks = (unsigned)c->n_sms * 8;
    add_bias_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)y, (const bf16 *)b, n, dim);
    CU_LAUNCH_CHECK();
}

__global__ void swiglu_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ gate,
                              const bf16 *__restrict__ up, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = __bfloat162float(gate[i]);
        out[i] = __float2bfloat16(g / (1.0f + expf(-g)) * __bfloat162float(up[i]));
    }
}

extern "C" void lethe_cuda_swiglu(lethe_backend *be, void *out, const void *gate, const void *up,
                                  size_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (!n) return;
    unsigned blocks = lethe_cuda_blocks(n, 256);
    if (blocks > (unsigned)c->n_sms * 8) blocks = (unsigned)c->n_sms * 8;
    swiglu_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)out, (const bf16 *)gate, (const bf16 *)up,
                                                  n);
    CU_LAUNCH_CHECK();
}

/* ---- KV store ---------------------------------------------------------- */

template <int VEC>
__global__ void kv_store_kernel(bf16 *__restrict__ kc, bf16 *__restrict__ vc,
                                const bf16 *__restrict__ k, const bf16 *__restrict__ v,
                                const int32_t *__restrict__ slots, int32_t n, int32_t kv_dim) {
    const int32_t per_row = kv_dim / VEC;
    const size_t total = (size_t)n * per_row;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
         t += (size_t)gridDim.x * blockDim.x) {
        int32_t i = (int32_t)(t / per_row), j = (int32_t)(t % per_row);
        size_t d = (size_t)slots[i] * kv_dim + (size_t)j * VEC, s = (size_t)i * kv_dim + (size_t)j * VEC;
        if (VEC == 8) {
            *(uint4 *)(kc + d) = *(const uint4 *)(k + s);
            *(uint4 *)(vc + d) = *(const uint4 *)(v + s);
        } else {
            kc[d] = k[s];
            vc[d] = v[s];
        }
    }
}

extern "C" void lethe_cuda_kv_store(lethe_backend *be, void *k_cache, void *v_cache, const void *k,
                                    const void *v, const int32_t *slots, int32_t n,
                                    int32_t kv_dim) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (n <= 0) return;
    const int32_t *d_slots = lethe_cuda_stage_idx(c, slots, (size_t)n);
    bool vec = kv_dim % 8 == 0 && (uintptr_t)k % 16 == 0 && (uintptr_t)v % 16 == 0 &&
               (uintptr_t)k_cache % 16 == 0 && (uintptr_t)v_cache % 16 == 0;
    size_t work = (size_t)n * (vec ? kv_dim / 8 : kv_dim);
    unsigned blocks = lethe_cuda_blocks(work, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    if (vec)
        kv_store_kernel<8><<<blocks, 256, 0, c->stream>>>((bf16 *)k_cache, (bf16 *)v_cache,
                                                          (const bf16 *)k, (const bf16 *)v, d_slots,
                                                          n, kv_dim);
    else
        kv_store_kernel<1><<<blocks, 256, 0, c->stream>>>((bf16 *)k_cache, (bf16 *)v_cache,
                                                          (const bf16 *)k, (const bf16 *)v, d_slots,
                                                          n, kv_dim);
    CU_LAUNCH_CHECK();
}

/* ---- casts ------------------------------------------------------------- */

__global__ void bf16_to_f32_kernel(float *__restrict__ dst, const bf16 *__restrict__ src,
                                   size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

__global__ void f32_to_bf16_kernel(bf16 *__restrict__ dst, const float *__restrict__ src,
                                   size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

extern "C" void lethe_cuda_bf16_to_f32(cuda_ctx *c, float *dst, const void *src, size_t n) {
    if (!n) return;
    unsigned blocks = lethe_cuda_blocks(n, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    bf16_to_f32_kernel<<<blocks, 256, 0, c->stream>>>(dst, (const bf16 *)src, n);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_f32_to_bf16(cuda_ctx *c, void *dst, const float *src, size_t n) {
    if (!n) return;
    unsigned blocks = lethe_cuda_blocks(n, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    f32_to_bf16_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)dst, src, n);
    CU_LAUNCH_CHECK();
}

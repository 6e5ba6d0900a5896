/* transfer.cu - rows of device buffers to and from the host (backend.h
 * rows_to_host / rows_from_host; CPU twin backend/cpu/transfer.c), for the
 * host KV tier: demoting a prefix-cache block gathers its slots' rows of one
 * payload plane into a contiguous device staging buffer (one kernel), then
 * one copy to pinned host memory, then a host copy into the caller's buffer;
 * restoring runs the same steps backwards and scatters. Rows are raw bytes
 * (any plane: K, V, latents), moved 16 bytes at a time when row_bytes allows.
 * Synchronous: the caller's host buffer may be reused when the call returns. */
#include "backend/cuda/cuda_common.cuh"

#include <string.h>

template <typename T>
__global__ void gather_rows_kernel(T *__restrict__ dst, const T *__restrict__ src,
                                   const int32_t *__restrict__ rows, size_t row_elems, int32_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n * row_elems;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / row_elems, e = i % row_elems;
        dst[i] = src[(size_t)rows[r] * row_elems + e];
    }
}

template <typename T>
__global__ void scatter_rows_kernel(T *__restrict__ dst, const T *__restrict__ src,
                                    const int32_t *__restrict__ rows, size_t row_elems, int32_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n * row_elems;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / row_elems, e = i % row_elems;
        dst[(size_t)rows[r] * row_elems + e] = src[i];
    }
}

/* the staging pair (device, pinned host) large enough for `bytes` */
static void stage_reserve(cuda_ctx *c, size_t bytes) {
    lethe_cuda_reserve(c, &c->xfer_d, &c->xfer_d_cap, bytes);
    if (bytes > c->xfer_h_cap) {
        CU_CHECK(cudaStreamSynchronize(c->stream));
        if (c->xfer_h) CU_CHECK(cudaFreeHost(c->xfer_h));
        c->xfer_h_cap = bytes + bytes / 4 + 4096;
        CU_CHECK(cudaMallocHost(&c->xfer_h, c->xfer_h_cap));
    }
}

static void launch(cuda_ctx *c, bool gather, void *dst, const void *src, const int32_t *d_rows,
                   size_t row_bytes, int32_t n) {
    const bool wide = row_bytes % 16 == 0 && ((uintptr_t)dst | (uintptr_t)src) % 16 == 0;
    const size_t unit = wide ? 16 : 1, elems = row_bytes / unit;
    unsigned blocks = lethe_cuda_blocks((size_t)n * elems, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    if (wide && gather)
        gather_rows_kernel<uint4><<<blocks, 256, 0, c->stream>>>((uint4 *)dst, (const uint4 *)src, d_rows, elems, n);
    else if (wide)
        scatter_rows_kernel<uint4><<<blocks, 256, 0, c->stream>>>((uint4 *)dst, (const uint4 *)src, d_rows, elems, n);
    else if (gather)
        gather_rows_kernel<uint8_t><<<blocks, 256, 0, c->stream>>>((uint8_t *)dst, (const uint8_t *)src, d_rows, elems, n);
    else
        scatter_rows_kernel<uint8_t><<<blocks, 256, 0, c->stream>>>((uint8_t *)dst, (const uint8_t *)src, d_rows, elems, n);
    CU_LAUNCH_CHECK();
}

extern "C" void lethe_cuda_rows_to_host(lethe_backend *be, void *host, const void *buf, size_t row_bytes,
                                        const int32_t *rows, int32_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && !c->capturing);
    const size_t bytes = (size_t)n * row_bytes;
    if (!bytes) return;
    stage_reserve(c, bytes);
    const int32_t *d_rows = lethe_cuda_stage_idx(c, rows, (size_t)n);
    launch(c, true, c->xfer_d, buf, d_rows, row_bytes, n);
    CU_CHECK(cudaMemcpyAsync(c->xfer_h, c->xfer_d, bytes, cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    memcpy(host, c->xfer_h, bytes);
}

extern "C" void lethe_cuda_rows_from_host(lethe_backend *be, void *buf, size_t row_bytes,
                                          const int32_t *rows, int32_t n, const void *host) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && !c->capturing);
    const size_t bytes = (size_t)n * row_bytes;
    if (!bytes) return;
    stage_reserve(c, bytes);
    memcpy(c->xfer_h, host, bytes);
    CU_CHECK(cudaMemcpyAsync(c->xfer_d, c->xfer_h, bytes, cudaMemcpyHostToDevice, c->stream));
    const int32_t *d_rows = lethe_cuda_stage_idx(c, rows, (size_t)n);
    launch(c, false, buf, c->xfer_d, d_rows, row_bytes, n);
    CU_CHECK(cudaStreamSynchronize(c->stream));
}

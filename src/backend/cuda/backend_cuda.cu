/* backend_cuda.cu - the CUDA backend: ops table, device memory, host
 * transfers, index staging and CUDA graphs of decode steps.
 *
 * Types: weights, activations and KV are bf16 on the device; weight_upload
 * converts f32 -> bf16 (round to nearest even), act_to_host / logits_to_host
 * convert back to f32. Every op is enqueued on the backend's one stream.
 *
 * Memory: alloc/release are cudaMalloc/cudaFree (init time). free_memory is
 * cudaMemGetInfo's free bytes, which the engine multiplies by
 * --gpu-memory-utilization after weights and workspaces are allocated.
 *
 * Index arrays: an op's int32 index argument is a host array (copied
 * through the eager staging ring, or found among the pre-staged step arrays)
 * or int32 device memory that an op wrote (topk, select_expand), which
 * lethe_cuda_stage_idx recognizes (cudaPointerGetAttributes) and hands to the
 * kernel as it is: a selection built on the device never visits the host.
 *
 * Graphs: graph_begin/graph_end capture every op of one forward step
 * (cuBLAS included: it gets a fixed workspace so it never allocates), the
 * replay needs no allocation and no host sync until the logits copy at the
 * end. Buffers a captured step uses (staged arrays, attention workspace,
 * f32 scratch) only grow outside capture; growth drops the graphs, since
 * they hold the old addresses. */
#include "backend/cuda/cuda_common.cuh"

#include <cuda_profiler_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "core/env.h"
#include "core/log.h"
}

extern "C" [[noreturn]] void lethe_cuda_fatal_(const char *what, const char *msg, const char *file,
                                            int line) {
    fprintf(stderr, "%s:%d: CUDA error in %s: %s\n", file, line, what, msg);
    abort();
}

#define RING_BYTES ((size_t)64 << 20)
#define CUBLAS_WS_BYTES ((size_t)32 << 20)

/* ---- staging ---------------------------------------------------------- */

void *lethe_cuda_ring_alloc(cuda_ctx *c, size_t n_bytes, void **host_view) {
    LETHE_ASSERT(!c->capturing);
    size_t need = (n_bytes + 255) & ~(size_t)255;
    if (need > c->ring_cap) {
        /* one request larger than the ring: grow it (rare, e.g. huge prefill) */
        CU_CHECK(cudaStreamSynchronize(c->stream));
        CU_CHECK(cudaFreeHost(c->ring_h));
        CU_CHECK(cudaFree(c->ring_d));
        c->ring_cap = need * 2;
        CU_CHECK(cudaMallocHost((void **)&c->ring_h, c->ring_cap));
        CU_CHECK(cudaMalloc((void **)&c->ring_d, c->ring_cap));
        c->ring_off = 0;
        c->ring_gen++;
    }
    if (c->ring_off + need > c->ring_cap) {
        /* wrap: earlier copies out of the pinned ring must have completed */
        CU_CHECK(cudaStreamSynchronize(c->stream));
        c->ring_off = 0;
        c->ring_gen++;
    }
    size_t off = c->ring_off;
    c->ring_off += need;
    *host_view = c->ring_h + off;
    return c->ring_d + off;
}

/* true when p is memory a kernel reads in place: device memory (ops->alloc,
 * e.g. a topk / select_expand output) or managed memory. A plain host
 * pointer (malloc, stack) is cudaMemoryTypeUnregistered with cudaSuccess; an
 * error return (older runtimes did that for unregistered host memory) also
 * means host, and is cleared so the next CU_LAUNCH_CHECK does not see it.
 * Pinned host memory (cudaMemoryTypeHost) is staged like any host array.
 * A pure address query, so legal while a graph is captured; the capturing
 * thread still switches to relaxed capture mode around it, so that a driver
 * classing it as "potentially unsafe" cannot invalidate the capture. */
static bool is_device_ptr(const cuda_ctx *c, const void *p) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (c->capturing) CU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    cudaPointerAttributes at;
    const cudaError_t e = cudaPointerGetAttributes(&at, p);
    if (c->capturing) CU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode)); /* restores */
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
}

const int32_t *lethe_cuda_stage_idx(cuda_ctx *c, const int32_t *host, size_t n) {
    /* a pre-staged array, or a sub-range of one (e.g. logit_rows + r0): the
     * fast path, no runtime call (every captured step's host arrays) */
    for (int i = 0; i < c->n_staged; i++) {
        const cuda_staged *s = &c->staged[i];
        if (host >= s->host && host + n <= s->host + s->n) return s->dev + (host - s->host);
    }
    /* backend memory an op wrote (a device-side selection): read in place.
     * A query of the driver's address table, no stream work, so it is also
     * what lets such arrays feed ops inside a graph capture. */
    if (n && is_device_ptr(c, host)) return host;
    LETHE_ASSERT(!c->capturing && "graph capture: host index array was not pre-staged");
    /* the same contents staged before and still in the ring: reuse that copy
     * (a sparse method's per-layer arguments repeat in every layer of a
     * step; each copy saved is one H2D transfer on the stream) */
    for (int i = 0; n && i < LETHE_CUDA_RECENT; i++) {
        const cuda_recent *r = &c->recent[i];
        if (r->n == n && r->gen == c->ring_gen && !memcmp(r->h, host, n * sizeof(int32_t)))
            return r->dev;
    }
    void *h;
    void *d = lethe_cuda_ring_alloc(c, n * sizeof(int32_t), &h);
    if (n) {
        memcpy(h, host, n * sizeof(int32_t));
        CU_CHECK(cudaMemcpyAsync(d, h, n * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream));
        c->recent[c->recent_next] = (cuda_recent){(const int32_t *)h, (const int32_t *)d, n, c->ring_gen};
        c->recent_next = (c->recent_next + 1) % LETHE_CUDA_RECENT;
    }
    return (const int32_t *)d;
}

static void drop_graphs(cuda_ctx *c) {
    for (int i = 0; i < c->n_graphs; i++) cudaGraphExecDestroy(c->graphs[i].exec);
    c->n_graphs = 0;
}

void lethe_cuda_reserve(cuda_ctx *c, void **buf, size_t *cap_bytes, size_t need_bytes) {
    if (need_bytes <= *cap_bytes) return;
    LETHE_ASSERT(!c->capturing && "graph capture: device buffer would have to grow");
    CU_CHECK(cudaStreamSynchronize(c->stream));
    if (*buf) CU_CHECK(cudaFree(*buf));
    size_t cap = need_bytes + need_bytes / 4 + 4096;
    CU_CHECK(cudaMalloc(buf, cap));
    *cap_bytes = cap;
    drop_graphs(c); /* captured graphs hold the old address */
}

static void cuda_stage_step(lethe_backend *be, const int32_t *const *arrays, const size_t *counts,
                            int n) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(n >= 0 && n <= LETHE_CUDA_MAX_STAGED && !c->capturing);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += counts[i];
    /* the pinned upload area is reused every step: wait for the previous upload */
    CU_CHECK(cudaStreamSynchronize(c->stream));
    if (total > c->stage_h_cap) {
        if (c->stage_h) CU_CHECK(cudaFreeHost(c->stage_h));
        c->stage_h_cap = total + total / 4 + 1024;
        CU_CHECK(cudaMallocHost((void **)&c->stage_h, c->stage_h_cap * sizeof(int32_t)));
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        cuda_staged *s = &c->staged[i];
        size_t cap_bytes = s->cap * sizeof(int32_t);
        lethe_cuda_reserve(c, (void **)&s->dev, &cap_bytes, counts[i] * sizeof(int32_t) + 4);
        s->cap = cap_bytes / sizeof(int32_t);
        s->host = arrays[i];
        s->n = counts[i];
        if (counts[i]) {
            memcpy(c->stage_h + off, arrays[i], counts[i] * sizeof(int32_t));
            CU_CHECK(cudaMemcpyAsync(s->dev, c->stage_h + off, counts[i] * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, c->stream));
        }
        off += counts[i];
    }
    c->n_staged = n;
    c->step_logits_n = 0; /* a new step starts */
}

static void cuda_unstage(lethe_backend *be) { cuda_ctx_of(be)->n_staged = 0; }

/* ---- memory and transfers --------------------------------------------- */

static lethe_status cuda_alloc(lethe_backend *be, size_t n_bytes, void **out) {
    cuda_ctx *c = cuda_ctx_of(be);
    cudaError_t e = cudaMalloc(out, n_bytes ? n_bytes : 256);
    if (e != cudaSuccess) {
        /* a failed cudaMalloc also sets the thread's last error: clear it, or
         * the next kernel's launch check reports this refusal as its own
         * failure (a caller that backs off from NOMEM would then die) */
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return lethe_errorf(LETHE_ERR_NOMEM,
                            "cuda backend: cannot allocate %zu bytes on device %d (%s; %zu of %zu "
                            "bytes free)",
                            n_bytes, c->device, cudaGetErrorString(e), fr, tot);
    }
    return LETHE_OK;
}

static void cuda_release(lethe_backend *be, void *p) {
    if (!p) return;
    cuda_ctx *c = cuda_ctx_of(be);
    CU_CHECK(cudaStreamSynchronize(c->stream));
    CU_CHECK(cudaFree(p));
}

static lethe_status cuda_weight_upload(lethe_backend *be, const float *host, size_t n, void **out) {
    cuda_ctx *c = cuda_ctx_of(be);
    void *w;
    lethe_status st = cuda_alloc(be, n * sizeof(bf16), &w);
    if (st != LETHE_OK) return st;
    /* upload in chunks through f32 device scratch, converting on the device */
    const size_t chunk = (size_t)16 << 20; /* floats */
    size_t cap = c->f32_cap;
    lethe_cuda_reserve(c, (void **)&c->f32_d, &cap, (n < chunk ? n : chunk) * sizeof(float));
    c->f32_cap = cap;
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = n - off < chunk ? n - off : chunk;
        CU_CHECK(cudaMemcpyAsync(c->f32_d, host + off, m * sizeof(float), cudaMemcpyHostToDevice,
                                 c->stream));
        lethe_cuda_f32_to_bf16(c, (bf16 *)w + off, c->f32_d, m);
    }
    CU_CHECK(cudaStreamSynchronize(c->stream));
    *out = w;
    return LETHE_OK;
}

static void cuda_act_to_host(lethe_backend *be, float *dst, const void *src, size_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing && "graph capture: act_to_host is a host sync");
    if (!n) return;
    size_t cap = c->f32_cap;
    lethe_cuda_reserve(c, (void **)&c->f32_d, &cap, n * sizeof(float));
    c->f32_cap = cap;
    lethe_cuda_bf16_to_f32(c, c->f32_d, src, n);
    CU_CHECK(cudaMemcpyAsync(dst, c->f32_d, n * sizeof(float), cudaMemcpyDeviceToHost, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
}

static void cuda_logits_to_host(lethe_backend *be, float *dst, const void *src, size_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (!n) return;
    if (!c->capturing) {
        /* keep the pinned area large enough for a capture of this step: all its
         * logits_to_host calls (since stage_step) land there back to back */
        c->step_logits_n += n;
        if (c->step_logits_n > c->f32_h_cap) {
            CU_CHECK(cudaStreamSynchronize(c->stream));
            if (c->f32_h) CU_CHECK(cudaFreeHost(c->f32_h));
            c->f32_h_cap = c->step_logits_n;
            CU_CHECK(cudaMallocHost((void **)&c->f32_h, c->f32_h_cap * sizeof(float)));
            drop_graphs(c);
        }
        cuda_act_to_host(be, dst, src, n);
        return;
    }
    /* captured: convert into scratch, copy into the pinned buffer after the
     * step's earlier logits; the host copy to dst happens after the graph ran
     * (graph_end / graph_launch), so a step's logits must be one contiguous
     * host range written in order (the forward's row chunks are) */
    const size_t off = c->capture_logits_n;
    if (off == 0) c->capture_logits_dst = dst;
    LETHE_ASSERT(dst == c->capture_logits_dst + off && "graph capture: logits not contiguous");
    LETHE_ASSERT(n * sizeof(float) <= c->f32_cap && off + n <= c->f32_h_cap);
    lethe_cuda_bf16_to_f32(c, c->f32_d, src, n);
    CU_CHECK(cudaMemcpyAsync(c->f32_h + off, c->f32_d, n * sizeof(float), cudaMemcpyDeviceToHost,
                             c->stream));
    c->capture_logits_n = off + n;
}

static void cuda_act_from_host(lethe_backend *be, void *dst, const float *src, size_t n) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing);
    if (!n) return;
    size_t cap = c->f32_cap;
    lethe_cuda_reserve(c, (void **)&c->f32_d, &cap, n * sizeof(float));
    c->f32_cap = cap;
    CU_CHECK(cudaMemcpyAsync(c->f32_d, src, n * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    lethe_cuda_f32_to_bf16(c, dst, c->f32_d, n);
    CU_CHECK(cudaStreamSynchronize(c->stream)); /* src may be reused by the caller at once */
}

static void cuda_sync(lethe_backend *be) {
    cuda_ctx *c = cuda_ctx_of(be);
    if (c->capturing) return;
    CU_CHECK(cudaStreamSynchronize(c->stream));
}

static size_t cuda_free_memory(lethe_backend *be) {
    cuda_ctx *c = cuda_ctx_of(be);
    size_t fr = 0, tot = 0;
    CU_CHECK(cudaStreamSynchronize(c->stream));
    CU_CHECK(cudaMemGetInfo(&fr, &tot));
    return fr;
}

/* ---- graphs ------------------------------------------------------------ */

static bool cuda_graph_begin(lethe_backend *be) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing);
    if (c->n_graphs >= LETHE_CUDA_MAX_GRAPHS) return false;
    CU_CHECK(cudaStreamSynchronize(c->stream));
    if (cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    c->capturing = true;
    c->capture_logits_dst = NULL;
    c->capture_logits_n = 0;
    return true;
}

static void copy_logits_out(cuda_ctx *c, float *dst, size_t n) {
    if (dst && n) memcpy(dst, c->f32_h, n * sizeof(float));
}

static lethe_status cuda_graph_end(lethe_backend *be, int32_t key) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(c->capturing);
    c->capturing = false;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess)
        return lethe_errorf(LETHE_ERR_BACKEND, "cuda backend: graph capture failed: %s",
                            cudaGetErrorString(e));
    cudaGraphExec_t exec;
    e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return lethe_errorf(LETHE_ERR_BACKEND, "cuda backend: graph instantiation failed: %s",
                            cudaGetErrorString(e));
    /* replace an older graph of the same key */
    int slot = c->n_graphs;
    for (int i = 0; i < c->n_graphs; i++)
        if (c->graphs[i].key == key) {
            cudaGraphExecDestroy(c->graphs[i].exec);
            slot = i;
        }
    if (slot == c->n_graphs) c->n_graphs++;
    c->graphs[slot].key = key;
    c->graphs[slot].exec = exec;
    c->graphs[slot].logits_n = c->capture_logits_n;
    CU_CHECK(cudaGraphLaunch(exec, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
    copy_logits_out(c, c->capture_logits_dst, c->capture_logits_n);
    c->capture_logits_dst = NULL;
    return LETHE_OK;
}

static bool cuda_graph_launch(lethe_backend *be, int32_t key, float *logits_dst) {
    cuda_ctx *c = cuda_ctx_of(be);
    LETHE_ASSERT(!c->capturing);
    for (int i = 0; i < c->n_graphs; i++) {
        if (c->graphs[i].key != key) continue;
        CU_CHECK(cudaGraphLaunch(c->graphs[i].exec, c->stream));
        CU_CHECK(cudaStreamSynchronize(c->stream));
        copy_logits_out(c, logits_dst, c->graphs[i].logits_n);
        return true;
    }
    return false;
}

static void cuda_graph_reset(lethe_backend *be) {
    cuda_ctx *c = cuda_ctx_of(be);
    CU_CHECK(cudaStreamSynchronize(c->stream));
    drop_graphs(c);
}

/* ---- roofline ceilings ------------------------------------------------- */

__global__ void fill_random_bf16(bf16 *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + seed) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z ^= z >> 31;
        p[i] = __float2bfloat16((float)(z >> 40) * 0x1p-24f - 0.5f);
    }
}

static float median5(float *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            float t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

/* copy: 1 GiB device-to-device (bytes read + written); GEMM: 8192^3 bf16 on
 * random data through the same cuBLAS call as matmul; medians of timed runs */
static lethe_status cuda_measure_peaks(lethe_backend *be, double *copy_bps, double *gemm_fps) {
    cuda_ctx *c = cuda_ctx_of(be);
    const size_t copy_bytes = (size_t)1 << 30;
    const int N = 8192;
    const size_t mat = (size_t)N * N;
    void *a = NULL, *b = NULL, *y = NULL;
    if (cudaMalloc(&a, copy_bytes) != cudaSuccess || cudaMalloc(&b, copy_bytes) != cudaSuccess ||
        cudaMalloc(&y, mat * sizeof(bf16)) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(a);
        cudaFree(b);
        cudaFree(y);
        return lethe_errorf(LETHE_ERR_NOMEM, "cuda backend: measure_peaks needs 2.1 GiB free");
    }
    fill_random_bf16<<<c->n_sms * 8, 256, 0, c->stream>>>((bf16 *)a, copy_bytes / 2, 1);
    fill_random_bf16<<<c->n_sms * 8, 256, 0, c->stream>>>((bf16 *)b, copy_bytes / 2, 7);
    CU_LAUNCH_CHECK();
    cudaEvent_t e0, e1;
    CU_CHECK(cudaEventCreate(&e0));
    CU_CHECK(cudaEventCreate(&e1));
    float t[9];
    for (int r = -2; r < 9; r++) {
        CU_CHECK(cudaEventRecord(e0, c->stream));
        CU_CHECK(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, copy_bytes, cudaMemcpyDeviceToDevice,
                                 c->stream));
        CU_CHECK(cudaEventRecord(e1, c->stream));
        CU_CHECK(cudaEventSynchronize(e1));
        if (r >= 0) CU_CHECK(cudaEventElapsedTime(&t[r], e0, e1));
    }
    *copy_bps = 2.0 * copy_bytes / (median5(t, 9) * 1e-3);
    /* x = first N*N of a, W = first N*N of b (both random) */
    for (int r = -3; r < 9; r++) {
        CU_CHECK(cudaEventRecord(e0, c->stream));
        lethe_cuda_matmul(be, y, a, b, N, N, N);
        CU_CHECK(cudaEventRecord(e1, c->stream));
        CU_CHECK(cudaEventSynchronize(e1));
        if (r >= 0) CU_CHECK(cudaEventElapsedTime(&t[r], e0, e1));
    }
    *gemm_fps = 2.0 * N * (double)N * N / (median5(t, 9) * 1e-3);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    CU_CHECK(cudaFree(a));
    CU_CHECK(cudaFree(b));
    CU_CHECK(cudaFree(y));
    return LETHE_OK;
}

/* ---- profiler range ------------------------------------------------------ */

static void cuda_profile_range(lethe_backend *be, bool start) {
    cuda_ctx *c = cuda_ctx_of(be);
    CU_CHECK(cudaStreamSynchronize(c->stream));
    if (start) cudaProfilerStart();
    else cudaProfilerStop();
    cudaGetLastError(); /* no profiler attached is not an error */
}

/* LETHE_MATMUL=auto|cublas (env table, core/env.c): auto (default) sends
 * decode-sized products (n <= 4) to matmul.cu's GEMV kernel; cublas sends
 * every product to cuBLAS (side-by-side benchmarks) */
static lethe_status matmul_from_env(bool *cublas_only) {
    const char *v = NULL;
    lethe_status st = lethe_env_choice(LETHE_ENV_MATMUL, &v);
    if (st != LETHE_OK) return st;
    *cublas_only = !strcmp(v, "cublas");
    return LETHE_OK;
}

/* ---- lifetime ---------------------------------------------------------- */

static void cuda_destroy(lethe_backend *be) {
    if (!be) return;
    cuda_ctx *c = cuda_ctx_of(be);
    if (c) {
        cudaStreamSynchronize(c->stream);
        drop_graphs(c);
        for (int i = 0; i < LETHE_CUDA_MAX_STAGED; i++)
            if (c->staged[i].dev) cudaFree(c->staged[i].dev);
        if (c->stage_h) cudaFreeHost(c->stage_h);
        if (c->ring_h) cudaFreeHost(c->ring_h);
        if (c->ring_d) cudaFree(c->ring_d);
        if (c->f32_d) cudaFree(c->f32_d);
        if (c->f32_h) cudaFreeHost(c->f32_h);
        if (c->attn_ws) cudaFree(c->attn_ws);
        if (c->qattn_ws) cudaFree(c->qattn_ws);
        if (c->bsp_ws) cudaFree(c->bsp_ws);
        if (c->qmean_ws) cudaFree(c->qmean_ws);
        if (c->tq_ws) cudaFree(c->tq_ws);
        if (c->gemm_attn_ws) cudaFree(c->gemm_attn_ws);
        free(c->tq_iota);
        if (c->sample_ws) cudaFree(c->sample_ws);
        if (c->xfer_d) cudaFree(c->xfer_d);
        if (c->xfer_h) cudaFreeHost(c->xfer_h);
        if (c->scores_d) cudaFree(c->scores_d);
        if (c->clu_d) cudaFree(c->clu_d);
        if (c->cublas_ws) cudaFree(c->cublas_ws);
        if (c->cublas) cublasDestroy(c->cublas);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c);
    }
    free(be);
}

static void cuda_copy_from_host(lethe_backend *be, void *dst, const void *src, size_t n_bytes) {
    cuda_ctx *c = cuda_ctx_of(be);
    CU_CHECK(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, c->stream));
    CU_CHECK(cudaStreamSynchronize(c->stream));
}

static const lethe_backend_ops cuda_ops = {
    /* .name */ "cuda",
    /* .caps */ LETHE_BE_GRAPHS | LETHE_BE_PROFILER,
    /* .act_size */ sizeof(bf16),
    /* .kv_size */ sizeof(bf16),
    /* .destroy */ cuda_destroy,
    /* .alloc */ cuda_alloc,
    /* .release */ cuda_release,
    /* .weight_upload */ cuda_weight_upload,
    /* .act_to_host */ cuda_act_to_host,
    /* .act_from_host */ cuda_act_from_host,
    /* .sync */ cuda_sync,
    /* .free_memory */ cuda_free_memory,
    /* .embed */ lethe_cuda_embed,
    /* .rmsnorm */ lethe_cuda_rmsnorm,
    /* .add */ lethe_cuda_add,
    /* .matmul */ lethe_cuda_matmul,
    /* .add_bias */ lethe_cuda_add_bias,
    /* .rope */ lethe_cuda_rope,
    /* .swiglu */ lethe_cuda_swiglu,
    /* .kv_store */ lethe_cuda_kv_store,
    /* .attention */ lethe_cuda_attention,
    /* .logits_to_host */ cuda_logits_to_host,
    /* .gather_rows */ lethe_cuda_gather_rows,
    /* .stage_step */ cuda_stage_step,
    /* .unstage */ cuda_unstage,
    /* .graph_begin */ cuda_graph_begin,
    /* .graph_end */ cuda_graph_end,
    /* .graph_launch */ cuda_graph_launch,
    /* .graph_reset */ cuda_graph_reset,
    /* .measure_peaks */ cuda_measure_peaks,
    /* .kv_store_quant */ lethe_cuda_kv_store_quant,
    /* .attn_scores */ lethe_cuda_attn_scores,
    /* Quest page bounds */
    /* .page_minmax */ lethe_cuda_page_minmax,
    /* .page_scores */ lethe_cuda_page_scores,
    /* .profile_range */ cuda_profile_range,
    /* .sample */ lethe_cuda_sample,
    /* device-side selection (select.cu) */
    /* .topk */ lethe_cuda_topk,
    /* .select_expand */ lethe_cuda_select_expand,
    /* mixture of experts (moe.cu) */
    /* .moe */ lethe_cuda_moe,
    /* latent attention (mla.cu) */
    /* .matmul_heads */ lethe_cuda_matmul_heads,
    /* .copy_block */ lethe_cuda_copy_block,
    /* .copy_from_host */ cuda_copy_from_host,
    /* .key_redundancy */ lethe_cuda_key_redundancy,
    /* RetroInfer key clusters (clusters.cu) */
    /* .cluster_assign */ lethe_cuda_cluster_assign,
    /* .cluster_scores */ lethe_cuda_cluster_scores,
    /* .cluster_attention */ lethe_cuda_cluster_attention,
    /* .gather_sum */ lethe_cuda_gather_sum,
    /* hybrid linear attention (gdn.cu) */
    /* .gdn_conv */ lethe_cuda_gdn_conv,
    /* .gdn_rule */ lethe_cuda_gdn_rule,
    /* .rmsnorm_gated */ lethe_cuda_rmsnorm_gated,
    /* .sigmoid_mul */ lethe_cuda_sigmoid_mul,
    /* .state_copy */ lethe_cuda_state_copy,
    /* .weight_upload_raw */ NULL,
    /* host KV tier (transfer.cu) */
    /* .rows_to_host */ lethe_cuda_rows_to_host,
    /* .rows_from_host */ lethe_cuda_rows_from_host,
    /* per-row top-k (select.cu) */
    /* .row_topk */ lethe_cuda_row_topk,
};

#define INIT_CHECK(call, what)                                                              \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            lethe_status st_ = lethe_errorf(LETHE_ERR_BACKEND, "cuda backend: %s: %s", what, \
                                            cudaGetErrorString(e_));                        \
            cuda_destroy(be);                                                               \
            return st_;                                                                     \
        }                                                                                   \
    } while (0)

extern "C" lethe_status lethe_backend_cuda_create(const lethe_backend_params *p,
                                                  lethe_backend **out) {
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        cudaGetLastError();
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "--device cuda: no CUDA device available (%s)",
                            e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    if (p->device_index < 0 || p->device_index >= n_dev)
        return lethe_errorf(LETHE_ERR_INVALID, "--device cuda: device index %d out of range (%d devices)",
                            p->device_index, n_dev);
    lethe_backend *be = (lethe_backend *)calloc(1, sizeof(*be));
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof(*c));
    if (!be || !c) {
        free(be);
        free(c);
        return lethe_errorf(LETHE_ERR_NOMEM, "cuda backend: out of host memory");
    }
    be->ops = &cuda_ops;
    be->n_threads = p->n_threads;
    be->ctx = c;
    lethe_status env_st = matmul_from_env(&c->matmul_cublas_only);
    if (env_st != LETHE_OK) {
        cuda_destroy(be);
        return env_st;
    }
    c->device = p->device_index;
    INIT_CHECK(cudaSetDevice(c->device), "cudaSetDevice");
    cudaDeviceProp prop;
    INIT_CHECK(cudaGetDeviceProperties(&prop, c->device), "cudaGetDeviceProperties");
    if (prop.major < 8) {
        cuda_destroy(be);
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "--device cuda: %s has compute capability %d.%d; lethe's CUDA kernels "
                            "need bf16 tensor cores (8.0 or newer)",
                            prop.name, prop.major, prop.minor);
    }
    c->n_sms = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    INIT_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "stream");
    if (cublasCreate(&c->cublas) != CUBLAS_STATUS_SUCCESS) {
        cuda_destroy(be);
        return lethe_errorf(LETHE_ERR_BACKEND, "cuda backend: cublasCreate failed");
    }
    c->cublas_ws_size = CUBLAS_WS_BYTES;
    INIT_CHECK(cudaMalloc(&c->cublas_ws, c->cublas_ws_size), "cuBLAS workspace");
    if (cublasSetStream(c->cublas, c->stream) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(c->cublas, c->cublas_ws, c->cublas_ws_size) != CUBLAS_STATUS_SUCCESS) {
        cuda_destroy(be);
        return lethe_errorf(LETHE_ERR_BACKEND, "cuda backend: cuBLAS stream/workspace setup failed");
    }
    cublasSetMathMode(c->cublas, CUBLAS_DEFAULT_MATH);
    c->ring_cap = RING_BYTES;
    INIT_CHECK(cudaMallocHost((void **)&c->ring_h, c->ring_cap), "pinned staging ring");
    INIT_CHECK(cudaMalloc((void **)&c->ring_d, c->ring_cap), "device staging ring");
    LOG_INFO("cuda backend: %s, %d SMs, %.1f GiB, compute %d.%d, matmul %s", prop.name, c->n_sms,
             prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor,
             c->matmul_cublas_only ? "cublas" : "auto");
    *out = be;
    return LETHE_OK;
}

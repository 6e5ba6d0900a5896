/* gdn_peak.cu - the SIMT fp32 FMA ceiling of the device (gdn_peak.h).
 *
 * lethe's gdn_rule kernel (src/backend/cuda/gdn.cu) does its arithmetic in
 * fp32 on the CUDA cores, not on tensor cores, so its compute bound is the
 * fp32 FMA rate, not the bf16 GEMM peak of ops->measure_peaks. Each thread
 * runs 8 independent chains of ITERS dependent FMAs in registers (enough
 * independent work to hide the FMA latency at 256 threads per block, 8
 * blocks per SM); the result is written once so nothing is optimised away. */
#include <cuda_runtime.h>

#include "gdn_peak.h"

#define PEAK_ITERS 4096
#define PEAK_CHAINS 8
#define PEAK_THREADS 256

__global__ void fma_peak_kernel(float *out, float a, float b) {
    float x[PEAK_CHAINS];
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; c++) x[c] = (float)(threadIdx.x + c);
    for (int i = 0; i < PEAK_ITERS; i++) {
#pragma unroll
        for (int c = 0; c < PEAK_CHAINS; c++) x[c] = fmaf(x[c], a, b);
    }
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; c++) s += x[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" double dev_cuda_fp32_peak(void) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 0;
    const int blocks = sms * 8;
    float *out = NULL;
    if (cudaMalloc(&out, (size_t)blocks * PEAK_THREADS * sizeof(float)) != cudaSuccess) return 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    /* a = 1 - 2^-20, b = 2^-20: values stay near 1, no denormals or overflow */
    fma_peak_kernel<<<blocks, PEAK_THREADS>>>(out, 0.99999905f, 9.5367432e-7f); /* warm-up */
    float best_ms = 0;
    for (int r = 0; r < 5; r++) {
        cudaEventRecord(e0);
        fma_peak_kernel<<<blocks, PEAK_THREADS>>>(out, 0.99999905f, 9.5367432e-7f);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (r == 0 || ms < best_ms) best_ms = ms;
    }
    const bool ok = cudaGetLastError() == cudaSuccess && best_ms > 0;
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(out);
    const double flops = 2.0 * PEAK_CHAINS * PEAK_ITERS * (double)blocks * PEAK_THREADS;
    return ok ? flops / (best_ms * 1e-3) : 0;
}

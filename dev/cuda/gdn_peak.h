/* gdn_peak.h - the SIMT fp32 ceiling gdn_bench.c sets the delta-rule kernel
 * against (dev/cuda/gdn_peak.cu). */
#ifndef LETHE_DEV_CUDA_GDN_PEAK_H
#define LETHE_DEV_CUDA_GDN_PEAK_H

#ifdef __cplusplus
extern "C" {
#endif
/* Measured fp32 FMA throughput of device 0 (FLOP/s, an FMA = 2 FLOPs): a
 * register-only kernel with 8 independent FMA chains per thread over every
 * SM, best of 5 timed launches (cudaEvent). 0 on a CUDA error. */
double dev_cuda_fp32_peak(void);
#ifdef __cplusplus
}
#endif

#endif /* LETHE_DEV_CUDA_GDN_PEAK_H */

/* attention_gen.h - the CUDA attention kernel generations behind one call
 * (dev/cuda/attention_v1.cu), for the comparison program attn_bench.c. */
#ifndef LETHE_DEV_CUDA_ATTENTION_GEN_H
#define LETHE_DEV_CUDA_ATTENTION_GEN_H

#include <stdbool.h>

#include "backend/backend.h"

enum { DEV_ATTN_V1 = 1, DEV_ATTN_V2 = 2 };

#ifdef __cplusplus
extern "C" {
#endif
/* Runs ops->attention's call `a` (native bf16 KV) on the CUDA backend `be`
 * with generation `gen`'s kernels, asynchronously on its stream, like the op.
 * v1: split_kernel for decode and for head dims other than 64 / 128, the WMMA
 * prefill_kernel for prefill / extend at 64 / 128. v2: lethe's
 * decode_v2_kernel / prefill_v2_kernel (head_dim 64 / 128). Returns false,
 * doing nothing, when the generation does not take the shape on this device
 * (its shared memory does not fit). */
bool dev_cuda_attention(lethe_backend *be, const lethe_attn_args *a, int gen);
#ifdef __cplusplus
}
#endif

#endif /* LETHE_DEV_CUDA_ATTENTION_GEN_H */

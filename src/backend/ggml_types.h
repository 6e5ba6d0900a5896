/* ggml_types.h - ggml tensor element types (GGUF weights): sizes, names,
 * dequantization to f32. Below the model layer so that backends which keep
 * weights in their stored format (backend/cpu/qmatmul.c) use the same codec
 * as the loader; layouts in ggml_types.c. */
#ifndef LETHE_BACKEND_GGML_TYPES_H
#define LETHE_BACKEND_GGML_TYPES_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

typedef enum lethe_ggml_type { /* tensor element types, numbered as in ggml */
                               LETHE_GGML_F32 = 0,
                               LETHE_GGML_F16 = 1,
                               LETHE_GGML_Q4_0 = 2,
                               LETHE_GGML_Q4_1 = 3,
                               LETHE_GGML_Q5_0 = 6,
                               LETHE_GGML_Q5_1 = 7,
                               LETHE_GGML_Q8_0 = 8,
                               LETHE_GGML_Q8_1 = 9,
                               LETHE_GGML_Q2_K = 10,
                               LETHE_GGML_Q3_K = 11,
                               LETHE_GGML_Q4_K = 12,
                               LETHE_GGML_Q5_K = 13,
                               LETHE_GGML_Q6_K = 14,
                               LETHE_GGML_Q8_K = 15,
                               LETHE_GGML_BF16 = 30,
} lethe_ggml_type;

/* Bytes for n elements of a ggml type; 0 if the type is unknown or n is not a
 * multiple of its block size. */
size_t lethe_ggml_type_size(lethe_ggml_type t, uint64_t n_elems);
const char *lethe_ggml_type_name(lethe_ggml_type t);
/* elements per block (1 for f32/f16/bf16); 0 if the type is unknown */
uint32_t lethe_ggml_block_size(lethe_ggml_type t);

/* Dequantizes n elements (a multiple of the block size) of type t to f32. */
lethe_status lethe_ggml_dequantize(lethe_ggml_type t, const void *src, float *dst, uint64_t n);
/* The same on the calling thread only (t known, n a multiple of its block
 * size: asserted), bit-identical to lethe_ggml_dequantize; for kernels that
 * dequantize weight panels inside their own parallel loop. */
void lethe_ggml_dequantize_serial(lethe_ggml_type t, const void *src, float *dst, uint64_t n);

#endif /* LETHE_BACKEND_GGML_TYPES_H */

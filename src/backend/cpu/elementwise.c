/* elementwise.c - row copies and pointwise ops for the CPU backend.
 *
 *   embed       x[i, :] = table[tokens[i], :]          table [n_vocab, dim]
 *   gather_rows dst[i, :] = src[idx[i], :]
 *   add         x += y                                  (residual)
 *   add_bias    y[i, :] += b                            (qwen2 qkv bias)
 *   swiglu      out = silu(gate) * up, silu(g) = g / (1 + exp(-g))  (HF SiLU)
 *
 * All pointwise, so results never depend on batch composition. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

/* parallelize only when the array is big enough to pay for a region */
static int threads_for(lethe_backend *be, size_t n) { return n < 65536 ? 1 : lethe_cpu_threads(be); }

void lethe_cpu_embed(lethe_backend *be, void *x_, const void *table_, const int32_t *tokens,
                     int32_t n, int32_t dim) {
    float *x = x_;
    const float *table = table_;
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(tokens[i] >= 0);
        memcpy(x + (size_t)i * dim, table + (size_t)tokens[i] * dim, (size_t)dim * sizeof(float));
    }
}

void lethe_cpu_gather_rows(lethe_backend *be, void *dst_, const void *src_, const int32_t *idx,
                           int32_t n, int32_t dim) {
    float *dst = dst_;
    const float *src = src_;
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(idx[i] >= 0);
        memmove(dst + (size_t)i * dim, src + (size_t)idx[i] * dim, (size_t)dim * sizeof(float));
    }
}

void lethe_cpu_add(lethe_backend *be, void *x_, const void *y_, size_t n) {
    float *x = x_;
    const float *y = y_;
#pragma omp parallel for schedule(static) num_threads(threads_for(be, n))
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

void lethe_cpu_add_bias(lethe_backend *be, void *y_, const void *b_, int32_t n, int32_t dim) {
    float *y = y_;
    const float *b = b_;
    for (int32_t i = 0; i < n; i++)
        for (int32_t j = 0; j < dim; j++) y[(size_t)i * dim + j] += b[j];
}

void lethe_cpu_swiglu(lethe_backend *be, void *out_, const void *gate_, const void *up_,
                      size_t n) {
    float *out = out_;
    const float *gate = gate_, *up = up_;
#pragma omp parallel for schedule(static) num_threads(threads_for(be, n))
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

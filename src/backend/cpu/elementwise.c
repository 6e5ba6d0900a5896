/* elementwise.c - row copies and pointwise ops for the CPU backend.
 *
 *   embed       x[i, :] = table[tokens[i], :]          table [n_vocab, dim] (f32, or a
 *               stored-format weight whose rows are decoded: qmatmul.c)
 *   gather_rows dst[i, :] = src[idx[i], :]
 *   add         x += y                                  (residual)
 *   add_bias    y[i, :] += b                            (qwen2 qkv bias)
 *   swiglu      out = silu(gate) * up, silu(g) = g / (1 + exp(-g))  (HF SiLU)
 *
 * All pointwise, so results never depend on batch composition. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

/* parallelize only when the array is big enough to pay for a region */
static int threads_for(lethe_backend *be, size_t n) { return n < 65536 ? 1 : lethe_cpu_threads(be); }

#define CHUNK 16384 /* elements per task of the pointwise ops */

typedef struct pw_job {
    float *out;
    const float *a, *b;
    size_t n;
} pw_job;

static void add_task(void *ctx, int t, int worker) {
    const pw_job *j = ctx;
    const size_t e = LETHE_MIN(j->n, (size_t)(t + 1) * CHUNK);
    for (size_t i = (size_t)t * CHUNK; i < e; i++) j->out[i] += j->a[i];
}

static void swiglu_task(void *ctx, int t, int worker) {
    const pw_job *j = ctx;
    const size_t e = LETHE_MIN(j->n, (size_t)(t + 1) * CHUNK);
    for (size_t i = (size_t)t * CHUNK; i < e; i++) {
        float g = j->a[i];
        j->out[i] = g / (1.0f + expf(-g)) * j->b[i];
    }
}

void lethe_cpu_embed(lethe_backend *be, void *x_, const void *table_, const int32_t *tokens,
                     int32_t n, int32_t dim) {
    float *x = x_;
    const float *table = table_;
    const lethe_cpu_qweight *q = lethe_cpu_qweight_find(be, table_); /* stored format: decode rows */
    LETHE_ASSERT(!q || q->cols == dim);
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(tokens[i] >= 0 && (!q || tokens[i] < q->rows));
        if (q) lethe_cpu_qweight_rows(q, tokens[i], tokens[i] + 1, x + (size_t)i * dim);
        else
            memcpy(x + (size_t)i * dim, table + (size_t)tokens[i] * dim,
                   (size_t)dim * sizeof(float));
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

void lethe_cpu_gather_sum(lethe_backend *be, void *out_, const void *src_, const int32_t *idx, int32_t n,
                          int32_t n_idx, int32_t dim, float scale) {
    float *out = out_;
    const float *src = src_;
    for (int32_t i = 0; i < n; i++) {
        float *o = out + (size_t)i * dim;
        for (int32_t j = 0; j < dim; j++) {
            float acc = 0; /* in index order, as the CUDA twin */
            for (int32_t k = 0; k < n_idx; k++) {
                LETHE_ASSERT(idx[(size_t)i * n_idx + k] >= 0);
                acc += src[(size_t)idx[(size_t)i * n_idx + k] * dim + j];
            }
            o[j] += scale * acc;
        }
    }
}

void lethe_cpu_add(lethe_backend *be, void *x_, const void *y_, size_t n) {
    pw_job j = {x_, y_, NULL, n};
    lethe_cpu_parallel(be, threads_for(be, n), (int)LETHE_CEIL_DIV(n, CHUNK), add_task, &j);
}

void lethe_cpu_add_bias(lethe_backend *be, void *y_, const void *b_, int32_t n, int32_t dim) {
    float *y = y_;
    const float *b = b_;
    for (int32_t i = 0; i < n; i++)
        for (int32_t j = 0; j < dim; j++) y[(size_t)i * dim + j] += b[j];
}

void lethe_cpu_swiglu(lethe_backend *be, void *out_, const void *gate_, const void *up_,
                      size_t n) {
    pw_job j = {out_, gate_, up_, n};
    lethe_cpu_parallel(be, threads_for(be, n), (int)LETHE_CEIL_DIV(n, CHUNK), swiglu_task, &j);
}

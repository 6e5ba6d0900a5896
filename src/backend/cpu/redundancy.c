/* redundancy.c - key_redundancy on the CPU backend (R-KV's redundancy term;
 * semantics: backend.h ops->key_redundancy; CUDA twin cuda/redundancy.cu).
 *
 * Per KV head (heads in parallel): the key norms, then for each key i one
 * pass over every other key j: c(i, j) from one fmaf chain over d (then
 * divided by the norm product), summed in double in j order, and the largest
 * j > i with c(i, j) > threshold remembered with its c. Then the newest-copy
 * rule: out[last(i)] loses c(i, last(i)) (the cosine is symmetric). Work
 * O(n^2 d) per head, memory O(n): the n x n similarity never exists. */
#include <math.h>
#include <stdlib.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

static float dot(const float *a, const float *b, int d) {
    float acc = 0.0f;
    for (int k = 0; k < d; k++) acc = fmaf(a[k], b[k], acc);
    return acc;
}

void lethe_cpu_key_redundancy(lethe_backend *be, float *out, const void *k_cache,
                              const int32_t *slots, int32_t n, int32_t n_kv_heads, int32_t head_dim,
                              float threshold) {
    LETHE_ASSERT(n >= 0 && n_kv_heads > 0 && head_dim > 0);
    if (n == 0) return;
    const float *kc = k_cache;
    const size_t stride = (size_t)n_kv_heads * head_dim;
    const int nt = (int64_t)n * n < 4096 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int h = 0; h < n_kv_heads; h++) {
        float *nrm = lethe_xmalloc((size_t)n * sizeof(float)),
              *clast = lethe_xmalloc((size_t)n * sizeof(float));
        int32_t *last = lethe_xmalloc((size_t)n * sizeof(int32_t));
        double *sum = lethe_xmalloc((size_t)n * sizeof(double));
        for (int32_t i = 0; i < n; i++) {
            const float *k = kc + (size_t)slots[i] * stride + (size_t)h * head_dim;
            nrm[i] = sqrtf(dot(k, k, head_dim)) + 1e-8f;
        }
        for (int32_t i = 0; i < n; i++) {
            const float *ki = kc + (size_t)slots[i] * stride + (size_t)h * head_dim;
            double s = 0.0;
            last[i] = -1;
            for (int32_t j = 0; j < n; j++) {
                if (j == i) continue;
                const float *kj = kc + (size_t)slots[j] * stride + (size_t)h * head_dim;
                const float c = dot(ki, kj, head_dim) / (nrm[i] * nrm[j]);
                s += c;
                if (j > i && c > threshold) last[i] = j, clast[i] = c;
            }
            sum[i] = s;
        }
        for (int32_t i = 0; i < n; i++)
            if (last[i] >= 0) sum[last[i]] -= clast[i];
        for (int32_t i = 0; i < n; i++) out[(size_t)h * n + i] = (float)(sum[i] / n);
        free(nrm), free(clast), free(last), free(sum);
    }
}

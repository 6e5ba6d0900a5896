/* redundancy.c - key_redundancy on the CPU backend (R-KV's redundancy term;
 * semantics: backend.h ops->key_redundancy; CUDA twin cuda/redundancy.cu).
 *
 * Per KV head: the key norms |k_j| + 1e-8, then for each key i one pass over
 * every key j: c(i, j) = (one fmaf chain over d) / (|k_i| |k_j|) in float,
 * c(i, i) taken as 0, summed in double in 8 lanes by j mod 8 (lane order fixed:
 * ((0+4)+(2+6))+((1+5)+(3+7))), and the largest j > i with c(i, j) > threshold
 * remembered with its c. Then the newest-copy rule: out[last(i)] loses
 * c(i, last(i)) (the cosine is symmetric). The lanes are what the AVX2 tier
 * (redundancy_avx2.c, keys transposed so that a vector holds 8 keys) sums,
 * so both tiers give the same bits for any thread count. Work O(n^2 d) per
 * head, memory O(n d) for the packed keys: the n x n similarity never
 * exists. Tasks: (KV head, block of rows) in parallel. */
#include <math.h>
#include <stdlib.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define ROWS_PER_TASK 64

static float dot(const float *a, const float *b, int d) {
    float acc = 0.0f;
    for (int k = 0; k < d; k++) acc = fmaf(a[k], b[k], acc);
    return acc;
}

/* the portable pass over rows [i0, i1) of one head */
static void rows_scalar(const float *kc, const int32_t *slots, size_t stride, size_t head_off, int32_t n,
                        int D, const float *nrm, float threshold, int32_t i0, int32_t i1, double *sum,
                        int32_t *last, float *clast) {
    for (int32_t i = i0; i < i1; i++) {
        const float *ki = kc + (size_t)slots[i] * stride + head_off;
        double l[8] = {0};
        last[i] = -1;
        for (int32_t j = 0; j < n; j++) {
            const float *kj = kc + (size_t)slots[j] * stride + head_off;
            const float c = j == i ? 0.0f : dot(ki, kj, D) / (nrm[i] * nrm[j]);
            l[j & 7] += c;
            if (j > i && c > threshold) last[i] = j, clast[i] = c;
        }
        sum[i] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    }
}

void lethe_cpu_key_redundancy(lethe_backend *be, float *out, const void *k_cache,
                              const int32_t *slots, int32_t n, int32_t n_kv_heads, int32_t head_dim,
                              float threshold) {
    LETHE_ASSERT(n >= 0 && n_kv_heads > 0 && head_dim > 0);
    if (n == 0) return;
    const float *kc = k_cache;
    const int D = head_dim;
    const size_t stride = (size_t)n_kv_heads * D;
    /* the AVX2 tier compares key indices as floats: exact below 2^24 */
    const bool avx2 = ((const lethe_cpu_ctx *)be->ctx)->isa >= LETHE_ISA_AVX2 && n < (1 << 24);
    const int32_t np = (n + 7) & ~7;
    float *nrm = lethe_xmalloc((size_t)n_kv_heads * np * sizeof(float)),
          *clast = lethe_xmalloc((size_t)n_kv_heads * n * sizeof(float));
    float *kt = avx2 ? lethe_xmalloc((size_t)n_kv_heads * D * np * sizeof(float)) : NULL;
    int32_t *last = lethe_xmalloc((size_t)n_kv_heads * n * sizeof(int32_t));
    double *sum = lethe_xmalloc((size_t)n_kv_heads * n * sizeof(double));
    const int nt = (int64_t)n * n < 4096 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(static, 1) num_threads(nt)
    for (int h = 0; h < n_kv_heads; h++) {
        if (avx2) {
            lethe_cpu_redundancy_pack_avx2(kc, slots, stride, (size_t)h * D, n, D, kt + (size_t)h * D * np, np,
                                           nrm + (size_t)h * np);
        } else {
            for (int32_t i = 0; i < n; i++) {
                const float *k = kc + (size_t)slots[i] * stride + (size_t)h * D;
                nrm[(size_t)h * np + i] = sqrtf(dot(k, k, D)) + 1e-8f;
            }
        }
    }
    const int32_t n_blk = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t t = 0; t < (int64_t)n_kv_heads * n_blk; t++) {
        const int h = (int)(t / n_blk);
        const int32_t i0 = (int32_t)(t % n_blk) * ROWS_PER_TASK, i1 = LETHE_MIN(n, i0 + ROWS_PER_TASK);
        const size_t o = (size_t)h * n;
        if (avx2)
            lethe_cpu_redundancy_rows_avx2(kc, slots, stride, (size_t)h * D, kt + (size_t)h * D * np, np, n, D,
                                           nrm + (size_t)h * np, threshold, i0, i1, sum + o, last + o, clast + o);
        else
            rows_scalar(kc, slots, stride, (size_t)h * D, n, D, nrm + (size_t)h * np, threshold, i0, i1, sum + o,
                        last + o, clast + o);
    }
    for (int h = 0; h < n_kv_heads; h++) {
        const size_t o = (size_t)h * n;
        for (int32_t i = 0; i < n; i++)
            if (last[o + i] >= 0) sum[o + last[o + i]] -= clast[o + i];
        for (int32_t i = 0; i < n; i++) out[o + i] = (float)(sum[o + i] / n);
    }
    free(nrm), free(clast), free(kt), free(last), free(sum);
}

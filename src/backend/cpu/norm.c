/* norm.c - RMSNorm for the CPU backend, computed like HF LlamaRMSNorm:
 *
 *   r      = 1 / sqrt(mean(x^2) + eps)        (sum of squares in double)
 *   out[i] = w[i] * (x[i] * r)                (fp32, HF's order of products)
 *
 * x, out: [n_rows, dim]; w: [dim]. out may alias x. Rows are independent, so
 * a row's result never depends on the other rows of the batch. Also used for
 * Qwen3's per-head q/k norm (rows = tokens * heads, dim = head_dim). */
#include <math.h>

#include "backend/cpu/cpu_ops.h"

static void rmsnorm_row(float *out, const float *x, const float *w, int dim, float eps) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= dim; i += 4) {
        s0 += (double)x[i] * x[i];
        s1 += (double)x[i + 1] * x[i + 1];
        s2 += (double)x[i + 2] * x[i + 2];
        s3 += (double)x[i + 3] * x[i + 3];
    }
    for (; i < dim; i++) s0 += (double)x[i] * x[i];
    double ss = (s0 + s1) + (s2 + s3);
    float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
    for (i = 0; i < dim; i++) out[i] = w[i] * (x[i] * r);
}

typedef struct norm_job {
    float *out;
    const float *x, *w;
    int32_t n_rows, dim;
    float eps;
} norm_job;

#define NORM_ROWS 8 /* rows per task */

static void norm_task(void *ctx, int t, int worker) {
    const norm_job *j = ctx;
    for (int32_t r = t * NORM_ROWS; r < j->n_rows && r < (t + 1) * NORM_ROWS; r++)
        rmsnorm_row(j->out + (size_t)r * j->dim, j->x + (size_t)r * j->dim, j->w, j->dim, j->eps);
}

void lethe_cpu_rmsnorm(lethe_backend *be, void *out_, const void *x_, const void *w_,
                       int32_t n_rows, int32_t dim, float eps) {
    LETHE_ASSERT(n_rows >= 0 && dim > 0);
    norm_job j = {out_, x_, w_, n_rows, dim, eps};
    const int nt = (size_t)n_rows * dim < 65536 ? 1 : lethe_cpu_threads(be);
    lethe_cpu_parallel(be, nt, (n_rows + NORM_ROWS - 1) / NORM_ROWS, norm_task, &j);
}

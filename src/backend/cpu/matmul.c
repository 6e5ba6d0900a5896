/* matmul.c - deterministic fp32 GEMM for the CPU backend: y = x W^T.
 *
 *   x [n, in] row-major, W [out, in] row-major (HF nn.Linear), y [n, out].
 *
 * Both operands are read along `in`, so every output element is a dot
 * product. The determinism contract: y[i][j] is computed by exactly the same
 * float operations whatever n, the tile it falls in, or the thread count:
 *   acc (8 lanes) : lane l accumulates x[k]*w[k] for k = l, l+8, l+16, ...
 *                   (k < in rounded down to 8) with one FMA per step, in
 *                   increasing k;
 *   s = hsum(acc) : a fixed reduction tree ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7));
 *   tail          : s = fmaf(x[k], w[k], s) for the in % 8 remaining k.
 * The register tiles (matmul_avx2.c) only change how many such dot products
 * run side by side, never the order inside one, and the portable C twin
 * below follows the same order (fmaf is the same fused operation), so the
 * result does not depend on the tier either. That is what lets the engine
 * promise bit-identical greedy output alone vs inside a batch.
 *
 * Weights kept in their stored format (GGUF blocks, f16, bf16) go to
 * qmatmul.c, which produces the same bits from them.
 *
 * Parallelism: the output is cut into macro tiles (TILE_M rows of x by
 * TILE_N rows of W, sized so both panels stay in L2) and the threads take
 * macro tiles; inside one, each micro tile keeps its MR x rows hot in L1
 * while streaming NR rows of W. */
#include <math.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define TILE_M 64   /* rows of x per macro tile */
#define TILE_N 48   /* rows of W per macro tile */

/* one dot product in the fixed order of the file comment */
static float dot_ref(const float *x, const float *w, int in) {
    float a[8] = {0};
    const int k8 = in & ~7;
    for (int k = 0; k < k8; k += 8)
        for (int l = 0; l < 8; l++) a[l] = fmaf(x[k + l], w[k + l], a[l]);
    float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for (int k = k8; k < in; k++) s = fmaf(x[k], w[k], s);
    return s;
}

void lethe_cpu_gemm_block(lethe_cpu_isa isa, const float *x, const float *w, float *y,
                          int32_t in, int32_t ldy, int32_t m, int32_t nw) {
    if (isa >= LETHE_ISA_AVX2) {
        lethe_cpu_gemm_block_avx2(x, w, y, in, ldy, m, nw);
        return;
    }
    for (int32_t i = 0; i < m; i++)
        for (int32_t j = 0; j < nw; j++)
            y[(size_t)i * ldy + j] = dot_ref(x + (size_t)i * in, w + (size_t)j * in, in);
}

typedef struct gemm_job {
    lethe_cpu_isa isa;
    float *y;
    const float *x, *w;
    int32_t n, out, in, tm;
} gemm_job;

/* W-block-major task order: consecutive tasks share a W panel */
static void gemm_task(void *ctx, int t, int worker) {
    const gemm_job *j = ctx;
    const int bj = t / j->tm, bi = t % j->tm, i0 = bi * TILE_M, j0 = bj * TILE_N;
    lethe_cpu_gemm_block(j->isa, j->x + (size_t)i0 * j->in, j->w + (size_t)j0 * j->in,
                         j->y + (size_t)i0 * j->out + j0, j->in, j->out,
                         LETHE_MIN(TILE_M, j->n - i0), LETHE_MIN(TILE_N, j->out - j0));
}

void lethe_cpu_matmul(lethe_backend *be, void *y_, const void *x_, const void *w_, int32_t n,
                      int32_t out_dim, int32_t in_dim) {
    LETHE_ASSERT(n >= 0 && out_dim > 0 && in_dim > 0);
    if (n == 0) return;
    float *y = y_;
    const float *x = x_, *w = w_;
    const lethe_cpu_qweight *q = lethe_cpu_qweight_find(be, w_);
    if (q) {
        LETHE_ASSERT(q->rows == out_dim && q->cols == in_dim);
        lethe_cpu_qmatmul(be, q, y, x, n);
        return;
    }
    const int tm = LETHE_CEIL_DIV(n, TILE_M), tn = LETHE_CEIL_DIV(out_dim, TILE_N);
    gemm_job j = {((const lethe_cpu_ctx *)be->ctx)->isa, y, x, w, n, out_dim, in_dim, tm};
    const int n_tasks = tm * tn;
    /* below ~0.2 MFLOP (~20 us on one core) waking the pool costs more than it saves */
    const double flops = 2.0 * n * out_dim * in_dim;
    lethe_cpu_parallel(be, flops < 2e5 ? 1 : lethe_cpu_threads(be), n_tasks, gemm_task, &j);
}

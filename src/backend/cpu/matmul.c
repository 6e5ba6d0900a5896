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
 * The register tiles (MR rows of x times NR rows of W) only change how many
 * such dot products run side by side, never the order inside one; edge tiles
 * are the same kernel instantiated with smaller MR/NR. That is what lets the
 * engine promise bit-identical greedy output alone vs inside a batch.
 *
 * Parallelism: the output is cut into macro tiles (TILE_M rows of x by
 * TILE_N rows of W, sized so both panels stay in L2) and OpenMP threads take
 * macro tiles; inside one, each micro tile keeps its MR x rows hot in L1
 * while streaming NR rows of W. */
#include <immintrin.h>
#include <math.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define MR 4        /* rows of x per register tile */
#define NR 3        /* rows of W per register tile: MR*NR = 12 accumulators */
#define TILE_M 64   /* rows of x per macro tile (multiple of MR) */
#define TILE_N 48   /* rows of W per macro tile (multiple of NR) */

/* Fixed-order horizontal sum of the 8 lanes (see the file comment). */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);                   /* l0+l4, l1+l5, l2+l6, l3+l7 */
    __m128 sh = _mm_movehl_ps(lo, lo);         /* l2+l6, l3+l7 */
    lo = _mm_add_ps(lo, sh);                   /* (0+4)+(2+6), (1+5)+(3+7) */
    sh = _mm_shuffle_ps(lo, lo, 1);
    lo = _mm_add_ss(lo, sh);
    return _mm_cvtss_f32(lo);
}

/* y[r*ldy + c] = dot(x row r, W row c) for r < mr, c < nr (mr <= MR, nr <= NR).
 * Inlined into one function per (mr, nr); the twelve accumulators are named
 * variables (GCC keeps an array of them in memory) and the unused ones are
 * dead code once mr/nr are constants: 12 accumulators + 3 W + 1 x registers. */
static inline __attribute__((always_inline)) void tile_kernel(const float *x, const float *w,
                                                              float *y, int in, int ldy, int mr,
                                                              int nr) {
    const __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z;
    __m256 a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
    const float *x0 = x, *x1 = x + (size_t)in, *x2 = x + 2 * (size_t)in, *x3 = x + 3 * (size_t)in;
    const float *w0 = w, *w1 = w + (size_t)in, *w2 = w + 2 * (size_t)in;
    const int k8 = in & ~7;
#define ROW(r)                                                         \
    {                                                                  \
        const __m256 xv = _mm256_loadu_ps(x##r + k);                   \
        a##r##0 = _mm256_fmadd_ps(xv, wv0, a##r##0);                   \
        if (nr > 1) a##r##1 = _mm256_fmadd_ps(xv, wv1, a##r##1);       \
        if (nr > 2) a##r##2 = _mm256_fmadd_ps(xv, wv2, a##r##2);       \
    }
    for (int k = 0; k < k8; k += 8) {
        const __m256 wv0 = _mm256_loadu_ps(w0 + k);
        const __m256 wv1 = nr > 1 ? _mm256_loadu_ps(w1 + k) : z;
        const __m256 wv2 = nr > 2 ? _mm256_loadu_ps(w2 + k) : z;
        ROW(0)
        if (mr > 1) ROW(1)
        if (mr > 2) ROW(2)
        if (mr > 3) ROW(3)
    }
#undef ROW
    /* the fixed reduction, then the in % 8 tail, per element */
#define FIN(r, c)                                                                  \
    if (mr > r && nr > c) {                                                        \
        float s = hsum8(a##r##c);                                                  \
        for (int k = k8; k < in; k++) s = fmaf(x##r[k], w##c[k], s);               \
        y[(size_t)r * ldy + c] = s;                                                \
    }
    FIN(0, 0) FIN(0, 1) FIN(0, 2) FIN(1, 0) FIN(1, 1) FIN(1, 2)
    FIN(2, 0) FIN(2, 1) FIN(2, 2) FIN(3, 0) FIN(3, 1) FIN(3, 2)
#undef FIN
}

typedef void (*tile_fn)(const float *x, const float *w, float *y, int in, int ldy);

#define DEF_TILE(m, n)                                                                \
    static void tile_##m##x##n(const float *x, const float *w, float *y, int in, int ldy) { \
        tile_kernel(x, w, y, in, ldy, m, n);                                          \
    }
DEF_TILE(1, 1) DEF_TILE(1, 2) DEF_TILE(1, 3)
DEF_TILE(2, 1) DEF_TILE(2, 2) DEF_TILE(2, 3)
DEF_TILE(3, 1) DEF_TILE(3, 2) DEF_TILE(3, 3)
DEF_TILE(4, 1) DEF_TILE(4, 2) DEF_TILE(4, 3)

static const tile_fn tiles[MR + 1][NR + 1] = {
    [1] = {NULL, tile_1x1, tile_1x2, tile_1x3},
    [2] = {NULL, tile_2x1, tile_2x2, tile_2x3},
    [3] = {NULL, tile_3x1, tile_3x2, tile_3x3},
    [4] = {NULL, tile_4x1, tile_4x2, tile_4x3},
};

/* One macro tile: x rows [i0, i1), W rows [j0, j1). */
static void macro_tile(const float *x, const float *w, float *y, int in, int out, int i0, int i1,
                       int j0, int j1) {
    for (int i = i0; i < i1; i += MR) {
        int mr = LETHE_MIN(MR, i1 - i);
        for (int j = j0; j < j1; j += NR) {
            int nr = LETHE_MIN(NR, j1 - j);
            tiles[mr][nr](x + (size_t)i * in, w + (size_t)j * in, y + (size_t)i * out + j, in, out);
        }
    }
}

void lethe_cpu_matmul(lethe_backend *be, void *y_, const void *x_, const void *w_, int32_t n,
                      int32_t out_dim, int32_t in_dim) {
    LETHE_ASSERT(n >= 0 && out_dim > 0 && in_dim > 0);
    if (n == 0) return;
    float *y = y_;
    const float *x = x_, *w = w_;
    const int tm = LETHE_CEIL_DIV(n, TILE_M), tn = LETHE_CEIL_DIV(out_dim, TILE_N);
    const int n_tasks = tm * tn;
    /* below ~1 MFLOP a parallel region costs more than it saves */
    const double flops = 2.0 * n * out_dim * in_dim;
    const int nt = flops < 1e6 ? 1 : LETHE_MIN(lethe_cpu_threads(be), n_tasks);
    /* W-block-major task order: consecutive tasks share a W panel */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int t = 0; t < n_tasks; t++) {
        int bj = t / tm, bi = t % tm;
        int i0 = bi * TILE_M, j0 = bj * TILE_N;
        macro_tile(x, w, y, in_dim, out_dim, i0, LETHE_MIN(i0 + TILE_M, n), j0,
                   LETHE_MIN(j0 + TILE_N, out_dim));
    }
}

/* matmul_avx2.c - the AVX2/FMA register tiles of the f32 GEMM (matmul.c
 * states the order every dot product follows; this file is compiled with
 * -mavx2 -mfma and only called when cpu_isa.c found them working).
 *
 * A register tile is MR rows of x times NR rows of W; edge tiles are the
 * same kernel instantiated with smaller MR/NR, so the float operations of
 * one dot product never depend on the tile it falls in. */
#include <immintrin.h>
#include <math.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd_avx2.h"
#include "core/util.h"

#define MR 4 /* rows of x per register tile */
#define NR 3 /* rows of W per register tile: MR*NR = 12 accumulators */

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
#define ROW(r)                                                   \
    {                                                            \
        const __m256 xv = _mm256_loadu_ps(x##r + k);             \
        a##r##0 = _mm256_fmadd_ps(xv, wv0, a##r##0);             \
        if (nr > 1) a##r##1 = _mm256_fmadd_ps(xv, wv1, a##r##1); \
        if (nr > 2) a##r##2 = _mm256_fmadd_ps(xv, wv2, a##r##2); \
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
#define FIN(r, c)                                                    \
    if (mr > r && nr > c) {                                          \
        float s = lethe_hsum8(a##r##c);                              \
        for (int k = k8; k < in; k++) s = fmaf(x##r[k], w##c[k], s); \
        y[(size_t)r * ldy + c] = s;                                  \
    }
    FIN(0, 0)
    FIN(0, 1) FIN(0, 2) FIN(1, 0) FIN(1, 1) FIN(1, 2) FIN(2, 0) FIN(2, 1) FIN(2, 2) FIN(3, 0)
        FIN(3, 1) FIN(3, 2)
#undef FIN
}

typedef void (*tile_fn)(const float *x, const float *w, float *y, int in, int ldy);

#define DEF_TILE(m, n)                                                                      \
    static void tile_##m##x##n(const float *x, const float *w, float *y, int in, int ldy) { \
        tile_kernel(x, w, y, in, ldy, m, n);                                                \
    }
DEF_TILE(1, 1)
DEF_TILE(1, 2) DEF_TILE(1, 3) DEF_TILE(2, 1) DEF_TILE(2, 2) DEF_TILE(2, 3) DEF_TILE(3, 1)
    DEF_TILE(3, 2) DEF_TILE(3, 3) DEF_TILE(4, 1) DEF_TILE(4, 2) DEF_TILE(4, 3)

        static const tile_fn tiles[MR + 1][NR + 1] = {
            [1] = {NULL, tile_1x1, tile_1x2, tile_1x3},
            [2] = {NULL, tile_2x1, tile_2x2, tile_2x3},
            [3] = {NULL, tile_3x1, tile_3x2, tile_3x3},
            [4] = {NULL, tile_4x1, tile_4x2, tile_4x3},
};

void lethe_cpu_gemm_block_avx2(const float *x, const float *w, float *y, int32_t in, int32_t ldy,
                               int32_t m, int32_t nw) {
    for (int i = 0; i < m; i += MR) {
        int mr = LETHE_MIN(MR, m - i);
        for (int j = 0; j < nw; j += NR) {
            int nr = LETHE_MIN(NR, nw - j);
            tiles[mr][nr](x + (size_t)i * in, w + (size_t)j * in, y + (size_t)i * ldy + j, in, ldy);
        }
    }
}

/* test_qmatmul.c - matmul on stored-format weights (backend/cpu/qmatmul.c).
 *
 * For every format the CPU keeps as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, f16, bf16): random blocks (random quants,
 * sane f16 scales) as a [rows, cols] weight, uploaded with weight_upload_raw
 * and, as the reference, dequantized (lethe_ggml_dequantize) and uploaded as
 * f32. Then for n = 1, 2, 3, 5, 64, 70 rows of x, on the AVX2 tier and the
 * portable C tier, and 1 and 2 threads:
 *   - bit-identical to the f32 matmul on the dequantized matrix: the error
 *     bound per format is 0 ulp (the design: same decoded values, same order);
 *   - within 1e-5 * sum_k |x_k w_k| of a double-precision dot product (the
 *     f32 GEMM's own rounding, so the reference itself is checked too);
 * the embed op decodes the same rows; the registry refuses what it cannot
 * hold (fp32 mode, f32 type, odd shapes) and a pointer into a stored weight
 * is not mistaken for an f32 weight. That is the exact mode; the default
 * (native) mode's 16-bit activations are checked by test_q8_formats. Also
 * the thread pool (pool.c). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"
#include "test.h"

static uint64_t g_rng = 0x1234abcdull;
static uint32_t rnd(void) { return (uint32_t)(lethe_splitmix64(&g_rng) >> 32); }

/* a positive f16 in about [2^-9, 2^-3] */
static void put_f16(uint8_t *p) {
    uint16_t h = (uint16_t)(((6 + rnd() % 7) << 10) | (rnd() & 0x3ff));
    memcpy(p, &h, 2);
}

typedef struct fmt {
    lethe_ggml_type t;
    int block, bytes;
    int f16_at[2]; /* byte offsets of the block's f16 scales (-1: none) */
} fmt;

static const fmt g_fmts[] = {
    {LETHE_GGML_Q4_0, 32, 18, {0, -1}},     {LETHE_GGML_Q4_1, 32, 20, {0, 2}},
    {LETHE_GGML_Q5_0, 32, 22, {0, -1}},     {LETHE_GGML_Q5_1, 32, 24, {0, 2}},
    {LETHE_GGML_Q8_0, 32, 34, {0, -1}},     {LETHE_GGML_Q2_K, 256, 84, {80, 82}},
    {LETHE_GGML_Q3_K, 256, 110, {108, -1}}, {LETHE_GGML_Q4_K, 256, 144, {0, 2}},
    {LETHE_GGML_Q5_K, 256, 176, {0, 2}},    {LETHE_GGML_Q6_K, 256, 210, {208, -1}},
    {LETHE_GGML_F16, 1, 2, {0, -1}},        {LETHE_GGML_BF16, 1, 2, {-1, -1}},
};

static void fill_blocks(const fmt *f, uint8_t *data, size_t n_blocks) {
    for (size_t b = 0; b < n_blocks; b++) {
        uint8_t *p = data + b * (size_t)f->bytes;
        for (int i = 0; i < f->bytes; i++) p[i] = (uint8_t)rnd();
        for (int i = 0; i < 2; i++)
            if (f->f16_at[i] >= 0) put_f16(p + f->f16_at[i]);
        if (f->t == LETHE_GGML_F16 && (rnd() & 1)) p[1] ^= 0x80; /* signs */
        if (f->t == LETHE_GGML_BF16) { /* a finite bf16 in about +-[2^-8, 2] */
            uint16_t h = (uint16_t)(((rnd() & 1) << 15) | ((119 + rnd() % 9) << 7) |
                                    (rnd() & 0x7f));
            memcpy(p, &h, 2);
        }
    }
}

static void set_isa(lethe_backend *be, lethe_cpu_isa isa) { ((lethe_cpu_ctx *)be->ctx)->isa = isa; }

static void check_format(lethe_backend *be, const fmt *f, int32_t rows, int32_t cols) {
    const size_t n_el = (size_t)rows * cols, n_blocks = n_el / f->block;
    uint8_t *data = lethe_xmalloc(n_blocks * f->bytes);
    fill_blocks(f, data, n_blocks);
    float *wf = lethe_xmalloc(n_el * 4);
    CHECK(lethe_ggml_dequantize(f->t, data, wf, n_el) == LETHE_OK);
    lethe_weight_raw raw = {.type = f->t, .rows = rows, .cols = cols, .data = data};
    void *wq = NULL, *w32 = NULL;
    CHECK_MSG(be->ops->weight_upload_raw(be, &raw, &wq) == LETHE_OK, "%s: %s",
              lethe_ggml_type_name(f->t), lethe_last_error());
    CHECK(be->ops->weight_upload(be, wf, n_el, &w32) == LETHE_OK);
    CHECK(lethe_cpu_qweight_find(be, wq) != NULL && lethe_cpu_qweight_find(be, w32) == NULL);

    const int32_t ns[] = {1, 2, 3, 5, 64, 70}, nmax = 70;
    float *x = lethe_xmalloc((size_t)nmax * cols * 4);
    for (size_t i = 0; i < (size_t)nmax * cols; i++)
        x[i] = (float)((int32_t)(rnd() % 2001) - 1000) * 1e-3f;
    float *yq = lethe_xmalloc((size_t)nmax * rows * 4),
          *yr = lethe_xmalloc((size_t)nmax * rows * 4);
    const lethe_cpu_isa tiers[] = {LETHE_ISA_AVX2, LETHE_ISA_SCALAR};
    for (size_t ti = 0; ti < LETHE_ARRAY_LEN(tiers); ti++)
        for (int threads = 1; threads <= 2; threads++)
            for (size_t ni = 0; ni < LETHE_ARRAY_LEN(ns); ni++) {
                const int32_t n = ns[ni];
                be->n_threads = threads;
                set_isa(be, LETHE_ISA_AVX2); /* the reference: the f32 path, AVX2 tiles */
                be->ops->matmul(be, yr, x, w32, n, rows, cols);
                set_isa(be, tiers[ti]);
                memset(yq, 0xff, (size_t)n * rows * 4);
                be->ops->matmul(be, yq, x, wq, n, rows, cols);
                for (int32_t i = 0; i < n; i++)
                    for (int32_t j = 0; j < rows; j++) {
                        const size_t e = (size_t)i * rows + j;
                        CHECK_MSG(!memcmp(&yq[e], &yr[e], 4),
                                  "%s %s n=%d threads %d: y[%d][%d] = %.9g, f32 path %.9g",
                                  lethe_ggml_type_name(f->t), lethe_cpu_isa_name(tiers[ti]), n,
                                  threads, i, j, (double)yq[e], (double)yr[e]);
                    }
            }
    set_isa(be, LETHE_ISA_AVX2);
    /* against double precision (first 3 rows of x) */
    for (int32_t i = 0; i < 3; i++)
        for (int32_t j = 0; j < rows; j++) {
            double s = 0, mag = 0;
            for (int32_t k = 0; k < cols; k++) {
                double p = (double)x[(size_t)i * cols + k] * wf[(size_t)j * cols + k];
                s += p, mag += fabs(p);
            }
            double err = fabs(yq[(size_t)i * rows + j] - s);
            CHECK_MSG(err <= 1e-5 * mag + 1e-30, "%s: y[%d][%d] = %.9g, double %.9g (|xw| %g)",
                      lethe_ggml_type_name(f->t), i, j, (double)yq[(size_t)i * rows + j], s, mag);
        }
    /* embed decodes the same rows */
    int32_t tok[3] = {0, rows - 1, rows / 2};
    float *e = lethe_xmalloc((size_t)3 * cols * 4);
    be->ops->embed(be, e, wq, tok, 3, cols);
    for (int r = 0; r < 3; r++)
        CHECK(!memcmp(e + (size_t)r * cols, wf + (size_t)tok[r] * cols, (size_t)cols * 4));
    be->ops->release(be, wq);
    be->ops->release(be, w32);
    free(e), free(x), free(yq), free(yr), free(wf), free(data);
}

static void test_formats(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 2, .cpu_weights = LETHE_CPU_WEIGHTS_EXACT};
    lethe_backend *be = NULL;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    for (size_t i = 0; i < LETHE_ARRAY_LEN(g_fmts); i++) {
        const fmt *f = &g_fmts[i];
        /* 37 rows: not a multiple of the 4-row kernel, the 16-row task or the 48-row panel */
        check_format(be, f, 37, f->block == 256 ? 512 : 96);
        check_format(be, f, 101, f->block == 256 ? 256 : 576);
        fprintf(stderr, "    %s: bit-identical to the f32 path\n", lethe_ggml_type_name(f->t));
    }
    lethe_backend_destroy(be);
}

/* The default (native) mode: block formats with a qdot kernel multiply with
 * x rounded to 16 bits per 32-element block. For every such format: the same
 * bits on every tier (vnni, avx2, scalar), thread count and n (row i of an
 * n-row product equals row i of the 70-row one: batch invariance), and
 * within the bound of qdot.h of the double-precision product on the
 * dequantized matrix: sum over blocks of (d_b / 2) * sum |w_k| (the rounding
 * of x) plus f32 rounding. Formats without a kernel (f16, bf16, Q2_K, Q3_K)
 * stay bit-identical to the f32 path. A non-finite x gives NaN. */
static void check_q8(lethe_backend *be, const fmt *f, int32_t rows, int32_t cols) {
    const size_t n_el = (size_t)rows * cols, n_blocks = n_el / f->block;
    uint8_t *data = lethe_xmalloc(n_blocks * f->bytes);
    fill_blocks(f, data, n_blocks);
    float *wf = lethe_xmalloc(n_el * 4);
    CHECK(lethe_ggml_dequantize(f->t, data, wf, n_el) == LETHE_OK);
    lethe_weight_raw raw = {.type = f->t, .rows = rows, .cols = cols, .data = data};
    void *wq = NULL, *w32 = NULL;
    CHECK(be->ops->weight_upload_raw(be, &raw, &wq) == LETHE_OK);
    CHECK(be->ops->weight_upload(be, wf, n_el, &w32) == LETHE_OK);
    const bool q8 = f->t != LETHE_GGML_F16 && f->t != LETHE_GGML_BF16 && f->t != LETHE_GGML_Q2_K &&
                    f->t != LETHE_GGML_Q3_K;
    const int32_t ns[] = {1, 2, 3, 5, 64, 70}, nmax = 70;
    float *x = lethe_xmalloc((size_t)nmax * cols * 4);
    for (size_t i = 0; i < (size_t)nmax * cols; i++) /* outliers: the 16-bit rounding shows */
        x[i] = (float)((int32_t)(rnd() % 2001) - 1000) * (i % 97 == 5 ? 3.0f : 1e-3f);
    float *ref = lethe_xmalloc((size_t)nmax * rows * 4), *y = lethe_xmalloc((size_t)nmax * rows * 4);
    const lethe_cpu_isa best = lethe_cpu_isa_detect();
    set_isa(be, best);
    be->n_threads = 2;
    be->ops->matmul(be, ref, x, wq, nmax, rows, cols);
    if (!q8) { /* f32 path: the same bits as the dequantized matrix */
        be->ops->matmul(be, y, x, w32, nmax, rows, cols);
        CHECK(!memcmp(y, ref, (size_t)nmax * rows * 4));
    }
    const lethe_cpu_isa tiers[] = {LETHE_ISA_AVX2_VNNI, LETHE_ISA_AVX2, LETHE_ISA_SCALAR};
    for (size_t ti = 0; ti < LETHE_ARRAY_LEN(tiers); ti++) {
        if (tiers[ti] > best) continue;
        for (int threads = 1; threads <= 2; threads++)
            for (size_t ni = 0; ni < LETHE_ARRAY_LEN(ns); ni++) {
                const int32_t n = ns[ni];
                set_isa(be, tiers[ti]);
                be->n_threads = threads;
                memset(y, 0xff, (size_t)n * rows * 4);
                be->ops->matmul(be, y, x, wq, n, rows, cols);
                for (size_t e = 0; e < (size_t)n * rows; e++)
                    CHECK_MSG(!memcmp(&y[e], &ref[e], 4), "%s %s n=%d threads %d: y[%zu] = %.9g, not %.9g",
                              lethe_ggml_type_name(f->t), lethe_cpu_isa_name(tiers[ti]), n, threads,
                              e, (double)y[e], (double)ref[e]);
            }
    }
    set_isa(be, best);
    double worst = 0;
    for (int32_t i = 0; i < nmax; i++)
        for (int32_t j = 0; j < rows; j++) {
            double s = 0, mag = 0, bound = 0;
            for (int32_t b = 0; b < cols / 32; b++) {
                double amax = 0, wabs = 0;
                for (int32_t k = 32 * b; k < 32 * b + 32; k++) {
                    const double xv = x[(size_t)i * cols + k], wv = wf[(size_t)j * cols + k];
                    s += xv * wv, mag += fabs(xv * wv), wabs += fabs(wv);
                    amax = fmax(amax, fabs(xv));
                }
                bound += amax / 32767.0 / 2.0 * wabs;
            }
            const double err = fabs(ref[(size_t)i * rows + j] - s);
            const double lim = q8 ? bound * (1 + 1e-5) + 2e-5 * mag + 1e-30 : 1e-5 * mag + 1e-30;
            CHECK_MSG(err <= lim, "%s: y[%d][%d] = %.9g, double %.9g (bound %g)",
                      lethe_ggml_type_name(f->t), i, j, (double)ref[(size_t)i * rows + j], s, lim);
            if (bound > 0) worst = fmax(worst, err / bound);
        }
    if (q8) { /* the rounding is real: not the f32 path's bits */
        be->ops->matmul(be, y, x, w32, nmax, rows, cols);
        CHECK(memcmp(y, ref, (size_t)nmax * rows * 4) != 0);
        x[3] = NAN; /* a non-finite x: NaN out, as on the f32 path */
        be->ops->matmul(be, y, x, wq, 1, rows, cols);
        for (int32_t j = 0; j < rows; j++) CHECK(isnan(y[j]));
        fprintf(stderr, "    %s: 16-bit activations, worst error %.2f of the bound\n",
                lethe_ggml_type_name(f->t), worst);
    }
    be->ops->release(be, wq);
    be->ops->release(be, w32);
    free(x), free(y), free(ref), free(wf), free(data);
}

static void test_q8_formats(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 2}; /* native: the default */
    lethe_backend *be = NULL;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    for (size_t i = 0; i < LETHE_ARRAY_LEN(g_fmts); i++) {
        const fmt *f = &g_fmts[i];
        check_q8(be, f, 37, f->block == 256 ? 512 : 96);
        check_q8(be, f, 101, f->block == 256 ? 256 : 576);
    }
    lethe_backend_destroy(be);
}

static void test_refusals(void) {
    uint8_t blk[64] = {0};
    void *w = NULL;
    lethe_backend *be = NULL;
    lethe_backend_params fp = {.device = "cpu", .cpu_weights = LETHE_CPU_WEIGHTS_FP32};
    CHECK(lethe_backend_create(&fp, &be) == LETHE_OK);
    lethe_weight_raw r = {.type = LETHE_GGML_Q8_0, .rows = 1, .cols = 32, .data = blk};
    CHECK(be->ops->weight_upload_raw(be, &r, &w) == LETHE_ERR_UNSUPPORTED); /* fp32 mode */
    lethe_backend_destroy(be);
    lethe_backend_params np = {.device = "cpu"};
    CHECK(lethe_backend_create(&np, &be) == LETHE_OK);
    lethe_weight_raw f32 = {.type = LETHE_GGML_F32, .rows = 1, .cols = 8, .data = blk};
    CHECK(be->ops->weight_upload_raw(be, &f32, &w) == LETHE_ERR_UNSUPPORTED);
    lethe_weight_raw odd = {.type = LETHE_GGML_F16, .rows = 1, .cols = 12, .data = blk};
    CHECK(be->ops->weight_upload_raw(be, &odd, &w) == LETHE_ERR_UNSUPPORTED);
    lethe_weight_raw bad = {.type = LETHE_GGML_Q4_0, .rows = 1, .cols = 48, .data = blk};
    CHECK(be->ops->weight_upload_raw(be, &bad, &w) == LETHE_ERR_UNSUPPORTED); /* not whole blocks */
    lethe_weight_raw two = {.type = LETHE_GGML_Q8_0, .rows = 1, .cols = 32, .data = blk};
    void *a = NULL, *b = NULL;
    CHECK(be->ops->weight_upload_raw(be, &two, &a) == LETHE_OK);
    CHECK(be->ops->weight_upload_raw(be, &two, &b) == LETHE_OK);
    CHECK(lethe_cpu_qweight_find(be, a) && lethe_cpu_qweight_find(be, b) && a != b);
    be->ops->release(be, a);
    CHECK(!lethe_cpu_qweight_find(be, a) && lethe_cpu_qweight_find(be, b));
    lethe_backend_destroy(be); /* frees b */
    int cw = -1;
    CHECK(lethe_cpu_weights_parse("fp32", &cw) == LETHE_OK && cw == LETHE_CPU_WEIGHTS_FP32);
    CHECK(lethe_cpu_weights_parse("exact", &cw) == LETHE_OK && cw == LETHE_CPU_WEIGHTS_EXACT);
    CHECK(lethe_cpu_weights_parse("native", &cw) == LETHE_OK && cw == LETHE_CPU_WEIGHTS_NATIVE);
    CHECK(lethe_cpu_weights_parse("int4", &cw) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "--cpu-weights int4");
}

/* the pool: every task runs exactly once, worker ids stay below the thread
 * count, nested calls run inline, and 2000 back-to-back jobs (the decode
 * pattern: spin-wake) and jobs after a sleep (futex wake) complete */
typedef struct pool_ctx {
    int *hits;
    int n_threads, bad_worker;
    lethe_cpu_pool *p;
} pool_ctx;

static void nested_task(void *ctx, int t, int worker) { ((pool_ctx *)ctx)->hits[t] += 100; }

static void pool_task(void *ctx, int t, int worker) {
    pool_ctx *c = ctx;
    __atomic_fetch_add(&c->hits[t], 1, __ATOMIC_RELAXED);
    if (worker < 0 || worker >= c->n_threads) __atomic_store_n(&c->bad_worker, 1, __ATOMIC_RELAXED);
}

static void test_pool(void) {
    lethe_cpu_pool *p = lethe_cpu_pool_create();
    CHECK(p);
    int hits[300];
    for (int job = 0; job < 2000; job++) {
        const int n_tasks = 1 + job % 300, nt = 1 + job % 5;
        memset(hits, 0, sizeof(hits));
        pool_ctx c = {hits, nt, 0, p};
        lethe_cpu_pool_run(p, nt, n_tasks, pool_task, &c);
        for (int t = 0; t < n_tasks; t++)
            CHECK_MSG(hits[t] == 1, "job %d task %d ran %d times", job, t, hits[t]);
        CHECK(!c.bad_worker);
        if (job % 500 == 499) usleep(200000); /* workers fall asleep: futex wake next */
    }
    memset(hits, 0, sizeof(hits));
    pool_ctx c = {hits, 1, 0, p};
    lethe_cpu_pool_run(p, 1, 7, nested_task, &c); /* one thread: inline */
    for (int t = 0; t < 7; t++) CHECK(hits[t] == 100);
    lethe_cpu_pool_destroy(p);
}

int main(void) {
    fprintf(stderr, "cpu kernel tier: %s\n", lethe_cpu_isa_name(lethe_cpu_isa_detect()));
    TEST_RUN(test_formats);
    TEST_RUN(test_q8_formats);
    TEST_RUN(test_refusals);
    TEST_RUN(test_pool);
    fprintf(stderr, "test_qmatmul: ok\n");
    return 0;
}

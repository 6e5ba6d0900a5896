/* test_cuda_row_topk.c - ops->row_topk on CUDA (backend/cuda/select.cu)
 * against its CPU twin (backend/cpu/select.c, itself checked against a full
 * sort in tests/test_select_ops.c). Needs a CUDA device (make test-gpu);
 * a few seconds.
 *
 * Scores are rounded to bf16 on the host, so both backends rank the same
 * values and the outputs must be identical, index for index:
 *  - DeltaKV's shapes: n 1024 rows, m 1024 .. 16384 columns, k 4, causal
 *    limits (row i sees the columns before it, growing to m), bias -|c|^2,
 *    alpha 2;
 *  - edge cases: k 1, 5, 8, 16; rows with limit 0 and limits below k; m 1;
 *    heavy ties (a few distinct values), NaN, +-inf, +-0; no bias; alpha -1;
 *    more columns than the block has threads and fewer. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "lethe.h"
#include "test.h"

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 4242;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f; /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static float frand(void) { return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0); }

/* kind 0: random (DeltaKV-like dot products), 1: 5 distinct values (ties),
 * 2: specials (NaN, +-inf, +-0, 1, -1), 3: all equal */
static float draw(int kind) {
    const uint64_t r = lethe_splitmix64(&g_rng);
    switch (kind) {
    case 0: return frand() * 40.0f;
    case 1: return (float)((int)(r % 5) - 2) * 0.5f;
    case 2: {
        static const float sp[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f, 0.25f};
        return sp[r % 8];
    }
    default: return 2.0f;
    }
}

typedef struct rcase {
    const char *name;
    int32_t n, m, k;
    int kind;        /* draw() kind of the scores */
    int lim_mode;    /* 0 causal (grows to m), 1 mixed (0, 1, < k, m, random), 2 all m */
    int bias;        /* 0 none, 1 -|c|^2-like (negative, random), 2 from the tie set */
    float alpha;
} rcase;

static int run_case(const rcase *t) {
    const size_t nm = (size_t)t->n * t->m;
    float *x = lethe_xmalloc(nm * sizeof(float)), *bias = lethe_xmalloc((size_t)t->m * sizeof(float));
    int32_t *lim = lethe_xmalloc((size_t)t->n * sizeof(int32_t));
    int32_t *oc = lethe_xmalloc(((size_t)t->n * t->k + 1) * sizeof(int32_t));
    int32_t *og = lethe_xmalloc(((size_t)t->n * t->k + 1) * sizeof(int32_t));
    for (size_t i = 0; i < nm; i++) x[i] = bf16_round(draw(t->kind));
    for (int32_t c = 0; c < t->m; c++)
        bias[c] = t->bias == 1 ? -(300.0f + 50.0f * frand()) : t->bias == 2 ? draw(1) : 0.0f;
    for (int32_t i = 0; i < t->n; i++) {
        int32_t l = t->m;
        if (t->lim_mode == 0) l = (int32_t)LETHE_MIN((int64_t)t->m, 1 + (int64_t)t->m * i / LETHE_MAX(1, t->n - 1));
        if (t->lim_mode == 1) {
            const int32_t opts[6] = {0, 1, LETHE_MAX(0, t->k - 1), t->m, t->m / 3,
                                     (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)(t->m + 1))};
            l = LETHE_MIN(opts[i % 6], t->m);
        }
        lim[i] = l;
    }
    void *xc = NULL, *xg = NULL;
    CHECK(g_cpu->ops->alloc(g_cpu, nm * g_cpu->ops->act_size, &xc) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, nm * g_gpu->ops->act_size, &xg) == LETHE_OK);
    g_cpu->ops->act_from_host(g_cpu, xc, x, nm);
    g_gpu->ops->act_from_host(g_gpu, xg, x, nm);
    const size_t no = (size_t)t->n * t->k;
    for (size_t i = 0; i <= no; i++) oc[i] = og[i] = -7;
    const float *b = t->bias ? bias : NULL;
    g_cpu->ops->row_topk(g_cpu, oc, xc, t->n, t->m, lim, t->k, t->alpha, b);
    g_gpu->ops->row_topk(g_gpu, og, xg, t->n, t->m, lim, t->k, t->alpha, b);
    int bad = 0;
    CHECK_MSG(oc[no] == -7 && og[no] == -7, "%s: wrote past the output", t->name);
    for (int32_t i = 0; i < t->n && bad < 5; i++)
        for (int32_t j = 0; j < t->k; j++) {
            const size_t o = (size_t)i * t->k + j;
            if (oc[o] != og[o] || (j >= lim[i]) != (oc[o] < 0)) {
                fprintf(stderr, "  %s: row %d (lim %d) [%d]: cuda %d, cpu %d\n", t->name, i, lim[i], j, og[o], oc[o]);
                bad++;
            }
        }
    g_cpu->ops->release(g_cpu, xc);
    g_gpu->ops->release(g_gpu, xg);
    free(x), free(bias), free(lim), free(oc), free(og);
    return bad;
}

static void test_row_topk(void) {
    const rcase cases[] = {
        /* DeltaKV's tiles: 1024 tokens against the centers before them */
        {"deltakv 1024x1024", 1024, 1024, 4, 0, 0, 1, 2.0f},
        {"deltakv 1024x4096", 1024, 4096, 4, 0, 0, 1, 2.0f},
        {"deltakv 1024x16384", 1024, 16384, 4, 0, 0, 1, 2.0f},
        {"deltakv 1024x16384 full rows", 1024, 16384, 4, 0, 2, 1, 2.0f},
        {"deltakv 300x13000 k 8", 300, 13000, 8, 0, 0, 1, 2.0f},
        /* edge cases */
        {"ties k 4", 64, 700, 4, 1, 1, 2, 2.0f},
        {"ties no bias k 16", 64, 700, 16, 1, 1, 0, 2.0f},
        {"all equal k 5", 32, 300, 5, 3, 1, 0, 1.0f},
        {"specials k 4", 64, 500, 4, 2, 1, 2, 2.0f},
        {"specials no bias k 16", 64, 97, 16, 2, 1, 0, -1.0f},
        {"specials alpha -1 k 8", 48, 2000, 8, 2, 2, 0, -1.0f},
        {"m 1 k 1", 8, 1, 1, 0, 1, 1, 2.0f},
        {"m 1 k 16", 8, 1, 16, 0, 2, 0, 2.0f},
        {"m 3 k 4", 16, 3, 4, 1, 1, 2, 2.0f},
        {"m 100 k 1", 100, 100, 1, 0, 0, 1, 2.0f},
        {"mixed limits k 4", 600, 5000, 4, 0, 1, 1, 2.0f},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) {
        const rcase t = cases[i];
        const int bad = run_case(&t);
        CHECK_MSG(bad == 0, "row_topk %s: CUDA differs from the CPU twin", t.name);
        fprintf(stderr, "    %-32s n %5d m %5d k %2d: identical\n", t.name, t.n, t.m, t.k);
    }
    /* every row's limit 0 (the early return without a launch) */
    {
        float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        void *xg = NULL;
        CHECK(g_gpu->ops->alloc(g_gpu, 8 * g_gpu->ops->act_size, &xg) == LETHE_OK);
        g_gpu->ops->act_from_host(g_gpu, xg, x, 8);
        int32_t lim[2] = {0, 0}, o[9];
        for (int i = 0; i < 9; i++) o[i] = -7;
        g_gpu->ops->row_topk(g_gpu, o, xg, 2, 4, lim, 4, 2.0f, NULL);
        for (int i = 0; i < 8; i++) CHECK(o[i] == -1);
        CHECK(o[8] == -7);
        lim[1] = 4; /* one row with all columns, k 4: 3, 2, 1, 0 (row 1 is x[4..8)) */
        g_gpu->ops->row_topk(g_gpu, o, xg, 2, 4, lim, 4, 2.0f, NULL);
        CHECK(o[0] == -1 && o[3] == -1 && o[4] == 3 && o[5] == 2 && o[6] == 1 && o[7] == 0);
        g_gpu->ops->release(g_gpu, xg);
    }
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pg, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    CHECK(g_gpu->ops->row_topk && g_cpu->ops->row_topk);
    TEST_RUN(test_row_topk);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_row_topk: all passed\n");
    return 0;
}

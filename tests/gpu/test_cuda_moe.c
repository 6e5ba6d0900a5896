/* test_cuda_moe.c - the CUDA mixture-of-experts op (backend/cuda/moe.cu)
 * against its CPU twin (backend/cpu/moe.c).
 *
 * Inputs are rounded to bf16 on the host so both backends route from the same
 * logits (ties: smaller expert id on both); the CPU computes in fp32, the GPU
 * keeps the expert activations in bf16. Shapes: Qwen3-30B-A3B's (128 experts,
 * 8 per token, dim 2048, expert FFN 768) at batch 1 and 64, GLM-4.7-Flash's
 * router (sigmoid + selection bias, normalized, scale 1.8), group-limited
 * routing (4 groups, 2 kept), token counts above LETHE_MOE_SMALL_N (the
 * grouped-GEMM path), and the decode path captured in a CUDA
 * graph and replayed (bit-identical to the eager call). The output buffer is
 * NaN-poisoned, so an unwritten row fails; with accumulate it starts as the
 * same random residual rows on both backends. Batches with 4 P <= E take
 * the fused down + combine kernel. Needs a CUDA device. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "test.h"

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 77;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float *rand_bf16(size_t n, float scale) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = bf16_round(
            (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0) * scale);
    return v;
}

typedef struct pair {
    void *c, *g;
} pair;

static pair act(const float *host, size_t n) {
    pair p;
    CHECK(g_cpu->ops->alloc(g_cpu, n * g_cpu->ops->act_size, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, n * g_gpu->ops->act_size, &p.g) == LETHE_OK);
    if (host) {
        g_cpu->ops->act_from_host(g_cpu, p.c, host, n);
        g_gpu->ops->act_from_host(g_gpu, p.g, host, n);
    }
    return p;
}

static pair weight(const float *host, size_t n) {
    pair p;
    CHECK(g_cpu->ops->weight_upload(g_cpu, host, n, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->weight_upload(g_gpu, host, n, &p.g) == LETHE_OK);
    return p;
}

static pair raw(size_t cpu_bytes, size_t gpu_bytes) {
    pair p;
    CHECK(g_cpu->ops->alloc(g_cpu, cpu_bytes, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, gpu_bytes, &p.g) == LETHE_OK);
    return p;
}

static void release(pair *p) {
    if (p->c) g_cpu->ops->release(g_cpu, p->c);
    if (p->g) g_gpu->ops->release(g_gpu, p->g);
    p->c = p->g = NULL;
}

typedef struct moe_case {
    int32_t n, dim, ffn, E, k, scoring;
    bool norm, bias;
    float scale;
    int32_t n_group, topk_group;
    const char *what;
    bool acc; /* lethe_moe_args.accumulate: out starts as a random residual stream */
} moe_case;

static void run_case(const moe_case *t, bool graph) {
    const int32_t n = t->n, dim = t->dim, ffn = t->ffn, E = t->E;
    float *x = rand_bf16((size_t)n * dim, 1.0f);
    float *lg = rand_bf16((size_t)n * E, 3.0f);
    float *b = rand_bf16((size_t)E, 0.3f);
    const float ws = 1.0f / sqrtf((float)dim), wd = 1.0f / sqrtf((float)ffn);
    float *wg = rand_bf16((size_t)E * ffn * dim, 2 * ws),
          *wu = rand_bf16((size_t)E * ffn * dim, 2 * ws);
    float *wdn = rand_bf16((size_t)E * dim * ffn, 2 * wd);
    pair px = act(x, (size_t)n * dim), pl = act(lg, (size_t)n * E),
         pout = act(NULL, (size_t)n * dim);
    pair pb = t->bias ? weight(b, (size_t)E) : (pair){NULL, NULL};
    pair pg = weight(wg, (size_t)E * ffn * dim), pu = weight(wu, (size_t)E * ffn * dim);
    pair pd = weight(wdn, (size_t)E * dim * ffn);
    const size_t wsc = lethe_moe_ws_bytes(g_cpu, n, t->k, dim, ffn, E);
    const size_t wsg = lethe_moe_ws_bytes(g_gpu, n, t->k, dim, ffn, E);
    pair pw = raw(wsc, wsg);
    /* out before the call: NaN (must be overwritten), or with accumulate the
     * same bf16 residual rows on both backends (must be added to) */
    float *nan = lethe_xmalloc((size_t)n * dim * sizeof(float));
    float *res = rand_bf16((size_t)n * dim, 0.25f); /* about the routed sum's size */
    for (size_t i = 0; i < (size_t)n * dim; i++) nan[i] = NAN;
    const float *before = t->acc ? res : nan;
    g_gpu->ops->act_from_host(g_gpu, pout.g, before, (size_t)n * dim);
    g_cpu->ops->act_from_host(g_cpu, pout.c, before, (size_t)n * dim);

    lethe_moe_args a = {.n = n,
                        .dim = dim,
                        .ffn = ffn,
                        .n_experts = E,
                        .k = t->k,
                        .scoring = t->scoring,
                        .norm_topk = t->norm,
                        .scale = t->scale,
                        .n_group = t->n_group,
                        .topk_group = t->topk_group,
                        .accumulate = t->acc};
    lethe_moe_args ac = a, ag = a;
    ac.out = pout.c, ac.x = px.c, ac.logits = pl.c, ac.bias = pb.c, ac.w_gate = pg.c;
    ac.w_up = pu.c, ac.w_down = pd.c, ac.ws = pw.c, ac.ws_bytes = wsc;
    ag.out = pout.g, ag.x = px.g, ag.logits = pl.g, ag.bias = pb.g, ag.w_gate = pg.g;
    ag.w_up = pu.g, ag.w_down = pd.g, ag.ws = pw.g, ag.ws_bytes = wsg;
    g_cpu->ops->moe(g_cpu, &ac);
    g_gpu->ops->moe(g_gpu, &ag);

    float *got = lethe_xmalloc((size_t)n * dim * sizeof(float));
    float *want = lethe_xmalloc((size_t)n * dim * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, got, pout.g, (size_t)n * dim);
    g_cpu->ops->act_to_host(g_cpu, want, pout.c, (size_t)n * dim);
    for (size_t i = 0; i < (size_t)n * dim; i++)
        CHECK_MSG(isfinite(got[i]), "%s: element %zu not finite", t->what, i);
    double e = rel_err(got, want, (size_t)n * dim);
    fprintf(stderr, "    %s: rel err %.2e\n", t->what, e);
    CHECK_MSG(e < 2e-2, "%s: relative error %.3g", t->what, e);
    if (t->acc) { /* what was added, apart from the residual */
        float *dg = lethe_xmalloc((size_t)n * dim * sizeof(float));
        float *dw = lethe_xmalloc((size_t)n * dim * sizeof(float));
        for (size_t i = 0; i < (size_t)n * dim; i++) dg[i] = got[i] - res[i], dw[i] = want[i] - res[i];
        const double ed = rel_err(dg, dw, (size_t)n * dim);
        fprintf(stderr, "    %s: added part rel err %.2e\n", t->what, ed);
        CHECK_MSG(ed < 2e-2, "%s: added part relative error %.3g", t->what, ed);
        free(dg), free(dw);
    }

    if (graph) { /* capture, replay from the same start: same bits as the eager call */
        CHECK(g_gpu->ops->graph_begin(g_gpu));
        g_gpu->ops->moe(g_gpu, &ag);
        CHECK(g_gpu->ops->graph_end(g_gpu, 1000 + n) == LETHE_OK); /* ran once: reset out */
        g_gpu->ops->act_from_host(g_gpu, pout.g, before, (size_t)n * dim);
        CHECK(g_gpu->ops->graph_launch(g_gpu, 1000 + n, NULL));
        float *again = lethe_xmalloc((size_t)n * dim * sizeof(float));
        g_gpu->ops->act_to_host(g_gpu, again, pout.g, (size_t)n * dim);
        CHECK_MSG(!memcmp(again, got, (size_t)n * dim * sizeof(float)),
                  "%s: graph replay differs from the eager call", t->what);
        free(again);
        g_gpu->ops->graph_reset(g_gpu);
    }
    pair all[] = {px, pl, pout, pb, pg, pu, pd, pw};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(all); i++) release(&all[i]);
    free(x), free(lg), free(b), free(wg), free(wu), free(wdn), free(nan), free(res), free(got);
    free(want);
}

static void test_moe(void) {
    static const moe_case cases[] = {
        /* 4 P <= E: the fused down + combine (+ residual) kernel */
        {1, 2048, 768, 128, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "qwen3-30b-a3b batch 1", false},
        {1, 2048, 768, 128, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "qwen3-30b-a3b batch 1, accumulate", true},
        {4, 2048, 768, 128, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "qwen3-30b-a3b batch 4, accumulate", true},
        {1, 2048, 1536, 64, 4, LETHE_MOE_SIGMOID, true, true, 1.8f, 1, 1,
         "glm-4.7-flash batch 1, accumulate", true},
        {2, 72, 96, 32, 2, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "fused, partial row block and lanes", true},
        /* expert-major down + combine */
        {8, 2048, 1536, 64, 4, LETHE_MOE_SIGMOID, true, true, 1.8f, 1, 1,
         "glm-4.7-flash batch 8, accumulate", true},
        {64, 2048, 768, 128, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "qwen3-30b-a3b batch 64", false},
        {3, 64, 32, 8, 2, LETHE_MOE_SOFTMAX, false, false, 1.0f, 1, 1, "tiny, unnormalized",
         false},
        {8, 2048, 1536, 64, 4, LETHE_MOE_SIGMOID, true, true, 1.8f, 1, 1, "glm-4.7-flash router",
         false},
        {17, 128, 64, 16, 4, LETHE_MOE_SIGMOID, true, true, 2.5f, 4, 2, "group-limited 4/2", false},
        /* n <= 4 tokens: routing and sorting in one launch (route_sort_kernel) */
        {2, 128, 64, 16, 4, LETHE_MOE_SIGMOID, true, true, 2.5f, 4, 2,
         "group-limited 4/2, 2 tokens", true},
        {1, 64, 32, 512, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1, "512 experts, 1 token",
         true},
        /* the grouped GEMM: output widths off its 64-column tiles (96), experts with
         * fewer pairs than a row tile, prefill at both models' expert shapes */
        {300, 256, 96, 32, 4, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1, "300 tokens (grouped)",
         false},
        {1000, 512, 128, 128, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "1000 tokens (grouped)", false},
        {512, 2048, 768, 128, 8, LETHE_MOE_SOFTMAX, true, false, 1.0f, 1, 1,
         "qwen3-30b-a3b prefill 512 (grouped)", false},
        {300, 2048, 1536, 64, 4, LETHE_MOE_SIGMOID, true, true, 1.8f, 1, 1,
         "glm-4.7-flash prefill 300 (grouped)", false},
        {300, 2048, 1536, 64, 4, LETHE_MOE_SIGMOID, true, true, 1.8f, 1, 1,
         "glm-4.7-flash prefill 300 (grouped), accumulate", true},
    };
    /* every path is graph-capturable (no host sync): each case replays its capture */
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_case(&cases[i], true);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pgp = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pgp, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_moe);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_moe: all passed\n");
    return 0;
}

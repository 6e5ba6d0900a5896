/* test_cuda_bsp.c - block-sparse prefill attention (backend.h
 * lethe_block_sparse): the CUDA backend (cuda/attention_bsp.cu +
 * prefill_v2_kernel<D, true>) against its CPU twin (cpu/attention_bsp.c).
 *
 * Inputs are rounded to bf16 on the host, so both backends see the same
 * values. The CUDA block scores use bf16 block means, the CPU f32 ones, so
 * the cases are ones where both must choose the same blocks:
 *   threshold 0  every block (the CUDA output must equal the CUDA dense
 *                kernel's bit for bit: the same tiles in the same order);
 *   threshold 1  only the forced blocks (sink, window, diagonal, last query
 *                blocks), with and without mean correction;
 *   planted      a key block aligned with every query, chosen at a middle
 *                threshold by a wide margin.
 * Batches mix a block-sparse chunk with a short dense chunk and a decode row,
 * head_dim 64 and 128, GQA 1 / 4 / 8, prefixes (extend chunks), lengths off
 * the 128 block, permuted cache slots. Error: ||gpu - cpu|| / ||cpu||.
 * Needs a CUDA device (make test-gpu). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "test.h"

/* the CUDA runtime's copy (the test links it; no CUDA header in C tests) */
int cudaMemcpy(void *dst, const void *src, size_t count, int kind);

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 4242;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static float frand(void) { return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0); }

typedef struct bcase {
    const char *name;
    int H, KH, D, n_seqs;
    int n_pre[3], n_q[3];
    float thr;
    int mc;        /* mean correction */
    int planted;   /* plant an attended key block (entries [3 * 128, 4 * 128) of sequence 0) */
} bcase;

static void *dev_copy(const float *h, size_t n) {
    void *p = NULL;
    CHECK(g_gpu->ops->alloc(g_gpu, (n ? n : 1) * g_gpu->ops->act_size, &p) == LETHE_OK);
    if (n && h) g_gpu->ops->act_from_host(g_gpu, p, h, n); /* NULL: storage only */
    return p;
}

static double rel(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK_MSG(isfinite(a[i]), "element %zu not finite", i);
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void run_case(const bcase *c) {
    const int H = c->H, KH = c->KH, D = c->D, S = c->n_seqs;
    int32_t q_begin[4] = {0}, sel_begin[4] = {0};
    for (int s = 0; s < S; s++) {
        q_begin[s + 1] = q_begin[s] + c->n_q[s];
        sel_begin[s + 1] = sel_begin[s] + c->n_pre[s] + c->n_q[s];
    }
    const int T = q_begin[S], n_slots = sel_begin[S] + 5;
    int32_t *sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) sel[i] = i;
    for (int i = n_slots - 1; i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = sel[i];
        sel[i] = sel[j];
        sel[j] = t;
    }
    const size_t kvd = (size_t)KH * D, nk = (size_t)n_slots * kvd, nq = (size_t)T * H * D;
    float *kc = lethe_xmalloc(nk * sizeof(float)), *vc = lethe_xmalloc(nk * sizeof(float));
    float *q = lethe_xmalloc(nq * sizeof(float));
    float *dir = lethe_xmalloc((size_t)D * sizeof(float));
    for (int i = 0; i < D; i++) dir[i] = frand();
    for (size_t i = 0; i < nk; i++) kc[i] = frand(), vc[i] = frand();
    for (size_t i = 0; i < nq; i++) q[i] = (c->planted ? 0.05f : 1.0f) * frand();
    if (c->planted) {
        for (int j = 0; j < c->n_q[0]; j++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < D; i++) q[((size_t)j * H + h) * D + i] += dir[i];
        for (int e = 3 * 128; e < 4 * 128; e++)
            for (int g = 0; g < KH; g++)
                for (int i = 0; i < D; i++) kc[(size_t)sel[e] * kvd + (size_t)g * D + i] = 4.0f * dir[i];
    }
    for (size_t i = 0; i < nk; i++) kc[i] = bf16_round(kc[i]), vc[i] = bf16_round(vc[i]);
    for (size_t i = 0; i < nq; i++) q[i] = bf16_round(q[i]);
    float *o_cpu = lethe_xmalloc(nq * sizeof(float)), *o_gpu = lethe_xmalloc(nq * sizeof(float));
    float *o_gd = lethe_xmalloc(nq * sizeof(float));
    const lethe_block_sparse p = {.block = 128, .sink_blocks = 2, .window_blocks = 2, .last_q_blocks = 1,
                                  .min_q = 256, .threshold = c->thr, .mean_correction = c->mc != 0};
    lethe_attn_args a = {.out = o_cpu, .q = q, .k_cache = kc, .v_cache = vc, .n_tokens = T, .n_seqs = S,
                         .q_begin = q_begin, .sel_begin = sel_begin, .sel_slots = sel, .n_heads = H,
                         .n_kv_heads = KH, .head_dim = D, .scale = 1.0f / sqrtf((float)D), .bsp = &p};
    g_cpu->ops->attention(g_cpu, &a);
    void *dq = dev_copy(q, nq), *dk = dev_copy(kc, nk), *dv = dev_copy(vc, nk), *dout = dev_copy(NULL, nq);
    float *nan = lethe_xmalloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) nan[i] = NAN;
    g_gpu->ops->act_from_host(g_gpu, dout, nan, nq);
    a.q = dq, a.k_cache = dk, a.v_cache = dv, a.out = dout;
    g_gpu->ops->attention(g_gpu, &a);
    g_gpu->ops->act_to_host(g_gpu, o_gpu, dout, nq);
    const double e = rel(o_gpu, o_cpu, nq);
    fprintf(stderr, "    %-44s thr %-6g mc %d: rel err vs CPU twin %.2e\n", c->name, (double)c->thr, c->mc, e);
    CHECK_MSG(e < 1.5e-2, "%s: relative error %.3g", c->name, e);
    if (c->thr == 0.0f) { /* every block read: the dense kernel's result exactly */
        a.bsp = NULL;
        g_gpu->ops->act_from_host(g_gpu, dout, nan, nq);
        g_gpu->ops->attention(g_gpu, &a);
        g_gpu->ops->act_to_host(g_gpu, o_gd, dout, nq);
        CHECK_MSG(!memcmp(o_gd, o_gpu, nq * sizeof(float)), "%s: threshold 0 differs from dense", c->name);
    }
    if (c->thr == 1.0f && !c->mc) { /* only forced blocks: far from dense on random data */
        a.bsp = NULL;
        a.out = o_gd, a.q = q, a.k_cache = kc, a.v_cache = vc;
        g_cpu->ops->attention(g_cpu, &a);
        CHECK_MSG(rel(o_gpu, o_gd, nq) > 2e-2, "%s: forced-only output equals dense (nothing skipped?)", c->name);
    }
    g_gpu->ops->release(g_gpu, dq);
    g_gpu->ops->release(g_gpu, dk);
    g_gpu->ops->release(g_gpu, dv);
    g_gpu->ops->release(g_gpu, dout);
    free(nan), free(sel), free(kc), free(vc), free(q), free(dir), free(o_cpu), free(o_gpu), free(o_gd);
}

static void test_block_sparse(void) {
    static const bcase cases[] = {
        {"prefill d128 gqa4", 16, 4, 128, 1, {0}, {1500}, 0.0f, 1, 0},
        {"prefill d128 gqa4", 16, 4, 128, 1, {0}, {1500}, 1.0f, 0, 0},
        {"prefill d128 gqa4", 16, 4, 128, 1, {0}, {1500}, 1.0f, 1, 0},
        {"extend d64 mha + short + decode", 4, 4, 64, 3, {700, 40, 300}, {1100, 30, 1}, 0.0f, 0, 0},
        {"extend d64 mha + short + decode", 4, 4, 64, 3, {700, 40, 300}, {1100, 30, 1}, 1.0f, 0, 0},
        {"extend d64 mha + short + decode", 4, 4, 64, 3, {700, 40, 300}, {1100, 30, 1}, 1.0f, 1, 0},
        {"extend d128 gqa8 two sparse", 16, 2, 128, 2, {129, 1000}, {1029, 640}, 1.0f, 1, 0},
        {"prefill d128 gqa8 long", 32, 4, 128, 1, {4000}, {4100}, 1.0f, 1, 0},
        {"planted d128 gqa4", 8, 2, 128, 1, {0}, {2048}, 0.4f, 1, 1},
        {"planted d64 gqa4", 8, 2, 64, 1, {0}, {1900}, 0.4f, 0, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_case(&cases[i]);
    run_case(&cases[2]); /* fresh inputs: a race shows up as a moving error */
}

/* attn_scores LETHE_SCORES_QMEAN (omnikv_prefill's chunk-mean logits): CUDA
 * (bf16 mean query) vs the CPU twin (f32), two chunks in one call, groups 1
 * and n_kv; the CUDA op's output stays on the device (out_on_backend, as
 * the method asks) for one of the runs */
static void test_qmean_scores(void) {
    const int H = 32, KH = 8, D = 128, T = 3000, n_slots = 40000;
    float *q = lethe_xmalloc((size_t)T * H * D * sizeof(float)), *k = lethe_xmalloc((size_t)n_slots * KH * D * sizeof(float));
    for (size_t i = 0; i < (size_t)T * H * D; i++) q[i] = bf16_round(frand());
    for (size_t i = 0; i < (size_t)n_slots * KH * D; i++) k[i] = bf16_round(frand());
    int32_t *slots = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) slots[i] = (i * 7919) % n_slots;
    const lethe_score_seq req[2] = {
        {.q_row = 0, .n_rows = 2048, .key_begin = 0, .n_keys = 30000, .c0 = 8, .c1 = 27800,
         .mode = LETHE_SCORES_LOGIT_MAX | LETHE_SCORES_QMEAN},
        {.q_row = 2048, .n_rows = 952, .key_begin = 30000, .n_keys = 9000, .c0 = 8, .c1 = 7900,
         .mode = LETHE_SCORES_LOGIT_MAX | LETHE_SCORES_QMEAN},
    };
    void *dq = dev_copy(q, (size_t)T * H * D), *dk = dev_copy(k, (size_t)n_slots * KH * D);
    for (int gi = 0; gi < 2; gi++) {
        const int G = gi ? KH : 1;
        const size_t n = lethe_attn_scores_out_len(req, 2, G);
        float *oc = lethe_xmalloc(n * sizeof(float)), *og = lethe_xmalloc(n * sizeof(float));
        lethe_attn_scores_args a = {.out = oc, .q = q, .k_cache = k, .n_tokens = T, .n_seqs = 2, .seqs = req,
                                    .key_slots = slots, .n_key_slots = n_slots, .n_heads = H, .n_kv_heads = KH,
                                    .head_dim = D, .n_groups = G, .scale = 1.0f / sqrtf((float)D)};
        g_cpu->ops->attn_scores(g_cpu, &a);
        a.q = dq, a.k_cache = dk, a.out = og;
        void *dout = NULL;
        if (gi) { /* on the device, then copied back */
            CHECK(g_gpu->ops->alloc(g_gpu, n * sizeof(float), &dout) == LETHE_OK);
            a.out = dout, a.out_on_backend = true;
        }
        g_gpu->ops->attn_scores(g_gpu, &a);
        if (gi) { /* device f32 -> host (act_to_host converts from bf16: copy the bytes) */
            g_gpu->ops->sync(g_gpu);
            CHECK(cudaMemcpy(og, dout, n * sizeof(float), 2 /* cudaMemcpyDeviceToHost */) == 0);
            g_gpu->ops->release(g_gpu, dout);
        }
        const double e = rel(og, oc, n);
        fprintf(stderr, "    attn_scores QMEAN groups %-2d: rel err vs CPU twin %.2e\n", G, e);
        CHECK_MSG(e < 1e-2, "QMEAN groups %d: relative error %.3g", G, e);
        free(oc), free(og);
    }
    g_gpu->ops->release(g_gpu, dq);
    g_gpu->ops->release(g_gpu, dk);
    free(q), free(k), free(slots);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pg, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_block_sparse);
    TEST_RUN(test_qmean_scores);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_bsp: all passed\n");
    return 0;
}

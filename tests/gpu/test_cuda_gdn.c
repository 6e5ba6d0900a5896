/* test_cuda_gdn.c - the CUDA Gated DeltaNet ops (backend/cuda/gdn.cu)
 * against their CPU twins (backend/cpu/gdn.c).
 *
 *  - gdn_conv + gdn_rule over three calls that share their states: fresh
 *    sequences (position 0) of 200 / 1 / 64 rows, then continuations (a
 *    decode row, 100 rows from position 1, 37 rows from position 64), then a
 *    decode step of all three; the conv outputs and the rule's outputs of
 *    every call within bf16 error of the CPU (so the states carried between
 *    calls agree too). Shapes: Qwen3.6-27B (16 k heads / 48 v heads of 128,
 *    4 taps), the tiny checkpoint's (2 / 4 heads of 16), and 1 / 2 heads of
 *    dk 64, dv 256 (two column tiles per head);
 *  - split invariance on the GPU: 200 rows in one call vs 64 + 136 (a cut at
 *    a multiple of LETHE_GDN_CHUNK) give bit-identical outputs and states;
 *  - rmsnorm_gated and sigmoid_mul on random rows.
 * Inputs are bf16-rounded on the host; outputs NaN-poisoned. Needs a GPU. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "test.h"

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 2024;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float urand(void) { return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0)); }

static float *rand_bf16(size_t n, float lo, float hi) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = bf16_round(lo + (hi - lo) * urand());
    return v;
}

typedef struct pair {
    void *c, *g;
    size_t n;
} pair;

static pair act(const float *host, size_t n) {
    pair p = {NULL, NULL, n};
    CHECK(g_cpu->ops->alloc(g_cpu, (n ? n : 1) * g_cpu->ops->act_size, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, (n ? n : 1) * g_gpu->ops->act_size, &p.g) == LETHE_OK);
    float *z = lethe_xcalloc(n ? n : 1, sizeof(float));
    if (!host)
        for (size_t i = 0; i < n; i++) z[i] = NAN;
    g_cpu->ops->act_from_host(g_cpu, p.c, host ? host : z, n);
    g_gpu->ops->act_from_host(g_gpu, p.g, host ? host : z, n);
    free(z);
    return p;
}

static pair weight(const float *host, size_t n) {
    pair p = {NULL, NULL, n};
    CHECK(g_cpu->ops->weight_upload(g_cpu, host, n, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->weight_upload(g_gpu, host, n, &p.g) == LETHE_OK);
    return p;
}

static pair raw(size_t bytes) {
    pair p = {NULL, NULL, bytes};
    CHECK(g_cpu->ops->alloc(g_cpu, bytes, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, bytes, &p.g) == LETHE_OK);
    return p;
}

static void release(pair *p) {
    g_cpu->ops->release(g_cpu, p->c);
    g_gpu->ops->release(g_gpu, p->g);
}

static double compare(const pair *p, size_t n, double thr, const char *what) {
    float *a = lethe_xmalloc(n * sizeof(float)), *b = lethe_xmalloc(n * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, a, p->g, n);
    g_cpu->ops->act_to_host(g_cpu, b, p->c, n);
    for (size_t i = 0; i < n; i++) CHECK_MSG(isfinite(a[i]), "%s: element %zu not finite", what, i);
    double e = rel_err(a, b, n);
    fprintf(stderr, "    %s: rel err %.2e\n", what, e);
    CHECK_MSG(e < thr, "%s: relative error %.3g >= %.3g", what, e, thr);
    free(a), free(b);
    return e;
}

typedef struct shape {
    int32_t Hk, Hv, dk, dv, K;
} shape;

typedef struct layer {
    shape sh;
    int32_t C;
    pair conv_w, A, dt_bias, conv_state, state;
} layer;

static layer layer_make(shape sh, int32_t n_slots) {
    layer L = {.sh = sh, .C = 2 * sh.Hk * sh.dk + sh.Hv * sh.dv};
    float *w = rand_bf16((size_t)L.C * sh.K, -0.5f, 0.5f);
    float *A = rand_bf16((size_t)sh.Hv, -1.0f, -0.01f), *dt = rand_bf16((size_t)sh.Hv, -0.2f, 0.2f);
    L.conv_w = weight(w, (size_t)L.C * sh.K);
    L.A = weight(A, (size_t)sh.Hv);
    L.dt_bias = weight(dt, (size_t)sh.Hv);
    L.conv_state = raw((size_t)n_slots * (sh.K - 1) * L.C * sizeof(float));
    L.state = raw((size_t)n_slots * sh.Hv * sh.dk * sh.dv * sizeof(float));
    free(w), free(A), free(dt);
    return L;
}

static void layer_free(layer *L) {
    release(&L->conv_w), release(&L->A), release(&L->dt_bias);
    release(&L->conv_state), release(&L->state);
}

/* one call: sequences s of len[s] rows from position start[s], state slot s */
static void run_call(layer *L, int32_t S, const int32_t *start, const int32_t *len, const char *what) {
    const shape sh = L->sh;
    int32_t q_begin[9] = {0}, slots[8], n = 0;
    for (int32_t s = 0; s < S; s++) q_begin[s + 1] = q_begin[s] + len[s], slots[s] = s;
    n = q_begin[S];
    int32_t *pos = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t s = 0; s < S; s++)
        for (int32_t i = 0; i < len[s]; i++) pos[q_begin[s] + i] = start[s] + i;
    float *x = rand_bf16((size_t)n * L->C, -1.0f, 1.0f);
    float *a = rand_bf16((size_t)n * sh.Hv, -2.0f, 2.0f), *b = rand_bf16((size_t)n * sh.Hv, -3.0f, 3.0f);
    pair px = act(x, (size_t)n * L->C), pa = act(a, (size_t)n * sh.Hv), pb = act(b, (size_t)n * sh.Hv);
    pair pxc = act(NULL, (size_t)n * L->C), po = act(NULL, (size_t)n * sh.Hv * sh.dv);
    lethe_gdn_args g = {.n_tokens = n, .n_seqs = S, .q_begin = q_begin, .state_slots = slots,
                        .pos = pos, .conv_dim = L->C, .kernel = sh.K, .n_k_heads = sh.Hk,
                        .n_v_heads = sh.Hv, .k_dim = sh.dk, .v_dim = sh.dv};
    lethe_gdn_args gc = g, gg = g;
    gc.x = px.c, gc.xc = pxc.c, gc.conv_w = L->conv_w.c, gc.conv_state = L->conv_state.c;
    gc.a = pa.c, gc.b = pb.c, gc.A = L->A.c, gc.dt_bias = L->dt_bias.c, gc.state = L->state.c, gc.out = po.c;
    gg.x = px.g, gg.xc = pxc.g, gg.conv_w = L->conv_w.g, gg.conv_state = L->conv_state.g;
    gg.a = pa.g, gg.b = pb.g, gg.A = L->A.g, gg.dt_bias = L->dt_bias.g, gg.state = L->state.g, gg.out = po.g;
    g_cpu->ops->gdn_conv(g_cpu, &gc);
    g_gpu->ops->gdn_conv(g_gpu, &gg);
    char name[160];
    snprintf(name, sizeof(name), "%s conv (Hk %d Hv %d dk %d dv %d)", what, sh.Hk, sh.Hv, sh.dk, sh.dv);
    compare(&pxc, (size_t)n * L->C, 1e-2, name);
    /* the rule reads the CPU's conv output on both sides: its own error only */
    float *xc = lethe_xmalloc((size_t)n * L->C * sizeof(float));
    g_cpu->ops->act_to_host(g_cpu, xc, pxc.c, (size_t)n * L->C);
    for (size_t i = 0; i < (size_t)n * L->C; i++) xc[i] = bf16_round(xc[i]);
    g_cpu->ops->act_from_host(g_cpu, pxc.c, xc, (size_t)n * L->C);
    g_gpu->ops->act_from_host(g_gpu, pxc.g, xc, (size_t)n * L->C);
    g_cpu->ops->gdn_rule(g_cpu, &gc);
    g_gpu->ops->gdn_rule(g_gpu, &gg);
    snprintf(name, sizeof(name), "%s rule (Hk %d Hv %d dk %d dv %d)", what, sh.Hk, sh.Hv, sh.dk, sh.dv);
    compare(&po, (size_t)n * sh.Hv * sh.dv, 2e-2, name);
    release(&px), release(&pa), release(&pb), release(&pxc), release(&po);
    free(x), free(a), free(b), free(xc), free(pos);
}

static void test_rule_vs_cpu(void) {
    static const shape shapes[] = {{16, 48, 128, 128, 4}, {2, 4, 16, 16, 4}, {1, 2, 64, 256, 3}};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(shapes); i++) {
        layer L = layer_make(shapes[i], 3);
        const int32_t s1[3] = {0, 0, 0}, n1[3] = {200, 1, 64};
        run_call(&L, 3, s1, n1, "fresh");
        const int32_t s2[3] = {200, 1, 64}, n2[3] = {1, 100, 37};
        run_call(&L, 3, s2, n2, "continue");
        const int32_t s3[3] = {201, 101, 101}, n3[3] = {1, 1, 1};
        run_call(&L, 3, s3, n3, "decode");
        layer_free(&L);
    }
}

/* GPU only: 200 rows in one call vs 64 + 136 rows (a cut at a multiple of
 * LETHE_GDN_CHUNK), each followed by a decode row that reads the states:
 * bit-identical outputs */
static void test_split_invariance(void) {
    const shape sh = {16, 48, 128, 128, 4};
    layer L = layer_make(sh, 1);
    const int32_t n = 201, C = L.C;
    float *x = rand_bf16((size_t)n * C, -1.0f, 1.0f);
    float *a = rand_bf16((size_t)n * sh.Hv, -2.0f, 2.0f), *b = rand_bf16((size_t)n * sh.Hv, -3.0f, 3.0f);
    int32_t *pos = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) pos[i] = i;
    const size_t on = (size_t)n * sh.Hv * sh.dv, as = g_gpu->ops->act_size;
    float *out[2];
    static const int32_t cuts[2][4] = {{0, 200, 201, -1}, {0, 64, 200, 201}};
    for (int pass = 0; pass < 2; pass++) {
        pair px = act(x, (size_t)n * C), pa = act(a, (size_t)n * sh.Hv), pb = act(b, (size_t)n * sh.Hv);
        pair pxc = act(NULL, (size_t)n * C), po = act(NULL, on);
        for (int part = 0; part < 3 && cuts[pass][part + 1] > 0; part++) {
            const int32_t r0 = cuts[pass][part], r1 = cuts[pass][part + 1];
            const int32_t qb[2] = {0, r1 - r0}, slot = 0;
            const size_t r = (size_t)r0;
            lethe_gdn_args g = {.n_tokens = r1 - r0, .n_seqs = 1, .q_begin = qb, .state_slots = &slot,
                                .pos = pos + r0, .x = (char *)px.g + r * C * as,
                                .xc = (char *)pxc.g + r * C * as, .conv_w = L.conv_w.g,
                                .conv_state = L.conv_state.g, .conv_dim = C, .kernel = sh.K,
                                .a = (char *)pa.g + r * sh.Hv * as, .b = (char *)pb.g + r * sh.Hv * as,
                                .A = L.A.g, .dt_bias = L.dt_bias.g, .state = L.state.g,
                                .out = (char *)po.g + r * sh.Hv * sh.dv * as, .n_k_heads = sh.Hk,
                                .n_v_heads = sh.Hv, .k_dim = sh.dk, .v_dim = sh.dv};
            g_gpu->ops->gdn_conv(g_gpu, &g);
            g_gpu->ops->gdn_rule(g_gpu, &g);
        }
        out[pass] = lethe_xmalloc(on * sizeof(float));
        g_gpu->ops->act_to_host(g_gpu, out[pass], po.g, on);
        release(&px), release(&pa), release(&pb), release(&pxc), release(&po);
    }
    CHECK_MSG(!memcmp(out[0], out[1], on * sizeof(float)), "split at 64: outputs differ from one call");
    fprintf(stderr, "    200 rows + a decode row: one call == 64 + 136 rows, bit-identical\n");
    free(out[0]), free(out[1]);
    free(x), free(a), free(b), free(pos);
    layer_free(&L);
}

static void test_gated_norm_and_gate(void) {
    const int32_t rows = 96 * 48, dim = 128;
    const size_t n = (size_t)rows * dim;
    float *x = rand_bf16(n, -2.0f, 2.0f), *z = rand_bf16(n, -3.0f, 3.0f), *w = rand_bf16(dim, 0.5f, 1.5f);
    pair px = act(x, n), pz = act(z, n), pw = weight(w, dim), po = act(NULL, n);
    g_cpu->ops->rmsnorm_gated(g_cpu, po.c, px.c, pz.c, pw.c, rows, dim, 1e-6f);
    g_gpu->ops->rmsnorm_gated(g_gpu, po.g, px.g, pz.g, pw.g, rows, dim, 1e-6f);
    compare(&po, n, 1e-2, "rmsnorm_gated");
    g_cpu->ops->sigmoid_mul(g_cpu, px.c, pz.c, n);
    g_gpu->ops->sigmoid_mul(g_gpu, px.g, pz.g, n);
    compare(&px, n, 1e-2, "sigmoid_mul");
    release(&px), release(&pz), release(&pw), release(&po);
    free(x), free(z), free(w);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu"}, pgp = {.device = "cuda"};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pgp, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "no CUDA device: %s", lethe_last_error());
    TEST_RUN(test_rule_vs_cpu);
    TEST_RUN(test_split_invariance);
    TEST_RUN(test_gated_norm_and_gate);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_gdn: all passed\n");
    return 0;
}

/* test_cuda_kvquant.c - the quantized-KV ops (backend/cuda/attention_quant.cu)
 * against their CPU twins (backend/cpu/attention_quant.c). Needs a CUDA device
 * (make test-gpu).
 *
 *  - kv_store_quant (FP8 E4M3): inputs are rounded to bf16 on the host, so
 *    both backends quantize identical values; codes AND scales must be
 *    bit-identical (the CUDA kernel repeats the CPU reference's steps: exact
 *    amax, IEEE division, round-half-even mantissa). Every slot is written
 *    (prefix tokens first, then the step's tokens over permuted slots).
 *  - attention over the FP8 codes: CUDA vs CPU, NaN-poisoned output, ragged
 *    batches mixing decode, prefill and extend, sparse selections, GQA
 *    1/3/4/16, head_dim 32/64/96/128/256, and the pre-staged path;
 *    ||gpu - cpu|| / ||cpu|| < 1.5e-2 (bf16 q and output, as for dense).
 * Raw code bytes are read with cudaMemcpy (declared below: the C tests are
 * not compiled with CUDA's include path). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "test.h"

/* CUDA runtime: cudaError_t cudaMemcpy(void *, const void *, size_t, enum cudaMemcpyKind) */
extern int cudaMemcpy(void *dst, const void *src, size_t n, int kind);
enum { MEMCPY_D2H = 2 };

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
static float *rand_bf16(size_t n, float scale) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = bf16_round(frand() * scale);
    return v;
}

typedef struct side {
    lethe_backend *be;
    void *kc, *vc, *q, *out, *kn, *vn, *k0, *v0;
    lethe_kv_quant kvq;
} side;

static void *alloc_bytes(lethe_backend *be, size_t n) {
    void *p = NULL;
    CHECK(be->ops->alloc(be, n ? n : 16, &p) == LETHE_OK);
    return p;
}
static void *upload(lethe_backend *be, const float *host, size_t n) {
    void *p = alloc_bytes(be, n * be->ops->act_size);
    be->ops->act_from_host(be, p, host, n);
    return p;
}
static void side_free(side *s) {
    void *bufs[] = {s->kc, s->vc, s->q, s->out, s->kn, s->vn, s->k0, s->v0, s->kvq.k_scale, s->kvq.v_scale};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++) s->be->ops->release(s->be, bufs[i]);
}

/* GPU buffer -> host bytes */
static void gpu_bytes(void *dst, const void *src, size_t n) {
    g_gpu->ops->sync(g_gpu);
    CHECK(cudaMemcpy(dst, src, n, MEMCPY_D2H) == 0);
}

static void compare_store(const side *c, const side *g, size_t n_slots, size_t kvd, int KV, const char *what) {
    uint8_t *buf = lethe_xmalloc(n_slots * kvd);
    float *sc = lethe_xmalloc(n_slots * (size_t)KV * sizeof(float));
    size_t bad = 0;
    for (int which = 0; which < 2; which++) {
        gpu_bytes(buf, which ? g->vc : g->kc, n_slots * kvd);
        const uint8_t *ref = which ? c->vc : c->kc;
        for (size_t i = 0; i < n_slots * kvd; i++) bad += buf[i] != ref[i];
        gpu_bytes(sc, which ? g->kvq.v_scale : g->kvq.k_scale, n_slots * (size_t)KV * sizeof(float));
        const float *rs = which ? c->kvq.v_scale : c->kvq.k_scale;
        CHECK_MSG(!memcmp(sc, rs, n_slots * (size_t)KV * sizeof(float)), "%s: %s scales differ", what,
                  which ? "V" : "K");
    }
    CHECK_MSG(bad == 0, "%s: %zu of %zu FP8 codes differ from the CPU", what, bad, 2 * n_slots * kvd);
    free(buf);
    free(sc);
}

typedef struct qcase {
    const char *name;
    int H, KV, D, S;
    int n_q[6], n_sel[6];
    int sparse;
} qcase;

static void run_case(const qcase *tc, int staged) {
    const int H = tc->H, KV = tc->KV, D = tc->D, S = tc->S;
    int32_t q_begin[7] = {0}, sel_begin[7] = {0}, n_slots = 0;
    for (int s = 0; s < S; s++) {
        q_begin[s + 1] = q_begin[s] + tc->n_q[s];
        n_slots += tc->n_sel[s] + 3;
    }
    const int T = q_begin[S];
    int32_t *perm = lethe_xmalloc((size_t)n_slots * sizeof(int32_t)), *all = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) perm[i] = all[i] = i;
    for (int i = n_slots - 1; i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t)), *store = lethe_xmalloc((size_t)(T ? T : 1) * sizeof(int32_t));
    int used = 0, n_sel = 0;
    for (int s = 0; s < S; s++) {
        for (int e = 0; e < tc->n_sel[s] - tc->n_q[s]; e++) {
            int32_t slot = perm[used++];
            if (tc->sparse && e > 0 && lethe_splitmix64(&g_rng) % 3 == 0) continue;
            sel[n_sel++] = slot;
        }
        for (int j = 0; j < tc->n_q[s]; j++) sel[n_sel++] = store[q_begin[s] + j] = perm[used++];
        sel_begin[s + 1] = n_sel;
    }
    const size_t kvd = (size_t)KV * D;
    /* a few large outliers per vector so the scales vary */
    float *k0 = rand_bf16((size_t)n_slots * kvd, 2), *v0 = rand_bf16((size_t)n_slots * kvd, 1);
    for (int i = 0; i < n_slots; i++) k0[(size_t)i * kvd + (size_t)(i % (int)kvd)] = bf16_round(30.0f * frand());
    float *kn = rand_bf16((size_t)T * kvd, 2), *vn = rand_bf16((size_t)T * kvd, 1);
    float *q = rand_bf16((size_t)T * H * D, 1);
    float *nan = lethe_xmalloc((size_t)T * H * D * sizeof(float));
    for (size_t i = 0; i < (size_t)T * H * D; i++) nan[i] = NAN;
    side sd[2];
    for (int b = 0; b < 2; b++) {
        side *s = &sd[b];
        s->be = b ? g_gpu : g_cpu;
        s->kc = alloc_bytes(s->be, (size_t)n_slots * kvd);
        s->vc = alloc_bytes(s->be, (size_t)n_slots * kvd);
        s->kvq.format = LETHE_KV_FP8_E4M3;
        s->kvq.k_scale = alloc_bytes(s->be, (size_t)n_slots * KV * sizeof(float));
        s->kvq.v_scale = alloc_bytes(s->be, (size_t)n_slots * KV * sizeof(float));
        s->k0 = upload(s->be, k0, (size_t)n_slots * kvd);
        s->v0 = upload(s->be, v0, (size_t)n_slots * kvd);
        s->kn = upload(s->be, kn, (size_t)T * kvd);
        s->vn = upload(s->be, vn, (size_t)T * kvd);
        s->q = upload(s->be, q, (size_t)T * H * D);
        s->out = upload(s->be, nan, (size_t)T * H * D);
    }
    char what[160];
    snprintf(what, sizeof what, "fp8 %s (H=%d KV=%d D=%d T=%d sel=%d%s)", tc->name, H, KV, D, T, n_sel,
             staged ? ", staged" : "");
    for (int b = 0; b < 2; b++)
        sd[b].be->ops->kv_store_quant(sd[b].be, &sd[b].kvq, sd[b].kc, sd[b].vc, sd[b].k0, sd[b].v0, all,
                                      n_slots, KV, D);
    if (staged) {
        const int32_t *arrays[4] = {store, q_begin, sel_begin, sel};
        size_t counts[4] = {(size_t)T, (size_t)S + 1, (size_t)S + 1, (size_t)n_sel};
        g_gpu->ops->stage_step(g_gpu, arrays, counts, 4);
    }
    for (int b = 0; b < 2; b++)
        sd[b].be->ops->kv_store_quant(sd[b].be, &sd[b].kvq, sd[b].kc, sd[b].vc, sd[b].kn, sd[b].vn, store,
                                      T, KV, D);
    compare_store(&sd[0], &sd[1], (size_t)n_slots, kvd, KV, what);
    for (int b = 0; b < 2; b++) {
        lethe_attn_args a = {.out = sd[b].out, .q = sd[b].q, .k_cache = sd[b].kc, .v_cache = sd[b].vc,
                             .n_tokens = T, .n_seqs = S, .q_begin = q_begin, .sel_begin = sel_begin,
                             .sel_slots = sel, .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                             .scale = 1.0f / sqrtf((float)D), .kvq = &sd[b].kvq};
        sd[b].be->ops->attention(sd[b].be, &a);
    }
    float *oc = lethe_xmalloc((size_t)T * H * D * sizeof(float)), *og = lethe_xmalloc((size_t)T * H * D * sizeof(float));
    g_cpu->ops->act_to_host(g_cpu, oc, sd[0].out, (size_t)T * H * D);
    g_gpu->ops->act_to_host(g_gpu, og, sd[1].out, (size_t)T * H * D);
    for (size_t i = 0; i < (size_t)T * H * D; i++)
        CHECK_MSG(isfinite(og[i]), "%s: element %zu not finite (%g): unwritten", what, i, (double)og[i]);
    double e = rel_err(og, oc, (size_t)T * H * D);
    CHECK_MSG(e < 1.5e-2, "%s: relative error %.3g", what, e);
    fprintf(stderr, "    %-78s codes equal, rel err %.2e\n", what, e);
    if (staged) g_gpu->ops->unstage(g_gpu);
    side_free(&sd[0]), side_free(&sd[1]);
    free(perm), free(all), free(sel), free(store), free(k0), free(v0), free(kn), free(vn), free(q), free(nan);
    free(oc), free(og);
}

static void test_fp8(void) {
    static const qcase cases[] = {
        {"decode single", 32, 8, 128, 1, {1}, {4096}, 0},
        {"decode ragged", 32, 8, 128, 5, {1, 1, 1, 1, 1}, {1, 37, 128, 129, 5000}, 0},
        {"decode gqa3 d64", 9, 3, 64, 3, {1, 1, 1}, {2, 300, 1025}, 0},
        {"decode mha d96", 4, 4, 96, 2, {1, 1}, {77, 513}, 0},
        {"decode gqa16 d256", 16, 1, 256, 2, {1, 1}, {17, 700}, 0},
        {"decode d32", 8, 2, 32, 2, {1, 1}, {3, 260}, 0},
        {"prefill ragged", 8, 2, 128, 4, {1, 63, 64, 65}, {1, 63, 64, 65}, 0},
        {"extend + decode", 8, 2, 128, 3, {1, 50, 130}, {900, 300, 130}, 0},
        {"extend d64 gqa3", 9, 3, 64, 2, {33, 70}, {100, 500}, 0},
        {"sparse decode", 32, 8, 128, 2, {1, 1}, {600, 2000}, 1},
        {"sparse extend", 8, 2, 128, 2, {17, 3}, {400, 90}, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_case(&cases[i], 0);
    run_case(&cases[1], 1);
    run_case(&cases[7], 1);
    run_case(&cases[1], 0); /* fresh inputs: a race shows up as a moving error */
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pg, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_fp8);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_kvquant: all passed\n");
    return 0;
}

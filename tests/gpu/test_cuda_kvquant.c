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
 *    1/3/4/12/16/32, head_dim 32/64/96/128/256, rows up to 33K keys (decode at
 *    head_dim 64 / 128 is the tensor-core kernel of attention_fp8.cu, the rest
 *    attention_quant.cu's), and the pre-staged path;
 *    ||gpu - cpu|| / ||cpu|| < 1.5e-2 (bf16 q and output, as for dense).
 *  - KIVI (2/4/8 bits, G 16/32/64): three steps (prefill, extend mixed with
 *    decode, decode) of 2-3 ragged sequences over scattered slots, planned
 *    like kivi_prepare (groups completed from residual + new rows, residual
 *    entries reused in the same step). After every step the store must be
 *    bit-identical to the CPU (codes and V params of packed slots, every used
 *    K group entry, residual values), then attention (dense or sparse
 *    selections) CUDA vs CPU as for FP8.
 *  - engine: tiny-llama (tests/data/tiny-llama) greedy on CUDA, kivi 4-bit
 *    G 16 vs dense: same first token, first-step logits rel err < 0.25 (the
 *    bound test_kv_quant.c allows SmolLM2 kivi 4-bit); prints how many of 16
 *    greedy tokens agree.
 * Raw code bytes are read with cudaMemcpy (declared below: the C tests are
 * not compiled with CUDA's include path). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/kv_codec.h"
#include "core/util.h"
#include "lethe.h"
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
        /* decode at head_dim 64 / 128 runs the tensor-core kernel (attention_fp8.cu):
         * long rows (many splits and warp tiles), G = 1, 12 (a partial M tile), 32
         * (two head chunks), 6 ragged rows with tile tails of 1..15 keys */
        {"decode long b4", 32, 8, 128, 4, {1, 1, 1, 1}, {16384, 20000, 16385, 33000}, 0},
        {"decode mha d128 b6", 8, 8, 128, 6, {1, 1, 1, 1, 1, 1}, {16, 17, 64, 65, 1000, 3}, 0},
        {"decode gqa12 d128", 12, 1, 128, 2, {1, 1}, {1, 5000}, 0},
        {"decode gqa32 d64", 64, 2, 64, 2, {1, 1}, {100, 1500}, 0},
        {"sparse decode d64", 16, 4, 64, 3, {1, 1, 1}, {50, 3000, 9000}, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_case(&cases[i], 0);
    run_case(&cases[1], 1);
    run_case(&cases[7], 1);
    run_case(&cases[1], 0); /* fresh inputs: a race shows up as a moving error */
}

/* ---- KIVI ------------------------------------------------------------------
 * A small host planner mirrors kivi_prepare (src/sparse/kivi.c): sequence s
 * owns residual block s; each step its new tokens complete groups (members
 * from the residual and / or this step's rows) that are packed into scattered
 * K group entries, the tail goes to the residual. Slots are a permutation. */

typedef struct kcase {
    const char *name;
    int H, KV, D, G, bits, S;
    int n_new[3][3]; /* [step][seq]: step 0 prefill, 1 extend / mixed, 2 decode */
    int sparse;
} kcase;

typedef struct kside {
    lethe_backend *be;
    void *kc, *vc, *vpar, *kgrp, *kres, *vres;
    lethe_kv_quant q;
} kside;

static float bf16_bits_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* store equality after a step: codes + params of every packed slot, every used
 * K group entry, residual rows of the others (CPU f32 vs CUDA bf16 values) */
static void kivi_compare_store(const kside *c, const kside *g, const int32_t *aux, const int32_t *const *row_slots,
                               const int *len, int S, int C, int G, int bits, int n_slots, const char *what) {
    const size_t cb = lethe_kivi_code_bytes(C, bits), np = (size_t)C / G;
    const size_t n_res = (size_t)c->q.n_res, n_groups = (size_t)c->q.n_groups;
    uint8_t *kc = lethe_xmalloc((size_t)n_slots * cb), *vc = lethe_xmalloc((size_t)n_slots * cb);
    float *vpar = lethe_xmalloc((size_t)n_slots * 2 * np * sizeof(float));
    float *kgrp = lethe_xmalloc(n_groups * 2 * C * sizeof(float));
    uint16_t *kres = lethe_xmalloc(n_res * C * 2), *vres = lethe_xmalloc(n_res * C * 2);
    gpu_bytes(kc, g->kc, (size_t)n_slots * cb), gpu_bytes(vc, g->vc, (size_t)n_slots * cb);
    gpu_bytes(vpar, g->vpar, (size_t)n_slots * 2 * np * sizeof(float));
    gpu_bytes(kgrp, g->kgrp, n_groups * 2 * C * sizeof(float));
    gpu_bytes(kres, g->kres, n_res * C * 2), gpu_bytes(vres, g->vres, n_res * C * 2);
    const uint8_t *rkc = c->kc, *rvc = c->vc;
    const float *rvp = c->vpar, *rkg = c->kgrp, *rkr = c->kres, *rvr = c->vres;
    size_t bad_codes = 0, bad_params = 0, bad_res = 0, n_packed = 0, n_resid = 0;
    for (int s = 0; s < S; s++)
        for (int t = 0; t < len[s]; t++) {
            const int32_t slot = row_slots[s][t], a = aux[slot];
            CHECK(a != INT32_MIN);
            if (a >= 0) {
                n_packed++;
                bad_codes += memcmp(kc + (size_t)slot * cb, rkc + (size_t)slot * cb, cb) != 0;
                bad_codes += memcmp(vc + (size_t)slot * cb, rvc + (size_t)slot * cb, cb) != 0;
                bad_params += memcmp(vpar + (size_t)slot * 2 * np, rvp + (size_t)slot * 2 * np, 2 * np * sizeof(float)) != 0;
                if (t % G == 0)
                    bad_params += memcmp(kgrp + (size_t)a * 2 * C, rkg + (size_t)a * 2 * C, 2 * (size_t)C * sizeof(float)) != 0;
            } else {
                n_resid++;
                const size_t r = (size_t)(-1 - a);
                for (int i = 0; i < C; i++)
                    bad_res += bf16_bits_to_float(kres[r * C + i]) != rkr[r * C + i] ||
                               bf16_bits_to_float(vres[r * C + i]) != rvr[r * C + i];
            }
        }
    CHECK_MSG(bad_codes == 0, "%s: %zu code rows of %zu packed slots differ from the CPU", what, bad_codes, n_packed);
    CHECK_MSG(bad_params == 0, "%s: %zu V param rows / K group entries differ from the CPU", what, bad_params);
    CHECK_MSG(bad_res == 0, "%s: %zu residual values of %zu tokens differ", what, bad_res, n_resid);
    free(kc), free(vc), free(vpar), free(kgrp), free(kres), free(vres);
}

static void run_kivi_case(const kcase *tc) {
    const int H = tc->H, KV = tc->KV, D = tc->D, G = tc->G, b = tc->bits, S = tc->S, C = KV * D;
    int total[3] = {0}, n_slots = 0;
    for (int s = 0; s < S; s++) {
        for (int st = 0; st < 3; st++) total[s] += tc->n_new[st][s];
        n_slots += total[s];
    }
    n_slots = (n_slots / G + 2 + S) * G; /* room for every group + spare */
    const int n_groups = n_slots / G, n_res = S * G;
    int32_t *perm = lethe_xmalloc((size_t)n_slots * sizeof(int32_t)), *eperm = lethe_xmalloc((size_t)n_groups * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) perm[i] = i;
    for (int i = 0; i < n_groups; i++) eperm[i] = n_groups - 1 - i;
    for (int i = n_slots - 1; i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *aux = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) aux[i] = INT32_MIN;
    int32_t *row[3];
    int len[3] = {0}, n_done[3] = {0}, used = 0, next_e = 0;
    for (int s = 0; s < S; s++) {
        row[s] = lethe_xmalloc((size_t)total[s] * sizeof(int32_t));
        for (int t = 0; t < total[s]; t++) row[s][t] = perm[used++];
    }
    const size_t cb = lethe_kivi_code_bytes(C, b), np = (size_t)C / G;
    kside sd[2];
    lethe_kivi_plan plan = {.slot_aux = aux};
    for (int k = 0; k < 2; k++) {
        kside *x = &sd[k];
        x->be = k ? g_gpu : g_cpu;
        x->kc = alloc_bytes(x->be, (size_t)n_slots * cb), x->vc = alloc_bytes(x->be, (size_t)n_slots * cb);
        x->vpar = alloc_bytes(x->be, (size_t)n_slots * 2 * np * sizeof(float));
        x->kgrp = alloc_bytes(x->be, (size_t)n_groups * 2 * C * sizeof(float));
        x->kres = alloc_bytes(x->be, (size_t)n_res * C * x->be->ops->kv_size);
        x->vres = alloc_bytes(x->be, (size_t)n_res * C * x->be->ops->kv_size);
        x->q = (lethe_kv_quant){.format = LETHE_KV_KIVI_FORMAT(b, G), .v_param = x->vpar, .k_group = x->kgrp,
                                .k_res = x->kres, .v_res = x->vres, .n_groups = n_groups, .n_res = n_res,
                                .kivi = &plan};
    }
    int32_t *psrc = lethe_xmalloc((size_t)n_slots * sizeof(int32_t)), *pslot = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    int32_t *pent = lethe_xmalloc((size_t)n_groups * sizeof(int32_t));
    for (int step = 0; step < 3; step++) {
        /* ---- plan (kivi_prepare) ---- */
        int32_t q_begin[4] = {0}, store[2048], n_pack = 0;
        for (int s = 0; s < S; s++) q_begin[s + 1] = q_begin[s] + tc->n_new[step][s];
        const int T = q_begin[S];
        LETHE_ASSERT(T <= 2048);
        for (int s = 0; s < S; s++) {
            const int t0 = len[s], L = t0 + tc->n_new[step][s];
            for (int g = n_done[s]; g < L / G; g++) {
                const int32_t e = eperm[next_e++];
                for (int j = 0; j < G; j++) {
                    const int t = g * G + j;
                    const int32_t slot = row[s][t];
                    int32_t src = t >= t0 ? q_begin[s] + (t - t0) : -(1 + s * G + j);
                    if (t < t0) CHECK(aux[slot] == src);
                    psrc[(size_t)n_pack * G + j] = src, pslot[(size_t)n_pack * G + j] = slot;
                    aux[slot] = e;
                }
                pent[n_pack++] = e;
                n_done[s]++;
            }
            for (int t = LETHE_MAX(t0, (L / G) * G); t < L; t++) aux[row[s][t]] = -(1 + s * G + t % G);
            for (int t = t0; t < L; t++) store[q_begin[s] + t - t0] = row[s][t];
            len[s] = L;
        }
        plan.n_pack = n_pack, plan.pack_src = psrc, plan.pack_slot = pslot, plan.pack_entry = pent;
        /* ---- store ---- */
        float *kn = rand_bf16((size_t)T * C, 2), *vn = rand_bf16((size_t)T * C, 1);
        for (int i = 0; i < T; i++) /* channel offsets and outliers so per-channel K params vary */
            for (int c = 0; c < C; c++) kn[(size_t)i * C + c] = bf16_round(kn[(size_t)i * C + c] + 0.25f * (c % 9));
        kn[0] = -0.0f, vn[0] = 0.0f; /* signed zeros (min / max scan order) */
        float *q = rand_bf16((size_t)T * H * D, 1);
        float *nan = lethe_xmalloc((size_t)T * H * D * sizeof(float));
        for (size_t i = 0; i < (size_t)T * H * D; i++) nan[i] = NAN;
        void *knd[2], *vnd[2], *qd[2], *od[2];
        for (int k = 0; k < 2; k++) {
            lethe_backend *be = sd[k].be;
            knd[k] = upload(be, kn, (size_t)T * C), vnd[k] = upload(be, vn, (size_t)T * C);
            qd[k] = upload(be, q, (size_t)T * H * D), od[k] = upload(be, nan, (size_t)T * H * D);
            be->ops->kv_store_quant(be, &sd[k].q, sd[k].kc, sd[k].vc, knd[k], vnd[k], store, T, KV, D);
        }
        char what[192];
        snprintf(what, sizeof what, "kivi%d G%d %s step %d (H=%d KV=%d D=%d T=%d packs=%d)", b, G, tc->name, step,
                 H, KV, D, T, n_pack);
        const int32_t *rows[3] = {row[0], S > 1 ? row[1] : NULL, S > 2 ? row[2] : NULL};
        kivi_compare_store(&sd[0], &sd[1], aux, rows, len, S, C, G, b, n_slots, what);
        /* ---- attention: each sequence's row (sparse: some older entries dropped) ---- */
        int32_t sel_begin[4] = {0};
        int32_t *sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
        int n_sel = 0;
        for (int s = 0; s < S; s++) {
            const int nq = tc->n_new[step][s];
            for (int t = 0; t < len[s]; t++) {
                if (tc->sparse && t > 0 && t < len[s] - nq && lethe_splitmix64(&g_rng) % 3 == 0) continue;
                sel[n_sel++] = row[s][t];
            }
            sel_begin[s + 1] = n_sel;
        }
        for (int k = 0; k < 2; k++) {
            lethe_attn_args a = {.out = od[k], .q = qd[k], .k_cache = sd[k].kc, .v_cache = sd[k].vc,
                                 .n_tokens = T, .n_seqs = S, .q_begin = q_begin, .sel_begin = sel_begin,
                                 .sel_slots = sel, .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                                 .scale = 1.0f / sqrtf((float)D), .kvq = &sd[k].q};
            sd[k].be->ops->attention(sd[k].be, &a);
        }
        float *oc = lethe_xmalloc((size_t)T * H * D * sizeof(float)), *og = lethe_xmalloc((size_t)T * H * D * sizeof(float));
        g_cpu->ops->act_to_host(g_cpu, oc, od[0], (size_t)T * H * D);
        g_gpu->ops->act_to_host(g_gpu, og, od[1], (size_t)T * H * D);
        for (size_t i = 0; i < (size_t)T * H * D; i++)
            CHECK_MSG(isfinite(og[i]), "%s: element %zu not finite (%g): unwritten", what, i, (double)og[i]);
        const double e = rel_err(og, oc, (size_t)T * H * D);
        CHECK_MSG(e < 1.5e-2, "%s: relative error %.3g", what, e);
        fprintf(stderr, "    %-82s store equal, rel err %.2e\n", what, e);
        for (int k = 0; k < 2; k++) {
            void *bufs[4] = {knd[k], vnd[k], qd[k], od[k]};
            for (int i = 0; i < 4; i++) sd[k].be->ops->release(sd[k].be, bufs[i]);
        }
        free(kn), free(vn), free(q), free(nan), free(sel), free(oc), free(og);
    }
    for (int k = 0; k < 2; k++) {
        void *bufs[6] = {sd[k].kc, sd[k].vc, sd[k].vpar, sd[k].kgrp, sd[k].kres, sd[k].vres};
        for (int i = 0; i < 6; i++) sd[k].be->ops->release(sd[k].be, bufs[i]);
    }
    for (int s = 0; s < S; s++) free(row[s]);
    free(perm), free(eperm), free(aux), free(psrc), free(pslot), free(pent);
}

static void test_kivi(void) {
    static const kcase cases[] = {
        /* seq 0: 45 -> 1 group + 13 residual; 20 more completes group 1 from 13 residual + 3 new ... */
        {"gqa4 d128 ragged", 8, 2, 128, 32, 4, 3, {{45, 7, 70}, {20, 60, 1}, {1, 1, 1}}, 0},
        {"gqa3 d64", 9, 3, 64, 16, 2, 2, {{21, 7}, {14, 30}, {1, 1}}, 0},
        {"mha d96", 4, 4, 96, 32, 8, 2, {{33, 100}, {1, 40}, {1, 1}}, 0},
        {"gqa16 d256 G64", 16, 1, 256, 64, 4, 2, {{130, 5}, {1, 70}, {1, 1}}, 0},
        {"tiny d16", 4, 2, 16, 16, 2, 2, {{17, 3}, {16, 20}, {1, 1}}, 0},
        {"tiny d16 8-bit", 4, 2, 16, 16, 8, 2, {{15, 1}, {2, 31}, {1, 1}}, 0},
        {"sparse", 8, 2, 128, 32, 4, 3, {{45, 7, 70}, {20, 60, 1}, {1, 1, 1}}, 1},
        {"long decode", 32, 8, 128, 32, 2, 2, {{1000, 300}, {1, 1}, {1, 1}}, 0},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_kivi_case(&cases[i]);
}

/* ---- engine: kivi 4-bit on CUDA vs dense on CUDA (tests/data/tiny-llama) ---- */

typedef struct kgen {
    int32_t tok[16];
    float *logits; /* first step */
    int n, V;
} kgen;

static void kgen_ev(void *user, const lethe_event *ev) {
    kgen *o = user;
    if (ev->n_tokens == 1 && o->n < 16) {
        if (!o->logits) {
            o->V = ev->n_vocab;
            o->logits = lethe_xmalloc((size_t)ev->n_vocab * sizeof(float));
            memcpy(o->logits, ev->logits, (size_t)ev->n_vocab * sizeof(float));
        }
        o->tok[o->n++] = ev->token;
    }
}

static void kivi_generate(const char *device, const char *method, kgen *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "tests/data/tiny-llama";
    p.seed = 7;
    p.device = device;
    p.max_model_len = 128;
    p.max_num_seqs = 8;
    p.max_num_batched_tokens = 64;
    p.enable_prefix_caching = false;
    p.kv_cache_bytes = (size_t)4 << 20;
    p.gpu_memory_utilization = 0.3f;
    p.check_invariants = true;
    p.sparse_method = method;
    p.sparse_config = !strcmp(method, "kivi") ? "kivi_bits=4,kv_quant_page_size=16" : NULL;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s on %s: %s", method, device, lethe_engine_last_error());
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 3 + (i * 7) % 50; /* repeated pattern */
    lethe_request_params rp = {.prompt = ids, .n_prompt = 40, .cb = kgen_ev, .user = o, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = 16; /* 40 + 16 tokens: groups complete in prefill and in decode */
    rp.sampling.ignore_eos = true;
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    while (lethe_engine_has_work(e)) CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
    lethe_engine_destroy(e);
    CHECK_EQ_INT(o->n, 16);
}

static void test_kivi_engine(void) {
    kgen d, k;
    kivi_generate("cuda", "dense", &d);
    kivi_generate("cuda", "kivi", &k);
    int same = 0;
    while (same < 16 && d.tok[same] == k.tok[same]) same++;
    const double e = rel_err(k.logits, d.logits, (size_t)d.V);
    fprintf(stderr, "    tiny-llama CUDA kivi 4-bit vs dense: first %d/16 greedy tokens equal, first-step logits "
            "rel err %.3g\n", same, e);
    CHECK(e < 0.25); /* test_kv_quant.c allows 0.25 for SmolLM2 kivi 4-bit */
    CHECK(d.tok[0] == k.tok[0]);
    free(d.logits), free(k.logits);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pg, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_fp8);
    TEST_RUN(test_kivi);
    TEST_RUN(test_kivi_engine);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_kvquant: all passed\n");
    return 0;
}

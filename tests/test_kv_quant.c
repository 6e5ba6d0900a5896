/* test_kv_quant.c - quantized KV storage (FP8 E4M3) on the CPU backend:
 *
 *  - kv_store_quant writes exactly the reference quantizer's codes and scales
 *    (src/backend/kv_codec.c) into the slots it is given, and nothing else;
 *  - attention over the FP8 codes (backend/cpu/attention_quant.c) equals the
 *    dense CPU attention over the dequantized KV (max abs error <= 1e-5 x the
 *    output scale) on a ragged batch: prefill, extend over a prefix, decode,
 *    sparse (subset) selections over permuted slots, GQA 4 and 1, head_dim 64
 *    and 36 (scalar tails);
 *  - the engine sizes the pool by the format's real bytes per token: fp8_kv
 *    holds 4 * hd / (hd + 4) times the slots of dense for the same
 *    --kv-cache-bytes on the f32 CPU backend (3.2x at the tiny model's hd 16;
 *    2 * hd / (hd + 4) ~ 1.9x against bf16 on CUDA);
 *  - SmolLM2-135M with fp8_kv stays close to dense (greedy tokens, logits). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/kv_codec.h"
#include "core/util.h"
#include "kv/kv_pool.h"
#include "lethe.h"
#include "sparse_throwaway.h"
#include "test.h"

static lethe_backend *g_be;
static uint64_t g_rng = 99;
static float frand(void) { return (float)((lethe_splitmix64(&g_rng) >> 40) * 0x1p-24) * 2.0f - 1.0f; }

static void test_store(void) {
    enum { SLOTS = 40, KV = 3, D = 64, N = 7 };
    const size_t kvd = (size_t)KV * D;
    uint8_t *kc = calloc(SLOTS * kvd, 1), *vc = calloc(SLOTS * kvd, 1);
    float ks[SLOTS * KV] = {0}, vs[SLOTS * KV] = {0};
    float k[N * KV * D], v[N * KV * D];
    for (size_t i = 0; i < LETHE_ARRAY_LEN(k); i++) k[i] = 4.0f * frand(), v[i] = 0.01f * frand();
    for (int d = 0; d < D; d++) k[KV * D + D + d] = 0.0f; /* token 1, head 1: zero vector */
    lethe_kv_quant q = {.format = LETHE_KV_FP8_E4M3, .k_scale = ks, .v_scale = vs};
    int32_t slots[N] = {5, 39, 0, 17, 18, 3, 22};
    g_be->ops->kv_store_quant(g_be, &q, kc, vc, k, v, slots, N, KV, D);
    int written = 0;
    for (int s = 0; s < SLOTS; s++) {
        int i = -1;
        for (int j = 0; j < N; j++)
            if (slots[j] == s) i = j;
        for (int h = 0; h < KV; h++) {
            uint8_t ck[D], cv[D];
            float sk = 0, sv = 0;
            if (i >= 0) {
                lethe_fp8_quant_vec(k + ((size_t)i * KV + h) * D, D, ck, &sk);
                lethe_fp8_quant_vec(v + ((size_t)i * KV + h) * D, D, cv, &sv);
                written++;
            } else {
                memset(ck, 0, D), memset(cv, 0, D); /* untouched */
            }
            CHECK(ks[s * KV + h] == sk && vs[s * KV + h] == sv);
            CHECK(!memcmp(kc + (size_t)s * kvd + (size_t)h * D, ck, D));
            CHECK(!memcmp(vc + (size_t)s * kvd + (size_t)h * D, cv, D));
        }
    }
    CHECK_EQ_INT(written, N * KV);
    CHECK(ks[slots[1] * KV + 1] == 0.0f); /* zero vector: scale 0, codes 0, no NaN */
    free(kc), free(vc);
}

typedef struct qcase {
    int H, KV, D, S;
    int n_q[4], n_sel[4];
    int sparse;
} qcase;

static void run_case(const qcase *c) {
    const int H = c->H, KV = c->KV, D = c->D, S = c->S;
    int32_t q_begin[5] = {0}, sel_begin[5] = {0}, n_slots = 0;
    for (int s = 0; s < S; s++) {
        q_begin[s + 1] = q_begin[s] + c->n_q[s];
        n_slots += c->n_sel[s] + 2;
    }
    const int T = q_begin[S];
    int32_t *perm = malloc((size_t)n_slots * sizeof(int32_t)), *sel = malloc((size_t)n_slots * sizeof(int32_t));
    int32_t *store = malloc((size_t)T * sizeof(int32_t)), *all = malloc((size_t)n_slots * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) perm[i] = all[i] = i;
    for (int i = n_slots - 1; i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int used = 0, n_sel = 0;
    for (int s = 0; s < S; s++) {
        for (int e = 0; e < c->n_sel[s] - c->n_q[s]; e++) {
            int32_t slot = perm[used++];
            if (c->sparse && e > 0 && lethe_splitmix64(&g_rng) % 3 == 0) continue;
            sel[n_sel++] = slot;
        }
        for (int j = 0; j < c->n_q[s]; j++) sel[n_sel++] = store[q_begin[s] + j] = perm[used++];
        sel_begin[s + 1] = n_sel;
    }
    const size_t kvd = (size_t)KV * D;
    /* every slot gets a token (the prefix), then the step's tokens overwrite theirs */
    float *k0 = malloc((size_t)n_slots * kvd * sizeof(float)), *v0 = malloc((size_t)n_slots * kvd * sizeof(float));
    float *kn = malloc((size_t)T * kvd * sizeof(float)), *vn = malloc((size_t)T * kvd * sizeof(float));
    for (size_t i = 0; i < (size_t)n_slots * kvd; i++) k0[i] = 2.0f * frand(), v0[i] = frand();
    for (size_t i = 0; i < (size_t)T * kvd; i++) kn[i] = 2.0f * frand(), vn[i] = frand();
    float *q = malloc((size_t)T * H * D * sizeof(float));
    for (size_t i = 0; i < (size_t)T * H * D; i++) q[i] = frand();
    uint8_t *kc = malloc((size_t)n_slots * kvd), *vc = malloc((size_t)n_slots * kvd);
    float *ks = malloc((size_t)n_slots * KV * sizeof(float)), *vs = malloc((size_t)n_slots * KV * sizeof(float));
    lethe_kv_quant kq = {.format = LETHE_KV_FP8_E4M3, .k_scale = ks, .v_scale = vs};
    g_be->ops->kv_store_quant(g_be, &kq, kc, vc, k0, v0, all, n_slots, KV, D);
    g_be->ops->kv_store_quant(g_be, &kq, kc, vc, kn, vn, store, T, KV, D);
    /* the reference: dequantized f32 caches through the dense attention */
    float *kd = malloc((size_t)n_slots * kvd * sizeof(float)), *vd = malloc((size_t)n_slots * kvd * sizeof(float));
    for (int s = 0; s < n_slots; s++)
        for (int h = 0; h < KV; h++) {
            size_t o = (size_t)s * kvd + (size_t)h * D;
            lethe_fp8_dequant_vec(kc + o, D, ks[s * KV + h], kd + o);
            lethe_fp8_dequant_vec(vc + o, D, vs[s * KV + h], vd + o);
        }
    float *out_q = malloc((size_t)T * H * D * sizeof(float)), *out_d = malloc((size_t)T * H * D * sizeof(float));
    for (size_t i = 0; i < (size_t)T * H * D; i++) out_q[i] = NAN;
    lethe_attn_args a = {.out = out_d, .q = q, .k_cache = kd, .v_cache = vd, .n_tokens = T, .n_seqs = S,
                         .q_begin = q_begin, .sel_begin = sel_begin, .sel_slots = sel, .n_heads = H,
                         .n_kv_heads = KV, .head_dim = D, .scale = 1.0f / sqrtf((float)D)};
    g_be->ops->attention(g_be, &a);
    a.out = out_q, a.k_cache = kc, a.v_cache = vc, a.kvq = &kq;
    g_be->ops->attention(g_be, &a);
    double mx = 0, err = 0;
    for (size_t i = 0; i < (size_t)T * H * D; i++) {
        CHECK_MSG(isfinite(out_q[i]), "element %zu not written", i);
        mx = fmax(mx, fabs(out_d[i]));
        err = fmax(err, fabs(out_q[i] - out_d[i]));
    }
    CHECK_MSG(err <= 1e-5 * fmax(mx, 1e-3), "H %d KV %d D %d: max err %g (max %g)", H, KV, D, err, mx);
    fprintf(stderr, "    H=%d KV=%d D=%d T=%d sel=%d: max abs err %.2e of %.2e\n", H, KV, D, T, n_sel, err, mx);
    free(perm), free(sel), free(store), free(all), free(k0), free(v0), free(kn), free(vn), free(q);
    free(kc), free(vc), free(ks), free(vs), free(kd), free(vd), free(out_q), free(out_d);
}

static void test_attention(void) {
    static const qcase cases[] = {
        {8, 2, 64, 4, {1, 37, 5, 1}, {1, 90, 5, 300}, 0},  /* decode, extend, prefill, decode */
        {8, 2, 64, 2, {1, 20}, {500, 120}, 1},             /* sparse decode + extend */
        {4, 4, 36, 2, {9, 1}, {40, 77}, 0},                /* MHA, head_dim with a scalar tail */
        {16, 1, 64, 1, {70}, {70}, 0},                     /* GQA 16, tiles of 8 queries */
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_case(&cases[i]);
}


/* ---- KIVI: packed codes, group params, residual (backend.h LETHE_KV_KIVI) ---- */

enum { KV_KV = 2, KV_D = 64, KV_C = KV_KV * KV_D, KV_G = 32, KV_SLOTS = 160, KV_BLOCKS = 2 };

typedef struct kivi_fix {
    int bits;
    uint8_t *kc, *vc;
    float *vpar, *kgrp, *kres, *vres;
    int32_t aux[KV_SLOTS];
    lethe_kivi_plan plan;
    lethe_kv_quant q;
    float ktok[96][KV_C], vtok[96][KV_C]; /* every token's f32 K / V by row index */
    int32_t slot_of[96];
} kivi_fix;

/* Two steps of one row (block 1): 40 tokens (group 0 packed from new rows,
 * tokens 32..39 to the residual), then 30 more (group 1 = 8 residual + 24 new,
 * tokens 64..69 reuse residual entries 0..5 of the block). */
static void kivi_fill(kivi_fix *f, int bits) {
    memset(f, 0, sizeof(*f));
    f->bits = bits;
    const size_t cb = lethe_kivi_code_bytes(KV_C, bits);
    f->kc = calloc(KV_SLOTS, cb), f->vc = calloc(KV_SLOTS, cb);
    f->vpar = calloc((size_t)KV_SLOTS * 2 * KV_C / KV_G, sizeof(float));
    f->kgrp = calloc((size_t)(KV_SLOTS / KV_G) * 2 * KV_C, sizeof(float));
    f->kres = calloc((size_t)KV_BLOCKS * KV_G * KV_C, sizeof(float));
    f->vres = calloc((size_t)KV_BLOCKS * KV_G * KV_C, sizeof(float));
    for (int i = 0; i < KV_SLOTS; i++) f->aux[i] = INT32_MIN;
    f->plan.slot_aux = f->aux;
    f->q = (lethe_kv_quant){.format = LETHE_KV_KIVI_FORMAT(bits, KV_G), .v_param = f->vpar, .k_group = f->kgrp,
                            .k_res = f->kres, .v_res = f->vres, .n_groups = KV_SLOTS / KV_G,
                            .n_res = KV_BLOCKS * KV_G, .kivi = &f->plan};
    for (int t = 0; t < 70; t++) {
        f->slot_of[t] = (t * 37 + 11) % KV_SLOTS; /* scattered, distinct */
        for (int c = 0; c < KV_C; c++) f->ktok[t][c] = 3.0f * frand() + (c % 7) * 0.5f, f->vtok[t][c] = frand();
    }
    const int res0 = 1 * KV_G;
    int32_t src[KV_G], dst[KV_G], entry[1], slots[40];
    /* step 1 */
    for (int j = 0; j < KV_G; j++) src[j] = j, dst[j] = f->slot_of[j], f->aux[dst[j]] = 3;
    entry[0] = 3;
    for (int t = 32; t < 40; t++) f->aux[f->slot_of[t]] = -(1 + res0 + t % KV_G);
    for (int t = 0; t < 40; t++) slots[t] = f->slot_of[t];
    f->plan.n_pack = 1, f->plan.pack_src = src, f->plan.pack_slot = dst, f->plan.pack_entry = entry;
    g_be->ops->kv_store_quant(g_be, &f->q, f->kc, f->vc, f->ktok[0], f->vtok[0], slots, 40, KV_KV, KV_D);
    /* step 2 */
    for (int j = 0; j < KV_G; j++) {
        int t = 32 + j;
        src[j] = t < 40 ? -(1 + res0 + t % KV_G) : t - 40;
        dst[j] = f->slot_of[t];
    }
    for (int j = 0; j < KV_G; j++) f->aux[dst[j]] = 0;
    entry[0] = 0;
    for (int t = 64; t < 70; t++) f->aux[f->slot_of[t]] = -(1 + res0 + t % KV_G);
    for (int t = 40; t < 70; t++) slots[t - 40] = f->slot_of[t];
    g_be->ops->kv_store_quant(g_be, &f->q, f->kc, f->vc, f->ktok[40], f->vtok[40], slots, 30, KV_KV, KV_D);
}

static void kivi_free(kivi_fix *f) {
    free(f->kc), free(f->vc), free(f->vpar), free(f->kgrp), free(f->kres), free(f->vres);
}

static void test_kivi_store(void) {
    for (int bits = 2; bits <= 8; bits *= 2) {
        static kivi_fix f;
        kivi_fill(&f, bits);
        const size_t cb = lethe_kivi_code_bytes(KV_C, bits), np = KV_C / KV_G;
        const int entries[2] = {3, 0};
        for (int g = 0; g < 2; g++) { /* the reference quantizer over the same G tokens */
            uint8_t codes[KV_G * KV_C];
            float sc[KV_C], zr[KV_C];
            lethe_kivi_quant_keys(f.ktok[g * KV_G], KV_G, KV_C, bits, codes, sc, zr);
            CHECK(!memcmp(f.kgrp + (size_t)entries[g] * 2 * KV_C, sc, sizeof(sc)));
            CHECK(!memcmp(f.kgrp + (size_t)entries[g] * 2 * KV_C + KV_C, zr, sizeof(zr)));
            for (int j = 0; j < KV_G; j++) {
                int t = g * KV_G + j, slot = f.slot_of[t];
                CHECK(!memcmp(f.kc + (size_t)slot * cb, codes + (size_t)j * cb, cb));
                uint8_t vcodes[KV_C];
                float vs[KV_C / KV_G], vz[KV_C / KV_G];
                lethe_kivi_quant_value(f.vtok[t], KV_C, KV_G, bits, vcodes, vs, vz);
                CHECK(!memcmp(f.vc + (size_t)slot * cb, vcodes, cb));
                CHECK(!memcmp(f.vpar + (size_t)slot * 2 * np, vs, sizeof(vs)));
                CHECK(!memcmp(f.vpar + (size_t)slot * 2 * np + np, vz, sizeof(vz)));
            }
        }
        for (int t = 64; t < 70; t++) { /* residual: exact */
            int r = -1 - f.aux[f.slot_of[t]];
            CHECK(!memcmp(f.kres + (size_t)r * KV_C, f.ktok[t], sizeof(f.ktok[t])));
            CHECK(!memcmp(f.vres + (size_t)r * KV_C, f.vtok[t], sizeof(f.vtok[t])));
        }
        kivi_free(&f);
    }
}

/* attention over the KIVI pool == dense attention over its dequantized KV */
static void test_kivi_attention(void) {
    static kivi_fix f;
    kivi_fill(&f, 2);
    const int H = 8;
    const size_t cb = lethe_kivi_code_bytes(KV_C, 2), np = KV_C / KV_G;
    float *kd = calloc((size_t)KV_SLOTS * KV_C, sizeof(float)), *vd = calloc((size_t)KV_SLOTS * KV_C, sizeof(float));
    for (int t = 0; t < 70; t++) {
        int s = f.slot_of[t], aux = f.aux[s];
        if (aux < 0) {
            memcpy(kd + (size_t)s * KV_C, f.kres + (size_t)(-1 - aux) * KV_C, KV_C * sizeof(float));
            memcpy(vd + (size_t)s * KV_C, f.vres + (size_t)(-1 - aux) * KV_C, KV_C * sizeof(float));
            continue;
        }
        for (int c = 0; c < KV_C; c++) {
            const float *ks = f.kgrp + (size_t)aux * 2 * KV_C;
            kd[(size_t)s * KV_C + c] = (float)lethe_code_get(f.kc + (size_t)s * cb, c, 2) * ks[c] + ks[KV_C + c];
        }
        lethe_kivi_dequant_value(f.vc + (size_t)s * cb, f.vpar + (size_t)s * 2 * np, f.vpar + (size_t)s * 2 * np + np,
                                 KV_C, KV_G, 2, vd + (size_t)s * KV_C);
    }
    /* two "sequences" over the same row: a 5-token extend at the end and a decode at 50 tokens */
    int32_t q_begin[3] = {0, 5, 6}, sel_begin[3] = {0, 70, 120}, sel[120];
    for (int t = 0; t < 70; t++) sel[t] = f.slot_of[t];
    for (int t = 0; t < 50; t++) sel[70 + t] = f.slot_of[t];
    const int T = 6;
    float *q = malloc((size_t)T * H * KV_D * sizeof(float));
    for (int i = 0; i < T * H * KV_D; i++) q[i] = frand();
    float *od = malloc((size_t)T * H * KV_D * sizeof(float)), *oq = malloc((size_t)T * H * KV_D * sizeof(float));
    for (int i = 0; i < T * H * KV_D; i++) oq[i] = NAN;
    lethe_attn_args a = {.out = od, .q = q, .k_cache = kd, .v_cache = vd, .n_tokens = T, .n_seqs = 2,
                         .q_begin = q_begin, .sel_begin = sel_begin, .sel_slots = sel, .n_heads = H,
                         .n_kv_heads = KV_KV, .head_dim = KV_D, .scale = 0.125f};
    g_be->ops->attention(g_be, &a);
    a.out = oq, a.k_cache = f.kc, a.v_cache = f.vc, a.kvq = &f.q;
    g_be->ops->attention(g_be, &a);
    double mx = 0, err = 0;
    for (int i = 0; i < T * H * KV_D; i++) {
        CHECK_MSG(isfinite(oq[i]), "element %d not written", i);
        mx = fmax(mx, fabs(od[i]));
        err = fmax(err, fabs(oq[i] - od[i]));
    }
    fprintf(stderr, "    kivi2 attention vs dense over the dequantized KV: max abs err %.2e of %.2e\n", err, mx);
    CHECK(err <= 1e-5 * fmax(mx, 1e-3));
    free(kd), free(vd), free(q), free(od), free(oq);
    kivi_free(&f);
}

/* ---- engine: pool capacity and outputs ---- */

static const char *g_sparse_config;
static int32_t g_max_len; /* 0 = the default below */
static lethe_engine *open_engine(const char *model, bool tiny, const char *method, size_t kv_bytes) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = model;
    p.load_format = tiny ? "dummy" : "auto";
    p.seed = 7;
    p.device = "cpu";
    p.n_threads = 2;
    p.max_model_len = g_max_len ? g_max_len : tiny ? 128 : 256;
    p.max_num_seqs = 4096;
    p.max_num_batched_tokens = 64;
    p.enable_prefix_caching = false;
    p.kv_cache_bytes = kv_bytes;
    p.sparse_method = method;
    p.sparse_config = !strcmp(method, "kivi") ? g_sparse_config : NULL;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int rc = lethe_engine_create(&p, &e);
    CHECK_MSG(rc == 0, "%s: %s", method, lethe_engine_last_error());
    return e;
}

static void test_pool_capacity(void) {
    const size_t budget = (size_t)4 << 20;
    int64_t slots[2];
    const char *methods[2] = {"dense", "fp8_kv"};
    for (int i = 0; i < 2; i++) {
        lethe_engine *e = open_engine("tests/data/tiny-llama/config.json", true, methods[i], budget);
        lethe_engine_stats st;
        lethe_engine_get_stats(e, &st);
        slots[i] = st.kv_slots_total;
        lethe_engine_destroy(e);
    }
    /* tiny llama: 2 layers, 2 KV heads, head_dim 16 */
    const size_t nat = lethe_kv_token_bytes(2, 2, 16, sizeof(float), LETHE_KV_NATIVE);
    const size_t fp8 = lethe_kv_token_bytes(2, 2, 16, sizeof(float), LETHE_KV_FP8_E4M3);
    CHECK_EQ_INT(nat, 2 * 2 * 2 * 16 * 4);
    CHECK_EQ_INT(fp8, 2 * 2 * 2 * (16 + 4));
    CHECK_EQ_INT(slots[0], (int64_t)(budget / nat));
    CHECK_EQ_INT(slots[1], (int64_t)(budget / fp8));
    double ratio = (double)slots[1] / (double)slots[0];
    fprintf(stderr, "    same %zu-byte budget: dense %lld slots, fp8_kv %lld (%.2fx)\n", budget,
            (long long)slots[0], (long long)slots[1], ratio);
    CHECK(ratio > 3.1 && ratio < 3.3); /* 4 * 16 / 20 */
    /* kivi 2-bit, G 16 (tiny head_dim 16): per token 2 layers x (2 x 32 x 2 / 8 codes
     * + 16 x 32 / 16 group params) + 4 = 100 bytes, after a residual of
     * min(max_num_seqs, budget / 8 / block) blocks of 16 f32 tokens */
    lethe_engine *e = open_engine("tests/data/tiny-llama/config.json", true, "kivi", budget);
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    lethe_engine_destroy(e);
    const lethe_kv_format kf = LETHE_KV_KIVI_FORMAT(2, 16);
    const size_t kt = lethe_kv_token_bytes(2, 2, 16, sizeof(float), kf);
    const size_t blk = lethe_kv_kivi_res_bytes(2, 2, 16, sizeof(float), kf, 1);
    CHECK_EQ_INT(kt, 100);
    CHECK_EQ_INT(blk, 2 * 2 * 16 * 32 * 4);
    const size_t nb = budget / 8 / blk;
    /* the residual bounds the running requests (nb = 64 here), and the engine never
     * holds more than running requests x max_model_len (128 for the tiny model) */
    const int64_t fit = (int64_t)((budget - nb * blk) / kt);
    CHECK_EQ_INT(st.kv_slots_total, LETHE_MIN(fit, (int64_t)nb * 128));
    double kr = (double)fit / (double)slots[0];
    fprintf(stderr, "    kivi 2-bit: %lld slots fit (%.2fx dense; %.2fx per token, 7/8 of the budget), %lld kept "
            "(%d running x 128)\n", (long long)fit, kr, (double)nat / (double)kt, (long long)st.kv_slots_total, (int)nb);
    CHECK(kr > 4.4 && kr < 4.6);
    /* a method's own payload layout (sparse_throwaway.h plane_copy: K, V and an
     * int32 position plane per layer) sizes the pool by its real bytes */
    e = open_engine("tests/data/tiny-llama/config.json", true, "plane_copy", budget);
    lethe_engine_get_stats(e, &st);
    lethe_engine_destroy(e);
    CHECK_EQ_INT(st.kv_slots_total, (int64_t)(budget / (nat + 2 * sizeof(int32_t))));
}

typedef struct gen_out {
    int32_t tok[8];
    int n;
    float *logits;
    int32_t n_vocab;
} gen_out;

static void on_event(void *user, const lethe_event *ev) {
    gen_out *o = user;
    if (ev->n_tokens == 1 && o->n < 8) {
        if (!o->logits) o->logits = calloc((size_t)8 * ev->n_vocab, sizeof(float));
        o->n_vocab = ev->n_vocab;
        memcpy(o->logits + (size_t)o->n * ev->n_vocab, ev->logits, sizeof(float) * (size_t)ev->n_vocab);
        o->tok[o->n++] = ev->token;
    }
}

static void generate(const char *method, gen_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine *e = open_engine("models/SmolLM2-135M-Instruct.Q4_1.gguf", false, method, (size_t)64 << 20);
    int32_t ids[96];
    for (int i = 0; i < 96; i++) ids[i] = 200 + (i * 13) % 64; /* repeated pattern: easy to continue */
    lethe_request_params rp = {.prompt = ids, .n_prompt = 96, .cb = on_event, .user = o, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = 8;
    rp.sampling.ignore_eos = true;
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    while (lethe_engine_has_work(e)) CHECK(lethe_engine_step(e) == 0);
    lethe_engine_destroy(e);
    CHECK_EQ_INT(o->n, 8);
}

static void test_smollm2_close_to_dense(void) {
    gen_out d, f;
    generate("dense", &d);
    generate("fp8_kv", &f);
    int same = 0;
    for (int i = 0; i < 8; i++) same += d.tok[i] == f.tok[i];
    /* the first token comes from the same prompt: same argmax, logits within
     * E4M3's few-percent element error (measured 0.062 on this prompt) */
    double e = rel_err(f.logits, d.logits, (size_t)d.n_vocab);
    fprintf(stderr, "    SmolLM2 fp8_kv vs dense: %d/8 greedy tokens equal, first-step logits rel err %.3g\n",
            same, e);
    CHECK(d.tok[0] == f.tok[0]);
    CHECK(e < 0.12);
    CHECK(same >= 6);
    free(f.logits);
    gen_out k;
    g_sparse_config = "kivi_bits=4,kv_quant_page_size=32";
    generate("kivi", &k); /* 96-token prompt: 3 groups of 32 quantized from the first step */
    same = 0;
    for (int i = 0; i < 8; i++) same += d.tok[i] == k.tok[i];
    e = rel_err(k.logits, d.logits, (size_t)d.n_vocab);
    fprintf(stderr, "    SmolLM2 kivi 4-bit vs dense: %d/8 greedy tokens equal, first-step logits rel err %.3g\n",
            same, e);
    CHECK(d.tok[0] == k.tok[0]);
    CHECK(e < 0.25);
    CHECK(same >= 5);
    free(k.logits), free(d.logits);
}

int main(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 2};
    CHECK(lethe_backend_create(&bp, &g_be) == LETHE_OK);
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_plane_copy) == LETHE_OK, "%s", lethe_last_error());
    TEST_RUN(test_store);
    TEST_RUN(test_attention);
    TEST_RUN(test_kivi_store);
    TEST_RUN(test_kivi_attention);
    g_sparse_config = "kivi_bits=2,kv_quant_page_size=16";
    TEST_RUN(test_pool_capacity);
    TEST_RUN(test_smollm2_close_to_dense);
    lethe_backend_destroy(g_be);
    return 0;
}

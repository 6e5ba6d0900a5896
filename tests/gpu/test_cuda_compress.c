/* test_cuda_compress.c - the compression methods on CUDA: the TurboQuant ops
 * (backend/cuda/attention_tq.cu) against their CPU twins
 * (backend/cpu/attention_tq.c), and turboquant / palu through the engine.
 * Needs a CUDA device (make test-gpu).
 *
 *  - kv_store_quant: inputs rounded to bf16 on the host, so both backends
 *    quantize identical values; codes AND fp16 norms must be bit-identical
 *    (the kernel repeats lethe_tq_quant_vec's steps with IEEE intrinsics),
 *    2/3/4 bits, head_dim 16..256, prefix tokens then the step's tokens over
 *    permuted slots, a zero vector included.
 *  - attention: pure decode batches (the fused kernel: rotated queries,
 *    codes read in the rotated basis, split-K, LSE merge, rotation back) and
 *    batches with prefill / extend rows (dequantized selection + the dense
 *    kernels), dense and sparse selections, GQA 1..8; NaN-poisoned output,
 *    ||gpu - cpu|| / ||cpu|| < 2e-2 (bf16 q and output).
 *  - engine: tiny-llama greedy on CUDA, turboquant 4-bit vs dense on CUDA and
 *    vs turboquant on the CPU backend: same first token, first-step logits
 *    rel err < 0.25; palu with full-rank identity factors (its payload path:
 *    latents, key reconstruction + RoPE, absorbed output projection, all
 *    through existing backend ops) vs dense on CUDA: same first token, logits
 *    rel err < 3e-2 (bf16 rounding of the scratch keys / absorbed wo);
 *  - gather_sum (DeltaKV's father means, cuda/elementwise.cu) vs its CPU
 *    twin on bf16-rounded inputs: rel err < 1e-2 (one bf16 rounding of out),
 *    K 1..8, repeated indices, scale -1/K and +1/K;
 *  - deltakv through the engine with the identity compressor, blocks of 8
 *    and top-16 selection (compression, fathers, reconstruction + RoPE,
 *    selection all on the device) vs deltakv on the CPU backend and vs CUDA
 *    dense: same first token, logits rel err < 5e-2. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/tq_codec.h"
#include "core/util.h"
#include "lethe.h"
#include "test.h"

extern int cudaMemcpy(void *dst, const void *src, size_t n, int kind);
enum { MEMCPY_D2H = 2 };

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 777;

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
static void gpu_bytes(void *dst, const void *src, size_t n) {
    g_gpu->ops->sync(g_gpu);
    CHECK(cudaMemcpy(dst, src, n, MEMCPY_D2H) == 0);
}

typedef struct tcase {
    const char *name;
    int H, KV, D, bits, S;
    int n_q[5], n_sel[5];
    int sparse;
} tcase;

typedef struct side {
    lethe_backend *be;
    void *kc, *vc, *kn, *vn, *tq, *q, *out, *k0, *v0, *knew, *vnew;
    lethe_kv_quant kvq;
} side;

static void run_case(const tcase *tc) {
    const int H = tc->H, KV = tc->KV, D = tc->D, S = tc->S, b = tc->bits;
    int32_t q_begin[6] = {0}, sel_begin[6] = {0}, n_slots = 0;
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
    int32_t *sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t)), *store = lethe_xmalloc((size_t)T * sizeof(int32_t));
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
    const size_t kvd = (size_t)KV * D, cb = (size_t)KV * lethe_tq_code_bytes(D, b);
    float *k0 = rand_bf16((size_t)n_slots * kvd, 2), *v0 = rand_bf16((size_t)n_slots * kvd, 1);
    float *kn = rand_bf16((size_t)T * kvd, 2), *vn = rand_bf16((size_t)T * kvd, 1);
    memset(kn, 0, (size_t)D * sizeof(float)); /* the step's first token, KV head 0: a zero key */
    float *q = rand_bf16((size_t)T * H * D, 1);
    float *nan = lethe_xmalloc((size_t)T * H * D * sizeof(float));
    for (size_t i = 0; i < (size_t)T * H * D; i++) nan[i] = NAN;
    const size_t nt = lethe_tq_tables_floats(D);
    float *tab = lethe_xcalloc(nt, sizeof(float));
    lethe_tq_rotation(5, D, tab);
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) tab[lethe_tq_off_rot_t(D) + (size_t)j * D + i] = tab[(size_t)i * D + j];
    lethe_tq_codebook(b, D, tab + lethe_tq_off_centroids(D), tab + lethe_tq_off_bounds(D));
    side sd[2];
    for (int k = 0; k < 2; k++) {
        side *s = &sd[k];
        s->be = k ? g_gpu : g_cpu;
        s->kc = alloc_bytes(s->be, (size_t)n_slots * cb);
        s->vc = alloc_bytes(s->be, (size_t)n_slots * cb);
        s->kn = alloc_bytes(s->be, (size_t)n_slots * KV * 2);
        s->vn = alloc_bytes(s->be, (size_t)n_slots * KV * 2);
        s->tq = alloc_bytes(s->be, nt * sizeof(float));
        s->be->ops->copy_from_host(s->be, s->tq, tab, nt * sizeof(float));
        s->kvq = (lethe_kv_quant){.format = LETHE_KV_TQ_FORMAT(b, 5), .k_norm = s->kn, .v_norm = s->vn, .tq = s->tq};
        s->k0 = upload(s->be, k0, (size_t)n_slots * kvd);
        s->v0 = upload(s->be, v0, (size_t)n_slots * kvd);
        s->knew = upload(s->be, kn, (size_t)T * kvd);
        s->vnew = upload(s->be, vn, (size_t)T * kvd);
        s->q = upload(s->be, q, (size_t)T * H * D);
        s->out = upload(s->be, nan, (size_t)T * H * D);
        s->be->ops->kv_store_quant(s->be, &s->kvq, s->kc, s->vc, s->k0, s->v0, all, n_slots, KV, D);
        s->be->ops->kv_store_quant(s->be, &s->kvq, s->kc, s->vc, s->knew, s->vnew, store, T, KV, D);
    }
    char what[160];
    snprintf(what, sizeof what, "tq%d %s (H=%d KV=%d D=%d T=%d sel=%d)", b, tc->name, H, KV, D, T, n_sel);
    /* store: codes and norms bit-identical */
    uint8_t *buf = lethe_xmalloc((size_t)n_slots * cb);
    uint16_t *nb = lethe_xmalloc((size_t)n_slots * KV * 2);
    for (int which = 0; which < 2; which++) {
        gpu_bytes(buf, which ? sd[1].vc : sd[1].kc, (size_t)n_slots * cb);
        size_t bad = 0;
        const uint8_t *ref = which ? sd[0].vc : sd[0].kc;
        for (size_t i = 0; i < (size_t)n_slots * cb; i++) bad += buf[i] != ref[i];
        CHECK_MSG(bad == 0, "%s: %zu of %zu %s code bytes differ from the CPU", what, bad, (size_t)n_slots * cb,
                  which ? "V" : "K");
        gpu_bytes(nb, which ? sd[1].vn : sd[1].kn, (size_t)n_slots * KV * 2);
        CHECK_MSG(!memcmp(nb, which ? sd[0].vn : sd[0].kn, (size_t)n_slots * KV * 2), "%s: %s norms differ", what,
                  which ? "V" : "K");
    }
    CHECK(((uint16_t *)sd[0].kn)[(size_t)store[0] * KV] == 0); /* the zero key: norm 0, no NaN */
    for (int k = 0; k < 2; k++) {
        lethe_attn_args a = {.out = sd[k].out, .q = sd[k].q, .k_cache = sd[k].kc, .v_cache = sd[k].vc,
                             .n_tokens = T, .n_seqs = S, .q_begin = q_begin, .sel_begin = sel_begin,
                             .sel_slots = sel, .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                             .scale = 1.0f / sqrtf((float)D), .kvq = &sd[k].kvq};
        sd[k].be->ops->attention(sd[k].be, &a);
    }
    float *oc = lethe_xmalloc((size_t)T * H * D * sizeof(float)), *og = lethe_xmalloc((size_t)T * H * D * sizeof(float));
    g_cpu->ops->act_to_host(g_cpu, oc, sd[0].out, (size_t)T * H * D);
    g_gpu->ops->act_to_host(g_gpu, og, sd[1].out, (size_t)T * H * D);
    for (size_t i = 0; i < (size_t)T * H * D; i++)
        CHECK_MSG(isfinite(og[i]), "%s: element %zu not finite (%g): unwritten", what, i, (double)og[i]);
    const double e = rel_err(og, oc, (size_t)T * H * D);
    fprintf(stderr, "    %-72s codes equal, rel err %.2e\n", what, e);
    CHECK_MSG(e < 2e-2, "%s: relative error %.3g", what, e);
    for (int k = 0; k < 2; k++) {
        void *bufs[] = {sd[k].kc, sd[k].vc, sd[k].kn, sd[k].vn, sd[k].tq, sd[k].q, sd[k].out,
                        sd[k].k0, sd[k].v0, sd[k].knew, sd[k].vnew};
        for (size_t i = 0; i < LETHE_ARRAY_LEN(bufs); i++) sd[k].be->ops->release(sd[k].be, bufs[i]);
    }
    free(perm), free(all), free(sel), free(store), free(k0), free(v0), free(kn), free(vn), free(q), free(nan);
    free(tab), free(buf), free(nb), free(oc), free(og);
}

static void test_ops(void) {
    static const tcase cases[] = {
        {"decode single", 32, 8, 128, 4, 1, {1}, {4096}, 0},
        {"decode batch", 32, 8, 128, 3, 4, {1, 1, 1, 1}, {300, 17, 2000, 1}, 0},
        {"decode sparse", 16, 4, 64, 2, 3, {1, 1, 1}, {900, 40, 130}, 1},
        {"decode gqa3 d64", 9, 3, 64, 4, 2, {1, 1}, {513, 77}, 0},
        {"decode d256", 8, 2, 256, 3, 2, {1, 1}, {257, 31}, 0},
        {"decode d16", 4, 2, 16, 4, 2, {1, 1}, {60, 9}, 0},
        {"prefill", 32, 8, 128, 4, 1, {200}, {200}, 0},
        {"mixed", 16, 4, 64, 3, 4, {1, 37, 1, 5}, {500, 37, 64, 90}, 0},
        {"mixed sparse mha", 4, 4, 96, 2, 3, {3, 1, 20}, {120, 33, 20}, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_case(&cases[i]);
}

/* ---- engine: turboquant 4-bit on CUDA vs dense on CUDA and vs the CPU ---- */

typedef struct gen {
    int32_t tok[16];
    float *logits;
    int n, V;
} gen;

static void gen_ev(void *user, const lethe_event *ev) {
    gen *o = user;
    if (ev->n_tokens == 1 && o->n < 16) {
        if (!o->logits) {
            o->V = ev->n_vocab;
            o->logits = lethe_xmalloc((size_t)ev->n_vocab * sizeof(float));
            memcpy(o->logits, ev->logits, (size_t)ev->n_vocab * sizeof(float));
        }
        o->tok[o->n++] = ev->token;
    }
}

static void generate(const char *device, const char *method, gen *o) {
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
    p.sparse_config = !strcmp(method, "turboquant") ? "turboquant_bits=4"
                      : !strcmp(method, "palu")     ? "palu_factors=@identity"
                      : !strcmp(method, "deltakv")  ? "deltakv_compressor=@identity,sink_keep_tokens=4,"
                                                      "recent_keep_tokens=8,decode_keep_tokens=16,deltakv_full_layers=0"
                                                    : NULL;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s on %s: %s", method, device, lethe_engine_last_error());
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 3 + (i * 7) % 50;
    lethe_request_params rp = {.prompt = ids, .n_prompt = 40, .cb = gen_ev, .user = o, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = 16;
    rp.sampling.ignore_eos = true;
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    while (lethe_engine_has_work(e)) CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
    lethe_engine_destroy(e);
    CHECK_EQ_INT(o->n, 16);
}

static void test_gather_sum(void) {
    const int cases[4][4] = {{1, 7, 64, 40}, {4, 33, 256, 100}, {8, 5, 96, 17}, {3, 300, 2048, 64}}; /* K, n, dim, rows */
    for (int c = 0; c < 4; c++) {
        const int K = cases[c][0], n = cases[c][1], dim = cases[c][2], rows = cases[c][3];
        float *src = rand_bf16((size_t)rows * dim, 2), *out = rand_bf16((size_t)n * dim, 1);
        float *ref = lethe_xmalloc((size_t)n * dim * sizeof(float)), *got = lethe_xmalloc((size_t)n * dim * sizeof(float));
        int32_t *idx = lethe_xmalloc((size_t)n * K * sizeof(int32_t));
        for (int i = 0; i < n * K; i++) idx[i] = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)rows);
        if (n > 1) idx[K - 1] = idx[0]; /* a repeated father */
        const float scale = c % 2 ? 1.0f / K : -1.0f / K;
        memcpy(ref, out, (size_t)n * dim * sizeof(float));
        g_cpu->ops->gather_sum(g_cpu, ref, src, idx, n, K, dim, scale);
        void *ds = upload(g_gpu, src, (size_t)rows * dim), *dout = upload(g_gpu, out, (size_t)n * dim);
        g_gpu->ops->gather_sum(g_gpu, dout, ds, idx, n, K, dim, scale);
        g_gpu->ops->act_to_host(g_gpu, got, dout, (size_t)n * dim);
        const double e = rel_err(got, ref, (size_t)n * dim);
        fprintf(stderr, "    gather_sum K %d n %d dim %d: rel err %.2e\n", K, n, dim, e);
        CHECK(e < 1e-2);
        g_gpu->ops->release(g_gpu, ds), g_gpu->ops->release(g_gpu, dout);
        free(src), free(out), free(ref), free(got), free(idx);
    }
}

static void test_engine(void) {
    gen d, t, c;
    generate("cuda", "dense", &d);
    generate("cuda", "turboquant", &t);
    generate("cpu", "turboquant", &c);
    int same = 0, same_cpu = 0;
    while (same < 16 && d.tok[same] == t.tok[same]) same++;
    while (same_cpu < 16 && c.tok[same_cpu] == t.tok[same_cpu]) same_cpu++;
    const double e = rel_err(t.logits, d.logits, (size_t)d.V), ec = rel_err(t.logits, c.logits, (size_t)d.V);
    fprintf(stderr, "    tiny-llama CUDA turboquant 4-bit: vs CUDA dense first %d/16 tokens equal, logits rel err "
            "%.3g; vs CPU turboquant %d/16, rel err %.3g\n", same, e, same_cpu, ec);
    CHECK(e < 0.25 && ec < 0.25);
    CHECK(d.tok[0] == t.tok[0] && c.tok[0] == t.tok[0]);
    gen pl;
    generate("cuda", "palu", &pl);
    int same_pl = 0;
    while (same_pl < 16 && d.tok[same_pl] == pl.tok[same_pl]) same_pl++;
    const double ep = rel_err(pl.logits, d.logits, (size_t)d.V);
    fprintf(stderr, "    tiny-llama CUDA palu @identity vs CUDA dense: %d/16 tokens equal, logits rel err %.3g\n", same_pl,
            ep);
    CHECK(ep < 3e-2 && d.tok[0] == pl.tok[0]);
    gen dg, dc;
    generate("cuda", "deltakv", &dg);
    generate("cpu", "deltakv", &dc);
    int same_dk = 0;
    while (same_dk < 16 && dc.tok[same_dk] == dg.tok[same_dk]) same_dk++;
    const double edc = rel_err(dg.logits, dc.logits, (size_t)d.V), edd = rel_err(dg.logits, d.logits, (size_t)d.V);
    fprintf(stderr, "    tiny-llama deltakv @identity, blocks of 8, top-16: CUDA vs CPU %d/16 tokens equal, logits rel "
            "err %.3g; vs CUDA dense %.3g\n", same_dk, edc, edd);
    CHECK(edc < 5e-2 && edd < 5e-2 && dg.tok[0] == dc.tok[0] && dg.tok[0] == d.tok[0]);
    free(d.logits), free(t.logits), free(c.logits), free(pl.logits), free(dg.logits), free(dc.logits);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pg, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_ops);
    TEST_RUN(test_gather_sum);
    TEST_RUN(test_engine);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_compress: all passed\n");
    return 0;
}

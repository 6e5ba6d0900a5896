/* test_cuda_retro.c - RetroInfer on the CUDA backend: its three ops against
 * the CPU twins (backend/cpu/clusters.c) and the method through the engine.
 *
 *  - cluster_assign: random bf16 keys over scattered slots, n up to 9000,
 *    n_c up to 600, head_dim 64 / 96 / 128 / 256, 1..8 KV heads: the CUDA
 *    choice's centred dot (recomputed in double) is within 1e-4 (relative to
 *    the row's best) of the CPU choice's, and most choices are equal;
 *  - cluster_scores: fp32 reassociation only (1e-5 relative);
 *  - cluster_attention: exact lists mixing pool slots and aux rows, estimated
 *    clusters with f32 tables, GQA 1 / 4 / 8, lists of 1 .. 5000 keys;
 *    relative error < 1e-2 (bf16 output) vs the CPU twin; other rows of out
 *    stay untouched;
 *  - engine: tiny Llama (dummy weights), 100-token prompt, 24 tokens (the
 *    index extended twice), CUDA against the CPU backend (test_engine):
 *    every cluster retrieved equals dense on CUDA bit for bit; lossy budgets
 *    teacher-forced match the CPU twin; the host tier (KV offloaded from the
 *    pool) equals the device path bit for bit; every run returns every slot.
 * Needs a CUDA device (make test-gpu). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "lethe.h"
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
static float frand(void) {
    return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0);
}
static float *rand_bf16(size_t n, float scale) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = bf16_round(frand() * scale);
    return v;
}

typedef struct pair {
    void *c, *g;
} pair;
static pair pair_act(const float *host, size_t n) {
    pair p;
    CHECK(g_cpu->ops->alloc(g_cpu, n * g_cpu->ops->act_size, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, n * g_gpu->ops->act_size, &p.g) == LETHE_OK);
    g_cpu->ops->act_from_host(g_cpu, p.c, host, n);
    g_gpu->ops->act_from_host(g_gpu, p.g, host, n);
    return p;
}
static pair pair_f32(const float *host, size_t n) { /* raw f32 backend memory (cluster tables) */
    pair p;
    CHECK(g_cpu->ops->alloc(g_cpu, n * sizeof(float), &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, n * sizeof(float), &p.g) == LETHE_OK);
    g_cpu->ops->copy_from_host(g_cpu, p.c, host, n * sizeof(float));
    g_gpu->ops->copy_from_host(g_gpu, p.g, host, n * sizeof(float));
    return p;
}
static void pair_free(pair *p) {
    g_cpu->ops->release(g_cpu, p->c);
    g_gpu->ops->release(g_gpu, p->g);
}

static void test_assign(void) {
    static const int shapes[][4] = {{1, 64, 40, 3},   {2, 128, 1024, 64}, {8, 128, 9000, 600},
                                    {3, 96, 777, 50}, {2, 256, 300, 20},  {8, 64, 8192, 512}};
    for (size_t si = 0; si < LETHE_ARRAY_LEN(shapes); si++) {
        const int KH = shapes[si][0], D = shapes[si][1], n = shapes[si][2], nc = shapes[si][3];
        const int n_slots = n + 50;
        float *kc = rand_bf16((size_t)n_slots * KH * D, 1.0f);
        float *cent = lethe_xmalloc((size_t)KH * nc * D * sizeof(float)),
              *mu = lethe_xmalloc((size_t)KH * D * sizeof(float));
        for (int i = 0; i < KH * nc; i++) { /* unit centroids */
            double s = 0;
            for (int d = 0; d < D; d++)
                cent[(size_t)i * D + d] = frand(),
                                     s += (double)cent[(size_t)i * D + d] * cent[(size_t)i * D + d];
            for (int d = 0; d < D; d++) cent[(size_t)i * D + d] /= (float)sqrt(s);
        }
        for (int i = 0; i < KH * D; i++) mu[i] = 0.05f * frand();
        int32_t *slots = lethe_xmalloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) slots[i] = (int32_t)(((int64_t)i * 37 + 11) % n_slots);
        pair k = pair_act(kc, (size_t)n_slots * KH * D);
        int32_t *ac = lethe_xmalloc((size_t)KH * n * sizeof(int32_t)),
                *ag = lethe_xmalloc((size_t)KH * n * sizeof(int32_t));
        for (int i = 0; i < KH * n; i++) ag[i] = -7;
        g_cpu->ops->cluster_assign(g_cpu, ac, k.c, slots, n, cent, mu, nc, KH, D);
        g_gpu->ops->cluster_assign(g_gpu, ag, k.g, slots, n, cent, mu, nc, KH, D);
        int same = 0;
        for (int h = 0; h < KH; h++)
            for (int e = 0; e < n; e++) {
                const int32_t a = ac[(size_t)h * n + e], b = ag[(size_t)h * n + e];
                CHECK_MSG(b >= 0 && b < nc, "assign: (%d, %d) not written (%d)", h, e, b);
                double sa = 0, sb = 0;
                for (int d = 0; d < D; d++) {
                    const double x = (double)kc[((size_t)slots[e] * KH + h) * D + d] -
                                     mu[h * D + d];
                    sa += x * cent[((size_t)h * nc + a) * D + d];
                    sb += x * cent[((size_t)h * nc + b) * D + d];
                }
                CHECK_MSG(sb >= sa - 1e-4 * (1 + fabs(sa)),
                          "assign KH=%d D=%d n=%d (%d, %d): cuda %d (%.7g) vs cpu %d (%.7g)", KH, D,
                          n, h, e, b, sb, a, sa);
                same += a == b;
            }
        CHECK(same >= (int)(0.99 * KH * n));
        fprintf(stderr, "    cluster_assign KH=%d D=%d n=%-5d n_c=%-4d same choice %.4f\n", KH, D,
                n, nc, (double)same / (KH * n));
        pair_free(&k);
        free(kc), free(cent), free(mu), free(slots), free(ac), free(ag);
    }
}

static void test_scores_attention(void) {
    static const int shapes[][5] = {/* H, KH, D, n_q, max keys */
                                    {4, 4, 64, 1, 40},   {32, 8, 128, 8, 5000}, {8, 1, 128, 3, 700},
                                    {12, 3, 96, 5, 300}, {16, 2, 256, 2, 900},  {32, 8, 128, 1, 1}};
    for (size_t si = 0; si < LETHE_ARRAY_LEN(shapes); si++) {
        const int H = shapes[si][0], KH = shapes[si][1], D = shapes[si][2], nq = shapes[si][3],
                  mk = shapes[si][4];
        const int n_slots = 6000, n_aux = 512, n_rows = 900, n_tok = nq + 2;
        float *kc = rand_bf16((size_t)n_slots * KH * D, 1.0f),
              *vc = rand_bf16((size_t)n_slots * KH * D, 1.0f);
        float *ka = rand_bf16((size_t)n_aux * D, 1.0f), *va = rand_bf16((size_t)n_aux * D, 1.0f);
        float *q = rand_bf16((size_t)n_tok * H * D, 1.5f);
        float *cent = lethe_xmalloc((size_t)n_rows * D * sizeof(float)),
              *vsum = lethe_xmalloc((size_t)n_rows * D * sizeof(float));
        float *cnt = lethe_xmalloc((size_t)n_rows * sizeof(float));
        for (int r = 0; r < n_rows; r++) {
            cnt[r] = (float)(1 + r % 30);
            for (int d = 0; d < D; d++)
                cent[(size_t)r * D + d] = bf16_round(frand()),
                                     vsum[(size_t)r * D + d] = cnt[r] * frand();
        }
        int32_t *qrows = lethe_xmalloc((size_t)nq * sizeof(int32_t));
        for (int i = 0; i < nq; i++) qrows[i] = (i * 5 + 1) % n_tok;
        for (int i = 0; i < nq; i++) /* distinct rows */
            for (int j = 0; j < i; j++)
                if (qrows[j] == qrows[i]) qrows[i] = (qrows[i] + 1) % n_tok, j = -1;
        const int no = nq * KH;
        int32_t *xb = lethe_xmalloc((size_t)(no + 1) * sizeof(int32_t)),
                *eb = lethe_xmalloc((size_t)(no + 1) * sizeof(int32_t));
        int32_t *xs = lethe_xmalloc((size_t)no * mk * sizeof(int32_t)),
                *ei = lethe_xmalloc((size_t)no * 200 * sizeof(int32_t));
        int nx = 0, ne = 0;
        for (int o = 0; o < no; o++) {
            xb[o] = nx, eb[o] = ne;
            const int cntx = 1 + (int)((lethe_splitmix64(&g_rng) >> 33) % (uint64_t)mk);
            for (int j = 0; j < cntx; j++) {
                const uint64_t r = lethe_splitmix64(&g_rng);
                xs[nx++] = (r & 3) == 0 ? -1 - (int32_t)((r >> 8) % n_aux)
                                        : (int32_t)((r >> 8) % n_slots);
            }
            const int cnte = (int)((lethe_splitmix64(&g_rng) >> 33) % 200);
            for (int j = 0; j < cnte; j++)
                ei[ne++] = (int32_t)((lethe_splitmix64(&g_rng) >> 20) % n_rows);
        }
        xb[no] = nx, eb[no] = ne;
        pair pk = pair_act(kc, (size_t)n_slots * KH * D),
             pv = pair_act(vc, (size_t)n_slots * KH * D);
        pair pka = pair_act(ka, (size_t)n_aux * D), pva = pair_act(va, (size_t)n_aux * D);
        pair pq = pair_act(q, (size_t)n_tok * H * D);
        pair pc = pair_f32(cent, (size_t)n_rows * D), ps = pair_f32(vsum, (size_t)n_rows * D);
        pair pn = pair_f32(cnt, (size_t)n_rows);
        float *fill = lethe_xmalloc((size_t)n_tok * H * D * sizeof(float));
        for (int i = 0; i < n_tok * H * D; i++) fill[i] = 7.0f;
        pair po = pair_act(fill, (size_t)n_tok * H * D);
        /* scores: every estimated list as the ids */
        float *sc = lethe_xmalloc((size_t)(ne + 1) * sizeof(float)),
              *sg = lethe_xmalloc((size_t)(ne + 1) * sizeof(float));
        g_cpu->ops->cluster_scores(g_cpu, sc, pq.c, pc.c, nq, qrows, eb, ei, H, KH, D, 0.125f);
        g_gpu->ops->cluster_scores(g_gpu, sg, pq.g, pc.g, nq, qrows, eb, ei, H, KH, D, 0.125f);
        for (int e = 0; e < ne; e++)
            CHECK_MSG(fabs(sg[e] - sc[e]) <= 1e-5 * (1 + fabs(sc[e])), "scores [%d]: %g vs %g", e,
                      sg[e], sc[e]);
        lethe_cluster_attn_args a = {.q = NULL,
                                     .n_q = nq,
                                     .q_rows = qrows,
                                     .x_begin = xb,
                                     .x_slots = xs,
                                     .e_begin = eb,
                                     .e_ids = ei,
                                     .n_heads = H,
                                     .n_kv_heads = KH,
                                     .head_dim = D,
                                     .scale = 0.125f};
        a.out = po.c, a.q = pq.c, a.k_cache = pk.c, a.v_cache = pv.c, a.k_aux = pka.c,
        a.v_aux = pva.c;
        a.cent = pc.c, a.vsum = ps.c, a.count = pn.c;
        g_cpu->ops->cluster_attention(g_cpu, &a);
        a.out = po.g, a.q = pq.g, a.k_cache = pk.g, a.v_cache = pv.g, a.k_aux = pka.g,
        a.v_aux = pva.g;
        a.cent = pc.g, a.vsum = ps.g, a.count = pn.g;
        g_gpu->ops->cluster_attention(g_gpu, &a);
        float *oc = lethe_xmalloc((size_t)n_tok * H * D * sizeof(float)),
              *og = lethe_xmalloc((size_t)n_tok * H * D * sizeof(float));
        g_cpu->ops->act_to_host(g_cpu, oc, po.c, (size_t)n_tok * H * D);
        g_gpu->ops->act_to_host(g_gpu, og, po.g, (size_t)n_tok * H * D);
        double num = 0, den = 0;
        for (int i = 0; i < n_tok * H * D; i++) {
            CHECK(isfinite(og[i]));
            num += ((double)og[i] - oc[i]) * ((double)og[i] - oc[i]);
            den += (double)oc[i] * oc[i];
        }
        for (int t = 0; t < n_tok; t++) { /* rows not listed stay untouched */
            bool listed = false;
            for (int i = 0; i < nq; i++) listed |= qrows[i] == t;
            if (!listed)
                for (int i = 0; i < H * D; i++) CHECK(og[(size_t)t * H * D + i] == 7.0f);
        }
        const double rel = sqrt(num / den);
        fprintf(stderr, "    cluster_attention H=%d KH=%d D=%d n_q=%d keys<=%d rel err %.2e\n", H,
                KH, D, nq, mk, rel);
        CHECK(rel < 1e-2);
        pair ps_[] = {pk, pv, pka, pva, pq, pc, ps, pn, po};
        for (size_t i = 0; i < LETHE_ARRAY_LEN(ps_); i++) pair_free(&ps_[i]);
        free(kc), free(vc), free(ka), free(va), free(q), free(cent), free(vsum), free(cnt),
            free(qrows), free(xb), free(eb), free(xs), free(ei), free(fill), free(sc), free(sg),
            free(oc), free(og);
    }
}

/* ---- the method through the engine ---- */

/* A 100-token prompt and 24 decode tokens: the prompt index is 2 segments of
 * 47 keys (12 clusters each) per layer and KV head, and decode extends it by
 * two 8-token segments (at row lengths 108 and 116), so the device path runs
 * the prompt clustering, the extensions and the three zones. */
enum { NPROMPT = 100, NGEN = 24, VOCAB = 256 };
typedef struct run_out {
    int32_t tokens[NGEN];
    float logits[NGEN][VOCAB];
    int n;
} run_out;

static void on_event(void *user, const lethe_event *ev) {
    run_out *o = user;
    if (ev->n_tokens != 1 || o->n >= NGEN) return;
    CHECK(ev->logits && ev->n_vocab == VOCAB);
    o->tokens[o->n] = ev->token;
    memcpy(o->logits[o->n], ev->logits, sizeof(o->logits[0]));
    o->n++;
}

/* one request on `device`: greedy, or teacher-forced to `forced` [NGEN] */
static void run(const char *device, const char *method, const char *cfg, const int32_t *forced,
                run_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "tests/data/tiny-llama/config.json";
    p.load_format = "dummy";
    p.seed = 11;
    p.device = device;
    p.kv_cache_bytes = (size_t)16 << 20;
    p.max_model_len = 128;
    p.max_num_batched_tokens = 48;
    p.gpu_memory_utilization = 0.05f;
    p.enable_prefix_caching = false;
    p.sparse_method = method;
    p.sparse_config = cfg;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s: %s", method, lethe_engine_last_error());
    int32_t ids[NPROMPT];
    for (int i = 0; i < NPROMPT; i++) ids[i] = 3 + (int32_t)((i * 37 + 5) % 250);
    lethe_request_params rp = {.prompt = ids,
                               .n_prompt = NPROMPT,
                               .cb = on_event,
                               .user = o,
                               .want_logits = true,
                               .forced = forced,
                               .n_forced = forced ? NGEN : 0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = NGEN;
    rp.sampling.ignore_eos = true;
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    while (lethe_engine_has_work(e))
        CHECK_MSG(lethe_engine_step(e) == 0, "%s: %s", method, lethe_engine_last_error());
    CHECK_EQ_INT(o->n, NGEN);
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    CHECK_EQ_INT(st.kv_slots_used, 0);
    lethe_engine_destroy(e);
}

/* relative L2 error of a's logits against b's, over every step */
static double logits_rel(const run_out *a, const run_out *b) {
    double num = 0, den = 0;
    for (int t = 0; t < NGEN; t++)
        for (int j = 0; j < VOCAB; j++) {
            CHECK(isfinite(a->logits[t][j]));
            const double d = (double)a->logits[t][j] - b->logits[t][j];
            num += d * d;
            den += (double)b->logits[t][j] * b->logits[t][j];
        }
    return sqrt(num / den);
}

#define SMALL                                                                                \
    "retroinfer_sink=2,retroinfer_recent=4,retroinfer_cluster_size=4,retroinfer_segment=32," \
    "retroinfer_update=8,retroinfer_min_tokens=32"
#define LOSSY ",retroinfer_retrieve=0.2,retroinfer_estimate=0.3"

/* The engine on CUDA against the engine on the CPU backend (the twin):
 *  - retrieve = 1: bit-identical to dense on CUDA (greedy);
 *  - the other budgets are teacher-forced to CUDA dense's tokens: a budget
 *    this small flips the greedy argmax of a random-weight model (flat
 *    logits) within a few steps, and after one different token the two runs
 *    decode different contexts, so free-running logits are not comparable
 *    (the old 6-token greedy check read 0.92 "vs dense" on both backends
 *    for that reason; teacher-forced, the loss is ~0.45). Checks: CUDA vs
 *    CPU retroinfer within CPU_TWIN_TOL; CUDA's loss vs dense within
 *    TWIN_LOSS_TOL of the CPU's and below LOSSY_MAX; the host tier (the
 *    clustered KV offloaded from the pool; a ring of 4096 head vectors and
 *    one of 128, ~3 tokens' retrieval, that wraps) bit-identical to the device
 *    path on CUDA (the same bf16 keys in the same order, read from the
 *    ring); 90% of the clusters retrieved within 0.1 of dense.
 * CUDA differs from the CPU by bf16 activations (dense ~4e-3 here) and by
 * k-means assignments / cluster ranks flipping at near-ties: the CPU backend
 * with its matmul outputs rounded to bf16 reads 0.060 vs the plain CPU on
 * the lossy budget, 0.005 on the near-dense one. */
#define CPU_TWIN_TOL 0.15
#define TWIN_LOSS_TOL 0.1
#define LOSSY_MAX 0.7
static void test_engine(void) {
    static run_out dense, dense_cpu, o, oc, dev_path;
    run("cuda", "dense", NULL, NULL, &dense);
    run("cpu", "dense", NULL, dense.tokens, &dense_cpu);
    const double d0 = logits_rel(&dense, &dense_cpu);
    fprintf(stderr, "    dense: cuda vs cpu logits rel err %.2e\n", d0);
    CHECK(d0 < 3e-2);
    run("cuda", "retroinfer", SMALL ",retroinfer_retrieve=1", NULL, &o);
    CHECK(!memcmp(o.tokens, dense.tokens, sizeof(o.tokens)));
    CHECK(!memcmp(o.logits, dense.logits, sizeof(o.logits)));
    const char *cfgs[] = {SMALL LOSSY, SMALL LOSSY ",retroinfer_host_kv=true,retroinfer_cache_rows=4096",
                          SMALL LOSSY ",retroinfer_host_kv=true,retroinfer_cache_rows=128",
                          SMALL ",retroinfer_retrieve=0.9,retroinfer_estimate=0.1"};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cfgs); i++) {
        const char *name = cfgs[i] + strlen(SMALL) + 1;
        run("cuda", "retroinfer", cfgs[i], dense.tokens, &o);
        run("cpu", "retroinfer", cfgs[i], dense.tokens, &oc);
        const double twin = logits_rel(&o, &oc), e_gpu = logits_rel(&o, &dense),
                     e_cpu = logits_rel(&oc, &dense_cpu);
        fprintf(stderr,
                "    retroinfer %s: cuda vs cpu %.2e; vs dense: cuda %.3f, cpu %.3f\n", name,
                twin, e_gpu, e_cpu);
        CHECK_MSG(twin < CPU_TWIN_TOL, "%s: cuda vs cpu retroinfer %.3f", name, twin);
        CHECK_MSG(fabs(e_gpu - e_cpu) < TWIN_LOSS_TOL, "%s: loss vs dense cuda %.3f, cpu %.3f",
                  name, e_gpu, e_cpu);
        if (i == 0) dev_path = o;
        if (i == 1 || i == 2)
            CHECK_MSG(!memcmp(o.logits, dev_path.logits, sizeof(o.logits)),
                      "%s: host tier differs from the device path", name);
        if (i < 3) CHECK_MSG(e_gpu < LOSSY_MAX, "%s: loss vs dense %.3f", name, e_gpu);
        if (i == 3) CHECK_MSG(e_gpu < 0.1, "%s: near-dense budget %.3f vs dense", name, e_gpu);
    }
}

int main(void) {
    lethe_backend_params cp = {.device = "cpu", .n_threads = 0}, gp = {.device = "cuda"};
    CHECK(lethe_backend_create(&cp, &g_cpu) == LETHE_OK);
    CHECK_MSG(lethe_backend_create(&gp, &g_gpu) == LETHE_OK, "%s", lethe_last_error());
    TEST_RUN(test_assign);
    TEST_RUN(test_scores_attention);
    TEST_RUN(test_engine);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    printf("test_cuda_retro: ok\n");
    return 0;
}

/* test_deltakv.c - DeltaKV's properties (methods.md §13) through the sparse
 * contract on the real KV pool and the CPU backend, with seeded random
 * q / k / v and real RoPE (theta 10000), one request of NL layers:
 *
 *  - identity compressor (Down = Up = I) with compression running: the
 *    attention outputs equal dense's up to float rounding (rel err < 1e-5);
 *  - the buffer policy: after every step the compressed part (past the
 *    sinks) is a multiple of r and the buffer holds [r, 2r) tokens once the
 *    row is long enough; every stride-th token of a block is a raw center;
 *    every latent token's fathers are centers (or sinks) at earlier positions;
 *  - keep >= history: decode reads every token (whole rows); a small keep
 *    reads exactly sink + top-K + buffer in the DeltaKV layers;
 *  - the slot capacity: bytes per token of the layout + overhead below
 *    dense's at latent 32 of 128.
 *
 * `test_deltakv --dump FILE --compressor DIR [--keep K]` instead runs one
 * scripted request with the compressor in DIR and writes its inputs and
 * outputs (header, then per step and layer q, k, v, out) for the numpy
 * reference tests/ref/deltakv_ref.py (tests/ref/test_deltakv_ref.py). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "kv/kv_pool.h"
#include "sparse/sparse.h"
#include "test.h"

int32_t lethe_deltakv_slot_state(const lethe_sparse_method *m, int32_t layer, int32_t slot, int32_t *pos,
                                 int32_t *father_pos);

enum { NL = 3, H = 4, HK = 2, D = 16, KVD = HK * D, NSLOTS = 512, MAXT = 128 };
static const lethe_rope_config g_rope = {.theta = 10000.0f};

typedef struct hx {
    lethe_backend *be;
    lethe_kv_pool *pool;
    lethe_sparse_method *m;
    int32_t row, n_done;
    uint64_t rng;
    FILE *dump;
    /* the last step's per-layer selection length and outputs of every token by position */
    int32_t n_sel[NL];
    float out[256][NL][H * D];
} hx;

static float frand(uint64_t *s) { return (float)((lethe_splitmix64(s) >> 40) * 0x1p-24) * 2.0f - 1.0f; }

static void hx_open(hx *h, const char *method, const char *cfg) {
    memset(h, 0, sizeof(*h));
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    CHECK(lethe_backend_create(&bp, &h->be) == LETHE_OK);
    lethe_sparse_env env = {.be = h->be, .n_layers = NL, .n_heads = H, .n_kv_heads = HK, .head_dim = D,
                            .max_model_len = 4096, .rope = &g_rope};
    CHECK_MSG(lethe_sparse_create(method, cfg, &env, &h->m) == LETHE_OK, "%s", lethe_last_error());
    lethe_kv_layout layouts[NL];
    const bool own = lethe_sparse_kv_layouts(h->m, layouts);
    lethe_kv_pool_params pp = {.n_layers = NL, .n_kv_heads = HK, .head_dim = D, .n_slots = NSLOTS, .be = h->be,
                               .layouts = own ? layouts : NULL};
    CHECK_MSG(lethe_kv_pool_create(&pp, &h->pool) == LETHE_OK, "%s", lethe_last_error());
    h->m->env.pool = h->pool;
    h->row = lethe_kv_row_alloc(h->pool);
    h->rng = 1234;
}

static void hx_close(hx *h) {
    lethe_kv_row_release(h->pool, h->row);
    lethe_sparse_destroy(h->m);
    lethe_kv_pool_destroy(h->pool);
    lethe_backend_destroy(h->be);
}

/* one step of n new tokens (a prefill chunk when prefill), as the model and
 * the engine drive a layer (arch_llama.c, engine_forward.c) */
static void hx_step(hx *h, int32_t n, bool prefill, int32_t n_prompt) {
    lethe_sparse_method *m = h->m;
    lethe_backend *be = h->be;
    static int32_t pos[MAXT], sel[NSLOTS], store[MAXT];
    static float q[MAXT * H * D], k[MAXT * KVD], v[MAXT * KVD], out[MAXT * H * D];
    for (int32_t t = 0; t < n; t++) pos[t] = h->n_done + t;
    CHECK(lethe_kv_row_append(h->pool, h->row, n, pos));
    int32_t seq_begin[2] = {0, n}, sel_begin[2] = {0, 0};
    lethe_sparse_seq seq = {.request_id = 1, .row = h->row, .q_row = 0, .n_new = n, .first_pos = h->n_done,
                            .n_prompt = n_prompt, .is_prefill = prefill,
                            .is_final_chunk = prefill && h->n_done + n == n_prompt};
    lethe_fwd_batch b = {.n_tokens = n, .pos = pos, .n_seqs = 1, .seq_begin = seq_begin};
    lethe_sparse_step st = {.n_seqs = 1, .seqs = &seq, .batch = &b};
    if (m->ops->prepare) m->ops->prepare(m, &st);
    const lethe_kv_path *path = lethe_sparse_kv_path(m);
    if (h->dump) fwrite((int32_t[2]){n, h->n_done}, sizeof(int32_t), 2, h->dump);
    for (int32_t l = 0; l < NL; l++) {
        for (int32_t i = 0; i < n * H * D; i++) q[i] = frand(&h->rng);
        for (int32_t i = 0; i < n * KVD; i++) k[i] = frand(&h->rng) * (1.0f + (i / KVD) % 3);
        for (int32_t i = 0; i < n * KVD; i++) v[i] = frand(&h->rng);
        if (h->dump) { /* inputs before RoPE */
            fwrite(q, sizeof(float), (size_t)n * H * D, h->dump);
            fwrite(k, sizeof(float), (size_t)n * KVD, h->dump);
            fwrite(v, sizeof(float), (size_t)n * KVD, h->dump);
        }
        be->ops->rope(be, q, pos, n, H, D, &g_rope);
        const int32_t L = lethe_kv_row_len(h->pool, 0, h->row);
        const int32_t *rs = lethe_kv_row_slots(h->pool, 0, h->row);
        for (int32_t t = 0; t < n; t++) store[t] = rs[L - n + t];
        const bool want = m->ops->needs_scores && m->ops->needs_scores(m, l);
        const int32_t ns = lethe_sparse_build_selection(m, l, &st, 0, q, sel, L);
        CHECK(ns >= n && ns <= L);
        for (int32_t t = 0; t < n; t++) CHECK_EQ_INT(sel[ns - n + t], store[t]);
        h->n_sel[l] = ns;
        sel_begin[1] = ns;
        if (!path || !path->k_pre_rope) be->ops->rope(be, k, pos, n, HK, D, &g_rope);
        if (path) path->store(path->ctx, l, k, v, store, pos, n);
        else be->ops->kv_store(be, lethe_kv_k(h->pool, l), lethe_kv_v(h->pool, l), k, v, store, n, KVD);
        lethe_attn_args a = {.out = out, .q = q, .k_cache = lethe_kv_k(h->pool, l), .v_cache = lethe_kv_v(h->pool, l),
                             .n_tokens = n, .n_seqs = 1, .q_begin = seq_begin, .sel_begin = sel_begin,
                             .sel_slots = sel, .n_heads = H, .n_kv_heads = HK, .head_dim = D,
                             .scale = 1.0f / sqrtf((float)D)};
        if (path) path->attend(path->ctx, l, &a);
        else be->ops->attention(be, &a);
        if (m->ops->after_attn) m->ops->after_attn(m, l, &st, want ? &a : NULL);
        for (int32_t t = 0; t < n; t++) memcpy(h->out[h->n_done + t][l], out + (size_t)t * H * D, sizeof(float) * H * D);
        if (h->dump) fwrite(out, sizeof(float), (size_t)n * H * D, h->dump);
    }
    if (m->ops->finish_step) m->ops->finish_step(m, &st);
    h->n_done += n;
    CHECK(lethe_kv_check(h->pool, NULL, 0) == LETHE_OK);
}

/* prompt in chunks of `chunk`, then decode to n_total */
static void hx_run(hx *h, int32_t n_prompt, int32_t n_total, int32_t chunk, void (*after)(hx *, void *), void *u) {
    while (h->n_done < n_prompt) {
        hx_step(h, LETHE_MIN(chunk, n_prompt - h->n_done), true, n_prompt);
        if (after) after(h, u);
    }
    while (h->n_done < n_total) {
        hx_step(h, 1, false, n_prompt);
        if (after) after(h, u);
    }
}

static void test_identity_compressor_exact(void) {
    static hx dense, dk;
    hx_open(&dense, "dense", NULL);
    hx_run(&dense, 70, 90, 24, NULL, NULL);
    hx_open(&dk, "deltakv", "deltakv_compressor=@identity,sink_keep_tokens=4,recent_keep_tokens=8,"
                            "decode_keep_tokens=4096,deltakv_full_layers=0");
    hx_run(&dk, 70, 90, 24, NULL, NULL);
    int32_t n_latent = 0;
    const int32_t *rs = lethe_kv_row_slots(dk.pool, 0, dk.row);
    for (int32_t e = 0; e < dk.n_done; e++) n_latent += lethe_deltakv_slot_state(dk.m, 1, rs[e], NULL, NULL) == 2;
    const double err = rel_err(&dk.out[0][0][0], &dense.out[0][0][0], (size_t)dk.n_done * NL * H * D);
    fprintf(stderr, "    %d of %d tokens latent; rel err vs dense %.2e\n", n_latent, dk.n_done, err);
    CHECK(n_latent > 50); /* the path really ran */
    CHECK(err < 1e-5);
    hx_close(&dense);
    hx_close(&dk);
}

typedef struct policy {
    int32_t s, r, stride, K, checks;
} policy;

static void check_policy(hx *h, void *u) {
    policy *p = u;
    const int32_t L = lethe_kv_row_len(h->pool, 0, h->row);
    const int32_t *rs = lethe_kv_row_slots(h->pool, 0, h->row);
    int32_t state[256], pos, fp[16], b0 = L;
    for (int32_t e = 0; e < L; e++) {
        state[e] = lethe_deltakv_slot_state(h->m, 1, rs[e], &pos, NULL);
        CHECK_EQ_INT(pos, e);
        CHECK_EQ_INT(state[e], e < p->s ? 1 : state[e]); /* sinks stay raw */
    }
    while (b0 > p->s && state[b0 - 1] == 0) b0--;
    for (int32_t e = p->s; e < b0; e++) CHECK(state[e] != 0); /* the buffer is one trailing run */
    CHECK_EQ_INT((b0 - p->s) % p->r, 0);                     /* compressed in multiples of r */
    CHECK(L - b0 < 2 * p->r);                                 /* at most 2r - 1 left after a step */
    if (L - p->s >= p->r) CHECK(L - b0 >= p->r);              /* at least r once that many exist */
    for (int32_t e = p->s; e < b0; e++) {
        const int32_t in_block = (e - p->s) % p->r;
        CHECK_EQ_INT(state[e], in_block % p->stride == 0 ? 1 : 2); /* centers every stride from the block's start */
        if (state[e] != 2) continue;
        for (int32_t l = 1; l < NL; l++) {
            lethe_deltakv_slot_state(h->m, l, rs[e], NULL, fp);
            for (int32_t k = 0; k < p->K; k++) {
                CHECK(fp[k] < e);                 /* causal */
                CHECK_EQ_INT(state[fp[k]], 1);    /* a center or a sink */
            }
        }
    }
    p->checks++;
}

static void test_buffer_policy(void) {
    static hx h;
    policy p = {.s = 4, .r = 12, .stride = 4, .K = 3};
    hx_open(&h, "deltakv", "deltakv_compressor=@random,deltakv_latent=16,sink_keep_tokens=4,recent_keep_tokens=12,"
                           "deltakv_center_ratio=0.25,deltakv_neighbors=3,deltakv_full_layers=0");
    hx_run(&h, 77, 120, 20, check_policy, &p);
    CHECK(p.checks == 4 + 43);
    hx_close(&h);
}

static void test_selection(void) {
    static hx h;
    /* keep >= history: whole rows */
    hx_open(&h, "deltakv", "deltakv_compressor=@random,deltakv_latent=16,sink_keep_tokens=4,recent_keep_tokens=8,"
                           "decode_keep_tokens=4096,deltakv_full_layers=0");
    hx_run(&h, 60, 70, 32, NULL, NULL);
    for (int32_t l = 0; l < NL; l++) CHECK_EQ_INT(h.n_sel[l], 70);
    hx_close(&h);
    /* keep 10: DeltaKV layers read sink 4 + 10 + the buffer; the full layer everything */
    hx_open(&h, "deltakv", "deltakv_compressor=@random,deltakv_latent=16,sink_keep_tokens=4,recent_keep_tokens=8,"
                           "decode_keep_tokens=10,deltakv_full_layers=0");
    hx_run(&h, 60, 70, 32, NULL, NULL);
    const int32_t *rs = lethe_kv_row_slots(h.pool, 0, h.row);
    int32_t b0 = 70;
    while (lethe_deltakv_slot_state(h.m, 1, rs[b0 - 1], NULL, NULL) == 0) b0--;
    CHECK_EQ_INT(h.n_sel[0], 70);
    for (int32_t l = 1; l < NL; l++) CHECK_EQ_INT(h.n_sel[l], 4 + 10 + (70 - b0 + 1) - 1);
    hx_close(&h);
}

static void test_capacity(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    lethe_backend *be = NULL;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    /* 8 layers, 2 KV heads of 32: x has 128 dims; latent 32, 2 full layers */
    lethe_sparse_env env = {.be = be, .n_layers = 8, .n_heads = 4, .n_kv_heads = 2, .head_dim = 32,
                            .max_model_len = 4096};
    lethe_sparse_method *m = NULL;
    CHECK(lethe_sparse_create("deltakv", "deltakv_compressor=@random,deltakv_latent=32,deltakv_full_layers=0:4",
                              &env, &m) == LETHE_OK);
    lethe_kv_layout lay[8];
    CHECK(lethe_sparse_kv_layouts(m, lay));
    const size_t tok = lethe_kv_layouts_token_bytes(lay, 8) + lethe_sparse_slot_overhead(m);
    const size_t dense = lethe_kv_token_bytes(8, 2, 32, sizeof(float), LETHE_KV_NATIVE);
    /* full: 2 x 2 x 64 x 4; DeltaKV: 6 x (32 x 4 + 4 x 4) + the centers 6 x 128 x 4 / 10 */
    CHECK_EQ_INT((int64_t)tok, 2 * 2 * 64 * 4 + 6 * (32 * 4 + 16) + 6 * 128 * 4 / 10);
    CHECK(tok * 10 < dense * 6); /* 1.87x the slots */
    CHECK(lethe_sparse_kv_reserve(m, 4, 512) == (size_t)(4 * (64 + 2 * 512 + 1) + 512) * 6 * 128 * 4);
    lethe_sparse_destroy(m);
    /* refusals: no compressor, a bad one */
    CHECK(lethe_sparse_create("deltakv", NULL, &env, &m) != LETHE_OK);
    CHECK_STR_CONTAINS(lethe_last_error(), "lethe fit deltakv");
    CHECK(lethe_sparse_create("deltakv", "deltakv_compressor=/nonexistent/dir", &env, &m) != LETHE_OK);
    CHECK_STR_CONTAINS(lethe_last_error(), "deltakv.json");
    CHECK(lethe_sparse_create("deltakv", "deltakv_compressor=@bogus", &env, &m) != LETHE_OK);
    lethe_backend_destroy(be);
}

static int dump_run(const char *path, const char *dir, int keep) {
    static hx h;
    char cfg[1200];
    snprintf(cfg, sizeof(cfg), "deltakv_compressor=%s,sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=%d,"
             "deltakv_center_ratio=0.25,deltakv_neighbors=2,deltakv_full_layers=0", dir, keep);
    hx_open(&h, "deltakv", cfg);
    h.dump = fopen(path, "wb");
    CHECK(h.dump);
    const int32_t hdr[8] = {NL, H, HK, D, 4, 8, 4, 2}; /* shape, s, r, stride, K */
    fwrite(hdr, sizeof(int32_t), 8, h.dump);
    fwrite((int32_t[1]){keep}, sizeof(int32_t), 1, h.dump);
    hx_run(&h, 50, 64, 20, NULL, NULL);
    fclose(h.dump);
    hx_close(&h);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 5 && !strcmp(argv[1], "--dump") && !strcmp(argv[3], "--compressor"))
        return dump_run(argv[2], argv[4], argc >= 7 && !strcmp(argv[5], "--keep") ? atoi(argv[6]) : 4096);
    TEST_RUN(test_identity_compressor_exact);
    TEST_RUN(test_buffer_policy);
    TEST_RUN(test_selection);
    TEST_RUN(test_capacity);
    fprintf(stderr, "test_deltakv: OK\n");
    return 0;
}

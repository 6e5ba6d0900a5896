/* test_inflight_share.c - in-flight prefix sharing (scheduler.c,
 * wait_for_inflight): requests that arrive together with a common prefix
 * compute it once. The first is admitted and computes the prefix; the others
 * wait while it does (a running request is computing blocks they could
 * attach) and are admitted once those blocks are published. SmolLM2-135M.
 *
 *  1. Dense + radix: 6 prompts with a 160-token common prefix, submitted
 *     before any step. The prompt tokens computed are one prefix plus each
 *     prompt's private part (not 6 prefixes); every later request reports
 *     160 cached tokens; the logits of every request are bit-identical to the
 *     same prompt on a cold engine; the ownership checker (block slot
 *     references and request references) runs after every step.
 *  2. SnapKV chains branching from one 128-token shared prefix (chain_share
 *     prefix): 5 chains started together compute the prefix once and the
 *     table holds one shared prefix; each chain's logits equal its cold run.
 *  3. No waiting without a shareable block: prompts whose common prefix is
 *     shorter than one block, and chains that do not share, are admitted at
 *     once (no in-flight waits) and compute everything. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GEN 3
#include "engine_run.h"

#define N_REQ 6
#define N_CHAINS 5
#define SNAP "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24,snapkv_window_size=8"

static lethe_engine *mk(const char *method, const char *config, const char *mode) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = MODEL;
    p.n_threads = 1;
    p.max_model_len = 512;
    p.max_num_seqs = 8;
    p.max_num_batched_tokens = 512;
    p.kv_cache_bytes = (size_t)48 << 20;
    p.sparse_method = method;
    p.sparse_config = config;
    p.prefix_cache_mode = mode;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK_MSG(st == 0, "%s: %s", method, lethe_engine_last_error());
    return e;
}

/* submits without stepping; share < 0: a plain (radix) request */
static void submit(lethe_engine *e, const int32_t *toks, int32_t n, int32_t share, result *r) {
    reset(r);
    lethe_request_params rp = greedy(toks, n, r);
    if (share < 0) {
        CHECK_MSG(lethe_engine_add_request(e, &rp, NULL) == 0, "%s", lethe_engine_last_error());
        return;
    }
    lethe_chain_params cp = {.share_prefix_tokens = share};
    lethe_chain_result cr;
    CHECK_MSG(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == 0, "%s", cr.message);
    snprintf(r->chain, sizeof(r->chain), "%s", cr.chain_id);
}

static int64_t waits(lethe_engine *e) {
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    return s.prefix_inflight_waits;
}

/* N prompts [common | private]; returns them in p[i] (n tokens each) */
static void prompts(int32_t (*p)[200], int32_t n_req, int32_t n, int32_t common) {
    for (int32_t i = 0; i < n_req; i++) {
        fill(p[i], n, 100);                             /* the same stream: a common prefix */
        fill(p[i] + common, n - common, 200 + (uint64_t)i); /* then each its own */
    }
}

/* every request vs the same prompt on a cold engine */
static void check_cold(const char *method, const char *config, const char *mode, int32_t (*p)[200],
                       int32_t n_req, int32_t n, int32_t share, result *got) {
    const int32_t nv = got[0].nv;
    result c = {.logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), .nv = nv};
    for (int32_t i = 0; i < n_req; i++) {
        lethe_engine *cold = mk(method, config, mode);
        submit(cold, p[i], n, share, &c);
        run_all(cold);
        CHECK(c.finished && c.n == GEN && got[i].finished && got[i].n == GEN);
        CHECK(memcmp(c.tokens, got[i].tokens, sizeof(c.tokens)) == 0);
        CHECK_MSG(memcmp(c.logits, got[i].logits, (size_t)GEN * nv * sizeof(float)) == 0,
                  "%s request %d: logits differ from a cold run", method, i);
        lethe_engine_destroy(cold);
    }
    free(c.logits);
}

static void test_radix(void) {
    enum { N = 184, COMMON = 160 };
    static int32_t p[N_REQ][200];
    prompts(p, N_REQ, N, COMMON);
    lethe_engine *e = mk("dense", NULL, "radix");
    const int32_t nv = lethe_engine_vocab_size(e);
    result r[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        r[i] = (result){.logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), .nv = nv};
        submit(e, p[i], N, -1, &r[i]);
    }
    run_all(e);
    /* one prefix, then only the private parts (and nothing of the prefix twice) */
    CHECK_EQ_INT((int)computed(e), N + (N_REQ - 1) * (N - COMMON));
    CHECK(waits(e) >= N_REQ - 1);
    CHECK_EQ_INT(r[0].cached, 0);
    for (int i = 1; i < N_REQ; i++) CHECK_EQ_INT(r[i].cached, COMMON);
    check_cold("dense", NULL, "radix", p, N_REQ, N, -1, r);
    fprintf(stderr, "    radix: %d requests at once computed %lld prompt tokens (%d without sharing), "
            "%lld in-flight waits, logits == cold\n", N_REQ, (long long)computed(e), N_REQ * N,
            (long long)waits(e));
    for (int i = 0; i < N_REQ; i++) free(r[i].logits);
    lethe_engine_destroy(e);
}

static void test_chains(void) {
    enum { N = 176, SHARE = 128 };
    static int32_t p[N_CHAINS][200];
    prompts(p, N_CHAINS, N, SHARE);
    lethe_engine *e = mk("snapkv", SNAP, "chain");
    const int32_t nv = lethe_engine_vocab_size(e);
    result r[N_CHAINS];
    for (int i = 0; i < N_CHAINS; i++) {
        r[i] = (result){.logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), .nv = nv};
        submit(e, p[i], N, SHARE, &r[i]);
    }
    run_all(e);
    CHECK_EQ_INT((int)computed(e), N + (N_CHAINS - 1) * (N - SHARE));
    CHECK(waits(e) >= N_CHAINS - 1);
    for (int i = 1; i < N_CHAINS; i++) CHECK_EQ_INT(r[i].cached, SHARE);
    lethe_engine_chain_stats st;
    lethe_engine_get_chain_stats(e, &st);
    CHECK_EQ_INT(st.n_branched, N_CHAINS);
    CHECK_EQ_INT(st.n_shared_prefixes, 1);
    CHECK_EQ_INT(st.shared_blocks, SHARE / 16);
    /* every chain's every layer holds the whole prefix at its positions */
    for (int i = 0; i < N_CHAINS; i++)
        for (int32_t l = 0; l < lethe_kv_n_layers(e->pool); l++) {
            int32_t pos[512];
            int32_t np = lethe_engine_chain_positions(e, r[i].chain, l, pos, 512);
            CHECK(np >= SHARE);
            for (int32_t k = 0; k < SHARE; k++) CHECK_EQ_INT(pos[k], k);
        }
    check_cold("snapkv", SNAP, "chain", p, N_CHAINS, N, SHARE, r);
    fprintf(stderr, "    chains: %d branching chains at once computed %lld prompt tokens (%d "
            "without sharing), one shared prefix, logits == cold\n", N_CHAINS,
            (long long)computed(e), N_CHAINS * N);
    for (int i = 0; i < N_CHAINS; i++) free(r[i].logits);
    lethe_engine_destroy(e);
}

static void test_no_wait(void) {
    enum { N = 100 };
    static int32_t p[3][200];
    prompts(p, 3, N, 8); /* common prefix shorter than a block */
    lethe_engine *e = mk("dense", NULL, "radix");
    const int32_t nv = lethe_engine_vocab_size(e);
    result r[3];
    for (int i = 0; i < 3; i++) {
        r[i] = (result){.logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), .nv = nv};
        submit(e, p[i], N, -1, &r[i]);
    }
    CHECK(lethe_engine_step(e) == 0);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.n_running, 3); /* all admitted in the first step */
    run_all(e);
    CHECK_EQ_INT((int)waits(e), 0);
    CHECK_EQ_INT((int)computed(e), 3 * N);
    lethe_engine_destroy(e);
    /* chains that do not share a prefix never wait, even with a common one */
    prompts(p, 3, N, 64);
    e = mk("snapkv", SNAP, "chain");
    for (int i = 0; i < 3; i++) submit(e, p[i], N, 0, &r[i]);
    run_all(e);
    CHECK_EQ_INT((int)waits(e), 0);
    CHECK_EQ_INT((int)computed(e), 3 * N);
    for (int i = 0; i < 3; i++) free(r[i].logits);
    lethe_engine_destroy(e);
}

int main(void) {
    if (no_model("test_inflight_share")) return 0;
    test_no_wait();
    test_radix();
    test_chains();
    printf("test_inflight_share: ok\n");
    return 0;
}

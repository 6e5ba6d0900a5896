/* test_chain_engine.c - the Chain Cache inside the engine.
 *
 *  1. Dense in chain mode on the fake model (KV bugs change its output like
 *     a real model's; check_dense asserts every selection is exactly the
 *     positions 0..p): a 10-turn conversation continued through the chain
 *     (full-prompt turns and append turns) gives the same greedy output as
 *     the KV-free reference on the full history; each turn prefills exactly
 *     the suffix after the processed boundary (engine counter) and reports
 *     the reused tokens as cached; the ownership checker runs every step.
 *  2. Mode selection: auto -> chain for eviction, radix for dense; explicit
 *     radix with an eviction method and modes without prefix caching fail
 *     with a message; chain calls on a radix engine are refused (400).
 *  3. Abort invalidates (410 afterwards) and frees the KV; a recreated turn
 *     frees the old KV; capacity refusal (503) when ACTIVE turns hold it all;
 *     a turn whose model step fails (LETHE_FAULT_TOKEN) invalidates only its
 *     own chain.
 *  4. SnapKV on the real SmolLM2 model: the chain's resident KV after each
 *     turn (positions kept per layer) and its outputs are the same whether
 *     the turns run synchronously in one engine or through the threaded
 *     submit path the server uses; the suffix's last recent_keep tokens and
 *     the sink are always resident, and each layer holds at most the budget
 *     plus the tokens decoded after the compaction. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "server/chain_api.h" /* the HTTP mapping of chain codes */
#include "test.h"

#define MAXT 2048

typedef struct result {
    int32_t tokens[MAXT];
    int32_t n, cached, prompt_tokens;
    bool finished;
    lethe_finish_reason why;
} result;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

static void on_event(void *user, const lethe_event *ev) {
    result *r = user;
    pthread_mutex_lock(&g_mu);
    if (ev->n_tokens == 1) r->tokens[r->n++] = ev->token;
    r->cached = ev->cached_tokens;
    r->prompt_tokens = ev->prompt_tokens;
    if (ev->finished) {
        r->finished = true;
        r->why = ev->finish_reason;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static void run_all(lethe_engine *e) {
    for (int guard = 0; lethe_engine_has_work(e); guard++) {
        CHECK(guard < 100000);
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    }
}

static lethe_fake_params fake_params(void) {
    lethe_fake_params fp;
    lethe_fake_default_params(&fp);
    fp.n_layers = 3;
    fp.n_vocab = 50;
    fp.max_pos = 1024;
    fp.eos = 3;
    fp.check_dense = true;
    return fp;
}

static lethe_engine *mk_fake(const char *method, const char *mode, bool prefix, size_t kv_bytes, int *status) {
    lethe_fake_params fp = fake_params();
    lethe_runner runner;
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "fake";
    p.kv_cache_bytes = kv_bytes;
    p.max_num_batched_tokens = 64;
    p.max_num_seqs = 8;
    p.enable_prefix_caching = prefix;
    p.sparse_method = method;
    p.prefix_cache_mode = mode;
    p.check_invariants = true;
    p.max_model_len = 1024;
    lethe_engine *e = NULL;
    *status = lethe_engine_create_with(&p, &runner, NULL, &e);
    return e;
}

static void fill(int32_t *a, int32_t n, uint64_t *s) {
    for (int32_t i = 0; i < n; i++) a[i] = 4 + (int32_t)(lethe_splitmix64(s) % 46); /* never eos (3) */
}

/* one synchronous chain turn; returns the result */
static void turn(lethe_engine *e, const char *id, const int32_t *toks, int32_t n, bool append, int32_t max_tokens,
                 lethe_chain_result *cr, result *res) {
    memset(res, 0, sizeof(*res));
    lethe_request_params rp = {.prompt = toks, .n_prompt = n, .cb = on_event, .user = res};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = max_tokens;
    rp.sampling.ignore_eos = true;
    lethe_chain_params cp = {.chain_id = id, .append = append};
    int st = lethe_engine_add_request_chain(e, &rp, &cp, cr, NULL);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    run_all(e);
    CHECK(res->finished && res->why == LETHE_FINISH_LENGTH);
}

static void test_dense_ten_turns(void) {
    int st;
    lethe_engine *e = mk_fake("dense", "chain", true, 0, &st);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    CHECK(lethe_engine_chain_mode(e));
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
    lethe_fake_params fp = fake_params();
    uint64_t seed = 11;
    int32_t hist[1024], n_hist = 0;
    char id[48] = "";
    result res;
    lethe_chain_result cr;
    for (int t = 0; t < 10; t++) {
        int32_t n_app = 5 + (int32_t)(lethe_splitmix64(&seed) % 40), n_gen = 1 + t % 4;
        int32_t app[64];
        fill(app, n_app, &seed);
        bool append = t > 0 && t % 2 == 0; /* alternate full-prompt and append turns */
        memcpy(hist + n_hist, app, (size_t)n_app * sizeof(int32_t));
        int32_t n_prompt = n_hist + n_app;
        lethe_engine_stats s0, s1;
        lethe_engine_get_stats(e, &s0);
        if (append) turn(e, id, app, n_app, true, n_gen, &cr, &res);
        else turn(e, t ? id : NULL, hist, n_prompt, false, n_gen, &cr, &res);
        lethe_engine_get_stats(e, &s1);
        CHECK_EQ_INT(srv_chain_http_status(cr.code), 200);
        CHECK(!strcmp(cr.status, t ? "resumed" : "created"));
        if (t == 0) strcpy(id, cr.chain_id);
        CHECK(!strcmp(cr.chain_id, id));
        CHECK_EQ_INT(cr.n_prompt, n_prompt);
        int32_t reused = t ? n_hist - 1 : 0; /* the last sampled token had no KV */
        CHECK_EQ_INT(cr.reused_tokens, reused);
        CHECK_EQ_INT(res.cached, reused);
        CHECK_EQ_INT(res.prompt_tokens, n_prompt);
        /* prefill work = the suffix only */
        CHECK_EQ_INT(s1.prefill_tokens_computed - s0.prefill_tokens_computed, n_prompt - reused);
        /* greedy output identical to the full history without any cache */
        int32_t ref[16];
        CHECK_EQ_INT(lethe_fake_reference(&fp, hist, n_prompt, n_gen, true, ref), n_gen);
        CHECK_EQ_INT(res.n, n_gen);
        for (int32_t i = 0; i < n_gen; i++) CHECK_EQ_INT(res.tokens[i], ref[i]);
        memcpy(hist + n_prompt, res.tokens, (size_t)n_gen * sizeof(int32_t));
        n_hist = n_prompt + n_gen;
        int32_t h[1024];
        CHECK_EQ_INT(lethe_engine_chain_history(e, id, h, 1024), n_hist);
        CHECK(memcmp(h, hist, (size_t)n_hist * sizeof(int32_t)) == 0);
        CHECK_EQ_INT(lethe_engine_chain_positions(e, id, 0, NULL, 0), n_hist - 1);
    }
    lethe_engine_chain_stats cs;
    lethe_engine_get_chain_stats(e, &cs);
    CHECK_EQ_INT(cs.n_created, 1);
    CHECK_EQ_INT(cs.n_resumed, 9);
    CHECK_EQ_INT(cs.n_idle, 1);
    CHECK(cs.resident_slots == n_hist - 1);

    /* a full prompt that diverges inside the boundary: recreated, computed in full */
    int32_t other[40];
    fill(other, 40, &seed);
    lethe_engine_stats s0, s1;
    lethe_engine_get_stats(e, &s0);
    turn(e, id, other, 40, false, 2, &cr, &res);
    lethe_engine_get_stats(e, &s1);
    CHECK(!strcmp(cr.status, "recreated"));
    CHECK_EQ_INT(cr.reused_tokens, 0);
    CHECK_EQ_INT(s1.prefill_tokens_computed - s0.prefill_tokens_computed, 40);
    CHECK_EQ_INT(lethe_engine_chain_positions(e, id, 0, NULL, 0), 41);
    CHECK(eng_check(e) == LETHE_OK);

    /* abort mid-turn: the chain is invalidated (410) and its KV freed */
    result ra = {0};
    lethe_request_params rp = {.prompt = other, .n_prompt = 5, .cb = on_event, .user = &ra};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.max_tokens = 50;
    rp.sampling.ignore_eos = true;
    lethe_chain_params cp = {.chain_id = id, .append = true};
    uint64_t rid;
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, &rid) == 0);
    CHECK(lethe_engine_step(e) == 0);
    CHECK(lethe_engine_abort(e, rid) == 0);
    CHECK(ra.finished && ra.why == LETHE_FINISH_ABORT);
    run_all(e);
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, &rid) == LETHE_ERR_NOT_FOUND);
    CHECK_EQ_INT(srv_chain_http_status(cr.code), 410);
    CHECK(!strcmp(srv_chain_code_name(cr.code), "chain_gone"));
    cp.chain_id = "chain_nope";
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, &rid) == LETHE_ERR_NOT_FOUND);
    CHECK_EQ_INT(srv_chain_http_status(cr.code), 404);
    lethe_engine_stats s2;
    lethe_engine_get_stats(e, &s2);
    CHECK_EQ_INT(s2.kv_slots_used, 0);
    lethe_engine_destroy(e);
}

static void test_modes_and_capacity(void) {
    int st;
    lethe_engine *e = mk_fake("streamingllm", NULL, true, 0, &st);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
    lethe_engine_destroy(e);
    e = mk_fake("dense", "auto", true, 0, &st);
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "radix"));
    /* chain turns on a radix engine: 400 chain_mode_disabled */
    int32_t toks[4] = {5, 6, 7, 8};
    result r;
    lethe_request_params rp = {.prompt = toks, .n_prompt = 4, .cb = on_event, .user = &r};
    lethe_sampling_default_params(&rp.sampling);
    lethe_chain_params cp = {0};
    lethe_chain_result cr;
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == LETHE_ERR_INVALID);
    CHECK_EQ_INT(srv_chain_http_status(cr.code), 400);
    CHECK(!strcmp(srv_chain_code_name(cr.code), "chain_mode_disabled"));
    lethe_engine_destroy(e);
    e = mk_fake("dense", "auto", false, 0, &st);
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "off"));
    lethe_engine_destroy(e);
    CHECK(mk_fake("streamingllm", "radix", true, 0, &st) == NULL);
    CHECK_EQ_INT(st, LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "incompatible with method streamingllm");
    CHECK(mk_fake("dense", "chain", false, 0, &st) == NULL);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "--no-enable-prefix-caching");
    CHECK(mk_fake("dense", "bogus", true, 0, &st) == NULL);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "expected auto, radix or chain");

    /* capacity: 1024 slots (24 B per token on the fake model); one ACTIVE turn
     * reserving 600 + 400 leaves no room for a second one of 200 + 100 */
    e = mk_fake("dense", "chain", true, 1024 * 24, &st);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    int32_t big[600];
    uint64_t seed = 3;
    fill(big, 600, &seed);
    result r1 = {0}, r2 = {0};
    lethe_request_params p1 = {.prompt = big, .n_prompt = 600, .cb = on_event, .user = &r1};
    lethe_sampling_default_params(&p1.sampling);
    p1.sampling.max_tokens = 400;
    p1.sampling.ignore_eos = true;
    CHECK(lethe_engine_add_request_chain(e, &p1, &cp, &cr, NULL) == 0);
    lethe_request_params p2 = p1;
    p2.n_prompt = 200;
    p2.sampling.max_tokens = 100;
    p2.user = &r2;
    CHECK(lethe_engine_add_request_chain(e, &p2, &cp, &cr, NULL) == LETHE_ERR_CAPACITY);
    CHECK_EQ_INT(srv_chain_http_status(cr.code), 503);
    CHECK(!strcmp(srv_chain_code_name(cr.code), "chain_capacity_unavailable"));
    run_all(e);
    /* now IDLE (1000 slots resident): the same turn reclaims it (LRU) and runs */
    char first[48];
    lethe_engine_chain_stats cs;
    lethe_engine_get_chain_stats(e, &cs);
    CHECK_EQ_INT(cs.n_idle, 1);
    CHECK(lethe_engine_add_request_chain(e, &p1, &cp, &cr, NULL) == 0); /* a second 600-token chain */
    strcpy(first, cr.chain_id);
    lethe_engine_get_chain_stats(e, &cs);
    CHECK_EQ_INT(cs.n_reclaimed, 1);
    run_all(e);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 999);
    lethe_engine_destroy(e);
}

/* A turn whose model step fails (LETHE_FAULT_TOKEN): it ends with an
 * internal error, its chain is invalidated (410 afterwards: its resident KV
 * holds the failed step's garbage) and freed; another chain's next turn
 * matches the reference on its full history. */
static bool holds(const int32_t *t, int32_t n, int32_t tok) {
    for (int32_t i = 0; i < n; i++)
        if (t[i] == tok) return true;
    return false;
}

static void test_failed_turn(void) {
    lethe_fake_params fp = fake_params();
    int32_t a1[40], b1[40], b2[20], a2[20];
    for (int32_t i = 0; i < 40; i++) a1[i] = 4 + (i * 5) % 24, b1[i] = 4 + (i * 7 + 3) % 24;
    for (int32_t i = 0; i < 20; i++) b2[i] = 4 + (i * 11) % 24, a2[i] = 4 + (i * 13) % 24;
    /* B's history: b1, its 8 tokens, b2, its 8 tokens; A's: a1, its 8 tokens */
    int32_t hb[96], ha[48], ref_b2[8];
    memcpy(hb, b1, sizeof(b1));
    CHECK_EQ_INT(lethe_fake_reference(&fp, b1, 40, 8, true, hb + 40), 8);
    memcpy(hb + 48, b2, sizeof(b2));
    CHECK_EQ_INT(lethe_fake_reference(&fp, hb, 68, 8, true, ref_b2), 8);
    memcpy(ha, a1, sizeof(a1));
    CHECK_EQ_INT(lethe_fake_reference(&fp, a1, 40, 8, true, ha + 40), 8);
    int32_t fault = -1;
    for (int32_t t = 28; t < 50 && fault < 0; t++)
        if (!holds(hb, 68, t) && !holds(ref_b2, 8, t) && !holds(ha, 48, t)) fault = t;
    CHECK(fault > 0);
    a2[10] = fault;
    char v[16];
    snprintf(v, sizeof(v), "%d", fault);
    setenv("LETHE_FAULT_TOKEN", v, 1);
    int st;
    lethe_engine *e = mk_fake("dense", "chain", true, 0, &st);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    unsetenv("LETHE_FAULT_TOKEN");
    result ra, rb;
    lethe_chain_result cr;
    char ida[48], idb[48];
    turn(e, NULL, a1, 40, false, 8, &cr, &ra);
    strcpy(ida, cr.chain_id);
    turn(e, NULL, b1, 40, false, 8, &cr, &rb);
    strcpy(idb, cr.chain_id);
    /* A's append turn holds the fault token: its prefill step fails */
    result rf = {0};
    lethe_request_params rp = {.prompt = a2, .n_prompt = 20, .cb = on_event, .user = &rf};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = 8;
    rp.sampling.ignore_eos = true;
    lethe_chain_params cp = {.chain_id = ida, .append = true};
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == 0);
    run_all(e);
    CHECK(rf.finished && rf.why == LETHE_FINISH_ERROR && rf.n == 0);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.n_failed_steps, 1);
    CHECK_EQ_INT(s.kv_slots_used, 47); /* only B's resident KV (48 tokens, the last one has none) */
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == LETHE_ERR_NOT_FOUND);
    CHECK(!strcmp(srv_chain_code_name(cr.code), "chain_gone"));
    turn(e, idb, b2, 20, true, 8, &cr, &rb);
    CHECK(!strcmp(cr.status, "resumed"));
    CHECK_EQ_INT(rb.n, 8);
    for (int32_t i = 0; i < 8; i++) CHECK_EQ_INT(rb.tokens[i], ref_b2[i]);
    CHECK(eng_check(e) == LETHE_OK);
    lethe_engine_destroy(e);
}

/* ---- SnapKV on the real model ---- */

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define NTURN 4

typedef struct snap_run {
    int32_t pos[NTURN][30][400]; /* [turn][layer][entries] */
    int32_t n_pos[NTURN][30];
    int32_t out[NTURN][16];
} snap_run;

static lethe_engine *mk_real(void) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = MODEL;
    p.n_threads = 1; /* a shared 2-core machine: no OpenMP spinning against other jobs */
    p.max_model_len = 1024;
    p.max_num_seqs = 4;
    p.max_num_batched_tokens = 256;
    p.kv_cache_bytes = (size_t)64 << 20;
    p.sparse_method = "snapkv";
    p.sparse_config = "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24,snapkv_window_size=8";
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
    return e;
}

static void snap_turns(bool threaded, snap_run *out) {
    lethe_engine *e = mk_real();
    int32_t n_layers = lethe_kv_n_layers(e->pool);
    CHECK(n_layers <= 30);
    uint64_t seed = 5;
    char id[48] = "";
    int32_t total = 0;
    if (threaded) CHECK(lethe_engine_start(e) == 0);
    for (int t = 0; t < NTURN; t++) {
        int32_t app[80];
        int32_t n_app = t == 0 ? 80 : 30 + 10 * t;
        for (int32_t i = 0; i < n_app; i++) app[i] = 1000 + (int32_t)(lethe_splitmix64(&seed) % 20000);
        result res = {0};
        lethe_request_params rp = {.prompt = app, .n_prompt = n_app, .cb = on_event, .user = &res};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = 6;
        rp.sampling.ignore_eos = true;
        lethe_chain_params cp = {.chain_id = t ? id : NULL, .append = t > 0};
        lethe_chain_result cr;
        int st = threaded ? lethe_engine_submit_chain(e, &rp, &cp, &cr, NULL)
                          : lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
        if (threaded) {
            pthread_mutex_lock(&g_mu);
            while (!res.finished) pthread_cond_wait(&g_cv, &g_mu);
            pthread_mutex_unlock(&g_mu);
            lethe_engine_stop(e); /* positions are read on this thread */
        } else {
            run_all(e);
        }
        CHECK(!strcmp(cr.status, t ? "resumed" : "created"));
        if (!t) strcpy(id, cr.chain_id);
        total += n_app + 6;
        CHECK_EQ_INT(res.n, 6);
        memcpy(out->out[t], res.tokens, 6 * sizeof(int32_t));
        for (int32_t l = 0; l < n_layers; l++) {
            int32_t n = lethe_engine_chain_positions(e, id, l, out->pos[t][l], 400);
            CHECK(n > 0 && n <= 400);
            out->n_pos[t][l] = n;
            const int32_t *p = out->pos[t][l];
            /* budget 4 + 24 + 16 = 44, plus the 5 decoded tokens with KV after compaction */
            CHECK(n <= 44 + 5);
            for (int32_t i = 0; i < 4; i++) CHECK_EQ_INT(p[i], i); /* sink */
            /* the suffix's last 16 prompt tokens and the decoded ones are resident */
            int32_t last = total - 2; /* processed boundary - 1 */
            for (int32_t k = 0; k < 16 + 5; k++) CHECK_EQ_INT(p[n - 1 - k], last - k);
            for (int32_t i = 1; i < n; i++) CHECK(p[i] > p[i - 1]);
        }
        /* the idle chain holds the only KV: one slot space per layer, so the
         * per-layer gauge is the slots summed over layers / layers */
        lethe_engine_stats es;
        lethe_engine_get_stats(e, &es);
        int64_t held = 0;
        for (int32_t l = 0; l < n_layers; l++) held += out->n_pos[t][l];
        CHECK_EQ_INT(lethe_kv_n_spaces(e->pool), n_layers);
        CHECK_EQ_INT(es.kv_slots_resident, held);
        CHECK_EQ_INT(es.kv_tokens_resident, held / n_layers);
        if (threaded && t + 1 < NTURN) CHECK(lethe_engine_start(e) == 0);
    }
    lethe_engine_destroy(e);
}

static void test_snapkv_chain(void) {
    snap_run *a = lethe_xcalloc(1, sizeof(*a)), *b = lethe_xcalloc(1, sizeof(*b));
    snap_turns(false, a);
    snap_turns(true, b);
    CHECK(memcmp(a->n_pos, b->n_pos, sizeof(a->n_pos)) == 0);
    CHECK(memcmp(a->pos, b->pos, sizeof(a->pos)) == 0);
    CHECK(memcmp(a->out, b->out, sizeof(a->out)) == 0);
    /* compaction happened and differs between layers at least once */
    bool differs = false;
    for (int t = 0; t < NTURN; t++)
        for (int l = 1; l < 30 && a->n_pos[t][l]; l++)
            differs |= memcmp(a->pos[t][l], a->pos[t][0], (size_t)a->n_pos[t][0] * sizeof(int32_t)) != 0;
    CHECK(differs);
    free(a);
    free(b);
}

int main(void) {
    test_dense_ten_turns();
    test_modes_and_capacity();
    test_failed_turn();
    test_snapkv_chain();
    printf("test_chain_engine: ok\n");
    return 0;
}

/* test_engine_fake.c - the engine end to end on the fake model (no backend):
 * outputs against a KV-free reference, prefix cache on/off, tiny KV pool
 * with preemption, alone vs batched, split vs mixed steps, request
 * validation, abort / cancel freeing KV within one step, forced outputs and
 * logits, threaded submit/cancel from several threads, a failed model step
 * (LETHE_FAULT_TOKEN) ending only its own requests, and a randomized
 * workload of >= 10,000 steps with the ownership checker after every step. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#define MAXR 4096
#define MAXT 512

typedef struct result {
    int32_t tokens[MAXT];
    int32_t n;
    int n_events, n_final;
    bool finished;
    lethe_finish_reason why;
    int32_t cached, prompt_tokens, completion_tokens;
    float logit0[MAXT];      /* want_logits: logits[0] of each token event */
    int32_t logits_vocab, n_top;
    bool internal; /* ERROR: error_internal */
    char error[256];
} result;

static result g_res[MAXR];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static int g_n_final;

static void on_event(void *user, const lethe_event *ev) {
    result *r = user;
    pthread_mutex_lock(&g_mu);
    r->n_events++;
    if (ev->n_tokens == 1) {
        CHECK(r->n < MAXT);
        r->tokens[r->n++] = ev->token;
    }
    CHECK(!r->finished); /* nothing after the final event */
    if (ev->logits) {
        r->logit0[r->n - 1] = ev->logits[0];
        r->logits_vocab = ev->n_vocab;
    }
    if (ev->n_tokens == 1) r->n_top = ev->n_top;
    CHECK_EQ_INT(ev->completion_tokens, r->n);
    r->prompt_tokens = ev->prompt_tokens;
    r->completion_tokens = ev->completion_tokens;
    r->cached = ev->cached_tokens;
    if (ev->finished) {
        r->finished = true;
        r->why = ev->finish_reason;
        r->internal = ev->error_internal;
        snprintf(r->error, sizeof(r->error), "%s", ev->error ? ev->error : "");
        r->n_final++;
        g_n_final++;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static void reset_results(void) {
    memset(g_res, 0, sizeof(g_res));
    g_n_final = 0;
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

static lethe_engine *mk_engine(size_t kv_bytes, int32_t budget, int32_t max_seqs, bool prefix,
                               bool split, int32_t max_model_len) {
    lethe_fake_params fp = fake_params();
    lethe_runner runner;
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "fake";
    p.kv_cache_bytes = kv_bytes; /* fake: 3 layers x 2 x 1 x 1 x 4 B = 24 B per token */
    p.max_num_batched_tokens = budget;
    p.max_num_seqs = max_seqs;
    p.enable_prefix_caching = prefix;
    p.split_prefill_decode = split;
    p.max_model_len = max_model_len;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int st = lethe_engine_create_with(&p, &runner, NULL, &e);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    return e;
}

static void make_prompt(int32_t *toks, int32_t n, int32_t family, int32_t shared, uint64_t *rng) {
    for (int32_t i = 0; i < n; i++)
        toks[i] = i < shared ? 4 + (family * 7 + i * 3) % 46 : 4 + (int32_t)(lethe_splitmix64(rng) % 46);
}

static uint64_t add(lethe_engine *e, const int32_t *prompt, int32_t n, int32_t max_tokens, bool ignore_eos,
                    result *res) {
    lethe_request_params rp = {0};
    rp.prompt = prompt;
    rp.n_prompt = n;
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = max_tokens;
    rp.sampling.ignore_eos = ignore_eos;
    rp.cb = on_event;
    rp.user = res;
    uint64_t id = 0;
    int st = lethe_engine_add_request(e, &rp, &id);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    return id;
}

static void run_all(lethe_engine *e) {
    for (int guard = 0; lethe_engine_has_work(e); guard++) {
        CHECK(guard < 100000);
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    }
}

static void check_reference(const int32_t *prompt, int32_t n_prompt, int32_t max_tokens, bool ignore_eos,
                            int32_t max_model_len, const result *r) {
    lethe_fake_params fp = fake_params();
    int32_t want[MAXT];
    int32_t n_gen = LETHE_MIN(max_tokens, max_model_len - n_prompt);
    int32_t n = lethe_fake_reference(&fp, prompt, n_prompt, n_gen, ignore_eos, want);
    CHECK(r->finished && r->n_final == 1);
    CHECK_MSG(r->n == n, "generated %d tokens, reference %d", r->n, n);
    for (int32_t i = 0; i < n; i++) CHECK_MSG(r->tokens[i] == want[i], "token %d: %d vs reference %d", i, r->tokens[i], want[i]);
    bool eos_stop = n > 0 && !ignore_eos && want[n - 1] == fp.eos;
    CHECK_EQ_INT(r->why, eos_stop ? LETHE_FINISH_STOP : LETHE_FINISH_LENGTH);
}

static void test_single_matches_reference(void) {
    reset_results();
    lethe_engine *e = mk_engine(1 << 20, 64, 8, true, false, 1024);
    uint64_t rng = 1;
    int32_t prompt[300];
    make_prompt(prompt, 300, 0, 0, &rng);
    add(e, prompt, 300, 40, true, &g_res[0]);
    run_all(e);
    check_reference(prompt, 300, 40, true, 1024, &g_res[0]);
    CHECK_EQ_INT(g_res[0].n_events, 40);
    CHECK_EQ_INT(g_res[0].prompt_tokens, 300);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.n_requests_finished, 1);
    CHECK_EQ_INT(s.generation_tokens_total, 40);
    CHECK_EQ_INT(s.prefill_tokens_computed, 300);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    CHECK_EQ_INT(s.n_running + s.n_waiting, 0);
    /* chunks of 64: 5 prefill steps + 39 decode steps */
    CHECK_EQ_INT(s.n_steps, 5 + 39);
    lethe_engine_destroy(e);
}

/* the same 24 prompts under different engine configurations must give
 * identical greedy outputs, equal to the reference */
typedef struct workload {
    int32_t prompt[24][200];
    int32_t n[24], max_tokens[24];
} workload;

static void make_workload(workload *w) {
    uint64_t rng = 99;
    for (int i = 0; i < 24; i++) {
        w->n[i] = 5 + (int32_t)(lethe_splitmix64(&rng) % 190);
        w->max_tokens[i] = 1 + (int32_t)(lethe_splitmix64(&rng) % 40);
        make_prompt(w->prompt[i], w->n[i], i % 3, (int32_t)(lethe_splitmix64(&rng) % 150), &rng);
    }
}

static lethe_engine_stats run_workload(const workload *w, lethe_engine *e, int n_req, bool staggered) {
    reset_results();
    int next = 0;
    if (!staggered)
        for (; next < n_req; next++) add(e, w->prompt[next], w->n[next], w->max_tokens[next], false, &g_res[next]);
    while (lethe_engine_has_work(e) || next < n_req) {
        if (next < n_req) { add(e, w->prompt[next], w->n[next], w->max_tokens[next], false, &g_res[next]); next++; }
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    }
    for (int i = 0; i < n_req; i++) check_reference(w->prompt[i], w->n[i], w->max_tokens[i], false, 1024, &g_res[i]);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    return s;
}

static void test_configs_agree(void) {
    static workload w;
    make_workload(&w);
    /* big pool, prefix cache on, batched */
    lethe_engine *e = mk_engine(1 << 20, 128, 16, true, false, 1024);
    lethe_engine_stats s1 = run_workload(&w, e, 24, true);
    CHECK(s1.prefix_hit_tokens > 0);
    CHECK_EQ_INT(s1.n_preemptions, 0);
    lethe_engine_destroy(e);
    /* prefix cache off */
    e = mk_engine(1 << 20, 128, 16, false, false, 1024);
    lethe_engine_stats s2 = run_workload(&w, e, 24, true);
    CHECK_EQ_INT(s2.prefix_hit_tokens, 0);
    CHECK(s2.prefill_tokens_computed > s1.prefill_tokens_computed);
    lethe_engine_destroy(e);
    /* tiny pool (1024 slots): preemption must happen, outputs unchanged */
    e = mk_engine(1024 * 24, 256, 16, true, false, 1024);
    lethe_engine_stats s3 = run_workload(&w, e, 24, false);
    CHECK(s3.n_preemptions > 0);
    fprintf(stderr, "    tiny pool: %lld preemptions\n", (long long)s3.n_preemptions);
    lethe_engine_destroy(e);
    /* split prefill/decode steps */
    e = mk_engine(1 << 20, 64, 16, true, true, 1024);
    run_workload(&w, e, 24, true);
    lethe_engine_destroy(e);
    /* one at a time (max_num_seqs 1) */
    e = mk_engine(1 << 20, 2048, 1, false, false, 1024);
    run_workload(&w, e, 24, false);
    lethe_engine_destroy(e);
}

static void test_validation(void) {
    reset_results();
    lethe_engine *e = mk_engine(1 << 20, 64, 8, true, false, 100);
    CHECK_EQ_INT(lethe_engine_max_model_len(e), 100);
    int32_t prompt[120];
    for (int i = 0; i < 120; i++) prompt[i] = 5;
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.prompt = prompt;
    rp.n_prompt = 100; /* no room for a generated token */
    uint64_t id = 0;
    CHECK(lethe_engine_add_request(e, &rp, &id) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "max_model_len is 100");
    CHECK(lethe_engine_submit(e, &rp, &id) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "max_model_len");
    rp.n_prompt = 0;
    CHECK(lethe_engine_add_request(e, &rp, &id) != 0);
    rp.n_prompt = 3;
    prompt[1] = 50; /* outside the vocabulary */
    CHECK(lethe_engine_add_request(e, &rp, &id) != 0);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "vocabulary");
    prompt[1] = 5;
    rp.sampling.top_p = 0;
    CHECK(lethe_engine_add_request(e, &rp, &id) != 0);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "top_p");
    rp.sampling.top_p = 1;
    rp.sampling.stop[0] = "x"; /* no tokenizer */
    CHECK(lethe_engine_add_request(e, &rp, &id) != 0);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "tokenizer");
    rp.sampling.stop[0] = NULL;
    rp.sampling.max_tokens = 0;
    CHECK(lethe_engine_add_request(e, &rp, &id) != 0);
    CHECK(!lethe_engine_has_work(e));
    /* max_tokens -1 runs to max_model_len */
    rp.sampling.max_tokens = -1;
    rp.sampling.ignore_eos = true;
    rp.sampling.temperature = 0;
    rp.n_prompt = 90;
    rp.cb = on_event;
    rp.user = &g_res[0];
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    run_all(e);
    CHECK_EQ_INT(g_res[0].n, 10);
    CHECK_EQ_INT(g_res[0].why, LETHE_FINISH_LENGTH);
    /* the engine refuses a max_model_len beyond the model */
    lethe_fake_params fp = fake_params();
    lethe_runner runner;
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.max_model_len = 5000;
    lethe_engine *bad = NULL;
    CHECK(lethe_engine_create_with(&p, &runner, NULL, &bad) == LETHE_ERR_INVALID);
    CHECK(bad == NULL);
    /* and a KV budget smaller than max_model_len */
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    p.max_model_len = 1000;
    p.kv_cache_bytes = 100 * 24;
    CHECK(lethe_engine_create_with(&p, &runner, NULL, &bad) == LETHE_ERR_CAPACITY);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "--kv-cache-bytes");
    /* unknown sparse method */
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    p.kv_cache_bytes = 0;
    p.sparse_method = "nope";
    CHECK(lethe_engine_create_with(&p, &runner, NULL, &bad) == LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "dense");
    lethe_engine_destroy(e);
}

static lethe_engine *g_cancel_engine;
static void cancel_after_3(void *user, const lethe_event *ev) {
    on_event(user, ev);
    if (((result *)user)->n == 3 && !ev->finished) lethe_engine_cancel(g_cancel_engine, ev->request_id);
}

static void test_abort_and_cancel(void) {
    reset_results();
    lethe_engine *e = mk_engine(1 << 20, 32, 8, true, false, 1024);
    int32_t prompt[100];
    uint64_t rng = 5;
    make_prompt(prompt, 100, 1, 0, &rng);
    uint64_t a = add(e, prompt, 100, 50, true, &g_res[0]);
    add(e, prompt, 60, 50, true, &g_res[1]);
    CHECK(lethe_engine_step(e) == 0); /* a: 32 of 100 prompt tokens */
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK(s.kv_slots_used > 0);
    /* abort mid-prefill: final ABORT event, KV freed right away */
    CHECK(lethe_engine_abort(e, a) == 0);
    CHECK(g_res[0].finished && g_res[0].why == LETHE_FINISH_ABORT && g_res[0].n == 0);
    CHECK(lethe_engine_abort(e, a) == LETHE_ERR_NOT_FOUND);
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 0); /* the other request has not started */
    run_all(e);
    CHECK(g_res[1].finished && g_res[1].n == 50);
    /* cancel from inside a callback: applied at the start of the next step */
    g_cancel_engine = e;
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.ignore_eos = true;
    rp.sampling.max_tokens = 50;
    rp.prompt = prompt;
    rp.n_prompt = 20;
    rp.cb = cancel_after_3;
    rp.user = &g_res[2];
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    for (int i = 0; i < 3; i++) CHECK(lethe_engine_step(e) == 0);
    CHECK_EQ_INT(g_res[2].n, 3);
    CHECK(!g_res[2].finished);
    CHECK(lethe_engine_has_work(e));
    CHECK(lethe_engine_step(e) == 0); /* cancel applied, nothing else runs */
    CHECK(g_res[2].finished && g_res[2].why == LETHE_FINISH_ABORT && g_res[2].n == 3);
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    CHECK(!lethe_engine_has_work(e));
    lethe_engine_cancel(e, id); /* idempotent, unknown ids are ignored */
    CHECK(lethe_engine_step(e) == 0);
    lethe_engine_destroy(e);
}

static void test_forced_and_logits(void) {
    reset_results();
    lethe_engine *e = mk_engine(1 << 20, 64, 8, true, false, 1024);
    int32_t prompt[40], forced[6] = {3, 3, 9, 10, 3, 11}; /* EOS (3) inside: ignored when forced */
    uint64_t rng = 8;
    make_prompt(prompt, 40, 2, 0, &rng);
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.logprobs = 2;
    rp.prompt = prompt;
    rp.n_prompt = 40;
    rp.forced = forced;
    rp.n_forced = 6;
    rp.want_logits = true;
    rp.cb = on_event;
    rp.user = &g_res[0];
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    run_all(e);
    CHECK_EQ_INT(g_res[0].n, 6);
    for (int i = 0; i < 6; i++) CHECK_EQ_INT(g_res[0].tokens[i], forced[i]);
    CHECK_EQ_INT(g_res[0].why, LETHE_FINISH_LENGTH);
    CHECK_EQ_INT(g_res[0].logits_vocab, 50);
    CHECK_EQ_INT(g_res[0].n_top, 2);
    /* event i carries the model's logits after prompt + forced[0..i) */
    lethe_fake_params fp = fake_params();
    int32_t seq[46];
    float ref[50];
    memcpy(seq, prompt, sizeof(prompt));
    for (int i = 0; i < 6; i++) {
        lethe_fake_reference_logits(&fp, seq, 40 + i, ref);
        CHECK(g_res[0].logit0[i] == ref[0]);
        seq[40 + i] = forced[i];
    }
    lethe_engine_destroy(e);
}

/* An evicting method (streamingllm, per-layer rows) through the same engine:
 * the engine picks per-layer slot spaces from the method's flag, turns the
 * prefix cache off, the method compacts rows in finish_step and the checker
 * (after every step) sees consistent ownership. */
static void test_eviction_method(void) {
    reset_results();
    lethe_fake_params fp = fake_params();
    fp.check_dense = false;
    lethe_runner runner;
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "fake";
    p.sparse_method = "attention-sink"; /* alias of streamingllm */
    p.sparse_config = "sink_keep_tokens=4,recent_keep_tokens=16";
    p.max_model_len = 400;
    p.kv_cache_bytes = 400 * 24;
    p.max_num_batched_tokens = 64;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create_with(&p, &runner, NULL, &e) == 0, "%s", lethe_engine_last_error());
    CHECK(lethe_kv_per_layer(e->pool));
    CHECK(strcmp(lethe_engine_prefix_cache_mode(e), "radix") != 0);
    uint64_t rng = 3;
    static int32_t prompts[8][300];
    for (int i = 0; i < 8; i++) {
        int32_t n = 100 + 25 * i;
        make_prompt(prompts[i], n, i, 0, &rng);
        add(e, prompts[i], n, 50, true, &g_res[i]);
    }
    int32_t max_decode_row = 0;
    while (lethe_engine_has_work(e)) {
        CHECK(lethe_engine_step(e) == 0);
        for (int32_t i = 0; i < lethe_sched_n_running(e->sched); i++) {
            const lethe_req *r = lethe_sched_running_at(e->sched, i);
            if (r->n_computed < r->n_prefill) continue;
            for (int32_t l = 0; l < 3; l++) max_decode_row = LETHE_MAX(max_decode_row, lethe_kv_row_len(e->pool, l, r->row));
        }
    }
    for (int i = 0; i < 8; i++) {
        CHECK(g_res[i].finished && g_res[i].why == LETHE_FINISH_LENGTH);
        CHECK_EQ_INT(g_res[i].n, 50);
    }
    /* decoding rows stay within 2 (sink + recent) per layer */
    CHECK(max_decode_row > 0 && max_decode_row <= 40);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_total, 400 * 3);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    lethe_engine_destroy(e);
}

/* ---- a failed model step (LETHE_FAULT_TOKEN) ---- */

static bool holds(const int32_t *t, int32_t n, int32_t tok) {
    for (int32_t i = 0; i < n; i++)
        if (t[i] == tok) return true;
    return false;
}

static void check_failed(const result *r) {
    CHECK(r->finished && r->n_final == 1);
    CHECK_EQ_INT(r->why, LETHE_FINISH_ERROR);
    CHECK(r->internal);
    CHECK_STR_CONTAINS(r->error, "LETHE_FAULT_TOKEN");
}

/* A step whose forward fails ends exactly the requests of its batch with an
 * internal error (KV written to their new slots is garbage); every other
 * request goes on to the reference output, the ownership checker passes after
 * every step (mk_engine: check_invariants), no slot stays held, and the
 * prefix cache serves no garbage: requests that reuse the failed request's
 * published blocks, or the blocks of a request failed mid-decode, still match
 * the reference. */
static void test_failed_step(void) {
    uint64_t rng = 77;
    static int32_t norm[6][160], pois[3][160];
    /* prompts of tokens 4..27; the fault token: one of the others that no
     * normal request's output holds */
    for (int i = 0; i < 6; i++)
        for (int32_t j = 0; j < 160; j++)
            norm[i][j] = j < 96 ? 4 + (i % 2 * 7 + j * 3) % 24
                                : 4 + (int32_t)(lethe_splitmix64(&rng) % 24);
    for (int i = 0; i < 3; i++)
        for (int32_t j = 0; j < 160; j++)
            pois[i][j] = j < 64 ? 4 + (i * 5 + j * 7) % 24
                                : 4 + (int32_t)(lethe_splitmix64(&rng) % 24);
    lethe_fake_params fp = fake_params();
    int32_t fault = -1;
    for (int32_t t = 28; t < 50 && fault < 0; t++) {
        bool used = false;
        for (int i = 0; i < 6 && !used; i++) {
            int32_t want[MAXT];
            int32_t n = lethe_fake_reference(&fp, norm[i], 160, 30, true, want);
            used = holds(norm[i], 160, t) || holds(want, n, t);
        }
        if (!used) fault = t;
    }
    CHECK(fault > 0);
    for (int i = 0; i < 3; i++) pois[i][100] = fault; /* in the second 64-token chunk */
    char v[16];
    snprintf(v, sizeof(v), "%d", fault);
    setenv("LETHE_FAULT_TOKEN", v, 1);

    /* split steps: a prefill step fails alone, decoding requests go on */
    reset_results();
    lethe_engine *e = mk_engine(1 << 20, 64, 8, true, true, 1024);
    CHECK_EQ_INT(e->runner.fault_token, fault);
    add(e, norm[0], 160, 30, true, &g_res[0]);
    add(e, norm[1], 160, 30, true, &g_res[1]);
    for (int k = 0; k < 6; k++) CHECK(lethe_engine_step(e) == 0); /* both prefilled (5 chunks) */
    CHECK(g_res[0].n > 0 && g_res[1].n > 0);
    add(e, pois[0], 160, 30, true, &g_res[2]);
    run_all(e);
    check_failed(&g_res[2]);
    CHECK_EQ_INT(g_res[2].n, 0);
    check_reference(norm[0], 160, 30, true, 1024, &g_res[0]);
    check_reference(norm[1], 160, 30, true, 1024, &g_res[1]);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.n_failed_steps, 1);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    CHECK_EQ_INT(s.n_running + s.n_waiting, 0);
    /* the failed request's first chunk was committed and published: a prompt
     * sharing those 64 tokens (without the fault token) reuses them */
    int32_t reuse[160];
    memcpy(reuse, pois[0], sizeof(reuse));
    reuse[100] = 4;
    add(e, reuse, 160, 20, true, &g_res[3]);
    run_all(e);
    check_reference(reuse, 160, 20, true, 1024, &g_res[3]);
    CHECK(g_res[3].cached >= 64);
    lethe_engine_destroy(e);

    /* mixed steps: the poisoned prefill shares its step with decode tokens of
     * running requests, which fail with it; requests admitted afterwards,
     * including ones that reuse the failed requests' cached prefixes, match */
    reset_results();
    e = mk_engine(1 << 20, 64, 8, true, false, 1024);
    add(e, norm[2], 160, 30, true, &g_res[0]);
    add(e, norm[3], 160, 30, true, &g_res[1]);
    for (int k = 0; k < 6; k++) CHECK(lethe_engine_step(e) == 0);
    CHECK(g_res[0].n > 0 && g_res[1].n > 0 && !g_res[0].finished);
    add(e, pois[1], 160, 30, true, &g_res[2]);
    add(e, pois[2], 60, 30, true, &g_res[3]); /* no fault token in its 60 tokens */
    run_all(e);
    check_failed(&g_res[2]);
    check_failed(&g_res[0]); /* decoding in the failed step */
    check_failed(&g_res[1]);
    CHECK(g_res[0].n > 0 && g_res[0].n < 30);
    lethe_engine_get_stats(e, &s);
    CHECK(s.n_failed_steps >= 1);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    /* pois[2]'s 60 tokens: in the failed step or after it, either way it ended */
    CHECK(g_res[3].finished);
    if (g_res[3].why != LETHE_FINISH_ERROR) check_reference(pois[2], 60, 30, true, 1024, &g_res[3]);
    add(e, norm[2], 160, 30, true, &g_res[4]); /* cached blocks of a failed request */
    add(e, norm[4], 160, 30, true, &g_res[5]);
    run_all(e);
    check_reference(norm[2], 160, 30, true, 1024, &g_res[4]);
    check_reference(norm[4], 160, 30, true, 1024, &g_res[5]);
    CHECK(g_res[4].cached >= 144);
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    lethe_engine_destroy(e);

    /* an eviction method (per-layer rows, method state, no radix cache) */
    reset_results();
    fp.check_dense = false;
    lethe_runner runner;
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "fake";
    p.sparse_method = "streamingllm";
    p.sparse_config = "sink_keep_tokens=4,recent_keep_tokens=16";
    p.max_model_len = 400;
    p.kv_cache_bytes = 800 * 24;
    p.max_num_batched_tokens = 64;
    p.split_prefill_decode = true;
    p.check_invariants = true;
    CHECK_MSG(lethe_engine_create_with(&p, &runner, NULL, &e) == 0, "%s",
              lethe_engine_last_error());
    /* the method changes the outputs (no dense reference): force them, all below the fault token */
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.prompt = norm[5];
    rp.n_prompt = 160;
    rp.forced = norm[4];
    rp.n_forced = 30;
    rp.cb = on_event;
    rp.user = &g_res[0];
    CHECK(lethe_engine_add_request(e, &rp, NULL) == 0);
    for (int k = 0; k < 4; k++) CHECK(lethe_engine_step(e) == 0);
    add(e, pois[0], 160, 30, true, &g_res[1]);
    run_all(e);
    check_failed(&g_res[1]);
    CHECK(g_res[0].finished && g_res[0].why == LETHE_FINISH_LENGTH && g_res[0].n == 30);
    CHECK(!memcmp(g_res[0].tokens, norm[4], 30 * sizeof(int32_t)));
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.n_failed_steps, 1);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    lethe_engine_destroy(e);
    unsetenv("LETHE_FAULT_TOKEN");
}

/* ---- threaded mode ---- */

typedef struct submitter {
    lethe_engine *e;
    int first, count;
    const workload *w;
} submitter;

static void *submit_thread(void *arg) {
    submitter *s = arg;
    for (int i = s->first; i < s->first + s->count; i++) {
        int k = i % 24;
        lethe_request_params rp = {0};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = s->w->max_tokens[k];
        rp.prompt = s->w->prompt[k];
        rp.n_prompt = s->w->n[k];
        rp.cb = on_event;
        rp.user = &g_res[i];
        uint64_t id;
        int st;
        while ((st = lethe_engine_submit(s->e, &rp, &id)) == LETHE_ERR_BUSY) usleep(100);
        CHECK(st == 0);
        if (i % 5 == 0) lethe_engine_cancel(s->e, id); /* may land before or after it finishes */
    }
    return NULL;
}

static void test_threaded(void) {
    static workload w;
    make_workload(&w);
    reset_results();
    lethe_engine *e = mk_engine(4096 * 24, 128, 16, true, false, 1024);
    CHECK(lethe_engine_start(e) == 0);
    CHECK(lethe_engine_start(e) == LETHE_ERR_BUSY);
    CHECK(lethe_engine_step(e) == LETHE_ERR_BUSY);
    enum { T = 4, PER = 30 };
    pthread_t th[T];
    submitter sub[T];
    for (int t = 0; t < T; t++) {
        sub[t] = (submitter){.e = e, .first = t * PER, .count = PER, .w = &w};
        CHECK(pthread_create(&th[t], NULL, submit_thread, &sub[t]) == 0);
    }
    for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
    pthread_mutex_lock(&g_mu);
    while (g_n_final < T * PER) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
    lethe_engine_stop(e);
    int aborted = 0;
    for (int i = 0; i < T * PER; i++) {
        CHECK_EQ_INT(g_res[i].n_final, 1);
        int k = i % 24;
        if (g_res[i].why == LETHE_FINISH_ABORT) {
            CHECK(i % 5 == 0);
            aborted++;
            continue;
        }
        check_reference(w.prompt[k], w.n[k], w.max_tokens[k], false, 1024, &g_res[i]);
    }
    CHECK(aborted > 0);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.n_requests_finished, T * PER);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    CHECK_EQ_INT(s.n_running + s.n_waiting, 0);
    /* restart, then destroy with work in flight: everything ends with ABORT */
    reset_results();
    CHECK(lethe_engine_start(e) == 0);
    submitter one = {.e = e, .first = 1, .count = 4, .w = &w};
    submit_thread(&one);
    lethe_engine_destroy(e);
    for (int i = 1; i < 5; i++) CHECK_EQ_INT(g_res[i].n_final, 1);
}

/* ---- randomized workload ---- */

typedef struct live {
    uint64_t id;
    int32_t prompt[260];
    int32_t n, max_tokens;
    bool ignore_eos;
    int slot;
} live;

static void test_random_workload(void) {
    reset_results();
    /* 640 slots, budget 48 tokens, 12 sequences: chunking, preemption and
     * cache eviction all happen constantly */
    lethe_engine *e = mk_engine(640 * 24, 48, 12, true, false, 300);
    static live L[MAXR];
    int n_sub = 0, n_checked = 0, n_aborted = 0;
    uint64_t rng = 2024;
    int64_t steps = 0;
    while (steps < 10000) {
        /* arrivals */
        uint64_t u = lethe_splitmix64(&rng) % 100;
        int arrivals = u < 25 ? 1 : u < 28 ? 2 : 0;
        for (int a = 0; a < arrivals && n_sub < MAXR; a++) {
            live *l = &L[n_sub];
            l->n = 1 + (int32_t)(lethe_splitmix64(&rng) % 250);
            l->max_tokens = 1 + (int32_t)(lethe_splitmix64(&rng) % 40);
            l->ignore_eos = lethe_splitmix64(&rng) % 2;
            int32_t family = (int32_t)(lethe_splitmix64(&rng) % 4);
            int32_t shared = (int32_t)(lethe_splitmix64(&rng) % 200);
            make_prompt(l->prompt, l->n, family, shared, &rng);
            l->slot = n_sub;
            l->id = add(e, l->prompt, l->n, l->max_tokens, l->ignore_eos, &g_res[n_sub]);
            n_sub++;
        }
        /* aborts: a random earlier request, wherever it is */
        if (n_sub > 0 && lethe_splitmix64(&rng) % 100 < 4) {
            int k = (int)(lethe_splitmix64(&rng) % (uint64_t)n_sub);
            if (!g_res[k].finished) {
                if (lethe_splitmix64(&rng) % 2) CHECK(lethe_engine_abort(e, L[k].id) == 0);
                else lethe_engine_cancel(e, L[k].id);
            }
        }
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "step %lld: %s", (long long)steps, lethe_engine_last_error());
        steps++;
    }
    run_all(e);
    for (int i = 0; i < n_sub; i++) {
        CHECK_EQ_INT(g_res[i].n_final, 1);
        if (g_res[i].why == LETHE_FINISH_ABORT) { n_aborted++; continue; }
        check_reference(L[i].prompt, L[i].n, L[i].max_tokens, L[i].ignore_eos, 300, &g_res[i]);
        n_checked++;
    }
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    fprintf(stderr, "    %lld steps, %d requests (%d checked against the reference, %d aborted), "
                    "%lld preemptions, prefix hits %lld / %lld tokens\n",
            (long long)steps, n_sub, n_checked, n_aborted, (long long)s.n_preemptions,
            (long long)s.prefix_hit_tokens, (long long)s.prefix_queries_tokens);
    CHECK(s.n_preemptions > 0);
    CHECK(s.prefix_hit_tokens > 0);
    CHECK(n_aborted > 0);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    lethe_engine_destroy(e);
}

int main(void) {
    TEST_RUN(test_single_matches_reference);
    TEST_RUN(test_configs_agree);
    TEST_RUN(test_validation);
    TEST_RUN(test_abort_and_cancel);
    TEST_RUN(test_forced_and_logits);
    TEST_RUN(test_eviction_method);
    TEST_RUN(test_failed_step);
    TEST_RUN(test_threaded);
    TEST_RUN(test_random_workload);
    return 0;
}

/* engine_run.h - what the engine tests on SmolLM2-135M share
 * (test_chain_branch, test_chain_host, test_host_tier, test_inflight_share):
 * a greedy request's result (tokens, cached tokens, every generated token's
 * logits), its event callback, random token prompts, running an engine until
 * it is idle, a plain request and a chain turn run to the end.
 *
 * Define GEN (tokens generated per request) before including this file.
 * Every function is static inline, so a test that uses a part only does not
 * warn about the rest. */
#ifndef LETHE_TESTS_ENGINE_RUN_H
#define LETHE_TESTS_ENGINE_RUN_H

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#ifndef GEN
#error "define GEN (tokens generated per request) before including engine_run.h"
#endif

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

typedef struct result {
    int32_t tokens[GEN];
    int32_t n, cached;
    float *logits; /* [GEN][nv] */
    int32_t nv;    /* the vocabulary size */
    bool finished;
    char chain[48]; /* the id of the chain a request started, where a test records it */
} result;

static inline void on_event(void *user, const lethe_event *ev) {
    result *r = user;
    if (ev->n_tokens == 1 && r->n < GEN) {
        if (ev->logits)
            memcpy(r->logits + (size_t)r->n * r->nv, ev->logits, (size_t)r->nv * sizeof(float));
        r->tokens[r->n++] = ev->token;
    }
    r->cached = ev->cached_tokens;
    if (ev->finished) r->finished = true;
}

/* a result with room for GEN rows of e's logits */
static inline result mk_result(lethe_engine *e) {
    result r = {.nv = lethe_engine_vocab_size(e)};
    r.logits = lethe_xcalloc((size_t)GEN * r.nv, sizeof(float));
    return r;
}

/* clears r for the next request, keeping its logits buffer */
static inline void reset(result *r) {
    float *lg = r->logits;
    int32_t nv = r->nv;
    memset(r, 0, sizeof(*r));
    r->logits = lg;
    r->nv = nv;
}

/* a greedy request of GEN tokens (EOS ignored) that records into r */
static inline lethe_request_params greedy(const int32_t *toks, int32_t n, result *r) {
    lethe_request_params rp = {
        .prompt = toks, .n_prompt = n, .cb = on_event, .user = r, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = GEN;
    rp.sampling.ignore_eos = true;
    return rp;
}

/* steps until nothing is left, then the engine's invariant check */
static inline void run_all(lethe_engine *e) {
    for (int guard = 0; lethe_engine_has_work(e); guard++) {
        CHECK(guard < 100000);
        CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
    }
    CHECK(eng_check(e) == LETHE_OK);
}

/* one plain request run to its end */
static inline void run_one(lethe_engine *e, const int32_t *toks, int32_t n, result *r) {
    reset(r);
    lethe_request_params rp = greedy(toks, n, r);
    CHECK_MSG(lethe_engine_add_request(e, &rp, NULL) == 0, "%s", lethe_engine_last_error());
    run_all(e);
    CHECK(r->finished && r->n == GEN);
}

/* one chain turn run to its end; returns the chain code (OK: finished). id:
 * the chain; NULL or "" starts a new one, and "" comes back holding its id */
static inline lethe_chain_code turn(lethe_engine *e, char *id, const int32_t *toks, int32_t n,
                                    bool append, int32_t share, result *res,
                                    lethe_chain_result *cr) {
    reset(res);
    lethe_request_params rp = greedy(toks, n, res);
    lethe_chain_params cp = {
        .chain_id = id && id[0] ? id : NULL, .append = append, .share_prefix_tokens = share};
    if (lethe_engine_add_request_chain(e, &rp, &cp, cr, NULL) != 0) return cr->code;
    if (id && !id[0]) snprintf(id, 48, "%s", cr->chain_id);
    run_all(e);
    CHECK(res->finished && res->n == GEN);
    return LETHE_CHAIN_OK;
}

/* a and b generated the same tokens with bit-identical logits */
static inline void same(const result *a, const result *b, const char *what) {
    CHECK_MSG(memcmp(a->tokens, b->tokens, sizeof(a->tokens)) == 0, "%s: tokens differ", what);
    CHECK_MSG(memcmp(a->logits, b->logits, (size_t)GEN * a->nv * sizeof(float)) == 0,
              "%s: logits differ", what);
}

/* n random token ids in [1000, 21000) */
static inline void fill(int32_t *a, int32_t n, uint64_t seed) {
    for (int32_t i = 0; i < n; i++) a[i] = 1000 + (int32_t)(lethe_splitmix64(&seed) % 20000);
}

/* prompt tokens the engine computed so far */
static inline int64_t computed(lethe_engine *e) {
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    return s.prefill_tokens_computed;
}

/* true (and a line on stdout) when the model is absent: the test has nothing to run */
static inline bool no_model(const char *test) {
    FILE *f = fopen(MODEL, "rb");
    if (f) {
        fclose(f);
        return false;
    }
    printf("%s: skipped (no %s)\n", test, MODEL);
    return true;
}

#endif /* LETHE_TESTS_ENGINE_RUN_H */

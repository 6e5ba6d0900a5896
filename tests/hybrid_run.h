/* hybrid_run.h - what the engine tests on the tiny hybrid model share
 * (tests/data/tiny-qwen3_5: test_engine_hybrid, test_hybrid_prefix,
 * test_hybrid_chain, gpu/test_cuda_hybrid_prefix): the engine parameters
 * they start from, a greedy request's result
 * (tokens, the first HR_KEEP logits of every generated token, cached
 * tokens, how it finished), its event callback, submitting one, stepping an
 * engine until it is idle, and comparing two results bit for bit.
 *
 * Define before including:
 *   HR_MAXT  the most tokens a request generates;
 *   HR_NV    the vocabulary every event must carry logits of (0: no check,
 *            events may come without logits);
 *   HR_KEEP  logits kept per token (default HR_NV).
 * Every function is static inline, so a test that uses a part only does not
 * warn about the rest. */
#ifndef LETHE_TESTS_HYBRID_RUN_H
#define LETHE_TESTS_HYBRID_RUN_H

#include <stdbool.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "test.h"

#if !defined(HR_MAXT) || !defined(HR_NV)
#error "define HR_MAXT and HR_NV before including hybrid_run.h"
#endif
#ifndef HR_KEEP
#define HR_KEEP HR_NV
#endif

#define TINY "tests/data/tiny-qwen3_5"

typedef struct out {
    int32_t tokens[HR_MAXT];
    float logits[HR_MAXT][HR_KEEP];
    int32_t n, cached;
    bool done;
    lethe_finish_reason why;
} out;

static inline void on_event(void *user, const lethe_event *ev) {
    out *o = user;
    if (ev->n_tokens) {
        CHECK(o->n < HR_MAXT && (HR_NV == 0 || (ev->logits && ev->n_vocab == HR_NV)));
        if (ev->logits) memcpy(o->logits[o->n], ev->logits, sizeof(o->logits[0]));
        o->tokens[o->n++] = ev->token;
    }
    o->cached = ev->cached_tokens;
    if (ev->finished) {
        o->done = true;
        o->why = ev->finish_reason;
    }
}

/* a greedy request of max_tokens (EOS ignored, logits on) that records into *o (cleared) */
static inline lethe_request_params hr_greedy(const int32_t *prompt, int32_t n, int32_t max_tokens, out *o) {
    memset(o, 0, sizeof(*o));
    lethe_request_params rp = {.prompt = prompt, .n_prompt = n, .cb = on_event, .user = o, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = max_tokens;
    rp.sampling.ignore_eos = true;
    return rp;
}

/* adds that request to e; returns its id */
static inline uint64_t submit(lethe_engine *e, const int32_t *prompt, int32_t n, int32_t max_tokens, out *o) {
    lethe_request_params rp = hr_greedy(prompt, n, max_tokens, o);
    uint64_t id;
    CHECK_MSG(lethe_engine_add_request(e, &rp, &id) == 0, "%s", lethe_engine_last_error());
    return id;
}

/* steps until nothing is left */
static inline void drain(lethe_engine *e) {
    while (lethe_engine_has_work(e)) CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
}

/* the parameters every engine of these tests starts from: the tiny model, a
 * 64 MiB KV pool, 4 sequences of up to 512 tokens, the invariant checker on,
 * 2 threads; a test changes what it varies */
static inline lethe_engine_params hr_params(void) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY;
    p.kv_cache_bytes = 64u << 20;
    p.max_num_seqs = 4;
    p.max_model_len = 512;
    p.check_invariants = true;
    p.n_threads = 2;
    return p;
}

/* the same token count, tokens and kept logits (bit for bit); `what` and
 * `i` (a request index, < 0: none) name the comparison in a failure */
static inline void hr_same(const out *a, const out *b, int i, const char *what) {
    CHECK_MSG(a->n == b->n, "%s request %d: %d vs %d tokens", what, i, a->n, b->n);
    for (int32_t t = 0; t < a->n; t++) {
        CHECK_MSG(a->tokens[t] == b->tokens[t], "%s request %d token %d: %d vs %d", what, i, t, a->tokens[t],
                  b->tokens[t]);
        CHECK_MSG(!memcmp(a->logits[t], b->logits[t], sizeof(a->logits[t])), "%s request %d token %d: logits differ",
                  what, i, t);
    }
}

#endif /* LETHE_TESTS_HYBRID_RUN_H */

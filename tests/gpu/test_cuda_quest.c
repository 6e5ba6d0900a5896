/* test_cuda_quest.c - Quest on the CUDA backend through the engine API.
 *
 *  1. Identity: with a budget >= the context and quest_always_score (the page
 *     ops run in every layer and select every page), greedy tokens equal
 *     dense on CUDA, for the tiny Llama shape (tests/data/tiny-llama, dummy
 *     weights, head_dim 16) and the Llama-3.1-8B shape
 *     (configs/llama-3.1-8b-instruct, dummy weights); two requests batched,
 *     chunked prefill, the KV ownership checker after every step. The
 *     selections are the same slot lists as dense, so the logits should be
 *     identical too: the largest difference is printed (and bounded).
 *     The same with quest_granularity=head (per-KV-head lists, the varlen
 *     attention kernel instead of dense's): logits within 2e-2 of their scale
 *     up to the first greedy token that differs (another attention kernel may
 *     flip a near-tie of the dummy weights), agreement printed.
 *  2. A real budget (8B shape): quest with B = 256 runs with the page ops
 *     selecting 16 of ~45 pages, every request finishes with its tokens.
 *  3. Timing (printed, not checked): 8B shape, a 16K-token prompt, 24 greedy
 *     decode steps, dense vs quest at B = 2048: decode ms / token of each.
 * Needs a CUDA device (make test-gpu). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "lethe.h"
#include "test.h"

#define TINY "tests/data/tiny-llama/config.json"
#define L8B "configs/llama-3.1-8b-instruct/config.json"
enum { MAXGEN = 32 };

typedef struct run_out {
    int32_t tokens[2][MAXGEN];
    int32_t n[2];
    float *logits[2]; /* [MAXGEN][n_vocab] */
    int32_t n_vocab;
    double t_tok[2][MAXGEN]; /* wall time of each token event */
} run_out;

typedef struct cb_ctx {
    run_out *o;
    int which;
} cb_ctx;

static void on_event(void *user, const lethe_event *ev) {
    cb_ctx *c = user;
    run_out *o = c->o;
    if (ev->n_tokens == 1 && o->n[c->which] < MAXGEN) {
        int i = o->n[c->which]++;
        o->tokens[c->which][i] = ev->token;
        o->t_tok[c->which][i] = lethe_time_s();
        if (ev->logits) {
            o->n_vocab = ev->n_vocab;
            if (!o->logits[c->which]) o->logits[c->which] = calloc((size_t)MAXGEN * ev->n_vocab, sizeof(float));
            memcpy(o->logits[c->which] + (size_t)i * ev->n_vocab, ev->logits,
                   sizeof(float) * (size_t)ev->n_vocab);
        }
    }
}

typedef struct run_spec {
    const char *model;
    const char *method, *cfg;
    int32_t n_prompt[2];
    int32_t n_gen;
    int32_t max_model_len;
    bool logits, check;
} run_spec;

static void run(const run_spec *sp, run_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = sp->model;
    p.load_format = "dummy";
    p.seed = 7;
    p.device = "cuda";
    p.max_model_len = sp->max_model_len;
    p.max_num_seqs = 4;
    p.max_num_batched_tokens = 512; /* chunked prefill */
    p.enable_prefix_caching = false;
    p.sparse_method = sp->method;
    p.sparse_config = sp->cfg;
    p.check_invariants = sp->check;
    lethe_engine *e = NULL;
    int rc = lethe_engine_create(&p, &e);
    CHECK_MSG(rc == 0, "%s %s: %s", sp->method, sp->cfg ? sp->cfg : "", lethe_engine_last_error());
    cb_ctx cc[2] = {{o, 0}, {o, 1}};
    uint64_t rng = 99;
    for (int r = 0; r < 2; r++) {
        if (!sp->n_prompt[r]) continue;
        int32_t *ids = lethe_xmalloc((size_t)sp->n_prompt[r] * sizeof(int32_t));
        for (int32_t i = 0; i < sp->n_prompt[r]; i++) ids[i] = 3 + (int32_t)(lethe_splitmix64(&rng) % 250);
        lethe_request_params rp = {.prompt = ids, .n_prompt = sp->n_prompt[r], .cb = on_event,
                                   .user = &cc[r], .want_logits = sp->logits};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = sp->n_gen;
        rp.sampling.ignore_eos = true;
        uint64_t id;
        CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
        free(ids);
    }
    while (lethe_engine_has_work(e)) CHECK(lethe_engine_step(e) == 0);
    lethe_engine_destroy(e);
    for (int r = 0; r < 2; r++)
        if (sp->n_prompt[r]) CHECK_EQ_INT(o->n[r], sp->n_gen);
}

static void free_out(run_out *o) {
    free(o->logits[0]);
    free(o->logits[1]);
}

/* greedy tokens equal; logits within `tol` of the largest |logit| (printed) */
static void same_as_dense(const char *what, const run_out *d, const run_out *q, int32_t n_gen,
                          double tol) {
    double worst = 0, scale = 1e-30;
    for (int r = 0; r < 2; r++) {
        for (int i = 0; i < n_gen; i++)
            CHECK_MSG(d->tokens[r][i] == q->tokens[r][i], "%s: request %d token %d: dense %d, quest %d",
                      what, r, i, d->tokens[r][i], q->tokens[r][i]);
        for (size_t i = 0; d->logits[r] && i < (size_t)n_gen * d->n_vocab; i++) {
            worst = fmax(worst, fabs((double)d->logits[r][i] - q->logits[r][i]));
            scale = fmax(scale, fabs((double)d->logits[r][i]));
        }
    }
    fprintf(stderr, "    %s: %d greedy tokens x 2 equal to dense; max |logit diff| %.3g (%.3g of max |logit|)\n",
            what, n_gen, worst, worst / scale);
    CHECK_MSG(worst <= tol * scale, "%s: logits differ from dense by %.3g of their scale", what, worst / scale);
}

/* logits of q within `tol` of d's scale over the tokens up to and including
 * the first greedy token that differs (the per-KV-head path's attention kernel) */
static void close_to_dense(const char *what, const run_out *d, const run_out *q, int32_t n_gen, double tol) {
    double worst = 0, scale = 1e-30;
    int agree = 0;
    for (int r = 0; r < 2; r++) {
        int same = 0;
        while (same < n_gen - 1 && d->tokens[r][same] == q->tokens[r][same]) same++;
        agree += same + (d->tokens[r][same] == q->tokens[r][same]);
        for (size_t i = 0; i < (size_t)(same + 1) * d->n_vocab; i++) {
            worst = fmax(worst, fabs((double)d->logits[r][i] - q->logits[r][i]));
            scale = fmax(scale, fabs((double)d->logits[r][i]));
        }
    }
    fprintf(stderr, "    %s: %d of %d greedy tokens equal to dense; max |logit diff| %.3g of max |logit|\n", what,
            agree, 2 * n_gen, worst / scale);
    CHECK_MSG(worst <= tol * scale, "%s: logits differ from dense by %.3g of their scale", what, worst / scale);
}

#define ALWAYS "sink_keep_tokens=64,recent_keep_tokens=512,decode_keep_tokens=100000,quest_skip_layers=0,quest_always_score=true"

static void test_identity_tiny(void) {
    run_spec d = {TINY, "dense", NULL, {100, 77}, 12, 128, true, true}, q = d;
    q.method = "quest";
    q.cfg = ALWAYS;
    static run_out od, oq;
    run(&d, &od);
    run(&q, &oq);
    same_as_dense("tiny-llama", &od, &oq, 12, 1e-3);
    free_out(&oq);
    q.cfg = ALWAYS ",quest_granularity=head";
    run(&q, &oq);
    close_to_dense("tiny-llama, quest per KV head", &od, &oq, 12, 2e-2);
    free_out(&od), free_out(&oq);
}

static void test_identity_8b(void) {
    run_spec d = {L8B, "dense", NULL, {700, 333}, 16, 2048, true, true}, q = d;
    q.method = "quest";
    q.cfg = ALWAYS;
    static run_out od, oq;
    run(&d, &od);
    run(&q, &oq);
    same_as_dense("llama-3.1-8b dummy", &od, &oq, 16, 1e-3);
    free_out(&oq);
    q.cfg = ALWAYS ",quest_granularity=head";
    run(&q, &oq);
    close_to_dense("llama-3.1-8b dummy, quest per KV head", &od, &oq, 16, 2e-2);
    q.cfg = ALWAYS;
    /* a real budget: 256 tokens = 16 pages of ~45 */
    static run_out os;
    q.cfg = "sink_keep_tokens=16,recent_keep_tokens=64,decode_keep_tokens=176";
    q.logits = false;
    run(&q, &os);
    int agree = 0;
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 16; i++) agree += os.tokens[r][i] == od.tokens[r][i];
    fprintf(stderr, "    llama-3.1-8b dummy, quest B=256: finished; %d of 32 greedy tokens equal dense\n", agree);
    free_out(&od), free_out(&oq), free_out(&os);
}

static double ms_per_token(const run_out *o, int32_t n) {
    return 1e3 * (o->t_tok[0][n - 1] - o->t_tok[0][1]) / (double)(n - 2); /* steady decode steps */
}

static void test_timing_8b(void) {
    const int32_t n = 24;
    run_spec d = {L8B, "dense", NULL, {16384, 0}, n, 16384 + 64, false, false}, q = d;
    q.method = "quest";
    q.cfg = "sink_keep_tokens=64,recent_keep_tokens=448,decode_keep_tokens=1536"; /* B = 2048 */
    static run_out od, oq;
    run(&d, &od);
    run(&q, &oq);
    fprintf(stderr, "    llama-3.1-8b dummy, 16K prompt, batch 1: decode %.2f ms/token dense, %.2f ms/token "
                    "quest B=2048\n", ms_per_token(&od, n), ms_per_token(&oq, n));
    free_out(&od), free_out(&oq);
}

int main(void) {
    TEST_RUN(test_identity_tiny);
    TEST_RUN(test_identity_8b);
    TEST_RUN(test_timing_8b);
    fprintf(stderr, "test_cuda_quest: all passed\n");
    return 0;
}

/* test_sampler.c - the sampler pipeline of engine/sampler.h.
 *
 * Greedy (ties -> smallest id), top-k = 1 equals greedy, seeded
 * reproducibility, the top-p nucleus and min-p sets (every draw inside the
 * independently computed set, every member drawn), penalties moving the
 * argmax as HF / OpenAI define them, empirical frequencies vs softmax over
 * many draws, raw logprobs + top alternatives, and parameter validation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "engine/sampler.h"
#include "test.h"

static lethe_sampling_params params(float temp) {
    lethe_sampling_params p;
    memset(&p, 0, sizeof(p));
    p.temperature = temp;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    p.logprobs = -1;
    p.max_tokens = -1;
    return p;
}

static int32_t sample(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng,
                      const float *l) {
    lethe_sample_result r;
    lethe_sampler_sample(ws, p, rng, l, NULL, 0, NULL, 0, &r);
    return r.token;
}

static void test_greedy(void) {
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, 6) == LETHE_OK);
    float l[6] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f};
    lethe_sampling_params p = params(0.0f);
    lethe_rng rng;
    lethe_rng_seed(&rng, 1);
    lethe_rng before = rng;
    CHECK_EQ_INT(sample(&ws, &p, &rng, l), 1); /* tie 1/3/5: smallest id */
    CHECK(!memcmp(&rng, &before, sizeof(rng)));  /* greedy draws nothing */
    /* top-k = 1 at temperature 1 is greedy too */
    p = params(1.0f);
    p.top_k = 1;
    for (int i = 0; i < 20; i++) CHECK_EQ_INT(sample(&ws, &p, &rng, l), 1);
    lethe_sampler_ws_free(&ws);
    lethe_sampler_ws_free(&ws); /* idempotent */
}

static void test_seed_reproducible(void) {
    const int V = 1000;
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, V) == LETHE_OK);
    float *l = lethe_xmalloc(V * sizeof(float));
    uint64_t st = 7;
    for (int i = 0; i < V; i++) l[i] = (float)((lethe_splitmix64(&st) >> 40) % 1000) / 250.0f;
    lethe_sampling_params p = params(0.8f);
    p.top_p = 0.95f;
    p.top_k = 200;
    int32_t a[64], b[64], c[64];
    lethe_rng r1, r2, r3;
    lethe_rng_seed(&r1, 42), lethe_rng_seed(&r2, 42), lethe_rng_seed(&r3, 43);
    for (int i = 0; i < 64; i++) a[i] = sample(&ws, &p, &r1, l);
    for (int i = 0; i < 64; i++) {
        b[i] = sample(&ws, &p, &r2, l);
        c[i] = sample(&ws, &p, &r3, l);
    }
    CHECK(!memcmp(a, b, sizeof(a)));
    CHECK(memcmp(a, c, sizeof(a)) != 0);
    free(l);
    lethe_sampler_ws_free(&ws);
}

/* the nucleus by a full sort: smallest rank prefix with mass >= top_p */
static int cmp_desc(const void *x, const void *y, void *ctx) {
    const double *pr = ctx;
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    if (pr[a] != pr[b]) return pr[a] > pr[b] ? -1 : 1;
    return a - b;
}

static void test_top_p(void) {
    const int V = 20000;
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, V) == LETHE_OK);
    float *l = lethe_xmalloc(V * sizeof(float));
    double *pr = lethe_xmalloc(V * sizeof(double));
    int32_t *order = lethe_xmalloc(V * sizeof(int32_t));
    char *in = calloc(V, 1), *seen = calloc(V, 1);
    uint64_t st = 99;
    for (int i = 0; i < V; i++) l[i] = (float)((lethe_splitmix64(&st) >> 40) % 100000) / 10000.0f;
    const float temp = 0.05f, top_p = 0.6f;
    double mx = -1e30, z = 0;
    for (int i = 0; i < V; i++) mx = fmax(mx, l[i] / temp);
    for (int i = 0; i < V; i++) z += pr[i] = exp(l[i] / temp - mx);
    for (int i = 0; i < V; i++) order[i] = i, pr[i] /= z;
    qsort_r(order, V, sizeof(int32_t), cmp_desc, pr);
    double cum = 0;
    int n_in = 0;
    while (cum < top_p) cum += pr[order[n_in]], in[order[n_in++]] = 1;
    CHECK(n_in > 20 && n_in < 200);
    lethe_sampling_params p = params(temp);
    p.top_p = top_p;
    lethe_rng rng;
    lethe_rng_seed(&rng, 5);
    int n_seen = 0;
    for (int i = 0; i < 40 * n_in; i++) {
        int32_t t = sample(&ws, &p, &rng, l);
        CHECK_MSG(in[t], "token %d outside the nucleus", t);
        if (!seen[t]) seen[t] = 1, n_seen++;
    }
    CHECK_EQ_INT(n_seen, n_in);
    /* min-p: only p >= min_p * p_max */
    p = params(1.0f);
    p.min_p = 0.5f;
    float l2[8] = {1.0f, 0.0f, 0.5f, 1.0f - logf(2.0f) - 0.01f, 0.9f, -3.0f, 0.31f, 0.2f};
    lethe_sampler_ws ws8;
    CHECK(lethe_sampler_ws_init(&ws8, 8) == LETHE_OK);
    int hits[8] = {0};
    for (int i = 0; i < 4000; i++) hits[sample(&ws8, &p, &rng, l2)]++;
    for (int t = 0; t < 8; t++) {
        int allowed = expf(l2[t] - 1.0f) >= 0.5f;
        CHECK_MSG(allowed ? hits[t] > 0 : hits[t] == 0, "min_p token %d hits %d", t, hits[t]);
    }
    free(l), free(pr), free(order), free(in), free(seen);
    lethe_sampler_ws_free(&ws);
    lethe_sampler_ws_free(&ws8);
}

static void test_penalties(void) {
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, 5) == LETHE_OK);
    float l[5] = {2.0f, 1.9f, -0.5f, -0.6f, 1.0f};
    lethe_sampling_params p = params(0.0f);
    lethe_rng rng;
    lethe_rng_seed(&rng, 1);
    lethe_sample_result r;
    int32_t prompt[3] = {0, 0, 3}, out[3] = {0, 0, 0};
    /* repetition: 2.0 / 1.2 = 1.67 < 1.9 -> token 1; repeated ids penalised once */
    p.repetition_penalty = 1.2f;
    lethe_sampler_sample(&ws, &p, &rng, l, prompt, 3, NULL, 0, &r);
    CHECK_EQ_INT(r.token, 1);
    p.repetition_penalty = 1.04f; /* 2.0 / 1.04 = 1.92 > 1.9: still 0 (once, not twice) */
    lethe_sampler_sample(&ws, &p, &rng, l, prompt, 3, NULL, 0, &r);
    CHECK_EQ_INT(r.token, 0);
    /* negative logits are multiplied: -0.5 * 3 = -1.5 < -0.6 */
    float neg[5] = {-0.5f, -0.6f, -9.0f, -9.0f, -9.0f};
    p.repetition_penalty = 3.0f;
    lethe_sampler_sample(&ws, &p, &rng, neg, prompt, 1, NULL, 0, &r);
    CHECK_EQ_INT(r.token, 1);
    /* frequency: counts over output only: 2.0 - 3 * 0.05 = 1.85 < 1.9 */
    p = params(0.0f);
    p.frequency_penalty = 0.05f;
    lethe_sampler_sample(&ws, &p, &rng, l, NULL, 0, out, 3, &r);
    CHECK_EQ_INT(r.token, 1);
    lethe_sampler_sample(&ws, &p, &rng, l, NULL, 0, out, 1, &r); /* 1.95 */
    CHECK_EQ_INT(r.token, 0);
    lethe_sampler_sample(&ws, &p, &rng, l, prompt, 3, NULL, 0, &r); /* prompt: no effect */
    CHECK_EQ_INT(r.token, 0);
    /* presence: once per distinct id */
    p = params(0.0f);
    p.presence_penalty = 0.15f;
    lethe_sampler_sample(&ws, &p, &rng, l, NULL, 0, out, 1, &r); /* 1.85 */
    CHECK_EQ_INT(r.token, 1);
    p.presence_penalty = 0.05f;
    lethe_sampler_sample(&ws, &p, &rng, l, NULL, 0, out, 3, &r); /* 1.95, not 1.85 */
    CHECK_EQ_INT(r.token, 0);
    /* the scratch counts are back to zero between calls */
    for (int i = 0; i < 5; i++) CHECK(ws.count[i] == 0);
    lethe_sampler_ws_free(&ws);
}

static void test_distribution(void) {
    const int V = 6, N = 200000;
    float l[6] = {1.0f, 0.2f, -0.5f, 1.3f, 0.0f, -2.0f};
    const float temp = 0.7f;
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, V) == LETHE_OK);
    lethe_sampling_params p = params(temp);
    lethe_rng rng;
    lethe_rng_seed(&rng, 2024);
    int hits[6] = {0};
    for (int i = 0; i < N; i++) hits[sample(&ws, &p, &rng, l)]++;
    double z = 0, pr[6];
    for (int i = 0; i < V; i++) z += pr[i] = exp(l[i] / temp);
    for (int i = 0; i < V; i++) {
        pr[i] /= z;
        double sd = sqrt(N * pr[i] * (1 - pr[i]));
        CHECK_MSG(fabs(hits[i] - N * pr[i]) <= 5 * sd, "token %d: %d draws, expected %.0f", i,
                  hits[i], N * pr[i]);
    }
    /* top-k = 2 renormalises over {3, 0} */
    p.top_k = 2;
    memset(hits, 0, sizeof(hits));
    for (int i = 0; i < N / 4; i++) hits[sample(&ws, &p, &rng, l)]++;
    double p3 = pr[3] / (pr[3] + pr[0]);
    CHECK(hits[0] + hits[3] == N / 4);
    CHECK(fabs(hits[3] - N / 4 * p3) <= 5 * sqrt(N / 4 * p3 * (1 - p3)));
    lethe_sampler_ws_free(&ws);
}

static void test_logprobs(void) {
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, 7) == LETHE_OK);
    float l[7] = {0.1f, 2.0f, 2.0f, -1.0f, 1.5f, 0.3f, 3.0f};
    double z = 0;
    for (int i = 0; i < 7; i++) z += exp(l[i]);
    lethe_sampling_params p = params(0.0f);
    p.logprobs = 4;
    p.repetition_penalty = 10.0f; /* moves the argmax, not the reported (raw) logprobs */
    int32_t prompt[1] = {6};
    lethe_rng rng;
    lethe_rng_seed(&rng, 3);
    lethe_sample_result r;
    lethe_sampler_sample(&ws, &p, &rng, l, prompt, 1, NULL, 0, &r);
    CHECK_EQ_INT(r.token, 1);
    CHECK(fabs(r.logprob - (l[1] - log(z))) < 1e-6);
    CHECK_EQ_INT(r.n_top, 4);
    const int32_t want[4] = {6, 1, 2, 4};
    for (int i = 0; i < 4; i++) {
        CHECK_EQ_INT(r.top[i].token, want[i]);
        CHECK(fabs(r.top[i].logprob - (l[want[i]] - log(z))) < 1e-6);
    }
    p.logprobs = -1;
    lethe_sampler_sample(&ws, &p, &rng, l, NULL, 0, NULL, 0, &r);
    CHECK(r.n_top == 0 && r.token == 6);
    p.logprobs = 20; /* more than the vocabulary */
    lethe_sampler_sample(&ws, &p, &rng, l, NULL, 0, NULL, 0, &r);
    CHECK_EQ_INT(r.n_top, 7);
    CHECK_EQ_INT(r.top[6].token, 3);
    lethe_sampler_ws_free(&ws);
}

static void test_params_check(void) {
    lethe_sampling_params p = params(1.0f);
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_OK);
    p.temperature = -0.1f;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "temperature");
    p = params(1.0f), p.top_p = 0.0f;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "top_p");
    p = params(1.0f), p.min_p = 1.5f;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    p = params(1.0f), p.repetition_penalty = 0.0f;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    p = params(1.0f), p.presence_penalty = 2.5f;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    p = params(1.0f), p.frequency_penalty = NAN;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    p = params(1.0f), p.logprobs = 21;
    CHECK(lethe_sampling_params_check(&p, 10) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "logprobs");
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, 0) == LETHE_ERR_INVALID);
}

int main(void) {
    TEST_RUN(test_greedy);
    TEST_RUN(test_seed_reproducible);
    TEST_RUN(test_top_p);
    TEST_RUN(test_penalties);
    TEST_RUN(test_distribution);
    TEST_RUN(test_logprobs);
    TEST_RUN(test_params_check);
    fprintf(stderr, "test_sampler: ok\n");
    return 0;
}

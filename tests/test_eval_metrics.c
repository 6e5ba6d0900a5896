/* test_eval_metrics.c - scorers and metric math of `lethe eval` against hand-computed values.
 *
 * KL of known two- and four-outcome distributions (closed forms), its shift
 * invariance and stability at large logits; top-1 tie-breaking; NLL and
 * perplexity of a uniform distribution (= vocabulary size); percentiles and
 * summaries against numpy's linear interpolation computed by hand; the
 * exact-match scorers on tricky outputs; list parsing of flag values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eval/eval.h"
#include "test.h"

#define NEAR(a, b, tol) CHECK_MSG(fabs((double)(a) - (double)(b)) <= (tol), "%.12g vs %.12g", (double)(a), (double)(b))

static void test_kl(void) {
    /* P = (0.5, 0.5), Q = (0.25, 0.75): KL = 0.5 ln 2 + 0.5 ln(2/3) */
    float p[2] = {logf(0.5f), logf(0.5f)}, q[2] = {logf(0.25f), logf(0.75f)};
    NEAR(lethe_eval_kl(p, q, 2), 0.5 * log(2.0) + 0.5 * log(2.0 / 3.0), 1e-6);
    /* reversed: 0.25 ln(0.5) + 0.75 ln(1.5) */
    NEAR(lethe_eval_kl(q, p, 2), 0.25 * log(0.5) + 0.75 * log(1.5), 1e-6);
    /* logits are only defined up to a constant: shifting either side changes nothing */
    float p2[2] = {p[0] + 7.0f, p[1] + 7.0f}, q2[2] = {q[0] - 3.0f, q[1] - 3.0f};
    NEAR(lethe_eval_kl(p2, q2, 2), lethe_eval_kl(p, q, 2), 1e-6);
    /* KL(P || P) = 0 */
    float r[4] = {1.0f, -2.0f, 0.5f, 3.0f};
    NEAR(lethe_eval_kl(r, r, 4), 0.0, 1e-12);
    /* four outcomes, P = (0.1, 0.2, 0.3, 0.4), Q uniform: sum p ln(4p) */
    float a[4], u[4] = {0, 0, 0, 0};
    double want = 0;
    for (int i = 0; i < 4; i++) {
        double pi = 0.1 * (i + 1);
        a[i] = (float)log(pi);
        want += pi * log(4 * pi);
    }
    NEAR(lethe_eval_kl(a, u, 4), want, 1e-6);
    /* large logits: no overflow; a near-one-hot P against uniform Q -> ln 4 */
    float big[4] = {1000.0f, 0.0f, 0.0f, 0.0f};
    NEAR(lethe_eval_kl(big, u, 4), log(4.0), 1e-9);
    CHECK(isfinite(lethe_eval_kl(u, big, 4)));
    NEAR(lethe_eval_kl(u, big, 4), 0.75 * 1000.0 - log(4.0), 1e-3); /* 3/4 of P on tokens Q gives e^-1000 */
}

static void test_log_softmax_nll(void) {
    float x[3] = {1.0f, 2.0f, 3.0f};
    double ls[3];
    lethe_eval_log_softmax(x, 3, ls);
    double z = log(exp(1.0) + exp(2.0) + exp(3.0));
    for (int i = 0; i < 3; i++) NEAR(ls[i], (i + 1) - z, 1e-9);
    NEAR(lethe_eval_nll(x, 3, 2), z - 3.0, 1e-9);
    /* uniform over V: NLL = ln V, perplexity = V */
    enum { V = 49152 };
    float *uni = calloc(V, sizeof(float));
    for (int i = 0; i < V; i++) uni[i] = 0.25f;
    double nll = 0;
    for (int t = 0; t < 10; t++) nll += lethe_eval_nll(uni, V, t * 997);
    NEAR(exp(nll / 10), (double)V, 1e-6 * V);
    free(uni);
}

static void test_argmax(void) {
    float x[5] = {0.1f, 3.0f, -1.0f, 3.0f, 2.9f};
    CHECK_EQ_INT(lethe_eval_argmax(x, 5), 1); /* tie: lower index */
    float y[1] = {-5.0f};
    CHECK_EQ_INT(lethe_eval_argmax(y, 1), 0);
}

static void test_percentiles(void) {
    /* numpy.percentile([4, 1, 3, 2], q): 50 -> 2.5, 90 -> 3.7, 99 -> 3.97, 0 -> 1, 100 -> 4 */
    double v[4] = {4, 1, 3, 2};
    NEAR(lethe_eval_percentile(v, 4, 50), 2.5, 1e-12);
    NEAR(lethe_eval_percentile(v, 4, 90), 3.7, 1e-12);
    NEAR(lethe_eval_percentile(v, 4, 99), 3.97, 1e-12);
    NEAR(lethe_eval_percentile(v, 4, 0), 1.0, 1e-12);
    NEAR(lethe_eval_percentile(v, 4, 100), 4.0, 1e-12);
    double one[1] = {7};
    NEAR(lethe_eval_percentile(one, 1, 99), 7.0, 0);
    CHECK(isnan(lethe_eval_percentile(one, 0, 50)));
    /* 1..10: median 5.5, p90 = 9.1, p99 = 9.91, mean 5.5, population std sqrt(8.25) */
    double w[10];
    for (int i = 0; i < 10; i++) w[i] = 10 - i;
    lethe_eval_summary s;
    lethe_eval_summarize(w, 10, &s);
    CHECK_EQ_INT(s.n, 10);
    NEAR(s.mean, 5.5, 1e-12);
    NEAR(s.median, 5.5, 1e-12);
    NEAR(s.p90, 9.1, 1e-12);
    NEAR(s.p99, 9.91, 1e-12);
    NEAR(s.std, sqrt(8.25), 1e-12);
    NEAR(s.min, 1, 0);
    NEAR(s.max, 10, 0);
    lethe_eval_summarize(w, 0, &s);
    CHECK(isnan(s.mean) && isnan(s.p99));
}

static lethe_eval_sample mk(lethe_eval_task t, int n, const char **ans) {
    lethe_eval_sample s;
    memset(&s, 0, sizeof(s));
    s.task = t;
    for (int i = 0; i < n; i++) s.answers[i] = (char *)ans[i];
    s.n_answers = n;
    return s;
}

static void test_scorers(void) {
    const char *pk[] = {"71432"};
    lethe_eval_sample s = mk(LETHE_EVAL_PASSKEY, 1, pk);
    NEAR(lethe_eval_score(&s, " 71432."), 1, 0);
    NEAR(lethe_eval_score(&s, "71432"), 1, 0);
    NEAR(lethe_eval_score(&s, " is 71432. Remember it. 12345"), 1, 0);
    NEAR(lethe_eval_score(&s, " 714321"), 0, 0);  /* longer number: wrong */
    NEAR(lethe_eval_score(&s, " 7143"), 0, 0);
    NEAR(lethe_eval_score(&s, " 12345, no 71432"), 0, 0); /* the first number counts */
    NEAR(lethe_eval_score(&s, " I don't know."), 0, 0);
    NEAR(lethe_eval_score(&s, ""), 0, 0);
    NEAR(lethe_eval_score(&s, NULL), 0, 0);
    s.task = LETHE_EVAL_NIAH_MULTIKEY;
    NEAR(lethe_eval_score(&s, ": 71432"), 1, 0);

    const char *vt[] = {"ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"};
    s = mk(LETHE_EVAL_VT, 5, vt);
    NEAR(lethe_eval_score(&s, " ABCDE, FGHIJ, KLMNO, PQRST, UVWXY"), 1, 0);
    NEAR(lethe_eval_score(&s, " VAR ABCDE, VAR FGHIJ"), 0.4, 1e-12);
    NEAR(lethe_eval_score(&s, " abcde fghij"), 0, 0);        /* case matters */
    NEAR(lethe_eval_score(&s, " ABCDEF FGHIJK"), 0, 0);      /* whole words only */
    NEAR(lethe_eval_score(&s, " ABCDE ABCDE ABCDE"), 0.2, 1e-12); /* repeats count once */

    const char *cw[] = {"market", "nation", "labor"};
    s = mk(LETHE_EVAL_CWE, 3, cw);
    NEAR(lethe_eval_score(&s, " 1. Market 2. nation 3. labor"), 1, 0);
    NEAR(lethe_eval_score(&s, " marketing, nations, labor"), 1.0 / 3, 1e-12);
    NEAR(lethe_eval_score(&s, " market market"), 1.0 / 3, 1e-12);
}

static void test_int_list(void) {
    int32_t v[8];
    CHECK_EQ_INT(lethe_eval_parse_int_list("2048,4096,8k", v, 8), 3);
    CHECK_EQ_INT(v[0], 2048);
    CHECK_EQ_INT(v[1], 4096);
    CHECK_EQ_INT(v[2], 8192);
    CHECK_EQ_INT(lethe_eval_parse_int_list("512", v, 8), 1);
    CHECK_EQ_INT(lethe_eval_parse_int_list("", v, 8), -1);
    CHECK_EQ_INT(lethe_eval_parse_int_list("1,x", v, 8), -1);
    CHECK_STR_CONTAINS(lethe_last_error(), "not a number");
    CHECK_EQ_INT(lethe_eval_parse_int_list("1,0", v, 8), -1);
    CHECK_EQ_INT(lethe_eval_parse_int_list("1,2,3", v, 2), -1);
    CHECK_EQ_INT(lethe_eval_parse_int_list("4q", v, 2), -1);
}

int main(void) {
    TEST_RUN(test_kl);
    TEST_RUN(test_log_softmax_nll);
    TEST_RUN(test_argmax);
    TEST_RUN(test_percentiles);
    TEST_RUN(test_scorers);
    TEST_RUN(test_int_list);
    return 0;
}

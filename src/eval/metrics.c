/* metrics.c - the numbers the eval reports: KL divergence, top-1, NLL,
 * percentiles, and list parsing for flags.
 *
 * All reductions run in double over float logits; log-softmax uses the
 * max-shifted logsumexp so that logits of any scale are safe. KL(P || Q) is
 * computed without temporaries: with a = log P, b = log Q,
 *     KL = sum_i exp(a_i) * (a_i - b_i),  a_i = p_i - lse(p), b_i = q_i - lse(q).
 * Percentiles interpolate linearly between order statistics (numpy's default,
 * what vLLM's benchmark reports). */
#include "eval/eval.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static double logsumexp(const float *x, int32_t n) {
    double m = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    if (!isfinite(m)) return m;
    double s = 0;
    for (int32_t i = 0; i < n; i++) s += exp((double)x[i] - m);
    return m + log(s);
}

void lethe_eval_log_softmax(const float *x, int32_t n, double *out) {
    double lse = logsumexp(x, n);
    for (int32_t i = 0; i < n; i++) out[i] = (double)x[i] - lse;
}

double lethe_eval_kl(const float *p, const float *q, int32_t n) {
    double lp = logsumexp(p, n), lq = logsumexp(q, n);
    double kl = 0;
    for (int32_t i = 0; i < n; i++) {
        double a = (double)p[i] - lp;
        if (a < -745) continue; /* exp underflows to 0: no contribution */
        kl += exp(a) * (a - ((double)q[i] - lq));
    }
    return kl > 0 ? kl : 0.0; /* rounding can leave -1e-17 */
}

int32_t lethe_eval_argmax(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

double lethe_eval_nll(const float *logits, int32_t n, int32_t target) {
    LETHE_ASSERT(target >= 0 && target < n);
    return logsumexp(logits, n) - (double)logits[target];
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile_sorted(const double *v, size_t n, double p) {
    if (n == 0) return NAN;
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    if (lo >= n - 1) return v[n - 1];
    double frac = pos - (double)lo;
    return v[lo] + frac * (v[lo + 1] - v[lo]);
}

double lethe_eval_percentile(double *v, size_t n, double p) {
    if (n == 0) return NAN;
    qsort(v, n, sizeof(double), cmp_double);
    return percentile_sorted(v, n, p);
}

void lethe_eval_summarize(double *v, size_t n, lethe_eval_summary *o) {
    o->n = n;
    if (n == 0) {
        o->mean = o->std = o->min = o->max = o->median = o->p90 = o->p99 = NAN;
        return;
    }
    qsort(v, n, sizeof(double), cmp_double);
    double s = 0;
    for (size_t i = 0; i < n; i++) s += v[i];
    o->mean = s / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += (v[i] - o->mean) * (v[i] - o->mean);
    o->std = sqrt(ss / (double)n); /* population std, like numpy's default */
    o->min = v[0];
    o->max = v[n - 1];
    o->median = percentile_sorted(v, n, 50);
    o->p90 = percentile_sorted(v, n, 90);
    o->p99 = percentile_sorted(v, n, 99);
}

int lethe_eval_parse_int_list(const char *s, int32_t *out, int max) {
    int n = 0;
    const char *p = s;
    if (!s || !*s) {
        lethe_errorf(LETHE_ERR_INVALID, "empty list");
        return -1;
    }
    while (*p) {
        char *end = NULL;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno) {
            lethe_errorf(LETHE_ERR_INVALID, "'%s': not a number at '%s'", s, p);
            return -1;
        }
        if (*end == 'k' || *end == 'K') {
            v *= 1024;
            end++;
        }
        if (*end && *end != ',') {
            lethe_errorf(LETHE_ERR_INVALID, "'%s': unexpected '%c'", s, *end);
            return -1;
        }
        if (v <= 0 || v > (1 << 26)) {
            lethe_errorf(LETHE_ERR_INVALID, "'%s': %lld out of range [1, %d]", s, v, 1 << 26);
            return -1;
        }
        if (n == max) {
            lethe_errorf(LETHE_ERR_INVALID, "'%s': more than %d items", s, max);
            return -1;
        }
        out[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    return n;
}

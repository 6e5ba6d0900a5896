/* test.h - the whole test framework: fail fast with file:line.
 *
 * A test binary is a main() that calls test functions; any failed CHECK
 * prints where and exits 1. TEST_DATA() resolves paths relative to the repo
 * root (tests run from there). */
#ifndef LETHE_TEST_H
#define LETHE_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                    \
    do {                                                                            \
        if (!(c)) {                                                                 \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #c);   \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define CHECK_MSG(c, ...)                                                           \
    do {                                                                            \
        if (!(c)) {                                                                 \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #c);   \
            fprintf(stderr, __VA_ARGS__);                                           \
            fputc('\n', stderr);                                                    \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                          \
    do {                                                                            \
        long long a_ = (long long)(a), b_ = (long long)(b);                         \
        if (a_ != b_) {                                                             \
            fprintf(stderr, "%s:%d: %s == %s failed: %lld != %lld\n", __FILE__,     \
                    __LINE__, #a, #b, a_, b_);                                      \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                             \
    do {                                                                            \
        const char *h_ = (hay), *n_ = (needle);                                     \
        if (!h_ || !strstr(h_, n_)) {                                               \
            fprintf(stderr, "%s:%d: expected \"%s\" to contain \"%s\"\n", __FILE__, \
                    __LINE__, h_ ? h_ : "(null)", n_);                              \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* max |a-b| <= atol + rtol*|b| elementwise */
static inline void check_close_(const float *a, const float *b, size_t n, float atol, float rtol,
                                const char *what, const char *file, int line) {
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= atol + rtol * fabsf(b[i]))) {
            fprintf(stderr, "%s:%d: %s: element %zu: %g vs %g (diff %g)\n", file, line, what, i,
                    (double)a[i], (double)b[i], (double)d);
            exit(1);
        }
    }
}
#define CHECK_CLOSE(a, b, n, atol, rtol) check_close_((a), (b), (n), (atol), (rtol), #a, __FILE__, __LINE__)

/* ||a-b|| / ||b|| */
static inline double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* LETHE_TEST_ONLY=sub[,sub...] runs only the tests whose name contains one
 * of the comma-separated substrings (a test-runner convenience while
 * developing; unset or empty runs everything; empty items are ignored) */
static inline int test_selected_(const char *name) {
    const char *only = getenv("LETHE_TEST_ONLY");
    if (!only || !*only) return 1;
    int any = 0;
    for (const char *p = only; *p;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 0) {
            any = 1;
            for (const char *h = name; strlen(h) >= n; h++)
                if (strncmp(h, p, n) == 0) return 1;
        }
        p += n;
        if (*p == ',') p++;
    }
    return !any; /* only commas: as if unset */
}
#define TEST_RUN(fn)                        \
    do {                                    \
        if (!test_selected_(#fn)) break;    \
        fprintf(stderr, "  %s\n", #fn);     \
        fn();                               \
    } while (0)

#endif /* LETHE_TEST_H */

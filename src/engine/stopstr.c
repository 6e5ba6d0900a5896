/* stopstr.c - hold back possible stop-string prefixes, cut at stop strings. */
#include "engine/stopstr.h"

#include <stdlib.h>
#include <string.h>

#include "core/util.h"

void lethe_stopstr_init(lethe_stopstr *s, const char *const *stops) {
    memset(s, 0, sizeof(*s));
    s->stops = stops;
}

void lethe_stopstr_free(lethe_stopstr *s) {
    free(s->held);
    free(s->out);
    memset(s, 0, sizeof(*s));
}

static void release(lethe_stopstr *s, size_t n, const char **released, size_t *n_released) {
    if (n + 1 > s->cap_out) {
        s->cap_out = LETHE_MAX(n + 1, 2 * s->cap_out);
        s->out = lethe_xrealloc(s->out, s->cap_out);
    }
    memcpy(s->out, s->held, n);
    s->out[n] = '\0';
    memmove(s->held, s->held + n, s->n_held - n);
    s->n_held -= n;
    *released = s->out;
    *n_released = n;
}

/* Finds needle in hay[0..n) (memmem semantics for non-terminated text). */
static const char *find(const char *hay, size_t n, const char *needle, size_t m) {
    if (m == 0 || m > n) return NULL;
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && !memcmp(hay + i, needle, m)) return hay + i;
    return NULL;
}

bool lethe_stopstr_push(lethe_stopstr *s, const char *text, size_t n, const char **released,
                        size_t *n_released) {
    if (s->n_held + n > s->cap_held) {
        s->cap_held = LETHE_MAX(s->n_held + n, 2 * s->cap_held + 16);
        s->held = lethe_xrealloc(s->held, s->cap_held);
    }
    memcpy(s->held + s->n_held, text, n);
    s->n_held += n;
    /* earliest stop string occurrence */
    const char *first = NULL;
    for (const char *const *st = s->stops; st && *st; st++) {
        const char *p = find(s->held, s->n_held, *st, strlen(*st));
        if (p && (!first || p < first)) first = p;
    }
    if (first) {
        release(s, (size_t)(first - s->held), released, n_released);
        s->n_held = 0;
        return true;
    }
    /* longest suffix of held that is a proper prefix of some stop string */
    size_t keep = 0;
    for (const char *const *st = s->stops; st && *st; st++) {
        size_t m = strlen(*st);
        if (m == 0) continue;
        for (size_t k = LETHE_MIN(m - 1, s->n_held); k > keep; k--)
            if (!memcmp(s->held + s->n_held - k, *st, k)) { keep = k; break; }
    }
    release(s, s->n_held - keep, released, n_released);
    return false;
}

void lethe_stopstr_flush(lethe_stopstr *s, const char **released, size_t *n_released) {
    release(s, s->n_held, released, n_released);
}

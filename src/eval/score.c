/* score.c - parses a model's greedy answer and compares it with the expected one.
 *
 * Exact matching on parsed units, not substring search: a passkey answer is
 * the first run of digits ("71432" matches 71432, "714321" does not); a
 * variable-tracking answer is the set of 5-letter upper-case words; a
 * common-word answer is the set of lower-cased alphabetic words. The score is
 * the fraction of expected answers found (RULER's string_match_all on parsed
 * units), so 1.0 means an exact match. */
#include "eval/eval.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

static int is_ascii_alpha(int c) { return c < 128 && isalpha(c); }
static int is_digit(int c) { return c >= '0' && c <= '9'; }

/* true if `want` (lower case) equals one maximal run of letters of text, lower-cased */
static bool has_word(const char *text, const char *want) {
    size_t wl = strlen(want);
    const char *p = text;
    while (*p) {
        if (!is_ascii_alpha((unsigned char)*p)) {
            p++;
            continue;
        }
        const char *b = p;
        while (is_ascii_alpha((unsigned char)*p)) p++;
        if ((size_t)(p - b) != wl) continue;
        bool eq = true;
        for (size_t i = 0; i < wl && eq; i++) eq = tolower((unsigned char)b[i]) == (unsigned char)want[i];
        if (eq) return true;
    }
    return false;
}

/* upper-case word units only: a run of letters that is all upper case */
static bool has_upper_word(const char *text, const char *want) {
    size_t wl = strlen(want);
    const char *p = text;
    while (*p) {
        if (!is_ascii_alpha((unsigned char)*p)) {
            p++;
            continue;
        }
        const char *b = p;
        bool upper = true;
        while (*p && is_ascii_alpha((unsigned char)*p)) upper &= isupper((unsigned char)*p++) != 0;
        if (upper && (size_t)(p - b) == wl && !memcmp(b, want, wl)) return true;
    }
    return false;
}

double lethe_eval_score(const lethe_eval_sample *s, const char *output) {
    if (!output || s->n_answers <= 0) return 0.0;
    switch (s->task) {
    case LETHE_EVAL_PASSKEY:
    case LETHE_EVAL_NIAH_MULTIKEY: {
        const char *p = output;
        while (*p && !is_digit((unsigned char)*p)) p++;
        const char *b = p;
        while (is_digit((unsigned char)*p)) p++;
        size_t len = (size_t)(p - b);
        return len > 0 && len == strlen(s->answers[0]) && !memcmp(b, s->answers[0], len) ? 1.0 : 0.0;
    }
    case LETHE_EVAL_VT: {
        int found = 0;
        for (int i = 0; i < s->n_answers; i++) found += has_upper_word(output, s->answers[i]);
        return (double)found / s->n_answers;
    }
    case LETHE_EVAL_CWE: {
        int found = 0;
        for (int i = 0; i < s->n_answers; i++)
            found += has_word(output, s->answers[i]);
        return (double)found / s->n_answers;
    }
    default: return 0.0;
    }
}

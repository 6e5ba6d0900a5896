/* stopstr.h - stop strings over streamed text.
 *
 * Text arrives in pieces (one detokenized token at a time). Anything that
 * could still be the beginning of a stop string is held back; the rest is
 * released. When a stop string appears, the text before it is released and
 * the stop string and everything after it are dropped (vLLM's default:
 * stop strings are not part of the output). */
#ifndef LETHE_STOPSTR_H
#define LETHE_STOPSTR_H

#include <stdbool.h>
#include <stddef.h>

typedef struct lethe_stopstr {
    const char *const *stops;  /* NULL-terminated list (not owned) */
    char *held;                /* text not yet released */
    size_t n_held, cap_held;
    char *out;                 /* released text of the last call, NUL-terminated */
    size_t cap_out;
} lethe_stopstr;

void lethe_stopstr_init(lethe_stopstr *s, const char *const *stops);
void lethe_stopstr_free(lethe_stopstr *s);
/* Adds text; *released is NUL-terminated text that is safe to emit (valid
 * until the next call). Returns true when a stop string was found. */
bool lethe_stopstr_push(lethe_stopstr *s, const char *text, size_t n, const char **released,
                        size_t *n_released);
/* Releases everything held (the request ended for another reason). */
void lethe_stopstr_flush(lethe_stopstr *s, const char **released, size_t *n_released);

#endif /* LETHE_STOPSTR_H */

/* grammar.h - constrained decoding: a small C interface over xgrammar's C++
 * core (grammar/xgrammar.cc; the library is built from its PyPI source
 * distribution by scripts/build-xgrammar.sh).
 *
 *   lethe_gcompiler  one per engine (vocabulary): the token table xgrammar
 *                    indexes once (tokens by their raw bytes; special tokens
 *                    as empty strings, so no grammar ever allows them; the
 *                    model's end tokens as the stop tokens), plus xgrammar's
 *                    compile cache. Thread-safe: any connection thread may
 *                    compile.
 *   lethe_grammar    a compiled grammar: immutable, reference counted, shared
 *                    by the requests that use it (public type, lethe.h).
 *   lethe_gmatcher   one per request: where the output is in the grammar.
 *                    The engine thread fills the token mask before each
 *                    sample (bit i of word i / 32 set = token i allowed) and
 *                    advances it with each accepted token. Once the grammar
 *                    is complete only the stop tokens remain allowed.
 * Every call catches xgrammar's exceptions and reports them as lethe
 * errors (a bad schema is LETHE_ERR_INVALID with xgrammar's message). */
#ifndef LETHE_GRAMMAR_H
#define LETHE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "lethe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lethe_gcompiler lethe_gcompiler;
typedef struct lethe_gmatcher lethe_gmatcher;

/* tokens[i] / lens[i]: raw bytes of token i (lens[i] = 0 for special tokens),
 * i < n_tokens <= vocab_size (ids beyond n_tokens are never allowed). */
lethe_status lethe_gcompiler_create(const char *const *tokens, const size_t *lens, int32_t n_tokens,
                                    int32_t vocab_size, const int32_t *stop_ids, int32_t n_stop,
                                    lethe_gcompiler **out);
void lethe_gcompiler_free(lethe_gcompiler *c); /* NULL-safe */

lethe_status lethe_gcompiler_compile(lethe_gcompiler *c, lethe_grammar_kind kind, const char *spec,
                                     lethe_grammar **out);
lethe_grammar *lethe_grammar_ref(lethe_grammar *g);

int32_t lethe_gmask_words(int32_t vocab_size); /* ceil(vocab_size / 32) */

lethe_status lethe_gmatcher_create(lethe_grammar *g, lethe_gmatcher **out);
void lethe_gmatcher_free(lethe_gmatcher *m); /* NULL-safe */
/* mask: [lethe_gmask_words(vocab_size)] words */
void lethe_gmatcher_fill_mask(lethe_gmatcher *m, uint32_t *mask);
/* false: the token is not allowed (the matcher is unchanged) */
bool lethe_gmatcher_accept(lethe_gmatcher *m, int32_t token);
bool lethe_gmatcher_terminated(const lethe_gmatcher *m); /* a stop token was accepted */

#ifdef __cplusplus
}
#endif

#endif /* LETHE_GRAMMAR_H */

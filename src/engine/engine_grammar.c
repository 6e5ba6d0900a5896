/* engine_grammar.c - structured output in the engine: compiling grammars
 * against the model's vocabulary (lethe_engine_compile_grammar, any
 * thread) and the per-step token masks (engine thread, engine_step.c).
 *
 * The compiler is built on the first compile: every token's raw bytes
 * (control tokens as empty strings, so no grammar allows them; ids the
 * tokenizer lacks up to the model's vocabulary likewise), the end tokens
 * (the config's EOS ids and the tokenizer's end-of-generation tokens) as the
 * grammar's stop tokens. A request's matcher (eng_req.gm) is created at
 * submit and advanced in process_token with every sampled token. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "grammar/grammar.h"

static lethe_status build_compiler(lethe_engine *e) {
    const int32_t nt = LETHE_MIN(lethe_tokenizer_n_vocab(e->tok), e->n_vocab);
    const char **toks = lethe_xcalloc((size_t)nt, sizeof(char *));
    size_t *lens = lethe_xcalloc((size_t)nt, sizeof(size_t));
    int32_t *stops = lethe_xmalloc((size_t)e->n_vocab * sizeof(int32_t));
    int32_t n_stop = 0;
    const lethe_model_config *c = &e->runner.cfg;
    for (int32_t i = 0; i < e->n_vocab; i++) {
        bool stop = lethe_tokenizer_is_eog(e->tok, i);
        for (int32_t k = 0; k < c->n_eos_ids && !stop; k++) stop = c->eos_ids[k] == i;
        if (stop) stops[n_stop++] = i;
        if (i >= nt || lethe_tokenizer_is_special(e->tok, i)) continue;
        size_t nb = 0;
        toks[i] = lethe_token_bytes(e->tok, i, &nb);
        lens[i] = toks[i] ? nb : 0;
    }
    lethe_status st = n_stop ? LETHE_OK
                             : lethe_errorf(LETHE_ERR_UNSUPPORTED, "structured output: the model has no end token");
    if (st == LETHE_OK) st = lethe_gcompiler_create(toks, lens, nt, e->n_vocab, stops, n_stop, &e->gram.compiler);
    free(toks);
    free(lens);
    free(stops);
    return st;
}

int lethe_engine_compile_grammar(lethe_engine *e, lethe_grammar_kind kind, const char *spec, lethe_grammar **out) {
    *out = NULL;
    if (!e->tok)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "structured output needs the model's tokenizer; %s has none",
                            e->model_name);
    if (kind != LETHE_GRAMMAR_JSON_OBJECT && (!spec || !spec[0]))
        return lethe_errorf(LETHE_ERR_INVALID, "structured output: empty grammar");
    pthread_mutex_lock(&e->gram.mu);
    lethe_status st = e->gram.compiler ? LETHE_OK : build_compiler(e);
    pthread_mutex_unlock(&e->gram.mu);
    if (st != LETHE_OK) return st;
    return lethe_gcompiler_compile(e->gram.compiler, kind, spec, out);
}

void eng_grammar_destroy(lethe_engine *e) {
    lethe_gcompiler_free(e->gram.compiler);
    e->gram.compiler = NULL;
    free(e->gram.mask);
    e->gram.mask = NULL;
    e->gram.cap_rows = 0;
}

const uint32_t *eng_grammar_mask(lethe_engine *e, eng_req *q, int32_t k) {
    LETHE_ASSERT(q->gm && k >= 0);
    if (!e->gram.words) e->gram.words = lethe_gmask_words(e->n_vocab);
    if (k >= e->gram.cap_rows) {
        e->gram.cap_rows = LETHE_MAX(k + 1, 2 * e->gram.cap_rows);
        e->gram.mask = lethe_xrealloc(e->gram.mask, (size_t)e->gram.cap_rows * (size_t)e->gram.words * sizeof(uint32_t));
    }
    uint32_t *m = e->gram.mask + (size_t)k * (size_t)e->gram.words;
    lethe_gmatcher_fill_mask(q->gm, m);
    return m;
}

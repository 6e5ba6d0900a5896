// xgrammar.cc - grammar.h over xgrammar's C++ API (TokenizerInfo,
// GrammarCompiler, CompiledGrammar, GrammarMatcher). C++ stays inside this
// file: every entry point catches exceptions and turns them into lethe
// errors, so none crosses into the C code.
//
// Compile choices: JSON schemas and json_object compile without free
// whitespace and with Python's separators (", " / ": "), so the output is
// bounded by the schema, looks like json.dumps, and a forced tool call
// re-renders to the same text through the chat template's tojson; strict
// mode (no properties or items the schema does not name). Structural tags
// (forced tool calls in the model's own format) are xgrammar's JSON format.
#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#define _Noreturn [[noreturn]] /* C11's spelling in core/status.h */
extern "C" {
#include "grammar/grammar.h"
}

struct lethe_gcompiler {
    xgrammar::TokenizerInfo info;
    xgrammar::GrammarCompiler compiler;
    int32_t vocab_size;
    lethe_gcompiler(xgrammar::TokenizerInfo i, int threads)
        : info(i), compiler(i, threads, /*cache_enabled=*/true, /*max_memory_bytes=*/int64_t(256) << 20) {}
};

struct lethe_grammar {
    std::atomic<int> refs{1};
    xgrammar::CompiledGrammar compiled;
    int32_t vocab_size;
    explicit lethe_grammar(xgrammar::CompiledGrammar c, int32_t v) : compiled(std::move(c)), vocab_size(v) {}
};

struct lethe_gmatcher {
    lethe_grammar *g;
    xgrammar::GrammarMatcher m;
    lethe_gmatcher(lethe_grammar *gr, xgrammar::GrammarMatcher mm) : g(gr), m(std::move(mm)) {}
};

static lethe_status fail(lethe_status s, const char *what, const std::exception &ex) {
    std::string msg = ex.what();
    if (msg.size() > 400) msg = msg.substr(0, 400) + "...";
    return lethe_errorf(s, "%s: %s", what, msg.c_str());
}

extern "C" lethe_status lethe_gcompiler_create(const char *const *tokens, const size_t *lens, int32_t n_tokens,
                                               int32_t vocab_size, const int32_t *stop_ids, int32_t n_stop,
                                               lethe_gcompiler **out) {
    *out = nullptr;
    try {
        std::vector<std::string> vocab((size_t)n_tokens);
        for (int32_t i = 0; i < n_tokens; i++) vocab[(size_t)i].assign(tokens[i] ? tokens[i] : "", lens[i]);
        std::vector<int32_t> stops(stop_ids, stop_ids + n_stop);
        xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, vocab_size, stops, false);
        *out = new lethe_gcompiler(info, 2);
        (*out)->vocab_size = vocab_size;
        return LETHE_OK;
    } catch (const std::exception &ex) {
        return fail(LETHE_ERR_BACKEND, "xgrammar: cannot index the vocabulary", ex);
    }
}

extern "C" void lethe_gcompiler_free(lethe_gcompiler *c) { delete c; }

extern "C" lethe_status lethe_gcompiler_compile(lethe_gcompiler *c, lethe_grammar_kind kind, const char *spec,
                                                lethe_grammar **out) {
    *out = nullptr;
    const std::optional<std::pair<std::string, std::string>> seps = std::make_pair(", ", ": ");
    try {
        xgrammar::CompiledGrammar cg(xgrammar::NullObj{});
        switch (kind) {
        case LETHE_GRAMMAR_JSON_OBJECT:
            cg = c->compiler.CompileJSONSchema("{\"type\": \"object\"}", false, std::nullopt, seps, true);
            break;
        case LETHE_GRAMMAR_JSON_SCHEMA:
            cg = c->compiler.CompileJSONSchema(spec, false, std::nullopt, seps, true);
            break;
        case LETHE_GRAMMAR_EBNF: cg = c->compiler.CompileGrammar(std::string(spec), "root"); break;
        case LETHE_GRAMMAR_REGEX: cg = c->compiler.CompileRegex(spec); break;
        case LETHE_GRAMMAR_STRUCTURAL_TAG: cg = c->compiler.CompileStructuralTag(spec); break;
        default: return lethe_errorf(LETHE_ERR_INVALID, "unknown grammar kind %d", (int)kind);
        }
        *out = new lethe_grammar(cg, c->vocab_size);
        return LETHE_OK;
    } catch (const std::exception &ex) {
        return fail(LETHE_ERR_INVALID, "the grammar does not compile (xgrammar)", ex);
    }
}

extern "C" lethe_grammar *lethe_grammar_ref(lethe_grammar *g) {
    if (g) g->refs.fetch_add(1);
    return g;
}

extern "C" void lethe_grammar_free(lethe_grammar *g) {
    if (g && g->refs.fetch_sub(1) == 1) delete g;
}

extern "C" int32_t lethe_gmask_words(int32_t vocab_size) { return (vocab_size + 31) / 32; }

extern "C" lethe_status lethe_gmatcher_create(lethe_grammar *g, lethe_gmatcher **out) {
    *out = nullptr;
    try {
        *out = new lethe_gmatcher(lethe_grammar_ref(g), xgrammar::GrammarMatcher(g->compiled));
        return LETHE_OK;
    } catch (const std::exception &ex) {
        lethe_grammar_free(g);
        return fail(LETHE_ERR_BACKEND, "xgrammar: cannot start a matcher", ex);
    }
}

extern "C" void lethe_gmatcher_free(lethe_gmatcher *m) {
    if (!m) return;
    lethe_grammar *g = m->g;
    delete m;
    lethe_grammar_free(g);
}

extern "C" void lethe_gmatcher_fill_mask(lethe_gmatcher *m, uint32_t *mask) {
    int64_t shape[1] = {lethe_gmask_words(m->g->vocab_size)};
    DLTensor t;
    std::memset(&t, 0, sizeof(t));
    t.data = mask;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = xgrammar::GetBitmaskDLType();
    t.shape = shape;
    try {
        m->m.FillNextTokenBitmask(&t, 0);
    } catch (const std::exception &ex) {
        /* a matcher that cannot continue: only its stop tokens stay allowed */
        std::memset(mask, 0, (size_t)shape[0] * sizeof(uint32_t));
        for (int32_t s : m->m.GetStopTokenIds()) mask[s / 32] |= 1u << (s % 32);
    }
}

extern "C" bool lethe_gmatcher_accept(lethe_gmatcher *m, int32_t token) {
    try {
        return m->m.AcceptToken(token);
    } catch (const std::exception &) {
        return false;
    }
}

extern "C" bool lethe_gmatcher_terminated(const lethe_gmatcher *m) { return m->m.IsTerminated(); }

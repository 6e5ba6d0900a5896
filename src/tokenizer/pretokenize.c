/* pretokenize.c - splitting text into words before BPE, through PCRE2.
 *
 * A pre-tokenizer is a sequence of regexes; each one splits every piece the
 * previous one produced, keeping both the matches and the text between them
 * (HF tokenizers' Split with behavior "Isolated"; ByteLevel(use_regex) is the
 * GPT-2 regex applied the same way; Digits(individual_digits) is \p{N}).
 * Each piece is matched as its own subject, so look-arounds like \s+(?!\S)
 * see only that piece, as in HF.
 *
 * Built-in regexes by GGUF tokenizer.ggml.pre:
 *   gpt2            GPT-2 (ByteLevel)
 *   smollm          \p{N} then GPT-2: SmolLM/SmolLM2's HF pre-tokenizer is
 *                   Sequence[Digits(individual_digits), ByteLevel]
 *   llama-bpe       Llama-3 (numbers in groups of up to 3)
 *   qwen2           Qwen2/Qwen3 (single digits), with NFC normalization
 * Patterns compile with PCRE2_UTF | PCRE2_UCP (Unicode \s, \p{L}, \p{N}) and
 * PCRE2_MATCH_INVALID_UTF, so bytes that are not UTF-8 never match and end up
 * in the gaps (they still round-trip through byte-level BPE). JIT is used
 * when available, with the interpreter as fallback.
 *
 * \s: HF's Oniguruma reads it as the Unicode White_Space property, while
 * PCRE2's UCP \s also takes U+180E MONGOLIAN VOWEL SEPARATOR (in its \h
 * list). Patterns are therefore rewritten before compiling: \s becomes the
 * explicit White_Space set (inside or outside a character class) and \S
 * outside a class its negation. */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "tokenizer/tok_internal.h"

const char *const TOK_RE_GPT2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char *const TOK_RE_LLAMA3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char *const TOK_RE_QWEN2 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const RE_DIGIT = "\\p{N}";

/* Unicode White_Space, as class members */
static const char WS_MEMBERS[] =
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

/* Copies pattern with \s / \S replaced (see the top comment). Tracks
 * escapes and character classes, including a leading ']' in a class. */
static char *rewrite_ws(const char *pat) {
    size_t n = strlen(pat), cap = (n + 1) * (sizeof(WS_MEMBERS) + 4), o = 0; /* worst case: every 2 chars grow */
    char *out = lethe_xmalloc(cap);
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = pat[i];
        if (c == '\\' && i + 1 < n) {
            char e = pat[i + 1];
            const char *rep = NULL;
            char buf[sizeof(WS_MEMBERS) + 4];
            if (e == 's') {
                snprintf(buf, sizeof(buf), in_class ? "%s" : "[%s]", WS_MEMBERS);
                rep = buf;
            } else if (e == 'S' && !in_class) {
                snprintf(buf, sizeof(buf), "[^%s]", WS_MEMBERS);
                rep = buf;
            }
            if (rep) {
                size_t k = strlen(rep);
                memcpy(out + o, rep, k);
                o += k;
            } else {
                out[o++] = c;
                out[o++] = e;
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            out[o++] = c;
            if (i + 1 < n && pat[i + 1] == '^') out[o++] = pat[++i];
            if (i + 1 < n && pat[i + 1] == ']') out[o++] = pat[++i]; /* literal ']' first in a class */
            continue;
        }
        if (in_class && c == ']') in_class = false;
        out[o++] = c;
    }
    out[o] = '\0';
    return out;
}

lethe_status tok_add_pre_regex(lethe_tokenizer *t, const char *pattern_in) {
    if (t->n_pre >= TOK_MAX_PRE_STEPS)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "tokenizer: more than %d pre-tokenizer steps",
                            TOK_MAX_PRE_STEPS);
    int err;
    PCRE2_SIZE erroff;
    char *pattern = rewrite_ws(pattern_in);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &erroff, NULL);
    free(pattern);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        return lethe_errorf(LETHE_ERR_FORMAT, "tokenizer: pre-tokenizer regex /%s/ does not compile: %s",
                            pattern_in, (const char *)msg);
    }
    if (pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) != 0)
        LOG_DEBUG("tokenizer: PCRE2 JIT unavailable, using the interpreter");
    t->pre[t->n_pre++] = re;
    return LETHE_OK;
}

lethe_status tok_set_pre_by_name(lethe_tokenizer *t, const char *name) {
    lethe_status st;
    snprintf(t->pre_name, sizeof(t->pre_name), "%s", name);
    if (!strcmp(name, "gpt2") || !strcmp(name, "gpt-2")) return tok_add_pre_regex(t, TOK_RE_GPT2);
    if (!strcmp(name, "smollm")) {
        if ((st = tok_add_pre_regex(t, RE_DIGIT)) != LETHE_OK) return st;
        return tok_add_pre_regex(t, TOK_RE_GPT2);
    }
    if (!strcmp(name, "llama-bpe") || !strcmp(name, "llama3")) {
        t->ignore_merges = true; /* the Llama-3 tokenizer.json sets model.ignore_merges */
        return tok_add_pre_regex(t, TOK_RE_LLAMA3);
    }
    if (!strcmp(name, "qwen2")) {
        t->norm = TOK_NORM_NFC; /* Qwen2/3's tokenizer.json normalizer; HF applies it, so do we */
        return tok_add_pre_regex(t, TOK_RE_QWEN2);
    }
    return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                        "tokenizer: pre-tokenizer \"%s\" is not supported (supported: gpt2, smollm, "
                        "llama-bpe, qwen2)", name);
}

static bool spans_push(tok_spans *s, size_t off, size_t len) {
    if (len == 0) return true;
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        tok_span *v = realloc(s->v, cap * sizeof(tok_span));
        if (!v) return false;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = (tok_span){off, len};
    return true;
}

/* Splits s[off..off+len) with re, Isolated behaviour. */
static lethe_status split_one(const pcre2_code *re, const char *s, size_t off, size_t len,
                              tok_spans *out, pcre2_match_data *md) {
    PCRE2_SPTR subj = (PCRE2_SPTR)(s + off);
    size_t pos = 0, last = 0;
    uint32_t opts = 0;
    while (pos < len) {
        int rc = pcre2_match(re, subj, len, pos, opts, md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !(opts & PCRE2_NO_JIT)) {
            opts |= PCRE2_NO_JIT; /* very long runs: retry with the interpreter's heap stack */
            continue;
        }
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            return lethe_errorf(LETHE_ERR_INVALID, "tokenizer: regex match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* empty match: step over one byte (never happens with our patterns) */
            pos = ms + 1;
            continue;
        }
        if (!spans_push(out, off + last, ms - last) || !spans_push(out, off + ms, me - ms))
            return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: out of memory");
        last = pos = me;
    }
    if (!spans_push(out, off + last, len - last)) return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: out of memory");
    return LETHE_OK;
}

lethe_status tok_pretokenize(const lethe_tokenizer *t, const char *s, size_t n, tok_spans *out,
                             tok_spans *scratch, pcre2_match_data *md) {
    if (t->n_pre == 0) {
        if (!spans_push(out, 0, n)) return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: out of memory");
        return LETHE_OK;
    }
    /* ping-pong between scratch and out; the last step writes into out */
    tok_spans *bufs[2] = {scratch, out};
    int first = (t->n_pre % 2 == 0) ? 0 : 1; /* step s writes into bufs[(first + s) % 2] */
    size_t out_base = out->n;
    tok_span whole = {0, n};
    tok_spans src = {&whole, 1, 1};
    for (int step = 0; step < t->n_pre; step++) {
        tok_spans *dst = bufs[(first + step) % 2];
        size_t base = dst == out ? out_base : 0;
        dst->n = base;
        for (size_t i = 0; i < src.n; i++) {
            lethe_status st = split_one(t->pre[step], s, src.v[i].off, src.v[i].len, dst, md);
            if (st != LETHE_OK) return st;
        }
        src = (tok_spans){dst->v + base, dst->n - base, 0};
    }
    return LETHE_OK;
}

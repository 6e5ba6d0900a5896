/* tok_internal.h - the tokenizer's private state, shared by its .c files.
 *
 * A lethe_tokenizer holds:
 *  - the token table: per id the stored piece (byte-level "unicode" form as
 *    written in GGUF / tokenizer.json, e.g. "Ġthe") and its decoded raw
 *    bytes (" the"), both in one string arena addressed by offsets;
 *  - hash maps piece -> id (BPE vocabulary; all tokens) and
 *    (left id, right id) -> (merge rank, merged id);
 *  - the added / special tokens matched in raw text before pre-tokenization;
 *  - the pre-tokenizer: a sequence of PCRE2 regex splits (HF "Isolated"
 *    behaviour: matches and the gaps between them both become pieces);
 *  - the normalizer (none or NFC) and the special ids.
 * Loaders (vocab_hf.c, vocab_gguf.c) fill it through the tok_* builder
 * functions below; everything is read-only after tok_finalize(), so one
 * tokenizer can be used from several threads at once. */
#ifndef LETHE_TOK_INTERNAL_H
#define LETHE_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "tokenizer/tokenizer.h"

enum {
    TOK_ATTR_BPE = 1,      /* part of the BPE vocabulary (reachable by merges) */
    TOK_ATTR_ADDED = 2,    /* matched verbatim in text before pre-tokenization */
    TOK_ATTR_SPECIAL = 4,  /* control token: matched only with parse_special; skip_special drops it */
    TOK_ATTR_LSTRIP = 8,   /* added token swallows whitespace on its left */
    TOK_ATTR_RSTRIP = 16,  /* ... and on its right */
    TOK_ATTR_SET = 32,     /* the id has a token at all (vocabularies may have holes) */
};

/* open-addressing map from a token's stored piece to its id */
typedef struct tok_strmap {
    uint32_t mask;    /* capacity - 1 (power of two) */
    int32_t *slots;   /* id, or -1 when empty */
} tok_strmap;

/* open-addressing map (left id, right id) -> merge */
typedef struct tok_pairmap {
    uint32_t mask;
    uint64_t *keys;   /* (left << 32) | right; UINT64_MAX when empty */
    int32_t *rank;
    int32_t *merged;
} tok_pairmap;

typedef struct tok_added {
    int32_t id;
    uint32_t off, len;  /* text in the arena (raw, as matched in input) */
} tok_added;

#define TOK_MAX_PRE_STEPS 8
#define TOK_MAX_EOG 16

typedef enum tok_norm { TOK_NORM_NONE = 0, TOK_NORM_NFC } tok_norm;

struct lethe_tokenizer {
    int32_t n_vocab;
    /* arena of NUL-terminated strings */
    char *arena;
    size_t arena_len, arena_cap;
    uint32_t *piece_off, *piece_len;   /* [n_vocab] stored form */
    uint32_t *bytes_off, *bytes_len;   /* [n_vocab] decoded bytes */
    uint8_t *attr;                     /* [n_vocab] TOK_ATTR_* */
    uint32_t max_token_bytes;

    tok_strmap bpe_map;   /* BPE vocabulary pieces */
    tok_strmap all_map;   /* every token's stored piece (find_token) */
    tok_pairmap merges;
    int32_t n_merges;
    int32_t byte_id[256]; /* id of the single-byte piece, -1 if absent */
    bool ignore_merges;   /* HF BPE ignore_merges (Llama-3): a whole word in the vocab wins */
    int32_t unk_id;

    tok_added *added;     /* sorted by first byte, then length descending */
    int32_t n_added;
    int32_t added_first[257]; /* added[added_first[b] .. added_first[b+1]) start with byte b */

    tok_norm norm;
    pcre2_code *pre[TOK_MAX_PRE_STEPS];
    int n_pre;
    bool prefix_space;    /* ByteLevel add_prefix_space: a segment not starting with ' ' gets one */

    int32_t bos, eos;
    int32_t eog[TOK_MAX_EOG];
    int n_eog;
    bool add_bos;
    char *chat_template;
    char pre_name[32];    /* for messages: "gpt2", "smollm", "llama-bpe", "qwen2", "hf" */
};

/* GPT-2's byte <-> unicode mapping (bytes_to_unicode): printable bytes map to
 * themselves, the rest to U+0100.. in byte order. */
uint32_t tok_byte_to_cp(uint8_t b);
int tok_cp_to_byte(uint32_t cp); /* -1 if cp is not in the image */

/* UTF-8 helpers: encode cp (<= 4 bytes) into out; decode one valid sequence
 * at s (returns its length, 0 if invalid or truncated). */
int tok_utf8_put(uint32_t cp, char *out);
int tok_utf8_get(const char *s, size_t n, uint32_t *cp);

/* builder (loaders) */
lethe_status tok_create(int32_t n_vocab, lethe_tokenizer **out);
uint32_t tok_arena_add(lethe_tokenizer *t, const char *s, size_t len); /* returns offset */
void tok_set_token(lethe_tokenizer *t, int32_t id, const char *piece, size_t len, uint8_t attr);
/* builds the piece maps; call after every tok_set_token and before tok_add_merge */
lethe_status tok_build_maps(lethe_tokenizer *t);
/* rank = order of the merge; missing pieces are counted in *n_skipped */
void tok_add_merge(lethe_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                   int32_t rank, int32_t *n_skipped);
lethe_status tok_reserve_merges(lethe_tokenizer *t, size_t n);
/* pre-tokenizer regex steps, applied in order */
lethe_status tok_add_pre_regex(lethe_tokenizer *t, const char *pattern);
/* the built-in pre-tokenizers by GGUF tokenizer.ggml.pre name */
lethe_status tok_set_pre_by_name(lethe_tokenizer *t, const char *name);
extern const char *const TOK_RE_GPT2, *const TOK_RE_LLAMA3, *const TOK_RE_QWEN2;
/* decoded bytes, added-token index, byte ids, eog list; last builder call */
lethe_status tok_finalize(lethe_tokenizer *t);
void tok_add_eog(lethe_tokenizer *t, int32_t id);

int32_t tok_strmap_get(const lethe_tokenizer *t, const tok_strmap *m, const char *s, size_t n);

/* encoding internals */
typedef struct tok_ids {
    int32_t *v;
    size_t n, cap;
    bool oom;
} tok_ids;
void tok_ids_push(tok_ids *ids, int32_t id);

typedef struct tok_span { size_t off, len; } tok_span;
typedef struct tok_spans {
    tok_span *v;
    size_t n, cap;
} tok_spans;
/* Splits s[0..n) by the pre-tokenizer steps into pieces (appended to out). */
lethe_status tok_pretokenize(const lethe_tokenizer *t, const char *s, size_t n, tok_spans *out,
                             tok_spans *scratch, pcre2_match_data *md);

typedef struct tok_bpe_scratch tok_bpe_scratch;
tok_bpe_scratch *tok_bpe_scratch_new(void);
void tok_bpe_scratch_free(tok_bpe_scratch *s);
/* BPE-encodes one pre-tokenized word (raw bytes), appending ids. Returns -1,
 * or the first byte value (0-255) that has no piece and no unk token to stand
 * for it: the caller refuses the text instead of dropping the byte. */
int tok_bpe_word(const lethe_tokenizer *t, const char *w, size_t n, tok_ids *out,
                 tok_bpe_scratch *s);

/* NFC normalization (normalize.c). *out is malloc'd; returns NOMEM / FORMAT. */
lethe_status tok_nfc(const char *s, size_t n, char **out, size_t *out_n);
/* true when s cannot change under NFC (no code point >= U+0300) */
bool tok_nfc_trivial(const char *s, size_t n);

#endif /* LETHE_TOK_INTERNAL_H */

/* tokenizer.c - encoding text to ids, loading by model path, accessors.
 *
 * Encoding, as HF tokenizers does it for byte-level BPE:
 *   1. added tokens are cut out of the raw text (leftmost, longest first);
 *      special ones only when parse_special, non-special ("user defined",
 *      e.g. Qwen's <tool_call>) always;
 *   2. each remaining segment is normalized (NFC when the tokenizer asks),
 *      gets a leading space if ByteLevel add_prefix_space, and is split by
 *      the pre-tokenizer regexes;
 *   3. each piece is BPE-encoded (bpe.c). Repeated words within one call
 *      are served from a small per-call cache.
 * Nothing here mutates the tokenizer, so concurrent calls are safe. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/log.h"
#include "core/util.h"
#include "model/gguf.h"
#include "tokenizer/tok_internal.h"

void tok_ids_push(tok_ids *ids, int32_t id) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 64;
        int32_t *v = realloc(ids->v, cap * sizeof(int32_t));
        if (!v) {
            ids->oom = true;
            return;
        }
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
}

/* ---- per-call word cache: word bytes -> ids, open addressing ---- */

#define WC_SLOTS 4096
#define WC_MAX_WORD 64
typedef struct word_cache {
    uint64_t hash[WC_SLOTS];
    uint32_t wlen[WC_SLOTS]; /* 0 = empty */
    uint32_t ids_off[WC_SLOTS], ids_n[WC_SLOTS];
    char word[WC_SLOTS][WC_MAX_WORD];
    tok_ids store;
    int used;
} word_cache;

typedef struct enc_ctx {
    const lethe_tokenizer *t;
    tok_ids *out;
    tok_spans spans, scratch;
    pcre2_match_data *md;
    tok_bpe_scratch *bpe;
    word_cache *wc;
} enc_ctx;

static lethe_status no_token(int byte) {
    return lethe_errorf(LETHE_ERR_INVALID,
                        "byte 0x%02x has no token in the vocabulary and the tokenizer has no unknown token",
                        byte);
}

static lethe_status encode_word(enc_ctx *c, const char *w, size_t n) {
    if (n > WC_MAX_WORD || !c->wc) {
        int bad = tok_bpe_word(c->t, w, n, c->out, c->bpe);
        return bad >= 0 ? no_token(bad) : LETHE_OK;
    }
    word_cache *wc = c->wc;
    uint64_t h = lethe_hash64(w, n, 7);
    uint32_t slot = (uint32_t)h & (WC_SLOTS - 1);
    for (int probe = 0; probe < 8; probe++, slot = (slot + 1) & (WC_SLOTS - 1)) {
        if (wc->wlen[slot] == 0) break;
        if (wc->hash[slot] == h && wc->wlen[slot] == n && memcmp(wc->word[slot], w, n) == 0) {
            for (uint32_t i = 0; i < wc->ids_n[slot]; i++) tok_ids_push(c->out, wc->store.v[wc->ids_off[slot] + i]);
            return LETHE_OK;
        }
    }
    size_t before = c->out->n;
    int bad = tok_bpe_word(c->t, w, n, c->out, c->bpe);
    if (bad >= 0) return no_token(bad);
    if (c->out->oom || wc->used >= WC_SLOTS / 2 || wc->wlen[slot] != 0) return LETHE_OK;
    wc->hash[slot] = h;
    wc->wlen[slot] = (uint32_t)n;
    memcpy(wc->word[slot], w, n);
    wc->ids_off[slot] = (uint32_t)wc->store.n;
    wc->ids_n[slot] = (uint32_t)(c->out->n - before);
    for (size_t i = before; i < c->out->n; i++) tok_ids_push(&wc->store, c->out->v[i]);
    if (wc->store.oom) wc->used = WC_SLOTS; /* stop caching */
    else wc->used++;
    return LETHE_OK;
}

/* normalize, prefix-space, pre-tokenize and BPE one segment without added tokens */
static lethe_status encode_segment(enc_ctx *c, const char *s, size_t n) {
    if (n == 0) return LETHE_OK;
    const lethe_tokenizer *t = c->t;
    char *norm = NULL;
    size_t nn = n;
    if (t->norm == TOK_NORM_NFC && !tok_nfc_trivial(s, n)) {
        lethe_status st = tok_nfc(s, n, &norm, &nn);
        if (st != LETHE_OK) return st;
        s = norm;
    }
    char *pref = NULL;
    if (t->prefix_space && s[0] != ' ') {
        pref = malloc(nn + 1);
        if (!pref) {
            free(norm);
            return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: out of memory");
        }
        pref[0] = ' ';
        memcpy(pref + 1, s, nn);
        s = pref;
        nn++;
    }
    c->spans.n = 0;
    lethe_status st = tok_pretokenize(t, s, nn, &c->spans, &c->scratch, c->md);
    for (size_t i = 0; st == LETHE_OK && i < c->spans.n; i++) st = encode_word(c, s + c->spans.v[i].off, c->spans.v[i].len);
    free(norm);
    free(pref);
    return st;
}

static bool is_ws(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f'; }

lethe_status lethe_tokenize(const lethe_tokenizer *t, const char *text, size_t len, bool add_bos,
                            bool parse_special, int32_t **ids, int32_t *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    if (!t || (!text && len > 0)) return lethe_errorf(LETHE_ERR_INVALID, "tokenize: NULL argument");
    if (len > (size_t)INT32_MAX / 2) return lethe_errorf(LETHE_ERR_INVALID, "tokenize: text of %zu bytes is too long", len);
    tok_ids out = {0};
    enc_ctx c = {.t = t, .out = &out};
    c.md = t->n_pre > 0 ? pcre2_match_data_create_from_pattern(t->pre[0], NULL) : NULL;
    for (int i = 1; c.md && i < t->n_pre; i++) {
        /* one match-data sized for the pattern with the most groups */
        uint32_t n0 = pcre2_get_ovector_count(c.md), cnt = 0;
        pcre2_pattern_info(t->pre[i], PCRE2_INFO_CAPTURECOUNT, &cnt);
        if (cnt + 1 > n0) {
            pcre2_match_data_free(c.md);
            c.md = pcre2_match_data_create(cnt + 1, NULL);
        }
    }
    c.bpe = tok_bpe_scratch_new();
    c.wc = len >= 256 ? malloc(sizeof(word_cache)) : NULL; /* worth it for long texts only */
    if (c.wc) {
        memset(c.wc->wlen, 0, sizeof(c.wc->wlen));
        c.wc->store = (tok_ids){0};
        c.wc->used = 0;
    }
    lethe_status st = LETHE_OK;
    if (t->n_pre > 0 && !c.md) st = lethe_errorf(LETHE_ERR_NOMEM, "tokenize: out of memory");

    if (add_bos && t->bos >= 0) tok_ids_push(&out, t->bos);
    size_t seg = 0, pos = 0;
    while (st == LETHE_OK && pos < len) {
        unsigned char b = (unsigned char)text[pos];
        const tok_added *hit = NULL;
        for (int32_t j = t->added_first[b]; j < t->added_first[b + 1]; j++) {
            const tok_added *a = &t->added[j];
            if (!parse_special && (t->attr[a->id] & TOK_ATTR_SPECIAL)) continue;
            if (a->len <= len - pos && memcmp(t->arena + a->off, text + pos, a->len) == 0) {
                hit = a;
                break;
            }
        }
        if (!hit) {
            pos++;
            continue;
        }
        size_t seg_end = pos;
        if (t->attr[hit->id] & TOK_ATTR_LSTRIP)
            while (seg_end > seg && is_ws(text[seg_end - 1])) seg_end--;
        st = encode_segment(&c, text + seg, seg_end - seg);
        tok_ids_push(&out, hit->id);
        pos += hit->len;
        if (t->attr[hit->id] & TOK_ATTR_RSTRIP)
            while (pos < len && is_ws(text[pos])) pos++;
        seg = pos;
    }
    if (st == LETHE_OK) st = encode_segment(&c, text + seg, len - seg);

    if (c.md) pcre2_match_data_free(c.md);
    tok_bpe_scratch_free(c.bpe);
    free(c.spans.v);
    free(c.scratch.v);
    if (c.wc) free(c.wc->store.v);
    free(c.wc);
    if (st == LETHE_OK && out.oom) st = lethe_errorf(LETHE_ERR_NOMEM, "tokenize: out of memory");
    if (st != LETHE_OK) {
        free(out.v);
        return st;
    }
    *ids = out.v ? out.v : lethe_xmalloc(sizeof(int32_t));
    *n_ids = (int32_t)out.n;
    return LETHE_OK;
}

/* ---- accessors ---- */

int32_t lethe_tokenizer_n_vocab(const lethe_tokenizer *t) { return t->n_vocab; }
int32_t lethe_tokenizer_bos(const lethe_tokenizer *t) { return t->bos; }
int32_t lethe_tokenizer_eos(const lethe_tokenizer *t) { return t->eos; }
bool lethe_tokenizer_adds_bos(const lethe_tokenizer *t) { return t->add_bos && t->bos >= 0; }
const char *lethe_tokenizer_chat_template(const lethe_tokenizer *t) { return t->chat_template; }

bool lethe_tokenizer_is_eog(const lethe_tokenizer *t, int32_t id) {
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return true;
    return false;
}

bool lethe_tokenizer_is_special(const lethe_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && (t->attr[id] & TOK_ATTR_SPECIAL);
}

int32_t lethe_tokenizer_find_token(const lethe_tokenizer *t, const char *piece) {
    if (!t || !piece) return -1;
    return tok_strmap_get(t, &t->all_map, piece, strlen(piece));
}

void lethe_tokenizer_free(lethe_tokenizer *t) {
    if (!t) return;
    free(t->arena);
    free(t->piece_off);
    free(t->piece_len);
    free(t->bytes_off);
    free(t->bytes_len);
    free(t->attr);
    free(t->bpe_map.slots);
    free(t->all_map.slots);
    free(t->merges.keys);
    free(t->merges.rank);
    free(t->merges.merged);
    free(t->added);
    for (int i = 0; i < t->n_pre; i++) pcre2_code_free(t->pre[i]);
    free(t->chat_template);
    free(t);
}

/* ---- loading by model path ---- */

static bool file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

static bool has_gguf_magic(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char m[4] = {0};
    size_t n = fread(m, 1, 4, f);
    fclose(f);
    return n == 4 && memcmp(m, "GGUF", 4) == 0;
}

lethe_status lethe_tokenizer_load(const char *model_path, lethe_tokenizer **out) {
    *out = NULL;
    if (!model_path) return lethe_errorf(LETHE_ERR_INVALID, "tokenizer: no model path");
    struct stat sb;
    if (stat(model_path, &sb) != 0) return lethe_errorf(LETHE_ERR_IO, "%s: no such file or folder", model_path);
    if (S_ISREG(sb.st_mode) && has_gguf_magic(model_path)) {
        lethe_gguf g;
        lethe_status st = lethe_gguf_open(model_path, &g);
        if (st != LETHE_OK) return st;
        st = lethe_tokenizer_from_gguf(&g, out);
        lethe_gguf_close(&g);
        return st;
    }
    /* a folder, or a file inside one (config.json of dummy weights): look beside it */
    size_t n = strlen(model_path);
    char *dir = lethe_xmalloc(n + 2);
    memcpy(dir, model_path, n + 1);
    if (!S_ISDIR(sb.st_mode)) {
        char *slash = strrchr(dir, '/');
        if (slash) slash[1] = '\0';
        else strcpy(dir, ".");
    }
    size_t dn = strlen(dir);
    char *tj = lethe_xmalloc(dn + 32), *tc = lethe_xmalloc(dn + 32);
    const char *sep = (dn > 0 && dir[dn - 1] == '/') ? "" : "/";
    snprintf(tj, dn + 32, "%s%stokenizer.json", dir, sep);
    snprintf(tc, dn + 32, "%s%stokenizer_config.json", dir, sep);
    lethe_status st;
    if (!file_exists(tj))
        st = lethe_errorf(LETHE_ERR_NOT_FOUND,
                          "%s: no tokenizer (no tokenizer.json in %s); a model without one (dummy weights) "
                          "takes token ids instead of text", model_path, dir);
    else
        st = lethe_tokenizer_from_hf(tj, file_exists(tc) ? tc : NULL, out);
    free(dir);
    free(tj);
    free(tc);
    return st;
}

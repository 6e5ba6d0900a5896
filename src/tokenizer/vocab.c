/* vocab.c - building a tokenizer's tables: token pieces, the piece -> id and
 * (pair) -> merge hash maps, GPT-2's byte <-> unicode mapping, the added-token
 * index and the end-of-generation set.
 *
 * Loaders call tok_create, tok_set_token for every id, tok_build_maps,
 * tok_add_merge in rank order, the pre-tokenizer setters, then tok_finalize.
 * The BPE pieces are stored as written in the vocabulary (byte-level form:
 * every byte is one code point, e.g. ' ' -> 'Ġ' U+0120); the raw bytes of a
 * token follow the HF ByteLevel decoder rule: if every code point of the
 * piece is in the byte map's image, the bytes are the inverse-mapped ones,
 * else the piece's own UTF-8 (e.g. added tokens written with a space). */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "tokenizer/tok_internal.h"

/* ---- GPT-2 bytes_to_unicode ---- */

static bool byte_is_printable(uint8_t b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

/* The 68 non-printable bytes are 0x00-0x20, 0x7F-0xA0 and 0xAD, mapped in
 * that order to U+0100..U+0143. */
uint32_t tok_byte_to_cp(uint8_t b) {
    if (byte_is_printable(b)) return b;
    if (b <= 0x20) return 256u + b;
    if (b >= 0x7F && b <= 0xA0) return 256u + 33u + (uint32_t)(b - 0x7F);
    return 256u + 67u; /* 0xAD */
}

int tok_cp_to_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable((uint8_t)cp) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 67) return (int)(cp - 256 - 33 + 0x7F);
    if (cp == 256 + 67) return 0xAD;
    return -1;
}

int tok_utf8_put(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = (unsigned char)(0xC0 | (cp >> 6)); o[1] = (unsigned char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

int tok_utf8_get(const char *s, size_t n, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0) return 0;
    unsigned char c = u[0];
    if (c < 0x80) { *cp = c; return 1; }
    int len;
    uint32_t v;
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) { len = 2; v = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3; v = c & 0x0F;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4; v = c & 0x07;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if ((size_t)len > n) return 0;
    for (int i = 1; i < len; i++) {
        unsigned char d = u[i];
        if (i == 1 ? (d < lo || d > hi) : (d < 0x80 || d > 0xBF)) return 0;
        v = (v << 6) | (d & 0x3F);
    }
    *cp = v;
    return len;
}

/* ---- arena and token table ---- */

lethe_status tok_create(int32_t n_vocab, lethe_tokenizer **out) {
    if (n_vocab <= 0 || n_vocab > (1 << 24))
        return lethe_errorf(LETHE_ERR_FORMAT, "tokenizer: implausible vocabulary size %d", n_vocab);
    lethe_tokenizer *t = lethe_xcalloc(1, sizeof(*t));
    t->n_vocab = n_vocab;
    size_t n = (size_t)n_vocab;
    t->piece_off = calloc(n, sizeof(uint32_t));
    t->piece_len = calloc(n, sizeof(uint32_t));
    t->bytes_off = calloc(n, sizeof(uint32_t));
    t->bytes_len = calloc(n, sizeof(uint32_t));
    t->attr = calloc(n, 1);
    t->arena_cap = n * 16 + 1024;
    t->arena = malloc(t->arena_cap);
    if (!t->piece_off || !t->piece_len || !t->bytes_off || !t->bytes_len || !t->attr || !t->arena) {
        lethe_tokenizer_free(t);
        return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: cannot allocate tables for %d tokens", n_vocab);
    }
    t->arena[0] = '\0';
    t->arena_len = 1; /* offset 0 is the empty string */
    t->bos = t->eos = t->unk_id = -1;
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    snprintf(t->pre_name, sizeof(t->pre_name), "none");
    *out = t;
    return LETHE_OK;
}

uint32_t tok_arena_add(lethe_tokenizer *t, const char *s, size_t len) {
    if (t->arena_len + len + 1 > t->arena_cap) {
        while (t->arena_len + len + 1 > t->arena_cap) t->arena_cap *= 2;
        LETHE_ASSERT(t->arena_cap < UINT32_MAX);
        t->arena = lethe_xrealloc(t->arena, t->arena_cap);
    }
    uint32_t off = (uint32_t)t->arena_len;
    memcpy(t->arena + off, s, len);
    t->arena[off + len] = '\0';
    t->arena_len += len + 1;
    return off;
}

void tok_set_token(lethe_tokenizer *t, int32_t id, const char *piece, size_t len, uint8_t attr) {
    LETHE_ASSERT(id >= 0 && id < t->n_vocab);
    t->piece_off[id] = tok_arena_add(t, piece, len);
    t->piece_len[id] = (uint32_t)len;
    t->attr[id] = attr | TOK_ATTR_SET;
}

/* ---- maps ---- */

static uint32_t pow2_at_least(size_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static lethe_status strmap_build(lethe_tokenizer *t, tok_strmap *m, uint8_t need_attr) {
    m->mask = pow2_at_least((size_t)t->n_vocab * 2) - 1;
    m->slots = malloc(((size_t)m->mask + 1) * sizeof(int32_t));
    if (!m->slots) return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: cannot allocate hash map");
    memset(m->slots, 0xFF, ((size_t)m->mask + 1) * sizeof(int32_t));
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!(t->attr[id] & need_attr)) continue;
        const char *p = t->arena + t->piece_off[id];
        uint32_t len = t->piece_len[id];
        uint32_t h = (uint32_t)lethe_hash64(p, len, 0) & m->mask;
        for (;; h = (h + 1) & m->mask) {
            int32_t o = m->slots[h];
            if (o < 0) { m->slots[h] = id; break; }
            /* duplicate piece: the first (lowest) id wins, as in a JSON object read in order */
            if (t->piece_len[o] == len && memcmp(t->arena + t->piece_off[o], p, len) == 0) break;
        }
    }
    return LETHE_OK;
}

int32_t tok_strmap_get(const lethe_tokenizer *t, const tok_strmap *m, const char *s, size_t n) {
    if (!m->slots) return -1;
    uint32_t h = (uint32_t)lethe_hash64(s, n, 0) & m->mask;
    for (;; h = (h + 1) & m->mask) {
        int32_t o = m->slots[h];
        if (o < 0) return -1;
        if (t->piece_len[o] == n && memcmp(t->arena + t->piece_off[o], s, n) == 0) return o;
    }
}

lethe_status tok_build_maps(lethe_tokenizer *t) {
    lethe_status st = strmap_build(t, &t->bpe_map, TOK_ATTR_BPE);
    if (st == LETHE_OK) st = strmap_build(t, &t->all_map, TOK_ATTR_SET);
    return st;
}

lethe_status tok_reserve_merges(lethe_tokenizer *t, size_t n) {
    tok_pairmap *m = &t->merges;
    m->mask = pow2_at_least(n * 2 + 1) - 1;
    size_t cap = (size_t)m->mask + 1;
    m->keys = malloc(cap * sizeof(uint64_t));
    m->rank = malloc(cap * sizeof(int32_t));
    m->merged = malloc(cap * sizeof(int32_t));
    if (!m->keys || !m->rank || !m->merged)
        return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: cannot allocate %zu merges", n);
    memset(m->keys, 0xFF, cap * sizeof(uint64_t));
    return LETHE_OK;
}

static uint32_t pair_hash(uint64_t k) {
    k ^= k >> 31;
    k *= 0x9E3779B97F4A7C15ull;
    return (uint32_t)(k >> 32);
}

void tok_add_merge(lethe_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                   int32_t rank, int32_t *n_skipped) {
    tok_pairmap *m = &t->merges;
    LETHE_ASSERT(m->keys && (uint32_t)t->n_merges < m->mask / 2 + 1);
    int32_t ia = tok_strmap_get(t, &t->bpe_map, a, alen);
    int32_t ib = tok_strmap_get(t, &t->bpe_map, b, blen);
    char stackbuf[256];
    char *ab = alen + blen <= sizeof(stackbuf) ? stackbuf : lethe_xmalloc(alen + blen);
    memcpy(ab, a, alen);
    memcpy(ab + alen, b, blen);
    int32_t im = tok_strmap_get(t, &t->bpe_map, ab, alen + blen);
    if (ab != stackbuf) free(ab);
    if (ia < 0 || ib < 0 || im < 0) {
        (*n_skipped)++;
        return;
    }
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    for (uint32_t h = pair_hash(key) & m->mask;; h = (h + 1) & m->mask) {
        if (m->keys[h] == key) return; /* duplicate merge: the earlier (lower) rank stays */
        if (m->keys[h] == UINT64_MAX) {
            m->keys[h] = key;
            m->rank[h] = rank;
            m->merged[h] = im;
            t->n_merges++;
            return;
        }
    }
}

/* ---- finalize ---- */

void tok_add_eog(lethe_tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab) return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return;
    if (t->n_eog < TOK_MAX_EOG) t->eog[t->n_eog++] = id;
}

static const lethe_tokenizer *g_sort_tok; /* qsort context; finalize runs single-threaded */
static int added_cmp(const void *pa, const void *pb) {
    const tok_added *a = pa, *b = pb;
    unsigned char fa = (unsigned char)g_sort_tok->arena[a->off];
    unsigned char fb = (unsigned char)g_sort_tok->arena[b->off];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1; /* longest first */
    return a->id < b->id ? -1 : a->id > b->id;
}

lethe_status tok_finalize(lethe_tokenizer *t) {
    /* decoded bytes */
    char *buf = lethe_xmalloc(4096);
    size_t buf_cap = 4096;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const char *p = t->arena + t->piece_off[id];
        size_t len = t->piece_len[id], nb = 0;
        if (len > buf_cap) {
            buf_cap = len;
            buf = lethe_xrealloc(buf, buf_cap);
        }
        bool mapped = true;
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            int k = tok_utf8_get(p + i, len - i, &cp);
            int b = k > 0 ? tok_cp_to_byte(cp) : -1;
            if (b < 0) { mapped = false; break; }
            buf[nb++] = (char)b;
            i += (size_t)k;
        }
        if (mapped) {
            t->bytes_off[id] = tok_arena_add(t, buf, nb);
            t->bytes_len[id] = (uint32_t)nb;
        } else {
            t->bytes_off[id] = t->piece_off[id];
            t->bytes_len[id] = (uint32_t)len;
        }
        if (t->bytes_len[id] > t->max_token_bytes) t->max_token_bytes = t->bytes_len[id];
    }
    free(buf);

    /* single-byte pieces */
    for (int b = 0; b < 256; b++) {
        char u[4];
        int k = tok_utf8_put(tok_byte_to_cp((uint8_t)b), u);
        t->byte_id[b] = tok_strmap_get(t, &t->bpe_map, u, (size_t)k);
    }

    /* added tokens, bucketed by first byte, longest first (leftmost-longest matching) */
    int32_t n_added = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & TOK_ATTR_ADDED) && t->piece_len[id] > 0) n_added++;
    t->added = lethe_xcalloc((size_t)n_added + 1, sizeof(tok_added));
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & TOK_ATTR_ADDED) && t->piece_len[id] > 0)
            t->added[t->n_added++] = (tok_added){id, t->piece_off[id], t->piece_len[id]};
    g_sort_tok = t;
    qsort(t->added, (size_t)t->n_added, sizeof(tok_added), added_cmp);
    int32_t j = 0;
    for (int b = 0; b <= 256; b++) {
        while (j < t->n_added && (unsigned char)t->arena[t->added[j].off] < b) j++;
        t->added_first[b] = j;
    }

    /* end of generation: eos plus the end-of-turn markers every family uses */
    static const char *const eog_names[] = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>",
                                            "<|end_of_text|>", "</s>", "<end_of_turn>", "<|end|>"};
    tok_add_eog(t, t->eos);
    for (size_t i = 0; i < LETHE_ARRAY_LEN(eog_names); i++) {
        int32_t id = tok_strmap_get(t, &t->all_map, eog_names[i], strlen(eog_names[i]));
        if (id >= 0 && (t->attr[id] & TOK_ATTR_ADDED)) tok_add_eog(t, id);
    }
    return LETHE_OK;
}

/* detok.c - token ids back to text.
 *
 * lethe_detokenize concatenates the tokens' raw bytes (see vocab.c for how a
 * piece becomes bytes) and keeps invalid UTF-8 as is. The streaming
 * detokenizer (lethe_detok_*) emits only complete UTF-8 characters: a
 * sequence that is still a valid prefix is held in d->pending (at most 3
 * bytes) until the next token completes it; bytes proven invalid become one
 * U+FFFD per maximal ill-formed subpart (the Unicode / WHATWG practice that
 * Python's errors="replace" and Rust's from_utf8_lossy follow). */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "tokenizer/tok_internal.h"

const char *lethe_token_bytes(const lethe_tokenizer *t, int32_t id, size_t *n_bytes) {
    if (!t || id < 0 || id >= t->n_vocab) {
        if (n_bytes) *n_bytes = 0;
        return NULL;
    }
    if (n_bytes) *n_bytes = t->bytes_len[id];
    return t->arena + t->bytes_off[id];
}

size_t lethe_tokenizer_max_token_bytes(const lethe_tokenizer *t) { return t->max_token_bytes; }

char *lethe_detokenize(const lethe_tokenizer *t, const int32_t *ids, int32_t n, bool skip_special) {
    size_t total = 0;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < t->n_vocab) total += t->bytes_len[ids[i]];
    char *s = malloc(total + 1);
    if (!s) return NULL;
    size_t o = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab) continue;
        if (skip_special && (t->attr[id] & TOK_ATTR_SPECIAL)) continue;
        memcpy(s + o, t->arena + t->bytes_off[id], t->bytes_len[id]);
        o += t->bytes_len[id];
    }
    s[o] = '\0';
    return s;
}

void lethe_detok_init(lethe_detok *d, const lethe_tokenizer *t, bool skip_special) {
    memset(d, 0, sizeof(*d));
    d->t = t;
    d->skip_special = skip_special;
}

typedef struct sink {
    char *out;
    size_t cap, n;
} sink;

/* appends whole characters only; drops what does not fit (cap too small) */
static void sink_put(sink *k, const char *s, size_t n) {
    if (k->cap == 0 || k->n + n + 1 > k->cap) return;
    memcpy(k->out + k->n, s, n);
    k->n += n;
    k->out[k->n] = '\0';
}

static const char REPL[3] = {(char)0xEF, (char)0xBF, (char)0xBD}; /* U+FFFD */

/* Length of the sequence a lead byte starts and the allowed range of its
 * second byte; 0 for bytes that cannot start one. */
static int lead_info(unsigned char c, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) {
        if (c == 0xE0) *lo = 0xA0;
        if (c == 0xED) *hi = 0x9F;
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (c == 0xF0) *lo = 0x90;
        if (c == 0xF4) *hi = 0x8F;
        return 4;
    }
    return 0;
}

/* Emits the complete characters of buf; a valid incomplete tail goes back to pending. */
static void emit_utf8(lethe_detok *d, const unsigned char *buf, size_t n, sink *k) {
    size_t i = 0;
    while (i < n) {
        unsigned char lo, hi;
        int len = lead_info(buf[i], &lo, &hi);
        if (len == 0) {
            sink_put(k, REPL, 3);
            i++;
            continue;
        }
        int got = 1;
        bool bad = false;
        while (got < len) {
            if (i + (size_t)got >= n) break;
            unsigned char c = buf[i + (size_t)got];
            bool ok = got == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
            if (!ok) { bad = true; break; }
            got++;
        }
        if (bad) { /* maximal subpart buf[i .. i+got) is ill-formed */
            sink_put(k, REPL, 3);
            i += (size_t)got;
            continue;
        }
        if (got < len) { /* valid so far, incomplete: wait for more bytes */
            memcpy(d->pending, buf + i, (size_t)got);
            d->n_pending = got;
            return;
        }
        sink_put(k, (const char *)buf + i, (size_t)len);
        i += (size_t)len;
    }
}

size_t lethe_detok_push(lethe_detok *d, int32_t id, char *out, size_t cap) {
    sink k = {out, cap, 0};
    if (cap) out[0] = '\0';
    const lethe_tokenizer *t = d->t;
    if (id < 0 || id >= t->n_vocab) return 0;
    if (d->skip_special && (t->attr[id] & TOK_ATTR_SPECIAL)) return 0;
    size_t nb = t->bytes_len[id];
    size_t n = (size_t)d->n_pending + nb;
    unsigned char stackbuf[512];
    unsigned char *buf = n <= sizeof(stackbuf) ? stackbuf : lethe_xmalloc(n);
    memcpy(buf, d->pending, (size_t)d->n_pending);
    memcpy(buf + d->n_pending, t->arena + t->bytes_off[id], nb);
    d->n_pending = 0;
    emit_utf8(d, buf, n, &k);
    if (buf != stackbuf) free(buf);
    return k.n;
}

size_t lethe_detok_flush(lethe_detok *d, char *out, size_t cap) {
    sink k = {out, cap, 0};
    if (cap) out[0] = '\0';
    if (d->n_pending > 0) sink_put(&k, REPL, 3); /* an unfinished sequence is one ill-formed subpart */
    d->n_pending = 0;
    return k.n;
}

/* normalize.c - Unicode NFC for tokenizers whose tokenizer.json has an NFC
 * normalizer (Qwen2/Qwen3), through ICU (libicu-dev).
 *
 * Text with no code point >= U+0300 is already NFC (nothing below U+0300
 * decomposes or combines with a preceding character), which covers ASCII and
 * Latin-1 without a conversion. Otherwise every maximal valid UTF-8 run is
 * converted to UTF-16, normalized by ICU and converted back; bytes that are
 * not UTF-8 are copied unchanged (they round-trip through byte-level BPE). */
#include <stdlib.h>
#include <string.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include "core/util.h"
#include "tokenizer/tok_internal.h"

bool tok_nfc_trivial(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0xCC) return false; /* lead bytes of U+0300 and above */
    return true;
}

/* NFC of one valid UTF-8 run, appended to *o (capacity managed by caller) */
static lethe_status nfc_run(const UNormalizer2 *nfc, const char *s, size_t n, char **o, size_t *on,
                            size_t *ocap) {
    if (n > INT32_MAX / 4) return lethe_errorf(LETHE_ERR_INVALID, "tokenizer: text too long to normalize");
    UErrorCode err = U_ZERO_ERROR;
    int32_t n16 = 0;
    u_strFromUTF8(NULL, 0, &n16, s, (int32_t)n, &err);
    if (err != U_BUFFER_OVERFLOW_ERROR && U_FAILURE(err))
        return lethe_errorf(LETHE_ERR_INVALID, "tokenizer: NFC: %s", u_errorName(err));
    err = U_ZERO_ERROR;
    UChar *src = malloc(((size_t)n16 + 1) * sizeof(UChar));
    int32_t cap16 = n16 * 3 + 16; /* NFC can grow a string by at most 3x */
    UChar *dst = malloc((size_t)cap16 * sizeof(UChar));
    lethe_status st = LETHE_OK;
    if (!src || !dst) {
        st = lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: NFC: out of memory");
        goto done;
    }
    u_strFromUTF8(src, n16 + 1, NULL, s, (int32_t)n, &err);
    int32_t nd = U_SUCCESS(err) ? unorm2_normalize(nfc, src, n16, dst, cap16, &err) : 0;
    if (U_FAILURE(err)) {
        st = lethe_errorf(LETHE_ERR_INVALID, "tokenizer: NFC: %s", u_errorName(err));
        goto done;
    }
    size_t need = *on + (size_t)nd * 3 + 1;
    if (need > *ocap) {
        *ocap = need * 2;
        char *no = realloc(*o, *ocap);
        if (!no) {
            st = lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: NFC: out of memory");
            goto done;
        }
        *o = no;
    }
    int32_t n8 = 0;
    u_strToUTF8(*o + *on, (int32_t)(*ocap - *on), &n8, dst, nd, &err);
    if (U_FAILURE(err)) st = lethe_errorf(LETHE_ERR_INVALID, "tokenizer: NFC: %s", u_errorName(err));
    else *on += (size_t)n8;
done:
    free(src);
    free(dst);
    return st;
}

lethe_status tok_nfc(const char *s, size_t n, char **out, size_t *out_n) {
    UErrorCode err = U_ZERO_ERROR;
    const UNormalizer2 *nfc = unorm2_getNFCInstance(&err);
    if (U_FAILURE(err)) return lethe_errorf(LETHE_ERR_BACKEND, "tokenizer: ICU NFC: %s", u_errorName(err));
    size_t cap = n + 16, on = 0;
    char *o = malloc(cap);
    if (!o) return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: NFC: out of memory");
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        uint32_t cp;
        int k;
        while (j < n && (k = tok_utf8_get(s + j, n - j, &cp)) > 0) j += (size_t)k;
        if (j > i) {
            lethe_status st = nfc_run(nfc, s + i, j - i, &o, &on, &cap);
            if (st != LETHE_OK) {
                free(o);
                return st;
            }
        }
        if (j < n) { /* one invalid byte, kept */
            if (on + 2 > cap) {
                cap = cap * 2 + 16;
                char *no = realloc(o, cap);
                if (!no) {
                    free(o);
                    return lethe_errorf(LETHE_ERR_NOMEM, "tokenizer: NFC: out of memory");
                }
                o = no;
            }
            o[on++] = s[j++];
        }
        i = j;
    }
    *out = o;
    *out_n = on;
    return LETHE_OK;
}

/* fuzz_tokenize.c - tokenization of arbitrary bytes with the default model's
 * byte-level tokenizer (SmolLM2: no normalizer, no prefix space). A byte
 * string either tokenizes and, with special tokens off, decodes back to
 * exactly the same bytes (the round trip is the identity), or - when it holds
 * a byte the vocabulary has no token for (SmolLM2 lacks 21 of the 256, e.g.
 * 0x04) - fails with LETHE_ERR_INVALID naming a byte that is in the input.
 * Nothing is dropped silently. The streaming decoder emits only valid UTF-8. */
#include <stdint.h>

#include "core/status.h"
#include "fuzz_util.h"
#include "model/gguf.h"
#include "tokenizer/tokenizer.h"

static lethe_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    if (lethe_tokenizer_load(fuzz_model_path(), &tok) != LETHE_OK) {
        fprintf(stderr, "fuzz_tokenize: cannot load the tokenizer of %s: %s\n", fuzz_model_path(),
                lethe_last_error());
        exit(1);
    }
    return 0;
}

static bool valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
        if (!len || i + len > n) return false;
        for (size_t k = 1; k < len; k++)
            if (((unsigned char)s[i + k] & 0xc0) != 0x80) return false;
        i += len;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    const char *text = (const char *)data;
    int32_t *ids = NULL, nid = 0;
    lethe_status st = lethe_tokenize(tok, text, n, false, false, &ids, &nid);
    if (st != LETHE_OK) {
        unsigned b = 256;
        const char *m = strstr(lethe_last_error(), "byte 0x");
        FUZZ_CHECK(st == LETHE_ERR_INVALID && m && sscanf(m, "byte 0x%2x", &b) == 1);
        FUZZ_CHECK(memchr(data, (int)b, n) != NULL);
        char one = (char)b;
        FUZZ_CHECK(lethe_tokenize(tok, &one, 1, false, false, &ids, &nid) == LETHE_ERR_INVALID);
        return 0;
    }
    FUZZ_CHECK(n == 0 || nid > 0);
    size_t total = 0;
    for (int32_t i = 0; i < nid; i++) {
        size_t nb = 0;
        FUZZ_CHECK(lethe_token_bytes(tok, ids[i], &nb) != NULL);
        total += nb;
    }
    FUZZ_CHECK(total == n);
    char *back = lethe_detokenize(tok, ids, nid, false);
    FUZZ_CHECK(back && memcmp(back, text, n) == 0);
    free(back);
    /* streaming decode: valid UTF-8 pieces only */
    lethe_detok d;
    lethe_detok_init(&d, tok, false);
    char buf[3 * 1024 + 64];
    FUZZ_CHECK(sizeof(buf) >= 3 * (lethe_tokenizer_max_token_bytes(tok) + 4) + 1);
    for (int32_t i = 0; i < nid; i++) {
        size_t k = lethe_detok_push(&d, ids[i], buf, sizeof(buf));
        FUZZ_CHECK(valid_utf8(buf, k));
    }
    size_t k = lethe_detok_flush(&d, buf, sizeof(buf));
    FUZZ_CHECK(valid_utf8(buf, k));
    free(ids);
    /* with special tokens on, and BOS: still no failure */
    st = lethe_tokenize(tok, text, n, true, true, &ids, &nid);
    FUZZ_CHECK(st == LETHE_OK);
    free(ids);
    (void)valid_utf8;
    return 0;
}

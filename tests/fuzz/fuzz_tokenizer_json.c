/* fuzz_tokenizer_json.c - loading an HF tokenizer.json from arbitrary bytes:
 * it loads or fails with an error; a loaded tokenizer encodes and decodes a
 * fixed text (special tokens on) without crashing, and every id it returns
 * is inside the vocabulary. */
#include <stdint.h>

#include "core/status.h"
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    char path[64];
    int fd = fuzz_memfile(data, n, path, sizeof(path));
    lethe_tokenizer *t = NULL;
    if (lethe_tokenizer_from_hf(path, NULL, &t) == LETHE_OK) {
        static const char text[] = "Hello, wor\xc3\xa9ld! <|im_start|>user\n  12345 \xf0\x9f\x98\x80\xff";
        int32_t *ids = NULL, nid = 0;
        if (lethe_tokenize(t, text, sizeof(text) - 1, true, true, &ids, &nid) == LETHE_OK) {
            for (int32_t i = 0; i < nid; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < lethe_tokenizer_n_vocab(t));
            char *out = lethe_detokenize(t, ids, nid, false);
            FUZZ_CHECK(out != NULL);
            free(out);
            lethe_detok d;
            lethe_detok_init(&d, t, true);
            char buf[3 * (1024 + 4) + 1];
            for (int32_t i = 0; i < nid; i++) (void)lethe_detok_push(&d, ids[i], buf, sizeof(buf));
            (void)lethe_detok_flush(&d, buf, sizeof(buf));
        }
        free(ids);
        lethe_tokenizer_free(t);
    }
    close(fd);
    return 0;
}

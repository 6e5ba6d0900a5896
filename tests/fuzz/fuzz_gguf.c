/* fuzz_gguf.c - the GGUF reader on arbitrary files: open must either fail with
 * an error or return a file whose every key, string, array element and tensor
 * lies inside the mapping; then the model config and the tokenizer are built
 * from its metadata (both may refuse, never crash). */
#include <stdint.h>

#include "core/status.h"
#include "fuzz_util.h"
#include "model/config.h"
#include "model/gguf.h"
#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    char path[64];
    int fd = fuzz_memfile(data, n, path, sizeof(path));
    lethe_gguf g;
    if (lethe_gguf_open(path, &g) == LETHE_OK) {
        const char *lo = g.map, *hi = lo + g.map_size;
        for (uint64_t i = 0; i < g.n_kv; i++) {
            const lethe_gguf_kv *kv = &g.kv[i];
            FUZZ_CHECK(kv->key.data >= lo && kv->key.data + kv->key.len <= hi);
            if (kv->type == LETHE_GGUF_STRING) FUZZ_CHECK(kv->str.data >= lo && kv->str.data + kv->str.len <= hi);
            if (kv->type == LETHE_GGUF_ARRAY && kv->arr_type == LETHE_GGUF_STRING)
                for (uint64_t j = 0; j < kv->arr_n && j < 64; j++) {
                    lethe_gguf_str s = lethe_gguf_arr_str(&g, kv, j);
                    FUZZ_CHECK(s.len == 0 || (s.data >= lo && s.data + s.len <= hi));
                }
            int64_t iv;
            double dv;
            lethe_gguf_str sv;
            char key[256];
            size_t kl = kv->key.len < sizeof(key) - 1 ? kv->key.len : sizeof(key) - 1;
            memcpy(key, kv->key.data, kl);
            key[kl] = '\0';
            (void)lethe_gguf_get_int(&g, key, &iv);
            (void)lethe_gguf_get_float(&g, key, &dv);
            (void)lethe_gguf_get_str(&g, key, &sv);
        }
        for (uint64_t i = 0; i < g.n_tensors; i++) {
            const lethe_gguf_tensor *t = &g.tensors[i];
            FUZZ_CHECK((const char *)t->data >= lo && (const char *)t->data + t->n_bytes <= hi);
            FUZZ_CHECK(lethe_gguf_find_tensor(&g, t->name) != NULL);
            /* dequantize small tensors: the row layout must fit the byte count */
            uint64_t ne = 1;
            for (uint32_t d = 0; d < t->n_dims; d++) ne *= t->ne[d];
            if (ne > 0 && ne <= 4096) {
                float *out = malloc(ne * sizeof(float));
                (void)lethe_ggml_dequantize(t->type, t->data, out, ne);
                free(out);
            }
        }
        lethe_model_config c;
        (void)lethe_gguf_config_load(&g, &c);
        lethe_tokenizer *tok = NULL;
        if (lethe_tokenizer_from_gguf(&g, &tok) == LETHE_OK) {
            int32_t *ids = NULL, nid = 0;
            if (lethe_tokenize(tok, "Hello world <|im_start|> 123", 28, true, true, &ids, &nid) == LETHE_OK) {
                char *text = lethe_detokenize(tok, ids, nid, false);
                free(text);
            }
            free(ids);
            lethe_tokenizer_free(tok);
        }
        lethe_gguf_close(&g);
    }
    close(fd);
    return 0;
}

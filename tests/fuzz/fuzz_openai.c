/* fuzz_openai.c - the OpenAI request parser (openai.c, chain_api.c,
 * json_in.c) on arbitrary bodies, with the default model's tokenizer and
 * chat template behind a real engine in chain mode (created, never started:
 * nothing is submitted). The first byte picks the endpoint. Properties: a
 * parse either succeeds with a prompt of 1 .. max_model_len - 1 in-vocabulary
 * ids and sane sampling fields, or fails with a 4xx whose error body is
 * itself strict, valid JSON (srv_json_parse accepts it). */
#include <stdint.h>

#include "fuzz_util.h"
#include "lethe.h"
#include "server/openai.h"

static lethe_engine *eng;
static srv_api api;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = fuzz_model_path();
    p.max_model_len = 512;
    p.max_num_seqs = 4;
    p.kv_cache_bytes = (size_t)32 << 20;
    p.n_threads = 1;
    p.prefix_cache_mode = "chain";
    if (lethe_engine_create(&p, &eng) != 0) {
        fprintf(stderr, "fuzz_openai: cannot create the engine on %s: %s\n", p.model, lethe_engine_last_error());
        exit(1);
    }
    api.engine = eng;
    api.served_name = "fuzz-model";
    api.model_path = p.model;
    api.max_model_len = lethe_engine_max_model_len(eng);
    size_t nb = 0;
    api.has_tokenizer = lethe_engine_token_text(eng, 0, &nb) != NULL;
    return 0;
}

static void check_error(const srv_error *err) {
    FUZZ_CHECK(err->status >= 400 && err->status < 500);
    char *body = srv_error_json(err);
    cJSON *root = NULL;
    srv_error e2;
    FUZZ_CHECK(srv_json_parse(body, strlen(body), &root, &e2) == 0);
    cJSON_Delete(root);
    free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    if (n < 1) return 0;
    const char *body = (const char *)data + 1;
    size_t len = n - 1;
    srv_error err = {0};
    switch (data[0] % 4) {
    case 0:
    case 1: {
        srv_gen g;
        srv_kind kind = data[0] % 4 == 0 ? SRV_COMPLETION : SRV_CHAT;
        if (srv_parse_request(&api, kind, body, len, NULL, &g, &err) == 0) {
            FUZZ_CHECK(g.n_prompt >= 1 && g.n_prompt < api.max_model_len);
            for (int32_t i = 0; i < g.n_prompt; i++) {
                size_t nb = 0;
                FUZZ_CHECK(lethe_engine_token_text(eng, g.prompt[i], &nb) != NULL);
            }
            FUZZ_CHECK(g.sp.max_tokens == -1 || (g.sp.max_tokens >= 1 && g.n_prompt + g.sp.max_tokens <= api.max_model_len));
            FUZZ_CHECK(g.logprobs >= -1 && g.logprobs <= LETHE_MAX_TOP_LOGPROBS);
            srv_gen_free(&g);
        } else {
            check_error(&err);
        }
        break;
    }
    case 2: {
        char *out = srv_tokenize_json(&api, body, len, &err);
        if (out) free(out);
        else check_error(&err);
        break;
    }
    default: {
        char *out = srv_detokenize_json(&api, body, len, &err);
        if (out) {
            cJSON *root = NULL;
            srv_error e2;
            FUZZ_CHECK(srv_json_parse(out, strlen(out), &root, &e2) == 0); /* sanitized text */
            cJSON_Delete(root);
            free(out);
        } else {
            check_error(&err);
        }
        break;
    }
    }
    return 0;
}

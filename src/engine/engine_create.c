/* engine_create.c - lethe_engine_create from a model path, and the
 * tokenizer-facing part of the API (tokenize, chat template, detokenize).
 *
 * Create: backend (lethe_backend_create) -> model (lethe_model_load: GGUF,
 * HF folder or dummy weights) -> tokenizer (lethe_tokenizer_load; a folder
 * without tokenizer.json gives an engine that takes token ids only) -> real
 * runner ->
 * lethe_engine_create_with (engine.c) for the KV pool, cache, scheduler. */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "tokenizer/chat_template.h"

int lethe_engine_create(const lethe_engine_params *p, lethe_engine **out) {
    *out = NULL;
    if (!p || !p->model || !p->model[0])
        return lethe_errorf(LETHE_ERR_INVALID, "--model: no model path given");
    lethe_load_format fmt;
    lethe_status st = lethe_load_format_parse(p->load_format ? p->load_format : "auto", &fmt);
    if (st != LETHE_OK) return st;
    lethe_backend_params bp = {.device = p->device ? p->device : "cpu", .n_threads = p->n_threads};
    if (p->cpu_weights) {
        lethe_status ws = lethe_cpu_weights_parse(p->cpu_weights, &bp.cpu_weights);
        if (ws) return ws;
    } else {
        /* a method that multiplies with model weights as activations needs them in f32 */
        const lethe_sparse_ops *mo = lethe_sparse_find_kv(p->sparse_method ? p->sparse_method : "dense");
        if (mo && (mo->flags & LETHE_SPARSE_F32_WEIGHTS)) bp.cpu_weights = LETHE_CPU_WEIGHTS_FP32;
    }
    lethe_backend *be = NULL;
    if ((st = lethe_backend_create(&bp, &be)) != LETHE_OK) return st;
    lethe_model_load_params lp = {.path = p->model, .format = fmt, .seed = p->seed, .progress = p->progress};
    lethe_model model;
    if ((st = lethe_model_load(&lp, be, &model)) != LETHE_OK) {
        lethe_backend_destroy(be);
        return st;
    }
    lethe_tokenizer *tok = NULL;
    const bool own_tok = p->tokenizer && p->tokenizer[0];
    st = lethe_tokenizer_load(own_tok ? p->tokenizer : p->model, &tok);
    if (st != LETHE_OK) {
        if (st == LETHE_ERR_NOT_FOUND && !own_tok) { /* no tokenizer beside the weights: token ids only */
            LOG_INFO("%s", lethe_last_error());
            tok = NULL;
        } else {
            lethe_model_free(&model);
            lethe_backend_destroy(be);
            return st;
        }
    }
    if (tok && lethe_tokenizer_n_vocab(tok) > model.cfg.n_vocab) {
        const int32_t tv = lethe_tokenizer_n_vocab(tok), mv = model.cfg.n_vocab; /* before the free */
        lethe_tokenizer_free(tok);
        lethe_model_free(&model);
        lethe_backend_destroy(be);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: the tokenizer has %d tokens but the model's vocabulary is %d",
                            p->model, tv, mv);
    }
    lethe_runner runner;
    lethe_runner_model(&model, be, &runner);
    return lethe_engine_create_with(p, &runner, tok, out);
}

static lethe_status need_tok(const lethe_engine *e, const char *what) {
    if (e->tok) return LETHE_OK;
    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: model %s has no tokenizer (dummy weights take token ids)",
                        what, e->model_name);
}

int lethe_engine_tokenize(lethe_engine *e, const char *text, bool add_bos, bool parse_special,
                          int32_t **ids, int32_t *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    lethe_status st = need_tok(e, "tokenize");
    if (st != LETHE_OK) return st;
    return lethe_tokenize(e->tok, text, strlen(text), add_bos, parse_special, ids, n_ids);
}

int lethe_engine_apply_chat(lethe_engine *e, const char *const *roles, const char *const *contents,
                            size_t n, bool add_generation_prompt, char **out) {
    *out = NULL;
    lethe_status st = need_tok(e, "chat template");
    if (st != LETHE_OK) return st;
    lethe_chat_msg *msgs = lethe_xcalloc(n ? n : 1, sizeof(*msgs));
    for (size_t i = 0; i < n; i++) {
        msgs[i].role = roles[i];
        msgs[i].content = contents[i];
    }
    st = lethe_chat_render(lethe_chat_format_detect(e->tok), msgs, n, add_generation_prompt, true, out);
    free(msgs);
    return st;
}

char *lethe_engine_detokenize(lethe_engine *e, const int32_t *ids, int32_t n) {
    if (!e->tok) return NULL;
    return lethe_detokenize(e->tok, ids, n, true);
}

bool lethe_engine_adds_bos(const lethe_engine *e) { return e->tok && lethe_tokenizer_adds_bos(e->tok); }

const char *lethe_engine_token_text(lethe_engine *e, int32_t id, size_t *n_bytes) {
    if (!e->tok) {
        if (n_bytes) *n_bytes = 0;
        return NULL;
    }
    return lethe_token_bytes(e->tok, id, n_bytes);
}

/* openai.c - parses and validates OpenAI completion / chat requests.
 *
 * Rules follow the OpenAI API and vLLM's extensions (top_k, min_p,
 * repetition_penalty, ignore_eos, stop_token_ids): a field that is present
 * with the wrong JSON type or out of range is a 400 naming the field; JSON
 * null counts as absent; unknown fields are ignored (as vLLM does). Features
 * lethe does not implement (n > 1, best_of, echo, suffix, logit_bias, tools,
 * JSON response formats, batched prompts) are refused with a 400 that says
 * so rather than silently ignored. Prompts are tokenized here, on the
 * connection's thread, so the engine thread only ever sees token ids; the
 * length checks against max-model-len use vLLM's wording. */
#include "server/openai.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/util.h"
#include "server/agent.h"
#include "server/chain_api.h"

int srv_errorf(srv_error *err, int status, const char *param, const char *fmt, ...) {
    err->status = status;
    err->code[0] = 0;
    snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return -1;
}

static const char *error_type(int status) {
    switch (status) {
    case 400: case 413: case 414: case 431: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 503: return "ServiceUnavailableError";
    default: return "InternalServerError";
    }
}

char *srv_error_json(const srv_error *err) {
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    /* valid UTF-8 whatever client text the message quotes (a path, a cut-off field) */
    char *msg = srv_utf8_sanitize(err->message, strlen(err->message));
    cJSON_AddStringToObject(e, "message", msg);
    free(msg);
    cJSON_AddStringToObject(e, "type", error_type(err->status));
    if (err->param[0]) cJSON_AddStringToObject(e, "param", err->param);
    else cJSON_AddNullToObject(e, "param");
    if (err->code[0]) cJSON_AddStringToObject(e, "code", err->code);
    else cJSON_AddNumberToObject(e, "code", err->status);
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

/* ---- typed field access: 0 absent, 1 present, -1 error ---- */

static cJSON *field(const cJSON *root, const char *name) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static int get_bool(const cJSON *root, const char *name, bool *out, srv_error *err) {
    cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsBool(v)) return srv_errorf(err, 400, name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(v);
    return 1;
}

static int get_float(const cJSON *root, const char *name, double lo, double hi, bool lo_open,
                     float *out, srv_error *err) {
    cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v)) return srv_errorf(err, 400, name, "'%s' must be a number", name);
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || d > hi || (lo_open && d == lo))
        return srv_errorf(err, 400, name, "'%s' must be in %s%g, %g], got %g", name,
                          lo_open ? "(" : "[", lo, hi, d);
    *out = (float)d;
    return 1;
}

static int get_int(const cJSON *root, const char *name, double lo, double hi, int64_t *out,
                   srv_error *err) {
    cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return srv_errorf(err, 400, name, "'%s' must be an integer", name);
    double d = v->valuedouble;
    if (d < lo || d > hi)
        return srv_errorf(err, 400, name, "'%s' must be in [%.0f, %.0f], got %.0f", name, lo, hi, d);
    *out = d >= 9.2e18 ? INT64_MAX : (int64_t)d;
    return 1;
}

/* ---- prompt ---- */

static int check_token_ids(const srv_api *api, const cJSON *arr, const char *param,
                           int32_t **ids, int32_t *n, srv_error *err) {
    int cnt = cJSON_GetArraySize(arr);
    if (cnt == 0) return srv_errorf(err, 400, param, "'%s' is empty", param);
    int32_t *out = malloc((size_t)cnt * sizeof(int32_t));
    if (!out) return srv_errorf(err, 413, param, "'%s' is too large", param);
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, arr) {
        size_t nb = 0;
        /* without a tokenizer the engine checks the vocabulary bound at submit (400) */
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble > INT32_MAX ||
            (api->has_tokenizer && !lethe_engine_token_text(api->engine, (int32_t)t->valuedouble, &nb))) {
            free(out);
            return srv_errorf(err, 400, param, "'%s'[%d] is not a valid token id", param, i);
        }
        out[i++] = (int32_t)t->valuedouble;
    }
    *ids = out;
    *n = cnt;
    return 0;
}

static int tokenize(const srv_api *api, const char *text, bool add_bos, const char *param,
                    srv_gen *g, srv_error *err) {
    if (lethe_engine_tokenize(api->engine, text, add_bos, true, &g->prompt, &g->n_prompt) != 0)
        return srv_errorf(err, 400, param, "cannot tokenize '%s': %s", param,
                          lethe_engine_last_error());
    if (g->n_prompt == 0) return srv_errorf(err, 400, param, "'%s' is empty", param);
    return 0;
}

static int parse_prompt(const srv_api *api, const cJSON *root, srv_gen *g, srv_error *err) {
    cJSON *p = field(root, "prompt");
    if (!p) return srv_errorf(err, 400, "prompt", "'prompt' is required");
    bool bos = lethe_engine_adds_bos(api->engine); /* as HF's add_special_tokens=True */
    if (cJSON_IsString(p)) return tokenize(api, p->valuestring, bos, "prompt", g, err);
    if (!cJSON_IsArray(p))
        return srv_errorf(err, 400, "prompt",
                          "'prompt' must be a string, an array of token ids, or a one-element "
                          "array of either");
    cJSON *first = cJSON_GetArrayItem(p, 0);
    if (first && (cJSON_IsString(first) || cJSON_IsArray(first))) {
        if (cJSON_GetArraySize(p) != 1)
            return srv_errorf(err, 400, "prompt",
                              "batched prompts are not supported (got %d); send one request "
                              "per prompt",
                              cJSON_GetArraySize(p));
        if (cJSON_IsString(first)) return tokenize(api, first->valuestring, bos, "prompt", g, err);
        return check_token_ids(api, first, "prompt", &g->prompt, &g->n_prompt, err);
    }
    return check_token_ids(api, p, "prompt", &g->prompt, &g->n_prompt, err);
}

/* Message content: a string, null, or an array of {"type": "text", "text": ...} parts. */
static int message_text(const cJSON *content, int idx, srv_buf *out, srv_error *err) {
    char param[48];
    snprintf(param, sizeof(param), "messages[%d].content", idx);
    if (!content || cJSON_IsNull(content)) return 0;
    if (cJSON_IsString(content)) {
        srv_buf_puts(out, content->valuestring);
        return 0;
    }
    if (!cJSON_IsArray(content))
        return srv_errorf(err, 400, param, "'%s' must be a string or an array of text parts", param);
    const cJSON *part;
    cJSON_ArrayForEach(part, content) {
        cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsObject(part) || !cJSON_IsString(type))
            return srv_errorf(err, 400, param, "'%s' parts must be objects with a 'type'", param);
        char clip[80];
        if (strcmp(type->valuestring, "text") != 0)
            return srv_errorf(err, 400, param, "content part type '%s' is not supported (text only)",
                              srv_clip(type->valuestring, clip, sizeof(clip)));
        if (!cJSON_IsString(text))
            return srv_errorf(err, 400, param, "text parts of '%s' need a string 'text'", param);
        srv_buf_puts(out, text->valuestring);
    }
    return 0;
}

static int parse_messages(const srv_api *api, const cJSON *root, srv_gen *g, srv_error *err) {
    cJSON *msgs = field(root, "messages");
    if (!msgs) return srv_errorf(err, 400, "messages", "'messages' is required");
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
        return srv_errorf(err, 400, "messages", "'messages' must be a non-empty array");
    if (cJSON_GetArraySize(msgs) > SRV_MAX_MESSAGES)
        return srv_errorf(err, 400, "messages", "'messages' has %d entries; at most %d are accepted",
                          cJSON_GetArraySize(msgs), SRV_MAX_MESSAGES);
    size_t n = (size_t)cJSON_GetArraySize(msgs);
    const char **roles = lethe_xcalloc(n, sizeof(char *));
    srv_buf *texts = lethe_xcalloc(n, sizeof(srv_buf));
    const char **contents = lethe_xcalloc(n, sizeof(char *));
    int rc = 0;
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        char param[48];
        snprintf(param, sizeof(param), "messages[%zu].role", i);
        cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role)) {
            rc = srv_errorf(err, 400, param, "each message must be an object with a string 'role'");
            break;
        }
        const char *r = role->valuestring;
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool") &&
            strcmp(r, "developer")) {
            char clip[80];
            rc = srv_errorf(err, 400, param, "unknown role '%s' (system, developer, user, assistant, tool)",
                            srv_clip(r, clip, sizeof(clip)));
            break;
        }
        roles[i] = strcmp(r, "developer") ? r : "system";
        if ((rc = message_text(cJSON_GetObjectItemCaseSensitive(m, "content"), (int)i, &texts[i],
                               err)))
            break;
        if ((rc = srv_agent_check_message(m, (int)i, err))) break;
        contents[i] = texts[i].data ? texts[i].data : "";
        i++;
    }
    bool add_gen = true;
    if (!rc && get_bool(root, "add_generation_prompt", &add_gen, err) < 0) rc = -1;
    char *rendered = NULL;
    const cJSON *cid = field(root, "chain_id"); /* the chain's memo restores dropped reasoning */
    const char *memo_id = cJSON_IsString(cid) ? cid->valuestring : g->hdr.chain_id;
    if (!rc) rc = srv_render_chat(api, msgs, g->agent, memo_id, add_gen, &rendered, err);
    if (!rc) rc = tokenize(api, rendered, false, "messages", g, err);
    if (!rc)
        rc = srv_retention_parse(api, msgs, g->agent, cJSON_IsString(cid) ? cid->valuestring : NULL,
                                 g, err);
    free(rendered);
    for (size_t k = 0; k < n; k++) srv_buf_free(&texts[k]);
    free(texts);
    free(roles);
    free(contents);
    return rc;
}

/* ---- sampling ---- */

static int parse_stop(const cJSON *root, srv_gen *g, srv_error *err) {
    cJSON *s = field(root, "stop");
    if (!s) return 0;
    int n = 0;
    if (cJSON_IsString(s)) {
        if (!s->valuestring[0]) return srv_errorf(err, 400, "stop", "'stop' must not be empty");
        if (strlen(s->valuestring) > SRV_MAX_STOP_BYTES)
            return srv_errorf(err, 400, "stop", "'stop' strings are at most %d bytes", SRV_MAX_STOP_BYTES);
        g->stops[n++] = lethe_xstrdup(s->valuestring);
    } else if (cJSON_IsArray(s)) {
        if (cJSON_GetArraySize(s) > LETHE_MAX_STOP - 1)
            return srv_errorf(err, 400, "stop", "'stop' takes at most %d strings",
                              LETHE_MAX_STOP - 1);
        const cJSON *it;
        cJSON_ArrayForEach(it, s) {
            if (!cJSON_IsString(it) || !it->valuestring[0])
                return srv_errorf(err, 400, "stop", "'stop' entries must be non-empty strings");
            if (strlen(it->valuestring) > SRV_MAX_STOP_BYTES)
                return srv_errorf(err, 400, "stop", "'stop' strings are at most %d bytes", SRV_MAX_STOP_BYTES);
            g->stops[n++] = lethe_xstrdup(it->valuestring);
        }
    } else {
        return srv_errorf(err, 400, "stop", "'stop' must be a string or an array of strings");
    }
    for (int i = 0; i < LETHE_MAX_STOP; i++) g->sp.stop[i] = i < n ? g->stops[i] : NULL;
    return 0;
}

static int parse_stop_ids(const srv_api *api, const cJSON *root, srv_gen *g, srv_error *err) {
    cJSON *s = field(root, "stop_token_ids");
    if (!s) return 0;
    if (!cJSON_IsArray(s) || cJSON_GetArraySize(s) > LETHE_MAX_STOP)
        return srv_errorf(err, 400, "stop_token_ids",
                          "'stop_token_ids' must be an array of at most %d token ids",
                          LETHE_MAX_STOP);
    int32_t *ids = NULL, n = 0;
    if (cJSON_GetArraySize(s) == 0) return 0;
    if (check_token_ids(api, s, "stop_token_ids", &ids, &n, err)) return -1;
    memcpy(g->sp.stop_token_ids, ids, (size_t)n * sizeof(int32_t));
    g->sp.n_stop_token_ids = n;
    free(ids);
    return 0;
}

static int parse_sampling(const srv_api *api, const cJSON *root, srv_gen *g, srv_error *err) {
    lethe_sampling_params *sp = &g->sp;
    int64_t iv = 0;
    int r;
    if (get_float(root, "temperature", 0, 100, false, &sp->temperature, err) < 0) return -1;
    if (get_float(root, "top_p", 0, 1, true, &sp->top_p, err) < 0) return -1;
    if ((r = get_int(root, "top_k", -1, 1 << 30, &iv, err)) < 0) return -1;
    if (r) sp->top_k = (int32_t)(iv <= 0 ? -1 : iv);
    if (get_float(root, "min_p", 0, 1, false, &sp->min_p, err) < 0) return -1;
    if (get_float(root, "repetition_penalty", 0, 100, true, &sp->repetition_penalty, err) < 0)
        return -1;
    if (get_float(root, "presence_penalty", -2, 2, false, &sp->presence_penalty, err) < 0) return -1;
    if (get_float(root, "frequency_penalty", -2, 2, false, &sp->frequency_penalty, err) < 0)
        return -1;
    if ((r = get_int(root, "seed", -9.2e18, 1.8e19, &iv, err)) < 0) return -1;
    if (r) {
        cJSON *sv = field(root, "seed");
        sp->seed = sv->valuedouble < 0 ? (uint64_t)(int64_t)sv->valuedouble
                                       : (uint64_t)sv->valuedouble;
        sp->has_seed = true;
    }
    if (get_bool(root, "ignore_eos", &sp->ignore_eos, err) < 0) return -1;
    if ((r = get_int(root, "max_tokens", 1, 1 << 30, &iv, err)) < 0) return -1;
    if (g->kind == SRV_CHAT) {
        int64_t iv2 = 0;
        int r2 = get_int(root, "max_completion_tokens", 1, 1 << 30, &iv2, err);
        if (r2 < 0) return -1;
        if (r2) {
            r = 1;
            iv = iv2;
        }
    }
    /* vLLM defaults: 16 for completions (OpenAI legacy), up to the context for chat. */
    sp->max_tokens = r ? (int32_t)iv : (g->kind == SRV_COMPLETION ? 16 : -1);
    if (parse_stop(root, g, err) || parse_stop_ids(api, root, g, err)) return -1;

    /* lethe extension for trace replay (as the anchor's benchmark_forced_token_ids): the
     * i-th generated token is forced_token_ids[i]; the request ends after the last one. */
    cJSON *f = field(root, "forced_token_ids");
    if (f) {
        if (!cJSON_IsArray(f) || cJSON_GetArraySize(f) == 0 ||
            cJSON_GetArraySize(f) >= api->max_model_len)
            return srv_errorf(err, 400, "forced_token_ids",
                              "'forced_token_ids' must be a non-empty array of fewer than %d token ids",
                              api->max_model_len);
        if (check_token_ids(api, f, "forced_token_ids", &g->forced, &g->n_forced, err)) return -1;
        if (r && sp->max_tokens < g->n_forced)
            return srv_errorf(err, 400, "max_tokens",
                              "'max_tokens' (%d) is smaller than the %d forced_token_ids", sp->max_tokens,
                              g->n_forced);
        sp->max_tokens = g->n_forced;
    }

    g->logprobs = -1;
    if (g->kind == SRV_COMPLETION) {
        if ((r = get_int(root, "logprobs", 0, LETHE_MAX_TOP_LOGPROBS, &iv, err)) < 0) return -1;
        if (r) g->logprobs = (int32_t)iv;
    } else {
        bool lp = false;
        if (get_bool(root, "logprobs", &lp, err) < 0) return -1;
        if ((r = get_int(root, "top_logprobs", 0, LETHE_MAX_TOP_LOGPROBS, &iv, err)) < 0) return -1;
        if (r && !lp)
            return srv_errorf(err, 400, "top_logprobs",
                              "'top_logprobs' needs 'logprobs' set to true");
        if (lp) g->logprobs = r ? (int32_t)iv : 0;
    }
    sp->logprobs = g->logprobs;
    return 0;
}

/* Fields lethe refuses explicitly instead of ignoring. */
static int check_unsupported(const cJSON *root, srv_kind kind, srv_error *err) {
    int64_t iv = 0;
    int r;
    if ((r = get_int(root, "n", -1e9, 1e9, &iv, err)) < 0) return -1;
    if (r && iv != 1)
        return srv_errorf(err, 400, "n", "only n = 1 is supported (got n = %lld)", (long long)iv);
    if ((r = get_int(root, "best_of", -1e9, 1e9, &iv, err)) < 0) return -1;
    if (r && iv != 1) return srv_errorf(err, 400, "best_of", "only best_of = 1 is supported");
    bool echo = false;
    if (get_bool(root, "echo", &echo, err) < 0) return -1;
    if (echo) return srv_errorf(err, 400, "echo", "'echo' is not supported");
    cJSON *v = field(root, "suffix");
    if (v && (!cJSON_IsString(v) || v->valuestring[0]))
        return srv_errorf(err, 400, "suffix", "'suffix' is not supported");
    v = field(root, "logit_bias");
    if (v && (!cJSON_IsObject(v) || v->child))
        return srv_errorf(err, 400, "logit_bias", "'logit_bias' is not supported");
    return 0;
}

static void make_id(srv_gen *g) {
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t c = ++counter;
    uint64_t seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (c << 7);
    uint64_t a = lethe_splitmix64(&seed), b = lethe_splitmix64(&seed);
    snprintf(g->id, sizeof(g->id), "%s-%016llx%08llx", g->kind == SRV_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)a, (unsigned long long)(b & 0xffffffffu));
    g->created = (int64_t)ts.tv_sec;
}

int srv_parse_request(const srv_api *api, srv_kind kind, const char *body, size_t len,
                      const srv_chain_headers *hdr, srv_gen *g, srv_error *err) {
    memset(g, 0, sizeof(*g));
    g->kind = kind;
    if (hdr) g->hdr = *hdr;
    g->logprobs = -1;
    lethe_sampling_default_params(&g->sp);
    make_id(g);
    cJSON *root = NULL;
    if (srv_json_parse(body, len, &root, err)) return -1;
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        srv_errorf(err, 400, NULL, "request body must be a JSON object");
        goto out;
    }
    cJSON *model = field(root, "model");
    if (model && !cJSON_IsString(model)) {
        srv_errorf(err, 400, "model", "'model' must be a string");
        goto out;
    }
    if (model && strcmp(model->valuestring, api->served_name) &&
        strcmp(model->valuestring, api->model_path)) {
        char clip[80];
        srv_errorf(err, 404, "model", "The model `%s` does not exist.",
                   srv_clip(model->valuestring, clip, sizeof(clip)));
        goto out;
    }
    if (get_bool(root, "stream", &g->stream, err) < 0) goto out;
    cJSON *so = field(root, "stream_options");
    if (so) {
        if (!g->stream) {
            srv_errorf(err, 400, "stream_options",
                       "'stream_options' can only be given when 'stream' is true");
            goto out;
        }
        if (!cJSON_IsObject(so)) {
            srv_errorf(err, 400, "stream_options", "'stream_options' must be an object");
            goto out;
        }
        if (get_bool(so, "include_usage", &g->include_usage, err) < 0) goto out;
    }
    if (check_unsupported(root, kind, err) || parse_sampling(api, root, g, err)) goto out;
    if (kind == SRV_CHAT && srv_agent_parse(api, root, g, err)) goto out; /* tools, reasoning, response_format */
    if (g->agent && g->agent->grammar && (g->sp.ignore_eos || g->forced)) {
        srv_errorf(err, 400, g->forced ? "forced_token_ids" : "ignore_eos",
                   "'%s' cannot be combined with structured output or forced tool calls",
                   g->forced ? "forced_token_ids" : "ignore_eos");
        goto out;
    }
    if (kind == SRV_CHAT ? parse_messages(api, root, g, err) : parse_prompt(api, root, g, err))
        goto out;
    if (srv_chain_parse(api, root, kind, g, err)) goto out; /* chain_id, chain_append_start */
    if (g->chain_append && (g->n_pinned || g->n_prunable)) {
        srv_errorf(err, 400, "chain_append_start",
                   "retention hints need the whole conversation (not chain_append_start)");
        goto out;
    }
    int32_t mml = api->max_model_len;
    if (g->n_prompt >= mml) {
        srv_errorf(err, 400, kind == SRV_CHAT ? "messages" : "prompt",
                   "This model's maximum context length is %d tokens. However, your request has "
                   "%d input tokens. Please reduce the length of the input.",
                   mml, g->n_prompt);
        goto out;
    }
    if (g->sp.max_tokens > 0 && (int64_t)g->n_prompt + g->sp.max_tokens > mml) {
        srv_errorf(err, 400, "max_tokens",
                   "This model's maximum context length is %d tokens. However, you requested %lld "
                   "tokens (%d in the input, %d in the completion). Please reduce the length of "
                   "the input or completion.",
                   mml, (long long)g->n_prompt + g->sp.max_tokens, g->n_prompt, g->sp.max_tokens);
        goto out;
    }
    rc = 0;
out:
    cJSON_Delete(root);
    if (rc) srv_gen_free(g);
    return rc;
}

void srv_gen_free(srv_gen *g) {
    srv_agent_free(g->agent);
    g->agent = NULL;
    free(g->prompt);
    g->prompt = NULL;
    free(g->chain_id);
    g->chain_id = NULL;
    free(g->forced);
    g->forced = NULL;
    free(g->pinned);
    g->pinned = NULL;
    free(g->prunable);
    g->prunable = NULL;
    g->n_pinned = g->n_prunable = 0;
    for (int i = 0; i < LETHE_MAX_STOP; i++) {
        free(g->stops[i]);
        g->stops[i] = NULL;
        g->sp.stop[i] = NULL;
    }
}

/* vLLM's /tokenize: {"prompt": str, "add_special_tokens": bool} or {"messages": [...],
 * "add_generation_prompt": bool} -> {"count", "max_model_len", "tokens"}. */
char *srv_tokenize_json(const srv_api *api, const char *body, size_t len, srv_error *err) {
    cJSON *root = NULL;
    if (srv_json_parse(body, len, &root, err)) return NULL;
    char *out = NULL;
    srv_gen g;
    memset(&g, 0, sizeof(g));
    if (!cJSON_IsObject(root)) {
        srv_errorf(err, 400, NULL, "request body must be a JSON object");
        goto done;
    }
    cJSON *prompt = field(root, "prompt");
    if (prompt) {
        bool special = true;
        if (!cJSON_IsString(prompt)) {
            srv_errorf(err, 400, "prompt", "'prompt' must be a string");
            goto done;
        }
        if (get_bool(root, "add_special_tokens", &special, err) < 0) goto done;
        if (lethe_engine_tokenize(api->engine, prompt->valuestring,
                                  special && lethe_engine_adds_bos(api->engine), true, &g.prompt,
                                  &g.n_prompt) != 0) {
            srv_errorf(err, 400, "prompt", "cannot tokenize 'prompt': %s", lethe_engine_last_error());
            goto done;
        }
    } else if (parse_messages(api, root, &g, err) != 0) {
        goto done;
    }
    cJSON *res = cJSON_CreateObject();
    cJSON_AddNumberToObject(res, "count", g.n_prompt);
    cJSON_AddNumberToObject(res, "max_model_len", api->max_model_len);
    cJSON *toks = cJSON_AddArrayToObject(res, "tokens");
    for (int32_t i = 0; i < g.n_prompt; i++) cJSON_AddItemToArray(toks, cJSON_CreateNumber(g.prompt[i]));
    out = cJSON_PrintUnformatted(res);
    cJSON_Delete(res);
done:
    srv_gen_free(&g);
    cJSON_Delete(root);
    return out;
}

/* vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}. */
char *srv_detokenize_json(const srv_api *api, const char *body, size_t len, srv_error *err) {
    cJSON *root = NULL;
    if (srv_json_parse(body, len, &root, err)) return NULL;
    char *out = NULL;
    int32_t *ids = NULL, n = 0;
    cJSON *toks = cJSON_IsObject(root) ? field(root, "tokens") : NULL;
    if (!cJSON_IsArray(toks)) {
        srv_errorf(err, 400, "tokens", "'tokens' must be an array of token ids");
    } else if (cJSON_GetArraySize(toks) == 0 ||
               check_token_ids(api, toks, "tokens", &ids, &n, err) == 0) {
        char *text = lethe_engine_detokenize(api->engine, ids, n);
        char *clean = srv_utf8_sanitize(text ? text : "", text ? strlen(text) : 0);
        cJSON *res = cJSON_CreateObject();
        cJSON_AddStringToObject(res, "prompt", clean);
        out = cJSON_PrintUnformatted(res);
        cJSON_Delete(res);
        free(clean);
        free(text);
    }
    free(ids);
    cJSON_Delete(root);
    return out;
}

char *srv_models_json(const srv_api *api) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", api->served_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)api->created);
    cJSON_AddStringToObject(m, "owned_by", "lethe");
    cJSON_AddStringToObject(m, "root", api->served_name); /* never a filesystem path */
    cJSON_AddNumberToObject(m, "max_model_len", api->max_model_len);
    cJSON_AddItemToArray(data, m);
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

/* engine_chat.c - lethe_engine_apply_chat_json: OpenAI-shaped messages,
 * tools and chat_template_kwargs (JSON text) to the model's built-in chat
 * format (tokenizer/chat_template.h).
 *
 * Normalization, as vLLM does before it calls the template: developer ->
 * system; content null -> "" (assistant turns with tool calls), text parts
 * concatenated; tool_calls[].function.arguments given as a JSON string is
 * parsed to the object the templates `tojson` (a string that is not a JSON
 * object stays a string); an empty or null tool_calls is no tool call. The
 * JSON keeps each number's text (core/json.h), so a tool schema's 1.0 renders
 * as Python's json.dumps writes it. */
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "tokenizer/chat_template.h"

/* content: string | null | [{"type": "text", "text": s}, ...] -> owned text in *out */
static lethe_status content_text(const cJSON *c, size_t i, char **out) {
    *out = NULL;
    if (!c || cJSON_IsNull(c)) return LETHE_OK;
    if (cJSON_IsString(c)) {
        *out = lethe_xstrdup(c->valuestring);
        return LETHE_OK;
    }
    if (!cJSON_IsArray(c)) return lethe_errorf(LETHE_ERR_INVALID, "messages[%zu].content must be a string, null or text parts", i);
    lethe_sbuf b = {0};
    lethe_sbuf_add(&b, "", 0);
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(part, "type");
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "text") || !cJSON_IsString(t)) {
            free(b.s);
            return lethe_errorf(LETHE_ERR_INVALID, "messages[%zu].content: only text parts are supported", i);
        }
        lethe_sbuf_puts(&b, t->valuestring);
    }
    *out = b.s;
    return LETHE_OK;
}

/* arguments strings -> objects, in place (calls is the caller's copy) */
static lethe_status normalize_calls(cJSON *calls, size_t i) {
    cJSON *call;
    cJSON_ArrayForEach(call, calls) {
        cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
        cJSON *name = fn ? cJSON_GetObjectItemCaseSensitive(fn, "name") : NULL;
        if (!cJSON_IsObject(call) || !cJSON_IsObject(fn) || !cJSON_IsString(name))
            return lethe_errorf(LETHE_ERR_INVALID, "messages[%zu].tool_calls: each call needs a function with a string name", i);
        cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        if (cJSON_IsString(args)) {
            cJSON *obj = lethe_json_parse(args->valuestring, strlen(args->valuestring));
            if (cJSON_IsObject(obj)) cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", obj);
            else cJSON_Delete(obj);
        }
    }
    return LETHE_OK;
}

static lethe_status parse_kwargs(const char *json, lethe_chat_opts *o, cJSON **keep) {
    *keep = NULL;
    if (!json) return LETHE_OK;
    cJSON *kw = lethe_json_parse(json, strlen(json));
    if (!cJSON_IsObject(kw)) {
        cJSON_Delete(kw);
        return lethe_errorf(LETHE_ERR_INVALID, "chat_template_kwargs must be a JSON object");
    }
    *keep = kw;
    const cJSON *v;
    cJSON_ArrayForEach(v, kw) {
        const char *k = v->string;
        if (!strcmp(k, "enable_thinking") && cJSON_IsBool(v)) {
            o->enable_thinking = cJSON_IsTrue(v);
        } else if (!strcmp(k, "tools_in_user_message") && cJSON_IsBool(v)) {
            o->tools_in_user_message = cJSON_IsTrue(v);
        } else if (!strcmp(k, "date_string") && cJSON_IsString(v)) {
            o->date_string = v->valuestring;
        } else if (cJSON_IsNull(v)) {
            continue; /* null = not given */
        } else {
            return lethe_errorf(LETHE_ERR_INVALID,
                                "chat_template_kwargs.%s: lethe's built-in templates take enable_thinking "
                                "(boolean), date_string (string) and tools_in_user_message (boolean)", k);
        }
    }
    return LETHE_OK;
}

int lethe_engine_apply_chat_json(lethe_engine *e, const char *messages_json, const lethe_chat_options *co,
                                 char **out) {
    *out = NULL;
    if (!e->tok)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "chat template: model %s has no tokenizer (dummy weights take "
                                                   "token ids)", e->model_name);
    lethe_chat_options defaults = {.add_generation_prompt = true};
    if (!co) co = &defaults;
    cJSON *msgs = messages_json ? lethe_json_parse(messages_json, strlen(messages_json)) : NULL;
    cJSON *tools = NULL, *kw = NULL;
    lethe_chat_msg *m = NULL;
    char **texts = NULL;
    size_t n = 0;
    lethe_status st = LETHE_OK;
    lethe_chat_opts o = {.add_generation_prompt = co->add_generation_prompt, .include_bos = true,
                         .enable_thinking = -1, .tools_in_user_message = -1,
                         .preserve_thinking = co->preserve_thinking};
    if (!cJSON_IsArray(msgs)) {
        st = lethe_errorf(LETHE_ERR_INVALID, "messages must be a JSON array");
        goto done;
    }
    if (co->tools_json) {
        tools = lethe_json_parse(co->tools_json, strlen(co->tools_json));
        if (!cJSON_IsArray(tools)) {
            st = lethe_errorf(LETHE_ERR_INVALID, "tools must be a JSON array");
            goto done;
        }
        o.tools = tools;
    }
    if ((st = parse_kwargs(co->kwargs_json, &o, &kw)) != LETHE_OK) goto done;
    n = (size_t)cJSON_GetArraySize(msgs);
    m = lethe_xcalloc(n ? n : 1, sizeof(*m));
    texts = lethe_xcalloc(n ? n : 1, sizeof(char *));
    size_t i = 0;
    cJSON *it;
    cJSON_ArrayForEach(it, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        if (!cJSON_IsObject(it) || !cJSON_IsString(role)) {
            st = lethe_errorf(LETHE_ERR_INVALID, "messages[%zu] must be an object with a string role", i);
            goto done;
        }
        m[i].role = strcmp(role->valuestring, "developer") ? role->valuestring : "system";
        if ((st = content_text(cJSON_GetObjectItemCaseSensitive(it, "content"), i, &texts[i])) != LETHE_OK) goto done;
        cJSON *calls = cJSON_GetObjectItemCaseSensitive(it, "tool_calls");
        if (calls && !cJSON_IsNull(calls)) {
            if (!cJSON_IsArray(calls)) {
                st = lethe_errorf(LETHE_ERR_INVALID, "messages[%zu].tool_calls must be an array", i);
                goto done;
            }
            if ((st = normalize_calls(calls, i)) != LETHE_OK) goto done;
            if (cJSON_GetArraySize(calls) > 0) m[i].tool_calls = calls;
        }
        const cJSON *rc = cJSON_GetObjectItemCaseSensitive(it, "reasoning_content");
        if (cJSON_IsString(rc)) m[i].reasoning_content = rc->valuestring;
        m[i].content = texts[i] ? texts[i] : (m[i].tool_calls ? NULL : "");
        i++;
    }
    st = lethe_chat_render_ex(lethe_chat_format_detect(e->tok), m, n, &o, out);
done:
    for (size_t k = 0; texts && k < n; k++) free(texts[k]);
    free(texts);
    free(m);
    cJSON_Delete(kw);
    cJSON_Delete(tools);
    cJSON_Delete(msgs);
    return st;
}

const char *lethe_engine_chat_format(const lethe_engine *e) {
    return e->tok ? lethe_chat_format_name(lethe_chat_format_detect(e->tok)) : NULL;
}

const char *lethe_engine_tool_format(const lethe_engine *e) {
    if (!e->tok) return NULL;
    switch (lethe_chat_tool_style(lethe_chat_format_detect(e->tok))) {
    case LETHE_TOOLS_HERMES: return "hermes";
    case LETHE_TOOLS_LLAMA_JSON: return "llama3_json";
    default: return NULL;
    }
}

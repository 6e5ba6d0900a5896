/* agent.c - tools, tool_choice, parallel_tool_calls, chat_template_kwargs,
 * enable_thinking / preserve_thinking and response_format of a chat request,
 * and the rendering of its messages with them (agent.h).
 *
 * Rules (OpenAI's, as vLLM applies them): tools is an array of at most
 * SRV_MAX_TOOLS {"type": "function", "function": {"name", "description"?,
 * "parameters"? (object), "strict"? (bool)}} with names of 1-64 characters
 * from [A-Za-z0-9_-], no two alike; tool_choice is "none" | "auto" |
 * "required" | {"type": "function", "function": {"name"}} naming one of the
 * tools (default "auto" with tools, "none" without; only "none" without
 * tools); a model whose template has no tool format refuses tools (400).
 * Reasoning is split out for the Qwen3 format unless enable_thinking is
 * false. */
#include "server/agent.h"

#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "core/util.h"

#define SRV_MAX_TOOLS 128

static cJSON *field(const cJSON *root, const char *name) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static bool valid_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 64) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

static int parse_tools(const cJSON *root, srv_agent *a, srv_error *err) {
    const cJSON *tools = field(root, "tools");
    if (!tools) return 0;
    if (!cJSON_IsArray(tools)) return srv_errorf(err, 400, "tools", "'tools' must be an array");
    const int n = cJSON_GetArraySize(tools);
    if (n > SRV_MAX_TOOLS)
        return srv_errorf(err, 400, "tools", "'tools' has %d entries; at most %d are accepted", n, SRV_MAX_TOOLS);
    if (n == 0) return 0;
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        char p[48];
        snprintf(p, sizeof(p), "tools[%d]", i);
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        if (!cJSON_IsObject(t) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") ||
            !cJSON_IsObject(fn))
            return srv_errorf(err, 400, p, "'%s' must be {\"type\": \"function\", \"function\": {...}}", p);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (!cJSON_IsString(name) || !valid_name(name->valuestring))
            return srv_errorf(err, 400, p, "'%s.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _ and -", p);
        const cJSON *d = field(fn, "description"), *params = field(fn, "parameters"), *strict = field(fn, "strict");
        if (d && !cJSON_IsString(d)) return srv_errorf(err, 400, p, "'%s.function.description' must be a string", p);
        if (params && !cJSON_IsObject(params))
            return srv_errorf(err, 400, p, "'%s.function.parameters' must be a JSON Schema object", p);
        if (strict && !cJSON_IsBool(strict)) return srv_errorf(err, 400, p, "'%s.function.strict' must be a boolean", p);
        for (const cJSON *o = tools->child; o != t; o = o->next) {
            const cJSON *on = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "function"), "name");
            if (!strcmp(on->valuestring, name->valuestring))
                return srv_errorf(err, 400, p, "two tools are named '%s'", name->valuestring);
        }
        i++;
    }
    a->tools = cJSON_Duplicate(tools, true);
    a->tools_json = lethe_json_print(tools);
    return 0;
}

static int parse_choice(const cJSON *root, srv_agent *a, srv_error *err) {
    const cJSON *c = field(root, "tool_choice");
    a->choice = a->tools ? SRV_TOOLS_AUTO : SRV_TOOLS_NONE;
    if (!c) return 0;
    if (cJSON_IsString(c)) {
        const char *s = c->valuestring;
        if (!strcmp(s, "none")) a->choice = SRV_TOOLS_NONE;
        else if (!strcmp(s, "auto")) a->choice = SRV_TOOLS_AUTO;
        else if (!strcmp(s, "required")) a->choice = SRV_TOOLS_REQUIRED;
        else
            return srv_errorf(err, 400, "tool_choice",
                              "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}");
    } else if (cJSON_IsObject(c)) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(c, "type");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "function"), "name");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "function") || !cJSON_IsString(name))
            return srv_errorf(err, 400, "tool_choice",
                              "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}");
        a->choice = SRV_TOOLS_NAMED;
        snprintf(a->tool_name, sizeof(a->tool_name), "%s", name->valuestring);
        bool found = false;
        const cJSON *t;
        cJSON_ArrayForEach(t, a->tools) {
            const cJSON *n = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
            found |= !strcmp(n->valuestring, name->valuestring);
        }
        if (!found) {
            char clip[80];
            return srv_errorf(err, 400, "tool_choice", "'tool_choice' names '%s', which is not in 'tools'",
                              srv_clip(name->valuestring, clip, sizeof(clip)));
        }
    } else {
        return srv_errorf(err, 400, "tool_choice", "'tool_choice' must be a string or an object");
    }
    if (a->choice != SRV_TOOLS_NONE && !a->tools)
        return srv_errorf(err, 400, "tool_choice", "'tool_choice' other than \"none\" needs 'tools'");
    return 0;
}

static int parse_kwargs(const cJSON *root, srv_agent *a, srv_error *err) {
    const cJSON *kw = field(root, "chat_template_kwargs");
    if (kw && !cJSON_IsObject(kw)) return srv_errorf(err, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
    cJSON *merged = kw ? cJSON_Duplicate(kw, true) : cJSON_CreateObject();
    const cJSON *et = field(root, "enable_thinking"); /* the anchor's top-level alias */
    int rc = 0;
    if (et && !cJSON_IsBool(et)) rc = srv_errorf(err, 400, "enable_thinking", "'enable_thinking' must be a boolean");
    else if (et && !cJSON_GetObjectItemCaseSensitive(merged, "enable_thinking"))
        cJSON_AddBoolToObject(merged, "enable_thinking", cJSON_IsTrue(et));
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(merged, "enable_thinking");
    if (!rc && v && !cJSON_IsNull(v) && !cJSON_IsBool(v))
        rc = srv_errorf(err, 400, "chat_template_kwargs", "'chat_template_kwargs.enable_thinking' must be a boolean");
    if (cJSON_IsBool(v)) a->enable_thinking = cJSON_IsTrue(v);
    if (!rc && merged->child) a->kwargs_json = lethe_json_print(merged);
    cJSON_Delete(merged);
    return rc;
}

static int parse_response_format(const cJSON *root, srv_agent *a, srv_error *err) {
    const cJSON *rf = field(root, "response_format");
    if (!rf) return 0;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rf, "type");
    if (!cJSON_IsObject(rf) || !cJSON_IsString(type))
        return srv_errorf(err, 400, "response_format", "'response_format' must be an object with a string 'type'");
    const char *t = type->valuestring;
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_object")) {
        a->rf = SRV_RF_JSON_OBJECT;
        return 0;
    }
    if (!strcmp(t, "json_schema")) {
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        const cJSON *schema = js ? field(js, "schema") : NULL;
        if (!cJSON_IsObject(js))
            return srv_errorf(err, 400, "response_format", "'response_format.json_schema' must be an object");
        if (schema && !cJSON_IsObject(schema) && !cJSON_IsBool(schema))
            return srv_errorf(err, 400, "response_format", "'response_format.json_schema.schema' must be a JSON Schema");
        a->rf = SRV_RF_JSON_SCHEMA;
        a->rf_spec = schema ? lethe_json_print(schema) : lethe_xstrdup("{}");
        return 0;
    }
    if (!strcmp(t, "grammar")) {
        const cJSON *gr = cJSON_GetObjectItemCaseSensitive(rf, "grammar");
        if (!cJSON_IsString(gr) || !gr->valuestring[0])
            return srv_errorf(err, 400, "response_format", "'response_format.grammar' must be a non-empty EBNF string");
        a->rf = SRV_RF_GRAMMAR;
        a->rf_spec = lethe_xstrdup(gr->valuestring);
        return 0;
    }
    char clip[80];
    return srv_errorf(err, 400, "response_format",
                      "'response_format.type' must be \"text\", \"json_object\", \"json_schema\" or \"grammar\" "
                      "(got '%s')", srv_clip(t, clip, sizeof(clip)));
}

static srv_tool_fmt model_tool_fmt(const srv_api *api) {
    if (api->tool_parser) {
        if (!strcmp(api->tool_parser, "hermes")) return SRV_TF_HERMES;
        if (!strcmp(api->tool_parser, "llama3_json")) return SRV_TF_LLAMA;
        if (!strcmp(api->tool_parser, "glm45")) return SRV_TF_GLM;
    }
    const char *f = lethe_engine_tool_format(api->engine);
    if (!f) return SRV_TF_NONE;
    return !strcmp(f, "hermes") ? SRV_TF_HERMES : SRV_TF_LLAMA;
}

int srv_agent_parse(const srv_api *api, const cJSON *root, srv_gen *g, srv_error *err) {
    srv_agent *a = lethe_xcalloc(1, sizeof(*a));
    g->agent = a;
    a->enable_thinking = -1;
    a->parallel = true;
    a->preserve_thinking = lethe_engine_chain_mode(api->engine);
    if (parse_tools(root, a, err) || parse_choice(root, a, err) || parse_kwargs(root, a, err) ||
        parse_response_format(root, a, err))
        return -1;
    bool b;
    const cJSON *v = field(root, "parallel_tool_calls");
    if (v) {
        if (!cJSON_IsBool(v)) return srv_errorf(err, 400, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
        a->parallel = cJSON_IsTrue(v);
    }
    if ((v = field(root, "preserve_thinking"))) {
        if (!cJSON_IsBool(v)) return srv_errorf(err, 400, "preserve_thinking", "'preserve_thinking' must be a boolean");
        b = cJSON_IsTrue(v);
        a->preserve_thinking = b;
    }
    const char *cf = api->has_tokenizer ? lethe_engine_chat_format(api->engine) : NULL;
    a->reasoning = cf && !strcmp(cf, "qwen3") && a->enable_thinking != 0;
    a->tool_fmt = model_tool_fmt(api);
    if (a->tools && !lethe_engine_tool_format(api->engine))
        return srv_errorf(err, 400, "tools",
                          "the model's chat template (%s) has no tool-calling format; lethe renders tools for "
                          "Qwen2.5, Qwen3 and Llama-3.1/3.2 templates", cf ? cf : "none");
    if (a->choice == SRV_TOOLS_REQUIRED || a->choice == SRV_TOOLS_NAMED || a->rf != SRV_RF_TEXT)
        return srv_grammar_build(api, g, err); /* grammar.c: the constraint of the request */
    return 0;
}

void srv_agent_free(srv_agent *a) {
    if (!a) return;
    cJSON_Delete(a->tools);
    free(a->tools_json);
    free(a->kwargs_json);
    free(a->rf_spec);
    lethe_grammar_free(a->grammar);
    srv_outparse_free(a->op);
    if (a->msg) srv_message_free(a->msg);
    free(a->msg);
    free(a);
}

int srv_agent_check_message(const cJSON *m, int i, srv_error *err) {
    char p[64];
    const cJSON *calls = field(m, "tool_calls");
    if (calls) {
        snprintf(p, sizeof(p), "messages[%d].tool_calls", i);
        if (!cJSON_IsArray(calls)) return srv_errorf(err, 400, p, "'%s' must be an array", p);
        int j = 0;
        const cJSON *c;
        cJSON_ArrayForEach(c, calls) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
            const cJSON *name = fn ? cJSON_GetObjectItemCaseSensitive(fn, "name") : NULL;
            const cJSON *args = fn ? field(fn, "arguments") : NULL;
            const cJSON *id = field(c, "id");
            if (!cJSON_IsObject(c) || !cJSON_IsObject(fn) || !cJSON_IsString(name) ||
                (args && !cJSON_IsString(args) && !cJSON_IsObject(args)) || (id && !cJSON_IsString(id)))
                return srv_errorf(err, 400, p,
                                  "'%s[%d]' must be {\"id\": str, \"type\": \"function\", \"function\": {\"name\": "
                                  "str, \"arguments\": str}}", p, j);
            j++;
        }
    }
    const char *str_fields[] = {"tool_call_id", "name", "reasoning_content"};
    for (size_t k = 0; k < LETHE_ARRAY_LEN(str_fields); k++) {
        const cJSON *v = field(m, str_fields[k]);
        snprintf(p, sizeof(p), "messages[%d].%s", i, str_fields[k]);
        if (v && !cJSON_IsString(v)) return srv_errorf(err, 400, p, "'%s' must be a string", p);
    }
    return 0;
}

int srv_render_chat(const srv_api *api, const cJSON *msgs, const srv_agent *a, const char *chain_id,
                    bool add_generation_prompt, char **out, srv_error *err) {
    *out = NULL;
    cJSON *copy = cJSON_Duplicate(msgs, true);
    /* the chain holds the reasoning of its turns: put it back where the client dropped it */
    if (chain_id && a && a->preserve_thinking) {
        cJSON *m;
        cJSON_ArrayForEach(m, copy) {
            const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
            if (!cJSON_IsString(role) || strcmp(role->valuestring, "assistant") || field(m, "reasoning_content"))
                continue;
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
            char *r = srv_memo_get(chain_id, cJSON_IsString(c) ? c->valuestring : "", field(m, "tool_calls"));
            if (r) {
                cJSON_DeleteItemFromObjectCaseSensitive(m, "reasoning_content");
                cJSON_AddStringToObject(m, "reasoning_content", r);
                free(r);
            }
        }
    }
    char *text = lethe_json_print(copy);
    cJSON_Delete(copy);
    lethe_chat_options o = {.add_generation_prompt = add_generation_prompt,
                            .tools_json = a ? a->tools_json : NULL,
                            .kwargs_json = a ? a->kwargs_json : NULL,
                            .preserve_thinking = a && a->preserve_thinking};
    int rc = 0;
    if (lethe_engine_apply_chat_json(api->engine, text, &o, out) != 0)
        rc = srv_errorf(err, 400, "messages", "cannot apply the chat template: %s", lethe_engine_last_error());
    free(text);
    return rc;
}

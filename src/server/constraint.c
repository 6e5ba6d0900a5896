/* constraint.c - the output constraint of a chat request (agent.h):
 * response_format and forced tool calls, compiled by the engine
 * (lethe_engine_compile_grammar, xgrammar).
 *
 *   response_format json_schema / json_object: the JSON Schema grammar
 *       (compact, Python's separators); grammar: the EBNF as given;
 *   tool_choice "required" / {"function"}: an xgrammar structural tag that
 *       spells the model's own call format around each tool's parameters
 *       schema, so the forced call is exactly what the template renders
 *       back:
 *         hermes  <tool_call>\n{"name": "N", "arguments": <schema>}\n</tool_call>
 *                 ("\n" between calls; one call when parallel_tool_calls is false)
 *         llama   {"name": "N", "parameters": <schema>} (one call)
 *         glm     <tool_call>N\n<arg_key>..</arg_key>\n<arg_value>..</arg_value>..</tool_call>
 *       required: any of the tools; named: that one.
 * A Qwen3 request that thinks (enable_thinking not false) first gets its
 * free "<think>...</think>\n\n" block, then the constraint. */
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "core/util.h"
#include "server/agent.h"

static cJSON *const_str(const char *s) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "const_string");
    cJSON_AddStringToObject(o, "value", s);
    return o;
}

static cJSON *schema_elem(const cJSON *schema, const char *style) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "json_schema");
    cJSON_AddItemToObject(o, "json_schema", schema ? cJSON_Duplicate(schema, true) : cJSON_Parse("{\"type\": \"object\"}"));
    if (style) cJSON_AddStringToObject(o, "style", style);
    /* structural tags allow free whitespace in JSON: at most one in a row, so
     * a model cannot spend its tokens on blanks (xgrammar's bound) */
    cJSON_AddNumberToObject(o, "max_whitespace_cnt", 1);
    return o;
}

static cJSON *tag(const char *begin, cJSON *content, const char *end) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "tag");
    cJSON_AddStringToObject(o, "begin", begin);
    cJSON_AddItemToObject(o, "content", content);
    cJSON_AddStringToObject(o, "end", end);
    return o;
}

/* the call tag of one tool in the model's format */
static cJSON *call_tag(srv_tool_fmt fmt, const cJSON *tool) {
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
    const char *name = cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring;
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    if (params && !cJSON_IsObject(params)) params = NULL;
    lethe_sbuf b = {0};
    switch (fmt) {
    case SRV_TF_LLAMA:
        lethe_sbuf_puts(&b, "{\"name\": \"");
        lethe_sbuf_puts(&b, name);
        lethe_sbuf_puts(&b, "\", \"parameters\": ");
        break;
    case SRV_TF_GLM:
        lethe_sbuf_puts(&b, "<tool_call>");
        lethe_sbuf_puts(&b, name);
        lethe_sbuf_puts(&b, "\n");
        break;
    default:
        lethe_sbuf_puts(&b, "<tool_call>\n{\"name\": \"");
        lethe_sbuf_puts(&b, name);
        lethe_sbuf_puts(&b, "\", \"arguments\": ");
    }
    const char *end = fmt == SRV_TF_LLAMA ? "}" : fmt == SRV_TF_GLM ? "</tool_call>" : "}\n</tool_call>";
    /* a function without parameters takes none: the empty object */
    cJSON *none = params ? NULL : cJSON_Parse("{\"type\": \"object\", \"properties\": {}, \"additionalProperties\": false}");
    cJSON *t = tag(b.s, schema_elem(params ? params : none, fmt == SRV_TF_GLM ? "glm_xml" : NULL), end);
    cJSON_Delete(none);
    free(b.s);
    return t;
}

static cJSON *tools_format(const srv_agent *a) {
    cJSON *tags = cJSON_CreateArray();
    const cJSON *t;
    cJSON_ArrayForEach(t, a->tools) {
        const char *name =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name")->valuestring;
        if (a->choice == SRV_TOOLS_NAMED && strcmp(name, a->tool_name)) continue;
        cJSON_AddItemToArray(tags, call_tag(a->tool_fmt, t));
    }
    if (a->choice == SRV_TOOLS_NAMED) { /* one call of that function */
        cJSON *one = cJSON_DetachItemFromArray(tags, 0);
        cJSON_Delete(tags);
        return one;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "tags_with_separator");
    cJSON_AddItemToObject(o, "tags", tags);
    cJSON_AddStringToObject(o, "separator", a->tool_fmt == SRV_TF_LLAMA ? "; " : "\n");
    cJSON_AddBoolToObject(o, "at_least_one", true);
    cJSON_AddBoolToObject(o, "stop_after_first", !a->parallel || a->tool_fmt == SRV_TF_LLAMA);
    return o;
}

int srv_grammar_build(const srv_api *api, srv_gen *g, srv_error *err) {
    srv_agent *a = g->agent;
    const bool tools = a->choice == SRV_TOOLS_REQUIRED || a->choice == SRV_TOOLS_NAMED;
    const char *param = tools ? "tool_choice" : "response_format";
    if (tools && a->tool_fmt == SRV_TF_NONE)
        return srv_errorf(err, 400, param, "forced tool calls need a model with a tool-calling format");
    lethe_grammar_kind kind;
    char *spec = NULL;
    if (!tools && !a->reasoning) { /* a plain JSON Schema / object / EBNF grammar */
        kind = a->rf == SRV_RF_JSON_SCHEMA ? LETHE_GRAMMAR_JSON_SCHEMA
               : a->rf == SRV_RF_GRAMMAR   ? LETHE_GRAMMAR_EBNF
                                           : LETHE_GRAMMAR_JSON_OBJECT;
        spec = a->rf_spec ? lethe_xstrdup(a->rf_spec) : NULL;
    } else {
        cJSON *body;
        if (tools) {
            body = tools_format(a);
        } else if (a->rf == SRV_RF_GRAMMAR) {
            body = cJSON_CreateObject();
            cJSON_AddStringToObject(body, "type", "grammar");
            cJSON_AddStringToObject(body, "grammar", a->rf_spec);
        } else {
            cJSON *schema = a->rf == SRV_RF_JSON_SCHEMA ? lethe_json_parse(a->rf_spec, strlen(a->rf_spec)) : NULL;
            body = schema_elem(schema, NULL);
            cJSON_Delete(schema);
        }
        if (a->reasoning) { /* Qwen3 thinks first: a free think block, then the constraint */
            cJSON *any = cJSON_CreateObject();
            cJSON_AddStringToObject(any, "type", "any_text");
            cJSON *seq = cJSON_CreateObject();
            cJSON_AddStringToObject(seq, "type", "sequence");
            cJSON *el = cJSON_AddArrayToObject(seq, "elements");
            cJSON_AddItemToArray(el, tag("<think>", any, "</think>"));
            cJSON_AddItemToArray(el, const_str("\n\n"));
            cJSON_AddItemToArray(el, body);
            body = seq;
        }
        cJSON *st = cJSON_CreateObject();
        cJSON_AddStringToObject(st, "type", "structural_tag");
        cJSON_AddItemToObject(st, "format", body);
        spec = lethe_json_print(st);
        cJSON_Delete(st);
        kind = LETHE_GRAMMAR_STRUCTURAL_TAG;
    }
    int rc = 0;
    if (lethe_engine_compile_grammar(api->engine, kind, spec, &a->grammar) != 0)
        rc = srv_errorf(err, 400, param, "%s", lethe_engine_last_error());
    free(spec);
    return rc;
}

/* chat_llama.c - the Llama-3.1 / 3.3 and Llama-3.2 chat formats (Meta's
 * JSON tool calling), as their Jinja templates render them:
 *
 *   [<|begin_of_text|>]<|start_header_id|>system<|end_header_id|>\n\n
 *   ["Environment: ipython\n" with tools]
 *   "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
 *   [tools as tojson(indent=4) + "\n\n" each, when tools_in_user_message is false]
 *   {system message, trimmed}<|eot_id|>
 *   [with tools in the user message (the default): the first message after
 *    the system one becomes a user turn "Given the following functions ..."
 *    + the tools + its trimmed content]
 *   per message: <|start_header_id|>{role}<|end_header_id|>\n\n{trim(content)}<|eot_id|>;
 *   a message with tool_calls (exactly one): an assistant turn
 *   {"name": "<name>", "parameters": <tojson(arguments)>}<|eot_id|>;
 *   tool / ipython: <|start_header_id|>ipython<|end_header_id|>\n\n
 *   {tojson(content)}<|eot_id|> (a string is iterable in Jinja: tojson'd)
 *   [<|start_header_id|>assistant<|end_header_id|>\n\n]
 * {date}: date_string, else "26 Jul 2024" (3.1) or today, "%d %b %Y" (3.2,
 * strftime_now). builtin_tools (<|python_tag|> calls) are not rendered. */
#include <string.h>
#include <time.h>

#include "core/status.h"
#include "tokenizer/chat_internal.h"

static void put_trim(lethe_sbuf *b, const char *s) {
    const char *e = s + strlen(s);
    chat_py_strip(&s, &e);
    cput(b, s, (size_t)(e - s));
}

static void tools_json(lethe_sbuf *b, const cJSON *tools) {
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        lethe_json_dump_py(b, t, 4);
        cputs(b, "\n\n");
    }
}

static void header(lethe_sbuf *b, const char *role) {
    cputs(b, "<|start_header_id|>");
    cputs(b, role);
    cputs(b, "<|end_header_id|>\n\n");
}

lethe_status chat_render_llama31(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, const lethe_chat_opts *o,
                                 bool v32) {
    static const char RESPOND[] = "Respond in the format {\"name\": function name, \"parameters\": dictionary of "
                                  "argument name and its value}.Do not use variables.\n\n";
    const bool in_user = o->tools_in_user_message != 0;
    char today[32];
    const char *date = o->date_string;
    if (!date && v32) {
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        strftime(today, sizeof(today), "%d %b %Y", &tm);
        date = today;
    }
    if (!date) date = "26 Jul 2024";
    if (o->include_bos) cputs(b, "<|begin_of_text|>");
    size_t i = 0;
    const char *system = "";
    if (n > 0 && !strcmp(m[0].role, "system")) system = m[i++].content;
    header(b, "system");
    if (o->tools) cputs(b, "Environment: ipython\n");
    cputs(b, "Cutting Knowledge Date: December 2023\nToday Date: ");
    cputs(b, date);
    cputs(b, "\n\n");
    if (o->tools && !in_user) {
        cputs(b, "You have access to the following functions. To call a function, please respond with JSON for "
                 "a function call.");
        cputs(b, RESPOND);
        tools_json(b, o->tools);
    }
    put_trim(b, system);
    cputs(b, "<|eot_id|>");
    if (in_user && o->tools) {
        if (i >= n)
            return lethe_errorf(LETHE_ERR_INVALID, "Cannot put tools in the first user message when there's no "
                                                   "first user message!");
        header(b, "user");
        cputs(b, "Given the following functions, please respond with a JSON for a function call with its proper "
                 "arguments that best answers the given prompt.\n\n");
        cputs(b, RESPOND);
        tools_json(b, o->tools);
        put_trim(b, m[i++].content);
        cputs(b, "<|eot_id|>");
    }
    for (; i < n; i++) {
        const char *role = m[i].role;
        const bool tool = !strcmp(role, "tool") || !strcmp(role, "ipython");
        if (m[i].tool_calls) {
            if (cJSON_GetArraySize(m[i].tool_calls) != 1)
                return lethe_errorf(LETHE_ERR_INVALID, "This model only supports single tool-calls at once!");
            const cJSON *fn = chat_call_fn(cJSON_GetArrayItem(m[i].tool_calls, 0));
            header(b, "assistant");
            cputs(b, "{\"name\": \"");
            cputs(b, chat_call_name(fn));
            cputs(b, "\", \"parameters\": ");
            chat_put_args(b, fn, false);
            cputs(b, "}<|eot_id|>");
        } else if (tool) {
            header(b, "ipython");
            cJSON *s = cJSON_CreateString(m[i].content);
            lethe_json_dump_py(b, s, -1);
            cJSON_Delete(s);
            cputs(b, "<|eot_id|>");
        } else {
            header(b, role);
            put_trim(b, m[i].content);
            cputs(b, "<|eot_id|>");
        }
    }
    if (o->add_generation_prompt) header(b, "assistant");
    return LETHE_OK;
}

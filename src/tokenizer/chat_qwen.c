/* chat_qwen.c - the Qwen2.5 and Qwen3 chat formats, as their Jinja
 * templates render them (ChatML turns; tools in the system turn).
 *
 * Tools block (both): "# Tools\n\nYou may call one or more functions ...
 * <tools>" then per tool "\n" + tojson(tool), then "\n</tools>\n\n For each
 * function call, ... </tool_call><|im_end|>\n". Qwen3 opens the system turn
 * with the system message + "\n\n" (if any); Qwen2.5 with the system message
 * or its default prompt, then "\n\n".
 * Assistant tool calls: "<tool_call>\n{"name": "<name>", "arguments":
 * <tojson(arguments)>}\n</tool_call>" per call (Qwen3 keeps string arguments
 * verbatim; Qwen2.5 tojson's them). Tool messages: "\n<tool_response>\n
 * {content}\n</tool_response>" blocks, consecutive ones in one user turn.
 * Qwen3 reasoning: assistant content "...</think>" is split into reasoning
 * and content unless reasoning_content is given; turns after the last real
 * user query that are last or have reasoning get "<think>\n{reasoning}\n
 * </think>\n\n" (preserve_thinking extends that to every turn with
 * reasoning); enable_thinking=false closes an empty think block after the
 * generation prompt. */
#include <string.h>

#include "core/status.h"
#include "tokenizer/chat_internal.h"

static const char QWEN25_DEFAULT_SYSTEM[] = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

static void tools_block(lethe_sbuf *b, const cJSON *tools) {
    cputs(b, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
             "You are provided with function signatures within <tools></tools> XML tags:\n<tools>");
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        cputs(b, "\n");
        lethe_json_dump_py(b, t, -1);
    }
    cputs(b, "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
             "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
             "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n");
}

static void tool_call(lethe_sbuf *b, const cJSON *call, bool verbatim) {
    const cJSON *fn = chat_call_fn(call);
    cputs(b, "<tool_call>\n{\"name\": \"");
    cputs(b, chat_call_name(fn));
    cputs(b, "\", \"arguments\": ");
    chat_put_args(b, fn, verbatim);
    cputs(b, "}\n</tool_call>");
}

/* tool message i: opens the user turn after a non-tool message, closes it before one */
static void tool_response(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, size_t i) {
    if (i == 0 || strcmp(m[i - 1].role, "tool") != 0) cputs(b, "<|im_start|>user");
    cputs(b, "\n<tool_response>\n");
    cputs(b, m[i].content);
    cputs(b, "\n</tool_response>");
    if (i + 1 == n || strcmp(m[i + 1].role, "tool") != 0) cputs(b, "<|im_end|>\n");
}

static void plain_turn(lethe_sbuf *b, const lethe_chat_msg *m) {
    cputs(b, "<|im_start|>");
    cputs(b, m->role);
    cputs(b, "\n");
    cputs(b, m->content);
    cputs(b, "<|im_end|>\n");
}

/* ---- Qwen3 ---- */

static void qwen3_assistant(lethe_sbuf *b, const lethe_chat_msg *msg, bool think_block, bool last) {
    const char *content = msg->content;
    const char *cb = content, *ce = content + strlen(content);
    const char *rb = ce, *re = ce; /* reasoning: empty */
    if (msg->reasoning_content) {
        rb = msg->reasoning_content;
        re = rb + strlen(rb);
    } else if (strstr(content, "</think>")) {
        /* content.split('</think>')[-1].lstrip('\n') */
        cb = chat_find_last(content, ce, "</think>") + strlen("</think>");
        chat_strip_nl(&cb, &ce, true, false);
        /* content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
        rb = content;
        re = strstr(content, "</think>");
        chat_strip_nl(&rb, &re, false, true);
        const char *open = chat_find_last(rb, re, "<think>");
        if (open) rb = open + strlen("<think>");
        chat_strip_nl(&rb, &re, true, false);
    }
    const bool has_content = ce > cb; /* the template's `content` test (before its lstrip) */
    cputs(b, "<|im_start|>assistant\n");
    if (think_block && (last || re > rb)) {
        cputs(b, "<think>\n");
        chat_strip_nl(&rb, &re, true, true);
        cput(b, rb, (size_t)(re - rb));
        cputs(b, "\n</think>\n\n");
        chat_strip_nl(&cb, &ce, true, false);
    }
    cput(b, cb, (size_t)(ce - cb));
    if (chat_has_calls(msg)) {
        int j = 0;
        const cJSON *call;
        cJSON_ArrayForEach(call, msg->tool_calls) {
            if (j > 0 || has_content) cputs(b, "\n");
            tool_call(b, call, true);
            j++;
        }
    }
    cputs(b, "<|im_end|>\n");
}

lethe_status chat_render_qwen3(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, const lethe_chat_opts *o) {
    const bool sys0 = n > 0 && !strcmp(m[0].role, "system");
    if (o->tools) {
        cputs(b, "<|im_start|>system\n");
        if (sys0) {
            cputs(b, m[0].content);
            cputs(b, "\n\n");
        }
        tools_block(b, o->tools);
    } else if (sys0) {
        plain_turn(b, &m[0]);
    }
    /* the last user message that is not a wrapped tool response */
    size_t last_query = n ? n - 1 : 0;
    for (size_t k = n; k-- > 0;) {
        if (!strcmp(m[k].role, "user") &&
            !(chat_has_prefix(m[k].content, "<tool_response>") && chat_has_suffix(m[k].content, "</tool_response>"))) {
            last_query = k;
            break;
        }
    }
    for (size_t i = 0; i < n; i++) {
        const char *role = m[i].role;
        if (!strcmp(role, "user") || (!strcmp(role, "system") && i > 0)) {
            plain_turn(b, &m[i]);
        } else if (!strcmp(role, "assistant")) {
            qwen3_assistant(b, &m[i], i > last_query || o->preserve_thinking, i + 1 == n);
        } else if (!strcmp(role, "tool")) {
            tool_response(b, m, n, i);
        }
    }
    if (o->add_generation_prompt) {
        cputs(b, "<|im_start|>assistant\n");
        if (o->enable_thinking == 0) cputs(b, "<think>\n\n</think>\n\n");
    }
    return LETHE_OK;
}

/* ---- Qwen2.5 ---- */

lethe_status chat_render_qwen25(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, const lethe_chat_opts *o) {
    const bool sys0 = n > 0 && !strcmp(m[0].role, "system");
    const char *system = sys0 ? m[0].content : QWEN25_DEFAULT_SYSTEM;
    cputs(b, "<|im_start|>system\n");
    cputs(b, system);
    if (o->tools) {
        cputs(b, "\n\n");
        tools_block(b, o->tools);
    } else {
        cputs(b, "<|im_end|>\n");
    }
    for (size_t i = 0; i < n; i++) {
        const char *role = m[i].role;
        const bool asst = !strcmp(role, "assistant");
        if (!strcmp(role, "user") || (!strcmp(role, "system") && i > 0) || (asst && !chat_has_calls(&m[i]))) {
            plain_turn(b, &m[i]);
        } else if (asst) {
            cputs(b, "<|im_start|>assistant");
            if (m[i].content[0]) {
                cputs(b, "\n");
                cputs(b, m[i].content);
            }
            const cJSON *call;
            cJSON_ArrayForEach(call, m[i].tool_calls) {
                cputs(b, "\n");
                tool_call(b, call, false);
            }
            cputs(b, "<|im_end|>\n");
        } else if (!strcmp(role, "tool")) {
            tool_response(b, m, n, i);
        }
    }
    if (o->add_generation_prompt) cputs(b, "<|im_start|>assistant\n");
    return LETHE_OK;
}

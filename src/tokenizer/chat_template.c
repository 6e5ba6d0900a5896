/* chat_template.c - format detection, the plain formats and dispatch.
 *
 *   ChatML   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
 *   SmolLM2  ChatML; when messages[0] is not a system message, the template
 *            first emits "<|im_start|>system\nYou are a helpful AI assistant
 *            named SmolLM, trained by Hugging Face<|im_end|>\n"
 *   Llama-3  [<|begin_of_text|>]<|start_header_id|>{role}<|end_header_id|>\n\n
 *            {content stripped of whitespace (Jinja trim)}<|eot_id|> ...
 *            [<|start_header_id|>assistant<|end_header_id|>\n\n]
 *            (the Llama-3.0 Instruct format: no default system prompt)
 * Qwen2.5 / Qwen3 are in chat_qwen.c, Llama-3.1 / 3.2 in chat_llama.c.
 * Detection reads the template text stored in the model, else the special
 * tokens present. */
#include "tokenizer/chat_template.h"

#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "tokenizer/chat_internal.h"
#include "tokenizer/tokenizer.h"

lethe_chat_format lethe_chat_format_detect_text(const char *tmpl, bool *exact) {
    bool ex = false;
    lethe_chat_format f = LETHE_CHAT_CHATML;
    if (tmpl && strstr(tmpl, "<|start_header_id|>")) {
        f = LETHE_CHAT_LLAMA3;
        if (strstr(tmpl, "Environment: ipython") && strstr(tmpl, "tools_in_user_message")) {
            f = strstr(tmpl, "strftime_now") ? LETHE_CHAT_LLAMA32 : LETHE_CHAT_LLAMA31;
            ex = true;
        } else {
            ex = !strstr(tmpl, "tool");
        }
    } else if (tmpl && strstr(tmpl, "<|im_start|>")) {
        if (strstr(tmpl, "You are a helpful AI assistant named SmolLM")) {
            f = LETHE_CHAT_SMOLLM2;
            ex = true;
        } else if (strstr(tmpl, "</think>") || strstr(tmpl, "reasoning_content")) {
            f = LETHE_CHAT_QWEN3;
            ex = strstr(tmpl, "last_query_index") != NULL;
        } else if (strstr(tmpl, "<tool_call>") && strstr(tmpl, "You are Qwen, created by Alibaba Cloud")) {
            f = LETHE_CHAT_QWEN25;
            ex = true;
        } else {
            ex = !strstr(tmpl, "tool");
        }
    }
    if (exact) *exact = ex;
    return f;
}

lethe_chat_format lethe_chat_format_detect(const lethe_tokenizer *t) {
    const char *tmpl = t ? lethe_tokenizer_chat_template(t) : NULL;
    if (tmpl) return lethe_chat_format_detect_text(tmpl, NULL);
    if (t && lethe_tokenizer_find_token(t, "<|start_header_id|>") >= 0) return LETHE_CHAT_LLAMA3;
    return LETHE_CHAT_CHATML;
}

const char *lethe_chat_format_name(lethe_chat_format f) {
    switch (f) {
    case LETHE_CHAT_CHATML: return "chatml";
    case LETHE_CHAT_LLAMA3: return "llama3";
    case LETHE_CHAT_SMOLLM2: return "smollm2";
    case LETHE_CHAT_QWEN3: return "qwen3";
    case LETHE_CHAT_QWEN25: return "qwen2.5";
    case LETHE_CHAT_LLAMA31: return "llama3.1";
    case LETHE_CHAT_LLAMA32: return "llama3.2";
    }
    return "unknown";
}

lethe_tool_style lethe_chat_tool_style(lethe_chat_format f) {
    switch (f) {
    case LETHE_CHAT_QWEN3:
    case LETHE_CHAT_QWEN25: return LETHE_TOOLS_HERMES;
    case LETHE_CHAT_LLAMA31:
    case LETHE_CHAT_LLAMA32: return LETHE_TOOLS_LLAMA_JSON;
    default: return LETHE_TOOLS_NONE;
    }
}

/* Python str.isspace() for the code point starting at s (its byte length in *len), 0 if not */
static int py_space_at(const unsigned char *s, size_t n) {
    if (n >= 1 && ((s[0] >= 0x09 && s[0] <= 0x0D) || (s[0] >= 0x1C && s[0] <= 0x20))) return 1;
    if (n >= 2 && s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0)) return 2;
    if (n >= 3 && s[0] == 0xE1 && s[1] == 0x9A && s[2] == 0x80) return 3; /* U+1680 */
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x80 &&
        (s[2] <= 0x8A || s[2] == 0xA8 || s[2] == 0xA9 || s[2] == 0xAF)) return 3; /* U+2000-200A, 2028, 2029, 202F */
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x81 && s[2] == 0x9F) return 3; /* U+205F */
    if (n >= 3 && s[0] == 0xE3 && s[1] == 0x80 && s[2] == 0x80) return 3; /* U+3000 */
    return 0;
}

/* Jinja's trim (Python str.strip()): [*b, *e) shrinks to the stripped range */
void chat_py_strip(const char **b, const char **e) {
    int k;
    while (*b < *e && (k = py_space_at((const unsigned char *)*b, (size_t)(*e - *b))) > 0) *b += k;
    for (;;) {
        const char *p = *e;
        bool found = false;
        for (int back = 1; back <= 3 && p - back >= *b; back++) {
            k = py_space_at((const unsigned char *)(p - back), (size_t)back);
            if (k == back) {
                *e -= back;
                found = true;
                break;
            }
        }
        if (!found) return;
    }
}

void chat_strip_nl(const char **b, const char **e, bool left, bool right) {
    while (left && *b < *e && **b == '\n') (*b)++;
    while (right && *e > *b && (*e)[-1] == '\n') (*e)--;
}

/* last occurrence of needle in [b, e), or NULL */
const char *chat_find_last(const char *b, const char *e, const char *needle) {
    size_t n = strlen(needle);
    for (const char *p = e - n; p >= b && e - b >= (ptrdiff_t)n; p--)
        if (memcmp(p, needle, n) == 0) return p;
    return NULL;
}

bool chat_has_prefix(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }
bool chat_has_suffix(const char *s, const char *x) {
    size_t n = strlen(s), m = strlen(x);
    return n >= m && memcmp(s + n - m, x, m) == 0;
}

const cJSON *chat_call_fn(const cJSON *call) {
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
    return (fn && !cJSON_IsNull(fn)) ? fn : call;
}

const char *chat_call_name(const cJSON *fn) {
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(fn, "name");
    return cJSON_IsString(n) ? n->valuestring : "";
}

void chat_put_args(lethe_sbuf *b, const cJSON *fn, bool verbatim_strings) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
    if (!a) return cputs(b, "null");
    if (verbatim_strings && cJSON_IsString(a)) return cputs(b, a->valuestring);
    lethe_json_dump_py(b, a, -1);
}

bool chat_has_calls(const lethe_chat_msg *m) {
    return m->tool_calls && cJSON_IsArray(m->tool_calls) && cJSON_GetArraySize(m->tool_calls) > 0;
}

static void render_chatml(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, bool smollm) {
    if (smollm && n > 0 && strcmp(m[0].role, "system") != 0)
        cputs(b, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n");
    for (size_t i = 0; i < n; i++) {
        cputs(b, "<|im_start|>");
        cputs(b, m[i].role);
        cputs(b, "\n");
        cputs(b, m[i].content);
        cputs(b, "<|im_end|>\n");
    }
}

static void render_llama3(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, bool include_bos) {
    if (include_bos) cputs(b, "<|begin_of_text|>");
    for (size_t i = 0; i < n; i++) {
        cputs(b, "<|start_header_id|>");
        cputs(b, m[i].role);
        cputs(b, "<|end_header_id|>\n\n");
        const char *cb = m[i].content, *ce = cb + strlen(cb);
        chat_py_strip(&cb, &ce);
        cput(b, cb, (size_t)(ce - cb));
        cputs(b, "<|eot_id|>");
    }
}

lethe_status lethe_chat_render_ex(lethe_chat_format f, const lethe_chat_msg *msgs, size_t n,
                                  const lethe_chat_opts *opts, char **out) {
    *out = NULL;
    lethe_chat_opts o = {.add_generation_prompt = true, .include_bos = true, .enable_thinking = -1,
                         .tools_in_user_message = -1};
    if (opts) o = *opts;
    bool calls = false;
    for (size_t i = 0; i < n; i++) {
        const bool c = chat_has_calls(&msgs[i]);
        calls |= c;
        if (!msgs[i].role || (!msgs[i].content && !c))
            return lethe_errorf(LETHE_ERR_INVALID, "chat message %zu has no %s", i, msgs[i].role ? "content" : "role");
    }
    const bool tools = o.tools && cJSON_IsArray(o.tools) && cJSON_GetArraySize(o.tools) > 0;
    if ((tools || calls) && lethe_chat_tool_style(f) == LETHE_TOOLS_NONE)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "the model's chat template (%s) has no tool-calling format: lethe renders tools "
                            "for Qwen2.5, Qwen3 and Llama-3.1/3.2 templates", lethe_chat_format_name(f));
    if (!tools) o.tools = NULL;
    /* the plain formats read content only; a missing one (tool calls) renders as "" */
    lethe_chat_msg *m = lethe_xmalloc((n ? n : 1) * sizeof(*m));
    for (size_t i = 0; i < n; i++) {
        m[i] = msgs[i];
        if (!m[i].content) m[i].content = "";
    }
    lethe_sbuf b = {0};
    cput(&b, "", 0);
    lethe_status st = LETHE_OK;
    switch (f) {
    case LETHE_CHAT_CHATML:
    case LETHE_CHAT_SMOLLM2:
        render_chatml(&b, m, n, f == LETHE_CHAT_SMOLLM2);
        if (o.add_generation_prompt) cputs(&b, "<|im_start|>assistant\n");
        break;
    case LETHE_CHAT_QWEN3: st = chat_render_qwen3(&b, m, n, &o); break;
    case LETHE_CHAT_QWEN25: st = chat_render_qwen25(&b, m, n, &o); break;
    case LETHE_CHAT_LLAMA31:
    case LETHE_CHAT_LLAMA32: st = chat_render_llama31(&b, m, n, &o, f == LETHE_CHAT_LLAMA32); break;
    case LETHE_CHAT_LLAMA3:
        render_llama3(&b, m, n, o.include_bos);
        if (o.add_generation_prompt) cputs(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    default: st = lethe_errorf(LETHE_ERR_INVALID, "unknown chat format %d", (int)f);
    }
    free(m);
    if (st != LETHE_OK) {
        free(b.s);
        return st;
    }
    *out = b.s;
    return LETHE_OK;
}

lethe_status lethe_chat_render(lethe_chat_format f, const lethe_chat_msg *msgs, size_t n,
                               bool add_generation_prompt, bool include_bos, char **out) {
    lethe_chat_opts o = {.add_generation_prompt = add_generation_prompt, .include_bos = include_bos,
                         .enable_thinking = -1, .tools_in_user_message = -1};
    return lethe_chat_render_ex(f, msgs, n, &o, out);
}

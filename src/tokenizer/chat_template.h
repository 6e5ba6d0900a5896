/* chat_template.h - renders chat messages to a prompt string.
 *
 * Built-in formats chosen from model metadata, each rendering exactly what
 * the model's own Jinja template renders through HF apply_chat_template
 * (golden tests: tests/data/tokenizer/chat_golden.txt and, with tools,
 * chat_tools_golden.jsonl). Detection looks at the template text stored in
 * the model (or the special tokens present). Tools, tool calls and tool
 * results exist in the formats whose templates have them (Qwen2.5, Qwen3,
 * Llama-3.1/3.2); giving them to another format is LETHE_ERR_UNSUPPORTED. */
#ifndef LETHE_CHAT_TEMPLATE_H
#define LETHE_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

#include "core/status.h"

typedef struct lethe_tokenizer lethe_tokenizer;

typedef enum lethe_chat_format {
    LETHE_CHAT_CHATML = 0,   /* <|im_start|>role\ncontent<|im_end|>\n */
    LETHE_CHAT_LLAMA3,       /* Llama-3.0: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
    LETHE_CHAT_SMOLLM2,      /* ChatML; a conversation not starting with a system message gets
                                SmolLM2's default one ("You are a helpful AI assistant named SmolLM,
                                trained by Hugging Face") */
    LETHE_CHAT_QWEN3,        /* ChatML as Qwen3's template renders it: assistant turns after the
                                last user message carry a <think>...</think> block (empty when the
                                content has none), earlier ones have their reasoning stripped;
                                tools in the system turn, <tool_call> JSON in assistant turns, tool
                                messages as <tool_response> blocks in a user turn; enable_thinking */
    LETHE_CHAT_QWEN25,       /* Qwen2.5: ChatML, default system prompt "You are Qwen, created by
                                Alibaba Cloud. You are a helpful assistant.", the same tool blocks */
    LETHE_CHAT_LLAMA31,      /* Llama-3.1 / 3.3: a system turn with the knowledge and today dates
                                ("26 Jul 2024" unless date_string), tools as indented JSON in the
                                first user turn, calls as {"name", "parameters"}, results in ipython
                                turns */
    LETHE_CHAT_LLAMA32,      /* Llama-3.2: as 3.1, today's date from the clock (strftime_now) */
} lethe_chat_format;

/* How a format's model writes tool calls (the output parser to use). */
typedef enum lethe_tool_style {
    LETHE_TOOLS_NONE = 0,    /* the template has no tool format */
    LETHE_TOOLS_HERMES,      /* <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> */
    LETHE_TOOLS_LLAMA_JSON,  /* {"name": ..., "parameters": {...}} as the whole message */
} lethe_tool_style;

typedef struct lethe_chat_msg {
    const char *role;        /* "system", "user", "assistant", "tool" */
    const char *content;     /* NULL only for an assistant message with tool_calls */
    /* optional (zero = absent) */
    const cJSON *tool_calls; /* assistant: array of {"id", "type", "function": {"name",
                                "arguments": object (or a string kept verbatim)}} */
    const char *reasoning_content; /* assistant reasoning given apart from content */
} lethe_chat_msg;

typedef struct lethe_chat_opts {
    bool add_generation_prompt;
    bool include_bos;        /* prepend the BOS text where the format has one (Llama-3
                                "<|begin_of_text|>"); false when rendering an appended slice */
    const cJSON *tools;      /* array of {"type": "function", "function": {...}} or NULL */
    int enable_thinking;     /* Qwen3: -1 undefined (thinking), 0 false, 1 true */
    /* Qwen3, lethe's choice for the Chain Cache: every assistant turn with
     * reasoning keeps its <think> block (the template drops it before the last
     * user message), so a conversation re-renders to the tokens the chain holds */
    bool preserve_thinking;
    const char *date_string; /* Llama-3.1/3.2 "Today Date"; NULL = the template's default */
    int tools_in_user_message; /* Llama-3.1/3.2: -1 default (true), 0, 1 */
} lethe_chat_opts;

lethe_chat_format lethe_chat_format_detect(const lethe_tokenizer *t);
/* The same from template text alone (NULL: ChatML). *exact = the template
 * text is one of the recognized families (otherwise the result is a guess
 * from the special tokens it uses). */
lethe_chat_format lethe_chat_format_detect_text(const char *tmpl, bool *exact);
const char *lethe_chat_format_name(lethe_chat_format f);
lethe_tool_style lethe_chat_tool_style(lethe_chat_format f);

/* Renders msgs[0..n) with o (NULL = defaults: generation prompt, BOS).
 * *out is malloc'd. Errors: LETHE_ERR_INVALID (a message without role or
 * content, what the template itself raises, e.g. Llama-3.1 with several
 * calls in one message), LETHE_ERR_UNSUPPORTED (tools for a format without
 * a tool format). */
lethe_status lethe_chat_render_ex(lethe_chat_format f, const lethe_chat_msg *msgs, size_t n,
                                  const lethe_chat_opts *o, char **out);
/* Shorthand without tools. */
lethe_status lethe_chat_render(lethe_chat_format f, const lethe_chat_msg *msgs, size_t n,
                               bool add_generation_prompt, bool include_bos, char **out);

#endif /* LETHE_CHAT_TEMPLATE_H */

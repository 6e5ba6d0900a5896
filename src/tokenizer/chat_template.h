/* chat_template.h - renders chat messages to a prompt string.
 *
 * Built-in formats chosen from model metadata: ChatML (plain), SmolLM2
 * (ChatML + its default system prompt), Qwen3 (ChatML + its <think> rules)
 * and Llama-3. Full Jinja templates come later; detection looks at the
 * template text stored in the model (or the special tokens present). */
#ifndef LETHE_CHAT_TEMPLATE_H
#define LETHE_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include "core/status.h"

typedef struct lethe_tokenizer lethe_tokenizer;

typedef enum lethe_chat_format {
    LETHE_CHAT_CHATML = 0,   /* <|im_start|>role\ncontent<|im_end|>\n */
    LETHE_CHAT_LLAMA3,       /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
    LETHE_CHAT_SMOLLM2,      /* ChatML; a conversation not starting with a system message gets
                                SmolLM2's default one ("You are a helpful AI assistant named SmolLM,
                                trained by Hugging Face") */
    LETHE_CHAT_QWEN3,        /* ChatML as Qwen3's template renders it: assistant turns after the
                                last user message carry a <think>...</think> block (empty when the
                                content has none), earlier ones have their reasoning stripped;
                                tool messages become <tool_response> blocks in a user turn. Not
                                supported: tools / tool_calls, enable_thinking=false. */
} lethe_chat_format;

typedef struct lethe_chat_msg {
    const char *role;        /* "system", "user", "assistant", "tool" */
    const char *content;
} lethe_chat_msg;

lethe_chat_format lethe_chat_format_detect(const lethe_tokenizer *t);
const char *lethe_chat_format_name(lethe_chat_format f);

/* Renders msgs[0..n) (and the assistant header if add_generation_prompt).
 * include_bos: prepend the model's BOS text where the format has one
 * (Llama-3 "<|begin_of_text|>"); false when rendering an appended slice of a
 * conversation. *out is malloc'd. Output matches HF apply_chat_template for
 * the model's own template (SmolLM2 injects its default system prompt when
 * the conversation has none; golden tests check this). */
lethe_status lethe_chat_render(lethe_chat_format f, const lethe_chat_msg *msgs, size_t n,
                               bool add_generation_prompt, bool include_bos, char **out);

#endif /* LETHE_CHAT_TEMPLATE_H */

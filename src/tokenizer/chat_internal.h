/* chat_internal.h - helpers shared by the chat format renderers
 * (chat_template.c: ChatML / SmolLM2 / Llama-3.0 and dispatch; chat_qwen.c;
 * chat_llama.c). Jinja string methods are Python's: trim = str.strip(),
 * lstrip('\n'), ... on byte ranges [b, e). */
#ifndef LETHE_CHAT_INTERNAL_H
#define LETHE_CHAT_INTERNAL_H

#include <stdbool.h>
#include <string.h>

#include "core/json.h"
#include "tokenizer/chat_template.h"

static inline void cput(lethe_sbuf *b, const char *s, size_t n) { lethe_sbuf_add(b, s, n); }
static inline void cputs(lethe_sbuf *b, const char *s) { lethe_sbuf_add(b, s, strlen(s)); }

/* Python str.strip() on [*b, *e) */
void chat_py_strip(const char **b, const char **e);
/* strip '\n' on the left and/or right */
void chat_strip_nl(const char **b, const char **e, bool left, bool right);
/* last occurrence of needle in [b, e), or NULL */
const char *chat_find_last(const char *b, const char *e, const char *needle);
bool chat_has_prefix(const char *s, const char *p);
bool chat_has_suffix(const char *s, const char *x);

/* tool_call.function if present, else the call itself (Jinja's
 * `if tool_call.function: set tool_call = tool_call.function`) */
const cJSON *chat_call_fn(const cJSON *call);
const char *chat_call_name(const cJSON *fn); /* "" if missing */
/* `tool_call.arguments | tojson` (always) or, with verbatim_strings, a
 * string argument as it is (Qwen3's `is string` test) */
void chat_put_args(lethe_sbuf *b, const cJSON *fn, bool verbatim_strings);
bool chat_has_calls(const lethe_chat_msg *m);

/* each returns LETHE_OK or an error set with lethe_errorf */
lethe_status chat_render_qwen3(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, const lethe_chat_opts *o);
lethe_status chat_render_qwen25(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, const lethe_chat_opts *o);
lethe_status chat_render_llama31(lethe_sbuf *b, const lethe_chat_msg *m, size_t n, const lethe_chat_opts *o,
                                 bool v32);

#endif /* LETHE_CHAT_INTERNAL_H */

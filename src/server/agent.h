/* agent.h - the agent-facing request fields of /v1/chat/completions:
 * tools, tool_choice, parallel_tool_calls, chat_template_kwargs (with the
 * anchor's top-level enable_thinking / preserve_thinking), response_format
 * (agent.c), the output parser that splits reasoning and tool calls out of
 * the generated text (outparse.c), and the reasoning memo that lets a chain
 * re-render its history when the client sends back visible content only
 * (memo.c).
 *
 * Request side: srv_agent_parse validates the fields into g->agent before
 * the messages are rendered; srv_render_chat renders a messages array with
 * them through lethe_engine_apply_chat_json (used for the whole
 * conversation and, in chain_api.c, for an appended slice). */
#ifndef LETHE_SERVER_AGENT_H
#define LETHE_SERVER_AGENT_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "server/openai.h"

typedef enum srv_tool_choice {
    SRV_TOOLS_NONE = 0,     /* no tools, or tool_choice "none": output is content */
    SRV_TOOLS_AUTO,         /* the model may call tools (parsed from its output) */
    SRV_TOOLS_REQUIRED,     /* at least one call, forced by the grammar */
    SRV_TOOLS_NAMED,        /* exactly the named function, forced by the grammar */
} srv_tool_choice;

typedef enum srv_tool_fmt {
    SRV_TF_NONE = 0,
    SRV_TF_HERMES,          /* <tool_call>\n{"name", "arguments"}\n</tool_call> (Qwen2.5/3) */
    SRV_TF_LLAMA,           /* {"name", "parameters"} as the message (Llama-3.1/3.2) */
    SRV_TF_GLM,             /* <tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value></tool_call> (GLM-4.5) */
} srv_tool_fmt;

typedef enum srv_rf {
    SRV_RF_TEXT = 0,
    SRV_RF_JSON_OBJECT,     /* any JSON object */
    SRV_RF_JSON_SCHEMA,     /* json_schema.schema */
    SRV_RF_GRAMMAR,         /* lethe extension: response_format {"type": "grammar", "grammar": EBNF} */
} srv_rf;

typedef struct srv_agent {
    cJSON *tools;               /* validated "tools" array (owned) or NULL */
    char *tools_json;           /* its text for the template, or NULL */
    srv_tool_choice choice;
    char tool_name[80];         /* SRV_TOOLS_NAMED */
    bool parallel;              /* parallel_tool_calls (default true) */
    srv_tool_fmt tool_fmt;      /* the model's (or --tool-call-parser's) format */
    char *kwargs_json;          /* chat_template_kwargs (+ top-level enable_thinking) or NULL */
    int enable_thinking;        /* -1 template default, 0, 1 */
    bool preserve_thinking;     /* default: the server runs the Chain Cache */
    bool reasoning;             /* split <think>...</think> into reasoning_content (Qwen3) */
    srv_rf rf;
    char *rf_spec;              /* schema JSON text or EBNF, owned */
    lethe_grammar *grammar;     /* compiled constraint (owned reference) or NULL */
    /* the response being formatted (format_agent.c) */
    struct srv_outparse *op;    /* streaming: the output parser */
    struct srv_message *msg;    /* what the output added up to so far */
    int n_calls;                /* tool calls in the output */
} srv_agent;

/* Parses the fields above into g->agent (allocated; chat only). */
int srv_agent_parse(const srv_api *api, const cJSON *root, srv_gen *g, srv_error *err);
void srv_agent_free(srv_agent *a); /* NULL-safe, frees a too */
/* Compiles g->agent's constraint (response_format, forced tool calls) into
 * g->agent->grammar (constraint.c). */
int srv_grammar_build(const srv_api *api, srv_gen *g, srv_error *err);

/* The tool-related fields of messages[i] (tool_calls, tool_call_id, name,
 * reasoning_content): types and shapes, with the offending field in err. */
int srv_agent_check_message(const cJSON *m, int i, srv_error *err);

/* Renders msgs (an OpenAI messages array) with the request's tools and
 * template options; chain_id (may be NULL) restores reasoning the client
 * dropped, from the memo. *out malloc'd. */
int srv_render_chat(const srv_api *api, const cJSON *msgs, const srv_agent *a, const char *chain_id,
                    bool add_generation_prompt, char **out, srv_error *err);

/* ---- output parsing (outparse.c) ---- */

typedef struct srv_call_delta {
    int index;                  /* 0-based call index */
    char *id, *name;            /* set on the call's first delta only (owned) */
    char *args;                 /* arguments text appended by this delta (owned, may be "") */
} srv_call_delta;

/* What one piece of output adds to the message. */
typedef struct srv_delta {
    srv_buf reasoning, content;
    srv_call_delta *calls;
    int n_calls, cap_calls;
} srv_delta;

void srv_delta_free(srv_delta *d);
bool srv_delta_empty(const srv_delta *d);

typedef struct srv_outparse srv_outparse;
/* fmt SRV_TF_NONE: no tool parsing; reasoning: split a leading think block */
srv_outparse *srv_outparse_new(srv_tool_fmt fmt, bool reasoning);
void srv_outparse_free(srv_outparse *p);
/* Appends to d what text[0..n) adds (text held back: a possible marker
 * start, trailing whitespace before a call). */
void srv_outparse_push(srv_outparse *p, const char *text, size_t n, srv_delta *d);
/* The output ended: releases what was held back. */
void srv_outparse_finish(srv_outparse *p, srv_delta *d);
int srv_outparse_n_calls(const srv_outparse *p);

/* The whole message of a finished output (non-streaming): reasoning,
 * content and the calls as OpenAI tool_calls objects. */
typedef struct srv_message {
    char *reasoning, *content;  /* owned, "" when empty */
    cJSON *tool_calls;          /* array (owned) or NULL */
} srv_message;
void srv_parse_output(srv_tool_fmt fmt, bool reasoning, const char *text, srv_message *m);
void srv_message_free(srv_message *m);
/* tool_calls of a message built from deltas */
void srv_message_add_delta(srv_message *m, const srv_delta *d);

/* ---- chat responses (format_agent.c; format.c calls them for chat requests) ---- */

/* message fields of a whole response: content (null when empty next to
 * tool calls), reasoning_content, tool_calls; remembers a chain turn's
 * reasoning in the memo */
void srv_agent_message(const srv_gen *g, const char *text, cJSON *message);
/* the stream's chunks for one event (reasoning / content / tool_calls deltas) */
void srv_agent_sse_event(const srv_api *api, const srv_gen *g, const srv_event *ev, size_t text_offset,
                         srv_buf *out);
bool srv_agent_called_tools(const srv_gen *g);

/* ---- the reasoning memo (memo.c) ---- */

/* Remembers the reasoning of a chain turn under (chain id, visible content,
 * tool calls). Thread-safe, bounded (oldest entries go first). */
void srv_memo_put(const char *chain_id, const char *content, const cJSON *tool_calls, const char *reasoning);
/* The reasoning stored for that visible turn, malloc'd, or NULL. */
char *srv_memo_get(const char *chain_id, const char *content, const cJSON *tool_calls);

#endif /* LETHE_SERVER_AGENT_H */

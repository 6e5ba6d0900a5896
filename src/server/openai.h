/* openai.h - the OpenAI API surface: request JSON in (openai.c), response
 * JSON out (format.c). All JSON goes through cJSON.
 *
 * Parsing turns a /v1/completions or /v1/chat/completions body into a
 * srv_gen: prompt token ids (tokenized or chat-templated by the engine's
 * tokenizer) plus lethe_sampling_params, validated with OpenAI/vLLM rules;
 * a bad field yields a srv_error whose status, param and message become an
 * OpenAI-style error body {"error": {"message", "type", "param", "code"}}.
 * Formatting builds whole responses (with usage and logprobs) and SSE
 * chunks for streaming. */
#ifndef LETHE_SERVER_OPENAI_H
#define LETHE_SERVER_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "lethe.h"
#include "server/buf.h"
#include "server/req.h"

typedef struct srv_error {
    int status;                 /* HTTP status */
    char param[64];             /* offending field, "" if none */
    char message[512];
    char code[40];              /* the body's "code" string (chain_mode_disabled, ...);
                                 * "" = the HTTP status number */
} srv_error;

/* Sets *err and returns -1 (so a check reads `return srv_errorf(...)`). */
int srv_errorf(srv_error *err, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
char *srv_error_json(const srv_error *err); /* malloc'd body */

typedef enum srv_kind { SRV_COMPLETION = 0, SRV_CHAT } srv_kind;

/* What the API layer needs to know about the loaded model. */
typedef struct srv_api {
    lethe_engine *engine;
    const char *served_name;    /* the id in /v1/models and responses */
    const char *model_path;     /* --model as given (also accepted as `model`) */
    int32_t max_model_len;
    int64_t created;            /* server start time (unix seconds) */
    bool has_tokenizer;         /* false for dummy weights: token-id prompts only, empty text */
    const char *tool_parser;    /* --tool-call-parser: NULL/"auto" = the chat template's format */
    bool replica;               /* --replica: an unknown chain id is 410 chain_gone, not 404 */
} srv_api;

/* Chain fields a request carries in headers, for a load balancer to route by
 * (docs/deploy.md); pointers into the request, valid while it is handled. */
typedef struct srv_chain_headers {
    const char *chain_id;     /* X-Lethe-Chain-Id: same as the body's chain_id */
    const char *new_chain_id; /* X-Lethe-New-Chain-Id: the id of a chain this request creates */
} srv_chain_headers;

typedef struct srv_agent srv_agent; /* tools, reasoning, structured output (agent.h) */

typedef struct srv_gen {
    srv_kind kind;
    bool stream, include_usage;
    int32_t *prompt;            /* [n_prompt] token ids, malloc'd */
    int32_t n_prompt;
    lethe_sampling_params sp;   /* sp.stop[] points into stops[] */
    char *stops[LETHE_MAX_STOP];
    int32_t logprobs;           /* -1: none; k >= 0: sampled token + k alternatives */
    int32_t *forced;            /* forced_token_ids (trace replay), malloc'd, or NULL */
    int32_t n_forced;
    char id[48];                /* "cmpl-..." / "chatcmpl-..." */
    int64_t created;
    /* Chain Cache (chain_api.c) */
    bool chain;                 /* submitted as a chain turn (the engine runs in chain mode) */
    char *chain_id;             /* requested id (malloc'd) or NULL: create */
    srv_chain_headers hdr;      /* the request's chain headers (not owned) */
    bool chain_append;          /* chain_append_start given: prompt = appended tokens only */
    int32_t chain_append_start, n_messages;
    int32_t chain_share;        /* chain_share_prefix / _messages: shared prefix tokens (branching) */
    lethe_chain_result chain_res;
    const char *tenant;         /* owner of the chains this request creates or resumes (not owned) */
    srv_agent *agent;           /* chat: tools, reasoning, response_format (agent.c), or NULL */
    /* chat retention hints (retention.c): message token spans, malloc'd */
    lethe_token_range *pinned;
    int32_t n_pinned;
    lethe_retention_range *prunable;
    int32_t n_prunable;
} srv_gen;

/* hdr: the request's chain headers, or NULL */
int srv_parse_request(const srv_api *api, srv_kind kind, const char *body, size_t len,
                      const srv_chain_headers *hdr, srv_gen *g, srv_error *err);
void srv_gen_free(srv_gen *g);
/* retention.c: messages' "retention" hints as token ranges of g->prompt
 * (the whole conversation's tokens); 0, or -1 with *err */
int srv_retention_parse(const srv_api *api, const cJSON *msgs, const srv_agent *a,
                        const char *chain_id, srv_gen *g, srv_error *err);
/* tokens of messages[0..k) rendered without the generation prompt, which
 * must be a token prefix of full[0..n_full) (else 400 naming `what`) */
int srv_messages_prefix_tokens(const srv_api *api, const cJSON *msgs, int k, const srv_agent *a,
                               const char *chain_id, const int32_t *full, int32_t n_full,
                               const char *what, int32_t *out, srv_error *err);

char *srv_models_json(const srv_api *api);
/* POST /tokenize and /detokenize (vLLM extensions); NULL + *err on bad input. */
char *srv_tokenize_json(const srv_api *api, const char *body, size_t len, srv_error *err);
char *srv_detokenize_json(const srv_api *api, const char *body, size_t len, srv_error *err);

/* Non-streaming: events are folded into an accumulator, then one response. */
typedef struct srv_acc {
    srv_buf text;
    cJSON *logprobs;            /* NULL unless asked */
    int32_t n_tokens;
    lethe_finish_reason finish;
    char *error;                /* first error message, owned */
} srv_acc;

void srv_acc_add(const srv_api *api, const srv_gen *g, srv_acc *a, const srv_event *ev);
char *srv_response_json(const srv_api *api, const srv_gen *g, const srv_acc *a, int32_t prompt,
                        int32_t completion, int32_t cached);
void srv_acc_free(srv_acc *a);

/* Streaming: appends "data: {...}\n\n" records to out. */
void srv_sse_role(const srv_api *api, const srv_gen *g, srv_buf *out); /* chat: first chunk */
void srv_sse_event(const srv_api *api, const srv_gen *g, const srv_event *ev, size_t text_offset,
                   srv_buf *out);
void srv_sse_usage(const srv_api *api, const srv_gen *g, int32_t prompt, int32_t completion,
                   int32_t cached, srv_buf *out);
void srv_sse_error(const srv_error *err, srv_buf *out);
/* chunk pieces for agent.c's stream formatting */
cJSON *srv_chunk_new(const srv_api *api, const srv_gen *g, cJSON **choice);
void srv_sse_put(cJSON *root, srv_buf *out); /* takes root */
void srv_chunk_logprobs(const srv_api *api, const srv_gen *g, const srv_event *ev, size_t text_offset,
                        cJSON *choice);
void srv_chunk_finish(const srv_gen *g, cJSON *choice, lethe_finish_reason r);
void srv_sse_done(srv_buf *out);

/* Limits on a request (each refusal is a 400 naming the field; the body size
 * is --max-request-bytes, 413). */
#define SRV_MAX_MESSAGES 4096      /* chat messages per request */
#define SRV_MAX_STOP_BYTES 1024    /* bytes in one stop string */

/* Strict body parsing (json_in.c): valid UTF-8, no NUL byte and no \u0000
 * escape in any string, one JSON value and nothing after it but whitespace.
 * 0 and *out (caller deletes), or -1 and a 400 in *err. */
int srv_json_parse(const char *body, size_t len, cJSON **out, srv_error *err);
/* Client text quoted in an error message: s, or its first cap - 4 bytes (cut at
 * a UTF-8 boundary) and "...". Returns buf. */
const char *srv_clip(const char *s, char *buf, size_t cap);

const char *srv_finish_str(lethe_finish_reason r);
/* Length of the valid UTF-8 sequence at s[0..n), 0 if invalid (format.c). */
size_t srv_utf8_seq(const unsigned char *s, size_t n);
/* Copy of s[0..n) with invalid UTF-8 replaced by U+FFFD and NUL bytes dropped; malloc'd. */
char *srv_utf8_sanitize(const char *s, size_t n);

#endif /* LETHE_SERVER_OPENAI_H */

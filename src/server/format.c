/* format.c - OpenAI response bodies and SSE chunks, built with cJSON.
 *
 * Shapes follow the OpenAI API as served by vLLM:
 *   completion:  {"id": "cmpl-..", "object": "text_completion", "choices":
 *                 [{"index", "text", "logprobs", "finish_reason"}], "usage"}
 *   chat:        {"id": "chatcmpl-..", "object": "chat.completion", "choices":
 *                 [{"index", "message": {"role", "content"}, "logprobs",
 *                 "finish_reason"}], "usage"}
 *   streaming:   the same with "text_completion" / "chat.completion.chunk"
 *                objects, chat deltas, a final usage chunk with empty choices
 *                when stream_options.include_usage, then "data: [DONE]".
 * usage = {prompt_tokens, completion_tokens, total_tokens,
 * prompt_tokens_details: {cached_tokens}}. Logprobs: completions use the
 * legacy {tokens, token_logprobs, top_logprobs, text_offset} arrays; chat uses
 * {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
 * Token strings are the token's raw bytes with invalid UTF-8 replaced by
 * U+FFFD (the exact bytes are in "bytes"). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "server/agent.h"
#include "server/openai.h"
#include "server/chain_api.h"

const char *srv_finish_str(lethe_finish_reason r) {
    switch (r) {
    case LETHE_FINISH_STOP: return "stop";
    case LETHE_FINISH_LENGTH: return "length";
    case LETHE_FINISH_ABORT: return "abort";
    case LETHE_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if invalid. */
size_t srv_utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) return 1;
    if ((c & 0xe0) == 0xc0) len = 2, min = 0x80;
    else if ((c & 0xf0) == 0xe0) len = 3, min = 0x800;
    else if ((c & 0xf8) == 0xf0) len = 4, min = 0x10000;
    else return 0;
    if (len > n) return 0;
    unsigned cp = c & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
}

char *srv_utf8_sanitize(const char *s, size_t n) {
    srv_buf b = {0};
    srv_buf_reserve(&b, n);
    b.data[0] = '\0'; /* "" when nothing is kept (empty or all-NUL input) */
    size_t i = 0;
    while (i < n) {
        size_t k = srv_utf8_seq((const unsigned char *)s + i, n - i);
        if (k == 0 || (k == 1 && s[i] == '\0')) {
            if (k == 0) srv_buf_puts(&b, "\xef\xbf\xbd");
            i++;
            continue;
        }
        srv_buf_add(&b, s + i, k);
        i += k;
    }
    return b.data;
}

static double clamp_lp(float lp) { return isfinite(lp) ? (double)lp : -9999.0; }

/* token string (sanitized) into *str; raw bytes into *bytes (may be NULL) */
static void token_strings(const srv_api *api, int32_t id, char **str, cJSON **bytes) {
    size_t n = 0;
    const char *raw = lethe_engine_token_text(api->engine, id, &n);
    if (!raw) raw = "", n = 0;
    *str = srv_utf8_sanitize(raw, n);
    if (bytes) {
        *bytes = cJSON_CreateArray();
        for (size_t i = 0; i < n; i++)
            cJSON_AddItemToArray(*bytes, cJSON_CreateNumber((unsigned char)raw[i]));
    }
}

static cJSON *chat_lp_item(const srv_api *api, int32_t id, float lp) {
    cJSON *o = cJSON_CreateObject();
    char *s;
    cJSON *bytes;
    token_strings(api, id, &s, &bytes);
    cJSON_AddStringToObject(o, "token", s);
    cJSON_AddNumberToObject(o, "logprob", clamp_lp(lp));
    cJSON_AddItemToObject(o, "bytes", bytes);
    free(s);
    return o;
}

/* Appends one token's logprobs to a chat {"content": [...]} or a completion
 * {"tokens", "token_logprobs", "top_logprobs", "text_offset"} object. */
static void add_logprobs(const srv_api *api, const srv_gen *g, cJSON *lp, const srv_event *ev,
                         size_t text_offset) {
    if (g->kind == SRV_CHAT) {
        cJSON *item = chat_lp_item(api, ev->token, ev->logprob);
        cJSON *top = cJSON_AddArrayToObject(item, "top_logprobs");
        for (int i = 0; i < ev->n_top && i < g->logprobs; i++)
            cJSON_AddItemToArray(top, chat_lp_item(api, ev->top[i].token, ev->top[i].logprob));
        cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "content"), item);
        return;
    }
    char *s;
    token_strings(api, ev->token, &s, NULL);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "tokens"), cJSON_CreateString(s));
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "token_logprobs"),
                         cJSON_CreateNumber(clamp_lp(ev->logprob)));
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "text_offset"),
                         cJSON_CreateNumber((double)text_offset));
    cJSON *top = cJSON_CreateObject();
    cJSON_AddNumberToObject(top, s, clamp_lp(ev->logprob)); /* the sampled token, as vLLM does */
    free(s);
    for (int i = 0; i < ev->n_top && i < g->logprobs; i++) {
        token_strings(api, ev->top[i].token, &s, NULL);
        if (!cJSON_GetObjectItemCaseSensitive(top, s))
            cJSON_AddNumberToObject(top, s, clamp_lp(ev->top[i].logprob));
        free(s);
    }
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "top_logprobs"), top);
}

static cJSON *new_logprobs(const srv_gen *g) {
    cJSON *lp = cJSON_CreateObject();
    if (g->kind == SRV_CHAT) {
        cJSON_AddArrayToObject(lp, "content");
    } else {
        cJSON_AddArrayToObject(lp, "tokens");
        cJSON_AddArrayToObject(lp, "token_logprobs");
        cJSON_AddArrayToObject(lp, "top_logprobs");
        cJSON_AddArrayToObject(lp, "text_offset");
    }
    return lp;
}

void srv_acc_add(const srv_api *api, const srv_gen *g, srv_acc *a, const srv_event *ev) {
    size_t offset = a->text.len;
    srv_buf_puts(&a->text, ev->text);
    if (ev->n_tokens > 0) {
        a->n_tokens += ev->n_tokens;
        if (g->logprobs >= 0) {
            if (!a->logprobs) a->logprobs = new_logprobs(g);
            add_logprobs(api, g, a->logprobs, ev, offset);
        }
    }
    if (ev->finished) {
        a->finish = ev->finish_reason;
        if (ev->error && !a->error) a->error = lethe_xstrdup(ev->error);
    }
}

void srv_acc_free(srv_acc *a) {
    srv_buf_free(&a->text);
    cJSON_Delete(a->logprobs);
    free(a->error);
    memset(a, 0, sizeof(*a));
}

static cJSON *usage_json(int32_t prompt, int32_t completion, int32_t cached) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", (double)prompt + completion);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", cached);
    return u;
}

static cJSON *envelope(const srv_api *api, const srv_gen *g, const char *object) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "id", g->id);
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)g->created);
    cJSON_AddStringToObject(root, "model", api->served_name);
    srv_chain_annotate(g, root);
    return root;
}

/* chat with tools: "tool_calls" instead of "stop" when the model called tools */
static const char *finish_str(const srv_gen *g, lethe_finish_reason r) {
    if (r == LETHE_FINISH_STOP && srv_agent_called_tools(g)) return "tool_calls";
    return srv_finish_str(r);
}

void srv_chunk_logprobs(const srv_api *api, const srv_gen *g, const srv_event *ev, size_t text_offset,
                        cJSON *choice) {
    cJSON *lp = new_logprobs(g);
    add_logprobs(api, g, lp, ev, text_offset);
    cJSON_AddItemToObject(choice, "logprobs", lp);
}

void srv_chunk_finish(const srv_gen *g, cJSON *choice, lethe_finish_reason r) {
    const char *s = finish_str(g, r);
    if (s) cJSON_AddStringToObject(choice, "finish_reason", s);
    else cJSON_AddNullToObject(choice, "finish_reason");
}

static void add_finish(cJSON *choice, lethe_finish_reason r) {
    const char *s = srv_finish_str(r);
    if (s) cJSON_AddStringToObject(choice, "finish_reason", s);
    else cJSON_AddNullToObject(choice, "finish_reason");
}

char *srv_response_json(const srv_api *api, const srv_gen *g, const srv_acc *a, int32_t prompt,
                        int32_t completion, int32_t cached) {
    bool chat = g->kind == SRV_CHAT;
    cJSON *root = envelope(api, g, chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(root, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    const char *text = a->text.data ? a->text.data : "";
    if (chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        if (g->agent) srv_agent_message(g, text, m); /* reasoning_content, tool_calls */
        else cJSON_AddStringToObject(m, "content", text);
    } else {
        cJSON_AddStringToObject(c, "text", text);
    }
    if (a->logprobs) cJSON_AddItemToObject(c, "logprobs", cJSON_Duplicate(a->logprobs, true));
    else if (g->logprobs >= 0) cJSON_AddItemToObject(c, "logprobs", new_logprobs(g));
    else cJSON_AddNullToObject(c, "logprobs");
    srv_chunk_finish(g, c, a->finish);
    cJSON_AddItemToArray(choices, c);
    cJSON_AddItemToObject(root, "usage", usage_json(prompt, completion, cached));
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

void srv_sse_put(cJSON *root, srv_buf *out) {
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    srv_buf_puts(out, "data: ");
    srv_buf_puts(out, s);
    srv_buf_puts(out, "\n\n");
    free(s);
}

cJSON *srv_chunk_new(const srv_api *api, const srv_gen *g, cJSON **choice) {
    cJSON *root = envelope(api, g, g->kind == SRV_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(root, "choices");
    *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(*choice, "index", 0);
    cJSON_AddItemToArray(choices, *choice);
    return root;
}

void srv_sse_role(const srv_api *api, const srv_gen *g, srv_buf *out) {
    cJSON *c;
    cJSON *root = srv_chunk_new(api, g, &c);
    cJSON *d = cJSON_AddObjectToObject(c, "delta");
    cJSON_AddStringToObject(d, "role", "assistant");
    cJSON_AddStringToObject(d, "content", "");
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddNullToObject(c, "finish_reason");
    if (g->include_usage) cJSON_AddNullToObject(root, "usage");
    srv_sse_put(root, out);
}

void srv_sse_event(const srv_api *api, const srv_gen *g, const srv_event *ev, size_t text_offset,
                   srv_buf *out) {
    if (g->kind == SRV_CHAT && g->agent) return srv_agent_sse_event(api, g, ev, text_offset, out);
    bool has_lp = g->logprobs >= 0 && ev->n_tokens > 0;
    /* nothing visible yet (a partial UTF-8 character or a held-back stop-string
     * prefix); without a tokenizer every token is empty text, so each still gets
     * a chunk for clients that time tokens */
    if (!ev->finished && !ev->text[0] && !has_lp && (api->has_tokenizer || ev->n_tokens == 0)) return;
    cJSON *c;
    cJSON *root = srv_chunk_new(api, g, &c);
    if (g->kind == SRV_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (ev->text[0] || !ev->finished) cJSON_AddStringToObject(d, "content", ev->text);
    } else {
        cJSON_AddStringToObject(c, "text", ev->text);
    }
    if (has_lp) {
        cJSON *lp = new_logprobs(g);
        add_logprobs(api, g, lp, ev, text_offset);
        cJSON_AddItemToObject(c, "logprobs", lp);
    } else {
        cJSON_AddNullToObject(c, "logprobs");
    }
    add_finish(c, ev->finished ? ev->finish_reason : LETHE_FINISH_NONE);
    if (g->include_usage) cJSON_AddNullToObject(root, "usage");
    srv_sse_put(root, out);
}

void srv_sse_usage(const srv_api *api, const srv_gen *g, int32_t prompt, int32_t completion,
                   int32_t cached, srv_buf *out) {
    cJSON *root = envelope(api, g, g->kind == SRV_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddArrayToObject(root, "choices");
    cJSON_AddItemToObject(root, "usage", usage_json(prompt, completion, cached));
    srv_sse_put(root, out);
}

void srv_sse_error(const srv_error *err, srv_buf *out) {
    char *s = srv_error_json(err);
    srv_buf_puts(out, "data: ");
    srv_buf_puts(out, s);
    srv_buf_puts(out, "\n\n");
    free(s);
}

void srv_sse_done(srv_buf *out) { srv_buf_puts(out, "data: [DONE]\n\n"); }

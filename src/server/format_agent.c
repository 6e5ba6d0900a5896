/* format_agent.c - chat responses with reasoning and tool calls (agent.h).
 *
 * Whole response: message {"role": "assistant", "content": str | null,
 * "reasoning_content"?: str, "tool_calls"?: [{"id", "type": "function",
 * "function": {"name", "arguments": str}}]}, finish_reason "tool_calls" when
 * the model called a tool and stopped by itself.
 * Streaming (as OpenAI sends them): per event, a chunk whose delta is
 * {"reasoning_content": ...}, one with {"content": ...}, and per call piece
 * {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments":
 * ""}}]} when a call starts, then {"tool_calls": [{"index", "function":
 * {"arguments": fragment}}]} as its arguments come; the last chunk carries
 * the finish reason. Text the parser holds back (a marker that may be
 * starting) comes in a later chunk. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "server/agent.h"

static srv_tool_fmt fmt_of(const srv_agent *a) { return a->choice == SRV_TOOLS_NONE ? SRV_TF_NONE : a->tool_fmt; }

bool srv_agent_called_tools(const srv_gen *g) { return g->agent && g->agent->n_calls > 0; }

static void remember(const srv_gen *g, const srv_message *m) {
    if (!g->chain || !g->chain_res.chain_id[0] || !m->reasoning || !m->reasoning[0]) return;
    srv_memo_put(g->chain_res.chain_id, m->content ? m->content : "", m->tool_calls, m->reasoning);
}

void srv_agent_message(const srv_gen *g, const char *text, cJSON *message) {
    srv_agent *a = g->agent;
    srv_message m;
    srv_parse_output(fmt_of(a), a->reasoning, text, &m);
    a->n_calls = m.tool_calls ? cJSON_GetArraySize(m.tool_calls) : 0;
    if (!m.content[0] && a->n_calls) cJSON_AddNullToObject(message, "content");
    else cJSON_AddStringToObject(message, "content", m.content);
    if (m.reasoning[0]) cJSON_AddStringToObject(message, "reasoning_content", m.reasoning);
    if (m.tool_calls) cJSON_AddItemToObject(message, "tool_calls", cJSON_Duplicate(m.tool_calls, true));
    remember(g, &m);
    srv_message_free(&m);
}

static void put_chunk(const srv_api *api, const srv_gen *g, cJSON *delta, const srv_event *lp_ev,
                      size_t text_offset, bool finished, lethe_finish_reason fin, srv_buf *out) {
    cJSON *c;
    cJSON *root = srv_chunk_new(api, g, &c);
    cJSON_AddItemToObject(c, "delta", delta);
    if (lp_ev) srv_chunk_logprobs(api, g, lp_ev, text_offset, c);
    else cJSON_AddNullToObject(c, "logprobs");
    srv_chunk_finish(g, c, finished ? fin : LETHE_FINISH_NONE);
    if (g->include_usage) cJSON_AddNullToObject(root, "usage");
    srv_sse_put(root, out);
}

void srv_agent_sse_event(const srv_api *api, const srv_gen *g, const srv_event *ev, size_t text_offset,
                         srv_buf *out) {
    srv_agent *a = g->agent;
    if (!a->op) {
        a->op = srv_outparse_new(fmt_of(a), a->reasoning);
        a->msg = lethe_xcalloc(1, sizeof(*a->msg));
    }
    srv_delta d = {0};
    srv_outparse_push(a->op, ev->text, strlen(ev->text), &d);
    if (ev->finished) srv_outparse_finish(a->op, &d);
    srv_message_add_delta(a->msg, &d);
    a->n_calls = srv_outparse_n_calls(a->op);
    /* the pieces as chunks; logprobs ride on the first, the finish reason on the last */
    cJSON **deltas = lethe_xmalloc((size_t)(d.n_calls + 3) * sizeof(cJSON *));
    int n = 0;
    if (d.reasoning.len) {
        deltas[n] = cJSON_CreateObject();
        cJSON_AddStringToObject(deltas[n++], "reasoning_content", d.reasoning.data);
    }
    if (d.content.len) {
        deltas[n] = cJSON_CreateObject();
        cJSON_AddStringToObject(deltas[n++], "content", d.content.data);
    }
    for (int i = 0; i < d.n_calls; i++) {
        const srv_call_delta *cd = &d.calls[i];
        cJSON *dl = cJSON_CreateObject(), *tcs = cJSON_AddArrayToObject(dl, "tool_calls"), *tc = cJSON_CreateObject();
        cJSON_AddNumberToObject(tc, "index", cd->index);
        if (cd->id) {
            cJSON_AddStringToObject(tc, "id", cd->id);
            cJSON_AddStringToObject(tc, "type", "function");
        }
        cJSON *fn = cJSON_AddObjectToObject(tc, "function");
        if (cd->name) cJSON_AddStringToObject(fn, "name", cd->name);
        cJSON_AddStringToObject(fn, "arguments", cd->args);
        cJSON_AddItemToArray(tcs, tc);
        deltas[n++] = dl;
    }
    const bool has_lp = g->logprobs >= 0 && ev->n_tokens > 0;
    if (n == 0 && (has_lp || ev->finished || (!api->has_tokenizer && ev->n_tokens > 0))) {
        deltas[n] = cJSON_CreateObject();
        if (!ev->finished) cJSON_AddStringToObject(deltas[n], "content", "");
        n++;
    }
    for (int i = 0; i < n; i++)
        put_chunk(api, g, deltas[i], i == 0 && has_lp ? ev : NULL, text_offset, ev->finished && i == n - 1,
                  ev->finish_reason, out);
    free(deltas);
    if (ev->finished) remember(g, a->msg);
    srv_delta_free(&d);
}

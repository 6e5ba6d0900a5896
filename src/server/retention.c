/* retention.c - chat retention hints: a message may carry
 *   "retention": "pin" | "normal" | {"prunable": keep_ratio}
 * and the server maps each hinted message onto the token range it occupies
 * in the rendered prompt: message k spans [len(render(messages[0..k))),
 * len(render(messages[0..k]))) in tokens, each partial rendering without the
 * generation prompt and tokenized as the whole one is. The ranges go to the
 * engine with the request (lethe_request_params.pinned / .prunable), where one
 * protected mask per KV row makes every method, pruning and the Chain Cache
 * keep pinned tokens (docs/serving.md "Retention hints"). A template whose
 * partial renderings are not token prefixes of the whole (none built in) is
 * refused with a 400 rather than mapped approximately. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "server/agent.h"
#include "server/openai.h"

/* -1: invalid (err), 0: none / normal, 1: pin, 2: prunable (*ratio) */
static int hint_of(const cJSON *m, int i, double *ratio, srv_error *err) {
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "retention");
    char p[48];
    snprintf(p, sizeof(p), "messages[%d].retention", i);
    if (!r || cJSON_IsNull(r)) return 0;
    if (cJSON_IsString(r)) {
        if (!strcmp(r->valuestring, "pin")) return 1;
        if (!strcmp(r->valuestring, "normal")) return 0;
    } else if (cJSON_IsObject(r)) {
        const cJSON *k = cJSON_GetObjectItemCaseSensitive(r, "prunable");
        if (cJSON_IsNumber(k) && r->child == k && !k->next && k->valuedouble >= 0 &&
            k->valuedouble <= 1) {
            *ratio = k->valuedouble;
            return 2;
        }
    }
    return srv_errorf(
        err, 400, p, "'%s' must be \"pin\", \"normal\" or {\"prunable\": keep_ratio in [0, 1]}", p);
}

int srv_messages_prefix_tokens(const srv_api *api, const cJSON *msgs, int k, const srv_agent *a,
                               const char *chain_id, const int32_t *full, int32_t n_full,
                               const char *what, int32_t *out, srv_error *err) {
    if (k == 0) {
        *out = 0;
        return 0;
    }
    cJSON *sub = cJSON_CreateArray();
    int j = 0;
    for (const cJSON *m = msgs->child; m && j < k; m = m->next, j++)
        cJSON_AddItemToArray(sub, cJSON_Duplicate(m, 1));
    char *text = NULL;
    int rc = srv_render_chat(api, sub, a, chain_id, false, &text, err);
    cJSON_Delete(sub);
    if (rc) return rc;
    int32_t *t = NULL, n = 0;
    if (lethe_engine_tokenize(api->engine, text, false, true, &t, &n) != 0) {
        free(text);
        return srv_errorf(err, 400, "messages", "cannot tokenize: %s", lethe_engine_last_error());
    }
    free(text);
    bool prefix = n <= n_full && !memcmp(t, full, (size_t)n * sizeof(int32_t));
    free(t);
    if (!prefix)
        return srv_errorf(
            err, 400, "messages",
            "%s: the first %d messages do not render to a token prefix of the whole "
            "conversation with this chat template",
            what, k);
    *out = n;
    return 0;
}

int srv_retention_parse(const srv_api *api, const cJSON *msgs, const srv_agent *a,
                        const char *chain_id, srv_gen *g, srv_error *err) {
    int n_msgs = cJSON_GetArraySize(msgs), i = 0, any = 0;
    for (const cJSON *m = msgs->child; m; m = m->next, i++) {
        double r = 1;
        int h = hint_of(m, i, &r, err);
        if (h < 0) return -1;
        any |= h > 0;
    }
    if (!any) return 0;
    int32_t start = 0;
    i = 0;
    for (const cJSON *m = msgs->child; m; m = m->next, i++) {
        double r = 1;
        int h = hint_of(m, i, &r, err);
        int32_t end = 0;
        if (h == 0) continue;
        if (srv_messages_prefix_tokens(api, msgs, i, a, chain_id, g->prompt, g->n_prompt,
                                       "retention hints", &start, err) ||
            srv_messages_prefix_tokens(api, msgs, i + 1, a, chain_id, g->prompt, g->n_prompt,
                                       "retention hints", &end, err))
            return -1;
        if (end <= start) continue;
        if (h == 1) {
            g->pinned = lethe_xrealloc(g->pinned, (size_t)(g->n_pinned + 1) * sizeof(*g->pinned));
            g->pinned[g->n_pinned++] = (lethe_prune_range){start, end};
        } else {
            g->prunable = lethe_xrealloc(g->prunable,
                                         (size_t)(g->n_prunable + 1) * sizeof(*g->prunable));
            g->prunable[g->n_prunable++] = (lethe_retention_range){start, end, (float)r};
        }
    }
    (void)n_msgs;
    return 0;
}

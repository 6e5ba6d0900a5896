/* chain_api.c - the Chain Cache on the HTTP surface (anchor §7.4-7.5).
 *
 * Request fields (chat and completions): chain_id (string; null or absent
 * creates a chain when the engine runs in chain mode) and, for chat,
 * chain_append_start = k: only messages[k:] are rendered and appended to the
 * chain's token history, so the conversation is never re-rendered or
 * re-tokenized. The render uses a dummy user/assistant context so template
 * boundaries are right (the closing of the previous assistant turn, the next
 * header, the generation prompt; no BOS), and drops the part of the closing
 * the model already produced (its end-of-turn token when it sampled it).
 * Branching: chain_share_prefix = N (tokens) or, for chat,
 * chain_share_messages = k (the tokens messages[:k] render to, e.g. 1 for a
 * system prompt) makes the first N prompt tokens of a new chain a prefix
 * shared with every other chain that names the same tokens: held once,
 * attached read-only, never compacted (lethe_chain_params.
 * share_prefix_tokens).
 * Response fields: chain_id, chain_status (created | resumed | recreated) on
 * every response object and stream chunk, chain_shared_tokens when the chain
 * branches from a shared prefix; usage.prompt_tokens_details.cached_tokens
 * carries the reused tokens.
 *
 * Headers, for a load balancer that routes a chain's turns to the replica
 * holding it (docs/deploy.md): the request's X-Lethe-Chain-Id is the same as
 * the body's chain_id (both given: they must agree); X-Lethe-New-Chain-Id
 * names the chain a request without a chain id creates (the balancer makes
 * it up and routes the first turn by it, so the id it hashes later is the
 * one it hashed first). Every chain response carries X-Lethe-Chain-Id and
 * X-Lethe-Chain-Status; a refusal X-Lethe-Chain-Id of the id it refused.
 * With --replica an id this server does not hold answers 410 chain_gone,
 * not 404: behind a balancer it lived on another replica or before a
 * restart, and the client recreates it. Refusals are OpenAI-style error
 * bodies whose "code" is the chain code string (chain_busy, chain_gone, ...)
 * with the matching HTTP status: the engine returns a lethe_chain_code and
 * this file alone maps it (srv_chain_http_status / srv_chain_code_name).
 * /metrics gains lethe:chain_* series. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/chain.h"
#include "core/util.h"
#include "server/agent.h"
#include "server/chain_api.h"

/* no whitespace at either end: Llama-3 trims message content (Python str.strip()
 * also strips \x1c-\x1f, so control-character brackets would vanish) */
#define MARK "[lethe-chain-boundary-3f9c]"

static cJSON *field(const cJSON *root, const char *name) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

/* Tokens to append for messages[k:] after the chain's history. */
static int render_append(const srv_api *api, const cJSON *msgs, int k, const char *chain_id, srv_gen *g,
                         srv_error *err) {
    int n = cJSON_GetArraySize(msgs);
    /* the dummy context, then messages[k:] as sent (tool results, tools and template options apply) */
    cJSON *slice = cJSON_CreateArray();
    cJSON *u = cJSON_CreateObject(), *a = cJSON_CreateObject();
    cJSON_AddStringToObject(u, "role", "user");
    cJSON_AddStringToObject(u, "content", "x");
    cJSON_AddStringToObject(a, "role", "assistant");
    cJSON_AddStringToObject(a, "content", MARK);
    cJSON_AddItemToArray(slice, u);
    cJSON_AddItemToArray(slice, a);
    for (int i = k; i < n; i++) cJSON_AddItemToArray(slice, cJSON_Duplicate(cJSON_GetArrayItem(msgs, i), true));
    char *text = NULL;
    int rc = -1;
    int32_t n_hist = 0, *hist = NULL;
    srv_error rerr = {0};
    if (srv_render_chat(api, slice, g->agent, NULL, true, &text, &rerr) != 0) {
        srv_errorf(err, 400, "messages", "cannot render messages[%d:]: %s", k, rerr.message);
        goto done;
    }
    const char *tail = strstr(text, MARK);
    if (!tail) {
        srv_errorf(err, 400, "chain_append_start", "the chat template does not render assistant content verbatim");
        goto done;
    }
    tail += strlen(MARK);
    /* the model may already have produced the start of the closing (its end-of-turn token) */
    n_hist = lethe_engine_chain_history(api->engine, chain_id, NULL, 0);
    if (n_hist > 0) {
        hist = lethe_xmalloc((size_t)n_hist * sizeof(int32_t));
        lethe_engine_chain_history(api->engine, chain_id, hist, n_hist);
        size_t nb = 0;
        const char *last = lethe_engine_token_text(api->engine, hist[n_hist - 1], &nb);
        if (last && nb > 0 && strncmp(tail, last, nb) == 0) tail += nb;
    }
    free(g->prompt);
    g->prompt = NULL;
    g->n_prompt = 0;
    if (lethe_engine_tokenize(api->engine, tail, false, true, &g->prompt, &g->n_prompt) != 0 || g->n_prompt == 0) {
        srv_errorf(err, 400, "messages", "cannot tokenize messages[%d:]: %s", k, lethe_engine_last_error());
        goto done;
    }
    rc = 0;
done:
    free(hist);
    free(text);
    cJSON_Delete(slice);
    return rc;
}

int srv_chain_http_status(lethe_chain_code c) {
    switch (c) {
    case LETHE_CHAIN_OK: return 200;
    case LETHE_CHAIN_NOT_FOUND: return 404;
    case LETHE_CHAIN_BUSY:
    case LETHE_CHAIN_PREFIX_MISMATCH:
    case LETHE_CHAIN_FINGERPRINT_MISMATCH: return 409;
    case LETHE_CHAIN_GONE: return 410;
    case LETHE_CHAIN_CAPACITY:
    case LETHE_CHAIN_QUEUE_FULL: return 503;
    case LETHE_CHAIN_BAD_REQUEST:
    case LETHE_CHAIN_MODE_DISABLED:
    case LETHE_CHAIN_INVALID_REQUEST: return 400;
    case LETHE_CHAIN_ENGINE_BUSY: return 500;
    }
    return 500;
}

const char *srv_chain_code_name(lethe_chain_code c) {
    switch (c) {
    case LETHE_CHAIN_OK: return "ok";
    case LETHE_CHAIN_NOT_FOUND: return "chain_not_found";
    case LETHE_CHAIN_BUSY: return "chain_busy";
    case LETHE_CHAIN_PREFIX_MISMATCH: return "chain_prefix_mismatch";
    case LETHE_CHAIN_FINGERPRINT_MISMATCH: return "chain_fingerprint_mismatch";
    case LETHE_CHAIN_GONE: return "chain_gone";
    case LETHE_CHAIN_CAPACITY: return "chain_capacity_unavailable";
    case LETHE_CHAIN_BAD_REQUEST: return "chain_invalid_request";
    case LETHE_CHAIN_MODE_DISABLED: return "chain_mode_disabled";
    case LETHE_CHAIN_INVALID_REQUEST: return "invalid_request";
    case LETHE_CHAIN_QUEUE_FULL: return "queue_full";
    case LETHE_CHAIN_ENGINE_BUSY: return "engine_busy";
    }
    return "chain_error";
}

int srv_chain_parse(const srv_api *api, const cJSON *root, srv_kind kind, srv_gen *g, srv_error *err) {
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(root, "chain_id");
    const cJSON *as = field(root, "chain_append_start");
    bool chain_mode = lethe_engine_chain_mode(api->engine);
    if (id && !cJSON_IsNull(id) && !cJSON_IsString(id))
        return srv_errorf(err, 400, "chain_id", "'chain_id' must be a string or null");
    bool has_id = cJSON_IsString(id) && id->valuestring[0];
    const char *hid = g->hdr.chain_id && g->hdr.chain_id[0] ? g->hdr.chain_id : NULL;
    if (hid && !lethe_chain_id_valid(hid))
        return srv_errorf(err, 400, SRV_CHAIN_ID_HEADER,
                          "the " SRV_CHAIN_ID_HEADER
                          " header must be 8 to %d characters of [A-Za-z0-9_.-]",
                          LETHE_CHAIN_ID_CAP - 1);
    if (hid && has_id && strcmp(hid, id->valuestring) != 0)
        return srv_errorf(err, 400, "chain_id",
                          "the " SRV_CHAIN_ID_HEADER " header and 'chain_id' differ");
    if (hid && !has_id) has_id = true, id = NULL; /* the header names the chain */
    if ((id || hid || as) && !chain_mode) {
        srv_errorf(err, srv_chain_http_status(LETHE_CHAIN_MODE_DISABLED), "chain_id",
                   "chain_id needs the Chain Cache, but this server runs prefix-cache mode '%s'; start it "
                   "with --prefix-cache-mode chain", lethe_engine_prefix_cache_mode(api->engine));
        snprintf(err->code, sizeof(err->code), "%s", srv_chain_code_name(LETHE_CHAIN_MODE_DISABLED));
        return -1;
    }
    if (!chain_mode) return 0;
    g->chain = true; /* in chain mode every request continues or creates a chain */
    if (has_id) g->chain_id = lethe_xstrdup(hid ? hid : id->valuestring);
    const char *nid = g->hdr.new_chain_id;
    if (nid && !nid[0]) nid = g->hdr.new_chain_id = NULL; /* an empty header is none */
    if (!has_id && nid && !lethe_chain_id_valid(nid))
        return srv_errorf(err, 400, SRV_NEW_CHAIN_ID_HEADER,
                          "the " SRV_NEW_CHAIN_ID_HEADER
                          " header must be 8 to %d characters of [A-Za-z0-9_.-]",
                          LETHE_CHAIN_ID_CAP - 1);
    const cJSON *msgs = kind == SRV_CHAT ? cJSON_GetObjectItemCaseSensitive(root, "messages") : NULL;
    g->n_messages = msgs ? cJSON_GetArraySize(msgs) : 0;
    /* branching: the shared prefix, in tokens or (chat) messages */
    const cJSON *sp = field(root, "chain_share_prefix"), *sm = field(root, "chain_share_messages");
    if (sp && sm)
        return srv_errorf(err, 400, "chain_share_messages",
                          "give 'chain_share_prefix' or 'chain_share_messages', not both");
    if (sp) {
        if (!cJSON_IsNumber(sp) || sp->valuedouble != (int)sp->valuedouble || sp->valuedouble < 0)
            return srv_errorf(err, 400, "chain_share_prefix",
                              "'chain_share_prefix' must be an integer >= 0 (prompt tokens)");
        g->chain_share = (int32_t)LETHE_MIN(sp->valuedouble, (double)g->n_prompt);
    }
    if (sm) {
        if (kind != SRV_CHAT)
            return srv_errorf(err, 400, "chain_share_messages",
                              "'chain_share_messages' is for chat requests (use chain_share_prefix)");
        if (!cJSON_IsNumber(sm) || sm->valuedouble != (int)sm->valuedouble || sm->valuedouble < 1 ||
            sm->valuedouble > g->n_messages)
            return srv_errorf(err, 400, "chain_share_messages",
                              "'chain_share_messages' must be an integer in [1, %d] (messages)",
                              g->n_messages);
        if (as)
            return srv_errorf(err, 400, "chain_share_messages",
                              "'chain_share_messages' needs the whole conversation (not "
                              "chain_append_start)");
        if (srv_messages_prefix_tokens(api, msgs, (int)sm->valuedouble, g->agent, g->chain_id,
                                       g->prompt, g->n_prompt, "chain_share_messages",
                                       &g->chain_share, err))
            return -1;
    }
    if (!as) return 0;
    if (kind != SRV_CHAT)
        return srv_errorf(err, 400, "chain_append_start", "'chain_append_start' is for chat requests");
    if (!cJSON_IsNumber(as) || as->valuedouble != (int)as->valuedouble || as->valuedouble < 1)
        return srv_errorf(err, 400, "chain_append_start", "'chain_append_start' must be an integer >= 1");
    if (!has_id) return srv_errorf(err, 400, "chain_append_start", "'chain_append_start' requires a 'chain_id'");
    int k = (int)as->valuedouble;
    if (k >= g->n_messages)
        return srv_errorf(err, 400, "chain_append_start",
                          "'chain_append_start' (%d) must leave at least one message to append (%d messages)", k,
                          g->n_messages);
    const cJSON *prev = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(msgs, k - 1), "role");
    if (!cJSON_IsString(prev) || strcmp(prev->valuestring, "assistant"))
        return srv_errorf(err, 400, "chain_append_start",
                          "messages[%d] (just before chain_append_start) must be the assistant response", k - 1);
    g->chain_append = true;
    g->chain_append_start = k;
    return render_append(api, msgs, k, g->chain_id, g, err);
}

int srv_chain_submit(const srv_api *api, const lethe_request_params *p, srv_gen *g, uint64_t *id) {
    lethe_chain_params cp = {.chain_id = g->chain_id,
                             .new_chain_id = g->chain_id ? NULL : g->hdr.new_chain_id,
                             .owner = g->tenant,
                             .append = g->chain_append,
                             .append_start = g->chain_append_start,
                             .n_messages = g->n_messages,
                             .share_prefix_tokens = g->chain_share};
    int rc = lethe_engine_submit_chain(api->engine, p, &cp, &g->chain_res, id);
    if (rc != 0 && api->replica && g->chain_res.code == LETHE_CHAIN_NOT_FOUND) {
        /* one replica of several: the chain lived elsewhere (or before a restart) and is lost here */
        g->chain_res.code = LETHE_CHAIN_GONE;
        snprintf(g->chain_res.message, sizeof(g->chain_res.message),
                 "chain %.48s is not on this replica (another replica or an earlier run held it); "
                 "resend the full prompt without chain_id",
                 g->chain_id);
        rc = LETHE_ERR_NOT_FOUND;
    }
    return rc;
}

void srv_chain_headers_out(const srv_gen *g, char *out, size_t cap) {
    out[0] = 0;
    if (!g->chain) return;
    const char *id = g->chain_res.chain_id[0] ? g->chain_res.chain_id : g->chain_id;
    /* a refused body id may be anything: never echo it */
    if (!id || !lethe_chain_id_valid(id)) return;
    if (g->chain_res.code == LETHE_CHAIN_OK && g->chain_res.status)
        snprintf(out, cap, SRV_CHAIN_ID_HEADER ": %s\r\nX-Lethe-Chain-Status: %s\r\n", id,
                 g->chain_res.status);
    else snprintf(out, cap, SRV_CHAIN_ID_HEADER ": %s\r\n", id);
}

int srv_chain_refusal_status(const srv_gen *g) {
    return g->chain && g->chain_res.code != LETHE_CHAIN_OK ? srv_chain_http_status(g->chain_res.code) : 0;
}

char *srv_chain_error_json(const srv_gen *g) {
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(e, "message", g->chain_res.message);
    int st = srv_chain_http_status(g->chain_res.code);
    cJSON_AddStringToObject(e, "type", st == 404 ? "NotFoundError" : st == 409 ? "ConflictError"
                                       : st == 410 ? "GoneError" : st == 503 ? "ServiceUnavailableError"
                                                                             : "BadRequestError");
    cJSON_AddNullToObject(e, "param");
    cJSON_AddStringToObject(e, "code", srv_chain_code_name(g->chain_res.code));
    if (g->chain_id) cJSON_AddStringToObject(root, "chain_id", g->chain_id);
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

void srv_chain_annotate(const srv_gen *g, cJSON *root) {
    if (!g->chain || !g->chain_res.chain_id[0]) return;
    cJSON_AddStringToObject(root, "chain_id", g->chain_res.chain_id);
    cJSON_AddStringToObject(root, "chain_status", g->chain_res.status);
    if (g->chain_res.shared_tokens > 0)
        cJSON_AddNumberToObject(root, "chain_shared_tokens", g->chain_res.shared_tokens);
}

void srv_chain_metrics(lethe_engine *e, const uint64_t *refused, const char *model, srv_buf *b) {
    if (!e || !lethe_engine_chain_mode(e)) return;
    lethe_engine_chain_stats s;
    lethe_engine_get_chain_stats(e, &s);
    const struct { const char *name, *type, *help; double v; } rows[] = {
        {"chain_cache_chains", "gauge", "Chains held (ACTIVE + IDLE).", s.n_chains},
        {"chain_cache_active", "gauge", "Chains with a turn in progress.", s.n_active},
        {"chain_cache_idle", "gauge", "Chains waiting for their next turn (reclaimable, LRU).", s.n_idle},
        {"chain_cache_tombstones", "gauge", "Reclaimed/invalidated chain ids remembered (410).", s.n_tombstones},
        {"chain_cache_resident_slots", "gauge", "KV slots resident in chains, summed over slot spaces.",
         (double)s.resident_slots},
        {"chain_cache_created_total", "counter", "Chains created.", (double)s.n_created},
        {"chain_cache_resumed_total", "counter", "Turns that resumed a chain.", (double)s.n_resumed},
        {"chain_cache_recreated_total", "counter", "Turns whose prompt did not continue the chain.",
         (double)s.n_recreated},
        {"chain_cache_reclaimed_total", "counter", "IDLE chains reclaimed (LRU) to make room.", (double)s.n_reclaimed},
        {"chain_cache_invalidated_total", "counter", "Chains invalidated by aborted or failed turns.",
         (double)s.n_invalidated},
        {"chain_cache_rejected_total", "counter", "Chain turns refused (404/409/410/503/400).", (double)s.n_rejected},
        {"chain_cache_capacity_rejected_total", "counter", "Chain turns refused for capacity (503).",
         (double)s.n_capacity_rejected},
        {"chain_cache_reused_tokens_total", "counter", "Prompt tokens whose KV was resident in a chain.",
         (double)s.reused_tokens},
        {"chain_cache_prompt_tokens_total", "counter", "Prompt tokens of admitted chain turns.",
         (double)s.prompt_tokens},
        {"chain_cache_branched", "gauge", "Chains that branch from a shared prefix.", s.n_branched},
        {"chain_cache_shared_prefixes", "gauge", "Distinct shared prefixes those chains hold.",
         s.n_shared_prefixes},
        {"chain_cache_shared_blocks", "gauge", "16-token blocks cached for shared prefixes.",
         s.shared_blocks},
        {"chain_cache_shared_hit_tokens_total", "counter",
         "Prompt tokens attached read-only from a shared prefix.", (double)s.shared_hit_tokens},
        {"chain_cache_on_host", "gauge", "IDLE chains whose KV is in the host-memory tier.", s.n_on_host},
        {"chain_cache_demoted_total", "counter", "IDLE chains demoted to the host-memory tier.",
         (double)s.n_demoted},
        {"chain_cache_restored_total", "counter", "Demoted chains restored by their next turn.",
         (double)s.n_restored},
        {"chain_cache_lost_total", "counter",
         "Reclaimed chains the host-memory tier could not keep (their next turn is 410).",
         (double)s.n_lost},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        srv_buf_printf(b, "# HELP lethe:%s %s\n# TYPE lethe:%s %s\n", rows[i].name, rows[i].help, rows[i].name,
                       rows[i].type);
        srv_buf_printf(b, "lethe:%s{model_name=\"%s\"} %.17g\n", rows[i].name, model, rows[i].v);
    }
    /* refusals as the client saw them (with --replica an unknown id is chain_gone) */
    srv_buf_puts(
        b,
        "# HELP lethe:chain_turns_refused_total Chain turns refused, by the error code answered.\n"
        "# TYPE lethe:chain_turns_refused_total counter\n");
    for (int c = LETHE_CHAIN_NOT_FOUND; c <= LETHE_CHAIN_ENGINE_BUSY; c++) {
        if (c == LETHE_CHAIN_MODE_DISABLED) continue; /* a parse error, never a refused turn */
        srv_buf_printf(b, "lethe:chain_turns_refused_total{model_name=\"%s\",code=\"%s\"} %llu\n",
                       model, srv_chain_code_name((lethe_chain_code)c),
                       (unsigned long long)refused[c]);
    }
}

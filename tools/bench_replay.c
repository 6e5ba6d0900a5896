/* bench_replay.c - `lethe bench replay`: multi-turn agent-trace replay
 * against an OpenAI-compatible server, comparing prefix-cache modes.
 *
 * Each agent of the trace (src/bench/trace.h: a JSONL file, or generated
 * with the synthetic coding-agent generator) is a conversation: per turn the
 * client appends the turn's messages, sends a streaming chat request whose
 * reply is FORCED (forced_token_ids = the trace's reply, tokenized once by
 * the server's /tokenize before timing starts; max_tokens = its length,
 * ignore_eos), appends the reply as the assistant message, then waits the
 * turn's tool time (x --wait-scale) before the next turn. Every
 * configuration therefore does exactly the same work. --concurrency agents
 * run at once (rolling: a worker takes the next agent when one ends).
 *
 * Client modes: "full" sends the whole conversation every turn (radix
 * prefix cache or no cache); "chain" sends chain_id + chain_append_start so
 * the server continues the conversation's resident KV (the id also in the
 * X-Lethe-Chain-Id header, which a load balancer routes by: docs/deploy.md).
 * A 410 (the chain was reclaimed, or its replica is gone) is retried once as
 * a full prompt without chain_id, as the anchor's clients do, and counted
 * (chains_gone_retried). A turn that got no answer, a cut-off stream or a
 * 502/503/504 (a replica died or is loading, the server is full) is sent
 * again up to --retries times after a pause, and counted (turns_retried),
 * so a replica that dies mid-run loses no turn.
 *
 * Branching, cache "chain+share" in --configs: a chain server where each
 * agent's first turn (and a 410 retry) names its system prompt as a shared
 * prefix (chain_share_messages = 1), so chains with the same system prompt
 * (--shared-system: every generated agent gets the same one) hold it once.
 *
 * --configs method-cache,... (cache = radix | chain | chain+share | nocache) starts
 * `lethe serve` per configuration (this binary), waits for /health, replays,
 * stops it; without --configs one replay runs against --base-url.
 * Reported per configuration: end-to-end time, per-turn TTFT percentiles,
 * prompt tokens, tokens reused (usage.prompt_tokens_details.cached_tokens)
 * vs computed, chain statuses, the server's prefill counter delta, and the
 * resident KV (lethe:kv_resident_tokens, per layer, and lethe:kv_resident_slots,
 * summed over slot spaces, sampled every 0.25 s: mean, peak).
 *
 * Tool-result pruning (anchor §9.4, client side), cache "radix+prune" in
 * --configs (or --prune-lag N against --base-url in full mode): tool bodies
 * are role "tool" messages, and in generated traces the tool outputs (the
 * "user" message of every turn after the first). After each model turn
 * with lag N, the (N+1)-th most recent tool body is pruned once: its token
 * span is found by rendering the conversation up to it through /tokenize
 * (messages [0, k) and [0, k] without the generation prompt: the body lies
 * in between), shrunk by 8 tokens at each end (the template's role and
 * end-of-turn tokens and any token that could straddle the body's edge) and
 * aligned inward to the 16-token block; keep = floor(width x
 * --prune-keep-ratio); the path is the last request's prompt tokens. The
 * client checks freed == width - keep and that match's resident KV dropped
 * by freed (prune_checks_failed counts violations). */
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/trace.h"
#include "commands.h"
#include "core/util.h"
#include "eval/bench_serve.h"
#include "eval/runinfo.h"
#include "options.h"

typedef struct rp_opts {
    const char *trace_path, *write_trace, *base_url, *mode, *configs, *model, *serve_args, *result_json;
    const char *sparse_config;
    lethe_trace_gen_params gen;
    bool generate;
    int32_t concurrency, port, timeout_s, retries;
    float wait_scale, max_wait;
    uint64_t seed;
    int32_t prune_lag; /* 0: no pruning client */
    float prune_keep_ratio;
    const char *prune_policy;
} rp_opts;

/* one turn's outcome */
typedef struct rp_turn_rec {
    bool ok;
    double ttft, e2e;
    int32_t prompt_tokens, cached_tokens, completion_tokens;
    int status;                /* chain status: 0 created, 1 resumed, 2 recreated, -1 none */
    bool retried_gone;
    int32_t retries; /* sends again after no answer / 502 / 503 / 504 / a cut-off stream */
} rp_turn_rec;

typedef struct rp_run {
    const rp_opts *o;
    const lethe_trace *t;
    char base[256];
    int32_t **forced;          /* [n_turns] forced ids */
    int32_t *n_forced;
    rp_turn_rec *recs;         /* [n_turns] */
    bool chain;
    bool share; /* chain: a new chain shares its system prompt (chain_share_messages) */
    bool prune; /* the tool-result pruning client runs */
    pthread_mutex_t mu;
    int32_t next_agent;
    char first_error[512];
    /* pruning client (under mu) */
    int32_t prune_jobs, prune_completed, prune_blocked, prune_failed, prune_skipped,
        prune_checks_failed;
    int64_t prune_freed;
    double prune_wait_s;
    /* resident KV sampler */
    volatile bool sampling;
    double resident_sum, resident_peak; /* lethe:kv_resident_slots (summed over slot spaces) */
    double rtok_sum, rtok_peak;         /* lethe:kv_resident_tokens (per layer: what compares) */
    int64_t n_resident;
} rp_run;

/* ---- HTTP ---- */

typedef struct membuf {
    char *p;
    size_t n;
} membuf;

static size_t mem_write(char *p, size_t sz, size_t nm, void *u) {
    membuf *b = u;
    size_t k = sz * nm;
    b->p = lethe_xrealloc(b->p, b->n + k + 1);
    memcpy(b->p + b->n, p, k);
    b->n += k;
    b->p[b->n] = 0;
    return k;
}

/* GET or POST (body != NULL); returns the body (malloc'd) and *code (0 = no answer) */
static char *http(const char *base, const char *path, const char *body, long *code, long timeout_s) {
    char url[512];
    snprintf(url, sizeof(url), "%s%s", base, path);
    CURL *h = curl_easy_init();
    membuf b = {0};
    struct curl_slist *hd = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, mem_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, timeout_s);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    if (body) {
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    }
    *code = 0;
    if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, code);
    curl_slist_free_all(hd);
    curl_easy_cleanup(h);
    return b.p;
}

/* ---- one streamed turn ---- */

typedef struct stream_ctx {
    lethe_sse sse;
    double t0, t_first;
    bool got_first, done;
    int32_t prompt, cached, completion;
    char chain_id[64], chain_status[16];
    char error[300];
    membuf head;              /* non-SSE error bodies */
} stream_ctx;

static void on_event(void *user, const char *data, size_t len) {
    stream_ctx *c = user;
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        c->done = true;
        return;
    }
    cJSON *j = cJSON_ParseWithLength(data, len);
    if (!j) return;
    const cJSON *cid = cJSON_GetObjectItemCaseSensitive(j, "chain_id");
    const cJSON *cst = cJSON_GetObjectItemCaseSensitive(j, "chain_status");
    if (cJSON_IsString(cid)) snprintf(c->chain_id, sizeof(c->chain_id), "%s", cid->valuestring);
    if (cJSON_IsString(cst)) snprintf(c->chain_status, sizeof(c->chain_status), "%s", cst->valuestring);
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
    if (err) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(err, "message");
        snprintf(c->error, sizeof(c->error), "%s", cJSON_IsString(m) ? m->valuestring : "error");
    }
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
    if (ch && !c->got_first) {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(ch, "delta");
        const cJSON *ct = d ? cJSON_GetObjectItemCaseSensitive(d, "content") : NULL;
        if (cJSON_IsString(ct) && ct->valuestring[0]) {
            c->got_first = true;
            c->t_first = lethe_time_s();
        }
    }
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
    if (cJSON_IsObject(u)) {
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens");
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(u, "completion_tokens");
        const cJSON *det = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens_details");
        const cJSON *cc = det ? cJSON_GetObjectItemCaseSensitive(det, "cached_tokens") : NULL;
        if (cJSON_IsNumber(pt)) c->prompt = (int32_t)pt->valuedouble;
        if (cJSON_IsNumber(ct)) c->completion = (int32_t)ct->valuedouble;
        if (cJSON_IsNumber(cc)) c->cached = (int32_t)cc->valuedouble;
    }
    cJSON_Delete(j);
}

static size_t on_bytes(char *p, size_t sz, size_t nm, void *u) {
    stream_ctx *c = u;
    size_t k = sz * nm;
    if (c->head.n < 1024) mem_write(p, 1, LETHE_MIN(k, 1024 - c->head.n), &c->head);
    lethe_sse_feed(&c->sse, p, k, on_event, c);
    return k;
}

/* POST one streaming chat request (chain_id also as the X-Lethe-Chain-Id
 * header when given); returns the HTTP code (0: no answer) */
static long post_stream(const rp_run *R, const char *body, const char *chain_id, stream_ctx *c) {
    char url[512];
    snprintf(url, sizeof(url), "%s/v1/chat/completions", R->base);
    CURL *h = curl_easy_init();
    struct curl_slist *hd = curl_slist_append(NULL, "Content-Type: application/json");
    if (chain_id && chain_id[0]) {
        char line[96];
        snprintf(line, sizeof(line), "X-Lethe-Chain-Id: %s", chain_id);
        hd = curl_slist_append(hd, line);
    }
    lethe_sse_init(&c->sse);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_bytes);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, (long)R->o->timeout_s);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    c->t0 = lethe_time_s();
    long code = 0;
    CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    else snprintf(c->error, sizeof(c->error), "%s", curl_easy_strerror(rc));
    curl_slist_free_all(hd);
    curl_easy_cleanup(h);
    lethe_sse_free(&c->sse);
    return code;
}

static void note_error(rp_run *R, const char *fmt, const char *a, long code, const char *msg) {
    pthread_mutex_lock(&R->mu);
    if (!R->first_error[0]) snprintf(R->first_error, sizeof(R->first_error), fmt, a, code, msg);
    pthread_mutex_unlock(&R->mu);
}

/* ---- the tool-result pruning client ---- */

#define PRUNE_MARGIN 8
#define PRUNE_BLOCK 16

/* token ids of messages[0, n) through /tokenize (NULL on failure) */
static int32_t *tokenize_msgs(const rp_run *R, const cJSON *msgs, int32_t n, bool gen_prompt,
                              int32_t *n_out) {
    cJSON *b = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(b, "messages");
    int32_t k = 0;
    for (const cJSON *m = msgs->child; m && k < n; m = m->next, k++)
        cJSON_AddItemToArray(arr, cJSON_Duplicate(m, 1));
    cJSON_AddBoolToObject(b, "add_generation_prompt", gen_prompt);
    char *body = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    long code;
    char *res = http(R->base, "/tokenize", body, &code, 120);
    free(body);
    cJSON *j = res && code == 200 ? cJSON_Parse(res) : NULL;
    free(res);
    const cJSON *toks = j ? cJSON_GetObjectItemCaseSensitive(j, "tokens") : NULL;
    int32_t *t = NULL;
    *n_out = 0;
    if (cJSON_IsArray(toks)) {
        *n_out = cJSON_GetArraySize(toks);
        t = lethe_xmalloc((size_t)LETHE_MAX(*n_out, 1) * sizeof(int32_t));
        int32_t i = 0;
        const cJSON *x;
        cJSON_ArrayForEach(x, toks) t[i++] = (int32_t)x->valuedouble;
    }
    cJSON_Delete(j);
    return t;
}

static int32_t match_resident(const rp_run *R, const char *ids_json) {
    char *body = lethe_xmalloc(strlen(ids_json) + 32);
    sprintf(body, "{\"token_ids\":%s}", ids_json);
    long code;
    char *res = http(R->base, "/v1/prefix_cache/match", body, &code, 60);
    free(body);
    cJSON *j = res && code == 200 ? cJSON_Parse(res) : NULL;
    free(res);
    const cJSON *v = j ? cJSON_GetObjectItemCaseSensitive(j, "resident_kv_tokens") : NULL;
    int32_t r = cJSON_IsNumber(v) ? (int32_t)v->valuedouble : -1;
    cJSON_Delete(j);
    return r;
}

/* prunes message k of msgs (a tool body); n_prompt_msgs: the messages of the
 * last request, whose prompt tokens name the path */
static void prune_body(rp_run *R, const char *agent, const cJSON *msgs, int32_t k,
                       int32_t n_prompt_msgs) {
    int32_t n0 = 0, n1 = 0, np = 0;
    int32_t *t0 = tokenize_msgs(R, msgs, k, false, &n0);
    int32_t *t1 = tokenize_msgs(R, msgs, k + 1, false, &n1);
    int32_t *path = tokenize_msgs(R, msgs, n_prompt_msgs, true, &np);
    free(t0);
    free(t1);
    const int32_t B = PRUNE_BLOCK;
    const int32_t s = (n0 + PRUNE_MARGIN + B - 1) / B * B, e = (n1 - PRUNE_MARGIN) / B * B;
    const int32_t keep = e > s ? (int32_t)floor((double)(e - s) * R->o->prune_keep_ratio) : 0;
    const int32_t obs = LETHE_MIN(64, keep / B * B);
    if (!path || e - s < 2 * B || obs < B || e > np) {
        pthread_mutex_lock(&R->mu);
        R->prune_skipped++;
        pthread_mutex_unlock(&R->mu);
        free(path);
        return;
    }
    cJSON *ids = cJSON_CreateIntArray(path, np);
    char *ids_json = cJSON_PrintUnformatted(ids);
    cJSON_Delete(ids);
    free(path);
    const double t0s = lethe_time_s();
    const int32_t before = match_resident(R, ids_json);
    char *body = lethe_xmalloc(strlen(ids_json) + 256);
    sprintf(body,
            "{\"token_ids\":%s,\"ranges\":[[%d,%d]],\"keep_tokens\":%d,\"policy\":\"%s\","
            "\"observation_tokens\":%d}",
            ids_json, s, e, keep, R->o->prune_policy, obs);
    long code;
    char *res = http(R->base, "/v1/prefix_cache/prune", body, &code, 60);
    free(body);
    cJSON *j = res && code == 202 ? cJSON_Parse(res) : NULL;
    const cJSON *pid = j ? cJSON_GetObjectItemCaseSensitive(j, "prune_id") : NULL;
    char path_get[96] = "";
    if (cJSON_IsString(pid))
        snprintf(path_get, sizeof(path_get), "/v1/prefix_cache/prune/%s", pid->valuestring);
    if (!path_get[0])
        note_error(R, "agent %s: prune: HTTP %ld: %s", agent, code, res ? res : "no response");
    cJSON_Delete(j);
    free(res);
    const char *status = "failed";
    int64_t freed = -1;
    bool degraded = false;
    cJSON *done = NULL;
    for (int i = 0; path_get[0] && i < 200000; i++) {
        char *g = http(R->base, path_get, NULL, &code, 60);
        cJSON *x = g && code == 200 ? cJSON_Parse(g) : NULL;
        free(g);
        const cJSON *st = x ? cJSON_GetObjectItemCaseSensitive(x, "status") : NULL;
        if (!cJSON_IsString(st)) {
            cJSON_Delete(x);
            break;
        }
        if (strcmp(st->valuestring, "queued")) {
            done = x;
            status = cJSON_GetObjectItemCaseSensitive(x, "status")->valuestring;
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(x, "freed_device_slots");
            if (cJSON_IsNumber(f)) freed = (int64_t)f->valuedouble;
            degraded = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(x, "quality_degraded"));
            break;
        }
        cJSON_Delete(x);
        usleep(2000);
    }
    const bool completed = !strcmp(status, "completed");
    const int32_t after = completed ? match_resident(R, ids_json) : before;
    const double dt = lethe_time_s() - t0s;
    bool check = !completed || (freed == (e - s) - keep && degraded && before - after == freed);
    pthread_mutex_lock(&R->mu);
    R->prune_jobs++;
    R->prune_wait_s += dt;
    if (completed) R->prune_completed++, R->prune_freed += freed;
    else if (!strcmp(status, "blocked")) R->prune_blocked++;
    else R->prune_failed++;
    if (!check) R->prune_checks_failed++;
    pthread_mutex_unlock(&R->mu);
    if (!strcmp(status, "failed") && done) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(done, "message");
        note_error(R, "agent %s: prune failed (%ld): %s", agent, 0L,
                   cJSON_IsString(m) ? m->valuestring : "?");
    }
    cJSON_Delete(done);
    free(ids_json);
}

/* tool bodies: role "tool", or the tool output of a generated turn after the first */
static bool is_tool_body(const lethe_trace_turn *u, const char *role, int32_t turn_index) {
    if (!strcmp(role, "tool")) return true;
    return u->n_msgs == 0 && turn_index > 0 && !strcmp(role, "user");
}

static void replay_agent(rp_run *R, int32_t a) {
    const lethe_trace *t = R->t;
    cJSON *msgs = cJSON_CreateArray();
    char chain_id[64] = "";
    int32_t covered = 0; /* messages the chain has seen (incl. its last reply) */
    int32_t *tools = NULL, n_tools = 0, pruned_upto = -1; /* tool-body message indices */
    for (int32_t i = t->agent_first[a]; i < t->agent_first[a + 1]; i++) {
        const lethe_trace_turn *u = &t->turns[i];
        int32_t n_app = 0;
        lethe_trace_msg *app = lethe_trace_turn_messages(t, u, R->o->seed, &n_app);
        for (int32_t k = 0; k < n_app; k++) {
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", app[k].role);
            cJSON_AddStringToObject(m, "content", app[k].content);
            if (is_tool_body(u, app[k].role, i - t->agent_first[a])) {
                tools = lethe_xrealloc(tools, (size_t)(n_tools + 1) * sizeof(int32_t));
                tools[n_tools++] = cJSON_GetArraySize(msgs);
            }
            cJSON_AddItemToArray(msgs, m);
            lethe_trace_msg_free(&app[k]);
        }
        free(app);
        rp_turn_rec *rec = &R->recs[i];
        rec->status = -1;
        for (;;) {
            cJSON *req = cJSON_CreateObject();
            cJSON_AddItemReferenceToObject(req, "messages", msgs);
            cJSON_AddNumberToObject(req, "max_tokens", R->n_forced[i]);
            cJSON *f = cJSON_AddArrayToObject(req, "forced_token_ids");
            for (int32_t k = 0; k < R->n_forced[i]; k++) cJSON_AddItemToArray(f, cJSON_CreateNumber(R->forced[i][k]));
            cJSON_AddNumberToObject(req, "temperature", 0);
            cJSON_AddBoolToObject(req, "ignore_eos", true);
            cJSON_AddBoolToObject(req, "stream", true);
            cJSON_AddItemToObject(req, "stream_options", cJSON_CreateObject());
            cJSON_AddBoolToObject(cJSON_GetObjectItem(req, "stream_options"), "include_usage", true);
            if (R->chain) {
                if (chain_id[0]) {
                    cJSON_AddStringToObject(req, "chain_id", chain_id);
                    cJSON_AddNumberToObject(req, "chain_append_start", covered);
                } else {
                    cJSON_AddNullToObject(req, "chain_id");
                    const cJSON *m0 = cJSON_GetArrayItem(msgs, 0);
                    const cJSON *role = m0 ? cJSON_GetObjectItemCaseSensitive(m0, "role") : NULL;
                    if (R->share && cJSON_IsString(role) && !strcmp(role->valuestring, "system"))
                        cJSON_AddNumberToObject(req, "chain_share_messages", 1);
                }
            }
            char *body = cJSON_PrintUnformatted(req);
            cJSON_Delete(req);
            stream_ctx c = {0};
            long code = post_stream(R, body, R->chain ? chain_id : NULL, &c);
            free(body);
            double t_end = lethe_time_s();
            if (code == 410 && R->chain && chain_id[0] &&
                !rec->retried_gone) { /* lost: once more, new chain */
                chain_id[0] = 0;
                rec->retried_gone = true;
                free(c.head.p);
                continue;
            }
            bool cut = code == 200 && !c.done; /* the server went away mid-stream */
            if ((code == 0 || code == 502 || code == 503 || code == 504 || cut) &&
                rec->retries < R->o->retries) {
                rec->retries++;
                free(c.head.p);
                double w = 0.25 * (1 << LETHE_MIN(rec->retries, 5)); /* 0.5, 1, 2, 4, 8 s */
                struct timespec ts = {.tv_sec = (time_t)w, .tv_nsec = (long)((w - floor(w)) * 1e9)};
                nanosleep(&ts, NULL);
                continue;
            }
            rec->ok = code == 200 && c.done && !c.error[0] && c.got_first;
            if (!rec->ok) {
                note_error(R, "agent %s: HTTP %ld: %s", t->agent_names[a], code,
                           c.error[0] ? c.error : (c.head.p ? c.head.p : "no response"));
            }
            rec->ttft = c.got_first ? c.t_first - c.t0 : NAN;
            rec->e2e = t_end - c.t0;
            rec->prompt_tokens = c.prompt;
            rec->cached_tokens = c.cached;
            rec->completion_tokens = c.completion;
            if (c.chain_status[0])
                rec->status = !strcmp(c.chain_status, "created") ? 0 : !strcmp(c.chain_status, "resumed") ? 1 : 2;
            if (c.chain_id[0]) snprintf(chain_id, sizeof(chain_id), "%s", c.chain_id);
            free(c.head.p);
            break;
        }
        if (!rec->ok) break; /* the conversation cannot continue */
        const int32_t n_prompt_msgs = cJSON_GetArraySize(msgs);
        char *out = lethe_trace_turn_output(t, u, R->o->seed);
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", out);
        cJSON_AddItemToArray(msgs, m);
        free(out);
        covered = cJSON_GetArraySize(msgs);
        /* lag policy: the (lag + 1)-th most recent tool body, once */
        if (R->prune && n_tools > R->o->prune_lag &&
            tools[n_tools - R->o->prune_lag - 1] > pruned_upto) {
            pruned_upto = tools[n_tools - R->o->prune_lag - 1];
            prune_body(R, t->agent_names[a], msgs, pruned_upto, n_prompt_msgs);
        }
        double w = u->wait_s * R->o->wait_scale;
        if (w > 0 && i + 1 < t->agent_first[a + 1]) {
            struct timespec ts = {.tv_sec = (time_t)w, .tv_nsec = (long)((w - floor(w)) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
    free(tools);
    cJSON_Delete(msgs);
}

static void *worker(void *arg) {
    rp_run *R = arg;
    for (;;) {
        pthread_mutex_lock(&R->mu);
        int32_t a = R->next_agent < R->t->n_agents ? R->next_agent++ : -1;
        pthread_mutex_unlock(&R->mu);
        if (a < 0) return NULL;
        replay_agent(R, a);
    }
}

/* forced reply ids for every turn through /tokenize (before timing) */
static int tokenize_outputs(rp_run *R) {
    const lethe_trace *t = R->t;
    R->forced = lethe_xcalloc((size_t)t->n_turns, sizeof(int32_t *));
    R->n_forced = lethe_xcalloc((size_t)t->n_turns, sizeof(int32_t));
    for (int32_t i = 0; i < t->n_turns; i++) {
        char *out = lethe_trace_turn_output(t, &t->turns[i], R->o->seed);
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "prompt", out);
        cJSON_AddBoolToObject(b, "add_special_tokens", false);
        char *body = cJSON_PrintUnformatted(b);
        cJSON_Delete(b);
        free(out);
        long code;
        char *res = http(R->base, "/tokenize", body, &code, 60);
        free(body);
        cJSON *j = res ? cJSON_Parse(res) : NULL;
        const cJSON *toks = j ? cJSON_GetObjectItemCaseSensitive(j, "tokens") : NULL;
        int n = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : 0;
        if (code != 200 || n == 0) {
            fprintf(stderr, "lethe bench replay: POST %s/tokenize gave HTTP %ld: %.200s\n", R->base, code,
                    res ? res : "no response");
            cJSON_Delete(j);
            free(res);
            return -1;
        }
        R->forced[i] = lethe_xmalloc((size_t)n * sizeof(int32_t));
        R->n_forced[i] = n;
        int k = 0;
        const cJSON *x;
        cJSON_ArrayForEach(x, toks) R->forced[i][k++] = (int32_t)x->valuedouble;
        cJSON_Delete(j);
        free(res);
    }
    return 0;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *s, int32_t n, double p) {
    if (n == 0) return NAN;
    double r = p / 100.0 * (n - 1);
    int32_t lo = (int32_t)floor(r), hi = (int32_t)ceil(r);
    return s[lo] + (s[hi] - s[lo]) * (r - lo);
}

static double metric(const char *base, const char *name) {
    long code;
    char *t = http(base, "/metrics", NULL, &code, 30);
    double v = NAN;
    if (t && code == 200 && !lethe_bs_prom_sum(t, name, &v)) v = NAN;
    free(t);
    return v;
}

/* resident KV every 0.25 s while the replay runs */
static void *sampler(void *arg) {
    rp_run *R = arg;
    while (R->sampling) {
        double v = metric(R->base, "kv_resident_slots");
        double tk = metric(R->base, "kv_resident_tokens");
        if (isfinite(v) && isfinite(tk)) {
            pthread_mutex_lock(&R->mu);
            R->resident_sum += v;
            R->resident_peak = LETHE_MAX(R->resident_peak, v);
            R->rtok_sum += tk;
            R->rtok_peak = LETHE_MAX(R->rtok_peak, tk);
            R->n_resident++;
            pthread_mutex_unlock(&R->mu);
        }
        usleep(250000);
    }
    return NULL;
}

/* ---- presets ---- */

/* Named workloads (--preset): trace generator settings, configurations,
 * sparse knobs and the `lethe serve` flags they need (put before
 * --serve-args, so a flag given there wins); any other flag given on the
 * command line overrides the preset's value.
 *
 * long-agents: a long-context coding-agent replay. 6 agents x up to 24
 *   turns, all at once: a 1000-word system prompt, a 500-word task, tool
 *   outputs of 3000-5000 words per turn, replies of 40-120 words, waits
 *   < 0.5 s; an agent ends before its context would pass 72,000 tokens
 *   (words of the generator are single tokens), so every conversation
 *   grows past 64K. The servers get a 16 GiB KV pool (--kv-cache-bytes):
 *   at Llama-3.1-8B's 128 KiB per token that is ~131K tokens, fewer than
 *   two agents at full length, while 6 grow at once: dense + radix must
 *   evict / preempt and recompute, SnapKV (2K budget) + chains keeps every
 *   agent's compacted KV resident. Configurations dense-radix and
 *   snapkv-chain; each must finish every turn. */
static int apply_preset(const char *name, rp_opts *o, const char **serve_pre) {
    if (!strcmp(name, "long-agents")) {
        o->generate = true;
        o->gen.n_agents = 6;
        o->gen.min_turns = o->gen.max_turns = 24;
        o->gen.system_tokens = 1000, o->gen.task_tokens = 500;
        o->gen.tool_min = 3000, o->gen.tool_max = 5000;
        o->gen.out_min = 40, o->gen.out_max = 120;
        o->gen.max_context = 72000;
        o->max_wait = 0.5f;
        o->concurrency = 0;
        o->configs = "dense-radix,snapkv-chain";
        o->sparse_config = "sink_keep_tokens=64,recent_keep_tokens=512,decode_keep_tokens=1472";
        *serve_pre = "--max-model-len 81920 --kv-cache-bytes 16G";
        return 0;
    }
    return -1;
}

/* the host tier's counters (lethe:host_cache_*), read before and after a replay */
enum { HT_DEMOTED, HT_PROMOTED, HT_DEM_BYTES, HT_DEM_S, HT_RES_BYTES, HT_RES_S, HT_N };
static const char *const ht_names[HT_N] = {
    "host_cache_demoted_blocks_total", "host_cache_promoted_blocks_total",
    "host_cache_demoted_bytes_total",  "host_cache_demote_seconds_total",
    "host_cache_restored_bytes_total", "host_cache_restore_seconds_total"};

static void host_counters(const char *base, double *v) {
    for (int i = 0; i < HT_N; i++) v[i] = metric(base, ht_names[i]);
}

/* one replay against a running server; adds a result object to arr */
static int replay_once(const rp_opts *o, const lethe_trace *t, const char *base, const char *label,
                       bool chain, bool share, bool prune, cJSON *arr) {
    rp_run R = {.o = o, .t = t, .chain = chain, .share = share, .prune = prune};
    snprintf(R.base, sizeof(R.base), "%s", base);
    pthread_mutex_init(&R.mu, NULL);
    if (tokenize_outputs(&R) != 0) return -1;
    R.recs = lethe_xcalloc((size_t)t->n_turns, sizeof(*R.recs));
    double pf0 = metric(base, "prefill_tokens_computed_total");
    double pre0 = metric(base, "num_preemptions_total");
    const double host_cap = metric(base, "host_cache_capacity_bytes");
    const bool host = isfinite(host_cap) && host_cap > 0;
    double ht0[HT_N], ht1[HT_N];
    if (host) host_counters(base, ht0);
    int32_t C = o->concurrency > 0 ? LETHE_MIN(o->concurrency, t->n_agents) : t->n_agents;
    pthread_t *th = lethe_xmalloc((size_t)C * sizeof(pthread_t));
    double t0 = lethe_time_s();
    pthread_t samp;
    R.sampling = true;
    pthread_create(&samp, NULL, sampler, &R);
    for (int32_t i = 0; i < C; i++) pthread_create(&th[i], NULL, worker, &R);
    for (int32_t i = 0; i < C; i++) pthread_join(th[i], NULL);
    double wall = lethe_time_s() - t0;
    R.sampling = false;
    pthread_join(samp, NULL);
    double pf1 = metric(base, "prefill_tokens_computed_total");
    double pre1 = metric(base, "num_preemptions_total");
    if (host) host_counters(base, ht1);
    free(th);
    int64_t prompt = 0, cached = 0, completion = 0;
    int32_t ok = 0, st[3] = {0}, gone = 0, retried = 0, retries = 0;
    double *tt = lethe_xmalloc((size_t)t->n_turns * sizeof(double));
    int32_t nt = 0;
    for (int32_t i = 0; i < t->n_turns; i++) {
        const rp_turn_rec *r = &R.recs[i];
        if (!r->ok) continue;
        ok++;
        prompt += r->prompt_tokens;
        cached += r->cached_tokens;
        completion += r->completion_tokens;
        if (r->status >= 0) st[r->status]++;
        gone += r->retried_gone;
        retried += r->retries > 0;
        retries += r->retries;
        if (isfinite(r->ttft)) tt[nt++] = r->ttft;
    }
    qsort(tt, (size_t)nt, sizeof(double), cmp_d);
    double mean = 0;
    for (int32_t i = 0; i < nt; i++) mean += tt[i] / nt;
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "config", label);
    cJSON_AddStringToObject(r, "client_mode", chain ? (share ? "chain+share" : "chain") : prune ? "full+prune" : "full");
    cJSON_AddNumberToObject(r, "agents", t->n_agents);
    cJSON_AddNumberToObject(r, "turns", t->n_turns);
    cJSON_AddNumberToObject(r, "turns_ok", ok);
    cJSON_AddNumberToObject(r, "concurrency", C);
    cJSON_AddNumberToObject(r, "wait_scale", o->wait_scale);
    cJSON_AddNumberToObject(r, "end_to_end_s", wall);
    cJSON_AddNumberToObject(r, "turns_per_s", wall > 0 ? ok / wall : NAN);
    const double preempt = isfinite(pre0) && isfinite(pre1) ? pre1 - pre0 : NAN;
    cJSON_AddNumberToObject(r, "preemptions", preempt);
    cJSON_AddNumberToObject(r, "mean_ttft_ms", nt ? mean * 1e3 : NAN);
    cJSON_AddNumberToObject(r, "p50_ttft_ms", pct(tt, nt, 50) * 1e3);
    cJSON_AddNumberToObject(r, "p90_ttft_ms", pct(tt, nt, 90) * 1e3);
    cJSON_AddNumberToObject(r, "p99_ttft_ms", pct(tt, nt, 99) * 1e3);
    cJSON_AddNumberToObject(r, "prompt_tokens", (double)prompt);
    cJSON_AddNumberToObject(r, "reused_tokens", (double)cached);
    cJSON_AddNumberToObject(r, "computed_prompt_tokens", (double)(prompt - cached));
    cJSON_AddNumberToObject(r, "output_tokens", (double)completion);
    if (isfinite(pf0) && isfinite(pf1)) cJSON_AddNumberToObject(r, "server_prefill_tokens_computed", pf1 - pf0);
    cJSON_AddNumberToObject(r, "chains_created", st[0]);
    cJSON_AddNumberToObject(r, "chains_resumed", st[1]);
    cJSON_AddNumberToObject(r, "chains_recreated", st[2]);
    cJSON_AddNumberToObject(r, "chains_gone_retried", gone);
    cJSON_AddNumberToObject(r, "turns_retried", retried);
    cJSON_AddNumberToObject(r, "retries", retries);
    const double res_mean = R.n_resident ? R.resident_sum / (double)R.n_resident : NAN;
    cJSON_AddNumberToObject(r, "resident_kv_slots_mean", res_mean);
    cJSON_AddNumberToObject(r, "resident_kv_slots_peak", R.n_resident ? R.resident_peak : NAN);
    const double rtok_mean = R.n_resident ? R.rtok_sum / (double)R.n_resident : NAN;
    cJSON_AddNumberToObject(r, "resident_kv_tokens_mean", rtok_mean);
    cJSON_AddNumberToObject(r, "resident_kv_tokens_peak", R.n_resident ? R.rtok_peak : NAN);
    if (prune) {
        cJSON *pr = cJSON_AddObjectToObject(r, "pruning");
        cJSON_AddNumberToObject(pr, "lag", o->prune_lag);
        cJSON_AddNumberToObject(pr, "keep_ratio", o->prune_keep_ratio);
        cJSON_AddStringToObject(pr, "policy", o->prune_policy);
        cJSON_AddNumberToObject(pr, "jobs", R.prune_jobs);
        cJSON_AddNumberToObject(pr, "completed", R.prune_completed);
        cJSON_AddNumberToObject(pr, "blocked", R.prune_blocked);
        cJSON_AddNumberToObject(pr, "failed", R.prune_failed);
        cJSON_AddNumberToObject(pr, "skipped_short", R.prune_skipped);
        cJSON_AddNumberToObject(pr, "checks_failed", R.prune_checks_failed);
        cJSON_AddNumberToObject(pr, "freed_slots", (double)R.prune_freed);
        cJSON_AddNumberToObject(pr, "client_prune_time_s", R.prune_wait_s);
    }
    double ht[HT_N] = {0}, copy_bps = NAN;
    if (host) { /* restore / demote bandwidth = bytes / seconds of the engine's synchronous copies */
        for (int i = 0; i < HT_N; i++) ht[i] = ht1[i] - ht0[i];
        copy_bps = metric(base, "host_cache_copy_bytes_per_second");
        cJSON *h = cJSON_AddObjectToObject(r, "host_tier");
        cJSON_AddNumberToObject(h, "capacity_bytes", host_cap);
        cJSON_AddNumberToObject(h, "demoted_blocks", ht[HT_DEMOTED]);
        cJSON_AddNumberToObject(h, "promoted_blocks", ht[HT_PROMOTED]);
        cJSON_AddNumberToObject(h, "demoted_bytes", ht[HT_DEM_BYTES]);
        cJSON_AddNumberToObject(h, "demote_s", ht[HT_DEM_S]);
        cJSON_AddNumberToObject(h, "restored_bytes", ht[HT_RES_BYTES]);
        cJSON_AddNumberToObject(h, "restore_s", ht[HT_RES_S]);
        cJSON_AddNumberToObject(h, "demote_gb_s", ht[HT_DEM_S] > 0 ? ht[HT_DEM_BYTES] / ht[HT_DEM_S] / 1e9 : NAN);
        cJSON_AddNumberToObject(h, "restore_gb_s", ht[HT_RES_S] > 0 ? ht[HT_RES_BYTES] / ht[HT_RES_S] / 1e9 : NAN);
        cJSON_AddNumberToObject(h, "copy_gb_s", copy_bps / 1e9);
    }
    if (R.first_error[0]) cJSON_AddStringToObject(r, "first_error", R.first_error);
    cJSON_AddItemToArray(arr, r);
    printf("%-22s %8.2f s  turns %d/%d  TTFT p50 %8.1f p90 %8.1f p99 %8.1f ms  prompt %lld reused %lld computed %lld\n",
           label, wall, ok, t->n_turns, pct(tt, nt, 50) * 1e3, pct(tt, nt, 90) * 1e3, pct(tt, nt, 99) * 1e3,
           (long long)prompt, (long long)cached, (long long)(prompt - cached));
    if (chain || retries)
        printf("  chains created %d resumed %d recreated %d, recreated after 410: %d, turns sent "
               "again: %d (%d "
               "sends)\n",
               st[0], st[1], st[2], gone, retried, retries);
    printf("%-22s resident KV tokens per layer mean %.0f peak %.0f (slots over all spaces mean "
           "%.0f peak %.0f)\n",
           "", rtok_mean, R.n_resident ? R.rtok_peak : NAN, res_mean,
           R.n_resident ? R.resident_peak : NAN);
    printf("%-22s %.3f turns/s, preemptions %.0f\n", "", wall > 0 ? ok / wall : NAN, preempt);
    if (prune)
        printf("%-22s prune jobs %d: completed %d blocked %d failed %d (skipped %d short), freed "
               "%lld slots, "
               "checks failed %d, client time %.2f s\n",
               "", R.prune_jobs, R.prune_completed, R.prune_blocked, R.prune_failed,
               R.prune_skipped, (long long)R.prune_freed, R.prune_checks_failed, R.prune_wait_s);
    if (host)
        printf("%-22s host tier: %.0f blocks demoted (%.1f MB in %.3f s: %.2f GB/s), %.0f restored "
               "(%.1f MB in %.3f s: %.2f GB/s); one large host copy %.2f GB/s\n",
               "", ht[HT_DEMOTED], ht[HT_DEM_BYTES] / 1e6, ht[HT_DEM_S],
               ht[HT_DEM_S] > 0 ? ht[HT_DEM_BYTES] / ht[HT_DEM_S] / 1e9 : NAN, ht[HT_PROMOTED],
               ht[HT_RES_BYTES] / 1e6, ht[HT_RES_S],
               ht[HT_RES_S] > 0 ? ht[HT_RES_BYTES] / ht[HT_RES_S] / 1e9 : NAN, copy_bps / 1e9);
    if (R.first_error[0]) printf("  first error: %s\n", R.first_error);
    fflush(stdout);
    free(tt);
    for (int32_t i = 0; i < t->n_turns; i++) free(R.forced[i]);
    free(R.forced);
    free(R.n_forced);
    free(R.recs);
    pthread_mutex_destroy(&R.mu);
    return ok == t->n_turns && R.prune_checks_failed == 0 ? 0 : 1;
}

/* ---- server per configuration ---- */

static pid_t start_server(const rp_opts *o, const char *method, const char *cache) {
    char port[16];
    snprintf(port, sizeof(port), "%d", o->port);
    const char *argv[64];
    int n = 0;
    argv[n++] = "/proc/self/exe";
    argv[n++] = "serve";
    argv[n++] = "--model";
    argv[n++] = o->model;
    argv[n++] = "--port";
    argv[n++] = port;
    argv[n++] = "--sparse-method";
    argv[n++] = method;
    if (o->sparse_config && strcmp(method, "dense") != 0) {
        argv[n++] = "--sparse-config";
        argv[n++] = o->sparse_config;
    }
    if (!strcmp(cache, "nocache")) argv[n++] = "--no-enable-prefix-caching";
    else {
        argv[n++] = "--prefix-cache-mode";
        argv[n++] = cache;
    }
    char *extra = o->serve_args ? lethe_xstrdup(o->serve_args) : NULL;
    for (char *s = extra ? strtok(extra, " ") : NULL; s && n < 62; s = strtok(NULL, " ")) argv[n++] = s;
    argv[n] = NULL;
    char log[256];
    snprintf(log, sizeof(log), "/tmp/lethe-replay-%d-%s-%s.log", o->port, method, cache);
    pid_t pid = fork();
    if (pid == 0) { /* the server's log goes to a file, not into the report */
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv("/proc/self/exe", (char *const *)argv);
        _exit(127);
    }
    free(extra);
    if (pid > 0) printf("%s-%s: lethe serve (pid %d) logs to %s\n", method, cache, (int)pid, log);
    return pid;
}

static bool wait_healthy(const char *base, pid_t pid, int timeout_s) {
    for (int i = 0; i < timeout_s * 4; i++) {
        long code;
        free(http(base, "/health", NULL, &code, 2));
        if (code == 200) return true;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return false;
        usleep(250000);
    }
    return false;
}

static void stop_server(pid_t pid) {
    kill(pid, SIGTERM);
    int st;
    for (int i = 0; i < 100; i++) {
        if (waitpid(pid, &st, WNOHANG) == pid) return;
        usleep(100000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
}

int lethe_bench_replay(int argc, char **argv) {
    rp_opts o = {.base_url = "http://127.0.0.1:8000",
                 .mode = "chain",
                 .concurrency = 0,
                 .port = 8765,
                 .timeout_s = 3600,
                 .retries = 3,
                 .wait_scale = 1.0f,
                 .seed = 42,
                 .prune_lag = 4,
                 .prune_keep_ratio = 0.2f,
                 .prune_policy = "snapkv_global"};
    bool prune_flag = false;
    lethe_trace_gen_default(&o.gen);
    o.max_wait = (float)o.gen.max_wait_s;
    lethe_opt rows[56];
    int n = 0;
#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}
    /* a preset sets defaults first; the flags parsed below override them */
    const char *preset = NULL, *serve_pre = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--preset") && i + 1 < argc) preset = argv[i + 1];
        else if (!strncmp(argv[i], "--preset=", 9)) preset = argv[i] + 9;
    }
    if (preset && apply_preset(preset, &o, &serve_pre) != 0) {
        fprintf(stderr, "lethe bench replay: --preset %s: unknown (presets: long-agents)\n", preset);
        return 2;
    }
    const char *preset_arg = NULL;
    ROW("--preset", NULL, LETHE_OPT_STR, &preset_arg, "NAME",
        "a named workload (long-agents: 6 agents growing past 64K tokens, 16 GiB KV pool, dense-radix vs "
        "snapkv-chain); other flags override it", 1, 0);
    ROW("--trace", NULL, LETHE_OPT_STR, &o.trace_path, "JSONL", "trace to replay (see src/bench/trace.h)", 1, 0);
    ROW("--generate", NULL, LETHE_OPT_BOOL, &o.generate, NULL, "synthesize a coding-agent trace instead", 1, 0);
    ROW("--write-trace", NULL, LETHE_OPT_STR, &o.write_trace, "PATH", "save the trace (generated or read) as JSONL", 1, 0);
    ROW("--agents", NULL, LETHE_OPT_INT, &o.gen.n_agents, "N", "generator: agents", 1, 100000);
    ROW("--min-turns", NULL, LETHE_OPT_INT, &o.gen.min_turns, "N", "generator: fewest turns per agent", 1, 100000);
    ROW("--max-turns", NULL, LETHE_OPT_INT, &o.gen.max_turns, "N", "generator: most turns per agent", 1, 100000);
    ROW("--system-tokens", NULL, LETHE_OPT_INT, &o.gen.system_tokens, "N", "generator: system prompt words", 0, 1 << 20);
    ROW("--task-tokens", NULL, LETHE_OPT_INT, &o.gen.task_tokens, "N", "generator: task (first user message) words", 1, 1 << 20);
    ROW("--tool-min", NULL, LETHE_OPT_INT, &o.gen.tool_min, "N", "generator: shortest tool output (words)", 1, 1 << 20);
    ROW("--tool-max", NULL, LETHE_OPT_INT, &o.gen.tool_max, "N", "generator: longest tool output (words)", 1, 1 << 20);
    ROW("--out-min", NULL, LETHE_OPT_INT, &o.gen.out_min, "N", "generator: shortest assistant reply (words)", 1, 1 << 20);
    ROW("--out-max", NULL, LETHE_OPT_INT, &o.gen.out_max, "N", "generator: longest assistant reply (words)", 1, 1 << 20);
    ROW("--max-wait", NULL, LETHE_OPT_FLOAT, &o.max_wait, "S", "generator: tool waits uniform in [0, S)", 0, 3600);
    ROW("--max-context", NULL, LETHE_OPT_INT, &o.gen.max_context, "N", "generator: end an agent before its context exceeds N tokens (0 = off)", 0, 1 << 24);
    ROW("--shared-system", NULL, LETHE_OPT_BOOL, &o.gen.shared_system, NULL,
        "generator: every agent gets the same system prompt", 1, 0);
    ROW("--seed", NULL, LETHE_OPT_U64, &o.seed, "N", "trace and text seed", 1, 0);
    ROW("--wait-scale", NULL, LETHE_OPT_FLOAT, &o.wait_scale, "F", "multiply tool waits (0 = none)", 0, 1000);
    ROW("--concurrency", NULL, LETHE_OPT_INT, &o.concurrency, "N", "agents in flight (0 = all)", 0, 100000);
    ROW("--base-url", NULL, LETHE_OPT_STR, &o.base_url, "URL", "server to replay against (without --configs)", 1, 0);
    ROW("--mode", NULL, LETHE_OPT_STR, &o.mode, "chain|full", "client mode against --base-url", 1, 0);
    ROW("--configs", NULL, LETHE_OPT_STR, &o.configs, "M-C,...",
        "start `lethe serve` per config: method-cache, cache = radix | radix+prune | chain | "
        "chain+share (branching from the system prompt) | nocache "
        "(e.g. dense-radix,snapkv-nocache,snapkv-chain)", 1, 0);
    ROW("--model", NULL, LETHE_OPT_STR, &o.model, "PATH", "model for the servers --configs starts", 1, 0);
    ROW("--sparse-config", NULL, LETHE_OPT_STR, &o.sparse_config, "K=V,...", "sparse knobs for non-dense configs", 1, 0);
    ROW("--serve-args", NULL, LETHE_OPT_STR, &o.serve_args, "\"ARGS\"", "extra `lethe serve` flags (space separated)", 1, 0);
    ROW("--port", NULL, LETHE_OPT_INT, &o.port, "N", "port of the servers --configs starts", 1, 65535);
    ROW("--timeout", NULL, LETHE_OPT_INT, &o.timeout_s, "S", "per-request timeout", 1, 86400);
    ROW("--retries", NULL, LETHE_OPT_INT, &o.retries, "N",
        "send a turn again up to N times after no answer, a cut-off stream or 502/503/504", 0, 100);
    ROW("--result-json", NULL, LETHE_OPT_STR, &o.result_json, "PATH", "write results as JSON", 1, 0);
    ROW("--prune", NULL, LETHE_OPT_BOOL, &prune_flag, NULL,
        "run the tool-result pruning client (full mode against --base-url; "
        "with --configs use the cache radix+prune)",
        1, 0);
    ROW("--prune-lag", NULL, LETHE_OPT_INT, &o.prune_lag, "N",
        "prune the (N+1)-th most recent tool body after each turn", 0, 100000);
    ROW("--prune-keep-ratio", NULL, LETHE_OPT_FLOAT, &o.prune_keep_ratio, "R",
        "keep this fraction of a pruned body", 0, 1);
    ROW("--prune-policy", NULL, LETHE_OPT_STR, &o.prune_policy, "P", "snapkv_global | kvzip_global",
        1, 0);
#undef ROW
    const char *pos[1];
    int n_pos = 0;
    int pr = lethe_opts_parse(rows, n, argc, argv, "lethe bench replay [options]",
                              "Multi-turn agent-trace replay: dense + radix vs eviction without / with chains.",
                              pos, &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    o.gen.seed = o.seed;
    o.gen.max_wait_s = o.max_wait;
    char *serve_joined = NULL; /* the preset's serve flags, then --serve-args */
    if (serve_pre) {
        const char *user = o.serve_args ? o.serve_args : "";
        serve_joined = lethe_xmalloc(strlen(serve_pre) + strlen(user) + 2);
        sprintf(serve_joined, "%s %s", serve_pre, user);
        o.serve_args = serve_joined;
    }
    lethe_trace t;
    lethe_status st;
    if (o.trace_path && o.generate) {
        fprintf(stderr, "lethe bench replay: --trace and --generate exclude each other\n");
        return 2;
    }
    if (o.trace_path) st = lethe_trace_load(o.trace_path, &t);
    else if (o.generate) st = lethe_trace_generate(&o.gen, &t);
    else {
        fprintf(stderr, "lethe bench replay: give --trace JSONL or --generate\n");
        return 2;
    }
    if (st != LETHE_OK) {
        fprintf(stderr, "lethe bench replay: %s\n", lethe_last_error());
        return 2;
    }
    int64_t ctx_max = 0;
    for (int32_t a = 0; a < t.n_agents; a++)
        ctx_max = LETHE_MAX(ctx_max, lethe_trace_context_after(&t, a, t.agent_first[a + 1] - t.agent_first[a] - 1));
    printf("trace: %d agents, %d turns, longest conversation ~%lld tokens\n", t.n_agents, t.n_turns,
           (long long)ctx_max);
    fflush(stdout);
    if (o.write_trace) {
        if ((st = lethe_trace_save(&t, o.write_trace)) != LETHE_OK) {
            fprintf(stderr, "lethe bench replay: %s\n", lethe_last_error());
            lethe_trace_free(&t);
            return 2;
        }
        printf("trace written to %s\n", o.write_trace);
        if (!o.configs && !strcmp(o.base_url, "http://127.0.0.1:8000") && o.generate) {
            lethe_trace_free(&t);
            return 0;
        }
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    cJSON *res = cJSON_CreateObject();
    char info[256];
    cJSON_AddStringToObject(res, "schema", "lethe-bench-replay/1");
    lethe_runinfo_commit(info, sizeof(info));
    cJSON_AddStringToObject(res, "commit", info);
    lethe_runinfo_date(info, sizeof(info));
    cJSON_AddStringToObject(res, "date", info);
    lethe_runinfo_machine(info, sizeof(info));
    cJSON_AddStringToObject(res, "machine", info);
    if (o.model) cJSON_AddStringToObject(res, "model", o.model);
    if (o.sparse_config) cJSON_AddStringToObject(res, "sparse_config", o.sparse_config);
    if (o.serve_args) cJSON_AddStringToObject(res, "serve_args", o.serve_args);
    if (preset) cJSON_AddStringToObject(res, "preset", preset);
    cJSON *pc = cJSON_AddObjectToObject(res, "prune_client");
    cJSON_AddNumberToObject(pc, "lag", o.prune_lag);
    cJSON_AddNumberToObject(pc, "keep_ratio", o.prune_keep_ratio);
    cJSON_AddStringToObject(pc, "policy", o.prune_policy);
    cJSON *tr = cJSON_AddObjectToObject(res, "trace");
    cJSON_AddStringToObject(tr, "source", o.trace_path ? o.trace_path : "generated");
    cJSON_AddNumberToObject(tr, "agents", t.n_agents);
    cJSON_AddNumberToObject(tr, "turns", t.n_turns);
    cJSON_AddBoolToObject(tr, "shared_system", t.shared_system);
    cJSON_AddNumberToObject(tr, "longest_context_tokens", (double)ctx_max);
    cJSON_AddNumberToObject(tr, "seed", (double)o.seed);
    if (o.generate) {
        const lethe_trace_gen_params *g = &o.gen;
        cJSON_AddNumberToObject(tr, "min_turns", g->min_turns);
        cJSON_AddNumberToObject(tr, "max_turns", g->max_turns);
        cJSON_AddNumberToObject(tr, "system_tokens", g->system_tokens);
        cJSON_AddNumberToObject(tr, "task_tokens", g->task_tokens);
        cJSON_AddNumberToObject(tr, "tool_min", g->tool_min);
        cJSON_AddNumberToObject(tr, "tool_max", g->tool_max);
        cJSON_AddNumberToObject(tr, "out_min", g->out_min);
        cJSON_AddNumberToObject(tr, "out_max", g->out_max);
        cJSON_AddNumberToObject(tr, "max_wait_s", g->max_wait_s);
        cJSON_AddNumberToObject(tr, "max_context", g->max_context);
    }
    cJSON *arr = cJSON_AddArrayToObject(res, "results");
    int rc = 0;
    if (!o.configs) {
        if (strcmp(o.mode, "chain") && strcmp(o.mode, "full")) {
            fprintf(stderr, "lethe bench replay: --mode %s: expected chain or full\n", o.mode);
            rc = 2;
        } else {
            if (prune_flag && strcmp(o.mode, "full")) {
                fprintf(stderr, "lethe bench replay: --prune needs --mode full (a radix server)\n");
                rc = 2;
            } else {
                rc = replay_once(&o, &t, o.base_url, o.mode, !strcmp(o.mode, "chain"), false,
                                 prune_flag, arr) < 0
                         ? 2
                         : rc;
            }
        }
    } else {
        if (!o.model) {
            fprintf(stderr, "lethe bench replay: --configs needs --model\n");
            rc = 2;
        }
        char *list = lethe_xstrdup(o.configs);
        char base[64];
        snprintf(base, sizeof(base), "http://127.0.0.1:%d", o.port);
        for (char *save = NULL, *c = rc ? NULL : strtok_r(list, ",", &save); c; c = strtok_r(NULL, ",", &save)) {
            char *dash = strrchr(c, '-');
            if (!dash || (strcmp(dash + 1, "radix") && strcmp(dash + 1, "chain") &&
                          strcmp(dash + 1, "nocache") && strcmp(dash + 1, "radix+prune") &&
                          strcmp(dash + 1, "chain+share"))) {
                fprintf(stderr,
                        "lethe bench replay: --configs entry '%s': expected "
                        "METHOD-radix|radix+prune|chain|chain+share|nocache\n",
                        c);
                rc = 2;
                break;
            }
            *dash = 0;
            const bool prune = !strcmp(dash + 1, "radix+prune");
            const bool share = !strcmp(dash + 1, "chain+share");
            const char *method = c, *cache = prune ? "radix" : share ? "chain" : dash + 1;
            char label[96];
            snprintf(label, sizeof(label), "%s-%s", method, dash + 1);
            const double ts = lethe_time_s();
            pid_t pid = start_server(&o, method, cache);
            const bool healthy = pid >= 0 && wait_healthy(base, pid, 600);
            if (healthy) printf("%s: server healthy after %.1f s\n", label, lethe_time_s() - ts);
            if (!healthy) {
                fprintf(stderr, "lethe bench replay: the server for %s did not become healthy\n", label);
                if (pid > 0) stop_server(pid);
                rc = 2;
                break;
            }
            int r = replay_once(&o, &t, base, label, !strcmp(cache, "chain"), share, prune, arr);
            stop_server(pid);
            if (r < 0) { rc = 2; break; }
            if (r > 0) rc = 1;
        }
        free(list);
    }
    if (o.result_json) {
        char *s = cJSON_Print(res);
        FILE *f = fopen(o.result_json, "w");
        if (f) {
            fputs(s, f);
            fclose(f);
        } else {
            fprintf(stderr, "lethe bench replay: cannot write %s\n", o.result_json);
            rc = 2;
        }
        free(s);
    }
    cJSON_Delete(res);
    curl_global_cleanup();
    lethe_trace_free(&t);
    free(serve_joined);
    return rc;
}

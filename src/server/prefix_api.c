/* prefix_api.c - /v1/prefix_cache/...: pruning (anchor §9) and radix control
 * (anchor §8) over HTTP. Every route takes a path selector, exactly one of
 *   "token_ids": [ids]          the path as token ids,
 *   "text": "..."               tokenized as a completion prompt is,
 *   "chat": {chat request}      rendered exactly as a chat turn would be
 *                               (template, tools, reasoning: srv_parse_request),
 * (inspect without a selector lists every block). Routes:
 *   POST prune                 -> 202 {prune_id, status: "queued"}; the job runs
 *                                 on the engine thread (lethe_engine_prune_submit)
 *   GET  prune/{prune_id}      -> {status: queued | completed | blocked | failed, ...}
 *   POST match | inspect | delete_subtree | set_eviction_priority
 * The job table keeps the newest SRV_PRUNE_KEEP jobs. */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "server/openai.h"
#include "server/prefix_api.h"

#define SRV_PRUNE_KEEP 1024

typedef struct prune_rec {
    uint32_t id;
    lethe_prune_result res; /* status QUEUED until the callback */
} prune_rec;

struct srv_prune_jobs {
    pthread_mutex_t mu;
    prune_rec *recs; /* ring of SRV_PRUNE_KEEP */
    int64_t n;       /* jobs ever recorded */
};

srv_prune_jobs *srv_prune_jobs_new(void) {
    srv_prune_jobs *j = lethe_xcalloc(1, sizeof(*j));
    /* recursive: with an engine in synchronous mode the callback runs inside submit */
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&j->mu, &a);
    pthread_mutexattr_destroy(&a);
    j->recs = lethe_xcalloc(SRV_PRUNE_KEEP, sizeof(*j->recs));
    return j;
}

void srv_prune_jobs_free(srv_prune_jobs *j) {
    if (!j) return;
    pthread_mutex_destroy(&j->mu);
    free(j->recs);
    free(j);
}

static prune_rec *find_rec(srv_prune_jobs *j, uint32_t id) {
    for (int64_t i = j->n - 1; i >= 0 && i >= j->n - SRV_PRUNE_KEEP; i--)
        if (j->recs[i % SRV_PRUNE_KEEP].id == id) return &j->recs[i % SRV_PRUNE_KEEP];
    return NULL;
}

static prune_rec *new_rec(srv_prune_jobs *j, uint32_t id) {
    prune_rec *r = &j->recs[j->n++ % SRV_PRUNE_KEEP];
    *r = (prune_rec){.id = id};
    r->res.prune_id = id;
    r->res.status = LETHE_PRUNE_QUEUED;
    return r;
}

/* the engine thread's callback */
static void on_done(void *user, const lethe_prune_result *r) {
    srv_prune_jobs *j = user;
    pthread_mutex_lock(&j->mu);
    prune_rec *rec = find_rec(j, r->prune_id);
    if (!rec) rec = new_rec(j, r->prune_id);
    rec->res = *r;
    pthread_mutex_unlock(&j->mu);
}

static const char *status_name(lethe_prune_status s) {
    switch (s) {
    case LETHE_PRUNE_QUEUED: return "queued";
    case LETHE_PRUNE_COMPLETED: return "completed";
    case LETHE_PRUNE_BLOCKED: return "blocked";
    case LETHE_PRUNE_FAILED: return "failed";
    }
    return "failed";
}

static const char *policy_name(lethe_prune_policy p) {
    return p == LETHE_PRUNE_KVZIP_GLOBAL ? "kvzip_global" : "snapkv_global";
}

/* ---- the selector ---- */

static int int_field(const cJSON *root, const char *name, int32_t lo, int32_t hi, int32_t *out,
                     srv_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != (double)(int64_t)v->valuedouble ||
        v->valuedouble < lo || v->valuedouble > hi)
        return srv_errorf(err, 400, name, "'%s' must be an integer in [%d, %d]", name, lo, hi);
    *out = (int32_t)v->valuedouble;
    return 1;
}

/* Fills *tokens from exactly one of token_ids / text / chat; returns 1, 0
 * (none given), or -1 with *err. */
static int parse_selector(const srv_api *api, const cJSON *root, int32_t **tokens, int32_t *n,
                          srv_error *err) {
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(root, "token_ids");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text");
    const cJSON *chat = cJSON_GetObjectItemCaseSensitive(root, "chat");
    const int given = (ids != NULL) + (text != NULL) + (chat != NULL);
    *tokens = NULL;
    *n = 0;
    if (given == 0) return 0;
    if (given > 1)
        return srv_errorf(err, 400, NULL, "give exactly one of 'token_ids', 'text' and 'chat'");
    if (ids) {
        if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) == 0)
            return srv_errorf(err, 400, "token_ids",
                              "'token_ids' must be a non-empty array of token ids");
        const int32_t cnt = cJSON_GetArraySize(ids);
        int32_t *t = lethe_xmalloc((size_t)cnt * sizeof(int32_t));
        int32_t k = 0;
        const int32_t vocab = lethe_engine_vocab_size(api->engine);
        for (const cJSON *x = ids->child; x; x = x->next, k++) {
            if (!cJSON_IsNumber(x) || x->valuedouble != (double)(int64_t)x->valuedouble ||
                x->valuedouble < 0 || x->valuedouble >= vocab) {
                free(t);
                return srv_errorf(err, 400, "token_ids",
                                  "token_ids[%d] is not a token id in [0, %d)", k, vocab);
            }
            t[k] = (int32_t)x->valuedouble;
        }
        *tokens = t;
        *n = cnt;
        return 1;
    }
    if (text) {
        if (!cJSON_IsString(text)) return srv_errorf(err, 400, "text", "'text' must be a string");
        if (lethe_engine_tokenize(api->engine, text->valuestring,
                                  lethe_engine_adds_bos(api->engine), true, tokens, n) != 0)
            return srv_errorf(err, 400, "text", "cannot tokenize 'text': %s",
                              lethe_engine_last_error());
        return 1;
    }
    if (!cJSON_IsObject(chat))
        return srv_errorf(err, 400, "chat", "'chat' must be a chat completion request");
    char *body = cJSON_PrintUnformatted(chat);
    srv_gen g;
    memset(&g, 0, sizeof(g));
    int rc = srv_parse_request(api, SRV_CHAT, body, strlen(body), NULL, &g, err);
    free(body);
    if (rc == 0) {
        *tokens = g.prompt;
        *n = g.n_prompt;
        g.prompt = NULL;
    }
    srv_gen_free(&g);
    return rc == 0 ? 1 : -1;
}

/* ---- prune ---- */

static int parse_ranges(const cJSON *root, lethe_prune_range *r, int32_t *n, srv_error *err) {
    const cJSON *ranges = cJSON_GetObjectItemCaseSensitive(root, "ranges");
    int32_t s = 0, e = 0;
    const int has_s = int_field(root, "range_start", INT32_MIN, INT32_MAX, &s, err);
    if (has_s < 0) return -1;
    const int has_e = int_field(root, "range_end", INT32_MIN, INT32_MAX, &e, err);
    if (has_e < 0) return -1;
    if (ranges && (has_s || has_e))
        return srv_errorf(err, 400, "ranges",
                          "give 'ranges' or 'range_start' / 'range_end', not both");
    if (!ranges) {
        if (!has_s || !has_e)
            return srv_errorf(
                err, 400, "ranges",
                "give 'ranges': [[start, end], ...] or 'range_start' and 'range_end'");
        r[0] = (lethe_prune_range){s, e};
        *n = 1;
        return 0;
    }
    if (!cJSON_IsArray(ranges) || cJSON_GetArraySize(ranges) == 0 ||
        cJSON_GetArraySize(ranges) > LETHE_PRUNE_MAX_RANGES)
        return srv_errorf(err, 400, "ranges", "'ranges' must be 1 to %d [start, end] pairs",
                          LETHE_PRUNE_MAX_RANGES);
    int32_t k = 0;
    for (const cJSON *x = ranges->child; x; x = x->next, k++) {
        const cJSON *a = cJSON_GetArrayItem(x, 0), *b = cJSON_GetArrayItem(x, 1);
        if (!cJSON_IsArray(x) || cJSON_GetArraySize(x) != 2 || !cJSON_IsNumber(a) ||
            !cJSON_IsNumber(b) || a->valuedouble != (double)(int32_t)a->valuedouble ||
            b->valuedouble != (double)(int32_t)b->valuedouble)
            return srv_errorf(err, 400, "ranges", "ranges[%d] must be [start, end] (integers)", k);
        r[k] = (lethe_prune_range){(int32_t)a->valuedouble, (int32_t)b->valuedouble};
    }
    *n = k;
    return 0;
}

static char *prune_post(srv_prune_jobs *jobs, const srv_api *api, const cJSON *root,
                        srv_error *err) {
    lethe_prune_params p = {.policy = LETHE_PRUNE_SNAPKV_GLOBAL};
    lethe_prune_range ranges[LETHE_PRUNE_MAX_RANGES];
    const cJSON *pol = cJSON_GetObjectItemCaseSensitive(root, "policy");
    if (pol) {
        if (!cJSON_IsString(pol) || (strcmp(pol->valuestring, "snapkv_global") &&
                                     strcmp(pol->valuestring, "kvzip_global"))) {
            srv_errorf(err, 400, "policy",
                       "'policy' must be \"snapkv_global\" or \"kvzip_global\"");
            return NULL;
        }
        if (!strcmp(pol->valuestring, "kvzip_global")) p.policy = LETHE_PRUNE_KVZIP_GLOBAL;
    }
    const cJSON *rec = cJSON_GetObjectItemCaseSensitive(root, "allow_recompress");
    if (rec && !cJSON_IsFalse(rec)) {
        srv_errorf(err, 400, "allow_recompress",
                   "'allow_recompress' is reserved: pruned ranges are not recompressed");
        return NULL;
    }
    const cJSON *keep = cJSON_GetObjectItemCaseSensitive(root, "keep_tokens");
    if (!keep) {
        srv_errorf(err, 400, "keep_tokens", "'keep_tokens' is required");
        return NULL;
    }
    if (int_field(root, "keep_tokens", INT32_MIN, INT32_MAX, &p.keep_tokens, err) < 0) return NULL;
    if (int_field(root, "observation_tokens", 0, 1 << 20, &p.observation_tokens, err) < 0)
        return NULL;
    if (parse_ranges(root, ranges, &p.n_ranges, err) < 0) return NULL;
    p.ranges = ranges;
    int32_t *tokens = NULL;
    int sel = parse_selector(api, root, &tokens, &p.n_tokens, err);
    if (sel == 0)
        srv_errorf(err, 400, NULL, "give the path: one of 'token_ids', 'text' and 'chat'");
    if (sel <= 0) return NULL;
    p.tokens = tokens;
    if (lethe_prune_validate(&p, NULL, NULL) != LETHE_OK) {
        srv_errorf(err, 400, "ranges", "%s", lethe_engine_last_error());
        free(tokens);
        return NULL;
    }
    /* the record first: the engine thread may finish the job before submit returns */
    /* under the lock: the engine thread's callback waits for the record (with
     * a synchronous engine it runs inside submit and makes the record itself) */
    pthread_mutex_lock(&jobs->mu);
    uint32_t id = 0;
    int rc = lethe_engine_prune_submit(api->engine, &p, on_done, jobs, &id);
    if (rc == 0 && !find_rec(jobs, id)) {
        prune_rec *r = new_rec(jobs, id);
        r->res.policy = p.policy;
    }
    pthread_mutex_unlock(&jobs->mu);
    free(tokens);
    if (rc != 0) {
        srv_errorf(err, 400, NULL, "%s", lethe_engine_last_error());
        return NULL;
    }
    cJSON *o = cJSON_CreateObject();
    char sid[32];
    snprintf(sid, sizeof(sid), "prune_%u", id);
    cJSON_AddStringToObject(o, "prune_id", sid);
    cJSON_AddStringToObject(o, "status", "queued");
    cJSON_AddStringToObject(o, "policy", policy_name(p.policy));
    cJSON_AddNumberToObject(o, "keep_tokens", p.keep_tokens);
    char *out = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return out;
}

static char *prune_get(srv_prune_jobs *jobs, const char *sid, srv_error *err) {
    unsigned id = 0;
    char tail;
    if (sscanf(sid, "prune_%u%c", &id, &tail) != 1) {
        srv_errorf(err, 404, NULL, "no prune job %s", sid);
        return NULL;
    }
    pthread_mutex_lock(&jobs->mu);
    prune_rec *r = find_rec(jobs, id);
    lethe_prune_result res;
    if (r) res = r->res;
    pthread_mutex_unlock(&jobs->mu);
    if (!r) {
        srv_errorf(err, 404, NULL, "no prune job %s", sid);
        return NULL;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prune_id", sid);
    cJSON_AddStringToObject(o, "status", status_name(res.status));
    cJSON_AddStringToObject(o, "policy", policy_name(res.policy));
    if (res.status == LETHE_PRUNE_COMPLETED) {
        cJSON_AddNumberToObject(o, "freed_device_slots", (double)res.freed_device_slots);
        cJSON_AddBoolToObject(o, "quality_degraded", res.quality_degraded);
        cJSON *arr = cJSON_AddArrayToObject(o, "ranges");
        for (int32_t i = 0; i < res.n_ranges; i++) {
            cJSON *x = cJSON_CreateObject();
            cJSON_AddStringToObject(x, "prune_id", sid);
            cJSON_AddStringToObject(x, "policy", policy_name(res.policy));
            cJSON *rg = cJSON_AddArrayToObject(x, "range");
            cJSON_AddItemToArray(rg, cJSON_CreateNumber(res.ranges[i].start));
            cJSON_AddItemToArray(rg, cJSON_CreateNumber(res.ranges[i].end));
            cJSON_AddNumberToObject(x, "original_tokens", res.ranges[i].original_tokens);
            cJSON_AddNumberToObject(x, "retained_tokens", res.ranges[i].retained_tokens);
            cJSON_AddItemToArray(arr, x);
        }
    }
    if (res.status == LETHE_PRUNE_BLOCKED || res.status == LETHE_PRUNE_FAILED)
        cJSON_AddStringToObject(o, "message", res.message);
    char *out = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return out;
}

/* ---- radix control ---- */

static void hex_id(uint64_t v, char out[17]) { snprintf(out, 17, "%016" PRIx64, v); }

static char *match_post(const srv_api *api, const int32_t *t, int32_t n, srv_error *err) {
    lethe_prefix_match m;
    if (lethe_engine_prefix_match(api->engine, t, n, &m) != 0) {
        srv_errorf(err, 400, NULL, "%s", lethe_engine_last_error());
        return NULL;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "supported", m.enabled);
    cJSON_AddBoolToObject(o, "enabled", m.enabled);
    cJSON_AddStringToObject(o, "mode", lethe_engine_prefix_cache_mode(api->engine));
    cJSON_AddNumberToObject(o, "block_size", m.block_size);
    cJSON_AddNumberToObject(o, "prompt_tokens", m.prompt_tokens);
    cJSON_AddNumberToObject(o, "usable_tokens", m.usable_tokens);
    cJSON_AddNumberToObject(o, "matched_tokens", m.matched_tokens);
    cJSON_AddNumberToObject(o, "matched_blocks", m.matched_blocks);
    cJSON_AddNumberToObject(o, "resident_kv_tokens", m.resident_kv_tokens);
    cJSON_AddNumberToObject(o, "match_ratio",
                            m.usable_tokens ? (double)m.matched_tokens / m.usable_tokens : 0.0);
    char h[17];
    hex_id(m.last_block_id, h);
    if (m.matched_blocks) cJSON_AddStringToObject(o, "last_block_id", h);
    else cJSON_AddNullToObject(o, "last_block_id");
    cJSON_AddNumberToObject(o, "live_blocks", m.live_blocks);
    char *out = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return out;
}

static char *inspect_post(const srv_api *api, const int32_t *t, int32_t n, srv_error *err) {
    int32_t total = lethe_engine_prefix_inspect(api->engine, t, n, NULL, 0);
    if (total < 0) {
        srv_errorf(err, 400, NULL, "prefix-cache control needs the radix prefix cache (mode %s)",
                   lethe_engine_prefix_cache_mode(api->engine));
        return NULL;
    }
    const int32_t cap = LETHE_MIN(total, 4096);
    lethe_prefix_block *b = lethe_xmalloc((size_t)LETHE_MAX(cap, 1) * sizeof(*b));
    int32_t got = lethe_engine_prefix_inspect(api->engine, t, n, b, cap);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "block_size", LETHE_PREFIX_BLOCK);
    cJSON_AddNumberToObject(o, "n_blocks", got);
    cJSON *arr = cJSON_AddArrayToObject(o, "blocks");
    for (int32_t i = 0; i < LETHE_MIN(got, cap); i++) {
        cJSON *x = cJSON_CreateObject();
        char h[17];
        hex_id(b[i].id, h);
        cJSON_AddStringToObject(x, "block_id", h);
        if (b[i].parent_id) {
            hex_id(b[i].parent_id, h);
            cJSON_AddStringToObject(x, "parent_id", h);
        } else {
            cJSON_AddNullToObject(x, "parent_id");
        }
        cJSON_AddNumberToObject(x, "start", b[i].start);
        cJSON_AddNumberToObject(x, "resident_kv_tokens", b[i].resident);
        cJSON_AddNumberToObject(x, "ref_count", b[i].req_refs);
        cJSON_AddNumberToObject(x, "children", b[i].n_children);
        cJSON_AddNumberToObject(x, "eviction_priority", b[i].priority);
        cJSON_AddBoolToObject(x, "quality_degraded", b[i].prune_id != 0);
        if (b[i].prune_id) {
            char sid[32];
            snprintf(sid, sizeof(sid), "prune_%u", b[i].prune_id);
            cJSON_AddStringToObject(x, "prune_id", sid);
        }
        cJSON_AddItemToArray(arr, x);
    }
    cJSON_AddBoolToObject(o, "truncated", got > cap);
    free(b);
    char *out = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return out;
}

static int status_of(int rc) {
    switch (rc) {
    case LETHE_ERR_NOT_FOUND: return 404;
    case LETHE_ERR_BUSY: return 409;
    default: return 400;
    }
}

/* ---- routing ---- */

char *srv_prefix_cache_route(srv_prune_jobs *jobs, const srv_api *api, bool post, const char *path,
                             const char *body, size_t len, int *status, srv_error *err) {
    const char *sub = path + strlen(SRV_PREFIX_CACHE_ROUTE);
    *status = 200;
    if (!strncmp(sub, "prune/", 6)) {
        if (post) {
            srv_errorf(err, 405, NULL, "use GET %s", path);
            return NULL;
        }
        return prune_get(jobs, sub + 6, err);
    }
    static const char *const routes[] = {"prune", "match", "inspect", "delete_subtree",
                                         "set_eviction_priority"};
    int k = -1;
    for (int i = 0; i < 5; i++)
        if (!strcmp(sub, routes[i])) k = i;
    if (k < 0) {
        srv_errorf(err, 404, NULL, "no route %s", path);
        return NULL;
    }
    if (!post) {
        srv_errorf(err, 405, NULL, "use POST %s", path);
        return NULL;
    }
    cJSON *root = NULL;
    if (srv_json_parse(body, len, &root, err)) return NULL;
    char *out = NULL;
    int32_t *t = NULL, n = 0;
    if (!cJSON_IsObject(root)) {
        srv_errorf(err, 400, NULL, "request body must be a JSON object");
        goto done;
    }
    if (k == 0) {
        out = prune_post(jobs, api, root, err);
        if (out) *status = 202;
        goto done;
    }
    int sel = parse_selector(api, root, &t, &n, err);
    if (sel < 0) goto done;
    if (sel == 0 && k != 2) {
        srv_errorf(err, 400, NULL, "give the path: one of 'token_ids', 'text' and 'chat'");
        goto done;
    }
    if (k == 1) {
        out = match_post(api, t, n, err);
    } else if (k == 2) {
        out = inspect_post(api, t, n, err);
    } else if (k == 3) {
        int32_t deleted = 0;
        int rc = lethe_engine_prefix_delete_subtree(api->engine, t, n, &deleted);
        if (rc != 0) {
            srv_errorf(err, status_of(rc), NULL, "%s", lethe_engine_last_error());
        } else {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "deleted_blocks", deleted);
            out = cJSON_PrintUnformatted(o);
            cJSON_Delete(o);
        }
    } else {
        int32_t prio = 0, nb = 0;
        int has = int_field(root, "priority", INT32_MIN, INT32_MAX, &prio, err);
        if (has < 0) goto done;
        if (has == 0) {
            srv_errorf(err, 400, "priority", "'priority' is required (negative = pinned)");
            goto done;
        }
        int rc = lethe_engine_prefix_set_priority(api->engine, t, n, prio, &nb);
        if (rc != 0) {
            srv_errorf(err, status_of(rc), NULL, "%s", lethe_engine_last_error());
        } else {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "blocks", nb);
            cJSON_AddNumberToObject(o, "priority", prio);
            cJSON_AddBoolToObject(o, "pinned", prio < 0);
            out = cJSON_PrintUnformatted(o);
            cJSON_Delete(o);
        }
    }
done:
    free(t);
    cJSON_Delete(root);
    return out;
}

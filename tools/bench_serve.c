/* bench_serve.c - `lethe bench serve`: a serving benchmark client for OpenAI-compatible servers.
 *
 * In the spirit of `vllm bench serve`: builds a workload (random lengths,
 * fixed lengths with --random-range-ratio 0, or a JSONL dataset; optional
 * shared prefix), sends it with Poisson arrivals (--request-rate) and/or a
 * concurrency cap (--max-concurrency), streams every response and measures
 * TTFT, TPOT, inter-token latency and end-to-end latency per request on the
 * client's clock. One thread drives all requests through the libcurl multi
 * interface, so timestamps are taken when bytes arrive, not when a worker
 * thread gets scheduled.
 *
 * Output lengths are exact because requests carry ignore_eos and max_tokens;
 * token counts come from the final usage chunk (stream_options.include_usage).
 * When the server has /metrics, its counters are read before and after the
 * run and the deltas (server-side TTFT sum/count, prompt and generation
 * tokens) are stored next to the client's numbers so the two can be checked
 * against each other. Everything is printed vLLM-style and written as JSON
 * (--result-json); src/eval/bench_serve_lib.c computes the numbers. */
#include <curl/curl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "commands.h"
#include "core/util.h"
#include "eval/bench_serve.h"
#include "eval/eval.h"
#include "eval/runinfo.h"
#include "options.h"

typedef struct bs_opts {
    const char *base_url, *endpoint, *model, *dataset, *result_json, *api_key, *percentiles;
    const char *server_method, *server_config;
    int32_t num_prompts, max_concurrency, input_len, output_len, shared_prefix_len, timeout_s;
    float request_rate, range_ratio, temperature;
    uint64_t seed;
    bool ignore_eos, save_detailed, progress;
} bs_opts;

/* ---- small blocking HTTP GET (model discovery, /metrics) ------------------- */

typedef struct membuf {
    char *s;
    size_t n;
} membuf;

static size_t mem_write(char *p, size_t sz, size_t nm, void *u) {
    membuf *b = u;
    size_t n = sz * nm;
    if (b->n + n > (64u << 20)) return 0; /* refuse absurd bodies */
    b->s = lethe_xrealloc(b->s, b->n + n + 1);
    memcpy(b->s + b->n, p, n);
    b->n += n;
    b->s[b->n] = '\0';
    return n;
}

static char *http_get(const bs_opts *o, const char *path, long *code) {
    char url[1024];
    snprintf(url, sizeof(url), "%s%s", o->base_url, path);
    CURL *h = curl_easy_init();
    membuf b = {0};
    struct curl_slist *hd = NULL;
    if (o->api_key) {
        char auth[512];
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", o->api_key);
        hd = curl_slist_append(hd, auth);
    }
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, mem_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    CURLcode rc = curl_easy_perform(h);
    *code = 0;
    if (rc == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, code);
    curl_slist_free_all(hd);
    curl_easy_cleanup(h);
    if (rc != CURLE_OK) {
        free(b.s);
        fprintf(stderr, "lethe bench serve: GET %s: %s\n", url, curl_easy_strerror(rc));
        return NULL;
    }
    return b.s ? b.s : lethe_xstrdup("");
}

static char *discover_model(const bs_opts *o) {
    long code;
    char *body = http_get(o, "/v1/models", &code);
    if (!body) return NULL;
    char *id = NULL;
    cJSON *j = cJSON_Parse(body);
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "data");
    const cJSON *m0 = cJSON_IsArray(d) ? cJSON_GetArrayItem(d, 0) : NULL;
    const cJSON *mid = cJSON_GetObjectItemCaseSensitive(m0, "id");
    if (code == 200 && cJSON_IsString(mid)) id = lethe_xstrdup(mid->valuestring);
    else fprintf(stderr, "lethe bench serve: GET /v1/models gave HTTP %ld without a model id; pass --model\n", code);
    cJSON_Delete(j);
    free(body);
    return id;
}

/* server counters, read before and after the run */
typedef struct server_counters {
    bool ok;
    double ttft_sum, ttft_count, prompt_tokens, generation_tokens, e2e_sum, e2e_count;
} server_counters;

static void read_counters(const bs_opts *o, server_counters *c) {
    memset(c, 0, sizeof(*c));
    long code;
    char *t = http_get(o, "/metrics", &code);
    if (!t) return;
    if (code == 200) {
        c->ok = lethe_bs_prom_sum(t, "time_to_first_token_seconds_sum", &c->ttft_sum);
        lethe_bs_prom_sum(t, "time_to_first_token_seconds_count", &c->ttft_count);
        lethe_bs_prom_sum(t, "prompt_tokens_total", &c->prompt_tokens);
        lethe_bs_prom_sum(t, "generation_tokens_total", &c->generation_tokens);
        lethe_bs_prom_sum(t, "e2e_request_latency_seconds_sum", &c->e2e_sum);
        lethe_bs_prom_sum(t, "e2e_request_latency_seconds_count", &c->e2e_count);
    }
    free(t);
}

/* ---- streamed requests ------------------------------------------------------- */

typedef struct req {
    CURL *h;
    struct curl_slist *hdrs;
    char *body;
    lethe_sse sse;
    lethe_bs_record *rec;
    double t_last;
    int32_t cap_itl;
    bool got_done, finished;
    char head[400];   /* first bytes of the response, for error messages */
    size_t n_head;
    char curl_err[CURL_ERROR_SIZE];
} req;

static void on_event(void *user, const char *data, size_t len) {
    req *r = user;
    lethe_bs_chunk c;
    lethe_bs_parse_chunk(data, len, &c);
    if (c.done) {
        r->got_done = true;
        return;
    }
    if (c.error[0] && !r->rec->error[0]) snprintf(r->rec->error, sizeof(r->rec->error), "server: %s", c.error);
    if (c.content_bytes > 0) {
        double now = lethe_time_s();
        lethe_bs_record *rec = r->rec;
        if (rec->t_first < 0) {
            rec->t_first = now;
        } else {
            if (rec->n_itl == r->cap_itl) {
                r->cap_itl = r->cap_itl ? r->cap_itl * 2 : 64;
                rec->itl = lethe_xrealloc(rec->itl, (size_t)r->cap_itl * sizeof(double));
            }
            rec->itl[rec->n_itl++] = now - r->t_last;
        }
        r->t_last = now;
        rec->n_chunks++;
    }
    if (c.finished) r->finished = true;
    if (c.has_usage) {
        r->rec->prompt_tokens = c.prompt_tokens;
        r->rec->output_tokens = c.completion_tokens;
        r->rec->cached_tokens = c.cached_tokens;
    }
}

static size_t on_bytes(char *p, size_t sz, size_t nm, void *u) {
    req *r = u;
    size_t n = sz * nm;
    if (r->n_head < sizeof(r->head) - 1) {
        size_t k = LETHE_MIN(n, sizeof(r->head) - 1 - r->n_head);
        memcpy(r->head + r->n_head, p, k);
        r->n_head += k;
        r->head[r->n_head] = '\0';
    }
    lethe_sse_feed(&r->sse, p, n, on_event, r);
    return n;
}

static char *request_body(const bs_opts *o, const char *model, const lethe_bs_item *it, bool chat) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "model", model);
    if (chat) {
        cJSON *msgs = it->messages_json ? cJSON_Parse(it->messages_json) : NULL;
        if (!msgs) {
            msgs = cJSON_CreateArray();
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "user");
            cJSON_AddStringToObject(m, "content", it->prompt);
            cJSON_AddItemToArray(msgs, m);
        }
        cJSON_AddItemToObject(j, "messages", msgs);
    } else {
        cJSON_AddStringToObject(j, "prompt", it->prompt);
    }
    cJSON_AddNumberToObject(j, "max_tokens", it->output_len);
    cJSON_AddNumberToObject(j, "temperature", o->temperature);
    if (o->ignore_eos) cJSON_AddBoolToObject(j, "ignore_eos", true);
    cJSON_AddBoolToObject(j, "stream", true);
    cJSON *so = cJSON_AddObjectToObject(j, "stream_options");
    cJSON_AddBoolToObject(so, "include_usage", true);
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    return s;
}

static void start_req(CURLM *m, const bs_opts *o, req *r, const char *url, const char *model,
                      const lethe_bs_item *it, bool chat) {
    r->body = request_body(o, model, it, chat);
    r->h = curl_easy_init();
    r->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    r->hdrs = curl_slist_append(r->hdrs, "Accept: text/event-stream");
    if (o->api_key) {
        char auth[512];
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", o->api_key);
        r->hdrs = curl_slist_append(r->hdrs, auth);
    }
    lethe_sse_init(&r->sse);
    curl_easy_setopt(r->h, CURLOPT_URL, url);
    curl_easy_setopt(r->h, CURLOPT_HTTPHEADER, r->hdrs);
    curl_easy_setopt(r->h, CURLOPT_POSTFIELDS, r->body);
    curl_easy_setopt(r->h, CURLOPT_WRITEFUNCTION, on_bytes);
    curl_easy_setopt(r->h, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(r->h, CURLOPT_ERRORBUFFER, r->curl_err);
    curl_easy_setopt(r->h, CURLOPT_TIMEOUT, (long)o->timeout_s);
    curl_easy_setopt(r->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(r->h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(r->h, CURLOPT_PRIVATE, r);
    r->rec->t_first = -1;
    r->rec->prompt_tokens = r->rec->output_tokens = r->rec->cached_tokens = -1;
    r->rec->t_start = lethe_time_s();
    curl_multi_add_handle(m, r->h);
}

static void finish_req(CURLM *m, req *r, CURLcode res) {
    lethe_bs_record *rec = r->rec;
    rec->t_end = lethe_time_s();
    long code = 0;
    curl_easy_getinfo(r->h, CURLINFO_RESPONSE_CODE, &code);
    if (res != CURLE_OK)
        snprintf(rec->error, sizeof(rec->error), "curl: %.240s", r->curl_err[0] ? r->curl_err : curl_easy_strerror(res));
    else if (code != 200)
        snprintf(rec->error, sizeof(rec->error), "HTTP %ld: %.200s", code, r->head);
    else if (!r->got_done && !r->finished && !rec->error[0])
        snprintf(rec->error, sizeof(rec->error), "stream ended without a finish_reason or [DONE]");
    rec->ok = !rec->error[0];
    if (rec->output_tokens < 0) rec->output_tokens = rec->n_chunks; /* no usage chunk */
    curl_multi_remove_handle(m, r->h);
    curl_easy_cleanup(r->h);
    curl_slist_free_all(r->hdrs);
    free(r->body);
    lethe_sse_free(&r->sse);
    r->h = NULL;
}

/* Runs the workload; fills recs; returns the benchmark duration (first send -> last finish). */
static double run_workload(const bs_opts *o, const char *model, const lethe_bs_item *items,
                           lethe_bs_record *recs) {
    int32_t n = o->num_prompts;
    bool chat = strstr(o->endpoint, "chat") != NULL;
    char url[1024];
    snprintf(url, sizeof(url), "%s%s", o->base_url, o->endpoint);
    req *rs = lethe_xcalloc((size_t)n, sizeof(req));
    CURLM *m = curl_multi_init();
    curl_multi_setopt(m, CURLMOPT_MAX_TOTAL_CONNECTIONS, o->max_concurrency > 0 ? (long)o->max_concurrency : 0L);
    lethe_progress pb;
    lethe_progress_init(&pb, "bench serve", n, o->progress);
    double t0 = lethe_time_s();
    int32_t next = 0, done = 0, inflight = 0;
    while (done < n) {
        double now = lethe_time_s() - t0;
        while (next < n && items[next].arrival_s <= now &&
               (o->max_concurrency <= 0 || inflight < o->max_concurrency)) {
            rs[next].rec = &recs[next];
            start_req(m, o, &rs[next], url, model, &items[next], chat);
            next++;
            inflight++;
        }
        int running = 0;
        curl_multi_perform(m, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            req *r = NULL;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&r);
            finish_req(m, r, msg->data.result);
            done++;
            inflight--;
            lethe_progress_update(&pb, done, NULL);
        }
        if (done >= n) break;
        int wait_ms = 50;
        if (next < n && (o->max_concurrency <= 0 || inflight < o->max_concurrency)) {
            double dt = items[next].arrival_s - (lethe_time_s() - t0);
            wait_ms = dt <= 0 ? 0 : (int)LETHE_MIN(50.0, ceil(dt * 1000.0));
        }
        curl_multi_poll(m, NULL, 0, wait_ms, NULL);
    }
    double t_end = lethe_time_s();
    lethe_progress_done(&pb);
    curl_multi_cleanup(m);
    free(rs);
    /* duration: from the first send to the last finish */
    double first = t_end;
    for (int32_t i = 0; i < n; i++) first = LETHE_MIN(first, recs[i].t_start);
    (void)t0;
    return t_end - first;
}

/* ---- printing ------------------------------------------------------------------ */

static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static void print_report(const cJSON *r, const double *pcts, int n_pcts) {
    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s %-10.0f\n", "Successful requests:", num(r, "completed"));
    printf("%-40s %-10.0f\n", "Failed requests:", num(r, "failed"));
    printf("%-40s %-10.2f\n", "Benchmark duration (s):", num(r, "duration"));
    printf("%-40s %-10.0f\n", "Total input tokens:", num(r, "total_input_tokens"));
    printf("%-40s %-10.0f\n", "Total generated tokens:", num(r, "total_output_tokens"));
    printf("%-40s %-10.2f\n", "Request throughput (req/s):", num(r, "request_throughput"));
    printf("%-40s %-10.2f\n", "Output token throughput (tok/s):", num(r, "output_throughput"));
    printf("%-40s %-10.2f\n", "Total token throughput (tok/s):", num(r, "total_token_throughput"));
    static const char *const names[4][3] = {
        {"ttft", "TTFT", "Time to First Token"}, {"tpot", "TPOT", "Time per Output Token (excl. 1st token)"},
        {"itl", "ITL", "Inter-token Latency"}, {"e2el", "E2EL", "End-to-end Latency"}};
    for (int k = 0; k < 4; k++) {
        char title[64], key[64], label[96];
        snprintf(title, sizeof(title), " %s ", names[k][2]);
        int pad = 50 - (int)strlen(title);
        printf("%.*s%s%.*s\n", pad / 2, "--------------------------------------------------", title,
               pad - pad / 2, "--------------------------------------------------");
        const char *up = names[k][0], *U = names[k][1];
        snprintf(key, sizeof(key), "mean_%s_ms", up);
        snprintf(label, sizeof(label), "Mean %s (ms):", U);
        printf("%-40s %-10.2f\n", label, num(r, key));
        snprintf(key, sizeof(key), "median_%s_ms", up);
        snprintf(label, sizeof(label), "Median %s (ms):", U);
        printf("%-40s %-10.2f\n", label, num(r, key));
        for (int i = 0; i < n_pcts; i++) {
            snprintf(key, sizeof(key), "p%g_%s_ms", pcts[i], up);
            snprintf(label, sizeof(label), "P%g %s (ms):", pcts[i], U);
            printf("%-40s %-10.2f\n", label, num(r, key));
        }
    }
    printf("==================================================\n");
}

static int parse_pcts(const char *s, double *out, int max) {
    int n = 0;
    const char *p = s;
    while (*p && n < max) {
        char *end;
        double v = strtod(p, &end);
        if (end == p || v < 0 || v > 100 || (*end && *end != ',')) return -1;
        out[n++] = v;
        p = *end ? end + 1 : end;
    }
    return *p ? -1 : n;
}

int lethe_bench_serve(int argc, char **argv) {
    bs_opts o = {.base_url = "http://127.0.0.1:8000", .endpoint = "/v1/completions",
                 .percentiles = "90,99", .num_prompts = 100, .input_len = 1024, .output_len = 128,
                 .timeout_s = 600, .request_rate = INFINITY, .ignore_eos = true, .progress = true};
    lethe_opt rows[40];
    int n = 0;
#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}
    ROW("--base-url", NULL, LETHE_OPT_STR, &o.base_url, "URL", "server address", 1, 0);
    ROW("--endpoint", NULL, LETHE_OPT_STR, &o.endpoint, "PATH", "/v1/completions or /v1/chat/completions", 1, 0);
    ROW("--model", NULL, LETHE_OPT_STR, &o.model, "NAME", "model name sent; default: the first of GET /v1/models", 1, 0);
    ROW("--num-prompts", NULL, LETHE_OPT_INT, &o.num_prompts, "N", "requests to send", 1, 10000000);
    ROW("--request-rate", NULL, LETHE_OPT_FLOAT, &o.request_rate, "R",
        "requests/s with Poisson arrivals; inf = all at once", 1, 0);
    ROW("--max-concurrency", NULL, LETHE_OPT_INT, &o.max_concurrency, "N",
        "at most N requests in flight (0 = no cap)", 0, 1000000);
    ROW("--random-input-len", NULL, LETHE_OPT_INT, &o.input_len, "N", "prompt length in words (~tokens)", 1, 1 << 24);
    ROW("--random-output-len", NULL, LETHE_OPT_INT, &o.output_len, "N", "max_tokens per request (exact with ignore_eos)", 1, 1 << 24);
    ROW("--random-range-ratio", NULL, LETHE_OPT_FLOAT, &o.range_ratio, "R",
        "lengths uniform in [L(1-R), L(1+R)]; 0 = fixed lengths", 0, 0.999);
    ROW("--shared-prefix-len", NULL, LETHE_OPT_INT, &o.shared_prefix_len, "N",
        "every prompt starts with the same N words (prefix-cache workloads)", 0, 1 << 24);
    ROW("--dataset", NULL, LETHE_OPT_STR, &o.dataset, "JSONL",
        "requests from a file: {\"prompt\": ...} or {\"messages\": [...]}, optional \"output_len\"", 1, 0);
    ROW("--seed", NULL, LETHE_OPT_U64, &o.seed, "N", "workload seed (lengths, words, arrivals)", 1, 0);
    ROW("--temperature", NULL, LETHE_OPT_FLOAT, &o.temperature, "T", "sampling temperature sent", 0, 100);
    ROW("--ignore-eos", NULL, LETHE_OPT_BOOL, &o.ignore_eos, NULL, "send ignore_eos so output lengths are exact", 1, 0);
    ROW("--metric-percentiles", NULL, LETHE_OPT_STR, &o.percentiles, "P,P", "percentiles reported (mean and median always)", 1, 0);
    ROW("--result-json", NULL, LETHE_OPT_STR, &o.result_json, "PATH", "write the results as JSON", 1, 0);
    ROW("--save-detailed", NULL, LETHE_OPT_BOOL, &o.save_detailed, NULL,
        "add per-request arrays (lengths, ttfts, itls, errors) to the JSON", 1, 0);
    ROW("--server-method", NULL, LETHE_OPT_STR, &o.server_method, "NAME",
        "sparse method the server runs (recorded in the JSON)", 1, 0);
    ROW("--server-config", NULL, LETHE_OPT_STR, &o.server_config, "K=V,...",
        "server knobs / flags (recorded in the JSON)", 1, 0);
    ROW("--timeout", NULL, LETHE_OPT_INT, &o.timeout_s, "S", "per-request timeout in seconds", 1, 86400);
    ROW("--api-key", NULL, LETHE_OPT_STR, &o.api_key, "KEY", "sent as Authorization: Bearer KEY", 1, 0);
    ROW("--progress", NULL, LETHE_OPT_BOOL, &o.progress, NULL, "progress bar on stderr", 1, 0);
#undef ROW
    const char *pos[1];
    int n_pos = 0;
    int pr = lethe_opts_parse(rows, n, argc, argv, "lethe bench serve [options]",
                              "Serving benchmark client (OpenAI API, streaming), like `vllm bench serve`.",
                              pos, &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    double pcts[16];
    int n_pcts = parse_pcts(o.percentiles, pcts, 16);
    if (n_pcts < 0) {
        fprintf(stderr, "lethe bench serve: --metric-percentiles: '%s' is not a list of numbers in [0, 100]\n",
                o.percentiles);
        return 2;
    }
    if (!(o.request_rate > 0)) {
        fprintf(stderr, "lethe bench serve: --request-rate must be > 0 or inf\n");
        return 2;
    }
    if (o.endpoint[0] != '/') {
        fprintf(stderr, "lethe bench serve: --endpoint must start with '/' (e.g. /v1/completions)\n");
        return 2;
    }
    lethe_bs_workload_params wp = {.num_prompts = o.num_prompts, .input_len = o.input_len,
                                   .output_len = o.output_len, .range_ratio = o.range_ratio,
                                   .shared_prefix_len = o.shared_prefix_len,
                                   .request_rate = o.request_rate, .seed = o.seed, .dataset = o.dataset};
    lethe_bs_item *items = NULL;
    if (lethe_bs_workload_make(&wp, &items) != LETHE_OK) {
        fprintf(stderr, "lethe bench serve: %s\n", lethe_last_error());
        return 2;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    int rc = 1;
    char *model = o.model ? lethe_xstrdup(o.model) : discover_model(&o);
    lethe_bs_record *recs = lethe_xcalloc((size_t)o.num_prompts, sizeof(*recs));
    if (!model) goto out;
    char command[2048] = "lethe bench"; /* argv[0] is "serve" */
    for (int i = 0; i < argc; i++) {
        size_t cl = strlen(command);
        snprintf(command + cl, sizeof(command) - cl, " %s", argv[i]);
    }
    char date[64], commit[64], machine[256]; /* the code and time the run starts with */
    lethe_runinfo_date(date, sizeof(date));
    lethe_runinfo_commit(commit, sizeof(commit));
    lethe_runinfo_machine(machine, sizeof(machine));
    server_counters before, after;
    read_counters(&o, &before);
    char conc[32] = "no cap";
    if (o.max_concurrency > 0) snprintf(conc, sizeof(conc), "%d", o.max_concurrency);
    fprintf(stderr, "lethe bench serve: %d requests to %s%s (model %s), rate %g req/s, max concurrency %s\n",
            o.num_prompts, o.base_url, o.endpoint, model, (double)o.request_rate, conc);
    double duration = run_workload(&o, model, items, recs);
    /* the server publishes its counters at the end of an engine step, which
     * can come just after the last response: read until two reads agree */
    read_counters(&o, &after);
    for (int k = 0; k < 20 && after.ok; k++) {
        server_counters again;
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        read_counters(&o, &again);
        bool same = again.ttft_count == after.ttft_count && again.generation_tokens == after.generation_tokens &&
                    again.prompt_tokens == after.prompt_tokens && again.e2e_count == after.e2e_count;
        after = again;
        if (same) break;
    }

    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "schema", "lethe-bench-serve/1");
    cJSON_AddStringToObject(j, "date", date);
    cJSON_AddStringToObject(j, "commit", commit);
    cJSON_AddStringToObject(j, "machine", machine);
    cJSON_AddStringToObject(j, "command", command);
    cJSON_AddStringToObject(j, "base_url", o.base_url);
    cJSON_AddStringToObject(j, "endpoint", o.endpoint);
    cJSON_AddStringToObject(j, "model_id", model);
    cJSON_AddStringToObject(j, "method", o.server_method ? o.server_method : "unspecified");
    cJSON_AddStringToObject(j, "knobs", o.server_config ? o.server_config : "");
    cJSON_AddNumberToObject(j, "num_prompts", o.num_prompts);
    if (isinf(o.request_rate)) cJSON_AddStringToObject(j, "request_rate", "inf");
    else cJSON_AddNumberToObject(j, "request_rate", o.request_rate);
    if (o.max_concurrency > 0) cJSON_AddNumberToObject(j, "max_concurrency", o.max_concurrency);
    else cJSON_AddNullToObject(j, "max_concurrency");
    if (o.dataset) cJSON_AddStringToObject(j, "dataset", o.dataset);
    else {
        cJSON_AddNumberToObject(j, "random_input_len", o.input_len);
        cJSON_AddNumberToObject(j, "random_output_len", o.output_len);
        cJSON_AddNumberToObject(j, "random_range_ratio", o.range_ratio);
        cJSON_AddNumberToObject(j, "shared_prefix_len", o.shared_prefix_len);
    }
    cJSON_AddNumberToObject(j, "seed", (double)o.seed);
    cJSON_AddBoolToObject(j, "ignore_eos", o.ignore_eos);
    cJSON_AddNumberToObject(j, "temperature", o.temperature);
    lethe_bs_report(j, recs, o.num_prompts, duration, pcts, n_pcts);
    if (before.ok && after.ok) {
        cJSON *s = cJSON_AddObjectToObject(j, "server_metrics");
        double c = after.ttft_count - before.ttft_count;
        cJSON_AddNumberToObject(s, "requests", c);
        if (c > 0) cJSON_AddNumberToObject(s, "mean_ttft_ms", (after.ttft_sum - before.ttft_sum) / c * 1000.0);
        cJSON_AddNumberToObject(s, "prompt_tokens", after.prompt_tokens - before.prompt_tokens);
        cJSON_AddNumberToObject(s, "generation_tokens", after.generation_tokens - before.generation_tokens);
        double ec = after.e2e_count - before.e2e_count;
        if (ec > 0) cJSON_AddNumberToObject(s, "mean_e2el_ms", (after.e2e_sum - before.e2e_sum) / ec * 1000.0);
    }
    int32_t n_err = 0;
    cJSON *errs = cJSON_CreateArray();
    for (int32_t i = 0; i < o.num_prompts; i++)
        if (!recs[i].ok && n_err++ < 10) cJSON_AddItemToArray(errs, cJSON_CreateString(recs[i].error));
    if (o.save_detailed) {
        cJSON *il = cJSON_AddArrayToObject(j, "input_lens"), *ol = cJSON_AddArrayToObject(j, "output_lens");
        cJSON *tf = cJSON_AddArrayToObject(j, "ttfts"), *it = cJSON_AddArrayToObject(j, "itls");
        cJSON *er = cJSON_AddArrayToObject(j, "errors");
        for (int32_t i = 0; i < o.num_prompts; i++) {
            cJSON_AddItemToArray(il, cJSON_CreateNumber(recs[i].prompt_tokens));
            cJSON_AddItemToArray(ol, cJSON_CreateNumber(recs[i].output_tokens));
            cJSON_AddItemToArray(tf, cJSON_CreateNumber(recs[i].t_first >= 0 ? recs[i].t_first - recs[i].t_start : -1));
            cJSON *a = cJSON_CreateArray();
            for (int32_t k = 0; k < recs[i].n_itl; k++) cJSON_AddItemToArray(a, cJSON_CreateNumber(recs[i].itl[k]));
            cJSON_AddItemToArray(it, a);
            cJSON_AddItemToArray(er, cJSON_CreateString(recs[i].error));
        }
        cJSON_Delete(errs);
    } else {
        cJSON_AddItemToObject(j, "errors", errs);
    }
    print_report(j, pcts, n_pcts);
    for (int32_t i = 0; i < o.num_prompts && n_err; i++)
        if (!recs[i].ok) {
            fprintf(stderr, "lethe bench serve: %d requests failed; the first: %s\n", n_err, recs[i].error);
            break;
        }
    if (before.ok && after.ok)
        printf("server /metrics over the run: %.0f requests, mean TTFT %.2f ms, %.0f prompt + %.0f generated tokens\n",
               num(cJSON_GetObjectItem(j, "server_metrics"), "requests"),
               num(cJSON_GetObjectItem(j, "server_metrics"), "mean_ttft_ms"),
               num(cJSON_GetObjectItem(j, "server_metrics"), "prompt_tokens"),
               num(cJSON_GetObjectItem(j, "server_metrics"), "generation_tokens"));
    rc = n_err ? 1 : 0;
    if (o.result_json) {
        char *s = cJSON_Print(j);
        FILE *f = fopen(o.result_json, "w");
        if (!f || fputs(s, f) < 0 || fputc('\n', f) == EOF) {
            fprintf(stderr, "lethe bench serve: cannot write %s\n", o.result_json);
            rc = 1;
        }
        if (f) fclose(f);
        free(s);
    }
    cJSON_Delete(j);
out:
    for (int32_t i = 0; i < o.num_prompts; i++) free(recs[i].itl);
    free(recs);
    free(model);
    lethe_bs_workload_free(items, o.num_prompts);
    curl_global_cleanup();
    return rc;
}

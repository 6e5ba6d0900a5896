/* test_eval_bench_serve.c - the network-free parts of `lethe bench serve`.
 *
 * SSE parsing under every split of a stream into two feeds (and with \r\n
 * line ends, comments, multi-line data); chunk parsing of completion, chat,
 * usage, [DONE] and error chunks; the workload (fixed and ranged lengths,
 * shared prefix, Poisson arrivals with the requested mean rate, JSONL
 * dataset and its errors); the report's TTFT / TPOT / ITL / E2EL and
 * throughputs against hand-computed records; Prometheus text sums. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eval/bench_serve.h"
#include "test.h"

#define NEAR(a, b, tol) CHECK_MSG(fabs((double)(a) - (double)(b)) <= (tol), "%.12g vs %.12g", (double)(a), (double)(b))

typedef struct events {
    char got[8][128];
    int n;
} events;

static void collect(void *u, const char *data, size_t len) {
    events *e = u;
    CHECK(e->n < 8);
    CHECK(strlen(data) == len);
    snprintf(e->got[e->n++], sizeof(e->got[0]), "%s", data);
}

static void test_sse(void) {
    const char *stream = ": keep-alive\r\n\r\ndata: {\"a\":1}\r\n\r\ndata:{\"b\":2}\n\nevent: x\ndata: l1\ndata: l2\n\n"
                         "data: [DONE]\n\n";
    size_t n = strlen(stream);
    for (size_t cut = 0; cut <= n; cut++) { /* every split point */
        lethe_sse s;
        events e = {0};
        lethe_sse_init(&s);
        lethe_sse_feed(&s, stream, cut, collect, &e);
        lethe_sse_feed(&s, stream + cut, n - cut, collect, &e);
        CHECK_EQ_INT(e.n, 4);
        CHECK(!strcmp(e.got[0], "{\"a\":1}"));
        CHECK(!strcmp(e.got[1], "{\"b\":2}"));
        CHECK(!strcmp(e.got[2], "l1\nl2"));
        CHECK(!strcmp(e.got[3], "[DONE]"));
        lethe_sse_free(&s);
    }
    /* byte at a time, and an event without the closing blank line is not dispatched */
    lethe_sse s;
    events e = {0};
    lethe_sse_init(&s);
    const char *t = "data: x\n\ndata: y\n";
    for (size_t i = 0; t[i]; i++) lethe_sse_feed(&s, t + i, 1, collect, &e);
    CHECK_EQ_INT(e.n, 1);
    CHECK(!strcmp(e.got[0], "x"));
    lethe_sse_free(&s);
}

static void test_chunks(void) {
    lethe_bs_chunk c;
    const char *cmpl = "{\"id\":\"c1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\" hello\","
                       "\"finish_reason\":null}],\"usage\":null}";
    lethe_bs_parse_chunk(cmpl, strlen(cmpl), &c);
    CHECK(c.parsed && !c.done && !c.has_usage && !c.finished);
    CHECK_EQ_INT(c.content_bytes, 6);
    const char *role = "{\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}";
    lethe_bs_parse_chunk(role, strlen(role), &c);
    CHECK_EQ_INT(c.content_bytes, 0); /* the role-only first chat delta is not a token */
    const char *delta = "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ab\"},\"finish_reason\":\"length\"}]}";
    lethe_bs_parse_chunk(delta, strlen(delta), &c);
    CHECK_EQ_INT(c.content_bytes, 2);
    CHECK(c.finished);
    const char *usage = "{\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":7,"
                        "\"total_tokens\":19,\"prompt_tokens_details\":{\"cached_tokens\":4}}}";
    lethe_bs_parse_chunk(usage, strlen(usage), &c);
    CHECK(c.has_usage);
    CHECK_EQ_INT(c.prompt_tokens, 12);
    CHECK_EQ_INT(c.completion_tokens, 7);
    CHECK_EQ_INT(c.cached_tokens, 4);
    CHECK_EQ_INT(c.content_bytes, 0);
    lethe_bs_parse_chunk(" [DONE]", 7, &c);
    CHECK(c.done);
    const char *err = "{\"error\":{\"message\":\"prompt too long\",\"type\":\"invalid_request_error\"}}";
    lethe_bs_parse_chunk(err, strlen(err), &c);
    CHECK(!strcmp(c.error, "prompt too long"));
    lethe_bs_parse_chunk("not json", 8, &c);
    CHECK(!c.parsed && !c.done);
}

static int count_words(const char *s) {
    int n = 0;
    for (const char *p = s; *p;) {
        while (*p == ' ') p++;
        if (!*p) break;
        n++;
        while (*p && *p != ' ') p++;
    }
    return n;
}

static void test_workload(void) {
    lethe_bs_workload_params p = {.num_prompts = 200, .input_len = 100, .output_len = 20,
                                  .range_ratio = 0, .shared_prefix_len = 30, .request_rate = INFINITY,
                                  .seed = 1};
    lethe_bs_item *it;
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_OK);
    for (int i = 0; i < 200; i++) {
        CHECK_EQ_INT(it[i].input_len, 100);
        CHECK_EQ_INT(it[i].output_len, 20);
        CHECK_EQ_INT(count_words(it[i].prompt), 100);
        CHECK(it[i].arrival_s == 0.0);
        /* shared prefix: the first 30 words are the same in every prompt */
        const char *a = it[0].prompt, *b = it[i].prompt;
        int w = 0;
        size_t k = 0;
        while (w < 30) {
            CHECK(a[k] == b[k]);
            if (a[k] == ' ') w++;
            k++;
        }
    }
    CHECK(strcmp(it[0].prompt, it[1].prompt) != 0); /* the rest differs */
    lethe_bs_workload_free(it, 200);

    /* range ratio: lengths within [L(1-r), L(1+r)], both ends reached; Poisson mean gap 1/rate */
    p = (lethe_bs_workload_params){.num_prompts = 4000, .input_len = 100, .output_len = 50,
                                   .range_ratio = 0.5f, .request_rate = 8.0, .seed = 2};
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_OK);
    int mn = 1 << 30, mx = 0;
    double prev = 0, sum_gap = 0;
    for (int i = 0; i < 4000; i++) {
        mn = it[i].input_len < mn ? it[i].input_len : mn;
        mx = it[i].input_len > mx ? it[i].input_len : mx;
        CHECK(it[i].output_len >= 25 && it[i].output_len <= 75);
        CHECK(it[i].arrival_s >= prev);
        if (i > 0) sum_gap += it[i].arrival_s - prev;
        prev = it[i].arrival_s;
    }
    CHECK_EQ_INT(mn, 50);
    CHECK_EQ_INT(mx, 150);
    NEAR(sum_gap / 3999, 1.0 / 8.0, 0.01); /* sd of the mean ~ 0.125/63 = 0.002 */
    lethe_bs_item *it2;
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it2), LETHE_OK); /* same seed, same workload */
    CHECK(!strcmp(it[17].prompt, it2[17].prompt));
    CHECK(it[17].arrival_s == it2[17].arrival_s);
    lethe_bs_workload_free(it, 4000);
    lethe_bs_workload_free(it2, 4000);

    p.shared_prefix_len = 500;
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_ERR_INVALID);
    p.shared_prefix_len = 0;
    p.range_ratio = 1.5f;
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_ERR_INVALID);
}

static void test_dataset(void) {
    char path[64];
    snprintf(path, sizeof(path), "/tmp/lethe_test_bench_serve_%d.jsonl", (int)getpid());
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs("{\"prompt\": \"hello there\", \"output_len\": 5}\n\n"
          "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", f);
    fclose(f);
    lethe_bs_workload_params p = {.num_prompts = 3, .output_len = 9, .request_rate = INFINITY,
                                  .dataset = path};
    lethe_bs_item *it;
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_OK);
    CHECK(!strcmp(it[0].prompt, "hello there"));
    CHECK_EQ_INT(it[0].output_len, 5);
    CHECK(it[0].messages_json == NULL);
    CHECK_STR_CONTAINS(it[1].messages_json, "\"content\":\"hi\"");
    CHECK_EQ_INT(it[1].output_len, 9);
    CHECK(!strcmp(it[2].prompt, "hello there")); /* cycles */
    lethe_bs_workload_free(it, 3);
    f = fopen(path, "w");
    fputs("{\"prompt\": \"ok\"}\n{\"nothing\": 1}\n", f);
    fclose(f);
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "jsonl:2:");
    p.dataset = "/nonexistent/no-such-file.jsonl";
    CHECK_EQ_INT(lethe_bs_workload_make(&p, &it), LETHE_ERR_IO);
    remove(path);
}

static double jnum(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    CHECK_MSG(cJSON_IsNumber(v), "%s missing", k);
    return v->valuedouble;
}

static void test_report(void) {
    /* two good requests and one failure, 10 s benchmark:
     *  r0: start 0, first 0.5, end 1.5, 11 tokens, ITL 0.1 x 10 -> TPOT 0.1
     *  r1: start 1, first 1.3, end 1.7, 5 tokens, ITL 0.1 x 4   -> TPOT 0.1
     * TTFT {0.5, 0.3}: mean 0.4, median 0.4, p99 = 0.3 + 0.99 * 0.2 = 0.498 */
    double itl0[10], itl1[4];
    for (int i = 0; i < 10; i++) itl0[i] = 0.1;
    for (int i = 0; i < 4; i++) itl1[i] = 0.1;
    lethe_bs_record r[3] = {
        {.ok = true, .t_start = 0, .t_first = 0.5, .t_end = 1.5, .itl = itl0, .n_itl = 10, .n_chunks = 11,
         .prompt_tokens = 100, .output_tokens = 11, .cached_tokens = 0},
        {.ok = true, .t_start = 1, .t_first = 1.3, .t_end = 1.7, .itl = itl1, .n_itl = 4, .n_chunks = 5,
         .prompt_tokens = 50, .output_tokens = 5, .cached_tokens = 32},
        {.ok = false, .t_start = 2, .t_first = -1, .t_end = 2.1, .prompt_tokens = -1, .output_tokens = 0},
    };
    double pcts[2] = {50, 99};
    cJSON *o = cJSON_CreateObject();
    lethe_bs_report(o, r, 3, 10.0, pcts, 2);
    NEAR(jnum(o, "completed"), 2, 0);
    NEAR(jnum(o, "failed"), 1, 0);
    NEAR(jnum(o, "total_input_tokens"), 150, 0);
    NEAR(jnum(o, "total_output_tokens"), 16, 0);
    NEAR(jnum(o, "total_cached_tokens"), 32, 0);
    NEAR(jnum(o, "request_throughput"), 0.2, 1e-12);
    NEAR(jnum(o, "output_throughput"), 1.6, 1e-12);
    NEAR(jnum(o, "total_token_throughput"), 16.6, 1e-12);
    NEAR(jnum(o, "mean_ttft_ms"), 400, 1e-9);
    NEAR(jnum(o, "median_ttft_ms"), 400, 1e-9);
    NEAR(jnum(o, "p99_ttft_ms"), 498, 1e-9);
    NEAR(jnum(o, "p50_ttft_ms"), 400, 1e-9);
    NEAR(jnum(o, "std_ttft_ms"), 100, 1e-9);
    NEAR(jnum(o, "mean_tpot_ms"), 100, 1e-9);
    NEAR(jnum(o, "mean_itl_ms"), 100, 1e-9);
    NEAR(jnum(o, "mean_e2el_ms"), 1100, 1e-9); /* (1.5 + 0.7) / 2 */
    NEAR(jnum(o, "p99_e2el_ms"), 700 + 0.99 * 800, 1e-9);
    cJSON_Delete(o);
    /* all failed: zeros and nulls, no crash */
    o = cJSON_CreateObject();
    lethe_bs_report(o, r + 2, 1, 1.0, pcts, 2);
    NEAR(jnum(o, "completed"), 0, 0);
    CHECK(cJSON_IsNull(cJSON_GetObjectItem(o, "mean_ttft_ms")));
    cJSON_Delete(o);
}

static void test_prom(void) {
    const char *t = "# HELP lethe:time_to_first_token_seconds TTFT\n"
                    "# TYPE lethe:time_to_first_token_seconds histogram\n"
                    "lethe:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\"} 3\n"
                    "lethe:time_to_first_token_seconds_sum{model_name=\"m\"} 1.25\n"
                    "lethe:time_to_first_token_seconds_count{model_name=\"m\"} 5\n"
                    "lethe:generation_tokens_total{model_name=\"a}b\"} 100\n"
                    "lethe:generation_tokens_total{model_name=\"c\"} 20\n"
                    "lethe:cached_prompt_tokens_total 7\n"
                    "prompt_tokens_total 40\n";
    double v;
    CHECK(lethe_bs_prom_sum(t, "time_to_first_token_seconds_sum", &v));
    NEAR(v, 1.25, 0);
    CHECK(lethe_bs_prom_sum(t, "time_to_first_token_seconds_count", &v));
    NEAR(v, 5, 0);
    CHECK(lethe_bs_prom_sum(t, "generation_tokens_total", &v));
    NEAR(v, 120, 0); /* summed over label sets, '}' inside a label value is fine */
    CHECK(lethe_bs_prom_sum(t, "prompt_tokens_total", &v));
    NEAR(v, 40, 0); /* not lethe:cached_prompt_tokens_total */
    CHECK(!lethe_bs_prom_sum(t, "e2e_request_latency_seconds_sum", &v));
}

int main(void) {
    TEST_RUN(test_sse);
    TEST_RUN(test_chunks);
    TEST_RUN(test_workload);
    TEST_RUN(test_dataset);
    TEST_RUN(test_report);
    TEST_RUN(test_prom);
    return 0;
}

/* test_chain_api.c - chain results on the HTTP surface (src/server/chain_api.c):
 * the engine returns a lethe_chain_code and the server alone maps it onto an
 * HTTP status and a code string; every chain refusal's error body carries
 * the chain code string, chain fields sent to a server without the Chain
 * Cache included (chain_mode_disabled); other request errors keep the status
 * number as their code. Engines on the fake model, no HTTP. */
#include <cjson/cJSON.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "server/chain_api.h"
#include "server/conn.h"
#include "test.h"

static lethe_engine *mk(const char *mode) {
    lethe_fake_params fp;
    lethe_fake_default_params(&fp);
    fp.n_layers = 2;
    fp.n_vocab = 50;
    fp.max_pos = 256;
    lethe_runner runner;
    CHECK(lethe_runner_fake(&fp, &runner) == LETHE_OK);
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "fake";
    p.max_num_batched_tokens = 64;
    p.max_num_seqs = 4;
    p.prefix_cache_mode = mode;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create_with(&p, &runner, NULL, &e) == 0, "%s", lethe_engine_last_error());
    return e;
}

/* the "error" object of a body; the caller deletes *root */
static const cJSON *error_of(const char *body, cJSON **root) {
    *root = cJSON_Parse(body);
    CHECK(*root != NULL);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(*root, "error");
    CHECK(cJSON_IsObject(e));
    return e;
}

static void test_mapping(void) {
    static const struct { lethe_chain_code c; int status; const char *name; } table[] = {
        {LETHE_CHAIN_OK, 200, "ok"},
        {LETHE_CHAIN_NOT_FOUND, 404, "chain_not_found"},
        {LETHE_CHAIN_BUSY, 409, "chain_busy"},
        {LETHE_CHAIN_PREFIX_MISMATCH, 409, "chain_prefix_mismatch"},
        {LETHE_CHAIN_FINGERPRINT_MISMATCH, 409, "chain_fingerprint_mismatch"},
        {LETHE_CHAIN_GONE, 410, "chain_gone"},
        {LETHE_CHAIN_CAPACITY, 503, "chain_capacity_unavailable"},
        {LETHE_CHAIN_BAD_REQUEST, 400, "chain_invalid_request"},
        {LETHE_CHAIN_MODE_DISABLED, 400, "chain_mode_disabled"},
        {LETHE_CHAIN_INVALID_REQUEST, 400, "invalid_request"},
        {LETHE_CHAIN_QUEUE_FULL, 503, "queue_full"},
        {LETHE_CHAIN_ENGINE_BUSY, 500, "engine_busy"},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        CHECK_EQ_INT(srv_chain_http_status(table[i].c), table[i].status);
        CHECK(!strcmp(srv_chain_code_name(table[i].c), table[i].name));
    }
}

static srv_api api_of(lethe_engine *e) {
    return (srv_api){.engine = e, .served_name = "fake", .model_path = "fake", .max_model_len = 256};
}

static void test_mode_disabled_body(void) {
    lethe_engine *e = mk("auto"); /* dense: the radix cache */
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "radix"));
    srv_api api = api_of(e);
    const char *bodies[] = {
        "{\"prompt\": [5, 6, 7], \"chain_id\": \"chain_abc\"}",
        "{\"prompt\": [5, 6, 7], \"chain_id\": null}",
        "{\"prompt\": [5, 6, 7], \"chain_append_start\": 1}",
    };
    for (size_t i = 0; i < sizeof(bodies) / sizeof(bodies[0]); i++) {
        srv_gen g;
        srv_error err = {0};
        CHECK(srv_parse_request(&api, SRV_COMPLETION, bodies[i], strlen(bodies[i]), NULL, &g,
                                &err) != 0);
        CHECK_EQ_INT(err.status, 400);
        char *s = srv_error_json(&err);
        cJSON *root;
        const cJSON *o = error_of(s, &root);
        const cJSON *code = cJSON_GetObjectItemCaseSensitive(o, "code");
        CHECK_MSG(cJSON_IsString(code) && !strcmp(code->valuestring, "chain_mode_disabled"), "%s", s);
        CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(o, "param")->valuestring, "chain_id"));
        CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(o, "type")->valuestring, "BadRequestError"));
        cJSON_Delete(root);
        free(s);
    }
    /* any other bad field: the code stays the HTTP status number */
    const char *bad = "{\"prompt\": [5, 6, 7], \"temperature\": \"hot\"}";
    srv_gen g;
    srv_error err = {0};
    CHECK(srv_parse_request(&api, SRV_COMPLETION, bad, strlen(bad), NULL, &g, &err) != 0);
    char *s = srv_error_json(&err);
    cJSON *root;
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(error_of(s, &root), "code");
    CHECK(cJSON_IsNumber(code) && code->valuedouble == 400);
    cJSON_Delete(root);
    free(s);
    lethe_engine_destroy(e);
}

/* a refusal by the chain cache: the status and code string of its code */
static void test_refusal_body(void) {
    lethe_engine *e = mk("chain");
    srv_api api = api_of(e);
    const char *body = "{\"prompt\": [5, 6, 7], \"max_tokens\": 2, \"chain_id\": \"chain_nope\"}";
    srv_gen g;
    srv_error err = {0};
    CHECK_MSG(srv_parse_request(&api, SRV_COMPLETION, body, strlen(body), NULL, &g, &err) == 0,
              "%s", err.message);
    CHECK(g.chain && !strcmp(g.chain_id, "chain_nope"));
    CHECK_EQ_INT(srv_chain_refusal_status(&g), 0); /* nothing refused yet */
    lethe_request_params p = {.prompt = g.prompt, .n_prompt = g.n_prompt, .sampling = g.sp};
    uint64_t id = 0;
    CHECK(srv_chain_submit(&api, &p, &g, &id) == LETHE_ERR_NOT_FOUND);
    CHECK_EQ_INT(g.chain_res.code, LETHE_CHAIN_NOT_FOUND);
    CHECK_EQ_INT(srv_chain_refusal_status(&g), 404);
    char *s = srv_chain_error_json(&g);
    cJSON *root;
    const cJSON *o = error_of(s, &root);
    CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(o, "code")->valuestring, "chain_not_found"));
    CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(o, "type")->valuestring, "NotFoundError"));
    CHECK_STR_CONTAINS(cJSON_GetObjectItemCaseSensitive(o, "message")->valuestring, "unknown chain_id");
    CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(root, "chain_id")->valuestring, "chain_nope"));
    cJSON_Delete(root);
    free(s);
    srv_gen_free(&g);
    lethe_engine_destroy(e);
}

static int parse(srv_api *api, const char *body, const srv_chain_headers *h, srv_gen *g,
                 srv_error *err) {
    memset(err, 0, sizeof(*err));
    return srv_parse_request(api, SRV_COMPLETION, body, strlen(body), h, g, err);
}

/* The chain headers a load balancer routes by (X-Lethe-Chain-Id,
 * X-Lethe-New-Chain-Id), the response headers, and --replica's 410. */
static void test_chain_headers(void) {
    lethe_engine *e = mk("chain");
    srv_api api = api_of(e);
    const char *named = "chain_0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9";
    srv_gen g;
    srv_error err;
    char hdr[SRV_RESPONSE_HEADERS_CAP];
    /* a new chain takes the balancer's id; the response names it */
    srv_chain_headers h = {.new_chain_id = named};
    CHECK_MSG(parse(&api, "{\"prompt\": [5, 6, 7], \"max_tokens\": 2}", &h, &g, &err) == 0, "%s",
              err.message);
    lethe_request_params p = {.prompt = g.prompt, .n_prompt = g.n_prompt, .sampling = g.sp};
    uint64_t id = 0;
    CHECK_MSG(srv_chain_submit(&api, &p, &g, &id) == 0, "%s", g.chain_res.message);
    CHECK(!strcmp(g.chain_res.chain_id, named));
    srv_chain_headers_out(&g, hdr, sizeof(hdr));
    char want[160];
    snprintf(want, sizeof(want), "X-Lethe-Chain-Id: %s\r\nX-Lethe-Chain-Status: created\r\n",
             named);
    CHECK_MSG(!strcmp(hdr, want), "%s", hdr);
    srv_gen_free(&g);
    /* the same id again as a new chain: taken */
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7], \"max_tokens\": 2}", &h, &g, &err) == 0);
    p = (lethe_request_params){.prompt = g.prompt, .n_prompt = g.n_prompt, .sampling = g.sp};
    CHECK(srv_chain_submit(&api, &p, &g, &id) != 0);
    CHECK_EQ_INT(srv_chain_refusal_status(&g), 400);
    srv_gen_free(&g);
    /* a malformed new id is a 400 before anything reaches the engine */
    srv_chain_headers bad = {.new_chain_id = "no spaces allowed"};
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7]}", &bad, &g, &err) != 0);
    CHECK_EQ_INT(err.status, 400);
    CHECK(!strcmp(err.param, "X-Lethe-New-Chain-Id"));
    /* X-Lethe-Chain-Id names the chain like the body field; both: they must agree */
    srv_chain_headers r = {.chain_id = named, .new_chain_id = "chain_not-used-when-resuming"};
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7], \"max_tokens\": 2}", &r, &g, &err) == 0);
    CHECK(g.chain_id && !strcmp(g.chain_id, named));
    srv_gen_free(&g);
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7], \"chain_id\": \"chain_other-one\"}", &r, &g, &err) !=
          0);
    CHECK_EQ_INT(err.status, 400);
    CHECK_STR_CONTAINS(err.message, "differ");
    srv_chain_headers crlf = {.chain_id = "chain_x\r\nSet-Cookie: a=b"};
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7]}", &crlf, &g, &err) != 0);
    CHECK(!strcmp(err.param, "X-Lethe-Chain-Id"));
    /* unknown id: 404 alone, 410 chain_gone as a --replica (the chain lived elsewhere) */
    srv_chain_headers u = {.chain_id = "chain_held-by-another-replica"};
    for (int replica = 0; replica < 2; replica++) {
        api.replica = replica;
        CHECK(parse(&api, "{\"prompt\": [5, 6, 7], \"max_tokens\": 2}", &u, &g, &err) == 0);
        p = (lethe_request_params){.prompt = g.prompt, .n_prompt = g.n_prompt, .sampling = g.sp};
        CHECK(srv_chain_submit(&api, &p, &g, &id) == LETHE_ERR_NOT_FOUND);
        CHECK_EQ_INT(srv_chain_refusal_status(&g), replica ? 410 : 404);
        if (replica) CHECK_STR_CONTAINS(g.chain_res.message, "not on this replica");
        srv_chain_headers_out(&g, hdr, sizeof(hdr));
        CHECK_MSG(!strcmp(hdr, "X-Lethe-Chain-Id: chain_held-by-another-replica\r\n"), "%s", hdr);
        srv_gen_free(&g);
    }
    /* a refused body id that is no valid id is never echoed into a header */
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7], \"max_tokens\": 2, \"chain_id\": \"a b\"}", NULL, &g,
                &err) == 0);
    p = (lethe_request_params){.prompt = g.prompt, .n_prompt = g.n_prompt, .sampling = g.sp};
    CHECK(srv_chain_submit(&api, &p, &g, &id) != 0);
    srv_chain_headers_out(&g, hdr, sizeof(hdr));
    CHECK_EQ_INT(strlen(hdr), 0);
    srv_gen_free(&g);
    lethe_engine_destroy(e);
    /* outside chain mode the balancer's new id is ignored, a chain id is chain_mode_disabled */
    e = mk("auto");
    api = api_of(e);
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7]}", &h, &g, &err) == 0);
    CHECK(!g.chain);
    srv_chain_headers_out(&g, hdr, sizeof(hdr));
    CHECK_EQ_INT(strlen(hdr), 0);
    srv_gen_free(&g);
    CHECK(parse(&api, "{\"prompt\": [5, 6, 7]}", &r, &g, &err) != 0);
    CHECK(!strcmp(err.code, "chain_mode_disabled"));
    lethe_engine_destroy(e);
}

int main(void) {
    test_mapping();
    test_mode_disabled_body();
    test_refusal_body();
    test_chain_headers();
    printf("test_chain_api: ok\n");
    return 0;
}

/* test_outparse.c - the output parser of chat responses (server/outparse.c):
 * reasoning and tool calls split from generated text, for each format.
 *
 * Every case is parsed whole and also fed in pieces of 1, 2, 3, 5 and 7
 * bytes (markers and JSON split everywhere, as token texts split them):
 * the message folded from the deltas must equal the whole parse, and both
 * the expected reasoning / content / calls (names and arguments). A call's
 * streamed arguments must arrive before the call ends (no buffering of
 * head-ordered calls). */
#include <string.h>

#include "core/util.h"
#include "server/agent.h"
#include "test.h"

typedef struct ocase {
    const char *name;
    srv_tool_fmt fmt;
    bool reasoning;
    const char *text;
    const char *want_reasoning, *want_content;
    int n_calls;
    const char *names[3], *args[3];
} ocase;

static const ocase CASES[] = {
    {"plain", SRV_TF_NONE, false, "Hello\n <tool_call>x", "", "Hello\n <tool_call>x", 0, {0}, {0}},
    {"hermes one", SRV_TF_HERMES, false,
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par\\\"is}\", \"n\": [1, {\"a\": 2}]}}\n</tool_call>",
     "", "", 1, {"get_weather"}, {"{\"city\": \"Par\\\"is}\", \"n\": [1, {\"a\": 2}]}"}},
    {"hermes text and two", SRV_TF_HERMES, false,
     "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
     "{\"name\":\"b\",\"arguments\":{\"x\":1}}\n</tool_call>\n",
     "", "Let me check.", 2, {"a", "b"}, {"{}", "{\"x\":1}"}},
    {"hermes arguments first", SRV_TF_HERMES, false,
     "<tool_call>\n{\"arguments\": {\"z\": 9}, \"name\": \"t\"}\n</tool_call>", "", "", 1, {"t"}, {"{\"z\":9}"}},
    {"hermes not a call", SRV_TF_HERMES, false, "a <tool_call>not json</tool_call> b", "",
     "a <tool_call>not json</tool_call> b", 0, {0}, {0}},
    {"hermes cut head", SRV_TF_HERMES, false, "x <tool_call>\n{\"na", "", "x <tool_call>\n{\"na", 0, {0}, {0}},
    {"hermes scalar args", SRV_TF_HERMES, false, "<tool_call>{\"name\": \"s\", \"arguments\": 42}</tool_call>", "",
     "", 1, {"s"}, {"42"}},
    {"reasoning and call", SRV_TF_HERMES, true,
     "<think>\n\nstep 1\nstep 2\n\n</think>\n\nOK.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"</think>\"}}\n</tool_call>",
     "step 1\nstep 2", "OK.", 1, {"f"}, {"{\"q\": \"</think>\"}"}},
    {"reasoning cut off", SRV_TF_NONE, true, "<think>\nstill thinking\n", "still thinking", "", 0, {0}, {0}},
    {"no think block", SRV_TF_NONE, true, "<thin", "", "<thin", 0, {0}, {0}},
    {"llama call", SRV_TF_LLAMA, false, "  {\"name\": \"get_time\", \"parameters\": {\"zone\": -3}}", "", "", 1,
     {"get_time"}, {"{\"zone\": -3}"}},
    {"llama two calls", SRV_TF_LLAMA, false,
     "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"k\": \"v\"}}; {\"name\": \"b\", \"parameters\": {}}", "", "",
     2, {"a", "b"}, {"{\"k\": \"v\"}", "{}"}},
    {"llama text", SRV_TF_LLAMA, false, "It is {sunny}.", "", "It is {sunny}.", 0, {0}, {0}},
    {"glm", SRV_TF_GLM, false,
     "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>",
     "", "Sure.", 1, {"get_weather"}, {"{\"city\": \"Paris\", \"days\": 3}"}},
};

static void check_message(const ocase *c, const srv_message *m, const char *how) {
    CHECK_MSG(!strcmp(m->reasoning, c->want_reasoning), "%s (%s): reasoning '%s'", c->name, how, m->reasoning);
    CHECK_MSG(!strcmp(m->content, c->want_content), "%s (%s): content '%s'", c->name, how, m->content);
    const int n = m->tool_calls ? cJSON_GetArraySize(m->tool_calls) : 0;
    CHECK_MSG(n == c->n_calls, "%s (%s): %d calls", c->name, how, n);
    for (int i = 0; i < n; i++) {
        const cJSON *call = cJSON_GetArrayItem(m->tool_calls, i);
        const cJSON *fn = cJSON_GetObjectItem(call, "function");
        CHECK(!strncmp(cJSON_GetObjectItem(call, "id")->valuestring, "call_", 5));
        CHECK(!strcmp(cJSON_GetObjectItem(call, "type")->valuestring, "function"));
        CHECK_MSG(!strcmp(cJSON_GetObjectItem(fn, "name")->valuestring, c->names[i]), "%s (%s): call %d name",
                  c->name, how, i);
        const char *args = cJSON_GetObjectItem(fn, "arguments")->valuestring;
        CHECK_MSG(!strcmp(args, c->args[i]), "%s (%s): call %d arguments '%s'", c->name, how, i, args);
    }
}

static void test_cases(void) {
    int n_runs = 0;
    for (size_t k = 0; k < LETHE_ARRAY_LEN(CASES); k++) {
        const ocase *c = &CASES[k];
        srv_message whole;
        srv_parse_output(c->fmt, c->reasoning, c->text, &whole);
        check_message(c, &whole, "whole");
        static const size_t pieces[] = {1, 2, 3, 5, 7};
        for (size_t pi = 0; pi < LETHE_ARRAY_LEN(pieces); pi++) {
            srv_outparse *p = srv_outparse_new(c->fmt, c->reasoning);
            srv_message m = {0};
            const size_t len = strlen(c->text);
            bool args_early = false;
            for (size_t off = 0; off < len; off += pieces[pi]) {
                srv_delta d = {0};
                srv_outparse_push(p, c->text + off, LETHE_MIN(pieces[pi], len - off), &d);
                for (int i = 0; i < d.n_calls; i++) args_early |= d.calls[i].args[0] && off + pieces[pi] < len;
                srv_message_add_delta(&m, &d);
                srv_delta_free(&d);
            }
            srv_delta d = {0};
            srv_outparse_finish(p, &d);
            srv_message_add_delta(&m, &d);
            srv_delta_free(&d);
            char how[32];
            snprintf(how, sizeof(how), "pieces of %zu", pieces[pi]);
            check_message(c, &m, how);
            if (c->n_calls && c->fmt != SRV_TF_GLM && strncmp(c->name, "hermes arguments", 16) &&
                pieces[pi] == 1)
                CHECK_MSG(args_early, "%s: arguments were not streamed before the end", c->name);
            CHECK_EQ_INT(srv_outparse_n_calls(p), c->n_calls);
            srv_message_free(&m);
            srv_outparse_free(p);
            n_runs++;
        }
        srv_message_free(&whole);
    }
    fprintf(stderr, "    %zu outputs, %d split feeds equal to the whole parse\n", LETHE_ARRAY_LEN(CASES), n_runs);
}

static void test_memo(void) {
    cJSON *calls = cJSON_Parse("[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]");
    srv_memo_put("chain_a", "", calls, "why");
    char *r = srv_memo_get("chain_a", "", calls);
    CHECK(r && !strcmp(r, "why"));
    free(r);
    CHECK(srv_memo_get("chain_b", "", calls) == NULL); /* only the same chain finds it */
    CHECK(srv_memo_get("chain_a", "", NULL) == NULL);  /* other visible turn */
    srv_memo_put("chain_a", "", calls, "again");        /* one entry per key */
    r = srv_memo_get("chain_a", "", calls);
    CHECK(r && !strcmp(r, "again"));
    free(r);
    srv_memo_put("chain_a", "text", NULL, "");           /* nothing to remember */
    CHECK(srv_memo_get("chain_a", "text", NULL) == NULL);
    cJSON_Delete(calls);
}

int main(void) {
    TEST_RUN(test_cases);
    TEST_RUN(test_memo);
    fprintf(stderr, "test_outparse: all passed\n");
    return 0;
}

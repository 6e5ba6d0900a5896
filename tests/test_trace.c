/* test_trace.c - agent traces: generator shape (turn counts, sizes, waits,
 * context bound, determinism), JSONL save/load round trip, explicit-message
 * turns, validation errors naming file:line, deterministic materialization. */
#include "bench/trace.h"

#include <string.h>
#include <unistd.h>

#include "core/util.h"
#include "test.h"

static void test_generate(void) {
    lethe_trace_gen_params p;
    lethe_trace_gen_default(&p);
    p.n_agents = 5;
    p.seed = 7;
    lethe_trace t;
    CHECK(lethe_trace_generate(&p, &t) == LETHE_OK);
    CHECK_EQ_INT(t.n_agents, 5);
    for (int32_t a = 0; a < t.n_agents; a++) {
        int32_t n = t.agent_first[a + 1] - t.agent_first[a];
        CHECK(n >= 20 && n <= 60);
        for (int32_t i = t.agent_first[a]; i < t.agent_first[a + 1]; i++) {
            const lethe_trace_turn *u = &t.turns[i];
            CHECK_EQ_INT(u->agent, a);
            CHECK_EQ_INT(u->turn, i - t.agent_first[a]);
            if (u->turn == 0) {
                CHECK_EQ_INT(u->system_tokens, 300);
                CHECK_EQ_INT(u->append_tokens, 200);
            } else {
                CHECK_EQ_INT(u->system_tokens, 0);
                CHECK(u->append_tokens >= 200 && u->append_tokens <= 2000);
            }
            CHECK(u->output_tokens >= 20 && u->output_tokens <= 120);
            CHECK(u->wait_s >= 0 && u->wait_s < 2.0);
        }
    }
    /* deterministic */
    lethe_trace t2;
    CHECK(lethe_trace_generate(&p, &t2) == LETHE_OK);
    CHECK_EQ_INT(t2.n_turns, t.n_turns);
    for (int32_t i = 0; i < t.n_turns; i++) {
        CHECK_EQ_INT(t2.turns[i].append_tokens, t.turns[i].append_tokens);
        CHECK(t2.turns[i].wait_s == t.turns[i].wait_s);
    }
    lethe_trace_free(&t2);
    /* context bound: every agent stays within max_context */
    p.max_context = 6000;
    CHECK(lethe_trace_generate(&p, &t2) == LETHE_OK);
    for (int32_t a = 0; a < t2.n_agents; a++) {
        int32_t last = t2.agent_first[a + 1] - t2.agent_first[a] - 1;
        CHECK(last >= 0);
        CHECK(lethe_trace_context_after(&t2, a, last) <= 6000);
    }
    /* agent 0 draws the same sizes as in the unbounded trace: it was cut
     * exactly where its next turn would have crossed the bound */
    int32_t last0 = t2.agent_first[1] - 1;
    CHECK(last0 + 1 < t.agent_first[1]);
    CHECK(lethe_trace_context_after(&t, 0, last0) <= 6000);
    CHECK(lethe_trace_context_after(&t, 0, last0 + 1) > 6000);
    lethe_trace_free(&t2);
    /* save / load round trip */
    char path[] = "/tmp/lethe_trace_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK(lethe_trace_save(&t, path) == LETHE_OK);
    CHECK(lethe_trace_load(path, &t2) == LETHE_OK);
    CHECK_EQ_INT(t2.n_turns, t.n_turns);
    CHECK_EQ_INT(t2.n_agents, t.n_agents);
    for (int32_t i = 0; i < t.n_turns; i++) {
        CHECK_EQ_INT(t2.turns[i].agent, t.turns[i].agent);
        CHECK_EQ_INT(t2.turns[i].turn, t.turns[i].turn);
        CHECK_EQ_INT(t2.turns[i].append_tokens, t.turns[i].append_tokens);
        CHECK_EQ_INT(t2.turns[i].system_tokens, t.turns[i].system_tokens);
        CHECK_EQ_INT(t2.turns[i].output_tokens, t.turns[i].output_tokens);
        CHECK(fabs(t2.turns[i].wait_s - t.turns[i].wait_s) < 1e-9);
    }
    remove(path);
    lethe_trace_free(&t2);
    lethe_trace_free(&t);
    lethe_trace_gen_params bad = p;
    bad.max_turns = 3;
    bad.min_turns = 5;
    CHECK(lethe_trace_generate(&bad, &t) == LETHE_ERR_INVALID);
}

static const char *write_tmp(const char *text) {
    static char path[64];
    strcpy(path, "/tmp/lethe_trace_XXXXXX");
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void test_explicit_and_errors(void) {
    /* out of order lines, explicit messages and output text */
    const char *good =
        "{\"agent\": \"b\", \"turn\": 1, \"messages\": [{\"role\": \"user\", \"content\": \"ls output\"}], "
        "\"output\": \"done\", \"wait_s\": 0.5}\n"
        "\n"
        "{\"agent\": \"b\", \"turn\": 0, \"messages\": [{\"role\": \"system\", \"content\": \"sys\"}, "
        "{\"role\": \"user\", \"content\": \"fix it\"}], \"output_tokens\": 3}\n"
        "{\"agent\": 7, \"turn\": 0, \"append_tokens\": 4, \"output_tokens\": 2}\n";
    const char *path = write_tmp(good);
    lethe_trace t;
    CHECK_MSG(lethe_trace_load(path, &t) == LETHE_OK, "%s", lethe_last_error());
    remove(path);
    CHECK_EQ_INT(t.n_agents, 2);
    CHECK(!strcmp(t.agent_names[0], "b") && !strcmp(t.agent_names[1], "7"));
    const lethe_trace_turn *u0 = &t.turns[t.agent_first[0]];
    CHECK_EQ_INT(u0->turn, 0);
    CHECK_EQ_INT(u0->n_msgs, 2);
    int32_t n = 0;
    lethe_trace_msg *m = lethe_trace_turn_messages(&t, u0, 1, &n);
    CHECK_EQ_INT(n, 2);
    CHECK(!strcmp(m[0].role, "system") && !strcmp(m[1].content, "fix it"));
    for (int32_t i = 0; i < n; i++) lethe_trace_msg_free(&m[i]);
    free(m);
    char *o = lethe_trace_turn_output(&t, &t.turns[1], 1);
    CHECK(!strcmp(o, "done"));
    free(o);
    CHECK(t.turns[1].wait_s == 0.5);
    /* count turn materializes into a user message of 4 words, deterministic per seed */
    const lethe_trace_turn *c = &t.turns[t.agent_first[1]];
    m = lethe_trace_turn_messages(&t, c, 9, &n);
    CHECK_EQ_INT(n, 1);
    CHECK(!strcmp(m[0].role, "user"));
    int spaces = 0;
    for (const char *p = m[0].content; *p; p++) spaces += *p == ' ';
    CHECK_EQ_INT(spaces, 4);
    char *again = lethe_trace_words(9, c->agent, c->turn, 2, 4);
    CHECK(!strcmp(again, m[0].content));
    char *other = lethe_trace_words(10, c->agent, c->turn, 2, 4);
    CHECK(strcmp(other, m[0].content) != 0);
    free(again);
    free(other);
    lethe_trace_msg_free(&m[0]);
    free(m);
    lethe_trace_free(&t);

    struct { const char *text, *want; } bad[] = {
        {"{\"agent\": \"a\", \"turn\": 1, \"append_tokens\": 3, \"output_tokens\": 1}\n", "turn 1 where turn 0"},
        {"{\"turn\": 0, \"append_tokens\": 3, \"output_tokens\": 1}\n", ":1: 'agent'"},
        {"{\"agent\": \"a\", \"turn\": 0, \"output_tokens\": 1}\n", "needs 'messages' or 'append_tokens'"},
        {"{\"agent\": \"a\", \"turn\": 0, \"append_tokens\": 2}\n", "needs 'output' or 'output_tokens'"},
        {"\n{\"agent\": \"a\", \"turn\": 0, \"append_tokens\": -2, \"output_tokens\": 1}\n", ":2: 'append_tokens'"},
        {"{\"agent\": \"a\", \"turn\": 0, \"append_tokens\": 2, \"output_tokens\": 1, \"wait_s\": \"x\"}\n", "wait_s"},
        {"not json\n", ":1: not a JSON object"},
        {"", "no turns"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        path = write_tmp(bad[i].text);
        CHECK(lethe_trace_load(path, &t) != LETHE_OK);
        CHECK_STR_CONTAINS(lethe_last_error(), bad[i].want);
        remove(path);
    }
}

int main(void) {
    test_generate();
    test_explicit_and_errors();
    printf("test_trace: ok\n");
    return 0;
}

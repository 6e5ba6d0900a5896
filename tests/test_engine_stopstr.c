/* test_engine_stopstr.c - stop strings over streamed text: hold back what
 * could start a stop string, release the rest, cut at the earliest stop
 * string (not included, as vLLM), flush on other finishes. */
#include <string.h>

#include "engine/stopstr.h"
#include "test.h"

static char g_out[256];

static bool push(lethe_stopstr *s, const char *text) {
    const char *rel;
    size_t n;
    bool hit = lethe_stopstr_push(s, text, strlen(text), &rel, &n);
    CHECK_EQ_INT(strlen(rel), n);
    strcat(g_out, rel);
    return hit;
}

static void test_basic(void) {
    const char *stops[] = {"STOP", NULL};
    lethe_stopstr s;
    lethe_stopstr_init(&s, stops);
    g_out[0] = '\0';
    CHECK(!push(&s, "hel"));
    CHECK(!strcmp(g_out, "hel"));
    CHECK(!push(&s, "lo ST"));
    CHECK(!strcmp(g_out, "hello ")); /* "ST" held back */
    CHECK(push(&s, "OP and more"));
    CHECK(!strcmp(g_out, "hello "));
    lethe_stopstr_free(&s);
}

static void test_false_start(void) {
    const char *stops[] = {"STOP", NULL};
    lethe_stopstr s;
    lethe_stopstr_init(&s, stops);
    g_out[0] = '\0';
    CHECK(!push(&s, "xS"));
    CHECK(!strcmp(g_out, "x"));
    CHECK(!push(&s, "T"));
    CHECK(!strcmp(g_out, "x"));
    CHECK(!push(&s, "x"));
    CHECK(!strcmp(g_out, "xSTx")); /* not a stop string after all: released */
    CHECK(!push(&s, "STO"));
    const char *rel;
    size_t n;
    lethe_stopstr_flush(&s, &rel, &n); /* finished for another reason */
    strcat(g_out, rel);
    CHECK(!strcmp(g_out, "xSTxSTO"));
    lethe_stopstr_free(&s);
}

static void test_earliest_and_utf8(void) {
    const char *stops[] = {"b", "abc", "\xc3\xa9t\xc3\xa9", NULL};
    lethe_stopstr s;
    lethe_stopstr_init(&s, stops);
    g_out[0] = '\0';
    CHECK(push(&s, "xabcb"));
    CHECK(!strcmp(g_out, "x")); /* "abc" starts before "b" */
    lethe_stopstr_free(&s);
    lethe_stopstr_init(&s, stops);
    g_out[0] = '\0';
    CHECK(!push(&s, "l'\xc3\xa9"));
    CHECK(!strcmp(g_out, "l'"));
    CHECK(push(&s, "t\xc3\xa9 !"));
    CHECK(!strcmp(g_out, "l'"));
    lethe_stopstr_free(&s);
}

static void test_no_stops(void) {
    lethe_stopstr s;
    lethe_stopstr_init(&s, NULL);
    g_out[0] = '\0';
    CHECK(!push(&s, "anything"));
    CHECK(!strcmp(g_out, "anything"));
    lethe_stopstr_free(&s);
}

int main(void) {
    TEST_RUN(test_basic);
    TEST_RUN(test_false_start);
    TEST_RUN(test_earliest_and_utf8);
    TEST_RUN(test_no_stops);
    return 0;
}

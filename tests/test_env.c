/* test_env.c - the LETHE_* environment table (core/env.c): every row is
 * complete and its default parses; bool / whole-number / choice values parse
 * or fail naming the variable; unset and empty mean the default; the --help
 * text lists every variable with its default; an engine refuses a bad value at create. */
#include "core/env.h"

#include <stdlib.h>
#include <string.h>

#include "lethe.h"
#include "test.h"

static void test_table(void) {
    for (int i = 0; i < LETHE_ENV_N; i++) {
        const lethe_env_var *v = lethe_env_var_of((lethe_env_id)i);
        CHECK(v->name && !strncmp(v->name, "LETHE_", 6));
        CHECK(v->def && v->reader && v->reader[0] && v->help && v->help[0]);
        CHECK((v->type == LETHE_ENV_CHOICE) == (v->choices != NULL));
        for (int j = 0; j < i; j++) CHECK(strcmp(v->name, lethe_env_var_of((lethe_env_id)j)->name));
        unsetenv(v->name); /* the default parses */
        bool b;
        int64_t n;
        const char *c;
        lethe_status st = v->type == LETHE_ENV_BOOL   ? lethe_env_bool((lethe_env_id)i, &b)
                          : v->type == LETHE_ENV_UINT ? lethe_env_uint((lethe_env_id)i, &n)
                          : v->type == LETHE_ENV_PATH ? lethe_env_path((lethe_env_id)i, &c)
                                                      : lethe_env_choice((lethe_env_id)i, &c);
        CHECK_MSG(st == LETHE_OK, "%s: default '%s' does not parse", v->name, v->def);
    }
}

static void test_bool(void) {
    bool b = true;
    unsetenv("LETHE_STEP_TIMES");
    CHECK(lethe_env_bool(LETHE_ENV_STEP_TIMES, &b) == LETHE_OK && !b);
    setenv("LETHE_STEP_TIMES", "", 1); /* empty: the default */
    CHECK(lethe_env_bool(LETHE_ENV_STEP_TIMES, &b) == LETHE_OK && !b);
    const char *on[] = {"1", "true", "yes", "on"}, *off[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        setenv("LETHE_STEP_TIMES", on[i], 1);
        CHECK(lethe_env_bool(LETHE_ENV_STEP_TIMES, &b) == LETHE_OK && b);
        setenv("LETHE_STEP_TIMES", off[i], 1);
        CHECK(lethe_env_bool(LETHE_ENV_STEP_TIMES, &b) == LETHE_OK && !b);
    }
    setenv("LETHE_STEP_TIMES", "2", 1);
    CHECK(lethe_env_bool(LETHE_ENV_STEP_TIMES, &b) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "LETHE_STEP_TIMES='2'");
    unsetenv("LETHE_STEP_TIMES");
}

static void test_uint(void) {
    int64_t n = -1;
    unsetenv("LETHE_PROFILE_STEP");
    CHECK(lethe_env_uint(LETHE_ENV_PROFILE_STEP, &n) == LETHE_OK && n == 0);
    setenv("LETHE_PROFILE_STEP", "20", 1);
    CHECK(lethe_env_uint(LETHE_ENV_PROFILE_STEP, &n) == LETHE_OK && n == 20);
    const char *bad[] = {"-1", "20x", "x", " 3", "99999999999999999999"};
    for (int i = 0; i < 5; i++) {
        setenv("LETHE_PROFILE_STEP", bad[i], 1);
        CHECK_MSG(lethe_env_uint(LETHE_ENV_PROFILE_STEP, &n) == LETHE_ERR_INVALID, "'%s' parsed",
                  bad[i]);
        CHECK_STR_CONTAINS(lethe_last_error(), "LETHE_PROFILE_STEP");
    }
    unsetenv("LETHE_PROFILE_STEP");
}

static void test_choice(void) {
    const char *v = NULL;
    unsetenv("LETHE_MATMUL");
    CHECK(lethe_env_choice(LETHE_ENV_MATMUL, &v) == LETHE_OK && !strcmp(v, "auto"));
    setenv("LETHE_MATMUL", "cublas", 1);
    CHECK(lethe_env_choice(LETHE_ENV_MATMUL, &v) == LETHE_OK && !strcmp(v, "cublas"));
    const char *bad[] = {"cublasx", "cu", "auto|cublas", "AUTO"}; /* whole words only */
    for (int i = 0; i < 4; i++) {
        setenv("LETHE_MATMUL", bad[i], 1);
        CHECK_MSG(lethe_env_choice(LETHE_ENV_MATMUL, &v) == LETHE_ERR_INVALID, "'%s' parsed",
                  bad[i]);
        CHECK_STR_CONTAINS(lethe_last_error(), "expected one of auto|cublas");
    }
    unsetenv("LETHE_MATMUL");
}

static void test_help(void) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    lethe_env_print_help(f);
    fclose(f);
    for (int i = 0; i < LETHE_ENV_N; i++) {
        const lethe_env_var *v = lethe_env_var_of((lethe_env_id)i);
        char head[160];
        snprintf(head, sizeof(head), "  %s=", v->name);
        CHECK_STR_CONTAINS(buf, head);
        snprintf(head, sizeof(head), "(default %s; %s)", v->def[0] ? v->def : "off", v->reader);
        CHECK_STR_CONTAINS(buf, head);
    }
    free(buf);
}

/* A bad value stops engine create with the variable's name (not ignored). */
static void test_engine_refuses(void) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "tests/data/tiny-llama";
    p.kv_cache_bytes = 1 << 20;
    const char *vars[] = {"LETHE_STEP_TIMES", "LETHE_PROFILE_STEP", "LETHE_SAMPLE_ON_HOST"};
    for (int i = 0; i < 3; i++) {
        setenv(vars[i], "bogus", 1);
        lethe_engine *e = NULL;
        CHECK(lethe_engine_create(&p, &e) == LETHE_ERR_INVALID && !e);
        CHECK_STR_CONTAINS(lethe_engine_last_error(), vars[i]);
        unsetenv(vars[i]);
    }
    lethe_engine *e = NULL;
    CHECK(lethe_engine_create(&p, &e) == LETHE_OK && e);
    lethe_engine_destroy(e);
}

int main(void) {
    TEST_RUN(test_table);
    TEST_RUN(test_bool);
    TEST_RUN(test_uint);
    TEST_RUN(test_choice);
    TEST_RUN(test_help);
    TEST_RUN(test_engine_refuses);
    printf("test_env: ok\n");
    return 0;
}

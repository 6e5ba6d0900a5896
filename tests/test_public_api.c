/* test_public_api.c - include/lethe.h alone is enough to drive the engine and
 * to tell one refusal from another: the status codes are public. Nothing from
 * src/ is included here on purpose. */
#include <stdio.h>
#include <string.h>

#include "lethe.h"
#include "test.h"

static void test_status_codes(void) {
    CHECK_EQ_INT(LETHE_OK, 0);
    CHECK(!strcmp(lethe_status_str(LETHE_OK), "ok"));
    CHECK(!strcmp(lethe_status_str(LETHE_ERR_CAPACITY), "capacity exceeded"));
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "tests/data/no-such-model";
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK(st != LETHE_OK && !e);
    CHECK(st == LETHE_ERR_NOT_FOUND || st == LETHE_ERR_IO);
    CHECK(strlen(lethe_engine_last_error()) > 0);

    p.model = "tests/data/tiny-llama";
    p.sparse_method = "no-such-method";
    st = lethe_engine_create(&p, &e);
    CHECK_EQ_INT(st, LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "unknown method");
}

int main(void) {
    TEST_RUN(test_status_codes);
    return 0;
}

/* test_safetensors.c - the safetensors reader on files written by the
 * reference `safetensors` library (tests/gen/gen_safetensors_fixtures.py):
 * every dtype lethe converts (F32/F16/BF16), shapes incl. scalar and empty,
 * the refusal of integer tensors at conversion time, __metadata__ skipping,
 * and a sharded checkpoint opened through model.safetensors.index.json. */
#include <string.h>

#include "model/safetensors.h"
#include "test.h"

static void test_single_file(void) {
    lethe_safetensors st;
    lethe_status s = lethe_st_open_file("tests/data/st/tiny.safetensors", &st);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    CHECK_EQ_INT(st.n_tensors, 6); /* __metadata__ is not a tensor */
    CHECK(lethe_st_find(&st, "__metadata__") == NULL);
    CHECK(lethe_st_find(&st, "nope") == NULL);
    float buf[16];

    const lethe_st_tensor *a = lethe_st_find(&st, "a.f32");
    CHECK(a && !strcmp(a->dtype, "F32") && a->n_dims == 2 && a->shape[0] == 3 && a->shape[1] == 4);
    CHECK_EQ_INT(a->n_elems, 12);
    CHECK(lethe_st_to_f32(&st, a, buf) == LETHE_OK);
    for (int i = 0; i < 12; i++) CHECK(buf[i] == i * 0.5f - 1);

    const lethe_st_tensor *b = lethe_st_find(&st, "b.f16");
    CHECK(b && b->shape[0] == 2 && b->shape[1] == 8 && b->n_bytes == 32);
    CHECK(lethe_st_to_f32(&st, b, buf) == LETHE_OK);
    for (int i = 0; i < 16; i++) CHECK(buf[i] == (i - 8) * 0.125f);

    const lethe_st_tensor *c = lethe_st_find(&st, "c.bf16");
    CHECK(c && c->n_dims == 1 && c->shape[0] == 16);
    CHECK(lethe_st_to_f32(&st, c, buf) == LETHE_OK);
    for (int i = 0; i < 16; i++) CHECK(buf[i] == (i - 8) * 0.25f);

    const lethe_st_tensor *e = lethe_st_find(&st, "e.scalar");
    CHECK(e && e->n_dims == 0 && e->n_elems == 1);
    CHECK(lethe_st_to_f32(&st, e, buf) == LETHE_OK && buf[0] == 3.0f);

    const lethe_st_tensor *f = lethe_st_find(&st, "f.empty");
    CHECK(f && f->n_elems == 0 && f->n_bytes == 0);

    const lethe_st_tensor *d = lethe_st_find(&st, "d.i64");
    CHECK(d && !strcmp(d->dtype, "I64") && d->n_bytes == 32);
    CHECK(lethe_st_to_f32(&st, d, buf) == LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "tiny.safetensors: tensor 'd.i64' has dtype I64");
    lethe_st_close(&st);
    lethe_st_close(&st); /* idempotent */
}

static void test_sharded(void) {
    lethe_safetensors st;
    lethe_status s = lethe_st_open_dir("tests/data/st/sharded", &st);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    CHECK_EQ_INT(st.n_files, 2);
    CHECK_EQ_INT(st.n_tensors, 2);
    float buf[4];
    const lethe_st_tensor *x = lethe_st_find(&st, "x");
    CHECK(x && lethe_st_to_f32(&st, x, buf) == LETHE_OK);
    CHECK(buf[0] == 1 && buf[1] == 2 && buf[2] == 3 && buf[3] == 4);
    const lethe_st_tensor *y = lethe_st_find(&st, "y");
    CHECK(y && y->file != x->file && lethe_st_to_f32(&st, y, buf) == LETHE_OK);
    CHECK(buf[0] == -1 && buf[1] == 0.5f && buf[2] == 2 && buf[3] == 8);
    lethe_st_close(&st);
}

static void test_dir_without_weights(void) {
    lethe_safetensors st;
    CHECK(lethe_st_open_dir("tests/data", &st) == LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_last_error(), "tests/data: no model.safetensors");
    CHECK(lethe_st_open_file("tests/data/st/missing.safetensors", &st) == LETHE_ERR_IO);
    CHECK_STR_CONTAINS(lethe_last_error(), "missing.safetensors: cannot open");
}

int main(void) {
    TEST_RUN(test_single_file);
    TEST_RUN(test_sharded);
    TEST_RUN(test_dir_without_weights);
    return 0;
}

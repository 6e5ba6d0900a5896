/* test_dequant.c - ggml dequantization against the gguf Python reference.
 *
 * tests/data/quant/<type>.q holds raw blocks and <type>.f32 the values that
 * gguf.quants.dequantize produced for them (tests/gen/gen_quant_fixtures.py).
 * Every value must match bit for bit (NaN payloads included) or within 1e-6
 * relative. Also checks block sizes/names, the multi-threaded path on a large
 * input, Q8_1/Q8_K (no Python reference: hand-built blocks) and the errors. */
#include <ctype.h>
#include <stdint.h>
#include <string.h>

#include "core/util.h"
#include "model/gguf.h"
#include "test.h"

static void *slurp(const char *path, size_t *n) {
    char *buf;
    lethe_status s = lethe_read_file(path, &buf, n);
    CHECK_MSG(s == LETHE_OK, "%s", lethe_last_error());
    return buf;
}

/* file: fixture base name (lower case); name: ggml's spelling of the type */
static void check_type(const char *file, const char *name, lethe_ggml_type t) {
    char qp[128], fp[128];
    snprintf(qp, sizeof(qp), "tests/data/quant/%s.q", file);
    snprintf(fp, sizeof(fp), "tests/data/quant/%s.f32", file);
    size_t nq, nf;
    uint8_t *q = slurp(qp, &nq);
    float *ref = slurp(fp, &nf);
    uint64_t n = nf / 4;
    CHECK_MSG(lethe_ggml_type_size(t, n) == nq, "%s: %zu bytes for %llu values", name,
              lethe_ggml_type_size(t, n), (unsigned long long)n);
    CHECK(!strcmp(lethe_ggml_type_name(t), name));
    float *out = malloc(n * sizeof(float));
    CHECK(lethe_ggml_dequantize(t, q, out, n) == LETHE_OK);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t a, b;
        memcpy(&a, &out[i], 4);
        memcpy(&b, &ref[i], 4);
        if (a == b) continue;
        float d = fabsf(out[i] - ref[i]);
        CHECK_MSG(d <= 1e-6f * fmaxf(1.0f, fabsf(ref[i])), "%s: element %llu: %.9g vs %.9g", name,
                  (unsigned long long)i, (double)out[i], (double)ref[i]);
    }
    free(out);
    free(q);
    free(ref);
}

static void test_reference_fixtures(void) {
    static const struct { const char *name; lethe_ggml_type t; } types[] = {
        {"f32", LETHE_GGML_F32},   {"f16", LETHE_GGML_F16},   {"bf16", LETHE_GGML_BF16},
        {"q4_0", LETHE_GGML_Q4_0}, {"q4_1", LETHE_GGML_Q4_1}, {"q5_0", LETHE_GGML_Q5_0},
        {"q5_1", LETHE_GGML_Q5_1}, {"q8_0", LETHE_GGML_Q8_0}, {"q2_K", LETHE_GGML_Q2_K},
        {"q3_K", LETHE_GGML_Q3_K}, {"q4_K", LETHE_GGML_Q4_K}, {"q5_K", LETHE_GGML_Q5_K},
        {"q6_K", LETHE_GGML_Q6_K},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(types); i++) {
        char file[16];
        size_t j = 0;
        for (; types[i].name[j]; j++) file[j] = (char)tolower((unsigned char)types[i].name[j]); /* q4_K -> q4_k */
        file[j] = '\0';
        fprintf(stderr, "    %s\n", types[i].name);
        check_type(file, types[i].name, types[i].t);
    }
}

/* Q8_1 (f16 d, f16 s, i8 qs[32]) and Q8_K (f32 d, i8 qs[256], i16 bsums[16]): x = d * q */
static void test_q8_1_q8_k(void) {
    uint8_t b1[36];
    uint16_t half = 0x3800; /* 0.5 */
    memcpy(b1, &half, 2);
    memset(b1 + 2, 0x55, 2); /* s: ignored */
    for (int i = 0; i < 32; i++) b1[4 + i] = (uint8_t)(int8_t)(i - 16);
    float y[256];
    CHECK(lethe_ggml_dequantize(LETHE_GGML_Q8_1, b1, y, 32) == LETHE_OK);
    for (int i = 0; i < 32; i++) CHECK(y[i] == 0.5f * (float)(i - 16));

    uint8_t bk[292];
    float d = -0.25f;
    memcpy(bk, &d, 4);
    for (int i = 0; i < 256; i++) bk[4 + i] = (uint8_t)(int8_t)(i - 128);
    memset(bk + 260, 0x77, 32);
    CHECK(lethe_ggml_dequantize(LETHE_GGML_Q8_K, bk, y, 256) == LETHE_OK);
    for (int i = 0; i < 256; i++) CHECK(y[i] == -0.25f * (float)(i - 128));
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_Q8_1, 64), 72);
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_Q8_K, 512), 584);
}

/* Large inputs take the OpenMP path: must equal the block-by-block result. */
static void test_parallel_matches(void) {
    size_t nq, nf;
    uint8_t *q = slurp("tests/data/quant/q4_k.q", &nq);
    float *ref = slurp("tests/data/quant/q4_k.f32", &nf);
    const int reps = 128; /* 128 x 1024 = 131072 values */
    uint8_t *big = malloc(nq * reps);
    for (int r = 0; r < reps; r++) memcpy(big + r * nq, q, nq);
    uint64_t n = (nf / 4) * reps;
    float *out = malloc(n * sizeof(float));
    CHECK(lethe_ggml_dequantize(LETHE_GGML_Q4_K, big, out, n) == LETHE_OK);
    for (int r = 0; r < reps; r++) CHECK(!memcmp(out + r * (nf / 4), ref, nf));
    /* f16 path */
    uint16_t *h = malloc(n * 2);
    for (uint64_t i = 0; i < n; i++) h[i] = (uint16_t)(i * 2654435761u >> 16) & 0x7bff;
    CHECK(lethe_ggml_dequantize(LETHE_GGML_F16, h, out, n) == LETHE_OK);
    float one;
    CHECK(lethe_ggml_dequantize(LETHE_GGML_F16, &h[n - 1], &one, 1) == LETHE_OK);
    CHECK(one == out[n - 1]);
    free(h);
    free(out);
    free(big);
    free(q);
    free(ref);
}

static void test_sizes_and_errors(void) {
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_F32, 7), 28);
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_BF16, 7), 14);
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_Q4_0, 64), 36);
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_Q6_K, 256), 210);
    CHECK_EQ_INT(lethe_ggml_type_size(LETHE_GGML_Q4_0, 48), 0); /* not a block multiple */
    CHECK_EQ_INT(lethe_ggml_type_size((lethe_ggml_type)4, 32), 0); /* removed Q4_2 */
    CHECK_EQ_INT(lethe_ggml_type_size((lethe_ggml_type)99, 32), 0);
    CHECK(!strcmp(lethe_ggml_type_name((lethe_ggml_type)99), "unknown"));
    float y[64];
    uint8_t b[64] = {0};
    CHECK(lethe_ggml_dequantize((lethe_ggml_type)99, b, y, 32) == LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "unknown ggml type id 99");
    CHECK(lethe_ggml_dequantize(LETHE_GGML_Q8_0, b, y, 40) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "40 elements is not a multiple of the q8_0 block size 32");
}

int main(void) {
    TEST_RUN(test_reference_fixtures);
    TEST_RUN(test_q8_1_q8_k);
    TEST_RUN(test_parallel_matches);
    TEST_RUN(test_sizes_and_errors);
    return 0;
}

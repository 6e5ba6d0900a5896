/* test_kv_codec.c - KIVI and FP8 E4M3 quantizers (src/backend/kv_codec.c):
 * error bounds from methods.md §15/§17, exact constant groups, packing, the
 * full E4M3 code table, saturation, zero vectors. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "backend/kv_codec.h"
#include "core/util.h"
#include "test.h"

static uint64_t rng = 777;
static float frand(void) { return (float)((lethe_splitmix64(&rng) >> 40) * 0x1p-24) * 2.0f - 1.0f; }

static void test_pack(void) {
    uint8_t c[8] = {0};
    float x[16], s, z;
    for (int i = 0; i < 16; i++) x[i] = (float)(i % 4); /* codes 0..3 exactly at 2 bits */
    lethe_quant_asym(x, 16, 1, 2, c, &s, &z);
    CHECK(s == 1.0f && z == 0.0f);
    for (int i = 0; i < 16; i++) CHECK_EQ_INT(lethe_code_get(c, i, 2), i % 4);
    CHECK_EQ_INT(c[0], 0xE4); /* 0 | 1<<2 | 2<<4 | 3<<6: first element in the low bits */
}

static void test_kivi_keys(void) {
    enum { G = 32, C = 64 };
    static float k[G * C], kh[G * C];
    static uint8_t codes[G * C];
    float sc[C], zr[C];
    for (int bits = 2; bits <= 8; bits *= 2) {
        for (int i = 0; i < G * C; i++) k[i] = 3.0f * frand() + (float)(i % C) * 0.1f;
        for (int t = 0; t < G; t++) k[t * C + 5] = 1.25f; /* constant channel */
        lethe_kivi_quant_keys(k, G, C, bits, codes, sc, zr);
        lethe_kivi_dequant_keys(codes, sc, zr, G, C, bits, kh);
        for (int t = 0; t < G; t++)
            for (int c = 0; c < C; c++) {
                float e = fabsf(k[t * C + c] - kh[t * C + c]);
                CHECK_MSG(e <= sc[c] * 0.5f * (1 + 1e-5f) + 1e-6f, "bits %d t %d c %d err %g s %g",
                          bits, t, c, e, sc[c]);
            }
        CHECK(sc[5] == 0.0f);
        for (int t = 0; t < G; t++) CHECK(kh[t * C + 5] == 1.25f);
        /* per-channel: the scale is the channel's range over the block */
        float mn = k[7], mx = k[7];
        for (int t = 1; t < G; t++) mn = fminf(mn, k[t * C + 7]), mx = fmaxf(mx, k[t * C + 7]);
        CHECK(zr[7] == mn && fabsf(sc[7] - (mx - mn) / (float)((1 << bits) - 1)) < 1e-6f);
        /* min and max are reproduced exactly up to rounding */
    }
}

static void test_kivi_values(void) {
    enum { C = 128, G = 32 };
    float v[C], vh[C], sc[C / G], zr[C / G];
    uint8_t codes[C];
    for (int bits = 2; bits <= 8; bits *= 2) {
        for (int i = 0; i < C; i++) v[i] = 5.0f * frand();
        for (int i = 64; i < 96; i++) v[i] = -0.5f; /* constant group */
        lethe_kivi_quant_value(v, C, G, bits, codes, sc, zr);
        lethe_kivi_dequant_value(codes, sc, zr, C, G, bits, vh);
        for (int i = 0; i < C; i++)
            CHECK(fabsf(v[i] - vh[i]) <= sc[i / G] * 0.5f * (1 + 1e-5f) + 1e-6f);
        for (int i = 64; i < 96; i++) CHECK(vh[i] == -0.5f);
        /* 2 bits is coarser than 4 bits on the same data */
    }
    /* mean error shrinks with bits */
    double err[3] = {0};
    int b = 0;
    for (int bits = 2; bits <= 8; bits *= 2, b++) {
        lethe_kivi_quant_value(v, C, G, bits, codes, sc, zr);
        lethe_kivi_dequant_value(codes, sc, zr, C, G, bits, vh);
        for (int i = 0; i < C; i++) err[b] += fabs(v[i] - vh[i]);
    }
    CHECK(err[0] > err[1] && err[1] > err[2]);
}

static void test_fp8_table(void) {
    /* every finite code decodes and re-encodes to itself */
    for (int b = 0; b < 256; b++) {
        float f = lethe_fp8_e4m3_to_float((uint8_t)b);
        if ((b & 0x7F) == 0x7F) {
            CHECK(isnan(f));
            continue;
        }
        uint8_t back = lethe_fp8_e4m3_from_float(f);
        CHECK_MSG(back == b || (f == 0.0f && (back & 0x7F) == 0), "code %02x -> %g -> %02x", b, f, back);
    }
    CHECK(lethe_fp8_e4m3_to_float(0x7E) == 448.0f);
    CHECK(lethe_fp8_e4m3_to_float(0x08) == 0x1p-6f);
    CHECK(lethe_fp8_e4m3_to_float(0x01) == 0x1p-9f);
    CHECK(lethe_fp8_e4m3_from_float(1e6f) == 0x7E);
    CHECK(lethe_fp8_e4m3_from_float(-1e6f) == 0xFE);
    CHECK(lethe_fp8_e4m3_from_float(NAN) == 0x7F);
    /* round to nearest even: 1 + 1/16 lies between 1 and 1.125 -> 1 (even mantissa) */
    CHECK(lethe_fp8_e4m3_to_float(lethe_fp8_e4m3_from_float(1.0625f)) == 1.0f);
    CHECK(lethe_fp8_e4m3_to_float(lethe_fp8_e4m3_from_float(1.1875f)) == 1.25f);
}

static void test_fp8_vec(void) {
    enum { N = 64 };
    float x[N], xh[N], s;
    uint8_t c[N];
    for (int trial = 0; trial < 50; trial++) {
        float mag = powf(10.0f, (float)(trial % 9) - 4.0f);
        for (int i = 0; i < N; i++) x[i] = mag * frand();
        lethe_fp8_quant_vec(x, N, c, &s);
        lethe_fp8_dequant_vec(c, N, s, xh);
        float amax = 0;
        int ia = 0;
        for (int i = 0; i < N; i++)
            if (fabsf(x[i]) > amax) amax = fabsf(x[i]), ia = i;
        CHECK(fabsf(xh[ia] - x[ia]) <= 1e-6f * amax); /* amax exact up to rounding */
        for (int i = 0; i < N; i++) {
            float e = fabsf(x[i] - xh[i]);
            if (fabsf(x[i]) / s >= 0x1p-6f)
                CHECK_MSG(e <= 0x1p-4f * fabsf(x[i]) * (1 + 1e-5f), "rel err %g at %g", e, x[i]);
            else
                CHECK(e <= 0x1p-10f * s * (1 + 1e-5f));
        }
    }
    memset(x, 0, sizeof(x));
    lethe_fp8_quant_vec(x, N, c, &s);
    lethe_fp8_dequant_vec(c, N, s, xh);
    CHECK(s == 0.0f);
    for (int i = 0; i < N; i++) CHECK(xh[i] == 0.0f && !isnan(xh[i]));
}

int main(void) {
    TEST_RUN(test_pack);
    TEST_RUN(test_kivi_keys);
    TEST_RUN(test_kivi_values);
    TEST_RUN(test_fp8_table);
    TEST_RUN(test_fp8_vec);
    return 0;
}

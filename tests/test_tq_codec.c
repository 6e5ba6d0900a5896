/* test_tq_codec.c - the TurboQuant reference quantizer (src/backend/tq_codec.c)
 * against its definition and the paper's distortion values (methods.md §16):
 *   - the rotation is orthogonal (P P^T = I to 1e-6) and depends only on the seed;
 *   - the Lloyd-Max codebooks are symmetric, ascending, and satisfy the
 *     centroid condition; their distortion per unit vector matches the
 *     paper's ~0.36 / 0.117 / 0.03 / 0.009 for b = 1..4 (the Gaussian
 *     Lloyd-Max values 0.3634 / 0.1175 / 0.03454 / 0.009497 within 3% at
 *     d = 128), and the measured MSE of random unit vectors matches it;
 *   - same seed -> identical codes; quant / dequant scales with the norm;
 *     a zero vector stays zero without NaN;
 *   - fp16 conversion equals the compiler's _Float16 on every half value and
 *     on random floats (round to nearest even).
 * `test_tq_codec --dump FILE` writes codebooks, distortions and quantized
 * vectors for the numpy reference tests/ref/test_turboquant_ref.py. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/tq_codec.h"
#include "core/util.h"
#include "test.h"

static uint64_t g_rng = 17;
static double gauss(void) {
    const double u1 = ((double)(lethe_splitmix64(&g_rng) >> 11) + 0.5) * 0x1p-53;
    const double u2 = ((double)(lethe_splitmix64(&g_rng) >> 11) + 0.5) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static void test_rotation(void) {
    const int dims[3] = {16, 64, 128};
    for (int t = 0; t < 3; t++) {
        const int d = dims[t];
        float *r = malloc((size_t)d * d * sizeof(float)), *r2 = malloc((size_t)d * d * sizeof(float));
        lethe_tq_rotation(3, d, r);
        double worst = 0;
        for (int i = 0; i < d; i++)
            for (int j = 0; j < d; j++) {
                double s = 0;
                for (int k = 0; k < d; k++) s += (double)r[i * d + k] * r[j * d + k];
                worst = fmax(worst, fabs(s - (i == j)));
            }
        CHECK_MSG(worst < 1e-6, "d %d: |P P^T - I| %g", d, worst);
        lethe_tq_rotation(3, d, r2);
        CHECK(!memcmp(r, r2, (size_t)d * d * sizeof(float)));
        lethe_tq_rotation(4, d, r2);
        CHECK(memcmp(r, r2, (size_t)d * d * sizeof(float)) != 0);
        free(r), free(r2);
    }
}

static void test_codebooks(void) {
    const double gauss_lm[5] = {0, 0.3634, 0.1175, 0.03454, 0.009497}; /* Lloyd-Max, N(0, 1) */
    const double paper[5] = {0, 0.36, 0.117, 0.03, 0.009};
    for (int b = 1; b <= 4; b++) {
        float c[16], bd[15];
        lethe_tq_codebook(b, 128, c, bd);
        const int K = 1 << b;
        for (int k = 0; k < K; k++) CHECK(c[k] == -c[K - 1 - k]);
        for (int k = 0; k + 1 < K; k++) CHECK(c[k] < bd[k] && bd[k] < c[k + 1]);
        const double D = lethe_tq_distortion(b, 128);
        fprintf(stderr, "    b=%d: distortion per unit vector %.5f (paper ~%.3f, Gaussian Lloyd-Max %.5f)\n", b,
                D, paper[b], gauss_lm[b]);
        CHECK_MSG(fabs(D - gauss_lm[b]) < 0.03 * gauss_lm[b], "b %d distortion %g", b, D);
        CHECK(fabs(D - paper[b]) < 0.16 * paper[b]); /* the paper quotes rounded values */
    }
}

/* random unit vectors through the quantizer: the measured MSE is the distortion */
static void test_mse_unit_vectors(void) {
    const int d = 128, N = 2000;
    float *rot = malloc((size_t)d * d * sizeof(float));
    lethe_tq_rotation(0, d, rot);
    float x[128], y[128];
    uint8_t codes[64], codes2[64];
    for (int b = 2; b <= 4; b++) {
        float c[16], bd[15];
        lethe_tq_codebook(b, d, c, bd);
        double mse = 0;
        for (int n = 0; n < N; n++) {
            double nn = 0;
            for (int i = 0; i < d; i++) x[i] = (float)gauss(), nn += (double)x[i] * x[i];
            for (int i = 0; i < d; i++) x[i] = (float)(x[i] / sqrt(nn));
            uint16_t h, h2;
            lethe_tq_quant_vec(x, d, b, rot, bd, codes, &h);
            lethe_tq_quant_vec(x, d, b, rot, bd, codes2, &h2);
            CHECK(h == h2 && !memcmp(codes, codes2, lethe_tq_code_bytes(d, b)));
            lethe_tq_dequant_vec(codes, h, d, b, rot, c, y);
            for (int i = 0; i < d; i++) mse += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        }
        mse /= N;
        const double D = lethe_tq_distortion(b, d);
        fprintf(stderr, "    b=%d: measured MSE per unit vector %.5f (distortion %.5f)\n", b, mse, D);
        CHECK_MSG(fabs(mse - D) < 0.08 * D, "b %d: mse %g vs %g", b, mse, D);
    }
    /* scale: quantizing 7 x gives 7 x the reconstruction (fp16 norm aside); zero stays zero */
    float c[16], bd[15];
    lethe_tq_codebook(3, d, c, bd);
    for (int i = 0; i < d; i++) x[i] = (float)gauss();
    uint16_t h;
    lethe_tq_quant_vec(x, d, 3, rot, bd, codes, &h);
    for (int i = 0; i < d; i++) x[i] *= 8.0f;
    uint16_t h8;
    lethe_tq_quant_vec(x, d, 3, rot, bd, codes2, &h8);
    CHECK(!memcmp(codes, codes2, lethe_tq_code_bytes(d, 3)));
    CHECK(lethe_f16_to_f32(h8) == 8.0f * lethe_f16_to_f32(h));
    memset(x, 0, sizeof(x));
    lethe_tq_quant_vec(x, d, 3, rot, bd, codes, &h);
    lethe_tq_dequant_vec(codes, h, d, 3, rot, c, y);
    CHECK(h == 0);
    for (int i = 0; i < d; i++) CHECK(y[i] == 0.0f);
    free(rot);
}

static void test_fp16(void) {
    for (uint32_t u = 0; u < 65536; u++) {
        _Float16 hv;
        uint16_t hb = (uint16_t)u;
        memcpy(&hv, &hb, 2);
        const float f = (float)hv;
        if (f != f) continue; /* NaN payloads */
        CHECK_MSG(lethe_f16_to_f32(hb) == f || (f == 0 && lethe_f16_to_f32(hb) == 0), "half %04x", u);
        CHECK_MSG(lethe_f32_to_f16(f) == hb, "float of half %04x", u);
    }
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)lethe_splitmix64(&g_rng);
        float f;
        memcpy(&f, &u, 4);
        if (f != f) continue;
        const _Float16 hv = (_Float16)f;
        uint16_t hb;
        memcpy(&hb, &hv, 2);
        CHECK_MSG(lethe_f32_to_f16(f) == hb, "float %a: %04x vs %04x", (double)f, lethe_f32_to_f16(f), hb);
    }
}

/* per (bits 1..4, d 64 / 128): int32 bits, d; f32 centroids [2^b], bounds
 * [2^b - 1]; f64 distortion; then rotation (seed 3) f32 [d][d] and 16 vectors:
 * f32 x [d], f32 dequantized [d], u16 norm, u8 codes unpacked [d] */
static int dump(const char *path) {
    FILE *f = fopen(path, "wb");
    CHECK(f);
    for (int32_t b = 1; b <= 4; b++)
        for (int32_t d = 64; d <= 128; d += 64) {
            float c[16], bd[15], *rot = lethe_xmalloc((size_t)d * d * sizeof(float)), x[128], xh[128];
            lethe_tq_codebook(b, d, c, bd);
            const double dist = lethe_tq_distortion(b, d);
            fwrite((int32_t[2]){b, d}, 4, 2, f);
            fwrite(c, 4, (size_t)1 << b, f);
            fwrite(bd, 4, ((size_t)1 << b) - 1, f);
            fwrite(&dist, 8, 1, f);
            lethe_tq_rotation(3, d, rot);
            fwrite(rot, 4, (size_t)d * d, f);
            for (int v = 0; v < 16; v++) {
                uint8_t codes[128], un[128];
                uint16_t n;
                for (int32_t i = 0; i < d; i++) x[i] = (float)gauss() * (1.0f + (float)v);
                lethe_tq_quant_vec(x, d, b, rot, bd, codes, &n);
                lethe_tq_dequant_vec(codes, n, d, b, rot, c, xh);
                for (int32_t i = 0; i < d; i++) un[i] = (uint8_t)lethe_tq_code(codes, i, b);
                fwrite(x, 4, (size_t)d, f), fwrite(xh, 4, (size_t)d, f), fwrite(&n, 2, 1, f), fwrite(un, 1, (size_t)d, f);
            }
            free(rot);
        }
    fclose(f);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--dump")) return dump(argv[2]);
    TEST_RUN(test_rotation);
    TEST_RUN(test_codebooks);
    TEST_RUN(test_mse_unit_vectors);
    TEST_RUN(test_fp16);
    return 0;
}

/* kv_codec.c - KIVI asymmetric integer groups and FP8 E4M3 (see kv_codec.h for the formats).
 *
 * CPU references of the KV quantizers. Rounding is round-half-to-even
 * (nearbyintf in the default rounding mode) everywhere, so a CUDA twin using
 * __float2int_rn / cvt.rn reproduces the codes bit for bit. */
#include "backend/kv_codec.h"

#include <math.h>
#include <string.h>

#include "core/status.h"

static void code_put(uint8_t *codes, int32_t i, int32_t bits, uint32_t q) {
    size_t bit = (size_t)i * (size_t)bits;
    uint8_t *b = codes + bit / 8;
    int sh = (int)(bit % 8);
    uint8_t mask = (uint8_t)(((1u << bits) - 1u) << sh);
    *b = (uint8_t)((*b & ~mask) | ((q << sh) & mask));
}

uint32_t lethe_code_get(const uint8_t *codes, int32_t i, int32_t bits) {
    size_t bit = (size_t)i * (size_t)bits;
    return ((uint32_t)codes[bit / 8] >> (bit % 8)) & ((1u << bits) - 1u);
}

void lethe_quant_asym(const float *x, int32_t n, size_t stride, int32_t bits, uint8_t *codes,
                      float *scale, float *zero) {
    LETHE_ASSERT(bits == 2 || bits == 4 || bits == 8);
    LETHE_ASSERT(n > 0);
    float mn = x[0], mx = x[0];
    for (int32_t i = 1; i < n; i++) {
        float v = x[(size_t)i * stride];
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    uint32_t qmax = (1u << bits) - 1u;
    float s = (mx - mn) / (float)qmax;
    *scale = s;
    *zero = mn;
    for (int32_t i = 0; i < n; i++) {
        uint32_t q = 0;
        if (s > 0.0f) {
            float f = nearbyintf((x[(size_t)i * stride] - mn) / s);
            q = f <= 0.0f ? 0u : f >= (float)qmax ? qmax : (uint32_t)f;
        }
        code_put(codes, i, bits, q);
    }
}

void lethe_kivi_quant_keys(const float *k, int32_t G, int32_t C, int32_t bits, uint8_t *codes,
                           float *scale, float *zero) {
    size_t row = lethe_kivi_code_bytes(C, bits);
    memset(codes, 0, (size_t)G * row);
    /* per channel c over the G tokens; code of (t, c) goes to token row t */
    uint8_t tmp[256];
    LETHE_ASSERT(lethe_kivi_code_bytes(G, bits) <= sizeof(tmp));
    for (int32_t c = 0; c < C; c++) {
        lethe_quant_asym(k + c, G, (size_t)C, bits, tmp, &scale[c], &zero[c]);
        for (int32_t t = 0; t < G; t++)
            code_put(codes + (size_t)t * row, c, bits, lethe_code_get(tmp, t, bits));
    }
}

void lethe_kivi_dequant_keys(const uint8_t *codes, const float *scale, const float *zero,
                             int32_t G, int32_t C, int32_t bits, float *k) {
    size_t row = lethe_kivi_code_bytes(C, bits);
    for (int32_t t = 0; t < G; t++)
        for (int32_t c = 0; c < C; c++)
            k[(size_t)t * C + c] =
                (float)lethe_code_get(codes + (size_t)t * row, c, bits) * scale[c] + zero[c];
}

void lethe_kivi_quant_value(const float *v, int32_t C, int32_t G, int32_t bits, uint8_t *codes,
                            float *scale, float *zero) {
    LETHE_ASSERT(G > 0 && C % G == 0 && ((size_t)G * bits) % 8 == 0);
    memset(codes, 0, lethe_kivi_code_bytes(C, bits));
    for (int32_t g = 0; g < C / G; g++)
        lethe_quant_asym(v + (size_t)g * G, G, 1, bits, codes + (size_t)g * G * bits / 8,
                         &scale[g], &zero[g]);
}

void lethe_kivi_dequant_value(const uint8_t *codes, const float *scale, const float *zero,
                              int32_t C, int32_t G, int32_t bits, float *v) {
    for (int32_t c = 0; c < C; c++)
        v[c] = (float)lethe_code_get(codes, c, bits) * scale[c / G] + zero[c / G];
}

/* ---- FP8 E4M3 ---- */

uint8_t lethe_fp8_e4m3_from_float(float x) {
    if (x != x) return 0x7F;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7E; /* saturate (no infinity in E4M3) */
    uint32_t code;
    if (a < 0x1p-6f) {
        /* subnormal: m * 2^-9, m in [0, 8]; m == 8 is the smallest normal 0x08 */
        code = (uint32_t)nearbyintf(a * 0x1p9f);
    } else {
        int e2;
        float f = frexpf(a, &e2);          /* a = f 2^e2, f in [0.5, 1) */
        int e = e2 - 1;                    /* a = (2f) 2^e, 2f in [1, 2) */
        uint32_t m = (uint32_t)nearbyintf((2.0f * f - 1.0f) * 8.0f); /* 0..8 */
        code = (uint32_t)(e + 7) * 8u + m; /* m == 8 carries into the exponent */
    }
    if (code > 0x7E) code = 0x7E;
    return sign | (uint8_t)code;
}

float lethe_fp8_e4m3_to_float(uint8_t b) {
    uint32_t e = (b >> 3) & 0xF, m = b & 0x7;
    if (e == 0xF && m == 0x7) return NAN;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, (int)e - 7);
    return (b & 0x80) ? -v : v;
}

void lethe_fp8_quant_vec(const float *x, int32_t n, uint8_t *codes, float *scale) {
    float amax = 0.0f;
    for (int32_t i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
    float s = amax / 448.0f;
    *scale = s;
    for (int32_t i = 0; i < n; i++) codes[i] = s > 0.0f ? lethe_fp8_e4m3_from_float(x[i] / s) : 0;
}

void lethe_fp8_dequant_vec(const uint8_t *codes, int32_t n, float scale, float *out) {
    for (int32_t i = 0; i < n; i++) out[i] = lethe_fp8_e4m3_to_float(codes[i]) * scale;
}

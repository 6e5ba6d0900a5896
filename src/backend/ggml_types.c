/* ggml_types.c - ggml tensor element types: sizes, names, dequantization to f32.
 *
 * Block formats follow ggml's published layouts (little endian, f16 scales):
 *   Q4_0  32 elems, 18 B: f16 d, u8 qs[16]          x = (nibble - 8) * d
 *   Q4_1  32 elems, 20 B: f16 d, f16 m, u8 qs[16]   x = nibble * d + m
 *   Q5_0  32 elems, 22 B: f16 d, u8 qh[4], qs[16]   x = (5-bit - 16) * d
 *   Q5_1  32 elems, 24 B: f16 d, f16 m, qh[4], qs[16]
 *   Q8_0  32 elems, 34 B: f16 d, i8 qs[32]
 *   Q8_1  32 elems, 36 B: f16 d, f16 s, i8 qs[32]
 *   K-quants, 256-element super-blocks with 6- or 8-bit sub-block scales:
 *   Q2_K 84 B, Q3_K 110 B, Q4_K 144 B, Q5_K 176 B, Q6_K 210 B, Q8_K 292 B.
 * In the 32-element formats the low nibbles hold elements 0..15 and the high
 * nibbles 16..31. Arithmetic is plain float (no FMA contraction under
 * -std=c17) so results match the reference dequantizer bit for bit. Rows are
 * independent, so large tensors are dequantized in parallel blocks. */
#include <string.h>

#include "backend/ggml_types.h"
#include "core/util.h"

typedef struct type_info {
    const char *name;
    uint32_t block;      /* elements per block */
    uint32_t bytes;      /* bytes per block */
} type_info;

static type_info info_of(lethe_ggml_type t) {
    switch (t) {
    case LETHE_GGML_F32: return (type_info){"f32", 1, 4};
    case LETHE_GGML_F16: return (type_info){"f16", 1, 2};
    case LETHE_GGML_BF16: return (type_info){"bf16", 1, 2};
    case LETHE_GGML_Q4_0: return (type_info){"q4_0", 32, 18};
    case LETHE_GGML_Q4_1: return (type_info){"q4_1", 32, 20};
    case LETHE_GGML_Q5_0: return (type_info){"q5_0", 32, 22};
    case LETHE_GGML_Q5_1: return (type_info){"q5_1", 32, 24};
    case LETHE_GGML_Q8_0: return (type_info){"q8_0", 32, 34};
    case LETHE_GGML_Q8_1: return (type_info){"q8_1", 32, 36};
    case LETHE_GGML_Q2_K: return (type_info){"q2_K", 256, 84};
    case LETHE_GGML_Q3_K: return (type_info){"q3_K", 256, 110};
    case LETHE_GGML_Q4_K: return (type_info){"q4_K", 256, 144};
    case LETHE_GGML_Q5_K: return (type_info){"q5_K", 256, 176};
    case LETHE_GGML_Q6_K: return (type_info){"q6_K", 256, 210};
    case LETHE_GGML_Q8_K: return (type_info){"q8_K", 256, 292};
    }
    return (type_info){"unknown", 0, 0};
}

size_t lethe_ggml_type_size(lethe_ggml_type t, uint64_t n_elems) {
    type_info ti = info_of(t);
    if (!ti.block || n_elems % ti.block) return 0;
    return (size_t)(n_elems / ti.block) * ti.bytes;
}

const char *lethe_ggml_type_name(lethe_ggml_type t) { return info_of(t).name; }

uint32_t lethe_ggml_block_size(lethe_ggml_type t) { return info_of(t).block; }

/* IEEE half -> float, including subnormals, inf and nan. */
static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_f32(h);
}

/* ---- 32-element blocks ---- */

static void dq_q4_0(const uint8_t *b, float *y) {
    float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0xf) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void dq_q4_1(const uint8_t *b, float *y) {
    float d = rd_f16(b), m = rd_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0xf) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void dq_q5_0(const uint8_t *b, float *y) {
    float d = rd_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = (float)(((qs[j] & 0xf) | (h0 << 4)) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | (h1 << 4)) - 16) * d;
    }
}

static void dq_q5_1(const uint8_t *b, float *y) {
    float d = rd_f16(b), m = rd_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = (float)((qs[j] & 0xf) | (h0 << 4)) * d + m;
        y[j + 16] = (float)((qs[j] >> 4) | (h1 << 4)) * d + m;
    }
}

static void dq_q8_0(const uint8_t *b, float *y) {
    float d = rd_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

static void dq_q8_1(const uint8_t *b, float *y) {
    float d = rd_f16(b); /* b+2 holds d * sum(qs), unused for dequantization */
    const int8_t *qs = (const int8_t *)(b + 4);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* ---- 256-element super-blocks ---- */

/* Q2_K: scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, f16 d, f16 dmin.
 * Each 128-element half: 4 shifts x 2 groups of 16 over qs[32]. */
static void dq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *q = b + 16;
    float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
    int is = 0;
    for (int n = 0; n < 256; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int g = 0; g < 2; g++) {
                uint8_t s = sc[is++];
                float dl = d * (float)(s & 0xf), ml = dmin * (float)(s >> 4);
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)((q[l + 16 * g] >> shift) & 3) - ml;
            }
        }
        q += 32;
    }
}

/* Q3_K: hmask[32] (high bit, set = no -4 offset), qs[64] 2-bit, scales[12] packing
 * sixteen 6-bit signed scales (bias 32), f16 d. */
static void dq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *q = b + 32, *sb = b + 96;
    float d = rd_f16(b + 108);
    int8_t scales[16];
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? (sb[j] & 0xf) : (sb[j - 8] >> 4);
        int hi = (sb[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        scales[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int g = 0; g < 2; g++) {
                float dl = d * (float)scales[is++];
                for (int l = 16 * g; l < 16 * g + 16; l++) {
                    int v = ((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4);
                    *y++ = dl * (float)v;
                }
            }
            m <<= 1;
        }
        q += 32;
    }
}

/* 6-bit scale and min j (0..7) packed in 12 bytes, as used by Q4_K and Q5_K. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: f16 d, f16 dmin, scales[12], qs[128]; 4 chunks of 64 = low nibbles then high. */
static void dq_q4_k(const uint8_t *b, float *y) {
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0; j < 8; j += 2) {
        uint8_t s, m;
        scale_min_k4(j, scales, &s, &m);
        float d1 = d * (float)s, m1 = dmin * (float)m;
        scale_min_k4(j + 1, scales, &s, &m);
        float d2 = d * (float)s, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xf) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        q += 32;
    }
}

/* Q5_K: as Q4_K plus qh[32] holding the fifth bit (two bits per 64-chunk). */
static void dq_q5_k(const uint8_t *b, float *y) {
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 8; j += 2) {
        uint8_t s, m;
        scale_min_k4(j, scales, &s, &m);
        float d1 = d * (float)s, m1 = dmin * (float)m;
        scale_min_k4(j + 1, scales, &s, &m);
        float d2 = d * (float)s, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 0xf) + ((qh[l] & u1) ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
        ql += 32;
        u1 <<= 2;
        u2 <<= 2;
    }
}

/* Q6_K: ql[128] low nibbles, qh[64] high 2 bits, i8 scales[16], f16 d; values - 32. */
static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = rd_f16(b + 208);
    for (int n = 0; n < 256; n += 128) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* Q8_K: f32 d, i8 qs[256], i16 bsums[16] (unused here). */
static void dq_q8_k(const uint8_t *b, float *y) {
    float d;
    memcpy(&d, b, 4);
    const int8_t *qs = (const int8_t *)(b + 4);
    for (int j = 0; j < 256; j++) y[j] = d * (float)qs[j];
}

typedef void (*block_fn)(const uint8_t *b, float *y);

static block_fn block_fn_of(lethe_ggml_type t) {
    switch (t) {
    case LETHE_GGML_Q4_0: return dq_q4_0;
    case LETHE_GGML_Q4_1: return dq_q4_1;
    case LETHE_GGML_Q5_0: return dq_q5_0;
    case LETHE_GGML_Q5_1: return dq_q5_1;
    case LETHE_GGML_Q8_0: return dq_q8_0;
    case LETHE_GGML_Q8_1: return dq_q8_1;
    case LETHE_GGML_Q2_K: return dq_q2_k;
    case LETHE_GGML_Q3_K: return dq_q3_k;
    case LETHE_GGML_Q4_K: return dq_q4_k;
    case LETHE_GGML_Q5_K: return dq_q5_k;
    case LETHE_GGML_Q6_K: return dq_q6_k;
    case LETHE_GGML_Q8_K: return dq_q8_k;
    default: return NULL;
    }
}

/* n elements from src; par: element count above which OpenMP threads share the work */
static void dequantize(lethe_ggml_type t, const uint8_t *s, float *dst, int64_t nn, int64_t par) {
    switch (t) {
    case LETHE_GGML_F32:
        memcpy(dst, s, (size_t)nn * 4);
        return;
    case LETHE_GGML_F16:
#pragma omp parallel for schedule(static) if (nn > par)
        for (int64_t i = 0; i < nn; i++) dst[i] = rd_f16(s + 2 * i);
        return;
    case LETHE_GGML_BF16:
#pragma omp parallel for schedule(static) if (nn > par)
        for (int64_t i = 0; i < nn; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            uint32_t bits = (uint32_t)h << 16;
            memcpy(&dst[i], &bits, 4);
        }
        return;
    default: break;
    }
    type_info ti = info_of(t);
    block_fn fn = block_fn_of(t);
    LETHE_ASSERT(fn);
    int64_t nb = nn / ti.block;
#pragma omp parallel for schedule(static) if (nn > par)
    for (int64_t i = 0; i < nb; i++) fn(s + (size_t)i * ti.bytes, dst + (size_t)i * ti.block);
}

lethe_status lethe_ggml_dequantize(lethe_ggml_type t, const void *src, float *dst, uint64_t n) {
    type_info ti = info_of(t);
    if (!ti.block)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "dequantize: unknown ggml type id %d", (int)t);
    if (n % ti.block)
        return lethe_errorf(LETHE_ERR_INVALID, "dequantize: %llu elements is not a multiple of "
                            "the %s block size %u", (unsigned long long)n, ti.name, ti.block);
    /* parallel only when the work pays for the thread start-up */
    dequantize(t, src, dst, (int64_t)n, 1 << 16);
    return LETHE_OK;
}

void lethe_ggml_dequantize_serial(lethe_ggml_type t, const void *src, float *dst, uint64_t n) {
    type_info ti = info_of(t);
    LETHE_ASSERT(ti.block && n % ti.block == 0);
    dequantize(t, src, dst, (int64_t)n, INT64_MAX);
}

/* qmatmul_avx2.c - register kernels for stored-format weights (AVX2/FMA/F16C;
 * compiled with -mavx2 -mfma -mf16c, called when cpu_isa.c found them working).
 *
 * y[i][j] = dot(x row i, W row j) for m <= 2 rows of x and 4 rows of W at a
 * time (4 independent FMA chains per x row). A row is walked in units of
 * elements (a 32-element block, a 32-element sub-block of a 256-element
 * K-quant super-block, or 8 elements of f16/bf16): prep_* reads the unit's
 * scales, vec_* decodes its v-th 8 elements to f32 with the float operations
 * of ggml_types.c's dequantizer (so the values are identical), and each
 * vector is FMA'd into one 8-lane accumulator per (x row, W row) in
 * increasing k: the f32 GEMM's order (matmul.c), hence the same bits. */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd_avx2.h"
#include "core/util.h"

typedef struct unit {
    const uint8_t *q; /* the unit's quant bytes (layout per format) */
    const uint8_t *h; /* high bits (Q5_*, Q5_K, Q6_K) */
    uint32_t qh;      /* Q5_0 / Q5_1: the block's 32 high bits */
    int shift;        /* nibble / bit selection within the bytes */
    float d, m;       /* scale and offset (second scale for Q6_K's upper 16) */
} unit;

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
static inline __m256i bytes_u32(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* nibbles of 8 bytes: low (shift 0) or high (shift 4), zero-extended */
static inline __m256i nib(const uint8_t *p, int shift) {
    return _mm256_and_si256(_mm256_srli_epi32(bytes_u32(p), shift), _mm256_set1_epi32(0xf));
}
static inline __m256 i2f(__m256i v) { return _mm256_cvtepi32_ps(v); }

/* ---- 32-element blocks: in the low nibbles elements 0..15, high 16..31 ---- */

static inline void prep_q4_0(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)u * 18;
    p->d = f16(b), p->q = b + 2;
}
static inline __m256 vec_q4_0(const unit *p, int v) { /* (q - 8) * d */
    __m256i q = _mm256_sub_epi32(nib(p->q + (v & 1) * 8, (v >> 1) * 4), _mm256_set1_epi32(8));
    return _mm256_mul_ps(i2f(q), _mm256_set1_ps(p->d));
}
static inline void prep_q4_1(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)u * 20;
    p->d = f16(b), p->m = f16(b + 2), p->q = b + 4;
}
static inline __m256 vec_q4_1(const unit *p, int v) { /* q * d + m */
    __m256 q = i2f(nib(p->q + (v & 1) * 8, (v >> 1) * 4));
    return _mm256_add_ps(_mm256_mul_ps(q, _mm256_set1_ps(p->d)), _mm256_set1_ps(p->m));
}
/* fifth bit of elements 8v .. 8v+7: bit e of qh */
static inline __m256i q5_high(uint32_t qh, int v) {
    const __m256i e = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                       _mm256_set1_epi32(8 * v));
    __m256i b = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)qh), e),
                                 _mm256_set1_epi32(1));
    return _mm256_slli_epi32(b, 4);
}
static inline void prep_q5_0(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)u * 22;
    p->d = f16(b), p->q = b + 6;
    memcpy(&p->qh, b + 2, 4);
}
static inline __m256 vec_q5_0(const unit *p, int v) { /* (q5 - 16) * d */
    __m256i q = _mm256_or_si256(nib(p->q + (v & 1) * 8, (v >> 1) * 4), q5_high(p->qh, v));
    q = _mm256_sub_epi32(q, _mm256_set1_epi32(16));
    return _mm256_mul_ps(i2f(q), _mm256_set1_ps(p->d));
}
static inline void prep_q5_1(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)u * 24;
    p->d = f16(b), p->m = f16(b + 2), p->q = b + 8;
    memcpy(&p->qh, b + 4, 4);
}
static inline __m256 vec_q5_1(const unit *p, int v) { /* q5 * d + m */
    __m256i q = _mm256_or_si256(nib(p->q + (v & 1) * 8, (v >> 1) * 4), q5_high(p->qh, v));
    return _mm256_add_ps(_mm256_mul_ps(i2f(q), _mm256_set1_ps(p->d)), _mm256_set1_ps(p->m));
}
static inline void prep_q8_0(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)u * 34;
    p->d = f16(b), p->q = b + 2;
}
static inline __m256 vec_q8_0(const unit *p, int v) { /* q * d */
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p->q + 8 * v)));
    return _mm256_mul_ps(i2f(q), _mm256_set1_ps(p->d));
}

/* ---- K-quants: unit u = sub-block s = u % 8 of super-block u / 8 ---- */

/* 6-bit scale and min j (0..7) of Q4_K / Q5_K, packed in 12 bytes */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
static inline void prep_q4_k(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)(u / 8) * 144;
    const int s = u % 8;
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    p->d = f16(b) * (float)sc, p->m = f16(b + 2) * (float)mn;
    p->q = b + 16 + 32 * (s / 2), p->shift = (s & 1) * 4;
}
static inline __m256 vec_q4_k(const unit *p, int v) { /* d1 * q - m1 */
    __m256 q = i2f(nib(p->q + 8 * v, p->shift));
    return _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(p->d), q), _mm256_set1_ps(p->m));
}
static inline void prep_q5_k(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)(u / 8) * 176;
    const int s = u % 8;
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    p->d = f16(b) * (float)sc, p->m = f16(b + 2) * (float)mn;
    p->h = b + 16, p->q = b + 48 + 32 * (s / 2), p->shift = s; /* nibble: (s & 1) * 4 */
}
static inline __m256 vec_q5_k(const unit *p, int v) { /* d1 * (q + 16 hb) - m1 */
    __m256i hb = _mm256_and_si256(
        _mm256_srl_epi32(bytes_u32(p->h + 8 * v), _mm_cvtsi32_si128(p->shift)),
        _mm256_set1_epi32(1));
    __m256i q = _mm256_or_si256(nib(p->q + 8 * v, (p->shift & 1) * 4), _mm256_slli_epi32(hb, 4));
    return _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(p->d), i2f(q)), _mm256_set1_ps(p->m));
}
/* Q6_K sub-block s: half n = s / 4, quarter t = s % 4; element l (0..31):
 * low nibble of ql[64n + 32(t&1) + l] (>> 4 for t >= 2), 2 bits of
 * qh[32n + l] >> 2t, scale sc[8n + l/16 + 2t] (d first, as the reference) */
static inline void prep_q6_k(const uint8_t *row, int u, unit *p) {
    const uint8_t *b = row + (size_t)(u / 8) * 210;
    const int s = u % 8, n = s / 4, t = s % 4;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * n + 2 * t;
    const float d = f16(b + 208);
    p->d = d * (float)sc[0], p->m = d * (float)sc[1];
    p->q = b + 64 * n + 32 * (t & 1), p->h = b + 128 + 32 * n, p->shift = t;
}
static inline __m256 vec_q6_k(const unit *p, int v) { /* (d sc) * (q6 - 32) */
    __m256i lo = nib(p->q + 8 * v, (p->shift >> 1) * 4);
    __m256i hi = _mm256_and_si256(
        _mm256_srl_epi32(bytes_u32(p->h + 8 * v), _mm_cvtsi32_si128(2 * p->shift)),
        _mm256_set1_epi32(3));
    __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                 _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_set1_ps(v < 2 ? p->d : p->m), i2f(q));
}

/* ---- f16 / bf16: unit = 8 elements ---- */

static inline void prep_f16(const uint8_t *row, int u, unit *p) { p->q = row + (size_t)u * 16; }
static inline __m256 vec_f16(const unit *p, int v) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p->q));
}
static inline __m256 vec_bf16(const unit *p, int v) {
    __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p->q));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

/* ---- the kernel ---- */

typedef void (*prep_fn)(const uint8_t *row, int u, unit *p);
typedef __m256 (*vec_fn)(const unit *p, int v);

static inline __attribute__((always_inline)) void qkernel(const lethe_cpu_qweight *w, int32_t j0,
                                                          int32_t j1, const float *x, int m,
                                                          float *y, int32_t ldy, const int ue,
                                                          prep_fn prep, vec_fn vec) {
    const int32_t in = w->cols, nu = in / ue, vpu = ue / 8;
    const float *x1 = x + in;
    for (int32_t j = j0; j < j1; j += 4) {
        const int nr = LETHE_MIN(4, j1 - j);
        const uint8_t *r0 = w->data + (size_t)j * w->row_bytes;
        const uint8_t *r1 = w->data + (size_t)(j + LETHE_MIN(1, nr - 1)) * w->row_bytes;
        const uint8_t *r2 = w->data + (size_t)(j + LETHE_MIN(2, nr - 1)) * w->row_bytes;
        const uint8_t *r3 = w->data + (size_t)(j + LETHE_MIN(3, nr - 1)) * w->row_bytes;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int32_t u = 0; u < nu; u++) {
            unit p0, p1, p2, p3;
            prep(r0, u, &p0), prep(r1, u, &p1), prep(r2, u, &p2), prep(r3, u, &p3);
            const float *xu = x + (size_t)u * ue, *xu1 = x1 + (size_t)u * ue;
            for (int v = 0; v < vpu; v++) {
                const __m256 xv = _mm256_loadu_ps(xu + 8 * v);
                const __m256 w0 = vec(&p0, v), w1 = vec(&p1, v), w2 = vec(&p2, v), w3 = vec(&p3, v);
                a0 = _mm256_fmadd_ps(xv, w0, a0), a1 = _mm256_fmadd_ps(xv, w1, a1);
                a2 = _mm256_fmadd_ps(xv, w2, a2), a3 = _mm256_fmadd_ps(xv, w3, a3);
                if (m > 1) {
                    const __m256 xv1 = _mm256_loadu_ps(xu1 + 8 * v);
                    b0 = _mm256_fmadd_ps(xv1, w0, b0), b1 = _mm256_fmadd_ps(xv1, w1, b1);
                    b2 = _mm256_fmadd_ps(xv1, w2, b2), b3 = _mm256_fmadd_ps(xv1, w3, b3);
                }
            }
        }
        float *yj = y + (j - j0);
        const __m256 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
        for (int c = 0; c < nr; c++) {
            yj[c] = lethe_hsum8(a[c]);
            if (m > 1) yj[ldy + c] = lethe_hsum8(b[c]);
        }
    }
}

#define DEF_KERNEL(name, ue, prep, vec)                                                  \
    static void name(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const float *x, \
                     int32_t m, float *y, int32_t ldy) {                                 \
        if (m == 1) qkernel(w, j0, j1, x, 1, y, ldy, ue, prep, vec);                     \
        else qkernel(w, j0, j1, x, 2, y, ldy, ue, prep, vec);                            \
    }
DEF_KERNEL(k_q4_0, 32, prep_q4_0, vec_q4_0)
DEF_KERNEL(k_q4_1, 32, prep_q4_1, vec_q4_1)
DEF_KERNEL(k_q5_0, 32, prep_q5_0, vec_q5_0)
DEF_KERNEL(k_q5_1, 32, prep_q5_1, vec_q5_1)
DEF_KERNEL(k_q8_0, 32, prep_q8_0, vec_q8_0)
DEF_KERNEL(k_q4_k, 32, prep_q4_k, vec_q4_k)
DEF_KERNEL(k_q5_k, 32, prep_q5_k, vec_q5_k)
DEF_KERNEL(k_q6_k, 32, prep_q6_k, vec_q6_k)
DEF_KERNEL(k_f16, 8, prep_f16, vec_f16)
DEF_KERNEL(k_bf16, 8, prep_f16, vec_bf16)

bool lethe_cpu_qrows_avx2(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const float *x,
                          int32_t m, float *y, int32_t ldy) {
    LETHE_ASSERT(m >= 1 && m <= 2 && 0 <= j0 && j0 <= j1 && j1 <= w->rows);
    void (*k)(const lethe_cpu_qweight *, int32_t, int32_t, const float *, int32_t, float *,
              int32_t) = NULL;
    switch (w->type) {
    case LETHE_GGML_Q4_0: k = k_q4_0; break;
    case LETHE_GGML_Q4_1: k = k_q4_1; break;
    case LETHE_GGML_Q5_0: k = k_q5_0; break;
    case LETHE_GGML_Q5_1: k = k_q5_1; break;
    case LETHE_GGML_Q8_0: k = k_q8_0; break;
    case LETHE_GGML_Q4_K: k = k_q4_k; break;
    case LETHE_GGML_Q5_K: k = k_q5_k; break;
    case LETHE_GGML_Q6_K: k = k_q6_k; break;
    case LETHE_GGML_F16: k = k_f16; break;
    case LETHE_GGML_BF16: k = k_bf16; break;
    default: return false;
    }
    k(w, j0, j1, x, m, y, ldy);
    return true;
}

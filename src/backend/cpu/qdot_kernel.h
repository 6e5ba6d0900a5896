/* qdot_kernel.h - the SIMD body of the 16-bit-activation matmul (qdot.c),
 * included by qdot_avx2.c (vpmaddwd) and qdot_vnni.c (vpdpwssd), each
 * compiled for its tier. The includer defines
 *     QDOT_DOT2(wl, xl, wh, xh) -> __m256i: lane l = the sum over the two
 *                        16-element chunks of w[2l] x[2l] + w[2l+1] x[2l+1]
 *                        (signed 16-bit integers, exact in 32 bits)
 *     QDOT_DOT1(w, x)    the same for one chunk
 *     QDOT_NAME          the entry point's name.
 * Both tiers run the same float operations in the same order on the same
 * integers, so their results are bit-identical (and identical to the
 * portable C twin in qdot.c).
 *
 * n <= 2 rows of x (decode): one W row at a time in memory order, units
 * decoded in registers. More rows: QDOT_QR rows of W decoded into scratch
 * (16-bit integers, scales, offsets) once, then every row of x against them. */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/qdot.h"
#include "backend/cpu/simd_avx2.h"
#include "core/util.h"

static inline float qk_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0-15), then high */
static inline __m256i qk_nib16(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
/* 32 bytes, the nibble at `shift` (0 or 4) of each */
static inline __m256i qk_nib32(const uint8_t *q, int shift) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(0x0f));
}
/* bit e of the 32-bit qh -> 0x10 in byte e (Q5_0 / Q5_1's fifth bit) */
static inline __m256i qk_bits16(uint32_t qh) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* One 32-element unit u of a W row: its integers (returned), the scales of
 * its two halves (lo, hi) and their offset coefficients (o[0], o[1]). One
 * always-inlined function per format, so the format switch is outside the loops. */
#define QK_UNIT(name) \
    static inline __attribute__((always_inline)) __m256i name(const uint8_t *row, int u, float *lo, \
                                                              float *hi, float *o)
QK_UNIT(qk_q4_0) {
    const uint8_t *b = row + (size_t)u * 18;
    *lo = *hi = qk_f16(b), o[0] = o[1] = -8.0f * *lo;
    return qk_nib16(b + 2);
}
QK_UNIT(qk_q4_1) {
    const uint8_t *b = row + (size_t)u * 20;
    *lo = *hi = qk_f16(b), o[0] = o[1] = qk_f16(b + 2);
    return qk_nib16(b + 4);
}
QK_UNIT(qk_q5_0) {
    const uint8_t *b = row + (size_t)u * 22;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    *lo = *hi = qk_f16(b), o[0] = o[1] = -16.0f * *lo;
    return _mm256_or_si256(qk_nib16(b + 6), qk_bits16(qh));
}
QK_UNIT(qk_q5_1) {
    const uint8_t *b = row + (size_t)u * 24;
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    *lo = *hi = qk_f16(b), o[0] = o[1] = qk_f16(b + 2);
    return _mm256_or_si256(qk_nib16(b + 8), qk_bits16(qh));
}
QK_UNIT(qk_q8_0) { /* signed bytes, as stored */
    const uint8_t *b = row + (size_t)u * 34;
    *lo = *hi = qk_f16(b), o[0] = o[1] = 0.0f;
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}
static inline __attribute__((always_inline)) __m256i qk_k45(const uint8_t *row, int u, float *lo,
                                                            float *hi, float *o, int k5) {
    const int s = u % 8;
    const uint8_t *b = row + (size_t)(u / 8) * (k5 ? 176 : 144);
    int sc, mn;
    qdot_scale_min_k4(s, b + 4, &sc, &mn);
    *lo = *hi = qk_f16(b) * (float)sc, o[0] = o[1] = -(qk_f16(b + 2) * (float)mn);
    __m256i q = qk_nib32(b + (k5 ? 48 : 16) + 32 * (s / 2), (s & 1) * 4);
    if (k5) { /* bit s of qh[l] -> 0x10 */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_set1_epi8((char)(1 << s));
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit),
                                                _mm256_set1_epi8(0x10)));
    }
    return q;
}
QK_UNIT(qk_q4_k) { return qk_k45(row, u, lo, hi, o, 0); }
QK_UNIT(qk_q5_k) { return qk_k45(row, u, lo, hi, o, 1); }
QK_UNIT(qk_q6_k) {
    const int s = u % 8, n = s / 4, tq = s % 4;
    const uint8_t *b = row + (size_t)(u / 8) * 210;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * n + 2 * tq;
    const float d = qk_f16(b + 208);
    *lo = d * (float)sc[0], *hi = d * (float)sc[1];
    o[0] = -32.0f * *lo, o[1] = -32.0f * *hi;
    const __m256i l4 = qk_nib32(b + 64 * n + 32 * (tq & 1), (tq >> 1) * 4);
    __m256i h2 = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
    h2 = _mm256_and_si256(_mm256_srl_epi16(h2, _mm_cvtsi32_si128(2 * tq)), _mm256_set1_epi8(3));
    return _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)); /* < 64: no carry across bytes */
}

/* a unit's 32 integers as two vectors of 16-bit: elements 0-15, 16-31 */
static inline __attribute__((always_inline)) void qk_widen(__m256i q, int is_signed, __m256i *lo,
                                                           __m256i *hi) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    *lo = is_signed ? _mm256_cvtepi8_epi16(a) : _mm256_cvtepu8_epi16(a);
    *hi = is_signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}
/* acc += the unit's dot (w lo/hi . x lo/hi) scaled: one scale for both
 * halves (sum the integers first), or Q6_K's two (lo half, then hi half) */
static inline __attribute__((always_inline)) __m256 qk_acc(__m256 acc, __m256i wl, __m256i wh,
                                                          const int16_t *x, float sl, float sh,
                                                          int split) {
    const __m256i xl = _mm256_loadu_si256((const __m256i *)x);
    const __m256i xh = _mm256_loadu_si256((const __m256i *)(x + 16));
    if (!split)
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(QDOT_DOT2(wl, xl, wh, xh)), _mm256_set1_ps(sl), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QDOT_DOT1(wl, xl)), _mm256_set1_ps(sl), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(QDOT_DOT1(wh, xh)), _mm256_set1_ps(sh), acc);
}

/* Rows [j0, j1) for n <= 2 x rows: one W row at a time, streamed in
 * memory order (the hardware prefetcher sees one sequential stream), its
 * units decoded in registers; the offset coefficients go to wo and are
 * applied at the end, in the order of the decoded path below (the same bits). */
static inline __attribute__((always_inline)) void
qk_fused(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x, float *y,
         int32_t ldy, float *wo, int is_signed, int split,
         __m256i (*unit)(const uint8_t *, int, float *, float *, float *)) {
    const int nb = x->cols / 32, ns = x->ns, m = x->n;
    const size_t unit_bytes = w->row_bytes / (size_t)nb;
    for (int h = 2 * nb; h < ns; h++) wo[h] = 0.0f;
    for (int32_t j = j0; j < j1; j++) {
        const uint8_t *r = w->data + (size_t)j * w->row_bytes;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int u = 0; u < nb; u++) {
            float lo, hi;
            /* a few hundred bytes ahead of the stream: the next rows' lines
             * are in flight while this unit computes */
            _mm_prefetch((const char *)(r + (size_t)u * unit_bytes + 768), _MM_HINT_T0);
            __m256i wl, wh;
            qk_widen(unit(r, u, &lo, &hi, wo + 2 * u), is_signed, &wl, &wh);
            a0 = qk_acc(a0, wl, wh, x->q + 32 * u, lo * x->d[u], hi * x->d[u], split);
            if (m > 1)
                a1 = qk_acc(a1, wl, wh, x->q + x->cols + 32 * u, lo * x->d[nb + u],
                            hi * x->d[nb + u], split);
        }
        for (int h = 0; h < ns; h += 8) {
            const __m256 wv = _mm256_loadu_ps(wo + h);
            a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x->s + h), a0);
            if (m > 1) a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x->s + ns + h), a1);
        }
        y[j - j0] = lethe_hsum8(a0);
        if (m > 1) y[(size_t)ldy + (j - j0)] = lethe_hsum8(a1);
    }
}

/* Rows [j0, j1) for any n: QDOT_QR rows decoded into scratch once (wq:
 * 16-bit integers, ws: the two half scales per unit, wo: offsets), then
 * every x row against them, two at a time, 4 x 2 accumulators in registers. */
static inline __attribute__((always_inline)) void
qk_decoded(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x, float *y,
           int32_t ldy, qdot_row *rows, int is_signed, int split,
           __m256i (*unit)(const uint8_t *, int, float *, float *, float *)) {
    const int nb = x->cols / 32, ns = x->ns;
    for (int32_t j = j0; j < j1; j += QDOT_QR) {
        const int nr = LETHE_MIN(QDOT_QR, j1 - j);
        for (int c = 0; c < QDOT_QR; c++) {
            const uint8_t *r = w->data + (size_t)(j + LETHE_MIN(c, nr - 1)) * w->row_bytes;
            for (int u = 0; u < nb; u++) {
                float lo, hi;
                __m256i wl, wh;
                qk_widen(unit(r, u, &lo, &hi, rows[c].wo + 2 * u), is_signed, &wl, &wh);
                _mm256_storeu_si256((__m256i *)(rows[c].wq + 32 * u), wl);
                _mm256_storeu_si256((__m256i *)(rows[c].wq + 32 * u + 16), wh);
                rows[c].ws[2 * u] = lo, rows[c].ws[2 * u + 1] = hi;
            }
            for (int h = 2 * nb; h < ns; h++) rows[c].wo[h] = 0.0f;
        }
        for (int32_t i = 0; i < x->n; i += 2) {
            const int m = LETHE_MIN(2, x->n - i);
            const int16_t *xq0 = x->q + (size_t)i * x->cols, *xq1 = xq0 + (m > 1 ? x->cols : 0);
            const float *xd0 = x->d + (size_t)i * nb, *xd1 = xd0 + (m > 1 ? nb : 0);
            /* 4 W rows x 2 x rows in registers (named: an array would live in memory) */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define QK_STEP(c, ac, bc)                                                                       \
    do {                                                                                         \
        const __m256i wl = _mm256_loadu_si256((const __m256i *)(rows[c].wq + 32 * u));          \
        const __m256i wh = _mm256_loadu_si256((const __m256i *)(rows[c].wq + 32 * u + 16));     \
        const float lo = rows[c].ws[2 * u], hi = rows[c].ws[2 * u + 1];                          \
        ac = qk_acc(ac, wl, wh, xq0 + 32 * u, lo * xd0[u], hi * xd0[u], split);                  \
        bc = qk_acc(bc, wl, wh, xq1 + 32 * u, lo * xd1[u], hi * xd1[u], split);                  \
    } while (0)
            for (int u = 0; u < nb; u++) {
                QK_STEP(0, a0, b0);
                QK_STEP(1, a1, b1);
                QK_STEP(2, a2, b2);
                QK_STEP(3, a3, b3);
            }
#undef QK_STEP
            const float *xs0 = x->s + (size_t)i * ns, *xs1 = xs0 + (m > 1 ? ns : 0);
            for (int h = 0; h < ns; h += 8) {
                const __m256 v0 = _mm256_loadu_ps(xs0 + h), v1 = _mm256_loadu_ps(xs1 + h);
                __m256 o = _mm256_loadu_ps(rows[0].wo + h);
                a0 = _mm256_fmadd_ps(o, v0, a0), b0 = _mm256_fmadd_ps(o, v1, b0);
                o = _mm256_loadu_ps(rows[1].wo + h);
                a1 = _mm256_fmadd_ps(o, v0, a1), b1 = _mm256_fmadd_ps(o, v1, b1);
                o = _mm256_loadu_ps(rows[2].wo + h);
                a2 = _mm256_fmadd_ps(o, v0, a2), b2 = _mm256_fmadd_ps(o, v1, b2);
                o = _mm256_loadu_ps(rows[3].wo + h);
                a3 = _mm256_fmadd_ps(o, v0, a3), b3 = _mm256_fmadd_ps(o, v1, b3);
            }
            const __m256 ra[QDOT_QR] = {a0, a1, a2, a3}, rb[QDOT_QR] = {b0, b1, b2, b3};
            float *y0 = y + (size_t)i * ldy + (j - j0);
            for (int c = 0; c < nr; c++) {
                y0[c] = lethe_hsum8(ra[c]);
                if (m > 1) y0[ldy + c] = lethe_hsum8(rb[c]);
            }
        }
    }
}

#define QK_CASE(T, fn, sg, split)                                                            \
    case T:                                                                                  \
        if (x->n <= 2) qk_fused(w, j0, j1, x, y, ldy, scratch[0].wo, sg, split, fn);         \
        else qk_decoded(w, j0, j1, x, y, ldy, scratch, sg, split, fn);                       \
        return;

void QDOT_NAME(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x,
               float *y, int32_t ldy, qdot_row *scratch) {
    switch (w->type) {
        QK_CASE(LETHE_GGML_Q4_0, qk_q4_0, 0, 0)
        QK_CASE(LETHE_GGML_Q4_1, qk_q4_1, 0, 0)
        QK_CASE(LETHE_GGML_Q5_0, qk_q5_0, 0, 0)
        QK_CASE(LETHE_GGML_Q5_1, qk_q5_1, 0, 0)
        QK_CASE(LETHE_GGML_Q8_0, qk_q8_0, 1, 0)
        QK_CASE(LETHE_GGML_Q4_K, qk_q4_k, 0, 0)
        QK_CASE(LETHE_GGML_Q5_K, qk_q5_k, 0, 0)
        QK_CASE(LETHE_GGML_Q6_K, qk_q6_k, 0, 1)
    default: LETHE_ASSERT(!"qdot: format without a kernel");
    }
}

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

/* QDOT_QR rows [j, j + nr) of W decoded into scratch: wq the 16-bit
 * integers, wo the offsets (zero-padded to ns), s4 [nb][2][QDOT_QR] the
 * half scales unit-major (rows past nr repeat the last row) */
static inline __attribute__((always_inline)) void
qk_decode_rows(const lethe_cpu_qweight *w, int32_t j, int nr, int nb, int ns, qdot_scratch *sc,
               int is_signed, __m256i (*unit)(const uint8_t *, int, float *, float *, float *)) {
    for (int c = 0; c < QDOT_QR; c++) {
        const uint8_t *r = w->data + (size_t)(j + LETHE_MIN(c, nr - 1)) * w->row_bytes;
        qdot_row *row = &sc->rows[c];
        for (int u = 0; u < nb; u++) {
            float lo, hi;
            __m256i wl, wh;
            qk_widen(unit(r, u, &lo, &hi, row->wo + 2 * u), is_signed, &wl, &wh);
            _mm256_storeu_si256((__m256i *)(row->wq + 32 * u), wl);
            _mm256_storeu_si256((__m256i *)(row->wq + 32 * u + 16), wh);
            sc->s4[(2 * u) * QDOT_QR + c] = lo, sc->s4[(2 * u + 1) * QDOT_QR + c] = hi;
        }
        for (int h = 2 * nb; h < ns; h++) row->wo[h] = 0.0f;
    }
}

/* p [nb][2][xt][QDOT_QR] = the scale of each (unit, half, x row, W row):
 * s4 times the x row's block scale, the very product (one f32 multiply)
 * that the decode path computes in registers; the tile loops read it back
 * as a broadcast from memory, a load instead of a multiply and a shuffle */
static inline __attribute__((always_inline)) void
qk_products(const qdot_scratch *sc, const float *const *xd, int nb, int split) {
    const float *restrict s4 = sc->s4;
    float *restrict p = sc->p;
    const float *restrict d0 = xd[0], *restrict d1 = xd[1];
#if QDOT_XT == 4
    const float *restrict d2 = xd[2], *restrict d3 = xd[3];
#endif
    for (int u = 0; u < nb; u++)
        for (int h = 0; h < (split ? 2 : 1); h++) {
            const __m128 v = _mm_loadu_ps(s4 + (2 * u + h) * QDOT_QR);
            float *q = p + (2 * u + h) * QDOT_XT * QDOT_QR;
            _mm_storeu_ps(q, _mm_mul_ps(v, _mm_set1_ps(d0[u])));
            _mm_storeu_ps(q + QDOT_QR, _mm_mul_ps(v, _mm_set1_ps(d1[u])));
#if QDOT_XT == 4
            _mm_storeu_ps(q + 2 * QDOT_QR, _mm_mul_ps(v, _mm_set1_ps(d2[u])));
            _mm_storeu_ps(q + 3 * QDOT_QR, _mm_mul_ps(v, _mm_set1_ps(d3[u])));
#endif
        }
}

/* acc += the unit's dot with the scales read from p */
#define QK_TILE_ACC(acc, wl, wh, xl, xh, pl, ph)                                                  \
    do {                                                                                          \
        if (!split) {                                                                             \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QDOT_DOT2(wl, xl, wh, xh)),                 \
                                  _mm256_set1_ps(*(pl)), acc);                                    \
        } else {                                                                                  \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QDOT_DOT1(wl, xl)), _mm256_set1_ps(*(pl)), acc); \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QDOT_DOT1(wh, xh)), _mm256_set1_ps(*(ph)), acc); \
        }                                                                                         \
    } while (0)

/* lethe_hsum8 of four vectors at once, the same additions in the same
 * tree: {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)} */
static inline __m128 qk_hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    /* lanes 0-3 + lanes 4-7: [a0 | a1] and [a2 | a3] */
    const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20),
                                     _mm256_permute2f128_ps(a0, a1, 0x31));
    const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20),
                                     _mm256_permute2f128_ps(a2, a3, 0x31));
    /* (0+4)+(2+6), (1+5)+(3+7): [a0, a0, a2, a2 | a1, a1, a3, a3] */
    const __m256 q = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 r = _mm256_hadd_ps(q, q); /* [a0, a2, a0, a2 | a1, a3, a1, a3] */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}

/* x row k's four accumulators (W rows 0-3): the offsets, then the sums to
 * y[0 .. nr) */
static inline __attribute__((always_inline)) void
qk_finish(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const qdot_scratch *sc, const float *xs,
          int ns, int nr, float *y) {
    for (int h = 0; h < ns; h += 8) {
        const __m256 v = _mm256_loadu_ps(xs + h);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(sc->rows[0].wo + h), v, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(sc->rows[1].wo + h), v, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(sc->rows[2].wo + h), v, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(sc->rows[3].wo + h), v, a3);
    }
    const __m128 r = qk_hsum8x4(a0, a1, a2, a3);
    if (nr == QDOT_QR) {
        _mm_storeu_ps(y, r);
    } else {
        float t[QDOT_QR];
        _mm_storeu_ps(t, r);
        for (int c = 0; c < nr; c++) y[c] = t[c];
    }
}

/* Rows [j0, j1) for any n: QDOT_QR rows decoded into scratch once, then
 * every x row against them, QDOT_XT at a time (2 on AVX2's 16 vector
 * registers, 4 with AVX-512VL's 32), QDOT_QR x QDOT_XT accumulators in
 * registers (named: an array would live in memory). The float operations
 * of each (W row, x row) pair are the decode path's, in its order. */
static inline __attribute__((always_inline)) void
qk_decoded(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x, float *y,
           int32_t ldy, qdot_scratch *sc, int is_signed, int split,
           __m256i (*unit)(const uint8_t *, int, float *, float *, float *)) {
    enum { XT = QDOT_XT };
    const int nb = x->cols / 32, ns = x->ns;
    for (int32_t j = j0; j < j1; j += QDOT_QR) {
        const int nr = LETHE_MIN(QDOT_QR, j1 - j);
        qk_decode_rows(w, j, nr, nb, ns, sc, is_signed, unit);
        const int16_t *wq0 = sc->rows[0].wq, *wq1 = sc->rows[1].wq, *wq2 = sc->rows[2].wq,
                      *wq3 = sc->rows[3].wq;
        for (int32_t i = 0; i < x->n; i += XT) {
            const int m = LETHE_MIN(XT, x->n - i);
            const int16_t *xq[XT];
            const float *xd[XT], *xs[XT];
            for (int k = 0; k < XT; k++) { /* rows past m repeat the last (not stored) */
                const int32_t r = i + LETHE_MIN(k, m - 1);
                xq[k] = x->q + (size_t)r * x->cols, xd[k] = x->d + (size_t)r * nb;
                xs[k] = x->s + (size_t)r * ns;
            }
            qk_products(sc, xd, nb, split);
            const float *p = sc->p;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
            /* a{W row}{x row}; with QDOT_XT 2 the x rows 2, 3 stay unused */
            __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
            __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
            __m256 a30 = a00, a31 = a00, a32 = a00, a33 = a00;
            for (int u = 0; u < nb; u++) {
                const float *pl = p + (2 * u) * XT * QDOT_QR, *ph = pl + XT * QDOT_QR;
                const __m256i x0l = _mm256_loadu_si256((const __m256i *)(xq[0] + 32 * u));
                const __m256i x0h = _mm256_loadu_si256((const __m256i *)(xq[0] + 32 * u + 16));
                const __m256i x1l = _mm256_loadu_si256((const __m256i *)(xq[1] + 32 * u));
                const __m256i x1h = _mm256_loadu_si256((const __m256i *)(xq[1] + 32 * u + 16));
#if QDOT_XT == 4
                const __m256i x2l = _mm256_loadu_si256((const __m256i *)(xq[2] + 32 * u));
                const __m256i x2h = _mm256_loadu_si256((const __m256i *)(xq[2] + 32 * u + 16));
                const __m256i x3l = _mm256_loadu_si256((const __m256i *)(xq[3] + 32 * u));
                const __m256i x3h = _mm256_loadu_si256((const __m256i *)(xq[3] + 32 * u + 16));
#endif
#if QDOT_XT == 4
#define QK_XROWS(c, A0, A1, A2, A3)                                                               \
    QK_TILE_ACC(A0, wl, wh, x0l, x0h, pl + 0 * QDOT_QR + c, ph + 0 * QDOT_QR + c);                \
    QK_TILE_ACC(A1, wl, wh, x1l, x1h, pl + 1 * QDOT_QR + c, ph + 1 * QDOT_QR + c);                \
    QK_TILE_ACC(A2, wl, wh, x2l, x2h, pl + 2 * QDOT_QR + c, ph + 2 * QDOT_QR + c);                \
    QK_TILE_ACC(A3, wl, wh, x3l, x3h, pl + 3 * QDOT_QR + c, ph + 3 * QDOT_QR + c)
#else
#define QK_XROWS(c, A0, A1, A2, A3)                                                               \
    QK_TILE_ACC(A0, wl, wh, x0l, x0h, pl + 0 * QDOT_QR + c, ph + 0 * QDOT_QR + c);                \
    QK_TILE_ACC(A1, wl, wh, x1l, x1h, pl + 1 * QDOT_QR + c, ph + 1 * QDOT_QR + c)
#endif
#define QK_WROW(c, wqc, A0, A1, A2, A3)                                                           \
    do {                                                                                          \
        const __m256i wl = _mm256_loadu_si256((const __m256i *)(wqc + 32 * u));                   \
        const __m256i wh = _mm256_loadu_si256((const __m256i *)(wqc + 32 * u + 16));              \
        QK_XROWS(c, A0, A1, A2, A3);                                                              \
    } while (0)
                QK_WROW(0, wq0, a00, a01, a02, a03);
                QK_WROW(1, wq1, a10, a11, a12, a13);
                QK_WROW(2, wq2, a20, a21, a22, a23);
                QK_WROW(3, wq3, a30, a31, a32, a33);
#undef QK_WROW
#undef QK_XROWS
            }
            float *yi = y + (size_t)i * ldy + (j - j0);
            qk_finish(a00, a10, a20, a30, sc, xs[0], ns, nr, yi);
            if (m > 1) qk_finish(a01, a11, a21, a31, sc, xs[1], ns, nr, yi + ldy);
            if (m > 2) qk_finish(a02, a12, a22, a32, sc, xs[2], ns, nr, yi + 2 * (size_t)ldy);
            if (m > 3) qk_finish(a03, a13, a23, a33, sc, xs[3], ns, nr, yi + 3 * (size_t)ldy);
        }
    }
}

#define QK_CASE(T, fn, sg, split)                                                            \
    case T:                                                                                  \
        if (x->n <= 2) qk_fused(w, j0, j1, x, y, ldy, scratch->rows[0].wo, sg, split, fn);         \
        else qk_decoded(w, j0, j1, x, y, ldy, scratch, sg, split, fn);                       \
        return;

void QDOT_NAME(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x,
               float *y, int32_t ldy, qdot_scratch *scratch) {
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

/* qdot_kernel.h - the SIMD body of the 16-bit-activation matmul (qdot.c),
 * included by qdot_avx2.c (vpmaddwd, 256-bit) and qdot_vnni.c (vpdpwssd,
 * 512-bit), each compiled for its tier. The includer defines
 *     QDOT_DOT2(wl, xl, wh, xh) -> __m256i: lane l = the sum over the two
 *                        16-element chunks of w[2l] x[2l] + w[2l+1] x[2l+1]
 *                        (signed 16-bit integers, exact in 32 bits)
 *     QDOT_DOT1(w, x)    the same for one chunk
 *     QDOT_ZMM           1: the prefill tile on 512-bit vectors (vpdpwssd)
 *     QDOT_NAME          the entry point's name.
 * Every path runs qdot.h's float order on the same integers, so the tiers,
 * the two paths and the portable C twin in qdot.c give the same bits.
 *
 * n <= 2 rows of x (decode): one W row at a time in memory order, units
 * decoded in registers, one scalar chain per (x row, W row). More rows:
 * QDOT_G = 16 rows of W decoded into scratch pair-interleaved (qdot.h), then
 * every x row against them with W rows in the vector lanes: per unit and x
 * row, 16 (or 2 x 8) integer multiply-adds with the x pair broadcast, one
 * convert, one scale multiply and one or two FMAs for all 16 W rows. */
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
static inline int32_t qk_ld32(const int16_t *p) { /* an x pair as one word */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
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

/* One 32-element unit u of a W row: its integers as bytes, before the
 * format's fixed offset (qk_widen subtracts it), the scales of its two
 * halves (lo, hi) and its min (*mn; formats without one leave it). One
 * always-inlined function per format, so the format switch is outside the loops. */
#define QK_UNIT(name) \
    static inline __attribute__((always_inline)) __m256i name(const uint8_t *row, int u, float *lo, \
                                                              float *hi, float *mn)
QK_UNIT(qk_q4_0) { /* offset 8 */
    const uint8_t *b = row + (size_t)u * 18;
    *lo = *hi = qk_f16(b);
    return qk_nib16(b + 2);
}
QK_UNIT(qk_q4_1) {
    const uint8_t *b = row + (size_t)u * 20;
    *lo = *hi = qk_f16(b), *mn = qk_f16(b + 2);
    return qk_nib16(b + 4);
}
QK_UNIT(qk_q5_0) { /* offset 16 */
    const uint8_t *b = row + (size_t)u * 22;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    *lo = *hi = qk_f16(b);
    return _mm256_or_si256(qk_nib16(b + 6), qk_bits16(qh));
}
QK_UNIT(qk_q5_1) {
    const uint8_t *b = row + (size_t)u * 24;
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    *lo = *hi = qk_f16(b), *mn = qk_f16(b + 2);
    return _mm256_or_si256(qk_nib16(b + 8), qk_bits16(qh));
}
QK_UNIT(qk_q8_0) { /* signed bytes, as stored */
    const uint8_t *b = row + (size_t)u * 34;
    *lo = *hi = qk_f16(b);
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}
static inline __attribute__((always_inline)) __m256i qk_k45(const uint8_t *row, int u, float *lo,
                                                            float *hi, float *mn, int k5) {
    const int s = u % 8;
    const uint8_t *b = row + (size_t)(u / 8) * (k5 ? 176 : 144);
    int sc, m;
    qdot_scale_min_k4(s, b + 4, &sc, &m);
    *lo = *hi = qk_f16(b) * (float)sc, *mn = -(qk_f16(b + 2) * (float)m);
    __m256i q = qk_nib32(b + (k5 ? 48 : 16) + 32 * (s / 2), (s & 1) * 4);
    if (k5) { /* bit s of qh[l] -> 0x10 */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_set1_epi8((char)(1 << s));
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit),
                                                _mm256_set1_epi8(0x10)));
    }
    return q;
}
QK_UNIT(qk_q4_k) { return qk_k45(row, u, lo, hi, mn, 0); }
QK_UNIT(qk_q5_k) { return qk_k45(row, u, lo, hi, mn, 1); }
QK_UNIT(qk_q6_k) { /* offset 32 */
    const int s = u % 8, n = s / 4, tq = s % 4;
    const uint8_t *b = row + (size_t)(u / 8) * 210;
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * n + 2 * tq;
    const float d = qk_f16(b + 208);
    *lo = d * (float)sc[0], *hi = d * (float)sc[1];
    const __m256i l4 = qk_nib32(b + 64 * n + 32 * (tq & 1), (tq >> 1) * 4);
    __m256i h2 = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
    h2 = _mm256_and_si256(_mm256_srl_epi16(h2, _mm_cvtsi32_si128(2 * tq)), _mm256_set1_epi8(3));
    return _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)); /* < 64: no carry across bytes */
}

/* The format's constants: the fixed offset subtracted from its integers
 * (bias: the result is signed), whether they are signed as stored (Q8_0),
 * whether its halves have their own scales (split: Q6_K) and a min. */
typedef __m256i (*qk_unit_fn)(const uint8_t *, int, float *, float *, float *);

/* a unit's 32 integers, offset removed, as two vectors of 16-bit: elements
 * 0-15, 16-31 */
static inline __attribute__((always_inline)) void qk_widen(__m256i q, int bias, int is_signed,
                                                           __m256i *lo, __m256i *hi) {
    if (bias) q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)bias));
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    *lo = is_signed || bias ? _mm256_cvtepi8_epi16(a) : _mm256_cvtepu8_epi16(a);
    *hi = is_signed || bias ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

/* {sum of v[0]'s lanes, ..., sum of v[7]'s} (exact) */
static inline __m256i qk_isum8(const __m256i *v) {
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31));
}

#define QK_PF_GROUPS 2 /* prefetch distance of the decode path, in 8-row groups */

/* Rows [j0, j1) for n <= 2 x rows: 8 W rows at a time, each streamed in
 * memory order, units decoded in registers; the rows' unit sums are
 * gathered into the lanes of one vector (lane r = W row j + r), so the
 * float chain of qdot.h runs on 8 rows at once. */
static inline __attribute__((always_inline)) void
qk_fused(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x, float *y,
         int32_t ldy, int bias, int is_signed, int split, int has_min, qk_unit_fn unit) {
    const int nb = x->cols / 32, m = x->n;
    const size_t unit_bytes = w->row_bytes / (size_t)nb;
    const int16_t *x1 = x->q + (m > 1 ? x->cols : 0);
    const float *d1 = x->d + (m > 1 ? nb : 0), *s1 = x->s + (m > 1 ? nb : 0);
    for (int32_t j = j0; j < j1; j += 8) {
        const int nr = LETHE_MIN(8, j1 - j);
        const uint8_t *r[8];
        for (int k = 0; k < 8; k++) /* rows past nr repeat the last (not stored) */
            r[k] = w->data + (size_t)(j + LETHE_MIN(k, nr - 1)) * w->row_bytes;
        const uint8_t *pf = w->data + (size_t)(j + 8 * QK_PF_GROUPS) * w->row_bytes;
        const size_t pf_share = 8 * unit_bytes;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int u = 0; u < nb; u++) {
            float lo[8], hi[8], mn[8] = {0};
            __m256i v0[8], v1[8], h0[8], h1[8];
            const __m256i x0l = _mm256_loadu_si256((const __m256i *)(x->q + 32 * u));
            const __m256i x0h = _mm256_loadu_si256((const __m256i *)(x->q + 32 * u + 16));
            const __m256i x1l = _mm256_loadu_si256((const __m256i *)(x1 + 32 * u));
            const __m256i x1h = _mm256_loadu_si256((const __m256i *)(x1 + 32 * u + 16));
            /* the 8 rows are one contiguous region, read as 8 interleaved
             * short streams that the hardware prefetcher does not follow:
             * unit u prefetches its share (8 units' bytes) of the region
             * QK_PF_GROUPS groups ahead */
            for (size_t o = (size_t)u * pf_share; o < (size_t)(u + 1) * pf_share; o += 64)
                _mm_prefetch((const char *)(pf + o), _MM_HINT_T0);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m256i wl, wh;
                qk_widen(unit(r[k], u, &lo[k], &hi[k], &mn[k]), bias, is_signed, &wl, &wh);
                if (!split) {
                    v0[k] = QDOT_DOT2(wl, x0l, wh, x0h), h0[k] = v0[k];
                    v1[k] = m > 1 ? QDOT_DOT2(wl, x1l, wh, x1h) : v0[k], h1[k] = v1[k];
                } else {
                    v0[k] = QDOT_DOT1(wl, x0l), h0[k] = QDOT_DOT1(wh, x0h);
                    v1[k] = m > 1 ? QDOT_DOT1(wl, x1l) : v0[k];
                    h1[k] = m > 1 ? QDOT_DOT1(wh, x1h) : h0[k];
                }
            }
            const __m256 wlo = _mm256_loadu_ps(lo);
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qk_isum8(v0)),
                                 _mm256_mul_ps(wlo, _mm256_set1_ps(x->d[u])), a0);
            if (m > 1)
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qk_isum8(v1)),
                                     _mm256_mul_ps(wlo, _mm256_set1_ps(d1[u])), a1);
            if (split) {
                const __m256 whi = _mm256_loadu_ps(hi);
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qk_isum8(h0)),
                                     _mm256_mul_ps(whi, _mm256_set1_ps(x->d[u])), a0);
                if (m > 1)
                    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qk_isum8(h1)),
                                         _mm256_mul_ps(whi, _mm256_set1_ps(d1[u])), a1);
            }
            if (has_min) {
                const __m256 wm = _mm256_loadu_ps(mn);
                a0 = _mm256_fmadd_ps(wm, _mm256_set1_ps(x->s[u]), a0);
                if (m > 1) a1 = _mm256_fmadd_ps(wm, _mm256_set1_ps(s1[u]), a1);
            }
        }
        float *yj = y + (j - j0);
        if (nr == 8) {
            _mm256_storeu_ps(yj, a0);
            if (m > 1) _mm256_storeu_ps(yj + ldy, a1);
        } else {
            float t[2][8];
            _mm256_storeu_ps(t[0], a0), _mm256_storeu_ps(t[1], a1);
            for (int k = 0; k < nr; k++) {
                yj[k] = t[0][k];
                if (m > 1) yj[(size_t)ldy + k] = t[1][k];
            }
        }
    }
}

/* QDOT_G rows [j, j + nr) of W decoded into scratch, pair-interleaved
 * (qdot.h); rows past nr repeat the last row */
static inline __attribute__((always_inline)) void
qk_decode_group(const lethe_cpu_qweight *w, int32_t j, int nr, int nb, qdot_scratch *sc, int bias,
                int is_signed, qk_unit_fn unit) {
    for (int g = 0; g < QDOT_G; g++) {
        const uint8_t *r = w->data + (size_t)(j + LETHE_MIN(g, nr - 1)) * w->row_bytes;
        for (int u = 0; u < nb; u++) {
            float lo, hi, mn = 0.0f;
            __m256i wl, wh;
            qk_widen(unit(r, u, &lo, &hi, &mn), bias, is_signed, &wl, &wh);
            int32_t t[16];
            _mm256_storeu_si256((__m256i *)t, wl);
            _mm256_storeu_si256((__m256i *)(t + 8), wh);
            int32_t *dst = sc->wq + (size_t)u * 16 * QDOT_G + g;
            for (int k = 0; k < 16; k++) dst[k * QDOT_G] = t[k];
            sc->ws[(2 * u) * QDOT_G + g] = lo, sc->ws[(2 * u + 1) * QDOT_G + g] = hi;
            sc->wm[u * QDOT_G + g] = mn;
        }
    }
}

#if QDOT_ZMM
/* The tile on 512-bit vectors: QDOT_G W rows in the lanes x QK_T x rows,
 * QK_T integer and QK_T float accumulators (named: an array would live in
 * memory). Integer sums restart per unit (per half for split formats). */
#define QK_T 8
#define QK_XB(t, k) _mm512_set1_epi32(qk_ld32(xq##t + 32 * u + 2 * (k)))
#define QK_FIRST(k) /* vpdpwssd into zero: vpmaddwd on 512 bits would need AVX-512BW */        \
    do {                                                                                          \
        i0 = i1 = i2 = i3 = i4 = i5 = i6 = i7 = _mm512_setzero_si512();                           \
        QK_STEP(k);                                                                               \
    } while (0)
#define QK_STEP(k)                                                                                \
    do {                                                                                          \
        const __m512i wk = _mm512_load_si512(W + (k));                                            \
        i0 = _mm512_dpwssd_epi32(i0, wk, QK_XB(0, k)), i1 = _mm512_dpwssd_epi32(i1, wk, QK_XB(1, k)); \
        i2 = _mm512_dpwssd_epi32(i2, wk, QK_XB(2, k)), i3 = _mm512_dpwssd_epi32(i3, wk, QK_XB(3, k)); \
        i4 = _mm512_dpwssd_epi32(i4, wk, QK_XB(4, k)), i5 = _mm512_dpwssd_epi32(i5, wk, QK_XB(5, k)); \
        i6 = _mm512_dpwssd_epi32(i6, wk, QK_XB(6, k)), i7 = _mm512_dpwssd_epi32(i7, wk, QK_XB(7, k)); \
    } while (0)
#define QK_STEPS8(k0)                                                                             \
    QK_STEP(k0 + 1); QK_STEP(k0 + 2); QK_STEP(k0 + 3); QK_STEP(k0 + 4); QK_STEP(k0 + 5);           \
    QK_STEP(k0 + 6); QK_STEP(k0 + 7)
/* f_t = fma(float(i_t), ws * d_t, f_t) for every x row t */
#define QK_SCALE1(t, ws) f##t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i##t), _mm512_mul_ps(ws, _mm512_set1_ps(xd##t[u])), f##t)
#define QK_SCALE(ws)                                                                              \
    QK_SCALE1(0, ws); QK_SCALE1(1, ws); QK_SCALE1(2, ws); QK_SCALE1(3, ws);                       \
    QK_SCALE1(4, ws); QK_SCALE1(5, ws); QK_SCALE1(6, ws); QK_SCALE1(7, ws)
#define QK_MIN1(t) f##t = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs##t[u]), f##t)

static inline __attribute__((always_inline)) void
qk_tile(const qdot_scratch *sc, const lethe_qx_rows *x, int32_t i, int m, int nr, float *y,
        int32_t ldy, int split, int has_min) {
    const int nb = x->cols / 32;
    const int16_t *xq0, *xq1, *xq2, *xq3, *xq4, *xq5, *xq6, *xq7;
    const float *xd0, *xd1, *xd2, *xd3, *xd4, *xd5, *xd6, *xd7;
    const float *xs0, *xs1, *xs2, *xs3, *xs4, *xs5, *xs6, *xs7;
#define QK_XROW(t)                                                                                \
    do { /* rows past m repeat the last (not stored) */                                           \
        const int32_t r = i + LETHE_MIN(t, m - 1);                                                \
        xq##t = x->q + (size_t)r * x->cols, xd##t = x->d + (size_t)r * nb;                        \
        xs##t = x->s + (size_t)r * nb;                                                            \
    } while (0)
    QK_XROW(0); QK_XROW(1); QK_XROW(2); QK_XROW(3);
    QK_XROW(4); QK_XROW(5); QK_XROW(6); QK_XROW(7);
#undef QK_XROW
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0;
    for (int u = 0; u < nb; u++) {
        const __m512i *W = (const __m512i *)(sc->wq + (size_t)u * 16 * QDOT_G);
        __m512i i0, i1, i2, i3, i4, i5, i6, i7;
        if (!split) {
            QK_FIRST(0); QK_STEPS8(0); QK_STEP(8); QK_STEPS8(8);
            const __m512 ws = _mm512_load_ps(sc->ws + (size_t)(2 * u) * QDOT_G);
            QK_SCALE(ws);
        } else {
            QK_FIRST(0); QK_STEPS8(0);
            const __m512 wsl = _mm512_load_ps(sc->ws + (size_t)(2 * u) * QDOT_G);
            QK_SCALE(wsl);
            QK_FIRST(8); QK_STEPS8(8);
            const __m512 wsh = _mm512_load_ps(sc->ws + (size_t)(2 * u + 1) * QDOT_G);
            QK_SCALE(wsh);
        }
        if (has_min) {
            const __m512 wm = _mm512_load_ps(sc->wm + (size_t)u * QDOT_G);
            QK_MIN1(0); QK_MIN1(1); QK_MIN1(2); QK_MIN1(3);
            QK_MIN1(4); QK_MIN1(5); QK_MIN1(6); QK_MIN1(7);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    float *yi = y + (size_t)i * ldy;
#define QK_STORE(t)                                                                               \
    if (m > t) _mm512_mask_storeu_ps(yi + (size_t)(t) * ldy, keep, f##t)
    QK_STORE(0); QK_STORE(1); QK_STORE(2); QK_STORE(3);
    QK_STORE(4); QK_STORE(5); QK_STORE(6); QK_STORE(7);
#undef QK_STORE
}
#undef QK_XB
#undef QK_FIRST
#undef QK_STEP
#undef QK_STEPS8
#undef QK_SCALE1
#undef QK_SCALE
#undef QK_MIN1
#else
/* The tile on 256-bit vectors: QDOT_G W rows as two halves (a: rows 0-7,
 * b: 8-15) x QK_T = 2 x rows; vpmaddwd then vpaddd */
#define QK_T 2
#define QK_XB(t, k) _mm256_set1_epi32(qk_ld32(xq##t + 32 * u + 2 * (k)))
#define QK_FIRST(k)                                                                               \
    do {                                                                                          \
        const __m256i wa = _mm256_load_si256(W + 2 * (k)), wb = _mm256_load_si256(W + 2 * (k) + 1); \
        const __m256i x0 = QK_XB(0, k), x1 = QK_XB(1, k);                                        \
        ia0 = _mm256_madd_epi16(wa, x0), ib0 = _mm256_madd_epi16(wb, x0);                         \
        ia1 = _mm256_madd_epi16(wa, x1), ib1 = _mm256_madd_epi16(wb, x1);                         \
    } while (0)
#define QK_STEP(k)                                                                                \
    do {                                                                                          \
        const __m256i wa = _mm256_load_si256(W + 2 * (k)), wb = _mm256_load_si256(W + 2 * (k) + 1); \
        const __m256i x0 = QK_XB(0, k), x1 = QK_XB(1, k);                                        \
        ia0 = _mm256_add_epi32(ia0, _mm256_madd_epi16(wa, x0));                                   \
        ib0 = _mm256_add_epi32(ib0, _mm256_madd_epi16(wb, x0));                                   \
        ia1 = _mm256_add_epi32(ia1, _mm256_madd_epi16(wa, x1));                                   \
        ib1 = _mm256_add_epi32(ib1, _mm256_madd_epi16(wb, x1));                                   \
    } while (0)
#define QK_STEPS8(k0)                                                                             \
    QK_STEP(k0 + 1); QK_STEP(k0 + 2); QK_STEP(k0 + 3); QK_STEP(k0 + 4); QK_STEP(k0 + 5);           \
    QK_STEP(k0 + 6); QK_STEP(k0 + 7)
#define QK_SCALE(h)                                                                               \
    do {                                                                                          \
        const float *s_ = sc->ws + (size_t)(2 * u + (h)) * QDOT_G;                                \
        const __m256 wsa = _mm256_load_ps(s_), wsb = _mm256_load_ps(s_ + 8);                      \
        const __m256 d0 = _mm256_set1_ps(xd0[u]), d1 = _mm256_set1_ps(xd1[u]);                   \
        fa0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia0), _mm256_mul_ps(wsa, d0), fa0);              \
        fb0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib0), _mm256_mul_ps(wsb, d0), fb0);              \
        fa1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia1), _mm256_mul_ps(wsa, d1), fa1);              \
        fb1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib1), _mm256_mul_ps(wsb, d1), fb1);              \
    } while (0)

static inline __attribute__((always_inline)) void
qk_tile(const qdot_scratch *sc, const lethe_qx_rows *x, int32_t i, int m, int nr, float *y,
        int32_t ldy, int split, int has_min) {
    const int nb = x->cols / 32;
    const int32_t r1 = i + LETHE_MIN(1, m - 1); /* row past m repeats the last (not stored) */
    const int16_t *xq0 = x->q + (size_t)i * x->cols, *xq1 = x->q + (size_t)r1 * x->cols;
    const float *xd0 = x->d + (size_t)i * nb, *xd1 = x->d + (size_t)r1 * nb;
    const float *xs0 = x->s + (size_t)i * nb, *xs1 = x->s + (size_t)r1 * nb;
    __m256 fa0 = _mm256_setzero_ps(), fb0 = fa0, fa1 = fa0, fb1 = fa0;
    for (int u = 0; u < nb; u++) {
        const __m256i *W = (const __m256i *)(sc->wq + (size_t)u * 16 * QDOT_G);
        __m256i ia0, ib0, ia1, ib1;
        if (!split) {
            QK_FIRST(0); QK_STEPS8(0); QK_STEP(8); QK_STEPS8(8);
            QK_SCALE(0);
        } else {
            QK_FIRST(0); QK_STEPS8(0);
            QK_SCALE(0);
            QK_FIRST(8); QK_STEPS8(8);
            QK_SCALE(1);
        }
        if (has_min) {
            const __m256 wma = _mm256_load_ps(sc->wm + (size_t)u * QDOT_G);
            const __m256 wmb = _mm256_load_ps(sc->wm + (size_t)u * QDOT_G + 8);
            const __m256 s0 = _mm256_set1_ps(xs0[u]), s1 = _mm256_set1_ps(xs1[u]);
            fa0 = _mm256_fmadd_ps(wma, s0, fa0), fb0 = _mm256_fmadd_ps(wmb, s0, fb0);
            fa1 = _mm256_fmadd_ps(wma, s1, fa1), fb1 = _mm256_fmadd_ps(wmb, s1, fb1);
        }
    }
    float *yi = y + (size_t)i * ldy;
    float t[2][QDOT_G];
    _mm256_storeu_ps(t[0], fa0), _mm256_storeu_ps(t[0] + 8, fb0);
    _mm256_storeu_ps(t[1], fa1), _mm256_storeu_ps(t[1] + 8, fb1);
    for (int k = 0; k < m; k++)
        for (int c = 0; c < nr; c++) yi[(size_t)k * ldy + c] = t[k][c];
}
#undef QK_XB
#undef QK_FIRST
#undef QK_STEP
#undef QK_STEPS8
#undef QK_SCALE
#endif

/* Rows [j0, j1) for any n: QDOT_G rows of W decoded into scratch once,
 * then every x row against them, QK_T at a time. (Chunking x to stay in L2,
 * re-decoding each group per chunk, measured ~5% slower on SmolLM2's shapes.) */
static inline __attribute__((always_inline)) void
qk_decoded(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x, float *y,
           int32_t ldy, qdot_scratch *sc, int bias, int is_signed, int split, int has_min,
           qk_unit_fn unit) {
    const int nb = x->cols / 32;
    for (int32_t j = j0; j < j1; j += QDOT_G) {
        const int nr = LETHE_MIN(QDOT_G, j1 - j);
        qk_decode_group(w, j, nr, nb, sc, bias, is_signed, unit);
        for (int32_t i = 0; i < x->n; i += QK_T)
            qk_tile(sc, x, i, LETHE_MIN(QK_T, x->n - i), nr, y + (j - j0), ldy, split, has_min);
    }
}
#undef QK_T

/* format: unit decoder, fixed offset, signed, split halves, min */
#define QK_CASE(T, fn, bias, sg, split, mn)                                                       \
    case T:                                                                                       \
        if (x->n <= 2) qk_fused(w, j0, j1, x, y, ldy, bias, sg, split, mn, fn);                   \
        else qk_decoded(w, j0, j1, x, y, ldy, scratch, bias, sg, split, mn, fn);                  \
        return;

void QDOT_NAME(const lethe_cpu_qweight *w, int32_t j0, int32_t j1, const lethe_qx_rows *x,
               float *y, int32_t ldy, qdot_scratch *scratch) {
    switch (w->type) {
        QK_CASE(LETHE_GGML_Q4_0, qk_q4_0, 8, 0, 0, 0)
        QK_CASE(LETHE_GGML_Q4_1, qk_q4_1, 0, 0, 0, 1)
        QK_CASE(LETHE_GGML_Q5_0, qk_q5_0, 16, 0, 0, 0)
        QK_CASE(LETHE_GGML_Q5_1, qk_q5_1, 0, 0, 0, 1)
        QK_CASE(LETHE_GGML_Q8_0, qk_q8_0, 0, 1, 0, 0)
        QK_CASE(LETHE_GGML_Q4_K, qk_q4_k, 0, 0, 0, 1)
        QK_CASE(LETHE_GGML_Q5_K, qk_q5_k, 0, 0, 0, 1)
        QK_CASE(LETHE_GGML_Q6_K, qk_q6_k, 32, 0, 1, 0)
    default: LETHE_ASSERT(!"qdot: format without a kernel");
    }
}

/* attention.c - KV store and attention over a slot selection (CPU backend).
 *
 * kv_store: k_cache[slots[i], :] = k[i, :] (same for v); rows of kv_dim.
 *
 * attention (see lethe_attn_args in backend.h): for sequence s with query
 * rows [q_begin[s], q_begin[s+1]) (n_q of them) and selection entries
 * sel_slots[sel_begin[s] .. sel_begin[s+1]) (n_sel of them, the last n_q are
 * the new tokens in order), query j of the sequence and head h attends to
 * entries e in [0, limit_j], limit_j = n_sel - n_q + j:
 *   score[e] = scale * (q[row, h, :] . K[sel[e], h / (n_heads/n_kv_heads), :])
 *   out[row, h, :] = sum_e softmax(score)[e] * V[sel[e], kv head, :]
 * The softmax is the numerically stable one in fp32, computed online over
 * blocks of ATT_BLOCK entries aligned at entry 0 (running max m, running sum
 * l; when the max grows, l and the output are rescaled by exp(m_old - m_new)),
 * so no scratch grows with the selection length.
 *
 * With per-KV-head selections (head_sel_begin, backend.h) KV head g of
 * sequence s reads its own list instead (same rules, its own n_sel): the
 * varlen-per-head attention of per-head eviction (CUDA twin:
 * cuda/attention_varlen.cu).
 *
 * Work item = (sequence, KV head, tile of up to QT consecutive queries): its
 * q vectors (QT queries x the G = n_heads/n_kv_heads heads sharing the KV
 * head) share every K/V block. Per block the K rows are transposed into
 * Kt [head_dim][ATT_BLOCK] so that scores are a small register-tiled GEMM
 * (broadcast q[d] x 8 entries per FMA, no horizontal sums), then P V is
 * accumulated straight into `out`.
 *
 * Determinism: a score is one FMA chain over d in increasing order; entries a
 * query may not see (beyond its causal limit, or padding of the last block)
 * get probability exactly 0, and blocks entirely beyond its limit leave its
 * state unchanged (rescale by exp(0) = 1, add 0). So a query's output is
 * bit-identical whatever tile, batch or thread count it is computed in.
 * (Per-key scores for the sparse methods: attn_scores, scores.c, which
 * computes each score with this same FMA chain.)
 *
 * Block-sparse prefill (a->bsp, backend.h lethe_block_sparse): the block
 * choice comes from attention_bsp.c; a sparse sequence's tiles then stay
 * inside one query block, skip the 32-entry blocks of unread key blocks and,
 * with mean correction, end with the skipped blocks' pseudo-entries. With
 * every block read the operations are those of the dense path. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define ATT_BLOCK 32       /* selection entries per online-softmax block (multiple of 8) */
#define ATT_GROUP_MAX 32   /* query heads per KV head */
#define ATT_HEAD_DIM_MAX 512
#define VEC_MAX 32         /* q vectors per tile: QT queries x G heads */
#define QT_MAX 16          /* queries per tile: max(1, VEC_TARGET / G) */
#define VEC_TARGET 16

void lethe_cpu_kv_store(lethe_backend *be, void *k_cache, void *v_cache, const void *k,
                        const void *v, const int32_t *slots, int32_t n, int32_t kv_dim) {
    float *kc = k_cache, *vc = v_cache;
    const float *kk = k, *vv = v;
    const size_t row = (size_t)kv_dim * sizeof(float);
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(slots[i] >= 0);
        memcpy(kc + (size_t)slots[i] * kv_dim, kk + (size_t)i * kv_dim, row);
        memcpy(vc + (size_t)slots[i] * kv_dim, vv + (size_t)i * kv_dim, row);
    }
}

/* exp for x <= 0 (Cephes expf polynomial, ~1 ulp); exp(0) is exactly 1. */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#define ATT_VB (ATT_BLOCK / 8) /* 8-float vectors per block row */

static inline float hmax8(__m256 v) { /* max is exact: any order gives the same result */
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Kt[d][b0 + i] = rows[i][d] for an 8 x 8 block (rows: 8 K rows at column d0). */
static inline void transpose8(float *kt, const float *const *rows, int d0, int b0) {
    __m256 r0 = _mm256_loadu_ps(rows[0] + d0), r1 = _mm256_loadu_ps(rows[1] + d0);
    __m256 r2 = _mm256_loadu_ps(rows[2] + d0), r3 = _mm256_loadu_ps(rows[3] + d0);
    __m256 r4 = _mm256_loadu_ps(rows[4] + d0), r5 = _mm256_loadu_ps(rows[5] + d0);
    __m256 r6 = _mm256_loadu_ps(rows[6] + d0), r7 = _mm256_loadu_ps(rows[7] + d0);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    float *o = kt + (size_t)d0 * ATT_BLOCK + b0;
    _mm256_store_ps(o + 0 * ATT_BLOCK, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_store_ps(o + 1 * ATT_BLOCK, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_store_ps(o + 2 * ATT_BLOCK, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_store_ps(o + 3 * ATT_BLOCK, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_store_ps(o + 4 * ATT_BLOCK, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_store_ps(o + 5 * ATT_BLOCK, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_store_ps(o + 6 * ATT_BLOCK, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_store_ps(o + 7 * ATT_BLOCK, _mm256_permute2f128_ps(s3, s7, 0x31));
}

/* The tile being computed: nv q vectors, vector v = query r * G + head h. */
typedef struct att_tile {
    const lethe_attn_args *a;
    int G, hd, nv;
    int hg0;                   /* first query head of the KV head (g * G) */
    int32_t row0;              /* batch row of the tile's first query */
    int32_t limit[QT_MAX];     /* causal limit of each query */
    const float *q[VEC_MAX];   /* [hd] each */
    float *out[VEC_MAX];       /* [hd] each, also the accumulator */
    float m[VEC_MAX], l[VEC_MAX];
} att_tile;

/* S[v0 + r][b] = scale * sum_d q[d] * Kt[d][b] for r < n (n constant after inlining).
 * 3 broadcasts + 1 K vector + 12 named accumulators = the 16 ymm registers. */
static inline __attribute__((always_inline)) void scores_kernel(const att_tile *t, const float *kt,
                                                                float (*S)[ATT_BLOCK], int v0,
                                                                int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const float *q0 = t->q[v0], *q1 = n > 1 ? t->q[v0 + 1] : q0, *q2 = n > 2 ? t->q[v0 + 2] : q0;
#define SCORE_STEP(k, i)                                        \
    a##i = _mm256_fmadd_ps(x0, k, a##i);                        \
    if (n > 1) b##i = _mm256_fmadd_ps(x1, k, b##i);             \
    if (n > 2) c##i = _mm256_fmadd_ps(x2, k, c##i);
    for (int d = 0; d < t->hd; d++) {
        const float *kd = kt + (size_t)d * ATT_BLOCK;
        const __m256 x0 = _mm256_broadcast_ss(q0 + d);
        const __m256 x1 = n > 1 ? _mm256_broadcast_ss(q1 + d) : x0;
        const __m256 x2 = n > 2 ? _mm256_broadcast_ss(q2 + d) : x0;
        __m256 k = _mm256_load_ps(kd);
        SCORE_STEP(k, 0)
        k = _mm256_load_ps(kd + 8);
        SCORE_STEP(k, 1)
        k = _mm256_load_ps(kd + 16);
        SCORE_STEP(k, 2)
        k = _mm256_load_ps(kd + 24);
        SCORE_STEP(k, 3)
    }
#undef SCORE_STEP
    const __m256 sc = _mm256_set1_ps(t->a->scale);
    __m256 r0[ATT_VB] = {a0, a1, a2, a3}, r1[ATT_VB] = {b0, b1, b2, b3}, r2[ATT_VB] = {c0, c1, c2, c3};
    for (int c = 0; c < ATT_VB; c++) {
        _mm256_storeu_ps(S[v0] + 8 * c, _mm256_mul_ps(r0[c], sc));
        if (n > 1) _mm256_storeu_ps(S[v0 + 1] + 8 * c, _mm256_mul_ps(r1[c], sc));
        if (n > 2) _mm256_storeu_ps(S[v0 + 2] + 8 * c, _mm256_mul_ps(r2[c], sc));
    }
}

_Static_assert(ATT_BLOCK == 32, "scores_kernel is written for 4 vectors of 8 entries");

static void tile_scores(const att_tile *t, const float *kt, float (*S)[ATT_BLOCK]) {
    int v0 = 0;
    for (; v0 + 3 <= t->nv; v0 += 3) scores_kernel(t, kt, S, v0, 3);
    if (t->nv - v0 == 2) scores_kernel(t, kt, S, v0, 2);
    if (t->nv - v0 == 1) scores_kernel(t, kt, S, v0, 1);
}

/* o[d..d+32) of vectors va (and vb when two) = o * corr + sum_b P[v][b] V_b[d..d+32). */
static inline __attribute__((always_inline)) void pv_kernel32(float *oa, float *ob, float ca,
                                                              float cb, const float *pa,
                                                              const float *pb,
                                                              const float *const *vrow, int nb,
                                                              int d, int two) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(oa + d), _mm256_set1_ps(ca));
    __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(oa + d + 8), _mm256_set1_ps(ca));
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(oa + d + 16), _mm256_set1_ps(ca));
    __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(oa + d + 24), _mm256_set1_ps(ca));
    __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
    if (two) {
        b0 = _mm256_mul_ps(_mm256_loadu_ps(ob + d), _mm256_set1_ps(cb));
        b1 = _mm256_mul_ps(_mm256_loadu_ps(ob + d + 8), _mm256_set1_ps(cb));
        b2 = _mm256_mul_ps(_mm256_loadu_ps(ob + d + 16), _mm256_set1_ps(cb));
        b3 = _mm256_mul_ps(_mm256_loadu_ps(ob + d + 24), _mm256_set1_ps(cb));
    }
    for (int b = 0; b < nb; b++) {
        const float *vr = vrow[b] + d;
        __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
        __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
        __m256 p = _mm256_broadcast_ss(pa + b);
        a0 = _mm256_fmadd_ps(p, v0, a0);
        a1 = _mm256_fmadd_ps(p, v1, a1);
        a2 = _mm256_fmadd_ps(p, v2, a2);
        a3 = _mm256_fmadd_ps(p, v3, a3);
        if (two) {
            __m256 q = _mm256_broadcast_ss(pb + b);
            b0 = _mm256_fmadd_ps(q, v0, b0);
            b1 = _mm256_fmadd_ps(q, v1, b1);
            b2 = _mm256_fmadd_ps(q, v2, b2);
            b3 = _mm256_fmadd_ps(q, v3, b3);
        }
    }
    _mm256_storeu_ps(oa + d, a0);
    _mm256_storeu_ps(oa + d + 8, a1);
    _mm256_storeu_ps(oa + d + 16, a2);
    _mm256_storeu_ps(oa + d + 24, a3);
    if (two) {
        _mm256_storeu_ps(ob + d, b0);
        _mm256_storeu_ps(ob + d + 8, b1);
        _mm256_storeu_ps(ob + d + 16, b2);
        _mm256_storeu_ps(ob + d + 24, b3);
    }
}

/* Columns [d0, hd) of one vector: 8 at a time, then scalars. Same per-element
 * operations as pv_kernel32 (o * corr, then one FMA per entry in order). */
static void pv_tail(float *o, float c, const float *p, const float *const *vrow, int nb, int d0,
                    int hd) {
    int d = d0;
    for (; d + 8 <= hd; d += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(c));
        for (int b = 0; b < nb; b++)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + b), _mm256_loadu_ps(vrow[b] + d), acc);
        _mm256_storeu_ps(o + d, acc);
    }
    for (; d < hd; d++) {
        float acc = o[d] * c;
        for (int b = 0; b < nb; b++) acc = fmaf(p[b], vrow[b][d], acc);
        o[d] = acc;
    }
}

static void tile_pv(const att_tile *t, float (*P)[ATT_BLOCK], const float *corr,
                    const float *const *vrow, int nb) {
    const int hd = t->hd, hd32 = hd & ~31;
    int v = 0;
    for (; v + 2 <= t->nv; v += 2) {
        for (int d = 0; d < hd32; d += 32)
            pv_kernel32(t->out[v], t->out[v + 1], corr[v], corr[v + 1], P[v], P[v + 1], vrow, nb, d, 1);
        if (hd32 < hd) {
            pv_tail(t->out[v], corr[v], P[v], vrow, nb, hd32, hd);
            pv_tail(t->out[v + 1], corr[v + 1], P[v + 1], vrow, nb, hd32, hd);
        }
    }
    if (v < t->nv) {
        for (int d = 0; d < hd32; d += 32)
            pv_kernel32(t->out[v], t->out[v], corr[v], corr[v], P[v], P[v], vrow, nb, d, 0);
        if (hd32 < hd) pv_tail(t->out[v], corr[v], P[v], vrow, nb, hd32, hd);
    }
}

/* Masks, updates the online softmax; P receives probabilities. */
static void tile_softmax(att_tile *t, int32_t e0, float (*S)[ATT_BLOCK], float *corr) {
    const int G = t->G;
    for (int v = 0; v < t->nv; v++) {
        const int r = v / G;
        const int32_t lim = t->limit[r];
        float *s = S[v];
        for (int b = 0; b < ATT_BLOCK; b++)
            if (e0 + b > lim) s[b] = -INFINITY;
        __m256 mx = _mm256_set1_ps(t->m[v]);
        for (int c = 0; c < ATT_VB; c++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + 8 * c));
        float mb = hmax8(mx);
        corr[v] = t->m[v] == -INFINITY ? 0.0f : expf(t->m[v] - mb);
        t->m[v] = mb;
        const __m256 mv = _mm256_set1_ps(mb), ninf = _mm256_set1_ps(-INFINITY);
        for (int c = 0; c < ATT_VB; c++) {
            __m256 x = _mm256_loadu_ps(s + 8 * c);
            __m256 keep = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
            _mm256_storeu_ps(s + 8 * c, _mm256_and_ps(exp_ps(_mm256_sub_ps(x, mv)), keep));
        }
        float sum = 0.0f;
        for (int b = 0; b < ATT_BLOCK; b++) sum += s[b];
        t->l[v] = t->l[v] * corr[v] + sum;
    }
}

/* Sequence of batch row i (q_begin is ascending; few sequences per step). */
static int seq_of_row(const lethe_attn_args *a, int32_t i) {
    int lo = 0, hi = a->n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (a->q_begin[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Kt = K block transposed (krow: nb rows): 8 x 8 tiles, then scalar edges;
 * padding zeroed (those entries are masked, zeroing just avoids reading garbage) */
static void fill_kt(float *kt, const float *const *krow, int nb, int hd) {
    const int nb8 = nb & ~7, hd8 = hd & ~7;
    for (int b0 = 0; b0 < nb8; b0 += 8) {
        for (int d0 = 0; d0 < hd8; d0 += 8) transpose8(kt, krow + b0, d0, b0);
        for (int d = hd8; d < hd; d++)
            for (int b = b0; b < b0 + 8; b++) kt[(size_t)d * ATT_BLOCK + b] = krow[b][d];
    }
    for (int b = nb8; b < ATT_BLOCK; b++)
        for (int d = 0; d < hd; d++) kt[(size_t)d * ATT_BLOCK + b] = b < nb ? krow[b][d] : 0.0f;
}

/* Block-sparse mean correction (backend.h lethe_block_sparse): the skipped
 * key blocks of the tile's query block as pseudo-entries (mean key, mean
 * value, logit + ln B), ATT_BLOCK at a time, visible to every query. */
static void attend_pseudo(att_tile *t, const lethe_cpu_bsp *bp, const uint8_t *keep, int g, int32_t B,
                          float *kt) {
    const size_t kv_stride = (size_t)t->a->n_kv_heads * t->hd;
    const float lnb = logf((float)B);
    float S[VEC_MAX][ATT_BLOCK], corr[VEC_MAX];
    const float *krow[ATT_BLOCK], *vrow[ATT_BLOCK];
    int nb = 0;
    for (int32_t b = 0; b <= bp->nkb; b++) {
        if (b < bp->nkb && keep[b]) continue;
        if (b < bp->nkb && (int64_t)(b + 1) * B > t->limit[0] + 1) continue; /* not visible to all */
        if (b < bp->nkb) {
            krow[nb] = bp->km + (size_t)b * kv_stride + (size_t)g * t->hd;
            vrow[nb] = bp->vm + (size_t)b * kv_stride + (size_t)g * t->hd;
            nb++;
        }
        if (nb == ATT_BLOCK || (b == bp->nkb && nb > 0)) {
            fill_kt(kt, krow, nb, t->hd);
            tile_scores(t, kt, S);
            for (int v = 0; v < t->nv; v++)
                for (int i = 0; i < ATT_BLOCK; i++) S[v][i] = i < nb ? S[v][i] + lnb : -INFINITY;
            tile_softmax(t, -(1 << 30), S, corr); /* (no causal limit applies) */
            tile_pv(t, S, corr, vrow, nb);
            nb = 0;
        }
    }
}

/* Queries [j0, j0 + qt) of sequence s, KV head g; bp: the sequence's block
 * choice when it runs block-sparse (the tile then lies in one query block). */
static void attend_tile(const lethe_attn_args *a, const lethe_cpu_bsp *bp, int s, int g, int32_t j0,
                        int qt) {
    att_tile t;
    t.a = a;
    t.G = a->n_heads / a->n_kv_heads;
    t.hd = a->head_dim;
    t.hg0 = g * t.G;
    const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
    /* per-KV-head selections: this KV head's own entries (varlen per head) */
    const int32_t *sb = a->head_sel_begin ? a->head_sel_begin + (size_t)s * a->n_kv_heads + g : a->sel_begin + s;
    const int32_t n_sel = sb[1] - sb[0];
    const int32_t *sel = (a->head_sel_begin ? a->head_sel_slots : a->sel_slots) + sb[0];
    qt = LETHE_MIN(qt, n_q - j0);
    t.row0 = a->q_begin[s] + j0;
    t.nv = qt * t.G;
    for (int r = 0; r < qt; r++) t.limit[r] = n_sel - n_q + j0 + r;
    for (int v = 0; v < t.nv; v++) {
        size_t off = ((size_t)(t.row0 + v / t.G) * a->n_heads + t.hg0 + v % t.G) * t.hd;
        t.q[v] = (const float *)a->q + off;
        t.out[v] = (float *)a->out + off;
        t.m[v] = -INFINITY;
        t.l[v] = 0.0f;
        memset(t.out[v], 0, (size_t)t.hd * sizeof(float));
    }
    const size_t kv_stride = (size_t)a->n_kv_heads * t.hd;
    const float *k_cache = a->k_cache, *v_cache = a->v_cache;
    static _Thread_local float kt[ATT_HEAD_DIM_MAX * ATT_BLOCK] __attribute__((aligned(32)));
    float S[VEC_MAX][ATT_BLOCK], corr[VEC_MAX];
    const float *vrow[ATT_BLOCK];
    const int32_t n_ent = t.limit[qt - 1] + 1;
    const int32_t B = bp ? a->bsp->block : 0;
    const uint8_t *keep = bp ? bp->keep + ((size_t)(j0 / B) * a->n_kv_heads + g) * bp->nkb : NULL;
    for (int32_t e0 = 0; e0 < n_ent; e0 += ATT_BLOCK) {
        if (keep && !keep[e0 / B]) continue; /* a skipped key block (B is a multiple of ATT_BLOCK) */
        const int nb = LETHE_MIN(ATT_BLOCK, n_ent - e0);
        const float *krow[ATT_BLOCK];
        for (int b = 0; b < nb; b++) {
            krow[b] = k_cache + (size_t)sel[e0 + b] * kv_stride + (size_t)g * t.hd;
            vrow[b] = v_cache + (size_t)sel[e0 + b] * kv_stride + (size_t)g * t.hd;
        }
        fill_kt(kt, krow, nb, t.hd);
        tile_scores(&t, kt, S);
        tile_softmax(&t, e0, S, corr);
        tile_pv(&t, S, corr, vrow, nb);
    }
    if (keep && a->bsp->mean_correction) attend_pseudo(&t, bp, keep, g, B, kt);
    for (int v = 0; v < t.nv; v++) {
        const float inv = 1.0f / t.l[v];
        for (int d = 0; d < t.hd; d++) t.out[v][d] *= inv;
    }
}

typedef struct att_job {
    const lethe_attn_args *a;
    int qt;
    const lethe_cpu_bsp *bsp;  /* [n_seqs] block choices, NULL = all dense */
} att_job;

/* items 4t .. 4t+3 of the (row, KV head) items; the row that starts a tile computes it */
static void att_task(void *ctx, int t, int worker) {
    const att_job *jb = ctx;
    const lethe_attn_args *a = jb->a;
    const int n_items = a->n_tokens * a->n_kv_heads;
    for (int it = 4 * t; it < LETHE_MIN(4 * t + 4, n_items); it++) {
        const int32_t i = it / a->n_kv_heads;
        const int g = it % a->n_kv_heads, s = seq_of_row(a, i);
        const int32_t j = i - a->q_begin[s];
        const lethe_cpu_bsp *bp = jb->bsp && jb->bsp[s].keep ? &jb->bsp[s] : NULL;
        if (!bp) {
            if (j % jb->qt == 0) attend_tile(a, NULL, s, g, j, jb->qt);
            continue;
        }
        /* block-sparse: tiles restart at every query block */
        const int32_t jb0 = j % a->bsp->block;
        if (jb0 % jb->qt == 0) attend_tile(a, bp, s, g, j, LETHE_MIN(jb->qt, a->bsp->block - jb0));
    }
}

void lethe_cpu_attention(lethe_backend *be, const lethe_attn_args *a) {
    if (!a->v_cache) { /* latent KV: mla.c */
        lethe_cpu_attention_latent(be, a);
        return;
    }
    if (a->kvq && a->kvq->format != LETHE_KV_NATIVE) { /* quantized KV: attention_quant.c */
        lethe_cpu_attention_quant(be, a);
        return;
    }
    lethe_check_attention(a);
    LETHE_ASSERT(a->n_heads / a->n_kv_heads <= ATT_GROUP_MAX);
    LETHE_ASSERT(a->head_dim > 0 && a->head_dim <= ATT_HEAD_DIM_MAX);
    const int G = a->n_heads / a->n_kv_heads;
    const int qt = LETHE_MAX(1, VEC_TARGET / G);
    /* one item per (row, KV head); the row that starts a tile computes the tile */
    const int n_items = a->n_tokens * a->n_kv_heads;
    const int nt = n_items < 2 ? 1 : lethe_cpu_threads(be);
    lethe_cpu_bsp *bsp = lethe_cpu_bsp_plan(a); /* attention_bsp.c; NULL without a->bsp */
    att_job j = {a, qt, bsp};
    lethe_cpu_parallel(be, nt, LETHE_CEIL_DIV(n_items, 4), att_task, &j);
    lethe_cpu_bsp_free(bsp, a->n_seqs);
}

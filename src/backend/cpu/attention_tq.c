/* attention_tq.c - KV store and attention over TurboQuant KV (CPU backend).
 *
 * The twin of backend/cuda/attention_tq.cu. Format (backend.h
 * LETHE_KV_TURBOQUANT, src/backend/tq_codec.h): per (slot, KV head) the b-bit
 * codes of the rotated unit vector [head_dim b / 8] in k_cache / v_cache and
 * its fp16 norm in kvq->k_norm / v_norm [n_slots, n_kv_heads]; kvq->tq holds
 * the rotation P [hd][hd], P^T, the 2^b centroids and the bounds.
 *
 * kv_store: lethe_tq_quant_vec per token, KV head, K and V (the reference
 * quantizer, so CPU codes ARE the reference codes).
 *
 * attention (same semantics as attention.c, lethe_attn_args) never leaves the
 * rotated basis for a key: work item = (sequence, KV head, tile of up to
 * TQ_QT queries); the tile's query vectors are rotated once (q' = P q, f32
 * fmaf chains), each block of TQ_BLOCK selection entries is decoded once
 * into rotated rows n16 c[code] [TQ_BLOCK][hd] for K and V, scores are
 * scale q' . k', an online softmax (running max / sum) accumulates o' =
 * sum p v' in the rotated basis, and at the end o = P^T o' / l. Equal to
 * dense attention over the dequantized KV (lethe_tq_dequant_vec) up to
 * float summation order (tests/test_kv_quant.c). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/tq_codec.h"
#include "core/util.h"

#define TQ_BLOCK 32
#define TQ_QT 8
#define TQ_GROUP_MAX 32
#define TQ_VEC_MAX (TQ_QT * TQ_GROUP_MAX)
#define TQ_D_MAX LETHE_TQ_HEAD_DIM_MAX

void lethe_cpu_kv_store_tq(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                           void *v_cache, const void *k, const void *v, const int32_t *slots,
                           int32_t n, int32_t n_kv_heads, int32_t head_dim) {
    const int32_t b = lethe_kv_tq_bits(kvq->format), hd = head_dim;
    const size_t cb = lethe_tq_code_bytes(hd, b), kv_dim = (size_t)n_kv_heads * hd;
    const float *rot = kvq->tq, *bounds = kvq->tq + lethe_tq_off_bounds(hd);
    uint16_t *kn = kvq->k_norm, *vn = kvq->v_norm;
    const float *kk = k, *vv = v;
    const int nt = n * n_kv_heads < 4 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int32_t it = 0; it < n * n_kv_heads; it++) {
        const int32_t i = it / n_kv_heads, h = it % n_kv_heads;
        LETHE_ASSERT(slots[i] >= 0);
        const size_t src = (size_t)i * kv_dim + (size_t)h * hd;
        const size_t row = (size_t)slots[i] * n_kv_heads + h;
        lethe_tq_quant_vec(kk + src, hd, b, rot, bounds, (uint8_t *)k_cache + row * cb, &kn[row]);
        lethe_tq_quant_vec(vv + src, hd, b, rot, bounds, (uint8_t *)v_cache + row * cb, &vn[row]);
    }
}

/* rotated row n16 c[code] of (slot, kv head g) into dst [hd] */
static inline void tq_row(float *dst, const uint8_t *codes, const uint16_t *norms,
                          const float *cent, int32_t slot, int g, int n_kv, int hd, int b) {
    const size_t row = (size_t)slot * n_kv + g;
    const uint8_t *c = codes + row * lethe_tq_code_bytes(hd, b);
    const float nn = lethe_f16_to_f32(norms[row]);
    for (int d = 0; d < hd; d++) dst[d] = nn * cent[lethe_tq_code(c, d, b)];
}

static inline float dotf(const float *a, const float *b, int n) { /* hd % 8 == 0 */
    __m256 acc = _mm256_setzero_ps();
    for (int d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

/* o = o * c + sum_j p[j] * V[j] */
static inline void pv(float *o, float c, const float *p, const float *vb, int nb, int hd) {
    for (int d = 0; d < hd; d += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(c));
        for (int j = 0; j < nb; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vb + (size_t)j * hd + d), acc);
        _mm256_storeu_ps(o + d, acc);
    }
}

static int qseq_of_row(const lethe_attn_args *a, int32_t i) {
    int lo = 0, hi = a->n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (a->q_begin[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* queries [j0, j0 + qt) of sequence s, KV head g */
static void tq_tile(const lethe_attn_args *a, int s, int g, int32_t j0, int qt) {
    const lethe_kv_quant *kq = a->kvq;
    const int G = a->n_heads / a->n_kv_heads, hd = a->head_dim, n_kv = a->n_kv_heads;
    const int b = lethe_kv_tq_bits(kq->format);
    const float *rot = kq->tq, *cent = kq->tq + lethe_tq_off_centroids(hd);
    const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
    const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
    const int32_t *sel = a->sel_slots + a->sel_begin[s];
    qt = LETHE_MIN(qt, n_q - j0);
    const int32_t row0 = a->q_begin[s] + j0;
    const int nv = qt * G;
    static _Thread_local float kb[TQ_BLOCK * TQ_D_MAX], vb[TQ_BLOCK * TQ_D_MAX];
    static _Thread_local float qr[TQ_VEC_MAX * TQ_D_MAX], orot[TQ_VEC_MAX * TQ_D_MAX];
    float m[TQ_VEC_MAX], l[TQ_VEC_MAX], p[TQ_BLOCK];
    int32_t limit[TQ_QT];
    for (int r = 0; r < qt; r++) limit[r] = n_sel - n_q + j0 + r;
    for (int v = 0; v < nv; v++) { /* q' = P q */
        const float *q = (const float *)a->q + ((size_t)(row0 + v / G) * a->n_heads + (size_t)g * G + v % G) * hd;
        float *o = qr + (size_t)v * hd;
        for (int i = 0; i < hd; i++) o[i] = dotf(rot + (size_t)i * hd, q, hd);
        m[v] = -INFINITY;
        l[v] = 0.0f;
        memset(orot + (size_t)v * hd, 0, (size_t)hd * sizeof(float));
    }
    const int32_t n_ent = limit[qt - 1] + 1;
    for (int32_t e0 = 0; e0 < n_ent; e0 += TQ_BLOCK) {
        const int nb = LETHE_MIN(TQ_BLOCK, n_ent - e0);
        for (int j = 0; j < nb; j++) {
            tq_row(kb + (size_t)j * hd, a->k_cache, kq->k_norm, cent, sel[e0 + j], g, n_kv, hd, b);
            tq_row(vb + (size_t)j * hd, a->v_cache, kq->v_norm, cent, sel[e0 + j], g, n_kv, hd, b);
        }
        for (int v = 0; v < nv; v++) {
            const int32_t lim = limit[v / G];
            if (e0 > lim) continue;
            const int nbv = LETHE_MIN(nb, lim - e0 + 1);
            float mb = m[v];
            for (int j = 0; j < nbv; j++) {
                p[j] = a->scale * dotf(qr + (size_t)v * hd, kb + (size_t)j * hd, hd);
                mb = fmaxf(mb, p[j]);
            }
            const float corr = m[v] == -INFINITY ? 0.0f : expf(m[v] - mb);
            float sum = 0.0f;
            for (int j = 0; j < nbv; j++) {
                p[j] = expf(p[j] - mb);
                sum += p[j];
            }
            m[v] = mb;
            l[v] = l[v] * corr + sum;
            pv(orot + (size_t)v * hd, corr, p, vb, nbv, hd);
        }
    }
    for (int v = 0; v < nv; v++) { /* o = P^T o' / l */
        float *out = (float *)a->out + ((size_t)(row0 + v / G) * a->n_heads + (size_t)g * G + v % G) * hd;
        const float *o = orot + (size_t)v * hd, inv = 1.0f / l[v];
        for (int j = 0; j < hd; j++) out[j] = 0.0f;
        for (int i = 0; i < hd; i++) {
            const float *r = rot + (size_t)i * hd;
            for (int j = 0; j < hd; j++) out[j] = fmaf(r[j], o[i], out[j]);
        }
        for (int j = 0; j < hd; j++) out[j] *= inv;
    }
}

void lethe_cpu_attention_tq(lethe_backend *be, const lethe_attn_args *a) {
    lethe_check_attention_quant(a);
    LETHE_ASSERT(a->n_heads / a->n_kv_heads <= TQ_GROUP_MAX && a->head_dim <= TQ_D_MAX);
    const int n_items = a->n_tokens * a->n_kv_heads;
    const int nt = n_items < 2 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
    for (int it = 0; it < n_items; it++) {
        const int32_t i = it / a->n_kv_heads;
        const int g = it % a->n_kv_heads, s = qseq_of_row(a, i);
        const int32_t j = i - a->q_begin[s];
        if (j % TQ_QT == 0) tq_tile(a, s, g, j, TQ_QT);
    }
}

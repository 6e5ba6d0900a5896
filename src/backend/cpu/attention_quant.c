/* attention_quant.c - KV store and attention over QUANTIZED KV (CPU backend).
 *
 * The twin of backend/cuda/attention_quant.cu. Formats are backend.h's
 * lethe_kv_format; this file reads them directly, nothing is dequantized into
 * the pool:
 *   FP8_E4M3  K/V caches: uint8 codes [n_slots, n_kv_heads, head_dim];
 *             kvq->k_scale / v_scale: f32 [n_slots, n_kv_heads];
 *             x^ = e4m3(code) * scale (src/backend/kv_codec.h).
 *   KIVI      packed b-bit codes per slot + V group params per slot + K group
 *             table + f32 residual, addressed through the host slot index
 *             kvq->kivi->slot_aux (backend.h); kv_store_quant packs the
 *             groups the method's plan completes (kv_codec.c reference quantizers)
 *             and writes the other new tokens to the residual.
 *
 * kv_store_quant: per token and KV head, lethe_fp8_quant_vec (the reference
 * quantizer of src/backend/kv_codec.c, so CPU codes ARE the reference codes).
 *
 * attention (same semantics as attention.c, lethe_attn_args): work item =
 * (sequence, KV head, tile of up to QA_QT consecutive queries); the tile's
 * QA_QT x G query vectors share each block of QA_BLOCK selection entries,
 * whose K and V rows are dequantized once into thread-local f32 buffers
 * [QA_BLOCK][head_dim] (registers / L1 on a CPU), then scores, an online
 * softmax (running max / sum, rescale by exp(m_old - m_new)) and P V follow in
 * fp32. Entries beyond a query's causal limit get probability 0. The result
 * equals dense attention over the dequantized KV up to float summation order
 * (tests/test_kv_quant.c checks it against lethe_cpu_attention). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/kv_codec.h"
#include "core/util.h"

#define QA_BLOCK 32
#define QA_QT 8            /* queries per tile */
#define QA_GROUP_MAX 32
#define QA_HEAD_DIM_MAX 512
#define QA_VEC_MAX (QA_QT * QA_GROUP_MAX)

/* KIVI store: pack the plan's completed groups (reference quantizers of
 * kv_codec.c, so CPU codes ARE the reference codes), then write the new tokens
 * that stay in the residual (f32 on the CPU backend). */
static void kivi_store(const lethe_kv_quant *kvq, uint8_t *kc, uint8_t *vc, const float *k,
                       const float *v, const int32_t *slots, int32_t n, int32_t C) {
    lethe_check_kv_store_kivi(kvq, n, C);
    const lethe_kivi_plan *pl = kvq->kivi;
    const int32_t b = lethe_kv_kivi_bits(kvq->format), G = lethe_kv_kivi_group(kvq->format);
    const size_t cb = lethe_kivi_code_bytes(C, b), np = (size_t)C / (size_t)G;
    float *kres = kvq->k_res, *vres = kvq->v_res, *kgrp = kvq->k_group, *vpar = kvq->v_param;
    float *tmp = lethe_xmalloc((size_t)G * C * sizeof(float));
    uint8_t *codes = lethe_xmalloc((size_t)G * cb);
    for (int32_t p = 0; p < pl->n_pack; p++) {
        const int32_t *src = pl->pack_src + (size_t)p * G, *dst = pl->pack_slot + (size_t)p * G;
        const int32_t e = pl->pack_entry[p];
        for (int32_t j = 0; j < G; j++) {
            const float *kr = src[j] >= 0 ? k + (size_t)src[j] * C : kres + (size_t)(-1 - src[j]) * C;
            memcpy(tmp + (size_t)j * C, kr, (size_t)C * sizeof(float));
        }
        float *ks = kgrp + (size_t)e * 2 * C;
        lethe_kivi_quant_keys(tmp, G, C, b, codes, ks, ks + C);
        for (int32_t j = 0; j < G; j++) {
            memcpy(kc + (size_t)dst[j] * cb, codes + (size_t)j * cb, cb);
            const float *vr = src[j] >= 0 ? v + (size_t)src[j] * C : vres + (size_t)(-1 - src[j]) * C;
            float *vp = vpar + (size_t)dst[j] * 2 * np;
            lethe_kivi_quant_value(vr, C, G, b, vc + (size_t)dst[j] * cb, vp, vp + np);
        }
    }
    for (int32_t i = 0; i < n; i++) {
        const int32_t aux = pl->slot_aux[slots[i]];
        LETHE_ASSERT(aux != INT32_MIN);
        if (aux >= 0) continue; /* packed above */
        const size_t r = (size_t)(-1 - aux);
        LETHE_ASSERT(r < (size_t)kvq->n_res);
        memcpy(kres + r * C, k + (size_t)i * C, (size_t)C * sizeof(float));
        memcpy(vres + r * C, v + (size_t)i * C, (size_t)C * sizeof(float));
    }
    free(codes);
    free(tmp);
}

void lethe_cpu_kv_store_quant(lethe_backend *be, const lethe_kv_quant *kvq, void *k_cache,
                              void *v_cache, const void *k, const void *v, const int32_t *slots,
                              int32_t n, int32_t n_kv_heads, int32_t head_dim) {
    if (kvq && lethe_kv_format_kind(kvq->format) == LETHE_KV_KIVI) {
        kivi_store(kvq, k_cache, v_cache, k, v, slots, n, n_kv_heads * head_dim);
        return;
    }
    if (kvq && lethe_kv_format_kind(kvq->format) == LETHE_KV_TURBOQUANT) {
        lethe_cpu_kv_store_tq(be, kvq, k_cache, v_cache, k, v, slots, n, n_kv_heads, head_dim);
        return;
    }
    LETHE_ASSERT(kvq && kvq->format == LETHE_KV_FP8_E4M3);
    const size_t kv_dim = (size_t)n_kv_heads * (size_t)head_dim;
    uint8_t *kc = k_cache, *vc = v_cache;
    float *ks = kvq->k_scale, *vs = kvq->v_scale;
    const float *kk = k, *vv = v;
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(slots[i] >= 0);
        for (int32_t h = 0; h < n_kv_heads; h++) {
            const size_t src = (size_t)i * kv_dim + (size_t)h * head_dim;
            const size_t dst = (size_t)slots[i] * kv_dim + (size_t)h * head_dim;
            const size_t sc = (size_t)slots[i] * n_kv_heads + h;
            lethe_fp8_quant_vec(kk + src, head_dim, kc + dst, &ks[sc]);
            lethe_fp8_quant_vec(vv + src, head_dim, vc + dst, &vs[sc]);
        }
    }
}

/* E4M3 code -> float, exactly lethe_fp8_e4m3_to_float for every code the
 * quantizer emits (it never stores the NaN code 0x7F / 0xFF). */
static inline float e4m3_value(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
    float v;
    if (e) {
        uint32_t bits = ((e + 120u) << 23) | (m << 20); /* 2^(e-7) * (1 + m/8) */
        memcpy(&v, &bits, sizeof(v));
    } else {
        v = (float)m * 0x1p-9f;
    }
    return (b & 0x80) ? -v : v;
}

/* dequantizes row (slot, kv head g) of one cache into dst[hd] */
static inline void fp8_row(float *dst, const uint8_t *codes, const float *scales, int32_t slot,
                           int g, int n_kv, int hd) {
    const uint8_t *c = codes + ((size_t)slot * n_kv + g) * hd;
    const float s = scales[(size_t)slot * n_kv + g];
    for (int d = 0; d < hd; d++) dst[d] = e4m3_value(c[d]) * s;
}

/* KIVI: dequantizes K and V rows (slot, kv head g) into kd / vd [hd] (the
 * formula of lethe_kivi_dequant_keys / _value), or copies the residual */
static inline void kivi_rows(float *kd, float *vd, const lethe_kv_quant *q, const uint8_t *kc,
                             const uint8_t *vc, int32_t slot, int g, int n_kv, int hd) {
    const int32_t aux = q->kivi->slot_aux[slot];
    const size_t C = (size_t)n_kv * hd, c0 = (size_t)g * hd;
    if (aux < 0) {
        const size_t r = (size_t)(-1 - aux);
        memcpy(kd, (const float *)q->k_res + r * C + c0, (size_t)hd * sizeof(float));
        memcpy(vd, (const float *)q->v_res + r * C + c0, (size_t)hd * sizeof(float));
        return;
    }
    const int32_t b = lethe_kv_kivi_bits(q->format), G = lethe_kv_kivi_group(q->format);
    const size_t cb = lethe_kivi_code_bytes((int32_t)C, b), np = C / (size_t)G;
    const float *ks = (const float *)q->k_group + (size_t)aux * 2 * C, *kz = ks + C;
    const float *vp = (const float *)q->v_param + (size_t)slot * 2 * np, *vz = vp + np;
    const uint8_t *kr = kc + (size_t)slot * cb, *vr = vc + (size_t)slot * cb;
    for (int d = 0; d < hd; d++) {
        const int32_t c = (int32_t)c0 + d;
        kd[d] = (float)lethe_code_get(kr, c, b) * ks[c] + kz[c];
        vd[d] = (float)lethe_code_get(vr, c, b) * vp[c / G] + vz[c / G];
    }
}

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    float r = _mm_cvtss_f32(h);
    for (; d < n; d++) r = fmaf(a[d], b[d], r);
    return r;
}

/* o = o * c + sum_b p[b] * V[b] */
static inline void pv(float *o, float c, const float *p, const float *vb, int nb, int hd) {
    int d = 0;
    for (; d + 8 <= hd; d += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(c));
        for (int b = 0; b < nb; b++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[b]), _mm256_loadu_ps(vb + (size_t)b * hd + d), acc);
        _mm256_storeu_ps(o + d, acc);
    }
    for (; d < hd; d++) {
        float acc = o[d] * c;
        for (int b = 0; b < nb; b++) acc = fmaf(p[b], vb[(size_t)b * hd + d], acc);
        o[d] = acc;
    }
}

static int qseq_of_row(const lethe_attn_args *a, int32_t i) {
    int lo = 0, hi = a->n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (a->q_begin[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* queries [j0, j0 + qt) of sequence s, KV head g */
static void qattend_tile(const lethe_attn_args *a, int s, int g, int32_t j0, int qt) {
    const int G = a->n_heads / a->n_kv_heads, hd = a->head_dim, n_kv = a->n_kv_heads;
    const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
    const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
    const int32_t *sel = a->sel_slots + a->sel_begin[s];
    qt = LETHE_MIN(qt, n_q - j0);
    const int32_t row0 = a->q_begin[s] + j0;
    const int nv = qt * G;
    static _Thread_local float kb[QA_BLOCK * QA_HEAD_DIM_MAX], vb[QA_BLOCK * QA_HEAD_DIM_MAX];
    float m[QA_VEC_MAX], l[QA_VEC_MAX], p[QA_BLOCK];
    const float *q[QA_VEC_MAX];
    float *out[QA_VEC_MAX];
    int32_t limit[QA_QT];
    for (int r = 0; r < qt; r++) limit[r] = n_sel - n_q + j0 + r;
    for (int v = 0; v < nv; v++) {
        const size_t off = ((size_t)(row0 + v / G) * a->n_heads + (size_t)g * G + v % G) * hd;
        q[v] = (const float *)a->q + off;
        out[v] = (float *)a->out + off;
        m[v] = -INFINITY;
        l[v] = 0.0f;
        memset(out[v], 0, (size_t)hd * sizeof(float));
    }
    const uint8_t *kc = a->k_cache, *vc = a->v_cache;
    const float *ks = a->kvq->k_scale, *vs = a->kvq->v_scale;
    const bool kivi = lethe_kv_format_kind(a->kvq->format) == LETHE_KV_KIVI;
    const int32_t n_ent = limit[qt - 1] + 1;
    for (int32_t e0 = 0; e0 < n_ent; e0 += QA_BLOCK) {
        const int nb = LETHE_MIN(QA_BLOCK, n_ent - e0);
        for (int b = 0; b < nb; b++) {
            if (kivi) {
                kivi_rows(kb + (size_t)b * hd, vb + (size_t)b * hd, a->kvq, kc, vc, sel[e0 + b], g, n_kv, hd);
            } else {
                fp8_row(kb + (size_t)b * hd, kc, ks, sel[e0 + b], g, n_kv, hd);
                fp8_row(vb + (size_t)b * hd, vc, vs, sel[e0 + b], g, n_kv, hd);
            }
        }
        for (int v = 0; v < nv; v++) {
            const int32_t lim = limit[v / G];
            if (e0 > lim) continue; /* the whole block is beyond this query */
            const int nbv = LETHE_MIN(nb, lim - e0 + 1);
            float mb = m[v];
            for (int b = 0; b < nbv; b++) {
                p[b] = a->scale * dot(q[v], kb + (size_t)b * hd, hd);
                mb = fmaxf(mb, p[b]);
            }
            const float corr = m[v] == -INFINITY ? 0.0f : expf(m[v] - mb);
            float sum = 0.0f;
            for (int b = 0; b < nbv; b++) {
                p[b] = expf(p[b] - mb);
                sum += p[b];
            }
            m[v] = mb;
            l[v] = l[v] * corr + sum;
            pv(out[v], corr, p, vb, nbv, hd);
        }
    }
    for (int v = 0; v < nv; v++) {
        const float inv = 1.0f / l[v];
        for (int d = 0; d < hd; d++) out[v][d] *= inv;
    }
}

typedef struct qatt_job {
    const lethe_attn_args *a;
    int qt;
} qatt_job;

/* items 4t .. 4t+3 of the (row, KV head) items; the row that starts a tile computes it */
static void qatt_task(void *ctx, int t, int worker) {
    const qatt_job *jb = ctx;
    const lethe_attn_args *a = jb->a;
    const int n_items = a->n_tokens * a->n_kv_heads;
    for (int it = 4 * t; it < LETHE_MIN(4 * t + 4, n_items); it++) {
        const int32_t i = it / a->n_kv_heads;
        const int g = it % a->n_kv_heads, s = qseq_of_row(a, i);
        const int32_t j = i - a->q_begin[s];
        if (j % jb->qt == 0) qattend_tile(a, s, g, j, jb->qt);
    }
}

void lethe_cpu_attention_quant(lethe_backend *be, const lethe_attn_args *a) {
    if (a->kvq && lethe_kv_format_kind(a->kvq->format) == LETHE_KV_TURBOQUANT) {
        lethe_cpu_attention_tq(be, a);
        return;
    }
    lethe_check_attention_quant(a);
    LETHE_ASSERT(a->n_heads / a->n_kv_heads <= QA_GROUP_MAX);
    LETHE_ASSERT(a->head_dim > 0 && a->head_dim <= QA_HEAD_DIM_MAX);
    const int n_items = a->n_tokens * a->n_kv_heads;
    const int nt = n_items < 2 ? 1 : lethe_cpu_threads(be);
    qatt_job j = {a, QA_QT};
    lethe_cpu_parallel(be, nt, LETHE_CEIL_DIV(n_items, 4), qatt_task, &j);
}

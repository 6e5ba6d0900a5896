/* select_util.c - head reduction, keep sets, window scores, pooling, Quest
 * page bounds and budget schedules (see select_util.h for shapes).
 *
 * These are the CPU references of the selection ops: plain loops, written for
 * clarity and exact reproducibility (the ordering of lethe_rank_before is the
 * only tie rule anywhere in lethe's sparse code). */
#include "sparse/select_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "core/util.h"

/* ---- reductions ---- */

static float reduce_init(lethe_reduce op) { return op == LETHE_REDUCE_MAX ? -INFINITY : 0.0f; }

static float reduce_step(lethe_reduce op, float acc, float x) {
    if (op == LETHE_REDUCE_MAX) return x > acc ? x : acc;
    return acc + x;
}

void lethe_reduce_heads(const float *in, int32_t n_heads, int32_t n, size_t stride,
                        lethe_reduce op, float *out) {
    LETHE_ASSERT(n_heads > 0 && stride >= (size_t)n);
    for (int32_t j = 0; j < n; j++) {
        float a = reduce_init(op);
        for (int32_t h = 0; h < n_heads; h++) a = reduce_step(op, a, in[(size_t)h * stride + j]);
        out[j] = op == LETHE_REDUCE_MEAN ? a / (float)n_heads : a;
    }
}

void lethe_reduce_gqa(const float *in, int32_t n_heads, int32_t n_kv_heads, int32_t n,
                      size_t stride, lethe_reduce op, float *out) {
    LETHE_ASSERT(n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    int32_t g = n_heads / n_kv_heads;
    for (int32_t kh = 0; kh < n_kv_heads; kh++)
        lethe_reduce_heads(in + (size_t)kh * g * stride, g, n, stride, op, out + (size_t)kh * n);
}

/* ---- keep sets ---- */

int32_t lethe_keep_sink_recent_topk(const float *scores, const uint8_t *pin, int32_t L,
                                    int32_t s, int32_t r, int32_t k, int32_t *keep) {
    LETHE_ASSERT(L >= 0 && s >= 0 && r >= 0 && k >= 0);
    if ((int64_t)s + k + r >= L) {
        for (int32_t i = 0; i < L; i++) keep[i] = i;
        return L;
    }
    LETHE_ASSERT(scores || k == 0);
    int32_t m0 = s, m1 = L - r; /* middle [m0, m1), non-empty here */
    int32_t n = 0;
    for (int32_t i = 0; i < s; i++) keep[n++] = i;
    int32_t n_pin = 0;
    if (pin)
        for (int32_t j = m0; j < m1; j++) n_pin += pin[j] != 0;
    int32_t k_free = k > n_pin ? k - n_pin : 0;
    if (k_free > 0) {
        /* rank only the unpinned middle: pinned ones get -INF-below (skipped) */
        float *ms = lethe_xmalloc((size_t)(m1 - m0) * sizeof(*ms));
        for (int32_t j = m0; j < m1; j++) ms[j - m0] = (pin && pin[j]) ? NAN : scores[j];
        int32_t *top = lethe_xmalloc((size_t)k_free * sizeof(*top));
        int32_t nt = lethe_topk_indices(ms, m1 - m0, k_free, top);
        /* merge the pinned positions and the top set in ascending order */
        int32_t t = 0;
        for (int32_t j = m0; j < m1; j++) {
            bool take = pin && pin[j];
            if (t < nt && top[t] + m0 == j) {
                if (!(pin && pin[j])) take = true;
                t++;
            }
            if (take) keep[n++] = j;
        }
        free(top);
        free(ms);
    } else if (n_pin > 0) {
        for (int32_t j = m0; j < m1; j++)
            if (pin[j]) keep[n++] = j;
    }
    for (int32_t i = m1; i < L; i++) keep[n++] = i;
    return n;
}

/* ---- window scores ---- */

void lethe_window_scores(const float *raw, int32_t n_heads, size_t head_stride,
                         size_t row_stride, int32_t n_rows, int32_t n_ent, int32_t c0,
                         int32_t c1, lethe_score_mode mode, bool cand_denominator,
                         lethe_reduce head_op, float *out) {
    LETHE_ASSERT(0 <= c0 && c0 <= c1 && c1 <= n_ent && n_rows >= 0);
    int32_t nc = c1 - c0;
    if (mode == LETHE_SCORE_LOGITS) {
        for (int32_t j = 0; j < nc; j++) out[j] = -INFINITY;
        for (int32_t h = 0; h < n_heads; h++)
            for (int32_t i = 0; i < n_rows; i++) {
                const float *row = raw + (size_t)h * head_stride + (size_t)i * row_stride;
                for (int32_t j = 0; j < nc; j++)
                    if (row[c0 + j] > out[j]) out[j] = row[c0 + j];
            }
        return;
    }
    /* probability: per head, mean over rows of the softmax mass; then heads */
    float *ph = lethe_xcalloc((size_t)(nc > 0 ? nc : 1), sizeof(float));
    for (int32_t j = 0; j < nc; j++) out[j] = reduce_init(head_op);
    int32_t d0 = cand_denominator ? c0 : 0, d1 = cand_denominator ? c1 : n_ent;
    for (int32_t h = 0; h < n_heads; h++) {
        memset(ph, 0, (size_t)nc * sizeof(float));
        for (int32_t i = 0; i < n_rows; i++) {
            const float *row = raw + (size_t)h * head_stride + (size_t)i * row_stride;
            double m = -INFINITY, l = 0.0;
            for (int32_t e = d0; e < d1; e++)
                if (row[e] > m) m = row[e];
            if (m == -INFINITY) continue; /* no visible key in the denominator */
            for (int32_t e = d0; e < d1; e++) l += exp((double)row[e] - m);
            for (int32_t j = 0; j < nc; j++) ph[j] += (float)(exp((double)row[c0 + j] - m) / l);
        }
        for (int32_t j = 0; j < nc; j++)
            out[j] = reduce_step(head_op, out[j], n_rows > 0 ? ph[j] / (float)n_rows : 0.0f);
    }
    if (head_op == LETHE_REDUCE_MEAN)
        for (int32_t j = 0; j < nc; j++) out[j] /= (float)n_heads;
    free(ph);
}

void lethe_score_accumulate(float *acc, const float *x, int32_t n, lethe_reduce op) {
    LETHE_ASSERT(op == LETHE_REDUCE_MAX || op == LETHE_REDUCE_SUM);
    for (int32_t i = 0; i < n; i++) acc[i] = reduce_step(op, acc[i], x[i]);
}

void lethe_softmax_inplace(float *x, int32_t n) {
    float m = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    if (m == -INFINITY) {
        for (int32_t i = 0; i < n; i++) x[i] = 0.0f;
        return;
    }
    double l = 0.0;
    for (int32_t i = 0; i < n; i++) l += exp((double)x[i] - m);
    for (int32_t i = 0; i < n; i++) x[i] = (float)(exp((double)x[i] - m) / l);
}

void lethe_pool1d(const float *in, int32_t n, int32_t k, lethe_reduce op, float *out) {
    LETHE_ASSERT(in != out && (op == LETHE_REDUCE_MAX || op == LETHE_REDUCE_MEAN));
    if (k <= 1) {
        memcpy(out, in, (size_t)n * sizeof(float));
        return;
    }
    int32_t pad = k / 2;
    for (int32_t j = 0; j < n; j++) {
        float a = reduce_init(op);
        for (int32_t t = j - pad; t < j - pad + k; t++) {
            if (t < 0 || t >= n) continue; /* MAX: -INF pad; MEAN: zero pad */
            a = reduce_step(op, a, in[t]);
        }
        out[j] = op == LETHE_REDUCE_MEAN ? a / (float)k : a;
    }
}

void lethe_gather_f32(float *dst, const float *src, const int32_t *keep, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(keep[i] >= i);
        dst[i] = src[keep[i]];
    }
}

/* ---- Quest ---- */

void lethe_page_minmax_add(float *kmin, float *kmax, const float *k, int32_t kv_dim, bool first) {
    if (first) {
        memcpy(kmin, k, (size_t)kv_dim * sizeof(float));
        memcpy(kmax, k, (size_t)kv_dim * sizeof(float));
        return;
    }
    for (int32_t c = 0; c < kv_dim; c++) {
        if (k[c] < kmin[c]) kmin[c] = k[c];
        if (k[c] > kmax[c]) kmax[c] = k[c];
    }
}

void lethe_page_minmax_build(const float *keys, int32_t n, int32_t kv_dim, int32_t P,
                             float *kmin, float *kmax) {
    LETHE_ASSERT(P > 0);
    for (int32_t t = 0; t < n; t++) {
        size_t p = (size_t)(t / P) * (size_t)kv_dim;
        lethe_page_minmax_add(kmin + p, kmax + p, keys + (size_t)t * kv_dim, kv_dim, t % P == 0);
    }
}

void lethe_quest_page_scores(const float *q, int32_t n_heads, int32_t n_kv_heads,
                             int32_t head_dim, const float *kmin, const float *kmax,
                             int32_t n_pages, float *out) {
    lethe_quest_page_scores_grouped(q, n_heads, n_kv_heads, head_dim, kmin, kmax, n_pages, 1, out);
}

void lethe_quest_page_scores_grouped(const float *q, int32_t n_heads, int32_t n_kv_heads,
                                     int32_t head_dim, const float *kmin, const float *kmax,
                                     int32_t n_pages, int32_t n_groups, float *out) {
    LETHE_ASSERT(n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    LETHE_ASSERT(n_groups == 1 || n_groups == n_kv_heads);
    int32_t g = n_heads / n_kv_heads, per_group = n_heads / n_groups;
    size_t kv_dim = (size_t)n_kv_heads * head_dim;
    for (int32_t p = 0; p < n_pages; p++) {
        float best = -INFINITY;
        for (int32_t h = 0; h < n_heads; h++) {
            const float *qh = q + (size_t)h * head_dim;
            const float *mn = kmin + p * kv_dim + (size_t)(h / g) * head_dim;
            const float *mx = kmax + p * kv_dim + (size_t)(h / g) * head_dim;
            float u = 0.0f;
            for (int32_t c = 0; c < head_dim; c++) {
                float a = qh[c] * mx[c], b = qh[c] * mn[c];
                u += a > b ? a : b;
            }
            if (u > best) best = u;
            if ((h + 1) % per_group == 0) {
                out[(size_t)(h / per_group) * n_pages + p] = best;
                best = -INFINITY;
            }
        }
    }
}

int32_t lethe_quest_select_pages(const float *scores, int32_t n_pages, int32_t K, int32_t *out) {
    LETHE_ASSERT(K >= 1 && n_pages >= 1);
    if (K >= n_pages) {
        for (int32_t p = 0; p < n_pages; p++) out[p] = p;
        return n_pages;
    }
    int32_t n = lethe_topk_indices(scores, n_pages - 1, K - 1, out);
    out[n++] = n_pages - 1;
    return n;
}

/* ---- budgets ---- */

void lethe_pyramid_budgets(int32_t n_layers, int32_t s, int32_t keep, int32_t r,
                           float start_ratio, float least_ratio, int32_t *budget) {
    LETHE_ASSERT(n_layers > 0 && start_ratio > 0.0f && least_ratio >= 0.0f);
    for (int32_t l = 0; l < n_layers; l++) {
        double t = n_layers > 1 ? (double)l / (double)(n_layers - 1) : 0.0;
        double ratio = (double)start_ratio + t * ((double)least_ratio - (double)start_ratio);
        budget[l] = s + (int32_t)floor((double)keep * ratio / (double)start_ratio) + r;
    }
}

void lethe_pyramid_budgets_original(int32_t n_layers, int32_t C, int32_t w, int32_t beta,
                                    int32_t L, int32_t *prefix_budget) {
    LETHE_ASSERT(n_layers > 0 && C > w && beta > 0);
    double base = (double)(C - w);
    if ((double)L < 2.0 * base || n_layers == 1) {
        for (int32_t l = 0; l < n_layers; l++) prefix_budget[l] = C - w;
        return;
    }
    double mn = base / beta, mx = 2.0 * base - mn;
    if (mx >= (double)(L - w)) {
        mx = (double)(L - w);
        mn = 2.0 * base - mx;
    }
    double step = (mx - mn) / (double)(n_layers - 1);
    for (int32_t l = 0; l < n_layers; l++) prefix_budget[l] = (int32_t)lround(mx - l * step);
}

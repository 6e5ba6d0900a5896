/* select_util.h - shared selection machinery of the sparse methods, on host arrays.
 *
 * Every sparse method decides which KV rows to keep (eviction) or to read
 * (selection) from per-token scores. The pieces they share live here, as pure
 * functions over plain host arrays with explicit shapes, so that each has a
 * CUDA twin with the same signature shape (see the list in docs/sparse-methods.md):
 *
 *   top-k            backend/topk.h (lethe_topk_indices, lethe_rank_before):
 *                    higher score first, ties -> smaller index, NaN last
 *   head reduction   [H, n] -> [n] (max / mean / sum) and GQA [H, n] -> [Hk, n]
 *   keep sets        sink [0,s) + top-k of the middle + recent [L-r, L), sorted
 *   window scores    raw q.k logits of observation-window queries -> per-key
 *                    score (logits: max; probability: softmax mass), then
 *                    accumulated across prefill chunks (max or sum)
 *   pooling          1-D max / avg pool, kernel k, padding k/2, stride 1
 *   Quest pages      per-page elementwise key min/max and the page upper
 *                    bound U_p = sum_c max(q_c M_c, q_c m_c)
 *
 * Indices are int32 positions within one request's row for one layer; scores
 * are float32. NaN scores rank below every number. Nothing here allocates
 * except the keep-set and page choices' top-k scratch (lethe_topk_indices). */
#ifndef LETHE_SPARSE_SELECT_UTIL_H
#define LETHE_SPARSE_SELECT_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/topk.h" /* lethe_rank_before, lethe_topk_indices */

typedef enum lethe_reduce {
    LETHE_REDUCE_MAX = 0,
    LETHE_REDUCE_MEAN,
    LETHE_REDUCE_SUM,
} lethe_reduce;

typedef enum lethe_score_mode {
    LETHE_SCORE_LOGITS = 0,     /* max raw logit over window rows and heads */
    LETHE_SCORE_PROBABILITY,    /* per head mean over rows of softmax probability, then heads */
} lethe_score_mode;

/* Head reduction: in [n_heads, n] (row stride `stride` >= n) -> out [n]. */
void lethe_reduce_heads(const float *in, int32_t n_heads, int32_t n, size_t stride,
                        lethe_reduce op, float *out);

/* GQA reduction: in [n_heads, n] -> out [n_kv_heads, n], reducing the
 * g = n_heads / n_kv_heads query heads of each KV group (methods.md §2.3 (b)). */
void lethe_reduce_gqa(const float *in, int32_t n_heads, int32_t n_kv_heads, int32_t n,
                      size_t stride, lethe_reduce op, float *out);

/* Keep set of one row of length L: sink [0, s), recent [L - r, L), and the
 * top-k (by scores[j], j in [s, L - r)) of the middle; `pin` (optional, [L],
 * non-zero = protected) forces middle tokens in, and they count against k.
 * scores may be NULL (position-only: StreamingLLM) when k == 0.
 * If L <= s + k + r every position is kept. Writes ascending positions to
 * keep (capacity >= min(L, s + k + r) + number of pinned middle tokens) and
 * returns the count. */
int32_t lethe_keep_sink_recent_topk(const float *scores, const uint8_t *pin, int32_t L,
                                    int32_t s, int32_t r, int32_t k, int32_t *keep);

/* Window scores of ONE sequence from the backend's raw score output.
 * raw(h, i, e) = raw[h * head_stride + i * row_stride + e]: scale * q_i,h . k_e for
 * window row i in [0, n_rows) and selection entry e in [0, n_ent); -INF past
 * the causal limit. Candidates are entries [c0, c1). Writes out[c1 - c0]:
 *   LOGITS:      out[j] = max over h, i of raw(h, i, c0 + j)
 *   PROBABILITY: p(h,i,e) = softmax over e of raw(h, i, .), the denominator
 *                spanning [c0, c1) when cand_denominator (the anchor) or all of
 *                [0, n_ent) otherwise (original SnapKV); per head the mean over
 *                rows, then `head_op` over heads (the anchor: max). */
void lethe_window_scores(const float *raw, int32_t n_heads, size_t head_stride,
                         size_t row_stride, int32_t n_rows, int32_t n_ent, int32_t c0,
                         int32_t c1, lethe_score_mode mode, bool cand_denominator,
                         lethe_reduce head_op, float *out);

/* acc[i] = op(acc[i], x[i]) for i < n, op = MAX or SUM (MEAN is refused). */
void lethe_score_accumulate(float *acc, const float *x, int32_t n, lethe_reduce op);

/* In-place softmax over x[0..n) (the max is subtracted; -INF entries get 0). */
void lethe_softmax_inplace(float *x, int32_t n);

/* 1-D pooling along j, kernel k (odd or even), padding k/2, stride 1,
 * output length n (extra trailing output of even k dropped). MAX pads with
 * -INF; MEAN divides by k (count_include_pad, as torch avg_pool1d). k <= 1
 * copies. in and out must not alias. */
void lethe_pool1d(const float *in, int32_t n, int32_t k, lethe_reduce op, float *out);

/* dst[i] = src[keep[i]] for i < n; keep ascending with keep[i] >= i, so dst
 * may equal src (in-place compaction of an aligned per-position array). */
void lethe_gather_f32(float *dst, const float *src, const int32_t *keep, int32_t n);

/* ---- Quest page metadata (methods.md §10) ----
 * Keys are rows of kv_dim = n_kv_heads * head_dim floats (post-RoPE). */

/* Folds key k [kv_dim] into the page bounds kmin/kmax [kv_dim];
 * first = the page was empty (the key initializes the bounds). */
void lethe_page_minmax_add(float *kmin, float *kmax, const float *k, int32_t kv_dim, bool first);

/* From scratch: keys [n, kv_dim] in pages of P tokens -> kmin/kmax
 * [ceil(n / P), kv_dim] (the last page may be partial). */
void lethe_page_minmax_build(const float *keys, int32_t n, int32_t kv_dim, int32_t P,
                             float *kmin, float *kmax);

/* Upper bound per page: q [n_heads, head_dim] (the current query), page bounds
 * [n_pages, n_kv_heads, head_dim]. For query head h of KV group h / g:
 * U(h, p) = sum_c max(q_c M_c, q_c m_c) >= max over keys t in p of q_h . k_t.
 * out[p] = max over h of U(h, p) (one page set per layer, the anchor). */
void lethe_quest_page_scores(const float *q, int32_t n_heads, int32_t n_kv_heads,
                             int32_t head_dim, const float *kmin, const float *kmax,
                             int32_t n_pages, float *out);
/* The same reduced per group: n_groups 1 (as above) or n_kv_heads (out[kh *
 * n_pages + p] = max over the query heads of KV head kh: per-KV-head page
 * sets, quest_granularity=head); out [n_groups, n_pages]. */
void lethe_quest_page_scores_grouped(const float *q, int32_t n_heads, int32_t n_kv_heads,
                                     int32_t head_dim, const float *kmin, const float *kmax,
                                     int32_t n_pages, int32_t n_groups, float *out);

/* Page choice: the last page (n_pages - 1, the current one) always, plus the
 * top-(K - 1) of the completed pages [0, n_pages - 1) by scores; ascending.
 * K >= n_pages selects every page. Returns the count (min(K, n_pages), K >= 1). */
int32_t lethe_quest_select_pages(const float *scores, int32_t n_pages, int32_t K, int32_t *out);

/* ---- budget schedules ---- */

/* The anchor's PyramidKV: ratios linear from start_ratio (layer 0) to
 * least_ratio (last layer); budget[l] = s + floor(keep * r_l / r_0) + r. */
void lethe_pyramid_budgets(int32_t n_layers, int32_t s, int32_t keep, int32_t r,
                           float start_ratio, float least_ratio, int32_t *budget);

/* The original (KVCache-Factory) schedule: average capacity C including the
 * window w, beta, prompt length L. Writes per-layer prefix budgets (window
 * excluded): min = base / beta, max = 2 base - min (clamped to L - w), linear.
 * Falls back to uniform base when L < 2 * base, as KVCache-Factory does. */
void lethe_pyramid_budgets_original(int32_t n_layers, int32_t C, int32_t w, int32_t beta,
                                    int32_t L, int32_t *prefix_budget);

#endif /* LETHE_SPARSE_SELECT_UTIL_H */

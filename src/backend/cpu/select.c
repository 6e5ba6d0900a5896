/* select.c - device-side selection ops on the CPU backend (the reference for
 * backend/cuda/select.cu): segmented top-k, selection expansion and per-row
 * top-k under a column limit (row_topk).
 *
 * Backend memory is host memory here, so the ops are plain loops; topk is
 * lethe_topk_indices per segment, which defines the order every backend must
 * reproduce (lethe_rank_before: higher first, ties to the smaller index, NaN
 * last). row_topk keeps a sorted list of k per row (insertion, k <= 16).
 * Its score alpha x + bias is two rounded operations: the file is built as
 * ISO C17 (-std=c17), where GCC does not contract them into an FMA, so the
 * values match the CUDA kernel's __fmul_rn / __fadd_rn bit for bit. */
#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/topk.h"
#include "core/util.h"

void lethe_cpu_topk(lethe_backend *be, int32_t *out, const float *scores, int32_t n_segs,
                    const int32_t *seg_begin, const int32_t *out_begin) {
    (void)be;
    lethe_check_topk(n_segs, seg_begin, out_begin);
    for (int32_t s = 0; s < n_segs; s++) {
        const int32_t n = seg_begin[s + 1] - seg_begin[s], k = out_begin[s + 1] - out_begin[s];
        int32_t got = lethe_topk_indices(scores + seg_begin[s], n, k, out + out_begin[s]);
        LETHE_ASSERT(got == k);
    }
}

void lethe_cpu_select_expand(lethe_backend *be, int32_t *out, const int32_t *rows,
                             const int32_t *picks, const lethe_expand_seq *seqs, int32_t n_seqs,
                             int32_t unit) {
    (void)be;
    lethe_check_select_expand(seqs, n_seqs, unit);
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_expand_seq *q = &seqs[s];
        const int32_t *row = rows + q->row_begin;
        int32_t *o = out + q->out_begin;
        int32_t n = 0, prev_end = q->head;
        for (int32_t e = 0; e < q->head; e++) o[n++] = row[e];
        for (int32_t i = 0; i < q->n_picks; i++) {
            const int32_t e0 = q->pick_off + picks[q->pick_begin + i] * unit;
            LETHE_ASSERT(e0 >= prev_end && e0 + unit <= q->tail); /* ascending, no overlap */
            for (int32_t j = 0; j < unit; j++) o[n++] = row[e0 + j];
            prev_end = e0 + unit;
        }
        for (int32_t e = q->tail; e < q->row_len; e++) o[n++] = row[e];
        LETHE_ASSERT(n == lethe_expand_count(q, unit));
    }
}

void lethe_cpu_row_topk(lethe_backend *be, int32_t *out, const void *scores_, int32_t n, int32_t m,
                        const int32_t *lim, int32_t k, float alpha, const float *bias) {
    const int32_t max_lim = lethe_check_row_topk(n, m, lim, k);
    const float *scores = scores_;
    const int nt = (int64_t)n * max_lim < 65536 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int32_t i = 0; i < n; i++) {
        const float *row = scores + (size_t)i * m;
        float bs[LETHE_ROW_TOPK_MAX];
        int32_t bi[LETHE_ROW_TOPK_MAX], nb = 0;
        for (int32_t c = 0; c < lim[i]; c++) {
            const float ax = alpha * row[c];
            const float s = ax + (bias ? bias[c] : 0.0f);
            if (nb == k && !lethe_rank_before(s, c, bs[k - 1], bi[k - 1])) continue;
            int32_t j = nb < k ? nb++ : k - 1; /* the slot freed at the end, then shift down */
            while (j > 0 && lethe_rank_before(s, c, bs[j - 1], bi[j - 1])) {
                bs[j] = bs[j - 1], bi[j] = bi[j - 1];
                j--;
            }
            bs[j] = s, bi[j] = c;
        }
        for (int32_t j = 0; j < k; j++) out[(size_t)i * k + j] = j < nb ? bi[j] : -1;
    }
}

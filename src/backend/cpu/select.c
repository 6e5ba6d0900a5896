/* select.c - device-side selection ops on the CPU backend (the reference for
 * backend/cuda/select.cu): segmented top-k and selection expansion.
 *
 * Backend memory is host memory here, so both ops are plain loops; topk is
 * lethe_topk_indices per segment, which defines the order every backend must
 * reproduce (lethe_rank_before: higher first, ties to the smaller index, NaN
 * last). */
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

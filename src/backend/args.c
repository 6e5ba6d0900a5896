/* args.c - argument checks shared by the CPU and CUDA twins (see args.h). */
#include "backend/args.h"

#include "backend/sample.h"
#include "core/status.h"

void lethe_check_attention(const lethe_attn_args *a) {
    LETHE_ASSERT(a->n_heads > 0 && a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0);
    LETHE_ASSERT(a->n_seqs > 0 && a->q_begin[0] == 0 && a->q_begin[a->n_seqs] == a->n_tokens);
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
        LETHE_ASSERT(n_q >= 0 && a->sel_begin[s + 1] - a->sel_begin[s] >= n_q);
        for (int32_t h = 0; a->head_sel_begin && h < a->n_kv_heads; h++) {
            const int32_t *hb = a->head_sel_begin + (size_t)s * a->n_kv_heads + h;
            LETHE_ASSERT(hb[1] - hb[0] >= n_q && hb[1] - hb[0] <= a->sel_begin[s + 1] - a->sel_begin[s]);
        }
    }
    LETHE_ASSERT(!a->head_sel_begin || (a->head_sel_begin[0] == 0 && a->head_sel_slots));
}

void lethe_check_attention_quant(const lethe_attn_args *a) {
    LETHE_ASSERT(!a->head_sel_begin); /* per-head selections: native KV only */
    LETHE_ASSERT(a->kvq && (a->kvq->format == LETHE_KV_FP8_E4M3 ||
                            lethe_kv_format_kind(a->kvq->format) == LETHE_KV_KIVI ||
                            lethe_kv_format_kind(a->kvq->format) == LETHE_KV_TURBOQUANT));
    if (lethe_kv_format_kind(a->kvq->format) == LETHE_KV_TURBOQUANT)
        LETHE_ASSERT(a->kvq->tq && a->kvq->k_norm && a->kvq->v_norm && a->head_dim % 8 == 0 &&
                     a->head_dim <= 256);
    lethe_check_attention(a);
}

void lethe_check_attn_scores(const lethe_attn_scores_args *a) {
    LETHE_ASSERT(a->n_heads > 0 && a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0);
    LETHE_ASSERT(a->n_groups > 0 && a->n_heads % a->n_groups == 0 && a->head_dim > 0);
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const lethe_score_seq *sq = &a->seqs[s];
        LETHE_ASSERT(sq->n_rows >= 1 && sq->n_keys >= sq->n_rows);
        LETHE_ASSERT(sq->q_row >= 0 && sq->q_row + sq->n_rows <= a->n_tokens);
        LETHE_ASSERT(sq->key_begin >= 0 && sq->key_begin + sq->n_keys <= a->n_key_slots);
        LETHE_ASSERT(0 <= sq->c0 && sq->c0 <= sq->c1 && sq->c1 <= sq->n_keys);
        LETHE_ASSERT((sq->mode & ~(LETHE_SCORES_KIND_MASK | LETHE_SCORES_CAND_DENOM | LETHE_SCORES_ROW_MAX |
                                   LETHE_SCORES_QMEAN)) == 0);
        if (sq->mode & LETHE_SCORES_QMEAN)
            LETHE_ASSERT((sq->mode & ~LETHE_SCORES_QMEAN) == LETHE_SCORES_LOGIT_MAX &&
                         sq->c1 <= sq->n_keys - sq->n_rows + 1);
        LETHE_ASSERT(((sq->mode ^ a->seqs[0].mode) & LETHE_SCORES_QMEAN) == 0);
    }
}

void lethe_check_kv_store_kivi(const lethe_kv_quant *kvq, int32_t n, int32_t C) {
    const lethe_kivi_plan *pl = kvq->kivi;
    LETHE_ASSERT(pl);
    const int32_t b = lethe_kv_kivi_bits(kvq->format), G = lethe_kv_kivi_group(kvq->format);
    LETHE_ASSERT((b == 2 || b == 4 || b == 8) && G >= 1 && C % G == 0);
    for (int32_t p = 0; p < pl->n_pack; p++) {
        LETHE_ASSERT(pl->pack_entry[p] >= 0 && pl->pack_entry[p] < kvq->n_groups);
        const int32_t *src = pl->pack_src + (size_t)p * G;
        for (int32_t j = 0; j < G; j++) /* a new token of this store, or a residual entry */
            LETHE_ASSERT(src[j] < n && (src[j] >= 0 || -1 - src[j] < kvq->n_res));
    }
}

void lethe_check_page_minmax(const int32_t *page_ids, const int32_t *slot_begin, int32_t n_pages,
                             int32_t kv_dim) {
    LETHE_ASSERT(n_pages >= 0 && kv_dim > 0);
    if (n_pages == 0) return;
    LETHE_ASSERT(slot_begin[0] == 0);
    for (int32_t i = 0; i < n_pages; i++)
        LETHE_ASSERT(page_ids[i] >= 0 && slot_begin[i + 1] > slot_begin[i]);
}

void lethe_check_page_scores(int32_t n_seqs, const int32_t *page_begin, int32_t n_heads,
                             int32_t n_kv_heads, int32_t n_groups) {
    LETHE_ASSERT(n_seqs >= 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    LETHE_ASSERT(n_groups == 1 || n_groups == n_kv_heads);
    if (n_seqs == 0) return;
    LETHE_ASSERT(page_begin[0] == 0);
    for (int32_t s = 0; s < n_seqs; s++) LETHE_ASSERT(page_begin[s + 1] >= page_begin[s]);
}

bool lethe_check_topk(int32_t n_segs, const int32_t *seg_begin, const int32_t *out_begin) {
    LETHE_ASSERT(n_segs >= 0);
    if (n_segs == 0) return false;
    LETHE_ASSERT(seg_begin[0] >= 0 && out_begin[0] >= 0);
    bool any = false;
    for (int32_t s = 0; s < n_segs; s++) {
        const int32_t n = seg_begin[s + 1] - seg_begin[s], k = out_begin[s + 1] - out_begin[s];
        LETHE_ASSERT(n >= 0 && k >= 0 && k <= n);
        any |= k > 0;
    }
    return any;
}

int32_t lethe_check_row_topk(int32_t n, int32_t m, const int32_t *lim, int32_t k) {
    LETHE_ASSERT(n >= 0 && m >= 0 && k >= 1 && k <= LETHE_ROW_TOPK_MAX);
    int32_t max_lim = 0;
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(lim[i] >= 0 && lim[i] <= m);
        if (lim[i] > max_lim) max_lim = lim[i];
    }
    return max_lim;
}

lethe_expand_extent lethe_check_select_expand(const lethe_expand_seq *seqs, int32_t n_seqs,
                                              int32_t unit) {
    LETHE_ASSERT(unit >= 1 && n_seqs >= 0);
    lethe_expand_extent x = {0, 0, 0};
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_expand_seq *q = &seqs[s];
        LETHE_ASSERT(q->row_begin >= 0 && q->pick_begin >= 0 && q->out_begin >= 0);
        LETHE_ASSERT(0 <= q->head && q->head <= q->tail && q->tail <= q->row_len && q->n_picks >= 0);
        const int64_t cnt = (int64_t)q->head + (int64_t)q->n_picks * unit + (q->row_len - q->tail);
        LETHE_ASSERT(cnt <= 0x7fffffff);
        const int64_t rows_end = (int64_t)q->row_begin + q->row_len;
        const int64_t picks_end = (int64_t)q->pick_begin + q->n_picks;
        if (cnt > x.max_out) x.max_out = cnt;
        if (rows_end > x.rows_end) x.rows_end = rows_end;
        if (q->n_picks && picks_end > x.picks_end) x.picks_end = picks_end;
    }
    return x;
}

void lethe_check_sample(const lethe_sample_args *a) {
    LETHE_ASSERT(a->n >= 0 && a->n_vocab > 0 && (a->n == 0 || (a->logits && a->rows && a->tokens)));
    for (int32_t i = 0; i < a->n; i++) {
        const lethe_sample_row *p = &a->rows[i];
        LETHE_ASSERT(p->n_pen == 0 || (p->pen_begin >= 0 && p->pen_begin + p->n_pen <= a->n_pen));
        LETHE_ASSERT(p->mask_row >= 0 && p->mask_row <= a->n_mask && (!p->mask_row || a->mask));
    }
}

void lethe_check_block_sparse(const lethe_block_sparse *p) {
    LETHE_ASSERT(p->block >= 32 && p->block % 32 == 0 && p->sink_blocks >= 1 && p->window_blocks >= 2 &&
                 p->last_q_blocks >= 0 && p->threshold >= 0.0f && p->threshold <= 1.0f);
}

bool lethe_bsp_seq_sparse(const lethe_attn_args *a, int32_t s) {
    if (!a->bsp || a->head_sel_begin || !a->v_cache || (a->kvq && a->kvq->format != LETHE_KV_NATIVE))
        return false;
    const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
    return n_q >= (a->bsp->min_q > 2 ? a->bsp->min_q : 2);
}

void lethe_bsp_block_range(const lethe_block_sparse *p, int32_t n_q, int32_t n_sel, int32_t t,
                           int32_t *kb_last, int32_t *n_full) {
    const int32_t B = p->block, n_pre = n_sel - n_q;
    const int32_t first = t * B, last = (n_q < first + B ? n_q : first + B) - 1;
    *kb_last = (n_pre + last) / B;     /* the last key block the block's last query sees */
    *n_full = (n_pre + first + 1) / B; /* key blocks all of whose entries its first query sees */
}

int32_t lethe_bsp_last_q(const lethe_attn_args *a, int32_t s) {
    return !a->bsp->prompt_end || a->bsp->prompt_end[s] ? a->bsp->last_q_blocks : 0;
}

bool lethe_bsp_forced(const lethe_block_sparse *p, int32_t t, int32_t n_qb, int32_t b, int32_t kb_last,
                      int32_t n_full) {
    return b < p->sink_blocks || b > kb_last - p->window_blocks || b >= n_full ||
           t >= n_qb - p->last_q_blocks;
}

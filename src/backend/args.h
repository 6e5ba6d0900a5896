/* args.h - argument checks shared by the CPU and CUDA twins of an op.
 *
 * Each function asserts (LETHE_ASSERT: a bad argument is a caller bug, ops
 * never fail) the part of an op's contract in backend.h / sample.h that does
 * not depend on the backend: shapes, index ranges, ordering of the host index
 * arrays. A backend's own limits (head_dim ranges, grid sizes, shared memory,
 * graph capture) stay in its twin, after the shared call. Every check reads
 * host arguments only, so both twins call it before staging anything.
 *
 * Callable from C and from the CUDA backend's C++ (.cu) files. */
#ifndef LETHE_BACKEND_ARGS_H
#define LETHE_BACKEND_ARGS_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* attention over native KV: heads (n_heads a multiple of n_kv_heads > 0),
 * q_begin [n_seqs + 1] from 0 to n_tokens (n_seqs > 0), and per sequence
 * n_q >= 0 query rows with at least n_q selected keys (the new tokens). */
void lethe_check_attention(const lethe_attn_args *a);

/* attention over quantized KV: lethe_check_attention plus a kvq of format
 * FP8_E4M3 or KIVI. */
void lethe_check_attention_quant(const lethe_attn_args *a);

/* attn_scores: heads and groups (n_heads a multiple of n_kv_heads and of
 * n_groups), head_dim > 0, and each lethe_score_seq inside q (rows), key_slots
 * (keys) and its keys (candidates), with a known mode. */
void lethe_check_attn_scores(const lethe_attn_scores_args *a);

/* kv_store_quant into a KIVI layer of C = n_kv_heads * head_dim channels for
 * n new tokens: a plan, b in {2, 4, 8}, G | C, and every completed group's K
 * entry and member rows (new token < n, or a residual entry) in range. */
void lethe_check_kv_store_kivi(const lethe_kv_quant *kvq, int32_t n, int32_t C);

/* page_minmax: n_pages >= 0, kv_dim > 0, slot_begin [n_pages + 1] from 0 with
 * at least one slot per page, page_ids >= 0. */
void lethe_check_page_minmax(const int32_t *page_ids, const int32_t *slot_begin, int32_t n_pages,
                             int32_t kv_dim);

/* page_scores: n_seqs >= 0, heads (n_heads a multiple of n_kv_heads > 0),
 * n_groups 1 or n_kv_heads, page_begin [n_seqs + 1] from 0, non-decreasing. */
void lethe_check_page_scores(int32_t n_seqs, const int32_t *page_begin, int32_t n_heads,
                             int32_t n_kv_heads, int32_t n_groups);

/* topk: n_segs >= 0, and per segment 0 <= k_s <= n_s (seg_begin, out_begin
 * [n_segs + 1], starting >= 0). Returns whether some k_s > 0 (false: the op
 * writes nothing). */
bool lethe_check_topk(int32_t n_segs, const int32_t *seg_begin, const int32_t *out_begin);

/* row_topk: n >= 0, m >= 0, 1 <= k <= LETHE_ROW_TOPK_MAX, every lim[i] in
 * [0, m]. Returns the largest lim[i] (0: no row has a column to rank). */
int32_t lethe_check_row_topk(int32_t n, int32_t m, const int32_t *lim, int32_t k);

/* How far a select_expand call reaches into its arrays (what a device backend
 * stages): the largest per-sequence output count, and the ends of the rows and
 * picks entries the sequences name. */
typedef struct lethe_expand_extent {
    int64_t max_out, rows_end, picks_end;
} lethe_expand_extent;

/* select_expand: unit >= 1, n_seqs >= 0, per sequence offsets >= 0 and
 * 0 <= head <= tail <= row_len, n_picks >= 0, its count inside int32. Returns
 * the call's extent. (Whether the picks fall inside (head, tail) is checked
 * where the picks are read: they are backend memory.) */
lethe_expand_extent lethe_check_select_expand(const lethe_expand_seq *seqs, int32_t n_seqs,
                                              int32_t unit);

/* block-sparse prefill (lethe_block_sparse): the parameters' bounds (block a
 * multiple of 32, sink >= 1, window >= 2, last_q >= 0, threshold in [0, 1]). */
void lethe_check_block_sparse(const lethe_block_sparse *p);
/* Whether sequence s of the call runs block-sparse (bsp set, native per-
 * sequence selections, n_q >= max(min_q, 2)). */
bool lethe_bsp_seq_sparse(const lethe_attn_args *a, int32_t s);
/* Query block t of a sequence with n_q queries and n_sel selected entries:
 * *kb_last = the last key block its last query sees, *n_full = the number of
 * leading key blocks all of whose entries its first query sees. */
void lethe_bsp_block_range(const lethe_block_sparse *p, int32_t n_q, int32_t n_sel, int32_t t,
                           int32_t *kb_last, int32_t *n_full);
/* The last query blocks of sequence s that attend densely: last_q_blocks
 * when its chunk ends the prompt (or prompt_end is NULL), else 0. */
int32_t lethe_bsp_last_q(const lethe_attn_args *a, int32_t s);
/* Whether key block b (<= kb_last) of query block t (of n_qb) is read
 * whatever its score: sink, window, diagonal or last query blocks (p's
 * last_q_blocks: the caller's lethe_bsp_last_q for the sequence). */
bool lethe_bsp_forced(const lethe_block_sparse *p, int32_t t, int32_t n_qb, int32_t b, int32_t kb_last,
                      int32_t n_full);

/* sample: n >= 0 rows over n_vocab > 0 (logits, rows and tokens present when
 * n > 0), each row's penalty entries inside [0, n_pen). */
void lethe_check_sample(const lethe_sample_args *a);

#ifdef __cplusplus
}
#endif

#endif /* LETHE_BACKEND_ARGS_H */

/* scores.c - attn_scores on the CPU backend: reduced per-key scores of a few
 * query rows for the sparse methods (semantics: lethe_attn_scores_args in
 * backend.h; CUDA twin: backend/cuda/scores.cu).
 *
 * Exactness: a raw score is computed as the CPU attention computes it (one
 * fmaf chain over d in increasing order from 0, then * scale), and the
 * reduction is the one sparse/select_util.c's lethe_window_scores applied to
 * the attention's full score output before this op existed (max in float;
 * softmax max and sum in double, p = (float)(exp(s - m) / l) summed over rows
 * in row order in float, divided by n_rows, heads reduced in head order), so
 * the methods' scores are bit-identical to that path.
 *
 * With AVX2/FMA the raw scores come from scores_avx2.c, 8 keys per vector,
 * each key's fmaf chain unchanged (the same bits, so every mode above stays
 * exact). One mode has a faster path as a whole: PROB_MAX | ROW_MAX without
 * CAND_DENOM (KVzip's replay scores) runs in scores_avx2.c with float
 * exponentials (that file says how close; no lethe_window_scores mode has a
 * row max, so nothing there had to stay bit-identical).
 *
 * Work per sequence: the query heads in parallel (OpenMP), each producing its
 * row-reduced values v(h, .) [n_cand] in a scratch [n_heads, n_cand], then
 * the group reduction in head order. Scratch: n_heads * n_cand floats plus
 * one raw row [n_keys] per head in flight. LETHE_SCORES_QMEAN first averages
 * each sequence's rows into one mean query (attn_scores_qmean). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

/* raw[e] = scale * q . K[slot(e), kvh] for e in [lo, hi); off (AVX2 tier, else
 * NULL): the keys' float offsets into the cache, 8 keys per vector in
 * scores_avx2.c with the same fmaf chain per key (the same bits) */
static void raw_scores(const lethe_attn_scores_args *a, const lethe_score_seq *sq, const float *q,
                       int kvh, int32_t lo, int32_t hi, const int32_t *off, float *raw) {
    const int D = a->head_dim;
    if (off) {
        if (hi > lo) lethe_cpu_scores_raw_avx2(q, a->k_cache, off + lo, hi - lo, D, a->scale, raw + lo);
        return;
    }
    const size_t kv_stride = (size_t)a->n_kv_heads * D;
    const float *kc = a->k_cache;
    const int32_t *slots = a->key_slots + sq->key_begin;
    for (int32_t e = lo; e < hi; e++) {
        const float *k = kc + (size_t)slots[e] * kv_stride + (size_t)kvh * D;
        float acc = 0.0f;
        for (int d = 0; d < D; d++) acc = fmaf(q[d], k[d], acc);
        raw[e] = acc * a->scale;
    }
}

/* v[j] for candidate c0 + j of query head h, reduced over the scored rows */
static void head_values(const lethe_attn_scores_args *a, const lethe_score_seq *sq, int h,
                        const int32_t *off, float *raw, float *v) {
    const int32_t c0 = sq->c0, c1 = sq->c1, nc = c1 - c0;
    const int kind = sq->mode & LETHE_SCORES_KIND_MASK;
    const bool cand = (sq->mode & LETHE_SCORES_CAND_DENOM) != 0;
    const bool row_max = (sq->mode & LETHE_SCORES_ROW_MAX) != 0;
    const int kvh = h / (a->n_heads / a->n_kv_heads);
    for (int32_t j = 0; j < nc; j++) v[j] = kind == LETHE_SCORES_LOGIT_MAX ? -INFINITY : 0.0f;
    for (int32_t i = 0; i < sq->n_rows; i++) {
        const int32_t lim = sq->n_keys - sq->n_rows + i; /* last visible key */
        const float *q = (const float *)a->q + ((size_t)(sq->q_row + i) * a->n_heads + h) * a->head_dim;
        const int32_t vc1 = LETHE_MIN(c1, lim + 1);      /* visible candidates [c0, vc1) */
        if (kind == LETHE_SCORES_LOGIT_MAX) {
            raw_scores(a, sq, q, kvh, c0, vc1, off, raw);
            for (int32_t e = c0; e < vc1; e++)
                if (raw[e] > v[e - c0]) v[e - c0] = raw[e];
            continue;
        }
        const int32_t d0 = cand ? c0 : 0, d1 = cand ? vc1 : lim + 1; /* denominator */
        raw_scores(a, sq, q, kvh, d0, d1, off, raw); /* [d0, d1) covers the visible candidates */
        double m = -INFINITY, l = 0.0;
        for (int32_t e = d0; e < d1; e++)
            if (raw[e] > m) m = raw[e];
        if (m == -INFINITY) continue; /* no visible key in the denominator */
        for (int32_t e = d0; e < d1; e++) l += exp((double)raw[e] - m);
        for (int32_t e = c0; e < vc1; e++) {
            const float p = (float)(exp((double)raw[e] - m) / l);
            if (!row_max) v[e - c0] += p;
            else if (p > v[e - c0]) v[e - c0] = p;
        }
    }
    if (kind != LETHE_SCORES_LOGIT_MAX && !row_max)
        for (int32_t j = 0; j < nc; j++) v[j] = v[j] / (float)sq->n_rows;
}

typedef struct scores_job {
    const lethe_attn_scores_args *a;
    const lethe_score_seq *sq;
    float *hv;
    int32_t nc;
    lethe_cpu_isa isa;
} scores_job;

/* key offsets of the AVX2 paths fit in int32 */
static bool offsets_fit(const scores_job *j) {
    const lethe_attn_scores_args *a = j->a;
    const int32_t *slots = a->key_slots + j->sq->key_begin;
    if (j->isa < LETHE_ISA_AVX2) return false;
    int32_t max_slot = 0;
    for (int32_t e = 0; e < j->sq->n_keys; e++) max_slot = LETHE_MAX(max_slot, slots[e]);
    return ((int64_t)max_slot + 1) * a->n_kv_heads * a->head_dim < INT32_MAX;
}

static void scores_task(void *ctx, int h, int worker) {
    const scores_job *j = ctx;
    const lethe_attn_scores_args *a = j->a;
    const lethe_score_seq *sq = j->sq;
    float *raw = lethe_xmalloc(((size_t)sq->n_keys + 8) * sizeof(float));
    int32_t *off = NULL;
    if (offsets_fit(j)) {
        const int kvh = h / (a->n_heads / a->n_kv_heads);
        const int32_t *slots = a->key_slots + sq->key_begin;
        off = lethe_xmalloc(((size_t)sq->n_keys + 8) * sizeof(int32_t));
        for (int32_t e = 0; e < sq->n_keys; e++)
            off[e] = (slots[e] * a->n_kv_heads + kvh) * a->head_dim;
    }
    if (off && sq->mode == (LETHE_SCORES_PROB_MAX | LETHE_SCORES_ROW_MAX)) {
        const size_t qs = (size_t)a->n_heads * a->head_dim;
        lethe_cpu_scores_rowmax_avx2((const float *)a->q + (size_t)sq->q_row * qs + (size_t)h * a->head_dim,
                                     qs, sq->n_rows, a->k_cache, off, sq->n_keys, a->head_dim,
                                     a->scale, sq->c0, sq->c1, raw, j->hv + (size_t)h * j->nc);
    } else {
        head_values(a, sq, h, off, raw, j->hv + (size_t)h * j->nc);
    }
    free(off);
    free(raw);
}

/* LETHE_SCORES_QMEAN: each sequence's rows averaged per head (f32 sums in
 * row order, / n_rows), then scored as one row over all its keys */
static void attn_scores_qmean(lethe_backend *be, const lethe_attn_scores_args *a) {
    const int H = a->n_heads, D = a->head_dim;
    float *qm = lethe_xcalloc((size_t)(a->n_seqs ? a->n_seqs : 1) * H * D, sizeof(float));
    lethe_score_seq *sq = lethe_xmalloc((size_t)(a->n_seqs ? a->n_seqs : 1) * sizeof(*sq));
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const lethe_score_seq *o = &a->seqs[s];
        float *m = qm + (size_t)s * H * D;
        for (int32_t r = 0; r < o->n_rows; r++) {
            const float *q = (const float *)a->q + (size_t)(o->q_row + r) * H * D;
            for (int c = 0; c < H * D; c++) m[c] += q[c];
        }
        for (int c = 0; c < H * D; c++) m[c] /= (float)o->n_rows;
        sq[s] = *o;
        sq[s].q_row = s, sq[s].n_rows = 1, sq[s].mode = o->mode & ~LETHE_SCORES_QMEAN;
    }
    lethe_attn_scores_args b = *a;
    b.q = qm, b.n_tokens = a->n_seqs, b.seqs = sq;
    lethe_cpu_attn_scores(be, &b);
    free(sq);
    free(qm);
}

void lethe_cpu_attn_scores(lethe_backend *be, const lethe_attn_scores_args *a) {
    lethe_check_attn_scores(a);
    if (a->n_seqs > 0 && (a->seqs[0].mode & LETHE_SCORES_QMEAN)) {
        attn_scores_qmean(be, a);
        return;
    }
    const int H = a->n_heads, per_group = a->n_heads / a->n_groups;
    size_t off = 0;
    for (int32_t s = 0; s < a->n_seqs; s++) {
        const lethe_score_seq *sq = &a->seqs[s];
        const int32_t nc = sq->c1 - sq->c0;
        if (nc == 0) continue;
        float *hv = lethe_xmalloc((size_t)H * (size_t)nc * sizeof(float));
        const int nt = sq->n_rows * (int64_t)sq->n_keys < 4096 ? 1 : lethe_cpu_threads(be);
        scores_job j = {a, sq, hv, nc, ((const lethe_cpu_ctx *)be->ctx)->isa};
        lethe_cpu_parallel(be, nt, H, scores_task, &j);
        const int kind = sq->mode & LETHE_SCORES_KIND_MASK;
        for (int g = 0; g < a->n_groups; g++) {
            float *o = a->out + off + (size_t)g * nc;
            for (int32_t j = 0; j < nc; j++) {
                float acc = kind == LETHE_SCORES_LOGIT_MAX || kind == LETHE_SCORES_PROB_MAX ? -INFINITY : 0.0f;
                for (int h = g * per_group; h < (g + 1) * per_group; h++) {
                    float x = hv[(size_t)h * nc + j];
                    if (kind == LETHE_SCORES_LOGIT_MAX || kind == LETHE_SCORES_PROB_MAX) acc = x > acc ? x : acc;
                    else acc += x;
                }
                o[j] = kind == LETHE_SCORES_PROB_MEAN ? acc / (float)per_group : acc;
            }
        }
        free(hv);
        off += (size_t)a->n_groups * (size_t)nc;
    }
}

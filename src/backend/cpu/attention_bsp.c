/* attention_bsp.c - the block choice of block-sparse prefill attention (CPU
 * backend; backend.h lethe_block_sparse; CUDA twin cuda/attention_bsp.cu).
 *
 * For each sequence of an attention call that runs block-sparse (n_q >=
 * min_q) this computes, before attention.c's tiles run:
 *   qm [n_qblocks, n_heads, hd]    mean query of each query block and head
 *   km, vm [n_kblocks, n_kv, hd]   mean key / value of each key block
 *   keep [n_qblocks, n_kv, n_kblocks]  1 = the block's entries are read
 * then attention.c reads only the kept key blocks and, with mean
 * correction, one pseudo-entry (km, vm, logit + ln B) per skipped block.
 * Sums run in increasing index order in f32, the block softmax in double,
 * so the choice is deterministic. Cost O(n_sel * kv_dim) for the means and
 * O(n_qblocks * n_kblocks * n_heads * hd) for the scores: 1/B^2 of the
 * dense attention's score work. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

static void plan_seq(const lethe_attn_args *a, int32_t s, lethe_cpu_bsp *o) {
    lethe_block_sparse ps = *a->bsp; /* this sequence's dense last query blocks */
    ps.last_q_blocks = lethe_bsp_last_q(a, s);
    const lethe_block_sparse *p = &ps;
    const int32_t B = p->block, H = a->n_heads, KH = a->n_kv_heads, G = H / KH, hd = a->head_dim;
    const int32_t q0 = a->q_begin[s], n_q = a->q_begin[s + 1] - q0;
    const int32_t *sel = a->sel_slots + a->sel_begin[s];
    const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
    const size_t kv_dim = (size_t)KH * hd;
    const float *q = a->q, *kc = a->k_cache, *vc = a->v_cache;
    o->nqb = LETHE_CEIL_DIV(n_q, B);
    o->nkb = LETHE_CEIL_DIV(n_sel, B);
    o->km = lethe_xcalloc((size_t)o->nkb * kv_dim, sizeof(float));
    o->vm = lethe_xcalloc((size_t)o->nkb * kv_dim, sizeof(float));
    o->keep = lethe_xmalloc((size_t)o->nqb * KH * o->nkb);
    for (int32_t b = 0; b < o->nkb; b++) {
        const int32_t e1 = LETHE_MIN(n_sel, (b + 1) * B);
        float *km = o->km + (size_t)b * kv_dim, *vm = o->vm + (size_t)b * kv_dim;
        for (int32_t e = b * B; e < e1; e++) {
            const float *kr = kc + (size_t)sel[e] * kv_dim, *vr = vc + (size_t)sel[e] * kv_dim;
            for (size_t c = 0; c < kv_dim; c++) km[c] += kr[c], vm[c] += vr[c];
        }
        const float inv = 1.0f / (float)(e1 - b * B);
        for (size_t c = 0; c < kv_dim; c++) km[c] *= inv, vm[c] *= inv;
    }
    float *qm = lethe_xmalloc((size_t)H * hd * sizeof(float));
    double *sc = lethe_xmalloc((size_t)o->nkb * sizeof(double));
    float *pmax = lethe_xmalloc((size_t)o->nkb * sizeof(float));
    for (int32_t t = 0; t < o->nqb; t++) {
        const int32_t r1 = LETHE_MIN(n_q, (t + 1) * B);
        memset(qm, 0, (size_t)H * hd * sizeof(float));
        for (int32_t r = t * B; r < r1; r++) {
            const float *qr = q + (size_t)(q0 + r) * H * hd;
            for (int32_t c = 0; c < H * hd; c++) qm[c] += qr[c];
        }
        const float inv = 1.0f / (float)(r1 - t * B);
        for (int32_t c = 0; c < H * hd; c++) qm[c] *= inv;
        int32_t kb_last, n_full;
        lethe_bsp_block_range(p, n_q, n_sel, t, &kb_last, &n_full);
        for (int32_t g = 0; g < KH; g++) {
            uint8_t *keep = o->keep + ((size_t)t * KH + g) * o->nkb;
            for (int32_t b = 0; b <= kb_last; b++) pmax[b] = 0.0f;
            for (int32_t h = g * G; h < (g + 1) * G; h++) {
                double mx = -INFINITY, sum = 0;
                for (int32_t b = 0; b <= kb_last; b++) {
                    const float *km = o->km + (size_t)b * kv_dim + (size_t)g * hd;
                    float d = 0.0f;
                    for (int32_t c = 0; c < hd; c++) d = fmaf(qm[(size_t)h * hd + c], km[c], d);
                    sc[b] = (double)(d * a->scale);
                    if (sc[b] > mx) mx = sc[b];
                }
                for (int32_t b = 0; b <= kb_last; b++) sum += exp(sc[b] - mx);
                for (int32_t b = 0; b <= kb_last; b++) {
                    const float pb = (float)(exp(sc[b] - mx) / sum);
                    if (pb > pmax[b]) pmax[b] = pb;
                }
            }
            for (int32_t b = 0; b < o->nkb; b++)
                keep[b] = b <= kb_last && (lethe_bsp_forced(p, t, o->nqb, b, kb_last, n_full) ||
                                           pmax[b] >= p->threshold);
        }
    }
    free(pmax);
    free(sc);
    free(qm);
}

lethe_cpu_bsp *lethe_cpu_bsp_plan(const lethe_attn_args *a) {
    if (!a->bsp) return NULL;
    lethe_check_block_sparse(a->bsp);
    lethe_cpu_bsp *out = NULL;
    for (int32_t s = 0; s < a->n_seqs; s++) {
        if (!lethe_bsp_seq_sparse(a, s)) continue;
        if (!out) out = lethe_xcalloc((size_t)a->n_seqs, sizeof(*out));
        plan_seq(a, s, &out[s]);
    }
    return out;
}

void lethe_cpu_bsp_free(lethe_cpu_bsp *p, int32_t n_seqs) {
    if (!p) return;
    for (int32_t s = 0; s < n_seqs; s++) {
        free(p[s].keep);
        free(p[s].km);
        free(p[s].vm);
    }
    free(p);
}

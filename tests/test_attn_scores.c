/* test_attn_scores.c - the CPU backend's attn_scores op (backend/cpu/scores.c)
 * against direct computations from q and K:
 *
 *  - exact: for one group (all heads) every mode equals, bit for bit,
 *    lethe_window_scores (sparse/select_util.c) applied to raw scores
 *    computed here as scale * (fmaf chain over d), i.e. the host reduction
 *    the methods used before the op existed, over the attention's own score
 *    values; this is what keeps SnapKV / PyramidKV / H2O / OmniKV results
 *    unchanged on the CPU backend;
 *  - oracle: a float64 computation of every mode with n_groups = 1, n_kv_heads
 *    and n_heads, within 1e-5 relative (+ 1e-5 absolute for logits);
 *  - several sequences of mixed modes in one call (packed output, ragged rows
 *    and keys, permuted and shared slots, head_dim not a multiple of 8),
 *    windows wider than the candidates' causal reach (masked candidates:
 *    -INF logits, zero probability), empty candidate ranges;
 *  - LETHE_SCORES_QMEAN (omnikv_prefill): the chunk-mean logit, max over a
 *    group's heads, against float64. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "sparse/select_util.h"
#include "test.h"

static uint64_t g_rng = 99;
static float frand(void) { return (float)((lethe_splitmix64(&g_rng) >> 40) * 0x1p-24) * 2.0f - 1.0f; }

typedef struct problem {
    int H, KH, D, T, n_slots;
    float *q, *k, scale;
    int32_t *slots;
    int n_slot_list;
} problem;

static void problem_init(problem *p, int H, int KH, int D, int T, int n_slots, int n_list) {
    p->H = H, p->KH = KH, p->D = D, p->T = T, p->n_slots = n_slots, p->n_slot_list = n_list;
    p->q = lethe_xmalloc(sizeof(float) * (size_t)T * H * D);
    p->k = lethe_xmalloc(sizeof(float) * (size_t)n_slots * KH * D);
    for (size_t i = 0; i < (size_t)T * H * D; i++) p->q[i] = 2.5f * frand();
    for (size_t i = 0; i < (size_t)n_slots * KH * D; i++) p->k[i] = frand();
    p->slots = lethe_xmalloc(sizeof(int32_t) * (size_t)n_list);
    for (int i = 0; i < n_list; i++) p->slots[i] = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)n_slots);
    p->scale = 1.0f / sqrtf((float)D);
}

static void problem_free(problem *p) { free(p->q), free(p->k), free(p->slots); }

/* raw score as the CPU attention computes it (and as scores.c must) */
static float raw_f(const problem *p, const lethe_score_seq *r, int i, int h, int e) {
    const float *q = p->q + ((size_t)(r->q_row + i) * p->H + h) * p->D;
    const float *k = p->k + ((size_t)p->slots[r->key_begin + e] * p->KH + h / (p->H / p->KH)) * p->D;
    float acc = 0.0f;
    for (int d = 0; d < p->D; d++) acc = fmaf(q[d], k[d], acc);
    return acc * p->scale;
}

static double raw_d(const problem *p, const lethe_score_seq *r, int i, int h, int e) {
    const float *q = p->q + ((size_t)(r->q_row + i) * p->H + h) * p->D;
    const float *k = p->k + ((size_t)p->slots[r->key_begin + e] * p->KH + h / (p->H / p->KH)) * p->D;
    double acc = 0.0;
    for (int d = 0; d < p->D; d++) acc += (double)q[d] * k[d];
    return acc * p->scale;
}

/* float64 oracle of one request: out [n_groups, c1 - c0] */
static void oracle(const problem *p, const lethe_score_seq *r, int n_groups, double *out) {
    const int nc = r->c1 - r->c0, kind = r->mode & LETHE_SCORES_KIND_MASK, per = p->H / n_groups;
    const bool cand = (r->mode & LETHE_SCORES_CAND_DENOM) != 0;
    const bool row_max = (r->mode & LETHE_SCORES_ROW_MAX) != 0;
    double *v = lethe_xcalloc((size_t)p->H * (nc ? nc : 1), sizeof(double));
    for (int h = 0; h < p->H; h++) {
        for (int j = 0; j < nc; j++) v[h * nc + j] = kind == LETHE_SCORES_LOGIT_MAX ? -INFINITY : 0.0;
        for (int i = 0; i < r->n_rows; i++) {
            int lim = r->n_keys - r->n_rows + i;
            if (kind == LETHE_SCORES_LOGIT_MAX) {
                for (int j = 0; j < nc && r->c0 + j <= lim; j++)
                    v[h * nc + j] = fmax(v[h * nc + j], raw_d(p, r, i, h, r->c0 + j));
                continue;
            }
            int d0 = cand ? r->c0 : 0, d1 = cand ? LETHE_MIN(r->c1, lim + 1) : lim + 1;
            double m = -INFINITY, l = 0;
            for (int e = d0; e < d1; e++) m = fmax(m, raw_d(p, r, i, h, e));
            if (m == -INFINITY) continue;
            for (int e = d0; e < d1; e++) l += exp(raw_d(p, r, i, h, e) - m);
            for (int j = 0; j < nc && r->c0 + j <= lim; j++) {
                const double pr = exp(raw_d(p, r, i, h, r->c0 + j) - m) / l;
                v[h * nc + j] = row_max ? fmax(v[h * nc + j], pr) : v[h * nc + j] + pr / r->n_rows;
            }
        }
    }
    for (int g = 0; g < n_groups; g++)
        for (int j = 0; j < nc; j++) {
            bool mx = kind == LETHE_SCORES_LOGIT_MAX || kind == LETHE_SCORES_PROB_MAX;
            double a = mx ? -INFINITY : 0.0;
            for (int h = g * per; h < (g + 1) * per; h++) a = mx ? fmax(a, v[h * nc + j]) : a + v[h * nc + j];
            out[g * nc + j] = kind == LETHE_SCORES_PROB_MEAN ? a / per : a;
        }
    free(v);
}

/* the pre-op host path: lethe_window_scores over a [H, n_rows, n_keys] raw block */
static void window_path(const problem *p, const lethe_score_seq *r, float *out) {
    const int kind = r->mode & LETHE_SCORES_KIND_MASK, W = r->n_rows, L = r->n_keys;
    float *raw = lethe_xmalloc(sizeof(float) * (size_t)p->H * W * L);
    for (int h = 0; h < p->H; h++)
        for (int i = 0; i < W; i++)
            for (int e = 0; e < L; e++)
                raw[((size_t)h * W + i) * L + e] = e <= L - W + i ? raw_f(p, r, i, h, e) : -INFINITY;
    lethe_reduce op = kind == LETHE_SCORES_PROB_SUM ? LETHE_REDUCE_SUM
                      : kind == LETHE_SCORES_PROB_MEAN ? LETHE_REDUCE_MEAN : LETHE_REDUCE_MAX;
    lethe_window_scores(raw, p->H, (size_t)W * L, (size_t)L, W, L, r->c0, r->c1,
                        kind == LETHE_SCORES_LOGIT_MAX ? LETHE_SCORE_LOGITS : LETHE_SCORE_PROBABILITY,
                        (r->mode & LETHE_SCORES_CAND_DENOM) != 0, op, out);
    free(raw);
}

static void run(lethe_backend *be, const problem *p, const lethe_score_seq *req, int n, int n_groups,
                bool exact) {
    size_t n_out = lethe_attn_scores_out_len(req, n, n_groups);
    float *out = lethe_xmalloc(sizeof(float) * (n_out + 1));
    for (size_t i = 0; i <= n_out; i++) out[i] = NAN;
    lethe_attn_scores_args a = {.out = out, .q = p->q, .k_cache = p->k, .n_tokens = p->T, .n_seqs = n,
                                .seqs = req, .key_slots = p->slots, .n_key_slots = p->n_slot_list,
                                .n_heads = p->H, .n_kv_heads = p->KH, .head_dim = p->D,
                                .n_groups = n_groups, .scale = p->scale};
    be->ops->attn_scores(be, &a);
    CHECK(isnan(out[n_out])); /* nothing written past the packed output */
    size_t off = 0;
    for (int s = 0; s < n; s++) {
        const int nc = req[s].c1 - req[s].c0;
        double *ref = lethe_xmalloc(sizeof(double) * (size_t)n_groups * (nc ? nc : 1));
        oracle(p, &req[s], n_groups, ref);
        for (int i = 0; i < n_groups * nc; i++) {
            double x = out[off + i], y = ref[i];
            if (isinf(y)) CHECK_MSG(x == y, "seq %d mode %d [%d]: %g vs %g", s, req[s].mode, i, x, y);
            else
                CHECK_MSG(fabs(x - y) <= 1e-5 * fabs(y) + ((req[s].mode & LETHE_SCORES_KIND_MASK) == LETHE_SCORES_LOGIT_MAX ? 1e-5 : 1e-9),
                          "seq %d mode %d groups %d [%d]: %.9g vs %.9g",
                          s, req[s].mode, n_groups, i, x, y);
        }
        if (exact && n_groups == 1 && !(req[s].mode & LETHE_SCORES_ROW_MAX)) { /* no row max there */
            float *w = lethe_xmalloc(sizeof(float) * (size_t)(nc ? nc : 1));
            window_path(p, &req[s], w);
            CHECK_MSG(!memcmp(w, out + off, sizeof(float) * (size_t)nc), "seq %d mode %d: not bit-identical "
                      "to lethe_window_scores", s, req[s].mode);
            free(w);
        }
        free(ref);
        off += (size_t)n_groups * nc;
    }
    free(out);
}

static void test_modes(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 2};
    lethe_backend *be;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    static const int shapes[][3] = {{8, 2, 40}, {4, 4, 16}, {6, 1, 64}, {4, 2, 7}};
    static const int modes[] = {LETHE_SCORES_LOGIT_MAX, LETHE_SCORES_PROB_MAX, LETHE_SCORES_PROB_SUM,
                                LETHE_SCORES_PROB_MEAN,
                                /* rows reduced by max (KVzip's replay queries) */
                                LETHE_SCORES_PROB_MAX | LETHE_SCORES_ROW_MAX,
                                LETHE_SCORES_PROB_SUM | LETHE_SCORES_ROW_MAX};
    for (size_t sh = 0; sh < LETHE_ARRAY_LEN(shapes); sh++) {
        problem p;
        problem_init(&p, shapes[sh][0], shapes[sh][1], shapes[sh][2], 60, 500, 700);
        for (int cand = 0; cand < 2; cand++)
            for (size_t mi = 0; mi < LETHE_ARRAY_LEN(modes); mi++) {
                int mode = modes[mi] | (cand ? LETHE_SCORES_CAND_DENOM : 0);
                /* decode row; a SnapKV-like window over [s, L - r) with r < w (masked
                 * candidates); an H2O-like whole chunk over all keys; empty candidates */
                lethe_score_seq req[4] = {
                    {.q_row = 3, .n_rows = 1, .key_begin = 0, .n_keys = 300, .c0 = 4, .c1 = 290, .mode = mode},
                    {.q_row = 10, .n_rows = 16, .key_begin = 300, .n_keys = 140, .c0 = 2, .c1 = 136, .mode = mode},
                    {.q_row = 30, .n_rows = 25, .key_begin = 440, .n_keys = 60, .c0 = 0, .c1 = 60, .mode = mode},
                    {.q_row = 0, .n_rows = 2, .key_begin = 600, .n_keys = 9, .c0 = 5, .c1 = 5, .mode = mode},
                };
                run(be, &p, req, 4, 1, true);
                run(be, &p, req, 4, p.KH, false);
                run(be, &p, req, 4, p.H, false);
            }
        /* mixed modes in one call, as H2O batches prefill and decode sequences */
        lethe_score_seq mix[3] = {
            {.q_row = 0, .n_rows = 8, .key_begin = 0, .n_keys = 200, .c0 = 0, .c1 = 200, .mode = LETHE_SCORES_LOGIT_MAX},
            {.q_row = 8, .n_rows = 1, .key_begin = 200, .n_keys = 90, .c0 = 0, .c1 = 90, .mode = LETHE_SCORES_PROB_SUM},
            {.q_row = 9, .n_rows = 3, .key_begin = 100, .n_keys = 400, .c0 = 64, .c1 = 300,
             .mode = LETHE_SCORES_PROB_MAX | LETHE_SCORES_CAND_DENOM},
        };
        run(be, &p, mix, 3, 1, true);
        problem_free(&p);
    }
    lethe_backend_destroy(be);
}

/* LETHE_SCORES_QMEAN: the mean over the rows of the raw logits (as the mean
 * query's logit), max over each group's heads, against float64 */
static void test_qmean(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 2};
    lethe_backend *be;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    problem p;
    problem_init(&p, 8, 2, 40, 60, 500, 700);
    /* two chunks over their history: candidates end before the first row's own key */
    lethe_score_seq req[2] = {
        {.q_row = 0, .n_rows = 24, .key_begin = 0, .n_keys = 300, .c0 = 8, .c1 = 250,
         .mode = LETHE_SCORES_LOGIT_MAX | LETHE_SCORES_QMEAN},
        {.q_row = 24, .n_rows = 36, .key_begin = 300, .n_keys = 400, .c0 = 0, .c1 = 365,
         .mode = LETHE_SCORES_LOGIT_MAX | LETHE_SCORES_QMEAN},
    };
    for (int gi = 0; gi < 3; gi++) {
        const int n_groups = gi == 0 ? 1 : gi == 1 ? p.KH : p.H, per = p.H / n_groups;
        size_t n_out = lethe_attn_scores_out_len(req, 2, n_groups);
        float *out = lethe_xmalloc(sizeof(float) * n_out);
        lethe_attn_scores_args a = {.out = out, .q = p.q, .k_cache = p.k, .n_tokens = p.T, .n_seqs = 2,
                                    .seqs = req, .key_slots = p.slots, .n_key_slots = p.n_slot_list,
                                    .n_heads = p.H, .n_kv_heads = p.KH, .head_dim = p.D,
                                    .n_groups = n_groups, .scale = p.scale};
        be->ops->attn_scores(be, &a);
        size_t off = 0;
        for (int s = 0; s < 2; s++) {
            const int nc = req[s].c1 - req[s].c0;
            for (int g = 0; g < n_groups; g++)
                for (int j = 0; j < nc; j++) {
                    double best = -INFINITY;
                    for (int h = g * per; h < (g + 1) * per; h++) {
                        double m = 0;
                        for (int i = 0; i < req[s].n_rows; i++) m += raw_d(&p, &req[s], i, h, req[s].c0 + j);
                        best = fmax(best, m / req[s].n_rows);
                    }
                    const double x = out[off + (size_t)g * nc + j];
                    CHECK_MSG(fabs(x - best) <= 1e-5 * fabs(best) + 1e-5, "seq %d group %d [%d]: %.9g vs %.9g",
                              s, g, j, x, best);
                }
            off += (size_t)n_groups * nc;
        }
        free(out);
    }
    problem_free(&p);
    lethe_backend_destroy(be);
}

int main(void) {
    TEST_RUN(test_modes);
    TEST_RUN(test_qmean);
    return 0;
}

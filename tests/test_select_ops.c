/* test_select_ops.c - the CPU backend's device-side selection ops
 * (backend/cpu/select.c), the reference the CUDA twins are compared to.
 *
 *   topk           against an independent full-sort reference (its own
 *                  comparator: higher first, ties -> smaller index, NaN last,
 *                  -0.0 == +0.0) and lethe_topk_indices, many segments in one
 *                  call: empty segments, k = 0, k = len, ties, NaN, +-0,
 *                  +-inf; output guard entries must stay untouched
 *   select_expand  hand-built expected lists for Quest-like (unit 16, head 0,
 *                  a tail page of new tokens) and OmniKV-like (unit 1, head =
 *                  sink = pick_off, recent tail) layouts in one call, rows
 *                  that are sub-ranges of one array
 *   row_topk       against the same full-sort reference per row over the
 *                  columns below the row's limit of alpha x + bias: ties,
 *                  NaN, +-inf, +-0, limits 0, below k, equal to m; k 1..16,
 *                  bias and no bias, alpha 2 and -1; entries past the limit
 *                  -1, the entry after the output untouched
 * Fast (well under a second). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"
#include "backend/topk.h"
#include "test.h"

static lethe_backend *g_be;
static uint64_t g_rng = 777;

/* ---- reference top-k: sort everything, take the first k, sort ascending ---- */

typedef struct ranked {
    float v;
    int32_t i;
} ranked;

static int cmp_ranked(const void *pa, const void *pb) {
    const ranked *a = pa, *b = pb;
    const int na = isnan(a->v), nb = isnan(b->v);
    if (na != nb) return na - nb;                       /* NaN after numbers */
    if (!na && a->v != b->v) return a->v > b->v ? -1 : 1; /* higher first; -0 == +0 */
    return (a->i > b->i) - (a->i < b->i);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static void ref_topk(const float *x, int32_t n, int32_t k, int32_t *out) {
    ranked *r = lethe_xmalloc((size_t)(n ? n : 1) * sizeof(*r));
    for (int32_t i = 0; i < n; i++) r[i] = (ranked){x[i], i};
    qsort(r, (size_t)n, sizeof(*r), cmp_ranked);
    for (int32_t i = 0; i < k; i++) out[i] = r[i].i;
    qsort(out, (size_t)k, sizeof(*out), cmp_i32);
    free(r);
}

/* A segment's values: kind 0 random from a small set (heavy ties), 1 special
 * values (NaN, +-inf, +-0, a few numbers), 2 all equal, 3 distinct. */
static float draw(int kind, int32_t i) {
    const uint64_t r = lethe_splitmix64(&g_rng);
    switch (kind) {
    case 0: return (float)((int)(r % 9) - 4) * 0.25f;
    case 1: {
        static const float sp[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f, 0.5f};
        return sp[r % 8];
    }
    case 2: return 3.0f;
    default: return (float)i * 0.001f * (r % 2 ? 1.0f : -1.0f);
    }
}

static void test_topk(void) {
    enum { MAX_SEGS = 64 };
    static const int32_t lens[] = {0, 1, 2, 5, 17, 64, 100, 1000, 3001};
    int32_t seg_begin[MAX_SEGS + 1] = {0}, out_begin[MAX_SEGS + 1] = {0}, len[MAX_SEGS], ks[MAX_SEGS];
    int n_segs = 0;
    for (size_t li = 0; li < LETHE_ARRAY_LEN(lens); li++) {
        const int32_t n = lens[li];
        const int32_t kk[6] = {0, 1, n / 7, n / 2, n > 0 ? n - 1 : 0, n};
        for (int j = 0; j < 6; j++) {
            if (kk[j] > n || n_segs == MAX_SEGS) continue;
            len[n_segs] = n, ks[n_segs] = kk[j];
            seg_begin[n_segs + 1] = seg_begin[n_segs] + n;
            out_begin[n_segs + 1] = out_begin[n_segs] + kk[j];
            n_segs++;
        }
    }
    const int32_t total = seg_begin[n_segs], n_out = out_begin[n_segs];
    float *x = lethe_xmalloc((size_t)total * sizeof(float));
    int32_t *out = lethe_xmalloc((size_t)(n_out + 1) * sizeof(int32_t));
    int32_t *want = lethe_xmalloc((size_t)(n_out + 1) * sizeof(int32_t));
    int32_t *heap = lethe_xmalloc((size_t)(n_out + 1) * sizeof(int32_t));
    for (int kind = 0; kind < 4; kind++) {
        for (int s = 0; s < n_segs; s++)
            for (int32_t i = 0; i < len[s]; i++) x[seg_begin[s] + i] = draw((kind + s) % 4, i);
        for (int32_t i = 0; i <= n_out; i++) out[i] = -7; /* guard + unwritten marker */
        g_be->ops->topk(g_be, out, x, n_segs, seg_begin, out_begin);
        CHECK(out[n_out] == -7);
        for (int s = 0; s < n_segs; s++) {
            const float *xs = x + seg_begin[s];
            ref_topk(xs, len[s], ks[s], want + out_begin[s]);
            CHECK(lethe_topk_indices(xs, len[s], ks[s], heap + out_begin[s]) == ks[s]);
            for (int32_t j = out_begin[s]; j < out_begin[s + 1]; j++) {
                CHECK_MSG(out[j] == want[j] && heap[j] == want[j],
                          "kind %d seg %d (len %d k %d) [%d]: op %d, heap %d, ref %d", kind, s, len[s],
                          ks[s], j - out_begin[s], out[j], heap[j], want[j]);
            }
        }
    }
    /* the ordering's corner cases by hand: -0.0 ties +0.0 (smaller index
     * wins), NaN below -inf, +inf first */
    {
        const float v[6] = {-0.0f, NAN, 0.0f, -INFINITY, INFINITY, NAN};
        int32_t sb[2] = {0, 6}, ob[2] = {0, 2}, o[2];
        g_be->ops->topk(g_be, o, v, 1, sb, ob);
        CHECK(o[0] == 0 && o[1] == 4); /* +inf, then -0.0 (index 0 before +0.0 at 2) */
        ob[1] = 4;
        int32_t o4[4];
        g_be->ops->topk(g_be, o4, v, 1, sb, ob);
        CHECK(o4[0] == 0 && o4[1] == 2 && o4[2] == 3 && o4[3] == 4); /* NaNs last */
        ob[1] = 5;
        int32_t o5[5];
        g_be->ops->topk(g_be, o5, v, 1, sb, ob);
        CHECK(o5[0] == 0 && o5[1] == 1 && o5[4] == 4); /* the first NaN (index 1) */
    }
    free(x), free(out), free(want), free(heap);
}

/* ---- select_expand ------------------------------------------------------ */

static void test_select_expand(void) {
    /* one rows array holding two sequences' rows: Quest row at [0, 100),
     * OmniKV row at [100, 180); slot ids = 1000 + position in the array */
    int32_t rows[180];
    for (int i = 0; i < 180; i++) rows[i] = 1000 + i;
    /* Quest: unit 16, pages of a 100-entry row: tail = 96 (the page of the
     * new tokens, partial), picks pages 1, 3, 4 of the completed ones.
     * OmniKV: sink 4 (head = pick_off = 4), recent tail from entry 70 of
     * 80, picks entries 0, 5, 6, 65 of the middle [4, 70) (relative). */
    int32_t picks[7] = {1, 3, 4, 0, 5, 6, 65};
    const lethe_expand_seq seqs[2] = {
        {.row_begin = 0, .row_len = 100, .head = 0, .pick_begin = 0, .n_picks = 3, .pick_off = 0,
         .tail = 96, .out_begin = 0},
        {.row_begin = 100, .row_len = 80, .head = 4, .pick_begin = 3, .n_picks = 4, .pick_off = 4,
         .tail = 70, .out_begin = 3 * 16 + 4},
    };
    /* Quest part: 3 pages * 16 + the partial tail page (4 entries); OmniKV:
     * 4 sink + 4 picks + 10 recent */
    enum { N_Q = 3 * 16 + 4, N_O = 4 + 4 + 10 };
    int32_t want[N_Q + N_O], n = 0;
    const int32_t qpages[3] = {1, 3, 4};
    for (int p = 0; p < 3; p++)
        for (int j = 0; j < 16; j++) want[n++] = 1000 + qpages[p] * 16 + j;
    for (int e = 96; e < 100; e++) want[n++] = 1000 + e;
    for (int e = 0; e < 4; e++) want[n++] = 1100 + e;
    const int32_t opicks[4] = {0, 5, 6, 65};
    for (int p = 0; p < 4; p++) want[n++] = 1100 + 4 + opicks[p];
    for (int e = 70; e < 80; e++) want[n++] = 1100 + e;
    CHECK(n == N_Q + N_O);
    /* unit is per call: Quest (16) and OmniKV (1) into one output */
    int32_t out[N_Q + N_O + 1];
    for (int i = 0; i <= N_Q + N_O; i++) out[i] = -7;
    g_be->ops->select_expand(g_be, out, rows, picks, &seqs[0], 1, 16);
    g_be->ops->select_expand(g_be, out, rows, picks, &seqs[1], 1, 1);
    for (int i = 0; i < N_Q + N_O; i++)
        CHECK_MSG(out[i] == want[i], "select_expand [%d]: %d, want %d", i, out[i], want[i]);
    CHECK(out[N_Q + N_O] == -7);
    /* several sequences in one call (same unit): no picks, all picks, empty tail */
    const lethe_expand_seq many[3] = {
        {.row_begin = 0, .row_len = 10, .head = 2, .pick_begin = 0, .n_picks = 0, .pick_off = 2,
         .tail = 7, .out_begin = 0},
        {.row_begin = 10, .row_len = 6, .head = 0, .pick_begin = 0, .n_picks = 6, .pick_off = 0,
         .tail = 6, .out_begin = 5},
        {.row_begin = 0, .row_len = 0, .head = 0, .pick_begin = 0, .n_picks = 0, .pick_off = 0,
         .tail = 0, .out_begin = 11},
    };
    int32_t all[6] = {0, 1, 2, 3, 4, 5}, o2[12];
    for (int i = 0; i < 12; i++) o2[i] = -7;
    g_be->ops->select_expand(g_be, o2, rows, all, many, 3, 1);
    const int32_t w2[11] = {1000, 1001, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014, 1015};
    for (int i = 0; i < 11; i++) CHECK_MSG(o2[i] == w2[i], "many [%d]: %d, want %d", i, o2[i], w2[i]);
    CHECK(o2[11] == -7);
}

/* ---- row_topk ----------------------------------------------------------- */

static void ref_row_topk(const float *x, int32_t lim, int32_t k, float alpha, const float *bias,
                         int32_t *out) {
    ranked *r = lethe_xmalloc((size_t)(lim ? lim : 1) * sizeof(*r));
    for (int32_t c = 0; c < lim; c++) {
        const float ax = alpha * x[c];
        r[c] = (ranked){ax + (bias ? bias[c] : 0.0f), c};
    }
    qsort(r, (size_t)lim, sizeof(*r), cmp_ranked);
    for (int32_t j = 0; j < k; j++) out[j] = j < lim ? r[j].i : -1; /* best-first */
    free(r);
}

static void test_row_topk(void) {
    static const int32_t ms[] = {1, 3, 17, 200, 1500};
    static const int32_t ks[] = {1, 3, 4, 16};
    for (size_t mi = 0; mi < LETHE_ARRAY_LEN(ms); mi++)
        for (size_t ki = 0; ki < LETHE_ARRAY_LEN(ks); ki++)
            for (int kind = 0; kind < 4; kind++)
                for (int variant = 0; variant < 2; variant++) {
                    const int32_t m = ms[mi], k = ks[ki], n = 9;
                    const float alpha = variant ? -1.0f : 2.0f;
                    float *x = lethe_xmalloc((size_t)n * m * sizeof(float)), *bias = lethe_xmalloc((size_t)m * sizeof(float));
                    int32_t lim[9], *out = lethe_xmalloc(((size_t)n * k + 1) * sizeof(int32_t));
                    int32_t want[LETHE_ROW_TOPK_MAX];
                    for (int32_t i = 0; i < n; i++)
                        for (int32_t c = 0; c < m; c++) x[(size_t)i * m + c] = draw((kind + i) % 4, c);
                    /* bias from the same sets: ties between columns survive it */
                    for (int32_t c = 0; c < m; c++) bias[c] = kind == 1 ? draw(1, c) : draw(0, c);
                    /* limits: 0, 1, below k, k, m, and some in between */
                    const int32_t l0[9] = {0, 1, LETHE_MAX(0, k - 1), LETHE_MIN(k, m), m, m / 2, m,
                                           (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)(m + 1)), 0};
                    for (int32_t i = 0; i < n; i++) lim[i] = LETHE_MIN(l0[i], m);
                    for (size_t i = 0; i <= (size_t)n * k; i++) out[i] = -7;
                    const float *b = variant ? NULL : bias;
                    g_be->ops->row_topk(g_be, out, x, n, m, lim, k, alpha, b);
                    CHECK(out[(size_t)n * k] == -7);
                    for (int32_t i = 0; i < n; i++) {
                        ref_row_topk(x + (size_t)i * m, lim[i], k, alpha, b, want);
                        for (int32_t j = 0; j < k; j++)
                            CHECK_MSG(out[(size_t)i * k + j] == want[j],
                                      "m %d k %d kind %d variant %d row %d (lim %d) [%d]: op %d, ref %d", m, k,
                                      kind, variant, i, lim[i], j, out[(size_t)i * k + j], want[j]);
                    }
                    free(x), free(bias), free(out);
                }
    /* by hand: row [1, NaN, 3, 3, -inf, -0, +0], alpha 1, no bias */
    {
        const float v[7] = {1.0f, NAN, 3.0f, 3.0f, -INFINITY, -0.0f, 0.0f};
        int32_t lim = 7, o[7];
        g_be->ops->row_topk(g_be, o, v, 1, 7, &lim, 7, 1.0f, NULL);
        const int32_t w[7] = {2, 3, 0, 5, 6, 4, 1}; /* tie 3/3 to index 2; -0 ties +0; -inf; NaN last */
        for (int j = 0; j < 7; j++) CHECK_MSG(o[j] == w[j], "by hand [%d]: %d, want %d", j, o[j], w[j]);
        lim = 2; /* limit below k: the two columns, then -1 */
        g_be->ops->row_topk(g_be, o, v, 1, 7, &lim, 4, 1.0f, NULL);
        CHECK(o[0] == 0 && o[1] == 1 && o[2] == -1 && o[3] == -1);
    }
}

int main(void) {
    lethe_backend_params p = {.device = "cpu", .n_threads = 0};
    CHECK(lethe_backend_cpu_create(&p, &g_be) == LETHE_OK);
    CHECK(g_be->ops->topk && g_be->ops->select_expand && g_be->ops->row_topk);
    TEST_RUN(test_topk);
    TEST_RUN(test_select_expand);
    TEST_RUN(test_row_topk);
    g_be->ops->destroy(g_be); /* not lethe_backend_destroy: keeps CUDA out of the link */
    fprintf(stderr, "test_select_ops: ok\n");
    return 0;
}

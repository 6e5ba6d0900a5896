/* test_sparse_select.c - property tests of the shared selection machinery
 * (src/sparse/select_util.c, backend/topk.c) against brute-force float64 oracles:
 * top-k order and tie-breaking, keep sets (StreamingLLM ranges, SnapKV window
 * and top scores, pins), window scores in both modes and their accumulation
 * across chunks, H2O column sums, pooling, Quest page bounds, budget schedules. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/topk.h"
#include "core/util.h"
#include "sparse/select_util.h"
#include "test.h"

static uint64_t rng = 12345;
static float frand(void) { return (float)((lethe_splitmix64(&rng) >> 40) * 0x1p-24) * 2.0f - 1.0f; }
static int32_t irand(int32_t n) { return (int32_t)(lethe_splitmix64(&rng) % (uint64_t)n); }

/* brute force: index i is in the top-k iff fewer than k indices rank before it */
static void check_topk_brute(const float *s, int32_t n, int32_t k, const int32_t *got, int32_t ng) {
    CHECK_EQ_INT(ng, k < n ? k : n);
    for (int32_t a = 1; a < ng; a++) CHECK(got[a - 1] < got[a]);
    uint8_t *in = calloc((size_t)n, 1);
    for (int32_t a = 0; a < ng; a++) in[got[a]] = 1;
    for (int32_t i = 0; i < n; i++) {
        int32_t before = 0;
        for (int32_t j = 0; j < n; j++) before += lethe_rank_before(s[j], j, s[i], i);
        CHECK_MSG((before < k) == (in[i] != 0), "index %d (rank %d, k %d)", i, before, k);
    }
    free(in);
}

static void test_topk(void) {
    float s[300];
    int32_t out[300];
    for (int trial = 0; trial < 40; trial++) {
        int32_t n = 1 + irand(300), k = irand(n + 5);
        for (int32_t i = 0; i < n; i++) s[i] = (float)irand(7); /* many ties */
        if (trial % 5 == 0) s[irand(n)] = NAN;
        int32_t ng = lethe_topk_indices(s, n, k, out);
        check_topk_brute(s, n, k, out, ng);
    }
    /* ties: smaller position wins */
    float t[6] = {1, 2, 2, 2, 0, 2};
    CHECK_EQ_INT(lethe_topk_indices(t, 6, 2, out), 2);
    CHECK_EQ_INT(out[0], 1);
    CHECK_EQ_INT(out[1], 2);
    /* determinism: a second call gives the same set */
    int32_t out2[6];
    lethe_topk_indices(t, 6, 3, out);
    lethe_topk_indices(t, 6, 3, out2);
    CHECK(memcmp(out, out2, 3 * sizeof(int32_t)) == 0);
    CHECK_EQ_INT(out[2], 3);
}

static void test_reduce(void) {
    float in[4 * 5], out[5], g[2 * 5];
    for (int i = 0; i < 20; i++) in[i] = (float)(i % 7) - 3.0f;
    lethe_reduce_heads(in, 4, 5, 5, LETHE_REDUCE_MAX, out);
    for (int j = 0; j < 5; j++) {
        float m = -INFINITY;
        for (int h = 0; h < 4; h++) m = fmaxf(m, in[h * 5 + j]);
        CHECK(out[j] == m);
    }
    lethe_reduce_gqa(in, 4, 2, 5, 5, LETHE_REDUCE_MEAN, g);
    for (int kh = 0; kh < 2; kh++)
        for (int j = 0; j < 5; j++)
            CHECK(fabsf(g[kh * 5 + j] - (in[(2 * kh) * 5 + j] + in[(2 * kh + 1) * 5 + j]) / 2) < 1e-6f);
}

/* StreamingLLM: no scores, exactly [0, s) and [L - r, L) */
static void test_keep_streaming(void) {
    int32_t keep[1000];
    int32_t n = lethe_keep_sink_recent_topk(NULL, NULL, 1000, 64, 512, 0, keep);
    CHECK_EQ_INT(n, 576);
    for (int i = 0; i < 64; i++) CHECK_EQ_INT(keep[i], i);
    for (int i = 0; i < 512; i++) CHECK_EQ_INT(keep[64 + i], 488 + i);
    /* L <= s + r: everything */
    CHECK_EQ_INT(lethe_keep_sink_recent_topk(NULL, NULL, 500, 64, 512, 0, keep), 500);
    for (int i = 0; i < 500; i++) CHECK_EQ_INT(keep[i], i);
}

/* SnapKV-style: sink, recent (the observation window lies inside recent) and the top middle scores */
static void test_keep_topk(void) {
    enum { L = 400 };
    float s[L];
    int32_t keep[L];
    for (int trial = 0; trial < 20; trial++) {
        for (int i = 0; i < L; i++) s[i] = (float)irand(50);
        int32_t sk = irand(10), r = 1 + irand(40), k = irand(100);
        int32_t n = lethe_keep_sink_recent_topk(s, NULL, L, sk, r, k, keep);
        CHECK_EQ_INT(n, sk + k + r); /* |kept| equals the budget exactly when L > budget */
        uint8_t in[L] = {0};
        for (int i = 0; i < n; i++) {
            if (i) CHECK(keep[i - 1] < keep[i]);
            in[keep[i]] = 1;
        }
        for (int i = 0; i < sk; i++) CHECK(in[i]);
        for (int i = L - r; i < L; i++) CHECK(in[i]);
        /* every kept middle token ranks before every dropped one */
        for (int a = sk; a < L - r; a++)
            for (int b = sk; b < L - r; b++)
                if (in[a] && !in[b]) CHECK(lethe_rank_before(s[a], a, s[b], b));
    }
    /* pinned middle tokens are kept and count against k */
    uint8_t pin[L] = {0};
    for (int i = 0; i < L; i++) s[i] = (float)i; /* later = better */
    pin[10] = pin[20] = 1;
    int32_t n = lethe_keep_sink_recent_topk(s, pin, L, 4, 8, 5, keep);
    CHECK_EQ_INT(n, 4 + 5 + 8);
    int32_t expect[] = {0, 1, 2, 3, 10, 20, 389, 390, 391};
    for (int i = 0; i < 9; i++) CHECK_EQ_INT(keep[i], expect[i]);
}

/* naive float64 reference of lethe_window_scores */
static void window_ref(const float *raw, int H, int R, int E, int c0, int c1, int mode, bool cand,
                       double *out) {
    for (int j = c0; j < c1; j++) out[j - c0] = -INFINITY;
    for (int h = 0; h < H; h++) {
        double acc[64] = {0};
        for (int i = 0; i < R; i++) {
            const float *row = raw + ((size_t)h * R + i) * E;
            if (mode == 0) {
                for (int j = c0; j < c1; j++) out[j - c0] = fmax(out[j - c0], row[j]);
                continue;
            }
            int d0 = cand ? c0 : 0, d1 = cand ? c1 : E;
            double m = -INFINITY, l = 0;
            for (int e = d0; e < d1; e++) m = fmax(m, row[e]);
            for (int e = d0; e < d1; e++) l += exp(row[e] - m);
            for (int j = c0; j < c1; j++) acc[j - c0] += exp(row[j] - m) / l / R;
        }
        if (mode == 1)
            for (int j = c0; j < c1; j++) out[j - c0] = fmax(out[j - c0], acc[j - c0]);
    }
}

static void test_window_scores(void) {
    enum { H = 3, R = 4, E = 40 };
    float raw[H * R * E];
    for (int h = 0; h < H; h++)
        for (int i = 0; i < R; i++)
            for (int e = 0; e < E; e++) /* causal: window row i sees entries <= E - R + i */
                raw[(h * R + i) * E + e] = e <= E - R + i ? 3.0f * frand() : -INFINITY;
    float out[E];
    double ref[E];
    for (int mode = 0; mode < 2; mode++)
        for (int cand = 0; cand < 2; cand++) {
            lethe_window_scores(raw, H, (size_t)R * E, E, R, E, 5, 30, mode, cand, LETHE_REDUCE_MAX, out);
            window_ref(raw, H, R, E, 5, 30, mode, cand, ref);
            for (int j = 0; j < 25; j++)
                CHECK_MSG(fabs(out[j] - ref[j]) <= 1e-5 * fmax(1.0, fabs(ref[j])), "mode %d j %d", mode, j);
        }
    /* accumulation across chunks: max of the two halves' logits == one pass over all rows */
    float a[25], b[25];
    lethe_window_scores(raw, H, (size_t)R * E, E, 2, E, 5, 30, LETHE_SCORE_LOGITS, false, LETHE_REDUCE_MAX, a);
    lethe_window_scores(raw + 2 * E, H, (size_t)R * E, E, 2, E, 5, 30, LETHE_SCORE_LOGITS, false, LETHE_REDUCE_MAX, b);
    lethe_score_accumulate(a, b, 25, LETHE_REDUCE_MAX);
    lethe_window_scores(raw, H, (size_t)R * E, E, R, E, 5, 30, LETHE_SCORE_LOGITS, false, LETHE_REDUCE_MAX, out);
    CHECK(memcmp(a, out, sizeof(a)) == 0);
}

/* planted needle: one key aligned with all window queries survives a tiny budget */
static void test_needle(void) {
    enum { H = 2, R = 8, E = 200, D = 16 };
    static float keys[E][D], q[H][R][D], raw[H * R * E];
    for (int e = 0; e < E; e++)
        for (int c = 0; c < D; c++) keys[e][c] = 0.3f * frand();
    float dir[D];
    for (int c = 0; c < D; c++) dir[c] = frand();
    for (int c = 0; c < D; c++) keys[77][c] = 2.0f * dir[c];
    for (int h = 0; h < H; h++)
        for (int i = 0; i < R; i++)
            for (int c = 0; c < D; c++) q[h][i][c] = dir[c] + 0.3f * frand();
    for (int h = 0; h < H; h++)
        for (int i = 0; i < R; i++)
            for (int e = 0; e < E; e++) {
                float d = 0;
                for (int c = 0; c < D; c++) d += q[h][i][c] * keys[e][c];
                raw[(h * R + i) * E + e] = e <= E - R + i ? d / 4.0f : -INFINITY;
            }
    float sc[E];
    int32_t keep[E];
    for (int mode = 0; mode < 2; mode++) {
        for (int e = 0; e < E; e++) sc[e] = -INFINITY;
        lethe_window_scores(raw, H, (size_t)R * E, E, R, E, 4, E - R, mode, true, LETHE_REDUCE_MAX, sc + 4);
        int32_t n = lethe_keep_sink_recent_topk(sc, NULL, E, 4, R, 1, keep);
        CHECK_EQ_INT(n, 4 + 1 + R);
        CHECK_EQ_INT(keep[4], 77);
    }
}

/* H2O: on a 4-token toy the accumulated score equals the causal softmax column sums;
 * uniform attention shows the early-token bias (A decreasing in j) */
static void test_h2o_column_sums(void) {
    enum { T = 4 };
    float raw[T * T];
    float lg[T][T] = {{0.5f}, {1.0f, -1.0f}, {0.2f, 0.3f, 0.1f}, {-0.4f, 2.0f, 0.0f, 1.0f}};
    for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) raw[i * T + j] = j <= i ? lg[i][j] : -INFINITY;
    float a[T];
    /* per-head mean over rows of probabilities, times the row count = column sums */
    lethe_window_scores(raw, 1, T * T, T, T, T, 0, T, LETHE_SCORE_PROBABILITY, false, LETHE_REDUCE_SUM, a);
    double col[T] = {0};
    for (int i = 0; i < T; i++) {
        double l = 0;
        for (int j = 0; j <= i; j++) l += exp(lg[i][j]);
        for (int j = 0; j <= i; j++) col[j] += exp(lg[i][j]) / l;
    }
    for (int j = 0; j < T; j++) CHECK(fabs(a[j] * T - col[j]) < 1e-5);
    for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) raw[i * T + j] = j <= i ? 0.0f : -INFINITY;
    lethe_window_scores(raw, 1, T * T, T, T, T, 0, T, LETHE_SCORE_PROBABILITY, false, LETHE_REDUCE_SUM, a);
    for (int j = 1; j < T; j++) CHECK(a[j] < a[j - 1]);
    CHECK(fabs(a[0] * T - (1.0 + 0.5 + 1.0 / 3 + 0.25)) < 1e-5);
    /* softmax over tokens (the H2O logits mode) sums to 1 */
    float x[5] = {1, 2, -INFINITY, 0, 3};
    lethe_softmax_inplace(x, 5);
    CHECK(fabsf(x[0] + x[1] + x[2] + x[3] + x[4] - 1.0f) < 1e-6f && x[2] == 0.0f);
    /* scores stay aligned after compaction: new[i] == old[keep[i]] */
    float sc[6] = {10, 11, 12, 13, 14, 15};
    int32_t keep[3] = {0, 3, 5};
    lethe_gather_f32(sc, sc, keep, 3);
    CHECK(sc[0] == 10 && sc[1] == 13 && sc[2] == 15);
}

static void test_pool(void) {
    float in[20] = {0}, out[20];
    in[10] = 5.0f;
    lethe_pool1d(in, 20, 7, LETHE_REDUCE_MAX, out);
    for (int j = 0; j < 20; j++) CHECK(out[j] == ((j >= 7 && j <= 13) ? 5.0f : 0.0f));
    lethe_pool1d(in, 20, 5, LETHE_REDUCE_MEAN, out);
    for (int j = 0; j < 20; j++) CHECK(fabsf(out[j] - ((j >= 8 && j <= 12) ? 1.0f : 0.0f)) < 1e-6f);
    /* neighbours of a hot token survive a top-k after max-pooling */
    float s[30];
    for (int i = 0; i < 30; i++) s[i] = 0.01f * (float)i;
    s[15] = 9.0f;
    float p[30];
    lethe_pool1d(s, 30, 3, LETHE_REDUCE_MAX, p);
    int32_t top[3];
    lethe_topk_indices(p, 30, 3, top);
    CHECK(top[0] == 14 && top[1] == 15 && top[2] == 16);
    lethe_pool1d(s, 30, 1, LETHE_REDUCE_MAX, p);
    CHECK(memcmp(p, s, sizeof(s)) == 0);
}

static void test_quest(void) {
    enum { H = 4, HK = 2, D = 8, N = 53, P = 16 };
    const int32_t KV = HK * D, NP = (N + P - 1) / P;
    static float keys[N * HK * D], q[H * D];
    for (int i = 0; i < N * KV; i++) keys[i] = frand();
    float mn[4 * HK * D], mx[4 * HK * D], mn2[4 * HK * D], mx2[4 * HK * D];
    lethe_page_minmax_build(keys, N, KV, P, mn, mx);
    for (int t = 0; t < N; t++) /* incremental == scratch */
        lethe_page_minmax_add(mn2 + (t / P) * KV, mx2 + (t / P) * KV, keys + t * KV, KV, t % P == 0);
    CHECK(memcmp(mn, mn2, (size_t)NP * KV * 4) == 0 && memcmp(mx, mx2, (size_t)NP * KV * 4) == 0);
    for (int trial = 0; trial < 20; trial++) {
        for (int i = 0; i < H * D; i++) q[i] = 2.0f * frand();
        float u[4];
        lethe_quest_page_scores(q, H, HK, D, mn, mx, NP, u);
        /* soundness: U_p >= q_h . k_t for every token of the page and every head */
        for (int t = 0; t < N; t++)
            for (int h = 0; h < H; h++) {
                float d = 0;
                for (int c = 0; c < D; c++) d += q[h * D + c] * keys[t * KV + (h / 2) * D + c];
                CHECK(u[t / P] >= d - 1e-5f);
            }
        int32_t sel[4];
        for (int K = 1; K <= 5; K++) {
            int32_t n = lethe_quest_select_pages(u, NP, K, sel);
            CHECK_EQ_INT(n, K < NP ? K : NP);
            CHECK_EQ_INT(sel[n - 1], NP - 1); /* the current page always */
            for (int i = 1; i < n; i++) CHECK(sel[i - 1] < sel[i]);
        }
    }
}

static void test_pyramid(void) {
    int32_t b[30];
    lethe_pyramid_budgets(30, 64, 4096, 512, 0.6f, 0.01f, b);
    CHECK_EQ_INT(b[0], 64 + 4096 + 512);
    CHECK_EQ_INT(b[29], 64 + (int32_t)floor(4096 * 0.01 / 0.6) + 512);
    for (int l = 1; l < 30; l++) CHECK(b[l] <= b[l - 1]);
    /* original schedule: sum over layers equals N (C - w) within rounding, non-increasing */
    int32_t pb[32];
    lethe_pyramid_budgets_original(32, 2048, 8, 20, 10000, pb);
    long sum = 0;
    for (int l = 0; l < 32; l++) {
        sum += pb[l];
        if (l) CHECK(pb[l] <= pb[l - 1]);
    }
    CHECK(labs(sum - 32L * 2040) <= 32);
    CHECK(pb[0] > pb[31]);
    /* clamp (base / beta < w): max capped at L - w, min raised to keep the sum */
    lethe_pyramid_budgets_original(32, 108, 8, 20, 200, pb);
    CHECK_EQ_INT(pb[0], 192);
    CHECK_EQ_INT(pb[31], 8);
    sum = 0;
    for (int l = 0; l < 32; l++) sum += pb[l];
    CHECK(labs(sum - 32L * 100) <= 32);
    /* fallback: L < 2 base -> uniform */
    lethe_pyramid_budgets_original(32, 2048, 8, 20, 3000 - 1000, pb);
    for (int l = 0; l < 32; l++) CHECK_EQ_INT(pb[l], 2040);
}

int main(void) {
    TEST_RUN(test_topk);
    TEST_RUN(test_reduce);
    TEST_RUN(test_keep_streaming);
    TEST_RUN(test_keep_topk);
    TEST_RUN(test_window_scores);
    TEST_RUN(test_needle);
    TEST_RUN(test_h2o_column_sums);
    TEST_RUN(test_pool);
    TEST_RUN(test_quest);
    TEST_RUN(test_pyramid);
    return 0;
}

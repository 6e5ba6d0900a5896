/* test_cpu_ops.c - every CPU backend op against a naive float64 loop.
 *
 * Random inputs at edge sizes: single tokens, sizes that are not multiples
 * of the GEMM register/macro tiles or of the 8-wide vectors, head_dim
 * 20/64/128, GQA ratios 1/4/8, ragged multi-sequence attention batches with
 * a prefix + new tokens, permuted cache slots and sparse (subset) selections,
 * and the optional score output. GEMM determinism: the same output row is
 * bit-identical whatever the batch size, its position in the batch and the
 * thread count. Quest page ops (page_minmax over arbitrary slot lists with
 * partial pages, page_scores over several sequences) bit-identical to the
 * direct host computation of select_util.c. key_redundancy (R-KV) against
 * float64 with planted copies, bit-identical across SIMD tier and threads. Ends with a GEMM throughput line
 * (GFLOP/s) for the log. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"
#include "sparse/select_util.h"
#include "test.h"

static lethe_backend *g_be;   /* all cores */
static lethe_backend *g_be1;  /* one thread */
static uint64_t g_rng = 12345;

static float frand(void) { /* uniform [-1, 1) */
    return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0);
}

static float *rand_vec(size_t n) {
    float *v = lethe_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = frand();
    return v;
}

/* ---- matmul ---------------------------------------------------------------- */

static void ref_matmul(float *y, const float *x, const float *w, int n, int out, int in) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < out; j++) {
            double s = 0;
            for (int k = 0; k < in; k++) s += (double)x[(size_t)i * in + k] * w[(size_t)j * in + k];
            y[(size_t)i * out + j] = (float)s;
        }
}

static void test_matmul_sizes(void) {
    static const int sizes[][3] = {
        {1, 1, 1},   {1, 7, 13},   {2, 3, 8},     {5, 11, 33},  {4, 3, 16},   {67, 50, 72},
        {1, 100, 64}, {130, 97, 200}, {3, 576, 576}, {65, 49, 9}, {64, 48, 7},
    };
    for (size_t t = 0; t < LETHE_ARRAY_LEN(sizes); t++) {
        int n = sizes[t][0], out = sizes[t][1], in = sizes[t][2];
        float *x = rand_vec((size_t)n * in), *w = rand_vec((size_t)out * in);
        float *y = lethe_xmalloc((size_t)n * out * 4), *r = lethe_xmalloc((size_t)n * out * 4);
        g_be->ops->matmul(g_be, y, x, w, n, out, in);
        ref_matmul(r, x, w, n, out, in);
        CHECK_CLOSE(y, r, (size_t)n * out, 1e-5f * sqrtf((float)in), 1e-5f);
        free(x), free(w), free(y), free(r);
    }
}

/* Row r of x W^T must be bit-identical computed alone, inside batches of
 * several sizes at several offsets, and with 1 or all threads. */
static void test_matmul_determinism(void) {
    const int out = 203, in = 300, n_max = 70;
    float *x = rand_vec((size_t)n_max * in), *w = rand_vec((size_t)out * in);
    float *alone = lethe_xmalloc((size_t)out * 4);
    float *y = lethe_xmalloc((size_t)n_max * out * 4);
    float *xb = lethe_xmalloc((size_t)n_max * in * 4);
    const float *row = x + (size_t)5 * in;
    g_be1->ops->matmul(g_be1, alone, row, w, 1, out, in);
    static const int batch[] = {1, 2, 3, 5, 16, 17, 64, 65, 70};
    for (size_t b = 0; b < LETHE_ARRAY_LEN(batch); b++) {
        int n = batch[b];
        for (int at = 0; at < n; at += (n > 8 ? 7 : 1)) {
            memcpy(xb, x, (size_t)n * in * 4);
            memcpy(xb + (size_t)at * in, row, (size_t)in * 4);
            for (int th = 0; th < 2; th++) {
                lethe_backend *be = th ? g_be : g_be1;
                be->ops->matmul(be, y, xb, w, n, out, in);
                CHECK_MSG(!memcmp(y + (size_t)at * out, alone, (size_t)out * 4),
                          "row differs in batch %d at %d (threads %d)", n, at, th);
            }
        }
    }
    free(x), free(w), free(alone), free(y), free(xb);
}

/* ---- norm, elementwise, copies ---------------------------------------------- */

static void test_rmsnorm(void) {
    static const int dims[] = {1, 7, 64, 576, 1000};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(dims); t++) {
        int d = dims[t], n = 37;
        float *x = rand_vec((size_t)n * d), *w = rand_vec(d), *y = lethe_xmalloc((size_t)n * d * 4);
        float *r = lethe_xmalloc((size_t)n * d * 4);
        for (int i = 0; i < n; i++) {
            double ss = 0;
            for (int k = 0; k < d; k++) ss += (double)x[i * d + k] * x[i * d + k];
            double inv = 1.0 / sqrt(ss / d + 1e-5);
            for (int k = 0; k < d; k++) r[i * d + k] = (float)(w[k] * x[i * d + k] * inv);
        }
        g_be->ops->rmsnorm(g_be, y, x, w, n, d, 1e-5f);
        CHECK_CLOSE(y, r, (size_t)n * d, 1e-6f, 1e-5f);
        g_be->ops->rmsnorm(g_be, x, x, w, n, d, 1e-5f); /* in place */
        CHECK(!memcmp(x, y, (size_t)n * d * 4));
        free(x), free(w), free(y), free(r);
    }
}

static void test_elementwise(void) {
    const int n = 300, d = 301; /* > 65536 elements: the parallel path */
    size_t nd = (size_t)n * d;
    float *x = rand_vec(nd), *y = rand_vec(nd), *b = rand_vec(d), *o = lethe_xmalloc(nd * 4);
    float *x0 = lethe_xmalloc(nd * 4);
    memcpy(x0, x, nd * 4);
    g_be->ops->add(g_be, x, y, nd);
    for (size_t i = 0; i < nd; i++) CHECK(x[i] == x0[i] + y[i]);
    memcpy(x, x0, nd * 4);
    g_be->ops->add_bias(g_be, x, b, n, d);
    for (size_t i = 0; i < nd; i++) CHECK(x[i] == x0[i] + b[i % d]);
    for (size_t i = 0; i < nd; i++) x0[i] *= 12.0f; /* gate values in [-12, 12] */
    g_be->ops->swiglu(g_be, o, x0, y, nd);
    for (size_t i = 0; i < nd; i++) {
        double g = x0[i], ref = g / (1.0 + exp(-g)) * y[i];
        CHECK_MSG(fabs(o[i] - ref) <= 1e-6 + 1e-6 * fabs(ref), "swiglu %zu: %g vs %g", i, o[i], ref);
    }
    free(x), free(y), free(b), free(o), free(x0);
}

static void test_copies(void) {
    const int V = 50, d = 19, n = 9;
    float *table = rand_vec((size_t)V * d), *x = lethe_xmalloc((size_t)n * d * 4);
    int32_t tok[9] = {0, 49, 3, 3, 17, 25, 1, 48, 0};
    g_be->ops->embed(g_be, x, table, tok, n, d);
    for (int i = 0; i < n; i++) CHECK(!memcmp(x + i * d, table + tok[i] * d, d * 4));
    float *g = lethe_xmalloc((size_t)3 * d * 4);
    int32_t idx[3] = {8, 0, 4};
    g_be->ops->gather_rows(g_be, g, x, idx, 3, d);
    for (int i = 0; i < 3; i++) CHECK(!memcmp(g + i * d, x + idx[i] * d, d * 4));
    /* kv_store into permuted slots */
    const int kvd = 24, slots_n = 20;
    float *kc = calloc((size_t)slots_n * kvd, 4), *vc = calloc((size_t)slots_n * kvd, 4);
    float *k = rand_vec((size_t)4 * kvd), *v = rand_vec((size_t)4 * kvd);
    int32_t slots[4] = {19, 2, 7, 0};
    g_be->ops->kv_store(g_be, kc, vc, k, v, slots, 4, kvd);
    for (int i = 0; i < 4; i++) {
        CHECK(!memcmp(kc + slots[i] * kvd, k + i * kvd, kvd * 4));
        CHECK(!memcmp(vc + slots[i] * kvd, v + i * kvd, kvd * 4));
    }
    CHECK(kc[1 * kvd] == 0.0f && vc[18 * kvd + 3] == 0.0f);
    float *logits = lethe_xmalloc((size_t)n * d * 4);
    g_be->ops->logits_to_host(g_be, logits, x, (size_t)n * d);
    CHECK(!memcmp(logits, x, (size_t)n * d * 4));
    free(table), free(x), free(g), free(kc), free(vc), free(k), free(v), free(logits);
}

/* ---- rope ------------------------------------------------------------------ */

static void ref_inv_freq(const lethe_rope_config *rc, int d, double *f) {
    for (int i = 0; i < d / 2; i++) {
        double base = 1.0 / pow(rc->theta, (2.0 * i) / d);
        if (rc->scaling == LETHE_ROPE_SCALING_LINEAR) base /= rc->factor;
        if (rc->scaling == LETHE_ROPE_SCALING_LLAMA3) {
            double wl = 2 * M_PI / base, lo_wl = rc->original_max_pos / rc->low_freq_factor;
            double hi_wl = rc->original_max_pos / rc->high_freq_factor;
            if (wl > lo_wl) base = base / rc->factor;
            else if (wl >= hi_wl) {
                double s = (rc->original_max_pos / wl - rc->low_freq_factor) /
                           (rc->high_freq_factor - rc->low_freq_factor);
                base = (1 - s) * base / rc->factor + s * base;
            }
        }
        f[i] = base;
    }
}

static void check_rope(const lethe_rope_config *rc, int d, int n_heads) {
    const int n = 6;
    int32_t pos[6] = {0, 1, 2, 17, 1000, 4095};
    float *x = rand_vec((size_t)n * n_heads * d), *x0 = lethe_xmalloc((size_t)n * n_heads * d * 4);
    memcpy(x0, x, (size_t)n * n_heads * d * 4);
    double f[512];
    ref_inv_freq(rc, d, f);
    float ff[512];
    lethe_rope_inv_freq(rc, d, ff);
    for (int i = 0; i < d / 2; i++) CHECK_MSG(fabs(ff[i] - f[i]) <= 1e-6 * f[i], "inv_freq %d", i);
    g_be->ops->rope(g_be, x, pos, n, n_heads, d, rc);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < n_heads; h++)
            for (int i = 0; i < d / 2; i++) {
                size_t o = ((size_t)t * n_heads + h) * d;
                double a = pos[t] * f[i], c = cos(a), s = sin(a);
                double r1 = x0[o + i] * c - x0[o + i + d / 2] * s;
                double r2 = x0[o + i + d / 2] * c + x0[o + i] * s;
                /* fp32 angles at position 4095 are off by up to ~4095 ulp(1) */
                double tol = 2e-6 + 3e-7 * pos[t];
                CHECK_MSG(fabs(x[o + i] - r1) <= tol && fabs(x[o + i + d / 2] - r2) <= tol,
                          "rope t=%d h=%d i=%d", t, h, i);
            }
    free(x), free(x0);
}

static void test_rope(void) {
    lethe_rope_config rc = {.theta = 10000.0f, .scaling = LETHE_ROPE_SCALING_NONE};
    check_rope(&rc, 64, 3);
    check_rope(&rc, 128, 2);
    check_rope(&rc, 6, 1);
    rc.scaling = LETHE_ROPE_SCALING_LINEAR, rc.factor = 4.0f;
    check_rope(&rc, 64, 2);
    rc = (lethe_rope_config){.theta = 500000.0f, .scaling = LETHE_ROPE_SCALING_LLAMA3, .factor = 8.0f,
                             .low_freq_factor = 1.0f, .high_freq_factor = 4.0f,
                             .original_max_pos = 8192};
    check_rope(&rc, 128, 2);
    /* small original context: all three llama3 regions inside head_dim 16 */
    rc.original_max_pos = 32, rc.theta = 10000.0f;
    double f[8], plain[8];
    ref_inv_freq(&rc, 16, f);
    lethe_rope_config none = rc;
    none.scaling = LETHE_ROPE_SCALING_NONE;
    ref_inv_freq(&none, 16, plain);
    int n_high = 0, n_low = 0, n_mid = 0;
    for (int i = 0; i < 8; i++) {
        if (f[i] == plain[i]) n_high++;
        else if (fabs(f[i] - plain[i] / 8) < 1e-12) n_low++;
        else n_mid++;
    }
    CHECK(n_high > 0 && n_low > 0 && n_mid > 0);
    check_rope(&rc, 16, 4);
}

/* ---- attention ------------------------------------------------------------- */

typedef struct att_case {
    int n_heads, n_kv_heads, head_dim;
    int n_seqs;
    int n_prefix[4], n_new[4];
    int sparse; /* keep only some prefix entries */
    int per_head; /* per-KV-head selections: KV head g keeps its own subset of the prefix */
} att_case;

static void run_attention_case(const att_case *c, lethe_backend *be) {
    const int H = c->n_heads, KH = c->n_kv_heads, hd = c->head_dim, G = H / KH;
    int32_t q_begin[5] = {0}, sel_begin[5] = {0};
    int n_tok = 0, n_slots = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        n_tok += c->n_new[s];
        n_slots += c->n_prefix[s] + c->n_new[s];
    }
    n_slots += 5; /* unused slots */
    /* a random permutation of slots: logical token -> physical slot */
    int32_t *perm = lethe_xmalloc((size_t)n_slots * 4);
    for (int i = 0; i < n_slots; i++) perm[i] = i;
    for (int i = n_slots - 1; i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    size_t kvd = (size_t)KH * hd;
    float *kc = rand_vec((size_t)n_slots * kvd), *vc = rand_vec((size_t)n_slots * kvd);
    float *q = rand_vec((size_t)n_tok * H * hd);
    for (size_t i = 0; i < (size_t)n_tok * H * hd; i++) q[i] *= 3.0f; /* peakier softmax */
    int32_t *sel = lethe_xmalloc((size_t)n_slots * 4);
    int n_sel_total = 0, used = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        q_begin[s + 1] = q_begin[s] + c->n_new[s];
        for (int p = 0; p < c->n_prefix[s]; p++)
            if (!c->sparse || p % 3 != 1) sel[n_sel_total++] = perm[used + p];
        for (int p = 0; p < c->n_new[s]; p++) sel[n_sel_total++] = perm[used + c->n_prefix[s] + p];
        used += c->n_prefix[s] + c->n_new[s];
        sel_begin[s + 1] = n_sel_total;
    }
    /* per-head lists (varlen per head): head g drops prefix entry e when (e + g) % 3 == 0 */
    int32_t *hsel = lethe_xmalloc(((size_t)n_sel_total * KH + 1) * 4), hb[4 * 8 + 1];
    int n_h = 0;
    LETHE_ASSERT(c->n_seqs * KH <= 4 * 8);
    for (int s = 0; s < c->n_seqs; s++)
        for (int g = 0; g < KH; g++) {
            hb[s * KH + g] = n_h;
            const int n = sel_begin[s + 1] - sel_begin[s], pre = n - c->n_new[s];
            for (int e = 0; e < n; e++)
                if (e >= pre || (e + g) % 3 != 0) hsel[n_h++] = sel[sel_begin[s] + e];
        }
    hb[c->n_seqs * KH] = n_h;
    float *out = lethe_xmalloc((size_t)n_tok * H * hd * 4), *ref = lethe_xmalloc((size_t)n_tok * H * hd * 4);
    float scale = 1.0f / sqrtf((float)hd);
    lethe_attn_args a = {.out = out, .q = q, .k_cache = kc, .v_cache = vc, .n_tokens = n_tok,
                         .n_seqs = c->n_seqs, .q_begin = q_begin, .sel_begin = sel_begin,
                         .sel_slots = sel, .n_heads = H, .n_kv_heads = KH, .head_dim = hd,
                         .scale = scale};
    if (c->per_head) a.head_sel_begin = hb, a.head_sel_slots = hsel;
    be->ops->attention(be, &a);
    /* float64 reference */
    double *sc = lethe_xmalloc((size_t)n_sel_total * 8);
    for (int s = 0; s < c->n_seqs; s++) {
        int n_q = q_begin[s + 1] - q_begin[s];
        for (int j = 0; j < n_q; j++) {
            int row = q_begin[s] + j;
            for (int h = 0; h < H; h++) {
                /* the head's list: its KV head's own entries, or the sequence's */
                const int32_t *sl = c->per_head ? hsel + hb[s * KH + h / G] : sel + sel_begin[s];
                const int n_sel = c->per_head ? hb[s * KH + h / G + 1] - hb[s * KH + h / G]
                                              : sel_begin[s + 1] - sel_begin[s];
                const int lim = n_sel - n_q + j;
                const float *qv = q + ((size_t)row * H + h) * hd;
                double mx = -INFINITY, sum = 0;
                for (int e = 0; e <= lim; e++) {
                    const float *kv = kc + (size_t)sl[e] * kvd + (size_t)(h / G) * hd;
                    double d = 0;
                    for (int k = 0; k < hd; k++) d += (double)qv[k] * kv[k];
                    sc[e] = d * scale;
                    mx = fmax(mx, sc[e]);
                }
                for (int e = 0; e <= lim; e++) sum += exp(sc[e] - mx);
                for (int k = 0; k < hd; k++) {
                    double o = 0;
                    for (int e = 0; e <= lim; e++)
                        o += exp(sc[e] - mx) / sum * vc[(size_t)sl[e] * kvd + (size_t)(h / G) * hd + k];
                    ref[((size_t)row * H + h) * hd + k] = (float)o;
                }
            }
        }
    }
    CHECK_CLOSE(out, ref, (size_t)n_tok * H * hd, 2e-6f, 1e-4f);
    free(perm), free(kc), free(vc), free(q), free(sel), free(out), free(ref), free(sc), free(hsel);
}

static void test_attention(void) {
    static const att_case cases[] = {
        /* one token, no prefix */
        {4, 4, 64, 1, {0}, {1}, 0, 0},
        /* decode steps of several sequences, GQA 4 */
        {8, 2, 64, 3, {5, 40, 1}, {1, 1, 1}, 0, 0},
        /* ragged prefill + prefix chunks, GQA 8, head_dim 128, > one softmax block */
        {8, 1, 128, 4, {0, 70, 3, 33}, {9, 5, 1, 40}, 0, 0},
        /* sparse selection of the prefix, GQA 1, odd head_dim */
        {3, 3, 20, 2, {50, 9}, {3, 7}, 1, 0},
        {16, 2, 64, 2, {100, 0}, {2, 66}, 1, 0},
        /* per-KV-head selections: decode, prefill after a prefix, GQA 1 odd head_dim */
        {8, 2, 64, 3, {5, 40, 1}, {1, 1, 1}, 0, 1},
        {8, 4, 128, 2, {70, 33}, {5, 40}, 1, 1},
        {3, 3, 20, 2, {50, 9}, {3, 7}, 0, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) {
        run_attention_case(&cases[i], g_be);
        run_attention_case(&cases[i], g_be1);
    }
}

/* A query's output is bit-identical computed inside a prefill chunk (in a tile
 * with its neighbours) or alone as a one-token step over the same entries. */
static void test_attention_tile_invariance(void) {
    /* {n_heads, GQA group, head_dim}: tiles of 16/G queries (G = 1, 3, 8) */
    static const int groups[][3] = {{3, 1, 64}, {8, 8, 64}, {9, 3, 64}, {8, 1, 128}, {6, 3, 20}};
    for (size_t gi = 0; gi < LETHE_ARRAY_LEN(groups); gi++) {
        const int H = groups[gi][0], KH = H / groups[gi][1], hd = groups[gi][2];
        const int P = 37, NQ = 40, n = P + NQ, kvd = KH * hd;
        float *kc = rand_vec((size_t)n * kvd), *vc = rand_vec((size_t)n * kvd);
        float *q = rand_vec((size_t)NQ * H * hd), *out = lethe_xmalloc((size_t)NQ * H * hd * 4);
        float *one = lethe_xmalloc((size_t)H * hd * 4);
        int32_t *sel = lethe_xmalloc((size_t)n * 4);
        for (int i = 0; i < n; i++) sel[i] = n - 1 - i; /* reversed slots */
        int32_t qb[2] = {0, NQ}, sb[2] = {0, n};
        lethe_attn_args a = {.out = out, .q = q, .k_cache = kc, .v_cache = vc, .n_tokens = NQ,
                             .n_seqs = 1, .q_begin = qb, .sel_begin = sb, .sel_slots = sel,
                             .n_heads = H, .n_kv_heads = KH, .head_dim = hd, .scale = 0.3f};
        g_be->ops->attention(g_be, &a);
        for (int j = 0; j < NQ; j++) {
            int32_t qb1[2] = {0, 1}, sb1[2] = {0, P + j + 1};
            lethe_attn_args b = a;
            b.out = one, b.q = q + (size_t)j * H * hd, b.n_tokens = 1, b.q_begin = qb1;
            b.sel_begin = sb1;
            g_be1->ops->attention(g_be1, &b);
            CHECK_MSG(!memcmp(one, out + (size_t)j * H * hd, (size_t)H * hd * 4),
                      "H=%d KH=%d hd=%d query %d differs alone", H, KH, hd, j);
        }
        free(kc), free(vc), free(q), free(out), free(one), free(sel);
    }
}

/* ---- throughput (for the log; asserts nothing about speed) ----------------- */

static void bench_matmul(void) {
    static const int shapes[][3] = {{512, 1536, 576}, {512, 576, 1536}, {1, 1536, 576}};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(shapes); t++) {
        int n = shapes[t][0], out = shapes[t][1], in = shapes[t][2];
        float *x = rand_vec((size_t)n * in), *w = rand_vec((size_t)out * in);
        float *y = lethe_xmalloc((size_t)n * out * 4);
        g_be->ops->matmul(g_be, y, x, w, n, out, in); /* warm */
        int reps = n == 1 ? 200 : 3;
        double t0 = lethe_time_s();
        for (int r = 0; r < reps; r++) g_be->ops->matmul(g_be, y, x, w, n, out, in);
        double dt = (lethe_time_s() - t0) / reps;
        fprintf(stderr, "  matmul n=%d out=%d in=%d: %.1f GFLOP/s (%d threads)\n", n, out, in,
                2.0 * n * out * in / dt * 1e-9, lethe_cpu_threads(g_be));
        free(x), free(w), free(y);
    }
}

/* ---- Quest page ops --------------------------------------------------------- */

/* page_minmax over pages of arbitrary slots (lengths 1..P, so partial pages)
 * and permuted meta page ids == lethe_page_minmax_build over the gathered
 * keys; page_scores of three sequences (query rows, page lists sharing meta
 * pages) == lethe_quest_page_scores, and per KV head ==
 * lethe_quest_page_scores_grouped. Bit-identical, both thread counts. */
static void test_page_ops(void) {
    enum { NS = 300, HK = 2, G = 4, D = 24, KVD = HK * D, P = 16, NP = 23, NMETA = 40, NQ = 5 };
    float *K = rand_vec((size_t)NS * KVD), *q = rand_vec((size_t)NQ * G * HK * D);
    for (int i = 0; i < NS * KVD; i += 7) K[i] = 0.0f; /* ties with the fold order */
    int32_t ids[NP], beg[NP + 1], slots[NP * P], n_slots = 0, len[NP];
    for (int i = 0; i < NMETA && i < NP; i++) ids[i] = (i * 17 + 5) % NMETA; /* distinct */
    for (int i = 0; i < NP; i++) {
        len[i] = i % 5 == 4 ? 1 + i % P : P; /* some partial pages */
        beg[i] = n_slots;
        for (int j = 0; j < len[i]; j++) slots[n_slots++] = (int32_t)(lethe_splitmix64(&g_rng) % NS);
    }
    beg[NP] = n_slots;
    lethe_backend *bes[2] = {g_be, g_be1};
    for (int b = 0; b < 2; b++) {
        float *meta = lethe_xcalloc((size_t)NMETA * 2 * KVD, sizeof(float));
        bes[b]->ops->page_minmax(bes[b], meta, K, ids, beg, slots, NP, KVD);
        for (int i = 0; i < NP; i++) {
            float keys[P * KVD], mn[KVD], mx[KVD];
            for (int j = 0; j < len[i]; j++) memcpy(keys + j * KVD, K + (size_t)slots[beg[i] + j] * KVD, sizeof(float) * KVD);
            lethe_page_minmax_build(keys, len[i], KVD, P, mn, mx);
            CHECK(!memcmp(meta + (size_t)ids[i] * 2 * KVD, mn, sizeof(mn)));
            CHECK(!memcmp(meta + (size_t)ids[i] * 2 * KVD + KVD, mx, sizeof(mx)));
        }
        /* three sequences: pages [0, 9), [9, 9) (none), [9, 23) reversed */
        int32_t rows[3] = {4, 0, 2}, pbeg[4] = {0, 9, 9, 23}, pids[23];
        for (int i = 0; i < 9; i++) pids[i] = ids[i];
        for (int i = 9; i < 23; i++) pids[i] = ids[NP - 1 - (i - 9)];
        float out[23], want[1];
        for (int i = 0; i < 23; i++) out[i] = NAN;
        bes[b]->ops->page_scores(bes[b], out, q, meta, 3, rows, pbeg, pids, G * HK, HK, D, 1, false);
        for (int s = 0; s < 3; s++)
            for (int i = pbeg[s]; i < pbeg[s + 1]; i++) {
                const float *pm = meta + (size_t)pids[i] * 2 * KVD;
                lethe_quest_page_scores(q + (size_t)rows[s] * G * HK * D, G * HK, HK, D, pm, pm + KVD, 1, want);
                CHECK_MSG(!memcmp(&out[i], want, sizeof(float)), "page %d: %g vs %g", i, (double)out[i],
                          (double)want[0]);
            }
        /* per KV head: sequence s's [HK, n_s] block from HK * pbeg[s] */
        float outg[HK * 23], wantg[HK];
        for (int i = 0; i < HK * 23; i++) outg[i] = NAN;
        bes[b]->ops->page_scores(bes[b], outg, q, meta, 3, rows, pbeg, pids, G * HK, HK, D, HK, false);
        for (int s = 0; s < 3; s++)
            for (int i = pbeg[s]; i < pbeg[s + 1]; i++) {
                const float *pm = meta + (size_t)pids[i] * 2 * KVD;
                lethe_quest_page_scores_grouped(q + (size_t)rows[s] * G * HK * D, G * HK, HK, D, pm, pm + KVD, 1,
                                                HK, wantg);
                for (int g = 0; g < HK; g++) {
                    const float got = outg[HK * pbeg[s] + g * (pbeg[s + 1] - pbeg[s]) + (i - pbeg[s])];
                    CHECK_MSG(!memcmp(&got, &wantg[g], sizeof(float)), "page %d KV head %d: %g vs %g", i, g,
                              (double)got, (double)wantg[g]);
                }
            }
        free(meta);
    }
    free(K);
    free(q);
}

/* ---- key redundancy (R-KV) ------------------------------------------------ */

/* key_redundancy against a float64 oracle of its definition (mean cosine to
 * the other keys, minus the cosine to the newest near-copy for the older
 * copies' newest copy), with planted exact and scaled copies; both SIMD tiers
 * and both thread counts give the same bits (the lane sums of redundancy.c). */
static void test_key_redundancy(void) {
    static const int shapes[][3] = {{1, 64, 40}, {2, 128, 700}, {3, 96, 257}, {1, 20, 13}, {2, 576, 100}, {3, 64, 9}};
    const lethe_cpu_isa have = ((lethe_cpu_ctx *)g_be->ctx)->isa;
    for (size_t si = 0; si < LETHE_ARRAY_LEN(shapes); si++) {
        const int KV = shapes[si][0], D = shapes[si][1], n = shapes[si][2], n_slots = 2 * n + 7;
        const size_t kvd = (size_t)KV * D;
        float *kc = rand_vec((size_t)n_slots * kvd);
        int32_t *slots = lethe_xmalloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) slots[i] = (int32_t)((i * 2 + 3) % n_slots);
        const int a = n / 3, b = n / 2, c = 2 * n / 3; /* a -> b, c exact; 1 -> 5 scaled */
        for (size_t d = 0; d < kvd; d++) {
            kc[(size_t)slots[b] * kvd + d] = kc[(size_t)slots[c] * kvd + d] = kc[(size_t)slots[a] * kvd + d];
            kc[(size_t)slots[5] * kvd + d] = 2.0f * kc[(size_t)slots[1] * kvd + d];
        }
        const float thr = 0.5f;
        float *o[4];
        lethe_backend *bes[2] = {g_be, g_be1};
        for (int v = 0; v < 4; v++) { /* (avx2 | scalar) x (all threads | one) */
            lethe_backend *be = bes[v & 1];
            ((lethe_cpu_ctx *)be->ctx)->isa = v < 2 ? have : LETHE_ISA_SCALAR;
            o[v] = lethe_xmalloc((size_t)KV * n * sizeof(float));
            be->ops->key_redundancy(be, o[v], kc, slots, n, KV, D, thr);
            ((lethe_cpu_ctx *)be->ctx)->isa = have;
        }
        for (int v = 1; v < 4; v++)
            CHECK_MSG(!memcmp(o[0], o[v], (size_t)KV * n * sizeof(float)),
                      "key_redundancy KV=%d D=%d n=%d: variant %d not bit-identical", KV, D, n, v);
        double worst = 0;
        for (int h = 0; h < KV; h++) {
            double *cs = lethe_xmalloc((size_t)n * n * sizeof(double)), *nr = lethe_xmalloc((size_t)n * sizeof(double));
            for (int i = 0; i < n; i++) {
                const float *k = kc + (size_t)slots[i] * kvd + (size_t)h * D;
                double s = 0;
                for (int d = 0; d < D; d++) s += (double)k[d] * k[d];
                nr[i] = sqrt(s);
            }
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) {
                    const float *ki = kc + (size_t)slots[i] * kvd + (size_t)h * D, *kj = kc + (size_t)slots[j] * kvd + (size_t)h * D;
                    double s = 0;
                    for (int d = 0; d < D; d++) s += (double)ki[d] * kj[d];
                    cs[(size_t)i * n + j] = s / (nr[i] * nr[j]);
                }
            double *want = lethe_xcalloc((size_t)n, sizeof(double));
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++)
                    if (j != i) want[i] += cs[(size_t)i * n + j];
            for (int i = 0; i < n; i++) { /* the newest copy does not count its older copies */
                int last = -1;
                for (int j = i + 1; j < n; j++)
                    if (cs[(size_t)i * n + j] > thr) last = j;
                if (last >= 0) want[last] -= cs[(size_t)i * n + last];
            }
            for (int i = 0; i < n; i++) {
                const double err = fabs(o[0][(size_t)h * n + i] - want[i] / n);
                worst = fmax(worst, err);
                CHECK_MSG(err <= 1e-5, "key_redundancy KV=%d D=%d n=%d [%d, %d]: %.7g vs %.7g", KV, D, n, h, i,
                          (double)o[0][(size_t)h * n + i], want[i] / n);
            }
            CHECK(o[0][(size_t)h * n + c] < o[0][(size_t)h * n + a] && o[0][(size_t)h * n + 5] < o[0][(size_t)h * n + 1]);
            free(cs), free(nr), free(want);
        }
        fprintf(stderr, "    key_redundancy KV=%d D=%d n=%-4d (%s and scalar) max abs err %.2e\n", KV, D, n,
                lethe_cpu_isa_name(have), worst);
        free(kc), free(slots);
        for (int v = 0; v < 4; v++) free(o[v]);
    }
}

int main(void) {
    lethe_backend_params p = {.device = "cpu", .n_threads = 0};
    CHECK(lethe_backend_cpu_create(&p, &g_be) == LETHE_OK);
    p.n_threads = 1;
    CHECK(lethe_backend_cpu_create(&p, &g_be1) == LETHE_OK);
    p.n_threads = -1;
    lethe_backend *bad = NULL;
    CHECK(lethe_backend_cpu_create(&p, &bad) == LETHE_ERR_INVALID && bad == NULL);
    CHECK(!strcmp(g_be->ops->name, "cpu") && g_be->ops->act_size == 4);
    /* host memory, no graphs, no profiler (backend.h capabilities) */
    CHECK(g_be->ops->caps == LETHE_BE_HOST_MEMORY && lethe_backend_has(g_be, LETHE_BE_HOST_MEMORY));
    CHECK(!lethe_backend_has(g_be, LETHE_BE_GRAPHS));
    CHECK(!lethe_backend_has(NULL, LETHE_BE_HOST_MEMORY));
    TEST_RUN(test_matmul_sizes);
    TEST_RUN(test_matmul_determinism);
    TEST_RUN(test_rmsnorm);
    TEST_RUN(test_elementwise);
    TEST_RUN(test_copies);
    TEST_RUN(test_rope);
    TEST_RUN(test_attention);
    TEST_RUN(test_attention_tile_invariance);
    TEST_RUN(test_page_ops);
    TEST_RUN(test_key_redundancy);
    TEST_RUN(bench_matmul);
    g_be->ops->destroy(g_be); /* not lethe_backend_destroy: keeps CUDA out of the link */
    g_be1->ops->destroy(g_be1);
    fprintf(stderr, "test_cpu_ops: ok\n");
    return 0;
}

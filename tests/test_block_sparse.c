/* test_block_sparse.c - block-sparse prefill attention on the CPU backend
 * (backend.h lethe_block_sparse, backend/cpu/attention_bsp.c + attention.c)
 * and the flashprefill method's knobs. The properties of methods.md §18.5:
 *   - threshold 0 reads every block: bit-identical to dense attention
 *     (shapes with GQA 1/3/4, head_dim 16/64/40, chunks with and without a
 *     prefix, lengths off the block size, blocks 32 and 128);
 *   - sink, window, diagonal and last-query blocks are always read, and at
 *     threshold 1 nothing else (the keep sets of lethe_cpu_bsp_plan);
 *   - a planted key block the queries attend to is chosen at a middle
 *     threshold, the others are not;
 *   - the output is the float64 reference of the same definition: attention
 *     over the kept blocks' entries, plus (mean correction) one pseudo-entry
 *     per skipped block with its mean key / value and logit + ln B;
 *   - sequences shorter than min_q (and decode rows) attend densely in the
 *     same call; the whole choice is deterministic across thread counts. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/args.h"
#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"
#include "sparse/sparse.h"
#include "test.h"

static lethe_backend *g_be, *g_be1;
static uint64_t g_rng = 77;

static float frand(void) { return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0); }

/* one attention call: n_seqs sequences, each n_pre prefix entries + n_q new
 * tokens over a random slot permutation */
typedef struct bcase {
    int H, KH, hd, n_seqs;
    int n_pre[3], n_q[3];
} bcase;

typedef struct bdata {
    bcase c;
    int32_t q_begin[4], sel_begin[4];
    int32_t *sel;
    float *kc, *vc, *q;
    int n_tok, n_slots;
} bdata;

static void make(bdata *d, const bcase *c, float qscale) {
    memset(d, 0, sizeof(*d));
    d->c = *c;
    for (int s = 0; s < c->n_seqs; s++) {
        d->q_begin[s + 1] = d->q_begin[s] + c->n_q[s];
        d->sel_begin[s + 1] = d->sel_begin[s] + c->n_pre[s] + c->n_q[s];
    }
    d->n_tok = d->q_begin[c->n_seqs];
    d->n_slots = d->sel_begin[c->n_seqs] + 3;
    d->sel = lethe_xmalloc((size_t)d->n_slots * sizeof(int32_t));
    for (int i = 0; i < d->n_slots; i++) d->sel[i] = i;
    for (int i = d->n_slots - 1; i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = d->sel[i];
        d->sel[i] = d->sel[j];
        d->sel[j] = t;
    }
    const size_t kvd = (size_t)c->KH * c->hd;
    d->kc = lethe_xmalloc((size_t)d->n_slots * kvd * sizeof(float));
    d->vc = lethe_xmalloc((size_t)d->n_slots * kvd * sizeof(float));
    d->q = lethe_xmalloc((size_t)d->n_tok * c->H * c->hd * sizeof(float));
    for (size_t i = 0; i < (size_t)d->n_slots * kvd; i++) d->kc[i] = frand(), d->vc[i] = frand();
    for (size_t i = 0; i < (size_t)d->n_tok * c->H * c->hd; i++) d->q[i] = qscale * frand();
}
static void unmake(bdata *d) {
    free(d->sel);
    free(d->kc);
    free(d->vc);
    free(d->q);
}

static lethe_attn_args args(const bdata *d, float *out, const lethe_block_sparse *bsp) {
    return (lethe_attn_args){.out = out, .q = d->q, .k_cache = d->kc, .v_cache = d->vc,
                             .n_tokens = d->n_tok, .n_seqs = d->c.n_seqs, .q_begin = d->q_begin,
                             .sel_begin = d->sel_begin, .sel_slots = d->sel, .n_heads = d->c.H,
                             .n_kv_heads = d->c.KH, .head_dim = d->c.hd,
                             .scale = 1.0f / sqrtf((float)d->c.hd), .bsp = bsp};
}

static float *run(lethe_backend *be, const bdata *d, const lethe_block_sparse *bsp) {
    float *out = lethe_xmalloc((size_t)d->n_tok * d->c.H * d->c.hd * sizeof(float));
    lethe_attn_args a = args(d, out, bsp);
    be->ops->attention(be, &a);
    return out;
}

static lethe_block_sparse params(int B, float thr, bool mc) {
    return (lethe_block_sparse){.block = B, .sink_blocks = 1, .window_blocks = 2, .last_q_blocks = 1,
                                .min_q = 2, .threshold = thr, .mean_correction = mc};
}

static const bcase g_cases[] = {
    {4, 4, 16, 1, {0}, {300}},             /* MHA, prefill from 0, off the block size */
    {6, 2, 64, 1, {200}, {257}},           /* GQA 3, an extend chunk with a prefix */
    {8, 2, 40, 2, {0, 77}, {130, 400}},    /* GQA 4, head_dim off the vectors, two sequences */
    {4, 1, 16, 3, {33, 0, 500}, {1, 5, 190}}, /* a decode row, a short chunk, a long one */
};

/* threshold 0: every block is read, the output is dense attention's bit for bit */
static void test_threshold0_is_dense(void) {
    for (size_t i = 0; i < LETHE_ARRAY_LEN(g_cases); i++)
        for (int B = 32; B <= 128; B += 96)
            for (int mc = 0; mc < 2; mc++) {
                bdata d;
                make(&d, &g_cases[i], 2.0f);
                lethe_block_sparse p = params(B, 0.0f, mc);
                float *dense = run(g_be, &d, NULL), *sp = run(g_be, &d, &p);
                CHECK_MSG(!memcmp(dense, sp, (size_t)d.n_tok * d.c.H * d.c.hd * sizeof(float)),
                          "case %zu block %d: threshold 0 differs from dense", i, B);
                free(dense);
                free(sp);
                unmake(&d);
            }
}

/* keep sets: forced blocks always; at threshold 1 exactly them */
static void test_forced_blocks(void) {
    bdata d;
    const bcase c = {4, 2, 16, 1, {100}, {700}};
    make(&d, &c, 1.0f);
    for (int k = 0; k < 3; k++) {
        lethe_block_sparse p = params(32, 1.0f, false);
        p.sink_blocks = 1 + k, p.window_blocks = 2 + k, p.last_q_blocks = k;
        float *o = lethe_xmalloc((size_t)d.n_tok * d.c.H * d.c.hd * sizeof(float));
        lethe_attn_args a = args(&d, o, &p);
        lethe_cpu_bsp *bp = lethe_cpu_bsp_plan(&a);
        CHECK(bp && bp[0].keep);
        const int32_t n_sel = d.sel_begin[1], n_q = d.q_begin[1];
        int64_t kept = 0, visible = 0;
        for (int32_t t = 0; t < bp[0].nqb; t++) {
            int32_t kb_last, n_full;
            lethe_bsp_block_range(&p, n_q, n_sel, t, &kb_last, &n_full);
            for (int g = 0; g < d.c.KH; g++)
                for (int32_t b = 0; b < bp[0].nkb; b++) {
                    const bool keep = bp[0].keep[((size_t)t * d.c.KH + g) * bp[0].nkb + b];
                    const bool want = b <= kb_last && lethe_bsp_forced(&p, t, bp[0].nqb, b, kb_last, n_full);
                    CHECK_MSG(keep == want, "t %d g %d b %d: keep %d, forced %d", t, g, b, keep, want);
                    if (b < p.sink_blocks && b <= kb_last) CHECK(keep);         /* sink */
                    if (b <= kb_last && b > kb_last - p.window_blocks) CHECK(keep); /* local */
                    kept += keep, visible += b <= kb_last;
                }
        }
        CHECK_MSG(kept * (k == 0 ? 2 : 1) < visible, "k %d: %lld of %lld blocks kept", k, (long long)kept, (long long)visible);
        lethe_cpu_bsp_free(bp, 1);
        free(o);
    }
    /* prompt_end: the last query blocks are dense only in a prompt's last chunk */
    for (int end = 0; end < 2; end++) {
        const bool flag = end != 0;
        lethe_block_sparse p = params(32, 1.0f, false), want_p = p;
        p.last_q_blocks = 3;
        p.prompt_end = &flag;
        want_p.last_q_blocks = end ? 3 : 0;
        float *o = lethe_xmalloc((size_t)d.n_tok * d.c.H * d.c.hd * sizeof(float));
        lethe_attn_args a = args(&d, o, &p);
        CHECK_EQ_INT(lethe_bsp_last_q(&a, 0), want_p.last_q_blocks);
        lethe_cpu_bsp *bp = lethe_cpu_bsp_plan(&a);
        const int32_t n_sel = d.sel_begin[1], n_q = d.q_begin[1];
        for (int32_t t = 0; t < bp[0].nqb; t++) {
            int32_t kb_last, n_full;
            lethe_bsp_block_range(&p, n_q, n_sel, t, &kb_last, &n_full);
            for (int g = 0; g < d.c.KH; g++)
                for (int32_t b = 0; b < bp[0].nkb; b++)
                    CHECK(bp[0].keep[((size_t)t * d.c.KH + g) * bp[0].nkb + b] ==
                          (b <= kb_last && lethe_bsp_forced(&want_p, t, bp[0].nqb, b, kb_last, n_full)));
        }
        lethe_cpu_bsp_free(bp, 1);
        free(o);
    }
    unmake(&d);
}

/* a key block aligned with every query of the chunk is chosen at a middle
 * threshold; the random blocks are not */
static void test_planted_block(void) {
    bdata d;
    const bcase c = {2, 1, 16, 1, {0}, {640}};
    make(&d, &c, 0.05f);
    const int B = 32, planted = 7; /* entries [224, 256) */
    float dir[16];
    for (int i = 0; i < 16; i++) dir[i] = frand();
    for (int j = 0; j < d.n_tok; j++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 16; i++) d.q[((size_t)j * 2 + h) * 16 + i] += dir[i];
    for (int e = planted * B; e < (planted + 1) * B; e++)
        for (int i = 0; i < 16; i++) d.kc[(size_t)d.sel[e] * 16 + i] = 6.0f * dir[i];
    lethe_block_sparse p = params(B, 0.4f, true);
    p.last_q_blocks = 0;
    float *o = lethe_xmalloc((size_t)d.n_tok * 2 * 16 * sizeof(float));
    lethe_attn_args a = args(&d, o, &p);
    lethe_cpu_bsp *bp = lethe_cpu_bsp_plan(&a);
    int n_chosen = 0;
    for (int32_t t = 0; t < bp[0].nqb; t++) {
        int32_t kb_last, n_full;
        lethe_bsp_block_range(&p, d.n_tok, d.n_tok, t, &kb_last, &n_full);
        for (int32_t b = 0; b <= kb_last; b++) {
            if (lethe_bsp_forced(&p, t, bp[0].nqb, b, kb_last, n_full)) continue;
            const bool keep = bp[0].keep[(size_t)t * bp[0].nkb + b];
            CHECK_MSG(keep == (b == planted), "t %d b %d keep %d", t, b, keep);
            n_chosen += keep;
        }
    }
    CHECK(n_chosen >= 5);
    lethe_cpu_bsp_free(bp, 1);
    free(o);
    unmake(&d);
}

/* float64 reference of the definition, for every sequence of d */
static void reference(const bdata *d, const lethe_block_sparse *p, const lethe_cpu_bsp *bp, double *ref) {
    const int H = d->c.H, KH = d->c.KH, hd = d->c.hd, G = H / KH;
    const double scale = 1.0 / sqrt((double)hd);
    const size_t kvd = (size_t)KH * hd;
    for (int s = 0; s < d->c.n_seqs; s++) {
        const int32_t n_q = d->q_begin[s + 1] - d->q_begin[s], n_sel = d->sel_begin[s + 1] - d->sel_begin[s];
        const int32_t *sel = d->sel + d->sel_begin[s];
        const lethe_cpu_bsp *b = bp && bp[s].keep ? &bp[s] : NULL;
        for (int32_t j = 0; j < n_q; j++)
            for (int h = 0; h < H; h++) {
                const int g = h / G;
                const float *qv = d->q + ((size_t)(d->q_begin[s] + j) * H + h) * hd;
                const int32_t lim = n_sel - n_q + j;
                const uint8_t *keep = b ? b->keep + ((size_t)(j / p->block) * KH + g) * b->nkb : NULL;
                double mx = -INFINITY, l = 0, acc[64] = {0};
                LETHE_ASSERT(hd <= 64);
                /* two passes: the max, then the weighted sum */
                for (int pass = 0; pass < 2; pass++) {
                    for (int32_t e = 0; e <= lim; e++) {
                        if (keep && !keep[e / p->block]) continue;
                        double x = 0;
                        for (int i = 0; i < hd; i++) x += (double)qv[i] * d->kc[(size_t)sel[e] * kvd + g * hd + i];
                        x *= scale;
                        if (pass == 0) mx = fmax(mx, x);
                        else {
                            const double w = exp(x - mx);
                            l += w;
                            for (int i = 0; i < hd; i++) acc[i] += w * d->vc[(size_t)sel[e] * kvd + g * hd + i];
                        }
                    }
                    for (int32_t kb = 0; keep && p->mean_correction && kb < b->nkb; kb++) {
                        if (keep[kb] || (kb + 1) * p->block > lim - j % p->block + 1) continue;
                        const float *km = b->km + (size_t)kb * kvd + g * hd, *vm = b->vm + (size_t)kb * kvd + g * hd;
                        double x = 0;
                        for (int i = 0; i < hd; i++) x += (double)qv[i] * km[i];
                        x = x * scale + log((double)p->block);
                        if (pass == 0) mx = fmax(mx, x);
                        else {
                            const double w = exp(x - mx);
                            l += w;
                            for (int i = 0; i < hd; i++) acc[i] += w * vm[i];
                        }
                    }
                }
                for (int i = 0; i < hd; i++) ref[((size_t)(d->q_begin[s] + j) * H + h) * hd + i] = acc[i] / l;
            }
    }
}

static void test_matches_reference(void) {
    for (size_t i = 0; i < LETHE_ARRAY_LEN(g_cases); i++)
        for (int mc = 0; mc < 2; mc++)
            for (int ti = 0; ti < 3; ti++) {
                const float thr[3] = {1.0f, 0.02f, 0.005f};
                bdata d;
                make(&d, &g_cases[i], 2.0f);
                lethe_block_sparse p = params(32, thr[ti], mc);
                p.min_q = 8; /* the 5-token chunk of case 3 attends densely */
                const size_t n = (size_t)d.n_tok * d.c.H * d.c.hd;
                float *o = run(g_be, &d, &p), *o1 = run(g_be1, &d, &p);
                CHECK_MSG(!memcmp(o, o1, n * sizeof(float)), "case %zu: thread count changed the output", i);
                lethe_attn_args a = args(&d, o, &p);
                lethe_cpu_bsp *bp = lethe_cpu_bsp_plan(&a);
                double *ref = lethe_xmalloc(n * sizeof(double));
                reference(&d, &p, bp, ref);
                double num = 0, den = 0;
                for (size_t k = 0; k < n; k++) num += (o[k] - ref[k]) * (o[k] - ref[k]), den += ref[k] * ref[k];
                CHECK_MSG(sqrt(num / den) < 1e-5, "case %zu mc %d thr %g: rel err %g", i, mc, thr[ti],
                          sqrt(num / den));
                /* short sequences (min_q) and decode rows are dense in the same call */
                float *dense = run(g_be, &d, NULL);
                for (int s = 0; s < d.c.n_seqs; s++)
                    if (!lethe_bsp_seq_sparse(&a, s)) {
                        const size_t r0 = (size_t)d.q_begin[s] * d.c.H * d.c.hd, r1 = (size_t)d.q_begin[s + 1] * d.c.H * d.c.hd;
                        CHECK(!memcmp(o + r0, dense + r0, (r1 - r0) * sizeof(float)));
                    }
                free(dense);
                free(ref);
                lethe_cpu_bsp_free(bp, d.c.n_seqs);
                free(o);
                free(o1);
                unmake(&d);
            }
}

/* mean correction moves the output towards dense: the skipped blocks' mass
 * is approximated instead of dropped */
static void test_mean_correction_helps(void) {
    const bcase c = {4, 2, 16, 1, {0}, {1024}};
    bdata d;
    make(&d, &c, 0.5f);
    lethe_block_sparse p0 = params(32, 1.0f, false), p1 = params(32, 1.0f, true);
    p0.last_q_blocks = p1.last_q_blocks = 0;
    float *dense = run(g_be, &d, NULL), *a = run(g_be, &d, &p0), *b = run(g_be, &d, &p1);
    const size_t n = (size_t)d.n_tok * 4 * 16;
    double ea = 0, eb = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        ea += (a[i] - dense[i]) * (a[i] - dense[i]);
        eb += (b[i] - dense[i]) * (b[i] - dense[i]);
        den += dense[i] * dense[i];
    }
    fprintf(stderr, "    forced blocks only: rel err vs dense %.4f without, %.4f with mean correction\n",
            sqrt(ea / den), sqrt(eb / den));
    CHECK(eb < ea);
    free(dense);
    free(a);
    free(b);
    unmake(&d);
}

/* the method's knobs reach the parameters; bad values are errors */
static void test_method_knobs(void) {
    lethe_sparse_env env = {.n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16, .max_model_len = 128};
    lethe_sparse_method *m = NULL;
    CHECK(lethe_sparse_create("flashprefill", "flashprefill_threshold=0.01,flashprefill_block=64", &env, &m) == LETHE_OK);
    /* a step of a middle chunk (is_final_chunk false) and a prompt's last one */
    const lethe_sparse_seq seqs[2] = {{.is_prefill = true}, {.is_prefill = true, .is_final_chunk = true}};
    const lethe_sparse_step st = {.n_seqs = 2, .seqs = seqs};
    const lethe_block_sparse *p = m->ops->block_sparse(m, 1, &st);
    CHECK(p && p->block == 64 && fabsf(p->threshold - 0.01f) < 1e-7f && p->sink_blocks == 2 &&
          p->window_blocks == 4 && p->last_q_blocks == 8 && p->min_q == 4096 && p->mean_correction);
    /* default scope: the last query blocks are dense in the prompt's last chunk only */
    CHECK(p->prompt_end && !p->prompt_end[0] && p->prompt_end[1]);
    lethe_sparse_destroy(m);
    CHECK(lethe_sparse_create("flashprefill", "flashprefill_last_q_scope=chunk", &env, &m) == LETHE_OK);
    p = m->ops->block_sparse(m, 0, &st);
    CHECK(p && p->prompt_end == NULL);
    lethe_sparse_destroy(m);
    CHECK(lethe_sparse_create("flashprefill", "flashprefill_last_q_scope=all", &env, &m) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "prompt or chunk");
    CHECK(lethe_sparse_create("flashprefill", NULL, &env, &m) == LETHE_OK);
    lethe_sparse_destroy(m);
    CHECK(lethe_sparse_find("flashprefill_v2") == lethe_sparse_find("flashprefill"));
    CHECK(lethe_sparse_create("flashprefill", "flashprefill_block=48", &env, &m) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "multiple of 32");
    CHECK(lethe_sparse_create("flashprefill", "flashprefill_threshold=2", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("flashprefill", "flashprefill_window_blocks=1", &env, &m) == LETHE_ERR_INVALID);
}

int main(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 0};
    CHECK(lethe_backend_cpu_create(&bp, &g_be) == LETHE_OK);
    bp.n_threads = 1;
    CHECK(lethe_backend_cpu_create(&bp, &g_be1) == LETHE_OK);
    TEST_RUN(test_threshold0_is_dense);
    TEST_RUN(test_forced_blocks);
    TEST_RUN(test_planted_block);
    TEST_RUN(test_matches_reference);
    TEST_RUN(test_mean_correction_helps);
    TEST_RUN(test_method_knobs);
    g_be->ops->destroy(g_be);
    g_be1->ops->destroy(g_be1);
    fprintf(stderr, "test_block_sparse: all passed\n");
    return 0;
}

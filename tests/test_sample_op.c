/* test_sample_op.c - the backend sample op (backend/sample.h) on the CPU.
 *
 *  - lethe_sample_exp against libm's exp on [-40, 0];
 *  - the CPU op against a naive reference of the definition (full sort by
 *    rank, plain loops) and against the host sampler (lethe_sampler_sample)
 *    on many random rows and parameter sets: penalties, temperature 0,
 *    top-k 1 / small / large, tiny and large top-p, min-p, bf16-rounded
 *    logits (many exact ties); exact token equality, logprob equality;
 *  - token masks (structured output): masked rows against the reference on
 *    -inf logits, only allowed tokens, the host sampler with the same mask;
 *  - the same rows in other batch compositions and orders give the same
 *    tokens; a fixed (seed, draw) reproduces, other draws move;
 *  - the engine on tiny-llama: sampled (seeded, non-greedy) requests take
 *    the backend path and give the same tokens as the host path
 *    (LETHE_SAMPLE_ON_HOST=1), alone vs batched, and with decode steps
 *    padded to graph buckets (padding rows are never sampled). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/sample.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "engine/sampler.h"
#include "test.h"

static uint64_t g_rng = 31337;
static lethe_backend *g_cpu;

static double urand(void) { return (double)(lethe_splitmix64(&g_rng) >> 11) * 0x1p-53; }

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- the naive reference ---- */

static const float *g_l;
static int cmp_rank(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    if (g_l[a] != g_l[b]) return g_l[a] > g_l[b] ? -1 : 1;
    return (a > b) - (a < b);
}
static int cmp_int(const void *x, const void *y) {
    return (*(const int32_t *)x > *(const int32_t *)y) - (*(const int32_t *)x < *(const int32_t *)y);
}

static int32_t ref_sample(const float *raw, int32_t V, const lethe_sample_row *p, const int32_t *ids,
                          const int32_t *counts) {
    float *l = lethe_xmalloc((size_t)V * sizeof(float));
    memcpy(l, raw, (size_t)V * sizeof(float));
    for (int32_t e = 0; e < p->n_pen; e++) {
        int32_t t = ids[p->pen_begin + e], c = counts[p->pen_begin + e];
        if (p->repetition_penalty != 1.0f) l[t] = l[t] > 0 ? l[t] / p->repetition_penalty : l[t] * p->repetition_penalty;
        if (c > 0 && (p->frequency_penalty != 0 || p->presence_penalty != 0))
            l[t] -= (float)c * p->frequency_penalty + p->presence_penalty;
    }
    int32_t *order = lethe_xmalloc((size_t)V * sizeof(int32_t));
    for (int32_t i = 0; i < V; i++) order[i] = i;
    g_l = l;
    qsort(order, (size_t)V, sizeof(int32_t), cmp_rank);
    int32_t tok = order[0];
    if (!(p->temperature == 0 || p->top_k == 1)) {
        uint64_t *q = lethe_xmalloc((size_t)V * sizeof(uint64_t));
        for (int32_t i = 0; i < V; i++) q[i] = lethe_sample_q(l[i], l[order[0]], 1.0 / p->temperature);
        int32_t K = p->top_k > 0 && p->top_k < V ? p->top_k : V;
        unsigned __int128 Q = 0;
        for (int32_t r = 0; r < K; r++) Q += q[order[r]];
        const uint64_t pnum = (uint64_t)((double)p->top_p * 4294967296.0 + 0.5);
        if (pnum < ((uint64_t)1 << 32)) {
            unsigned __int128 cum = 0;
            int32_t r = 0;
            while (r < K) {
                cum += q[order[r++]];
                if (cum * ((unsigned __int128)1 << 32) >= Q * pnum) break;
            }
            K = r;
        }
        const double qmin = ceil((double)p->min_p * 0x1p40);
        int32_t n = 0;
        for (int32_t r = 0; r < K; r++)
            if ((double)q[order[r]] >= qmin && q[order[r]]) order[n++] = order[r];
        qsort(order, (size_t)n, sizeof(int32_t), cmp_int);
        unsigned __int128 qs = 0;
        for (int32_t c = 0; c < n; c++) qs += q[order[c]];
        const uint64_t T = (uint64_t)(((unsigned __int128)lethe_sample_bits(p->seed, p->draw) * qs) >> 64);
        uint64_t cum = 0;
        tok = -1;
        for (int32_t c = 0; c < n && tok < 0; c++)
            if ((cum += q[order[c]]) > T) tok = order[c];
        free(q);
    }
    free(order);
    free(l);
    return tok;
}

/* ---- random cases ---- */

typedef struct tcase {
    int32_t V, n;
    float *logits;                 /* [n, V] */
    lethe_sample_row *rows;
    lethe_sampling_params *sp;     /* the request params behind each row */
    int32_t **hist;                /* prompt + output ids per row */
    int32_t *n_prompt, *n_out;
    int32_t *pen_ids, *pen_counts;
    int32_t n_pen;
} tcase;

static void random_params(lethe_sampling_params *p, int kind) {
    lethe_sampling_default_params(p);
    p->temperature = (float)(0.2 + 1.5 * urand());
    switch (kind % 9) {
    case 0: p->temperature = 0; break;
    case 1: p->top_k = 1; break;
    case 2: p->top_k = 1 + (int32_t)(urand() * 60); break;
    case 3: p->top_p = (float)(0.05 + 0.9 * urand()); break;
    case 4: p->top_p = 1e-6f; break;
    case 5: p->min_p = (float)(0.01 + 0.3 * urand()); break;
    case 6: p->top_k = 500, p->top_p = 0.9f, p->min_p = 0.02f; break;
    case 7: p->repetition_penalty = 1.3f, p->frequency_penalty = 0.5f, p->presence_penalty = 0.3f, p->top_p = 0.8f; break;
    case 8: p->temperature = 5.0f; break; /* flat: the walk spans most of the vocabulary */
    }
    if (kind % 4 == 3) p->repetition_penalty = 0.8f;
}

static tcase make_case(int32_t n, int32_t V, int seed_kind) {
    tcase c = {.V = V, .n = n};
    c.logits = lethe_xmalloc((size_t)n * V * sizeof(float));
    c.rows = lethe_xcalloc((size_t)n, sizeof(*c.rows));
    c.sp = lethe_xcalloc((size_t)n, sizeof(*c.sp));
    c.hist = lethe_xcalloc((size_t)n, sizeof(int32_t *));
    c.n_prompt = lethe_xcalloc((size_t)n, sizeof(int32_t));
    c.n_out = lethe_xcalloc((size_t)n, sizeof(int32_t));
    int64_t cap = 0;
    for (int32_t r = 0; r < n; r++) {
        const double scale = 2.0 + 10.0 * urand();
        for (int32_t i = 0; i < V; i++) c.logits[(size_t)r * V + i] = bf16_round((float)((urand() * 2 - 1) * scale));
        random_params(&c.sp[r], seed_kind + r);
        c.n_prompt[r] = (int32_t)(urand() * 40), c.n_out[r] = (int32_t)(urand() * 30);
        const int32_t nh = c.n_prompt[r] + c.n_out[r];
        c.hist[r] = lethe_xmalloc((size_t)(nh ? nh : 1) * sizeof(int32_t));
        for (int32_t j = 0; j < nh; j++) c.hist[r][j] = (int32_t)(urand() * (j % 3 ? LETHE_MIN(20, V) : V)); /* repeats */
        cap += nh;
    }
    c.pen_ids = lethe_xmalloc((size_t)(cap + 1) * sizeof(int32_t));
    c.pen_counts = lethe_xmalloc((size_t)(cap + 1) * sizeof(int32_t));
    lethe_sampler_ws ws;
    CHECK(lethe_sampler_ws_init(&ws, V) == LETHE_OK);
    for (int32_t r = 0; r < n; r++) {
        lethe_rng rng = {.seed = 1000 + (uint64_t)r * 7, .draw = (uint64_t)(urand() * 50)};
        c.rows[r] = lethe_sampler_row(&c.sp[r], &rng);
        c.rows[r].pen_begin = c.n_pen;
        c.rows[r].n_pen = lethe_sampler_penalty_entries(&ws, &c.sp[r], c.hist[r], c.n_prompt[r],
                                                        c.hist[r] + c.n_prompt[r], c.n_out[r],
                                                        c.pen_ids + c.n_pen, c.pen_counts + c.n_pen);
        c.n_pen += c.rows[r].n_pen;
    }
    lethe_sampler_ws_free(&ws);
    return c;
}

static void free_case(tcase *c) {
    for (int32_t r = 0; r < c->n; r++) free(c->hist[r]);
    free(c->logits), free(c->rows), free(c->sp), free(c->hist), free(c->n_prompt), free(c->n_out);
    free(c->pen_ids), free(c->pen_counts);
}

static void run_op(const tcase *c, int32_t *tok, float *lp) {
    for (int32_t r = 0; r < c->n; r++) tok[r] = -7;
    lethe_sample_args a = {.logits = c->logits, .n = c->n, .n_vocab = c->V, .rows = c->rows,
                           .pen_ids = c->pen_ids, .pen_counts = c->pen_counts, .n_pen = c->n_pen,
                           .tokens = tok, .logprobs = lp};
    g_cpu->ops->sample(g_cpu, &a);
}

/* ---- tests ---- */

static void test_exp(void) {
    double worst = 0;
    for (int i = 0; i < 200000; i++) { /* x > -40: below, 0 (q would round to 0 anyway) */
        double x = -40.0 * i / 200000.0, a = lethe_sample_exp(x), b = exp(x);
        worst = fmax(worst, fabs(a - b) / b);
    }
    fprintf(stderr, "    lethe_sample_exp: worst relative error %.2e on [-40, 0]\n", worst);
    CHECK(worst < 1e-15);
    CHECK(lethe_sample_exp(0.0) == 1.0 && lethe_sample_exp(-41.0) == 0.0 && lethe_sample_exp(-INFINITY) == 0.0);
    CHECK(lethe_sample_q(3.0f, 3.0f, 1.0) == LETHE_SAMPLE_Q_ONE);
    CHECK(lethe_sample_key(-0.0f) == lethe_sample_key(0.0f));
    CHECK(lethe_sample_key(-1.0f) < lethe_sample_key(-0.5f) && lethe_sample_key(0.5f) < lethe_sample_key(1.0f));
}

static void test_op_vs_reference(void) {
    static const int32_t vocabs[] = {2, 7, 1000, 5003, 32000};
    int n_rows = 0, n_sampled = 0;
    for (size_t vi = 0; vi < LETHE_ARRAY_LEN(vocabs); vi++) {
        const int32_t V = vocabs[vi], n = V > 10000 ? 9 : 27;
        tcase c = make_case(n, V, (int)vi);
        int32_t *tok = lethe_xmalloc((size_t)n * sizeof(int32_t));
        float *lp = lethe_xmalloc((size_t)n * sizeof(float));
        run_op(&c, tok, lp);
        lethe_sampler_ws ws;
        CHECK(lethe_sampler_ws_init(&ws, V) == LETHE_OK);
        for (int32_t r = 0; r < n; r++) {
            const float *row = c.logits + (size_t)r * V;
            const int32_t want = ref_sample(row, V, &c.rows[r], c.pen_ids, c.pen_counts);
            CHECK_MSG(tok[r] == want, "V=%d row %d (T=%g k=%d p=%g minp=%g rep=%g): op %d, reference %d", V,
                      r, (double)c.rows[r].temperature, c.rows[r].top_k, (double)c.rows[r].top_p,
                      (double)c.rows[r].min_p, (double)c.rows[r].repetition_penalty, tok[r], want);
            /* the host sampler (request params + history + rng) agrees too */
            lethe_rng rng = {.seed = c.rows[r].seed, .draw = c.rows[r].draw};
            lethe_sampling_params sp = c.sp[r];
            sp.logprobs = 0;
            lethe_sample_result res;
            lethe_sampler_sample(&ws, &sp, &rng, row, c.hist[r], c.n_prompt[r], c.hist[r] + c.n_prompt[r],
                                 c.n_out[r], &res);
            CHECK_EQ_INT(res.token, tok[r]);
            CHECK(res.logprob == lp[r]);
            CHECK(rng.draw == c.rows[r].draw + !lethe_sample_is_greedy(&c.rows[r]));
            n_rows++;
            n_sampled += !lethe_sample_is_greedy(&c.rows[r]);
        }
        lethe_sampler_ws_free(&ws);
        free(tok), free(lp);
        free_case(&c);
    }
    fprintf(stderr, "    %d rows (%d sampled) equal to the reference and the host sampler\n", n_rows, n_sampled);
}

static void test_batch_composition(void) {
    const int32_t V = 3000, n = 18;
    tcase c = make_case(n, V, 4);
    int32_t all[18], one[1], perm_tok[18];
    run_op(&c, all, NULL);
    /* each row alone */
    for (int32_t r = 0; r < n; r++) {
        tcase s = c;
        lethe_sample_row row = c.rows[r];
        s.n = 1;
        s.logits = c.logits + (size_t)r * V;
        s.rows = &row;
        run_op(&s, one, NULL);
        CHECK_EQ_INT(one[0], all[r]);
    }
    /* reversed order */
    float *lr = lethe_xmalloc((size_t)n * V * sizeof(float));
    lethe_sample_row rr[18];
    for (int32_t r = 0; r < n; r++) {
        memcpy(lr + (size_t)r * V, c.logits + (size_t)(n - 1 - r) * V, (size_t)V * sizeof(float));
        rr[r] = c.rows[n - 1 - r];
    }
    tcase s = c;
    s.logits = lr, s.rows = rr;
    run_op(&s, perm_tok, NULL);
    for (int32_t r = 0; r < n; r++) CHECK_EQ_INT(perm_tok[r], all[n - 1 - r]);
    /* the same call again: the same tokens; other draws: some move */
    run_op(&c, perm_tok, NULL);
    CHECK(!memcmp(perm_tok, all, sizeof(all)));
    int moved = 0;
    for (int32_t d = 1; d <= 8; d++) {
        for (int32_t r = 0; r < n; r++) c.rows[r].draw += 1;
        run_op(&c, perm_tok, NULL);
        for (int32_t r = 0; r < n; r++) moved += perm_tok[r] != all[r];
    }
    CHECK(moved > 20);
    free(lr);
    free_case(&c);
}

/* ---- the engine: backend path == host path ---- */

typedef struct eout {
    int32_t tok[64];
    float lp[64];
    int n;
} eout;

static void on_ev(void *user, const lethe_event *ev) {
    eout *o = user;
    if (ev->n_tokens && o->n < 64) o->lp[o->n] = ev->logprob, o->tok[o->n++] = ev->token;
}

static void run_engine(bool host, bool batched, bool pad, eout *outs, int64_t *dev_steps) {
    if (host) setenv("LETHE_SAMPLE_ON_HOST", "1", 1);
    else unsetenv("LETHE_SAMPLE_ON_HOST");
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "tests/data/tiny-llama";
    p.kv_cache_bytes = 1 << 20;
    p.check_invariants = true;
    p.pad_decode_batches = pad; /* decode steps padded to graph buckets: dummy rows after the real ones */
    lethe_engine *e;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    for (int i = 0; i < 6; i++) {
        int32_t prompt[20];
        for (int j = 0; j < 20; j++) prompt[j] = (i * 37 + j * 11) % 256;
        lethe_request_params rp = {0};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0.9f;
        rp.sampling.top_p = i % 2 ? 0.9f : 1.0f;
        rp.sampling.top_k = i % 3 == 2 ? 20 : 0;
        rp.sampling.repetition_penalty = i == 4 ? 1.3f : 1.0f;
        rp.sampling.frequency_penalty = i == 5 ? 0.4f : 0.0f;
        rp.sampling.logprobs = i == 1 ? 0 : -1;
        rp.sampling.seed = 77 + (uint64_t)i;
        rp.sampling.has_seed = true;
        rp.sampling.max_tokens = 24;
        rp.sampling.ignore_eos = true;
        rp.prompt = prompt;
        rp.n_prompt = 4 + 2 * i;
        rp.cb = on_ev;
        rp.user = &outs[i];
        uint64_t id;
        CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
        if (!batched)
            while (lethe_engine_has_work(e)) CHECK(lethe_engine_step(e) == 0);
    }
    while (lethe_engine_has_work(e)) CHECK(lethe_engine_step(e) == 0);
    *dev_steps = e->ds.n_steps;
    CHECK(!pad || e->stats.cur.padded_seqs > 0);
    lethe_engine_destroy(e);
    unsetenv("LETHE_SAMPLE_ON_HOST");
}

static void test_engine_paths(void) {
    static eout host[6], dev[6], dev_alone[6], dev_pad[6];
    int64_t s_host, s_dev, s_alone, s_pad;
    run_engine(true, true, false, host, &s_host);
    run_engine(false, true, false, dev, &s_dev);
    run_engine(false, false, false, dev_alone, &s_alone);
    run_engine(false, true, true, dev_pad, &s_pad);
    CHECK(s_host == 0 && s_dev > 0 && s_alone > 0 && s_pad > 0);
    for (int i = 0; i < 6; i++) {
        CHECK_EQ_INT(dev[i].n, 24);
        CHECK_EQ_INT(host[i].n, 24);
        CHECK(!memcmp(host[i].tok, dev[i].tok, sizeof(host[i].tok)));
        CHECK(!memcmp(dev_alone[i].tok, dev[i].tok, sizeof(dev[i].tok)));
        CHECK(!memcmp(dev_pad[i].tok, dev[i].tok, sizeof(dev[i].tok)));
        if (i == 1)
            for (int j = 0; j < 24; j++) CHECK(host[i].lp[j] == dev[i].lp[j] && dev[i].lp[j] < 0);
    }
    fprintf(stderr, "    engine: %lld backend-sampled steps, tokens equal to the host path\n", (long long)s_dev);
}

/* Step 0, the token mask: the op equals the reference run on the row with
 * masked logits set to -inf, the token is always an allowed one, the host
 * sampler with the same mask agrees, and the logprob is the raw one. Masks
 * from one allowed token to almost all, on rows where the best tokens are
 * masked (the masked argmax and draws must come from the allowed set). */
static void test_mask(void) {
    static const int32_t vocabs[] = {7, 1000, 32000};
    int n_rows = 0;
    for (size_t vi = 0; vi < LETHE_ARRAY_LEN(vocabs); vi++) {
        const int32_t V = vocabs[vi], n = 24, W = lethe_sample_mask_words(V);
        tcase c = make_case(n, V, 40 + (int)vi);
        uint32_t *mask = lethe_xcalloc((size_t)n * (size_t)W, sizeof(uint32_t));
        for (int32_t r = 0; r < n; r++) {
            uint32_t *m = mask + (size_t)r * W;
            const double density = r % 4 == 0 ? 0.0 : r % 4 == 1 ? 0.01 : r % 4 == 2 ? 0.5 : 0.97;
            for (int32_t i = 0; i < V; i++)
                if (urand() < density) m[i / 32] |= 1u << (i % 32);
            const int32_t one = (int32_t)(urand() * V); /* at least one allowed token */
            m[one / 32] |= 1u << (one % 32);
            c.rows[r].mask_row = r % 5 == 4 ? 0 : r + 1; /* some rows without a mask in the same call */
        }
        int32_t *tok = lethe_xmalloc((size_t)n * sizeof(int32_t));
        float *lp = lethe_xmalloc((size_t)n * sizeof(float));
        for (int32_t r = 0; r < n; r++) tok[r] = -7;
        lethe_sample_args a = {.logits = c.logits, .n = n, .n_vocab = V, .rows = c.rows, .pen_ids = c.pen_ids,
                               .pen_counts = c.pen_counts, .n_pen = c.n_pen, .mask = mask, .n_mask = n,
                               .tokens = tok, .logprobs = lp};
        g_cpu->ops->sample(g_cpu, &a);
        lethe_sampler_ws ws;
        CHECK(lethe_sampler_ws_init(&ws, V) == LETHE_OK);
        float *masked = lethe_xmalloc((size_t)V * sizeof(float));
        for (int32_t r = 0; r < n; r++) {
            const float *row = c.logits + (size_t)r * V;
            const uint32_t *m = c.rows[r].mask_row ? mask + (size_t)r * W : NULL;
            for (int32_t i = 0; i < V; i++) masked[i] = m && !lethe_sample_mask_allows(m, i) ? -INFINITY : row[i];
            const int32_t want = ref_sample(masked, V, &c.rows[r], c.pen_ids, c.pen_counts);
            CHECK_MSG(tok[r] == want, "mask V=%d row %d: op %d, reference %d", V, r, tok[r], want);
            CHECK(!m || lethe_sample_mask_allows(m, tok[r]));
            CHECK(lp[r] == lethe_sample_logprob_f32(row, V, tok[r])); /* raw, not masked */
            lethe_rng rng = {.seed = c.rows[r].seed, .draw = c.rows[r].draw};
            lethe_sample_result res;
            lethe_sampling_params sp = c.sp[r];
            sp.logprobs = -1;
            lethe_sampler_sample_masked(&ws, &sp, &rng, row, m, c.hist[r], c.n_prompt[r], c.hist[r] + c.n_prompt[r],
                                        c.n_out[r], &res);
            CHECK_EQ_INT(res.token, tok[r]);
            n_rows++;
        }
        free(masked);
        lethe_sampler_ws_free(&ws);
        free(tok), free(lp), free(mask);
        free_case(&c);
    }
    fprintf(stderr, "    %d masked rows equal to the reference, always an allowed token\n", n_rows);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 2};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    TEST_RUN(test_exp);
    TEST_RUN(test_op_vs_reference);
    TEST_RUN(test_batch_composition);
    TEST_RUN(test_mask);
    TEST_RUN(test_engine_paths);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_sample_op: ok\n");
    return 0;
}

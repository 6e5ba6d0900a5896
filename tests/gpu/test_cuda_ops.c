/* test_cuda_ops.c - every CUDA backend op against the CPU reference backend.
 *
 * Inputs are drawn fresh per size and rounded to bf16 on the host, so both
 * backends see identical values; the CPU computes in fp32, the CUDA backend
 * in bf16 storage with fp32 accumulation. Each CUDA output buffer is
 * poisoned with NaN before the op, so an element the op did not write fails
 * the check. The error measure is ||gpu - cpu|| / ||cpu|| with thresholds per
 * op (bf16 output rounding alone is ~2e-3). Sizes include single rows,
 * lengths that are not multiples of the kernels' tiles or vector widths,
 * GQA groups 1/3/4/8/12/16/32, head_dim 32/64/96/128/256, ragged batches mixing
 * decode rows with prefill and extend chunks over permuted cache slots,
 * sparse (subset) selections, the pre-staged (stage_step) path, contexts
 * >= 16K (split-K; head_dim 64 / 128 run the v2 kernels, the others the
 * generic split-K kernel; dev/cuda compares v1 too), attn_scores (every mode, up to 40K
 * candidates; single-row shapes on all logits kernels; MLA's latent rows of
 * head_dim 576 shared by 4..40 heads), key_redundancy (up to head_dim 576), the Quest page ops
 * (page_minmax: exact; page_scores: fp32 reassociation only, both kernels, max over all heads and per KV head, head_dim up to 576), the sample op (exact token equality, see
 * test_sample), and the device-side selection ops topk / select_expand
 * (exact int equality, -7-poisoned outputs: many segments up to 300K with
 * ties / NaN / +-inf / +-0; chains page_scores or attn_scores with
 * out_on_backend -> topk -> select_expand; rows as host and as device
 * arrays; a chain captured in a CUDA graph and replayed; see test_select).
 * Needs a CUDA device (make test-gpu). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/sample.h"
#include "core/util.h"
#include "test.h"

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 2024;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float frand(void) {
    return (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0);
}

static float *rand_bf16(size_t n, float scale) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = bf16_round(frand() * scale);
    return v;
}

/* A tensor living on both backends with the same values. */
typedef struct pair {
    void *c, *g;
    size_t n;
} pair;

static pair pair_act(const float *host, size_t n) {
    pair p = {NULL, NULL, n};
    CHECK(g_cpu->ops->alloc(g_cpu, (n ? n : 1) * g_cpu->ops->act_size, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, (n ? n : 1) * g_gpu->ops->act_size, &p.g) == LETHE_OK);
    if (host && n) {
        g_cpu->ops->act_from_host(g_cpu, p.c, host, n);
        g_gpu->ops->act_from_host(g_gpu, p.g, host, n);
    }
    return p;
}

static pair pair_weight(const float *host, size_t n) {
    pair p = {NULL, NULL, n};
    CHECK(g_cpu->ops->weight_upload(g_cpu, host, n, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->weight_upload(g_gpu, host, n, &p.g) == LETHE_OK);
    return p;
}

static void pair_free(pair *p) {
    g_cpu->ops->release(g_cpu, p->c);
    g_gpu->ops->release(g_gpu, p->g);
}

static void poison(pair *p) {
    float *nan = lethe_xmalloc((p->n ? p->n : 1) * sizeof(float));
    for (size_t i = 0; i < p->n; i++) nan[i] = NAN;
    g_gpu->ops->act_from_host(g_gpu, p->g, nan, p->n);
    free(nan);
}

/* Compares the two sides of p (first n elements); returns the relative error. */
static double compare(const pair *p, size_t n, double thr, const char *what) {
    float *a = lethe_xmalloc((n ? n : 1) * sizeof(float)), *b = lethe_xmalloc((n ? n : 1) * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, a, p->g, n);
    g_cpu->ops->act_to_host(g_cpu, b, p->c, n);
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(isfinite(a[i]), "%s: element %zu not finite (%g): unwritten or overflow", what, i,
                  (double)a[i]);
    double e = rel_err(a, b, n);
    CHECK_MSG(e < thr, "%s: relative error %.3g >= %.3g", what, e, thr);
    free(a);
    free(b);
    return e;
}

/* ---- key redundancy (R-KV) ------------------------------------------------ */

/* CUDA key_redundancy vs the CPU twin: random bf16 keys over scattered slots
 * with planted copies (the newest-copy rule fires) and a near-copy; the
 * newest copies must come out lower than their older copies on both. */
static void test_key_redundancy(void) {
    static const int shapes[][3] = {{1, 64, 40},  {2, 128, 700}, {8, 128, 3000},
                                    {3, 96, 257}, {2, 256, 130}, {1, 576, 300}}; /* last: MLA latent */
    for (size_t si = 0; si < LETHE_ARRAY_LEN(shapes); si++) {
        const int KV = shapes[si][0], D = shapes[si][1], n = shapes[si][2], n_slots = 2 * n + 7;
        const size_t kvd = (size_t)KV * D;
        float *kc = rand_bf16((size_t)n_slots * kvd, 1);
        int32_t *slots = lethe_xmalloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) slots[i] = (int32_t)((i * 2 + 3) % n_slots);
        /* copies: key n/3 -> n/2 and 2n/3 (exact), key 1 -> 5 scaled (cosine 1) */
        const int a = n / 3, b = n / 2, c = 2 * n / 3;
        for (size_t d = 0; d < kvd; d++) {
            kc[(size_t)slots[b] * kvd + d] = kc[(size_t)slots[a] * kvd + d];
            kc[(size_t)slots[c] * kvd + d] = kc[(size_t)slots[a] * kvd + d];
            kc[(size_t)slots[5] * kvd + d] = bf16_round(2.0f * kc[(size_t)slots[1] * kvd + d]);
        }
        pair pk = pair_act(kc, (size_t)n_slots * kvd);
        float *oc = lethe_xmalloc((size_t)KV * n * sizeof(float)), *og = lethe_xmalloc((size_t)KV * n * sizeof(float));
        for (int i = 0; i < KV * n; i++) og[i] = NAN;
        g_cpu->ops->key_redundancy(g_cpu, oc, pk.c, slots, n, KV, D, 0.5f);
        g_gpu->ops->key_redundancy(g_gpu, og, pk.g, slots, n, KV, D, 0.5f);
        double worst = 0;
        for (int i = 0; i < KV * n; i++) {
            CHECK_MSG(isfinite(og[i]), "key_redundancy KV=%d D=%d n=%d [%d]: not written", KV, D, n, i);
            const double err = fabs((double)og[i] - oc[i]);
            worst = fmax(worst, err);
            CHECK_MSG(err <= 2e-5, "key_redundancy KV=%d D=%d n=%d [%d]: %.7g vs cpu %.7g", KV, D, n, i, og[i], oc[i]);
        }
        for (int h = 0; h < KV; h++) { /* the newest copy does not count its older copies */
            CHECK(og[(size_t)h * n + c] < og[(size_t)h * n + a] && oc[(size_t)h * n + c] < oc[(size_t)h * n + a]);
            CHECK(og[(size_t)h * n + 5] < og[(size_t)h * n + 1]);
        }
        fprintf(stderr, "    key_redundancy KV=%d D=%d n=%-5d max abs err %.2e\n", KV, D, n, worst);
        pair_free(&pk);
        free(kc), free(slots), free(oc), free(og);
    }
}

/* ---- pointwise and row ops ------------------------------------------------ */

static void test_matmul(void) {
    static const int sizes[][3] = {{1, 1, 8},     {1, 4096, 4096}, {7, 300, 520}, {64, 1000, 768},
                                   {130, 257, 129}, {3, 576, 576},  {33, 17, 13},  {256, 512, 1024},
                                   {2, 1000, 768}, {4, 300, 520},  {1, 14336, 4096}, {2, 77, 4104},
                                   {4, 9, 16},     {3, 5, 12},
                                   /* decode batches 5..16 (cuBLAS): odd rows and k tails */
                                   {5, 4096, 4096}, {8, 6144, 4096}, {8, 1024, 4096},
                                   {16, 300, 520}, {9, 77, 4104},   {8, 33, 40},
                                   {12, 8448, 64},  {6, 17, 8},     {7, 14336, 128},
                                   {16, 4096, 14336}};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(sizes); t++) {
        int n = sizes[t][0], out = sizes[t][1], in = sizes[t][2];
        float *x = rand_bf16((size_t)n * in, 1), *w = rand_bf16((size_t)out * in, 0.5f);
        pair px = pair_act(x, (size_t)n * in), pw = pair_weight(w, (size_t)out * in);
        pair py = pair_act(NULL, (size_t)n * out);
        poison(&py);
        g_cpu->ops->matmul(g_cpu, py.c, px.c, pw.c, n, out, in);
        g_gpu->ops->matmul(g_gpu, py.g, px.g, pw.g, n, out, in);
        char what[64];
        snprintf(what, sizeof what, "matmul n=%d out=%d in=%d", n, out, in);
        compare(&py, (size_t)n * out, 8e-3, what);
        pair_free(&px), pair_free(&pw), pair_free(&py);
        free(x), free(w);
    }
}

static void test_rmsnorm(void) {
    static const int sizes[][2] = {{1, 4096}, {5, 576}, {33, 100}, {2048, 128}, {3, 8}, {7, 4100}};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(sizes); t++) {
        int rows = sizes[t][0], dim = sizes[t][1];
        float *x = rand_bf16((size_t)rows * dim, 3), *w = rand_bf16(dim, 1);
        pair px = pair_act(x, (size_t)rows * dim), pw = pair_weight(w, dim);
        pair po = pair_act(NULL, (size_t)rows * dim);
        poison(&po);
        g_cpu->ops->rmsnorm(g_cpu, po.c, px.c, pw.c, rows, dim, 1e-5f);
        g_gpu->ops->rmsnorm(g_gpu, po.g, px.g, pw.g, rows, dim, 1e-5f);
        compare(&po, (size_t)rows * dim, 6e-3, "rmsnorm");
        /* in place (out aliases x) */
        g_cpu->ops->rmsnorm(g_cpu, px.c, px.c, pw.c, rows, dim, 1e-6f);
        g_gpu->ops->rmsnorm(g_gpu, px.g, px.g, pw.g, rows, dim, 1e-6f);
        compare(&px, (size_t)rows * dim, 6e-3, "rmsnorm in place");
        pair_free(&px), pair_free(&pw), pair_free(&po);
        free(x), free(w);
    }
}

static void test_rope(void) {
    lethe_rope_config cfgs[3] = {
        {10000.0f, LETHE_ROPE_SCALING_NONE, 1, 0, 0, 0, 0},
        {1000000.0f, LETHE_ROPE_SCALING_LINEAR, 4.0f, 0, 0, 0, 0},
        {500000.0f, LETHE_ROPE_SCALING_LLAMA3, 8.0f, 1.0f, 4.0f, 8192, 0},
    };
    static const int shapes[][3] = {{1, 32, 128}, {37, 8, 64}, {5, 3, 96}, {300, 4, 128}, {2, 2, 256}};
    for (int ci = 0; ci < 3; ci++)
        for (size_t t = 0; t < LETHE_ARRAY_LEN(shapes); t++) {
            int n = shapes[t][0], nh = shapes[t][1], hd = shapes[t][2];
            size_t len = (size_t)n * nh * hd;
            float *x = rand_bf16(len, 2);
            int32_t *pos = lethe_xmalloc((size_t)n * sizeof(int32_t));
            for (int i = 0; i < n; i++) pos[i] = (int32_t)(lethe_splitmix64(&g_rng) % 131072);
            pos[0] = 0;
            pair px = pair_act(x, len);
            g_cpu->ops->rope(g_cpu, px.c, pos, n, nh, hd, &cfgs[ci]);
            g_gpu->ops->rope(g_gpu, px.g, pos, n, nh, hd, &cfgs[ci]);
            compare(&px, len, 8e-3, "rope");
            pair_free(&px);
            free(x), free(pos);
        }
}

static void test_pointwise(void) {
    static const size_t sizes[] = {1, 7, 4096, 14336 * 3 + 1, 1 << 20};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(sizes); t++) {
        size_t n = sizes[t];
        float *a = rand_bf16(n, 4), *b = rand_bf16(n, 4);
        pair pa = pair_act(a, n), pb = pair_act(b, n), po = pair_act(NULL, n);
        poison(&po);
        g_cpu->ops->swiglu(g_cpu, po.c, pa.c, pb.c, n);
        g_gpu->ops->swiglu(g_gpu, po.g, pa.g, pb.g, n);
        compare(&po, n, 6e-3, "swiglu");
        g_cpu->ops->add(g_cpu, pa.c, pb.c, n);
        g_gpu->ops->add(g_gpu, pa.g, pb.g, n);
        compare(&pa, n, 6e-3, "add");
        pair_free(&pa), pair_free(&pb), pair_free(&po);
        free(a), free(b);
    }
    static const int bias_sizes[][2] = {{1, 4096}, {9, 1000}, {3, 7}};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(bias_sizes); t++) {
        int n = bias_sizes[t][0], dim = bias_sizes[t][1];
        float *y = rand_bf16((size_t)n * dim, 2), *b = rand_bf16(dim, 2);
        pair py = pair_act(y, (size_t)n * dim), pb = pair_weight(b, dim);
        g_cpu->ops->add_bias(g_cpu, py.c, pb.c, n, dim);
        g_gpu->ops->add_bias(g_gpu, py.g, pb.g, n, dim);
        compare(&py, (size_t)n * dim, 6e-3, "add_bias");
        pair_free(&py), pair_free(&pb);
        free(y), free(b);
    }
}

static void test_rows(void) {
    static const int sizes[][3] = {{1, 1000, 4096}, {17, 300, 576}, {64, 50, 13}, {5, 5, 8}};
    for (size_t t = 0; t < LETHE_ARRAY_LEN(sizes); t++) {
        int n = sizes[t][0], vocab = sizes[t][1], dim = sizes[t][2];
        float *tab = rand_bf16((size_t)vocab * dim, 1);
        int32_t *tok = lethe_xmalloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) tok[i] = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)vocab);
        tok[n - 1] = vocab - 1;
        pair pt = pair_weight(tab, (size_t)vocab * dim), px = pair_act(NULL, (size_t)n * dim);
        poison(&px);
        g_cpu->ops->embed(g_cpu, px.c, pt.c, tok, n, dim);
        g_gpu->ops->embed(g_gpu, px.g, pt.g, tok, n, dim);
        compare(&px, (size_t)n * dim, 1e-6, "embed"); /* exact: bf16 table copied */
        /* staged-copy reuse (lethe_cuda_stage_idx): the same contents from
         * another host array reuse the device copy; changed contents at the
         * same pointer and size must be staged afresh */
        int32_t *tok2 = lethe_xmalloc((size_t)n * sizeof(int32_t));
        memcpy(tok2, tok, (size_t)n * sizeof(int32_t));
        poison(&px);
        g_gpu->ops->embed(g_gpu, px.g, pt.g, tok2, n, dim);
        compare(&px, (size_t)n * dim, 1e-6, "embed (same contents, other array)");
        for (int i = 0; i < n; i++) tok2[i] = (tok2[i] + 1 + i) % vocab;
        poison(&px);
        g_cpu->ops->embed(g_cpu, px.c, pt.c, tok2, n, dim);
        g_gpu->ops->embed(g_gpu, px.g, pt.g, tok2, n, dim);
        compare(&px, (size_t)n * dim, 1e-6, "embed (changed contents, same array)");
        free(tok2);
        /* gather to a new buffer, then in place (ascending idx >= i, as for logit rows) */
        int32_t *idx = lethe_xmalloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) idx[i] = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)n);
        pair pg = pair_act(NULL, (size_t)n * dim);
        poison(&pg);
        g_cpu->ops->gather_rows(g_cpu, pg.c, px.c, idx, n, dim);
        g_gpu->ops->gather_rows(g_gpu, pg.g, px.g, idx, n, dim);
        compare(&pg, (size_t)n * dim, 1e-6, "gather_rows");
        int m = 0;
        for (int i = 0; i < n; i += 2) idx[m++] = i + (i + 1 < n);
        g_cpu->ops->gather_rows(g_cpu, px.c, px.c, idx, m, dim);
        g_gpu->ops->gather_rows(g_gpu, px.g, px.g, idx, m, dim);
        compare(&px, (size_t)n * dim, 1e-6, "gather_rows in place");
        pair_free(&pt), pair_free(&px), pair_free(&pg);
        free(tab), free(tok), free(idx);
    }
}

/* ---- KV store + attention ------------------------------------------------ */

#define ATTN_MAX_SEQS 24
#define ATTN_CONSECUTIVE 2

typedef struct attn_case {
    const char *name;
    int n_heads, n_kv, hd;
    int n_seqs;     /* <= ATTN_MAX_SEQS */
    int n_q[ATTN_MAX_SEQS];   /* queries per sequence */
    int n_sel[ATTN_MAX_SEQS]; /* selection length (>= n_q) */
    int sparse;     /* 1: drop a random subset of the prefix; ATTN_CONSECUTIVE: each
                     * sequence's selection is consecutive slots (read in place by the
                     * GEMM path) instead of a random permutation */
    int per_head;   /* per-KV-head selections (varlen per head): each head drops its own subset */
} attn_case;

static void run_attn_case(const attn_case *tc, int staged) {
    const int H = tc->n_heads, KV = tc->n_kv, D = tc->hd, S = tc->n_seqs;
    int32_t q_begin[ATTN_MAX_SEQS + 1] = {0}, sel_begin[ATTN_MAX_SEQS + 1] = {0};
    LETHE_ASSERT(S >= 1 && S <= ATTN_MAX_SEQS);
    int32_t n_slots = 0;
    for (int s = 0; s < S; s++) {
        q_begin[s + 1] = q_begin[s] + tc->n_q[s];
        n_slots += tc->n_sel[s] + 3;
    }
    const int T = q_begin[S];
    /* slots: a random permutation of the cache rows */
    int32_t *perm = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    for (int i = 0; i < n_slots; i++) perm[i] = i;
    for (int i = n_slots - 1; tc->sparse != ATTN_CONSECUTIVE && i > 0; i--) {
        int j = (int)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t *sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    int32_t *store = lethe_xmalloc((size_t)(T ? T : 1) * sizeof(int32_t));
    int used = 0, n_sel_tot = 0;
    for (int s = 0; s < S; s++) {
        int prefix = tc->n_sel[s] - tc->n_q[s];
        for (int e = 0; e < prefix; e++) {
            int32_t slot = perm[used++];
            if (tc->sparse == 1 && e > 0 && lethe_splitmix64(&g_rng) % 3 == 0) continue;
            sel[n_sel_tot++] = slot;
        }
        for (int j = 0; j < tc->n_q[s]; j++) {
            int32_t slot = perm[used++];
            store[q_begin[s] + j] = slot;
            sel[n_sel_tot++] = slot;
        }
        sel_begin[s + 1] = n_sel_tot;
    }
    /* per-head lists: a random subsequence of each sequence's prefix per KV
     * head (a head may keep nothing of it), then all the new tokens */
    int32_t *hsel = NULL, *hsel_begin = NULL;
    if (tc->per_head) {
        hsel = lethe_xmalloc(((size_t)n_sel_tot * KV + 1) * sizeof(int32_t));
        hsel_begin = lethe_xmalloc(((size_t)S * KV + 1) * sizeof(int32_t));
        int32_t off = 0;
        for (int s = 0; s < S; s++)
            for (int g = 0; g < KV; g++) {
                hsel_begin[s * KV + g] = off;
                const int32_t n = sel_begin[s + 1] - sel_begin[s], pre = n - tc->n_q[s];
                const uint64_t keep_mod = 1 + (uint64_t)g % 3; /* heads keep different shares */
                for (int32_t e = 0; e < n; e++)
                    if (e >= pre || lethe_splitmix64(&g_rng) % (keep_mod + 1) != 0)
                        hsel[off++] = sel[sel_begin[s] + e];
            }
        hsel_begin[S * KV] = off;
    }
    const size_t kv_dim = (size_t)KV * D;
    float *kc = rand_bf16((size_t)n_slots * kv_dim, 1), *vc = rand_bf16((size_t)n_slots * kv_dim, 1);
    float *q = rand_bf16((size_t)T * H * D, 1);
    float *kn = rand_bf16((size_t)T * kv_dim, 1), *vn = rand_bf16((size_t)T * kv_dim, 1);
    pair pk = pair_act(kc, (size_t)n_slots * kv_dim), pv = pair_act(vc, (size_t)n_slots * kv_dim);
    pair pq = pair_act(q, (size_t)T * H * D), pkn = pair_act(kn, (size_t)T * kv_dim),
         pvn = pair_act(vn, (size_t)T * kv_dim), po = pair_act(NULL, (size_t)T * H * D);
    poison(&po);
    if (staged) {
        const int32_t *arrays[4] = {store, q_begin, sel_begin, sel};
        size_t counts[4] = {(size_t)T, (size_t)S + 1, (size_t)S + 1, (size_t)n_sel_tot};
        g_gpu->ops->stage_step(g_gpu, arrays, counts, 4);
    }
    g_cpu->ops->kv_store(g_cpu, pk.c, pv.c, pkn.c, pvn.c, store, T, (int32_t)kv_dim);
    g_gpu->ops->kv_store(g_gpu, pk.g, pv.g, pkn.g, pvn.g, store, T, (int32_t)kv_dim);
    lethe_attn_args a = {0};
    a.q = pq.c, a.out = po.c, a.k_cache = pk.c, a.v_cache = pv.c;
    a.n_tokens = T, a.n_seqs = S, a.q_begin = q_begin, a.sel_begin = sel_begin, a.sel_slots = sel;
    a.n_heads = H, a.n_kv_heads = KV, a.head_dim = D, a.scale = 1.0f / sqrtf((float)D);
    a.head_sel_begin = hsel_begin, a.head_sel_slots = hsel;
    g_cpu->ops->attention(g_cpu, &a);
    a.q = pq.g, a.out = po.g, a.k_cache = pk.g, a.v_cache = pv.g;
    g_gpu->ops->attention(g_gpu, &a);
    char what[160];
    snprintf(what, sizeof what, "attention %s (H=%d KV=%d D=%d T=%d%s%s)", tc->name, H, KV, D, T,
             staged ? ", staged" : "", tc->per_head ? ", per-head" : "");
    compare(&pk, (size_t)n_slots * kv_dim, 1e-6, "kv_store K");
    compare(&pv, (size_t)n_slots * kv_dim, 1e-6, "kv_store V");
    double e = compare(&po, (size_t)T * H * D, 1.5e-2, what);
    if (staged) g_gpu->ops->unstage(g_gpu);
    fprintf(stderr, "    %-76s rel err %.2e\n", what, e);
    pair_free(&pk), pair_free(&pv), pair_free(&pq), pair_free(&pkn), pair_free(&pvn), pair_free(&po);
    free(perm), free(sel), free(store), free(kc), free(vc), free(q), free(kn), free(vn);
    free(hsel), free(hsel_begin);
}

static void test_attention(void) {
    static const attn_case cases[] = {
        {"decode single", 32, 8, 128, 1, {1}, {4096}, 0, 0},
        {"decode ragged", 32, 8, 128, 5, {1, 1, 1, 1, 1}, {1, 37, 128, 129, 5000}, 0, 0},
        {"decode gqa3 d64", 9, 3, 64, 3, {1, 1, 1}, {2, 300, 1025}, 0, 0},
        {"decode mha d96", 4, 4, 96, 2, {1, 1}, {77, 513}, 0, 0},
        {"decode gqa16 d256", 16, 1, 256, 2, {1, 1}, {17, 700}, 0, 0},
        {"decode d32", 8, 2, 32, 2, {1, 1}, {3, 260}, 0, 0},
        {"prefill single", 32, 8, 128, 1, {200}, {200}, 0, 0},
        {"prefill ragged", 8, 2, 128, 4, {1, 63, 64, 65}, {1, 63, 64, 65}, 0, 0},
        {"extend + decode", 8, 2, 128, 3, {1, 50, 130}, {900, 300, 130}, 0, 0},
        {"extend d64 gqa3", 9, 3, 64, 2, {33, 70}, {100, 500}, 0, 0},
        {"extend d96 (split + gemm)", 4, 2, 96, 2, {5, 20}, {40, 20}, 0, 0},
        {"sparse decode", 32, 8, 128, 2, {1, 1}, {600, 2000}, 1, 0},
        {"sparse extend", 8, 2, 128, 2, {17, 3}, {400, 90}, 1, 0},
        {"mixed d64", 8, 2, 64, 3, {1, 10, 4}, {50, 10, 70}, 0, 0},
        {"sparse decode short", 32, 8, 128, 2, {1, 1}, {129, 300}, 1, 0},
        /* the v2 kernels' shapes: head_dim 64/128, GQA groups 1/4/8 and > 16
         * (several head chunks), lengths off the 16/64-key tiles */
        {"decode mha d128", 4, 4, 128, 3, {1, 1, 1}, {1, 15, 17}, 0, 0},
        {"decode mha d64", 6, 6, 64, 3, {1, 1, 1}, {2, 65, 1000}, 0, 0},
        {"decode gqa4 d64", 8, 2, 64, 2, {1, 1}, {3, 190}, 0, 0},
        {"decode gqa8 d64", 16, 2, 64, 4, {1, 1, 1, 1}, {16, 63, 64, 3001}, 0, 0},
        {"decode gqa4 d128", 16, 4, 128, 4, {1, 1, 1, 1}, {4, 257, 2049, 777}, 0, 0},
        {"decode gqa8 d128", 16, 2, 128, 3, {1, 1, 1}, {1, 80, 4097}, 0, 0},
        {"decode gqa32 d64", 64, 2, 64, 2, {1, 1}, {100, 1500}, 0, 0},
        {"decode gqa12 d128", 24, 2, 128, 2, {1, 1}, {31, 333}, 0, 0},
        /* decode_v2 at head_dim 256 (Qwen3.5/3.6's gated attention: 24 / 4
         * heads), lengths off the tiles, long enough to split, and sparse */
        {"decode gqa6 d256", 24, 4, 256, 4, {1, 1, 1, 1}, {1, 17, 1000, 20000}, 0, 0},
        {"sparse decode gqa6 d256", 24, 4, 256, 2, {1, 1}, {300, 5000}, 1, 0},
        {"decode gqa32 d256", 32, 1, 256, 2, {1, 1}, {63, 4100}, 0, 0},
        /* n_kv * batch past the device's one-wave block count: one split per
         * row, written without the merge pass */
        {"decode batch-wide", 32, 8, 128, 24,
         {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
         {1, 2, 15, 16, 17, 63, 64, 65, 100, 128, 129, 255, 256, 257, 500, 1000, 1023, 1024, 1025,
          2000, 3000, 4095, 4096, 4097}, 0, 0},
        {"sparse decode d64 gqa8", 16, 2, 64, 3, {1, 1, 1}, {40, 900, 5000}, 1, 0},
        {"prefill mha d64", 4, 4, 64, 2, {129, 1}, {129, 1}, 0, 0},
        {"prefill gqa4 d64", 12, 3, 64, 3, {127, 64, 3}, {127, 64, 3}, 0, 0},
        {"extend gqa4 d128", 16, 4, 128, 3, {70, 1, 200}, {1000, 65, 263}, 0, 0},
        {"sparse extend d64", 8, 1, 64, 3, {40, 1, 65}, {700, 300, 900}, 1, 0},
        /* long contexts: split-K over >= 16K keys */
        {"decode long b4", 32, 8, 128, 4, {1, 1, 1, 1}, {16384, 20000, 16385, 33000}, 0, 0},
        {"decode long d64", 9, 3, 64, 2, {1, 1}, {17000, 24576}, 0, 0},
        {"sparse decode long", 32, 8, 128, 2, {1, 1}, {30000, 16500}, 1, 0},
        {"extend long prefix", 8, 2, 128, 2, {130, 1}, {16500, 17000}, 0, 0},
        /* mixed steps: v2 sends the single-query sequences to the decode
         * kernel (item list, split-K + merge by item) and the rest to prefill */
        {"mixed decode rows", 32, 8, 128, 6, {1, 1, 100, 1, 1, 1}, {3000, 17, 600, 1, 129, 5000}, 0, 0},
        {"mixed decode rows d64 sparse", 9, 3, 64, 4, {1, 7, 1, 1}, {20000, 300, 65, 2}, 1, 0},
        /* prefill / extend at head_dims v2 does not take: attention_gemm.cu
         * (cuBLAS S = QK^T, bf16 P, PV) over gathered scattered slots or
         * consecutive slots in place; sequences with < 8 queries (decode rows
         * of a mixed call) go to split_kernel by item list. Qwen3.5/3.6's
         * shape (24 / 4 heads, D 256, G 6: batched over a KV head's 6 query
         * heads), chunk offsets (n_q < n_sel), several sequences. */
        {"gemm d256 gqa6 chunks", 24, 4, 256, 3, {300, 1000, 64}, {2500, 1000, 3000}, 0, 0},
        {"gemm d256 gqa6 sparse", 24, 4, 256, 2, {100, 513}, {4000, 1500}, 1, 0},
        {"gemm d256 gqa6 consecutive", 24, 4, 256, 2, {128, 500}, {128, 2000}, ATTN_CONSECUTIVE, 0},
        {"gemm d256 gqa6 + decode rows", 24, 4, 256, 5, {1, 200, 1, 9, 5}, {3000, 1500, 40, 9, 700}, 0, 0},
        {"gemm d96 mha", 4, 4, 96, 2, {64, 333}, {64, 1200}, 0, 0},
        {"gemm d96 gqa2", 8, 4, 96, 2, {77, 8}, {2000, 8}, 0, 0},
        {"gemm d96 gqa8 + decode", 16, 2, 96, 3, {150, 1, 40}, {150, 900, 1000}, 0, 0},
        {"gemm d32 mha", 6, 6, 32, 2, {250, 16}, {250, 3000}, 0, 0},
        {"gemm d32 gqa2 consecutive", 8, 4, 32, 2, {90, 300}, {1000, 300}, ATTN_CONSECUTIVE, 0},
        {"gemm d32 gqa8 sparse", 16, 2, 32, 2, {129, 31}, {2049, 700}, 1, 0},
        /* one KV head of 32 query heads (the CPU twin's largest group): S + P
         * of 3000 keys are 18 KB a row and head, so under the 1 MiB test
         * bound the heads run one at a time, each in many row blocks */
        {"gemm d32 mqa32 row blocks", 32, 1, 32, 1, {600}, {3000}, 0, 0},
        /* per-KV-head selections (attention_varlen.cu vs the CPU's per-head lists) */
        {"varlen decode", 32, 8, 128, 4, {1, 1, 1, 1}, {1, 40, 700, 3000}, 0, 1},
        {"varlen decode gqa3 d64", 9, 3, 64, 3, {1, 1, 1}, {2, 300, 1025}, 1, 1},
        {"varlen decode d96 mha", 4, 4, 96, 2, {1, 1}, {77, 513}, 0, 1},
        {"varlen extend + decode d256", 16, 2, 256, 3, {1, 33, 70}, {500, 200, 70}, 0, 1},
        {"varlen prefill d32", 8, 2, 32, 2, {64, 5}, {64, 300}, 0, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_attn_case(&cases[i], 0);
    run_attn_case(&cases[1], 1);
    run_attn_case(&cases[8], 1);
    run_attn_case(&cases[23], 1);
    /* repeat with fresh inputs: a kernel race shows up as a moving error */
    run_attn_case(&cases[1], 0);
    run_attn_case(&cases[7], 0);
    run_attn_case(&cases[19], 0);
    run_attn_case(&cases[27], 0);
    run_attn_case(&cases[35], 0); /* gemm d256 gqa6 chunks */
    run_attn_case(&cases[38], 1); /* gemm d256 + decode rows, staged arrays */
    /* the GEMM path's blocking at small sizes: S + P scratch 1 MiB (row
     * blocks of tens of rows, batches of 1-2 heads), gather scratch 6.5 MiB
     * (the D 256 cases gather their 4 KV heads in groups of 2) */
    setenv("LETHE_ATTN_GEMM_SP_BYTES", "1048576", 1);
    setenv("LETHE_ATTN_GEMM_GATHER_BYTES", "6815744", 1);
    fprintf(stderr, "    GEMM scratch bounds 1 MiB (S + P) / 6.5 MiB (gather):\n");
    for (size_t i = 35; i <= 45; i++) run_attn_case(&cases[i], 0);
    unsetenv("LETHE_ATTN_GEMM_SP_BYTES");
    unsetenv("LETHE_ATTN_GEMM_GATHER_BYTES");
    run_attn_case(&cases[LETHE_ARRAY_LEN(cases) - 5], 1); /* varlen, staged arrays */
}

/* ---- attn_scores (sparse methods' reduced scores) ------------------------- */

typedef struct score_case {
    const char *name;
    int n_heads, n_kv, hd;
    int n_seqs;
    int n_rows[4], n_keys[4], c0[4], r[4]; /* candidates [c0, n_keys - r) */
    int few;  /* large: n_groups 1 only (the CPU twin is the slow side) */
} score_case;

/* CUDA vs the CPU twin: every mode kind x denominator flag x n_groups in
 * {1, n_kv, n_heads}, sequences of one case batched in one call with
 * different modes; GPU output NaN-poisoned (packed: nothing may stay NaN). */
static void run_score_case(const score_case *tc) {
    const int H = tc->n_heads, KV = tc->n_kv, D = tc->hd, S = tc->n_seqs;
    int T = 0, n_list = 0;
    for (int s = 0; s < S; s++) T += tc->n_rows[s] + 2, n_list += tc->n_keys[s];
    const int n_slots = n_list + 17;
    const size_t kv_dim = (size_t)KV * D;
    float *kc = rand_bf16((size_t)n_slots * kv_dim, 1), *q = rand_bf16((size_t)T * H * D, 2);
    pair pk = pair_act(kc, (size_t)n_slots * kv_dim), pq = pair_act(q, (size_t)T * H * D);
    int32_t *slots = lethe_xmalloc((size_t)n_list * sizeof(int32_t));
    for (int i = 0; i < n_list; i++) slots[i] = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)n_slots);
    static const int kinds[] = {LETHE_SCORES_LOGIT_MAX, LETHE_SCORES_PROB_MAX, LETHE_SCORES_PROB_SUM,
                                LETHE_SCORES_PROB_MEAN};
    const int groups[3] = {1, KV, H};
    double worst = 0;
    for (int variant = 0; variant < 8 * 3; variant += tc->few ? 3 : 1) {
        const int n_groups = groups[variant % 3], v = variant / 3;
        lethe_score_seq req[4];
        int row = 0, key = 0;
        for (int s = 0; s < S; s++) {
            int mode = kinds[(v + s) % 4] | ((v / 4 + s) % 2 ? LETHE_SCORES_CAND_DENOM : 0);
            /* rows reduced by max (KVzip) on some probability requests */
            if ((mode & LETHE_SCORES_KIND_MASK) != LETHE_SCORES_LOGIT_MAX && (v + 2 * s) % 3 == 0)
                mode |= LETHE_SCORES_ROW_MAX;
            req[s] = (lethe_score_seq){.q_row = row + 1, .n_rows = tc->n_rows[s], .key_begin = key,
                                       .n_keys = tc->n_keys[s], .c0 = tc->c0[s],
                                       .c1 = tc->n_keys[s] - tc->r[s], .mode = mode};
            row += tc->n_rows[s] + 2;
            key += tc->n_keys[s];
        }
        const size_t n_out = lethe_attn_scores_out_len(req, S, n_groups);
        float *oc = lethe_xmalloc((n_out + 1) * sizeof(float)), *og = lethe_xmalloc((n_out + 1) * sizeof(float));
        for (size_t i = 0; i <= n_out; i++) og[i] = NAN, oc[i] = NAN;
        lethe_attn_scores_args a = {.out = oc, .q = pq.c, .k_cache = pk.c, .n_tokens = T, .n_seqs = S,
                                    .seqs = req, .key_slots = slots, .n_key_slots = n_list,
                                    .n_heads = H, .n_kv_heads = KV, .head_dim = D, .n_groups = n_groups,
                                    .scale = 1.0f / sqrtf((float)D)};
        g_cpu->ops->attn_scores(g_cpu, &a);
        a.out = og, a.q = pq.g, a.k_cache = pk.g;
        g_gpu->ops->attn_scores(g_gpu, &a);
        CHECK_MSG(isnan(og[n_out]), "%s: wrote past its output", tc->name);
        size_t off = 0;
        for (int s = 0; s < S; s++) {
            const size_t n = (size_t)n_groups * (req[s].c1 - req[s].c0);
            const bool logit = (req[s].mode & LETHE_SCORES_KIND_MASK) == LETHE_SCORES_LOGIT_MAX;
            double amax = 0;
            for (size_t i = 0; i < n; i++)
                if (isfinite(oc[off + i])) amax = fmax(amax, fabs(oc[off + i]));
            for (size_t i = 0; i < n; i++) {
                const float c = oc[off + i], g = og[off + i];
                CHECK_MSG(!isnan(g), "%s seq %d mode %d groups %d [%zu]: NaN (unwritten)", tc->name, s,
                          req[s].mode, n_groups, i);
                if (isinf(c)) {
                    CHECK_MSG(g == c, "%s seq %d mode %d [%zu]: %g vs %g", tc->name, s, req[s].mode, i, g, c);
                    continue;
                }
                /* logits: fp32 dots in another order; probabilities: expf and fp32 sums */
                double err = fabs((double)g - c), tol = logit ? 1e-4 * (1.0 + fabs(c)) : 2e-3 * fabs(c) + 1e-6 * amax;
                if (!logit && fabs(c) > 1e-3 * amax) worst = fmax(worst, err / fabs(c));
                CHECK_MSG(err <= tol, "%s seq %d mode %d groups %d [%zu]: %.7g vs cpu %.7g", tc->name, s,
                          req[s].mode, n_groups, i, g, c);
            }
            off += n;
        }
        free(oc), free(og);
    }
    fprintf(stderr, "    attn_scores %-24s max rel err (probabilities) %.2e\n", tc->name, worst);
    pair_free(&pk), pair_free(&pq);
    free(kc), free(q), free(slots);
}

static void test_attn_scores(void) {
    static const score_case cases[] = {
        /* decode rows (OmniKV filter layer, H2O decode eviction), ragged, one at 40K keys */
        {"decode ragged 40K", 32, 8, 128, 3, {1, 1, 1}, {40000, 300, 5}, {64, 0, 1}, {512, 0, 1}, 0},
        /* SnapKV window (w = 32) at 33K keys + a short sequence whose recent < w */
        {"window 33K", 8, 2, 128, 2, {32, 32}, {33000, 100}, {64, 4}, {512, 8}, 1},
        /* H2O prefill: a whole-chunk window of 200 rows, all keys candidates */
        {"h2o chunk d64 gqa3", 9, 3, 64, 2, {200, 7}, {1000, 7}, {0, 0}, {0, 0}, 0},
        /* tiny-llama shape (head_dim 16), an empty candidate range */
        {"tiny d16", 4, 2, 16, 3, {8, 1, 3}, {120, 60, 9}, {4, 2, 5}, {8, 6, 4}, 0},
        /* head_dim 256 and 96, MHA */
        {"d256 gqa16", 16, 1, 256, 2, {5, 1}, {700, 2000}, {0, 100}, {10, 100}, 0},
        {"d96 mha", 4, 4, 96, 1, {17}, {513}, {3}, {5}, 0},
        /* a head_dim not a multiple of 8 (row_dots' 2-channel loop), and KVzip's
         * replay shape: rows = the replay so far, keys = sink + chunk + replay,
         * candidates = the chunk (row blocks of 16 with a ragged last one) */
        {"d10 gqa2", 4, 2, 10, 2, {19, 3}, {300, 40}, {2, 0}, {7, 1}, 0},
        {"kvzip replay d128", 32, 8, 128, 1, {333}, {4 + 300 + 333}, {4}, {333}, 1},
        /* every sequence one row: the single-row kernels (scores.cu sc1_*), incl. a
         * KV group above 48 KiB of shared memory, MHA head_dim 16, an empty range */
        {"decode d256 gqa16", 16, 1, 256, 2, {1, 1}, {3000, 70}, {0, 5}, {100, 5}, 0},
        {"decode d16 mha empty", 4, 4, 16, 3, {1, 1, 1}, {50, 9, 200}, {4, 5, 0}, {8, 4, 0}, 0},
        {"decode d64 gqa3", 9, 3, 64, 2, {1, 1}, {1000, 65}, {0, 3}, {0, 2}, 0},
        /* sc1_logits_d_kernel<D, G> (head_dim 64 / 128, g <= 8: queries padded to G = 4 / 8)
         * with key counts around the 256-key block, then shapes left to sc1_logits_kernel */
        {"decode d128 g8 keys 257", 64, 8, 128, 3, {1, 1, 1}, {1000, 257, 256}, {0, 3, 0}, {0, 1, 0}, 0},
        {"decode d128 mha", 8, 8, 128, 2, {1, 1}, {511, 45}, {2, 0}, {3, 0}, 0},
        {"decode d64 g4 ragged", 16, 4, 64, 4, {1, 1, 1, 1}, {513, 255, 1, 2000}, {0, 7, 0, 100}, {1, 2, 0, 30}, 0},
        {"decode d64 g5", 20, 4, 64, 2, {1, 1}, {700, 31}, {1, 0}, {0, 3}, 0},
        {"decode d128 g16 generic", 32, 2, 128, 2, {1, 1}, {700, 300}, {0, 1}, {0, 1}, 0},
        {"decode d96 generic", 12, 4, 96, 2, {1, 1}, {600, 33}, {2, 0}, {5, 0}, 0},
        /* latent KV (MLA, GLM-4.7-Flash: 20 heads over one 576-wide latent + RoPE row):
         * sc1_logits_lat_kernel<G> (G = 24, 8, 32), a group above 32 left to the
         * generic kernel, and SnapKV / H2O windows on the general path */
        {"mla decode d576 h20", 20, 1, 576, 3, {1, 1, 1}, {6000, 300, 5}, {64, 0, 1}, {512, 0, 1}, 1},
        {"mla decode d576 h4", 4, 1, 576, 2, {1, 1}, {700, 257}, {0, 3}, {10, 1}, 0},
        {"mla decode d576 h32", 32, 1, 576, 2, {1, 1}, {1000, 9}, {0, 2}, {0, 1}, 1},
        {"mla decode d576 h40 generic", 40, 1, 576, 1, {1}, {500}, {3}, {4}, 1},
        {"mla window d576 h20", 20, 1, 576, 2, {32, 8}, {3000, 100}, {64, 4}, {512, 8}, 1},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_score_case(&cases[i]);
    run_score_case(&cases[1]); /* fresh inputs: a race shows up as a moving error */
}

/* ---- Quest page ops ------------------------------------------------------- */

typedef struct page_case {
    const char *name;
    int n_heads, n_kv, hd;
    int n_seqs;
    int n_pages[4];  /* pages scored per sequence (0 allowed; > 32 spans several tiles) */
} page_case;

/* page_minmax over random slot lists (1..40 slots: partial and oversized
 * pages) into permuted meta pages of a NaN-poisoned buffer: written pages
 * bit-identical to the CPU twin (a min / max of bf16 keys is a bf16 key),
 * the others still NaN. page_scores of each sequence's query row over its
 * page list (pages shared between sequences, some pages twice), max over all
 * heads and per KV head (n_groups = n_kv_heads): host output NaN-poisoned,
 * |gpu - cpu| <= 1e-5 of sum_c |q_c| max(|m_c|, |M_c|). */
static void run_page_case(const page_case *tc) {
    const int H = tc->n_heads, KV = tc->n_kv, D = tc->hd, KVD = KV * D, S = tc->n_seqs;
    int32_t n_pages = 0;
    for (int s = 0; s < S; s++) n_pages = LETHE_MAX(n_pages, tc->n_pages[s]);
    n_pages += 3;
    /* page ids (i * 7 + 3) % n_meta are distinct only if 7 does not divide n_meta
     * (the op requires distinct ids per call: two pages writing one id race) */
    int32_t n_meta = 2 * n_pages + 5;
    if (n_meta % 7 == 0) n_meta++;
    const int32_t NS = 700, n_tok = 7;
    float *keys = rand_bf16((size_t)NS * KVD, 2), *qh = rand_bf16((size_t)n_tok * H * D, 1);
    for (size_t i = 0; i < (size_t)NS * KVD; i += 11) keys[i] = 0.0f;
    int32_t *ids = lethe_xmalloc((size_t)n_pages * sizeof(int32_t));
    int32_t *beg = lethe_xmalloc((size_t)(n_pages + 1) * sizeof(int32_t));
    int32_t *slots = lethe_xmalloc((size_t)n_pages * 40 * sizeof(int32_t)), n_sl = 0;
    for (int32_t i = 0; i < n_pages; i++) {
        ids[i] = (int32_t)((i * 7 + 3) % n_meta); /* distinct: see n_meta */
        beg[i] = n_sl;
        int32_t len = i % 6 == 5 ? 1 + (int32_t)(lethe_splitmix64(&g_rng) % 40) : 16;
        for (int32_t j = 0; j < len; j++) slots[n_sl++] = (int32_t)(lethe_splitmix64(&g_rng) % NS);
    }
    beg[n_pages] = n_sl;
    pair pk = pair_act(keys, (size_t)NS * KVD), pq = pair_act(qh, (size_t)n_tok * H * D);
    pair pm = pair_act(NULL, (size_t)n_meta * 2 * KVD);
    poison(&pm);
    g_cpu->ops->page_minmax(g_cpu, pm.c, pk.c, ids, beg, slots, n_pages, KVD);
    g_gpu->ops->page_minmax(g_gpu, pm.g, pk.g, ids, beg, slots, n_pages, KVD);
    float *mg = lethe_xmalloc((size_t)n_meta * 2 * KVD * sizeof(float));
    float *mc = lethe_xmalloc((size_t)n_meta * 2 * KVD * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, mg, pm.g, (size_t)n_meta * 2 * KVD);
    g_cpu->ops->act_to_host(g_cpu, mc, pm.c, (size_t)n_meta * 2 * KVD);
    bool *written = lethe_xcalloc((size_t)n_meta, sizeof(bool));
    for (int32_t i = 0; i < n_pages; i++) written[ids[i]] = true;
    for (int32_t p = 0; p < n_meta; p++)
        for (int32_t c = 0; c < 2 * KVD; c++) {
            float g = mg[(size_t)p * 2 * KVD + c], e = mc[(size_t)p * 2 * KVD + c];
            if (written[p])
                CHECK_MSG(g == e, "%s page_minmax: meta page %d element %d: %g vs %g", tc->name, p, c,
                          (double)g, (double)e);
            else
                CHECK_MSG(isnan(g), "%s page_minmax: meta page %d was not to be written", tc->name, p);
        }
    /* scoring: sequence s reads pages ids[(s + i) % n_pages] (overlapping lists) */
    int32_t rows[4], pbeg[5] = {0}, *pids = lethe_xmalloc((size_t)4 * n_pages * sizeof(int32_t));
    for (int s = 0; s < S; s++) {
        rows[s] = (int32_t)((s * 3 + 1) % n_tok);
        for (int i = 0; i < tc->n_pages[s]; i++) pids[pbeg[s] + i] = ids[(s + i) % n_pages];
        if (tc->n_pages[s] > 2) pids[pbeg[s] + 1] = pids[pbeg[s]]; /* a page twice */
        pbeg[s + 1] = pbeg[s] + tc->n_pages[s];
    }
    const int32_t total = pbeg[S];
    /* per KV head too (n_groups = n_kv_heads: sequence s's [KV, n_s] block at KV * pbeg[s]) */
    double worst = 0;
    for (int G = 1; G <= KV; G = G == 1 && KV > 1 ? KV : KV + 1) {
        const int32_t n_out = G * total;
        float *ug = lethe_xmalloc((size_t)(n_out + 1) * sizeof(float));
        float *uc = lethe_xmalloc((size_t)(n_out + 1) * sizeof(float));
        for (int32_t i = 0; i <= n_out; i++) ug[i] = NAN;
        ug[n_out] = 12345.0f; /* guard: nothing past the output */
        g_cpu->ops->page_scores(g_cpu, uc, pq.c, pm.c, S, rows, pbeg, pids, H, KV, D, G, false);
        g_gpu->ops->page_scores(g_gpu, ug, pq.g, pm.g, S, rows, pbeg, pids, H, KV, D, G, false);
        CHECK(ug[n_out] == 12345.0f);
        for (int s = 0; s < S; s++)
            for (int g = 0; g < G; g++)
                for (int32_t i = pbeg[s]; i < pbeg[s + 1]; i++) {
                    const int32_t o = G * pbeg[s] + g * (pbeg[s + 1] - pbeg[s]) + (i - pbeg[s]);
                    const float *mn = mc + (size_t)pids[i] * 2 * KVD, *mx = mn + KVD;
                    double scale = 1e-30;
                    for (int h = g * (H / G); h < (g + 1) * (H / G); h++) {
                        double a = 0;
                        for (int c = 0; c < D; c++) {
                            int kc = (h / (H / KV)) * D + c;
                            a += fabs(qh[(size_t)rows[s] * H * D + (size_t)h * D + c]) *
                                 fmax(fabs(mn[kc]), fabs(mx[kc]));
                        }
                        scale = fmax(scale, a);
                    }
                    CHECK_MSG(isfinite(ug[o]), "%s page_scores (%d groups): output %d not written", tc->name, G, o);
                    double e = fabs((double)ug[o] - uc[o]) / scale;
                    worst = fmax(worst, e);
                    CHECK_MSG(e <= 1e-5, "%s page_scores (%d groups): seq %d group %d page %d: %g vs %g (err %.3g of scale)",
                              tc->name, G, s, g, i, (double)ug[o], (double)uc[o], e);
                }
        free(ug), free(uc);
    }
    fprintf(stderr, "    %s: page_minmax exact, page_scores max err %.3g\n", tc->name, worst);
    pair_free(&pk), pair_free(&pq), pair_free(&pm);
    free(keys), free(qh), free(ids), free(beg), free(slots), free(mg), free(mc), free(written);
    free(pids);
}

static void test_page_ops(void) {
    static const page_case cases[] = {
        {"llama8b", 32, 8, 128, 3, {40, 1, 300}},
        {"mha", 8, 8, 64, 2, {33, 32}},
        {"tiny hd16", 4, 2, 16, 2, {5, 0}},
        {"scalar kv_dim 20", 2, 1, 20, 1, {9}},
        {"hd256 big query", 64, 4, 256, 2, {70, 3}},   /* 64 KiB query row: smem opt-in */
        {"group 16", 16, 1, 96, 4, {1, 2, 65, 0}},
        /* page_scores_vec_kernel<R> (head_dim a power of two, kv_dim <= 1024): the 8B
         * shape over tile edges (32 pages a block, 4 a warp: prefetch of the next page) */
        {"llama8b edges", 32, 8, 128, 4, {0, 1, 31, 33}},
        {"llama8b 2048 pages", 32, 8, 128, 3, {2048, 2047, 5}},
        {"llama70b (group 8)", 64, 8, 128, 3, {65, 1, 300}},  /* <4, 16, 8> */
        {"hd64 kv5 (40 chunks)", 10, 5, 64, 3, {33, 2, 100}},
        {"hd64 kv10 (R 3)", 30, 10, 64, 2, {70, 9}},
        {"hd32 kv12 (cph 4)", 24, 12, 32, 2, {40, 7}},
        {"hd8 (cph 1)", 6, 3, 8, 2, {37, 4}},
        /* page_scores_kernel: head_dim not a power of two, kv_dim above 1024 */
        {"hd80 fallback", 8, 2, 80, 2, {40, 3}},
        {"kv_dim 2048 fallback", 16, 16, 128, 1, {20}},
        /* latent KV (MLA): one 576-wide row shared by 20 heads, 9 channel pairs a lane */
        {"mla latent hd576", 20, 1, 576, 3, {40, 1, 70}},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) run_page_case(&cases[i]);
    run_page_case(&cases[0]); /* fresh inputs: a race shows up as a moving error */
}

/* ---- sampling -------------------------------------------------------------- */

/* The sample op's tokens depend only on integer sums and deterministic IEEE
 * ops (backend/sample.h), so CUDA must equal the CPU twin on EVERY row, not
 * only where probability margins are safe: any mismatch is a bug. Logits
 * are bf16-exact, so both backends see the same values. Row parameters
 * cycle through greedy, top-k 1 / small / large, top-p (tiny, medium),
 * min-p, penalties with histories, flat (T = 5) and peaked rows. */
static void sample_case(int n, int V, int variant) {
    float *x = lethe_xmalloc((size_t)n * V * sizeof(float));
    for (int r = 0; r < n; r++) {
        const float scale = 1.0f + (float)((r * 7 + variant) % 13);
        for (int i = 0; i < V; i++) x[(size_t)r * V + i] = bf16_round(frand() * scale);
        if (r % 5 == 4) x[(size_t)r * V + (r * 131) % V] = bf16_round(scale + 3.0f); /* a peak */
        if (r % 6 == 5) /* exact ties at the top: smallest id must win */
            for (int i = 0; i < V; i += V / 7 + 1) x[(size_t)r * V + i] = bf16_round(scale + 1.0f);
    }
    pair px = pair_act(x, (size_t)n * V);
    lethe_sample_row *rows = lethe_xcalloc((size_t)n, sizeof(*rows));
    int32_t *ids = lethe_xmalloc((size_t)n * 40 * sizeof(int32_t)), *cnt = lethe_xmalloc((size_t)n * 40 * sizeof(int32_t));
    int32_t n_pen = 0;
    for (int r = 0; r < n; r++) {
        lethe_sample_row *p = &rows[r];
        p->temperature = 0.3f + 0.1f * (float)(r % 11);
        p->top_p = 1.0f;
        p->repetition_penalty = 1.0f;
        p->seed = 0x5eed0000ull + (uint64_t)r * 977 + (uint64_t)variant;
        p->draw = (uint64_t)(r * 3 + variant);
        switch ((r + variant) % 10) {
        case 0: p->temperature = 0.0f; break;
        case 1: p->top_k = 1; break;
        case 2: p->top_k = 40; break;
        case 3: p->top_p = 0.9f; break;
        case 4: p->top_p = 1e-6f; break;
        case 5: p->min_p = 0.05f; break;
        case 6: p->top_k = 2000, p->top_p = 0.95f, p->min_p = 0.01f; break;
        case 7: p->temperature = 5.0f; break;
        case 8: p->temperature = 1.0f, p->top_p = 0.5f; break;
        case 9: p->top_k = V / 2, p->top_p = 0.99f; break;
        }
        if (r % 3 == 1) { /* penalties over 40 distinct ids, some with output counts */
            p->repetition_penalty = 1.2f, p->frequency_penalty = 0.3f, p->presence_penalty = 0.2f;
            p->pen_begin = n_pen;
            for (int e = 0; e < 40 && e < V; e++) {
                ids[n_pen] = (int32_t)(((uint64_t)e * 2654435761u + (uint64_t)r) % (uint64_t)V);
                bool dup = false;
                for (int f = p->pen_begin; f < n_pen; f++) dup |= ids[f] == ids[n_pen];
                if (dup) continue;
                cnt[n_pen++] = e % 3;
            }
            p->n_pen = n_pen - p->pen_begin;
        }
    }
    /* token masks (structured output) on every 4th row: 1/8 of the ids, or a
     * single one, with the row's best token masked out; applied on the device */
    const int32_t W = lethe_sample_mask_words(V);
    uint32_t *mask = lethe_xcalloc((size_t)n * (size_t)W, sizeof(uint32_t));
    int32_t n_mask = 0;
    for (int r = 0; r < n; r++) {
        if (r % 4 != 3) continue;
        uint32_t *m = mask + (size_t)n_mask * W;
        for (int i = 0; i < V; i++)
            if (r % 8 == 3 ? i == (r * 37 + 11) % V : (i * 2654435761u + (unsigned)r) % 8 == 0) m[i / 32] |= 1u << (i % 32);
        rows[r].mask_row = ++n_mask;
    }
    int32_t *tc = lethe_xmalloc((size_t)n * sizeof(int32_t)), *tg = lethe_xmalloc((size_t)n * sizeof(int32_t));
    float *lc = lethe_xmalloc((size_t)n * sizeof(float)), *lg = lethe_xmalloc((size_t)n * sizeof(float));
    for (int r = 0; r < n; r++) tg[r] = -7, lg[r] = NAN; /* poisoned outputs */
    lethe_sample_args a = {.n = n, .n_vocab = V, .rows = rows, .pen_ids = ids, .pen_counts = cnt,
                           .n_pen = n_pen, .mask = n_mask ? mask : NULL, .n_mask = n_mask, .tokens = tc,
                           .logprobs = lc};
    a.logits = px.c;
    g_cpu->ops->sample(g_cpu, &a);
    a.logits = px.g, a.tokens = tg, a.logprobs = lg;
    g_gpu->ops->sample(g_gpu, &a);
    int n_sampled = 0;
    for (int r = 0; r < n; r++) {
        const lethe_sample_row *p = &rows[r];
        CHECK_MSG(tg[r] == tc[r], "sample n=%d V=%d row %d (T=%g k=%d p=%g minp=%g pen=%d): cuda %d, cpu %d", n, V,
                  r, (double)p->temperature, p->top_k, (double)p->top_p, (double)p->min_p, p->n_pen, tg[r], tc[r]);
        CHECK_MSG(fabsf(lg[r] - lc[r]) <= 1e-5f * (1.0f + fabsf(lc[r])), "sample logprob row %d: %g vs %g", r,
                  (double)lg[r], (double)lc[r]);
        n_sampled += !lethe_sample_is_greedy(p);
        if (p->mask_row)
            CHECK_MSG(lethe_sample_mask_allows(mask + (size_t)(p->mask_row - 1) * W, tg[r]),
                      "sample row %d: token %d is masked out", r, tg[r]);
    }
    /* a second call without logprobs: the same tokens (deterministic kernel) */
    a.logprobs = NULL;
    for (int r = 0; r < n; r++) tg[r] = -7;
    g_gpu->ops->sample(g_gpu, &a);
    for (int r = 0; r < n; r++) CHECK_MSG(tg[r] == tc[r], "sample rerun row %d: %d vs %d", r, tg[r], tc[r]);
    fprintf(stderr, "    sample n=%-3d V=%-6d %d rows (%d sampled, %d masked): tokens equal\n", n, V, n, n_sampled,
            n_mask);
    pair_free(&px);
    free(mask);
    free(x), free(rows), free(ids), free(cnt), free(tc), free(tg), free(lc), free(lg);
}

static void test_sample(void) {
    static const int ns[] = {1, 7, 64};
    static const int vocabs[] = {1000, 32000, 128256};
    int variant = 0;
    for (size_t vi = 0; vi < LETHE_ARRAY_LEN(vocabs); vi++)
        for (size_t ni = 0; ni < LETHE_ARRAY_LEN(ns); ni++) sample_case(ns[ni], vocabs[vi], variant++);
    sample_case(64, 128256, 5); /* fresh logits, other parameter rotation */
}

/* ---- device-side selection: topk, select_expand --------------------------- */

/* Both ops have integer outputs defined exactly (backend.h), so CUDA must
 * equal the CPU twin entry for entry. Integer GPU buffers are filled with -7
 * first (an unwritten entry fails) and carry a -7 guard entry past the end.
 * Raw bytes move with cudaMemcpy (declared here: the C tests are not
 * compiled with CUDA's include path); it runs on the legacy stream, so the
 * backend stream is synced before and the device after each copy. */
extern int cudaMemcpy(void *dst, const void *src, size_t n, int kind);
extern int cudaDeviceSynchronize(void);
enum { MEMCPY_H2D = 1, MEMCPY_D2H = 2 };

static void *gpu_buf(size_t bytes) {
    void *p = NULL;
    CHECK(g_gpu->ops->alloc(g_gpu, bytes ? bytes : 16, &p) == LETHE_OK);
    return p;
}

static void gpu_put(void *dst, const void *src, size_t n) {
    g_gpu->ops->sync(g_gpu);
    if (n) CHECK(cudaMemcpy(dst, src, n, MEMCPY_H2D) == 0);
    CHECK(cudaDeviceSynchronize() == 0);
}

static void gpu_get(void *dst, const void *src, size_t n) {
    g_gpu->ops->sync(g_gpu);
    if (n) CHECK(cudaMemcpy(dst, src, n, MEMCPY_D2H) == 0);
}

/* n + 1 int32 of -7 into the GPU buffer p (n entries + the guard) */
static void poison_ints(int32_t *p, size_t n) {
    int32_t *h = lethe_xmalloc((n + 1) * sizeof(int32_t));
    for (size_t i = 0; i <= n; i++) h[i] = -7;
    gpu_put(p, h, (n + 1) * sizeof(int32_t));
    free(h);
}

/* GPU ints [0, n) == want exactly, and the guard entry n still -7 */
static void check_ints(const int32_t *gpu, const int32_t *want, size_t n, const char *what) {
    int32_t *h = lethe_xmalloc((n + 1) * sizeof(int32_t));
    gpu_get(h, gpu, (n + 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(h[i] == want[i], "%s [%zu]: cuda %d, cpu %d%s", what, i, h[i], want[i],
                  h[i] == -7 ? " (unwritten)" : "");
    CHECK_MSG(h[n] == -7, "%s: wrote past its output (%d)", what, h[n]);
    free(h);
}

static void upload_f32(float *gpu, const float *host, size_t n) { gpu_put(gpu, host, n * sizeof(float)); }

/* kind 0: bf16-rounded uniform (many exact ties at these lengths); 1: NaN,
 * +-inf, +-0 and three numbers, mixed */
static float select_score(int kind) {
    if (kind == 0) return bf16_round(frand());
    static const float sp[8] = {NAN, -INFINITY, INFINITY, 0.0f, -0.0f, -1.0f, 0.5f, 1.0f};
    return sp[lethe_splitmix64(&g_rng) % 8];
}

/* Many segments in one call: lengths 0 .. 300000, k in {0, 1, len/7,
 * len-1, len}, segments and outputs starting at an offset (entries before
 * out_begin[0] must stay -7 too); run twice (the same result). */
static void topk_many(int kind) {
    static const int32_t lens[] = {0, 1, 17, 1000, 2048, 40000, 300000};
    enum { MAX_SEGS = 40 };
    int32_t seg_begin[MAX_SEGS + 1], out_begin[MAX_SEGS + 1], n_segs = 0;
    seg_begin[0] = 3, out_begin[0] = 2;
    for (size_t li = 0; li < LETHE_ARRAY_LEN(lens); li++) {
        const int32_t n = lens[li], ks[5] = {0, 1, n / 7, n - 1, n};
        for (int j = 0; j < 5; j++) {
            if (ks[j] < 0 || ks[j] > n) continue;
            seg_begin[n_segs + 1] = seg_begin[n_segs] + n;
            out_begin[n_segs + 1] = out_begin[n_segs] + ks[j];
            n_segs++;
        }
    }
    const size_t n_sc = (size_t)seg_begin[n_segs], n_out = (size_t)out_begin[n_segs];
    float *x = lethe_xmalloc(n_sc * sizeof(float));
    for (size_t i = 0; i < n_sc; i++) x[i] = select_score(kind);
    int32_t *want = lethe_xmalloc(n_out * sizeof(int32_t));
    for (int32_t i = 0; i < out_begin[0]; i++) want[i] = -7;
    g_cpu->ops->topk(g_cpu, want, x, n_segs, seg_begin, out_begin);
    float *xg = gpu_buf(n_sc * sizeof(float));
    int32_t *og = gpu_buf((n_out + 1) * sizeof(int32_t));
    upload_f32(xg, x, n_sc);
    for (int rep = 0; rep < 2; rep++) {
        poison_ints(og, n_out);
        g_gpu->ops->topk(g_gpu, og, xg, n_segs, seg_begin, out_begin);
        check_ints(og, want, n_out, kind ? "topk NaN/inf/+-0" : "topk bf16 ties");
    }
    fprintf(stderr, "    topk %-16s %d segments, %zu scores, %zu picks: exact\n",
            kind ? "NaN/inf/+-0" : "bf16 ties", n_segs, n_sc, n_out);
    g_gpu->ops->release(g_gpu, xg), g_gpu->ops->release(g_gpu, og);
    free(x), free(want);
}

/* The chained use: per sequence s, segment s of the scores ranks the units
 * of its row between head and tail (tail = head + seg_len * unit), topk
 * picks k[s] of them, select_expand assembles head + picked units + [tail,
 * row_len) as slot ids from rows (back to back). CUDA picks and selections
 * vs the CPU twin's; rows once as a host array, once as GPU memory (the
 * device-pointer path of stage_idx). scores_c: host (CPU backend memory),
 * scores_g: GPU f32. captured: afterwards the same ops in a CUDA graph
 * (pre-staged host arrays, device picks read in place during capture),
 * replayed on fresh scores. */
static void run_chain(const char *name, int32_t S, int32_t unit, float *scores_c, float *scores_g,
                      const int32_t *seg_begin, const int32_t *k, const int32_t *rows,
                      const int32_t *row_len, const int32_t *head, bool captured) {
    enum { MAXS = 8 };
    LETHE_ASSERT(S <= MAXS && seg_begin[0] == 0);
    int32_t out_begin[MAXS + 1] = {0}, n_rows = 0, n_sel = 0;
    lethe_expand_seq seqs[MAXS];
    for (int32_t s = 0; s < S; s++) {
        const int32_t n_units = seg_begin[s + 1] - seg_begin[s], tail = head[s] + n_units * unit;
        LETHE_ASSERT(tail <= row_len[s] && k[s] <= n_units);
        out_begin[s + 1] = out_begin[s] + k[s];
        seqs[s] = (lethe_expand_seq){.row_begin = n_rows, .row_len = row_len[s], .head = head[s],
                                     .pick_begin = out_begin[s], .n_picks = k[s],
                                     .pick_off = head[s], .tail = tail, .out_begin = n_sel};
        n_rows += row_len[s];
        n_sel += head[s] + k[s] * unit + row_len[s] - tail;
    }
    const size_t n_pick = (size_t)out_begin[S];
    int32_t *pc = lethe_xmalloc((n_pick + 1) * sizeof(int32_t)), *sc = lethe_xmalloc((size_t)(n_sel + 1) * sizeof(int32_t));
    int32_t *pg = gpu_buf((n_pick + 1) * sizeof(int32_t)), *sg = gpu_buf((size_t)(n_sel + 1) * sizeof(int32_t));
    int32_t *rows_g = gpu_buf((size_t)n_rows * sizeof(int32_t));
    gpu_put(rows_g, rows, (size_t)n_rows * sizeof(int32_t));
    char what[128];
    g_cpu->ops->topk(g_cpu, pc, scores_c, S, seg_begin, out_begin);
    g_cpu->ops->select_expand(g_cpu, sc, rows, pc, seqs, S, unit);
    poison_ints(pg, n_pick);
    g_gpu->ops->topk(g_gpu, pg, scores_g, S, seg_begin, out_begin);
    snprintf(what, sizeof what, "%s: topk picks", name);
    check_ints(pg, pc, n_pick, what);
    for (int dev_rows = 0; dev_rows < 2; dev_rows++) {
        poison_ints(sg, (size_t)n_sel);
        g_gpu->ops->select_expand(g_gpu, sg, dev_rows ? rows_g : rows, pg, seqs, S, unit);
        snprintf(what, sizeof what, "%s: select_expand (rows %s)", name, dev_rows ? "on the GPU" : "host");
        check_ints(sg, sc, (size_t)n_sel, what);
    }
    fprintf(stderr, "    select %-34s %d seqs, %zu picks, %d slots: exact (rows host + GPU)\n", name, S,
            n_pick, n_sel);
    if (captured) {
        const int32_t *arrays[4] = {seg_begin, out_begin, (const int32_t *)seqs, rows};
        size_t counts[4] = {(size_t)S + 1, (size_t)S + 1, (size_t)S * 8, (size_t)n_rows};
        for (int rep = 0; rep < 2; rep++) {
            if (rep) { /* fresh scores into the same buffer, then replay */
                for (int32_t i = 0; i < seg_begin[S]; i++) scores_c[i] = select_score(0);
                upload_f32(scores_g, scores_c, (size_t)seg_begin[S]);
                g_cpu->ops->topk(g_cpu, pc, scores_c, S, seg_begin, out_begin);
                g_cpu->ops->select_expand(g_cpu, sc, rows, pc, seqs, S, unit);
            }
            poison_ints(pg, n_pick); /* before capture: the legacy-stream copies may not be captured */
            poison_ints(sg, (size_t)n_sel);
            g_gpu->ops->stage_step(g_gpu, arrays, counts, 4);
            if (rep == 0) {
                CHECK_MSG(g_gpu->ops->graph_begin(g_gpu), "%s: graph capture unavailable", name);
                g_gpu->ops->topk(g_gpu, pg, scores_g, S, seg_begin, out_begin);
                g_gpu->ops->select_expand(g_gpu, sg, rows, pg, seqs, S, unit);
                lethe_status st = g_gpu->ops->graph_end(g_gpu, 9001);
                CHECK_MSG(st == LETHE_OK, "%s: graph capture of topk + select_expand: %s", name,
                          lethe_last_error());
            } else {
                CHECK(g_gpu->ops->graph_launch(g_gpu, 9001, NULL));
            }
            snprintf(what, sizeof what, "%s: captured topk (%s)", name, rep ? "replay" : "first run");
            check_ints(pg, pc, n_pick, what);
            snprintf(what, sizeof what, "%s: captured select_expand (%s)", name, rep ? "replay" : "first run");
            check_ints(sg, sc, (size_t)n_sel, what);
            g_gpu->ops->unstage(g_gpu);
        }
        g_gpu->ops->graph_reset(g_gpu);
        fprintf(stderr, "    select %-34s captured in a CUDA graph + replayed on new scores: exact\n", name);
    }
    g_gpu->ops->release(g_gpu, pg), g_gpu->ops->release(g_gpu, sg), g_gpu->ops->release(g_gpu, rows_g);
    free(pc), free(sc);
}

/* random slot ids for rows of n entries (any ints: select_expand copies them) */
static int32_t *rand_rows(int32_t n) {
    int32_t *r = lethe_xmalloc((size_t)(n ? n : 1) * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) r[i] = (int32_t)(lethe_splitmix64(&g_rng) % 1000000);
    return r;
}

/* Quest-like (unit 16, head 0, tail = the partial page of new tokens) and
 * OmniKV-like (unit 1, head = pick_off = sink 4, a recent tail) layouts over
 * random bf16 scores; the Quest one also captured in a graph. */
static void chain_random(int32_t unit, int32_t S, const int32_t *n_units, const int32_t *k,
                         const int32_t *head, const int32_t *extra, const char *name, bool captured) {
    int32_t seg_begin[9] = {0}, row_len[8], n_rows = 0;
    for (int32_t s = 0; s < S; s++) {
        seg_begin[s + 1] = seg_begin[s] + n_units[s];
        row_len[s] = head[s] + n_units[s] * unit + extra[s];
        n_rows += row_len[s];
    }
    float *x = lethe_xmalloc((size_t)seg_begin[S] * sizeof(float));
    for (int32_t i = 0; i < seg_begin[S]; i++) x[i] = select_score(0);
    float *xg = gpu_buf((size_t)seg_begin[S] * sizeof(float));
    upload_f32(xg, x, (size_t)seg_begin[S]);
    int32_t *rows = rand_rows(n_rows);
    run_chain(name, S, unit, x, xg, seg_begin, k, rows, row_len, head, captured);
    g_gpu->ops->release(g_gpu, xg);
    free(x), free(rows);
}

/* Scores produced on the GPU (out_on_backend: no host copy) feed topk. Keys
 * and queries are small integers, so every score is an exact fp32 integer
 * whatever the summation order: the CUDA scores equal the CPU ones bit for
 * bit (checked), and so must the whole chain. */
static float rand_int_val(int lim) { return (float)((int)(lethe_splitmix64(&g_rng) % (2 * lim + 1)) - lim); }

static void chain_page_scores(void) {
    enum { H = 32, KV = 8, D = 128, KVD = KV * D, P = 16, S = 2 };
    const int32_t n_pages[S] = {50, 700}, partial[S] = {5, 16}, k[S] = {12, 200};
    int32_t row_len[S], head[S] = {0, 0}, n_rows = 0, page_begin[S + 1] = {0};
    for (int s = 0; s < S; s++) {
        row_len[s] = (n_pages[s] - 1) * P + partial[s];
        page_begin[s + 1] = page_begin[s] + n_pages[s] - 1; /* completed pages are scored */
        n_rows += row_len[s];
    }
    /* rows: a permutation of the cache slots; keys / query: integers */
    int32_t *rows = lethe_xmalloc((size_t)n_rows * sizeof(int32_t));
    for (int32_t i = 0; i < n_rows; i++) rows[i] = i;
    for (int32_t i = n_rows - 1; i > 0; i--) {
        int32_t j = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1)), t = rows[i];
        rows[i] = rows[j], rows[j] = t;
    }
    float *keys = lethe_xmalloc((size_t)n_rows * KVD * sizeof(float)), *q = lethe_xmalloc((size_t)S * H * D * sizeof(float));
    for (size_t i = 0; i < (size_t)n_rows * KVD; i++) keys[i] = rand_int_val(3);
    for (size_t i = 0; i < (size_t)S * H * D; i++) q[i] = rand_int_val(2);
    pair pk = pair_act(keys, (size_t)n_rows * KVD), pq = pair_act(q, (size_t)S * H * D);
    /* meta page i = completed page i of all sequences, slots from the rows */
    const int32_t n_meta = page_begin[S];
    int32_t *ids = lethe_xmalloc((size_t)n_meta * sizeof(int32_t)), *sbeg = lethe_xmalloc((size_t)(n_meta + 1) * sizeof(int32_t));
    int32_t *slots = lethe_xmalloc((size_t)n_meta * P * sizeof(int32_t)), q_rows[S] = {0, 1}, r0 = 0;
    for (int s = 0; s < S; s++) {
        for (int32_t p = 0; p < n_pages[s] - 1; p++) {
            const int32_t i = page_begin[s] + p;
            ids[i] = i, sbeg[i] = i * P;
            for (int j = 0; j < P; j++) slots[i * P + j] = rows[r0 + p * P + j];
        }
        r0 += row_len[s];
    }
    sbeg[n_meta] = n_meta * P;
    pair pm = pair_act(NULL, (size_t)n_meta * 2 * KVD);
    g_cpu->ops->page_minmax(g_cpu, pm.c, pk.c, ids, sbeg, slots, n_meta, KVD);
    g_gpu->ops->page_minmax(g_gpu, pm.g, pk.g, ids, sbeg, slots, n_meta, KVD);
    float *uc = lethe_xmalloc((size_t)n_meta * sizeof(float)), *ug = gpu_buf((size_t)n_meta * sizeof(float));
    g_cpu->ops->page_scores(g_cpu, uc, pq.c, pm.c, S, q_rows, page_begin, ids, H, KV, D, 1, true);
    g_gpu->ops->page_scores(g_gpu, ug, pq.g, pm.g, S, q_rows, page_begin, ids, H, KV, D, 1, true);
    float *uh = lethe_xmalloc((size_t)n_meta * sizeof(float));
    gpu_get(uh, ug, (size_t)n_meta * sizeof(float));
    for (int32_t i = 0; i < n_meta; i++)
        CHECK_MSG(uh[i] == uc[i], "page_scores (out_on_backend) page %d: cuda %g, cpu %g (integer inputs: must be exact)",
                  i, (double)uh[i], (double)uc[i]);
    run_chain("page_scores -> topk -> expand", S, P, uc, ug, page_begin, k, rows, row_len, head, false);
    pair_free(&pk), pair_free(&pq), pair_free(&pm);
    g_gpu->ops->release(g_gpu, ug);
    free(rows), free(keys), free(q), free(ids), free(sbeg), free(slots), free(uc), free(uh);
}

static void chain_attn_scores(void) {
    enum { H = 8, KV = 2, D = 64, S = 2, NS = 6000 };
    const int32_t n_keys[S] = {5000, 300}, sink[S] = {4, 4}, recent[S] = {16, 8}, k[S] = {512, 50};
    int32_t seg_begin[S + 1] = {0}, n_list = 0;
    lethe_score_seq req[S];
    for (int s = 0; s < S; s++) {
        req[s] = (lethe_score_seq){.q_row = s, .n_rows = 1, .key_begin = n_list, .n_keys = n_keys[s],
                                   .c0 = sink[s], .c1 = n_keys[s] - recent[s], .mode = LETHE_SCORES_LOGIT_MAX};
        seg_begin[s + 1] = seg_begin[s] + req[s].c1 - req[s].c0;
        n_list += n_keys[s];
    }
    int32_t *slots = lethe_xmalloc((size_t)n_list * sizeof(int32_t));
    for (int32_t i = 0; i < n_list; i++) slots[i] = (int32_t)(lethe_splitmix64(&g_rng) % NS);
    float *keys = lethe_xmalloc((size_t)NS * KV * D * sizeof(float)), *q = lethe_xmalloc((size_t)S * H * D * sizeof(float));
    for (size_t i = 0; i < (size_t)NS * KV * D; i++) keys[i] = rand_int_val(3);
    for (size_t i = 0; i < (size_t)S * H * D; i++) q[i] = rand_int_val(2);
    pair pk = pair_act(keys, (size_t)NS * KV * D), pq = pair_act(q, (size_t)S * H * D);
    const size_t n_out = lethe_attn_scores_out_len(req, S, 1);
    CHECK(n_out == (size_t)seg_begin[S]);
    float *oc = lethe_xmalloc(n_out * sizeof(float)), *og = gpu_buf(n_out * sizeof(float));
    /* scale 1: raw scores are exact integer dot products on both backends */
    lethe_attn_scores_args a = {.out = oc, .out_on_backend = true, .q = pq.c, .k_cache = pk.c, .n_tokens = S,
                                .n_seqs = S, .seqs = req, .key_slots = slots, .n_key_slots = n_list,
                                .n_heads = H, .n_kv_heads = KV, .head_dim = D, .n_groups = 1, .scale = 1.0f};
    g_cpu->ops->attn_scores(g_cpu, &a);
    a.out = og, a.q = pq.g, a.k_cache = pk.g;
    g_gpu->ops->attn_scores(g_gpu, &a);
    float *oh = lethe_xmalloc(n_out * sizeof(float));
    gpu_get(oh, og, n_out * sizeof(float));
    for (size_t i = 0; i < n_out; i++)
        CHECK_MSG(oh[i] == oc[i], "attn_scores (out_on_backend) [%zu]: cuda %g, cpu %g (integer inputs: must be exact)",
                  i, (double)oh[i], (double)oc[i]);
    /* OmniKV's layout: the row is the key list, head = pick_off = sink, tail = the recent part */
    run_chain("attn_scores -> topk -> expand", S, 1, oc, og, seg_begin, k, slots, n_keys, sink, false);
    pair_free(&pk), pair_free(&pq);
    g_gpu->ops->release(g_gpu, og);
    free(slots), free(keys), free(q), free(oc), free(oh);
}

static void test_select(void) {
    topk_many(0);
    topk_many(1);
    {   /* Quest-like: pages of 16, a sequence with k = 0, one with k = all */
        const int32_t n_units[4] = {4, 39, 299, 8}, k[4] = {0, 7, 150, 8}, head[4] = {0, 0, 0, 0},
                      extra[4] = {3, 16, 1, 5};
        chain_random(16, 4, n_units, k, head, extra, "quest-like (unit 16)", false);
    }
    {   /* OmniKV-like: sink 4, 40K and 3K rows, recent 64 / 10 */
        const int32_t n_units[2] = {40000 - 4 - 64, 3000 - 4 - 10}, k[2] = {2048, 100}, head[2] = {4, 4},
                      extra[2] = {64, 10};
        chain_random(1, 2, n_units, k, head, extra, "omnikv-like (unit 1)", false);
    }
    chain_page_scores();
    chain_attn_scores();
    {   /* captured in a graph (last: the capture path is the newest) */
        const int32_t n_units[2] = {63, 250}, k[2] = {20, 100}, head[2] = {0, 0}, extra[2] = {7, 16};
        chain_random(16, 2, n_units, k, head, extra, "quest-like graph", true);
    }
}

static void test_free_memory(void) {
    size_t f0 = g_gpu->ops->free_memory(g_gpu);
    CHECK(f0 > ((size_t)1 << 30));
    void *p;
    CHECK(g_gpu->ops->alloc(g_gpu, (size_t)1 << 30, &p) == LETHE_OK);
    size_t f1 = g_gpu->ops->free_memory(g_gpu);
    CHECK(f1 + ((size_t)1 << 30) <= f0 + ((size_t)64 << 20));
    g_gpu->ops->release(g_gpu, p);
    /* a refused allocation is a status and leaves no CUDA error behind for
     * the next kernel's launch check: callers back off from NOMEM (bench
     * points that do not fit, the pool planner) and go on */
    void *big = NULL;
    CHECK(g_gpu->ops->alloc(g_gpu, (size_t)1 << 50, &big) == LETHE_ERR_NOMEM);
    CHECK(strstr(lethe_last_error(), "cannot allocate") != NULL);
    float *a = rand_bf16(4096, 4), *b = rand_bf16(4096, 4);
    pair pa = pair_act(a, 4096), pb = pair_act(b, 4096);
    g_cpu->ops->add(g_cpu, pa.c, pb.c, 4096);
    g_gpu->ops->add(g_gpu, pa.g, pb.g, 4096);
    compare(&pa, 4096, 6e-3, "add after a refused allocation");
    pair_free(&pa), pair_free(&pb);
    free(a), free(b);
    CHECK(g_cpu->ops->free_memory(g_cpu) == 0);
    /* device memory, graphs, profiler (backend.h capabilities) */
    CHECK(g_gpu->ops->caps == (LETHE_BE_GRAPHS | LETHE_BE_PROFILER));
    CHECK(!lethe_backend_has(g_gpu, LETHE_BE_HOST_MEMORY));
}

/* rows_to_host / rows_from_host (the host KV tier): raw bytes of scattered
 * rows, exact. The same host image is scattered into both backends' buffers,
 * gathered back, and compared byte for byte with each other and with the
 * image; row sizes with and without 16-byte alignment, many rows (a
 * demoted 4K-token prefix of one plane) and a single one. */
static void test_host_rows(void) {
    const size_t sizes[] = {16, 48, 512, 7, 1152};
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        const size_t rb = sizes[si];
        const int32_t n_rows_buf = 5000, counts[] = {1, 16, 4096};
        for (size_t ci = 0; ci < 3; ci++) {
            const int32_t n = counts[ci];
            int32_t *rows = lethe_xmalloc((size_t)n * sizeof(int32_t));
            /* distinct scattered rows: a stride coprime with the buffer's row count */
            for (int32_t i = 0; i < n; i++) rows[i] = (int32_t)(((int64_t)i * 977 + 13) % n_rows_buf);
            uint8_t *img = lethe_xmalloc((size_t)n * rb), *back_c = lethe_xmalloc((size_t)n * rb),
                    *back_g = lethe_xmalloc((size_t)n * rb);
            for (size_t i = 0; i < (size_t)n * rb; i++) img[i] = (uint8_t)lethe_splitmix64(&g_rng);
            void *bc = NULL, *bg = NULL;
            CHECK(g_cpu->ops->alloc(g_cpu, (size_t)n_rows_buf * rb, &bc) == LETHE_OK);
            CHECK(g_gpu->ops->alloc(g_gpu, (size_t)n_rows_buf * rb, &bg) == LETHE_OK);
            g_cpu->ops->rows_from_host(g_cpu, bc, rb, rows, n, img);
            g_gpu->ops->rows_from_host(g_gpu, bg, rb, rows, n, img);
            memset(back_c, 0xa5, (size_t)n * rb);
            memset(back_g, 0x5a, (size_t)n * rb);
            g_cpu->ops->rows_to_host(g_cpu, back_c, bc, rb, rows, n);
            g_gpu->ops->rows_to_host(g_gpu, back_g, bg, rb, rows, n);
            CHECK_MSG(memcmp(back_c, img, (size_t)n * rb) == 0, "cpu rows: %zu bytes x %d", rb, n);
            CHECK_MSG(memcmp(back_g, img, (size_t)n * rb) == 0, "cuda rows: %zu bytes x %d", rb, n);
            g_gpu->ops->release(g_gpu, bg);
            g_cpu->ops->release(g_cpu, bc);
            free(img);
            free(back_c);
            free(back_g);
            free(rows);
        }
    }
    /* bandwidth of one large gather (65536 rows of 1 KiB, scattered), for the log */
    const size_t rb = 1024;
    const int32_t n = 65536;
    int32_t *rows = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) rows[i] = (int32_t)(((int64_t)i * 977) % n);
    uint8_t *img = lethe_xmalloc((size_t)n * rb);
    memset(img, 1, (size_t)n * rb);
    void *bg = NULL;
    CHECK(g_gpu->ops->alloc(g_gpu, (size_t)n * rb, &bg) == LETHE_OK);
    g_gpu->ops->rows_from_host(g_gpu, bg, rb, rows, n, img); /* warm-up: staging buffers */
    double t0 = lethe_time_s();
    g_gpu->ops->rows_to_host(g_gpu, img, bg, rb, rows, n);
    double t1 = lethe_time_s();
    g_gpu->ops->rows_from_host(g_gpu, bg, rb, rows, n, img);
    double t2 = lethe_time_s();
    double copy_bw = 0, gemm = 0;
    CHECK(g_gpu->ops->measure_peaks(g_gpu, &copy_bw, &gemm) == LETHE_OK);
    fprintf(stderr,
            "    host rows: %d x %zu B: to host %.2f GB/s, from host (restore) %.2f GB/s (pageable "
            "caller buffer); device copy bandwidth %.0f GB/s (read + write)\n",
            n, rb, (double)n * rb / (t1 - t0) / 1e9, (double)n * rb / (t2 - t1) / 1e9, copy_bw / 1e9);
    g_gpu->ops->release(g_gpu, bg);
    free(img);
    free(rows);
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pg, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_free_memory);
    TEST_RUN(test_matmul);
    TEST_RUN(test_rmsnorm);
    TEST_RUN(test_rope);
    TEST_RUN(test_pointwise);
    TEST_RUN(test_rows);
    TEST_RUN(test_attention);
    TEST_RUN(test_attn_scores);
    TEST_RUN(test_key_redundancy);
    TEST_RUN(test_page_ops);
    TEST_RUN(test_sample);
    TEST_RUN(test_select);
    TEST_RUN(test_host_rows);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_ops: all passed\n");
    return 0;
}

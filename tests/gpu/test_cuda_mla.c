/* test_cuda_mla.c - the CUDA latent-attention ops (backend/cuda/mla.cu)
 * against their CPU twins (backend/cpu/mla.c).
 *
 *  - matmul_heads: GLM-4.7-Flash's absorptions (20 heads: q_nope [192] ->
 *    latent [512] into a strided [.., 576] query, o_lat [512] -> v [256]), a
 *    shared input row (x head stride 0) and odd tiny shapes;
 *  - copy_block: into strided rows and scattered to cache slots;
 *  - attention over latent KV (v_cache NULL, V = the first v_dim columns of
 *    each slot): decode batches at contexts up to 20K (split-K + merge),
 *    ragged prefill / extend chunks over permuted slots, tiny head counts;
 *    the decode call captured in a CUDA graph and replayed bit-identically;
 *  - attention over dense per-sequence K / V (sel_dense, the expanded
 *    prefill: cuda/attention_gemm.cu) at GLM-4.7-Flash's expanded heads,
 *    chunks over cached prefixes, a K / V head shared by all heads, tiny shapes.
 * Inputs are bf16-rounded on the host; outputs NaN-poisoned. Needs a GPU. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "test.h"

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 99;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float *rand_bf16(size_t n, float scale) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = bf16_round(
            (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0) * 2.0 - 1.0) * scale);
    return v;
}

typedef struct pair {
    void *c, *g;
    size_t n;
} pair;

static pair act(const float *host, size_t n) {
    pair p = {NULL, NULL, n};
    CHECK(g_cpu->ops->alloc(g_cpu, (n ? n : 1) * g_cpu->ops->act_size, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->alloc(g_gpu, (n ? n : 1) * g_gpu->ops->act_size, &p.g) == LETHE_OK);
    if (host) {
        g_cpu->ops->act_from_host(g_cpu, p.c, host, n);
        g_gpu->ops->act_from_host(g_gpu, p.g, host, n);
    } else { /* zero the CPU side, poison the GPU side */
        float *z = lethe_xcalloc(n ? n : 1, sizeof(float));
        g_cpu->ops->act_from_host(g_cpu, p.c, z, n);
        for (size_t i = 0; i < n; i++) z[i] = NAN;
        g_gpu->ops->act_from_host(g_gpu, p.g, z, n);
        free(z);
    }
    return p;
}

static pair weight(const float *host, size_t n) {
    pair p = {NULL, NULL, n};
    CHECK(g_cpu->ops->weight_upload(g_cpu, host, n, &p.c) == LETHE_OK);
    CHECK(g_gpu->ops->weight_upload(g_gpu, host, n, &p.g) == LETHE_OK);
    return p;
}

static void release(pair *p) {
    g_cpu->ops->release(g_cpu, p->c);
    g_gpu->ops->release(g_gpu, p->g);
}

/* rel err of the elements at idx (NULL: all), every GPU element finite there */
static double compare(const pair *p, double thr, const char *what) {
    float *a = lethe_xmalloc(p->n * sizeof(float)), *b = lethe_xmalloc(p->n * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, a, p->g, p->n);
    g_cpu->ops->act_to_host(g_cpu, b, p->c, p->n);
    for (size_t i = 0; i < p->n; i++)
        CHECK_MSG(isfinite(a[i]), "%s: element %zu not finite (unwritten?)", what, i);
    double e = rel_err(a, b, p->n);
    fprintf(stderr, "    %s: rel err %.2e\n", what, e);
    CHECK_MSG(e < thr, "%s: relative error %.3g >= %.3g", what, e, thr);
    free(a), free(b);
    return e;
}

static void test_matmul_heads(void) {
    /* n, heads, out, in, x_ld, x_hs, y_ld, y_hs */
    static const int cases[][8] = {
        {1, 20, 512, 192, 20 * 192, 192, 20 * 576, 576},  /* q absorption, decode */
        {37, 20, 512, 192, 20 * 192, 192, 20 * 576, 576}, /* prefill chunk */
        {5, 20, 256, 512, 20 * 512, 512, 20 * 256, 256},  /* v un-absorption */
        {3, 4, 8, 32, 32, 0, 4 * 40, 40},                 /* one row shared by the heads */
        {9, 4, 32, 16, 4 * 16, 16, 4 * 40, 40},           /* the tiny checkpoint's shapes */
        /* n <= 4: the GEMV kernel (heads_gemv_kernel) */
        {4, 20, 256, 512, 20 * 512, 512, 20 * 256, 256},  /* v un-absorption, batch 4 */
        {2, 20, 512, 192, 20 * 192, 192, 20 * 576, 576},  /* q absorption, batch 2 */
        {2, 3, 13, 1064, 3 * 1064, 1064, 3 * 16, 16},     /* partial row block, > 1 pass */
        {4, 2, 8, 40, 48, 0, 2 * 8, 8},                   /* shared row, padded x rows */
        {3, 2, 8, 36, 2 * 36, 36, 2 * 8, 8},              /* in % 8 != 0: cuBLAS */
    };
    for (size_t t = 0; t < LETHE_ARRAY_LEN(cases); t++) {
        const int *k = cases[t];
        const int n = k[0], H = k[1], out = k[2], in = k[3];
        float *x = rand_bf16((size_t)n * k[4], 1.0f), *w = rand_bf16((size_t)H * out * in, 0.2f);
        pair px = act(x, (size_t)n * k[4]), pw = weight(w, (size_t)H * out * in);
        pair py = act(NULL, (size_t)n * k[6]);
        g_cpu->ops->matmul_heads(g_cpu, py.c, k[6], k[7], px.c, k[4], k[5], pw.c, n, H, out, in);
        g_gpu->ops->matmul_heads(g_gpu, py.g, k[6], k[7], px.g, k[4], k[5], pw.g, n, H, out, in);
        /* the output rows are only partly written when y_hs > out: compare those columns */
        float *a = lethe_xmalloc(py.n * sizeof(float)), *b = lethe_xmalloc(py.n * sizeof(float));
        g_gpu->ops->act_to_host(g_gpu, a, py.g, py.n);
        g_cpu->ops->act_to_host(g_cpu, b, py.c, py.n);
        size_t m = 0;
        for (int r = 0; r < n; r++)
            for (int h = 0; h < H; h++)
                for (int o = 0; o < out; o++, m++) {
                    const size_t i = (size_t)r * k[6] + (size_t)h * k[7] + o;
                    CHECK_MSG(isfinite(a[i]), "matmul_heads case %zu: element not written", t);
                    a[m] = a[i], b[m] = b[i];
                }
        double e = rel_err(a, b, m);
        fprintf(stderr, "    matmul_heads n=%d heads=%d out=%d in=%d: rel err %.2e\n", n, H, out,
                in, e);
        CHECK_MSG(e < 8e-3, "matmul_heads case %zu: rel err %g", t, e);
        free(a), free(b), free(x), free(w);
        release(&px), release(&pw), release(&py);
    }
}

static void test_copy_block(void) {
    const int n = 7, width = 64, src_ld = 80, dst_ld = 576, off = 512, n_dst = 40;
    float *src = rand_bf16((size_t)n * src_ld, 1.0f),
          *base = rand_bf16((size_t)n_dst * dst_ld, 1.0f);
    pair ps = act(src, (size_t)n * src_ld), pd = act(base, (size_t)n_dst * dst_ld);
    const int32_t rows[7] = {33, 2, 17, 0, 39, 5, 21};
    g_cpu->ops->copy_block(g_cpu, pd.c, dst_ld, off, rows, ps.c, src_ld, n, width);
    g_gpu->ops->copy_block(g_gpu, pd.g, dst_ld, off, rows, ps.g, src_ld, n, width);
    g_cpu->ops->copy_block(g_cpu, pd.c, dst_ld, 0, NULL, ps.c, src_ld, n, width);
    g_gpu->ops->copy_block(g_gpu, pd.g, dst_ld, 0, NULL, ps.g, src_ld, n, width);
    CHECK(compare(&pd, 1e-9, "copy_block (scattered + identity rows)") == 0.0);
    free(src), free(base);
    release(&ps), release(&pd);
}

/* n_seqs sequences: q_len[s] new rows over ctx[s] resident slots (permuted) */
static void run_latent(int H, int D, int Dv, int n_seqs, const int *q_len, const int *ctx,
                       bool graph, const char *what) {
    int32_t qb[17] = {0}, sb[17] = {0};
    int n_tok = 0, n_sel = 0;
    for (int s = 0; s < n_seqs; s++) {
        n_tok += q_len[s], n_sel += ctx[s];
        qb[s + 1] = n_tok, sb[s + 1] = n_sel;
    }
    const int n_slots = n_sel + 7;
    int32_t *sel = lethe_xmalloc((size_t)n_sel * sizeof(int32_t));
    for (int i = 0; i < n_sel; i++) sel[i] = (int32_t)(((int64_t)i * 7919 + 3) % n_slots);
    float *q = rand_bf16((size_t)n_tok * H * D, 1.0f), *kv = rand_bf16((size_t)n_slots * D, 1.0f);
    pair pq = act(q, (size_t)n_tok * H * D), pk = act(kv, (size_t)n_slots * D);
    pair po = act(NULL, (size_t)n_tok * H * Dv);
    lethe_attn_args a = {.q = NULL,
                         .n_tokens = n_tok,
                         .n_seqs = n_seqs,
                         .q_begin = qb,
                         .sel_begin = sb,
                         .sel_slots = sel,
                         .n_heads = H,
                         .n_kv_heads = 1,
                         .head_dim = D,
                         .scale = 1.0f / sqrtf((float)D * 0.44f),
                         .v_dim = Dv};
    lethe_attn_args ac = a, ag = a;
    ac.out = po.c, ac.q = pq.c, ac.k_cache = pk.c;
    ag.out = po.g, ag.q = pq.g, ag.k_cache = pk.g;
    g_cpu->ops->attention(g_cpu, &ac);
    g_gpu->ops->attention(g_gpu, &ag);
    compare(&po, 2e-2, what);
    if (graph) {
        float *first = lethe_xmalloc(po.n * sizeof(float)),
              *again = lethe_xmalloc(po.n * sizeof(float));
        g_gpu->ops->act_to_host(g_gpu, first, po.g, po.n);
        const int32_t *arrays[3] = {qb, sb, sel};
        size_t counts[3] = {(size_t)n_seqs + 1, (size_t)n_seqs + 1, (size_t)n_sel};
        g_gpu->ops->stage_step(g_gpu, arrays, counts, 3);
        CHECK(g_gpu->ops->graph_begin(g_gpu));
        g_gpu->ops->attention(g_gpu, &ag);
        CHECK(g_gpu->ops->graph_end(g_gpu, 7) == LETHE_OK);
        CHECK(g_gpu->ops->graph_launch(g_gpu, 7, NULL));
        g_gpu->ops->unstage(g_gpu);
        g_gpu->ops->act_to_host(g_gpu, again, po.g, po.n);
        CHECK_MSG(!memcmp(first, again, po.n * sizeof(float)), "%s: graph replay differs", what);
        g_gpu->ops->graph_reset(g_gpu);
        free(first), free(again);
    }
    free(sel), free(q), free(kv);
    release(&pq), release(&pk), release(&po);
}

static void test_attention_latent(void) {
    { /* GLM-4.7-Flash decode: 20 heads, slot 512 + 64, V 512 */
        int ql[4] = {1, 1, 1, 1}, cx[4] = {1, 300, 4096, 20000};
        run_latent(20, 576, 512, 4, ql, cx, true, "glm decode, contexts 1..20000");
        int ql1[1] = {1}, cx1[1] = {32768};
        run_latent(20, 576, 512, 1, ql1, cx1, true, "glm decode batch 1, 32K");
    }
    { /* prefill + extend + decode rows in one call */
        int ql[3] = {37, 1, 20}, cx[3] = {37, 90, 200};
        run_latent(20, 576, 512, 3, ql, cx, false, "glm prefill / extend / decode mixed");
    }
    { /* the tiny checkpoint: 4 heads, 32 + 8, V 32 */
        int ql[2] = {9, 1}, cx[2] = {9, 50};
        run_latent(4, 40, 32, 2, ql, cx, false, "tiny shapes");
    }
}

/* attention over dense per-sequence K / V rows (sel_dense: the selection is
 * the identity), the expanded prefill's call: CUDA's GEMM path vs the CPU
 * attention. n_kv 0: one K / V head per query head (expanded MLA), else that
 * many KV heads (1: shared by every head). */
static void run_dense(int H, int KV, int D, int n_seqs, const int *q_len, const int *ctx,
                      const char *what) {
    int32_t qb[9] = {0}, sb[9] = {0};
    int n_tok = 0, n_sel = 0;
    for (int s = 0; s < n_seqs; s++) {
        n_tok += q_len[s], n_sel += ctx[s];
        qb[s + 1] = n_tok, sb[s + 1] = n_sel;
    }
    int32_t *iota = lethe_xmalloc((size_t)n_sel * sizeof(int32_t));
    for (int i = 0; i < n_sel; i++) iota[i] = i;
    float *q = rand_bf16((size_t)n_tok * H * D, 1.0f);
    float *k = rand_bf16((size_t)n_sel * KV * D, 1.0f), *v = rand_bf16((size_t)n_sel * KV * D, 1.0f);
    pair pq = act(q, (size_t)n_tok * H * D), pk = act(k, (size_t)n_sel * KV * D);
    pair pv = act(v, (size_t)n_sel * KV * D), po = act(NULL, (size_t)n_tok * H * D);
    lethe_attn_args a = {.n_tokens = n_tok,
                         .n_seqs = n_seqs,
                         .q_begin = qb,
                         .sel_begin = sb,
                         .sel_slots = iota,
                         .n_heads = H,
                         .n_kv_heads = KV,
                         .head_dim = D,
                         .scale = 2.0f / sqrtf((float)D),
                         .sel_dense = true};
    lethe_attn_args ac = a, ag = a;
    ac.out = po.c, ac.q = pq.c, ac.k_cache = pk.c, ac.v_cache = pv.c;
    ag.out = po.g, ag.q = pq.g, ag.k_cache = pk.g, ag.v_cache = pv.g;
    g_cpu->ops->attention(g_cpu, &ac);
    g_gpu->ops->attention(g_gpu, &ag);
    compare(&po, 2e-2, what);
    free(iota), free(q), free(k), free(v);
    release(&pq), release(&pk), release(&pv), release(&po);
}

static void test_attention_dense(void) {
    { /* GLM-4.7-Flash expanded: 20 heads of 192 + 64 (V 256): a 1000-token prompt
       * alone, then prefill chunks over cached prefixes (the causal offset) */
        int ql[1] = {1000}, cx[1] = {1000};
        run_dense(20, 20, 256, 1, ql, cx, "glm expanded prefill 1000");
        int ql3[3] = {300, 64, 2}, cx3[3] = {2300, 64, 700};
        run_dense(20, 20, 256, 3, ql3, cx3, "glm expanded chunks over prefixes");
    }
    { /* one K / V row shared by every head (stride 0), and the tiny checkpoint (4 x 24) */
        int ql[2] = {50, 7}, cx[2] = {80, 7};
        run_dense(8, 1, 192, 2, ql, cx, "shared K / V head");
        int qt[2] = {9, 20}, ct[2] = {9, 45};
        run_dense(4, 4, 24, 2, qt, ct, "tiny expanded shapes");
    }
}

int main(void) {
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pgp = {.device = "cuda", .device_index = 0};
    CHECK(lethe_backend_create(&pc, &g_cpu) == LETHE_OK);
    lethe_status st = lethe_backend_create(&pgp, &g_gpu);
    CHECK_MSG(st == LETHE_OK, "cuda backend: %s", lethe_last_error());
    TEST_RUN(test_matmul_heads);
    TEST_RUN(test_copy_block);
    TEST_RUN(test_attention_latent);
    TEST_RUN(test_attention_dense);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    fprintf(stderr, "test_cuda_mla: all passed\n");
    return 0;
}

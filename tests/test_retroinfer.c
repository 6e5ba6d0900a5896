/* test_retroinfer.c - RetroInfer (src/sparse/retroinfer.c, methods.md §12)
 * through the sparse contract on the real KV pool and the CPU backend, with
 * synthetic K / V / q, and its backend ops (backend/cpu/clusters.c):
 *
 *  - ops: cluster_attention with every key exact equals the backend's dense
 *    attention; a cluster of identical keys estimated equals it read exactly;
 *    cluster_assign is the first argmax of the centred dot; cluster_scores
 *    is the group-mean logit;
 *  - index: the reverse lists are a permutation of the clustered entries
 *    [sink, end), no cluster is empty (planted duplicate keys leave most
 *    k-means clusters empty), each table row holds its members' mean key,
 *    value sum and count; decode extends the index by whole update segments;
 *  - decode: retrieve = 1 is bit-identical to dense; every cluster retrieved
 *    through the three-zone op is dense within rounding; with estimate = 0
 *    the output equals an oracle that ranks the clusters itself and attends
 *    exactly over sink + the top ceil(r n) clusters + the tail (budgets
 *    respected); planted identical-key clusters estimated give dense; the
 *    estimation error is bounded on random keys and shrinks as the
 *    retrieval budget grows;
 *  - host tier: 40 decode tokens bit-identical to the device path in 2
 *    layers (the prompt index and one extension offloaded: the row holds
 *    sink + tail, 320 slots free again, the pool check passes, ring hits and
 *    misses, no pool reads); a ring smaller than one token's retrieval
 *    estimates the clusters that do not fit (finite, close); admission
 *    refused past retroinfer_host_gib with that name;
 *  - through the engine (tiny Llama, CPU): at the same KV budget the host
 *    tier runs 12 requests at once without preemption where the device path
 *    cannot; the tier's tokens and logits equal the
 *    device path's (large pool, same schedule) bit for bit, with the layer
 *    split into ring-sized passes.
 * With `--ref IN OUT` it runs one case for tests/e2e/test_retroinfer_ref.py
 * (the numpy reference tests/ref/retroinfer_ref.py): the index of layer 0 and
 * one decode token's attention output. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "kv/kv_pool.h"
#include "lethe.h"
#include "sparse/retroinfer.h"
#include "sparse/sparse.h"
#include "test.h"

enum { NSLOTS = 2048, MAXN = 1024 };

typedef struct rig {
    lethe_backend *be;
    lethe_kv_pool *pool;
    lethe_sparse_method *m;
    int32_t nl, h, kh, d, row, n; /* n: tokens stored so far */
    void *state;
    float *k, *v, *q; /* per layer [MAXN, kh d] / [MAXN, h d] synthetic inputs */
} rig;

static uint64_t g_seed = 1;
static float urand(void) {
    return (float)((lethe_splitmix64(&g_seed) >> 40) * 0x1p-24) * 2.0f - 1.0f;
}

static void rig_open(rig *r, const char *cfg, int32_t nl, int32_t h, int32_t kh, int32_t d) {
    memset(r, 0, sizeof(*r));
    r->nl = nl, r->h = h, r->kh = kh, r->d = d;
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    CHECK(lethe_backend_create(&bp, &r->be) == LETHE_OK);
    lethe_sparse_env env = {.be = r->be,
                            .n_layers = nl,
                            .n_heads = h,
                            .n_kv_heads = kh,
                            .head_dim = d,
                            .max_model_len = MAXN};
    CHECK_MSG(lethe_sparse_create("retroinfer", cfg, &env, &r->m) == LETHE_OK, "%s",
              lethe_last_error());
    lethe_kv_layout layouts[8];
    CHECK(lethe_sparse_kv_layouts(r->m, layouts));
    lethe_kv_pool_params pp = {.n_layers = nl,
                               .n_kv_heads = kh,
                               .head_dim = d,
                               .n_slots = NSLOTS,
                               .be = r->be,
                               .layouts = layouts};
    CHECK_MSG(lethe_kv_pool_create(&pp, &r->pool) == LETHE_OK, "%s", lethe_last_error());
    r->m->env.pool = r->pool;
    r->k = lethe_xcalloc((size_t)nl * MAXN * kh * d, sizeof(float));
    r->v = lethe_xcalloc((size_t)nl * MAXN * kh * d, sizeof(float));
    r->q = lethe_xcalloc((size_t)nl * MAXN * h * d, sizeof(float));
}

static lethe_status rig_request(rig *r, int32_t n_prompt) {
    r->row = lethe_kv_row_alloc(r->pool);
    lethe_sparse_seq s = {.request_id = 1, .row = r->row, .n_prompt = n_prompt};
    return r->m->ops->request_init(r->m, &s, &r->state);
}

static void rig_close(rig *r) {
    if (r->state) r->m->ops->request_finished(r->m, r->state);
    lethe_sparse_destroy(r->m);
    lethe_kv_pool_destroy(r->pool);
    lethe_backend_destroy(r->be);
    free(r->k), free(r->v), free(r->q);
}

#define KP(r, l, t) ((r)->k + (((size_t)(l)*MAXN + (t)) * (r)->kh * (r)->d))
#define VP(r, l, t) ((r)->v + (((size_t)(l)*MAXN + (t)) * (r)->kh * (r)->d))
#define QP(r, l, t) ((r)->q + (((size_t)(l)*MAXN + (t)) * (r)->h * (r)->d))

/* random inputs; dup > 0: keys of positions >= 4 are one of `dup` fixed vectors */
static void fill(rig *r, int32_t n, int32_t dup) {
    const int32_t kd = r->kh * r->d;
    for (int32_t l = 0; l < r->nl; l++) {
        for (int32_t t = 0; t < n; t++) {
            for (int32_t i = 0; i < kd; i++)
                KP(r, l, t)[i] = 1.5f * urand(), VP(r, l, t)[i] = urand();
            for (int32_t i = 0; i < r->h * r->d; i++) QP(r, l, t)[i] = 1.5f * urand();
        }
        if (dup > 0)
            for (int32_t t = 4; t < n; t++)
                memcpy(KP(r, l, t), KP(r, l, t % dup), (size_t)kd * sizeof(float));
    }
}

/* one step of n tokens (prefill chunk or one decode token); out: [n, h d] of layer `ol` */
static void rig_step(rig *r, int32_t n, bool prefill, bool final, int32_t ol, float *out) {
    const int32_t first = r->n;
    int32_t pos[MAXN], seq_begin[2] = {0, n};
    for (int32_t t = 0; t < n; t++) pos[t] = first + t;
    CHECK(lethe_kv_row_append(r->pool, r->row, n, pos));
    lethe_sparse_seq seq = {.request_id = 1,
                            .state = r->state,
                            .row = r->row,
                            .q_row = 0,
                            .n_new = n,
                            .first_pos = first,
                            .is_prefill = prefill,
                            .is_final_chunk = final};
    lethe_fwd_batch b = {.n_tokens = n, .pos = pos, .n_seqs = 1, .seq_begin = seq_begin};
    lethe_sparse_step st = {.n_seqs = 1, .seqs = &seq, .batch = &b};
    lethe_sparse_method *m = r->m;
    if (m->ops->prepare) m->ops->prepare(m, &st);
    const int32_t kd = r->kh * r->d;
    static int32_t sel[NSLOTS];
    float *att = lethe_xmalloc((size_t)n * r->h * r->d * sizeof(float));
    for (int32_t l = 0; l < r->nl; l++) {
        const float *q = QP(r, l, first);
        const int32_t ns = lethe_sparse_build_selection(m, l, &st, 0, q, sel, NSLOTS);
        const int32_t *slots = lethe_kv_row_slots(r->pool, 0, r->row);
        const int32_t len = lethe_kv_row_len(r->pool, 0, r->row); /* < r->n + n once offloaded */
        m->ops->kv_store(m, l, KP(r, l, first), VP(r, l, first), slots + len - n, pos, n);
        (void)kd;
        int32_t qb[2] = {0, n}, sb[2] = {0, ns};
        lethe_attn_args a = {.out = att,
                             .q = q,
                             .k_cache = lethe_kv_plane_buf(r->pool, l, 0),
                             .v_cache = lethe_kv_plane_buf(r->pool, l, 1),
                             .n_tokens = n,
                             .n_seqs = 1,
                             .q_begin = qb,
                             .sel_begin = sb,
                             .sel_slots = sel,
                             .n_heads = r->h,
                             .n_kv_heads = r->kh,
                             .head_dim = r->d,
                             .scale = 1.0f / sqrtf((float)r->d)};
        m->ops->kv_attend(m, l, &a);
        if (l == ol && out) memcpy(out, att, (size_t)n * r->h * r->d * sizeof(float));
    }
    free(att);
    r->n += n;
    m->ops->finish_step(m, &st);
}

static void rig_prefill(rig *r, int32_t n, int32_t chunk) {
    for (int32_t done = 0; done < n; done += chunk) {
        const int32_t c = LETHE_MIN(chunk, n - done);
        rig_step(r, c, true, done + c == n, -1, NULL);
    }
}

/* dense attention of query token t (all heads) in layer l over entries [0, t] */
static void dense_ref(const rig *r, int32_t l, int32_t t, float *out) {
    const int32_t g = r->h / r->kh, D = r->d;
    const double sc = 1.0 / sqrt((double)D);
    for (int32_t qh = 0; qh < r->h; qh++) {
        const float *q = QP(r, l, t) + (size_t)qh * D;
        const int32_t h = qh / g;
        double mx = -INFINITY, den = 0, acc[256] = {0};
        double *s = lethe_xmalloc((size_t)(t + 1) * sizeof(double));
        for (int32_t j = 0; j <= t; j++) {
            double d = 0;
            for (int32_t i = 0; i < D; i++) d += (double)q[i] * KP(r, l, j)[h * D + i];
            s[j] = d * sc;
            mx = fmax(mx, s[j]);
        }
        for (int32_t j = 0; j <= t; j++) {
            const double w = exp(s[j] - mx);
            den += w;
            for (int32_t i = 0; i < D; i++) acc[i] += w * VP(r, l, j)[h * D + i];
        }
        for (int32_t i = 0; i < D; i++) out[qh * D + i] = (float)(acc[i] / den);
        free(s);
    }
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double e = 0;
    for (size_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i]));
    return e;
}

/* ---- ops ---- */

static void test_ops(void) {
    lethe_backend *be = NULL;
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    enum { H = 4, KH = 2, D = 16, NS = 64 };
    static float kc[NS * KH * D], vc[NS * KH * D], q[2 * H * D], out[2 * H * D], ref[2 * H * D];
    for (int i = 0; i < NS * KH * D; i++) kc[i] = urand(), vc[i] = urand();
    for (int i = 0; i < 2 * H * D; i++) q[i] = 2 * urand();
    /* every key exact == dense attention (query row 1 over slots 0..40) */
    int32_t sel[41], xb[KH + 1], xs[41 * KH], eb[KH + 1] = {0};
    for (int i = 0; i < 41; i++) sel[i] = i;
    for (int h = 0; h <= KH; h++) xb[h] = 41 * h;
    for (int h = 0; h < KH; h++)
        for (int i = 0; i < 41; i++) xs[h * 41 + (40 - i)] = i; /* any order */
    int32_t qb[2] = {0, 1}, sb[2] = {0, 41}, qrow = 1;
    lethe_attn_args a = {.out = ref + H * D,
                         .q = q + H * D,
                         .k_cache = kc,
                         .v_cache = vc,
                         .n_tokens = 1,
                         .n_seqs = 1,
                         .q_begin = qb,
                         .sel_begin = sb,
                         .sel_slots = sel,
                         .n_heads = H,
                         .n_kv_heads = KH,
                         .head_dim = D,
                         .scale = 0.25f};
    be->ops->attention(be, &a);
    float dummy[D] = {0}, cnt0 = 1;
    lethe_cluster_attn_args ca = {.out = out,
                                  .q = q,
                                  .k_cache = kc,
                                  .v_cache = vc,
                                  .cent = dummy,
                                  .vsum = dummy,
                                  .count = &cnt0,
                                  .n_q = 1,
                                  .q_rows = &qrow,
                                  .x_begin = xb,
                                  .x_slots = xs,
                                  .e_begin = eb,
                                  .n_heads = H,
                                  .n_kv_heads = KH,
                                  .head_dim = D,
                                  .scale = 0.25f};
    be->ops->cluster_attention(be, &ca);
    CHECK_MSG(max_abs_diff(out + H * D, ref + H * D, H * D) < 1e-5, "all exact vs dense %g",
              max_abs_diff(out + H * D, ref + H * D, H * D));
    /* a cluster of identical keys: slots 10..19 get key 10; estimated == exact */
    for (int s = 11; s < 20; s++) memcpy(kc + s * KH * D, kc + 10 * KH * D, KH * D * sizeof(float));
    be->ops->attention(be, &a);
    float cent[KH * D], vsum[KH * D], cnt[KH] = {10, 10};
    int32_t xs2[31 * KH], xb2[KH + 1], eb2[KH + 1], ei[KH];
    for (int h = 0; h < KH; h++) {
        memcpy(cent + h * D, kc + (10 * KH + h) * D, D * sizeof(float));
        for (int i = 0; i < D; i++) {
            double s = 0;
            for (int t = 10; t < 20; t++) s += vc[(t * KH + h) * D + i];
            vsum[h * D + i] = (float)s;
        }
        xb2[h] = 31 * h, eb2[h] = h, ei[h] = h;
        int n = 0;
        for (int i = 0; i < 41; i++)
            if (i < 10 || i >= 20) xs2[h * 31 + n++] = i;
    }
    xb2[KH] = 31 * KH, eb2[KH] = KH;
    ca.cent = cent, ca.vsum = vsum, ca.count = cnt, ca.x_begin = xb2, ca.x_slots = xs2,
    ca.e_begin = eb2, ca.e_ids = ei;
    be->ops->cluster_attention(be, &ca);
    CHECK_MSG(max_abs_diff(out + H * D, ref + H * D, H * D) < 1e-5, "identical-key estimate %g",
              max_abs_diff(out + H * D, ref + H * D, H * D));
    /* assign: the first argmax of (k - mean) . c */
    enum { NC = 5 };
    float cc[KH * NC * D], mu[KH * D];
    for (int i = 0; i < KH * NC * D; i++) cc[i] = urand();
    for (int i = 0; i < KH * D; i++) mu[i] = 0.1f * urand();
    memcpy(cc + 3 * D, cc + 1 * D, D * sizeof(float)); /* head 0: centroids 1 and 3 tie: 1 wins */
    int32_t slots[NS], as[KH * NS];
    for (int i = 0; i < NS; i++) slots[i] = (i * 7) % NS;
    be->ops->cluster_assign(be, as, kc, slots, NS, cc, mu, NC, KH, D);
    for (int h = 0; h < KH; h++)
        for (int e = 0; e < NS; e++) {
            double best = -INFINITY;
            int bi = 0;
            for (int c = 0; c < NC; c++) {
                double s = 0;
                for (int i = 0; i < D; i++)
                    s += ((double)kc[(slots[e] * KH + h) * D + i] - mu[h * D + i]) *
                         cc[(h * NC + c) * D + i];
                if (s > best + 1e-9) best = s, bi = c;
            }
            CHECK_MSG(as[h * NS + e] == bi, "assign h %d e %d: %d vs %d", h, e, as[h * NS + e], bi);
            CHECK(as[h * NS + e] != 3 || h != 0);
        }
    /* scores: scale x mean over the group's query heads */
    int32_t beg[KH + 1] = {0, 2, 3}, ids[3] = {0, 1, 1};
    float sc[3];
    be->ops->cluster_scores(be, sc, q, cent, 1, &qrow, beg, ids, H, KH, D, 0.25f);
    for (int e = 0; e < 3; e++) {
        const int h = e < 2 ? 0 : 1;
        double s = 0;
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < D; i++)
                s += (double)q[(H + h * 2 + j) * D + i] * cent[ids[e] * D + i];
        CHECK_MSG(fabs(sc[e] - 0.25 * s / 2) < 1e-5, "scores %d: %g vs %g", e, sc[e], 0.25 * s / 2);
    }
    lethe_backend_destroy(be);
}

/* ---- the index ---- */

static const char *CFG =
    "retroinfer_sink=4,retroinfer_recent=8,retroinfer_cluster_size=8,retroinfer_segment=128,"
    "retroinfer_update=32,retroinfer_min_tokens=64";

static void check_index(rig *r, bool planted) {
    for (int32_t l = 0; l < r->nl; l++)
        for (int32_t h = 0; h < r->kh; h++) {
            lethe_retro_head_view v;
            CHECK(lethe_retroinfer_view(r->m, r->state, l, h, &v));
            CHECK(v.end > 4);
            uint8_t *seen = lethe_xcalloc((size_t)v.end, 1);
            for (int32_t c = 0; c < v.n_clusters; c++) {
                CHECK_MSG(v.mbeg[c + 1] > v.mbeg[c], "layer %d head %d cluster %d is empty", l, h,
                          c);
                float cent[256], vs[256], cnt;
                CHECK(lethe_retroinfer_table_row(r->m, l, v.rows[c], cent, vs, &cnt));
                CHECK_EQ_INT((int)cnt, v.mbeg[c + 1] - v.mbeg[c]);
                double mk[256] = {0}, sv[256] = {0};
                for (int32_t u = v.mbeg[c]; u < v.mbeg[c + 1]; u++) {
                    const int32_t e = v.members[u];
                    CHECK(e >= 4 && e < v.end && !seen[e]);
                    if (u > v.mbeg[c]) CHECK(e > v.members[u - 1]);
                    seen[e] = 1;
                    for (int32_t i = 0; i < r->d; i++)
                        mk[i] += KP(r, l, e)[h * r->d + i], sv[i] += VP(r, l, e)[h * r->d + i];
                }
                for (int32_t i = 0; i < r->d; i++) {
                    CHECK(fabs(mk[i] / cnt - cent[i]) < 1e-5);
                    CHECK(fabs(sv[i] - vs[i]) < 1e-4);
                }
                if (planted) /* duplicate keys: every cluster holds copies of one key */
                    for (int32_t u = v.mbeg[c]; u < v.mbeg[c + 1]; u++)
                        CHECK(!memcmp(KP(r, l, v.members[u]) + h * r->d,
                                      KP(r, l, v.members[v.mbeg[c]]) + h * r->d,
                                      (size_t)r->d * sizeof(float)));
            }
            for (int32_t e = 4; e < v.end; e++) CHECK_MSG(seen[e], "entry %d in no cluster", e);
            free(seen);
        }
}

static void test_index(void) {
    rig r;
    rig_open(&r, CFG, 2, 4, 2, 16);
    CHECK(rig_request(&r, 300) == LETHE_OK);
    fill(&r, 400, 0);
    rig_prefill(&r, 300, 64);
    lethe_retro_head_view v;
    CHECK(lethe_retroinfer_view(r.m, r.state, 0, 0, &v));
    CHECK_EQ_INT(v.end, 300 - 8); /* [4, 292): 2 segments of 144 */
    check_index(&r, false);
    /* decode: one update segment once 32 tokens left the recent window */
    for (int i = 0; i < 40; i++) rig_step(&r, 1, false, false, -1, NULL);
    CHECK(lethe_retroinfer_view(r.m, r.state, 1, 1, &v));
    CHECK_EQ_INT(v.end, 292 + 32);
    check_index(&r, false);
    rig_close(&r);
    /* planted duplicates: 7 distinct keys over 18 clusters per segment: most end empty */
    rig_open(&r, CFG, 1, 4, 2, 16);
    CHECK(rig_request(&r, 300) == LETHE_OK);
    fill(&r, 301, 7);
    rig_prefill(&r, 300, 300);
    check_index(&r, true);
    CHECK(lethe_retroinfer_view(r.m, r.state, 0, 0, &v));
    CHECK(v.n_clusters <= 2 * 7); /* 2 segments, 7 distinct keys */
    rig_close(&r);
}

/* ---- decode ---- */

/* the decode output of token 300 of a 300-token prompt under cfg (layer 0) */
static void decode_out(const char *extra, int32_t dup, float *out, rig *keep) {
    char cfg[512];
    snprintf(cfg, sizeof(cfg), "%s,%s", CFG, extra);
    rig r;
    rig_open(&r, cfg, 1, 4, 2, 16);
    CHECK(rig_request(&r, 300) == LETHE_OK);
    g_seed = 7;
    fill(&r, 302, dup);
    rig_prefill(&r, 300, 100);
    rig_step(&r, 1, false, false, 0, out);
    if (keep) *keep = r;
    else rig_close(&r);
}

/* oracle: rank clusters by the group-mean logit of the mean key, attend
 * exactly over sink + top ceil(ret n) clusters + tail (double) */
static void oracle(rig *r, double ret, float *out) {
    const int32_t g = r->h / r->kh, D = r->d, t = 300;
    const double sc = 1.0 / sqrt((double)D);
    for (int32_t h = 0; h < r->kh; h++) {
        lethe_retro_head_view v;
        CHECK(lethe_retroinfer_view(r->m, r->state, 0, h, &v));
        double *cs = lethe_xmalloc((size_t)v.n_clusters * sizeof(double));
        int32_t *ord = lethe_xmalloc((size_t)v.n_clusters * sizeof(int32_t));
        for (int32_t c = 0; c < v.n_clusters; c++) {
            float cent[256], vs[256], cnt;
            CHECK(lethe_retroinfer_table_row(r->m, 0, v.rows[c], cent, vs, &cnt));
            double s = 0;
            for (int32_t j = 0; j < g; j++)
                for (int32_t i = 0; i < D; i++)
                    s += (double)QP(r, 0, t)[(h * g + j) * D + i] * cent[i];
            cs[c] = s / g;
            ord[c] = c;
        }
        for (int32_t a = 0; a < v.n_clusters;
             a++) /* selection sort: best first, ties to the lower index */
            for (int32_t b = a + 1; b < v.n_clusters; b++)
                if (cs[ord[b]] > cs[ord[a]]) {
                    int32_t x = ord[a];
                    ord[a] = ord[b], ord[b] = x;
                }
        const int32_t n_ret = (int32_t)LETHE_MIN(v.n_clusters, ceil(ret * v.n_clusters - 1e-9));
        uint8_t *use = lethe_xcalloc(t + 1, 1);
        for (int32_t e = 0; e < 4; e++) use[e] = 1;
        for (int32_t e = v.end; e <= t; e++) use[e] = 1;
        for (int32_t k = 0; k < n_ret; k++)
            for (int32_t u = v.mbeg[ord[k]]; u < v.mbeg[ord[k] + 1]; u++) use[v.members[u]] = 1;
        for (int32_t j = 0; j < g; j++) {
            const float *q = QP(r, 0, t) + (size_t)(h * g + j) * D;
            double mx = -INFINITY, den = 0, acc[256] = {0};
            for (int32_t e = 0; e <= t; e++) {
                if (!use[e]) continue;
                double d = 0;
                for (int32_t i = 0; i < D; i++) d += (double)q[i] * KP(r, 0, e)[h * D + i];
                mx = fmax(mx, d * sc);
            }
            for (int32_t e = 0; e <= t; e++) {
                if (!use[e]) continue;
                double d = 0;
                for (int32_t i = 0; i < D; i++) d += (double)q[i] * KP(r, 0, e)[h * D + i];
                const double w = exp(d * sc - mx);
                den += w;
                for (int32_t i = 0; i < D; i++) acc[i] += w * VP(r, 0, e)[h * D + i];
            }
            for (int32_t i = 0; i < D; i++) out[(h * g + j) * D + i] = (float)(acc[i] / den);
        }
        free(use), free(cs), free(ord);
    }
}

static void test_decode(void) {
    enum { HD = 4 * 16 };
    float o[HD], ref[HD], o2[HD];
    rig r;
    /* retrieve = 1: the whole row through the backend attention, as dense */
    decode_out("retroinfer_retrieve=1", 0, o, &r);
    dense_ref(&r, 0, 300, ref);
    CHECK_MSG(max_abs_diff(o, ref, HD) < 1e-5, "retrieve=1 vs dense %g", max_abs_diff(o, ref, HD));
    rig_close(&r);
    /* every cluster retrieved through the three-zone op */
    decode_out("retroinfer_retrieve=0.99999,retroinfer_estimate=0", 0, o, &r);
    CHECK_MSG(max_abs_diff(o, ref, HD) < 1e-5, "all clusters exact vs dense %g",
              max_abs_diff(o, ref, HD));
    rig_close(&r);
    /* estimate 0: exactly sink + top clusters + tail (the oracle ranks itself) */
    decode_out("retroinfer_retrieve=0.2,retroinfer_estimate=0", 0, o, &r);
    oracle(&r, 0.2, o2);
    CHECK_MSG(max_abs_diff(o, o2, HD) < 1e-5, "top-cluster oracle %g", max_abs_diff(o, o2, HD));
    rig_close(&r);
    /* planted identical-key clusters, everything not retrieved estimated: exact */
    decode_out("retroinfer_retrieve=0.05,retroinfer_estimate=1", 7, o, &r);
    dense_ref(&r, 0, 300, ref);
    CHECK_MSG(max_abs_diff(o, ref, HD) < 1e-5, "identical keys estimated vs dense %g",
              max_abs_diff(o, ref, HD));
    rig_close(&r);
    /* random keys: the estimated zone helps, and more retrieval means less error */
    decode_out("retroinfer_retrieve=0.05,retroinfer_estimate=0", 0, o, &r);
    dense_ref(&r, 0, 300, ref);
    rig_close(&r);
    const double e_drop = max_abs_diff(o, ref, HD);
    decode_out("retroinfer_retrieve=0.05,retroinfer_estimate=1", 0, o, NULL);
    const double e_est = max_abs_diff(o, ref, HD);
    decode_out("retroinfer_retrieve=0.5,retroinfer_estimate=0.5", 0, o, NULL);
    const double e_half = max_abs_diff(o, ref, HD);
    fprintf(stderr,
            "    max abs err vs dense: retrieve 5%% only %.4f, + estimate rest %.4f, retrieve 50%% "
            "%.4f\n",
            e_drop, e_est, e_half);
    CHECK(e_est < e_drop && e_half < e_est && e_est < 0.25);
}

/* prompt 300 (chunks of 100), then `steps` decode tokens; out[t]: the last
 * layer's output of decode token t [4 x 16]; the rig stays open */
static void tier_run(const char *extra, int32_t steps, float (*out)[4 * 16], rig *r) {
    char cfg[512];
    snprintf(cfg, sizeof(cfg), "%s,%s", CFG, extra);
    rig_open(r, cfg, 2, 4, 2, 16);
    CHECK(rig_request(r, 300) == LETHE_OK);
    g_seed = 7;
    fill(r, 300 + steps, 0);
    rig_prefill(r, 300, 100);
    for (int32_t t = 0; t < steps; t++) rig_step(r, 1, false, false, 1, out[t]);
}

static void test_host_tier(void) {
    enum { HD = 4 * 16, STEPS = 40 };
    static float o[STEPS][HD], oh[STEPS][HD];
    const char *base = "retroinfer_retrieve=0.2,retroinfer_estimate=0.3";
    char cfg[256];
    rig r, rh;
    /* the device path vs the host tier, 2 layers, 40 tokens (one extension
     * segment at row length 332): bit-identical outputs; the host tier's row
     * holds sink + tail only, the rest of the pool is free again */
    tier_run(base, STEPS, o, &r);
    snprintf(cfg, sizeof(cfg), "%s,retroinfer_host_kv=true", base);
    tier_run(cfg, STEPS, oh, &rh);
    CHECK(!memcmp(o, oh, sizeof(o)));
    lethe_retro_head_view v;
    CHECK(lethe_retroinfer_view(rh.m, rh.state, 0, 0, &v));
    CHECK_EQ_INT(v.end, 4 + 288 + 32); /* the prompt's 2 segments and one extension */
    CHECK_EQ_INT(v.n_offloaded, 288 + 32);
    CHECK_EQ_INT(lethe_kv_row_len(rh.pool, 0, rh.row), 340 - 320); /* sink 4 + entries 324..339 */
    CHECK_EQ_INT(lethe_kv_row_len(r.pool, 0, r.row), 340);
    CHECK_EQ_INT(lethe_kv_min_free(rh.pool), lethe_kv_min_free(r.pool) + 320);
    CHECK(lethe_kv_check(rh.pool, NULL, 0) == LETHE_OK);
    lethe_retro_counters c;
    lethe_retroinfer_counters(rh.m, &c);
    CHECK(c.misses > 0 && c.hits > 0 && c.pool_reads == 0 && c.demoted == 0);
    CHECK_EQ_INT(c.offloaded, 320);
    fprintf(stderr, "    host tier: %lld hits, %lld misses, %.1f KiB fetched over %d tokens\n",
            (long long)c.hits, (long long)c.misses, c.bytes_fetched / 1024.0, STEPS);
    rig_close(&rh);
    /* a ring of 40 head vectors (one token retrieves ~44 per layer): the
     * best clusters fit, the rest of the retrieved ones are estimated (they
     * are no longer in the pool) */
    snprintf(cfg, sizeof(cfg), "%s,retroinfer_host_kv=true,retroinfer_cache_rows=40", base);
    tier_run(cfg, STEPS, oh, &rh);
    lethe_retroinfer_counters(rh.m, &c);
    CHECK(c.demoted > 0 && c.pool_reads == 0);
    double worst = 0;
    for (int32_t t = 0; t < STEPS; t++)
        for (int32_t i = 0; i < HD; i++) {
            CHECK(isfinite(oh[t][i]));
            worst = fmax(worst, fabs((double)oh[t][i] - o[t][i]));
        }
    fprintf(stderr, "    ring of 40 rows: %lld clusters estimated, max abs diff %.3f\n",
            (long long)c.demoted, worst);
    CHECK(worst > 0 && worst < 1.0);
    rig_close(&rh);
    rig_close(&r);
    /* admission: the prompt's host bytes past the budget are refused by name */
    rig_open(&r, "retroinfer_host_kv=true,retroinfer_host_gib=0.0000001", 2, 4, 2, 16);
    lethe_status st = rig_request(&r, 300);
    CHECK(st == LETHE_ERR_CAPACITY);
    CHECK_STR_CONTAINS(lethe_last_error(), "retroinfer_host_gib");
    r.state = NULL;
    rig_close(&r);
}

/* ---- the host tier through the engine: capacity ---- */

enum { EN_REQ = 12, EN_PROMPT = 100, EN_GEN = 24, EN_VOCAB = 256 };
typedef struct en_out {
    int32_t tokens[EN_REQ][EN_GEN];
    float logits[EN_REQ][EN_GEN][EN_VOCAB];
    int32_t n[EN_REQ];
    int32_t max_running;
    int64_t preemptions, slots;
} en_out;
typedef struct en_user {
    en_out *o;
    int32_t r;
} en_user;

static void en_event(void *user, const lethe_event *ev) {
    en_user *u = user;
    en_out *o = u->o;
    if (ev->n_tokens != 1 || o->n[u->r] >= EN_GEN) return;
    CHECK(ev->logits && ev->n_vocab == EN_VOCAB);
    o->tokens[u->r][o->n[u->r]] = ev->token;
    memcpy(o->logits[u->r][o->n[u->r]], ev->logits, sizeof(o->logits[0][0]));
    o->n[u->r]++;
}

#define EN_CFG                                                                                \
    "retroinfer_sink=2,retroinfer_recent=4,retroinfer_cluster_size=16,retroinfer_segment=32," \
    "retroinfer_update=16,retroinfer_min_tokens=32,retroinfer_retrieve=0.2,retroinfer_estimate=0.3"

/* 12 requests of 100 tokens + 24 greedy tokens on the tiny Llama (CPU,
 * dummy weights), a KV budget of `kv_bytes` */
static void en_run(const char *cfg, size_t kv_bytes, en_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "tests/data/tiny-llama/config.json";
    p.load_format = "dummy";
    p.seed = 11;
    p.device = "cpu";
    p.n_threads = 1;
    p.kv_cache_bytes = kv_bytes;
    p.max_model_len = 128;
    p.max_num_batched_tokens = 128;
    p.enable_prefix_caching = false;
    p.sparse_method = "retroinfer";
    p.sparse_config = cfg;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    o->slots = st.kv_slots_total;
    static int32_t ids[EN_REQ][EN_PROMPT];
    static en_user users[EN_REQ];
    for (int32_t r = 0; r < EN_REQ; r++) {
        for (int i = 0; i < EN_PROMPT; i++) ids[r][i] = 3 + (int32_t)((i * 37 + 5 + 11 * r) % 250);
        users[r] = (en_user){o, r};
        lethe_request_params rp = {.prompt = ids[r],
                                   .n_prompt = EN_PROMPT,
                                   .cb = en_event,
                                   .user = &users[r],
                                   .want_logits = true};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = EN_GEN;
        rp.sampling.ignore_eos = true;
        uint64_t id;
        CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    }
    while (lethe_engine_has_work(e)) {
        CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
        lethe_engine_get_stats(e, &st);
        o->max_running = LETHE_MAX(o->max_running, st.n_running);
    }
    lethe_engine_get_stats(e, &st);
    o->preemptions = st.n_preemptions;
    CHECK_EQ_INT(st.kv_slots_used, 0);
    for (int32_t r = 0; r < EN_REQ; r++) CHECK_EQ_INT(o->n[r], EN_GEN);
    lethe_engine_destroy(e);
}

/* The same device budget (~1000 slots of the device path: 8 full rows)
 * without and with the host tier: the tier admits all 12 requests at once
 * without a preemption (each holds sink + tail in the pool once its prompt
 * is clustered; its ring and its tables for 1536 context tokens are paid
 * out of the same budget), the device path cannot; the tier's tokens and
 * logits equal the device path's run with a pool large enough for the same
 * schedule, bit for bit (its ring of 128 head vectors per layer holds one
 * request's retrieval, not all of them: the layer runs in several passes). */
static void test_engine_tier(void) {
    static en_out big, dev, tier;
    en_run(EN_CFG, (size_t)16 << 20, &big);
    CHECK(big.max_running == EN_REQ && big.preemptions == 0);
    /* ~1000 slots: a per-slot cost from the big engine's budget */
    const double slot_b = (double)((size_t)16 << 20) / (double)big.slots;
    const size_t budget = (size_t)(1000 * slot_b);
    en_run(EN_CFG, budget, &dev);
    en_run(EN_CFG ",retroinfer_host_kv=true,retroinfer_cache_rows=128,retroinfer_context_tokens=1536",
           budget, &tier);
    fprintf(stderr,
            "    %zu KiB of KV: device path %lld slots, %d requests at once, %lld preemptions; "
            "host tier %lld slots (ring reserved), %d at once, %lld preemptions\n",
            budget >> 10, (long long)dev.slots, dev.max_running, (long long)dev.preemptions,
            (long long)tier.slots, tier.max_running, (long long)tier.preemptions);
    CHECK(tier.slots < dev.slots); /* the ring is paid for out of the same budget */
    CHECK(dev.max_running <= dev.slots / EN_PROMPT && dev.max_running < EN_REQ);
    CHECK(tier.max_running == EN_REQ && tier.preemptions == 0);
    CHECK(!memcmp(tier.tokens, big.tokens, sizeof(big.tokens)));
    CHECK(!memcmp(tier.logits, big.logits, sizeof(big.logits)));
}

/* ---- the reference comparison (tests/e2e/test_retroinfer_ref.py) ---- */

static int ref_main(const char *in, const char *outp) {
    FILE *f = fopen(in, "rb");
    if (!f) return fprintf(stderr, "cannot open %s\n", in), 2;
    int32_t hdr[10];
    double bud[2];
    CHECK(fread(hdr, sizeof(int32_t), 10, f) == 10 && fread(bud, sizeof(double), 2, f) == 2);
    const int32_t N = hdr[0], H = hdr[1], KH = hdr[2], D = hdr[3];
    char cfg[512];
    snprintf(
        cfg, sizeof(cfg),
        "retroinfer_sink=%d,retroinfer_recent=%d,retroinfer_cluster_size=%d,retroinfer_segment=%d,"
        "retroinfer_update=%d,retroinfer_min_tokens=%d,retroinfer_kmeans_iters=%d,retroinfer_"
        "retrieve=%.17g,"
        "retroinfer_estimate=%.17g",
        hdr[4], hdr[5], hdr[6], hdr[7], hdr[8], hdr[8], hdr[9], bud[0], bud[1]);
    rig r;
    rig_open(&r, cfg, 1, H, KH, D);
    CHECK(N <= MAXN);
    CHECK(fread(r.k, sizeof(float), (size_t)N * KH * D, f) == (size_t)N * KH * D);
    CHECK(fread(r.v, sizeof(float), (size_t)N * KH * D, f) == (size_t)N * KH * D);
    CHECK(fread(QP(&r, 0, N - 1), sizeof(float), (size_t)H * D, f) == (size_t)H * D);
    fclose(f);
    CHECK(rig_request(&r, N - 1) == LETHE_OK);
    rig_prefill(&r, N - 1, 128);
    float *o = lethe_xmalloc((size_t)H * D * sizeof(float));
    rig_step(&r, 1, false, false, 0, o);
    FILE *g = fopen(outp, "wb");
    CHECK(g);
    for (int32_t h = 0; h < KH; h++) {
        lethe_retro_head_view v;
        CHECK(lethe_retroinfer_view(r.m, r.state, 0, h, &v));
        fwrite(&v.end, sizeof(int32_t), 1, g);
        fwrite(&v.n_clusters, sizeof(int32_t), 1, g);
        fwrite(v.mbeg, sizeof(int32_t), (size_t)v.n_clusters + 1, g);
        fwrite(v.members, sizeof(int32_t), (size_t)v.mbeg[v.n_clusters], g);
    }
    fwrite(o, sizeof(float), (size_t)H * D, g);
    fclose(g);
    free(o);
    rig_close(&r);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--ref")) return ref_main(argv[2], argv[3]);
    TEST_RUN(test_ops);
    TEST_RUN(test_index);
    TEST_RUN(test_decode);
    TEST_RUN(test_host_tier);
    TEST_RUN(test_engine_tier);
    printf("test_retroinfer: ok\n");
    return 0;
}

/* test_sparse_methods.c - every registered sparse method through the contract
 * (src/sparse/sparse.h) on the real KV pool and the CPU backend's attention
 * op, with synthetic per-layer q/k/v (a deterministic function of request,
 * layer, position), so that methods are checked without a model:
 *
 *  - conformance: the same scripted lifecycle for every method (two requests,
 *    chunked prefill, decode, abort, preemption + recompute, chain
 *    snapshot/restore) with the KV ownership checker after every step;
 *  - identity (T0): with budgets >= the context every method's attention
 *    outputs are bit-identical to dense (fp8_kv: within the E4M3 bound);
 *  - eviction methods free exactly the expected slots; logical ones none;
 *  - per-method properties: StreamingLLM's kept ranges and decode cycle,
 *    SnapKV's kept set == oracle top-k of window logits, PyramidKV per-layer
 *    budgets, H2O compaction between chunks, Quest page count and
 *    current-page rule and its selection == a scratch oracle (batched decode,
 *    page boundaries, compaction), OmniKV sparse layers == sink + oracle top-K + recent,
 *    R-KV keeps the newer of two copied keys and its importance == a float64
 *    oracle, SkipKV removes the earlier of two copied spans whole and evicts
 *    whole spans under pressure, its steering knob refuses to run without an asset,
 *    KIVI / FP8 stored values within their bounds and tail pages exact;
 *  - registry and knob parsing errors, the contract's registry rules (broken
 *    tables rejected with the method and the rule named), the OmniKV layer
 *    picker.
 * The generic parts iterate the registry and run each method's own
 * test_configs (sparse.h), including a throwaway method registered here
 * (sparse_throwaway.h): a new method needs no edit in this file. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/kv_codec.h"
#include "backend/topk.h"
#include "core/util.h"
#include "kv/kv_pool.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"
#include "sparse_throwaway.h"
#include "test.h"

enum { NL = 4, H = 4, HK = 2, D = 32, KVD = HK * D, NSLOTS = 512, MAXR = 4, MAXT = 256 };

/* planted structure for the R-KV / SkipKV properties: one-hot keys (every
 * position its own direction per head) with key g_dup_dst a copy of g_dup_src;
 * V rows of [g_vdup_dst, + g_vdup_len) copies of those from g_vdup_src */
static int g_onehot_keys, g_dup_src = -1, g_dup_dst = -1;
static int g_vdup_src = -1, g_vdup_dst = -1, g_vdup_len;

/* deterministic synthetic activations in [-1, 1] */
static float gen(uint64_t req, int layer, int pos, int which, int i) {
    if (which == 1 && g_onehot_keys) {
        const int pp = pos == g_dup_dst ? g_dup_src : pos;
        return i % D == (pp + i / D) % D ? 1.0f : 0.0f;
    }
    if (which == 2 && g_vdup_dst >= 0 && pos >= g_vdup_dst && pos < g_vdup_dst + g_vdup_len)
        pos = pos - g_vdup_dst + g_vdup_src;
    uint64_t s = req * 0x9E3779B97F4A7C15ull ^ ((uint64_t)layer << 48) ^ ((uint64_t)pos << 20) ^
                 ((uint64_t)which << 16) ^ (uint64_t)i;
    float x = (float)((lethe_splitmix64(&s) >> 40) * 0x1p-24) * 2.0f - 1.0f;
    if (which == 1 && pos % 7 == 3) x *= 2.5f; /* some keys stand out */
    return x;
}

typedef struct hreq {
    bool active;
    uint64_t id;
    int32_t row, n_prompt, n_total, n_done;
    void *state;
    float out[NL][H * D];       /* attention output of the last new token, per layer */
    float (*by_pos)[NL][H * D]; /* optional: output of every token by position */
} hreq;

typedef struct harness {
    lethe_backend *be;
    lethe_kv_pool *pool;
    lethe_sparse_method *m;
    hreq r[MAXR];
    int32_t chunk;
    /* the last step's selections (positions) of request 0, per layer, and
     * per KV head when select_layer built per-KV-head lists (n_hsel 0: none) */
    int32_t sel_pos[NL][NSLOTS], n_sel[NL];
    int32_t hsel_pos[NL][HK][NSLOTS], n_hsel[NL][HK];
    int32_t n_select_layer[4]; /* select_layer answers by lethe_sel_result */
} harness;

static void h_open(harness *h, const char *method, const char *cfg) {
    memset(h, 0, sizeof(*h));
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    CHECK(lethe_backend_create(&bp, &h->be) == LETHE_OK);
    const lethe_sparse_ops *o = lethe_sparse_find(method);
    CHECK_MSG(o, "%s", lethe_last_error());
    /* as the engine: the method first (it declares the KV format), then its pool */
    lethe_sparse_env env = {.pool = NULL, .be = h->be, .n_layers = NL, .n_heads = H,
                            .n_kv_heads = HK, .head_dim = D, .max_model_len = 4096};
    CHECK_MSG(lethe_sparse_create(method, cfg, &env, &h->m) == LETHE_OK, "%s", lethe_last_error());
    lethe_kv_layout layouts[NL];
    const bool own = lethe_sparse_kv_layouts(h->m, layouts); /* a COMPRESSION method's payload */
    lethe_kv_pool_params pp = {.n_layers = NL, .n_kv_heads = HK, .head_dim = D, .n_slots = NSLOTS,
                               .per_layer = (o->flags & LETHE_SPARSE_PER_LAYER_ROWS) != 0, .be = h->be,
                               .format = lethe_sparse_kv_format(h->m), .kivi_res_blocks = MAXR,
                               .layouts = own ? layouts : NULL,
                               .head_masks = (o->flags & LETHE_SPARSE_HEAD_ROWS) != 0};
    CHECK_MSG(lethe_kv_pool_create(&pp, &h->pool) == LETHE_OK, "%s", lethe_last_error());
    h->m->env.pool = h->pool;
    h->chunk = 24;
}

static void h_add(harness *h, int i, uint64_t id, int32_t n_prompt, int32_t n_total) {
    hreq *r = &h->r[i];
    memset(r, 0, sizeof(*r));
    r->active = true;
    r->id = id;
    r->row = lethe_kv_row_alloc(h->pool);
    r->n_prompt = n_prompt;
    r->n_total = n_total;
    lethe_sparse_seq s = {.request_id = id, .row = r->row, .n_prompt = n_prompt};
    r->state = NULL;
    if (h->m->ops->request_init) CHECK(h->m->ops->request_init(h->m, &s, &r->state) == LETHE_OK);
}

static void h_drop(harness *h, int i) { /* finished, aborted or preempted */
    hreq *r = &h->r[i];
    if (h->m->ops->request_finished) h->m->ops->request_finished(h->m, r->state);
    lethe_kv_row_release(h->pool, r->row);
    r->active = false;
}

static int64_t row_slots_total(harness *h) {
    int64_t n = 0;
    for (int i = 0; i < MAXR; i++)
        if (h->r[i].active)
            for (int sp = 0; sp < lethe_kv_n_spaces(h->pool); sp++) n += lethe_kv_row_len(h->pool, sp, h->r[i].row);
    return n;
}

static void check_invariants(harness *h) {
    lethe_status st = lethe_kv_check(h->pool, NULL, 0);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
    int64_t cap = (int64_t)NSLOTS * lethe_kv_n_spaces(h->pool);
    CHECK_EQ_INT(lethe_kv_total_free(h->pool) + row_slots_total(h), cap);
}

/* one engine step over every active request that still has tokens to run */
static void h_step(harness *h) {
    lethe_sparse_seq seqs[MAXR];
    int idx[MAXR], n_seqs = 0, n_tok = 0;
    static int32_t pos[MAXT], seq_begin[MAXR + 1], q_begin[MAXR + 1];
    for (int i = 0; i < MAXR; i++) {
        hreq *r = &h->r[i];
        if (!r->active || r->n_done >= r->n_total) continue;
        bool pre = r->n_done < r->n_prompt;
        int32_t rem = r->n_prompt - r->n_done, n = pre ? LETHE_MIN(h->chunk, rem) : 1;
        int32_t mfc = lethe_sparse_min_final_chunk(h->m); /* prefill policy: a long enough final chunk */
        if (pre && rem > n && rem - n < mfc) n = LETHE_MAX(1, rem - mfc);
        for (int32_t t = 0; t < n; t++) pos[n_tok + t] = r->n_done + t;
        CHECK(lethe_kv_row_append(h->pool, r->row, n, pos + n_tok));
        seqs[n_seqs] = (lethe_sparse_seq){.request_id = r->id, .state = r->state, .row = r->row,
                                          .q_row = n_tok, .n_new = n, .first_pos = r->n_done,
                                          .n_prompt = r->n_prompt, .is_prefill = pre,
                                          .is_final_chunk = pre && r->n_done + n == r->n_prompt};
        seq_begin[n_seqs] = q_begin[n_seqs] = n_tok;
        idx[n_seqs++] = i;
        n_tok += n;
    }
    if (!n_seqs) return;
    seq_begin[n_seqs] = q_begin[n_seqs] = n_tok;
    lethe_fwd_batch b = {.n_tokens = n_tok, .pos = pos, .n_seqs = n_seqs, .seq_begin = seq_begin};
    lethe_sparse_step st = {.index = 0, .n_seqs = n_seqs, .seqs = seqs, .batch = &b};
    lethe_sparse_method *m = h->m;
    if (m->ops->prepare) m->ops->prepare(m, &st);
    static float q[MAXT * H * D], k[MAXT * KVD], v[MAXT * KVD], out[MAXT * H * D];
    static int32_t sel[MAXR * NSLOTS], sel_begin[MAXR + 1], store[MAXT];
    for (int l = 0; l < NL; l++) {
        for (int s = 0; s < n_seqs; s++)
            for (int t = 0; t < seqs[s].n_new; t++) {
                int row = seqs[s].q_row + t, p = pos[row];
                uint64_t id = h->r[idx[s]].id;
                for (int i = 0; i < H * D; i++) q[row * H * D + i] = gen(id, l, p, 0, i);
                for (int i = 0; i < KVD; i++) k[row * KVD + i] = gen(id, l, p, 1, i);
                for (int i = 0; i < KVD; i++) v[row * KVD + i] = gen(id, l, p, 2, i);
            }
        int32_t n_sel = 0;
        int32_t sp = lethe_kv_space_of(h->pool, l);
        /* as the engine does (engine_forward.c stage_rows): a method with
         * select_layer answers for the whole step from the full rows; its
         * BUILT selections are backend memory, which is host memory here */
        static int32_t rows[MAXR * NSLOTS], rows_begin[MAXR + 1];
        const int32_t *lsb = NULL, *lss = NULL, *hb = NULL, *hs = NULL;
        lethe_sel_result how = LETHE_SEL_PER_SEQ;
        if (m->ops->select_layer) {
            int32_t off = 0;
            for (int s = 0; s < n_seqs; s++) {
                int32_t L = lethe_kv_row_len(h->pool, sp, seqs[s].row);
                memcpy(rows + off, lethe_kv_row_slots(h->pool, sp, seqs[s].row), sizeof(int32_t) * L);
                rows_begin[s] = off;
                off += L;
            }
            rows_begin[n_seqs] = off;
            lethe_step_rows sr = {.begin = rows_begin, .slots = rows};
            how = m->ops->select_layer(m, l, &st, q, &sr, &lsb, &lss);
            if (how == LETHE_SEL_FULL) lsb = rows_begin, lss = rows;
            /* per-KV-head lists: attention reads them, the sequences' selections are the rows */
            if (how == LETHE_SEL_BUILT_HEADS) hb = lsb, hs = lss, lsb = rows_begin, lss = rows;
            h->n_select_layer[how]++;
        }
        memset(h->n_hsel[l], 0, sizeof(h->n_hsel[l]));
        for (int s = 0; hb && s < n_seqs; s++) { /* each list: a subsequence of the row, new tokens last */
            const int32_t L = lethe_kv_row_len(h->pool, sp, seqs[s].row);
            const int32_t *rs = lethe_kv_row_slots(h->pool, sp, seqs[s].row);
            const int32_t *rp = lethe_kv_row_pos(h->pool, sp, seqs[s].row);
            for (int g = 0; g < HK; g++) {
                const int32_t *lst = hs + hb[s * HK + g], n = hb[s * HK + g + 1] - hb[s * HK + g];
                CHECK(n >= seqs[s].n_new && n <= L);
                for (int t = 0; t < seqs[s].n_new; t++)
                    CHECK_EQ_INT(lst[n - seqs[s].n_new + t], rs[L - seqs[s].n_new + t]);
                for (int32_t e = 0, j = 0; e < n; e++, j++) {
                    while (j < L && rs[j] != lst[e]) j++;
                    CHECK(j < L);
                    if (idx[s] == 0) h->hsel_pos[l][g][e] = rp[j];
                }
                if (idx[s] == 0) h->n_hsel[l][g] = n;
            }
        }
        bool want = m->ops->needs_scores && m->ops->needs_scores(m, l);
        for (int s = 0; s < n_seqs; s++) {
            int32_t L = lethe_kv_row_len(h->pool, sp, seqs[s].row);
            const int32_t *rs = lethe_kv_row_slots(h->pool, sp, seqs[s].row);
            for (int t = 0; t < seqs[s].n_new; t++) store[seqs[s].q_row + t] = rs[L - seqs[s].n_new + t];
            sel_begin[s] = n_sel;
            int32_t n;
            if (how != LETHE_SEL_PER_SEQ) {
                n = lsb[s + 1] - lsb[s];
                CHECK(n <= L);
                memcpy(sel + n_sel, lss + lsb[s], sizeof(int32_t) * (size_t)(n > 0 ? n : 0));
            } else {
                n = lethe_sparse_build_selection(m, l, &st, s, q, sel + n_sel, L);
            }
            CHECK(n >= seqs[s].n_new && n <= L);
            for (int t = 0; t < seqs[s].n_new; t++) /* the new tokens last, in order */
                CHECK_EQ_INT(sel[n_sel + n - seqs[s].n_new + t], rs[L - seqs[s].n_new + t]);
            if (idx[s] == 0) { /* record positions for the property tests */
                h->n_sel[l] = n;
                const int32_t *rp = lethe_kv_row_pos(h->pool, sp, seqs[s].row);
                for (int32_t e = 0, j = 0; e < n; e++) {
                    while (rs[j] != sel[n_sel + e]) j++;
                    h->sel_pos[l][e] = rp[j];
                }
            }
            n_sel += n;
        }
        sel_begin[n_seqs] = n_sel;
        const lethe_kv_quant *kvq = lethe_kv_quant_of(h->pool, l);
        const lethe_kv_path *path = lethe_sparse_kv_path(m); /* as the model does (arch_llama.c) */
        if (path)
            path->store(path->ctx, l, k, v, store, pos, n_tok);
        else if (kvq)
            h->be->ops->kv_store_quant(h->be, kvq, lethe_kv_k(h->pool, l), lethe_kv_v(h->pool, l), k, v,
                                       store, n_tok, HK, D);
        else
            h->be->ops->kv_store(h->be, lethe_kv_k(h->pool, l), lethe_kv_v(h->pool, l), k, v, store, n_tok, KVD);
        lethe_attn_args a = {.out = out, .q = q, .k_cache = lethe_kv_k(h->pool, l),
                             .v_cache = lethe_kv_v(h->pool, l), .n_tokens = n_tok, .n_seqs = n_seqs,
                             .q_begin = q_begin, .sel_begin = sel_begin, .sel_slots = sel,
                             .head_sel_begin = hb, .head_sel_slots = hs,
                             .n_heads = H, .n_kv_heads = HK, .head_dim = D, .scale = 0.25f, .kvq = kvq};
        if (path)
            path->attend(path->ctx, l, &a);
        else
            h->be->ops->attention(h->be, &a);
        if (m->ops->after_attn) m->ops->after_attn(m, l, &st, want ? &a : NULL);
        if (m->ops->layer_end) m->ops->layer_end(m, l, &st);
        for (int s = 0; s < n_seqs; s++) {
            hreq *r = &h->r[idx[s]];
            memcpy(r->out[l], out + (size_t)(seqs[s].q_row + seqs[s].n_new - 1) * H * D, sizeof(float) * H * D);
            for (int t = 0; r->by_pos && t < seqs[s].n_new; t++)
                memcpy(r->by_pos[r->n_done + t][l], out + (size_t)(seqs[s].q_row + t) * H * D,
                       sizeof(float) * H * D);
        }
    }
    if (m->ops->finish_step) m->ops->finish_step(m, &st);
    for (int s = 0; s < n_seqs; s++) h->r[idx[s]].n_done += seqs[s].n_new;
    check_invariants(h);
}

static void h_close(harness *h) {
    for (int i = 0; i < MAXR; i++)
        if (h->r[i].active) h_drop(h, i);
    CHECK_EQ_INT(lethe_kv_total_free(h->pool), (int64_t)NSLOTS * lethe_kv_n_spaces(h->pool));
    lethe_sparse_destroy(h->m);
    lethe_kv_pool_destroy(h->pool);
    lethe_backend_destroy(h->be);
}

/* ---- identity: budgets >= context => bit-identical to dense ---- */

typedef struct trace {
    float out[80][NL][H * D]; /* request 0's outputs by position */
    int n;
} trace;

/* layers whose per-KV-head lists select_layer built in the last run_script */
static int32_t g_heads_built;

/* returns whether the method stores lossy codes with this config (its pool's
 * KV format is not the backend's native one) */
static bool run_script(const char *method, const char *cfg, trace *tr) {
    harness h;
    h_open(&h, method, cfg);
    const bool lossy = lethe_kv_format_of(h.pool) != LETHE_KV_NATIVE;
    h_add(&h, 0, 11, 70, 80);
    h_add(&h, 1, 22, 45, 52);
    h.r[0].by_pos = tr->out;
    while (h.r[0].n_done < h.r[0].n_total) h_step(&h);
    tr->n = h.r[0].n_total;
    g_heads_built = h.n_select_layer[LETHE_SEL_BUILT_HEADS];
    h_close(&h);
    return lossy;
}

/* every method with its identity config (budgets >= context): bit-identical
 * to dense, or close when it stores lossy codes (fp8_kv: every token is read
 * as E4M3 codes, its own step included) */
static void test_identity(void) {
    static trace dense, tr;
    run_script("dense", NULL, &dense);
    int n_lossy = 0;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *o = lethe_sparse_method_at(i);
        fprintf(stderr, "    %s\n", o->name);
        const bool lossy = run_script(o->name, o->test_configs.identity, &tr);
        CHECK_EQ_INT(tr.n, dense.n);
        if (lossy) {
            double e = rel_err(&tr.out[0][0][0], &dense.out[0][0][0], (size_t)tr.n * NL * H * D);
            const double tol = o->test_configs.lossy_rel_err > 0 ? o->test_configs.lossy_rel_err : 0.05;
            fprintf(stderr, "      lossy: rel err %.4f (bound %.2f)\n", e, tol);
            CHECK_MSG(e > 0 && e < tol, "%s rel err %g", o->name, e);
            n_lossy++;
        } else {
            CHECK_MSG(memcmp(tr.out, dense.out, sizeof(tr.out[0]) * (size_t)tr.n) == 0,
                      "%s with budgets >= context differs from dense", o->name);
        }
    }
    CHECK(n_lossy >= 1); /* fp8_kv */
}

/* ---- lifecycle: abort, preemption + recompute, chain snapshot/restore ---- */

static void lifecycle(const char *method, const char *cfg) {
    harness h;
    h_open(&h, method, cfg);
    h.chunk = 16;
    h_add(&h, 0, 1, 60, 75);
    h_add(&h, 1, 2, 90, 95);
    h_add(&h, 2, 3, 40, 44);
    h_step(&h);
    h_step(&h);
    h_drop(&h, 2); /* abort mid-prefill */
    check_invariants(&h);
    for (int i = 0; i < 4; i++) h_step(&h);
    /* preempt request 1 (recompute: prompt = everything it had) */
    int32_t done = h.r[1].n_done;
    h_drop(&h, 1);
    check_invariants(&h);
    h_add(&h, 1, 2, done, done + 5);
    while (h.r[0].n_done < h.r[0].n_total || h.r[1].n_done < h.r[1].n_total) h_step(&h);
    /* chain: snapshot request 0's state, free it, restore into a fresh one, resume a new turn */
    if (h.m->ops->snapshot) {
        size_t n = h.m->ops->snapshot(h.m, h.r[0].state, NULL, 0);
        char *buf = malloc(n + 1), *buf2 = malloc(n + 1);
        CHECK_EQ_INT(h.m->ops->snapshot(h.m, h.r[0].state, buf, n), n);
        h.m->ops->request_finished(h.m, h.r[0].state);
        lethe_sparse_seq s = {.row = h.r[0].row, .n_prompt = h.r[0].n_total + 20};
        CHECK(h.m->ops->request_init(h.m, &s, &h.r[0].state) == LETHE_OK);
        CHECK(h.m->ops->restore(h.m, h.r[0].state, buf, n) == LETHE_OK);
        CHECK_EQ_INT(h.m->ops->snapshot(h.m, h.r[0].state, buf2, n), n);
        CHECK(memcmp(buf, buf2, n) == 0);
        if (n > 4) CHECK(h.m->ops->restore(h.m, h.r[0].state, buf, n - 1) != LETHE_OK);
        CHECK(h.m->ops->restore(h.m, h.r[0].state, buf, n) == LETHE_OK);
        free(buf);
        free(buf2);
    }
    h.r[0].n_prompt = h.r[0].n_total + 20; /* the next turn's suffix is a prefill */
    h.r[0].n_total += 26;
    while (h.r[0].n_done < h.r[0].n_total) h_step(&h);
    h_close(&h);
}

static void test_lifecycle_all(void) {
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const char *name = lethe_sparse_method_at(i)->name;
        fprintf(stderr, "    %s\n", name);
        /* budgets > context, nothing evicted: the identity config (the defaults for
         * most methods; a method that needs an artifact names a built-in one) */
        lifecycle(name, lethe_sparse_method_at(i)->test_configs.identity);
        const char *small = lethe_sparse_method_at(i)->test_configs.small;
        if (small) lifecycle(name, small); /* budgets that evict / select */
    }
}

/* ---- properties ---- */

static int32_t len_of(harness *h, int l, int i) {
    return lethe_kv_row_len(h->pool, lethe_kv_space_of(h->pool, l), h->r[i].row);
}
static const int32_t *pos_of(harness *h, int l, int i) {
    return lethe_kv_row_pos(h->pool, lethe_kv_space_of(h->pool, l), h->r[i].row);
}

static void test_streamingllm(void) {
    harness h;
    h_open(&h, "attention-sink", "sink_keep_tokens=4,recent_keep_tokens=12");
    h_add(&h, 0, 5, 70, 120);
    int64_t free0 = lethe_kv_total_free(h.pool);
    while (h.r[0].n_done < 70) h_step(&h);
    for (int l = 0; l < NL; l++) { /* exactly [0, 4) and [58, 70) */
        CHECK_EQ_INT(len_of(&h, l, 0), 16);
        for (int e = 0; e < 16; e++) CHECK_EQ_INT(pos_of(&h, l, 0)[e], e < 4 ? e : 54 + e);
    }
    CHECK_EQ_INT(lethe_kv_total_free(h.pool), free0 - 16 * NL); /* 54 slots per layer freed */
    int lo = 1000, hi = 0;
    while (h.r[0].n_done < h.r[0].n_total) {
        h_step(&h);
        lo = LETHE_MIN(lo, len_of(&h, 0, 0));
        hi = LETHE_MAX(hi, len_of(&h, 0, 0));
    }
    CHECK_EQ_INT(lo, 16); /* between s + r and 2 (s + r) */
    CHECK_EQ_INT(hi, 31);
    h_close(&h);
}

/* oracle: SnapKV logits score of position j at layer l = max over heads and
 * the last w prompt queries of scale * q . k (GQA head h reads KV head h / 2) */
static float snap_oracle(uint64_t id, int l, int j, int n_prompt, int w) {
    float best = -INFINITY;
    for (int p = n_prompt - w; p < n_prompt; p++)
        for (int hh = 0; hh < H; hh++) {
            float d = 0;
            for (int c = 0; c < D; c++)
                d += gen(id, l, p, 0, hh * D + c) * gen(id, l, j, 1, (hh / 2) * D + c);
            best = fmaxf(best, 0.25f * d);
        }
    return best;
}

static void test_snapkv(void) {
    harness h;
    h_open(&h, "snapkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=10,snapkv_window_size=8");
    CHECK_EQ_INT(lethe_sparse_min_final_chunk(h.m), 8);
    h_add(&h, 0, 77, 100, 100);
    h_add(&h, 1, 78, 30, 30); /* shorter than the budget: kept whole */
    while (h.r[0].n_done < 100) h_step(&h);
    CHECK_EQ_INT(len_of(&h, 0, 1), 22); /* 30 > 22: compacted too */
    for (int l = 0; l < NL; l++) {
        CHECK_EQ_INT(len_of(&h, l, 0), 22);
        const int32_t *p = pos_of(&h, l, 0);
        float sc[100];
        for (int j = 0; j < 100; j++) sc[j] = j >= 4 && j < 92 ? snap_oracle(77, l, j, 100, 8) : -INFINITY;
        int32_t keep[100];
        int32_t n = lethe_keep_sink_recent_topk(sc, NULL, 100, 4, 8, 10, keep);
        CHECK_EQ_INT(n, 22);
        for (int e = 0; e < 22; e++) CHECK_EQ_INT(p[e], keep[e]); /* window (recent) + top scores */
    }
    h_close(&h);
    /* short prompt: nothing evicted */
    h_open(&h, "snapkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=10");
    h_add(&h, 0, 1, 20, 25);
    while (h.r[0].n_done < 25) h_step(&h);
    CHECK_EQ_INT(len_of(&h, 2, 0), 25);
    h_close(&h);
}

static void test_pyramidkv(void) {
    harness h;
    h_open(&h, "pyramidkv", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=60,"
                            "decode_eviction_interval=5");
    h_add(&h, 0, 9, 120, 140);
    while (h.r[0].n_done < 120) h_step(&h);
    int32_t b[NL];
    lethe_pyramid_budgets(NL, 2, 60, 6, 0.6f, 0.01f, b);
    for (int l = 0; l < NL; l++) CHECK_EQ_INT(len_of(&h, l, 0), b[l]);
    CHECK(b[0] > b[NL - 1]);
    /* decode eviction (on by default): each layer returns to its budget at budget + interval */
    for (int t = 0; t < 20; t++) {
        h_step(&h);
        for (int l = 0; l < NL; l++) CHECK(len_of(&h, l, 0) >= b[l] && len_of(&h, l, 0) < b[l] + 5);
    }
    h_close(&h);
}

static void test_h2o(void) {
    harness h;
    h_open(&h, "h2o_prefill", "h2o_prefill_budget=30,h2o_decode_budget=20,h2o_recent_ratio=0.25");
    h.chunk = 24;
    h_add(&h, 0, 4, 90, 95);
    h_step(&h); /* 24 <= 30 */
    CHECK_EQ_INT(len_of(&h, 0, 0), 24);
    h_step(&h); /* 48 -> 30 */
    for (int l = 0; l < NL; l++) CHECK_EQ_INT(len_of(&h, l, 0), 30);
    const int32_t *p = pos_of(&h, 1, 0);
    for (int e = 0; e < 7; e++) CHECK_EQ_INT(p[30 - 1 - e], 47 - e); /* recent = floor(30 * 0.25) */
    h_step(&h);
    h_step(&h); /* final chunk (90): -> 20, recent 5 */
    for (int l = 0; l < NL; l++) {
        CHECK_EQ_INT(len_of(&h, l, 0), 20);
        for (int e = 0; e < 5; e++) CHECK_EQ_INT(pos_of(&h, l, 0)[19 - e], 89 - e);
    }
    while (h.r[0].n_done < 95) h_step(&h); /* decode: score-free, rows grow */
    CHECK_EQ_INT(len_of(&h, 0, 0), 25);
    /* scores follow compaction: the snapshot holds one value per resident entry */
    size_t n = h.m->ops->snapshot(h.m, h.r[0].state, NULL, 0);
    CHECK_EQ_INT(n, NL * (4 + 25 * 4));
    h_close(&h);
}

/* R-KV with one-hot keys (every key its own direction, cosine 0) except one
 * planted pair of copies: the older copy is the more redundant one and is
 * evicted, the newer survives (without the newest-copy rule both would be
 * equally redundant and both evicted); ties among the rest keep the earliest.
 * Then the interval cycle: the row grows to B + interval and is cut to B. */
static void test_rkv_duplicates(void) {
    harness h;
    g_onehot_keys = 1, g_dup_src = 5, g_dup_dst = 8;
    /* B = 0 + 8 + 4 = 12, w = 4: compaction at L >= 16 */
    h_open(&h, "rkv", "sink_keep_tokens=0,recent_keep_tokens=4,decode_keep_tokens=8,rkv_observation_tokens=4,"
                      "rkv_compression_interval=4,rkv_alpha=0");
    h.chunk = 16;
    h_add(&h, 0, 9, 24, 30);
    h_step(&h);
    h_step(&h); /* the prompt: never compacted at prefill */
    CHECK_EQ_INT(len_of(&h, 0, 0), 24);
    h_step(&h); /* first decode token: L = 25 >= 16 -> 12 */
    static const int32_t want[12] = {0, 1, 2, 3, 4, 6, 7, 8, 21, 22, 23, 24};
    for (int l = 0; l < NL; l++) {
        CHECK_EQ_INT(len_of(&h, l, 0), 12);
        for (int e = 0; e < 12; e++) CHECK_EQ_INT(pos_of(&h, l, 0)[e], want[e]);
    }
    for (int s = 13; s <= 15; s++) { /* grows below B + interval */
        h_step(&h);
        CHECK_EQ_INT(len_of(&h, 0, 0), s);
    }
    h_step(&h); /* L = 16 -> 12 */
    for (int l = 0; l < NL; l++) CHECK_EQ_INT(len_of(&h, l, 0), 12);
    h_close(&h);
    g_onehot_keys = 0, g_dup_src = g_dup_dst = -1;
}

/* R-KV importance alone (alpha 1): the kept set is the top of a float64 oracle:
 * per layer the mean over the ring's 4 queries (the last 4 tokens' own) and all
 * heads of the softmax over the prefix keys, max-pooled (k = 7), summed over
 * layers. */
static void test_rkv_importance(void) {
    harness h;
    h_open(&h, "rkv", "sink_keep_tokens=0,recent_keep_tokens=4,decode_keep_tokens=8,rkv_observation_tokens=4,"
                      "rkv_compression_interval=4,rkv_alpha=1");
    h.chunk = 16;
    h_add(&h, 0, 13, 40, 42);
    while (h.r[0].n_done < 41) h_step(&h); /* L = 41 at the first decode step -> 12 */
    const int L = 41, w = 4, nc = L - w;
    double F[64] = {0};
    for (int l = 0; l < NL; l++) {
        double imp[64] = {0};
        for (int r = 0; r < w; r++) {
            const int qp = L - w + r;
            for (int hh = 0; hh < H; hh++) {
                double s[64], mx = -INFINITY, sum = 0;
                for (int j = 0; j < nc; j++) {
                    double d = 0;
                    for (int i = 0; i < D; i++)
                        d += (double)gen(13, l, qp, 0, hh * D + i) * gen(13, l, j, 1, (hh / (H / HK)) * D + i);
                    s[j] = d * 0.25;
                    mx = fmax(mx, s[j]);
                }
                for (int j = 0; j < nc; j++) sum += exp(s[j] - mx);
                for (int j = 0; j < nc; j++) imp[j] += exp(s[j] - mx) / sum / (w * H);
            }
        }
        for (int j = 0; j < nc; j++) {
            double m = -INFINITY;
            for (int k = j - 3; k <= j + 3; k++)
                if (k >= 0 && k < nc) m = fmax(m, imp[k]);
            F[j] += m;
        }
    }
    int32_t top[8];
    float Ff[64];
    for (int j = 0; j < nc; j++) Ff[j] = (float)F[j];
    CHECK_EQ_INT(lethe_topk_indices(Ff, nc, 8, top), 8);
    for (int l = 0; l < NL; l++) {
        CHECK_EQ_INT(len_of(&h, l, 0), 12);
        for (int e = 0; e < 8; e++) CHECK_EQ_INT(pos_of(&h, l, 0)[e], top[e]);
        for (int e = 0; e < 4; e++) CHECK_EQ_INT(pos_of(&h, l, 0)[8 + e], L - w + e);
    }
    h_close(&h);
}

/* SkipKV without a tokenizer: spans of skipkv_segment (4) tokens. A span whose
 * last-layer V rows copy a later span's is the earlier near-duplicate and goes
 * whole, nothing else (the row then fits the budget). */
static void test_skipkv_duplicates(void) {
    harness h;
    g_vdup_src = 8, g_vdup_dst = 24, g_vdup_len = 4; /* V of [24, 28) = V of [8, 12) */
    /* B = 0 + 33 + 4 = 37: compaction at L >= 41, middle [0, 37) */
    h_open(&h, "skipkv", "sink_keep_tokens=0,recent_keep_tokens=4,decode_keep_tokens=33,"
                         "skipkv_compression_interval=4,skipkv_segment=4");
    h.chunk = 16;
    h_add(&h, 0, 21, 40, 43);
    for (int i = 0; i < 3; i++) h_step(&h);
    CHECK_EQ_INT(len_of(&h, 0, 0), 40); /* the prompt: never compacted at prefill */
    h_step(&h);                          /* L = 41 -> 37 */
    for (int l = 0; l < NL; l++) {
        CHECK_EQ_INT(len_of(&h, l, 0), 37);
        for (int e = 0, p = 0; e < 37; e++, p++) {
            if (p == 8) p = 12; /* the earlier copy [8, 12) is gone */
            CHECK_EQ_INT(pos_of(&h, l, 0)[e], p);
        }
    }
    h_close(&h);
    g_vdup_src = g_vdup_dst = -1;
}

/* SkipKV under pressure: whole spans go (least attended first) until the row
 * fits B; what stays is the sink, whole spans and the recent tokens. */
static void test_skipkv_sentences(void) {
    harness h;
    /* B = 2 + 11 + 4 = 17: compaction at L >= 21; the prompt of 40 -> <= 17 */
    h_open(&h, "skipkv", "sink_keep_tokens=2,recent_keep_tokens=4,decode_keep_tokens=11,"
                         "skipkv_compression_interval=4,skipkv_segment=4");
    h.chunk = 16;
    h_add(&h, 0, 5, 40, 42);
    for (int i = 0; i < 4; i++) h_step(&h);
    for (int l = 0; l < NL; l++) {
        const int32_t n = len_of(&h, l, 0), *p = pos_of(&h, l, 0);
        CHECK(n <= 17 && n > 17 - 4); /* whole 4-token spans */
        CHECK(p[0] == 0 && p[1] == 1);  /* sink */
        for (int e = 0; e < 4; e++) CHECK_EQ_INT(p[n - 4 + e], 37 + e); /* recent */
        /* the middle [2, 37) in spans [2, 6), [6, 10), ..., [34, 37): each whole or gone */
        uint8_t kept[41] = {0};
        for (int e = 0; e < n; e++) kept[p[e]] = 1;
        for (int s0 = 2; s0 < 37; s0 += 4)
            for (int q = s0; q < LETHE_MIN(37, s0 + 4); q++) CHECK_EQ_INT(kept[q], kept[s0]);
        for (int e = 0; e < n; e++) CHECK_EQ_INT(p[e], pos_of(&h, 0, 0)[e]); /* one token set */
    }
    h_close(&h);
}

/* steering needs a per-model asset: a clear error, not a silent no-op */
static void test_skipkv_steering(void) {
    lethe_sparse_env env = {.n_layers = NL, .n_heads = H, .n_kv_heads = HK, .head_dim = D};
    lethe_sparse_method *m = NULL;
    CHECK(lethe_sparse_create("skipkv", "skipkv_steering=true", &env, &m) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "skipkv_steering_asset");
    CHECK(lethe_sparse_create("skipkv", "skipkv_steering=true,skipkv_steering_asset=/nonexistent.bin", &env, &m) ==
          LETHE_ERR_UNSUPPORTED);
    CHECK(lethe_sparse_create("skipkv", "skipkv_steering=false", &env, &m) == LETHE_OK);
    lethe_sparse_destroy(m);
}

static void test_quest(void) {
    harness h;
    /* budget 4 + 24 + 4 = 32 tokens -> K = max(3, 32/16) = 3 pages */
    h_open(&h, "quest", "sink_keep_tokens=4,recent_keep_tokens=4,decode_keep_tokens=24,quest_skip_layers=1");
    h_add(&h, 0, 3, 100, 103);
    while (h.r[0].n_done < 101) h_step(&h);
    /* L = 101: pages 0..6, the current page 6 holds positions 96..100 */
    CHECK_EQ_INT(h.n_sel[0], 101); /* skipped layer: dense */
    for (int l = 1; l < NL; l++) {
        CHECK_EQ_INT(h.n_sel[l], 2 * 16 + 5);
        for (int e = 0; e < 32; e++) CHECK_EQ_INT(h.sel_pos[l][e] % 16, e % 16); /* whole pages */
        CHECK_EQ_INT(h.sel_pos[l][32], 96);
        CHECK_EQ_INT(len_of(&h, l, 0), 101); /* logical: nothing freed */
    }
    /* the sparse layers' selections were built by the backend ops (select_layer) */
    CHECK(h.n_select_layer[LETHE_SEL_BUILT] > 0 && h.n_select_layer[LETHE_SEL_PER_SEQ] == 0);
    h_close(&h);
}

/* Request 0's Quest selection in layer l at its last decode step, recomputed
 * from scratch from the row's current entries: bounds of the completed pages
 * over the keys in entry order (lethe_page_minmax_build), the decode query,
 * lethe_quest_page_scores, top-(K - current pages), then the current page(s). */
static void check_quest_oracle(harness *h, int l, int32_t budget) {
    enum { P = 16 };
    const int32_t L = len_of(h, l, 0), *pos = pos_of(h, l, 0);
    const uint64_t id = h->r[0].id;
    const int32_t nd = (L - 1) / P, n_cur = LETHE_CEIL_DIV(L, P) - nd, K = LETHE_MAX(3, budget / P);
    static float keys[NSLOTS * KVD], mn[NSLOTS * KVD], mx[NSLOTS * KVD], q[H * D], u[NSLOTS];
    for (int32_t e = 0; e < nd * P; e++)
        for (int i = 0; i < KVD; i++) keys[e * KVD + i] = gen(id, l, pos[e], 1, i);
    lethe_page_minmax_build(keys, nd * P, KVD, P, mn, mx);
    for (int i = 0; i < H * D; i++) q[i] = gen(id, l, pos[L - 1], 0, i);
    lethe_quest_page_scores(q, H, HK, D, mn, mx, nd, u);
    int32_t top[NSLOTS];
    int32_t np = lethe_topk_indices(u, nd, K - n_cur, top);
    CHECK_EQ_INT(h->n_sel[l], np * P + (L - nd * P));
    int32_t e = 0;
    for (int32_t i = 0; i < np; i++)
        for (int32_t t = 0; t < P; t++) CHECK_EQ_INT(h->sel_pos[l][e++], pos[top[i] * P + t]);
    for (int32_t t = nd * P; t < L; t++) CHECK_EQ_INT(h->sel_pos[l][e++], pos[t]);
}

/* Quest through the page ops == the scratch oracle at every decode step:
 * two requests decoding in one batch (one op call each for both), across a
 * page boundary (incremental refresh == scratch), then after a compaction of
 * the shared row (lethe_kv_keep drops entries mid-row: the pool's page
 * watermark must make the stale pages recompute). */
static void test_quest_oracle(void) {
    harness h;
    h_open(&h, "quest", "sink_keep_tokens=4,recent_keep_tokens=4,decode_keep_tokens=56,quest_skip_layers=1");
    h_add(&h, 0, 31, 150, 175);
    h_add(&h, 1, 32, 120, 175);
    while (h.r[0].n_done < 151) h_step(&h);
    for (int step = 0; step < 12; step++) {
        for (int l = 1; l < NL; l++) check_quest_oracle(&h, l, 64);
        CHECK_EQ_INT(h.n_sel[0], len_of(&h, 0, 0)); /* skipped layer: dense */
        h_step(&h);
    }
    int32_t keep[NSLOTS], n = 0, L = len_of(&h, 0, 0);
    for (int32_t e = 0; e < L; e++)
        if (e < 21 || e >= 45) keep[n++] = e;
    lethe_kv_keep(h.pool, 0, h.r[0].row, keep, n);
    check_invariants(&h);
    for (int step = 0; step < 5; step++) {
        h_step(&h);
        for (int l = 1; l < NL; l++) check_quest_oracle(&h, l, 64);
    }
    h_close(&h);
}

/* Request 0's per-KV-head Quest lists (quest_granularity=head) in layer l,
 * from scratch as check_quest_oracle, but scored per group
 * (lethe_quest_page_scores_grouped, HK groups): KV head g reads its own
 * top-(K - current pages), then the current page(s). Returns whether the two
 * KV heads read different pages. */
static bool check_quest_head_oracle(harness *h, int l, int32_t budget) {
    enum { P = 16 };
    const int32_t L = len_of(h, l, 0), *pos = pos_of(h, l, 0);
    const uint64_t id = h->r[0].id;
    const int32_t nd = (L - 1) / P, n_cur = LETHE_CEIL_DIV(L, P) - nd, K = LETHE_MAX(3, budget / P);
    static float keys[NSLOTS * KVD], mn[NSLOTS * KVD], mx[NSLOTS * KVD], q[H * D], u[HK * NSLOTS];
    for (int32_t e = 0; e < nd * P; e++)
        for (int i = 0; i < KVD; i++) keys[e * KVD + i] = gen(id, l, pos[e], 1, i);
    lethe_page_minmax_build(keys, nd * P, KVD, P, mn, mx);
    for (int i = 0; i < H * D; i++) q[i] = gen(id, l, pos[L - 1], 0, i);
    lethe_quest_page_scores_grouped(q, H, HK, D, mn, mx, nd, HK, u);
    int32_t top[HK][NSLOTS], np[HK];
    for (int g = 0; g < HK; g++) {
        np[g] = lethe_topk_indices(u + (size_t)g * nd, nd, K - n_cur, top[g]);
        CHECK_EQ_INT(h->n_hsel[l][g], np[g] * P + (L - nd * P));
        int32_t e = 0;
        for (int32_t i = 0; i < np[g]; i++)
            for (int32_t t = 0; t < P; t++) CHECK_EQ_INT(h->hsel_pos[l][g][e++], pos[top[g][i] * P + t]);
        for (int32_t t = nd * P; t < L; t++) CHECK_EQ_INT(h->hsel_pos[l][g][e++], pos[t]);
    }
    CHECK_EQ_INT(h->n_sel[l], L); /* the sequence's selection: its row */
    return np[0] != np[1] || memcmp(top[0], top[1], sizeof(int32_t) * (size_t)np[0]) != 0;
}

/* Quest per KV head: every decode step's lists == the per-head oracle (the
 * scenario of test_quest_oracle: two requests batched, page boundaries, a
 * compaction), the heads really choose different pages, the lists come from
 * select_layer (LETHE_SEL_BUILT_HEADS) and attention read them; with budgets
 * >= the context (every page selected through the page ops) the outputs are
 * bit-identical to dense. */
static void test_quest_heads(void) {
    harness h;
    h_open(&h, "quest", "sink_keep_tokens=4,recent_keep_tokens=4,decode_keep_tokens=56,quest_skip_layers=1,"
                        "quest_granularity=head");
    h_add(&h, 0, 31, 150, 175);
    h_add(&h, 1, 32, 120, 175);
    while (h.r[0].n_done < 151) h_step(&h);
    int n_differ = 0;
    for (int step = 0; step < 12; step++) {
        for (int l = 1; l < NL; l++) n_differ += check_quest_head_oracle(&h, l, 64);
        CHECK_EQ_INT(h.n_hsel[0][0], 0); /* skipped layer: dense, no head lists */
        h_step(&h);
    }
    int32_t keep[NSLOTS], n = 0, L = len_of(&h, 0, 0);
    for (int32_t e = 0; e < L; e++)
        if (e < 21 || e >= 45) keep[n++] = e;
    lethe_kv_keep(h.pool, 0, h.r[0].row, keep, n);
    check_invariants(&h);
    for (int step = 0; step < 5; step++) {
        h_step(&h);
        for (int l = 1; l < NL; l++) n_differ += check_quest_head_oracle(&h, l, 64);
    }
    fprintf(stderr, "    per-KV-head page sets differ in %d of %d (step, layer) checks\n", n_differ, 17 * (NL - 1));
    CHECK(n_differ > 0);
    CHECK(h.n_select_layer[LETHE_SEL_BUILT_HEADS] > 0 && h.n_select_layer[LETHE_SEL_BUILT] == 0);
    h_close(&h);

    static trace dense, tr;
    run_script("dense", NULL, &dense);
    run_script("quest", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=4096,quest_skip_layers=0,"
                        "quest_always_score=true,quest_granularity=head", &tr);
    CHECK(g_heads_built > 0);
    CHECK_MSG(memcmp(tr.out, dense.out, sizeof(tr.out[0]) * (size_t)tr.n) == 0,
              "quest head mode with budgets >= context differs from dense");
    /* a bad value is a clear error */
    lethe_sparse_env env = {.n_layers = NL, .n_heads = H, .n_kv_heads = HK, .head_dim = D, .max_model_len = 4096};
    lethe_sparse_method *m = NULL;
    CHECK(lethe_sparse_create("quest", "quest_granularity=kv", &env, &m) == LETHE_ERR_INVALID);
    CHECK(strstr(lethe_last_error(), "quest_granularity=kv") != NULL);
}

/* A layer whose selection scratch cannot be allocated reads densely and
 * leaves its stale page bounds stale: the next step (memory back) computes
 * them and selects exactly what the oracle selects. The backend's alloc
 * refuses while g_refuse_alloc is set (a wrapped CPU backend table). */
static bool g_refuse_alloc;
static lethe_status (*g_cpu_alloc)(lethe_backend *, size_t, void **);
static lethe_status refusing_alloc(lethe_backend *be, size_t n, void **out) {
    if (g_refuse_alloc) return lethe_errorf(LETHE_ERR_NOMEM, "test: backend allocation refused");
    return g_cpu_alloc(be, n, out);
}

static void test_quest_scratch_refused(void) {
    for (int heads = 0; heads < 2; heads++) {
        harness h;
        h_open(&h, "quest", heads ? "sink_keep_tokens=4,recent_keep_tokens=4,decode_keep_tokens=56,"
                                    "quest_skip_layers=1,quest_granularity=head"
                                  : "sink_keep_tokens=4,recent_keep_tokens=4,decode_keep_tokens=56,"
                                    "quest_skip_layers=1");
        static lethe_backend_ops ops;
        ops = *h.be->ops;
        g_cpu_alloc = ops.alloc;
        ops.alloc = refusing_alloc;
        const lethe_backend_ops *real = h.be->ops;
        h.be->ops = &ops;
        h_add(&h, 0, 41, 150, 160); /* the page bounds are allocated here */
        while (h.r[0].n_done < 150) h_step(&h);
        g_refuse_alloc = true; /* the first decode: no scratch, every stale bound stays stale */
        h_step(&h);
        g_refuse_alloc = false;
        for (int l = 0; l < NL; l++) CHECK_EQ_INT(h.n_sel[l], len_of(&h, l, 0)); /* read densely */
        for (int step = 0; step < 3; step++) {
            h_step(&h);
            for (int l = 1; l < NL; l++) heads ? (void)check_quest_head_oracle(&h, l, 64) : check_quest_oracle(&h, l, 64);
        }
        h.be->ops = real;
        h_close(&h);
    }
}

/* omnikv_prefill: in a prefill chunk with a long enough history, the
 * sparse layers read sink + the oracle top-K of the filter layer's
 * chunk-mean logits (max over heads) + recent history + the chunk; full
 * layers and decode read everything */
static void test_omnikv_prefill(void) {
    harness h;
    h_open(&h, "omnikv_prefill", "omnikv_prefill_keep_tokens=10,omnikv_prefill_sink_tokens=3,"
                                 "omnikv_prefill_recent_tokens=5,omnikv_full_layers=0:2");
    h_add(&h, 0, 8, 72, 74);
    while (h.r[0].n_done < 72) h_step(&h); /* the last step: chunk [48, 72), history 48 */
    CHECK_EQ_INT(h.n_sel[0], 72);
    CHECK_EQ_INT(h.n_sel[2], 72);
    for (int l = 1; l < NL; l += 2) {
        const int f = l - 1, hist = 48, c0 = 3, c1 = hist - 5;
        float sc[48];
        for (int j = c0; j < c1; j++) {
            double best = -INFINITY;
            for (int hh = 0; hh < H; hh++) { /* mean over the chunk's queries of q . k_j */
                double d = 0;
                for (int i = hist; i < 72; i++)
                    for (int c = 0; c < D; c++) d += gen(8, f, i, 0, hh * D + c) * gen(8, f, j, 1, (hh / 2) * D + c);
                best = fmax(best, d / 24.0);
            }
            sc[j - c0] = (float)best;
        }
        int32_t top[10];
        CHECK_EQ_INT(lethe_topk_indices(sc, c1 - c0, 10, top), 10);
        CHECK_EQ_INT(h.n_sel[l], 3 + 10 + 5 + 24);
        for (int e = 0; e < 3; e++) CHECK_EQ_INT(h.sel_pos[l][e], e);
        for (int e = 0; e < 10; e++) CHECK_EQ_INT(h.sel_pos[l][3 + e], top[e] + c0);
        for (int e = 0; e < 5 + 24; e++) CHECK_EQ_INT(h.sel_pos[l][13 + e], c1 + e);
    }
    CHECK(h.n_select_layer[LETHE_SEL_BUILT] > 0);
    h_step(&h); /* decode: dense */
    for (int l = 0; l < NL; l++) CHECK_EQ_INT(h.n_sel[l], 73);
    h_close(&h);
}

static void test_omnikv(void) {
    harness h;
    h_open(&h, "omnikv", "sink_keep_tokens=3,recent_keep_tokens=5,decode_keep_tokens=10,omnikv_full_layers=0:2");
    h_add(&h, 0, 8, 60, 62);
    while (h.r[0].n_done < 61) h_step(&h);
    /* decode token at position 60; layers 0, 2 full; 1 and 3 read from filters 0 and 2 */
    CHECK_EQ_INT(h.n_sel[0], 61);
    CHECK_EQ_INT(h.n_sel[2], 61);
    for (int l = 1; l < NL; l += 2) {
        int f = l - 1, L = 61;
        float sc[61];
        for (int j = 3; j < L - 5; j++) {
            float best = 0;
            for (int hh = 0; hh < H; hh++) { /* softmax over candidates [3, 56), max over heads */
                double m = -INFINITY, z = 0, lg[61];
                for (int t = 3; t < L - 5; t++) {
                    double d = 0;
                    for (int c = 0; c < D; c++) d += gen(8, f, 60, 0, hh * D + c) * gen(8, f, t, 1, (hh / 2) * D + c);
                    lg[t] = 0.25 * d;
                    m = fmax(m, lg[t]);
                }
                for (int t = 3; t < L - 5; t++) z += exp(lg[t] - m);
                best = fmaxf(best, (float)(exp(lg[j] - m) / z));
            }
            sc[j - 3] = best;
        }
        int32_t top[10];
        CHECK_EQ_INT(lethe_topk_indices(sc, L - 8, 10, top), 10);
        CHECK_EQ_INT(h.n_sel[l], 3 + 10 + 5);
        for (int e = 0; e < 3; e++) CHECK_EQ_INT(h.sel_pos[l][e], e);
        for (int e = 0; e < 10; e++) CHECK_EQ_INT(h.sel_pos[l][3 + e], top[e] + 3);
        for (int e = 0; e < 5; e++) CHECK_EQ_INT(h.sel_pos[l][13 + e], 56 + e);
    }
    CHECK(h.n_select_layer[LETHE_SEL_BUILT] > 0 && h.n_select_layer[LETHE_SEL_PER_SEQ] == 0);
    h_close(&h);
    /* the layer picker: a chain 0 -> 1 -> 2 -> 3 of strong overlaps prefers all */
    float ov[5 * 5] = {0};
    ov[0 * 5 + 1] = 0.9f, ov[0 * 5 + 2] = 0.1f, ov[0 * 5 + 3] = 0.1f, ov[0 * 5 + 4] = 0.1f;
    ov[2 * 5 + 3] = 0.9f, ov[2 * 5 + 4] = 0.9f, ov[1 * 5 + 3] = 0.2f, ov[1 * 5 + 4] = 0.2f;
    bool full[5];
    extern void lethe_omnikv_pick_layers(const float *overlap, int32_t N, int32_t n_full, bool *full);
    lethe_omnikv_pick_layers(ov, 5, 2, full);
    CHECK(full[0] && full[2] && !full[1] && !full[3] && !full[4]);
}

static void test_quantizers(void) {
    harness h;
    h_open(&h, "kivi", "kivi_bits=4,kv_quant_page_size=16");
    h_add(&h, 0, 6, 40, 41);
    while (h.r[0].n_done < 41) h_step(&h);
    /* the pool holds 4-bit codes: groups [0,16) and [16,32) quantized per
     * channel (error <= s / 2), the tail 32..40 bit-exact in the f32 residual */
    CHECK(lethe_kv_format_kind(lethe_kv_format_of(h.pool)) == LETHE_KV_KIVI);
    const lethe_kv_quant *kq = lethe_kv_quant_of(h.pool, 1);
    const uint8_t *Kc = lethe_kv_k(h.pool, 1);
    const int32_t *slots = lethe_kv_row_slots(h.pool, 0, h.r[0].row);
    const size_t cb = lethe_kivi_code_bytes(KVD, 4);
    for (int pg = 0; pg < 2; pg++) {
        const int32_t e = kq->kivi->slot_aux[slots[pg * 16]];
        CHECK(e >= 0);
        const float *ks = (const float *)kq->k_group + (size_t)e * 2 * KVD;
        for (int c = 0; c < KVD; c++) {
            float mn = INFINITY, mx = -INFINITY;
            for (int t = pg * 16; t < pg * 16 + 16; t++) mn = fminf(mn, gen(6, 1, t, 1, c)), mx = fmaxf(mx, gen(6, 1, t, 1, c));
            float s = (mx - mn) / 15.0f;
            CHECK(ks[c] == s && ks[KVD + c] == mn);
            for (int t = pg * 16; t < pg * 16 + 16; t++) {
                CHECK(kq->kivi->slot_aux[slots[t]] == e);
                float x = (float)lethe_code_get(Kc + (size_t)slots[t] * cb, c, 4) * ks[c] + ks[KVD + c];
                CHECK(fabsf(x - gen(6, 1, t, 1, c)) <= s * 0.5f * 1.0001f + 1e-6f);
            }
        }
    }
    for (int t = 32; t < 41; t++) {
        const int32_t aux = kq->kivi->slot_aux[slots[t]];
        CHECK(aux < 0);
        for (int c = 0; c < KVD; c++)
            CHECK(((const float *)kq->k_res)[(size_t)(-1 - aux) * KVD + c] == gen(6, 1, t, 1, c));
    }
    h_close(&h);
    h_open(&h, "fp8", NULL);
    h_add(&h, 0, 6, 30, 31);
    while (h.r[0].n_done < 31) h_step(&h);
    /* the pool really holds E4M3 codes + one scale per (slot, KV head) */
    CHECK(lethe_kv_format_of(h.pool) == LETHE_KV_FP8_E4M3);
    const uint8_t *Vc = lethe_kv_v(h.pool, 2);
    const float *Vs = lethe_kv_quant_of(h.pool, 2)->v_scale;
    slots = lethe_kv_row_slots(h.pool, 0, h.r[0].row);
    for (int t = 0; t < 31; t++)
        for (int hh = 0; hh < HK; hh++) {
            float amax = 0;
            for (int c = 0; c < D; c++) amax = fmaxf(amax, fabsf(gen(6, 2, t, 2, hh * D + c)));
            CHECK(Vs[slots[t] * HK + hh] == amax / 448.0f);
            for (int c = 0; c < D; c++) {
                float x = gen(6, 2, t, 2, hh * D + c);
                float y = lethe_fp8_e4m3_to_float(Vc[(size_t)slots[t] * KVD + hh * D + c]) * Vs[slots[t] * HK + hh];
                CHECK(fabsf(x - y) <= fmaxf(0x1p-4f * fabsf(x), 0x1p-10f * amax / 448.0f) * 1.0001f);
            }
        }
    h_close(&h);
}

static void test_registry_knobs(void) {
    CHECK(lethe_sparse_find("attention_sink") == lethe_sparse_find("streamingllm"));
    CHECK(lethe_sparse_find("H2O-PREFILL") == lethe_sparse_find("h2o"));
    CHECK(lethe_sparse_find("nope") == NULL);
    lethe_sparse_env env = {.n_layers = NL, .n_heads = H, .n_kv_heads = HK, .head_dim = D};
    lethe_sparse_method *m;
    CHECK(lethe_sparse_create("snapkv", "pool_kernel_size=0", &env, &m) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "pool_kernel_size");
    CHECK(lethe_sparse_create("snapkv", "snapkv_window=3", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("snapkv", "sparse_prefill_score_mode=softmax", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("pyramidkv", "pyramidkv_least_ratio=0.9,pyramidkv_start_ratio=0.5", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("omnikv", "omnikv_full_layers=0:9", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("kivi", "kivi_bits=3", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("h2o", "h2o_prefill=maybe", &env, &m) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_create("h2o", "h2o_recent_ratio=0.3,h2o_prefill=false", &env, &m) == LETHE_OK);
    lethe_sparse_destroy(m);
    /* every method: the contract's rules hold, defaults and test configs parse */
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *o = lethe_sparse_method_at(i);
        CHECK_MSG(lethe_sparse_validate(o) == LETHE_OK, "%s", lethe_last_error());
        const char *cfgs[3] = {NULL, o->test_configs.identity, o->test_configs.small};
        for (int c = 0; c < 3; c++) {
            if (c > 0 && !cfgs[c]) continue; /* that config is the defaults */
            const lethe_status st = lethe_sparse_create(o->name, cfgs[c], &env, &m);
            if (c == 0 && st != LETHE_OK && o->test_configs.identity && o->n_knob_table > 0) {
                /* a method that needs an artifact (palu's factors) refuses its
                 * defaults with a message naming the knob to set */
                CHECK_EQ_INT(st, LETHE_ERR_INVALID);
                CHECK_STR_CONTAINS(lethe_last_error(), o->knob_table[0].name);
                continue;
            }
            CHECK_MSG(st == LETHE_OK, "%s %s: %s", o->name, cfgs[c] ? cfgs[c] : "", lethe_last_error());
            lethe_sparse_destroy(m);
        }
    }
}

/* ---- the registry's rules: broken tables fail naming the method and the rule ---- */

static lethe_sel_result stub_select_layer(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                          const void *q, const lethe_step_rows *rows,
                                          const int32_t **sel_begin, const int32_t **sel_slots) {
    return LETHE_SEL_PER_SEQ;
}
static bool stub_needs_scores(lethe_sparse_method *m, int32_t layer) { return false; }
static void stub_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            const lethe_attn_args *attn) {}
static lethe_kv_format stub_kv_format(const lethe_sparse_method *m) { return LETHE_KV_NATIVE; }
static lethe_status stub_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return LETHE_OK;
}

static void expect_broken(const lethe_sparse_ops *o, const char *rule) {
    CHECK_MSG(lethe_sparse_validate(o) == LETHE_ERR_INVALID, "%s: accepted, expected '%s'",
              o->name ? o->name : "(unnamed)", rule);
    char head[96];
    snprintf(head, sizeof(head), "sparse method %s: ", o->name ? o->name : "(unnamed)");
    CHECK_STR_CONTAINS(lethe_last_error(), head);
    CHECK_STR_CONTAINS(lethe_last_error(), rule);
    /* nor can it be registered */
    CHECK(lethe_sparse_register_extra(o) == LETHE_ERR_INVALID);
}

static void test_registry_rules(void) {
    const int32_t n0 = lethe_sparse_n_methods();
    lethe_sparse_ops o;
    /* a minimal table (name + summary, every hook defaulted) is valid */
    o = (lethe_sparse_ops){.name = "minimal", .summary = "defaults only"};
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.name = NULL;
    expect_broken(&o, "name must be a non-empty [a-z0-9_] word");
    o = (lethe_sparse_ops){.name = "Bad-Name", .summary = "x"};
    expect_broken(&o, "name must be a non-empty [a-z0-9_] word");
    o = (lethe_sparse_ops){.name = "nosummary"};
    expect_broken(&o, "summary");

    o = (lethe_sparse_ops){.name = "sel", .summary = "x", .kind = LETHE_SPARSE_KIND_SELECTION,
                           .test_configs = {.small = "decode_keep_tokens=8"}};
    expect_broken(&o, "a SELECTION method must provide select_layer, build_decode_selection or block_sparse");
    o.select_layer = stub_select_layer;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    /* a prefill-axis method narrows prompt chunks only: no state, no decode selection */
    o.flags = LETHE_SPARSE_PREFILL_AXIS;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.request_init = lethe_sparse_find("h2o")->request_init;
    o.request_finished = lethe_sparse_find("h2o")->request_finished;
    expect_broken(&o, "a LETHE_SPARSE_PREFILL_AXIS method narrows prompt chunks only");
    o.request_init = NULL;
    o.request_finished = NULL;
    o.flags = LETHE_SPARSE_UNIFORM;
    expect_broken(&o, "select_layer needs shared rows");

    /* graph_step plans what select_layer issues, or decode over per-layer resident rows */
    o = lethe_sparse_dense;
    o.name = "gs";
    o.flags = 0;
    o.graph_step = lethe_sparse_find("quest")->graph_step;
    expect_broken(&o, "graph_step needs select_layer");
    o.select_layer = stub_select_layer;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());

    o = lethe_sparse_dense; /* UNIFORM */
    o.name = "uni";
    o.needs_scores = stub_needs_scores;
    o.after_attn = stub_after_attn;
    expect_broken(&o, "a LETHE_SPARSE_UNIFORM method must not have needs_scores, after_attn or layer_end");
    o.flags &= ~(unsigned)LETHE_SPARSE_UNIFORM;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.after_attn = NULL;
    expect_broken(&o, "needs_scores without after_attn");

    o = *lethe_sparse_find("streamingllm");
    o.name = "evict";
    o.aliases[0] = NULL;
    o.select_layer = stub_select_layer;
    expect_broken(&o, "select_layer needs shared rows");
    o.select_layer = NULL;
    o.finish_step = NULL;
    expect_broken(&o, "an EVICTION method must provide finish_step");
    o = *lethe_sparse_find("streamingllm");
    o.name = "evict";
    o.aliases[0] = NULL;
    o.flags = 0;
    expect_broken(&o, "an EVICTION method must set LETHE_SPARSE_PER_LAYER_ROWS");
    o.flags = LETHE_SPARSE_PER_LAYER_ROWS | LETHE_SPARSE_PREFIX_CACHE;
    expect_broken(&o, "must not set LETHE_SPARSE_PREFIX_CACHE");
    o.flags = LETHE_SPARSE_PER_LAYER_ROWS;
    o.test_configs.small = NULL;
    expect_broken(&o, "must give test_configs.small");
    o = (lethe_sparse_ops){.name = "rows", .summary = "x", .flags = LETHE_SPARSE_PER_LAYER_ROWS};
    expect_broken(&o, "LETHE_SPARSE_PER_LAYER_ROWS is for EVICTION methods only");

    o = (lethe_sparse_ops){.name = "quant", .summary = "x", .kind = LETHE_SPARSE_KIND_QUANTIZATION};
    expect_broken(&o, "a QUANTIZATION method must provide kv_format");
    o.kv_format = stub_kv_format;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.kind = LETHE_SPARSE_KIND_DENSE;
    expect_broken(&o, "only a QUANTIZATION method may");

    /* payload layouts: kind, the three hooks together, no uniform plan */
    o = (lethe_sparse_ops){.name = "latent", .summary = "x", .kind = LETHE_SPARSE_KIND_COMPRESSION};
    expect_broken(&o, "a COMPRESSION method must provide kv_layout");
    o.kv_layout = throwaway_plane_copy.kv_layout;
    expect_broken(&o, "kv_layout, kv_store and kv_attend come together");
    o.kv_store = throwaway_plane_copy.kv_store;
    o.kv_attend = throwaway_plane_copy.kv_attend;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.flags = LETHE_SPARSE_UNIFORM;
    expect_broken(&o, "a method with kv_layout must not be LETHE_SPARSE_UNIFORM");
    o.flags = LETHE_SPARSE_KV_PRE_ROPE;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.kind = LETHE_SPARSE_KIND_DENSE;
    expect_broken(&o, "only a COMPRESSION or SELECTION method may");
    o.kind = LETHE_SPARSE_KIND_SELECTION; /* attends through its path (RetroInfer) */
    o.select_layer = stub_select_layer;
    o.test_configs.small = "x=1";
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o = (lethe_sparse_ops){.name = "latent", .summary = "x", .flags = LETHE_SPARSE_KV_PRE_ROPE};
    expect_broken(&o, "kv_out_proj and LETHE_SPARSE_KV_PRE_ROPE need kv_layout");

    o = (lethe_sparse_ops){.name = "meta", .summary = "x", .page_meta_floats = 4};
    expect_broken(&o, "page_meta_floats must be > 0 exactly when LETHE_SPARSE_PAGE_META is set");
    o.flags = LETHE_SPARSE_PAGE_META;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.page_meta_floats = 0;
    expect_broken(&o, "page_meta_floats must be > 0 exactly when LETHE_SPARSE_PAGE_META is set");

    o = (lethe_sparse_ops){.name = "hooks", .summary = "x", .snapshot = lethe_sparse_find("h2o")->snapshot};
    expect_broken(&o, "snapshot and restore come together");
    o = (lethe_sparse_ops){.name = "hooks", .summary = "x", .request_init = lethe_sparse_find("h2o")->request_init};
    expect_broken(&o, "request_init and request_finished come together");
    o = (lethe_sparse_ops){.name = "hooks", .summary = "x", .init = lethe_sparse_find("h2o")->init};
    expect_broken(&o, "init without destroy");

    /* knob tables */
    static const lethe_sparse_knob shadow[] = {{"sink_keep_tokens", LETHE_KNOB_INT, "4", 0, 10, "h"}};
    static const lethe_sparse_knob twice[] = {{"a_knob", LETHE_KNOB_INT, "4", 0, 10, "h"},
                                              {"a_knob", LETHE_KNOB_FLOAT, "0.5", 0, 1, "h"}};
    static const lethe_sparse_knob bad_def[] = {{"a_knob", LETHE_KNOB_INT, "40", 0, 10, "h"}};
    o = (lethe_sparse_ops){.name = "knobs", .summary = "x", .knob_table = shadow, .n_knob_table = 1,
                           .set_knob = stub_set_knob};
    expect_broken(&o, "knob sink_keep_tokens shadows the shared knob");
    o.knob_table = twice, o.n_knob_table = 2;
    expect_broken(&o, "knob a_knob is listed twice");
    o.knob_table = bad_def, o.n_knob_table = 1;
    expect_broken(&o, "knob a_knob: its default '40' is not a valid value");
    o.knob_table = twice + 1;
    CHECK_MSG(lethe_sparse_validate(&o) == LETHE_OK, "%s", lethe_last_error());
    o.set_knob = NULL;
    expect_broken(&o, "a method with a knob_table must provide set_knob");

    /* names: a registered spelling is refused, nothing was added */
    o = (lethe_sparse_ops){.name = "another_dense", .summary = "x", .aliases = {"Vanilla", NULL}};
    CHECK(lethe_sparse_register_extra(&o) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "sparse method another_dense: 'Vanilla' already names method dense");
    CHECK_EQ_INT(lethe_sparse_n_methods(), n0);
}

int main(void) {
    /* a method defined only in this test runs through every generic suite below */
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_recent_window) == LETHE_OK, "%s", lethe_last_error());
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_plane_copy) == LETHE_OK, "%s", lethe_last_error());
    CHECK(lethe_sparse_find("recent-window") == &throwaway_recent_window);
    TEST_RUN(test_registry_rules);
    TEST_RUN(test_registry_knobs);
    TEST_RUN(test_identity);
    TEST_RUN(test_streamingllm);
    TEST_RUN(test_snapkv);
    TEST_RUN(test_pyramidkv);
    TEST_RUN(test_h2o);
    TEST_RUN(test_quest);
    TEST_RUN(test_quest_oracle);
    TEST_RUN(test_quest_heads);
    TEST_RUN(test_quest_scratch_refused);
    TEST_RUN(test_omnikv);
    TEST_RUN(test_omnikv_prefill);
    TEST_RUN(test_rkv_duplicates);
    TEST_RUN(test_rkv_importance);
    TEST_RUN(test_skipkv_duplicates);
    TEST_RUN(test_skipkv_sentences);
    TEST_RUN(test_skipkv_steering);
    TEST_RUN(test_quantizers);
    TEST_RUN(test_lifecycle_all);
    return 0;
}

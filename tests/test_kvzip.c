/* test_kvzip.c - the auxiliary prefill facility and KVzip (methods.md §7)
 * through the engine on the CPU backend, tiny Llama shape (tests/data/
 * tiny-llama, seeded dummy weights: 2 layers, 4 query / 2 KV heads).
 *
 *  1. Auxiliary prefill (a probe method registered here): tokens appended to a
 *     request at its prompt end run through the model in forwards of at most
 *     max_num_batched_tokens, the method sees them as is_aux sequences whose
 *     queries it can score, and afterwards every row is exactly what it was:
 *     the request's tokens and logits are bit-identical to dense; asking for
 *     more slots than are free fails with LETHE_ERR_CAPACITY and changes nothing.
 *  2. kvzip shared level: after the prompt every layer keeps exactly the
 *     budget with the sink; the replay ran with the documented construction
 *     (its token count in prefill_tokens_computed); the replay's KV is gone.
 *  3. kvzip pair level: the global threshold keeps exactly ceil(ratio x
 *     entries) (layer, KV head, token) entries beside the sink; kept sets nest
 *     (ratio 0.3 within 0.6); ratio 1 is dense; the budget mode gives
 *     non-uniform per-head lengths; attention then reads per KV head.
 *  4. The Chain Cache with kvzip (both levels): three turns of a conversation,
 *     each compacted, positions ascending with the sink resident. */
#include <math.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "lethe.h"
#include "sparse/sparse.h"
#include "test.h"

#define TINY "tests/data/tiny-llama/config.json"
enum { NPROMPT = 48, NGEN = 4, AUXN = 30, CHUNK = 16 };

typedef struct out {
    int32_t tok[NGEN];
    int32_t n;
    float *logits; /* [NGEN][n_vocab] */
    int32_t n_vocab;
} out;

static void on_event(void *user, const lethe_event *ev) {
    out *o = user;
    if (ev->n_tokens != 1 || o->n >= NGEN) return;
    o->n_vocab = ev->n_vocab;
    if (!o->logits) o->logits = calloc((size_t)NGEN * ev->n_vocab, sizeof(float));
    memcpy(o->logits + (size_t)o->n * ev->n_vocab, ev->logits, sizeof(float) * (size_t)ev->n_vocab);
    o->tok[o->n++] = ev->token;
}

static lethe_engine *open_engine(const char *method, const char *cfg, bool chain) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY;
    p.load_format = "dummy";
    p.seed = 7;
    p.device = "cpu";
    p.n_threads = 1;
    p.max_model_len = 128;
    p.max_num_batched_tokens = CHUNK; /* chunked prompts, split auxiliary forwards */
    p.enable_prefix_caching = chain;
    p.kv_cache_bytes = (size_t)8 << 20;
    p.sparse_method = method;
    p.sparse_config = cfg;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s: %s", method, lethe_engine_last_error());
    return e;
}

static void prompt_ids(int32_t *ids, int32_t n, int salt) {
    for (int32_t i = 0; i < n; i++) ids[i] = 3 + (int32_t)((i * 37 + salt * 11) % 250);
}

static uint64_t add(lethe_engine *e, const int32_t *ids, int32_t n, out *o) {
    lethe_request_params rp = {
        .prompt = ids, .n_prompt = n, .cb = on_event, .user = o, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = NGEN;
    rp.sampling.ignore_eos = true;
    uint64_t id = 0;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    return id;
}

static void run_all(lethe_engine *e) {
    for (int guard = 0; lethe_engine_has_work(e); guard++) {
        CHECK(guard < 10000);
        CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
    }
}

/* one request to the end; `until_first` stops after its first token (running) */
static lethe_engine *run_one(const char *method, const char *cfg, out *o, bool until_first) {
    memset(o, 0, sizeof(*o));
    lethe_engine *e = open_engine(method, cfg, false);
    int32_t ids[NPROMPT];
    prompt_ids(ids, NPROMPT, 0);
    add(e, ids, NPROMPT, o);
    if (until_first) {
        while (o->n == 0) CHECK(lethe_engine_step(e) == 0);
        return e;
    }
    run_all(e);
    CHECK_EQ_INT(o->n, NGEN);
    return e;
}

static void same_as(const out *a, const out *b) {
    CHECK_EQ_INT(a->n, b->n);
    CHECK(a->n_vocab == b->n_vocab && a->logits && b->logits);
    for (int32_t i = 0; i < a->n; i++) CHECK_EQ_INT(a->tok[i], b->tok[i]);
    CHECK(memcmp(a->logits, b->logits, sizeof(float) * (size_t)a->n * a->n_vocab) == 0);
}

/* ---- 1. the auxiliary prefill through a probe method ---- */

static struct {
    int aux_layers;   /* after_attn calls with an aux sequence */
    int aux_new;      /* their new tokens (summed over calls of layer 0) */
    double score_sum; /* scores of the aux queries over the keys */
    int calls, capacity_refused;
} g_probe;
static bool g_probe_scoring;

static int32_t probe_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                          int32_t n_resident, int32_t n_chunk) {
    return s->is_final_chunk ? n_chunk + AUXN : n_chunk;
}
static bool probe_needs_scores(lethe_sparse_method *m, int32_t layer) { return g_probe_scoring; }
static void probe_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                             const lethe_attn_args *attn) {
    if (!attn || !g_probe_scoring) return;
    CHECK_EQ_INT(st->n_seqs, 1);
    const lethe_sparse_seq *q = &st->seqs[0];
    CHECK(q->is_aux && q->is_prefill && !q->is_final_chunk);
    CHECK(q->n_new <= CHUNK && q->n_new > 0);
    g_probe.aux_layers++;
    if (layer == 0) g_probe.aux_new += q->n_new;
    const int32_t L = attn->sel_begin[1];
    lethe_score_seq req = {.q_row = q->q_row,
                           .n_rows = q->n_new,
                           .key_begin = 0,
                           .n_keys = L,
                           .c0 = 0,
                           .c1 = L - q->n_new,
                           .mode = LETHE_SCORES_PROB_MAX | LETHE_SCORES_ROW_MAX};
    float *sc = malloc(sizeof(float) * (size_t)L);
    CHECK(lethe_sparse_scores(m, attn, &req, 1, 1, sc));
    for (int32_t j = 0; j < L - q->n_new; j++) {
        CHECK(sc[j] >= 0 && sc[j] <= 1);
        g_probe.score_sum += sc[j];
    }
    free(sc);
}
static void probe_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        if (!q->is_final_chunk) continue;
        int32_t len0 = lethe_sparse_row_len(m, 0, q->row);
        const int32_t free0 = lethe_kv_n_free(m->env.pool, 0);
        /* more than is free: refused, nothing changed */
        int32_t *big = calloc((size_t)free0 + 1, sizeof(int32_t));
        CHECK(lethe_sparse_aux_prefill(m, q, big, free0 + 1) == LETHE_ERR_CAPACITY);
        free(big);
        g_probe.capacity_refused++;
        CHECK_EQ_INT(lethe_sparse_row_len(m, 0, q->row), len0);
        CHECK_EQ_INT(lethe_kv_n_free(m->env.pool, 0), free0);
        int32_t rep[AUXN];
        for (int32_t j = 0; j < AUXN; j++) rep[j] = q->tokens[(j * 7) % q->n_tokens];
        g_probe_scoring = true;
        CHECK(lethe_sparse_aux_prefill(m, q, rep, AUXN) == LETHE_OK);
        g_probe_scoring = false;
        g_probe.calls++;
        CHECK_EQ_INT(lethe_sparse_row_len(m, 0, q->row), len0);
        CHECK_EQ_INT(lethe_kv_n_free(m->env.pool, 0), free0);
    }
}
static const lethe_sparse_ops probe_ops = {
    .name = "aux_probe",
    .summary =
        "test-only: replays tokens through an auxiliary prefill at prompt end, keeps everything",
    .prefill_peak_slots = probe_peak,
    .finish_step = probe_finish,
    .needs_scores = probe_needs_scores,
    .after_attn = probe_after_attn,
};

static void test_aux_prefill(void) {
    CHECK(lethe_sparse_register_extra(&probe_ops) == LETHE_OK);
    out dense, probe;
    lethe_engine_destroy(run_one("dense", NULL, &dense, false));
    lethe_engine *e = run_one("aux_probe", NULL, &probe, false);
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    CHECK_EQ_INT(st.prefill_tokens_computed, NPROMPT + AUXN);
    lethe_engine_destroy(e);
    CHECK_EQ_INT(g_probe.calls, 1);
    CHECK_EQ_INT(g_probe.capacity_refused, 1);
    CHECK_EQ_INT(g_probe.aux_new, AUXN);
    CHECK_EQ_INT(g_probe.aux_layers, 2 * 2); /* 2 forwards (16 + 14 tokens) x 2 layers */
    CHECK(g_probe.score_sum > 0);
    same_as(&dense, &probe); /* the replay left no trace */
    free(dense.logits);
    free(probe.logits);
}

/* ---- 2. / 3. kvzip ---- */

static const lethe_req *running0(lethe_engine *e) {
    const lethe_req *r = lethe_sched_running_at(e->sched, 0);
    CHECK(r && r->row >= 0);
    return r;
}

static void test_kvzip_shared(void) {
    out o;
    lethe_engine *e = run_one(
        "kvzip", "kvzip_token_budget=12,kvzip_chunk_size=16,kvzip_postfix=4,kvzip_sink_tokens=2",
        &o, true);
    const lethe_req *r = running0(e);
    for (int32_t l = 0; l < 2; l++) {
        CHECK_EQ_INT(lethe_kv_row_len(e->pool, l, r->row), 12); /* the budget; the replay is gone */
        const int32_t *pos = lethe_kv_row_pos(e->pool, l, r->row);
        CHECK(pos[0] == 0 && pos[1] == 1); /* sink */
        const int32_t *pos0 = lethe_kv_row_pos(e->pool, 0, r->row);
        for (int32_t i = 0; i < 12; i++) CHECK_EQ_INT(pos[i], pos0[i]); /* one token set */
    }
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    /* candidates 2..47 in chunks of 16, 16, 14; replays: 16, 4 + 16, 4 + 14 (no
     * tokenizer, so no instruction) */
    CHECK_EQ_INT(st.prefill_tokens_computed, NPROMPT + 16 + 20 + 18);
    run_all(e);
    CHECK_EQ_INT(o.n, NGEN);
    lethe_engine_destroy(e);
    free(o.logits);
}

typedef struct pair_state {
    int32_t pos[2][NPROMPT];
    uint64_t mask[2][NPROMPT];
    int32_t len[2];
    int64_t kept_cand; /* (layer, KV head) entries of non-sink tokens */
    int32_t head_len[2][2];
} pair_state;

static void pair_run(const char *cfg, pair_state *ps, out *o) {
    lethe_engine *e = run_one("kvzip", cfg, o, true);
    const lethe_req *r = running0(e);
    memset(ps, 0, sizeof(*ps));
    for (int32_t l = 0; l < 2; l++) {
        const int32_t L = lethe_kv_row_len(e->pool, l, r->row);
        CHECK(L <= NPROMPT + 1);
        const int32_t *pos = lethe_kv_row_pos(e->pool, l, r->row);
        const uint64_t *mk = lethe_kv_row_head_mask(e->pool, l, r->row);
        CHECK(mk);
        ps->len[l] = 0;
        for (int32_t i = 0; i < L; i++) {
            if (pos[i] >= NPROMPT) continue; /* the decoded token */
            ps->pos[l][ps->len[l]] = pos[i];
            ps->mask[l][ps->len[l]++] = mk[i];
            if (pos[i] < 2) CHECK(mk[i] == 3); /* sink: both KV heads */
            else ps->kept_cand += __builtin_popcountll(mk[i]);
        }
        for (int32_t h = 0; h < 2; h++)
            ps->head_len[l][h] = lethe_kv_head_len(e->pool, l, r->row, h);
    }
    run_all(e); /* decode with per-head attention, the ownership checker every step */
    CHECK_EQ_INT(o->n, NGEN);
    lethe_engine_destroy(e);
}

static bool kept(const pair_state *ps, int32_t l, int32_t p, int32_t h) {
    for (int32_t i = 0; i < ps->len[l]; i++)
        if (ps->pos[l][i] == p) return (ps->mask[l][i] >> h) & 1u;
    return false;
}

static void test_kvzip_pair(void) {
    const int64_t cand = 2 * 2 * (NPROMPT - 2); /* layers x KV heads x non-sink tokens */
    pair_state *a = calloc(1, sizeof(*a)), *b = calloc(1, sizeof(*b));
    out oa, ob, od, o1;
    const char *base = "kvzip_level=pair,kvzip_chunk_size=16,kvzip_postfix=4,kvzip_sink_tokens=2";
    char cfg[256];
    snprintf(cfg, sizeof cfg, "%s,kvzip_ratio=0.3", base);
    pair_run(cfg, a, &oa);
    snprintf(cfg, sizeof cfg, "%s,kvzip_ratio=0.6", base);
    pair_run(cfg, b, &ob);
    CHECK_EQ_INT(a->kept_cand, (int64_t)ceil(0.3 * (double)cand));
    CHECK_EQ_INT(b->kept_cand, (int64_t)ceil(0.6 * (double)cand));
    for (int32_t l = 0; l < 2; l++) /* nesting: kept at 0.3 => kept at 0.6 */
        for (int32_t p = 0; p < NPROMPT; p++)
            for (int32_t h = 0; h < 2; h++)
                if (kept(a, l, p, h)) CHECK(kept(b, l, p, h));
    /* the budget mode: (budget - sink) x layers x KV heads entries, per-head lengths vary */
    snprintf(cfg, sizeof cfg, "%s,kvzip_token_budget=14", base);
    pair_run(cfg, a, &oa);
    CHECK_EQ_INT(a->kept_cand, (int64_t)(14 - 2) * 2 * 2);
    bool uniform = true;
    for (int32_t l = 0; l < 2; l++)
        for (int32_t h = 0; h < 2; h++) uniform &= a->head_len[l][h] == a->head_len[0][0];
    CHECK(!uniform);
    /* ratio 1: nothing replayed, bit-identical to dense */
    snprintf(cfg, sizeof cfg, "%s,kvzip_ratio=1", base);
    lethe_engine_destroy(run_one("kvzip", cfg, &o1, false));
    lethe_engine_destroy(run_one("dense", NULL, &od, false));
    same_as(&od, &o1);
    free(oa.logits), free(ob.logits), free(od.logits), free(o1.logits);
    free(a), free(b);
}

/* ---- 4. the Chain Cache ---- */

static void chain_turns(const char *cfg, int32_t budget) {
    lethe_engine *e = open_engine("kvzip", cfg, true);
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
    char id[48] = "";
    int32_t hist[128], n_hist = 0;
    for (int t = 0; t < 3; t++) {
        int32_t n_app = t == 0 ? 30 : 12;
        prompt_ids(hist + n_hist, n_app, t + 1);
        n_hist += n_app;
        out o = {0};
        lethe_request_params rp = {.prompt = t ? hist + n_hist - n_app : hist,
                                   .n_prompt = n_app,
                                   .cb = on_event,
                                   .user = &o,
                                   .want_logits = true};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = NGEN;
        rp.sampling.ignore_eos = true;
        lethe_chain_params cp = {.chain_id = t ? id : NULL, .append = t > 0};
        lethe_chain_result cr;
        CHECK_MSG(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == 0, "%s",
                  lethe_engine_last_error());
        run_all(e);
        CHECK_EQ_INT(o.n, NGEN);
        CHECK(!strcmp(cr.status, t ? "resumed" : "created"));
        if (!t) strcpy(id, cr.chain_id);
        for (int32_t i = 0; i < NGEN; i++) hist[n_hist++] = o.tok[i];
        for (int32_t l = 0; l < 2; l++) {
            int32_t pos[128];
            int32_t n = lethe_engine_chain_positions(e, id, l, pos, 128);
            CHECK(n > 0 && n <= budget + NGEN);
            CHECK(pos[0] == 0 && pos[1] == 1); /* sink */
            for (int32_t i = 1; i < n; i++) CHECK(pos[i] > pos[i - 1]);
        }
        free(o.logits);
    }
    lethe_engine_destroy(e);
}

static void test_kvzip_chain(void) {
    chain_turns("kvzip_token_budget=16,kvzip_chunk_size=16,kvzip_postfix=4,kvzip_sink_tokens=2",
                16);
    /* pair: a layer holds at most every token (union over its heads) */
    chain_turns(
        "kvzip_level=pair,kvzip_ratio=0.4,kvzip_chunk_size=16,kvzip_postfix=4,kvzip_sink_tokens=2",
        128);
}

int main(void) {
    TEST_RUN(test_aux_prefill);
    TEST_RUN(test_kvzip_shared);
    TEST_RUN(test_kvzip_pair);
    TEST_RUN(test_kvzip_chain);
    printf("test_kvzip: ok\n");
    return 0;
}

/* test_hybrid_chain.c - the Chain Cache on a hybrid linear-attention model
 * (tests/data/tiny-qwen3_5: 3 Gated DeltaNet layers + 1 gated attention
 * layer) on the CPU forward, invariant checker after every step: an idle
 * chain keeps its row, and the row owns its state slot, so a turn continues
 * from the states after the chain's boundary without recompute.
 *
 * Which cold run a continuation equals bit for bit (the delta rule's float
 * order depends on how tokens were processed: chunked prefill segments cut
 * at multiples of LETHE_GDN_CHUNK, or one-step decode updates):
 *  - turns that generate one token leave a boundary with prefill states
 *    only (the sampled token has no KV yet); when the boundary is a
 *    multiple of 64, the next turn prefills from there in the segments a
 *    cold prefill of its full prompt cuts, so it equals a cold run of that
 *    prompt on an engine without prefix caching (3 turns, step budgets 64
 *    and 2048);
 *  - a turn after several generated tokens continues from states built by
 *    decode updates; it equals the same turns on a fresh engine (nothing
 *    else ran), here after other chains and plain requests ran in between,
 *    and is checked against the cold prefill of its full prompt only within
 *    rounding (printed);
 *  - idle chains' states have a budget (--state-snapshot-bytes): beyond it
 *    the least recently used chain is reclaimed (its next turn is gone);
 *    with none, a finished chain keeps no row and its next turn recomputes
 *    (equal to the cold run);
 *  - with the host tier (--host-cache-bytes) a chain reclaimed beyond the
 *    idle-state budget is demoted with its row's states instead of
 *    dropped; its next turn restores KV and states and equals the cold run
 *    of its full prompt; with no idle-state budget at all every finished
 *    chain goes to the host and comes back the same way;
 *  - an aborted turn frees its row and state slot; branching is refused;
 *  - PREFILL+DECODE pairs take the prefix cache mode they take on a dense
 *    model (tests/data/tiny-qwen3), in auto and explicit modes, from the
 *    pair's resolved table; a pair's chain turn resumes and equals the cold
 *    run of its full prompt with the same pair. */
#include <math.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "sparse/sparse.h"
#include "test.h"

#define NV 256
#define MAXT 8
#define MAXP 400
#define HR_MAXT MAXT
#define HR_NV NV
#include "hybrid_run.h"

static size_t g_host_bytes; /* --host-cache-bytes of the next engine */

static lethe_engine *mk(const char *mode, int32_t budget, size_t snap_bytes) {
    lethe_engine_params p = hr_params();
    p.max_num_batched_tokens = budget;
    p.enable_prefix_caching = mode != NULL;
    if (mode) p.prefix_cache_mode = mode;
    p.state_snapshot_bytes = snap_bytes;
    p.host_cache_bytes = g_host_bytes;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    return e;
}

static void cold(lethe_engine *e, const int32_t *prompt, int32_t n, int32_t max_tokens, out *o) {
    lethe_request_params rp = hr_greedy(prompt, n, max_tokens, o);
    uint64_t id;
    CHECK_MSG(lethe_engine_add_request(e, &rp, &id) == 0, "%s", lethe_engine_last_error());
    drain(e);
    CHECK(o->done && o->n == max_tokens);
}

/* one chain turn (full prompt); id NULL creates; returns the result code */
static lethe_chain_code turn(lethe_engine *e, const char *id, const int32_t *prompt, int32_t n, int32_t max_tokens,
                             out *o, lethe_chain_result *cr) {
    lethe_request_params rp = hr_greedy(prompt, n, max_tokens, o);
    lethe_chain_params cp = {.chain_id = id};
    if (lethe_engine_add_request_chain(e, &rp, &cp, cr, NULL) != 0) return cr->code;
    drain(e);
    CHECK(o->done && o->n == max_tokens);
    return cr->code;
}

static void same(const out *a, const out *b, const char *what) { hr_same(a, b, -1, what); }

static float max_diff(const out *a, const out *b) {
    float d = 0;
    for (int32_t t = 0; t < LETHE_MIN(a->n, b->n); t++)
        for (int v = 0; v < NV; v++) d = LETHE_MAX(d, fabsf(a->logits[t][v] - b->logits[t][v]));
    return d;
}

/* no state slot held; free = all but the scratch one, the running rows' and idle chains' */
static void states_accounted(lethe_engine *e, int32_t idle_rows) {
    const int32_t scratch = lethe_kv_scratch_state(e->pool) >= 0;
    CHECK_EQ_INT(lethe_kv_state_n_held(e->pool), 0);
    CHECK_EQ_INT(lethe_pcache_rows_held(e->pcache), idle_rows);
    CHECK_EQ_INT(lethe_kv_state_n_free(e->pool), lethe_kv_n_state_slots(e->pool) - scratch - idle_rows);
    CHECK(eng_check(e) == LETHE_OK);
}

static int32_t g_p[MAXP];

static void make_tokens(void) {
    uint64_t rng = 91;
    for (int32_t k = 0; k < MAXP; k++) g_p[k] = (int32_t)(lethe_splitmix64(&rng) % NV);
}

/* turn prompts: history + the sampled token + new tokens (from g_p) */
static int32_t extend(int32_t *buf, int32_t n, const out *o, int32_t from, int32_t n_new) {
    for (int32_t t = 0; t < o->n; t++) buf[n++] = o->tokens[t];
    memcpy(buf + n, g_p + from, (size_t)n_new * sizeof(int32_t));
    return n + n_new;
}

static void test_prefill_boundaries_equal_cold(void) {
    const int32_t budgets[] = {2048, 64};
    for (size_t b = 0; b < LETHE_ARRAY_LEN(budgets); b++) {
        lethe_engine *ce = mk(NULL, 2048, 0), *e = mk("chain", budgets[b], 0);
        CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
        static int32_t prompt[MAXP];
        static out o, c;
        lethe_chain_result cr;
        memcpy(prompt, g_p, 128 * sizeof(int32_t));
        int32_t n = 128;
        CHECK(turn(e, NULL, prompt, n, 1, &o, &cr) == LETHE_CHAIN_OK); /* boundary 128 */
        cold(ce, prompt, n, 1, &c);
        same(&o, &c, "turn 1");
        char id[48];
        snprintf(id, sizeof(id), "%s", cr.chain_id);
        states_accounted(e, 1);
        n = extend(prompt, n, &o, 128, 63); /* 192 tokens; boundary 192 after it */
        CHECK(turn(e, id, prompt, n, 1, &o, &cr) == LETHE_CHAIN_OK);
        CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 128);
        cold(ce, prompt, n, 1, &c);
        same(&o, &c, "turn 2");
        n = extend(prompt, n, &o, 191, 100); /* 293 tokens, continues from 192 */
        CHECK(turn(e, id, prompt, n, MAXT, &o, &cr) == LETHE_CHAIN_OK);
        CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 192);
        cold(ce, prompt, n, MAXT, &c);
        same(&o, &c, "turn 3");
        states_accounted(e, 1);
        fprintf(stderr, "    budget %d: turns resumed at 128 and 192, logits bit-identical to cold prefills\n",
                budgets[b]);
        lethe_engine_destroy(e);
        lethe_engine_destroy(ce);
    }
}

/* a chain whose first turn decodes 8 tokens, then a second turn; with
 * `traffic`, other chains and plain requests run between the two turns */
static void decoded_history(bool traffic, out *t2, int32_t *prompt, int32_t *n_out) {
    lethe_engine *e = mk("chain", 64, 0);
    static out o, x;
    lethe_chain_result cr;
    memcpy(prompt, g_p, 100 * sizeof(int32_t));
    int32_t n = 100;
    CHECK(turn(e, NULL, prompt, n, MAXT, &o, &cr) == LETHE_CHAIN_OK);
    char id[48];
    snprintf(id, sizeof(id), "%s", cr.chain_id);
    if (traffic) {
        lethe_chain_result xr;
        for (int k = 0; k < 3; k++) {
            CHECK(turn(e, NULL, g_p + 50 + 30 * k, 120, MAXT, &x, &xr) == LETHE_CHAIN_OK);
            cold(e, g_p + 7 * k, 150, 4, &x);
        }
        states_accounted(e, 4);
    }
    n = extend(prompt, n, &o, 200, 50);
    CHECK(turn(e, id, prompt, n, MAXT, t2, &cr) == LETHE_CHAIN_OK);
    CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 100 + MAXT - 1);
    states_accounted(e, traffic ? 4 : 1);
    *n_out = n;
    lethe_engine_destroy(e);
}

static void test_decoded_history(void) {
    static out alone, busy, c;
    static int32_t p1[MAXP], p2[MAXP];
    int32_t n1, n2;
    decoded_history(false, &alone, p1, &n1);
    decoded_history(true, &busy, p2, &n2);
    CHECK(n1 == n2 && !memcmp(p1, p2, (size_t)n1 * sizeof(int32_t)));
    same(&busy, &alone, "turn 2 after other traffic vs on a fresh engine");
    lethe_engine *ce = mk(NULL, 2048, 0);
    cold(ce, p1, n1, MAXT, &c);
    lethe_engine_destroy(ce);
    const float d = max_diff(&alone, &c);
    fprintf(stderr, "    after 7 decoded tokens: turn 2 bit-identical to the same turns on a fresh engine; "
                    "vs a cold prefill of its prompt: max |logit diff| %.3g\n", (double)d);
    CHECK(d < 1e-3f);
}

static void test_idle_state_budget(void) {
    lethe_engine *probe = mk(NULL, 64, 0);
    const size_t one = eng_state_bytes(probe, 1);
    lethe_engine_destroy(probe);
    lethe_engine *e = mk("chain", 64, 2 * one + one / 2);
    CHECK_EQ_INT(e->n_snap_slots, 2);
    static out o;
    lethe_chain_result cr;
    char ids[3][48];
    for (int k = 0; k < 3; k++) {
        CHECK(turn(e, NULL, g_p + 40 * k, 100, 2, &o, &cr) == LETHE_CHAIN_OK);
        snprintf(ids[k], sizeof(ids[k]), "%s", cr.chain_id);
        states_accounted(e, LETHE_MIN(k + 1, 2));
    }
    /* the first chain was reclaimed (LRU) for the third one's state */
    CHECK(turn(e, ids[0], g_p, 100, 2, &o, &cr) == LETHE_CHAIN_GONE);
    for (int k = 1; k < 3; k++) {
        int32_t hist[MAXP];
        const int32_t nh = lethe_engine_chain_history(e, ids[k], hist, MAXP);
        CHECK(nh == 102);
        memcpy(hist + nh, g_p + 300, 20 * sizeof(int32_t));
        CHECK(turn(e, ids[k], hist, nh + 20, 2, &o, &cr) == LETHE_CHAIN_OK);
        CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 101);
    }
    states_accounted(e, 2);
    lethe_engine_destroy(e);
    /* no state for idle chains at all: a finished chain keeps no row; its next turn recomputes */
    e = mk("chain", 64, 1);
    CHECK_EQ_INT(e->n_snap_slots, 0);
    lethe_engine *ce = mk(NULL, 2048, 0);
    static out c;
    CHECK(turn(e, NULL, g_p, 100, 2, &o, &cr) == LETHE_CHAIN_OK);
    char id[48];
    snprintf(id, sizeof(id), "%s", cr.chain_id);
    states_accounted(e, 0);
    int32_t hist[MAXP];
    const int32_t nh = lethe_engine_chain_history(e, id, hist, MAXP);
    memcpy(hist + nh, g_p + 300, 20 * sizeof(int32_t));
    CHECK(turn(e, id, hist, nh + 20, MAXT, &o, &cr) == LETHE_CHAIN_OK);
    CHECK(cr.reused_tokens == 0);
    cold(ce, hist, nh + 20, MAXT, &c);
    same(&o, &c, "recomputed turn");
    fprintf(stderr, "    idle states: 2 kept (LRU reclaims the third's oldest), 0 kept: the turn recomputes, "
                    "identical to cold\n");
    lethe_engine_destroy(ce);
    lethe_engine_destroy(e);
}

/* A's first turn, B's first turn (A, the least recently used, leaves the pool),
 * A's second turn from its boundary at 128, against cold runs */
static void host_round(size_t snap_bytes, int32_t idle_after) {
    g_host_bytes = 64u << 20;
    lethe_engine *e = mk("chain", 64, snap_bytes);
    g_host_bytes = 0;
    lethe_engine *ce = mk(NULL, 2048, 0);
    static int32_t pa[MAXP];
    static out o, c;
    lethe_chain_result cr;
    memcpy(pa, g_p, 128 * sizeof(int32_t));
    CHECK(turn(e, NULL, pa, 128, 1, &o, &cr) == LETHE_CHAIN_OK); /* boundary 128 */
    char id[48];
    snprintf(id, sizeof(id), "%s", cr.chain_id);
    CHECK(turn(e, NULL, g_p + 200, 130, 2, &c, &cr) == LETHE_CHAIN_OK); /* B */
    states_accounted(e, idle_after);
    lethe_engine_chain_stats cs;
    lethe_engine_get_chain_stats(e, &cs);
    CHECK_MSG(cs.n_on_host == 2 - idle_after && cs.n_demoted == 2 - idle_after, "%d on host, %lld demoted",
              cs.n_on_host, (long long)cs.n_demoted);
    const int32_t n = extend(pa, 128, &o, 128, 63); /* 192 tokens */
    CHECK(turn(e, id, pa, n, MAXT, &o, &cr) == LETHE_CHAIN_OK);
    CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 128);
    cold(ce, pa, n, MAXT, &c);
    same(&o, &c, "turn restored from the host tier");
    lethe_engine_get_chain_stats(e, &cs);
    CHECK_EQ_INT(cs.n_restored, 1);
    states_accounted(e, idle_after);
    lethe_engine_destroy(ce);
    lethe_engine_destroy(e);
}

static void test_host_tier(void) {
    lethe_engine *probe = mk(NULL, 64, 0);
    const size_t one = eng_state_bytes(probe, 1);
    lethe_engine_destroy(probe);
    host_round(one + one / 2, 1); /* one idle chain keeps its row: A is demoted for B */
    host_round(1, 0);             /* none: both are demoted as they finish */
    fprintf(stderr, "    host tier: chains demoted with their states (budget 1 and 0), the restored turn "
                    "bit-identical to cold\n");
}

static void test_abort_and_refusals(void) {
    lethe_engine *e = mk("chain", 64, 0);
    static out o;
    lethe_chain_result cr;
    lethe_request_params rp = hr_greedy(g_p, 300, MAXT, &o);
    lethe_chain_params cp = {0};
    uint64_t rid;
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, &rid) == 0);
    for (int k = 0; k < 2; k++) CHECK(lethe_engine_step(e) == 0); /* mid-prefill */
    CHECK(lethe_engine_abort(e, rid) == 0);
    CHECK(o.done && o.why == LETHE_FINISH_ABORT);
    states_accounted(e, 0);
    /* branching needs the states at the shared prefix's end: refused */
    rp = hr_greedy(g_p, 100, 2, &o);
    cp.share_prefix_tokens = 64;
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, &rid) != 0);
    CHECK(cr.code == LETHE_CHAIN_INVALID_REQUEST && strstr(cr.message, "cannot branch"));
    lethe_engine_destroy(e);
    /* auto with an eviction method takes the Chain Cache */
    lethe_engine_params p = hr_params();
    p.sparse_method = "snapkv";
    p.sparse_config = "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24";
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
    CHECK(turn(e, NULL, g_p, 120, 4, &o, &cr) == LETHE_CHAIN_OK);
    states_accounted(e, 1);
    lethe_engine_destroy(e);
}

/* an engine with `method`, or NULL with the reason in *err (model: tiny hybrid or dense) */
static lethe_engine *mk_method(const char *model, int32_t max_len, const char *method, const char *mode,
                               bool caching, char *err, size_t cap) {
    lethe_engine_params p = hr_params();
    p.model = model;
    p.max_num_batched_tokens = 64;
    p.max_model_len = max_len;
    p.enable_prefix_caching = caching;
    if (mode) p.prefix_cache_mode = mode;
    p.sparse_method = method;
    lethe_engine *e = NULL;
    if (lethe_engine_create(&p, &e) != 0) {
        snprintf(err, cap, "%s", lethe_engine_last_error());
        return NULL;
    }
    return e;
}

static void test_pairs_resolve_like_dense(void) {
    const char *modes[] = {"auto", "radix", "chain"};
    int32_t n_pairs = 0, n_refused = 0;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *P = lethe_sparse_method_at(i);
        if (!(P->flags & LETHE_SPARSE_PREFILL_AXIS)) continue;
        for (int32_t j = 0; j < lethe_sparse_n_methods(); j++) {
            const lethe_sparse_ops *D = lethe_sparse_method_at(j);
            if (D->flags & LETHE_SPARSE_PREFILL_AXIS) continue;
            char name[128];
            snprintf(name, sizeof(name), "%s+%s", P->name, D->name);
            const lethe_sparse_ops *p2, *d2;
            if (lethe_sparse_combine(name, &p2, &d2) != LETHE_OK) continue; /* refused everywhere */
            const lethe_sparse_ops *who = NULL;
            const bool hybrid_ok = lethe_sparse_hybrid_refusal_of(name, &who) == NULL;
            for (size_t m = 0; m < LETHE_ARRAY_LEN(modes); m++) {
                char derr[512] = "", herr[512] = "";
                lethe_engine *de = mk_method("tests/data/tiny-qwen3", 128, name, modes[m], true, derr, sizeof(derr));
                lethe_engine *he = mk_method(TINY, 512, name, modes[m], true, herr, sizeof(herr));
                if (!hybrid_ok) { /* refused with the method's reason, whatever the mode */
                    CHECK_MSG(!he && strstr(herr, "cannot use method"), "%s: %s", name, herr);
                    if (de) lethe_engine_destroy(de);
                    n_refused += m == 0;
                    continue;
                }
                const char *dm = de ? lethe_engine_prefix_cache_mode(de) : "error";
                const char *hm = he ? lethe_engine_prefix_cache_mode(he) : "error";
                CHECK_MSG(!strcmp(dm, hm), "%s mode %s: dense model %s (%s), hybrid %s (%s)", name, modes[m], dm,
                          derr, hm, herr);
                /* an impossible explicit mode names the flag on both */
                if (!de) CHECK_MSG(strstr(derr, "prefix-cache-mode") && strstr(herr, "prefix-cache-mode"),
                                   "%s: %s / %s", name, derr, herr);
                if (de) lethe_engine_destroy(de);
                if (he) lethe_engine_destroy(he);
                n_pairs += m == 0;
            }
        }
    }
    CHECK(n_pairs > 0);
    fprintf(stderr, "    %d pairs take the mode of the dense model in auto, radix and chain; %d refused on hybrid\n",
            n_pairs, n_refused);
    /* a pair's chain turn on the hybrid model resumes and equals its cold run */
    const char *pairs[] = {"flashprefill+dense", "omnikv_prefill+quest"};
    for (size_t k = 0; k < LETHE_ARRAY_LEN(pairs); k++) {
        char err[512];
        lethe_engine *e = mk_method(TINY, 512, pairs[k], "auto", true, err, sizeof(err));
        lethe_engine *ce = mk_method(TINY, 512, pairs[k], NULL, false, err, sizeof(err));
        CHECK_MSG(e && ce, "%s: %s", pairs[k], err);
        CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
        static int32_t prompt[MAXP];
        static out o, c;
        lethe_chain_result cr;
        memcpy(prompt, g_p, 128 * sizeof(int32_t));
        int32_t n = 128;
        CHECK(turn(e, NULL, prompt, n, 1, &o, &cr) == LETHE_CHAIN_OK);
        cold(ce, prompt, n, 1, &c);
        same(&o, &c, "pair turn 1");
        char id[48];
        snprintf(id, sizeof(id), "%s", cr.chain_id);
        n = extend(prompt, n, &o, 128, 63);
        CHECK(turn(e, id, prompt, n, MAXT, &o, &cr) == LETHE_CHAIN_OK);
        CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 128);
        cold(ce, prompt, n, MAXT, &c);
        same(&o, &c, "pair turn 2");
        states_accounted(e, 1);
        fprintf(stderr, "    %s: chain turn resumed at 128, logits bit-identical to its cold run\n", pairs[k]);
        lethe_engine_destroy(e);
        lethe_engine_destroy(ce);
    }
}

int main(void) {
    make_tokens();
    TEST_RUN(test_pairs_resolve_like_dense);
    TEST_RUN(test_prefill_boundaries_equal_cold);
    TEST_RUN(test_decoded_history);
    TEST_RUN(test_idle_state_budget);
    TEST_RUN(test_host_tier);
    TEST_RUN(test_abort_and_refusals);
    fprintf(stderr, "test_hybrid_chain: ok\n");
    return 0;
}

/* test_sparse_pairs.c - every PREFILL+DECODE pair of the registry
 * (--sparse-method flashprefill+snapkv; src/sparse/combined.c) through the
 * real engine on the CPU backend, tiny Llama shape (dummy weights):
 *
 *  - refusals: a pair lethe_sparse_combine rejects (a block-sparse prefill
 *    over quantized / compressed KV, a select_layer prefill over per-layer
 *    rows) is refused at engine create with a message naming both methods;
 *  - identity: with the prefill method's test_configs.identity (it reads
 *    every token) and the decode method's small config, greedy tokens, the
 *    full logits of every step and the resident slots at the end are
 *    bit-identical to the decode method alone (two batched requests, chunked
 *    prefill, a third aborted mid-prefill, the KV checker after every step);
 *  - both small: the pair runs with both methods narrowing (evicting decode
 *    methods still free slots, a select_layer prefill builds on the backend);
 *  - Quest per KV head (quest_granularity=head) after every prefill method:
 *    identical to quest head alone at the prefill identity, runs both small;
 *  - Chain Cache: three turns of one chain (the decode method's per-request
 *    state snapshot at each turn's end and restored at the next) give the
 *    same tokens, logits and per-layer resident positions as the decode
 *    method alone;
 *  - hybrid models: every method of a pair is asked whether it refuses them
 *    (ops->hybrid_refusal), the pair's table carries the refusal, and an own
 *    output projection must declare it.
 * The pairs come from the registry (the test's throwaway methods included):
 * a new method of either axis needs no edit here. LETHE_TEST_DEVICE=cuda
 * runs the same expectations on the CUDA backend (tests/gpu/run.sh does);
 * there flashprefill's identity config takes 128-token blocks (the CUDA
 * kernel's only size; threshold 0 is dense bit for bit there too). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "lethe.h"
#include "sparse/sparse.h"
#include "sparse_throwaway.h"
#include "test.h"

#define TINY "tests/data/tiny-llama/config.json"
enum { NPROMPT = 48, NGEN = 6, NTURN = 3 };
static const char *g_device = "cpu";

typedef struct run_out {
    int32_t tokens[2][NGEN];
    int32_t n[2];
    float *logits[2]; /* [NGEN][n_vocab] */
    int32_t n_vocab;
    int64_t slots_used_end; /* kv_slots_used before the last step */
    int64_t device_selections;
} run_out;
typedef struct cb_ctx {
    run_out *o;
    int which;
} cb_ctx;

static void on_event(void *user, const lethe_event *ev) {
    cb_ctx *c = user;
    run_out *o = c->o;
    if (ev->n_tokens != 1 || o->n[c->which] >= NGEN) return;
    const int i = o->n[c->which]++;
    o->tokens[c->which][i] = ev->token;
    CHECK(ev->logits && ev->n_vocab > 0);
    o->n_vocab = ev->n_vocab;
    if (!o->logits[c->which]) o->logits[c->which] = calloc((size_t)NGEN * ev->n_vocab, sizeof(float));
    memcpy(o->logits[c->which] + (size_t)i * ev->n_vocab, ev->logits, sizeof(float) * (size_t)ev->n_vocab);
}
static void free_out(run_out *o) {
    free(o->logits[0]);
    free(o->logits[1]);
    memset(o, 0, sizeof(*o));
}

static void params(lethe_engine_params *p, const char *method, const char *cfg, bool chain) {
    lethe_engine_default_params(p);
    p->model = TINY;
    p->load_format = "dummy";
    p->seed = 7;
    p->device = g_device;
    p->gpu_memory_utilization = 0.05f;
    p->n_threads = 2;
    p->max_model_len = 128;
    p->max_num_batched_tokens = 40; /* chunked prefill */
    p->enable_prefix_caching = chain;
    if (chain) p->prefix_cache_mode = "chain";
    p->kv_cache_bytes = (size_t)96 << 20;
    p->sparse_method = method;
    p->sparse_config = cfg;
    p->check_invariants = true;
}

static lethe_engine *open_engine(const char *method, const char *cfg, bool chain) {
    lethe_engine_params p;
    params(&p, method, cfg, chain);
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s %s: %s", method, cfg ? cfg : "", lethe_engine_last_error());
    return e;
}

static void prompt(int which, int32_t *ids) {
    for (int i = 0; i < NPROMPT; i++) ids[i] = 3 + (int32_t)((i * 37 + which * 11) % 250);
}
static void greedy(lethe_request_params *rp) {
    lethe_sampling_default_params(&rp->sampling);
    rp->sampling.temperature = 0;
    rp->sampling.max_tokens = NGEN;
    rp->sampling.ignore_eos = true;
}

/* two requests to completion plus a third aborted after its first chunk */
static void run(const char *method, const char *cfg, run_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine *e = open_engine(method, cfg, false);
    int32_t ids[3][NPROMPT];
    run_out sink = {0};
    cb_ctx cc[3] = {{o, 0}, {o, 1}, {&sink, 0}};
    uint64_t id[3];
    for (int r = 0; r < 3; r++) {
        prompt(r, ids[r]);
        lethe_request_params rp = {.prompt = ids[r], .n_prompt = NPROMPT - 8 * r, .cb = on_event,
                                   .user = &cc[r], .want_logits = true};
        greedy(&rp);
        CHECK(lethe_engine_add_request(e, &rp, &id[r]) == 0);
    }
    CHECK(lethe_engine_step(e) == 0);
    CHECK(lethe_engine_abort(e, id[2]) == 0);
    while (lethe_engine_has_work(e)) {
        lethe_engine_stats st;
        lethe_engine_get_stats(e, &st);
        if (st.n_running + st.n_waiting > 0) o->slots_used_end = st.kv_slots_used;
        CHECK_MSG(lethe_engine_step(e) == 0, "%s: %s", method, lethe_engine_last_error());
    }
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    CHECK_EQ_INT(st.kv_slots_used, 0);
    o->device_selections = st.device_selections;
    lethe_engine_destroy(e);
    free_out(&sink);
    CHECK_EQ_INT(o->n[0], NGEN);
    CHECK_EQ_INT(o->n[1], NGEN);
}

static void same(const run_out *a, const run_out *b, const char *what) {
    CHECK_EQ_INT(a->n_vocab, b->n_vocab);
    for (int r = 0; r < 2; r++) {
        CHECK_MSG(!memcmp(a->tokens[r], b->tokens[r], sizeof(a->tokens[r])), "%s: tokens", what);
        CHECK_MSG(!memcmp(a->logits[r], b->logits[r], (size_t)NGEN * (size_t)a->n_vocab * sizeof(float)),
                  "%s: logits", what);
    }
}

/* positions of every layer of a chain after each turn, and the turns' outputs */
typedef struct chain_out {
    run_out turn[NTURN];
    int32_t pos[NTURN][2][128], n_pos[NTURN][2];
} chain_out;

static void chain_turns(const char *method, const char *cfg, chain_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine *e = open_engine(method, cfg, true);
    char id[48] = "";
    for (int t = 0; t < NTURN; t++) {
        int32_t ids[NPROMPT];
        prompt(t, ids);
        cb_ctx cc = {&o->turn[t], 0};
        lethe_request_params rp = {.prompt = ids, .n_prompt = t ? 12 : NPROMPT, .cb = on_event, .user = &cc,
                                   .want_logits = true};
        greedy(&rp);
        lethe_chain_params cp = {.chain_id = t ? id : NULL, .append = t > 0};
        lethe_chain_result cr;
        CHECK_MSG(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == 0, "%s: %s", method,
                  lethe_engine_last_error());
        while (lethe_engine_has_work(e)) CHECK_MSG(lethe_engine_step(e) == 0, "%s: %s", method, lethe_engine_last_error());
        CHECK_MSG(!strcmp(cr.status, t ? "resumed" : "created"), "%s turn %d: %s", method, t, cr.status);
        if (!t) snprintf(id, sizeof(id), "%s", cr.chain_id);
        CHECK_EQ_INT(o->turn[t].n[0], NGEN);
        for (int32_t l = 0; l < 2; l++) {
            o->n_pos[t][l] = lethe_engine_chain_positions(e, id, l, o->pos[t][l], 128);
            CHECK(o->n_pos[t][l] > 0);
        }
    }
    lethe_engine_destroy(e);
}

static bool is_prefill(const lethe_sparse_ops *o) { return (o->flags & LETHE_SPARSE_PREFILL_AXIS) != 0; }

static char *join(const char *a, const char *b) {
    char *s = lethe_xmalloc(strlen(a ? a : "") + strlen(b ? b : "") + 2);
    sprintf(s, "%s%s%s", a ? a : "", a && *a && b && *b ? "," : "", b ? b : "");
    return s;
}

static void test_pairs(void) {
    int n_pairs = 0, n_refused = 0, n_prefill = 0;
    static run_out dense;
    run("dense", NULL, &dense);
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *P = lethe_sparse_method_at(i);
        if (!is_prefill(P)) continue;
        n_prefill++;
        for (int32_t j = 0; j < lethe_sparse_n_methods(); j++) {
            const lethe_sparse_ops *D = lethe_sparse_method_at(j);
            if (is_prefill(D)) continue;
            char name[128];
            snprintf(name, sizeof(name), "%s+%s", P->name, D->name);
            const char *dcfg = D->test_configs.small ? D->test_configs.small : D->test_configs.identity;
            const lethe_sparse_ops *p2, *d2;
            if (lethe_sparse_combine(name, &p2, &d2) != LETHE_OK) {
                lethe_engine_params ep;
                params(&ep, name, NULL, false);
                lethe_engine *e = NULL;
                CHECK_MSG(lethe_engine_create(&ep, &e) != 0, "%s: expected a refusal", name);
                const char *msg = lethe_engine_last_error();
                CHECK_MSG(strstr(msg, P->name) && strstr(msg, D->name), "%s: refusal names both: %s", name, msg);
                fprintf(stderr, "    %s refused: %s\n", name, msg);
                n_refused++;
                continue;
            }
            CHECK(p2 == P && d2 == D);
            fprintf(stderr, "    %s\n", name);
            static run_out alone, pair;
            char pid[256];
            snprintf(pid, sizeof(pid), "%s%s", P->test_configs.identity ? P->test_configs.identity : "",
                     strcmp(g_device, "cpu") && P->block_sparse ? ",flashprefill_block=128" : "");
            char *cfg = join(pid, dcfg);
            run(D->name, dcfg, &alone);
            run(name, cfg, &pair);
            same(&alone, &pair, name);
            CHECK_EQ_INT(pair.slots_used_end, alone.slots_used_end);
            free_out(&pair);
            free(cfg);
            /* both narrowing */
            char psm[256];
            snprintf(psm, sizeof(psm), "%s%s", P->test_configs.small ? P->test_configs.small : "",
                     strcmp(g_device, "cpu") && P->block_sparse ? ",flashprefill_block=128" : "");
            cfg = join(psm, dcfg);
            run(name, cfg, &pair);
            if (D->kind == LETHE_SPARSE_KIND_EVICTION) /* still frees slots */
                CHECK_MSG(pair.slots_used_end < dense.slots_used_end, "%s: %lld vs dense %lld", name,
                          (long long)pair.slots_used_end, (long long)dense.slots_used_end);
            if (P->select_layer) CHECK_MSG(pair.device_selections > 0, "%s: no device selection", name);
            free_out(&pair);
            free_out(&alone);
            free(cfg);
            /* the Chain Cache: snapshot / restore of the decode method's state */
            static chain_out ca, cp;
            cfg = join(pid, dcfg);
            chain_turns(D->name, dcfg, &ca);
            chain_turns(name, cfg, &cp);
            for (int t = 0; t < NTURN; t++) {
                CHECK_MSG(!memcmp(ca.turn[t].tokens[0], cp.turn[t].tokens[0], sizeof(ca.turn[t].tokens[0])),
                          "%s chain turn %d tokens", name, t);
                CHECK_MSG(!memcmp(ca.turn[t].logits[0], cp.turn[t].logits[0],
                                  (size_t)NGEN * (size_t)ca.turn[t].n_vocab * sizeof(float)),
                          "%s chain turn %d logits", name, t);
                for (int l = 0; l < 2; l++) {
                    CHECK_EQ_INT(ca.n_pos[t][l], cp.n_pos[t][l]);
                    CHECK(!memcmp(ca.pos[t][l], cp.pos[t][l], (size_t)ca.n_pos[t][l] * sizeof(int32_t)));
                }
                free_out(&ca.turn[t]);
                free_out(&cp.turn[t]);
            }
            free(cfg);
            n_pairs++;
        }
    }
    free_out(&dense);
    CHECK(n_prefill >= 2);  /* flashprefill, omnikv_prefill */
    CHECK(n_pairs >= 12);   /* flashprefill with every native-KV decode method, omnikv_prefill + dense/quest/omnikv */
    CHECK(n_refused >= 1);  /* e.g. flashprefill+kivi */
    fprintf(stderr, "    %d pairs, %d refused\n", n_pairs, n_refused);
}

/* names: order, axes, unknown methods, knobs of both in one config */
/* Quest per KV head (quest_granularity=head: per-KV-head lists from its
 * select_layer) as the decode side of every prefill method: with the prefill
 * method's identity config the pair equals quest head alone bit for bit
 * (steps where both sides built selections gather the prefill chunks' lists
 * per KV head, combined.c merge), and it runs with both narrowing. */
static void test_quest_heads_pairs(void) {
    const lethe_sparse_ops *Q = lethe_sparse_find("quest");
    char *dcfg = join(Q->test_configs.small, "quest_granularity=head");
    int n = 0;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *P = lethe_sparse_method_at(i);
        if (!is_prefill(P)) continue;
        char name[128], pid[256], psm[256];
        snprintf(name, sizeof(name), "%s+quest", P->name);
        const lethe_sparse_ops *p2, *d2;
        if (lethe_sparse_combine(name, &p2, &d2) != LETHE_OK) continue;
        fprintf(stderr, "    %s, quest_granularity=head\n", name);
        snprintf(pid, sizeof(pid), "%s%s", P->test_configs.identity ? P->test_configs.identity : "",
                 strcmp(g_device, "cpu") && P->block_sparse ? ",flashprefill_block=128" : "");
        snprintf(psm, sizeof(psm), "%s%s", P->test_configs.small ? P->test_configs.small : "",
                 strcmp(g_device, "cpu") && P->block_sparse ? ",flashprefill_block=128" : "");
        static run_out alone, pair;
        run("quest", dcfg, &alone);
        char *cfg = join(pid, dcfg);
        run(name, cfg, &pair);
        same(&alone, &pair, name);
        CHECK(pair.device_selections > 0);
        free_out(&pair);
        free(cfg);
        cfg = join(psm, dcfg);
        run(name, cfg, &pair);
        CHECK_EQ_INT(pair.slots_used_end, alone.slots_used_end); /* selection: nothing freed */
        free_out(&pair);
        free_out(&alone);
        free(cfg);
        n++;
    }
    CHECK(n >= 2); /* flashprefill, omnikv_prefill */
    free(dcfg);
}

static void test_pair_names(void) {
    const lethe_sparse_ops *p, *d;
    CHECK(lethe_sparse_combine("flashprefill+snapkv", &p, &d) == LETHE_OK);
    CHECK(p == lethe_sparse_find("flashprefill") && d == lethe_sparse_find("snapkv"));
    CHECK(lethe_sparse_combine("block-sparse-prefill+SnapKV", &p, &d) == LETHE_OK); /* aliases, spelling */
    CHECK(lethe_sparse_combine("snapkv+flashprefill", &p, &d) == LETHE_ERR_INVALID);
    CHECK(strstr(lethe_last_error(), "flashprefill+snapkv")); /* says the right order */
    CHECK(lethe_sparse_combine("flashprefill+omnikv_prefill", &p, &d) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_combine("snapkv+quest", &p, &d) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_combine("flashprefill+nope", &p, &d) == LETHE_ERR_NOT_FOUND);
    CHECK(lethe_sparse_combine("flashprefill+", &p, &d) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_combine("a+b+c", &p, &d) == LETHE_ERR_INVALID);
    CHECK(lethe_sparse_combine("flashprefill+kivi", &p, &d) == LETHE_ERR_UNSUPPORTED);
    CHECK(lethe_sparse_combine("omnikv_prefill+snapkv", &p, &d) == LETHE_ERR_UNSUPPORTED);
    CHECK(lethe_sparse_find_kv("flashprefill+snapkv") == lethe_sparse_find("snapkv"));
    CHECK(lethe_sparse_find_kv("quest") == lethe_sparse_find("quest"));
    lethe_sparse_env env = {.n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16, .max_model_len = 128};
    lethe_sparse_method *m = NULL;
    CHECK_MSG(lethe_sparse_create("flashprefill+snapkv",
                                  "flashprefill_threshold=0.01,snapkv_window_size=8,decode_keep_tokens=16", &env,
                                  &m) == LETHE_OK, "%s", lethe_last_error());
    CHECK(!strcmp(m->ops->name, "flashprefill+snapkv"));
    CHECK(m->ops->kind == LETHE_SPARSE_KIND_EVICTION && (m->ops->flags & LETHE_SPARSE_PER_LAYER_ROWS));
    const lethe_sparse_seq sq = {.is_prefill = true};
    const lethe_sparse_step st = {.n_seqs = 1, .seqs = &sq};
    CHECK(m->ops->block_sparse && m->ops->block_sparse(m, 0, &st)->threshold == 0.01f);
    CHECK_EQ_INT(m->knobs.decode_keep_tokens, 16);
    lethe_sparse_destroy(m);
    /* omnikv_full_layers is a knob of both: one entry, set in both */
    CHECK(lethe_sparse_create("omnikv_prefill+omnikv", "omnikv_full_layers=0", &env, &m) == LETHE_OK);
    int n = 0;
    for (int32_t k = 0; k < m->ops->n_knob_table; k++) n += !strcmp(m->ops->knob_table[k].name, "omnikv_full_layers");
    CHECK_EQ_INT(n, 1);
    lethe_sparse_destroy(m);
    CHECK(lethe_sparse_create("flashprefill+snapkv", "quest_page_size=16", &env, &m) == LETHE_ERR_INVALID);
    CHECK(strstr(lethe_last_error(), "quest_page_size"));
    CHECK(lethe_sparse_create("flashprefill+snapkv", "flashprefill_threshold=2", &env, &m) == LETHE_ERR_INVALID);
    CHECK(m == NULL);
}

/* hybrid models: a method declares that it cannot run on them
 * (ops->hybrid_refusal), and every method of a pair is asked, whether the
 * pair combines or not; the engine side is test_engine_hybrid */
static const lethe_block_sparse *no_bsp(const lethe_sparse_method *m, int32_t layer,
                                        const lethe_sparse_step *st) {
    return NULL;
}
static const lethe_sparse_ops refusing_prefill = {
    .name = "refusing_prefill",
    .summary = "test: a prefill-axis method that declares it cannot run on hybrid models",
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .flags = LETHE_SPARSE_PREFILL_AXIS,
    .block_sparse = no_bsp,
    .test_configs = {.identity = "", .small = ""}, /* (no knobs; never run by the generic loops) */
    .hybrid_refusal = "a test method refuses hybrid models",
};

static void test_hybrid_refusals(void) {
    const lethe_sparse_ops *palu = lethe_sparse_find("palu"), *who = NULL;
    CHECK(palu && palu->hybrid_refusal);
    CHECK(lethe_sparse_hybrid_refusal(palu) == palu->hybrid_refusal);
    CHECK(lethe_sparse_hybrid_refusal_of("palu", &who) == palu->hybrid_refusal && who == palu);
    /* palu as the decode method of a pair (which combine refuses for its own reason) */
    CHECK(lethe_sparse_hybrid_refusal_of("flashprefill+palu", &who) == palu->hybrid_refusal && who == palu);
    CHECK(lethe_sparse_hybrid_refusal_of("omnikv_prefill+palu", &who) == palu->hybrid_refusal && who == palu);
    const char *fine[] = {"dense", "snapkv", "flashprefill+snapkv", "omnikv_prefill+quest", "no_such_method",
                          "flashprefill+no_such_method", NULL};
    for (int i = 0; fine[i]; i++) {
        CHECK_MSG(lethe_sparse_hybrid_refusal_of(fine[i], &who) == NULL && who == NULL, "%s", fine[i]);
    }
    /* a refusing PREFILL method in a pair that combines: the pair's table carries it */
    CHECK_MSG(lethe_sparse_register_extra(&refusing_prefill) == LETHE_OK, "%s", lethe_last_error());
    CHECK(lethe_sparse_hybrid_refusal_of("refusing_prefill+dense", &who) == refusing_prefill.hybrid_refusal &&
          who == &refusing_prefill);
    CHECK(lethe_sparse_hybrid_refusal_of("refusing_prefill+snapkv", &who) == refusing_prefill.hybrid_refusal);
    lethe_sparse_env env = {.n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16, .max_model_len = 256};
    lethe_sparse_method *m = NULL;
    CHECK_MSG(lethe_sparse_create("refusing_prefill+snapkv", NULL, &env, &m) == LETHE_OK, "%s", lethe_last_error());
    CHECK(lethe_sparse_hybrid_refusal(m->ops) == refusing_prefill.hybrid_refusal);
    lethe_sparse_destroy(m);
    /* an own output projection without the declaration is refused at registration */
    lethe_sparse_ops undeclared = *palu;
    undeclared.name = "palu_undeclared";
    memset(undeclared.aliases, 0, sizeof(undeclared.aliases));
    undeclared.hybrid_refusal = NULL;
    CHECK(lethe_sparse_validate(&undeclared) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "kv_out_proj needs hybrid_refusal");
}

int main(void) {
    if (getenv("LETHE_TEST_DEVICE")) g_device = getenv("LETHE_TEST_DEVICE");
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_recent_window) == LETHE_OK, "%s", lethe_last_error());
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_plane_copy) == LETHE_OK, "%s", lethe_last_error());
    TEST_RUN(test_pair_names);
    TEST_RUN(test_pairs);
    TEST_RUN(test_quest_heads_pairs);
    TEST_RUN(test_hybrid_refusals); /* last: it registers a method the pair loops would run */
    return 0;
}

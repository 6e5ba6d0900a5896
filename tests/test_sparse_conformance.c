/* test_sparse_conformance.c - every registered sparse method through the real
 * engine (include/lethe.h) on the CPU backend, with the tiny Llama shape
 * (tests/data/tiny-llama, dummy weights) and the tiny Qwen3-MoE shape
 * (tests/data/tiny-qwen3-moe: routed experts, one dense layer) and the tiny
 * GLM-4.7-Flash shape (tests/data/tiny-glm4-moe-lite: latent KV; methods that
 * quantize K / V refuse it at start-up, tested) and a tiny Qwen3.5 hybrid
 * shape (tests/data/tiny-qwen3_5-2attn, dummy weights: 4 Gated DeltaNet
 * layers with states + 2 gated attention layers, layers 1 and 4, which
 * methods see as layers 0 and 1; a method with an output projection of its
 * own refuses it, tested) for every method, and
 * SmolLM2-135M for one dense / snapkv pair:
 *
 *  - identity: with the method's test_configs.identity (budgets >= the
 *    context), greedy tokens AND the full next-token logits of every step are
 *    bit-identical to dense (two requests batched, prefill chunked by a small
 *    --max-num-batched-tokens, the KV ownership checker after every step); a
 *    method whose storage is lossy with that config (fp8_kv changes stored
 *    values by design) must stay close instead;
 *  - with test_configs.small, eviction methods keep fewer KV slots resident
 *    than dense (per slot space; slots really return to the pool), selection
 *    methods keep as many and build their selections with select_layer; in
 *    every run a third request is aborted mid-prefill and the pool ends empty;
 *  - retention pins: every eviction method with test_configs.small, in chain
 *    mode, keeps a pinned range of the prompt in every layer of the chain's
 *    compacted row while it evicts other tokens (the engine's checker also
 *    verifies the pins after every step, lethe_kv_keep asserts them);
 *  - Quest per KV head (quest_granularity=head): the identity and small runs
 *    above for that mode (per-KV-head lists through the varlen attention).
 * The suite iterates the registry, including a throwaway method registered
 * here (sparse_throwaway.h): a new method needs no edit in this file.
 * Per-method algorithm properties are in test_sparse_methods.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "lethe.h"
#include "sparse/sparse.h"
#include "sparse_throwaway.h"
#include "test.h"

/* the tiny Llama shape (2 layers, GQA 4/2, vocab 256, 128 positions) with
 * seeded dummy weights (its checkpoint has no tokenizer, which the engine
 * needs for real weights); SMOL: the real SmolLM2 for one dense / snapkv pair */
#define TINY "tests/data/tiny-llama/config.json"
#define TINY_MOE "tests/data/tiny-qwen3-moe"
#define TINY_MLA "tests/data/tiny-glm4-moe-lite"
#define TINY_HYBRID "tests/data/tiny-qwen3_5-2attn/config.json"
#define SMOL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
enum { NPROMPT = 48, NPROMPT_MAX = 120, NGEN = 6, MAXV = 50000 };
/* prompt length of the identity / eviction runs: hybrid models chunk at 64,
 * so theirs are longer to span two chunks (prefill-time methods select in the
 * second), with final chunks (56, 48, 40) above every method's minimum so
 * every chunk stays aligned as dense's */
static int g_nprompt = NPROMPT;
static const char *g_model = TINY;
static bool g_tiny = true;
static const char *g_format = "dummy"; /* of the tiny models */
static bool g_refusals;                /* latent KV: quantized-storage methods refuse */
static bool g_hybrid;                  /* hybrid model: lethe_sparse_hybrid_refusal's methods refuse */

typedef struct run_out {
    int32_t tokens[2][NGEN];
    int32_t n[2];
    float *logits[2];            /* [NGEN][n_vocab] */
    int32_t n_vocab;
    int64_t slots_used_end;      /* kv_slots_used per slot space before the last step */
    int64_t device_selections;   /* engine stat: layers built by select_layer */
} run_out;

typedef struct cb_ctx {
    run_out *o;
    int which;
} cb_ctx;

static void on_event(void *user, const lethe_event *ev) {
    cb_ctx *c = user;
    run_out *o = c->o;
    if (ev->n_tokens == 1 && o->n[c->which] < NGEN) {
        int i = o->n[c->which]++;
        o->tokens[c->which][i] = ev->token;
        CHECK(ev->logits && ev->n_vocab > 0 && ev->n_vocab <= MAXV);
        o->n_vocab = ev->n_vocab;
        if (!o->logits[c->which]) o->logits[c->which] = calloc((size_t)NGEN * ev->n_vocab, sizeof(float));
        memcpy(o->logits[c->which] + (size_t)i * ev->n_vocab, ev->logits, sizeof(float) * (size_t)ev->n_vocab);
    }
}

static lethe_engine *open_engine(const char *method, const char *cfg) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = g_model;
    p.load_format = g_tiny ? g_format : "auto";
    p.seed = 7;
    p.device = "cpu";
    p.n_threads = 2;
    p.max_model_len = g_tiny ? 128 : 512;
    /* forces chunked prefill (>= the SnapKV window); hybrid models chunk at
     * multiples of 64 positions, so 64 there (the prompts then fit one chunk) */
    p.max_num_batched_tokens = g_hybrid ? 64 : 40;
    p.enable_prefix_caching = false;
    p.kv_cache_bytes = (size_t)96 << 20;
    p.sparse_method = method;
    p.sparse_config = cfg;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int rc = lethe_engine_create(&p, &e);
    CHECK_MSG(rc == 0, "%s %s: %s", method, cfg ? cfg : "", lethe_engine_last_error());
    return e;
}

static void prompt(int which, int32_t *ids) {
    for (int i = 0; i < NPROMPT_MAX; i++) ids[i] = 3 + (int32_t)((i * 37 + which * 11) % 250);
}

static void free_out(run_out *o) {
    free(o->logits[0]);
    free(o->logits[1]);
}

/* two requests to completion plus a third aborted after its first prefill chunk */
static void run(const char *method, const char *cfg, run_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_engine *e = open_engine(method, cfg);
    int32_t ids[3][NPROMPT_MAX];
    run_out sink = {0};
    cb_ctx cc[3] = {{o, 0}, {o, 1}, {&sink, 0}};
    uint64_t id[3];
    for (int r = 0; r < 3; r++) {
        prompt(r, ids[r]);
        lethe_request_params rp = {.prompt = ids[r], .n_prompt = g_nprompt - 8 * r, .cb = on_event,
                                   .user = &cc[r], .want_logits = true};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = NGEN;
        rp.sampling.ignore_eos = true;
        CHECK(lethe_engine_add_request(e, &rp, &id[r]) == 0);
    }
    CHECK(lethe_engine_step(e) == 0);
    CHECK(lethe_engine_abort(e, id[2]) == 0); /* abort mid-prefill */
    int64_t spaces = 0;
    while (lethe_engine_has_work(e)) {
        lethe_engine_stats st;
        lethe_engine_get_stats(e, &st);
        spaces = st.kv_slots_total;
        if (st.n_running + st.n_waiting > 0) o->slots_used_end = st.kv_slots_used;
        CHECK(lethe_engine_step(e) == 0);
    }
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    CHECK_EQ_INT(st.kv_slots_used, 0); /* finished and aborted requests freed everything */
    o->device_selections = st.device_selections;
    o->slots_used_end = o->slots_used_end * 1000000 / LETHE_MAX(spaces, 1); /* per million of the pool */
    lethe_engine_destroy(e);
    free_out(&sink);
    CHECK_EQ_INT(o->n[0], NGEN);
    CHECK_EQ_INT(o->n[1], NGEN);
}

/* whether `cfg` makes the method store lossy codes: its KV format on the CPU
 * backend (the engine's) for the tiny Llama shape is not the native one */
static bool lossy_storage(const lethe_sparse_ops *ops, const char *cfg) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    lethe_backend *be = NULL;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    lethe_sparse_env env = {.be = be, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16,
                            .max_model_len = 128};
    lethe_sparse_method *m = NULL;
    CHECK_MSG(lethe_sparse_create(ops->name, cfg, &env, &m) == LETHE_OK, "%s: %s", ops->name, lethe_last_error());
    const bool lossy = lethe_sparse_kv_format(m) != LETHE_KV_NATIVE;
    lethe_sparse_destroy(m);
    lethe_backend_destroy(be);
    return lossy;
}

/* true when the engine refuses `method` on g_model at create, by design: the
 * message names the model and the method (latent KV and a quantization or
 * compression method, or one with per-KV-head rows) */
static bool refused(const lethe_sparse_ops *ops, const char *cfg) {
    if (g_hybrid && !lethe_sparse_hybrid_refusal(ops)) return false;
    if (!g_hybrid && (!g_refusals || (ops->kind != LETHE_SPARSE_KIND_QUANTIZATION &&
                                      ops->kind != LETHE_SPARSE_KIND_COMPRESSION && !ops->kv_layout &&
                                      !(ops->flags & LETHE_SPARSE_HEAD_ROWS))))
        return false;
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = g_model;
    p.load_format = g_format;
    p.device = "cpu";
    p.max_model_len = 128;
    p.max_num_batched_tokens = g_hybrid ? 64 : p.max_num_batched_tokens;
    p.enable_prefix_caching = false;
    p.kv_cache_bytes = (size_t)16 << 20;
    p.sparse_method = ops->name;
    p.sparse_config = cfg;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) != 0, "%s on %s: expected a refusal", ops->name, g_model);
    const char *msg = lethe_engine_last_error();
    CHECK_MSG(strstr(msg, g_model) && strstr(msg, ops->name),
              "refusal does not name model and "
              "method: %s",
              msg);
    fprintf(stderr, "      refused: %s\n", msg);
    return true;
}

static void identity_and_eviction(void) {
    static run_out dense, o;
    run("dense", NULL, &dense);
    int n_lossy = 0;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *ops = lethe_sparse_method_at(i);
        const lethe_sparse_test_configs *tc = &ops->test_configs;
        fprintf(stderr, "    %s\n", ops->name);
        if (refused(ops, tc->identity)) {
            n_lossy++;
            continue;
        }
        run(ops->name, tc->identity, &o);
        size_t n = (size_t)NGEN * (size_t)dense.n_vocab;
        if (!lossy_storage(ops, tc->identity)) {
            for (int r = 0; r < 2; r++) {
                CHECK_MSG(!memcmp(o.tokens[r], dense.tokens[r], sizeof(o.tokens[r])), "%s tokens", ops->name);
                CHECK_MSG(!memcmp(o.logits[r], dense.logits[r], n * sizeof(float)), "%s logits", ops->name);
            }
        } else {
            /* lossy codes may flip a greedy token (MoE routing amplifies them); the
             * logits are comparable up to and including the first differing token */
            int same = 0;
            while (same < NGEN - 1 && o.tokens[0][same] == dense.tokens[0][same]) same++;
            double e = rel_err(o.logits[0], dense.logits[0], (size_t)(same + 1) * (size_t)dense.n_vocab);
            const double tol = tc->lossy_rel_err > 0 ? tc->lossy_rel_err : 0.05;
            fprintf(stderr, "      lossy: logits rel err %.4f over %d steps (bound %.2f)\n", e, same + 1, tol);
            CHECK_MSG(e < tol, "%s logits rel err %g", ops->name, e);
            n_lossy++;
        }
        /* e.g. Quest reads through its page ops in every layer here: the selections
         * were built by select_layer (backend ops), checked by the engine's invariants */
        if (tc->identity_on_backend) CHECK_MSG(o.device_selections > 0, "%s: identity not on the backend", ops->name);
        free_out(&o);
        /* small budgets: eviction frees slots, selection reads subsets but keeps all */
        if (!tc->small) continue;
        run(ops->name, tc->small, &o);
        if (ops->kind == LETHE_SPARSE_KIND_EVICTION)
            CHECK_MSG(o.slots_used_end * 2 < dense.slots_used_end, "%s: %lld vs dense %lld per million",
                      ops->name, (long long)o.slots_used_end, (long long)dense.slots_used_end);
        else if (ops->kind == LETHE_SPARSE_KIND_SELECTION) { /* logical: never frees */
            CHECK_EQ_INT(o.slots_used_end, dense.slots_used_end);
            if (ops->select_layer)
                CHECK_MSG(o.device_selections > 0, "%s: no select_layer selection", ops->name);
        }
        free_out(&o);
    }
    CHECK(n_lossy >= 1); /* fp8_kv */
    free_out(&dense);
}

static void test_identity_and_eviction(void) { identity_and_eviction(); }

/* the same over routed experts (qwen3_moe: the KV is ordinary, the FFN is not),
 * with the checkpoint's own weights: their router is decisive, where dummy
 * weights' near-uniform routing would let fp8_kv's small KV error flip experts */
static void test_identity_and_eviction_moe(void) {
    g_model = TINY_MOE;
    g_format = "hf";
    identity_and_eviction();
    g_model = TINY;
    g_format = "dummy";
}

/* latent attention (glm4_moe_lite): slots hold the latent + RoPE key, methods
 * score from the latent-space logits; KIVI / FP8 refuse at start-up */
static void test_identity_and_eviction_mla(void) {
    g_model = TINY_MLA;
    g_format = "hf";
    g_refusals = true;
    identity_and_eviction();
    g_model = TINY;
    g_format = "dummy";
    g_refusals = false;
}

/* the hybrid family (qwen3_5): methods see the two full-attention layers as
 * layers 0 and 1, the DeltaNet layers keep their states; every
 * method but the refused ones (lethe_sparse_hybrid_refusal) identical to
 * dense at identity budgets, eviction frees slots at small ones */
static void test_identity_and_eviction_hybrid(void) {
    g_model = TINY_HYBRID;
    g_format = "dummy";
    g_hybrid = true;
    g_nprompt = NPROMPT_MAX;
    identity_and_eviction();
    g_nprompt = NPROMPT;
    int n_refused = 0;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++)
        n_refused += lethe_sparse_hybrid_refusal(lethe_sparse_method_at(i)) != NULL;
    fprintf(stderr, "    hybrid: %d of %d methods refused\n", n_refused, lethe_sparse_n_methods());
    CHECK(n_refused >= 1 && n_refused * 4 < lethe_sparse_n_methods()); /* palu; not the many */
    g_model = TINY;
    g_format = "dummy";
    g_hybrid = false;
}

/* a pinned range [PIN0, PIN1) survives every eviction method and the Chain Cache */
enum { PIN0 = 8, PIN1 = 24 };
static void test_pinned_every_eviction_method(void) {
    int n_methods = 0;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *ops = lethe_sparse_method_at(i);
        if (ops->kind != LETHE_SPARSE_KIND_EVICTION || !ops->test_configs.small) continue;
        fprintf(stderr, "    %s (pinned)\n", ops->name);
        lethe_engine_params p;
        lethe_engine_default_params(&p);
        p.model = g_model;
        p.load_format = "dummy";
        p.seed = 7;
        p.device = "cpu";
        p.n_threads = 2;
        p.max_model_len = 128;
        p.max_num_batched_tokens = 40;
        p.enable_prefix_caching = true;
        p.prefix_cache_mode = "chain";
        p.kv_cache_bytes = (size_t)96 << 20;
        p.sparse_method = ops->name;
        p.sparse_config = ops->test_configs.small;
        p.check_invariants = true;
        lethe_engine *e = NULL;
        CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s: %s", ops->name, lethe_engine_last_error());
        int32_t ids[NPROMPT_MAX];
        prompt(0, ids);
        run_out o = {0};
        cb_ctx cc = {&o, 0};
        const lethe_token_range pin = {PIN0, PIN1};
        lethe_request_params rp = {.prompt = ids,
                                   .n_prompt = NPROMPT,
                                   .cb = on_event,
                                   .user = &cc,
                                   .want_logits = true,
                                   .pinned = &pin,
                                   .n_pinned = 1};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = NGEN;
        rp.sampling.ignore_eos = true;
        lethe_chain_params cp = {0};
        lethe_chain_result cr;
        CHECK_MSG(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) == 0, "%s: %s", ops->name,
                  lethe_engine_last_error());
        while (lethe_engine_has_work(e))
            CHECK_MSG(lethe_engine_step(e) == 0, "%s: %s", ops->name, lethe_engine_last_error());
        CHECK_EQ_INT(o.n[0], NGEN);
        bool evicted = false;
        for (int32_t layer = 0; layer < 2; layer++) {
            int32_t pos[256];
            int32_t n = lethe_engine_chain_positions(e, cr.chain_id, layer, pos, 256);
            CHECK_MSG(n > 0 && n <= 256, "%s: chain positions %d", ops->name, n);
            evicted |= n < NPROMPT + NGEN - 1;
            int32_t found = 0;
            for (int32_t k = 0; k < n; k++) found += pos[k] >= PIN0 && pos[k] < PIN1;
            CHECK_MSG(found == PIN1 - PIN0, "%s layer %d: %d of %d pinned positions kept",
                      ops->name, layer, found, PIN1 - PIN0);
        }
        CHECK_MSG(evicted, "%s: nothing was evicted", ops->name);
        free_out(&o);
        lethe_engine_destroy(e);
        n_methods++;
    }
    CHECK(n_methods >= 4); /* streamingllm, snapkv, pyramidkv, h2o (+ the throwaway) */
}

/* Quest per KV head (quest_granularity=head, per-KV-head lists through
 * select_layer and the varlen attention): with the identity budgets (every
 * page scored and selected) tokens and logits bit-identical to dense, the
 * selections built on the backend; with small budgets it reads subsets and
 * frees nothing. On the tiny Llama (GQA 4/2) and the tiny hybrid. */
static void quest_heads(void) {
    static run_out dense, o;
    const lethe_sparse_ops *ops = lethe_sparse_find("quest");
    char cfg[512];
    run("dense", NULL, &dense);
    snprintf(cfg, sizeof(cfg), "%s,quest_granularity=head", ops->test_configs.identity);
    run("quest", cfg, &o);
    size_t n = (size_t)NGEN * (size_t)dense.n_vocab;
    for (int r = 0; r < 2; r++) {
        CHECK_MSG(!memcmp(o.tokens[r], dense.tokens[r], sizeof(o.tokens[r])), "quest head tokens");
        CHECK_MSG(!memcmp(o.logits[r], dense.logits[r], n * sizeof(float)), "quest head logits");
    }
    CHECK(o.device_selections > 0);
    free_out(&o);
    snprintf(cfg, sizeof(cfg), "%s,quest_granularity=head", ops->test_configs.small);
    run("quest", cfg, &o);
    CHECK_EQ_INT(o.slots_used_end, dense.slots_used_end);
    CHECK(o.device_selections > 0);
    free_out(&o);
    free_out(&dense);
}

static void test_quest_heads(void) {
    quest_heads();
    g_model = TINY_HYBRID;
    g_hybrid = true;
    g_nprompt = NPROMPT_MAX;
    quest_heads();
    g_nprompt = NPROMPT;
    g_model = TINY;
    g_hybrid = false;
}

static void test_smollm2_snapkv(void) {
    static run_out dense, o;
    g_model = SMOL;
    g_tiny = false;
    run("dense", NULL, &dense);
    run("snapkv", "decode_keep_tokens=4096", &o);
    size_t n = (size_t)NGEN * (size_t)dense.n_vocab;
    for (int r = 0; r < 2; r++) {
        CHECK(!memcmp(o.tokens[r], dense.tokens[r], sizeof(o.tokens[r])));
        CHECK(!memcmp(o.logits[r], dense.logits[r], n * sizeof(float)));
    }
    free_out(&o);
    free_out(&dense);
    g_model = TINY;
    g_tiny = true;
}

int main(void) {
    /* a method defined only in this test runs through the suite like the built-ins */
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_recent_window) == LETHE_OK, "%s", lethe_last_error());
    CHECK_MSG(lethe_sparse_register_extra(&throwaway_plane_copy) == LETHE_OK, "%s", lethe_last_error());
    TEST_RUN(test_identity_and_eviction);
    TEST_RUN(test_identity_and_eviction_moe);
    TEST_RUN(test_identity_and_eviction_mla);
    TEST_RUN(test_identity_and_eviction_hybrid);
    TEST_RUN(test_pinned_every_eviction_method);
    TEST_RUN(test_quest_heads);
    TEST_RUN(test_smollm2_snapkv);
    return 0;
}

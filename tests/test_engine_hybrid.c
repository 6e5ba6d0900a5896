/* test_engine_hybrid.c - the engine on a hybrid linear-attention model
 * (tests/data/tiny-qwen3_5: 3 Gated DeltaNet layers with per-request states
 * + 1 gated attention layer) on the CPU forward, with the invariant checker
 * (KV slots and state slots) after every step.
 *
 *  - the engine's greedy continuation of the HF fixture's seq0 equals HF
 *    generate's 64 tokens (the states carried from prefill into decode);
 *  - 16 requests of 4..299 tokens alone vs together (chunked prefill with a
 *    budget of 64 and of 100, mixed steps, split prefill/decode steps): the
 *    same tokens and bit-identical logits (prefill chunks stop at multiples
 *    of LETHE_GDN_CHUNK, so the DeltaNet layers run the same segments);
 *  - a pool so small that requests are preempted and recomputed: same outputs;
 *  - padded decode batches (the CPU stand-in for CUDA-graph buckets): the
 *    scratch state slot serves the dummies, logits bit-identical;
 *  - abort mid-prefill and mid-decode: every state slot comes back;
 *  - refusals: a method with its own output projection (palu), alone or in
 *    a PREFILL+DECODE pair, a step budget below one chunk, states over the
 *    KV budget (prefix caching: test_hybrid_prefix, test_hybrid_chain);
 *    methods that combine run on the attention layer: FP8 KV, and
 *    per-layer SnapKV (prompts whose final chunk would be shorter than its
 *    window past the last multiple of 64 the budget reaches: the scheduler
 *    then cuts unaligned rather than waiting forever). The per-method suite
 *    over a hybrid shape is test_sparse_conformance. */
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#define NREQ 16
#define MAXT 64
#define MAXP 300
#define HR_MAXT MAXT
#define HR_NV 0   /* events need not carry logits */
#define HR_KEEP 8 /* the first 8 logits of every token are compared */
#include "hybrid_run.h"

typedef struct cfg {
    size_t kv_bytes;
    int32_t budget, max_seqs;
    bool split, pad, no_cache;
    const char *method, *pc_mode, *method_cfg;
} cfg;

static int mk(const cfg *c, lethe_engine **e) {
    lethe_engine_params p = hr_params();
    if (c->kv_bytes) p.kv_cache_bytes = c->kv_bytes;
    p.max_num_batched_tokens = c->budget;
    p.max_num_seqs = c->max_seqs;
    p.split_prefill_decode = c->split;
    p.pad_decode_batches = c->pad;
    if (c->method) p.sparse_method = c->method;
    if (c->method_cfg) p.sparse_config = c->method_cfg;
    if (c->pc_mode) p.prefix_cache_mode = c->pc_mode;
    p.enable_prefix_caching = !c->no_cache;
    *e = NULL;
    return lethe_engine_create(&p, e);
}

static lethe_engine *mk_ok(const cfg *c) {
    lethe_engine *e;
    CHECK_MSG(mk(c, &e) == 0, "%s", lethe_engine_last_error());
    CHECK(lethe_kv_has_states(e->pool) && lethe_kv_n_state_slots(e->pool) >= c->max_seqs);
    return e;
}

typedef struct job {
    int32_t prompt[MAXP];
    int32_t n, max_tokens;
} job;

static job g_jobs[NREQ];
static out g_alone[NREQ], g_other[NREQ];

static void make_jobs(void) {
    uint64_t rng = 53;
    for (int i = 0; i < NREQ; i++) {
        job *j = &g_jobs[i];
        j->n = 4 + (int32_t)(lethe_splitmix64(&rng) % (MAXP - 4));
        j->max_tokens = 1 + (int32_t)(lethe_splitmix64(&rng) % 40);
        for (int32_t k = 0; k < j->n; k++) j->prompt[k] = (int32_t)(lethe_splitmix64(&rng) % 256);
    }
}

/* every state slot is free but the radix cache's snapshots (prefix caching
 * is on by default: test_hybrid_prefix) */
static void all_states_free(lethe_engine *e) {
    const int32_t scratch = lethe_kv_scratch_state(e->pool) >= 0;
    lethe_pc_stats pcs;
    lethe_pcache_stats(e->pcache, &pcs);
    CHECK_EQ_INT(lethe_kv_state_n_held(e->pool), pcs.snapshots);
    CHECK_EQ_INT(lethe_kv_state_n_free(e->pool), lethe_kv_n_state_slots(e->pool) - scratch - pcs.snapshots);
    CHECK(eng_check(e) == LETHE_OK);
}

static lethe_engine_stats run_all(lethe_engine *e, out *outs) {
    memset(outs, 0, sizeof(out) * NREQ);
    for (int i = 0; i < NREQ; i++) submit(e, g_jobs[i].prompt, g_jobs[i].n, g_jobs[i].max_tokens, &outs[i]);
    drain(e);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    all_states_free(e);
    return s;
}

static void same(const out *a, const out *b, int i, const char *what) {
    CHECK(a->done && b->done);
    hr_same(a, b, i, what);
}

/* HF generate's 64 greedy tokens after seq0 (tests/data/hf-ref/tiny-qwen3_5.bin,
 * read here by name without the full reader: the arrays are in a fixed order) */
static void test_engine_matches_hf_greedy(void) {
    char *buf;
    size_t len;
    CHECK(lethe_read_file("tests/data/hf-ref/tiny-qwen3_5.bin", &buf, &len) == LETHE_OK);
    const char *p = buf + 12, *end = buf + len;
    const int32_t *tokens = NULL, *greedy = NULL;
    int32_t n_tokens = 0, n_greedy = 0;
    while (p + 4 <= end && (!tokens || !greedy)) {
        uint32_t nl, dt, nd, shape[4], n = 1;
        memcpy(&nl, p, 4), p += 4;
        char name[64] = {0};
        memcpy(name, p, nl < 63 ? nl : 63), p += nl;
        memcpy(&dt, p, 4), memcpy(&nd, p + 4, 4), p += 8;
        for (uint32_t d = 0; d < nd; d++) memcpy(&shape[d], p, 4), p += 4, n *= shape[d];
        int32_t *copy = lethe_xmalloc(n * 4);
        memcpy(copy, p, n * 4), p += n * 4;
        if (!strcmp(name, "seq0.tokens")) tokens = copy, n_tokens = (int32_t)n;
        else if (!strcmp(name, "greedy")) greedy = copy, n_greedy = (int32_t)n;
        else free(copy);
    }
    CHECK(tokens && greedy && n_greedy == MAXT);
    cfg c = {.budget = 64, .max_seqs = 4};
    lethe_engine *e = mk_ok(&c);
    static out o;
    memset(&o, 0, sizeof(o));
    submit(e, tokens, n_tokens, n_greedy, &o);
    drain(e);
    CHECK(o.done && o.n == n_greedy);
    for (int32_t i = 0; i < n_greedy; i++)
        CHECK_MSG(o.tokens[i] == greedy[i], "engine greedy token %d is %d, HF %d", i, o.tokens[i], greedy[i]);
    fprintf(stderr, "    engine: %d greedy tokens identical to HF generate\n", n_greedy);
    all_states_free(e);
    lethe_engine_destroy(e);
    free((void *)tokens), free((void *)greedy), free(buf);
}

static void test_alone_vs_batch(void) {
    make_jobs();
    cfg alone = {.budget = 2048, .max_seqs = 1};
    lethe_engine *e = mk_ok(&alone);
    memset(g_alone, 0, sizeof(g_alone));
    for (int i = 0; i < NREQ; i++) {
        submit(e, g_jobs[i].prompt, g_jobs[i].n, g_jobs[i].max_tokens, &g_alone[i]);
        drain(e);
    }
    all_states_free(e);
    lethe_engine_destroy(e);
    const cfg others[] = {{.budget = 64, .max_seqs = 16}, {.budget = 100, .max_seqs = 16},
                          {.budget = 160, .max_seqs = 5, .split = true}};
    const char *names[] = {"budget 64", "budget 100", "split steps"};
    for (size_t k = 0; k < LETHE_ARRAY_LEN(others); k++) {
        e = mk_ok(&others[k]);
        lethe_engine_stats s = run_all(e, g_other);
        for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_other[i], i, names[k]);
        CHECK_EQ_INT(s.n_requests_finished, NREQ);
        fprintf(stderr, "    %s: %d requests, %lld steps, identical to alone\n", names[k], NREQ,
                (long long)s.n_steps);
        lethe_engine_destroy(e);
    }
}

static void test_preemption_same_output(void) {
    /* one attention layer of 2 KV heads x 32 f32 K and V: 512 bytes per token; the
     * states of 16 requests come off the budget first */
    lethe_engine *probe = mk_ok(&(cfg){.budget = 256, .max_seqs = 16, .no_cache = true});
    const size_t states = eng_state_bytes(probe, probe->n_state_slots);
    lethe_engine_destroy(probe);
    /* prefix caching off: its snapshots would take a share of the budget too */
    cfg small = {.kv_bytes = states + 700 * 512, .budget = 256, .max_seqs = 16, .no_cache = true};
    lethe_engine *e = mk_ok(&small);
    CHECK_EQ_INT(lethe_kv_n_slots(e->pool), 700);
    lethe_engine_stats s = run_all(e, g_other);
    CHECK(s.n_preemptions > 0);
    for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_other[i], i, "preempted");
    fprintf(stderr, "    small pool: %lld preemptions, same outputs, every state slot back\n",
            (long long)s.n_preemptions);
    lethe_engine_destroy(e);
}

static void test_padded_decode(void) {
    cfg pad = {.budget = 128, .max_seqs = 13, .pad = true};
    lethe_engine *e = mk_ok(&pad);
    CHECK(lethe_kv_scratch_state(e->pool) >= 0);
    lethe_engine_stats s = run_all(e, g_other);
    CHECK(s.padded_seqs > 0);
    for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_other[i], i, "padded");
    fprintf(stderr, "    padded decode: %lld dummy sequences, logits bit-identical\n", (long long)s.padded_seqs);
    lethe_engine_destroy(e);
}

static void test_abort_releases_states(void) {
    cfg c = {.budget = 64, .max_seqs = 8};
    lethe_engine *e = mk_ok(&c);
    static out o[NREQ];
    memset(o, 0, sizeof(o));
    uint64_t ids[NREQ];
    for (int i = 0; i < 8; i++) ids[i] = submit(e, g_jobs[i].prompt, g_jobs[i].n, 40, &o[i]);
    for (int k = 0; k < 3; k++) CHECK(lethe_engine_step(e) == 0);
    CHECK(lethe_kv_state_n_free(e->pool) < lethe_kv_n_state_slots(e->pool));
    for (int i = 0; i < 8; i += 2) CHECK(lethe_engine_abort(e, ids[i]) == 0); /* mid-prefill or decode */
    CHECK(eng_check(e) == LETHE_OK);
    for (int k = 0; k < 12; k++) CHECK(lethe_engine_step(e) == 0);
    for (int i = 1; i < 8; i += 2) CHECK(lethe_engine_abort(e, ids[i]) == 0);
    drain(e);
    all_states_free(e);
    for (int i = 0; i < 8; i++) CHECK(o[i].done && o[i].why == LETHE_FINISH_ABORT);
    lethe_engine_destroy(e);
}

static void test_refusals(void) {
    lethe_engine *e;
    CHECK(mk(&(cfg){.budget = 64, .max_seqs = 4, .method = "palu", .method_cfg = "palu_factors=@identity"}, &e) != 0);
    CHECK_MSG(strstr(lethe_engine_last_error(), "cannot use method palu") &&
                  strstr(lethe_engine_last_error(), "output gate"),
              "%s", lethe_engine_last_error());
    /* either method of a pair: palu as the decode method is refused for the model, not for the pair */
    const char *pairs[] = {"flashprefill+palu", "omnikv_prefill+palu"};
    for (int i = 0; i < 2; i++) {
        CHECK(mk(&(cfg){.budget = 64, .max_seqs = 4, .method = pairs[i], .method_cfg = "palu_factors=@identity"},
                 &e) != 0);
        CHECK_MSG(strstr(lethe_engine_last_error(), "cannot use method ") &&
                      strstr(lethe_engine_last_error(), pairs[i]) &&
                      strstr(lethe_engine_last_error(), ": palu: it folds") &&
                      strstr(lethe_engine_last_error(), "output gate"),
                  "%s", lethe_engine_last_error());
    }
    CHECK(mk(&(cfg){.budget = 32, .max_seqs = 4}, &e) != 0);
    CHECK_MSG(strstr(lethe_engine_last_error(), "needs at least 64"), "%s", lethe_engine_last_error());
    CHECK(mk(&(cfg){.kv_bytes = 4096, .budget = 64, .max_seqs = 4}, &e) != 0);
    CHECK_MSG(strstr(lethe_engine_last_error(), "recurrent states"), "%s", lethe_engine_last_error());
    /* methods that combine run on the attention layer: FP8 KV there, states as always */
    e = mk_ok(&(cfg){.budget = 64, .max_seqs = 16, .method = "fp8_kv"});
    lethe_engine_stats s = run_all(e, g_other);
    CHECK_EQ_INT(s.n_requests_finished, NREQ);
    int agree = 0, total = 0;
    for (int i = 0; i < NREQ; i++)
        for (int32_t t = 0; t < g_other[i].n; t++, total++) agree += g_other[i].tokens[t] == g_alone[i].tokens[t];
    fprintf(stderr, "    fp8_kv on the attention layer: %d/%d greedy tokens as dense\n", agree, total);
    CHECK(agree * 10 >= total * 5);
    lethe_engine_destroy(e);
    /* per-layer rows on the one attention layer: SnapKV at a budget the prompts exceed */
    e = mk_ok(&(cfg){.budget = 64, .max_seqs = 16, .method = "snapkv",
                     .method_cfg = "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24"});
    CHECK(lethe_kv_per_layer(e->pool) && lethe_kv_n_layers(e->pool) == 1);
    s = run_all(e, g_other);
    CHECK_EQ_INT(s.n_requests_finished, NREQ);
    lethe_engine_destroy(e);
}

int main(void) {
    TEST_RUN(test_engine_matches_hf_greedy);
    TEST_RUN(test_alone_vs_batch);
    TEST_RUN(test_preemption_same_output);
    TEST_RUN(test_padded_decode);
    TEST_RUN(test_abort_releases_states);
    TEST_RUN(test_refusals);
    fprintf(stderr, "test_engine_hybrid: ok\n");
    return 0;
}

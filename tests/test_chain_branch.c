/* test_chain_branch.c - chains that branch from a shared prefix (the Chain
 * Cache's shared-prefix tree, src/cache/chain_cache.c), on SmolLM2-135M.
 *
 *  1. For every eviction method that runs in chain mode: two chains share a
 *     64-token prefix. The second attaches it (cached_tokens = 64, prefill
 *     of its private part only), and its logits on two turns are
 *     bit-identical to the same chain on a cold engine (where it computes the
 *     prefix itself); every layer of its compacted row still holds the whole
 *     prefix (the method compacted only the private part); the prefix's
 *     slots exist once (the chain's resident count leaves them out, the
 *     table counts one shared prefix); the ownership checker, which counts
 *     the shared blocks' slot references and the request references chains
 *     hold on them, runs after every step.
 *  2. The shared blocks outlive the chain that computed them only while a
 *     chain holds them: an abandoned chain drops its references, the blocks
 *     become reclaimable; a recreated chain and a chain with a different
 *     prefix do not share.
 *  3. Bad values: share_prefix_tokens < 0 is refused; a share longer than
 *     the prompt is cut to the last whole block before the last token. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GEN 4
#include "engine_run.h"

#define SHARE 64
#define MAXV 49152

static lethe_engine *mk(const char *method, const char *config) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = MODEL;
    p.n_threads = 1;
    p.max_model_len = 1024;
    p.max_num_seqs = 4;
    p.max_num_batched_tokens = 512;
    p.kv_cache_bytes = (size_t)48 << 20;
    p.sparse_method = method;
    p.sparse_config = config;
    p.prefix_cache_mode = "chain";
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK_MSG(st == 0, "%s: %s", method, lethe_engine_last_error());
    return e;
}

/* the second chain's two turns, on engine e (optionally after a first chain) */
typedef struct branch_out {
    result t1, t2;
    int32_t resident_tokens; /* the chain's private resident entries after turn 1 */
} branch_out;

static void second_chain(lethe_engine *e, const int32_t *prompt, int32_t n, const int32_t *app, int32_t n_app,
                         branch_out *o) {
    lethe_chain_result cr;
    CHECK(turn(e, NULL, prompt, n, false, SHARE, &o->t1, &cr) == 0);
    CHECK_EQ_INT(cr.shared_tokens, SHARE);
    char id[48];
    snprintf(id, sizeof(id), "%s", cr.chain_id);
    /* every layer holds the whole shared prefix: compaction touched only the private part */
    for (int32_t l = 0; l < lethe_kv_n_layers(e->pool); l++) {
        int32_t pos[1024];
        int32_t np = lethe_engine_chain_positions(e, id, l, pos, 1024);
        CHECK(np >= SHARE);
        for (int32_t i = 0; i < SHARE; i++) CHECK_EQ_INT(pos[i], i);
    }
    lethe_chain_summary cs[4];
    int32_t nc = lethe_engine_list_chains(e, cs, 4);
    CHECK(nc >= 1);
    CHECK(!strcmp(cs[0].chain_id, id) && cs[0].shared_tokens == SHARE);
    o->resident_tokens = cs[0].resident_tokens;
    CHECK(turn(e, id, app, n_app, true, 0, &o->t2, &cr) == 0);
    CHECK(!strcmp(cr.status, "resumed"));
}

static void test_branch_equals_cold(const char *method, const char *config) {
    const int32_t np = 112, n_app = 24;
    int32_t a[112], b[112], app[24];
    fill(a, np, 7);
    memcpy(b, a, SHARE * sizeof(int32_t)); /* the shared prefix */
    fill(b + SHARE, np - SHARE, 8);
    fill(app, n_app, 9);
    lethe_engine *hot = mk(method, config), *cold = mk(method, config);
    const int32_t nv = lethe_engine_vocab_size(hot);
    CHECK(nv <= MAXV);
    branch_out *h = lethe_xcalloc(1, sizeof(*h)), *c = lethe_xcalloc(1, sizeof(*c));
    result first = {.logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), .nv = nv};
    result *rs[] = {&h->t1, &h->t2, &c->t1, &c->t2};
    for (int i = 0; i < 4; i++) rs[i]->logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), rs[i]->nv = nv;
    /* hot: chain A computes and publishes the prefix, chain B attaches it */
    lethe_chain_result cr;
    CHECK(turn(hot, NULL, a, np, false, SHARE, &first, &cr) == 0);
    CHECK_EQ_INT(first.cached, 0);
    lethe_engine_stats s0;
    lethe_engine_get_stats(hot, &s0);
    second_chain(hot, b, np, app, n_app, h);
    CHECK_EQ_INT(h->t1.cached, SHARE);
    lethe_engine_stats s1;
    lethe_engine_get_stats(hot, &s1);
    /* B's first turn prefilled only its private part; its second turn the appended tokens */
    CHECK_EQ_INT((int)(s1.prefill_tokens_computed - s0.prefill_tokens_computed),
                 (np - SHARE) + (n_app + 1));
    lethe_engine_chain_stats st;
    lethe_engine_get_chain_stats(hot, &st);
    CHECK_EQ_INT(st.n_branched, 2);
    CHECK_EQ_INT(st.n_shared_prefixes, 1);
    CHECK_EQ_INT(st.shared_blocks, SHARE / 16);
    CHECK(st.shared_hit_tokens >= SHARE);
    /* cold: the same chain computes the prefix itself */
    second_chain(cold, b, np, app, n_app, c);
    CHECK_EQ_INT(c->t1.cached, 0);
    CHECK_EQ_INT(h->resident_tokens, c->resident_tokens);
    CHECK(h->resident_tokens >= 1);
    CHECK(memcmp(h->t1.tokens, c->t1.tokens, sizeof(h->t1.tokens)) == 0);
    CHECK(memcmp(h->t2.tokens, c->t2.tokens, sizeof(h->t2.tokens)) == 0);
    CHECK_MSG(memcmp(h->t1.logits, c->t1.logits, (size_t)GEN * nv * sizeof(float)) == 0,
              "%s: turn 1 logits differ from the cold run", method);
    CHECK_MSG(memcmp(h->t2.logits, c->t2.logits, (size_t)GEN * nv * sizeof(float)) == 0,
              "%s: turn 2 logits differ from the cold run", method);
    CHECK(eng_check(hot) == LETHE_OK && eng_check(cold) == LETHE_OK);
    fprintf(stderr, "    %s: branch == cold (2 turns, %d private resident entries)\n", method,
            h->resident_tokens);
    for (int i = 0; i < 4; i++) free(rs[i]->logits);
    free(first.logits);
    free(h);
    free(c);
    lethe_engine_destroy(hot);
    lethe_engine_destroy(cold);
}

/* references: an abandoned turn drops them, the blocks become reclaimable */
static void test_refs_and_errors(void) {
    lethe_engine *e = mk("snapkv", "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24,snapkv_window_size=8");
    const int32_t nv = lethe_engine_vocab_size(e);
    result r = {.logits = lethe_xcalloc((size_t)GEN * nv, sizeof(float)), .nv = nv};
    int32_t a[100], b[100];
    fill(a, 100, 11);
    fill(b, 100, 12); /* another prefix */
    lethe_chain_result cr;
    CHECK(turn(e, NULL, a, 100, false, SHARE, &r, &cr) == 0);
    int64_t reclaim0 = lethe_pcache_reclaimable(e->pcache);
    CHECK_EQ_INT((int)reclaim0, 0); /* held by the IDLE chain */
    /* a different prefix: its own blocks, nothing attached */
    CHECK(turn(e, NULL, b, 100, false, SHARE, &r, &cr) == 0);
    CHECK_EQ_INT(r.cached, 0);
    lethe_engine_chain_stats st;
    lethe_engine_get_chain_stats(e, &st);
    CHECK_EQ_INT(st.n_shared_prefixes, 2);
    CHECK_EQ_INT(st.shared_blocks, 2 * SHARE / 16);
    /* the chain on a is aborted mid-turn: its references go with it */
    char id[48];
    snprintf(id, sizeof(id), "%s", cr.chain_id);
    lethe_request_params rp = {.prompt = a, .n_prompt = 100, .cb = on_event, .user = &r};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.max_tokens = GEN;
    lethe_chain_params cp = {.chain_id = id, .share_prefix_tokens = SHARE};
    uint64_t rid = 0;
    r.n = 0;
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, &rid) == 0);
    CHECK(!strcmp(cr.status, "recreated"));
    CHECK(lethe_engine_step(e) == 0);
    CHECK(lethe_engine_abort(e, rid) == 0);
    run_all(e);
    CHECK(eng_check(e) == LETHE_OK);
    lethe_engine_get_chain_stats(e, &st);
    CHECK_EQ_INT(st.n_shared_prefixes, 1);
    /* b's four blocks are held by nobody now: reclaimable, evicted under pressure */
    CHECK_EQ_INT((int)lethe_pcache_reclaimable(e->pcache), SHARE);
    /* bad values */
    cp = (lethe_chain_params){.share_prefix_tokens = -1};
    CHECK(lethe_engine_add_request_chain(e, &rp, &cp, &cr, NULL) != 0);
    CHECK_EQ_INT(cr.code, LETHE_CHAIN_INVALID_REQUEST);
    CHECK_STR_CONTAINS(cr.message, "share_prefix_tokens");
    /* longer than the prompt: cut to whole blocks before the last token */
    CHECK(turn(e, NULL, a, 40, false, 1000, &r, &cr) == 0);
    CHECK_EQ_INT(cr.shared_tokens, 32);
    CHECK_EQ_INT(r.cached, 32); /* a's first two blocks are still cached */
    free(r.logits);
    lethe_engine_destroy(e);
}

int main(void) {
    if (no_model("test_chain_branch")) return 0;
    const char *small = "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24";
    char cfg[256];
    test_refs_and_errors();
    snprintf(cfg, sizeof(cfg), "%s,snapkv_window_size=8", small);
    test_branch_equals_cold("snapkv", cfg);
    test_branch_equals_cold("streamingllm", small);
    test_branch_equals_cold("h2o", small);
    snprintf(cfg, sizeof(cfg), "%s,snapkv_window_size=8", small);
    test_branch_equals_cold("pyramidkv", cfg);
    printf("test_chain_branch: ok\n");
    return 0;
}

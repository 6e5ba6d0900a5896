/* test_cuda_hybrid_prefix.c - prefix hits from state snapshots on the CUDA
 * backend (tests/data/tiny-qwen3_5: 3 Gated DeltaNet layers + 1 gated
 * attention layer; the CPU twin of every case is tests/test_hybrid_prefix.c).
 *
 * The snapshots are state slots copied on the device (ops->state_copy,
 * stream-ordered after the step that ends at the snapshot point), and a hit
 * copies one back into the request's slot before its first chunk. The
 * comparator is a cold run (prefix caching off) of the same prompt with the
 * same chunking: both engines take steps of 64 tokens, so the hit's chunks
 * [192, 256), [256, 300) are the cold run's last two, and every matmul sees
 * the same row counts (cuBLAS may pick another kernel for another row count,
 * so a cold run in other chunks may differ in the last bits on CUDA).
 *
 *  - a prompt extending a cached one by 100 tokens: hit of 192 tokens (its
 *    deepest snapshot), 8 greedy tokens with bit-identical logits;
 *  - a prompt that shares 180 tokens with the cached one, snapshots every
 *    128: resumes from 128, bit-identical;
 *  - a chain (--prefix-cache-mode chain) whose first turn of 128 tokens
 *    generates one token keeps its row and the states it owns; its second
 *    turn continues from 128 and equals the cold run of its full prompt;
 *    again with the host tier and no idle-state budget: the finished first
 *    turn is demoted with its row's states (device -> host) and the second
 *    turn restores them (host -> device), equal to the same cold run;
 *  - the host tier (--host-cache-bytes): every block of the cached prompt
 *    evicted to host memory, its snapshots with it (device -> host through
 *    rows_to_host); the hits at 192 and, after another eviction, at 128
 *    restore KV and snapshot (rows_from_host) and are bit-identical to cold;
 *  - the invariant checker after every step (the held state slots are the
 *    snapshots the cache lists; every host blob's size matches its snapshot
 *    flag) and no state slot held but theirs at the end. */
#include <stdio.h>
#include <string.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#define NV 256
#define MAXT 8
#define HR_MAXT MAXT
#define HR_NV NV
#include "hybrid_run.h"

static size_t g_host_bytes, g_snap_bytes; /* --host-cache-bytes, --state-snapshot-bytes of the next engine */

static lethe_engine *mk_mode(bool cache, int32_t every, const char *mode) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY;
    p.device = "cuda";
    p.kv_cache_bytes = 64u << 20;
    p.max_num_batched_tokens = 64;
    p.max_num_seqs = 4;
    p.enable_prefix_caching = cache;
    p.state_snapshot_interval = every;
    if (mode) p.prefix_cache_mode = mode;
    p.host_cache_bytes = g_host_bytes;
    p.state_snapshot_bytes = g_snap_bytes;
    p.check_invariants = true;
    p.max_model_len = 512;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    return e;
}

static lethe_engine *mk(bool cache, int32_t every) { return mk_mode(cache, every, NULL); }

/* one request (chain: a chain turn, id NULL creates; the id comes back in cr) */
static void run_req(lethe_engine *e, const int32_t *prompt, int32_t n, int32_t max_tokens,
                    const lethe_chain_params *chain, lethe_chain_result *cr, out *o) {
    lethe_request_params rp = hr_greedy(prompt, n, max_tokens, o);
    uint64_t id;
    if (chain)
        CHECK_MSG(lethe_engine_add_request_chain(e, &rp, chain, cr, &id) == 0, "%s", lethe_engine_last_error());
    else
        CHECK_MSG(lethe_engine_add_request(e, &rp, &id) == 0, "%s", lethe_engine_last_error());
    drain(e);
    CHECK(o->done && o->n == max_tokens);
}

static void run1(lethe_engine *e, const int32_t *prompt, int32_t n, out *o) {
    run_req(e, prompt, n, MAXT, NULL, NULL, o);
}

static void same(const out *a, const out *b, const char *what) {
    CHECK(a->n == b->n);
    for (int32_t t = 0; t < a->n; t++) {
        CHECK_MSG(a->tokens[t] == b->tokens[t], "%s token %d: %d vs %d", what, t, a->tokens[t], b->tokens[t]);
        float worst = 0;
        for (int v = 0; v < NV; v++) worst = LETHE_MAX(worst, fabsf(a->logits[t][v] - b->logits[t][v]));
        CHECK_MSG(!memcmp(a->logits[t], b->logits[t], sizeof(a->logits[t])),
                  "%s token %d: logits differ (max abs %g)", what, t, (double)worst);
    }
}

static void only_snapshots_held(lethe_engine *e) {
    lethe_pc_stats s;
    lethe_pcache_stats(e->pcache, &s);
    CHECK_EQ_INT(lethe_kv_state_n_held(e->pool), s.snapshots);
    CHECK(eng_check(e) == LETHE_OK);
}

static int32_t g_a[400], g_b[400], g_b180[300];

static void test_hits(void) {
    uint64_t rng = 77;
    for (int k = 0; k < 400; k++) g_a[k] = (int32_t)(lethe_splitmix64(&rng) % NV);
    memcpy(g_b, g_a, 200 * sizeof(int32_t));
    for (int k = 200; k < 400; k++) g_b[k] = (int32_t)(lethe_splitmix64(&rng) % NV);
    memcpy(g_b180, g_a, 180 * sizeof(int32_t));
    memcpy(g_b180 + 180, g_b + 200, 120 * sizeof(int32_t));
    static out cold_a, cold_b, cold_b180, o;
    lethe_engine *e = mk(false, 0);
    run1(e, g_a, 250, &cold_a);
    run1(e, g_b, 300, &cold_b);
    run1(e, g_b180, 300, &cold_b180);
    lethe_engine_destroy(e);

    e = mk(true, 64);
    run1(e, g_a, 250, &o); /* snapshots at 64, 128, 192 */
    same(&o, &cold_a, "the snapshotting run");
    run1(e, g_b, 300, &o);
    CHECK_EQ_INT(o.cached, 192);
    same(&o, &cold_b, "hit at 192");
    only_snapshots_held(e);
    lethe_engine_destroy(e);
    fprintf(stderr, "    cuda: hit of 192 tokens from a device snapshot, logits bit-identical to cold\n");

    e = mk(true, 128);
    run1(e, g_a, 250, &o); /* snapshots at 128 and 192 */
    run1(e, g_b180, 300, &o); /* 176 tokens match: resumes from 128 */
    CHECK_EQ_INT(o.cached, 128);
    same(&o, &cold_b180, "hit between snapshots");
    only_snapshots_held(e);
    lethe_engine_destroy(e);
    fprintf(stderr, "    cuda: resumed from the snapshot at 128 of a 176-token match: bit-identical\n");

    g_host_bytes = 64u << 20;
    e = mk(true, 64);
    g_host_bytes = 0;
    run1(e, g_a, 250, &o); /* snapshots at 64, 128, 192 */
    lethe_pcache_evict(e->pcache, INT32_MAX); /* every block and its snapshot to the host */
    lethe_pc_stats s;
    lethe_pcache_stats(e->pcache, &s);
    CHECK(s.snapshots == 0 && s.snapshots_demoted == 3);
    only_snapshots_held(e);
    run1(e, g_b, 300, &o); /* 12 demoted blocks promoted up to the snapshot at 192 */
    CHECK_EQ_INT(o.cached, 192);
    same(&o, &cold_b, "hit at 192 from the host tier");
    lethe_pcache_stats(e->pcache, &s);
    CHECK(s.snapshots_restored == 3 && s.host_promoted == 12);
    only_snapshots_held(e);
    lethe_pcache_evict(e->pcache, INT32_MAX);
    run1(e, g_b180, 300, &o); /* 11 demoted blocks match: promoted up to the snapshot at 128 */
    CHECK_EQ_INT(o.cached, 128);
    same(&o, &cold_b180, "hit at 128 from the host tier");
    only_snapshots_held(e);
    lethe_engine_destroy(e);
    fprintf(stderr, "    cuda: hits at 192 and 128 from blocks and snapshots demoted to the host tier: "
                    "bit-identical to cold\n");
}

static void chain_round(bool host) {
    static int32_t p2[300];
    static out o, cold;
    lethe_chain_result cr;
    lethe_chain_params cp = {0};
    g_host_bytes = host ? 64u << 20 : 0;
    g_snap_bytes = host ? 1 : 0; /* no idle chain keeps its row: the first turn goes to the host */
    lethe_engine *e = mk_mode(true, 0, "chain");
    g_host_bytes = g_snap_bytes = 0;
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), "chain"));
    run_req(e, g_a, 128, 1, &cp, &cr, &o); /* boundary 128: prefill states only */
    memcpy(p2, g_a, 128 * sizeof(int32_t));
    p2[128] = o.tokens[0];
    memcpy(p2 + 129, g_b + 200, 100 * sizeof(int32_t));
    char id[48];
    snprintf(id, sizeof(id), "%s", cr.chain_id);
    cp.chain_id = id;
    run_req(e, p2, 229, MAXT, &cp, &cr, &o);
    CHECK(!strcmp(cr.status, "resumed") && cr.reused_tokens == 128);
    CHECK(eng_check(e) == LETHE_OK && lethe_kv_state_n_held(e->pool) == 0);
    if (host) {
        lethe_engine_chain_stats cs;
        lethe_engine_get_chain_stats(e, &cs);
        CHECK(cs.n_demoted == 2 && cs.n_restored == 1); /* turn 1, restored; turn 2 */
    }
    lethe_engine_destroy(e);
    e = mk(false, 0);
    run1(e, p2, 229, &cold);
    lethe_engine_destroy(e);
    same(&o, &cold, "chain turn 2");
    fprintf(stderr, "    cuda: chain turn continued from its states at 128%s: bit-identical to cold\n",
            host ? " restored from the host tier" : "");
}

static void test_chain(void) {
    chain_round(false);
    chain_round(true);
}

int main(void) {
    TEST_RUN(test_hits);
    TEST_RUN(test_chain);
    fprintf(stderr, "test_cuda_hybrid_prefix: ok\n");
    return 0;
}

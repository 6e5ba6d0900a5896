/* test_hybrid_prefix.c - prefix reuse on a hybrid linear-attention model
 * (tests/data/tiny-qwen3_5: 3 Gated DeltaNet layers with per-request states
 * + 1 gated attention layer) through the radix cache's state snapshots, on
 * the CPU forward, with the invariant checker (KV slots, state slots and
 * the snapshots the cache lists) after every step.
 *
 * The comparator of every hit is a cold run: the same prompt on an engine
 * with prefix caching off. Snapshot points are multiples of LETHE_GDN_CHUNK
 * inside the prompt, and the delta rule cuts its segments at those absolute
 * positions, so the cold run's arithmetic is the same whatever its chunking
 * (test_engine_hybrid shows that for budgets of 64, 100 and 2048); each
 * case below still names the cold budget it is compared with.
 *
 *  - a hit at a snapshot: cached tokens = the snapshot's position, every
 *    logit of the prompt's continuation bit-identical to the cold run, and
 *    the requests that made the snapshots identical to their cold runs too
 *    (the chunk cuts at snapshot points change nothing);
 *  - a hit between snapshots resumes from the earlier one and recomputes
 *    the rest: still identical;
 *  - warm engines with step budgets of 64 and 100 tokens against the cold
 *    budget-2048 run;
 *  - a snapshot budget of two: LRU drops the oldest, a prompt whose
 *    snapshots are gone is a miss (computed from 0, identical), the newest
 *    still hit;
 *  - 8 requests over one shared prefix in a pool small enough to preempt:
 *    identical to cold, every state slot accounted;
 *  - release: abort mid-prefill and finish leave only the snapshots held;
 *    evicting every block gives every snapshot back; a state slot held
 *    behind the cache's back is an invariant failure;
 *  - the engine's snapshot statistics (lethe_engine_stats, /metrics) move
 *    by the exact counts of each case: held, bytes, budget, taken, hits,
 *    tokens recomputed after a hit's snapshot, evicted;
 *  - the host tier (--host-cache-bytes): evicted blocks take their
 *    snapshots along (the blob carries the states), a hit on demoted blocks
 *    promotes them up to the deepest demoted snapshot and resumes there,
 *    bit-identical to cold; a small tier keeps within its bytes; the
 *    checker verifies every host blob's size against its snapshot flag;
 *    preemption with demotions under way stays identical to cold;
 *  - refusals: an interval that is not a multiple of 64, snapshots over the
 *    KV budget, pruning. */
#include <string.h>

#include "cache/host_tier.h"
#include "cache/radix.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#define NV 256
#define MAXT 8
#define MAXP 400
#define HR_MAXT MAXT
#define HR_NV NV
#include "hybrid_run.h"

typedef struct cfg {
    bool cache;
    int32_t budget, max_seqs, every, max_len;
    size_t kv_bytes, snap_bytes, host_bytes;
} cfg;

static lethe_engine *mk(const cfg *c) {
    lethe_engine_params p = hr_params();
    if (c->kv_bytes) p.kv_cache_bytes = c->kv_bytes;
    p.max_num_batched_tokens = c->budget;
    if (c->max_seqs) p.max_num_seqs = c->max_seqs;
    p.enable_prefix_caching = c->cache;
    p.state_snapshot_interval = c->every;
    p.state_snapshot_bytes = c->snap_bytes;
    p.host_cache_bytes = c->host_bytes;
    if (c->max_len) p.max_model_len = c->max_len;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    CHECK(!strcmp(lethe_engine_prefix_cache_mode(e), c->cache ? "radix" : "off"));
    return e;
}

static void run1(lethe_engine *e, const int32_t *prompt, int32_t n, out *o) {
    submit(e, prompt, n, MAXT, o);
    drain(e);
    CHECK(o->done && o->n == MAXT);
}

static void same(const out *a, const out *b, const char *what) {
    CHECK(a->done && b->done && a->n == b->n);
    hr_same(a, b, -1, what);
}

static lethe_pc_stats snap_stats(lethe_engine *e) {
    lethe_pc_stats s;
    lethe_pcache_stats(e->pcache, &s);
    return s;
}

/* the engine's published snapshot statistics are exactly these */
static void engine_snaps(lethe_engine *e, int64_t held, int64_t taken, int64_t hits, int64_t recomputed,
                         int64_t evicted) {
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    const int64_t one = (int64_t)eng_state_bytes(e, 1);
    CHECK_EQ_INT(st.state_snapshots, held);
    CHECK_EQ_INT(st.state_snapshot_bytes, held * one);
    CHECK_EQ_INT(st.state_snapshot_capacity_bytes, (int64_t)e->n_snap_slots * one);
    CHECK_EQ_INT(st.state_snapshots_taken, taken);
    CHECK_EQ_INT(st.state_snapshot_hits, hits);
    CHECK_EQ_INT(st.state_snapshot_recomputed_tokens, recomputed);
    CHECK_EQ_INT(st.state_snapshots_evicted, evicted);
}

/* every state slot not owned by a row is free, but the snapshots' */
static void only_snapshots_held(lethe_engine *e) {
    const int32_t scratch = lethe_kv_scratch_state(e->pool) >= 0;
    const int32_t n_snap = snap_stats(e).snapshots;
    CHECK_EQ_INT(lethe_kv_state_n_held(e->pool), n_snap);
    CHECK_EQ_INT(lethe_kv_state_n_free(e->pool), lethe_kv_n_state_slots(e->pool) - scratch - n_snap);
    CHECK(eng_check(e) == LETHE_OK);
}

static int32_t g_a[MAXP], g_b[MAXP], g_c[MAXP];

static void make_prompts(void) {
    uint64_t rng = 77;
    for (int32_t k = 0; k < MAXP; k++) {
        g_a[k] = (int32_t)(lethe_splitmix64(&rng) % NV);
        g_c[k] = (int32_t)(lethe_splitmix64(&rng) % NV);
    }
    /* b shares a's first 200 tokens */
    memcpy(g_b, g_a, 200 * sizeof(int32_t));
    for (int32_t k = 200; k < MAXP; k++) g_b[k] = (int32_t)(lethe_splitmix64(&rng) % NV);
}

static out g_cold_a, g_cold_b, g_cold_b180;

static void cold_runs(void) {
    lethe_engine *e = mk(&(cfg){.budget = 2048});
    run1(e, g_a, 250, &g_cold_a);
    run1(e, g_b, 300, &g_cold_b);
    /* b truncated: shares 180 tokens with a, then b's own */
    static int32_t b180[300];
    memcpy(b180, g_a, 180 * sizeof(int32_t));
    memcpy(b180 + 180, g_b + 200, 120 * sizeof(int32_t));
    run1(e, b180, 300, &g_cold_b180);
    lethe_engine_destroy(e);
}

static void test_hit_at_snapshot(void) {
    const int32_t budgets[] = {2048, 64, 100};
    for (size_t k = 0; k < LETHE_ARRAY_LEN(budgets); k++) {
        lethe_engine *e = mk(&(cfg){.cache = true, .budget = budgets[k], .every = 64});
        static out oa, ob;
        run1(e, g_a, 250, &oa); /* snapshots at 64, 128, 192 (also the last multiple of 64) */
        CHECK_EQ_INT(oa.cached, 0);
        same(&oa, &g_cold_a, "the snapshotting run");
        lethe_pc_stats s = snap_stats(e);
        CHECK_EQ_INT(s.snapshots, 3);
        CHECK_EQ_INT(s.snapshots_taken, 3);
        engine_snaps(e, 3, 3, 0, 0, 0);
        run1(e, g_b, 300, &ob); /* shares 200 tokens: 12 blocks matched, the deepest snapshot at 192 */
        CHECK_EQ_INT(ob.cached, 192);
        same(&ob, &g_cold_b, "hit at 192");
        s = snap_stats(e);
        CHECK_EQ_INT(s.snapshot_hits, 1);
        CHECK_EQ_INT(s.snapshots, 4); /* b's own at 256 (also its prompt's last multiple of 64) */
        engine_snaps(e, 4, 4, 1, 0, 0); /* 12 blocks matched, the snapshot at the last: none recomputed */
        only_snapshots_held(e);
        fprintf(stderr, "    budget %d: hit of 192 tokens from a snapshot, logits bit-identical to cold\n",
                budgets[k]);
        lethe_engine_destroy(e);
    }
}

static void test_hit_between_snapshots(void) {
    lethe_engine *e = mk(&(cfg){.cache = true, .budget = 2048, .every = 128});
    static out oa, ob;
    run1(e, g_a, 250, &oa); /* snapshots at 128 and 192 (the last multiple of 64) */
    same(&oa, &g_cold_a, "the snapshotting run");
    CHECK_EQ_INT(snap_stats(e).snapshots, 2);
    static int32_t b180[300];
    memcpy(b180, g_a, 180 * sizeof(int32_t));
    memcpy(b180 + 180, g_b + 200, 120 * sizeof(int32_t));
    run1(e, b180, 300, &ob); /* 11 blocks (176 tokens) match: resumes from 128 */
    CHECK_EQ_INT(ob.cached, 128);
    same(&ob, &g_cold_b180, "hit between snapshots");
    /* b180's own at 256 (its last multiple of 64); tokens 128 .. 176 were cached but recomputed */
    engine_snaps(e, 3, 3, 1, 176 - 128, 0);
    only_snapshots_held(e);
    fprintf(stderr, "    176 tokens matched, resumed from the snapshot at 128: bit-identical to cold\n");
    lethe_engine_destroy(e);
}

static void test_snapshot_lru(void) {
    lethe_engine *probe = mk(&(cfg){.budget = 2048});
    const size_t one = eng_state_bytes(probe, 1);
    lethe_engine_destroy(probe);
    lethe_engine *e = mk(&(cfg){.cache = true, .budget = 2048, .every = 64, .snap_bytes = 2 * one + one / 2});
    CHECK_EQ_INT(e->n_snap_slots, 2);
    static out o;
    run1(e, g_a, 250, &o); /* 3 snapshot points: the one at 64 is dropped for the one at 192 */
    same(&o, &g_cold_a, "a");
    lethe_pc_stats s = snap_stats(e);
    CHECK(s.snapshots == 2 && s.snapshots_taken == 3 && s.snapshots_evicted == 1);
    engine_snaps(e, 2, 3, 0, 0, 1);
    run1(e, g_c, 130, &o); /* c's snapshots at 64 and 128 replace a's */
    s = snap_stats(e);
    CHECK(s.snapshots == 2 && s.snapshots_evicted == 3);
    run1(e, g_b, 300, &o); /* a's snapshots are gone: a miss, computed from 0 */
    CHECK_EQ_INT(o.cached, 0);
    same(&o, &g_cold_b, "miss after LRU");
    /* b's own snapshots at 64 .. 256 took both places; b again hits its newest */
    run1(e, g_b, 300, &o);
    CHECK_EQ_INT(o.cached, 256);
    same(&o, &g_cold_b, "hit after LRU");
    /* b: 64 .. 256 four times taken, two evicted each for the other; its hit at 256 of 18
     * matched blocks (288 tokens) recomputes 32 */
    engine_snaps(e, 2, 3 + 2 + 4, 1, 288 - 256, 1 + 2 + 4);
    only_snapshots_held(e);
    fprintf(stderr, "    2 snapshots: LRU drops the oldest; a miss and a hit both bit-identical to cold\n");
    lethe_engine_destroy(e);
}

static void shared_prefix_preemption(bool host) {
    enum { N = 8, LEN = 240 };
    static int32_t prompts[N][LEN];
    static out cold[N], warm[N];
    uint64_t rng = 5;
    for (int i = 0; i < N; i++)
        for (int32_t k = 0; k < LEN; k++)
            prompts[i][k] = k < 136 ? g_c[k] : (int32_t)(lethe_splitmix64(&rng) % NV);
    lethe_engine *e = mk(&(cfg){.budget = 2048, .max_seqs = 1});
    for (int i = 0; i < N; i++) run1(e, prompts[i], LEN, &cold[i]);
    lethe_engine_destroy(e);
    /* one attention layer of 2 KV heads x 32 f32 K and V: 512 bytes a token */
    lethe_engine *probe = mk(&(cfg){.budget = 128, .max_seqs = N});
    const size_t states = eng_state_bytes(probe, probe->n_state_slots);
    const size_t one = eng_state_bytes(probe, 1);
    lethe_engine_destroy(probe);
    e = mk(&(cfg){.cache = true, .budget = 128, .max_seqs = N, .every = 64, .snap_bytes = 16 * one,
                  .kv_bytes = states + 16 * one + 300 * 512, .max_len = 256,
                  .host_bytes = host ? 64u << 20 : 0});
    for (int i = 0; i < N; i++) submit(e, prompts[i], LEN, MAXT, &warm[i]);
    drain(e);
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    int32_t hits = 0;
    for (int i = 0; i < N; i++) {
        same(&warm[i], &cold[i], "shared prefix");
        hits += warm[i].cached > 0;
    }
    CHECK_MSG(hits > 0 && st.n_preemptions > 0, "%d hits, %lld preemptions", hits, (long long)st.n_preemptions);
    only_snapshots_held(e);
    if (host) CHECK(st.host_cache_demoted_blocks > 0);
    fprintf(stderr, "    %d requests over a 136-token prefix (KV for 300 tokens%s): %d hits, %lld preemptions, "
            "%lld blocks demoted, %lld promoted, identical to cold\n", N, host ? ", host tier" : "", hits,
            (long long)st.n_preemptions, (long long)st.host_cache_demoted_blocks,
            (long long)st.host_cache_promoted_blocks);
    lethe_engine_destroy(e);
}

static void test_shared_prefix_preemption(void) {
    shared_prefix_preemption(false);
    shared_prefix_preemption(true);
}

/* the largest blob of the host tier (a block with its snapshot) */
static uint64_t largest_host_blob(lethe_host_tier *t, size_t *n) {
    uint64_t keys[256], best = 0;
    const int64_t nk = lethe_host_tier_keys(t, LETHE_HOST_TIER_RADIX, keys, 256);
    *n = 0;
    for (int64_t i = 0; i < LETHE_MIN(nk, 256); i++) {
        const size_t sz = lethe_host_tier_read(t, LETHE_HOST_TIER_RADIX, keys[i], NULL, 0);
        if (sz > *n) {
            *n = sz;
            best = keys[i];
        }
    }
    return best;
}

static void test_host_tier(void) {
    lethe_engine *e = mk(&(cfg){.cache = true, .budget = 2048, .every = 64, .host_bytes = 64u << 20});
    const int64_t one = (int64_t)eng_state_bytes(e, 1);
    static out o;
    run1(e, g_a, 250, &o); /* 16 blocks (250 prompt + 7 computed generated tokens), snapshots at 64, 128, 192 */
    same(&o, &g_cold_a, "a");
    lethe_pcache_evict(e->pcache, INT32_MAX); /* every block to the host, each snapshot with its block */
    lethe_pc_stats s = snap_stats(e);
    CHECK(s.snapshots == 0 && s.snapshots_demoted == 3 && s.host_demoted == 16);
    CHECK(lethe_radix_n_blocks(lethe_radix_cache_tree(e->pcache)) == 0);
    lethe_host_tier_stats hs;
    lethe_host_tier_get_stats(e->host_tier, &hs);
    CHECK(hs.entries == 16 && (int64_t)hs.used_bytes > 3 * one);
    only_snapshots_held(e);
    /* b shares 12 blocks with a: promoted up to the demoted snapshot at 192, resumed there */
    run1(e, g_b, 300, &o);
    CHECK_EQ_INT(o.cached, 192);
    same(&o, &g_cold_b, "hit on demoted blocks");
    s = snap_stats(e);
    CHECK(s.snapshots_restored == 3 && s.host_promoted == 12 && s.snapshot_hits == 1);
    engine_snaps(e, 4, 4, 1, 0, 0); /* the 3 restored and b's own at 256 */
    lethe_engine_stats es;
    lethe_engine_get_stats(e, &es);
    CHECK(es.state_snapshots_demoted == 3 && es.state_snapshots_restored == 3);
    only_snapshots_held(e);
    /* again, between snapshots: 11 host blocks match, resumed from the one at 128 */
    lethe_pcache_evict(e->pcache, INT32_MAX);
    static int32_t b180[300];
    memcpy(b180, g_a, 180 * sizeof(int32_t));
    memcpy(b180 + 180, g_b + 200, 120 * sizeof(int32_t));
    run1(e, b180, 300, &o);
    CHECK_EQ_INT(o.cached, 128);
    same(&o, &g_cold_b180, "hit between demoted snapshots");
    s = snap_stats(e);
    CHECK(s.snapshot_hits == 2 && s.snapshot_recomputed_tokens == 176 - 128);
    only_snapshots_held(e);
    /* the checker reads every host blob: one without its snapshot's bytes is caught */
    size_t n = 0;
    const uint64_t key = largest_host_blob(e->host_tier, &n);
    CHECK(n > (size_t)one);
    uint8_t *blob = lethe_host_tier_take(e->host_tier, LETHE_HOST_TIER_RADIX, key, &n);
    uint8_t *cut = lethe_xmalloc(n - (size_t)one);
    memcpy(cut, blob, n - (size_t)one);
    CHECK(lethe_host_tier_put(e->host_tier, LETHE_HOST_TIER_RADIX, key, cut, n - (size_t)one));
    CHECK(eng_check(e) != LETHE_OK);
    CHECK_MSG(strstr(lethe_last_error(), "a state snapshot"), "%s", lethe_last_error());
    CHECK(lethe_host_tier_put(e->host_tier, LETHE_HOST_TIER_RADIX, key, blob, n));
    CHECK(eng_check(e) == LETHE_OK);
    fprintf(stderr, "    demoted snapshots: hits at 192 and 128 restored from the host tier, bit-identical to cold\n");
    lethe_engine_destroy(e);
    /* a tier for about 3 blocks with snapshots: it stays within its bytes (LRU across plain
     * blocks and snapshot-carrying ones); whatever it kept, a hit resumes at a snapshot, equal
     * to cold */
    const size_t cap = 3 * ((size_t)one + 16 * 512 + 256);
    e = mk(&(cfg){.cache = true, .budget = 2048, .every = 64, .host_bytes = cap});
    run1(e, g_a, 250, &o);
    lethe_pcache_evict(e->pcache, INT32_MAX);
    lethe_host_tier_get_stats(e->host_tier, &hs);
    CHECK(hs.used_bytes <= cap && hs.evictions > 0 && hs.entries > 0 && hs.entries < 16);
    only_snapshots_held(e);
    run1(e, g_b, 300, &o);
    CHECK(o.cached % 64 == 0 && o.cached <= 192);
    same(&o, &g_cold_b, "small tier");
    lethe_host_tier_get_stats(e->host_tier, &hs);
    CHECK(hs.used_bytes <= cap);
    only_snapshots_held(e);
    fprintf(stderr, "    a tier of %zu bytes: %lld blobs kept, %lld dropped (LRU); the hit resumed at %d, "
            "identical to cold\n", cap, (long long)hs.entries, (long long)hs.evictions, o.cached);
    lethe_engine_destroy(e);
}

static void test_release(void) {
    lethe_engine *e = mk(&(cfg){.cache = true, .budget = 64, .max_seqs = 4, .every = 64});
    static out o[3];
    uint64_t id = submit(e, g_a, 250, MAXT, &o[0]);
    for (int k = 0; k < 2; k++) CHECK(lethe_engine_step(e) == 0); /* 128 of 250 prompt tokens */
    CHECK_EQ_INT(snap_stats(e).snapshots, 2);
    CHECK(lethe_engine_abort(e, id) == 0); /* mid-prefill: its row's state goes, the snapshots stay */
    only_snapshots_held(e);
    CHECK(o[0].done && o[0].why == LETHE_FINISH_ABORT);
    run1(e, g_a, 250, &o[1]); /* resumes from the aborted request's snapshot at 128 */
    CHECK_EQ_INT(o[1].cached, 128);
    same(&o[1], &g_cold_a, "after abort");
    only_snapshots_held(e);
    /* a state slot held outside the cache is caught by the checker */
    const int32_t x = lethe_kv_state_take(e->pool);
    CHECK(x >= 0 && eng_check(e) != LETHE_OK);
    CHECK(strstr(lethe_last_error(), "snapshot leaked"));
    lethe_kv_state_give(e->pool, x);
    CHECK(eng_check(e) == LETHE_OK);
    /* evicting every block gives every snapshot back */
    CHECK(snap_stats(e).snapshots == 3);
    lethe_pcache_evict(e->pcache, INT32_MAX);
    CHECK_EQ_INT(lethe_radix_n_blocks(lethe_radix_cache_tree(e->pcache)), 0);
    CHECK_EQ_INT(snap_stats(e).snapshots, 0);
    only_snapshots_held(e);
    run1(e, g_a, 250, &o[2]);
    CHECK_EQ_INT(o[2].cached, 0);
    same(&o[2], &g_cold_a, "after eviction");
    lethe_engine_destroy(e);
}

static void test_refusals(void) {
    lethe_engine_params p = hr_params();
    lethe_engine *e = NULL;
    p.state_snapshot_interval = 100;
    CHECK(lethe_engine_create(&p, &e) != 0);
    CHECK_MSG(strstr(lethe_engine_last_error(), "multiple of 64"), "%s", lethe_engine_last_error());
    p.state_snapshot_interval = 0;
    p.state_snapshot_bytes = (size_t)1 << 40;
    CHECK(lethe_engine_create(&p, &e) != 0);
    CHECK_MSG(strstr(lethe_engine_last_error(), "snapshots"), "%s", lethe_engine_last_error());
    /* pruning's scoring pass would need the states at the end of the cached prefix */
    e = mk(&(cfg){.cache = true, .budget = 2048, .every = 64});
    static out o;
    run1(e, g_a, 250, &o);
    const lethe_token_range rr = {0, 64};
    lethe_prune_params pp = {.tokens = g_a, .n_tokens = 250, .ranges = &rr, .n_ranges = 1, .keep_tokens = 32,
                             .policy = LETHE_PRUNE_SNAPKV_GLOBAL, .observation_tokens = 16};
    lethe_prune_result pr;
    CHECK(lethe_engine_prune(e, &pp, &pr) != 0);
    CHECK_MSG(strstr(lethe_engine_last_error(), "not available for hybrid"), "%s", lethe_engine_last_error());
    lethe_engine_destroy(e);
}

int main(void) {
    make_prompts();
    cold_runs();
    TEST_RUN(test_hit_at_snapshot);
    TEST_RUN(test_hit_between_snapshots);
    TEST_RUN(test_snapshot_lru);
    TEST_RUN(test_shared_prefix_preemption);
    TEST_RUN(test_release);
    TEST_RUN(test_host_tier);
    TEST_RUN(test_refusals);
    fprintf(stderr, "test_hybrid_prefix: ok\n");
    return 0;
}

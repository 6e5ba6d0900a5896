/* test_prefix_prune.c - prefix-cache pruning and radix control through the
 * public API, on tests/data/tiny-llama (real CPU forward, radix cache,
 * dense, invariants checked after every step and every call):
 *
 *  - every validation error names the range or number;
 *  - a committed prune: freed == width - keep, per-range records, match
 *    before/after (matched unchanged, resident smaller), the ownership
 *    checker and the radix checker pass, the next turn reuses the pruned
 *    prefix (cached tokens = matched) and publishes blocks after it;
 *  - blocked while a running request holds the blocks, completed after;
 *    failed when not cached / already pruned / not in radix mode;
 *  - threaded mode: lethe_engine_prune waits for the engine thread,
 *    lethe_engine_prune_submit calls back;
 *  - radix control: inspect, set_eviction_priority (pinned blocks survive
 *    eviction pressure and are not counted as reclaimable), delete_subtree;
 *  - retention hints: pinned tokens are recorded on the blocks and kept by
 *    pruning; prunable ranges are pruned after the request. */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "cache/radix.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#define TINY "tests/data/tiny-llama"

typedef struct out {
    int32_t tokens[128];
    int32_t n, cached;
    bool done;
} out;

static void on_event(void *user, const lethe_event *ev) {
    out *o = user;
    if (ev->n_tokens && o->n < 128) o->tokens[o->n++] = ev->token;
    o->cached = ev->cached_tokens;
    if (ev->finished) o->done = true;
}

static lethe_engine *mk(size_t kv_bytes, const char *mode) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY;
    p.kv_cache_bytes = kv_bytes;
    p.max_num_batched_tokens = 64;
    p.max_num_seqs = 4;
    p.enable_prefix_caching = true;
    p.prefix_cache_mode = mode;
    p.check_invariants = true;
    p.n_threads = 1;
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    return e;
}

static void prompt_of(int32_t *t, int32_t n, int32_t seed) {
    for (int32_t i = 0; i < n; i++) t[i] = (int32_t)((i * 37 + seed * 11 + (i * i) % 7) % 250) + 3;
}

static void submit(lethe_engine *e, const int32_t *t, int32_t n, int32_t max_tokens, out *o) {
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = max_tokens;
    rp.sampling.ignore_eos = true;
    rp.prompt = t;
    rp.n_prompt = n;
    rp.cb = on_event;
    rp.user = o;
    memset(o, 0, sizeof(*o));
    int st = lethe_engine_add_request(e, &rp, NULL);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
}

static void drain(lethe_engine *e) {
    while (lethe_engine_has_work(e)) {
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    }
}

static void check_ok(lethe_engine *e) {
    lethe_status st = eng_check(e);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_engine_last_error());
}

static lethe_prune_params params(const int32_t *t, int32_t n, const lethe_prune_range *r,
                                 int32_t nr, int32_t keep, int32_t obs) {
    return (lethe_prune_params){.tokens = t,
                                .n_tokens = n,
                                .ranges = r,
                                .n_ranges = nr,
                                .keep_tokens = keep,
                                .policy = LETHE_PRUNE_SNAPKV_GLOBAL,
                                .observation_tokens = obs};
}

static void expect_invalid(const lethe_prune_params *p, const char *needle) {
    CHECK_EQ_INT(lethe_prune_validate(p, NULL, NULL), LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), needle);
}

static void test_validation(void) {
    int32_t t[96];
    prompt_of(t, 96, 1);
    lethe_prune_range r[3];
    lethe_prune_params p;
    r[0] = (lethe_prune_range){32, 32};
    p = params(t, 96, r, 1, 0, 0);
    expect_invalid(&p, "range [32, 32) is empty");
    r[0] = (lethe_prune_range){64, 112};
    expect_invalid(&p, "range [64, 112) is outside the path's 96 tokens");
    r[0] = (lethe_prune_range){-16, 16};
    expect_invalid(&p, "range [-16, 16) is outside");
    r[0] = (lethe_prune_range){8, 32};
    expect_invalid(&p, "range [8, 32) is not aligned to the 16-token block");
    r[0] = (lethe_prune_range){16, 48};
    r[1] = (lethe_prune_range){32, 64};
    p = params(t, 96, r, 2, 0, 0);
    expect_invalid(&p, "ranges [16, 48) and [32, 64) overlap");
    r[1] = (lethe_prune_range){48, 64};
    p = params(t, 96, r, 2, 48, 0);
    expect_invalid(&p, "keep_tokens 48 must be in [0, 48)");
    p.keep_tokens = -1;
    expect_invalid(&p, "keep_tokens -1");
    p.keep_tokens = 8;
    p.observation_tokens = 24;
    expect_invalid(&p, "observation_tokens 24");
    p = params(t, 96, r, 0, 0, 0);
    expect_invalid(&p, "no ranges");
    /* adjacent ranges merge, any order */
    r[0] = (lethe_prune_range){48, 64};
    r[1] = (lethe_prune_range){16, 48};
    r[2] = (lethe_prune_range){80, 96};
    p = params(t, 96, r, 3, 10, 0);
    lethe_prune_range m[3];
    int32_t nm = 0;
    CHECK_EQ_INT(lethe_prune_validate(&p, m, &nm), LETHE_OK);
    CHECK_EQ_INT(nm, 2);
    CHECK(m[0].start == 16 && m[0].end == 64 && m[1].start == 80 && m[1].end == 96);
}

static void test_commit_and_reuse(void) {
    lethe_engine *e = mk(8 << 20, "radix");
    int32_t t[128];
    prompt_of(t, 128, 2);
    out o;
    submit(e, t, 97, 1, &o); /* 97 prompt + 1 generated: 6 full blocks cached */
    drain(e);
    lethe_prefix_match m;
    CHECK_EQ_INT(lethe_engine_prefix_match(e, t, 97, &m), LETHE_OK);
    CHECK(m.enabled && m.block_size == 16 && m.prompt_tokens == 97 && m.usable_tokens == 96);
    CHECK_EQ_INT(m.matched_tokens, 96);
    CHECK_EQ_INT(m.resident_kv_tokens, 96);
    CHECK(m.last_block_id != 0);
    lethe_engine_stats s0;
    lethe_engine_get_stats(e, &s0);

    /* [16, 48) + [64, 80), keep 24: the window [64, 80) is protected (16), 8 of [16, 48) */
    lethe_prune_range r[2] = {{16, 48}, {64, 80}};
    lethe_prune_params p = params(t, 97, r, 2, 24, 16);
    lethe_prune_result res;
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_MSG(res.status == LETHE_PRUNE_COMPLETED, "%d: %s", res.status, res.message);
    CHECK_EQ_INT(res.freed_device_slots, 48 - 24);
    CHECK(res.quality_degraded && res.prune_id != 0);
    CHECK_EQ_INT(res.n_ranges, 2);
    CHECK(res.ranges[0].start == 16 && res.ranges[0].end == 48 &&
          res.ranges[0].original_tokens == 32);
    CHECK_EQ_INT(res.ranges[0].retained_tokens, 8);
    CHECK_EQ_INT(res.ranges[1].retained_tokens, 16);
    check_ok(e);
    lethe_prefix_match m2;
    CHECK_EQ_INT(lethe_engine_prefix_match(e, t, 97, &m2), LETHE_OK);
    CHECK_EQ_INT(m2.matched_tokens, 96);          /* logical route unchanged */
    CHECK_EQ_INT(m2.resident_kv_tokens, 96 - 24); /* physical payload smaller */
    CHECK(m2.last_block_id == m.last_block_id);
    lethe_engine_stats s1;
    lethe_engine_get_stats(e, &s1);
    CHECK_EQ_INT(s0.kv_slots_resident - s1.kv_slots_resident, 24);
    CHECK_EQ_INT(s1.prune_jobs, 1);

    /* inspect: the pruned blocks carry the job id and fewer slots */
    lethe_prefix_block blocks[8];
    CHECK_EQ_INT(lethe_engine_prefix_inspect(e, t, 97, blocks, 8), 6);
    int32_t resident = 0;
    for (int i = 0; i < 6; i++) {
        CHECK_EQ_INT(blocks[i].start, 16 * i);
        resident += blocks[i].resident;
        bool in = (i >= 1 && i < 3) || i == 4;
        CHECK(in ? blocks[i].prune_id == res.prune_id : blocks[i].prune_id == 0);
        if (i > 0) CHECK(blocks[i].parent_id == blocks[i - 1].id);
    }
    CHECK_EQ_INT(resident, 72);
    CHECK_EQ_INT(blocks[4].resident, 16);
    /* the kept 8 of [16, 48) come from the scores, not from the order (ties
     * to the lower position would keep 16..23) */
    lethe_radix_block *chain[6];
    CHECK(lethe_radix_find(lethe_radix_cache_tree(e->pcache), t, 6, chain));
    lethe_radix_block_info b1, b2;
    lethe_radix_block_get_info(chain[1], &b1);
    lethe_radix_block_get_info(chain[2], &b2);
    CHECK_EQ_INT(b1.resident + b2.resident, 8);
    CHECK(b1.resident != 8 || b1.offsets[7] != 7);

    /* pruning the same blocks again fails (no recompression) */
    lethe_prune_range again = {16, 32};
    p = params(t, 97, &again, 1, 4, 16);
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_EQ_INT(res.status, LETHE_PRUNE_FAILED);
    CHECK_STR_CONTAINS(res.message, "not recompressed");

    /* the next turn attaches the pruned prefix and publishes blocks after it */
    submit(e, t, 120, 4, &o);
    while (lethe_engine_has_work(e)) {
        CHECK_EQ_INT(lethe_engine_step(e), 0);
        check_ok(e);
    }
    CHECK(o.done && o.n == 4);
    CHECK_EQ_INT(o.cached, 96);
    CHECK_EQ_INT(lethe_engine_prefix_match(e, t, 124, &m2), LETHE_OK);
    CHECK_EQ_INT(m2.matched_tokens, 112);
    CHECK_EQ_INT(m2.resident_kv_tokens, 112 - 24);

    /* kvzip_global: the reconstruction replay scores [48, 64) (no window to protect) */
    lethe_prune_range kz = {48, 64};
    p = params(t, 124, &kz, 1, 5, 0);
    p.policy = LETHE_PRUNE_KVZIP_GLOBAL;
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_MSG(res.status == LETHE_PRUNE_COMPLETED, "%s", res.message);
    CHECK_EQ_INT(res.freed_device_slots, 11);
    CHECK_EQ_INT(res.ranges[0].retained_tokens, 5);
    lethe_radix_block_info b3;
    lethe_radix_block_get_info(chain[3], &b3);
    CHECK_EQ_INT(b3.resident, 5);
    CHECK(b3.offsets[4] != 4); /* from the scores, not the order */
    check_ok(e);

    /* not cached: a path nobody computed */
    int32_t u[64];
    prompt_of(u, 64, 9);
    lethe_prune_range ur = {0, 32};
    p = params(u, 64, &ur, 1, 16, 16);
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_EQ_INT(res.status, LETHE_PRUNE_FAILED);
    CHECK_STR_CONTAINS(res.message, "cached up to token 0");
    lethe_engine_destroy(e);
}

static void test_blocked(void) {
    lethe_engine *e = mk(8 << 20, "radix");
    int32_t t[128];
    prompt_of(t, 128, 3);
    out o;
    submit(e, t, 81, 1, &o);
    drain(e);
    /* a second request on the same prefix, still running: it references the blocks */
    submit(e, t, 90, 20, &o);
    CHECK_EQ_INT(lethe_engine_step(e), 0);
    lethe_prune_range r = {16, 64};
    lethe_prune_params p = params(t, 81, &r, 1, 20, 16);
    lethe_prune_result res;
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_EQ_INT(res.status, LETHE_PRUNE_BLOCKED);
    CHECK_STR_CONTAINS(res.message, "referenced by 1 running request");
    check_ok(e);
    drain(e);
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_MSG(res.status == LETHE_PRUNE_COMPLETED, "%s", res.message);
    CHECK_EQ_INT(res.freed_device_slots, 48 - 20);
    check_ok(e);
    lethe_engine_destroy(e);

    /* chain mode: no radix tree to prune */
    e = mk(8 << 20, "chain");
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_EQ_INT(res.status, LETHE_PRUNE_FAILED);
    CHECK_STR_CONTAINS(res.message, "radix prefix cache");
    lethe_prefix_match m;
    CHECK_EQ_INT(lethe_engine_prefix_match(e, t, 81, &m), LETHE_OK);
    CHECK(!m.enabled && m.matched_tokens == 0);
    CHECK_EQ_INT(lethe_engine_prefix_inspect(e, NULL, 0, NULL, 0), -1);
    lethe_engine_destroy(e);
}

typedef struct cb_box {
    pthread_mutex_t mu;
    lethe_prune_result res;
    bool done;
} cb_box;

static void on_prune(void *user, const lethe_prune_result *r) {
    cb_box *b = user;
    pthread_mutex_lock(&b->mu);
    b->res = *r;
    b->done = true;
    pthread_mutex_unlock(&b->mu);
}

static void test_threaded(void) {
    lethe_engine *e = mk(8 << 20, "radix");
    int32_t t[128];
    prompt_of(t, 128, 4);
    out o;
    submit(e, t, 97, 1, &o);
    drain(e);
    CHECK_EQ_INT(lethe_engine_start(e), 0);
    lethe_prune_range r = {0, 32};
    lethe_prune_params p = params(t, 97, &r, 1, 16, 16);
    lethe_prune_result res;
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_MSG(res.status == LETHE_PRUNE_COMPLETED, "%s", res.message);
    CHECK_EQ_INT(res.freed_device_slots, 16);
    cb_box box = {.mu = PTHREAD_MUTEX_INITIALIZER};
    lethe_prune_range r2 = {48, 80};
    p = params(t, 97, &r2, 1, 20, 16);
    uint32_t id = 0;
    CHECK_EQ_INT(lethe_engine_prune_submit(e, &p, on_prune, &box, &id), LETHE_OK);
    CHECK(id != 0 && id != res.prune_id);
    for (int i = 0; i < 2000; i++) {
        pthread_mutex_lock(&box.mu);
        bool d = box.done;
        pthread_mutex_unlock(&box.mu);
        if (d) break;
        usleep(1000);
    }
    CHECK(box.done);
    CHECK_EQ_INT(box.res.prune_id, id);
    CHECK_MSG(box.res.status == LETHE_PRUNE_COMPLETED, "%s", box.res.message);
    CHECK_EQ_INT(box.res.freed_device_slots, 12);
    lethe_prefix_match m;
    CHECK_EQ_INT(lethe_engine_prefix_match(e, t, 97, &m), LETHE_OK);
    CHECK_EQ_INT(m.resident_kv_tokens, 96 - 16 - 12);
    /* an invalid job is refused before it is queued */
    p.keep_tokens = 32;
    CHECK_EQ_INT(lethe_engine_prune_submit(e, &p, on_prune, &box, &id), LETHE_ERR_INVALID);
    lethe_engine_stop(e);
    check_ok(e);
    lethe_engine_destroy(e);
}

static void test_control(void) {
    /* a pool of ~200 slots: two 96-token paths do not fit together with a third */
    lethe_engine *e = mk(200 * 512,
                         "radix"); /* 512 B per token: 2 layers x K,V x 2 heads x 16 x f32 */
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    int32_t a[128], b[128], c[128];
    prompt_of(a, 128, 5);
    prompt_of(b, 128, 6);
    prompt_of(c, 128, 7);
    out o;
    submit(e, a, 97, 1, &o);
    drain(e);
    int32_t n = 0;
    CHECK_EQ_INT(lethe_engine_prefix_set_priority(e, a, 97, -1, &n), LETHE_OK);
    CHECK_EQ_INT(n, 6);
    lethe_engine_get_stats(e, &s);
    lethe_radix *tree = lethe_radix_cache_tree(e->pcache);
    CHECK_EQ_INT(lethe_radix_reclaimable(tree), 0); /* pinned: not reclaimable */
    check_ok(e);
    /* pressure: b and c need the pool; a's pinned blocks stay */
    submit(e, b, 97, 1, &o);
    drain(e);
    submit(e, c, 97, 1, &o);
    while (lethe_engine_has_work(e)) {
        CHECK_EQ_INT(lethe_engine_step(e), 0);
        check_ok(e);
    }
    lethe_prefix_match m;
    CHECK_EQ_INT(lethe_engine_prefix_match(e, a, 97, &m), LETHE_OK);
    CHECK_EQ_INT(m.matched_tokens, 96);
    lethe_prefix_block blocks[8];
    CHECK_EQ_INT(lethe_engine_prefix_inspect(e, a, 97, blocks, 8), 6);
    for (int i = 0; i < 6; i++) CHECK_EQ_INT(blocks[i].priority, -1);
    /* unpin the path from block 0: every block below it loses the pin */
    CHECK_EQ_INT(lethe_engine_prefix_set_priority(e, a, 16, 0, &n), LETHE_OK);
    CHECK_EQ_INT(n, 1);
    CHECK_EQ_INT(lethe_engine_prefix_inspect(e, a, 97, blocks, 8), 6);
    for (int i = 0; i < 6; i++) CHECK_EQ_INT(blocks[i].priority, 0);
    check_ok(e);
    /* delete_subtree from block 3 of a: blocks 3..5 go */
    int32_t total = lethe_engine_prefix_inspect(e, NULL, 0, NULL, 0);
    CHECK_EQ_INT(lethe_engine_prefix_delete_subtree(e, a, 64, &n), LETHE_OK);
    CHECK_EQ_INT(n, 3);
    CHECK_EQ_INT(lethe_engine_prefix_inspect(e, NULL, 0, NULL, 0), total - 3);
    CHECK_EQ_INT(lethe_engine_prefix_match(e, a, 97, &m), LETHE_OK);
    CHECK_EQ_INT(m.matched_tokens, 48);
    check_ok(e);
    /* not cached / busy */
    CHECK_EQ_INT(lethe_engine_prefix_delete_subtree(e, a, 97, &n), LETHE_ERR_NOT_FOUND);
    submit(e, a, 60, 30, &o);
    CHECK_EQ_INT(lethe_engine_step(e), 0);
    CHECK_EQ_INT(lethe_engine_prefix_delete_subtree(e, a, 16, &n), LETHE_ERR_BUSY);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "running request");
    drain(e);
    check_ok(e);
    lethe_engine_destroy(e);
}

static void submit_hinted(lethe_engine *e, const int32_t *t, int32_t n,
                          const lethe_token_range *pin, int32_t n_pin,
                          const lethe_retention_range *pr, int32_t n_pr, out *o) {
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = 1;
    rp.prompt = t;
    rp.n_prompt = n;
    rp.cb = on_event;
    rp.user = o;
    rp.pinned = pin;
    rp.n_pinned = n_pin;
    rp.prunable = pr;
    rp.n_prunable = n_pr;
    memset(o, 0, sizeof(*o));
    int st = lethe_engine_add_request(e, &rp, NULL);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
}

/* retention hints: pinned tokens survive pruning; prunable ranges are pruned
 * after the request; bad ranges are refused */
static void test_retention(void) {
    lethe_engine *e = mk(8 << 20, "radix");
    int32_t t[128];
    prompt_of(t, 128, 8);
    out o;
    lethe_token_range bad = {90, 100};
    lethe_request_params rp = {.prompt = t, .n_prompt = 97, .pinned = &bad, .n_pinned = 1};
    lethe_sampling_default_params(&rp.sampling);
    CHECK_EQ_INT(lethe_engine_add_request(e, &rp, NULL), LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_engine_last_error(),
                       "pinned range [90, 100) is empty or outside the 97-token prompt");

    const lethe_token_range pin = {16, 32};
    submit_hinted(e, t, 97, &pin, 1, NULL, 0, &o);
    drain(e);
    lethe_radix_block *chain[6];
    CHECK(lethe_radix_find(lethe_radix_cache_tree(e->pcache), t, 6, chain));
    lethe_radix_block_info bi;
    lethe_radix_block_get_info(chain[1], &bi);
    CHECK_EQ_INT(bi.pin, 0xffff); /* block [16, 32) remembers its pins */
    lethe_radix_block_get_info(chain[2], &bi);
    CHECK_EQ_INT(bi.pin, 0);
    /* [16, 48): 16 pinned + the 16-token window are protected */
    lethe_prune_range r = {16, 48};
    lethe_prune_params p = params(t, 97, &r, 1, 20, 16);
    lethe_prune_result res;
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_EQ_INT(res.status, LETHE_PRUNE_FAILED);
    CHECK_STR_CONTAINS(res.message,
                       "below the 32 protected tokens inside the ranges (16 retention-pinned");
    lethe_prune_range r2 = {0, 48};
    p = params(t, 97, &r2, 1, 36, 16);
    CHECK_EQ_INT(lethe_engine_prune(e, &p, &res), LETHE_OK);
    CHECK_MSG(res.status == LETHE_PRUNE_COMPLETED, "%s", res.message);
    lethe_radix_block_get_info(chain[1], &bi);
    CHECK_EQ_INT(bi.resident, 16); /* every pinned token kept */
    lethe_radix_block_info b0;
    lethe_radix_block_get_info(chain[0], &b0);
    CHECK_EQ_INT(b0.resident, 4); /* the 4 unprotected tokens of the budget went to block 0 */
    check_ok(e);

    /* prunable: pruned to the ratio once the request is done (a queued job) */
    int32_t u[128];
    prompt_of(u, 128, 11);
    const lethe_retention_range pr = {16, 80, 0.25f};
    submit_hinted(e, u, 97, NULL, 0, &pr, 1, &o);
    drain(e); /* the request, then the step that runs the job */
    lethe_prefix_match m;
    CHECK_EQ_INT(lethe_engine_prefix_match(e, u, 97, &m), LETHE_OK);
    CHECK_EQ_INT(m.matched_tokens, 96);
    CHECK_EQ_INT(m.resident_kv_tokens, 96 - (64 - 16));
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.prune_jobs, 2);
    check_ok(e);
    lethe_engine_destroy(e);
}

int main(void) {
    test_validation();
    test_commit_and_reuse();
    test_blocked();
    test_threaded();
    test_control();
    test_retention();
    printf("test_prefix_prune: ok\n");
    return 0;
}

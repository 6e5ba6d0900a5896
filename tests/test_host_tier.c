/* test_host_tier.c - the host-memory tier (src/cache/host_tier.c) and the
 * prefix caches' demotion / promotion through it (radix.c, kv_host.c).
 *
 *  1. The tier alone: put / take / read / drop / keys, strict LRU eviction
 *     when a put would pass the byte cap (used bytes never exceed it), a blob
 *     larger than the cap refused, replacement under the same key, owners
 *     kept apart; the invariant check after every operation.
 *  2. Dense + radix on SmolLM2-135M with a KV cache too small for two
 *     prompts: prompt A is evicted by prompt B, demoted to the host tier, and
 *     restored on A's next request (cached tokens = its whole prefix,
 *     promoted tokens counted, fewer prompt tokens computed); the logits are
 *     bit-identical to the same request on an engine whose KV cache is large
 *     enough that A never left it, and to a cold run; the ownership checker
 *     runs after every step.
 *  3. A byte cap of a few blocks: the tier holds no more than it allows and
 *     drops least recently used blocks; a hit on what is left is still exact.
 *  4. Bad configurations are refused with a message naming the flag. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/host_tier.h"

#define GEN 3
#include "engine_run.h"

/* ---- 1. the tier alone ---- */

static void *blob_of(size_t n, uint8_t v) {
    uint8_t *b = lethe_xmalloc(n);
    memset(b, v, n);
    return b;
}

static void test_tier_unit(void) {
    lethe_host_tier *t = lethe_host_tier_create(1000);
    lethe_host_tier_stats st;
    CHECK(lethe_host_tier_put(t, 1, 10, blob_of(300, 1), 300));
    CHECK(lethe_host_tier_put(t, 1, 11, blob_of(300, 2), 300));
    CHECK(lethe_host_tier_put(t, 2, 10, blob_of(300, 3), 300)); /* another owner, same key */
    CHECK(lethe_host_tier_check(t));
    uint8_t buf[400];
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 1, 10, buf, sizeof(buf)), 300);
    CHECK(buf[0] == 1 && buf[299] == 1);
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 2, 10, buf, 4), 300);
    CHECK(buf[0] == 3);
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 1, 99, buf, 4), 0);
    /* a fourth blob: the least recently used (owner 1 key 10) goes */
    CHECK(lethe_host_tier_put(t, 1, 12, blob_of(300, 4), 300));
    CHECK(lethe_host_tier_check(t));
    lethe_host_tier_get_stats(t, &st);
    CHECK_EQ_INT((int)st.entries, 3);
    CHECK_EQ_INT((int)st.evictions, 1);
    CHECK(st.used_bytes == 900 && st.used_bytes <= st.cap_bytes);
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 1, 10, NULL, 0), 0);
    /* take moves it out; a read does not change the order */
    size_t n = 0;
    uint8_t *b = lethe_host_tier_take(t, 1, 11, &n);
    CHECK(b && n == 300 && b[0] == 2);
    free(b);
    CHECK(lethe_host_tier_take(t, 1, 11, &n) == NULL && n == 0);
    /* replacement under the same key */
    CHECK(lethe_host_tier_put(t, 1, 12, blob_of(100, 5), 100));
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 1, 12, buf, 1), 100);
    CHECK(buf[0] == 5);
    /* too large for the cap: refused, nothing else dropped */
    CHECK(!lethe_host_tier_put(t, 1, 13, blob_of(1001, 6), 1001));
    lethe_host_tier_get_stats(t, &st);
    CHECK_EQ_INT((int)st.refused, 1);
    CHECK_EQ_INT((int)st.entries, 2);
    uint64_t keys[4];
    CHECK_EQ_INT((int)lethe_host_tier_keys(t, 1, keys, 4), 1);
    CHECK(keys[0] == 12);
    CHECK(lethe_host_tier_drop(t, 2, 10) && !lethe_host_tier_drop(t, 2, 10));
    /* many entries: the table grows, the cap holds */
    for (int i = 0; i < 5000; i++) {
        CHECK(lethe_host_tier_put(t, 3, (uint64_t)i, blob_of(7, (uint8_t)i), 7));
        lethe_host_tier_get_stats(t, &st);
        CHECK(st.used_bytes <= st.cap_bytes);
    }
    CHECK(lethe_host_tier_check(t));
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 3, 4999, buf, 1), 7); /* the newest stays */
    CHECK_EQ_INT((int)lethe_host_tier_read(t, 3, 0, buf, 1), 0);    /* the oldest went */
    lethe_host_tier_destroy(t);
}

/* ---- 2..5. through the engine ---- */

static lethe_engine *mk(const char *method, size_t kv_bytes, size_t host_bytes, bool prefix, int *status) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = MODEL;
    p.n_threads = 1;
    p.max_model_len = 320;
    p.max_num_seqs = 2;
    p.max_num_batched_tokens = 512;
    p.kv_cache_bytes = kv_bytes;
    p.host_cache_bytes = host_bytes;
    p.enable_prefix_caching = prefix;
    p.sparse_method = method;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    *status = lethe_engine_create(&p, &e);
    return e;
}

static lethe_engine *mk_ok(const char *method, size_t kv_bytes, size_t host_bytes) {
    int st;
    lethe_engine *e = mk(method, kv_bytes, host_bytes, true, &st);
    CHECK_MSG(st == 0 && e, "%s", lethe_engine_last_error());
    return e;
}

/* bytes of KV per token (all layers) of the dense engine */
static size_t token_bytes(lethe_engine *e) { return lethe_kv_space_slot_bytes(e->pool, 0); }

#define NA 300
#define NB 300

static void test_demote_promote(void) {
    int32_t a[NA], b[NB];
    fill(a, NA, 21);
    fill(b, NB, 22);
    /* sizes: the small engine holds one prompt (+ generation), not two */
    lethe_engine *probe = mk_ok("dense", (size_t)32 << 20, 0);
    const size_t tb = token_bytes(probe);
    lethe_engine_destroy(probe);
    const size_t small_kv = tb * 420, host = (size_t)64 << 20;
    lethe_engine *e = mk_ok("dense", small_kv, host), *big = mk_ok("dense", (size_t)64 << 20, 0);
    lethe_engine *cold = mk_ok("dense", (size_t)64 << 20, 0);
    CHECK(lethe_kv_n_slots(e->pool) < NA + NB);
    result r = mk_result(e), rb = mk_result(big), rc = mk_result(cold);
    run_one(e, a, NA, &r);   /* A cached */
    run_one(e, b, NB, &r);   /* B evicts A's blocks: demoted */
    lethe_engine_stats s0;
    lethe_engine_get_stats(e, &s0);
    CHECK(s0.host_cache_demoted_blocks > 0);
    CHECK(s0.host_cache_used_bytes > 0 && s0.host_cache_used_bytes <= (int64_t)host);
    CHECK_EQ_INT((int)s0.host_cache_capacity_bytes, (int)host);
    run_one(e, a, NA, &r);   /* A again: restored from the host */
    lethe_engine_stats s1;
    lethe_engine_get_stats(e, &s1);
    const int32_t usable = (NA - 1) / 16 * 16;
    CHECK_EQ_INT(r.cached, usable);
    CHECK(s1.host_cache_promoted_blocks > s0.host_cache_promoted_blocks);
    CHECK(s1.host_cache_promoted_tokens > 0);
    CHECK_EQ_INT((int)(s1.prefill_tokens_computed - s0.prefill_tokens_computed), NA - usable);
    /* reference: A stays in a big cache; cold: no hit at all */
    run_one(big, a, NA, &rb);
    run_one(big, b, NB, &rb);
    run_one(big, a, NA, &rb);
    CHECK_EQ_INT(rb.cached, usable);
    lethe_engine_stats sb;
    lethe_engine_get_stats(big, &sb);
    CHECK_EQ_INT((int)sb.host_cache_promoted_blocks, 0);
    run_one(cold, a, NA, &rc);
    CHECK(memcmp(r.tokens, rb.tokens, sizeof(r.tokens)) == 0);
    CHECK_MSG(memcmp(r.logits, rb.logits, (size_t)GEN * r.nv * sizeof(float)) == 0,
              "logits after demotion differ from a never-demoted hit");
    CHECK_MSG(memcmp(r.logits, rc.logits, (size_t)GEN * r.nv * sizeof(float)) == 0,
              "logits after demotion differ from a cold run");
    CHECK(eng_check(e) == LETHE_OK);
    fprintf(stderr, "    demote/promote: %lld blocks demoted, %lld promoted (%lld tokens), logits bit-identical\n",
            (long long)s1.host_cache_demoted_blocks, (long long)s1.host_cache_promoted_blocks,
            (long long)s1.host_cache_promoted_tokens);
    free(r.logits);
    free(rb.logits);
    free(rc.logits);
    lethe_engine_destroy(e);
    lethe_engine_destroy(big);
    lethe_engine_destroy(cold);
}

static void test_byte_cap(void) {
    int32_t a[NA], b[NB], c[NB];
    fill(a, NA, 31);
    fill(b, NB, 32);
    fill(c, NB, 33);
    lethe_engine *probe = mk_ok("dense", (size_t)32 << 20, 0);
    const size_t tb = token_bytes(probe);
    lethe_engine_destroy(probe);
    /* room for 5 demoted blocks (each: a header + 16 tokens' KV) */
    const size_t cap = 5 * (16 * tb + 256);
    lethe_engine *e = mk_ok("dense", tb * 420, cap);
    result r = mk_result(e);
    /* b evicts A's deeper blocks (the 5 demoted last stay in the tier), a
     * promotes them again; c and a once more */
    const int32_t *ps[] = {a, b, a, c, a};
    for (int i = 0; i < 5; i++) {
        run_one(e, ps[i], NA, &r);
        lethe_engine_stats s;
        lethe_engine_get_stats(e, &s);
        CHECK(s.host_cache_used_bytes <= (int64_t)cap);
        CHECK(s.host_cache_entries <= 5);
        CHECK(lethe_host_tier_check(e->host_tier));
    }
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK(s.host_cache_evicted > 0); /* LRU dropped what did not fit */
    CHECK(s.host_cache_promoted_blocks > 0);
    fprintf(stderr, "    byte cap %zu: %lld entries (%lld bytes), %lld dropped (LRU), %lld promoted\n", cap,
            (long long)s.host_cache_entries, (long long)s.host_cache_used_bytes,
            (long long)s.host_cache_evicted, (long long)s.host_cache_promoted_blocks);
    free(r.logits);
    lethe_engine_destroy(e);
}

static void test_errors(void) {
    int st;
    lethe_engine *e = mk("dense", (size_t)32 << 20, (size_t)1 << 20, false, &st);
    CHECK(st != 0 && !e);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "--host-cache-bytes needs prefix caching");
    e = mk("dense", (size_t)32 << 20, 1000, true, &st);
    CHECK(st != 0 && !e);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "smaller than one 16-token block");
    e = mk("fp8_kv", (size_t)32 << 20, (size_t)1 << 20, true, &st);
    CHECK(st != 0 && !e);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "--host-cache-bytes");
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "native");
}

int main(void) {
    test_tier_unit();
    FILE *f = fopen(MODEL, "rb");
    if (!f) {
        printf("test_host_tier: engine parts skipped (no %s)\n", MODEL);
        return 0;
    }
    fclose(f);
    test_errors();
    test_demote_promote();
    test_byte_cap();
    printf("test_host_tier: ok\n");
    return 0;
}

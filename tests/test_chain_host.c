/* test_chain_host.c - idle chains demoted to the host-memory tier and
 * restored (src/cache/chain_cache.c demote_kv / restore_kv, chain.c), on
 * SmolLM2-135M with a KV cache that holds one chain's turn but not two.
 *
 *  1. For SnapKV (compacted rows, no method state) and H2O (compacted rows
 *     and a per-request state, saved through its snapshot / restore): chain A
 *     takes a turn, chain B's turn reclaims A, which is demoted (A stays
 *     IDLE, nothing of it resident; the tier holds its blob within the byte
 *     cap). A's next turn resumes it: status resumed, only the appended
 *     tokens are prefilled, and its tokens, logits and the positions every
 *     layer's row holds are bit-identical to the same chain on an engine
 *     large enough that A never left the pool. A third chain's turn demotes
 *     B, which is restored the same way. The ownership checker runs after every step
 *     (rows held = payloads with a row; shared-block references).
 *  2. A method state without snapshot / restore (R-KV) cannot leave the pool:
 *     the reclaimed chain is lost and its next turn answers GONE (410), as
 *     without a tier.
 *  3. The tier as a second budget: with a byte cap that holds one demoted
 *     chain, demoting a second drops the first (LRU across both tiers); the
 *     first's next turn is GONE, the tier never holds more than its cap.
 *     A cap smaller than a chain's blob: the demotion is refused, GONE.
 *  4. A branching chain (shared prefix; dense rows in chain mode, whose
 *     private parts are large enough to need reclaim): its private part goes to the host,
 *     its shared blocks stay held, and after the restore the row is again
 *     [shared | private], equal to the never-demoted run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/host_tier.h"

#define GEN 4
#include "engine_run.h"

#define NA 100
#define NB 176
#define NAPP 16
#define SMALL "sink_keep_tokens=4,recent_keep_tokens=16,decode_keep_tokens=24"

static lethe_engine *mk(const char *method, const char *config, size_t kv_bytes, size_t host_bytes) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = MODEL;
    p.n_threads = 1;
    p.max_model_len = 200;
    p.max_num_seqs = 2;
    p.max_num_batched_tokens = 256;
    p.kv_cache_bytes = kv_bytes;
    p.host_cache_bytes = host_bytes;
    p.sparse_method = method;
    p.sparse_config = config;
    p.prefix_cache_mode = "chain";
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK_MSG(st == 0, "%s: %s", method, lethe_engine_last_error());
    return e;
}

/* every layer's resident positions of chain id on e and f are equal */
static void same_positions(lethe_engine *e, const char *ide, lethe_engine *f, const char *idf) {
    static int32_t pe[256], pf[256];
    for (int32_t l = 0; l < lethe_kv_n_layers(e->pool); l++) {
        int32_t ne = lethe_engine_chain_positions(e, ide, l, pe, 256);
        int32_t nf = lethe_engine_chain_positions(f, idf, l, pf, 256);
        CHECK_EQ_INT(ne, nf);
        CHECK(ne > 0 && memcmp(pe, pf, (size_t)ne * sizeof(int32_t)) == 0);
    }
}

/* KV for the longest turn alone: two chains' turns do not fit together */
static size_t small_kv(void) { return (size_t)46080 * 205; }

static int32_t a_tok[NA], b_tok[NB], a_app[NAPP], b_app[NAPP];

static void prompts(int32_t share) {
    fill(a_tok, NA, 1);
    fill(b_tok, NB, 2);
    if (share > 0) memcpy(b_tok, a_tok, (size_t)share * sizeof(int32_t));
    fill(a_app, NAPP, 3);
    fill(b_app, NAPP, 4);
}

static void test_demote_restore(const char *method, const char *config, int32_t share) {
    prompts(share);
    lethe_engine *e = mk(method, config, small_kv(), (size_t)64 << 20);
    lethe_engine *big = mk(method, config, (size_t)64 << 20, 0);
    result r = mk_result(e), rb = mk_result(big);
    lethe_chain_result cr;
    char ia[48] = "", ib[48] = "", ja[48] = "", jb[48] = "";
    /* A, then B reclaims A: demoted */
    CHECK(turn(e, ia, a_tok, NA, false, share, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(turn(big, ja, a_tok, NA, false, share, &rb, &cr) == LETHE_CHAIN_OK);
    same(&r, &rb, "turn A1");
    CHECK(turn(e, ib, b_tok, NB, false, share, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(turn(big, jb, b_tok, NB, false, share, &rb, &cr) == LETHE_CHAIN_OK);
    same(&r, &rb, "turn B1");
    lethe_engine_chain_stats st;
    lethe_engine_get_chain_stats(e, &st);
    CHECK_EQ_INT((int)st.n_demoted, 1);
    CHECK_EQ_INT(st.n_on_host, 1);
    CHECK_EQ_INT(st.n_chains, 2);
    CHECK_EQ_INT((int)lethe_engine_chain_positions(e, ia, 0, NULL, 0), 0); /* nothing resident */
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK(s.host_cache_used_bytes > 0 && s.host_cache_used_bytes <= s.host_cache_capacity_bytes);
    CHECK(lethe_host_tier_check(e->host_tier));
    /* A again: restored before its suffix, only the appended tokens computed */
    int64_t c0 = computed(e);
    CHECK(turn(e, ia, a_app, NAPP, true, 0, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(!strcmp(cr.status, "resumed"));
    CHECK_EQ_INT((int)(computed(e) - c0), NAPP + 1);
    CHECK(turn(big, ja, a_app, NAPP, true, 0, &rb, &cr) == LETHE_CHAIN_OK);
    same(&r, &rb, "turn A2 after demotion");
    same_positions(e, ia, big, ja);
    lethe_engine_get_chain_stats(e, &st);
    CHECK_EQ_INT((int)st.n_restored, 1);
    CHECK(st.restored_entries > 0);
    /* a third chain's turn sends B (least recently used) to the host; it comes back the same way */
    char ic[48] = "";
    CHECK(turn(e, ic, b_tok, NB, false, share, &r, &cr) == LETHE_CHAIN_OK);
    lethe_engine_get_chain_stats(e, &st);
    CHECK(st.n_demoted >= 2 && st.n_on_host >= 1);
    lethe_chain_code code = turn(e, ib, b_app, NAPP, true, 0, &r, &cr);
    CHECK_MSG(code == LETHE_CHAIN_OK, "turn B2: %d %s", (int)code, cr.message);
    CHECK(!strcmp(cr.status, "resumed"));
    CHECK(turn(big, jb, b_app, NAPP, true, 0, &rb, &cr) == LETHE_CHAIN_OK);
    same(&r, &rb, "turn B2 after demotion");
    same_positions(e, ib, big, jb);
    lethe_engine_get_chain_stats(e, &st);
    CHECK(st.n_restored >= 2);
    CHECK_EQ_INT((int)st.n_lost, 0);
    if (share > 0) CHECK_EQ_INT(st.n_shared_prefixes, 1);
    fprintf(stderr, "    %s%s: %lld demotions, %lld restores (%lld entries), turns == never demoted\n",
            method, share ? " (branching)" : "", (long long)st.n_demoted, (long long)st.n_restored,
            (long long)st.restored_entries);
    free(r.logits);
    free(rb.logits);
    lethe_engine_destroy(e);
    lethe_engine_destroy(big);
}

/* A reclaimed, its KV lost (demotion impossible or dropped): its next turn is GONE */
static void expect_gone(lethe_engine *e, const char *what) {
    result r = mk_result(e);
    lethe_chain_result cr;
    char ia[48] = "", ib[48] = "";
    CHECK(turn(e, ia, a_tok, NA, false, 0, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(turn(e, ib, b_tok, NB, false, 0, &r, &cr) == LETHE_CHAIN_OK);
    CHECK_MSG(turn(e, ia, a_app, NAPP, true, 0, &r, &cr) == LETHE_CHAIN_GONE, "%s", what);
    CHECK_STR_CONTAINS(cr.message, ia);
    lethe_engine_chain_stats st;
    lethe_engine_get_chain_stats(e, &st);
    CHECK(st.n_lost >= 1);
    free(r.logits);
}

static void test_lost(void) {
    prompts(0);
    /* R-KV keeps a state it cannot save */
    lethe_engine *e = mk("rkv", SMALL, small_kv(), (size_t)64 << 20);
    expect_gone(e, "rkv: a state without snapshot cannot leave the pool");
    lethe_engine_destroy(e);
    /* a cap smaller than the chain's blob (but one block): refused */
    e = mk("snapkv", SMALL ",snapkv_window_size=8", small_kv(), (size_t)46080 * 17);
    expect_gone(e, "a blob larger than the cap");
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK(s.host_cache_used_bytes <= s.host_cache_capacity_bytes);
    lethe_engine_destroy(e);
}

/* the tier holds one demoted chain: the second demotion drops the first (LRU) */
static void test_second_budget(void) {
    prompts(0);
    const char *cfg = SMALL ",snapkv_window_size=8";
    lethe_engine *probe = mk("snapkv", cfg, small_kv(), (size_t)64 << 20);
    result r = mk_result(probe);
    lethe_chain_result cr;
    char ia[48] = "", ib[48] = "", ic[48] = "";
    CHECK(turn(probe, ia, a_tok, NA, false, 0, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(turn(probe, ib, b_tok, NB, false, 0, &r, &cr) == LETHE_CHAIN_OK);
    lethe_engine_stats s;
    lethe_engine_get_stats(probe, &s);
    const size_t blob_a = (size_t)s.host_cache_used_bytes;
    CHECK(blob_a > 0);
    lethe_engine_destroy(probe);
    /* room for A's blob and a bit: C's turn demotes B (larger), which drops A */
    lethe_engine *e = mk("snapkv", cfg, small_kv(), blob_a + blob_a / 2);
    ia[0] = ib[0] = 0;
    CHECK(turn(e, ia, a_tok, NA, false, 0, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(turn(e, ib, b_tok, NB, false, 0, &r, &cr) == LETHE_CHAIN_OK);
    CHECK(turn(e, ic, b_tok, NB, false, 0, &r, &cr) == LETHE_CHAIN_OK); /* another chain, same prompt */
    lethe_engine_get_stats(e, &s);
    CHECK(s.host_cache_used_bytes <= s.host_cache_capacity_bytes);
    CHECK(s.host_cache_evicted >= 1);
    CHECK(lethe_host_tier_check(e->host_tier));
    CHECK(turn(e, ia, a_app, NAPP, true, 0, &r, &cr) == LETHE_CHAIN_GONE);
    lethe_engine_chain_stats st;
    lethe_engine_get_chain_stats(e, &st);
    CHECK(st.n_lost >= 1);
    fprintf(stderr, "    second budget: cap %zu, %lld blobs dropped (LRU), %lld chains lost\n",
            (size_t)s.host_cache_capacity_bytes, (long long)s.host_cache_evicted, (long long)st.n_lost);
    free(r.logits);
    lethe_engine_destroy(e);
}

int main(void) {
    if (no_model("test_chain_host")) return 0;
    test_demote_restore("snapkv", SMALL ",snapkv_window_size=8", 0);
    test_demote_restore("h2o", SMALL, 0);
    test_demote_restore("dense", NULL, 64); /* uncompacted rows: the private part is large */
    test_lost();
    test_second_budget();
    printf("test_chain_host: ok\n");
    return 0;
}

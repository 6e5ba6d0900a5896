/* test_prefix_cache.c - the prefix-cache seam (src/cache/prefix_cache.h):
 * both implementations, radix and chain, through the same interface calls.
 *
 *  1. Mode choice: auto picks radix for shareable KV and chain otherwise;
 *     explicit modes that cannot work fail naming the flag; off is NULL and
 *     every wrapper accepts NULL.
 *  2. A two-turn conversation driven by the scheduler with the same code for
 *     both caches: turn 2 reuses turn 1's KV (radix: the published full
 *     blocks; chain: everything up to the processed boundary), prefills only
 *     the rest, and the KV ownership checker (pool + the cache's holder +
 *     the cache's own check + rows held outside requests) passes after every
 *     step; eviction and destroy give every slot back.
 *  3. The request lifecycle by direct calls: match is read-only, acquire
 *     attaches, release PREEMPTED keeps a chain turn (which then recomputes)
 *     and drops radix references; release OK hands a chain the row and the
 *     method state, freed through the release callback at destroy; release
 *     FAILED invalidates a chain (GONE afterwards).
 *  4. Control operations: chain history; radix answers UNSUPPORTED. */
#include <string.h>

#include "cache/radix.h"
#include "core/util.h"
#include "sched/scheduler.h"
#include "test.h"

#define NSLOTS 512

static lethe_kv_pool *mk_pool(void) {
    lethe_kv_pool_params pp = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .n_slots = NSLOTS};
    lethe_kv_pool *pool = NULL;
    CHECK(lethe_kv_pool_create(&pp, &pool) == LETHE_OK);
    return pool;
}

static int g_released;
static void release_state(void *ctx, void *state) {
    CHECK(ctx == &g_released);
    CHECK(*(int *)state == 77);
    g_released++;
}

static lethe_prefix_cache *mk_cache(lethe_kv_pool *pool, const char *mode, bool shareable) {
    lethe_pc_params p = {.mode = mode,
                         .enabled = true,
                         .shareable = shareable,
                         .method = "m",
                         .pool = pool,
                         .kv_description = "test",
                         .release_state = release_state,
                         .release_ctx = &g_released};
    lethe_prefix_cache *pc = NULL;
    lethe_status st = lethe_pcache_create(&p, &pc);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
    CHECK(pc != NULL);
    return pc;
}

/* the whole ownership picture: slot counts (rows + the cache's references),
 * the cache's own invariants, rows in use = running requests + rows held */
static void check_all(lethe_kv_pool *pool, lethe_prefix_cache *pc, int32_t n_running) {
    lethe_kv_holder h = lethe_pcache_holder(pc);
    lethe_status st = lethe_kv_check(pool, &h, 1);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
    st = lethe_pcache_check(pc);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
    int32_t rows = 0;
    for (int32_t row = 0; row < lethe_kv_max_rows(pool); row++)
        rows += lethe_kv_row_in_use(pool, row);
    CHECK_EQ_INT(rows, n_running + lethe_pcache_rows_held(pc));
}

static void test_modes(void) {
    lethe_kv_pool *pool = mk_pool();
    lethe_prefix_cache *pc = mk_cache(pool, NULL, true);
    CHECK(!strcmp(lethe_pcache_mode(pc), "radix") && !lethe_pcache_takes_turns(pc));
    lethe_pcache_destroy(pc);
    pc = mk_cache(pool, "auto", false);
    CHECK(!strcmp(lethe_pcache_mode(pc), "chain") && lethe_pcache_takes_turns(pc));
    lethe_pcache_destroy(pc);
    pc = mk_cache(pool, "chain", true); /* shareable KV may still use chains */
    CHECK(!strcmp(lethe_pcache_mode(pc), "chain"));
    lethe_pcache_destroy(pc);

    lethe_pc_params p = {
        .mode = "radix", .enabled = true, .shareable = false, .method = "snapkv", .pool = pool};
    CHECK(lethe_pcache_create(&p, &pc) == LETHE_ERR_INVALID && pc == NULL);
    CHECK_STR_CONTAINS(lethe_last_error(), "incompatible with method snapkv");
    p.mode = "bogus";
    CHECK(lethe_pcache_create(&p, &pc) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "expected auto, radix or chain");
    p = (lethe_pc_params){.mode = "chain", .enabled = false, .pool = pool};
    CHECK(lethe_pcache_create(&p, &pc) == LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "--no-enable-prefix-caching");
    p.mode = NULL;
    CHECK(lethe_pcache_create(&p, &pc) == LETHE_OK && pc == NULL);

    /* off: every wrapper answers "nothing cached" */
    CHECK(!strcmp(lethe_pcache_mode(NULL), "off") && !lethe_pcache_takes_turns(NULL));
    int32_t toks[20] = {0}, row = -1;
    void *state = NULL, *ref = NULL;
    lethe_pc_seq v = {
        .id = 1, .tokens = toks, .n_tokens = 20, .row = &row, .method_state = &state, .ref = &ref};
    lethe_pc_match m;
    lethe_pcache_match(NULL, &v, &m);
    CHECK(m.tokens == 0 && m.resident == 0 && m.pinned == 0 && m.queried == 0 && !m.resume);
    CHECK_EQ_INT(lethe_pcache_reclaimable(NULL), 0);
    CHECK_EQ_INT(lethe_pcache_rows_held(NULL), 0);
    lethe_chain_begin_args a = {.tokens = toks, .n_tokens = 20};
    lethe_chain_turn t;
    lethe_pcache_begin_turn(NULL, &a, &t, &ref);
    CHECK(t.code == LETHE_CHAIN_MODE_DISABLED && ref == NULL);
    lethe_pc_ctl c = {.kind = LETHE_PC_CTL_CHAIN_HISTORY, .chain_id = "x"};
    CHECK(lethe_pcache_control(NULL, &c) == LETHE_ERR_UNSUPPORTED && c.n_out == -1);
    check_all(pool, NULL, 0);
    lethe_kv_pool_destroy(pool);
}

/* ---- a conversation through the scheduler, the same code for both caches ---- */

typedef struct turn_out {
    int32_t cached, first_chunk, n_tokens;
    lethe_chain_code code;
    char id[LETHE_CHAIN_ID_CAP];
    int32_t tokens[256];
} turn_out;

/* One turn: the cache may take it as a chain turn (begin_turn), or not
 * (MODE_DISABLED: a plain request); then the scheduler runs it to n_gen
 * generated tokens and removes it as finished (ok) or, with abort_after > 0,
 * as failed after that many steps. */
static void run_turn(lethe_kv_pool *pool, lethe_prefix_cache *pc, lethe_sched *s,
                     const char *chain_id, const int32_t *prompt, int32_t n_prompt, int32_t n_gen,
                     int32_t abort_after, turn_out *out) {
    memset(out, 0, sizeof(*out));
    lethe_chain_begin_args a = {.chain_id = chain_id,
                                .tokens = prompt,
                                .n_tokens = n_prompt,
                                .gen_peak = n_gen,
                                .max_len = 256};
    lethe_chain_turn t;
    void *ref = NULL;
    lethe_pcache_begin_turn(pc, &a, &t, &ref);
    out->code = t.code;
    if (t.code != LETHE_CHAIN_OK && t.code != LETHE_CHAIN_MODE_DISABLED) return;
    lethe_req *r = lethe_xcalloc(1, sizeof(*r));
    r->id = 1;
    const int32_t *full = t.code == LETHE_CHAIN_OK ? t.tokens : prompt;
    int32_t n_full = t.code == LETHE_CHAIN_OK ? t.n_tokens : n_prompt;
    for (int32_t i = 0; i < n_full; i++) lethe_req_push_token(r, full[i]);
    r->n_prompt = n_full;
    r->cache_ref = ref;
    snprintf(out->id, sizeof(out->id), "%s", t.code == LETHE_CHAIN_OK ? t.id : "");
    free(t.tokens);
    lethe_sched_add(s, r);
    lethe_sched_out so;
    for (int32_t step = 0; r->state != LETHE_REQ_FINISHED; step++) {
        CHECK(step < 100);
        if (abort_after > 0 && step == abort_after) {
            lethe_sched_remove(s, r, false);
            break;
        }
        lethe_sched_schedule(s, &so);
        CHECK_EQ_INT(so.n_items, 1);
        if (step == 0) out->first_chunk = so.items[0].n;
        lethe_sched_commit(s, &so);
        if (so.items[0].wants_logits) {
            lethe_req_push_token(r, 100 + r->n_tokens); /* the "model" */
            if (r->n_tokens - r->n_prompt >= n_gen) lethe_sched_remove(s, r, true);
        }
        check_all(pool, pc, lethe_sched_n_running(s));
    }
    CHECK(r->cache_ref == NULL && r->row < 0 && !r->method_state);
    out->cached = r->cached_tokens;
    out->n_tokens = r->n_tokens;
    memcpy(out->tokens, r->tokens, (size_t)r->n_tokens * sizeof(int32_t));
    free(r->tokens);
    free(r);
}

static void conversation(const char *mode, bool shareable) {
    lethe_kv_pool *pool = mk_pool();
    lethe_prefix_cache *pc = mk_cache(pool, mode, shareable);
    bool chain = lethe_pcache_takes_turns(pc);
    lethe_sched_params sp = {.max_num_seqs = 4, .max_num_batched_tokens = 256};
    lethe_sched *s = lethe_sched_create(&sp, pool, pc, NULL);
    int32_t p1[40];
    for (int32_t i = 0; i < 40; i++) p1[i] = 10 + i;
    turn_out t1, t2;
    run_turn(pool, pc, s, NULL, p1, 40, 4, 0, &t1);
    CHECK_EQ_INT(t1.cached, 0);
    CHECK_EQ_INT(t1.first_chunk, 40);
    CHECK_EQ_INT(t1.n_tokens, 44);
    check_all(pool, pc, 0);
    /* turn 2: the whole history plus 20 new tokens */
    int32_t p2[64];
    memcpy(p2, t1.tokens, 44 * sizeof(int32_t));
    for (int32_t i = 44; i < 64; i++) p2[i] = 500 + i;
    run_turn(pool, pc, s, chain ? t1.id : NULL, p2, 64, 3, 0, &t2);
    CHECK_EQ_INT(t2.code, chain ? LETHE_CHAIN_OK : LETHE_CHAIN_MODE_DISABLED);
    /* radix: turn 1 computed 43 tokens = 2 published blocks; chain: the
     * processed boundary (44 - 1: the last sampled token had no KV) */
    int32_t reuse = chain ? 43 : 32;
    CHECK_EQ_INT(t2.cached, reuse);
    CHECK_EQ_INT(t2.first_chunk, 64 - reuse);
    const lethe_sched_stats *ss = lethe_sched_get_stats(s);
    CHECK_EQ_INT(ss->prefix_queries_tokens, chain ? 0 : 40 + 64); /* a chain turn is not a lookup */
    CHECK_EQ_INT(ss->prefix_hit_tokens, chain ? 0 : 32);
    lethe_pc_stats st;
    lethe_pcache_stats(pc, &st);
    CHECK_EQ_INT(st.chain.n_resumed, chain ? 1 : 0);
    CHECK_EQ_INT(st.chain.n_idle, chain ? 1 : 0);
    /* what stays cached: radix blocks (reclaimable), or the chain's row */
    CHECK_EQ_INT(lethe_pcache_reclaimable(pc), chain ? 0 : 4 * 16);
    CHECK_EQ_INT(lethe_pcache_rows_held(pc), chain ? 1 : 0);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), NSLOTS - (chain ? 66 : 64));
    lethe_pcache_evict(pc, NSLOTS);
    check_all(pool, pc, 0);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0),
                 NSLOTS - (chain ? 66 : 0)); /* chains are not evicted under pressure */
    lethe_sched_destroy(s);
    lethe_pcache_destroy(pc);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), NSLOTS);
    CHECK(lethe_kv_check(pool, NULL, 0) == LETHE_OK);
    lethe_kv_pool_destroy(pool);
}

/* an aborted turn: the chain is gone; radix blocks published before the abort stay */
static void aborted(const char *mode, bool shareable) {
    lethe_kv_pool *pool = mk_pool();
    lethe_prefix_cache *pc = mk_cache(pool, mode, shareable);
    bool chain = lethe_pcache_takes_turns(pc);
    lethe_sched_params sp = {.max_num_seqs = 4, .max_num_batched_tokens = 16};
    lethe_sched *s = lethe_sched_create(&sp, pool, pc, NULL);
    int32_t p[40];
    for (int32_t i = 0; i < 40; i++) p[i] = 10 + i;
    turn_out t;
    run_turn(pool, pc, s, NULL, p, 40, 2, 2, &t); /* removed after two 16-token chunks */
    check_all(pool, pc, 0);
    CHECK_EQ_INT(lethe_pcache_rows_held(pc), 0);
    CHECK_EQ_INT(lethe_pcache_reclaimable(pc), chain ? 0 : 32);
    if (chain) {
        turn_out again;
        run_turn(pool, pc, s, t.id, p, 40, 2, 0, &again);
        CHECK_EQ_INT(again.code, LETHE_CHAIN_GONE);
    }
    lethe_sched_destroy(s);
    lethe_pcache_destroy(pc);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), NSLOTS);
    lethe_kv_pool_destroy(pool);
}

/* ---- the lifecycle by direct calls ---- */

typedef struct seq {
    int32_t tokens[64], n_tokens, n_computed, row;
    void *state, *ref;
} seq;

static lethe_pc_seq view(seq *q) {
    return (lethe_pc_seq){.id = 9,
                          .tokens = q->tokens,
                          .n_tokens = q->n_tokens,
                          .n_computed = q->n_computed,
                          .row = &q->row,
                          .method_state = &q->state,
                          .ref = &q->ref};
}

/* match + acquire as the scheduler does, then compute the rest of the prompt */
static lethe_pc_match admit(lethe_kv_pool *pool, lethe_prefix_cache *pc, seq *q) {
    lethe_pc_seq v = view(q);
    lethe_pc_match m, m2;
    lethe_pcache_match(pc, &v, &m);
    lethe_pcache_match(pc, &v, &m2); /* read-only: the same answer twice */
    CHECK(memcmp(&m, &m2, sizeof(m)) == 0);
    if (!m.resume) q->row = lethe_kv_row_alloc(pool);
    lethe_pcache_acquire(pc, &v, &m);
    q->n_computed = m.tokens;
    int32_t pos[64];
    for (int32_t i = 0; i < q->n_tokens - m.tokens; i++) pos[i] = m.tokens + i;
    CHECK(lethe_kv_row_append(pool, q->row, q->n_tokens - m.tokens, pos));
    q->n_computed = q->n_tokens;
    v = view(q);
    lethe_pcache_commit(pc, &v);
    return m;
}

/* what the scheduler frees after release */
static void end(lethe_kv_pool *pool, lethe_prefix_cache *pc, seq *q, lethe_pc_end how) {
    lethe_pc_seq v = view(q);
    lethe_pcache_release(pc, &v, how);
    if (q->row >= 0) lethe_kv_row_release(pool, q->row);
    if (q->state) release_state(&g_released, q->state);
    q->row = -1;
    q->state = NULL;
    q->n_computed = 0;
}

static void test_lifecycle(void) {
    static int marker = 77;
    lethe_kv_pool *pool = mk_pool();
    /* radix: preemption drops the references, the blocks stay reclaimable */
    lethe_prefix_cache *pc = mk_cache(pool, "radix", true);
    seq a = {.n_tokens = 40, .row = -1}, b = {.n_tokens = 40, .row = -1};
    for (int32_t i = 0; i < 40; i++) a.tokens[i] = b.tokens[i] = 3 + i;
    CHECK_EQ_INT(admit(pool, pc, &a).tokens, 0);
    check_all(pool, pc, 1);
    lethe_pc_match m = admit(pool, pc, &b);
    CHECK(m.tokens == 32 && m.resident == 32 && m.pinned == 0 && m.queried == 40 && !m.resume);
    check_all(pool, pc, 2);
    end(pool, pc, &a, LETHE_PC_END_OK);
    CHECK_EQ_INT(lethe_pcache_reclaimable(pc), 0); /* b still holds both blocks */
    end(pool, pc, &b, LETHE_PC_END_PREEMPTED);
    CHECK(b.ref == NULL);
    CHECK_EQ_INT(lethe_pcache_reclaimable(pc), 32);
    lethe_pc_seq v = view(&b);
    lethe_pcache_match(pc, &v, &m);
    CHECK_EQ_INT(m.pinned, 32); /* attaching now would pin the unreferenced blocks */
    check_all(pool, pc, 0);
    lethe_pc_ctl c = {.kind = LETHE_PC_CTL_CHAIN_HISTORY, .chain_id = "x"};
    CHECK(lethe_pcache_control(pc, &c) == LETHE_ERR_UNSUPPORTED);
    lethe_pcache_destroy(pc);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), NSLOTS);

    /* chain: a finished turn keeps its row and method state */
    pc = mk_cache(pool, "chain", false);
    seq t = {.n_tokens = 30, .row = -1};
    for (int32_t i = 0; i < 30; i++) t.tokens[i] = 3 + i;
    lethe_chain_begin_args ba = {.tokens = t.tokens, .n_tokens = 30, .gen_peak = 4, .max_len = 64};
    lethe_chain_turn tt;
    lethe_pcache_begin_turn(pc, &ba, &tt, &t.ref);
    CHECK(tt.code == LETHE_CHAIN_OK && t.ref);
    char id[LETHE_CHAIN_ID_CAP];
    snprintf(id, sizeof(id), "%s", tt.id);
    free(tt.tokens);
    CHECK(!admit(pool, pc, &t).resume);
    t.state = &marker;
    t.tokens[t.n_tokens++] = 99; /* a sampled token without KV */
    end(pool, pc, &t, LETHE_PC_END_OK);
    CHECK(t.ref == NULL && g_released == 0);
    CHECK_EQ_INT(lethe_pcache_rows_held(pc), 1);
    check_all(pool, pc, 0);
    int32_t hist[64];
    c = (lethe_pc_ctl){.kind = LETHE_PC_CTL_CHAIN_HISTORY, .chain_id = id, .out = hist, .cap = 64};
    CHECK(lethe_pcache_control(pc, &c) == LETHE_OK);
    CHECK_EQ_INT(c.n_out, 31);
    CHECK_EQ_INT(hist[30], 99);
    c = (lethe_pc_ctl){.kind = LETHE_PC_CTL_CHAIN_POSITIONS, .chain_id = id, .layer = 1};
    CHECK(lethe_pcache_control(pc, &c) == LETHE_OK);
    CHECK_EQ_INT(c.n_out, 30);

    /* the next turn resumes on that row; preempted, it is readmitted from 0 */
    seq u = {.n_tokens = 40, .row = -1};
    memcpy(u.tokens, t.tokens, 31 * sizeof(int32_t));
    for (int32_t i = 31; i < 40; i++) u.tokens[i] = 200 + i;
    ba = (lethe_chain_begin_args){
        .chain_id = id, .tokens = u.tokens, .n_tokens = 40, .gen_peak = 4, .max_len = 64};
    lethe_pcache_begin_turn(pc, &ba, &tt, &u.ref);
    CHECK(tt.code == LETHE_CHAIN_OK && tt.status == LETHE_CHAIN_RESUMED && tt.reused == 30);
    free(tt.tokens);
    v = view(&u);
    lethe_pcache_match(pc, &v, &m);
    CHECK(m.tokens == 30 && m.resident == 30 && m.queried == 0 && m.resume);
    check_all(pool, pc, 0); /* still the chain's until acquired */
    admit(pool, pc, &u);
    CHECK(u.state == &marker); /* the method state came with the row */
    CHECK_EQ_INT(lethe_pcache_rows_held(pc), 0);
    check_all(pool, pc, 1);
    end(pool, pc, &u, LETHE_PC_END_PREEMPTED);
    CHECK(u.ref != NULL && g_released == 1);
    CHECK(!admit(pool, pc, &u).resume); /* recomputes its whole prompt */
    check_all(pool, pc, 1);

    /* a failed turn invalidates the chain */
    end(pool, pc, &u, LETHE_PC_END_FAILED);
    CHECK(u.ref == NULL);
    check_all(pool, pc, 0);
    CHECK_EQ_INT(lethe_pcache_rows_held(pc), 0);
    lethe_pcache_begin_turn(pc, &ba, &tt, &u.ref);
    CHECK(tt.code == LETHE_CHAIN_GONE && u.ref == NULL);

    /* a begun turn that never reaches the scheduler, and a payload freed at destroy */
    seq w = {.n_tokens = 10, .row = -1};
    for (int32_t i = 0; i < 10; i++) w.tokens[i] = 7 + i;
    ba = (lethe_chain_begin_args){.tokens = w.tokens, .n_tokens = 10, .gen_peak = 4, .max_len = 64};
    lethe_pcache_begin_turn(pc, &ba, &tt, &w.ref);
    free(tt.tokens);
    lethe_pcache_cancel_turn(pc, w.ref);
    w.ref = NULL;
    lethe_pcache_begin_turn(pc, &ba, &tt, &w.ref);
    free(tt.tokens);
    admit(pool, pc, &w);
    w.state = &marker;
    end(pool, pc, &w, LETHE_PC_END_OK);
    lethe_pc_stats st;
    lethe_pcache_stats(pc, &st);
    CHECK_EQ_INT(st.chain.n_invalidated, 2);
    CHECK_EQ_INT(st.chain.n_idle, 1);
    check_all(pool, pc, 0);
    lethe_pcache_destroy(pc);
    CHECK_EQ_INT(g_released, 2);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), NSLOTS);
    lethe_kv_pool_destroy(pool);
}

int main(void) {
    test_modes();
    conversation("radix", true);
    conversation("chain", false);
    conversation("chain", true); /* dense KV in chain mode */
    aborted("radix", true);
    aborted("chain", false);
    test_lifecycle();
    printf("test_prefix_cache: ok\n");
    return 0;
}

/* test_scheduler.c - scheduler budget decisions: chunked prefill under the
 * token budget, mixed vs split steps, max_num_seqs, FCFS admission asked
 * before allocating, prefix-cache hits, preemption by recompute (newest
 * first, re-queued at the head, prompt + generated re-prefilled), requests
 * that can never fit, abort; plus a capacity question answered by a method.
 * The "model" here appends a fixed token whenever a step wants logits; the
 * KV checker runs after every step. */
#include <string.h>

#include "cache/radix.h"
#include "core/util.h"
#include "sched/scheduler.h"
#include "test.h"

typedef struct world {
    lethe_kv_pool *pool;
    lethe_prefix_cache *pc;
    lethe_radix *radix;         /* the tree behind pc */
    lethe_sched *s;
    lethe_sched_out out;
    int32_t max_gen[64]; /* finish after this many generated tokens */
} world;

static void world_init(world *w, int32_t n_slots, int32_t budget, int32_t max_seqs, bool split,
                       bool prefix, lethe_sparse_method *m) {
    memset(w, 0, sizeof(*w));
    lethe_kv_pool_params pp = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .n_slots = n_slots};
    CHECK(lethe_kv_pool_create(&pp, &w->pool) == LETHE_OK);
    if (prefix) {
        lethe_pc_params pc = {.mode = "radix", .enabled = true, .shareable = true, .pool = w->pool};
        CHECK(lethe_pcache_create(&pc, &w->pc) == LETHE_OK);
        w->radix = lethe_radix_cache_tree(w->pc);
        CHECK(w->radix != NULL);
    }
    lethe_sched_params sp = {.max_num_seqs = max_seqs, .max_num_batched_tokens = budget,
                             .split_prefill_decode = split};
    w->s = lethe_sched_create(&sp, w->pool, w->pc, m);
}

static void world_check(world *w) {
    lethe_kv_holder h = lethe_pcache_holder(w->pc);
    lethe_status st = lethe_kv_check(w->pool, &h, 1);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
}

static void world_free(world *w) {
    lethe_sched_destroy(w->s);
    lethe_pcache_destroy(w->pc);
    lethe_kv_pool_destroy(w->pool);
}

static lethe_req *mkreq(uint64_t id, int32_t n_prompt, int32_t base) {
    lethe_req *r = lethe_xcalloc(1, sizeof(*r));
    r->id = id;
    for (int32_t i = 0; i < n_prompt; i++) lethe_req_push_token(r, base + i);
    r->n_prompt = n_prompt;
    return r;
}

static void freereq(lethe_req *r) {
    CHECK(r->cache_ref == NULL); /* released with the request */
    free(r->tokens);
    free(r);
}

/* one step: schedule, "forward", commit, append a token to requests whose
 * chunk wanted logits, finish those at max_gen */
static void step(world *w) {
    lethe_sched_schedule(w->s, &w->out);
    int32_t sum = 0;
    for (int32_t i = 0; i < w->out.n_items; i++) sum += w->out.items[i].n;
    CHECK_EQ_INT(sum, w->out.n_tokens);
    lethe_sched_commit(w->s, &w->out);
    for (int32_t i = 0; i < w->out.n_items; i++) {
        lethe_req *r = w->out.items[i].req;
        if (!w->out.items[i].wants_logits) continue;
        lethe_req_push_token(r, 7);
        if (r->n_tokens - r->n_prompt >= w->max_gen[r->id]) lethe_sched_remove(w->s, r, true);
    }
    world_check(w);
}

static int32_t item_n(const world *w, const lethe_req *r) {
    for (int32_t i = 0; i < w->out.n_items; i++)
        if (w->out.items[i].req == r) return w->out.items[i].n;
    return 0;
}

static void test_chunked_prefill(void) {
    world w;
    world_init(&w, 1024, 64, 8, false, false, NULL);
    lethe_req *a = mkreq(1, 150, 0);
    w.max_gen[1] = 3;
    lethe_sched_add(w.s, a);
    step(&w);
    CHECK_EQ_INT(w.out.n_items, 1);
    CHECK_EQ_INT(item_n(&w, a), 64);
    CHECK(w.out.items[0].is_prefill && !w.out.items[0].wants_logits);
    step(&w);
    CHECK_EQ_INT(item_n(&w, a), 64);
    step(&w);
    CHECK_EQ_INT(item_n(&w, a), 22);
    CHECK(w.out.items[0].wants_logits);
    CHECK_EQ_INT(a->n_tokens, 151);
    step(&w); /* decode */
    CHECK_EQ_INT(item_n(&w, a), 1);
    CHECK(!w.out.items[0].is_prefill);
    CHECK_EQ_INT(w.out.n_decode_tokens, 1);
    step(&w);
    CHECK(a->state == LETHE_REQ_FINISHED);
    CHECK(!lethe_sched_has_work(w.s));
    CHECK_EQ_INT(lethe_kv_n_free(w.pool, 0), 1024);
    freereq(a);
    world_free(&w);
}

/* A decodes while B arrives with a long prompt */
static void mixed_vs_split(bool split) {
    world w;
    world_init(&w, 1024, 64, 8, split, false, NULL);
    lethe_req *a = mkreq(1, 10, 0), *b = mkreq(2, 100, 500);
    w.max_gen[1] = 10;
    w.max_gen[2] = 2;
    lethe_sched_add(w.s, a);
    step(&w); /* A's prompt */
    CHECK_EQ_INT(item_n(&w, a), 10);
    lethe_sched_add(w.s, b);
    step(&w);
    if (!split) {
        /* vLLM-style: A's decode token and B's first chunk share the step */
        CHECK_EQ_INT(item_n(&w, a), 1);
        CHECK_EQ_INT(item_n(&w, b), 63);
        CHECK_EQ_INT(w.out.n_prefill_tokens, 63);
        CHECK_EQ_INT(w.out.n_decode_tokens, 1);
        step(&w);
        CHECK_EQ_INT(item_n(&w, a), 1);
        CHECK_EQ_INT(item_n(&w, b), 37);
    } else {
        /* anchor-style: prefill steps first, A waits */
        CHECK_EQ_INT(item_n(&w, a), 0);
        CHECK_EQ_INT(item_n(&w, b), 64);
        step(&w);
        CHECK_EQ_INT(item_n(&w, a), 0);
        CHECK_EQ_INT(item_n(&w, b), 36);
        step(&w); /* both decode */
        CHECK_EQ_INT(item_n(&w, a), 1);
        CHECK_EQ_INT(item_n(&w, b), 1);
        CHECK_EQ_INT(w.out.n_prefill_tokens, 0);
    }
    while (lethe_sched_has_work(w.s)) step(&w);
    CHECK_EQ_INT(a->n_tokens, 20);
    CHECK_EQ_INT(b->n_tokens, 102);
    freereq(a);
    freereq(b);
    world_free(&w);
}
static void test_mixed(void) { mixed_vs_split(false); }
static void test_split(void) { mixed_vs_split(true); }

static void test_max_num_seqs(void) {
    world w;
    world_init(&w, 1024, 256, 2, false, false, NULL);
    lethe_req *r[3];
    for (int i = 0; i < 3; i++) {
        r[i] = mkreq((uint64_t)i, 8, 100 * i);
        w.max_gen[i] = 3;
        lethe_sched_add(w.s, r[i]);
    }
    step(&w);
    CHECK_EQ_INT(w.out.n_items, 2);
    CHECK_EQ_INT(lethe_sched_n_running(w.s), 2);
    CHECK_EQ_INT(lethe_sched_n_waiting(w.s), 1);
    step(&w);
    step(&w); /* r0, r1 finish (3 tokens) */
    CHECK(r[0]->state == LETHE_REQ_FINISHED && r[1]->state == LETHE_REQ_FINISHED);
    CHECK(r[2]->state == LETHE_REQ_WAITING);
    step(&w);
    CHECK_EQ_INT(item_n(&w, r[2]), 8);
    while (lethe_sched_has_work(w.s)) step(&w);
    for (int i = 0; i < 3; i++) freereq(r[i]);
    world_free(&w);
}

/* FCFS: the head waits for memory and nobody overtakes it */
static void test_fcfs_capacity(void) {
    world w;
    world_init(&w, 64, 256, 8, false, false, NULL);
    lethe_req *a = mkreq(1, 40, 0), *b = mkreq(2, 40, 100), *c = mkreq(3, 4, 200);
    w.max_gen[1] = 2;
    w.max_gen[2] = 2;
    w.max_gen[3] = 2;
    lethe_sched_add(w.s, a);
    lethe_sched_add(w.s, b);
    lethe_sched_add(w.s, c);
    step(&w);
    /* b does not fit (24 free < 40) and c, which would fit, must not overtake it */
    CHECK_EQ_INT(w.out.n_items, 1);
    CHECK_EQ_INT(item_n(&w, a), 40);
    CHECK(b->state == LETHE_REQ_WAITING && b->row < 0);
    CHECK(c->state == LETHE_REQ_WAITING && c->row < 0);
    CHECK_EQ_INT(lethe_kv_n_free(w.pool, 0), 24); /* nothing was allocated for b */
    step(&w);  /* a's decode; a finishes */
    CHECK(a->state == LETHE_REQ_FINISHED);
    step(&w);
    CHECK_EQ_INT(item_n(&w, b), 40);
    CHECK_EQ_INT(item_n(&w, c), 4);
    while (lethe_sched_has_work(w.s)) step(&w);
    CHECK_EQ_INT(lethe_sched_get_stats(w.s)->n_preemptions, 0);
    freereq(a);
    freereq(b);
    freereq(c);
    world_free(&w);
}

static void test_preemption(void) {
    world w;
    world_init(&w, 48, 256, 8, false, false, NULL);
    lethe_req *a = mkreq(1, 20, 0), *b = mkreq(2, 20, 100);
    w.max_gen[1] = 12;
    w.max_gen[2] = 6;
    lethe_sched_add(w.s, a);
    lethe_sched_add(w.s, b);
    step(&w); /* 40 slots used */
    CHECK_EQ_INT(w.out.n_items, 2);
    int32_t preempted_at = -1;
    bool saw_recompute = false;
    for (int k = 0; k < 40 && lethe_sched_has_work(w.s); k++) {
        step(&w);
        if (w.out.n_preempted > 0 && preempted_at < 0) {
            preempted_at = k;
            /* the newest request is the victim; it waits at the head with no KV */
            CHECK(w.out.preempted[0] == b);
            CHECK(b->state == LETHE_REQ_WAITING && b->row < 0 && b->n_computed == 0);
            CHECK_EQ_INT(item_n(&w, a), 1);
            CHECK_EQ_INT(item_n(&w, b), 0);
        }
        if (preempted_at >= 0 && item_n(&w, b) > 1) {
            /* re-admission: prompt + 5 generated tokens re-prefilled as one prompt */
            CHECK_EQ_INT(item_n(&w, b), 25);
            CHECK(b->is_recompute);
            CHECK_EQ_INT(b->n_prefill, 25);
            saw_recompute = true;
        }
    }
    CHECK(preempted_at >= 0 && saw_recompute);
    CHECK(!lethe_sched_has_work(w.s));
    CHECK_EQ_INT(lethe_sched_get_stats(w.s)->n_preemptions, 1);
    CHECK_EQ_INT(b->n_preemptions, 1);
    CHECK_EQ_INT(a->n_tokens, 32);
    CHECK_EQ_INT(b->n_tokens, 26);
    CHECK_EQ_INT(lethe_kv_n_free(w.pool, 0), 48);
    freereq(a);
    freereq(b);
    world_free(&w);
}

static void test_prefix_hit(void) {
    world w;
    world_init(&w, 256, 256, 8, false, true, NULL);
    lethe_req *a = mkreq(1, 40, 0), *b = mkreq(2, 40, 0), *c = mkreq(3, 32, 0);
    w.max_gen[1] = 5;
    w.max_gen[2] = 2;
    w.max_gen[3] = 1;
    lethe_sched_add(w.s, a);
    step(&w);
    CHECK_EQ_INT(lethe_radix_n_blocks(w.radix), 2); /* a published its 2 full blocks after the step */
    lethe_sched_add(w.s, b);
    lethe_sched_add(w.s, c);
    step(&w);
    CHECK_EQ_INT(b->cached_tokens, 32);
    CHECK_EQ_INT(item_n(&w, b), 8);
    /* c's whole 32-token prompt is cached but one token is always recomputed */
    CHECK_EQ_INT(c->cached_tokens, 16);
    CHECK_EQ_INT(item_n(&w, c), 16);
    /* b shares a's slots for the first 32 positions */
    CHECK_EQ_INT(lethe_kv_row_slots(w.pool, 0, b->row)[5], lethe_kv_row_slots(w.pool, 0, a->row)[5]);
    CHECK_EQ_INT(lethe_sched_get_stats(w.s)->prefix_queries_tokens, 40 + 40 + 32);
    CHECK_EQ_INT(lethe_sched_get_stats(w.s)->prefix_hit_tokens, 48);
    while (lethe_sched_has_work(w.s)) step(&w);
    CHECK(lethe_radix_n_blocks(w.radix) >= 2);
    freereq(a);
    freereq(b);
    freereq(c);
    world_free(&w);
}

/* the cache gives memory back under pressure instead of blocking admission */
static void test_prefix_eviction_under_pressure(void) {
    world w;
    world_init(&w, 64, 256, 8, false, true, NULL);
    lethe_req *a = mkreq(1, 48, 0), *b = mkreq(2, 48, 1000);
    w.max_gen[1] = 1;
    w.max_gen[2] = 1;
    lethe_sched_add(w.s, a);
    step(&w);
    CHECK(a->state == LETHE_REQ_FINISHED);
    CHECK_EQ_INT(lethe_radix_n_blocks(w.radix), 3);
    CHECK_EQ_INT(lethe_kv_n_free(w.pool, 0), 16);
    lethe_sched_add(w.s, b);
    CHECK_EQ_INT(lethe_sched_available(w.s), 64);
    step(&w);
    CHECK_EQ_INT(item_n(&w, b), 48);
    /* a's two newest blocks were evicted (leaves first), b's three published */
    CHECK_EQ_INT(lethe_radix_n_blocks(w.radix), 4);
    CHECK_EQ_INT(lethe_radix_match(w.radix, a->tokens, 48, (lethe_radix_block *[3]){0}, 3), 1);
    freereq(a);
    freereq(b);
    world_free(&w);
}

static void test_never_fits(void) {
    world w;
    world_init(&w, 16, 256, 8, false, false, NULL);
    lethe_req *a = mkreq(1, 40, 0);
    w.max_gen[1] = 2;
    lethe_sched_add(w.s, a);
    step(&w); /* alone: the chunk shrinks to the 16 free slots */
    CHECK_EQ_INT(item_n(&w, a), 16);
    step(&w); /* cannot continue and nothing can be freed */
    CHECK_EQ_INT(w.out.n_failed, 1);
    CHECK(w.out.failed[0] == a);
    CHECK(a->state == LETHE_REQ_FINISHED);
    CHECK_STR_CONTAINS(a->fail_reason, "KV cache too small");
    CHECK_EQ_INT(lethe_kv_n_free(w.pool, 0), 16);
    CHECK(!lethe_sched_has_work(w.s));
    freereq(a);
    world_free(&w);
}

static void test_abort_frees(void) {
    world w;
    world_init(&w, 128, 32, 8, false, true, NULL);
    lethe_req *a = mkreq(1, 100, 0);
    w.max_gen[1] = 5;
    lethe_sched_add(w.s, a);
    step(&w);
    step(&w);
    CHECK_EQ_INT(a->n_computed, 64);
    lethe_sched_remove(w.s, a, false); /* mid-prefill */
    world_check(&w);
    CHECK_EQ_INT(lethe_kv_n_free(w.pool, 0) + lethe_radix_reclaimable(w.radix), 128);
    CHECK(!lethe_sched_has_work(w.s));
    /* waiting requests abort too */
    lethe_req *b = mkreq(2, 10, 0);
    lethe_sched_add(w.s, b);
    lethe_sched_remove(w.s, b, false);
    CHECK(!lethe_sched_has_work(w.s));
    freereq(a);
    freereq(b);
    world_free(&w);
}

/* A method whose prefill chunk needs twice its tokens at peak (staging): the
 * scheduler asks it and admits accordingly. */
static int32_t double_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s, int32_t res,
                           int32_t n) {
    return 2 * n;
}
static void test_method_capacity(void) {
    lethe_sparse_ops ops = lethe_sparse_dense;
    ops.prefill_peak_slots = double_peak;
    lethe_sparse_method m = {.ops = &ops};
    world w;
    world_init(&w, 100, 256, 8, false, false, &m);
    lethe_req *a = mkreq(1, 30, 0), *b = mkreq(2, 30, 100);
    w.max_gen[1] = 2;
    w.max_gen[2] = 2;
    lethe_sched_add(w.s, a);
    lethe_sched_add(w.s, b);
    step(&w);
    /* a: 30 appended + 30 reserved; b would need 60 more of the 40 left */
    CHECK_EQ_INT(w.out.n_items, 1);
    CHECK_EQ_INT(item_n(&w, a), 30);
    CHECK(b->state == LETHE_REQ_WAITING);
    step(&w);
    CHECK_EQ_INT(item_n(&w, b), 30); /* a decodes (1) + b's 60 peak fit in 69 */
    while (lethe_sched_has_work(w.s)) step(&w);
    freereq(a);
    freereq(b);
    world_free(&w);
}

/* A method whose final prompt chunk must hold 32 tokens (SnapKV's window). */
static int32_t mfc32(const lethe_sparse_method *m) { return 32; }
static void test_min_final_chunk(void) {
    lethe_sparse_ops ops = lethe_sparse_dense;
    ops.min_final_chunk = mfc32;
    lethe_sparse_method m = {.ops = &ops};
    world w;
    world_init(&w, 1024, 64, 8, false, false, &m);
    lethe_req *a = mkreq(1, 150, 0), *b = mkreq(2, 20, 300);
    w.max_gen[1] = 2;
    w.max_gen[2] = 2;
    lethe_sched_add(w.s, a);
    step(&w);
    CHECK_EQ_INT(item_n(&w, a), 64);
    step(&w); /* 64 would leave 22 < 32 for the final chunk: take 54 */
    CHECK_EQ_INT(item_n(&w, a), 54);
    lethe_sched_add(w.s, b);
    step(&w);
    CHECK_EQ_INT(item_n(&w, a), 32);
    CHECK(w.out.items[0].wants_logits);
    CHECK_EQ_INT(item_n(&w, b), 20); /* a short prompt is one final chunk */
    while (lethe_sched_has_work(w.s)) step(&w);
    freereq(a);
    freereq(b);
    world_free(&w);
}

int main(void) {
    TEST_RUN(test_min_final_chunk);
    TEST_RUN(test_chunked_prefill);
    TEST_RUN(test_mixed);
    TEST_RUN(test_split);
    TEST_RUN(test_max_num_seqs);
    TEST_RUN(test_fcfs_capacity);
    TEST_RUN(test_preemption);
    TEST_RUN(test_prefix_hit);
    TEST_RUN(test_prefix_eviction_under_pressure);
    TEST_RUN(test_never_fits);
    TEST_RUN(test_abort_frees);
    TEST_RUN(test_method_capacity);
    return 0;
}

/* test_kv_pool.c - slot allocator, rows, compaction (shared and per-layer),
 * references, page metadata, the ownership checker (including that it
 * catches corruption) and the host RAM the K/V buffers occupy. */
#include "kv/kv_internal.h"
#include "core/util.h"
#include "test.h"

#include <unistd.h>

static lethe_kv_pool *mk(int32_t n_layers, int32_t n_slots, bool per_layer, int32_t meta) {
    lethe_kv_pool_params p = {.n_layers = n_layers, .n_kv_heads = 2, .head_dim = 4,
                              .n_slots = n_slots, .per_layer = per_layer, .page_meta_floats = meta};
    lethe_kv_pool *pool = NULL;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_OK);
    return pool;
}

static void check_ok(const lethe_kv_pool *pool) {
    lethe_status st = lethe_kv_check(pool, NULL, 0);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
}

static void seq_pos(int32_t *pos, int32_t first, int32_t n) {
    for (int32_t i = 0; i < n; i++) pos[i] = first + i;
}

static void test_allocator(void) {
    lethe_kv_pool *pool = mk(2, 8, false, 0);
    CHECK_EQ_INT(lethe_kv_n_spaces(pool), 1);
    int32_t pos[16];
    int32_t a = lethe_kv_row_alloc(pool), b = lethe_kv_row_alloc(pool);
    CHECK(a != b);
    seq_pos(pos, 0, 5);
    CHECK(lethe_kv_row_append(pool, a, 5, pos));
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 3);
    /* fresh pool hands out slots 0, 1, 2, ... */
    for (int32_t i = 0; i < 5; i++) CHECK_EQ_INT(lethe_kv_row_slots(pool, 0, a)[i], i);
    check_ok(pool);
    /* all-or-nothing */
    seq_pos(pos, 0, 4);
    CHECK(!lethe_kv_row_append(pool, b, 4, pos));
    CHECK_EQ_INT(lethe_kv_row_len(pool, 0, b), 0);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 3);
    CHECK(lethe_kv_row_append(pool, b, 3, pos));
    CHECK_EQ_INT(lethe_kv_min_free(pool), 0);
    check_ok(pool);
    lethe_kv_row_release(pool, a);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 5);
    CHECK(!lethe_kv_row_in_use(pool, a));
    check_ok(pool);
    /* a released row id is reused, empty */
    int32_t c = lethe_kv_row_alloc(pool);
    CHECK_EQ_INT(c, a);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 0, c), 0);
    lethe_kv_row_release(pool, b);
    lethe_kv_row_release(pool, c);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 8);
    check_ok(pool);
    /* many rows: the row table grows */
    int32_t rows[100];
    for (int i = 0; i < 100; i++) rows[i] = lethe_kv_row_alloc(pool);
    CHECK(lethe_kv_max_rows(pool) >= 100);
    for (int i = 0; i < 100; i++) lethe_kv_row_release(pool, rows[i]);
    check_ok(pool);
    lethe_kv_pool_destroy(pool);
    CHECK_EQ_INT(lethe_kv_token_bytes(30, 3, 64, 4, LETHE_KV_NATIVE), 30 * 2 * 3 * 64 * 4);
    CHECK_EQ_INT(lethe_kv_token_bytes(30, 3, 64, 4, LETHE_KV_FP8_E4M3), 30 * 2 * 3 * (64 + 4));
}

static void test_keep_shared(void) {
    lethe_kv_pool *pool = mk(3, 16, false, 0);
    int32_t pos[16];
    int32_t r = lethe_kv_row_alloc(pool);
    seq_pos(pos, 0, 10);
    CHECK(lethe_kv_row_append(pool, r, 10, pos));
    const int32_t keep[] = {0, 1, 5, 8, 9};
    lethe_kv_keep(pool, 2, r, keep, 5); /* shared layout: any layer compacts the one row */
    CHECK_EQ_INT(lethe_kv_row_len(pool, 0, r), 5);
    const int32_t *s = lethe_kv_row_slots(pool, 0, r), *p = lethe_kv_row_pos(pool, 0, r);
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(s[i], keep[i]); /* slot i was position i */
        CHECK_EQ_INT(p[i], keep[i]);
    }
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 11);
    check_ok(pool);
    /* new tokens keep their logical positions after compaction */
    seq_pos(pos, 10, 2);
    CHECK(lethe_kv_row_append(pool, r, 2, pos));
    CHECK_EQ_INT(lethe_kv_row_pos(pool, 0, r)[5], 10);
    CHECK_EQ_INT(lethe_kv_row_pos(pool, 0, r)[6], 11);
    check_ok(pool);
    /* keep nothing */
    lethe_kv_keep(pool, 0, r, NULL, 0);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 16);
    check_ok(pool);
    lethe_kv_row_release(pool, r);
    lethe_kv_pool_destroy(pool);
}

static void test_keep_per_layer(void) {
    lethe_kv_pool *pool = mk(3, 12, true, 0);
    CHECK_EQ_INT(lethe_kv_n_spaces(pool), 3);
    CHECK_EQ_INT(lethe_kv_space_of(pool, 2), 2);
    int32_t pos[16];
    int32_t r = lethe_kv_row_alloc(pool);
    seq_pos(pos, 0, 8);
    CHECK(lethe_kv_row_append(pool, r, 8, pos));
    for (int32_t sp = 0; sp < 3; sp++) CHECK_EQ_INT(lethe_kv_n_free(pool, sp), 4);
    const int32_t keep1[] = {0, 6, 7};
    lethe_kv_keep(pool, 1, r, keep1, 3);
    const int32_t keep2[] = {0, 1, 2, 3, 7};
    lethe_kv_keep(pool, 2, r, keep2, 5);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 0, r), 8);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 1, r), 3);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 2, r), 5);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 4);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 1), 9);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 2), 7);
    CHECK_EQ_INT(lethe_kv_min_free(pool), 4);
    CHECK_EQ_INT(lethe_kv_total_free(pool), 20);
    CHECK_EQ_INT(lethe_kv_row_pos(pool, 1, r)[1], 6);
    check_ok(pool);
    /* an append needs room in every space: layer 0 has 4 */
    seq_pos(pos, 8, 5);
    CHECK(!lethe_kv_row_append(pool, r, 5, pos));
    CHECK(lethe_kv_row_append(pool, r, 4, pos));
    CHECK_EQ_INT(lethe_kv_row_pos(pool, 1, r)[3], 8);
    check_ok(pool);
    lethe_kv_row_release(pool, r);
    for (int32_t sp = 0; sp < 3; sp++) CHECK_EQ_INT(lethe_kv_n_free(pool, sp), 12);
    check_ok(pool);
    lethe_kv_pool_destroy(pool);
}

/* holder: a list of (space, slot) references */
typedef struct refs { int32_t n; int32_t sp[32], slot[32]; } refs;
static void refs_each(void *ctx, void (*visit)(void *, int32_t, int32_t), void *vctx) {
    refs *r = ctx;
    for (int32_t i = 0; i < r->n; i++) visit(vctx, r->sp[i], r->slot[i]);
}

static void test_refs_and_attach(void) {
    lethe_kv_pool *pool = mk(2, 8, true, 0);
    int32_t pos[8];
    int32_t a = lethe_kv_row_alloc(pool);
    seq_pos(pos, 0, 4);
    CHECK(lethe_kv_row_append(pool, a, 4, pos));
    refs h = {0};
    /* an outside holder (the prefix cache) references a's first two tokens */
    int32_t shared[2][2];
    for (int32_t sp = 0; sp < 2; sp++)
        for (int32_t i = 0; i < 2; i++) {
            int32_t s = lethe_kv_row_slots(pool, sp, a)[i];
            shared[sp][i] = s;
            lethe_kv_ref(pool, sp, s);
            h.sp[h.n] = sp;
            h.slot[h.n++] = s;
        }
    lethe_kv_holder holder = {.ctx = &h, .for_each = refs_each};
    CHECK(lethe_kv_check(pool, &holder, 1) == LETHE_OK);
    /* without the holder the recount disagrees: a leak is reported */
    CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
    CHECK_STR_CONTAINS(lethe_last_error(), "references found");
    /* a second row attaches the shared slots, then appends its own */
    int32_t b = lethe_kv_row_alloc(pool);
    lethe_kv_row_attach(pool, b, &shared[0][0], pos, 2);
    CHECK_EQ_INT(lethe_kv_refcount(pool, 1, shared[1][1]), 3);
    seq_pos(pos, 2, 1);
    CHECK(lethe_kv_row_append(pool, b, 1, pos));
    CHECK(lethe_kv_check(pool, &holder, 1) == LETHE_OK);
    /* releasing a keeps the shared slots (count 2 -> still owned) */
    lethe_kv_row_release(pool, a);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 8 - 3);
    CHECK(lethe_kv_check(pool, &holder, 1) == LETHE_OK);
    lethe_kv_row_release(pool, b);
    for (int32_t i = 0; i < h.n; i++) lethe_kv_unref(pool, h.sp[i], h.slot[i]);
    h.n = 0;
    CHECK_EQ_INT(lethe_kv_total_free(pool), 16);
    CHECK(lethe_kv_check(pool, &holder, 1) == LETHE_OK);
    lethe_kv_pool_destroy(pool);
}

static void test_checker_catches_corruption(void) {
    int32_t pos[8];
    seq_pos(pos, 0, 8);
    /* 1: an owned slot pushed on the free list */
    lethe_kv_pool *pool = mk(1, 8, false, 0);
    int32_t r = lethe_kv_row_alloc(pool);
    CHECK(lethe_kv_row_append(pool, r, 3, pos));
    pool->spaces[0].free_stack[pool->spaces[0].n_free++] = lethe_kv_row_slots(pool, 0, r)[0];
    CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
    lethe_kv_pool_destroy(pool);
    /* 2: a row pointing at a free slot */
    pool = mk(1, 8, false, 0);
    r = lethe_kv_row_alloc(pool);
    CHECK(lethe_kv_row_append(pool, r, 3, pos));
    pool->tabs[r].slot[2] = pool->spaces[0].free_stack[0];
    CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
    pool->tabs[r].len = 0; /* so destroy does not trip the asserts */
    lethe_kv_pool_destroy(pool);
    /* 3: the same slot twice in a row */
    pool = mk(1, 8, false, 0);
    r = lethe_kv_row_alloc(pool);
    CHECK(lethe_kv_row_append(pool, r, 3, pos));
    pool->tabs[r].slot[1] = pool->tabs[r].slot[0];
    pool->spaces[0].ref[pool->tabs[r].slot[0]] = 2;
    CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
    CHECK_STR_CONTAINS(lethe_last_error(), "twice");
    lethe_kv_pool_destroy(pool);
    /* 4: a lost slot (neither free nor owned) */
    pool = mk(1, 8, false, 0);
    pool->spaces[0].n_free--;
    CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
    CHECK_STR_CONTAINS(lethe_last_error(), "leak or loss");
    lethe_kv_pool_destroy(pool);
    /* 5: positions out of order */
    pool = mk(1, 8, false, 0);
    r = lethe_kv_row_alloc(pool);
    CHECK(lethe_kv_row_append(pool, r, 3, pos));
    pool->tabs[r].pos[2] = 0;
    CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
    CHECK_STR_CONTAINS(lethe_last_error(), "ascending");
    lethe_kv_pool_destroy(pool);
}

static void test_page_meta(void) {
    lethe_kv_pool *pool = mk(2, 128, true, 4);
    int32_t pos[64];
    int32_t r = lethe_kv_row_alloc(pool);
    seq_pos(pos, 0, 40);
    CHECK(lethe_kv_row_append(pool, r, 40, pos)); /* pages 0, 1 full, 2 partial */
    CHECK_EQ_INT(lethe_kv_page_meta_valid(pool, 1, r), 0);
    for (int32_t pg = 0; pg < 3; pg++) lethe_kv_page_meta(pool, 1, r, pg)[0] = (float)pg;
    lethe_kv_page_meta_set_valid(pool, 1, r, 3);
    /* appending touches page 2 (partial): pages 0, 1 stay valid */
    seq_pos(pos, 40, 5);
    CHECK(lethe_kv_row_append(pool, r, 5, pos));
    CHECK_EQ_INT(lethe_kv_page_meta_valid(pool, 1, r), 2);
    CHECK(lethe_kv_page_meta(pool, 1, r, 1)[0] == 1.0f);
    lethe_kv_page_meta_set_valid(pool, 1, r, 3);
    /* compaction that first changes entry 20 (page 1) invalidates from page 1 */
    int32_t keep[45], n = 0;
    for (int32_t i = 0; i < 45; i++)
        if (i != 20) keep[n++] = i;
    lethe_kv_keep(pool, 1, r, keep, n);
    CHECK_EQ_INT(lethe_kv_page_meta_valid(pool, 1, r), 1);
    CHECK_EQ_INT(lethe_kv_page_meta_valid(pool, 0, r), 0); /* layer 0 never set */
    check_ok(pool);
    lethe_kv_row_release(pool, r);
    lethe_kv_pool_destroy(pool);
}

/* random appends / keeps / releases, checked after every operation against a
 * plain model of which positions each row holds */
static void test_random(bool per_layer) {
    enum { L = 3, S = 200, R = 6, MAXP = 400 };
    lethe_kv_pool *pool = mk(L, S, per_layer, 2);
    uint64_t rng = per_layer ? 7 : 3;
    int32_t row[R], next_pos[R];
    bool live[R] = {0};
    int32_t pos[64], keep[MAXP];
    for (int it = 0; it < 4000; it++) {
        int32_t i = (int32_t)(lethe_splitmix64(&rng) % R);
        uint64_t op = lethe_splitmix64(&rng) % 10;
        if (!live[i]) {
            row[i] = lethe_kv_row_alloc(pool);
            live[i] = true;
            next_pos[i] = 0;
        } else if (op < 5) {
            int32_t n = (int32_t)(lethe_splitmix64(&rng) % 20) + 1;
            seq_pos(pos, next_pos[i], n);
            bool fits = lethe_kv_min_free(pool) >= n;
            CHECK(lethe_kv_row_append(pool, row[i], n, pos) == fits);
            if (fits) next_pos[i] += n;
        } else if (op < 8) {
            int32_t layer = (int32_t)(lethe_splitmix64(&rng) % L);
            int32_t sp = lethe_kv_space_of(pool, layer);
            int32_t len = lethe_kv_row_len(pool, sp, row[i]), n = 0;
            int32_t before_free = lethe_kv_n_free(pool, sp);
            for (int32_t k = 0; k < len; k++)
                if (lethe_splitmix64(&rng) % 3) keep[n++] = k;
            int32_t last_pos = n ? lethe_kv_row_pos(pool, sp, row[i])[keep[n - 1]] : 0;
            lethe_kv_keep(pool, layer, row[i], keep, n);
            CHECK_EQ_INT(lethe_kv_row_len(pool, sp, row[i]), n);
            CHECK_EQ_INT(lethe_kv_n_free(pool, sp), before_free + (len - n));
            if (n) CHECK_EQ_INT(lethe_kv_row_pos(pool, sp, row[i])[n - 1], last_pos);
        } else {
            lethe_kv_row_release(pool, row[i]);
            live[i] = false;
        }
        check_ok(pool);
    }
    for (int32_t i = 0; i < R; i++)
        if (live[i]) lethe_kv_row_release(pool, row[i]);
    CHECK_EQ_INT(lethe_kv_total_free(pool), (int64_t)S * lethe_kv_n_spaces(pool));
    check_ok(pool);
    lethe_kv_pool_destroy(pool);
}

static void test_random_shared(void) { test_random(false); }
static void test_random_per_layer(void) { test_random(true); }

/* The padding scratch slot: last id in every space, never handed out, held by
 * the pool's own reference (the checker counts it and refuses rows on it). */
static void test_scratch_slot(void) {
    for (int per_layer = 0; per_layer < 2; per_layer++) {
        lethe_kv_pool_params p = {.n_layers = 3, .n_kv_heads = 2, .head_dim = 4, .n_slots = 9,
                                  .per_layer = per_layer, .scratch_slot = true};
        lethe_kv_pool *pool = NULL;
        CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_OK);
        CHECK_EQ_INT(lethe_kv_scratch_slot(pool), 8);
        CHECK_EQ_INT(lethe_kv_min_free(pool), 8);
        check_ok(pool);
        int32_t pos[8];
        seq_pos(pos, 0, 8);
        int32_t r = lethe_kv_row_alloc(pool);
        CHECK(lethe_kv_row_append(pool, r, 8, pos));
        CHECK(!lethe_kv_row_append(pool, r, 1, pos)); /* the scratch slot is not allocatable */
        for (int32_t sp = 0; sp < lethe_kv_n_spaces(pool); sp++)
            for (int32_t i = 0; i < 8; i++) CHECK(lethe_kv_row_slots(pool, sp, r)[i] != 8);
        check_ok(pool);
        lethe_kv_row_release(pool, r);
        check_ok(pool);
        /* corruption: a row pointing at the scratch slot */
        r = lethe_kv_row_alloc(pool);
        CHECK(lethe_kv_row_append(pool, r, 1, pos));
        int32_t was = pool->tabs[(size_t)r * (size_t)pool->n_spaces].slot[0];
        pool->tabs[(size_t)r * (size_t)pool->n_spaces].slot[0] = 8;
        CHECK(lethe_kv_check(pool, NULL, 0) != LETHE_OK);
        CHECK_STR_CONTAINS(lethe_last_error(), "scratch");
        pool->tabs[(size_t)r * (size_t)pool->n_spaces].slot[0] = was;
        check_ok(pool);
        lethe_kv_pool_destroy(pool);
    }
    lethe_kv_pool_params p = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 4, .n_slots = 1, .scratch_slot = true};
    lethe_kv_pool *pool = NULL;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_ERR_CAPACITY);
}

static void test_errors(void) {
    lethe_kv_pool *pool = NULL;
    lethe_kv_pool_params p = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .n_slots = 0};
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_ERR_CAPACITY);
    CHECK(pool == NULL);
    p.n_slots = 4;
    p.n_layers = 0;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_ERR_INVALID);
}

/* A declared payload layout (per layer, different planes per layer): the
 * planes are allocated with their bytes per slot, K / V are planes 0 / 1,
 * the token cost is their sum; bad layouts are refused with a message. */
static void test_layouts(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    lethe_backend *be = NULL;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    lethe_kv_layout L[2] = {
        {.n_planes = 2, .planes = {{"latent", 40}, {"rope_k", 12}}},
        {.n_planes = 3, .planes = {{"codes", 9}, {"norm", 2}, {"pos", 4}}},
    };
    CHECK_EQ_INT(lethe_kv_layouts_token_bytes(L, 2), 40 + 12 + 9 + 2 + 4);
    lethe_kv_pool_params p = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .n_slots = 16, .be = be,
                              .layouts = L};
    lethe_kv_pool *pool = NULL;
    CHECK_MSG(lethe_kv_pool_create(&p, &pool) == LETHE_OK, "%s", lethe_last_error());
    L[0].planes[0].slot_bytes = 1; /* copied at create */
    CHECK(lethe_kv_has_layout(pool));
    CHECK_EQ_INT(lethe_kv_layout_of(pool, 0)->planes[0].slot_bytes, 40);
    CHECK_EQ_INT(lethe_kv_layout_of(pool, 1)->n_planes, 3);
    CHECK(lethe_kv_k(pool, 0) == lethe_kv_plane_buf(pool, 0, 0));
    CHECK(lethe_kv_v(pool, 1) == lethe_kv_plane_buf(pool, 1, 1));
    /* every plane is a buffer of n_slots x bytes (host memory on the CPU: write all of it) */
    memset(lethe_kv_plane_buf(pool, 0, 0), 1, 16 * 40);
    memset(lethe_kv_plane_buf(pool, 1, 2), 1, 16 * 4);
    CHECK(lethe_kv_check(pool, NULL, 0) == LETHE_OK);
    lethe_kv_pool_destroy(pool);
    /* the format's own planes when none is declared */
    p.layouts = NULL;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_OK);
    CHECK(!lethe_kv_has_layout(pool));
    CHECK_EQ_INT(lethe_kv_layout_of(pool, 1)->planes[1].slot_bytes, 4 * sizeof(float));
    lethe_kv_pool_destroy(pool);
    /* refused: no planes, an empty plane, a layout over a quantized format */
    lethe_kv_layout bad[2] = {L[1], {.n_planes = 0}};
    p.layouts = bad;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_ERR_INVALID && !pool);
    CHECK(strstr(lethe_last_error(), "layer 1 layout has 0 planes"));
    bad[1] = L[1];
    bad[1].planes[1].slot_bytes = 0;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_ERR_INVALID);
    CHECK(strstr(lethe_last_error(), "plane 1 (norm) has 0 bytes"));
    bad[1] = L[1];
    p.format = LETHE_KV_FP8_E4M3;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_ERR_INVALID);
    CHECK(strstr(lethe_last_error(), "needs the native format"));
    lethe_backend_destroy(be);
}

/* The K/V buffers of a CPU pool are allocated untouched: lethe_kv_host_memory
 * reports all of them as allocated and, as resident, only the pages written
 * (slots 0..1023 of one layer's K: 512 KB), which is what lets the soak test
 * tell the KV pool's first-touched pages from any other RSS growth. A pool
 * without a backend has no host buffers. */
static void test_host_memory(void) {
    lethe_backend_params bp = {.device = "cpu", .n_threads = 1};
    lethe_backend *be = NULL;
    CHECK(lethe_backend_create(&bp, &be) == LETHE_OK);
    /* 40 MB per plane: above malloc's largest mmap threshold, so fresh pages */
    const int32_t n_slots = 81920, heads = 2, hd = 64;
    const int64_t plane = (int64_t)n_slots * heads * hd * (int64_t)sizeof(float);
    lethe_kv_pool_params p = {.n_layers = 2, .n_kv_heads = heads, .head_dim = hd, .n_slots = n_slots, .be = be};
    lethe_kv_pool *pool = NULL;
    CHECK_MSG(lethe_kv_pool_create(&p, &pool) == LETHE_OK, "%s", lethe_last_error());
    int64_t res0, alloc;
    CHECK(lethe_kv_host_memory(pool, &res0, &alloc));
    CHECK_EQ_INT(alloc, 4 * plane);
    CHECK_MSG(res0 <= 4 * 64 * 1024, "%lld bytes resident before any slot was written", (long long)res0);
    const int64_t written = 1024LL * heads * hd * (int64_t)sizeof(float);
    memset(lethe_kv_k(pool, 1), 1, (size_t)written);
    int64_t res1;
    CHECK(lethe_kv_host_memory(pool, &res1, &alloc));
    const int64_t page = sysconf(_SC_PAGESIZE);
    CHECK_MSG(res1 - res0 >= written - page && res1 - res0 <= written + 2 * page,
              "resident %lld -> %lld after writing %lld bytes", (long long)res0, (long long)res1,
              (long long)written);
    lethe_kv_pool_destroy(pool);
    lethe_backend_destroy(be);
    lethe_kv_pool *bare = mk(2, 64, false, 0);
    CHECK(!lethe_kv_host_memory(bare, &res0, &alloc) && res0 == 0 && alloc == 0);
    lethe_kv_pool_destroy(bare);
}

int main(void) {
    TEST_RUN(test_host_memory); /* first: before other tests' frees move malloc's mmap threshold */
    TEST_RUN(test_allocator);
    TEST_RUN(test_keep_shared);
    TEST_RUN(test_keep_per_layer);
    TEST_RUN(test_refs_and_attach);
    TEST_RUN(test_checker_catches_corruption);
    TEST_RUN(test_page_meta);
    TEST_RUN(test_random_shared);
    TEST_RUN(test_random_per_layer);
    TEST_RUN(test_scratch_slot);
    TEST_RUN(test_errors);
    TEST_RUN(test_layouts);
    return 0;
}

/* test_radix.c - prefix cache: insert/match (hash chain, full blocks, at
 * least one token left), acquire/release refcounts, LRU eviction of
 * unreferenced leaves, duplicates, per-layer blocks, and the KV ownership
 * checker with the cache as a holder after every operation. */
#include "cache/radix.h"
#include "core/util.h"
#include "test.h"

#define B LETHE_RADIX_BLOCK

static void check_all(lethe_kv_pool *pool, lethe_radix *r) {
    lethe_kv_holder h = lethe_radix_holder(r);
    lethe_status st = lethe_kv_check(pool, &h, 1);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
    st = lethe_radix_check(r);
    CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
}

static lethe_kv_pool *mk(int32_t n_slots, bool per_layer) {
    lethe_kv_pool_params p = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .n_slots = n_slots,
                              .per_layer = per_layer};
    lethe_kv_pool *pool = NULL;
    CHECK(lethe_kv_pool_create(&p, &pool) == LETHE_OK);
    return pool;
}

/* a row holding tokens 0..n of `toks`, computed privately */
static int32_t fill_row(lethe_kv_pool *pool, int32_t n) {
    int32_t row = lethe_kv_row_alloc(pool);
    int32_t *pos = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) pos[i] = i;
    CHECK(lethe_kv_row_append(pool, row, n, pos));
    free(pos);
    return row;
}

/* publishes every full block of the row; returns the chain */
static int32_t publish(lethe_radix *r, const int32_t *toks, int32_t n, int32_t row,
                       lethe_radix_block **chain) {
    int32_t nb = n / B;
    for (int32_t k = 0; k < nb; k++)
        chain[k] = lethe_radix_insert(r, k ? chain[k - 1] : NULL, toks + k * B, row, k * B);
    return nb;
}

static void test_insert_match(void) {
    lethe_kv_pool *pool = mk(256, false);
    lethe_radix *r = lethe_radix_create(pool, 42);
    int32_t toks[80], other[80];
    for (int i = 0; i < 80; i++) toks[i] = other[i] = 1000 + i;
    other[40] = 7; /* differs inside block 2 */
    lethe_radix_block *chain[8], *m[8];
    int32_t row = fill_row(pool, 50);
    CHECK_EQ_INT(publish(r, toks, 50, row, chain), 3);
    CHECK_EQ_INT(lethe_radix_n_blocks(r), 3);
    check_all(pool, r);
    /* the full prompt of 80: 3 cached blocks */
    CHECK_EQ_INT(lethe_radix_match(r, toks, 80, m, 8), 3);
    for (int k = 0; k < 3; k++) CHECK(m[k] == chain[k]);
    /* at least one token is left to compute: 48 tokens match only 2 blocks */
    CHECK_EQ_INT(lethe_radix_match(r, toks, 48, m, 8), 2);
    CHECK_EQ_INT(lethe_radix_match(r, toks, 49, m, 8), 3);
    CHECK_EQ_INT(lethe_radix_match(r, toks, 16, m, 8), 0);
    /* a difference in block 2 stops the match there */
    CHECK_EQ_INT(lethe_radix_match(r, other, 80, m, 8), 2);
    /* a block equal in tokens but under a different parent does not match */
    int32_t shifted[64];
    for (int i = 0; i < 64; i++) shifted[i] = toks[(i + 16) % 64];
    CHECK_EQ_INT(lethe_radix_match(r, shifted, 64, m, 8), 0);
    /* another fingerprint (model/method) never matches */
    lethe_radix *r2 = lethe_radix_create(pool, 43);
    CHECK_EQ_INT(lethe_radix_match(r2, toks, 80, m, 8), 0);
    lethe_radix_destroy(r2);
    /* hash chain: same tokens, different parents -> different ids */
    CHECK(lethe_radix_block_hash(chain[0]) != lethe_radix_block_hash(chain[1]));
    /* a duplicate insert returns the existing block and takes a reference */
    int32_t row2 = fill_row(pool, 16);
    lethe_radix_block *dup = lethe_radix_insert(r, NULL, toks, row2, 0);
    CHECK(dup == chain[0]);
    CHECK_EQ_INT(lethe_radix_block_req_refs(chain[0]), 2);
    CHECK_EQ_INT(lethe_radix_n_blocks(r), 3);
    check_all(pool, r);
    lethe_radix_release(r, &dup, 1);
    lethe_kv_row_release(pool, row2);
    lethe_radix_release(r, chain, 3);
    lethe_kv_row_release(pool, row);
    check_all(pool, r);
    /* only the cache holds the 48 block slots now */
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 256 - 48);
    CHECK_EQ_INT(lethe_radix_reclaimable(r), 48);
    lethe_radix_destroy(r);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 256);
    CHECK(lethe_kv_check(pool, NULL, 0) == LETHE_OK);
    lethe_kv_pool_destroy(pool);
}

static void test_acquire_release(void) {
    lethe_kv_pool *pool = mk(128, false);
    lethe_radix *r = lethe_radix_create(pool, 1);
    int32_t toks[40];
    for (int i = 0; i < 40; i++) toks[i] = i * 3;
    lethe_radix_block *chain[4], *m[4];
    int32_t row = fill_row(pool, 40);
    CHECK_EQ_INT(publish(r, toks, 40, row, chain), 2);
    const int32_t *src = lethe_kv_row_slots(pool, 0, row);
    int32_t first_slot = src[0], slot17 = src[17];
    lethe_radix_release(r, chain, 2);
    lethe_kv_row_release(pool, row);
    CHECK_EQ_INT(lethe_radix_n_unreferenced(r), 2);
    /* a new request attaches the cached prefix */
    int32_t nb = lethe_radix_match(r, toks, 40, m, 4);
    CHECK_EQ_INT(nb, 2);
    CHECK_EQ_INT(lethe_radix_count_unreferenced(m, nb), 2);
    int32_t row2 = lethe_kv_row_alloc(pool);
    lethe_radix_acquire(r, m, nb, row2);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 0, row2), 32);
    CHECK_EQ_INT(lethe_kv_row_slots(pool, 0, row2)[0], first_slot);
    CHECK_EQ_INT(lethe_kv_row_slots(pool, 0, row2)[17], slot17);
    CHECK_EQ_INT(lethe_kv_row_pos(pool, 0, row2)[31], 31);
    CHECK_EQ_INT(lethe_kv_refcount(pool, 0, first_slot), 2);
    CHECK_EQ_INT(lethe_radix_n_unreferenced(r), 0);
    CHECK_EQ_INT(lethe_radix_reclaimable(r), 0);
    check_all(pool, r);
    /* referenced blocks are never evicted */
    CHECK_EQ_INT(lethe_radix_evict(r, 128), 0);
    lethe_radix_release(r, m, nb);
    lethe_kv_row_release(pool, row2);
    check_all(pool, r);
    lethe_radix_destroy(r);
    lethe_kv_pool_destroy(pool);
}

static void test_lru_eviction(void) {
    lethe_kv_pool *pool = mk(16 * 8, false);
    lethe_radix *r = lethe_radix_create(pool, 9);
    int32_t a[48], b[48];
    for (int i = 0; i < 48; i++) { a[i] = i; b[i] = i < 16 ? i : 500 + i; } /* share block 0 */
    lethe_radix_block *ca[3], *cb[3], *m[3];
    int32_t ra = fill_row(pool, 48);
    publish(r, a, 48, ra, ca);
    int32_t rb = lethe_kv_row_alloc(pool);
    CHECK_EQ_INT(lethe_radix_match(r, b, 48, m, 3), 1);
    lethe_radix_acquire(r, m, 1, rb);
    int32_t pos[32];
    for (int i = 0; i < 32; i++) pos[i] = 16 + i;
    CHECK(lethe_kv_row_append(pool, rb, 32, pos));
    cb[0] = m[0];
    cb[1] = lethe_radix_insert(r, cb[0], b + 16, rb, 16);
    cb[2] = lethe_radix_insert(r, cb[1], b + 32, rb, 32);
    CHECK_EQ_INT(lethe_radix_n_blocks(r), 5);
    check_all(pool, r);
    /* a finishes first (older), then b */
    lethe_radix_release(r, ca, 3);
    lethe_kv_row_release(pool, ra);
    lethe_radix_release(r, cb, 3);
    lethe_kv_row_release(pool, rb);
    check_all(pool, r);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 128 - 80);
    CHECK_EQ_INT(lethe_radix_reclaimable(r), 80);
    /* want 64 free -> evict one block: a's leaf (least recently used) */
    CHECK_EQ_INT(lethe_radix_evict(r, 64), 1);
    CHECK_EQ_INT(lethe_radix_match(r, a, 48, m, 3), 2);
    CHECK_EQ_INT(lethe_radix_match(r, b, 48, m, 3), 2); /* b's chain untouched (2 of 3 usable) */
    check_all(pool, r);
    /* next: a's block 1 (now a leaf, older than b's) */
    CHECK_EQ_INT(lethe_radix_evict(r, 80), 1);
    CHECK_EQ_INT(lethe_radix_match(r, a, 48, m, 3), 1);
    check_all(pool, r);
    /* the shared block 0 has b's chain below it: b's leaves go first, block 0 last */
    CHECK_EQ_INT(lethe_radix_evict(r, 112), 2);
    CHECK_EQ_INT(lethe_radix_n_blocks(r), 1);
    CHECK_EQ_INT(lethe_radix_match(r, b, 48, m, 3), 1);
    CHECK_EQ_INT(lethe_radix_evict(r, 1000), 1);
    CHECK_EQ_INT(lethe_radix_n_blocks(r), 0);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), 128);
    check_all(pool, r);
    /* a re-used (acquired) block moves to the back of the LRU order */
    int32_t rc = fill_row(pool, 32), rd = 0;
    lethe_radix_block *cc[2], *cd[2];
    publish(r, a, 32, rc, cc);
    lethe_radix_release(r, cc, 2);
    lethe_kv_row_release(pool, rc);
    rd = fill_row(pool, 32);
    publish(r, b + 16, 32, rd, cd); /* unrelated chain, newer */
    lethe_radix_release(r, cd, 2);
    lethe_kv_row_release(pool, rd);
    int32_t re = lethe_kv_row_alloc(pool);
    CHECK_EQ_INT(lethe_radix_match(r, a, 33, m, 3), 2);
    lethe_radix_acquire(r, m, 2, re);  /* touch a's chain */
    lethe_radix_release(r, m, 2);
    lethe_kv_row_release(pool, re);
    CHECK_EQ_INT(lethe_radix_evict(r, 128 - 48), 1); /* evicts the other chain's leaf */
    CHECK_EQ_INT(lethe_radix_match(r, a, 33, m, 3), 2);
    check_all(pool, r);
    lethe_radix_destroy(r);
    lethe_kv_pool_destroy(pool);
}

static void test_per_layer_blocks(void) {
    lethe_kv_pool *pool = mk(64, true);
    lethe_radix *r = lethe_radix_create(pool, 5);
    int32_t toks[33];
    for (int i = 0; i < 33; i++) toks[i] = 7 * i;
    lethe_radix_block *c[2], *m[2];
    int32_t row = fill_row(pool, 33);
    publish(r, toks, 33, row, c);
    lethe_radix_release(r, c, 2);
    lethe_kv_row_release(pool, row);
    for (int32_t sp = 0; sp < 2; sp++) CHECK_EQ_INT(lethe_kv_n_free(pool, sp), 64 - 32);
    check_all(pool, r);
    int32_t row2 = lethe_kv_row_alloc(pool);
    CHECK_EQ_INT(lethe_radix_match(r, toks, 33, m, 2), 2);
    lethe_radix_acquire(r, m, 2, row2);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 0, row2), 32);
    CHECK_EQ_INT(lethe_kv_row_len(pool, 1, row2), 32);
    check_all(pool, r);
    lethe_radix_release(r, m, 2);
    lethe_kv_row_release(pool, row2);
    CHECK_EQ_INT(lethe_radix_evict(r, 64), 2);
    for (int32_t sp = 0; sp < 2; sp++) CHECK_EQ_INT(lethe_kv_n_free(pool, sp), 64);
    check_all(pool, r);
    lethe_radix_destroy(r);
    lethe_kv_pool_destroy(pool);
}

/* many random prompts from a few shared prefixes, random finish order, random
 * eviction pressure; checks after every operation; the hash table and heap
 * grow past their initial sizes */
static void test_random(void) {
    enum { S = 4096, R = 12 };
    lethe_kv_pool *pool = mk(S, false);
    lethe_radix *r = lethe_radix_create(pool, 77);
    uint64_t rng = 11;
    int32_t toks[R][160], n[R], row[R], nblk[R];
    lethe_radix_block *chain[R][10], *m[10];
    bool live[R] = {0};
    int32_t pos[160];
    for (int i = 0; i < 160; i++) pos[i] = i;
    for (int it = 0; it < 3000; it++) {
        int32_t i = (int32_t)(lethe_splitmix64(&rng) % R);
        if (!live[i]) {
            int32_t fam = (int32_t)(lethe_splitmix64(&rng) % 4);
            n[i] = 20 + (int32_t)(lethe_splitmix64(&rng) % 140);
            int32_t shared = (int32_t)(lethe_splitmix64(&rng) % 100);
            for (int32_t k = 0; k < n[i]; k++)
                toks[i][k] = k < shared ? fam * 1000 + k : (int32_t)(lethe_splitmix64(&rng) % 50000);
            nblk[i] = lethe_radix_match(r, toks[i], n[i], m, 10);
            int32_t hit = nblk[i] * B;
            int64_t avail = lethe_kv_min_free(pool) + lethe_radix_reclaimable(r) -
                            (int64_t)lethe_radix_count_unreferenced(m, nblk[i]) * B;
            if (avail < n[i] - hit) continue;
            row[i] = lethe_kv_row_alloc(pool);
            for (int32_t k = 0; k < nblk[i]; k++) chain[i][k] = m[k];
            lethe_radix_acquire(r, m, nblk[i], row[i]);
            if (lethe_kv_min_free(pool) < n[i] - hit) lethe_radix_evict(r, n[i] - hit);
            CHECK(lethe_kv_row_append(pool, row[i], n[i] - hit, pos + hit));
            for (int32_t k = nblk[i]; k < n[i] / B; k++)
                chain[i][k] = lethe_radix_insert(r, k ? chain[i][k - 1] : NULL, toks[i] + k * B, row[i], k * B);
            nblk[i] = n[i] / B;
            live[i] = true;
        } else {
            lethe_radix_release(r, chain[i], nblk[i]);
            lethe_kv_row_release(pool, row[i]);
            live[i] = false;
        }
        check_all(pool, r);
    }
    for (int32_t i = 0; i < R; i++)
        if (live[i]) {
            lethe_radix_release(r, chain[i], nblk[i]);
            lethe_kv_row_release(pool, row[i]);
        }
    check_all(pool, r);
    CHECK(lethe_radix_n_blocks(r) > 0);
    lethe_radix_evict(r, S);
    CHECK_EQ_INT(lethe_radix_n_blocks(r), 0);
    CHECK_EQ_INT(lethe_kv_n_free(pool, 0), S);
    lethe_radix_destroy(r);
    lethe_kv_pool_destroy(pool);
}

int main(void) {
    TEST_RUN(test_insert_match);
    TEST_RUN(test_acquire_release);
    TEST_RUN(test_lru_eviction);
    TEST_RUN(test_per_layer_blocks);
    TEST_RUN(test_random);
    return 0;
}

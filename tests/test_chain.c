/* test_chain.c - the Chain Cache table on its own (no engine): ids,
 * digest, create/resume/recreate, append mode, busy, fingerprint mismatch,
 * strict LRU reclaim, ACTIVE chains never reclaimed, capacity refusal that
 * reclaims nothing, bounded tombstones, payload hand-over and release. */
#include "cache/chain.h"

#include <string.h>

#include "core/util.h"
#include "server/chain_api.h" /* the HTTP mapping of chain codes */
#include "test.h"

static uint8_t FP[LETHE_CHAIN_FP_BYTES], FP2[LETHE_CHAIN_FP_BYTES];

static void begin(lethe_chain_table *t, const char *id, const int32_t *toks, int32_t n, bool append,
                  int32_t gen, lethe_chain_turn *out) {
    lethe_chain_begin_args a = {.chain_id = id, .fingerprint = FP, .tokens = toks, .n_tokens = n,
                                .append = append, .gen_peak = gen};
    lethe_chain_begin(t, &a, out);
}

static void seq(int32_t *a, int32_t n, int32_t base) {
    for (int32_t i = 0; i < n; i++) a[i] = base + i;
}

/* finishes a turn: history = prompt + `gen` tokens, resident = r per space */
static void finish(lethe_chain_table *t, lethe_chain_turn *turn, int32_t gen, int32_t res, void *payload) {
    int32_t n = turn->n_tokens + gen;
    int32_t *h = lethe_xmalloc((size_t)n * sizeof(int32_t));
    memcpy(h, turn->tokens, (size_t)turn->n_tokens * sizeof(int32_t));
    for (int32_t i = 0; i < gen; i++) h[turn->n_tokens + i] = 9000 + i;
    int32_t resident[2] = {res, res};
    lethe_chain_finish(t, turn->id, h, n, n - 1, resident, payload);
    free(h);
    free(turn->tokens);
    turn->tokens = NULL;
}

static void test_ids_and_digest(void) {
    char a[LETHE_CHAIN_ID_CAP], b[LETHE_CHAIN_ID_CAP];
    CHECK(lethe_chain_new_id(a) == 0 && lethe_chain_new_id(b) == 0);
    CHECK_EQ_INT(strlen(a), 6 + 32); /* 24 random bytes = 192 bits = 32 base64url chars */
    CHECK(strncmp(a, "chain_", 6) == 0);
    CHECK(strcmp(a, b) != 0);
    for (const char *p = a + 6; *p; p++)
        CHECK((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-' ||
              *p == '_');
    /* SHA-256 of the int64-LE encoding: known value for [1] (01 00 .. 00) */
    int32_t one = 1;
    uint8_t d[32];
    lethe_chain_digest(&one, 1, d);
    static const uint8_t want[8] = {0x7c, 0x9f, 0xa1, 0x36, 0xd4, 0x41, 0x3f, 0xa6};
    CHECK(memcmp(d, want, 8) == 0);
    /* large inputs cross the internal buffer boundary */
    int32_t big[600], big2[600];
    seq(big, 600, 5);
    seq(big2, 600, 5);
    uint8_t d1[32], d2[32];
    lethe_chain_digest(big, 600, d1);
    lethe_chain_digest(big2, 600, d2);
    CHECK(memcmp(d1, d2, 32) == 0);
    big2[599]++;
    lethe_chain_digest(big2, 600, d2);
    CHECK(memcmp(d1, d2, 32) != 0);
    CHECK_EQ_INT(srv_chain_http_status(LETHE_CHAIN_GONE), 410);
    CHECK_EQ_INT(srv_chain_http_status(LETHE_CHAIN_CAPACITY), 503);
    CHECK_EQ_INT(srv_chain_http_status(LETHE_CHAIN_BUSY), 409);
    CHECK_EQ_INT(srv_chain_http_status(LETHE_CHAIN_NOT_FOUND), 404);
    CHECK(strcmp(srv_chain_code_name(LETHE_CHAIN_CAPACITY), "chain_capacity_unavailable") == 0);
}

static void test_turns(void) {
    lethe_chain_table_params p = {.n_spaces = 2, .slots_per_space = 1000};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t prompt[100];
    seq(prompt, 100, 1);
    lethe_chain_turn t1;
    begin(t, NULL, prompt, 50, false, 10, &t1);
    CHECK_EQ_INT(t1.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(t1.status, LETHE_CHAIN_CREATED);
    CHECK_EQ_INT(t1.reused, 0);
    CHECK(lethe_chain_take_payload(t, t1.id) == NULL);
    char id[LETHE_CHAIN_ID_CAP];
    strcpy(id, t1.id);
    /* busy while ACTIVE */
    lethe_chain_turn b;
    begin(t, id, prompt, 60, false, 10, &b);
    CHECK_EQ_INT(b.code, LETHE_CHAIN_BUSY);
    int payload1 = 1;
    finish(t, &t1, 5, 40, &payload1); /* history 55 tokens, processed 54 */
    lethe_chain_info info;
    CHECK_EQ_INT(lethe_chain_lookup(t, id, &info), LETHE_CHAIN_OK);
    CHECK_EQ_INT(info.state, LETHE_CHAIN_IDLE);
    CHECK_EQ_INT(info.processed, 54);
    CHECK_EQ_INT(info.n_history, 55);
    CHECK_EQ_INT(info.resident_total, 80);

    /* full-prompt resume: history + new tokens */
    int32_t hist[55];
    CHECK_EQ_INT(lethe_chain_history(t, id, hist, 55), 55);
    int32_t next[70];
    memcpy(next, hist, sizeof(hist));
    seq(next + 55, 15, 500);
    lethe_chain_turn t2;
    begin(t, id, next, 70, false, 10, &t2);
    CHECK_EQ_INT(t2.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(t2.status, LETHE_CHAIN_RESUMED);
    CHECK_EQ_INT(t2.reused, 54);
    CHECK_EQ_INT(lethe_chain_count_payloads(t), 1); /* still in the record until taken */
    CHECK(lethe_chain_take_payload(t, t2.id) == &payload1);
    CHECK_EQ_INT(lethe_chain_count_payloads(t), 0);
    CHECK_EQ_INT(t2.n_tokens, 70);
    finish(t, &t2, 3, 30, &payload1); /* history 73 */

    /* append mode: only the new tokens */
    int32_t app[7];
    seq(app, 7, 700);
    lethe_chain_turn t3;
    begin(t, id, app, 7, true, 4, &t3);
    CHECK_EQ_INT(t3.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(t3.status, LETHE_CHAIN_RESUMED);
    CHECK_EQ_INT(t3.n_tokens, 80);
    CHECK_EQ_INT(t3.reused, 72);
    CHECK_EQ_INT(t3.tokens[72], 9002); /* the last sampled token starts the suffix */
    CHECK_EQ_INT(t3.tokens[73], 700);
    CHECK(lethe_chain_take_payload(t, t3.id) == &payload1);
    finish(t, &t3, 2, 30, &payload1);

    /* fingerprint mismatch */
    lethe_chain_begin_args fa = {.chain_id = id, .fingerprint = FP2, .tokens = app, .n_tokens = 7, .append = true};
    lethe_chain_turn f;
    lethe_chain_begin(t, &fa, &f);
    CHECK_EQ_INT(f.code, LETHE_CHAIN_FINGERPRINT_MISMATCH);
    CHECK_EQ_INT(srv_chain_http_status(f.code), 409);

    /* digest mismatch in full-prompt mode: recreate, old payload released */
    int32_t other[90];
    seq(other, 90, 3);
    lethe_chain_turn t4;
    begin(t, id, other, 90, false, 4, &t4);
    CHECK_EQ_INT(t4.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(t4.status, LETHE_CHAIN_RECREATED);
    CHECK_EQ_INT(t4.reused, 0);
    CHECK(lethe_chain_take_payload(t, t4.id) == NULL);
    CHECK(strcmp(t4.id, id) == 0);
    void *rel[4];
    CHECK_EQ_INT(lethe_chain_take_released(t, rel, 4), 1);
    CHECK(rel[0] == &payload1);
    int payload2 = 2;
    finish(t, &t4, 2, 10, &payload2);

    /* prompt not longer than the boundary: recreate too (full mode) */
    lethe_chain_turn t5;
    begin(t, id, other, 50, false, 4, &t5);
    CHECK_EQ_INT(t5.status, LETHE_CHAIN_RECREATED);
    CHECK_EQ_INT(lethe_chain_take_released(t, rel, 4), 1);
    finish(t, &t5, 1, 10, &payload2);

    /* digest mismatch in append mode is impossible by construction (the table
     * appends to its own history); a shorter history via a mismatching
     * full prompt then an append keeps working */
    lethe_chain_turn t6;
    begin(t, id, app, 3, true, 4, &t6);
    CHECK_EQ_INT(t6.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(t6.status, LETHE_CHAIN_RESUMED);

    /* abandon before the payload was taken: the record's payload and the
     * caller's are both queued; tombstone */
    int payload3 = 3;
    lethe_chain_abandon(t, id, &payload3);
    CHECK_EQ_INT(lethe_chain_lookup(t, id, NULL), LETHE_CHAIN_GONE);
    CHECK_EQ_INT(lethe_chain_take_released(t, rel, 4), 2);
    CHECK(rel[0] == &payload2 || rel[1] == &payload2);
    CHECK(rel[0] == &payload3 || rel[1] == &payload3);
    free(t6.tokens);
    lethe_chain_turn g;
    begin(t, id, app, 3, true, 4, &g);
    CHECK_EQ_INT(g.code, LETHE_CHAIN_GONE);
    begin(t, "chain_doesnotexist", app, 3, true, 4, &g);
    CHECK_EQ_INT(g.code, LETHE_CHAIN_NOT_FOUND);
    begin(t, NULL, app, 3, true, 4, &g);
    CHECK_EQ_INT(g.code, LETHE_CHAIN_BAD_REQUEST);

    lethe_chain_stats st;
    lethe_chain_get_stats(t, &st);
    CHECK_EQ_INT(st.n_created, 1);
    CHECK_EQ_INT(st.n_resumed, 3);
    CHECK_EQ_INT(st.n_recreated, 2);
    CHECK_EQ_INT(st.n_invalidated, 1);
    CHECK_EQ_INT(st.reused_tokens, 54 + 72 + 0 + 0 + 50); /* t6 reused t5's processed boundary (50) */
    lethe_chain_destroy(t);
}

static void test_prefix_mismatch_append(void) {
    /* the boundary is past the history when nothing is resident: finish with
     * payload NULL sets processed 0; an append then resumes from 0 */
    lethe_chain_table_params p = {.n_spaces = 1, .slots_per_space = 100};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t a[10];
    seq(a, 10, 1);
    lethe_chain_turn t1;
    begin(t, NULL, a, 10, false, 0, &t1);
    char id[LETHE_CHAIN_ID_CAP];
    strcpy(id, t1.id);
    int32_t res = 0;
    lethe_chain_finish(t, id, t1.tokens, 10, 9, &res, NULL);
    free(t1.tokens);
    lethe_chain_info info;
    lethe_chain_lookup(t, id, &info);
    CHECK_EQ_INT(info.processed, 0);
    /* full prompt that diverges from history at token 0 with processed 0: resumed (nothing to check) */
    lethe_chain_turn t2;
    begin(t, id, a + 1, 5, false, 0, &t2);
    CHECK_EQ_INT(t2.status, LETHE_CHAIN_RESUMED);
    CHECK_EQ_INT(t2.reused, 0);
    int one = 1;
    res = 5;
    lethe_chain_finish(t, id, t2.tokens, 5, 4, &res, &one);
    free(t2.tokens);
    /* append of zero tokens: prompt == history, not longer than processed+... it is: 5 > 4 */
    lethe_chain_turn t3;
    begin(t, id, a, 0, true, 0, &t3);
    CHECK_EQ_INT(t3.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(t3.reused, 4);
    lethe_chain_finish(t, id, t3.tokens, 5, 4, &res, lethe_chain_take_payload(t, id));
    free(t3.tokens);
    lethe_chain_destroy(t);
}

static void test_lru_capacity_tombstones(void) {
    /* 2 spaces of 100 slots; chains use 30 slots each when idle */
    lethe_chain_table_params p = {.n_spaces = 2, .slots_per_space = 100, .max_tombstones = 2};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t toks[200];
    seq(toks, 200, 1);
    char ids[4][LETHE_CHAIN_ID_CAP];
    int payloads[4];
    for (int i = 0; i < 3; i++) {
        lethe_chain_turn tt;
        begin(t, NULL, toks, 20, false, 10, &tt); /* need 30 */
        CHECK_EQ_INT(tt.code, LETHE_CHAIN_OK);
        strcpy(ids[i], tt.id);
        finish(t, &tt, 1, 30, &payloads[i]);
    }
    /* touch chain 0 so that chain 1 becomes the least recently used */
    int32_t h[32];
    CHECK_EQ_INT(lethe_chain_history(t, ids[0], h, 32), 21);
    lethe_chain_turn r0;
    begin(t, ids[0], toks, 0, true, 0, &r0);
    CHECK_EQ_INT(r0.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(r0.status, LETHE_CHAIN_RESUMED);
    int32_t res[2] = {30, 30};
    lethe_chain_finish(t, ids[0], r0.tokens, r0.n_tokens, r0.n_tokens - 1, res,
                       lethe_chain_take_payload(t, r0.id));
    free(r0.tokens);
    /* the list: most recently used first (chain 0, then 2, then 1), with the
     * history and resident slots of each */
    lethe_chain_entry ent[4];
    CHECK_EQ_INT(lethe_chain_list(t, NULL, 0), 3);
    CHECK_EQ_INT(lethe_chain_list(t, ent, 2), 3); /* copies 2 of 3 */
    CHECK(!strcmp(ent[0].id, ids[0]) && !strcmp(ent[1].id, ids[2]));
    CHECK_EQ_INT(lethe_chain_list(t, ent, 4), 3);
    CHECK(!strcmp(ent[2].id, ids[1]));
    CHECK_EQ_INT(ent[0].info.n_history, 21);
    CHECK_EQ_INT(ent[0].info.resident_total, 60);
    CHECK_EQ_INT(ent[0].info.resident_max, 30);
    CHECK_EQ_INT(ent[2].info.state, LETHE_CHAIN_IDLE);
    /* usage 90; a new chain needing 25 must reclaim exactly one: chain 1 (LRU) */
    lethe_chain_turn n1;
    begin(t, NULL, toks, 20, false, 5, &n1);
    CHECK_EQ_INT(n1.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(n1.n_reclaimed, 1);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[1], NULL), LETHE_CHAIN_GONE);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[2], NULL), LETHE_CHAIN_OK);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[0], NULL), LETHE_CHAIN_OK);
    void *rel[4];
    CHECK_EQ_INT(lethe_chain_take_released(t, rel, 4), 1);
    CHECK(rel[0] == &payloads[1]);
    strcpy(ids[3], n1.id);
    /* n1 is ACTIVE with 25 reserved; usage = 30 + 30 + 25 = 85. A turn that
     * needs 80 cannot fit even reclaiming both idle chains (85 - 60 + 80 > 100):
     * refused with CAPACITY and nothing reclaimed */
    lethe_chain_turn big;
    begin(t, NULL, toks, 70, false, 10, &big);
    CHECK_EQ_INT(big.code, LETHE_CHAIN_CAPACITY);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[2], NULL), LETHE_CHAIN_OK);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[0], NULL), LETHE_CHAIN_OK);
    CHECK_EQ_INT(lethe_chain_take_released(t, rel, 4), 0);
    /* needing 70: reclaims chain 2 (older) then chain 0 */
    lethe_chain_turn mid;
    begin(t, NULL, toks, 60, false, 10, &mid);
    CHECK_EQ_INT(mid.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(mid.n_reclaimed, 2);
    CHECK_EQ_INT(lethe_chain_take_released(t, rel, 4), 2);
    /* tombstones are bounded (2): chain 1 was forgotten, now unknown */
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[1], NULL), LETHE_CHAIN_NOT_FOUND);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[2], NULL), LETHE_CHAIN_GONE);
    CHECK_EQ_INT(lethe_chain_lookup(t, ids[0], NULL), LETHE_CHAIN_GONE);
    /* two ACTIVE chains (25 + 70): an idle-free table refuses a third */
    lethe_chain_turn x;
    begin(t, NULL, toks, 10, false, 0, &x);
    CHECK_EQ_INT(x.code, LETHE_CHAIN_CAPACITY);
    lethe_chain_stats st;
    lethe_chain_get_stats(t, &st);
    CHECK_EQ_INT(st.n_active, 2);
    CHECK_EQ_INT(st.n_reclaimed, 3);
    CHECK_EQ_INT(st.n_capacity_rejected, 2);
    CHECK_EQ_INT(st.reserved_slots, 2 * (25 + 70));
    int pn = 0, pm = 0;
    finish(t, &n1, 1, 10, &pn);
    finish(t, &mid, 1, 10, &pm);
    CHECK_EQ_INT(lethe_chain_drain_all(t, rel, 4), 2);
    lethe_chain_destroy(t);
}

/* per-layer capacity: one tight space decides */
static void test_per_space(void) {
    lethe_chain_table_params p = {.n_spaces = 2, .slots_per_space = 50};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t toks[40];
    seq(toks, 40, 1);
    lethe_chain_turn a;
    begin(t, NULL, toks, 10, false, 0, &a);
    int32_t h[11];
    memcpy(h, a.tokens, 10 * sizeof(int32_t));
    h[10] = 77;
    int32_t res[2] = {5, 40}; /* layer 1 kept much more */
    int pa = 0;
    lethe_chain_finish(t, a.id, h, 11, 10, res, &pa);
    free(a.tokens);
    lethe_chain_turn b;
    begin(t, NULL, toks, 15, false, 0, &b); /* 15 + 40 > 50 in space 1 only */
    CHECK_EQ_INT(b.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(b.n_reclaimed, 1);
    free(b.tokens);
    lethe_chain_destroy(t);
}

/* chat bookkeeping: append_start must equal the messages the chain covers */
static void test_append_messages(void) {
    lethe_chain_table_params p = {.n_spaces = 1, .slots_per_space = 1000};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t toks[40];
    seq(toks, 40, 1);
    lethe_chain_begin_args a = {.fingerprint = FP, .tokens = toks, .n_tokens = 20, .n_messages = 2};
    lethe_chain_turn t1;
    lethe_chain_begin(t, &a, &t1);
    CHECK_EQ_INT(t1.code, LETHE_CHAIN_OK);
    int pl = 0;
    int32_t res = 20;
    lethe_chain_finish(t, t1.id, t1.tokens, 20, 19, &res, &pl);
    lethe_chain_info info;
    lethe_chain_lookup(t, t1.id, &info);
    CHECK_EQ_INT(info.n_messages, 3); /* system/user + the assistant response */
    lethe_chain_begin_args b = {.chain_id = t1.id, .fingerprint = FP, .tokens = toks, .n_tokens = 5,
                                .append = true, .append_start = 2, .n_messages = 4};
    lethe_chain_turn bad;
    lethe_chain_begin(t, &b, &bad);
    CHECK_EQ_INT(bad.code, LETHE_CHAIN_PREFIX_MISMATCH);
    CHECK_EQ_INT(srv_chain_http_status(bad.code), 409);
    CHECK_STR_CONTAINS(bad.message, "start at 2, the chain covers 3");
    b.append_start = 3;
    lethe_chain_turn ok;
    lethe_chain_begin(t, &b, &ok);
    CHECK_EQ_INT(ok.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(ok.reused, 19);
    CHECK_EQ_INT(ok.n_tokens, 25);
    lethe_chain_finish(t, ok.id, ok.tokens, 25, 24, &res, lethe_chain_take_payload(t, ok.id));
    lethe_chain_lookup(t, t1.id, &info);
    CHECK_EQ_INT(info.n_messages, 5);
    free(t1.tokens);
    free(ok.tokens);
    lethe_chain_destroy(t);
}

/* A chain belongs to the owner that created it: another owner gets NOT_FOUND for
 * the live chain and for its tombstone (never GONE, BUSY or a recreate), and
 * its attempts change nothing. */
static void test_owners(void) {
    lethe_chain_table_params p = {.n_spaces = 1, .slots_per_space = 100};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t toks[40];
    seq(toks, 40, 1);
    lethe_chain_begin_args a = {.owner = "alice", .fingerprint = FP, .tokens = toks, .n_tokens = 10, .gen_peak = 2};
    lethe_chain_turn tt;
    lethe_chain_begin(t, &a, &tt);
    CHECK_EQ_INT(tt.code, LETHE_CHAIN_OK);
    char id[LETHE_CHAIN_ID_CAP];
    strcpy(id, tt.id);
    /* while ACTIVE, bob does not learn that it is busy */
    lethe_chain_begin_args b = a;
    b.owner = "bob";
    b.chain_id = id;
    lethe_chain_turn bt;
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_NOT_FOUND);
    CHECK_STR_CONTAINS(bt.message, "unknown chain_id");
    finish(t, &tt, 1, 11, NULL);
    /* IDLE: bob's full prompt (which would recreate it) is refused; the anonymous owner too */
    b.n_tokens = 20;
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_NOT_FOUND);
    b.owner = NULL;
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_NOT_FOUND);
    lethe_chain_stats st;
    lethe_chain_get_stats(t, &st);
    CHECK_EQ_INT(st.n_recreated, 0);
    /* alice resumes */
    a.chain_id = id;
    a.n_tokens = 20;
    lethe_chain_turn at;
    lethe_chain_begin(t, &a, &at);
    CHECK_EQ_INT(at.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(at.status, LETHE_CHAIN_RESUMED);
    /* abandoned -> tombstone: GONE for alice, NOT_FOUND for bob */
    lethe_chain_abandon(t, id, NULL);
    free(at.tokens);
    lethe_chain_begin(t, &a, &at);
    CHECK_EQ_INT(at.code, LETHE_CHAIN_GONE);
    b.owner = "bob";
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_NOT_FOUND);
    lethe_chain_destroy(t);
}

/* A new chain named by a load balancer (new_id): it gets that id, resumes by
 * it; an id in use or tombstoned (for any owner) or malformed is refused
 * before anything changes; with a chain_id the new id plays no part. */
static void test_named_new_chain(void) {
    CHECK(lethe_chain_id_valid("chain_0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"));
    CHECK(lethe_chain_id_valid("abcdefgh") && !lethe_chain_id_valid("abcdefg"));
    CHECK(!lethe_chain_id_valid("chain_with space") && !lethe_chain_id_valid("chain_crlf\r\nX: y"));
    CHECK(!lethe_chain_id_valid(NULL) && !lethe_chain_id_valid("chain_\xc3\xa9t\xc3\xa9"));
    char longest[LETHE_CHAIN_ID_CAP + 1];
    memset(longest, 'a', LETHE_CHAIN_ID_CAP - 1);
    longest[LETHE_CHAIN_ID_CAP - 1] = 0;
    CHECK(lethe_chain_id_valid(longest));
    longest[LETHE_CHAIN_ID_CAP - 1] = 'a';
    longest[LETHE_CHAIN_ID_CAP] = 0;
    CHECK(!lethe_chain_id_valid(longest));

    lethe_chain_table_params p = {.n_spaces = 1, .slots_per_space = 100};
    lethe_chain_table *t = lethe_chain_create(&p);
    int32_t toks[40];
    seq(toks, 40, 1);
    const char *named = "chain_0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9";
    lethe_chain_begin_args a = {.new_id = named,
                                .owner = "alice",
                                .fingerprint = FP,
                                .tokens = toks,
                                .n_tokens = 10,
                                .gen_peak = 2};
    lethe_chain_turn tt;
    lethe_chain_begin(t, &a, &tt);
    CHECK_EQ_INT(tt.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(tt.status, LETHE_CHAIN_CREATED);
    CHECK(!strcmp(tt.id, named));
    finish(t, &tt, 1, 11, NULL);
    /* taken: refused for any owner, nothing created */
    lethe_chain_begin_args b = a;
    b.owner = "bob";
    lethe_chain_turn bt;
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_BAD_REQUEST);
    CHECK_STR_CONTAINS(bt.message, "already taken");
    b.new_id = "bad id!";
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_BAD_REQUEST);
    lethe_chain_stats st;
    lethe_chain_get_stats(t, &st);
    CHECK_EQ_INT(st.n_chains, 1);
    CHECK_EQ_INT(st.n_created, 1);
    /* resumed by that id; new_id is ignored when a chain_id is given */
    a.chain_id = named;
    a.new_id = "chain_ignored-when-resuming";
    a.n_tokens = 20;
    lethe_chain_begin(t, &a, &tt);
    CHECK_EQ_INT(tt.code, LETHE_CHAIN_OK);
    CHECK_EQ_INT(tt.status, LETHE_CHAIN_RESUMED);
    CHECK(!strcmp(tt.id, named));
    /* tombstoned: still taken */
    lethe_chain_abandon(t, named, NULL);
    free(tt.tokens);
    b.new_id = named;
    b.owner = "alice";
    lethe_chain_begin(t, &b, &bt);
    CHECK_EQ_INT(bt.code, LETHE_CHAIN_BAD_REQUEST);
    lethe_chain_destroy(t);
}

int main(void) {
    lethe_chain_fingerprint("model=a,method=dense", FP);
    lethe_chain_fingerprint("model=a,method=snapkv", FP2);
    CHECK(memcmp(FP, FP2, sizeof(FP)) != 0);
    test_ids_and_digest();
    test_turns();
    test_prefix_mismatch_append();
    test_lru_capacity_tombstones();
    test_per_space();
    test_append_messages();
    test_owners();
    test_named_new_chain();
    printf("test_chain: ok\n");
    return 0;
}

/* chain_cache.c - the Chain Cache table (chain.c) as a prefix cache.
 *
 * A chain's payload is {row, method state}: the KV row of the last turn
 * (possibly compacted per layer by the method) and the method's per-request
 * state (SnapKV's score vectors...), kept as they were when the turn ended:
 * nothing is copied or serialized. A turn's request carries a chain_ref
 * (chain id, reused tokens). Its life:
 *
 *   begin_turn (any thread)  lethe_chain_begin: lookup, state, fingerprint,
 *                            digest, capacity (may reclaim IDLE chains: their
 *                            payloads are queued for release); the full prompt
 *                            (history + appended tokens) becomes the request.
 *   drain (engine thread)    queued payloads are freed (row + method state);
 *                            the engine drains before it admits new turns, so
 *                            a turn that made room finds it free.
 *   match / acquire          a resumed turn's payload is handed to the request
 *                            at its first admission: the scheduler runs it on
 *                            that row with n_computed = the processed
 *                            boundary, so only the suffix is prefilled and the
 *                            method continues from its state.
 *   release OK               row and state are detached from the request
 *                            before the scheduler frees it; boundary =
 *                            n_computed (the last sampled token has no KV
 *                            yet), history = all tokens, resident = row length
 *                            per slot space.
 *   release FAILED           the chain is invalidated (tombstone) and its KV
 *                            freed at once.
 *   release PREEMPTED        nothing: the request loses its row like any other
 *                            and recomputes its whole prompt; the chain then
 *                            continues from the recomputed KV. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/prefix_cache.h"
#include "core/util.h"

typedef struct chain_kv {
    int32_t row;
    void *state;
} chain_kv;

typedef struct chain_ref {
    char id[LETHE_CHAIN_ID_CAP];
    int32_t reused; /* tokens with resident KV at the turn's start */
    bool admitted;  /* admitted once: a readmission (after preemption) recomputes */
} chain_ref;

typedef struct chain_cache {
    lethe_prefix_cache base; /* must stay first */
    lethe_chain_table *t;
    uint8_t fp[LETHE_CHAIN_FP_BYTES];
} chain_cache;

static chain_cache *cc_of(lethe_prefix_cache *pc) { return (chain_cache *)pc; }

static void kv_free(chain_cache *cc, chain_kv *k) {
    if (!k) return;
    if (k->row >= 0) lethe_kv_row_release(cc->base.pool, k->row);
    if (k->state) {
        LETHE_ASSERT(cc->base.release_state);
        cc->base.release_state(cc->base.release_ctx, k->state);
    }
    free(k);
}

static int32_t row_resident(const lethe_kv_pool *pool, int32_t row) {
    int32_t m = 0;
    for (int32_t sp = 0; sp < lethe_kv_n_spaces(pool); sp++)
        m = LETHE_MAX(m, lethe_kv_row_len(pool, sp, row));
    return m;
}

static void cc_match(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_match *out) {
    chain_cache *cc = cc_of(pc);
    const chain_ref *c = *s->ref;
    const chain_kv *k = c && !c->admitted ? lethe_chain_turn_payload(cc->t, c->id) : NULL;
    if (!k) return; /* a new, recreated or readmitted turn computes from 0 */
    out->tokens = c->reused;
    out->resident = row_resident(pc->pool, k->row);
    out->resume = true;
}

static void cc_acquire(lethe_prefix_cache *pc, const lethe_pc_seq *s, const lethe_pc_match *m) {
    chain_ref *c = *s->ref;
    if (c) c->admitted = true;
    if (!m->resume) return;
    LETHE_ASSERT(c && *s->row < 0 && !*s->method_state);
    chain_kv *k = lethe_chain_take_payload(cc_of(pc)->t, c->id);
    LETHE_ASSERT(k);
    *s->row = k->row;
    *s->method_state = k->state;
    free(k);
}

static void cc_drain(lethe_prefix_cache *pc) {
    chain_cache *cc = cc_of(pc);
    void *buf[64];
    int32_t n;
    do {
        n = lethe_chain_take_released(cc->t, buf, 64);
        for (int32_t i = 0; i < n; i++) kv_free(cc, buf[i]);
    } while (n == 64);
}

static void cc_release(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_end how) {
    chain_cache *cc = cc_of(pc);
    chain_ref *c = *s->ref;
    if (!c || how == LETHE_PC_END_PREEMPTED) return;
    chain_kv *k = NULL;
    if (*s->row >= 0) { /* running: detach the row and state before the scheduler frees them */
        k = lethe_xmalloc(sizeof(*k));
        k->row = *s->row;
        k->state = *s->method_state;
        *s->row = -1;
        *s->method_state = NULL;
    }
    if (how == LETHE_PC_END_FAILED) { /* on the engine thread: the KV goes now */
        lethe_chain_abandon(cc->t, c->id, NULL);
        kv_free(cc, k);
        cc_drain(pc);
    } else {
        int32_t n_sp = lethe_kv_n_spaces(pc->pool);
        int32_t *resident = lethe_xcalloc((size_t)n_sp, sizeof(int32_t));
        if (k)
            for (int32_t sp = 0; sp < n_sp; sp++)
                resident[sp] = lethe_kv_row_len(pc->pool, sp, k->row);
        LETHE_ASSERT(s->n_computed <= s->n_tokens);
        lethe_chain_finish(cc->t, c->id, s->tokens, s->n_tokens, k ? s->n_computed : 0, resident,
                           k);
        free(resident);
    }
    free(c);
    *s->ref = NULL;
}

static void cc_begin_turn(lethe_prefix_cache *pc, const lethe_chain_begin_args *a,
                          lethe_chain_turn *out, void **ref) {
    chain_cache *cc = cc_of(pc);
    lethe_chain_begin_args b = *a;
    b.fingerprint = cc->fp;
    lethe_chain_begin(cc->t, &b, out);
    if (out->code != LETHE_CHAIN_OK) return;
    chain_ref *c = lethe_xcalloc(1, sizeof(*c));
    snprintf(c->id, sizeof(c->id), "%s", out->id);
    c->reused = out->reused;
    *ref = c;
}

static void cc_cancel_turn(lethe_prefix_cache *pc, void *ref) {
    chain_ref *c = ref;
    lethe_chain_abandon(cc_of(pc)->t, c->id, NULL); /* an untaken payload is queued for drain */
    free(c);
}

static lethe_status cc_control(lethe_prefix_cache *pc, lethe_pc_ctl *c) {
    chain_cache *cc = cc_of(pc);
    if (c->kind == LETHE_PC_CTL_CHAIN_LIST) {
        c->n_out = lethe_chain_list(cc->t, c->entries, c->cap);
        return LETHE_OK;
    }
    if (!c->chain_id) return LETHE_OK; /* n_out = -1: unknown */
    switch (c->kind) {
    case LETHE_PC_CTL_CHAIN_LIST: break; /* above */
    case LETHE_PC_CTL_CHAIN_HISTORY:
        c->n_out = lethe_chain_history(cc->t, c->chain_id, c->out, c->cap);
        return LETHE_OK;
    case LETHE_PC_CTL_CHAIN_POSITIONS: {
        if (c->layer < 0 || c->layer >= lethe_kv_n_layers(pc->pool)) return LETHE_OK;
        const chain_kv *k = lethe_chain_peek_payload(cc->t, c->chain_id);
        if (!k) return LETHE_OK;
        int32_t sp = lethe_kv_space_of(pc->pool, c->layer);
        int32_t n = lethe_kv_row_len(pc->pool, sp, k->row);
        if (c->out)
            memcpy(c->out, lethe_kv_row_pos(pc->pool, sp, k->row),
                   (size_t)LETHE_MIN(n, c->cap) * sizeof(int32_t));
        c->n_out = n;
        return LETHE_OK;
    }
    }
    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "prefix cache chain: no control operation %d",
                        (int)c->kind);
}

static void cc_stats(lethe_prefix_cache *pc, lethe_pc_stats *out) {
    lethe_chain_get_stats(cc_of(pc)->t, &out->chain);
}

static int32_t cc_rows_held(lethe_prefix_cache *pc) {
    return lethe_chain_count_payloads(cc_of(pc)->t);
}

typedef struct check_ctx {
    const lethe_kv_pool *pool;
    uint8_t *seen; /* [max_rows] */
    int32_t bad_row;
    const char *why;
} check_ctx;

static void check_payload(void *vctx, void *payload) {
    check_ctx *x = vctx;
    const chain_kv *k = payload;
    if (x->why) return;
    if (k->row < 0 || k->row >= lethe_kv_max_rows(x->pool) || !lethe_kv_row_in_use(x->pool, k->row))
        x->why = "is not a KV row in use";
    else if (x->seen[k->row]++) x->why = "is held by two payloads";
    x->bad_row = k->row;
}

/* every payload owns a distinct live row (the engine checks that rows in use
 * = running requests + rows_held, and the pool recounts the slots) */
static lethe_status cc_check(lethe_prefix_cache *pc) {
    check_ctx x = {.pool = pc->pool, .seen = lethe_xcalloc((size_t)lethe_kv_max_rows(pc->pool), 1)};
    lethe_chain_for_each_payload(cc_of(pc)->t, check_payload, &x);
    free(x.seen);
    if (x.why)
        return lethe_errorf(LETHE_ERR_INVALID, "chain cache check: a payload's row %d %s",
                            x.bad_row, x.why);
    return LETHE_OK;
}

static void cc_destroy(lethe_prefix_cache *pc) {
    chain_cache *cc = cc_of(pc);
    void *buf[64];
    int32_t n;
    do {
        n = lethe_chain_drain_all(cc->t, buf, 64);
        for (int32_t i = 0; i < n; i++) kv_free(cc, buf[i]);
    } while (n == 64);
    lethe_chain_destroy(cc->t);
    free(cc);
}

static const lethe_prefix_cache_ops chain_ops = {
    .name = "chain",
    .match = cc_match,
    .acquire = cc_acquire,
    .release = cc_release,
    .drain = cc_drain,
    .begin_turn = cc_begin_turn,
    .cancel_turn = cc_cancel_turn,
    .control = cc_control,
    .stats = cc_stats,
    .rows_held = cc_rows_held,
    .check = cc_check,
    .destroy = cc_destroy,
};

lethe_prefix_cache *lethe_chain_cache_create(const lethe_pc_params *p) {
    chain_cache *cc = lethe_xcalloc(1, sizeof(*cc));
    cc->base = (lethe_prefix_cache){.ops = &chain_ops,
                                    .pool = p->pool,
                                    .release_state = p->release_state,
                                    .release_ctx = p->release_ctx};
    lethe_chain_table_params cp = {.n_spaces = lethe_kv_n_spaces(p->pool),
                                   .slots_per_space = lethe_kv_n_slots(p->pool)};
    cc->t = lethe_chain_create(&cp);
    lethe_chain_fingerprint(p->kv_description ? p->kv_description : "", cc->fp);
    return &cc->base;
}

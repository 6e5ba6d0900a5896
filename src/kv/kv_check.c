/* kv_check.c - the KV ownership invariant checker.
 *
 * Recounts every slot reference from scratch (row entries + references held
 * by outside holders such as the prefix cache) and compares with the pool's
 * reference counts and free lists. It runs after every step in tests and
 * with --check-invariants, so it is written for clarity over speed:
 * O(n_spaces x n_slots + total row entries) per call.
 *
 * Checked, per slot space:
 *  - free stack: ids in range, each at most once, each with count 0;
 *  - n_free + (slots with count > 0) == n_slots;
 *  - count[s] == row entries pointing at s + holder references to s
 *    (so no row points at a free slot and nothing leaks);
 *  - the scratch slot (if reserved) has exactly the pool's one reference and
 *    no row holds it;
 *  - a row never holds the same slot twice; positions strictly ascend;
 *  - unused rows are empty;
 *  - per-request states: every state slot is on the free list exactly once,
 *    owned by exactly one row in use, or held (lethe_kv_state_take) and by
 *    nothing else; every row in use owns one, none the scratch state, and
 *    the counts add up; when a holder lists state slots (the radix cache's
 *    snapshots), every held slot is listed exactly once and nothing else is. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "kv/kv_internal.h"

typedef struct check_ctx {
    const lethe_kv_pool *pool;
    int32_t **seen;  /* [n_spaces][n_slots] recount */
    bool bad;
    int32_t bad_sp, bad_slot;
} check_ctx;

typedef struct state_claims {
    int32_t *n;     /* [n_state_slots] claims per slot */
    int32_t n_slots;
    bool bad;       /* a claim out of range */
} state_claims;

static void visit_state(void *vctx, int32_t slot) {
    state_claims *c = vctx;
    if (slot < 0 || slot >= c->n_slots) c->bad = true;
    else c->n[slot]++;
}

static void visit_holder(void *vctx, int32_t sp, int32_t slot) {
    check_ctx *c = vctx;
    if (sp < 0 || sp >= c->pool->n_spaces || slot < 0 || slot >= c->pool->p.n_slots) {
        if (!c->bad) { c->bad = true; c->bad_sp = sp; c->bad_slot = slot; }
        return;
    }
    c->seen[sp][slot]++;
}

lethe_status lethe_kv_check(const lethe_kv_pool *pool, const lethe_kv_holder *holders,
                            int32_t n_holders) {
    const int32_t ns = pool->p.n_slots;
    lethe_status st = LETHE_OK;
    check_ctx c = {.pool = pool};
    c.seen = calloc((size_t)pool->n_spaces, sizeof(int32_t *));
    int32_t *mark = calloc((size_t)ns, sizeof(int32_t)); /* per-row duplicate marks (row id + 1) */
    if (!c.seen || !mark) { free(c.seen); free(mark); return lethe_errorf(LETHE_ERR_NOMEM, "kv check: out of memory"); }
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        c.seen[sp] = calloc((size_t)ns, sizeof(int32_t));
        if (!c.seen[sp]) { st = lethe_errorf(LETHE_ERR_NOMEM, "kv check: out of memory"); goto out; }
    }

    /* free lists */
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        const kv_space *s = &pool->spaces[sp];
        if (s->n_free < 0 || s->n_free > ns) {
            st = lethe_errorf(LETHE_ERR_INVALID, "kv check: space %d: free count %d outside [0, %d]", sp, s->n_free, ns);
            goto out;
        }
        int32_t used = 0;
        for (int32_t i = 0; i < ns; i++) used += s->ref[i] > 0;
        for (int32_t i = 0; i < s->n_free; i++) {
            int32_t slot = s->free_stack[i];
            if (slot < 0 || slot >= ns) {
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: space %d: free list holds bad id %d", sp, slot);
                goto out;
            }
            if (s->ref[slot] != 0) {
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: space %d: slot %d is on the free list with count %d",
                                  sp, slot, s->ref[slot]);
                goto out;
            }
            if (c.seen[sp][slot]++) {
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: space %d: slot %d is on the free list twice", sp, slot);
                goto out;
            }
        }
        if (s->n_free + used != ns) {
            st = lethe_errorf(LETHE_ERR_INVALID, "kv check: space %d: %d free + %d in use != %d slots (leak or loss)",
                              sp, s->n_free, used, ns);
            goto out;
        }
        memset(c.seen[sp], 0, (size_t)ns * sizeof(int32_t));
    }

    /* rows */
    for (int32_t row = 0; row < pool->max_rows; row++) {
        for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
            const kv_rowtab *t = &pool->tabs[(size_t)row * (size_t)pool->n_spaces + (size_t)sp];
            if (!pool->row_used[row]) {
                if (t->len != 0) {
                    st = lethe_errorf(LETHE_ERR_INVALID, "kv check: unused row %d has %d entries in space %d",
                                      row, t->len, sp);
                    goto out;
                }
                continue;
            }
            if (t->len < 0 || t->len > t->cap) {
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d: length %d, capacity %d", row, sp, t->len, t->cap);
                goto out;
            }
            for (int32_t i = 0; i < t->len; i++) {
                int32_t slot = t->slot[i];
                if (slot < 0 || slot >= ns) {
                    st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d entry %d: bad slot %d", row, sp, i, slot);
                    goto out;
                }
                if (slot == lethe_kv_scratch_slot(pool)) {
                    st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d entry %d holds the scratch slot %d",
                                      row, sp, i, slot);
                    goto out;
                }
                if (i > 0 && t->pos[i] <= t->pos[i - 1]) {
                    st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d: positions not ascending at entry %d (%d after %d)",
                                      row, sp, i, t->pos[i], t->pos[i - 1]);
                    goto out;
                }
                if (mark[slot] == row * pool->n_spaces + sp + 1) {
                    st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d holds slot %d twice", row, sp, slot);
                    goto out;
                }
                if (pool->p.head_masks &&
                    (t->hmask[i] == 0 || (t->hmask[i] & ~lethe_kv_full_head_mask(pool)))) {
                    st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d entry %d: head mask %#llx "
                                      "(none or unknown KV heads)", row, sp, i, (unsigned long long)t->hmask[i]);
                    goto out;
                }
                mark[slot] = row * pool->n_spaces + sp + 1;
                c.seen[sp][slot]++;
            }
            if (pool->p.page_meta_floats > 0 && t->meta_valid > LETHE_CEIL_DIV(t->len, LETHE_KV_PAGE)) {
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d space %d: %d valid metadata pages for %d entries",
                                  row, sp, t->meta_valid, t->len);
                goto out;
            }
        }
    }

    /* outside holders */
    for (int32_t h = 0; h < n_holders; h++) holders[h].for_each(holders[h].ctx, visit_holder, &c);
    if (c.bad) {
        st = lethe_errorf(LETHE_ERR_INVALID, "kv check: a holder references space %d slot %d (out of range)",
                          c.bad_sp, c.bad_slot);
        goto out;
    }

    if (lethe_kv_scratch_slot(pool) >= 0) /* the pool's own reference */
        for (int32_t sp = 0; sp < pool->n_spaces; sp++) c.seen[sp][lethe_kv_scratch_slot(pool)]++;
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        const kv_space *s = &pool->spaces[sp];
        for (int32_t i = 0; i < ns; i++) {
            if (c.seen[sp][i] != s->ref[i]) {
                st = lethe_errorf(LETHE_ERR_INVALID,
                                  "kv check: space %d slot %d: count %d but %d references found (%s)", sp, i,
                                  s->ref[i], c.seen[sp][i],
                                  s->ref[i] == 0 ? "a row or holder points at a free slot"
                                                 : "leaked or double-owned slot");
                goto out;
            }
        }
    }

    if (lethe_kv_has_states(pool)) {
        const int32_t nst = pool->p.n_state_slots, scratch = lethe_kv_scratch_state(pool);
        int32_t *own = calloc((size_t)nst, sizeof(int32_t)), owned = 0;
        if (!own) { st = lethe_errorf(LETHE_ERR_NOMEM, "kv check: out of memory"); goto out; }
        for (int32_t i = 0; i < pool->n_state_free && st == LETHE_OK; i++) {
            const int32_t x = pool->state_free[i];
            if (x < 0 || x >= nst || x == scratch || own[x]++)
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: state free list: bad or repeated state slot %d", x);
        }
        for (int32_t row = 0; row < pool->max_rows && st == LETHE_OK; row++) {
            const int32_t x = pool->row_state[row];
            if (!pool->row_used[row]) {
                if (x != -1) st = lethe_errorf(LETHE_ERR_INVALID, "kv check: unused row %d owns state slot %d", row, x);
                continue;
            }
            if (x < 0 || x >= nst || x == scratch)
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: row %d owns state slot %d (none, out of range or "
                                  "the scratch one)", row, x);
            else if (own[x]++)
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: state slot %d owned twice (free list or another "
                                  "row)", x);
            owned++;
        }
        int32_t held = 0;
        for (int32_t x = 0; x < nst && st == LETHE_OK; x++) {
            if (!pool->state_held[x]) continue;
            held++;
            if (x == scratch || own[x]++)
                st = lethe_errorf(LETHE_ERR_INVALID, "kv check: held state slot %d is also free, owned by a row "
                                  "or the scratch one", x);
        }
        if (st == LETHE_OK && held != pool->n_state_held)
            st = lethe_errorf(LETHE_ERR_INVALID, "kv check: %d held state slots counted, %d marked", pool->n_state_held,
                              held);
        if (st == LETHE_OK && pool->n_state_free + owned + held + (scratch >= 0) != nst)
            st = lethe_errorf(LETHE_ERR_INVALID,
                              "kv check: %d free + %d owned + %d held state slots (+ scratch) != %d",
                              pool->n_state_free, owned, held, nst);
        /* the held ones are exactly what the holders say they hold */
        bool listed = false;
        for (int32_t h = 0; h < n_holders; h++) listed |= holders[h].for_each_state != NULL;
        if (st == LETHE_OK && listed) {
            state_claims sc = {.n = calloc((size_t)nst, sizeof(int32_t)), .n_slots = nst};
            if (!sc.n) { free(own); st = lethe_errorf(LETHE_ERR_NOMEM, "kv check: out of memory"); goto out; }
            for (int32_t h = 0; h < n_holders; h++)
                if (holders[h].for_each_state) holders[h].for_each_state(holders[h].ctx, visit_state, &sc);
            if (sc.bad) st = lethe_errorf(LETHE_ERR_INVALID, "kv check: a holder lists a state slot out of range");
            for (int32_t x = 0; x < nst && st == LETHE_OK; x++)
                if (sc.n[x] != (pool->state_held[x] ? 1 : 0))
                    st = lethe_errorf(LETHE_ERR_INVALID,
                                      "kv check: state slot %d is %s and listed by %d holder(s) (a snapshot "
                                      "leaked or freed twice)",
                                      x, pool->state_held[x] ? "held" : "not held", sc.n[x]);
            free(sc.n);
        }
        free(own);
    }

out:
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) free(c.seen[sp]);
    free(c.seen);
    free(mark);
    return st;
}

/* radix_cache.c - the radix tree (radix.c) as a prefix cache: a request's
 * record is the chain of blocks it holds request references on, covering
 * row entries [0, 16 * n). match looks the prompt up block by block, acquire
 * attaches the blocks' slots to the fresh row, commit publishes every newly
 * completed block of the row (prompt and generated tokens alike), release
 * drops the references whatever the outcome.
 *
 * Hybrid models (the pool has per-request states, kv_pool.h): a prefix is
 * only usable with the linear-attention states at its end, which cannot be
 * cut back from a longer computation. So commit also takes a state snapshot
 * (radix.h) of the row at its snapshot points: every snapshot_every tokens
 * of the prompt and at the prompt's last multiple of LETHE_GDN_CHUNK; the
 * scheduler ends prefill chunks there (chunk_end), so the row's state slot
 * holds exactly those states after the step. Snapshot points are multiples
 * of LETHE_GDN_CHUNK inside the user's prompt, so the states are those of
 * a cold prefill however it was split (the delta rule cuts its segments at
 * those absolute positions) and never states built by one-step decode
 * updates (generated tokens). match stops at the deepest block of the
 * cached chain that holds a snapshot ("a hit resumes from the nearest
 * snapshot at or before the match"; the tokens after it are recomputed and
 * their blocks found again on publishing), and acquire copies that snapshot
 * into the row's own state slot. With the host tier a demoted block carries
 * its snapshot (radix.h): match looks past the resident blocks for the
 * deepest demoted one with a snapshot, acquire promotes the blocks up to it
 * (KV and snapshot) and resumes from there. */
#include <stdlib.h>
#include <string.h>

#include "cache/prefix_cache.h"
#include "cache/radix.h"
#include "core/util.h"

typedef struct radix_ref {
    lethe_radix_block **blocks;
    int32_t n, cap;
    int32_t entries; /* row entries blocks[0..n) occupy (fewer than 16 n when pruned) */
} radix_ref;

typedef struct radix_cache {
    lethe_prefix_cache base; /* must stay first */
    lethe_radix *tree;
    /* the last match, for the acquire that follows it: n_match blocks in the
     * pool, then n_host in the host tier (promoted by acquire) */
    lethe_radix_block **match;
    int32_t n_match, n_host, cap_match;
    int32_t n_matched;  /* hybrid: blocks matched before stepping back to a snapshot */
    int64_t snap_recomputed; /* hybrid: tokens of hits' matched blocks after their snapshot */
    uint64_t match_id;
    bool states;        /* hybrid model: hits need a snapshot (above) */
    int32_t snap_every; /* tokens between snapshot points (a multiple of LETHE_GDN_CHUNK) */
} radix_cache;

static radix_cache *rc_of(lethe_prefix_cache *pc) { return (radix_cache *)pc; }

static void ref_reserve(radix_ref *ref, int32_t n) {
    if (n <= ref->cap) return;
    ref->cap = LETHE_MAX(n, 2 * ref->cap);
    ref->blocks = lethe_xrealloc(ref->blocks, (size_t)ref->cap * sizeof(*ref->blocks));
}

static void rc_match(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_match *out) {
    radix_cache *rc = rc_of(pc);
    int32_t max_blocks = (s->n_tokens - 1) / LETHE_RADIX_BLOCK;
    if (max_blocks > rc->cap_match) {
        rc->cap_match = LETHE_MAX(max_blocks, 2 * rc->cap_match);
        rc->match = lethe_xrealloc(rc->match, (size_t)rc->cap_match * sizeof(*rc->match));
    }
    int32_t nb = lethe_radix_match(rc->tree, s->tokens, s->n_tokens, rc->match, max_blocks);
    int32_t host_res = 0; /* demoted blocks after them: restored into fresh slots */
    rc->n_matched = nb;
    if (rc->states) {
        /* resume from the deepest snapshot: on a demoted block after the
         * resident ones (promoted with it), else on a resident block */
        int32_t seen = 0;
        rc->n_host = lethe_radix_match_host_snap(rc->tree, s->tokens, s->n_tokens, rc->match, nb,
                                                 max_blocks, &host_res, &seen);
        rc->n_matched = nb + seen;
        if (rc->n_host == 0)
            while (nb > 0 && lethe_radix_block_snapshot(rc->match[nb - 1]) < 0) nb--;
    } else {
        rc->n_host = lethe_radix_match_host(rc->tree, s->tokens, s->n_tokens, rc->match, nb,
                                            max_blocks, &host_res);
    }
    rc->n_match = nb;
    rc->match_id = s->id;
    out->tokens = (nb + rc->n_host) * LETHE_RADIX_BLOCK;
    out->resident = lethe_radix_resident_tokens(rc->match, nb) + host_res; /* pruned: fewer */
    out->pinned = lethe_radix_unreferenced_slots(rc->match, nb) + host_res;
    out->queried = s->n_tokens;
    out->shareable = max_blocks * LETHE_RADIX_BLOCK;
    out->share_block = LETHE_RADIX_BLOCK;
    if (rc->states) { /* what another request's snapshots can supply: whole intervals */
        const int32_t every = lethe_radix_max_snapshots(rc->tree) > 0 ? rc->snap_every : 0;
        out->shareable = every ? out->shareable / every * every : 0;
        out->share_block = every;
    }
}

/* hybrid models: whether the state after the first `pos` tokens of s is a
 * snapshot point (file comment) */
static bool snap_point(const radix_cache *rc, const lethe_pc_seq *s, int32_t pos) {
    if (pos <= 0 || pos > s->n_prompt || pos % LETHE_GDN_CHUNK) return false;
    return pos % rc->snap_every == 0 || pos == s->n_prompt / LETHE_GDN_CHUNK * LETHE_GDN_CHUNK;
}

/* a prefill chunk from `start` ends at the next snapshot point before start + n */
static int32_t rc_chunk_end(lethe_prefix_cache *pc, const lethe_pc_seq *s, int32_t start, int32_t n) {
    const radix_cache *rc = rc_of(pc);
    if (!rc->states || lethe_radix_max_snapshots(rc->tree) == 0) return n;
    int32_t end = start + n;
    const int32_t next = (start / rc->snap_every + 1) * rc->snap_every;
    const int32_t last = s->n_prompt / LETHE_GDN_CHUNK * LETHE_GDN_CHUNK;
    if (next < end && next <= s->n_prompt) end = next;
    if (last > start && last < end) end = last;
    return end - start;
}

/* every completed block of the row, prompt and generated tokens alike */
static int32_t rc_publishes(lethe_prefix_cache *pc, const lethe_pc_seq *s) {
    (void)pc;
    return s->n_tokens / LETHE_RADIX_BLOCK * LETHE_RADIX_BLOCK;
}

static void rc_acquire(lethe_prefix_cache *pc, const lethe_pc_seq *s, const lethe_pc_match *m) {
    radix_cache *rc = rc_of(pc);
    LETHE_ASSERT(rc->match_id == s->id &&
                 m->tokens == (rc->n_match + rc->n_host) * LETHE_RADIX_BLOCK && !m->resume);
    LETHE_ASSERT(*s->ref == NULL);
    if (rc->n_host > 0) { /* back from the host tier first (admission counted their slots) */
        int32_t got = lethe_radix_promote(rc->tree, s->tokens, rc->match, rc->n_match, rc->n_host);
        LETHE_ASSERT(got == rc->n_host);
        rc->n_match += got;
        rc->n_host = 0;
        /* hybrid: the last one brought its snapshot back (match stopped there) */
        LETHE_ASSERT(!rc->states || lethe_radix_block_snapshot(rc->match[rc->n_match - 1]) >= 0);
    }
    if (rc->n_match == 0) return;
    radix_ref *ref = lethe_xcalloc(1, sizeof(*ref));
    ref_reserve(ref, rc->n_match);
    memcpy(ref->blocks, rc->match, (size_t)rc->n_match * sizeof(*ref->blocks));
    ref->n = rc->n_match;
    ref->entries = m->resident;
    lethe_radix_acquire(rc->tree, ref->blocks, ref->n, *s->row);
    *s->ref = ref;
    /* the states at the end of the hit: the row continues from its own copy */
    if (rc->states) {
        lethe_radix_snapshot_restore(rc->tree, ref->blocks[ref->n - 1],
                                     lethe_kv_row_state(pc->pool, *s->row));
        rc->snap_recomputed += (int64_t)(rc->n_matched - ref->n) * LETHE_RADIX_BLOCK;
    }
}

static void rc_commit(lethe_prefix_cache *pc, const lethe_pc_seq *s) {
    radix_cache *rc = rc_of(pc);
    radix_ref *ref = *s->ref;
    for (int32_t n = ref ? ref->n : 0; (n + 1) * LETHE_RADIX_BLOCK <= s->n_computed; n++) {
        if (!ref) *s->ref = ref = lethe_xcalloc(1, sizeof(*ref));
        ref_reserve(ref, n < 8 ? 8 : n + 1);
        /* block n's tokens start at 16 n; its row entries after the
         * (possibly pruned) blocks before it */
        int32_t first = n * LETHE_RADIX_BLOCK;
        lethe_radix_block *parent = n ? ref->blocks[n - 1] : NULL;
        ref->blocks[n] = lethe_radix_insert(rc->tree, parent, s->tokens + first, *s->row,
                                            ref->entries);
        ref->entries += LETHE_RADIX_BLOCK;
        ref->n = n + 1;
    }
    /* the step ended at a snapshot point: the row's state slot holds the states there */
    if (rc->states && snap_point(rc, s, s->n_computed)) {
        LETHE_ASSERT(ref && ref->n >= s->n_computed / LETHE_RADIX_BLOCK);
        lethe_radix_snapshot(rc->tree, ref->blocks[s->n_computed / LETHE_RADIX_BLOCK - 1],
                             lethe_kv_row_state(pc->pool, *s->row));
    }
}

static void rc_release(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_end how) {
    (void)how; /* shared blocks stay published whatever became of the request */
    radix_ref *ref = *s->ref;
    if (!ref) return;
    lethe_radix_release(rc_of(pc)->tree, ref->blocks, ref->n);
    free(ref->blocks);
    free(ref);
    *s->ref = NULL;
}

static int64_t rc_reclaimable(const lethe_prefix_cache *pc) {
    return lethe_radix_reclaimable(((const radix_cache *)pc)->tree);
}

static void rc_evict(lethe_prefix_cache *pc, int64_t want_free) {
    lethe_radix_evict(rc_of(pc)->tree, (int32_t)LETHE_MIN(want_free, (int64_t)INT32_MAX));
}

static void rc_holder_for_each(void *pc, void (*visit)(void *, int32_t, int32_t), void *vctx) {
    lethe_kv_holder h = lethe_radix_holder(rc_of(pc)->tree);
    h.for_each(h.ctx, visit, vctx);
}

static void rc_holder_for_each_state(void *pc, void (*visit)(void *, int32_t), void *vctx) {
    lethe_kv_holder h = lethe_radix_holder(rc_of(pc)->tree);
    h.for_each_state(h.ctx, visit, vctx);
}

static lethe_status rc_check(lethe_prefix_cache *pc) { return lethe_radix_check(rc_of(pc)->tree); }

static void rc_stats(lethe_prefix_cache *pc, lethe_pc_stats *out) {
    lethe_radix *t = rc_of(pc)->tree;
    lethe_radix_host_counts(t, &out->host_demoted, &out->host_promoted, &out->host_promoted_tokens);
    out->snapshots = lethe_radix_n_snapshots(t);
    lethe_radix_snapshot_counts(t, &out->snapshots_taken, &out->snapshots_evicted,
                                &out->snapshot_hits);
    lethe_radix_host_snapshot_counts(t, &out->snapshots_demoted, &out->snapshots_restored);
    out->snapshot_recomputed_tokens = rc_of(pc)->snap_recomputed;
}

static void rc_destroy(lethe_prefix_cache *pc) {
    radix_cache *rc = rc_of(pc);
    lethe_radix_destroy(rc->tree);
    free(rc->match);
    free(rc);
}

static const lethe_prefix_cache_ops radix_ops = {
    .name = "radix",
    .match = rc_match,
    .acquire = rc_acquire,
    .commit = rc_commit,
    .publishes = rc_publishes,
    .chunk_end = rc_chunk_end,
    .release = rc_release,
    .reclaimable = rc_reclaimable,
    .evict = rc_evict,
    .holder_for_each = rc_holder_for_each,
    .holder_for_each_state = rc_holder_for_each_state,
    .check = rc_check,
    .stats = rc_stats,
    .destroy = rc_destroy,
};

lethe_prefix_cache *lethe_radix_cache_create(const lethe_pc_params *p) {
    radix_cache *rc = lethe_xcalloc(1, sizeof(*rc));
    rc->base = (lethe_prefix_cache){.ops = &radix_ops,
                                    .pool = p->pool,
                                    .release_state = p->release_state,
                                    .release_ctx = p->release_ctx};
    /* the block size shapes ids too: folded into the first block's seed */
    const char *d = p->kv_description ? p->kv_description : "";
    int32_t block = LETHE_RADIX_BLOCK;
    uint64_t fp = lethe_hash64(&block, sizeof(block), lethe_hash64(d, strlen(d), 0x1e7e));
    rc->tree = lethe_radix_create(p->pool, fp);
    rc->states = lethe_kv_has_states(p->pool);
    if (rc->states) {
        LETHE_ASSERT(p->snapshot_slots >= 0 && p->snapshot_every > 0 &&
                     p->snapshot_every % LETHE_GDN_CHUNK == 0);
        rc->snap_every = p->snapshot_every;
        lethe_radix_set_snapshots(rc->tree, p->snapshot_slots);
    }
    lethe_radix_set_host_tier(rc->tree, p->host_tier);
    return &rc->base;
}

lethe_radix *lethe_radix_cache_tree(lethe_prefix_cache *pc) {
    return pc && pc->ops == &radix_ops ? rc_of(pc)->tree : NULL;
}

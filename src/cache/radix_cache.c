/* radix_cache.c - the radix tree (radix.c) as a prefix cache: a request's
 * record is the chain of blocks it holds request references on, covering
 * row entries [0, 16 * n). match looks the prompt up block by block, acquire
 * attaches the blocks' slots to the fresh row, commit publishes every newly
 * completed block of the row (prompt and generated tokens alike), release
 * drops the references whatever the outcome. */
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
    uint64_t match_id;
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
    rc->n_host = lethe_radix_match_host(rc->tree, s->tokens, s->n_tokens, rc->match, nb, max_blocks,
                                        &host_res);
    rc->n_match = nb;
    rc->match_id = s->id;
    out->tokens = (nb + rc->n_host) * LETHE_RADIX_BLOCK;
    out->resident = lethe_radix_resident_tokens(rc->match, nb) + host_res; /* pruned: fewer */
    out->pinned = lethe_radix_unreferenced_slots(rc->match, nb) + host_res;
    out->queried = s->n_tokens;
    out->shareable = max_blocks * LETHE_RADIX_BLOCK;
    out->share_block = LETHE_RADIX_BLOCK;
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
    }
    if (rc->n_match == 0) return;
    radix_ref *ref = lethe_xcalloc(1, sizeof(*ref));
    ref_reserve(ref, rc->n_match);
    memcpy(ref->blocks, rc->match, (size_t)rc->n_match * sizeof(*ref->blocks));
    ref->n = rc->n_match;
    ref->entries = m->resident;
    lethe_radix_acquire(rc->tree, ref->blocks, ref->n, *s->row);
    *s->ref = ref;
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

static lethe_status rc_check(lethe_prefix_cache *pc) { return lethe_radix_check(rc_of(pc)->tree); }

static void rc_stats(lethe_prefix_cache *pc, lethe_pc_stats *out) {
    lethe_radix_host_counts(rc_of(pc)->tree, &out->host_demoted, &out->host_promoted,
                            &out->host_promoted_tokens);
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
    .release = rc_release,
    .reclaimable = rc_reclaimable,
    .evict = rc_evict,
    .holder_for_each = rc_holder_for_each,
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
    lethe_radix_set_host_tier(rc->tree, p->host_tier);
    return &rc->base;
}

lethe_radix *lethe_radix_cache_tree(lethe_prefix_cache *pc) {
    return pc && pc->ops == &radix_ops ? rc_of(pc)->tree : NULL;
}

/* prefix_cache.c - the prefix-cache mode choice and the NULL-safe wrappers
 * over the active implementation's ops (see prefix_cache.h). */
#include "cache/prefix_cache.h"

#include <string.h>

#include "core/log.h"

lethe_status lethe_pcache_create(const lethe_pc_params *p, lethe_prefix_cache **out) {
    *out = NULL;
    const char *mode = p->mode && p->mode[0] ? p->mode : "auto";
    if (strcmp(mode, "auto") && strcmp(mode, "radix") && strcmp(mode, "chain"))
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--prefix-cache-mode %s: expected auto, radix or chain", mode);
    if (!p->enabled) {
        if (strcmp(mode, "auto"))
            return lethe_errorf(LETHE_ERR_INVALID,
                                "--prefix-cache-mode %s needs prefix caching; it was turned off "
                                "with --no-enable-prefix-caching",
                                mode);
        return LETHE_OK;
    }
    if (!strcmp(mode, "radix") && !p->shareable)
        return lethe_errorf(
            LETHE_ERR_INVALID,
            "--prefix-cache-mode radix is incompatible with method %s: its KV depends on the whole "
            "history (eviction/compaction), so prefixes cannot be shared block by block; use "
            "--prefix-cache-mode chain or auto",
            p->method ? p->method : "?");
    bool radix = !strcmp(mode, "radix") || (!strcmp(mode, "auto") && p->shareable);
    *out = radix ? lethe_radix_cache_create(p) : lethe_chain_cache_create(p);
    if (!radix)
        LOG_INFO("prefix cache: chain mode (method %s, %d slot space(s) of %d slots)",
                 p->method ? p->method : "?", lethe_kv_n_spaces(p->pool),
                 lethe_kv_n_slots(p->pool));
    return LETHE_OK;
}

void lethe_pcache_destroy(lethe_prefix_cache *pc) {
    if (pc) pc->ops->destroy(pc);
}

const char *lethe_pcache_mode(const lethe_prefix_cache *pc) { return pc ? pc->ops->name : "off"; }

bool lethe_pcache_takes_turns(const lethe_prefix_cache *pc) { return pc && pc->ops->begin_turn; }

bool lethe_pcache_ctl_engine_thread(lethe_pc_ctl_kind kind) {
    return kind != LETHE_PC_CTL_CHAIN_HISTORY && kind != LETHE_PC_CTL_CHAIN_LIST;
}

void lethe_pcache_match(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_match *out) {
    memset(out, 0, sizeof(*out));
    if (pc) pc->ops->match(pc, s, out);
    LETHE_ASSERT(out->tokens >= 0 && out->tokens < s->n_tokens && out->resident >= 0 &&
                 out->pinned >= 0);
}

void lethe_pcache_acquire(lethe_prefix_cache *pc, const lethe_pc_seq *s, const lethe_pc_match *m) {
    if (pc) pc->ops->acquire(pc, s, m);
    LETHE_ASSERT(*s->row >= 0);
}

void lethe_pcache_commit(lethe_prefix_cache *pc, const lethe_pc_seq *s) {
    if (pc && pc->ops->commit) pc->ops->commit(pc, s);
}

int32_t lethe_pcache_publishes(lethe_prefix_cache *pc, const lethe_pc_seq *s) {
    return pc && pc->ops->publishes ? pc->ops->publishes(pc, s) : 0;
}

int32_t lethe_pcache_chunk_end(lethe_prefix_cache *pc, const lethe_pc_seq *s, int32_t start, int32_t n) {
    if (!pc || !pc->ops->chunk_end) return n;
    const int32_t k = pc->ops->chunk_end(pc, s, start, n);
    LETHE_ASSERT(k >= 1 && k <= n);
    return k;
}

void lethe_pcache_release(lethe_prefix_cache *pc, const lethe_pc_seq *s, lethe_pc_end how) {
    if (pc) pc->ops->release(pc, s, how);
}

int64_t lethe_pcache_reclaimable(const lethe_prefix_cache *pc) {
    return pc && pc->ops->reclaimable ? pc->ops->reclaimable(pc) : 0;
}

void lethe_pcache_evict(lethe_prefix_cache *pc, int64_t want_free) {
    if (pc && pc->ops->evict) pc->ops->evict(pc, want_free);
}

void lethe_pcache_drain(lethe_prefix_cache *pc) {
    if (pc && pc->ops->drain) pc->ops->drain(pc);
}

void lethe_pcache_begin_turn(lethe_prefix_cache *pc, const lethe_chain_begin_args *a,
                             lethe_chain_turn *out, void **ref) {
    *ref = NULL;
    if (!lethe_pcache_takes_turns(pc)) {
        memset(out, 0, sizeof(*out));
        out->code = LETHE_CHAIN_MODE_DISABLED;
        return;
    }
    pc->ops->begin_turn(pc, a, out, ref);
    LETHE_ASSERT((out->code == LETHE_CHAIN_OK) == (*ref != NULL));
}

void lethe_pcache_cancel_turn(lethe_prefix_cache *pc, void *ref) {
    if (ref) pc->ops->cancel_turn(pc, ref);
}

lethe_status lethe_pcache_control(lethe_prefix_cache *pc, lethe_pc_ctl *c) {
    c->n_out = -1;
    if (!pc || !pc->ops->control)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "prefix cache %s: no control operation %d",
                            lethe_pcache_mode(pc), (int)c->kind);
    return pc->ops->control(pc, c);
}

void lethe_pcache_stats(lethe_prefix_cache *pc, lethe_pc_stats *out) {
    memset(out, 0, sizeof(*out));
    if (pc && pc->ops->stats) pc->ops->stats(pc, out);
}

static void holder_none(void *ctx, void (*visit)(void *, int32_t, int32_t), void *vctx) {
    (void)ctx, (void)visit, (void)vctx;
}

static void states_none(void *ctx, void (*visit)(void *, int32_t), void *vctx) {
    (void)ctx, (void)visit, (void)vctx;
}

/* always lists state slots (none when the cache holds none), so the checker
 * also verifies that nothing else holds one between steps */
lethe_kv_holder lethe_pcache_holder(lethe_prefix_cache *pc) {
    lethe_kv_holder h = {.ctx = pc, .for_each = holder_none, .for_each_state = states_none};
    if (pc && pc->ops->holder_for_each) h.for_each = pc->ops->holder_for_each;
    if (pc && pc->ops->holder_for_each_state) h.for_each_state = pc->ops->holder_for_each_state;
    return h;
}

int32_t lethe_pcache_rows_held(lethe_prefix_cache *pc) {
    return pc && pc->ops->rows_held ? pc->ops->rows_held(pc) : 0;
}

lethe_status lethe_pcache_check(lethe_prefix_cache *pc) {
    return pc && pc->ops->check ? pc->ops->check(pc) : LETHE_OK;
}

/* engine_pcctl.c - radix prefix-cache control (anchor §8): match, inspect,
 * delete_subtree, set_eviction_priority. Each runs on the engine thread
 * between steps (eng_call_wait: directly in synchronous mode), because the
 * tree and the KV pool belong to that thread. A path is a token list from the
 * first token; its blocks are the full 16-token blocks it covers. */
#include <stdlib.h>
#include <string.h>

#include "cache/radix.h"
#include "core/util.h"
#include "engine/engine_internal.h"

typedef struct ctl_call {
    const int32_t *tokens;
    int32_t n;
    int32_t priority;
    lethe_prefix_match *match;
    lethe_prefix_block *out;
    int32_t cap;
    int32_t result; /* count, or -1 */
    lethe_status st;
    char msg[256];
} ctl_call;

int32_t lethe_engine_vocab_size(const lethe_engine *e) { return e->n_vocab; }

static void ctl_fail(ctl_call *c, lethe_status st, const char *msg) {
    c->st = st;
    snprintf(c->msg, sizeof(c->msg), "%s", msg);
}

/* the error of an engine-thread call, on the caller's thread */
static int ctl_finish(const ctl_call *c) {
    return c->st == LETHE_OK ? LETHE_OK : lethe_errorf(c->st, "%s", c->msg);
}

static void block_out(const lethe_radix_block *b, lethe_prefix_block *o) {
    lethe_radix_block_info bi;
    lethe_radix_block_get_info(b, &bi);
    *o = (lethe_prefix_block){.id = bi.hash,
                              .parent_id = bi.parent_hash,
                              .start = bi.depth * LETHE_PREFIX_BLOCK,
                              .resident = bi.resident,
                              .req_refs = bi.req_refs,
                              .n_children = bi.n_children,
                              .priority = bi.priority,
                              .prune_id = bi.prune_id};
}

static void do_match(lethe_engine *e, void *arg) {
    ctl_call *c = arg;
    lethe_prefix_match *m = c->match;
    *m = (lethe_prefix_match){.block_size = LETHE_PREFIX_BLOCK, .prompt_tokens = c->n};
    m->usable_tokens = c->n > 0 ? (c->n - 1) / LETHE_PREFIX_BLOCK * LETHE_PREFIX_BLOCK : 0;
    lethe_radix *tree = lethe_radix_cache_tree(e->pcache);
    if (!tree) return;
    m->enabled = true;
    m->live_blocks = lethe_radix_n_blocks(tree);
    const int32_t max_blocks = m->usable_tokens / LETHE_PREFIX_BLOCK;
    lethe_radix_block **chain = lethe_xmalloc((size_t)LETHE_MAX(max_blocks, 1) * sizeof(*chain));
    const int32_t nb = lethe_radix_match(tree, c->tokens, c->n, chain, max_blocks);
    m->matched_blocks = nb;
    m->matched_tokens = nb * LETHE_PREFIX_BLOCK;
    m->resident_kv_tokens = lethe_radix_resident_tokens(chain, nb);
    m->last_block_id = nb ? lethe_radix_block_hash(chain[nb - 1]) : 0;
    free(chain);
}

int lethe_engine_prefix_match(lethe_engine *e, const int32_t *tokens, int32_t n,
                              lethe_prefix_match *out) {
    if (n < 0 || (n > 0 && !tokens))
        return lethe_errorf(LETHE_ERR_INVALID, "prefix match: no tokens");
    ctl_call c = {.tokens = tokens, .n = n, .match = out};
    eng_call_wait(e, do_match, &c);
    return ctl_finish(&c);
}

typedef struct collect {
    lethe_prefix_block *out;
    int32_t cap, n;
    const lethe_radix_block **all;
} collect;

static void collect_one(void *ctx, const lethe_radix_block *b) {
    collect *k = ctx;
    k->all[k->n++] = b;
}

static int cmp_block(const void *a, const void *b) {
    lethe_radix_block_info x, y;
    lethe_radix_block_get_info(*(const lethe_radix_block *const *)a, &x);
    lethe_radix_block_get_info(*(const lethe_radix_block *const *)b, &y);
    if (x.depth != y.depth) return x.depth < y.depth ? -1 : 1;
    return (x.hash > y.hash) - (x.hash < y.hash);
}

static void do_inspect(lethe_engine *e, void *arg) {
    ctl_call *c = arg;
    lethe_radix *tree = lethe_radix_cache_tree(e->pcache);
    if (!tree) {
        c->result = -1;
        return;
    }
    if (c->tokens) { /* the path's cached blocks */
        const int32_t max_blocks = c->n / LETHE_PREFIX_BLOCK;
        lethe_radix_block **chain = lethe_xmalloc((size_t)LETHE_MAX(max_blocks, 1) *
                                                  sizeof(*chain));
        int32_t nb = 0;
        while (nb < max_blocks && lethe_radix_find(tree, c->tokens, nb + 1, chain)) nb++;
        for (int32_t i = 0; i < nb && i < c->cap; i++) block_out(chain[i], &c->out[i]);
        c->result = nb;
        free(chain);
        return;
    }
    collect k = {.out = c->out, .cap = c->cap};
    k.all = lethe_xmalloc((size_t)LETHE_MAX(lethe_radix_n_blocks(tree), 1) * sizeof(*k.all));
    lethe_radix_for_each_block(tree, collect_one, &k);
    qsort(k.all, (size_t)k.n, sizeof(*k.all), cmp_block);
    for (int32_t i = 0; i < k.n && i < c->cap; i++) block_out(k.all[i], &c->out[i]);
    c->result = k.n;
    free(k.all);
}

int32_t lethe_engine_prefix_inspect(lethe_engine *e, const int32_t *tokens, int32_t n,
                                    lethe_prefix_block *out, int32_t cap) {
    ctl_call c = {.tokens = tokens, .n = n, .out = out, .cap = out ? cap : 0};
    eng_call_wait(e, do_inspect, &c);
    return c.result;
}

/* the path's full blocks, all cached: chain[] and their count, or a failure */
static int32_t path_blocks(lethe_engine *e, ctl_call *c, lethe_radix **tree,
                           lethe_radix_block ***chain) {
    *tree = lethe_radix_cache_tree(e->pcache);
    if (!*tree) {
        ctl_fail(c, LETHE_ERR_UNSUPPORTED, "prefix-cache control needs the radix prefix cache");
        return -1;
    }
    const int32_t nb = c->n / LETHE_PREFIX_BLOCK;
    if (nb == 0) {
        ctl_fail(c, LETHE_ERR_INVALID, "the path has no full 16-token block");
        return -1;
    }
    *chain = lethe_xmalloc((size_t)nb * sizeof(**chain));
    if (!lethe_radix_find(*tree, c->tokens, nb, *chain)) {
        free(*chain);
        snprintf(c->msg, sizeof(c->msg), "the path's %d tokens in full blocks are not all cached",
                 nb * LETHE_PREFIX_BLOCK);
        c->st = LETHE_ERR_NOT_FOUND;
        return -1;
    }
    return nb;
}

static void do_delete(lethe_engine *e, void *arg) {
    ctl_call *c = arg;
    lethe_radix *tree;
    lethe_radix_block **chain;
    const int32_t nb = path_blocks(e, c, &tree, &chain);
    if (nb < 0) return;
    c->result = lethe_radix_delete_subtree(tree, chain[nb - 1]);
    if (c->result < 0)
        ctl_fail(c, LETHE_ERR_BUSY, "a running request holds a block of the subtree");
    free(chain);
    eng_publish_stats(e);
}

int lethe_engine_prefix_delete_subtree(lethe_engine *e, const int32_t *tokens, int32_t n,
                                       int32_t *n_deleted) {
    if (n <= 0 || !tokens) return lethe_errorf(LETHE_ERR_INVALID, "delete_subtree: no tokens");
    ctl_call c = {.tokens = tokens, .n = n};
    eng_call_wait(e, do_delete, &c);
    if (n_deleted) *n_deleted = c.st == LETHE_OK ? c.result : 0;
    return ctl_finish(&c);
}

static void do_priority(lethe_engine *e, void *arg) {
    ctl_call *c = arg;
    lethe_radix *tree;
    lethe_radix_block **chain;
    const int32_t nb = path_blocks(e, c, &tree, &chain);
    if (nb < 0) return;
    for (int32_t i = 0; i < nb; i++) lethe_radix_set_priority(tree, chain[i], c->priority);
    c->result = nb;
    free(chain);
}

int lethe_engine_prefix_set_priority(lethe_engine *e, const int32_t *tokens, int32_t n,
                                     int32_t priority, int32_t *n_blocks) {
    if (n <= 0 || !tokens)
        return lethe_errorf(LETHE_ERR_INVALID, "set_eviction_priority: no tokens");
    ctl_call c = {.tokens = tokens, .n = n, .priority = priority};
    eng_call_wait(e, do_priority, &c);
    if (n_blocks) *n_blocks = c.st == LETHE_OK ? c.result : 0;
    return ctl_finish(&c);
}

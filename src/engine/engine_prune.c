/* engine_prune.c - prefix-cache pruning (anchor §9): a client names token
 * ranges of a cached path (old tool outputs, typically) and one keep budget;
 * the engine scores those tokens, keeps the best `keep_tokens` of them and
 * frees the rest of their KV. The pruned blocks keep their ids, tokens and
 * place in the radix tree, so the logical prefix still matches and the next
 * turn attaches the retained slots at their logical positions (K is stored
 * after RoPE: nothing is re-rotated).
 *
 * A job, on the engine thread between steps (eng_post_call):
 *  1. find the path's blocks up to the largest range end R; refuse when they
 *     are not cached (failed), a running request references a block of the
 *     ranges (blocked), or one was pruned before (failed: no recompression);
 *  2. score, with scoring passes (score_pass: a temporary row attaches a
 *     cached prefix with request references, so nothing can evict it
 *     meanwhile, and the runner prefills query tokens into fresh slots;
 *     after each layer's attention the backend's attn_scores op reduces the
 *     query rows' softmax over the candidate keys on the device, and the
 *     engine takes the max over layers: one score per logical position,
 *     [R - L0] floats; the row and its references are dropped afterwards):
 *       snapkv_global: one pass, the observation window [W, R), W = R - obs,
 *         over the prefix [0, W): mean over the window rows, max over heads
 *         (LETHE_SCORES_PROB_MAX);
 *       kvzip_global: one pass per chunk (<= 2048 tokens) of each range: the
 *         reconstruction instruction + the 64 tokens before the chunk (less
 *         when a step holds fewer than instruction + 128 tokens) + the
 *         chunk, appended after the whole prefix [0, R), scoring the chunk's
 *         keys: max over the replay rows and heads (PROB_MAX | ROW_MAX);
 *  3. select: protected positions (the window inside the ranges, the tokens
 *     a retention hint pinned when the block was published: the block's pin
 *     bits, from the row's protected mask) are kept and count toward the budget, the rest
 *     of the budget goes to the best scores (ties: lower position). One mask
 *     for every layer, head and slot space;
 *  4. commit: each block of the ranges keeps its selected offsets and frees
 *     the other slots (lethe_radix_prune_block).
 * Nothing runs between 1 and 4 (the engine thread does nothing else), so the
 * "unreferenced" check of step 1 still holds at the commit. */
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/radix.h"
#include "core/util.h"
#include "engine/engine_internal.h"

#define PRUNE_DEFAULT_OBS 64
#define PRUNE_MAX_OBS 1024

static atomic_uint next_prune_id = 1;

static int cmp_range(const void *a, const void *b) {
    const lethe_prune_range *x = a, *y = b;
    return x->start != y->start ? (x->start < y->start ? -1 : 1)
                                : (x->end > y->end) - (x->end < y->end);
}

int lethe_prune_validate(const lethe_prune_params *p, lethe_prune_range *merged,
                         int32_t *n_merged) {
    const int32_t B = LETHE_PREFIX_BLOCK;
    if (!p->tokens || p->n_tokens <= 0)
        return lethe_errorf(LETHE_ERR_INVALID, "prune: the path has no tokens");
    if (p->n_ranges <= 0) return lethe_errorf(LETHE_ERR_INVALID, "prune: no ranges given");
    if (p->n_ranges > LETHE_PRUNE_MAX_RANGES)
        return lethe_errorf(LETHE_ERR_INVALID, "prune: %d ranges, at most %d", p->n_ranges,
                            LETHE_PRUNE_MAX_RANGES);
    if (p->policy != LETHE_PRUNE_SNAPKV_GLOBAL && p->policy != LETHE_PRUNE_KVZIP_GLOBAL)
        return lethe_errorf(LETHE_ERR_INVALID, "prune: unknown policy %d", (int)p->policy);
    for (int32_t i = 0; i < p->n_ranges; i++) {
        const lethe_prune_range r = p->ranges[i];
        if (r.start >= r.end)
            return lethe_errorf(LETHE_ERR_INVALID, "prune: range [%d, %d) is empty", r.start,
                                r.end);
        if (r.start < 0 || r.end > p->n_tokens)
            return lethe_errorf(LETHE_ERR_INVALID,
                                "prune: range [%d, %d) is outside the path's %d tokens", r.start,
                                r.end, p->n_tokens);
        if (r.start % B || r.end % B)
            return lethe_errorf(LETHE_ERR_INVALID,
                                "prune: range [%d, %d) is not aligned to the %d-token block",
                                r.start, r.end, B);
    }
    lethe_prune_range *m = lethe_xmalloc((size_t)p->n_ranges * sizeof(*m));
    memcpy(m, p->ranges, (size_t)p->n_ranges * sizeof(*m));
    qsort(m, (size_t)p->n_ranges, sizeof(*m), cmp_range);
    int32_t n = 0;
    for (int32_t i = 0; i < p->n_ranges; i++) {
        if (n > 0 && m[i].start < m[n - 1].end) {
            lethe_status st = lethe_errorf(LETHE_ERR_INVALID,
                                           "prune: ranges [%d, %d) and [%d, %d) overlap",
                                           m[n - 1].start, m[n - 1].end, m[i].start, m[i].end);
            free(m);
            return st;
        }
        if (n > 0 && m[i].start == m[n - 1].end) m[n - 1].end = m[i].end; /* adjacent: merged */
        else m[n++] = m[i];
    }
    int64_t width = 0;
    for (int32_t i = 0; i < n; i++) width += m[i].end - m[i].start;
    if (merged) memcpy(merged, m, (size_t)n * sizeof(*m));
    if (n_merged) *n_merged = n;
    free(m);
    if (p->keep_tokens < 0 || p->keep_tokens >= width)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "prune: keep_tokens %d must be in [0, %lld) (the ranges' width)",
                            p->keep_tokens, (long long)width);
    if (p->policy == LETHE_PRUNE_SNAPKV_GLOBAL) {
        int32_t obs = p->observation_tokens ? p->observation_tokens : PRUNE_DEFAULT_OBS;
        if (obs < B || obs > PRUNE_MAX_OBS || obs % B)
            return lethe_errorf(LETHE_ERR_INVALID,
                                "prune: observation_tokens %d must be a multiple of %d in [%d, %d]",
                                obs, B, B, PRUNE_MAX_OBS);
    }
    return LETHE_OK;
}

/* ---- the job ---- */

typedef struct prune_job {
    lethe_prune_params p; /* tokens / ranges point at the copies below */
    int32_t *tokens;
    lethe_prune_range ranges[LETHE_PRUNE_MAX_RANGES]; /* merged */
    lethe_prune_result res;
    lethe_prune_cb done;
    void *user;
} prune_job;

/* the scoring pass's state, for its hooks */
typedef struct prune_score {
    lethe_engine *e;
    int32_t row;
    int32_t n_new;      /* window tokens, the row's last entries */
    int32_t lo, hi;     /* best[] covers positions [lo, hi) */
    int32_t c_lo, c_hi; /* this pass scores the keys at positions [c_lo, c_hi) */
    int32_t mode;       /* LETHE_SCORES_* */
    float *best;        /* [hi - lo] max over layers (and passes), -INF where no key */
    float *tmp;
    int32_t *sel;
    int32_t cap_sel;
    int32_t sel_begin[2];
} prune_score;

static void score_plan(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                       lethe_layer_plan *out) {
    prune_score *ps = ctx;
    (void)b;
    (void)q;
    lethe_kv_pool *pool = ps->e->pool;
    const int32_t sp = lethe_kv_space_of(pool, layer);
    const int32_t len = lethe_kv_row_len(pool, sp, ps->row);
    if (len > ps->cap_sel) {
        ps->cap_sel = len;
        ps->sel = lethe_xrealloc(ps->sel, (size_t)len * sizeof(int32_t));
    }
    memcpy(ps->sel, lethe_kv_row_slots(pool, sp, ps->row), (size_t)len * sizeof(int32_t));
    ps->sel_begin[0] = 0;
    ps->sel_begin[1] = len;
    out->store_slots = ps->sel + len - ps->n_new; /* the window: the last entries */
    out->sel_begin = ps->sel_begin;
    out->sel_slots = ps->sel;
    out->kvq = NULL;
}

static void score_after_attn(void *ctx, int32_t layer, const lethe_fwd_batch *b,
                             const lethe_attn_args *a) {
    prune_score *ps = ctx;
    (void)b;
    lethe_kv_pool *pool = ps->e->pool;
    lethe_backend *be = ps->e->runner.be;
    const int32_t sp = lethe_kv_space_of(pool, layer);
    const int32_t len = lethe_kv_row_len(pool, sp, ps->row);
    const int32_t *pos = lethe_kv_row_pos(pool, sp, ps->row);
    int32_t c0 = 0, c1;
    while (c0 < len && pos[c0] < ps->c_lo) c0++;
    for (c1 = c0; c1 < len && pos[c1] < ps->c_hi; c1++) {}
    if (c1 <= c0 || !be || !a || !a->q) return;
    lethe_score_seq sq = {.q_row = 0,
                          .n_rows = ps->n_new,
                          .key_begin = 0,
                          .n_keys = len,
                          .c0 = c0,
                          .c1 = c1,
                          .mode = ps->mode};
    lethe_attn_scores_args sa = {.out = ps->tmp,
                                 .q = a->q,
                                 .k_cache = a->k_cache,
                                 .n_tokens = a->n_tokens,
                                 .n_seqs = 1,
                                 .seqs = &sq,
                                 .key_slots = a->sel_slots,
                                 .n_key_slots = len,
                                 .n_heads = a->n_heads,
                                 .n_kv_heads = a->n_kv_heads,
                                 .head_dim = a->head_dim,
                                 .n_groups = 1,
                                 .scale = a->scale};
    be->ops->attn_scores(be, &sa);
    for (int32_t j = c0; j < c1; j++) {
        const int32_t k = pos[j] - ps->lo;
        LETHE_ASSERT(k >= 0 && k < ps->hi - ps->lo);
        if (ps->tmp[j - c0] > ps->best[k]) ps->best[k] = ps->tmp[j - c0];
    }
}

static void job_fail(prune_job *j, lethe_prune_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void job_fail(prune_job *j, lethe_prune_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->res.message, sizeof(j->res.message), fmt, ap);
    va_end(ap);
    j->res.status = st;
}

/* One scoring pass: a temporary row attaches chain[0, nb) (request
 * references: nothing can evict it meanwhile) and the runner prefills
 * tokens[0, n_new) at positions pos0 .. into fresh slots; after each layer's
 * attention the backend's attn_scores op reduces the new rows' attention over
 * the keys at positions [c_lo, c_hi) (mode), and best[] keeps the max over
 * layers and passes. The row and the references are dropped afterwards. */
static bool score_pass(lethe_engine *e, prune_job *j, lethe_radix *tree, lethe_radix_block **chain,
                       int32_t nb, const int32_t *tokens, int32_t n_new, int32_t pos0, int32_t c_lo,
                       int32_t c_hi, int32_t mode, int32_t lo, int32_t hi, float *best) {
    if (n_new > e->p.max_num_batched_tokens) {
        job_fail(j, LETHE_PRUNE_FAILED,
                 "a scoring pass of %d tokens exceeds max_num_batched_tokens %d", n_new,
                 e->p.max_num_batched_tokens);
        return false;
    }
    if (pos0 + n_new > e->max_model_len) {
        job_fail(j, LETHE_PRUNE_FAILED,
                 "a scoring pass reaches position %d, beyond max_model_len %d", pos0 + n_new,
                 e->max_model_len);
        return false;
    }
    lethe_radix_acquire_refs(tree, chain, nb);
    if (lethe_kv_min_free(e->pool) < n_new) lethe_pcache_evict(e->pcache, n_new);
    if (lethe_kv_min_free(e->pool) < n_new) {
        lethe_radix_release(tree, chain, nb);
        job_fail(j, LETHE_PRUNE_FAILED, "no %d free KV slots for the scoring pass", n_new);
        return false;
    }
    const int32_t row = lethe_kv_row_alloc(e->pool);
    lethe_radix_acquire(tree, chain, nb,
                        row); /* a second reference each, dropped with the row below */
    lethe_radix_release(tree, chain, nb);
    int32_t *pos = lethe_xmalloc((size_t)n_new * sizeof(int32_t));
    for (int32_t i = 0; i < n_new; i++) pos[i] = pos0 + i;
    bool ok = lethe_kv_row_append(e->pool, row, n_new, pos);
    LETHE_ASSERT(ok);
    prune_score ps = {.e = e,
                      .row = row,
                      .n_new = n_new,
                      .lo = lo,
                      .hi = hi,
                      .c_lo = c_lo,
                      .c_hi = c_hi,
                      .mode = mode,
                      .best = best};
    ps.tmp = lethe_xmalloc((size_t)(c_hi - c_lo + 1) * sizeof(float));
    const int32_t seq_begin[2] = {0, n_new};
    const lethe_fwd_batch b = {.n_tokens = n_new,
                               .tokens = tokens,
                               .pos = pos,
                               .n_seqs = 1,
                               .seq_begin = seq_begin,
                               .n_logits = 0,
                               .logit_rows = NULL};
    const lethe_fwd_hooks hooks = {
        .ctx = &ps, .plan_layer = score_plan, .after_attn = score_after_attn};
    if (e->runner.be) e->runner.be->ops->unstage(e->runner.be); /* no stale step arrays */
    e->runner.forward(e->runner.ctx, &b, &hooks, NULL);
    lethe_kv_row_release(e->pool, row);
    lethe_radix_release(tree, chain, nb);
    free(pos);
    free(ps.tmp);
    free(ps.sel);
    return true;
}

/* snapkv_global: the window [W, R) prefilled over the prefix [0, W), scoring
 * [lo, R): softmax mean over the window rows, max over heads and layers */
static bool score_snapkv(lethe_engine *e, prune_job *j, lethe_radix *tree,
                         lethe_radix_block **chain, int32_t R, int32_t W, int32_t lo, float *best) {
    for (int32_t i = 0; i < R - lo; i++) best[i] = -INFINITY;
    return score_pass(e, j, tree, chain, W / LETHE_PREFIX_BLOCK, j->tokens + W, R - W, W, lo, R,
                      LETHE_SCORES_PROB_MAX, lo, R, best);
}

#define KVZIP_PRUNE_INSTRUCTION "\nReconstruct the following context span exactly:\n"
#define KVZIP_PRUNE_CHUNK 2048
#define KVZIP_PRUNE_PREV 64

/* kvzip_global (anchor §9.2): for each chunk of each range, the replay
 * instruction + the <= 64 tokens before the chunk + the chunk, appended after
 * the whole prefix [0, R), scores the chunk's keys: softmax over every key
 * of the prefix and the replay (causal), max over the replay rows, heads and
 * layers (LETHE_SCORES_PROB_MAX | ROW_MAX). Chunks: min(2048, what a step
 * holds after the instruction and the postfix). */
static bool score_kvzip(lethe_engine *e, prune_job *j, lethe_radix *tree, lethe_radix_block **chain,
                        int32_t R, int32_t lo, float *best) {
    for (int32_t i = 0; i < R - lo; i++) best[i] = -INFINITY;
    int32_t *instr = NULL, n_instr = 0;
    if (lethe_engine_tokenize(e, KVZIP_PRUNE_INSTRUCTION, false, true, &instr, &n_instr) != 0)
        n_instr = 0;
    /* a replay must fit in one step: a smaller postfix and chunk under a small token budget */
    const int32_t room = e->p.max_num_batched_tokens - n_instr;
    const int32_t prev_cap = LETHE_MIN(KVZIP_PRUNE_PREV, room / 2);
    const int32_t chunk = LETHE_MIN(KVZIP_PRUNE_CHUNK, room - prev_cap);
    if (chunk < LETHE_PREFIX_BLOCK) {
        free(instr);
        job_fail(j, LETHE_PRUNE_FAILED,
                 "max_num_batched_tokens %d leaves no room for a kvzip replay chunk",
                 e->p.max_num_batched_tokens);
        return false;
    }
    int32_t *rep = lethe_xmalloc((size_t)(n_instr + prev_cap + chunk) * sizeof(int32_t));
    bool ok = true;
    for (int32_t r = 0; ok && r < j->p.n_ranges; r++)
        for (int32_t c = j->ranges[r].start; ok && c < j->ranges[r].end; c += chunk) {
            const int32_t ce = LETHE_MIN(c + chunk, j->ranges[r].end),
                          prev = LETHE_MIN(prev_cap, c);
            int32_t n = 0;
            memcpy(rep + n, instr, (size_t)n_instr * sizeof(int32_t));
            n += n_instr;
            memcpy(rep + n, j->tokens + c - prev, (size_t)(prev + ce - c) * sizeof(int32_t));
            n += prev + ce - c;
            ok = score_pass(e, j, tree, chain, R / LETHE_PREFIX_BLOCK, rep, n, R, c, ce,
                            LETHE_SCORES_PROB_MAX | LETHE_SCORES_ROW_MAX, lo, R, best);
        }
    free(rep);
    free(instr);
    return ok;
}

typedef struct cand {
    float score;
    int32_t pos;
} cand;

static int cmp_cand(const void *a, const void *b) {
    const cand *x = a, *y = b;
    /* higher score first, NaN last, ties to the lower position */
    const bool xn = isnan(x->score), yn = isnan(y->score);
    if (xn != yn) return xn ? 1 : -1;
    if (!xn && x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static void run_job(lethe_engine *e, prune_job *j) {
    lethe_prune_result *res = &j->res;
    lethe_radix *tree = lethe_radix_cache_tree(e->pcache);
    if (!tree)
        return job_fail(j, LETHE_PRUNE_FAILED,
                        "pruning needs the radix prefix cache (prefix cache mode: %s)",
                        lethe_pcache_mode(e->pcache));
    if (!e->runner.be)
        return job_fail(j, LETHE_PRUNE_FAILED,
                        "the runner has no backend to score with (fake model)");
    if (lethe_kv_format_of(e->pool) != LETHE_KV_NATIVE)
        return job_fail(j, LETHE_PRUNE_FAILED, "scoring reads native KV; the pool stores %s",
                        lethe_kv_format_name(lethe_kv_format_of(e->pool)));
    const int32_t B = LETHE_PREFIX_BLOCK, nr = res->n_ranges;
    const int32_t L0 = j->ranges[0].start, R = j->ranges[nr - 1].end;
    const int32_t nb = R / B;
    lethe_radix_block **chain = lethe_xmalloc((size_t)nb * sizeof(*chain));
    if (!lethe_radix_find(tree, j->tokens, nb, chain)) {
        int32_t have = 0;
        while (have < nb && lethe_radix_find(tree, j->tokens, have + 1, NULL)) have++;
        free(chain);
        return job_fail(j, LETHE_PRUNE_FAILED,
                        "the path is cached up to token %d, the ranges end at %d", have * B, R);
    }
    for (int32_t r = 0; r < nr; r++)
        for (int32_t k = j->ranges[r].start / B; k < j->ranges[r].end / B; k++) {
            lethe_radix_block_info bi;
            lethe_radix_block_get_info(chain[k], &bi);
            if (bi.req_refs > 0) {
                free(chain);
                return job_fail(j, LETHE_PRUNE_BLOCKED,
                                "block [%d, %d) is referenced by %d running request(s)", k * B,
                                k * B + B, bi.req_refs);
            }
            if (bi.prune_id) {
                free(chain);
                return job_fail(
                    j, LETHE_PRUNE_FAILED,
                    "block [%d, %d) was pruned by job %u; pruned ranges are not recompressed",
                    k * B, k * B + B, bi.prune_id);
            }
        }
    /* snapkv_global: the window [W, R) and what of it lies inside the ranges (protected) */
    const bool kvzip = j->p.policy == LETHE_PRUNE_KVZIP_GLOBAL;
    const int32_t obs = j->p.observation_tokens ? j->p.observation_tokens : PRUNE_DEFAULT_OBS;
    const int32_t W = kvzip ? R : LETHE_MAX(0, R - obs);
    const int32_t width = R - L0;
    bool *in_range = lethe_xcalloc((size_t)width, sizeof(bool));
    bool *keep = lethe_xcalloc((size_t)width, sizeof(bool));
    int32_t n_protected = 0;
    int32_t n_pinned = 0;
    for (int32_t r = 0; r < nr; r++)
        for (int32_t p = j->ranges[r].start; p < j->ranges[r].end; p++) {
            lethe_radix_block_info bi;
            lethe_radix_block_get_info(chain[p / B], &bi);
            const bool pinned = bi.pin >> (p % B) &
                                1; /* a retention pin of the request that wrote it */
            in_range[p - L0] = true;
            if (p >= W || pinned) keep[p - L0] = true, n_protected++;
            n_pinned += pinned;
        }
    if (n_protected > j->p.keep_tokens) {
        free(chain), free(in_range), free(keep);
        return job_fail(j, LETHE_PRUNE_FAILED,
                        "keep_tokens %d is below the %d protected tokens inside the ranges (%d "
                        "retention-pinned, "
                        "the rest the observation window: lower observation_tokens)",
                        j->p.keep_tokens, n_protected, n_pinned);
    }
    float *best = lethe_xmalloc((size_t)width * sizeof(float));
    if (!(kvzip ? score_kvzip(e, j, tree, chain, R, L0, best)
                : score_snapkv(e, j, tree, chain, R, W, L0, best))) {
        free(chain), free(in_range), free(keep), free(best);
        return;
    }
    /* the rest of the budget to the best unprotected range positions */
    cand *c = lethe_xmalloc((size_t)width * sizeof(*c));
    int32_t nc = 0;
    for (int32_t i = 0; i < width; i++)
        if (in_range[i] && !keep[i]) c[nc++] = (cand){best[i], L0 + i};
    qsort(c, (size_t)nc, sizeof(*c), cmp_cand);
    for (int32_t i = 0; i < j->p.keep_tokens - n_protected && i < nc; i++)
        keep[c[i].pos - L0] = true;
    /* commit, block by block */
    res->prune_id = res->prune_id ? res->prune_id : atomic_fetch_add(&next_prune_id, 1);
    res->freed_device_slots = 0;
    for (int32_t r = 0; r < nr; r++) {
        lethe_prune_range_result *rr = &res->ranges[r];
        *rr = (lethe_prune_range_result){.start = j->ranges[r].start,
                                         .end = j->ranges[r].end,
                                         .original_tokens = j->ranges[r].end - j->ranges[r].start};
        for (int32_t k = rr->start / B; k < rr->end / B; k++) {
            bool m[LETHE_PREFIX_BLOCK];
            for (int32_t o = 0; o < B; o++) {
                m[o] = keep[k * B + o - L0];
                rr->retained_tokens += m[o];
            }
            res->freed_device_slots += lethe_radix_prune_block(tree, chain[k], m, res->prune_id);
        }
    }
    res->status = LETHE_PRUNE_COMPLETED;
    res->quality_degraded = true;
    e->stats.cur.prune_jobs++;
    e->stats.cur.prune_freed_slots += res->freed_device_slots;
    eng_publish_stats(e);
    free(chain), free(in_range), free(keep), free(best), free(c);
}

static prune_job *job_new(const lethe_prune_params *p) {
    prune_job *j = lethe_xcalloc(1, sizeof(*j));
    j->p = *p;
    j->tokens = lethe_xmalloc((size_t)p->n_tokens * sizeof(int32_t));
    memcpy(j->tokens, p->tokens, (size_t)p->n_tokens * sizeof(int32_t));
    j->p.tokens = j->tokens;
    int32_t n = 0;
    lethe_status st = lethe_prune_validate(p, j->ranges, &n);
    LETHE_ASSERT(st == LETHE_OK);
    j->p.ranges = j->ranges;
    j->p.n_ranges = n;
    j->res.n_ranges = n;
    j->res.policy = p->policy;
    j->res.prune_id = atomic_fetch_add(&next_prune_id, 1);
    for (int32_t i = 0; i < n; i++)
        j->res.ranges[i] = (lethe_prune_range_result){.start = j->ranges[i].start,
                                                      .end = j->ranges[i].end,
                                                      .original_tokens = j->ranges[i].end -
                                                                         j->ranges[i].start};
    return j;
}

static void job_free(prune_job *j) {
    free(j->tokens);
    free(j);
}

static void run_sync(lethe_engine *e, void *arg) { run_job(e, arg); }

static void run_async(lethe_engine *e, void *arg) {
    prune_job *j = arg;
    run_job(e, j);
    if (j->done) j->done(j->user, &j->res);
    job_free(j);
}

/* hybrid models: the scoring pass runs the window after the cached prefix,
 * which would need the linear-attention states at the prefix's end */
static lethe_status refuse_hybrid(const lethe_engine *e) {
    if (e->runner.cfg.n_linear_layers == 0) return LETHE_OK;
    return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                        "prune: not available for hybrid model %s (its scoring pass would need the "
                        "linear-attention states at the end of the cached prefix)",
                        e->runner.cfg.arch);
}

int lethe_engine_prune(lethe_engine *e, const lethe_prune_params *p, lethe_prune_result *out) {
    lethe_status st = refuse_hybrid(e);
    if (st != LETHE_OK) return st;
    st = lethe_prune_validate(p, NULL, NULL);
    if (st != LETHE_OK) return st;
    prune_job *j = job_new(p);
    eng_call_wait(e, run_sync, j);
    *out = j->res;
    job_free(j);
    return LETHE_OK;
}

int lethe_engine_prune_submit(lethe_engine *e, const lethe_prune_params *p, lethe_prune_cb done,
                              void *user, uint32_t *prune_id) {
    lethe_status st = refuse_hybrid(e);
    if (st != LETHE_OK) return st;
    st = lethe_prune_validate(p, NULL, NULL);
    if (st != LETHE_OK) return st;
    prune_job *j = job_new(p);
    j->done = done;
    j->user = user;
    if (prune_id) *prune_id = j->res.prune_id;
    eng_post_call(e, run_async, j);
    return LETHE_OK;
}

/* ---- prunable retention hints ---- */

/* One job per distinct keep ratio over the finished request's prunable
 * ranges (aligned inward to blocks; shorter than two blocks: skipped), on its
 * whole token history, with a 16-token observation window. It is queued, so
 * it runs at the start of the next step, after the request's references are
 * gone; a failure (e.g. keep below the window) only counts in the stats. */
void eng_prune_hints(lethe_engine *e, const eng_req *q) {
    if (!lethe_radix_cache_tree(e->pcache) || e->runner.cfg.n_linear_layers > 0) return;
    const int32_t B = LETHE_PREFIX_BLOCK;
    bool *done = lethe_xcalloc((size_t)q->n_prunable, sizeof(bool));
    for (int32_t i = 0; i < q->n_prunable; i++) {
        if (done[i]) continue;
        const float ratio = q->prunable[i].keep_ratio;
        lethe_prune_range rr[LETHE_PRUNE_MAX_RANGES];
        int32_t n = 0, width = 0;
        for (int32_t k = i; k < q->n_prunable; k++) {
            if (done[k] || q->prunable[k].keep_ratio != ratio) continue;
            done[k] = true;
            const int32_t s = (q->prunable[k].start + B - 1) / B * B,
                          en = q->prunable[k].end / B * B;
            if (en - s < 2 * B || n == LETHE_PRUNE_MAX_RANGES) continue;
            rr[n++] = (lethe_prune_range){s, en};
            width += en - s;
        }
        const int32_t keep = (int32_t)floor((double)width * ratio);
        lethe_prune_params p = {.tokens = q->r.tokens,
                                .n_tokens = q->r.n_tokens,
                                .ranges = rr,
                                .n_ranges = n,
                                .keep_tokens = keep,
                                .policy = LETHE_PRUNE_SNAPKV_GLOBAL,
                                .observation_tokens = B};
        if (n == 0 || keep < B || lethe_prune_validate(&p, NULL, NULL) != LETHE_OK) continue;
        prune_job *j = job_new(&p);
        eng_post_call_later(e, run_async, j);
    }
    free(done);
}

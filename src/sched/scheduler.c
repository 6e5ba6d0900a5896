/* scheduler.c - one engine step's plan: which requests run, how many tokens
 * each, what gets admitted or preempted. See scheduler.h for the policy.
 *
 * Capacity arithmetic ("can it fit", always asked BEFORE allocating):
 *   available = min over slot spaces of free slots
 *             + slots the prefix cache can reclaim on demand (unreferenced
 *               radix blocks)
 *             - extra slots reserved this step by methods whose peak exceeds
 *               the tokens they append (temporary staging, for instance).
 * Per-layer slot spaces are never summed: the minimum is what every layer can
 * give. Allocation evicts from the cache only when the free lists fall short. */
#include "sched/scheduler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"

struct lethe_sched {
    lethe_sched_params p;
    lethe_kv_pool *pool;
    lethe_prefix_cache *pc;
    lethe_sparse_method *m;
    lethe_req **running;       /* admission order (oldest first) */
    int32_t n_running, cap_running;
    lethe_req *wait_head, *wait_tail;
    int32_t n_waiting;
    uint64_t next_arrival;
    lethe_sched_stats stats;
    int64_t reserved_extra;    /* this step */
    /* step output buffers */
    lethe_sched_item *items;
    int32_t cap_items;
    lethe_req **preempted, **failed;
    int32_t cap_preempted, cap_failed;
    int32_t *pos_buf;
    int32_t cap_pos;
};

void lethe_req_push_token(lethe_req *r, int32_t tok) {
    if (r->n_tokens == r->cap_tokens) {
        r->cap_tokens = r->cap_tokens ? r->cap_tokens * 2 : 64;
        r->tokens = lethe_xrealloc(r->tokens, (size_t)r->cap_tokens * sizeof(int32_t));
    }
    r->tokens[r->n_tokens++] = tok;
}

lethe_sched *lethe_sched_create(const lethe_sched_params *p, lethe_kv_pool *pool, lethe_prefix_cache *pc,
                                lethe_sparse_method *method) {
    LETHE_ASSERT(p->max_num_seqs > 0 && p->max_num_batched_tokens > 0);
    lethe_sched *s = lethe_xcalloc(1, sizeof(*s));
    s->p = *p;
    s->pool = pool;
    s->pc = pc;
    s->m = method;
    return s;
}

void lethe_sched_destroy(lethe_sched *s) {
    if (!s) return;
    free(s->running);
    free(s->items);
    free(s->preempted);
    free(s->failed);
    free(s->pos_buf);
    free(s);
}

/* ---- queues ---- */

static void wait_push_back(lethe_sched *s, lethe_req *r) {
    r->prev = s->wait_tail;
    r->next = NULL;
    if (s->wait_tail) s->wait_tail->next = r; else s->wait_head = r;
    s->wait_tail = r;
    s->n_waiting++;
}

static void wait_push_front(lethe_sched *s, lethe_req *r) {
    r->prev = NULL;
    r->next = s->wait_head;
    if (s->wait_head) s->wait_head->prev = r; else s->wait_tail = r;
    s->wait_head = r;
    s->n_waiting++;
}

static void wait_unlink(lethe_sched *s, lethe_req *r) {
    if (r->prev) r->prev->next = r->next; else s->wait_head = r->next;
    if (r->next) r->next->prev = r->prev; else s->wait_tail = r->prev;
    r->prev = r->next = NULL;
    s->n_waiting--;
}

static void running_push(lethe_sched *s, lethe_req *r) {
    if (s->n_running == s->cap_running) {
        s->cap_running = s->cap_running ? s->cap_running * 2 : 16;
        s->running = lethe_xrealloc(s->running, (size_t)s->cap_running * sizeof(*s->running));
    }
    s->running[s->n_running++] = r;
}

static void running_remove(lethe_sched *s, lethe_req *r) {
    for (int32_t i = 0; i < s->n_running; i++) {
        if (s->running[i] == r) {
            memmove(s->running + i, s->running + i + 1, (size_t)(s->n_running - i - 1) * sizeof(*s->running));
            s->n_running--;
            return;
        }
    }
    LETHE_ASSERT(!"running request not in the running list");
}

void lethe_sched_add(lethe_sched *s, lethe_req *r) {
    LETHE_ASSERT(r->state == LETHE_REQ_NEW && r->n_tokens >= 1);
    r->row = -1;
    r->n_computed = 0;
    r->n_absent = 0;
    r->arrival = s->next_arrival++;
    r->state = LETHE_REQ_WAITING;
    wait_push_back(s, r);
}

/* ---- KV of one request ---- */

/* the prefix cache's view of r */
static lethe_pc_seq pc_seq(lethe_req *r) {
    return (lethe_pc_seq){.id = r->id, .tokens = r->tokens, .n_tokens = r->n_tokens, .n_computed = r->n_computed,
                          .n_prompt = r->n_prompt,
                          .row = &r->row, .method_state = &r->method_state, .ref = &r->cache_ref};
}

/* The prefix cache lets go first (a finished chain turn takes the row and
 * the method state), then whatever is left is freed. */
static void free_kv(lethe_sched *s, lethe_req *r, lethe_pc_end how) {
    lethe_pc_seq v = pc_seq(r);
    lethe_pcache_release(s->pc, &v, how);
    if (r->row >= 0) {
        lethe_kv_row_release(s->pool, r->row);
        r->row = -1;
    }
    if (s->m && s->m->ops->request_finished && r->method_state) s->m->ops->request_finished(s->m, r->method_state);
    r->method_state = NULL;
    r->n_computed = 0;
    r->n_absent = 0;
}

void lethe_sched_remove(lethe_sched *s, lethe_req *r, bool ok) {
    if (r->state == LETHE_REQ_RUNNING) running_remove(s, r);
    else if (r->state == LETHE_REQ_WAITING) wait_unlink(s, r);
    free_kv(s, r, ok ? LETHE_PC_END_OK : LETHE_PC_END_FAILED);
    r->state = LETHE_REQ_FINISHED;
}

static void push_ptr(lethe_req ***arr, int32_t *n, int32_t *cap, lethe_req *r) {
    if (*n == *cap) {
        *cap = *cap ? *cap * 2 : 8;
        *arr = lethe_xrealloc(*arr, (size_t)*cap * sizeof(**arr));
    }
    (*arr)[(*n)++] = r;
}

static void preempt(lethe_sched *s, lethe_sched_out *out, lethe_req *r) {
    running_remove(s, r);
    free_kv(s, r, LETHE_PC_END_PREEMPTED);
    r->state = LETHE_REQ_WAITING;
    r->n_preemptions++;
    s->stats.n_preemptions++;
    wait_push_front(s, r);
    push_ptr(&s->preempted, &out->n_preempted, &s->cap_preempted, r);
    out->preempted = s->preempted;
    LOG_DEBUG("sched: preempted request %llu (%d tokens) to free KV", (unsigned long long)r->id, r->n_tokens);
}

/* ---- capacity ---- */

static int64_t reclaimable(const lethe_sched *s) { return lethe_pcache_reclaimable(s->pc); }

int64_t lethe_sched_available(const lethe_sched *s) {
    return (int64_t)lethe_kv_min_free(s->pool) + reclaimable(s) - s->reserved_extra;
}

static int32_t resident(const lethe_sched *s, const lethe_req *r) {
    if (r->row < 0) return 0;
    int32_t m = 0;
    for (int32_t sp = 0; sp < lethe_kv_n_spaces(s->pool); sp++)
        m = LETHE_MAX(m, lethe_kv_row_len(s->pool, sp, r->row));
    return m;
}

void lethe_sched_seq_view(const lethe_req *r, int32_t n_new, int32_t q_row, lethe_sparse_seq *out) {
    memset(out, 0, sizeof(*out));
    out->request_id = r->id;
    out->state = r->method_state;
    out->row = r->row;
    out->q_row = q_row;
    out->n_new = n_new;
    out->first_pos = r->n_computed;
    out->n_prompt = r->n_prefill;
    out->is_prefill = r->n_computed < r->n_prefill;
    out->is_final_chunk = out->is_prefill && r->n_computed + n_new >= r->n_tokens;
    out->is_recompute = r->is_recompute;
    out->tokens = r->tokens;
    out->n_tokens = r->n_tokens;
}

static int32_t peak_for(const lethe_sched *s, const lethe_req *r, int32_t n_resident, int32_t n) {
    lethe_sparse_seq v;
    lethe_sched_seq_view(r, n, 0, &v);
    /* a decode token needs one new slot per layer */
    int32_t peak = v.is_prefill ? lethe_sparse_prefill_peak(s->m, &v, n_resident, n) : 1;
    LETHE_ASSERT(peak >= n);
    return peak;
}

/* Largest n' in [1, n] whose peak fits `avail` (0 if none); peaks are monotone in n. */
static int32_t shrink_to_fit(const lethe_sched *s, const lethe_req *r, int32_t n_resident, int32_t n,
                             int64_t avail) {
    int32_t k = (int32_t)LETHE_MIN((int64_t)n, avail);
    while (k > 0) {
        int64_t peak = peak_for(s, r, n_resident, k);
        if (peak <= avail) return k;
        k -= (int32_t)LETHE_MAX(1, LETHE_MIN(peak - avail, (int64_t)k));
    }
    return 0;
}

/* Prefill policy of the method: the final prompt chunk holds at least
 * min_final_chunk tokens (SnapKV scores with a window that must lie in it).
 * Returns the chunk to run now; <= 0 means "not this step". */
/* n tokens of a prefill chunk starting at token `start` of r: the method's
 * minimum final chunk; with chunk_align (hybrid models) the linear-attention
 * layers must see the same segments however a prompt is split
 * (backend.h lethe_gdn_args): a chunk inside the user's prompt ends at its
 * end or at a multiple of chunk_align positions (0 tokens: not this step),
 * and past it (generated tokens re-prefilled after a preemption) one token
 * per step, as they were decoded. When no multiple of chunk_align leaves the
 * method its minimum final chunk even with a whole step's budget (a prompt
 * end less than the final chunk past the last multiple the budget reaches),
 * the final-chunk rule wins and the chunk ends unaligned (the states stay
 * exact; only that prompt's rounding then depends on its split). */
static int32_t final_chunk_only(const lethe_sched *s, int32_t n, int32_t remaining) {
    int32_t mfc = s->m ? lethe_sparse_min_final_chunk(s->m) : 0;
    if (mfc > 0 && n < remaining && remaining - n < mfc) n = remaining - mfc;
    return n;
}
static int32_t aligned_end(const lethe_sched *s, const lethe_req *r, int32_t start, int32_t n) {
    const int32_t a = s->p.chunk_align;
    const int32_t end = start < r->n_prompt ? r->n_prompt : start + 1;
    return start + n >= end ? end - start : (start + n) / a * a - start;
}
static int32_t respect_final_chunk(const lethe_sched *s, const lethe_req *r, int32_t start, int32_t n,
                                   int32_t remaining) {
    const int32_t nf = final_chunk_only(s, n, remaining);
    if (s->p.chunk_align <= 1 || nf <= 0) return nf;
    const int32_t k = aligned_end(s, r, start, nf);
    if (k > 0 || nf == n) return k; /* aligned, or the budget alone stopped short of a multiple */
    /* the final chunk cut it below a multiple: would a whole step's budget find one? */
    const int32_t full = final_chunk_only(s, LETHE_MIN(remaining, s->p.max_num_batched_tokens), remaining);
    return full > 0 && aligned_end(s, r, start, full) > 0 ? 0 : nf;
}

/* n tokens of a prefill chunk from `start`, cut where the prefix cache wants
 * the chunk to end (a hybrid model's radix cache: its state snapshot points),
 * unless that would leave the method less than its minimum final chunk */
static int32_t cache_chunk_end(const lethe_sched *s, lethe_req *r, int32_t start, int32_t n) {
    lethe_pc_seq v = pc_seq(r);
    const int32_t k = lethe_pcache_chunk_end(s->pc, &v, start, n);
    const int32_t mfc = s->m ? lethe_sparse_min_final_chunk(s->m) : 0;
    return k < n && r->n_tokens - start - k < mfc ? n : k;
}

/* Takes `n` new slots at the next positions (evicting from the cache if needed). */
static void allocate(lethe_sched *s, lethe_req *r, int32_t n, int32_t peak) {
    int64_t need = (int64_t)n + s->reserved_extra + (peak - n);
    if (lethe_kv_min_free(s->pool) < need) lethe_pcache_evict(s->pc, (int32_t)need);
    if (n > s->cap_pos) {
        s->cap_pos = LETHE_MAX(n, 2 * s->cap_pos);
        s->pos_buf = lethe_xrealloc(s->pos_buf, (size_t)s->cap_pos * sizeof(int32_t));
    }
    for (int32_t i = 0; i < n; i++) s->pos_buf[i] = r->n_computed + i;
    bool ok = lethe_kv_row_append(s->pool, r->row, n, s->pos_buf);
    LETHE_ASSERT(ok); /* capacity was checked before */
    s->reserved_extra += peak - n;
}

static void emit(lethe_sched *s, lethe_sched_out *out, lethe_req *r, int32_t n) {
    if (out->n_items == s->cap_items) {
        s->cap_items = s->cap_items ? s->cap_items * 2 : 32;
        s->items = lethe_xrealloc(s->items, (size_t)s->cap_items * sizeof(*s->items));
    }
    out->items = s->items;
    lethe_sched_item *it = &s->items[out->n_items++];
    it->req = r;
    it->start = r->n_computed;
    it->n = n;
    it->is_prefill = r->n_computed < r->n_prefill;
    it->wants_logits = r->n_computed + n == r->n_tokens;
    out->n_tokens += n;
    if (it->is_prefill) out->n_prefill_tokens += n; else out->n_decode_tokens += n;
}

static void fail(lethe_sched *s, lethe_sched_out *out, lethe_req *r, int32_t need, int64_t avail) {
    if (!r->fail_reason[0])
        snprintf(r->fail_reason, sizeof(r->fail_reason),
                 "KV cache too small for this request: it needs %d more slots per layer, %lld can be "
                 "made available (%d slots per layer in total); raise --kv-cache-bytes or lower "
                 "--max-model-len", need, (long long)avail, lethe_kv_n_slots(s->pool));
    lethe_sched_remove(s, r, false);
    push_ptr(&s->failed, &out->n_failed, &s->cap_failed, r);
    out->failed = s->failed;
}

/* ---- one step ---- */

enum { PHASE_ANY, PHASE_PREFILL, PHASE_DECODE };

static bool in_phase(const lethe_req *r, int phase) {
    bool prefill = r->n_computed < r->n_prefill;
    return phase == PHASE_ANY || (phase == PHASE_PREFILL) == prefill;
}

/* Schedules running requests; returns tokens left in the budget. */
static int32_t schedule_running(lethe_sched *s, lethe_sched_out *out, int phase, int32_t budget) {
    for (int32_t i = 0; i < s->n_running && budget > 0; i++) {
        lethe_req *r = s->running[i];
        if (!in_phase(r, phase)) continue;
        bool prefill = r->n_computed < r->n_prefill;
        int32_t remaining = r->n_tokens - r->n_computed;
        int32_t n = LETHE_MIN(remaining, budget);
        LETHE_ASSERT(n >= 1);
        if (prefill) n = cache_chunk_end(s, r, r->n_computed, n);
        if (prefill && (n = respect_final_chunk(s, r, r->n_computed, n, remaining)) <= 0) continue;
        int32_t res = resident(s, r);
        for (;;) {
            int64_t avail = lethe_sched_available(s);
            int32_t peak = peak_for(s, r, res, n);
            if (peak <= avail) break;
            if (prefill) {
                int32_t k = respect_final_chunk(s, r, r->n_computed, shrink_to_fit(s, r, res, n, avail),
                                                remaining);
                if (k > 0) { n = k; break; }
            }
            lethe_req *victim = s->running[s->n_running - 1];
            if (victim == r) {
                /* r is the newest; alone with an empty cache it can never fit */
                if (s->n_running == 1 && reclaimable(s) == 0 && out->n_items == 0)
                    fail(s, out, r, peak_for(s, r, res, n), lethe_sched_available(s));
                else preempt(s, out, r);
                n = 0;
                break;
            }
            preempt(s, out, victim);
        }
        if (n == 0) break; /* r left the running list and was the last one */
        int32_t peak = peak_for(s, r, res, n);
        allocate(s, r, n, peak);
        emit(s, out, r, n);
        budget -= n;
    }
    return budget;
}

/* In-flight sharing: whether a running request is computing, right now, a
 * prefix of r's prompt beyond what the cache supplies (m->tokens) that its
 * commits will publish and r could attach (m->shareable); r then waits for
 * it instead of computing its own copy (agents that start together with one
 * system prompt compute and hold it once). Only running requests count, so
 * r never waits on something that is not making progress. */
static bool wait_for_inflight(lethe_sched *s, const lethe_req *r, const lethe_pc_match *m) {
    if (m->resume || m->shareable <= m->tokens || m->share_block <= 0) return false;
    for (int32_t i = 0; i < s->n_running; i++) {
        lethe_req *o = s->running[i];
        lethe_pc_seq v = pc_seq(o);
        const int32_t lim = LETHE_MIN(LETHE_MIN(m->shareable, lethe_pcache_publishes(s->pc, &v)),
                                      LETHE_MIN(o->n_tokens, r->n_tokens));
        if (o->n_computed >= lim || lim <= m->tokens) continue;
        /* the common prefix, in whole blocks past the hit */
        int32_t k = m->tokens;
        while (k < lim && o->tokens[k] == r->tokens[k]) k++;
        if (k / m->share_block * m->share_block > LETHE_MAX(m->tokens, o->n_computed)) return true;
    }
    return false;
}

static int32_t admit_waiting(lethe_sched *s, lethe_sched_out *out, int32_t budget) {
    /* hybrid models: a row comes with a state slot (kv_pool.h); none free, no admission */
    for (lethe_req *r = s->wait_head, *next; r && budget > 0 && s->n_running < s->p.max_num_seqs &&
                                             lethe_kv_state_n_free(s->pool) > 0;
         r = next) {
        next = r->next;
        /* what the prefix cache can supply (read-only): shared blocks, or a
         * chain turn's resident row (possibly compacted: resident < hit) */
        lethe_pc_seq v = pc_seq(r);
        lethe_pc_match m;
        lethe_pcache_match(s->pc, &v, &m);
        if (wait_for_inflight(s, r, &m)) { /* attaches it next steps, once published */
            s->stats.n_inflight_waits++;
            continue;
        }
        int32_t hit = m.tokens;
        int32_t res0 = m.resident; /* resident entries before the first chunk (max over slot spaces) */
        int32_t n = respect_final_chunk(s, r, hit, cache_chunk_end(s, r, hit, LETHE_MIN(r->n_tokens - hit, budget)),
                                        r->n_tokens - hit);
        if (n <= 0) break; /* the final chunk needs more budget than this step has left */
        int64_t avail = lethe_sched_available(s) - m.pinned;
        /* peak of the first chunk, asked with the state it will have */
        int32_t saved_computed = r->n_computed, saved_prefill = r->n_prefill;
        r->n_computed = hit;
        r->n_prefill = r->n_tokens;
        int32_t peak = peak_for(s, r, res0, n);
        if (peak > avail) {
            bool alone = s->n_running == 0 && out->n_items == 0;
            int32_t k = alone ? respect_final_chunk(s, r, hit, shrink_to_fit(s, r, res0, n, avail), r->n_tokens - hit)
                              : 0;
            if (k == 0) {
                r->n_computed = saved_computed;
                r->n_prefill = saved_prefill;
                if (alone) { /* nothing else holds KV: waiting would never help */
                    fail(s, out, r, peak, avail);
                    continue;
                }
                break; /* FCFS: the head waits, nobody overtakes it */
            }
            n = k;
            peak = peak_for(s, r, res0, n);
        }
        /* commit: a fresh row unless the cache hands over a resident one */
        wait_unlink(s, r);
        if (!m.resume) r->row = lethe_kv_row_alloc(s->pool);
        v = pc_seq(r);
        lethe_pcache_acquire(s->pc, &v, &m);
        r->n_absent = hit - m.resident;
        /* retention pins: the row's protected mask (a resumed chain row keeps its earlier ones);
         * shared radix blocks below the hit are not this request's to keep */
        if (r->n_pinned > 0) lethe_kv_row_protect(s->pool, r->row, r->pinned, r->n_pinned);
        r->protect_from = m.resume ? 0 : hit;
        r->is_recompute = r->admitted_once;
        if (!r->admitted_once) r->cached_tokens = hit;
        r->admitted_once = true;
        s->stats.prefix_queries_tokens += m.queried;
        if (m.queried > 0) s->stats.prefix_hit_tokens += hit;
        r->state = LETHE_REQ_RUNNING;
        running_push(s, r);
        if (s->m && s->m->ops->request_init && !m.resume) {
            lethe_sparse_seq sv;
            lethe_sched_seq_view(r, n, 0, &sv);
            lethe_status st = s->m->ops->request_init(s->m, &sv, &r->method_state);
            if (st != LETHE_OK) {
                snprintf(r->fail_reason, sizeof(r->fail_reason), "sparse method %s: %s", s->m->ops->name,
                         lethe_last_error());
                fail(s, out, r, 0, 0);
                continue;
            }
        }
        allocate(s, r, n, peak);
        emit(s, out, r, n);
        budget -= n;
    }
    return budget;
}

static void plan(lethe_sched *s, lethe_sched_out *out, int phase) {
    int32_t budget = schedule_running(s, out, phase, s->p.max_num_batched_tokens);
    if (out->n_preempted == 0 && phase != PHASE_DECODE) admit_waiting(s, out, budget);
}

void lethe_sched_schedule(lethe_sched *s, lethe_sched_out *out) {
    memset(out, 0, sizeof(*out));
    s->reserved_extra = 0;
    if (!s->p.split_prefill_decode) {
        plan(s, out, PHASE_ANY);
    } else {
        bool prefill_work = s->n_waiting > 0 && s->n_running < s->p.max_num_seqs;
        for (int32_t i = 0; i < s->n_running && !prefill_work; i++)
            prefill_work = s->running[i]->n_computed < s->running[i]->n_prefill;
        if (prefill_work) plan(s, out, PHASE_PREFILL);
        if (out->n_items == 0) plan(s, out, PHASE_DECODE);
    }
    /* temporary slots a method reserved must physically exist during the step */
    if (s->reserved_extra > 0 && lethe_kv_min_free(s->pool) < s->reserved_extra)
        lethe_pcache_evict(s->pc, (int32_t)s->reserved_extra);
}

void lethe_sched_commit(lethe_sched *s, const lethe_sched_out *out) {
    for (int32_t i = 0; i < out->n_items; i++) {
        const lethe_sched_item *it = &out->items[i];
        lethe_req *r = it->req;
        if (r->state != LETHE_REQ_RUNNING) continue; /* removed during the step */
        LETHE_ASSERT(r->n_computed == it->start);
        r->n_computed += it->n;
        lethe_pc_seq v = pc_seq(r);
        lethe_pcache_commit(s->pc, &v); /* e.g. publish newly completed full blocks */
    }
}

bool lethe_sched_has_work(const lethe_sched *s) { return s->n_running > 0 || s->n_waiting > 0; }
int32_t lethe_sched_n_running(const lethe_sched *s) { return s->n_running; }
int32_t lethe_sched_n_waiting(const lethe_sched *s) { return s->n_waiting; }
lethe_req *lethe_sched_running_at(const lethe_sched *s, int32_t i) {
    return i >= 0 && i < s->n_running ? s->running[i] : NULL;
}
const lethe_sched_stats *lethe_sched_get_stats(const lethe_sched *s) { return &s->stats; }

/* engine_step.c - one engine step, from the scheduler's plan to events:
 * eng_step = step_schedule -> step_run -> step_postprocess.
 *
 *   schedule     the prefix cache's reclaimed KV and the inbox (queued submissions and
 *                cancels: cancelled KV is freed before anything is
 *                scheduled), then lethe_sched_schedule (sched/scheduler.c):
 *                which requests, how many tokens, slots appended to their rows
 *   run          the batch (build_batch), method->prepare, the forward
 *                (eng_forward, engine_forward.c: per-layer plan_layer hooks
 *                that ask the sparse method for each sequence's selection, or
 *                one uniform plan), sampling on the backend when no row needs
 *                host logits (engine_sample.c), method->finish_step
 *                (eviction), lethe_sched_commit (n_computed advances, full
 *                blocks go to the cache). Diagnostics hook around it
 *                (engine_diag.c: LETHE_STEP_TIMES, LETHE_PROFILE_STEP).
 *   postprocess  per logits row: the forced token or the sampled one, then
 *                EOS / stop token / detokenize / stop strings / max_tokens /
 *                max_model_len, one event per token (the finishing one has
 *                finished = true)
 *   (or fail)    a forward that failed (a backend error) ends every request
 *                of its batch with an internal error instead (step_fail)
 * then the invariant check (check_invariants) and the stats snapshot. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "grammar/grammar.h"

void eng_ensure_caps(lethe_engine *e, int32_t n_rows, int32_t n_seqs) {
    if (n_rows > e->step.cap_rows) {
        e->step.cap_rows = LETHE_MAX(n_rows, 2 * e->step.cap_rows);
        e->step.tokens = lethe_xrealloc(e->step.tokens, (size_t)e->step.cap_rows * sizeof(int32_t));
        e->step.pos = lethe_xrealloc(e->step.pos, (size_t)e->step.cap_rows * sizeof(int32_t));
        e->step.logit_rows = lethe_xrealloc(e->step.logit_rows, (size_t)e->step.cap_rows * sizeof(int32_t));
        e->plan.store = lethe_xrealloc(e->plan.store, (size_t)e->step.cap_rows * sizeof(int32_t));
    }
    if (n_seqs > e->step.cap_seqs) {
        e->step.cap_seqs = LETHE_MAX(n_seqs, 2 * e->step.cap_seqs);
        e->step.seq_begin = lethe_xrealloc(e->step.seq_begin, (size_t)(e->step.cap_seqs + 1) * sizeof(int32_t));
        e->step.state_slots = lethe_xrealloc(e->step.state_slots, (size_t)e->step.cap_seqs * sizeof(int32_t));
        e->plan.sel_begin = lethe_xrealloc(e->plan.sel_begin, (size_t)(e->step.cap_seqs + 1) * sizeof(int32_t));
        e->plan.rows_begin = lethe_xrealloc(e->plan.rows_begin, (size_t)(e->step.cap_seqs + 1) * sizeof(int32_t));
        e->step.seqs = lethe_xrealloc(e->step.seqs, (size_t)e->step.cap_seqs * sizeof(*e->step.seqs));
        e->step.seq_req = lethe_xrealloc(e->step.seq_req, (size_t)e->step.cap_seqs * sizeof(*e->step.seq_req));
    }
}

/* ---- tokens -> events ---- */

static bool is_eos(const lethe_engine *e, int32_t tok) {
    const lethe_model_config *c = &e->runner.cfg;
    for (int32_t i = 0; i < c->n_eos_ids; i++)
        if (c->eos_ids[i] == tok) return true;
    return e->tok && lethe_tokenizer_is_eog(e->tok, tok);
}

typedef struct textbuf {
    char *s;
    size_t n, cap;
} textbuf;

static void tb_add(textbuf *t, const char *s, size_t n) {
    if (t->n + n + 1 > t->cap) {
        t->cap = LETHE_MAX(t->n + n + 1, 2 * t->cap + 64);
        t->s = lethe_xrealloc(t->s, t->cap);
    }
    memcpy(t->s + t->n, s, n);
    t->n += n;
    t->s[t->n] = '\0';
}

/* detokenized text through the stop-string filter; returns true on a stop string */
static bool add_text(eng_req *q, textbuf *t, const char *s, size_t n) {
    if (!q->stop_list[0]) {
        tb_add(t, s, n);
        return false;
    }
    const char *rel;
    size_t n_rel;
    bool hit = lethe_stopstr_push(&q->stop, s, n, &rel, &n_rel);
    tb_add(t, rel, n_rel);
    return hit;
}

/* The finish reason after token `tok` (pushed already), and its text in
 * `text`: detokenized through the stop-string filter; on a finish, what the
 * detokenizer and the filter held back is released. */
static lethe_finish_reason token_text(lethe_engine *e, eng_req *q, int32_t tok, bool forced,
                                      textbuf *text) {
    bool stop_tok = false;
    if (!forced) {
        stop_tok = !q->sp.ignore_eos && is_eos(e, tok);
        for (int32_t i = 0; i < q->sp.n_stop_token_ids; i++) stop_tok |= q->sp.stop_token_ids[i] == tok;
    }
    text->n = 0;
    tb_add(text, "", 0);
    bool stop_str = false;
    if (e->tok && !stop_tok) {
        size_t n = lethe_detok_push(&q->detok, tok, e->step.detok_buf, e->step.detok_cap);
        stop_str = add_text(q, text, e->step.detok_buf, n);
    }
    lethe_finish_reason why = LETHE_FINISH_NONE;
    if (stop_tok || stop_str) why = LETHE_FINISH_STOP;
    else if (q->r.n_tokens >= q->max_total) why = LETHE_FINISH_LENGTH;
    if (why != LETHE_FINISH_NONE && !stop_str && e->tok) {
        /* release what was held back: incomplete UTF-8, possible stop-string starts */
        size_t n = lethe_detok_flush(&q->detok, e->step.detok_buf, e->step.detok_cap);
        if (n && add_text(q, text, e->step.detok_buf, n)) stop_str = true, why = LETHE_FINISH_STOP;
        if (!stop_str && q->stop_list[0]) {
            const char *rel;
            size_t n_rel;
            lethe_stopstr_flush(&q->stop, &rel, &n_rel);
            tb_add(text, rel, n_rel);
        }
    }
    return why;
}

/* One token's event; a finishing request leaves before its callback runs,
 * like eng_finish. */
static void emit(lethe_engine *e, eng_req *q, const lethe_sample_result *res,
                 lethe_finish_reason why, const char *text, const float *logits) {
    const lethe_req *r = &q->r;
    lethe_event ev = {0};
    ev.request_id = r->id;
    ev.n_tokens = 1;
    ev.token = res->token;
    ev.text = text;
    ev.logprob = res->logprob;
    ev.n_top = res->n_top;
    ev.top = res->top;
    ev.finished = why != LETHE_FINISH_NONE;
    ev.finish_reason = why;
    ev.prompt_tokens = r->n_prompt;
    ev.completion_tokens = r->n_tokens - r->n_prompt;
    ev.cached_tokens = r->cached_tokens;
    ev.ttft_s = q->ttft;
    if (q->want_logits) {
        ev.logits = logits;
        ev.n_vocab = e->n_vocab;
    }
    if (ev.finished) {
        eng_retire(e, q, true);
        if (q->cb) q->cb(q->user, &ev);
        eng_req_free(q);
    } else if (q->cb) {
        q->cb(q->user, &ev);
    }
}

/* Logits row k of the step for request q: its token, stop checks, text,
 * event. logits: the host row, or NULL when the backend sampled. */
static void process_token(lethe_engine *e, eng_req *q, const float *logits, int32_t k,
                          textbuf *text) {
    const bool forced = q->r.n_tokens - q->r.n_prompt < q->n_forced;
    lethe_sample_result res;
    eng_sample_token(e, q, logits, k, &res); /* engine_sample.c */
    if (q->gm && !forced && !lethe_gmatcher_accept(q->gm, res.token)) {
        /* cannot happen while the mask is applied; refuse the token rather than emit it */
        LOG_ERROR("request %llu: token %d is not allowed by its grammar", (unsigned long long)q->r.id, res.token);
        eng_finish(e, q, LETHE_FINISH_ERROR, "structured output: the sampled token is not allowed by the grammar");
        return;
    }
    lethe_req_push_token(&q->r, res.token);
    e->stats.cur.generation_tokens_total++;
    if (!q->has_ttft) {
        q->ttft = lethe_time_s() - q->t_submit;
        q->has_ttft = true;
    }
    const lethe_finish_reason why = token_text(e, q, res.token, forced, text);
    emit(e, q, &res, why, text->s, logits);
}

/* ---- the step: schedule -> run -> postprocess ---- */

/* The prefix cache's reclaimed KV and the inbox first (a cancel frees its KV before anything
 * is scheduled), then the scheduler's plan; requests it failed end here. */
static void step_schedule(lethe_engine *e, lethe_sched_out *out) {
    lethe_pcache_drain(e->pcache); /* reclaimed chains free their KV before new turns are admitted */
    eng_apply_inbox(e);
    eng_run_calls(e); /* prefix-cache control and pruning: no request is mid-forward */
    lethe_sched_schedule(e->sched, out);
    for (int32_t i = 0; i < out->n_failed; i++) {
        eng_req *q = (eng_req *)out->failed[i];
        LOG_WARN("request %llu: %s", (unsigned long long)q->r.id, q->r.fail_reason);
        eng_finish(e, q, LETHE_FINISH_ERROR, q->r.fail_reason);
    }
}

/* The scheduler's items as the forward batch (e->step): tokens, logical
 * positions, sequence boundaries, the rows whose logits are wanted (the last
 * row of chunks that reach the end), and the method's view of them. */
static void build_batch(lethe_engine *e, const lethe_sched_out *out) {
    eng_ensure_caps(e, out->n_tokens, out->n_items);
    eng_step_state *s = &e->step;
    int32_t row = 0, n_logits = 0;
    for (int32_t i = 0; i < out->n_items; i++) {
        const lethe_sched_item *it = &out->items[i];
        lethe_req *r = it->req;
        s->seq_begin[i] = row;
        s->state_slots[i] = lethe_kv_has_states(e->pool) ? lethe_kv_row_state(e->pool, r->row) : -1;
        lethe_sched_seq_view(r, it->n, row, &s->seqs[i]);
        s->seq_req[i] = (eng_req *)r;
        for (int32_t j = 0; j < it->n; j++) {
            s->tokens[row] = r->tokens[it->start + j];
            s->pos[row] = it->start + j;
            row++;
        }
        if (it->wants_logits) s->logit_rows[n_logits++] = row - 1;
    }
    s->seq_begin[out->n_items] = row;
    LETHE_ASSERT(row == out->n_tokens && n_logits <= s->cap_logits);
    s->batch = (lethe_fwd_batch){.n_tokens = row,
                                 .tokens = s->tokens,
                                 .pos = s->pos,
                                 .n_seqs = out->n_items,
                                 .seq_begin = s->seq_begin,
                                 .n_logits = n_logits,
                                 .logit_rows = s->logit_rows,
                                 .state_slots = lethe_kv_has_states(e->pool) ? s->state_slots : NULL};
    s->st = (lethe_sparse_step){
        .index = s->index, .n_seqs = out->n_items, .seqs = s->seqs, .batch = &s->batch};
}

/* The batch through the model and the sampler: method->prepare, the forward
 * (engine_forward.c), the tokens on the backend when no row needs host
 * logits (engine_sample.c), method->finish_step (eviction), then the
 * scheduler's commit (n_computed advances, full blocks go to the cache).
 * *on_device: whether the backend sampled. A failed forward stops right
 * after it (nothing sampled, evicted or committed) and returns its status. */
static lethe_status step_run(lethe_engine *e, const lethe_sched_out *out, bool *on_device) {
    build_batch(e, out);
    lethe_sparse_method *m = e->method;
    if (m->ops->prepare) m->ops->prepare(m, &e->step.st);
    *on_device = eng_sample_on_device(e, out);
    eng_diag_step_begin(e, out->n_prefill_tokens == 0); /* engine_diag.c */
    const lethe_status st = eng_forward(e, *on_device ? NULL : e->step.logits);
    eng_diag_forward_done(e);
    e->step.index++;
    if (st != LETHE_OK) {
        eng_diag_step_end(e);
        return st;
    }
    if (*on_device) eng_sample_device(e, out); /* right after the forward or its graph replay */
    if (m->ops->finish_step) m->ops->finish_step(m, &e->step.st);
    eng_diag_step_end(e);
    lethe_sched_commit(e->sched, out);
    e->stats.cur.n_steps++;
    e->stats.cur.prefill_tokens_computed += out->n_prefill_tokens;
    return LETHE_OK;
}

/* A failed step (the forward's error in lethe_last_error): every request of
 * its batch ends with an internal error, the others are untouched. Its K/V
 * went only to its own requests' new slots (the store slots appended this
 * step), never to a slot another request or the prefix cache can read:
 * cached blocks are published at commit, which did not happen. Ending a
 * request releases its row, its method state and its cache references (a
 * chain turn's chain is invalidated, LETHE_PC_END_FAILED), so no slot stays
 * held; the invariant check after the step verifies it. */
static void step_fail(lethe_engine *e, const lethe_sched_out *out) {
    char msg[320];
    snprintf(msg, sizeof(msg), "%s", lethe_last_error());
    LOG_ERROR("engine step %lld failed, ending its %d requests: %s", (long long)e->step.index - 1,
              out->n_items, msg);
    for (int32_t i = 0; i < out->n_items; i++) eng_fail_internal(e, e->step.seq_req[i], msg);
    e->stats.cur.n_failed_steps++;
}

/* Per logits row, in order: the token and its event (process_token). */
static void step_postprocess(lethe_engine *e, const lethe_sched_out *out, bool on_device) {
    textbuf text = {0};
    int32_t k = 0;
    for (int32_t i = 0; i < out->n_items; i++) {
        if (!out->items[i].wants_logits) continue;
        const float *logits = on_device ? NULL : e->step.logits + (size_t)k * (size_t)e->n_vocab;
        process_token(e, e->step.seq_req[i], logits, k, &text);
        k++;
    }
    free(text.s);
}

int eng_step(lethe_engine *e) {
    lethe_sched_out out;
    step_schedule(e, &out);
    if (out.n_items > 0) {
        bool on_device = false;
        if (step_run(e, &out, &on_device) == LETHE_OK) step_postprocess(e, &out, on_device);
        else step_fail(e, &out);
    }
    lethe_status st = LETHE_OK;
    if (e->p.check_invariants) {
        st = eng_check(e);
        if (st != LETHE_OK) LOG_ERROR("%s", lethe_last_error());
    }
    eng_publish_stats(e);
    return st;
}

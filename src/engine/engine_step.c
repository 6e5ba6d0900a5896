/* engine_step.c - one engine step, from the scheduler's plan to events.
 *
 *   1. inbox: queued submissions and cancels (cancelled KV is freed here,
 *      before anything is scheduled)
 *   2. lethe_sched_schedule: which requests, how many tokens, slots appended
 *      to their rows (sched/scheduler.c)
 *   3. the batch: tokens, logical positions, sequence boundaries, the rows
 *      whose logits are wanted (last row of chunks that reach the end)
 *   4. method->prepare, the forward (eng_forward: per layer, or once for a
 *      uniform method, see engine_forward.c); inside, per layer, plan_layer()
 *      answers "where do the new K/V go and what does attention read" by
 *      asking the sparse method for each sequence's selection
 *      (build_prefill_selection / build_decode_selection), then after_attn
 *      (with the attention's arguments when needs_scores: the method scores
 *      through the backend's attn_scores op) + layer_end; method->finish_step
 *      (eviction) after the forward
 *   5. lethe_sched_commit: n_computed advances, full blocks go to the cache
 *   6. per logits row: forced token or the sampled one, then EOS / stop
 *      token / detokenize / stop strings / max_tokens / max_model_len, one
 *      event per token (the finishing one has finished = true). Sampling
 *      runs on the backend (runner->sample -> ops->sample on the logits the
 *      forward left on the device, no logits copy) unless a row of the step
 *      needs host logits (want_logits, top logprobs, logprobs of a forced
 *      token): then the forward copies the logits rows to the host and
 *      lethe_sampler_sample runs there. Both give the same tokens
 *      (backend/sample.h).
 *   7. invariant check (check_invariants) and the stats snapshot. */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"

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
        e->plan.sel_begin = lethe_xrealloc(e->plan.sel_begin, (size_t)(e->step.cap_seqs + 1) * sizeof(int32_t));
        e->plan.rows_begin = lethe_xrealloc(e->plan.rows_begin, (size_t)(e->step.cap_seqs + 1) * sizeof(int32_t));
        e->step.seqs = lethe_xrealloc(e->step.seqs, (size_t)e->step.cap_seqs * sizeof(*e->step.seqs));
        e->step.seq_req = lethe_xrealloc(e->step.seq_req, (size_t)e->step.cap_seqs * sizeof(*e->step.seq_req));
    }
}

/* ---- forward hooks ---- */

/* The method's select_layer answer as the layer's plan (rows: the step's
 * staged full rows, engine_forward.c); false: build per sequence. */
static bool plan_from_select_layer(lethe_engine *e, int32_t layer, const void *q,
                                   lethe_layer_plan *out) {
    lethe_sparse_method *m = e->method;
    const int32_t n_seqs = e->step.st.n_seqs;
    const lethe_step_rows rows = {.begin = e->plan.rows_begin, .slots = e->plan.rows};
    const int32_t *sb = NULL, *ss = NULL;
    lethe_sel_result r = m->ops->select_layer(m, layer, &e->step.st, q, &rows, &sb, &ss);
    if (r == LETHE_SEL_PER_SEQ) return false;
    out->store_slots = e->plan.store; /* staged: the new tokens' slots, the same in every layer */
    out->kvq = lethe_kv_quant_of(e->pool, layer);
    LETHE_ASSERT(!out->kvq); /* built selections live on the backend: native KV only */
    if (r == LETHE_SEL_FULL) {
        out->sel_begin = e->plan.rows_begin;
        out->sel_slots = e->plan.rows;
    } else {
        LETHE_ASSERT(r == LETHE_SEL_BUILT && sb && ss && sb[0] == 0);
        /* counts always; the contents live on the backend, readable here when
         * backend memory is host memory (the CPU backend: every test) */
        const bool host_view = e->p.check_invariants &&
                               lethe_backend_has(e->runner.be, LETHE_BE_HOST_MEMORY);
        const int32_t sp = lethe_kv_space_of(e->pool, layer);
        for (int32_t s = 0; s < n_seqs; s++) {
            const lethe_sparse_seq *sq = &e->step.seqs[s];
            const int32_t n = sb[s + 1] - sb[s], cap = e->plan.rows_begin[s + 1] - e->plan.rows_begin[s];
            LETHE_ASSERT(n >= sq->n_new && n <= cap);
            if (!host_view) continue;
            const int32_t *sel = ss + sb[s];
            for (int32_t j = 0; j < sq->n_new; j++) /* the new tokens last, in order */
                LETHE_ASSERT(sel[n - sq->n_new + j] == e->plan.store[sq->q_row + j]);
            for (int32_t j = 0; j < n; j++) LETHE_ASSERT(lethe_kv_refcount(e->pool, sp, sel[j]) > 0);
        }
        out->sel_begin = sb;
        out->sel_slots = ss;
        e->stats.cur.device_selections++;
    }
    e->plan.layer_scores = m->ops->needs_scores && m->ops->needs_scores(m, layer);
    return true;
}

static void plan_layer_(lethe_engine *e, int32_t layer, const void *q, lethe_layer_plan *out);

static void plan_layer(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q,
                       lethe_layer_plan *out) {
    lethe_engine *e = ctx;
    const double t0 = e->diag.timed ? lethe_time_s() : 0;
    plan_layer_(e, layer, q, out);
    if (e->diag.timed) e->diag.t_plan += lethe_time_s() - t0;
}

static void plan_layer_(lethe_engine *e, int32_t layer, const void *q, lethe_layer_plan *out) {
    lethe_sparse_method *m = e->method;
    if (e->plan.rows_staged && plan_from_select_layer(e, layer, q, out)) return;
    const int32_t sp = lethe_kv_space_of(e->pool, layer);
    const int32_t n_seqs = e->step.st.n_seqs;
    int64_t total = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_sparse_seq *sq = &e->step.seqs[s];
        int32_t len = lethe_kv_row_len(e->pool, sp, sq->row);
        const int32_t *slots = lethe_kv_row_slots(e->pool, sp, sq->row);
        LETHE_ASSERT(len >= sq->n_new);
        /* the new tokens are the row's last entries (appended by the scheduler) */
        memcpy(e->plan.store + sq->q_row, slots + len - sq->n_new, (size_t)sq->n_new * sizeof(int32_t));
        total += len;
    }
    if (total > e->plan.cap_sel) {
        e->plan.cap_sel = LETHE_MAX(total, 2 * e->plan.cap_sel);
        e->plan.sel = lethe_xrealloc(e->plan.sel, (size_t)e->plan.cap_sel * sizeof(int32_t));
    }
    int32_t off = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        const lethe_sparse_seq *sq = &e->step.seqs[s];
        int32_t cap = lethe_kv_row_len(e->pool, sp, sq->row);
        int32_t n = lethe_sparse_build_selection(m, layer, &e->step.st, s, q, e->plan.sel + off, cap);
        LETHE_ASSERT(n >= sq->n_new && n <= cap);
        if (e->p.check_invariants) {
            for (int32_t j = 0; j < sq->n_new; j++)
                LETHE_ASSERT(e->plan.sel[off + n - sq->n_new + j] == e->plan.store[sq->q_row + j]);
            for (int32_t j = 0; j < n; j++) LETHE_ASSERT(lethe_kv_refcount(e->pool, sp, e->plan.sel[off + j]) > 0);
        }
        e->plan.sel_begin[s] = off;
        off += n;
    }
    e->plan.sel_begin[n_seqs] = off;
    out->store_slots = e->plan.store;
    out->sel_begin = e->plan.sel_begin;
    out->sel_slots = e->plan.sel;
    out->kvq = lethe_kv_quant_of(e->pool, layer);
    /* asked here, while the step's selections are built: after_attn then gets
     * the attention's arguments to score with (backend attn_scores) */
    e->plan.layer_scores = m->ops->needs_scores && m->ops->needs_scores(m, layer);
}

static void after_attn(void *ctx, int32_t layer, const lethe_fwd_batch *b, const lethe_attn_args *a) {
    lethe_engine *e = ctx;
    lethe_sparse_method *m = e->method;
    (void)b;
    if (m->ops->after_attn) m->ops->after_attn(m, layer, &e->step.st, e->plan.layer_scores ? a : NULL);
    if (m->ops->layer_end) m->ops->layer_end(m, layer, &e->step.st);
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

/* ---- sampling on the backend ---- */

/* No row of this step needs host logits. */
static bool step_samples_on_device(const lethe_engine *e, const lethe_sched_out *out) {
    if (!e->ds.enabled) return false;
    for (int32_t i = 0; i < out->n_items; i++) {
        if (!out->items[i].wants_logits) continue;
        const eng_req *q = e->step.seq_req[i];
        const bool forced = q->r.n_tokens - q->r.n_prompt < q->n_forced;
        if (q->want_logits || q->sp.logprobs > 0 || (forced && q->sp.logprobs >= 0)) return false;
    }
    return true;
}

/* ops->sample over the step's logits rows (in order); results in e->ds. */
static void sample_on_device(lethe_engine *e, const lethe_sched_out *out) {
    if (!e->ds.rows) {
        e->ds.rows = lethe_xmalloc((size_t)e->step.cap_logits * sizeof(*e->ds.rows));
        e->ds.tokens = lethe_xmalloc((size_t)e->step.cap_logits * sizeof(int32_t));
        e->ds.logprobs = lethe_xmalloc((size_t)e->step.cap_logits * sizeof(float));
    }
    int32_t k = 0;
    int64_t n_pen = 0;
    bool want_lp = false;
    for (int32_t i = 0; i < out->n_items; i++) {
        if (!out->items[i].wants_logits) continue;
        eng_req *q = e->step.seq_req[i];
        const lethe_req *r = &q->r;
        const int32_t n_gen = r->n_tokens - r->n_prompt;
        lethe_sample_row row = lethe_sampler_row(&q->sp, &q->rng);
        if (n_gen < q->n_forced) { /* forced: the token is known, sample nothing */
            memset(&row, 0, sizeof(row));
            row.top_p = 1.0f;
            row.repetition_penalty = 1.0f;
        } else {
            const int64_t need = n_pen + LETHE_MIN(e->n_vocab, r->n_tokens);
            if (need > e->ds.cap_pen) {
                e->ds.cap_pen = LETHE_MAX(need, 2 * e->ds.cap_pen);
                e->ds.pen_ids = lethe_xrealloc(e->ds.pen_ids, (size_t)e->ds.cap_pen * sizeof(int32_t));
                e->ds.pen_counts = lethe_xrealloc(e->ds.pen_counts, (size_t)e->ds.cap_pen * sizeof(int32_t));
            }
            row.pen_begin = (int32_t)n_pen;
            row.n_pen = lethe_sampler_penalty_entries(&e->sws, &q->sp, r->tokens, r->n_prompt,
                                                      r->tokens + r->n_prompt, n_gen,
                                                      e->ds.pen_ids + n_pen, e->ds.pen_counts + n_pen);
            n_pen += row.n_pen;
            want_lp |= q->sp.logprobs == 0;
        }
        e->ds.rows[k++] = row;
    }
    LETHE_ASSERT(k == e->step.batch.n_logits && n_pen <= INT32_MAX);
    lethe_sample_args a = {.n = k, .n_vocab = e->n_vocab, .rows = e->ds.rows,
                           .pen_ids = e->ds.pen_ids, .pen_counts = e->ds.pen_counts,
                           .n_pen = (int32_t)n_pen, .tokens = e->ds.tokens,
                           .logprobs = want_lp ? e->ds.logprobs : NULL};
    e->runner.sample(e->runner.ctx, &a);
    e->ds.n_steps++;
}

/* logits: host row, or NULL when the backend sampled (k = the row's index) */
static void process_token(lethe_engine *e, eng_req *q, const float *logits, int32_t k, textbuf *text) {
    lethe_req *r = &q->r;
    const int32_t n_gen = r->n_tokens - r->n_prompt;
    lethe_sample_result res;
    memset(&res, 0, sizeof(res));
    const bool forced = n_gen < q->n_forced;
    if (forced) {
        res.token = q->forced[n_gen];
        if (q->sp.logprobs >= 0) lethe_sampler_logprobs(logits, e->n_vocab, res.token, q->sp.logprobs, &res);
    } else if (!logits) {
        res.token = e->ds.tokens[k];
        LETHE_ASSERT(res.token >= 0 && res.token < e->n_vocab);
        if (q->sp.logprobs == 0) res.logprob = e->ds.logprobs[k];
        lethe_sample_row row = lethe_sampler_row(&q->sp, &q->rng);
        if (!lethe_sample_is_greedy(&row)) q->rng.draw++; /* as lethe_sampler_sample does */
    } else {
        lethe_sampler_sample(&e->sws, &q->sp, &q->rng, logits, r->tokens, r->n_prompt,
                             r->tokens + r->n_prompt, n_gen, &res);
    }
    const int32_t tok = res.token;
    lethe_req_push_token(r, tok);
    e->stats.cur.generation_tokens_total++;
    if (!q->has_ttft) {
        q->ttft = lethe_time_s() - q->t_submit;
        q->has_ttft = true;
    }
    lethe_finish_reason why = LETHE_FINISH_NONE;
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
    if (stop_tok || stop_str) why = LETHE_FINISH_STOP;
    else if (r->n_tokens >= q->max_total) why = LETHE_FINISH_LENGTH;
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
    lethe_event ev = {0};
    ev.request_id = r->id;
    ev.n_tokens = 1;
    ev.token = tok;
    ev.text = text->s;
    ev.logprob = res.logprob;
    ev.n_top = res.n_top;
    ev.top = res.top;
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
        /* the request leaves before its callback runs, like eng_finish */
        eng_retire(e, q, true);
        if (q->cb) q->cb(q->user, &ev);
        eng_req_free(q);
    } else if (q->cb) {
        q->cb(q->user, &ev);
    }
}

/* ---- the step ---- */

int eng_step(lethe_engine *e) {
    lethe_pcache_drain(e->pcache); /* reclaimed chains free their KV before new turns are admitted */
    eng_apply_inbox(e);
    lethe_sched_out out;
    lethe_sched_schedule(e->sched, &out);
    for (int32_t i = 0; i < out.n_failed; i++) {
        eng_req *q = (eng_req *)out.failed[i];
        LOG_WARN("request %llu: %s", (unsigned long long)q->r.id, q->r.fail_reason);
        eng_finish(e, q, LETHE_FINISH_ERROR, q->r.fail_reason);
    }
    if (out.n_items > 0) {
        eng_ensure_caps(e, out.n_tokens, out.n_items);
        int32_t row = 0, n_logits = 0;
        for (int32_t i = 0; i < out.n_items; i++) {
            const lethe_sched_item *it = &out.items[i];
            lethe_req *r = it->req;
            e->step.seq_begin[i] = row;
            lethe_sched_seq_view(r, it->n, row, &e->step.seqs[i]);
            e->step.seq_req[i] = (eng_req *)r;
            for (int32_t j = 0; j < it->n; j++) {
                e->step.tokens[row] = r->tokens[it->start + j];
                e->step.pos[row] = it->start + j;
                row++;
            }
            if (it->wants_logits) e->step.logit_rows[n_logits++] = row - 1;
        }
        e->step.seq_begin[out.n_items] = row;
        LETHE_ASSERT(row == out.n_tokens && n_logits <= e->step.cap_logits);
        e->step.batch = (lethe_fwd_batch){.n_tokens = row, .tokens = e->step.tokens, .pos = e->step.pos,
                                     .n_seqs = out.n_items, .seq_begin = e->step.seq_begin,
                                     .n_logits = n_logits, .logit_rows = e->step.logit_rows};
        e->step.st = (lethe_sparse_step){.index = e->step.index, .n_seqs = out.n_items, .seqs = e->step.seqs,
                                    .batch = &e->step.batch};
        lethe_sparse_method *m = e->method;
        if (m->ops->prepare) m->ops->prepare(m, &e->step.st);
        lethe_fwd_hooks hooks = {.ctx = e, .plan_layer = plan_layer, .after_attn = after_attn};
        const bool on_device = step_samples_on_device(e, &out);
        const bool pure_decode = out.n_prefill_tokens == 0;
        const bool timed = e->diag.step_times && pure_decode; /* decode steps only */
        if (pure_decode) e->diag.n_decode_steps++;
        lethe_backend *be = e->runner.be;
        const bool profiled = pure_decode && e->diag.n_decode_steps == e->diag.profile_step &&
                              be && be->ops->profile_range;
        if (profiled) be->ops->profile_range(be, true);
        e->diag.timed = timed;
        const double t0 = timed ? lethe_time_s() : 0;
        /* engine_forward.c: per-layer hooks or one uniform plan */
        eng_forward(e, &hooks, on_device ? NULL : e->step.logits);
        const double t1 = timed ? lethe_time_s() : 0;
        if (on_device) sample_on_device(e, &out); /* right after the forward or its graph replay */
        if (m->ops->finish_step) m->ops->finish_step(m, &e->step.st);
        if (profiled) be->ops->profile_range(be, false);
        if (timed) {
            const double t2 = lethe_time_s();
            e->diag.n_timed++;
            e->diag.t_fwd += t1 - t0;
            e->diag.t_sample += t2 - t1;
            e->diag.t_step += t2 - t0;
        }
        lethe_sched_commit(e->sched, &out);
        e->stats.cur.n_steps++;
        e->stats.cur.prefill_tokens_computed += out.n_prefill_tokens;
        e->step.index++;
        textbuf text = {0};
        int32_t k = 0;
        for (int32_t i = 0; i < out.n_items; i++) {
            if (!out.items[i].wants_logits) continue;
            process_token(e, e->step.seq_req[i], on_device ? NULL : e->step.logits + (size_t)k * (size_t)e->n_vocab,
                          k, &text);
            k++;
        }
        free(text.s);
    }
    lethe_status st = LETHE_OK;
    if (e->p.check_invariants) {
        st = eng_check(e);
        if (st != LETHE_OK) LOG_ERROR("%s", lethe_last_error());
    }
    eng_publish_stats(e);
    return st;
}

/* engine_sample.c - the token each logits row of a step gives.
 *
 * Two paths, chosen per step (eng_sample_on_device):
 *
 *  - on the backend: no row of the step needs host logits, so the forward
 *    leaves the logits on the device and runner->sample (ops->sample) draws
 *    every row's token from them at once (eng_sample_device): per row the
 *    sampling params (lethe_sampler_row), the repetition-penalty entries of
 *    its tokens so far, and whether its logprob is wanted. No logits copy.
 *  - on the host: a row needs host logits (want_logits, top logprobs, the
 *    logprob of a forced token): the forward copies the logits rows to the
 *    host and lethe_sampler_sample (sampler.c) runs there per row.
 *
 * Both give the same tokens (backend/sample.h defines the op, sampler.c is
 * its host twin). A forced token (the request's forced output) is never
 * sampled; its row on the backend is a greedy dummy whose result is unused.
 * A request with a grammar (structured output) gets its token mask in both
 * paths: a mask row of the op's arguments on the backend (applied on the
 * device), the same bits to lethe_sampler_sample_masked on the host.
 * LETHE_SAMPLE_ON_HOST=1 forces the host path (debugging, comparisons). */
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "core/util.h"
#include "engine/engine_internal.h"

lethe_status eng_sample_init(lethe_engine *e) {
    bool on_host = false;
    lethe_status st = lethe_env_bool(LETHE_ENV_SAMPLE_ON_HOST, &on_host);
    if (st != LETHE_OK) return st;
    e->ds.enabled = e->runner.sample && !on_host;
    return LETHE_OK;
}

void eng_sample_free(lethe_engine *e) {
    free(e->ds.rows), free(e->ds.tokens), free(e->ds.logprobs), free(e->ds.pen_ids),
        free(e->ds.pen_counts);
}

/* Row i of the step (an item with a logits row) emits a forced token. */
static bool is_forced(const eng_req *q) { return q->r.n_tokens - q->r.n_prompt < q->n_forced; }

bool eng_sample_on_device(const lethe_engine *e, const lethe_sched_out *out) {
    if (!e->ds.enabled) return false;
    for (int32_t i = 0; i < out->n_items; i++) {
        if (!out->items[i].wants_logits) continue;
        const eng_req *q = e->step.seq_req[i];
        if (q->want_logits || q->sp.logprobs > 0 || (is_forced(q) && q->sp.logprobs >= 0))
            return false;
    }
    return true;
}

/* The penalty entries of q's tokens so far, appended at n_pen (grows the arrays). */
static int32_t penalty_entries(lethe_engine *e, eng_req *q, int64_t n_pen) {
    const lethe_req *r = &q->r;
    const int64_t need = n_pen + LETHE_MIN(e->n_vocab, r->n_tokens);
    if (need > e->ds.cap_pen) {
        e->ds.cap_pen = LETHE_MAX(need, 2 * e->ds.cap_pen);
        e->ds.pen_ids = lethe_xrealloc(e->ds.pen_ids, (size_t)e->ds.cap_pen * sizeof(int32_t));
        e->ds.pen_counts = lethe_xrealloc(e->ds.pen_counts,
                                          (size_t)e->ds.cap_pen * sizeof(int32_t));
    }
    return lethe_sampler_penalty_entries(&e->sws, &q->sp, r->tokens, r->n_prompt,
                                         r->tokens + r->n_prompt, r->n_tokens - r->n_prompt,
                                         e->ds.pen_ids + n_pen, e->ds.pen_counts + n_pen);
}

void eng_sample_device(lethe_engine *e, const lethe_sched_out *out) {
    if (!e->ds.rows) {
        e->ds.rows = lethe_xmalloc((size_t)e->step.cap_logits * sizeof(*e->ds.rows));
        e->ds.tokens = lethe_xmalloc((size_t)e->step.cap_logits * sizeof(int32_t));
        e->ds.logprobs = lethe_xmalloc((size_t)e->step.cap_logits * sizeof(float));
    }
    int32_t k = 0, n_mask = 0;
    int64_t n_pen = 0;
    bool want_lp = false;
    for (int32_t i = 0; i < out->n_items; i++) {
        if (!out->items[i].wants_logits) continue;
        eng_req *q = e->step.seq_req[i];
        lethe_sample_row row = lethe_sampler_row(&q->sp, &q->rng);
        if (is_forced(q)) { /* the token is known, sample nothing */
            memset(&row, 0, sizeof(row));
            row.top_p = 1.0f;
            row.repetition_penalty = 1.0f;
        } else {
            row.pen_begin = (int32_t)n_pen;
            row.n_pen = penalty_entries(e, q, n_pen);
            n_pen += row.n_pen;
            want_lp |= q->sp.logprobs == 0;
            if (q->gm) { /* structured output: the grammar's mask, applied by the op (on the device) */
                eng_grammar_mask(e, q, n_mask);
                row.mask_row = ++n_mask;
            }
        }
        e->ds.rows[k++] = row;
    }
    LETHE_ASSERT(k == e->step.batch.n_logits && n_pen <= INT32_MAX);
    lethe_sample_args a = {.n = k,
                           .n_vocab = e->n_vocab,
                           .rows = e->ds.rows,
                           .pen_ids = e->ds.pen_ids,
                           .pen_counts = e->ds.pen_counts,
                           .n_pen = (int32_t)n_pen,
                           .mask = n_mask ? e->gram.mask : NULL,
                           .n_mask = n_mask,
                           .tokens = e->ds.tokens,
                           .logprobs = want_lp ? e->ds.logprobs : NULL};
    e->runner.sample(e->runner.ctx, &a);
    e->ds.n_steps++;
}

void eng_sample_token(lethe_engine *e, eng_req *q, const float *logits, int32_t k,
                      lethe_sample_result *res) {
    lethe_req *r = &q->r;
    const int32_t n_gen = r->n_tokens - r->n_prompt;
    memset(res, 0, sizeof(*res));
    if (n_gen < q->n_forced) {
        res->token = q->forced[n_gen];
        if (q->sp.logprobs >= 0)
            lethe_sampler_logprobs(logits, e->n_vocab, res->token, q->sp.logprobs, res);
    } else if (!logits) {
        res->token = e->ds.tokens[k];
        LETHE_ASSERT(res->token >= 0 && res->token < e->n_vocab);
        if (q->sp.logprobs == 0) res->logprob = e->ds.logprobs[k];
        lethe_sample_row row = lethe_sampler_row(&q->sp, &q->rng);
        if (!lethe_sample_is_greedy(&row)) q->rng.draw++; /* as lethe_sampler_sample does */
    } else {
        const uint32_t *mask = q->gm ? eng_grammar_mask(e, q, 0) : NULL;
        lethe_sampler_sample_masked(&e->sws, &q->sp, &q->rng, logits, mask, r->tokens, r->n_prompt,
                                    r->tokens + r->n_prompt, n_gen, res);
    }
}

/* harness.c - drives an engine through eval jobs (synchronous mode, lethe.h).
 *
 * Greedy jobs: temperature 0, max_tokens = the task's budget, stop at EOS.
 * Forced jobs: max_tokens = n_forced, ignore_eos, forced = the continuation,
 * want_logits; every token event's logits go to the caller, so dense and a
 * sparse method can be compared position by position on identical inputs.
 * At most max_inflight jobs are in the engine at a time; the rest wait here
 * (the engine's own queue would also hold them, but bounding it keeps the KV
 * pool from thrashing with preemptions on long prompts). */
#include "eval/harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

typedef struct job_ctx {
    lethe_eval_job *job;
    int32_t index;
    lethe_eval_logits_fn on_logits;
    lethe_eval_done_fn on_done;
    void *user;
    int32_t *n_active;
} job_ctx;

static void append_text(lethe_eval_job *j, const char *s) {
    size_t n = strlen(s);
    if (j->n_text + n + 1 > j->cap_text) {
        j->cap_text = LETHE_MAX(j->cap_text * 2, j->n_text + n + 64);
        j->text = lethe_xrealloc(j->text, j->cap_text);
    }
    memcpy(j->text + j->n_text, s, n + 1);
    j->n_text += n;
}

static void on_event(void *user, const lethe_event *ev) {
    job_ctx *c = user;
    lethe_eval_job *j = c->job;
    if (ev->n_tokens > 0) {
        if (ev->text) append_text(j, ev->text);
        if (c->on_logits && ev->logits)
            c->on_logits(c->user, c->index, j->n_out, ev->token, ev->logits, ev->n_vocab);
        j->n_out++;
    } else if (ev->text && ev->text[0]) {
        append_text(j, ev->text); /* held-back bytes flushed on the final event */
    }
    if (ev->finished) {
        j->finish = ev->finish_reason;
        if (ev->finish_reason == LETHE_FINISH_ERROR)
            snprintf(j->error, sizeof(j->error), "%s", ev->error ? ev->error : "engine error");
        else if (ev->finish_reason == LETHE_FINISH_ABORT)
            snprintf(j->error, sizeof(j->error), "aborted");
        j->done = true;
        (*c->n_active)--;
        if (c->on_done) c->on_done(c->user, c->index);
    }
}

lethe_status lethe_eval_run_jobs(lethe_engine *e, lethe_eval_job *jobs, int32_t n, int32_t max_inflight,
                                 lethe_eval_logits_fn on_logits, lethe_eval_done_fn on_done, void *user) {
    job_ctx *ctx = lethe_xcalloc((size_t)LETHE_MAX(n, 1), sizeof(job_ctx));
    int32_t active = 0, next = 0;
    lethe_status st = LETHE_OK;
    if (max_inflight < 1) max_inflight = 1;
    for (int32_t i = 0; i < n; i++) {
        if (!jobs[i].text) append_text(&jobs[i], "");
        ctx[i] = (job_ctx){&jobs[i], i, on_logits, on_done, user, &active};
    }
    while (next < n || active > 0) {
        while (next < n && active < max_inflight) {
            lethe_eval_job *j = &jobs[next];
            lethe_request_params rp;
            memset(&rp, 0, sizeof(rp));
            rp.prompt = j->prompt;
            rp.n_prompt = j->n_prompt;
            lethe_sampling_default_params(&rp.sampling);
            rp.sampling.temperature = 0.0f;
            rp.sampling.has_seed = true;
            rp.sampling.seed = 0;
            rp.sampling.logprobs = -1;
            if (j->forced) {
                rp.forced = j->forced;
                rp.n_forced = j->n_forced;
                rp.sampling.max_tokens = j->n_forced;
                rp.sampling.ignore_eos = true;
                rp.want_logits = on_logits != NULL;
            } else {
                rp.sampling.max_tokens = j->max_new_tokens;
            }
            rp.cb = on_event;
            rp.user = &ctx[next];
            uint64_t id;
            active++;
            if (lethe_engine_add_request(e, &rp, &id) != 0) {
                active--;
                snprintf(j->error, sizeof(j->error), "rejected: %s", lethe_engine_last_error());
                j->finish = LETHE_FINISH_ERROR;
                j->done = true;
                if (on_done) on_done(user, next);
            }
            next++;
        }
        if (active == 0) continue;
        if (!lethe_engine_has_work(e)) { /* should not happen: the engine lost requests */
            st = lethe_errorf(LETHE_ERR_BACKEND, "eval: engine idle with %d requests unfinished", active);
            break;
        }
        if (lethe_engine_step(e) != 0) {
            st = lethe_errorf(LETHE_ERR_BACKEND, "eval: engine step failed: %s", lethe_engine_last_error());
            break;
        }
    }
    if (st != LETHE_OK) {
        for (int32_t i = 0; i < n; i++)
            if (!jobs[i].done) {
                snprintf(jobs[i].error, sizeof(jobs[i].error), "%s", lethe_last_error());
                jobs[i].finish = LETHE_FINISH_ERROR;
            }
    }
    free(ctx);
    return st;
}

void lethe_eval_job_free(lethe_eval_job *j) {
    if (!j) return;
    free(j->text);
    j->text = NULL;
    j->n_text = j->cap_text = 0;
}

lethe_status lethe_eval_render(lethe_engine *e, const char *user, const char *answer_prefix,
                               int32_t **ids, int32_t *n_ids) {
    const char *roles[1] = {"user"}, *contents[1] = {user};
    char *chat = NULL;
    if (lethe_engine_apply_chat(e, roles, contents, 1, true, &chat) != 0)
        return lethe_errorf(LETHE_ERR_INVALID, "eval: chat template: %s", lethe_engine_last_error());
    size_t a = strlen(chat), b = answer_prefix ? strlen(answer_prefix) : 0;
    char *full = lethe_xmalloc(a + b + 1);
    memcpy(full, chat, a);
    if (b) memcpy(full + a, answer_prefix, b);
    full[a + b] = '\0';
    free(chat);
    int rc = lethe_engine_tokenize(e, full, false, true, ids, n_ids);
    free(full);
    if (rc != 0) return lethe_errorf(LETHE_ERR_INVALID, "eval: tokenize: %s", lethe_engine_last_error());
    return LETHE_OK;
}

int32_t lethe_eval_measure_engine(void *ctx, const char *user, const char *answer_prefix) {
    int32_t *ids = NULL, n = 0;
    if (lethe_eval_render((lethe_engine *)ctx, user, answer_prefix, &ids, &n) != LETHE_OK) return -1;
    free(ids);
    return n;
}

/* harness.h - runs eval requests on an engine in synchronous mode.
 *
 * A job is one request: a prompt (token ids) and either a greedy generation
 * budget or a forced continuation (teacher forcing, with the next-token
 * logits of every position handed to a callback). lethe_eval_run_jobs keeps
 * up to max_inflight jobs in the engine at once (the engine batches them),
 * steps it until all are done and records each job's text, token count and
 * finish reason; a job the engine rejects is recorded with its error, never
 * dropped. Prompts are rendered with the model's chat template. */
#ifndef LETHE_EVAL_HARNESS_H
#define LETHE_EVAL_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "lethe.h"

typedef struct lethe_eval_job {
    /* inputs */
    const int32_t *prompt;
    int32_t n_prompt;
    const int32_t *forced;      /* teacher-forced continuation, or NULL */
    int32_t n_forced;
    int32_t max_new_tokens;     /* greedy budget when forced == NULL */
    /* outputs */
    char *text;                 /* generated text (malloc'd, NUL-terminated) */
    size_t n_text, cap_text;
    int32_t n_out;              /* tokens generated */
    lethe_finish_reason finish;
    char error[256];
    bool done;
} lethe_eval_job;

/* Called for every generated position of a job that has want_logits
 * (forced jobs): pos counts from 0; token is what was forced/sampled there;
 * logits[n_vocab] are the raw next-token logits that produced it. */
typedef void (*lethe_eval_logits_fn)(void *user, int32_t job, int32_t pos, int32_t token,
                                     const float *logits, int32_t n_vocab);
/* Called once per finished job (progress). */
typedef void (*lethe_eval_done_fn)(void *user, int32_t job);

/* Runs jobs[0..n). Returns LETHE_OK unless the engine itself fails a step
 * (then the message says why and unfinished jobs carry the error). */
lethe_status lethe_eval_run_jobs(lethe_engine *e, lethe_eval_job *jobs, int32_t n, int32_t max_inflight,
                                 lethe_eval_logits_fn on_logits, lethe_eval_done_fn on_done, void *user);
void lethe_eval_job_free(lethe_eval_job *j); /* frees text */

/* Renders one user message with the model's chat template (generation
 * prompt added), appends answer_prefix (may be NULL) and tokenizes it
 * (special tokens parsed, no extra BOS: the template carries it). */
lethe_status lethe_eval_render(lethe_engine *e, const char *user, const char *answer_prefix,
                               int32_t **ids, int32_t *n_ids);

/* lethe_eval_measure_fn over an engine (ctx = lethe_engine *): the token
 * count of lethe_eval_render, or -1 with the error set. */
int32_t lethe_eval_measure_engine(void *ctx, const char *user, const char *answer_prefix);

#endif /* LETHE_EVAL_HARNESS_H */

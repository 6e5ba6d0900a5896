/* suite.h - the `lethe eval` run: inputs prepared once, then every configuration on them.
 *
 * lethe_eval_suite_prepare() builds every input with the dense engine's
 * tokenizer and chat template: task samples per (length, task) from the
 * haystack corpus, and the token stream of the perplexity windows.
 * lethe_eval_suite_run() then runs one configuration (dense first: its
 * teacher-forced logits are the reference kept in a temporary file) and
 * appends one JSON row per (length, task); a configuration whose engine
 * could not start, or a length above the model's limit, still produces its
 * rows, with score 0 and the reason. Row fields: method, budget, knobs,
 * context_length, task, n, then score / exact / prompt_tokens_mean /
 * samples[] for tasks, or ppl / nll_mean / scored_tokens and (non-dense)
 * kl_mean / kl_median / kl_p90 / kl_p99 / kl_max / top1_agree /
 * kl_by_position[T] for "ppl"; error + errors when something failed. */
#ifndef LETHE_EVAL_SUITE_H
#define LETHE_EVAL_SUITE_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "eval/eval.h"
#include "lethe.h"

#define LETHE_EVAL_TASK_PPL LETHE_EVAL_N_TASKS /* pseudo-task: perplexity + agreement windows */
#define LETHE_EVAL_MAX_LENGTHS 16
#define LETHE_EVAL_GEN_RESERVE 64 /* tokens left free for the answer in task prompts */

typedef struct lethe_eval_suite_params {
    int32_t lengths[LETHE_EVAL_MAX_LENGTHS];
    int32_t n_lengths;
    bool task_on[LETHE_EVAL_N_TASKS + 1]; /* [LETHE_EVAL_TASK_PPL] = the ppl windows */
    int32_t samples;          /* per task and length */
    int32_t windows;          /* ppl windows per length */
    int32_t forced_tokens;    /* T: scored tokens per window */
    int32_t max_batch;        /* requests in the engine at once */
    uint64_t seed;
    int32_t n_configs;        /* for the progress bar */
    bool progress;
} lethe_eval_suite_params;

typedef struct lethe_eval_config {
    char method[64];
    int32_t budget;           /* -1: none */
    char knobs[512];          /* --sparse-config given to the engine */
} lethe_eval_config;

typedef struct lethe_eval_suite lethe_eval_suite;

/* Prepares every input on the dense engine. ppl_corpus may equal corpus.
 * Fails only when the perplexity corpus is too short for the windows. */
lethe_status lethe_eval_suite_prepare(const lethe_eval_suite_params *p, lethe_engine *dense,
                                      const lethe_eval_corpus *corpus, const lethe_eval_corpus *ppl_corpus,
                                      lethe_eval_suite **out);
/* Runs configuration c on engine e (NULL when it failed to start: then
 * cfg_error says why) and appends its rows. Dense must run first. */
void lethe_eval_suite_run(lethe_eval_suite *s, lethe_engine *e, const lethe_eval_config *c,
                          const char *cfg_error, cJSON *rows);
void lethe_eval_suite_finish_progress(lethe_eval_suite *s);
int32_t lethe_eval_suite_max_len(const lethe_eval_suite *s);
const char *lethe_eval_suite_ppl_docs(const lethe_eval_suite *s); /* files the windows came from */
void lethe_eval_suite_free(lethe_eval_suite *s);

#endif /* LETHE_EVAL_SUITE_H */

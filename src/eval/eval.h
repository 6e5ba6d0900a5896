/* eval.h - the long-context quality suite: corpus, task generators, scorers, metrics.
 *
 * Everything here is engine-free so it can be unit tested on its own:
 *  - a corpus is a folder of text files split into sentences (haystack), a
 *    word pool (common-word extraction, needle keys) and whole documents
 *    (perplexity / teacher-forced agreement);
 *  - a task generator turns (task, seed, target length in tokens) into one
 *    sample: the user message (instruction + haystack + question), an answer
 *    prefix that starts the assistant turn (RULER style) and the expected
 *    answers. Length is measured by a caller-supplied callback that returns
 *    the token count of the rendered prompt, so the generator never needs a
 *    tokenizer itself; it fills the haystack to the largest size that fits;
 *  - scorers parse the greedy output and compare answers exactly;
 *  - metrics: log-softmax, KL(p || q), top-1, NLL / perplexity, percentiles.
 *
 * The tasks follow RULER (Hsieh et al. 2024): passkey (niah_single),
 * niah_multikey (several key-value needles, one asked; the rest are
 * distractors), variable tracking (chains of VAR X = VAR Y; one distractor
 * chain) and common-word extraction (numbered word list). */
#ifndef LETHE_EVAL_H
#define LETHE_EVAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

/* ---- corpus ------------------------------------------------------------ */

typedef struct lethe_eval_corpus {
    char **docs;          /* [n_docs] whole files, whitespace-normalized, sorted by file name */
    char **doc_names;     /* [n_docs] base names */
    int32_t n_docs;
    char **sentences;     /* [n_sentences] in corpus order (each ends with . ! or ?) */
    int32_t n_sentences;
    char **words;         /* [n_words] unique lowercase alphabetic words, 4..10 letters, sorted */
    int32_t n_words;
} lethe_eval_corpus;

/* Loads every regular, non-hidden file of dir whose name ends in .txt or .md
 * (files with NUL bytes are refused). Fails with a message naming dir when
 * it holds no usable text (fewer than 50 sentences or 100 distinct words). */
lethe_status lethe_eval_corpus_load(const char *dir, lethe_eval_corpus **out);
void lethe_eval_corpus_free(lethe_eval_corpus *c); /* NULL-safe */

/* ---- tasks ------------------------------------------------------------- */

typedef enum lethe_eval_task {
    LETHE_EVAL_PASSKEY = 0,
    LETHE_EVAL_NIAH_MULTIKEY,
    LETHE_EVAL_VT,
    LETHE_EVAL_CWE,
    LETHE_EVAL_N_TASKS
} lethe_eval_task;

const char *lethe_eval_task_name(lethe_eval_task t);       /* "passkey", "niah_multikey", "vt", "cwe" */
int lethe_eval_task_from_name(const char *name);           /* -1 if unknown; accepts "niah" too */

#define LETHE_EVAL_MAX_ANSWERS 16
#define LETHE_EVAL_MAX_NEEDLES 16

/* Returns the number of prompt tokens of the chat prompt that `user` and
 * `answer_prefix` render to, or a negative value on error. Must grow (not
 * necessarily strictly) when text is added to user. */
typedef int32_t (*lethe_eval_measure_fn)(void *ctx, const char *user, const char *answer_prefix);

typedef struct lethe_eval_sample {
    lethe_eval_task task;
    uint64_t seed;
    char *user;                 /* instruction + context + question (malloc'd) */
    char *answer_prefix;        /* starts the assistant turn (malloc'd) */
    char *answers[LETHE_EVAL_MAX_ANSWERS]; /* expected strings (malloc'd) */
    int32_t n_answers;
    /* where the generator put its needles: byte offsets into user, and the
     * requested depth of each in [0, 1] (fraction of the haystack before it) */
    size_t needle_offset[LETHE_EVAL_MAX_NEEDLES];
    float needle_depth[LETHE_EVAL_MAX_NEEDLES];
    int32_t n_needles;
    int32_t n_prompt_tokens;    /* measure() of the final sample */
    int32_t max_new_tokens;     /* generation budget the scorer needs */
} lethe_eval_sample;

/* Generates one sample whose measured prompt is the longest that stays
 * <= target_tokens (haystack grown a sentence or list entry at a time).
 * Same (task, seed, corpus, target, measure) -> identical text. Fails with
 * LETHE_ERR_INVALID when even the bare task (no haystack) exceeds the target,
 * or LETHE_ERR_CAPACITY when the corpus is too small to fill it. */
lethe_status lethe_eval_generate(lethe_eval_task task, const lethe_eval_corpus *c, uint64_t seed,
                                 int32_t target_tokens, lethe_eval_measure_fn measure, void *ctx,
                                 lethe_eval_sample *out);
void lethe_eval_sample_free(lethe_eval_sample *s); /* frees the strings, NULL-safe */

/* ---- scoring ----------------------------------------------------------- */

/* Parses the greedy output (the text after answer_prefix) and returns the
 * fraction of expected answers found in [0, 1]:
 *  passkey, niah_multikey: 1 iff the first run of digits equals the answer;
 *  vt: answers (5-letter upper-case names) found among the output's
 *      upper-case words / n_answers;
 *  cwe: answers found among the output's lower-cased words / n_answers.
 * A sample is an exact match when the score is 1. */
double lethe_eval_score(const lethe_eval_sample *s, const char *output);

/* ---- metrics ----------------------------------------------------------- */

/* out[i] = x[i] - logsumexp(x), in double. */
void lethe_eval_log_softmax(const float *x, int32_t n, double *out);
/* KL(P || Q) = sum_i P_i (log P_i - log Q_i) with P = softmax(p), Q = softmax(q);
 * nats, >= 0. */
double lethe_eval_kl(const float *p_logits, const float *q_logits, int32_t n);
/* index of the largest element; ties go to the lower index */
int32_t lethe_eval_argmax(const float *x, int32_t n);
/* -log softmax(x)[target] */
double lethe_eval_nll(const float *logits, int32_t n, int32_t target);

/* Linear-interpolated percentile (numpy's default) of v[0..n), p in [0, 100].
 * Sorts v in place. n == 0 -> NaN. */
double lethe_eval_percentile(double *v, size_t n, double p);

typedef struct lethe_eval_summary {
    size_t n;
    double mean, std, min, max, median, p90, p99;
} lethe_eval_summary;
/* Summary of v[0..n) (sorts v in place); all NaN when n == 0. */
void lethe_eval_summarize(double *v, size_t n, lethe_eval_summary *out);

/* ---- lists ------------------------------------------------------------- */

/* Parses "2048,4096,8k" (k/K = x1024) into out[0..max); returns the count or
 * -1 with a message (lethe_last_error) naming the bad item. */
int lethe_eval_parse_int_list(const char *s, int32_t *out, int max);

#endif /* LETHE_EVAL_H */

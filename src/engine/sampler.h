/* sampler.h - next-token selection from host logits (engine helper).
 *
 * Split in two so that per-request state stays small:
 *   lethe_rng          per request: the seeded generator (32 bytes);
 *   lethe_sampler_ws   one per engine thread: n_vocab-sized scratch reused by
 *                      every request (never allocated per token).
 * The token history needed by the penalties (prompt + generated ids) is
 * passed in by the caller, which owns it anyway.
 *
 * lethe_sampler_sample is the backend `sample` op's definition applied to
 * one host row (backend/sample.h states it; backend/cpu/sample.c implements
 * it, and the CPU and CUDA ops run the same arithmetic), HF/vLLM semantics:
 *   1. repetition penalty r over the distinct ids of prompt + output:
 *        l > 0 ? l / r : l * r                              (HF, vLLM)
 *   2. frequency / presence penalties over the output ids (OpenAI):
 *        l -= count(id) * frequency + (count(id) > 0) * presence
 *   3. temperature == 0 or top_k == 1: greedy argmax of the penalised logits
 *      (smallest id wins ties); no random number is drawn. Otherwise weights
 *      exp((l - max) / temperature) in fixed point and
 *   4. top-k (k > 0), 5. top-p (smallest set of highest-probability tokens
 *      whose mass reaches top_p), 6. min-p (drop p < min_p * p_max), ranks
 *      ordered by (logit desc, id asc); then one draw from the survivors.
 * The RNG is counter-based: draw d of a request is a hash of (seed, d), and
 * the request's counter advances once per non-greedy sample, so a seeded
 * request reproduces the same tokens whatever else runs in the batch and
 * whether the host or the device samples it.
 *
 * Logprobs (sampling.logprobs >= 0) follow vLLM's default ("raw_logprobs"):
 * log-softmax of the RAW model logits, before penalties and temperature. The
 * chosen token's logprob is always reported; logprobs = k > 0 adds the k
 * most likely tokens of that raw distribution (descending, smallest id first
 * among equal logits). */
#ifndef LETHE_ENGINE_SAMPLER_H
#define LETHE_ENGINE_SAMPLER_H

#include <stdint.h>

#include "core/status.h"
#include "lethe.h"

#include "backend/sample.h"

typedef struct lethe_rng {
    uint64_t seed; /* key of the counter-based stream (lethe_sample_bits) */
    uint64_t draw; /* index of the next draw */
} lethe_rng;

void lethe_rng_seed(lethe_rng *r, uint64_t seed);
uint64_t lethe_rng_next(lethe_rng *r);  /* lethe_sample_bits(seed, draw++) */
double lethe_rng_uniform(lethe_rng *r); /* [0, 1), 53 bits */

typedef struct lethe_sampler_ws {
    int32_t n_vocab;
    lethe_sample_scratch row; /* [n_vocab] each: penalised copy, weights, ids */
    int32_t *pen_ids;  /* [n_vocab] penalty entries of one call */
    int32_t *pen_counts;
    int32_t *count;    /* [n_vocab] output-token counts, all zero between calls */
    uint32_t *mark;    /* [n_vocab] epoch stamps: "already listed in this call" */
    uint32_t epoch;
} lethe_sampler_ws;

lethe_status lethe_sampler_ws_init(lethe_sampler_ws *ws, int32_t n_vocab);
void lethe_sampler_ws_free(lethe_sampler_ws *ws); /* NULL-safe, idempotent */

/* Checks the sampling fields the sampler reads (ranges; logprobs <= 20);
 * LETHE_ERR_INVALID naming the field otherwise. */
lethe_status lethe_sampling_params_check(const lethe_sampling_params *p, int32_t n_vocab);

typedef struct lethe_sample_result {
    int32_t token;
    float logprob;                                  /* raw log-softmax of token; 0 if not asked */
    int32_t n_top;                                  /* = max(logprobs, 0) */
    lethe_top_logprob top[LETHE_MAX_TOP_LOGPROBS];
} lethe_sample_result;

/* Picks the next token (see the pipeline above). logits: host [n_vocab], not
 * modified. prompt/output: the request's ids so far (for the penalties). */
void lethe_sampler_sample(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng,
                          const float *logits, const int32_t *prompt, int32_t n_prompt,
                          const int32_t *output, int32_t n_output, lethe_sample_result *res);
/* The same with a token mask (backend/sample.h step 0; NULL = none). */
void lethe_sampler_sample_masked(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng,
                                 const float *logits, const uint32_t *mask, const int32_t *prompt,
                                 int32_t n_prompt, const int32_t *output, int32_t n_output,
                                 lethe_sample_result *res);

/* The op's row parameters for a request (penalty entries not set). */
lethe_sample_row lethe_sampler_row(const lethe_sampling_params *p, const lethe_rng *rng);

/* The penalty entries of backend/sample.h for one request: each distinct id
 * of prompt + output once with its output count (only output ids when the
 * repetition penalty is off; none without penalties). ids / counts need
 * room for min(n_vocab, n_prompt + n_output) entries; returns the count. */
int32_t lethe_sampler_penalty_entries(lethe_sampler_ws *ws, const lethe_sampling_params *p,
                                      const int32_t *prompt, int32_t n_prompt,
                                      const int32_t *output, int32_t n_output, int32_t *ids,
                                      int32_t *counts);

/* Fills res->logprob / res->top for a given token (used by sample, and by the
 * engine for forced tokens); n_top <= LETHE_MAX_TOP_LOGPROBS, < 0 = none. */
void lethe_sampler_logprobs(const float *logits, int32_t n_vocab, int32_t token, int32_t n_top,
                            lethe_sample_result *res);

#endif /* LETHE_ENGINE_SAMPLER_H */

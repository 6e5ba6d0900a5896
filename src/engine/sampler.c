/* sampler.c - host-side sampling: request parameters -> the backend sample
 * op's row definition (backend/sample.h, backend/cpu/sample.c), penalty
 * entries from the token history, the counter-based RNG, raw logprobs. The
 * pipeline and its semantics are documented in sampler.h. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

/* ---- RNG: counter-based (backend/sample.h) ------------------------------------ */

void lethe_rng_seed(lethe_rng *r, uint64_t seed) {
    r->seed = seed;
    r->draw = 0;
}

uint64_t lethe_rng_next(lethe_rng *r) { return lethe_sample_bits(r->seed, r->draw++); }

double lethe_rng_uniform(lethe_rng *r) { return (double)(lethe_rng_next(r) >> 11) * 0x1.0p-53; }

/* ---- workspace ------------------------------------------------------------------ */

lethe_status lethe_sampler_ws_init(lethe_sampler_ws *ws, int32_t n_vocab) {
    memset(ws, 0, sizeof(*ws));
    if (n_vocab <= 0) return lethe_errorf(LETHE_ERR_INVALID, "sampler: n_vocab %d <= 0", n_vocab);
    size_t n = (size_t)n_vocab;
    ws->n_vocab = n_vocab;
    ws->row.l = malloc(n * sizeof(float));
    ws->row.q = malloc(n * sizeof(uint64_t));
    ws->row.idx = malloc(n * sizeof(int32_t));
    ws->pen_ids = malloc(n * sizeof(int32_t));
    ws->pen_counts = malloc(n * sizeof(int32_t));
    ws->count = calloc(n, sizeof(int32_t));
    ws->mark = calloc(n, sizeof(uint32_t));
    if (!ws->row.l || !ws->row.q || !ws->row.idx || !ws->pen_ids || !ws->pen_counts || !ws->count ||
        !ws->mark) {
        lethe_sampler_ws_free(ws);
        return lethe_errorf(LETHE_ERR_NOMEM, "sampler: cannot allocate scratch for %d tokens",
                            n_vocab);
    }
    return LETHE_OK;
}

void lethe_sampler_ws_free(lethe_sampler_ws *ws) {
    if (!ws) return;
    free(ws->row.l);
    free(ws->row.q);
    free(ws->row.idx);
    free(ws->pen_ids);
    free(ws->pen_counts);
    free(ws->count);
    free(ws->mark);
    memset(ws, 0, sizeof(*ws));
}

lethe_status lethe_sampling_params_check(const lethe_sampling_params *p, int32_t n_vocab) {
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return lethe_errorf(LETHE_ERR_INVALID, "temperature %g: must be a finite number >= 0",
                            (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return lethe_errorf(LETHE_ERR_INVALID, "top_p %g: must be in (0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return lethe_errorf(LETHE_ERR_INVALID, "min_p %g: must be in [0, 1]", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f) || !isfinite(p->repetition_penalty))
        return lethe_errorf(LETHE_ERR_INVALID, "repetition_penalty %g: must be a finite number > 0",
                            (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return lethe_errorf(LETHE_ERR_INVALID, "presence_penalty %g: must be in [-2, 2]",
                            (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return lethe_errorf(LETHE_ERR_INVALID, "frequency_penalty %g: must be in [-2, 2]",
                            (double)p->frequency_penalty);
    if (p->logprobs < -1 || p->logprobs > LETHE_MAX_TOP_LOGPROBS)
        return lethe_errorf(LETHE_ERR_INVALID, "logprobs %d: must be in [-1, %d]", p->logprobs,
                            LETHE_MAX_TOP_LOGPROBS);
    (void)n_vocab;
    return LETHE_OK;
}

/* ---- logprobs of the raw distribution ------------------------------------------ */

/* a ranks before b: larger logit, then smaller id */
static inline int ranks_before(float la, int32_t a, float lb, int32_t b) {
    return la > lb || (la == lb && a < b);
}

void lethe_sampler_logprobs(const float *logits, int32_t n_vocab, int32_t token, int32_t n_top,
                            lethe_sample_result *res) {
    LETHE_ASSERT(token >= 0 && token < n_vocab && n_top <= LETHE_MAX_TOP_LOGPROBS);
    float m = logits[0];
    for (int32_t i = 1; i < n_vocab; i++) m = fmaxf(m, logits[i]);
    double sum = 0;
    for (int32_t i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - m);
    const double lse = m + log(sum);
    res->logprob = (float)(logits[token] - lse);
    res->n_top = n_top > 0 ? LETHE_MIN(n_top, n_vocab) : 0;
    /* insertion into a sorted array of the best n_top (descending rank) */
    int32_t n = 0;
    for (int32_t i = 0; i < n_vocab && res->n_top > 0; i++) {
        float li = logits[i];
        if (n == res->n_top && !ranks_before(li, i, logits[res->top[n - 1].token], res->top[n - 1].token))
            continue;
        int32_t j = n < res->n_top ? n++ : n - 1;
        while (j > 0 && ranks_before(li, i, logits[res->top[j - 1].token], res->top[j - 1].token)) {
            res->top[j] = res->top[j - 1];
            j--;
        }
        res->top[j].token = i;
    }
    for (int32_t j = 0; j < res->n_top; j++)
        res->top[j].logprob = (float)(logits[res->top[j].token] - lse);
}

/* ---- sampling ------------------------------------------------------------------- */

lethe_sample_row lethe_sampler_row(const lethe_sampling_params *p, const lethe_rng *rng) {
    lethe_sample_row r;
    memset(&r, 0, sizeof(r));
    r.temperature = p->temperature;
    r.top_k = p->top_k;
    r.top_p = p->top_p;
    r.min_p = p->min_p;
    r.repetition_penalty = p->repetition_penalty;
    r.presence_penalty = p->presence_penalty;
    r.frequency_penalty = p->frequency_penalty;
    r.seed = rng->seed;
    r.draw = rng->draw;
    return r;
}

int32_t lethe_sampler_penalty_entries(lethe_sampler_ws *ws, const lethe_sampling_params *p,
                                      const int32_t *prompt, int32_t n_prompt,
                                      const int32_t *output, int32_t n_output, int32_t *ids,
                                      int32_t *counts) {
    const bool rep = p->repetition_penalty != 1.0f;
    const bool freq = p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
    if (!rep && !freq) return 0;
    if (++ws->epoch == 0) { /* wrapped: clear stamps */
        memset(ws->mark, 0, (size_t)ws->n_vocab * sizeof(uint32_t));
        ws->epoch = 1;
    }
    int32_t n = 0;
    for (int32_t i = 0; i < n_output; i++) { /* output counts (all zero between calls) */
        LETHE_ASSERT(output[i] >= 0 && output[i] < ws->n_vocab);
        ws->count[output[i]]++;
    }
    for (int32_t pass = rep ? 0 : 1; pass < 2; pass++) {
        const int32_t *t = pass ? output : prompt;
        const int32_t m = pass ? n_output : n_prompt;
        for (int32_t i = 0; i < m; i++) {
            const int32_t id = t[i];
            LETHE_ASSERT(id >= 0 && id < ws->n_vocab);
            if (ws->mark[id] == ws->epoch) continue;
            ws->mark[id] = ws->epoch;
            ids[n] = id;
            counts[n++] = ws->count[id];
        }
    }
    for (int32_t i = 0; i < n_output; i++) ws->count[output[i]] = 0;
    return n;
}

void lethe_sampler_sample(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng,
                          const float *logits, const int32_t *prompt, int32_t n_prompt,
                          const int32_t *output, int32_t n_output, lethe_sample_result *res) {
    lethe_sampler_sample_masked(ws, p, rng, logits, NULL, prompt, n_prompt, output, n_output, res);
}

void lethe_sampler_sample_masked(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng,
                                 const float *logits, const uint32_t *mask, const int32_t *prompt,
                                 int32_t n_prompt, const int32_t *output, int32_t n_output,
                                 lethe_sample_result *res) {
    lethe_sample_row row = lethe_sampler_row(p, rng);
    row.n_pen = lethe_sampler_penalty_entries(ws, p, prompt, n_prompt, output, n_output,
                                              ws->pen_ids, ws->pen_counts);
    res->token = lethe_sample_row_f32(logits, ws->n_vocab, &row, ws->pen_ids, ws->pen_counts, mask,
                                      &ws->row, NULL);
    if (!lethe_sample_is_greedy(&row)) rng->draw++;
    res->logprob = 0.0f;
    res->n_top = 0;
    if (p->logprobs >= 0) lethe_sampler_logprobs(logits, ws->n_vocab, res->token, p->logprobs, res);
}

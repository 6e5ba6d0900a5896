/* sampler.c - penalties, temperature, top-k / top-p / min-p, seeded draws,
 * raw logprobs. The pipeline and its semantics are documented in sampler.h.
 *
 * Cost per call is O(n_vocab) plus O(c log c) for sorting the c candidates
 * when top-k or top-p needs an order: top-p without top-k first keeps only
 * the tokens whose probability relative to the best is >= a threshold (1e-3,
 * then 1e-5, 1e-7, 0 until their mass reaches top_p) so that it sorts a few
 * hundred candidates, not the whole vocabulary. Such a threshold set is
 * always a prefix of the full sorted order, so the result is identical. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

/* ---- RNG: xoshiro256** (Blackman & Vigna), seeded through splitmix64 ---------- */

void lethe_rng_seed(lethe_rng *r, uint64_t seed) {
    uint64_t sm = seed;
    for (int i = 0; i < 4; i++) r->s[i] = lethe_splitmix64(&sm);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t lethe_rng_next(lethe_rng *r) {
    uint64_t *s = r->s;
    const uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double lethe_rng_uniform(lethe_rng *r) { return (double)(lethe_rng_next(r) >> 11) * 0x1.0p-53; }

/* ---- workspace ------------------------------------------------------------------ */

lethe_status lethe_sampler_ws_init(lethe_sampler_ws *ws, int32_t n_vocab) {
    memset(ws, 0, sizeof(*ws));
    if (n_vocab <= 0) return lethe_errorf(LETHE_ERR_INVALID, "sampler: n_vocab %d <= 0", n_vocab);
    size_t n = (size_t)n_vocab;
    ws->n_vocab = n_vocab;
    ws->logits = malloc(n * sizeof(float));
    ws->idx = malloc(n * sizeof(int32_t));
    ws->prob = malloc(n * sizeof(float));
    ws->count = calloc(n, sizeof(int32_t));
    ws->mark = calloc(n, sizeof(uint32_t));
    if (!ws->logits || !ws->idx || !ws->prob || !ws->count || !ws->mark) {
        lethe_sampler_ws_free(ws);
        return lethe_errorf(LETHE_ERR_NOMEM, "sampler: cannot allocate scratch for %d tokens",
                            n_vocab);
    }
    return LETHE_OK;
}

void lethe_sampler_ws_free(lethe_sampler_ws *ws) {
    if (!ws) return;
    free(ws->logits);
    free(ws->idx);
    free(ws->prob);
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

static void apply_penalties(lethe_sampler_ws *ws, const lethe_sampling_params *p,
                            const int32_t *prompt, int32_t n_prompt, const int32_t *output,
                            int32_t n_output) {
    float *l = ws->logits;
    const float r = p->repetition_penalty;
    if (r != 1.0f) {
        if (++ws->epoch == 0) { /* wrapped: clear stamps */
            memset(ws->mark, 0, (size_t)ws->n_vocab * sizeof(uint32_t));
            ws->epoch = 1;
        }
        for (int32_t pass = 0; pass < 2; pass++) {
            const int32_t *ids = pass ? output : prompt;
            int32_t n = pass ? n_output : n_prompt;
            for (int32_t i = 0; i < n; i++) {
                int32_t t = ids[i];
                LETHE_ASSERT(t >= 0 && t < ws->n_vocab);
                if (ws->mark[t] == ws->epoch) continue;
                ws->mark[t] = ws->epoch;
                l[t] = l[t] > 0 ? l[t] / r : l[t] * r;
            }
        }
    }
    if (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f) {
        for (int32_t i = 0; i < n_output; i++) {
            LETHE_ASSERT(output[i] >= 0 && output[i] < ws->n_vocab);
            ws->count[output[i]]++;
        }
        for (int32_t i = 0; i < n_output; i++) {
            int32_t t = output[i], c = ws->count[t];
            if (!c) continue; /* already applied (repeated id) */
            l[t] -= (float)c * p->frequency_penalty + p->presence_penalty;
            ws->count[t] = 0;
        }
    }
}

static int cmp_rank(const void *a, const void *b, void *ctx) {
    const float *l = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    float lx = l[x], ly = l[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : (x > y);
}

static void sort_by_rank(int32_t *idx, int32_t n, const float *logits) {
    qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_rank, (void *)logits);
}

/* The k best ids (by rank) into idx[0..k), sorted. O(V log k) with a heap. */
static int32_t select_top_k(const float *l, int32_t n_vocab, int32_t k, int32_t *idx) {
    /* min-heap on rank: idx[0] is the worst of the kept */
    int32_t n = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (n == k) {
            if (!ranks_before(l[i], i, l[idx[0]], idx[0])) continue;
            idx[0] = i; /* replace the worst, sift down */
            int32_t j = 0;
            for (;;) {
                int32_t c = 2 * j + 1;
                if (c >= n) break;
                if (c + 1 < n && ranks_before(l[idx[c]], idx[c], l[idx[c + 1]], idx[c + 1])) c++;
                if (!ranks_before(l[idx[j]], idx[j], l[idx[c]], idx[c])) break;
                int32_t t = idx[j]; idx[j] = idx[c]; idx[c] = t;
                j = c;
            }
        } else { /* push, sift up */
            int32_t j = n++;
            idx[j] = i;
            while (j > 0) {
                int32_t pa = (j - 1) / 2;
                if (!ranks_before(l[idx[pa]], idx[pa], l[idx[j]], idx[j])) break;
                int32_t t = idx[j]; idx[j] = idx[pa]; idx[pa] = t;
                j = pa;
            }
        }
    }
    sort_by_rank(idx, n, l);
    return n;
}

static int32_t argmax(const float *l, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (l[i] > l[best]) best = i; /* strict: the smallest id wins ties */
    return best;
}

/* Non-greedy: weights w[id] = exp((l - max) / T) (the best has weight 1),
 * candidate ids in ws->idx, then one draw over the survivors' weights. */
static int32_t sample_random(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng) {
    const float *l = ws->logits;
    const int32_t V = ws->n_vocab;
    int32_t *idx = ws->idx;
    float *w = ws->prob;
    const float m = l[argmax(l, V)], inv_t = 1.0f / p->temperature;
    double total = 0;
    for (int32_t i = 0; i < V; i++) total += w[i] = expf((l[i] - m) * inv_t);
    int32_t n;
    if (p->top_k > 0 && p->top_k < V) {
        n = select_top_k(l, V, p->top_k, idx);
        total = 0;
        for (int32_t c = 0; c < n; c++) total += w[idx[c]];
    } else if (p->top_p < 1.0f) {
        /* a threshold prefix of the sorted order whose mass reaches top_p */
        static const float thresholds[] = {1e-3f, 1e-5f, 1e-7f, 0.0f};
        n = 0;
        for (size_t t = 0; t < LETHE_ARRAY_LEN(thresholds); t++) {
            const float th = thresholds[t];
            double mass = 0;
            n = 0;
            for (int32_t i = 0; i < V; i++)
                if (w[i] >= th && w[i] > 0) {
                    idx[n++] = i;
                    mass += w[i];
                }
            if (mass >= p->top_p * total) break;
        }
        sort_by_rank(idx, n, l);
    } else {
        n = V;
        for (int32_t i = 0; i < V; i++) idx[i] = i;
    }
    if (p->top_p < 1.0f) { /* candidates are in rank order here */
        const double target = p->top_p * total;
        double cum = 0;
        int32_t keep = 0;
        while (keep < n && cum < target) cum += w[idx[keep++]];
        n = LETHE_MAX(keep, 1);
    }
    if (p->min_p > 0.0f) { /* p_i / p_max = w_i: the best candidate has weight 1 */
        int32_t k = 0;
        for (int32_t c = 0; c < n; c++)
            if (w[idx[c]] >= p->min_p) idx[k++] = idx[c];
        n = k;
    }
    total = 0;
    for (int32_t c = 0; c < n; c++) total += w[idx[c]];
    const double u = lethe_rng_uniform(rng) * total;
    double cum = 0;
    for (int32_t c = 0; c < n; c++) {
        cum += w[idx[c]];
        if (u < cum) return idx[c];
    }
    return idx[n - 1];
}

void lethe_sampler_sample(lethe_sampler_ws *ws, const lethe_sampling_params *p, lethe_rng *rng,
                          const float *logits, const int32_t *prompt, int32_t n_prompt,
                          const int32_t *output, int32_t n_output, lethe_sample_result *res) {
    const int32_t V = ws->n_vocab;
    memcpy(ws->logits, logits, (size_t)V * sizeof(float));
    apply_penalties(ws, p, prompt, n_prompt, output, n_output);
    if (p->temperature == 0.0f || p->top_k == 1)
        res->token = argmax(ws->logits, V);
    else
        res->token = sample_random(ws, p, rng);
    res->logprob = 0.0f;
    res->n_top = 0;
    if (p->logprobs >= 0) lethe_sampler_logprobs(logits, V, res->token, p->logprobs, res);
}

/* runner.h - what the engine calls to run the model: the forward behind a
 * function pointer.
 *
 * The real runner (runner.c) wraps lethe_model_forward with the KV pool's
 * per-layer buffers. The fake runner (runner_fake.c) is a deterministic
 * stand-in with no backend: it keeps a 64-bit "K/V" per slot and per layer,
 * derives each token's state from the slots attention selects, and produces
 * logits from that state, so scheduler, KV and prefix-cache bugs (a wrong
 * slot, a stale slot, a lost token) change its output exactly like they
 * would change a real model's. lethe_fake_reference() computes the same
 * model directly from a token list (no KV at all) for comparison. */
#ifndef LETHE_RUNNER_H
#define LETHE_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"
#include "kv/kv_pool.h"
#include "model/config.h"
#include "model/forward_uniform.h"
#include "model/model.h"

typedef struct lethe_runner {
    void *ctx;
    const char *kind;               /* "model" or "fake" */
    lethe_model_config cfg;         /* shapes, vocab, max_pos, eos ids */
    lethe_backend *be;              /* NULL for the fake runner */
    /* optional, called before the KV pool is sized (device memory left after
     * weights AND workspace is what the pool may take): forward workspace
     * for n_tokens_max rows, with room for n_logits_max logits rows on the
     * device (for forward(logits = NULL) + sample) */
    lethe_status (*workspace)(void *ctx, int32_t n_tokens_max, int32_t n_logits_max);
    /* called once the pool exists (K/V buffers; the fake allocates its state) */
    lethe_status (*bind)(void *ctx, lethe_kv_pool *pool, int32_t n_tokens_max);
    /* logits: host [b->n_logits, n_vocab], or NULL when the caller samples
     * on the device next (only if `sample` is set) */
    void (*forward)(void *ctx, const lethe_fwd_batch *b, const lethe_fwd_hooks *hooks, float *logits);
    /* optional: the step with one plan for every layer
     * (lethe_model_forward_uniform: arrays staged once, decode steps
     * captured/replayed as CUDA graphs through gs when use_graph). NULL: the
     * engine always calls forward (the fake runner). */
    void (*forward_uniform)(void *ctx, const lethe_fwd_batch *b, const lethe_layer_plan *plan,
                            bool use_graph, lethe_graph_state *gs, float *logits);
    /* optional: forward with per-layer hooks through the graph logic
     * (lethe_model_forward_graph: arrays staged once, decode steps
     * captured/replayed through gs when use_graph). NULL: no graphs for
     * per-layer hooks (the fake runner). */
    void (*forward_graph)(void *ctx, const lethe_fwd_batch *b, const lethe_fwd_hooks *hooks,
                          const int32_t *const *arrays, const size_t *counts, int n_arrays,
                          bool use_graph, lethe_graph_state *gs, float *logits);
    /* optional: the backend sample op (backend/sample.h) over the logits rows
     * of the last forward(logits = NULL); a->logits is filled in by the
     * runner, a->rows[i] is logits row i (padding rows, if any, come after
     * a->n and are never sampled) */
    void (*sample)(void *ctx, lethe_sample_args *a);
    void (*destroy)(void *ctx);
    /* testing (LETHE_FAULT_TOKEN, read by the engine at create): the forward
     * of a step whose batch holds this token id fails after it ran, like a
     * backend error would (lethe_runner_step_status); 0 = never */
    int32_t fault_token;
} lethe_runner;

/* The status of the forward that just ran over batch b: LETHE_OK, or the
 * error it ended with (the message is set, lethe_last_error). The forward
 * ran to its end either way: K/V of b's store slots may be written, nothing
 * else. Backend ops do not fail at run time (a CUDA error aborts: a sticky
 * device error leaves the context unusable), so today the one error is the
 * injected fault_token. */
lethe_status lethe_runner_step_status(const lethe_runner *r, const lethe_fwd_batch *b);

/* Real model (the runner takes ownership of model and backend). */
lethe_status lethe_runner_model(lethe_model *model, lethe_backend *be, lethe_runner *out);
/* The model inside a real runner (NULL for the fake runner): for tools that
 * run their own steps over the engine's KV buffers (lethe bench sparse). */
lethe_model *lethe_runner_model_of(const lethe_runner *r);

typedef struct lethe_fake_params {
    int32_t n_layers;       /* default 2 */
    int32_t n_vocab;        /* default 64 */
    int32_t max_pos;        /* default 4096 */
    int32_t eos;            /* -1 = none */
    uint64_t seed;
    bool check_dense;       /* assert every selection is exactly positions 0..p (dense method) */
} lethe_fake_params;

void lethe_fake_default_params(lethe_fake_params *p);
lethe_status lethe_runner_fake(const lethe_fake_params *p, lethe_runner *out);

/* Greedy continuation of tokens[0..n_prompt) by the fake model with dense
 * attention, computed without KV: writes n_gen tokens into out (stops early
 * at eos unless ignore_eos; returns the count written). */
int32_t lethe_fake_reference(const lethe_fake_params *p, const int32_t *tokens, int32_t n_prompt,
                             int32_t n_gen, bool ignore_eos, int32_t *out);
/* The fake model's next-token logits after tokens[0..n) (dense, no KV). */
void lethe_fake_reference_logits(const lethe_fake_params *p, const int32_t *tokens, int32_t n,
                                 float *logits);
/* The fake model's logits for a state (shared by runner and reference). */
void lethe_fake_logits(const lethe_fake_params *p, uint64_t state, float *logits);

#endif /* LETHE_RUNNER_H */

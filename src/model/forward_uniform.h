/* forward_uniform.h - a forward step whose layers all read the same plan,
 * with the step's index arrays staged once and decode steps replayed as
 * CUDA graphs.
 *
 * Dense attention (and any method whose selection is the same in every
 * layer) gives every layer the same store slots and selection. Then one
 * upload of the step's arrays serves all layers (ops->stage_step), and a
 * decode step (one query per sequence) can be captured once per batch size
 * and replayed: the replay runs every kernel of the step from the staged
 * buffers without host work per layer. Graphs are keyed by the number of
 * sequences; a key is captured on its second step (the first runs eagerly
 * and sizes the backend's workspaces). On the CPU backend (no graphs) this
 * is exactly lethe_model_forward. */
#ifndef LETHE_MODEL_FORWARD_UNIFORM_H
#define LETHE_MODEL_FORWARD_UNIFORM_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"

#define LETHE_GRAPH_MAX_BATCH 256

/* Decode batch sizes that get a CUDA graph in the engine (vLLM's default
 * cudagraph capture sizes): 1, 2, 4, then every multiple of 8 up to
 * LETHE_GRAPH_MAX_BATCH (35 sizes). A decode step of B sequences runs the
 * graph of the smallest bucket >= B, padded with dummy sequences
 * (src/engine/engine_forward.c), so at most 35 graphs exist and a padded
 * step wastes < 8 rows (< 1 when B <= 4). */
#define LETHE_GRAPH_BUCKET_LIST                                                                  \
    1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152,   \
        160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256

/* The smallest bucket >= n, or 0 when that bucket would exceed max_bucket. */
int32_t lethe_graph_bucket(int32_t n, int32_t max_bucket);
/* The largest bucket an engine uses: the smallest bucket >= max_seqs (no
 * larger decode batch can occur), or the largest bucket <= max_rows when
 * that one does not fit the forward workspace (max_rows rows); 0 if none. */
int32_t lethe_graph_max_bucket(int32_t max_seqs, int32_t max_rows);

typedef struct lethe_graph_state {
    uint8_t warm[LETHE_GRAPH_MAX_BATCH + 1]; /* batch size ran eagerly once */
    int64_t n_replays, n_captures, n_eager;  /* counters for reports and tests */
    /* host seconds inside graph_launch / graph_end: the launch and the wait
     * for the device to run the graph (LETHE_STEP_TIMES splits it off the
     * host's own issue time) */
    double t_graph;
} lethe_graph_state;

/* Runs one step with `plan` for every layer (no after_attn hook).
 * use_graph: capture/replay decode-shaped steps (n_tokens == n_seqs ==
 * n_logits, n_seqs <= LETHE_GRAPH_MAX_BATCH) through gs; other steps run
 * eagerly. logits_out as in lethe_model_forward. The caller must keep the
 * plan's and the batch's arrays unchanged during the call. */
void lethe_model_forward_uniform(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                                 void *const *v_cache, const lethe_layer_plan *plan,
                                 bool use_graph, lethe_graph_state *gs, float *logits_out);

/* The same graph logic for any per-layer hooks (a sparse method whose
 * select_layer issues the same backend ops every step, sparse.h graph_step):
 * arrays[0..n_arrays) are every host index array the step's ops get (staged
 * once; the same arrays in the same order every step), and a replay runs
 * the captured kernels without calling the hooks at all. */
void lethe_model_forward_graph(lethe_model *m, const lethe_fwd_batch *b, void *const *k_cache,
                               void *const *v_cache, const lethe_fwd_hooks *hooks,
                               const int32_t *const *arrays, const size_t *counts, int n_arrays,
                               bool use_graph, lethe_graph_state *gs, float *logits_out);

#endif /* LETHE_MODEL_FORWARD_UNIFORM_H */

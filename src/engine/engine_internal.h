/* engine_internal.h - the engine's state, shared by its files:
 *
 *   engine_create.c  lethe_engine_create (backend, model, tokenizer) and the
 *                    tokenizer-facing API (tokenize, chat, detokenize)
 *   engine.c         construction from a runner, requests (validate, add,
 *                    abort), stats, destroy
 *   engine_step.c    one step: schedule -> run (batch, forward, sample,
 *                    commit) -> postprocess (detokenize, stop checks, events)
 *   engine_forward.c how the step's forward runs: the plan_layer hooks routed
 *                    through the sparse method, or one uniform plan (staged
 *                    once; decode steps as CUDA graphs padded to bucket sizes)
 *   engine_sample.c  the tokens: on the backend (ops->sample) or the host
 *   engine_diag.c    LETHE_STEP_TIMES / LETHE_PROFILE_STEP around a step
 *   engine_seldump.c LETHE_DUMP_SELECTIONS: what each decode layer reads
 *   engine_thread.c  threaded mode: start/stop/submit/cancel
 *
 * Ownership: in threaded mode the engine thread owns everything below except
 * `thr.inbox` (its own mutex), `stats.mu`/`stats.snap`, `reqs.next_id`
 * (atomic) and the immutable fields set at create (limits, vocab,
 * tokenizer), which validation reads from any thread. */
#ifndef LETHE_ENGINE_INTERNAL_H
#define LETHE_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "cache/prefix_cache.h"
#include "engine/queue.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "engine/stopstr.h"
#include "kv/kv_pool.h"
#include "lethe.h"
#include "sched/scheduler.h"
#include "sparse/sparse.h"
#include "tokenizer/tokenizer.h"

/* One request: the scheduler's part first, then the engine's. */
typedef struct eng_req {
    lethe_req r;                      /* must stay first */
    lethe_sampling_params sp;         /* sp.stop[] points at stop_copy */
    char *stop_copy[LETHE_MAX_STOP];
    const char *stop_list[LETHE_MAX_STOP + 1]; /* NULL-terminated, for stopstr */
    lethe_event_cb cb;
    void *user;
    int32_t *forced;
    int32_t n_forced;
    bool want_logits;
    int32_t max_total;                /* finish LENGTH when n_tokens reaches this */
    lethe_rng rng;
    lethe_detok detok;
    lethe_stopstr stop;
    double t_submit, ttft;
    bool has_ttft;
    struct eng_req *hnext;            /* id table chain */
    struct lethe_gmatcher *gm;        /* structured output: the request's grammar state, or NULL */
    lethe_retention_range
        *prunable; /* retention hints: pruned after the request (engine_prune.c) */
    int32_t n_prunable;
} eng_req;

/* Live requests by id (engine.c): chained hash table, power-of-two buckets. */
typedef struct eng_reqs {
    eng_req **buckets;
    uint64_t n_buckets;
    int32_t n_live;
    atomic_uint_fast64_t next_id;     /* any thread (submit) */
} eng_reqs;

/* One step's batch (host): the scheduler's items as forward rows and the
 * method's view of them, plus the host logits rows and the text scratch. */
typedef struct eng_step_state {
    int64_t index;                    /* steps run so far (lethe_sparse_step.index) */
    int32_t cap_rows, cap_seqs;       /* capacity of the arrays below (eng_ensure_caps) */
    int32_t *tokens, *pos, *logit_rows; /* [cap_rows] */
    int32_t *seq_begin;               /* [cap_seqs + 1] */
    int32_t *state_slots;             /* [cap_seqs] hybrid models: each sequence's state slot */
    lethe_sparse_seq *seqs;           /* [cap_seqs] */
    eng_req **seq_req;                /* [cap_seqs] */
    lethe_fwd_batch batch;            /* points into the arrays above */
    lethe_sparse_step st;             /* the method's view: seqs, batch */
    float *logits;                    /* [cap_logits, n_vocab] */
    int32_t cap_logits;
    size_t detok_cap;                 /* text buffer for one token */
    char *detok_buf;
} eng_step_state;

/* What attention reads and where new K/V go (plan_layer, engine_forward.c). */
typedef struct eng_plan {
    int32_t *store;                   /* [cap_rows] store slots of the current layer */
    int32_t *sel, *sel_begin;         /* selection of the current layer: [cap_sel], [cap_seqs + 1] */
    int64_t cap_sel;
    bool layer_scores;                /* the method's needs_scores for the current layer */
    /* the step's full rows for a method with select_layer (engine_forward.c):
     * built and staged once per step, the same in every layer */
    int32_t *rows, *rows_begin;       /* [cap_rows], [cap_seqs + 1] */
    int64_t cap_rows;
    bool rows_staged;                 /* this step's forward asks select_layer */
    bool graph;                       /* ... through graph_sel_forward (the method's graph_step plan) */
    /* per-KV-head selections of the current layer (head masks, engine_forward.c) */
    int32_t *hsel, *hsel_begin;       /* [cap_hsel], [cap_hsel_begin] */
    /* a per-layer-rows method's graph step (engine_forward.c graph_rows_forward):
     * every layer's store slots [n_layers][bucket], selection starts
     * [n_layers][bucket + 1] (offsets into lslots), and all selections */
    int32_t *lstore, *lbegin, *lslots;
    int64_t cap_lstore, cap_lbegin, cap_lslots;
    int32_t lbucket;                  /* the bucket they were built for */
    lethe_layer_plan uplan;           /* the uniform plan of a quantized-KV method's step */
    int64_t cap_hsel, cap_hsel_begin;
} eng_plan;

/* How the forward runs (engine_forward.c), chosen at create. */
typedef struct eng_fwd {
    bool uniform;                     /* one plan per step (LETHE_SPARSE_UNIFORM + runner support) */
    bool graph_sel;                   /* a select_layer method with graph_step (engine_forward.c) */
    bool graph_rows;                  /* a per-layer-rows method with graph_step */
    bool warned_decline;              /* the method declined a decode step's graph (logged once) */
    bool use_graphs;                  /* uniform or graph_sel, a backend with graphs, not enforce_eager */
    int32_t max_bucket;               /* decode batches <= this are padded to a bucket; 0 = never */
    int32_t scratch_slot;             /* KV slot of padding sequences (pool-reserved), -1 = none */
    lethe_graph_state *gs;
} eng_fwd;

/* Sampling on the backend (engine_sample.c): per logits row params, results,
 * penalty entries; used when no row of a step needs host logits. */
typedef struct eng_dsample {
    bool enabled;
    lethe_sample_row *rows;           /* [cap_logits] */
    int32_t *tokens;                  /* [cap_logits] */
    float *logprobs;                  /* [cap_logits] */
    int32_t *pen_ids, *pen_counts;    /* [cap_pen] */
    int64_t cap_pen;
    int64_t n_steps;                  /* steps sampled on the backend (tests) */
} eng_dsample;

/* Diagnostics. LETHE_STEP_TIMES=1: host seconds of pure decode steps,
 * logged when the engine is destroyed: whole step, the forward call (the
 * host issuing work; the device runs behind it), plan_layer inside it, and
 * the sampling call (which waits for the device). LETHE_PROFILE_STEP=N: the
 * device profiler's range around the N-th pure decode step. */
typedef struct eng_diag {
    bool step_times;
    int64_t profile_step;             /* 0: off */
    int64_t n_decode_steps;           /* pure decode steps run so far */
    bool profiled;                    /* the current step is inside the profiler's range */
    bool timed;                       /* the current step is timed */
    double t0, t1;                    /* the current step's begin and forward_done */
    int64_t n_timed;
    double t_step, t_fwd, t_plan, t_sample; /* sums over the timed steps */
    double t_step_max;                      /* the slowest timed step (a compaction, a capture) */
    double t_graph, t_graph0;         /* graph launch + wait inside t_fwd; gs->t_graph at begin */
    int64_t n_graph_steps, graphs0;   /* timed steps that replayed / captured a graph */
    FILE *seldump;                    /* LETHE_DUMP_SELECTIONS (engine_seldump.c), NULL: off */
} eng_diag;

/* Structured output (engine_grammar.c): the vocabulary's grammar compiler,
 * built on first use by whichever thread compiles first (under mu), and the
 * step's token masks (engine thread). */
typedef struct eng_grammar {
    pthread_mutex_t mu;
    struct lethe_gcompiler *compiler;
    uint32_t *mask;                   /* [cap_rows, words] allowed-token bits of the step's rows */
    int32_t cap_rows, words;
} eng_grammar;

/* Counters (engine thread) and the snapshot other threads read. */
typedef struct eng_stats {
    lethe_engine_stats cur;
    lethe_engine_sparse_stats sparse; /* selected / resident counted in engine_forward.c */
    pthread_mutex_t mu;
    lethe_engine_stats snap;          /* under mu */
    lethe_engine_sparse_stats sparse_snap;
    lethe_kv_space_use *spaces;       /* [n_spaces] */
    int32_t n_spaces;
} eng_stats;

/* Threaded mode (engine_thread.c). The inbox is used in both modes: queued
 * submissions and cancels (a cancel from a callback). */
typedef struct eng_thread {
    lethe_queue inbox;                /* its own mutex */
    pthread_t thread;
    bool running;
    atomic_bool stop;
} eng_thread;

struct lethe_engine {
    /* set at create, immutable */
    lethe_engine_params p;            /* strings below are owned copies */
    char *model_path, *model_name, *sparse_method, *sparse_config, *load_format, *device;
    int32_t max_model_len, n_vocab;
    int32_t kivi_res_blocks;          /* KIVI residual blocks (engine.c size_pool), else 0 */
    int32_t n_state_slots;            /* hybrid models: per-request state slots (engine_hybrid.c),
                                       * the radix cache's snapshots included */
    bool cache_states;                /* hybrid + prefix caching: the cache keeps states */
    int32_t snap_every;               /* hybrid + prefix caching: tokens between the radix cache's
                                       * state snapshots, else 0 */
    int32_t n_snap_slots;             /* of n_state_slots, the prefix cache's: radix snapshots or
                                       * idle chains' states (engine.c size_pool) */
    lethe_kv_layout *kv_layouts;      /* [n_layers] the method's payload layout, or NULL */
    size_t kv_reserve;                /* the method's fixed reserve (kv_reserve_bytes, engine.c size_pool) */

    /* the parts */
    lethe_runner runner;
    lethe_tokenizer *tok;             /* NULL: token ids only (dummy models, fake runner) */
    lethe_kv_pool *pool;
    lethe_sparse_method *method;
    lethe_sched *sched;
    lethe_sampler_ws sws;
    lethe_prefix_cache *pcache;       /* radix or chain (src/cache chooses); NULL: prefix caching off */
    struct lethe_host_tier *host_tier; /* --host-cache-bytes (src/cache/host_tier.c), NULL: none */
    double host_copy_bps; /* with a host tier: one large host -> KV memory copy, bytes/s (probe) */

    eng_reqs reqs;
    eng_step_state step;
    eng_plan plan;
    eng_fwd fwd;
    eng_dsample ds;
    eng_diag diag;
    eng_grammar gram;
    eng_stats stats;
    eng_thread thr;
};

/* Builds an engine around a runner and an optional tokenizer, both taken
 * over (also on failure): the engine destroys the runner, then the KV pool,
 * then runner->be (the backend), then the tokenizer. p->model is only used
 * as a name and in the prefix-cache fingerprint. */
int lethe_engine_create_with(const lethe_engine_params *p, lethe_runner *runner,
                             lethe_tokenizer *tok, lethe_engine **out);

/* engine.c */
lethe_status eng_validate(const lethe_engine *e, const lethe_request_params *p);
eng_req *eng_req_new(lethe_engine *e, const lethe_request_params *p);
void eng_req_free(eng_req *q);
void eng_admit(lethe_engine *e, eng_req *q); /* into the table and the scheduler */
eng_req *eng_find(lethe_engine *e, uint64_t id);
void eng_finish(lethe_engine *e, eng_req *q, lethe_finish_reason why, const char *error);
/* ERROR because the engine failed (a failed model step), not the request: the event has
 * error_internal (HTTP 500) */
void eng_fail_internal(lethe_engine *e, eng_req *q, const char *error);
void eng_retire(lethe_engine *e, eng_req *q, bool ok); /* ok: finished normally (the cache may keep its KV) */
void eng_publish_stats(lethe_engine *e);
lethe_status eng_check(lethe_engine *e);
void eng_apply_inbox(lethe_engine *e);
/* Calls on the engine thread (prefix-cache control, pruning): run now when
 * no engine thread runs, else queued and run at the start of the next step,
 * before anything is scheduled (no request is inside a forward then).
 * eng_call_wait returns once fn has run. */
typedef void (*eng_call_fn)(lethe_engine *e, void *arg);
void eng_post_call(lethe_engine *e, eng_call_fn fn, void *arg);
void eng_call_wait(lethe_engine *e, eng_call_fn fn, void *arg);
void eng_run_calls(lethe_engine *e);
/* queued even in synchronous mode: runs at the start of the next step */
void eng_post_call_later(lethe_engine *e, eng_call_fn fn, void *arg);
/* engine_prune.c: the finished request's prunable retention hints as a prune job */
void eng_prune_hints(lethe_engine *e, const eng_req *q);

/* engine_grammar.c */
void eng_grammar_destroy(lethe_engine *e);
/* q's mask for its next token into the step's mask row k (0-based); grows the buffer */
const uint32_t *eng_grammar_mask(lethe_engine *e, eng_req *q, int32_t k);

/* engine_chain.c */
lethe_status eng_cache_init(lethe_engine *e); /* at create, once the pool exists: e->pcache (mode choice in src/cache) */

/* engine_step.c */
int eng_step(lethe_engine *e);
void eng_ensure_caps(lethe_engine *e, int32_t n_rows, int32_t n_seqs); /* step scratch capacity */

/* engine_forward.c */
void eng_forward_init(lethe_engine *e);   /* at create, after the method, before the pool */
void eng_forward_bind(lethe_engine *e);   /* at create, once the pool exists */
/* runs e->step.batch through the runner: plan_layer hooks per layer, or the
 * uniform plan; logits: e->step.logits, or NULL to leave them on the device.
 * Returns the runner's step status (lethe_runner_step_status): not OK = the
 * step failed, its logits and new K/V are garbage. */
lethe_status eng_forward(lethe_engine *e, float *logits);
/* lethe_sparse_env.aux_prefill (ctx = the engine): sparse.h lethe_sparse_aux_prefill */
lethe_status eng_aux_prefill(void *ctx, const lethe_sparse_seq *s, const int32_t *tokens, int32_t n);

/* engine_sample.c */
lethe_status eng_sample_init(lethe_engine *e); /* at create: LETHE_SAMPLE_ON_HOST, runner->sample */
void eng_sample_free(lethe_engine *e);
/* no row of the step needs host logits */
bool eng_sample_on_device(const lethe_engine *e, const lethe_sched_out *out);
/* every logits row's token (and logprob) into e->ds, by runner->sample */
void eng_sample_device(lethe_engine *e, const lethe_sched_out *out);
/* request q's token for logits row k (host row, or NULL: the backend's
 * e->ds result): the forced token, or the sampled one */
void eng_sample_token(lethe_engine *e, eng_req *q, const float *logits, int32_t k,
                      lethe_sample_result *res);

/* engine_diag.c: hooks around a step's run (no-ops unless asked for) */
lethe_status eng_diag_init(lethe_engine *e); /* at create: LETHE_STEP_TIMES, LETHE_PROFILE_STEP */
void eng_diag_step_begin(lethe_engine *e, bool pure_decode); /* before the forward */
void eng_diag_forward_done(lethe_engine *e);                 /* after the forward call */
void eng_diag_step_end(lethe_engine *e);                     /* after sampling and finish_step */
void eng_diag_report(const lethe_engine *e);                 /* at destroy: the log line */
/* engine_seldump.c: LETHE_DUMP_SELECTIONS (off unless set) */
lethe_status eng_seldump_init(lethe_engine *e);              /* at create: opens the file */
void eng_seldump_layer(lethe_engine *e, int32_t layer, const lethe_layer_plan *plan);
void eng_seldump_close(lethe_engine *e);                     /* at destroy */

/* engine_hybrid.c: checks for hybrid (linear-attention) models; the state bytes of
 * n_state_slots requests (engine.c) */
lethe_status eng_check_hybrid(lethe_engine *e);
size_t eng_state_bytes(const lethe_engine *e, int32_t n_state_slots);

#endif /* LETHE_ENGINE_INTERNAL_H */

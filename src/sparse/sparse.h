/* sparse.h - the sparse-method contract: how a method changes what attention
 * reads (logical selection) and what KV stays resident (physical eviction)
 * without the engine, the scheduler or the model naming it.
 *
 * A method is a lethe_sparse_ops table (one static const per method in its
 * own file, listed by one line in registry.c) plus per-engine private state.
 * The engine drives it; the scheduler only asks it capacity questions (peak
 * slots per layer). Every hook is optional with a documented default (at the
 * field); the registry checks each table's rules (validate.c) on first use.
 *
 * Call order for one engine step (a step may mix prefill chunks and decode
 * tokens; each sequence says which it is):
 *
 *   prepare(step)                                   once, before the forward
 *   for each layer l:                               inside the model forward
 *       needs_scores(l)                             will after_attn score queries?
 *       select_layer(l, q, rows)                    if the method has it: every
 *                                                   sequence's selection at once,
 *                                                   on the backend; or else / if it
 *                                                   answers PER_SEQ:
 *       for each sequence s of the step:
 *           build_prefill_selection(l, s)           if s.is_prefill
 *           build_decode_selection(l, s, q)         otherwise (may read q)
 *       -- the model stores the new K/V and runs attention over the selections --
 *       after_attn(l, attn)                         attn (what attention read) only if
 *                                                   needs_scores(l): the method may
 *                                                   score with lethe_sparse_scores
 *       layer_end(l)                                end of the layer's attention
 *   finish_step(step)                               after the forward, before
 *                                                   tokens are published: the ONLY
 *                                                   place physical eviction
 *                                                   (lethe_kv_keep) may happen
 *
 * Per request: request_init when the request is admitted (again after a
 * preemption: recompute rebuilds the state from scratch, is_recompute tells),
 * request_finished when it ends, is preempted or aborted. snapshot/restore
 * serialise per-request state (for prefix chains that resume a conversation).
 *
 * Selection convention (backend.h lethe_attn_args): a sequence's selection is
 * a list of slot ids of its row in this layer's slot space, ascending by
 * logical position, whose LAST n_new entries are the sequence's new tokens
 * (the engine appended them to the row before the forward). Every resident
 * slot is readable; the new tokens must always be selected.
 *
 * Flags decide the row layout: a method that evicts per layer sets
 * LETHE_SPARSE_PER_LAYER_ROWS (each layer its own slot space and row); one
 * whose per-token KV does not depend on history sets LETHE_SPARSE_PREFIX_CACHE
 * (shared prefixes may be reused through the radix cache). */
#ifndef LETHE_SPARSE_H
#define LETHE_SPARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/status.h"
#include "kv/kv_pool.h"
#include "model/model.h"

/* ---- knobs ---- */

#define LETHE_SPARSE_SINK_DEFAULT 64
#define LETHE_SPARSE_RECENT_DEFAULT 512
#define LETHE_SPARSE_DECODE_KEEP_DEFAULT 4096

/* Budget knobs shared by every method; token counts, never ratios. What they
 * mean depends on the method (`lethe methods` lists it). */
typedef struct lethe_sparse_knobs {
    int32_t sink_keep_tokens;   /* first tokens always kept (attention sinks), 64 */
    int32_t recent_keep_tokens; /* most recent tokens always kept, 512 */
    int32_t decode_keep_tokens; /* middle tokens kept / selected at decode, 4096 */
} lethe_sparse_knobs;

void lethe_sparse_knobs_default(lethe_sparse_knobs *k);

/* ---- what the method sees of a step ---- */

typedef struct lethe_sparse_seq {
    uint64_t request_id;
    void *state;               /* per-request state from request_init (or NULL) */
    int32_t row;               /* KV row id */
    int32_t q_row;             /* first batch row of this sequence's new tokens */
    int32_t n_new;             /* new tokens this step (rows q_row .. q_row + n_new) */
    int32_t first_pos;         /* logical position of the first new token */
    int32_t n_prompt;          /* tokens to prefill before decoding (prompt, or prompt +
                                * generated tokens when recomputing after preemption) */
    bool is_prefill;           /* the new tokens are prompt tokens */
    bool is_final_chunk;       /* this chunk completes the prompt: logits follow */
    bool is_recompute;         /* re-prefill after a preemption */
    /* an auxiliary prefill's tokens (lethe_sparse_aux_prefill): no logits, and
     * they leave the row when the call returns; never seen by prepare /
     * finish_step (is_prefill is true, is_final_chunk false) */
    bool is_aux;
    /* the request's token ids by logical position [0, n_tokens) (prompt, then
     * generated); valid during the hook call only */
    const int32_t *tokens;
    int32_t n_tokens;
} lethe_sparse_seq;

typedef struct lethe_sparse_step {
    int64_t index;             /* engine step counter */
    int32_t n_seqs;
    const lethe_sparse_seq *seqs;
    const lethe_fwd_batch *batch; /* tokens, positions, rows of each sequence */
} lethe_sparse_step;

/* Engine facilities a method may use. pool is NULL during init / set_knob /
 * configure (the engine sizes the pool after asking the method's flags and
 * max_resident) and set before any request or step hook runs. */
typedef struct lethe_sparse_env {
    lethe_kv_pool *pool;       /* rows, slots, lethe_kv_keep, page metadata */
    lethe_backend *be;         /* to read q / K with act_to_host; NULL with the fake model */
    int32_t n_layers, n_heads, n_kv_heads, head_dim;
    int32_t max_model_len;
    int32_t dim;                        /* model width (0 in tests without a model) */
    const lethe_rope_config *rope;      /* the model's RoPE; NULL = no rotation (tests) */
    const struct lethe_model *model;    /* the loaded model (weights), NULL without one */
    /* the model's tokenizer (to encode a method's fixed text, e.g. KVzip's
     * repeat instruction); NULL with token-id-only models */
    const struct lethe_tokenizer *tok;
    /* Auxiliary prefill, provided by the engine (NULL where none runs, e.g. the
     * contract test harness): lethe_sparse_aux_prefill below. max_aux_tokens:
     * the most tokens one auxiliary forward holds (max_num_batched_tokens);
     * longer runs are split into several forwards. */
    lethe_status (*aux_prefill)(void *ctx, const lethe_sparse_seq *s, const int32_t *tokens, int32_t n);
    void *aux_ctx;
    int32_t max_aux_tokens;
} lethe_sparse_env;

typedef struct lethe_sparse_ops lethe_sparse_ops;

/* select_layer (below): the step's full rows, and what the method returns */
typedef struct lethe_step_rows {
    const int32_t *begin;      /* host [n_seqs + 1] */
    const int32_t *slots;      /* host [begin[n_seqs]], staged: sequence s's row is
                                * slots[begin[s] .. begin[s+1]) (the new tokens last) */
} lethe_step_rows;
/* graph_step (below): the per-step host arrays a method's select_layer reads */
#define LETHE_GRAPH_MAX_ARRAYS 12
typedef struct lethe_graph_arrays {
    int32_t n;
    const int32_t *arrays[LETHE_GRAPH_MAX_ARRAYS];
    size_t counts[LETHE_GRAPH_MAX_ARRAYS];
    int64_t selected;
} lethe_graph_arrays;
typedef enum lethe_sel_result {
    LETHE_SEL_PER_SEQ = 0,
    LETHE_SEL_FULL,
    LETHE_SEL_BUILT,
    LETHE_SEL_BUILT_HEADS,
} lethe_sel_result;

/* What a method does to the KV (for `lethe methods` and capacity reasoning). */
typedef enum lethe_sparse_kind {
    LETHE_SPARSE_KIND_DENSE = 0,
    LETHE_SPARSE_KIND_EVICTION,      /* physical: frees slots (lethe_kv_keep in finish_step) */
    LETHE_SPARSE_KIND_SELECTION,     /* logical: reads a subset, never frees a slot (but see
                                      * LETHE_SPARSE_OFFLOADS: KV moved off the device) */
    LETHE_SPARSE_KIND_QUANTIZATION,  /* changes what a slot stores: a storage format (kv_format) */
    LETHE_SPARSE_KIND_COMPRESSION,   /* a payload of its own (kv_layout: latents, codes) and the
                                      * path that writes and reads it (kv_store / kv_attend) */
} lethe_sparse_kind;
const char *lethe_sparse_kind_name(lethe_sparse_kind k);

/* A method-specific knob with its type, default, bounds and help (one
 * spelling everywhere: --sparse-config, API, `lethe methods`). */
typedef enum lethe_knob_type { LETHE_KNOB_INT, LETHE_KNOB_FLOAT, LETHE_KNOB_BOOL, LETHE_KNOB_STR } lethe_knob_type;
typedef struct lethe_sparse_knob {
    const char *name;
    lethe_knob_type type;
    const char *def;           /* default as text: "32", "0.5", "true", "auto" */
    double min, max;           /* numeric bounds, inclusive */
    const char *help;
} lethe_sparse_knob;

#define LETHE_SPARSE_MAX_KNOBS 16
/* Values of a method's knob table (kept in the method's priv). */
typedef struct lethe_knob_values {
    double num[LETHE_SPARSE_MAX_KNOBS];    /* INT / FLOAT / BOOL (0/1) */
    char str[LETHE_SPARSE_MAX_KNOBS][512]; /* STR values (and the text of every value; paths) */
} lethe_knob_values;

/* bits of lethe_sparse_ops.shared_knobs: which shared knobs a method reads */
enum { LETHE_USES_SINK = 1u << 0, LETHE_USES_RECENT = 1u << 1, LETHE_USES_KEEP = 1u << 2 };

typedef struct lethe_sparse_method {
    const lethe_sparse_ops *ops;
    lethe_sparse_env env;
    lethe_sparse_knobs knobs;
    void *priv;                /* method-private engine-wide state */
    lethe_kv_path path;        /* the payload path over the kv_* hooks (lethe_sparse_kv_path) */
} lethe_sparse_method;

enum {
    LETHE_SPARSE_PER_LAYER_ROWS = 1u << 0, /* a slot space and row per layer (per-layer eviction) */
    LETHE_SPARSE_PREFIX_CACHE = 1u << 1,   /* radix prefix reuse is valid for this method */
    LETHE_SPARSE_PAGE_META = 1u << 2,      /* wants per-page metadata (page_meta_floats) */
    /* kv_store receives keys BEFORE RoPE (kv_attend rotates what it
     * reconstructs, at the slots' positions); only with kv_layout */
    LETHE_SPARSE_KV_PRE_ROPE = 1u << 4,
    /* Uniform: every layer gets the same selection (shared rows), built
     * without the query, no scores, no after_attn / layer_end (registry
     * checks). The engine then builds the plan once per step (layer 0, q =
     * NULL) and runs the step as one plan: index arrays staged once, pure
     * decode steps replayed as CUDA graphs padded to bucket sizes
     * (engine_forward.c). Dense and fp8_kv (per-token FP8 codes: each layer
     * reads its own codes and scales, no host plan) qualify; kivi's store
     * and attention read a host plan, quest / omnikv select per layer. */
    LETHE_SPARSE_UNIFORM = 1u << 3,
    /* Per-(layer, KV head) row lengths: the pool keeps a KV-head mask per row
     * entry (kv_pool.h head masks), the method narrows them with
     * lethe_kv_keep_heads (finish_step), and the engine hands attention
     * per-KV-head selections (each head reads the entries of the sequence's
     * selection that it keeps; lethe_attn_args.head_sel_*). Needs
     * PER_LAYER_ROWS and native KV (registry checks). */
    LETHE_SPARSE_HEAD_ROWS = 1u << 5,
    /* The method multiplies with model weights as activations at set-up (palu
     * absorbs its value factors into W_o), so the CPU backend loads the
     * weights dequantized to f32 (--cpu-weights fp32) for it. */
    LETHE_SPARSE_F32_WEIGHTS = 1u << 7,
    /* A prefill-axis method: it only narrows what prompt chunks read (a
     * SELECTION method: select_layer or block_sparse), keeps no per-request
     * state, never changes the KV and leaves decode dense, so it pairs with
     * any decode method as --sparse-method PREFILL+DECODE (combined.c;
     * registry checks). */
    LETHE_SPARSE_PREFILL_AXIS = 1u << 8,
    /* Offloads KV out of the pool while still attending to it (RetroInfer's
     * host tier): a shared-rows SELECTION or COMPRESSION method with its own
     * attention (kv_layout / kv_attend) may drop row entries in finish_step
     * with lethe_kv_keep (like eviction: their slots are freed) once it holds
     * their K / V elsewhere (host memory) and reads them through kv_attend.
     * The row then holds fewer entries than the request's tokens (the
     * engine's row check allows it), every layer the same ones; selections
     * still list only resident slots. Not with PREFIX_CACHE, PER_LAYER_ROWS
     * or UNIFORM (registry checks). */
    LETHE_SPARSE_OFFLOADS = 1u << 9,
};

/* Configurations the method-generic test suites run every registered method
 * with (tests/test_sparse_conformance.c through the engine on the tiny Llama,
 * tests/test_sparse_methods.c through this contract on synthetic q/k/v), so a
 * new method needs no test edit. Their contexts are 30 .. 130 tokens in 2 or 4
 * layers (head_dim 16 / 32), prefill chunks 16 .. 40 tokens. */
typedef struct lethe_sparse_test_configs {
    /* --sparse-config with budgets >= every test context: attention reads
     * what dense reads, so outputs are bit-identical to dense (close to it
     * when the method's kv_format stores lossy codes). NULL = the defaults. */
    const char *identity;
    /* bound on the relative error of the identity run vs dense when the
     * storage is lossy (outputs of the methods suite, logits of the
     * conformance suite); 0 = 0.05. TurboQuant's 4-bit codes have an MSE of
     * ~0.9% per unit vector, ~10% relative error per vector. */
    double lossy_rel_err;
    /* the identity config still builds selections with select_layer (every
     * page / token selected), so the identity run also proves that path */
    bool identity_on_backend;
    /* budgets far below the test contexts: an EVICTION method ends with
     * fewer resident slots than dense, a SELECTION method reads subsets
     * (built by select_layer when it has one). Required for those two kinds
     * (registry check); NULL for the others. */
    const char *small;
} lethe_sparse_test_configs;

/* The method table. Only name and summary are required; every other field
 * may stay zero / NULL and then has the default written next to it (the
 * lethe_sparse_* wrappers below apply the defaults, so the engine and the
 * scheduler never test a hook for NULL themselves). lethe_sparse_validate
 * lists the rules a table must follow; the registry checks them on first use. */
struct lethe_sparse_ops {
    /* ---- identity and knobs ---- */
    const char *name;          /* required: canonical name, [a-z0-9_], e.g. "dense" */
    const char *aliases[4];    /* other accepted spellings, NULL-terminated; default none */
    const char *summary;       /* required: one line for `lethe methods` */
    lethe_sparse_kind kind;    /* default LETHE_SPARSE_KIND_DENSE */
    unsigned flags;            /* LETHE_SPARSE_*; default 0: shared rows, no radix prefix reuse */
    unsigned shared_knobs;     /* LETHE_USES_*: shared knobs the method reads; default none */
    const lethe_sparse_knob *knob_table; /* method knobs (values reach set_knob); default none */
    int32_t n_knob_table;
    lethe_sparse_test_configs test_configs; /* what the generic test suites run (above) */
    /* hybrid models (linear-attention layers with per-request states): why
     * the method cannot run on them, one clause for the refusal and `lethe
     * methods`; default NULL: it runs on their full-attention layers. A method
     * with kv_out_proj must declare it (validate.c) */
    const char *hybrid_refusal;

    /* ---- capacity questions: asked before the pool exists (env.pool NULL) ---- */
    /* admission bound: most slots one layer of the request may hold at once
     * (prompt n_prompt, n_total tokens in all, prefill chunks <= chunk);
     * default n_total (nothing is ever freed) */
    int32_t (*max_resident)(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                            int32_t n_total, int32_t chunk);
    /* prefill policy: the final prompt chunk must hold at least this many
     * tokens (SnapKV's observation window lies in it); default 0 */
    int32_t (*min_final_chunk)(const lethe_sparse_method *m);
    /* peak new slots per layer (in every slot space) a prefill chunk of
     * n_chunk tokens needs, counted before finish_step evicts anything;
     * default n_chunk (a decode token always needs 1) */
    int32_t (*prefill_peak_slots)(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                                  int32_t n_resident, int32_t n_chunk);
    /* the KV storage format the pool must use (after configure, so it may
     * depend on knobs); default LETHE_KV_NATIVE. The engine sizes the pool by
     * that format's real bytes per token (lethe_kv_token_bytes). */
    lethe_kv_format (*kv_format)(const lethe_sparse_method *m);
    /* backend bytes the method allocates per KV slot (all layers together)
     * besides K and V (Quest: its page bounds); the engine adds them to the
     * per-token cost when it sizes the pool. Default 0. */
    size_t (*slot_overhead_bytes)(const lethe_sparse_method *m);
    /* backend bytes the method needs besides its per-slot cost, for the
     * running requests (DeltaKV: the raw KV of every request's sink and
     * buffer and of one step's new tokens), given the scheduler's bounds;
     * asked once, when the engine sizes the pool, which takes them off the
     * KV budget before dividing it into slots. Default 0. */
    size_t (*kv_reserve_bytes)(lethe_sparse_method *m, int32_t max_num_seqs, int32_t max_num_batched_tokens);
    /* A payload of the method's own (COMPRESSION methods; backend.h
     * lethe_kv_layout): fill layer `layer`'s planes (bytes per slot) and
     * return true, or return false to keep the backend's K / V (no backend,
     * a passthrough config: then for every layer). Asked after configure,
     * before the pool exists; the pool is sized by these bytes. With a
     * layout the model writes and reads the layer only through the three
     * hooks below (model.h lethe_kv_path): kv_store gets the new tokens'
     * k / v [n, n_kv_heads * head_dim] activations (pre-RoPE k with
     * LETHE_SPARSE_KV_PRE_ROPE), their slots and positions; kv_attend gets
     * the attention's arguments (k_cache / v_cache = planes 0 / 1) and writes
     * a->out; kv_out_proj (optional) returns the output projection weight
     * [dim, n_heads * head_dim] to use instead of the layer's wo (values
     * absorbed into it), NULL = wo. Default: no layout. */
    bool (*kv_layout)(const lethe_sparse_method *m, int32_t layer, lethe_kv_layout *out);
    void (*kv_store)(lethe_sparse_method *m, int32_t layer, const void *k, const void *v,
                     const int32_t *slots, const int32_t *pos, int32_t n);
    void (*kv_attend)(lethe_sparse_method *m, int32_t layer, const lethe_attn_args *a);
    const void *(*kv_out_proj)(lethe_sparse_method *m, int32_t layer);
    /* floats of pool page metadata per 16-entry page (kv_pool.h), > 0 exactly
     * when flags has LETHE_SPARSE_PAGE_META; default 0 */
    int32_t page_meta_floats;
    /* Block-sparse prefill attention (backend.h lethe_block_sparse) for
     * layer `layer` of step st (its sequences are the attention call's, in
     * order: prompt_end may follow them), or NULL = dense: the engine hands
     * it to the layer's attention in every step (auxiliary prefills
     * included), and the backend applies it to the sequences whose chunk
     * holds at least min_q new tokens (decode rows attend densely). Only the
     * attention's reads change, never the KV. Default none (dense). */
    const lethe_block_sparse *(*block_sparse)(const lethe_sparse_method *m, int32_t layer,
                                              const lethe_sparse_step *st);

    /* ---- engine lifetime (pool NULL in all four) ---- */
    lethe_status (*init)(lethe_sparse_method *m);        /* allocate m->priv; default none */
    /* after init and the knob parse: cross-knob checks, derived budgets; default none */
    lethe_status (*configure)(lethe_sparse_method *m);
    void (*destroy)(lethe_sparse_method *m);             /* free m->priv; required with init */
    /* one method knob (a knob_table name) = value; required with knob_table */
    lethe_status (*set_knob)(lethe_sparse_method *m, const char *key, const char *value);

    /* ---- per request ---- */
    /* *state = per-request state (lethe_sparse_seq.state); default none (NULL) */
    lethe_status (*request_init)(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state);
    void (*request_finished)(lethe_sparse_method *m, void *state); /* required with request_init */

    /* ---- per step ---- */
    void (*prepare)(lethe_sparse_method *m, const lethe_sparse_step *st);     /* default none */
    /* after the forward, before tokens are published: the ONLY place physical
     * eviction (lethe_kv_keep) may happen; required for EVICTION, default none */
    void (*finish_step)(lethe_sparse_method *m, const lethe_sparse_step *st);

    /* ---- per layer (inside the model forward) ---- */
    /* will after_attn score this layer's queries? default false */
    bool (*needs_scores)(lethe_sparse_method *m, int32_t layer);
    /* shared rows only (not PER_LAYER_ROWS, not UNIFORM): the selections of
     * EVERY sequence of the step for `layer` at once, built on the backend, so
     * a decode step needs no host sync and no per-layer upload of slot lists.
     * When present the engine calls it instead of the per-sequence builders
     * (and before the layer's K/V store, like them). rows: the engine's
     * full-row selections of the step (each sequence's whole row, ascending;
     * host arrays already staged on the backend, the same in every layer).
     * Returns LETHE_SEL_FULL (attention reads `rows`), LETHE_SEL_BUILT
     * (*sel_begin: host [n_seqs + 1]; *sel_slots: backend int32 memory, e.g.
     * written by ops->select_expand; both owned by the method and valid until
     * its next call), LETHE_SEL_BUILT_HEADS (per-KV-head selections, Quest's
     * quest_granularity=head: *sel_begin host [n_seqs * n_kv_heads + 1],
     * sequence s's KV head h reads *sel_slots[sel_begin[s * n_kv_heads + h]
     * ..], each list a subsequence of the sequence's row; the engine hands
     * them to attention as lethe_attn_args.head_sel_* with `rows` as the
     * sequences' selections) or LETHE_SEL_PER_SEQ (build per sequence,
     * below). The selection convention is the same (ascending, new tokens
     * last). Default none: always per sequence. */
    lethe_sel_result (*select_layer)(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                     const void *q, const lethe_step_rows *rows,
                                     const int32_t **sel_begin, const int32_t **sel_slots);
    /* Graph decode (select_layer methods only; optional). Called once for a
     * pure decode step (one new token per sequence, no prefill) that the
     * engine would run as a CUDA graph, before the forward and after
     * prepare. rows: the step's full rows for n_pad >= st->n_seqs sequences:
     * the real ones first, then padding sequences whose row is one scratch
     * slot (their query rows are batch rows n_seqs .. n_pad - 1). The method
     * builds, for every layer at once, each host array its select_layer will
     * hand to backend ops, lists them in *out (the same arrays in the same
     * order every step; contents and counts may change), and reserves its
     * backend scratch; then true. During this step select_layer answers for
     * all n_pad sequences and must issue the same backend ops in every step,
     * reading only those arrays, rows and backend memory: on a replay it is
     * not called at all. false: the step runs the per-layer path instead
     * (e.g. more stale state than a graph step refreshes). out->selected:
     * entries the real sequences read, summed over layers (engine stats).
     * A LETHE_SPARSE_PER_LAYER_ROWS method (no select_layer) gets rows NULL
     * and answers whether this step's decode reads every resident slot of
     * every layer with no per-layer hook to call (needs_scores false in every
     * layer, after_attn / layer_end with nothing to do: the method does now
     * whatever bookkeeping they would do); out stays empty, and the engine
     * builds and stages every layer's rows itself. */
    bool (*graph_step)(lethe_sparse_method *m, const lethe_sparse_step *st,
                       const lethe_step_rows *rows, int32_t n_pad, lethe_graph_arrays *out);
    /* Write the selection of prefill sequence `seq` for `layer` into
     * sel[0..cap) and return its length (cap >= the row length). Default:
     * every resident slot of the row (lethe_sparse_select_all). */
    int32_t (*build_prefill_selection)(lethe_sparse_method *m, int32_t layer,
                                       const lethe_sparse_step *st, int32_t seq, int32_t *sel,
                                       int32_t cap);
    /* As above for a decode token; q is the backend activation [n_tokens,
     * n_heads, head_dim] after RoPE (rows of this sequence from q_row).
     * Default: every resident slot of the row. */
    int32_t (*build_decode_selection)(lethe_sparse_method *m, int32_t layer,
                                      const lethe_sparse_step *st, int32_t seq, const void *q,
                                      int32_t *sel, int32_t cap);
    /* attn: the layer's attention arguments (q after RoPE, this layer's K
     * cache, each sequence's selection in step order) when needs_scores(layer)
     * was true, else NULL; valid during the call only. A method turns them
     * into reduced per-key scores with lethe_sparse_scores (the backend's
     * attn_scores op: on the device, nothing rows x keys). Required with
     * needs_scores; default none. */
    void (*after_attn)(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                       const lethe_attn_args *attn);
    void (*layer_end)(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st); /* default none */

    /* ---- state snapshot / restore (prefix chains that resume a conversation) ---- */
    /* serialise `state` into buf[0..cap) and return its size (write only when
     * it fits; buf may be NULL to ask the size); default: nothing to save */
    size_t (*snapshot)(lethe_sparse_method *m, const void *state, void *buf, size_t cap);
    /* rebuild a fresh request_init state from a snapshot; required with snapshot */
    lethe_status (*restore)(lethe_sparse_method *m, void *state, const void *buf, size_t n);
};

/* ---- registry (registry.c) ---- */

/* The registered methods: the built-ins of registry.c, then those added with
 * lethe_sparse_register_extra. The first call of any registry function checks
 * every built-in with lethe_sparse_validate and aborts naming the method and
 * the rule (a broken built-in table is a bug). */
int32_t lethe_sparse_n_methods(void);
const lethe_sparse_ops *lethe_sparse_method_at(int32_t i);
/* by canonical name or alias ('-' and '_' are interchangeable, case-insensitive);
 * NULL with an error naming the known methods otherwise */
const lethe_sparse_ops *lethe_sparse_find(const char *name);

/* The contract's rules for one table (validate.c; each field's comment above
 * says what it needs): LETHE_OK, or LETHE_ERR_INVALID with the message
 * "sparse method NAME: RULE". */
lethe_status lethe_sparse_validate(const lethe_sparse_ops *ops);
/* Registers a method defined outside registry.c after the built-ins (the
 * tests' throwaway method): validated like them, and its name and aliases
 * must not spell a registered method. At most 8; not thread-safe (call it
 * before any engine exists). */
lethe_status lethe_sparse_register_extra(const lethe_sparse_ops *ops);
/* the shared knobs' names (lethe_sparse_knobs order), which method knobs must not shadow */
extern const char *const lethe_sparse_shared_knob_names[3];

/* Parses "knob=value,knob=value" into knobs (shared ones) and hands others
 * to the method's set_knob. Unknown knobs and bad values are errors. */
lethe_status lethe_sparse_parse_config(lethe_sparse_method *m, const char *config);

/* Creates the method `name` (NULL = "dense") with `config` for an engine.
 * `name` may be a pair PREFILL+DECODE (a LETHE_SPARSE_PREFILL_AXIS method,
 * then any decode method: flashprefill+snapkv), one method whose table is
 * synthesized from both (combined.c), `config` holding the knobs of both. */
lethe_status lethe_sparse_create(const char *name, const char *config, const lethe_sparse_env *env,
                                 lethe_sparse_method **out);
void lethe_sparse_destroy(lethe_sparse_method *m); /* NULL-safe */

/* ---- prefill + decode pairs (combined.c) ---- */

/* Splits `name` into its prefill-axis and decode-axis methods: "a+b" gives
 * both (or an error saying why the pair cannot work: order, two methods of
 * one axis, a decode method whose KV the prefill method cannot read); a
 * single name gives one of the two (the other NULL). */
lethe_status lethe_sparse_combine(const char *name, const lethe_sparse_ops **prefill,
                                  const lethe_sparse_ops **decode);
/* The table that decides the KV of `name` (a pair's decode method, else the
 * method itself), for checks before the method exists; NULL when unknown. */
const lethe_sparse_ops *lethe_sparse_find_kv(const char *name);
lethe_status lethe_sparse_create_combined(const lethe_sparse_ops *prefill, const lethe_sparse_ops *decode,
                                          const char *config, const lethe_sparse_env *env,
                                          lethe_sparse_method **out);

/* ---- hooks with their defaults applied (sparse_common.c): what the engine
 * and the scheduler call instead of testing the table for NULL ---- */

/* The selection of sequence `seq` for `layer` into sel[0..cap): the
 * method's build_prefill_selection or build_decode_selection (by
 * st->seqs[seq].is_prefill), or every resident slot of the row. */
int32_t lethe_sparse_build_selection(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                     int32_t seq, const void *q, int32_t *sel, int32_t cap);
int32_t lethe_sparse_prefill_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                                  int32_t n_resident, int32_t n_chunk); /* n_chunk without the hook */
int32_t lethe_sparse_min_final_chunk(const lethe_sparse_method *m); /* 0 without the hook */
lethe_kv_format lethe_sparse_kv_format(const lethe_sparse_method *m); /* NATIVE without the hook */
int32_t lethe_sparse_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk); /* n_total without the hook */
size_t lethe_sparse_slot_overhead(const lethe_sparse_method *m); /* 0 without the hook */
size_t lethe_sparse_kv_reserve(lethe_sparse_method *m, int32_t max_num_seqs,
                               int32_t max_num_batched_tokens); /* 0 without the hook */
/* The method's payload layouts into out[env.n_layers]: true when it declares
 * them (kv_layout answered true for layer 0; then every layer must). */
bool lethe_sparse_kv_layouts(const lethe_sparse_method *m, lethe_kv_layout *out);
/* The path the model writes and reads a layer through when the pool holds
 * the method's layout (m->path over the kv_* hooks, ctx = m); NULL when the
 * pool holds the backend's K / V (or no pool yet). Same for every layer. */
const lethe_kv_path *lethe_sparse_kv_path(lethe_sparse_method *m);

/* ---- auxiliary prefill (KVzip's context replay) ---- */

/* Runs tokens[0..n) as a teacher-forced prefill of sequence s appended to its
 * row (positions right after the row's last one), through the model in
 * forwards of at most env.max_aux_tokens tokens, with this method's selection
 * hooks and after_attn (seq.is_aux: the method scores the appended queries
 * against the resident keys), no logits and no sampling; then drops the
 * appended entries, so every layer's row returns exactly to what it was
 * (slots freed). Only from finish_step, for a sequence of that step. The
 * slots must have been asked for: prefill_peak_slots of the chunk (the step
 * it runs in) includes n, so the scheduler reserved them at admission time;
 * LETHE_ERR_CAPACITY (nothing changed) when some layer lacks n free slots,
 * LETHE_ERR_UNSUPPORTED without an engine (env.aux_prefill NULL). */
lethe_status lethe_sparse_aux_prefill(lethe_sparse_method *m, const lethe_sparse_seq *s,
                                      const int32_t *tokens, int32_t n);

/* ---- helpers for methods (sparse_common.c) ---- */

/* Copies a row's slots for `layer` into sel (the "select everything
 * resident" selection, the selection hooks' default) and returns the count. */
int32_t lethe_sparse_select_all(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                int32_t *sel, int32_t cap);

/* Typed knob helpers (sparse_common.c): defaults of a table, one key=value
 * (LETHE_ERR_INVALID naming knob and method when out of range / malformed),
 * lookup by name (asserts the knob exists). */
void lethe_knobs_defaults(const lethe_sparse_ops *o, lethe_knob_values *v);
lethe_status lethe_knobs_set(const lethe_sparse_ops *o, lethe_knob_values *v, const char *key,
                             const char *value);
double lethe_knob_num(const lethe_sparse_ops *o, const lethe_knob_values *v, const char *name);
const char *lethe_knob_str(const lethe_sparse_ops *o, const lethe_knob_values *v, const char *name);

/* Host view of a layer's stored K / V ([n_slots, n_kv_heads, head_dim] f32),
 * NULL when the backend's KV memory is not host f32 (CUDA: the method ops
 * need CUDA twins there). */
float *lethe_sparse_kv_host(const lethe_sparse_method *m, int32_t layer, bool value);
/* whether the backend's KV is host f32 (callable before the pool exists, e.g. in configure) */
bool lethe_sparse_kv_host_ok(const lethe_sparse_method *m);

/* Reduced attention scores for the requests req[0..n) (lethe_score_seq:
 * rows, keys, candidates, mode; keys index attn->sel_slots, so key_begin is
 * normally attn->sel_begin[seq]) through the backend's attn_scores op, into
 * HOST out [lethe_attn_scores_out_len(req, n, n_groups)]. Returns false (out
 * untouched) when there is nothing to score with: attn NULL, or no backend /
 * no q (the fake runner), where methods skip scoring. */
bool lethe_sparse_scores(const lethe_sparse_method *m, const lethe_attn_args *attn,
                         const lethe_score_seq *req, int32_t n, int32_t n_groups, float *out);
/* The same into backend f32 memory (no host copy, no sync; for ops->topk). */
bool lethe_sparse_scores_on_backend(const lethe_sparse_method *m, const lethe_attn_args *attn,
                                    const lethe_score_seq *req, int32_t n, int32_t n_groups,
                                    float *out);

/* A growable backend buffer a method owns (device scratch for select_layer).
 * Contents are NOT kept when it grows (scratch). Growth releases and
 * allocates (a device sync on CUDA; rare: 25% headroom) and drops the
 * backend's captured graphs, which may hold the old address. */
typedef struct lethe_dev_buf {
    void *p;
    size_t cap;                /* bytes */
} lethe_dev_buf;
lethe_status lethe_dev_buf_reserve(const lethe_sparse_method *m, lethe_dev_buf *b, size_t bytes);
void lethe_dev_buf_free(const lethe_sparse_method *m, lethe_dev_buf *b);

/* Converts ascending row-entry indices sel[0..n) of `row` in `layer` into slot
 * ids in place (selections are slot lists). */
void lethe_sparse_entries_to_slots(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                   int32_t *sel, int32_t n);

static inline int32_t lethe_sparse_row_len(const lethe_sparse_method *m, int32_t layer, int32_t row) {
    return lethe_kv_row_len(m->env.pool, lethe_kv_space_of(m->env.pool, layer), row);
}

/* The keep set of an eviction: sink [0, s), recent [L - r, L) and the top-k
 * of the middle by scores (lethe_keep_sink_recent_topk), with the row's
 * protected entries (retention pins: lethe_kv_row_protect) forced in. Every
 * eviction method builds its keep set here, so no method can drop a pinned
 * token; pinned middle entries count against k, and the result holds more
 * than s + k + r entries when they outnumber k. keep: capacity L (the row's
 * length in the layer). Returns the count. */
int32_t lethe_sparse_keep_set(const lethe_sparse_method *m, int32_t layer, int32_t row,
                              const float *scores, int32_t s, int32_t r, int32_t k, int32_t *keep);
/* Adds the row's pinned entries of layer that keep[0, n) lacks (a method that builds
 * its keep set itself, e.g. sentence or top-k compaction), so pins survive it; keep
 * (capacity >= the row's length) comes back ascending; returns the new count. */
int32_t lethe_sparse_keep_add_pins(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                   int32_t *keep, int32_t n);

/* A float vector aligned with a request's row entries in one layer (per-token
 * scores that must follow compaction). */
typedef struct lethe_rowvec {
    float *v;
    int32_t n, cap;
} lethe_rowvec;
void lethe_rowvec_resize(lethe_rowvec *r, int32_t n, float fill); /* grow with fill / shrink */
void lethe_rowvec_keep(lethe_rowvec *r, const int32_t *keep, int32_t n);
void lethe_rowvec_free(lethe_rowvec *r);
/* snapshot of n_vecs vectors: [int32 n][float v[n]] each; save returns the
 * size (writes only when it fits cap) */
size_t lethe_rowvecs_save(const lethe_rowvec *r, int32_t n_vecs, void *buf, size_t cap);
lethe_status lethe_rowvecs_load(lethe_rowvec *r, int32_t n_vecs, const void *buf, size_t n);

extern const lethe_sparse_ops lethe_sparse_dense;

/* Hybrid models (linear-attention layers with per-request states): NULL when
 * the method applies to their full-attention layers (it then sees only
 * those: env.n_layers, layer indices and budgets count full-attention
 * layers), else why it cannot (ops->hybrid_refusal). `lethe methods` prints
 * it. lethe_sparse_hybrid_refusal_of asks every method a --sparse-method
 * names (both of a PREFILL+DECODE pair) and returns the first refusal, with
 * the refusing method in *who; NULL for names that do not resolve (creation
 * reports those). The engine refuses with it (engine_hybrid.c). */
const char *lethe_sparse_hybrid_refusal(const lethe_sparse_ops *ops);
const char *lethe_sparse_hybrid_refusal_of(const char *name, const lethe_sparse_ops **who);

#endif /* LETHE_SPARSE_H */

/* lethe.h - the public C API of the lethe engine.
 *
 * One engine owns a model, a backend, the KV pool, the scheduler, the prefix
 * cache and the sparse method. Two ways to drive it:
 *
 *  1. Synchronous (offline tools, tests): lethe_engine_add_request() then
 *     lethe_engine_step() until lethe_engine_has_work() is false. Every call
 *     happens on the caller's thread.
 *  2. Threaded (the server): lethe_engine_start() spawns the engine thread,
 *     which then owns all state; any thread may call lethe_engine_submit() and
 *     lethe_engine_cancel() (they go through a bounded queue and are applied
 *     at the start of the next step). lethe_engine_stop() joins the thread.
 *
 * Results come back through the request's callback, always on the thread that
 * runs lethe_engine_step() (the engine thread in mode 2). A callback must not
 * call back into the engine except lethe_engine_cancel(). */
#ifndef LETHE_H
#define LETHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lethe_engine lethe_engine;

/* What every int-returning function below returns: 0 (LETHE_OK) or the kind
 * of refusal; lethe_engine_last_error() has the message. */
typedef enum lethe_status {
    LETHE_OK = 0,
    LETHE_ERR_INVALID,      /* bad argument, flag or user input */
    LETHE_ERR_IO,           /* open/read/mmap/socket failed */
    LETHE_ERR_FORMAT,       /* malformed GGUF, safetensors, tokenizer or JSON */
    LETHE_ERR_UNSUPPORTED,  /* well-formed but not handled: dtype, arch, method */
    LETHE_ERR_NOMEM,        /* host or device allocation failed */
    LETHE_ERR_BACKEND,      /* device / library call failed outside the hot path */
    LETHE_ERR_CAPACITY,     /* does not fit (KV, queue): a scheduling outcome at boundaries */
    LETHE_ERR_NOT_FOUND,    /* unknown id / name */
    LETHE_ERR_BUSY,         /* resource in use */
} lethe_status;

/* "ok", "invalid argument", ... (static strings) */
const char *lethe_status_str(lethe_status s);

#define LETHE_MAX_STOP 8
#define LETHE_MAX_TOP_LOGPROBS 20

typedef struct lethe_sampling_params {
    float temperature;          /* 0 = greedy; default 1.0 */
    int32_t top_k;              /* <= 0: off */
    float top_p;                /* 1.0: off */
    float min_p;                /* 0: off */
    float repetition_penalty;   /* 1.0: off (HF/vLLM semantics, prompt + output tokens) */
    float presence_penalty;     /* 0: off (OpenAI semantics, output tokens) */
    float frequency_penalty;    /* 0: off */
    uint64_t seed;              /* used when has_seed; else a per-request random seed */
    bool has_seed;
    int32_t max_tokens;         /* completion tokens; -1 = until max_model_len */
    bool ignore_eos;
    const char *stop[LETHE_MAX_STOP]; /* stop strings (copied at submit); NULL-terminated */
    int32_t stop_token_ids[LETHE_MAX_STOP];
    int32_t n_stop_token_ids;
    int32_t logprobs;           /* -1: none; 0: sampled token only; k: + top-k alternatives */
} lethe_sampling_params;

void lethe_sampling_default_params(lethe_sampling_params *p);

typedef enum lethe_finish_reason {
    LETHE_FINISH_NONE = 0,      /* still running */
    LETHE_FINISH_STOP,          /* EOS, stop token or stop string */
    LETHE_FINISH_LENGTH,        /* max_tokens or max_model_len */
    LETHE_FINISH_ABORT,         /* cancelled */
    LETHE_FINISH_ERROR,         /* rejected (e.g. prompt too long); see error */
} lethe_finish_reason;

typedef struct lethe_top_logprob {
    int32_t token;
    float logprob;
} lethe_top_logprob;

/* One event per sampled token, plus a final event (finished = true; it may
 * carry the last token or none, n_tokens == 0). text is the newly completed
 * UTF-8 text (stop strings already removed); valid only during the callback. */
typedef struct lethe_event {
    uint64_t request_id;
    int32_t n_tokens;           /* 0 or 1 */
    int32_t token;
    const char *text;
    float logprob;
    int32_t n_top;
    const lethe_top_logprob *top;
    bool finished;
    lethe_finish_reason finish_reason;
    const char *error;          /* finish_reason == ERROR */
    bool error_internal;        /* ERROR: the engine failed (a backend error; HTTP 500), not the
                                 * request as asked (no room in the KV cache, ...; HTTP 400) */
    /* usage, filled on every event */
    int32_t prompt_tokens;
    int32_t completion_tokens;
    int32_t cached_tokens;      /* prompt tokens reused from the prefix cache */
    double ttft_s;              /* time to first token (from submit); set once known */
    const float *logits;        /* want_logits: [n_vocab], valid during the callback */
    int32_t n_vocab;
} lethe_event;

typedef void (*lethe_event_cb)(void *user, const lethe_event *ev);

/* A compiled output constraint (structured output, forced tool calls):
 * immutable, reference counted; a request keeps its own reference, so the
 * caller may free its handle right after submit. */
typedef struct lethe_grammar lethe_grammar;
typedef enum lethe_grammar_kind {
    LETHE_GRAMMAR_JSON_SCHEMA = 0,  /* spec: a JSON Schema (JSON text) */
    LETHE_GRAMMAR_JSON_OBJECT,      /* any JSON object; spec unused */
    LETHE_GRAMMAR_EBNF,             /* spec: EBNF (GBNF-style, root rule "root") */
    LETHE_GRAMMAR_REGEX,            /* spec: a regular expression for the whole output */
    LETHE_GRAMMAR_STRUCTURAL_TAG,   /* spec: an xgrammar structural tag (JSON text) */
} lethe_grammar_kind;
/* Compiles against the engine's vocabulary (thread-safe; compiled grammars
 * are cached). LETHE_ERR_INVALID with the compiler's message for a bad spec. */
int lethe_engine_compile_grammar(lethe_engine *e, lethe_grammar_kind kind, const char *spec,
                                 lethe_grammar **out);
void lethe_grammar_free(lethe_grammar *g); /* drops one reference; NULL-safe */

/* A half-open token range [start, end) of a prompt. */
typedef struct lethe_token_range {
    int32_t start, end;
} lethe_token_range;

/* Retention hint "prunable": tokens [start, end) may be pruned to keep_ratio. */
typedef struct lethe_retention_range {
    int32_t start, end;
    float keep_ratio; /* [0, 1] */
} lethe_retention_range;

typedef struct lethe_request_params {
    const int32_t *prompt;      /* token ids (copied at submit) */
    int32_t n_prompt;
    lethe_sampling_params sampling;
    lethe_event_cb cb;
    void *user;
    /* Forced output (teacher forcing / trace replay): when n_forced > 0 the
     * i-th generated token is forced[i] instead of a sample, for i < n_forced,
     * and the request finishes (LENGTH) after n_forced tokens. Copied at submit. */
    const int32_t *forced;
    int32_t n_forced;
    /* When true, every token event carries the full next-token logits
     * (raw, before penalties/temperature) that produced it. */
    bool want_logits;
    /* Output constraint or NULL: every sampled token is one the grammar
     * allows (masked before sampling, on the device for CUDA); the model's
     * end tokens only once the grammar is complete. Not with forced tokens
     * or ignore_eos. The request takes its own reference at submit. */
    lethe_grammar *grammar;
    /* Retention hints (chat "retention", docs/serving.md), prompt token
     * ranges, copied at submit. Pinned tokens are kept by every eviction
     * method, by prefix-cache pruning and in a chain's compacted row (one
     * protected mask per KV row: kv_protect.c). Prunable ranges: with the
     * radix cache, the engine prunes their cached blocks to keep_ratio once
     * the request has finished (snapkv_global, in the background); elsewhere
     * they are kept as normal tokens. */
    const lethe_token_range *pinned;
    int32_t n_pinned;
    const lethe_retention_range *prunable;
    int32_t n_prunable;
} lethe_request_params;

typedef struct lethe_engine_params {
    const char *model;          /* .gguf, HF folder, or config.json (dummy) */
    const char *load_format;    /* "auto" | "gguf" | "hf" | "dummy" */
    uint64_t seed;              /* dummy weights and default sampling seed */
    const char *device;         /* "cpu" | "cuda" */
    int32_t n_threads;          /* CPU threads, 0 = all cores */
    /* CPU weights: "native" (NULL: GGUF blocks, f16, bf16 kept as stored;
     * block formats multiply with x rounded to 8 bits per 32-element block,
     * as llama.cpp does: the fast default) | "exact" (kept as stored, f32
     * activations: bit-identical to fp32) | "fp32" (dequantized at load, the
     * reference) */
    const char *cpu_weights;
    int32_t max_model_len;      /* 0 = model's max_pos */
    int32_t max_num_seqs;       /* default 256 */
    int32_t max_num_batched_tokens; /* per-step token budget, default 2048 */
    size_t kv_cache_bytes;      /* CPU KV budget; 0 = default (1 GiB). On a device: a cap on the
                                 * pool that gpu_memory_utilization sizes (0 = none) */
    float gpu_memory_utilization; /* CUDA: fraction of device memory, default 0.9 */
    bool enable_prefix_caching; /* default true */
    /* Host-memory tier under the prefix cache (--host-cache-bytes): prefix
     * blocks evicted from the KV pool (radix blocks, chains' shared prefixes)
     * are demoted to at most this many bytes of host memory, least recently
     * used out first, and restored on a later hit instead of recomputed
     * (bit-identical). 0 = off (default). Needs prefix caching and a KV
     * format whose payload is all in the slot planes (native). */
    size_t host_cache_bytes;
    const char *sparse_method;  /* default "dense" */
    const char *sparse_config;  /* "knob=value,knob=value" (sink_keep_tokens, ...), may be NULL */
    bool check_invariants;      /* run the KV ownership checker after every step */
    bool progress;              /* progress bar while loading */
    /* never put prefill and decode tokens in one step
     * (the anchor's rule; default false = mixed steps as vLLM, see
     * docs/architecture.md for the CPU measurement) */
    bool split_prefill_decode;
    /* "auto" (NULL) | "radix" | "chain". auto picks
     * the radix prefix cache for methods whose per-token KV does not depend
     * on history (dense, logical selection) and the Chain Cache for the
     * others (eviction); radix with an eviction method is an error. */
    const char *prefix_cache_mode;
    /* tokenizer.json / tokenizer_config.json folder (or a file inside it, or a
     * GGUF) to use instead of the one beside the model; NULL = beside the
     * model. Lets dummy weights (config.json) serve text: e.g. the Llama-3
     * tokenizer with the dummy Llama-3.1-8B shape. */
    const char *tokenizer;
    /* added with CUDA-graph decode (src/engine/engine_forward.c): never
     * capture or replay CUDA graphs (vLLM's --enforce-eager). Graphs are used
     * on the CUDA backend for pure decode steps of methods whose selection is
     * the same in every layer (dense) or that plan their decode steps for
     * graphs (sparse.h graph_step: quest), padded to bucket sizes. */
    bool enforce_eager;
    /* tests: pad decode batches to the graph bucket sizes even where no graph
     * runs (CPU backend, or with enforce_eager), to prove padding changes no
     * real request's output */
    bool pad_decode_batches;
    /* Hybrid models (linear-attention layers with per-request states, e.g.
     * qwen3_5), radix prefix cache: a prefix hit needs the states at its
     * end, so the cache snapshots them every state_snapshot_interval tokens
     * of a prompt (--state-snapshot-interval, a multiple of 64; 0 = the step
     * budget max_num_batched_tokens rounded down to a multiple of 64) and
     * at the prompt's last multiple of 64; prefill chunks end there. The
     * snapshots take at most state_snapshot_bytes (--state-snapshot-bytes;
     * 0 = an eighth of the KV budget) off the KV budget, least recently
     * used out first. In chain mode the same budget holds idle chains'
     * states (LRU chains beyond it are reclaimed). Other models ignore both. */
    int32_t state_snapshot_interval;
    size_t state_snapshot_bytes;
} lethe_engine_params;

void lethe_engine_default_params(lethe_engine_params *p);

/* Returns LETHE_OK and *out on success; otherwise a lethe_status and
 * lethe_engine_last_error() says why. */
int lethe_engine_create(const lethe_engine_params *p, lethe_engine **out);
void lethe_engine_destroy(lethe_engine *e); /* NULL-safe; stops the thread if running */
const char *lethe_engine_last_error(void);

/* Tokenizer access (text in / text out for tools and the server). */
int lethe_engine_tokenize(lethe_engine *e, const char *text, bool add_bos, bool parse_special,
                          int32_t **ids, int32_t *n_ids); /* *ids malloc'd */
/* Renders chat messages (roles/contents arrays) with the model's template.
 * The text includes the template's BOS text where it has one (Llama-3):
 * tokenize it with add_bos = false and parse_special = true. */
int lethe_engine_apply_chat(lethe_engine *e, const char *const *roles,
                            const char *const *contents, size_t n, bool add_generation_prompt,
                            char **out); /* *out malloc'd */
char *lethe_engine_detokenize(lethe_engine *e, const int32_t *ids, int32_t n); /* malloc'd */
/* Chat with tools and reasoning (OpenAI shapes, JSON text in). messages_json:
 * the "messages" array (roles system / developer / user / assistant / tool;
 * content a string, null or text parts; assistant "tool_calls" with
 * "arguments" as a JSON string or object; "reasoning_content"). The model's
 * template renders tools, calls and results; a template without a tool
 * format refuses them (LETHE_ERR_UNSUPPORTED). */
typedef struct lethe_chat_options {
    bool add_generation_prompt;
    const char *tools_json;     /* the "tools" array, or NULL */
    /* chat_template_kwargs object, or NULL: enable_thinking (bool),
     * date_string (Llama-3.x), tools_in_user_message (Llama-3.x, bool);
     * other keys are refused (LETHE_ERR_INVALID) */
    const char *kwargs_json;
    /* Qwen3: keep the <think> block of every assistant turn that has
     * reasoning (the template drops it before the last user message) */
    bool preserve_thinking;
} lethe_chat_options;
int lethe_engine_apply_chat_json(lethe_engine *e, const char *messages_json, const lethe_chat_options *o,
                                 char **out); /* *out malloc'd */
/* "qwen3", "qwen2.5", "llama3.1", "smollm2", ... (NULL without a tokenizer) */
const char *lethe_engine_chat_format(const lethe_engine *e);
/* How the model writes tool calls: "hermes" (<tool_call> JSON: Qwen2.5/3),
 * "llama3_json" (Llama-3.1/3.2), or NULL when its template has no tools. */
const char *lethe_engine_tool_format(const lethe_engine *e);

/* true when the model's tokenizer prepends BOS to a plain prompt (Llama-3: yes;
 * SmolLM2 / Qwen: no), i.e. the add_bos a completion prompt should use. */
bool lethe_engine_adds_bos(const lethe_engine *e);
const char *lethe_engine_token_text(lethe_engine *e, int32_t id, size_t *n_bytes);
int32_t lethe_engine_max_model_len(const lethe_engine *e);
const char *lethe_engine_model_name(const lethe_engine *e); /* file / folder base name */

/* Synchronous mode. add_request validates (prompt length, sampling fields) and
 * returns non-zero with an error message instead of queuing a bad request. */
int lethe_engine_add_request(lethe_engine *e, const lethe_request_params *p, uint64_t *id_out);
int lethe_engine_step(lethe_engine *e); /* one scheduler step; 0 on success */
bool lethe_engine_has_work(const lethe_engine *e);
int lethe_engine_abort(lethe_engine *e, uint64_t id); /* frees its KV now; final event ABORT */

/* Threaded mode. */
int lethe_engine_start(lethe_engine *e);
void lethe_engine_stop(lethe_engine *e);
int lethe_engine_submit(lethe_engine *e, const lethe_request_params *p, uint64_t *id_out);
void lethe_engine_cancel(lethe_engine *e, uint64_t id); /* thread-safe, idempotent */

typedef struct lethe_engine_stats {
    int32_t n_running, n_waiting;
    int64_t kv_slots_total, kv_slots_used;   /* summed over slot spaces (1, or one per layer) */
    double kv_usage;                         /* used / total in [0, 1]; slots held only by the
                                              * prefix cache count as free (evictable on demand) */
    int64_t prefix_queries_tokens, prefix_hit_tokens; /* cumulative */
    int64_t prompt_tokens_total, generation_tokens_total;
    int64_t prefill_tokens_computed;         /* tokens that went through the forward as prompt */
    int64_t n_preemptions;
    int64_t n_steps;
    /* steps whose forward failed (a backend error): their requests ended with an internal error */
    int64_t n_failed_steps;
    int64_t n_requests_finished;
    /* forward path (CUDA-graph decode, src/engine/engine_forward.c) */
    int64_t graph_replays;    /* decode steps replayed from a captured CUDA graph */
    int64_t graph_captures;   /* decode steps that captured a graph (and ran it) */
    int64_t eager_steps;      /* steps whose ops were launched one by one */
    int64_t padded_seqs;      /* dummy sequences added to pad decode batches to buckets */
    int64_t device_selections; /* layers whose selections a method built on the backend
                                * (select_layer: Quest, OmniKV), summed over steps */
    /* prefix cache (src/engine/engine_prune.c) */
    int64_t
        kv_slots_resident; /* slots holding KV (requests and the prefix cache), summed over spaces */
    int64_t kv_tokens_resident; /* the same per layer: kv_slots_resident / slot spaces. With one
                                 * shared space (dense) equal to it; a method that compacts layers
                                 * apart has one space per layer, so this is what compares */
    int64_t prune_jobs;    /* prune jobs committed */
    int64_t prune_freed_slots; /* slots per space they freed */
    /* host tier (--host-cache-bytes; all 0 without it) */
    int64_t host_cache_capacity_bytes, host_cache_used_bytes, host_cache_entries;
    int64_t host_cache_demoted_blocks;  /* cumulative: blocks moved pool -> host */
    int64_t host_cache_promoted_blocks; /* cumulative: blocks restored host -> pool on a hit */
    int64_t host_cache_promoted_tokens; /* the prompt tokens they covered (not recomputed) */
    int64_t host_cache_evicted;         /* cumulative: blobs dropped from the host (LRU) */
    /* cumulative KV payload bytes copied pool -> host (demotions) and host ->
     * pool (restores), and the wall seconds of those synchronous copies */
    int64_t host_cache_demoted_bytes, host_cache_restored_bytes;
    double host_cache_demote_seconds, host_cache_restore_seconds;
    double host_cache_copy_bytes_per_s; /* one large raw host -> KV-memory copy at start-up */
    /* cumulative: admissions put off because another running request was
     * computing a prefix they share (they attach it once it is published) */
    int64_t prefix_inflight_waits;
    /* hybrid models (linear-attention states, --state-snapshot-bytes; all 0
     * otherwise): state snapshots the prefix cache holds now (radix:
     * snapshots; chain mode: idle chains' states), their bytes and the budget;
     * radix, cumulative: snapshots taken, hits resumed from one, the matched
     * prompt tokens after a hit's snapshot that it recomputed, snapshots
     * dropped for room (LRU), and with --host-cache-bytes the snapshots
     * demoted to the host tier with their blocks and restored with them */
    int64_t state_snapshots, state_snapshot_bytes, state_snapshot_capacity_bytes;
    int64_t state_snapshots_taken, state_snapshot_hits, state_snapshot_recomputed_tokens;
    int64_t state_snapshots_evicted, state_snapshots_demoted, state_snapshots_restored;
} lethe_engine_stats;

/* Thread-safe snapshot (updated at the end of every step). */
void lethe_engine_get_stats(lethe_engine *e, lethe_engine_stats *out);

/* ---- live views (the dashboard of `lethe serve`, GET / and /metrics):
 * thread-safe snapshots, updated at the end of every step ---- */
typedef struct lethe_kv_space_use {
    int64_t slots_total;        /* without the scratch slot */
    int64_t slots_used;         /* held by requests and chains */
    int64_t slots_cached;       /* held only by the prefix cache (evictable on demand) */
} lethe_kv_space_use;
/* KV use of every slot space (1 shared, or one per layer with per-layer
 * rows); copies up to cap, returns how many spaces there are. */
int32_t lethe_engine_get_kv_spaces(lethe_engine *e, lethe_kv_space_use *out, int32_t cap);
/* Host RAM of the KV pool when its buffers are host memory (the CPU
 * backend): *allocated bytes in all, of which *resident are in RAM now. The
 * buffers are allocated untouched, so the resident part rises with the
 * highest number of slots ever in use (pages join the process RSS when a slot
 * is first written), up to *allocated. False (0, 0) on a device backend.
 * Thread-safe, measured at the call. */
bool lethe_engine_kv_host_memory(lethe_engine *e, int64_t *resident, int64_t *allocated);

/* What attention read against what the rows held, and what the sparse
 * method dropped; cumulative (per step: divide differences by n_steps'). */
typedef struct lethe_engine_sparse_stats {
    int64_t selected_slots;     /* KV entries attention read, summed over layers and sequences */
    int64_t resident_slots;     /* entries the same rows held then (selected <= resident) */
    int64_t evicted_slots;      /* row entries the method dropped, summed over slot spaces */
    int64_t n_steps;
} lethe_engine_sparse_stats;
void lethe_engine_get_sparse_stats(lethe_engine *e, lethe_engine_sparse_stats *out);

/* ---- Chain Cache (src/cache/chain_cache.c) ----
 * In chain mode a conversation keeps its (possibly compacted) KV and method
 * state between turns; a turn only prefills the tokens after the processed
 * boundary. Turns are submitted with the *_chain functions below; a refused
 * turn returns LETHE_ERR_CAPACITY / NOT_FOUND / BUSY / INVALID with
 * res->code saying why. The HTTP server maps the codes onto statuses and
 * code strings (src/server/chain_api.c: 404 chain_not_found, 409 chain_busy |
 * chain_prefix_mismatch | chain_fingerprint_mismatch, 410 chain_gone, 503
 * chain_capacity_unavailable, 400 chain_invalid_request | chain_mode_disabled). */
typedef enum lethe_chain_code {
    LETHE_CHAIN_OK = 0,
    LETHE_CHAIN_NOT_FOUND,            /* unknown chain id */
    LETHE_CHAIN_BUSY,                 /* the chain has a turn in progress */
    LETHE_CHAIN_PREFIX_MISMATCH,      /* append mode: the tokens do not continue the chain */
    LETHE_CHAIN_FINGERPRINT_MISMATCH, /* built by another model / method configuration */
    LETHE_CHAIN_GONE,                 /* reclaimed or invalidated: resend the full prompt */
    LETHE_CHAIN_CAPACITY,             /* no KV for the turn even after reclaiming idle chains */
    LETHE_CHAIN_BAD_REQUEST,          /* the turn's chain fields are inconsistent */
    LETHE_CHAIN_MODE_DISABLED,        /* the engine does not run the Chain Cache */
    LETHE_CHAIN_INVALID_REQUEST,      /* the request itself is invalid (sampling, token ids) */
    LETHE_CHAIN_QUEUE_FULL,           /* the engine's inbox is full */
    LETHE_CHAIN_ENGINE_BUSY,          /* add_request_chain while the engine thread runs */
} lethe_chain_code;

typedef struct lethe_chain_params {
    const char *chain_id;       /* NULL or "": create a new chain */
    const char *new_chain_id;   /* creating: the new chain's id (a load balancer chose it, to route
                                 * by it; lethe_chain_id_valid); NULL: the engine makes one up */
    const char *owner;          /* tenant that owns the chain (NULL = anonymous); another owner's
                                 * chain is chain_not_found; at most 71 bytes */
    bool append;                /* prompt = only the tokens appended to the chain's history */
    int32_t append_start;       /* chat: index of the first appended message (append mode) */
    int32_t n_messages;         /* chat: messages of the conversation (0 for token prompts) */
    /* Branching: creating (or recreating) a chain, its first share_prefix_tokens
     * prompt tokens (rounded down to whole 16-token blocks, and leaving the
     * last prompt token) are a prefix shared with other chains: attached
     * read-only from the cache when another chain computed it (held once,
     * reference-counted), computed and published otherwise; positions inside
     * it are protected, so the sparse method compacts only the chain's private
     * continuation. 0: the chain owns all of its KV. Ignored on a resumed turn
     * (the chain keeps its own shared prefix). */
    int32_t share_prefix_tokens;
} lethe_chain_params;

typedef struct lethe_chain_result {
    lethe_chain_code code;      /* LETHE_CHAIN_OK, or why the turn was refused */
    char message[192];
    char chain_id[48];
    const char *status;         /* "created" | "resumed" | "recreated" */
    int32_t reused_tokens;      /* prompt tokens whose KV was resident */
    int32_t n_prompt;           /* full prompt of the turn */
    int32_t shared_tokens;      /* the chain's shared prefix (0: not branching) */
} lethe_chain_result;

bool lethe_engine_chain_mode(const lethe_engine *e);
const char *lethe_engine_prefix_cache_mode(const lethe_engine *e); /* "chain" | "radix" | "off" */
/* Threaded mode (any thread) / synchronous mode; p->prompt is the full
 * prompt, or with c->append only the appended tokens. */
int lethe_engine_submit_chain(lethe_engine *e, const lethe_request_params *p, const lethe_chain_params *c,
                              lethe_chain_result *res, uint64_t *id_out);
int lethe_engine_add_request_chain(lethe_engine *e, const lethe_request_params *p, const lethe_chain_params *c,
                                   lethe_chain_result *res, uint64_t *id_out);
/* The chain's logical token history (copies up to cap); -1 unknown/gone. */
int32_t lethe_engine_chain_history(lethe_engine *e, const char *chain_id, int32_t *out, int32_t cap);
/* Synchronous mode, IDLE chains only (tests): logical positions resident in
 * one layer's KV, ascending (copies up to cap); -1 if none. */
int32_t lethe_engine_chain_positions(lethe_engine *e, const char *chain_id, int32_t layer, int32_t *out,
                                     int32_t cap);

typedef struct lethe_engine_chain_stats {
    int32_t n_chains, n_active, n_idle, n_tombstones;
    int64_t n_created, n_resumed, n_recreated, n_reclaimed, n_invalidated, n_rejected, n_capacity_rejected;
    int64_t reused_tokens, prompt_tokens;   /* over admitted turns */
    int64_t resident_slots;                 /* private slots, summed over slot spaces */
    /* branching (lethe_chain_params.share_prefix_tokens) */
    int32_t n_branched;                     /* chains with a shared prefix */
    int32_t n_shared_prefixes;              /* distinct shared prefixes they hold */
    int32_t shared_blocks;                  /* 16-token blocks cached for shared prefixes */
    int64_t shared_hit_tokens;              /* prompt tokens attached from a shared prefix */
    /* host tier (--host-cache-bytes): IDLE chains reclaimed from the KV cache
     * are demoted to host memory and restored by their next turn */
    int32_t n_on_host;                      /* chains whose KV is in the host tier now */
    int64_t n_demoted, n_restored;          /* cumulative */
    int64_t n_lost;                         /* demoted chains the tier could not keep (410) */
    int64_t restored_entries;               /* KV row entries restored, summed over slot spaces */
} lethe_engine_chain_stats;
/* All zero outside chain mode. */
void lethe_engine_get_chain_stats(lethe_engine *e, lethe_engine_chain_stats *out);

typedef struct lethe_chain_summary {
    char chain_id[48];
    bool active;                /* a turn in progress */
    int32_t logical_tokens;     /* the chain's token history */
    int32_t processed_tokens;   /* history tokens whose KV was computed */
    int32_t resident_tokens;    /* private KV entries resident, max over slot spaces */
    int64_t resident_slots;     /* private, summed over slot spaces */
    int32_t shared_tokens;      /* its shared prefix (0: none), held once for all its sharers */
} lethe_chain_summary;
/* The chains, most recently used first (copies up to cap); returns how many
 * there are (0 outside chain mode). Any thread. */
int32_t lethe_engine_list_chains(lethe_engine *e, lethe_chain_summary *out, int32_t cap);

/* ---- Prefix-cache control and pruning (radix mode; src/engine/engine_prune.c,
 * engine_pcctl.c). Blocks are the radix cache's 16-token blocks; a path is
 * named by its token ids from the first token. Every call here runs on the
 * engine thread: directly in synchronous mode, else queued and run at the
 * start of the next step (the *_submit form returns at once). ---- */
#define LETHE_PREFIX_BLOCK 16
#define LETHE_PRUNE_MAX_RANGES 256

typedef enum lethe_prune_policy {
    LETHE_PRUNE_SNAPKV_GLOBAL = 0, /* softmax attention of the last observation tokens before
                                    * the largest range end, max over layers and heads */
    LETHE_PRUNE_KVZIP_GLOBAL,      /* context reconstruction scores (needs the kvzip scorer) */
} lethe_prune_policy;

typedef enum lethe_prune_status {
    LETHE_PRUNE_QUEUED = 0,
    LETHE_PRUNE_COMPLETED, /* committed: the ranges hold only the kept tokens' KV */
    LETHE_PRUNE_BLOCKED,   /* a running request references a block of the ranges */
    LETHE_PRUNE_FAILED,    /* not cached, already pruned, no radix cache, ... (message) */
} lethe_prune_status;

typedef lethe_token_range lethe_prune_range; /* half-open token range [start, end) */

typedef struct lethe_prune_params {
    const int32_t *tokens; /* the path: its blocks up to the largest range end must be cached */
    int32_t n_tokens;
    const lethe_token_range *ranges; /* block-aligned, non-empty, non-overlapping, inside
                                      * [0, n_tokens); any order; adjacent ranges merge */
    int32_t n_ranges;
    int32_t keep_tokens; /* 0 <= keep < sum of widths: one budget shared by all ranges */
    lethe_prune_policy policy;
    int32_t observation_tokens; /* snapkv_global query window (multiple of 16); 0 = 64 */
} lethe_prune_params;

typedef struct lethe_prune_range_result {
    int32_t start, end; /* a merged range */
    int32_t original_tokens, retained_tokens;
} lethe_prune_range_result;

typedef struct lethe_prune_result {
    lethe_prune_status status;
    uint32_t prune_id;
    lethe_prune_policy policy;
    int64_t freed_device_slots; /* per slot space: sum of widths - keep when completed */
    bool quality_degraded;      /* completed: the path's KV is no longer the exact prefill */
    int32_t n_ranges;
    lethe_prune_range_result ranges[LETHE_PRUNE_MAX_RANGES];
    char message[256]; /* why blocked / failed */
} lethe_prune_result;

/* Checks and merges the ranges without an engine (what the HTTP layer asks
 * first): LETHE_ERR_INVALID with a message naming the offending range or
 * number (lethe_engine_last_error). merged may be NULL. */
int lethe_prune_validate(const lethe_prune_params *p, lethe_prune_range *merged, int32_t *n_merged);
/* Runs a prune job to its end (threaded mode: waits for the engine thread). */
int lethe_engine_prune(lethe_engine *e, const lethe_prune_params *p, lethe_prune_result *out);
/* Queues it: validation errors come back at once; `done` runs on the engine
 * thread with the final result (and must not call into the engine). */
typedef void (*lethe_prune_cb)(void *user, const lethe_prune_result *r);
int lethe_engine_prune_submit(lethe_engine *e, const lethe_prune_params *p, lethe_prune_cb done,
                              void *user, uint32_t *prune_id);

/* Token ids are in [0, vocab size). */
int32_t lethe_engine_vocab_size(const lethe_engine *e);

/* POST /v1/prefix_cache/match: how much of a prompt the radix cache holds. */
typedef struct lethe_prefix_match {
    bool enabled; /* the radix cache is active (else every count is 0) */
    int32_t block_size;
    int32_t prompt_tokens;
    int32_t usable_tokens;  /* floor((prompt - 1) / 16) * 16: one token is always computed */
    int32_t matched_tokens; /* logical tokens of the cached blocks (<= usable) */
    int32_t matched_blocks;
    int32_t resident_kv_tokens; /* slots they hold per space (< matched once pruned) */
    int32_t live_blocks;        /* blocks in the whole cache */
    uint64_t last_block_id;     /* 0 when nothing matched */
} lethe_prefix_match;
int lethe_engine_prefix_match(lethe_engine *e, const int32_t *tokens, int32_t n,
                              lethe_prefix_match *out);

typedef struct lethe_prefix_block {
    uint64_t id, parent_id; /* parent_id 0 for a first block */
    int32_t start;          /* first token: 16 * depth */
    int32_t resident;       /* slots it holds (16 unless pruned) */
    int32_t req_refs, n_children;
    int32_t priority;  /* eviction priority: lower first; < 0 pinned */
    uint32_t prune_id; /* 0: never pruned */
} lethe_prefix_block;
/* The cached blocks of the path tokens[0..n) (root first), or with tokens
 * NULL every block (by depth, then id); copies up to cap, returns how many
 * there are (-1: no radix cache). */
int32_t lethe_engine_prefix_inspect(lethe_engine *e, const int32_t *tokens, int32_t n,
                                    lethe_prefix_block *out, int32_t cap);
/* Deletes the block ending the path's full blocks (floor(n / 16) of them,
 * all cached) and every block below it. LETHE_ERR_NOT_FOUND (not cached),
 * LETHE_ERR_BUSY (a running request holds one), LETHE_ERR_UNSUPPORTED (no
 * radix cache). */
int lethe_engine_prefix_delete_subtree(lethe_engine *e, const int32_t *tokens, int32_t n,
                                       int32_t *n_deleted);
/* Sets the eviction priority of every cached block of the path's full
 * blocks (negative = pinned: never evicted, only deleted). */
int lethe_engine_prefix_set_priority(lethe_engine *e, const int32_t *tokens, int32_t n,
                                     int32_t priority, int32_t *n_blocks);

#ifdef __cplusplus
}
#endif

#endif /* LETHE_H */

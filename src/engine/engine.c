/* engine.c - the engine object: construction around a runner, requests
 * (validation, copies, the id table, finishing), stats, destroy.
 *
 * Construction order (lethe_engine_create_with):
 *   limits -> sparse method (its flags choose the row layout) -> forward
 *   workspace -> forward path (engine_forward.c: uniform plan, graphs,
 *   padding) -> KV pool sized from the budget, plus the padding scratch slot
 *   (handed to the method) ->
 *   runner bind ->
 *   prefix cache (src/cache picks radix, chain or off) -> scheduler -> sampler
 *   scratch -> inbox.
 * KV sizing: slots per layer = budget / (bytes one token costs in all layers),
 * capped at max_num_seqs x max_model_len (more could never be used by running
 * requests; small models would otherwise reserve a whole GiB for nothing),
 * and at least max_model_len, or create fails naming both flags. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/host_tier.h"
#include "core/env.h"
#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"
#include "grammar/grammar.h"

#define ENG_QUEUE_CAP 4096
#define ENG_DEFAULT_KV_BYTES ((size_t)1 << 30)
#define ENG_MAX_SNAPSHOTS 65536 /* hybrid models: state snapshots the radix cache may hold */

void lethe_sampling_default_params(lethe_sampling_params *p) {
    memset(p, 0, sizeof(*p));
    p->temperature = 1.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
    p->max_tokens = -1;
    p->logprobs = -1;
}

void lethe_engine_default_params(lethe_engine_params *p) {
    memset(p, 0, sizeof(*p));
    p->load_format = "auto";
    p->device = "cpu";
    p->max_num_seqs = 256;
    p->max_num_batched_tokens = 2048;
    p->gpu_memory_utilization = 0.9f;
    p->enable_prefix_caching = true;
    p->sparse_method = "dense";
    p->prefix_cache_mode = "auto";
}

const char *lethe_engine_last_error(void) { return lethe_last_error(); }

static char *dup_or_null(const char *s) { return s ? lethe_xstrdup(s) : NULL; }

static const char *base_name(const char *path) {
    if (!path || !*path) return "model";
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t i = n;
    while (i > 0 && path[i - 1] != '/') i--;
    static _Thread_local char buf[256];
    snprintf(buf, sizeof(buf), "%.*s", (int)(n - i), path + i);
    return buf;
}

/* ---- construction ---- */

/* A method that cannot apply to the model's KV refuses before it is created,
 * naming both: latent KV (one row of latent + RoPE key per token, no V: the
 * model's payload) has no per-head K / V for the quantization methods (KIVI's
 * per-channel key groups, FP8's per-head scales), no per-KV-head rows, nor a
 * place for a compression method's own payload; and a device backend's
 * score / page kernels take head_dim <= LETHE_SCORES_HEAD_DIM_MAX. */
static lethe_status eng_check_kv_layout(lethe_engine *e) {
    const lethe_model_config *c = &e->runner.cfg;
    const lethe_sparse_ops *ops = lethe_sparse_find_kv(e->sparse_method); /* a pair: its decode method */
    if (!lethe_kv_k_only(c) || !ops) return LETHE_OK; /* unknown names: lethe_sparse_create says */
    const char *model = e->model_path ? e->model_path : c->arch;
    if (ops->kind == LETHE_SPARSE_KIND_QUANTIZATION || ops->kind == LETHE_SPARSE_KIND_COMPRESSION ||
        ops->kv_layout)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "model %s (%s, latent KV: one %d-wide row per token, no V) cannot use "
                            "method %s: it %s separate K and V heads",
                            model, c->arch, c->head_dim, ops->name,
                            ops->kind == LETHE_SPARSE_KIND_QUANTIZATION ? "quantizes"
                            : ops->kind == LETHE_SPARSE_KIND_COMPRESSION
                                ? "compresses"
                                : "attends through its own payload of");
    if (ops->flags & LETHE_SPARSE_HEAD_ROWS)
        return lethe_errorf(
            LETHE_ERR_UNSUPPORTED,
            "model %s (%s, latent KV: one %d-wide row per token shared by all heads) "
            "cannot use method %s: it keeps per-KV-head rows",
            model, c->arch, c->head_dim, ops->name);
    const bool scores = ops->needs_scores || ops->select_layer;
    if (scores && !lethe_backend_has(e->runner.be, LETHE_BE_HOST_MEMORY) &&
        c->head_dim > LETHE_SCORES_HEAD_DIM_MAX)
        return lethe_errorf(
            LETHE_ERR_UNSUPPORTED,
            "model %s (%s, latent KV of head_dim %d) cannot use method %s on the %s "
            "backend: its score kernels take head_dim <= %d",
            model, c->arch, c->head_dim, ops->name, e->runner.be->ops->name,
            LETHE_SCORES_HEAD_DIM_MAX);
    return LETHE_OK;
}

/* Bytes of every request's states (hybrid models: recurrent + conv state in
 * each linear-attention layer, one state slot per running request plus the
 * padding scratch one), taken off the KV budget before token slots. */
size_t eng_state_bytes(const lethe_engine *e, int32_t n_state_slots) {
    const lethe_model_config *c = &e->runner.cfg;
    return (size_t)c->n_linear_layers * (size_t)n_state_slots * lethe_lin_state_bytes(c);
}

static lethe_status size_pool(lethe_engine *e, int32_t *n_slots) {
    const lethe_model_config *c = &e->runner.cfg;
    size_t kv_size = e->runner.be ? e->runner.be->ops->kv_size : sizeof(float);
    /* layers with KV: linear-attention layers keep states, no token slots */
    const int32_t kv_layers = c->n_layers - c->n_linear_layers;
    /* real bytes per token of the method's storage format (quantized KV: more slots),
     * plus what the method keeps per slot (Quest's page bounds) */
    size_t tok_bytes = (e->kv_layouts ? lethe_kv_layouts_token_bytes(e->kv_layouts, kv_layers)
                                      : lethe_kv_token_bytes(kv_layers, c->n_kv_heads, c->head_dim, kv_size,
                                                             lethe_sparse_kv_format(e->method))) +
                       lethe_sparse_slot_overhead(e->method);
    size_t budget;
    /* device memory: the pool takes a share of what is free; host memory (and
     * the fake runner): the configured KV budget */
    const lethe_backend *be = e->runner.be;
    bool device_mem = be && !lethe_backend_has(be, LETHE_BE_HOST_MEMORY) && be->ops->free_memory &&
                      be->ops->free_memory(e->runner.be) > 0;
    if (device_mem) {
        budget = (size_t)((double)e->runner.be->ops->free_memory(e->runner.be) * e->p.gpu_memory_utilization);
        /* kv_cache_bytes also caps a device pool: a fixed capacity whatever the
         * device's memory (benchmark presets) */
        if (e->p.kv_cache_bytes && e->p.kv_cache_bytes < budget) budget = e->p.kv_cache_bytes;
    } else {
        budget = e->p.kv_cache_bytes ? e->p.kv_cache_bytes : ENG_DEFAULT_KV_BYTES;
    }
    /* KIVI keeps a full-precision residual block (G tokens) per running request:
     * a fixed share of at most 1/8 of the budget, and at most max_num_seqs blocks;
     * the scheduler then runs at most that many requests at once */
    const lethe_kv_format fmt = lethe_sparse_kv_format(e->method);
    if (lethe_kv_format_kind(fmt) == LETHE_KV_KIVI) {
        size_t blk = lethe_kv_kivi_res_bytes(kv_layers, c->n_kv_heads, c->head_dim, kv_size, fmt, 1);
        int64_t nb = (int64_t)(budget / 8 / blk);
        if (nb > e->p.max_num_seqs) nb = e->p.max_num_seqs;
        if (nb < 1) nb = 1;
        e->kivi_res_blocks = (int32_t)nb;
        if (nb < e->p.max_num_seqs) {
            LOG_INFO("engine: kivi residual for %lld running requests (max_num_seqs %d lowered)", (long long)nb,
                     e->p.max_num_seqs);
            e->p.max_num_seqs = (int32_t)nb;
        }
        budget = budget > blk * (size_t)nb ? budget - blk * (size_t)nb : 0;
    }
    /* what the method keeps for the running requests besides its slots
     * (DeltaKV's raw sink + buffer rows, RetroInfer's cluster ring): at most a quarter of the budget,
     * max_num_seqs lowered to fit, as KIVI's residual above */
    if (lethe_sparse_kv_reserve(e->method, 1, e->p.max_num_batched_tokens)) {
        const size_t base = lethe_sparse_kv_reserve(e->method, 0, e->p.max_num_batched_tokens);
        const size_t per = lethe_sparse_kv_reserve(e->method, 1, e->p.max_num_batched_tokens) - base;
        /* a fixed reserve (per 0: RetroInfer's cluster ring) does not limit the requests */
        int64_t nb = 0;
        if (budget / 4 > base) nb = per ? (int64_t)((budget / 4 - base) / per) : e->p.max_num_seqs;
        if (nb > e->p.max_num_seqs) nb = e->p.max_num_seqs;
        if (nb < 1)
            return lethe_errorf(LETHE_ERR_CAPACITY,
                                "KV cache budget of %zu bytes: method %s needs %zu bytes for one running request "
                                "and a step of %d tokens, more than a quarter of it (raise the budget or lower "
                                "--max-num-batched-tokens)",
                                budget, e->method->ops->name, base + per, e->p.max_num_batched_tokens);
        if (nb < e->p.max_num_seqs) {
            LOG_INFO("engine: %s raw buffers for %lld running requests (max_num_seqs %d lowered)",
                     e->method->ops->name, (long long)nb, e->p.max_num_seqs);
            e->p.max_num_seqs = (int32_t)nb;
        }
        const size_t reserve = lethe_sparse_kv_reserve(e->method, e->p.max_num_seqs, e->p.max_num_batched_tokens);
        LOG_INFO("engine: %s reserves %zu bytes for %d running requests", e->method->ops->name, reserve,
                 e->p.max_num_seqs);
        budget -= reserve;
        e->kv_reserve = reserve;
    }
    if (c->n_linear_layers > 0 && e->cache_states) {
        /* the prefix cache's state slots (engine_hybrid.c): radix snapshots, idle chains */
        const size_t one = eng_state_bytes(e, 1);
        const size_t want = e->p.state_snapshot_bytes ? e->p.state_snapshot_bytes : budget / 8;
        e->n_snap_slots = (int32_t)LETHE_MIN((int64_t)(want / one), (int64_t)ENG_MAX_SNAPSHOTS);
        e->n_state_slots += e->n_snap_slots;
        if (e->n_snap_slots == 0)
            LOG_WARN("engine: states of %.1f MB do not fit in %zu bytes (--state-snapshot-bytes): no "
                     "prefix hits or resident chains for hybrid model %s", (double)one / 1e6, want, c->arch);
    }
    if (c->n_linear_layers > 0) {
        const size_t sb = eng_state_bytes(e, e->n_state_slots);
        if (sb >= budget)
            return lethe_errorf(LETHE_ERR_CAPACITY,
                                "the recurrent states of %d requests and %d snapshots (%d linear-attention layers, "
                                "%.1f MB each) need %.1f MB, more than the KV budget of %.1f MB: lower "
                                "--max-num-seqs or --state-snapshot-bytes, or raise --kv-cache-bytes%s",
                                e->p.max_num_seqs, e->n_snap_slots, c->n_linear_layers,
                                (double)eng_state_bytes(e, 1) / 1e6, (double)sb / 1e6, (double)budget / 1e6,
                                device_mem ? " / --gpu-memory-utilization" : "");
        budget -= sb;
    }
    int64_t slots = (int64_t)(budget / tok_bytes);
    int64_t cap = (int64_t)e->p.max_num_seqs * e->max_model_len;
    if (slots > cap) slots = cap;
    if (slots > INT32_MAX / 2) slots = INT32_MAX / 2;
    /* one request of max_model_len tokens must fit alone (an evicting method
     * may bound what a layer keeps below that: max_resident) */
    int32_t need = 0;
    for (int32_t l = 0; l < kv_layers; l++)
        need = LETHE_MAX(need, lethe_sparse_max_resident(e->method, l, e->max_model_len - 1, e->max_model_len,
                                                         e->p.max_num_batched_tokens));
    need = LETHE_MIN(need, e->max_model_len);
    if (slots < need)
        return lethe_errorf(LETHE_ERR_CAPACITY,
                            "KV cache budget of %zu bytes holds %lld tokens (%zu bytes each over %d layers), "
                            "fewer than the %d one request of max_model_len %d needs: raise --kv-cache-bytes%s "
                            "or lower --max-model-len",
                            budget, (long long)slots, tok_bytes, kv_layers, need, e->max_model_len,
                            device_mem ? " / --gpu-memory-utilization" : "");
    *n_slots = (int32_t)slots;
    return LETHE_OK;
}

int lethe_engine_create_with(const lethe_engine_params *pin, lethe_runner *runner,
                             lethe_tokenizer *tok, lethe_engine **out) {
    *out = NULL;
    lethe_engine *e = lethe_xcalloc(1, sizeof(*e));
    e->p = *pin;
    e->model_path = dup_or_null(pin->model);
    e->model_name = lethe_xstrdup(base_name(pin->model ? pin->model : runner->kind));
    e->sparse_method = lethe_xstrdup(pin->sparse_method ? pin->sparse_method : "dense");
    e->sparse_config = dup_or_null(pin->sparse_config);
    e->load_format = dup_or_null(pin->load_format);
    e->device = dup_or_null(pin->device);
    e->p.model = e->model_path;
    e->p.sparse_method = e->sparse_method;
    e->p.sparse_config = e->sparse_config;
    e->p.load_format = e->load_format;
    e->p.device = e->device;
    e->runner = *runner;
    memset(runner, 0, sizeof(*runner));
    e->tok = tok;
    pthread_mutex_init(&e->stats.mu, NULL);
    pthread_mutex_init(&e->gram.mu, NULL);
    lethe_queue_init(&e->thr.inbox, ENG_QUEUE_CAP);
    atomic_init(&e->reqs.next_id, 1);
    atomic_init(&e->thr.stop, false);
    lethe_status st = LETHE_OK;
    const lethe_model_config *c = &e->runner.cfg;
    const lethe_sparse_ops *ops = NULL;
    int32_t n_slots = 0;

    if (e->p.max_num_seqs < 1 || e->p.max_num_batched_tokens < 1) {
        st = lethe_errorf(LETHE_ERR_INVALID, "--max-num-seqs %d / --max-num-batched-tokens %d: must be >= 1",
                          e->p.max_num_seqs, e->p.max_num_batched_tokens);
        goto fail;
    }
    if (e->p.max_model_len < 0 || e->p.max_model_len > c->max_pos) {
        st = lethe_errorf(LETHE_ERR_INVALID, "--max-model-len %d: must be in [1, %d] (the model's context length)",
                          e->p.max_model_len, c->max_pos);
        goto fail;
    }
    e->max_model_len = e->p.max_model_len ? e->p.max_model_len : c->max_pos;
    e->n_vocab = c->n_vocab;
    if (e->max_model_len < 2) {
        st = lethe_errorf(LETHE_ERR_INVALID, "max_model_len %d: must be at least 2", e->max_model_len);
        goto fail;
    }
    /* the method first (its flags choose the row layout, its max_resident
     * bounds the pool), then the pool it will use */
    /* hybrid models: the method sees the KV (full-attention) layers only,
     * numbered 0 .. kv_layers-1 in model order, like the pool and the hooks */
    const int32_t kv_layers = c->n_layers - c->n_linear_layers;
    lethe_sparse_env env = {.pool = NULL, .be = e->runner.be, .n_layers = kv_layers,
                            .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                            .max_model_len = e->max_model_len, .dim = c->dim, .rope = &c->rope,
                            .model = lethe_runner_model_of(&e->runner), .tok = e->tok,
                            .aux_prefill = eng_aux_prefill, .aux_ctx = e,
                            .max_aux_tokens = e->p.max_num_batched_tokens};
    if ((st = eng_check_kv_layout(e)) != LETHE_OK) goto fail;
    /* hybrid models: refusals before the method is built (palu's set-up reads
     * the output projections of the attention layers it is given) */
    if (c->n_linear_layers > 0 && (st = eng_check_hybrid(e)) != LETHE_OK) goto fail;
    if ((st = lethe_sparse_create(e->sparse_method, e->sparse_config, &env, &e->method)) != LETHE_OK) goto fail;
    ops = e->method->ops;
    if (lethe_sparse_min_final_chunk(e->method) > e->p.max_num_batched_tokens) {
        st = lethe_errorf(LETHE_ERR_INVALID,
                          "method %s needs final prompt chunks of %d tokens but --max-num-batched-tokens is %d",
                          ops->name, lethe_sparse_min_final_chunk(e->method), e->p.max_num_batched_tokens);
        goto fail;
    }
    eng_forward_init(e); /* uniform plan? graphs? padding (needs the scratch slot)? */
    if ((st = eng_diag_init(e)) != LETHE_OK) goto fail; /* LETHE_STEP_TIMES, LETHE_PROFILE_STEP */
    if ((st = eng_seldump_init(e)) != LETHE_OK) goto fail; /* LETHE_DUMP_SELECTIONS */
    int64_t fault_token = 0;
    if ((st = lethe_env_uint(LETHE_ENV_FAULT_TOKEN, &fault_token)) != LETHE_OK) goto fail;
    e->runner.fault_token = (int32_t)LETHE_MIN(fault_token, (int64_t)INT32_MAX);
    /* device logits rows: every logits row of a step, padded decode steps included */
    if (e->runner.workspace &&
        (st = e->runner.workspace(e->runner.ctx, e->p.max_num_batched_tokens,
                                  LETHE_MAX(LETHE_MIN(e->p.max_num_seqs, e->p.max_num_batched_tokens),
                                            e->fwd.max_bucket))) != LETHE_OK)
        goto fail;
    /* the method's own payload (COMPRESSION methods), sized by its real bytes */
    e->kv_layouts = lethe_xcalloc((size_t)kv_layers, sizeof(lethe_kv_layout));
    if (lethe_kv_k_only(c)) {
        /* or the model's: latent attention keeps one plane per layer, the
         * latent + RoPE key row (model/config.h), read by its forward */
        const size_t kv_size = e->runner.be ? e->runner.be->ops->kv_size : sizeof(float);
        for (int32_t l = 0; l < kv_layers; l++) {
            lethe_kv_layout *L = &e->kv_layouts[l];
            L->n_planes = 1;
            snprintf(L->planes[0].name, sizeof(L->planes[0].name), "latent");
            L->planes[0].slot_bytes = (size_t)c->n_kv_heads * c->head_dim * kv_size;
        }
    } else if (!lethe_sparse_kv_layouts(e->method, e->kv_layouts)) {
        free(e->kv_layouts);
        e->kv_layouts = NULL;
    }
    const bool scratch = e->fwd.max_bucket > 0;
    if (c->n_linear_layers > 0) {
        /* one per running request, one spare for the auxiliary prefill's copy
         * (engine_forward.c eng_aux_prefill) */
        e->n_state_slots = e->p.max_num_seqs + 1 + scratch;
    }
    if ((st = size_pool(e, &n_slots)) != LETHE_OK) goto fail;
    lethe_kv_pool_params pp = {
        .n_layers = kv_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
        .n_slots = n_slots + scratch, .per_layer = (ops->flags & LETHE_SPARSE_PER_LAYER_ROWS) != 0,
        .page_meta_floats = (ops->flags & LETHE_SPARSE_PAGE_META) ? ops->page_meta_floats : 0,
        .be = e->runner.be, .format = lethe_sparse_kv_format(e->method), .scratch_slot = scratch,
        .kivi_res_blocks = e->kivi_res_blocks, .layouts = e->kv_layouts,
        .head_masks = (ops->flags & LETHE_SPARSE_HEAD_ROWS) != 0,
        .n_state_layers = c->n_linear_layers,
        .state_k_bytes = lethe_model_state_rec_bytes(c, 1),
        .state_v_bytes = lethe_model_state_conv_bytes(c, 1),
        .n_state_slots = e->n_state_slots,
    };
    if ((st = lethe_kv_pool_create(&pp, &e->pool)) != LETHE_OK) goto fail;
    e->method->env.pool = e->pool;
    if ((st = e->runner.bind(e->runner.ctx, e->pool, e->p.max_num_batched_tokens)) != LETHE_OK) goto fail;
    if ((st = eng_cache_init(e)) != LETHE_OK) goto fail;
    lethe_sched_params sp = {.max_num_seqs = e->p.max_num_seqs,
                             .max_num_batched_tokens = e->p.max_num_batched_tokens,
                             .split_prefill_decode = e->p.split_prefill_decode,
                             .chunk_align = c->n_linear_layers > 0 ? LETHE_GDN_CHUNK : 0};
    e->sched = lethe_sched_create(&sp, e->pool, e->pcache, e->method);
    if ((st = lethe_sampler_ws_init(&e->sws, e->n_vocab)) != LETHE_OK) goto fail;
    /* padded decode steps produce max_bucket logits rows (engine_forward.c) */
    e->step.cap_logits = LETHE_MAX(LETHE_MIN(e->p.max_num_seqs, e->p.max_num_batched_tokens), e->fwd.max_bucket);
    /* sampling on the backend unless LETHE_SAMPLE_ON_HOST=1 */
    if ((st = eng_sample_init(e)) != LETHE_OK) goto fail;
    e->step.logits = malloc((size_t)e->step.cap_logits * (size_t)e->n_vocab * sizeof(float));
    if (!e->step.logits) {
        st = lethe_errorf(LETHE_ERR_NOMEM, "engine: logits buffer for %d sequences x %d vocab", e->step.cap_logits,
                          e->n_vocab);
        goto fail;
    }
    /* written once now with a host backend (lethe_model_ws_alloc says why): sized for the
     * most sequences a step samples, it would join the RSS row by row as steps get wider */
    if (e->runner.be && (e->runner.be->ops->caps & LETHE_BE_HOST_MEMORY))
        memset(e->step.logits, 0, (size_t)e->step.cap_logits * (size_t)e->n_vocab * sizeof(float));
    eng_forward_bind(e);
    if (e->tok) {
        e->step.detok_cap = 3 * (lethe_tokenizer_max_token_bytes(e->tok) + 4) + 1;
        e->step.detok_buf = lethe_xmalloc(e->step.detok_cap);
    }
    e->reqs.n_buckets = 1024;
    e->reqs.buckets = lethe_xcalloc(e->reqs.n_buckets, sizeof(*e->reqs.buckets));
    e->stats.cur.kv_slots_total = (int64_t)n_slots * lethe_kv_n_spaces(e->pool); /* without the scratch slot */
    e->stats.n_spaces = lethe_kv_n_spaces(e->pool);
    e->stats.spaces = lethe_xcalloc((size_t)e->stats.n_spaces, sizeof(*e->stats.spaces));
    eng_publish_stats(e);
    if (c->n_linear_layers > 0)
        LOG_INFO("engine: %d of %d layers are linear attention: no KV, %d state slots of %.1f MB (%.1f MB; "
                 "%d for the %s prefix cache; radix snapshots every %d tokens)",
                 c->n_linear_layers, c->n_layers, e->n_state_slots, (double)eng_state_bytes(e, 1) / 1e6,
                 (double)eng_state_bytes(e, e->n_state_slots) / 1e6, e->n_snap_slots,
                 lethe_pcache_mode(e->pcache), e->snap_every);
    LOG_INFO("engine: %s, %d layers, KV %d slots per layer (%s rows, %s), max_model_len %d, method %s%s%s%s",
             e->model_name, c->n_layers, n_slots, pp.per_layer ? "per-layer" : "shared",
             e->kv_layouts ? ops->name : lethe_kv_format_name(pp.format), e->max_model_len,
             ops->name, e->pcache ? ", prefix cache " : "", e->pcache ? lethe_pcache_mode(e->pcache) : "",
             e->fwd.use_graphs ? ", CUDA-graph decode" : e->fwd.max_bucket ? ", padded decode" : "");
    *out = e;
    return LETHE_OK;
fail:
    lethe_engine_destroy(e);
    return st;
}

/* ---- id table ---- */

static uint64_t bucket(const lethe_engine *e, uint64_t id) {
    return (id * 0x9e3779b97f4a7c15ull >> 17) & (e->reqs.n_buckets - 1);
}

eng_req *eng_find(lethe_engine *e, uint64_t id) {
    for (eng_req *q = e->reqs.buckets[bucket(e, id)]; q; q = q->hnext)
        if (q->r.id == id) return q;
    return NULL;
}

static void table_remove(lethe_engine *e, eng_req *q) {
    eng_req **p = &e->reqs.buckets[bucket(e, q->r.id)];
    while (*p && *p != q) p = &(*p)->hnext;
    LETHE_ASSERT(*p == q);
    *p = q->hnext;
    e->reqs.n_live--;
}

/* ---- requests ---- */

lethe_status eng_validate(const lethe_engine *e, const lethe_request_params *p) {
    if (!p || !p->prompt || p->n_prompt < 1)
        return lethe_errorf(LETHE_ERR_INVALID, "request: the prompt is empty (at least one token is needed)");
    if (p->n_prompt + 1 > e->max_model_len)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "request: the prompt has %d tokens but max_model_len is %d (the prompt plus at "
                            "least one generated token must fit)", p->n_prompt, e->max_model_len);
    for (int32_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= e->n_vocab)
            return lethe_errorf(LETHE_ERR_INVALID, "request: prompt token %d at index %d is outside the vocabulary [0, %d)",
                                p->prompt[i], i, e->n_vocab);
    lethe_status st = lethe_sampling_params_check(&p->sampling, e->n_vocab);
    if (st != LETHE_OK) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", lethe_last_error());
        return lethe_errorf(st, "request: %s", msg);
    }
    if (p->sampling.max_tokens == 0 || p->sampling.max_tokens < -1)
        return lethe_errorf(LETHE_ERR_INVALID, "request: max_tokens %d: must be >= 1 (or -1 for no limit)",
                            p->sampling.max_tokens);
    if (p->sampling.n_stop_token_ids < 0 || p->sampling.n_stop_token_ids > LETHE_MAX_STOP)
        return lethe_errorf(LETHE_ERR_INVALID, "request: n_stop_token_ids %d outside [0, %d]",
                            p->sampling.n_stop_token_ids, LETHE_MAX_STOP);
    for (int32_t i = 0; i < p->sampling.n_stop_token_ids; i++)
        if (p->sampling.stop_token_ids[i] < 0 || p->sampling.stop_token_ids[i] >= e->n_vocab)
            return lethe_errorf(LETHE_ERR_INVALID, "request: stop_token_ids[%d] = %d is outside the vocabulary",
                                i, p->sampling.stop_token_ids[i]);
    for (int i = 0; i < LETHE_MAX_STOP && p->sampling.stop[i]; i++) {
        if (!e->tok)
            return lethe_errorf(LETHE_ERR_INVALID, "request: stop strings need a tokenizer; this model has none "
                                                   "(use stop_token_ids)");
        if (!p->sampling.stop[i][0]) return lethe_errorf(LETHE_ERR_INVALID, "request: stop string %d is empty", i);
    }
    if (p->grammar && (p->n_forced > 0 || p->sampling.ignore_eos))
        return lethe_errorf(LETHE_ERR_INVALID, "request: a grammar (structured output) cannot be combined with %s",
                            p->n_forced > 0 ? "forced tokens" : "ignore_eos");
    if (p->n_forced < 0 || (p->n_forced > 0 && !p->forced))
        return lethe_errorf(LETHE_ERR_INVALID, "request: forced output: %d tokens but no array", p->n_forced);
    for (int32_t i = 0; i < p->n_forced; i++)
        if (p->forced[i] < 0 || p->forced[i] >= e->n_vocab)
            return lethe_errorf(LETHE_ERR_INVALID, "request: forced token %d at index %d is outside the vocabulary",
                                p->forced[i], i);
    if (p->n_pinned < 0 || p->n_pinned > 4096 || (p->n_pinned > 0 && !p->pinned) ||
        p->n_prunable < 0 || p->n_prunable > 4096 || (p->n_prunable > 0 && !p->prunable))
        return lethe_errorf(LETHE_ERR_INVALID,
                            "request: retention ranges: %d pinned, %d prunable (at most 4096 each)",
                            p->n_pinned, p->n_prunable);
    for (int32_t i = 0; i < p->n_pinned + p->n_prunable; i++) {
        const bool pin = i < p->n_pinned;
        const int32_t a = pin ? p->pinned[i].start : p->prunable[i - p->n_pinned].start;
        const int32_t b = pin ? p->pinned[i].end : p->prunable[i - p->n_pinned].end;
        if (a < 0 || a >= b || b > p->n_prompt)
            return lethe_errorf(
                LETHE_ERR_INVALID,
                "request: %s range [%d, %d) is empty or outside the %d-token prompt",
                pin ? "pinned" : "prunable", a, b, p->n_prompt);
        if (!pin && !(p->prunable[i - p->n_pinned].keep_ratio >= 0 &&
                      p->prunable[i - p->n_pinned].keep_ratio <= 1))
            return lethe_errorf(LETHE_ERR_INVALID,
                                "request: prunable range [%d, %d): keep_ratio outside [0, 1]", a,
                                b);
    }
    return LETHE_OK;
}

eng_req *eng_req_new(lethe_engine *e, const lethe_request_params *p) {
    eng_req *q = lethe_xcalloc(1, sizeof(*q));
    q->r.id = atomic_fetch_add(&e->reqs.next_id, 1);
    q->r.row = -1;
    q->r.cap_tokens = p->n_prompt + 16;
    q->r.tokens = lethe_xmalloc((size_t)q->r.cap_tokens * sizeof(int32_t));
    memcpy(q->r.tokens, p->prompt, (size_t)p->n_prompt * sizeof(int32_t));
    q->r.n_tokens = q->r.n_prompt = p->n_prompt;
    q->sp = p->sampling;
    int32_t ns = 0;
    for (int i = 0; i < LETHE_MAX_STOP && p->sampling.stop[i]; i++) q->stop_copy[ns++] = lethe_xstrdup(p->sampling.stop[i]);
    for (int i = 0; i < LETHE_MAX_STOP; i++) q->sp.stop[i] = i < ns ? q->stop_copy[i] : NULL;
    for (int i = 0; i <= LETHE_MAX_STOP; i++) q->stop_list[i] = i < ns ? q->stop_copy[i] : NULL;
    q->cb = p->cb;
    q->user = p->user;
    if (p->n_forced > 0) {
        q->forced = lethe_xmalloc((size_t)p->n_forced * sizeof(int32_t));
        memcpy(q->forced, p->forced, (size_t)p->n_forced * sizeof(int32_t));
        q->n_forced = p->n_forced;
    }
    q->want_logits = p->want_logits;
    if (p->n_pinned > 0) {
        q->r.pinned = lethe_xmalloc((size_t)p->n_pinned * 2 * sizeof(int32_t));
        for (int32_t i = 0; i < p->n_pinned; i++) {
            q->r.pinned[2 * i] = p->pinned[i].start;
            q->r.pinned[2 * i + 1] = p->pinned[i].end;
        }
        q->r.n_pinned = p->n_pinned;
    }
    if (p->n_prunable > 0) {
        q->prunable = lethe_xmalloc((size_t)p->n_prunable * sizeof(*q->prunable));
        memcpy(q->prunable, p->prunable, (size_t)p->n_prunable * sizeof(*q->prunable));
        q->n_prunable = p->n_prunable;
    }
    if (p->grammar) {
        lethe_status gs = lethe_gmatcher_create(p->grammar, &q->gm);
        LETHE_ASSERT(gs == LETHE_OK && "a grammar matcher (allocation)");
    }
    int64_t limit = e->max_model_len;
    if (q->n_forced > 0) limit = LETHE_MIN(limit, (int64_t)p->n_prompt + q->n_forced);
    else if (p->sampling.max_tokens > 0) limit = LETHE_MIN(limit, (int64_t)p->n_prompt + p->sampling.max_tokens);
    q->max_total = (int32_t)limit;
    uint64_t seed = p->sampling.has_seed ? p->sampling.seed : lethe_hash64(&q->r.id, sizeof(q->r.id), e->p.seed ^ 0x5a3bull);
    lethe_rng_seed(&q->rng, seed);
    if (e->tok) lethe_detok_init(&q->detok, e->tok, true);
    lethe_stopstr_init(&q->stop, q->stop_list);
    q->t_submit = lethe_time_s();
    return q;
}

void eng_req_free(eng_req *q) {
    if (!q) return;
    LETHE_ASSERT(!q->r.cache_ref); /* released by the scheduler or cancelled */
    free(q->r.tokens);
    for (int i = 0; i < LETHE_MAX_STOP; i++) free(q->stop_copy[i]);
    free(q->forced);
    free(q->r.pinned);
    free(q->prunable);
    lethe_gmatcher_free(q->gm);
    lethe_stopstr_free(&q->stop);
    free(q);
}

void eng_admit(lethe_engine *e, eng_req *q) {
    if ((uint64_t)e->reqs.n_live + 1 > e->reqs.n_buckets) { /* grow the id table */
        uint64_t nb = e->reqs.n_buckets * 2;
        eng_req **old = e->reqs.buckets;
        uint64_t ob = e->reqs.n_buckets;
        e->reqs.buckets = lethe_xcalloc(nb, sizeof(*e->reqs.buckets));
        e->reqs.n_buckets = nb;
        for (uint64_t i = 0; i < ob; i++)
            for (eng_req *x = old[i], *next; x; x = next) {
                next = x->hnext;
                uint64_t b = bucket(e, x->r.id);
                x->hnext = e->reqs.buckets[b];
                e->reqs.buckets[b] = x;
            }
        free(old);
    }
    uint64_t b = bucket(e, q->r.id);
    q->hnext = e->reqs.buckets[b];
    e->reqs.buckets[b] = q;
    e->reqs.n_live++;
    e->stats.cur.prompt_tokens_total += q->r.n_prompt;
    lethe_sched_add(e->sched, &q->r);
}

/* Final event without a token (abort, error), then the request is gone. */
static void finish(lethe_engine *e, eng_req *q, lethe_finish_reason why, const char *error,
                   bool internal) {
    lethe_event ev = {0};
    ev.request_id = q->r.id;
    ev.text = "";
    ev.finished = true;
    ev.finish_reason = why;
    ev.error = error;
    ev.error_internal = internal;
    ev.prompt_tokens = q->r.n_prompt;
    ev.completion_tokens = q->r.n_tokens - q->r.n_prompt;
    ev.cached_tokens = q->r.cached_tokens;
    ev.ttft_s = q->has_ttft ? q->ttft : 0.0;
    eng_retire(e, q, false);
    if (q->cb) q->cb(q->user, &ev);
    eng_req_free(q);
}

void eng_finish(lethe_engine *e, eng_req *q, lethe_finish_reason why, const char *error) {
    finish(e, q, why, error, false);
}

void eng_fail_internal(lethe_engine *e, eng_req *q, const char *error) {
    finish(e, q, LETHE_FINISH_ERROR, error, true);
}

/* Out of the scheduler (KV freed) and the id table; the caller frees q. */
void eng_retire(lethe_engine *e, eng_req *q, bool ok) {
    if (q->r.state != LETHE_REQ_FINISHED) lethe_sched_remove(e->sched, &q->r, ok);
    if (ok && q->n_prunable > 0) eng_prune_hints(e, q); /* its blocks are unreferenced now */
    table_remove(e, q);
    e->stats.cur.n_requests_finished++;
}

/* ---- synchronous API ---- */

int lethe_engine_add_request(lethe_engine *e, const lethe_request_params *p, uint64_t *id_out) {
    lethe_status st = eng_validate(e, p);
    if (st != LETHE_OK) return st;
    eng_req *q = eng_req_new(e, p);
    if (id_out) *id_out = q->r.id;
    eng_admit(e, q);
    return LETHE_OK;
}

int lethe_engine_abort(lethe_engine *e, uint64_t id) {
    if (e->thr.running) { /* the engine thread owns the requests: go through its inbox */
        lethe_engine_cancel(e, id);
        return LETHE_OK;
    }
    eng_req *q = eng_find(e, id);
    if (!q) return lethe_errorf(LETHE_ERR_NOT_FOUND, "abort: no live request %llu", (unsigned long long)id);
    eng_finish(e, q, LETHE_FINISH_ABORT, NULL);
    eng_publish_stats(e);
    return LETHE_OK;
}

bool lethe_engine_has_work(const lethe_engine *e) {
    return lethe_sched_has_work(e->sched) || lethe_queue_pending((lethe_queue *)&e->thr.inbox) > 0;
}

int lethe_engine_step(lethe_engine *e) {
    if (e->thr.running)
        return lethe_errorf(LETHE_ERR_BUSY, "lethe_engine_step: the engine thread is running (threaded mode)");
    return eng_step(e);
}

/* Applies queued submissions, then queued cancels (threaded mode and
 * lethe_engine_cancel from a callback). */
void eng_apply_inbox(lethe_engine *e) {
    void **items;
    uint64_t *ids;
    int32_t n_items, n_ids;
    lethe_queue_drain(&e->thr.inbox, &items, &n_items, &ids, &n_ids);
    for (int32_t i = 0; i < n_items; i++) eng_admit(e, items[i]);
    for (int32_t i = 0; i < n_ids; i++) {
        eng_req *q = eng_find(e, ids[i]);
        if (q) eng_finish(e, q, LETHE_FINISH_ABORT, NULL);
    }
    free(items);
    free(ids);
}

/* ---- calls on the engine thread ---- */

typedef struct eng_call {
    eng_call_fn fn;
    void *arg;
} eng_call;

void eng_post_call_later(lethe_engine *e, eng_call_fn fn, void *arg) {
    eng_call *c = lethe_xmalloc(sizeof(*c));
    *c = (eng_call){fn, arg};
    lethe_queue_call(&e->thr.inbox, c);
}

void eng_post_call(lethe_engine *e, eng_call_fn fn, void *arg) {
    if (!e->thr.running) fn(e, arg);
    else eng_post_call_later(e, fn, arg);
}

typedef struct call_wait {
    eng_call_fn fn;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
} call_wait;

static void run_and_signal(lethe_engine *e, void *arg) {
    call_wait *w = arg;
    w->fn(e, w->arg);
    pthread_mutex_lock(&w->mu);
    w->done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void eng_call_wait(lethe_engine *e, eng_call_fn fn, void *arg) {
    if (!e->thr.running) {
        fn(e, arg);
        return;
    }
    call_wait w = {.fn = fn, .arg = arg};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    eng_post_call(e, run_and_signal, &w);
    pthread_mutex_lock(&w.mu);
    while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
}

void eng_run_calls(lethe_engine *e) {
    void **items;
    int32_t n;
    lethe_queue_drain_calls(&e->thr.inbox, &items, &n);
    for (int32_t i = 0; i < n; i++) {
        eng_call *c = items[i];
        c->fn(e, c->arg);
        free(c);
    }
    free(items);
}

/* ---- stats, checks ---- */

void eng_publish_stats(lethe_engine *e) {
    lethe_engine_stats *s = &e->stats.cur;
    s->n_running = lethe_sched_n_running(e->sched);
    s->n_waiting = lethe_sched_n_waiting(e->sched);
    int32_t n_sp = lethe_kv_n_spaces(e->pool);
    int64_t reclaim = lethe_pcache_reclaimable(e->pcache) * n_sp;
    s->kv_slots_used = s->kv_slots_total - lethe_kv_total_free(e->pool) - reclaim;
    s->kv_slots_resident = s->kv_slots_total - lethe_kv_total_free(e->pool);
    s->kv_tokens_resident = s->kv_slots_resident / n_sp;
    s->kv_usage = s->kv_slots_total ? (double)s->kv_slots_used / (double)s->kv_slots_total : 0.0;
    const lethe_sched_stats *ss = lethe_sched_get_stats(e->sched);
    s->prefix_queries_tokens = ss->prefix_queries_tokens;
    s->prefix_hit_tokens = ss->prefix_hit_tokens;
    s->prefix_inflight_waits = ss->n_inflight_waits;
    s->n_preemptions = ss->n_preemptions;
    if (e->host_tier) { /* the host tier's own counters and the caches' moves */
        lethe_host_tier_stats hs;
        lethe_host_tier_get_stats(e->host_tier, &hs);
        lethe_pc_stats ps;
        lethe_pcache_stats(e->pcache, &ps);
        s->host_cache_capacity_bytes = (int64_t)hs.cap_bytes;
        s->host_cache_used_bytes = (int64_t)hs.used_bytes;
        s->host_cache_entries = hs.entries;
        s->host_cache_evicted = hs.evictions;
        s->host_cache_demoted_blocks = ps.host_demoted;
        s->host_cache_promoted_blocks = ps.host_promoted;
        s->host_cache_promoted_tokens = ps.host_promoted_tokens;
        lethe_kv_host_copies hc;
        lethe_kv_host_copy_stats(e->pool, &hc);
        s->host_cache_demoted_bytes = hc.saved_bytes;
        s->host_cache_demote_seconds = hc.save_s;
        s->host_cache_restored_bytes = hc.loaded_bytes;
        s->host_cache_restore_seconds = hc.load_s;
        s->host_cache_copy_bytes_per_s = e->host_copy_bps;
    }
    if (e->cache_states) { /* hybrid: the prefix cache's state slots */
        lethe_pc_stats ps;
        lethe_pcache_stats(e->pcache, &ps);
        const bool radix = lethe_radix_cache_tree(e->pcache) != NULL;
        const int64_t one = (int64_t)eng_state_bytes(e, 1);
        s->state_snapshots = radix ? ps.snapshots : lethe_pcache_rows_held(e->pcache);
        s->state_snapshot_bytes = s->state_snapshots * one;
        s->state_snapshot_capacity_bytes = (int64_t)e->n_snap_slots * one;
        s->state_snapshots_taken = ps.snapshots_taken;
        s->state_snapshot_hits = ps.snapshot_hits;
        s->state_snapshot_recomputed_tokens = ps.snapshot_recomputed_tokens;
        s->state_snapshots_evicted = ps.snapshots_evicted;
        s->state_snapshots_demoted = ps.snapshots_demoted;
        s->state_snapshots_restored = ps.snapshots_restored;
    }
    e->stats.sparse.evicted_slots = lethe_kv_dropped(e->pool);
    e->stats.sparse.n_steps = s->n_steps;
    const int64_t per_space = s->kv_slots_total / n_sp;
    pthread_mutex_lock(&e->stats.mu);
    e->stats.snap = *s;
    e->stats.sparse_snap = e->stats.sparse;
    const int64_t cached = reclaim / n_sp; /* the prefix cache's: the same in every space */
    for (int32_t sp = 0; sp < n_sp && sp < e->stats.n_spaces; sp++) {
        lethe_kv_space_use *u = &e->stats.spaces[sp];
        *u = (lethe_kv_space_use){.slots_total = per_space,
                                  .slots_used = per_space - lethe_kv_n_free(e->pool, sp) - cached,
                                  .slots_cached = cached};
    }
    pthread_mutex_unlock(&e->stats.mu);
}

void lethe_engine_get_stats(lethe_engine *e, lethe_engine_stats *out) {
    pthread_mutex_lock(&e->stats.mu);
    *out = e->stats.snap;
    pthread_mutex_unlock(&e->stats.mu);
    out->n_waiting += lethe_queue_pending(&e->thr.inbox);
}

int32_t lethe_engine_get_kv_spaces(lethe_engine *e, lethe_kv_space_use *out, int32_t cap) {
    pthread_mutex_lock(&e->stats.mu);
    const int32_t n = e->stats.n_spaces;
    if (out && cap > 0) memcpy(out, e->stats.spaces, (size_t)LETHE_MIN(n, cap) * sizeof(*out));
    pthread_mutex_unlock(&e->stats.mu);
    return n;
}

bool lethe_engine_kv_host_memory(lethe_engine *e, int64_t *resident, int64_t *allocated) {
    return lethe_kv_host_memory(e->pool, resident, allocated); /* the buffer list is fixed after create */
}

void lethe_engine_get_sparse_stats(lethe_engine *e, lethe_engine_sparse_stats *out) {
    pthread_mutex_lock(&e->stats.mu);
    *out = e->stats.sparse_snap;
    pthread_mutex_unlock(&e->stats.mu);
}

lethe_status eng_check(lethe_engine *e) {
    lethe_kv_holder h = lethe_pcache_holder(e->pcache);
    lethe_status st = lethe_kv_check(e->pool, &h, 1);
    if (st == LETHE_OK) st = lethe_pcache_check(e->pcache);
    if (st != LETHE_OK) return st;
    /* every running request owns a live row; waiting ones own nothing */
    int32_t n_run = lethe_sched_n_running(e->sched);
    for (int32_t i = 0; i < n_run; i++) {
        const lethe_req *r = lethe_sched_running_at(e->sched, i);
        if (!lethe_kv_row_in_use(e->pool, r->row))
            return lethe_errorf(LETHE_ERR_INVALID, "engine check: running request %llu has no KV row",
                                (unsigned long long)r->id);
        const int32_t lost = lethe_kv_row_missing_protected(e->pool, r->row, r->protect_from,
                                                            r->n_computed);
        if (lost >= 0)
            return lethe_errorf(LETHE_ERR_INVALID,
                                "engine check: request %llu: pinned position %d is not in its row",
                                (unsigned long long)r->id, lost);
        /* shared rows hold every computed token, or fewer when the method
         * offloads KV out of the pool (LETHE_SPARSE_OFFLOADS) */
        const int32_t row_len = lethe_kv_row_len(e->pool, 0, r->row),
                      expect = r->n_computed - r->n_absent;
        const bool offloads = (e->method->ops->flags & LETHE_SPARSE_OFFLOADS) != 0;
        if (!lethe_kv_per_layer(e->pool) && (offloads ? row_len > expect : row_len != expect))
            return lethe_errorf(
                LETHE_ERR_INVALID,
                "engine check: request %llu: row holds %d tokens, %d computed, %d pruned away",
                (unsigned long long)r->id, lethe_kv_row_len(e->pool, 0, r->row), r->n_computed,
                r->n_absent);
    }
    int32_t rows = 0;
    for (int32_t row = 0; row < lethe_kv_max_rows(e->pool); row++) rows += lethe_kv_row_in_use(e->pool, row);
    int32_t held = lethe_pcache_rows_held(e->pcache);
    if (rows != n_run + held)
        return lethe_errorf(LETHE_ERR_INVALID, "engine check: %d KV rows in use for %d running requests and %d "
                            "rows held by the prefix cache", rows, n_run, held);
    return LETHE_OK;
}

/* ---- accessors ---- */

int32_t lethe_engine_max_model_len(const lethe_engine *e) { return e->max_model_len; }
const char *lethe_engine_model_name(const lethe_engine *e) { return e->model_name; }

/* ---- destroy ---- */

void lethe_engine_destroy(lethe_engine *e) {
    if (!e) return;
    lethe_engine_stop(e);
    eng_diag_report(e);
    eng_seldump_close(e);
    if (e->sched) {
        /* requests still queued or live end with ABORT so callers are released */
        if (e->reqs.buckets) eng_apply_inbox(e);
        eng_run_calls(e); /* control calls posted before the thread stopped */
        for (uint64_t b = 0; e->reqs.buckets && b < e->reqs.n_buckets; b++)
            while (e->reqs.buckets[b]) eng_finish(e, e->reqs.buckets[b], LETHE_FINISH_ABORT, NULL);
    } else {
        void **items;
        uint64_t *ids;
        int32_t n_items, n_ids;
        lethe_queue_drain(&e->thr.inbox, &items, &n_items, &ids, &n_ids);
        for (int32_t i = 0; i < n_items; i++) eng_req_free(items[i]);
        free(items);
        free(ids);
    }
    lethe_sched_destroy(e->sched);
    lethe_pcache_destroy(e->pcache); /* resident KV it holds, before the pool and the method go */
    lethe_host_tier_destroy(e->host_tier);
    lethe_sparse_destroy(e->method);
    if (e->runner.destroy) e->runner.destroy(e->runner.ctx);
    lethe_kv_pool_destroy(e->pool);
    free(e->kv_layouts);
    if (e->runner.be) lethe_backend_destroy(e->runner.be);
    lethe_tokenizer_free(e->tok);
    lethe_sampler_ws_free(&e->sws);
    eng_grammar_destroy(e);
    free(e->reqs.buckets);
    free(e->step.tokens);
    free(e->step.pos);
    free(e->step.seq_begin);
    free(e->step.state_slots);
    free(e->step.logit_rows);
    free(e->step.seqs);
    free(e->step.seq_req);
    free(e->plan.store);
    free(e->plan.lstore);
    free(e->plan.lbegin);
    free(e->plan.lslots);
    free(e->plan.sel);
    free(e->plan.sel_begin);
    free(e->plan.rows);
    free(e->plan.rows_begin);
    free(e->plan.hsel);
    free(e->plan.hsel_begin);
    free(e->fwd.gs);
    free(e->step.logits);
    eng_sample_free(e);
    free(e->step.detok_buf);
    lethe_queue_destroy(&e->thr.inbox);
    pthread_mutex_destroy(&e->stats.mu);
    free(e->stats.spaces);
    pthread_mutex_destroy(&e->gram.mu);
    free(e->model_path);
    free(e->model_name);
    free(e->sparse_method);
    free(e->sparse_config);
    free(e->load_format);
    free(e->device);
    free(e);
}

/* engine_chain.c - the engine side of the prefix cache (src/cache/
 * prefix_cache.h): its construction (what shapes KV content, how a held
 * method state is freed) and the public chain-turn API, both without
 * knowing which implementation is active.
 *
 * A chain turn: lethe_pcache_begin_turn (any thread) admits the turn in the
 * cache (lookup, fingerprint, digest, capacity; a cache that takes no turns
 * answers LETHE_CHAIN_MODE_DISABLED) and returns the full prompt (history +
 * appended tokens) and the cache's record for the request, which rides in
 * lethe_req.cache_ref. From there the scheduler drives it like any request
 * (match/acquire resume the resident KV, release keeps or drops it); payloads
 * the cache let go of are drained at the start of every step
 * (engine_step.c), before the inbox is applied, so a turn that made room
 * finds it free. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/host_tier.h"
#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"

/* The reference the tier's restores are compared with: one large raw copy
 * from host memory into backend memory (copy_from_host; CUDA: a pageable
 * cudaMemcpy), best of 3 over 64 MiB. Restores move a block's slots one
 * (layer, plane) at a time through the backend's staging
 * (lethe_kv_host_copy_stats), so their bandwidth is at most this. */
static double probe_copy_bps(lethe_backend *be) {
    const size_t n = (size_t)64 << 20;
    void *dst = NULL;
    if (!be->ops->copy_from_host || be->ops->alloc(be, n, &dst) != LETHE_OK) return 0.0;
    uint8_t *src = lethe_xmalloc(n);
    memset(src, 0x5a, n);
    double best = 0.0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = lethe_time_s();
        be->ops->copy_from_host(be, dst, src, n);
        const double dt = lethe_time_s() - t0;
        if (dt > 0 && (double)n / dt > best) best = (double)n / dt;
    }
    be->ops->release(be, dst);
    free(src);
    return best;
}

/* a method state the cache held (a chain's payload) */
static void release_state(void *ctx, void *state) {
    lethe_sparse_method *m = ctx;
    if (m->ops->request_finished) m->ops->request_finished(m, state);
}

/* a demoted chain's method state: the method's snapshot / restore hooks
 * (a state without them cannot leave the pool) */
static size_t snapshot_state(void *ctx, const void *state, void *buf, size_t cap) {
    lethe_sparse_method *m = ctx;
    if (!m->ops->snapshot) return SIZE_MAX;
    return m->ops->snapshot(m, state, buf, cap);
}

static lethe_status restore_state(void *ctx, const void *buf, size_t n, void **state) {
    lethe_sparse_method *m = ctx;
    LETHE_ASSERT(m->ops->request_init && m->ops->restore);
    lethe_sparse_seq v = {.row = -1}; /* a fresh state; the snapshot fills it */
    lethe_status st = m->ops->request_init(m, &v, state);
    if (st == LETHE_OK) st = m->ops->restore(m, *state, buf, n);
    return st;
}

lethe_status eng_cache_init(lethe_engine *e) {
    const lethe_model_config *c = &e->runner.cfg;
    const lethe_sparse_ops *ops = e->method->ops;
    char desc[1400];
    snprintf(
        desc, sizeof(desc),
        "model=%s|arch=%s|layers=%d|kv_heads=%d|head_dim=%d|vocab=%d|dim=%d|kv_elem=%zu|device=%s|"
        "max_model_len=%d|method=%s|config=%s|sink=%d|recent=%d|keep=%d",
        e->model_path ? e->model_path : "", c->arch, c->n_layers, c->n_kv_heads, c->head_dim,
        c->n_vocab, c->dim, e->runner.be ? e->runner.be->ops->kv_size : sizeof(float),
        e->device ? e->device : "cpu", e->max_model_len, ops->name,
        e->sparse_config ? e->sparse_config : "", e->method->knobs.sink_keep_tokens,
        e->method->knobs.recent_keep_tokens, e->method->knobs.decode_keep_tokens);
    if (e->p.host_cache_bytes > 0) { /* the host tier under the prefix cache */
        if (!e->p.enable_prefix_caching)
            return lethe_errorf(LETHE_ERR_INVALID,
                                "--host-cache-bytes needs prefix caching (it holds evicted prefix "
                                "blocks); it was turned off with --no-enable-prefix-caching");
        lethe_status st = lethe_kv_host_copy_check(e->pool);
        if (st != LETHE_OK)
            return lethe_errorf(st, "--host-cache-bytes with method %s: %s", ops->name,
                                lethe_last_error());
        if (e->p.host_cache_bytes < lethe_kv_space_slot_bytes(e->pool, 0) * 16 * lethe_kv_n_spaces(e->pool))
            return lethe_errorf(LETHE_ERR_INVALID,
                                "--host-cache-bytes %zu: smaller than one 16-token block (%zu bytes)",
                                e->p.host_cache_bytes,
                                lethe_kv_space_slot_bytes(e->pool, 0) * 16 * lethe_kv_n_spaces(e->pool));
        e->host_tier = lethe_host_tier_create(e->p.host_cache_bytes);
        e->host_copy_bps = probe_copy_bps(e->runner.be);
    }
    lethe_pc_params p = {.mode = e->p.prefix_cache_mode,
                         .enabled = e->p.enable_prefix_caching,
                         .shareable = (ops->flags & LETHE_SPARSE_PREFIX_CACHE) != 0,
                         .method = ops->name,
                         .pool = e->pool,
                         .kv_description = desc,
                         .release_state = release_state,
                         .release_ctx = e->method,
                         .snapshot_state = snapshot_state,
                         .restore_state = restore_state,
                         .host_tier = e->host_tier,
                         .snapshot_slots = e->n_snap_slots,
                         .snapshot_every = e->snap_every ? e->snap_every : LETHE_GDN_CHUNK};
    return lethe_pcache_create(&p, &e->pcache);
}

bool lethe_engine_chain_mode(const lethe_engine *e) { return lethe_pcache_takes_turns(e->pcache); }

const char *lethe_engine_prefix_cache_mode(const lethe_engine *e) {
    return lethe_pcache_mode(e->pcache);
}

static int refuse(lethe_chain_result *res, lethe_chain_code code, lethe_status st,
                  const char *msg) {
    res->code = code;
    snprintf(res->message, sizeof(res->message), "%s", msg);
    return lethe_errorf(st, "%s", msg);
}

static int chain_submit(lethe_engine *e, const lethe_request_params *p, const lethe_chain_params *c,
                        lethe_chain_result *res, uint64_t *id_out, bool threaded) {
    memset(res, 0, sizeof(*res));
    res->code = LETHE_CHAIN_OK;
    res->status = "created";
    lethe_status st = LETHE_OK;
    if (lethe_pcache_takes_turns(e->pcache)) { /* (the full prompt's length is checked below) */
        if (c->owner && strlen(c->owner) >= LETHE_CHAIN_OWNER_CAP)
            return refuse(res, LETHE_CHAIN_INVALID_REQUEST, LETHE_ERR_INVALID,
                          "chain owner (tenant) longer than 71 bytes");
        if (c->share_prefix_tokens < 0)
            return refuse(res, LETHE_CHAIN_INVALID_REQUEST, LETHE_ERR_INVALID,
                          "share_prefix_tokens must be >= 0");
        /* a shared prefix's blocks come without the linear-attention states at their end */
        if (c->share_prefix_tokens > 0 && e->runner.cfg.n_linear_layers > 0)
            return refuse(res, LETHE_CHAIN_INVALID_REQUEST, LETHE_ERR_UNSUPPORTED,
                          "share_prefix_tokens: chains of a hybrid (linear-attention) model cannot "
                          "branch from a shared prefix; send the chain without it");
        if ((st = eng_validate(e, p)) != LETHE_OK) /* sampling, token ids */
            return refuse(res, LETHE_CHAIN_INVALID_REQUEST, st, lethe_last_error());
    }
    int64_t gen = p->n_forced > 0              ? p->n_forced
                  : p->sampling.max_tokens > 0 ? p->sampling.max_tokens
                                               : e->max_model_len;
    lethe_chain_begin_args a = {.chain_id = c->chain_id,
                                .new_id = c->new_chain_id,
                                .owner = c->owner,
                                .tokens = p->prompt,
                                .n_tokens = p->n_prompt,
                                .append = c->append,
                                .gen_peak = (int32_t)LETHE_MIN(gen, e->max_model_len),
                                .max_len = e->max_model_len,
                                .n_messages = c->n_messages,
                                .append_start = c->append_start,
                                .share_tokens = c->share_prefix_tokens};
    lethe_chain_turn t;
    void *ref = NULL;
    lethe_pcache_begin_turn(e->pcache, &a, &t, &ref);
    if (t.code == LETHE_CHAIN_MODE_DISABLED && !t.message[0])
        snprintf(t.message, sizeof(t.message),
                 "chains need the Chain Cache, but this engine runs prefix-cache "
                 "mode '%s' (method %s); use --prefix-cache-mode chain",
                 lethe_pcache_mode(e->pcache), e->method->ops->name);
    if (t.code != LETHE_CHAIN_OK)
        return refuse(res, t.code, lethe_chain_code_status(t.code), t.message);
    snprintf(res->chain_id, sizeof(res->chain_id), "%s", t.id);
    res->status = lethe_chain_status_name(t.status);
    res->reused_tokens = t.reused;
    res->n_prompt = t.n_tokens;
    res->shared_tokens = t.shared;
    lethe_request_params full = *p;
    full.prompt = t.tokens;
    full.n_prompt = t.n_tokens;
    st = eng_validate(e, &full);
    if (st != LETHE_OK) {
        lethe_pcache_cancel_turn(e->pcache, ref);
        free(t.tokens);
        return refuse(res, LETHE_CHAIN_INVALID_REQUEST, st, lethe_last_error());
    }
    eng_req *q = eng_req_new(e, &full);
    free(t.tokens);
    q->r.cache_ref = ref;
    uint64_t id = q->r.id;
    if (threaded) {
        st = lethe_queue_push(&e->thr.inbox, q);
        if (st != LETHE_OK) {
            lethe_pcache_cancel_turn(e->pcache, q->r.cache_ref);
            q->r.cache_ref = NULL;
            eng_req_free(q);
            return refuse(res, LETHE_CHAIN_QUEUE_FULL, st, lethe_last_error());
        }
    } else {
        eng_admit(e, q);
    }
    if (id_out) *id_out = id;
    return LETHE_OK;
}

int lethe_engine_submit_chain(lethe_engine *e, const lethe_request_params *p,
                              const lethe_chain_params *c, lethe_chain_result *res,
                              uint64_t *id_out) {
    return chain_submit(e, p, c, res, id_out, true);
}

int lethe_engine_add_request_chain(lethe_engine *e, const lethe_request_params *p,
                                   const lethe_chain_params *c, lethe_chain_result *res,
                                   uint64_t *id_out) {
    if (e->thr.running)
        return refuse(
            res, LETHE_CHAIN_ENGINE_BUSY, LETHE_ERR_BUSY,
            "lethe_engine_add_request_chain: the engine thread is running (use submit_chain)");
    return chain_submit(e, p, c, res, id_out, false);
}

/* a control operation from the API: ones that touch the pool need the engine
 * thread, so they are refused while it runs */
static int32_t control(lethe_engine *e, lethe_pc_ctl *c) {
    if (lethe_pcache_ctl_engine_thread(c->kind) && e->thr.running) return -1;
    if (lethe_pcache_control(e->pcache, c) != LETHE_OK) return -1;
    return c->n_out;
}

int32_t lethe_engine_chain_history(lethe_engine *e, const char *chain_id, int32_t *out,
                                   int32_t cap) {
    lethe_pc_ctl c = {
        .kind = LETHE_PC_CTL_CHAIN_HISTORY, .chain_id = chain_id, .out = out, .cap = cap};
    return control(e, &c);
}

int32_t lethe_engine_chain_positions(lethe_engine *e, const char *chain_id, int32_t layer,
                                     int32_t *out, int32_t cap) {
    lethe_pc_ctl c = {.kind = LETHE_PC_CTL_CHAIN_POSITIONS,
                      .chain_id = chain_id,
                      .layer = layer,
                      .out = out,
                      .cap = cap};
    return control(e, &c);
}

int32_t lethe_engine_list_chains(lethe_engine *e, lethe_chain_summary *out, int32_t cap) {
    if (cap < 0) cap = 0;
    lethe_chain_entry *ent = cap ? lethe_xmalloc((size_t)cap * sizeof(*ent)) : NULL;
    lethe_pc_ctl c = {.kind = LETHE_PC_CTL_CHAIN_LIST, .entries = ent, .cap = cap};
    int32_t n = e->pcache && lethe_pcache_control(e->pcache, &c) == LETHE_OK ? c.n_out : 0;
    for (int32_t i = 0; out && i < LETHE_MIN(n, cap); i++) {
        const lethe_chain_info *in = &ent[i].info;
        out[i] = (lethe_chain_summary){.active = in->state == LETHE_CHAIN_ACTIVE,
                                       .logical_tokens = in->n_history,
                                       .processed_tokens = in->processed,
                                       .resident_tokens = in->resident_max,
                                       .resident_slots = in->resident_total,
                                       .shared_tokens = in->shared};
        snprintf(out[i].chain_id, sizeof(out[i].chain_id), "%s", ent[i].id);
    }
    free(ent);
    return n;
}

void lethe_engine_get_chain_stats(lethe_engine *e, lethe_engine_chain_stats *out) {
    lethe_pc_stats ps;
    lethe_pcache_stats(e->pcache, &ps);
    const lethe_chain_stats *s = &ps.chain;
    *out = (lethe_engine_chain_stats){.n_chains = s->n_chains,
                                      .n_active = s->n_active,
                                      .n_idle = s->n_idle,
                                      .n_tombstones = s->n_tombstones,
                                      .n_created = s->n_created,
                                      .n_resumed = s->n_resumed,
                                      .n_recreated = s->n_recreated,
                                      .n_reclaimed = s->n_reclaimed,
                                      .n_invalidated = s->n_invalidated,
                                      .n_rejected = s->n_rejected,
                                      .n_capacity_rejected = s->n_capacity_rejected,
                                      .reused_tokens = s->reused_tokens,
                                      .prompt_tokens = s->prompt_tokens,
                                      .resident_slots = s->resident_slots,
                                      .n_branched = s->n_branched,
                                      .n_shared_prefixes = s->n_shared_prefixes,
                                      .shared_blocks = ps.shared_blocks,
                                      .shared_hit_tokens = ps.shared_hit_tokens,
                                      .n_on_host = s->n_on_host,
                                      .n_demoted = s->n_demoted,
                                      .n_restored = s->n_restored,
                                      .n_lost = s->n_lost,
                                      .restored_entries = ps.chain_restored_tokens};
}

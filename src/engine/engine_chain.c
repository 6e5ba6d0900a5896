/* engine_chain.c - the engine side of the Chain Cache (src/cache/chain.h):
 * prefix-cache mode selection, chain turns in and out of the scheduler.
 *
 * A chain's resident KV is a payload {row, method state}: the KV row of the
 * last turn (possibly compacted per layer by the method) and the method's
 * per-request state (SnapKV's score vectors...), kept as they were when the
 * turn ended: nothing is copied or serialized. Its life:
 *
 *   submit (any thread)   lethe_chain_begin: lookup, state, fingerprint,
 *                         digest, capacity (may reclaim IDLE chains: their
 *                         payloads are queued for release); the full prompt
 *                         (history + appended tokens) becomes the request.
 *   eng_step start        queued payloads are freed (row + method state)
 *                         BEFORE the inbox is applied, so a turn that made
 *                         room finds it free.
 *   eng_admit             the payload moves into the request (resume_row /
 *                         resume_state); the scheduler admits it on that row
 *                         with n_computed = the processed boundary, so only
 *                         the suffix is prefilled and the method continues
 *                         from its state (SnapKV's window lies in the suffix).
 *   finish (ok)           row and state are detached from the request before
 *                         the scheduler frees it; boundary = n_computed (the
 *                         last sampled token has no KV yet), history = all
 *                         tokens, resident = row length per slot space.
 *   abort / error         the chain is invalidated (tombstone) and its KV freed.
 * A preempted chain turn loses its row like any request and recomputes its
 * whole prompt; the chain then continues from the recomputed KV. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/chain.h"
#include "core/log.h"
#include "core/util.h"
#include "engine/engine_internal.h"

typedef struct chain_kv {
    int32_t row;
    void *state;
} chain_kv;

static void kv_free(lethe_engine *e, chain_kv *k) {
    if (!k) return;
    if (k->row >= 0) lethe_kv_row_release(e->pool, k->row);
    if (k->state && e->method->ops->request_finished) e->method->ops->request_finished(e->method, k->state);
    free(k);
}

lethe_status eng_cache_mode_init(lethe_engine *e) {
    const char *mode = e->p.prefix_cache_mode && e->p.prefix_cache_mode[0] ? e->p.prefix_cache_mode : "auto";
    const lethe_sparse_ops *ops = e->method->ops;
    if (strcmp(mode, "auto") && strcmp(mode, "radix") && strcmp(mode, "chain"))
        return lethe_errorf(LETHE_ERR_INVALID, "--prefix-cache-mode %s: expected auto, radix or chain", mode);
    bool radix_ok = (ops->flags & LETHE_SPARSE_PREFIX_CACHE) != 0;
    if (!e->p.enable_prefix_caching) {
        if (strcmp(mode, "auto"))
            return lethe_errorf(LETHE_ERR_INVALID, "--prefix-cache-mode %s needs prefix caching; it was turned off "
                                "with --no-enable-prefix-caching", mode);
        return LETHE_OK;
    }
    if (!strcmp(mode, "radix") && !radix_ok)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--prefix-cache-mode radix is incompatible with method %s: its KV depends on the whole "
                            "history (eviction/compaction), so prefixes cannot be shared block by block; use "
                            "--prefix-cache-mode chain or auto", ops->name);
    if (!strcmp(mode, "radix") || (!strcmp(mode, "auto") && radix_ok)) return LETHE_OK; /* radix */
    lethe_chain_table_params cp = {.n_spaces = lethe_kv_n_spaces(e->pool), .slots_per_space = lethe_kv_n_slots(e->pool)};
    e->prefix.chains = lethe_chain_create(&cp);
    const lethe_model_config *c = &e->runner.cfg;
    char desc[1400];
    snprintf(desc, sizeof(desc),
             "model=%s|arch=%s|layers=%d|kv_heads=%d|head_dim=%d|vocab=%d|dim=%d|kv_elem=%zu|device=%s|"
             "max_model_len=%d|method=%s|config=%s|sink=%d|recent=%d|keep=%d",
             e->model_path ? e->model_path : "", c->arch, c->n_layers, c->n_kv_heads, c->head_dim, c->n_vocab,
             c->dim, e->runner.be ? e->runner.be->ops->kv_size : sizeof(float), e->device ? e->device : "cpu",
             e->max_model_len, ops->name, e->sparse_config ? e->sparse_config : "",
             e->method->knobs.sink_keep_tokens, e->method->knobs.recent_keep_tokens,
             e->method->knobs.decode_keep_tokens);
    lethe_chain_fingerprint(desc, e->prefix.chain_fp);
    LOG_INFO("prefix cache: chain mode (method %s, %d slot space(s) of %d slots)", ops->name, cp.n_spaces,
             cp.slots_per_space);
    return LETHE_OK;
}

bool lethe_engine_chain_mode(const lethe_engine *e) { return e->prefix.chains != NULL; }

const char *lethe_engine_prefix_cache_mode(const lethe_engine *e) {
    return e->prefix.chains ? "chain" : e->prefix.radix ? "radix" : "off";
}

static int refuse(lethe_chain_result *res, int http, const char *code, lethe_status st, const char *msg) {
    res->http_status = http;
    res->code = code;
    snprintf(res->message, sizeof(res->message), "%s", msg);
    return lethe_errorf(st, "%s", msg);
}

static int chain_submit(lethe_engine *e, const lethe_request_params *p, const lethe_chain_params *c,
                        lethe_chain_result *res, uint64_t *id_out, bool threaded) {
    memset(res, 0, sizeof(*res));
    res->http_status = 200;
    res->code = "ok";
    res->status = "created";
    if (!e->prefix.chains) {
        char msg[192];
        snprintf(msg, sizeof(msg), "chains need the Chain Cache, but this engine runs prefix-cache mode '%s' "
                 "(method %s); use --prefix-cache-mode chain", lethe_engine_prefix_cache_mode(e),
                 e->method->ops->name);
        return refuse(res, 400, "chain_mode_disabled", LETHE_ERR_INVALID, msg);
    }
    if (c->owner && strlen(c->owner) >= LETHE_CHAIN_OWNER_CAP)
        return refuse(res, 400, "invalid_request", LETHE_ERR_INVALID, "chain owner (tenant) longer than 71 bytes");
    lethe_status st = eng_validate(e, p); /* sampling, token ids (the full length is checked below) */
    if (st != LETHE_OK) return refuse(res, 400, "invalid_request", st, lethe_last_error());
    int64_t gen = p->n_forced > 0 ? p->n_forced : p->sampling.max_tokens > 0 ? p->sampling.max_tokens : e->max_model_len;
    lethe_chain_begin_args a = {.chain_id = c->chain_id, .owner = c->owner, .fingerprint = e->prefix.chain_fp,
                                .tokens = p->prompt,
                                .n_tokens = p->n_prompt, .append = c->append,
                                .gen_peak = (int32_t)LETHE_MIN(gen, e->max_model_len), .max_len = e->max_model_len,
                                .n_messages = c->n_messages, .append_start = c->append_start};
    lethe_chain_turn t;
    lethe_chain_begin(e->prefix.chains, &a, &t);
    if (t.code != LETHE_CHAIN_OK) {
        lethe_status s = t.code == LETHE_CHAIN_CAPACITY ? LETHE_ERR_CAPACITY
                         : t.code == LETHE_CHAIN_NOT_FOUND || t.code == LETHE_CHAIN_GONE ? LETHE_ERR_NOT_FOUND
                         : t.code == LETHE_CHAIN_BAD_REQUEST || t.code == LETHE_CHAIN_MODE_DISABLED ? LETHE_ERR_INVALID
                         : LETHE_ERR_BUSY;
        return refuse(res, lethe_chain_http_status(t.code), lethe_chain_code_name(t.code), s, t.message);
    }
    snprintf(res->chain_id, sizeof(res->chain_id), "%s", t.id);
    res->status = lethe_chain_status_name(t.status);
    res->reused_tokens = t.reused;
    res->n_prompt = t.n_tokens;
    lethe_request_params full = *p;
    full.prompt = t.tokens;
    full.n_prompt = t.n_tokens;
    st = eng_validate(e, &full);
    if (st != LETHE_OK) {
        lethe_chain_abandon(e->prefix.chains, t.id, NULL);
        free(t.tokens);
        return refuse(res, 400, "invalid_request", st, lethe_last_error());
    }
    eng_req *q = eng_req_new(e, &full);
    free(t.tokens);
    q->has_chain = true;
    snprintf(q->chain_id, sizeof(q->chain_id), "%s", t.id);
    q->chain_reused = t.reused;
    uint64_t id = q->r.id;
    if (threaded) {
        st = lethe_queue_push(&e->thr.inbox, q);
        if (st != LETHE_OK) {
            lethe_chain_abandon(e->prefix.chains, q->chain_id, NULL);
            eng_req_free(q);
            return refuse(res, 503, "queue_full", st, lethe_last_error());
        }
    } else {
        eng_admit(e, q);
    }
    if (id_out) *id_out = id;
    return LETHE_OK;
}

int lethe_engine_submit_chain(lethe_engine *e, const lethe_request_params *p, const lethe_chain_params *c,
                              lethe_chain_result *res, uint64_t *id_out) {
    return chain_submit(e, p, c, res, id_out, true);
}

int lethe_engine_add_request_chain(lethe_engine *e, const lethe_request_params *p, const lethe_chain_params *c,
                                   lethe_chain_result *res, uint64_t *id_out) {
    if (e->thr.running)
        return refuse(res, 500, "engine_busy", LETHE_ERR_BUSY,
                      "lethe_engine_add_request_chain: the engine thread is running (use submit_chain)");
    return chain_submit(e, p, c, res, id_out, false);
}

void eng_chain_on_admit(lethe_engine *e, eng_req *q) {
    chain_kv *k = lethe_chain_take_payload(e->prefix.chains, q->chain_id);
    if (!k) return;
    q->r.has_resume = true;
    q->r.resume_row = k->row;
    q->r.resume_state = k->state;
    q->r.resume_computed = q->chain_reused;
    free(k);
}

void eng_chain_on_end(lethe_engine *e, eng_req *q, bool ok) {
    if (!q->has_chain) return;
    q->has_chain = false;
    lethe_req *r = &q->r;
    chain_kv *k = NULL;
    if (r->row >= 0) { /* running: detach the row and state before the scheduler frees them */
        k = lethe_xmalloc(sizeof(*k));
        k->row = r->row;
        k->state = r->method_state;
        r->row = -1;
        r->method_state = NULL;
    } else if (r->has_resume) { /* never admitted */
        k = lethe_xmalloc(sizeof(*k));
        k->row = r->resume_row;
        k->state = r->resume_state;
        r->has_resume = false;
    }
    if (!ok) { /* on the engine thread: the KV goes now (abort frees KV at once) */
        lethe_chain_abandon(e->prefix.chains, q->chain_id, NULL);
        kv_free(e, k);
        eng_chain_drain(e);
        return;
    }
    int32_t n_sp = lethe_kv_n_spaces(e->pool);
    int32_t *resident = lethe_xcalloc((size_t)n_sp, sizeof(int32_t));
    if (k)
        for (int32_t sp = 0; sp < n_sp; sp++) resident[sp] = lethe_kv_row_len(e->pool, sp, k->row);
    LETHE_ASSERT(r->n_computed <= r->n_tokens);
    lethe_chain_finish(e->prefix.chains, q->chain_id, r->tokens, r->n_tokens, k ? r->n_computed : 0, resident, k);
    free(resident);
}

void eng_chain_drain(lethe_engine *e) {
    if (!e->prefix.chains) return;
    void *buf[64];
    int32_t n;
    do {
        n = lethe_chain_take_released(e->prefix.chains, buf, 64);
        for (int32_t i = 0; i < n; i++) kv_free(e, buf[i]);
    } while (n == 64);
}

void eng_chain_destroy(lethe_engine *e) {
    if (!e || !e->prefix.chains) return;
    void *buf[64];
    int32_t n;
    do {
        n = lethe_chain_drain_all(e->prefix.chains, buf, 64);
        for (int32_t i = 0; i < n; i++) kv_free(e, buf[i]);
    } while (n == 64);
    lethe_chain_destroy(e->prefix.chains);
    e->prefix.chains = NULL;
}

int32_t eng_chain_rows_held(lethe_engine *e) {
    if (!e->prefix.chains) return 0;
    int32_t n = lethe_chain_count_payloads(e->prefix.chains);
    for (uint64_t b = 0; b < e->reqs.n_buckets; b++)
        for (eng_req *q = e->reqs.buckets[b]; q; q = q->hnext) n += q->r.has_resume;
    return n;
}

int32_t lethe_engine_chain_history(lethe_engine *e, const char *chain_id, int32_t *out, int32_t cap) {
    return e->prefix.chains && chain_id ? lethe_chain_history(e->prefix.chains, chain_id, out, cap) : -1;
}

int32_t lethe_engine_chain_positions(lethe_engine *e, const char *chain_id, int32_t layer, int32_t *out,
                                     int32_t cap) {
    if (!e->prefix.chains || e->thr.running || layer < 0 || layer >= lethe_kv_n_layers(e->pool)) return -1;
    const chain_kv *k = lethe_chain_peek_payload(e->prefix.chains, chain_id);
    if (!k) return -1;
    int32_t sp = lethe_kv_space_of(e->pool, layer);
    int32_t n = lethe_kv_row_len(e->pool, sp, k->row);
    const int32_t *pos = lethe_kv_row_pos(e->pool, sp, k->row);
    if (out) memcpy(out, pos, (size_t)LETHE_MIN(n, cap) * sizeof(int32_t));
    return n;
}

void lethe_engine_get_chain_stats(lethe_engine *e, lethe_engine_chain_stats *out) {
    memset(out, 0, sizeof(*out));
    if (!e->prefix.chains) return;
    lethe_chain_stats s;
    lethe_chain_get_stats(e->prefix.chains, &s);
    *out = (lethe_engine_chain_stats){
        .n_chains = s.n_chains, .n_active = s.n_active, .n_idle = s.n_idle, .n_tombstones = s.n_tombstones,
        .n_created = s.n_created, .n_resumed = s.n_resumed, .n_recreated = s.n_recreated,
        .n_reclaimed = s.n_reclaimed, .n_invalidated = s.n_invalidated, .n_rejected = s.n_rejected,
        .n_capacity_rejected = s.n_capacity_rejected, .reused_tokens = s.reused_tokens,
        .prompt_tokens = s.prompt_tokens, .resident_slots = s.resident_slots};
}

/* bench_sparse.c - `lethe bench sparse`: what a sparse method buys in decode
 * throughput, in two parts.
 *
 * capacity (an eviction method, default SnapKV, at each --capacity-inputs L):
 *   (i)  a real engine run (lethe_engine C API): n = max(1, --engine-tokens / L)
 *        requests of L random tokens with the method, --engine-output decode
 *        tokens each. It records the prefill time (submit -> every request has
 *        its first token), the slots each layer keeps after compaction (read
 *        from the KV pool when a request's first token is published, i.e.
 *        after finish_step compacted it), preemptions, and the engine's own
 *        decode tokens/s at that small batch.
 *   (ii) the largest batch from the engine's capacity planning: the pool has S
 *        slots per layer (sized by the engine from --gpu-memory-utilization /
 *        --kv-cache-bytes); a request needs P = max over layers of the method's
 *        max_resident(L, L + O) while it prefills (SnapKV: the whole prompt)
 *        and R + O in steady state (R = most slots any layer kept after
 *        compaction in (i), O = --capacity-output). Largest batch:
 *            method: B = min(max_num_seqs, 1 + floor((S - P) / (R + O)), floor(S / (R + O)))
 *                    (the last request prefills while the others hold R + O)
 *            dense:  B = min(max_num_seqs, floor(S / (L + O)))
 *        At that batch it times --decode-steps decode steps over synthetic
 *        resident KV of exactly that size, like `lethe bench engine`: the
 *        engine's own model and per-layer KV buffers, every layer reading the
 *        same R (method) or L (dense) contiguous slots per sequence, through
 *        lethe_model_forward_uniform (CUDA graphs unless --no-graph; batches
 *        above LETHE_GRAPH_MAX_BATCH run eagerly). The decode window is
 *        centred on context R + O/2 (L + O/2). KV contents are whatever the
 *        pool memory holds (timing does not depend on values). Logits of every
 *        sequence go to the host each step, as the engine's host sampler needs.
 *   Reported: both batches, both tokens/s, their ratio.
 *
 * matched (--matched-methods, default quest,omnikv, plus dense first): real
 *   engine runs at the same batch: --matched-batch prompts of
 *   --matched-input random tokens (identical for every method), greedy with
 *   ignore_eos. Decode tokens/s = tokens produced in steps that ran while
 *   every request was decoding (all had their first token, none had
 *   finished) / the time of those steps; max_tokens = --matched-output plus
 *   the prefill steps, so that window holds at least --matched-output steps.
 *   Next to it the window's median step as a rate (tokens of an average full
 *   step / the median step's time) and its slowest step: a method that
 *   compacts inside one decode step (R-KV's first pass over a long prompt)
 *   lowers the window's rate but not the median's.
 *   Also the most device slots any layer of a request holds when its first
 *   token is published (resident_after_prompt_max: below the input for a
 *   method that moves or frees KV after the prompt).
 *
 * ownpath (--parts ownpath; --ownpath-methods, default snapkv, pyramidkv, h2o,
 *   streamingllm, after dense): capacity measured through each method's own
 *   engine path. A pool of K (L + O) slots per layer is planned (K =
 *   --ownpath-pool-requests dense requests); the method's batch B in it comes
 *   from its measured resident R (one probe request) and prefill peak P as
 *   above; then B REAL requests (distinct random prompts, prefilled, compacted
 *   and decoded by the method's own path; max_tokens = --ownpath-output, as
 *   requested) run --repeats times, and the full-batch decode tokens/s is
 *   their median. Dense runs K requests. Reported: R, P, B, batch and tok/s
 *   vs dense, preemptions (0 expected: the engine's real pool is larger than
 *   the plan). Each method prefills B x L tokens, so K stays small. See
 *   part_ownpath.
 *
 * The matched and ownpath parts run every configuration --repeats times
 * (default 1: the gpu-check phases that predate it keep their time; kvcap
 * asks for 2) and report the median decode tokens/s (matched: every run's
 * in decode_tok_s_runs); matched records the requested --matched-output next
 * to the max_tokens it sends.
 *
 * Every method gets the same total budget --budget T per layer: sink 64 +
 * recent 512 + decode_keep_tokens (T - 576) (SnapKV keeps that many slots,
 * Quest reads that many tokens as pages, OmniKV's sparse layers read that
 * many). Prefix caching is off. --json writes the results (rewritten after
 * every configuration, so a crash keeps what finished). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"
#include "core/util.h"
#include "engine/engine_introspect.h"
#include "eval/runinfo.h"
#include "model/forward_uniform.h"
#include "options.h"
#include "sparse/sparse.h" /* the knob defaults */

#define SB_MAX_LIST 8

typedef struct sb_opts {
    lethe_engine_params ep;
    const char *parts, *cap_method, *cap_inputs, *matched_methods, *json;
    const char *own_methods, *own_inputs;
    int32_t own_pool_requests, own_output, repeats;
    int32_t budget, sink, recent;
    int32_t cap_output, engine_tokens, engine_output, decode_steps;
    int32_t matched_batch, matched_input, matched_output;
    uint64_t seed;
    bool no_graph, no_progress;
    const char *method_config[LETHE_MAX_STOP]; /* "METHOD:K=V,K=V" extra knobs of one method */
} sb_opts;

/* ---- engine runs ---------------------------------------------------------------- */

typedef struct sb_track {
    lethe_engine *e;
    int32_t n_req, n_started, n_finished, n_errors;
    int64_t step_tokens;
    bool record_resident;
    int32_t record_at; /* the completion token after which resident slots are read (0 = 1) */
    int32_t res_min, res_max;
    double res_sum;
    int64_t res_n;
    char error[256];
} sb_track;

static void on_event(void *user, const lethe_event *ev) {
    sb_track *t = user;
    if (ev->n_tokens == 1) {
        t->step_tokens++;
        if (ev->completion_tokens == 1) t->n_started++;
        if (ev->completion_tokens == (t->record_at > 0 ? t->record_at : 1)) {
            if (t->record_resident && !ev->finished) {
                /* the first token is published after finish_step compacted the prompt (record_at 1) */
                lethe_engine_layout lo;
                lethe_engine_get_layout(t->e, &lo);
                for (int32_t l = 0; l < lo.n_layers; l++) {
                    const int32_t n = lethe_engine_request_resident(t->e, ev->request_id, l);
                    if (n < 0) break; /* not live or no KV row */
                    t->res_min = t->res_n ? LETHE_MIN(t->res_min, n) : n;
                    t->res_max = t->res_n ? LETHE_MAX(t->res_max, n) : n;
                    t->res_sum += n;
                    t->res_n++;
                }
            }
        }
    }
    if (ev->finished) {
        t->n_finished++;
        if (ev->finish_reason == LETHE_FINISH_ERROR || ev->finish_reason == LETHE_FINISH_ABORT) {
            t->n_errors++;
            if (!t->error[0]) snprintf(t->error, sizeof(t->error), "%s", ev->error ? ev->error : "aborted");
        }
    }
}

static int cmp_dbl(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct sb_run {
    int32_t n_req, input, max_tokens;
    double prefill_s, decode_tok_s, window_s, total_s;
    double step_p50_s, step_max_s; /* full-batch steps: the median and the slowest */
    int64_t window_tokens, window_steps, steps, preemptions;
    int32_t res_min, res_max;
    double res_mean;
    char error[256];
} sb_run;

/* n requests of `input` random tokens (request i's tokens depend only on seed
 * and i, so every method sees the same prompts), greedy, ignore_eos. */
static int engine_run(lethe_engine *e, const char *label, int32_t n, int32_t input, int32_t max_tokens,
                      uint64_t seed, int32_t record_at, bool progress, sb_run *r) {
    memset(r, 0, sizeof(*r));
    r->n_req = n, r->input = input, r->max_tokens = max_tokens;
    sb_track t = {.e = e, .n_req = n, .record_resident = record_at > 0, .record_at = record_at};
    int32_t *prompt = lethe_xmalloc((size_t)input * sizeof(int32_t));
    lethe_engine_layout lo;
    lethe_engine_get_layout(e, &lo);
    lethe_engine_stats s0, s1;
    lethe_engine_get_stats(e, &s0);
    double t0 = lethe_time_s();
    for (int32_t i = 0; i < n; i++) {
        uint64_t rng = seed * 0x9e3779b97f4a7c15ull + (uint64_t)i + 1;
        for (int32_t k = 0; k < input; k++)
            prompt[k] = (int32_t)(lethe_splitmix64(&rng) % (uint64_t)lo.n_vocab);
        lethe_request_params rp = {.prompt = prompt, .n_prompt = input, .cb = on_event, .user = &t};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.ignore_eos = true;
        rp.sampling.max_tokens = max_tokens;
        uint64_t id;
        if (lethe_engine_add_request(e, &rp, &id) != 0) {
            snprintf(r->error, sizeof(r->error), "add_request: %s", lethe_engine_last_error());
            free(prompt);
            return -1;
        }
    }
    free(prompt);
    double t_started = 0, t_last_print = 0;
    double *step_s = NULL; /* every full-batch step's seconds, for the median */
    size_t step_cap = 0;
    while (lethe_engine_has_work(e)) {
        bool full = t.n_started == n && t.n_finished == 0; /* every request decodes in this step */
        t.step_tokens = 0;
        double ts = lethe_time_s();
        if (lethe_engine_step(e) != 0) {
            snprintf(r->error, sizeof(r->error), "step: %s", lethe_engine_last_error());
            free(step_s);
            return -1;
        }
        double now = lethe_time_s();
        r->steps++;
        if (full) {
            r->window_s += now - ts;
            r->window_tokens += t.step_tokens;
            if ((size_t)r->window_steps == step_cap) {
                step_cap = step_cap ? 2 * step_cap : 256;
                step_s = lethe_xrealloc(step_s, step_cap * sizeof(double));
            }
            step_s[r->window_steps++] = now - ts;
        }
        if (!t_started && t.n_started == n) t_started = now;
        if (progress && now - t_last_print > 1.0) {
            fprintf(stderr, "\r  %s: L=%d step %lld, prefilled %d/%d, finished %d/%d, %.0f s   ", label, input,
                    (long long)r->steps, t.n_started, n, t.n_finished, n, now - t0);
            t_last_print = now;
        }
    }
    if (progress) fprintf(stderr, "\r%*s\r", 100, "");
    r->total_s = lethe_time_s() - t0;
    r->prefill_s = t_started ? t_started - t0 : NAN;
    r->decode_tok_s = r->window_s > 0 ? (double)r->window_tokens / r->window_s : NAN;
    /* the median step: a method that compacts inside a decode step (R-KV's
     * first pass over a long prompt) shows as one slow step, which the
     * window's mean spreads over every token; the median is its steady rate */
    r->step_p50_s = r->step_max_s = NAN;
    if (r->window_steps > 0) {
        qsort(step_s, (size_t)r->window_steps, sizeof(double), cmp_dbl);
        const int64_t w = r->window_steps;
        r->step_p50_s = w % 2 ? step_s[w / 2] : 0.5 * (step_s[w / 2 - 1] + step_s[w / 2]);
        r->step_max_s = step_s[w - 1];
    }
    free(step_s);
    lethe_engine_get_stats(e, &s1);
    r->preemptions = s1.n_preemptions - s0.n_preemptions;
    if (t.res_n) {
        r->res_min = t.res_min, r->res_max = t.res_max;
        r->res_mean = t.res_sum / (double)t.res_n;
    }
    if (t.n_errors) {
        snprintf(r->error, sizeof(r->error), "%d of %d requests failed: %.200s", t.n_errors, n, t.error);
        return -1;
    }
    return 0;
}

/* ---- synthetic steady-state decode over the engine's KV buffers ------------------ */

typedef struct sb_decode {
    int32_t batch, ctx0, steps;
    double step_ms, tok_s;
    int64_t replays, eager;
} sb_decode;

/* `steps` decode steps of B sequences; sequence q owns slots [q*T, q*T + T),
 * T = ctx0 + steps, holds ctx0 + step tokens before a step, and every layer
 * selects all of them. Needs B * T <= the pool's slots per layer. */
static lethe_status synthetic_decode(lethe_engine *e, int32_t B, int32_t ctx0, int32_t steps, bool graph,
                                     uint64_t seed, sb_decode *d) {
    memset(d, 0, sizeof(*d));
    d->batch = B, d->ctx0 = ctx0, d->steps = steps;
    lethe_model *m = lethe_engine_model(e);
    if (!m) return lethe_errorf(LETHE_ERR_UNSUPPORTED, "synthetic decode needs a real model");
    lethe_engine_layout lo;
    lethe_engine_get_layout(e, &lo);
    const int32_t T = ctx0 + steps, L = m->cfg.n_layers;
    LETHE_ASSERT(B >= 1 && (int64_t)B * T <= lo.kv_slots_per_layer);
    LETHE_ASSERT(B <= lo.max_num_batched_tokens); /* the forward workspace's rows */
    void **kc = lethe_xmalloc((size_t)L * sizeof(void *)), **vc = lethe_xmalloc((size_t)L * sizeof(void *));
    lethe_engine_kv_buffers(e, kc, vc);
    int32_t *tok = lethe_xmalloc((size_t)B * sizeof(int32_t)), *pos = lethe_xmalloc((size_t)B * sizeof(int32_t));
    int32_t *store = lethe_xmalloc((size_t)B * sizeof(int32_t)), *rows = lethe_xmalloc((size_t)B * sizeof(int32_t));
    /* hybrid models: sequence q continues from state slot q (free while the engine is idle) */
    const bool hybrid = m->cfg.n_linear_layers > 0;
    LETHE_ASSERT(!hybrid || B < lethe_engine_n_state_slots(e));
    int32_t *sslots = lethe_xmalloc((size_t)B * sizeof(int32_t));
    for (int32_t q = 0; q < B; q++) sslots[q] = q;
    int32_t *seq_begin = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
    int32_t *sel_begin = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
    int32_t *sel = lethe_xmalloc((size_t)B * T * sizeof(int32_t));
    float *logits = lethe_xmalloc((size_t)B * m->cfg.n_vocab * sizeof(float));
    double *dt = lethe_xmalloc((size_t)steps * sizeof(double));
    lethe_graph_state *gs = lethe_xcalloc(1, sizeof(*gs));
    uint64_t rng = seed ^ 0xdec0de;
    for (int32_t s = 0; s < steps; s++) {
        const int32_t ctx = ctx0 + s;
        int32_t n_sel = 0;
        seq_begin[0] = sel_begin[0] = 0;
        for (int32_t q = 0; q < B; q++) {
            tok[q] = (int32_t)(lethe_splitmix64(&rng) % (uint64_t)m->cfg.n_vocab);
            pos[q] = ctx;
            store[q] = q * T + ctx;
            rows[q] = q;
            seq_begin[q + 1] = q + 1;
            for (int32_t k = 0; k <= ctx; k++) sel[n_sel + k] = q * T + k;
            n_sel += ctx + 1;
            sel_begin[q + 1] = n_sel;
        }
        lethe_fwd_batch b = {.n_tokens = B, .tokens = tok, .pos = pos, .n_seqs = B, .seq_begin = seq_begin,
                             .n_logits = B, .logit_rows = rows, .state_slots = hybrid ? sslots : NULL};
        lethe_layer_plan plan = {.store_slots = store, .sel_begin = sel_begin, .sel_slots = sel};
        double t0 = lethe_time_s();
        lethe_model_forward_uniform(m, &b, kc, vc, &plan, graph, gs, logits);
        dt[s] = lethe_time_s() - t0;
    }
    /* the first steps run eagerly / capture: time the steady state (median) */
    int skip = steps > 4 ? 2 : 0;
    double *v = dt + skip;
    int nv = steps - skip;
    for (int i = 1; i < nv; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double x = v[j];
            v[j] = v[j - 1], v[j - 1] = x;
        }
    double med = nv % 2 ? v[nv / 2] : 0.5 * (v[nv / 2 - 1] + v[nv / 2]);
    d->step_ms = med * 1e3;
    d->tok_s = med > 0 ? B / med : NAN;
    d->replays = gs->n_replays, d->eager = gs->n_eager;
    if (m->be->ops->graph_reset) m->be->ops->graph_reset(m->be); /* graphs hold these buffers */
    free(kc), free(vc), free(tok), free(pos), free(store), free(rows), free(sslots), free(seq_begin), free(sel_begin);
    free(sel), free(logits), free(dt), free(gs);
    return LETHE_OK;
}

/* ---- helpers ---------------------------------------------------------------------- */

static int parse_ints(const char *s, int32_t *out, int cap, const char *flag) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || v > (1 << 24) || n == cap || (*end && *end != ',')) {
            fprintf(stderr, "lethe bench sparse: %s '%s': expected up to %d positive integers, comma separated\n",
                    flag, s, cap);
            return -1;
        }
        out[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    return n;
}

static void knobs_for(const sb_opts *o, const char *method, char *out, size_t cap) {
    if (!strcmp(method, "dense")) {
        out[0] = 0;
        return;
    }
    size_t n = (size_t)snprintf(out, cap, "sink_keep_tokens=%d,recent_keep_tokens=%d,decode_keep_tokens=%d",
                                o->sink, o->recent, o->budget - o->sink - o->recent);
    /* H2O sizes its row by its own knob: compacted to the same total budget at prompt end */
    if (!strcmp(method, "h2o") && n < cap) n += (size_t)snprintf(out + n, cap - n, ",h2o_decode_budget=%d", o->budget);
    const size_t ml = strlen(method);
    for (int i = 0; i < LETHE_MAX_STOP && o->method_config[i] && n < cap; i++) /* --method-config M:K=V,... */
        if (!strncmp(o->method_config[i], method, ml) && o->method_config[i][ml] == ':')
            n += (size_t)snprintf(out + n, cap - n, ",%s", o->method_config[i] + ml + 1);
}

static lethe_engine *make_engine(const sb_opts *o, const char *method, int32_t max_model_len, char *knobs,
                                 size_t kcap, char *err, size_t ecap) {
    lethe_engine_params p = o->ep;
    knobs_for(o, method, knobs, kcap);
    p.sparse_method = method;
    p.sparse_config = knobs[0] ? knobs : NULL;
    p.max_model_len = max_model_len;
    p.enable_prefix_caching = false;
    p.prefix_cache_mode = "auto";
    p.progress = false;
    lethe_engine *e = NULL;
    if (lethe_engine_create(&p, &e) != 0) {
        snprintf(err, ecap, "%s", lethe_engine_last_error());
        return NULL;
    }
    return e;
}

static void write_json(const sb_opts *o, cJSON *root) {
    if (!o->json) return;
    char *s = cJSON_Print(root);
    char tmp[1024];
    snprintf(tmp, sizeof(tmp), "%s.tmp", o->json);
    FILE *f = fopen(tmp, "w");
    if (!f || fputs(s, f) < 0 || fclose(f) != 0 || rename(tmp, o->json) != 0)
        fprintf(stderr, "lethe bench sparse: --json %s: cannot write\n", o->json);
    free(s);
}

/* tokens of an average full-batch step over the median step's time */
static double p50_step_tok_s(const sb_run *r) {
    return r->window_steps > 0 && r->step_p50_s > 0
               ? (double)r->window_tokens / (double)r->window_steps / r->step_p50_s
               : NAN;
}

static cJSON *run_json(const sb_run *r) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "requests", r->n_req);
    cJSON_AddNumberToObject(j, "input", r->input);
    cJSON_AddNumberToObject(j, "max_tokens", r->max_tokens);
    cJSON_AddNumberToObject(j, "prefill_s", r->prefill_s);
    cJSON_AddNumberToObject(j, "prefill_tok_s", r->prefill_s > 0 ? (double)r->n_req * r->input / r->prefill_s : NAN);
    cJSON_AddNumberToObject(j, "decode_tok_s", r->decode_tok_s);
    cJSON_AddNumberToObject(j, "decode_window_steps", (double)r->window_steps);
    cJSON_AddNumberToObject(j, "decode_window_tokens", (double)r->window_tokens);
    cJSON_AddNumberToObject(j, "decode_window_s", r->window_s);
    cJSON_AddNumberToObject(j, "decode_step_p50_ms", r->step_p50_s * 1e3);
    cJSON_AddNumberToObject(j, "decode_step_max_ms", r->step_max_s * 1e3);
    cJSON_AddNumberToObject(j, "decode_tok_s_p50_step", p50_step_tok_s(r));
    cJSON_AddNumberToObject(j, "steps", (double)r->steps);
    cJSON_AddNumberToObject(j, "total_s", r->total_s);
    cJSON_AddNumberToObject(j, "preemptions", (double)r->preemptions);
    if (r->error[0]) cJSON_AddStringToObject(j, "error", r->error);
    return j;
}

static cJSON *decode_json(const sb_decode *d) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "batch", d->batch);
    cJSON_AddNumberToObject(j, "context_start", d->ctx0);
    cJSON_AddNumberToObject(j, "steps", d->steps);
    cJSON_AddNumberToObject(j, "step_ms", d->step_ms);
    cJSON_AddNumberToObject(j, "tok_s", d->tok_s);
    cJSON_AddNumberToObject(j, "graph_replays", (double)d->replays);
    cJSON_AddNumberToObject(j, "eager_steps", (double)d->eager);
    return j;
}

/* ---- part 1: capacity ------------------------------------------------------------- */

static int part_capacity(const sb_opts *o, cJSON *root) {
    int32_t ins[SB_MAX_LIST];
    int ni = parse_ints(o->cap_inputs, ins, SB_MAX_LIST, "--capacity-inputs");
    if (ni < 0) return 2;
    int32_t max_in = 0;
    for (int i = 0; i < ni; i++) max_in = LETHE_MAX(max_in, ins[i]);
    const int32_t O = o->cap_output;
    cJSON *cap = cJSON_AddObjectToObject(root, "capacity");
    cJSON_AddStringToObject(cap, "method", o->cap_method);
    cJSON *pts = cJSON_AddArrayToObject(cap, "points");
    char knobs[256], err[512];
    /* one engine for every length: max_model_len covers the longest request */
    int32_t mml = max_in + LETHE_MAX(O, o->engine_output) + 1;
    double tl = lethe_time_s();
    lethe_engine *e = make_engine(o, o->cap_method, mml, knobs, sizeof(knobs), err, sizeof(err));
    cJSON_AddStringToObject(cap, "knobs", knobs);
    cJSON_AddNumberToObject(cap, "max_model_len", mml);
    if (!e) {
        fprintf(stderr, "lethe bench sparse: %s engine: %s\n", o->cap_method, err);
        cJSON_AddStringToObject(cap, "error", err);
        write_json(o, root);
        return 1;
    }
    lethe_engine_layout lo;
    lethe_engine_get_layout(e, &lo);
    const int32_t S = lo.kv_slots_per_layer, nl = lo.n_layers;
    const int32_t chunk = lo.max_num_batched_tokens, max_seqs = lo.max_num_seqs;
    const size_t tok_bytes = lo.kv_token_bytes;
    cJSON_AddNumberToObject(cap, "engine_load_s", lethe_time_s() - tl);
    cJSON_AddNumberToObject(cap, "pool_slots_per_layer", S);
    cJSON_AddNumberToObject(cap, "kv_bytes_per_token", (double)tok_bytes);
    cJSON_AddNumberToObject(cap, "max_num_seqs", max_seqs);
    cJSON_AddNumberToObject(cap, "output_tokens", O);
    printf("%s (%s): KV pool %d slots per layer (%.1f GiB), max_num_seqs %d\n", o->cap_method, knobs, S,
           (double)S * tok_bytes / 1073741824.0, max_seqs);
    printf("%8s | %5s %9s %9s %9s | %7s %9s %9s | %7s %9s %9s | %7s\n", "input", "reqs", "prefill s", "resident",
           "peak", "batch", "step ms", "tok/s", "dense b", "step ms", "tok/s", "ratio");
    int rc = 0;
    for (int i = 0; i < ni; i++) {
        const int32_t L = ins[i];
        cJSON *pt = cJSON_CreateObject();
        cJSON_AddItemToArray(pts, pt);
        cJSON_AddNumberToObject(pt, "input", L);
        /* (i) the real engine run */
        int32_t n = LETHE_MAX(1, o->engine_tokens / L);
        sb_run r;
        char label[64];
        snprintf(label, sizeof(label), "%s engine run", o->cap_method);
        int er = engine_run(e, label, n, L, o->engine_output, o->seed, 1, !o->no_progress, &r);
        cJSON_AddItemToObject(pt, "engine_run", run_json(&r));
        int32_t R;
        const char *r_src;
        if (er == 0 && r.res_max > 0) {
            R = r.res_max;
            r_src = "measured: most slots any layer kept after compaction in the engine run";
            cJSON *res = cJSON_AddObjectToObject(pt, "resident_after_compaction");
            cJSON_AddNumberToObject(res, "min", r.res_min);
            cJSON_AddNumberToObject(res, "max", r.res_max);
            cJSON_AddNumberToObject(res, "mean", r.res_mean);
        } else {
            /* the method's own bound when the engine run failed (e.g. not yet on this backend) */
            R = LETHE_MIN(L, o->budget);
            r_src = "NOT measured (engine run failed): the budget";
            fprintf(stderr, "lethe bench sparse: %s engine run at %d: %s\n", o->cap_method, L, r.error);
            rc = 1;
        }
        cJSON_AddStringToObject(pt, "resident_source", r_src);
        /* (ii) capacity arithmetic */
        int32_t P = 0;
        for (int32_t l = 0; l < nl; l++) {
            int32_t pl = lethe_engine_max_resident(e, l, L, L + O, chunk);
            P = LETHE_MAX(P, pl);
        }
        const int64_t steady = (int64_t)R + O, dense_need = (int64_t)L + O;
        int64_t b_pool = S >= P ? LETHE_MIN(1 + (S - P) / steady, S / steady) : 0;
        int64_t d_pool = S / dense_need;
        int32_t B = (int32_t)LETHE_MIN(b_pool, (int64_t)max_seqs), Bd = (int32_t)LETHE_MIN(d_pool, (int64_t)max_seqs);
        cJSON *ca = cJSON_AddObjectToObject(pt, "arithmetic");
        cJSON_AddNumberToObject(ca, "pool_slots_per_layer", S);
        cJSON_AddNumberToObject(ca, "resident_R", R);
        cJSON_AddNumberToObject(ca, "prefill_peak_P", P);
        cJSON_AddNumberToObject(ca, "output_O", O);
        cJSON_AddNumberToObject(ca, "method_batch_pool_limit", (double)b_pool);
        cJSON_AddNumberToObject(ca, "dense_batch_pool_limit", (double)d_pool);
        cJSON_AddNumberToObject(ca, "method_batch", B);
        cJSON_AddNumberToObject(ca, "dense_batch", Bd);
        cJSON_AddBoolToObject(ca, "method_capped_by_max_num_seqs", b_pool > max_seqs);
        cJSON_AddBoolToObject(ca, "dense_capped_by_max_num_seqs", d_pool > max_seqs);
        cJSON_AddNumberToObject(ca, "batch_ratio", Bd > 0 ? (double)B / Bd : NAN);
        /* the decode window: `steps` steps centred on context R + O/2 (L + O/2) */
        const int32_t steps = LETHE_MIN(o->decode_steps, O);
        sb_decode dm = {0}, dd = {0};
        bool have_m = false, have_d = false;
        if (B >= 1 && B <= chunk &&
            synthetic_decode(e, B, R + (O - steps) / 2, steps, !o->no_graph, o->seed, &dm) == LETHE_OK) {
            have_m = true;
            cJSON_AddItemToObject(pt, "method_decode", decode_json(&dm));
        }
        if (Bd >= 1 && Bd <= chunk &&
            synthetic_decode(e, Bd, L + (O - steps) / 2, steps, !o->no_graph, o->seed, &dd) == LETHE_OK) {
            have_d = true;
            cJSON_AddItemToObject(pt, "dense_decode", decode_json(&dd));
        }
        if (Bd < 1) cJSON_AddStringToObject(pt, "dense_error", "one dense request of input + output does not fit");
        double ratio = have_m && have_d ? dm.tok_s / dd.tok_s : NAN;
        cJSON_AddNumberToObject(pt, "tok_s_ratio", ratio);
        printf("%8d | %5d %9.2f %9d %9d | %7d %9.2f %9.0f | %7d %9.2f %9.0f | %6.2fx\n", L, n, r.prefill_s, R, P, B,
               have_m ? dm.step_ms : NAN, have_m ? dm.tok_s : NAN, Bd, have_d ? dd.step_ms : NAN,
               have_d ? dd.tok_s : NAN, ratio);
        fflush(stdout);
        write_json(o, root);
    }
    lethe_engine_destroy(e);
    return rc;
}

/* ---- part 3: capacity through each method's own engine path ------------------------ */

/* median of the finite values of v[0..n) (NaN when none) */
static double median_finite(const double *v, int n) {
    double w[64];
    int m = 0;
    for (int i = 0; i < n && m < 64; i++)
        if (isfinite(v[i])) w[m++] = v[i];
    if (!m) return NAN;
    qsort(w, (size_t)m, sizeof(double), cmp_dbl);
    return m % 2 ? w[m / 2] : 0.5 * (w[m / 2 - 1] + w[m / 2]);
}

/* ownpath: for dense and each --ownpath-methods method, at each input L, the
 * largest batch of a pool of Sv = K (L + O) slots per layer (K =
 * --ownpath-pool-requests dense requests; O = --ownpath-output, the
 * max_tokens every request gets, as requested), computed like the capacity
 * part from the method's measured resident R (one probe request) and prefill
 * peak P, then REAL engine runs at that batch: B distinct prompts of L random
 * tokens prefilled, compacted and decoded by the method's own path (eager or
 * graphs, whatever the engine does), --repeats times; decode tokens/s of the
 * full-batch window (every request decoding), median over the repeats. The
 * engine's real pool is larger than Sv (the batch is what bounds it), so the
 * runs do not preempt; preemptions are reported anyway. K is small so that
 * B x L prefill tokens stay affordable; the batch ratio to dense grows with K
 * toward (L + O) / (R + O) (one request always prefills at its peak P), so a
 * small-K ratio understates the capacity part's full-pool one. */
static int part_ownpath(const sb_opts *o, cJSON *root) {
    int32_t ins[SB_MAX_LIST];
    const int ni = parse_ints(o->own_inputs, ins, SB_MAX_LIST, "--ownpath-inputs");
    if (ni < 0) return 2;
    int32_t max_in = 0;
    for (int i = 0; i < ni; i++) max_in = LETHE_MAX(max_in, ins[i]);
    const int32_t O = o->own_output, K = o->own_pool_requests;
    const int reps = LETHE_MIN(o->repeats, 64);
    cJSON *cr = cJSON_AddObjectToObject(root, "ownpath");
    cJSON_AddNumberToObject(cr, "pool_requests", K);
    cJSON_AddNumberToObject(cr, "max_tokens", O);
    cJSON_AddNumberToObject(cr, "repeats", reps);
    cJSON *rows = cJSON_AddArrayToObject(cr, "methods");
    char list[512];
    snprintf(list, sizeof(list), "dense,%s", o->own_methods);
    printf("\ncapacity through each method's own engine path: pool of %d dense requests (input + %d), "
           "max_tokens %d, %d repeats (median)\n", K, O, O, reps);
    printf("%-12s %8s | %6s %6s %6s | %9s %12s %8s %6s | %7s %7s\n", "method", "input", "R", "P", "batch",
           "prefill s", "decode t/s", "window", "preem", "batch x", "t/s x");
    double dense_tok[SB_MAX_LIST], dense_b[SB_MAX_LIST];
    for (int i = 0; i < ni; i++) dense_tok[i] = dense_b[i] = NAN;
    int rc = 0;
    char *save = NULL;
    for (char *m = strtok_r(list, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        if (!m[0] || (!strcmp(m, "dense") && cJSON_GetArraySize(rows) > 0)) continue;
        const bool dense = !strcmp(m, "dense");
        char knobs[1024], err[512];
        cJSON *row = cJSON_CreateObject();
        cJSON_AddItemToArray(rows, row);
        cJSON_AddStringToObject(row, "method", m);
        lethe_engine *e = make_engine(o, m, max_in + O + 1, knobs, sizeof(knobs), err, sizeof(err));
        cJSON_AddStringToObject(row, "knobs", knobs);
        if (!e) {
            fprintf(stderr, "lethe bench sparse: %s engine: %s\n", m, err);
            cJSON_AddStringToObject(row, "error", err);
            write_json(o, root);
            rc = 1;
            continue;
        }
        lethe_engine_layout lo;
        lethe_engine_get_layout(e, &lo);
        cJSON *pts = cJSON_AddArrayToObject(row, "points");
        for (int i = 0; i < ni; i++) {
            const int32_t L = ins[i];
            const int64_t Sv = (int64_t)K * (L + O);
            cJSON *pt = cJSON_CreateObject();
            cJSON_AddItemToArray(pts, pt);
            cJSON_AddNumberToObject(pt, "input", L);
            cJSON_AddNumberToObject(pt, "pool_slots_per_layer", (double)Sv);
            if (Sv > lo.kv_slots_per_layer) {
                cJSON_AddStringToObject(pt, "error", "the engine's pool is smaller than the planned one");
                fprintf(stderr, "lethe bench sparse: ownpath %s at %d: pool %d slots < %lld planned\n", m, L,
                        lo.kv_slots_per_layer, (long long)Sv);
                rc = 1;
                continue;
            }
            int32_t R = L + O, P = L + O, B = K;
            sb_run r;
            char label[96];
            if (!dense) { /* one probe request: what the method keeps after compaction */
                snprintf(label, sizeof(label), "%s probe", m);
                /* R: the most slots a layer holds after the 4th token (H2O and the like
                 * evict in decode steps; up to 3 decoded tokens more than steady R) */
                if (engine_run(e, label, 1, L, 6, o->seed, 4, !o->no_progress, &r) != 0 || r.res_max <= 0) {
                    cJSON_AddStringToObject(pt, "error", r.error[0] ? r.error : "no resident count");
                    fprintf(stderr, "lethe bench sparse: ownpath %s probe at %d: %s\n", m, L, r.error);
                    rc = 1;
                    continue;
                }
                R = r.res_max;
                P = 0;
                for (int32_t l = 0; l < lo.n_layers; l++)
                    P = LETHE_MAX(P, lethe_engine_max_resident(e, l, L, L + O, lo.max_num_batched_tokens));
                const int64_t steady = (int64_t)R + O;
                const int64_t b = Sv >= P ? LETHE_MIN(1 + (Sv - P) / steady, Sv / steady) : 0;
                B = (int32_t)LETHE_MIN(b, (int64_t)lo.max_num_seqs);
            }
            cJSON_AddNumberToObject(pt, "resident_R", R);
            cJSON_AddNumberToObject(pt, "prefill_peak_P", P);
            cJSON_AddNumberToObject(pt, "batch", B);
            cJSON_AddBoolToObject(pt, "batch_capped_by_max_num_seqs", B == lo.max_num_seqs && !dense);
            double tok[64], pre_s[64];
            int64_t preempt = 0, window = 0;
            cJSON *runs = cJSON_AddArrayToObject(pt, "runs");
            bool failed = B < 1;
            for (int k = 0; k < reps && !failed; k++) {
                snprintf(label, sizeof(label), "%s run %d/%d", m, k + 1, reps);
                if (engine_run(e, label, B, L, O, o->seed, 0, !o->no_progress, &r) != 0) {
                    cJSON_AddStringToObject(pt, "error", r.error);
                    fprintf(stderr, "lethe bench sparse: ownpath %s at %d: %s\n", m, L, r.error);
                    failed = true;
                    rc = 1;
                    break;
                }
                tok[k] = r.decode_tok_s, pre_s[k] = r.prefill_s;
                preempt += r.preemptions;
                window = k ? LETHE_MIN(window, r.window_steps) : r.window_steps;
                cJSON_AddItemToArray(runs, run_json(&r));
            }
            const int done = cJSON_GetArraySize(runs);
            const double med = median_finite(tok, done), med_pre = median_finite(pre_s, done);
            cJSON_AddNumberToObject(pt, "decode_tok_s_median", med);
            cJSON_AddNumberToObject(pt, "prefill_s_median", med_pre);
            cJSON_AddNumberToObject(pt, "decode_window_steps_min", (double)window);
            cJSON_AddNumberToObject(pt, "preemptions", (double)preempt);
            if (dense) dense_tok[i] = med, dense_b[i] = B;
            const double bx = B / dense_b[i], tx = med / dense_tok[i];
            cJSON_AddNumberToObject(pt, "batch_vs_dense", bx);
            cJSON_AddNumberToObject(pt, "tok_s_vs_dense", tx);
            printf("%-12s %8d | %6d %6d %6d | %9.2f %12.1f %8lld %6lld | %6.2fx %6.2fx%s\n", m, L, R, P, B, med_pre,
                   med, (long long)window, (long long)preempt, bx, tx,
                   window < 8 ? "  (short window: raise --ownpath-output)" : "");
            fflush(stdout);
            write_json(o, root);
        }
        lethe_engine_destroy(e);
    }
    return rc;
}

/* ---- part 2: matched batch ----------------------------------------------------------- */

static int part_matched(const sb_opts *o, cJSON *root) {
    char list[256];
    snprintf(list, sizeof(list), "dense,%s", o->matched_methods);
    const int32_t B = o->matched_batch, L = o->matched_input;
    /* every request decodes at least matched_output steps with the whole batch:
     * early requests may decode while later ones still prefill */
    const int32_t extra = (int32_t)(((int64_t)B * L + o->ep.max_num_batched_tokens - 1) / o->ep.max_num_batched_tokens);
    const int32_t max_tokens = o->matched_output + extra + 1;
    cJSON *mt = cJSON_AddObjectToObject(root, "matched");
    cJSON_AddNumberToObject(mt, "batch", B);
    cJSON_AddNumberToObject(mt, "input", L);
    cJSON_AddNumberToObject(mt, "max_tokens", max_tokens);
    cJSON_AddNumberToObject(mt, "matched_output_requested", o->matched_output);
    cJSON_AddNumberToObject(mt, "repeats", LETHE_MIN(o->repeats, 64));
    cJSON *rows = cJSON_AddArrayToObject(mt, "methods");
    printf("\nmatched batch %d x %d input, greedy, ignore_eos, max_tokens %d\n", B, L, max_tokens);
    printf("%-10s | %10s %12s | %12s %8s %6s | %7s | %12s %11s\n", "method", "prefill s", "prefill t/s",
           "decode t/s", "steps", "preem", "vs dense", "median-step", "slowest ms");
    double dense_tok_s = NAN;
    int rc = 0;
    char *save = NULL;
    for (char *m = strtok_r(list, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        if (!m[0] || (strcmp(m, "dense") == 0 && cJSON_GetArraySize(rows) > 0)) continue;
        char knobs[1024], err[512];
        cJSON *row = cJSON_CreateObject();
        cJSON_AddItemToArray(rows, row);
        cJSON_AddStringToObject(row, "method", m);
        double tl = lethe_time_s();
        lethe_engine *e = make_engine(o, m, L + max_tokens + 1, knobs, sizeof(knobs), err, sizeof(err));
        cJSON_AddStringToObject(row, "knobs", knobs);
        if (!e) {
            fprintf(stderr, "lethe bench sparse: %s engine: %s\n", m, err);
            cJSON_AddStringToObject(row, "error", err);
            printf("%-10s | failed: %.100s\n", m, err);
            write_json(o, root);
            rc = 1;
            continue;
        }
        cJSON_AddNumberToObject(row, "engine_load_s", lethe_time_s() - tl);
        lethe_engine_layout lo;
        lethe_engine_get_layout(e, &lo);
        cJSON_AddNumberToObject(row, "pool_slots_per_layer", lo.kv_slots_per_layer);
        /* capacity of a payload: KV bytes per token over all layers, tokens per GiB of KV */
        cJSON_AddNumberToObject(row, "kv_token_bytes", (double)lo.kv_token_bytes);
        /* what one slot really costs: the payload + the method's per-slot buffers (DeltaKV's centers) */
        const size_t slot_b = lo.kv_token_bytes + lo.kv_slot_overhead_bytes;
        cJSON_AddNumberToObject(row, "kv_slot_overhead_bytes", (double)lo.kv_slot_overhead_bytes);
        cJSON_AddNumberToObject(row, "kv_reserve_bytes", (double)lo.kv_reserve_bytes);
        cJSON_AddNumberToObject(row, "tokens_per_gib", slot_b ? 1073741824.0 / slot_b : 0);
        printf("%-10s | KV %zu B per token (+ %zu B method buffers), %.0f tokens per GiB, pool %d slots per layer, "
               "reserve %.2f GiB\n", m, lo.kv_token_bytes, lo.kv_slot_overhead_bytes,
               slot_b ? 1073741824.0 / slot_b : 0.0, lo.kv_slots_per_layer, lo.kv_reserve_bytes / 1073741824.0);
        sb_run r;
        /* --repeats runs of the same prompts; decode tokens/s is their median */
        double runs_tok[64], runs_p50[64], runs_max[64];
        int n_runs = 0, er = 0;
        cJSON *rruns = cJSON_CreateArray();
        for (int k = 0; k < LETHE_MIN(o->repeats, 64) && er == 0; k++) {
            er = engine_run(e, m, B, L, max_tokens, o->seed, 1, !o->no_progress, &r);
            if (er == 0)
                runs_tok[n_runs] = r.decode_tok_s, runs_p50[n_runs] = r.step_p50_s,
                runs_max[n_runs++] = r.step_max_s;
            cJSON_AddItemToArray(rruns, cJSON_CreateNumber(r.decode_tok_s));
        }
        if (er == 0) { /* the median over the runs of each */
            r.decode_tok_s = median_finite(runs_tok, n_runs);
            r.step_p50_s = median_finite(runs_p50, n_runs);
            r.step_max_s = median_finite(runs_max, n_runs);
        }
        lethe_engine_destroy(e);
        cJSON *rj = run_json(&r);
        cJSON *it;
        cJSON_ArrayForEach(it, rj) cJSON_AddItemToObject(row, it->string, cJSON_Duplicate(it, true));
        cJSON_Delete(rj);
        cJSON_AddItemToObject(row, "decode_tok_s_runs", rruns); /* decode_tok_s is their median */
        /* device slots a request holds per layer once its prompt is done (a
         * method that frees slots, e.g. RetroInfer's host tier, holds fewer
         * than its input); requests per pool = slots / (that + output) */
        if (er == 0 && r.res_max > 0) {
            cJSON_AddNumberToObject(row, "resident_after_prompt_max", r.res_max);
            printf("%-10s | %d device slots per layer per request after the prompt (input %d): "
                   "%.0f such requests per pool\n",
                   m, r.res_max, L, (double)lo.kv_slots_per_layer / (r.res_max + max_tokens));
        }
        if (!strcmp(m, "dense") && er == 0) dense_tok_s = r.decode_tok_s;
        double ratio = er == 0 ? r.decode_tok_s / dense_tok_s : NAN;
        cJSON_AddNumberToObject(row, "decode_vs_dense", ratio);
        if (er != 0) {
            fprintf(stderr, "lethe bench sparse: %s: %s\n", m, r.error);
            rc = 1;
        }
        printf("%-10s | %10.2f %12.0f | %12.1f %8lld %6lld | %6.2fx | %12.1f %11.1f%s\n", m, r.prefill_s,
               r.prefill_s > 0 ? (double)B * L / r.prefill_s : NAN, r.decode_tok_s, (long long)r.window_steps,
               (long long)r.preemptions, ratio, p50_step_tok_s(&r), r.step_max_s * 1e3, er ? "  (failed)" : "");
        fflush(stdout);
        write_json(o, root);
    }
    return rc;
}

/* ---- command ---------------------------------------------------------------------- */

int lethe_bench_sparse(int argc, char **argv) {
    sb_opts o = {.parts = "capacity,matched", .cap_method = "snapkv", .cap_inputs = "32768,131072",
                 .matched_methods = "quest,omnikv", .budget = 2048, .sink = LETHE_SPARSE_SINK_DEFAULT,
                 .recent = LETHE_SPARSE_RECENT_DEFAULT, .cap_output = 256, .engine_tokens = 131072,
                 .engine_output = 8, .decode_steps = 32, .matched_batch = 8, .matched_input = 32768,
                 .matched_output = 64, .seed = 1,
                 .own_methods = "snapkv,pyramidkv,h2o,streamingllm", .own_inputs = "16384",
                 .own_pool_requests = 2, .own_output = 128, .repeats = 1};
    lethe_engine_default_params(&o.ep);
    o.ep.model = "configs/llama-3.1-8b-instruct/config.json";
    o.ep.load_format = "dummy";
    o.ep.device = "cuda";
    o.ep.max_num_batched_tokens = 8192;
    lethe_opt rows[48];
    int n = 0;
#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}
    ROW("--model", "-m", LETHE_OPT_STR, &o.ep.model, "PATH", "model: .gguf, HF folder, or config.json (dummy)", 1, 0);
    ROW("--load-format", NULL, LETHE_OPT_STR, &o.ep.load_format, "FMT", "auto | gguf | hf | dummy", 1, 0);
    ROW("--device", NULL, LETHE_OPT_STR, &o.ep.device, "DEV", "cuda | cpu", 1, 0);
    ROW("--threads", "-t", LETHE_OPT_INT, &o.ep.n_threads, "N", "CPU threads (0 = all)", 0, 4096);
    ROW("--model-seed", NULL, LETHE_OPT_U64, &o.ep.seed, "N", "dummy weights seed", 1, 0);
    ROW("--gpu-memory-utilization", NULL, LETHE_OPT_FLOAT, &o.ep.gpu_memory_utilization, "F",
        "CUDA: fraction of free device memory (after weights and workspace) for the KV pool", 0.01, 1.0);
    ROW("--kv-cache-bytes", NULL, LETHE_OPT_BYTES, &o.ep.kv_cache_bytes, "SIZE", "CPU: KV pool budget", 1, 0);
    ROW("--max-num-batched-tokens", NULL, LETHE_OPT_INT, &o.ep.max_num_batched_tokens, "N",
        "tokens per engine step (prefill chunk)", 16, 1 << 20);
    ROW("--max-num-seqs", NULL, LETHE_OPT_INT, &o.ep.max_num_seqs, "N",
        "requests running at once: also caps the largest batch", 1, 65536);
    ROW("--parts", NULL, LETHE_OPT_STR, &o.parts, "LIST", "any of capacity, matched, ownpath", 1, 0);
    ROW("--repeats", NULL, LETHE_OPT_INT, &o.repeats, "N",
        "matched and ownpath parts: engine runs per configuration, decode tok/s is their median", 1, 64);
    ROW("--ownpath-methods", NULL, LETHE_OPT_STR, &o.own_methods, "LIST",
        "ownpath part: methods run after dense through their own engine path", 1, 0);
    ROW("--ownpath-inputs", NULL, LETHE_OPT_STR, &o.own_inputs, "LIST", "ownpath part: input lengths", 1, 0);
    ROW("--ownpath-pool-requests", NULL, LETHE_OPT_INT, &o.own_pool_requests, "K",
        "ownpath part: the planned pool holds K dense requests of input + output", 1, 4096);
    ROW("--ownpath-output", NULL, LETHE_OPT_INT, &o.own_output, "O",
        "ownpath part: max_tokens of every request (as requested; also the pool plan's output)", 2, 1 << 20);
    ROW("--budget", NULL, LETHE_OPT_INT, &o.budget, "T",
        "tokens per layer for every method: sink + recent + decode_keep_tokens", 2, 1 << 24);
    ROW("--sink", NULL, LETHE_OPT_INT, &o.sink, "N", "sink_keep_tokens (part of --budget)", 0, 1 << 20);
    ROW("--recent", NULL, LETHE_OPT_INT, &o.recent, "N", "recent_keep_tokens (part of --budget)", 0, 1 << 20);
    ROW("--capacity-method", NULL, LETHE_OPT_STR, &o.cap_method, "NAME", "eviction method of the capacity part", 1, 0);
    ROW("--capacity-inputs", NULL, LETHE_OPT_STR, &o.cap_inputs, "LIST", "capacity part: input lengths", 1, 0);
    ROW("--capacity-output", NULL, LETHE_OPT_INT, &o.cap_output, "O",
        "capacity part: output tokens every request is planned for", 1, 1 << 20);
    ROW("--engine-tokens", NULL, LETHE_OPT_INT, &o.engine_tokens, "N",
        "capacity part: prompt tokens of the real engine run per input length (requests = N / input, >= 1)", 1,
        1 << 30);
    ROW("--engine-output", NULL, LETHE_OPT_INT, &o.engine_output, "N",
        "capacity part: decode tokens per request of the engine run", 2, 1 << 20);
    ROW("--decode-steps", NULL, LETHE_OPT_INT, &o.decode_steps, "N",
        "capacity part: timed synthetic decode steps (<= --capacity-output; the first 2 are not timed)", 1, 1 << 20);
    ROW("--matched-methods", NULL, LETHE_OPT_STR, &o.matched_methods, "LIST",
        "matched part: methods run after dense at the same batch", 1, 0);
    ROW("--matched-batch", NULL, LETHE_OPT_INT, &o.matched_batch, "B", "matched part: requests", 1, 65536);
    ROW("--matched-input", NULL, LETHE_OPT_INT, &o.matched_input, "L", "matched part: prompt tokens", 1, 1 << 24);
    ROW("--matched-output", NULL, LETHE_OPT_INT, &o.matched_output, "N",
        "matched part: decode steps with the whole batch decoding", 1, 1 << 20);
    ROW("--seed", NULL, LETHE_OPT_U64, &o.seed, "N", "prompt token seed", 1, 0);
    ROW("--method-config", NULL, LETHE_OPT_STRLIST, o.method_config, "M:K=V,..",
        "extra knobs of method M, e.g. palu:palu_factors=DIR or turboquant:turboquant_bits=2 (repeatable)", 1, 0);
    ROW("--no-graph", NULL, LETHE_OPT_BOOL, &o.no_graph, NULL, "synthetic decode without CUDA graphs", 1, 0);
    ROW("--no-progress", NULL, LETHE_OPT_BOOL, &o.no_progress, NULL, "no progress line on stderr", 1, 0);
    ROW("--json", NULL, LETHE_OPT_STR, &o.json, "PATH", "write results as JSON (schema lethe-bench-sparse/1)", 1, 0);
#undef ROW
    const char *pos[1];
    int n_pos = 0;
    int pr = lethe_opts_parse(
        rows, n, argc, argv, "lethe bench sparse [options]",
        "Decode throughput of sparse methods vs dense. capacity: an eviction method's largest\n"
        "batch from the engine's KV planning (resident slots measured by a real engine run at each input\n"
        "length), decode tokens/s at that batch over synthetic resident KV, vs dense at its largest batch.\n"
        "matched: real engine runs of dense and --matched-methods at the same batch and prompts (window\n"
        "tokens/s, and the median and slowest full-batch step).\n"
        "ownpath: each method's largest batch in a pool of K dense requests, run for real through its own\n"
        "engine path (--repeats runs, median).",
        pos, &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    bool do_cap = strstr(o.parts, "capacity") != NULL, do_match = strstr(o.parts, "matched") != NULL;
    bool do_own = strstr(o.parts, "ownpath") != NULL;
    if (!do_cap && !do_match && !do_own) {
        fprintf(stderr, "lethe bench sparse: --parts %s: expected any of capacity, matched, ownpath\n", o.parts);
        return 2;
    }
    if (o.budget <= o.sink + o.recent) {
        fprintf(stderr, "lethe bench sparse: --budget %d must exceed --sink %d + --recent %d\n", o.budget, o.sink,
                o.recent);
        return 2;
    }
    cJSON *root = cJSON_CreateObject();
    char info[256];
    cJSON_AddStringToObject(root, "schema", "lethe-bench-sparse/1");
    lethe_runinfo_commit(info, sizeof(info));
    cJSON_AddStringToObject(root, "commit", info);
    lethe_runinfo_date(info, sizeof(info));
    cJSON_AddStringToObject(root, "date", info);
    lethe_runinfo_machine(info, sizeof(info));
    cJSON_AddStringToObject(root, "machine", info);
    cJSON_AddStringToObject(root, "model", o.ep.model);
    cJSON_AddStringToObject(root, "load_format", o.ep.load_format);
    cJSON_AddStringToObject(root, "device", o.ep.device);
    cJSON_AddNumberToObject(root, "budget", o.budget);
    cJSON_AddNumberToObject(root, "max_num_batched_tokens", o.ep.max_num_batched_tokens);
    cJSON_AddNumberToObject(root, "max_num_seqs", o.ep.max_num_seqs);
    if (!strcmp(o.ep.device, "cuda"))
        cJSON_AddNumberToObject(root, "gpu_memory_utilization", o.ep.gpu_memory_utilization);
    else
        cJSON_AddNumberToObject(root, "kv_cache_bytes", (double)o.ep.kv_cache_bytes);
    cJSON_AddBoolToObject(root, "cuda_graphs", !o.no_graph);
    char cmd[2048];
    size_t off = (size_t)snprintf(cmd, sizeof(cmd), "lethe bench sparse");
    for (int i = 1; i < argc && off < sizeof(cmd); i++)
        off += (size_t)snprintf(cmd + off, sizeof(cmd) - off, " %s", argv[i]);
    cJSON_AddStringToObject(root, "command", cmd);
    int rc = 0;
    if (do_cap) rc = part_capacity(&o, root);
    if (do_match) {
        int r2 = part_matched(&o, root); /* (LETHE_MAX would evaluate it twice) */
        rc = LETHE_MAX(rc, r2);
    }
    if (do_own) {
        int r3 = part_ownpath(&o, root);
        rc = LETHE_MAX(rc, r3);
    }
    write_json(&o, root);
    cJSON_Delete(root);
    return rc;
}

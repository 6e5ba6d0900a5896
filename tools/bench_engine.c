/* bench_engine.c - `lethe bench engine`: offline throughput against the
 * measured roofline of the device (no server, no tokenizer).
 *
 * The model comes from a file or from a config.json with dummy weights
 * (--load-format dummy). For every (batch, input length, output length) of
 * the sweep it prefills `batch` prompts of `input` random tokens (packed into
 * steps of up to --max-num-batched-tokens), then decodes `output` steps of
 * the whole batch (a point B:I:O:s skips the prefill and decodes over a
 * synthetic context of I tokens: large batches at long contexts without
 * paying their prefill), and reports:
 *   prefill tokens/s and the fraction of the compute roofline
 *       (matmul + causal attention FLOPs / measured bf16 GEMM peak);
 *   decode tokens/s, median step time and the fraction of the memory
 *       roofline ((weight bytes + KV bytes read per step) / measured copy
 *       bandwidth, at the mean context of the decode phase; MoE models count
 *       the experts a step's tokens choose, lethe_model_params_read).
 * The ceilings are measured in the same run (ops->measure_peaks: a large
 * device copy and an 8192^3 GEMM). KV layout: contiguous slots per sequence
 * (slot = seq * capacity + position), dense selection; steps go through
 * lethe_model_forward_uniform, so decode steps replay CUDA graphs unless
 * --no-graph. Hybrid models (linear-attention layers): those layers hold
 * one state slot per sequence instead of KV; the roofline's bytes count their
 * states read and written once per decode step, and the attention FLOPs and
 * KV bytes count the full-attention layers only. --attention adds attention-only sweeps of the backend's
 * attention op (the kernels the engine runs): decode (vs copy bandwidth) and
 * prefill (causal, vs the GEMM peak); dev/cuda/attn_bench compares the CUDA
 * kernel generations side by side. --profile wraps one call per attention
 * shape and the last decode step in the profiler range for `ncu
 * --profile-from-start off` (scripts/gpu-check.sh profile). --json writes
 * everything (scripts/plot_bench.py draws it). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "commands.h"
#include "core/log.h"
#include "core/util.h"
#include "model/forward_uniform.h"
#include "model/model.h"
#include "options.h"

#define MAX_SWEEP 16

typedef struct bench_opts {
    const char *model, *load_format, *device, *json, *cpu_weights;
    const char *batch, *input, *output, *attn_batch, *attn_ctx, *attn_prefill, *points;
    int32_t max_batched, threads, reps;
    uint64_t seed;
    bool no_graph, attention, skip_model, profile;
} bench_opts;

static int parse_list(const char *s, int32_t *out, const char *flag) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || v > 1 << 24 || n == MAX_SWEEP) {
            fprintf(stderr, "lethe bench engine: %s '%s': expected up to %d positive integers "
                            "separated by commas\n", flag, s, MAX_SWEEP);
            return -1;
        }
        out[n++] = (int32_t)v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') {
            fprintf(stderr, "lethe bench engine: %s '%s': unexpected '%c'\n", flag, s, *end);
            return -1;
        }
    }
    return n;
}

static double median(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0;
}

/* bytes of the matmul weights a decode step of B tokens reads (MoE: the
 * experts they choose, lethe_model_params_read), weight element size ws */
static double weight_bytes(const lethe_model_config *c, double ws, int32_t B) {
    return ws * lethe_model_params_read(c, B);
}

static double matmul_flops_per_token(const lethe_model_config *c) {
    return 2.0 * lethe_model_params_per_token(c);
}

/* ---- one (batch, input, output) point --------------------------------------- */

#define FILL_ROWS 4096 /* rows of the random block a synthetic context's KV is tiled with */

static void upload_random(lethe_backend *be, void *dst, size_t n);

/* A synthetic context's KV: rows [0, n_slots) of every attention layer's K
 * (and V) buffer [n_slots, width] := copies of one random block of
 * FILL_ROWS rows. Finite values in [-1, 1): memory as cudaMalloc hands it
 * out may hold NaNs, and NaN attention output would route every token of a
 * mixture-of-experts layer to the same first experts (NaN never wins a
 * comparison), so a batch would read fewer expert bytes than the roofline
 * counts. Linear-attention states are left as the memory holds them. */
static lethe_status fill_kv_random(lethe_backend *be, const lethe_model_config *c, void **kc,
                                   void **vc, size_t n_slots, int32_t width) {
    if (be->ops->act_size != be->ops->kv_size)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "synthetic context: the %s backend stores KV "
                                                   "in another type than activations",
                            be->ops->name);
    void *blk = NULL;
    lethe_status st = be->ops->alloc(be, (size_t)FILL_ROWS * width * be->ops->act_size, &blk);
    if (st != LETHE_OK) return st;
    upload_random(be, blk, (size_t)FILL_ROWS * width);
    int32_t *rows = lethe_xmalloc(FILL_ROWS * sizeof(int32_t));
    for (size_t r0 = 0; r0 < n_slots; r0 += FILL_ROWS) {
        const int32_t nr = (int32_t)LETHE_MIN((size_t)FILL_ROWS, n_slots - r0);
        for (int32_t i = 0; i < nr; i++) rows[i] = (int32_t)(r0 + (size_t)i);
        for (int l = 0; l < c->n_layers; l++) {
            if (lethe_layer_is_linear(c, l)) continue; /* kc / vc hold its states */
            if (kc[l]) be->ops->copy_block(be, kc[l], width, 0, rows, blk, width, nr, width);
            if (vc[l]) be->ops->copy_block(be, vc[l], width, 0, rows, blk, width, nr, width);
        }
    }
    be->ops->sync(be);
    free(rows);
    be->ops->release(be, blk);
    return LETHE_OK;
}

typedef struct point {
    int32_t batch, input, output;
    bool synthetic;  /* decode over a synthetic context of `input` tokens, no prefill */
    double prefill_s, prefill_tok_s, prefill_tflops, prefill_frac;
    double step_ms, decode_tok_s, decode_bytes, decode_frac, decode_gbs;
    int64_t replays, captures, eager;
} point;

static lethe_status run_point(lethe_model *m, const bench_opts *o, int32_t B, int32_t in,
                              int32_t out, bool synthetic, double copy_bps, double gemm_fps,
                              point *pt) {
    const lethe_model_config *c = &m->cfg;
    lethe_backend *be = m->be;
    const int32_t cap = in + out, kv_dim = c->n_kv_heads * c->head_dim;
    const size_t kv_bytes = (size_t)B * cap * kv_dim * be->ops->kv_size;
    const bool k_only = lethe_kv_k_only(c); /* latent KV: one row per token, no V */
    void **kc = lethe_xcalloc((size_t)c->n_layers, sizeof(void *));
    void **vc = lethe_xcalloc((size_t)c->n_layers, sizeof(void *));
    lethe_status st = LETHE_OK;
    const int32_t kv_layers = c->n_layers - c->n_linear_layers;
    for (int l = 0; l < c->n_layers && st == LETHE_OK; l++) {
        if (lethe_layer_is_linear(c, l)) { /* states of the B sequences (state slot = sequence) */
            st = be->ops->alloc(be, lethe_model_state_rec_bytes(c, B), &kc[l]);
            if (st == LETHE_OK) st = be->ops->alloc(be, lethe_model_state_conv_bytes(c, B), &vc[l]);
            continue;
        }
        st = be->ops->alloc(be, kv_bytes, &kc[l]);
        if (st == LETHE_OK && !k_only) st = be->ops->alloc(be, kv_bytes, &vc[l]);
    }
    const int32_t maxb = o->max_batched;
    const int32_t n_buf = LETHE_MAX(maxb, B);
    int32_t *tok = lethe_xmalloc((size_t)n_buf * sizeof(int32_t));
    int32_t *pos = lethe_xmalloc((size_t)n_buf * sizeof(int32_t));
    int32_t *store = lethe_xmalloc((size_t)n_buf * sizeof(int32_t));
    int32_t *seq_begin = lethe_xmalloc(((size_t)n_buf + 1) * sizeof(int32_t));
    int32_t *sel_begin = lethe_xmalloc(((size_t)n_buf + 1) * sizeof(int32_t));
    int32_t *logit_rows = lethe_xmalloc((size_t)n_buf * sizeof(int32_t));
    int32_t *state_slots = lethe_xmalloc((size_t)n_buf * sizeof(int32_t));
    const bool hybrid = c->n_linear_layers > 0;
    int32_t *sel = lethe_xmalloc((size_t)B * cap * sizeof(int32_t));
    float *logits = lethe_xmalloc((size_t)n_buf * c->n_vocab * sizeof(float));
    uint64_t rng = o->seed ^ 0x5eedull;
    lethe_graph_state *gs = lethe_xcalloc(1, sizeof(*gs));
    if (st != LETHE_OK) goto done;
    if (synthetic && (st = fill_kv_random(be, c, kc, vc, (size_t)B * cap, kv_dim)) != LETHE_OK)
        goto done;

    /* prefill: whole prompts packed into steps of <= maxb tokens; a prompt
     * longer than maxb is split into chunks that extend its own prefix. A
     * synthetic point skips it: decode reads `in` slots per sequence (random
     * rows, fill_kv_random; states as the memory holds them); the time of a step does not depend
     * on the values, and no real prefill of B x in tokens is paid for. */
    double t0 = lethe_time_s();
    int32_t s = synthetic ? B : 0, done_tok = 0; /* next sequence and its prefilled length */
    while (s < B) {
        int32_t n = 0, S = 0;
        seq_begin[0] = 0;
        sel_begin[0] = 0;
        int32_t n_sel = 0;
        while (s < B && n < maxb) {
            int32_t take = LETHE_MIN(in - done_tok, maxb - n);
            for (int32_t j = 0; j < take; j++) {
                tok[n + j] = (int32_t)(lethe_splitmix64(&rng) % (uint64_t)c->n_vocab);
                pos[n + j] = done_tok + j;
                store[n + j] = s * cap + done_tok + j;
            }
            for (int32_t e = 0; e < done_tok + take; e++) sel[n_sel + e] = s * cap + e;
            n_sel += done_tok + take;
            n += take;
            logit_rows[S] = n - 1;
            state_slots[S] = s;
            seq_begin[++S] = n;
            sel_begin[S] = n_sel;
            done_tok += take;
            if (done_tok == in) {
                s++;
                done_tok = 0;
            }
        }
        lethe_fwd_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .n_seqs = S,
                             .seq_begin = seq_begin, .n_logits = S, .logit_rows = logit_rows,
                             .state_slots = hybrid ? state_slots : NULL};
        lethe_layer_plan plan = {.store_slots = store, .sel_begin = sel_begin, .sel_slots = sel};
        lethe_model_forward_uniform(m, &b, kc, vc, &plan, false, gs, logits);
    }
    pt->prefill_s = synthetic ? 0 : lethe_time_s() - t0;
    pt->prefill_tok_s = synthetic ? 0 : (double)B * in / pt->prefill_s;
    /* q.k and p.v per (query, key) pair and head; latent attention: k over the
     * latent + RoPE key, v over the latent (the absorbed form the model runs) */
    const double kv_w = k_only ? (double)c->head_dim + c->kv_lora_rank : 2.0 * c->head_dim;
    double attn_flops = 2.0 * kv_layers * c->n_heads * kv_w * ((double)in * (in + 1) / 2);
    double flops = (double)B * (in * matmul_flops_per_token(c) + attn_flops) +
                   2.0 * B * (double)c->n_vocab * c->dim;
    pt->prefill_tflops = synthetic ? 0 : flops / pt->prefill_s * 1e-12;
    pt->prefill_frac = gemm_fps > 0 && !synthetic ? flops / gemm_fps / pt->prefill_s : 0;

    /* decode: `out` steps of the whole batch */
    double *steps = lethe_xmalloc((size_t)(out ? out : 1) * sizeof(double));
    for (int32_t step = 0; step < out; step++) {
        const int32_t ctx = in + step; /* tokens before this one */
        int32_t n_sel = 0;
        seq_begin[0] = sel_begin[0] = 0;
        for (int32_t q = 0; q < B; q++) {
            tok[q] = (int32_t)(lethe_splitmix64(&rng) % (uint64_t)c->n_vocab);
            pos[q] = ctx;
            store[q] = q * cap + ctx;
            logit_rows[q] = q;
            state_slots[q] = q;
            seq_begin[q + 1] = q + 1;
            for (int32_t e = 0; e <= ctx; e++) sel[n_sel + e] = q * cap + e;
            n_sel += ctx + 1;
            sel_begin[q + 1] = n_sel;
        }
        lethe_fwd_batch b = {.n_tokens = B, .tokens = tok, .pos = pos, .n_seqs = B,
                             .seq_begin = seq_begin, .n_logits = B, .logit_rows = logit_rows,
                             .state_slots = hybrid ? state_slots : NULL};
        lethe_layer_plan plan = {.store_slots = store, .sel_begin = sel_begin, .sel_slots = sel};
        const bool prof = o->profile && step == out - 1 && lethe_backend_has(be, LETHE_BE_PROFILER);
        if (prof) be->ops->profile_range(be, true);
        double ts = lethe_time_s();
        lethe_model_forward_uniform(m, &b, kc, vc, &plan, !o->no_graph, gs, logits);
        steps[step] = lethe_time_s() - ts;
        if (prof) be->ops->profile_range(be, false);
    }
    /* the first two steps run eagerly / capture: report the steady state */
    int skip = out > 4 ? 2 : 0;
    pt->step_ms = median(steps + skip, out - skip) * 1e3;
    free(steps);
    pt->decode_tok_s = pt->step_ms > 0 ? B / (pt->step_ms * 1e-3) : 0;
    double mean_ctx = in + out / 2.0;
    /* matrices as held (stored formats on the CPU): bytes per parameter of this model */
    const double ws = m->matrix_bytes ? (double)m->matrix_bytes / lethe_model_params_read(c, 1 << 20)
                                      : (double)be->ops->kv_size;
    pt->decode_bytes = weight_bytes(c, ws, B) +
                       (double)B * mean_ctx * kv_layers * (k_only ? 1.0 : 2.0) * kv_dim *
                           be->ops->kv_size +
                       2.0 * B * c->n_linear_layers * (double)lethe_lin_state_bytes(c);
    pt->decode_gbs = pt->step_ms > 0 ? pt->decode_bytes / (pt->step_ms * 1e-3) * 1e-9 : 0;
    pt->decode_frac = copy_bps > 0 && pt->step_ms > 0
                          ? pt->decode_bytes / copy_bps / (pt->step_ms * 1e-3) : 0;
    pt->replays = gs->n_replays;
    pt->captures = gs->n_captures;
    pt->eager = gs->n_eager;
done:
    if (be->ops->graph_reset) be->ops->graph_reset(be); /* graphs hold these KV buffers */
    for (int l = 0; l < c->n_layers; l++) {
        if (kc[l]) be->ops->release(be, kc[l]);
        if (vc[l]) be->ops->release(be, vc[l]);
    }
    free(kc), free(vc), free(tok), free(pos), free(store), free(seq_begin), free(sel_begin);
    free(state_slots);
    free(logit_rows), free(sel), free(logits), free(gs);
    return st;
}

/* ---- attention alone ----------------------------------------------------------- */

/* Times `reps` calls of a (after 3 warm-up calls); with `profile`, one more
 * call inside the profiler range (ncu --profile-from-start off). */
static double time_attention(lethe_backend *be, const lethe_attn_args *a, int reps, bool profile) {
    for (int r = 0; r < 3; r++) be->ops->attention(be, a);
    be->ops->sync(be);
    double t0 = lethe_time_s();
    for (int r = 0; r < reps; r++) be->ops->attention(be, a);
    be->ops->sync(be);
    double t = (lethe_time_s() - t0) / reps;
    if (profile && lethe_backend_has(be, LETHE_BE_PROFILER)) {
        be->ops->profile_range(be, true);
        be->ops->attention(be, a);
        be->ops->profile_range(be, false);
    }
    return t;
}

static void upload_random(lethe_backend *be, void *dst, size_t n) {
    const size_t chunk = (size_t)1 << 22;
    float *h = lethe_xmalloc(LETHE_MIN(chunk, n ? n : 1) * sizeof(float));
    uint64_t rng = 99;
    for (size_t r = 0; r < LETHE_MIN(chunk, n); r++)
        h[r] = (float)((lethe_splitmix64(&rng) >> 40) * 0x1p-24) * 2.0f - 1.0f;
    const size_t es = be->ops->act_size;
    for (size_t off = 0; off < n; off += chunk)
        be->ops->act_from_host(be, (char *)dst + off * es, h, LETHE_MIN(chunk, n - off));
    free(h);
}

/* Times the attention call `a` and prints "| us rate frac". `work` is what one
 * call moves or computes (bytes or FLOPs), `ceiling` the same-run device rate
 * for it (copy bytes/s or GEMM FLOP/s; 0 = unknown), `unit` scales work/s into
 * the printed rate (1e-9: GB/s, 1e-12: TFLOP/s). JSON: e gets {us, rate_key,
 * frac_key}. */
static void time_entry(lethe_backend *be, const lethe_attn_args *a, int reps, bool profile,
                       double work, double ceiling, double unit, const char *rate_key,
                       const char *frac_key, cJSON *e) {
    const double t = time_attention(be, a, reps, profile);
    const double rate = work / t * unit, frac = ceiling > 0 ? work / ceiling / t : 0;
    printf(" | %9.1f %8.1f %6.1f%%", t * 1e6, rate, 100 * frac);
    cJSON_AddNumberToObject(e, "us", t * 1e6);
    cJSON_AddNumberToObject(e, rate_key, rate);
    cJSON_AddNumberToObject(e, frac_key, frac);
}

/* Decode attention (one query per sequence, dense selection of ctx slots):
 * bytes of K + V read per call vs the copy bandwidth; the entry's us / gb_s /
 * frac_copy are what the engine runs (bench/peer_hf.py compares them with
 * torch). */
static cJSON *attention_sweep(lethe_backend *be, const lethe_model_config *c, const int32_t *bs,
                              int nb, const int32_t *ctxs, int nc, double copy_bps, int reps,
                              bool profile) {
    cJSON *arr = cJSON_CreateArray();
    const int32_t H = c->n_heads, KV = c->n_kv_heads, D = c->head_dim, kv_dim = KV * D;
    printf("\ndecode attention alone (H=%d KV=%d D=%d, %s KV, %d reps)\n", H, KV, D,
           be->ops->kv_size == 2 ? "bf16" : "f32", reps);
    printf("%6s %8s | %9s %8s %7s\n", "batch", "ctx", "us/call", "GB/s", "of copy");
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < nc; j++) {
            const int32_t B = bs[i], L = ctxs[j];
            const size_t slots = (size_t)B * L;
            void *k = NULL, *v = NULL, *q = NULL, *o = NULL;
            if (be->ops->alloc(be, slots * kv_dim * be->ops->kv_size, &k) != LETHE_OK ||
                be->ops->alloc(be, slots * kv_dim * be->ops->kv_size, &v) != LETHE_OK ||
                be->ops->alloc(be, (size_t)B * H * D * be->ops->act_size, &q) != LETHE_OK ||
                be->ops->alloc(be, (size_t)B * H * D * be->ops->act_size, &o) != LETHE_OK) {
                fprintf(stderr, "attention sweep: batch %d ctx %d does not fit, skipped\n", B, L);
                if (k) be->ops->release(be, k);
                if (v) be->ops->release(be, v);
                if (q) be->ops->release(be, q);
                continue;
            }
            /* random K, V, q (never zeros) */
            upload_random(be, k, slots * kv_dim);
            upload_random(be, v, slots * kv_dim);
            upload_random(be, q, (size_t)B * H * D);
            int32_t *qb = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
            int32_t *sb = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
            int32_t *sel = lethe_xmalloc(slots * sizeof(int32_t));
            for (int32_t s = 0; s <= B; s++) qb[s] = s, sb[s] = s * L;
            for (size_t e = 0; e < slots; e++) sel[e] = (int32_t)e;
            const int32_t *arrays[3] = {qb, sb, sel};
            size_t counts[3] = {(size_t)B + 1, (size_t)B + 1, slots};
            be->ops->stage_step(be, arrays, counts, 3);
            lethe_attn_args a = {.out = o, .q = q, .k_cache = k, .v_cache = v, .n_tokens = B,
                                 .n_seqs = B, .q_begin = qb, .sel_begin = sb, .sel_slots = sel,
                                 .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                                 .scale = 1.0f / sqrtf((float)D)};
            const double bytes = 2.0 * slots * kv_dim * be->ops->kv_size;
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "batch", B);
            cJSON_AddNumberToObject(e, "ctx", L);
            printf("%6d %8d", B, L);
            time_entry(be, &a, reps, profile, bytes, copy_bps, 1e-9, "gb_s", "frac_copy", e);
            printf("\n");
            fflush(stdout);
            cJSON_AddItemToArray(arr, e);
            be->ops->unstage(be);
            be->ops->release(be, k), be->ops->release(be, v);
            be->ops->release(be, q), be->ops->release(be, o);
            free(qb), free(sb), free(sel);
        }
    return arr;
}

/* Prefill attention alone: one sequence of L new tokens, causal over itself
 * (dense selection), FLOPs 4 H D L (L + 1) / 2 vs the measured GEMM peak. */
static cJSON *prefill_attention_sweep(lethe_backend *be, const lethe_model_config *c,
                                      const int32_t *lens, int nl, double gemm_fps, int reps,
                                      bool profile) {
    cJSON *arr = cJSON_CreateArray();
    const int32_t H = c->n_heads, KV = c->n_kv_heads, D = c->head_dim, kv_dim = KV * D;
    printf("\nprefill attention alone (H=%d KV=%d D=%d, causal, one sequence, %d reps)\n", H, KV,
           D, reps);
    printf("%8s | %9s %8s %7s\n", "tokens", "us/call", "TFLOP/s", "of pk");
    for (int i = 0; i < nl; i++) {
        const int32_t L = lens[i];
        void *k = NULL, *v = NULL, *q = NULL, *o = NULL;
        if (be->ops->alloc(be, (size_t)L * kv_dim * be->ops->kv_size, &k) != LETHE_OK ||
            be->ops->alloc(be, (size_t)L * kv_dim * be->ops->kv_size, &v) != LETHE_OK ||
            be->ops->alloc(be, (size_t)L * H * D * be->ops->act_size, &q) != LETHE_OK ||
            be->ops->alloc(be, (size_t)L * H * D * be->ops->act_size, &o) != LETHE_OK) {
            fprintf(stderr, "prefill attention sweep: %d tokens do not fit, skipped\n", L);
            if (k) be->ops->release(be, k);
            if (v) be->ops->release(be, v);
            if (q) be->ops->release(be, q);
            continue;
        }
        upload_random(be, k, (size_t)L * kv_dim);
        upload_random(be, v, (size_t)L * kv_dim);
        upload_random(be, q, (size_t)L * H * D);
        int32_t qb[2] = {0, L}, sb[2] = {0, L};
        int32_t *sel = lethe_xmalloc((size_t)L * sizeof(int32_t));
        for (int32_t e = 0; e < L; e++) sel[e] = e;
        const int32_t *arrays[3] = {qb, sb, sel};
        size_t counts[3] = {2, 2, (size_t)L};
        be->ops->stage_step(be, arrays, counts, 3);
        lethe_attn_args a = {.out = o, .q = q, .k_cache = k, .v_cache = v, .n_tokens = L,
                             .n_seqs = 1, .q_begin = qb, .sel_begin = sb, .sel_slots = sel,
                             .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                             .scale = 1.0f / sqrtf((float)D)};
        const double flops = 4.0 * H * D * ((double)L * (L + 1) / 2);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "tokens", L);
        cJSON_AddNumberToObject(e, "flops", flops);
        printf("%8d", L);
        time_entry(be, &a, reps, profile, flops, gemm_fps, 1e-12, "tflops", "frac_gemm_peak", e);
        printf("\n");
        fflush(stdout);
        cJSON_AddItemToArray(arr, e);
        be->ops->unstage(be);
        be->ops->release(be, k), be->ops->release(be, v);
        be->ops->release(be, q), be->ops->release(be, o);
        free(sel);
    }
    return arr;
}

int lethe_bench_engine(int argc, char **argv) {
    bench_opts o = {.model = "configs/llama-3.1-8b-instruct/config.json", .load_format = "auto",
                    .device = "cuda", .batch = "1,8,32,64", .input = "1024", .output = "64",
                    .attn_batch = "8,64", .attn_ctx = "4096,16384,32768", .attn_prefill = "8192",
                    .max_batched = 8192,
                    .reps = 20, .seed = 0};
    lethe_opt rows[] = {
        {"--model", "-m", LETHE_OPT_STR, &o.model, "PATH", "model: .gguf, HF folder, or config.json (dummy)", 1, 0},
        {"--load-format", NULL, LETHE_OPT_STR, &o.load_format, "FMT", "auto | gguf | hf | dummy", 1, 0},
        {"--device", NULL, LETHE_OPT_STR, &o.device, "DEV", "cuda | cpu", 1, 0},
        {"--threads", "-t", LETHE_OPT_INT, &o.threads, "N", "CPU threads (0 = all)", 0, 4096},
        {"--cpu-weights", NULL, LETHE_OPT_STR, &o.cpu_weights, "native|exact|fp32", "CPU weights as stored with 16-bit activations (native), as stored with f32 activations (exact) or dequantized at load (fp32)", 1, 0},
        {"--batch", "-b", LETHE_OPT_STR, &o.batch, "LIST", "batch sizes, comma separated", 1, 0},
        {"--input-len", "-i", LETHE_OPT_STR, &o.input, "LIST", "prompt lengths", 1, 0},
        {"--output-len", "-o", LETHE_OPT_STR, &o.output, "LIST", "decode steps", 1, 0},
        {"--points", NULL, LETHE_OPT_STR, &o.points, "B:I:O,...", "explicit (batch:input:output) points instead of the sweep; B:I:O:s decodes over a synthetic context of I tokens (no prefill)", 1, 0},
        {"--max-num-batched-tokens", NULL, LETHE_OPT_INT, &o.max_batched, "N", "tokens per prefill step", 1, 1 << 20},
        {"--no-graph", "--enforce-eager", LETHE_OPT_BOOL, &o.no_graph, NULL, "decode eagerly (no CUDA graphs)", 1, 0},
        {"--attention", NULL, LETHE_OPT_BOOL, &o.attention, NULL, "also time decode attention alone", 1, 0},
        {"--attention-only", NULL, LETHE_OPT_BOOL, &o.skip_model, NULL, "only the attention sweep (model from config, no weights)", 1, 0},
        {"--attn-batch", NULL, LETHE_OPT_STR, &o.attn_batch, "LIST", "attention sweep batch sizes", 1, 0},
        {"--attn-ctx", NULL, LETHE_OPT_STR, &o.attn_ctx, "LIST", "attention sweep context lengths", 1, 0},
        {"--attn-prefill", NULL, LETHE_OPT_STR, &o.attn_prefill, "LIST", "prefill attention sweep lengths (one sequence, causal)", 1, 0},
        {"--reps", NULL, LETHE_OPT_INT, &o.reps, "N", "timed repetitions (attention sweep)", 1, 100000},
        {"--profile", NULL, LETHE_OPT_BOOL, &o.profile, NULL, "profiler range (ncu --profile-from-start off) around one call per attention shape and the last decode step", 1, 0},
        {"--seed", NULL, LETHE_OPT_U64, &o.seed, "N", "dummy weights and token seed", 1, 0},
        {"--json", NULL, LETHE_OPT_STR, &o.json, "PATH", "write results as JSON", 1, 0},
    };
    const char *pos[1];
    int n_pos = 0;
    int r = lethe_opts_parse(rows, (int)LETHE_ARRAY_LEN(rows), argc, argv,
                             "lethe bench engine [options]",
                             "Offline prefill/decode throughput vs the measured device roofline.",
                             pos, &n_pos, 0);
    if (r) return r > 0 ? 0 : 2;
    int32_t bs[MAX_SWEEP], ins[MAX_SWEEP], outs[MAX_SWEEP], abs_[MAX_SWEEP], actx[MAX_SWEEP];
    int32_t apf[MAX_SWEEP];
    int nb = parse_list(o.batch, bs, "--batch"), ni = parse_list(o.input, ins, "--input-len");
    int no = parse_list(o.output, outs, "--output-len");
    int nab = parse_list(o.attn_batch, abs_, "--attn-batch"), nac = parse_list(o.attn_ctx, actx, "--attn-ctx");
    int napf = parse_list(o.attn_prefill, apf, "--attn-prefill");
    if (nb < 0 || ni < 0 || no < 0 || nab < 0 || nac < 0 || napf < 0) return 2;
    /* the run list: explicit points, or the cross product of the sweep lists */
    int32_t pb[MAX_SWEEP * MAX_SWEEP], pi[MAX_SWEEP * MAX_SWEEP], po[MAX_SWEEP * MAX_SWEEP];
    bool psyn[MAX_SWEEP * MAX_SWEEP] = {false};
    int np = 0;
    if (o.points) {
        const char *p = o.points;
        while (*p && np < MAX_SWEEP * MAX_SWEEP) {
            int consumed = 0;
            if (sscanf(p, "%d:%d:%d%n", &pb[np], &pi[np], &po[np], &consumed) != 3 || pb[np] <= 0 ||
                pi[np] <= 0 || po[np] < 0) {
                fprintf(stderr, "lethe bench engine: --points '%s': expected B:I:O,B:I:O,...\n",
                        o.points);
                return 2;
            }
            p += consumed;
            if (!strncmp(p, ":s", 2) && (p[2] == ',' || !p[2])) { /* B:I:O:s = synthetic context */
                psyn[np] = true;
                p += 2;
            }
            np++;
            if (*p == ',') p++;
            else if (*p) {
                fprintf(stderr, "lethe bench engine: --points '%s': unexpected '%c'\n", o.points, *p);
                return 2;
            }
        }
    } else {
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < ni; j++)
                for (int k = 0; k < no; k++) pb[np] = bs[i], pi[np] = ins[j], po[np++] = outs[k];
    }

    lethe_backend_params bp = {.device = o.device, .n_threads = o.threads, .device_index = 0};
    lethe_backend *be = NULL;
    if ((o.cpu_weights && lethe_cpu_weights_parse(o.cpu_weights, &bp.cpu_weights) != LETHE_OK) ||
        lethe_backend_create(&bp, &be) != LETHE_OK) {
        fprintf(stderr, "lethe bench engine: %s\n", lethe_last_error());
        return 1;
    }
    double copy_bps = 0, gemm_fps = 0;
    if (be->ops->measure_peaks(be, &copy_bps, &gemm_fps) != LETHE_OK) {
        fprintf(stderr, "lethe bench engine: %s\n", lethe_last_error());
        lethe_backend_destroy(be);
        return 1;
    }
    printf("device %s: copy %.0f GB/s (read + write), GEMM %.1f TFLOP/s\n", be->ops->name,
           copy_bps * 1e-9, gemm_fps * 1e-12);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "device", be->ops->name);
    cJSON_AddStringToObject(root, "model", o.model);
    cJSON_AddNumberToObject(root, "copy_gb_s", copy_bps * 1e-9);
    cJSON_AddNumberToObject(root, "gemm_tflops", gemm_fps * 1e-12);
    cJSON_AddBoolToObject(root, "cuda_graphs", !o.no_graph);
    int rc = 0;

    lethe_model m = {0};
    lethe_load_format fmt;
    if (lethe_load_format_parse(o.load_format, &fmt) != LETHE_OK) {
        fprintf(stderr, "lethe bench engine: %s\n", lethe_last_error());
        rc = 2;
        goto out;
    }
    if (o.skip_model) {
        lethe_model_config cfg;
        if (lethe_hf_config_load(o.model, &cfg) != LETHE_OK) {
            fprintf(stderr, "lethe bench engine: %s\n", lethe_last_error());
            rc = 1;
            goto out;
        }
        cJSON_AddItemToObject(root, "attention", attention_sweep(be, &cfg, abs_, nab, actx, nac,
                                                                 copy_bps, o.reps, o.profile));
        cJSON_AddItemToObject(root, "prefill_attention",
                              prefill_attention_sweep(be, &cfg, apf, napf, gemm_fps, o.reps, o.profile));
        goto out;
    }
    lethe_model_load_params lp = {.path = o.model, .format = fmt, .seed = o.seed, .progress = false};
    double tl = lethe_time_s();
    if (lethe_model_load(&lp, be, &m) != LETHE_OK) {
        fprintf(stderr, "lethe bench engine: %s\n", lethe_last_error());
        rc = 1;
        goto out;
    }
    printf("model %s: %d layers, dim %d, heads %d/%d, vocab %d, loaded in %.1f s\n", o.model,
           m.cfg.n_layers, m.cfg.dim, m.cfg.n_heads, m.cfg.n_kv_heads, m.cfg.n_vocab,
           lethe_time_s() - tl);
    int32_t max_b = 1;
    for (int i = 0; i < np; i++) max_b = LETHE_MAX(max_b, pb[i]);
    if (lethe_model_workspace_init(&m, LETHE_MAX(o.max_batched, max_b)) != LETHE_OK) {
        fprintf(stderr, "lethe bench engine: %s\n", lethe_last_error());
        rc = 1;
        goto out;
    }
    cJSON *pts = cJSON_AddArrayToObject(root, "points");
    printf("%6s %7s %6s | %12s %8s %6s | %9s %12s %9s %6s\n", "batch", "input", "output",
           "prefill t/s", "TFLOP/s", "of pk", "step ms", "decode t/s", "GB/s", "of bw");
    for (int i = 0; i < np; i++) {
                point pt = {.batch = pb[i], .input = pi[i], .output = po[i], .synthetic = psyn[i]};
                if (run_point(&m, &o, pb[i], pi[i], po[i], psyn[i], copy_bps, gemm_fps, &pt) !=
                    LETHE_OK) {
                    fprintf(stderr, "batch %d input %d output %d skipped: %s\n", pb[i], pi[i],
                            po[i], lethe_last_error());
                    continue;
                }
                printf("%6d %7d %6d | %12.0f %8.1f %5.1f%% | %9.3f %12.1f %9.0f %5.1f%%\n",
                       pt.batch, pt.input, pt.output, pt.prefill_tok_s, pt.prefill_tflops,
                       100 * pt.prefill_frac, pt.step_ms, pt.decode_tok_s, pt.decode_gbs,
                       100 * pt.decode_frac);
                fflush(stdout);
                cJSON *e = cJSON_CreateObject();
                cJSON_AddNumberToObject(e, "batch", pt.batch);
                cJSON_AddNumberToObject(e, "input", pt.input);
                cJSON_AddNumberToObject(e, "output", pt.output);
                cJSON_AddBoolToObject(e, "synthetic_context", pt.synthetic);
                cJSON_AddNumberToObject(e, "prefill_s", pt.prefill_s);
                cJSON_AddNumberToObject(e, "prefill_tok_s", pt.prefill_tok_s);
                cJSON_AddNumberToObject(e, "prefill_tflops", pt.prefill_tflops);
                cJSON_AddNumberToObject(e, "prefill_frac_gemm_peak", pt.prefill_frac);
                cJSON_AddNumberToObject(e, "decode_step_ms", pt.step_ms);
                cJSON_AddNumberToObject(e, "decode_tok_s", pt.decode_tok_s);
                cJSON_AddNumberToObject(e, "decode_bytes_per_step", pt.decode_bytes);
                cJSON_AddNumberToObject(e, "decode_gb_s", pt.decode_gbs);
                cJSON_AddNumberToObject(e, "decode_frac_copy_bw", pt.decode_frac);
                cJSON_AddNumberToObject(e, "graph_replays", (double)pt.replays);
                cJSON_AddNumberToObject(e, "graph_captures", (double)pt.captures);
                cJSON_AddItemToArray(pts, e);
            }
            if (o.attention && lethe_kv_k_only(&m.cfg)) {
                printf("--attention: the attention-only sweeps time K / V heads; %s has latent KV "
                       "(its attention is part of the decode points above)\n",
                       m.cfg.arch);
            } else if (o.attention) {
                cJSON_AddItemToObject(
                    root, "attention",
                    attention_sweep(be, &m.cfg, abs_, nab, actx, nac, copy_bps, o.reps, o.profile));
                cJSON_AddItemToObject(
                    root, "prefill_attention",
                    prefill_attention_sweep(be, &m.cfg, apf, napf, gemm_fps, o.reps, o.profile));
            }
out:
    if (o.json) {
        char *txt = cJSON_Print(root);
        FILE *f = fopen(o.json, "w");
        if (!f || fputs(txt, f) < 0) {
            fprintf(stderr, "lethe bench engine: --json %s: cannot write\n", o.json);
            rc = rc ? rc : 1;
        }
        if (f) fclose(f);
        free(txt);
    }
    cJSON_Delete(root);
    if (m.arch) lethe_model_free(&m);
    lethe_backend_destroy(be);
    return rc;
}

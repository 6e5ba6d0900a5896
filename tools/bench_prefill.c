/* bench_prefill.c - `lethe bench prefill`: what a prefill-axis method
 * (flashprefill, omnikv_prefill: they change what prefill attention reads,
 * never the KV) buys in prefill time, against dense in the same run.
 *
 * For each method (dense first) one engine is created (prefix caching off,
 * max_model_len = the longest input + 2) and, per --inputs L: a warm-up
 * request of --warmup tokens, then --reps timed requests of L random tokens
 * (the same tokens for every method), each alone in the engine, max_tokens 1,
 * greedy. Prefill time = submit -> the first token's event (every prompt
 * chunk of --max-num-batched-tokens, the final logits and the sample); the
 * best of the reps is reported, with prefill tokens/s, dense time / method
 * time (the speed-up; below 1 for a method that adds prefill work, KVzip's
 * context replay: its extra cost is 1 / speed-up) and the next-token
 * distribution after the prompt against dense's on the same tokens:
 * KL(dense || method) and whether the top-1 tokens agree (one position per
 * input: a sanity check; quality over many positions and real text is
 * `lethe eval`, docs/quality.md). Method knobs come from --method-config
 * M:K=V,... (e.g. flashprefill:flashprefill_threshold=0.002); a method may
 * be listed twice as NAME#LABEL (flashprefill#t01) with knobs of its own
 * (--method-config flashprefill#t01:flashprefill_threshold=0.01), and may be
 * a pair PREFILL+DECODE. --json writes the results (schema
 * lethe-bench-prefill/2, rewritten after every run). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "core/util.h"
#include "engine/engine_introspect.h"
#include "eval/runinfo.h"
#include "options.h"

#define BP_MAX_INPUTS 8

typedef struct bp_opts {
    lethe_engine_params ep;
    const char *methods, *inputs, *json;
    int32_t reps, warmup;
    uint64_t seed;
    const char *method_config[LETHE_MAX_STOP];
} bp_opts;

typedef struct bp_track {
    int32_t n_first, n_finished, n_errors;
    double t_first;
    char error[256];
    float *logits;             /* [n_vocab]: the first token's next-token logits */
    int32_t n_vocab;
} bp_track;

static void on_event(void *user, const lethe_event *ev) {
    bp_track *t = user;
    if (ev->n_tokens >= 1 && ev->completion_tokens == 1 && !t->n_first++) {
        t->t_first = lethe_time_s();
        if (ev->logits && ev->n_vocab == t->n_vocab) memcpy(t->logits, ev->logits, (size_t)t->n_vocab * sizeof(float));
    }
    if (ev->finished) {
        t->n_finished++;
        if (ev->finish_reason == LETHE_FINISH_ERROR || ev->finish_reason == LETHE_FINISH_ABORT) {
            t->n_errors++;
            if (!t->error[0]) snprintf(t->error, sizeof(t->error), "%s", ev->error ? ev->error : "aborted");
        }
    }
}

/* one request of `input` tokens (depending on seed and input only); returns
 * the prefill seconds (logits[n_vocab]: the next-token logits), or a
 * negative value with err set */
static double prefill_once(lethe_engine *e, int32_t input, uint64_t seed, int32_t n_vocab, float *logits, char *err,
                           size_t ecap) {
    int32_t *prompt = lethe_xmalloc((size_t)input * sizeof(int32_t));
    uint64_t rng = seed * 0x9e3779b97f4a7c15ull + (uint64_t)input;
    for (int32_t k = 0; k < input; k++) prompt[k] = (int32_t)(lethe_splitmix64(&rng) % (uint64_t)n_vocab);
    bp_track t = {.logits = logits, .n_vocab = n_vocab};
    lethe_request_params rp = {.prompt = prompt, .n_prompt = input, .cb = on_event, .user = &t, .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.ignore_eos = true;
    rp.sampling.max_tokens = 1;
    uint64_t id;
    const double t0 = lethe_time_s();
    if (lethe_engine_add_request(e, &rp, &id) != 0) {
        snprintf(err, ecap, "add_request: %s", lethe_engine_last_error());
        free(prompt);
        return -1;
    }
    free(prompt);
    while (lethe_engine_has_work(e))
        if (lethe_engine_step(e) != 0) {
            snprintf(err, ecap, "step: %s", lethe_engine_last_error());
            return -1;
        }
    if (t.n_errors || !t.n_first) {
        snprintf(err, ecap, "request failed: %.200s", t.error[0] ? t.error : "no token");
        return -1;
    }
    return t.t_first - t0;
}

/* KL(p || q) of the softmaxes of logits a (p) and b (q), in nats */
static double kl_logits(const float *a, const float *b, int32_t n) {
    double ma = -INFINITY, mb = -INFINITY, za = 0, zb = 0, kl = 0;
    for (int32_t i = 0; i < n; i++) ma = fmax(ma, a[i]), mb = fmax(mb, b[i]);
    for (int32_t i = 0; i < n; i++) za += exp(a[i] - ma), zb += exp(b[i] - mb);
    for (int32_t i = 0; i < n; i++) {
        const double lp = a[i] - ma - log(za), lq = b[i] - mb - log(zb);
        kl += exp(lp) * (lp - lq);
    }
    return kl > 0 ? kl : 0;
}
static int32_t argmax(const float *x, int32_t n) {
    int32_t k = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[k]) k = i;
    return k;
}

static void knobs_for(const bp_opts *o, const char *method, char *out, size_t cap) {
    size_t n = 0;
    out[0] = 0;
    const size_t ml = strlen(method);
    for (int i = 0; i < LETHE_MAX_STOP && o->method_config[i] && n < cap; i++)
        if (!strncmp(o->method_config[i], method, ml) && o->method_config[i][ml] == ':')
            n += (size_t)snprintf(out + n, cap - n, "%s%s", n ? "," : "", o->method_config[i] + ml + 1);
}

static void write_json(const bp_opts *o, cJSON *root) {
    if (!o->json) return;
    char *s = cJSON_Print(root);
    char tmp[1024];
    snprintf(tmp, sizeof(tmp), "%s.tmp", o->json);
    FILE *f = fopen(tmp, "w");
    if (!f || fputs(s, f) < 0 || fclose(f) != 0 || rename(tmp, o->json) != 0)
        fprintf(stderr, "lethe bench prefill: --json %s: cannot write\n", o->json);
    free(s);
}

int lethe_bench_prefill(int argc, char **argv) {
    bp_opts o = {.methods = "flashprefill,omnikv_prefill", .inputs = "32768,131072", .reps = 1, .warmup = 2048,
                 .seed = 1};
    lethe_engine_default_params(&o.ep);
    o.ep.model = "configs/llama-3.1-8b-instruct/config.json";
    o.ep.load_format = "dummy";
    o.ep.device = "cuda";
    o.ep.max_num_batched_tokens = 8192;
    lethe_opt rows[24];
    int n = 0;
#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}
    ROW("--model", "-m", LETHE_OPT_STR, &o.ep.model, "PATH", "model: .gguf, HF folder, or config.json (dummy)", 1, 0);
    ROW("--load-format", NULL, LETHE_OPT_STR, &o.ep.load_format, "FMT", "auto | gguf | hf | dummy", 1, 0);
    ROW("--device", NULL, LETHE_OPT_STR, &o.ep.device, "DEV", "cuda | cpu", 1, 0);
    ROW("--threads", "-t", LETHE_OPT_INT, &o.ep.n_threads, "N", "CPU threads (0 = all)", 0, 4096);
    ROW("--gpu-memory-utilization", NULL, LETHE_OPT_FLOAT, &o.ep.gpu_memory_utilization, "F",
        "CUDA: fraction of free device memory (after weights and workspace) for the KV pool", 0.01, 1.0);
    ROW("--kv-cache-bytes", NULL, LETHE_OPT_BYTES, &o.ep.kv_cache_bytes, "SIZE", "CPU: KV pool budget", 1, 0);
    ROW("--max-num-batched-tokens", NULL, LETHE_OPT_INT, &o.ep.max_num_batched_tokens, "N",
        "tokens per engine step (the prefill chunk)", 16, 1 << 20);
    ROW("--methods", NULL, LETHE_OPT_STR, &o.methods, "LIST",
        "methods timed after dense (NAME, NAME#LABEL for a second config, PREFILL+DECODE)", 1, 0);
    ROW("--inputs", NULL, LETHE_OPT_STR, &o.inputs, "LIST", "prompt lengths", 1, 0);
    ROW("--reps", NULL, LETHE_OPT_INT, &o.reps, "N", "timed requests per length (the best is reported)", 1, 1000);
    ROW("--warmup", NULL, LETHE_OPT_INT, &o.warmup, "N", "tokens of the untimed first request of an engine", 1,
        1 << 24);
    ROW("--seed", NULL, LETHE_OPT_U64, &o.seed, "N", "prompt token seed", 1, 0);
    ROW("--method-config", NULL, LETHE_OPT_STRLIST, o.method_config, "M:K=V,..",
        "knobs of method M, e.g. flashprefill:flashprefill_threshold=0.002 (repeatable)", 1, 0);
    ROW("--json", NULL, LETHE_OPT_STR, &o.json, "PATH", "write results as JSON (schema lethe-bench-prefill/1)", 1, 0);
#undef ROW
    const char *pos[1];
    int n_pos = 0;
    int pr = lethe_opts_parse(rows, n, argc, argv, "lethe bench prefill [options]",
                              "Prefill time of prefill-axis methods (flashprefill, omnikv_prefill) vs dense:\n"
                              "one request per input length alone in the engine, submit -> first token.",
                              pos, &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    int32_t inputs[BP_MAX_INPUTS], n_in = 0, max_in = 0;
    {
        const char *p = o.inputs;
        while (*p) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p || v <= 0 || v > (1 << 24) || n_in == BP_MAX_INPUTS || (*end && *end != ',')) {
                fprintf(stderr, "lethe bench prefill: --inputs '%s': expected up to %d positive integers\n",
                        o.inputs, BP_MAX_INPUTS);
                return 2;
            }
            inputs[n_in++] = (int32_t)v;
            max_in = LETHE_MAX(max_in, (int32_t)v);
            p = *end ? end + 1 : end;
        }
    }
    cJSON *root = cJSON_CreateObject();
    char info[256];
    cJSON_AddStringToObject(root, "schema", "lethe-bench-prefill/2");
    lethe_runinfo_commit(info, sizeof(info));
    cJSON_AddStringToObject(root, "commit", info);
    lethe_runinfo_date(info, sizeof(info));
    cJSON_AddStringToObject(root, "date", info);
    lethe_runinfo_machine(info, sizeof(info));
    cJSON_AddStringToObject(root, "machine", info);
    cJSON_AddStringToObject(root, "model", o.ep.model);
    cJSON_AddStringToObject(root, "load_format", o.ep.load_format);
    cJSON_AddStringToObject(root, "device", o.ep.device);
    cJSON_AddNumberToObject(root, "max_num_batched_tokens", o.ep.max_num_batched_tokens);
    cJSON_AddNumberToObject(root, "reps", o.reps);
    char cmd[2048];
    size_t off = (size_t)snprintf(cmd, sizeof(cmd), "lethe bench prefill");
    for (int i = 1; i < argc && off < sizeof(cmd); i++) off += (size_t)snprintf(cmd + off, sizeof(cmd) - off, " %s", argv[i]);
    cJSON_AddStringToObject(root, "command", cmd);
    cJSON *runs = cJSON_AddArrayToObject(root, "runs");
    double dense_s[BP_MAX_INPUTS];
    float *dense_logits[BP_MAX_INPUTS] = {0}, *logits = NULL;
    for (int i = 0; i < n_in; i++) dense_s[i] = NAN;
    char list[512];
    snprintf(list, sizeof(list), "dense,%s", o.methods);
    printf("prefill alone, max_num_batched_tokens %d, best of %d\n", o.ep.max_num_batched_tokens, o.reps);
    printf("%-24s %8s | %10s %12s | %8s | %10s %5s\n", "method", "input", "prefill s", "tokens/s", "speed-up",
           "KL(dense)", "top1");
    int rc = 0;
    char *save = NULL;
    for (char *m = strtok_r(list, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        if (!m[0] || (!strcmp(m, "dense") && cJSON_GetArraySize(runs) > 0)) continue;
        char knobs[1024], err[512];
        knobs_for(&o, m, knobs, sizeof(knobs));
        char method[128];
        snprintf(method, sizeof(method), "%s", m); /* NAME#LABEL: the engine runs NAME */
        if (strchr(method, '#')) *strchr(method, '#') = '\0';
        lethe_engine_params p = o.ep;
        p.sparse_method = method;
        p.sparse_config = knobs[0] ? knobs : NULL;
        p.max_model_len = LETHE_MAX(max_in, o.warmup) + 2;
        p.enable_prefix_caching = false;
        p.prefix_cache_mode = "auto";
        p.progress = false;
        lethe_engine *e = NULL;
        if (lethe_engine_create(&p, &e) != 0) {
            fprintf(stderr, "lethe bench prefill: %s engine: %s\n", m, lethe_engine_last_error());
            rc = 1;
            continue;
        }
        lethe_engine_layout lo;
        lethe_engine_get_layout(e, &lo);
        logits = lethe_xrealloc(logits, (size_t)lo.n_vocab * sizeof(float));
        if (prefill_once(e, o.warmup, o.seed + 1000, lo.n_vocab, logits, err, sizeof(err)) < 0) {
            fprintf(stderr, "lethe bench prefill: %s warm-up: %s\n", m, err);
            rc = 1;
        }
        for (int i = 0; i < n_in; i++) {
            double best = INFINITY;
            for (int r = 0; r < o.reps; r++) {
                const double s = prefill_once(e, inputs[i], o.seed, lo.n_vocab, logits, err, sizeof(err));
                if (s < 0) {
                    fprintf(stderr, "lethe bench prefill: %s L=%d: %s\n", m, inputs[i], err);
                    rc = 1;
                    break;
                }
                best = LETHE_MIN(best, s);
            }
            if (!strcmp(m, "dense")) {
                dense_s[i] = best;
                if (isfinite(best)) {
                    dense_logits[i] = lethe_xmalloc((size_t)lo.n_vocab * sizeof(float));
                    memcpy(dense_logits[i], logits, (size_t)lo.n_vocab * sizeof(float));
                }
            }
            const double speed = dense_s[i] / best;
            /* the same tokens as dense's request: the next-token distributions compare */
            const bool cmp = isfinite(best) && dense_logits[i];
            const double kl = cmp ? kl_logits(dense_logits[i], logits, lo.n_vocab) : NAN;
            const bool top1 = cmp && argmax(dense_logits[i], lo.n_vocab) == argmax(logits, lo.n_vocab);
            printf("%-24s %8d | %10.3f %12.0f | %7.2fx | %10.3g %5s\n", m, inputs[i], best, inputs[i] / best, speed,
                   kl, cmp ? (top1 ? "yes" : "no") : "-");
            fflush(stdout);
            cJSON *row = cJSON_CreateObject();
            cJSON_AddStringToObject(row, "method", m);
            cJSON_AddStringToObject(row, "knobs", knobs);
            cJSON_AddNumberToObject(row, "input", inputs[i]);
            cJSON_AddNumberToObject(row, "prefill_s", isfinite(best) ? best : -1);
            cJSON_AddNumberToObject(row, "prefill_tok_s", isfinite(best) ? inputs[i] / best : 0);
            cJSON_AddNumberToObject(row, "speedup_vs_dense", isfinite(speed) ? speed : 0);
            if (cmp) {
                cJSON_AddNumberToObject(row, "kl_vs_dense", kl);
                cJSON_AddBoolToObject(row, "top1_agree", top1);
            }
            cJSON_AddItemToArray(runs, row);
            write_json(&o, root);
        }
        lethe_engine_destroy(e);
    }
    write_json(&o, root);
    cJSON_Delete(root);
    for (int i = 0; i < n_in; i++) free(dense_logits[i]);
    free(logits);
    return rc;
}

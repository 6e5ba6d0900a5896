/* options.c - table-driven argv parsing, bounds and --help for `lethe`. */
#include "options.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static void print_default(FILE *f, const lethe_opt *o) {
    switch (o->kind) {
    case LETHE_OPT_STR: {
        const char *s = *(const char **)o->dst;
        if (s) fprintf(f, " (default: %s)", s);
        break;
    }
    case LETHE_OPT_INT: fprintf(f, " (default: %d)", *(int32_t *)o->dst); break;
    case LETHE_OPT_U64: fprintf(f, " (default: %llu)", (unsigned long long)*(uint64_t *)o->dst); break;
    case LETHE_OPT_FLOAT: fprintf(f, " (default: %g)", (double)*(float *)o->dst); break;
    case LETHE_OPT_BOOL: fprintf(f, " (default: %s)", *(bool *)o->dst ? "on" : "off"); break;
    case LETHE_OPT_BYTES: {
        size_t b = *(size_t *)o->dst;
        if (b) fprintf(f, " (default: %zuM)", b >> 20);
        break;
    }
    case LETHE_OPT_STRLIST: break;
    }
}

void lethe_opts_help(FILE *f, const lethe_opt *opts, int n_opts, const char *usage,
                     const char *summary) {
    fprintf(f, "usage: %s\n", usage);
    if (summary) fprintf(f, "\n%s\n", summary);
    fprintf(f, "\noptions:\n");
    for (int i = 0; i < n_opts; i++) {
        const lethe_opt *o = &opts[i];
        char left[96];
        int k = snprintf(left, sizeof(left), "  %s%s%s", o->alias ? o->alias : "",
                         o->alias ? ", " : "", o->name);
        if (o->metavar && o->kind != LETHE_OPT_BOOL && k > 0 && (size_t)k < sizeof(left))
            snprintf(left + k, sizeof(left) - (size_t)k, " %s", o->metavar);
        fprintf(f, "%-34s %s", left, o->help ? o->help : "");
        print_default(f, o);
        fputc('\n', f);
    }
    fprintf(f, "  %-32s %s\n", "-h, --help", "show this help and exit");
}

static bool in_range(const lethe_opt *o, double v) {
    if (o->min > o->max) return true;
    return v >= o->min && v <= o->max;
}

static int parse_value(const lethe_opt *o, const char *val) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case LETHE_OPT_STR: *(const char **)o->dst = val; return 0;
    case LETHE_OPT_STRLIST: {
        const char **arr = (const char **)o->dst;
        for (int i = 0; i < LETHE_MAX_STOP - 1; i++)
            if (!arr[i]) { arr[i] = val; arr[i + 1] = NULL; return 0; }
        fprintf(stderr, "lethe: %s given more than %d times\n", o->name, LETHE_MAX_STOP - 1);
        return -1;
    }
    case LETHE_OPT_INT: case LETHE_OPT_U64: {
        long long v = strtoll(val, &end, 10);
        if (errno || !end || *end || end == val) break;
        if (!in_range(o, (double)v)) goto out_range;
        if (o->kind == LETHE_OPT_INT) {
            if (v < INT32_MIN || v > INT32_MAX) goto out_range;
            *(int32_t *)o->dst = (int32_t)v;
        } else {
            if (v < 0) goto out_range;
            *(uint64_t *)o->dst = (uint64_t)v;
        }
        return 0;
    }
    case LETHE_OPT_FLOAT: {
        double v = strtod(val, &end);
        if (errno || !end || *end || end == val) break;
        if (!in_range(o, v)) goto out_range;
        *(float *)o->dst = (float)v;
        return 0;
    }
    case LETHE_OPT_BYTES: {
        double v = strtod(val, &end);
        if (errno || !end || end == val || v < 0) break;
        double mul = 1;
        switch (*end) {
        case 'k': case 'K': mul = 1024.0; end++; break;
        case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
        case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
        case '\0': break;
        default: goto out_bad;
        }
        if (*end == 'i' || *end == 'B') end++;
        if (*end == 'B') end++;
        if (*end) break;
        *(size_t *)o->dst = (size_t)(v * mul);
        return 0;
    }
    case LETHE_OPT_BOOL: break;
    }
out_bad:
    fprintf(stderr, "lethe: %s: invalid value '%s'\n", o->name, val);
    return -1;
out_range:
    fprintf(stderr, "lethe: %s: value %s out of range [%g, %g]\n", o->name, val, o->min, o->max);
    return -1;
}

int lethe_opts_parse(const lethe_opt *opts, int n_opts, int argc, char **argv,
                     const char *usage, const char *summary, const char **pos, int *n_pos,
                     int pos_max) {
    *n_pos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            lethe_opts_help(stdout, opts, n_opts, usage, summary);
            return 1;
        }
        if (a[0] != '-' || !strcmp(a, "-")) {
            if (*n_pos >= pos_max) {
                fprintf(stderr, "lethe: unexpected argument '%s' (see --help)\n", a);
                return -1;
            }
            pos[(*n_pos)++] = a;
            continue;
        }
        /* --name=value form */
        char name[96];
        const char *eq = strchr(a, '=');
        size_t nl = eq ? (size_t)(eq - a) : strlen(a);
        if (nl >= sizeof(name)) nl = sizeof(name) - 1;
        memcpy(name, a, nl);
        name[nl] = '\0';
        bool negated = false;
        const lethe_opt *o = NULL;
        for (int k = 0; k < n_opts && !o; k++) {
            if (!strcmp(opts[k].name, name) || (opts[k].alias && !strcmp(opts[k].alias, name)))
                o = &opts[k];
            else if (opts[k].kind == LETHE_OPT_BOOL && !strncmp(name, "--no-", 5) &&
                     !strcmp(opts[k].name + 2, name + 5)) {
                o = &opts[k];
                negated = true;
            }
        }
        if (!o) {
            fprintf(stderr, "lethe: unknown option '%s' (see --help)\n", name);
            return -1;
        }
        if (o->kind == LETHE_OPT_BOOL) {
            bool v = !negated;
            if (eq) {
                if (!strcmp(eq + 1, "true") || !strcmp(eq + 1, "1")) v = !negated;
                else if (!strcmp(eq + 1, "false") || !strcmp(eq + 1, "0")) v = negated;
                else {
                    fprintf(stderr, "lethe: %s: expected true or false\n", o->name);
                    return -1;
                }
            }
            *(bool *)o->dst = v;
            continue;
        }
        const char *val = eq ? eq + 1 : NULL;
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "lethe: %s needs a value%s%s\n", o->name,
                        o->metavar ? " " : "", o->metavar ? o->metavar : "");
                return -1;
            }
            val = argv[++i];
        }
        if (parse_value(o, val) != 0) return -1;
    }
    return 0;
}

#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}

int lethe_opts_engine(lethe_opt *rows, lethe_engine_params *p) {
    int n = 0;
    ROW("--model", "-m", LETHE_OPT_STR, &p->model, "PATH",
        "model: .gguf file, HF folder, or config.json with --load-format dummy", 1, 0);
    ROW("--tokenizer", NULL, LETHE_OPT_STR, &p->tokenizer, "PATH",
        "tokenizer instead of the model's own: a folder with tokenizer.json (+ tokenizer_config.json) "
        "or a .gguf (e.g. for dummy weights)", 1, 0);
    ROW("--load-format", NULL, LETHE_OPT_STR, &p->load_format, "FMT",
        "auto | gguf | hf | dummy (seeded random weights at real shapes)", 1, 0);
    ROW("--device", NULL, LETHE_OPT_STR, &p->device, "DEV", "cpu | cuda", 1, 0);
    ROW("--threads", "-t", LETHE_OPT_INT, &p->n_threads, "N", "CPU threads, 0 = all cores", 0, 4096);
    ROW("--cpu-weights", NULL, LETHE_OPT_STR, &p->cpu_weights, "native|exact|fp32",
        "CPU weights: native keeps GGUF blocks / f16 / bf16 as stored and multiplies block "
        "formats with 16-bit integer activations (default); exact keeps them as stored "
        "with f32 activations; fp32 dequantizes at load (exact and fp32: the same bits)", 1, 0);
    ROW("--max-model-len", NULL, LETHE_OPT_INT, &p->max_model_len, "N",
        "max prompt + output tokens per request, 0 = the model's", 0, 1 << 24);
    ROW("--max-num-seqs", NULL, LETHE_OPT_INT, &p->max_num_seqs, "N",
        "max requests running at once", 1, 65536);
    ROW("--max-num-batched-tokens", NULL, LETHE_OPT_INT, &p->max_num_batched_tokens, "N",
        "token budget of one engine step (chunked prefill)", 16, 1 << 20);
    ROW("--kv-cache-bytes", NULL, LETHE_OPT_BYTES, &p->kv_cache_bytes, "SIZE",
        "KV cache memory budget (e.g. 512M, 2G); CUDA: a cap on the pool --gpu-memory-utilization sizes", 1, 0);
    ROW("--gpu-memory-utilization", NULL, LETHE_OPT_FLOAT, &p->gpu_memory_utilization, "F",
        "CUDA: fraction of device memory for weights + KV", 0.01, 1.0);
    ROW("--host-cache-bytes", NULL, LETHE_OPT_BYTES, &p->host_cache_bytes, "SIZE",
        "host-memory tier under the prefix cache (e.g. 4G): prefix blocks evicted from the KV "
        "cache are kept there (LRU) and restored on a hit instead of recomputed (hybrid models: "
        "radix blocks and idle chains with their linear-attention states); 0 = off", 1, 0);
    ROW("--enable-prefix-caching", NULL, LETHE_OPT_BOOL, &p->enable_prefix_caching, NULL,
        "reuse KV of shared prompt prefixes (--no-enable-prefix-caching to disable)", 1, 0);
    ROW("--prefix-cache-mode", NULL, LETHE_OPT_STR, &p->prefix_cache_mode, "MODE",
        "auto | radix | chain: auto = radix for dense / logical selection, chain (multi-turn KV "
        "continuation) for eviction methods", 1, 0);
    ROW("--state-snapshot-interval", NULL, LETHE_OPT_INT, &p->state_snapshot_interval, "N",
        "hybrid models (qwen3_5): the radix prefix cache snapshots the linear-attention states "
        "every N prompt tokens (a multiple of 64; 0 = --max-num-batched-tokens rounded down to one) "
        "and at the prompt's last multiple of "
        "64; a hit resumes from the deepest snapshot", 0, 1 << 24);
    ROW("--state-snapshot-bytes", NULL, LETHE_OPT_BYTES, &p->state_snapshot_bytes, "SIZE",
        "hybrid models: memory for those snapshots (chain mode: idle chains' states), taken off "
        "the KV budget, LRU (0 = an eighth of the KV budget)", 1, 0);
    ROW("--sparse-method", NULL, LETHE_OPT_STR, &p->sparse_method, "NAME",
        "sparse attention / KV method (see `lethe methods`)", 1, 0);
    ROW("--sparse-config", NULL, LETHE_OPT_STR, &p->sparse_config, "K=V,...",
        "method knobs, e.g. decode_keep_tokens=2048,sink_keep_tokens=64", 1, 0);
    ROW("--model-seed", NULL, LETHE_OPT_U64, &p->seed, "N", "seed for dummy weights", 1, 0);
    ROW("--check-invariants", NULL, LETHE_OPT_BOOL, &p->check_invariants, NULL,
        "verify KV ownership after every step (slow; for debugging)", 1, 0);
    ROW("--split-prefill-decode", NULL, LETHE_OPT_BOOL, &p->split_prefill_decode, NULL,
        "never mix prefill chunks and decode tokens in one step (anchor-style)", 1, 0);
    ROW("--enforce-eager", NULL, LETHE_OPT_BOOL, &p->enforce_eager, NULL,
        "CUDA: never capture/replay CUDA graphs (by default decode steps of dense, fp8_kv, quest and "
        "the evicting methods replay one graph per batch-size bucket, padded to 1, 2, 4, 8, 16, 24, "
        "... 256)", 1, 0);
    return n;
}

int lethe_opts_sampling(lethe_opt *rows, lethe_sampling_params *s) {
    int n = 0;
    ROW("--temperature", "--temp", LETHE_OPT_FLOAT, &s->temperature, "T", "0 = greedy", 0, 100);
    ROW("--top-k", NULL, LETHE_OPT_INT, &s->top_k, "K", "keep the K most likely tokens, <=0 off", -1, 1 << 20);
    ROW("--top-p", NULL, LETHE_OPT_FLOAT, &s->top_p, "P", "nucleus sampling mass, 1 = off", 0, 1);
    ROW("--min-p", NULL, LETHE_OPT_FLOAT, &s->min_p, "P", "drop tokens below P x max prob, 0 = off", 0, 1);
    ROW("--repetition-penalty", NULL, LETHE_OPT_FLOAT, &s->repetition_penalty, "F",
        "HF-style penalty on prompt+output tokens, 1 = off", 0.01, 100);
    ROW("--presence-penalty", NULL, LETHE_OPT_FLOAT, &s->presence_penalty, "F",
        "OpenAI presence penalty, 0 = off", -2, 2);
    ROW("--frequency-penalty", NULL, LETHE_OPT_FLOAT, &s->frequency_penalty, "F",
        "OpenAI frequency penalty, 0 = off", -2, 2);
    ROW("--max-tokens", "-n", LETHE_OPT_INT, &s->max_tokens, "N",
        "max tokens to generate, -1 = until the context is full", -1, 1 << 24);
    ROW("--ignore-eos", NULL, LETHE_OPT_BOOL, &s->ignore_eos, NULL, "keep generating past EOS", 1, 0);
    ROW("--stop", NULL, LETHE_OPT_STRLIST, s->stop, "STR", "stop string (repeatable)", 1, 0);
    return n;
}

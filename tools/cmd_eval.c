/* cmd_eval.c - `lethe eval`: long-context quality of every sparse method against dense.
 *
 * One invocation runs every configuration (dense first, then each method at
 * each budget) over every context length on identical inputs:
 *  - synthetic tasks (passkey, niah_multikey, vt, cwe; src/eval/tasks.c)
 *    generated from the seed at each length from --corpus, prompted through
 *    the model's chat template, answered greedily and scored by exact match;
 *  - "ppl": sliding windows over long documents (--ppl-corpus): a window of
 *    L tokens whose last T are teacher-forced. Every configuration gets the
 *    perplexity of those T tokens; sparse ones also get per-position
 *    KL(dense || method) and top-1 agreement with dense, whose logits are
 *    kept in a temporary file between configurations. The scored tokens are
 *    the same at every length (windows end at the same places), so
 *    perplexity across lengths shows what longer context buys.
 * A length the model cannot take, or a task it fails, is a row with score 0
 * and the reason, never a dropped row. This file resolves the flags into
 * configurations and writes the results; src/eval/suite.c prepares the
 * inputs and runs them. Results: a table on stdout, a JSON
 * file (--result-json, with commit, date, machine, model, device and every
 * knob), and a PNG plot (--plot; drawn by scripts/gen_docs.py with
 * matplotlib, which `make deps` installs). */
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "commands.h"
#include "core/util.h"
#include "engine/engine_introspect.h"
#include "eval/eval.h"
#include "eval/runinfo.h"
#include "eval/suite.h"
#include "options.h"

extern char **environ;

#define MAX_CONFIGS 128

typedef struct eval_opts {
    lethe_engine_params ep;
    const char *corpus, *ppl_corpus, *tasks, *lengths, *methods, *budgets, *budget_knob;
    const char *result_json, *plot;
    int32_t samples, windows, forced_tokens, max_batch;
    uint64_t seed;
    bool progress;
    char command[2048];         /* the invocation, for the results */
    char date[64], commit[64], machine[256]; /* taken when the run starts */
} eval_opts;

typedef struct run {            /* what the flags resolve to */
    eval_opts *o;
    lethe_eval_suite_params sp;
    int32_t n_tasks_on;
    lethe_eval_config cfg[MAX_CONFIGS];
    lethe_engine_layout layout[MAX_CONFIGS]; /* each configuration's KV pool (kv_token_bytes = 0: no engine) */
    int32_t n_cfg;
} run;

/* ---- flags ------------------------------------------------------------------ */

static int split_list(const char *s, char out[][64], int max) {
    int n = 0;
    const char *p = s;
    while (p && *p && n < max) {
        size_t k = strcspn(p, ",");
        if (k > 0 && k < 64) {
            memcpy(out[n], p, k);
            out[n++][k] = '\0';
        }
        p += k;
        if (*p == ',') p++;
    }
    return n;
}

static const char *budget_knob_for(const eval_opts *o, const char *method) {
    static char knob[64];
    char items[32][64];
    int n = split_list(o->budget_knob, items, 32);
    snprintf(knob, sizeof(knob), "decode_keep_tokens");
    for (int i = 0; i < n; i++) { /* "NAME" = every method; "method:NAME" = that method */
        char *c = strchr(items[i], ':');
        if (!c) snprintf(knob, sizeof(knob), "%.63s", items[i]);
    }
    for (int i = 0; i < n; i++) {
        char *c = strchr(items[i], ':');
        if (c && (size_t)(c - items[i]) == strlen(method) && !strncmp(items[i], method, strlen(method)))
            snprintf(knob, sizeof(knob), "%.63s", c + 1);
    }
    return knob;
}

static int build_configs(run *r) {
    eval_opts *o = r->o;
    char methods[32][64];
    int nm = split_list(o->methods, methods, 32);
    int32_t budgets[32];
    int nb = 0;
    if (o->budgets && o->budgets[0]) {
        nb = lethe_eval_parse_int_list(o->budgets, budgets, 32);
        if (nb < 0) {
            fprintf(stderr, "lethe eval: --budgets: %s\n", lethe_last_error());
            return -1;
        }
    }
    r->n_cfg = 0;
    lethe_eval_config *d = &r->cfg[r->n_cfg++];
    snprintf(d->method, sizeof(d->method), "dense");
    d->budget = -1;
    d->knobs[0] = '\0';
    for (int i = 0; i < nm; i++) {
        if (!strcmp(methods[i], "dense")) continue;
        for (int b = 0; b < (nb ? nb : 1); b++) {
            if (r->n_cfg == MAX_CONFIGS) {
                fprintf(stderr, "lethe eval: more than %d method x budget configurations\n", MAX_CONFIGS);
                return -1;
            }
            lethe_eval_config *c = &r->cfg[r->n_cfg++];
            snprintf(c->method, sizeof(c->method), "%.63s", methods[i]);
            c->budget = nb ? budgets[b] : -1;
            const char *base = o->ep.sparse_config ? o->ep.sparse_config : "";
            if (nb)
                snprintf(c->knobs, sizeof(c->knobs), "%s%s%s=%d", base, base[0] ? "," : "",
                         budget_knob_for(o, methods[i]), budgets[b]);
            else
                snprintf(c->knobs, sizeof(c->knobs), "%s", base);
        }
    }
    return 0;
}

static int parse_tasks(run *r) {
    char items[16][64];
    int n = split_list(r->o->tasks, items, 16);
    for (int i = 0; i < n; i++) {
        int t = lethe_eval_task_from_name(items[i]);
        if (t < 0 && (!strcmp(items[i], "ppl") || !strcmp(items[i], "agreement"))) t = LETHE_EVAL_TASK_PPL;
        if (t < 0) {
            fprintf(stderr, "lethe eval: --tasks: unknown task '%s' (passkey, niah, vt, cwe, ppl)\n", items[i]);
            return -1;
        }
        if (!r->sp.task_on[t]) r->n_tasks_on++;
        r->sp.task_on[t] = true;
    }
    if (!r->n_tasks_on) {
        fprintf(stderr, "lethe eval: --tasks is empty\n");
        return -1;
    }
    return 0;
}

/* ---- output ------------------------------------------------------------------ */

static double jnum(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static void print_table(const cJSON *rows) {
    printf("%-12s %7s %7s %-14s %3s %6s %6s %8s %9s %6s  %s\n", "method", "budget", "ctx", "task", "n", "score",
           "exact", "ppl", "kl_mean", "top1", "note");
    const cJSON *row;
    cJSON_ArrayForEach(row, rows) {
        char b[16] = "-", sc[16] = "", ex[16] = "", pp[16] = "", kl[16] = "", t1[16] = "";
        double v;
        if (isfinite(v = jnum(row, "budget"))) snprintf(b, sizeof(b), "%.0f", v);
        if (isfinite(v = jnum(row, "score"))) snprintf(sc, sizeof(sc), "%.3f", v);
        if (isfinite(v = jnum(row, "exact"))) snprintf(ex, sizeof(ex), "%.3f", v);
        if (isfinite(v = jnum(row, "ppl"))) snprintf(pp, sizeof(pp), "%.3f", v);
        if (isfinite(v = jnum(row, "kl_mean"))) snprintf(kl, sizeof(kl), "%.5f", v);
        if (isfinite(v = jnum(row, "top1_agree"))) snprintf(t1, sizeof(t1), "%.3f", v);
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(row, "error");
        printf("%-12s %7s %7.0f %-14s %3.0f %6s %6s %8s %9s %6s  %.60s\n",
               cJSON_GetObjectItemCaseSensitive(row, "method")->valuestring, b, jnum(row, "context_length"),
               cJSON_GetObjectItemCaseSensitive(row, "task")->valuestring, jnum(row, "n"), sc, ex, pp, kl, t1,
               cJSON_IsString(e) ? e->valuestring : "");
    }
}

/* gen_docs.py next to the binary's source tree (build/lethe -> scripts/), else ./scripts */
static int draw_plot(const char *json, const char *png) {
    char exe[1024], script[1200] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *s = strrchr(exe, '/');
        if (s) *s = '\0';
        snprintf(script, sizeof(script), "%s/../scripts/gen_docs.py", exe);
    }
    if (!script[0] || access(script, R_OK) != 0) snprintf(script, sizeof(script), "scripts/gen_docs.py");
    const char *hint = "the plot is drawn by scripts/gen_docs.py with matplotlib (pip install matplotlib; "
                       "then: python3 scripts/gen_docs.py plot-eval RESULTS.json OUT.png)";
    if (access(script, R_OK) != 0) {
        fprintf(stderr, "lethe eval: --plot: scripts/gen_docs.py not found; %s\n", hint);
        return -1;
    }
    char *argv[] = {"python3", script, "plot-eval", (char *)json, (char *)png, NULL};
    pid_t pid;
    if (posix_spawnp(&pid, "python3", NULL, NULL, argv, environ) != 0) {
        fprintf(stderr, "lethe eval: --plot: cannot run python3; %s\n", hint);
        return -1;
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "lethe eval: --plot: %s failed; %s\n", script, hint);
        return -1;
    }
    fprintf(stderr, "lethe eval: plot written to %s\n", png);
    return 0;
}

static cJSON *header(const run *r, const lethe_eval_suite *suite, const char *model) {
    const eval_opts *o = r->o;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "schema", "lethe-eval/1");
    cJSON_AddStringToObject(j, "date", o->date);
    cJSON_AddStringToObject(j, "commit", o->commit);
    cJSON_AddStringToObject(j, "machine", o->machine);
    cJSON_AddStringToObject(j, "device", o->ep.device ? o->ep.device : "cpu");
    cJSON_AddNumberToObject(j, "threads", o->ep.n_threads);
    cJSON_AddStringToObject(j, "model", model);
    cJSON_AddStringToObject(j, "model_path", o->ep.model);
    cJSON_AddNumberToObject(j, "max_model_len", lethe_eval_suite_max_len(suite));
    cJSON_AddStringToObject(j, "corpus", o->corpus);
    cJSON_AddStringToObject(j, "ppl_corpus", o->ppl_corpus ? o->ppl_corpus : o->corpus);
    cJSON_AddStringToObject(j, "ppl_documents", lethe_eval_suite_ppl_docs(suite));
    cJSON_AddNumberToObject(j, "seed", (double)o->seed);
    cJSON_AddNumberToObject(j, "samples", o->samples);
    cJSON_AddNumberToObject(j, "ppl_windows", o->windows);
    cJSON_AddStringToObject(j, "command", o->command);
    cJSON_AddNumberToObject(j, "forced_tokens", o->forced_tokens);
    cJSON_AddStringToObject(j, "tasks", o->tasks);
    cJSON *ls = cJSON_AddArrayToObject(j, "context_lengths");
    for (int i = 0; i < r->sp.n_lengths; i++) cJSON_AddItemToArray(ls, cJSON_CreateNumber(r->sp.lengths[i]));
    cJSON_AddStringToObject(j, "prompt_format", "chat template + RULER answer prefix; greedy");
    cJSON_AddBoolToObject(j, "prefix_caching", o->ep.enable_prefix_caching);
    static const char *const env[] = {"OMP_WAIT_POLICY", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"};
    for (size_t i = 0; i < sizeof(env) / sizeof(env[0]); i++)
        if (getenv(env[i])) cJSON_AddStringToObject(j, env[i], getenv(env[i]));
    return j;
}

int lethe_cmd_eval(int argc, char **argv) {
    eval_opts o = {.tasks = "passkey,niah,vt,cwe,ppl", .lengths = "2048,4096", .methods = "dense",
                   .budget_knob = "decode_keep_tokens", .samples = 4, .forced_tokens = 128, .max_batch = 4,
                   .progress = true};
    lethe_engine_default_params(&o.ep);
    lethe_opt opts[LETHE_OPTS_MAX];
    int n = 0;
    lethe_opt eng[32];
    int ne = lethe_opts_engine(eng, &o.ep);
    for (int i = 0; i < ne; i++)
        if (strcmp(eng[i].name, "--sparse-method")) opts[n++] = eng[i]; /* --methods replaces it */
#define ROW(...) opts[n++] = (lethe_opt){__VA_ARGS__}
    ROW("--corpus", NULL, LETHE_OPT_STR, &o.corpus, "DIR", "folder of .txt/.md files for the haystacks (required)", 1, 0);
    ROW("--ppl-corpus", NULL, LETHE_OPT_STR, &o.ppl_corpus, "DIR", "documents for perplexity / agreement (default: --corpus)", 1, 0);
    ROW("--tasks", NULL, LETHE_OPT_STR, &o.tasks, "LIST", "passkey, niah, vt, cwe, ppl (ppl = perplexity + KL/top-1 vs dense)", 1, 0);
    ROW("--context-lengths", NULL, LETHE_OPT_STR, &o.lengths, "LIST", "context lengths in tokens, e.g. 2048,4096,8k", 1, 0);
    ROW("--samples", NULL, LETHE_OPT_INT, &o.samples, "N", "samples per task and length", 1, 100000);
    ROW("--methods", NULL, LETHE_OPT_STR, &o.methods, "LIST", "sparse methods; dense is always run first as the reference", 1, 0);
    ROW("--budgets", NULL, LETHE_OPT_STR, &o.budgets, "LIST", "budgets in tokens for each non-dense method, e.g. 512,1024,2048", 1, 0);
    ROW("--budget-knob", NULL, LETHE_OPT_STR, &o.budget_knob, "KNOB",
        "knob a budget sets: NAME for all, or method:NAME,... per method", 1, 0);
    ROW("--ppl-windows", NULL, LETHE_OPT_INT, &o.windows, "N", "ppl windows per length, 0 = --samples", 0, 100000);
    ROW("--forced-tokens", NULL, LETHE_OPT_INT, &o.forced_tokens, "T", "teacher-forced tokens scored per ppl window", 1, 65536);
    ROW("--max-batch", NULL, LETHE_OPT_INT, &o.max_batch, "N", "requests in the engine at once", 1, 4096);
    ROW("--seed", NULL, LETHE_OPT_U64, &o.seed, "N", "task / window seed", 1, 0);
    ROW("--result-json", "-o", LETHE_OPT_STR, &o.result_json, "PATH", "write results as JSON", 1, 0);
    ROW("--plot", NULL, LETHE_OPT_STR, &o.plot, "PNG", "quality vs budget per method (via scripts/gen_docs.py, matplotlib)", 1, 0);
    ROW("--progress", NULL, LETHE_OPT_BOOL, &o.progress, NULL, "progress bar on stderr", 1, 0);
#undef ROW
    const char *pos[1];
    int n_pos;
    int pr = lethe_opts_parse(opts, n, argc, argv, "lethe eval --model PATH --corpus DIR [options]",
                              "Long-context quality of sparse methods against dense on identical inputs:\n"
                              "synthetic retrieval tasks (exact match), perplexity, KL and top-1 vs dense.",
                              pos, &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    if (o.windows <= 0) o.windows = o.samples;
    lethe_runinfo_date(o.date, sizeof(o.date)); /* the code and time the run starts with */
    lethe_runinfo_commit(o.commit, sizeof(o.commit));
    lethe_runinfo_machine(o.machine, sizeof(o.machine));
    size_t cl = 0;
    for (int i = 0; i < argc && cl + 2 < sizeof(o.command); i++) {
        int k = snprintf(o.command + cl, sizeof(o.command) - cl, "%s%s", i ? " " : "lethe ", argv[i]);
        cl += k > 0 ? (size_t)k : 0;
    }
    if (cl >= sizeof(o.command)) cl = sizeof(o.command) - 1;
    if (!o.ep.model || !o.corpus) {
        fprintf(stderr, "lethe eval: --model and --corpus are required (e.g. --corpus ../shared/data/sotu)\n");
        return 2;
    }
    run r = {.o = &o};
    r.sp.n_lengths = lethe_eval_parse_int_list(o.lengths, r.sp.lengths, LETHE_EVAL_MAX_LENGTHS);
    if (r.sp.n_lengths < 0) {
        fprintf(stderr, "lethe eval: --context-lengths: %s\n", lethe_last_error());
        return 2;
    }
    if (parse_tasks(&r) || build_configs(&r)) return 2;
    bool ppl = r.sp.task_on[LETHE_EVAL_TASK_PPL];
    for (int i = 0; i < r.sp.n_lengths; i++)
        if (ppl && r.sp.lengths[i] <= o.forced_tokens + 1) {
            fprintf(stderr, "lethe eval: context length %d leaves no prompt before %d forced tokens (--forced-tokens)\n",
                    r.sp.lengths[i], o.forced_tokens);
            return 2;
        }
    r.sp.samples = o.samples;
    r.sp.windows = o.windows;
    r.sp.forced_tokens = o.forced_tokens;
    r.sp.max_batch = o.max_batch;
    r.sp.seed = o.seed;
    r.sp.n_configs = r.n_cfg;
    r.sp.progress = o.progress;
    lethe_eval_corpus *corpus = NULL, *pcorpus = NULL;
    if (lethe_eval_corpus_load(o.corpus, &corpus) != LETHE_OK) {
        fprintf(stderr, "lethe eval: --corpus: %s\n", lethe_last_error());
        return 2;
    }
    if (o.ppl_corpus && strcmp(o.ppl_corpus, o.corpus) && ppl &&
        lethe_eval_corpus_load(o.ppl_corpus, &pcorpus) != LETHE_OK) {
        fprintf(stderr, "lethe eval: --ppl-corpus: %s\n", lethe_last_error());
        lethe_eval_corpus_free(corpus);
        return 2;
    }
    int rc = 0;
    lethe_engine_params dp = o.ep;
    dp.sparse_method = "dense";
    dp.sparse_config = NULL;
    lethe_engine *dense = NULL;
    if (lethe_engine_create(&dp, &dense) != 0) {
        fprintf(stderr, "lethe eval: %s\n", lethe_engine_last_error());
        lethe_eval_corpus_free(corpus);
        lethe_eval_corpus_free(pcorpus);
        return 1;
    }
    char model[256];
    snprintf(model, sizeof(model), "%s", lethe_engine_model_name(dense));
    fprintf(stderr, "lethe eval: %s, %d configuration(s), lengths %s, %d sample(s) per task; preparing inputs\n",
            model, r.n_cfg, o.lengths, o.samples);
    lethe_eval_suite *suite = NULL;
    if (lethe_eval_suite_prepare(&r.sp, dense, corpus, pcorpus ? pcorpus : corpus, &suite) != LETHE_OK) rc = 1;
    cJSON *rows = cJSON_CreateArray();
    for (int ci = 0; ci < r.n_cfg; ci++) {
        const lethe_eval_config *c = &r.cfg[ci];
        char cerr[300] = "";
        lethe_engine *e = dense;
        if (ci > 0) {
            lethe_engine_params p = o.ep;
            p.sparse_method = c->method;
            p.sparse_config = c->knobs[0] ? c->knobs : NULL;
            p.progress = false;
            e = NULL;
            if (lethe_engine_create(&p, &e) != 0) {
                snprintf(cerr, sizeof(cerr), "engine: %s", lethe_engine_last_error());
                fprintf(stderr, "\nlethe eval: %s %s: %s\n", c->method, c->knobs, cerr);
                e = NULL;
                rc = 1;
            }
        }
        if (e) lethe_engine_get_layout(e, &r.layout[ci]);
        lethe_eval_suite_run(suite, e, c, cerr[0] ? cerr : NULL, rows);
        lethe_engine_destroy(e); /* dense too: the inputs are prepared; free its memory for the next */
        dense = NULL;
    }
    lethe_eval_suite_finish_progress(suite);
    print_table(rows);

    cJSON *j = header(&r, suite, model);
    cJSON *cfgs = cJSON_AddArrayToObject(j, "configs");
    for (int ci = 0; ci < r.n_cfg; ci++) {
        cJSON *co = cJSON_CreateObject();
        cJSON_AddStringToObject(co, "method", r.cfg[ci].method);
        if (r.cfg[ci].budget >= 0) cJSON_AddNumberToObject(co, "budget", r.cfg[ci].budget);
        else cJSON_AddNullToObject(co, "budget");
        cJSON_AddStringToObject(co, "knobs", r.cfg[ci].knobs);
        /* what one token costs in this configuration's pool (the method's format on this
         * device: f32 KV on the CPU, 16-bit on CUDA), and the slots that bought */
        const lethe_engine_layout *lo = &r.layout[ci];
        if (lo->kv_token_bytes) {
            cJSON_AddNumberToObject(co, "kv_token_bytes", (double)lo->kv_token_bytes);
            cJSON_AddNumberToObject(co, "kv_slot_overhead_bytes", (double)lo->kv_slot_overhead_bytes);
            cJSON_AddNumberToObject(co, "kv_slots_per_layer", lo->kv_slots_per_layer);
            cJSON_AddNumberToObject(co, "kv_reserve_bytes", (double)lo->kv_reserve_bytes);
        }
        cJSON_AddItemToArray(cfgs, co);
    }
    cJSON_AddItemToObject(j, "rows", rows);
    char auto_json[1100];
    const char *out = o.result_json;
    if (!out && o.plot) { /* the plot is drawn from a JSON file: put it beside the PNG */
        snprintf(auto_json, sizeof(auto_json), "%s", o.plot);
        char *dot = strrchr(auto_json, '.');
        if (dot && !strchr(dot, '/')) *dot = '\0';
        strncat(auto_json, ".json", sizeof(auto_json) - strlen(auto_json) - 1);
        out = auto_json;
    }
    if (out) {
        char *txt = cJSON_Print(j);
        FILE *f = fopen(out, "w");
        if (!f || fputs(txt, f) < 0 || fputc('\n', f) == EOF) {
            fprintf(stderr, "lethe eval: cannot write %s\n", out);
            rc = 1;
            out = NULL;
        } else {
            fprintf(stderr, "lethe eval: results written to %s\n", out);
        }
        if (f) fclose(f);
        free(txt);
    }
    if (o.plot && (!out || draw_plot(out, o.plot) != 0)) rc = 1;
    cJSON_Delete(j);
    lethe_eval_suite_free(suite);
    lethe_eval_corpus_free(corpus);
    lethe_eval_corpus_free(pcorpus);
    return rc;
}

/* bench_prune.c - `lethe bench prune`: quality of prefix-cache pruning.
 *
 * A multi-turn transcript (a system prompt, then per turn a user request, an
 * assistant reply and a tool output holding an excerpt of a State of the
 * Union speech from --corpus, then a final question) is prefilled once on a
 * dense engine with the radix cache. The reference answer is the unpruned
 * greedy continuation (--answer-tokens). For every policy and keep ratio:
 * the cache is cleared (delete_subtree at the root), the transcript cached
 * again, the tool bodies pruned in one job (ranges = each tool message's
 * token span shrunk by 8 tokens at each end and aligned inward to 16, as the
 * replay client does; keep = floor(width x ratio)), and the reference answer
 * is teacher-forced on the pruned prefix. Reported per position of the
 * answer: KL(unpruned || pruned) of the next-token distributions (mean, p50,
 * p90, max) and top-1 agreement, with the resident KV before / after.
 * The unpruned forced run is compared with the unpruned prefill run too
 * (identical on the CPU: KL 0, the harness's own noise floor). */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "core/util.h"
#include "eval/eval.h"
#include "eval/runinfo.h"
#include "lethe.h"
#include "options.h"

typedef struct bp_opts {
    const char *model, *corpus, *policies, *ratios, *result_json;
    int32_t tools, tool_words, answer_tokens, threads, max_model_len;
} bp_opts;

typedef struct bp_out {
    int32_t n, cap;
    int32_t *tokens;
    float *logits; /* [n, n_vocab] when want_logits */
    int32_t n_vocab, cached;
    bool done, failed;
} bp_out;

static void on_event(void *user, const lethe_event *ev) {
    bp_out *o = user;
    if (ev->n_tokens) {
        if (o->n == o->cap) {
            o->cap = o->cap ? 2 * o->cap : 64;
            o->tokens = lethe_xrealloc(o->tokens, (size_t)o->cap * sizeof(int32_t));
            if (ev->logits)
                o->logits = lethe_xrealloc(o->logits, (size_t)o->cap * ev->n_vocab * sizeof(float));
        }
        if (ev->logits) {
            memcpy(o->logits + (size_t)o->n * ev->n_vocab, ev->logits,
                   (size_t)ev->n_vocab * sizeof(float));
            o->n_vocab = ev->n_vocab;
        }
        o->tokens[o->n++] = ev->token;
    }
    o->cached = ev->cached_tokens;
    if (ev->finished) {
        o->done = true;
        o->failed = ev->finish_reason == LETHE_FINISH_ERROR;
    }
}

static int run(lethe_engine *e, const int32_t *prompt, int32_t n, int32_t max_tokens,
               const int32_t *forced, int32_t n_forced, bool logits, bp_out *o) {
    memset(o, 0, sizeof(*o));
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = max_tokens;
    rp.sampling.ignore_eos = true;
    rp.prompt = prompt;
    rp.n_prompt = n;
    rp.forced = forced;
    rp.n_forced = n_forced;
    rp.want_logits = logits;
    rp.cb = on_event;
    rp.user = o;
    if (lethe_engine_add_request(e, &rp, NULL) != 0) return -1;
    while (lethe_engine_has_work(e))
        if (lethe_engine_step(e) != 0) return -1;
    return o->done && !o->failed ? 0 : -1;
}

static void out_free(bp_out *o) {
    free(o->tokens);
    free(o->logits);
}

/* speech excerpts: the first tool_words words of the first files (sorted) */
static char **load_excerpts(const char *dir, int32_t n, int32_t words) {
    struct dirent **list = NULL;
    int nf = scandir(dir, &list, NULL, alphasort);
    if (nf < 0) return NULL;
    char **out = lethe_xcalloc((size_t)n, sizeof(char *));
    int32_t k = 0;
    for (int i = 0; i < nf && k < n; i++) {
        if (strstr(list[i]->d_name, ".txt") && i % 7 == 3) { /* spread over the years */
            char path[1024];
            snprintf(path, sizeof(path), "%s/%s", dir, list[i]->d_name);
            FILE *f = fopen(path, "r");
            if (f) {
                char *buf = lethe_xcalloc(1, 1 << 20);
                size_t len = fread(buf, 1, (1 << 20) - 1, f);
                fclose(f);
                buf[len] = 0;
                int32_t w = 0;
                char *p = buf;
                for (; *p && w < words; p++)
                    if (*p == ' ' && p[1] != ' ') w++;
                *p = 0;
                for (char *c = buf; *c; c++)
                    if (*c == '\n' || *c == '\r') *c = ' ';
                out[k++] = buf;
            }
        }
    }
    for (int i = 0; i < nf; i++) free(list[i]);
    free(list);
    if (k < n) {
        for (int32_t i = 0; i < k; i++) free(out[i]);
        free(out);
        return NULL;
    }
    return out;
}

static int32_t n_tokens_of(lethe_engine *e, const char *const *roles, const char *const *contents,
                           size_t n, bool gen) {
    char *text = NULL;
    if (lethe_engine_apply_chat(e, roles, contents, n, gen, &text) != 0) return -1;
    int32_t *t = NULL, nt = 0;
    int rc = lethe_engine_tokenize(e, text, false, true, &t, &nt);
    free(text);
    free(t);
    return rc == 0 ? nt : -1;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int lethe_bench_prune(int argc, char **argv) {
    bp_opts o = {.model = "models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 .corpus = "/work/shared/data/sotu",
                 .policies = "snapkv_global",
                 .ratios = "0.2,0.5",
                 .tools = 4,
                 .tool_words = 300,
                 .answer_tokens = 64,
                 .threads = 0,
                 .max_model_len = 4096};
    lethe_opt rows[16];
    int n = 0;
#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}
    ROW("--model", NULL, LETHE_OPT_STR, &o.model, "PATH", "model (dense, radix prefix cache)", 1,
        0);
    ROW("--corpus", NULL, LETHE_OPT_STR, &o.corpus, "DIR",
        "folder of .txt speeches for the tool outputs", 1, 0);
    ROW("--policies", NULL, LETHE_OPT_STR, &o.policies, "P,...", "snapkv_global, kvzip_global", 1,
        0);
    ROW("--keep-ratios", NULL, LETHE_OPT_STR, &o.ratios, "R,...",
        "kept fraction of the tool bodies", 1, 0);
    ROW("--tools", NULL, LETHE_OPT_INT, &o.tools, "N", "tool outputs in the transcript", 1, 64);
    ROW("--tool-words", NULL, LETHE_OPT_INT, &o.tool_words, "N", "words per tool output", 16,
        100000);
    ROW("--answer-tokens", NULL, LETHE_OPT_INT, &o.answer_tokens, "N", "reference answer length", 1,
        4096);
    ROW("--threads", NULL, LETHE_OPT_INT, &o.threads, "N", "CPU threads (0 = all)", 0, 1024);
    ROW("--max-model-len", NULL, LETHE_OPT_INT, &o.max_model_len, "N", "context length", 256,
        1 << 20);
    ROW("--result-json", NULL, LETHE_OPT_STR, &o.result_json, "PATH", "write results as JSON", 1,
        0);
#undef ROW
    const char *pos[1];
    int n_pos = 0;
    int pr = lethe_opts_parse(
        rows, n, argc, argv, "lethe bench prune [options]",
        "Prefix-cache pruning quality: KL and top-1 of pruned vs unpruned continuations.", pos,
        &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    char **ex = load_excerpts(o.corpus, o.tools, o.tool_words);
    if (!ex) {
        fprintf(stderr, "lethe bench prune: cannot read %d speeches from %s\n", o.tools, o.corpus);
        return 2;
    }
    lethe_engine_params ep;
    lethe_engine_default_params(&ep);
    ep.model = o.model;
    ep.n_threads = o.threads;
    ep.max_model_len = o.max_model_len;
    ep.enable_prefix_caching = true;
    ep.prefix_cache_mode = "radix";
    ep.max_num_seqs = 4;
    lethe_engine *e = NULL;
    if (lethe_engine_create(&ep, &e) != 0) {
        fprintf(stderr, "lethe bench prune: %s\n", lethe_engine_last_error());
        return 2;
    }
    /* the transcript */
    const int32_t n_msgs = 2 + 3 * o.tools;
    const char **roles = lethe_xcalloc((size_t)n_msgs, sizeof(char *));
    char **contents = lethe_xcalloc((size_t)n_msgs, sizeof(char *));
    int32_t m = 0;
    roles[m] = "system";
    contents[m++] = lethe_xstrdup(
        "You are a research assistant. You call a reader tool that returns passages of "
        "State of the Union addresses, then answer questions about them.");
    for (int32_t i = 0; i < o.tools; i++) {
        char buf[160];
        snprintf(buf, sizeof(buf), "Please read passage %d of the archive.", i + 1);
        roles[m] = "user";
        contents[m++] = lethe_xstrdup(buf);
        roles[m] = "assistant";
        contents[m++] = lethe_xstrdup("Calling the reader tool for that passage.");
        roles[m] = "user";
        size_t L = strlen(ex[i]) + 32;
        contents[m] = lethe_xmalloc(L);
        snprintf(contents[m++], L, "Tool output: %s", ex[i]);
    }
    roles[m] = "user";
    contents[m++] = lethe_xstrdup(
        "Based on the passages, what did the presidents say about commerce, public "
        "credit and the revenue? Answer in a few sentences.");
    LETHE_ASSERT(m == n_msgs);
    char *text = NULL;
    int32_t *prompt = NULL, np = 0;
    if (lethe_engine_apply_chat(e, roles, (const char *const *)contents, (size_t)n_msgs, true,
                                &text) != 0 ||
        lethe_engine_tokenize(e, text, false, true, &prompt, &np) != 0) {
        fprintf(stderr, "lethe bench prune: %s\n", lethe_engine_last_error());
        return 2;
    }
    free(text);
    /* the tool bodies' spans: message k lies between the renders of [0, k) and [0, k] */
    lethe_prune_range ranges[64];
    int32_t nr = 0, width = 0;
    for (int32_t i = 0; i < o.tools; i++) {
        const int32_t k = 3 + 3 * i;
        int32_t a = n_tokens_of(e, roles, (const char *const *)contents, (size_t)k, false);
        int32_t b = n_tokens_of(e, roles, (const char *const *)contents, (size_t)k + 1, false);
        int32_t s = (a + 8 + 15) / 16 * 16, en = (b - 8) / 16 * 16;
        if (a < 0 || b < 0 || en - s < 32) continue;
        ranges[nr++] = (lethe_prune_range){s, en};
        width += en - s;
    }
    printf("transcript: %d tokens, %d tool bodies, %d prunable tokens in ranges\n", np, nr, width);
    /* reference: the unpruned greedy answer, then the same forced (logits) */
    bp_out ref, ref_f;
    if (run(e, prompt, np, o.answer_tokens, NULL, 0, true, &ref) != 0 ||
        run(e, prompt, np, o.answer_tokens, ref.tokens, ref.n, true, &ref_f) != 0) {
        fprintf(stderr, "lethe bench prune: reference run failed: %s\n", lethe_engine_last_error());
        return 2;
    }
    const int32_t V = ref.n_vocab, A = ref.n;
    double floor_kl = 0;
    for (int32_t j = 0; j < A; j++)
        floor_kl = fmax(floor_kl,
                        lethe_eval_kl(ref.logits + (size_t)j * V, ref_f.logits + (size_t)j * V, V));
    printf("unpruned forced vs unpruned greedy: max KL %.3g over %d positions\n", floor_kl, A);
    cJSON *res = cJSON_CreateObject();
    char info[256];
    cJSON_AddStringToObject(res, "schema", "lethe-bench-prune/1");
    lethe_runinfo_commit(info, sizeof(info));
    cJSON_AddStringToObject(res, "commit", info);
    lethe_runinfo_date(info, sizeof(info));
    cJSON_AddStringToObject(res, "date", info);
    lethe_runinfo_machine(info, sizeof(info));
    cJSON_AddStringToObject(res, "machine", info);
    cJSON_AddStringToObject(res, "model", o.model);
    cJSON_AddNumberToObject(res, "transcript_tokens", np);
    cJSON_AddNumberToObject(res, "tool_bodies", nr);
    cJSON_AddNumberToObject(res, "range_tokens", width);
    cJSON_AddNumberToObject(res, "answer_tokens", A);
    cJSON_AddNumberToObject(res, "noise_floor_max_kl", floor_kl);
    cJSON *arr = cJSON_AddArrayToObject(res, "results");
    int rc = 0;
    char *plist = lethe_xstrdup(o.policies);
    for (char *sp = NULL, *pol = strtok_r(plist, ",", &sp); pol; pol = strtok_r(NULL, ",", &sp)) {
        char *rlist = lethe_xstrdup(o.ratios);
        for (char *sr = NULL, *rs = strtok_r(rlist, ",", &sr); rs; rs = strtok_r(NULL, ",", &sr)) {
            const double ratio = atof(rs);
            int32_t deleted = 0;
            lethe_engine_prefix_delete_subtree(e, prompt, 16,
                                               &deleted); /* a fresh, unpruned cache */
            bp_out warm;
            if (run(e, prompt, np, 1, NULL, 0, false, &warm) != 0) rc = 2;
            out_free(&warm);
            lethe_prefix_match m0, m1;
            lethe_engine_prefix_match(e, prompt, np, &m0);
            lethe_prune_params pp = {.tokens = prompt,
                                     .n_tokens = np,
                                     .ranges = ranges,
                                     .n_ranges = nr,
                                     .keep_tokens = (int32_t)floor(width * ratio),
                                     .policy = !strcmp(pol, "kvzip_global")
                                                   ? LETHE_PRUNE_KVZIP_GLOBAL
                                                   : LETHE_PRUNE_SNAPKV_GLOBAL,
                                     .observation_tokens = 64};
            lethe_prune_result pres;
            double t0 = lethe_time_s();
            if (lethe_engine_prune(e, &pp, &pres) != 0) {
                fprintf(stderr, "lethe bench prune: %s\n", lethe_engine_last_error());
                rc = 2;
                continue;
            }
            double t_prune = lethe_time_s() - t0;
            if (pres.status != LETHE_PRUNE_COMPLETED) {
                printf("%-14s keep %.2f: %s\n", pol, ratio, pres.message);
                cJSON *r = cJSON_CreateObject();
                cJSON_AddStringToObject(r, "policy", pol);
                cJSON_AddNumberToObject(r, "keep_ratio", ratio);
                cJSON_AddStringToObject(r, "error", pres.message);
                cJSON_AddItemToArray(arr, r);
                rc = 1;
                continue;
            }
            lethe_engine_prefix_match(e, prompt, np, &m1);
            bp_out pr_f;
            if (run(e, prompt, np, A, ref.tokens, A, true, &pr_f) != 0 || pr_f.n != A) {
                rc = 2;
                out_free(&pr_f);
                continue;
            }
            double *kl = lethe_xmalloc((size_t)A * sizeof(double)), mean = 0;
            int32_t top1 = 0;
            for (int32_t j = 0; j < A; j++) {
                kl[j] = lethe_eval_kl(ref.logits + (size_t)j * V, pr_f.logits + (size_t)j * V, V);
                mean += kl[j] / A;
                top1 += lethe_eval_argmax(ref.logits + (size_t)j * V, V) ==
                        lethe_eval_argmax(pr_f.logits + (size_t)j * V, V);
            }
            qsort(kl, (size_t)A, sizeof(double), cmp_d);
            printf("%-14s keep %.2f: freed %lld of %d, resident %d -> %d of %d matched, cached %d; "
                   "KL mean %.4f p50 "
                   "%.4f p90 %.4f max %.4f; top-1 %.3f; prune %.2f s\n",
                   pol, ratio, (long long)pres.freed_device_slots, width, m0.resident_kv_tokens,
                   m1.resident_kv_tokens, m1.matched_tokens, pr_f.cached, mean, kl[A / 2],
                   kl[(A * 9) / 10], kl[A - 1], (double)top1 / A, t_prune);
            cJSON *r = cJSON_CreateObject();
            cJSON_AddStringToObject(r, "policy", pol);
            cJSON_AddNumberToObject(r, "keep_ratio", ratio);
            cJSON_AddNumberToObject(r, "keep_tokens", pp.keep_tokens);
            cJSON_AddNumberToObject(r, "freed_device_slots", (double)pres.freed_device_slots);
            cJSON_AddNumberToObject(r, "resident_before", m0.resident_kv_tokens);
            cJSON_AddNumberToObject(r, "resident_after", m1.resident_kv_tokens);
            cJSON_AddNumberToObject(r, "matched_tokens", m1.matched_tokens);
            cJSON_AddNumberToObject(r, "cached_tokens_next_turn", pr_f.cached);
            cJSON_AddNumberToObject(r, "kl_mean", mean);
            cJSON_AddNumberToObject(r, "kl_p50", kl[A / 2]);
            cJSON_AddNumberToObject(r, "kl_p90", kl[(A * 9) / 10]);
            cJSON_AddNumberToObject(r, "kl_max", kl[A - 1]);
            cJSON_AddNumberToObject(r, "top1_agreement", (double)top1 / A);
            cJSON_AddNumberToObject(r, "prune_seconds", t_prune);
            cJSON_AddItemToArray(arr, r);
            free(kl);
            out_free(&pr_f);
        }
        free(rlist);
    }
    free(plist);
    if (o.result_json) {
        char *s = cJSON_Print(res);
        FILE *f = fopen(o.result_json, "w");
        if (f) {
            fputs(s, f);
            fclose(f);
        }
        free(s);
    }
    cJSON_Delete(res);
    out_free(&ref);
    out_free(&ref_f);
    free(prompt);
    for (int32_t i = 0; i < n_msgs; i++) free(contents[i]);
    free(contents);
    free(roles);
    for (int32_t i = 0; i < o.tools; i++) free(ex[i]);
    free(ex);
    lethe_engine_destroy(e);
    return rc;
}

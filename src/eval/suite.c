/* suite.c - prepares the `lethe eval` inputs once and runs every configuration on them.
 *
 * Tasks: samples per (length, task) generated from seed * 1000003 + i at
 * target length L - 64 (room for the answer) and rendered with the chat
 * template; each configuration answers them greedily (harness.c) and the
 * scorer compares the parsed answer exactly.
 * Windows: documents of the ppl corpus are concatenated from a seed-chosen
 * one into a token stream; window w of every length L teacher-forces the T
 * tokens stream[off + wT, off + (w+1)T) after the L - T tokens before them
 * (off = longest L - T), so every length scores the same tokens. Dense runs
 * first and writes its logits [length][window][T][n_vocab] (float32) to a
 * temporary file; every other configuration reads them back position by
 * position for KL(dense || method) and top-1 agreement. */
#include "eval/suite.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "core/util.h"
#include "eval/harness.h"
#include "eval/runinfo.h"

typedef struct eval_tsample {   /* one task sample at one length */
    lethe_eval_sample s;
    int32_t *ids;               /* rendered prompt */
    int32_t n_ids;
    char error[256];            /* why it has no prompt (length too long, corpus too small) */
} eval_tsample;

struct lethe_eval_suite {
    lethe_eval_suite_params p;
    int32_t *lengths;           /* = p.lengths */
    int32_t n_lengths;
    bool *task_on;              /* = p.task_on */
    eval_tsample *ts;           /* [n_lengths][N_TASKS][samples] */
    int32_t *stream, n_stream, off, bos;
    char ppl_docs[512];
    int32_t max_len;
    FILE *ref;                  /* dense logits, [n_lengths][windows][T][n_vocab] float32 */
    bool *ref_ok;               /* [n_lengths][windows] the dense window completed */
    int32_t n_vocab;
    lethe_progress pb;
    int64_t done_units;
    char detail[128];
};

static eval_tsample *ts_at(lethe_eval_suite *r, int li, int t, int s) {
    return &r->ts[((size_t)li * LETHE_EVAL_N_TASKS + (size_t)t) * (size_t)r->p.samples + (size_t)s];
}

static void prepare_tasks(lethe_eval_suite *r, lethe_engine *e, const lethe_eval_corpus *c) {
    for (int li = 0; li < r->n_lengths; li++)
        for (int t = 0; t < LETHE_EVAL_N_TASKS; t++) {
            if (!r->task_on[t]) continue;
            for (int s = 0; s < r->p.samples; s++) {
                eval_tsample *x = ts_at(r, li, t, s);
                int32_t L = r->lengths[li];
                uint64_t seed = r->p.seed * 1000003ull + (uint64_t)s;
                if (L > r->max_len) {
                    snprintf(x->error, sizeof(x->error), "context length %d exceeds the model's max_model_len %d",
                             L, r->max_len);
                    continue;
                }
                if (lethe_eval_generate((lethe_eval_task)t, c, seed, L - LETHE_EVAL_GEN_RESERVE, lethe_eval_measure_engine, e,
                                        &x->s) != LETHE_OK ||
                    lethe_eval_render(e, x->s.user, x->s.answer_prefix, &x->ids, &x->n_ids) != LETHE_OK) {
                    snprintf(x->error, sizeof(x->error), "%s", lethe_last_error());
                    continue;
                }
            }
        }
}

static int prepare_ppl(lethe_eval_suite *r, lethe_engine *e, const lethe_eval_corpus *c) {
    int32_t T = r->p.forced_tokens, Lmax = 0;
    for (int li = 0; li < r->n_lengths; li++)
        if (r->lengths[li] <= r->max_len) Lmax = LETHE_MAX(Lmax, r->lengths[li]);
    if (Lmax == 0) return 0; /* every length is too long: rows carry the error */
    int32_t *b = NULL, nb = 0;
    r->bos = -1;
    if (lethe_engine_tokenize(e, "", true, false, &b, &nb) == 0 && nb == 1) r->bos = b[0];
    free(b);
    int32_t need = (r->p.windows - 1) * T + Lmax;
    /* concatenate documents from a seed-chosen one until the stream is long enough */
    int32_t d0 = (int32_t)(r->p.seed % (uint64_t)c->n_docs);
    size_t cap = 0, len = 0;
    char *text = NULL;
    r->ppl_docs[0] = '\0';
    for (int32_t k = 0; k < c->n_docs; k++) {
        const char *doc = c->docs[(d0 + k) % c->n_docs];
        size_t dl = strlen(doc);
        if (len + dl + 3 > cap) {
            cap = (len + dl + 3) * 2;
            text = lethe_xrealloc(text, cap);
        }
        if (len) memcpy(text + len, "\n\n", 2), len += 2;
        memcpy(text + len, doc, dl + 1);
        len += dl;
        size_t pl = strlen(r->ppl_docs);
        snprintf(r->ppl_docs + pl, sizeof(r->ppl_docs) - pl, "%s%s", pl ? "," : "", c->doc_names[(d0 + k) % c->n_docs]);
        if ((int64_t)len < (int64_t)need * 3) continue; /* < ~3 bytes per token: surely too short */
        free(r->stream);
        r->stream = NULL;
        if (lethe_engine_tokenize(e, text, false, false, &r->stream, &r->n_stream) != 0) {
            fprintf(stderr, "lethe eval: tokenizing the ppl corpus: %s\n", lethe_engine_last_error());
            free(text);
            return -1;
        }
        if (r->n_stream >= need + 1) break;
    }
    free(text);
    if (r->n_stream < need + 1) {
        fprintf(stderr, "lethe eval: --ppl-corpus has %d tokens; %d windows of %d need %d\n", r->n_stream,
                r->p.windows, Lmax, need + 1);
        return -1;
    }
    r->off = Lmax - T;
    return 0;
}

/* ---- running one configuration ------------------------------------------------ */

typedef struct ppl_acc {        /* per (config, length) */
    lethe_eval_suite *r;
    int li;
    bool dense;
    float *buf;                 /* [n_vocab] dense logits read back */
    double nll_sum;
    int64_t n_tok;
    double *kl;                 /* [samples * T] */
    int64_t n_kl, n_top1;
    double *kl_pos;             /* [T] sums per position */
    int32_t *kl_pos_n;
    bool io_error;
} ppl_acc;

static void on_done(void *user, int32_t job) {
    lethe_eval_suite *r = user;
    (void)job;
    r->done_units++;
    lethe_progress_update(&r->pb, r->done_units, r->detail);
}

static void on_ppl_done(void *user, int32_t job) { on_done(((ppl_acc *)user)->r, job); }

static void on_logits(void *user, int32_t w, int32_t pos, int32_t token, const float *logits, int32_t nv) {
    ppl_acc *a = user;
    lethe_eval_suite *r = a->r;
    int32_t T = r->p.forced_tokens;
    if (r->n_vocab == 0) r->n_vocab = nv;
    LETHE_ASSERT(nv == r->n_vocab && pos < T);
    a->nll_sum += lethe_eval_nll(logits, nv, token);
    a->n_tok++;
    if (!r->ref) return; /* dense only: no comparison wanted */
    off_t at = ((((off_t)a->li * r->p.windows + w) * T) + pos) * (off_t)nv * (off_t)sizeof(float);
    if (fseeko(r->ref, at, SEEK_SET) != 0) {
        a->io_error = true;
        return;
    }
    if (a->dense) {
        if (fwrite(logits, sizeof(float), (size_t)nv, r->ref) != (size_t)nv) a->io_error = true;
        return;
    }
    if (!r->ref_ok[a->li * r->p.windows + w]) return;
    if (!a->buf) a->buf = lethe_xmalloc((size_t)nv * sizeof(float));
    if (fread(a->buf, sizeof(float), (size_t)nv, r->ref) != (size_t)nv) {
        a->io_error = true;
        return;
    }
    double kl = lethe_eval_kl(a->buf, logits, nv);
    a->kl[a->n_kl++] = kl;
    a->kl_pos[pos] += kl;
    a->kl_pos_n[pos]++;
    a->n_top1 += lethe_eval_argmax(a->buf, nv) == lethe_eval_argmax(logits, nv);
}

static void add_common(cJSON *row, const lethe_eval_config *c, int32_t L, const char *task) {
    cJSON_AddStringToObject(row, "method", c->method);
    if (c->budget >= 0) cJSON_AddNumberToObject(row, "budget", c->budget);
    else cJSON_AddNullToObject(row, "budget");
    cJSON_AddStringToObject(row, "knobs", c->knobs);
    cJSON_AddNumberToObject(row, "context_length", L);
    cJSON_AddStringToObject(row, "task", task);
}

static void num_or_null(cJSON *o, const char *k, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, k, v);
    else cJSON_AddNullToObject(o, k);
}

/* greedy task jobs of one length; appends one row per task */
static void run_tasks(lethe_eval_suite *r, lethe_engine *e, const lethe_eval_config *c, int li, const char *cfg_error, cJSON *rows) {
    int32_t S = r->p.samples, L = r->lengths[li];
    lethe_eval_job *jobs = lethe_xcalloc((size_t)LETHE_EVAL_N_TASKS * (size_t)S, sizeof(*jobs));
    int32_t *map = lethe_xcalloc((size_t)LETHE_EVAL_N_TASKS * (size_t)S, sizeof(int32_t));
    int32_t nj = 0;
    for (int t = 0; t < LETHE_EVAL_N_TASKS; t++) {
        if (!r->task_on[t]) continue;
        for (int s = 0; s < S; s++) {
            eval_tsample *x = ts_at(r, li, t, s);
            if (x->error[0] || cfg_error) {
                on_done(r, 0);
                continue;
            }
            jobs[nj] = (lethe_eval_job){.prompt = x->ids, .n_prompt = x->n_ids, .max_new_tokens = x->s.max_new_tokens};
            map[nj++] = t * S + s;
        }
    }
    if (nj) lethe_eval_run_jobs(e, jobs, nj, r->p.max_batch, NULL, on_done, r);
    for (int t = 0; t < LETHE_EVAL_N_TASKS; t++) {
        if (!r->task_on[t]) continue;
        cJSON *row = cJSON_CreateObject();
        add_common(row, c, L, lethe_eval_task_name((lethe_eval_task)t));
        cJSON *samples = cJSON_CreateArray();
        double score = 0, exact = 0, ptok = 0;
        int n_err = 0;
        char first_err[256] = "";
        for (int s = 0; s < S; s++) {
            eval_tsample *x = ts_at(r, li, t, s);
            lethe_eval_job *j = NULL;
            for (int k = 0; k < nj; k++)
                if (map[k] == t * S + s) j = &jobs[k];
            const char *err = cfg_error ? cfg_error : x->error[0] ? x->error : (j && j->error[0]) ? j->error : NULL;
            double sc = err || !j ? 0.0 : lethe_eval_score(&x->s, j->text);
            score += sc;
            exact += sc == 1.0;
            ptok += x->n_ids;
            cJSON *so = cJSON_CreateObject();
            cJSON_AddNumberToObject(so, "seed", (double)(r->p.seed * 1000003ull + (uint64_t)s));
            cJSON_AddNumberToObject(so, "prompt_tokens", x->n_ids);
            cJSON *ans = cJSON_AddArrayToObject(so, "answers");
            for (int k = 0; k < x->s.n_answers; k++) cJSON_AddItemToArray(ans, cJSON_CreateString(x->s.answers[k]));
            if (j && j->text) {
                char out[301];
                snprintf(out, sizeof(out), "%s", j->text);
                cJSON_AddStringToObject(so, "output", out);
            }
            cJSON_AddNumberToObject(so, "score", sc);
            if (err) {
                cJSON_AddStringToObject(so, "error", err);
                if (!n_err++) snprintf(first_err, sizeof(first_err), "%s", err);
            }
            cJSON_AddItemToArray(samples, so);
        }
        cJSON_AddNumberToObject(row, "n", S);
        cJSON_AddNumberToObject(row, "score", score / S);
        cJSON_AddNumberToObject(row, "exact", exact / S);
        cJSON_AddNumberToObject(row, "prompt_tokens_mean", ptok / S);
        if (n_err) {
            cJSON_AddNumberToObject(row, "errors", n_err);
            cJSON_AddStringToObject(row, "error", first_err);
        }
        cJSON_AddItemToObject(row, "samples", samples);
        cJSON_AddItemToArray(rows, row);
    }
    for (int k = 0; k < nj; k++) lethe_eval_job_free(&jobs[k]);
    free(jobs);
    free(map);
}

/* teacher-forced windows of one length; appends the "ppl" row */
static void run_ppl(lethe_eval_suite *r, lethe_engine *e, const lethe_eval_config *c, int li, const char *cfg_error, cJSON *rows) {
    int32_t S = r->p.windows, T = r->p.forced_tokens, L = r->lengths[li];
    bool dense = !strcmp(c->method, "dense");
    const char *err = cfg_error;
    char lbuf[160];
    if (!err && L > r->max_len) {
        snprintf(lbuf, sizeof(lbuf), "context length %d exceeds the model's max_model_len %d", L, r->max_len);
        err = lbuf;
    }
    if (!err && !r->stream) err = "no perplexity corpus prepared";
    ppl_acc a = {.r = r, .li = li, .dense = dense};
    a.kl = lethe_xcalloc((size_t)S * (size_t)T, sizeof(double));
    a.kl_pos = lethe_xcalloc((size_t)T, sizeof(double));
    a.kl_pos_n = lethe_xcalloc((size_t)T, sizeof(int32_t));
    lethe_eval_job *jobs = lethe_xcalloc((size_t)S, sizeof(*jobs));
    int32_t **prompts = lethe_xcalloc((size_t)S, sizeof(int32_t *));
    int n_fail = 0;
    if (!err) {
        for (int w = 0; w < S; w++) {
            /* scored chunk: stream[off + wT, off + (w+1)T); the prompt is the L - T tokens before it */
            int32_t end = r->off + w * T, np = L - T, has_bos = r->bos >= 0;
            prompts[w] = lethe_xmalloc((size_t)np * sizeof(int32_t));
            if (has_bos) prompts[w][0] = r->bos;
            memcpy(prompts[w] + has_bos, r->stream + end - (np - has_bos), (size_t)(np - has_bos) * sizeof(int32_t));
            jobs[w] = (lethe_eval_job){.prompt = prompts[w], .n_prompt = np, .forced = r->stream + end, .n_forced = T};
        }
        lethe_eval_run_jobs(e, jobs, S, r->p.max_batch, on_logits, on_ppl_done, &a);
        for (int w = 0; w < S; w++) {
            bool ok = !jobs[w].error[0] && jobs[w].n_out == T && !a.io_error;
            if (dense && r->ref_ok) r->ref_ok[li * S + w] = ok;
            if (!ok) {
                n_fail++;
                if (!err) err = jobs[w].error[0] ? jobs[w].error : a.io_error ? "reference logits file I/O failed"
                                                                           : "continuation cut short";
            }
        }
    } else {
        for (int w = 0; w < S; w++) on_done(r, 0);
        n_fail = S;
    }
    cJSON *row = cJSON_CreateObject();
    add_common(row, c, L, "ppl");
    cJSON_AddNumberToObject(row, "n", S);
    cJSON_AddNumberToObject(row, "forced_tokens", T);
    cJSON_AddNumberToObject(row, "scored_tokens", (double)a.n_tok);
    num_or_null(row, "ppl", a.n_tok ? exp(a.nll_sum / (double)a.n_tok) : NAN);
    num_or_null(row, "nll_mean", a.n_tok ? a.nll_sum / (double)a.n_tok : NAN);
    if (dense) {
        cJSON_AddStringToObject(row, "reference", "dense is the reference of KL and top-1");
    } else {
        lethe_eval_summary s;
        num_or_null(row, "top1_agree", a.n_kl ? (double)a.n_top1 / (double)a.n_kl : NAN);
        lethe_eval_summarize(a.kl, (size_t)a.n_kl, &s);
        num_or_null(row, "kl_mean", s.mean);
        num_or_null(row, "kl_median", s.median);
        num_or_null(row, "kl_p90", s.p90);
        num_or_null(row, "kl_p99", s.p99);
        num_or_null(row, "kl_max", s.max);
        cJSON *kp = cJSON_AddArrayToObject(row, "kl_by_position");
        for (int p = 0; p < T; p++)
            cJSON_AddItemToArray(kp, a.kl_pos_n[p] ? cJSON_CreateNumber(a.kl_pos[p] / a.kl_pos_n[p]) : cJSON_CreateNull());
    }
    if (err) {
        cJSON_AddNumberToObject(row, "errors", n_fail);
        cJSON_AddStringToObject(row, "error", err);
    }
    cJSON_AddItemToArray(rows, row);
    for (int w = 0; w < S; w++) {
        lethe_eval_job_free(&jobs[w]);
        free(prompts[w]);
    }
    free(prompts);
    free(jobs);
    free(a.kl);
    free(a.kl_pos);
    free(a.kl_pos_n);
    free(a.buf);
}


/* ---- public ------------------------------------------------------------------ */

lethe_status lethe_eval_suite_prepare(const lethe_eval_suite_params *p, lethe_engine *dense,
                                      const lethe_eval_corpus *corpus, const lethe_eval_corpus *ppl_corpus,
                                      lethe_eval_suite **out) {
    lethe_eval_suite *r = lethe_xcalloc(1, sizeof(*r));
    r->p = *p;
    r->lengths = r->p.lengths;
    r->n_lengths = r->p.n_lengths;
    r->task_on = r->p.task_on;
    r->max_len = lethe_engine_max_model_len(dense);
    r->ts = lethe_xcalloc((size_t)r->n_lengths * LETHE_EVAL_N_TASKS * (size_t)p->samples, sizeof(eval_tsample));
    *out = r;
    prepare_tasks(r, dense, corpus);
    lethe_status st = LETHE_OK;
    if (r->task_on[LETHE_EVAL_TASK_PPL]) {
        if (prepare_ppl(r, dense, ppl_corpus) != 0) st = LETHE_ERR_INVALID; /* printed; rows say it */
        if (p->n_configs > 1 && r->stream) {
            r->ref = tmpfile();
            r->ref_ok = lethe_xcalloc((size_t)r->n_lengths * (size_t)p->windows, sizeof(bool));
            if (!r->ref) fprintf(stderr, "lethe eval: cannot create a temporary file for dense logits; no KL / top-1\n");
        }
    }
    int n_tasks = 0;
    for (int t = 0; t < LETHE_EVAL_N_TASKS; t++) n_tasks += r->task_on[t];
    int64_t per_len = (int64_t)n_tasks * p->samples + (r->task_on[LETHE_EVAL_TASK_PPL] ? p->windows : 0);
    lethe_progress_init(&r->pb, "eval", (int64_t)p->n_configs * r->n_lengths * per_len, p->progress);
    return st;
}

void lethe_eval_suite_run(lethe_eval_suite *r, lethe_engine *e, const lethe_eval_config *c,
                          const char *cfg_error, cJSON *rows) {
    for (int li = 0; li < r->n_lengths; li++) {
        snprintf(r->detail, sizeof(r->detail), "%s%s%.20s L=%d", c->method, c->budget >= 0 ? "@" : "",
                 c->budget >= 0 ? strrchr(c->knobs, '=') + 1 : "", r->lengths[li]);
        run_tasks(r, e, c, li, cfg_error, rows);
        if (r->task_on[LETHE_EVAL_TASK_PPL]) run_ppl(r, e, c, li, cfg_error, rows);
    }
}

void lethe_eval_suite_finish_progress(lethe_eval_suite *s) { lethe_progress_done(&s->pb); }
int32_t lethe_eval_suite_max_len(const lethe_eval_suite *s) { return s->max_len; }
const char *lethe_eval_suite_ppl_docs(const lethe_eval_suite *s) { return s->ppl_docs; }

void lethe_eval_suite_free(lethe_eval_suite *r) {
    if (!r) return;
    for (size_t i = 0; i < (size_t)r->n_lengths * LETHE_EVAL_N_TASKS * (size_t)r->p.samples; i++) {
        lethe_eval_sample_free(&r->ts[i].s);
        free(r->ts[i].ids);
    }
    free(r->ts);
    free(r->stream);
    free(r->ref_ok);
    if (r->ref) fclose(r->ref);
    free(r);
}

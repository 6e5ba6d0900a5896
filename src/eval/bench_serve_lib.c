/* bench_serve_lib.c - SSE parsing, chunk parsing, workload and report of `lethe bench serve`.
 *
 * Kept free of networking so the numbers the benchmark prints are unit
 * tested: the SSE parser against arbitrary byte splits, the chunk parser
 * against completion / chat / usage / error chunks, the workload against its
 * length and arrival distributions, the report against hand-computed
 * records. Definitions follow vLLM's benchmark (see bench_serve.h). */
#include "eval/bench_serve.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "eval/eval.h"

/* ---- SSE ------------------------------------------------------------------ */

void lethe_sse_init(lethe_sse *s) { memset(s, 0, sizeof(*s)); }

void lethe_sse_free(lethe_sse *s) {
    free(s->line);
    free(s->data);
    memset(s, 0, sizeof(*s));
}

static void grow(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return;
    *cap = LETHE_MAX(need, *cap * 2 + 256);
    *buf = lethe_xrealloc(*buf, *cap);
}

static void sse_line(lethe_sse *s, lethe_sse_fn fn, void *user) {
    const char *l = s->line ? s->line : "";
    size_t n = s->n;
    if (n == 0) { /* blank line: dispatch */
        if (s->has_data) {
            grow(&s->data, &s->cap_data, s->n_data + 1);
            s->data[s->n_data] = '\0';
            fn(user, s->data, s->n_data);
        }
        s->n_data = 0;
        s->has_data = false;
        return;
    }
    if (l[0] == ':') return; /* comment / keep-alive */
    if (n >= 5 && !memcmp(l, "data:", 5)) {
        size_t off = 5 + (n > 5 && l[5] == ' ');
        if (s->has_data) {
            grow(&s->data, &s->cap_data, s->n_data + 1);
            s->data[s->n_data++] = '\n';
        }
        grow(&s->data, &s->cap_data, s->n_data + (n - off) + 1);
        memcpy(s->data + s->n_data, l + off, n - off);
        s->n_data += n - off;
        s->has_data = true;
    }
}

void lethe_sse_feed(lethe_sse *s, const char *bytes, size_t n, lethe_sse_fn fn, void *user) {
    for (size_t i = 0; i < n; i++) {
        char c = bytes[i];
        bool after_cr = s->last_cr;
        s->last_cr = c == '\r';
        if (c == '\n' || c == '\r') {
            /* "\r\n" is one line end (possibly split across two feeds) */
            if (c == '\n' && after_cr) continue;
            grow(&s->line, &s->cap, s->n + 1);
            s->line[s->n] = '\0';
            sse_line(s, fn, user);
            s->n = 0;
            continue;
        }
        grow(&s->line, &s->cap, s->n + 2);
        s->line[s->n++] = c;
    }
}

/* ---- chunks --------------------------------------------------------------- */

static int32_t get_int(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? (int32_t)v->valuedouble : -1;
}

void lethe_bs_parse_chunk(const char *data, size_t len, lethe_bs_chunk *out) {
    memset(out, 0, sizeof(*out));
    out->prompt_tokens = out->completion_tokens = out->cached_tokens = -1;
    while (len && (*data == ' ' || *data == '\t')) data++, len--;
    if (len >= 6 && !strncmp(data, "[DONE]", 6)) {
        out->done = true;
        return;
    }
    cJSON *j = cJSON_ParseWithLength(data, len);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return;
    }
    out->parsed = true;
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
    if (err && !cJSON_IsNull(err)) {
        const cJSON *m = cJSON_IsObject(err) ? cJSON_GetObjectItemCaseSensitive(err, "message") : err;
        snprintf(out->error, sizeof(out->error), "%s",
                 cJSON_IsString(m) ? m->valuestring : "error object without a message");
    }
    const cJSON *ch = cJSON_GetObjectItemCaseSensitive(j, "choices");
    const cJSON *c0 = cJSON_IsArray(ch) ? cJSON_GetArrayItem(ch, 0) : NULL;
    if (cJSON_IsObject(c0)) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(c0, "text");
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(c0, "delta");
        if (cJSON_IsObject(d)) t = cJSON_GetObjectItemCaseSensitive(d, "content");
        if (cJSON_IsString(t)) out->content_bytes = strlen(t->valuestring);
        out->finished = cJSON_IsString(cJSON_GetObjectItemCaseSensitive(c0, "finish_reason"));
    }
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
    if (cJSON_IsObject(u)) {
        out->has_usage = true;
        out->prompt_tokens = get_int(u, "prompt_tokens");
        out->completion_tokens = get_int(u, "completion_tokens");
        const cJSON *det = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens_details");
        if (cJSON_IsObject(det)) out->cached_tokens = get_int(det, "cached_tokens");
    }
    cJSON_Delete(j);
}

/* ---- workload ------------------------------------------------------------- */

static double rnd_unit(uint64_t *st) { /* (0, 1] */
    return ((double)(lethe_splitmix64(st) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

static int32_t rnd_len(uint64_t *st, int32_t len, float ratio) {
    int32_t lo = (int32_t)((double)len * (1.0 - ratio)), hi = (int32_t)((double)len * (1.0 + ratio));
    lo = LETHE_MAX(lo, 1);
    hi = LETHE_MAX(hi, lo);
    return lo + (int32_t)(lethe_splitmix64(st) % (uint64_t)(hi - lo + 1));
}

static char *words_text(uint64_t *st, int32_t n, const char *prefix) {
    size_t cap = (prefix ? strlen(prefix) : 0) + (size_t)n * 10 + 1, len = 0;
    char *s = lethe_xmalloc(cap);
    s[0] = '\0';
    if (prefix) {
        len = strlen(prefix);
        memcpy(s, prefix, len + 1);
    }
    for (int32_t i = 0; i < n; i++) {
        const char *w = lethe_bs_words[lethe_splitmix64(st) % (uint64_t)lethe_bs_n_words];
        int k = snprintf(s + len, cap - len, "%s%s", len ? " " : "", w);
        len += (size_t)k;
    }
    return s;
}

static lethe_status load_dataset(const lethe_bs_workload_params *p, lethe_bs_item *items) {
    char *text = NULL;
    lethe_status st = lethe_read_file(p->dataset, &text, NULL);
    if (st != LETHE_OK) return st;
    /* collect the non-empty lines */
    char **lines = NULL;
    int32_t n_lines = 0, cap = 0;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        while (*l == ' ' || *l == '\t' || *l == '\r') l++;
        if (!*l) continue;
        if (n_lines == cap) {
            cap = cap ? cap * 2 : 64;
            lines = lethe_xrealloc(lines, (size_t)cap * sizeof(char *));
        }
        lines[n_lines++] = l;
    }
    if (n_lines == 0) {
        st = lethe_errorf(LETHE_ERR_INVALID, "%s: no requests (empty file)", p->dataset);
        goto out;
    }
    for (int32_t i = 0; i < p->num_prompts; i++) {
        int32_t li = i % n_lines;
        cJSON *j = cJSON_Parse(lines[li]);
        if (!cJSON_IsObject(j)) {
            cJSON_Delete(j);
            st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: not a JSON object", p->dataset, li + 1);
            goto out;
        }
        const cJSON *pr = cJSON_GetObjectItemCaseSensitive(j, "prompt");
        const cJSON *ms = cJSON_GetObjectItemCaseSensitive(j, "messages");
        if (cJSON_IsString(pr)) {
            items[i].prompt = lethe_xstrdup(pr->valuestring);
        } else if (cJSON_IsArray(ms) && cJSON_GetArraySize(ms) > 0) {
            items[i].messages_json = cJSON_PrintUnformatted(ms);
            /* a text form for /v1/completions: the last message's content */
            const cJSON *last = cJSON_GetArrayItem(ms, cJSON_GetArraySize(ms) - 1);
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(last, "content");
            items[i].prompt = lethe_xstrdup(cJSON_IsString(c) ? c->valuestring : "");
        } else {
            cJSON_Delete(j);
            st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: needs \"prompt\" (string) or \"messages\" (array)",
                              p->dataset, li + 1);
            goto out;
        }
        int32_t ol = get_int(j, "output_len");
        if (ol < 0) ol = get_int(j, "max_tokens");
        items[i].output_len = ol > 0 ? ol : p->output_len;
        items[i].input_len = get_int(j, "input_len");
        cJSON_Delete(j);
    }
out:
    free(lines);
    free(text);
    return st;
}

lethe_status lethe_bs_workload_make(const lethe_bs_workload_params *p, lethe_bs_item **out) {
    *out = NULL;
    if (p->num_prompts <= 0) return lethe_errorf(LETHE_ERR_INVALID, "--num-prompts must be > 0");
    if (p->range_ratio < 0 || p->range_ratio >= 1)
        return lethe_errorf(LETHE_ERR_INVALID, "--random-range-ratio must be in [0, 1)");
    lethe_bs_item *items = lethe_xcalloc((size_t)p->num_prompts, sizeof(*items));
    uint64_t st = p->seed ^ 0x62656e6368ull;
    if (p->dataset) {
        lethe_status s = load_dataset(p, items);
        if (s != LETHE_OK) {
            lethe_bs_workload_free(items, p->num_prompts);
            return s;
        }
    } else {
        if (p->shared_prefix_len > p->input_len)
            return free(items), lethe_errorf(LETHE_ERR_INVALID,
                                             "--shared-prefix-len %d exceeds --random-input-len %d",
                                             p->shared_prefix_len, p->input_len);
        uint64_t pst = p->seed ^ 0x707265666978ull; /* the prefix depends on the seed only */
        char *prefix = p->shared_prefix_len > 0 ? words_text(&pst, p->shared_prefix_len, NULL) : NULL;
        for (int32_t i = 0; i < p->num_prompts; i++) {
            int32_t in = rnd_len(&st, p->input_len, p->range_ratio);
            in = LETHE_MAX(in, p->shared_prefix_len);
            items[i].input_len = in;
            items[i].output_len = rnd_len(&st, p->output_len, p->range_ratio);
            items[i].prompt = words_text(&st, in - p->shared_prefix_len, prefix);
        }
        free(prefix);
    }
    double t = 0;
    bool burst = !(p->request_rate > 0) || isinf(p->request_rate);
    for (int32_t i = 0; i < p->num_prompts; i++) {
        items[i].arrival_s = burst ? 0.0 : t;
        if (!burst) t += -log(rnd_unit(&st)) / p->request_rate;
    }
    *out = items;
    return LETHE_OK;
}

void lethe_bs_workload_free(lethe_bs_item *items, int32_t n) {
    if (!items) return;
    for (int32_t i = 0; i < n; i++) {
        free(items[i].prompt);
        free(items[i].messages_json);
    }
    free(items);
}

/* ---- report --------------------------------------------------------------- */

static void add_dist(cJSON *obj, const char *name, double *v, size_t n, const double *pcts, int n_pcts) {
    char key[64];
    lethe_eval_summary s;
    lethe_eval_summarize(v, n, &s); /* sorts v */
#define PUT(fmt, val)                                                          \
    do {                                                                       \
        snprintf(key, sizeof(key), fmt, name);                                 \
        double x_ = (val);                                                     \
        if (isfinite(x_)) cJSON_AddNumberToObject(obj, key, x_ * 1000.0);      \
        else cJSON_AddNullToObject(obj, key);                                  \
    } while (0)
    PUT("mean_%s_ms", s.mean);
    PUT("median_%s_ms", s.median);
    PUT("std_%s_ms", s.std);
    for (int i = 0; i < n_pcts; i++) {
        char pk[32];
        snprintf(pk, sizeof(pk), "p%g_%%s_ms", pcts[i]);
        PUT(pk, lethe_eval_percentile(v, n, pcts[i]));
    }
#undef PUT
}

void lethe_bs_report(cJSON *obj, const lethe_bs_record *r, int32_t n, double duration_s,
                     const double *pcts, int n_pcts) {
    double *ttft = lethe_xmalloc((size_t)LETHE_MAX(n, 1) * sizeof(double));
    double *tpot = lethe_xmalloc((size_t)LETHE_MAX(n, 1) * sizeof(double));
    double *e2el = lethe_xmalloc((size_t)LETHE_MAX(n, 1) * sizeof(double));
    size_t n_itl = 0, k_tpot = 0, k = 0;
    for (int32_t i = 0; i < n; i++)
        if (r[i].ok) n_itl += (size_t)r[i].n_itl;
    double *itl = lethe_xmalloc(LETHE_MAX(n_itl, 1) * sizeof(double));
    int64_t in_tok = 0, out_tok = 0, cached = 0;
    int32_t failed = 0;
    n_itl = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!r[i].ok) {
            failed++;
            continue;
        }
        double e = r[i].t_end - r[i].t_start;
        double f = r[i].t_first >= 0 ? r[i].t_first - r[i].t_start : e;
        ttft[k] = f;
        e2el[k++] = e;
        if (r[i].output_tokens > 1) tpot[k_tpot++] = (e - f) / (r[i].output_tokens - 1);
        for (int32_t j = 0; j < r[i].n_itl; j++) itl[n_itl++] = r[i].itl[j];
        in_tok += r[i].prompt_tokens > 0 ? r[i].prompt_tokens : 0;
        out_tok += r[i].output_tokens;
        cached += r[i].cached_tokens > 0 ? r[i].cached_tokens : 0;
    }
    cJSON_AddNumberToObject(obj, "duration", duration_s);
    cJSON_AddNumberToObject(obj, "completed", (double)k);
    cJSON_AddNumberToObject(obj, "failed", failed);
    cJSON_AddNumberToObject(obj, "total_input_tokens", (double)in_tok);
    cJSON_AddNumberToObject(obj, "total_output_tokens", (double)out_tok);
    cJSON_AddNumberToObject(obj, "total_cached_tokens", (double)cached);
    double d = duration_s > 0 ? duration_s : NAN;
    cJSON_AddNumberToObject(obj, "request_throughput", isfinite(d) ? (double)k / d : 0);
    cJSON_AddNumberToObject(obj, "output_throughput", isfinite(d) ? (double)out_tok / d : 0);
    cJSON_AddNumberToObject(obj, "total_token_throughput", isfinite(d) ? (double)(in_tok + out_tok) / d : 0);
    add_dist(obj, "ttft", ttft, k, pcts, n_pcts);
    add_dist(obj, "tpot", tpot, k_tpot, pcts, n_pcts);
    add_dist(obj, "itl", itl, n_itl, pcts, n_pcts);
    add_dist(obj, "e2el", e2el, k, pcts, n_pcts);
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
}

/* ---- Prometheus ----------------------------------------------------------- */

bool lethe_bs_prom_sum(const char *text, const char *suffix, double *out) {
    size_t sl = strlen(suffix);
    bool any = false;
    double sum = 0;
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (*l == '#' || *l == '\n') continue;
        size_t nl = strcspn(l, "{ \t\n");
        if (nl < sl || memcmp(l + nl - sl, suffix, sl) != 0) continue;
        if (nl > sl && l[nl - sl - 1] != ':') continue; /* "prefix:" + suffix, or exactly suffix */
        const char *v = l + nl;
        if (*v == '{') { /* skip labels; values may contain '}' only inside quotes */
            bool q = false;
            for (v++; *v && *v != '\n' && (q || *v != '}'); v++) {
                if (*v == '\\' && v[1]) v++;
                else if (*v == '"') q = !q;
            }
            if (*v == '}') v++;
        }
        char *end = NULL;
        double x = strtod(v, &end);
        if (end == v) continue;
        sum += x;
        any = true;
    }
    *out = sum;
    return any;
}

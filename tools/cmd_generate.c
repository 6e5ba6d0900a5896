/* cmd_generate.c - `lethe generate`: one-shot, interactive chat, or a JSONL
 * batch through the batching engine.
 *
 *   lethe generate -p "Why is the sky blue?"        chat-wrapped user message, streamed
 *   lethe generate -p "Once upon a time" --raw      plain completion of the text
 *   lethe generate --chat [--system S]              multi-turn REPL on stdin
 *   lethe generate --input in.jsonl --output out.jsonl
 *       each line {"prompt": "..."} | {"messages": [...]} | {"prompt_token_ids": [...]}
 *       plus optional sampling fields (temperature, top_k, top_p, min_p,
 *       repetition/presence/frequency_penalty, max_tokens, seed, stop,
 *       stop_token_ids, ignore_eos, logprobs, forced_token_ids) and an "id"
 *       that is copied through; one result line per input line, in input
 *       order, with text, token_ids, finish_reason, usage (and error for
 *       rejected lines).
 *       forced_token_ids (as `lethe serve`): the i-th generated token is
 *       forced_token_ids[i] and the request ends after the last one (teacher
 *       forcing: logits at every position of a known continuation).
 *       --dump-logits FILE writes the raw next-token logits behind every
 *       generated token as little-endian float32 rows of n_vocab, requests in
 *       input order, each with completion_tokens rows (tests compare them
 *       with transformers: tests/gpu/test_hf_logits.py).
 *
 * Every request goes through lethe_engine_add_request / lethe_engine_step,
 * so --input batches are scheduled together (continuous batching, prefix
 * cache). Timing goes to stderr: prompt tokens/s (prefill, up to the first
 * token) and generation tokens/s. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"
#include "core/util.h"
#include "lethe.h"
#include "options.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define GEN_DEFAULT_MAX_TOKENS 256

/* ---- one streamed request (one-shot and chat) ---- */

typedef struct stream_state {
    bool done;
    lethe_finish_reason why;
    char *error;
    int32_t n_prompt, n_gen, n_cached;
    double t_first, t_end, ttft;
    char *text;           /* whole reply (chat history) */
    size_t n_text, cap_text;
} stream_state;

static void stream_cb(void *user, const lethe_event *ev) {
    stream_state *s = user;
    if (ev->n_tokens > 0 && s->n_gen == 0) s->t_first = lethe_time_s();
    s->n_gen = ev->completion_tokens;
    s->n_prompt = ev->prompt_tokens;
    s->n_cached = ev->cached_tokens;
    s->ttft = ev->ttft_s;
    if (ev->text && ev->text[0]) {
        size_t n = strlen(ev->text);
        fwrite(ev->text, 1, n, stdout);
        fflush(stdout);
        if (s->n_text + n + 1 > s->cap_text) {
            s->cap_text = (s->n_text + n + 1) * 2;
            s->text = lethe_xrealloc(s->text, s->cap_text);
        }
        memcpy(s->text + s->n_text, ev->text, n);
        s->n_text += n;
        s->text[s->n_text] = '\0';
    }
    if (ev->finished) {
        s->done = true;
        s->why = ev->finish_reason;
        s->t_end = lethe_time_s();
        if (ev->error) s->error = lethe_xstrdup(ev->error);
    }
}

static const char *reason_name(lethe_finish_reason r) {
    switch (r) {
    case LETHE_FINISH_STOP: return "stop";
    case LETHE_FINISH_LENGTH: return "length";
    case LETHE_FINISH_ABORT: return "abort";
    case LETHE_FINISH_ERROR: return "error";
    default: return "none";
    }
}

/* Runs one prompt to completion, streaming to stdout; timing on stderr. */
static int run_stream(lethe_engine *e, const int32_t *ids, int32_t n, const lethe_sampling_params *sp,
                      bool quiet, stream_state *s) {
    memset(s, 0, sizeof(*s));
    lethe_request_params rp = {.prompt = ids, .n_prompt = n, .sampling = *sp, .cb = stream_cb, .user = s};
    uint64_t id;
    if (lethe_engine_add_request(e, &rp, &id) != 0) {
        fprintf(stderr, "lethe generate: %s\n", lethe_engine_last_error());
        return 1;
    }
    double t0 = lethe_time_s();
    while (lethe_engine_has_work(e))
        if (lethe_engine_step(e) != 0) {
            fprintf(stderr, "lethe generate: %s\n", lethe_engine_last_error());
            return 1;
        }
    if (s->why == LETHE_FINISH_ERROR) {
        fprintf(stderr, "\nlethe generate: %s\n", s->error ? s->error : "request failed");
        return 1;
    }
    if (!quiet) {
        double prefill = s->n_gen > 0 ? s->t_first - t0 : s->t_end - t0;
        double gen = s->t_end - s->t_first;
        int32_t computed = s->n_prompt - s->n_cached;
        fprintf(stderr, "\n[prompt: %d tokens (%d cached) in %.2f s, %.1f tok/s | generation: %d tokens in %.2f s, "
                        "%.1f tok/s | finish: %s]\n",
                s->n_prompt, s->n_cached, prefill, prefill > 0 ? computed / prefill : 0.0, s->n_gen, gen,
                gen > 0 && s->n_gen > 1 ? (s->n_gen - 1) / gen : 0.0, reason_name(s->why));
    }
    return 0;
}

/* ---- prompt building ---- */

static int chat_ids(lethe_engine *e, const char *const *roles, const char *const *contents, size_t n,
                    int32_t **ids, int32_t *n_ids) {
    char *text = NULL;
    if (lethe_engine_apply_chat(e, roles, contents, n, true, &text) != 0) {
        fprintf(stderr, "lethe generate: chat template: %s\n", lethe_engine_last_error());
        return 1;
    }
    int st = lethe_engine_tokenize(e, text, false, true, ids, n_ids);
    free(text);
    if (st != 0) {
        fprintf(stderr, "lethe generate: %s\n", lethe_engine_last_error());
        return 1;
    }
    return 0;
}

static char *read_all(FILE *f) {
    size_t cap = 4096, n = 0;
    char *buf = lethe_xmalloc(cap);
    size_t k;
    while ((k = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (cap - n - 1 == 0) buf = lethe_xrealloc(buf, cap *= 2);
    }
    buf[n] = '\0';
    return buf;
}

/* ---- interactive chat ---- */

static int run_chat(lethe_engine *e, const char *system, const lethe_sampling_params *sp) {
    size_t n = 0, cap = 16;
    const char **roles = lethe_xmalloc(cap * sizeof(char *));
    char **contents = lethe_xmalloc(cap * sizeof(char *));
    if (system) {
        roles[n] = "system";
        contents[n++] = lethe_xstrdup(system);
    }
    fprintf(stderr, "lethe chat with %s: type a message; /reset clears the conversation, /exit or Ctrl-D quits\n",
            lethe_engine_model_name(e));
    char *line = NULL;
    size_t line_cap = 0;
    int rc = 0;
    for (;;) {
        fprintf(stderr, "> ");
        fflush(stderr);
        ssize_t k = getline(&line, &line_cap, stdin);
        if (k < 0) break;
        while (k > 0 && (line[k - 1] == '\n' || line[k - 1] == '\r')) line[--k] = '\0';
        if (!strcmp(line, "/exit")) break;
        if (!strcmp(line, "/reset")) {
            for (size_t i = system ? 1 : 0; i < n; i++) free(contents[i]);
            n = system ? 1 : 0;
            continue;
        }
        if (k == 0) continue;
        if (n + 2 > cap) {
            cap *= 2;
            roles = lethe_xrealloc(roles, cap * sizeof(char *));
            contents = lethe_xrealloc(contents, cap * sizeof(char *));
        }
        roles[n] = "user";
        contents[n++] = lethe_xstrdup(line);
        int32_t *ids = NULL, n_ids = 0;
        if (chat_ids(e, roles, (const char *const *)contents, n, &ids, &n_ids)) { rc = 1; break; }
        stream_state s;
        rc = run_stream(e, ids, n_ids, sp, false, &s);
        free(ids);
        free(s.error);
        if (rc) { free(s.text); break; }
        roles[n] = "assistant";
        contents[n++] = s.text ? s.text : lethe_xstrdup("");
    }
    free(line);
    for (size_t i = 0; i < n; i++) free(contents[i]);
    free(roles);
    free(contents);
    return rc;
}

/* ---- JSONL batch ---- */

typedef struct batch_item {
    int32_t *ids;
    int32_t n_ids;
    lethe_sampling_params sp;
    char *stop_copy[LETHE_MAX_STOP];
    cJSON *id_field;         /* copied through */
    char *error;             /* rejected line */
    /* result */
    bool done;
    lethe_finish_reason why;
    char *text;
    size_t n_text, cap_text;
    int32_t *out_ids;
    int32_t n_out, cap_out;
    int32_t *forced;
    int32_t n_forced;
    float *logits;           /* --dump-logits: [n_out, n_vocab] */
    int32_t n_vocab;
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    double ttft, t_submit, latency;
} batch_item;

static void batch_cb(void *user, const lethe_event *ev) {
    batch_item *b = user;
    if (ev->n_tokens > 0) {
        if (b->n_out == b->cap_out) {
            b->cap_out = b->cap_out ? 2 * b->cap_out : 64;
            b->out_ids = lethe_xrealloc(b->out_ids, (size_t)b->cap_out * sizeof(int32_t));
        }
        if (ev->logits) {
            b->logits = lethe_xrealloc(b->logits, (size_t)b->cap_out * (size_t)ev->n_vocab * sizeof(float));
            memcpy(b->logits + (size_t)b->n_out * (size_t)ev->n_vocab, ev->logits, (size_t)ev->n_vocab * sizeof(float));
            b->n_vocab = ev->n_vocab;
        }
        b->out_ids[b->n_out++] = ev->token;
    }
    if (ev->text && ev->text[0]) {
        size_t n = strlen(ev->text);
        if (b->n_text + n + 1 > b->cap_text) {
            b->cap_text = (b->n_text + n + 1) * 2;
            b->text = lethe_xrealloc(b->text, b->cap_text);
        }
        memcpy(b->text + b->n_text, ev->text, n);
        b->n_text += n;
        b->text[b->n_text] = '\0';
    }
    b->prompt_tokens = ev->prompt_tokens;
    b->completion_tokens = ev->completion_tokens;
    b->cached_tokens = ev->cached_tokens;
    b->ttft = ev->ttft_s;
    if (ev->finished) {
        b->done = true;
        b->why = ev->finish_reason;
        b->latency = lethe_time_s() - b->t_submit;
        if (ev->error) b->error = lethe_xstrdup(ev->error);
    }
}

static char *fmt_err(const char *fmt, const char *a) {
    char buf[512];
    snprintf(buf, sizeof(buf), fmt, a);
    return lethe_xstrdup(buf);
}

/* Fills item from one JSON line (prompt, sampling overrides). */
static void parse_line(lethe_engine *e, const char *line, int lineno, const lethe_sampling_params *def,
                       batch_item *b) {
    b->sp = *def;
    cJSON *j = cJSON_Parse(line);
    char where[32];
    snprintf(where, sizeof(where), "line %d", lineno);
    if (!j || !cJSON_IsObject(j)) {
        b->error = fmt_err("%s: not a JSON object", where);
        cJSON_Delete(j);
        return;
    }
    cJSON *idf = cJSON_GetObjectItemCaseSensitive(j, "id");
    if (idf) b->id_field = cJSON_Duplicate(idf, true);
    cJSON *f;
#define NUM(name, dst, type)                                                                    \
    if ((f = cJSON_GetObjectItemCaseSensitive(j, name))) {                                      \
        if (!cJSON_IsNumber(f)) { b->error = fmt_err("%s: \"" name "\" must be a number", where); goto out; } \
        dst = (type)f->valuedouble;                                                             \
    }
    NUM("temperature", b->sp.temperature, float);
    NUM("top_k", b->sp.top_k, int32_t);
    NUM("top_p", b->sp.top_p, float);
    NUM("min_p", b->sp.min_p, float);
    NUM("repetition_penalty", b->sp.repetition_penalty, float);
    NUM("presence_penalty", b->sp.presence_penalty, float);
    NUM("frequency_penalty", b->sp.frequency_penalty, float);
    NUM("max_tokens", b->sp.max_tokens, int32_t);
    NUM("logprobs", b->sp.logprobs, int32_t);
#undef NUM
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "seed"))) {
        if (!cJSON_IsNumber(f) || f->valuedouble < 0) { b->error = fmt_err("%s: \"seed\" must be a number >= 0", where); goto out; }
        b->sp.seed = (uint64_t)f->valuedouble;
        b->sp.has_seed = true;
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "ignore_eos"))) b->sp.ignore_eos = cJSON_IsTrue(f);
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "stop"))) {
        int ns = 0;
        for (int i = 0; i < LETHE_MAX_STOP; i++) b->sp.stop[i] = NULL;
        if (cJSON_IsString(f)) {
            b->stop_copy[ns++] = lethe_xstrdup(f->valuestring);
        } else if (cJSON_IsArray(f)) {
            cJSON *x;
            cJSON_ArrayForEach(x, f) {
                if (!cJSON_IsString(x) || ns >= LETHE_MAX_STOP - 1) {
                    b->error = fmt_err("%s: \"stop\" must be a string or at most 7 strings", where);
                    goto out;
                }
                b->stop_copy[ns++] = lethe_xstrdup(x->valuestring);
            }
        } else {
            b->error = fmt_err("%s: \"stop\" must be a string or an array of strings", where);
            goto out;
        }
        for (int i = 0; i < ns; i++) b->sp.stop[i] = b->stop_copy[i];
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "stop_token_ids"))) {
        cJSON *x;
        b->sp.n_stop_token_ids = 0;
        cJSON_ArrayForEach(x, f) {
            if (!cJSON_IsNumber(x) || b->sp.n_stop_token_ids >= LETHE_MAX_STOP) {
                b->error = fmt_err("%s: \"stop_token_ids\" must be at most 8 token ids", where);
                goto out;
            }
            b->sp.stop_token_ids[b->sp.n_stop_token_ids++] = (int32_t)x->valuedouble;
        }
    }
    if ((f = cJSON_GetObjectItemCaseSensitive(j, "forced_token_ids"))) {
        int n = cJSON_GetArraySize(f);
        if (!cJSON_IsArray(f) || n == 0) { b->error = fmt_err("%s: \"forced_token_ids\" must be a non-empty array", where); goto out; }
        b->forced = lethe_xmalloc((size_t)n * sizeof(int32_t));
        cJSON *x;
        cJSON_ArrayForEach(x, f) {
            if (!cJSON_IsNumber(x)) { b->error = fmt_err("%s: \"forced_token_ids\" must hold integers", where); goto out; }
            b->forced[b->n_forced++] = (int32_t)x->valuedouble;
        }
    }
    cJSON *prompt = cJSON_GetObjectItemCaseSensitive(j, "prompt");
    cJSON *msgs = cJSON_GetObjectItemCaseSensitive(j, "messages");
    cJSON *pids = cJSON_GetObjectItemCaseSensitive(j, "prompt_token_ids");
    if (!!prompt + !!msgs + !!pids != 1) {
        b->error = fmt_err("%s: give exactly one of \"prompt\", \"messages\", \"prompt_token_ids\"", where);
    } else if (pids) {
        int n = cJSON_GetArraySize(pids);
        if (!cJSON_IsArray(pids) || n == 0) { b->error = fmt_err("%s: \"prompt_token_ids\" must be a non-empty array", where); goto out; }
        b->ids = lethe_xmalloc((size_t)n * sizeof(int32_t));
        cJSON *x;
        cJSON_ArrayForEach(x, pids) {
            if (!cJSON_IsNumber(x)) { b->error = fmt_err("%s: \"prompt_token_ids\" must hold integers", where); goto out; }
            b->ids[b->n_ids++] = (int32_t)x->valuedouble;
        }
    } else if (prompt) {
        if (!cJSON_IsString(prompt)) { b->error = fmt_err("%s: \"prompt\" must be a string", where); goto out; }
        if (lethe_engine_tokenize(e, prompt->valuestring, lethe_engine_adds_bos(e), false, &b->ids, &b->n_ids) != 0)
            b->error = fmt_err("%s", lethe_engine_last_error());
    } else {
        int n = cJSON_GetArraySize(msgs);
        if (!cJSON_IsArray(msgs) || n == 0) { b->error = fmt_err("%s: \"messages\" must be a non-empty array", where); goto out; }
        const char **roles = lethe_xcalloc((size_t)n, sizeof(char *));
        const char **contents = lethe_xcalloc((size_t)n, sizeof(char *));
        int k = 0;
        cJSON *m;
        cJSON_ArrayForEach(m, msgs) {
            cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role"), *c = cJSON_GetObjectItemCaseSensitive(m, "content");
            if (!cJSON_IsString(r) || !cJSON_IsString(c)) break;
            roles[k] = r->valuestring;
            contents[k++] = c->valuestring;
        }
        if (k != n) {
            b->error = fmt_err("%s: every message needs string \"role\" and \"content\"", where);
        } else {
            char *text = NULL;
            if (lethe_engine_apply_chat(e, roles, contents, (size_t)n, true, &text) != 0 ||
                lethe_engine_tokenize(e, text, false, true, &b->ids, &b->n_ids) != 0)
                b->error = fmt_err("%s", lethe_engine_last_error());
            free(text);
        }
        free(roles);
        free(contents);
    }
out:
    cJSON_Delete(j);
}

static void write_result(FILE *out, FILE *dump, int index, batch_item *b) {
    if (dump && b->logits && b->n_out > 0)
        fwrite(b->logits, sizeof(float), (size_t)b->n_out * (size_t)b->n_vocab, dump);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", index);
    if (b->id_field) cJSON_AddItemToObject(o, "id", cJSON_Duplicate(b->id_field, true));
    cJSON_AddStringToObject(o, "text", b->text ? b->text : "");
    cJSON *ids = cJSON_AddArrayToObject(o, "token_ids");
    for (int32_t i = 0; i < b->n_out; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(b->out_ids[i]));
    cJSON_AddStringToObject(o, "finish_reason", b->error ? "error" : reason_name(b->why));
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", b->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", b->completion_tokens);
    cJSON_AddNumberToObject(u, "cached_tokens", b->cached_tokens);
    if (!b->error) {
        cJSON_AddNumberToObject(o, "ttft_s", b->ttft);
        cJSON_AddNumberToObject(o, "latency_s", b->latency);
    }
    if (b->error) cJSON_AddStringToObject(o, "error", b->error);
    char *s = cJSON_PrintUnformatted(o);
    fprintf(out, "%s\n", s);
    free(s);
    cJSON_Delete(o);
}

static void progress(int done, int total, double t0, int64_t gen_tokens) {
    double dt = lethe_time_s() - t0;
    int w = 30, fill = total ? (int)((double)done / total * w) : w;
    fprintf(stderr, "\r[");
    for (int i = 0; i < w; i++) fputc(i < fill ? '=' : (i == fill ? '>' : ' '), stderr);
    fprintf(stderr, "] %d/%d requests  %.0f gen tok/s  %.1f s", done, total, dt > 0 ? gen_tokens / dt : 0.0, dt);
    fflush(stderr);
}

static void free_item(batch_item *b) {
    free(b->ids);
    for (int i = 0; i < LETHE_MAX_STOP; i++) free(b->stop_copy[i]);
    cJSON_Delete(b->id_field);
    free(b->error);
    free(b->text);
    free(b->out_ids);
    free(b->forced);
    free(b->logits);
}

static int run_batch(lethe_engine *e, const char *in_path, const char *out_path, const char *dump_path,
                     const lethe_sampling_params *def) {
    FILE *in = !strcmp(in_path, "-") ? stdin : fopen(in_path, "r");
    if (!in) {
        fprintf(stderr, "lethe generate: --input %s: cannot open\n", in_path);
        return 1;
    }
    FILE *out = !out_path || !strcmp(out_path, "-") ? stdout : fopen(out_path, "w");
    if (!out) {
        fprintf(stderr, "lethe generate: --output %s: cannot create\n", out_path);
        if (in != stdin) fclose(in);
        return 1;
    }
    FILE *dump = NULL;
    if (dump_path && !(dump = fopen(dump_path, "wb"))) {
        fprintf(stderr, "lethe generate: --dump-logits %s: cannot create\n", dump_path);
        if (in != stdin) fclose(in);
        if (out != stdout) fclose(out);
        return 1;
    }
    int n = 0, cap = 64;
    batch_item *items = lethe_xcalloc((size_t)cap, sizeof(*items));
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t k;
    int lineno = 0;
    while ((k = getline(&line, &line_cap, in)) >= 0) {
        lineno++;
        while (k > 0 && (line[k - 1] == '\n' || line[k - 1] == '\r' || line[k - 1] == ' ')) line[--k] = '\0';
        if (k == 0) continue;
        if (n == cap) {
            items = lethe_xrealloc(items, (size_t)(cap * 2) * sizeof(*items));
            memset(items + cap, 0, (size_t)cap * sizeof(*items));
            cap *= 2;
        }
        parse_line(e, line, lineno, def, &items[n]);
        n++;
    }
    free(line);
    if (in != stdin) fclose(in);
    double t0 = lethe_time_s();
    int64_t prompt_total = 0;
    for (int i = 0; i < n; i++) {
        batch_item *b = &items[i];
        if (b->error) { b->done = true; continue; }
        lethe_request_params rp = {.prompt = b->ids, .n_prompt = b->n_ids, .sampling = b->sp, .cb = batch_cb, .user = b,
                                   .forced = b->forced, .n_forced = b->n_forced, .want_logits = dump != NULL};
        uint64_t id;
        b->t_submit = lethe_time_s();
        if (lethe_engine_add_request(e, &rp, &id) != 0) {
            b->error = lethe_xstrdup(lethe_engine_last_error());
            b->prompt_tokens = b->n_ids;
            b->done = true;
            continue;
        }
        prompt_total += b->n_ids;
    }
    int next_write = 0, done = 0, rc = 0;
    bool tty = isatty(2);
    while (lethe_engine_has_work(e)) {
        if (lethe_engine_step(e) != 0) {
            fprintf(stderr, "\nlethe generate: %s\n", lethe_engine_last_error());
            rc = 1;
            break;
        }
        while (next_write < n && items[next_write].done) {
            write_result(out, dump, next_write, &items[next_write]);
            next_write++;
        }
        int d = 0;
        for (int i = 0; i < n; i++) d += items[i].done;
        if (d != done || tty) {
            done = d;
            lethe_engine_stats st;
            lethe_engine_get_stats(e, &st);
            progress(done, n, t0, st.generation_tokens_total);
        }
    }
    for (; next_write < n; next_write++) write_result(out, dump, next_write, &items[next_write]);
    double dt = lethe_time_s() - t0;
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    progress(n, n, t0, st.generation_tokens_total);
    int n_err = 0;
    for (int i = 0; i < n; i++) n_err += items[i].error != NULL;
    fprintf(stderr, "\n[%d requests (%d rejected) in %.2f s | prompt: %lld tokens (%lld from the prefix cache), "
                    "%.1f tok/s | generation: %lld tokens, %.1f tok/s | %lld steps, %lld preemptions | "
                    "%lld graph replays, %lld graph captures, %lld eager steps, %lld padding seqs, "
                    "%lld device-built layer selections]\n",
            n, n_err, dt, (long long)prompt_total, (long long)st.prefix_hit_tokens,
            dt > 0 ? (double)st.prefill_tokens_computed / dt : 0.0, (long long)st.generation_tokens_total,
            dt > 0 ? (double)st.generation_tokens_total / dt : 0.0, (long long)st.n_steps,
            (long long)st.n_preemptions, (long long)st.graph_replays, (long long)st.graph_captures,
            (long long)st.eager_steps, (long long)st.padded_seqs, (long long)st.device_selections);
    if (dump) fclose(dump);
    if (out != stdout) fclose(out);
    else fflush(stdout);
    for (int i = 0; i < n; i++) free_item(&items[i]);
    free(items);
    return rc;
}

/* ---- command ---- */

int lethe_cmd_generate(int argc, char **argv) {
    lethe_engine_params ep;
    lethe_engine_default_params(&ep);
    ep.model = DEFAULT_MODEL;
    ep.progress = isatty(2);
    lethe_sampling_params sp;
    lethe_sampling_default_params(&sp);
    sp.max_tokens = GEN_DEFAULT_MAX_TOKENS;
    const char *prompt = NULL, *system = NULL, *input = NULL, *output = NULL, *dump_logits = NULL;
    bool chat = false, raw = false;
    uint64_t seed = 0;
    lethe_opt rows[LETHE_OPTS_MAX];
    int n = lethe_opts_engine(rows, &ep);
    n += lethe_opts_sampling(rows + n, &sp);
#define ROW(...) rows[n++] = (lethe_opt){__VA_ARGS__}
    ROW("--prompt", "-p", LETHE_OPT_STR, &prompt, "TEXT",
        "prompt (a user message in the model's chat template unless --raw)", 1, 0);
    ROW("--raw", NULL, LETHE_OPT_BOOL, &raw, NULL, "use --prompt as plain text (completion), no chat template", 1, 0);
    ROW("--chat", NULL, LETHE_OPT_BOOL, &chat, NULL, "interactive multi-turn chat on stdin", 1, 0);
    ROW("--system", NULL, LETHE_OPT_STR, &system, "TEXT", "system message for --prompt / --chat", 1, 0);
    ROW("--seed", NULL, LETHE_OPT_U64, &seed, "N", "sampling seed (default: per-request)", 1, 0);
    ROW("--input", "-i", LETHE_OPT_STR, &input, "FILE.jsonl",
        "batch: one request per line ({\"prompt\"|\"messages\"|\"prompt_token_ids\": ...} + sampling fields)", 1, 0);
    ROW("--output", "-o", LETHE_OPT_STR, &output, "FILE.jsonl", "batch results, one line per input (default stdout)", 1, 0);
    ROW("--dump-logits", NULL, LETHE_OPT_STR, &dump_logits, "FILE",
        "batch: raw next-token logits of every generated token, float32 [completion_tokens, n_vocab] per "
        "request in input order (with \"forced_token_ids\": logits of a known continuation)", 1, 0);
#undef ROW
    const char *pos[1];
    int n_pos = 0;
    bool seed_given = false;
    for (int i = 1; i < argc; i++) seed_given |= !strcmp(argv[i], "--seed") || !strncmp(argv[i], "--seed=", 7);
    int pr = lethe_opts_parse(rows, n, argc, argv, "lethe generate [options] (-p TEXT | --chat | --input FILE.jsonl)",
                              "Generate text with the batching engine: one prompt (streamed), an interactive chat, "
                              "or a JSONL batch.", pos, &n_pos, 0);
    if (pr != 0) return pr > 0 ? 0 : 2;
    if (seed_given) {
        sp.seed = seed;
        sp.has_seed = true;
    }
    if (dump_logits && !input) {
        fprintf(stderr, "lethe generate: --dump-logits needs --input FILE.jsonl\n");
        return 2;
    }
    if (input && (prompt || chat)) {
        fprintf(stderr, "lethe generate: --input cannot be combined with --prompt or --chat\n");
        return 2;
    }
    char *stdin_prompt = NULL;
    if (!input && !prompt && !chat) {
        if (isatty(0)) {
            fprintf(stderr, "lethe generate: give --prompt TEXT, --chat or --input FILE.jsonl (see --help)\n");
            return 2;
        }
        prompt = stdin_prompt = read_all(stdin);
    }
    lethe_engine *e = NULL;
    if (lethe_engine_create(&ep, &e) != 0) {
        fprintf(stderr, "lethe generate: %s\n", lethe_engine_last_error());
        free(stdin_prompt);
        return 1;
    }
    int rc;
    if (input) {
        rc = run_batch(e, input, output, dump_logits, &sp);
    } else if (chat && !prompt) {
        rc = run_chat(e, system, &sp);
    } else {
        int32_t *ids = NULL, n_ids = 0;
        if (raw) {
            rc = lethe_engine_tokenize(e, prompt, lethe_engine_adds_bos(e), false, &ids, &n_ids) != 0;
            if (rc) fprintf(stderr, "lethe generate: %s\n", lethe_engine_last_error());
        } else {
            const char *roles[2], *contents[2];
            size_t m = 0;
            if (system) { roles[m] = "system"; contents[m++] = system; }
            roles[m] = "user";
            contents[m++] = prompt;
            rc = chat_ids(e, roles, contents, m, &ids, &n_ids);
        }
        if (!rc) {
            stream_state s;
            rc = run_stream(e, ids, n_ids, &sp, false, &s);
            if (!rc) fputc('\n', stdout);
            free(s.text);
            free(s.error);
        }
        free(ids);
    }
    free(stdin_prompt);
    lethe_engine_destroy(e);
    return rc;
}

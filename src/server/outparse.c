/* outparse.c - splits generated text into reasoning, content and tool
 * calls, incrementally (one parser per request; streaming feeds it each
 * event's text, a whole response feeds it everything at once, so both give
 * the same message).
 *
 * Stage 1, reasoning (Qwen3): an output that starts with "<think>" is
 * reasoning up to "</think>"; the newlines the template puts around it
 * (reasoning.strip('\n'), content.lstrip('\n')) are dropped. An output cut
 * off inside the block is all reasoning.
 * Stage 2, tool calls, by format:
 *   hermes  "<tool_call>\n{"name": N, "arguments": A}\n</tool_call>" blocks;
 *           text around them is content (whitespace next to a call dropped)
 *   llama   the message is {"name": N, "parameters": A} (optionally after
 *           <|python_tag|>), several separated by ';'
 *   glm     "<tool_call>N\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>...
 *           </tool_call>" (a value that parses as JSON is JSON, else a string)
 * A call's arguments stream as the model writes them once "name" has been
 * read (the exact text of A: the JSON value is tracked character by
 * character, strings and escapes included); a call whose object does not
 * start with "name" is parsed whole at its end; a block that is no call is
 * content. Markers split across pieces are held back until they resolve. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/json.h"
#include "core/util.h"
#include "server/agent.h"

enum { R_DETECT, R_IN, R_AFTER, R_OUT };
enum { T_TEXT, T_HEAD, T_ARGS, T_TAIL, T_RAW, T_LSTART, T_LSEP, T_PLAIN, T_GLM };

struct srv_outparse {
    srv_tool_fmt fmt;
    int rs;
    bool r_started;          /* a reasoning character was emitted (leading '\n' dropped before) */
    srv_buf rhold;
    int ts;
    srv_buf buf;             /* stage-2 text not yet consumed */
    bool skip_ws;            /* drop whitespace (after a call) */
    int lsep_brace;          /* llama: the call object's closing brace was skipped */
    srv_buf sep;             /* whitespace before "<tool_call>": dropped if a call follows */
    int n_calls;
    /* the arguments value scanner */
    int depth;
    bool in_str, esc, val_started;
};

static const char THINK_OPEN[] = "<think>", THINK_CLOSE[] = "</think>";
static const char CALL_OPEN[] = "<tool_call>", CALL_CLOSE[] = "</tool_call>";

static bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

void srv_delta_free(srv_delta *d) {
    srv_buf_free(&d->reasoning);
    srv_buf_free(&d->content);
    for (int i = 0; i < d->n_calls; i++) {
        free(d->calls[i].id);
        free(d->calls[i].name);
        free(d->calls[i].args);
    }
    free(d->calls);
    memset(d, 0, sizeof(*d));
}

bool srv_delta_empty(const srv_delta *d) { return !d->reasoning.len && !d->content.len && !d->n_calls; }

/* the delta's entry for call index: the last one when it is that call's
 * (fragments join it), else a new one (fresh: always a new one) */
static srv_call_delta *call_delta(srv_delta *d, int index, bool fresh) {
    if (!fresh && d->n_calls && d->calls[d->n_calls - 1].index == index) return &d->calls[d->n_calls - 1];
    if (d->n_calls == d->cap_calls) {
        d->cap_calls = d->cap_calls ? 2 * d->cap_calls : 4;
        d->calls = lethe_xrealloc(d->calls, (size_t)d->cap_calls * sizeof(*d->calls));
    }
    srv_call_delta *c = &d->calls[d->n_calls++];
    memset(c, 0, sizeof(*c));
    c->index = index;
    c->args = lethe_xstrdup("");
    return c;
}

static void add_args(srv_delta *d, int index, const char *s, size_t n) {
    if (!n) return;
    srv_call_delta *c = call_delta(d, index, false);
    size_t have = strlen(c->args);
    c->args = lethe_xrealloc(c->args, have + n + 1);
    memcpy(c->args + have, s, n);
    c->args[have + n] = '\0';
}

static void new_id(char *out, size_t cap) {
    static atomic_uint_fast64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (atomic_fetch_add(&counter, 1) << 8);
    uint64_t a = lethe_splitmix64(&seed), b = lethe_splitmix64(&seed);
    snprintf(out, cap, "call_%016llx%08llx", (unsigned long long)a, (unsigned long long)(b & 0xffffffffu));
}

static void start_call(srv_outparse *p, srv_delta *d, const char *name) {
    p->sep.len = 0; /* the template's separator, not content */
    srv_call_delta *c = call_delta(d, p->n_calls, true);
    char id[48];
    new_id(id, sizeof(id));
    c->id = lethe_xstrdup(id);
    c->name = lethe_xstrdup(name);
}

/* length of the longest suffix of s[0..n) that is a proper prefix of marker */
static size_t partial_marker(const char *s, size_t n, const char *marker) {
    size_t m = strlen(marker);
    for (size_t k = LETHE_MIN(n, m - 1); k > 0; k--)
        if (!memcmp(s + n - k, marker, k)) return k;
    return 0;
}

static const char *find(const char *s, size_t n, const char *needle) {
    return memmem(s, n, needle, strlen(needle));
}

/* ---- the arguments value scanner ---- */

static void scan_reset(srv_outparse *p) {
    p->depth = 0;
    p->in_str = p->esc = p->val_started = false;
}

/* Consumes s[0..n) as the arguments value; returns the bytes that belong to
 * it (leading whitespace skipped) through *vb and *vn, and the offset just past
 * the value when it completed (else -1). */
static long scan_value(srv_outparse *p, const char *s, size_t n, size_t *vb, size_t *vn) {
    size_t i = 0;
    if (!p->val_started) {
        while (i < n && is_ws(s[i])) i++;
        if (i == n) {
            *vb = *vn = 0;
            return -1;
        }
        p->val_started = true;
    }
    *vb = i;
    for (; i < n; i++) {
        const char c = s[i];
        if (p->in_str) {
            if (p->esc) p->esc = false;
            else if (c == '\\') p->esc = true;
            else if (c == '"') {
                p->in_str = false;
                if (p->depth == 0) {
                    *vn = i + 1 - *vb;
                    return (long)(i + 1);
                }
            }
            continue;
        }
        if (c == '"') p->in_str = true;
        else if (c == '{' || c == '[') p->depth++;
        else if (c == '}' || c == ']') {
            if (p->depth == 0) { /* a scalar ended by the outer object's brace */
                *vn = i - *vb;
                return (long)i;
            }
            if (--p->depth == 0) {
                *vn = i + 1 - *vb;
                return (long)(i + 1);
            }
        } else if (p->depth == 0 && (c == ',' || is_ws(c))) { /* the end of a scalar */
            *vn = i - *vb;
            return (long)i;
        }
    }
    *vn = n - *vb;
    return -1;
}

/* ---- the call head: {"name": "N", "<args key>": ---- */

enum { HEAD_MORE, HEAD_NO, HEAD_OK };

/* a JSON string at s[*i]; its decoded text malloc'd in *out */
static int head_string(const char *s, size_t n, size_t *i, char **out) {
    if (*i >= n) return HEAD_MORE;
    if (s[*i] != '"') return HEAD_NO;
    size_t j = *i + 1;
    for (; j < n && s[j] != '"'; j++)
        if (s[j] == '\\') j++;
    if (j >= n) return HEAD_MORE;
    cJSON *v = cJSON_ParseWithLength(s + *i, j + 1 - *i);
    if (!cJSON_IsString(v)) {
        cJSON_Delete(v);
        return HEAD_NO;
    }
    *out = lethe_xstrdup(v->valuestring);
    cJSON_Delete(v);
    *i = j + 1;
    return HEAD_OK;
}

static int head_char(const char *s, size_t n, size_t *i, char c) {
    while (*i < n && is_ws(s[*i])) (*i)++;
    if (*i >= n) return HEAD_MORE;
    if (s[*i] != c) return HEAD_NO;
    (*i)++;
    while (*i < n && is_ws(s[*i])) (*i)++;
    return HEAD_OK;
}

static int parse_head(const char *s, size_t n, bool llama, char **name, size_t *args_at) {
    size_t i = 0;
    char *key = NULL;
    int r;
    *name = NULL;
    if ((r = head_char(s, n, &i, '{')) != HEAD_OK) return r;
    if ((r = head_string(s, n, &i, &key)) != HEAD_OK) return r;
    bool is_name = !strcmp(key, "name");
    free(key);
    if (!is_name) return HEAD_NO;
    if ((r = head_char(s, n, &i, ':')) != HEAD_OK) return r;
    if ((r = head_string(s, n, &i, name)) != HEAD_OK) return r;
    if ((r = head_char(s, n, &i, ',')) == HEAD_OK && (r = head_string(s, n, &i, &key)) == HEAD_OK) {
        bool ok = !strcmp(key, "arguments") || (llama && !strcmp(key, "parameters"));
        free(key);
        r = ok ? head_char(s, n, &i, ':') : HEAD_NO;
    }
    if (r != HEAD_OK) {
        free(*name);
        *name = NULL;
        return r;
    }
    *args_at = i;
    return HEAD_OK;
}

/* ---- whole blocks (a call object not in head order; GLM) ---- */

static bool emit_whole_json(srv_outparse *p, srv_delta *d, const char *s, size_t n, bool llama) {
    cJSON *o = lethe_json_parse(s, n);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
    if (!args && llama) args = cJSON_GetObjectItemCaseSensitive(o, "parameters");
    bool ok = cJSON_IsObject(o) && cJSON_IsString(name);
    if (ok) {
        start_call(p, d, name->valuestring);
        char *a = args ? lethe_json_print(args) : lethe_xstrdup("{}");
        add_args(d, p->n_calls, a, strlen(a));
        free(a);
        p->n_calls++;
    }
    cJSON_Delete(o);
    return ok;
}

static char *trim_dup(const char *b, const char *e) {
    while (b < e && is_ws(*b)) b++;
    while (e > b && is_ws(e[-1])) e--;
    char *s = lethe_xmalloc((size_t)(e - b) + 1);
    memcpy(s, b, (size_t)(e - b));
    s[e - b] = '\0';
    return s;
}

static bool emit_glm(srv_outparse *p, srv_delta *d, const char *s, size_t n) {
    const char *e = s + n, *k = find(s, n, "<arg_key>");
    const char *name_end = k ? k : e;
    char *name = trim_dup(s, name_end);
    if (!name[0]) {
        free(name);
        return false;
    }
    cJSON *args = cJSON_CreateObject();
    bool ok = true;
    while (k) {
        const char *kb = k + strlen("<arg_key>"), *ke = find(kb, (size_t)(e - kb), "</arg_key>");
        const char *vb = ke ? find(ke, (size_t)(e - ke), "<arg_value>") : NULL;
        const char *ve = vb ? find(vb, (size_t)(e - vb), "</arg_value>") : NULL;
        if (!ve) {
            ok = false;
            break;
        }
        vb += strlen("<arg_value>");
        char *key = trim_dup(kb, ke), *val = lethe_xmalloc((size_t)(ve - vb) + 1);
        memcpy(val, vb, (size_t)(ve - vb));
        val[ve - vb] = '\0';
        cJSON *jv = lethe_json_parse(val, strlen(val));
        cJSON_AddItemToObject(args, key, jv ? jv : cJSON_CreateString(val));
        free(key);
        free(val);
        const char *rest = ve + strlen("</arg_value>");
        k = find(rest, (size_t)(e - rest), "<arg_key>");
    }
    if (ok) {
        start_call(p, d, name);
        char *a = lethe_json_dumps_py(args, -1);
        add_args(d, p->n_calls, a, strlen(a));
        free(a);
        p->n_calls++;
    }
    cJSON_Delete(args);
    free(name);
    return ok;
}

/* ---- stage 2 ---- */

static void content(srv_delta *d, const char *s, size_t n) { srv_buf_add(&d->content, s, n); }

/* content text of T_TEXT / T_PLAIN, dropping whitespace right after a call */
static void text_out(srv_outparse *p, srv_delta *d, const char *s, size_t n) {
    if (p->skip_ws) {
        while (n && is_ws(*s)) s++, n--;
        if (n) p->skip_ws = false;
    }
    content(d, s, n);
}

static void tools_push(srv_outparse *p, const char *s, size_t n, srv_delta *d);

/* consumes p->buf from offset k (the rest of the buffer is re-fed) */
static void refeed(srv_outparse *p, size_t k, srv_delta *d) {
    srv_buf rest = p->buf;
    memset(&p->buf, 0, sizeof(p->buf));
    if (rest.len > k) tools_push(p, rest.data + k, rest.len - k, d);
    srv_buf_free(&rest);
}

static void tools_push(srv_outparse *p, const char *s, size_t n, srv_delta *d) {
    if (p->fmt == SRV_TF_NONE || p->ts == T_PLAIN) {
        if (p->fmt == SRV_TF_NONE) content(d, s, n);
        else text_out(p, d, s, n);
        return;
    }
    srv_buf_add(&p->buf, s, n);
    const char *b = p->buf.data;
    const size_t len = p->buf.len;
    switch (p->ts) {
    case T_TEXT: {
        const char *m = find(b, len, CALL_OPEN);
        if (m) {
            size_t pre = (size_t)(m - b);
            while (pre && is_ws(b[pre - 1])) pre--; /* the template's separator before a call */
            text_out(p, d, b, pre);
            p->sep.len = 0;
            if (!p->skip_ws) srv_buf_add(&p->sep, b + pre, (size_t)(m - b) - pre);
            p->ts = p->fmt == SRV_TF_GLM ? T_GLM : T_HEAD;
            refeed(p, (size_t)(m - b) + strlen(CALL_OPEN), d);
            return;
        }
        size_t keep = partial_marker(b, len, CALL_OPEN);
        while (keep < len && is_ws(b[len - keep - 1])) keep++; /* trailing whitespace: maybe before a call */
        text_out(p, d, b, len - keep);
        memmove(p->buf.data, b + len - keep, keep);
        p->buf.len = keep;
        return;
    }
    case T_LSTART: {
        size_t i = 0;
        while (i < len && is_ws(b[i])) i++;
        if (i == len) return;
        static const char TAG[] = "<|python_tag|>";
        if (len - i < strlen(TAG) && !memcmp(b + i, TAG, len - i)) return;
        if (len - i >= strlen(TAG) && !memcmp(b + i, TAG, strlen(TAG))) i += strlen(TAG);
        while (i < len && is_ws(b[i])) i++;
        if (i == len) return;
        p->ts = b[i] == '{' ? T_HEAD : T_PLAIN;
        if (p->ts == T_PLAIN) {
            refeed(p, 0, d);
            return;
        }
        refeed(p, i, d);
        return;
    }
    case T_HEAD: {
        char *name = NULL;
        size_t at = 0;
        int r = parse_head(b, len, p->fmt == SRV_TF_LLAMA, &name, &at);
        if (r == HEAD_MORE) return;
        if (r == HEAD_NO) { /* not {"name": ..., "arguments": ...}: parse the block whole at its end */
            p->ts = T_RAW;
            refeed(p, 0, d);
            return;
        }
        start_call(p, d, name);
        free(name);
        scan_reset(p);
        p->ts = T_ARGS;
        refeed(p, at, d);
        return;
    }
    case T_ARGS: {
        size_t vb, vn;
        long end = scan_value(p, b, len, &vb, &vn);
        add_args(d, p->n_calls, b + vb, vn);
        if (end < 0) {
            p->buf.len = 0;
            return;
        }
        p->n_calls++;
        p->ts = p->fmt == SRV_TF_LLAMA ? T_LSEP : T_TAIL;
        if (p->fmt == SRV_TF_LLAMA) { /* the outer object's closing brace: skipped once in T_LSEP */
            p->lsep_brace = 0;
            refeed(p, (size_t)end, d);
        } else {
            refeed(p, (size_t)end, d);
        }
        return;
    }
    case T_TAIL: {
        const char *m = find(b, len, CALL_CLOSE);
        if (!m) return;
        p->skip_ws = true;
        p->ts = T_TEXT;
        refeed(p, (size_t)(m - b) + strlen(CALL_CLOSE), d);
        return;
    }
    case T_RAW:
    case T_GLM: {
        const char *m = find(b, len, CALL_CLOSE);
        if (!m) return;
        const size_t bn = (size_t)(m - b);
        bool ok = p->ts == T_GLM ? emit_glm(p, d, b, bn) : emit_whole_json(p, d, b, bn, false);
        if (!ok) { /* not a call: the block is content */
            content(d, p->sep.data ? p->sep.data : "", p->sep.len);
            p->sep.len = 0;
            content(d, CALL_OPEN, strlen(CALL_OPEN));
            content(d, b, bn + strlen(CALL_CLOSE));
        } else {
            p->skip_ws = true;
        }
        p->ts = T_TEXT;
        refeed(p, bn + strlen(CALL_CLOSE), d);
        return;
    }
    case T_LSEP: {
        size_t i = 0;
        while (i < len && (is_ws(b[i]) || b[i] == ';' || (b[i] == '}' && !p->lsep_brace++))) i++;
        if (i == len) {
            p->buf.len = 0;
            return;
        }
        p->ts = b[i] == '{' ? T_HEAD : T_PLAIN;
        refeed(p, i, d);
        return;
    }
    default: LETHE_ASSERT(!"outparse: bad state");
    }
}

static void tools_finish(srv_outparse *p, srv_delta *d) {
    const char *b = p->buf.data ? p->buf.data : "";
    const size_t len = p->buf.len;
    switch (p->ts) {
    case T_TEXT:
    case T_PLAIN: text_out(p, d, b, len); break;
    case T_LSTART: content(d, b, len); break;
    case T_HEAD:
    case T_RAW:
    case T_GLM:
        if (p->fmt == SRV_TF_LLAMA) {
            if (!(p->ts == T_RAW && emit_whole_json(p, d, b, len, true))) content(d, b, len);
        } else {
            content(d, p->sep.data ? p->sep.data : "", p->sep.len);
            content(d, CALL_OPEN, strlen(CALL_OPEN));
            content(d, b, len);
        }
        break;
    default: break; /* a call cut off inside its arguments stays as it is */
    }
    p->buf.len = 0;
}

/* ---- stage 1 ---- */

srv_outparse *srv_outparse_new(srv_tool_fmt fmt, bool reasoning) {
    srv_outparse *p = lethe_xcalloc(1, sizeof(*p));
    p->fmt = fmt;
    p->rs = reasoning ? R_DETECT : R_OUT;
    p->ts = fmt == SRV_TF_LLAMA ? T_LSTART : T_TEXT;
    return p;
}

void srv_outparse_free(srv_outparse *p) {
    if (!p) return;
    srv_buf_free(&p->rhold);
    srv_buf_free(&p->buf);
    srv_buf_free(&p->sep);
    free(p);
}

int srv_outparse_n_calls(const srv_outparse *p) { return p->n_calls; }

static void reasoning_out(srv_outparse *p, srv_delta *d, const char *s, size_t n) {
    if (!p->r_started) {
        while (n && *s == '\n') s++, n--;
        if (n) p->r_started = true;
    }
    srv_buf_add(&d->reasoning, s, n);
}

void srv_outparse_push(srv_outparse *p, const char *s, size_t n, srv_delta *d) {
    if (p->rs == R_OUT) return tools_push(p, s, n, d);
    srv_buf_add(&p->rhold, s, n);
    const char *b = p->rhold.data;
    size_t len = p->rhold.len, used = 0;
    if (p->rs == R_DETECT) {
        const size_t m = strlen(THINK_OPEN);
        if (len < m && !memcmp(b, THINK_OPEN, len)) return; /* maybe "<think>" */
        if (len >= m && !memcmp(b, THINK_OPEN, m)) {
            p->rs = R_IN;
            used = m;
        } else {
            p->rs = R_OUT;
        }
    }
    if (p->rs == R_IN) {
        const char *c = find(b + used, len - used, THINK_CLOSE);
        if (c) {
            size_t rn = (size_t)(c - (b + used));
            while (rn && b[used + rn - 1] == '\n') rn--;
            reasoning_out(p, d, b + used, rn);
            used = (size_t)(c - b) + strlen(THINK_CLOSE);
            p->rs = R_AFTER;
        } else {
            size_t keep = partial_marker(b + used, len - used, THINK_CLOSE);
            while (keep < len - used && b[len - keep - 1] == '\n') keep++;
            reasoning_out(p, d, b + used, len - used - keep);
            used = len - keep;
        }
    }
    if (p->rs == R_AFTER) {
        while (used < len && b[used] == '\n') used++;
        if (used < len) p->rs = R_OUT;
    }
    srv_buf rest = p->rhold;
    memset(&p->rhold, 0, sizeof(p->rhold));
    if (p->rs == R_OUT) {
        if (rest.len > used) tools_push(p, rest.data + used, rest.len - used, d);
    } else if (rest.len > used) {
        srv_buf_add(&p->rhold, rest.data + used, rest.len - used);
    }
    srv_buf_free(&rest);
}

void srv_outparse_finish(srv_outparse *p, srv_delta *d) {
    const char *b = p->rhold.data ? p->rhold.data : "";
    size_t n = p->rhold.len;
    if (p->rs == R_DETECT) tools_push(p, b, n, d);
    else if (p->rs == R_IN) {
        while (n && b[n - 1] == '\n') n--;
        reasoning_out(p, d, b, n);
    }
    p->rhold.len = 0;
    p->rs = R_OUT;
    tools_finish(p, d);
}

/* ---- whole messages ---- */

void srv_message_add_delta(srv_message *m, const srv_delta *d) {
    size_t rn = m->reasoning ? strlen(m->reasoning) : 0, cn = m->content ? strlen(m->content) : 0;
    m->reasoning = lethe_xrealloc(m->reasoning, rn + d->reasoning.len + 1);
    memcpy(m->reasoning + rn, d->reasoning.data ? d->reasoning.data : "", d->reasoning.len);
    m->reasoning[rn + d->reasoning.len] = '\0';
    m->content = lethe_xrealloc(m->content, cn + d->content.len + 1);
    memcpy(m->content + cn, d->content.data ? d->content.data : "", d->content.len);
    m->content[cn + d->content.len] = '\0';
    for (int i = 0; i < d->n_calls; i++) {
        const srv_call_delta *c = &d->calls[i];
        if (!m->tool_calls) m->tool_calls = cJSON_CreateArray();
        cJSON *call = cJSON_GetArrayItem(m->tool_calls, c->index);
        if (!call) {
            call = cJSON_CreateObject();
            cJSON_AddStringToObject(call, "id", c->id ? c->id : "");
            cJSON_AddStringToObject(call, "type", "function");
            cJSON *fn = cJSON_AddObjectToObject(call, "function");
            cJSON_AddStringToObject(fn, "name", c->name ? c->name : "");
            cJSON_AddStringToObject(fn, "arguments", "");
            cJSON_AddItemToArray(m->tool_calls, call);
        }
        cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
        const char *old = cJSON_GetObjectItemCaseSensitive(fn, "arguments")->valuestring;
        char *joined = lethe_xmalloc(strlen(old) + strlen(c->args) + 1);
        strcpy(joined, old);
        strcat(joined, c->args);
        cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", cJSON_CreateString(joined));
        free(joined);
    }
}

void srv_parse_output(srv_tool_fmt fmt, bool reasoning, const char *text, srv_message *m) {
    memset(m, 0, sizeof(*m));
    srv_outparse *p = srv_outparse_new(fmt, reasoning);
    srv_delta d = {0};
    srv_outparse_push(p, text, strlen(text), &d);
    srv_outparse_finish(p, &d);
    srv_message_add_delta(m, &d);
    srv_delta_free(&d);
    srv_outparse_free(p);
}

void srv_message_free(srv_message *m) {
    free(m->reasoning);
    free(m->content);
    cJSON_Delete(m->tool_calls);
    memset(m, 0, sizeof(*m));
}

/* trace.c - agent-trace JSONL reader/writer, synthetic coding-agent trace
 * generator and deterministic text materialization (see trace.h). */
#include "bench/trace.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "eval/bench_serve.h"

static void turn_free(lethe_trace_turn *u) {
    for (int32_t i = 0; i < u->n_msgs; i++) lethe_trace_msg_free(&u->msgs[i]);
    free(u->msgs);
    free(u->output);
}

void lethe_trace_msg_free(lethe_trace_msg *m) {
    free(m->role);
    free(m->content);
    m->role = m->content = NULL;
}

void lethe_trace_free(lethe_trace *t) {
    if (!t) return;
    for (int32_t i = 0; i < t->n_turns; i++) turn_free(&t->turns[i]);
    free(t->turns);
    for (int32_t a = 0; a < t->n_agents; a++) free(t->agent_names[a]);
    free(t->agent_names);
    free(t->agent_first);
    memset(t, 0, sizeof(*t));
}

static int cmp_turn(const void *a, const void *b) {
    const lethe_trace_turn *x = a, *y = b;
    if (x->agent != y->agent) return x->agent < y->agent ? -1 : 1;
    return (x->turn > y->turn) - (x->turn < y->turn);
}

/* sorts turns, builds agent_first, checks 0..n-1 numbering */
static lethe_status finalize(lethe_trace *t, const char *what) {
    qsort(t->turns, (size_t)t->n_turns, sizeof(*t->turns), cmp_turn);
    t->agent_first = lethe_xcalloc((size_t)t->n_agents + 1, sizeof(int32_t));
    int32_t i = 0;
    for (int32_t a = 0; a < t->n_agents; a++) {
        t->agent_first[a] = i;
        int32_t k = 0;
        for (; i < t->n_turns && t->turns[i].agent == a; i++, k++)
            if (t->turns[i].turn != k)
                return lethe_errorf(LETHE_ERR_FORMAT, "%s: agent '%s' has turn %d where turn %d was expected "
                                    "(turns must be numbered 0..n-1, each once)", what, t->agent_names[a],
                                    t->turns[i].turn, k);
    }
    t->agent_first[t->n_agents] = i;
    return LETHE_OK;
}

static int32_t agent_index(lethe_trace *t, const char *name) {
    for (int32_t a = 0; a < t->n_agents; a++)
        if (!strcmp(t->agent_names[a], name)) return a;
    t->agent_names = lethe_xrealloc(t->agent_names, (size_t)(t->n_agents + 1) * sizeof(char *));
    t->agent_names[t->n_agents] = lethe_xstrdup(name);
    return t->n_agents++;
}

static lethe_status get_count(const cJSON *o, const char *name, int32_t *out, const char *path, int line) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v || cJSON_IsNull(v)) return LETHE_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 1e8 || v->valuedouble != (int32_t)v->valuedouble)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: '%s' must be a non-negative integer", path, line, name);
    *out = (int32_t)v->valuedouble;
    return LETHE_OK;
}

static lethe_status parse_line(lethe_trace *t, const char *s, const char *path, int line) {
    cJSON *o = cJSON_Parse(s);
    lethe_status st = LETHE_OK;
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: not a JSON object", path, line);
    }
    lethe_trace_turn u = {0};
    const cJSON *ag = cJSON_GetObjectItemCaseSensitive(o, "agent");
    const cJSON *tn = cJSON_GetObjectItemCaseSensitive(o, "turn");
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(o, "messages");
    const cJSON *out = cJSON_GetObjectItemCaseSensitive(o, "output");
    const cJSON *wait = cJSON_GetObjectItemCaseSensitive(o, "wait_s");
    char agbuf[32];
    const char *agname = NULL;
    if (cJSON_IsString(ag)) agname = ag->valuestring;
    else if (cJSON_IsNumber(ag)) { snprintf(agbuf, sizeof(agbuf), "%d", (int)ag->valuedouble); agname = agbuf; }
    if (!agname) { st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: 'agent' (string or number) is required", path, line); goto done; }
    if (!cJSON_IsNumber(tn) || tn->valuedouble < 0 || tn->valuedouble != (int32_t)tn->valuedouble) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: 'turn' must be a non-negative integer", path, line);
        goto done;
    }
    u.turn = (int32_t)tn->valuedouble;
    if ((st = get_count(o, "append_tokens", &u.append_tokens, path, line)) ||
        (st = get_count(o, "system_tokens", &u.system_tokens, path, line)) ||
        (st = get_count(o, "output_tokens", &u.output_tokens, path, line)))
        goto done;
    if (msgs && !cJSON_IsNull(msgs)) {
        if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0) {
            st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: 'messages' must be a non-empty array", path, line);
            goto done;
        }
        u.msgs = lethe_xcalloc((size_t)cJSON_GetArraySize(msgs), sizeof(*u.msgs));
        const cJSON *m;
        cJSON_ArrayForEach(m, msgs) {
            const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
            if (!cJSON_IsString(r) || !cJSON_IsString(c)) {
                st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: messages[%d] needs string 'role' and 'content'",
                                  path, line, u.n_msgs);
                goto done;
            }
            u.msgs[u.n_msgs].role = lethe_xstrdup(r->valuestring);
            u.msgs[u.n_msgs].content = lethe_xstrdup(c->valuestring);
            u.n_msgs++;
        }
    } else if (u.append_tokens <= 0 && u.system_tokens <= 0) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: a turn needs 'messages' or 'append_tokens' > 0", path, line);
        goto done;
    }
    if (cJSON_IsString(out)) u.output = lethe_xstrdup(out->valuestring);
    else if (out && !cJSON_IsNull(out)) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: 'output' must be a string", path, line);
        goto done;
    }
    if (!u.output && u.output_tokens <= 0) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: a turn needs 'output' or 'output_tokens' > 0", path, line);
        goto done;
    }
    if (wait && !cJSON_IsNull(wait)) {
        if (!cJSON_IsNumber(wait) || !(wait->valuedouble >= 0 && wait->valuedouble < 3600)) {
            st = lethe_errorf(LETHE_ERR_FORMAT, "%s:%d: 'wait_s' must be a number in [0, 3600)", path, line);
            goto done;
        }
        u.wait_s = wait->valuedouble;
    }
    u.agent = agent_index(t, agname);
    t->turns = lethe_xrealloc(t->turns, (size_t)(t->n_turns + 1) * sizeof(*t->turns));
    t->turns[t->n_turns++] = u;
    memset(&u, 0, sizeof(u));
done:
    turn_free(&u);
    cJSON_Delete(o);
    return st;
}

lethe_status lethe_trace_load(const char *path, lethe_trace *out) {
    memset(out, 0, sizeof(*out));
    char *text = NULL;
    size_t len = 0;
    lethe_status st = lethe_read_file(path, &text, &len);
    if (st != LETHE_OK) return st;
    int line = 0;
    for (char *p = text; *p && st == LETHE_OK;) {
        char *nl = strchr(p, '\n');
        if (nl) *nl = 0;
        line++;
        const char *q = p;
        while (*q == ' ' || *q == '\t' || *q == '\r') q++;
        if (*q) st = parse_line(out, q, path, line);
        p = nl ? nl + 1 : p + strlen(p);
    }
    free(text);
    if (st == LETHE_OK && out->n_turns == 0) st = lethe_errorf(LETHE_ERR_FORMAT, "%s: no turns", path);
    if (st == LETHE_OK) st = finalize(out, path);
    if (st != LETHE_OK) lethe_trace_free(out);
    return st;
}

lethe_status lethe_trace_save(const lethe_trace *t, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return lethe_errorf(LETHE_ERR_IO, "cannot write %s", path);
    for (int32_t i = 0; i < t->n_turns; i++) {
        const lethe_trace_turn *u = &t->turns[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "agent", t->agent_names[u->agent]);
        cJSON_AddNumberToObject(o, "turn", u->turn);
        if (u->n_msgs > 0) {
            cJSON *arr = cJSON_AddArrayToObject(o, "messages");
            for (int32_t k = 0; k < u->n_msgs; k++) {
                cJSON *m = cJSON_CreateObject();
                cJSON_AddStringToObject(m, "role", u->msgs[k].role);
                cJSON_AddStringToObject(m, "content", u->msgs[k].content);
                cJSON_AddItemToArray(arr, m);
            }
        } else {
            if (u->system_tokens > 0) cJSON_AddNumberToObject(o, "system_tokens", u->system_tokens);
            cJSON_AddNumberToObject(o, "append_tokens", u->append_tokens);
        }
        if (u->output) cJSON_AddStringToObject(o, "output", u->output);
        else cJSON_AddNumberToObject(o, "output_tokens", u->output_tokens);
        cJSON_AddNumberToObject(o, "wait_s", u->wait_s);
        char *s = cJSON_PrintUnformatted(o);
        fprintf(f, "%s\n", s);
        free(s);
        cJSON_Delete(o);
    }
    bool ok = !ferror(f);
    if (fclose(f) != 0 || !ok) return lethe_errorf(LETHE_ERR_IO, "error writing %s", path);
    return LETHE_OK;
}

void lethe_trace_gen_default(lethe_trace_gen_params *p) {
    *p = (lethe_trace_gen_params){.n_agents = 8, .min_turns = 20, .max_turns = 60, .system_tokens = 300,
                                  .task_tokens = 200, .tool_min = 200, .tool_max = 2000, .out_min = 20,
                                  .out_max = 120, .max_wait_s = 2.0, .max_context = 0, .seed = 42};
}

static int32_t uniform_i(uint64_t *s, int32_t lo, int32_t hi) {
    if (hi <= lo) return lo;
    return lo + (int32_t)(lethe_splitmix64(s) % (uint64_t)(hi - lo + 1));
}

static int64_t turn_tokens(const lethe_trace_turn *u) {
    int64_t n = (int64_t)u->system_tokens + u->append_tokens + u->output_tokens;
    for (int32_t i = 0; i < u->n_msgs; i++) n += (int64_t)strlen(u->msgs[i].content) / 4 + 4;
    if (u->output) n += (int64_t)strlen(u->output) / 4;
    return n + 12; /* template tokens around the messages */
}

int64_t lethe_trace_context_after(const lethe_trace *t, int32_t agent, int32_t turn) {
    int64_t n = 0;
    for (int32_t i = t->agent_first[agent]; i < t->agent_first[agent + 1] && t->turns[i].turn <= turn; i++)
        n += turn_tokens(&t->turns[i]);
    return n;
}

lethe_status lethe_trace_generate(const lethe_trace_gen_params *p, lethe_trace *out) {
    memset(out, 0, sizeof(*out));
    if (p->n_agents < 1 || p->min_turns < 1 || p->max_turns < p->min_turns || p->tool_min < 1 ||
        p->tool_max < p->tool_min || p->out_min < 1 || p->out_max < p->out_min || p->task_tokens < 1 ||
        p->system_tokens < 0 || !(p->max_wait_s >= 0))
        return lethe_errorf(LETHE_ERR_INVALID, "trace generator: need agents >= 1, 1 <= min-turns <= max-turns, "
                            "1 <= tool-min <= tool-max, 1 <= out-min <= out-max, task-tokens >= 1, wait >= 0");
    uint64_t s = p->seed ^ 0x7ace7ace7ace7aceull;
    out->shared_system = p->shared_system;
    for (int32_t a = 0; a < p->n_agents; a++) {
        char name[32];
        snprintf(name, sizeof(name), "agent-%03d", a);
        agent_index(out, name);
        int32_t n_turns = uniform_i(&s, p->min_turns, p->max_turns);
        int64_t ctx = 0;
        for (int32_t k = 0; k < n_turns; k++) {
            lethe_trace_turn u = {.agent = a, .turn = k};
            if (k == 0) {
                u.system_tokens = p->system_tokens;
                u.append_tokens = p->task_tokens;
            } else {
                u.append_tokens = uniform_i(&s, p->tool_min, p->tool_max);
            }
            u.output_tokens = uniform_i(&s, p->out_min, p->out_max);
            u.wait_s = p->max_wait_s > 0 ? (double)(lethe_splitmix64(&s) >> 11) * 0x1.0p-53 * p->max_wait_s : 0;
            int64_t add = turn_tokens(&u);
            if (p->max_context > 0 && k > 0 && ctx + add > p->max_context) break;
            ctx += add;
            out->turns = lethe_xrealloc(out->turns, (size_t)(out->n_turns + 1) * sizeof(*out->turns));
            out->turns[out->n_turns++] = u;
        }
    }
    return finalize(out, "generated trace");
}

char *lethe_trace_words(uint64_t seed, int32_t agent, int32_t turn, int32_t salt, int32_t n) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull ^ ((uint64_t)(uint32_t)agent << 32 | (uint32_t)turn) ^
                 ((uint64_t)(uint32_t)salt * 0xd1b54a32d192ed03ull);
    size_t cap = 16 * (size_t)LETHE_MAX(n, 1) + 1, len = 0;
    char *buf = lethe_xmalloc(cap);
    buf[0] = 0;
    for (int32_t i = 0; i < n; i++) {
        const char *w = lethe_bs_words[lethe_splitmix64(&s) % (uint64_t)lethe_bs_n_words];
        size_t wl = strlen(w);
        if (len + wl + 2 > cap) {
            cap = 2 * cap + wl + 2;
            buf = lethe_xrealloc(buf, cap);
        }
        buf[len++] = ' ';
        memcpy(buf + len, w, wl);
        len += wl;
        buf[len] = 0;
    }
    return buf;
}

lethe_trace_msg *lethe_trace_turn_messages(const lethe_trace *t, const lethe_trace_turn *u, uint64_t seed,
                                           int32_t *n) {
    *n = 0;
    lethe_trace_msg *out = lethe_xcalloc((size_t)LETHE_MAX(u->n_msgs, 2), sizeof(*out));
    if (u->n_msgs > 0) {
        for (int32_t i = 0; i < u->n_msgs; i++) {
            out[i].role = lethe_xstrdup(u->msgs[i].role);
            out[i].content = lethe_xstrdup(u->msgs[i].content);
        }
        *n = u->n_msgs;
        return out;
    }
    if (u->system_tokens > 0) {
        /* a shared system prompt: the words of no agent in particular */
        char *w = t->shared_system ? lethe_trace_words(seed, -1, 0, 1, u->system_tokens)
                                   : lethe_trace_words(seed, u->agent, u->turn, 1, u->system_tokens);
        out[*n].role = lethe_xstrdup("system");
        out[*n].content = w;
        (*n)++;
    }
    if (u->append_tokens > 0) {
        char *w = lethe_trace_words(seed, u->agent, u->turn, 2, u->append_tokens);
        out[*n].role = lethe_xstrdup("user");
        out[*n].content = w;
        (*n)++;
    }
    return out;
}

char *lethe_trace_turn_output(const lethe_trace *t, const lethe_trace_turn *u, uint64_t seed) {
    (void)t;
    if (u->output) return lethe_xstrdup(u->output);
    return lethe_trace_words(seed, u->agent, u->turn, 3, u->output_tokens);
}

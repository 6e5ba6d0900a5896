/* registry.c - the list of sparse methods (one line each), lookup by name or
 * alias, "knob=value,..." parsing, and the defaults of optional hooks.
 *
 * Adding a method: write src/sparse/<name>.c defining a lethe_sparse_ops,
 * declare it in sparse.h and add one line to g_methods below. */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/sparse.h"

extern const lethe_sparse_ops lethe_sparse_streamingllm, lethe_sparse_snapkv, lethe_sparse_pyramidkv,
    lethe_sparse_h2o, lethe_sparse_quest, lethe_sparse_omnikv, lethe_sparse_kivi, lethe_sparse_fp8_kv;

static const lethe_sparse_ops *const g_methods[] = {
    &lethe_sparse_dense,
    &lethe_sparse_streamingllm,
    &lethe_sparse_snapkv,
    &lethe_sparse_pyramidkv,
    &lethe_sparse_h2o,
    &lethe_sparse_quest,
    &lethe_sparse_omnikv,
    &lethe_sparse_kivi,
    &lethe_sparse_fp8_kv,
};

void lethe_sparse_knobs_default(lethe_sparse_knobs *k) {
    k->sink_keep_tokens = LETHE_SPARSE_SINK_DEFAULT;
    k->recent_keep_tokens = LETHE_SPARSE_RECENT_DEFAULT;
    k->decode_keep_tokens = LETHE_SPARSE_DECODE_KEEP_DEFAULT;
}

int32_t lethe_sparse_n_methods(void) { return (int32_t)LETHE_ARRAY_LEN(g_methods); }

const lethe_sparse_ops *lethe_sparse_method_at(int32_t i) {
    return i >= 0 && i < lethe_sparse_n_methods() ? g_methods[i] : NULL;
}

/* case-insensitive, '-' == '_' */
static bool name_eq(const char *a, const char *b) {
    for (; *a && *b; a++, b++) {
        char x = (char)tolower((unsigned char)*a), y = (char)tolower((unsigned char)*b);
        if (x == '-') x = '_';
        if (y == '-') y = '_';
        if (x != y) return false;
    }
    return *a == *b;
}

const lethe_sparse_ops *lethe_sparse_find(const char *name) {
    if (!name || !*name) name = "dense";
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *o = g_methods[i];
        if (name_eq(name, o->name)) return o;
        for (int a = 0; a < 4 && o->aliases[a]; a++)
            if (name_eq(name, o->aliases[a])) return o;
    }
    char known[512];
    size_t k = 0;
    known[0] = '\0';
    for (int32_t i = 0; i < lethe_sparse_n_methods() && k < sizeof(known); i++) {
        int w = snprintf(known + k, sizeof(known) - k, "%s%s", i ? ", " : "", g_methods[i]->name);
        if (w > 0) k += (size_t)w;
    }
    lethe_errorf(LETHE_ERR_NOT_FOUND, "--sparse-method %s: unknown method (known: %s)", name, known);
    return NULL;
}

static lethe_status parse_knob_int(const char *key, const char *val, int32_t *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (errno || end == val || *end || v < 0 || v > (1L << 30))
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--sparse-config %s=%s: expected a token count (integer >= 0)", key, val);
    *out = (int32_t)v;
    return LETHE_OK;
}

lethe_status lethe_sparse_parse_config(lethe_sparse_method *m, const char *config) {
    if (!config || !*config) return LETHE_OK;
    char *buf = lethe_xstrdup(config);
    lethe_status st = LETHE_OK;
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item && st == LETHE_OK;
         item = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*item)) item++;
        if (!*item) continue;
        char *eq = strchr(item, '=');
        if (!eq || eq == item || !eq[1]) {
            st = lethe_errorf(LETHE_ERR_INVALID, "--sparse-config: '%s' is not knob=value", item);
            break;
        }
        *eq = '\0';
        const char *key = item, *val = eq + 1;
        char *kend = eq;
        while (kend > item && isspace((unsigned char)kend[-1])) *--kend = '\0';
        if (!strcmp(key, "sink_keep_tokens")) st = parse_knob_int(key, val, &m->knobs.sink_keep_tokens);
        else if (!strcmp(key, "recent_keep_tokens")) st = parse_knob_int(key, val, &m->knobs.recent_keep_tokens);
        else if (!strcmp(key, "decode_keep_tokens")) st = parse_knob_int(key, val, &m->knobs.decode_keep_tokens);
        else {
            bool known = false;
            for (const char *const *k = m->ops->knob_names; k && *k; k++) known |= !strcmp(*k, key);
            for (int32_t k = 0; k < m->ops->n_knob_table; k++) known |= !strcmp(m->ops->knob_table[k].name, key);
            if (!known || !m->ops->set_knob) {
                char names[768] = "sink_keep_tokens, recent_keep_tokens, decode_keep_tokens";
                for (const char *const *k = m->ops->knob_names; k && *k; k++) {
                    size_t l = strlen(names);
                    snprintf(names + l, sizeof(names) - l, ", %s", *k);
                }
                for (int32_t k = 0; k < m->ops->n_knob_table; k++) {
                    size_t l = strlen(names);
                    snprintf(names + l, sizeof(names) - l, ", %s", m->ops->knob_table[k].name);
                }
                st = lethe_errorf(LETHE_ERR_INVALID, "--sparse-config: unknown knob '%s' for method %s (knobs: %s)",
                                  key, m->ops->name, names);
            } else {
                st = m->ops->set_knob(m, key, val);
            }
        }
    }
    free(buf);
    return st;
}

lethe_status lethe_sparse_create(const char *name, const char *config, const lethe_sparse_env *env,
                                 lethe_sparse_method **out) {
    *out = NULL;
    const lethe_sparse_ops *ops = lethe_sparse_find(name);
    if (!ops) return LETHE_ERR_NOT_FOUND;
    LETHE_ASSERT(ops->build_prefill_selection && ops->build_decode_selection);
    /* select_layer hands the engine one selection per sequence of shared rows */
    LETHE_ASSERT(!ops->select_layer ||
                 !(ops->flags & (LETHE_SPARSE_PER_LAYER_ROWS | LETHE_SPARSE_UNIFORM)));
    lethe_sparse_method *m = lethe_xcalloc(1, sizeof(*m));
    m->ops = ops;
    m->env = *env;
    lethe_sparse_knobs_default(&m->knobs);
    lethe_status st = ops->init ? ops->init(m) : LETHE_OK;
    if (st == LETHE_OK) st = lethe_sparse_parse_config(m, config);
    if (st == LETHE_OK && ops->configure) st = ops->configure(m);
    if (st != LETHE_OK) {
        lethe_sparse_destroy(m);
        return st;
    }
    *out = m;
    return LETHE_OK;
}

void lethe_sparse_destroy(lethe_sparse_method *m) {
    if (!m) return;
    if (m->ops->destroy) m->ops->destroy(m);
    free(m);
}

int32_t lethe_sparse_prefill_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                                  int32_t n_resident, int32_t n_chunk) {
    if (m && m->ops->prefill_peak_slots) return m->ops->prefill_peak_slots(m, s, n_resident, n_chunk);
    return n_chunk;
}

int32_t lethe_sparse_decode_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                                 int32_t n_resident) {
    if (m && m->ops->decode_peak_slots) return m->ops->decode_peak_slots(m, s, n_resident);
    return 1;
}

int32_t lethe_sparse_select_all(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                int32_t *sel, int32_t cap) {
    int32_t sp = lethe_kv_space_of(m->env.pool, layer);
    int32_t n = lethe_kv_row_len(m->env.pool, sp, row);
    LETHE_ASSERT(n <= cap);
    memcpy(sel, lethe_kv_row_slots(m->env.pool, sp, row), (size_t)n * sizeof(int32_t));
    return n;
}

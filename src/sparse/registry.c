/* registry.c - the list of sparse methods (one line each), lookup by name or
 * alias, "knob=value,..." parsing, method creation.
 *
 * Adding a method: write src/sparse/<name>.c defining `const lethe_sparse_ops
 * lethe_sparse_<name>` (sparse.h: only name and summary are required, every
 * hook has a default) and add the line X(<name>) to LETHE_SPARSE_METHODS
 * below. On the registry's first use every table is checked against the
 * contract's rules (validate.c); the generic test suites then run the method
 * with its test_configs. */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "sparse/sparse.h"

/* The built-in methods, one line each: X(name) registers lethe_sparse_<name>
 * (the table in src/sparse/<name>.c). Order = `lethe methods` order. */
#define LETHE_SPARSE_METHODS(X)                                                                    \
    X(dense)                                                                                       \
    X(streamingllm)                                                                                \
    X(snapkv)                                                                                      \
    X(pyramidkv)                                                                                   \
    X(h2o)                                                                                         \
    X(quest)                                                                                       \
    X(omnikv)                                                                                      \
    X(retroinfer)                                                                                  \
    X(kivi)                                                                                        \
    X(turboquant)                                                                                  \
    X(palu)                                                                                        \
    X(deltakv)                                                                                     \
    X(fp8_kv)                                                                                      \
    X(kvzip)                                                                                       \
    X(rkv)                                                                                         \
    X(skipkv)                                                                                      \
    X(flashprefill)                                                                                \
    X(omnikv_prefill)

#define DECLARE_(n) extern const lethe_sparse_ops lethe_sparse_##n;
#define ENTRY_(n) &lethe_sparse_##n,
LETHE_SPARSE_METHODS(DECLARE_)
static const lethe_sparse_ops *const g_methods[] = {LETHE_SPARSE_METHODS(ENTRY_)};
enum { N_BUILTIN = (int)LETHE_ARRAY_LEN(g_methods), MAX_EXTRA = 8 };

/* methods registered at run time (lethe_sparse_register_extra), after the built-ins */
static const lethe_sparse_ops *g_extra[MAX_EXTRA];
static int32_t g_n_extra;

void lethe_sparse_knobs_default(lethe_sparse_knobs *k) {
    k->sink_keep_tokens = LETHE_SPARSE_SINK_DEFAULT;
    k->recent_keep_tokens = LETHE_SPARSE_RECENT_DEFAULT;
    k->decode_keep_tokens = LETHE_SPARSE_DECODE_KEEP_DEFAULT;
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

static const lethe_sparse_ops *method_at(int32_t i) { return i < N_BUILTIN ? g_methods[i] : g_extra[i - N_BUILTIN]; }

/* whether `name` spells method o (its name or an alias) */
static bool spells(const lethe_sparse_ops *o, const char *name) {
    if (name_eq(name, o->name)) return true;
    for (int a = 0; a < 4 && o->aliases[a]; a++)
        if (name_eq(name, o->aliases[a])) return true;
    return false;
}

/* o's name and aliases against each other and against methods [0, n) */
static lethe_status check_clash(const lethe_sparse_ops *o, int32_t n) {
    const char *names[5] = {o->name};
    int n_names = 1;
    for (int a = 0; a < 4 && o->aliases[a]; a++) names[n_names++] = o->aliases[a];
    for (int i = 0; i < n_names; i++) {
        for (int j = 0; j < i; j++)
            if (name_eq(names[i], names[j]))
                return lethe_errorf(LETHE_ERR_INVALID, "sparse method %s: '%s' is spelled twice in its "
                                    "name and aliases", o->name, names[i]);
        for (int32_t k = 0; k < n; k++)
            if (spells(method_at(k), names[i]))
                return lethe_errorf(LETHE_ERR_INVALID, "sparse method %s: '%s' already names method %s",
                                    o->name, names[i], method_at(k)->name);
    }
    return LETHE_OK;
}

/* Every built-in table against the contract (validate.c) and the others'
 * names, once. A broken built-in is a bug: abort naming method and rule. */
static pthread_once_t g_checked = PTHREAD_ONCE_INIT;
static void check_builtins(void) {
    for (int32_t i = 0; i < N_BUILTIN; i++) {
        lethe_status st = lethe_sparse_validate(g_methods[i]);
        if (st == LETHE_OK) st = check_clash(g_methods[i], i);
        if (st != LETHE_OK) LOG_ERROR("sparse registry: %s", lethe_last_error());
        LETHE_ASSERT(st == LETHE_OK && "a registered sparse method breaks the contract (sparse.h)");
    }
}
static void ensure_checked(void) { pthread_once(&g_checked, check_builtins); }

int32_t lethe_sparse_n_methods(void) {
    ensure_checked();
    return N_BUILTIN + g_n_extra;
}

const lethe_sparse_ops *lethe_sparse_method_at(int32_t i) {
    return i >= 0 && i < lethe_sparse_n_methods() ? method_at(i) : NULL;
}

lethe_status lethe_sparse_register_extra(const lethe_sparse_ops *ops) {
    const int32_t n = lethe_sparse_n_methods();
    lethe_status st = lethe_sparse_validate(ops);
    if (st != LETHE_OK) return st;
    if ((st = check_clash(ops, n)) != LETHE_OK) return st;
    if (g_n_extra == MAX_EXTRA)
        return lethe_errorf(LETHE_ERR_CAPACITY, "sparse method %s: the registry holds at most %d extra "
                            "methods", ops->name, MAX_EXTRA);
    g_extra[g_n_extra++] = ops;
    return LETHE_OK;
}

const lethe_sparse_ops *lethe_sparse_find(const char *name) {
    if (!name || !*name) name = "dense";
    const int32_t n = lethe_sparse_n_methods();
    for (int32_t i = 0; i < n; i++)
        if (spells(method_at(i), name)) return method_at(i);
    char known[512];
    size_t k = 0;
    known[0] = '\0';
    for (int32_t i = 0; i < n && k < sizeof(known); i++) {
        int w = snprintf(known + k, sizeof(known) - k, "%s%s", i ? ", " : "", method_at(i)->name);
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
            for (int32_t k = 0; k < m->ops->n_knob_table; k++) known |= !strcmp(m->ops->knob_table[k].name, key);
            if (!known) {
                char names[768] = "sink_keep_tokens, recent_keep_tokens, decode_keep_tokens";
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
    if (name && strchr(name, '+')) { /* PREFILL+DECODE (combined.c) */
        const lethe_sparse_ops *p, *d;
        lethe_status st = lethe_sparse_combine(name, &p, &d);
        return st == LETHE_OK ? lethe_sparse_create_combined(p, d, config, env, out) : st;
    }
    const lethe_sparse_ops *ops = lethe_sparse_find(name);
    if (!ops) return LETHE_ERR_NOT_FOUND; /* (registered tables passed lethe_sparse_validate) */
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

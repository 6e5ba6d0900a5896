/* env.c - the table of LETHE_* environment variables and their parsers (env.h). */
#include "core/env.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static const lethe_env_var g_vars[LETHE_ENV_N] = {
    [LETHE_ENV_STEP_TIMES] =
        {"LETHE_STEP_TIMES", LETHE_ENV_BOOL, "0", NULL, "engine",
         "log, when an engine is destroyed, the host ms per pure decode step split into "
         "host issue time (planning with plan_layer inside it, staging, launching), the "
         "graph launch + device wait and the sampling wait (a large wait: device-bound)"},
    [LETHE_ENV_PROFILE_STEP] =
        {"LETHE_PROFILE_STEP", LETHE_ENV_UINT, "0", NULL, "engine",
         "put the device profiler's range around the N-th pure decode step (1-based; 0: "
         "off), for ncu --profile-from-start off"},
    [LETHE_ENV_SAMPLE_ON_HOST] =
        {"LETHE_SAMPLE_ON_HOST", LETHE_ENV_BOOL, "0", NULL, "engine",
         "sample on the host from copied logits instead of the backend's sample op "
         "(debugging, comparisons; same tokens)"},
    [LETHE_ENV_MATMUL] =
        {"LETHE_MATMUL", LETHE_ENV_CHOICE, "auto", "auto|cublas", "CUDA backend",
         "auto: products of at most 4 rows (decode at batch <= 4) on lethe's GEMV kernel, the "
         "rest on cuBLAS; cublas: every product on cuBLAS (side-by-side benchmarks)"},
    [LETHE_ENV_FAULT_TOKEN] =
        {"LETHE_FAULT_TOKEN", LETHE_ENV_UINT, "0", NULL, "engine",
         "testing: the model forward of every step whose batch holds token id N fails after "
         "it ran, as a backend error would; the step's requests end with an internal error "
         "(HTTP 500), the others continue (0: off)"},
    [LETHE_ENV_CPU_ISA] =
        {"LETHE_CPU_ISA", LETHE_ENV_CHOICE, "auto", "auto|vnni|avx2|scalar", "CPU backend",
         "auto: the best kernel tier this CPU runs (probed by executing it); vnni / avx2 / "
         "scalar: at most that tier (tests and side-by-side benchmarks; the same results, "
         "except KVzip's replay scores: float exponentials on avx2, within 1e-5)"},
    [LETHE_ENV_DUMP_SELECTIONS] =
        {"LETHE_DUMP_SELECTIONS", LETHE_ENV_PATH, "", NULL, "engine",
         "testing: append to this file one JSON line per decode sequence and layer with the "
         "positions attention reads (per KV head where rows keep per-head lengths), for the "
         "reference comparisons of tests/ref; CPU backend only (empty: off)"},
    [LETHE_ENV_MLA_EXPAND_MIN_Q] =
        {"LETHE_MLA_EXPAND_MIN_Q", LETHE_ENV_UINT, "64", NULL, "model",
         "latent attention (GLM-4.7-Flash): a layer's attention runs in the expanded form "
         "(per-head K / V decompressed by GEMMs) when its batch has at least N queries per "
         "key on average, else absorbed (0: always absorbed; side-by-side benchmarks)"},
};

const lethe_env_var *lethe_env_var_of(lethe_env_id id) {
    LETHE_ASSERT((int)id >= 0 && id < LETHE_ENV_N && g_vars[id].name);
    return &g_vars[id];
}

/* The raw value: the environment's when set and non-empty, else the default. */
static const char *raw(const lethe_env_var *v) {
    const char *s = getenv(v->name);
    return s && *s ? s : v->def;
}

lethe_status lethe_env_bool(lethe_env_id id, bool *out) {
    const lethe_env_var *v = lethe_env_var_of(id);
    LETHE_ASSERT(v->type == LETHE_ENV_BOOL);
    const char *s = raw(v);
    static const char *const on[] = {"1", "true", "yes", "on"}, *const off[] = {"0", "false", "no",
                                                                                "off"};
    for (size_t i = 0; i < sizeof(on) / sizeof(on[0]); i++) {
        if (!strcmp(s, on[i])) return *out = true, LETHE_OK;
        if (!strcmp(s, off[i])) return *out = false, LETHE_OK;
    }
    return lethe_errorf(LETHE_ERR_INVALID, "%s='%s': expected 0 or 1", v->name, s);
}

lethe_status lethe_env_uint(lethe_env_id id, int64_t *out) {
    const lethe_env_var *v = lethe_env_var_of(id);
    LETHE_ASSERT(v->type == LETHE_ENV_UINT);
    const char *s = raw(v);
    char *end = NULL;
    errno = 0;
    long long x = s[0] >= '0' && s[0] <= '9' ? strtoll(s, &end, 10) : -1;
    if (x < 0 || errno || *end)
        return lethe_errorf(LETHE_ERR_INVALID, "%s='%s': expected a whole number >= 0", v->name, s);
    *out = x;
    return LETHE_OK;
}

lethe_status lethe_env_choice(lethe_env_id id, const char **out) {
    const lethe_env_var *v = lethe_env_var_of(id);
    LETHE_ASSERT(v->type == LETHE_ENV_CHOICE && v->choices);
    const char *s = raw(v);
    const size_t n = strlen(s);
    for (const char *c = v->choices; *c;) {
        const char *bar = strchr(c, '|');
        const size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && !strncmp(c, s, n)) return *out = s, LETHE_OK;
        c += len + (bar != NULL);
    }
    return lethe_errorf(LETHE_ERR_INVALID, "%s='%s': expected one of %s", v->name, s, v->choices);
}

lethe_status lethe_env_path(lethe_env_id id, const char **out) {
    const lethe_env_var *v = lethe_env_var_of(id);
    LETHE_ASSERT(v->type == LETHE_ENV_PATH);
    *out = raw(v);
    return LETHE_OK;
}

/* Prints s word-wrapped to `width` columns, each line indented by `indent`. */
static void print_wrapped(FILE *f, const char *s, int indent, int width) {
    int col = 0;
    while (*s) {
        const int len = (int)strcspn(s, " ");
        if (col > 0 && col + 1 + len > width) {
            fputc('\n', f);
            col = 0;
        }
        if (col == 0) col = fprintf(f, "%*s%.*s", indent, "", len, s);
        else col += fprintf(f, " %.*s", len, s);
        s += len;
        s += strspn(s, " ");
    }
    fputc('\n', f);
}

void lethe_env_print_help(FILE *f) {
    static const char *const type_values[] = {[LETHE_ENV_BOOL] = "0|1", [LETHE_ENV_UINT] = "N",
                                                [LETHE_ENV_PATH] = "PATH"};
    fprintf(f, "environment (diagnostics and side-by-side switches, read when an engine or a\n"
               "backend is created; unset or empty: the default):\n");
    for (int i = 0; i < LETHE_ENV_N; i++) {
        const lethe_env_var *v = &g_vars[i];
        fprintf(f, "  %s=%s (default %s; %s)\n", v->name,
                v->type == LETHE_ENV_CHOICE ? v->choices : type_values[v->type],
                v->def[0] ? v->def : "off", v->reader);
        print_wrapped(f, v->help, 6, 80);
    }
}

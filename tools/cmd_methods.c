/* cmd_methods.c - `lethe methods [NAME] [--json]`: the registered sparse
 * methods with their aliases, kind (dense / eviction / selection /
 * quantization), one-line summary, whether it applies to hybrid models
 * (linear-attention layers; lethe_sparse_hybrid_refusal) and knobs with defaults, straight from the
 * registry (src/sparse/registry.c), so the listing cannot drift from what
 * --sparse-method / --sparse-config accept. Each method has an axis: prefill
 * (LETHE_SPARSE_PREFILL_AXIS, only cheaper prompt chunks) or decode; NAME may
 * be a pair PREFILL+DECODE (src/sparse/combined.c), listed as its two
 * methods, or the reason the pair cannot work. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "options.h"
#include "sparse/sparse.h"

static const struct {
    unsigned bit;
    const char *name;
    int def;
    const char *help;
} shared[] = {
    {LETHE_USES_SINK, "sink_keep_tokens", LETHE_SPARSE_SINK_DEFAULT, "first tokens always kept (sinks)"},
    {LETHE_USES_RECENT, "recent_keep_tokens", LETHE_SPARSE_RECENT_DEFAULT, "most recent tokens always kept"},
    {LETHE_USES_KEEP, "decode_keep_tokens", LETHE_SPARSE_DECODE_KEEP_DEFAULT, "scored middle tokens kept / selected"},
};

static const char *type_name(lethe_knob_type t) {
    return t == LETHE_KNOB_INT ? "int" : t == LETHE_KNOB_FLOAT ? "float" : t == LETHE_KNOB_BOOL ? "bool" : "str";
}

static void print_text(const lethe_sparse_ops *o) {
    printf("%s", o->name);
    for (int a = 0; a < 4 && o->aliases[a]; a++) printf("%s%s", a ? ", " : "  (aliases: ", o->aliases[a]);
    printf("%s\n  kind: %s\n  %s\n", o->aliases[0] ? ")" : "", lethe_sparse_kind_name(o->kind), o->summary);
    if (o->flags & LETHE_SPARSE_PREFILL_AXIS) {
        printf("  axis: prefill; pairs with decode methods: --sparse-method %s+DECODE, e.g.", o->name);
        int shown = 0;
        for (int32_t i = 0; i < lethe_sparse_n_methods() && shown < 4; i++) {
            char pair[160];
            const lethe_sparse_ops *p, *d = lethe_sparse_method_at(i);
            if (d->flags & LETHE_SPARSE_PREFILL_AXIS || d->kind == LETHE_SPARSE_KIND_DENSE) continue;
            snprintf(pair, sizeof(pair), "%s+%s", o->name, d->name);
            if (lethe_sparse_combine(pair, &p, &d) == LETHE_OK) printf("%s %s", shown++ ? "," : "", pair);
        }
        printf("\n");
    } else {
        printf("  axis: decode\n");
    }
    const char *no_hybrid = lethe_sparse_hybrid_refusal(o);
    printf("  hybrid models: %s%s\n", no_hybrid ? "no, " : "yes (full-attention layers only)",
           no_hybrid ? no_hybrid : "");
    for (size_t i = 0; i < sizeof(shared) / sizeof(shared[0]); i++)
        if (o->shared_knobs & shared[i].bit)
            printf("    %-30s int    %-8d %s\n", shared[i].name, shared[i].def, shared[i].help);
    for (int32_t k = 0; k < o->n_knob_table; k++) {
        const lethe_sparse_knob *kn = &o->knob_table[k];
        printf("    %-30s %-6s %-8s %s", kn->name, type_name(kn->type), kn->def, kn->help);
        if (kn->type == LETHE_KNOB_INT || kn->type == LETHE_KNOB_FLOAT) printf(" [%.10g, %.10g]", kn->min, kn->max);
        printf("\n");
    }
    printf("\n");
}

static cJSON *to_json(const lethe_sparse_ops *o) {
    cJSON *m = cJSON_CreateObject(), *al = cJSON_AddArrayToObject(m, "aliases");
    cJSON_AddStringToObject(m, "name", o->name);
    for (int a = 0; a < 4 && o->aliases[a]; a++) cJSON_AddItemToArray(al, cJSON_CreateString(o->aliases[a]));
    cJSON_AddStringToObject(m, "kind", lethe_sparse_kind_name(o->kind));
    cJSON_AddStringToObject(m, "summary", o->summary);
    cJSON_AddStringToObject(m, "axis", o->flags & LETHE_SPARSE_PREFILL_AXIS ? "prefill" : "decode");
    const char *no_hybrid = lethe_sparse_hybrid_refusal(o);
    cJSON_AddBoolToObject(m, "hybrid", no_hybrid == NULL);
    if (no_hybrid) cJSON_AddStringToObject(m, "hybrid_refusal", no_hybrid);
    cJSON *kn = cJSON_AddArrayToObject(m, "knobs");
    for (size_t i = 0; i < sizeof(shared) / sizeof(shared[0]); i++) {
        if (!(o->shared_knobs & shared[i].bit)) continue;
        cJSON *k = cJSON_CreateObject();
        cJSON_AddStringToObject(k, "name", shared[i].name);
        cJSON_AddStringToObject(k, "type", "int");
        char d[16];
        snprintf(d, sizeof(d), "%d", shared[i].def);
        cJSON_AddStringToObject(k, "default", d);
        cJSON_AddStringToObject(k, "help", shared[i].help);
        cJSON_AddItemToArray(kn, k);
    }
    for (int32_t j = 0; j < o->n_knob_table; j++) {
        const lethe_sparse_knob *t = &o->knob_table[j];
        cJSON *k = cJSON_CreateObject();
        cJSON_AddStringToObject(k, "name", t->name);
        cJSON_AddStringToObject(k, "type", type_name(t->type));
        cJSON_AddStringToObject(k, "default", t->def);
        cJSON_AddStringToObject(k, "help", t->help);
        if (t->type == LETHE_KNOB_INT || t->type == LETHE_KNOB_FLOAT) {
            cJSON_AddNumberToObject(k, "min", t->min);
            cJSON_AddNumberToObject(k, "max", t->max);
        }
        cJSON_AddItemToArray(kn, k);
    }
    return m;
}

int lethe_cmd_methods(int argc, char **argv) {
    bool json = false;
    lethe_opt rows[] = {
        {"--json", NULL, LETHE_OPT_BOOL, &json, NULL, "machine-readable output", 1, 0},
    };
    const char *pos[1];
    int n_pos = 0;
    int pr = lethe_opts_parse(rows, 1, argc, argv, "lethe methods [NAME] [--json]",
                              "List the sparse methods (--sparse-method) and their knobs (--sparse-config k=v,...).",
                              pos, &n_pos, 1);
    if (pr != 0) return pr > 0 ? 0 : 2;
    const lethe_sparse_ops *only = NULL;
    if (n_pos == 1 && strchr(pos[0], '+')) { /* a pair: its two methods */
        const lethe_sparse_ops *p, *d;
        if (lethe_sparse_combine(pos[0], &p, &d) != LETHE_OK) {
            fprintf(stderr, "lethe methods: %s\n", lethe_last_error());
            return 2;
        }
        if (json) {
            cJSON *o = cJSON_CreateObject();
            char name[160];
            snprintf(name, sizeof(name), "%s+%s", p->name, d->name);
            cJSON_AddStringToObject(o, "name", name);
            cJSON_AddItemToObject(o, "prefill", to_json(p));
            cJSON_AddItemToObject(o, "decode", to_json(d));
            char *s = cJSON_Print(o);
            printf("%s\n", s);
            free(s);
            cJSON_Delete(o);
        } else {
            printf("%s+%s: prefill chunks by %s, decode and the KV by %s; the knobs of both in one "
                   "--sparse-config\n\n", p->name, d->name, p->name, d->name);
            print_text(p);
            print_text(d);
        }
        return 0;
    }
    if (n_pos == 1 && !(only = lethe_sparse_find(pos[0]))) {
        fprintf(stderr, "lethe methods: %s\n", lethe_last_error());
        return 2;
    }
    cJSON *arr = json ? cJSON_CreateArray() : NULL;
    for (int32_t i = 0; i < lethe_sparse_n_methods(); i++) {
        const lethe_sparse_ops *o = lethe_sparse_method_at(i);
        if (only && o != only) continue;
        if (json) cJSON_AddItemToArray(arr, to_json(o));
        else print_text(o);
    }
    if (json) {
        char *s = cJSON_Print(arr);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(arr);
    } else if (!only) {
        printf("knobs: --sparse-config knob=value,knob=value (the same spelling in the API's sparse_config)\n");
    }
    return 0;
}

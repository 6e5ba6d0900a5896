/* validate.c - the rules a lethe_sparse_ops table must follow (sparse.h),
 * checked for every registered method on the registry's first use
 * (registry.c) and by lethe_sparse_register_extra, so a broken table fails at
 * start-up with the method and the rule named instead of deep inside a step.
 *
 * The rules are the assumptions the engine, the scheduler and the generic
 * test suites make about a method: which hooks come together, which flags
 * go with which kind, and that the knob table parses. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "sparse/sparse.h"

/* the shared knobs (lethe_sparse_knobs) a method knob must not shadow */
const char *const lethe_sparse_shared_knob_names[3] = {"sink_keep_tokens", "recent_keep_tokens",
                                                       "decode_keep_tokens"};

static lethe_status broken(const lethe_sparse_ops *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static lethe_status broken(const lethe_sparse_ops *o, const char *fmt, ...) {
    char rule[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rule, sizeof(rule), fmt, ap);
    va_end(ap);
    return lethe_errorf(LETHE_ERR_INVALID, "sparse method %s: %s",
                        o->name && *o->name ? o->name : "(unnamed)", rule);
}

#define RULE(cond, ...)                                                                            \
    do {                                                                                           \
        if (!(cond)) return broken(o, __VA_ARGS__);                                                \
    } while (0)

/* canonical names: [a-z0-9_]; aliases may also use '-' and capitals */
static bool spelling_ok(const char *s, bool alias) {
    if (!s || !*s) return false;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        bool ok = islower(c) || isdigit(c) || c == '_' || (alias && (isupper(c) || c == '-'));
        if (!ok) return false;
    }
    return true;
}

static lethe_status check_knobs(const lethe_sparse_ops *o) {
    RULE(o->n_knob_table >= 0 && o->n_knob_table <= LETHE_SPARSE_MAX_KNOBS,
         "n_knob_table %d outside [0, %d]", o->n_knob_table, LETHE_SPARSE_MAX_KNOBS);
    RULE((o->n_knob_table > 0) == (o->knob_table != NULL),
         "knob_table and n_knob_table must be set together");
    RULE(o->n_knob_table == 0 || o->set_knob, "a method with a knob_table must provide set_knob");
    RULE((o->shared_knobs & ~(unsigned)(LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP)) == 0,
         "shared_knobs has bits other than LETHE_USES_*");
    for (int32_t i = 0; i < o->n_knob_table; i++) {
        const lethe_sparse_knob *k = &o->knob_table[i];
        const char *kname = k->name;
        RULE(kname && *kname && k->def && k->help, "knob %d needs a name, a default and a help line", i);
        for (int s = 0; s < 3; s++)
            RULE(strcmp(kname, lethe_sparse_shared_knob_names[s]),
                 "knob %s shadows the shared knob of that name", kname);
        for (int32_t j = 0; j < i; j++)
            RULE(strcmp(kname, o->knob_table[j].name), "knob %s is listed twice", kname);
        RULE((int)k->type >= (int)LETHE_KNOB_INT && (int)k->type <= (int)LETHE_KNOB_STR, "knob %s has an unknown type", k->name);
        RULE(k->type == LETHE_KNOB_STR || k->type == LETHE_KNOB_BOOL || k->min <= k->max,
             "knob %s: min %g > max %g", k->name, k->min, k->max);
        lethe_knob_values v;
        RULE(lethe_knobs_set(o, &v, k->name, k->def) == LETHE_OK,
             "knob %s: its default '%s' is not a valid value (%s)", k->name, k->def, lethe_last_error());
    }
    return LETHE_OK;
}

lethe_status lethe_sparse_validate(const lethe_sparse_ops *o) {
    LETHE_ASSERT(o);
    /* identity */
    RULE(spelling_ok(o->name, false), "name must be a non-empty [a-z0-9_] word");
    RULE(o->summary && *o->summary, "summary (one line for `lethe methods`) is required");
    for (int a = 0; a < 4 && o->aliases[a]; a++)
        RULE(spelling_ok(o->aliases[a], true), "alias %d must be a non-empty word of letters, digits, "
             "'-' and '_'", a);
    RULE((int)o->kind >= (int)LETHE_SPARSE_KIND_DENSE && (int)o->kind <= (int)LETHE_SPARSE_KIND_COMPRESSION,
         "kind %d is not a lethe_sparse_kind", (int)o->kind);
    const unsigned known = LETHE_SPARSE_PER_LAYER_ROWS | LETHE_SPARSE_PREFIX_CACHE |
                           LETHE_SPARSE_PAGE_META | LETHE_SPARSE_UNIFORM | LETHE_SPARSE_KV_PRE_ROPE |
                           LETHE_SPARSE_HEAD_ROWS | LETHE_SPARSE_F32_WEIGHTS | LETHE_SPARSE_PREFILL_AXIS |
                           LETHE_SPARSE_OFFLOADS;
    RULE((o->flags & ~known) == 0, "flags has bits other than LETHE_SPARSE_*");
    lethe_status st = check_knobs(o);
    if (st != LETHE_OK) return st;

    const bool evicts = o->kind == LETHE_SPARSE_KIND_EVICTION;
    const bool per_layer = (o->flags & LETHE_SPARSE_PER_LAYER_ROWS) != 0;
    const bool uniform = (o->flags & LETHE_SPARSE_UNIFORM) != 0;
    /* rows and eviction */
    RULE(!evicts || per_layer, "an EVICTION method must set LETHE_SPARSE_PER_LAYER_ROWS "
         "(each layer frees its own tokens)");
    RULE(evicts || !per_layer, "LETHE_SPARSE_PER_LAYER_ROWS is for EVICTION methods only "
         "(a method that frees nothing keeps one shared row)");
    RULE(!evicts || o->finish_step, "an EVICTION method must provide finish_step (the only place "
         "lethe_kv_keep may run)");
    RULE(!evicts || !(o->flags & LETHE_SPARSE_PREFIX_CACHE), "an EVICTION method must not set "
         "LETHE_SPARSE_PREFIX_CACHE (its KV depends on the request's history)");
    RULE(!(o->flags & LETHE_SPARSE_HEAD_ROWS) || (per_layer && !o->kv_format && !o->kv_layout),
         "LETHE_SPARSE_HEAD_ROWS needs LETHE_SPARSE_PER_LAYER_ROWS and native KV (no kv_format, no kv_layout)");
    /* selection */
    RULE(o->kind != LETHE_SPARSE_KIND_SELECTION || o->select_layer || o->build_decode_selection ||
             o->build_prefill_selection || o->block_sparse,
         "a SELECTION method must provide select_layer, build_decode_selection or block_sparse (the "
         "default selects every resident slot)");
    /* (a pair PREFILL+DECODE carries its prefill method's block_sparse under
     * the decode method's kind) */
    RULE(!o->block_sparse || (o->kind != LETHE_SPARSE_KIND_DENSE && !uniform && !o->kv_layout && !o->kv_format),
         "block_sparse reads the backend's native K / V: not with kv_layout, kv_format or "
         "LETHE_SPARSE_UNIFORM");
    RULE(!(o->flags & LETHE_SPARSE_PREFILL_AXIS) ||
             (o->kind == LETHE_SPARSE_KIND_SELECTION && (o->select_layer || o->block_sparse) &&
              !per_layer && !(o->flags & LETHE_SPARSE_PREFIX_CACHE) && !o->request_init &&
              !o->build_decode_selection && !o->kv_layout && !o->prefill_peak_slots &&
              !o->max_resident && !o->slot_overhead_bytes && !o->kv_reserve_bytes),
         "a LETHE_SPARSE_PREFILL_AXIS method narrows prompt chunks only: a SELECTION method with "
         "select_layer or block_sparse, shared rows, no per-request state, no decode selection, "
         "no storage or capacity hooks of its own");
    RULE(!o->select_layer || (!per_layer && !uniform), "select_layer needs shared rows: not with "
         "LETHE_SPARSE_PER_LAYER_ROWS or LETHE_SPARSE_UNIFORM");
    RULE(!o->graph_step || o->select_layer || per_layer, "graph_step needs select_layer (it plans "
         "what select_layer issues) or LETHE_SPARSE_PER_LAYER_ROWS (decode over the resident rows)");
    RULE(!uniform || !(o->needs_scores || o->after_attn || o->layer_end),
         "a LETHE_SPARSE_UNIFORM method must not have needs_scores, after_attn or layer_end "
         "(the engine builds one plan per step)");
    RULE(!o->needs_scores || o->after_attn, "needs_scores without after_attn (the scores are "
         "handed to after_attn)");
    /* storage */
    RULE((o->kind == LETHE_SPARSE_KIND_QUANTIZATION) == (o->kv_format != NULL),
         "a QUANTIZATION method must provide kv_format, and only a QUANTIZATION method may");
    /* a SELECTION method may attend through its own path too (RetroInfer's
     * estimated zone is not a subset of the KV) */
    RULE(o->kind != LETHE_SPARSE_KIND_COMPRESSION || o->kv_layout,
         "a COMPRESSION method must provide kv_layout");
    RULE(!o->kv_layout || o->kind == LETHE_SPARSE_KIND_COMPRESSION ||
             o->kind == LETHE_SPARSE_KIND_SELECTION,
         "only a COMPRESSION or SELECTION method may provide kv_layout");
    RULE(!o->kv_layout == !o->kv_store && !o->kv_layout == !o->kv_attend,
         "kv_layout, kv_store and kv_attend come together (the model reads a layout only through them)");
    RULE(o->kv_layout || (!o->kv_out_proj && !(o->flags & LETHE_SPARSE_KV_PRE_ROPE)),
         "kv_out_proj and LETHE_SPARSE_KV_PRE_ROPE need kv_layout");
    RULE(!o->kv_out_proj || (o->hybrid_refusal && o->hybrid_refusal[0]),
         "kv_out_proj needs hybrid_refusal: a hybrid model's gated attention multiplies the "
         "per-head outputs an own output projection never forms");
    RULE(!o->kv_layout || !uniform, "a method with kv_layout must not be LETHE_SPARSE_UNIFORM (its "
         "layers store and attend through kv_store / kv_attend)");
    RULE(!(o->flags & LETHE_SPARSE_OFFLOADS) ||
             (o->kv_layout && o->finish_step && !evicts && !per_layer && !uniform &&
              !(o->flags & LETHE_SPARSE_PREFIX_CACHE)),
         "LETHE_SPARSE_OFFLOADS needs kv_layout / kv_attend (it attends to what it offloaded) and "
         "finish_step, shared rows, no LETHE_SPARSE_PREFIX_CACHE, not an EVICTION method");
    RULE(((o->flags & LETHE_SPARSE_PAGE_META) != 0) == (o->page_meta_floats > 0),
         "page_meta_floats must be > 0 exactly when LETHE_SPARSE_PAGE_META is set (it is %d)",
         o->page_meta_floats);
    /* hooks that come in pairs */
    RULE(!o->init || o->destroy, "init without destroy (m->priv would leak)");
    RULE(!o->request_init == !o->request_finished, "request_init and request_finished come together");
    RULE(!o->snapshot == !o->restore, "snapshot and restore come together");
    RULE(!o->snapshot || o->request_init, "snapshot needs request_init (the state it saves)");
    /* what the generic test suites run */
    RULE(!(evicts || o->kind == LETHE_SPARSE_KIND_SELECTION) || o->test_configs.small,
         "an EVICTION or SELECTION method must give test_configs.small (budgets the conformance "
         "suite runs to see it evict / select)");
    RULE(!o->test_configs.identity_on_backend || o->select_layer,
         "test_configs.identity_on_backend without select_layer");
    return LETHE_OK;
}

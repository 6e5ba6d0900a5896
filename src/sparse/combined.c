/* combined.c - a prefill-axis method and a decode-axis method in one engine:
 * --sparse-method PREFILL+DECODE (e.g. flashprefill+snapkv,
 * omnikv_prefill+quest), with the knobs of both in one --sparse-config.
 *
 * A prefill-axis method (LETHE_SPARSE_PREFILL_AXIS: flashprefill,
 * omnikv_prefill) only makes prompt chunks cheaper: it narrows what prefill
 * attention reads, keeps no per-request state and never changes the KV. So
 * the pair is one method table (synthesized here, m->ops points at it) whose
 * hooks hand each question to the method that owns it:
 *
 *   prefill sequences' selections          PREFILL (select_layer / block_sparse)
 *   decode sequences' selections           DECODE
 *   auxiliary prefills (KVzip's replay)    DECODE only (its own business)
 *   scores, after_attn, layer_end          both, each with what it asked for
 *   prepare / finish_step                  both (PREFILL first; it never evicts)
 *   capacity, storage, rows, per-request
 *   state, snapshot / restore              DECODE
 *   knobs                                  the one whose table names it (both
 *                                          when both do: omnikv_full_layers)
 *
 * So with PREFILL at a budget that reads every token the pair is bit-identical
 * to DECODE alone (tests/test_sparse_conformance.c runs every pair). When both
 * build selections on the backend in one step (omnikv_prefill + quest, a
 * mixed prefill / decode step), the two device lists are gathered into one
 * with two select_expand calls (no host sync).
 *
 * Pairs that cannot work are refused with the reason (lethe_sparse_combine):
 * a block-sparse PREFILL needs DECODE's K / V in the backend's native pools
 * (no kv_format, no kv_layout: quantized and compressed KV attend through
 * their own kernels), a select_layer PREFILL needs shared rows and native KV
 * (its device selections index the one row every layer shares). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/sparse.h"

typedef struct combo {
    lethe_sparse_ops ops;      /* the pair's table (m->ops) */
    char name[96], summary[256];
    lethe_sparse_knob knobs[2 * LETHE_SPARSE_MAX_KNOBS];
    lethe_sparse_method *pm, *dm; /* PREFILL, DECODE (their own env, knobs, priv) */
    const lethe_sparse_step *st; /* the engine's step (prepare .. finish_step); an auxiliary
                                  * prefill swaps its own view into it */
    bool p_scores, d_scores;   /* what each answered to needs_scores for the current layer */
    int32_t *sel_begin, cap_seqs; /* merged selections (both BUILT) */
    lethe_expand_seq *ex;
    lethe_dev_buf sel;
} combo;
#define C(m) ((combo *)(m)->priv)

/* ---- splitting and checking a PREFILL+DECODE name ---- */

lethe_status lethe_sparse_combine(const char *name, const lethe_sparse_ops **prefill,
                                  const lethe_sparse_ops **decode) {
    *prefill = *decode = NULL;
    const char *plus = name ? strchr(name, '+') : NULL;
    if (!plus) {
        const lethe_sparse_ops *o = lethe_sparse_find(name);
        if (!o) return LETHE_ERR_NOT_FOUND;
        if (o->flags & LETHE_SPARSE_PREFILL_AXIS) *prefill = o;
        else *decode = o;
        return LETHE_OK;
    }
    char a[64];
    const size_t na = (size_t)(plus - name);
    if (na == 0 || na >= sizeof(a) || !plus[1] || strchr(plus + 1, '+'))
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-method %s: expected PREFILL+DECODE, two method "
                            "names (e.g. flashprefill+snapkv)", name);
    memcpy(a, name, na);
    a[na] = '\0';
    const lethe_sparse_ops *p = lethe_sparse_find(a), *d = p ? lethe_sparse_find(plus + 1) : NULL;
    if (!p || !d) return LETHE_ERR_NOT_FOUND;
    const bool pa = (p->flags & LETHE_SPARSE_PREFILL_AXIS) != 0, da = (d->flags & LETHE_SPARSE_PREFILL_AXIS) != 0;
    if (!pa && da)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-method %s: the prefill method comes first: %s+%s",
                            name, d->name, p->name);
    if (!pa)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-method %s: %s is not a prefill method (the first "
                            "name must be one: flashprefill, omnikv_prefill)", name, p->name);
    if (da)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-method %s: %s is a prefill method too; the second "
                            "name is the decode method (dense, snapkv, quest, ...)", name, d->name);
    const bool native = !d->kv_format && !d->kv_layout;
    if (p->block_sparse && !native)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "--sparse-method %s: %s's block-sparse prefill reads the "
                            "backend's native K / V, and %s stores its own format (%s)", name, p->name,
                            d->name, d->kv_format ? "quantized KV" : "a payload of its own");
    if (p->select_layer && (!native || (d->flags & LETHE_SPARSE_PER_LAYER_ROWS)))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "--sparse-method %s: %s builds device selections over "
                            "the one row every layer shares, and %s %s", name, p->name, d->name,
                            native ? "keeps a row per layer (per-layer eviction)"
                                   : "stores its own KV format");
    *prefill = p;
    *decode = d;
    return LETHE_OK;
}

const lethe_sparse_ops *lethe_sparse_find_kv(const char *name) {
    const lethe_sparse_ops *p, *d;
    if (lethe_sparse_combine(name, &p, &d) != LETHE_OK) return NULL;
    return d ? d : p;
}

/* ---- the hooks ---- */

static bool aux_step(const lethe_sparse_step *st) {
    for (int32_t i = 0; i < st->n_seqs; i++)
        if (st->seqs[i].is_aux) return true;
    return false;
}

/* the engine sets env.pool after creation; the children read theirs */
static void sync(lethe_sparse_method *m) {
    combo *c = C(m);
    c->pm->env.pool = c->dm->env.pool = m->env.pool;
}

static lethe_status cb_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    combo *c = C(m);
    lethe_status st = LETHE_OK;
    bool known = false;
    lethe_sparse_method *ch[2] = {c->pm, c->dm};
    for (int i = 0; i < 2 && st == LETHE_OK; i++)
        for (int32_t k = 0; k < ch[i]->ops->n_knob_table; k++)
            if (!strcmp(ch[i]->ops->knob_table[k].name, key)) {
                known = true;
                st = ch[i]->ops->set_knob(ch[i], key, value);
                break;
            }
    LETHE_ASSERT(known); /* parse_config checked the combined table */
    return st;
}

static lethe_status cb_configure(lethe_sparse_method *m) {
    combo *c = C(m);
    c->pm->knobs = c->dm->knobs = m->knobs; /* the shared knobs: parsed into the pair */
    lethe_status st = c->pm->ops->configure ? c->pm->ops->configure(c->pm) : LETHE_OK;
    if (st == LETHE_OK && c->dm->ops->configure) st = c->dm->ops->configure(c->dm);
    return st;
}

static void cb_destroy(lethe_sparse_method *m) {
    combo *c = C(m);
    if (!c) return;
    lethe_sparse_destroy(c->pm);
    lethe_sparse_destroy(c->dm);
    if (c->sel.p) lethe_dev_buf_free(m, &c->sel);
    free(c->sel_begin);
    free(c->ex);
    free(c);
    m->priv = NULL;
}

static int32_t cb_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt, int32_t n_total,
                               int32_t chunk) {
    return lethe_sparse_max_resident(C(m)->dm, layer, n_prompt, n_total, chunk);
}
static int32_t cb_min_final_chunk(const lethe_sparse_method *m) {
    return LETHE_MAX(lethe_sparse_min_final_chunk(C(m)->pm), lethe_sparse_min_final_chunk(C(m)->dm));
}
static int32_t cb_prefill_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s, int32_t n_resident,
                               int32_t n_chunk) {
    return lethe_sparse_prefill_peak(C(m)->dm, s, n_resident, n_chunk);
}
static size_t cb_slot_overhead(const lethe_sparse_method *m) { return lethe_sparse_slot_overhead(C(m)->dm); }
static size_t cb_kv_reserve(lethe_sparse_method *m, int32_t n_seqs, int32_t n_tokens) {
    return lethe_sparse_kv_reserve(C(m)->dm, n_seqs, n_tokens);
}
static const lethe_block_sparse *cb_block_sparse(const lethe_sparse_method *m, int32_t layer,
                                                 const lethe_sparse_step *st) {
    const lethe_sparse_method *p = C(m)->pm;
    return p->ops->block_sparse(p, layer, st);
}

static lethe_status cb_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    sync(m);
    return C(m)->dm->ops->request_init(C(m)->dm, s, state);
}
static void cb_request_finished(lethe_sparse_method *m, void *state) {
    C(m)->dm->ops->request_finished(C(m)->dm, state);
}
static size_t cb_snapshot(lethe_sparse_method *m, const void *state, void *buf, size_t cap) {
    return C(m)->dm->ops->snapshot(C(m)->dm, state, buf, cap);
}
static lethe_status cb_restore(lethe_sparse_method *m, void *state, const void *buf, size_t n) {
    sync(m);
    return C(m)->dm->ops->restore(C(m)->dm, state, buf, n);
}

static void cb_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    combo *c = C(m);
    sync(m);
    c->st = st;
    if (c->pm->ops->prepare) c->pm->ops->prepare(c->pm, st);
    if (c->dm->ops->prepare) c->dm->ops->prepare(c->dm, st);
}
static void cb_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    combo *c = C(m);
    sync(m);
    if (c->pm->ops->finish_step) c->pm->ops->finish_step(c->pm, st);
    if (c->dm->ops->finish_step) c->dm->ops->finish_step(c->dm, st); /* may run an aux prefill */
    c->st = NULL;
}

/* PREFILL takes part in this step's layers: not in an auxiliary prefill */
static bool prefill_on(const combo *c, const lethe_sparse_step *st) { return !st || !aux_step(st); }

/* asked once per layer while its plan is built (engine_forward.c), so the
 * answers hold for the after_attn that follows */
static bool cb_needs_scores(lethe_sparse_method *m, int32_t layer) {
    combo *c = C(m);
    c->p_scores = prefill_on(c, c->st) && c->pm->ops->needs_scores && c->pm->ops->needs_scores(c->pm, layer);
    c->d_scores = c->dm->ops->needs_scores && c->dm->ops->needs_scores(c->dm, layer);
    return c->p_scores || c->d_scores;
}
static void cb_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                          const lethe_attn_args *attn) {
    combo *c = C(m);
    if (prefill_on(c, st) && c->pm->ops->after_attn)
        c->pm->ops->after_attn(c->pm, layer, st, attn && c->p_scores ? attn : NULL);
    if (c->dm->ops->after_attn) c->dm->ops->after_attn(c->dm, layer, st, attn && c->d_scores ? attn : NULL);
    c->p_scores = c->d_scores = false;
}
static void cb_layer_end(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st) {
    combo *c = C(m);
    if (prefill_on(c, st) && c->pm->ops->layer_end) c->pm->ops->layer_end(c->pm, layer, st);
    if (c->dm->ops->layer_end) c->dm->ops->layer_end(c->dm, layer, st);
}

/* per-sequence selections: a prompt chunk is PREFILL's (when it has a
 * builder), a decode token and an auxiliary prefill DECODE's */
static int32_t cb_prefill_selection(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                    int32_t seq, int32_t *sel, int32_t cap) {
    combo *c = C(m);
    if (!st->seqs[seq].is_aux && c->pm->ops->build_prefill_selection)
        return c->pm->ops->build_prefill_selection(c->pm, layer, st, seq, sel, cap);
    return lethe_sparse_build_selection(c->dm, layer, st, seq, NULL, sel, cap);
}
static int32_t cb_decode_selection(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                   int32_t seq, const void *q, int32_t *sel, int32_t cap) {
    return lethe_sparse_build_selection(C(m)->dm, layer, st, seq, q, sel, cap);
}

/* One child's select_layer answer; without the hook: FULL when its
 * per-sequence builders would read whole rows for this step, else PER_SEQ. */
static lethe_sel_result child_select(lethe_sparse_method *ch, bool prefill_side, int32_t layer,
                                     const lethe_sparse_step *st, const void *q, const lethe_step_rows *rows,
                                     const int32_t **sb, const int32_t **ss) {
    if (ch->ops->select_layer) return ch->ops->select_layer(ch, layer, st, q, rows, sb, ss);
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const bool pre = st->seqs[i].is_prefill;
        if (prefill_side ? pre && ch->ops->build_prefill_selection
                         : (pre ? ch->ops->build_prefill_selection != NULL : ch->ops->build_decode_selection != NULL))
            return LETHE_SEL_PER_SEQ;
    }
    return LETHE_SEL_FULL;
}

/* Both sides built device selections: sequence s's list from PREFILL's
 * (a prompt chunk) or DECODE's (the others), gathered into c->sel. Each side
 * read whole rows for the sequences it does not own, so either list holds a
 * valid selection; this only picks the owner's. With per-KV-head lists from
 * DECODE (heads > 1: LETHE_SEL_BUILT_HEADS, [S * heads + 1] begins) every
 * sequence gets `heads` lists: a prompt chunk's one selection for each head. */
static lethe_sel_result merge(lethe_sparse_method *m, const lethe_sparse_step *st, const int32_t *pb,
                              const int32_t *ps, const int32_t *db, const int32_t *ds, int32_t heads,
                              const int32_t **sel_begin, const int32_t **sel_slots) {
    combo *c = C(m);
    const int32_t S = st->n_seqs, NS = S * heads;
    if (NS > c->cap_seqs) {
        c->cap_seqs = LETHE_MAX(NS, 2 * c->cap_seqs);
        c->sel_begin = lethe_xrealloc(c->sel_begin, ((size_t)c->cap_seqs + 1) * sizeof(int32_t));
        c->ex = lethe_xrealloc(c->ex, (size_t)c->cap_seqs * sizeof(*c->ex));
    }
    /* c->ex: PREFILL's lists first (n_p of them), then DECODE's; out_begin
     * holds the list index until the offsets are known */
    int32_t n = 0, n_p = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < S; i++) {
            const bool from_p = st->seqs[i].is_prefill;
            if (from_p != (pass == 0)) continue;
            for (int32_t h = 0; h < heads; h++) {
                const int32_t li = from_p ? i : i * heads + h; /* the list in its side's begins */
                const int32_t *b = from_p ? pb : db;
                c->ex[n++] = (lethe_expand_seq){.row_begin = b[li], .row_len = b[li + 1] - b[li],
                                                .out_begin = i * heads + h};
                n_p += from_p;
            }
        }
    int32_t off = 0;
    for (int32_t k = 0; k < NS; k++) {
        const int32_t i = k / heads, li = st->seqs[i].is_prefill ? i : k;
        const int32_t *b = st->seqs[i].is_prefill ? pb : db;
        c->sel_begin[k] = off;
        off += b[li + 1] - b[li];
    }
    c->sel_begin[NS] = off;
    for (int32_t k = 0; k < n; k++) c->ex[k].out_begin = c->sel_begin[c->ex[k].out_begin];
    if (lethe_dev_buf_reserve(m, &c->sel, (size_t)off * sizeof(int32_t)) != LETHE_OK)
        return LETHE_SEL_FULL; /* (reading more than needed is always correct) */
    lethe_backend *be = m->env.be;
    /* head = pick_off = tail = 0, no picks: each list is copied whole */
    if (n_p) be->ops->select_expand(be, c->sel.p, ps, ps, c->ex, n_p, 1);
    if (n > n_p) be->ops->select_expand(be, c->sel.p, ds, ds, c->ex + n_p, n - n_p, 1);
    *sel_begin = c->sel_begin;
    *sel_slots = c->sel.p;
    return heads > 1 ? LETHE_SEL_BUILT_HEADS : LETHE_SEL_BUILT;
}

static lethe_sel_result cb_select_layer(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                        const void *q, const lethe_step_rows *rows, const int32_t **sel_begin,
                                        const int32_t **sel_slots) {
    combo *c = C(m);
    const int32_t *pb = NULL, *ps = NULL, *db = NULL, *ds = NULL;
    const lethe_sel_result rp = prefill_on(c, st) ? child_select(c->pm, true, layer, st, q, rows, &pb, &ps)
                                                  : LETHE_SEL_FULL;
    const lethe_sel_result rd = child_select(c->dm, false, layer, st, q, rows, &db, &ds);
    LETHE_ASSERT(rp != LETHE_SEL_BUILT_HEADS); /* prefill-axis methods build one list per sequence */
    if (rp == LETHE_SEL_PER_SEQ || rd == LETHE_SEL_PER_SEQ) return LETHE_SEL_PER_SEQ;
    if (rp == LETHE_SEL_FULL && rd == LETHE_SEL_FULL) return LETHE_SEL_FULL;
    if (rp == LETHE_SEL_FULL || rd == LETHE_SEL_FULL) {
        *sel_begin = rp != LETHE_SEL_FULL ? pb : db;
        *sel_slots = rp != LETHE_SEL_FULL ? ps : ds;
        return rp != LETHE_SEL_FULL ? rp : rd;
    }
    return merge(m, st, pb, ps, db, ds, rd == LETHE_SEL_BUILT_HEADS ? m->env.n_kv_heads : 1, sel_begin,
                 sel_slots);
}

/* ---- the pair's table ---- */

static lethe_status cb_init(lethe_sparse_method *m) { (void)m; return LETHE_OK; } /* children: below */

/* the union of both knob tables (a name both use appears once: set_knob
 * sets it in both) */
static int32_t merge_knobs(combo *c, const lethe_sparse_ops *p, const lethe_sparse_ops *d) {
    int32_t n = 0;
    const lethe_sparse_ops *side[2] = {p, d};
    for (int i = 0; i < 2; i++)
        for (int32_t k = 0; k < side[i]->n_knob_table; k++) {
            bool dup = false;
            for (int32_t j = 0; j < n; j++) dup |= !strcmp(c->knobs[j].name, side[i]->knob_table[k].name);
            if (!dup) c->knobs[n++] = side[i]->knob_table[k];
        }
    return n;
}

static void build_table(combo *c, const lethe_sparse_ops *p, const lethe_sparse_ops *d) {
    lethe_sparse_ops *o = &c->ops;
    snprintf(c->name, sizeof(c->name), "%s+%s", p->name, d->name);
    snprintf(c->summary, sizeof(c->summary), "prefill: %s; decode: %s", p->name, d->name);
    *o = (lethe_sparse_ops){.name = c->name, .summary = c->summary};
    const bool dense = d->kind == LETHE_SPARSE_KIND_DENSE;
    o->kind = dense ? p->kind : d->kind;
    /* DECODE's rows and storage; never UNIFORM (PREFILL plans per layer), and
     * radix prefix reuse only when both allow it */
    o->flags = (d->flags & ~(unsigned)LETHE_SPARSE_UNIFORM & ~(unsigned)LETHE_SPARSE_PREFIX_CACHE) |
               (d->flags & p->flags & LETHE_SPARSE_PREFIX_CACHE);
    o->shared_knobs = p->shared_knobs | d->shared_knobs;
    o->n_knob_table = merge_knobs(c, p, d);
    o->knob_table = o->n_knob_table ? c->knobs : NULL;
    o->test_configs = dense ? p->test_configs : d->test_configs;
    o->test_configs.identity_on_backend = o->test_configs.identity_on_backend && (p->select_layer || d->select_layer);
    o->max_resident = d->max_resident ? cb_max_resident : NULL;
    o->min_final_chunk = p->min_final_chunk || d->min_final_chunk ? cb_min_final_chunk : NULL;
    o->prefill_peak_slots = d->prefill_peak_slots ? cb_prefill_peak : NULL;
    o->slot_overhead_bytes = d->slot_overhead_bytes ? cb_slot_overhead : NULL;
    o->kv_reserve_bytes = d->kv_reserve_bytes ? cb_kv_reserve : NULL;
    o->page_meta_floats = d->page_meta_floats;
    o->block_sparse = p->block_sparse ? cb_block_sparse : NULL;
    o->hybrid_refusal = p->hybrid_refusal ? p->hybrid_refusal : d->hybrid_refusal;
    o->init = cb_init;
    o->configure = cb_configure;
    o->destroy = cb_destroy;
    o->set_knob = o->n_knob_table ? cb_set_knob : NULL;
    o->request_init = d->request_init ? cb_request_init : NULL;
    o->request_finished = d->request_finished ? cb_request_finished : NULL;
    o->snapshot = d->snapshot ? cb_snapshot : NULL;
    o->restore = d->restore ? cb_restore : NULL;
    o->prepare = cb_prepare;
    o->finish_step = cb_finish;
    o->needs_scores = p->needs_scores || d->needs_scores ? cb_needs_scores : NULL;
    o->after_attn = p->after_attn || d->after_attn ? cb_after_attn : NULL;
    o->layer_end = p->layer_end || d->layer_end ? cb_layer_end : NULL;
    o->select_layer = p->select_layer || d->select_layer ? cb_select_layer : NULL;
    o->build_prefill_selection = p->build_prefill_selection || d->build_prefill_selection ? cb_prefill_selection : NULL;
    o->build_decode_selection = d->build_decode_selection ? cb_decode_selection : NULL;
}

/* a child method after init, before its knobs (lethe_sparse_create's first half) */
static lethe_status child_new(const lethe_sparse_ops *o, const lethe_sparse_env *env, lethe_sparse_method **out) {
    lethe_sparse_method *m = lethe_xcalloc(1, sizeof(*m));
    m->ops = o;
    m->env = *env;
    lethe_sparse_knobs_default(&m->knobs);
    lethe_status st = o->init ? o->init(m) : LETHE_OK;
    if (st != LETHE_OK) {
        lethe_sparse_destroy(m);
        return st;
    }
    *out = m;
    return LETHE_OK;
}

lethe_status lethe_sparse_create_combined(const lethe_sparse_ops *p, const lethe_sparse_ops *d, const char *config,
                                          const lethe_sparse_env *env, lethe_sparse_method **out) {
    *out = NULL;
    combo *c = lethe_xcalloc(1, sizeof(*c));
    build_table(c, p, d);
    /* the contract's rules for the synthesized table (its name has a '+',
     * which canonical names do not: checked under a plain spelling) */
    lethe_sparse_ops chk = c->ops;
    char plain[96];
    snprintf(plain, sizeof(plain), "%s_%s", p->name, d->name);
    chk.name = plain;
    lethe_status st = lethe_sparse_validate(&chk);
    if (st != LETHE_OK) {
        free(c);
        return st;
    }
    lethe_sparse_method *m = lethe_xcalloc(1, sizeof(*m));
    m->ops = &c->ops;
    m->env = *env;
    m->priv = c;
    lethe_sparse_knobs_default(&m->knobs);
    /* the children: their own init now, their knobs and configure through ours */
    if ((st = child_new(p, env, &c->pm)) == LETHE_OK) st = child_new(d, env, &c->dm);
    if (st == LETHE_OK) st = lethe_sparse_parse_config(m, config);
    if (st == LETHE_OK) st = cb_configure(m);
    if (st != LETHE_OK) {
        lethe_sparse_destroy(m);
        return st;
    }
    *out = m;
    return LETHE_OK;
}

/* sparse_common.c - helpers every sparse method shares on top of the contract:
 * typed knob tables (defaults, parsing with bounds, lookup), the hooks with
 * their defaults applied (selection, capacity questions), host access to stored K/V (CPU backend),
 * the attn_scores call, entry -> slot conversion, and row-aligned score vectors that follow
 * compaction (with their chain-cache snapshot format). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/select_util.h"
#include "sparse/sparse.h"

/* Hybrid models: the method sees the full-attention layers only (the pool,
 * the hooks and env.n_layers count them alone, kv_pool.h), so rows per
 * layer or per KV head, budgets per layer and payloads of its own all apply.
 * What cannot is declared by the method (ops->hybrid_refusal; e.g. an output
 * projection of its own). */
const char *lethe_sparse_hybrid_refusal(const lethe_sparse_ops *ops) {
    return ops ? ops->hybrid_refusal : NULL;
}

const char *lethe_sparse_hybrid_refusal_of(const char *name, const lethe_sparse_ops **who) {
    *who = NULL;
    const char *plus = name ? strchr(name, '+') : NULL;
    char first[64];
    const char *names[2] = {name, NULL};
    if (plus) { /* each method of a PREFILL+DECODE pair, whether the pair combines or not */
        const size_t n = (size_t)(plus - name);
        if (n >= sizeof(first)) return NULL;
        memcpy(first, name, n);
        first[n] = '\0';
        names[0] = first;
        names[1] = plus + 1;
    }
    for (int i = 0; i < 2 && names[i]; i++) {
        const lethe_sparse_ops *o = lethe_sparse_find(names[i]);
        if (o && o->hybrid_refusal) {
            *who = o;
            return o->hybrid_refusal;
        }
    }
    return NULL;
}

const char *lethe_sparse_kind_name(lethe_sparse_kind k) {
    switch (k) {
    case LETHE_SPARSE_KIND_DENSE: return "dense";
    case LETHE_SPARSE_KIND_EVICTION: return "eviction";
    case LETHE_SPARSE_KIND_SELECTION: return "selection";
    case LETHE_SPARSE_KIND_QUANTIZATION: return "quantization";
    case LETHE_SPARSE_KIND_COMPRESSION: return "compression";
    }
    return "?";
}

static int32_t knob_index(const lethe_sparse_ops *o, const char *name) {
    for (int32_t i = 0; i < o->n_knob_table; i++)
        if (!strcmp(o->knob_table[i].name, name)) return i;
    return -1;
}

static lethe_status set_value(const lethe_sparse_ops *o, int32_t i, lethe_knob_values *v,
                              const char *val) {
    const lethe_sparse_knob *k = &o->knob_table[i];
    if (strlen(val) >= sizeof(v->str[i]))
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config %s=%s: value too long (method %s)",
                            k->name, val, o->name);
    double x = 0;
    if (k->type == LETHE_KNOB_BOOL) {
        if (!strcmp(val, "true") || !strcmp(val, "1") || !strcmp(val, "on")) x = 1;
        else if (!strcmp(val, "false") || !strcmp(val, "0") || !strcmp(val, "off")) x = 0;
        else
            return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config %s=%s: expected true or false "
                                "(method %s)", k->name, val, o->name);
    } else if (k->type != LETHE_KNOB_STR) {
        char *end;
        errno = 0;
        x = strtod(val, &end);
        if (end == val || *end || errno || !isfinite(x) || (k->type == LETHE_KNOB_INT && x != floor(x)))
            return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config %s=%s: expected %s (method %s)",
                                k->name, val, k->type == LETHE_KNOB_INT ? "an integer" : "a number",
                                o->name);
        if (x < k->min || x > k->max)
            return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config %s=%s: outside [%g, %g] (method %s)",
                                k->name, val, k->min, k->max, o->name);
    }
    v->num[i] = x;
    snprintf(v->str[i], sizeof(v->str[i]), "%s", val);
    return LETHE_OK;
}

void lethe_knobs_defaults(const lethe_sparse_ops *o, lethe_knob_values *v) {
    LETHE_ASSERT(o->n_knob_table <= LETHE_SPARSE_MAX_KNOBS);
    memset(v, 0, sizeof(*v));
    for (int32_t i = 0; i < o->n_knob_table; i++) {
        lethe_status st = set_value(o, i, v, o->knob_table[i].def);
        LETHE_ASSERT(st == LETHE_OK); /* a default outside its own bounds is a bug */
    }
}

lethe_status lethe_knobs_set(const lethe_sparse_ops *o, lethe_knob_values *v, const char *key,
                             const char *value) {
    int32_t i = knob_index(o, key);
    if (i < 0)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config: unknown knob '%s' for method %s",
                            key, o->name);
    return set_value(o, i, v, value);
}

double lethe_knob_num(const lethe_sparse_ops *o, const lethe_knob_values *v, const char *name) {
    int32_t i = knob_index(o, name);
    LETHE_ASSERT(i >= 0);
    return v->num[i];
}

const char *lethe_knob_str(const lethe_sparse_ops *o, const lethe_knob_values *v, const char *name) {
    int32_t i = knob_index(o, name);
    LETHE_ASSERT(i >= 0);
    return v->str[i];
}

int32_t lethe_sparse_prefill_peak(const lethe_sparse_method *m, const lethe_sparse_seq *s,
                                  int32_t n_resident, int32_t n_chunk) {
    if (m && m->ops->prefill_peak_slots) return m->ops->prefill_peak_slots(m, s, n_resident, n_chunk);
    return n_chunk;
}

lethe_status lethe_sparse_aux_prefill(lethe_sparse_method *m, const lethe_sparse_seq *s,
                                      const int32_t *tokens, int32_t n) {
    if (!m->env.aux_prefill)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "sparse method %s: no auxiliary prefill here (no engine)",
                            m->ops->name);
    LETHE_ASSERT(n >= 0 && s && !s->is_aux);
    return m->env.aux_prefill(m->env.aux_ctx, s, tokens, n);
}

int32_t lethe_sparse_select_all(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                int32_t *sel, int32_t cap) {
    int32_t sp = lethe_kv_space_of(m->env.pool, layer);
    int32_t n = lethe_kv_row_len(m->env.pool, sp, row);
    LETHE_ASSERT(n <= cap);
    memcpy(sel, lethe_kv_row_slots(m->env.pool, sp, row), (size_t)n * sizeof(int32_t));
    return n;
}

int32_t lethe_sparse_build_selection(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                                     int32_t seq, const void *q, int32_t *sel, int32_t cap) {
    if (st->seqs[seq].is_prefill) {
        if (m->ops->build_prefill_selection) return m->ops->build_prefill_selection(m, layer, st, seq, sel, cap);
    } else if (m->ops->build_decode_selection) {
        return m->ops->build_decode_selection(m, layer, st, seq, q, sel, cap);
    }
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

int32_t lethe_sparse_min_final_chunk(const lethe_sparse_method *m) {
    return m && m->ops->min_final_chunk ? m->ops->min_final_chunk(m) : 0;
}

int32_t lethe_sparse_max_resident(const lethe_sparse_method *m, int32_t layer, int32_t n_prompt,
                                  int32_t n_total, int32_t chunk) {
    if (m && m->ops->max_resident) return m->ops->max_resident(m, layer, n_prompt, n_total, chunk);
    return n_total;
}

size_t lethe_sparse_slot_overhead(const lethe_sparse_method *m) {
    return m && m->ops->slot_overhead_bytes ? m->ops->slot_overhead_bytes(m) : 0;
}

size_t lethe_sparse_kv_reserve(lethe_sparse_method *m, int32_t max_num_seqs, int32_t max_num_batched_tokens) {
    return m && m->ops->kv_reserve_bytes ? m->ops->kv_reserve_bytes(m, max_num_seqs, max_num_batched_tokens) : 0;
}

bool lethe_sparse_kv_layouts(const lethe_sparse_method *m, lethe_kv_layout *out) {
    if (!m || !m->ops->kv_layout) return false;
    memset(out, 0, sizeof(*out) * (size_t)m->env.n_layers);
    if (!m->ops->kv_layout(m, 0, &out[0])) return false;
    for (int32_t l = 1; l < m->env.n_layers; l++) {
        const bool has = m->ops->kv_layout(m, l, &out[l]);
        LETHE_ASSERT(has); /* a layout for layer 0 means one for every layer */
    }
    return true;
}

static void path_store(void *ctx, int32_t layer, const void *k, const void *v, const int32_t *slots,
                       const int32_t *pos, int32_t n) {
    lethe_sparse_method *m = ctx;
    m->ops->kv_store(m, layer, k, v, slots, pos, n);
}
static void path_attend(void *ctx, int32_t layer, const lethe_attn_args *a) {
    lethe_sparse_method *m = ctx;
    m->ops->kv_attend(m, layer, a);
}
static const void *path_out_proj(void *ctx, int32_t layer) {
    lethe_sparse_method *m = ctx;
    return m->ops->kv_out_proj(m, layer);
}

const lethe_kv_path *lethe_sparse_kv_path(lethe_sparse_method *m) {
    if (!m || !m->env.pool || !lethe_kv_has_layout(m->env.pool) || !m->ops->kv_layout) return NULL;
    m->path = (lethe_kv_path){
        .ctx = m, .k_pre_rope = (m->ops->flags & LETHE_SPARSE_KV_PRE_ROPE) != 0,
        .store = path_store, .attend = path_attend,
        .out_proj = m->ops->kv_out_proj ? path_out_proj : NULL,
    };
    return &m->path;
}

bool lethe_sparse_kv_host_ok(const lethe_sparse_method *m) {
    const lethe_backend *be = m->env.be;
    return lethe_backend_has(be, LETHE_BE_HOST_MEMORY) && be->ops->kv_size == sizeof(float);
}

lethe_kv_format lethe_sparse_kv_format(const lethe_sparse_method *m) {
    return m && m->ops->kv_format ? m->ops->kv_format(m) : LETHE_KV_NATIVE;
}

float *lethe_sparse_kv_host(const lethe_sparse_method *m, int32_t layer, bool value) {
    if (!lethe_sparse_kv_host_ok(m) || !m->env.pool) return NULL;
    if (lethe_kv_format_of(m->env.pool) != LETHE_KV_NATIVE) return NULL; /* codes, not f32 */
    if (lethe_kv_has_layout(m->env.pool)) return NULL;                 /* the method's payload */
    return value ? lethe_kv_v(m->env.pool, layer) : lethe_kv_k(m->env.pool, layer);
}

static bool scores_to(const lethe_sparse_method *m, const lethe_attn_args *attn,
                      const lethe_score_seq *req, int32_t n, int32_t n_groups, float *out,
                      bool on_backend) {
    lethe_backend *be = m->env.be;
    if (!attn || !attn->q || !be || n == 0) return false;
    /* attn_scores reads K in the backend's kv type (no quantized-format path yet) */
    LETHE_ASSERT(!attn->kvq || attn->kvq->format == LETHE_KV_NATIVE);
    lethe_attn_scores_args a = {
        .out = out, .q = attn->q, .k_cache = attn->k_cache, .n_tokens = attn->n_tokens,
        .n_seqs = n, .seqs = req, .key_slots = attn->sel_slots,
        .n_key_slots = attn->sel_begin[attn->n_seqs], .n_heads = attn->n_heads,
        .n_kv_heads = attn->n_kv_heads, .head_dim = attn->head_dim, .n_groups = n_groups,
        .scale = attn->scale, .out_on_backend = on_backend,
    };
    be->ops->attn_scores(be, &a);
    return true;
}

bool lethe_sparse_scores(const lethe_sparse_method *m, const lethe_attn_args *attn,
                         const lethe_score_seq *req, int32_t n, int32_t n_groups, float *out) {
    return scores_to(m, attn, req, n, n_groups, out, false);
}

bool lethe_sparse_scores_on_backend(const lethe_sparse_method *m, const lethe_attn_args *attn,
                                    const lethe_score_seq *req, int32_t n, int32_t n_groups,
                                    float *out) {
    return scores_to(m, attn, req, n, n_groups, out, true);
}

lethe_status lethe_dev_buf_reserve(const lethe_sparse_method *m, lethe_dev_buf *b, size_t bytes) {
    lethe_backend *be = m->env.be;
    LETHE_ASSERT(be);
    if (bytes <= b->cap && b->p) return LETHE_OK;
    size_t cap = bytes + bytes / 4 + 256;
    void *p = NULL;
    lethe_status st = be->ops->alloc(be, cap, &p);
    if (st != LETHE_OK) return st;
    if (b->p) {
        be->ops->release(be, b->p);
        /* captured decode graphs (sparse.h graph_step) may hold the old address */
        be->ops->graph_reset(be);
    }
    b->p = p;
    b->cap = cap;
    return LETHE_OK;
}

void lethe_dev_buf_free(const lethe_sparse_method *m, lethe_dev_buf *b) {
    if (b->p) m->env.be->ops->release(m->env.be, b->p);
    b->p = NULL;
    b->cap = 0;
}

void lethe_sparse_entries_to_slots(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                   int32_t *sel, int32_t n) {
    int32_t sp = lethe_kv_space_of(m->env.pool, layer);
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, sp, row);
    int32_t len = lethe_kv_row_len(m->env.pool, sp, row);
    int32_t prev = -1;
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(sel[i] > prev && sel[i] < len); /* ascending entries of the row */
        prev = sel[i];
        sel[i] = slots[sel[i]];
    }
}

void lethe_rowvec_resize(lethe_rowvec *r, int32_t n, float fill) {
    if (n > r->cap) {
        int32_t cap = r->cap ? r->cap : 64;
        while (cap < n) cap *= 2;
        r->v = lethe_xrealloc(r->v, (size_t)cap * sizeof(float));
        r->cap = cap;
    }
    for (int32_t i = r->n; i < n; i++) r->v[i] = fill;
    r->n = n;
}

void lethe_rowvec_keep(lethe_rowvec *r, const int32_t *keep, int32_t n) {
    LETHE_ASSERT(n <= r->n);
    lethe_gather_f32(r->v, r->v, keep, n);
    r->n = n;
}

void lethe_rowvec_free(lethe_rowvec *r) {
    free(r->v);
    memset(r, 0, sizeof(*r));
}

size_t lethe_rowvecs_save(const lethe_rowvec *r, int32_t n_vecs, void *buf, size_t cap) {
    size_t need = 0;
    for (int32_t i = 0; i < n_vecs; i++) need += sizeof(int32_t) + (size_t)r[i].n * sizeof(float);
    if (!buf || cap < need) return need;
    char *p = buf;
    for (int32_t i = 0; i < n_vecs; i++) {
        memcpy(p, &r[i].n, sizeof(int32_t));
        p += sizeof(int32_t);
        if (r[i].n) memcpy(p, r[i].v, (size_t)r[i].n * sizeof(float));
        p += (size_t)r[i].n * sizeof(float);
    }
    return need;
}

lethe_status lethe_rowvecs_load(lethe_rowvec *r, int32_t n_vecs, const void *buf, size_t n) {
    const char *p = buf, *end = p + n;
    for (int32_t i = 0; i < n_vecs; i++) {
        int32_t len;
        if ((size_t)(end - p) < sizeof(int32_t)) goto bad;
        memcpy(&len, p, sizeof(int32_t));
        p += sizeof(int32_t);
        if (len < 0 || (size_t)(end - p) / sizeof(float) < (size_t)len) goto bad;
        r[i].n = 0;
        lethe_rowvec_resize(&r[i], len, 0.0f);
        if (len) memcpy(r[i].v, p, (size_t)len * sizeof(float));
        p += (size_t)len * sizeof(float);
    }
    if (p == end) return LETHE_OK;
bad:
    return lethe_errorf(LETHE_ERR_FORMAT, "sparse state snapshot: truncated or malformed (%zu bytes)", n);
}

int32_t lethe_sparse_keep_set(const lethe_sparse_method *m, int32_t layer, int32_t row,
                              const float *scores, int32_t s, int32_t r, int32_t k, int32_t *keep) {
    lethe_kv_pool *pool = m->env.pool;
    const int32_t sp = lethe_kv_space_of(pool, layer);
    const int32_t L = lethe_kv_row_len(pool, sp, row);
    const int32_t *prot = NULL;
    uint8_t *pin = NULL;
    if (lethe_kv_row_protected(pool, row, &prot) > 0) {
        pin = lethe_xmalloc((size_t)LETHE_MAX(L, 1));
        if (lethe_kv_row_pin_mask(pool, sp, row, pin) == 0) {
            free(pin);
            pin = NULL;
        }
    }
    int32_t n = lethe_keep_sink_recent_topk(scores, pin, L, s, r, k, keep);
    free(pin);
    return n;
}

int32_t lethe_sparse_keep_add_pins(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                   int32_t *keep, int32_t n) {
    lethe_kv_pool *pool = m->env.pool;
    const int32_t sp = lethe_kv_space_of(pool, layer);
    const int32_t L = lethe_kv_row_len(pool, sp, row);
    const int32_t *prot = NULL;
    if (L <= 0 || lethe_kv_row_protected(pool, row, &prot) <= 0) return n;
    uint8_t *mark = lethe_xmalloc((size_t)L);
    if (lethe_kv_row_pin_mask(pool, sp, row, mark) == 0) {
        free(mark);
        return n;
    }
    /* mark: 1 pinned, 2 kept (pinned or not) */
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(keep[i] >= 0 && keep[i] < L);
        mark[keep[i]] = 2;
    }
    int32_t k = 0;
    for (int32_t e = 0; e < L; e++)
        if (mark[e]) keep[k++] = e;
    free(mark);
    return k;
}

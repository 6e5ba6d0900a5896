/* kivi.c - KIVI (methods.md §15), asymmetric 2/4-bit KV quantization.
 *
 * The anchor's page layout: the row is cut into pages of kv_quant_page_size
 * tokens; a page is quantized when it completes, the incomplete tail page stays
 * full precision (the residual). Keys per CHANNEL over the page's tokens,
 * values per TOKEN in groups of kv_quant_page_size channels (quant.c). The
 * original keeps a separate residual of R = 128 full-precision tokens and
 * defaults to 2 bits; the anchor defaults to 4 bits.
 *
 * Storage seam (documented limitation): lethe's KV pool stores f32 (CPU) /
 * bf16 (CUDA) slots, and a per-method payload type is not in the pool yet. So
 * KIVI quantizes on store: after a layer's attention, every page completed by
 * this step is quantized and its dequantized values are written back into the
 * slots (host KV of the CPU backend; CUDA needs the twin). Attention then reads exactly the values a fused
 * dequantizing kernel would produce, but the memory is NOT reduced: the
 * numerics of KIVI, not its footprint. The tokens of a page that completes in
 * this step were attended in full precision during this step only.
 * kivi_bits = 16 is a passthrough (T0: equals dense). */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/quant.h"
#include "sparse/sparse.h"

typedef struct kivi_priv {
    lethe_knob_values kv;
    int32_t kv_dim, bits, page;
} kivi_priv;
#define PRIV(m) ((kivi_priv *)(m)->priv)

typedef struct kivi_state {
    int32_t *pages_done;        /* [n_layers] quantized leading pages */
} kivi_state;

static const lethe_sparse_knob knobs[] = {
    {"kivi_bits", LETHE_KNOB_INT, "4", 2, 16, "2 | 4 | 8 bits per element; 16 = passthrough"},
    {"kv_quant_page_size", LETHE_KNOB_INT, "32", 16, 128, "tokens per quantized page (power of two dividing head_dim)"},
};

static lethe_status kivi_init(lethe_sparse_method *m) {
    kivi_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void kivi_destroy(lethe_sparse_method *m) {
    free(m->priv);
    m->priv = NULL;
}
static lethe_status kivi_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status kivi_configure(lethe_sparse_method *m) {
    kivi_priv *p = PRIV(m);
    p->bits = (int32_t)lethe_knob_num(m->ops, &p->kv, "kivi_bits");
    p->page = (int32_t)lethe_knob_num(m->ops, &p->kv, "kv_quant_page_size");
    p->kv_dim = m->env.n_kv_heads * m->env.head_dim;
    if (p->bits != 2 && p->bits != 4 && p->bits != 8 && p->bits != 16)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config kivi_bits=%d: expected 2, 4, 8 or 16", p->bits);
    if ((p->page & (p->page - 1)) || m->env.head_dim % p->page)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config kv_quant_page_size=%d: must be a power "
                            "of two dividing head_dim %d", p->page, m->env.head_dim);
    if (m->env.be && p->bits != 16 && !lethe_sparse_kv_host_ok(m))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "--sparse-method kivi: the %s backend's KV is not "
                            "host-readable (the quantizer has no twin there yet)", m->env.be->ops->name);
    return LETHE_OK;
}

static lethe_status kivi_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    kivi_state *ks = lethe_xcalloc(1, sizeof(*ks));
    ks->pages_done = lethe_xcalloc((size_t)m->env.n_layers, sizeof(int32_t));
    *state = ks;
    return LETHE_OK;
}
static void kivi_request_finished(lethe_sparse_method *m, void *state) {
    kivi_state *ks = state;
    if (!ks) return;
    free(ks->pages_done);
    free(ks);
}

static size_t kivi_snapshot(lethe_sparse_method *m, const void *state, void *buf, size_t cap) {
    size_t n = (size_t)m->env.n_layers * sizeof(int32_t);
    if (buf && cap >= n) memcpy(buf, ((const kivi_state *)state)->pages_done, n);
    return n;
}
static lethe_status kivi_restore(lethe_sparse_method *m, void *state, const void *buf, size_t n) {
    if (n != (size_t)m->env.n_layers * sizeof(int32_t))
        return lethe_errorf(LETHE_ERR_FORMAT, "kivi state snapshot: %zu bytes, want %zu", n,
                            (size_t)m->env.n_layers * sizeof(int32_t));
    memcpy(((kivi_state *)state)->pages_done, buf, n);
    return LETHE_OK;
}

static int32_t kivi_prefill(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            int32_t seq, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}
static int32_t kivi_decode(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           int32_t seq, const void *q, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

/* quantize-dequantize one page: K, V rows of `slots` [P] in place */
static void qdq_page(const kivi_priv *p, float *K, float *V, const int32_t *slots, float *k, float *v) {
    int32_t P = p->page, C = p->kv_dim, b = p->bits;
    for (int32_t t = 0; t < P; t++) {
        memcpy(k + (size_t)t * C, K + (size_t)slots[t] * C, (size_t)C * sizeof(float));
        memcpy(v + (size_t)t * C, V + (size_t)slots[t] * C, (size_t)C * sizeof(float));
    }
    uint8_t *codes = lethe_xmalloc(lethe_kivi_code_bytes(P * C, b));
    float *sc = lethe_xmalloc((size_t)C * sizeof(float)), *zr = lethe_xmalloc((size_t)C * sizeof(float));
    lethe_kivi_quant_keys(k, P, C, b, codes, sc, zr);
    lethe_kivi_dequant_keys(codes, sc, zr, P, C, b, k);
    for (int32_t t = 0; t < P; t++) { /* per token, groups of P channels */
        lethe_kivi_quant_value(v + (size_t)t * C, C, P, b, codes, sc, zr);
        lethe_kivi_dequant_value(codes, sc, zr, C, P, b, v + (size_t)t * C);
    }
    for (int32_t t = 0; t < P; t++) {
        memcpy(K + (size_t)slots[t] * C, k + (size_t)t * C, (size_t)C * sizeof(float));
        memcpy(V + (size_t)slots[t] * C, v + (size_t)t * C, (size_t)C * sizeof(float));
    }
    free(zr);
    free(sc);
    free(codes);
}

static void kivi_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                            const lethe_attn_args *attn) {
    kivi_priv *p = PRIV(m);
    float *K = lethe_sparse_kv_host(m, layer, false), *V = lethe_sparse_kv_host(m, layer, true);
    if (p->bits == 16 || !K) return;
    size_t page_floats = (size_t)p->page * p->kv_dim;
    float *k = lethe_xmalloc(page_floats * sizeof(float)), *v = lethe_xmalloc(page_floats * sizeof(float));
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        kivi_state *ks = q->state;
        int32_t sp = lethe_kv_space_of(m->env.pool, layer);
        int32_t L = lethe_kv_row_len(m->env.pool, sp, q->row);
        const int32_t *slots = lethe_kv_row_slots(m->env.pool, sp, q->row);
        for (int32_t pg = ks->pages_done[layer]; (pg + 1) * p->page <= L; pg++) {
            qdq_page(p, K, V, slots + (size_t)pg * p->page, k, v);
            ks->pages_done[layer] = pg + 1;
        }
    }
    free(v);
    free(k);
}

const lethe_sparse_ops lethe_sparse_kivi = {
    .name = "kivi",
    .aliases = {NULL},
    .summary = "2/4-bit KV: per-channel keys, per-token values, full-precision tail page",
    .init = kivi_init,
    .destroy = kivi_destroy,
    .set_knob = kivi_set_knob,
    .request_init = kivi_request_init,
    .request_finished = kivi_request_finished,
    .snapshot = kivi_snapshot,
    .restore = kivi_restore,
    .build_prefill_selection = kivi_prefill,
    .build_decode_selection = kivi_decode,
    .after_attn = kivi_after_attn,
    .kind = LETHE_SPARSE_KIND_QUANTIZATION,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .configure = kivi_configure,
};

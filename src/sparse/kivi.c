/* kivi.c - KIVI (methods.md §15), asymmetric 2/4/8-bit KV quantization.
 *
 * Real storage (backend.h LETHE_KV_KIVI): the method declares the format
 * LETHE_KV_KIVI_FORMAT(b, G) (G = kv_quant_page_size) and the pool holds per
 * slot packed b-bit K and V codes + the token's V group params (per token,
 * groups of G channels), a K group table (per CHANNEL over a row's G
 * consecutive tokens), and a full-precision residual: each running request
 * owns one block of G residual entries where its incomplete tail group lives.
 * Host bookkeeping only lives here: `prepare` (once per step, before the
 * forward) writes the pool's KIVI plan: the host slot index slot_aux (slot ->
 * K group entry, or residual entry for tail tokens) and the groups that
 * complete this step (members from the residual or from this step's new
 * tokens); every layer's kv_store_quant then quantizes those groups and writes
 * the rest to the residual (backend/{cpu,cuda}/attention_quant), and attention
 * reads codes / residual directly. So a token is read quantized from the step
 * its group completes (also by its own prefill chunk) and full precision
 * before; the original keeps R = 128 residual tokens and defaults to 2 bits,
 * the anchor 4 bits. Bytes per token: kv_pool.h. kivi_bits = 16 is a
 * passthrough (NATIVE storage, equals dense).
 *
 * Rows are never compacted and the prefix cache is off for kivi, so row index
 * t of a request is its t-th token and a slot belongs to one group only. */
#include <stdlib.h>
#include <string.h>

#include "backend/kv_codec.h"
#include "core/util.h"
#include "sparse/sparse.h"

typedef struct kivi_priv {
    lethe_knob_values kv;
    int32_t kv_dim, bits, page;
    /* allocators (lazily sized from the pool): K group entries, residual blocks */
    int32_t n_groups, n_blocks;
    uint8_t *grp_used, *blk_used;
    int32_t grp_hint, blk_hint;
    /* the step plan's arrays */
    int32_t *pack_src, *pack_slot, *pack_entry;
    int32_t cap_pack;
} kivi_priv;
#define PRIV(m) ((kivi_priv *)(m)->priv)

typedef struct kivi_state {
    int32_t block;      /* residual block (entries block * G ..), -1 = none */
    int32_t len;        /* tokens of the row placed so far */
    int32_t n_done;     /* complete (quantized) groups */
    int32_t *entry;     /* [n_done] K group entries */
    int32_t cap;
} kivi_state;

static const lethe_sparse_knob knobs[] = {
    {"kivi_bits", LETHE_KNOB_INT, "4", 2, 16, "2 | 4 | 8 bits per element; 16 = passthrough"},
    {"kv_quant_page_size", LETHE_KNOB_INT, "32", 16, 128, "tokens per quantized K group = channels per V group (power of two dividing head_dim)"},
};

static lethe_status kivi_init(lethe_sparse_method *m) {
    kivi_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void kivi_destroy(lethe_sparse_method *m) {
    kivi_priv *p = PRIV(m);
    free(p->grp_used), free(p->blk_used);
    free(p->pack_src), free(p->pack_slot), free(p->pack_entry);
    free(p);
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
    /* packing / attention kernels: backend/cpu/attention_quant.c and
     * backend/cuda/attention_quant.cu (the CUDA kernels read 8 codes per load:
     * head_dim % 8 == 0, which G | head_dim with G >= 16 gives) */
    return LETHE_OK;
}

static lethe_kv_format kivi_kv_format(const lethe_sparse_method *m) {
    const kivi_priv *p = PRIV(m);
    if (!m->env.be || p->bits == 16) return LETHE_KV_NATIVE; /* fake model / passthrough */
    return LETHE_KV_KIVI_FORMAT(p->bits, p->page);
}

/* the pool's KIVI plan, NULL when the storage is native */
static lethe_kivi_plan *plan_of(lethe_sparse_method *m) {
    return m->env.pool ? lethe_kv_kivi_plan(m->env.pool) : NULL;
}

static void size_allocators(lethe_sparse_method *m) {
    kivi_priv *p = PRIV(m);
    if (p->grp_used) return;
    const lethe_kv_quant *q = lethe_kv_quant_of(m->env.pool, 0);
    p->n_groups = q->n_groups;
    p->n_blocks = q->n_res / p->page;
    p->grp_used = lethe_xcalloc((size_t)p->n_groups, 1);
    p->blk_used = lethe_xcalloc((size_t)p->n_blocks, 1);
}

/* first free index from *hint (cyclic), -1 if none */
static int32_t take(uint8_t *used, int32_t n, int32_t *hint) {
    for (int32_t k = 0; k < n; k++) {
        int32_t i = (*hint + k) % n;
        if (!used[i]) {
            used[i] = 1;
            *hint = (i + 1) % n;
            return i;
        }
    }
    return -1;
}

static lethe_status kivi_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s, void **state) {
    kivi_state *ks = lethe_xcalloc(1, sizeof(*ks));
    ks->block = -1;
    if (plan_of(m)) {
        kivi_priv *p = PRIV(m);
        size_allocators(m);
        ks->block = take(p->blk_used, p->n_blocks, &p->blk_hint);
        if (ks->block < 0) {
            free(ks);
            return lethe_errorf(LETHE_ERR_CAPACITY, "kivi: all %d full-precision residual blocks are in use "
                                "(one per running request)", p->n_blocks);
        }
    }
    *state = ks;
    return LETHE_OK;
}

static void release_all(kivi_priv *p, kivi_state *ks) {
    if (ks->block >= 0) p->blk_used[ks->block] = 0;
    for (int32_t i = 0; i < ks->n_done; i++) p->grp_used[ks->entry[i]] = 0;
    ks->block = -1;
    ks->n_done = 0;
}

static void kivi_request_finished(lethe_sparse_method *m, void *state) {
    kivi_state *ks = state;
    if (!ks) return;
    if (PRIV(m)->grp_used) release_all(PRIV(m), ks);
    free(ks->entry);
    free(ks);
}

/* snapshot: block, len, n_done, entry[n_done] (int32) */
static size_t kivi_snapshot(lethe_sparse_method *m, const void *state, void *buf, size_t cap) {
    const kivi_state *ks = state;
    size_t n = (3u + (size_t)ks->n_done) * sizeof(int32_t);
    if (buf && cap >= n) {
        int32_t hdr[3] = {ks->block, ks->len, ks->n_done};
        memcpy(buf, hdr, sizeof(hdr));
        if (ks->n_done) memcpy((char *)buf + sizeof(hdr), ks->entry, (size_t)ks->n_done * sizeof(int32_t));
    }
    return n;
}

/* restore re-claims the snapshot's residual block and group entries (freed
 * when the snapshotted state finished; the row kept its slots) */
static lethe_status kivi_restore(lethe_sparse_method *m, void *state, const void *buf, size_t n) {
    kivi_priv *p = PRIV(m);
    kivi_state *ks = state;
    int32_t hdr[3];
    if (n < sizeof(hdr)) return lethe_errorf(LETHE_ERR_FORMAT, "kivi state snapshot: %zu bytes", n);
    memcpy(hdr, buf, sizeof(hdr));
    if (hdr[2] < 0 || n != (3u + (size_t)hdr[2]) * sizeof(int32_t))
        return lethe_errorf(LETHE_ERR_FORMAT, "kivi state snapshot: %zu bytes, want %zu", n,
                            (3u + (size_t)LETHE_MAX(hdr[2], 0)) * sizeof(int32_t));
    const int32_t *ent = (const int32_t *)((const char *)buf + sizeof(hdr));
    if (p->grp_used) release_all(p, ks);
    if (p->grp_used) {
        if (hdr[0] >= 0 && (hdr[0] >= p->n_blocks || p->blk_used[hdr[0]]))
            return lethe_errorf(LETHE_ERR_INVALID, "kivi restore: residual block %d is taken", hdr[0]);
        for (int32_t i = 0; i < hdr[2]; i++)
            if (ent[i] < 0 || ent[i] >= p->n_groups || p->grp_used[ent[i]])
                return lethe_errorf(LETHE_ERR_INVALID, "kivi restore: K group entry %d is taken", ent[i]);
        if (hdr[0] >= 0) p->blk_used[hdr[0]] = 1;
        for (int32_t i = 0; i < hdr[2]; i++) p->grp_used[ent[i]] = 1;
    }
    if (hdr[2] > ks->cap) {
        ks->cap = hdr[2];
        ks->entry = lethe_xrealloc(ks->entry, (size_t)ks->cap * sizeof(int32_t));
    }
    ks->block = hdr[0], ks->len = hdr[1], ks->n_done = hdr[2];
    if (hdr[2]) memcpy(ks->entry, ent, (size_t)hdr[2] * sizeof(int32_t));
    return LETHE_OK;
}

/* Places this step's new tokens: groups completed by them are packed, the
 * rest go to the request's residual block (see the file comment). */
static void kivi_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    lethe_kivi_plan *plan = plan_of(m);
    if (!plan) return;
    kivi_priv *p = PRIV(m);
    const int32_t G = p->page;
    int32_t n_pack = 0;
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        kivi_state *ks = q->state;
        LETHE_ASSERT(ks && ks->block >= 0);
        const int32_t L = lethe_kv_row_len(m->env.pool, 0, q->row), t0 = L - q->n_new;
        const int32_t *slots = lethe_kv_row_slots(m->env.pool, 0, q->row);
        LETHE_ASSERT(t0 == ks->len && "kivi rows are never compacted");
        const int32_t res0 = ks->block * G;
        for (int32_t g = ks->n_done; g < L / G; g++) {
            if (n_pack + 1 > p->cap_pack) {
                p->cap_pack = LETHE_MAX(16, 2 * (n_pack + 1));
                p->pack_src = lethe_xrealloc(p->pack_src, (size_t)p->cap_pack * G * sizeof(int32_t));
                p->pack_slot = lethe_xrealloc(p->pack_slot, (size_t)p->cap_pack * G * sizeof(int32_t));
                p->pack_entry = lethe_xrealloc(p->pack_entry, (size_t)p->cap_pack * sizeof(int32_t));
            }
            const int32_t e = take(p->grp_used, p->n_groups, &p->grp_hint);
            LETHE_ASSERT(e >= 0 && "a complete group owns G slots: the table has n_slots / G entries");
            for (int32_t j = 0; j < G; j++) {
                const int32_t t = g * G + j, slot = slots[t];
                int32_t src;
                if (t >= t0) {
                    src = q->q_row + (t - t0);
                } else {
                    src = -(1 + res0 + j);
                    LETHE_ASSERT(plan->slot_aux[slot] == src);
                }
                p->pack_src[(size_t)n_pack * G + j] = src;
                p->pack_slot[(size_t)n_pack * G + j] = slot;
                plan->slot_aux[slot] = e;
            }
            p->pack_entry[n_pack++] = e;
            if (ks->n_done + 1 > ks->cap) {
                ks->cap = LETHE_MAX(8, 2 * ks->cap);
                ks->entry = lethe_xrealloc(ks->entry, (size_t)ks->cap * sizeof(int32_t));
            }
            ks->entry[ks->n_done++] = e;
        }
        for (int32_t t = LETHE_MAX(t0, (L / G) * G); t < L; t++) plan->slot_aux[slots[t]] = -(1 + res0 + t % G);
        ks->len = L;
    }
    plan->n_pack = n_pack;
    plan->pack_src = p->pack_src;
    plan->pack_slot = p->pack_slot;
    plan->pack_entry = p->pack_entry;
}

const lethe_sparse_ops lethe_sparse_kivi = {
    .name = "kivi",
    .aliases = {NULL},
    .summary = "2/4/8-bit KV codes in the pool: per-channel key groups, per-token values, full-precision tail group",
    .kind = LETHE_SPARSE_KIND_QUANTIZATION,
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    /* 16 bits: the passthrough (native storage), bit-identical to dense */
    .test_configs = {.identity = "kivi_bits=16,kv_quant_page_size=16"},
    .kv_format = kivi_kv_format,
    .init = kivi_init,
    .configure = kivi_configure,
    .destroy = kivi_destroy,
    .set_knob = kivi_set_knob,
    .request_init = kivi_request_init,
    .request_finished = kivi_request_finished,
    .prepare = kivi_prepare,
    .snapshot = kivi_snapshot,
    .restore = kivi_restore,
};

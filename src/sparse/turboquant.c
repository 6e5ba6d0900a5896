/* turboquant.c - TurboQuant (methods.md §16), data-oblivious vector
 * quantization of K and V: a seeded random rotation, then a Lloyd-Max
 * codebook of 2^b levels for each coordinate of the rotated unit vector, the
 * vector norm in fp16 (MSE variant, no QJL residual sketch, as SparseEngine).
 *
 * The method only declares its storage format (kv_format:
 * LETHE_KV_TQ_FORMAT(bits, seed)); the pool then holds per (slot, KV head)
 * head_dim b / 8 bytes of codes + a 2-byte norm for K and for V (kv_pool.h:
 * 2 L KH (hd b / 8 + 2) bytes per token), plus one copy of the rotation and
 * codebook (src/backend/tq_codec.h). The backend's kv_store_quant quantizes
 * every token as it is stored and attention (backend/{cpu,cuda}/attention_tq)
 * reads the codes in the rotated basis (queries rotated once, the output
 * rotated back once), so nothing is ever dequantized into memory and a
 * token is read quantized from its own step on.
 *
 * Per-token quantization does not depend on history: radix prefix reuse is
 * valid (LETHE_SPARSE_PREFIX_CACHE); attention reads every resident slot. */
#include <stdlib.h>

#include "core/util.h"
#include "sparse/sparse.h"

typedef struct tq_priv {
    lethe_knob_values kv;
    int32_t bits, seed;
} tq_priv;
#define PRIV(m) ((tq_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"turboquant_bits", LETHE_KNOB_INT, "4", 2, 4, "bits per coordinate: 2 | 3 | 4"},
    {"turboquant_seed", LETHE_KNOB_INT, "0", 0, 32767, "seed of the random rotation"},
};

static lethe_status tq_init(lethe_sparse_method *m) {
    tq_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void tq_destroy(lethe_sparse_method *m) {
    free(m->priv);
    m->priv = NULL;
}
static lethe_status tq_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status tq_configure(lethe_sparse_method *m) {
    tq_priv *p = PRIV(m);
    p->bits = (int32_t)lethe_knob_num(m->ops, &p->kv, "turboquant_bits");
    p->seed = (int32_t)lethe_knob_num(m->ops, &p->kv, "turboquant_seed");
    /* codes of one head vector fill whole bytes at 3 bits; the kernels hold up to 256 */
    if (m->env.head_dim % 8 || m->env.head_dim > 256)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "turboquant: head_dim %d unsupported (a multiple of 8 up "
                            "to 256)", m->env.head_dim);
    return LETHE_OK;
}

static lethe_kv_format tq_kv_format(const lethe_sparse_method *m) {
    const tq_priv *p = PRIV(m);
    if (!m->env.be) return LETHE_KV_NATIVE; /* fake model: bookkeeping only */
    return LETHE_KV_TQ_FORMAT(p->bits, p->seed);
}

const lethe_sparse_ops lethe_sparse_turboquant = {
    .name = "turboquant",
    .aliases = {"tq", NULL},
    .summary = "seeded rotation + Lloyd-Max codebook codes (2/3/4 bit) with fp16 norms for K and V",
    .kind = LETHE_SPARSE_KIND_QUANTIZATION,
    .flags = LETHE_SPARSE_PREFIX_CACHE,
    .knob_table = knobs,
    .n_knob_table = (int32_t)LETHE_ARRAY_LEN(knobs),
    /* lossy by design: the identity run is close to dense, not equal */
    .test_configs = {.identity = NULL, .lossy_rel_err = 0.15},
    .init = tq_init,
    .configure = tq_configure,
    .destroy = tq_destroy,
    .set_knob = tq_set_knob,
    .kv_format = tq_kv_format,
};

/* fp8_kv.c - FP8 KV (methods.md §17): E4M3 codes with per-token, per-KV-head
 * dynamic scales (amax / 448) for K and V separately; no calibration.
 *
 * Storage seam (documented limitation, as kivi.c): the pool has no FP8 payload
 * type yet, so every token is quantized on store: after a layer's attention the
 * step's new tokens are quantized and the dequantized values written back into
 * their slots. Later steps read exactly the FP8 values; memory is not reduced,
 * and a token's own step attended it in full precision. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "sparse/quant.h"
#include "sparse/sparse.h"

static lethe_status fp8_configure(lethe_sparse_method *m) {
    if (m->env.be && !lethe_sparse_kv_host_ok(m))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "--sparse-method fp8_kv: the %s backend's KV is not "
                            "host-readable (the quantizer has no twin there yet)", m->env.be->ops->name);
    return LETHE_OK;
}

static int32_t fp8_prefill(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           int32_t seq, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}
static int32_t fp8_decode(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                          int32_t seq, const void *q, int32_t *sel, int32_t cap) {
    return lethe_sparse_select_all(m, layer, st->seqs[seq].row, sel, cap);
}

/* quantize-dequantize rows x [kv_dim] per KV head in place */
static void qdq_row(float *x, int32_t n_kv_heads, int32_t head_dim, uint8_t *codes) {
    for (int32_t h = 0; h < n_kv_heads; h++) {
        float s, *xh = x + (size_t)h * head_dim;
        lethe_fp8_quant_vec(xh, head_dim, codes, &s);
        lethe_fp8_dequant_vec(codes, head_dim, s, xh);
    }
}

static void fp8_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           const float *scores, int32_t stride) {
    float *K = lethe_sparse_kv_host(m, layer, false), *V = lethe_sparse_kv_host(m, layer, true);
    if (!K) return;
    int32_t C = m->env.n_kv_heads * m->env.head_dim;
    uint8_t *codes = lethe_xmalloc((size_t)m->env.head_dim);
    int32_t sp = lethe_kv_space_of(m->env.pool, layer);
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        int32_t L = lethe_kv_row_len(m->env.pool, sp, q->row);
        const int32_t *slots = lethe_kv_row_slots(m->env.pool, sp, q->row);
        for (int32_t t = L - q->n_new; t < L; t++) { /* this step's new tokens */
            qdq_row(K + (size_t)slots[t] * C, m->env.n_kv_heads, m->env.head_dim, codes);
            qdq_row(V + (size_t)slots[t] * C, m->env.n_kv_heads, m->env.head_dim, codes);
        }
    }
    free(codes);
}

const lethe_sparse_ops lethe_sparse_fp8_kv = {
    .name = "fp8_kv",
    .aliases = {"fp8", NULL},
    .summary = "E4M3 KV with per-token, per-KV-head dynamic scales",
    .flags = LETHE_SPARSE_PREFIX_CACHE,
    .build_prefill_selection = fp8_prefill,
    .build_decode_selection = fp8_decode,
    .after_attn = fp8_after_attn,
    .kind = LETHE_SPARSE_KIND_QUANTIZATION,
    .configure = fp8_configure,
};

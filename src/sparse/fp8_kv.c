/* fp8_kv.c - FP8 KV (methods.md §17): E4M3 codes with per-token, per-KV-head
 * dynamic scales (amax / 448) for K and V separately; no calibration.
 *
 * The method only declares its storage format (kv_format: FP8_E4M3); the pool
 * then holds 1-byte codes + one f32 scale per (slot, KV head) for K and V
 * (kv_pool.h: 2 * n_kv_heads * (head_dim + 4) bytes per token per layer), the
 * backend's kv_store_quant quantizes every token as it is stored, and the
 * attention kernels (backend/{cpu,cuda}/attention_quant) dequantize on read.
 * So a token is read quantized from its own step on (also by the queries of
 * its own prefill chunk), on CPU and CUDA alike.
 *
 * Quantization is per token, so a token's codes do not depend on its history:
 * radix prefix reuse stays valid (LETHE_SPARSE_PREFIX_CACHE). Attention reads
 * every resident slot (the selection hooks' default). */
#include "sparse/sparse.h"

static lethe_kv_format fp8_kv_format(const lethe_sparse_method *m) {
    return m->env.be ? LETHE_KV_FP8_E4M3 : LETHE_KV_NATIVE; /* fake model: bookkeeping only */
}

const lethe_sparse_ops lethe_sparse_fp8_kv = {
    .name = "fp8_kv",
    .aliases = {"fp8", NULL},
    .summary = "E4M3 KV with per-token, per-KV-head dynamic scales (1-byte codes in the pool)",
    .kind = LETHE_SPARSE_KIND_QUANTIZATION,
    /* uniform: every layer reads every resident slot; per-token codes need no
     * host plan, so decode steps are CUDA graphs like dense (engine_forward.c) */
    .flags = LETHE_SPARSE_PREFIX_CACHE | LETHE_SPARSE_UNIFORM,
    /* the defaults (no budget): lossy by design, so close to dense, not equal */
    .test_configs = {.identity = NULL},
    .kv_format = fp8_kv_format,
};

/* backend.c - picks a backend by name; the only place that knows whether
 * CUDA was compiled in (LETHE_HAVE_CUDA). */
#include "backend/backend.h"

#include <string.h>

#include "backend/moe_layout.h"

lethe_status lethe_backend_create(const lethe_backend_params *p, lethe_backend **out) {
    const char *dev = p->device ? p->device : "cpu";
    if (!strcmp(dev, "cpu")) return lethe_backend_cpu_create(p, out);
    if (!strcmp(dev, "cuda")) {
#ifdef LETHE_HAVE_CUDA
        return lethe_backend_cuda_create(p, out);
#else
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "--device cuda: this lethe was built without CUDA (nvcc not found at "
                            "build time); rebuild on a machine with the CUDA toolkit");
#endif
    }
    return lethe_errorf(LETHE_ERR_INVALID, "--device %s: unknown device (expected cpu or cuda)", dev);
}

void lethe_backend_destroy(lethe_backend *be) {
    if (be && be->ops && be->ops->destroy) be->ops->destroy(be);
}

size_t lethe_attn_scores_out_len(const lethe_score_seq *seqs, int32_t n_seqs, int32_t n_groups) {
    size_t n = 0;
    for (int32_t s = 0; s < n_seqs; s++) n += (size_t)n_groups * (size_t)(seqs[s].c1 - seqs[s].c0);
    return n;
}

size_t lethe_moe_ws_bytes(const lethe_backend *be, int32_t n, int32_t k, int32_t dim, int32_t ffn,
                          int32_t n_experts) {
    return lethe_moe_layout_of(be->ops->act_size, n, k, dim, ffn, n_experts).total;
}

lethe_status lethe_cpu_weights_parse(const char *s, int *out) {
    if (s && !strcmp(s, "native")) *out = LETHE_CPU_WEIGHTS_NATIVE;
    else if (s && !strcmp(s, "exact")) *out = LETHE_CPU_WEIGHTS_EXACT;
    else if (s && !strcmp(s, "fp32")) *out = LETHE_CPU_WEIGHTS_FP32;
    else
        return lethe_errorf(LETHE_ERR_INVALID,
                            "--cpu-weights %s: unknown (expected native: GGUF blocks, f16 and "
                            "bf16 kept as stored, 16-bit activations; exact: kept as stored, f32 "
                            "activations; or fp32: dequantized at load, the reference)",
                            s ? s : "(null)");
    return LETHE_OK;
}

/* backend_cpu.c - the CPU reference backend: ops table, memory, transfers.
 *
 * Everything is fp32 in host memory (act_size = kv_size = 4): alloc is a
 * 64-byte aligned malloc, weight_upload copies, weight_upload_raw keeps a
 * matrix in its stored format (qmatmul.c), the host-transfer ops are memcpy. The math lives in the per-op files listed in cpu_ops.h. This
 * backend is the reference the CUDA backend and the HF fixtures are checked
 * against, so it favours clarity and determinism, then speed. */
#include "backend/cpu/cpu_ops.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "core/util.h"

#define CPU_ALIGN 64

int lethe_cpu_threads(const lethe_backend *be) {
    int n = be->n_threads;
    if (n > 0) return n;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    return 1;
}

void lethe_cpu_parallel(lethe_backend *be, int n_threads, int n_tasks, lethe_cpu_task_fn fn,
                        void *ctx) {
    lethe_cpu_ctx *c = be->ctx;
    lethe_cpu_pool_run(c->pool, n_threads, n_tasks, fn, ctx);
}

static void cpu_destroy(lethe_backend *be) {
    if (!be) return;
    if (be->ctx) lethe_cpu_sample_free(be->ctx);
    if (be->ctx) lethe_cpu_qweight_free_all(be->ctx);
    if (be->ctx) lethe_cpu_pool_destroy(((lethe_cpu_ctx *)be->ctx)->pool);
    free(be->ctx);
    free(be);
}

static lethe_status cpu_alloc(lethe_backend *be, size_t n_bytes, void **out) {
    size_t n = (n_bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    void *p = aligned_alloc(CPU_ALIGN, n ? n : CPU_ALIGN);
    if (!p) return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes", n_bytes);
    *out = p;
    return LETHE_OK;
}

static void cpu_release(lethe_backend *be, void *p) {
    if (!lethe_cpu_qweight_release(be, p)) free(p);
}

static lethe_status cpu_weight_upload(lethe_backend *be, const float *host, size_t n, void **out) {
    void *p = NULL;
    lethe_status st = cpu_alloc(be, n * sizeof(float), &p);
    if (st != LETHE_OK) return st;
    memcpy(p, host, n * sizeof(float));
    *out = p;
    return LETHE_OK;
}

static void cpu_copy_floats(lethe_backend *be, float *dst, const void *src, size_t n) {
    memcpy(dst, src, n * sizeof(float));
}

static void cpu_act_from_host(lethe_backend *be, void *dst, const float *src, size_t n) {
    memcpy(dst, src, n * sizeof(float));
}

static void cpu_sync(lethe_backend *be) {}

static size_t cpu_free_memory(lethe_backend *be) { return 0; }

/* Step staging and graphs are device concerns: the CPU reads host arrays
 * directly and runs every step eagerly. */
static void cpu_stage_step(lethe_backend *be, const int32_t *const *arrays, const size_t *counts,
                           int n) {}
static void cpu_unstage(lethe_backend *be) {}
static bool cpu_graph_begin(lethe_backend *be) { return false; }
static lethe_status cpu_graph_end(lethe_backend *be, int32_t key) {
    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "cpu backend: no graph capture");
}
static bool cpu_graph_launch(lethe_backend *be, int32_t key, float *logits_dst) { return false; }
static void cpu_graph_reset(lethe_backend *be) {}

/* no device profiler */
static void cpu_profile_range(lethe_backend *be, bool start) {}

/* memcpy bandwidth (64 MiB, read + written bytes) and the f32 GEMM rate */
static lethe_status cpu_measure_peaks(lethe_backend *be, double *copy_bps, double *gemm_fps) {
    const size_t n = (size_t)16 << 20; /* floats */
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    if (!a || !b) {
        free(a);
        free(b);
        return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: measure_peaks: out of memory");
    }
    uint64_t st = 1;
    for (size_t i = 0; i < n; i++) a[i] = (float)(lethe_splitmix64(&st) >> 40) * 0x1p-24f - 0.5f;
    memcpy(b, a, n * sizeof(float));
    double t0 = lethe_time_s();
    for (int r = 0; r < 4; r++) memcpy(r % 2 ? a : b, r % 2 ? b : a, n * sizeof(float));
    *copy_bps = 4.0 * 2 * n * sizeof(float) / (lethe_time_s() - t0);
    const int32_t m = 256, k = 512, o = 512;
    lethe_cpu_matmul(be, b, a, a + (size_t)m * k, m, o, k); /* warm */
    t0 = lethe_time_s();
    for (int r = 0; r < 3; r++) lethe_cpu_matmul(be, b, a, a + (size_t)m * k, m, o, k);
    *gemm_fps = 3.0 * 2.0 * m * k * o / (lethe_time_s() - t0);
    free(a);
    free(b);
    return LETHE_OK;
}

static void cpu_copy_from_host(lethe_backend *be, void *dst, const void *src, size_t n_bytes) {
    memcpy(dst, src, n_bytes);
}

static const lethe_backend_ops cpu_ops = {
    .name = "cpu",
    .caps = LETHE_BE_HOST_MEMORY,
    .act_size = sizeof(float),
    .kv_size = sizeof(float),
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .weight_upload = cpu_weight_upload,
    .act_to_host = cpu_copy_floats,
    .act_from_host = cpu_act_from_host,
    .sync = cpu_sync,
    .free_memory = cpu_free_memory,
    .embed = lethe_cpu_embed,
    .rmsnorm = lethe_cpu_rmsnorm,
    .add = lethe_cpu_add,
    .matmul = lethe_cpu_matmul,
    .add_bias = lethe_cpu_add_bias,
    .rope = lethe_cpu_rope,
    .swiglu = lethe_cpu_swiglu,
    .kv_store = lethe_cpu_kv_store,
    .attention = lethe_cpu_attention,
    .logits_to_host = cpu_copy_floats,
    .gather_rows = lethe_cpu_gather_rows,
    .stage_step = cpu_stage_step,
    .unstage = cpu_unstage,
    .graph_begin = cpu_graph_begin,
    .graph_end = cpu_graph_end,
    .graph_launch = cpu_graph_launch,
    .graph_reset = cpu_graph_reset,
    .measure_peaks = cpu_measure_peaks,
    .kv_store_quant = lethe_cpu_kv_store_quant,
    .attn_scores = lethe_cpu_attn_scores,
    /* Quest page bounds */
    .page_minmax = lethe_cpu_page_minmax,
    .page_scores = lethe_cpu_page_scores,
    .profile_range = cpu_profile_range,
    .sample = lethe_cpu_sample,
    .topk = lethe_cpu_topk,
    .select_expand = lethe_cpu_select_expand,
    .moe = lethe_cpu_moe,
    .matmul_heads = lethe_cpu_matmul_heads,
    .copy_block = lethe_cpu_copy_block,
    .copy_from_host = cpu_copy_from_host,
    .key_redundancy = lethe_cpu_key_redundancy,
    .cluster_assign = lethe_cpu_cluster_assign,
    .cluster_scores = lethe_cpu_cluster_scores,
    .cluster_attention = lethe_cpu_cluster_attention,
    .gather_sum = lethe_cpu_gather_sum,
    .gdn_conv = lethe_cpu_gdn_conv,
    .gdn_rule = lethe_cpu_gdn_rule,
    .rmsnorm_gated = lethe_cpu_rmsnorm_gated,
    .sigmoid_mul = lethe_cpu_sigmoid_mul,
    .state_copy = lethe_cpu_state_copy,
    .weight_upload_raw = lethe_cpu_weight_upload_raw,
    .rows_to_host = lethe_cpu_rows_to_host,
    .rows_from_host = lethe_cpu_rows_from_host,
    .row_topk = lethe_cpu_row_topk,
};

lethe_status lethe_backend_cpu_create(const lethe_backend_params *p, lethe_backend **out) {
    if (p->n_threads < 0)
        return lethe_errorf(LETHE_ERR_INVALID, "--threads %d: must be >= 0 (0 = all cores)",
                            p->n_threads);
    if (p->cpu_weights != LETHE_CPU_WEIGHTS_NATIVE && p->cpu_weights != LETHE_CPU_WEIGHTS_FP32 &&
        p->cpu_weights != LETHE_CPU_WEIGHTS_EXACT)
        return lethe_errorf(LETHE_ERR_INVALID, "cpu backend: cpu_weights %d is not a "
                            "LETHE_CPU_WEIGHTS_* value", p->cpu_weights);
    /* the kernel tier: what the CPU runs, capped by LETHE_CPU_ISA */
    const char *want = NULL;
    lethe_status st = lethe_env_choice(LETHE_ENV_CPU_ISA, &want);
    if (st) return st;
    lethe_cpu_isa isa = lethe_cpu_isa_detect();
    if (isa < LETHE_ISA_AVX2)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "cpu backend: this CPU does not run AVX2 + FMA + F16C (CPUID or the "
                            "probe that executes them says no); the attention kernels need them");
    if (!strcmp(want, "scalar")) isa = LETHE_ISA_SCALAR;
    if (!strcmp(want, "avx2") && isa > LETHE_ISA_AVX2) isa = LETHE_ISA_AVX2;
    lethe_backend *be = calloc(1, sizeof(*be));
    if (!be) return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: out of memory");
    be->ops = &cpu_ops;
    be->n_threads = p->n_threads;
    lethe_cpu_ctx *c = calloc(1, sizeof(lethe_cpu_ctx));
    be->ctx = c;
    if (!c) {
        free(be);
        return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: out of memory");
    }
    c->isa = isa;
    c->cpu_weights = p->cpu_weights;
    if (!(c->pool = lethe_cpu_pool_create())) {
        free(c);
        free(be);
        return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: out of memory");
    }
    *out = be;
    return LETHE_OK;
}

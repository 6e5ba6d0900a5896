/* attn_bench.c - the CUDA attention kernel generations side by side
 * (dev/cuda/README.md): v1 (dev/cuda/attention_v1.cu), v2 and lethe's
 * attention op (the kernels the engine runs), against the CPU twin.
 *
 * Check (unless --no-check): small ragged / sparse / mixed / long cases at
 * head_dim 64 and 128 (shapes taken from tests/gpu/test_cuda_ops.c) through
 * the CPU backend's attention (fp32) and each CUDA generation. Inputs are
 * bf16-rounded on the host, so both sides see the same values; CUDA outputs
 * are NaN-poisoned first (an unwritten element fails) and must be within a
 * relative error ||gpu - cpu|| / ||cpu|| of 1.5e-2 (bf16 output rounding
 * alone is ~2e-3). Any failure makes the exit status 1.
 *
 * Bench (unless --no-bench): at one model shape (--heads / --kv-heads /
 * --head-dim; default Llama-3.1-8B, 32 / 8 / 128), decode attention alone for
 * every --batch x --ctx (one query per sequence over a dense selection of ctx
 * slots, the selection pre-staged as in an engine step) and prefill attention
 * alone for every --prefill length (one sequence, causal over itself). Per
 * generation: mean time per call over --reps calls after 3 warm-up calls (host
 * clock around a device sync), GB/s of K + V read and the fraction of the
 * measured copy bandwidth (decode), TFLOP/s and the fraction of the measured
 * GEMM peak (prefill); plus the relative difference of the v1 and v2 outputs.
 * --profile adds one call per generation and shape inside the profiler range
 * (ncu --profile-from-start off). --json writes everything.
 *
 * Decode by KV format (--kv, default bf16,fp8,kivi4,kivi2): for every
 * --batch x --ctx, decode attention alone through lethe's op over bf16 K / V
 * and over the same K / V quantized to FP8 E4M3 and KIVI (kv_store_quant):
 * bytes read (payload + scales / parameters), time, GB/s, the fraction of
 * the copy bandwidth in bytes read, the speed-up over bf16 and the output's
 * difference from bf16's (the quantization error, a sanity check). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_gen.h"
#include "backend/backend.h"
#include "core/util.h"
#include "options.h"

#define MAX_LIST 16
#define CHECK_TOL 1.5e-2
#define GEN_LETHE 0 /* lethe's ops->attention */
#define MAX_SEQS 8

static lethe_backend *g_cpu, *g_gpu;
static uint64_t g_rng = 2024;

static const int k_gens[] = {DEV_ATTN_V1, DEV_ATTN_V2, GEN_LETHE};
#define N_GENS 3

static const char *gen_name(int g) {
    return g == DEV_ATTN_V1 ? "v1" : g == DEV_ATTN_V2 ? "v2" : "lethe";
}

/* Runs `a` on the CUDA backend with generation g; false: g does not take
 * the shape on this device */
static bool run_gen(const lethe_attn_args *a, int g) {
    if (g == GEN_LETHE) {
        g_gpu->ops->attention(g_gpu, a);
        return true;
    }
    return dev_cuda_attention(g_gpu, a, g);
}

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float *rand_bf16(size_t n) {
    float *v = lethe_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = bf16_round((float)((lethe_splitmix64(&g_rng) >> 40) * 0x1p-24 * 2.0 - 1.0));
    return v;
}

static double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* n activations of backend be holding host[0..n) (NULL: uninitialized) */
static void *upload(lethe_backend *be, const float *host, size_t n) {
    void *p = NULL;
    if (be->ops->alloc(be, (n ? n : 1) * be->ops->act_size, &p) != LETHE_OK) {
        fprintf(stderr, "attn_bench: %s\n", lethe_last_error());
        exit(1);
    }
    if (host && n) be->ops->act_from_host(be, p, host, n);
    return p;
}

/* ||gpu - cpu|| / ||cpu|| of n floats of device out (1e9 if one is not finite) */
static double gpu_err(const void *out, const float *ref, size_t n) {
    float *h = lethe_xmalloc((n ? n : 1) * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, h, out, n);
    double e = rel_err(h, ref, n);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(h[i])) e = 1e9;
    free(h);
    return e;
}

/* ---- check: every generation vs the CPU twin --------------------------------- */

typedef struct check_case {
    const char *name;
    int n_heads, n_kv, hd, n_seqs;
    int n_q[MAX_SEQS], n_sel[MAX_SEQS]; /* queries and selection length per sequence */
    int sparse;                         /* drop a random third of each prefix */
} check_case;

static const check_case k_cases[] = {
    {"decode single", 32, 8, 128, 1, {1}, {4096}, 0},
    {"decode ragged", 32, 8, 128, 5, {1, 1, 1, 1, 1}, {1, 37, 128, 129, 5000}, 0},
    {"decode gqa3 d64", 9, 3, 64, 3, {1, 1, 1}, {2, 300, 1025}, 0},
    {"decode gqa32 d64", 64, 2, 64, 2, {1, 1}, {100, 1500}, 0},
    {"decode long b4", 32, 8, 128, 4, {1, 1, 1, 1}, {16384, 20000, 16385, 33000}, 0},
    {"sparse decode", 32, 8, 128, 2, {1, 1}, {600, 2000}, 1},
    {"prefill single", 32, 8, 128, 1, {200}, {200}, 0},
    {"prefill ragged", 8, 2, 128, 4, {1, 63, 64, 65}, {1, 63, 64, 65}, 0},
    {"prefill gqa4 d64", 12, 3, 64, 3, {127, 64, 3}, {127, 64, 3}, 0},
    {"extend + decode", 8, 2, 128, 3, {1, 50, 130}, {900, 300, 130}, 0},
    {"sparse extend d64", 8, 1, 64, 3, {40, 1, 65}, {700, 300, 900}, 1},
    {"extend long prefix", 8, 2, 128, 2, {130, 1}, {16500, 17000}, 0},
    {"mixed decode rows", 32, 8, 128, 6, {1, 1, 100, 1, 1, 1}, {3000, 17, 600, 1, 129, 5000}, 0},
};

/* Returns the number of failed (case, generation) pairs; appends to arr. */
static int check_case_run(const check_case *tc, cJSON *arr) {
    const int H = tc->n_heads, KV = tc->n_kv, D = tc->hd, S = tc->n_seqs;
    int32_t q_begin[MAX_SEQS + 1] = {0}, sel_begin[MAX_SEQS + 1] = {0};
    int32_t n_slots = 0;
    for (int s = 0; s < S; s++) {
        q_begin[s + 1] = q_begin[s] + tc->n_q[s];
        n_slots += tc->n_sel[s];
    }
    const int32_t T = q_begin[S];
    /* slots: a random permutation of the cache rows; sparse drops prefix entries */
    int32_t *perm = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    for (int32_t i = 0; i < n_slots; i++) perm[i] = i;
    for (int32_t i = n_slots - 1; i > 0; i--) {
        const int32_t j = (int32_t)(lethe_splitmix64(&g_rng) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *sel = lethe_xmalloc((size_t)n_slots * sizeof(int32_t));
    int32_t used = 0, n_sel = 0;
    for (int s = 0; s < S; s++) {
        for (int e = 0; e < tc->n_sel[s]; e++) {
            const int32_t slot = perm[used++];
            const bool prefix = e < tc->n_sel[s] - tc->n_q[s];
            if (tc->sparse && prefix && e > 0 && lethe_splitmix64(&g_rng) % 3 == 0) continue;
            sel[n_sel++] = slot;
        }
        sel_begin[s + 1] = n_sel;
    }
    const size_t kv_n = (size_t)n_slots * KV * D, q_n = (size_t)T * H * D;
    float *k = rand_bf16(kv_n), *v = rand_bf16(kv_n), *q = rand_bf16(q_n);
    float *ref = lethe_xmalloc(q_n * sizeof(float)), *nan = lethe_xmalloc(q_n * sizeof(float));
    for (size_t i = 0; i < q_n; i++) nan[i] = NAN;
    lethe_attn_args a = {.n_tokens = T, .n_seqs = S, .q_begin = q_begin, .sel_begin = sel_begin,
                         .sel_slots = sel, .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                         .scale = 1.0f / sqrtf((float)D)};
    /* the CPU twin */
    a.k_cache = upload(g_cpu, k, kv_n), a.v_cache = upload(g_cpu, v, kv_n);
    a.q = upload(g_cpu, q, q_n), a.out = upload(g_cpu, NULL, q_n);
    g_cpu->ops->attention(g_cpu, &a);
    g_cpu->ops->act_to_host(g_cpu, ref, a.out, q_n);
    g_cpu->ops->release(g_cpu, (void *)a.k_cache), g_cpu->ops->release(g_cpu, (void *)a.v_cache);
    g_cpu->ops->release(g_cpu, (void *)a.q), g_cpu->ops->release(g_cpu, a.out);
    /* each CUDA generation */
    a.k_cache = upload(g_gpu, k, kv_n), a.v_cache = upload(g_gpu, v, kv_n);
    a.q = upload(g_gpu, q, q_n), a.out = upload(g_gpu, NULL, q_n);
    int fails = 0;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "case", tc->name);
    printf("%-22s H=%-2d KV=%d D=%-3d T=%-5d", tc->name, H, KV, D, T);
    for (int gi = 0; gi < N_GENS; gi++) {
        g_gpu->ops->act_from_host(g_gpu, a.out, nan, q_n);
        if (!run_gen(&a, k_gens[gi])) {
            printf(" | %5s       n/a", gen_name(k_gens[gi]));
            continue;
        }
        const double err = gpu_err(a.out, ref, q_n);
        const bool ok = err < CHECK_TOL;
        fails += !ok;
        printf(" | %5s %.2e", gen_name(k_gens[gi]), err);
        cJSON_AddNumberToObject(e, gen_name(k_gens[gi]), err);
    }
    printf("%s\n", fails ? "  FAIL" : "");
    cJSON_AddItemToArray(arr, e);
    g_gpu->ops->release(g_gpu, (void *)a.k_cache), g_gpu->ops->release(g_gpu, (void *)a.v_cache);
    g_gpu->ops->release(g_gpu, (void *)a.q), g_gpu->ops->release(g_gpu, a.out);
    free(perm), free(sel), free(k), free(v), free(q), free(ref), free(nan);
    return fails;
}

/* ---- bench: v1 vs v2 at one model shape --------------------------------------- */

/* mean seconds per call of generation g over reps calls (after 3 warm-up
 * calls); with profile, one more call inside the profiler range */
static double time_gen(const lethe_attn_args *a, int g, int reps, bool profile) {
    for (int r = 0; r < 3; r++) run_gen(a, g);
    g_gpu->ops->sync(g_gpu);
    const double t0 = lethe_time_s();
    for (int r = 0; r < reps; r++) run_gen(a, g);
    g_gpu->ops->sync(g_gpu);
    const double t = (lethe_time_s() - t0) / reps;
    if (profile && g_gpu->ops->profile_range) {
        g_gpu->ops->profile_range(g_gpu, true);
        run_gen(a, g);
        g_gpu->ops->profile_range(g_gpu, false);
    }
    return t;
}

/* n random bf16 activations on the device (a 4M-value block, repeated) */
static void *upload_random(size_t n) {
    const size_t block = (size_t)1 << 22, m = n < block ? n : block;
    float *h = rand_bf16(m);
    void *p = upload(g_gpu, NULL, n);
    for (size_t off = 0; off < n; off += block)
        g_gpu->ops->act_from_host(g_gpu, (char *)p + off * g_gpu->ops->act_size, h,
                                  n - off < block ? n - off : block);
    free(h);
    return p;
}

/* Times v1 and v2 on `a` (q, K, V on the device; selection pre-staged):
 * `work` per call (bytes or FLOPs) against `ceiling` (same unit per second),
 * `unit` scales the printed rate. Adds {v1: {us, rate_key, frac}, v2: ...,
 * v1_vs_v2} to e. */
static void bench_point(lethe_attn_args *a, size_t out_n, int reps, bool profile, double work,
                        double ceiling, double unit, const char *rate_key, cJSON *e) {
    cJSON *per = cJSON_AddObjectToObject(e, "kernels");
    float *outs[2] = {NULL, NULL};
    double t_gen[2] = {0, 0};
    for (int gi = 0; gi < 2; gi++) {
        const int g = k_gens[gi];
        if (!run_gen(a, g)) {
            printf(" | %4s %9s %8s %7s", gen_name(g), "n/a", "", "");
            continue;
        }
        const double t = time_gen(a, g, reps, profile);
        const double rate = work / t * unit, frac = ceiling > 0 ? work / ceiling / t : 0;
        printf(" | %4s %9.1f %8.1f %6.1f%%", gen_name(g), t * 1e6, rate, 100 * frac);
        cJSON *k = cJSON_AddObjectToObject(per, gen_name(g));
        cJSON_AddNumberToObject(k, "us", t * 1e6);
        cJSON_AddNumberToObject(k, rate_key, rate);
        cJSON_AddNumberToObject(k, "frac_ceiling", frac);
        t_gen[gi] = t;
        outs[gi] = lethe_xmalloc(out_n * sizeof(float));
        g_gpu->ops->act_to_host(g_gpu, outs[gi], a->out, out_n);
    }
    if (outs[0] && outs[1]) {
        const double d = rel_err(outs[0], outs[1], out_n);
        printf(" | %5.2fx  %.1e", t_gen[0] / t_gen[1], d);
        cJSON_AddNumberToObject(e, "v2_speedup", t_gen[0] / t_gen[1]);
        cJSON_AddNumberToObject(e, "v1_vs_v2_rel_diff", d);
    }
    printf("\n");
    fflush(stdout);
    free(outs[0]), free(outs[1]);
}

static void bench_decode(int H, int KV, int D, int32_t B, int32_t L, double copy_bps, int reps,
                         bool profile, cJSON *arr) {
    const size_t slots = (size_t)B * L, kv_n = slots * KV * D, q_n = (size_t)B * H * D;
    lethe_attn_args a = {.k_cache = upload_random(kv_n), .v_cache = upload_random(kv_n),
                         .q = upload_random(q_n), .out = upload(g_gpu, NULL, q_n), .n_tokens = B,
                         .n_seqs = B, .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                         .scale = 1.0f / sqrtf((float)D)};
    int32_t *qb = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
    int32_t *sb = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
    int32_t *sel = lethe_xmalloc(slots * sizeof(int32_t));
    for (int32_t s = 0; s <= B; s++) qb[s] = s, sb[s] = s * L;
    for (size_t e = 0; e < slots; e++) sel[e] = (int32_t)e;
    a.q_begin = qb, a.sel_begin = sb, a.sel_slots = sel;
    const int32_t *arrays[3] = {qb, sb, sel};
    const size_t counts[3] = {(size_t)B + 1, (size_t)B + 1, slots};
    g_gpu->ops->stage_step(g_gpu, arrays, counts, 3);
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "batch", B);
    cJSON_AddNumberToObject(e, "ctx", L);
    printf("%6d %8d", B, L);
    bench_point(&a, q_n, reps, profile, 2.0 * kv_n * g_gpu->ops->kv_size, copy_bps, 1e-9, "gb_s",
                e);
    cJSON_AddItemToArray(arr, e);
    g_gpu->ops->unstage(g_gpu);
    g_gpu->ops->release(g_gpu, (void *)a.k_cache), g_gpu->ops->release(g_gpu, (void *)a.v_cache);
    g_gpu->ops->release(g_gpu, (void *)a.q), g_gpu->ops->release(g_gpu, a.out);
    free(qb), free(sb), free(sel);
}

static void bench_prefill(int H, int KV, int D, int32_t L, double gemm_fps, int reps, bool profile,
                          cJSON *arr) {
    const size_t kv_n = (size_t)L * KV * D, q_n = (size_t)L * H * D;
    int32_t qb[2] = {0, L}, sb[2] = {0, L};
    int32_t *sel = lethe_xmalloc((size_t)L * sizeof(int32_t));
    for (int32_t e = 0; e < L; e++) sel[e] = e;
    lethe_attn_args a = {.k_cache = upload_random(kv_n), .v_cache = upload_random(kv_n),
                         .q = upload_random(q_n), .out = upload(g_gpu, NULL, q_n), .n_tokens = L,
                         .n_seqs = 1, .q_begin = qb, .sel_begin = sb, .sel_slots = sel,
                         .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                         .scale = 1.0f / sqrtf((float)D)};
    const int32_t *arrays[3] = {qb, sb, sel};
    const size_t counts[3] = {2, 2, (size_t)L};
    g_gpu->ops->stage_step(g_gpu, arrays, counts, 3);
    const double flops = 4.0 * H * D * ((double)L * (L + 1) / 2); /* QK^T + PV, causal */
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "tokens", L);
    cJSON_AddNumberToObject(e, "flops", flops);
    printf("%8d", L);
    bench_point(&a, q_n, reps, profile, flops, gemm_fps, 1e-12, "tflops", e);
    cJSON_AddItemToArray(arr, e);
    g_gpu->ops->unstage(g_gpu);
    g_gpu->ops->release(g_gpu, (void *)a.k_cache), g_gpu->ops->release(g_gpu, (void *)a.v_cache);
    g_gpu->ops->release(g_gpu, (void *)a.q), g_gpu->ops->release(g_gpu, a.out);
    free(sel);
}

/* ---- bench: decode attention by KV format (lethe's op) ------------------------ */

/* KV formats of the format table: bf16 (the native cache), FP8 E4M3, KIVI */
#define FMT_BF16 0
#define FMT_FP8 1
#define FMT_KIVI 2 /* + bits in the low byte of the list entry */
#define MAX_FMTS 8

static const char *fmt_name(int f, char *buf, size_t n) {
    if (f == FMT_BF16) return "bf16";
    if (f == FMT_FP8) return "fp8_e4m3";
    snprintf(buf, n, "kivi%d", f >> 8);
    return buf;
}

static void *alloc_dev(size_t n_bytes) {
    void *p = NULL;
    if (g_gpu->ops->alloc(g_gpu, n_bytes ? n_bytes : 1, &p) != LETHE_OK) {
        fprintf(stderr, "attn_bench: %s\n", lethe_last_error());
        exit(1);
    }
    return p;
}

/* Decode attention alone at one (batch, ctx) for every format in fmts, all
 * through ops->attention: bf16 over random K / V; FP8 and KIVI over codes
 * quantized from that same K / V by ops->kv_store_quant (KIVI: every complete
 * group of G consecutive slots packed, the tail in the residual), so each
 * output is compared with the bf16 one. Bytes read per call: the K and V
 * payload (bf16 values / codes) plus the scales or group parameters
 * (FP8: 2 x 4 bytes per slot and KV head; KIVI: per-token V params and the K
 * group table), not the slot indices (4 bytes per entry for every format). */
static void bench_formats(int H, int KV, int D, int32_t B, int32_t L, int G, const int *fmts,
                          int n_fmts, double copy_bps, int reps, bool profile, cJSON *arr) {
    const size_t slots = (size_t)B * L, kv_n = slots * KV * D, q_n = (size_t)B * H * D;
    const size_t C = (size_t)KV * D;
    void *kb = upload_random(kv_n), *vb = upload_random(kv_n);
    lethe_attn_args a = {.q = upload_random(q_n), .out = upload(g_gpu, NULL, q_n), .n_tokens = B,
                         .n_seqs = B, .n_heads = H, .n_kv_heads = KV, .head_dim = D,
                         .scale = 1.0f / sqrtf((float)D)};
    int32_t *qb = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
    int32_t *sb = lethe_xmalloc(((size_t)B + 1) * sizeof(int32_t));
    int32_t *sel = lethe_xmalloc(slots * sizeof(int32_t));
    for (int32_t s = 0; s <= B; s++) qb[s] = s, sb[s] = s * L;
    for (size_t e = 0; e < slots; e++) sel[e] = (int32_t)e;
    a.q_begin = qb, a.sel_begin = sb, a.sel_slots = sel;
    const int32_t *arrays[3] = {qb, sb, sel};
    const size_t counts[3] = {(size_t)B + 1, (size_t)B + 1, slots};
    float *ref = lethe_xmalloc(q_n * sizeof(float)), *outh = lethe_xmalloc(q_n * sizeof(float));
    double t_bf16 = 0;
    bool have_ref = false;
    /* kv_store_quant in chunks of CH tokens (a multiple of every G) */
    const size_t CH = 65536;
    int32_t *ch_slots = lethe_xmalloc(CH * sizeof(int32_t));
    const size_t act = g_gpu->ops->act_size;
    for (int fi = 0; fi < n_fmts; fi++) {
        const int f = fmts[fi];
        char nb[16];
        lethe_kv_quant kvq = {.format = LETHE_KV_NATIVE};
        lethe_kivi_plan plan = {.n_pack = 0};
        void *kc = kb, *vc = vb;
        double bytes = 2.0 * kv_n * g_gpu->ops->kv_size;
        void *extra[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
        int32_t *aux = NULL, *psrc = NULL, *pslot = NULL, *pent = NULL;
        if (f == FMT_FP8) {
            kvq.format = LETHE_KV_FP8_E4M3;
            kc = extra[0] = alloc_dev(kv_n), vc = extra[1] = alloc_dev(kv_n);
            kvq.k_scale = extra[2] = alloc_dev(slots * KV * sizeof(float));
            kvq.v_scale = extra[3] = alloc_dev(slots * KV * sizeof(float));
            bytes = 2.0 * kv_n + 2.0 * slots * KV * sizeof(float);
        } else if (f != FMT_BF16) {
            const int b = f >> 8;
            const size_t full = slots / (size_t)G; /* complete groups; the tail is residual */
            kvq.format = LETHE_KV_KIVI_FORMAT(b, G);
            kc = extra[0] = alloc_dev(slots * C * b / 8), vc = extra[1] = alloc_dev(slots * C * b / 8);
            kvq.v_param = extra[2] = alloc_dev(slots * 2 * (C / G) * sizeof(float));
            kvq.k_group = extra[3] = alloc_dev((full ? full : 1) * 2 * C * sizeof(float));
            kvq.k_res = extra[4] = alloc_dev((size_t)G * C * act);
            kvq.v_res = extra[5] = alloc_dev((size_t)G * C * act);
            kvq.n_groups = (int32_t)(full ? full : 1), kvq.n_res = G;
            aux = lethe_xmalloc(slots * sizeof(int32_t));
            for (size_t s = 0; s < slots; s++)
                aux[s] = s < full * G ? (int32_t)(s / G) : -1 - (int32_t)(s - full * G);
            psrc = lethe_xmalloc(CH * sizeof(int32_t)), pslot = lethe_xmalloc(CH * sizeof(int32_t));
            pent = lethe_xmalloc(CH / G * sizeof(int32_t));
            plan.slot_aux = aux;
            kvq.kivi = &plan;
            bytes = 2.0 * slots * C * b / 8 + 2.0 * slots * (C / G) * sizeof(float) +
                    2.0 * full * C * sizeof(float);
        }
        if (f != FMT_BF16) { /* quantize the bf16 cache into the format, CH slots at a time */
            for (size_t off = 0; off < slots; off += CH) {
                const size_t n = slots - off < CH ? slots - off : CH;
                for (size_t i = 0; i < n; i++) ch_slots[i] = (int32_t)(off + i);
                if (aux) {
                    const size_t full = slots / (size_t)G;
                    size_t np = 0;
                    for (size_t i = 0; i + G <= n && off + i + G <= full * G; i += G, np++) {
                        for (int j = 0; j < G; j++)
                            psrc[i + j] = (int32_t)(i + j), pslot[i + j] = (int32_t)(off + i + j);
                        pent[np] = (int32_t)((off + i) / G);
                    }
                    plan.n_pack = (int32_t)np, plan.pack_src = psrc, plan.pack_slot = pslot;
                    plan.pack_entry = pent;
                }
                g_gpu->ops->kv_store_quant(g_gpu, &kvq, kc, vc, (const char *)kb + off * C * act,
                                           (const char *)vb + off * C * act, ch_slots, (int32_t)n,
                                           KV, D);
            }
            plan.n_pack = 0;
            g_gpu->ops->sync(g_gpu);
        }
        a.k_cache = kc, a.v_cache = vc, a.kvq = f == FMT_BF16 ? NULL : &kvq;
        g_gpu->ops->stage_step(g_gpu, arrays, counts, 3);
        const double t = time_gen(&a, GEN_LETHE, reps, profile);
        g_gpu->ops->act_to_host(g_gpu, outh, a.out, q_n);
        g_gpu->ops->unstage(g_gpu);
        double diff = NAN;
        if (f == FMT_BF16) {
            memcpy(ref, outh, q_n * sizeof(float));
            have_ref = true, t_bf16 = t;
        } else if (have_ref) {
            diff = rel_err(outh, ref, q_n);
        }
        const double gbs = bytes / t * 1e-9, frac = copy_bps > 0 ? bytes / copy_bps / t : 0;
        printf("%6d %8d  %-10s %9.1f %9.1f %7.0f %7.1f%%", B, L, fmt_name(f, nb, sizeof nb),
               bytes * 1e-6, t * 1e6, gbs, 100 * frac);
        if (t_bf16 > 0 && f != FMT_BF16) printf("   %5.2fx  %.1e", t_bf16 / t, diff);
        printf("\n");
        fflush(stdout);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "batch", B);
        cJSON_AddNumberToObject(e, "ctx", L);
        cJSON_AddStringToObject(e, "format", fmt_name(f, nb, sizeof nb));
        if (f >> 8) cJSON_AddNumberToObject(e, "kivi_group", G);
        cJSON_AddNumberToObject(e, "bytes_read", bytes);
        cJSON_AddNumberToObject(e, "us", t * 1e6);
        cJSON_AddNumberToObject(e, "gb_s", gbs);
        cJSON_AddNumberToObject(e, "frac_copy", frac);
        if (t_bf16 > 0 && f != FMT_BF16) {
            cJSON_AddNumberToObject(e, "speedup_vs_bf16", t_bf16 / t);
            cJSON_AddNumberToObject(e, "rel_diff_vs_bf16", diff);
        }
        cJSON_AddItemToArray(arr, e);
        for (int i = 0; i < 6; i++)
            if (extra[i]) g_gpu->ops->release(g_gpu, extra[i]);
        free(aux), free(psrc), free(pslot), free(pent);
    }
    g_gpu->ops->release(g_gpu, kb), g_gpu->ops->release(g_gpu, vb);
    g_gpu->ops->release(g_gpu, (void *)a.q), g_gpu->ops->release(g_gpu, a.out);
    free(qb), free(sb), free(sel), free(ref), free(outh), free(ch_slots);
}

/* "bf16,fp8,kivi4,kivi2" -> format codes; "none" -> 0 formats */
static int parse_formats(const char *s, int *out) {
    if (!strcmp(s, "none")) return 0;
    int n = 0;
    for (const char *p = s; *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        int f = -1;
        if (len == 4 && !strncmp(p, "bf16", 4)) f = FMT_BF16;
        else if (len == 3 && !strncmp(p, "fp8", 3)) f = FMT_FP8;
        else if (len == 5 && !strncmp(p, "kivi", 4) && strchr("248", p[4])) f = FMT_KIVI | ((p[4] - '0') << 8);
        if (f < 0 || n == MAX_FMTS) {
            fprintf(stderr, "attn_bench: --kv '%s': expected up to %d of bf16, fp8, kivi2, kivi4, "
                            "kivi8 separated by commas, or none\n", s, MAX_FMTS);
            return -1;
        }
        out[n++] = f;
        p = end ? end + 1 : p + len;
    }
    return n;
}

/* ---- main ---------------------------------------------------------------------- */

static int parse_list(const char *s, int32_t *out, const char *flag) {
    int n = 0;
    for (const char *p = s; *p;) {
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || v > 1 << 24 || n == MAX_LIST || (*end && *end != ',')) {
            fprintf(stderr, "attn_bench: %s '%s': expected up to %d positive integers separated "
                            "by commas\n", flag, s, MAX_LIST);
            return -1;
        }
        out[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    return n;
}

int main(int argc, char **argv) {
    int32_t heads = 32, kv_heads = 8, head_dim = 128, reps = 20;
    int32_t kivi_group = 32;
    const char *batch = "8,32", *ctx = "16384,32768", *prefill = "8192", *json = NULL;
    const char *kv = "bf16,fp8,kivi4,kivi2";
    bool no_check = false, no_bench = false, profile = false;
    lethe_opt rows[] = {
        {"--heads", NULL, LETHE_OPT_INT, &heads, "N", "query heads (bench shape)", 1, 256},
        {"--kv-heads", NULL, LETHE_OPT_INT, &kv_heads, "N", "KV heads (divides --heads)", 1, 256},
        {"--head-dim", NULL, LETHE_OPT_INT, &head_dim, "D", "multiple of 8, <= 256", 8, 256},
        {"--batch", NULL, LETHE_OPT_STR, &batch, "LIST", "decode batch sizes", 1, 0},
        {"--ctx", NULL, LETHE_OPT_STR, &ctx, "LIST", "decode context lengths", 1, 0},
        {"--prefill", NULL, LETHE_OPT_STR, &prefill, "LIST", "prefill lengths (one seq)", 1, 0},
        {"--reps", NULL, LETHE_OPT_INT, &reps, "N", "timed calls per point", 1, 100000},
        {"--kv", NULL, LETHE_OPT_STR, &kv, "LIST",
         "KV formats of the decode-by-format table (bf16,fp8,kivi2,kivi4,kivi8 | none)", 1, 0},
        {"--kivi-group", NULL, LETHE_OPT_INT, &kivi_group, "G",
         "KIVI group (tokens per K group = channels per V group)", 16, 128},
        {"--no-check", NULL, LETHE_OPT_BOOL, &no_check, NULL, "skip the check vs the CPU", 1, 0},
        {"--no-bench", NULL, LETHE_OPT_BOOL, &no_bench, NULL, "skip the timings", 1, 0},
        {"--profile", NULL, LETHE_OPT_BOOL, &profile, NULL,
         "one call per generation and point in the profiler range", 1, 0},
        {"--json", NULL, LETHE_OPT_STR, &json, "PATH", "write the results as JSON", 1, 0},
    };
    int n_pos = 0;
    const int r = lethe_opts_parse(rows, (int)LETHE_ARRAY_LEN(rows), argc, argv,
                                   "attn_bench [options]",
                                   "CUDA attention kernel generations (v1, v2, lethe's op) against "
                                   "the CPU twin, then timed side by side (dev/cuda/README.md).",
                                   NULL, &n_pos, 0);
    if (r) return r > 0 ? 0 : 2;
    int32_t bs[MAX_LIST], cs[MAX_LIST], ps[MAX_LIST];
    const int nb = parse_list(batch, bs, "--batch"), nc = parse_list(ctx, cs, "--ctx");
    const int np = parse_list(prefill, ps, "--prefill");
    int fmts[MAX_FMTS];
    const int nf = parse_formats(kv, fmts);
    if (nb < 0 || nc < 0 || np < 0 || nf < 0) return 2;
    if (nf && (head_dim % kivi_group || (kivi_group & (kivi_group - 1)))) {
        fprintf(stderr, "attn_bench: --kivi-group must be a power of two dividing --head-dim\n");
        return 2;
    }
    if (heads % kv_heads || head_dim % 8) {
        fprintf(stderr, "attn_bench: --kv-heads must divide --heads and --head-dim be a multiple "
                        "of 8\n");
        return 2;
    }
    lethe_backend_params pc = {.device = "cpu", .n_threads = 0};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    if (lethe_backend_create(&pc, &g_cpu) != LETHE_OK ||
        lethe_backend_create(&pg, &g_gpu) != LETHE_OK) {
        fprintf(stderr, "attn_bench: %s\n", lethe_last_error());
        lethe_backend_destroy(g_cpu);
        return 1;
    }
    cJSON *root = cJSON_CreateObject();
    int fails = 0;
    if (!no_check) {
        printf("check: relative error vs the CPU twin (limit %.1e; n/a: the generation does not "
               "take the shape on this device)\n", CHECK_TOL);
        cJSON *arr = cJSON_AddArrayToObject(root, "check");
        for (size_t i = 0; i < LETHE_ARRAY_LEN(k_cases); i++)
            fails += check_case_run(&k_cases[i], arr);
        printf("check: %d failed\n", fails);
        cJSON_AddNumberToObject(root, "check_failed", fails);
    }
    if (!no_bench) {
        double copy_bps = 0, gemm_fps = 0;
        if (g_gpu->ops->measure_peaks(g_gpu, &copy_bps, &gemm_fps) != LETHE_OK) {
            fprintf(stderr, "attn_bench: %s\n", lethe_last_error());
            fails++;
        } else {
            printf("\ndevice: copy %.0f GB/s (read + write), GEMM %.1f TFLOP/s\n", copy_bps * 1e-9,
                   gemm_fps * 1e-12);
            cJSON_AddNumberToObject(root, "copy_gb_s", copy_bps * 1e-9);
            cJSON_AddNumberToObject(root, "gemm_tflops", gemm_fps * 1e-12);
            cJSON *shape = cJSON_AddObjectToObject(root, "shape");
            cJSON_AddNumberToObject(shape, "heads", heads);
            cJSON_AddNumberToObject(shape, "kv_heads", kv_heads);
            cJSON_AddNumberToObject(shape, "head_dim", head_dim);
            printf("\ndecode attention alone (H=%d KV=%d D=%d, bf16 KV, %d reps)\n", heads,
                   kv_heads, head_dim, reps);
            printf("%6s %8s | %4s %9s %8s %7s | %4s %9s %8s %7s | v2 gain  v1-v2 diff\n", "batch",
                   "ctx", "v1", "us/call", "GB/s", "of copy", "v2", "us/call", "GB/s", "of copy");
            cJSON *dec = cJSON_AddArrayToObject(root, "decode");
            for (int i = 0; i < nb; i++)
                for (int j = 0; j < nc; j++)
                    bench_decode(heads, kv_heads, head_dim, bs[i], cs[j], copy_bps, reps, profile,
                                 dec);
            if (nf) {
                printf("\ndecode attention by KV format (lethe's op; H=%d KV=%d D=%d, KIVI G=%d, "
                       "%d reps; MB read = K + V codes + scales / group params, not the slot "
                       "indices; diff = relative difference of the output from bf16's)\n",
                       heads, kv_heads, head_dim, kivi_group, reps);
                printf("%6s %8s  %-10s %9s %9s %7s %8s   %6s  %s\n", "batch", "ctx", "format",
                       "MB read", "us/call", "GB/s", "of copy", "vs bf16", "diff");
                cJSON *fa = cJSON_AddArrayToObject(root, "decode_kv");
                for (int i = 0; i < nb; i++)
                    for (int j = 0; j < nc; j++)
                        bench_formats(heads, kv_heads, head_dim, bs[i], cs[j], kivi_group, fmts,
                                      nf, copy_bps, reps, profile, fa);
            }
            printf("\nprefill attention alone (H=%d KV=%d D=%d, causal, one sequence, %d reps)\n",
                   heads, kv_heads, head_dim, reps);
            printf("%8s | %4s %9s %8s %7s | %4s %9s %8s %7s | v2 gain  v1-v2 diff\n", "tokens",
                   "v1", "us/call", "TFLOP/s", "of pk", "v2", "us/call", "TFLOP/s", "of pk");
            cJSON *pre = cJSON_AddArrayToObject(root, "prefill");
            for (int i = 0; i < np; i++)
                bench_prefill(heads, kv_heads, head_dim, ps[i], gemm_fps, reps, profile, pre);
        }
    }
    if (json) {
        char *txt = cJSON_Print(root);
        FILE *f = fopen(json, "w");
        bool ok = f && fputs(txt, f) >= 0;
        if (f && fclose(f) != 0) ok = false;
        if (!ok) {
            fprintf(stderr, "attn_bench: cannot write %s\n", json);
            fails++;
        }
        free(txt);
    }
    cJSON_Delete(root);
    lethe_backend_destroy(g_gpu);
    lethe_backend_destroy(g_cpu);
    return fails ? 1 : 0;
}

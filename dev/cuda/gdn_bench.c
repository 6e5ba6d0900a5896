/* gdn_bench.c - lethe's CUDA Gated DeltaNet kernels (src/backend/cuda/gdn.cu,
 * ops->gdn_rule and ops->gdn_conv) timed against their memory and compute
 * bounds, both measured in the same run.
 *
 * Shape: one linear-attention layer of --hk / --hv heads of --dk / --dv
 * (default Qwen3.6-27B: 16 k heads, 48 v heads of 128, conv kernel 4), so
 * conv_dim C = 2 Hk dk + Hv dv. Points:
 *   prefill S:L  S fresh sequences (position 0) of L rows each in one call:
 *                the chunked form (segments of LETHE_GDN_CHUNK rows, sub-chunks
 *                of 32 inside the kernel);
 *   decode B     B sequences of one row each at position --decode-pos,
 *                continuing from their states: the one-step update.
 * Per point and op: mean time per call over --reps calls after 3 warm-up
 * calls (host clock around a device sync), and the bound
 *   t_bound = max(bytes / copy bandwidth, flops / fp32 FMA peak)
 * with
 *   bytes (rule) = q | k | v rows read (n C) + a, b read (2 n Hv) + out
 *                  written (n Hv dv), activations of act_size bytes, + the f32
 *                  state [Hv, dk, dv] written per sequence and read per
 *                  continuing one (fresh sequences start from zeros);
 *   flops (rule) = per row and v head, the chunked form as gdn.cu runs it
 *                  with sub-chunks of CH = 32 rows: K S, q S and the state
 *                  update (2 dk dv each), the in-chunk products M, A (~CH dk
 *                  each), the triangular solve and A vn (~CH dv each):
 *                  6 dk dv + 2 CH (dk + dv); the one-step update 7 dk dv
 *                  (decay, S^T k, the rank-1 update, S^T q);
 *   bytes (conv) = x read + xc written (n C each) + the f32 conv state
 *                  [K - 1, C] per sequence; flops 2 K C per row (memory-bound).
 * The copy bandwidth (read + write bytes per second) comes from
 * ops->measure_peaks; the fp32 peak from dev_cuda_fp32_peak (gdn_peak.cu):
 * gdn.cu computes on the CUDA cores in fp32, so the bf16 GEMM peak is not its
 * ceiling (printed too, as the ceiling of a tensor-core chunked form). The
 * outputs are checked to be finite. --json writes everything. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/util.h"
#include "gdn_peak.h"
#include "options.h"

#define MAX_LIST 16
#define GDN_SUBCHUNK 32 /* gdn.cu's GDN_CH: rows per sub-chunk of the chunked form */

static lethe_backend *g_gpu;
static uint64_t g_rng = 2026;

typedef struct shape {
    int32_t Hk, Hv, dk, dv, K, C;
} shape;

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float urand(float lo, float hi) {
    return lo + (hi - lo) * (float)((lethe_splitmix64(&g_rng) >> 40) * (1.0 / 16777216.0));
}

/* n activations on the device, random in [lo, hi) (a 1M-value block repeated), or
 * NaN when lo > hi (poison: an unwritten output element is caught) */
static void *act_dev(size_t n, float lo, float hi) {
    const size_t block = (size_t)1 << 20, m = n < block ? n : block;
    float *h = lethe_xmalloc((m ? m : 1) * sizeof(float));
    for (size_t i = 0; i < m; i++) h[i] = lo > hi ? NAN : bf16_round(urand(lo, hi));
    void *p = NULL;
    if (g_gpu->ops->alloc(g_gpu, (n ? n : 1) * g_gpu->ops->act_size, &p) != LETHE_OK) {
        free(h);
        return NULL;
    }
    for (size_t off = 0; off < n; off += block)
        g_gpu->ops->act_from_host(g_gpu, (char *)p + off * g_gpu->ops->act_size, h,
                                  n - off < block ? n - off : block);
    free(h);
    return p;
}

static void *weight_dev(size_t n, float lo, float hi) {
    float *h = lethe_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = bf16_round(urand(lo, hi));
    void *p = NULL;
    if (g_gpu->ops->weight_upload(g_gpu, h, n, &p) != LETHE_OK) p = NULL;
    free(h);
    return p;
}

static bool all_finite(const void *dev, size_t n) {
    float *h = lethe_xmalloc(n * sizeof(float));
    g_gpu->ops->act_to_host(g_gpu, h, dev, n);
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) ok = isfinite(h[i]);
    free(h);
    return ok;
}

typedef void (*gdn_op)(lethe_backend *be, const lethe_gdn_args *a);

static double time_op(gdn_op op, const lethe_gdn_args *a, int reps) {
    for (int r = 0; r < 3; r++) op(g_gpu, a);
    g_gpu->ops->sync(g_gpu);
    const double t0 = lethe_time_s();
    for (int r = 0; r < reps; r++) op(g_gpu, a);
    g_gpu->ops->sync(g_gpu);
    return (lethe_time_s() - t0) / reps;
}

/* one op's line and JSON: time, GB/s, TFLOP/s, the bound and the share of it */
static void report(cJSON *e, const char *op, double t, double bytes, double flops, double copy_bps,
                   double fp32_fps, double gemm_fps) {
    const double tm = bytes / copy_bps, tc = flops / fp32_fps, tb = tm > tc ? tm : tc;
    printf(" | %-4s %9.1f %8.0f %8.2f %9.1f %-7s %6.1f%% %6.1f%%", op, t * 1e6, bytes / t * 1e-9,
           flops / t * 1e-12, tb * 1e6, tm >= tc ? "memory" : "compute", 100 * tb / t,
           100 * (flops / gemm_fps) / t);
    cJSON *o = cJSON_AddObjectToObject(e, op);
    cJSON_AddNumberToObject(o, "us", t * 1e6);
    cJSON_AddNumberToObject(o, "bytes", bytes);
    cJSON_AddNumberToObject(o, "flops", flops);
    cJSON_AddNumberToObject(o, "gb_s", bytes / t * 1e-9);
    cJSON_AddNumberToObject(o, "tflops", flops / t * 1e-12);
    cJSON_AddNumberToObject(o, "bound_us", tb * 1e6);
    cJSON_AddStringToObject(o, "bound", tm >= tc ? "memory" : "compute");
    cJSON_AddNumberToObject(o, "memory_bound_us", tm * 1e6);
    cJSON_AddNumberToObject(o, "compute_bound_us", tc * 1e6);
    cJSON_AddNumberToObject(o, "frac_bound", tb / t);
    cJSON_AddNumberToObject(o, "frac_gemm_peak", (flops / gemm_fps) / t);
}

/* S sequences of L rows each (decode: L = 1 at position pos0 > 0, continuing) */
static int run_point(const shape *sh, int32_t S, int32_t L, int32_t pos0, int reps, double copy_bps,
                     double fp32_fps, double gemm_fps, cJSON *arr) {
    const int32_t n = S * L, Hv = sh->Hv, C = sh->C;
    const size_t as = g_gpu->ops->act_size;
    const bool fresh = pos0 == 0;
    int32_t *qb = lethe_xmalloc(((size_t)S + 1) * sizeof(int32_t));
    int32_t *slots = lethe_xmalloc((size_t)S * sizeof(int32_t));
    int32_t *pos = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t s = 0; s <= S; s++) qb[s] = s * L;
    for (int32_t s = 0; s < S; s++) slots[s] = s;
    for (int32_t t = 0; t < n; t++) pos[t] = pos0 + t % L;
    void *x = act_dev((size_t)n * C, -1.0f, 1.0f), *xc = act_dev((size_t)n * C, 1.0f, 0.0f);
    void *a = act_dev((size_t)n * Hv, -2.0f, 2.0f), *b = act_dev((size_t)n * Hv, -3.0f, 3.0f);
    void *out = act_dev((size_t)n * Hv * sh->dv, 1.0f, 0.0f);
    void *w = weight_dev((size_t)C * sh->K, -0.5f, 0.5f);
    void *A = weight_dev((size_t)Hv, -1.0f, -0.01f), *dt = weight_dev((size_t)Hv, -0.2f, 0.2f);
    const size_t rec_b = (size_t)Hv * sh->dk * sh->dv * sizeof(float);
    const size_t conv_b = (size_t)(sh->K - 1) * C * sizeof(float);
    void *st = NULL, *cst = NULL;
    int fails = 0;
    if (!x || !xc || !a || !b || !out || !w || !A || !dt ||
        g_gpu->ops->alloc(g_gpu, (size_t)S * rec_b, &st) != LETHE_OK ||
        g_gpu->ops->alloc(g_gpu, (size_t)S * conv_b, &cst) != LETHE_OK) {
        fprintf(stderr, "gdn_bench: %d x %d rows do not fit: %s\n", S, L, lethe_last_error());
        fails = 1;
        goto done;
    }
    lethe_gdn_args g = {.n_tokens = n, .n_seqs = S, .q_begin = qb, .state_slots = slots, .pos = pos,
                        .x = x, .xc = xc, .conv_w = w, .conv_state = cst, .conv_dim = C,
                        .kernel = sh->K, .a = a, .b = b, .A = A, .dt_bias = dt, .state = st,
                        .out = out, .n_k_heads = sh->Hk, .n_v_heads = Hv, .k_dim = sh->dk,
                        .v_dim = sh->dv};
    if (!fresh) { /* continuing sequences: finite states first (one fresh row per sequence) */
        int32_t *p0 = lethe_xmalloc((size_t)n * sizeof(int32_t));
        for (int32_t t = 0; t < n; t++) p0[t] = t % L;
        lethe_gdn_args g0 = g;
        g0.pos = p0;
        g_gpu->ops->gdn_conv(g_gpu, &g0);
        g_gpu->ops->gdn_rule(g_gpu, &g0);
        g_gpu->ops->sync(g_gpu);
        free(p0);
    }
    /* conv: each call reads the same x and (continuing) the state it wrote the
     * call before: the same work every call */
    const double t_conv = time_op(g_gpu->ops->gdn_conv, &g, reps);
    const double t_rule = time_op(g_gpu->ops->gdn_rule, &g, reps);
    if (!all_finite(xc, (size_t)n * C) || !all_finite(out, (size_t)n * Hv * sh->dv)) {
        fprintf(stderr, "gdn_bench: %d x %d: non-finite output\n", S, L);
        fails = 1;
    }
    const double dkdv = (double)sh->dk * sh->dv;
    const double rule_bytes = (double)n * (C + 2.0 * Hv + (double)Hv * sh->dv) * (double)as +
                              (double)S * (double)rec_b * (fresh ? 1.0 : 2.0);
    const double rule_flops =
        (double)n * Hv *
        (L == 1 ? 7.0 * dkdv : 6.0 * dkdv + 2.0 * GDN_SUBCHUNK * ((double)sh->dk + sh->dv));
    const double conv_bytes = 2.0 * n * C * (double)as + (double)S * conv_b * (fresh ? 1.0 : 2.0);
    const double conv_flops = 2.0 * n * (double)C * sh->K;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "kind", fresh ? "prefill" : "decode");
    cJSON_AddNumberToObject(e, "seqs", S);
    cJSON_AddNumberToObject(e, "rows_per_seq", L);
    cJSON_AddNumberToObject(e, "pos", pos0);
    printf("%-7s %3d x %6d", fresh ? "prefill" : "decode", S, L);
    report(e, "rule", t_rule, rule_bytes, rule_flops, copy_bps, fp32_fps, gemm_fps);
    printf(" | rule %7.2f Mtok/s\n%18s", n / t_rule * 1e-6, "");
    cJSON_AddNumberToObject(e, "rule_tok_s", n / t_rule);
    report(e, "conv", t_conv, conv_bytes, conv_flops, copy_bps, fp32_fps, gemm_fps);
    printf("\n");
    fflush(stdout);
    cJSON_AddItemToArray(arr, e);
done:
    if (x) g_gpu->ops->release(g_gpu, x);
    if (xc) g_gpu->ops->release(g_gpu, xc);
    if (a) g_gpu->ops->release(g_gpu, a);
    if (b) g_gpu->ops->release(g_gpu, b);
    if (out) g_gpu->ops->release(g_gpu, out);
    if (w) g_gpu->ops->release(g_gpu, w);
    if (A) g_gpu->ops->release(g_gpu, A);
    if (dt) g_gpu->ops->release(g_gpu, dt);
    if (st) g_gpu->ops->release(g_gpu, st);
    if (cst) g_gpu->ops->release(g_gpu, cst);
    free(qb), free(slots), free(pos);
    return fails;
}

/* "S:L,S:L" (or "L": S = 1) */
static int parse_prefill(const char *s, int32_t *seqs, int32_t *lens) {
    int n = 0;
    for (const char *p = s; *p;) {
        char *end;
        long a = strtol(p, &end, 10), b = 0;
        if (end != p && *end == ':') {
            const char *q = end + 1;
            b = strtol(q, &end, 10);
            if (end == q) b = 0;
        } else {
            b = a, a = 1;
        }
        if (end == p || a <= 0 || b <= 0 || a * b > 1 << 22 || n == MAX_LIST || (*end && *end != ',')) {
            fprintf(stderr, "gdn_bench: --prefill '%s': expected up to %d S:L pairs (S x L <= 4M rows)\n",
                    s, MAX_LIST);
            return -1;
        }
        seqs[n] = (int32_t)a, lens[n++] = (int32_t)b;
        p = *end ? end + 1 : end;
    }
    return n;
}

static int parse_list(const char *s, int32_t *out, const char *flag) {
    int n = 0;
    for (const char *p = s; *p;) {
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p || v <= 0 || v > 1 << 16 || n == MAX_LIST || (*end && *end != ',')) {
            fprintf(stderr, "gdn_bench: %s '%s': expected up to %d positive integers\n", flag, s,
                    MAX_LIST);
            return -1;
        }
        out[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    return n;
}

int main(int argc, char **argv) {
    int32_t hk = 16, hv = 48, dk = 128, dv = 128, kern = 4, reps = 10, dpos = 32768;
    const char *prefill = "1:8192,1:32768,1:131072,8:8192", *decode = "1,8,64", *json = NULL;
    lethe_opt rows[] = {
        {"--hk", NULL, LETHE_OPT_INT, &hk, "N", "k heads", 1, 256},
        {"--hv", NULL, LETHE_OPT_INT, &hv, "N", "v heads (a multiple of --hk)", 1, 1024},
        {"--dk", NULL, LETHE_OPT_INT, &dk, "D", "k head dim", 1, 256},
        {"--dv", NULL, LETHE_OPT_INT, &dv, "D", "v head dim", 1, 1024},
        {"--kernel", NULL, LETHE_OPT_INT, &kern, "K", "conv taps", 2, 16},
        {"--prefill", NULL, LETHE_OPT_STR, &prefill, "S:L,...", "prefill points: S sequences of L rows", 1, 0},
        {"--decode", NULL, LETHE_OPT_STR, &decode, "LIST", "decode batch sizes (one row each)", 1, 0},
        {"--decode-pos", NULL, LETHE_OPT_INT, &dpos, "P", "position of the decode rows", 1, 1 << 24},
        {"--reps", NULL, LETHE_OPT_INT, &reps, "N", "timed calls per point", 1, 100000},
        {"--json", NULL, LETHE_OPT_STR, &json, "PATH", "write the results as JSON", 1, 0},
    };
    int n_pos = 0;
    const int r = lethe_opts_parse(rows, (int)LETHE_ARRAY_LEN(rows), argc, argv, "gdn_bench [options]",
                                   "lethe's CUDA Gated DeltaNet kernels (gdn_rule, gdn_conv) against "
                                   "their memory / compute bounds measured in the same run.",
                                   NULL, &n_pos, 0);
    if (r) return r > 0 ? 0 : 2;
    int32_t ps[MAX_LIST], pl[MAX_LIST], db[MAX_LIST];
    const int np = parse_prefill(prefill, ps, pl), nd = parse_list(decode, db, "--decode");
    if (np < 0 || nd < 0) return 2;
    if (hv % hk) {
        fprintf(stderr, "gdn_bench: --hk must divide --hv\n");
        return 2;
    }
    const shape sh = {.Hk = hk, .Hv = hv, .dk = dk, .dv = dv, .K = kern, .C = 2 * hk * dk + hv * dv};
    lethe_backend_params pg = {.device = "cuda", .device_index = 0};
    if (lethe_backend_create(&pg, &g_gpu) != LETHE_OK) {
        fprintf(stderr, "gdn_bench: %s\n", lethe_last_error());
        return 1;
    }
    double copy_bps = 0, gemm_fps = 0;
    const double fp32_fps = dev_cuda_fp32_peak();
    if (g_gpu->ops->measure_peaks(g_gpu, &copy_bps, &gemm_fps) != LETHE_OK || fp32_fps <= 0) {
        fprintf(stderr, "gdn_bench: measuring the peaks failed: %s\n", lethe_last_error());
        lethe_backend_destroy(g_gpu);
        return 1;
    }
    printf("device: copy %.0f GB/s (read + write), fp32 FMA %.1f TFLOP/s, bf16 GEMM %.1f TFLOP/s\n",
           copy_bps * 1e-9, fp32_fps * 1e-12, gemm_fps * 1e-12);
    printf("shape: Hk %d Hv %d dk %d dv %d, conv %d taps (C = %d), %d reps\n", hk, hv, dk, dv, kern,
           sh.C, reps);
    printf("%-7s %3s   %6s | %-4s %9s %8s %8s %9s %-7s %7s %7s\n", "", "S", "rows", "op", "us/call",
           "GB/s", "TFLOP/s", "bound us", "bound", "of bnd", "of mma");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "copy_gb_s", copy_bps * 1e-9);
    cJSON_AddNumberToObject(root, "fp32_tflops", fp32_fps * 1e-12);
    cJSON_AddNumberToObject(root, "gemm_tflops", gemm_fps * 1e-12);
    cJSON *shp = cJSON_AddObjectToObject(root, "shape");
    cJSON_AddNumberToObject(shp, "n_k_heads", hk);
    cJSON_AddNumberToObject(shp, "n_v_heads", hv);
    cJSON_AddNumberToObject(shp, "k_dim", dk);
    cJSON_AddNumberToObject(shp, "v_dim", dv);
    cJSON_AddNumberToObject(shp, "kernel", kern);
    cJSON *arr = cJSON_AddArrayToObject(root, "points");
    int fails = 0;
    for (int i = 0; i < np; i++)
        fails += run_point(&sh, ps[i], pl[i], 0, reps, copy_bps, fp32_fps, gemm_fps, arr);
    for (int i = 0; i < nd; i++)
        fails += run_point(&sh, db[i], 1, dpos, reps, copy_bps, fp32_fps, gemm_fps, arr);
    if (json) {
        char *txt = cJSON_Print(root);
        FILE *f = fopen(json, "w");
        bool ok = f && fputs(txt, f) >= 0;
        if (f && fclose(f) != 0) ok = false;
        if (!ok) {
            fprintf(stderr, "gdn_bench: cannot write %s\n", json);
            fails++;
        }
        free(txt);
    }
    cJSON_Delete(root);
    lethe_backend_destroy(g_gpu);
    return fails ? 1 : 0;
}

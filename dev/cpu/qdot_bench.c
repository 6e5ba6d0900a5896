/* dev/cpu/qdot_bench.c - the CPU stored-format matmul (--cpu-weights
 * native) alone, at the shapes of a model's layers: the fastest of R
 * repetitions (the minimum, robust to a shared machine) in GMAC/s, for
 * prefill-sized n and decode n = 1.
 *
 *   build-cpu/dev/cpu/qdot_bench [--type q4_1] [--n 512] [--threads 1] [--reps 20]
 *                                [--shapes 576x576,192x576,1536x576,576x1536]
 *
 * Shapes are rows x cols (W [rows, cols], y = x W^T); the default is
 * SmolLM2-135M's q/o, k/v, gate/up and down. Random blocks with f16 scales
 * in a normal range; x uniform in [-1, 1]. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/ggml_types.h"
#include "core/util.h"

static uint64_t g_rng = 0x5eedull;
static uint32_t rnd(void) { return (uint32_t)(lethe_splitmix64(&g_rng) >> 32); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* random blocks; every aligned 2-byte f16 made a small positive scale-like
 * value so no block is inf/NaN (the formats' scales sit at various offsets) */
static void fill(uint8_t *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)rnd();
    for (size_t i = 0; i + 1 < bytes; i += 2) {
        uint16_t h = (uint16_t)(((6 + rnd() % 7) << 10) | (rnd() & 0x3ff));
        if ((p[i + 1] & 0x7c) == 0x7c) memcpy(p + i, &h, 2); /* inf / NaN pattern only */
    }
}

int main(int argc, char **argv) {
    const char *type = "q4_1", *shapes = "576x576,192x576,1536x576,576x1536";
    int n = 512, threads = 1, reps = 20;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "qdot_bench: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--type")) type = v;
        else if (!strcmp(a, "--n")) n = atoi(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--reps")) reps = atoi(v);
        else if (!strcmp(a, "--shapes")) shapes = v;
        else { fprintf(stderr, "qdot_bench: unknown option %s\n", a); return 2; }
        i++;
    }
    lethe_ggml_type t = LETHE_GGML_F32;
    for (int k = 0; k <= LETHE_GGML_BF16; k++)
        if (lethe_ggml_block_size((lethe_ggml_type)k) && !strcmp(lethe_ggml_type_name((lethe_ggml_type)k), type))
            t = (lethe_ggml_type)k;
    if (t == LETHE_GGML_F32 || n < 1 || threads < 1 || reps < 1) {
        fprintf(stderr, "qdot_bench: bad --type/--n/--threads/--reps\n");
        return 2;
    }
    lethe_backend_params bp = {.device = "cpu", .n_threads = threads,
                               .cpu_weights = LETHE_CPU_WEIGHTS_NATIVE};
    lethe_backend *be = NULL;
    if (lethe_backend_create(&bp, &be) != LETHE_OK) {
        fprintf(stderr, "qdot_bench: %s\n", lethe_last_error());
        return 1;
    }
    printf("%-11s %5s %8s %10s\n", "shape", "n", "ms", "GMAC/s");
    double total_ms = 0;
    for (const char *s = shapes; *s;) {
        int rows = 0, cols = 0, used = 0;
        if (sscanf(s, "%dx%d%n", &rows, &cols, &used) != 2 || rows < 1 || cols < 1) {
            fprintf(stderr, "qdot_bench: bad shape list at '%s'\n", s);
            return 2;
        }
        s += used + (s[used] == ',');
        const size_t el = (size_t)rows * cols, bytes = lethe_ggml_type_size(t, (uint64_t)el);
        uint8_t *data = lethe_xmalloc(bytes);
        fill(data, bytes);
        lethe_weight_raw raw = {.type = t, .rows = rows, .cols = cols, .data = data};
        void *w = NULL;
        if (be->ops->weight_upload_raw(be, &raw, &w) != LETHE_OK) {
            fprintf(stderr, "qdot_bench: %s\n", lethe_last_error());
            return 1;
        }
        float *x = lethe_xmalloc((size_t)n * cols * 4), *y = lethe_xmalloc((size_t)n * rows * 4);
        for (size_t i = 0; i < (size_t)n * cols; i++) x[i] = (float)(rnd() % 2001) * 1e-3f - 1.0f;
        double best = 1e30;
        for (int r = 0; r < reps + 2; r++) {
            const double t0 = now_s();
            be->ops->matmul(be, y, x, w, n, rows, cols);
            const double dt = now_s() - t0;
            if (r >= 2 && dt < best) best = dt; /* two warm-up calls */
        }
        total_ms += best * 1e3;
        printf("%5dx%-5d %5d %8.3f %10.2f\n", rows, cols, n, best * 1e3,
               (double)n * (double)el / best * 1e-9);
        be->ops->release(be, w);
        free(x), free(y), free(data);
    }
    printf("total %.3f ms\n", total_ms);
    lethe_backend_destroy(be);
    return 0;
}

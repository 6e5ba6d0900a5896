/* qmatmul.c - matmul on weights kept in their stored format.
 *
 * GGUF weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and the other
 * block formats ggml_types.c decodes) and f16/bf16 matrices stay in memory as
 * the file stores them: a decode step then streams ~5-8 bits per weight
 * instead of 32, which is what bounds decode speed on a CPU.
 *
 * Exactness: every weight element is decoded to the very f32 value
 * lethe_ggml_dequantize gives it (the same float operations, in registers),
 * and the dot product runs in the f32 GEMM's fixed order (matmul.c). So
 * y = x W^T here is bit-identical to the f32 matmul on the dequantized
 * matrix (`--cpu-weights fp32`, the reference), whatever n, the tier or the
 * thread count: activations are not quantized, batch invariance holds, and
 * the HF parity fixtures hold for both paths. Two ways to get there:
 *   n <= SMALL_N  (decode): the W rows are decoded in registers, block by
 *                 block, and multiplied with the m x rows at once
 *                 (qmatmul_avx2.c); nothing is written but y;
 *   n > SMALL_N   (prefill, big decode batches): a panel of PANEL rows of W
 *                 is dequantized into the thread's scratch (f32, stays in
 *                 L2) and multiplied with all n rows by the f32 tiles.
 * Threads split W into row ranges (each output column is one thread's). */
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/qdot.h"
#include "core/util.h"

#define SMALL_N 2     /* rows of x the register kernels take at once */
#define PANEL 48      /* rows of W per dequantized panel */
#define SMALL_ROWS 16 /* rows of W per task on the register path */
#define QX_ROWS 32    /* rows of x per task of the 16-bit rounding */

static lethe_cpu_ctx *ctx_of(const lethe_backend *be) { return be->ctx; }

/* ---- registry (sorted by data pointer; filled at load, read by ops) ---- */

static int find_slot(const lethe_cpu_ctx *c, const void *p) { /* first entry with data >= p */
    int lo = 0, hi = c->n_qw;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if ((const uint8_t *)c->qw[mid].data < (const uint8_t *)p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

const lethe_cpu_qweight *lethe_cpu_qweight_find(const lethe_backend *be, const void *p) {
    const lethe_cpu_ctx *c = ctx_of(be);
    if (!c || !c->n_qw || !p) return NULL;
    int i = find_slot(c, p);
    if (i < c->n_qw && c->qw[i].data == p) return &c->qw[i];
    if (i > 0) { /* p inside the previous weight: an offset into blocks is a bug */
        const lethe_cpu_qweight *q = &c->qw[i - 1];
        LETHE_ASSERT(!((const uint8_t *)p < q->data + (size_t)q->rows * q->row_bytes));
    }
    return NULL;
}

static bool type_supported(lethe_ggml_type t) {
    switch (t) {
    case LETHE_GGML_F16:
    case LETHE_GGML_BF16:
    case LETHE_GGML_Q4_0:
    case LETHE_GGML_Q4_1:
    case LETHE_GGML_Q5_0:
    case LETHE_GGML_Q5_1:
    case LETHE_GGML_Q8_0:
    case LETHE_GGML_Q2_K:
    case LETHE_GGML_Q3_K:
    case LETHE_GGML_Q4_K:
    case LETHE_GGML_Q5_K:
    case LETHE_GGML_Q6_K: return true;
    default: return false;
    }
}

lethe_status lethe_cpu_weight_upload_raw(lethe_backend *be, const lethe_weight_raw *w, void **out) {
    lethe_cpu_ctx *c = ctx_of(be);
    /* f16/bf16 rows of a multiple of 8 keep the f32 order without a tail */
    const bool shape_ok = w->rows > 0 && w->cols > 0 && w->rows <= INT32_MAX &&
                          w->cols <= INT32_MAX &&
                          (lethe_ggml_block_size(w->type) > 1 || w->cols % 8 == 0);
    if (c->cpu_weights == LETHE_CPU_WEIGHTS_FP32 || !type_supported(w->type) || !shape_ok ||
        !lethe_ggml_type_size(w->type, (uint64_t)w->cols))
        return LETHE_ERR_UNSUPPORTED;
    lethe_cpu_qweight q = {.type = w->type,
                           .rows = (int32_t)w->rows,
                           .cols = (int32_t)w->cols,
                           .row_bytes = lethe_ggml_type_size(w->type, (uint64_t)w->cols)};
    size_t n = q.row_bytes * (size_t)q.rows, alloc = (n + 63) / 64 * 64;
    q.data = aligned_alloc(64, alloc);
    if (!q.data) return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes", n);
    memcpy(q.data, w->data, n);
    if (c->n_qw == c->cap_qw) {
        int cap = c->cap_qw ? 2 * c->cap_qw : 64;
        lethe_cpu_qweight *g = realloc(c->qw, (size_t)cap * sizeof(*g));
        if (!g) {
            free(q.data);
            return lethe_errorf(LETHE_ERR_NOMEM, "cpu backend: out of memory");
        }
        c->qw = g, c->cap_qw = cap;
    }
    int i = find_slot(c, q.data);
    memmove(c->qw + i + 1, c->qw + i, (size_t)(c->n_qw - i) * sizeof(*c->qw));
    c->qw[i] = q;
    c->n_qw++;
    *out = q.data;
    return LETHE_OK;
}

bool lethe_cpu_qweight_release(lethe_backend *be, void *p) {
    lethe_cpu_ctx *c = ctx_of(be);
    if (!c || !c->n_qw) return false;
    int i = find_slot(c, p);
    if (i >= c->n_qw || c->qw[i].data != p) return false;
    free(c->qw[i].data);
    memmove(c->qw + i, c->qw + i + 1, (size_t)(c->n_qw - i - 1) * sizeof(*c->qw));
    c->n_qw--;
    return true;
}

void lethe_cpu_qweight_free_all(lethe_cpu_ctx *c) {
    for (int i = 0; i < LETHE_CPU_MAX_THREADS; i++) free(c->panel[i]);
    free(c->qx);
    c->qx = NULL, c->qx_cap = 0;
    for (int i = 0; i < c->n_qw; i++) free(c->qw[i].data);
    free(c->qw);
    c->qw = NULL;
    c->n_qw = c->cap_qw = 0;
}

void lethe_cpu_qweight_rows(const lethe_cpu_qweight *w, int32_t r0, int32_t r1, float *dst) {
    LETHE_ASSERT(0 <= r0 && r0 <= r1 && r1 <= w->rows);
    lethe_ggml_dequantize_serial(w->type, w->data + (size_t)r0 * w->row_bytes, dst,
                                 (uint64_t)(r1 - r0) * (uint64_t)w->cols);
}

/* ---- matmul ---- */

/* worker's panel scratch [PANEL, cols] f32, grown on first use */
static float *panel_scratch(lethe_cpu_ctx *c, int worker, size_t n_floats) {
    LETHE_ASSERT(worker >= 0 && worker < LETHE_CPU_MAX_THREADS);
    if (c->panel_cap[worker] < n_floats) {
        free(c->panel[worker]);
        c->panel[worker] = aligned_alloc(64, (n_floats * sizeof(float) + 63) / 64 * 64);
        LETHE_ASSERT(c->panel[worker]); /* a few hundred KB; ops cannot fail */
        c->panel_cap[worker] = n_floats;
    }
    return c->panel[worker];
}

/* y columns [j0, j1) for all n rows through dequantized panels */
static void panel_rows(lethe_cpu_ctx *c, int worker, const lethe_cpu_qweight *w, lethe_cpu_isa isa,
                       float *y, const float *x, int32_t n, int32_t j0, int32_t j1) {
    const int32_t in = w->cols;
    float *p = panel_scratch(c, worker, (size_t)PANEL * in);
    for (int32_t j = j0; j < j1; j += PANEL) {
        int32_t nw = LETHE_MIN(PANEL, j1 - j);
        lethe_cpu_qweight_rows(w, j, j + nw, p);
        lethe_cpu_gemm_block(isa, x, p, y + j, in, w->rows, n, nw);
    }
}

typedef struct qjob {
    lethe_cpu_ctx *c;
    const lethe_cpu_qweight *w;
    lethe_cpu_isa isa;
    bool small;
    int32_t per, n;
    float *y;
    const float *x;
    const lethe_qx_rows *xq; /* 16-bit activations (qdot.c), or NULL */
} qjob;

static void qtask(void *ctx, int t, int worker) {
    const qjob *j = ctx;
    const int32_t out = j->w->rows, j0 = t * j->per, j1 = LETHE_MIN(out, j0 + j->per);
    if (j->xq) {
        void *s = panel_scratch(j->c, worker, lethe_cpu_qdot_scratch_bytes(j->w->cols) / 4 + 1);
        lethe_cpu_qdot_rows(j->isa, j->w, j0, j1, j->xq, j->y + j0, out, s);
    } else if (!j->small || !lethe_cpu_qrows_avx2(j->w, j0, j1, j->x, j->n, j->y + j0, out)) {
        panel_rows(j->c, worker, j->w, j->isa, j->y, j->x, j->n, j0, j1);
    }
}

typedef struct qxjob {
    lethe_cpu_isa isa;
    const float *x;
    const lethe_qx_rows *xq;
} qxjob;

static void qxtask(void *ctx, int t, int worker) {
    const qxjob *j = ctx;
    const int32_t r0 = t * QX_ROWS, r1 = LETHE_MIN(j->xq->n, r0 + QX_ROWS);
    lethe_cpu_qx_quantize_rows(j->isa, j->x, j->xq, r0, r1);
}

/* x rounded to 16 bits into the context's scratch, QX_ROWS rows per task
 * (rows are independent: the same bits however they are shared) */
static const lethe_qx_rows *quantize_x(lethe_backend *be, lethe_cpu_ctx *c, const float *x,
                                       int32_t n, int32_t cols, int nt, lethe_qx_rows *out) {
    const size_t need = lethe_cpu_qx_bytes(n, cols);
    if (c->qx_cap < need) {
        free(c->qx);
        c->qx = aligned_alloc(64, (need + 63) / 64 * 64);
        LETHE_ASSERT(c->qx); /* 2 n x cols bytes: ops cannot fail */
        c->qx_cap = need;
    }
    lethe_cpu_qx_layout(n, cols, c->qx, out);
    if (n <= QX_ROWS) {
        lethe_cpu_qx_quantize_rows(c->isa, x, out, 0, n);
    } else {
        qxjob j = {c->isa, x, out};
        lethe_cpu_parallel(be, nt, LETHE_CEIL_DIV(n, QX_ROWS), qxtask, &j);
    }
    return out;
}

void lethe_cpu_qmatmul(lethe_backend *be, const lethe_cpu_qweight *w, float *y, const float *x,
                       int32_t n) {
    lethe_cpu_ctx *c = ctx_of(be);
    const lethe_cpu_isa isa = c->isa;
    lethe_qx_rows xq;
    if (c->cpu_weights == LETHE_CPU_WEIGHTS_NATIVE && lethe_cpu_qdot_supported(w->type, w->cols)) {
        const double flops = 2.0 * n * w->rows * w->cols;
        const int nt = flops < 2e5 ? 1 : lethe_cpu_threads(be);
        /* long contiguous row ranges (4 per thread): each thread streams W in
         * memory order, which is what the prefetchers follow; whole groups of
         * QDOT_G rows for the prefill tile */
        int32_t per = LETHE_MAX(SMALL_ROWS, LETHE_CEIL_DIV(w->rows, 4 * nt));
        qjob j = {c, w, isa, true, LETHE_CEIL_DIV(per, QDOT_G) * QDOT_G, n, y, x,
                  quantize_x(be, c, x, n, w->cols, nt, &xq)};
        lethe_cpu_parallel(be, nt, LETHE_CEIL_DIV(w->rows, j.per), qtask, &j);
        return;
    }
    const bool small = n <= SMALL_N && isa >= LETHE_ISA_AVX2;
    qjob j = {c, w, isa, small, small ? SMALL_ROWS : PANEL, n, y, x, NULL};
    const double flops = 2.0 * n * w->rows * w->cols;
    lethe_cpu_parallel(be, flops < 2e5 ? 1 : lethe_cpu_threads(be), /* as matmul.c */
                       LETHE_CEIL_DIV(w->rows, j.per), qtask, &j);
}

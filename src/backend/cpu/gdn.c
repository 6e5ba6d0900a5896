/* gdn.c - Gated DeltaNet on the CPU backend: the causal conv, the gated
 * delta rule (one-step and chunked), the gated output norm and the sigmoid
 * gate (definitions in backend.h, lethe_gdn_args; the CUDA twin is
 * backend/cuda/gdn.cu).
 *
 * The chunked form of one segment of L <= LETHE_GDN_CHUNK rows (one v head,
 * state S [dk, dv], rows i, j in [0, L), q already normalised and scaled):
 *   cum_i  = g_0 + ... + g_i                            (in-chunk log decay)
 *   kb_i   = beta_i k_i,  vb_i = beta_i v_i
 *   M[i,j] = (kb_i . k_j) exp(cum_i - cum_j)            for j < i
 *   u_i    = vb_i - sum_{j<i} M[i,j] u_j                (forward substitution:
 *   w_i    = exp(cum_i) kb_i - sum_{j<i} M[i,j] w_j      (I + M)^-1 [vb | kb e^cum])
 *   vn_i   = u_i - S^T w_i                              (the delta correction)
 *   out_i  = S^T (exp(cum_i) q_i) + sum_{j<=i} (q_i . k_j) exp(cum_i - cum_j) vn_j
 *   S      = exp(cum_{L-1}) S + sum_j exp(cum_{L-1} - cum_j) k_j vn_j^T
 * which unrolls to the per-token recurrence (the DeltaNet papers' UT
 * transform; transformers' torch_chunk_gated_delta_rule computes the same).
 * A task is one (sequence, v head): its rows in order, so a sequence's result
 * never depends on the other sequences of the batch or the thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

#define GDN_CONV_MAX 16 /* kernel width bound (config.c) */

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch threshold 20 */

/* ---- causal conv ---- */

typedef struct conv_job {
    const lethe_gdn_args *a;
    int32_t n_blocks; /* channel blocks per sequence */
} conv_job;

#define CONV_BLOCK 256 /* channels per task */

static void conv_task(void *ctx, int task, int worker) {
    const conv_job *j = ctx;
    const lethe_gdn_args *a = j->a;
    const int32_t s = task / j->n_blocks, blk = task % j->n_blocks;
    const int32_t C = a->conv_dim, K = a->kernel, t0 = a->q_begin[s], n = a->q_begin[s + 1] - t0;
    const int32_t c0 = blk * CONV_BLOCK, c1 = LETHE_MIN(C, c0 + CONV_BLOCK);
    if (n == 0) return;
    const float *x = a->x, *w = a->conv_w;
    float *xc = a->xc;
    float *st = (float *)a->conv_state + (size_t)a->state_slots[s] * (K - 1) * C;
    const bool fresh = a->pos[t0] == 0;
    for (int32_t c = c0; c < c1; c++) {
        float win[GDN_CONV_MAX]; /* the last K - 1 inputs before the row, oldest first */
        for (int32_t i = 0; i < K - 1; i++) win[i] = fresh ? 0.0f : st[(size_t)i * C + c];
        const float *wc = w + (size_t)c * K;
        for (int32_t t = 0; t < n; t++) {
            const float xt = x[(size_t)(t0 + t) * C + c];
            float acc = 0.0f;
            for (int32_t i = 0; i < K - 1; i++) acc += wc[i] * win[i];
            acc += wc[K - 1] * xt;
            xc[(size_t)(t0 + t) * C + c] = silu(acc);
            for (int32_t i = 0; i + 1 < K - 1; i++) win[i] = win[i + 1];
            if (K > 1) win[K - 2] = xt;
        }
        for (int32_t i = 0; i < K - 1; i++) st[(size_t)i * C + c] = win[i];
    }
}

void lethe_cpu_gdn_conv(lethe_backend *be, const lethe_gdn_args *a) {
    LETHE_ASSERT(a->kernel >= 2 && a->kernel <= GDN_CONV_MAX && a->conv_dim > 0);
    conv_job j = {a, (a->conv_dim + CONV_BLOCK - 1) / CONV_BLOCK};
    const int nt = (size_t)a->n_tokens * a->conv_dim < 65536 ? 1 : lethe_cpu_threads(be);
    lethe_cpu_parallel(be, nt, a->n_seqs * j.n_blocks, conv_task, &j);
}

/* ---- the delta rule ---- */

typedef struct rule_job {
    const lethe_gdn_args *a;
} rule_job;

/* x * rsqrt(sum(x^2) + 1e-6) (transformers' l2norm), then * scale */
static void l2norm_scaled(float *dst, const float *x, int32_t d, float scale) {
    float ss = 0.0f;
    for (int32_t i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int32_t i = 0; i < d; i++) dst[i] = x[i] * r * scale;
}

static float dot(const float *x, const float *y, int32_t d) {
    float s = 0.0f;
    for (int32_t i = 0; i < d; i++) s += x[i] * y[i];
    return s;
}

/* scratch of one task: L rows of q, k, w [dk]; v, u, vn [dv]; M [L, L]; cum, beta [L] */
typedef struct rule_scratch {
    float *q, *k, *w, *v, *u, *vn, *M, *cum, *beta, *tmp;
} rule_scratch;

/* one token: S = e^g S; S += k (beta (v - S^T k))^T; out = S^T q */
static void rule_step(float *S, const float *q, const float *k, const float *v, float g,
                      float beta, float *out, float *tmp, int32_t dk, int32_t dv) {
    const float decay = expf(g);
    for (int32_t i = 0; i < dk * dv; i++) S[i] *= decay;
    for (int32_t c = 0; c < dv; c++) tmp[c] = 0.0f;
    for (int32_t r = 0; r < dk; r++)
        for (int32_t c = 0; c < dv; c++) tmp[c] += S[(size_t)r * dv + c] * k[r];
    for (int32_t c = 0; c < dv; c++) tmp[c] = (v[c] - tmp[c]) * beta;
    for (int32_t r = 0; r < dk; r++)
        for (int32_t c = 0; c < dv; c++) S[(size_t)r * dv + c] += k[r] * tmp[c];
    for (int32_t c = 0; c < dv; c++) out[c] = 0.0f;
    for (int32_t r = 0; r < dk; r++)
        for (int32_t c = 0; c < dv; c++) out[c] += S[(size_t)r * dv + c] * q[r];
}

/* one segment of L rows in the chunked form (file comment) */
static void rule_chunk(float *S, const rule_scratch *w, int32_t L, float *out, int32_t out_ld,
                       int32_t dk, int32_t dv) {
    const float *q = w->q, *k = w->k, *cum = w->cum, *beta = w->beta;
    float *M = w->M, *u = w->u, *wk = w->w, *vn = w->vn;
    for (int32_t i = 0; i < L; i++)
        for (int32_t j = 0; j < i; j++)
            M[i * L + j] = beta[i] * dot(k + (size_t)i * dk, k + (size_t)j * dk, dk) *
                           expf(cum[i] - cum[j]);
    for (int32_t i = 0; i < L; i++) {
        float *ui = u + (size_t)i * dv, *wi = wk + (size_t)i * dk;
        const float ec = expf(cum[i]);
        for (int32_t c = 0; c < dv; c++) ui[c] = beta[i] * w->v[(size_t)i * dv + c];
        for (int32_t r = 0; r < dk; r++) wi[r] = beta[i] * k[(size_t)i * dk + r] * ec;
        for (int32_t j = 0; j < i; j++) {
            const float m = M[i * L + j];
            for (int32_t c = 0; c < dv; c++) ui[c] -= m * u[(size_t)j * dv + c];
            for (int32_t r = 0; r < dk; r++) wi[r] -= m * wk[(size_t)j * dk + r];
        }
        /* vn_i = u_i - S^T w_i */
        float *vni = vn + (size_t)i * dv;
        for (int32_t c = 0; c < dv; c++) vni[c] = 0.0f;
        for (int32_t r = 0; r < dk; r++)
            for (int32_t c = 0; c < dv; c++) vni[c] += S[(size_t)r * dv + c] * wi[r];
        for (int32_t c = 0; c < dv; c++) vni[c] = ui[c] - vni[c];
    }
    for (int32_t i = 0; i < L; i++) {
        float *oi = out + (size_t)i * out_ld;
        const float ec = expf(cum[i]);
        const float *qi = q + (size_t)i * dk;
        for (int32_t c = 0; c < dv; c++) oi[c] = 0.0f;
        for (int32_t r = 0; r < dk; r++) {
            const float qr = qi[r] * ec;
            for (int32_t c = 0; c < dv; c++) oi[c] += S[(size_t)r * dv + c] * qr;
        }
        for (int32_t j = 0; j <= i; j++) {
            const float aij = dot(qi, k + (size_t)j * dk, dk) * expf(cum[i] - cum[j]);
            for (int32_t c = 0; c < dv; c++) oi[c] += aij * vn[(size_t)j * dv + c];
        }
    }
    const float last = cum[L - 1], el = expf(last);
    for (int32_t i = 0; i < dk * dv; i++) S[i] *= el;
    for (int32_t j = 0; j < L; j++) {
        const float e = expf(last - cum[j]);
        for (int32_t r = 0; r < dk; r++) {
            const float kr = k[(size_t)j * dk + r] * e;
            float *Sr = S + (size_t)r * dv;
            for (int32_t c = 0; c < dv; c++) Sr[c] += kr * vn[(size_t)j * dv + c];
        }
    }
}

static void rule_task(void *ctx, int task, int worker) {
    const rule_job *job = ctx;
    const lethe_gdn_args *a = job->a;
    const int32_t Hv = a->n_v_heads, Hk = a->n_k_heads, dk = a->k_dim, dv = a->v_dim;
    const int32_t s = task / Hv, h = task % Hv, kh = h / (Hv / Hk);
    const int32_t t0 = a->q_begin[s], n = a->q_begin[s + 1] - t0;
    if (n == 0) return;
    const int32_t C = a->conv_dim, kd = Hk * dk, CH = LETHE_GDN_CHUNK;
    const float *xc = a->xc, *av = a->a, *bv = a->b, *A = a->A, *dtb = a->dt_bias;
    float *out = a->out;
    float *S = (float *)a->state + ((size_t)a->state_slots[s] * Hv + h) * dk * dv;
    if (a->pos[t0] == 0) memset(S, 0, (size_t)dk * dv * sizeof(float));
    float *mem = malloc(sizeof(float) * ((size_t)CH * (3 * dk + 3 * dv + CH + 2) + dv));
    LETHE_ASSERT(mem);
    rule_scratch w = {.q = mem};
    w.k = w.q + (size_t)CH * dk, w.w = w.k + (size_t)CH * dk, w.v = w.w + (size_t)CH * dk;
    w.u = w.v + (size_t)CH * dv, w.vn = w.u + (size_t)CH * dv, w.M = w.vn + (size_t)CH * dv;
    w.cum = w.M + (size_t)CH * CH, w.beta = w.cum + CH, w.tmp = w.beta + CH;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int32_t i = 0; i < n;) {
        /* the segment: rows up to the next position multiple of the chunk */
        const int32_t p = a->pos[t0 + i];
        const int32_t L = LETHE_MIN(n - i, CH - p % CH);
        float acc = 0.0f;
        for (int32_t r = 0; r < L; r++) {
            const size_t t = (size_t)(t0 + i + r);
            LETHE_ASSERT(a->pos[t] == p + r);
            const float *row = xc + t * C;
            l2norm_scaled(w.q + (size_t)r * dk, row + (size_t)kh * dk, dk, qscale);
            l2norm_scaled(w.k + (size_t)r * dk, row + kd + (size_t)kh * dk, dk, 1.0f);
            memcpy(w.v + (size_t)r * dv, row + 2 * kd + (size_t)h * dv, (size_t)dv * sizeof(float));
            w.beta[r] = sigmoidf_(bv[t * Hv + h]);
            const float g = A[h] * softplus(av[t * Hv + h] + dtb[h]);
            w.cum[r] = L == 1 ? g : (acc += g);
        }
        float *o = out + ((size_t)(t0 + i) * Hv + h) * dv;
        if (L == 1)
            rule_step(S, w.q, w.k, w.v, w.cum[0], w.beta[0], o, w.tmp, dk, dv);
        else
            rule_chunk(S, &w, L, o, Hv * dv, dk, dv);
        i += L;
    }
    free(mem);
}

void lethe_cpu_gdn_rule(lethe_backend *be, const lethe_gdn_args *a) {
    LETHE_ASSERT(a->n_k_heads > 0 && a->n_v_heads % a->n_k_heads == 0 && a->k_dim > 0 &&
                 a->v_dim > 0 && a->conv_dim == 2 * a->n_k_heads * a->k_dim + a->n_v_heads * a->v_dim);
    rule_job j = {a};
    lethe_cpu_parallel(be, lethe_cpu_threads(be), a->n_seqs * a->n_v_heads, rule_task, &j);
}

/* ---- gated norm and the sigmoid gate ---- */

typedef struct gnorm_job {
    float *out;
    const float *x, *z, *w;
    int32_t dim;
    float eps;
} gnorm_job;

static void gnorm_task(void *ctx, int r, int worker) {
    const gnorm_job *j = ctx;
    const float *x = j->x + (size_t)r * j->dim, *z = j->z + (size_t)r * j->dim;
    float *o = j->out + (size_t)r * j->dim;
    double ss = 0;
    for (int32_t i = 0; i < j->dim; i++) ss += (double)x[i] * x[i];
    const float rr = (float)(1.0 / sqrt(ss / j->dim + (double)j->eps));
    for (int32_t i = 0; i < j->dim; i++) o[i] = j->w[i] * (x[i] * rr) * silu(z[i]);
}

void lethe_cpu_rmsnorm_gated(lethe_backend *be, void *out, const void *x, const void *z,
                             const void *w, int32_t n_rows, int32_t dim, float eps) {
    gnorm_job j = {out, x, z, w, dim, eps};
    const int nt = (size_t)n_rows * dim < 65536 ? 1 : lethe_cpu_threads(be);
    lethe_cpu_parallel(be, nt, n_rows, gnorm_task, &j);
}

void lethe_cpu_sigmoid_mul(lethe_backend *be, void *x_, const void *g_, size_t n) {
    float *x = x_;
    const float *g = g_;
    for (size_t i = 0; i < n; i++) x[i] *= sigmoidf_(g[i]);
}

void lethe_cpu_state_copy(lethe_backend *be, void *buf, size_t row_bytes, int32_t dst, int32_t src) {
    if (dst == src) return;
    memcpy((char *)buf + (size_t)dst * row_bytes, (const char *)buf + (size_t)src * row_bytes,
           row_bytes);
}

/* mla.c - the ops of multi-head latent attention on the CPU backend (CUDA
 * twins in backend/cuda/mla.cu; definitions in backend.h):
 *
 *   matmul_heads      y[t, h, :] = W[h] x[t, h, :] with strided rows / heads
 *                     (absorbing W_kb into the query, W_vb into the output)
 *   copy_block        dst[rows[r]][off .. off + width) = src[r][0 .. width)
 *                     (q_pe into the absorbed query, a token's latent and RoPE
 *                     key into its cache slot)
 *   attention_latent  attention whose V is the first v_dim columns of each
 *                     cache slot (lethe_attn_args with v_cache == NULL): one
 *                     read of a slot serves K and V of every head
 *
 * Every output element is one fixed sequence of float operations (an FMA
 * chain over increasing index, the softmax per (row, head)), so a row's
 * result does not depend on its batch or the thread count. */
#include <math.h>
#include <string.h>

#include "backend/args.h"
#include "backend/cpu/cpu_ops.h"
#include "core/util.h"

void lethe_cpu_matmul_heads(lethe_backend *be, void *y_, int32_t y_ld, int32_t y_hs, const void *x_,
                            int32_t x_ld, int32_t x_hs, const void *w_, int32_t n, int32_t n_heads,
                            int32_t out, int32_t in) {
    LETHE_ASSERT(n >= 0 && n_heads > 0 && out > 0 && in > 0);
    float *y = y_;
    const float *x = x_, *w = w_;
    const int64_t items = (int64_t)n * n_heads * out;
    const int nt = items * in < (1 << 18) ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t it = 0; it < items; it++) {
        const int32_t t = (int32_t)(it / ((int64_t)n_heads * out));
        const int32_t h = (int32_t)(it / out % n_heads), o = (int32_t)(it % out);
        const float *xr = x + (size_t)t * x_ld + (size_t)h * x_hs;
        const float *wr = w + ((size_t)h * out + o) * in;
        float s = 0.0f;
        for (int32_t i = 0; i < in; i++) s = fmaf(xr[i], wr[i], s);
        y[(size_t)t * y_ld + (size_t)h * y_hs + o] = s;
    }
}

void lethe_cpu_copy_block(lethe_backend *be, void *dst_, int32_t dst_ld, int32_t dst_off,
                          const int32_t *rows, const void *src_, int32_t src_ld, int32_t n_rows,
                          int32_t width) {
    LETHE_ASSERT(n_rows >= 0 && width >= 0 && dst_off >= 0 && dst_off + width <= dst_ld);
    float *dst = dst_;
    const float *src = src_;
    for (int32_t r = 0; r < n_rows; r++) {
        const int32_t d = rows ? rows[r] : r;
        LETHE_ASSERT(d >= 0);
        memmove(dst + (size_t)d * dst_ld + dst_off, src + (size_t)r * src_ld,
                (size_t)width * sizeof(float));
    }
}

void lethe_cpu_attention_latent(lethe_backend *be, const lethe_attn_args *a) {
    lethe_check_attention(a);
    LETHE_ASSERT(a->n_kv_heads == 1 && a->v_cache == NULL && a->v_dim > 0 &&
                 a->v_dim <= a->head_dim);
    const int32_t H = a->n_heads, D = a->head_dim, Dv = a->v_dim;
    const float *q = a->q, *kc = a->k_cache;
    float *out = a->out;
    const int32_t items = a->n_tokens * H;
    const int nt = items < 2 ? 1 : lethe_cpu_threads(be);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int32_t it = 0; it < items; it++) {
        const int32_t row = it / H, h = it % H;
        int32_t s = 0;
        while (a->q_begin[s + 1] <= row) s++;
        const int32_t j = row - a->q_begin[s], n_q = a->q_begin[s + 1] - a->q_begin[s];
        const int32_t *sel = a->sel_slots + a->sel_begin[s];
        const int32_t n_sel = a->sel_begin[s + 1] - a->sel_begin[s];
        const int32_t lim = n_sel - n_q + j; /* entries [0, lim] are visible */
        const float *qr = q + ((size_t)row * H + h) * D;
        float *o = out + ((size_t)row * H + h) * Dv;
        /* online softmax over the visible entries, in order */
        float m = -INFINITY, l = 0.0f;
        for (int32_t d = 0; d < Dv; d++) o[d] = 0.0f;
        for (int32_t e = 0; e <= lim; e++) {
            const float *k = kc + (size_t)sel[e] * D;
            float sc = 0.0f;
            for (int32_t d = 0; d < D; d++) sc = fmaf(qr[d], k[d], sc);
            sc *= a->scale;
            if (sc > m) {
                const float r = expf(m - sc); /* 0 on the first entry */
                l *= r;
                for (int32_t d = 0; d < Dv; d++) o[d] *= r;
                m = sc;
            }
            const float p = expf(sc - m);
            l += p;
            for (int32_t d = 0; d < Dv; d++) o[d] = fmaf(p, k[d], o[d]);
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int32_t d = 0; d < Dv; d++) o[d] *= inv;
    }
}

/* moe.c - the mixture-of-experts FFN on the CPU backend (ops->moe, the
 * definition in backend.h; the CUDA twin is backend/cuda/moe.cu).
 *
 * Steps, with the scratch parts of backend/moe_layout.h:
 *   1. route every token: ids / wts [n, k] (lethe_cpu_moe_route_row);
 *   2. sort the n * k pairs by expert (counting sort, stable): perm, inv;
 *   3. per expert e with m pairs: xs = x rows of its pairs [m, dim],
 *      hg = xs W_gate[e]^T, hu = xs W_up[e]^T [m, ffn], hg = silu(hg) * hu,
 *      ys = hg W_down[e]^T [m, dim] (lethe_cpu_matmul: the same float ops
 *      per row whatever m, so the result does not depend on the batch);
 *   4. out[t] = sum_j wts[t, j] * ys[inv[t * k + j]], j ascending.
 * Only the experts some token chose are read: a decode token reads k
 * experts' weights. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/moe_layout.h"
#include "core/util.h"

/* index of the largest v[i] over i in [0, n) with !taken[i] (ties: smaller i) */
static int32_t argmax_free(const float *v, const uint8_t *taken, int32_t n) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

void lethe_cpu_moe_route_row(const float *logits, const float *bias, int32_t n_experts, int32_t k,
                             int32_t scoring, bool norm_topk, float scale, int32_t n_group,
                             int32_t topk_group, int32_t *ids, float *wts) {
    const int32_t E = n_experts;
    float p[LETHE_MOE_MAX_EXPERTS], choice[LETHE_MOE_MAX_EXPERTS];
    uint8_t taken[LETHE_MOE_MAX_EXPERTS];
    LETHE_ASSERT(E > 0 && E <= LETHE_MOE_MAX_EXPERTS && k > 0 && k <= E);
    if (scoring == LETHE_MOE_SOFTMAX) {
        float mx = logits[0];
        for (int32_t e = 1; e < E; e++) mx = fmaxf(mx, logits[e]);
        double sum = 0;
        for (int32_t e = 0; e < E; e++) sum += exp((double)logits[e] - mx);
        for (int32_t e = 0; e < E; e++)
            choice[e] = p[e] = (float)(exp((double)logits[e] - mx) / sum);
    } else {
        LETHE_ASSERT(scoring == LETHE_MOE_SIGMOID);
        for (int32_t e = 0; e < E; e++) {
            p[e] = (float)(1.0 / (1.0 + exp(-(double)logits[e])));
            choice[e] = p[e] + (bias ? bias[e] : 0.0f);
        }
    }
    memset(taken, 0, (size_t)E);
    if (n_group > 1) {
        /* group score = sum of its two best choices; the experts of the groups
         * not kept are out (choice -inf, as the reference's masked_fill) */
        const int32_t gs = E / n_group;
        float gscore[LETHE_MOE_MAX_EXPERTS];
        uint8_t gtaken[LETHE_MOE_MAX_EXPERTS] = {0};
        for (int32_t g = 0; g < n_group; g++) {
            const float *cg = choice + g * gs;
            int32_t a = 0, b = -1; /* best, second best */
            for (int32_t i = 1; i < gs; i++) {
                if (cg[i] > cg[a]) b = a, a = i;
                else if (b < 0 || cg[i] > cg[b]) b = i;
            }
            gscore[g] = cg[a] + (b >= 0 ? cg[b] : 0.0f);
        }
        uint8_t keep[LETHE_MOE_MAX_EXPERTS] = {0};
        for (int32_t i = 0; i < topk_group; i++) {
            int32_t g = argmax_free(gscore, gtaken, n_group);
            LETHE_ASSERT(g >= 0);
            gtaken[g] = keep[g] = 1;
        }
        for (int32_t e = 0; e < E; e++)
            if (!keep[e / gs]) choice[e] = -INFINITY;
    }
    double sum = 0;
    for (int32_t j = 0; j < k; j++) {
        int32_t e = argmax_free(choice, taken, E);
        LETHE_ASSERT(e >= 0);
        taken[e] = 1;
        ids[j] = e;
        wts[j] = p[e];
        sum += p[e];
    }
    if (norm_topk) {
        const float denom = (float)sum + (scoring == LETHE_MOE_SIGMOID ? 1e-20f : 0.0f);
        for (int32_t j = 0; j < k; j++) wts[j] /= denom;
    }
    for (int32_t j = 0; j < k; j++) wts[j] *= scale;
}

void lethe_cpu_moe(lethe_backend *be, const lethe_moe_args *a) {
    const int32_t n = a->n, k = a->k, E = a->n_experts, dim = a->dim, ffn = a->ffn;
    LETHE_ASSERT(n >= 0 && k > 0 && k <= E && dim > 0 && ffn > 0 && a->out != a->x);
    if (!n) return;
    const lethe_moe_layout L = lethe_moe_layout_of(sizeof(float), n, k, dim, ffn, E);
    LETHE_ASSERT(a->ws && a->ws_bytes >= L.total);
    char *ws = a->ws;
    int32_t *ids = (int32_t *)(ws + L.ids), *counts = (int32_t *)(ws + L.counts);
    int32_t *offsets = (int32_t *)(ws + L.offsets), *perm = (int32_t *)(ws + L.perm);
    int32_t *inv = (int32_t *)(ws + L.inv);
    float *wts = (float *)(ws + L.wts), *xs = (float *)(ws + L.xs), *hg = (float *)(ws + L.hg);
    float *hu = (float *)(ws + L.hu), *ys = (float *)(ws + L.ys);
    const float *x = a->x, *logits = a->logits, *bias = a->bias;
    const int32_t P = n * k;

    for (int32_t t = 0; t < n; t++)
        lethe_cpu_moe_route_row(logits + (size_t)t * E, bias, E, k, a->scoring, a->norm_topk,
                                a->scale, a->n_group, a->topk_group, ids + (size_t)t * k,
                                wts + (size_t)t * k);
    memset(counts, 0, (size_t)E * sizeof(int32_t));
    for (int32_t p = 0; p < P; p++) counts[ids[p]]++;
    offsets[0] = 0;
    for (int32_t e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
    memcpy(counts, offsets, (size_t)E * sizeof(int32_t)); /* counts become write cursors */
    for (int32_t p = 0; p < P; p++) {
        const int32_t at = counts[ids[p]]++;
        perm[at] = p;
        inv[p] = at;
    }
    for (int32_t i = 0; i < P; i++)
        memcpy(xs + (size_t)i * dim, x + (size_t)(perm[i] / k) * dim, (size_t)dim * sizeof(float));

    const size_t up_sz = (size_t)ffn * dim;
    for (int32_t e = 0; e < E; e++) {
        const int32_t o = offsets[e], m = offsets[e + 1] - o;
        if (!m) continue;
        float *hge = hg + (size_t)o * ffn, *hue = hu + (size_t)o * ffn;
        lethe_cpu_matmul(be, hge, xs + (size_t)o * dim, (const float *)a->w_gate + e * up_sz, m,
                         ffn, dim);
        lethe_cpu_matmul(be, hue, xs + (size_t)o * dim, (const float *)a->w_up + e * up_sz, m, ffn,
                         dim);
        lethe_cpu_swiglu(be, hge, hge, hue, (size_t)m * ffn);
        lethe_cpu_matmul(be, ys + (size_t)o * dim, hge, (const float *)a->w_down + e * up_sz, m,
                         dim, ffn);
    }
    /* per element: the routed sum in j order, then (accumulate) one add to out,
     * i.e. the same arithmetic as a separate residual add of the sum */
    float *out = a->out;
    for (int32_t t = 0; t < n; t++) {
        float *o = out + (size_t)t * dim;
        const float *w = wts + (size_t)t * k;
        for (int32_t d = 0; d < dim; d++) {
            float sum = 0.0f;
            for (int32_t j = 0; j < k; j++) sum += w[j] * ys[(size_t)inv[t * k + j] * dim + d];
            o[d] = a->accumulate ? o[d] + sum : sum;
        }
    }
}

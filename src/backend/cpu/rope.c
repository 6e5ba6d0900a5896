/* rope.c - rotary position embedding, HF "rotate half" convention.
 *
 * For each token t, head h and i < d/2 (d = head_dim):
 *   a = pos[t] * inv_freq[i]                       (fp32 product, as HF)
 *   x1 = x[i], x2 = x[i + d/2]
 *   x[i]       = x1 * cos(a) - x2 * sin(a)
 *   x[i + d/2] = x2 * cos(a) + x1 * sin(a)
 * on x [n, n_heads, head_dim] in place.
 *
 * inv_freq follows transformers' rope initialisers computed in fp32:
 *   default: inv_freq[i] = 1 / theta^((2i)/d)
 *   linear : default / factor
 *   llama3 : (Llama 3.1) with wavelen = 2*pi/inv_freq,
 *            low_wl = original_max_pos / low_freq_factor,
 *            high_wl = original_max_pos / high_freq_factor:
 *            wavelen > low_wl  -> inv_freq / factor           (low frequencies)
 *            wavelen < high_wl -> inv_freq                    (high frequencies)
 *            otherwise, s = (original_max_pos / wavelen - low_freq_factor)
 *                           / (high_freq_factor - low_freq_factor)
 *                       -> (1 - s) * inv_freq / factor + s * inv_freq
 * Partial rotary (rope->rot_dim = r > 0): d above is r, the first r values
 * of each head rotate and the other head_dim - r pass through unchanged.
 * The table is d/2 powf calls, recomputed per call (negligible next to the
 * rotation itself); cos/sin are computed once per token and shared by heads. */
#include <math.h>

#include "backend/cpu/cpu_ops.h"

#define ROPE_HALF_MAX 512 /* head_dim up to 1024 */

void lethe_rope_inv_freq(const lethe_rope_config *rope, int32_t head_dim, float *inv_freq) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float e = (float)(2 * i) / (float)head_dim;
        inv_freq[i] = 1.0f / powf(rope->theta, e);
    }
    if (rope->scaling == LETHE_ROPE_SCALING_LINEAR) {
        for (int i = 0; i < half; i++) inv_freq[i] /= rope->factor;
    } else if (rope->scaling == LETHE_ROPE_SCALING_LLAMA3) {
        const float factor = rope->factor, lo = rope->low_freq_factor, hi = rope->high_freq_factor;
        const float old_len = (float)rope->original_max_pos;
        const float low_wl = old_len / lo, high_wl = old_len / hi;
        const float two_pi = 6.283185307179586f;
        for (int i = 0; i < half; i++) {
            float f = inv_freq[i];
            float wl = two_pi / f;
            float g = wl > low_wl ? f / factor : f;
            if (!(wl < high_wl) && !(wl > low_wl)) {
                float s = (old_len / wl - lo) / (hi - lo);
                g = (1.0f - s) * g / factor + s * g;
            }
            inv_freq[i] = g;
        }
    }
}

typedef struct rope_job {
    float *x;
    const int32_t *pos;
    const float *inv_freq;
    int32_t n_heads, half, head_dim;
} rope_job;

static void rope_task(void *ctx, int t, int worker) {
    const rope_job *j = ctx;
    const int half = j->half;
    float c[ROPE_HALF_MAX], s[ROPE_HALF_MAX];
    const float p = (float)j->pos[t];
    for (int i = 0; i < half; i++) {
        float a = p * j->inv_freq[i];
        c[i] = cosf(a);
        s[i] = sinf(a);
    }
    for (int h = 0; h < j->n_heads; h++) {
        float *v = j->x + ((size_t)t * j->n_heads + h) * j->head_dim;
        for (int i = 0; i < half; i++) {
            float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] - x2 * s[i];
            v[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

void lethe_cpu_rope(lethe_backend *be, void *x_, const int32_t *pos, int32_t n, int32_t n_heads,
                    int32_t head_dim, const lethe_rope_config *rope) {
    const int32_t rd = rope->rot_dim > 0 ? rope->rot_dim : head_dim;
    LETHE_ASSERT(rd % 2 == 0 && rd <= head_dim && rd / 2 <= ROPE_HALF_MAX);
    float *x = x_;
    const int half = rd / 2;
    float inv_freq[ROPE_HALF_MAX];
    lethe_rope_inv_freq(rope, rd, inv_freq);
    const int nt = (size_t)n * n_heads * head_dim < 65536 ? 1 : lethe_cpu_threads(be);
    rope_job j = {x, pos, inv_freq, n_heads, half, head_dim};
    lethe_cpu_parallel(be, nt, n, rope_task, &j);
}

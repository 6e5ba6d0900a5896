/* rope.cu - HF rotate-half RoPE for the CUDA backend, in place:
 *
 *   x [n, n_heads, head_dim] bf16, positions pos[n] (host, staged)
 *   angle_j = pos * inv_freq[j]                        j < head_dim/2 (fp32)
 *   x'[j]        = x[j] cos - x[j + half] sin
 *   x'[j + half] = x[j + half] cos + x[j] sin
 *
 * Partial rotary (rope->rot_dim = r > 0): only the first r values of each
 * head rotate (half = r / 2, frequencies for r); the rest pass through.
 *
 * inv_freq comes from lethe_rope_inv_freq (the CPU backend's host function:
 * default / linear / llama3 scaling computed exactly as HF does in fp32) and
 * travels by value in the kernel parameters, so a captured graph keeps it. */
#include "backend/cuda/cuda_common.cuh"

extern "C" {
#include "backend/cpu/cpu_ops.h"
}

#define ROPE_MAX_HALF 256

struct rope_freqs {
    float inv_freq[ROPE_MAX_HALF];
};

__global__ void rope_kernel(bf16 *__restrict__ x, const int32_t *__restrict__ pos, int32_t n,
                            int32_t n_heads, int32_t head_dim, int32_t half, const rope_freqs f) {
    const size_t total = (size_t)n * n_heads * half;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
         t += (size_t)gridDim.x * blockDim.x) {
        int32_t j = (int32_t)(t % half);
        size_t row = t / half; /* token * n_heads + head */
        int32_t tok = (int32_t)(row / n_heads);
        float s, c;
        sincosf((float)pos[tok] * f.inv_freq[j], &s, &c);
        bf16 *p = x + row * head_dim;
        float a = __bfloat162float(p[j]), b = __bfloat162float(p[j + half]);
        p[j] = __float2bfloat16(a * c - b * s);
        p[j + half] = __float2bfloat16(b * c + a * s);
    }
}

extern "C" void lethe_cuda_rope(lethe_backend *be, void *x, const int32_t *pos, int32_t n,
                                int32_t n_heads, int32_t head_dim, const lethe_rope_config *rope) {
    cuda_ctx *c = cuda_ctx_of(be);
    const int32_t rd = rope->rot_dim > 0 ? rope->rot_dim : head_dim;
    LETHE_ASSERT(rd % 2 == 0 && rd <= head_dim && rd / 2 <= ROPE_MAX_HALF);
    if (n <= 0) return;
    rope_freqs f;
    lethe_rope_inv_freq(rope, rd, f.inv_freq);
    const int32_t *d_pos = lethe_cuda_stage_idx(c, pos, (size_t)n);
    size_t total = (size_t)n * n_heads * (rd / 2);
    unsigned blocks = lethe_cuda_blocks(total, 256);
    if (blocks > (unsigned)c->n_sms * 16) blocks = (unsigned)c->n_sms * 16;
    rope_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)x, d_pos, n, n_heads, head_dim, rd / 2, f);
    CU_LAUNCH_CHECK();
}

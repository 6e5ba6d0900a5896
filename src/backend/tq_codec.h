/* tq_codec.h - TurboQuant (methods.md §16): the MSE vector quantizer of the
 * `turboquant` method, on host arrays (the CPU reference the backends' TQ
 * store reproduces bit for bit).
 *
 * For one head vector x [d]: n = ||x||, u = P x / n with P a fixed seeded
 * random rotation (orthogonal d x d), each coordinate of u quantized to the
 * nearest of 2^b Lloyd-Max centroids for the distribution of one coordinate
 * of a uniformly random unit vector in R^d (density ~ (1 - t^2)^((d-3)/2),
 * about N(0, 1/d)). Stored: the b-bit codes (packed, element i at bit i b,
 * little end first, as KIVI) and n as fp16. Dequant: x^ = n16 P^T c[code].
 * No QJL residual sketch (the MSE variant, as SparseEngine).
 *
 * Attention never dequantizes a row: q . x^ = n16 (P q) . c[code] and
 * sum_j p_j x^_j = P^T (sum_j p_j n16_j c[code_j]), so queries are rotated
 * once, keys / values are read in the rotated basis, and the output is
 * rotated back once (backend/{cpu,cuda}/attention_tq).
 *
 * Exactness contract with the CUDA store (one warp per vector): the sum of
 * squares is the 32-lane butterfly of lethe_tq_sumsq, n = sqrtf (IEEE),
 * y_i = fmaf chain over j ascending of P[i][j] x_j, u_i = y_i / n (IEEE),
 * code_i = #{k : bounds[k] < u_i}; so the same f32 inputs give the same
 * codes and norms on both backends. */
#ifndef LETHE_BACKEND_TQ_CODEC_H
#define LETHE_BACKEND_TQ_CODEC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LETHE_TQ_BITS_MAX 4
#define LETHE_TQ_HEAD_DIM_MAX 256

/* packed code bytes of one head vector (d % 8 == 0) */
static inline size_t lethe_tq_code_bytes(int32_t d, int32_t bits) {
    return (size_t)d * (size_t)bits / 8;
}

/* P [d][d] row-major f32: a seeded Gaussian matrix orthonormalized by
 * modified Gram-Schmidt in double (rows, sign so that R's diagonal is
 * positive), so the same seed gives the same rotation everywhere. */
void lethe_tq_rotation(uint64_t seed, int32_t d, float *rot);
/* Lloyd-Max codebook for one coordinate of a uniform unit vector in R^d:
 * centroids [2^bits] ascending and symmetric, bounds [2^bits - 1] (the
 * midpoints). bits in [1, 4]; deterministic (double precision iteration). */
void lethe_tq_codebook(int32_t bits, int32_t d, float *centroids, float *bounds);
/* The quantizer's distortion E ||u - u^||^2 for a unit vector, computed from
 * the codebook and the coordinate density (d times the per-coordinate MSE). */
double lethe_tq_distortion(int32_t bits, int32_t d);

/* IEEE binary16 conversions (round to nearest even; CUDA __float2half_rn) */
uint16_t lethe_f32_to_f16(float x);
float lethe_f16_to_f32(uint16_t h);

/* sum of x[j]^2 in the order of a 32-lane warp: lane l accumulates j = l,
 * l + 32, ... with fmaf, then five butterfly steps v[l] += v[l ^ o] */
float lethe_tq_sumsq(const float *x, int32_t d);

/* one vector x [d] -> codes [lethe_tq_code_bytes(d, bits)], *norm (fp16 bits);
 * a zero vector gets norm 0 and codes 0 */
void lethe_tq_quant_vec(const float *x, int32_t d, int32_t bits, const float *rot,
                        const float *bounds, uint8_t *codes, uint16_t *norm);
/* x^ = n P^T c[code] into out [d] */
void lethe_tq_dequant_vec(const uint8_t *codes, uint16_t norm, int32_t d, int32_t bits,
                          const float *rot, const float *centroids, float *out);
/* code i of a packed row (b-bit codes may straddle two bytes) */
static inline uint32_t lethe_tq_code(const uint8_t *codes, int32_t i, int32_t bits) {
    const uint32_t bit = (uint32_t)i * (uint32_t)bits, byte = bit >> 3, sh = bit & 7u;
    uint32_t w = codes[byte];
    if (sh + (uint32_t)bits > 8u) w |= (uint32_t)codes[byte + 1] << 8;
    return (w >> sh) & ((1u << bits) - 1u);
}

#ifdef __cplusplus
}
#endif

#endif /* LETHE_BACKEND_TQ_CODEC_H */

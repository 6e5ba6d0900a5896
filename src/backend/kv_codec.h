/* kv_codec.h - KV quantizers of the quantization methods (KIVI, FP8 E4M3), on host arrays.
 *
 * KIVI (methods.md §15): asymmetric integer quantization with b bits
 * (2, 4 or 8). For a group with min mu and max M: scale s = (M - mu) / (2^b - 1),
 * code q = clamp(round((x - mu) / s), 0, 2^b - 1), x^ = q s + mu, so
 * |x - x^| <= s / 2 (plus float rounding); a constant group (s = 0) is exact.
 *   keys   per CHANNEL: a block of G tokens x C channels, one (s, mu) per
 *          channel over the block's G tokens;
 *   values per TOKEN:   one token's C channels in groups of G channels, one
 *          (s, mu) per group.
 * Codes are packed little-end first: element i of a row sits in byte
 * i * b / 8 at bit (i * b) % 8. Scales and zeros are float32 (the anchor keeps
 * fp16; float32 keeps the error bound exactly s / 2 and costs 8 bytes per group).
 *
 * FP8 (methods.md §17): E4M3 (bias 7, 3 mantissa bits, max 448, no infinity,
 * 0x7F = NaN), round to nearest even, saturating. Per vector (one token, one KV
 * head): scale = amax / 448, code = e4m3(x / scale), x^ = e4m3_to_float(code) *
 * scale. Relative error <= 2^-4 for |x| / scale >= 2^-6 (normal range),
 * absolute error <= 2^-10 * scale below it; a zero vector has scale 0, codes 0.
 *
 * CUDA twins: backend/cuda/attention_quant.cu repeats these steps bit for bit
 * (KIVI pack kernels, fp8_store_kernel; docs/sparse-methods.md). */
#ifndef LETHE_BACKEND_KV_CODEC_H
#define LETHE_BACKEND_KV_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* bytes of n packed b-bit codes (b in {2, 4, 8}) */
static inline size_t lethe_kivi_code_bytes(int32_t n, int32_t bits) {
    return ((size_t)n * (size_t)bits + 7) / 8;
}

/* Asymmetric quantization of n values x[i * stride]: writes the n codes
 * (packed, see above) and returns scale / zero. */
void lethe_quant_asym(const float *x, int32_t n, size_t stride, int32_t bits, uint8_t *codes,
                      float *scale, float *zero);
/* code i of a packed row */
uint32_t lethe_code_get(const uint8_t *codes, int32_t i, int32_t bits);

/* keys: k [G, C] -> codes [G][code_bytes(C)] (row-major by token), scale/zero [C] */
void lethe_kivi_quant_keys(const float *k, int32_t G, int32_t C, int32_t bits, uint8_t *codes,
                           float *scale, float *zero);
void lethe_kivi_dequant_keys(const uint8_t *codes, const float *scale, const float *zero,
                             int32_t G, int32_t C, int32_t bits, float *k);

/* one value token: v [C] in groups of G channels (C % G == 0) -> codes
 * [code_bytes(C)], scale/zero [C / G] */
void lethe_kivi_quant_value(const float *v, int32_t C, int32_t G, int32_t bits, uint8_t *codes,
                            float *scale, float *zero);
void lethe_kivi_dequant_value(const uint8_t *codes, const float *scale, const float *zero,
                              int32_t C, int32_t G, int32_t bits, float *v);

/* E4M3 scalar conversions */
uint8_t lethe_fp8_e4m3_from_float(float x);
float lethe_fp8_e4m3_to_float(uint8_t b);

/* one vector x [n] -> codes [n], *scale (amax / 448; 0 for an all-zero vector) */
void lethe_fp8_quant_vec(const float *x, int32_t n, uint8_t *codes, float *scale);
void lethe_fp8_dequant_vec(const uint8_t *codes, int32_t n, float scale, float *out);

#endif /* LETHE_BACKEND_KV_CODEC_H */

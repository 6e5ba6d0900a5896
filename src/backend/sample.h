/* sample.h - the `sample` op's arguments and the arithmetic that defines it,
 * shared by the CPU twin (backend/cpu/sample.c, also the engine's host
 * sampler) and the CUDA kernel (backend/cuda/sample.cu).
 *
 * Definition of one row (n_vocab raw logits r, f32 values; CUDA reads bf16):
 *   0. token mask (structured output): a row with a mask sets l_i = -inf for
 *      every token whose bit is clear (bit i % 32 of word i / 32), so such a
 *      token has q = 0 and is never drawn or picked by greedy while one
 *      allowed token has a finite logit; the logprob stays the raw one;
 *   1. penalties, per entry (id t, output count c) of the row's list, which
 *      holds each distinct id of prompt + output once (HF/vLLM/OpenAI order):
 *        rep != 1:            l = l > 0 ? l / rep : l * rep
 *        c > 0, freq|pres:    l = l - (c * freq + pres)          (f32 ops)
 *   2. greedy (temperature 0 or top_k 1, or a non-finite max): the first id of
 *      the rank order (l desc, id asc); no random number is used.
 *   3. weights q_i = round(exp((l_i - max) / T) * 2^40), unsigned integers:
 *      exp is lethe_sample_exp below (only IEEE double + - * and exact scaling,
 *      so CPU and GPU compute the same bits); the best token has q = 2^40,
 *      tokens with p / p_max < ~5e-13 get 0 and are never drawn.
 *   4. top-k (0 < k < V): keep the first k of the rank order.
 *   5. top-p (< 1): Q = sum of q kept; keep the shortest rank prefix (>= 1)
 *      whose sum * 2^32 >= Q * round(top_p * 2^32).
 *   6. min-p (> 0): keep q >= ceil(min_p * 2^40) (the best always stays).
 *   7. draw: Qs = sum of q kept, T = floor(bits * Qs / 2^64) with bits =
 *      lethe_sample_bits(seed, draw); walking the kept ids in ASCENDING ID
 *      order, the token is the first whose running sum exceeds T.
 * Every sum is an exact integer, so the order of summation does not matter:
 * a tree reduction on the GPU and a loop on the CPU give the same token for
 * the same logits, bit for bit (no tolerance, no margin). Only the optional
 * logprob (raw log-softmax of the chosen token, as lethe_sampler_logprobs)
 * is a double-precision sum whose rounding may differ in the last bits.
 *
 * RNG: counter-based. The draw-th uniform of a request is a pure function
 * of (seed, draw): the splitmix64 stream started at mix(seed), element
 * draw + 1. The engine advances a request's draw counter once per
 * non-greedy token, so a seeded request gets the same tokens whatever else
 * runs in its batch and whichever backend samples it. */
#ifndef LETHE_BACKEND_SAMPLE_H
#define LETHE_BACKEND_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define LETHE_SHD static inline __host__ __device__
#else
#define LETHE_SHD static inline
#endif

/* IEEE round-to-nearest ops that the compiler must not fuse into FMAs (nvcc
 * contracts by default; gcc does not in -std=c17 mode, -ffp-contract=off). */
#ifdef __CUDA_ARCH__
#define LS_FMUL(a, b) __fmul_rn(a, b)
#define LS_FADD(a, b) __fadd_rn(a, b)
#define LS_FSUB(a, b) __fsub_rn(a, b)
#define LS_FDIV(a, b) __fdiv_rn(a, b)
#define LS_DMUL(a, b) __dmul_rn(a, b)
#define LS_DADD(a, b) __dadd_rn(a, b)
#define LS_DSUB(a, b) __dsub_rn(a, b)
#else
#define LS_FMUL(a, b) ((a) * (b))
#define LS_FADD(a, b) ((a) + (b))
#define LS_FSUB(a, b) ((a) - (b))
#define LS_FDIV(a, b) ((a) / (b))
#define LS_DMUL(a, b) ((a) * (b))
#define LS_DADD(a, b) ((a) + (b))
#define LS_DSUB(a, b) ((a) - (b))
#endif

#define LETHE_SAMPLE_Q_ONE ((uint64_t)1 << 40) /* weight of the best token */

/* Per-row parameters (host). */
typedef struct lethe_sample_row {
    float temperature;          /* 0 = greedy */
    int32_t top_k;              /* <= 0 or >= n_vocab: off; 1 = greedy */
    float top_p;                /* (0, 1]; 1 = off */
    float min_p;                /* [0, 1]; 0 = off */
    float repetition_penalty;   /* 1 = off */
    float presence_penalty, frequency_penalty;
    int32_t pen_begin, n_pen;   /* this row's entries in pen_ids / pen_counts */
    int32_t mask_row;           /* 1-based row of the args' mask; 0 = no mask */
    uint64_t seed, draw;        /* RNG key and the request's draw index */
} lethe_sample_row;

/* The op's arguments. logits: backend activations [n, n_vocab] (rows in
 * the order of `rows`); everything else is host memory. */
struct lethe_sample_args {
    const void *logits;
    int32_t n, n_vocab;
    const lethe_sample_row *rows;  /* [n] */
    const int32_t *pen_ids;        /* [n_pen] distinct ids per row (see above) */
    const int32_t *pen_counts;     /* [n_pen] occurrences in the row's output */
    int32_t n_pen;
    const uint32_t *mask;          /* [n_mask, lethe_sample_mask_words(n_vocab)] allowed-token bits */
    int32_t n_mask;
    int32_t *tokens;               /* out [n] */
    float *logprobs;               /* out [n] or NULL: raw logprob of the token */
};
typedef struct lethe_sample_args lethe_sample_args;

LETHE_SHD int32_t lethe_sample_mask_words(int32_t n_vocab) { return (n_vocab + 31) / 32; }

LETHE_SHD bool lethe_sample_mask_allows(const uint32_t *mask, int32_t i) {
    return (mask[i >> 5] >> (i & 31)) & 1u;
}

LETHE_SHD bool lethe_sample_is_greedy(const lethe_sample_row *p) {
    return p->temperature == 0.0f || p->top_k == 1;
}

LETHE_SHD uint64_t lethe_sample_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* 64 random bits for draw `draw` of the stream `seed` */
LETHE_SHD uint64_t lethe_sample_bits(uint64_t seed, uint64_t draw) {
    return lethe_sample_mix(lethe_sample_mix(seed) + (draw + 1) * 0x9e3779b97f4a7c15ull);
}

LETHE_SHD uint64_t lethe_sample_mulhi(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
    return __umul64hi(a, b);
#else
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#endif
}

/* a * 2^32 >= b * c, exactly (128-bit) */
LETHE_SHD bool lethe_sample_ge_scaled(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t lh = a >> 32, ll = a << 32, rh = lethe_sample_mulhi(b, c), rl = b * c;
    return lh > rh || (lh == rh && ll >= rl);
}

/* Order key of a logit: larger logit = larger key; -0 counts as +0, so the
 * key order is the float order (NaN is not a valid logit). */
LETHE_SHD uint32_t lethe_sample_key(float l) {
    l = LS_FADD(l, 0.0f);
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(l);
#else
    memcpy(&u, &l, 4);
#endif
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* exp(x) for x <= 0 from IEEE double ops only: x = k ln2 + r, |r| <= ln2/2,
 * a degree-13 Taylor polynomial (truncation < 2^-60), times 2^k built from
 * its bits. Not correctly rounded (~1 ulp), but the same bits everywhere. */
LETHE_SHD double lethe_sample_exp(double x) {
    if (!(x > -40.0)) return 0.0; /* also NaN; result would round to q = 0 anyway */
    const double inv_ln2 = 1.4426950408889634, ln2_hi = 6.93147180369123816490e-01,
                 ln2_lo = 1.90821492927058770002e-10;
#ifdef __CUDA_ARCH__
    const double k = rint(LS_DMUL(x, inv_ln2));
#else
    const double k = __builtin_rint(LS_DMUL(x, inv_ln2));
#endif
    const double r = LS_DSUB(LS_DSUB(x, LS_DMUL(k, ln2_hi)), LS_DMUL(k, ln2_lo));
    /* Horner over 1/j!, j = 13 .. 0 (literals are the doubles nearest 1/j!) */
    double p = 1.6059043836821613e-10;
    p = LS_DADD(LS_DMUL(p, r), 2.08767569878681e-09);
    p = LS_DADD(LS_DMUL(p, r), 2.505210838544172e-08);
    p = LS_DADD(LS_DMUL(p, r), 2.755731922398589e-07);
    p = LS_DADD(LS_DMUL(p, r), 2.7557319223985893e-06);
    p = LS_DADD(LS_DMUL(p, r), 2.48015873015873e-05);
    p = LS_DADD(LS_DMUL(p, r), 0.0001984126984126984);
    p = LS_DADD(LS_DMUL(p, r), 0.001388888888888889);
    p = LS_DADD(LS_DMUL(p, r), 0.008333333333333333);
    p = LS_DADD(LS_DMUL(p, r), 0.041666666666666664);
    p = LS_DADD(LS_DMUL(p, r), 0.16666666666666666);
    p = LS_DADD(LS_DMUL(p, r), 0.5);
    p = LS_DADD(LS_DMUL(p, r), 1.0);
    p = LS_DADD(LS_DMUL(p, r), 1.0);
    const int64_t e = (int64_t)k + 1023; /* k in [-58, 0]: a normal power of two */
    uint64_t bits = (uint64_t)e << 52;
    double s;
#ifdef __CUDA_ARCH__
    s = __longlong_as_double((long long)bits);
#else
    memcpy(&s, &bits, 8);
#endif
    return LS_DMUL(p, s);
}

/* q of a (penalised) logit l given the row max m and 1 / temperature */
LETHE_SHD uint64_t lethe_sample_q(float l, float m, double inv_t) {
    double w = lethe_sample_exp(LS_DMUL(LS_DSUB((double)l, (double)m), inv_t));
    double s = LS_DADD(LS_DMUL(w, 0x1p40), 0.5);
#ifdef __CUDA_ARCH__
    return __double2ull_rz(s);
#else
    return (uint64_t)s;
#endif
}

LETHE_SHD float lethe_sample_penalise(float l, int32_t count, const lethe_sample_row *p) {
    const float rep = p->repetition_penalty;
    if (rep != 1.0f) l = l > 0.0f ? LS_FDIV(l, rep) : LS_FMUL(l, rep);
    if (count > 0 && (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f))
        l = LS_FSUB(l, LS_FADD(LS_FMUL((float)count, p->frequency_penalty), p->presence_penalty));
    return l;
}

/* top_p and min_p in the fixed-point units of steps 5 and 6 */
LETHE_SHD uint64_t lethe_sample_pnum(float top_p) {
    return (uint64_t)LS_DADD(LS_DMUL((double)top_p, 0x1p32), 0.5);
}
LETHE_SHD uint64_t lethe_sample_qmin(float min_p) {
    double s = LS_DMUL((double)min_p, 0x1p40);
    uint64_t q = (uint64_t)s;
    return (double)q < s ? q + 1 : q; /* ceil */
}

/* scratch of the CPU row function: l [V] floats, q [V] u64, idx [V] int32 */
typedef struct lethe_sample_scratch {
    float *l;
    uint64_t *q;
    int32_t *idx;
} lethe_sample_scratch;

#ifndef __CUDACC__
/* The row function of the definition above (backend/cpu/sample.c), on f32
 * logits; the engine's host sampler calls it too. mask: the row's bits or
 * NULL. Returns the token; *logprob if non-NULL. */
int32_t lethe_sample_row_f32(const float *raw, int32_t n_vocab, const lethe_sample_row *p,
                             const int32_t *pen_ids, const int32_t *pen_counts, const uint32_t *mask,
                             lethe_sample_scratch *s, float *logprob);
/* raw log-softmax of one token: m + log(sum exp(r - m)) in double, in id order */
float lethe_sample_logprob_f32(const float *raw, int32_t n_vocab, int32_t token);
#endif

#endif /* LETHE_BACKEND_SAMPLE_H */

/* topk.h - the one score ordering and the host top-k every selection uses.
 *
 * Backends (backend/cpu/select.c is lethe_topk_indices per segment;
 * backend/cuda/select.cu's radix select reproduces its indices exactly) and
 * the sparse methods (sparse/select_util.c: keep sets, Quest page choice)
 * share it, so it lives below both.
 *
 * Indices are int32 positions; scores are float32. NaN scores rank below
 * every number. lethe_topk_indices allocates a heap scratch of size k. */
#ifndef LETHE_BACKEND_TOPK_H
#define LETHE_BACKEND_TOPK_H

#include <stdbool.h>
#include <stdint.h>

/* true when score a at index ia ranks before score b at index ib (a > b, ties
 * by smaller index, NaN last). The one ordering every selection uses. */
static inline bool lethe_rank_before(float a, int32_t ia, float b, int32_t ib) {
    bool na = a != a, nb = b != b;
    if (na != nb) return nb;
    if (!na && a != b) return a > b;
    return ia < ib;
}

/* Top-k of scores[0..n): writes min(k, n) indices to out in ASCENDING index
 * order and returns how many. Deterministic (lethe_rank_before). O(n log k). */
int32_t lethe_topk_indices(const float *scores, int32_t n, int32_t k, int32_t *out);

#endif /* LETHE_BACKEND_TOPK_H */

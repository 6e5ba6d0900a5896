/* moe_layout.h - how ops->moe carves its scratch (lethe_moe_args.ws), the
 * same on every backend (internal to src/backend).
 *
 * P = n * k (token, choice) pairs; pair p = t * k + j. In order, each part
 * 256-byte aligned:
 *   ids     int32 [P]          chosen expert of pair p
 *   wts     f32   [P]          its weight
 *   counts  int32 [E]          pairs per expert
 *   offsets int32 [E + 1]      exclusive prefix sum of counts
 *   active  int32 [E + 1]      experts with pairs, ascending; active[E] = their count
 *   perm    int32 [P]          pairs sorted by expert (stable: ascending p per expert)
 *   inv     int32 [P]          sorted position of pair p
 *   tiles   int32 [E + 1]      exclusive prefix sum of ceil(counts / LETHE_MOE_TILE_M):
 *                              the row tiles of the grouped GEMM (CUDA; unused on the CPU)
 *   xs      act   [P, dim]     x rows of the sorted pairs
 *   hg, hu  act   [P, ffn]     gate / up activations, hg then silu(hg) * hu
 *   ys      act   [P, dim]     expert outputs, sorted order */
#ifndef LETHE_BACKEND_MOE_LAYOUT_H
#define LETHE_BACKEND_MOE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

/* rows of a grouped-GEMM tile (cuda/moe.cu) */
#define LETHE_MOE_TILE_M 64

typedef struct lethe_moe_layout {
    size_t ids, wts, counts, offsets, active, perm, inv, tiles, xs, hg, hu, ys, total;
} lethe_moe_layout;

static inline size_t lethe_moe_align_(size_t x) { return (x + 255) & ~(size_t)255; }

static inline lethe_moe_layout lethe_moe_layout_of(size_t act, int32_t n, int32_t k, int32_t dim,
                                                   int32_t ffn, int32_t n_experts) {
    lethe_moe_layout L;
    const size_t P = (size_t)n * (size_t)k, E = (size_t)n_experts;
    size_t at = 0;
#define LETHE_MOE_PART_(f, bytes) (L.f = at, at = lethe_moe_align_(at + (bytes)))
    LETHE_MOE_PART_(ids, P * 4);
    LETHE_MOE_PART_(wts, P * 4);
    LETHE_MOE_PART_(counts, E * 4);
    LETHE_MOE_PART_(offsets, (E + 1) * 4);
    LETHE_MOE_PART_(active, (E + 1) * 4);
    LETHE_MOE_PART_(perm, P * 4);
    LETHE_MOE_PART_(inv, P * 4);
    LETHE_MOE_PART_(tiles, (E + 1) * 4);
    LETHE_MOE_PART_(xs, P * (size_t)dim * act);
    LETHE_MOE_PART_(hg, P * (size_t)ffn * act);
    LETHE_MOE_PART_(hu, P * (size_t)ffn * act);
    LETHE_MOE_PART_(ys, P * (size_t)dim * act);
#undef LETHE_MOE_PART_
    L.total = at;
    return L;
}

#endif /* LETHE_BACKEND_MOE_LAYOUT_H */

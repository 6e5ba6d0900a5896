/* attention_v2.cu - v2 attention kernels: bf16 tensor cores through
 * mma.sync.m16n8k16 (fp32 accumulate), K/V rows gathered through the slot
 * table with cp.async into multi-buffered shared memory, online softmax in
 * registers (FlashAttention-2 register layout: the S accumulator of QK^T is
 * reused as the A operand of PV without a shared-memory round trip).
 * Semantics: backend.h's lethe_attn_args, same as attention.cu and the CPU
 * twin backend/cpu/attention.c. head_dim 64 and 128, and 256 for decode
 * (Qwen3.5/3.6's gated attention layers); attention.cu keeps the generic
 * split-K kernel for every other shape.
 *
 * decode_v2_kernel (one query row per sequence): a block = (row, KV head,
 * split) with the G <= 16 query heads of that KV head as the 16 rows of the
 * mma M dimension (rows >= G are zero), so every K/V row is read once per
 * group. 4 warps; warp w takes the 16-key tiles w, w+4, w+8, ... of the
 * split and runs its own NST-stage cp.async pipeline in its own shared
 * memory (no block barrier in the main loop); slot ids of the tile after
 * next are loaded one tile ahead. At the end the 4 warp states (m, l, O)
 * are merged through shared memory; a row with one effective split writes
 * bf16 out directly, else a normalized partial + LSE for the merge kernel.
 * The grid (splits per row) is fixed by the batch size and the occupancy,
 * so a decode step can be a CUDA graph; effective splits come from the
 * device-resident selection lengths.
 *
 * prefill_v2_kernel (prefill / extend, causal, ragged batches): a block =
 * 128 query rows of one sequence x one head, 8 warps of 16 rows; 64-key K/V
 * tiles double-buffered with cp.async (tile t+1 loads while t computes),
 * Q fragments in registers, causal mask only on tiles that cross the
 * diagonal. Tiles are ordered heaviest first (more keys), heads of one tile
 * adjacent (their K/V rows meet in L2).
 *
 * Mixed batches (decode rows next to prefill/extend chunks, the engine's
 * mixed steps): single-query sequences go through decode_v2_kernel with an
 * item list (one block per KV head group and split, K/V read once per group)
 * instead of a mostly empty 128-row tile per query head.
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16 bf16; g = lane / 4, t = lane % 4):
 *   A 16x16 row-major:  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
 *   B 16x8 "col":       b0 (k=2t..2t+1, n=g)  b1 (k=2t+8.., n=g)
 *   C 16x8 f32:         c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
 * K tiles [keys][D] in shared memory are B of QK^T via ldmatrix (keys = n);
 * V tiles [keys][D] are B of PV via ldmatrix.trans (keys = k). Shared rows
 * are padded to D + 8 elements: 8 consecutive rows hit 8 distinct 16-byte
 * bank groups, so ldmatrix is conflict-free. */
#include "backend/cuda/attention_common.cuh"

#include <math.h>
#include <stdlib.h>

/* ---- PTX wrappers -------------------------------------------------------- */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy; src_bytes 0 fills the 16 bytes with zeros
 * (src must still be a valid address) */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                        const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p))
                 : "memory"); /* ordered after cp.async waits and barriers */
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                          const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p))
                 : "memory"); /* ordered after cp.async waits and barriers */
}

/* c += a b  (16x16 bf16 x 16x8 bf16 -> 16x8 f32) */
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low half) = lo */
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

__device__ __forceinline__ uint32_t ld_u32(const bf16 *p) { return __ldg((const unsigned int *)p); }

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* ---- decode ---------------------------------------------------------------- */

#define DV2_WARPS 4
#define DV2_THREADS (DV2_WARPS * 32)
#define DV2_KT 16                        /* keys per warp tile */
#define DV2_GRAN (DV2_WARPS * DV2_KT)    /* split chunks are multiples of this */
#define DV2_GMAX 16                      /* query heads per block = mma M */

template <int D>
struct dv2_cfg {
    /* pipeline stages per warp; at D 256 a stage is 16.5 KB, two keep the
     * four warps' pipelines at 132 KB (one block an SM, the splits fill it) */
    static constexpr int NST = D == 64 ? 6 : D == 128 ? 3 : 2;
    static constexpr int LD = D + 8;                       /* bf16 per shared row */
    static constexpr int STAGE = 2 * DV2_KT * LD;          /* K tile then V tile, bf16 */
    static constexpr size_t WARP_BYTES = (size_t)NST * STAGE * 2;
    static constexpr int LDO = D + 4;                      /* floats per merge row */
    static constexpr size_t MERGE_BYTES = (size_t)DV2_WARPS * DV2_GMAX * (LDO + 2) * 4;
    static constexpr size_t PIPE_BYTES = DV2_WARPS * WARP_BYTES;
    static constexpr size_t SMEM = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
};

/* grid: x = item, y = KV head * head chunks, z = split. Item i is query row
 * items[i] (items NULL: row i, and every sequence has one query, decode =
 * 1); partials are indexed by item. n_splits == 1: every row writes out
 * directly (ws unused). */
template <int D>
__global__ void __launch_bounds__(DV2_THREADS)
decode_v2_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                 const bf16 *__restrict__ vc, const int32_t *__restrict__ q_begin,
                 const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel,
                 const int32_t *__restrict__ items, int n_seqs, int decode, int n_heads, int n_kv,
                 float scale_log2, int n_splits, float *__restrict__ ws_o,
                 float *__restrict__ ws_lse) {
    typedef dv2_cfg<D> C;
    constexpr int NST = C::NST, LD = C::LD;
    constexpr int CPR = D / 8;        /* 16-byte chunks per row */
    constexpr int RPI = 32 / CPR;     /* rows per warp pass */
    constexpr int PASSES = DV2_KT / RPI;
    extern __shared__ __align__(128) char dv2_smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int32_t it = blockIdx.x, r = items ? items[it] : it;
    const int G_all = n_heads / n_kv, n_chunks = (G_all + DV2_GMAX - 1) / DV2_GMAX;
    const int kvh = blockIdx.y / n_chunks;
    const int h0 = kvh * G_all + (blockIdx.y % n_chunks) * DV2_GMAX;
    const int G = min(DV2_GMAX, kvh * G_all + G_all - h0);
    const int split = blockIdx.z;

    int32_t base, n_ent;
    item_range(q_begin, sel_begin, n_seqs, decode != 0, r, &base, &n_ent);
    const int32_t chunk = split_chunk(n_ent, n_splits, DV2_GRAN);
    const int32_t k_begin = split * chunk;
    if (k_begin >= n_ent) return; /* past this row's effective split count (block-uniform) */
    const int32_t k_end = min(n_ent, k_begin + chunk);
    const bool direct = chunk >= n_ent; /* one effective split: no merge pass */
    const int n_tiles = (k_end - k_begin + DV2_KT - 1) / DV2_KT;
    const int n_my = n_tiles > warp ? (n_tiles - warp + DV2_WARPS - 1) / DV2_WARPS : 0;

    /* Q rows g, g+8 (heads h0 + row) as A fragments, unscaled bf16 */
    uint32_t qa[D / 16][4];
    {
        const size_t q0 = ((size_t)r * n_heads + h0) * D;
        const bool ok0 = g < G, ok1 = g + 8 < G;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const int d = ks * 16 + 2 * t4;
            qa[ks][0] = ok0 ? ld_u32(q + q0 + (size_t)g * D + d) : 0u;
            qa[ks][1] = ok1 ? ld_u32(q + q0 + (size_t)(g + 8) * D + d) : 0u;
            qa[ks][2] = ok0 ? ld_u32(q + q0 + (size_t)g * D + d + 8) : 0u;
            qa[ks][3] = ok1 ? ld_u32(q + q0 + (size_t)(g + 8) * D + d + 8) : 0u;
        }
    }

    bf16 *wbuf = (bf16 *)dv2_smem + (size_t)warp * NST * C::STAGE;
    const size_t row_stride = (size_t)n_kv * D;
    const bf16 *kbase = kc + (size_t)kvh * D, *vbase = vc + (size_t)kvh * D;
    /* lane l holds the slot of key (l & 15) of a tile; -1 past k_end */
    auto tile_key0 = [&](int j) -> int32_t { return k_begin + (warp + j * DV2_WARPS) * DV2_KT; };
    auto load_slot = [&](int j) -> int32_t {
        const int32_t e = tile_key0(j) + (lane & 15);
        return e < k_end ? __ldg(sel + base + e) : -1;
    };
    auto issue = [&](int32_t myslot, int st) {
        bf16 *ks_ = wbuf + st * C::STAGE, *vs_ = ks_ + DV2_KT * LD;
        const int cc = lane % CPR;
#pragma unroll
        for (int i = 0; i < PASSES; i++) {
            const int rr = i * RPI + lane / CPR;
            const int32_t s = __shfl_sync(0xffffffffu, myslot, rr);
            const size_t off = (size_t)(s >= 0 ? s : 0) * row_stride + cc * 8;
            const int nb = s >= 0 ? 16 : 0; /* zero rows past the end: 0 * garbage could be NaN */
            cp_async16(ks_ + rr * LD + cc * 8, kbase + off, nb);
            cp_async16(vs_ + rr * LD + cc * 8, vbase + off, nb);
        }
    };

#pragma unroll
    for (int st = 0; st < NST - 1; st++) {
        if (st < n_my) issue(load_slot(st), st);
        cp_async_commit(); /* empty groups keep the wait counts uniform */
    }
    int32_t slot_next = NST - 1 < n_my ? load_slot(NST - 1) : -1;

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; /* rows g, g + 8 */

    for (int j = 0; j < n_my; j++) {
        cp_async_wait<NST - 2>(); /* this lane's copies of tile j landed */
        __syncwarp();             /* ... and every lane's */
        const int jn = j + NST - 1;
        if (jn < n_my) issue(slot_next, jn % NST); /* stage of tile j - 1, consumed */
        cp_async_commit();
        if (jn + 1 < n_my) slot_next = load_slot(jn + 1);

        const bf16 *Ks = wbuf + (j % NST) * C::STAGE, *Vs = Ks + DV2_KT * LD;
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3,
                    Ks + ((lane >> 4) * 8 + (lane & 7)) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
            mma_bf16(s[0], qa[ks], b0, b1);
            mma_bf16(s[1], qa[ks], b2, b3);
        }
        const int32_t key0 = tile_key0(j);
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int32_t key = key0 + nt * 8 + 2 * t4 + (c & 1);
                s[nt][c] = key < k_end ? s[nt][c] * scale_log2 : -INFINITY;
                if (c < 2) mx0 = fmaxf(mx0, s[nt][c]);
                else mx1 = fmaxf(mx1, s[nt][c]);
            }
        /* the tile's first key is valid, so both maxima are finite */
        const float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1); /* 0 on the first tile */
        m0 = mn0, m1 = mn1;
        float p[2][4];
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            p[nt][0] = exp2f(s[nt][0] - mn0), p[nt][1] = exp2f(s[nt][1] - mn0);
            p[nt][2] = exp2f(s[nt][2] - mn1), p[nt][3] = exp2f(s[nt][3] - mn1);
            sum0 += p[nt][0] + p[nt][1];
            sum1 += p[nt][2] + p[nt][3];
        }
        l0 = l0 * al0 + sum0; /* per-lane partial; reduced over the quad at the end */
        l1 = l1 * al1 + sum1;
#pragma unroll
        for (int i = 0; i < D / 8; i++) o[i][0] *= al0, o[i][1] *= al0, o[i][2] *= al1, o[i][3] *= al1;
        const uint32_t pa[4] = {pack_bf16(p[0][0], p[0][1]), pack_bf16(p[0][2], p[0][3]),
                                pack_bf16(p[1][0], p[1][1]), pack_bf16(p[1][2], p[1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 16; dt++) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3,
                      Vs + (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dt * 16 + (lane >> 4) * 8);
            mma_bf16(o[2 * dt], pa, b0, b1);
            mma_bf16(o[2 * dt + 1], pa, b2, b3);
        }
        __syncwarp(); /* tile j's stage is refilled by the next iteration */
    }
    cp_async_wait<0>();
    l0 = quad_sum(l0), l1 = quad_sum(l1);
    __syncthreads(); /* every warp is done with the pipeline buffers: reuse them */

    /* merge the 4 warp states: os [w][16][LDO], ms [w][16], ls [w][16] */
    float *os = (float *)dv2_smem;
    float *ms = os + DV2_WARPS * DV2_GMAX * C::LDO, *ls = ms + DV2_WARPS * DV2_GMAX;
    {
        float *o0 = os + (warp * DV2_GMAX + g) * C::LDO, *o1 = o0 + 8 * C::LDO;
#pragma unroll
        for (int i = 0; i < D / 8; i++) {
            const int d = i * 8 + 2 * t4;
            o0[d] = o[i][0], o0[d + 1] = o[i][1];
            o1[d] = o[i][2], o1[d + 1] = o[i][3];
        }
        if (t4 == 0) {
            ms[warp * DV2_GMAX + g] = m0, ms[warp * DV2_GMAX + g + 8] = m1;
            ls[warp * DV2_GMAX + g] = l0, ls[warp * DV2_GMAX + g + 8] = l1;
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += DV2_THREADS) {
        const int hg = i / D, d = i % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < DV2_WARPS; w++) M = fmaxf(M, ms[w * DV2_GMAX + hg]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < DV2_WARPS; w++) {
            const float wt = exp2f(ms[w * DV2_GMAX + hg] - M); /* 0 for a warp without tiles */
            L += wt * ls[w * DV2_GMAX + hg];
            O += wt * os[(w * DV2_GMAX + hg) * C::LDO + d];
        }
        if (direct) {
            out[((size_t)r * n_heads + h0 + hg) * D + d] = __float2bfloat16(O / L);
        } else {
            const size_t idx = ((size_t)it * n_heads + h0 + hg) * n_splits + split;
            ws_o[idx * D + d] = O / L;
            if (d == 0) ws_lse[idx] = M + log2f(L);
        }
    }
}

template <int D>
static int dv2_blocks_per_sm(void) {
    static int n = 0; /* per instantiation; the kernel attributes never change */
    if (!n) {
        CU_CHECK(cudaFuncSetAttribute(decode_v2_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)dv2_cfg<D>::SMEM));
        CU_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_v2_kernel<D>, DV2_THREADS,
                                                               dv2_cfg<D>::SMEM));
        if (n < 1) n = 1;
    }
    return n;
}

/* n_items query rows with one query each: rows 0..n_items-1 of an all-decode
 * batch (d_items NULL), or the rows d_items[] of a mixed batch */
template <int D>
static void launch_decode_v2(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                             const int32_t *d_sb, const int32_t *d_sel, int32_t n_items,
                             const int32_t *d_items) {
    const int G = a->n_heads / a->n_kv_heads;
    const int n_chunks = (G + DV2_GMAX - 1) / DV2_GMAX;
    /* one wave: as many splits as fit next to the other (row, KV head) blocks;
     * rounding down keeps the last wave from being a small tail */
    const int64_t base_blocks = (int64_t)n_items * a->n_kv_heads * n_chunks;
    const int64_t slots = (int64_t)c->n_sms * dv2_blocks_per_sm<D>();
    int64_t ns = slots / base_blocks;
    const int n_splits = (int)(ns < 1 ? 1 : ns > SPLIT_MAX ? SPLIT_MAX : ns);
    float *ws_o = NULL, *ws_lse = NULL;
    const size_t n_part = (size_t)n_items * a->n_heads * n_splits;
    if (n_splits > 1) {
        size_t cap = c->attn_ws_cap * sizeof(float);
        lethe_cuda_reserve(c, (void **)&c->attn_ws, &cap, n_part * (D + 1) * sizeof(float));
        c->attn_ws_cap = cap / sizeof(float);
        ws_o = c->attn_ws, ws_lse = c->attn_ws + n_part * D;
    }
    LETHE_ASSERT(a->n_kv_heads * n_chunks <= 65535);
    dim3 grid((unsigned)n_items, (unsigned)(a->n_kv_heads * n_chunks), (unsigned)n_splits);
    decode_v2_kernel<D><<<grid, DV2_THREADS, dv2_cfg<D>::SMEM, c->stream>>>(
        (bf16 *)a->out, (const bf16 *)a->q, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache, d_qb,
        d_sb, d_sel, d_items, a->n_seqs, d_items ? 0 : 1, a->n_heads, a->n_kv_heads,
        a->scale * LOG2E, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
    if (n_splits > 1)
        lethe_cuda_attn_merge(c, a->out, d_qb, d_sb, a->n_seqs, d_items == NULL, n_items,
                              a->n_heads, D, n_splits, DV2_GRAN, true, d_items, ws_o, ws_lse);
}

void lethe_cuda_attn_decode_v2(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                               const int32_t *d_sb, const int32_t *d_sel) {
    LETHE_ASSERT(a->n_tokens == a->n_seqs);
    if (a->head_dim == 64) launch_decode_v2<64>(c, a, d_qb, d_sb, d_sel, a->n_tokens, NULL);
    else if (a->head_dim == 128) launch_decode_v2<128>(c, a, d_qb, d_sb, d_sel, a->n_tokens, NULL);
    else if (a->head_dim == 256) launch_decode_v2<256>(c, a, d_qb, d_sb, d_sel, a->n_tokens, NULL);
    else LETHE_ASSERT(!"decode v2: head_dim must be 64, 128 or 256");
}

/* ---- prefill / extend -------------------------------------------------------- */

/* 128 query rows per block (8 warps x 16) rather than 64: every K/V tile
 * read from L2 serves twice the rows. At 64 rows the L2 -> SM traffic at
 * the tensor-core rate (~32 KB of K/V per 2 MFLOP block-tile) would be about
 * 12 TB/s, above what L2 delivers. */
#define PF2_BM 128
#define PF2_BN 64 /* keys per tile */
#define PF2_WARPS (PF2_BM / 16)
#define PF2_THREADS (PF2_WARPS * 32)

template <int D>
struct pf2_cfg {
    static constexpr int LD = D + 8;
    static constexpr int Q_ELEMS = PF2_BM * LD;
    static constexpr int KV_ELEMS = PF2_BN * LD;
    /* Q, then 2 buffers x (K, V): 104 KB at D = 128 (opt-in dynamic shared memory) */
    static constexpr size_t SMEM = (size_t)(Q_ELEMS + 4 * KV_ELEMS) * 2;
};

/* grid: x = head, y = tile (tiles[y] = {seq, first row within seq}, heaviest
 * first; BSP: {seq, first row, query block of the block-sparse plan or -1}).
 * BSP (block-sparse prefill, attention_bsp.cu): a tile with a plan reads only
 * the 64-key tiles bp.tiles lists for its (query block, KV head), ascending,
 * then ceil(n_skip / 64) pseudo-tiles: the mean K / V rows (bp.km / bp.vm)
 * of its skipped key blocks, each with logit + log2(128) (the block's 128
 * entries), visible to every row. */
template <int D, bool BSP>
__global__ void __launch_bounds__(PF2_THREADS, 1)
prefill_v2_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ q, const bf16 *__restrict__ kc,
                  const bf16 *__restrict__ vc, const int32_t *__restrict__ q_begin,
                  const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel,
                  const int32_t *__restrict__ tiles, int n_heads, int n_kv, float scale_log2,
                  lethe_cuda_bsp_dev bp) {
    typedef pf2_cfg<D> C;
    constexpr int LD = C::LD;
    constexpr int CPR = D / 8;                 /* 16-byte chunks per row */
    constexpr int RPP = PF2_THREADS / CPR;     /* rows per block pass */
    constexpr int PASSES = PF2_BN / RPP;       /* K/V tile passes */
    constexpr int QPASSES = PF2_BM / RPP;
    static_assert(PF2_BN % RPP == 0 && PF2_BM % RPP == 0, "whole passes");
    extern __shared__ __align__(128) char pf2_smem[];
    bf16 *Qs = (bf16 *)pf2_smem;
    bf16 *KVs = Qs + C::Q_ELEMS; /* buffer b: K at 2b, V at 2b + 1 (units of KV_ELEMS) */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int h = blockIdx.x, kvh = h / (n_heads / n_kv);
    constexpr int TS = BSP ? 3 : 2; /* ints per tiles[] entry */
    const int s = tiles[TS * blockIdx.y], qt0 = tiles[TS * blockIdx.y + 1];
    const int32_t qb = q_begin[s], n_q = q_begin[s + 1] - qb;
    const int32_t sb = sel_begin[s], n_sel = sel_begin[s + 1] - sb, n_pre = n_sel - n_q;
    const int rows_here = min(PF2_BM, n_q - qt0);
    const int32_t kend = n_pre + qt0 + rows_here; /* entries [0, kend) are read */
    const int n_kt = (kend + PF2_BN - 1) / PF2_BN;
    const size_t row_stride = (size_t)n_kv * D;
    const int cc = tid % CPR, r0 = tid / CPR;
    /* iterations: key tiles (dense: 0 .. n_kt - 1; BSP: the listed ones), then pseudo-tiles */
    const int32_t qblk = BSP ? tiles[TS * blockIdx.y + 2] : -1;
    const int32_t *tlist = nullptr, *skl = nullptr;
    int n_real = n_kt, n_skip = 0;
    if (BSP && qblk >= 0) {
        const size_t item = (size_t)qblk * n_kv + kvh;
        n_real = bp.counts[2 * item];
        n_skip = bp.counts[2 * item + 1];
        tlist = bp.tiles + item * bp.tiles_stride;
        skl = bp.skips + item * bp.skips_stride;
    }
    const int n_it = n_real + (n_skip + PF2_BN - 1) / PF2_BN;
    /* key tile of iteration it (BSP pseudo-tile p: -1 - p) */
    auto tile_of = [&](int it) -> int { return it < n_real ? (tlist ? __ldg(tlist + it) : it) : n_real - 1 - it; };

    /* Q tile (rows past the sequence are zeros) */
#pragma unroll
    for (int i = 0; i < QPASSES; i++) {
        const int rr = r0 + i * RPP;
        const bool ok = rr < rows_here;
        const bf16 *src = q + ((size_t)(qb + qt0 + (ok ? rr : 0)) * n_heads + h) * D + cc * 8;
        cp_async16(Qs + rr * LD + cc * 8, src, ok ? 16 : 0);
    }
    cp_async_commit();

    int32_t slot[PASSES]; /* slots of this thread's rows in the next tile to issue */
    bool slot_mean = false; /* ... which are rows of bp.km / bp.vm (a pseudo-tile) */
    auto load_slots = [&](int it) {
        const int kt = tile_of(it);
        slot_mean = BSP && kt < 0;
#pragma unroll
        for (int i = 0; i < PASSES; i++) {
            if (BSP && kt < 0) {
                const int32_t x = (-1 - kt) * PF2_BN + r0 + i * RPP;
                slot[i] = x < n_skip ? __ldg(skl + x) : -1;
                continue;
            }
            const int32_t e = kt * PF2_BN + r0 + i * RPP;
            slot[i] = e < kend ? __ldg(sel + sb + e) : -1;
        }
    };
    auto issue = [&](int buf) {
        bf16 *Kd = KVs + (size_t)(2 * buf) * C::KV_ELEMS, *Vd = Kd + C::KV_ELEMS;
        const bf16 *ks = BSP && slot_mean ? bp.km : kc, *vs = BSP && slot_mean ? bp.vm : vc;
#pragma unroll
        for (int i = 0; i < PASSES; i++) {
            const int rr = r0 + i * RPP;
            const size_t off = (size_t)(slot[i] >= 0 ? slot[i] : 0) * row_stride +
                               (size_t)kvh * D + cc * 8;
            const int nb = slot[i] >= 0 ? 16 : 0;
            cp_async16(Kd + rr * LD + cc * 8, ks + off, nb);
            cp_async16(Vd + rr * LD + cc * 8, vs + off, nb);
        }
    };
    load_slots(0);
    issue(0);
    cp_async_commit();
    if (n_it > 1) load_slots(1);

    cp_async_wait<1>(); /* the Q group */
    __syncthreads();
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
        ldsm_x4(qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3],
                Qs + (warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + ks * 16 +
                    (lane >> 4) * 8);

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int32_t lim0 = n_pre + qt0 + warp * 16 + g, lim1 = lim0 + 8; /* inclusive, rows g, g+8 */
    const int32_t diag = n_pre + qt0; /* keys > diag are masked for some row of the block */
    /* a warp whose 16 rows are all past the sequence (short chunks, decode rows
     * of a mixed batch) only helps load and keeps the barriers */
    const bool warp_rows = warp * 16 < rows_here;

    for (int it = 0; it < n_it; it++) {
        cp_async_wait<0>(); /* tile it (this thread's copies) */
        __syncthreads();    /* every thread's copies; every warp done with tile it - 1 */
        if (it + 1 < n_it) issue((it + 1) & 1);
        cp_async_commit();
        if (it + 2 < n_it) load_slots(it + 2);

        if (!warp_rows) continue;
        const int kt = tile_of(it);
        const bf16 *Ks = KVs + (size_t)(2 * (it & 1)) * C::KV_ELEMS, *Vs = Ks + C::KV_ELEMS;
        float sc[PF2_BN / 8][4];
#pragma unroll
        for (int i = 0; i < PF2_BN / 8; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
            for (int np = 0; np < PF2_BN / 16; np++) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3,
                        Ks + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + ks * 16 +
                            ((lane >> 3) & 1) * 8);
                mma_bf16(sc[2 * np], qa[ks], b0, b1);
                mma_bf16(sc[2 * np + 1], qa[ks], b2, b3);
            }
        const bool pseudo = BSP && kt < 0;
        const int32_t key0 = pseudo ? (-1 - kt) * PF2_BN : kt * PF2_BN;
        const bool need_mask = pseudo || key0 + PF2_BN - 1 > diag; /* block-uniform */
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < PF2_BN / 8; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float v = sc[nt][c] * scale_log2;
                if (need_mask) {
                    const int32_t key = key0 + nt * 8 + 2 * t4 + (c & 1);
                    if (pseudo) v = key < n_skip ? v + 7.0f : -INFINITY; /* log2(128) */
                    else if (key > (c < 2 ? lim0 : lim1)) v = -INFINITY;
                }
                sc[nt][c] = v;
                if (c < 2) mx0 = fmaxf(mx0, v);
                else mx1 = fmaxf(mx1, v);
            }
        /* key 0 is valid for every row, so m is finite from the first tile on;
         * a fully masked row in a later tile keeps m (alpha 1, p 0) */
        const float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
        m0 = mn0, m1 = mn1;
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < PF2_BN / 8; nt++) {
            sc[nt][0] = exp2f(sc[nt][0] - mn0), sc[nt][1] = exp2f(sc[nt][1] - mn0);
            sc[nt][2] = exp2f(sc[nt][2] - mn1), sc[nt][3] = exp2f(sc[nt][3] - mn1);
            sum0 += sc[nt][0] + sc[nt][1];
            sum1 += sc[nt][2] + sc[nt][3];
        }
        l0 = l0 * al0 + sum0;
        l1 = l1 * al1 + sum1;
#pragma unroll
        for (int i = 0; i < D / 8; i++) o[i][0] *= al0, o[i][1] *= al0, o[i][2] *= al1, o[i][3] *= al1;
#pragma unroll
        for (int kk = 0; kk < PF2_BN / 16; kk++) {
            const uint32_t pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]),
                                    pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                                    pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                    pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < D / 16; dt++) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3,
                          Vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dt * 16 +
                              (lane >> 4) * 8);
                mma_bf16(o[2 * dt], pa, b0, b1);
                mma_bf16(o[2 * dt + 1], pa, b2, b3);
            }
        }
    }
    cp_async_wait<0>();
    l0 = quad_sum(l0), l1 = quad_sum(l1);
    const int ra = warp * 16 + g, rb = ra + 8;
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
        const int d = i * 8 + 2 * t4;
        if (ra < rows_here)
            *(__nv_bfloat162 *)(out + ((size_t)(qb + qt0 + ra) * n_heads + h) * D + d) =
                __floats2bfloat162_rn(o[i][0] * inv0, o[i][1] * inv0);
        if (rb < rows_here)
            *(__nv_bfloat162 *)(out + ((size_t)(qb + qt0 + rb) * n_heads + h) * D + d) =
                __floats2bfloat162_rn(o[i][2] * inv1, o[i][3] * inv1);
    }
}

typedef struct pf2_tile {
    int32_t seq, r0, work;
} pf2_tile;

static int pf2_heavier_first(const void *x, const void *y) {
    const pf2_tile *a = (const pf2_tile *)x, *b = (const pf2_tile *)y;
    if (a->work != b->work) return a->work > b->work ? -1 : 1;
    if (a->seq != b->seq) return a->seq < b->seq ? -1 : 1;
    return a->r0 < b->r0 ? -1 : a->r0 > b->r0;
}

template <int D>
static void launch_prefill_v2(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                              const int32_t *d_sb, const int32_t *d_sel, const lethe_cuda_bsp_plan *bp) {
    /* single-query sequences (decode rows of a mixed step) -> decode kernel */
    int32_t n_single = 0, n_tiles = 0;
    for (int s = 0; s < a->n_seqs; s++) {
        const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
        if (n_q == 1) n_single++;
        else n_tiles += (n_q + PF2_BM - 1) / PF2_BM;
    }
    if (n_single) {
        void *hv;
        int32_t *d_items = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)n_single * sizeof(int32_t), &hv);
        int32_t *hi = (int32_t *)hv, k = 0;
        for (int s = 0; s < a->n_seqs; s++)
            if (a->q_begin[s + 1] - a->q_begin[s] == 1) hi[k++] = a->q_begin[s];
        CU_CHECK(cudaMemcpyAsync(d_items, hi, (size_t)n_single * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, c->stream));
        launch_decode_v2<D>(c, a, d_qb, d_sb, d_sel, n_single, d_items);
    }
    if (!n_tiles) return;
    LETHE_ASSERT(n_tiles <= 65535 && "prefill v2: more than 65535 query tiles in one call");
    pf2_tile *list = (pf2_tile *)malloc((size_t)n_tiles * sizeof(pf2_tile));
    LETHE_ASSERT(list);
    int32_t t = 0;
    for (int s = 0; s < a->n_seqs; s++) {
        const int32_t n_q = a->q_begin[s + 1] - a->q_begin[s];
        const int32_t n_pre = a->sel_begin[s + 1] - a->sel_begin[s] - n_q;
        if (n_q == 1) continue; /* done by the decode kernel above */
        for (int32_t r0 = 0; r0 < n_q; r0 += PF2_BM) {
            const int32_t rows = n_q - r0 < PF2_BM ? n_q - r0 : PF2_BM;
            list[t++] = (pf2_tile){s, r0, n_pre + r0 + rows};
        }
    }
    qsort(list, (size_t)n_tiles, sizeof(pf2_tile), pf2_heavier_first);
    void *h;
    const int TS = bp ? 3 : 2; /* ints per tile: seq, first row (, block-sparse query block) */
    int32_t *d_tiles = (int32_t *)lethe_cuda_ring_alloc(c, (size_t)n_tiles * TS * sizeof(int32_t), &h);
    int32_t *ht = (int32_t *)h;
    for (int32_t i = 0; i < n_tiles; i++) {
        ht[TS * i] = list[i].seq, ht[TS * i + 1] = list[i].r0;
        if (bp) {
            const int32_t base = bp->qblk_base[list[i].seq];
            ht[TS * i + 2] = base >= 0 ? base + list[i].r0 / PF2_BM : -1;
        }
    }
    free(list);
    CU_CHECK(cudaMemcpyAsync(d_tiles, ht, (size_t)n_tiles * TS * sizeof(int32_t),
                             cudaMemcpyHostToDevice, c->stream));
    static bool attr_set[2] = {false, false}; /* per instantiation */
    if (!attr_set[bp ? 1 : 0]) {
        if (bp)
            CU_CHECK(cudaFuncSetAttribute(prefill_v2_kernel<D, true>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)pf2_cfg<D>::SMEM));
        else
            CU_CHECK(cudaFuncSetAttribute(prefill_v2_kernel<D, false>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)pf2_cfg<D>::SMEM));
        attr_set[bp ? 1 : 0] = true;
    }
    const dim3 grid((unsigned)a->n_heads, (unsigned)n_tiles);
    if (bp)
        prefill_v2_kernel<D, true><<<grid, PF2_THREADS, pf2_cfg<D>::SMEM, c->stream>>>(
            (bf16 *)a->out, (const bf16 *)a->q, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache,
            d_qb, d_sb, d_sel, d_tiles, a->n_heads, a->n_kv_heads, a->scale * LOG2E, bp->dev);
    else
        prefill_v2_kernel<D, false><<<grid, PF2_THREADS, pf2_cfg<D>::SMEM, c->stream>>>(
            (bf16 *)a->out, (const bf16 *)a->q, (const bf16 *)a->k_cache, (const bf16 *)a->v_cache,
            d_qb, d_sb, d_sel, d_tiles, a->n_heads, a->n_kv_heads, a->scale * LOG2E,
            lethe_cuda_bsp_dev{});
    CU_LAUNCH_CHECK();
}

bool lethe_cuda_attn_v2_fits(const cuda_ctx *c, int D) {
    if (D != 64 && D != 128) return false;
    const size_t dec = D == 64 ? dv2_cfg<64>::SMEM : dv2_cfg<128>::SMEM;
    const size_t pre = D == 64 ? pf2_cfg<64>::SMEM : pf2_cfg<128>::SMEM;
    return dec <= c->smem_optin && pre <= c->smem_optin;
}

bool lethe_cuda_attn_decode_v2_fits(const cuda_ctx *c, int D) {
    if (D == 256) return dv2_cfg<256>::SMEM <= c->smem_optin;
    return lethe_cuda_attn_v2_fits(c, D);
}

void lethe_cuda_attn_prefill_v2(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                const int32_t *d_sb, const int32_t *d_sel) {
    lethe_cuda_attn_prefill_v2_bsp(c, a, d_qb, d_sb, d_sel, NULL);
}

void lethe_cuda_attn_prefill_v2_bsp(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                    const int32_t *d_sb, const int32_t *d_sel,
                                    const lethe_cuda_bsp_plan *bp) {
    if (a->head_dim == 64) launch_prefill_v2<64>(c, a, d_qb, d_sb, d_sel, bp);
    else if (a->head_dim == 128) launch_prefill_v2<128>(c, a, d_qb, d_sb, d_sel, bp);
    else LETHE_ASSERT(!"prefill v2: head_dim must be 64 or 128");
}

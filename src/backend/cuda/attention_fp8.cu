/* attention_fp8.cu - decode attention over FP8 E4M3 KV on tensor cores
 * (CUDA backend). Semantics: backend.h's lethe_attn_args with kvq format
 * FP8_E4M3, every sequence one query (decode), head_dim 64 / 128; the CPU twin
 * is backend/cpu/attention_quant.c, and attention_quant.cu's SIMT kernel takes
 * every other shape (prefill / extend rows, other head dims).
 *
 * Structure as decode_v2_kernel (attention_v2.cu): a block = (row, KV head,
 * chunk of <= 16 query heads, split); the query heads are the 16 M rows of
 * mma.sync.m16n8k16; 4 warps, warp w takes the 16-key tiles w, w+4, ... of
 * the split through its own NST-stage cp.async pipeline; the warp states are
 * merged at the end (one split: bf16 out, else partial + LSE for
 * lethe_cuda_attn_merge). A stage holds the tile's K and V CODES (16 x D
 * bytes each, half the bytes of bf16) and their per-(slot, KV head) scales.
 *
 * Exact dequantization into fp16 mma operands: an E4M3 byte s eeee mmm placed
 * as the fp16 bits s 0eeee mmm0000000 is the value x 2^-8 exactly, normal and
 * subnormal codes alike (fp16 has the same 3-bit field order, 8 more exponent
 * bias, and subnormals the tensor cores keep). So K and V enter the mma as
 * exact code values; the scales are applied outside it:
 *   QK^T: S[h][key] = (Q'[h] . Kcode'[key]) * 2^8 * k_scale[key] / pw[h],
 *         Q' = Q * pw[h] in fp16, pw a power of two per head putting the
 *         head's |q| max in [2^14, 2^15) (scaling by 2^k is exact; fp16 holds
 *         bf16's 8 significant bits);
 *   PV:   O[h] += sum_key (p[h][key] * v_scale[key] / vr) * Vcode'[key] with
 *         vr the tile's largest v_scale (the fp16 P' lies in [0, 1]); the
 *         fp32 O is kept in units of 2^-8 vr and rescaled with the softmax
 *         correction when vr changes between tiles.
 * The only rounding beyond the dense kernel's is P' to fp16 (11 significant
 * bits; dense rounds P to bf16, 8 bits).
 *
 * Operand layouts. The k dimension of an mma may be permuted freely as long
 * as A and B agree, so lanes take whole words of codes:
 *   QK^T B (k = d, n = key): lane (g, t4) loads the 16-byte chunk 4 kq + t4
 *     of key rows g and g + 8; word j of the chunk (codes d0 .. d0 + 3,
 *     d0 = 64 kq + 16 t4 + 4 j) gives b0 = codes (d0, d0 + 2) and b1 = codes
 *     (d0 + 1, d0 + 3) of k-step ks = 4 kq + j, and Q's A fragment takes the
 *     same d's.
 *   PV B (k = key, n = d): lane (g, t4) loads bytes [W g, W g + W) (W = D / 8)
 *     of key rows 2t4, 2t4+1, 2t4+8, 2t4+9 and pairs the rows by byte
 *     permutes; n-tile i's column n is output dim W n + i.
 * Shared code rows are D + 16 bytes (conflict-free PV reads, 2-way on K). */
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/ptx.cuh"

#include <math.h>

#define F8_WARPS 4
#define F8_THREADS (F8_WARPS * 32)
#define F8_KT 16                       /* keys per warp tile */
#define F8_GRAN (F8_WARPS * F8_KT)     /* split chunks are multiples of this */
#define F8_GMAX 16                     /* query heads per block = mma M */

template <int D>
struct f8_cfg {
    static constexpr int NST = D == 64 ? 8 : 4;           /* pipeline stages per warp */
    static constexpr int LDB = D + 16;                    /* bytes per shared code row */
    static constexpr int STAGE = 2 * F8_KT * LDB + 2 * F8_KT * 4; /* K, V codes, k / v scales */
    static constexpr size_t PIPE_BYTES = (size_t)F8_WARPS * NST * STAGE;
    static constexpr int LDO = D + 4;                     /* floats per merge row */
    static constexpr size_t MERGE_BYTES = (size_t)F8_WARPS * F8_GMAX * (LDO + 2) * 4;
    static constexpr size_t SMEM = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
};

/* fp16 pairs (x 2^-8) of E4M3 codes: bytes 0, 2 of x / bytes 1, 3 of x */
__device__ __forceinline__ uint32_t e4m3x2_lo(uint32_t x) {
    return ((x << 7) & 0x3F803F80u) | ((x << 8) & 0x80008000u);
}
__device__ __forceinline__ uint32_t e4m3x2_hi(uint32_t x) {
    return ((x >> 1) & 0x3F803F80u) | (x & 0x80008000u);
}

__device__ __forceinline__ float f8_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float f8_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* grid: x = query row (= sequence), y = KV head * head chunks, z = split.
 * n_splits == 1: every row writes out directly (ws unused). */
template <int D>
__global__ void __launch_bounds__(F8_THREADS)
decode_fp8_kernel(bf16 *__restrict__ out, const bf16 *__restrict__ q, const uint8_t *__restrict__ kc,
                  const uint8_t *__restrict__ vc, const float *__restrict__ ksc,
                  const float *__restrict__ vsc, const int32_t *__restrict__ q_begin,
                  const int32_t *__restrict__ sel_begin, const int32_t *__restrict__ sel, int n_seqs,
                  int n_heads, int n_kv, float scale_log2, int n_splits, float *__restrict__ ws_o,
                  float *__restrict__ ws_lse) {
    typedef f8_cfg<D> C;
    constexpr int NST = C::NST, LDB = C::LDB;
    constexpr int CPR = D / 16;       /* 16-byte chunks per code row */
    constexpr int RPI = 32 / CPR;     /* rows per warp pass */
    constexpr int PASSES = F8_KT / RPI;
    constexpr int W = D / 8;          /* PV: output dims per lane group, n-tiles */
    extern __shared__ __align__(128) char f8_smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int32_t r = blockIdx.x;
    const int G_all = n_heads / n_kv, n_chunks = (G_all + F8_GMAX - 1) / F8_GMAX;
    const int kvh = blockIdx.y / n_chunks;
    const int h0 = kvh * G_all + (blockIdx.y % n_chunks) * F8_GMAX;
    const int G = min(F8_GMAX, kvh * G_all + G_all - h0);
    const int split = blockIdx.z;

    int32_t base, n_ent;
    item_range(q_begin, sel_begin, n_seqs, true, r, &base, &n_ent);
    const int32_t chunk = split_chunk(n_ent, n_splits, F8_GRAN);
    const int32_t k_begin = split * chunk;
    if (k_begin >= n_ent) return; /* past this row's effective split count (block-uniform) */
    const int32_t k_end = min(n_ent, k_begin + chunk);
    const bool direct = chunk >= n_ent;
    const int n_tiles = (k_end - k_begin + F8_KT - 1) / F8_KT;
    const int n_my = n_tiles > warp ? (n_tiles - warp + F8_WARPS - 1) / F8_WARPS : 0;

    /* Q rows g, g + 8 as fp16 A fragments, scaled by a power of two per head */
    uint32_t qa[D / 16][4];
    float qs0, qs1; /* 2^8 scale_log2 / pw of rows g, g + 8 */
    {
        const bf16 *q0 = q + ((size_t)r * n_heads + h0 + g) * D, *q1 = q0 + (size_t)8 * D;
        const bool ok0 = g < G, ok1 = g + 8 < G;
        float mx0 = 0.0f, mx1 = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const int d0 = (ks / 4) * 64 + 16 * t4 + 4 * (ks % 4);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (ok0) mx0 = fmaxf(mx0, fabsf(__bfloat162float(q0[d0 + u])));
                if (ok1) mx1 = fmaxf(mx1, fabsf(__bfloat162float(q1[d0 + u])));
            }
        }
        mx0 = f8_quad_max(mx0), mx1 = f8_quad_max(mx1);
        int e0 = 0, e1 = 0;
        if (mx0 > 0.0f) frexpf(mx0, &e0);
        if (mx1 > 0.0f) frexpf(mx1, &e1);
        const float pw0 = mx0 > 0.0f ? ldexpf(1.0f, 15 - e0) : 1.0f;
        const float pw1 = mx1 > 0.0f ? ldexpf(1.0f, 15 - e1) : 1.0f;
        qs0 = scale_log2 * 256.0f / pw0, qs1 = scale_log2 * 256.0f / pw1;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const int d0 = (ks / 4) * 64 + 16 * t4 + 4 * (ks % 4);
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int u = 0; u < 4; u++) {
                if (ok0) a[u] = __bfloat162float(q0[d0 + u]) * pw0;
                if (ok1) b[u] = __bfloat162float(q1[d0 + u]) * pw1;
            }
            qa[ks][0] = ptx_pack_f16(a[0], a[2]), qa[ks][2] = ptx_pack_f16(a[1], a[3]);
            qa[ks][1] = ptx_pack_f16(b[0], b[2]), qa[ks][3] = ptx_pack_f16(b[1], b[3]);
        }
    }

    char *wbuf = f8_smem + (size_t)warp * NST * C::STAGE;
    const size_t row_stride = (size_t)n_kv * D;
    const uint8_t *kbase = kc + (size_t)kvh * D, *vbase = vc + (size_t)kvh * D;
    /* lane l holds the slot of key (l & 15) of a tile; -1 past k_end */
    auto tile_key0 = [&](int j) -> int32_t { return k_begin + (warp + j * F8_WARPS) * F8_KT; };
    auto load_slot = [&](int j) -> int32_t {
        const int32_t e = tile_key0(j) + (lane & 15);
        return e < k_end ? __ldg(sel + base + e) : -1;
    };
    auto issue = [&](int32_t myslot, int st) {
        char *ks_ = wbuf + st * C::STAGE, *vs_ = ks_ + F8_KT * LDB;
        float *sc = (float *)(vs_ + F8_KT * LDB); /* k scales [16], v scales [16] */
        const int cc = lane % CPR;
#pragma unroll
        for (int i = 0; i < PASSES; i++) {
            const int rr = i * RPI + lane / CPR;
            const int32_t s = __shfl_sync(0xffffffffu, myslot, rr);
            const size_t off = (size_t)(s >= 0 ? s : 0) * row_stride + cc * 16;
            const int nb = s >= 0 ? 16 : 0; /* zero rows past the end */
            ptx_cp_async16(ks_ + rr * LDB + cc * 16, kbase + off, nb);
            ptx_cp_async16(vs_ + rr * LDB + cc * 16, vbase + off, nb);
        }
        const size_t srow = (size_t)(myslot >= 0 ? myslot : 0) * n_kv + kvh;
        ptx_cp_async4(sc + lane, (lane < 16 ? ksc : vsc) + srow, myslot >= 0 ? 4 : 0);
    };

#pragma unroll
    for (int st = 0; st < NST - 1; st++) {
        if (st < n_my) issue(load_slot(st), st);
        ptx_cp_async_commit(); /* empty groups keep the wait counts uniform */
    }
    int32_t slot_next = NST - 1 < n_my ? load_slot(NST - 1) : -1;

    float o[W][4];
#pragma unroll
    for (int i = 0; i < W; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; /* rows g, g + 8 */
    float vr = 1.0f; /* o is in units of 2^-8 vr */

    for (int j = 0; j < n_my; j++) {
        ptx_cp_async_wait<NST - 2>(); /* this lane's copies of tile j landed */
        __syncwarp();                 /* ... and every lane's */
        const int jn = j + NST - 1;
        if (jn < n_my) issue(slot_next, jn % NST); /* stage of tile j - 1, consumed */
        ptx_cp_async_commit();
        if (jn + 1 < n_my) slot_next = load_slot(jn + 1);

        const char *Ks = wbuf + (j % NST) * C::STAGE, *Vs = Ks + F8_KT * LDB;
        const float *sc = (const float *)(Vs + F8_KT * LDB);
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kq = 0; kq < D / 64; kq++) {
            const uint4 w0 = *(const uint4 *)(Ks + g * LDB + (4 * kq + t4) * 16);
            const uint4 w1 = *(const uint4 *)(Ks + (g + 8) * LDB + (4 * kq + t4) * 16);
            const uint32_t x0[4] = {w0.x, w0.y, w0.z, w0.w}, x1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                ptx_mma_f16(s[0], qa[4 * kq + jj], e4m3x2_lo(x0[jj]), e4m3x2_hi(x0[jj]));
                ptx_mma_f16(s[1], qa[4 * kq + jj], e4m3x2_lo(x1[jj]), e4m3x2_hi(x1[jj]));
            }
        }
        /* keys of this lane's S columns: 2t4, 2t4 + 1 (nt 0), 2t4 + 8, 2t4 + 9 (nt 1) */
        const float2 kA = *(const float2 *)(sc + 2 * t4), kB = *(const float2 *)(sc + 8 + 2 * t4);
        const float2 vA = *(const float2 *)(sc + 16 + 2 * t4), vB = *(const float2 *)(sc + 24 + 2 * t4);
        const float kk[2][2] = {{kA.x, kA.y}, {kB.x, kB.y}}, vv[2][2] = {{vA.x, vA.y}, {vB.x, vB.y}};
        const int32_t key0 = tile_key0(j);
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int32_t key = key0 + nt * 8 + 2 * t4 + (c & 1);
                s[nt][c] = key < k_end ? s[nt][c] * kk[nt][c & 1] * (c < 2 ? qs0 : qs1) : -INFINITY;
                if (c < 2) mx0 = fmaxf(mx0, s[nt][c]);
                else mx1 = fmaxf(mx1, s[nt][c]);
            }
        /* the tile's first key is valid, so both maxima are finite */
        const float mn0 = fmaxf(m0, f8_quad_max(mx0)), mn1 = fmaxf(m1, f8_quad_max(mx1));
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1); /* 0 on the first tile */
        m0 = mn0, m1 = mn1;
        float vt = f8_quad_max(fmaxf(fmaxf(vA.x, vA.y), fmaxf(vB.x, vB.y)));
        if (!(vt > 0.0f)) vt = vr; /* an all-zero V tile contributes nothing */
        const float ratio = vr / vt, inv = 1.0f / vt;
        vr = vt;
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
        const float c0 = al0 * ratio, c1 = al1 * ratio;
#pragma unroll
        for (int i = 0; i < W; i++) o[i][0] *= c0, o[i][1] *= c0, o[i][2] *= c1, o[i][3] *= c1;
        uint32_t pa[4];
        pa[0] = ptx_pack_f16(p[0][0] * vv[0][0] * inv, p[0][1] * vv[0][1] * inv);
        pa[1] = ptx_pack_f16(p[0][2] * vv[0][0] * inv, p[0][3] * vv[0][1] * inv);
        pa[2] = ptx_pack_f16(p[1][0] * vv[1][0] * inv, p[1][1] * vv[1][1] * inv);
        pa[3] = ptx_pack_f16(p[1][2] * vv[1][0] * inv, p[1][3] * vv[1][1] * inv);
        /* V rows 2t4, 2t4+1 (b0) and 2t4+8, 2t4+9 (b1), bytes [W g, W g + W) */
        uint32_t va[4][W / 4];
        {
            const char *v0 = Vs + W * g;
            const int rows[4] = {2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if constexpr (W == 16) {
                    const uint4 w = *(const uint4 *)(v0 + rows[k] * LDB);
                    va[k][0] = w.x, va[k][1] = w.y, va[k][2] = w.z, va[k][3] = w.w;
                } else {
                    const uint2 w = *(const uint2 *)(v0 + rows[k] * LDB);
                    va[k][0] = w.x, va[k][1] = w.y;
                }
            }
        }
#pragma unroll
        for (int wd = 0; wd < W / 4; wd++) {
            /* bytes (row a col c, row a col c+1, row b col c, row b col c+1) */
            const uint32_t y01 = __byte_perm(va[0][wd], va[1][wd], 0x5410);
            const uint32_t y23 = __byte_perm(va[0][wd], va[1][wd], 0x7632);
            const uint32_t z01 = __byte_perm(va[2][wd], va[3][wd], 0x5410);
            const uint32_t z23 = __byte_perm(va[2][wd], va[3][wd], 0x7632);
            ptx_mma_f16(o[4 * wd + 0], pa, e4m3x2_lo(y01), e4m3x2_lo(z01));
            ptx_mma_f16(o[4 * wd + 1], pa, e4m3x2_hi(y01), e4m3x2_hi(z01));
            ptx_mma_f16(o[4 * wd + 2], pa, e4m3x2_lo(y23), e4m3x2_lo(z23));
            ptx_mma_f16(o[4 * wd + 3], pa, e4m3x2_hi(y23), e4m3x2_hi(z23));
        }
        __syncwarp(); /* tile j's stage is refilled by the next iteration */
    }
    ptx_cp_async_wait<0>();
    l0 = f8_quad_sum(l0), l1 = f8_quad_sum(l1);
    __syncthreads(); /* every warp is done with the pipeline buffers: reuse them */

    /* merge the 4 warp states: os [w][16][LDO], ms [w][16], ls [w][16] */
    float *os = (float *)f8_smem;
    float *ms = os + F8_WARPS * F8_GMAX * C::LDO, *ls = ms + F8_WARPS * F8_GMAX;
    {
        const float u = vr * 256.0f; /* o back to value units */
        float *o0 = os + (warp * F8_GMAX + g) * C::LDO, *o1 = o0 + 8 * C::LDO;
#pragma unroll
        for (int i = 0; i < W; i++) {
            const int d = W * 2 * t4 + i; /* columns n = 2t4, 2t4 + 1 of n-tile i */
            o0[d] = o[i][0] * u, o0[d + W] = o[i][1] * u;
            o1[d] = o[i][2] * u, o1[d + W] = o[i][3] * u;
        }
        if (t4 == 0) {
            ms[warp * F8_GMAX + g] = m0, ms[warp * F8_GMAX + g + 8] = m1;
            ls[warp * F8_GMAX + g] = l0, ls[warp * F8_GMAX + g + 8] = l1;
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += F8_THREADS) {
        const int hg = i / D, d = i % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < F8_WARPS; w++) M = fmaxf(M, ms[w * F8_GMAX + hg]);
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < F8_WARPS; w++) {
            const float wt = exp2f(ms[w * F8_GMAX + hg] - M); /* 0 for a warp without tiles */
            L += wt * ls[w * F8_GMAX + hg];
            O += wt * os[(w * F8_GMAX + hg) * C::LDO + d];
        }
        if (direct) {
            out[((size_t)r * n_heads + h0 + hg) * D + d] = __float2bfloat16(O / L);
        } else {
            const size_t idx = ((size_t)r * n_heads + h0 + hg) * n_splits + split;
            ws_o[idx * D + d] = O / L;
            if (d == 0) ws_lse[idx] = M + log2f(L);
        }
    }
}

template <int D>
static int f8_blocks_per_sm(void) {
    static int n = 0; /* per instantiation; the kernel attributes never change */
    if (!n) {
        CU_CHECK(cudaFuncSetAttribute(decode_fp8_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)f8_cfg<D>::SMEM));
        CU_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_fp8_kernel<D>, F8_THREADS,
                                                               f8_cfg<D>::SMEM));
        if (n < 1) n = 1;
    }
    return n;
}

template <int D>
static void launch_decode_fp8(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                              const int32_t *d_sb, const int32_t *d_sel) {
    const int32_t n_rows = a->n_tokens;
    const int G = a->n_heads / a->n_kv_heads;
    const int n_chunks = (G + F8_GMAX - 1) / F8_GMAX;
    /* one wave: as many splits as fit next to the other (row, KV head) blocks */
    const int64_t base_blocks = (int64_t)n_rows * a->n_kv_heads * n_chunks;
    const int64_t slots = (int64_t)c->n_sms * f8_blocks_per_sm<D>();
    const int64_t ns = slots / base_blocks;
    const int n_splits = (int)(ns < 1 ? 1 : ns > SPLIT_MAX ? SPLIT_MAX : ns);
    float *ws_o = NULL, *ws_lse = NULL;
    const size_t n_part = (size_t)n_rows * a->n_heads * n_splits;
    if (n_splits > 1) {
        size_t cap = c->attn_ws_cap * sizeof(float);
        lethe_cuda_reserve(c, (void **)&c->attn_ws, &cap, n_part * (D + 1) * sizeof(float));
        c->attn_ws_cap = cap / sizeof(float);
        ws_o = c->attn_ws, ws_lse = c->attn_ws + n_part * D;
    }
    LETHE_ASSERT(a->n_kv_heads * n_chunks <= 65535);
    dim3 grid((unsigned)n_rows, (unsigned)(a->n_kv_heads * n_chunks), (unsigned)n_splits);
    decode_fp8_kernel<D><<<grid, F8_THREADS, f8_cfg<D>::SMEM, c->stream>>>(
        (bf16 *)a->out, (const bf16 *)a->q, (const uint8_t *)a->k_cache, (const uint8_t *)a->v_cache,
        (const float *)a->kvq->k_scale, (const float *)a->kvq->v_scale, d_qb, d_sb, d_sel, a->n_seqs,
        a->n_heads, a->n_kv_heads, a->scale * LOG2E, n_splits, ws_o, ws_lse);
    CU_LAUNCH_CHECK();
    if (n_splits > 1)
        lethe_cuda_attn_merge(c, a->out, d_qb, d_sb, a->n_seqs, true, n_rows, a->n_heads, D,
                              n_splits, F8_GRAN, true, NULL, ws_o, ws_lse);
}

bool lethe_cuda_attn_fp8_fits(const cuda_ctx *c, int D) {
    if (D != 64 && D != 128) return false;
    return (D == 64 ? f8_cfg<64>::SMEM : f8_cfg<128>::SMEM) <= c->smem_optin;
}

void lethe_cuda_attn_decode_fp8(cuda_ctx *c, const lethe_attn_args *a, const int32_t *d_qb,
                                const int32_t *d_sb, const int32_t *d_sel) {
    LETHE_ASSERT(a->n_tokens == a->n_seqs && a->kvq && a->kvq->format == LETHE_KV_FP8_E4M3);
    if (a->head_dim == 64) launch_decode_fp8<64>(c, a, d_qb, d_sb, d_sel);
    else if (a->head_dim == 128) launch_decode_fp8<128>(c, a, d_qb, d_sb, d_sel);
    else LETHE_ASSERT(!"decode fp8: head_dim must be 64 or 128");
}

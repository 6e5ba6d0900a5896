/* ptx.cuh - inline PTX wrappers for the tensor-core attention kernels
 * (internal): cp.async copies into shared memory and mma.sync.m16n8k16 with
 * fp16 inputs. attention_fp8.cu uses them; attention_v2.cu keeps its own
 * bf16 set. */
#ifndef LETHE_BACKEND_CUDA_PTX_CUH
#define LETHE_BACKEND_CUDA_PTX_CUH

#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

__device__ __forceinline__ uint32_t ptx_smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy (L2 only); src_bytes 0 fills zeros (src must
 * still be a valid address) */
__device__ __forceinline__ void ptx_cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ptx_smem_u32(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
/* 4-byte global -> shared copy; src_bytes 0 fills zeros */
__device__ __forceinline__ void ptx_cp_async4(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(ptx_smem_u32(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void ptx_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void ptx_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* c += a b  (16x16 f16 x 16x8 f16 -> 16x8 f32); fragment layouts as for bf16
 * (attention_v2.cu's header) */
__device__ __forceinline__ void ptx_mma_f16(float c[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* two floats as f16x2 (.x = lo in the low half), round to nearest even */
__device__ __forceinline__ uint32_t ptx_pack_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

#endif /* LETHE_BACKEND_CUDA_PTX_CUH */

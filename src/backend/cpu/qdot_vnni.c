/* qdot_vnni.c - the 16-bit-activation matmul with AVX-512 VNNI
 * (vpdpwssd: 16-bit pairs multiplied and accumulated into 32 bits, exact),
 * compiled with -mavx512f -mavx512vl -mavx512vnni; called only when
 * cpu_isa.c's probe ran it. The prefill tile puts 16 W rows in the lanes
 * of a 512-bit vector. The same integers and float operations as
 * qdot_avx2.c: the same bits. */
#define QDOT_NAME lethe_cpu_qdot_vnni
#define QDOT_ZMM 1
#define QDOT_DOT1(w, x) _mm256_madd_epi16((w), (x))
#define QDOT_DOT2(wl, xl, wh, xh) _mm256_dpwssd_epi32(_mm256_madd_epi16((wl), (xl)), (wh), (xh))
#include "backend/cpu/qdot_kernel.h"

/* cpu_isa.c - which SIMD tier the CPU backend's kernels may use.
 *
 * lethe is compiled without global -mavx2/-mfma (Makefile: only the *_avx2.c
 * kernel files and the attention files get them), so the binary starts on
 * any x86-64 and the kernels are chosen here at run time. A tier is usable
 * when (1) CPUID advertises its instructions, (2) XGETBV says the OS saves
 * the YMM state, and (3) a probe function built for the tier actually runs:
 * a virtual machine may advertise instructions that it traps, so the probe
 * executes them under a SIGILL/SIGSEGV handler and a fault means "no". */
#include <setjmp.h>
#include <signal.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define LETHE_X86 1
#endif

#include "backend/cpu/cpu_ops.h"

#ifdef LETHE_X86
static sigjmp_buf g_probe_jmp;
static void probe_fault(int sig) { siglongjmp(g_probe_jmp, 1); }

/* FMA, AVX2 integer ops and F16C conversion: the instructions the avx2 kernels use */
__attribute__((target("avx2,fma,f16c"), noinline)) static int probe_avx2(volatile float *io) {
    __m256 a = _mm256_set1_ps(io[0]), b = _mm256_set1_ps(io[1]);
    __m256 c = _mm256_fmadd_ps(a, b, a);
    __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(c), _mm256_set1_epi32(1));
    __m128i h = _mm_set1_epi16(0x3c00); /* 1.0 in f16 */
    __m256 f = _mm256_add_ps(_mm256_cvtph_ps(h), _mm256_cvtepi32_ps(i));
    io[2] = _mm256_cvtss_f32(f);
    return 1;
}

/* AVX-512 VNNI on ymm and zmm registers, F and VL: vpdpbusd, vpdpwssd on
 * 512 bits and a masked 512-bit store (what qdot_vnni.c executes) */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"), noinline)) static int
probe_vnni(volatile float *io) {
    __m256i a = _mm256_set1_epi8(2), b = _mm256_set1_epi8((char)io[1]); /* 3 */
    __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);  /* 4 * 2 * 3 = 24 */
    __m512i z = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi16(2),
                                    _mm512_set1_epi16((short)io[1])); /* 2 * 2 * 3 = 12 */
    float t[16] = {0};
    _mm512_mask_storeu_ps(t, (__mmask16)0x8000, _mm512_cvtepi32_ps(z));
    io[2] = (float)(_mm256_extract_epi32(d, 7) - 14) + t[15] - 12.0f; /* 10 */
    return 1;
}

/* runs fn under a fault handler: 1 if it completed */
static int runs(int (*fn)(volatile float *)) {
    struct sigaction sa, old_ill, old_segv;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = probe_fault;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGILL, &sa, &old_ill);
    sigaction(SIGSEGV, &sa, &old_segv);
    volatile float io[3] = {2.0f, 3.0f, 0.0f};
    volatile int ok = 0;
    if (!sigsetjmp(g_probe_jmp, 1)) ok = fn(io) && io[2] == 10.0f; /* 2*3+2 = 8, +1, +1 */
    sigaction(SIGILL, &old_ill, NULL);
    sigaction(SIGSEGV, &old_segv, NULL);
    return ok;
}

static lethe_cpu_isa detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return LETHE_ISA_SCALAR;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1,
              f16c = (c >> 29) & 1;
    if (!(fma && osxsave && avx && f16c)) return LETHE_ISA_SCALAR;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6) != 6) return LETHE_ISA_SCALAR; /* the OS does not save XMM + YMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((b >> 5) & 1)) return LETHE_ISA_SCALAR;
    if (!runs(probe_avx2)) return LETHE_ISA_SCALAR;
    /* AVX512F (b 16), AVX512VL (b 31), AVX512_VNNI (c 11), and the OS saving
     * the opmask and ZMM state (XCR0 bits 5-7) */
    const int vnni = ((b >> 16) & 1) && ((b >> 31) & 1) && ((c >> 11) & 1) && (lo & 0xe0) == 0xe0;
    return vnni && runs(probe_vnni) ? LETHE_ISA_AVX2_VNNI : LETHE_ISA_AVX2;
}
#else
static lethe_cpu_isa detect(void) { return LETHE_ISA_SCALAR; }
#endif

lethe_cpu_isa lethe_cpu_isa_detect(void) {
    static int cached = -1; /* detection is idempotent: a race only repeats it */
    if (cached < 0) cached = (int)detect();
    return (lethe_cpu_isa)cached;
}

const char *lethe_cpu_isa_name(lethe_cpu_isa isa) {
    return isa == LETHE_ISA_AVX2_VNNI ? "avx2+vnni" : isa == LETHE_ISA_AVX2 ? "avx2" : "scalar";
}

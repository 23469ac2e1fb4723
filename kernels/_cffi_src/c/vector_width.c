/*
 * Whether this CPU multiplies 512-bit vectors at full width: the FMA throughput of 512-bit
 * vectors over that of 256-bit ones, in FLOPs (blas.py's choice of OpenBLAS's kernels).
 *
 * A CPU with AVX-512 may execute each 512-bit instruction as two 256-bit halves (AMD's
 * Zen 4, some Zen 5 parts): then OpenBLAS's AVX-512 (SkylakeX) kernels gain nothing over
 * its AVX2 (Haswell) ones and run slower; with a full-width unit they run up to twice as
 * fast. The flags cannot tell the two apart, so the ratio is measured: twelve independent
 * multiply-add chains in each width (enough to keep two pipes of four cycles' latency
 * busy), the best of several rounds, about a millisecond in all. 0 where the CPU or the
 * compiler has no such instructions.
 */
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define MG_CHAINS 12
#define MG_STEPS 20000

static double mg_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define MG_FMA_TIMER(name, isa, vec, set1, fmadd, lanes)                                      \
    __attribute__((target(isa))) static double name(void)                                      \
    {                                                                                          \
        vec acc[MG_CHAINS];                                                                    \
        const vec scale = set1(0.999999f), shift = set1(1e-7f);                                \
        for (int i = 0; i < MG_CHAINS; i++)                                                    \
            acc[i] = set1(1.0f + (float)i);                                                    \
        double start = mg_now();                                                               \
        for (int s = 0; s < MG_STEPS; s++)                                                     \
            for (int i = 0; i < MG_CHAINS; i++)                                                \
                acc[i] = fmadd(acc[i], scale, shift);                                          \
        double seconds = mg_now() - start;                                                     \
        float sink[lanes];                                                                     \
        vec total = acc[0];                                                                    \
        for (int i = 1; i < MG_CHAINS; i++)                                                    \
            total = fmadd(total, scale, acc[i]);                                               \
        __builtin_memcpy(sink, &total, sizeof total);                                          \
        volatile float keep = sink[0]; /* the chains are not dead code */                      \
        (void)keep;                                                                            \
        return seconds;                                                                        \
    }

MG_FMA_TIMER(mg_fma512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, 16)
MG_FMA_TIMER(mg_fma256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, 8)

double mg_fma_512_over_256(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx2") ||
        !__builtin_cpu_supports("fma"))
        return 0.0;
    double wide = 1e30, narrow = 1e30;
    for (int round = 0; round < 5; round++) {
        double w = mg_fma512(), n = mg_fma256();
        wide = w < wide ? w : wide;
        narrow = n < narrow ? n : narrow;
    }
    return wide > 0.0 ? 2.0 * narrow / wide : 0.0; /* twice the lanes in the same time: 2 */
}
#else
double mg_fma_512_over_256(void) { return 0.0; }
#endif

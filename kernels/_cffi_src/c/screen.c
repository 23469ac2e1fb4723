/*
 * Stage one of the emulator's Freivalds screen (proxy/emulator/freivalds.py: the rule and
 * why), in one pass over a block of a product C (rows of n elements, ldc apart): for each
 * row and each column block J of `edge` columns (the last maybe narrower), the weighted
 * sum s = Σ c·r over the block, with the block's screen weights r, and the 2-norm q of the
 * row's block, both summed in double; and whether the row's block fails the screen,
 * |s − ref| > unit·2·q + subnormal, or s is not finite where ref is (ref: a row's blocks,
 * rows ldref apart). numpy made that a dozen calls and two passes over C.
 *
 * Entry points fill sums and norms [rows, blocks] and return how many (row, block) pairs
 * fail.
 */
#include <math.h>
#include <stdint.h>

/* On x86-64 Linux, a copy of the pass for each vector width, chosen when the module loads
 * (an ifunc): the build's baseline is SSE2, whose two double lanes make the pass slower
 * than numpy's own two passes in float32. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__gnu_linux__)
#define MG_SCREEN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MG_SCREEN_CLONES
#endif

#define MG_SCREEN_T float
#define MG_SCREEN_SUFFIX f32
#include "screen_typed.h"
#undef MG_SCREEN_T
#undef MG_SCREEN_SUFFIX

#define MG_SCREEN_T double
#define MG_SCREEN_SUFFIX f64
#include "screen_typed.h"
#undef MG_SCREEN_T
#undef MG_SCREEN_SUFFIX

/*
 * Depthwise convolutions: each output channel reads one input channel.
 *
 * Output channel c·M + j (j < M, the channel multiplier) reads input channel c with its
 * own kh × kw taps. numpy did this one tap at a time over whole arrays (einsum for the
 * gradients), whose speed jumped with strides and multipliers; here every pass is a row:
 * an output row (forward, grad weight) or an input row (grad input) is finished while it
 * sits in L1, one tap after another, each tap a loop over the output's columns that the
 * compiler vectorises (contiguous where the column stride is 1). Padding is never
 * materialised: a tap's rows and columns that fall in the padding are skipped.
 *
 * Arrays are NCHW, C-contiguous, one dtype per call; the geometry is kernels/conv.py's
 * (padding above and to the left of the array given; outputs past the last row or column
 * are not asked for). Single-threaded, like every device kernel: a device's workers each
 * run one call. Entry points return 0, or -ENOMEM when a scratch buffer cannot be had.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct mg_dw_geom {
    int64_t n, c, multiplier; /* images, input channels, output channels per input one */
    int64_t h, w;             /* rows and columns of the input (all of it, for dx) */
    int64_t oh, ow;           /* rows and columns of the whole output */
    int64_t kh, kw, sh, sw, dh, dw;
    int64_t top, left; /* zero rows above the input, zero columns to its left */
} mg_dw_geom;

static int64_t mg_dw_floor_div(int64_t a, int64_t b) /* b > 0 */
{
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/* The output columns [lo, hi) at which tap column b reads a column of the input, not of
 * the padding: 0 <= ow·sw + b·dw − left < w. One pair per tap column, computed per call. */
static int64_t *mg_dw_columns(const mg_dw_geom *g)
{
    int64_t *span = malloc(2 * (size_t)g->kw * sizeof *span);
    if (span == NULL)
        return NULL;
    for (int64_t b = 0; b < g->kw; b++) {
        int64_t shift = b * g->dw - g->left; /* the input column output column 0 reads */
        int64_t lo = -mg_dw_floor_div(shift, g->sw);
        int64_t hi = mg_dw_floor_div(g->w - 1 - shift, g->sw) + 1;
        lo = lo < 0 ? 0 : lo;
        hi = hi > g->ow ? g->ow : hi;
        span[2 * b] = lo;
        span[2 * b + 1] = hi > lo ? hi : lo;
    }
    return span;
}

#define MG_DW_T float
#define MG_DW_SUFFIX f32
#include "depthwise_typed.h"
#undef MG_DW_T
#undef MG_DW_SUFFIX

#define MG_DW_T double
#define MG_DW_SUFFIX f64
#include "depthwise_typed.h"
#undef MG_DW_T
#undef MG_DW_SUFFIX

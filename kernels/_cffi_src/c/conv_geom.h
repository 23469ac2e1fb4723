/*
 * A convolution's geometry as the C kernels take it (kernels/conv.py's ``ConvGeometry``
 * for one call: the array given, its padding above and to the left, the output's size),
 * and the column spans every row loop needs. Shared by depthwise.c, unfold.c and
 * implicit_gemm.c.
 */
#ifndef MG_CONV_GEOM_H
#define MG_CONV_GEOM_H

#include <stdint.h>
#include <stdlib.h>

typedef struct mg_conv_geom {
    int64_t n, c, multiplier; /* images, input channels, output channels per input one */
    int64_t h, w;             /* rows and columns of the input (all of it, for dx) */
    int64_t oh, ow;           /* rows and columns of the whole output */
    int64_t kh, kw, sh, sw, dh, dw;
    int64_t top, left; /* zero rows above the input, zero columns to its left */
} mg_conv_geom;

typedef struct mg_strides4 { /* an NCHW array's strides, in elements */
    int64_t n, c, h, w;
} mg_strides4;

static int64_t mg_conv_floor_div(int64_t a, int64_t b) /* b > 0 */
{
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/* The output columns [lo, hi) at which tap column b reads a column of the input, not of
 * the padding: 0 <= ow·sw + b·dw − left < w. One pair per tap column, computed per call. */
static int64_t *mg_conv_columns(const mg_conv_geom *g)
{
    int64_t *span = malloc(2 * (size_t)g->kw * sizeof *span);
    if (span == NULL)
        return NULL;
    for (int64_t b = 0; b < g->kw; b++) {
        int64_t shift = b * g->dw - g->left; /* the input column output column 0 reads */
        int64_t lo = -mg_conv_floor_div(shift, g->sw);
        int64_t hi = mg_conv_floor_div(g->w - 1 - shift, g->sw) + 1;
        lo = lo < 0 ? 0 : lo;
        hi = hi > g->ow ? g->ow : hi;
        span[2 * b] = lo;
        span[2 * b + 1] = hi > lo ? hi : lo;
    }
    return span;
}

#endif

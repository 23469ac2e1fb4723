/*
 * The unfold (im2col) of a convolution's input: what the implicit GEMM (implicit_gemm.c)
 * multiplies.
 *
 * cols [C, kh, kw, N, OH, OW] of x [N, C, H, W] (float32 or float64, at element strides
 * ``xs``): cols[c, a, b, n, oh, ow] = x[n, c, oh·sh + a·dh − top, ow·sw + b·dw − left],
 * 0 where that lies in the padding. Each output row is one tap's reach into one input row:
 * a memcpy where the columns it reads are adjacent, else a strided gather, with the
 * padding's columns zeroed around it (``mg_conv_columns``) and never a padded copy of x.
 * Single-threaded, like every device kernel. ``multiplier`` is not read. Returns 0, or
 * -ENOMEM when the column spans cannot be had.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "conv_geom.h"

/* ``count`` elements of ``size`` bytes from every ``stride``-th of ``src`` into ``dst``. */
static void mg_unfold_gather(char *restrict dst, const char *restrict src, int64_t stride,
                             int64_t count, size_t size)
{
    if (stride == 1) {
        memcpy(dst, src, (size_t)count * size);
    } else if (size == 4) {
        uint32_t *d = (uint32_t *)dst;
        const uint32_t *s = (const uint32_t *)src;
        for (int64_t k = 0; k < count; k++)
            d[k] = s[k * stride];
    } else {
        uint64_t *d = (uint64_t *)dst;
        const uint64_t *s = (const uint64_t *)src;
        for (int64_t k = 0; k < count; k++)
            d[k] = s[k * stride];
    }
}

static int mg_unfold(const mg_conv_geom *g, const char *restrict x, const mg_strides4 *xs,
                     char *restrict cols, size_t size)
{
    int64_t *span = mg_conv_columns(g);
    if (span == NULL)
        return -ENOMEM;
    const size_t row = (size_t)g->ow * size;
    char *out = cols;
    for (int64_t c = 0; c < g->c; c++)
        for (int64_t a = 0; a < g->kh; a++)
            for (int64_t b = 0; b < g->kw; b++) {
                const int64_t lo = span[2 * b], hi = span[2 * b + 1];
                const int64_t first = lo * g->sw + b * g->dw - g->left; /* column lo reads */
                for (int64_t n = 0; n < g->n; n++) {
                    const char *plane = x + (n * xs->n + c * xs->c) * (int64_t)size;
                    for (int64_t oh = 0; oh < g->oh; oh++, out += row) {
                        const int64_t ih = oh * g->sh + a * g->dh - g->top;
                        if (ih < 0 || ih >= g->h || lo >= hi) {
                            memset(out, 0, row);
                            continue;
                        }
                        memset(out, 0, (size_t)lo * size);
                        mg_unfold_gather(out + (size_t)lo * size,
                                         plane + (ih * xs->h + first * xs->w) * (int64_t)size,
                                         g->sw * xs->w, hi - lo, size);
                        memset(out + (size_t)hi * size, 0, (size_t)(g->ow - hi) * size);
                    }
                }
            }
    free(span);
    return 0;
}

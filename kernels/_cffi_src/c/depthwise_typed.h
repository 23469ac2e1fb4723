/*
 * The depthwise kernels for one element type, included by depthwise.c once per dtype
 * with MG_DW_T (the type) and MG_DW_SUFFIX (f32, f64) defined.
 */
#define MG_DW_PASTE(name, suffix) mg_dw_##name##_##suffix
#define MG_DW_NAME(name, suffix) MG_DW_PASTE(name, suffix)
#define MG_DW(name) MG_DW_NAME(name, MG_DW_SUFFIX)

typedef MG_DW_T MG_DW(t);

/* Each row loop below comes twice: for a unit column stride, contiguous vector loads and
 * stores, and for any other, the same loop strided. */

/* out[k] += v · in[k·stride]: one tap over a row (forward). */
static void MG_DW(gather)(MG_DW(t) *restrict out, const MG_DW(t) *restrict in, int64_t stride,
                          MG_DW(t) v, int64_t count)
{
    if (stride == 1)
        for (int64_t k = 0; k < count; k++)
            out[k] += v * in[k];
    else
        for (int64_t k = 0; k < count; k++)
            out[k] += v * in[k * stride];
}

/* out[k·stride] += v · in[k]: one tap's share of an input row (grad input). */
static void MG_DW(scatter)(MG_DW(t) *restrict out, int64_t stride, const MG_DW(t) *restrict in,
                           MG_DW(t) v, int64_t count)
{
    if (stride == 1)
        for (int64_t k = 0; k < count; k++)
            out[k] += v * in[k];
    else
        for (int64_t k = 0; k < count; k++)
            out[k * stride] += v * in[k];
}

/* out[k] (=, or += where add) v · in[k]: one output channel's share of its input channel's
 * tap, summed over the multiplier's channels before the strided scatter (grad input). */
static void MG_DW(combine)(MG_DW(t) *restrict out, const MG_DW(t) *restrict in, MG_DW(t) v,
                           int64_t count, int add)
{
    if (add)
        for (int64_t k = 0; k < count; k++)
            out[k] += v * in[k];
    else
        for (int64_t k = 0; k < count; k++)
            out[k] = v * in[k];
}

/* Σ dy[k] · in[k·stride]: one tap over a row (grad weight), in vector lanes. */
static MG_DW(t) MG_DW(dot)(const MG_DW(t) *restrict dy, const MG_DW(t) *restrict in,
                           int64_t stride, int64_t count)
{
    MG_DW(t) sum = 0;
    if (stride == 1) {
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < count; k++)
            sum += dy[k] * in[k];
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < count; k++)
            sum += dy[k] * in[k * stride];
    }
    return sum;
}

/* y [N, C·M, OH, OW] of x [N, C, H, W] and w [C·M, 1, kh, kw]. */
int MG_DW(forward)(const mg_conv_geom *g, const MG_DW(t) *restrict x,
                   const MG_DW(t) *restrict w, MG_DW(t) *restrict y)
{
    int64_t *span = mg_conv_columns(g);
    if (span == NULL)
        return -ENOMEM;
    const int64_t oc_count = g->c * g->multiplier, taps = g->kh * g->kw;
    for (int64_t n = 0; n < g->n; n++)
        for (int64_t oc = 0; oc < oc_count; oc++) {
            const MG_DW(t) *xc = x + (n * g->c + oc / g->multiplier) * g->h * g->w;
            const MG_DW(t) *wc = w + oc * taps;
            MG_DW(t) *yc = y + (n * oc_count + oc) * g->oh * g->ow;
            for (int64_t oh = 0; oh < g->oh; oh++) {
                MG_DW(t) *yr = yc + oh * g->ow;
                for (int64_t k = 0; k < g->ow; k++)
                    yr[k] = 0;
                for (int64_t a = 0; a < g->kh; a++) {
                    int64_t ih = oh * g->sh + a * g->dh - g->top;
                    if (ih < 0 || ih >= g->h)
                        continue;
                    const MG_DW(t) *xr = xc + ih * g->w;
                    for (int64_t b = 0; b < g->kw; b++) {
                        int64_t lo = span[2 * b], hi = span[2 * b + 1];
                        if (lo < hi)
                            MG_DW(gather)(yr + lo, xr + lo * g->sw + b * g->dw - g->left, g->sw,
                                      wc[a * g->kw + b], hi - lo);
                    }
                }
            }
        }
    free(span);
    return 0;
}

/* dx [N, C, rows, W], input rows [i0, i0 + rows) of the whole input, from dy
 * [N, C·M, dy_rows, OW] holding output rows [oh_lo, oh_lo + dy_rows): each input row
 * gathers the taps that reach it, so no output row's share is written outside the band.
 * With a multiplier the M channels' shares of a tap are summed into one contiguous row
 * first, so the strided scatter runs once per tap, not M times. */
int MG_DW(grad_input)(const mg_conv_geom *g, const MG_DW(t) *restrict dy,
                      const MG_DW(t) *restrict w, MG_DW(t) *restrict dx, int64_t i0, int64_t rows,
                      int64_t oh_lo, int64_t dy_rows)
{
    const int64_t m = g->multiplier, taps = g->kh * g->kw;
    int64_t *span = mg_conv_columns(g);
    MG_DW(t) *share = m > 1 ? malloc((size_t)g->ow * sizeof *share) : NULL;
    if (span == NULL || (m > 1 && share == NULL)) {
        free(span);
        return -ENOMEM;
    }
    for (int64_t n = 0; n < g->n; n++)
        for (int64_t c = 0; c < g->c; c++) {
            const MG_DW(t) *dyc = dy + (n * g->c + c) * m * dy_rows * g->ow; /* channel c·M */
            const MG_DW(t) *wc = w + c * m * taps;
            for (int64_t i = 0; i < rows; i++) {
                MG_DW(t) *dr = dx + ((n * g->c + c) * rows + i) * g->w;
                for (int64_t k = 0; k < g->w; k++)
                    dr[k] = 0;
                for (int64_t a = 0; a < g->kh; a++) {
                    int64_t reach = i0 + i + g->top - a * g->dh; /* = oh · sh */
                    if (reach < 0 || reach % g->sh)
                        continue;
                    int64_t oh = reach / g->sh - oh_lo;
                    if (oh < 0 || oh >= dy_rows)
                        continue;
                    for (int64_t b = 0; b < g->kw; b++) {
                        int64_t lo = span[2 * b], hi = span[2 * b + 1], tap = a * g->kw + b;
                        if (lo >= hi)
                            continue;
                        MG_DW(t) *out = dr + lo * g->sw + b * g->dw - g->left;
                        const MG_DW(t) *dyr = dyc + oh * g->ow + lo;
                        if (m == 1) {
                            MG_DW(scatter)(out, g->sw, dyr, wc[tap], hi - lo);
                            continue;
                        }
                        for (int64_t j = 0; j < m; j++)
                            MG_DW(combine)(share, dyr + j * dy_rows * g->ow, wc[j * taps + tap],
                                           hi - lo, j > 0);
                        MG_DW(scatter)(out, g->sw, share, 1, hi - lo);
                    }
                }
            }
        }
    free(span);
    free(share);
    return 0;
}

/* dw [C·M, 1, kh, kw] from x [N, C, H, W] and dy [N, C·M, OH, OW], fully reduced: each
 * output row's dot products with the input rows its taps read. */
int MG_DW(grad_weight)(const mg_conv_geom *g, const MG_DW(t) *restrict x,
                       const MG_DW(t) *restrict dy, MG_DW(t) *restrict dw)
{
    const int64_t oc_count = g->c * g->multiplier, taps = g->kh * g->kw;
    int64_t *span = mg_conv_columns(g);
    if (span == NULL)
        return -ENOMEM;
    for (int64_t oc = 0; oc < oc_count; oc++) {
        MG_DW(t) *sums = dw + oc * taps;
        for (int64_t tap = 0; tap < taps; tap++)
            sums[tap] = 0;
        for (int64_t n = 0; n < g->n; n++) {
            const MG_DW(t) *xc = x + (n * g->c + oc / g->multiplier) * g->h * g->w;
            const MG_DW(t) *dyc = dy + (n * oc_count + oc) * g->oh * g->ow;
            for (int64_t oh = 0; oh < g->oh; oh++)
                for (int64_t a = 0; a < g->kh; a++) {
                    int64_t ih = oh * g->sh + a * g->dh - g->top;
                    if (ih < 0 || ih >= g->h)
                        continue;
                    const MG_DW(t) *xr = xc + ih * g->w;
                    for (int64_t b = 0; b < g->kw; b++) {
                        int64_t lo = span[2 * b], hi = span[2 * b + 1];
                        if (lo < hi)
                            sums[a * g->kw + b] += MG_DW(dot)(dyc + oh * g->ow + lo,
                                                              xr + lo * g->sw + b * g->dw - g->left,
                                                              g->sw, hi - lo);
                    }
                }
        }
    }
    free(span);
    return 0;
}

#undef MG_DW
#undef MG_DW_NAME
#undef MG_DW_PASTE

/*
 * A convolution's implicit GEMM in one call: for each run of images, the unfold (unfold.c)
 * and one BLAS call per group (blas.c's library), reading the input and writing the output
 * at the strides the caller's arrays have.
 *
 * A tile's operands and output are bands of larger arrays (a block of channels, a band of
 * rows), so numpy would copy each into a contiguous array and back, and the interpreter
 * lock would be taken again between every step, while the workers of the other devices
 * and the event loop want it too. Here a tile is one call, holding no lock.
 *
 * Arrays are float32 or float64 (``size`` 4 or 8), one dtype per call. Strides are in
 * elements (``mg_strides4``: image, channel, row, column), not negative. ``w`` is
 * [OC, C/groups·kh·kw], C-contiguous; ``dw`` rows [OC, C/groups·kh·kw] at a stride of
 * ``ldw`` elements, each row contiguous. ``scratch`` holds the unfold of ``chunk`` images
 * and, after it at a 64-byte boundary, their [OC, chunk·OH·OW] product or output gradient
 * (``mg_conv_scratch``). Entry points return 0, -EINVAL for arguments that do not fit (a
 * BLAS dimension past INT_MAX, too little scratch, another size, no library), or -ENOMEM
 * from the unfold.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "conv_geom.h"

/* Bytes of scratch the two entry points need for ``chunk`` images of geometry ``g`` with
 * ``oc`` output channels (kernels/conv.py reckons the same); -1 on overflow. */
static int64_t mg_conv_scratch(const mg_conv_geom *g, int64_t oc, int64_t chunk, int64_t size)
{
    int64_t positions, cols, out;
    if (__builtin_mul_overflow(g->oh * g->ow, chunk, &positions) ||
        __builtin_mul_overflow(g->c * g->kh * g->kw, positions, &cols) ||
        __builtin_mul_overflow(cols, size, &cols) ||
        __builtin_mul_overflow(oc, positions, &out) || __builtin_mul_overflow(out, size, &out))
        return -1;
    return (cols + 63) / 64 * 64 + out;
}

static int mg_fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

/* c = a·b (+ c when ``accumulate``), row-major, ``tb``: b transposed. */
static void mg_conv_blas(size_t size, int tb, int64_t m, int64_t n, int64_t k, const char *a,
                         int64_t lda, const char *b, int64_t ldb, int accumulate, char *c,
                         int64_t ldc)
{
    int t = tb ? MG_CBLAS_TRANS : MG_CBLAS_NO_TRANS;
    if (size == 4)
        mg_blas.sgemm(MG_CBLAS_ROW_MAJOR, MG_CBLAS_NO_TRANS, t, (int)m, (int)n, (int)k, 1.0f,
                      (const float *)a, (int)lda, (const float *)b, (int)ldb,
                      accumulate ? 1.0f : 0.0f, (float *)c, (int)ldc);
    else
        mg_blas.dgemm(MG_CBLAS_ROW_MAJOR, MG_CBLAS_NO_TRANS, t, (int)m, (int)n, (int)k, 1.0,
                      (const double *)a, (int)lda, (const double *)b, (int)ldb,
                      accumulate ? 1.0 : 0.0, (double *)c, (int)ldc);
}

/* ``count`` elements of ``size`` bytes between ``dst`` and ``src`` at element strides
 * ``dstride`` and ``sstride``. */
static void mg_conv_copy(char *restrict dst, int64_t dstride, const char *restrict src,
                         int64_t sstride, int64_t count, size_t size)
{
    if (dstride == 1 && sstride == 1) {
        memcpy(dst, src, (size_t)count * size);
    } else if (size == 4) {
        for (int64_t k = 0; k < count; k++)
            ((uint32_t *)dst)[k * dstride] = ((const uint32_t *)src)[k * sstride];
    } else {
        for (int64_t k = 0; k < count; k++)
            ((uint64_t *)dst)[k * dstride] = ((const uint64_t *)src)[k * sstride];
    }
}

/* Between the strided array ``a`` (images [n0, n0 + images)) and the contiguous
 * [channels, images, rows, cols] ``flat``: ``to_flat`` gathers a into flat, else scatters
 * flat into a. */
static void mg_conv_transfer(char *a, const mg_strides4 *s, char *flat, int64_t n0,
                             int64_t images, int64_t channels, int64_t rows, int64_t cols,
                             size_t size, int to_flat)
{
    for (int64_t o = 0; o < channels; o++)
        for (int64_t i = 0; i < images; i++)
            for (int64_t r = 0; r < rows; r++) {
                char *strided = a + ((n0 + i) * s->n + o * s->c + r * s->h) * (int64_t)size;
                char *row = flat + (size_t)(((o * images + i) * rows + r) * cols) * size;
                if (to_flat)
                    mg_conv_copy(row, 1, strided, s->w, cols, size);
                else
                    mg_conv_copy(strided, s->w, row, 1, cols, size);
            }
}

/* Whether image n0 of ``a``, as [channels, rows·cols], is a matrix BLAS can address in
 * place: its positions contiguous, its channels a leading dimension apart. */
static int mg_conv_in_place(const mg_strides4 *s, int64_t rows, int64_t cols)
{
    return s->w == 1 && (rows == 1 || s->h == cols) && s->c >= rows * cols && mg_fits_int(s->c);
}

/* The checks both entry points share: BLAS dimensions that fit in an int, scratch enough,
 * a library loaded. */
static int mg_conv_args(const mg_conv_geom *g, int64_t groups, int64_t oc, int64_t chunk,
                        int64_t scratch_bytes, size_t size)
{
    if (mg_blas.handle == NULL || groups < 1 || g->c % groups || oc % groups || chunk < 1)
        return -EINVAL;
    int64_t need = mg_conv_scratch(g, oc, chunk, (int64_t)size);
    int64_t k = g->c / groups * g->kh * g->kw;
    if (need < 0 || need > scratch_bytes || !mg_fits_int(k) ||
        !mg_fits_int(g->oh * g->ow * chunk) || !mg_fits_int(oc))
        return -EINVAL;
    return 0;
}

/* Both entry points: the forward (``dw`` NULL: ``second`` the weight, ``y`` at ``ys``) or
 * the grad weight (``second`` dy at ``ss``, into ``dw``). Per run of images: the unfold,
 * then per group y = w·cols (into y itself for one image whose positions BLAS can
 * address, else into scratch and scattered into y), or dw (+)= dy·colsᵀ (from dy itself
 * likewise, else from a gathered copy). */
static int mg_conv_gemm(const mg_conv_geom *g, int64_t groups, int64_t oc, const char *x,
                        const mg_strides4 *xs, const char *second, const mg_strides4 *ss,
                        char *y, const mg_strides4 *ys, char *dw, int64_t ldw, char *scratch,
                        int64_t scratch_bytes, int64_t chunk, size_t size)
{
    int rc = mg_conv_args(g, groups, oc, chunk, scratch_bytes, size);
    if (rc)
        return rc;
    const int64_t positions = g->oh * g->ow, k = g->c / groups * g->kh * g->kw;
    const int64_t per = oc / groups, item = (int64_t)size;
    const int forward = dw == NULL;
    if (!forward && (!mg_fits_int(ldw) || ldw < k))
        return -EINVAL;
    if (!forward && g->n == 0) { /* nothing summed */
        for (int64_t o = 0; o < oc; o++)
            memset(dw + o * ldw * item, 0, (size_t)k * size);
        return 0;
    }
    char *cols = scratch, *flat = scratch + (k * groups * positions * chunk * item + 63) / 64 * 64;
    const mg_strides4 *strided = forward ? ys : ss; /* the array [N, OC, OH, OW] of the run */
    for (int64_t n0 = 0; n0 < g->n; n0 += chunk) {
        const int64_t images = g->n - n0 < chunk ? g->n - n0 : chunk, width = images * positions;
        mg_conv_geom run = *g;
        run.n = images;
        if ((rc = mg_unfold(&run, x + n0 * xs->n * item, xs, cols, size)))
            return rc;
        const int direct = images == 1 && mg_conv_in_place(strided, g->oh, g->ow);
        char *rows = direct ? (forward ? y : (char *)second) + n0 * strided->n * item : flat;
        const int64_t ld = direct ? strided->c : width;
        if (!forward && !direct)
            mg_conv_transfer((char *)second, ss, flat, n0, images, oc, g->oh, g->ow, size, 1);
        for (int64_t gi = 0; gi < groups; gi++) {
            const char *unfolded = cols + gi * k * width * item;
            if (forward)
                mg_conv_blas(size, 0, per, width, k, second + gi * per * k * item, k, unfolded,
                             width, 0, rows + gi * per * ld * item, ld);
            else
                mg_conv_blas(size, 1, per, k, width, rows + gi * per * ld * item, ld, unfolded,
                             width, n0 > 0, dw + gi * per * ldw * item, ldw);
        }
        if (forward && !direct)
            mg_conv_transfer(y, ys, flat, n0, images, oc, g->oh, g->ow, size, 0);
    }
    return 0;
}

/* The entry points, for float32 (``size`` 4) or float64 (8) arrays. */
int mg_conv_forward(const mg_conv_geom *g, int64_t size, int64_t groups, int64_t oc,
                    const void *x, const mg_strides4 *xs, const void *w, void *y,
                    const mg_strides4 *ys, void *scratch, int64_t scratch_bytes, int64_t chunk)
{
    if (size != 4 && size != 8)
        return -EINVAL;
    return mg_conv_gemm(g, groups, oc, x, xs, w, NULL, y, ys, NULL, 0, scratch, scratch_bytes,
                        chunk, (size_t)size);
}

int mg_conv_grad_weight(const mg_conv_geom *g, int64_t size, int64_t groups, int64_t oc,
                        const void *x, const mg_strides4 *xs, const void *dy,
                        const mg_strides4 *dys, void *dw, int64_t ldw, void *scratch,
                        int64_t scratch_bytes, int64_t chunk)
{
    if (size != 4 && size != 8)
        return -EINVAL;
    return mg_conv_gemm(g, groups, oc, x, xs, dy, dys, NULL, NULL, dw, ldw, scratch,
                        scratch_bytes, chunk, (size_t)size);
}

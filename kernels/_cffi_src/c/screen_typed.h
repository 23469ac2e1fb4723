/*
 * The screen's pass for one element type, included by screen.c once per dtype with
 * MG_SCREEN_T (the type) and MG_SCREEN_SUFFIX (f32, f64) defined.
 */
#define MG_SCREEN_PASTE(suffix) mg_screen_##suffix
#define MG_SCREEN_NAME(suffix) MG_SCREEN_PASTE(suffix)

MG_SCREEN_CLONES int64_t MG_SCREEN_NAME(MG_SCREEN_SUFFIX)(
    const MG_SCREEN_T *restrict c, int64_t rows, int64_t n, int64_t ldc, int64_t edge,
    const MG_SCREEN_T *restrict r, const MG_SCREEN_T *restrict ref, int64_t ldref,
    double unit, double subnormal, double *restrict sums, double *restrict norms)
{
    int64_t blocks = (n + edge - 1) / edge, failed = 0;
    for (int64_t i = 0; i < rows; i++) {
        const MG_SCREEN_T *row = c + i * ldc;
        for (int64_t j = 0; j < blocks; j++) {
            int64_t lo = j * edge, hi = lo + edge < n ? lo + edge : n;
            double s = 0.0, q = 0.0;
#pragma omp simd reduction(+ : s, q)
            for (int64_t k = lo; k < hi; k++) {
                double v = row[k];
                s += v * (double)r[k];
                q += v * v;
            }
            double want = ref[i * ldref + j], norm = sqrt(q);
            sums[i * blocks + j] = s;
            norms[i * blocks + j] = norm;
            /* (a NaN fails the comparison: it counts as off) */
            failed += !(fabs(s - want) <= unit * 2.0 * norm + subnormal) ||
                      (!isfinite(s) && isfinite(want));
        }
    }
    return failed;
}

#undef MG_SCREEN_PASTE
#undef MG_SCREEN_NAME

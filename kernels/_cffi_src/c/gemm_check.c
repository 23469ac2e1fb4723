/*
 * Memory-safety checks shared by every GEMM executor (CPU BLAS, cuBLASXt).
 *
 * Callers pass row-major GEMM arguments plus the byte length of each
 * operand's buffer; a call whose dimensions, leading dimensions or extents
 * do not fit is refused with a code the Python layer turns into a
 * ValueError, so no argument can make a kernel read or write out of bounds.
 */
#include <stdint.h>

enum {
    MG_GEMM_OK = 0,
    MG_GEMM_EDIMS = 1,
    MG_GEMM_ELDA = 2,
    MG_GEMM_ELDB = 3,
    MG_GEMM_ELDC = 4,
    MG_GEMM_EA = 5,
    MG_GEMM_EB = 6,
    MG_GEMM_EC = 7,
    MG_GEMM_EDTYPE = 8,
    MG_GEMM_ENOLIB = 9,
    MG_GEMM_EOVERLAP = 10,
};

static int64_t mg_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Bytes spanned by `batch` row-major rows x cols matrices (ld, stride in
 * elements) starting at the buffer's first byte; -1 if it cannot be
 * addressed from there (negative stride, overflow). */
static int64_t mg_extent(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch,
                         int64_t item)
{
    if (rows == 0 || cols == 0 || batch == 0)
        return 0;
    if (stride < 0)
        return -1;
    int64_t last, one;
    if (__builtin_mul_overflow(batch - 1, stride, &last) ||
        __builtin_mul_overflow(rows - 1, ld, &one) || __builtin_add_overflow(one, cols, &one) ||
        __builtin_add_overflow(last, one, &last) || __builtin_mul_overflow(last, item, &last))
        return -1;
    return last;
}

static int mg_gemm_check(int dtype, int trans_a, int trans_b, int m, int n, int k, int lda,
                         int64_t stride_a, int64_t a_len, int ldb, int64_t stride_b, int64_t b_len,
                         int ldc, int64_t stride_c, int64_t c_len, int64_t batch)
{
    if (dtype != 0 && dtype != 1)
        return MG_GEMM_EDTYPE;
    if (m < 0 || n < 0 || k < 0 || batch < 0)
        return MG_GEMM_EDIMS;
    if (stride_a < 0 || stride_b < 0 || stride_c < 0)
        return stride_a < 0 ? MG_GEMM_EA : stride_b < 0 ? MG_GEMM_EB : MG_GEMM_EC;
    int64_t item = dtype == 0 ? 4 : 8;
    /* Stored shapes: op(A) is m x k, so A is stored k x m when transposed. */
    int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
    int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
    if (lda < mg_max64(1, a_cols))
        return MG_GEMM_ELDA;
    if (ldb < mg_max64(1, b_cols))
        return MG_GEMM_ELDB;
    if (ldc < mg_max64(1, n))
        return MG_GEMM_ELDC;
    int64_t ea = k ? mg_extent(a_rows, a_cols, lda, stride_a, batch, item) : 0;
    int64_t eb = k ? mg_extent(b_rows, b_cols, ldb, stride_b, batch, item) : 0;
    int64_t ec = mg_extent(m, n, ldc, stride_c, batch, item);
    if (ea < 0 || ea > a_len)
        return MG_GEMM_EA;
    if (eb < 0 || eb > b_len)
        return MG_GEMM_EB;
    if (ec < 0 || ec > c_len)
        return MG_GEMM_EC;
    /* Output pivots must not overlap: stacked (stride past a whole matrix) or
     * interleaved within the rows (stride past a row's n, all inside ldc).
     * With stride_c >= n >= 1 inside c_len, batch is bounded by the buffer. */
    if (batch > 1 && m > 0 && n > 0 && stride_c < (int64_t)(m - 1) * ldc + n &&
        !(stride_c >= n && (batch - 1) * stride_c + n <= ldc))
        return MG_GEMM_EOVERLAP;
    return MG_GEMM_OK;
}

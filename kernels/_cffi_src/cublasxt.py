"""Declarations for c/cublasxt.c: cuBLASXt on host pointers, opened at run time."""

INCLUDES = ""

TYPES = """
typedef struct mg_xt_ctx mg_xt_ctx;
"""

FUNCTIONS = """
int mg_xt_open(const char *cuda_path, const char *cublas_path, char *err, size_t errlen);
int mg_xt_device_count(void);
mg_xt_ctx *mg_xt_create(int *devices, int ndevices, int block_dim, int *status);
void mg_xt_destroy(mg_xt_ctx *ctx);
int mg_xt_gemm(mg_xt_ctx *ctx, int dtype, int trans_a, int trans_b, int m, int n, int k,
               double alpha, const void *a, int lda, int64_t stride_a, int64_t a_len,
               const void *b, int ldb, int64_t stride_b, int64_t b_len, double beta, void *c,
               int ldc, int64_t stride_c, int64_t c_len, int64_t batch);
"""

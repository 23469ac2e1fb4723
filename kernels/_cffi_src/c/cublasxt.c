/*
 * GPU GEMM through cuBLASXt on host pointers.
 *
 * cuBLASXt tiles the host operands and moves them to and from the GPUs
 * itself, which is what a device agent on an emulator host wants: tiles
 * arrive in host buffers and leave from host buffers. libcuda (the driver)
 * and libcublas are dlopen'ed so the extension builds and imports on hosts
 * without CUDA; mg_xt_open says why it is unavailable there.
 *
 * cuBLASXt is column-major. A row-major C = op(A) op(B) is computed as the
 * column-major C^T = op(B)^T op(A)^T, i.e. with the operands swapped and
 * the same transpose flags.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *mg_xt_handle_t;
typedef int (*mg_xt_create_fn)(mg_xt_handle_t *);
typedef int (*mg_xt_destroy_fn)(mg_xt_handle_t);
typedef int (*mg_xt_select_fn)(mg_xt_handle_t, int, int *);
typedef int (*mg_xt_blockdim_fn)(mg_xt_handle_t, int);
typedef int (*mg_xt_sgemm_fn)(mg_xt_handle_t, int, int, size_t, size_t, size_t, const float *,
                              const float *, size_t, const float *, size_t, const float *,
                              float *, size_t);
typedef int (*mg_xt_dgemm_fn)(mg_xt_handle_t, int, int, size_t, size_t, size_t, const double *,
                              const double *, size_t, const double *, size_t, const double *,
                              double *, size_t);
typedef int (*mg_cu_init_fn)(unsigned int);
typedef int (*mg_cu_count_fn)(int *);

static struct {
    void *cuda;
    void *cublas;
    mg_xt_create_fn create;
    mg_xt_destroy_fn destroy;
    mg_xt_select_fn select;
    mg_xt_blockdim_fn block_dim;
    mg_xt_sgemm_fn sgemm;
    mg_xt_dgemm_fn dgemm;
    int device_count;
} mg_xt;

typedef struct mg_xt_ctx {
    mg_xt_handle_t handle;
} mg_xt_ctx;

int mg_xt_open(const char *cuda_path, const char *cublas_path, char *err, size_t errlen)
{
    if (mg_xt.cublas != NULL)
        return 0;
    void *cuda = dlopen(cuda_path, RTLD_NOW | RTLD_GLOBAL);
    if (cuda == NULL) {
        snprintf(err, errlen, "CUDA driver: %s", dlerror());
        return -1;
    }
    mg_cu_init_fn cu_init = (mg_cu_init_fn)dlsym(cuda, "cuInit");
    mg_cu_count_fn cu_count = (mg_cu_count_fn)dlsym(cuda, "cuDeviceGetCount");
    int count = 0, rc;
    if (cu_init == NULL || cu_count == NULL) {
        snprintf(err, errlen, "CUDA driver %s lacks cuInit/cuDeviceGetCount", cuda_path);
        dlclose(cuda);
        return -1;
    }
    if ((rc = cu_init(0)) != 0 || (rc = cu_count(&count)) != 0 || count < 1) {
        if (rc != 0)
            snprintf(err, errlen, "CUDA driver error %d (no usable GPU)", rc);
        else
            snprintf(err, errlen, "no CUDA devices");
        dlclose(cuda);
        return -1;
    }
    void *cublas = dlopen(cublas_path, RTLD_NOW | RTLD_LOCAL);
    if (cublas == NULL) {
        snprintf(err, errlen, "cuBLAS: %s", dlerror());
        dlclose(cuda);
        return -1;
    }
    mg_xt.create = (mg_xt_create_fn)dlsym(cublas, "cublasXtCreate");
    mg_xt.destroy = (mg_xt_destroy_fn)dlsym(cublas, "cublasXtDestroy");
    mg_xt.select = (mg_xt_select_fn)dlsym(cublas, "cublasXtDeviceSelect");
    mg_xt.block_dim = (mg_xt_blockdim_fn)dlsym(cublas, "cublasXtSetBlockDim");
    mg_xt.sgemm = (mg_xt_sgemm_fn)dlsym(cublas, "cublasXtSgemm");
    mg_xt.dgemm = (mg_xt_dgemm_fn)dlsym(cublas, "cublasXtDgemm");
    if (!mg_xt.create || !mg_xt.destroy || !mg_xt.select || !mg_xt.block_dim || !mg_xt.sgemm ||
        !mg_xt.dgemm) {
        snprintf(err, errlen, "%s lacks the cublasXt* entry points", cublas_path);
        dlclose(cublas);
        dlclose(cuda);
        return -1;
    }
    mg_xt.cuda = cuda;
    mg_xt.cublas = cublas;
    mg_xt.device_count = count;
    return 0;
}

int mg_xt_device_count(void) { return mg_xt.device_count; }

mg_xt_ctx *mg_xt_create(int *devices, int ndevices, int block_dim, int *status)
{
    *status = -1;
    if (mg_xt.cublas == NULL)
        return NULL;
    mg_xt_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL)
        return NULL;
    if ((*status = mg_xt.create(&ctx->handle)) != 0) {
        free(ctx);
        return NULL;
    }
    if ((*status = mg_xt.select(ctx->handle, ndevices, devices)) != 0 ||
        (block_dim > 0 && (*status = mg_xt.block_dim(ctx->handle, block_dim)) != 0)) {
        mg_xt.destroy(ctx->handle);
        free(ctx);
        return NULL;
    }
    return ctx;
}

void mg_xt_destroy(mg_xt_ctx *ctx)
{
    if (ctx == NULL)
        return;
    mg_xt.destroy(ctx->handle);
    free(ctx);
}

int mg_xt_gemm(mg_xt_ctx *ctx, int dtype, int trans_a, int trans_b, int m, int n, int k,
               double alpha, const void *a, int lda, int64_t stride_a, int64_t a_len,
               const void *b, int ldb, int64_t stride_b, int64_t b_len, double beta, void *c,
               int ldc, int64_t stride_c, int64_t c_len, int64_t batch)
{
    trans_a = trans_a != 0; /* cublasOperation_t: 0 = N, 1 = T */
    trans_b = trans_b != 0;
    int check = mg_gemm_check(dtype, trans_a, trans_b, m, n, k, lda, stride_a, a_len, ldb,
                              stride_b, b_len, ldc, stride_c, c_len, batch);
    if (check != MG_GEMM_OK)
        return check;
    if (m == 0 || n == 0)
        return MG_GEMM_OK;
    const float falpha = (float)alpha, fbeta = (float)beta;
    for (int64_t p = 0; p < batch; p++) {
        int rc;
        if (dtype == 0)
            rc = mg_xt.sgemm(ctx->handle, trans_b, trans_a, (size_t)n, (size_t)m, (size_t)k,
                             &falpha, (const float *)b + p * stride_b, (size_t)ldb,
                             (const float *)a + p * stride_a, (size_t)lda, &fbeta,
                             (float *)c + p * stride_c, (size_t)ldc);
        else
            rc = mg_xt.dgemm(ctx->handle, trans_b, trans_a, (size_t)n, (size_t)m, (size_t)k,
                             &alpha, (const double *)b + p * stride_b, (size_t)ldb,
                             (const double *)a + p * stride_a, (size_t)lda, &beta,
                             (double *)c + p * stride_c, (size_t)ldc);
        if (rc != 0)
            return 100 + rc; /* cuBLAS status, offset past the check codes */
    }
    return MG_GEMM_OK;
}

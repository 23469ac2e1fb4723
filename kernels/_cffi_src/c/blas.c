/*
 * CPU GEMM over a CBLAS library chosen at run time.
 *
 * The library (MKL's libmkl_rt or an OpenBLAS build) is dlopen'ed rather than
 * linked, so the extension builds without BLAS headers, an MKL wheel can be
 * preferred over a system OpenBLAS, and the choice is made (and logged) by the
 * Python layer. All matrices are row-major, with transposes and leading
 * dimensions explicit; mg_gemm_check (gemm_check.c) guards every call.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { MG_CBLAS_ROW_MAJOR = 101, MG_CBLAS_NO_TRANS = 111, MG_CBLAS_TRANS = 112 };

/* Below this many multiply-adds per matrix, an OpenMP fork/join costs more
 * than it saves (64^3 runs in 3.7 us on one core against 4.2-5.2 us on two),
 * so MKL runs such calls on the calling thread alone. */
#define MG_SMALL_GEMM (1 << 20)

typedef void (*mg_sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                            const float *, int, float, float *, int);
typedef void (*mg_dgemm_fn)(int, int, int, int, int, int, double, const double *, int,
                            const double *, int, double, double *, int);
typedef int (*mg_int_of_int_fn)(int);
typedef void (*mg_void_of_int_fn)(int);
typedef void (*mg_version_fn)(char *, int);
typedef char *(*mg_config_fn)(void);

static struct {
    void *handle;
    mg_sgemm_fn sgemm;
    mg_dgemm_fn dgemm;
    mg_int_of_int_fn mkl_threads_local; /* MKL: per calling thread */
    mg_void_of_int_fn set_threads;      /* MKL or OpenBLAS: process-wide */
    mg_version_fn mkl_version;
    mg_config_fn openblas_config;
} mg_blas;

static void *mg_sym(void *handle, const char *prefix, const char *name)
{
    char full[128];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return dlsym(handle, full);
}

int mg_blas_open(const char *path, const char *prefix, int threading_layer, char *err,
                 size_t errlen)
{
    if (mg_blas.handle != NULL) {
        snprintf(err, errlen, "a BLAS library is already loaded in this process");
        return -1;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        snprintf(err, errlen, "%s", dlerror());
        return -1;
    }
    mg_sgemm_fn sgemm = (mg_sgemm_fn)mg_sym(h, prefix, "cblas_sgemm");
    mg_dgemm_fn dgemm = (mg_dgemm_fn)mg_sym(h, prefix, "cblas_dgemm");
    if (sgemm == NULL || dgemm == NULL) {
        snprintf(err, errlen, "%s has no %scblas_sgemm/%scblas_dgemm", path, prefix, prefix);
        dlclose(h);
        return -1;
    }
    mg_int_of_int_fn set_layer = (mg_int_of_int_fn)dlsym(h, "MKL_Set_Threading_Layer");
    if (set_layer != NULL && threading_layer >= 0)
        set_layer(threading_layer); /* must precede the first MKL call */
    mg_blas.sgemm = sgemm;
    mg_blas.dgemm = dgemm;
    mg_blas.mkl_threads_local = (mg_int_of_int_fn)dlsym(h, "MKL_Set_Num_Threads_Local");
    mg_blas.mkl_version = (mg_version_fn)dlsym(h, "MKL_Get_Version_String");
    mg_blas.openblas_config = (mg_config_fn)mg_sym(h, prefix, "openblas_get_config");
    mg_blas.set_threads = (mg_void_of_int_fn)dlsym(h, "MKL_Set_Num_Threads");
    if (mg_blas.set_threads == NULL)
        mg_blas.set_threads = (mg_void_of_int_fn)mg_sym(h, prefix, "openblas_set_num_threads");
    mg_blas.handle = h;
    return 0;
}

int mg_blas_is_mkl(void) { return mg_blas.mkl_version != NULL; }

void mg_blas_version(char *buf, int len)
{
    if (len <= 0)
        return;
    buf[0] = '\0';
    if (mg_blas.mkl_version != NULL)
        mg_blas.mkl_version(buf, len);
    else if (mg_blas.openblas_config != NULL)
        snprintf(buf, (size_t)len, "%s", mg_blas.openblas_config());
}

int mg_blas_set_threads(int n, int thread_local_only)
{
    if (mg_blas.handle == NULL || n < 1)
        return -1;
    if (mg_blas.mkl_threads_local != NULL) {
        mg_blas.mkl_threads_local(n);
        if (thread_local_only)
            return 0;
    } else if (thread_local_only) {
        return -1; /* OpenBLAS has only a process-wide count */
    }
    if (mg_blas.set_threads == NULL)
        return -1;
    mg_blas.set_threads(n);
    return 0;
}

int mg_gemm(int dtype, int trans_a, int trans_b, int m, int n, int k, double alpha,
            const void *a, int lda, int64_t stride_a, int64_t a_len, const void *b, int ldb,
            int64_t stride_b, int64_t b_len, double beta, void *c, int ldc, int64_t stride_c,
            int64_t c_len, int64_t batch)
{
    if (mg_blas.handle == NULL)
        return MG_GEMM_ENOLIB;
    trans_a = trans_a != 0;
    trans_b = trans_b != 0;
    int rc = mg_gemm_check(dtype, trans_a, trans_b, m, n, k, lda, stride_a, a_len, ldb, stride_b,
                           b_len, ldc, stride_c, c_len, batch);
    if (rc != MG_GEMM_OK)
        return rc;
    if (m == 0 || n == 0)
        return MG_GEMM_OK; /* nothing to write */
    int ta = trans_a ? MG_CBLAS_TRANS : MG_CBLAS_NO_TRANS;
    int tb = trans_b ? MG_CBLAS_TRANS : MG_CBLAS_NO_TRANS;
    int small = mg_blas.mkl_threads_local != NULL && (int64_t)m * n * k < MG_SMALL_GEMM;
    int previous = small ? mg_blas.mkl_threads_local(1) : 0;
    for (int64_t p = 0; p < batch; p++) {
        if (dtype == 0) {
            const float *pa = (const float *)a + p * stride_a;
            const float *pb = (const float *)b + p * stride_b;
            float *pc = (float *)c + p * stride_c;
            mg_blas.sgemm(MG_CBLAS_ROW_MAJOR, ta, tb, m, n, k, (float)alpha, pa, lda, pb, ldb,
                          (float)beta, pc, ldc);
        } else {
            const double *pa = (const double *)a + p * stride_a;
            const double *pb = (const double *)b + p * stride_b;
            double *pc = (double *)c + p * stride_c;
            mg_blas.dgemm(MG_CBLAS_ROW_MAJOR, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta,
                          pc, ldc);
        }
    }
    if (small)
        mg_blas.mkl_threads_local(previous); /* 0 restores the global setting */
    return MG_GEMM_OK;
}

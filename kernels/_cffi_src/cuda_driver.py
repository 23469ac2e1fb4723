"""Declarations for the CUDA libraries opened in cffi ABI mode (``ffi.dlopen`` at run time).

Unlike the other topics here, nothing is compiled: ``kernels/cuda.py`` feeds these
strings to ``FFI.cdef`` and opens ``libcuda.so.1`` (and libcublas, for the green-context
GEMMs) when first needed, so hosts without CUDA import the package and the compiled
``_native`` extension never has to be rebuilt for GPU features.

ABI mode binds exported symbols by name, so the versioned names that ``cuda.h``
``#define``s the plain ones to are spelled out (``cuMemHostRegister`` is exported as
``cuMemHostRegister_v2``, likewise ``cuCtxPushCurrent``, ``cuCtxPopCurrent``,
``cuMemAlloc``, ``cuMemFree``, ``cuMemcpy*Async``, ``cuStreamDestroy`` and
``cuDevicePrimaryCtxRelease``). Layouts must match ``cuda.h`` exactly: ``CUdevResource``
is 4 + 92 + 48 = 144 bytes with ``sm.smCount`` at offset 96 in CUDA 12.x and 13.x alike
(13.x splits the last 48 bytes into a 40-byte union and a ``nextResource`` pointer).
"""

DRIVER_TYPES = """
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;

#define CUDA_SUCCESS 0
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_MEMHOSTREGISTER_PORTABLE 1
#define CU_STREAM_NON_BLOCKING 1
#define CU_GREEN_CTX_DEFAULT_STREAM 1
#define CU_DEV_RESOURCE_TYPE_SM 1

typedef struct CUdevSmResource_st {
    unsigned int smCount;
} CUdevSmResource;

typedef struct CUdevResource_st {
    int type;
    unsigned char _internal_padding[92];
    union {
        CUdevSmResource sm;
        unsigned char _oversize[48];
    };
} CUdevResource;
"""

DRIVER_FUNCTIONS = """
CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuCtxSetCurrent(CUcontext ctx);

CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int flags);
CUresult cuMemHostUnregister(void *p);
CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t byteCount,
                              CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t byteCount,
                              CUstream hStream);

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuStreamDestroy_v2(CUstream hStream);

CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, int type);
CUresult cuDevSmResourceSplitByCount(CUdevResource *result, unsigned int *nbGroups,
                                     const CUdevResource *input, CUdevResource *remaining,
                                     unsigned int useFlags, unsigned int minCount);
CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources,
                                   unsigned int nbResources);
CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev,
                          unsigned int flags);
CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags,
                                int priority);
CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx);
CUresult cuGreenCtxDestroy(CUgreenCtx hCtx);
"""

# The green-context entry points: absent from drivers before 12.4, so looked up by name.
GREEN_CONTEXT_SYMBOLS = (
    "cuDeviceGetDevResource",
    "cuDevSmResourceSplitByCount",
    "cuDevResourceGenerateDesc",
    "cuGreenCtxCreate",
    "cuGreenCtxStreamCreate",
    "cuCtxFromGreenCtx",
    "cuGreenCtxDestroy",
)

# Plain cuBLAS (not Xt): a handle bound to one stream, which a green context needs.
CUBLAS_TYPES = """
typedef struct cublasContext *cublasHandle_t;
#define CUBLAS_OP_N 0
#define CUBLAS_OP_T 1
"""

CUBLAS_FUNCTIONS = """
int cublasCreate_v2(cublasHandle_t *handle);
int cublasDestroy_v2(cublasHandle_t handle);
int cublasSetStream_v2(cublasHandle_t handle, CUstream streamId);
int cublasSgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                   const float *alpha, const float *A, int lda, const float *B, int ldb,
                   const float *beta, float *C, int ldc);
int cublasDgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                   const double *alpha, const double *A, int lda, const double *B, int ldb,
                   const double *beta, double *C, int ldc);
"""

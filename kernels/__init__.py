"""Compute and memory kernels: CPU and GPU GEMM, convolutions, buffer pools, green contexts,
the worker pool.

The C sources and their cffi builders live in ``_cffi_src/``; nothing here
spells a C type outside the thin wrappers.
"""

from .blas import BlasInfo, blas_info, gemm, run_plan, set_threads
from .conv import (
    ConvGeometry,
    conv_flops,
    conv_forward,
    conv_grad_input,
    conv_grad_weight,
)
from .cublasxt import CublasXt, cublasxt_status
from .cuda import CudaError, CudaHostPinner, CudaUnavailable, cuda_status
from .green_context import (
    CudaGreenContexts,
    GreenContextConfig,
    GreenContextController,
    GreenTrace,
    SwitchStats,
    TraceError,
    green_context_status,
)
from .layout import GemmPlan, LayoutError, Operand, blas_operand, plan_explicit, plan_gemm
from .pool import BufferPool, HostPinner, Lease, LeaseError, MlockError, PoolStats
from .workers import (
    POLICIES,
    CpuBackend,
    GemmResult,
    GpuBackend,
    GreenGpuBackend,
    WorkerLoad,
    WorkerPool,
    WorkerStats,
    choose_worker,
)

__all__ = [
    "POLICIES",
    "BlasInfo",
    "BufferPool",
    "ConvGeometry",
    "CpuBackend",
    "CublasXt",
    "CudaError",
    "CudaGreenContexts",
    "CudaHostPinner",
    "CudaUnavailable",
    "GemmPlan",
    "GemmResult",
    "GpuBackend",
    "GreenContextConfig",
    "GreenContextController",
    "GreenGpuBackend",
    "GreenTrace",
    "HostPinner",
    "LayoutError",
    "Lease",
    "LeaseError",
    "MlockError",
    "Operand",
    "PoolStats",
    "SwitchStats",
    "TraceError",
    "WorkerLoad",
    "WorkerPool",
    "WorkerStats",
    "blas_info",
    "blas_operand",
    "choose_worker",
    "conv_flops",
    "conv_forward",
    "conv_grad_input",
    "conv_grad_weight",
    "cublasxt_status",
    "cuda_status",
    "gemm",
    "green_context_status",
    "plan_explicit",
    "plan_gemm",
    "run_plan",
    "set_threads",
]

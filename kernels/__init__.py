"""Compute and memory kernels: CPU and GPU GEMM, buffer pools, the GEMM worker pool.

The C sources and their cffi builders live in ``_cffi_src/``; nothing here
spells a C type outside the thin wrappers.
"""

from .blas import BlasInfo, blas_info, gemm, run_plan, set_threads
from .cublasxt import CublasXt, cublasxt_status
from .layout import GemmPlan, LayoutError, Operand, blas_operand, plan_explicit, plan_gemm
from .pool import BufferPool, Lease, LeaseError, MlockError, PoolStats
from .workers import (
    POLICIES,
    CpuBackend,
    GemmResult,
    GpuBackend,
    WorkerLoad,
    WorkerPool,
    WorkerStats,
    choose_worker,
)

__all__ = [
    "POLICIES",
    "BlasInfo",
    "BufferPool",
    "CpuBackend",
    "CublasXt",
    "GemmPlan",
    "GemmResult",
    "GpuBackend",
    "LayoutError",
    "Lease",
    "LeaseError",
    "MlockError",
    "Operand",
    "PoolStats",
    "WorkerLoad",
    "WorkerPool",
    "WorkerStats",
    "blas_info",
    "blas_operand",
    "choose_worker",
    "cublasxt_status",
    "gemm",
    "plan_explicit",
    "plan_gemm",
    "run_plan",
    "set_threads",
]

"""GPU GEMM through cuBLASXt on host pointers.

The CUDA driver (``libcuda.so.1``) and cuBLAS are found at run time: the
``nvidia-cublas`` wheel (CUDA 13, ``libcublas.so.13``), ``nvidia-cublas-cu12``
(``libcublas.so.12``), or a system CUDA. On a host without them
``cublasxt_status()`` says why, and ``CublasXt()`` raises with that reason.
"""

from __future__ import annotations

import site
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ._native import ffi, lib
from .ctext import c_text
from .layout import GemmPlan, check_failure, plan_gemm

_ERRLEN = 1024
_SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


def _cublas_candidates() -> list[str]:
    roots = [Path(p) for p in (*site.getsitepackages(), site.getusersitepackages(), *sys.path)]
    subdirs = ("nvidia/cu13/lib", "nvidia/cublas/lib", "nvidia/cu12/lib")
    found = [
        str(root / sub / name)
        for root in dict.fromkeys(roots)
        for sub in subdirs
        for name in _SONAMES
        if (root / sub / name).exists()
    ]
    system = [f"/usr/local/cuda/lib64/{name}" for name in _SONAMES]
    return found + [p for p in system if Path(p).exists()] + list(_SONAMES)


_lock = threading.Lock()
_status: str | None = None  # "available" or "unavailable: <reason>"


def cublasxt_status() -> str:
    """``"available"`` or ``"unavailable: <reason>"``; loads the libraries once."""
    global _status
    with _lock:
        if _status is None:
            err = ffi.new("char[]", _ERRLEN)
            reasons = []
            for path in _cublas_candidates():
                if lib.mg_xt_open(b"libcuda.so.1", path.encode(), err, _ERRLEN) == 0:
                    _status = "available"
                    break
                reason = c_text(ffi.string(err))
                if reason.startswith("CUDA driver") or reason == "no CUDA devices":
                    reasons = [reason]  # no GPU: which cuBLAS is irrelevant
                    break
                reasons.append(reason)
            if _status is None:
                _status = "unavailable: " + "; ".join(reasons)
    return _status


class CublasXt:
    """One cuBLASXt handle over a set of GPUs (default: all), with a block dimension.

    A handle belongs to the thread that uses it; the worker pool creates one
    per GPU worker thread.
    """

    def __init__(self, devices: list[int] | None = None, block_dim: int = 1024) -> None:
        status = cublasxt_status()
        if status != "available":
            raise RuntimeError(f"cuBLASXt {status}")
        count = lib.mg_xt_device_count()
        devices = list(range(count)) if devices is None else list(devices)
        bad = [d for d in devices if not 0 <= d < count]
        if not devices or bad:
            raise ValueError(f"devices={devices}: this host has GPUs 0..{count - 1}")
        if block_dim < 0:
            raise ValueError(f"block_dim={block_dim}: must be >= 0 (0 keeps cuBLASXt's default)")
        ids = ffi.new("int[]", devices)
        rc = ffi.new("int *")
        ctx = lib.mg_xt_create(ids, len(devices), block_dim, rc)
        if ctx == ffi.NULL:
            raise RuntimeError(f"cublasXtCreate/DeviceSelect/SetBlockDim failed: status {rc[0]}")
        self._ctx = ffi.gc(ctx, lib.mg_xt_destroy)
        self.devices = devices
        self.block_dim = block_dim

    def run_plan(self, plan: GemmPlan) -> None:
        rc = lib.mg_xt_gemm(self._ctx, *plan)
        if rc:
            raise check_failure(rc, plan)

    def gemm(
        self, a: Any, b: Any, out: Any = None, *, alpha: float = 1.0, beta: float = 0.0
    ) -> np.ndarray:
        """Same contract as ``morphling.kernels.gemm``, computed on the GPUs."""
        plan, result = plan_gemm(a, b, out, alpha=alpha, beta=beta)
        self.run_plan(plan)
        return result

    def close(self) -> None:
        if self._ctx is not None:
            ffi.release(self._ctx)
            self._ctx = None

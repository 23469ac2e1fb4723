"""CPU GEMM through MKL (preferred) or OpenBLAS, chosen once per process.

MKL comes from the ``mkl`` wheel (``libmkl_rt.so.3`` under the environment's
``lib/``); where it is missing (ARM boards) or refused, OpenBLAS is used and
the reason is logged. ``MORPHLING_BLAS`` picks ``auto`` (default), ``mkl``,
``openblas`` or a library path.

Threads: PyTorch's CPU build runs MKL on GNU OpenMP (libgomp). Loading MKL's
Intel threading layer next to it would start a second OpenMP runtime, and the
two would oversubscribe the cores. MKL is therefore put on the GNU layer by
default (``MORPHLING_MKL_THREADING``: gnu, intel, sequential, tbb), and the
thread count is set per worker thread (``set_threads``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._native import ffi, lib
from .ctext import c_text
from .layout import GemmPlan, check_failure, plan_gemm

log = logging.getLogger(__name__)

_MKL_LAYERS = {"intel": 0, "sequential": 1, "gnu": 3, "tbb": 4}
_ERRLEN = 1024


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS this process computes with, and why."""

    name: str  # "mkl" or "openblas"
    path: str
    version: str
    threading: str
    fallback_reason: str | None = None


def _mkl_candidates() -> list[str]:
    names = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
    dirs = dict.fromkeys([Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"])
    found = [str(d / n) for n in names for d in dirs if (d / n).exists()]
    return found + list(names)  # bare sonames: let the dynamic loader search


def _openblas_candidates() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    try:
        import scipy_openblas32

        lib_dir = Path(scipy_openblas32.get_lib_dir())
        found.append((str(lib_dir / f"lib{scipy_openblas32.get_library()}.so"), "scipy_"))
    except ImportError:
        pass
    return [*found, ("libopenblas.so.0", ""), ("libopenblas.so", ""), ("libcblas.so.3", "")]


def _open(path: str, prefix: str, layer: int) -> str | None:
    err = ffi.new("char[]", _ERRLEN)
    if lib.mg_blas_open(path.encode(), prefix.encode(), layer, err, _ERRLEN) == 0:
        return None
    return c_text(ffi.string(err))


def _settings() -> tuple[str, str, int | None]:
    """(choice, MKL threading layer, threads), validated before anything is loaded."""
    choice = os.environ.get("MORPHLING_BLAS", "auto").strip()
    if choice.lower() in ("auto", "mkl", "openblas"):
        choice = choice.lower()
    elif not Path(choice).exists():
        raise ValueError(f"MORPHLING_BLAS={choice!r}: expected auto, mkl, openblas or a path")
    threading_name = os.environ.get("MORPHLING_MKL_THREADING", "gnu").strip().lower()
    if threading_name not in _MKL_LAYERS:
        raise ValueError(
            f"MORPHLING_MKL_THREADING={threading_name!r}: expected one of {sorted(_MKL_LAYERS)}"
        )
    threads = os.environ.get("MORPHLING_BLAS_THREADS")
    if threads is not None and (not threads.isdigit() or int(threads) < 1):
        raise ValueError(f"MORPHLING_BLAS_THREADS={threads!r}: expected a positive integer")
    return choice, threading_name, None if threads is None else int(threads)


def _load() -> BlasInfo:
    choice, threading_name, threads = _settings()
    layer = _MKL_LAYERS[threading_name]

    errors: list[str] = []
    if choice in ("auto", "mkl"):
        for path in _mkl_candidates():
            reason = _open(path, "", layer)
            if reason is None:
                return _info("mkl", path, threading_name, None, threads)
            errors.append(reason)
        if choice == "mkl":
            raise RuntimeError("MKL requested but not loadable: " + "; ".join(errors))
    fallback = None
    if choice == "auto":
        fallback = "MKL not loadable: " + "; ".join(errors)
    elif choice == "openblas":
        fallback = "MORPHLING_BLAS=openblas"
    candidates = [(choice, "")] if Path(choice).exists() else _openblas_candidates()
    for path, prefix in candidates:
        reason = _open(path, prefix, -1)
        if reason is None:
            name = "mkl" if lib.mg_blas_is_mkl() else "openblas"
            info = _info(name, path, "native", fallback, threads)
            level = logging.WARNING if choice == "auto" else logging.INFO
            log.log(level, "BLAS: using %s at %s (%s)", info.name, path, fallback)
            return info
        errors.append(reason)
    raise RuntimeError("no usable BLAS library: " + "; ".join(errors))


def _info(
    name: str, path: str, threading_name: str, reason: str | None, threads: int | None
) -> BlasInfo:
    buf = ffi.new("char[]", 512)
    lib.mg_blas_version(buf, 512)
    version = c_text(ffi.string(buf)).strip()
    if threads is not None:
        lib.mg_blas_set_threads(threads, 0)
    log.debug("BLAS: %s %s (%s) threading=%s", name, version, path, threading_name)
    return BlasInfo(name, path, version, threading_name, reason)


_lock = threading.Lock()
_loaded: BlasInfo | None = None


def blas_info() -> BlasInfo:
    """Load the BLAS library on first use and describe it."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded


_warned_threads = False


def set_threads(n: int) -> None:
    """Threads for BLAS calls made from the calling thread.

    Only MKL has per-thread counts. OpenBLAS's count is process-wide, and
    changing it while another thread computes is unsafe, so there it is left
    alone (set ``MORPHLING_BLAS_THREADS`` instead) and a warning is logged once.
    """
    global _warned_threads
    if n < 1:
        raise ValueError(f"threads={n}: must be >= 1")
    info = blas_info()
    if lib.mg_blas_set_threads(n, 1) != 0 and not _warned_threads:
        _warned_threads = True
        log.warning(
            "%s has no per-thread thread count; threads=%d ignored "
            "(use MORPHLING_BLAS_THREADS for a process-wide count)",
            info.name,
            n,
        )


def run_plan(plan: GemmPlan) -> None:
    """Execute a plan on the CPU. The GIL is released for the duration of the call."""
    blas_info()
    rc = lib.mg_gemm(*plan)
    if rc:
        raise check_failure(rc, plan)


def gemm(a: Any, b: Any, out: Any = None, *, alpha: float = 1.0, beta: float = 0.0) -> np.ndarray:
    """``out = alpha * a @ b + beta * out`` on the CPU, for 2-D or batched 3-D views.

    Transposes and leading dimensions are read from the views' strides, so
    ``gemm(x.T, w)`` runs ``cblas_sgemm`` with ``transa`` set and no copy.
    Returns the numpy view of ``out``.
    """
    plan, result = plan_gemm(a, b, out, alpha=alpha, beta=beta)
    run_plan(plan)
    return result

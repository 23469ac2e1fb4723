"""CPU GEMM through MKL or OpenBLAS, chosen once per process.

MKL comes from the ``mkl`` wheel (``libmkl_rt.so.3`` under the environment's
``lib/``), OpenBLAS from ``scipy-openblas32``. ``MORPHLING_BLAS`` picks ``auto``
(default), ``mkl``, ``openblas`` or a library path. ``auto`` takes MKL on Intel
CPUs and OpenBLAS on the others: MKL runs its AVX2 code on a non-Intel CPU even
where the CPU has AVX-512, at about half the rate of OpenBLAS's AVX-512 kernels.
Where the preferred library is missing (MKL on ARM boards) or refused, the other
is used and the reason is logged.

OpenBLAS picks its kernels by CPU model, which says nothing of how wide a newer
AMD CPU's vector units are: one that runs each 512-bit instruction as two 256-bit
halves (Zen 4, some Zen 5 parts) computes faster with the AVX2 (``Haswell``)
kernels, one with full-width units up to twice as fast with the AVX-512
(``SkylakeX``) ones. On a non-Intel CPU with AVX-512 the width is therefore
measured (``c/vector_width.c``: 512-bit against 256-bit multiply-add throughput)
and OpenBLAS opened as the kernels that suit it, unless ``OPENBLAS_CORETYPE``
says otherwise; the version string names the kernels used.

Threads: PyTorch's CPU build runs MKL on GNU OpenMP (libgomp). Loading MKL's
Intel threading layer next to it would start a second OpenMP runtime, and the
two would oversubscribe the cores. MKL is therefore put on the GNU layer by
default (``MORPHLING_MKL_THREADING``: gnu, intel, sequential, tbb), and the
thread count is set per worker thread (``set_threads``). OpenBLAS has one
count for the whole process: the first ``set_threads`` sets it.
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
    why_not_mkl: str | None = None  # None where it is MKL


_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}  # what SkylakeX's kernels use
_FULL_WIDTH = 1.5  # 512-bit over 256-bit FMA FLOPs: 1 split in halves, 2 at full width


def _x86_cpu() -> tuple[str, set[str]]:
    """The first CPU's vendor and flags from ``/proc/cpuinfo``; ("", set()) where it
    says neither (another architecture, or no /proc)."""
    vendor, flags = "", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return vendor, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            vendor = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
        elif not line.strip() and (vendor or flags):
            break
    return vendor, flags


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
    vendor, flags = _x86_cpu()
    elsewhere = vendor not in ("", "GenuineIntel")  # another vendor's x86 CPU
    wide = elsewhere and flags >= _AVX512  # (which kernels then: ``_openblas_core``)
    errors: list[str] = []
    if choice == "auto" and elsewhere:
        why = f"{vendor} CPU: MKL would run its AVX2 code"
        info = _open_openblas(None, why, threads, wide, errors)
        if info is not None:
            log.info("BLAS: using openblas at %s (%s)", info.path, why)
            return info
    if choice in ("auto", "mkl"):
        for path in _mkl_candidates():
            reason = _open(path, "", _MKL_LAYERS[threading_name])
            if reason is None:
                return _info("mkl", path, threading_name, None, threads)
            errors.append(reason)
        if choice == "mkl":
            raise RuntimeError("MKL requested but not loadable: " + "; ".join(errors))
        if elsewhere:  # (OpenBLAS was tried first)
            raise RuntimeError("no usable BLAS library: " + "; ".join(errors))
    if choice == "auto":
        why = "MKL not loadable: " + "; ".join(errors)
    else:
        why = f"MORPHLING_BLAS={choice}" if choice == "openblas" else "MORPHLING_BLAS is a path"
    info = _open_openblas(choice if Path(choice).exists() else None, why, threads, wide, errors)
    if info is None:
        raise RuntimeError("no usable BLAS library: " + "; ".join(errors))
    level = logging.WARNING if choice == "auto" else logging.INFO
    log.log(level, "BLAS: using %s at %s (%s)", info.name, info.path, why)
    return info


def _open_openblas(
    path: str | None,
    why: str,
    threads: int | None,
    wide: bool,
    errors: list[str],
) -> BlasInfo | None:
    """The library at ``path``, or the first of ``_openblas_candidates`` that opens, as
    the OpenBLAS kernels that suit the CPU's vector width where it is ``wide`` (a non-Intel
    CPU with AVX-512: the module docstring says why) and nobody named them; None, with the
    reasons in ``errors``."""
    forced = _openblas_core() if wide and "OPENBLAS_CORETYPE" not in os.environ else None
    try:
        if forced:  # read once, as the library loads (importing scipy_openblas32 loads it)
            os.environ["OPENBLAS_CORETYPE"] = forced
        for candidate, prefix in [(path, "")] if path else _openblas_candidates():
            reason = _open(candidate, prefix, -1)
            if reason is None:
                name = "mkl" if lib.mg_blas_is_mkl() else "openblas"
                return _info(name, candidate, "native", why, threads)
            errors.append(reason)
    finally:
        if forced:
            del os.environ["OPENBLAS_CORETYPE"]
    return None


def _openblas_core() -> str:
    """OpenBLAS's kernels for this non-Intel CPU with AVX-512: ``SkylakeX`` where its
    512-bit multiply-adds run at full width (about twice the 256-bit FLOPs), else
    ``Haswell``."""
    ratio = lib.mg_fma_512_over_256()
    core = "SkylakeX" if ratio >= _FULL_WIDTH else "Haswell"
    log.debug(
        "BLAS: 512-bit FMA throughput %.2fx the 256-bit one: OpenBLAS's %s kernels", ratio, core
    )
    return core


def _info(
    name: str, path: str, threading_name: str, reason: str | None, threads: int | None
) -> BlasInfo:
    global _process_threads
    buf = ffi.new("char[]", 512)
    lib.mg_blas_version(buf, 512)
    version = c_text(ffi.string(buf)).strip()
    if threads is not None:
        _process_threads = threads
        lib.mg_blas_set_threads(threads, 0)
    log.debug("BLAS: %s %s (%s) threading=%s", name, version, path, threading_name)
    return BlasInfo(name, path, version, threading_name, reason)


_lock = threading.Lock()
_loaded: BlasInfo | None = None
_process_threads: int | None = None  # OpenBLAS's one count, once it is set


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

    MKL has per-thread counts. OpenBLAS's count is process-wide, and changing it while
    another thread computes is unsafe, so the first call sets it (the workers of a pool
    start together, before any of them computes) unless ``MORPHLING_BLAS_THREADS`` has,
    and a later different count is logged once and left alone.
    """
    global _process_threads, _warned_threads
    if n < 1:
        raise ValueError(f"threads={n}: must be >= 1")
    info = blas_info()
    if lib.mg_blas_set_threads(n, 1) == 0:
        return
    with _lock:
        if _process_threads is None:
            _process_threads = n
            lib.mg_blas_set_threads(n, 0)
        elif n != _process_threads and not _warned_threads:
            _warned_threads = True
            log.warning(
                "%s has one thread count per process: threads=%d ignored, %d kept",
                info.name,
                n,
                _process_threads,
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

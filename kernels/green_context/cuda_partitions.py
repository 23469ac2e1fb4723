"""Green contexts on the CUDA driver: SM partitions of one GPU, each running cuBLAS GEMMs.

How a GEMM runs under a green context: cuBLASXt picks its own streams and contexts and
cannot be given a stream, so each partition instead holds a plain cuBLAS handle, created
with the partition's context current (``cublasCreate_v2``) and bound to the partition's
stream (``cublasSetStream_v2``), from the libcublas the cuBLASXt loader finds. The
operands are copied to device scratch memory on that stream (straight from pinned pool
buffers when the pool is pinned), ``cublasSgemm_v2``/``cublasDgemm_v2`` runs there, and
the result is copied back before the call returns. The whole device (the primary
context) is a partition like the others, so throttled and unthrottled GEMMs take the
same path and their times compare.

CUDA facts this relies on (``cuda.h`` and the driver API reference):

- green contexts need driver 12.5 or newer (``cuDriverGetVersion`` >= 12050); with an
  older driver the controller says so and every GEMM runs on the whole device;
- SM counts come in steps that depend on the compute capability (6.x: 1 or more;
  7.x: 2 or more, multiples of 2; 8.x: 4 or more, multiples of 2; 9.0+: 8 or more,
  multiples of 8). A count is rounded up to the next valid one, a count at or above the
  device's SMs means the whole device, and the count a split really yields is read back
  rather than assumed;
- a green context is current on one thread at a time, with no locking inside the
  driver: a controller and its partitions belong to the thread that runs the GEMMs;
- teardown order (upstream crashed at exit without it): each partition's cuBLAS handle
  (with its context current) and stream, then device memory, then the green contexts,
  then no context left current on the thread, then the primary context released.

The C declarations are ``_cffi_src/cuda_driver.py``'s, opened in ABI mode by ``cuda``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from .. import cuda
from .._cffi_src.cuda_driver import GREEN_CONTEXT_SYMBOLS
from .._native import ffi as native_ffi
from .._native import lib as native_lib
from ..cublasxt import _cublas_candidates
from ..layout import GemmPlan, check_failure

if TYPE_CHECKING:
    from cffi import FFI

    CData: TypeAlias = FFI.CData

log = logging.getLogger(__name__)

MIN_DRIVER = 12050
OFF_ENV = "MORPHLING_NO_GREEN_CTX"


def sm_granularity(cc_major: int) -> tuple[int, int]:
    """(minimum, multiple) of an SM split for a compute capability, from ``cuda.h``."""
    if cc_major >= 9:
        return 8, 8
    if cc_major == 8:
        return 4, 2
    if cc_major == 7:
        return 2, 2
    return 1, 1


def round_sm_count(requested: int, total: int, minimum: int, multiple: int) -> int:
    """The SM count a partition for ``requested`` SMs gets; ``total`` means the whole device."""
    count = max(minimum, -(-requested // multiple) * multiple)
    return total if count >= total else count


def green_context_status() -> str:
    """``"available"``, ``"off: ..."`` (the environment switch) or ``"unavailable: <reason>"``."""
    switch = os.environ.get(OFF_ENV, "")
    if switch not in ("", "0"):
        return f"off: {OFF_ENV}={switch}"
    status = cuda.cuda_status()
    if status != "available":
        return status
    version = cuda.driver_version()
    if version < MIN_DRIVER:
        return (
            f"unavailable: driver {cuda.format_version(version)} ({version}) is older than "
            "12.5; running without green contexts"
        )
    drv = cuda.driver()
    missing = [name for name in GREEN_CONTEXT_SYMBOLS if not hasattr(drv, name)]
    if missing:
        return f"unavailable: {cuda.DRIVER_SONAME} lacks {', '.join(missing)}"
    return "available"


class CublasLibrary(Protocol):
    """The plain cuBLAS calls a partition makes; each returns a ``cublasStatus_t``."""

    def cublasCreate_v2(self, handle: CData, /) -> int: ...

    def cublasSetStream_v2(self, handle: CData, stream: CData | None, /) -> int: ...

    def cublasDestroy_v2(self, handle: CData, /) -> int: ...

    def cublasSgemm_v2(self, handle: CData | None, /, *args: CData | int) -> int: ...

    def cublasDgemm_v2(self, handle: CData | None, /, *args: CData | int) -> int: ...


_blas_lock = threading.Lock()
_blas: CublasLibrary | None = None
_blas_error: str | None = None


def cublas_library() -> CublasLibrary:
    """libcublas opened in ABI mode, from the places the cuBLASXt loader searches."""
    global _blas, _blas_error
    with _blas_lock:
        if _blas is None and _blas_error is None:
            reasons = []
            for path in _cublas_candidates():
                try:
                    _blas = cuda.dlopen(path)
                    break
                except OSError as exc:
                    reasons.append(str(exc))
            else:
                _blas_error = "cuBLAS: " + "; ".join(reasons)
    if _blas is None:
        raise cuda.CudaUnavailable(_blas_error)
    return _blas


def _address(cdata: CData) -> int:
    """The address behind a pointer of the compiled extension, for the ABI-mode calls."""
    return int(native_ffi.cast("uintptr_t", cdata))


def _spans(plan: GemmPlan) -> tuple[int, int, int]:
    """Bytes of A, B and C the GEMM reads or writes, after the checks the compiled
    executors make in ``gemm_check.c`` (not callable from Python), with the same errors."""
    p, lib = plan, native_lib
    if p.dtype not in (0, 1):
        raise check_failure(lib.MG_GEMM_EDTYPE, p)
    if min(p.m, p.n, p.k, p.batch) < 0:
        raise check_failure(lib.MG_GEMM_EDIMS, p)
    item = 4 if p.dtype == 0 else 8
    a_rows, a_cols = (p.k, p.m) if p.trans_a else (p.m, p.k)
    b_rows, b_cols = (p.n, p.k) if p.trans_b else (p.k, p.n)
    operands = (
        (lib.MG_GEMM_ELDA, lib.MG_GEMM_EA, a_rows, a_cols, p.lda, p.stride_a, p.a_len),
        (lib.MG_GEMM_ELDB, lib.MG_GEMM_EB, b_rows, b_cols, p.ldb, p.stride_b, p.b_len),
        (lib.MG_GEMM_ELDC, lib.MG_GEMM_EC, p.m, p.n, p.ldc, p.stride_c, p.c_len),
    )
    spans = []
    for ld_code, code, rows, cols, ld, stride, length in operands:
        if ld < max(1, cols):
            raise check_failure(ld_code, p)
        if stride < 0:
            raise check_failure(code, p)
        empty = rows == 0 or cols == 0 or p.batch == 0 or (code != lib.MG_GEMM_EC and not p.k)
        span = 0 if empty else ((p.batch - 1) * stride + (rows - 1) * ld + cols) * item
        if span > length:
            raise check_failure(code, p)
        spans.append(span)
    stacked = p.stride_c >= (p.m - 1) * p.ldc + p.n
    interleaved = p.n <= p.stride_c and (p.batch - 1) * p.stride_c + p.n <= p.ldc
    if p.batch > 1 and p.m and p.n and not (stacked or interleaved):
        raise check_failure(lib.MG_GEMM_EOVERLAP, p)
    return spans[0], spans[1], spans[2]


@dataclass(slots=True)
class _Partition:
    sm_count: int
    context: CData | None  # CUcontext: the primary context, or the green context's
    green: CData | None = None  # CUgreenCtx; None for the whole device
    stream: CData | None = None
    handle: CData | None = None  # cublasHandle_t bound to ``stream``


class CudaGreenContexts:
    """SM partitions of one GPU as green contexts, each with a stream and a cuBLAS handle.

    The whole device (the primary context) is always a partition; ``green=False`` (a
    driver older than 12.5) leaves it the only one. See the module docstring for the
    GEMM path, the thread rule and the teardown order.
    """

    def __init__(self, device: int = 0, *, green: bool = True, stream_priority: int = 0) -> None:
        self._drv = cuda.driver()
        self._blas = cublas_library()
        self.device = device
        self.total_sms = cuda.device_attribute(device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        major = cuda.device_attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        self.min_sms, self.sm_multiple = sm_granularity(major)
        self._priority = stream_priority
        self._partitions: dict[int, _Partition] = {}
        self._active: _Partition | None = None
        self._scratch = [(0, 0), (0, 0), (0, 0)]  # (device pointer, bytes) for A, B, C
        self._sm_resource: CData | None = None
        # Retained before any green context exists, as the driver documentation advises,
        # so creating and destroying those does not initialise the device over again.
        self._primary: cuda.PrimaryContext | None = cuda.PrimaryContext(device)
        try:
            primary = self._primary
            whole = _Partition(self.total_sms, primary.context)
            self._partitions[self.total_sms] = whole
            stream = cuda.ffi.new("CUstream *")
            with primary.current():
                cuda.check(
                    self._drv.cuStreamCreateWithPriority(
                        stream, self._drv.CU_STREAM_NON_BLOCKING, stream_priority
                    ),
                    "cuStreamCreateWithPriority",
                )
            whole.stream = stream[0]
            self._bind_blas(whole)
            if green:
                resource = cuda.ffi.new("CUdevResource *")
                cuda.check(
                    self._drv.cuDeviceGetDevResource(
                        primary.handle, resource, self._drv.CU_DEV_RESOURCE_TYPE_SM
                    ),
                    "cuDeviceGetDevResource",
                )
                self._sm_resource = resource
        except BaseException:
            self.close()
            raise

    @property
    def _primary_context(self) -> cuda.PrimaryContext:
        """The device's primary context, while the partitions are open."""
        if self._primary is None:
            raise RuntimeError("the green contexts are closed")
        return self._primary

    def _bind_blas(self, part: _Partition) -> None:
        """A cuBLAS handle made in the partition's context and bound to its stream."""
        handle = cuda.ffi.new("cublasHandle_t *")
        with self._primary_context.current(part.context):
            rc = self._blas.cublasCreate_v2(handle)
            if rc != 0:
                raise RuntimeError(f"cublasCreate failed: cuBLAS status {rc}")
            part.handle = handle[0]
            rc = self._blas.cublasSetStream_v2(part.handle, part.stream)
        if rc != 0:
            raise RuntimeError(f"cublasSetStream failed: cuBLAS status {rc}")

    def prepare(self, sm_count: int) -> int:
        """Split off ``sm_count`` SMs into a green context; the SMs the split really gave."""
        if self._sm_resource is None:
            raise RuntimeError("green contexts are off for this device (green=False)")
        drv, ffi = self._drv, cuda.ffi
        result = ffi.new("CUdevResource[1]")
        groups = ffi.new("unsigned int *", 1)
        cuda.check(
            drv.cuDevSmResourceSplitByCount(
                result, groups, self._sm_resource, ffi.new("CUdevResource *"), 0, sm_count
            ),
            "cuDevSmResourceSplitByCount",
        )
        if groups[0] < 1:
            raise RuntimeError(f"cuDevSmResourceSplitByCount made no group of {sm_count} SMs")
        got = int(result[0].sm.smCount)
        if got in self._partitions:
            return got
        desc = ffi.new("CUdevResourceDesc *")
        cuda.check(drv.cuDevResourceGenerateDesc(desc, result, 1), "cuDevResourceGenerateDesc")
        green = ffi.new("CUgreenCtx *")
        primary = self._primary_context.handle
        cuda.check(
            drv.cuGreenCtxCreate(green, desc[0], primary, drv.CU_GREEN_CTX_DEFAULT_STREAM),
            "cuGreenCtxCreate",
        )
        part = _Partition(got, None, green=green[0])
        try:
            context = ffi.new("CUcontext *")
            cuda.check(drv.cuCtxFromGreenCtx(context, part.green), "cuCtxFromGreenCtx")
            part.context = context[0]
            stream = ffi.new("CUstream *")
            cuda.check(
                drv.cuGreenCtxStreamCreate(
                    stream, part.green, drv.CU_STREAM_NON_BLOCKING, self._priority
                ),
                "cuGreenCtxStreamCreate",
            )
            part.stream = stream[0]
            self._bind_blas(part)
        except BaseException:
            self._unbind(part)
            _warn(drv.cuGreenCtxDestroy(part.green), "cuGreenCtxDestroy")
            raise
        self._partitions[got] = part
        return got

    def activate(self, sm_count: int) -> None:
        part = self._partitions[sm_count]
        cuda.check(self._drv.cuCtxSetCurrent(part.context), "cuCtxSetCurrent")
        self._active = part

    def run_plan(self, plan: GemmPlan, *, repeat: int = 1) -> None:
        """Run a plan on the active partition: upload, GEMM, download, all on its stream.

        ``repeat`` > 1 runs the GEMM that many times between the copies, so benchmarks
        can take the device time apart from the transfers; it needs ``beta == 0``.
        """
        part = self._active
        if part is None:
            raise RuntimeError("run_plan before activate")
        if repeat < 1 or (repeat > 1 and plan.beta != 0.0):
            raise ValueError(f"repeat={repeat}: must be >= 1, and 1 when beta != 0")
        a_bytes, b_bytes, c_bytes = _spans(plan)
        if not c_bytes:
            return
        drv, ffi = self._drv, cuda.ffi
        da, db, dc = self._scratch_for(a_bytes, b_bytes, c_bytes)
        stream = part.stream
        # C goes up too unless every byte of its span is overwritten: rows with gaps
        # (ldc > n) must come back as they were.
        c_dense = plan.ldc == plan.n and (plan.batch == 1 or plan.stride_c == plan.m * plan.n)
        uploads = [(da, plan.a, a_bytes), (db, plan.b, b_bytes)]
        if plan.beta != 0.0 or not c_dense:
            uploads.append((dc, plan.c, c_bytes))
        for device_ptr, host, nbytes in uploads:
            if nbytes:
                host_ptr = ffi.cast("void *", _address(host))
                cuda.check(
                    drv.cuMemcpyHtoDAsync_v2(device_ptr, host_ptr, nbytes, stream),
                    "cuMemcpyHtoDAsync",
                )
        self._gemms(part, plan, da, db, dc, repeat)
        cuda.check(
            drv.cuMemcpyDtoHAsync_v2(ffi.cast("void *", _address(plan.c)), dc, c_bytes, stream),
            "cuMemcpyDtoHAsync",
        )
        cuda.check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def _gemms(
        self, part: _Partition, plan: GemmPlan, da: int, db: int, dc: int, repeat: int
    ) -> None:
        """cuBLAS is column-major: the row-major C = op(A) op(B) is computed as
        C^T = op(B)^T op(A)^T, with the operands swapped (as ``cublasxt.c`` does)."""
        ffi = cuda.ffi
        ctype, item = ("float", 4) if plan.dtype == 0 else ("double", 8)
        gemm = self._blas.cublasSgemm_v2 if plan.dtype == 0 else self._blas.cublasDgemm_v2
        alpha = ffi.new(f"{ctype} *", plan.alpha)
        beta = ffi.new(f"{ctype} *", plan.beta)
        pointer = f"{ctype} *"
        for _ in range(repeat):
            for pivot in range(plan.batch):
                a = ffi.cast(pointer, da + pivot * plan.stride_a * item)
                b = ffi.cast(pointer, db + pivot * plan.stride_b * item)
                c = ffi.cast(pointer, dc + pivot * plan.stride_c * item)
                rc = gemm(
                    part.handle,
                    plan.trans_b,
                    plan.trans_a,
                    plan.n,
                    plan.m,
                    plan.k,
                    alpha,
                    b,
                    plan.ldb,
                    a,
                    plan.lda,
                    beta,
                    c,
                    plan.ldc,
                )
                if rc != 0:
                    raise check_failure(100 + rc, plan)

    def _scratch_for(self, *sizes: int) -> tuple[int, ...]:
        """Device buffers of at least ``sizes`` bytes, grown in MiB steps and kept.

        Made in the primary context, whose memory every green context of the device
        shares; nothing is in flight here, since each run ends with a synchronize.
        """
        drv = self._drv
        for i, need in enumerate(sizes):
            pointer, have = self._scratch[i]
            if need <= have:
                continue
            size = -(-need // (1 << 20)) << 20
            fresh = cuda.ffi.new("CUdeviceptr *")
            with self._primary_context.current():
                if pointer:
                    self._scratch[i] = (0, 0)
                    cuda.check(drv.cuMemFree_v2(pointer), "cuMemFree")
                cuda.check(drv.cuMemAlloc_v2(fresh, size), "cuMemAlloc")
            self._scratch[i] = (int(fresh[0]), size)
        return tuple(pointer for pointer, _ in self._scratch)

    def _unbind(self, part: _Partition) -> None:
        """Destroy a partition's handle (with its context current), then its stream."""
        drv = self._drv
        if part.stream is not None:
            _warn(drv.cuStreamSynchronize(part.stream), "cuStreamSynchronize")
        if part.handle is not None:
            with self._primary_context.current(part.context):
                rc = self._blas.cublasDestroy_v2(part.handle)
            if rc != 0:
                log.warning("cublasDestroy: cuBLAS status %d", rc)
            part.handle = None
        if part.stream is not None:
            _warn(drv.cuStreamDestroy_v2(part.stream), "cuStreamDestroy")
            part.stream = None

    def close(self) -> None:
        """Tear down in the order of the module docstring; safe to call twice."""
        primary = self._primary
        if primary is None:
            return
        drv = self._drv
        parts = list(self._partitions.values())
        for part in parts:
            self._unbind(part)
        with primary.current():
            for pointer, _ in self._scratch:
                if pointer:
                    _warn(drv.cuMemFree_v2(pointer), "cuMemFree")
        self._scratch = [(0, 0), (0, 0), (0, 0)]
        for part in parts:
            if part.green is not None:
                _warn(drv.cuGreenCtxDestroy(part.green), "cuGreenCtxDestroy")
        self._partitions.clear()
        self._active = None
        # No destroyed context may stay current on this thread (upstream's exit crash).
        _warn(drv.cuCtxSetCurrent(cuda.ffi.NULL), "cuCtxSetCurrent")
        self._primary = None
        primary.release()


def _warn(code: int, call: str) -> None:
    """Teardown goes on past a failed step, so that the rest is still released."""
    if code != 0:
        log.warning("%s: %s", call, cuda.error_name(code))

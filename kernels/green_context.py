"""Green contexts: a GPU throttled to an SM count that follows a trace, by step or wall time.

A virtual GPU device of the fleet can be slowed the way a shared or power-capped GPU
is, by running its GEMMs on a partition of the SMs. The parts:

- ``GreenTrace`` parses the ``# greenctx_trace v2`` format (errors name the line and the
  problem) and looks the SM count up as a step function of a step index or of the
  elapsed time since the first GEMM.
- ``GreenContextController`` decides before each GEMM which partition it runs on,
  switches only when that changes, counts switches and their cost, and has an off
  switch (``disable()``, or ``MORPHLING_NO_GREEN_CTX=1`` in the environment).
- ``CudaGreenContexts`` is the CUDA driver backend behind the small ``SmPartitions``
  interface the controller drives; tests on hosts without a GPU drive the controller
  through another implementation of that interface.

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
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from . import cuda
from ._cffi_src.cuda_driver import GREEN_CONTEXT_SYMBOLS
from ._native import ffi as native_ffi
from ._native import lib as native_lib
from .cublasxt import _cublas_candidates
from .layout import GemmPlan, check_failure

log = logging.getLogger(__name__)

TIME_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}  # microseconds per unit
CLOCK_MODES = ("step", "wall")
BACKENDS = ("auto", "cuda", "off")
MIN_DRIVER = 12050
OFF_ENV = "MORPHLING_NO_GREEN_CTX"
_VERSION_LINE = "# greenctx_trace v2"
_DIRECTIVES = {"time_unit": tuple(TIME_UNITS), "semantics": ("step_function",)}
_DIRECTIVE = re.compile(r"([A-Za-z_]\w*)\s*=\s*(\S*)")
_COLUMNS = ("timestamp", "num_sms", "tag")


class TraceError(ValueError):
    """A trace that does not follow the format; the message names the line and the problem."""


@dataclass(frozen=True, slots=True)
class TracePoint:
    timestamp: float  # in the trace's time unit, or a step index
    num_sms: int
    tag: str
    line: int


@dataclass(frozen=True, slots=True)
class GreenTrace:
    """SM count as a step function: each point holds until the next one's timestamp."""

    points: tuple[TracePoint, ...]
    time_unit: str = "us"
    source: str = "<trace>"

    @classmethod
    def load(cls, path: str | Path) -> GreenTrace:
        return cls.parse(Path(path).read_text(), source=str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<trace>") -> GreenTrace:
        """Parse and validate a ``# greenctx_trace v2`` trace; ``TraceError`` on any fault."""
        versioned = False
        directives: dict[str, str] = {}
        points: list[TracePoint] = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            where = f"{source}, line {number}"
            if not line:
                continue
            if not versioned:
                if " ".join(line.lstrip("#").split()) != _VERSION_LINE.lstrip("# "):
                    raise TraceError(f"{where}: expected {_VERSION_LINE!r} first, got {line!r}")
                versioned = True
            elif line.startswith("#"):
                _directive(line, where, directives, bool(points))
            elif tuple(f.strip() for f in line.split(",")) in (_COLUMNS, _COLUMNS[:2]):
                if points:
                    raise TraceError(f"{where}: column header after data lines")
            else:
                points.append(_point(line, number, where, points))
        if not versioned:
            raise TraceError(f"{source}: empty; expected {_VERSION_LINE!r}, then data lines")
        if not points:
            raise TraceError(f"{source}: no data lines (timestamp,num_sms,tag)")
        return cls(tuple(points), directives.get("time_unit", "us"), source)

    def at_step(self, step: int) -> TracePoint:
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        return self._at(step)

    def at_us(self, elapsed_us: float) -> TracePoint:
        """The point in force ``elapsed_us`` microseconds after the start."""
        return self._at(elapsed_us / TIME_UNITS[self.time_unit])

    def _at(self, t: float) -> TracePoint:
        return self.points[max(0, bisect_right(self.points, t, key=_timestamp) - 1)]

    def check_steps(self) -> None:
        """In ``clock_mode="step"`` timestamps are step indices: they must be whole numbers."""
        for p in self.points:
            if p.timestamp != int(p.timestamp):
                raise TraceError(
                    f"{self.source}, line {p.line}: timestamp {p.timestamp:g} is not a whole "
                    "step index (clock_mode=step)"
                )


def _timestamp(point: TracePoint) -> float:
    return point.timestamp


def _directive(line: str, where: str, seen: dict[str, str], after_data: bool) -> None:
    """Record a ``# key=value`` line in ``seen``; other ``#`` lines are comments."""
    match = _DIRECTIVE.fullmatch(line[1:].strip())
    if match is None:
        return
    key, value = match.groups()
    if key not in _DIRECTIVES:
        known = ", ".join(sorted(_DIRECTIVES))
        raise TraceError(f"{where}: unknown directive {key!r} (known: {known})")
    if after_data:
        raise TraceError(f"{where}: directive {key!r} after data lines; put it before them")
    if key in seen:
        raise TraceError(f"{where}: {key} given twice")
    if value not in _DIRECTIVES[key]:
        allowed = "|".join(_DIRECTIVES[key])
        raise TraceError(f"{where}: {key}={value!r} is not one of {allowed}")
    seen[key] = value


def _point(line: str, number: int, where: str, before: list[TracePoint]) -> TracePoint:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) not in (2, 3):
        raise TraceError(f"{where}: expected timestamp,num_sms,tag; got {len(fields)} fields")
    try:
        timestamp = float(fields[0])
    except ValueError:
        raise TraceError(f"{where}: timestamp {fields[0]!r} is not a number") from None
    if not math.isfinite(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: timestamp {fields[0]} must be a finite number >= 0")
    try:
        num_sms = int(fields[1])
    except ValueError:
        raise TraceError(f"{where}: num_sms {fields[1]!r} is not an integer") from None
    if num_sms < 1:
        raise TraceError(f"{where}: num_sms {num_sms} must be >= 1")
    if not before and timestamp != 0:
        raise TraceError(
            f"{where}: the first timestamp is {fields[0]}; it must be 0, so that the SM count "
            "is defined from the start"
        )
    if before and timestamp <= before[-1].timestamp:
        prev = before[-1]
        raise TraceError(
            f"{where}: timestamp {fields[0]} does not come after {prev.timestamp:g} "
            f"(line {prev.line}); timestamps must increase"
        )
    return TracePoint(timestamp, num_sms, fields[2] if len(fields) == 3 else "", number)


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


@dataclass(frozen=True, slots=True)
class GreenContextConfig:
    """How a GPU worker uses green contexts (upstream's ``GreenContextConfig``).

    ``backend``: ``auto`` runs without green contexts where they are unavailable (and
    says why), ``cuda`` requires them, ``off`` never uses them. ``strict`` makes ``auto``
    require them too. ``clock_mode``: the trace's timestamps are step indices (``step``,
    advanced with ``GreenContextController.set_step``) or times since the first GEMM
    (``wall``).
    """

    enabled: bool = False
    backend: str = "auto"
    trace_path: str | None = None
    clock_mode: str = "step"
    strict: bool = False
    device: int = 0
    stream_priority: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.clock_mode not in CLOCK_MODES:
            raise ValueError(
                f"clock_mode={self.clock_mode!r}: expected one of {', '.join(CLOCK_MODES)}"
            )
        if self.enabled and not self.trace_path:
            raise ValueError("enabled=True needs trace_path")
        if self.device < 0:
            raise ValueError(f"device={self.device}: must be >= 0")


@dataclass(frozen=True, slots=True)
class SwitchStats:
    """What the controller did: its state, and the partition switches and their cost."""

    status: str  # "available", or why green contexts are off
    enabled: bool
    active_sms: int | None  # SMs of the partition now current (None before the first GEMM)
    switch_count: int
    total_overhead_us: float
    max_overhead_us: float
    gemms_by_sms: dict[int, int]


class SmPartitions(Protocol):
    """SM partitions of one GPU, as the controller drives them (``CudaGreenContexts``)."""

    total_sms: int
    min_sms: int
    sm_multiple: int

    def prepare(self, sm_count: int) -> int:
        """Create the partition for a valid count; the SMs it really has."""
        ...

    def activate(self, sm_count: int) -> None:
        """Make a prepared partition (``total_sms``: the whole device) current on this thread."""
        ...

    def run_plan(self, plan: GemmPlan) -> None: ...

    def close(self) -> None: ...


class GreenContextController:
    """Before each GEMM, the partition for the current step or wall time.

    The partitions for every count in the trace are made up front, so a switch swaps
    contexts and never creates one. ``disable()`` is the off switch: from the next GEMM
    on, the whole device and no further switches. With no partitions (no GPU) it only
    reports. Use it from the thread that runs the GEMMs (see the module docstring);
    ``set_step``, ``disable`` and ``stats`` may come from any thread.
    """

    def __init__(
        self,
        trace: GreenTrace | None,
        partitions: SmPartitions | None,
        *,
        clock_mode: str = "step",
        status: str = "available",
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if clock_mode not in CLOCK_MODES:
            raise ValueError(f"clock_mode={clock_mode!r}: expected one of {', '.join(CLOCK_MODES)}")
        if trace is not None and clock_mode == "step":
            trace.check_steps()
        self.trace = trace
        self.partitions = partitions
        self.clock_mode = clock_mode
        self._status = "off: no trace" if trace is None and status == "available" else status
        self._enabled = partitions is not None and trace is not None and status == "available"
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self._step = 0
        self._epoch_ns: int | None = None
        self._active: int | None = None
        self._switches = 0
        self._overhead_ns = 0
        self._max_overhead_ns = 0
        self._gemms: dict[int, int] = {}
        self._sms_for: dict[int, int] = {}  # a count the trace names -> its partition's SMs
        if self._enabled:
            try:
                self._prepare_all()
            except BaseException:
                partitions.close()
                raise

    def _prepare_all(self) -> None:
        parts = self.partitions
        made: dict[int, int] = {}  # valid count -> the SMs its partition got
        for requested in sorted({p.num_sms for p in self.trace.points}):
            valid = round_sm_count(requested, parts.total_sms, parts.min_sms, parts.sm_multiple)
            if valid not in made:
                made[valid] = valid if valid == parts.total_sms else parts.prepare(valid)
            got = self._sms_for[requested] = made[valid]
            if got != requested:
                log.info("green contexts: the trace's %d SMs run on %d", requested, got)

    @classmethod
    def from_config(cls, config: GreenContextConfig) -> GreenContextController:
        """The controller a GPU worker uses: green contexts where ``config`` asks for them
        and the driver has them, else the whole device, with the reason in ``stats()``."""
        trace = GreenTrace.load(config.trace_path) if config.trace_path else None
        if not config.enabled or config.backend == "off":
            status = "off: disabled in the configuration"
        else:
            status = green_context_status()
            if status != "available":
                # The environment's off switch is a choice, never an error.
                if status.startswith("unavailable") and (config.strict or config.backend == "cuda"):
                    raise RuntimeError(f"green contexts {status}")
                log.warning("green contexts %s", status)
        partitions = None
        if cuda.cuda_status() == "available":
            partitions = CudaGreenContexts(
                config.device,
                green=status == "available",
                stream_priority=config.stream_priority,
            )
        return cls(trace, partitions, clock_mode=config.clock_mode, status=status)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_step(self, step: int) -> None:
        """The training step the next GEMMs belong to (``clock_mode="step"``)."""
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        self._step = step

    def activate(self) -> int | None:
        """Switch to the partition for now; its SM count (``None``: no GPU to switch)."""
        with self._lock:
            parts = self.partitions
            if parts is None:
                return None
            sms = self._sms_for[self._point_now().num_sms] if self._enabled else parts.total_sms
            if sms != self._active:
                start = self._clock_ns()
                parts.activate(sms)
                cost = self._clock_ns() - start
                self._active = sms
                self._switches += 1
                self._overhead_ns += cost
                self._max_overhead_ns = max(self._max_overhead_ns, cost)
            self._gemms[sms] = self._gemms.get(sms, 0) + 1
            return sms

    def _point_now(self) -> TracePoint:
        if self.clock_mode == "step":
            return self.trace.at_step(self._step)
        now = self._clock_ns()
        if self._epoch_ns is None:  # wall time counts from the first GEMM
            self._epoch_ns = now
        return self.trace.at_us((now - self._epoch_ns) / 1e3)

    def run_plan(self, plan: GemmPlan) -> None:
        """Run a GEMM on the partition for now."""
        if self.activate() is None:
            raise RuntimeError(f"no GPU to run GEMMs on (green contexts {self._status})")
        self.partitions.run_plan(plan)

    def disable(self, reason: str = "disabled") -> None:
        """The off switch: the whole device from the next GEMM on, and no more switching."""
        with self._lock:
            self._enabled = False
            self._status = f"off: {reason}"

    def stats(self) -> SwitchStats:
        with self._lock:
            return SwitchStats(
                status=self._status,
                enabled=self._enabled,
                active_sms=self._active,
                switch_count=self._switches,
                total_overhead_us=self._overhead_ns / 1e3,
                max_overhead_us=self._max_overhead_ns / 1e3,
                gemms_by_sms=dict(self._gemms),
            )

    def close(self) -> None:
        """Tear the partitions down (on the thread that ran the GEMMs)."""
        self.disable("closed")
        parts, self.partitions = self.partitions, None
        if parts is not None:
            parts.close()


# -- the CUDA backend ----------------------------------------------------------

_blas_lock = threading.Lock()
_blas: Any = None
_blas_error: str | None = None


def cublas_library() -> Any:
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


def _address(cdata: Any) -> int:
    """The address behind a pointer of the compiled extension, for the ABI-mode calls."""
    return int(native_ffi.cast("uintptr_t", cdata))


def _spans(plan: GemmPlan) -> tuple[int, int, int]:
    """Bytes of A, B and C the GEMM reads or writes, after the checks the compiled
    executors make in ``gemm_check.c`` (not callable from Python), with the same errors."""
    p = plan
    if p.dtype not in (0, 1):
        raise check_failure(native_lib.MG_GEMM_EDTYPE, p)
    if min(p.m, p.n, p.k, p.batch) < 0:
        raise check_failure(native_lib.MG_GEMM_EDIMS, p)
    item = 4 if p.dtype == 0 else 8
    a_rows, a_cols = (p.k, p.m) if p.trans_a else (p.m, p.k)
    b_rows, b_cols = (p.n, p.k) if p.trans_b else (p.k, p.n)
    operands = (
        (
            native_lib.MG_GEMM_ELDA,
            native_lib.MG_GEMM_EA,
            a_rows,
            a_cols,
            p.lda,
            p.stride_a,
            p.a_len,
        ),
        (
            native_lib.MG_GEMM_ELDB,
            native_lib.MG_GEMM_EB,
            b_rows,
            b_cols,
            p.ldb,
            p.stride_b,
            p.b_len,
        ),
        (native_lib.MG_GEMM_ELDC, native_lib.MG_GEMM_EC, p.m, p.n, p.ldc, p.stride_c, p.c_len),
    )
    spans = []
    for ld_code, code, rows, cols, ld, stride, length in operands:
        if ld < max(1, cols):
            raise check_failure(ld_code, p)
        if stride < 0:
            raise check_failure(code, p)
        empty = (
            rows == 0 or cols == 0 or p.batch == 0 or (code != native_lib.MG_GEMM_EC and not p.k)
        )
        span = 0 if empty else ((p.batch - 1) * stride + (rows - 1) * ld + cols) * item
        if span > length:
            raise check_failure(code, p)
        spans.append(span)
    stacked = p.stride_c >= (p.m - 1) * p.ldc + p.n
    interleaved = p.n <= p.stride_c and (p.batch - 1) * p.stride_c + p.n <= p.ldc
    if p.batch > 1 and p.m and p.n and not (stacked or interleaved):
        raise check_failure(native_lib.MG_GEMM_EOVERLAP, p)
    return spans[0], spans[1], spans[2]


@dataclass(slots=True)
class _Partition:
    sm_count: int
    context: Any  # CUcontext: the primary context, or the green context's
    green: Any = None  # CUgreenCtx; None for the whole device
    stream: Any = None
    handle: Any = None  # cublasHandle_t bound to ``stream``


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
        self._sm_resource: Any = None
        # Retained before any green context exists, as the driver documentation advises,
        # so creating and destroying those does not initialise the device over again.
        self._primary: cuda.PrimaryContext | None = cuda.PrimaryContext(device)
        try:
            whole = _Partition(self.total_sms, self._primary.context)
            self._partitions[self.total_sms] = whole
            stream = cuda.ffi.new("CUstream *")
            with self._primary.current():
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
                        self._primary.handle, resource, self._drv.CU_DEV_RESOURCE_TYPE_SM
                    ),
                    "cuDeviceGetDevResource",
                )
                self._sm_resource = resource
        except BaseException:
            self.close()
            raise

    def _bind_blas(self, part: _Partition) -> None:
        """A cuBLAS handle made in the partition's context and bound to its stream."""
        handle = cuda.ffi.new("cublasHandle_t *")
        with self._primary.current(part.context):
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
        cuda.check(
            drv.cuGreenCtxCreate(
                green, desc[0], self._primary.handle, drv.CU_GREEN_CTX_DEFAULT_STREAM
            ),
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
                rc = gemm(
                    part.handle, plan.trans_b, plan.trans_a, plan.n, plan.m, plan.k, alpha,
                    ffi.cast(pointer, db + pivot * plan.stride_b * item), plan.ldb,
                    ffi.cast(pointer, da + pivot * plan.stride_a * item), plan.lda, beta,
                    ffi.cast(pointer, dc + pivot * plan.stride_c * item), plan.ldc,
                )  # fmt: skip
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
            with self._primary.current():
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
            with self._primary.current(part.context):
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

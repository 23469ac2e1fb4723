"""Which SM partition each GEMM of a green-context GPU runs on, and what switching cost.

Before each GEMM the controller looks the SM count up in the trace (by step or by wall
time), switches partitions only when that changes, and counts the switches and their cost.
It has an off switch (``disable()``, or ``MORPHLING_NO_GREEN_CTX=1`` in the environment).
It drives the partitions through the small ``SmPartitions`` interface: ``CudaGreenContexts``
on a GPU; tests on hosts without one drive it through another implementation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .. import cuda
from ..layout import GemmPlan
from .cuda_partitions import CudaGreenContexts, green_context_status, round_sm_count
from .trace import GreenTrace, TracePoint

log = logging.getLogger(__name__)

CLOCK_MODES = ("step", "wall")
BACKENDS = ("auto", "cuda", "off")


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
    reports. Use it from the thread that runs the GEMMs (the thread rule in
    ``cuda_partitions``); ``set_step``, ``disable`` and ``stats`` may come from any thread.
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
        if self._enabled and trace is not None and partitions is not None:
            try:
                self._prepare_all(trace, partitions)
            except BaseException:
                partitions.close()
                raise

    def _prepare_all(self, trace: GreenTrace, parts: SmPartitions) -> None:
        made: dict[int, int] = {}  # valid count -> the SMs its partition got
        for requested in sorted({p.num_sms for p in trace.points}):
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
            trace = self.trace
            if self._enabled and trace is not None:  # (enabled implies a trace)
                sms = self._sms_for[self._point_now(trace).num_sms]
            else:
                sms = parts.total_sms
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

    def _point_now(self, trace: GreenTrace) -> TracePoint:
        if self.clock_mode == "step":
            return trace.at_step(self._step)
        now = self._clock_ns()
        if self._epoch_ns is None:  # wall time counts from the first GEMM
            self._epoch_ns = now
        return trace.at_us((now - self._epoch_ns) / 1e3)

    def run_plan(self, plan: GemmPlan) -> None:
        """Run a GEMM on the partition for now."""
        if self.activate() is None or (parts := self.partitions) is None:
            raise RuntimeError(f"no GPU to run GEMMs on (green contexts {self._status})")
        parts.run_plan(plan)

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

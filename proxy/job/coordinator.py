"""Coordinator time: what the script does on the host between two fleet GEMMs.

The virtual timeline needs it between every pair of GEMMs. ``measured`` takes
the host's wall time (times ``scale``, for a host faster or slower than the
coordinator being studied) from the moment a fleet GEMM's result is back in
the script to the moment its next GEMM reaches the interceptor: Morphling's
own work on a GEMM (checking it, sending it, waiting, turning the result
into a tensor) is left out, local GEMMs are in. Faithful, but it changes
with the host's load.
``model`` counts the work instead — aten operations run locally, the bytes
they write, the FLOPs of GEMMs kept local — and prices it with a
``CoordinatorModel``, so the same script gives the same timeline on any host,
however busy.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("measured", "model")


@dataclass
class HostWork:
    """Local work counted since the last fleet GEMM."""

    ops: int = 0
    bytes: int = 0
    flops: int = 0

    def take(self) -> HostWork:
        """The counts so far, and start again from zero."""
        taken = HostWork(self.ops, self.bytes, self.flops)
        self.ops = self.bytes = self.flops = 0
        return taken


@dataclass(frozen=True)
class CoordinatorModel:
    """Seconds for local work: a fixed cost per operation (eager dispatch), bytes
    written at a memory bandwidth, local GEMM FLOPs at a compute rate.

    The defaults are round figures for one core of a current x86 host running
    eager PyTorch (a few µs of dispatch per op, a few GB/s for elementwise
    kernels that read and write): our assumption, to be replaced by figures
    measured on the coordinator under study.
    """

    op_s: float = 5e-6
    bytes_per_s: float = 4e9
    flops: float = 50e9

    def __post_init__(self) -> None:
        for name in ("op_s", "bytes_per_s", "flops"):
            value = getattr(self, name)
            if not value >= 0 or (name != "op_s" and not value > 0):
                raise ValueError(f"coordinator model {name}={value!r}: must be positive")

    def seconds(self, work: HostWork) -> float:
        return work.ops * self.op_s + work.bytes / self.bytes_per_s + work.flops / self.flops

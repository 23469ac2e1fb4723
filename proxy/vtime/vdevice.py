"""One device as the virtual clock sees it: its FIFOs, its models, its memory.

A ``VirtualDevice`` is the emulated board, not the process that computes its
tiles: a downlink FIFO (latency + bytes / bandwidth), a compute FIFO whose
durations come from the profile's compute model at the thermal state's
frequency, an uplink FIFO, and the emulated memory that decides which
weight blocks are resident (their bytes do not travel again) and which
tiles do not fit (an emulated out-of-memory event).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from morphling.devices.models.compute import ComputeModel, GemmShape
from morphling.devices.models.conv_shape import ConvShape
from morphling.devices.models.profiles import DeviceProfile
from morphling.devices.models.thermal import ThermalParams, ThermalState

from .engine import Fifo, Span
from .memory import DeviceMemory

Compute = GemmShape | ConvShape  # what a tile computes: a GEMM, or a convolution's product


@dataclass(frozen=True, slots=True)
class Work:
    """What one tile asks of a device: bytes each way and what it computes, and the
    operand bytes it held already, which its link did not carry (``bytes_saved``)."""

    bytes_down: int
    bytes_up: int
    shape: Compute
    bytes_saved: int = 0


class VirtualDevice:
    """The emulated state of device ``id``; see the module docstring. ``convolutions``:
    it computes convolution tiles (its agent said so, HELLO ``caps.conv``)."""

    def __init__(
        self, id: int, name: str, profile: DeviceProfile, *, convolutions: bool = True
    ) -> None:
        self.id = id
        self.name = name
        self.profile = profile
        self.convolutions = convolutions
        self.compute_model = (
            ComputeModel.from_dict(profile.compute)
            if profile.compute
            else ComputeModel.analytic(profile.flops)
        )
        self.conv_model = profile.conv_model()
        thermal = profile.thermal
        self.thermal = ThermalState(ThermalParams.from_dict(thermal)) if thermal else None
        self.down, self.compute, self.up = Fifo(), Fifo(), Fifo()
        self.memory = DeviceMemory(profile.memory_bytes)
        self._returns: deque[float] = deque()  # when its tiles come back, in order
        self._nominal: dict[Compute, float] = {}
        self._last: tuple[Compute | None, float] = (None, 0.0)  # the last shape asked
        # its next absence (the timeline's availability): when it leaves, and is back
        self.leaves_at = self.back_at = math.inf

    def nominal_s(self, shape: Compute) -> float:
        """Seconds for ``shape`` at the top frequency (cached: a GEMM repeats few shapes).

        Tiles come in runs that share one shape object, so that is checked first, by
        identity: cheaper than hashing the shape."""
        last = self._last
        if last[0] is shape:
            return last[1]
        seconds = self._nominal.get(shape)
        if seconds is None:
            if len(self._nominal) > 4096:
                self._nominal.clear()
            seconds = self._nominal[shape] = (
                self.compute_model.predict_s(shape)
                if isinstance(shape, GemmShape)
                else self.conv_model.predict_s(shape)
            )
        self._last = (shape, seconds)
        return seconds

    def speed(self) -> float:
        """The current frequency as a fraction of the top one (1 without a thermal model)."""
        return 1.0 if self.thermal is None else self.thermal.speed

    def download_s(self, nbytes: int) -> float:
        return self.profile.download_s(nbytes) if nbytes else 0.0

    def upload_s(self, nbytes: int) -> float:
        return self.profile.upload_s(nbytes)

    def predict_finish(self, now: float, work: Work) -> float:
        """When ``work`` placed now would be back, behind everything placed before it."""
        down = max(now, self.down.free_at) + self.download_s(work.bytes_down)
        comp = max(down, self.compute.free_at) + self.nominal_s(work.shape) / self.speed()
        return max(comp, self.up.free_at) + self.upload_s(work.bytes_up)

    def outstanding(self, now: float) -> int:
        """Tiles placed on it and not back by ``now``."""
        returns = self._returns
        while returns and returns[0] <= now:
            returns.popleft()
        return len(returns)

    def compute_after(
        self, arrival: float, shape: Compute
    ) -> tuple[Span, float | None, float | None]:
        """Queue ``shape`` on the compute FIFO once its operands arrive: (start, end), and
        the MHz and °C it starts at (None without a thermal model, which it heats)."""
        nominal = self.nominal_s(shape)
        if self.thermal is None:
            return self.compute.serve(arrival, nominal), None, None
        duration, freq, temp, _ = self.thermal.run(max(arrival, self.compute.free_at), nominal)
        return self.compute.serve(arrival, duration), freq, temp

    def returns_at(self, when: float) -> None:
        """A tile placed on it comes back at ``when`` (no earlier than the last one)."""
        self._returns.append(when)

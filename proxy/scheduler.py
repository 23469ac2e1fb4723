"""Which device computes which tile, with a per-device window.

Policies (``POLICIES``): ``round-robin`` cycles through ready devices from
where it last stopped; ``load-balanced`` picks the fewest tiles in flight;
``greedy`` picks the earliest predicted finish — the device's predicted
backlog plus the tile's download, compute and upload under the device's
model — and, when that device's window is full, holds the tile for it rather
than giving it to a worse one. Ties go to the lowest device id, so a decision
depends only on the scheduler's state, never on which socket answered first.

A device takes at most ``window`` tiles at once and none while its send
buffer is above the high-water mark, so a slow device never makes the
server buffer without bound. Across all devices, at most ``inflight_bytes``
of tile operands are out at once (a single tile always may go): a window
per device alone would let a fleet of a thousand virtual devices in one
process hold a thousand windows of operands.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from .partition import GemmTask, TileTask
from .registry import DeviceRecord, Registry

log = logging.getLogger(__name__)

POLICIES = ("round-robin", "greedy", "load-balanced")


def operand_bytes(tile: TileTask) -> int:
    """The bytes of the operand blocks a tile needs (op(A)'s rows, op(B)'s columns)."""
    rows, cols = tile.shape
    return (rows + cols) * tile.gemm.request.k * tile.gemm.out.itemsize


def predicted_cost_s(device: DeviceRecord, tile: TileTask) -> float:
    """The plain analytic model: operands down, 2·m·n·k of compute, the tile up."""
    rows, cols = tile.shape
    g = tile.gemm.request
    item = tile.gemm.out.itemsize
    model = device.model
    return (
        model.download_s(operand_bytes(tile))
        + model.compute_s(rows, cols, g.k)
        + model.upload_s(rows * cols * item)
    )


class Scheduler:
    """Queues tiles and hands them to devices through ``send(device, tile)``."""

    def __init__(
        self,
        registry: Registry,
        send: Callable[[DeviceRecord, TileTask], None],
        *,
        policy: str = "greedy",
        window: int = 4,
        inflight_bytes: int = 64 << 20,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1")
        self.registry = registry
        self.policy = policy
        self.window = window
        self.max_inflight_bytes = inflight_bytes
        self.inflight_bytes = 0
        self._send = send
        self.queue: deque[TileTask] = deque()
        self._cursor = -1  # round-robin: the id of the device served last

    def submit(self, tiles: Iterable[TileTask]) -> None:
        self.queue.extend(tiles)
        self.dispatch()

    def requeue(self, device: DeviceRecord) -> list[TileTask]:
        """Put a lost device's tiles back at the front of the queue, in their order."""
        held = [device.give_back(tile_id) for tile_id in list(device.outstanding)]
        self.inflight_bytes -= sum(operand_bytes(t) for t in held)
        tiles = [t for t in held if not t.gemm.cancelled]
        for tile in tiles:
            tile.gemm.requeued += 1
        self.queue.extendleft(reversed(tiles))
        return tiles

    def cancel(self, gemm: GemmTask) -> None:
        gemm.cancelled = True
        self.queue = deque(t for t in self.queue if t.gemm is not gemm)

    def finished(self, device: DeviceRecord, tile_id: int) -> TileTask | None:
        """The device returned ``tile_id``: the task, or None when it was not expected."""
        predicted_s = device.predicted_s.get(tile_id, 0.0)
        tile = device.give_back(tile_id)
        if tile is not None:
            self.inflight_bytes -= operand_bytes(tile)
            device.completed += 1
            busy = tile.gemm.device_s
            busy[device.id] = busy.get(device.id, 0.0) + predicted_s
        return tile

    def dispatch(self) -> None:
        """Assign queued tiles while some device may take one."""
        ready = self.registry.ready()
        if not ready:
            return
        while self.queue:
            tile = self.queue[0]
            if tile.gemm.cancelled:
                self.queue.popleft()
                continue
            nbytes = operand_bytes(tile)
            if self.inflight_bytes and self.inflight_bytes + nbytes > self.max_inflight_bytes:
                return  # results coming back will dispatch again
            device = self._choose(ready, tile)
            if device is None:
                return
            self.queue.popleft()
            self.inflight_bytes += nbytes
            tile.attempts += 1
            device.take(tile, predicted_cost_s(device, tile))
            tile.gemm.devices.add(device.id)
            self._send(device, tile)

    def _choose(self, ready: list[DeviceRecord], tile: TileTask) -> DeviceRecord | None:
        if self.policy == "greedy":
            best = min(ready, key=lambda d: (d.backlog_s + predicted_cost_s(d, tile), d.id))
            return best if best.can_take(self.window) else None
        open_ = [d for d in ready if d.can_take(self.window)]
        if not open_:
            return None
        if self.policy == "load-balanced":
            return min(open_, key=lambda d: (len(d.outstanding), d.id))
        after = [d for d in open_ if d.id > self._cursor]
        device = after[0] if after else open_[0]
        self._cursor = device.id
        return device

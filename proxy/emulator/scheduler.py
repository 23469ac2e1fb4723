"""Sending placed tiles to their devices, with flow control.

Which device computes a tile is decided in virtual time (``placement``,
through the ``Timeline``); this module only moves the real tiles: a queue
per device, in placement order, drained while the device has room.

A device takes at most ``window`` tiles at once and none while its send
buffer is above the high-water mark, so a slow device never makes the
server buffer without bound. Across all devices, at most ``inflight_bytes``
of tile operands are on the wire at once (a single tile always may go): a
window per device alone would let a fleet of a thousand virtual devices in
one process hold a thousand windows of operands. Operands a device reads
from its own mapping (the operand arena, shared weights) or already holds
cost nothing there, so they do not count: counting them would let one tile
with a long K (a 256-row block of a 50,000-wide matrix is 50 MiB) hold the
whole fleet to one tile at a time.

A device that leaves has its queued and outstanding tiles sent to the
device with the least work waiting (ties: lowest id), as bytes: the virtual
timeline keeps them where they were placed, and the log says they moved. A
convolution's tile goes only to a device that computes them (``DeviceRecord.conv``),
and waits while none is ready. A tile sent ``MAX_TILE_ATTEMPTS`` times that failed
each time (its device lost while holding it, or its result unusable) is one the
devices cannot compute (a broken build, a kernel that brings them down): its request
is dropped and its job told why (``give_up_on``), rather than the tile going round a
fleet that reconnects for ever.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from morphling.proxy.vtime.memory import Admission
from morphling.proxy.wire.messages import ConvTile, Tile

from .conv_partition import AnyTile
from .registry import DeviceRecord, Placed, Registry
from .task import Task

log = logging.getLogger(__name__)

MAX_TILE_ATTEMPTS = 3


class TileMessages(Protocol):
    """What makes a tile's TILE for the device it goes to (``tiles.TileMessages``)."""

    def message(
        self, device: DeviceRecord, tile: AnyTile, admission: Admission | None
    ) -> Tile | ConvTile:
        """The TILE (a CONV_TILE); what the device reads from its mappings goes by reference."""
        ...


class Scheduler:
    """Per-device queues; ``messages`` makes each tile's TILE for its device, which the
    scheduler sends on the device's connection once the flow control lets it."""

    def __init__(
        self,
        registry: Registry,
        messages: TileMessages,
        *,
        window: int = 4,
        inflight_bytes: int = 64 << 20,
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1")
        self.registry = registry
        self.messages = messages
        self.window = window
        self.max_inflight_bytes = inflight_bytes
        self.inflight_bytes = 0
        # since the start, for operators (``status``): tiles and their bytes on the wire
        self.tiles_sent = self.bytes_sent = self.tiles_returned = self.bytes_returned = 0
        self.orphans: deque[Placed] = deque()  # moved tiles waiting for any device
        self._waiting: dict[int, DeviceRecord] = {}  # devices with queued tiles

    @property
    def queued(self) -> int:
        """Tiles placed and not yet sent."""
        return len(self.orphans) + sum(len(d.queue) for d in self._waiting.values())

    def submit(self, placed: list[tuple[AnyTile, int, Admission]]) -> None:
        """Queue tiles on the devices they were placed on."""
        devices = self.registry.devices
        for tile, device_id, admission in placed:
            device = devices.get(device_id)
            if device is None:  # it left since: like any tile of a lost device
                self.orphans.append((tile, None))
            else:
                device.queue.append((tile, admission))
                self._waiting[device.id] = device
        self.dispatch()

    def requeue(self, device: DeviceRecord) -> list[AnyTile]:
        """Move a lost device's tiles, outstanding first, to the other devices."""
        held = list(device.outstanding.values())
        device.outstanding.clear()
        self.inflight_bytes -= sum(t.wire_bytes for t in held)
        moved = [t for t in held + [t for t, _ in device.queue] if not t.gemm.cancelled]
        device.queue.clear()
        self._waiting.pop(device.id, None)
        for tile in moved:
            tile.gemm.requeued += 1
        self.orphans.extend((t, None) for t in moved)
        return moved

    def retry(self, tile: AnyTile) -> None:
        """Send ``tile`` again, before anything else, to any device: the result its device
        sent was unusable (and that device is being dropped)."""
        tile.gemm.requeued += 1
        self.orphans.appendleft((tile, None))

    def give_up_on(self, tile: AnyTile, device: DeviceRecord, why: str) -> bool:
        """Whether ``tile``, whose attempt on ``device`` just failed (``why``: how that
        device ended, or what was wrong with its result), has failed every one of
        ``MAX_TILE_ATTEMPTS`` sends: then its request is cancelled and its job told."""
        if tile.attempts < MAX_TILE_ATTEMPTS:
            return False
        task = tile.gemm
        if task.owner is not None and not task.cancelled:  # (not told already)
            self.cancel(task)
            task.owner.give_up(
                f"{type(task.request).__name__.upper()} {task.id}: tile {tile.id} was sent "
                f"{tile.attempts} times and failed each time; the last device, "
                f"{device.id} ({device.name}), ended with: {why}"
            )
        return True

    def resend(self, device: DeviceRecord, tile_id: int, why: str) -> None:
        """``device`` lacks an operand ``tile_id`` named by reference (``why``: which; it
        was evicted, or the device restarted): send the tile again, first, with every
        operand as bytes, kept nowhere."""
        tile = device.give_back(tile_id)
        if tile is None:
            return
        self.inflight_bytes -= tile.wire_bytes
        if tile.gemm.cancelled:
            return
        tile.attempts -= 1  # (the send did not fail)
        tile.gemm.resent += 1
        log.info("device %d: %s; tile %d goes again with its bytes", device.id, why, tile_id)
        device.queue.appendleft((tile, None))
        self._waiting[device.id] = device
        self.dispatch()

    def drop_panels(self, device_id: int, panels: list[int]) -> None:
        """The emulated memory of ``device_id`` let ``panels`` go (a step's sweep): the
        device may drop them, with its next tile (one placed before and still queued that
        reads one is answered TILE_MISSING, and goes again with its bytes: ``resend``)."""
        device = self.registry.devices.get(device_id)
        if device is not None:
            device.drop_panels.extend(panels)

    def cancel(self, gemm: Task) -> None:
        """Drop the tiles of a GEMM whose job is gone (those out come back ignored)."""
        gemm.cancelled = True
        self.orphans = deque(p for p in self.orphans if p[0].gemm is not gemm)
        for device in list(self._waiting.values()):
            device.queue = deque(p for p in device.queue if p[0].gemm is not gemm)
            if not device.queue:
                del self._waiting[device.id]

    def finished(self, device: DeviceRecord, tile_id: int) -> AnyTile | None:
        """The device returned ``tile_id``: the task, or None when it was not expected."""
        tile = device.give_back(tile_id)
        if tile is not None:
            self.inflight_bytes -= tile.wire_bytes
            self.tiles_returned += 1
            device.completed += 1
        return tile

    def dispatch(self) -> None:
        """Send queued tiles while their devices have room."""
        if self.orphans:
            self._adopt()
        for device in list(self._waiting.values()):
            if not self._drain(device):
                return  # the byte budget is spent: results coming back dispatch again

    def _adopt(self) -> None:
        ready = self.registry.ready()
        if not ready:
            return
        able = [d for d in ready if d.conv]  # for a convolution's tiles
        left: deque[Placed] = deque()  # those no device ready can take
        while self.orphans:
            tile, _ = self.orphans.popleft()
            devices = ready if tile.conv is None else able
            if not devices:
                left.append((tile, None))
                continue
            device = min(devices, key=lambda d: (len(d.queue) + len(d.outstanding), d.id))
            log.debug("tile %d of request %d moves to device %d", tile.id, tile.gemm.id, device.id)
            device.queue.append((tile, None))
            self._waiting[device.id] = device
        self.orphans = left

    def _drain(self, device: DeviceRecord) -> bool:
        """Send from ``device``'s queue while it may take more; False when the global
        byte budget stopped it."""
        queue = device.queue
        while queue and device.can_take(self.window):
            tile, admission = queue[0]
            if tile.gemm.cancelled:
                queue.popleft()
                continue
            message = self.messages.message(device, tile, admission)
            nbytes = sum(segment.nbytes for segment in message.segments)
            spent = self.inflight_bytes
            if nbytes and spent and spent + nbytes > self.max_inflight_bytes:
                return False  # (a tile built is sent: one handed over as arrays is offered)
            queue.popleft()
            self.inflight_bytes += nbytes
            self.tiles_sent += 1
            self.bytes_sent += nbytes
            tile.wire_bytes = nbytes
            tile.attempts += 1
            device.take(tile)
            tile.gemm.devices.add(device.id)
            tile.gemm.bytes_down += nbytes
            # the panels it may forget: those its memory evicted for this tile, and those
            # swept since its last tile (``drop_panels``)
            evicted = admission.evicted_panels if admission is not None else ()
            message.drop_panels = [*device.drop_panels, *evicted]
            device.drop_panels = []
            device.conn.send(message)
        if not queue:
            self._waiting.pop(device.id, None)
        return True

"""A placed tile becomes a TILE for its device; its TILE_RESULT goes back into its GEMM.

Each operand block goes to the device the cheapest way it can take it (its
``Location``): a device that maps the operand arena reads blocks that lie there,
and writes C there when the GEMM's output does; one that maps the shared weights
reads weight blocks from its mapping; one whose emulated memory holds the block (a
weight block at its current version, or a panel, the same bytes sent before by any
request) gets only its reference, and one whose memory holds a block around it (a
column block of a matrix it was sent whole) gets that block's reference and where the
tile's lies in it; a device in the emulator's own process is handed the arrays
(``local``). Anything else goes as bytes, with the weight's reference or the panel's
id when the device is to keep them (its emulated memory admitted them). The
TILE_RESULT must then carry C as its TILE asked (``operands.check_tile_result``).
Which panels a device may drop (evicted, or swept at a step's end) goes with the next
tile it is sent: the scheduler's (``Scheduler._drain``), since a TILE built may wait and
be built again.

A convolution's tile becomes a CONV_TILE: its operands go contiguous as bytes, as
panels the same way, or are handed over as views in the emulator's process with the
view of the output it writes (``local``); C comes back in TILE_RESULT, or is written
there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from morphling.proxy.shm import handover as local
from morphling.proxy.shm.arena import OperandArena
from morphling.proxy.vtime.memory import Admission
from morphling.proxy.wire.errors import RemoteProtocolError
from morphling.proxy.wire.messages import ConvTile, Tile, TileResult
from morphling.proxy.wire.operands import (
    HANDED,
    IN_FRAME,
    Location,
    OperandError,
    Place,
    check_tile_result,
    in_arena,
    in_frame,
    in_weights,
    kept,
    tile_fields,
)

from .conv_partition import AnyTile, ConvTileTask
from .partition import Block, GemmTask, TileTask
from .registry import DeviceRecord
from .task import Task
from .verify import Verifier, device_key

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)


class Sent(NamedTuple):
    """How one operand block goes: the bytes in the TILE (none when not in the frame),
    their leading dimension, and where the device finds the block."""

    bytes: np.ndarray
    ld: int
    at: Location


class TileMessages:
    """Builds each tile's TILE for the device it goes to; see the module docstring."""

    def __init__(self, token: str) -> None:
        self.token = token  # the emulator's, for arrays handed over (``local``)
        self.arena: OperandArena | None = None  # the emulator's, once it made it

    def message(
        self, device: DeviceRecord, tile: AnyTile, admission: Admission | None
    ) -> Tile | ConvTile:
        """``tile``'s TILE (a convolution's: CONV_TILE) for ``device``; ``admission`` is the
        device's emulated memory's say (from the timeline), None for a tile moved off a lost
        device: all bytes but what the device maps. Notes on the tile where C goes
        (``TileTask.c_at``)."""
        if isinstance(tile, ConvTileTask):
            return self._conv_tile(device, tile, admission)
        task = tile.gemm
        drop = list(admission.evicted) if admission is not None and not device.colocated else []
        a, b = tile.operands()
        if task.writers is not None and device.local:
            self._hand_over(device, tile, task.writers)
            sent_a, sent_b = Sent(a.span[:0], a.ld, HANDED), Sent(b.span[:0], b.ld, HANDED)
            return self._tile(tile, sent_a, sent_b, HANDED, drop)
        out = self._out_offset(device, task)
        c_at = IN_FRAME if out is None else in_arena(out + tile.out_start * task.out.itemsize)
        sent_a, sent_b = (self._block(device, task, x, admission) for x in (a, b))
        return self._tile(tile, sent_a, sent_b, c_at, drop)

    def _tile(
        self, tile: TileTask, a: Sent, b: Sent, c_at: Location, drop: list[list[int]]
    ) -> Tile:
        task, g = tile.gemm, tile.gemm.request
        rows, cols = tile.shape
        tile.c_at = c_at
        return Tile(
            tile=tile.id,
            dtype=g.dtype,
            ta=g.ta,
            tb=g.tb,
            m=rows,
            n=cols,
            k=g.k,
            lda=a.ld,
            ldb=b.ld,
            drop=drop,
            ldc=task.out.shape[2] if c_at.in_place else 0,
            **tile_fields(a.at, b.at, c_at),
            segments=(a.bytes, b.bytes),
        )

    def _block(
        self, device: DeviceRecord, task: GemmTask, block: Block, admission: Admission | None
    ) -> Sent:
        """How ``block`` goes to ``device``."""
        at = self.arena.offset_of(block.span) if self.arena is not None and device.arena else None
        if at is not None:  # it reads the span from its mapping of the arena
            return Sent(block.span[:0], block.ld, in_arena(at))
        if block.offset is not None and device.colocated:  # from its mapping of the weights
            return Sent(block.span[:0], block.ld, in_weights(block.ref))
        inner = admission.within if admission is not None else None
        inside = inner.get(block.key) if inner else None
        if inside is not None:  # it holds the block within one it kept
            if device.panels < 2:  # it reads no block within another: bytes, kept nowhere
                return Sent(*task.packed(block), IN_FRAME)
            container, within, ld = inside
            if isinstance(container, int):
                return Sent(block.span[:0], ld, kept(container, within))
            return Sent(block.span[:0], ld, in_weights((*container, block.version), within))
        if block.offset is None:
            where = _panel(device, block.panel, admission)
            if where.place is Place.KEPT:
                return Sent(block.span[:0], block.sent_ld, where)
            return Sent(*task.packed(block), where)
        if admission is None:
            return Sent(*task.packed(block), IN_FRAME)
        if block.key in admission.held:  # it holds the bytes sent before
            return Sent(block.span[:0], block.sent_ld, in_weights(block.ref))
        # bytes, to be kept under the ref if they fit
        return Sent(*task.packed(block), in_frame(block.ref) if admission.fits else IN_FRAME)

    def _out_offset(self, device: DeviceRecord, task: GemmTask) -> int | None:
        """Where in the operand arena ``device`` finds ``task``'s output, or None."""
        if self.arena is None or not device.arena:
            return None
        return self.arena.offset_of(task.out)

    def _hand_over(self, device: DeviceRecord, tile: TileTask, writers: local.Writers) -> None:
        """Offer ``device``, in this process, the tile's blocks and its span of C."""
        a, b = tile.operands()
        rows, cols = tile.shape
        out = tile.gemm.out
        n, start = out.shape[2], tile.out_start
        c = out.reshape(-1)[start : start + (rows - 1) * n + cols if rows and cols else start]
        offered = local.TileOperands(a.span, b.span, c, writers)
        local.offer_tile((self.token, device.id, tile.id), offered)

    def _conv_tile(
        self, device: DeviceRecord, tile: ConvTileTask, admission: Admission | None
    ) -> ConvTile:
        """A convolution tile's CONV_TILE: its operands handed over with the view of C it
        writes (the job's own output, to a device in this process), or as panels: bytes,
        or the id of one the device kept."""
        task, c = tile.gemm, tile.gemm.request
        writers = task.writers
        panels = [0, 0]
        if writers is not None and device.local:
            offered = local.TileOperands(tile.a, tile.b, task.out[tile.out_index], writers)
            local.offer_tile((self.token, device.id, tile.id), offered)
            tile.c_at, segments = HANDED, (tile.a[:0], tile.b[:0])
        else:
            sent = []
            for i, operand in enumerate(tile.operands()):
                where = _panel(device, operand.panel, admission)
                panels[i] = where.panel
                held = where.place is Place.KEPT
                sent.append(operand.array[:0] if held else operand.contiguous)
            tile.c_at, segments = IN_FRAME, (sent[0], sent[1])
        geom = task.geometry
        return ConvTile(
            tile=tile.id,
            kind=c.kind,
            dtype=c.dtype,
            a_shape=list(tile.a.shape),
            b_shape=list(tile.b.shape),
            kernel=list(geom.kernel),
            stride=list(geom.stride),
            dilation=list(geom.dilation),
            padding=list(tile.padding),
            groups=tile.groups,
            input_size=list(task.input_shape[2:]) if c.kind == "grad_input" else [],
            oh_lo=tile.oh_lo,
            rows=list(tile.rows) if c.kind == "grad_input" else [],
            local=tile.c_at is HANDED,
            panel_a=panels[0],
            panel_b=panels[1],
            segments=segments,
        )


def _panel(device: DeviceRecord, panel: int, admission: Admission | None) -> Location:
    """How panel ``panel`` goes to ``device``: by its id where the device's emulated memory
    holds it, else as bytes, kept under its id where the memory took it in. A tile moved
    off a lost device (no ``admission``), or for a device that keeps no panels (its HELLO
    did not say ``caps.panels``), goes as bytes, kept nowhere."""
    if admission is None or not device.panels:
        return IN_FRAME
    if panel in admission.held:
        return kept(panel)
    if panel not in admission.kept:  # it did not fit, or residency is off
        return IN_FRAME
    return in_frame(panel=panel)


def take_result(
    scheduler: Scheduler, verifier: Verifier, device: DeviceRecord, msg: TileResult
) -> None:
    """A device's TILE_RESULT: its C into the request's output (unless written in place),
    and the job answered once every tile is in and checked (``verify``). A result that is
    not what its TILE asked for is a protocol error, and a wrong one quarantines its device:
    either way the device is dropped and the tile sent to another (or given up,
    ``Scheduler.give_up_on``)."""
    tile = scheduler.finished(device, msg.tile)
    if tile is None:
        why = "not expected (late or duplicate); ignored"
        log.debug("device %d: result for tile %d %s", device.id, msg.tile, why)
    elif not tile.gemm.cancelled:
        task = tile.gemm
        try:
            check_tile_result(msg, tile.c_at, tile.shape, task.out.itemsize)
        except OperandError as exc:
            raise _refused(scheduler, tile, device, str(exc), "bad_result") from None
        segment = msg.segments[0]
        task.bytes_up += segment.nbytes
        scheduler.bytes_returned += segment.nbytes
        values = None if tile.c_at.in_place else np.frombuffer(segment, dtype=task.out.dtype)
        if task.put(tile, values):  # (a duplicate is not)
            verifier.check(tile, device)
            if task.remaining == 0:
                settle(scheduler, verifier, task)
    scheduler.dispatch()


def settle(scheduler: Scheduler, verifier: Verifier, task: Task) -> None:
    """Every tile of ``task`` is in: the job is answered unless some are wrong, which are
    taken back and computed again; each device that sent them is quarantined once, with
    the evidence of its first, and dropped."""
    if task.writers is not None and task.writers.count:  # a lost device's kernel still writes
        task.writers.then(lambda: settle(scheduler, verifier, task))
        return
    by_device: dict[DeviceRecord, list[tuple[AnyTile, str]]] = {}
    for tile, device, why in verifier.settle(task):
        task.take_back(tile)
        by_device.setdefault(device, []).append((tile, why))
    for device, wrong in by_device.items():
        (first, why), more = wrong[0], len(wrong) - 1
        if more:
            why += f" (and {more} more of its tiles of request {task.id})"
        error = _wrong(scheduler, verifier, first, device, why)
        for other, evidence in wrong[1:]:
            _refused(scheduler, other, device, f"tile {other.id} is wrong: {evidence}",
                     "wrong_result")  # fmt: skip
        if device.conn.open:
            device.conn.fail(error.code, error.reason)
    if task.remaining == 0 and task.owner is not None and not task.cancelled:
        task.owner.finish(task)
    scheduler.dispatch()  # the tiles taken back


def _wrong(
    scheduler: Scheduler, verifier: Verifier, tile: AnyTile, device: DeviceRecord, why: str
) -> RemoteProtocolError:
    """``device``'s result for ``tile`` is wrong (``why``): the error that drops it, made
    once the tile is sent to another device or given up. The first time, it is quarantined,
    and so is any device of its name on its host that joined since (the GEMM that found it
    out may have been settled after it reconnected)."""
    if not device.quarantined:
        device.quarantined = True
        key = device_key(device.name, device.conn.peername)
        verifier.quarantine(device.id, key, tile.gemm.id, tile.id, why)
        for other in list(scheduler.registry.devices.values()):
            if other is not device and device_key(other.name, other.conn.peername) == key:
                other.quarantined = True
                other.conn.fail("quarantined", verifier.refused(key))
    return _refused(scheduler, tile, device, f"tile {tile.id} is wrong: {why}", "wrong_result")


def _refused(
    scheduler: Scheduler, tile: AnyTile, device: DeviceRecord, why: str, code: str
) -> RemoteProtocolError:
    """The error that drops ``device``, whose result for ``tile`` is refused (``why``),
    once the tile is sent to another device or given up."""
    given_up = scheduler.give_up_on(tile, device, f"{code}: {why}")
    if not given_up:
        scheduler.retry(tile)
    then = "" if given_up else " (the tile goes to another device)"
    return RemoteProtocolError(f"{why}{then}", code)

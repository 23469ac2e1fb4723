"""The devices the emulator knows: server-assigned ids, profiles, tiles in flight."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from morphling.devices.models.profiles import DeviceProfile
from morphling.proxy.vtime.memory import Admission
from morphling.proxy.wire.messages import Message

from .conv_partition import AnyTile

Placed = tuple[AnyTile, Admission | None]  # None: moved off its device, send as bytes


class TileLink(Protocol):
    """A device's connection, as far as sending it tiles goes."""

    writable: bool  # its send buffer is below the high-water mark
    peername: str  # host:port

    @property
    def open(self) -> bool: ...

    def send(self, msg: Message) -> None: ...

    def fail(self, code: str, reason: str) -> None: ...


@dataclass(eq=False)
class DeviceRecord:
    """A registered device. ``model`` is the profile its virtual twin runs on; ``queue``
    holds the tiles placed on it and not yet sent (with their memory admission)."""

    id: int
    name: str
    declared: DeviceProfile
    conn: TileLink
    virtual: bool
    model: DeviceProfile
    ready: bool = False
    outstanding: dict[int, AnyTile] = field(default_factory=dict)
    queue: deque[Placed] = field(default_factory=deque)
    drop_panels: list[int] = field(default_factory=list)  # for its next tile to say
    completed: int = 0
    colocated: bool = False  # maps the emulator's shared weights (same host)
    arena: bool = False  # maps the emulator's operand arena (same host)
    local: bool = False  # runs in the emulator's process: takes tiles as arrays (``local``)
    conv: bool = False  # computes convolution tiles (HELLO ``caps.conv``)
    # ``caps.panels``: 1, it keeps panels sent to keep until told to drop them; 2, it also
    # reads a block within a panel or weight block it keeps (``within_*``)
    panels: int = 0
    # what its probes measured (``status``): latency_s, dl_bw, ul_bw, flops; empty: none
    probed: dict[str, float] = field(default_factory=dict)
    quarantined: bool = False  # a tile of it was wrong: it is being dropped

    def take(self, tile: AnyTile) -> None:
        self.outstanding[tile.id] = tile

    def give_back(self, tile_id: int) -> AnyTile | None:
        """The tile it no longer holds, or None when it did not hold ``tile_id``."""
        return self.outstanding.pop(tile_id, None)

    def can_take(self, window: int) -> bool:
        return (
            self.ready and self.conn.open and self.conn.writable and len(self.outstanding) < window
        )


class Registry:
    """Devices by id; ids are 0, 1, 2, ... in registration order and never reused."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.devices: dict[int, DeviceRecord] = {}

    def add(
        self,
        name: str,
        declared: DeviceProfile,
        conn: TileLink,
        *,
        virtual: bool,
        colocated: bool,
        arena: bool = False,
        local: bool = False,
        conv: bool = False,
        panels: int = 0,
    ) -> DeviceRecord:
        record = DeviceRecord(
            next(self._ids),
            name,
            declared,
            conn,
            virtual,
            declared,
            colocated=colocated,
            arena=arena,
            local=local,
            conv=conv,
            panels=panels,
        )
        self.devices[record.id] = record
        return record

    def reserve(self) -> int:
        """An id for a device the timeline times without an agent (a replayed rank's)."""
        return next(self._ids)

    def remove(self, device_id: int) -> DeviceRecord | None:
        return self.devices.pop(device_id, None)

    def ready(self, conv: bool = False) -> list[DeviceRecord]:
        """Devices that may be given tiles (one being closed may not: its tiles go back);
        ``conv``: convolution tiles."""
        devices = self.devices.values()
        return [d for d in devices if d.ready and d.conn.open and (d.conv or not conv)]

"""The devices the emulator knows: server-assigned ids, profiles, tiles in flight."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..devices.profiles import DeviceProfile
from .memory import DeviceMemory
from .partition import TileTask


@dataclass(eq=False)
class DeviceRecord:
    """A registered device. ``model`` is the profile the scheduler plans with."""

    id: int
    name: str
    declared: DeviceProfile
    conn: Any
    virtual: bool
    model: DeviceProfile
    ready: bool = False
    outstanding: dict[int, TileTask] = field(default_factory=dict)
    predicted_s: dict[int, float] = field(default_factory=dict)
    backlog_s: float = 0.0  # the sum of predicted_s: the greedy policy's clock
    completed: int = 0
    colocated: bool = False  # maps the emulator's shared weights (same host)
    memory: DeviceMemory = field(init=False)

    def __post_init__(self) -> None:
        self.memory = DeviceMemory(self.declared.memory_bytes)

    def take(self, tile: TileTask, predicted_s: float) -> None:
        self.outstanding[tile.id] = tile
        self.predicted_s[tile.id] = predicted_s
        self.backlog_s += predicted_s

    def give_back(self, tile_id: int) -> TileTask | None:
        """The tile it no longer holds, or None when it did not hold ``tile_id``."""
        self.backlog_s -= self.predicted_s.pop(tile_id, 0.0)
        if not self.predicted_s:
            self.backlog_s = 0.0  # no drift from float sums once idle
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
        self, name: str, declared: DeviceProfile, conn: Any, *, virtual: bool, colocated: bool
    ) -> DeviceRecord:
        record = DeviceRecord(
            next(self._ids), name, declared, conn, virtual, model=declared, colocated=colocated
        )
        self.devices[record.id] = record
        return record

    def remove(self, device_id: int) -> DeviceRecord | None:
        return self.devices.pop(device_id, None)

    def ready(self) -> list[DeviceRecord]:
        return [d for d in self.devices.values() if d.ready]

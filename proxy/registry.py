"""The devices the emulator knows: server-assigned ids, profiles, tiles in flight."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..devices.profiles import DeviceProfile
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
    completed: int = 0

    @property
    def backlog_s(self) -> float:
        """Predicted time to finish the tiles it holds (the greedy policy's clock)."""
        return sum(self.predicted_s.values())

    def can_take(self, window: int) -> bool:
        return (
            self.ready and self.conn.open and self.conn.writable and len(self.outstanding) < window
        )


class Registry:
    """Devices by id; ids are 0, 1, 2, ... in registration order and never reused."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.devices: dict[int, DeviceRecord] = {}

    def add(self, name: str, declared: DeviceProfile, conn: Any, *, virtual: bool) -> DeviceRecord:
        record = DeviceRecord(next(self._ids), name, declared, conn, virtual, model=declared)
        self.devices[record.id] = record
        return record

    def remove(self, device_id: int) -> DeviceRecord | None:
        return self.devices.pop(device_id, None)

    def ready(self) -> list[DeviceRecord]:
        return [d for d in self.devices.values() if d.ready]

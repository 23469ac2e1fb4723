"""Which virtual device computes which tile: the scheduling policies.

A policy reads virtual-time state only (FIFO free times, tiles outstanding in
virtual time, the device models), never which socket answered first, so the
same script on the same fleet places every tile the same way on every run.
Ties go to the lowest device id.

- ``round-robin`` cycles through the devices from where it last stopped;
- ``load-balanced`` picks the fewest tiles outstanding;
- ``greedy`` picks the earliest predicted finish: the device's downlink,
  compute and uplink queues (everything placed on it so far) plus this
  tile's transfer and compute under the device's models at its current
  frequency. The prediction counts every operand byte; weight blocks
  already resident make the real transfer shorter, never longer.
"""

from __future__ import annotations

import bisect

import numpy as np

from .vdevice import VirtualDevice, Work

POLICIES = ("round-robin", "greedy", "load-balanced")


class Placement:
    """A policy over the fleet's devices, kept ordered by id.

    Greedy evaluates every device for every tile, so it works on arrays: each
    device's FIFO free times and link figures, and its compute time for the
    tile's shape from one device per distinct profile. They are rebuilt when the
    fleet has changed, at the next placement: a fleet of a thousand joining
    devices costs one rebuild, not a thousand.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.devices: list[VirtualDevice] = []
        self._ids: list[int] = []
        self._kinds: dict[int, str] = {}  # device id → its profile, as a grouping key
        self._stale = True
        self._cursor = -1  # round-robin: the id of the device served last

    def add(self, device: VirtualDevice) -> None:
        index = bisect.bisect(self._ids, device.id)
        self._ids.insert(index, device.id)
        self.devices.insert(index, device)
        self._kinds[device.id] = repr(device.profile)
        self._stale = True

    def remove(self, device_id: int) -> None:
        """No more tiles for it (what it has placed stays placed)."""
        if self._kinds.pop(device_id, None) is not None:
            index = self._ids.index(device_id)
            del self._ids[index], self.devices[index]
            self._stale = True

    def _rebuild(self) -> None:
        devices = self.devices
        kinds: dict[str, int] = {}
        group = [kinds.setdefault(self._kinds[d.id], len(kinds)) for d in devices]
        self._group = np.array(group, dtype=np.intp)
        self._models = [devices[group.index(g)] for g in range(len(kinds))]
        profiles = [d.profile for d in devices]
        self._dl_lat = np.array([p.dl_lat_s for p in profiles])
        self._ul_lat = np.array([p.ul_lat_s for p in profiles])
        self._dl_inv = 1.0 / np.array([p.dl_bw for p in profiles])  # 0 on an ideal link
        self._ul_inv = 1.0 / np.array([p.ul_bw for p in profiles])
        self._free = np.array([[d.down.free_at, d.compute.free_at, d.up.free_at, d.speed()]
                               for d in devices]).reshape(-1, 4)  # fmt: skip
        self._stale = False

    def placed(self, index: int) -> None:
        """Device ``index`` took a tile: refresh what greedy knows of it."""
        if self.policy != "greedy":
            return
        d = self.devices[index]
        self._free[index] = (d.down.free_at, d.compute.free_at, d.up.free_at, d.speed())

    def choose(self, now: float, work: Work) -> int:
        """The index (in ``devices``, non-empty) of the device for one tile."""
        devices = self.devices
        if self._stale:
            self._rebuild()
        if self.policy == "greedy":
            return self._greedy(now, work)
        if self.policy == "load-balanced":
            counts = [d.outstanding(now) for d in devices]
            return counts.index(min(counts))
        index = bisect.bisect_right(self._ids, self._cursor) % len(devices)
        self._cursor = devices[index].id
        return index

    def _greedy(self, now: float, work: Work) -> int:
        """The earliest predicted finish; argmin keeps the first of equals (lowest id)."""
        free = self._free
        nominal = np.array([d.nominal_s(work.shape) for d in self._models])[self._group]
        down = np.maximum(free[:, 0], now)
        if work.bytes_down:
            down += self._dl_lat + work.bytes_down * self._dl_inv
        comp = np.maximum(down, free[:, 1]) + nominal / free[:, 3]
        up = np.maximum(comp, free[:, 2]) + self._ul_lat + work.bytes_up * self._ul_inv
        return int(np.argmin(up))

"""The emulator's state as an operator sees it: one snapshot for ``morphling status`` (the
STATUS message) and the Prometheus metrics (``metrics``), so the two never disagree.

Taken on the event loop, from what the emulator keeps anyway; nothing here is on a
tile's path.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
from morphling.proxy.wire.states import State

from .registry import DeviceRecord

if TYPE_CHECKING:
    from .server import Emulator

DEVICE_STATES = ("probing", "idle", "busy")


def device_state(device: DeviceRecord) -> str:
    """probing (welcomed, not yet scheduled on), idle, or busy (tiles out or queued)."""
    if not device.ready:
        return "probing"
    return "busy" if device.outstanding or device.queue else "idle"


def _device(device: DeviceRecord) -> dict[str, Any]:
    return {
        "id": device.id,
        "name": device.name,
        "peer": device.conn.peername,
        "profile": device.model.name,
        "declared": device.declared.name,
        "state": device_state(device),
        "virtual": device.virtual,
        "conv": device.conv,
        "in_flight": len(device.outstanding),
        "queued": len(device.queue),
        "completed": device.completed,
        "probe": dict(device.probed),
    }


def snapshot(emulator: Emulator) -> dict[str, Any]:
    """Everything ``morphling status`` prints and the metrics export, as plain data."""
    scheduler, timeline = emulator.scheduler, emulator.timeline
    jobs = [
        {"id": p.job.id, "name": p.job.name, "peer": p.peername, "steps": p.job.steps,
         "tiles_in_flight": p.job.tiles_in_flight}
        for p in emulator.peers
        if p.job is not None and p.open and p.wire.our_state is State.JOB
    ]  # fmt: skip
    return {
        "uptime_s": time.monotonic() - emulator.started_at,
        "verify": emulator.config.verify,
        "devices": [
            _device(d) for d in sorted(emulator.registry.devices.values(), key=lambda d: d.id)
        ],
        "jobs": sorted(jobs, key=lambda j: j["id"]),
        "quarantines": emulator.verifier.refusing(),
        "verification": dict(emulator.verifier.counts),
        "tiles": {
            "sent": scheduler.tiles_sent,
            "returned": scheduler.tiles_returned,
            "queued": scheduler.queued,
            "in_flight_bytes": scheduler.inflight_bytes,
        },
        "bytes": {"down": scheduler.bytes_sent, "up": scheduler.bytes_returned},
        "unwelcomed": emulator.gate.waiting(),
        "clock": {
            "virtual_s": timeline.clock.now,
            "held": timeline.held_time.held,
            "held_s": timeline.held_time.seconds(),
        },
    }


def packed(emulator: Emulator) -> np.ndarray:
    """The snapshot as STATUS carries it: a msgpack map, as payload bytes."""
    return np.frombuffer(msgpack.packb(snapshot(emulator), use_bin_type=True), np.uint8)

"""Every tile checked before it reaches a job; a device that sends a wrong one quarantined.

``Verifier`` decides which tiles are checked (``--verify all``, ``sample:P`` or ``off``),
checks a GEMM or convolution tile's result (``freivalds``: a screen for every tile, a
float64 recomputation for those it flags) and keeps the quarantine book: a device whose
tile was wrong is dropped with the evidence (the tile goes to another device, and nothing
of its result reaches the job), and a device of that name is refused for
``quarantine_s``, doubled at each further wrong tile, when it comes back.
"""

from __future__ import annotations

import logging
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import freivalds
from .conv_partition import AnyTile
from .partition import GemmTask, TileTask
from .settings import parse_mode
from .task import Task

log = logging.getLogger(__name__)

MAX_DOUBLINGS = 16  # a device's refusal doubles per wrong tile up to 2¹⁶ times quarantine_s


@dataclass
class Quarantine:
    """A device's wrong tile, as run.json lists it."""

    device: int
    name: str
    request: int
    tile: int
    evidence: str
    at_s: float  # seconds since the emulator started
    refused_s: float  # how long a device of that name is refused from then

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def device_key(name: str, peer: str) -> str:
    """Whom a quarantine refuses: the device's name (the registry's: its HELLO ``name``, or
    its ``peer`` address when it gave none) on its host. Stock boards share a hostname, and
    a peer's port changes at each connection, so an unnamed device is its host."""
    host = peer.rsplit(":", 1)[0] if ":" in peer else peer
    return host if name == peer else f"{name}@{host}"


class Verifier:
    """See the module docstring; ``check`` is the emulator's only question to it per tile."""

    def __init__(self, mode: str, quarantine_s: float) -> None:
        self.mode = mode
        self.fraction = parse_mode(mode)
        self.quarantine_s = quarantine_s
        # the check's weights and the samples: from a seed no device can know
        self._rng = np.random.default_rng(secrets.randbits(128))
        self._started = time.monotonic()
        self._checks: weakref.WeakKeyDictionary[Task, freivalds.RequestCheck] = (
            weakref.WeakKeyDictionary()
        )
        self.counts = {
            "checked": 0, "screened_out": 0, "wrong": 0, "sampled_out": 0, "check_errors": 0,
        }  # fmt: skip
        self.quarantines: list[Quarantine] = []
        self._refused: dict[str, tuple[float, int]] = {}  # name@host -> (until, wrong tiles)

    def check(self, tile: AnyTile, values: np.ndarray | None) -> str:
        """Empty when ``tile``'s result (``values``, or what its device wrote into the
        output when None) may reach its job, else the evidence that it is wrong. A check
        that cannot run takes the tile unchecked, logged and counted: it must not lose the
        tile or drop an honest device."""
        try:
            return self._check(tile, values)
        except Exception:
            log.exception("tile %d of request %d: its check failed; the result is taken "
                          "unchecked", tile.id, tile.gemm.id)  # fmt: skip
            self.counts["check_errors"] += 1
            return ""

    def _check(self, tile: AnyTile, values: np.ndarray | None) -> str:
        if self.fraction == 0.0:
            return ""
        if self.fraction < 1.0 and self._rng.random() >= self.fraction:
            self.counts["sampled_out"] += 1
            return ""
        task = tile.gemm
        c = task.out[tile.index] if values is None else values.reshape(tile.shape)
        if c.size == 0:
            return ""
        self.counts["checked"] += 1
        if not isinstance(tile, TileTask):
            if freivalds.screen_conv(tile, c, self._rng) is None:
                return ""
            self.counts["screened_out"] += 1
            return self._judged(freivalds.confirm_conv(tile, c))
        rows, cols = slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
        request = self._request(tile.gemm)
        if request.screen(tile.pivot, rows, cols, c) is None:
            return ""
        self.counts["screened_out"] += 1
        a, b = request.a[tile.pivot], request.b[tile.pivot]
        return self._judged(freivalds.confirm(a[rows], b[:, cols], c))

    def _judged(self, why: str) -> str:
        if why:
            self.counts["wrong"] += 1
        return why

    def _request(self, task: GemmTask) -> freivalds.RequestCheck:
        """The screen's figures for ``task``, made at its first tile checked."""
        request = self._checks.get(task)
        if request is None:
            a, b = task.op_views()
            request = self._checks[task] = freivalds.RequestCheck(a, b, task.block_edge, self._rng)
        return request

    def quarantine(self, device: int, name: str, request: int, tile: int, evidence: str) -> None:
        """``device`` (``name``) sent a wrong ``tile`` of ``request``: log it, and refuse
        a device of that name for a while (longer each time)."""
        now = time.monotonic()
        _, wrong = self._refused.get(name, (now, 0))
        refused_s = self.quarantine_s * 2 ** min(wrong, MAX_DOUBLINGS)
        self._refused[name] = (now + refused_s, wrong + 1)
        entry = Quarantine(device, name, request, tile, evidence, now - self._started, refused_s)
        self.quarantines.append(entry)
        log.error(
            "device %d (%s) quarantined: tile %d of request %d is wrong: %s; a device named "
            "%r is refused for %.0f s",
            device, name, tile, request, evidence, name, refused_s,
        )  # fmt: skip

    def refused(self, name: str) -> str:
        """Why the device ``name`` (``device_key``) may not join now, or empty when it may."""
        until, wrong = self._refused.get(name, (0.0, 0))
        left = until - time.monotonic()
        if left <= 0:
            return ""
        return (
            f"device {name!r} is quarantined for {left:.0f} s more: {wrong} of its tiles "
            "were wrong (run.json lists the evidence)"
        )

    def refusing(self) -> list[dict[str, Any]]:
        """The devices refused now: their ``device_key``, seconds left, wrong tiles."""
        now = time.monotonic()
        return [
            {"device": name, "left_s": until - now, "wrong": wrong}
            for name, (until, wrong) in self._refused.items()
            if until > now
        ]

    def summary(self) -> dict[str, Any]:
        """run.json's ``verification``."""
        return {
            "mode": self.mode,
            **self.counts,
            "quarantines": [q.to_json() for q in self.quarantines],
        }

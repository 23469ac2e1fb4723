"""Every tile checked before it reaches a job; a device that sends a wrong one quarantined.

``Verifier`` decides which tiles are checked (``--verify all``, ``sample:P`` or ``off``),
checks their results (``freivalds``: a screen for every tile, a float64 recomputation
for those it flags) and keeps the quarantine book: a device whose tile was wrong is
dropped with the evidence (the tile goes to another device, and nothing of its result
reaches the job), and a device of that name is refused for ``quarantine_s``, doubled each
further time it is caught, when it comes back. A convolution tile is judged as it comes; a
GEMM's tiles are stored and judged together once all are in (``settle``), one pass over
the request's output instead of a dozen numpy calls per tile, before its job is answered.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import freivalds
from .conv_partition import AnyTile, ConvTileTask
from .partition import GemmTask, TileTask
from .registry import DeviceRecord
from .settings import parse_mode
from .task import Task

log = logging.getLogger(__name__)

MAX_DOUBLINGS = 16  # a device's refusal doubles each time caught, up to 2¹⁶ × quarantine_s


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


class WeightPool:
    """The screens' weights, drawn ``POOL`` at a time (one generator call for many
    requests); each request takes fresh ones, never used before."""

    POOL = 1 << 18

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._left: dict[np.dtype[Any], np.ndarray] = {}

    def take(self, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        left = self._left.get(dtype)
        if left is None or len(left) < n:
            left = freivalds.weights(self._rng, max(n, self.POOL), dtype)
        self._left[dtype] = left[n:]
        return left[:n]


class Verifier:
    """See the module docstring: ``check`` for each tile, ``settle`` for each GEMM."""

    def __init__(self, mode: str, quarantine_s: float) -> None:
        self.mode = mode
        self.fraction = parse_mode(mode)
        self.quarantine_s = quarantine_s
        # the check's weights and the samples: from a seed no device can know
        self._rng = np.random.default_rng(secrets.randbits(128))
        self._started = time.monotonic()
        self._weights = WeightPool(self._rng)
        self.counts = {
            "checked": 0, "screened_out": 0, "wrong": 0, "sampled_out": 0, "check_errors": 0,
        }  # fmt: skip
        self.quarantines: list[Quarantine] = []
        self._refused: dict[str, tuple[float, int]] = {}  # name@host -> (until, times caught)

    def check(self, tile: AnyTile, values: np.ndarray | None, source: DeviceRecord) -> str:
        """Whether ``tile``'s result (``values``, or what its device, ``source``, wrote into
        the output when None) may be stored: empty, else the evidence that it is wrong. A
        convolution tile is judged now; a GEMM tile is stored and judged with the rest of
        its request (``settle``), in one pass over the request's output. A check that
        cannot run takes the tile unchecked, logged and counted: it must not lose the tile
        or drop an honest device."""
        if self.fraction == 0.0:
            return ""
        if self.fraction < 1.0 and self._rng.random() >= self.fraction:
            self.counts["sampled_out"] += 1
            return ""
        if isinstance(tile, TileTask):
            if tile.id not in tile.gemm.done:  # (a duplicate is not stored)
                tile.gemm.unchecked[tile.id] = (tile, source)
            return ""
        try:
            return self._check_conv(tile, values)
        except Exception:
            log.exception("tile %d of request %d: its check failed; the result is taken "
                          "unchecked", tile.id, tile.gemm.id)  # fmt: skip
            self.counts["check_errors"] += 1
            return ""

    def _check_conv(self, tile: ConvTileTask, values: np.ndarray | None) -> str:
        c = tile.gemm.out[tile.index] if values is None else values.reshape(tile.shape)
        if c.size == 0:
            return ""
        self.counts["checked"] += 1
        if freivalds.screen_conv(tile, c, self._weights.take) is None:
            return ""
        self.counts["screened_out"] += 1
        return self._judged(freivalds.confirm_conv(tile, c))

    def settle(self, task: Task) -> list[tuple[TileTask, DeviceRecord, str]]:
        """Every tile of ``task`` (all in) stored since it was last settled: those wrong,
        with their devices and the evidence. They are to be computed again."""
        pending, task.unchecked = task.unchecked, {}
        if not pending:
            return []
        assert isinstance(task, GemmTask)
        self.counts["checked"] += len(pending)
        try:
            a, b = task.op_views()
            edge = task.block_edge
            signs = self._weights.take(b.shape[-1], task.out.dtype)
            bad = freivalds.RequestCheck(a, b, edge, signs).screen(task.out)
            found = []
            for tile, source in pending.values():
                assert isinstance(tile, TileTask)
                p, rows, cols = tile.pivot, slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
                if not bad[p, rows, tile.c0 // edge].any():
                    continue
                self.counts["screened_out"] += 1
                why = freivalds.confirm(a[p, rows], b[p, :, cols], task.out[tile.index])
                if self._judged(why):
                    found.append((tile, source, why))
            return found
        except Exception:
            log.exception("request %d: its check failed; its %d tiles are taken unchecked",
                          task.id, len(pending))  # fmt: skip
            self.counts["check_errors"] += len(pending)
            return []

    def _judged(self, why: str) -> str:
        if why:
            self.counts["wrong"] += 1
        return why

    def quarantine(self, device: int, name: str, request: int, tile: int, evidence: str) -> None:
        """``device`` (``name``) sent a wrong ``tile`` of ``request``: log it, and refuse
        a device of that name for a while (longer each time)."""
        now = time.monotonic()
        _, caught = self._refused.get(name, (now, 0))
        refused_s = self.quarantine_s * 2 ** min(caught, MAX_DOUBLINGS)
        self._refused[name] = (now + refused_s, caught + 1)
        entry = Quarantine(device, name, request, tile, evidence, now - self._started, refused_s)
        self.quarantines.append(entry)
        log.error(
            "device %d (%s) quarantined: tile %d of request %d is wrong: %s; a device named "
            "%r is refused for %.0f s",
            device, name, tile, request, evidence, name, refused_s,
        )  # fmt: skip

    def refused(self, name: str) -> str:
        """Why the device ``name`` (``device_key``) may not join now, or empty when it may."""
        until, caught = self._refused.get(name, (0.0, 0))
        left = until - time.monotonic()
        if left <= 0:
            return ""
        return (
            f"device {name!r} is quarantined for {left:.0f} s more: its tiles were found "
            f"wrong {caught} times (run.json lists the evidence)"
        )

    def refusing(self) -> list[dict[str, Any]]:
        """The devices refused now: their ``device_key``, seconds left, and how many times
        they were caught."""
        now = time.monotonic()
        return [
            {"device": name, "left_s": until - now, "caught": caught}
            for name, (until, caught) in self._refused.items()
            if until > now
        ]

    def summary(self) -> dict[str, Any]:
        """run.json's ``verification``."""
        return {
            "mode": self.mode,
            **self.counts,
            "quarantines": [q.to_json() for q in self.quarantines],
        }

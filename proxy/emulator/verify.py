"""Every tile checked before it reaches a job; a device that sends a wrong one quarantined.

``Verifier`` decides which tiles are checked (``--verify all``, ``sample:P`` or ``off``),
checks their results (``freivalds``: a screen for every tile, a float64 recomputation
for those it flags) and keeps the quarantine book: a device whose tile was wrong is
dropped with the evidence (the tile goes to another device, and nothing of its result
reaches the job), and a device of that name is refused for ``quarantine_s``, doubled each
further time it is caught, when it comes back. A request's screen is made once, from its
operands alone, while devices compute (``prepare``); a GEMM's tiles are then judged as
they come in, each a pass over its block of the output, and a convolution's together once
all are in; the job is answered once every tile is judged and those flagged are
confirmed (``settle``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from morphling.kernels import blas_info
from threadpoolctl import ThreadpoolController

from . import freivalds
from .conv_partition import AnyTile, ConvTask, ConvTileTask
from .partition import GemmTask, TileTask
from .registry import DeviceRecord
from .settings import parse_mode
from .task import Judge, Task, TaskTile

log = logging.getLogger(__name__)

MAX_DOUBLINGS = 16  # a device's refusal doubles each time caught, up to 2¹⁶ × quarantine_s
THREAD_BYTES = 16 << 20  # a request with operands of this many bytes has its screen's
# reference made in the worker thread (``Verifier.prepare``)


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
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="morphling-verify")
        self._blas = _numpy_blas_on_one_thread() if self.fraction else None

    def check(self, tile: AnyTile, source: DeviceRecord) -> None:
        """Judge ``tile``'s result, just stored by its device ``source``, unless it is
        sampled out: now, where its request's screen is made and judges tiles as they come
        (a GEMM's: its pass over C then runs while devices compute the other tiles), else
        with the rest of its request (``settle``), which also confirms a flagged one."""
        if self.fraction == 0.0:
            return
        if self.fraction < 1.0 and self._rng.random() >= self.fraction:
            self.counts["sampled_out"] += 1
            return
        task, judge = tile.gemm, _made(tile.gemm.screen)
        flagged = None
        if judge is not None and judge.at_arrival:
            try:
                flagged = judge.fails(tile)
            except Exception:  # (judged again, and counted, by settle)
                log.debug("tile %d: its screen failed", tile.id, exc_info=True)
            else:
                self.counts["checked"] += 1
                if not flagged:
                    return
        task.unchecked[tile.id] = (tile, source, flagged)

    def prepare(self, task: Task) -> None:
        """Under ``--verify all``, start ``task``'s screen while devices compute its tiles
        (its weights drawn now, its reference made from the operands alone), so that its
        tiles are judged as they come in. The reference is made on the loop just after
        the tiles are sent, or, for operands of ``THREAD_BYTES`` or more, in a worker
        thread, while the loop serves the others: for less, a thread's handoff costs about
        what the reference does. Any failure is ``settle``'s to count."""
        if self.fraction < 1.0 or task.screen is not None:
            return
        try:
            make = self._screen(task)
            if _operand_bytes(task) >= THREAD_BYTES:
                task.screen = self._worker.submit(make)
            else:
                asyncio.get_running_loop().call_soon(self._make_soon, task, make)
        except Exception:  # (made again, and counted, by settle)
            log.debug("request %d: its screen could not start", task.id, exc_info=True)

    def _make_soon(self, task: Task, make: Callable[[], Judge]) -> None:
        """``prepare``'s reference, made on the loop unless the task was settled meanwhile."""
        if task.screen is not None or not task.remaining:
            return
        try:
            task.screen = make()
        except Exception:  # (made again, and counted, by settle)
            log.debug("request %d: its screen could not start", task.id, exc_info=True)

    def _screen(self, task: Task) -> Callable[[], Judge]:
        """``task``'s screen, its weights drawn (here, on the loop: the pool is not shared
        with the worker): the call that makes its reference and returns its judge."""
        if isinstance(task, ConvTask):
            conv = freivalds.ConvScreen(task, self._weights.take)
            return lambda: _ConvJudge(conv, conv.reference())
        assert isinstance(task, GemmTask)
        a, b = task.op_views()
        signs = self._weights.take(b.shape[-1], task.out.dtype)
        return lambda: _GemmJudge(freivalds.RequestCheck(a, b, task.out, task.block_edge, signs))

    def _judge(self, task: Task, screen: Judge | Future[Judge] | None) -> Judge:
        """``task``'s judge: the one made ahead (waited for, if the worker makes it), or
        one made now."""
        made = screen.result() if isinstance(screen, Future) else screen
        return made or self._screen(task)()

    def settle(self, task: Task) -> list[tuple[AnyTile, DeviceRecord, str]]:
        """Every tile of ``task`` (all in) stored since it was last settled and not yet
        found right: those wrong, with their devices and the evidence. They are to be
        computed again. A check that cannot run takes the tiles unchecked, logged and
        counted: it must not lose them or drop an honest device."""
        pending, task.unchecked = task.unchecked, {}
        screen, task.screen = task.screen, None  # (tiles computed again: fresh weights)
        if not pending:
            return []
        try:
            unjudged = any(flagged is None for *_, flagged in pending.values())
            judge = self._judge(task, screen) if unjudged else None
            found: list[tuple[AnyTile, DeviceRecord, str]] = []
            for tile, source, flagged in pending.values():
                assert isinstance(tile, TileTask | ConvTileTask)
                if flagged is None:
                    assert judge is not None
                    self.counts["checked"] += 1
                    flagged = judge.fails(tile)
                if not flagged:
                    continue
                self.counts["screened_out"] += 1
                why = _confirm(tile)
                if why:
                    self.counts["wrong"] += 1
                    found.append((tile, source, why))
            return found
        except Exception:
            log.exception("request %d: its check failed; its %d tiles are taken unchecked",
                          task.id, len(pending))  # fmt: skip
            self.counts["check_errors"] += len(pending)
            return []

    def close(self) -> None:
        """Stop the worker, dropping the screens not started; numpy's BLAS threads back."""
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._blas is not None:
            self._blas.restore_original_limits()
            self._blas = None

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


def _numpy_blas_on_one_thread() -> Any:
    """Hold numpy's BLAS (any BLAS loaded but the kernels' own, whose threads the device
    workers set) to one thread until the returned limiter is restored. The screens'
    products are thin (a few channels, a few columns per block): more threads gain them
    nothing, and that BLAS has one thread count for the whole process, whose idle threads
    spin after each call on the cores the devices compute on (an embedded fleet's)."""
    own = Path(blas_info().path).resolve().name
    loaded = ThreadpoolController().select(user_api="blas")
    others = [lib.filepath for lib in loaded.lib_controllers
              if Path(lib.filepath).resolve().name != own]  # fmt: skip
    return loaded.select(filepath=others).limit(limits=1)


def _operand_bytes(task: Task) -> int:
    """The bytes of ``task``'s two operands (op(A) and op(B) of each pivot, for a GEMM):
    what its screen's reference reads."""
    if isinstance(task, ConvTask):
        return int(task.a.nbytes + task.b.nbytes)
    assert isinstance(task, GemmTask)
    g = task.request
    return g.batch * g.k * (g.m + g.n) * task.out.itemsize


def _made(screen: Judge | Future[Judge] | None) -> Judge | None:
    """The judge of a request's screen, if it is made (a worker's, once done)."""
    if isinstance(screen, Future):
        return screen.result() if screen.done() and screen.exception() is None else None
    return screen


@dataclass
class _GemmJudge:
    """A GEMM's screen judges each tile as it comes in: a pass over its block of C."""

    check: freivalds.RequestCheck
    at_arrival = True

    def fails(self, tile: TaskTile) -> bool:
        assert isinstance(tile, TileTask)
        return self.check.fails(tile.pivot, slice(tile.r0, tile.r1), slice(tile.c0, tile.c1))


@dataclass
class _ConvJudge:
    """A convolution's screen judges its whole product at once, when all its tiles are in
    (``ConvScreen.flags``: one pass over the product, in chunks of images)."""

    screen: freivalds.ConvScreen
    want: np.ndarray  # its reference
    flags: np.ndarray | None = None
    at_arrival = False

    def fails(self, tile: TaskTile) -> bool:
        assert isinstance(tile, ConvTileTask)
        if self.flags is None:
            self.flags = self.screen.flags(self.want)
        return freivalds.conv_flagged(self.flags, tile)


def _confirm(tile: AnyTile) -> str:
    """The confirmation of a tile the screen flagged: why it is wrong, or empty."""
    if isinstance(tile, ConvTileTask):
        return freivalds.confirm_conv(tile, tile.gemm.out[tile.index])
    a, b = tile.gemm.op_views()
    rows, cols = slice(tile.r0, tile.r1), slice(tile.c0, tile.c1)
    return freivalds.confirm(a[tile.pivot, rows], b[tile.pivot, :, cols], tile.gemm.out[tile.index])

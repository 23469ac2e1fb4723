"""The device side of the protocol: register, answer probes, compute tiles.

A ``DeviceAgent`` is one device — a physical board (``morphling device``) or
one of many virtual ones sharing a process, a worker pool and a buffer pool
(``morphling fleet``). Tiles — a GEMM's, or a convolution's (``conv_tile``; it says
so in HELLO, ``caps.conv``) — are computed for real on the worker pool, off the
event loop, and each result reports the measured compute time and, from the
device's profile, the modelled one. ``run()`` keeps the device connected:
lost connections are retried with exponential backoff and jitter, and only
refusals that retrying cannot fix (authentication, version) end it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from morphling.kernels import BufferPool, GemmResult, WorkerPool, plan_explicit, run_plan
from morphling.proxy.net.peer import PeerProtocol
from morphling.proxy.net.protocol import pool_allocator
from morphling.proxy.shm import handover as local
from morphling.proxy.shm.arena import OperandArena
from morphling.proxy.shm.attach import attach
from morphling.proxy.shm.weights import SharedWeights
from morphling.proxy.wire import challenge, handshake
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.messages import (
    REFUSALS,
    ConvTile,
    Greeting,
    Hello,
    Message,
    ProbeFlops,
    ProbeFlopsResult,
    ProbeVerdict,
    Tile,
    TileMissing,
    TileResult,
    Welcome,
)
from morphling.proxy.wire.operands import (
    IN_FRAME,
    Location,
    Place,
    panel_operand,
    stored_shape,
    tile_locations,
)
from morphling.proxy.wire.states import Party

from . import conv_tile
from .models.profiles import DeviceProfile

log = logging.getLogger(__name__)

# Tiles this small are computed on the event loop: handing them to a worker thread
# and back costs many times their compute.
INLINE_FLOPS = 1 << 20
NO_BYTES = memoryview(b"")
# What the agent announces in HELLO ``caps`` (docs/PROTOCOL.md): the convolution tiles it
# computes (version 1), and that it keeps panels (2: and reads a block within one kept).
CONV_CAPABILITY = 1
PANELS_CAPABILITY = 2


class _Missing(Exception):
    """A tile named by reference an operand this device does not hold."""


@dataclass(frozen=True)
class Tls:
    """Client TLS, for an emulator behind an nginx that terminates it."""

    context: ssl.SSLContext
    server_name: str  # what the certificate must name


class DeviceConnection(PeerProtocol):
    """One connection of a device agent."""

    def __init__(self, agent: DeviceAgent) -> None:
        super().__init__(Connection(Party.PEER, "device", allocate=agent.allocate))
        self.agent = agent
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.weights: SharedWeights | None = None  # the emulator's, when on this host
        self.arena: OperandArena | None = None  # likewise
        self.cache: dict[tuple[int, ...], Any] = {}  # weight blocks sent by value, by ref
        self.panels: dict[int, Any] = {}  # other blocks sent to keep, by panel id
        self.emulator_token = ""  # the emulator's, when it runs in this process (``local``)

    def disconnected(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def greeted(self, greeting: Greeting) -> Hello:
        agent = self.agent
        if handshake.token_missing(greeting, agent.token):
            log.error("%s: the emulator requires a token (--token)", agent.name)
        share = agent.share_memory
        got = attach(greeting, weights=share, arena=share, in_process=share)
        self.weights, self.arena, self.emulator_token = got.weights, got.arena, got.process
        caps = {
            "virtual": agent.virtual,
            "conv": CONV_CAPABILITY,
            "panels": PANELS_CAPABILITY,
            **got.caps,
        }
        profile = agent.profile.to_wire()
        fields = {"name": agent.name, "uuid": agent.uuid, "profile": profile, "caps": caps}
        return handshake.hello(greeting, agent.token, "device", **fields)

    def welcomed(self, welcome: Welcome) -> None:
        agent = self.agent
        agent.device_id = welcome.peer_id
        agent.joined.set()
        if self.emulator_token:  # only now: a TILE may not overtake WELCOME
            self.pair_in_process()
        log.info("%s registered as device %d", agent.name, welcome.peer_id)

    def refused(self, code: str, reason: str) -> None:
        log.error("%s: emulator says %s: %s", self.agent.name, code, reason)
        self.agent.last_error = (code, reason)

    def dismissed(self, reason: str) -> None:
        log.info("%s: emulator said goodbye: %s", self.agent.name, reason)
        self.agent.dismissed = True

    def received(self, msg: Message) -> None:
        if isinstance(msg, Tile):
            self._tile(msg)
        elif isinstance(msg, ConvTile):
            self._conv_tile(msg)
        elif isinstance(msg, ProbeFlops):
            self._challenge(msg)
        elif isinstance(msg, ProbeVerdict):
            level = logging.INFO if msg.ok else logging.ERROR
            verdict = f"{'passed' if msg.ok else 'FAILED'} ({msg.flops / 1e9:.3g} GFLOP/s)"
            log.log(level, "%s: FLOPS challenge %s %s", self.agent.name, verdict, msg.reason)

    def _forget(self, msg: Tile | ConvTile) -> None:
        """What the emulator said this device may drop (processed before the operands)."""
        for panel in msg.drop_panels:
            self.panels.pop(panel, None)
        if isinstance(msg, Tile):
            for ref in msg.drop:
                self.cache.pop(tuple(ref), None)

    def _missing(self, msg: Tile | ConvTile, exc: _Missing) -> None:
        """An operand by reference this device does not hold: asked again, with its bytes."""
        name = msg.TYPE.name
        log.info("%s: %s %d: %s; asking for its bytes", self.agent.name, name, msg.tile, exc)
        self.send(TileMissing(tile=msg.tile, reason=str(exc)))

    def _tile(self, msg: Tile) -> None:
        agent = self.agent
        dtype = np.dtype(msg.dtype)
        self._forget(msg)
        handed = None
        try:
            at_a, at_b, at_c = tile_locations(msg)
            if at_c.place is Place.LOCAL:
                handed = self._taken(msg.tile)
                a, b, out = handed.a, handed.b, handed.c
            else:
                a, b = self._operand(msg, "a", at_a), self._operand(msg, "b", at_b)
                out = self._result_memory(msg, at_c, dtype)
            ldc = msg.ldc if at_c.in_place else max(1, msg.n)
            plan = plan_explicit(
                dtype, msg.ta, msg.tb, msg.m, msg.n, msg.k, a, msg.lda, b, msg.ldb, out, ldc
            )
        except _Missing as exc:
            self._missing(msg, exc)
            return
        except (KeyError, ValueError, TypeError) as exc:
            self.fail("bad_tile", f"TILE {msg.tile}: {exc}")
            return
        model_ns = int(agent.profile.compute_s(msg.m, msg.n, msg.k) * 1e9)
        if 2 * msg.m * msg.n * msg.k <= agent.inline_flops:
            start = time.perf_counter_ns()
            run_plan(plan)
            self._result(msg, at_c.in_place, time.perf_counter_ns() - start, model_ns, out)
            return
        future = agent.workers.submit_plan(plan, out, keep=(a, b))
        self._when_done(msg, future, at_c.in_place, model_ns, handed)

    def _when_done(
        self,
        msg: Tile | ConvTile,
        future: asyncio.Future[GemmResult],
        in_place: bool,
        model_ns: int,
        handed: local.TileOperands | None,
    ) -> None:
        """Answer once the tile's kernel on the worker pool is done."""
        writers = handed.writers if handed is not None else None
        if writers is not None:  # the emulator answers the job only once this kernel is done
            writers.enter()
        future.add_done_callback(lambda f: self._tile_done(msg, in_place, model_ns, f, writers))

    def _conv_tile(self, msg: ConvTile) -> None:
        """A convolution's tile: its operands from the segments, or handed over in this
        process with the view of the output it writes (``local``); the ``kernels.conv``
        call on the worker pool (inline when small), answered as a TILE's. A tile whose
        fields or operands describe no convolution is ``bad_tile``."""
        agent = self.agent
        self._forget(msg)
        handed = None
        try:
            if msg.local:
                handed = self._taken(msg.tile)
                a, b = handed.a, handed.b
            else:
                a, b = (self._conv_operand(msg, i) for i in range(2))
            product, flops = conv_tile.prepare(msg, a, b)
        except _Missing as exc:
            self._missing(msg, exc)
            return
        except ValueError as exc:
            self.fail("bad_tile", f"CONV_TILE {msg.tile}: {exc}")
            return
        out = None if handed is None else handed.c

        def compute() -> np.ndarray:
            c = product(out)  # (into the job's own output, when handed over)
            return c if out is None else c[:0]  # (then nothing goes back)

        model_ns = int(flops / agent.profile.flops * 1e9)
        if flops <= agent.inline_flops:
            start = time.perf_counter_ns()
            try:
                c = compute()
            except ValueError as exc:
                self.fail("bad_tile", f"CONV_TILE {msg.tile}: {exc}")
                return
            self._result(msg, msg.local, time.perf_counter_ns() - start, model_ns, c)
            return
        self._when_done(msg, agent.workers.submit_call(compute), msg.local, model_ns, handed)

    def _taken(self, tile: int) -> local.TileOperands:
        """The arrays the emulator in this process handed over for ``tile``."""
        assert self.agent.device_id is not None, "a tile comes after WELCOME"
        handed = local.take_tile((self.emulator_token, self.agent.device_id, tile))
        if handed is None:
            raise ValueError("local: nothing was handed over in this process")
        return handed

    def _result_memory(self, msg: Tile, at: Location, dtype: np.dtype) -> Any:
        """Where the tile's C goes: the GEMM's output in the operand arena when the
        emulator says so (``at``), else a buffer to send back."""
        if at.place is Place.FRAME:
            return self.agent.output(msg.m * msg.n * dtype.itemsize, dtype, (msg.m, msg.n))
        if self.arena is None:
            raise ValueError(f"arena_c={at.offset}, but this device maps no operand arena")
        return self.arena.block(at.offset, msg.m, msg.n, msg.ldc, msg.dtype)

    def _result(
        self, msg: Tile | ConvTile, in_place: bool, compute_ns: int, model_ns: int, out: Any
    ) -> None:
        c = NO_BYTES if in_place else out  # as received: what a paired end is handed too
        result = TileResult(
            tile=msg.tile,
            compute_ns=compute_ns,
            model_ns=model_ns,
            in_place=in_place,
            segments=(c,),
        )
        self.send(result)

    def _conv_operand(self, msg: ConvTile, index: int) -> np.ndarray:
        """Operand ``index`` of a convolution's tile: its segment (kept under its panel id,
        if it has one), or the panel kept before."""
        name, segment = "ab"[index], msg.segments[index]
        panel = msg.panel_b if index else msg.panel_a
        at = panel_operand(name, panel, segment=segment) if panel else IN_FRAME
        return conv_tile.operand(msg, index, self._held(at, segment))

    def _held(self, at: Location, segment: Any, itemsize: int = 0) -> Any:
        """An operand in the frame (``segment``, kept under its ref or panel id if it has
        one) or kept by an earlier tile (``_Missing`` if it was not), from its element
        ``at.within`` (of ``itemsize`` bytes) when it lies within what was kept."""
        if at.place is Place.KEPT:
            try:
                return _from(self.panels[at.panel], at.within, itemsize)
            except KeyError:
                raise _Missing(f"panel {at.panel} is not held") from None
        if at.ref:
            self.cache[at.ref] = segment
        if at.panel:
            self.panels[at.panel] = segment
        return segment

    def _operand(self, msg: Tile, which: str, at: Location) -> Any:
        """Operand ``which`` ("a" or "b") of a tile, where ``at`` says: its bytes (kept
        under the ref or panel id they come with), a panel kept before, the operand arena,
        or the weight block its ref names, read from the shared weights or from what was
        kept."""
        itemsize = np.dtype(msg.dtype).itemsize
        if at.place is Place.FRAME or at.place is Place.KEPT:
            return self._held(at, msg.segments[0 if which == "a" else 1], itemsize)
        tile_ld = msg.lda if which == "a" else msg.ldb
        if at.place is Place.ARENA:
            if self.arena is None:
                raise ValueError(
                    f"arena_{which}={at.offset}, but this device maps no operand arena"
                )
            return self.arena.block(at.offset, *stored_shape(msg, which), tile_ld, msg.dtype)
        if self.weights is not None:
            offset, rows, cols, ld, _ = at.ref
            if at.within != -1:  # the tile's block, inside the one the ref names
                (rows, cols), ld = stored_shape(msg, which), tile_ld
                offset += at.within * itemsize
            return self.weights.block(offset, rows, cols, ld, msg.dtype)
        try:
            return _from(self.cache[at.ref], at.within, itemsize)
        except KeyError:
            raise _Missing(f"weight reference {list(at.ref)} is neither mapped nor held") from None

    def _tile_done(
        self,
        msg: Tile | ConvTile,
        in_place: bool,
        model_ns: int,
        future: asyncio.Future[GemmResult],
        writers: local.Writers | None,
    ) -> None:
        if writers is not None:
            writers.leave()
        if future.cancelled() or not self.open:
            return
        if (exc := future.exception()) is not None:
            name = msg.TYPE.name
            if isinstance(msg, ConvTile) and isinstance(exc, ValueError):  # the kernels' checks
                self.fail("bad_tile", f"{name} {msg.tile}: {exc}")
            else:
                self.fail("compute_failed", f"{name} {msg.tile}: {exc}")
            return
        res = future.result()
        self._result(msg, in_place, res.compute_ns, model_ns, res.out)

    def _challenge(self, msg: ProbeFlops) -> None:
        challenge.check_dim(msg.dim, "PROBE_FLOPS.dim")
        self.spawn(self._answer_challenge(msg))

    async def _answer_challenge(self, msg: ProbeFlops) -> None:
        """Compute the challenge twice and report the faster run: the first pays for
        warming the kernel (thread start-up, page faults), which is not the device's speed."""
        a, b = challenge.matrices(msg.seed, msg.dim)
        runs = [await self.agent.workers.submit(a, b) for _ in range(2)]
        best = min(runs, key=lambda r: r.compute_ns)
        if self.open:
            self.send(ProbeFlopsResult(probe=msg.probe, compute_ns=best.compute_ns,
                                       segments=(best.out,)))  # fmt: skip


def _from(kept: Any, within: int, itemsize: int) -> Any:
    """The bytes ``kept`` from element ``within`` on (-1: all of them); a ``ValueError``
    past their end (the kernel checks that the operand's layout fits in what is left)."""
    if within == -1:
        return kept
    view = memoryview(kept).cast("B")
    if within * itemsize >= view.nbytes:
        raise ValueError(f"element {within} is past the {view.nbytes} bytes kept")
    return view[within * itemsize :]


def backoff_s(attempt: int, max_s: float) -> float:
    """The wait before reconnect ``attempt`` (0, 1, ...): 0.25 s doubling up to ``max_s``,
    times a random 0.5–1, so that a fleet cut off at once does not call back at once. The
    exponent stops growing long before a float would overflow (an agent may retry for
    days while its emulator is down)."""
    return min(max_s, 0.25 * 2.0 ** min(attempt, 64)) * random.uniform(0.5, 1.0)


class DeviceAgent:
    """One device; see the module docstring."""

    def __init__(
        self,
        profile: DeviceProfile,
        workers: WorkerPool,
        pool: BufferPool,
        *,
        name: str = "",
        token: str = "",
        virtual: bool = False,
        inline_flops: int = INLINE_FLOPS,
        share_memory: bool = True,
        tls: Tls | None = None,
    ) -> None:
        self.profile = profile
        self.workers = workers
        self.pool = pool
        self.name = name or profile.name
        self.token = token
        self.virtual = virtual
        self.inline_flops = inline_flops  # tiles up to this many FLOPs skip the worker pool
        self.share_memory = share_memory  # map the emulator's weights and arena on its host
        self.tls = tls
        self.uuid = uuidlib.uuid4().hex
        self.device_id: int | None = None
        self.last_error: tuple[str, str] | None = None
        self.dismissed = False  # the emulator ended the last connection with BYE
        self.connection: DeviceConnection | None = None
        self.joined = asyncio.Event()  # registered once, or gave up trying
        self._stopping = False
        self.allocate = pool_allocator(pool)

    def output(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return np.frombuffer(self.allocate(nbytes), dtype=dtype).reshape(shape)

    @property
    def registered(self) -> int:
        return int(self.device_id is not None)

    async def connect(self, host: str, port: int) -> DeviceConnection:
        loop = asyncio.get_running_loop()
        tls = self.tls
        _, conn = await loop.create_connection(
            lambda: DeviceConnection(self), host, port,
            ssl=tls.context if tls else None, server_hostname=tls.server_name if tls else None,
        )  # fmt: skip
        self.connection = conn
        return conn

    async def run(
        self,
        host: str,
        port: int,
        *,
        reconnect: bool = True,
        max_backoff_s: float = 30.0,
        gate: asyncio.Semaphore | None = None,
        after: asyncio.Event | None = None,
    ) -> int:
        """Stay connected until ``stop()`` or a fatal refusal; the exit code: 2 for a
        refusal; with ``reconnect`` off, 1 when the emulator cannot be reached or the
        connection is lost without its goodbye (BYE); else 0.

        ``gate`` bounds how many devices of a fleet connect at the same moment;
        the first connection waits for ``after`` (the previous device's ``joined``),
        so a fleet's devices get their ids in its order.
        """
        try:
            return await self._run(host, port, reconnect, max_backoff_s, gate, after)
        finally:
            self.joined.set()

    async def _run(
        self, host: str, port: int, reconnect: bool, max_backoff_s: float,
        gate: asyncio.Semaphore | None, after: asyncio.Event | None,
    ) -> int:  # fmt: skip
        if after is not None:
            await after.wait()
        attempt = 0
        while not self._stopping:
            try:
                if gate is None:
                    conn = await self.connect(host, port)
                else:
                    async with gate:
                        conn = await self.connect(host, port)
                await conn.closed
                if self.device_id is not None:
                    attempt = 0  # it had registered: a fresh start for the backoff
            except ssl.SSLCertVerificationError as exc:
                log.error("%s: TLS: %s:%d is not who it should be: %s (see --tls-ca, "
                          "--tls-server-name)", self.name, host, port,
                          exc.verify_message)  # fmt: skip
                self.last_error = ("tls", exc.verify_message)
                return 2
            except OSError as exc:  # refused, unreachable, no such host: not connected
                log.log(logging.WARNING if reconnect else logging.ERROR,
                        "%s: cannot reach %s:%d: %s", self.name, host, port, exc)  # fmt: skip
                if not reconnect:
                    return 1
            if self.last_error and self.last_error[0] in REFUSALS:
                return 2
            if self._stopping:
                break
            if not reconnect:
                if self.dismissed:
                    break
                log.error("%s: lost the connection to %s:%d", self.name, host, port)
                return 1
            delay = backoff_s(attempt, max_backoff_s)
            attempt += 1
            log.info("%s: reconnecting in %.2f s", self.name, delay)
            await asyncio.sleep(delay)
            self.device_id = None
        return 0

    def stop(self) -> None:
        self._stopping = True
        conn = self.connection
        if conn is not None:
            conn.close()
            if not conn.closed.done():  # do not wait on a transport that never came up
                conn.closed.set_result(None)

"""What the emulator would see of this machine: its link and its verified FLOPS.

A ``probe`` peer (GREETING → HELLO{role: "probe"} → WELCOME) measures with the
protocol's own probe messages:

- latency: RTT/2 of 64-byte PROBE_ECHO round trips (median and minimum);
- downlink (emulator → here): PROBE_PULL of each size, timed to the last byte of
  its PROBE_PULLED, less one round trip;
- uplink (here → emulator): PROBE_PUSH of each size, timed to its PROBE_ACK,
  less one round trip;
- FLOPS: PROBE_FLOPS_REQUEST{dim}; the emulator answers with a seeded
  PROBE_FLOPS challenge, this machine computes it with ``morphling.kernels.gemm``
  (timing the computation itself), returns PROBE_FLOPS_RESULT and gets a
  PROBE_VERDICT saying whether C was right and what FLOP/s it stands for.

Bandwidth repetitions alternate down and up for each size and report medians.
``morphling-bench`` (``morphling.commands.bench``) is the command around it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np
from morphling.kernels import BufferPool, gemm
from morphling.proxy.net.peer import PeerProtocol
from morphling.proxy.net.protocol import pool_allocator
from morphling.proxy.wire import challenge, handshake
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.messages import (
    REFUSALS,
    Bye,
    Greeting,
    Hello,
    Message,
    ProbeAck,
    ProbeEcho,
    ProbeFlops,
    ProbeFlopsRequest,
    ProbeFlopsResult,
    ProbePull,
    ProbePulled,
    ProbePush,
    ProbeVerdict,
    Status,
    StatusAsk,
    Welcome,
)
from morphling.proxy.wire.states import Party
from tqdm import tqdm

from morphling.text import format_size
from morphling.version import __version__

PROG = "morphling-bench"
SLOWEST_LINK = 125_000.0  # bytes/s (1 Mbit/s): what a transfer's time limit allows on top
LATENCY_BYTES = 64
CHALLENGE_RUNS = 7
CHALLENGE_BUDGET_NS = 200_000_000

Probe = ProbeEcho | ProbePush | ProbePull  # what we ask
Answer = ProbeEcho | ProbeAck | ProbePulled  # what answers them
Reply = TypeVar("Reply", ProbeEcho, ProbeAck, ProbePulled)  # what answers one of them


class BenchError(Exception):
    """The benchmark cannot go on; ``exit_code`` is what the command returns."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- the probe connection ----------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """The emulator's PROBE_VERDICT on our FLOPS challenge result."""

    ok: bool
    flops: float
    reason: str
    dim: int
    compute_ns: int
    runs: int


class ProbeConnection(PeerProtocol):
    """A ``probe`` peer: asks the emulator's probes and answers its challenge.

    Replies are matched to requests by probe id; each waiter gets the reply and
    the ``perf_counter`` reading taken when its last byte was decoded, so the
    event loop's wake-up latency is not part of a measurement.
    """

    def __init__(self, token: str, name: str, pool: BufferPool) -> None:
        super().__init__(Connection(Party.PEER, "probe", allocate=pool_allocator(pool)))
        loop = asyncio.get_running_loop()
        self.token, self.name = token, name
        self.welcomed_as: asyncio.Future[int] = loop.create_future()
        self.awaiting: dict[type[Message], asyncio.Future[Any]] = {}  # PROBE_VERDICT, STATUS
        self.error: BenchError | None = None
        self._waiters: dict[int, asyncio.Future[tuple[Answer, float]]] = {}
        self._answered = (0, 0, 0)  # (dim, compute_ns, runs) of the challenge we answered

    # -- receiving -----------------------------------------------------------------

    def greeted(self, greeting: Greeting) -> Hello | None:
        if handshake.token_missing(greeting, self.token):
            self._abort(BenchError("the emulator requires a token (--token)", 2))
            return None
        return handshake.hello(greeting, self.token, "probe", name=self.name)

    def welcomed(self, welcome: Welcome) -> None:
        self.welcomed_as.set_result(welcome.peer_id)

    def refused(self, code: str, reason: str) -> None:
        exit_code = 2 if code in REFUSALS else 1
        self._abort(BenchError(f"the emulator refused: {code}: {reason}", exit_code))

    def dismissed(self, reason: str) -> None:
        self._abort(BenchError(f"the emulator said goodbye: {reason or '-'}"))

    def received(self, msg: Message) -> None:
        if isinstance(msg, Answer):  # an echo request is answered
            waiter = self._waiters.pop(msg.probe, None)
            if waiter is not None and not waiter.done():
                waiter.set_result((msg, time.perf_counter()))
        elif isinstance(msg, ProbeFlops):
            challenge.check_dim(msg.dim, "PROBE_FLOPS.dim")
            self.spawn(self._answer_challenge(msg))
        elif isinstance(msg, ProbeVerdict | Status):
            future = self.awaiting.pop(type(msg), None)
            if future is None or future.done():
                return
            if isinstance(msg, Status):
                future.set_result(msgpack.unpackb(msg.segments[0]))
            else:
                future.set_result(Verdict(msg.ok, msg.flops, msg.reason, *self._answered))

    def disconnected(self, exc: Exception | None) -> None:
        error = self.error or BenchError(f"connection to the emulator lost ({exc or 'closed'})")
        futures: list[asyncio.Future[Any]] = [self.welcomed_as, *self._waiters.values()]
        futures += self.awaiting.values()
        for future in futures:
            if not future.done():
                future.set_exception(error)
        self._waiters.clear()

    def _abort(self, error: BenchError) -> None:
        self.error = self.error or error
        self.close()

    async def _answer_challenge(self, msg: ProbeFlops) -> None:
        out, compute_ns, runs = await asyncio.to_thread(compute_challenge, msg.seed, msg.dim)
        self._answered = (msg.dim, compute_ns, runs)
        if self.open:
            self.send(ProbeFlopsResult(probe=msg.probe, compute_ns=compute_ns, segments=(out,)))

    # -- asking ----------------------------------------------------------------------

    async def ask(self, msg: Probe, kind: type[Reply], timeout: float) -> tuple[Reply, float]:
        """Send ``msg``; its reply (of ``kind``) and the ``perf_counter`` when it was
        complete."""
        if self.error is not None:
            raise self.error
        future = self._waiters[msg.probe] = asyncio.get_running_loop().create_future()
        try:
            self.send(msg)
            reply, done = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise BenchError(f"no reply to {msg.TYPE.name} within {timeout:g} s") from None
        except ConnectionError as exc:
            raise self.error or BenchError(f"connection to the emulator lost ({exc})") from None
        finally:
            self._waiters.pop(msg.probe, None)
        if not isinstance(reply, kind):
            raise BenchError(f"the emulator answered {msg.TYPE.name} with {reply.TYPE.name}")
        return reply, done


def compute_challenge(seed: int, dim: int) -> tuple[np.ndarray, int, int]:
    """(C = A·B, best compute ns, runs) for the seeded challenge.

    The first run pays for warming the kernel (threads, page faults), and on a
    shared host any run can lose its time slice; neither is this machine's
    speed, so the challenge is computed up to ``CHALLENGE_RUNS`` times, for at
    most ``CHALLENGE_BUDGET_NS`` in all, and the fastest run counts. A single
    long run ends it, so the answer stays well inside the emulator's time limit.
    """
    a, b = challenge.matrices(seed, dim)
    out = np.empty((dim, dim), np.float32)
    best, runs, spent = math.inf, 0, 0
    while runs < CHALLENGE_RUNS and spent < CHALLENGE_BUDGET_NS:
        start = time.perf_counter_ns()
        gemm(a, b, out)
        elapsed = time.perf_counter_ns() - start
        best, runs, spent = min(best, elapsed), runs + 1, spent + elapsed
    return out, max(int(best), 1), runs


class ProbeClient:
    """A probe peer connected to an emulator; ``await ProbeClient.connect(host, port)``."""

    def __init__(self, conn: ProbeConnection, peer_id: int, timeout: float) -> None:
        self.conn = conn
        self.peer_id = peer_id
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._payloads: dict[int, np.ndarray] = {}

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        token: str = "",
        name: str = PROG,
        timeout: float = 30.0,
        pool: BufferPool | None = None,
    ) -> ProbeClient:
        """Connect and register; ``BenchError`` (exit code 2) if that cannot be done."""
        loop = asyncio.get_running_loop()
        pool = pool or BufferPool(pin=False)
        where = f"{host}:{port}"
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: ProbeConnection(token, name, pool), host, port),
                timeout,
            )
        except TimeoutError:
            message = f"cannot reach {where}: no connection within {timeout:g} s"
            raise BenchError(message, 2) from None
        except OSError as exc:
            raise BenchError(f"cannot reach {where}: {exc.strerror or exc}", 2) from None
        try:
            peer_id = await asyncio.wait_for(conn.welcomed_as, timeout)
        except TimeoutError:
            conn.close()
            raise BenchError(
                f"{where} accepted the connection but did not welcome us within {timeout:g} s "
                "(is it a Morphling emulator?)",
                2,
            ) from None
        except BenchError as exc:
            exc.exit_code = 2  # refused at the handshake: nothing was measured
            raise
        return cls(conn, peer_id, timeout)

    def _payload(self, nbytes: int) -> np.ndarray:
        """A payload of ``nbytes`` whose pages exist already (allocated once per size)."""
        payload = self._payloads.get(nbytes)
        if payload is None:
            payload = self._payloads[nbytes] = np.full(nbytes, 0xA5, np.uint8)
        return payload

    async def echo(self, nbytes: int = LATENCY_BYTES) -> float:
        """Round-trip seconds of one PROBE_ECHO of ``nbytes``."""
        payload = self._payload(nbytes)
        start = time.perf_counter()
        _, done = await self.conn.ask(
            ProbeEcho(probe=next(self._ids), segments=(payload,)), ProbeEcho, self.timeout
        )
        return done - start

    def _limit(self, nbytes: int) -> float:
        """How long a transfer of ``nbytes`` may take: the time limit, plus its bytes at
        ``SLOWEST_LINK`` (64 MiB over a board's weak Wi-Fi takes minutes)."""
        return self.timeout + nbytes / SLOWEST_LINK

    async def pull(self, nbytes: int) -> float:
        """Seconds from asking for ``nbytes`` to their last byte arriving (emulator → here)."""
        start = time.perf_counter()
        reply, done = await self.conn.ask(
            ProbePull(probe=next(self._ids), nbytes=nbytes), ProbePulled, self._limit(nbytes)
        )
        got = reply.segments[0].nbytes
        if got != nbytes:
            raise BenchError(f"PROBE_PULLED carried {got} bytes, asked for {nbytes}")
        return done - start

    async def push(self, nbytes: int) -> float:
        """Seconds from sending ``nbytes`` to their PROBE_ACK (here → emulator)."""
        payload = self._payload(nbytes)
        start = time.perf_counter()
        reply, done = await self.conn.ask(
            ProbePush(probe=next(self._ids), segments=(payload,)), ProbeAck, self._limit(nbytes)
        )
        if reply.nbytes != nbytes:
            raise BenchError(f"PROBE_ACK counted {reply.nbytes} bytes, sent {nbytes}")
        return done - start

    async def flops(self, dim: int) -> Verdict:
        """Ask for a FLOPS challenge of ``dim``, answer it, and return the verdict."""
        verdict: Verdict = await self._answer(ProbeFlopsRequest(dim=dim), ProbeVerdict)
        return verdict

    async def status(self) -> dict[str, Any]:
        """The emulator's fleet, jobs and counters (STATUS; docs/PROTOCOL.md)."""
        status: dict[str, Any] = await self._answer(StatusAsk(), Status)
        return status

    async def _answer(self, msg: Message, kind: type[Message]) -> Any:
        """Send ``msg`` and wait for the one reply of ``kind`` it asks for."""
        conn = self.conn
        if conn.error is not None:
            raise conn.error
        future = conn.awaiting[kind] = asyncio.get_running_loop().create_future()
        conn.send(msg)
        try:
            return await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise BenchError(f"no {kind.TYPE.name} within {self.timeout:g} s") from None
        finally:
            conn.awaiting.pop(kind, None)

    async def close(self) -> None:
        if self.conn.open:
            self.conn.send(Bye(reason=f"{PROG} done"))
            self.conn.close()
        await asyncio.sleep(0)


# -- the benchmark -----------------------------------------------------------------


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


async def measure_latency(client: ProbeClient, rounds: int) -> dict[str, Any]:
    await client.echo()  # warm-up: first-use allocations on both sides
    rtts = [await client.echo() for _ in range(rounds)]
    return {
        "bytes": LATENCY_BYTES,
        "rounds": rounds,
        "median_us": _us(statistics.median(rtts) / 2),
        "min_us": _us(min(rtts) / 2),
        "rtt_median_us": _us(statistics.median(rtts)),
        "rtt_min_us": _us(min(rtts)),
    }


async def measure_bandwidth(
    client: ProbeClient, sizes: Sequence[int], repeats: int, rtt_s: float, bar: tqdm
) -> list[dict[str, Any]]:
    """Per size: median bytes/s each way, alternating down and up, less one RTT each."""
    rows = []
    for nbytes in sizes:
        bar.set_postfix_str(format_size(nbytes))
        await client.pull(nbytes)  # warm-up: buffers of this size on both sides
        await client.push(nbytes)
        down, up = [], []
        for _ in range(repeats):
            down.append(nbytes / max(await client.pull(nbytes) - rtt_s, 1e-9))
            bar.update()
            up.append(nbytes / max(await client.push(nbytes) - rtt_s, 1e-9))
            bar.update()
        d, u = statistics.median(down), statistics.median(up)
        rows.append(
            {
                "size": format_size(nbytes),
                "bytes": nbytes,
                "repeats": repeats,
                "down_bytes_s": round(d),
                "up_bytes_s": round(u),
                "down_gbit_s": round(d * 8e-9, 3),
                "up_gbit_s": round(u * 8e-9, 3),
            }
        )
    return rows


async def run_bench(
    host: str,
    port: int,
    *,
    token: str = "",
    sizes: Sequence[int] = (4 << 20,),
    latency_rounds: int = 20,
    repeats: int = 3,
    flops_dim: int = 256,
    timeout: float = 30.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every measurement; the report ``--json`` prints. Raises ``BenchError``."""
    client = await ProbeClient.connect(host, port, token=token, timeout=timeout)
    try:
        latency = await measure_latency(client, latency_rounds)
        rtt = latency["rtt_min_us"] / 1e6
        with tqdm(
            total=2 * repeats * len(sizes),
            desc="bandwidth",
            unit="transfer",
            file=sys.stderr,
            disable=not progress,
            leave=False,
        ) as bar:
            bandwidth = await measure_bandwidth(client, sizes, repeats, rtt, bar)
        verdict = await client.flops(flops_dim)
    finally:
        await client.close()
    return {
        "server": f"{host}:{port}",
        "peer_id": client.peer_id,
        "morphling": __version__,
        "latency": latency,
        "bandwidth": bandwidth,
        "flops": {
            "dim": verdict.dim or flops_dim,
            "ok": verdict.ok,
            "flops": verdict.flops,
            "gflops": round(verdict.flops / 1e9, 2),
            "reason": verdict.reason,
            "compute_ns": verdict.compute_ns,
            "runs": verdict.runs,
        },
    }

"""The emulator end to end, over real loopback sockets: no mocks, one emulator per test.

Each test starts its own ``Emulator`` on 127.0.0.1 port 0 with short timeouts
and small probes, virtual ``DeviceAgent``s sharing one ``WorkerPool`` and
``BufferPool``, and jobs through ``AsyncClient`` / ``Client``. Misbehaving
peers are raw sockets that speak (or break) the protocol by hand, with
``codec`` doing the framing. The ``fleet`` fixture tears everything down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import re
import socket
import threading
import time
from typing import Any

import msgpack
import numpy as np
import pytest
from morphling.devices.agent import INLINE_FLOPS, DeviceAgent, backoff_s
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.emulator import probes
from morphling.proxy.emulator.registry import DeviceRecord
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.client import AsyncClient, Client, EmulatorError
from morphling.proxy.wire import challenge, codec
from morphling.proxy.wire.handshake import expected_mac
from morphling.proxy.wire.messages import (
    Bye,
    Error,
    Gemm,
    Greeting,
    Heartbeat,
    Hello,
    Message,
    MsgType,
    Open,
    ProbeAck,
    ProbeEcho,
    ProbeFlops,
    ProbeFlopsRequest,
    ProbeFlopsResult,
    ProbePulled,
    Result,
    Step,
    TileResult,
    Welcome,
)

try:  # imported up front: importing torch inside a test would stall the event loop
    import torch
except ImportError:  # pragma: no cover - torch is a dev dependency
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

FAST = {
    "listen_ip": "127.0.0.1",
    "listen_port": 0,
    "block_size": 16,
    "probe": False,
    "heartbeat_s": 0.25,
    "heartbeat_timeout_s": 2.0,
    "hello_timeout_s": 1.0,
    "probe_bandwidth_bytes": 65536,
    "probe_flops_dim": 32,
    "probe_timeout_s": 3.0,
}
TIMEOUT = 20.0  # per GEMM: generous, a failure shows long before it
_gemm_ids = itertools.count(1000)  # explicit requests; matmul() numbers its own from 1


# -- the fleet fixture ---------------------------------------------------------------------


class Fleet:
    """One emulator, its devices and jobs; ``close()`` stops them all."""

    def __init__(self, emu: Emulator, host: str, port: int, workers: WorkerPool) -> None:
        self.emu = emu
        self.host, self.port = host, port
        self.workers = workers
        self.pool = BufferPool()
        self.agents: list[DeviceAgent] = []
        self.tasks: dict[DeviceAgent, asyncio.Task[int]] = {}
        self.clients: list[AsyncClient] = []
        self.raw: list[RawPeer] = []

    def agent(
        self, profile: str = "rpi4", *, name: str = "", token: str = "", virtual: bool = True,
        workers: WorkerPool | None = None,
    ) -> DeviceAgent:  # fmt: skip
        agent = DeviceAgent(
            BUILTIN[profile], workers or self.workers, self.pool,
            name=name or f"{profile}-{len(self.agents)}", token=token, virtual=virtual,
            inline_flops=0 if workers is not None else INLINE_FLOPS,  # gated workers see all
        )  # fmt: skip
        self.agents.append(agent)
        return agent

    def run(self, agent: DeviceAgent, *, reconnect: bool = False) -> asyncio.Task[int]:
        task = asyncio.create_task(agent.run(self.host, self.port, reconnect=reconnect))
        self.tasks[agent] = task
        return task

    async def add_device(self, profile: str = "rpi4", **kwargs: Any) -> DeviceAgent:
        """Start a device agent and wait until the emulator schedules on it."""
        agent = self.agent(profile, **kwargs)
        self.run(agent)
        await self.wait_ready(agent)
        return agent

    async def wait_ready(self, agent: DeviceAgent, timeout: float = 10.0) -> DeviceRecord:
        def ready() -> bool:
            record = self.emu.registry.devices.get(agent.device_id)
            return agent.device_id is not None and record is not None and record.ready

        await wait_for_condition(ready, timeout, f"{agent.name} to become ready")
        return self.record(agent)

    def record(self, agent: DeviceAgent) -> DeviceRecord:
        return self.emu.registry.devices[agent.device_id]

    async def client(self, **kwargs: Any) -> AsyncClient:
        client = await AsyncClient.connect(self.host, self.port, timeout=5.0, **kwargs)
        self.clients.append(client)
        return client

    async def raw_peer(self, *, rcvbuf: int = 0) -> RawPeer:
        peer = await RawPeer.connect(self.host, self.port, rcvbuf=rcvbuf)
        self.raw.append(peer)
        return peer

    async def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 2.0)
        for peer in self.raw:
            peer.close()
        for agent in self.agents:
            agent.stop()
        await self.emu.stop()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
            for task in self.tasks.values():
                task.cancel()


@pytest.fixture
async def fleet():
    """``await fleet(**config)``: a started emulator (``FAST`` plus overrides), torn down after."""
    fleets: list[Fleet] = []
    workers = WorkerPool([CpuBackend(1), CpuBackend(1)])

    async def make(**overrides: Any) -> Fleet:
        emu = Emulator(EmulatorConfig(**{**FAST, **overrides}))
        host, port = await emu.start()
        made = Fleet(emu, host, port, workers)
        fleets.append(made)
        return made

    try:
        yield make
    finally:
        for made in fleets:
            await made.close()
        workers.close()


# -- helpers -------------------------------------------------------------------------------


async def wait_for_condition(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def reference(a: Any, b: Any) -> np.ndarray:
    """a @ b in float64 from the very same operands."""
    if torch is not None and isinstance(a, torch.Tensor):
        a, b = a.numpy(), b.numpy()
    return np.matmul(a.astype(np.float64), b.astype(np.float64))


def assert_gemm_close(c: np.ndarray, a: Any, b: Any, what: str = "") -> None:
    ref = reference(a, b)
    assert c.shape == ref.shape, what
    dtype = a.numpy().dtype if torch is not None and isinstance(a, torch.Tensor) else a.dtype
    assert c.dtype == dtype, what
    k = a.shape[-1]
    if dtype == np.float32:
        np.testing.assert_allclose(c, ref, rtol=1e-4, atol=1e-4 * max(1, k) ** 0.5, err_msg=what)
    else:
        np.testing.assert_allclose(c, ref, rtol=1e-10, atol=1e-10 * max(1, k), err_msg=what)


def gemm_request(a: np.ndarray, b: np.ndarray) -> Gemm:
    """An explicit GEMM request for C-contiguous a [batch?, m, k] and b [batch?, k, n]."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.shape[0] if a.ndim == 3 else b.shape[0] if b.ndim == 3 else 1
    return Gemm(
        gemm=next(_gemm_ids), dtype=a.dtype.name, ta=False, tb=False, m=m, n=n, k=k,
        lda=k, ldb=n, batch=batch, stride_a=m * k if a.ndim == 3 else 0,
        stride_b=k * n if b.ndim == 3 else 0, segments=(a.reshape(-1), b.reshape(-1)),
    )  # fmt: skip


def result_array(result: Result, request: Gemm, *, batched: bool = True) -> np.ndarray:
    shape = (request.batch, request.m, request.n) if batched else (request.m, request.n)
    return np.frombuffer(result.segments[0], dtype=request.dtype).reshape(shape)


async def check_serving(client: AsyncClient, seed: int = 0) -> None:
    """The emulator still computes a batched GEMM correctly for ``client``."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((3, 37, 21), dtype=np.float32)
    b = rng.standard_normal((21, 29), dtype=np.float32)
    assert_gemm_close(await client.matmul(a, b, timeout=TIMEOUT), a, b, "still serving")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def prefix(msg_type: int, header_len: int, payload_len: int, *, magic: int = codec.MAGIC,
           version: int = codec.VERSION) -> bytes:  # fmt: skip
    return codec.PREFIX.pack(magic, version, msg_type, header_len, payload_len)


def raw_frame(msg_type: int, header: Any, payload_len: int = 0) -> bytes:
    """A frame's prefix and an arbitrary msgpack header (the payload is the caller's)."""
    packed = msgpack.packb(header)
    return prefix(msg_type, len(packed), payload_len) + packed


class RawPeer:
    """A hand-driven asyncio connection: send frames or bytes, read decoded messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder()
        self.greeting: Greeting | None = None

    @classmethod
    async def connect(cls, host: str, port: int, *, rcvbuf: int = 0) -> RawPeer:
        """``rcvbuf``: a small kernel receive buffer, so that not reading soon backs up."""
        if not rcvbuf:
            return cls(*await asyncio.open_connection(host, port))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        return cls(*await asyncio.open_connection(sock=sock))

    def stop_reading(self) -> None:
        """Read nothing more from the socket until ``recv`` is called."""
        self.writer.transport.pause_reading()

    def send(self, msg: Message) -> None:
        self.writer.write(codec.encode_bytes(msg))

    def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self, timeout: float = 5.0) -> Message | None:
        """The next message, or None at EOF (or a reset)."""
        self.writer.transport.resume_reading()
        while (msg := self.decoder.next_message()) is None:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 20), timeout)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.decoder.receive_data(data)
        return msg

    async def recv_skipping_heartbeats(self, timeout: float = 5.0) -> Message | None:
        """The next message but HEARTBEATs and NOTICEs (which only inform a job's user)."""
        skipped = (MsgType.HEARTBEAT, MsgType.NOTICE)
        while (msg := await self.recv(timeout)) is not None and msg.TYPE in skipped:
            pass
        return msg

    async def hello(self, role: str = "job", *, token: str = "", **fields: Any) -> Welcome:
        greeting = await self.recv()
        assert isinstance(greeting, Greeting), greeting
        self.greeting = greeting
        mac = expected_mac(token, greeting.nonce) if token else b""
        self.send(Hello(role=role, mac=mac, **fields))
        welcome = await self.recv_skipping_heartbeats()
        assert isinstance(welcome, Welcome), welcome
        return welcome

    async def expect_error(self, code: str | tuple[str, ...], timeout: float = 5.0) -> Error:
        """The next message is an ERROR with ``code`` (or one of them), then EOF."""
        msg = await self.recv_skipping_heartbeats(timeout)
        assert isinstance(msg, Error), f"expected ERROR {code}, got {msg!r}"
        assert msg.code in ((code,) if isinstance(code, str) else code), msg
        assert await self.recv(timeout) is None, "the server should close after an ERROR"
        return msg

    def close(self) -> None:
        self.writer.close()


def blocking_exchange(
    host: str, port: int, data: bytes, *, wait_s: float = 5.0
) -> tuple[list[Message], bool, float]:
    """A plain blocking socket: send ``data``, read to EOF; (messages, got EOF, seconds)."""
    decoder = codec.Decoder()
    messages: list[Message] = []
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=wait_s) as sock:
        if data:
            sock.sendall(data)
        eof = False
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                break
            except ConnectionResetError:
                eof = True
                break
            if not chunk:
                eof = True
                break
            decoder.receive_data(chunk)
            while (msg := decoder.next_message()) is not None:
                messages.append(msg)
    return messages, eof, time.monotonic() - start


class GatedCpuBackend(CpuBackend):
    """A real CPU backend that starts each GEMM only once ``gate`` is set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(1)
        self.gate = gate

    def run(self, plan: Any) -> None:
        self.gate.wait(30)
        super().run(plan)


# -- 1. correctness --------------------------------------------------------------------------

SIZES = (1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 40)
LAYOUTS_2D = ("c", "t", "pad", "pad_t")
LAYOUTS_3D = (*LAYOUTS_2D, "step", "interleaved")


def make_operand(
    rng: np.random.Generator, rows: int, cols: int, dtype: type, batch: int, layout: str
) -> np.ndarray:
    """A [batch?, rows, cols] view of ``layout``: contiguous, transposed, padded, strided."""
    lead = (batch,) if batch else ()

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    if layout == "c":
        return normal(*lead, rows, cols)
    if layout == "t":  # x.T of a contiguous array: column-major
        return np.swapaxes(normal(*lead, cols, rows), -1, -2)
    if layout == "pad":  # a window of a larger array: ld > cols, offset start
        return normal(*lead, rows + 3, cols + 5)[..., 1 : rows + 1, 2 : cols + 2]
    if layout == "pad_t":
        return np.swapaxes(normal(*lead, cols + 4, rows + 2)[..., 1 : cols + 1, :rows], -1, -2)
    if layout == "step":  # every other pivot of a larger batch
        return normal(2 * batch, rows, cols)[::2]
    if layout == "interleaved":  # pivots interleaved row by row: stride < ld
        return normal(rows, batch, cols).transpose(1, 0, 2)
    raise AssertionError(layout)


def random_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    kind = str(rng.choice(["2d", "bcast_b", "bcast_a", "both"]))
    dtype = np.float32 if rng.random() < 0.6 else np.float64
    m, n, k = (int(rng.choice(SIZES)) for _ in range(3))
    batch = int(rng.choice([1, 2, 3, 5]))
    batch_a = batch if kind in ("bcast_b", "both") else 0
    batch_b = batch if kind in ("bcast_a", "both") else 0
    la = str(rng.choice(LAYOUTS_3D if batch_a else LAYOUTS_2D))
    lb = str(rng.choice(LAYOUTS_3D if batch_b else LAYOUTS_2D))
    a = make_operand(rng, m, k, dtype, batch_a, la)
    b = make_operand(rng, k, n, dtype, batch_b, lb)
    what = f"{kind} {np.dtype(dtype).name} a{a.shape}:{la} @ b{b.shape}:{lb}"
    return a, b, what


EDGE_CASES = [  # (a shape, b shape, a layout, b layout)
    ((1, 1), (1, 1), "c", "c"),
    ((1, 17), (17, 1), "t", "t"),
    ((33, 1), (1, 31), "pad", "pad_t"),
    ((1, 16, 16), (16, 16), "c", "t"),
    ((2, 1, 33), (2, 33, 1), "interleaved", "step"),
    ((17, 40), (3, 40, 15), "pad_t", "interleaved"),
]


async def test_random_gemms_match_numpy(fleet):
    f = await fleet(block_size=16)
    for i in range(4):
        await f.add_device(name=f"dev{i}")
    client = await f.client(name="correctness")
    rng = np.random.default_rng(2024)
    cases = [random_case(rng) for _ in range(40)]
    for a_shape, b_shape, la, lb in EDGE_CASES:
        for dtype in (np.float32, np.float64):
            batch_a = a_shape[0] if len(a_shape) == 3 else 0
            batch_b = b_shape[0] if len(b_shape) == 3 else 0
            a = make_operand(rng, *a_shape[-2:], dtype, batch_a, la)
            b = make_operand(rng, *b_shape[-2:], dtype, batch_b, lb)
            cases.append((a, b, f"edge a{a.shape}:{la} @ b{b.shape}:{lb} {np.dtype(dtype)}"))
    layouts = {name for _, _, what in cases for name in re.findall(r":(\w+)", what)}
    assert layouts == set(LAYOUTS_3D), "the cases should exercise every layout"
    assert {a.dtype for a, _, _ in cases} == {np.dtype(np.float32), np.dtype(np.float64)}
    for start in range(0, len(cases), 8):  # eight GEMMs in flight at a time
        chunk = cases[start : start + 8]
        results = await asyncio.gather(*(client.matmul(a, b, timeout=TIMEOUT) for a, b, _ in chunk))
        for (a, b, what), c in zip(chunk, results, strict=True):
            assert_gemm_close(c, a, b, what)
    devices = [f.record(agent) for agent in f.agents]
    assert all(d.completed > 0 for d in devices), [d.completed for d in devices]
    assert all(not d.outstanding for d in devices)


async def test_out_argument_and_empty_dimensions(fleet):
    f = await fleet()
    await f.add_device()
    await f.add_device()
    client = await f.client()
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 19, 23))
    b = rng.standard_normal((23, 21))
    out = np.empty((2, 19, 21))
    assert await client.matmul(a, b, out, timeout=TIMEOUT) is out
    assert_gemm_close(out, a, b)
    # Zero-sized dimensions: nothing to tile (m, n) or an all-zero product (k).
    for a_shape, b_shape in (((0, 5), (5, 4)), ((4, 5), (5, 0)), ((6, 0), (0, 7)),
                             ((2, 3, 0), (0, 5))):  # fmt: skip
        a = np.ones(a_shape, np.float32)
        b = np.ones(b_shape, np.float32)
        c = await client.matmul(a, b, timeout=TIMEOUT)
        np.testing.assert_array_equal(c, a @ b)
    await check_serving(client)


@needs_torch
async def test_torch_operands(fleet):
    f = await fleet(block_size=8)
    for _ in range(2):
        await f.add_device()
    client = await f.client()
    torch.manual_seed(0)
    cases = [
        (torch.randn(17, 9), torch.randn(9, 20)),
        (torch.randn(3, 17, 9), torch.randn(20, 9).T),  # batched @ transposed 2-D
        (torch.randn(23, 31)[2:13, 5:30], torch.randn(25, 12, dtype=torch.float32)),  # padded
        (torch.randn(2, 9, 14, dtype=torch.float64).transpose(1, 2),
         torch.randn(2, 9, 5, dtype=torch.float64)),
        (torch.randn(1, 1), torch.randn(1, 1)),
    ]  # fmt: skip
    for a, b in cases:
        c = await client.matmul(a, b, timeout=TIMEOUT)
        assert isinstance(c, np.ndarray)
        assert_gemm_close(c, a, b, f"torch {tuple(a.shape)} @ {tuple(b.shape)}")
        np.testing.assert_allclose(c, (a @ b).numpy(), rtol=1e-4, atol=1e-4)
    a, b = torch.randn(4, 6, 10), torch.randn(10, 3)
    out = torch.empty(4, 6, 3)
    assert await client.matmul(a, b, out, timeout=TIMEOUT) is out
    np.testing.assert_allclose(out.numpy(), (a @ b).numpy(), rtol=1e-4, atol=1e-4)


async def test_sync_client_from_a_plain_thread(fleet):
    f = await fleet()
    for _ in range(2):
        await f.add_device()
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 30, 18)).astype(np.float32)
    b = rng.standard_normal((25, 18)).astype(np.float32).T  # transposed view

    def job() -> tuple[np.ndarray, np.ndarray, Any, Any]:
        assert threading.current_thread() is not threading.main_thread()
        with Client(f.host, f.port, name="sync") as client:
            c1 = client.matmul(a, b, timeout=TIMEOUT)
            c2 = client.matmul(a[1], b[:, :7], timeout=TIMEOUT)
            step = client.step(1)
            totals = client.close()
        return c1, c2, step, totals

    c1, c2, step, totals = await asyncio.to_thread(job)
    assert_gemm_close(c1, a, b)
    assert_gemm_close(c2, a[1], b[:, :7])
    assert step.step == 1 and step.gemms == 2 and step.tiles > 0
    assert totals.gemms == 2 and totals.tiles == step.tiles


async def test_two_jobs_at_once(fleet):
    f = await fleet(block_size=16)
    for _ in range(3):
        await f.add_device()
    jobs = [await f.client(name=f"job{i}") for i in range(2)]
    rng = np.random.default_rng(9)

    async def work(client: AsyncClient) -> None:
        for _ in range(5):
            a, b, what = random_case(rng)
            assert_gemm_close(await client.matmul(a, b, timeout=TIMEOUT), a, b, what)

    await asyncio.gather(*(work(client) for client in jobs))
    totals = [await client.step(7) for client in jobs]
    assert [t.gemms for t in totals] == [5, 5]


# -- 2. policies ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round-robin", "greedy", "load-balanced"])
async def test_policy_computes_and_spreads(fleet, policy):
    f = await fleet(policy=policy, block_size=16, window=2)
    for _ in range(4):
        await f.add_device("rpi4")
    client = await f.client()
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 64, 24), dtype=np.float32)
    b = rng.standard_normal((24, 64), dtype=np.float32)
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request), a, b, policy)
    assert result.tiles == 2 * 4 * 4
    completed = [f.record(agent).completed for agent in f.agents]
    assert sum(completed) == result.tiles
    assert set(result.devices) == {i for i, n in enumerate(completed) if n}
    if policy != "greedy":  # greedy may keep work on its fastest device; these must spread
        assert len(result.devices) > 1, completed
    if policy == "round-robin":
        assert len(result.devices) == 4 and max(completed) - min(completed) <= 2 * 2, completed
    # And a second, differently shaped GEMM through the same scheduler state.
    await check_serving(client)


async def test_greedy_prefers_the_faster_device(fleet):
    """Greedy places each tile by predicted finish in virtual time under the profiles.

    On the built-ins' gigabit LAN a Pi's tiles are link-bound (spreading them is the
    right call), so both boards are on the ideal link here: compute decides, and the
    Orin Nano (40x a Pi 4's FLOP/s) gets all of them.
    """
    f = await fleet(policy="greedy", block_size=256, window=64, high_water_bytes=64 << 20)
    pi, orin = f.agent("rpi4"), f.agent("orin-nano")
    for agent in (pi, orin):
        agent.profile = LINKS["ideal"].apply(agent.profile)
        f.run(agent)
        await f.wait_ready(agent)
    client = await f.client()
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1024, 512), dtype=np.float32)
    b = rng.standard_normal((512, 1024), dtype=np.float32)
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request, batched=False), a, b)
    pi_done, orin_done = f.record(pi).completed, f.record(orin).completed
    assert pi_done + orin_done == result.tiles == 16
    # 16 tiles of 67 MFLOP: 1.1 ms in all on the Orin, 2.8 ms for one on the Pi
    assert (orin_done, pi_done) == (16, 0)
    assert result.devices == [f.record(orin).id]


# -- 3. window / flow control -----------------------------------------------------------------


async def test_window_of_one_bounds_tiles_in_flight(fleet):
    f = await fleet(window=1, block_size=8, policy="load-balanced")
    for _ in range(3):
        await f.add_device()
    client = await f.client()
    seen: list[int] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            seen.extend(len(d.outstanding) for d in list(f.emu.registry.devices.values()))
            await asyncio.sleep(0.0005)

    sampler = asyncio.create_task(sample())
    rng = np.random.default_rng(6)
    a = rng.standard_normal((6, 48, 40), dtype=np.float32)
    b = rng.standard_normal((40, 56), dtype=np.float32)
    try:
        request = gemm_request(a, b)
        result = await client.submit(request, timeout=TIMEOUT)
    finally:
        stop.set()
        await sampler
    assert_gemm_close(result_array(result, request), a, b)
    assert result.tiles == 6 * 6 * 7
    assert len(seen) > 30, "the sampler should have run while tiles were in flight"
    assert max(seen) == 1, f"window=1 exceeded: {max(seen)} tiles outstanding on one device"
    assert seen.count(1) > 0


async def test_tiles_wait_for_a_full_send_buffer_to_drain(fleet):
    """With a 1-byte high-water mark every big tile pauses its device's connection; tiles
    resume as the buffers drain (``resume_writing``), and the GEMM completes. (No operand
    arena, so that the operands cross the wire.)"""
    f = await fleet(block_size=128, window=4, high_water_bytes=1, policy="load-balanced",
                    arena_bytes=0)  # fmt: skip
    for _ in range(2):
        await f.add_device()
    client = await f.client()
    paused: list[bool] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            paused.extend(not d.conn.writable for d in list(f.emu.registry.devices.values()))
            await asyncio.sleep(0.0005)

    sampler = asyncio.create_task(sample())
    rng = np.random.default_rng(22)
    a = rng.standard_normal((512, 1024), dtype=np.float32)  # 1 MiB of A per tile row
    b = rng.standard_normal((1024, 384), dtype=np.float32)
    try:
        c = await client.matmul(a, b, timeout=TIMEOUT)
    finally:
        stop.set()
        await sampler
    assert_gemm_close(c, a, b)
    assert any(paused), "the send buffer never crossed the high-water mark"
    assert all(not d.outstanding for d in f.emu.registry.devices.values())


# -- 4. authentication -----------------------------------------------------------------------


async def test_token_authentication(fleet):
    f = await fleet(token="s3cret")
    good = await f.add_device(token="s3cret", name="good")
    job = await f.client(token="s3cret", name="good-job")
    rng = np.random.default_rng(8)
    a = rng.standard_normal((4, 64, 32), dtype=np.float32)
    b = rng.standard_normal((32, 48), dtype=np.float32)
    running = asyncio.create_task(job.matmul(a, b, timeout=TIMEOUT))

    for token in ("wrong", ""):  # devices: refused for good, run() gives up with 2
        bad = f.agent(token=token, name=f"bad-{token or 'none'}")
        code = await asyncio.wait_for(f.run(bad, reconnect=True), 10)
        assert code == 2
        assert bad.last_error is not None and bad.last_error[0] == "auth", bad.last_error
    for token in ("wrong", ""):  # jobs
        with pytest.raises(EmulatorError) as info:
            await f.client(token=token)
        assert info.value.code == "auth"
    with pytest.raises(EmulatorError) as info:  # the blocking client raises the same
        await asyncio.to_thread(Client, f.host, f.port, token="nope")
    assert info.value.code == "auth"
    raw = await f.raw_peer()  # a MAC over the wrong nonce
    greeting = await raw.recv()
    assert isinstance(greeting, Greeting) and greeting.auth
    raw.send(Hello(role="job", mac=expected_mac("s3cret", bytes(16))))
    await raw.expect_error("auth")

    assert_gemm_close(await running, a, b, "job started before the refusals")
    assert list(f.emu.registry.devices) == [good.device_id]
    await check_serving(job)


async def test_no_token_configured_accepts_anyone(fleet):
    f = await fleet()
    await f.add_device(token="whatever")  # a MAC the emulator does not ask for is ignored
    client = await f.client(token="also-ignored")
    await check_serving(client)


# -- 5. bad input to a live server ---------------------------------------------------------------


async def serving_fleet(fleet: Any, **overrides: Any) -> tuple[Fleet, AsyncClient]:
    f = await fleet(**overrides)
    for _ in range(2):
        await f.add_device()
    client = await f.client(name="good")
    return f, client


def _gemm_frame(size: int = 4) -> bytes:
    a = np.ones((size, size), np.float32)
    return codec.encode_bytes(gemm_request(a, a))


_ONE_SEG = {"seg": [["uint8", [4], 4]]}

BAD_PREFIXES = {  # sent before any HELLO: (bytes, the ERROR code)
    "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(40)), "bad_magic"),
    "bad_version": (prefix(MsgType.HELLO, 8, 0, version=codec.VERSION + 1) + b"\x80" * 8,
                    "bad_version"),
    "unknown_type": (prefix(99, 1, 0) + b"\x80", "unknown_type"),
    "zero_header": (prefix(MsgType.HELLO, 0, 0), "too_large"),
    "huge_header": (prefix(MsgType.HELLO, codec.MAX_HEADER + 1, 0), "too_large"),
    "huge_payload": (prefix(MsgType.HELLO, 8, 1 << 40), "too_large"),
    "header_not_a_map": (raw_frame(MsgType.HELLO, [1]), "bad_frame"),
    "tile_result_first": (
        codec.encode_bytes(TileResult(tile=1, compute_ns=1, segments=(np.zeros(0, np.float32),))),
        "out_of_order",
    ),
    "gemm_first": (_gemm_frame(0), "out_of_order"),
    "hello_bad_role": (codec.encode_bytes(Hello(role="admin")), "bad_hello"),
    "hello_bad_profile": (
        codec.encode_bytes(Hello(role="device", profile={"name": "x"})), "bad_hello",
    ),
    "hello_wrong_field_type": (raw_frame(MsgType.HELLO, {"role": 7}), "bad_header"),
    "hello_unknown_field": (raw_frame(MsgType.HELLO, {"role": "job", "x": 1}), "bad_header"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_PREFIXES))
async def test_bad_bytes_get_an_error_and_the_server_carries_on(fleet, case):
    data, code = BAD_PREFIXES[case]
    f, client = await serving_fleet(fleet)
    rng = np.random.default_rng(10)
    a = rng.standard_normal((3, 64, 40), dtype=np.float32)
    b = rng.standard_normal((40, 64), dtype=np.float32)
    running = asyncio.create_task(client.matmul(a, b, timeout=TIMEOUT))
    stats_before, rss_before = f.emu.pool.stats(), rss_bytes()

    messages, eof, _ = await asyncio.to_thread(blocking_exchange, f.host, f.port, data)

    assert [type(m) for m in messages] == [Greeting, Error], messages
    assert messages[1].code == code, messages[1]
    assert eof, "the server should close after its ERROR"
    if case == "huge_payload":  # refused from the prefix: nothing was allocated for it
        stats = f.emu.pool.stats()
        assert stats.leased_bytes <= stats_before.leased_bytes + (4 << 20)
        assert stats.allocations <= stats_before.allocations + 8
        assert rss_bytes() - rss_before < 64 << 20
    assert_gemm_close(await running, a, b, f"GEMM in flight during {case}")
    await check_serving(client)
    await wait_for_condition(lambda: len(f.emu.peers) == 3, 5, "the bad peer to be dropped")


async def test_payload_before_hello_is_refused_without_allocating(fleet):
    """A peer that has not said HELLO (here: not authenticated) cannot make the server
    commit memory by declaring a payload; HELLO itself carries none."""
    f = await fleet(token="s3cret", hello_timeout_s=2.0)
    await f.add_device(token="s3cret")
    client = await f.client(token="s3cret")
    nbytes = 64 << 20
    for msg_type, header in ((MsgType.HELLO, {"role": "job"}), (MsgType.TILE_RESULT, {"tile": 1})):
        before = f.emu.pool.stats().leased_bytes
        raw = await f.raw_peer()
        assert isinstance(await raw.recv(), Greeting)
        header = {**header, "seg": [["uint8", [nbytes], nbytes]]}
        raw.send_bytes(raw_frame(msg_type, header, nbytes))  # ...and never the payload
        await raw.writer.drain()
        msg = await raw.recv(timeout=1.0)
        leased = f.emu.pool.stats().leased_bytes - before
        assert leased < 1 << 20, f"{leased} bytes leased for a peer that has not said HELLO"
        assert isinstance(msg, Error) and msg.code in ("too_large", "out_of_order"), msg
        assert await raw.recv() is None
    await check_serving(client)


async def test_bad_frame_after_hello_is_refused(fleet):
    f, client = await serving_fleet(fleet, max_payload_bytes=1 << 24)
    stats_before, rss_before = f.emu.pool.stats(), rss_bytes()
    for data, code in (
        (prefix(MsgType.OPEN, 4, 0) + b"\xc1\xc1\xc1\xc1", "bad_frame"),  # invalid msgpack
        (codec.encode_bytes(Welcome(peer_id=1, heartbeat_s=1.0)), "out_of_order"),
        (codec.encode_bytes(Open(block=-1)), "bad_open"),
        (raw_frame(MsgType.GEMM, {"seg": [["uint8", [4], 4]]}, 5) + bytes(5), "bad_frame"),
        (raw_frame(MsgType.GEMM, {"seg": [["int7", [4], 4]]}, 4) + bytes(4), "bad_frame"),
        (raw_frame(MsgType.GEMM, {"seg": [["uint8", [-4], 4]]}, 4) + bytes(4), "bad_frame"),
        (raw_frame(MsgType.GEMM, {"seg": "x"}, 0), "bad_frame"),
        (raw_frame(MsgType.GEMM, _ONE_SEG, 4) + bytes(4), "bad_header"),  # GEMM has two
        (raw_frame(MsgType.OPEN, _ONE_SEG, 4) + bytes(4), ("bad_frame", "bad_header")),
        (prefix(MsgType.GEMM, 8, (1 << 24) + 1), "too_large"),  # past max_payload_bytes
        (prefix(MsgType.GEMM, 8, 1 << 62), "too_large"),
    ):
        raw = await f.raw_peer()
        await raw.hello("job", name="raw")
        raw.send_bytes(data)
        await raw.expect_error(code)
    stats = f.emu.pool.stats()
    assert stats.leased_bytes <= stats_before.leased_bytes + (4 << 20)
    assert rss_bytes() - rss_before < 64 << 20
    await check_serving(client)


GEMM_LIES = {
    # name: (Gemm fields, a elements, b elements, text the reason must contain)
    "a_too_short": ({"m": 8, "n": 8, "k": 8, "lda": 8, "ldb": 8}, 63, 64, "operand a"),
    "b_too_short": ({"m": 8, "n": 8, "k": 8, "lda": 8, "ldb": 8}, 64, 56, "operand b"),
    "ld_lies": ({"m": 8, "n": 8, "k": 8, "lda": 8, "ldb": 9}, 64, 64, "operand b"),
    "ld_too_small": ({"m": 8, "n": 8, "k": 8, "lda": 4, "ldb": 8}, 64, 64, "lda=4"),
    "stride_lies": ({"m": 8, "n": 8, "k": 8, "lda": 8, "ldb": 8, "batch": 2,
                     "stride_a": 64, "stride_b": 64}, 128, 64, "operand b"),
    "negative_stride": ({"m": 2, "n": 2, "k": 2, "lda": 2, "ldb": 2, "batch": 2,
                         "stride_a": -4}, 8, 4, "stride_a"),
    "transposed_lies": ({"m": 8, "n": 4, "k": 2, "lda": 8, "ldb": 4, "ta": True}, 15, 8,
                        "operand a"),
    "negative_k": ({"m": 2, "n": 2, "k": -1, "lda": 2, "ldb": 2}, 4, 4, "k=-1"),
    "zero_batch": ({"m": 2, "n": 2, "k": 2, "lda": 2, "ldb": 2, "batch": 0}, 4, 4, "batch=0"),
    "dtype": ({"m": 2, "n": 2, "k": 2, "lda": 2, "ldb": 2, "dtype": "uint8"}, 4, 4, "dtype"),
    "output_too_big": ({"m": 1 << 20, "n": 1 << 20, "k": 0, "lda": 1, "ldb": 1 << 20}, 0, 0,
                       "exceeds max_payload_bytes"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GEMM_LIES))
async def test_gemm_header_that_lies_is_refused(fleet, case):
    fields, a_len, b_len, text = GEMM_LIES[case]
    f, client = await serving_fleet(fleet)
    raw = await f.raw_peer()
    await raw.hello("job", name="liar")
    raw.send(Open(name="liar"))
    stats_before = f.emu.pool.stats()
    request = Gemm(
        **{"gemm": 1, "dtype": "float32", "ta": False, "tb": False, **fields},
        segments=(np.ones(a_len, np.float32), np.ones(b_len, np.float32)),
    )
    raw.send(request)
    error = await raw.expect_error("bad_gemm")
    assert text in error.reason, error.reason
    assert not f.emu.scheduler.queued, "no tile was queued"
    if case == "output_too_big":
        assert f.emu.pool.stats().leased_bytes <= stats_before.leased_bytes + (1 << 20)
    await check_serving(client)


async def test_duplicate_gemm_id_is_refused(fleet):
    f = await fleet()  # no devices: the first GEMM stays in flight
    raw = await f.raw_peer()
    await raw.hello("job", name="dup")
    raw.send(Open())
    a = np.ones((4, 4), np.float32)
    request = gemm_request(a, a)
    raw.send(request)
    raw.send(request)
    error = await raw.expect_error("bad_gemm")
    assert "already in flight" in error.reason
    await wait_for_condition(lambda: not f.emu.scheduler.queued, 5, "its tiles to be dropped")


def _empty_gemm(gemm: int, rows: int) -> Gemm:
    """rows × 10 tiles of 1×1 at block 1, with k = 0: no operand bytes."""
    return Gemm(gemm=gemm, dtype="float32", ta=False, tb=False, m=rows, n=10, k=0, lda=1,
                ldb=10, segments=(b"", b""))  # fmt: skip


def _server_end(f: Fleet, peer_id: int) -> Any:
    """The emulator's connection to the job (or probe peer) it welcomed as ``peer_id``."""
    return next(p for p in f.emu.peers if p.job_id == peer_id)


async def test_a_job_waits_while_its_gemms_in_flight_hold_max_job_tiles(fleet):
    """Past ``max_job_tiles`` tiles in flight the emulator reads no more of the job's
    requests (they wait, nothing is lost) until RESULTs bring it back below. A GEMM that
    alone has more is refused. Waiting is not silence: the job is not dropped."""
    f = await fleet(max_job_tiles=100, heartbeat_s=0.1, heartbeat_timeout_s=1.0)
    alone = await f.raw_peer()
    await alone.hello("job", name="one-too-many")
    alone.send(Open(block=1))
    alone.send(_empty_gemm(1, 11))
    error = await alone.expect_error("bad_gemm")
    assert "110 tiles" in error.reason and "max_job_tiles=100" in error.reason

    job = await f.raw_peer()
    welcome = await job.hello("job", name="pipelined")
    job.send(Open(block=1))
    for gemm in (1, 2, 3):  # 60 tiles each; no device yet, so none finishes
        job.send(_empty_gemm(gemm, 6))
    end = _server_end(f, welcome.peer_id)
    await wait_for_condition(lambda: not end.reading, 5, "the emulator to stop reading")
    await asyncio.sleep(1.5)  # past heartbeat_timeout_s
    assert end.open and end.tiles_in_flight == 120 and sorted(end.gemms) == [1, 2]
    job.send(Heartbeat())  # read once the emulator reads again, as a client's would be
    await f.add_device()
    results = [await job.recv_skipping_heartbeats(timeout=TIMEOUT) for _ in range(3)]
    assert sorted(r.gemm for r in results) == [1, 2, 3] and {r.tiles for r in results} == {60}
    assert end.tiles_in_flight == 0 and end.reading
    await check_serving(await f.client())


async def test_a_job_waits_while_its_gemms_in_flight_hold_max_job_bytes(fleet):
    """The operands the emulator received count, as well as the outputs it holds."""
    f = await fleet(max_job_bytes=1 << 20)
    job = await f.raw_peer()
    welcome = await job.hello("job", name="wide")
    job.send(Open())
    k = 1 << 16  # 1×k times k×1: 512 KiB of operands for a 4-byte C
    for gemm in (1, 2, 3):
        a, b = np.ones((1, k), np.float32), np.full((k, 1), gemm, np.float32)
        job.send(dataclasses.replace(gemm_request(a, b), gemm=gemm))
    end = _server_end(f, welcome.peer_id)
    await wait_for_condition(lambda: not end.reading, 5, "the emulator to stop reading")
    assert sorted(end.gemms) == [1, 2] and end.bytes_in_flight == 2 * (8 * k + 4)
    await f.add_device()
    results = [await job.recv_skipping_heartbeats(timeout=TIMEOUT) for _ in range(3)]
    assert {r.gemm: np.frombuffer(r.segments[0], np.float32)[0] for r in results} == {
        1: k,
        2: 2 * k,
        3: 3 * k,
    }
    assert end.bytes_in_flight == 0


async def test_the_blocking_client_reads_replies_while_its_send_waits(fleet):
    """A GEMM that timed out leaves its RESULT (32 MiB: more than the kernel's socket
    buffers hold) unread, past the high-water mark: the emulator reads no more from the
    job. The next GEMM's 32 MiB of operands cannot all fit in the socket buffers either, so
    the client's send must read that RESULT while it waits, or both sides would wait on
    each other (until the job was dropped)."""
    f = await fleet(high_water_bytes=64 << 10, block_size=256, heartbeat_timeout_s=3.0)
    rng = np.random.default_rng(31)
    stale = rng.standard_normal((2048, 8), dtype=np.float32)
    a = rng.standard_normal((1024, 4096), dtype=np.float32)
    b = rng.standard_normal((4096, 1024), dtype=np.float32)

    def job() -> np.ndarray:
        with Client(f.host, f.port, name="patient", share_memory=False) as client:
            with pytest.raises(TimeoutError):
                client.matmul(np.vstack([stale, stale]), stale.T, timeout=0.2)  # no device
            assert added.wait(10)
            end = _server_end(f, client.job_id)
            deadline = time.monotonic() + 10
            while end.reading and time.monotonic() < deadline:
                time.sleep(0.01)  # until its RESULT is queued, unread
            assert not end.reading, "the emulator still reads the job"
            return client.matmul(a, b, timeout=60)

    added = threading.Event()
    running = asyncio.create_task(asyncio.to_thread(job))
    await asyncio.sleep(0.5)
    await f.add_device()
    added.set()
    c = await asyncio.wait_for(running, 90)
    np.testing.assert_allclose(c, reference(a, b), rtol=1e-3, atol=1e-3)


async def test_a_send_cut_short_leaves_the_blocking_client_closed_not_stuck(fleet):
    """Ctrl-C in the middle of a large request: what went out is part of a frame, so the
    connection is given up at once (``close`` does not wait 30 s for a CLOSE that cannot
    come, and the next call fails instead of hanging)."""
    f = await fleet()
    await f.add_device()
    a = np.ones((2048, 4096), np.float32)  # 32 MiB: more than one send takes

    def job() -> tuple[EmulatorError | None, float, str]:
        client = Client(f.host, f.port, name="interrupted", share_memory=False)

        channel = client._channel
        wait = channel._await_room

        def interrupted() -> None:
            channel._await_room = wait  # once: a second Ctrl-C would stop the test run
            raise KeyboardInterrupt

        channel._await_room = interrupted  # as if Ctrl-C came while the send waited
        with pytest.raises(KeyboardInterrupt):
            client.matmul(a, a[:1].T, timeout=30)
        start = time.monotonic()
        client.close()
        closing = time.monotonic() - start
        with pytest.raises(EmulatorError) as info:
            client.matmul(a[:4], a[:1].T, timeout=30)
        return client.error, closing, info.value.code

    error, closing, code = await asyncio.wait_for(asyncio.to_thread(job), 60)
    assert error is not None and "cut off" in error.reason
    assert closing < 2.0 and code == "disconnected"
    await check_serving(await f.client())


async def test_the_blocking_client_gives_up_on_a_silent_emulator():
    """An emulator heartbeats a quiet peer; one that says nothing for three periods (a
    SIGSTOPped process, a host gone without a FIN) is given up, as ``AsyncClient`` does,
    instead of waiting for ever."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(codec.encode_bytes(Greeting(version=1, nonce=bytes(16), auth=False)))
        await reader.read(1 << 16)  # HELLO
        writer.write(codec.encode_bytes(Welcome(peer_id=1, heartbeat_s=0.2)))
        while await reader.read(1 << 20):  # then reads everything and answers nothing
            pass

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def job() -> tuple[str, float]:
        with Client("127.0.0.1", port, name="patient", share_memory=False) as client:
            start = time.monotonic()
            with pytest.raises(EmulatorError) as info:
                client.matmul(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32))
            return info.value.code, time.monotonic() - start

    try:
        code, waited = await asyncio.wait_for(asyncio.to_thread(job), 20)
    finally:
        server.close()
    assert code == "timeout" and 0.5 < waited < 5.0, (code, waited)


def _outer_gemm(gemm: int, rows: int, cols: int) -> Gemm:
    """A rows × cols C of ``gemm``s from a rows × 1 and a 1 × cols operand: little in, much
    out."""
    a, b = np.ones((rows, 1), np.float32), np.full((1, cols), float(gemm), np.float32)
    return dataclasses.replace(gemm_request(a, b), gemm=gemm)


async def _job_not_reading(f: Fleet, name: str, gemms: list[Gemm]) -> tuple[RawPeer, Any]:
    """A job that sends ``gemms`` and reads nothing from its socket (with a small receive
    buffer, so that its RESULTs soon back up), and the emulator's end of it."""
    job = await f.raw_peer(rcvbuf=16 << 10)
    welcome = await job.hello("job", name=name)
    job.stop_reading()
    job.send(Open())
    for gemm in gemms:
        job.send(gemm)
    return job, _server_end(f, welcome.peer_id)


async def test_a_job_that_does_not_read_its_results_is_held_back_then_dropped(fleet):
    """RESULTs a job leaves unread fill the send buffer: past its high-water mark the
    emulator reads no more requests from it, so what it holds for the job stays within
    the send buffer's mark plus ``max_job_bytes`` of outputs in flight; a job that reads
    nothing for heartbeat_timeout_s is dropped. Before, it buffered every RESULT."""
    high_water, max_bytes, side, count = 64 << 10, 1 << 20, 256, 96  # 256 KiB a RESULT
    f = await fleet(high_water_bytes=high_water, max_job_bytes=max_bytes, block_size=256,
                    heartbeat_s=0.2, heartbeat_timeout_s=1.5)  # fmt: skip
    await f.add_device()
    gemms = [_outer_gemm(gemm, side, side) for gemm in range(1, count + 1)]
    _, end = await _job_not_reading(f, "deaf", gemms)
    most, deadline = 0, time.monotonic() + 20
    while end.transport is not None and time.monotonic() < deadline:
        most = max(most, end.transport.get_write_buffer_size())
        await asyncio.sleep(0.005)
    assert most <= high_water + max_bytes + 2 * side * side * 4, most
    assert end.totals["gemms"] < count / 2, end.totals  # the rest were never read
    # Dropped for good, and what it held with it: not left closing behind unread bytes.
    assert end.transport is None and end not in f.emu.peers
    await check_serving(await f.client())


async def test_a_job_that_reads_slower_than_its_results_come_gets_them_all(fleet):
    """Held back, not dropped, while it reads, however slowly, and every RESULT arrives in
    full. What it takes is judged from the emulator's buffer and the kernel's send queue
    together: on loopback the queue holds megabytes, and drains first."""
    count, rows, cols = 32, 256, 1024  # 1 MiB a RESULT
    f = await fleet(high_water_bytes=64 << 10, max_job_bytes=8 << 20, block_size=256,
                    heartbeat_s=0.2, heartbeat_timeout_s=1.5)  # fmt: skip
    await f.add_device()
    gemms = [_outer_gemm(gemm, rows, cols) for gemm in range(1, count + 1)]
    job, end = await _job_not_reading(f, "slow", gemms)
    await wait_for_condition(lambda: not end.reading, 5, "the emulator to stop reading")
    job.writer.transport.resume_reading()
    start = time.monotonic()
    while time.monotonic() - start < 4.0:  # over twice heartbeat_timeout_s, at ~400 KB/s
        job.decoder.receive_data(await job.reader.read(40_000))
        job.send(Heartbeat())
        await asyncio.sleep(0.1)
    assert end.open, "dropped while it read"
    seen: set[int] = set()
    while len(seen) < count:
        result = await job.recv_skipping_heartbeats(timeout=TIMEOUT)
        assert isinstance(result, Result), result
        c = np.frombuffer(result.segments[0], np.float32)
        assert c.size == rows * cols and np.all(c == result.gemm)
        seen.add(result.gemm)
    assert seen == set(range(1, count + 1))


async def test_probe_requests_past_the_high_water_mark_are_refused(fleet):
    """Past the send buffer's high-water mark (``pause_writing``, called here as the transport
    would), a peer's probe request is refused as ``overload``: one that asks without reading
    cannot make the replies pile up. Everyone else is served throughout."""
    f, client = await serving_fleet(fleet)
    device = await f.raw_peer()
    await device.hello("device", name="flood", profile=BUILTIN["rpi4"].to_wire())
    next(p for p in f.emu.peers if p.device and p.device.name == "flood").pause_writing()
    device.send(ProbeEcho(probe=1, segments=(np.zeros(64, np.uint8),)))
    await device.expect_error("overload")
    await check_serving(client)


async def test_silent_connection_times_out_waiting_for_hello(fleet):
    f, client = await serving_fleet(fleet, hello_timeout_s=0.4)
    messages, eof, elapsed = await asyncio.to_thread(blocking_exchange, f.host, f.port, b"")
    assert [type(m) for m in messages] == [Greeting, Error]
    assert messages[1].code == "timeout" and "HELLO" in messages[1].reason
    assert eof
    assert 0.35 <= elapsed < 2.0, elapsed
    await check_serving(client)


async def test_truncated_frame_then_disconnect(fleet):
    f, client = await serving_fleet(fleet)
    for cut in (3, codec.PREFIX.size, codec.PREFIX.size + 5, len(_gemm_frame()) - 7):
        raw = await f.raw_peer()
        await raw.hello("job", name="cut")
        raw.send(Open())
        raw.send_bytes(_gemm_frame()[:cut])
        await raw.writer.drain()
        raw.close()
        await wait_for_condition(lambda: len(f.emu.peers) == 3, 5, "the peer to be dropped")
    # And before HELLO, from a blocking socket that leaves mid-header.
    frame = codec.encode_bytes(Hello(role="job", name="x" * 40))
    with socket.create_connection((f.host, f.port)) as sock:
        sock.sendall(frame[:20])
    await wait_for_condition(lambda: len(f.emu.peers) == 3, 5, "the peer to be dropped")
    await check_serving(client)
    assert len(f.emu.registry.devices) == 2


async def test_job_disconnecting_mid_gemm_does_not_disturb_others(fleet):
    f, client = await serving_fleet(fleet, block_size=8)
    quitter = await f.client(name="quitter")
    rng = np.random.default_rng(12)
    a = rng.standard_normal((8, 64, 32), dtype=np.float32)
    b = rng.standard_normal((32, 64), dtype=np.float32)
    doomed = asyncio.create_task(quitter.matmul(a, b, timeout=TIMEOUT))
    await wait_for_condition(lambda: f.emu.scheduler.queued, 5, "tiles to be queued")
    quitter._conn.transport.abort()
    with pytest.raises(EmulatorError):
        await doomed
    await wait_for_condition(lambda: not f.emu.scheduler.queued, 5, "its tiles to be dropped")
    await check_serving(client)


@pytest.mark.parametrize(
    ("role", "opened", "make", "code"),
    [
        ("job", False, lambda: gemm_request(np.ones((2, 2)), np.ones((2, 2))), "out_of_order"),
        ("job", True, lambda: TileResult(tile=1, compute_ns=1,
                                         segments=(np.zeros(1, np.float32),)), "out_of_order"),
        ("job", True, lambda: Hello(role="job"), "out_of_order"),
        ("job", True, lambda: Open(), "out_of_order"),
        ("device", False, lambda: gemm_request(np.ones((2, 2)), np.ones((2, 2))), "out_of_order"),
        ("device", False, lambda: Open(), "out_of_order"),
    ],
    ids=["gemm_before_open", "job_tile_result", "second_hello", "second_open", "device_gemm",
         "device_open"],
)  # fmt: skip
async def test_messages_outside_the_role_are_refused(fleet, role, opened, make, code):
    f, client = await serving_fleet(fleet)
    raw = await f.raw_peer()
    if role == "job":
        await raw.hello("job", name="raw")
    else:
        await raw.hello("device", name="raw-dev", profile=BUILTIN["rpi4"].to_wire())
    if opened:
        raw.send(Open())
    raw.send(make())
    await raw.expect_error(code)
    await check_serving(client)
    assert len(f.emu.registry.devices) == 2


def tile_operand(seg: Any, dtype: str, trans: bool, rows: int, cols: int, ld: int) -> np.ndarray:
    """op(X), [rows, cols], from a TILE segment as the protocol defines it (checked bounds)."""
    flat = np.frombuffer(seg, dtype)
    srows, scols = (cols, rows) if trans else (rows, cols)
    assert ld >= scols and len(flat) >= (srows - 1) * ld + scols, "TILE span too short"
    stored = np.lib.stride_tricks.as_strided(
        flat, (srows, scols), (ld * flat.itemsize, flat.itemsize), writeable=False
    )
    return stored.T if trans else stored


async def raw_tile_device(peer: RawPeer, *, bogus: bool, stop_after: int | None = None) -> int:
    """Compute TILEs with numpy straight from the wire format; ``bogus`` first sends a result
    for a tile never given and then every result twice. Returns the tiles answered."""
    answered = 0
    if bogus:
        peer.send(TileResult(tile=10**9, compute_ns=1, segments=(np.zeros(4, np.float32),)))
    while (msg := await peer.recv(timeout=10)) is not None:
        if msg.TYPE != MsgType.TILE:
            continue
        a = tile_operand(msg.segments[0], msg.dtype, msg.ta, msg.m, msg.k, msg.lda)
        b = tile_operand(msg.segments[1], msg.dtype, msg.tb, msg.k, msg.n, msg.ldb)
        c = np.ascontiguousarray(a @ b, dtype=msg.dtype)
        for _ in range(2 if bogus else 1):
            peer.send(TileResult(tile=msg.tile, compute_ns=1, segments=(c,)))
        answered += 1
        if stop_after is not None and answered >= stop_after:
            break
    return answered


@pytest.mark.parametrize("bogus", [False, True], ids=["honest", "duplicates"])
async def test_raw_device_computing_from_the_wire_format(fleet, bogus):
    """A device written against the protocol alone (numpy, not the agent) gets every layout
    right; results for unknown tiles and duplicates are ignored, not counted twice."""
    f = await fleet(block_size=8, policy="round-robin", window=3)
    await f.add_device(name="agent")
    peer = await f.raw_peer()
    welcome = await peer.hello("device", name="raw-dev", profile=BUILTIN["rpi4"].to_wire())
    await wait_for_condition(
        lambda: f.emu.registry.devices.get(welcome.peer_id) is not None
        and f.emu.registry.devices[welcome.peer_id].ready, 5, "the raw device to be ready",
    )  # fmt: skip
    worker = asyncio.create_task(raw_tile_device(peer, bogus=bogus))
    client = await f.client()
    rng = np.random.default_rng(20)
    cases = [("t", "pad", 3, 0), ("pad_t", "t", 0, 0), ("interleaved", "step", 2, 2),
             ("c", "pad_t", 0, 4)]  # fmt: skip
    for la, lb, batch_a, batch_b in cases:
        for dtype in (np.float32, np.float64):
            a = make_operand(rng, 21, 13, dtype, batch_a, la)
            b = make_operand(rng, 13, 19, dtype, batch_b, lb)
            c = await client.matmul(a, b, timeout=TIMEOUT)
            assert_gemm_close(c, a, b, f"{la} @ {lb} {np.dtype(dtype)}")
    record = f.emu.registry.devices[welcome.peer_id]
    assert record.completed > 0 and not record.outstanding
    peer.close()
    assert await worker == record.completed


@pytest.mark.parametrize(
    "lie",
    [
        {"segments": (np.zeros(3, np.float32),)},  # a tile of the wrong size
        {"in_place": True, "segments": (b"",)},  # "written in place", unasked (no arena here)
    ],
    ids=["wrong_size", "in_place_unasked"],
)
async def test_device_returning_a_wrong_tile_is_dropped(fleet, caplog, lie):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=8, policy="round-robin", window=2)
    peer = await f.raw_peer()
    welcome = await peer.hello("device", name="liar", profile=BUILTIN["rpi4"].to_wire())
    await f.add_device(name="honest")
    client = await f.client()
    rng = np.random.default_rng(21)
    a = rng.standard_normal((2, 32, 16), dtype=np.float32)
    b = rng.standard_normal((16, 32), dtype=np.float32)
    request = gemm_request(a, b)
    running = asyncio.create_task(client.submit(request, timeout=TIMEOUT))
    tile = await peer.recv_skipping_heartbeats()
    assert tile is not None and tile.TYPE == MsgType.TILE, tile
    peer.send(TileResult(tile=tile.tile, compute_ns=1, **lie))
    while (msg := await peer.recv()) is not None and msg.TYPE in (MsgType.TILE, MsgType.HEARTBEAT):
        pass  # the window's other tile
    assert isinstance(msg, Error) and msg.code == "bad_result", msg
    assert str(tile.tile) in msg.reason
    assert await peer.recv() is None
    result = await running
    assert_gemm_close(result_array(result, request), a, b)
    assert welcome.peer_id in result.devices
    assert welcome.peer_id not in f.emu.registry.devices
    # The wrong tile counts as re-queued, beside those the liar held when it was dropped.
    lost = [r.getMessage() for r in caplog.records if "re-queued tiles" in r.getMessage()]
    held = re.search(r"lost with (\d+) tiles in flight and (\d+) queued", "".join(lost))
    assert result.requeued == 1 + (int(held[1]) + int(held[2]) if held else 0), lost
    await check_serving(client)


async def test_emulator_stop_says_bye_to_jobs_and_devices(fleet):
    f = await fleet()
    gate = threading.Event()  # the device holds its tile: the GEMM is in flight at shutdown
    stuck_workers = WorkerPool([GatedCpuBackend(gate)])
    try:
        agent = await f.add_device(name="bystander", workers=stuck_workers)
        client = await f.client()
        running = asyncio.create_task(client.matmul(np.ones((9, 9)), np.ones((9, 9)), timeout=5))
        raw = await f.raw_peer()
        await raw.hello("job")
        record = f.record(agent)
        await wait_for_condition(lambda: record.outstanding, 5, "the tile to be in flight")
        await f.emu.stop()
        with pytest.raises(EmulatorError) as info:
            await running
        assert info.value.code == "bye"
        assert isinstance(await raw.recv_skipping_heartbeats(), Bye)
        assert await raw.recv() is None
        assert await asyncio.wait_for(f.tasks[agent], 5) == 0
        assert agent.last_error is None
    finally:
        gate.set()
        stuck_workers.close()


# -- 6. heartbeats ---------------------------------------------------------------------------


async def test_silent_job_is_dropped_after_heartbeat_timeout(fleet):
    f, client = await serving_fleet(fleet, heartbeat_s=0.1, heartbeat_timeout_s=0.5)
    stop = asyncio.Event()

    async def keep_busy() -> int:  # the good job keeps talking, so it stays
        done = 0
        while not stop.is_set():
            await check_serving(client, seed=done)
            done += 1
            await asyncio.sleep(0.05)
        return done

    busy = asyncio.create_task(keep_busy())
    raw = await f.raw_peer()
    await raw.hello("job", name="silent")
    raw.send(Open(name="silent"))
    start = time.monotonic()
    heartbeats = 0
    while isinstance(msg := await raw.recv(timeout=5), Heartbeat):
        heartbeats += 1
    elapsed = time.monotonic() - start
    stop.set()
    assert isinstance(msg, Error) and msg.code == "timeout", msg
    assert await raw.recv() is None, "closed after the ERROR"
    assert 0.45 <= elapsed < 2.0, elapsed
    assert heartbeats >= 2, "the emulator heartbeats a quiet peer"
    assert await busy >= 3
    await check_serving(client)


async def test_idle_blocking_client_heartbeats_and_stays(fleet):
    """The blocking client's heartbeat thread keeps a job alive while its script is
    busy elsewhere for longer than the emulator's heartbeat timeout."""
    f = await fleet(heartbeat_s=0.1, heartbeat_timeout_s=0.4)
    await f.add_device()
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((2, 20, 20)).astype(np.float32)

    def job() -> tuple[np.ndarray, np.ndarray]:
        with Client(f.host, f.port, name="idle") as client:
            first = client.matmul(a, b, timeout=TIMEOUT)
            time.sleep(1.2)  # three heartbeat timeouts without a request
            return first, client.matmul(a, b, timeout=TIMEOUT)

    for c in await asyncio.to_thread(job):
        assert_gemm_close(c, a, b)


async def test_blocking_client_times_out_and_reports_a_closed_emulator(fleet):
    f = await fleet()  # no devices: a GEMM waits for ever
    a = np.ones((8, 8), np.float32)

    def job() -> Client:
        client = Client(f.host, f.port, name="waiting")
        with pytest.raises(TimeoutError):
            client.matmul(a, a, timeout=0.3)
        return client

    client = await asyncio.to_thread(job)
    await f.emu.stop()
    with pytest.raises(EmulatorError) as info:
        await asyncio.to_thread(client.matmul, a, a, timeout=TIMEOUT)
    assert info.value.code in ("bye", "disconnected"), info.value
    assert client.close() is None


async def test_heartbeating_raw_peer_is_kept_and_heartbeated(fleet):
    f = await fleet(heartbeat_s=0.1, heartbeat_timeout_s=0.4)
    raw = await f.raw_peer()
    await raw.hello("job", name="alive")
    raw.send(Open())
    received: list[Message] = []

    async def read() -> None:
        while (msg := await raw.recv(timeout=5)) is not None:
            received.append(msg)

    reader = asyncio.create_task(read())
    for _ in range(15):  # 1.5 s, nearly four heartbeat timeouts
        raw.send(Heartbeat())
        await asyncio.sleep(0.1)
    assert not reader.done(), f"the peer was dropped: {received[-1:]}"
    assert len(received) >= 5 and all(isinstance(m, Heartbeat) for m in received), received
    raw.close()
    await reader


async def test_quiet_device_agent_is_not_dropped(fleet):
    f = await fleet(heartbeat_s=0.1, heartbeat_timeout_s=0.4)
    agent = await f.add_device(name="quiet")
    conn, device_id = agent.connection, agent.device_id
    await asyncio.sleep(1.6)  # four heartbeat timeouts without a tile
    assert agent.connection is conn and conn.open
    assert agent.device_id == device_id and device_id in f.emu.registry.devices
    assert not f.tasks[agent].done()
    assert agent.last_error is None
    client = await f.client()
    await check_serving(client)
    assert f.record(agent).completed > 0


# -- 7. a device lost mid-run ------------------------------------------------------------------


async def test_device_lost_mid_gemm_tiles_are_requeued(fleet, caplog):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=8, window=2, policy="load-balanced")
    gate = threading.Event()
    stuck_workers = WorkerPool([GatedCpuBackend(gate)])
    try:
        await f.add_device(name="steady-0")
        await f.add_device(name="steady-1")
        victim = await f.add_device(name="victim", workers=stuck_workers)
        victim_id = victim.device_id
        client = await f.client()
        rng = np.random.default_rng(13)
        a = rng.standard_normal((4, 64, 32), dtype=np.float32)
        b = rng.standard_normal((32, 64), dtype=np.float32)
        request = gemm_request(a, b)
        running = asyncio.create_task(client.submit(request, timeout=TIMEOUT))
        record = f.record(victim)
        await wait_for_condition(lambda: len(record.outstanding) == 2, 5, "tiles on the victim")
        in_flight, queued = sorted(record.outstanding), len(record.queue)
        victim.connection.transport.abort()
        victim.stop()
        result = await running
    finally:
        gate.set()
        stuck_workers.close()
    assert_gemm_close(result_array(result, request), a, b)
    assert len(in_flight) == 2
    assert result.requeued == 2 + queued  # placed on the victim: sent, and not yet sent
    assert result.tiles == 4 * 8 * 8
    assert victim_id in result.devices  # it was given tiles, which others then computed
    assert victim_id not in f.emu.registry.devices
    lost = [r.getMessage() for r in caplog.records if "re-queued tiles" in r.getMessage()]
    assert len(lost) == 1, lost
    assert (
        f"device {victim_id} (victim) lost with 2 tiles in flight and {queued} queued" in (lost[0])
    )
    logged = [int(x) for x in re.search(r"re-queued tiles \[([\d, ]+)\]", lost[0]).group(1)
              .split(",")]  # fmt: skip
    assert sorted(logged[:2]) == in_flight and len(logged) == 2 + queued
    assert await f.tasks[victim] == 0


async def test_device_aborted_while_busy_gemm_still_completes(fleet, caplog):
    """The plain race: no gate, the device drops whenever it happens to hold tiles."""
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=8, window=2, policy="round-robin")
    agents = [await f.add_device(name=f"d{i}") for i in range(3)]
    client = await f.client()
    rng = np.random.default_rng(14)
    a = rng.standard_normal((6, 64, 48), dtype=np.float32)
    b = rng.standard_normal((48, 64), dtype=np.float32)
    request = gemm_request(a, b)
    running = asyncio.create_task(client.submit(request, timeout=TIMEOUT))
    record = f.record(agents[1])
    await wait_for_condition(
        lambda: record.completed >= 5 and record.outstanding, 10, "the device to be busy"
    )
    agents[1].connection.transport.abort()
    agents[1].stop()
    result = await running
    assert_gemm_close(result_array(result, request), a, b)
    lost = [r.getMessage() for r in caplog.records if "re-queued tiles" in r.getMessage()]
    if result.requeued:
        assert len(lost) == 1 and "re-queued tiles" in lost[0], lost
        moved = re.search(r"lost with (\d+) tiles in flight and (\d+) queued", lost[0])
        assert int(moved[1]) + int(moved[2]) == result.requeued, lost
    await check_serving(client)


# -- 8. probes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "virtual", "measured"),
    [("measured", True, True), ("declared", True, False), ("auto", True, False),
     ("auto", False, True)],
)  # fmt: skip
async def test_probed_device_profile_source(fleet, caplog, source, virtual, measured):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(probe=True, profile_source=source)
    agent = await f.add_device("rpi4", virtual=virtual, name="probed")
    record = f.record(agent)
    deltas = [r.getMessage() for r in caplog.records if "PROFILE_DELTA" in r.getMessage()]
    assert len(deltas) == 1 and "device 0 (probed)" in deltas[0], deltas
    assert "latency" in deltas[0] and "GFLOP/s" in deltas[0]
    if measured:
        assert record.model.source == "measured"
        assert record.model.dl_bw != BUILTIN["rpi4"].dl_bw
    else:
        assert record.model == BUILTIN["rpi4"]
        assert record.model.source.startswith("derived from published figures")
    assert record.declared == BUILTIN["rpi4"]
    client = await f.client()
    await check_serving(client)


async def raw_device(peer: RawPeer, flops_reply: Any, *, ack_push: bool = True) -> dict[str, Any]:
    """Speak the device side by hand, answering the FLOPS challenge with ``flops_reply``
    (not at all if None) and PROBE_PUSH only if ``ack_push``."""
    seen: dict[str, Any] = {"tiles": 0, "verdict": None, "error": None, "types": []}
    while (msg := await peer.recv(timeout=10)) is not None:
        seen["types"].append(msg.TYPE.name)
        t = msg.TYPE
        if t == MsgType.PROBE_ECHO and not msg.reply:
            peer.send(ProbeEcho(probe=msg.probe, reply=True, segments=(bytes(msg.segments[0]),)))
        elif t == MsgType.PROBE_PUSH and ack_push:
            peer.send(ProbeAck(probe=msg.probe, nbytes=msg.segments[0].nbytes))
        elif t == MsgType.PROBE_PULL:
            peer.send(ProbePulled(probe=msg.probe, segments=(np.zeros(msg.nbytes, np.uint8),)))
        elif t == MsgType.PROBE_FLOPS and flops_reply is not None:
            c = flops_reply(msg.seed, msg.dim)
            peer.send(ProbeFlopsResult(probe=msg.probe, compute_ns=10_000, segments=(c,)))
        elif t == MsgType.PROBE_VERDICT:
            seen["verdict"] = msg
            if msg.ok:
                break
        elif t == MsgType.ERROR:
            seen["error"] = msg
        elif t == MsgType.TILE:
            seen["tiles"] += 1
    return seen


def _right(seed: int, dim: int) -> np.ndarray:
    a, b = challenge.matrices(seed, dim)
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


FLOPS_REPLIES = {
    "right": (_right, None),
    "zeros": (lambda seed, dim: np.zeros((dim, dim), np.float32), "flops_failed"),
    "wrong_size": (lambda seed, dim: np.zeros((dim, dim + 1), np.float32), "flops_failed"),
    "nan": (lambda seed, dim: np.full((dim, dim), np.nan, np.float32), "flops_failed"),
}


@pytest.mark.parametrize("reply", sorted(FLOPS_REPLIES))
async def test_flops_challenge_through_a_raw_device(fleet, caplog, reply):
    caplog.set_level(logging.INFO, logger="morphling")
    flops_reply, code = FLOPS_REPLIES[reply]
    f = await fleet(probe=True, block_size=8)
    await f.add_device(name="honest")
    client = await f.client()
    rng = np.random.default_rng(15)
    a = rng.standard_normal((4, 64, 16), dtype=np.float32)
    b = rng.standard_normal((16, 64), dtype=np.float32)
    running = asyncio.create_task(client.matmul(a, b, timeout=TIMEOUT))  # tiles to steal

    peer = await f.raw_peer()
    welcome = await peer.hello(
        "device", name=f"raw-{reply}", uuid="raw", profile=BUILTIN["rpi4"].to_wire(),
        caps={"virtual": True},
    )  # fmt: skip
    seen = await asyncio.wait_for(raw_device(peer, flops_reply), 15)
    assert seen["verdict"] is not None, seen["types"]
    if code is None:
        assert seen["verdict"].ok and seen["verdict"].flops > 0
        await wait_for_condition(
            lambda: f.emu.registry.devices[welcome.peer_id].ready, 5, "the raw device ready"
        )
    else:
        assert not seen["verdict"].ok and seen["verdict"].reason
        assert seen["error"] is not None and seen["error"].code == code, seen
        assert seen["tiles"] == 0, "a device that failed its FLOPS challenge got tiles"
        assert welcome.peer_id not in f.emu.registry.devices
        assert "TILE" not in seen["types"]
    peer.close()
    assert_gemm_close(await running, a, b)
    await check_serving(client)


@pytest.mark.parametrize("answers", [True, False], ids=["answers", "silent"])
async def test_a_device_that_leaves_a_push_unanswered_is_still_challenged(fleet, answers):
    """A network probe that runs out of time keeps the declared link but never skips the
    FLOPS check: a device that answers no challenge gets no tiles."""
    f = await fleet(probe=True, profile_source="measured", probe_timeout_s=1.0, block_size=8)
    peer = await f.raw_peer()
    welcome = await peer.hello(
        "device", name="no-ack", uuid="raw", profile=BUILTIN["rpi4"].to_wire(),
        caps={"virtual": False},
    )  # fmt: skip
    flops_reply = _right if answers else None
    seen = await asyncio.wait_for(raw_device(peer, flops_reply, ack_push=False), 15)
    assert "PROBE_FLOPS" in seen["types"], seen["types"]
    assert seen["verdict"] is not None and seen["verdict"].ok is answers, seen
    if answers:
        await wait_for_condition(
            lambda: f.emu.registry.devices[welcome.peer_id].ready, 5, "the raw device ready"
        )
        model = f.emu.registry.devices[welcome.peer_id].model
        assert model.source == "measured FLOPS, declared link"
        assert model.flops == pytest.approx(seen["verdict"].flops)
        declared = BUILTIN["rpi4"]
        assert (model.dl_bw, model.ul_bw, model.dl_lat_s) == (
            declared.dl_bw, declared.ul_bw, declared.dl_lat_s
        )  # fmt: skip
    else:
        assert seen["error"].code == "flops_failed" and "no result within" in seen["error"].reason
        assert seen["tiles"] == 0 and welcome.peer_id not in f.emu.registry.devices
    peer.close()


async def test_a_peer_asks_for_one_challenge_at_a_time(fleet):
    f = await fleet()
    await f.add_device()
    peer = await f.raw_peer()
    await peer.hello("probe", name="eager")
    for _ in range(2):  # one after the other: each verdict frees the next
        peer.send(ProbeFlopsRequest(dim=16))
        challenge_msg = await peer.recv_skipping_heartbeats()
        assert isinstance(challenge_msg, ProbeFlops) and challenge_msg.dim == 16
        c = _right(challenge_msg.seed, 16)
        peer.send(ProbeFlopsResult(probe=challenge_msg.probe, compute_ns=1000, segments=(c,)))
        verdict = await peer.recv_skipping_heartbeats()
        assert verdict.TYPE == MsgType.PROBE_VERDICT and verdict.ok, verdict
    peer.send(ProbeFlopsRequest(dim=16))
    assert isinstance(await peer.recv_skipping_heartbeats(), ProbeFlops)
    peer.send(ProbeFlopsRequest(dim=16))  # before the first one's verdict
    refused = await peer.recv_skipping_heartbeats()
    assert isinstance(refused, Error) and refused.code == "overload", refused
    assert "PROBE_VERDICT" in refused.reason
    assert await peer.recv_skipping_heartbeats() is None
    await check_serving(await f.client())


async def test_a_check_keeps_its_slot_until_done_though_its_peer_left(fleet, monkeypatch):
    """The check of a challenge a peer asked for runs on after the peer leaves, and holds
    its slot until it ends: else a peer could start any number by leaving mid-check. The
    checks of arriving devices have a slot of their own meanwhile."""
    release = threading.Event()
    check = probes.check_result

    def held(seed: int, dim: int, got: memoryview, tolerance: float) -> str:
        if dim == 16:  # the peer's; an arriving device's is FAST's 32
            release.wait(30)
        return check(seed, dim, got, tolerance)

    monkeypatch.setattr(probes, "check_result", held)
    f = await fleet(probe=True)
    peer = await f.raw_peer()
    welcome = await peer.hello("probe", name="leaver")
    peer.send(ProbeFlopsRequest(dim=16))
    asked = await peer.recv_skipping_heartbeats()
    assert isinstance(asked, ProbeFlops)
    c = _right(asked.seed, 16)
    peer.send(ProbeFlopsResult(probe=asked.probe, compute_ns=1000, segments=(c,)))
    slot = f.emu.checking_asked
    await wait_for_condition(slot.locked, 5, "the check to start")
    peer.close()
    await wait_for_condition(
        lambda: all(p.job_id != welcome.peer_id for p in f.emu.peers), 5, "the peer to go"
    )
    assert slot.locked(), "the slot was given back while its check still runs"
    device = await asyncio.wait_for(f.add_device(name="arriving"), 10)  # checked meanwhile
    assert f.record(device).ready and slot.locked()
    release.set()
    await wait_for_condition(lambda: not slot.locked(), 5, "the check to end")


async def test_checking_the_largest_challenge_does_not_stall_the_server(fleet):
    """The reference for dim 4096 (its operands rebuilt, a 137 GFLOP GEMM, the check) is
    computed off the event loop: on it, this stalled every peer for seconds."""
    f = await fleet(heartbeat_s=2.0, heartbeat_timeout_s=30.0)  # a stall must not trip these
    peer = await f.raw_peer()
    await peer.hello("probe", name="big")
    peer.send(ProbeFlopsRequest(dim=4096))
    challenge_msg = await peer.recv_skipping_heartbeats()
    assert isinstance(challenge_msg, ProbeFlops)
    c = np.zeros((4096, 4096), np.float32)  # wrong, but checked in full all the same
    peer.send(ProbeFlopsResult(probe=challenge_msg.probe, compute_ns=1000, segments=(c,)))
    gaps: list[float] = []
    last = time.monotonic()
    verdict = asyncio.create_task(peer.recv_skipping_heartbeats(timeout=60))
    while not verdict.done():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    assert verdict.result().TYPE == MsgType.PROBE_VERDICT and not verdict.result().ok
    assert "elements off" in verdict.result().reason
    assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s"


# -- 9. dynamic membership ------------------------------------------------------------------------


async def test_gemm_waits_for_a_device_to_join(fleet):
    f = await fleet(block_size=16)
    client = await f.client()
    rng = np.random.default_rng(16)
    a = rng.standard_normal((2, 40, 24), dtype=np.float32)
    b = rng.standard_normal((24, 33), dtype=np.float32)
    running = asyncio.create_task(client.matmul(a, b, timeout=TIMEOUT))
    await asyncio.sleep(0.3)
    assert not running.done()
    assert f.emu.timeline.stalled == 1, "placed when a device is there"
    await f.add_device(name="late")
    assert_gemm_close(await running, a, b)
    second = await f.add_device("orin-nano", name="later")  # joins a running fleet
    await check_serving(client)
    assert f.record(second).ready


async def test_devices_leave_and_rejoin_between_gemms(fleet):
    f = await fleet(block_size=16)
    first = await f.add_device(name="first")
    client = await f.client()
    await check_serving(client, seed=1)
    first.stop()
    await wait_for_condition(lambda: not f.emu.registry.devices, 5, "the device to leave")
    rng = np.random.default_rng(17)
    a = rng.standard_normal((33, 47))
    b = rng.standard_normal((47, 18))
    running = asyncio.create_task(client.matmul(a, b, timeout=TIMEOUT))
    await asyncio.sleep(0.1)
    assert not running.done()
    await f.add_device(name="second")
    assert_gemm_close(await running, a, b)
    assert sorted(f.emu.registry.devices) == [1], "ids are never reused"


async def test_a_job_without_devices_is_told_and_fails_past_its_device_wait(fleet, caplog):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=16, device_wait_notice_s=0.2)
    client = await f.client(name="patient", device_wait_s=2.0)
    a = np.ones((20, 20), np.float32)  # 4 tiles
    started = time.monotonic()
    with pytest.raises(EmulatorError) as info:
        await client.matmul(a, a, timeout=TIMEOUT)
    assert time.monotonic() - started >= 2.0
    assert info.value.code == "no_devices"
    assert (
        info.value.reason
        == "no device was ready for 2 s (device_wait_s); the job had 4 tiles queued"
    )
    job = [r.getMessage() for r in caplog.records if r.name == "morphling.job"]
    assert job[0] == ("emulator: no device is ready (0 connected): the job waits with 4 tiles "
                      "queued; it fails after 2 s (device_wait_s)")  # fmt: skip
    progress = r"emulator: waiting for devices: 0 connected, 4 tiles queued, waited [\d.]+ s of 2"
    assert any(re.fullmatch(progress, m) for m in job), job
    assert "job 1 (patient): no device is ready" in caplog.text, "the emulator logs it too"
    await f.add_device(name="late")  # the emulator serves on
    await check_serving(await f.client())


async def test_a_job_is_told_when_devices_are_back_and_its_gemm_completes(fleet, caplog):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=16, device_wait_notice_s=0.2)
    client = await f.client()  # device_wait_s 0: it waits for ever
    a = np.ones((20, 20), np.float32)
    running = asyncio.create_task(client.matmul(a, a, timeout=TIMEOUT))
    await wait_for_condition(lambda: "waiting for devices" in caplog.text, 10, "a progress line")
    assert "it waits for ever (device_wait_s)" in caplog.text
    await f.add_device(name="late")
    assert_gemm_close(await running, a, a)
    assert "emulator: devices are back: 1 ready after " in caplog.text
    assert "sending the job's 4 tiles queued" in caplog.text


async def test_a_negative_device_wait_is_refused(fleet):
    f = await fleet()
    client = await f.client(device_wait_s=-1.0)
    with pytest.raises(EmulatorError) as info:
        await client.matmul(np.ones((4, 4)), np.ones((4, 4)), timeout=TIMEOUT)
    assert info.value.code == "bad_open" and "device_wait_s=-1.0" in info.value.reason


def test_reconnect_waits_double_with_jitter_up_to_the_cap():
    for attempt in range(8):
        base = min(4.0, 0.25 * 2**attempt)
        waits = [backoff_s(attempt, 4.0) for _ in range(200)]
        assert base / 2 <= min(waits) and max(waits) <= base, (attempt, waits)
        assert max(waits) - min(waits) > base / 4, "no jitter"
    # An agent retrying for days: still capped, where 0.25·2**n overflowed past n = 1023.
    assert 2.0 <= backoff_s(5000, 4.0) <= 4.0


async def test_a_device_retries_an_emulator_that_is_not_there(fleet, caplog):
    """Each wait is as ``backoff_s`` says, and ``stop()`` still ends it with 0."""
    caplog.set_level(logging.INFO, logger="morphling")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    f = await fleet()
    agent = f.agent(name="patient")
    running = asyncio.create_task(agent.run("127.0.0.1", port, max_backoff_s=0.5))
    await asyncio.sleep(1.5)
    waits = [float(m) for m in re.findall(r"patient: reconnecting in ([\d.]+) s", caplog.text)]
    assert len(waits) >= 3, waits
    for attempt, wait in enumerate(waits):
        base = min(0.5, 0.25 * 2**attempt)
        assert base / 2 - 0.005 <= wait <= base + 0.005, (attempt, waits)  # logged as %.2f
    assert f"cannot reach 127.0.0.1:{port}" in caplog.text
    agent.stop()
    assert await asyncio.wait_for(running, 5) == 0


async def test_job_waiting_longer_than_heartbeat_timeout_keeps_its_connection(fleet):
    """The job's own HEARTBEATs keep it while it waits for a device."""
    f = await fleet(block_size=16, heartbeat_s=0.1, heartbeat_timeout_s=0.4)
    client = await f.client()
    a = np.ones((20, 20), np.float32)
    running = asyncio.create_task(client.matmul(a, a, timeout=TIMEOUT))
    await asyncio.sleep(1.0)  # no device yet; 2.5 heartbeat timeouts
    await f.add_device(name="late")
    assert_gemm_close(await running, a, a)


async def test_an_empty_gemms_host_time_is_coordinator_time(fleet):
    """A GEMM with no output has no tiles, but the host time before it is still the
    script's own: it counts in the step (it was dropped)."""
    f = await fleet()
    job = await f.raw_peer()
    await job.hello("job", name="empty")
    job.send(Open())
    for gemm, host_ns in ((1, 0), (2, 50_000_000)):  # (the first's is setting up the job)
        b = np.zeros(15, np.float32)
        job.send(Gemm(gemm=gemm, dtype="float32", ta=False, tb=False, m=0, n=5, k=3, lda=3,
                      ldb=5, host_ns=host_ns, segments=(b"", b)))  # fmt: skip
        result = await job.recv_skipping_heartbeats()
        assert isinstance(result, Result) and result.gemm == gemm and result.tiles == 0
    job.send(Step(step=1))
    step = await job.recv_skipping_heartbeats()
    assert step.TYPE == MsgType.STEP and step.coord_ns == 50_000_000, step


async def test_empty_output_gemm_does_not_stall_the_server(fleet):
    f = await fleet(heartbeat_s=2.0, heartbeat_timeout_s=10.0)  # a stall must not trip these
    client = await f.client(block=1)
    gaps: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    a = np.empty((1 << 23, 0), np.float32)  # 8 Mi rows of nothing: one empty row block each
    b = np.empty((0, 0), np.float32)
    c = await client.matmul(a, b, timeout=TIMEOUT)
    stop.set()
    await ticker
    assert c.shape == (1 << 23, 0)
    assert max(gaps) < 0.2, f"the event loop stalled for {max(gaps):.2f} s on an empty GEMM"


async def test_inflight_bytes_bound_all_devices_together(fleet):
    """With room for one tile's operands, one tile is out at a time over all devices."""
    f = await fleet(block_size=8, inflight_bytes=1, window=4)
    for _ in range(3):
        await f.add_device()
    most = 0
    send = f.emu.scheduler._send

    def counting(device: DeviceRecord, tile: Any, message: Any) -> None:
        nonlocal most
        most = max(most, sum(len(d.outstanding) for d in f.emu.registry.devices.values()))
        send(device, tile, message)

    f.emu.scheduler._send = counting
    client = await f.client()
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 32, 32)).astype(np.float32)
    assert_gemm_close(await client.matmul(a, b, timeout=TIMEOUT), a, b)
    assert most == 1
    assert f.emu.scheduler.inflight_bytes == 0

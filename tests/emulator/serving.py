"""An emulator serving a fleet in the test's own event loop, and what its tests share.

Each test starts its own ``Emulator`` on 127.0.0.1 port 0 with short timeouts and small
probes (``FAST``), virtual ``DeviceAgent``s sharing one ``WorkerPool`` and ``BufferPool``,
and jobs through ``AsyncClient`` / ``Client``: real loopback sockets, no mocks.
Misbehaving peers are ``raw_peer.RawPeer``s. The ``fleet`` fixture (conftest) tears
everything down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from typing import Any

import numpy as np
import pytest
from morphling.devices.agent import INLINE_FLOPS, DeviceAgent
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.emulator.registry import DeviceRecord
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.job.client import AsyncClient
from morphling.proxy.wire.messages import (
    Gemm,
    Result,
)
from raw_peer import RawPeer

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
    # Peers give up on an emulator silent for 3 periods: 1.5 s, not less, since the whole
    # suite on two cores can stall a test's event loop past 0.75 s (test_probes did).
    "heartbeat_s": 0.5,
    "heartbeat_timeout_s": 2.0,
    "hello_timeout_s": 1.0,
    "probe_bandwidth_bytes": 65536,
    "probe_flops_dim": 32,
    "probe_timeout_s": 3.0,
}
TIMEOUT = 20.0  # per GEMM: generous, a failure shows long before it
_gemm_ids = itertools.count(1000)  # explicit requests; matmul() numbers its own from 1


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
        self,
        profile: str = "rpi4",
        *,
        name: str = "",
        token: str = "",
        virtual: bool = True,
        workers: WorkerPool | None = None,
    ) -> DeviceAgent:
        agent = DeviceAgent(
            BUILTIN[profile],
            workers or self.workers,
            self.pool,
            name=name or f"{profile}-{len(self.agents)}",
            token=token,
            virtual=virtual,
            inline_flops=0 if workers is not None else INLINE_FLOPS,  # gated workers see all
        )
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
        gemm=next(_gemm_ids),
        dtype=a.dtype.name,
        ta=False,
        tb=False,
        m=m,
        n=n,
        k=k,
        lda=k,
        ldb=n,
        batch=batch,
        stride_a=m * k if a.ndim == 3 else 0,
        stride_b=k * n if b.ndim == 3 else 0,
        segments=(a.reshape(-1), b.reshape(-1)),
    )


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


class GatedCpuBackend(CpuBackend):
    """A real CPU backend that starts each GEMM (or convolution tile) only once ``gate`` is
    set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(1)
        self.gate = gate

    def run(self, plan: Any) -> None:
        self.gate.wait(30)
        super().run(plan)

    def call(self, fn: Any) -> Any:
        self.gate.wait(30)
        return super().call(fn)


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


async def serving_fleet(fleet: Any, **overrides: Any) -> tuple[Fleet, AsyncClient]:
    f = await fleet(**overrides)
    for _ in range(2):
        await f.add_device()
    client = await f.client(name="good")
    return f, client

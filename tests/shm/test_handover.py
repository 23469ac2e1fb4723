"""Operands handed over as arrays in the emulator's own process (``morphling.proxy.shm.handover``).

The embedded emulator, its devices and the job share one process: the job hands over its
operands and a new C, and each device the blocks of its tiles and where its C goes, over
real sockets that then carry headers only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from morphling.devices.agent import DeviceAgent
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import BufferPool, ConvGeometry, CpuBackend, WorkerPool, conv_forward
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.job.client import Client
from morphling.proxy.net import pairing
from morphling.proxy.shm import handover as local
from morphling.proxy.wire import connection
from morphling.proxy.wire.messages import Gemm, MsgType, Open
from raw_peer import RawPeer
from test_arena import CountingSocket, Served, serve, stop_served


class GatedBackend(CpuBackend):
    """A CPU worker whose kernels wait for ``gate``: a device that is slow to finish."""

    def __init__(self) -> None:
        super().__init__(1)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def run(self, plan: Any) -> None:
        self.entered.set()
        self.gate.wait(30)
        super().run(plan)


@pytest.fixture
async def emulator():
    """``await emulator(*pools)``: an emulator and one device in this process per worker
    pool given (its kernels run there), all ready; torn down after."""
    served: Served = []
    buffers = BufferPool(pin=False)

    async def make(
        *pools: WorkerPool, **config: Any
    ) -> tuple[str, int, Emulator, list[DeviceAgent]]:
        agents = [DeviceAgent(BUILTIN["rpi4"], pool, buffers, name=f"d{i}", virtual=True)
                  for i, pool in enumerate(pools)]  # fmt: skip
        return (*await serve(agents, served, **config), agents)

    yield make
    await stop_served(served)


@pytest.fixture
def workers():
    with WorkerPool([CpuBackend(1), CpuBackend(1)]) as pool:
        yield pool


def cases() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((150, 130), dtype=np.float32)
    b = rng.standard_normal((130, 90), dtype=np.float32)
    batched = rng.standard_normal((3, 70, 40))
    return [
        (a, b),
        (a.T.copy().T, b[:, ::1]),  # A stored column-major (a transposed view)
        (a[:, :100], b[:100]),  # A with a leading dimension wider than its rows
        (batched, rng.standard_normal((40, 66))),  # float64, B broadcast over the batch
        (batched, rng.standard_normal((3, 66, 40)).transpose(0, 2, 1)),  # batched, transposed
    ]


async def test_a_job_in_the_emulators_process_hands_over_its_operands(emulator, workers):
    """Results right for every layout; the socket carries headers only, no slab is asked
    for, and nothing stays behind in the registry."""
    host, port, emu, _ = await emulator(workers, workers)
    assert all(d.local for d in emu.registry.devices.values())
    pairs = cases()

    def job() -> tuple[list[np.ndarray], int, int, Any]:
        with Client(host, port, name="in-process") as client:
            counted = client._channel.sock = CountingSocket(client._channel.sock)
            products = [client.matmul(a, b) for a, b in pairs]
            return products, counted.sent, counted.received, client._slab

    products, sent, received, slab = await asyncio.to_thread(job)
    for (a, b), c in zip(pairs, products, strict=True):
        np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
        assert c.dtype == a.dtype and c.flags.c_contiguous
    operand_bytes = sum(a.nbytes + b.nbytes for a, b in pairs)
    assert sent < 4096 < operand_bytes, f"{sent} bytes sent: headers only"
    assert received < 4096, f"{received} bytes received: no C"
    assert slab is None
    assert not local._gemms and not local._tiles, "every handed-over array was taken"


async def test_hand_over_off_uses_the_slab(emulator, workers):
    host, port, _, _ = await emulator(workers)
    a, b = cases()[0]

    def job() -> tuple[np.ndarray, Any]:
        with Client(host, port, hand_over=False) as client:
            return client.matmul(a, b), client._slab

    c, slab = await asyncio.to_thread(job)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert slab is not None


async def test_the_job_gets_c_only_once_a_lost_devices_kernel_is_done(emulator, workers):
    """A device lost while its kernel computes a tile has that tile computed again
    elsewhere, but its kernel would still write into C, an array the job owns once it has
    the result: the emulator answers only after that kernel has run."""
    gated = GatedBackend()
    with WorkerPool([gated]) as slow:
        host, port, emu, agents = await emulator(workers, slow)
        # two columns of whole tiles (greedy gives each device one): each device's tiles
        # are big enough for its worker pool, not computed inline
        a, b = cases()[0][0], np.random.default_rng(8).standard_normal((130, 128), np.float32)
        answered: list[float] = []

        def job() -> np.ndarray:
            with Client(host, port) as client:
                c = client.matmul(a, b, timeout=60)
                answered.append(time.monotonic())
                return c

        running = asyncio.create_task(asyncio.to_thread(job))
        assert await asyncio.to_thread(gated.entered.wait, 10), "the slow device got a tile"
        agents[1].stop()  # lost with its tiles in flight: they go to device 0
        devices = emu.registry.devices
        for _ in range(500):  # until device 0 has computed every tile again
            if 1 not in devices and not devices[0].outstanding and not emu.scheduler.queued:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # time enough to answer, were it allowed to
        assert not answered, "answered while the lost device's kernel could still write"
        released = time.monotonic()
        gated.gate.set()
        c = await asyncio.wait_for(running, 30)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert answered[0] >= released


async def test_a_peer_elsewhere_cannot_claim_local_operands(emulator, workers):
    """A GEMM that says ``local`` but handed nothing over (a job in another process, which
    cannot) is an ERROR naming the problem."""
    host, port, emu, _ = await emulator(workers)
    raw = await RawPeer.connect(host, port)
    try:
        await raw.hello("job", caps={"process": emu.token})
        raw.send(Open())
        empty = np.ones(0, np.float32)
        raw.send(Gemm(gemm=1, dtype="float32", ta=False, tb=False, m=8, n=8, k=8, lda=8,
                      ldb=8, local=True, segments=(empty, empty)))  # fmt: skip
        error = await raw.expect_error("bad_gemm")
        assert "no operands were handed over" in error.reason, error.reason
    finally:
        raw.close()


def product(host: str, port: int, a: np.ndarray, b: np.ndarray, **kw: Any) -> np.ndarray:
    with Client(host, port, **kw) as client:
        return client.matmul(a, b)


@pytest.fixture
def encoded(monkeypatch) -> list[MsgType]:
    """The type of every message a connection in this process encodes for its socket."""
    types: list[MsgType] = []
    encode = connection.encode

    def recording(msg: Any) -> list:
        types.append(msg.TYPE)
        return encode(msg)

    monkeypatch.setattr(connection, "encode", recording)
    return types


async def test_paired_ends_hand_tiles_and_results_over_on_the_loop(emulator, workers, encoded):
    """An emulator and its devices on one loop pair their ends: TILE and TILE_RESULT without
    bytes skip the socket, and a lost device's end is unpaired."""
    host, port, emu, agents = await emulator(workers, workers)
    ends = [d.conn for d in emu.registry.devices.values()]

    def paired() -> bool:
        return all(end.partner is not None and end.partner.partner is end for end in ends)

    for _ in range(500):  # a device's end offers once it reads WELCOME: maybe after it is ready
        if paired():
            break
        await asyncio.sleep(0.01)
    assert paired()
    a, b = cases()[0]
    encoded.clear()
    c = await asyncio.to_thread(product, host, port, a, b)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert MsgType.TILE not in encoded and MsgType.TILE_RESULT not in encoded, encoded
    device_end = ends[1].partner
    agents[1].stop()
    for _ in range(500):
        if ends[1].partner is None and device_end.partner is None:
            break
        await asyncio.sleep(0.01)
    assert ends[1].partner is None and device_end.partner is None
    assert ends[1]._pairing not in pairing._offers and device_end._pairing not in pairing._offers


async def test_paired_ends_hand_convolution_tiles_over_on_the_loop(emulator, workers, encoded):
    """A convolution in the emulator's process: the job hands its operands and product
    over, each device its tile's views; CONV_TILE and TILE_RESULT skip the socket, and the
    product is the whole convolution's."""
    host, port, _, _ = await emulator(workers, workers)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 30, 20)).astype(np.float32)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    geom = ConvGeometry((3, 3), (2, 1), (1, 1), (1, 1, 2, 0), groups=2)
    shapes = {
        "input_shape": x.shape,
        "weight_shape": w.shape,
        "stride": geom.stride,
        "padding": geom.padding,
        "dilation": geom.dilation,
        "groups": 2,
    }

    def convolve() -> np.ndarray:
        with Client(host, port, block=8) as client:
            return client.conv("forward", x, w, **shapes)

    encoded.clear()
    y = await asyncio.to_thread(convolve)
    np.testing.assert_allclose(y, conv_forward(x, w, geom), rtol=1e-5, atol=1e-5)
    assert MsgType.CONV in encoded  # the request: headers only
    assert MsgType.CONV_TILE not in encoded and MsgType.TILE_RESULT not in encoded, encoded


async def test_tiles_with_bytes_still_cross_the_socket(emulator, workers, encoded):
    """Without the hand-over or the arena, operands go as bytes: over the socket, paired
    or not."""
    host, port, _, _ = await emulator(workers, arena_bytes=0)
    a, b = cases()[0]
    encoded.clear()
    c = await asyncio.to_thread(product, host, port, a, b, hand_over=False)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert MsgType.TILE in encoded and MsgType.TILE_RESULT in encoded, encoded


async def test_a_device_joining_while_tiles_wait_gets_welcome_first(emulator, workers):
    """Tiles queued before a device joins go to it as soon as it is ready, which without
    probes is right after WELCOME: none may reach it before WELCOME, paired or not."""
    host, port, emu, _ = await emulator()
    a, b = cases()[0]
    running = asyncio.create_task(asyncio.to_thread(product, host, port, a, b))
    for _ in range(500):  # until the GEMM waits for a device
        if emu.timeline.stalled:
            break
        await asyncio.sleep(0.01)
    assert emu.timeline.stalled
    agent = DeviceAgent(BUILTIN["rpi4"], workers, BufferPool(pin=False), name="late",
                        virtual=True)  # fmt: skip
    joined = asyncio.create_task(agent.run(host, port, reconnect=False))
    try:
        c = await asyncio.wait_for(running, 30)
        np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
        assert agent.last_error is None
        assert emu.registry.devices[0].conn.partner is not None
    finally:
        agent.stop()
        await asyncio.wait([joined], timeout=5)

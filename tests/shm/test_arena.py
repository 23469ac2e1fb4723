"""The operand arena: allocation in shared memory, and operands read in place over real sockets.

An emulator receives a job's large operands into its arena; devices on this
host that map it get each block as an offset (no operand bytes on the wire),
a device that does not (``share_memory=False``, as a board elsewhere) gets
bytes. Bytes are counted from each RESULT's ``bytes_down``.
"""

from __future__ import annotations

import asyncio
import gc
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from morphling.devices.agent import DeviceAgent
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.emulator.partition import make_task
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.client import AsyncClient, Client, gemm_request, result_array
from morphling.proxy.shm.arena import PAGE, OperandArena
from morphling.proxy.wire.messages import Gemm, Message, MsgType, Open, Slab, Step, TileResult

# -- the allocator -----------------------------------------------------------------------------


@pytest.fixture
def arena():
    made = OperandArena.create(64 * PAGE)
    yield made
    made.close()


def test_allocations_are_page_aligned_disjoint_and_shared(arena):
    views = [arena.allocate(n) for n in (1, PAGE, PAGE + 1, 10 * PAGE)]
    offsets = [arena.offset_of(np.frombuffer(v, np.uint8)) for v in views]
    assert offsets == [0, PAGE, 2 * PAGE, 4 * PAGE], "first fit, rounded up to pages"
    assert [len(v) for v in views] == [1, PAGE, PAGE + 1, 10 * PAGE]
    views[3][:4] = b"abcd"
    peer = OperandArena.attach(arena.announce())  # another mapping of the same file
    assert peer is not None and bytes(peer.region(4 * PAGE, 4, "uint8")) == b"abcd"
    assert arena.free_bytes == 50 * PAGE


def test_freed_extents_coalesce_and_are_reused(arena):
    views = [arena.allocate(PAGE) for _ in range(6)]
    del views[1:4]  # three neighbours go: one free extent of 3 pages
    gc.collect()
    assert arena.free_bytes == 61 * PAGE
    again = arena.allocate(3 * PAGE)
    assert arena.offset_of(np.frombuffer(again, np.uint8)) == PAGE, "the hole is reused"
    del views, again
    gc.collect()
    assert arena.free_bytes == 64 * PAGE
    assert arena.allocate(64 * PAGE) is not None, "all of it coalesced into one extent"


def test_what_does_not_fit_is_refused(arena):
    keep = arena.allocate(60 * PAGE)
    assert arena.allocate(5 * PAGE) is None and arena.full == 1
    assert arena.allocate(4 * PAGE) is not None
    del keep


def test_a_full_dev_shm_means_no_allocation_not_a_crash():
    """Pages are reserved before use: in a 1 MiB /dev/shm (a private mount namespace's;
    a default Docker container has 64 MiB), a 64 MiB arena hands out what fits and says
    None for the rest, instead of the process dying of SIGBUS when it writes."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small /dev/shm")
    script = textwrap.dedent("""
        from morphling.proxy.shm.arena import OperandArena
        arena = OperandArena.create(64 << 20)
        small = arena.allocate(512 << 10)
        small[:] = b"x" * len(small)
        print(arena.allocate(4 << 20) is None, arena.full)
        arena.close()
    """)
    command = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && "
               f"exec {shlex.quote(sys.executable)} -c {shlex.quote(script)}")  # fmt: skip
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", command],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1"]
    assert "/dev/shm has no room" in out.stderr


# -- over real sockets -------------------------------------------------------------------------


Served = list[tuple[Emulator, list[DeviceAgent], list[asyncio.Task]]]


async def serve(
    agents: list[DeviceAgent], served: Served, **config: Any
) -> tuple[str, int, Emulator]:
    """An emulator (block 64, no probes, ``config``) started with ``agents`` connected to it,
    once every one is ready; noted in ``served`` for ``stop_served``."""
    emu = Emulator(EmulatorConfig(listen_ip="127.0.0.1", listen_port=0, probe=False,
                                  block_size=64, **config))  # fmt: skip
    host, port = await emu.start()
    tasks = [asyncio.create_task(a.run(host, port, reconnect=False)) for a in agents]
    served.append((emu, agents, tasks))
    for _ in range(1000):
        if len(emu.registry.ready()) == len(agents):
            return host, port, emu
        await asyncio.sleep(0.005)
    raise AssertionError("devices not ready")


async def stop_served(served: Served) -> None:
    for emu, agents, tasks in served:
        for agent in agents:
            agent.stop()
        await emu.stop()
        if tasks:
            await asyncio.wait(tasks, timeout=5)


@pytest.fixture
async def emulator():
    served: Served = []
    workers = WorkerPool([CpuBackend(1)])
    pool = BufferPool(pin=False)

    async def make(*share: bool, **config: object) -> tuple[str, int, Emulator]:
        agents = [DeviceAgent(BUILTIN["rpi4"], workers, pool, name=f"d{i}", virtual=True,
                              share_memory=s) for i, s in enumerate(share)]  # fmt: skip
        return await serve(agents, served, **config)

    yield make
    await stop_served(served)
    workers.close()


async def product(host: str, port: int, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, Any]:
    """``a @ b`` through a job, and its RESULT (for the byte counts)."""
    client = await AsyncClient.connect(host, port, timeout=5.0)
    try:
        request, shape = gemm_request(1, a, b, None)
        result = await client.submit(request, timeout=30)
        return result_array(request, result, shape, None), result
    finally:
        await client.close()


A_SHAPE, B_SHAPE = (192, 160), (160, 128)  # 120 KiB and 80 KiB: both go to the arena


@pytest.fixture
def operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    a = rng.standard_normal(A_SHAPE, dtype=np.float32)
    return a, rng.standard_normal(B_SHAPE, dtype=np.float32)


async def test_devices_on_this_host_work_in_place(emulator, operands):
    """They read the operands and write C (192×128 floats: 96 KiB, in the arena too) there."""
    host, port, emu = await emulator(True, True)
    assert all(d.arena for d in emu.registry.devices.values()), "both map the arena"
    a, b = operands
    c, result = await product(host, port, a, b.T.copy().T)  # B stored column-major too
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert result.bytes_down == 0, "no operand bytes on the wire"
    assert result.bytes_up == 0, "no result bytes on the wire"
    assert sorted(result.devices) == [0, 1] and result.tiles == 6
    gc.collect()
    assert emu.arena.free_bytes == emu.arena.nbytes, "the operands' extents were freed"


@pytest.mark.parametrize("share", [True, False], ids=["in-place", "bytes"])
async def test_only_bytes_on_the_wire_count_against_inflight_bytes(emulator, operands, share):
    """With room for one byte of operands in flight, tiles whose blocks devices read in
    place still all go out together (nothing of them is buffered); those that carry bytes,
    one at a time (a tile whose blocks its device kept carries none, and goes beside them)."""
    host, port, emu = await emulator(share, share, inflight_bytes=1, window=4)
    most = 0

    def counting(send: Callable[[Message], None]) -> Callable[[Message], None]:
        def counted(msg: Message) -> None:
            nonlocal most
            if msg.TYPE == MsgType.TILE:
                devices = emu.registry.devices.values()
                out = [t for d in devices for t in d.outstanding.values()]
                most = max(most, len(out) if share else sum(1 for t in out if t.wire_bytes))
            send(msg)

        return counted

    for device in emu.registry.devices.values():
        device.conn.send = counting(device.conn.send)
    a, b = operands
    c, _ = await product(host, port, a, b)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert most == (6 if share else 1)
    assert emu.scheduler.inflight_bytes == 0


async def test_a_device_that_does_not_map_it_gets_bytes(emulator, operands):
    host, port, _ = await emulator(False)
    a, b = operands
    c, result = await product(host, port, a, b)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    rows, cols = A_SHAPE[0] // 64, B_SHAPE[1] // 64  # blocks of tiles
    a_rows = 64 * 160 * 4  # 64 whole rows of A
    b_span = (159 * 128 + 64) * 4  # 64 columns of row-major B: its span (under 2x: not packed)
    assert result.devices == [0]
    # each block crosses once, as bytes: the device keeps it for the GEMM's other tiles
    assert result.bytes_down == rows * a_rows + cols * b_span, "each operand block once"
    assert result.bytes_up == c.nbytes, "and its result"


async def test_without_an_arena_operands_are_bytes(emulator, operands):
    host, port, emu = await emulator(True, arena_bytes=0)
    assert emu.arena is None
    a, b = operands
    c, result = await product(host, port, a, b)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert result.bytes_down > 0 and result.bytes_up == c.nbytes


async def test_operands_that_do_not_fit_go_as_bytes(emulator, operands):
    """A GEMM's payload (A and B together, 200 KiB) larger than the arena goes to the pool,
    and its tiles as bytes: nothing fails."""
    host, port, emu = await emulator(True, arena_bytes=100 << 10)
    a, b = operands
    c, result = await product(host, port, a, b)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert result.bytes_down > 0 and emu.arena.full == 1


# -- a job's slab ------------------------------------------------------------------------------


def test_blocks_of_a_and_b_in_one_span_are_packed_each_by_its_own_layout():
    """A and B at the same offset of the slab, with different leading dimensions: each
    tile's packed blocks are its own rows and columns, not the other operand's bytes."""
    slab = np.arange(1024, dtype=np.float32).view(np.uint8)
    m = n = k = 4
    request = Gemm(gemm=1, dtype="float32", ta=False, tb=False, m=m, n=n, k=k, lda=64, ldb=16,
                   slab_a=0, slab_b=0, slab_c=2048, segments=(b"", b""))  # fmt: skip
    task = make_task(request, slab=slab)
    flat = slab[:2048].view(np.float32)
    a = np.lib.stride_tricks.as_strided(flat, (m, k), (64 * 4, 4))
    b = np.lib.stride_tricks.as_strided(flat, (k, n), (16 * 4, 4))
    for tile in task.tiles(2):
        block_a, block_b = tile.operands()
        assert block_a.packs and block_b.packs
        (packed_a, lda), (packed_b, ldb) = task.packed(block_a), task.packed(block_b)
        assert (lda, ldb) == (k, 2)
        np.testing.assert_array_equal(packed_a.reshape(-1, k), a[tile.r0 : tile.r1])
        np.testing.assert_array_equal(packed_b.reshape(k, -1), b[:, tile.c0 : tile.c1])


class CountingSocket:
    """A job client's socket that counts the bytes through it."""

    def __init__(self, sock: Any) -> None:
        self.sock, self.sent, self.received = sock, 0, 0

    def sendmsg(self, buffers: Any) -> int:
        sent = self.sock.sendmsg(buffers)
        self.sent += sent
        return sent

    def recv_into(self, buffer: Any) -> int:
        got = self.sock.recv_into(buffer)
        self.received += got
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def job_products(host: str, port: int, pairs: list[tuple[np.ndarray, np.ndarray]], **kw: Any):
    """Each ``a @ b`` through a blocking job client (run it in a thread), the bytes its
    socket sent and received, and its slab's size after each product. The job uses its
    slab as a job in another process would, unless ``hand_over`` says otherwise."""
    with Client(host, port, name="slab-job", **{"hand_over": False, **kw}) as client:
        counted = client._channel.sock = CountingSocket(client._channel.sock)
        products, slabs = [], []
        for a, b in pairs:
            products.append(client.matmul(a, b))
            slabs.append(0 if client._slab is None else len(client._slab))
        return products, counted.sent, counted.received, slabs


@pytest.mark.parametrize("share", [(True, True), (False,)], ids=["mapping", "elsewhere"])
async def test_a_job_on_this_host_passes_operands_and_c_through_its_slab(emulator, operands, share):
    """Neither the operands nor C cross the job's socket, whether the devices map the arena
    (they read the slab) or not (the emulator sends them bytes from it). The slab grows for
    a larger GEMM, and goes back to the arena when the job ends."""
    host, port, emu = await emulator(*share)
    a, b = operands
    rng = np.random.default_rng(4)
    big_a = rng.standard_normal((384, 160), dtype=np.float32)
    batched = rng.standard_normal((3, 40, 50)), rng.standard_normal((30, 50)).T  # float64
    pairs = [(a, b.T.copy().T), (a[:, :96], b[:96]), (big_a, b), batched]
    products, sent, received, slabs = await asyncio.to_thread(job_products, host, port, pairs)
    for (x, y), c in zip(pairs, products, strict=True):
        np.testing.assert_allclose(c, x @ y, rtol=1e-4, atol=1e-4)
    operand_bytes = sum(x.nbytes + y.nbytes for x, y in pairs)
    assert sent < 4096 < operand_bytes, f"{sent} bytes sent: headers only"
    assert received < 4096, f"{received} bytes received: no C"
    assert slabs[0] == slabs[1] < slabs[2] == slabs[3], "the slab is reused, then grown"
    gc.collect()
    assert emu.arena.free_bytes == emu.arena.nbytes, "the slabs went back to the arena"


async def test_a_job_without_shared_memory_sends_bytes(emulator, operands):
    host, port, _ = await emulator(True)
    a, b = operands
    products, sent, received, slabs = await asyncio.to_thread(
        job_products, host, port, [(a, b)], share_memory=False
    )  # fmt: skip
    np.testing.assert_allclose(products[0], a @ b, rtol=1e-4, atol=1e-4)
    assert sent > a.nbytes + b.nbytes and received > products[0].nbytes and slabs == [0]


async def test_a_gemm_too_large_for_a_slab_goes_as_bytes(emulator, operands):
    """No job gets more than half the arena: a GEMM needing more (operands and C: 300 KiB
    of a 512 KiB arena) goes as bytes; a smaller one later still gets a slab."""
    host, port, _ = await emulator(True, arena_bytes=512 << 10)
    a, b = operands
    pairs = [(a, b), (a[:64, :96], b[:96, :96])]
    products, sent, _, slabs = await asyncio.to_thread(job_products, host, port, pairs)
    for (x, y), c in zip(pairs, products, strict=True):
        np.testing.assert_allclose(c, x @ y, rtol=1e-4, atol=1e-4)
    assert sent > a.nbytes + b.nbytes, "the large one's operands went on the wire"
    assert slabs[0] == 0 and slabs[1] > 0


SLAB_MISUSE = {
    # GEMM fields (besides a 64 × 64 × 64 float32 product), the ERROR code, its reason
    "no_slab": (None, {"slab_a": 0}, "bad_gemm", "this job has no slab"),
    "outside": (1 << 16, {"slab_a": 1 << 16}, "bad_gemm", "inside the job's slab"),
    "unaligned": (1 << 16, {"slab_a": 2}, "bad_gemm", "aligned range"),
    "c_over_a": (1 << 16, {"slab_a": 0, "slab_c": 8192}, "bad_gemm", "overlaps operand a"),
    "ref_and_slab": (1 << 16, {"slab_a": 0, "ref_a": [0, 0]}, "bad_gemm", "both a reference"),
    "c_over_b": (1 << 16, {"slab_b": 0, "slab_c": 8192}, "bad_gemm", "overlaps operand b"),
    "two_in_flight": (1 << 16, {"slab_c": 0}, "bad_gemm", "is in flight"),
    "slab_in_flight": (1 << 16, {"slab_c": 0}, "bad_slab", "which uses the slab, is in"),
    "unmapped": ("unmapped", {}, "bad_slab", "does not map the operand arena"),
    "negative": (-1, {}, "bad_slab", "negative"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SLAB_MISUSE))
async def test_slab_misuse_is_refused(emulator, case):
    """Each misuse gets an ERROR naming it, and what the job held goes back to the arena."""
    from raw_peer import RawPeer  # the hand-driven connection of the emulator tests

    slab, fields, code, text = SLAB_MISUSE[case]
    host, port, emu = await emulator()  # no devices: a GEMM stays in flight
    raw = await RawPeer.connect(host, port)
    try:
        await raw.hello("job", caps={} if slab == "unmapped" else {"arena": str(emu.arena.path)})
        raw.send(Open())
        if slab is not None:
            raw.send(Slab(nbytes=1 << 16 if slab == "unmapped" else slab))
        if code == "bad_gemm":
            if slab is not None:
                reply = await raw.recv_skipping_heartbeats()
                assert reply.TYPE == MsgType.SLAB and reply.nbytes == slab, reply
            one = np.ones(64 * 64, np.float32)
            gemm = {"dtype": "float32", "ta": False, "tb": False, "m": 64, "n": 64, "k": 64,
                    "lda": 64, "ldb": 64}  # fmt: skip
            if case == "two_in_flight":
                raw.send(Gemm(gemm=1, **gemm, slab_c=0, segments=(one, one)))
            segments = (one[:0] if "slab_a" in fields else one,
                        one[:0] if "slab_b" in fields else one)  # fmt: skip
            raw.send(Gemm(gemm=2, **gemm, **fields, segments=segments))
        elif case == "slab_in_flight":  # its slab GEMM stays in flight: no devices
            await raw.recv_skipping_heartbeats()
            one = np.ones(64 * 64, np.float32)
            raw.send(Gemm(gemm=1, dtype="float32", ta=False, tb=False, m=64, n=64, k=64,
                          lda=64, ldb=64, slab_c=0, segments=(one, one)))  # fmt: skip
            raw.send(Slab(nbytes=1 << 17))
        error = await raw.expect_error(code)
        assert text in error.reason, error.reason
    finally:
        raw.close()
    for _ in range(200):
        gc.collect()
        if emu.arena.free_bytes == emu.arena.nbytes:
            break
        await asyncio.sleep(0.01)
    assert emu.arena.free_bytes == emu.arena.nbytes, "the slab went back to the arena"


async def test_a_slab_a_lost_device_may_write_into_is_retired(emulator, operands):
    """A device on this host that goes away while computing a tile whose C is in the job's
    slab might still write there: the job gets its C (the tile re-run elsewhere) and is told
    to stop using that slab (RESULT.slab_retired), which the emulator holds a while; the
    job's next GEMM gets a new slab."""
    from raw_peer import RawPeer

    host, port, emu = await emulator(True, policy="round-robin")
    raw = await RawPeer.connect(host, port)
    await raw.hello("device", name="leaves", profile=BUILTIN["rpi4"].to_wire(),
                    caps={"arena": str(emu.arena.path), "virtual": True})  # fmt: skip
    for _ in range(500):
        if len(emu.registry.ready()) == 2:
            break
        await asyncio.sleep(0.01)
    a, b = operands
    seen: dict[str, Any] = {}

    def job() -> list[np.ndarray]:
        with Client(host, port, name="slab-job", hand_over=False) as client:
            first = client.matmul(a, b)
            seen["after_first"] = client._slab
            second = client.matmul(a, b)
            seen["after_second"] = client._slab
            seen["job_slab"] = [p.job.slab for p in emu.peers if p.job is not None]
            return [first, second]

    running = asyncio.create_task(asyncio.to_thread(job))
    while (tile := await raw.recv_skipping_heartbeats()) is not None and tile.TYPE != MsgType.TILE:
        pass
    assert tile is not None and tile.arena_c >= 0, "it was to write its tile into the slab"
    raw.close()  # gone without an answer
    products = await asyncio.wait_for(running, 30)
    for c in products:
        np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert seen["after_first"] is None, "the job dropped the retired slab"
    assert seen["after_second"] is not None, "and got a new one"
    ((_, (retired_out,)),) = emu._late_writes  # the retired slab's C, held for late writes
    new = seen["job_slab"][0]
    assert new is not None and not np.shares_memory(new, retired_out), "a different slab"


async def test_after_a_timed_out_gemm_its_slab_waits_for_its_result(emulator, operands):
    """A GEMM that timed out may still be computed into the slab, so the job does not use it
    until that GEMM's RESULT has come, even when it comes while the job waits for something
    else (here the STEP reply); then the slab is back in use."""
    from raw_peer import RawPeer, tile_operand

    host, port, emu = await emulator()
    raw = await RawPeer.connect(host, port)
    await raw.hello("device", name="slow", profile=BUILTIN["rpi4"].to_wire(),
                    caps={"virtual": True})  # fmt: skip
    for _ in range(500):
        if emu.registry.ready():
            break
        await asyncio.sleep(0.01)
    timed_out = threading.Event()

    async def device() -> None:  # holds its first tile until the job has given up
        held = True
        while (msg := await raw.recv(timeout=30)) is not None:
            if msg.TYPE != MsgType.TILE:
                continue
            while held and not timed_out.is_set():
                await asyncio.sleep(0.01)
            held = False
            x = tile_operand(msg.segments[0], msg.dtype, msg.ta, msg.m, msg.k, msg.lda)
            y = tile_operand(msg.segments[1], msg.dtype, msg.tb, msg.k, msg.n, msg.ldb)
            c = np.ascontiguousarray(x @ y, dtype=msg.dtype)
            raw.send(TileResult(tile=msg.tile, compute_ns=1, segments=(c,)))

    a, b = operands

    def job() -> dict[str, Any]:
        with Client(host, port, name="patient", hand_over=False) as client:
            counted = client._channel.sock = CountingSocket(client._channel.sock)
            with pytest.raises(TimeoutError):
                client.matmul(a, b, timeout=0.3)
            busy = client._slab_busy
            timed_out.set()
            deadline = time.monotonic() + 30
            while (
                any(p.job and p.job.gemms for p in list(emu.peers)) and time.monotonic() < deadline
            ):
                time.sleep(0.01)  # until the emulator has sent the late RESULT
            client.step(1)  # the late RESULT is read while waiting for the STEP reply
            free = client._slab_busy
            before = counted.sent
            c = client.matmul(a, b)
            return {"busy": busy, "free": free, "sent": counted.sent - before, "c": c}

    serving = asyncio.create_task(device())
    try:
        seen = await asyncio.wait_for(asyncio.to_thread(job), 60)
    finally:
        raw.close()
        await asyncio.wait([serving], timeout=5)
    assert seen["busy"] and not seen["free"], "busy after the timeout, free after the STEP"
    np.testing.assert_allclose(seen["c"], a @ b, rtol=1e-4, atol=1e-4)
    assert seen["sent"] < 4096, "the next GEMM went through the slab again"


async def test_a_slab_exchange_cut_short_stops_the_job_using_the_arena(emulator, operands):
    """Interrupted between SLAB and its reply (Ctrl-C, a timeout), the job no longer knows
    which slab it has (the emulator has already taken the old one back), so it sends bytes
    from then on, and its results stay right."""
    host, port, _ = await emulator(True)
    a, b = operands

    def job() -> tuple[np.ndarray, Any]:
        with Client(host, port, name="interrupted", hand_over=False) as client:
            client.matmul(a[:64, :96], b[:96, :96])  # a small slab first
            real = client._expect

            def cut_short(kind: type[Message], timeout: float | None) -> Any:
                if kind is Slab:
                    client._expect = real
                    raise KeyboardInterrupt
                return real(kind, timeout)

            client._expect = cut_short
            with pytest.raises(KeyboardInterrupt):
                client.matmul(a, b)  # needs a larger slab
            return client.matmul(a, b), client._arena

    c, arena = await asyncio.to_thread(job)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert arena is None, "the job stopped using the arena"


async def test_a_gemm_whose_job_left_before_its_issue_is_dropped(emulator):
    """Job A's GEMM is due in virtual time after job B's clock; A leaves before then. When
    B moves on, A's GEMM is not issued (no devices: it would wait for one forever, holding
    A's slab), and the slab goes back to the arena."""
    from raw_peer import RawPeer

    host, port, emu = await emulator()
    b = await RawPeer.connect(host, port)
    await b.hello("job")
    b.send(Open())
    b.send(Step(step=1))
    assert (await b.recv_skipping_heartbeats()).TYPE == MsgType.STEP
    a = await RawPeer.connect(host, port)
    await a.hello("job", caps={"arena": str(emu.arena.path)})
    a.send(Open())
    a.send(Slab(nbytes=1 << 20))
    await a.recv_skipping_heartbeats()
    empty = np.zeros(0, np.float32)
    a.send(Gemm(gemm=1, dtype="float32", ta=False, tb=False, m=64, n=64, k=64, lda=64,
                ldb=64, slab_a=0, slab_b=16384, slab_c=32768, host_ns=10**9,
                segments=(empty, empty)))  # fmt: skip
    await asyncio.sleep(0.1)
    a.close()
    for _ in range(500):  # until the emulator has seen A go
        if sum(1 for p in emu.peers if p.job is not None) == 1:
            break
        await asyncio.sleep(0.01)
    b.send(Step(step=2, host_ns=5 * 10**9))  # B's clock passes A's GEMM's issue
    assert (await b.recv_skipping_heartbeats()).TYPE == MsgType.STEP
    for _ in range(200):
        gc.collect()
        if emu.arena.free_bytes == emu.arena.nbytes:
            break
        await asyncio.sleep(0.01)
    b.close()
    assert emu.timeline.stalled == 0, "A's GEMM was not left waiting for a device"
    assert emu.arena.free_bytes == emu.arena.nbytes, "A's slab went back to the arena"


@pytest.mark.parametrize("share", [True, False])
def test_morphling_run_share_memory_decides_how_operands_go(share):
    """``emulate(share_memory=...)`` (``morphling run --[no-]share-memory``): the job, in
    the embedded emulator's process, hands a linear layer's operands over as arrays, or
    sends them as bytes; it uses no slab either way."""
    torch = pytest.importorskip("torch")
    from morphling.proxy.job.session import emulate

    layer = torch.nn.Linear(256, 256)
    x = torch.randn(128, 256)
    with emulate(devices="2", share_memory=share) as session:
        y = layer(x)
        handed, slab = bool(session.client._local), session.client._slab
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert handed == share and slab is None

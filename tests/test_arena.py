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
from typing import Any

import numpy as np
import pytest
from morphling.devices.agent import DeviceAgent
from morphling.devices.profiles import BUILTIN
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.arena import PAGE, OperandArena
from morphling.proxy.client import AsyncClient, gemm_request, result_array
from morphling.proxy.server import Emulator
from morphling.proxy.settings import EmulatorConfig

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
        from morphling.proxy.arena import OperandArena
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


@pytest.fixture
async def emulator():
    made: list[tuple[Emulator, list[DeviceAgent], list[asyncio.Task]]] = []
    workers = WorkerPool([CpuBackend(1)])
    pool = BufferPool(pin=False)

    async def make(*share: bool, **config: object) -> tuple[str, int, Emulator]:
        emu = Emulator(EmulatorConfig(listen_ip="127.0.0.1", listen_port=0, probe=False,
                                      block_size=64, **config))  # fmt: skip
        host, port = await emu.start()
        agents = [DeviceAgent(BUILTIN["rpi4"], workers, pool, name=f"d{i}", virtual=True,
                              share_memory=s) for i, s in enumerate(share)]  # fmt: skip
        tasks = [asyncio.create_task(a.run(host, port, reconnect=False)) for a in agents]
        made.append((emu, agents, tasks))
        for _ in range(1000):
            if len(emu.registry.ready()) == len(agents):
                return host, port, emu
            await asyncio.sleep(0.005)
        raise AssertionError("devices not ready")

    yield make
    for emu, agents, tasks in made:
        for agent in agents:
            agent.stop()
        await emu.stop()
        await asyncio.wait(tasks, timeout=5)
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


async def test_a_device_that_does_not_map_it_gets_bytes(emulator, operands):
    host, port, _ = await emulator(False)
    a, b = operands
    c, result = await product(host, port, a, b)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    tiles = (A_SHAPE[0] // 64) * (B_SHAPE[1] // 64)
    a_rows = 64 * 160 * 4  # 64 whole rows of A
    b_span = (159 * 128 + 64) * 4  # 64 columns of row-major B: its span (under 2x: not packed)
    assert result.bytes_down == tiles * (a_rows + b_span), "each tile's operand blocks as bytes"
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

"""Shared weights over real sockets: references, caching, invalidation, emulated memory.

A checkpoint holds one weight ``w`` [96, 64]. The emulator shares it; the job
maps the shared copy and sends GEMMs on views of it by reference. Devices on
this host read weight blocks from their own mapping (no weight bytes on the
wire); a device that does not map it (``share_memory=False``, as a board on
another host) gets each block once and then a reference, until the weight
changes. Bytes are counted from each RESULT's ``bytes_down``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from morphling.devices.agent import DeviceAgent
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.checkpoint.format import Checkpoint, CheckpointError, write_checkpoint
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.client import Client, EmulatorError
from morphling.proxy.job.session import Session

M, N, K, BLOCK = 40, 96, 64, 32
X_BYTES = M * K * 4  # op(A) rows, once: the device keeps them for C's 3 column blocks
W_BYTES = N * K * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("weights") / "ckpt"
    w = torch.from_numpy(np.random.default_rng(0).standard_normal((N, K)).astype(np.float32))
    write_checkpoint(path, [("w", w)], source="test")
    return path


class Setup:
    """An emulator sharing ``ckpt``, devices, and a blocking job mapping the weights."""

    def __init__(self, emulator: Emulator, host: str, port: int, ckpt: Path) -> None:
        self.emulator, self.host, self.port, self.ckpt = emulator, host, port, ckpt
        self.workers = WorkerPool([CpuBackend(1)])
        self.pool = BufferPool()
        self.tasks: list[asyncio.Task] = []
        self.agents: list[DeviceAgent] = []

    async def add_device(self, *, share_memory: bool = True, memory: int = 0) -> DeviceAgent:
        profile = BUILTIN["rpi4"]
        if memory:
            profile = dataclasses.replace(profile, memory_bytes=memory)
        agent = DeviceAgent(profile, self.workers, self.pool, name=f"d{len(self.agents)}",
                            virtual=True, share_memory=share_memory)  # fmt: skip
        self.agents.append(agent)
        self.tasks.append(asyncio.create_task(agent.run(self.host, self.port, reconnect=False)))
        for _ in range(1000):
            record = self.emulator.registry.devices.get(agent.device_id)
            if record is not None and record.ready:
                return agent
            await asyncio.sleep(0.005)
        raise AssertionError("device not ready")

    async def job(self) -> tuple[Client, torch.Tensor]:
        """A job whose ``w`` is a view of the shared weights."""
        client = await asyncio.to_thread(Client, self.host, self.port, name="job")
        mapped = Checkpoint.open(self.ckpt, verify=False, writable=True,
                                 data=client.weights["path"])  # fmt: skip
        client.shared = (mapped.buffer.data_ptr(), mapped.buffer.numel())
        return client, mapped.tensor("w")

    def ckpt_tensor(self) -> torch.Tensor:
        return Checkpoint.open(self.ckpt).tensor("w")

    async def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        await self.emulator.stop()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        self.workers.close()


@pytest.fixture
async def setup(ckpt: Path):
    made: list[Setup] = []

    async def make(**config: Any) -> Setup:
        emu = Emulator(EmulatorConfig(listen_ip="127.0.0.1", listen_port=0, probe=False,
                                      block_size=BLOCK, ckpt_path=str(ckpt), **config))  # fmt: skip
        host, port = await emu.start()
        made.append(Setup(emu, host, port, ckpt))
        return made[-1]

    yield make
    for s in made:
        await s.close()


def product(client: Client, a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, Any]:
    """``a @ b`` through the client, and its RESULT (for the byte counts)."""
    from morphling.proxy.job.client import gemm_request, result_array

    request, shape = gemm_request(1000 + client.job_id, a, b, client.shared, epoch=client.steps)
    result = client.submit(request, timeout=30)
    return result_array(request, result, shape, None), result


def assert_product(c: np.ndarray, a: torch.Tensor, b: torch.Tensor) -> None:
    np.testing.assert_allclose(c, (a.double() @ b.double()).numpy(), rtol=1e-4, atol=1e-4)


async def test_colocated_devices_read_weights_by_reference(setup):
    s = await setup()
    await s.add_device()
    await s.add_device()
    client, w = await s.job()
    x = torch.randn(M, K)
    c, result = await asyncio.to_thread(product, client, x, w.t())  # a Linear's forward
    assert_product(c, x, w.t())
    # no weight bytes on the wire: x's rows alone, each once (each device computes one of
    # x's two row blocks of C, and keeps it for the row's other tiles)
    assert result.devices == [0, 1] and result.bytes_down == X_BYTES, "x's rows alone"
    g = torch.randn(M, N)  # grad_input = grad @ w: column blocks of w, strided in the mapping
    c, result = await asyncio.to_thread(product, client, g, w)
    assert_product(c, g, w)
    assert result.bytes_down == M * N * 4, "only grad's rows, each once"
    with torch.no_grad():
        w.mul_(-2.0)  # an optimizer step, in place in the shared mapping
    c, _ = await asyncio.to_thread(product, client, x, w.t())
    assert_product(c, x, w.t())
    await asyncio.to_thread(client.close)


async def test_remote_device_gets_weight_bytes_once_until_they_change(setup):
    s = await setup()
    await s.add_device(share_memory=False)
    client, w = await s.job()
    x = torch.randn(M, K)
    first = await asyncio.to_thread(product, client, x, w.t())
    again = await asyncio.to_thread(product, client, x, w.t())
    assert first[1].bytes_down == X_BYTES + W_BYTES, "each weight block once"
    assert again[1].bytes_down == 0, "then only references (x's panels stay too)"
    assert_product(again[0], x, w.t())
    with torch.no_grad():
        w.add_(1.0)  # a new version: the device's copy is stale
    after = await asyncio.to_thread(product, client, x, w.t())
    assert after[1].bytes_down == W_BYTES, "changed weights are sent again (x is held)"
    assert_product(after[0], x, w.t())  # a stale block would fail this
    g = torch.randn(M, N)  # grad_input = grad @ w: strided column blocks of w, then held
    c1, r1 = await asyncio.to_thread(product, client, g, w)
    c2, r2 = await asyncio.to_thread(product, client, g, w)
    assert_product(c1, g, w)
    assert_product(c2, g, w)
    assert r2.bytes_down == 0 < r1.bytes_down, "the second time, references only"
    # w's first 32 rows are one block it holds: the column blocks of that slice lie within
    # it, and the device reads them there (the TILE names the block kept and the offset)
    top = w[:BLOCK]
    g = torch.randn(M, BLOCK)
    c3, r3 = await asyncio.to_thread(product, client, g, top)
    assert_product(c3, g, top)
    assert r3.bytes_down == g.numel() * 4 and r3.resent == 0, "g's rows alone"
    await asyncio.to_thread(client.close)


async def test_weights_changed_without_a_new_version_are_sent_again_after_a_step(setup):
    """Fused optimizers (``AdamW(fused=True)``) and updates through ``.data`` leave the
    tensor's ``_version`` as it was: after a step mark (made by the optimizer step's hook)
    no weight block counts as the one a device holds."""
    s = await setup()
    await s.add_device(share_memory=False)
    client, w = await s.job()
    x = torch.randn(M, K)
    await asyncio.to_thread(product, client, x, w.t())
    version = w._version
    w.data.add_(1.0)
    assert w._version == version
    await asyncio.to_thread(client.step, 1)
    after = await asyncio.to_thread(product, client, x, w.t())
    # x's panels were used in step 1, so they stay (its bytes did not change)
    assert after[1].bytes_down == W_BYTES, "changed weights are sent again"
    assert_product(after[0], x, w.t())  # the stale block gave the old product
    await asyncio.to_thread(client.close)


async def test_a_new_job_is_not_referred_to_blocks_kept_for_an_earlier_one(setup):
    """Versions are each job's own: the next job's start at 0 again, over bytes the first
    may have changed (here through ``.data``, before any step mark)."""
    s = await setup()
    await s.add_device(share_memory=False)
    first, w = await s.job()
    x = torch.randn(M, K)
    await asyncio.to_thread(product, first, x, w.t())  # the device keeps w at version 0
    w.data.add_(1.0)
    await asyncio.to_thread(first.close)
    second, w2 = await s.job()
    assert w2._version == w._version == 0
    c, result = await asyncio.to_thread(product, second, x, w2.t())
    assert_product(c, x, w2.t())  # the kept blocks held the old weights
    assert result.bytes_down == X_BYTES + W_BYTES, "w's blocks are sent again"
    await asyncio.to_thread(second.close)


async def test_fresh_weights_are_refused_once_the_checkpoint_changed_on_disk(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, [("w", torch.ones(N, K))], source="test")
    emu = Emulator(EmulatorConfig(listen_ip="127.0.0.1", listen_port=0, probe=False,
                                  ckpt_path=str(ckpt)))  # fmt: skip
    host, port = await emu.start()
    try:
        write_checkpoint(ckpt, [("w", torch.zeros(N, K))], source="test", force=True)
        with pytest.raises(EmulatorError) as info:
            await asyncio.to_thread(Client, host, port, fresh_weights=True)
        assert info.value.code == "bad_open"
        assert "is no longer the checkpoint the emulator loaded" in info.value.reason
        client = await asyncio.to_thread(Client, host, port, map_weights=True)  # serves on
        assert client.weights["trained"] == []
        await asyncio.to_thread(client.close)
    finally:
        await emu.stop()


async def test_operands_that_do_not_fit_are_an_emulated_oom(setup, caplog):
    s = await setup()
    await s.add_device(share_memory=False, memory=8 << 10)  # the smallest tile needs 11 KiB
    client, w = await s.job()
    x = torch.randn(M, K)
    with caplog.at_level(logging.WARNING, logger="morphling.proxy.vtime.timeline"):
        c, result = await asyncio.to_thread(product, client, x, w.t())
    assert_product(c, x, w.t())  # computed anyway: the OOM is emulated, not real
    assert result.oom == result.tiles == 6
    assert "emulated OOM: device" in caplog.text
    again = await asyncio.to_thread(product, client, x, w.t())
    assert again[1].bytes_down == result.bytes_down == 3 * X_BYTES + 2 * W_BYTES, (
        "nothing is kept when it does not fit: each x block goes to the 3 column blocks, "
        "each w block to both row blocks, every time"
    )
    await asyncio.to_thread(client.close)


async def test_reference_without_shared_weights_is_refused(setup):
    s = await setup()
    await s.add_device()
    client, w = await s.job()
    shared, s.emulator.weights = s.emulator.weights, None  # as without --ckpt-path
    try:
        with pytest.raises(EmulatorError) as info:
            await asyncio.to_thread(product, client, torch.randn(M, K), w.t())
    finally:
        s.emulator.weights = shared  # for stop() to remove it
    assert info.value.code == "bad_gemm" and "no shared weights" in info.value.reason


async def test_job_refuses_a_different_checkpoint(setup, tmp_path):
    s = await setup()
    other = tmp_path / "other"
    write_checkpoint(other, [("w", torch.zeros(N, K))], source="test")
    client = await asyncio.to_thread(Client, s.host, s.port, name="job")
    session = Session(client)
    with pytest.raises(CheckpointError, match="not the checkpoint the emulator shares"):
        session.share_weights(str(other))
    session.share_weights(str(s.ckpt))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(N, K))  # named as in the checkpoint
    model.other = torch.nn.Parameter(torch.zeros(3))  # not in it: left alone
    assert session.bind(model) == 1
    np.testing.assert_array_equal(model.w.detach().numpy(), s.ckpt_tensor().numpy())
    await asyncio.to_thread(client.close)


def test_working_copies_of_dead_emulators_are_removed(tmp_path):
    from morphling.proxy.shm.files import remove_orphans

    dead = tmp_path / "morphling-weights-999999999-abc"  # no such pid
    alive = tmp_path / f"morphling-weights-{os.getpid()}-abc"
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    remove_orphans(tmp_path, "weights")
    assert not dead.exists() and alive.exists()

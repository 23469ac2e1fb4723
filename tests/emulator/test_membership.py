"""Devices come and go: GEMMs wait for one, a job is told and fails past its
``device_wait_s``, devices reconnect with backoff; and the intake's edge cases (empty
GEMMs, ``inflight_bytes`` over all devices)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from morphling.devices.agent import backoff_s
from morphling.kernels import CpuBackend, WorkerPool
from morphling.proxy.job.client import EmulatorError
from morphling.proxy.wire.messages import (
    Gemm,
    Message,
    MsgType,
    Open,
    Result,
    Step,
)
from serving import (
    TIMEOUT,
    assert_gemm_close,
    check_serving,
    wait_for_condition,
)


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
    assert job[0] == (
        "emulator: no device is ready (0 connected): the job waits with 4 tiles "
        "queued; it fails after 2 s (device_wait_s)"
    )
    progress = r"emulator: waiting for devices: 0 connected, 4 tiles queued, waited [\d.]+ s of 2"
    assert any(re.fullmatch(progress, m) for m in job), job
    assert "job 1 (patient): no device is ready" in caplog.text, "the emulator logs it too"
    await f.add_device(name="late")  # the emulator serves on
    await check_serving(await f.client())


class NoDoubles(CpuBackend):
    """A device build whose float64 GEMM is broken: its float32 FLOPS challenge passes,
    every float64 tile fails (the agent answers ERROR compute_failed and reconnects)."""

    def run(self, plan: Any) -> None:
        if plan.dtype == 1:
            raise RuntimeError("dgemm is broken in this build")
        super().run(plan)


async def test_a_tile_no_device_can_compute_ends_its_job_instead_of_going_round(fleet, caplog):
    """Both devices fail every float64 tile and come straight back: each tile would be
    re-queued for ever. After its third device is lost the job gets ``tile_failed``
    naming the request, the tile and the device's error; float32 work is served on."""
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=16)
    broken = WorkerPool([NoDoubles(1)])
    try:
        agents = [f.agent(name=f"broken-{i}", workers=broken) for i in range(2)]
        for agent in agents:
            f.run(agent, reconnect=True)
            await f.wait_ready(agent)
        client = await f.client()
        a = np.ones((20, 20))  # float64: 4 tiles
        with pytest.raises(EmulatorError) as info:
            await client.matmul(a, a, timeout=TIMEOUT)
        assert info.value.code == "tile_failed"
        reason = (
            r"GEMM 1: tile \d+ was sent 3 times and failed each time; the last device, \d+ "
            r"\(broken-\d\), ended with: compute_failed: TILE \d+: dgemm is broken in this build"
        )
        assert re.fullmatch(reason, info.value.reason), info.value.reason
        for agent in agents:
            await f.wait_ready(agent)  # (back after its last failure)
        await check_serving(await f.client())  # float32
    finally:
        broken.close()


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
        job.send(
            Gemm(
                gemm=gemm,
                dtype="float32",
                ta=False,
                tb=False,
                m=0,
                n=5,
                k=3,
                lda=3,
                ldb=5,
                host_ns=host_ns,
                segments=(b"", b),
            )
        )
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
    """With room for one tile's operands, one tile is out at a time over all devices (one
    column of tiles: each carries an A block no device holds yet)."""
    f = await fleet(block_size=8, inflight_bytes=1, window=4)
    for _ in range(3):
        await f.add_device()
    most = 0

    def counting(send: Callable[[Message], None]) -> Callable[[Message], None]:
        def counted(msg: Message) -> None:
            nonlocal most
            if msg.TYPE == MsgType.TILE:
                most = max(most, sum(len(d.outstanding) for d in f.emu.registry.devices.values()))
            send(msg)

        return counted

    for device in f.emu.registry.devices.values():
        device.conn.send = counting(device.conn.send)
    client = await f.client()
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((64, 32)).astype(np.float32), np.ones((32, 8), np.float32)
    assert_gemm_close(await client.matmul(a, b, timeout=TIMEOUT), a, b)
    assert most == 1
    assert f.emu.scheduler.inflight_bytes == 0

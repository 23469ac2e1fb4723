"""Heartbeats: a silent peer is dropped after ``heartbeat_timeout_s``, a quiet one that
heartbeats is kept, and a client gives up on a silent emulator."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from morphling.proxy.job.client import Client, EmulatorError
from morphling.proxy.wire.messages import (
    Error,
    Heartbeat,
    Message,
    Open,
)
from serving import (
    TIMEOUT,
    assert_gemm_close,
    check_serving,
    serving_fleet,
)


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

"""A device lost mid-run: its tiles are re-queued on the others and the GEMM completes."""

from __future__ import annotations

import asyncio
import logging
import re
import threading

import numpy as np
from morphling.kernels import WorkerPool
from serving import (
    TIMEOUT,
    GatedCpuBackend,
    assert_gemm_close,
    check_serving,
    gemm_request,
    result_array,
    wait_for_condition,
)


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
    logged = [
        int(x) for x in re.search(r"re-queued tiles \[([\d, ]+)\]", lost[0]).group(1).split(",")
    ]
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

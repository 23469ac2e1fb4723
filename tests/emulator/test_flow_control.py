"""A device's window bounds its tiles in flight, and a full send buffer holds its
tiles back until it drains."""

from __future__ import annotations

import asyncio

import numpy as np
from serving import (
    TIMEOUT,
    assert_gemm_close,
    gemm_request,
    result_array,
)


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
    arena, so that the operands cross the wire; one column of tiles, so that each carries
    an A block of its own, which no device holds yet.)"""
    f = await fleet(
        block_size=128, window=4, high_water_bytes=1, policy="load-balanced", arena_bytes=0
    )
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
    a = rng.standard_normal((2048, 2048), dtype=np.float32)  # 1 MiB of A per tile
    b = rng.standard_normal((2048, 128), dtype=np.float32)
    try:
        c = await client.matmul(a, b, timeout=TIMEOUT)
    finally:
        stop.set()
        await sampler
    assert_gemm_close(c, a, b)
    assert any(paused), "the send buffer never crossed the high-water mark"
    assert all(not d.outstanding for d in f.emu.registry.devices.values())

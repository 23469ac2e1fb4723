"""Operands that stay where they are: a panel (an operand block of a job's own bytes) crosses
a device's link once, is then referenced by any request that needs the same bytes, and is
dropped when a step ends without using it.

Real agents on loopback, without the operand arena, so that every byte a tile needs
crosses the socket and the RESULT's ``bytes_down`` counts them.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
from morphling.devices import agent as agent_module
from morphling.devices.agent import DeviceAgent
from morphling.proxy.job.client import AsyncClient
from morphling.proxy.wire.messages import Result
from serving import (
    TIMEOUT,
    Fleet,
    assert_gemm_close,
    gemm_request,
    result_array,
    wait_for_condition,
)

M, K, N, BLOCK = 96, 80, 64, 16  # 6 row blocks × 4 column blocks of C


def operands(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), np.float32)


async def product(client: AsyncClient, a: np.ndarray, b: np.ndarray) -> Result:
    """``a @ b`` by the fleet, checked against numpy: its RESULT."""
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request, batched=False), a, b)
    return result


async def one_device(fleet, **config) -> tuple[Fleet, DeviceAgent]:
    f = await fleet(block_size=BLOCK, arena_bytes=0, **config)
    return f, await f.add_device()


async def test_each_panel_crosses_once_and_the_links_are_charged_what_crossed(fleet):
    """One device: A's row blocks and B's column blocks each cross once (24 tiles, 10
    panels), not once per tile; the emulated link is charged exactly the bytes that crossed;
    a later request that needs the same bytes gets references only; a step that uses no
    block of A has the device told to drop A's panels, with its next tile."""
    f, agent = await one_device(fleet)
    client = await f.client()
    a, b = operands(1)
    result = await product(client, a, b)
    assert result.tiles == (M // BLOCK) * (N // BLOCK) and result.resent == 0
    assert result.bytes_down == a.nbytes + b.nbytes  # each block of each operand, once
    step = await client.step(1)
    assert step.link_down == result.bytes_down == step.link_bound  # the one device's bound
    panel = BLOCK * K * 4  # an A row block, or a B column block (packed)
    assert step.link_saved == result.tiles * 2 * panel - step.link_down  # what stayed
    first = set(agent.connection.panels)
    assert len(first) == M // BLOCK + N // BLOCK
    again = await product(client, a, b)  # a new request, the same bytes: nothing crosses
    assert again.bytes_down == 0 and again.resent == 0
    assert (await client.step(2)).link_saved == result.tiles * 2 * panel
    c = operands(2)[0]
    assert (await product(client, c, b)).bytes_down == c.nbytes  # B's blocks stay
    await client.step(3)  # A's were not used in it: swept
    assert (await product(client, c, b)).bytes_down == 0
    now = set(agent.connection.panels)
    assert len(now) == M // BLOCK + N // BLOCK
    assert len(first & now) == N // BLOCK, "A's panels were dropped, B's kept"


def weight_use(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's weight W [BLOCK, K] (one block of rows: sent whole), its input x [M, K]
    and an output gradient y [M, BLOCK]."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((BLOCK, K), dtype=np.float32)
    return w, rng.standard_normal((M, K), np.float32), rng.standard_normal((M, BLOCK), np.float32)


async def forward_then_grad_input(client: AsyncClient, w, x, y) -> Result:
    """x·Wᵀ (W is B stored transposed, sent whole), then y·W (W's column blocks, each
    within W): the second's RESULT."""
    forward = replace(gemm_request(x, w.T), tb=True, ldb=K, segments=(x.reshape(-1), w.reshape(-1)))
    result = await client.submit(forward, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, forward, batched=False), x, w.T)
    return await product(client, y, w)


async def test_a_block_within_a_panel_held_is_read_there(fleet):
    """A weight's forward product sends it whole; its input-gradient product needs its
    column blocks, each within it: the device reads them from the bytes it kept (the
    TILE names the kept panel and the element where the block starts), so only the
    output gradient crosses, and the product is exact."""
    f, _ = await one_device(fleet)
    client = await f.client()
    w, x, y = weight_use(4)
    grad_input = await forward_then_grad_input(client, w, x, y)
    assert grad_input.bytes_down == y.nbytes and grad_input.resent == 0
    step = await client.step(1)
    assert step.link_saved >= w.nbytes  # W's column blocks, as their tiles needed them


async def test_a_device_that_reads_no_block_within_another_is_sent_its_bytes(fleet, monkeypatch):
    """A device whose HELLO says ``caps.panels`` 1 gets such blocks as bytes, kept
    nowhere, and its products are exact too."""
    monkeypatch.setattr(agent_module, "PANELS_CAPABILITY", 1)
    f, _ = await one_device(fleet)
    client = await f.client()
    w, x, y = weight_use(5)
    grad_input = await forward_then_grad_input(client, w, x, y)
    # each tile's block of W as bytes (kept nowhere), y's blocks once
    each = BLOCK * BLOCK * 4
    assert grad_input.bytes_down == y.nbytes + grad_input.tiles * each
    assert grad_input.resent == 0


async def test_a_device_that_lost_its_panels_asks_for_them_and_nothing_is_lost(fleet, caplog):
    """A device that kept nothing (as after an eviction the emulator did not know of, or a
    restart under the same connection) answers a tile that references a panel with
    TILE_MISSING; the emulator sends that tile again with its bytes, the product is exact,
    and the RESULT counts the tiles sent again."""
    caplog.set_level(logging.INFO, logger="morphling")
    f, agent = await one_device(fleet)

    class Forgets(dict):
        def __setitem__(self, key, value) -> None:  # keeps nothing it is sent
            pass

    agent.connection.panels = Forgets()
    client = await f.client()
    a, b = operands(2)
    result = await product(client, a, b)
    # every tile but the first references a panel sent before: each is sent again
    assert result.resent == result.tiles - 1 and result.requeued == 0
    assert "is not held" in caplog.text and "goes again with its bytes" in caplog.text
    assert f.record(agent).ready  # not an error: the device serves on
    await product(client, b.T.copy(), a.T.copy())


async def test_a_small_memory_evicts_panels_and_says_so_and_still_computes(fleet):
    """A device whose emulated memory holds about two panels beside a tile: panels are
    evicted least recently used first, the device is told to drop them (its real cache
    stays within what the emulated memory holds), and evicted panels cross again when a
    later tile needs them: more bytes than with room for all, fewer than without keeping."""
    f = await fleet(block_size=BLOCK, arena_bytes=0)
    panel = BLOCK * K * 4  # one row block of A, or one column block of B
    out = BLOCK * BLOCK * 4
    agent = await f.add_device("rpi4")
    record = f.record(agent)
    memory = f.emu.timeline.devices[record.id].memory
    memory.capacity = 3 * panel + out
    client = await f.client()
    a, b = operands(3)
    most = 0

    def watching(msg) -> None:
        nonlocal most
        most = max(most, len(agent.connection.panels))
        receive(msg)

    receive = agent.connection.received
    agent.connection.received = watching
    sent = (await product(client, a, b)).bytes_down
    assert a.nbytes + b.nbytes < sent < (M // BLOCK) * (N // BLOCK) * 2 * panel
    assert 0 < most <= 3 + 2  # what the memory holds, and at most one tile's two to drop
    await wait_for_condition(lambda: not record.outstanding, 5, "the tiles to be back")

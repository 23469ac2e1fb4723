"""GEMMs through the emulator match numpy: random shapes, layouts and dtypes, edge
cases, the out argument, torch operands, the blocking client, two jobs at once."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import numpy as np
from morphling.proxy.job.client import AsyncClient, Client
from serving import (
    TIMEOUT,
    assert_gemm_close,
    check_serving,
    make_operand,
    needs_torch,
    torch,
)

SIZES = (1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 40)
LAYOUTS_2D = ("c", "t", "pad", "pad_t")
LAYOUTS_3D = (*LAYOUTS_2D, "step", "interleaved")


def random_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    kind = str(rng.choice(["2d", "bcast_b", "bcast_a", "both"]))
    dtype = np.float32 if rng.random() < 0.6 else np.float64
    m, n, k = (int(rng.choice(SIZES)) for _ in range(3))
    batch = int(rng.choice([1, 2, 3, 5]))
    batch_a = batch if kind in ("bcast_b", "both") else 0
    batch_b = batch if kind in ("bcast_a", "both") else 0
    la = str(rng.choice(LAYOUTS_3D if batch_a else LAYOUTS_2D))
    lb = str(rng.choice(LAYOUTS_3D if batch_b else LAYOUTS_2D))
    a = make_operand(rng, m, k, dtype, batch_a, la)
    b = make_operand(rng, k, n, dtype, batch_b, lb)
    what = f"{kind} {np.dtype(dtype).name} a{a.shape}:{la} @ b{b.shape}:{lb}"
    return a, b, what


EDGE_CASES = [  # (a shape, b shape, a layout, b layout)
    ((1, 1), (1, 1), "c", "c"),
    ((1, 17), (17, 1), "t", "t"),
    ((33, 1), (1, 31), "pad", "pad_t"),
    ((1, 16, 16), (16, 16), "c", "t"),
    ((2, 1, 33), (2, 33, 1), "interleaved", "step"),
    ((17, 40), (3, 40, 15), "pad_t", "interleaved"),
]


async def test_random_gemms_match_numpy(fleet):
    f = await fleet(block_size=16)
    for i in range(4):
        await f.add_device(name=f"dev{i}")
    client = await f.client(name="correctness")
    rng = np.random.default_rng(2024)
    cases = [random_case(rng) for _ in range(40)]
    for a_shape, b_shape, la, lb in EDGE_CASES:
        for dtype in (np.float32, np.float64):
            batch_a = a_shape[0] if len(a_shape) == 3 else 0
            batch_b = b_shape[0] if len(b_shape) == 3 else 0
            a = make_operand(rng, *a_shape[-2:], dtype, batch_a, la)
            b = make_operand(rng, *b_shape[-2:], dtype, batch_b, lb)
            cases.append((a, b, f"edge a{a.shape}:{la} @ b{b.shape}:{lb} {np.dtype(dtype)}"))
    layouts = {name for _, _, what in cases for name in re.findall(r":(\w+)", what)}
    assert layouts == set(LAYOUTS_3D), "the cases should exercise every layout"
    assert {a.dtype for a, _, _ in cases} == {np.dtype(np.float32), np.dtype(np.float64)}
    for start in range(0, len(cases), 8):  # eight GEMMs in flight at a time
        chunk = cases[start : start + 8]
        results = await asyncio.gather(*(client.matmul(a, b, timeout=TIMEOUT) for a, b, _ in chunk))
        for (a, b, what), c in zip(chunk, results, strict=True):
            assert_gemm_close(c, a, b, what)
    devices = [f.record(agent) for agent in f.agents]
    assert all(d.completed > 0 for d in devices), [d.completed for d in devices]
    assert all(not d.outstanding for d in devices)


async def test_out_argument_and_empty_dimensions(fleet):
    f = await fleet()
    await f.add_device()
    await f.add_device()
    client = await f.client()
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 19, 23))
    b = rng.standard_normal((23, 21))
    out = np.empty((2, 19, 21))
    assert await client.matmul(a, b, out, timeout=TIMEOUT) is out
    assert_gemm_close(out, a, b)
    # Zero-sized dimensions: nothing to tile (m, n) or an all-zero product (k).
    for a_shape, b_shape in (
        ((0, 5), (5, 4)),
        ((4, 5), (5, 0)),
        ((6, 0), (0, 7)),
        ((2, 3, 0), (0, 5)),
    ):
        a = np.ones(a_shape, np.float32)
        b = np.ones(b_shape, np.float32)
        c = await client.matmul(a, b, timeout=TIMEOUT)
        np.testing.assert_array_equal(c, a @ b)
    await check_serving(client)


@needs_torch
async def test_torch_operands(fleet):
    f = await fleet(block_size=8)
    for _ in range(2):
        await f.add_device()
    client = await f.client()
    torch.manual_seed(0)
    cases = [
        (torch.randn(17, 9), torch.randn(9, 20)),
        (torch.randn(3, 17, 9), torch.randn(20, 9).T),  # batched @ transposed 2-D
        (torch.randn(23, 31)[2:13, 5:30], torch.randn(25, 12, dtype=torch.float32)),  # padded
        (
            torch.randn(2, 9, 14, dtype=torch.float64).transpose(1, 2),
            torch.randn(2, 9, 5, dtype=torch.float64),
        ),
        (torch.randn(1, 1), torch.randn(1, 1)),
    ]
    for a, b in cases:
        c = await client.matmul(a, b, timeout=TIMEOUT)
        assert isinstance(c, np.ndarray)
        assert_gemm_close(c, a, b, f"torch {tuple(a.shape)} @ {tuple(b.shape)}")
        np.testing.assert_allclose(c, (a @ b).numpy(), rtol=1e-4, atol=1e-4)
    a, b = torch.randn(4, 6, 10), torch.randn(10, 3)
    out = torch.empty(4, 6, 3)
    assert await client.matmul(a, b, out, timeout=TIMEOUT) is out
    np.testing.assert_allclose(out.numpy(), (a @ b).numpy(), rtol=1e-4, atol=1e-4)


async def test_sync_client_from_a_plain_thread(fleet):
    f = await fleet()
    for _ in range(2):
        await f.add_device()
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 30, 18)).astype(np.float32)
    b = rng.standard_normal((25, 18)).astype(np.float32).T  # transposed view

    def job() -> tuple[np.ndarray, np.ndarray, Any, Any]:
        assert threading.current_thread() is not threading.main_thread()
        with Client(f.host, f.port, name="sync") as client:
            c1 = client.matmul(a, b, timeout=TIMEOUT)
            c2 = client.matmul(a[1], b[:, :7], timeout=TIMEOUT)
            step = client.step(1)
            totals = client.close()
        return c1, c2, step, totals

    c1, c2, step, totals = await asyncio.to_thread(job)
    assert_gemm_close(c1, a, b)
    assert_gemm_close(c2, a[1], b[:, :7])
    assert step.step == 1 and step.gemms == 2 and step.tiles > 0
    assert totals.gemms == 2 and totals.tiles == step.tiles


async def test_two_jobs_at_once(fleet):
    f = await fleet(block_size=16)
    for _ in range(3):
        await f.add_device()
    jobs = [await f.client(name=f"job{i}") for i in range(2)]
    rng = np.random.default_rng(9)

    async def work(client: AsyncClient) -> None:
        for _ in range(5):
            a, b, what = random_case(rng)
            assert_gemm_close(await client.matmul(a, b, timeout=TIMEOUT), a, b, what)

    await asyncio.gather(*(work(client) for client in jobs))
    totals = [await client.step(7) for client in jobs]
    assert [t.gemms for t in totals] == [5, 5]


async def test_products_computed_on_the_emulators_host_match_numpy_and_send_their_sample(fleet):
    """``sample_tiles=2``: a GEMM of more than two tiles is computed by the emulator, two
    of its tiles by their devices (over their sockets, checked as any); one of two tiles
    or fewer goes to the devices whole. Every random case still matches numpy."""
    f = await fleet(block_size=16, sample_tiles=2)
    for i in range(3):
        await f.add_device(name=f"dev{i}")
    client = await f.client(name="sampled")
    rng = np.random.default_rng(7)
    cases = [random_case(rng) for _ in range(24)]
    results = await asyncio.gather(*(client.matmul(a, b, timeout=TIMEOUT) for a, b, _ in cases))
    for (a, b, what), c in zip(cases, results, strict=True):
        assert_gemm_close(c, a, b, what)
    host = f.emu.host_products
    devices = sum(f.record(agent).completed for agent in f.agents)
    assert host.on_host > 0 and host.on_devices > 0
    assert devices >= host.on_devices  # (and every tile of the small GEMMs)
    tiles = [max(a.shape[0] if a.ndim == 3 else 1, b.shape[0] if b.ndim == 3 else 1)
             * -(-a.shape[-2] // 16) * -(-b.shape[-1] // 16) for a, b, _ in cases]  # fmt: skip
    assert host.on_devices == 2 * sum(t > 2 for t in tiles)  # two of each, whatever its size
    assert host.on_host == sum(t - 2 for t in tiles if t > 2)

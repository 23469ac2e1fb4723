"""Placement that follows the data: greedy places a request's tiles as blocks of rows ×
columns (``Placement.plan``), so that each device needs the A blocks of its rows and the
B blocks of its columns once, with the tiles shared out by how fast each device would get
through them; ``--no-residency`` keeps upstream's every-tile-carries-its-blocks."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from morphling.proxy.emulator.partition import auto_edge, make_task
from morphling.proxy.wire.messages import Gemm
from timeline_driver import MB, Recorder, new_timeline, profile, records, submit, task

BLOCK = 64


def run(devices: list, gemm, *, residency: bool = True, policy: str = "greedy", steps=None):
    """(placed devices in tile order, tile records, the GEMM's record) of one GEMM, in a
    step whose times go in ``steps`` (a list) once it closes."""
    tl, sink = new_timeline(policy)
    tl.residency = residency
    for i, p in enumerate(devices):
        tl.add_device(i, f"d{i}", p)
    tl.open_job(1, "job")
    rec = Recorder()
    submit(tl, rec, 1, gemm, block=BLOCK)
    tl.mark_step(1, 1, host_s=0.0, done=(steps if steps is not None else []).append)
    (g,) = records(sink, "gemm")
    return [device for _, device in rec.placed], records(sink, "tile"), g


def test_four_equal_devices_each_take_a_quarter_as_a_block_and_need_half_of_each_operand():
    """8 × 8 tiles on four equal devices: each device a 4 × 4 block, so its A rows and B
    columns are half of each operand: 4 × (half of A + half of B) in all, the least a
    2 × 2 partition needs, which the step reports as its bound; without residency every
    tile carries both its blocks, against the same bound."""
    m = n = k = 8 * BLOCK
    devices = [profile(flops=1e9, bw=100 * MB)] * 4
    steps: list = []
    placed, tiles, _ = run(devices, task(1, m, n, k), steps=steps)
    operand = m * k * 4
    assert sum(t["bytes_down"] for t in tiles) == 4 * (operand // 2 + operand // 2)
    (step,) = steps
    assert step.link_bound == step.link_down == 4 * (operand // 2 + operand // 2)
    grid = np.array(placed).reshape(8, 8)
    for device in range(4):
        rows, cols = np.nonzero(grid == device)
        assert len(rows) == 16 and len(set(rows)) == 4 and len(set(cols)) == 4
    _, without, _ = run(devices, task(1, m, n, k), residency=False, steps=steps)
    assert sum(t["bytes_down"] for t in without) == 64 * 2 * BLOCK * k * 4
    assert steps[1].link_down == 64 * 2 * BLOCK * k * 4 > steps[1].link_bound


def test_a_faster_device_takes_more_tiles_and_the_gemm_ends_no_later_than_tile_by_tile():
    """Shares follow each device's rate: a device with four times the FLOPS (fast links,
    no latency: compute decides) takes about four times the tiles of each slow one, and
    the GEMM ends no later than greedy placing tile by tile would have it (on the same
    residency)."""
    fast, slow = (profile(name, flops=f, bw=1e10, lat=0.0) for name, f in (("f", 4e9), ("s", 1e9)))
    devices = [fast, slow, slow]
    gemm = task(1, 12 * BLOCK, 12 * BLOCK, 4 * BLOCK)
    placed, _, planned = run(devices, gemm)
    counts = Counter(placed)
    assert counts[0] == pytest.approx(4 * counts[1], rel=0.15)
    assert counts[1] == pytest.approx(counts[2], abs=2)

    from morphling.proxy.vtime import placement

    original = placement.Placement.plan
    try:
        placement.Placement.plan = lambda *args: None  # type: ignore[method-assign]
        _, _, greedy = run(devices, task(1, 12 * BLOCK, 12 * BLOCK, 4 * BLOCK))
    finally:
        placement.Placement.plan = original  # type: ignore[method-assign]
    assert planned["end"] <= greedy["end"] * 1.02


def test_pivots_that_share_no_block_are_placed_tile_by_tile():
    """A batched GEMM whose pivots have their own A and B is no grid: greedy places its
    tiles one by one (as round-robin would spread equal devices), each pivot's blocks
    going where its tiles go."""
    batch, m, n, k = 4, BLOCK, BLOCK, BLOCK
    a = np.ones((batch, m, k), np.float32)
    b = np.ones((batch, k, n), np.float32)
    request = Gemm(gemm=1, dtype="float32", ta=False, tb=False, m=m, n=n, k=k, lda=k, ldb=n,
                   batch=batch, stride_a=m * k, stride_b=k * n,
                   segments=(memoryview(a).cast("B"), memoryview(b).cast("B")))  # fmt: skip
    placed, tiles, _ = run([profile(bw=1e10)] * 4, make_task(request))
    assert sorted(placed) == [0, 1, 2, 3]
    assert sum(t["bytes_down"] for t in tiles) == a.nbytes + b.nbytes


def test_round_robin_is_untouched_and_still_gains_from_residency():
    """Only greedy plans; round-robin cycles as it did, and its devices still keep the
    blocks that their later tiles of the request need."""
    m = n = k = 4 * BLOCK
    placed, tiles, _ = run([profile()] * 2, task(1, m, n, k), policy="round-robin")
    assert placed == [0, 1] * 8
    block = BLOCK * k * 4
    # each device: its A block for each row (4), and the 2 B blocks of its columns
    assert sum(t["bytes_down"] for t in tiles) == 2 * (4 + 2) * block


def gemm_of(gemm: int, a: np.ndarray, b: np.ndarray):
    request = Gemm(gemm=gemm, dtype="float32", ta=False, tb=False, m=a.shape[0], n=b.shape[1],
                   k=a.shape[1], lda=a.shape[1], ldb=b.shape[1],
                   segments=(memoryview(a).cast("B"), memoryview(b).cast("B")))  # fmt: skip
    return make_task(request)


def test_a_step_keeps_what_it_used_and_drops_the_rest_at_its_end():
    """Panels are named by their bytes: a later request of any step that needs bytes a
    device holds is charged none of them. At a step's end each device lets go of the
    panels no tile used in that step (the timeline says which), and keeps the others (a
    weight that did not change)."""
    dropped: list[tuple[int, list[int]]] = []
    tl, sink = new_timeline(dropped=lambda device, panels: dropped.append((device, panels)))
    tl.add_device(0, "d0", profile(bw=100 * MB))
    tl.open_job(1, "job")
    rng = np.random.default_rng(7)
    x, y, w = (rng.standard_normal((BLOCK, BLOCK), np.float32) for _ in range(3))
    rec, steps = Recorder(), []
    for gemm, a in enumerate([x, x, y], start=1):  # one product a step; w in each
        submit(tl, rec, 1, gemm_of(gemm, a, w), block=BLOCK, after=gemm - 1)
        tl.mark_step(1, gemm, host_s=0.0, done=steps.append)
    tiles = records(sink, "tile")
    assert [t["bytes_down"] for t in tiles] == [2 * x.nbytes, 0, y.nbytes]
    assert [t.get("bytes_saved", 0) for t in tiles] == [0, 2 * x.nbytes, w.nbytes]
    assert [s.link_saved for s in steps] == [0, 2 * x.nbytes, w.nbytes]
    assert len(dropped) == 1, "only step 3's end lets one go"
    (device, [panel]) = dropped[0]
    memory = tl.devices[0].memory
    assert device == 0 and panel not in memory.resident  # x's block
    assert len(memory.resident) == 2 and memory.used == y.nbytes + w.nbytes


def test_a_device_holding_a_requests_bytes_draws_it_where_that_pays():
    """Greedy counts, for a device that holds some of a tile's blocks, only the bytes it
    lacks. A compute-heavy product of x goes to the fast-computing device; a light one of
    x after it would go by the full bytes to the device with the faster link, but goes to
    the one that holds x, and ends sooner."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4 * BLOCK, 4 * BLOCK), np.float32)
    wide = rng.standard_normal((4 * BLOCK, 32 * BLOCK), np.float32)
    narrow = rng.standard_normal((4 * BLOCK, BLOCK // 4), np.float32)

    def light_product(held: bool) -> tuple[int, float]:
        tl, sink = new_timeline()
        if not held:
            tl._held = lambda a, b: None  # type: ignore[method-assign]
        tl.add_device(0, "link", profile("link", flops=1e9, bw=12 * MB, lat=0.0))
        tl.add_device(1, "compute", profile("compute", flops=1e11, bw=10 * MB, lat=0.0))
        tl.open_job(1, "job")
        rec = Recorder()
        submit(tl, rec, 1, gemm_of(1, x, wide), block=64 * BLOCK)
        submit(tl, rec, 1, gemm_of(2, x, narrow), block=64 * BLOCK, after=1)
        tl.close_job(1)
        heavy, light = records(sink, "tile")
        assert heavy["device"] == 1
        return light["device"], records(sink, "gemm")[1]["end"]

    (near, end_near), (far, end_far) = light_product(True), light_product(False)
    assert (near, far) == (1, 0)
    assert end_near < end_far


def test_auto_edge_spreads_a_slow_links_fleet_and_keeps_a_lone_fast_device_whole():
    """Sixteen devices on slow links: the quarter edge, whose sixteen tiles cross sixteen
    links at once; one device with ideal links: the block itself (fewer tiles, the same
    compute); the same fleet asked again, the same edge (its state does not count)."""
    slow, tl = [profile(flops=2e10, bw=5 * MB, lat=0.003)] * 16, new_timeline()[0]
    for i, p in enumerate(slow):
        tl.add_device(i, f"d{i}", p)
    request = task(1, 256, 256, 256).request
    assert auto_edge(request, 256, tl.placement) == 64
    tl.open_job(1, "job")
    submit(tl, Recorder(), 1, task(2, 256, 256, 256), block=256)  # queues on one device
    assert auto_edge(request, 256, tl.placement) == 64
    lone = new_timeline()[0]
    lone.add_device(0, "d0", profile(flops=2e10, bw=math.inf, lat=0.0))
    assert auto_edge(request, 256, lone.placement) == 256
    assert auto_edge(task(3, 40, 40, 40).request, 64, tl.placement) == 32  # (none below 32)

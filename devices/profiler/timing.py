"""Timing GEMMs with the real kernels, as a device computes its tiles.

A shared host's other processes only ever slow a GEMM down, so each shape's time is the
fastest of several interleaved rounds, each on fresh buffers and in a new order.
"""

from __future__ import annotations

import math
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from morphling.kernels import GemmPlan, plan_explicit, run_plan, set_threads
from numpy.typing import NDArray

from ..models.compute import GemmShape

# A, B and C: byte buffers a GEMM's operands are laid out in.
Buffers = tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8]]
Progress = Callable[[int], object]  # called with 1 after each shape timed in a round
Clock = Callable[[], float]


def _fresh(nbytes: int) -> NDArray[np.uint8]:
    """Anonymous pages as the device's buffer pool gets them (no huge-page advice: with it,
    page-multiple strides ran 40 % slower or not depending on the allocation), filled with a
    normal number in both float widths (0x3F bytes) so no denormal slows the kernel."""
    memory = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)
    memory[:] = 0x3F
    return memory


def _span(rows: int, cols: int, ld: int, itemsize: int) -> int:
    return ((rows - 1) * ld + cols) * itemsize


def fresh_buffers(shapes: Sequence[GemmShape]) -> Buffers:
    """Fresh A, B and C buffers, each page-aligned and large enough for every shape."""
    a = max(_span(s.a_rows, s.a_cols, s.lda, s.itemsize) for s in shapes)
    b = max(_span(s.b_rows, s.b_cols, s.ldb, s.itemsize) for s in shapes)
    c = max(s.m * s.n * s.itemsize for s in shapes)
    return _fresh(a), _fresh(b), _fresh(c)


def gemm_plan(s: GemmShape, buffers: Buffers) -> GemmPlan:
    """The kernels' plan for ``s`` on ``buffers`` (C contiguous)."""
    a, b, c = buffers
    return plan_explicit(s.dtype, s.ta, s.tb, s.m, s.n, s.k, a, s.lda, b, s.ldb, c, s.n)


def calls_for(plan: GemmPlan, seconds: float, clock: Clock) -> int:
    """Back-to-back calls of ``plan`` that take about ``seconds`` (from one timed call)."""
    start = clock()
    run_plan(plan)
    return math.ceil(seconds / max(clock() - start, 1e-7))


def measure(
    shapes: Sequence[GemmShape],
    *,
    threads: int = 1,
    rounds: int = 5,
    min_batch_s: float = 2e-4,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[tuple[GemmShape, float]]:
    """Seconds per GEMM of each shape, timed with the real kernels on ``threads`` threads.

    Each round gets fresh operand buffers and visits the shapes in a new random order; a
    shape's time in a round is the mean of a batch of back-to-back calls (at least
    ``min_batch_s``) after one warm-up call, and its result is the fastest round. Other
    processes on a shared machine only ever slow a round down, and interleaving spreads a
    slow spell over many shapes instead of ruining a few. ``progress`` is called with 1
    after each shape in each round. Sets the calling thread's BLAS thread count.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not shapes:
        return []
    set_threads(threads)
    # One thread computes in the calling thread, so its CPU time leaves out the time the OS
    # gave other processes; more threads need the wall clock.
    clock = time.thread_time if threads == 1 else time.perf_counter
    rng = np.random.default_rng(seed)
    best = np.full(len(shapes), math.inf)
    calls = np.zeros(len(shapes), dtype=np.int64)
    for _ in range(rounds):
        buffers = fresh_buffers(shapes)
        for i in rng.permutation(len(shapes)):
            plan = gemm_plan(shapes[i], buffers)
            run_plan(plan)  # warm-up: operands into cache, pages faulted in
            if calls[i] == 0:
                calls[i] = calls_for(plan, min_batch_s, clock)
            count = int(calls[i])
            start = clock()
            for _ in range(count):
                run_plan(plan)
            best[i] = min(best[i], (clock() - start) / count)
            if progress is not None:
                progress(1)
    seconds: list[float] = best.tolist()
    return list(zip(shapes, seconds, strict=True))


@dataclass(frozen=True, slots=True)
class Timed:
    """A grid to fit and a held-out set to score the fit, timed in the same rounds."""

    grid: list[tuple[GemmShape, float]]
    heldout: list[tuple[GemmShape, float]]
    repeat_p90: float  # how far the held-out set's two timings differ, at p90 (0.03 = 3 %)


def measure_grid_and_heldout(
    grid: Sequence[GemmShape],
    heldout: Sequence[GemmShape],
    *,
    threads: int = 1,
    rounds: int = 5,
    progress: Progress | None = None,
) -> Timed:
    """Time both sets interleaved, so a slow spell on a shared host hits both alike.

    Held-out shapes are listed twice: their reference time is the faster of two independent
    timings (twice the rounds), and how far the two differ says how well this host
    reproduces its own measurements, which bounds how well any fit can be judged on it.
    """
    every = [*grid, *heldout, *heldout]
    timed = measure(every, threads=threads, rounds=rounds, progress=progress)
    first, second = timed[len(grid) : len(grid) + len(heldout)], timed[len(grid) + len(heldout) :]
    once = [t for _, t in first]
    twice = [t for _, t in second]
    repeat_p90 = 0.0
    if heldout:
        ratios = np.array(twice) / np.array(once)
        repeat_p90 = float(np.percentile(np.abs(ratios - 1.0), 90))
    faster = [(s, min(a, b)) for s, a, b in zip(heldout, once, twice, strict=True)]
    return Timed(timed[: len(grid)], faster, repeat_p90)

"""Timing GEMMs with the real kernels, as a device computes its tiles.

A shared host's other processes only ever slow a call down, so each shape's time is the
fastest of several interleaved rounds, each on fresh buffers and in a new order
(``measure_calls``, which ``conv_timing`` shares for convolutions).
"""

from __future__ import annotations

import functools
import math
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
from morphling.kernels import GemmPlan, plan_explicit, run_plan, set_threads
from numpy.typing import NDArray

from ..models.compute import GemmShape
from ..models.conv_shape import ConvShape

# A, B and C: byte buffers a GEMM's operands are laid out in.
Buffers = tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8]]
Progress = Callable[[int], object]  # called with 1 after each shape timed in a round
Clock = Callable[[], float]
Call = Callable[[], object]  # one kernel call on operands laid out beforehand
Shape = TypeVar("Shape", GemmShape, ConvShape)


def fresh_pages(nbytes: int) -> NDArray[np.uint8]:
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
    return fresh_pages(a), fresh_pages(b), fresh_pages(c)


def gemm_plan(s: GemmShape, buffers: Buffers) -> GemmPlan:
    """The kernels' plan for ``s`` on ``buffers`` (C contiguous)."""
    a, b, c = buffers
    return plan_explicit(s.dtype, s.ta, s.tb, s.m, s.n, s.k, a, s.lda, b, s.ldb, c, s.n)


def calls_for(call: Call, seconds: float, clock: Clock) -> int:
    """Back-to-back calls of ``call`` that take about ``seconds`` (from one timed call)."""
    start = clock()
    call()
    return math.ceil(seconds / max(clock() - start, 1e-7))


def measure_calls(
    shapes: Sequence[Shape],
    fresh: Callable[[Sequence[Shape]], Any],
    call: Callable[[Shape, Any], Call],
    *,
    threads: int,
    rounds: int,
    min_batch_s: float,
    seed: int,
    progress: Progress | None,
) -> list[tuple[Shape, float]]:
    """Seconds per call of each shape on ``threads`` BLAS threads: the fastest of ``rounds``.

    Each round lays the operands out in fresh buffers (``fresh(shapes)``, large enough for
    every shape; ``call(shape, buffers)`` is the shape's call on them) and visits the
    shapes in a new random order; a shape's time in a round is the mean of a batch of
    back-to-back calls (at least ``min_batch_s``) after one warm-up call. Other processes
    on a shared machine only ever slow a round down, and interleaving spreads a slow spell
    over many shapes instead of ruining a few. ``progress`` is called with 1 after each
    shape in each round. Sets the calling thread's BLAS thread count.
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
        buffers = fresh(shapes)
        for i in rng.permutation(len(shapes)):
            run = call(shapes[i], buffers)
            run()  # warm-up: operands into cache, pages faulted in
            if calls[i] == 0:
                calls[i] = calls_for(run, min_batch_s, clock)
            count = int(calls[i])
            start = clock()
            for _ in range(count):
                run()
            best[i] = min(best[i], (clock() - start) / count)
            if progress is not None:
                progress(1)
    seconds: list[float] = best.tolist()
    return list(zip(shapes, seconds, strict=True))


def _gemm_call(shape: GemmShape, buffers: Buffers) -> Call:
    return functools.partial(run_plan, gemm_plan(shape, buffers))


def measure(
    shapes: Sequence[GemmShape],
    *,
    threads: int = 1,
    rounds: int = 5,
    min_batch_s: float = 2e-4,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[tuple[GemmShape, float]]:
    """Seconds per GEMM of each shape, timed with the real kernels (``measure_calls``)."""
    return measure_calls(
        shapes,
        fresh_buffers,
        _gemm_call,
        threads=threads,
        rounds=rounds,
        min_batch_s=min_batch_s,
        seed=seed,
        progress=progress,
    )


@dataclass(frozen=True, slots=True)
class Timed(Generic[Shape]):
    """A grid to fit and a held-out set to score the fit, timed in the same rounds."""

    grid: list[tuple[Shape, float]]
    heldout: list[tuple[Shape, float]]
    repeat_p90: float  # how far the held-out set's two timings differ, at p90 (0.03 = 3 %)


def measure_grid_and_heldout(
    grid: Sequence[Shape],
    heldout: Sequence[Shape],
    *,
    measure: Callable[..., list[tuple[Shape, float]]],
    threads: int = 1,
    rounds: int = 5,
    progress: Progress | None = None,
) -> Timed[Shape]:
    """Time both sets interleaved with ``measure`` (``measure`` here for GEMMs,
    ``conv_timing.measure_conv`` for convolutions), so a slow spell on a shared host hits
    both alike.

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

#!/usr/bin/env python3
"""Kernel benchmarks: each figure beside its anchor, measured in the same run.

Writes ``bench-results/kernels.json``. Measurements of a figure and its
anchor alternate (ours, anchor, ours, ...) so that load from other work on a
shared machine hits both alike; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from benchlib import run_meta, write_results
from morphling.kernels import BufferPool, blas_info, gemm, plan_explicit, run_plan
from tqdm import tqdm


def per_call_ns(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def paired(
    ours: Callable[[], object], anchor: Callable[[], object], reps: int, calls: int, bar: tqdm
) -> tuple[float, float]:
    """Median ns per call of each, from ``reps`` alternating blocks of ``calls`` calls."""
    ours(), anchor()  # warm up: page in, JIT, thread pools
    a, b = [], []
    for _ in range(reps):
        a.append(per_call_ns(ours, calls))
        b.append(per_call_ns(anchor, calls))
        bar.update()
    return statistics.median(a), statistics.median(b)


def bench_sgemm_2048(reps: int, bar: tqdm) -> dict:
    n = 2048
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    out = np.empty_like(a)
    ta, tb, tout = torch.from_numpy(a), torch.from_numpy(b), torch.empty(n, n)
    ours, theirs = paired(lambda: gemm(a, b, out), lambda: torch.mm(ta, tb, out=tout), reps, 1, bar)
    flop = 2 * n**3
    return {
        "morphling_gflops": round(flop / ours, 1),
        "torch_gflops": round(flop / theirs, 1),
        "ratio": round(theirs / ours, 3),
        "target_ratio_min": 0.95,
        "met": theirs / ours >= 0.95,
    }


def bench_sgemm_64(reps: int, bar: tqdm) -> dict:
    """Per-call time of a 64³ sgemm: the tile path (explicit plan on pool leases), the
    array convenience API, and torch.mm, all on the same data."""
    n = 64
    rng = np.random.default_rng(1)
    pool = BufferPool()
    la, lb, lc = (pool.acquire(n * n * 4) for _ in range(3))
    a, b, c = (lease.array(np.float32, (n, n)) for lease in (la, lb, lc))
    a[:] = rng.standard_normal((n, n))
    b[:] = rng.standard_normal((n, n))
    ta, tb, tout = torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.empty(n, n)

    def tile() -> None:
        run_plan(plan_explicit(np.float32, False, False, n, n, n, la, n, lb, n, lc, n))

    calls = 500
    ours, theirs = paired(tile, lambda: torch.mm(ta, tb, out=tout), reps, calls, bar)
    array_api, theirs2 = paired(
        lambda: gemm(a, b, c), lambda: torch.mm(ta, tb, out=tout), reps, calls, bar
    )
    assert np.allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    torch_us = statistics.median([theirs, theirs2]) / 1e3
    return {
        "morphling_us": round(ours / 1e3, 2),
        "morphling_array_api_us": round(array_api / 1e3, 2),
        "torch_us": round(torch_us, 2),
        "ratio": round(ours / 1e3 / torch_us, 3),
        "target_ratio_max": 1.0,
        "met": ours / 1e3 <= torch_us,
    }


def bench_pool(reps: int, bar: tqdm) -> dict:
    size = 64 * 1024
    pool = BufferPool()
    pool.acquire(size).release()  # the bucket's buffer now exists; we time reuse

    def acquire_release() -> None:
        pool.acquire(size).release()

    ours, anchor = paired(acquire_release, lambda: bytearray(size), reps, 2000, bar)
    return {
        "acquire_release_ns": round(ours),
        "bytearray_ns": round(anchor),
        "size_bytes": size,
        "target_ns_max": 2000,
        "met": ours <= 2000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="paired repetitions (>= 5)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/kernels.json"))
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5 (medians of at least 5 repetitions)")
    info = blas_info()
    with tqdm(total=4 * args.reps, desc="kernel benchmarks", unit="rep") as bar:
        results = {
            "sgemm_2048": bench_sgemm_2048(args.reps, bar),
            "sgemm_64": bench_sgemm_64(args.reps, bar),
            "pool": bench_pool(args.reps, bar),
        }
    results["meta"] = run_meta(
        args.reps,
        blas=f"{info.name} {info.version}",
        blas_threading=info.threading,
        torch_threads=torch.get_num_threads(),
    )
    write_results(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

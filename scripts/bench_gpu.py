#!/usr/bin/env python3
"""GPU benchmarks: tiles against numpy, cuBLASXt against torch.matmul, GEMM time by SM count.

Writes ``bench-results/gpu.json`` with, measured in one run on one GPU:

- ``tiles``: cuBLASXt tiles (and cuBLAS under each green context) equal to numpy;
- ``sgemm_4096``: GFLOP/s of a 4096³ sgemm through cuBLASXt on host pointers (pinned
  pool buffers and plain numpy arrays; host↔device traffic included), beside
  ``torch.matmul`` on the GPU, alternating as ``bench_kernels.py`` does;
- ``sm_scaling``: the same GEMM under green contexts of 8, 16, 32 SMs and the whole
  device: device time per GEMM (the transfers taken out) and with them.

On a host without a usable GPU it prints why and exits 0 without writing anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_kernels import paired
from benchlib import run_meta, write_results
from morphling.kernels import (
    BufferPool,
    CublasXt,
    CudaGreenContexts,
    cublasxt_status,
    cuda_status,
    green_context_status,
    plan_gemm,
)
from morphling.kernels import cuda as cuda_driver
from morphling.kernels.green_context.cuda_partitions import round_sm_count
from tqdm import tqdm

N = 4096
SM_COUNTS = (8, 16, 32)
TILE_CASES = [(1, 1, 1), (17, 33, 5), (256, 128, 300), (1000, 999, 64), (1024, 1024, 1024)]


def tolerance(dtype: type, k: int) -> dict[str, float]:
    return (
        {"rtol": 1e-4, "atol": 1e-4 * k} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-10}
    )


def tile_cases(rng: np.random.Generator, dtype: type):
    """(name, a, b) with padded rows, a column-major operand and a batch, as tiles arrive."""
    for m, n, k in TILE_CASES:
        a = rng.standard_normal((m, k + 3)).astype(dtype)[:, :k]
        b = np.ascontiguousarray(rng.standard_normal((n, k)).astype(dtype)).T
        yield f"{np.dtype(dtype).name} {m}x{n}x{k}", a, b
        yield (
            f"{np.dtype(dtype).name} 3x{m}x{n}x{k}",
            rng.standard_normal((3, m, k)).astype(dtype),
            b,
        )


def check_tiles(xt: CublasXt, parts: CudaGreenContexts, counts: list[int]) -> dict:
    """Every case through cuBLASXt and through cuBLAS on each partition, against numpy."""
    rng = np.random.default_rng(0)
    worst: dict[str, float] = {}
    failed: list[str] = []
    for dtype in (np.float32, np.float64):
        for name, a, b in tile_cases(rng, dtype):
            expected = a @ b
            runs = {"cublasxt": xt.gemm(a, b)}
            for sms in counts:  # the whole device last, so cuBLASXt runs in the primary context
                parts.activate(sms)
                plan, out = plan_gemm(a, b)
                parts.run_plan(plan)
                runs[f"green {sms} SMs"] = out
            for path, got in runs.items():
                err = float(np.max(np.abs(got - expected), initial=0.0))
                worst[path] = max(worst.get(path, 0.0), err)
                if not np.allclose(got, expected, **tolerance(dtype, a.shape[-1])):
                    failed.append(f"{path}: {name}")
    return {
        "cases": 4 * len(TILE_CASES),
        "max_abs_error": worst,
        "failed": failed,
        "met": not failed,
    }


def _times(fn: Any, reps: int, bar: tqdm) -> list[float]:
    """Seconds of each of ``reps`` calls, after one to warm up."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        bar.update()
    return times


def bench_sgemm(xt: CublasXt, reps: int, bar: tqdm) -> dict:
    """cuBLASXt from pinned pool buffers and from numpy arrays, beside torch.matmul on
    resident operands and torch with the same host traffic (pinned copies both ways)."""
    rng = np.random.default_rng(1)
    pool = BufferPool()
    leases = [pool.acquire(N * N * 4) for _ in range(3)]
    a, b, out = (lease.array(np.float32, (N, N)) for lease in leases)
    a[:] = rng.standard_normal((N, N))
    b[:] = rng.standard_normal((N, N))
    a_plain, b_plain, out_plain = a.copy(), b.copy(), np.empty_like(a)
    gflop = 2 * N**3 / 1e9
    result: dict[str, Any] = {"pool": pool.stats().pin_status, "target_ratio_min": 0.8}
    if not torch.cuda.is_available():
        ours = statistics.median(_times(lambda: xt.gemm(a, b, out), reps, bar))
        result["cublasxt_pinned_gflops"] = round(gflop / ours, 1)
        result["torch"] = f"unavailable: torch {torch.__version__} has no CUDA, so no anchor"
        result["met"] = None
        return result
    ha, hb = (torch.from_numpy(x).pin_memory() for x in (a_plain, b_plain))
    hout = torch.empty((N, N)).pin_memory()
    ta, tb = ha.cuda(), hb.cuda()
    tout = torch.empty_like(ta)

    def resident() -> None:
        torch.matmul(ta, tb, out=tout)
        torch.cuda.synchronize()

    def with_traffic() -> None:
        da, db = ha.cuda(non_blocking=True), hb.cuda(non_blocking=True)
        torch.matmul(da, db, out=tout)
        hout.copy_(tout, non_blocking=True)
        torch.cuda.synchronize()

    pinned, anchor = paired(lambda: xt.gemm(a, b, out), resident, reps, 1, bar)
    plain, traffic = paired(
        lambda: xt.gemm(a_plain, b_plain, out_plain), with_traffic, reps, 1, bar
    )
    np.testing.assert_allclose(out, hout.numpy(), rtol=1e-3, atol=1e-2)
    result.update(
        cublasxt_pinned_gflops=round(gflop * 1e9 / pinned, 1),
        cublasxt_pageable_gflops=round(gflop * 1e9 / plain, 1),
        torch_resident_gflops=round(gflop * 1e9 / anchor, 1),
        torch_with_traffic_gflops=round(gflop * 1e9 / traffic, 1),
        ratio=round(anchor / pinned, 3),
        ratio_same_traffic=round(traffic / pinned, 3),
        met=anchor / pinned >= 0.8,
        torch=f"torch {torch.__version__}",
        torch_allow_tf32=torch.backends.cuda.matmul.allow_tf32,  # off: both are plain fp32
    )
    return result


def bench_sm_scaling(parts: CudaGreenContexts, counts: list[int], reps: int, bar: tqdm) -> dict:
    """Per SM count: time with transfers (one GEMM) and per GEMM on the device, from the
    difference between ``repeat`` GEMMs between the same transfers and one."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((N, N)).astype(np.float32)
    b = rng.standard_normal((N, N)).astype(np.float32)
    plan, _out = plan_gemm(a, b)
    repeat = 4
    rows = {}
    for sms in counts:
        parts.activate(sms)
        one = statistics.median(_times(lambda: parts.run_plan(plan), reps, bar))
        many = statistics.median(_times(lambda: parts.run_plan(plan, repeat=repeat), reps, bar))
        device = (many - one) / (repeat - 1)
        rows[str(sms)] = {
            "with_transfers_ms": round(one * 1e3, 2),
            "device_ms": round(device * 1e3, 3),
            "device_gflops": round(2 * N**3 / device / 1e9, 1),
        }
    whole = rows[str(parts.total_sms)]["device_ms"]
    for row in rows.values():
        row["slowdown_vs_all"] = round(row["device_ms"] / whole, 2)
    return {"total_sms": parts.total_sms, "m_n_k": N, "by_sms": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="repetitions per figure (>= 5)")
    parser.add_argument("--block-dim", type=int, default=1024, help="cuBLASXt block dimension")
    parser.add_argument("--output", type=Path, default=Path("bench-results/gpu.json"))
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5 (medians of at least 5 repetitions)")
    for what, status in (("CUDA", cuda_status()), ("cuBLASXt", cublasxt_status())):
        if status != "available":
            print(f"bench_gpu: nothing ran and nothing was written: {what} {status}")
            return 0
    green = green_context_status()
    xt = CublasXt(devices=[0], block_dim=args.block_dim)
    parts = CudaGreenContexts(0, green=green == "available")
    try:
        counts = []
        if green == "available":
            rule = (parts.total_sms, parts.min_sms, parts.sm_multiple)
            valid = {round_sm_count(n, *rule) for n in SM_COUNTS}
            counts = [parts.prepare(n) for n in sorted(valid) if n < parts.total_sms]
        counts.append(parts.total_sms)
        with tqdm(
            total=2 * args.reps * (1 + len(counts)), desc="gpu benchmarks", unit="rep"
        ) as bar:
            results = {
                "tiles": check_tiles(xt, parts, counts),
                "sgemm_4096": bench_sgemm(xt, args.reps, bar),
                "sm_scaling": bench_sm_scaling(parts, counts, args.reps, bar),
            }
    finally:
        parts.close()
        xt.close()
    results["sm_scaling"]["green_contexts"] = green
    results["meta"] = run_meta(
        args.reps,
        gpu=cuda_driver.device_name(0),
        driver=cuda_driver.format_version(cuda_driver.driver_version()),
        block_dim=args.block_dim,
    )
    write_results(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Kernel demo (until the emulator lands): one OPT-125m layer's GEMMs cut into tiles.

Each tile of ``x @ W^T`` (forward) and of the two backward GEMMs is staged in
pool buffers and computed by the worker pool through the explicit tile
contract a device uses; the reassembled results are checked against torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

import numpy as np
import torch
from morphling.kernels import BufferPool, CpuBackend, WorkerPool, blas_info, plan_explicit
from tqdm import tqdm

log = logging.getLogger("morphling.demo")


async def tiled_gemm(pool: WorkerPool, mem: BufferPool, a: np.ndarray, b: np.ndarray,
                     block: int, bar: tqdm) -> tuple[np.ndarray, list[int]]:  # fmt: skip
    """C = a @ b, one full-K tile per (block x block) output block, like a device would."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.float32)
    bt = np.ascontiguousarray(b.T)  # B's columns as rows: each tile's B block is contiguous
    workers: list[int] = []

    async def tile(r: int, c: int) -> None:
        rows, cols = min(block, m - r), min(block, n - c)
        with mem.acquire(rows * k * 4) as la, mem.acquire(cols * k * 4) as lb, \
                mem.acquire(rows * cols * 4) as lc:  # fmt: skip
            la.array(np.float32, (rows, k))[:] = a[r : r + rows]
            lb.array(np.float32, (cols, k))[:] = bt[c : c + cols]
            plan = plan_explicit(np.float32, False, True, rows, cols, k, la, k, lb, k, lc, cols)
            res = await pool.submit_plan(plan, lc, keep=(la, lb))
            del plan  # it points into the leases, which are released below
            out[r : r + rows, c : c + cols] = lc.array(np.float32, (rows, cols))
            workers.append(res.worker)
            bar.update()

    await asyncio.gather(*(tile(r, c) for r in range(0, m, block) for c in range(0, n, block)))
    return out, workers


async def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    tokens, hidden, ffn = args.batch * args.seq, 768, 3072  # OPT-125m's fc1
    x = torch.randn(tokens, hidden)
    w = torch.randn(ffn, hidden) * hidden**-0.5
    grad_y = torch.randn(tokens, ffn)
    gemms = {
        "forward  y = x·Wᵀ": (x.numpy(), w.T.numpy(), x @ w.T),
        "backward dx = dy·W": (grad_y.numpy(), w.numpy(), grad_y @ w),
        "backward dW = dyᵀ·x": (grad_y.T.numpy(), x.numpy(), grad_y.T @ x),
    }
    mem = BufferPool()
    backends = [CpuBackend(threads=1) for _ in range(args.workers)]
    total_tiles = sum(-(-a.shape[0] // args.block) * -(-b.shape[1] // args.block)
                      for a, b, _ in gemms.values())  # fmt: skip
    print(f"BLAS: {blas_info().name}; {args.workers} workers; block {args.block}; "
          f"{tokens} tokens of OPT-125m fc1 ({hidden}→{ffn})")  # fmt: skip
    rows = []
    with (
        WorkerPool(backends, policy=args.policy) as pool,
        tqdm(total=total_tiles, desc="tiles", unit="tile", file=sys.stderr) as bar,
    ):
        for name, (a, b, reference) in gemms.items():
            start = time.perf_counter()
            out, workers = await tiled_gemm(pool, mem, a, b, args.block, bar)
            seconds = time.perf_counter() - start
            err = float(np.abs(out - reference.numpy()).max())
            flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            per_worker = np.bincount(workers, minlength=args.workers).tolist()
            shape = f"{a.shape[0]}×{a.shape[1]}·{b.shape[0]}×{b.shape[1]}"
            rows.append((name, shape, len(workers), per_worker, seconds * 1e3,
                         flop / seconds / 1e9, err))  # fmt: skip
    print(f"\n{'GEMM':<22}{'shape':<22}{'tiles':>6}  {'tiles per worker':<18}"
          f"{'ms':>8}{'GFLOP/s':>9}{'max |err|':>11}")  # fmt: skip
    for name, shape, tiles, per_worker, ms, gflops, err in rows:
        print(f"{name:<22}{shape:<22}{tiles:>6}  {per_worker!s:<18}{ms:>8.1f}{gflops:>9.1f}"
              f"{err:>11.2e}")  # fmt: skip
    stats = mem.stats()
    print(f"\nbuffer pool: {stats.allocations} buffers allocated, {stats.reuses} reuses, "
          f"{stats.locked_bytes >> 10} KiB locked, {stats.unlocked_bytes >> 10} KiB unlocked "
          f"(RLIMIT_MEMLOCK {stats.memlock_limit >> 10} KiB)")  # fmt: skip
    worst = max(r[-1] for r in rows)
    if worst > 1e-2:
        log.error("tiled results differ from torch by %.3g", worst)
        return 1
    print("all tiles match torch.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--block", type=int, default=256, help="tile edge (default 256)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--policy", default="greedy",
                        choices=["round-robin", "greedy", "load-balanced"])  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch", "seq", "block", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

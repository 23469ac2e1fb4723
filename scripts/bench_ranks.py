#!/usr/bin/env python3
"""Ranks benchmarks: DDP under ``morphling run --ranks`` against torchrun.

Writes ``bench-results/ranks.json`` with one group, ``ddp_4``: a DDP script (gloo; an MLP
of five 1024-wide linear layers, batch 128 per rank, SGD) run by ``torchrun
--nproc-per-node 4`` and by ``morphling run --ranks 4 --embedded --devices rpi4:4``, runs
alternating:

- ``overhead_ratio``: the emulated run's host wall seconds per step over torchrun's (each
  the median over ranks and steps, the first step dropped); the whole commands' wall
  seconds, start-up included, beside it;
- ``collective_error``: the largest relative difference, over the emulated run's gradient
  all-reduces, between the time each took in virtual time and the ring's closed form on
  the Pi 4's links (2(n−1)/n·S/bw plus 2(n−1) latencies each way).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_net import morphling_cmd

RANKS = 4
WITHOUT_FINALIZING = Path(__file__).with_name("without_finalizing.py")  # see its docstring
DDP_SCRIPT = """\
import json, sys, time, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = [m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]
ddp = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(1024, 10)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
data = torch.Generator().manual_seed(rank)
x, y = torch.randn(128, 1024, generator=data), torch.randint(0, 10, (128,), generator=data)
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(json.dumps({"rank": rank, "times": times}), flush=True)
dist.destroy_process_group()
"""


def step_times(cmd: list[str]) -> tuple[list[float], float]:
    """Every rank's step times after its first, and the command's wall seconds."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    decoder, times, at = json.JSONDecoder(), [], proc.stdout.find('{"rank"')
    while at != -1:  # the ranks share stdout: two objects may share a line
        obj, end = decoder.raw_decode(proc.stdout, at)
        times += obj["times"][1:]
        at = proc.stdout.find('{"rank"', end)
    return times, wall


def collective_error(run_dir: Path) -> tuple[float, int]:
    """The largest relative error of an all-reduce's time against the closed form, and how
    many there were."""
    from morphling.devices.models.profiles import BUILTIN

    p, n = BUILTIN["rpi4"], RANKS
    lines = gzip.decompress((run_dir / "events.jsonl.gz").read_bytes()).splitlines()
    reduces = [r for r in map(json.loads, lines) if r["ev"] == "collective"
               and r["op"] == "allreduce"]  # fmt: skip
    worst = 0.0
    for r in reduces:
        closed = 2 * (n - 1) / n * r["nbytes"] / min(p.ul_bw, p.dl_bw)
        closed += 2 * (n - 1) * (p.ul_lat_s + p.dl_lat_s)
        worst = max(worst, abs((r["end"] - r["start"]) - closed) / closed)
    return worst, len(reduces)


def run(args: argparse.Namespace) -> dict:
    from benchlib import run_meta
    from tqdm import tqdm

    native, emulated, native_wall, emulated_wall = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        script = Path(tmp) / "ddp_step.py"
        script.write_text(DDP_SCRIPT)
        run_dir = Path(tmp) / "run"
        for _ in tqdm(range(args.reps), desc="ddp_4", unit="rep"):  # alternating
            times, wall = step_times([sys.executable, "-m", "torch.distributed.run",
                                      "--nproc-per-node", str(RANKS), str(WITHOUT_FINALIZING),
                                      str(script), str(args.steps)])  # fmt: skip
            native += times
            native_wall.append(wall)
            times, wall = step_times(morphling_cmd(
                "run", "--ranks", str(RANKS), "--embedded", "--devices", f"rpi4:{RANKS}",
                "--run-dir", str(run_dir), "--force", "--no-report", "--", "python",
                str(script), str(args.steps), log_level="warning"))  # fmt: skip
            emulated += times
            emulated_wall.append(wall)
        error, count = collective_error(run_dir)
    n, e = statistics.median(native), statistics.median(emulated)
    nw, ew = statistics.median(native_wall), statistics.median(emulated_wall)
    return {
        "ddp_4": {
            "native_step_s": round(n, 4), "emulated_step_s": round(e, 4),
            "overhead_ratio": round(e / n, 3), "native_wall_s": round(nw, 2),
            "emulated_wall_s": round(ew, 2), "wall_ratio": round(ew / nw, 3),
            "allreduces": count, "collective_error": float(f"{error:.2e}"),
            "target_overhead_ratio_max": 1.3, "target_collective_error_max": 0.02,
            "met": e / n <= 1.3 and error <= 0.02,
        },
        "meta": run_meta(args.reps, steps=args.steps, ranks=RANKS, devices=f"rpi4:{RANKS}",
                         model="MLP 5 x 1024, batch 128 per rank, DDP over gloo"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from benchlib import step_main

    return step_main(run, __doc__.splitlines()[0], output="bench-results/ranks.json", reps=5,
                     steps=8, argv=argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

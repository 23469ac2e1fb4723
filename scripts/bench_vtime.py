#!/usr/bin/env python3
"""Virtual-time benchmarks: the engine's throughput and a 1,000-device what-if.

Writes ``bench-results/vtime.json``:

- ``engine``: tiles placed and settled per wall second by the timeline alone
  (64 devices of four built-in profiles, greedy placement, 2048×2048 GEMMs
  with k 256 cut into 128² tiles, each of operands of its own, as independent
  GEMMs are, the event log hashed but not written).
  A *tile event* is one stage of a tile's passage settled in virtual time —
  its download, its compute or its upload — so three per tile. Beside it, the
  event core alone (``Clock``: as many events, scheduled out of order and run,
  each calling a no-op) against its anchor, measured in the same run: a bare
  ``heapq`` loop doing the same pushes and pops and calls, the floor of any
  Python event queue (``ratio_to_heap``: the median over pairs of runs, one beside the
  other; the garbage collector off in both, which would otherwise time itself).
- ``whatif_1000``: ``morphling run --embedded`` of two training steps of the
  demo model on 1,000 virtual devices (modelled coordinator time): the wall
  seconds of the whole command (start-up of the fleet included), of the
  second step, and the same second step run natively.
- ``whatif_10000``: ``morphling run --ranks 10000 --numerics sample:1`` of three
  data-parallel (DDP) steps of the demo model on a mixed fleet of 10,000 devices over
  Wi-Fi behind one access point (``--bottleneck-bw``), rank 0 computed and the others
  replayed: the wall seconds of the whole command and the peak RSS of its processes
  (the largest of them: the launcher, which holds the emulator).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchlib import run_meta, write_results
from morphling.devices.models.profiles import BUILTIN
from morphling.proxy.emulator.partition import make_task
from morphling.proxy.vtime.engine import Clock
from morphling.proxy.vtime.eventlog import EventLog
from morphling.proxy.vtime.timeline import Timeline
from morphling.proxy.wire.messages import Gemm

STAGES = 3  # download, compute, upload
CORE_EVENTS = 200_000  # per run of the event core, and of its anchor
PAIRS = 5  # core and anchor runs per rep, alternating: ``ratio_to_heap`` is their median
FLEET_1000 = "rpi4:400,rpi5:300,orin-nano:200,jetson-nano:100"
FLEET_10000 = "rpi4:4000,rpi5:3000,orin-nano:2000,jetson-nano:1000"
ACCESS_POINT_BW = 12.5e6  # bytes/s: a 100 Mbit/s access point every device's Wi-Fi shares
DDP_SCRIPT = """\
import sys, torch, torch.distributed as dist
sys.path.insert(0, {scripts!r})
from demo import MODEL
from morphling.proxy.checkpoint.hf_models import build_model, load_config
dist.init_process_group("gloo")
cfg = load_config("opt-tiny")
cfg.update(MODEL)
model = torch.nn.parallel.DistributedDataParallel(build_model(cfg, seed=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = torch.randint(0, cfg["vocab_size"], (4, 64))
for _ in range(int(sys.argv[1])):
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""

STEP_SCRIPT = """\
import json, sys, time, torch
sys.path.insert(0, {scripts!r})
from demo import MODEL
from morphling.proxy.checkpoint.hf_models import build_model, load_config
cfg = load_config("opt-tiny")
cfg.update(MODEL)
model = build_model(cfg, seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = torch.randint(0, cfg["vocab_size"], (4, 64))
for _ in range(2):  # the second step is the one measured: the first pays for warming up
    start = time.perf_counter()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()
print(json.dumps({{"step_s": time.perf_counter() - start}}))
"""


def engine_rate(gemms: int, devices: int = 64) -> tuple[float, float]:
    """(tile events per wall second, tiles per GEMM) for the timeline alone."""
    names = ["rpi4", "rpi5", "orin-nano", "jetson-nano"]
    timeline = Timeline("greedy", log=EventLog())
    for i in range(devices):
        timeline.add_device(i, f"d{i}", BUILTIN[names[i % len(names)]])
    timeline.open_job(1, "bench")
    m = n = 2048
    k = 256
    rng = np.random.default_rng(0)
    work = []
    for g in range(1, gemms + 1):
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        request = Gemm(gemm=g, dtype="float32", ta=False, tb=False, m=m, n=n, k=k, lda=k, ldb=n,
                       segments=(memoryview(a).cast("B"), memoryview(b).cast("B")))  # fmt: skip
        task = make_task(request)
        work.append((task, task.tiles(128)))
    gc.collect()
    gc.freeze()  # as `morphling emulator` does once it listens: start-up objects stay put
    start = time.perf_counter()
    for g, (task, tiles) in enumerate(work, 1):
        timeline.submit(1, task, tiles, after=g - 1, host_s=1e-3, place=lambda placed: None,
                        done=lambda issue, end: None)  # fmt: skip
    elapsed = time.perf_counter() - start
    count = sum(len(tiles) for _, tiles in work)
    return count * STAGES / elapsed, count / gemms


def _noop(_: object) -> None:
    pass


def _event_times(events: int) -> list[float]:
    """Times out of order, as a fleet's events are pushed (a permutation: no ties)."""
    return [(i * 7919) % events * 1e-6 for i in range(events)]


def core_rate(events: int) -> float:
    """Events per second of the event core alone: ``Clock.at`` each, then ``Clock.run``."""
    clock, times = Clock(), _event_times(events)
    gc.collect()
    gc.disable()
    start = time.perf_counter()
    for i, t in enumerate(times):
        clock.at(t, _noop, i, device=i % 64, job=1, tile=i)
    clock.run()
    elapsed = time.perf_counter() - start
    gc.enable()
    return events / elapsed


def heap_rate(events: int) -> float:
    """Events per second of a bare heapq loop doing the core's pushes, pops and calls."""
    queue: list[tuple[float, int, int, int, int, Callable[[object], None], int]] = []
    times = _event_times(events)
    gc.collect()
    gc.disable()
    start = time.perf_counter()
    for i, t in enumerate(times):
        heapq.heappush(queue, (t, i % 64, 1, i, i, _noop, i))
    while queue:
        _, _, _, _, _, action, arg = heapq.heappop(queue)
        action(arg)
    elapsed = time.perf_counter() - start
    gc.enable()
    return events / elapsed


def whatif(devices: str) -> dict[str, float]:
    """One step of the demo model on ``devices`` through ``morphling run``, and natively."""
    scripts = str(Path(__file__).resolve().parent)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "step.py"
        script.write_text(STEP_SCRIPT.format(scripts=scripts))
        native = json.loads(subprocess.run(
            [sys.executable, str(script)], check=True, capture_output=True, text=True
        ).stdout)["step_s"]  # fmt: skip
        report = Path(tmp) / "report.json"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "morphling", "--log-level", "warning", "run", "--embedded",
             "--devices", devices, "--coordinator-time", "model", "--run-dir",
             str(Path(tmp) / "run"), "--no-report", "--json", str(report), "--",
             str(script)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        step = json.loads(report.read_text())["steps"][-1]
    return {"wall_s": round(wall, 2), "step_wall_s": round(step["host_s"], 2),
            "native_step_s": round(native, 3), "emulated_step_s": round(step["emulated_s"], 4),
            "step_ratio_to_native": round(step["host_s"] / native, 1)}  # fmt: skip


# The peak RSS of a command's processes alone: RUSAGE_CHILDREN of a process whose only
# children are the command's (this script's own counts every run before it too).
PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
    "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def whatif_ranks(devices: str, steps: int = 3) -> dict[str, float]:
    """The data-parallel what-if: every device a rank, one computed (``whatif_10000``)."""
    ranks = sum(int(part.rpartition(":")[2]) for part in devices.split(","))
    scripts = str(Path(__file__).resolve().parent)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ddp.py"
        script.write_text(DDP_SCRIPT.format(scripts=scripts))
        report = Path(tmp) / "report.json"
        start = time.perf_counter()
        peak = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "morphling", "--log-level",
             "warning", "run", "--embedded", "--devices", devices, "--ranks", str(ranks),
             "--numerics", "sample:1", "--link", "wifi", "--bottleneck-bw",
             str(ACCESS_POINT_BW), "--run-dir", str(Path(tmp) / "run"), "--no-report",
             "--no-table", "--json", str(report), "--", "python", str(script), str(steps)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        wall = time.perf_counter() - start
        run = json.loads(report.read_text())
    rss_mib = int(peak.split()[-1]) / 1024  # (KiB on Linux)
    return {"ranks": ranks, "steps": len(run["steps"]), "replayed": run["replay"]["replayed"],
            "timed": run["replay"]["timed"],
            "wall_s": round(wall, 1), "target_wall_s_max": 60.0, "rss_mib": round(rss_mib),
            "target_rss_mib_max": 2048,
            "emulated_step_s": [round(s["emulated_s"], 3) for s in run["steps"]],
            "met": wall <= 60.0 and rss_mib <= 2048}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="engine runs, alternating")
    parser.add_argument("--gemms", type=int, default=40, help="GEMMs per engine run")
    parser.add_argument("--devices", default=FLEET_1000, help="the what-if fleet")
    parser.add_argument(
        "--rank-devices", default=FLEET_10000, help="the data-parallel what-if's fleet, a rank each"
    )
    parser.add_argument("--output", type=Path, default=Path("bench-results/vtime.json"))
    args = parser.parse_args(argv)
    engine, core, heap, ratios = [], [], [], []
    tiles_per_gemm = 0.0
    for _ in range(args.reps):
        rate, tiles_per_gemm = engine_rate(args.gemms)
        engine.append(rate)
        for _ in range(PAIRS):  # each core run beside its anchor: the host's load moves both
            core.append(core_rate(CORE_EVENTS))
            heap.append(heap_rate(CORE_EVENTS))
            ratios.append(core[-1] / heap[-1])
    events_per_s = statistics.median(engine)
    ratio = statistics.median(ratios)
    results = {
        "meta": run_meta(args.reps, gemms=args.gemms, tiles_per_gemm=tiles_per_gemm),
        "engine": {
            "events_per_s": round(events_per_s),
            "tiles_per_s": round(events_per_s / STAGES),
            "target_events_per_s": 200_000,
            "core_events_per_s": round(statistics.median(core)),
            "heap_events_per_s": round(statistics.median(heap)),
            "ratio_to_heap": round(ratio, 3),
            "target_ratio_to_heap_min": 0.5,
            "met": events_per_s >= 200_000 and ratio >= 0.5,
        },
        "whatif_1000": {"devices": args.devices, **whatif(args.devices)},
        "whatif_10000": {"devices": args.rank_devices, **whatif_ranks(args.rank_devices)},
    }
    write_results(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

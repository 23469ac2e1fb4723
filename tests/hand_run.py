"""A run directory written as the engine would, over a hand-computed schedule.

``schedule_events`` plays the engine's FIFO rules (download, compute, upload queues per
device; one job, GEMMs one after another) over tile durations chosen as multiples of
0.25 s, so every time, sum and difference is exact in binary floating point and the
figures a report computes from it can be worked out by hand and compared exactly
(``tests/report/test_report.py`` does).

The schedule (3 devices; b-1 is slow and has a thermal model; times in s):

    step 0  coord [0, 0.5]
            gemm 0 issue 0.5: a-0 t0, b-1 t1, c-2 t2, a-0 t3; end 2.25 (b-1's t1)
            coord [2.25, 2.5]
            gemm 1 issue 2.5: b-1 t0, b-1 t1, a-0 t2 (operands resident); end 5.5 (b-1's t1)
            coord [5.5, 6.0]
    step 1  coord [6.0, 6.25]                      (b-1 throttles to 1000 MHz at 6.0)
            gemm 2 issue 6.25: a-0 t0, c-2 t1 (OOM), b-1 t2; end 8.75 (b-1's t2)
            coord [8.75, 9.0]
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BW = 4096.0  # bytes/s on every link (latency 0): a transfer of s seconds moves s × BW bytes
JOB = 1
FLEET = [
    {"id": i, "name": name, "profile": profile, "kind": "cpu", "flops": 1e9,
     "memory_bytes": 2**30, "dl_bw": BW, "ul_bw": BW, "dl_lat_s": 0.0, "ul_lat_s": 0.0,
     "cooling": "none", "source": "test schedule"}
    for i, (name, profile) in enumerate((("a-0", "fast"), ("b-1", "slow"), ("c-2", "fast")))
]  # fmt: skip


@dataclass(frozen=True)
class T:
    """A tile as the schedule gives it: its device and how long each stage takes."""

    device: int
    down: float
    compute: float
    up: float
    freq: float | None = None
    temp: float | None = None


def schedule_events(steps: list[list[float | list[T]]]) -> list[dict[str, Any]]:
    """The engine's event log for one job: a float in a step is coordinator time, a list
    is a GEMM's tiles in issue order. Each device's downlink, compute and uplink are FIFOs."""
    down_free: dict[int, float] = defaultdict(float)
    compute_free: dict[int, float] = defaultdict(float)
    up_free: dict[int, float] = defaultdict(float)
    clock, gemm, events = 0.0, 0, []
    for step, items in enumerate(steps):
        start, gemms = clock, 0
        for item in items:
            if isinstance(item, float):
                events.append({"ev": "coord", "job": JOB, "step": step, "t0": clock,
                               "t1": clock + item})  # fmt: skip
                clock += item
                continue
            tiles = []
            for i, t in enumerate(item):
                d = t.device
                down = [clock, clock]  # resident operands: nothing to move
                if t.down:
                    down = [max(clock, down_free[d]), max(clock, down_free[d]) + t.down]
                    down_free[d] = down[1]
                compute = [max(down[1], compute_free[d]), max(down[1], compute_free[d]) + t.compute]
                compute_free[d] = compute[1]
                up = [max(compute[1], up_free[d]), max(compute[1], up_free[d]) + t.up]
                up_free[d] = up[1]
                tiles.append({"ev": "tile", "job": JOB, "gemm": gemm, "step": step, "tile": i,
                              "device": d, "bytes_down": int(t.down * BW),
                              "bytes_up": int(t.up * BW), "down": down, "compute": compute,
                              "up": up, "freq_mhz": t.freq, "temp_c": t.temp})  # fmt: skip
            last = max(tiles, key=lambda e: (e["up"][1], e["device"], e["tile"]))
            events += tiles
            events.append({"ev": "gemm", "job": JOB, "gemm": gemm, "step": step, "issue": clock,
                           "end": last["up"][1], "tiles": len(tiles), "last_tile": last["tile"],
                           "last_device": last["device"], "m": 512, "n": 256, "k": 64,
                           "batch": 1})  # fmt: skip
            clock, gemm, gemms = last["up"][1], gemm + 1, gemms + 1
        events.append({"ev": "step", "job": JOB, "step": step, "t0": start, "t1": clock,
                       "gemms": gemms, "local_gemms": 1})  # fmt: skip
    return events


SLOW = 1  # b-1
SCHEDULE: list[list[float | list[T]]] = [
    [
        0.5,
        [T(0, 0.25, 0.5, 0.25), T(SLOW, 0.25, 1.25, 0.25, 1500.0, 60.0),
         T(2, 0.25, 0.5, 0.25), T(0, 0.25, 0.5, 0.25)],
        0.25,
        [T(SLOW, 0.5, 1.0, 1.25, 1500.0, 70.0), T(SLOW, 0.25, 1.0, 0.25, 1500.0, 78.0),
         T(0, 0.0, 0.5, 0.25)],
        0.5,
    ],
    [
        0.25,
        [T(0, 0.25, 0.5, 0.25), T(2, 0.25, 0.5, 0.25), T(SLOW, 0.25, 2.0, 0.25, 1000.0, 82.0)],
        0.25,
    ],
]  # fmt: skip
FREQ = {"ev": "freq", "device": SLOW, "t": 6.0, "freq_mhz": 1000.0, "temp_c": 80.5}
OOM = {"ev": "oom", "job": JOB, "gemm": 2, "step": 1, "tile": 1, "device": 2, "t": 6.25,
       "need_bytes": 3 * 2**30, "capacity_bytes": 2**30}  # fmt: skip
FUTURE = {"ev": "something-newer", "job": JOB, "payload": [1, 2, 3]}


def run_events() -> list[dict[str, Any]]:
    """The schedule's log, not in time order (the engine may log tiles as they complete),
    with one thermal step, one OOM and an event kind this reader does not know."""
    return [{**FUTURE}, *reversed(schedule_events(SCHEDULE)), {**FREQ}, {**OOM}]


def write_run(path: Path, events: list[dict[str, Any]], /, **meta: Any) -> Path:
    """A run directory: run.json (``meta`` overriding its fields) and the event log."""
    path.mkdir(parents=True, exist_ok=True)
    run = {"version": 1, "policy": "greedy", "block": 256, "coordinator_time": "model",
           "bottleneck": None, "command": ["python", "train.py"], "fleet": FLEET,
           "jobs": [{"id": JOB, "name": "train.py"}], **meta}  # fmt: skip
    (path / "run.json").write_text(json.dumps(run))
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path

#!/usr/bin/env python3
"""Tile verification's benchmarks: what it catches, what it costs.

Adds ``verify`` to ``bench-results/net.json`` (the rest of the file is kept):

- ``detected``: corrupted tiles caught (screened out, then confirmed wrong) over corrupted
  tiles checked. ``--tiles`` GEMM tiles (10,000 by default) of random shapes (m, n from 8
  to 256, K from 8 to 4096, log-uniform), float32, their operands of either sign,
  rectified, all positive or badly scaled (``tests/emulator/test_freivalds.py``'s kinds),
  each computed honestly by MKL or numpy's BLAS, then one element changed by ±s times the
  tile's RMS element, s log-uniform in [0.05, 1] (a realistic fault: a flipped exponent or
  high mantissa bit of a typical element changes it by 6 % or more);
- ``false_alarms``: the same tiles, honest, refused (target 0); ``screened_out_honest`` counts
  those the screen sent to the confirmation (they cost a recomputation, never a refusal);
- ``overhead_ratio``: host seconds of the embedded demo step (``train_demo_model.py`` on
  the demo's fleet) with ``--verify all`` over ``--verify off``: over ``--reps`` pairs of
  runs, each pair's ratio of its median steps after the first, and the median of those
  (``overhead_ratio_min``/``_max``: the pairs' spread, this host's noise). Thirty steps a
  run: on a shared two-core host one step's time varies by half from the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_net import morphling_cmd
from bench_train import DEMO_FLEET, checked
from morphling.kernels.blas import gemm
from morphling.proxy.emulator.freivalds import RequestCheck, confirm, weights
from tqdm import tqdm

KINDS = ("normal", "relu", "positive", "scaled")


def operands(rng: np.random.Generator, kind: str, m: int, k: int, n: int):
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    if kind == "relu":
        a, b = np.maximum(a, 0), b * 0.02
    elif kind == "positive":
        a, b = a + 10, b + 3
    elif kind == "scaled":  # some of K's terms a thousand times larger in A, smaller in B
        a[:, : k // 2] *= 1e3
        b[: k // 2] *= 1e-3
    return a.astype(np.float32), b.astype(np.float32)


def verdict(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, rng: np.random.Generator
) -> tuple[bool, bool]:
    """(screened out, confirmed wrong) for tile ``c`` of a·b."""
    signs = weights(rng, c.shape[1], c.dtype)
    whole = (slice(0, c.shape[0]), slice(0, c.shape[1]))
    if not RequestCheck(a[None], b[None], c[None], c.shape[1], signs).fails(0, *whole):
        return False, False
    return True, bool(confirm(a, b, c))


def bench_detection(tiles: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    caught = false_alarms = screened_honest = 0
    for i in tqdm(range(tiles), desc="verify: tiles", leave=False):
        m, n = (int(np.exp(rng.uniform(np.log(8), np.log(256)))) for _ in range(2))
        k = int(np.exp(rng.uniform(np.log(8), np.log(4096))))
        a, b = operands(rng, KINDS[i % len(KINDS)], m, k, n)
        c = gemm(a, b) if i % 2 else a @ b
        flagged, wrong = verdict(a, b, c, rng)
        screened_honest += flagged
        false_alarms += wrong
        bad = c.copy()
        rms = float(np.sqrt(np.mean(c.astype(np.float64) ** 2)))
        size = np.exp(rng.uniform(np.log(0.05), 0.0)) * rng.choice([-1.0, 1.0])
        bad[rng.integers(m), rng.integers(n)] += np.float32(size * rms)
        caught += verdict(a, b, bad, rng)[1]
    return {
        "tiles": tiles,
        "detected": round(caught / tiles, 6),
        "missed": tiles - caught,
        "false_alarms": false_alarms,
        "screened_out_honest": screened_honest,
    }


def demo_steps(workdir: Path, mode: str, steps: int) -> list[float]:
    """Host seconds of each step but the first, the embedded demo under ``--verify mode``."""
    report = workdir / f"demo-{mode}.json"
    script = str(Path(__file__).with_name("train_demo_model.py"))
    cmd = morphling_cmd("run", "--embedded", "--devices", DEMO_FLEET, "--verify", mode,
                        "--no-report", "--json", str(report), "--", "python", script,
                        "--steps", str(steps), log_level="warning")  # fmt: skip
    checked(cmd)
    return [s["host_s"] for s in json.loads(report.read_text())["steps"]][1:]


def bench_overhead(reps: int, steps: int) -> dict:
    """Each rep runs the demo under ``all`` then ``off`` (so load from elsewhere hits both
    alike): the ratio is the median over reps of each pair's ratio of median steps; the
    spread of the pairs' ratios says how noisy the host was."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs, runs = [], {"all": [], "off": []}
        for _ in tqdm(range(reps), desc="verify: demo steps", leave=False):
            on, off = demo_steps(work, "all", steps), demo_steps(work, "off", steps)
            runs["all"] += on
            runs["off"] += off
            pairs.append(statistics.median(on) / statistics.median(off))
    return {"step_s_all": round(statistics.median(runs["all"]), 4),
            "step_s_off": round(statistics.median(runs["off"]), 4),
            "overhead_ratio": round(statistics.median(pairs), 4),
            "overhead_ratio_min": round(min(pairs), 4),
            "overhead_ratio_max": round(max(pairs), 4), "reps": reps}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=10_000, help="tiles for detection")
    parser.add_argument("--reps", type=int, default=11, help="alternating demo runs of each")
    parser.add_argument("--steps", type=int, default=30, help="demo steps per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench-results/net.json"))
    args = parser.parse_args(argv)
    result = {**bench_detection(args.tiles, args.seed), **bench_overhead(args.reps, args.steps)}
    result.update(
        target_detected_min=1.0, target_false_alarms_max=0, target_overhead_ratio_max=1.05,
        met=result["detected"] >= 1.0 and result["false_alarms"] == 0
        and result["overhead_ratio"] <= 1.05,
    )  # fmt: skip
    data = json.loads(args.output.read_text()) if args.output.exists() else {}
    data["verify"] = result
    args.output.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

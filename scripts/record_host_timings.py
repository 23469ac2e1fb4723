#!/usr/bin/env python3
"""Record one measurement of this host's GEMM timings for the compute model's tests.

``tests/devices/test_compute_model.py`` fits and scores the model on this recording instead of
timing the host in every test run: a fit is judged on real MKL timings, and a busy moment
on a shared CI host cannot fail (or skip) the suite. The live figures, measured afresh
each time, are ``bench_host.py``'s ``heldout`` group. Re-record when the shape sets, the
timing method or the reference host change; the test names this script when the shapes
in the recording are no longer the ones it asks for.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from morphling.devices.models.compute import GemmShape
from morphling.devices.models.conv_shape import ConvShape
from morphling.devices.profiler import host_key
from morphling.devices.profiler.shapes import grid_shapes, heldout_shapes
from morphling.devices.profiler.timing import measure, measure_grid_and_heldout
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "tests" / "data" / "host-timings-1t.json.gz"
GRID, HELDOUT, ROUNDS = 2000, 300, 5

# Pairs that differ only in the leading dimensions: a page multiple (4096 floats) against a
# near stride (768 floats = 3 KiB). Sizes are off the grid levels, so a fit predicts them.
STRIDE_PAIRS = {
    "small": [GemmShape(120, 120, 1000, True, False, ld, ld, "float32") for ld in (4096, 768)],
    "packed": [GemmShape(300, 300, 1000, True, False, ld, ld, "float32") for ld in (4096, 768)],
}


def records(samples: Sequence[tuple[GemmShape | ConvShape, float]]) -> list[dict[str, Any]]:
    return [{**s.to_dict(), "seconds": t} for s, t in samples]


def arguments(doc: str, output: Path, argv: list[str] | None) -> argparse.Namespace:
    """``--output`` (default ``output``) and ``--rounds``: what a recording script takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=output,
        help="gzipped JSON to write (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="interleaved timing rounds (default: %(default)s)",
    )
    return parser.parse_args(argv)


def write(output: Path, rounds: int, repeat_p90: float, command: str, **sets: Any) -> None:
    """The recording: which host and how (``meta``), then each set of records."""
    meta = {
        **host_key(1),
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "host": platform.node(),
        "rounds": rounds,
        "repeat_p90": repeat_p90,
        "command": command,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(output, "wt") as f:
        json.dump({"meta": meta, **sets}, f, separators=(",", ":"))


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, DEFAULT_OUTPUT, argv)
    grid = grid_shapes(GRID, seed=0)
    held = heldout_shapes(HELDOUT, seed=1)
    pairs = [s for pair in STRIDE_PAIRS.values() for s in pair]
    total = (len(grid) + 2 * (len(held) + len(pairs))) * args.rounds
    with tqdm(total=total, unit="shape", desc="timing") as bar:
        timed = measure_grid_and_heldout(
            grid, held + pairs, measure=measure, threads=1, rounds=args.rounds, progress=bar.update
        )
    write(
        args.output,
        args.rounds,
        timed.repeat_p90,
        "python scripts/record_host_timings.py",
        grid=records(timed.grid),
        heldout=records(timed.heldout[: len(held)]),
        stride_pairs=records(timed.heldout[len(held) :]),
    )
    print(
        f"wrote {args.output}: {len(grid)} grid and {len(held)} held-out shapes, "
        f"repeat timings within {timed.repeat_p90:.1%} at p90"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

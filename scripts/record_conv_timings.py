#!/usr/bin/env python3
"""Record one measurement of this host's convolution timings for the conv model's tests.

``tests/devices/test_conv_model.py`` fits and scores the convolution model on this recording
instead of timing the host in every test run, as ``record_host_timings.py`` does for the
GEMM model; ``bench_host.py``'s ``heldout`` group measures the same figures live.
Re-record when the call sets, the timing method or the reference host change; the test
names this script when the calls in the recording are no longer the ones it asks for.
"""

from __future__ import annotations

import sys

from morphling.devices.profiler.conv_shapes import conv_grid_shapes, conv_heldout_shapes
from morphling.devices.profiler.conv_timing import measure_conv
from morphling.devices.profiler.timing import measure_grid_and_heldout
from record_host_timings import ROOT, arguments, records, write
from tqdm import tqdm

DEFAULT_OUTPUT = ROOT / "tests" / "data" / "host-conv-timings-1t.json.gz"
GRID, HELDOUT = 2000, 300


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, DEFAULT_OUTPUT, argv)
    grid = conv_grid_shapes(GRID, seed=0)
    held = conv_heldout_shapes(HELDOUT, seed=1)
    total = (len(grid) + 2 * len(held)) * args.rounds
    with tqdm(total=total, unit="call", desc="timing") as bar:
        timed = measure_grid_and_heldout(
            grid, held, measure=measure_conv, threads=1, rounds=args.rounds, progress=bar.update
        )
    write(
        args.output,
        args.rounds,
        timed.repeat_p90,
        "python scripts/record_conv_timings.py",
        grid=records(timed.grid),
        heldout=records(timed.heldout),
    )
    print(
        f"wrote {args.output}: {len(grid)} grid and {len(held)} held-out calls, "
        f"repeat timings within {timed.repeat_p90:.1%} at p90"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

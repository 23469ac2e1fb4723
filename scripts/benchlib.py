"""What every benchmark script shares: the run's metadata, writing the results, and the
command line of the step benchmarks."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from morphling.version import __version__


def run_meta(reps: int, **extra: Any) -> dict[str, Any]:
    """Where and how a benchmark ran, for the ``meta`` group of its JSON."""
    return {
        "morphling": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        **extra,
        "reps": reps,
        "python": sys.version.split()[0],
    }


def write_results(results: dict[str, Any], path: Path) -> None:
    """Write ``results`` as JSON to ``path`` (for ``bench_report.py``) and echo them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2) + "\n"
    path.write_text(text)
    print(text, end="")


def step_main(
    run: Callable[[argparse.Namespace], dict[str, Any]],
    description: str,
    *,
    output: str,
    reps: int,
    steps: int,
    argv: list[str] | None = None,
    extend: Callable[[argparse.ArgumentParser], object] | None = None,
) -> int:
    """The command line of a benchmark of training steps run alternating (``--reps``,
    ``--steps`` with the first dropped, ``--output``; ``extend`` adds its own flags):
    ``run``'s results written to the output."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reps", type=int, default=reps, help="alternating runs of each (>= 1)")
    parser.add_argument("--steps", type=int, default=steps, help="steps per run, first dropped")
    parser.add_argument("--output", type=Path, default=Path(output))
    if extend is not None:
        extend(parser)
    args = parser.parse_args(argv)
    if args.reps < 1 or args.steps < 2:
        parser.error("--reps must be >= 1 and --steps >= 2")
    write_results(run(args), args.output)
    return 0

"""``morphling profile``: measure this host and write a device profile TOML.

A one-shot command, so a plain argparse parser (like ``morphling save``) rather than the
layered configuration of the long-running roles.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

from morphling.devices.profiler import FULL, LARGE_GEMM, QUICK, ProfileResult, plan_size, profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure this host's GEMM and convolution speed and write a device profile",
        description=(
            "Time a grid of GEMM tile shapes and strides with the real kernels, fit the "
            "stride-aware compute model, score it on held-out shapes; likewise for a grid of "
            "convolution calls (general, grouped, depthwise, 1x1, strided, dilated, 1-D; "
            "forward and both gradients) and the convolution model; record a sustained-load "
            "trace, and write a profile TOML that --profile and fleet specs accept. Where "
            "/sys/class/thermal has a sensor and --ambient is given, the load is followed by a "
            "cooldown and the RC thermal model fitted to the trace is written too. The "
            "built-in profile 'host' is this command's --quick run, made once and cached."
        ),
    )
    p.add_argument("--output", required=True, type=Path, metavar="PROFILE", help="TOML to write")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="BLAS threads to measure with: the device's --threads (default: %(default)s)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.grid} GEMM and {QUICK.conv_grid} convolution grid shapes and a "
        f"{QUICK.duration_s:g} s trace, about 30 s (default: {FULL.grid} and {FULL.conv_grid} "
        f"shapes and {FULL.duration_s:g} s, about 4 minutes)",
    )
    p.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="seconds of sustained load for the thermal trace (default: as --quick says; "
        "boards take minutes to throttle, so give 600 or more on one)",
    )
    p.add_argument(
        "--cooldown",
        type=float,
        metavar="S",
        help="seconds of idle recorded after the load for the thermal fit (default: as long "
        "as the load; only where there is a temperature sensor and --ambient)",
    )
    p.add_argument(
        "--ambient",
        type=float,
        metavar="C",
        help="room temperature in C: with a temperature sensor, fit the thermal model "
        "(a warm trace cannot tell the room from the board's idle rise)",
    )
    p.add_argument("--name", default="host", help="profile name (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite an existing PROFILE")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _usage_error(message: str) -> int:
    print(f"morphling profile: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    output: Path = args.output
    if args.threads < 1:
        return _usage_error(f"--threads must be >= 1, got {args.threads}")
    if args.duration is not None and not 0 < args.duration < float("inf"):
        return _usage_error(f"--duration must be a positive number of seconds, got {args.duration}")
    if args.cooldown is not None and not 0 <= args.cooldown < float("inf"):
        return _usage_error(f"--cooldown must be a number of seconds >= 0, got {args.cooldown}")
    if args.ambient is not None and not -273.15 < args.ambient < float("inf"):
        return _usage_error(f"--ambient must be a temperature in C, got {args.ambient}")
    if not args.name:
        return _usage_error("--name must not be empty")
    if output.exists() and not args.force:
        return _usage_error(f"{output} exists; pass --force to overwrite it")
    if not output.parent.is_dir():
        return _usage_error(f"directory {output.parent} does not exist")
    plan = QUICK if args.quick else FULL
    with tqdm(
        total=plan_size(plan), desc="shape grids", unit="shape", disable=args.no_progress or None
    ) as bar:
        result = profile(
            output,
            threads=args.threads,
            plan=plan,
            duration_s=args.duration,
            cooldown_s=args.cooldown,
            ambient_c=args.ambient,
            name=args.name,
            force=args.force,
            progress=bar.update,
        )
    error, conv, trace, large = result.heldout, result.conv_heldout, result.bursts, LARGE_GEMM
    sensor = "temperatures recorded" if trace.has_temperatures else "no temperature sensor"
    print(
        f"wrote {result.path}: {result.flops / 1e9:.1f} GFLOP/s on a {large.m}x{large.n}x"
        f"{large.k} {large.dtype} GEMM; "
        f"held-out error median {error['median_ape']:.1%}, p90 {error['p90_ape']:.1%} "
        f"over {error['count']} GEMM shapes, median {conv['median_ape']:.1%}, p90 "
        f"{conv['p90_ape']:.1%} over {conv['count']} convolutions; {_ops(result)}; trace "
        f"{trace.latency_s.size} bursts, {sensor}; thermal model {result.thermal_status}"
    )
    return 0


def _ops(result: ProfileResult) -> str:
    """The op model in a few words: its error on the items it was fitted to, or why none."""
    if result.ops is None:
        return "no op model (torch is not installed)"
    error = result.ops_error
    return (f"op model within {error['median_ape']:.1%} median, {error['p90_ape']:.1%} p90 of "
            f"{error['count']} timed items")  # fmt: skip

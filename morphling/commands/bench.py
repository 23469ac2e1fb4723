"""``morphling-bench``: measure the link to an emulator and this machine's verified FLOPS.

The measuring is ``morphling.devices.bench`` (a probe peer); this is the command:
arguments, the table or JSON, the exit status (0 success, 1 the FLOPS verdict failed
or a measurement broke off, 2 a usage error, an unreachable server or a refused
handshake).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import uvloop

from morphling.config import parse_int, read_secret
from morphling.devices.bench import LATENCY_BYTES, PROG, BenchError, run_bench
from morphling.proxy.wire.challenge import MAX_DIM
from morphling.runtime import parse_server
from morphling.version import __version__

log = logging.getLogger(__name__)

DEFAULT_SIZES = "64KiB,1MiB,4MiB,16MiB,64MiB"  # small messages to bulk transfers
MAX_SIZE = 1 << 30  # the emulator's default max_payload_bytes
LOG_LEVELS = ("debug", "info", "warning", "error")


# -- sizes ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``65536``, ``64KiB``, ``4MiB``, ``1GiB`` (binary units; decimal ``MB`` is ambiguous)."""
    try:
        nbytes = parse_int(text)
    except ValueError:
        raise ValueError(
            f"size {text!r}: expected an integer with an optional B, KiB, MiB or GiB suffix"
        ) from None
    if not 1 <= nbytes <= MAX_SIZE:
        raise ValueError(f"size {text!r}: must be 1 B .. 1 GiB")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, each as ``parse_size`` reads it."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"sizes {text!r}: no size given")
    return [parse_size(p) for p in parts]


def render_table(report: dict[str, Any]) -> str:
    """The human-readable form of a report."""
    lat = report["latency"]
    lines = [
        f"morphling-bench → {report['server']} (probe peer {report['peer_id']})",
        "",
        f"latency ({lat['bytes']} B echo, RTT/2, {lat['rounds']} rounds): "
        f"median {lat['median_us']:.1f} µs, min {lat['min_us']:.1f} µs",
        "",
        f"{'size':>8}  {'down (emulator → here)':>24}  {'up (here → emulator)':>24}",
    ]
    for row in report["bandwidth"]:
        down = f"{row['down_bytes_s'] / 1e6:,.1f} MB/s ({row['down_gbit_s']:.2f} Gbit/s)"
        up = f"{row['up_bytes_s'] / 1e6:,.1f} MB/s ({row['up_gbit_s']:.2f} Gbit/s)"
        lines.append(f"{row['size']:>8}  {down:>24}  {up:>24}")
    fl = report["flops"]
    dim = fl["dim"]
    compute = f"compute {fl['compute_ns'] / 1e3:,.1f} µs, best of {fl['runs']}"
    if fl["ok"]:
        verdict = f"passed, {fl['gflops']:,.2f} GFLOP/s verified ({compute})"
    else:
        verdict = f"FAILED: {fl['reason'] or 'no reason given'} ({compute})"
    lines += ["", f"FLOPS challenge ({dim}×{dim} float32): {verdict}"]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is outside {bounds}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Measure the link to a Morphling emulator (latency, bandwidth each "
        "direction) and this machine's FLOPS, verified by the emulator's challenge.",
        epilog="Exit status: 0 success; 1 the FLOPS verdict failed or a measurement broke "
        "off; 2 a usage error, an unreachable server or a refused handshake.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "--server",
        required=True,
        metavar="HOST:PORT",
        help="emulator address (HOST alone means port 39000; [v6]:PORT for IPv6)",
    )
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token",
        default="",
        help="shared secret, if the emulator requires one (ps shows it here: prefer --token-file)",
    )
    token.add_argument(
        "--token-file", metavar="PATH", help="read the shared secret from this file, one line"
    )
    parser.add_argument(
        "--sizes",
        type=_sizes_arg,
        default=parse_sizes(DEFAULT_SIZES),
        metavar="LIST",
        help="bandwidth payload sizes, comma-separated, with B/KiB/MiB/GiB "
        f"suffixes, e.g. 64KiB,1MiB,4MiB (default: {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--repeats",
        type=_bounded_int(1),
        default=3,
        metavar="N",
        help="transfers per size and direction; the median is reported (default: 3)",
    )
    parser.add_argument(
        "--latency-rounds",
        type=_bounded_int(1),
        default=20,
        metavar="N",
        help=f"{LATENCY_BYTES} B echoes for the latency (default: 20)",
    )
    parser.add_argument(
        "--flops-dim",
        type=_bounded_int(1, MAX_DIM),
        default=256,
        metavar="N",
        help="FLOPS challenge matrix size, N×N float32 (default: 256)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="limit for connecting and for each reply, a bandwidth transfer's plus its bytes "
        "at 1 Mbit/s (default: 30)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar on stderr"
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="logging level on stderr (default: warning)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``morphling-bench`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        host, port = parse_server(args.server)
        if args.token_file is not None:
            args.token = read_secret(args.token_file, "--token-file")
    except ValueError as exc:  # ConfigError is one
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = {
            k: getattr(args, k)
            for k in (
                "token",
                "sizes",
                "latency_rounds",
                "repeats",
                "flops_dim",
                "timeout",
                "progress",
            )
        }
        report = uvloop.run(run_bench(host, port, **settings))
    except BenchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2) if args.json else render_table(report))
    if not report["flops"]["ok"]:
        print(f"{PROG}: FLOPS challenge failed: {report['flops']['reason']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``morphling sweep``: one training script on several fleets, links and coolings, compared.

Each combination is a separate ``morphling run --embedded`` child process (a fresh
interpreter: no emulator state leaks from one run into the next) writing its own run
directory under ``--out``; its output goes to ``LABEL.log`` beside it. The run
directories are then summarised (``report.summarize``) into one comparison table.
SIGTERM or SIGINT to the sweep is passed on to the running child, which ends its run
cleanly; the sweep waits for it (``GRACE_S``, then SIGKILL), runs no more and exits
143 or 130.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from morphling.devices.models.capacity import MAX_DEVICES_HELP
from morphling.devices.models.profiles import expand_fleet
from morphling.interrupt import Signals
from morphling.outputs import check_dir_writable
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.load import load_run
from morphling.proxy.report.summary import Summary
from morphling.proxy.vtime.eventlog import EVENT_LEVELS
from morphling.text import format_bytes

COOLINGS = ("none", "fan")
LOG_TAIL_LINES = 20
# ``morphling run`` exits 2 on a usage error (a bad preset, a bad spec): every run would.
USAGE_ERROR = 2
# How long a signalled child may take to end its run (stop its fleet, write its reports).
GRACE_S = 60.0


@dataclass(frozen=True)
class Combination:
    """One run of the sweep; None: the flag is not passed (the profiles' own setting)."""

    fleet: str
    link: str | None
    cooling: str | None

    @property
    def label(self) -> str:
        """A directory name: the settings, with anything but letters, digits, . and - as -."""
        words = (self.fleet, self.link or "default", self.cooling or "default")
        return "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", w).strip("-") for w in words)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a script on every combination of fleets, links and coolings; compare them",
        description=(
            "Run the training command once per combination of --fleet, --link and --cooling "
            "(morphling run --embedded, each in its own process and run directory under "
            "--out), then print one table comparing mean step time, total emulated time, "
            "utilisation, bytes moved and OOMs: morphling sweep --fleet rpi4:8 --fleet "
            "orin-nano:2 --link lan --link wifi -- python train.py ARGS."
        ),
    )
    p.add_argument(
        "--fleet",
        action="append",
        required=True,
        metavar="SPEC",
        help="a fleet SPEC as for morphling run --devices (repeat for more)",
    )
    p.add_argument(
        "--link",
        action="append",
        metavar="PRESET",
        help="a link preset for every device (repeat for more; default: the profiles' own)",
    )
    p.add_argument(
        "--cooling",
        action="append",
        choices=COOLINGS,
        help="cooling of every device (repeat for more; default: the profiles' own)",
    )
    p.add_argument(
        "--max-devices",
        type=int,
        default=0,
        metavar="N",
        help=f"{MAX_DEVICES_HELP} (default: 0)",
    )
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="directory for the run directories and logs (default: sweep-DATE-TIME)",
    )
    p.add_argument(
        "--steps-from",
        type=int,
        default=1,
        metavar="N",
        help="mean step time skips each job's first N steps (warm-up) when it has more "
        "(default: 1)",
    )
    p.add_argument(
        "--events",
        choices=[level for level in EVENT_LEVELS if level != "off"],
        help="what each run's event log keeps, as morphling run --events (default: "
        "morphling run's); the comparison needs a log",
    )
    p.add_argument(
        "--auto-block",
        action="store_true",
        help="each run's GEMMs cut into tiles of the edge greedy predicts ends them "
        "soonest on its fleet, as morphling run --auto-block",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- [python] SCRIPT.py|-m MODULE [ARGS]"
    )
    p.set_defaults(func=run)


def combinations(args: argparse.Namespace) -> list[Combination]:
    """Fleets × links × coolings, in the order given (the first is the speed-up baseline)."""
    return [
        Combination(*c)
        for c in itertools.product(args.fleet, args.link or [None], args.cooling or [None])
    ]


def passed_flags(events: str | None, max_devices: int, auto_block: bool = False) -> list[str]:
    """The sweep's flags that every ``morphling run`` child gets, where given."""
    flags = [] if events is None else ["--events", events]
    flags += ["--auto-block"] if auto_block else []
    return flags + (["--max-devices", str(max_devices)] if max_devices else [])


def child_command(
    combo: Combination, run_dir: Path, command: list[str], passed: Sequence[str] = ()
) -> list[str]:
    """The ``morphling run`` child for one combination, with the flags the sweep passes on."""
    flags = ["--embedded", "--devices", combo.fleet, "--run-dir", str(run_dir), *passed]
    if combo.link is not None:
        flags += ["--link", combo.link]
    if combo.cooling is not None:
        flags += ["--cooling", combo.cooling]
    return [sys.executable, "-m", "morphling", "run", *flags, "--", *command]


def mean_step_s(summary: Summary, steps_from: int) -> float | None:
    """Mean emulated time of the complete steps, each job's first ``steps_from`` left out
    when the job has more than that (warm-up: caches are cold, devices cool)."""
    times = []
    for job in summary["jobs"]:
        steps = [s["emulated_s"] for s in job["steps"] if s["complete"]]
        times += steps[steps_from:] if len(steps) > steps_from else steps
    return statistics.fmean(times) if times else None


def comparison_row(combo: Combination, summary: Summary, steps_from: int) -> dict:
    """One line of the comparison, from a run's summary."""
    totals = summary["totals"]
    return {
        **asdict(combo),
        "label": combo.label,
        "run_dir": summary["run"]["path"],
        "devices": totals["devices"],
        "steps": totals["steps"],
        "mean_step_s": mean_step_s(summary, steps_from),
        "total_s": totals["span_s"],
        "mean_utilisation": totals["mean_utilisation"],
        "bytes_moved": totals["bytes_down"] + totals["bytes_up"],
        "oom": totals["oom"],
    }


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its speed-up: the first row's mean step time over its own."""
    base = rows[0]["mean_step_s"] if rows else None
    return [
        {**r, "speedup": base / r["mean_step_s"] if base and r["mean_step_s"] else None}
        for r in rows
    ]


def format_comparison(rows: list[dict[str, Any]]) -> str:
    """The comparison as a fixed-width table."""
    fleet_w = max([len("fleet"), *(len(r["fleet"]) for r in rows)])
    head = (
        f"{'fleet':<{fleet_w}} {'link':<8} {'cooling':<8} {'devices':>7} {'step s':>10} "
        f"{'total s':>10} {'util %':>7} {'moved':>10} {'OOM':>5} {'speed-up':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        step = "-" if r["mean_step_s"] is None else f"{r['mean_step_s']:.4f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"{r['fleet']:<{fleet_w}} {r['link'] or 'default':<8} {r['cooling'] or 'default':<8} "
            f"{r['devices']:>7} {step:>10} {r['total_s']:>10.4f} "
            f"{100 * r['mean_utilisation']:>7.1f} {format_bytes(r['bytes_moved']):>10} "
            f"{r['oom']:>5} {speedup:>8}"
        )
    return "\n".join(lines)


def _usage(message: str) -> int:
    print(f"morphling sweep: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _usage("no training command: morphling sweep --fleet SPEC ... -- python train.py")
    if args.steps_from < 0:
        return _usage(f"--steps-from must be >= 0, got {args.steps_from}")
    if args.max_devices < 0:
        return _usage(f"--max-devices must be >= 0, got {args.max_devices}")
    try:
        for spec in args.fleet:
            expand_fleet(spec, max_devices=args.max_devices)
    except ValueError as exc:
        return _usage(str(exc))
    out = args.out or Path(time.strftime("sweep-%Y%m%d-%H%M%S"))
    combos = combinations(args)
    if len({c.label for c in combos}) < len(combos):
        return _usage("a --fleet, --link or --cooling is given twice")
    taken = [c.label for c in combos if (out / c.label).exists()]
    if taken:
        return _usage(f"{out} already holds {', '.join(taken)}: choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _usage(f"--out {out}: cannot create it: {exc.strerror}")
    try:
        check_dir_writable(out)  # now, not when the first run's log is opened
    except OSError as exc:
        return _usage(f"--out {out}: cannot write in it: {exc.strerror}")

    rows, failed = [], []
    passed = passed_flags(args.events, args.max_devices, args.auto_block)
    running: list[subprocess.Popen] = []  # the child a signal is passed on to

    def forward(signum: int) -> None:
        for child in running:
            child.send_signal(signum)  # nothing once it has been reaped

    with (
        Signals(forward) as signals,
        tqdm(combos, desc="sweep", unit="run", disable=args.no_progress) as bar,
    ):
        for combo in bar:
            if signals.received is not None:
                break
            bar.set_postfix_str(combo.label)
            code, result = _run_one(combo, out, command, passed, signals, running)
            if not isinstance(result, str):
                rows.append(comparison_row(combo, result, args.steps_from))
                continue
            failed.append({"label": combo.label, "exit": code})
            ended = "failed" if signals.received is None else "was interrupted"
            bar.write(f"morphling sweep: run {combo.label} {ended}: {result}", file=sys.stderr)
            if code == USAGE_ERROR:
                bar.write(
                    "morphling sweep: a usage error; the remaining runs are skipped",
                    file=sys.stderr,
                )
                return USAGE_ERROR
    rows = with_speedups(rows)
    if args.json:
        print(
            json.dumps(
                {"out": str(out), "steps_from": args.steps_from, "runs": rows, "failed": failed},
                indent=1,
            )
        )
    elif rows:
        print(format_comparison(rows))
    if signals.exit_code is not None:
        return signals.exit_code
    return 1 if failed else 0


def _run_one(
    combo: Combination,
    out: Path,
    command: list[str],
    passed: list[str],
    signals: Signals,
    running: list[subprocess.Popen],
) -> tuple[int, Summary | str]:
    """Run one combination: (exit code, its run's summary, or what went wrong)."""
    run_dir, log = out / combo.label, out / f"{combo.label}.log"
    with log.open("w") as f:
        child = subprocess.Popen(
            child_command(combo, run_dir, command, passed), stdout=f, stderr=subprocess.STDOUT
        )
        running.append(child)
        try:
            if signals.received is not None:  # it came while the child was being started
                child.send_signal(signals.received)
            code = _wait(child, signals)
        finally:
            running.remove(child)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return code, f"exit {code}; the end of {log}:\n" + "\n".join(tail)
    try:
        return code, summarize(load_run(run_dir))
    except ValueError as exc:
        return 1, str(exc)


def _wait(child: subprocess.Popen, signals: Signals) -> int:
    """The child's exit code. Once the sweep has been signalled (and passed the signal
    on), the child has ``GRACE_S`` to end its run before it is killed."""
    while True:
        try:
            return child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            if signals.since is not None and time.monotonic() - signals.since > GRACE_S:
                child.kill()

"""``morphling report RUN_DIR``: what a run directory says, as text, JSON, a trace and plots.

The text summary goes to stdout (or, with ``--json``, summary.json's content, so a script
can pipe it); the list of files written goes to stderr. Every step is in the summary; the
trace, the timeline and the critical-path segments show the steps of ``--detail-steps``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.files import write_report_files
from morphling.proxy.report.load import DEFAULT_DETAIL, StepFigures, StepRange, load_run, steps_text
from morphling.proxy.report.text import format_summary


def _step_range(text: str) -> StepRange:
    """``--detail-steps``: a bad range is a usage error (exit 2), said by argparse."""
    try:
        return StepRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="summarise a run directory: per-step times, utilisation, stragglers, trace, plots",
        description=(
            "Read the run directory that morphling run --run-dir wrote, print a summary "
            "(per-step emulated time, busiest devices, stragglers, the slowest step's critical "
            "path, OOMs) and write summary.json, trace.json (open it in ui.perfetto.dev) and "
            "PNG plots into it. The summary covers every step; the trace, timeline.png and "
            "each step's critical-path segments cover the steps of --detail-steps."
        ),
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the text")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.add_argument(
        "--detail-steps",
        type=_step_range,
        metavar="A:B|all",
        help="the steps of each job (A to B, both included; A:, :B, N or all) that trace.json, "
        "timeline.png and the critical-path segments show tile by tile, of those the log has "
        f"tiles for (default: {DEFAULT_DETAIL}, the first {DEFAULT_DETAIL.last})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        loaded = load_run(args.run_dir, args.detail_steps or DEFAULT_DETAIL)
        if args.detail_steps is not None and not any(loaded.shows(s.step) for s in loaded.steps):
            print(
                f"morphling report: --detail-steps {args.detail_steps}: the log has the tiles of "
                f"{steps_text(loaded.logged)} (--events {loaded.level}) and the run has "
                f"{_steps(loaded.steps)}: no step to show",
                file=sys.stderr,
            )
            return 2
        summary = summarize(loaded)
        paths = write_report_files(loaded, summary, plots=not args.no_plots)
    except ValueError as exc:  # RunError: not a run, or a garbled one
        print(f"morphling report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"morphling report: cannot write the reports: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _steps(steps: tuple[StepFigures, ...]) -> str:
    """The range of step numbers of a run."""
    numbers = [s.step for s in steps]
    return f"steps {min(numbers)}-{max(numbers)}" if numbers else "no step"

"""``morphling report RUN_DIR``: what a run directory says, as text, JSON, a trace and plots.

The text summary goes to stdout (or, with ``--json``, summary.json's content, so a script
can pipe it); the list of files written goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="summarise a run directory: per-step times, utilisation, stragglers, trace, plots",
        description=(
            "Read the run directory that morphling run --run-dir wrote, print a summary "
            "(per-step emulated time, busiest devices, stragglers, the slowest step's critical "
            "path, OOMs) and write summary.json, trace.json (open it in ui.perfetto.dev) and "
            "PNG plots into it."
        ),
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the text")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .report import format_summary, load_run, summarize, write_report_files

    try:
        loaded = load_run(args.run_dir)
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

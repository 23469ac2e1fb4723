"""The report files a run directory gets: summary.json, trace.json and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from .analysis import summarize
from .load import DEFAULT_DETAIL, Run, StepRange, load_run
from .plots import PLOT_FILES, write_plots
from .summary import Summary
from .trace import write_trace

SUMMARY_FILE, TRACE_FILE = "summary.json", "trace.json"
# Every file ``write_report_files`` may write: a run directory holding any other is not
# replaced by ``morphling run --force``.
REPORT_FILES = (SUMMARY_FILE, TRACE_FILE, *PLOT_FILES.values())


def write_reports(
    run_dir: str | Path, *, plots: bool = True, detail: StepRange = DEFAULT_DETAIL
) -> list[Path]:
    """Load and summarise the run in ``run_dir`` and write its reports there; their paths."""
    run = load_run(run_dir, detail)
    return write_report_files(run, summarize(run), plots=plots)


def write_report_files(run: Run, summary: Summary, *, plots: bool = True) -> list[Path]:
    """``summary.json``, ``trace.json`` and (with ``plots``) the PNGs, in the run directory."""
    summary_path, trace_path = run.path / SUMMARY_FILE, run.path / TRACE_FILE
    with summary_path.open("w") as f:  # written as it is encoded: a long run has many steps
        json.dump(summary, f, indent=1)
        f.write("\n")
    write_trace(run, trace_path)
    paths = [summary_path, trace_path]
    if plots:
        paths += write_plots(run, summary, run.path)
    return paths

"""What every benchmark script shares: the run's metadata and writing the results."""

from __future__ import annotations

import json
import platform
import sys
import time
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

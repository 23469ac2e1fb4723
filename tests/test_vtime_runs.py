"""The virtual timeline end to end: ``morphling run`` twice, once beside a CPU hog.

With modelled coordinator time the event log depends only on the script, its
seed and the fleet: the same run on a quiet and on a loaded host must give the
same log, bit for bit (its sha256 is in ``run.json``). Every run directory is
then reported on: summary, trace and plots, and ``morphling report`` reads it
again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from processes import child_env
from test_run import SCRIPTS, morphling_run, succeeded

FLEET = ("--embedded", "--devices", "rpi4:2,orin-nano:1,jetson-nano:1", "--block-size", "16",
         "--min-flops", "0", "--coordinator-time", "model")  # fmt: skip
HOG = "import itertools\nfor _ in itertools.count(): pass\n"


def run_training(run_dir: Path, state: Path) -> dict:
    succeeded(morphling_run(*FLEET, "--run-dir", run_dir, "--", "python",
                            SCRIPTS / "train_opt.py", state))  # fmt: skip
    return json.loads((run_dir / "run.json").read_text())


def test_same_run_same_timeline_however_loaded_the_host(tmp_path):
    quiet = run_training(tmp_path / "quiet", tmp_path / "quiet.pt")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], env=child_env())
            for _ in range(os.cpu_count() or 1)]  # fmt: skip
    try:
        loaded = run_training(tmp_path / "loaded", tmp_path / "loaded.pt")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert quiet["events"] > 1000 and quiet["events"] == loaded["events"]
    assert quiet["digest"] == loaded["digest"]
    quiet_log = (tmp_path / "quiet" / "events.jsonl").read_bytes()
    assert quiet_log == (tmp_path / "loaded" / "events.jsonl").read_bytes()


def test_run_directory_is_reported_and_report_reads_it_again(tmp_path):
    run_dir = tmp_path / "run"
    run = run_training(run_dir, tmp_path / "state.pt")
    assert [d["profile"] for d in run["fleet"]] == ["rpi4", "rpi4", "orin-nano", "jetson-nano"]
    assert run["coordinator_time"] == "model"
    for name in ("summary.json", "trace.json", "timeline.png", "utilisation.png", "steps.png",
                 "thermal.png"):  # fmt: skip
        assert (run_dir / name).stat().st_size > 0, name
    summary = json.loads((run_dir / "summary.json").read_text())
    trace = json.loads((run_dir / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    proc = subprocess.run(
        [sys.executable, "-m", "morphling", "report", "--json", "--no-plots", str(run_dir)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == summary
    missing = subprocess.run(
        [sys.executable, "-m", "morphling", "report", str(tmp_path / "nowhere")],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert missing.returncode == 1 and "nowhere" in missing.stderr

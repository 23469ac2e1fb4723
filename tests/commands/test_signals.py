"""SIGTERM and SIGINT to ``morphling run`` and ``morphling sweep`` mid-training.

Real signals to real processes training ``tests/scripts/train_forever.py``: each must end
every process it started, leave a run directory ``morphling report`` reads (marked
incomplete, with the signal), leave none of its files in /dev/shm, and exit 143 or 130.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from morphling.proxy.report.load import load_run
from morphling.proxy.shm.files import shm_dir
from processes import MORPHLING, Procs, child_env

FOREVER = Path(__file__).parents[1] / "scripts" / "train_forever.py"
SIGNALS = [pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
           pytest.param(signal.SIGINT, 130, id="SIGINT")]  # fmt: skip
TIMEOUT_S = 150


def shm_files(pid: int) -> list[Path]:
    """The shared-memory files process ``pid`` created (their names carry its pid)."""
    return sorted(shm_dir().glob(f"morphling-*-{pid}-*"))


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_for_text(path: Path, needle: str, procs: Procs, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and needle in path.read_text(errors="replace")):
        if time.monotonic() > deadline:
            procs.fail(f"no {needle!r} in {path} after {timeout} s")
        time.sleep(0.1)


def reported(run_dir: Path) -> dict:
    """``morphling report RUN_DIR --json``, which must accept the directory."""
    proc = subprocess.run([*MORPHLING, "report", str(run_dir), "--json", "--no-plots"],
                          capture_output=True, text=True, env=child_env(), timeout=TIMEOUT_S,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_run_ends_cleanly_on_signal(procs: Procs, tmp_path: Path, sig: int, code: int) -> None:
    run_dir, report = tmp_path / "run", tmp_path / "report.json"
    proc = procs.start(
        "run", "--log-level", "warning", "run", "--embedded", "--devices", "2",
        "--run-dir", str(run_dir), "--json", str(report), "--", "python", str(FOREVER),
    )  # fmt: skip
    procs.wait_for(proc, "step 3", timeout=TIMEOUT_S)
    pid = proc.popen.pid
    assert shm_files(pid), "the run has no operand arena: the check below would prove nothing"
    proc.signal(sig)
    assert proc.wait(timeout=TIMEOUT_S) == code, proc.text()[-3000:]
    text, name = proc.text(), signal.Signals(sig).name
    assert f"morphling run: interrupted by {name}" in text
    assert "Traceback" not in text
    assert shm_files(pid) == []
    assert children(pid) == []
    steps = json.loads(report.read_text())["steps"]  # --json: what was measured
    assert len(steps) >= 3
    assert " step  emulated s" in text  # the per-step table
    summary = reported(run_dir)
    assert summary["run"]["incomplete"] == f"interrupted by {name}"
    logged = summary["jobs"][0]["steps"]
    assert len(logged) in (len(steps), len(steps) + 1)  # and the step cut short, if any
    assert "incomplete: the run ended early" in text  # the summary printed at the end


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_sweep_passes_signal_on(procs: Procs, tmp_path: Path, sig: int, code: int) -> None:
    """The signal to the sweep's pid alone: its child ends its run as it would itself."""
    out = tmp_path / "out"
    sweep = procs.start(
        "sweep", "--log-level", "warning", "sweep", "--no-progress", "--fleet", "2",
        "--fleet", "3", "--out", str(out), "--", "python", str(FOREVER),
    )  # fmt: skip
    log = out / "2_default_default.log"
    wait_for_text(log, "step 3", procs)
    [child] = children(sweep.popen.pid)
    assert shm_files(child), "the run has no operand arena: the check below would prove nothing"
    sweep.signal(sig)
    assert sweep.wait(timeout=TIMEOUT_S) == code, sweep.text()[-3000:]
    name = signal.Signals(sig).name
    assert not running(child)
    assert shm_files(child) == []
    assert f"morphling run: interrupted by {name}" in log.read_text()
    assert load_run(out / "2_default_default").incomplete == f"interrupted by {name}"
    assert not (out / "3_default_default").exists()  # no run starts after the signal

"""The virtual timeline end to end: ``morphling run`` twice, once beside a CPU hog.

With modelled coordinator time the event log depends only on the script, its
seed and the fleet: the same run on a quiet and on a loaded host must give the
same log, bit for bit (its sha256 is in ``run.json``). Every run directory is
then reported on: summary, trace and plots, and ``morphling report`` reads it
again. The same deterministic run with each ``--events`` level: a compressed full
log, a ``steps`` log with the same per-step figures, no log at all; and a run
directory as older engines left it (uncompressed) is still read.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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
    quiet_log = (tmp_path / "quiet" / "events.jsonl.gz").read_bytes()
    assert quiet_log == (tmp_path / "loaded" / "events.jsonl.gz").read_bytes()


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


# -- what the event log keeps (--events) --------------------------------------------------------

# 30 SGD steps of a small MLP; tiles of 16 rows make each GEMM many tiles, as a large
# model's are.
MLP = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(30):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done", loss.item())
"""
MLP_STEPS = 30


def report(run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "morphling", "report", *flags, str(run_dir)],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def levels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The same deterministic run at each level: its run directory and its stderr."""
    tmp = tmp_path_factory.mktemp("levels")
    script = tmp / "mlp.py"
    script.write_text(MLP)
    runs = {}
    for level in ("full", "steps", "off"):
        proc = succeeded(morphling_run(*FLEET, "--run-dir", tmp / level, "--events", level,
                                       "--", "python", script))  # fmt: skip
        runs[level] = (tmp / level, proc.stderr)
    return runs


def meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_full_log_is_compressed_and_its_digest_verifiable(levels):
    run_dir, _ = levels["full"]
    run = meta(run_dir)
    assert run["event_log"] == "full" and run["event_file"] == "events.jsonl.gz"
    assert not (run_dir / "events.jsonl").exists()
    compressed = (run_dir / "events.jsonl.gz").read_bytes()
    text = gzip.decompress(compressed)
    assert hashlib.sha256(text).hexdigest() == run["digest"]
    assert text.count(b"\n") == run["events"]
    kinds = {json.loads(line)["ev"] for line in text.splitlines()}
    assert {"tile", "gemm", "coord", "step"} <= kinds and "device_step" not in kinds
    # The uncompressed log is what a run used to leave: the compressed one is a fraction.
    assert len(compressed) * 4 < len(text), (len(compressed), len(text))


def test_steps_log_has_the_full_logs_per_step_figures(levels):
    (full_dir, _), (steps_dir, stderr) = levels["full"], levels["steps"]
    assert meta(steps_dir)["event_log"] == "steps"
    full = json.loads(succeeded(report(full_dir, "--json", "--no-plots")).stdout)
    steps = json.loads(succeeded(report(steps_dir, "--json", "--no-plots")).stdout)
    full_steps, step_steps = full["jobs"][0]["steps"], steps["jobs"][0]["steps"]
    assert len(full_steps) == len(step_steps) == MLP_STEPS
    for a, b in zip(full_steps, step_steps, strict=True):
        assert b["critical_path"].pop("segments") is None  # a full log's GEMMs only
        del a["critical_path"]["segments"]
        assert a == b  # times, totals and critical paths, to the bit
    mean = "mean_utilisation"  # of busy times, below
    assert steps["totals"].pop(mean) == pytest.approx(full["totals"].pop(mean), rel=1e-12)
    assert steps["totals"] == full["totals"]
    for a, b in zip(full["devices"], steps["devices"], strict=True):
        for key in ("tiles", "bytes_down", "bytes_up", "last_in", "final_temp_c",
                    "top_freq_mhz", "below_top_s"):  # fmt: skip
            assert a[key] == b[key], key
        # a FIFO's busy time: the union of its tiles' stages, or their sum per step
        for key in ("busy_s", "utilisation", "downlink_utilisation", "uplink_utilisation"):
            assert b[key] == pytest.approx(a[key], rel=1e-12), key
        assert b["lateness"] is None and b["gemms"] is None and b["expected_last"] is None
    assert steps["stragglers"]["devices"] is None
    # What is left out is said, not shown as zeros; the per-tile plot is not drawn.
    assert "event log: steps" in stderr and "stragglers" in stderr
    assert "not known from a steps log" in stderr
    assert not (steps_dir / "timeline.png").exists() and (steps_dir / "steps.png").exists()
    trace = json.loads((steps_dir / "trace.json").read_text())
    assert trace["otherData"]["event_log"].startswith("steps: no tiles")
    full_log = (full_dir / "events.jsonl.gz").stat().st_size
    assert (steps_dir / "events.jsonl.gz").stat().st_size * 4 < full_log


def test_off_writes_no_log_and_report_says_so(levels):
    run_dir, stderr = levels["off"]
    assert "emulated s" in stderr  # the per-step table still prints
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.json"]
    run = meta(run_dir)
    assert run["event_log"] == "off" and "digest" not in run
    proc = report(run_dir)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "--events off" in proc.stderr


def test_report_reads_an_uncompressed_log_and_refuses_a_cut_one(levels, tmp_path):
    full_dir, _ = levels["full"]
    expected = json.loads(succeeded(report(full_dir, "--json", "--no-plots")).stdout)
    old = tmp_path / "old"  # as engines before compression left it
    old.mkdir()
    run = meta(full_dir)
    del run["event_log"], run["event_file"]
    (old / "run.json").write_text(json.dumps(run))
    (old / "events.jsonl").write_bytes(gzip.decompress((full_dir / "events.jsonl.gz").read_bytes()))
    got = json.loads(succeeded(report(old, "--json", "--no-plots")).stdout)
    assert got == expected | {"run": expected["run"] | {"path": str(old)}}

    cut = tmp_path / "cut"
    shutil.copytree(full_dir, cut)
    log = cut / "events.jsonl.gz"
    log.write_bytes(log.read_bytes()[: log.stat().st_size // 2])
    proc = report(cut, "--no-plots")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "events.jsonl.gz" in proc.stderr and "Traceback" not in proc.stderr

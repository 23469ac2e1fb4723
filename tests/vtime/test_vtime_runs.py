"""The virtual timeline end to end: ``morphling run`` twice, once beside a CPU hog.

With modelled coordinator time the event log depends only on the script, its
seed and the fleet: the same run on a quiet and on a loaded host must give the
same log, bit for bit (its sha256 is in ``run.json``). Every run directory is
then reported on: summary, trace and plots, and ``morphling report`` reads it
again. The same deterministic run with each ``--events`` level: a compressed full
log, a ``steps`` log with the same per-step figures, no log at all; and a run
directory as older engines left it (uncompressed) is still read. A longer run at the
default level, ``auto``: tiles for its first steps, totals after, the same per-step
figures as ``full``; reports that show a window of steps (``--detail-steps`` moves it);
a run directory that grows little per step.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from processes import SCRIPTS, child_env, morphling_run, succeeded

from morphling.text import FIRST_ROWS, LAST_ROWS

FLEET = ("--embedded", "--devices", "rpi4:2,orin-nano:1,jetson-nano:1", "--block-size", "16",
         "--min-flops", "0", "--coordinator", "rpi4")  # fmt: skip
HOG = "import itertools\nfor _ in itertools.count(): pass\n"
OPT_STEPS = 6  # thousands of events: enough for a timeline the host's load could move


def run_training(run_dir: Path, state: Path) -> dict:
    succeeded(morphling_run(*FLEET, "--run-dir", run_dir, "--", "python",
                            SCRIPTS / "train_opt.py", state, OPT_STEPS))  # fmt: skip
    return json.loads((run_dir / "run.json").read_text())


@pytest.fixture(scope="module")
def quiet(tmp_path_factory) -> Path:
    """The run directory of the training on a quiet host."""
    tmp = tmp_path_factory.mktemp("quiet")
    run_training(tmp / "run", tmp / "state.pt")
    return tmp / "run"


def test_same_run_same_timeline_however_loaded_the_host(tmp_path, quiet):
    # one hog: beside the suite's other worker it loads this host; one per core slowed the
    # other worker's tests as much as this one
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], env=child_env())]
    try:
        loaded = run_training(tmp_path / "loaded", tmp_path / "loaded.pt")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    run = json.loads((quiet / "run.json").read_text())
    assert run["events"] > 1000 and run["events"] == loaded["events"]
    assert run["digest"] == loaded["digest"]
    quiet_log = (quiet / "events.jsonl.gz").read_bytes()
    assert quiet_log == (tmp_path / "loaded" / "events.jsonl.gz").read_bytes()


def test_run_directory_is_reported_and_report_reads_it_again(tmp_path, quiet):
    run_dir = quiet
    run = json.loads((run_dir / "run.json").read_text())
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

# SGD steps of a small MLP (as many as its argument says); tiles of 16 rows make each GEMM
# many tiles, as a large model's are.
MLP = """\
import sys
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(int(sys.argv[1])):
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
                                       "--", "python", script, MLP_STEPS))  # fmt: skip
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
        assert b.pop("devices") is None  # each device's time, as the segments: shown only
        del a["critical_path"]["segments"], a["devices"]
        assert a == b  # times, totals, critical paths and classes, each device's bytes, to the bit
        moved = b["device_bytes"].values()  # each device's share of the step's bytes
        assert [sum(d[k] for d in moved) for k in ("down", "up", "saved")] == [
            b["bytes_down"], b["bytes_up"], b["bytes_saved"]]  # fmt: skip
    mean = "mean_utilisation"  # of busy times, below
    assert steps["totals"].pop(mean) == pytest.approx(full["totals"].pop(mean), rel=1e-12)
    assert steps["totals"] == full["totals"]
    saved = sum(s["bytes_saved"] for s in full_steps)
    assert saved > 0 and sum(d["bytes_saved"] for d in steps["devices"]) == saved
    for a, b in zip(full["devices"], steps["devices"], strict=True):
        for key in ("tiles", "bytes_down", "bytes_up", "bytes_saved", "last_in", "final_temp_c",
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


# -- the shared bottleneck (--bottleneck-bw) ---------------------------------------------------

BOTTLENECK_BW = 1e5  # bytes/s each way: far below the rpi4s' own links, so it sets the pace


def test_a_bottleneck_bound_run_reports_its_bottleneck_busy(tmp_path):
    """Four devices share a FIFO that every transfer crosses, so slow that the steps are
    almost all downloads through it. The report's busy share of each direction is what
    the job was told it moved (each step's bytes, from the emulator's STEP replies, not
    from the log) over the bandwidth, over the run's span: the log holds the shared
    FIFO's spans, and the trace draws them. (Before, the log had none: 0.0% busy.)"""
    script = tmp_path / "mlp.py"
    script.write_text(MLP)
    run_dir = tmp_path / "run"
    fleet = ("--embedded", "--devices", "rpi4:4", "--block-size", "16", "--min-flops", "0",
             "--coordinator", "rpi4", "--bottleneck-bw", str(BOTTLENECK_BW))  # fmt: skip
    proc = succeeded(morphling_run(*fleet, "--run-dir", run_dir, "--json", tmp_path / "run.json",
                                   "--", "python", script, 3))  # fmt: skip
    steps = json.loads((tmp_path / "run.json").read_text())["steps"]
    down_s = sum(s["bytes_down"] for s in steps) / BOTTLENECK_BW
    up_s = sum(s["bytes_up"] for s in steps) / BOTTLENECK_BW
    summary = json.loads((run_dir / "summary.json").read_text())
    span_s = summary["totals"]["span_s"]
    assert span_s >= sum(s["emulated_s"] for s in steps)
    shared = summary["run"]["bottleneck"]
    assert shared["downlink_utilisation"] == pytest.approx(down_s / span_s, rel=1e-6)
    assert shared["uplink_utilisation"] == pytest.approx(up_s / span_s, rel=1e-6)
    assert shared["downlink_utilisation"] > 0.9, "the downloads set the pace"
    down, up = (f"{100 * shared[k]:.1f}%" for k in ("downlink_utilisation", "uplink_utilisation"))
    assert f"downlink {down}, uplink {up} busy" in proc.stderr
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    (nic,) = (e["pid"] for e in trace if e["args"].get("name") == "shared bottleneck")
    tiles = summary["totals"]["tiles"]
    assert sum(e["pid"] == nic and e.get("cat") == "upload" for e in trace) == tiles


# -- a longer run at the default level (auto) ---------------------------------------------------

DETAIL_STEPS, SHORT, LONG = 10, 30, 120  # tiles for each job's first 10 steps, then totals


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The MLP for LONG steps at the default level and at full, and for SHORT steps at the
    default level: run directory and stderr of each."""
    tmp = tmp_path_factory.mktemp("long")
    script = tmp / "mlp.py"
    script.write_text(MLP)
    runs = {}
    for name, steps, level in (("auto", LONG, ()), ("short", SHORT, ()),
                               ("full", LONG, ("--events", "full"))):  # fmt: skip
        flags = ("--run-dir", tmp / name, "--events-detail-steps", DETAIL_STEPS, *level)
        proc = succeeded(morphling_run(*FLEET, *flags, "--", "python", script, steps))
        runs[name] = (tmp / name, proc.stderr)
    return runs


def log_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in gzip.open(run_dir / "events.jsonl.gz", "rt")]


def step_rows(summary: dict) -> list[dict]:
    """Each step's row without its critical-path segments and devices' times (which cover
    a window)."""
    rows = [dict(s, critical_path=dict(s["critical_path"])) for s in summary["jobs"][0]["steps"]]
    for row in rows:
        del row["critical_path"]["segments"], row["devices"]
    return rows


def test_auto_logs_the_first_steps_tile_by_tile_then_totals(long_runs):
    """The default level keeps every tile of each job's first steps and each step's and
    device's totals after them; the report reads the mixed log, says so, and gives every
    step the figures a full log gives."""
    (auto_dir, stderr), (full_dir, _) = long_runs["auto"], long_runs["full"]
    run = meta(auto_dir)
    assert (run["event_log"], run["event_detail_steps"]) == ("auto", DETAIL_STEPS)
    steps_of: dict[str, set[int]] = {}
    for r in log_records(auto_dir):
        steps_of.setdefault(r["ev"], set()).add(r.get("step"))
    detailed, after = set(range(1, DETAIL_STEPS + 1)), set(range(DETAIL_STEPS + 1, LONG + 1))
    assert steps_of["tile"] == steps_of["gemm"] == steps_of["coord"] == detailed
    assert steps_of["device_step"] == after and steps_of["step"] == detailed | after
    assert f"the log has every tile of steps up to {DETAIL_STEPS} of each job" in stderr

    auto = json.loads(succeeded(report(auto_dir, "--json", "--no-plots")).stdout)
    full = json.loads(succeeded(report(full_dir, "--json", "--no-plots")).stdout)
    assert len(step_rows(auto)) == LONG and step_rows(auto) == step_rows(full)  # to the bit
    mean = "mean_utilisation"  # of busy times, below
    assert auto["totals"].pop(mean) == pytest.approx(full["totals"].pop(mean), rel=1e-12)
    assert auto["totals"] == full["totals"]
    for a, f in zip(auto["devices"], full["devices"], strict=True):
        for key in ("tiles", "bytes_down", "bytes_up", "last_in", "final_temp_c",
                    "top_freq_mhz", "below_top_s"):  # fmt: skip
            assert a[key] == f[key], key
        for key in ("busy_s", "utilisation", "downlink_utilisation", "uplink_utilisation"):
            assert a[key] == pytest.approx(f[key], rel=1e-12), key
    assert auto["run"]["detail"]["logged"] == f":{DETAIL_STEPS}"
    assert not auto["run"]["detail"]["every_step_logged"]
    assert full["run"]["detail"]["every_step_logged"]


def shown_steps(run_dir: Path) -> tuple[list[int], set[int]]:
    """The steps whose segments summary.json has, and those trace.json covers."""
    summary = json.loads((run_dir / "summary.json").read_text())
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    segments = [s["step"] for s in summary["jobs"][0]["steps"]
                if s["critical_path"]["segments"] is not None]  # fmt: skip
    traced = {e["args"]["step"] for e in trace if e.get("cat") in ("compute", "gemm")}
    traced |= {int(e["name"].split()[1]) for e in trace if e.get("cat") == "step"}
    return segments, traced


def test_reports_show_a_window_of_steps_and_detail_steps_moves_it(long_runs, tmp_path):
    """trace.json, timeline.png and the segments cover each job's first 50 steps (or those
    of them the log has tiles for); --detail-steps shows others the log has."""
    full_dir, auto_dir = tmp_path / "full", tmp_path / "auto"  # reported on again here
    shutil.copytree(long_runs["full"][0], full_dir)
    shutil.copytree(long_runs["auto"][0], auto_dir)
    first_50 = list(range(1, 51))
    assert shown_steps(full_dir) == (first_50, set(first_50))
    detail = json.loads((full_dir / "summary.json").read_text())["run"]["detail"]
    assert detail["shown"] == [{"job": 1, "first": 1, "last": 50, "steps": 50}]
    assert shown_steps(auto_dir) == (list(range(1, DETAIL_STEPS + 1)), set(range(1, 51)))

    proc = succeeded(report(full_dir, "--detail-steps", "100:120"))
    assert f"show job 1 steps 100-120 of {LONG} steps (--detail-steps 100:120)" in proc.stdout
    assert shown_steps(full_dir) == (list(range(100, 121)), set(range(100, 121)))
    assert (full_dir / "timeline.png").stat().st_size > 0
    succeeded(report(auto_dir, "--detail-steps", "all", "--no-plots"))
    assert shown_steps(auto_dir)[0] == list(range(1, DETAIL_STEPS + 1))

    # steps the log has no tiles for: said in one line, a usage error
    refused = report(auto_dir, "--detail-steps", "100:120")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"tiles of steps up to {DETAIL_STEPS}" in refused.stderr
    bad = report(auto_dir, "--detail-steps", "20:10")
    assert bad.returncode == 2 and "ends before it starts" in bad.stderr


def test_run_directory_grows_little_per_step(long_runs):
    """At the default level, a run four times longer takes far less than four times the
    disk: the log, the trace and the plots are bounded; the summary's rows grow."""
    (short_dir, _), (long_dir, _) = long_runs["short"], long_runs["auto"]

    def size(run_dir: Path, name: str = "*") -> int:
        return sum(p.stat().st_size for p in run_dir.glob(name))

    per_step = {n: size(d) / steps for n, d, steps in (("short", short_dir, SHORT),
                                                       ("long", long_dir, LONG))}  # fmt: skip
    assert per_step["long"] < per_step["short"] / 2, per_step
    # each step after the first ones adds a fraction of what each of those took in the log
    log_short, log_long = size(short_dir, "events.jsonl.gz"), size(long_dir, "events.jsonl.gz")
    assert (log_long - log_short) / (LONG - SHORT) < log_short / SHORT / 4, (log_short, log_long)


def test_a_long_runs_tables_show_its_first_and_last_steps(long_runs):
    """Every step's row on stderr made a 60,000-step run's table 60,000 lines: the job's
    table and the report's show the first and last steps and say how many lie between;
    --json and summary.json keep them all."""
    _, stderr = long_runs["auto"]
    left_out = LONG - FIRST_ROWS - LAST_ROWS
    assert f"... {left_out} more rows (--json has every step) ..." in stderr  # the job's
    assert f"... {left_out} more rows (summary.json or --json has every step) ..." in stderr
    job_rows = [line.split()[0] for line in stderr.splitlines()
                if re.fullmatch(r"\s*\d+ +\d+\.\d{4} .*", line)]  # fmt: skip
    shown = [*range(1, FIRST_ROWS + 1), *range(LONG - LAST_ROWS + 1, LONG + 1)]
    assert [int(step) for step in job_rows] == shown

"""Reports split each step by op class, end to end: a job drives the real emulator (its
devices virtual, in this process) with GEMMs, a convolution and step marks whose host time
it splits by op class (``host_split``), or not; ``morphling report`` reads the run
directory the emulator left. Old logs, with no split anywhere, say why their coordinator
time has no class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hand_run import run_events, write_run
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.client import Client
from morphling.proxy.job.embedded import EmbeddedFleet
from morphling.proxy.report.analysis import MEASURED, UNSPLIT, summarize
from morphling.proxy.report.load import load_run
from morphling.proxy.report.text import format_summary
from processes import child_env

MS = 1_000_000  # ns
GEOMETRY = {"stride": (1, 1), "padding": (1, 1, 1, 1), "dilation": (1, 1), "groups": 1}


def report(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "morphling", "report", str(run_dir)],
        capture_output=True, text=True, env=child_env(), timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def classified(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, str]:
    """A two-step job on two virtual rpi4: step 1 a GEMM, a convolution 3 ms after it
    (2 ms elementwise, 1 ms a convolution kept on the host) and a mark 5 ms after that
    (4 ms optimizer, 1 ms a GEMM kept on the host); step 2 a GEMM and a mark whose host
    time (2 + 1 ms) is not split. Its run directory, the STEP replies and the report's
    stdout."""
    run_dir = tmp_path_factory.mktemp("classes") / "run"
    config = EmulatorConfig(probe=False, run_dir=str(run_dir), events="full")
    fleet = EmbeddedFleet("rpi4:2", config, run_info={"coordinator_time": "model"})
    host, port = fleet.start()
    rng = np.random.default_rng(21)
    a = rng.standard_normal((96, 96), dtype=np.float32)
    x = rng.standard_normal((2, 4, 10, 10), dtype=np.float32)
    w = rng.standard_normal((6, 4, 3, 3), dtype=np.float32)
    try:
        with Client(host, port, name="classes", block=32, timeout=60) as client:
            client.matmul(a, a, host_ns=0)
            client.conv("forward", x, w, input_shape=x.shape, weight_shape=w.shape, **GEOMETRY,
                        host_ns=3 * MS, host_split={"elementwise": 2 * MS, "conv": MS})  # fmt: skip
            replies = [client.step(1, host_ns=5 * MS, host_split={"optimizer": 4 * MS, "gemm": MS})]
            client.matmul(a, a, host_ns=2 * MS)
            replies.append(client.step(2, host_ns=MS, local_gemms=3))
    finally:
        fleet.stop()
    proc = report(run_dir)
    assert proc.returncode == 0, proc.stderr
    return run_dir, replies, proc.stdout


def test_the_step_reply_carries_the_coordinators_split(classified):
    _, (one, two), _ = classified
    assert one.coord_ns == 8 * MS
    assert one.coord_split == {"elementwise": 2 * MS, "conv": MS, "optimizer": 4 * MS, "gemm": MS}
    assert (two.coord_ns, two.coord_split) == (3 * MS, {})  # not split: nothing to say


def test_each_step_is_split_by_op_class(classified):
    run_dir, _, _ = classified
    summary = json.loads((run_dir / "summary.json").read_text())
    s1, s2 = summary["jobs"][0]["steps"]
    one, two = s1["critical_path"]["by_class"], s2["critical_path"]["by_class"]
    assert one["coordinator_gemm_s"] == pytest.approx(0.001, rel=1e-9)
    assert one["coordinator_conv_s"] == pytest.approx(0.001, rel=1e-9)
    assert one["coordinator_other_s"] == pytest.approx(0.006, rel=1e-9)  # elementwise, optimizer
    assert one["coordinator_unclassified_s"] == 0.0
    assert one["fleet_gemm_s"] > 0 and one["fleet_conv_s"] > 0
    assert one["fleet_gemm_s"] + one["fleet_conv_s"] == pytest.approx(s1["gemm_s"], rel=1e-12)
    assert sum(one.values()) == pytest.approx(s1["emulated_s"], rel=1e-12)
    ops = s1["critical_path"]["ops"]
    assert ops["fleet"].keys() == {"gemm", "conv_forward"}
    assert ops["coordinator"] == pytest.approx(
        {"elementwise": 0.002, "conv": 0.001, "optimizer": 0.004, "gemm": 0.001}, rel=1e-9
    )
    # step 2: its GEMM, and 3 ms of host time the job did not split
    assert two["fleet_conv_s"] == two["coordinator_other_s"] == 0.0
    assert two["coordinator_unclassified_s"] == pytest.approx(0.003, rel=1e-9)
    untimed = summary["untimed"]
    assert untimed["coordinator_unclassified_s"] == pytest.approx(0.003, rel=1e-9)
    assert (untimed["steps"], untimed["reason"], untimed["local_gemms"]) == (1, UNSPLIT, 3)
    totals = summary["totals"]["by_class"]
    assert totals["coordinator_other_s"] == pytest.approx(0.006, rel=1e-9)


def test_the_critical_path_names_each_products_op_and_the_hosts_classes(classified):
    run_dir, _, _ = classified
    summary = json.loads((run_dir / "summary.json").read_text())
    s1 = summary["jobs"][0]["steps"][0]
    path = [(p["kind"], p.get("op")) for p in s1["critical_path"]["segments"]]
    assert path == [("gemm", "gemm"), ("coordinator", None), ("conv", "conv_forward"),
                    ("coordinator", None)]  # fmt: skip
    coords = [p for p in s1["critical_path"]["segments"] if p["kind"] == "coordinator"]
    assert coords[0]["ops"] == pytest.approx({"elementwise": 0.002, "conv": 0.001}, rel=1e-9)
    assert coords[1]["ops"] == pytest.approx({"optimizer": 0.004, "gemm": 0.001}, rel=1e-9)
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    products = {e["name"].split()[0] for e in trace if e.get("cat") == "gemm"}
    assert products == {"gemm", "conv_forward"}
    spans = [e["args"].get("ops") for e in trace if e.get("cat") == "coordinator"]
    assert spans[:2] == [coords[0]["ops"], coords[1]["ops"]] and spans[2:] == [None, None]


def test_each_devices_time_by_what_it_did(classified):
    run_dir, _, _ = classified
    summary = json.loads((run_dir / "summary.json").read_text())
    span = summary["totals"]["span_s"]
    for d in summary["devices"]:
        t = d["time"]
        assert t["gemm_s"] + t["conv_s"] == pytest.approx(d["busy_s"], rel=1e-12)
        assert t["link_s"] > 0 and t["waiting_s"] >= 0
        assert t["waiting_s"] == pytest.approx(
            max(0.0, span - t["gemm_s"] - t["conv_s"] - t["link_s"]), rel=1e-9, abs=1e-12
        )
    assert sum(d["time"]["conv_s"] for d in summary["devices"]) > 0
    s1, s2 = summary["jobs"][0]["steps"]
    assert sum(t["conv_s"] for t in s1["devices"].values()) > 0
    assert sum(t["conv_s"] for t in s2["devices"].values()) == 0
    for step in (s1, s2):
        fleet = step["device_time"]  # the devices' summed: device-seconds
        for key, seconds in fleet.items():
            assert seconds == pytest.approx(sum(t[key] for t in step["devices"].values()))
        for t in step["devices"].values():
            total = t["gemm_s"] + t["conv_s"] + t["link_s"] + t["waiting_s"]
            assert total >= step["emulated_s"] * (1 - 1e-9)
    assert (run_dir / "device_time.png").stat().st_size > 5000


def test_the_text_shows_the_classes_and_what_is_unclassified(classified):
    _, _, text = classified
    assert "time by op class (s):" in text
    assert "fleet ops (s): gemm " in text and "conv_forward" in text
    assert "coordinator ops (s): elementwise 0.0020, conv 0.0010, optimizer 0.0040" in text
    assert "their time over the run" in text
    assert (
        f"untimed work: 0.0030 s of coordinator time in 1 step is unclassified ({UNSPLIT})" in text
    )
    assert "3 GEMMs kept on the host" in text


def test_an_old_log_without_splits_says_its_coordinator_time_is_unclassified(tmp_path):
    """A log written before op classes (no split, no op): every product a GEMM, the
    coordinator's time unclassified, and why; a measured run says it was measured."""
    for coordinator, why in (("model", UNSPLIT), ("measured", MEASURED)):
        run = load_run(
            write_run(tmp_path / coordinator, run_events(), coordinator_time=coordinator)
        )
        summary = summarize(run)
        s0, s1 = summary["jobs"][0]["steps"]
        for step in (s0, s1):
            by_class = step["critical_path"]["by_class"]
            assert by_class["fleet_gemm_s"] == step["gemm_s"] and by_class["fleet_conv_s"] == 0
            assert by_class["coordinator_unclassified_s"] == step["coordinator_s"]
        untimed = summary["untimed"]
        assert (untimed["reason"], untimed["steps"]) == (why, 2)
        assert untimed["coordinator_unclassified_s"] == summary["totals"]["coordinator_s"]
        text = format_summary(summary)
        assert f"is unclassified ({why})" in text
        assert "time by op class" not in text  # nothing it would add to the steps table

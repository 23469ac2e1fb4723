"""Run reports over ``hand_run``'s hand-computed schedule: a run directory written as the
engine would, whose expected figures below, worked out by hand in the comments, are
compared exactly (``hand_run`` has the schedule).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from hand_run import BW, FLEET, JOB, T, run_events, schedule_events, write_run
from morphling.proxy.report.analysis import BREAKDOWN, summarize
from morphling.proxy.report.files import write_reports
from morphling.proxy.report.load import StepRange, load_run
from morphling.proxy.report.records import RunError
from morphling.proxy.report.text import format_summary
from morphling.proxy.report.trace import chrome_trace

from morphling.cli import command_parser, run_command
from morphling.commands import report as report_cli


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", run_events())


@pytest.fixture
def summary(run_dir: Path) -> dict[str, Any]:
    return summarize(load_run(run_dir))


# -- the numbers -----------------------------------------------------------------------------


def test_steps(summary: dict[str, Any]) -> None:
    (job,) = summary["jobs"]
    s0, s1 = job["steps"]
    # step 0: [0, 6]; coordinator 0.5 + 0.25 + 0.5; GEMMs (2.25 - 0.5) + (5.5 - 2.5)
    assert (s0["t0"], s0["t1"], s0["emulated_s"]) == (0.0, 6.0, 6.0)
    assert (s0["coordinator_s"], s0["gemm_s"]) == (1.25, 4.75)
    # step 1: [6, 9]; coordinator 0.25 + 0.25; GEMM 8.75 - 6.25
    assert (s1["t0"], s1["t1"], s1["emulated_s"]) == (6.0, 9.0, 3.0)
    assert (s1["coordinator_s"], s1["gemm_s"]) == (0.5, 2.5)
    assert [(s["gemms"], s["local_gemms"], s["tiles"], s["oom"]) for s in (s0, s1)] == [
        (2, 1, 7, 0),
        (1, 1, 3, 1),
    ]
    # step 0 moves 4 × 0.25 + 0.5 + 0.25 (+ 0, resident) s down, 4 × 0.25 + 1.25 + 2 × 0.25 up
    assert (s0["bytes_down"], s0["bytes_up"]) == (1.75 * BW, 2.75 * BW)
    assert (s1["bytes_down"], s1["bytes_up"]) == (0.75 * BW, 0.75 * BW)
    # each device's: a-0 0.25 + 0.25 + 0 s down, 3 × 0.25 up; b-1 0.25 + 0.5 + 0.25 down,
    # 0.25 + 1.25 + 0.25 up; c-2 0.25 each way; step 1 0.25 each way each
    moved = {name: (b["down"] / BW, b["up"] / BW, b["saved"])
             for name, b in s0["device_bytes"].items()}  # fmt: skip
    assert moved == {"a-0": (0.5, 0.75, 0), "b-1": (1.0, 1.75, 0), "c-2": (0.25, 0.25, 0)}
    quarter = {"down": BW / 4, "up": BW / 4, "saved": 0}
    assert s1["device_bytes"] == {name: quarter for name in ("a-0", "b-1", "c-2")}
    assert s0["complete"] and s1["complete"]
    totals = summary["totals"]
    assert (totals["span_s"], totals["emulated_s"], totals["steps"], totals["tiles"]) == (
        9.0, 9.0, 2, 10,
    )  # fmt: skip
    assert (totals["gemms"], totals["oom"], totals["bytes_down"]) == (3, 1, 2.5 * BW)


def test_devices(summary: dict[str, Any]) -> None:
    a, b, c = summary["devices"]
    # compute: a-0 4 × 0.5; b-1 1.25 + 1 + 1 + 2; c-2 2 × 0.5 — over a 9 s run
    assert [d["busy_s"] for d in (a, b, c)] == [2.0, 5.25, 1.0]
    assert [d["utilisation"] for d in (a, b, c)] == [2.0 / 9, 5.25 / 9, 1.0 / 9]
    # downlinks: a-0 3 × 0.25 (+ a resident tile, no time); b-1 0.25 + 0.5 + 0.25 + 0.25
    assert [d["downlink_utilisation"] for d in (a, b, c)] == [0.75 / 9, 1.25 / 9, 0.5 / 9]
    assert [d["uplink_utilisation"] for d in (a, b, c)] == [1.0 / 9, 2.0 / 9, 0.5 / 9]
    assert [d["tiles"] for d in (a, b, c)] == [4, 4, 2]
    assert b["bytes_up"] == 2.0 * BW
    # b-1 runs at 1500 MHz until the throttle at 6.0 s, then 1000 MHz to the end (9 s);
    # its last sample is the tile computed from 6.5 s, at 82 °C
    assert (b["top_freq_mhz"], b["below_top_s"], b["final_temp_c"]) == (1500.0, 3.0, 82.0)
    assert (a["top_freq_mhz"], a["below_top_s"], a["final_temp_c"]) == (None, None, None)


def test_straggler(summary: dict[str, Any]) -> None:
    a, b, c = summary["devices"]
    # Results back per GEMM (a-0, b-1, c-2): gemm 0 (2, 2.25, 1.5), median 2, lasts 1.75 s;
    # gemm 1 (3.25, 5.5, -), median 4.375, 3 s; gemm 2 (7.25, 8.75, 7.25), median 7.25, 2.5 s
    assert b["lateness"] == pytest.approx(
        statistics.fmean([0.25 / 1.75, 1.125 / 3.0, 1.5 / 2.5]), rel=1e-15
    )
    assert a["lateness"] == pytest.approx(statistics.fmean([0.0, -1.125 / 3.0, 0.0]), rel=1e-15)
    assert c["lateness"] == pytest.approx(statistics.fmean([-0.5 / 1.75, 0.0]), rel=1e-15)
    assert (b["last_in"], b["gemms"]) == (3, 3)
    assert b["expected_last"] == pytest.approx(1 / 3 + 1 / 2 + 1 / 3, rel=1e-15)
    assert [s["name"] for s in summary["stragglers"]["devices"]] == ["b-1"]


def test_critical_path_sums_to_the_step(summary: dict[str, Any]) -> None:
    s0, s1 = summary["jobs"][0]["steps"]
    path = s0["critical_path"]
    # gemm 0's last tile (b-1 t1): no queueing, 0.25 down, 1.25 compute, 0.25 up.
    # gemm 1's (b-1 t1): waits 0.5 for t0's download, 0.25 down, waits 0.75 for t0's
    # compute, 1.0 compute, waits 0.25 for t0's 1.25 s upload, 0.25 up.
    assert path["breakdown"] == {
        "coordinator_s": 1.25, "link_queue_s": 0.5, "download_s": 0.5,
        "compute_queue_s": 0.75, "compute_s": 2.25, "upload_queue_s": 0.25, "upload_s": 0.5,
        "unattributed_s": 0.0,
    }  # fmt: skip
    for step in (s0, s1):
        assert sum(step["critical_path"]["breakdown"].values()) == step["emulated_s"]
        assert list(step["critical_path"]["breakdown"]) == list(BREAKDOWN)
    assert [(p["kind"], p.get("device_name")) for p in path["segments"]] == [
        ("coordinator", None), ("gemm", "b-1"), ("coordinator", None), ("gemm", "b-1"),
        ("coordinator", None),
    ]  # fmt: skip
    assert path["devices"] == {"b-1": 2}


def test_a_complete_steps_rounding_residue_is_not_unattributed_time(tmp_path: Path) -> None:
    """0.3 s stages do not sum exactly in binary: the step's time less its parts is a
    residue of -2e-16 s, which the text printed as "unattributed -0.0000 s -0.0%"."""
    events = schedule_events([[0.3, [T(0, 0.3, 0.3, 0.3)], 0.3]])
    summary = summarize(load_run(write_run(tmp_path, events)))
    (step,) = summary["jobs"][0]["steps"]
    assert step["critical_path"]["breakdown"]["unattributed_s"] == 0.0
    assert "-0.0" not in format_summary(summary)


def test_oom(summary: dict[str, Any]) -> None:
    assert summary["ooms"]["count"] == 1
    (oom,) = summary["ooms"]["events"]
    assert (oom["device_name"], oom["gemm"], oom["tile"], oom["t"]) == ("c-2", 2, 1, 6.25)
    assert (oom["need_bytes"], oom["capacity_bytes"]) == (3 * 2**30, 2**30)


def test_shared_bottleneck(tmp_path: Path) -> None:
    events = run_events()
    for e in events:
        if e["ev"] == "tile":  # every transfer also crosses the shared FIFO, at the same time
            e["nic_down"], e["nic_up"] = e["down"], e["up"]
    run = load_run(write_run(tmp_path, events, bottleneck={"bw": BW, "lat_s": 0.001}))
    summary = summarize(run)
    bottleneck = summary["run"]["bottleneck"]
    # downloads cover [0.5, 1], [2.5, 3.25], [6.25, 6.5]; uploads [1.25, 1.5], [1.75, 2.25],
    # [3, 3.25], [4, 5.5], [7, 7.25], [8.5, 8.75]
    assert bottleneck["parameters"] == {"bw": BW, "lat_s": 0.001}
    assert bottleneck["downlink_utilisation"] == 1.5 / 9
    assert bottleneck["uplink_utilisation"] == 3.0 / 9
    assert "shared bottleneck (bw 4096, lat_s 0.001): downlink 16.7%, uplink 33.3% busy" in (
        format_summary(summary)
    )
    events = chrome_trace(run)["traceEvents"]
    (nic,) = [e["pid"] for e in events if e.get("args", {}).get("name") == "shared bottleneck"]
    assert len([e for e in events if e["pid"] == nic and e["ph"] == "X"]) == 19


def test_ideal_link_has_infinite_bandwidth(tmp_path: Path) -> None:
    fleet = [{**d, "dl_bw": float("inf"), "ul_bw": float("inf")} for d in FLEET]
    run = load_run(write_run(tmp_path, run_events(), fleet=fleet))  # written as Infinity
    assert run.fleet[0].dl_bw == float("inf")


def test_summary_is_json(summary: dict[str, Any]) -> None:
    assert json.loads(json.dumps(summary, allow_nan=False)) == summary


def test_step_without_its_step_event_is_incomplete(tmp_path: Path) -> None:
    events = [e for e in run_events() if not (e["ev"] == "step" and e["step"] == 1)]
    for e in events:  # one of its tiles held 256 bytes of its operands
        if e["ev"] == "tile" and (e["step"], e["device"]) == (1, 0):
            e["bytes_saved"] = 256
    summary = summarize(load_run(write_run(tmp_path, events)))
    s1 = summary["jobs"][0]["steps"][1]
    # from its first coordinator span to its last
    assert (s1["complete"], s1["t0"], s1["t1"], s1["local_gemms"]) == (False, 6.0, 9.0, 0)
    assert s1["bytes_saved"] == s1["device_bytes"]["a-0"]["saved"] == 256  # from its tiles
    assert "(incomplete)" in format_summary(summary)


def test_format_summary(summary: dict[str, Any]) -> None:
    text = format_summary(summary)
    assert "critical path of the slowest step (job 1 step 0, 6.0000 s)" in text
    assert "  b-1: " in text.split("stragglers")[1]  # the straggler is named
    assert "OOM events: 1" in text
    assert "gemm 2 tile 1 on c-2 at 6.2500 s: needs 3.0 GiB of 1.0 GiB" in text
    devices = text.split("devices by compute utilisation")[1].splitlines()[2:5]
    assert [line.split()[1] for line in devices] == ["b-1", "a-0", "c-2"]  # busiest first


# -- the trace and the plots -----------------------------------------------------------------


def test_chrome_trace(run_dir: Path) -> None:
    trace = chrome_trace(load_run(run_dir))
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert {"pid", "tid", "ts", "dur", "name"} <= e.keys(), e
        assert e["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == [
        "device 0: a-0 (fast)", "device 1: b-1 (slow)", "device 2: c-2 (fast)", "job 1: train.py",
    ]  # fmt: skip
    pid = {name.split(":")[1].split()[0]: p for p, name in names.items()}
    # gemm 0 tile 1 computes on b-1 from 0.75 s to 2.0 s: in µs
    (compute,) = [e for e in complete if e["pid"] == pid["b-1"] and e["name"] == "gemm 0 tile 1"
                  and e["cat"] == "compute"]  # fmt: skip
    assert (compute["ts"], compute["dur"]) == (750_000.0, 1_250_000.0)
    # 10 tiles: 10 computes, 10 uploads, 9 downloads (a resident one moves nothing);
    # 2 steps, 3 GEMMs, 5 coordinator spans on the job
    cats = [e["cat"] for e in complete]
    assert [cats.count(c) for c in ("compute", "upload", "download")] == [10, 10, 9]
    assert [cats.count(c) for c in ("step", "gemm", "coordinator")] == [2, 3, 5]
    assert {e["pid"] for e in complete if e["cat"] in ("step", "gemm")} == {pid["train.py"]}
    counters = [e for e in events if e["ph"] == "C"]
    # b-1: the freq event and 4 tiles, each with a temperature and a frequency
    assert {e["pid"] for e in counters} == {pid["b-1"]}
    assert len(counters) == 10
    (oom,) = [e for e in events if e["ph"] == "i"]
    assert (oom["pid"], oom["ts"]) == (pid["c-2"], 6_250_000.0)


def test_write_reports(run_dir: Path) -> None:
    paths = write_reports(run_dir)
    names = sorted(p.name for p in paths)
    assert names == ["device_time.png", "steps.png", "summary.json", "thermal.png", "timeline.png",
                     "trace.json", "utilisation.png"]  # fmt: skip
    for p in paths:
        assert p.parent == run_dir
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000, p
    run = load_run(run_dir)
    assert json.loads((run_dir / "trace.json").read_text()) == chrome_trace(run)
    assert json.loads((run_dir / "summary.json").read_text()) == summarize(run)


def test_no_thermal_plot_without_a_thermal_model(tmp_path: Path) -> None:
    events = [e for e in run_events() if e["ev"] != "freq"]
    for e in events:
        if e["ev"] == "tile":
            e["freq_mhz"] = e["temp_c"] = None
    paths = write_reports(write_run(tmp_path, events))
    assert "thermal.png" not in {p.name for p in paths}
    assert not (tmp_path / "thermal.png").exists()


# -- bad input -------------------------------------------------------------------------------


def line_of(events: list[dict[str, Any]], match: dict[str, Any]) -> int:
    """The 1-based line of the first event with all of ``match``'s items."""
    return 1 + next(i for i, e in enumerate(events) if match.items() <= e.items())


def _garble(events: list[dict[str, Any]], match: dict[str, Any], **changes: Any) -> None:
    events[line_of(events, match) - 1].update(changes)


@pytest.mark.parametrize(
    ("match", "changes", "message"),
    [
        ({"ev": "tile", "gemm": 1, "tile": 2}, {"device": 7}, "device 7 is not in run.json"),
        ({"ev": "gemm", "gemm": 1}, {"job": 2}, "job 2 is not in run.json"),
        ({"ev": "tile", "gemm": 0, "tile": 0}, {"compute": [0.6, 1.25]}, "out of order"),
        ({"ev": "tile", "gemm": 0, "tile": 0}, {"up": [2.0, 1.0]}, "'up' ends before it starts"),
        ({"ev": "tile", "gemm": 0, "tile": 0}, {"bytes_up": -1}, "'bytes_up' must be an integer"),
        ({"ev": "step", "step": 1}, {"t0": "soon"}, "'t0' must be a finite number"),
        ({"ev": "gemm", "gemm": 0}, {"last_tile": 9}, "last_tile 9 is not logged"),
        ({"ev": "gemm", "gemm": 0}, {"end": 2.0}, "disagrees with its last tile"),
        ({"ev": "gemm", "gemm": 1}, {"issue": 2.0}, "overlaps"),
        ({"ev": "coord", "t0": 8.75}, {"step": 0}, "outside step 0"),
        ({"ev": "tile", "gemm": 0, "tile": 0}, {"tile": 1}, "repeats the tile of line"),
    ],
)
def test_inconsistent_log_names_the_line(
    tmp_path: Path, match: dict[str, Any], changes: dict[str, Any], message: str
) -> None:
    events = run_events()
    line = line_of(events, match)
    _garble(events, match, **changes)
    with pytest.raises(RunError, match=f"line {line}: .*{message}"):
        load_run(write_run(tmp_path, events))


def test_missing_field(tmp_path: Path) -> None:
    events = run_events()
    line = line_of(events, {"ev": "oom"})
    del events[line - 1]["need_bytes"]
    with pytest.raises(RunError, match=f"line {line}: oom event: missing field 'need_bytes'"):
        load_run(write_run(tmp_path, events))


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"version": 2}, "'version' is 2"),
        ({"format": "morphling-ckpt"}, "'format' is 'morphling-ckpt', not 'morphling-run'"),
        ({"fleet": []}, "'fleet' must be a non-empty list"),
        ({"fleet": [{**FLEET[0], "flops": "fast"}]}, "'flops' must be a finite number"),
        ({"bottleneck": {"bw": "fast"}}, "'bottleneck.bw' must be a finite number"),
        ({"command": "python train.py"}, "'command' must be a list of strings"),
        ({"block": None}, "'block' must be an integer"),
        # 10 tiles, 3 GEMMs, 5 coordinator spans, 2 steps, a freq, an OOM, a newer kind
        ({"events": 3}, "has 23 lines but run.json says 3: the log is incomplete"),
        ({"digest": "0" * 64}, "does not match run.json's digest"),
        ({"event_log": "some"}, "'event_log' must be one of"),
        ({"event_file": "../elsewhere.jsonl"}, "'event_file' must be 'events.jsonl' or"),
        ({"event_file": "events.jsonl.gz"}, "it has no events.jsonl.gz"),
        ({"incomplete": True}, "'incomplete' must be null or a string"),
    ],
)
def test_bad_run_json(tmp_path: Path, meta: dict[str, Any], message: str) -> None:
    with pytest.raises(RunError, match=message):
        load_run(write_run(tmp_path, run_events(), **meta))


def test_log_matches_run_json(tmp_path: Path) -> None:
    """The engine's line count and sha256 of the log, when given, are checked."""
    run_dir = write_run(tmp_path, run_events())
    digest = hashlib.sha256((run_dir / "events.jsonl").read_bytes()).hexdigest()
    load_run(write_run(tmp_path, run_events(), events=23, digest=digest))


def test_compressed_log_matches_run_json(tmp_path: Path) -> None:
    """A compressed log is read as the lines it holds; run.json's sha256 is theirs."""
    text = "".join(json.dumps(e) + "\n" for e in run_events()).encode()
    digest = hashlib.sha256(text).hexdigest()
    run_dir = write_run(tmp_path, [], event_file="events.jsonl.gz", events=23, digest=digest)
    (run_dir / "events.jsonl.gz").write_bytes(gzip.compress(text))
    assert len(load_run(run_dir).tiles) == 10
    (run_dir / "events.jsonl.gz").write_bytes(gzip.compress(text.replace(b"512", b"513")))
    with pytest.raises(RunError, match=r"does not match run\.json's digest"):
        load_run(run_dir)


STEP_TOTALS = {"tiles": 0, "coord_s": 0.0, "gemm_s": 0.0, "bytes_down": 0, "bytes_up": 0,
               **dict.fromkeys(BREAKDOWN[1:-1], 0.0)}  # fmt: skip


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"ev": "step", "job": JOB, "step": 0, "t0": 0.0, "t1": 1.0, "gemms": 0,
           "local_gemms": 0}],
         r"line 1: step event: a step whose tiles the log does not keep needs its totals: "
         r"missing \['tiles'"),
        ([{"ev": "step", "job": JOB, "step": 0, "t0": 0.0, "t1": 1.0, "gemms": 0,
           "local_gemms": 0, **STEP_TOTALS},
          {"ev": "device_step", "job": JOB, "step": 1, "device": 0, "tiles": 1, "bytes_down": 1,
           "bytes_up": 1, "down_s": 0.0, "compute_s": 0.0, "up_s": 0.0, "last_in": 0, "t": 0.5,
           "freq_mhz": None, "temp_c": None}],
         "line 2: device_step of job 1 step 1, which is not logged"),
    ],
)  # fmt: skip
def test_steps_log_is_checked(tmp_path: Path, events: list[dict[str, Any]], message: str) -> None:
    """A steps log's step records stand for its tiles, GEMMs and coordinator spans: they
    must have the totals, and each device's totals belong to a logged step."""
    with pytest.raises(RunError, match=message):
        load_run(write_run(tmp_path, events, event_log="steps"))


def renumbered(events: list[dict[str, Any]], by: int) -> list[dict[str, Any]]:
    """The events with their steps numbered ``by`` more (the engine's start at 1)."""
    return [{**e, "step": e["step"] + by} if "step" in e else e for e in events]


DEVICE_STEP = {"ev": "device_step", "job": JOB, "step": 0, "device": 0, "tiles": 1,
               "bytes_down": 1, "bytes_up": 1, "down_s": 0.0, "compute_s": 0.0, "up_s": 0.0,
               "last_in": 0, "t": 0.5, "freq_mhz": None, "temp_c": None}  # fmt: skip


@pytest.mark.parametrize(
    ("events", "meta", "message"),
    [
        # a steps log keeps no step's tiles: the first one met (the log is reversed) is wrong
        (run_events(), {"event_log": "steps"},
         r"line 2: step event: a step whose tiles the log does not keep needs its totals"),
        ([e for e in run_events() if e["ev"] != "step"], {"event_log": "steps"},
         r"line 2: coord of job 1 step 1, but a log at level steps keeps tiles, GEMMs and "
         r"coordinator spans for no step"),
        # auto keeps the tiles of each job's first steps (here 1), the totals of the others
        (renumbered(run_events(), 1), {"event_log": "auto", "event_detail_steps": 1},
         r"line 2: step event: a step whose tiles the log does not keep needs its totals"),
        ([*run_events(), DEVICE_STEP], {}, "line 24: device_step of job 1 step 0, whose tiles "
         "the log keeps"),
        (run_events(), {"event_log": "auto"}, "'event_detail_steps' must be an integer >= 0"),
        (run_events(), {"event_log": "auto", "event_detail_steps": 0},
         "'event_detail_steps' must be >= 1"),
    ],
)  # fmt: skip
def test_each_step_keeps_tiles_or_totals_as_the_level_says(
    tmp_path: Path, events: list[dict[str, Any]], meta: dict[str, Any], message: str
) -> None:
    with pytest.raises(RunError, match=message):
        load_run(write_run(tmp_path, events, **meta))


def test_auto_log_of_a_short_run_is_read_as_full(tmp_path: Path) -> None:
    """A run shorter than its ``event_detail_steps`` has every tile: its report is a full
    log's (the hand-made schedule numbers its steps from 0, the engine from 1)."""
    events = renumbered(run_events(), 1)
    full = summarize(load_run(write_run(tmp_path / "full", events)))
    auto = summarize(load_run(write_run(tmp_path / "auto", events, event_log="auto",
                                        event_detail_steps=2)))  # fmt: skip
    assert auto["run"]["detail"] == full["run"]["detail"] | {"logged": ":2"}
    assert auto["run"]["detail"]["every_step_logged"]
    assert auto | {"run": full["run"]} == full


def test_a_window_keeps_the_records_of_its_steps_only(run_dir: Path) -> None:
    """Loaded for step 1 only: its records are kept (for the trace, the timeline, the
    segments); step 0's are reduced as they are read, to the same figures."""
    whole = summarize(load_run(run_dir))
    run = load_run(run_dir, StepRange(1, 1))
    assert {(t.step, t.gemm) for t in run.tiles} == {(1, 2)} and len(run.tiles) == 3
    assert [g.gemm for g in run.gemms] == [2] and {c.step for c in run.coords} == {1}
    part = summarize(run)
    s0, s1 = part["jobs"][0]["steps"]
    w0, w1 = whole["jobs"][0]["steps"]
    assert s0["critical_path"].pop("segments") is None and s1 == w1
    assert s0.pop("devices") is None  # each device's time in it, as the segments: shown only
    del w0["critical_path"]["segments"], w0["devices"]
    assert s0 == w0
    for key in ("totals", "devices", "stragglers", "ooms"):
        assert part[key] == whole[key], key
    assert part["run"]["detail"]["shown"] == [{"job": JOB, "first": 1, "last": 1, "steps": 1}]
    assert "show job 1 step 1 of 2 steps (--detail-steps 1)" in format_summary(part)
    events = chrome_trace(run)["traceEvents"]
    assert [e["name"] for e in events if e.get("cat") == "step"] == ["step 1"]
    assert len([e for e in events if e.get("cat") == "compute"]) == 3
    # the thermal counters of step 1's time, [6, 9]: the freq event and b-1's tile
    assert (
        sorted(e["ts"] for e in events if e["ph"] == "C") == [6_000_000.0] * 2 + [6_500_000.0] * 2
    )


def test_an_empty_gemm_is_read(tmp_path: Path) -> None:
    """A GEMM with no output has no tiles and no last tile (null): it takes no time and is
    not a GEMM on the fleet, but the log holds it."""
    empty = {"ev": "gemm", "job": JOB, "gemm": 3, "step": 1, "issue": 9.0, "end": 9.0,
             "tiles": 0, "last_tile": None, "last_device": None, "m": 0, "n": 5, "k": 3,
             "batch": 1}  # fmt: skip
    expected = summarize(load_run(write_run(tmp_path / "without", run_events())))
    run = load_run(write_run(tmp_path / "with", [*run_events(), empty]))
    assert [g.gemm for g in run.gemms if g.last_tile is None] == [3]
    summary = summarize(run)
    assert summary["jobs"] == expected["jobs"] and summary["totals"] == expected["totals"]
    assert len(chrome_trace(run)["traceEvents"]) == len(chrome_trace(
        load_run(tmp_path / "without"))["traceEvents"]) + 1  # fmt: skip


@pytest.mark.parametrize(
    ("text", "steps", "inside", "outside"),
    [("all", (None, None), [0, 1, 10**6], []), ("3:7", (3, 7), [3, 5, 7], [2, 8]),
     (":50", (None, 50), [0, 1, 50], [51]), ("100:", (100, None), [100, 10**6], [99]),
     ("7", (7, 7), [7], [6, 8]), (":", (None, None), [0, 10**6], [])],
)  # fmt: skip
def test_step_range(
    text: str, steps: tuple[int | None, int | None], inside: list[int], outside: list[int]
) -> None:
    r = StepRange.parse(text)
    assert (r.first, r.last) == steps and StepRange.parse(str(r)) == r
    assert all(n in r for n in inside) and not any(n in r for n in outside)


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "is not A:B"), ("x:3", "is not A:B"), ("-2:3", "is not A:B"), ("9:3", "ends before")],
)
def test_bad_step_range(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepRange.parse(text)


def test_incomplete_run(tmp_path: Path) -> None:
    """A run that ended early (SIGTERM) is read, and every report says so, and why."""
    run = load_run(write_run(tmp_path, run_events(), incomplete="interrupted by SIGTERM"))
    assert run.incomplete == "interrupted by SIGTERM"
    summary = summarize(run)
    assert summary["run"]["incomplete"] == "interrupted by SIGTERM"
    assert "incomplete: the run ended early (interrupted by SIGTERM)" in format_summary(summary)
    complete = summarize(load_run(write_run(tmp_path / "complete", run_events())))
    assert complete["run"]["incomplete"] is None
    assert "incomplete:" not in format_summary(complete)


def test_missing_run_json_field(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, run_events())
    meta = json.loads((run_dir / "run.json").read_text())
    del meta["policy"], meta["command"]  # the command is descriptive: it may be left out
    (run_dir / "run.json").write_text(json.dumps(meta))
    with pytest.raises(RunError, match=r"run\.json: missing field 'policy'"):
        load_run(run_dir)


# -- morphling report ------------------------------------------------------------------------


def morphling(*argv: str | Path) -> int:
    """``morphling report ARGV`` in this process, through the subcommand's own parser."""
    parser, sub = command_parser("morphling", "test")
    report_cli.add_parser(sub)
    return run_command(parser, ["report", *map(str, argv)])


def test_cli_prints_and_writes(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert morphling(run_dir) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"run {run_dir}: policy greedy") and "stragglers" in out
    assert "summary.json" in err and "timeline.png" in err
    assert (run_dir / "timeline.png").is_file()


def test_cli_json_without_plots(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert morphling(run_dir, "--json", "--no-plots") == 0
    out, _ = capsys.readouterr()
    assert json.loads(out) == json.loads((run_dir / "summary.json").read_text())
    assert not list(run_dir.glob("*.png"))


def test_cli_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert morphling(tmp_path) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err == f"morphling report: {tmp_path} is not a Morphling run directory: it has no run.json"
    )
    assert morphling(tmp_path / "absent") == 1
    assert "not a directory" in capsys.readouterr().err


def test_cli_malformed_line(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    lines[4] = lines[4][:-3]  # a truncated line 5
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    assert morphling(run_dir) == 1
    err = capsys.readouterr().err
    assert err.startswith("morphling report: ") and "events.jsonl line 5: not valid JSON" in err
    assert len(err.strip().splitlines()) == 1


def test_cli_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        morphling()
    assert exc.value.code == 2
    assert "RUN_DIR" in capsys.readouterr().err


def test_help_lists_the_options() -> None:
    _, sub = command_parser("morphling", "test")
    report_cli.add_parser(sub)
    help_text = sub.choices["report"].format_help()
    assert "--json" in help_text and "--no-plots" in help_text
    assert isinstance(sub.choices["report"], argparse.ArgumentParser)

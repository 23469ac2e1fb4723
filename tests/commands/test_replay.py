"""``morphling run --ranks N --numerics sample:K``: K ranks computed, the others replayed.

Real processes and sockets: a 16-rank DDP run with every rank computed and the same run
with one computed and fifteen replayed give the same event log, event for event; 10,000
ranks, one computed, run in seconds; what replay cannot map is refused, naming it.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
from morphling.proxy.emulator.replay import Replay, parse_numerics
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.load import load_run
from morphling.proxy.report.trace import chrome_trace
from morphling.proxy.vtime.eventlog import COMPRESSED_EVENTS_FILE
from morphling.proxy.wire.errors import RemoteProtocolError
from processes import SCRIPTS, morphling_here, morphling_run, succeeded

TIMES = ("t", "t0", "t1", "issue", "end", "start", "ready")
SPANS = ("down", "compute", "up")
IDS = ("tile", "request", "gemm", "last_tile")  # numbered in arrival order, run by run


def replay_run(tmp: Path, name: str, ranks: int, numerics: str, devices: str, script: str,
               *args: str) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    run_dir, report = tmp / name, tmp / f"{name}.json"
    succeeded(morphling_run("--ranks", ranks, "--numerics", numerics, "--embedded",
                            "--devices", devices, "--min-flops", "0", "--run-dir", run_dir,
                            "--json", report, "--no-report", "--", "python", SCRIPTS / script,
                            *args, cwd=tmp))  # fmt: skip
    return run_dir, json.loads(report.read_text())


def timeline(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events, each job named by its rank and each device by its name; times
    from the run's first product on taken from it (see the test), earlier ones left out.
    A rank that mirrors a timed one (``Replay.classes``) has the timed one's events, on its
    own device."""
    run = json.loads((run_dir / "run.json").read_text())
    names = {d["id"]: d["name"] for d in run["fleet"]}
    ranks = {j["id"]: int(re.search(r"rank (\d+)", j["name"])[1]) for j in run["jobs"]}
    lines = gzip.decompress((run_dir / COMPRESSED_EVENTS_FILE).read_bytes()).splitlines()
    records = [json.loads(line) for line in lines]
    mirrored = {m["rank"]: m for m in run.get("replay", {}).get("mirrors", [])}
    for r in list(records):
        timed = mirrored.get(ranks.get(r.get("job", -1), -1))
        if timed is None or r.get("device", timed["device"]) != timed["device"]:
            continue
        for rank, device in zip(timed["ranks"], timed["devices"], strict=True):
            ranks[-rank - 1] = rank  # (a job id of no job)
            copy = {**r, "job": -rank - 1}
            copy.update({k: device for k in ("device", "last_device") if k in r})
            records.append(copy)
    origin = min(r["issue"] for r in records if r["ev"] == "gemm")
    events = []
    for r in records:
        r["job"] = ranks[r["job"]] if "job" in r else None
        for key in ("device", "last_device"):
            if key in r:
                r[key] = names[r[key]]
        begins = r[SPANS[0]][0] if SPANS[0] in r else next(r[k] for k in TIMES if k in r)
        if begins < origin:  # DDP's start-up: no times (see the test), no op-class split
            r = {k: v for k, v in r.items() if k not in (*TIMES, *SPANS, "split")}
        else:
            r.update({k: r[k] - origin for k in TIMES if r.get(k) is not None})
            r.update({k: [t - origin for t in r[k]] for k in SPANS if k in r})
        events.append({k: v for k, v in r.items() if k not in IDS})
    return sorted(events, key=lambda r: json.dumps(r, sort_keys=True))


def assert_same(got: object, want: object, where: str) -> None:
    """Equal, floats to 1e-9."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-9), where
    else:
        assert got == want, where


def test_fifteen_replayed_ranks_have_the_timeline_of_fifteen_computed(tmp_path: Path) -> None:
    """Every event of 16 DDP ranks on a mixed fleet (each rank's products on its own board,
    its own work priced by its board's op model) is the same, to 1e-9 s, whether each rank
    is computed or rank 0 is and fifteen replay it, from the run's first product on.
    Before it, DDP's constructor does work that grows with the world size (its check of
    the parameters' shapes gathers a tensor per rank): four ranks computed of sixteen do
    less of it than sixteen would, so those first events are compared but not their
    times (and the step 1 records, which count them, are not compared at all)."""
    devices = "rpi4:8,rpi5:4,orin-nano:4"
    full, full_report = replay_run(tmp_path, "all", 16, "all", devices, "ranks_ddp.py", "2")
    replayed, report = replay_run(tmp_path, "sample", 16, "sample:1", devices, "ranks_ddp.py",
                                  "2")  # fmt: skip
    want = [e for e in timeline(full) if not (e["ev"] == "step" and e["step"] == 1)]
    got = [e for e in timeline(replayed) if not (e["ev"] == "step" and e["step"] == 1)]
    assert len(got) == len(want) and {e["job"] for e in want} == set(range(16))
    assert sum(e["ev"] == "tile" for e in want) == 16 * 2 * 5  # each rank's 5 products
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"event {i} ({w['ev']} of rank {w['job']})")

    run = json.loads((replayed / "run.json").read_text())
    mirrors = [(m["rank"], m["ranks"]) for m in run["replay"].pop("mirrors")]
    assert mirrors == [(1, [2, 3, 4, 5, 6, 7]), (8, [9, 10, 11]), (12, [13, 14, 15])]
    assert run["replay"] == {"world": 16, "computed": [0], "replayed": 15, "timed": 3,
                             "copies": "rank s replays rank s mod 1", "diverged_steps": 0,
                             "diverged": []}  # fmt: skip
    assert report["replay"]["replayed"] == 15 and [r["rank"] for r in report["ranks"]] == [0]
    assert [s["emulated_s"] for s in report["steps"][1:]] == pytest.approx(
        [s["emulated_s"] for s in full_report["steps"][1:]], abs=1e-9
    )
    # the report has each mirroring rank's device busy as its timed rank's; the trace
    # shows a device of each kind that was timed (the computed rank's, three copies')
    loaded = load_run(replayed)
    busy = {d["name"]: d["busy_s"] for d in summarize(loaded)["devices"]}
    full_busy = {d["name"]: d["busy_s"] for d in summarize(load_run(full))["devices"]}
    assert busy == pytest.approx(full_busy, abs=1e-9) and min(busy.values()) > 0
    trace = chrome_trace(loaded)
    shown = [
        e["args"]["name"]
        for e in trace["traceEvents"]  # type: ignore[union-attr]
        if e.get("name") == "process_name" and e["args"]["name"].startswith("device")
    ]
    assert len(shown) == 4 and "12 devices" in trace["otherData"]["mirrored"]  # type: ignore[index]


def test_ten_thousand_ranks_one_computed_two_timed_the_rest_mirrored(tmp_path: Path) -> None:
    """The suite's what-if at scale: 10,000 ranks of a one-layer DDP, one computed, one
    step; the replayed ones in two classes (a board each), one timed of each, and
    every other rank mirroring it on its own device."""
    run_dir, report = replay_run(tmp_path, "big", 10_000, "sample:1", "rpi4:5000,rpi5:5000",
                                 "ranks_ddp.py", "1", "-1", "-1", "-1", "tiny")  # fmt: skip
    run = json.loads((run_dir / "run.json").read_text())
    assert len(run["fleet"]) == 10_000 and len(run["jobs"]) == 3
    replay = run["replay"]
    assert replay["replayed"] == 9_999 and replay["timed"] == 2
    assert [(m["rank"], len(m["ranks"])) for m in replay["mirrors"]] == [(1, 4998), (5000, 4999)]
    mirrored = {r for m in replay["mirrors"] for r in (m["rank"], *m["ranks"])}
    assert mirrored == set(range(1, 10_000))
    names = {d["id"]: d["name"] for d in run["fleet"]}
    assert {names[d].rpartition("-")[0] for d in replay["mirrors"][1]["devices"]} == {"rpi5"}
    lines = gzip.decompress((run_dir / COMPRESSED_EVENTS_FILE).read_bytes()).splitlines()
    steps = [r for r in map(json.loads, lines) if r["ev"] == "step"]
    assert len(steps) == 3 and {s["step"] for s in steps} == {1}
    assert len(report["steps"]) == 1 and report["steps"][0]["emulated_s"] > 0


def test_a_replayed_rank_whose_device_leaves_is_dropped_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    """``--on-leave drop``: rank 2's device leaves at 35 ms (in step 2, during its last
    all-reduce) and is back at 1 s. Under ``wait`` the others wait for it in that
    all-reduce; under ``drop`` it leaves the run: the all-reduce starts again without it
    when it leaves, step 3's are of three ranks, and rank 2 logs no step after step 1."""
    (tmp_path / "trace.csv").write_text("device,start,end\nrpi4-2,0,0.035\nrpi4-2,1.0,\n")
    runs = {}
    for policy in ("wait", "drop"):
        run_dir, report = tmp_path / policy, tmp_path / f"{policy}.json"
        succeeded(morphling_run("--ranks", 4, "--numerics", "sample:1", "--embedded",
                                "--devices", "rpi4:4", "--min-flops", "0", "--availability",
                                tmp_path / "trace.csv", "--on-leave", policy, "--run-dir",
                                run_dir, "--json", report, "--no-report", "--", "python",
                                SCRIPTS / "ranks_ddp.py", "3", cwd=tmp_path))  # fmt: skip
        lines = gzip.decompress((run_dir / COMPRESSED_EVENTS_FILE).read_bytes()).splitlines()
        run = json.loads((run_dir / "run.json").read_text())
        ranks = {j["id"]: int(re.search(r"rank (\d+)", j["name"])[1]) for j in run["jobs"]}
        events = [{**e, "rank": ranks[e["job"]]} for e in map(json.loads, lines) if "job" in e]
        runs[policy] = (json.loads(report.read_text())["steps"], run["replay"], events)
    (waited, replay_wait, _), (dropped, replay, events) = runs["wait"], runs["drop"]
    assert "dropped" not in replay_wait and replay["dropped"] == [{"rank": 2, "at": 0.035}]
    assert waited[1]["emulated_s"] > 0.9  # rank 0's step 2 waits for rank 2 to be back
    assert dropped[1]["emulated_s"] < 0.05 and dropped[2]["emulated_s"] < 0.05
    assert [e["step"] for e in events if e["ev"] == "step" and e["rank"] == 2] == [1]
    parts = [e for e in events if e["ev"] == "collective" and e["rank"] == 0]
    assert {e["members"] for e in parts if e["step"] == 3} == {3}
    restarted = [e for e in parts if e["step"] == 2 and e["members"] == 3]
    assert restarted and restarted[0]["start"] == pytest.approx(0.035)


def test_two_computed_ranks_of_six_each_replayed_by_two(tmp_path: Path) -> None:
    """K = 2: ranks 2 and 4 copy rank 0, ranks 3 and 5 rank 1 (2 and 3 timed, 4 and 5
    mirroring them: one board for all); both computed ranks run (a world of two for gloo)
    and their work, the same shapes, is not taken for divergent."""
    run_dir, report = replay_run(tmp_path, "k2", 6, "sample:2", "rpi4:6", "ranks_ddp.py", "2")
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    run = json.loads((run_dir / "run.json").read_text())
    names = [j["name"] for j in run["jobs"]]
    copies = [re.findall(r"rank (\d+)", n) for n in names if "replaying" in n]
    assert sorted(copies) == [["2", "0"], ["3", "1"]]  # ("rank 2, replaying SCRIPT rank 0")
    mirrors = sorted((m["rank"], m["ranks"]) for m in run["replay"]["mirrors"])
    assert mirrors == [(2, [4]), (3, [5])]  # (in the order the computed ranks opened)
    assert run["replay"]["diverged_steps"] == 0


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--ranks", "2", "--numerics", "sample:3"], "3 computed ranks, but --ranks is 2"),
        (["--ranks", "2", "--numerics", "sample:0"], "give 'all' or 'sample:K' with K >= 1"),
        (["--ranks", "2", "--numerics", "half"], "give 'all' or 'sample:K' with K >= 1"),
        (["--ranks", "2", "--numerics", "sample:1", "--products", "device"],
         "needs --products rank"),
    ],
)  # fmt: skip
def test_what_replay_cannot_take_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    flags: list[str], said: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    code, _, err = morphling_here(capsys, "run", "--embedded", "--devices", "rpi4:2", *flags,
                                  "--", "python", str(SCRIPTS / "ranks_ddp.py"))  # fmt: skip
    assert code == 2 and said in err, err


def test_a_pipelines_sends_cannot_be_replayed_and_the_run_says_why(tmp_path: Path) -> None:
    """Point-to-point operations name a peer that a replayed rank would not have: refused
    by the emulator, naming the way out."""
    proc = morphling_run("--ranks", "4", "--numerics", "sample:2", "--embedded", "--devices",
                         "rpi4:4", "--min-flops", "0", "--no-report", "--", "python",
                         SCRIPTS / "ranks_pipeline.py", cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert "replay maps only collectives of the whole world" in proc.stderr, proc.stderr[-3000:]
    assert "--numerics all" in proc.stderr


def test_replay_maps_the_whole_worlds_collectives_and_refuses_others() -> None:
    replay = Replay(8, 2, {r: 100 + r for r in range(2, 8)})
    assert replay.copies(0) == [2, 4, 6] and replay.copies(1) == [3, 5, 7]
    assert replay.group("allreduce", [1, 0], "COLLECTIVE 3") == tuple(range(8))
    for op, ranks in (("allreduce", [0]), ("send", [0, 1]), ("broadcast", [0, 1, 2])):
        with pytest.raises(RemoteProtocolError, match="whole world") as refused:
            replay.group(op, ranks, "COLLECTIVE 3")
        assert refused.value.code == "bad_collective"


def test_copies_timed_alike_are_one_class_and_a_device_of_its_own_times_its_copy_alone() -> None:
    """Of rank 0's copies 2, 4, 6, 8 (devices 102..108), 2 and 6 are on one kind of board,
    4 on another, and 8's device has absences of its own (``alike``: None)."""
    kinds = {102: "rpi4", 104: "rpi5", 106: "rpi4", 108: "rpi4"}
    replay = Replay(9, 2, {r: 100 + r for r in range(2, 9)})
    classes = replay.classes(0, lambda device: None if device == 108 else kinds[device])
    assert classes == [(2, {6: 106}), (4, {}), (8, {})]
    summary = replay.summary()
    assert summary["timed"] == 6  # of 7 replayed: 6 mirrors 2
    assert summary["mirrors"] == [{"rank": 2, "device": 102, "ranks": [6], "devices": [106]}]


def test_computed_ranks_whose_work_differs_are_counted() -> None:
    replay = Replay(4, 2, {2: 10, 3: 11})
    replay.check(0, 1, ("gemm", 64))
    replay.check(1, 1, ("gemm", 64))
    replay.check(0, 2, ("gemm", 64))
    replay.check(1, 2, ("gemm", 32))
    assert replay.summary()["diverged_steps"] == 1
    assert replay.summary()["diverged"] == [{"step": 2, "rank": 1}]


def test_numerics_parses_all_and_sample() -> None:
    assert parse_numerics("all", 0) is None and parse_numerics("sample:3", 4) == 3
    assert parse_numerics("sample:64", 0) == 64  # (an offloaded run's tiles per GEMM)
    for spec, ranks in (("sample:", 4), ("sample:-1", 4), ("some:2", 4), ("sample:5", 4)):
        with pytest.raises(ValueError, match="--numerics"):
            parse_numerics(spec, ranks)

"""Devices that leave and come back in virtual time: the trace readers, the churn model,
and the timeline placing again the tiles a leaving device had not sent back."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from morphling.proxy.emulator.settings import EmulatorConfig, availability_of
from morphling.proxy.vtime.availability import (
    Churn,
    Presence,
    Trace,
    bind,
    parse_churn,
    read_trace,
)
from morphling.proxy.vtime.timeline import Operation
from timeline_driver import MB, Recorder, new_timeline, profile, records, submit, task

from morphling.config import ConfigError


def first(absences, n: int) -> list[tuple[float, float]]:
    return list(itertools.islice(absences, n))


def test_a_csv_trace_gives_each_device_its_absences(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("device,start,end\n# a comment\na,0,10\na,20,30\nb,5,\nc,0,4\nc,3,8\n")
    devices = read_trace(path)
    assert first(devices["a"].absences(), 5) == [(10, 20), (30, math.inf)]
    assert first(devices["b"].absences(), 5) == [(0, 5)]  # there from 5 s on, to the end
    assert first(devices["c"].absences(), 5) == [(8, math.inf)]  # overlapping lines merge
    assert first(Trace(devices).absences("unnamed"), 5) == []  # always there


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a,0\n", "trace.csv:1: expected device,start,end"),
        ("a,0,10\nb,x,3\n", "trace.csv:2: start 'x' is not a time"),
        ("a,5,2\n", "trace.csv:1: end '2' is not after start 5.0"),
        ("a,-1,2\n", "trace.csv:1: start '-1' is not a time"),
        ('{"1": {"active": [0], "inactive": [5]}}', "client '1': no 'finish_time'"),
        ('{"1": {"active": [0, 9], "inactive": [5], "finish_time": 10}}', "2 active and 1"),
        ('{"1": {"active": [0], "inactive": [50], "finish_time": 10}}', "past finish_time"),
        ('{"1": {"active": ["0"], "inactive": [5], "finish_time": 10}}', "active[0] '0'"),
        ('{"1": [0, 5]', "trace.csv:1: not JSON"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_line_and_field(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=None) as caught:
        read_trace(path)
    assert expected in str(caught.value)


def test_fedscales_trace_repeats_every_finish_time_and_binds_ids_in_fleet_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "behave.json"
    trace = {
        "7": {"duration": 9, "active": [0, 6], "inactive": [4, 9], "finish_time": 10, "model": "x"},
        "3": {"duration": 5, "active": [2], "inactive": [10], "finish_time": 10, "model": "y"},
        "12": {"active": [0], "inactive": [10], "finish_time": 10},
    }
    path.write_text(json.dumps(trace))
    devices = read_trace(path)
    assert first(devices["7"].absences(), 4) == [(4, 6), (9, 10), (14, 16), (19, 20)]
    bound = bind(devices, ["rpi4-0", "rpi4-1"], path)  # ids 3, 7 (12 unused: 2 devices)
    assert first(bound.absences("rpi4-0"), 2) == [(0, 2), (10, 12)]
    assert first(bound.absences("rpi4-1"), 1) == [(4, 6)]
    always = Presence(((0.0, 10.0),), 10.0)
    assert first(always.absences(), 3) == []  # there the whole period: no absence, ever


def test_a_trace_naming_devices_the_fleet_lacks_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("rpi4-0,0,1\nghost,0,1\n")
    with pytest.raises(ValueError, match="names devices the fleet lacks: ghost"):
        bind(read_trace(path), ["rpi4-0", "rpi4-1"], path)


def test_churn_is_seeded_by_the_seed_and_the_device_name() -> None:
    churn = parse_churn("mtbf=100,mttr=10,seed=3")
    assert churn == Churn(100.0, 10.0, 3)
    a = first(churn.absences("rpi4-0"), 200)
    assert a == first(churn.absences("rpi4-0"), 200)
    assert a != first(churn.absences("rpi4-1"), 200)
    assert a != first(parse_churn("mtbf=100,mttr=10,seed=4").absences("rpi4-0"), 200)
    assert all(l1 < b1 <= l2 for (l1, b1), (l2, _) in itertools.pairwise(a))
    ups = [l2 - b1 for (_, b1), (l2, _) in itertools.pairwise(a)]
    downs = [b - leave for leave, b in a]
    assert 60 < sum(ups) / len(ups) < 140 and 6 < sum(downs) / len(downs) < 14


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("mtbf=10", "mttr missing"),
        ("mtbf=10,mttr=0", "mttr='0' is not seconds > 0"),
        ("mtbf=ten,mttr=1", "mtbf='ten'"),
        ("mtbf=10,mttr=1,seed=x", "seed='x' is not an integer"),
        ("mtbf=10,mttr=1,rate=3", "'rate=3' is not a setting"),
        ("mtbf=1,mtbf=2,mttr=1", "mtbf is given twice"),
    ],
)
def test_a_churn_spec_that_does_not_parse_is_refused(spec: str, expected: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_churn(spec)
    assert expected in str(caught.value)


def run_gemm(availability, devices: int = 2, policy: str = "greedy"):
    """One 1024×1024×256 GEMM (16 tiles of 256²) on ``devices`` equal devices."""
    tl, sink = new_timeline(policy, availability=availability)
    for d in range(devices):
        tl.add_device(d, f"d-{d}", profile(flops=1e9, bw=100 * MB))
    rec = Recorder()
    tl.open_job(1, "job")
    submit(tl, rec, 1, task(1, 1024, 1024, 256), block=256)
    closed = []
    tl.mark_step(1, 1, host_s=0.0, done=closed.append)
    tl.close_job(1)
    return rec, closed[0], sink, tl


def test_a_leaving_device_s_tiles_are_placed_again_and_the_gemm_ends_later() -> None:
    rec, steady, sink, _ = run_gemm(None)
    end = rec.ended[1][1]
    leave = end / 3  # device 0 leaves a third of the way through, back near the end
    trace = Trace({"d-0": Presence(((0.0, leave), (end * 0.9, math.inf)))})
    rec2, times, sink2, tl = run_gemm(trace)
    tiles = records(sink2, "tile")
    assert len(tiles) == 16 == times.tiles  # every tile once, where it was computed last
    assert not [t for t in tiles if t["device"] == 0 and t["up"][1] > leave]
    away = records(sink2, "away")
    assert away == [
        {"ev": "away", "device": 0, "t0": leave, "t1": end * 0.9, "tiles": away[0]["tiles"],
         "lost_s": away[0]["lost_s"]}
    ]  # fmt: skip
    assert away[0]["tiles"] == times.interruptions > 0 and times.lost_s == away[0]["lost_s"] > 0
    assert rec2.ended[1][1] > end  # the lost work and one device less cost time
    assert steady.interruptions == 0 and records(sink, "away") == []
    # what the real path was handed is unchanged: each tile once, on the device first chosen
    assert len({t for t, _ in rec2.placed}) == len(rec2.placed) == len(rec.placed) == 16
    step = records(sink2, "step")[0]
    assert step["interruptions"] == times.interruptions and step["lost_s"] == times.lost_s
    assert tl.log.digest() == run_gemm(trace)[3].log.digest()


def test_tiles_wait_while_every_device_is_away() -> None:
    trace = Trace({f"d-{d}": Presence(((0.0, 0.01), (5.0, math.inf))) for d in range(2)})
    rec, times, sink, _ = run_gemm(trace)
    assert rec.ended[1][1] > 5.0  # they went on once the devices were back
    assert len(records(sink, "tile")) == 16 and times.interruptions > 0
    assert all(t["down"][0] >= 5.0 for t in records(sink, "tile"))


@pytest.mark.parametrize("policy", ["greedy", "round-robin", "load-balanced"])
def test_a_device_away_when_it_joins_takes_tiles_only_once_it_is_back(policy: str) -> None:
    trace = Trace({"d-1": Presence(((1e6, math.inf),))})  # there only from 1e6 s on
    _, times, sink, _ = run_gemm(trace, devices=3, policy=policy)
    assert {t["device"] for t in records(sink, "tile")} == {0, 2}
    assert times.interruptions == 0


def test_churn_on_a_fleet_is_deterministic_and_counts_its_interruptions() -> None:
    churn = Churn(mtbf_s=0.05, mttr_s=0.02, seed=1)
    runs = [run_gemm(churn, devices=4) for _ in range(2)]
    (_, times, sink, tl), (_, again, _, tl2) = runs
    assert tl.log.digest() == tl2.log.digest()
    assert times.interruptions == again.interruptions > 0
    assert len(records(sink, "tile")) == 16


def rank_round(on_leave: str, away: dict[str, tuple[float, float]]):
    """Two ranks, each on its own device: 0.5 s of its own work, then a 4 MB all-reduce,
    then a step mark; ``away``: device name → (leave, back). Each rank's step times."""
    trace = Trace({name: Presence(((0.0, leave), (back, math.inf))) for name, (leave, back)
                   in away.items()})  # fmt: skip
    tl, sink = new_timeline(availability=trace, on_leave=on_leave)
    for r in range(2):
        tl.add_device(r, f"d-{r}", profile(bw=10 * MB, lat=0.001))
        tl.open_job(r + 1, f"rank-{r}", device=r, rank=r)
    ended, steps = {}, {}
    op = Operation(("world", 1), "allreduce", 4_000_000, (0, 1))
    for r in range(2):
        tl.collective(r + 1, r, 7, op, after=0, host_s=0.5,
                      done=lambda issue, end, r=r: ended.__setitem__(r, end))  # fmt: skip
    for r in range(2):
        tl.mark_step(r + 1, 1, host_s=0.0, done=lambda t, r=r: steps.__setitem__(r, t))
    return ended, steps, sink


ALLREDUCE_S = 2 * 1 / 2 * 4_000_000 / (10 * MB) + 2 * 1 * 2 * 0.001


def test_a_rank_waits_for_its_device_and_the_others_wait_for_it_in_the_collective() -> None:
    ended, steps, _ = rank_round("wait", {})
    assert ended[0] == pytest.approx(0.5 + ALLREDUCE_S)
    # rank 1's device is away from 0.2 s to 1.2 s: its work pauses, then goes on
    ended, steps, sink = rank_round("wait", {"d-1": (0.2, 1.2)})
    assert ended == {0: pytest.approx(1.5 + ALLREDUCE_S), 1: pytest.approx(1.5 + ALLREDUCE_S)}
    assert steps[1].interruptions == 1 and steps[1].lost_s == 0.0
    assert steps[0].interruptions == 0 and steps[0].comm_wait_s == pytest.approx(1.0)
    assert records(sink, "away") == [
        {"ev": "away", "device": 1, "t0": 0.2, "t1": 1.2, "tiles": 1, "lost_s": 0.0}
    ]


def test_a_restarting_rank_does_its_step_again_once_back() -> None:
    ended, steps, _ = rank_round("restart", {"d-1": (0.2, 1.2)})
    # back at 1.2 s, the 0.2 s it had done are done again, then its last 0.3 s
    assert ended[1] == pytest.approx(1.2 + 0.2 + 0.3 + ALLREDUCE_S)
    assert steps[1].lost_s == pytest.approx(0.2) and steps[1].interruptions == 1


def test_a_collective_waits_for_a_member_that_leaves_during_it() -> None:
    leave = 0.5 + ALLREDUCE_S / 2  # in the middle of the all-reduce
    ended, steps, _ = rank_round("wait", {"d-0": (leave, 2.0)})
    assert ended[0] == pytest.approx(2.0 + ALLREDUCE_S)  # it starts again once back
    assert steps[0].interruptions == 1


def drop_round(leave: float, *, droppable: bool = True):
    """Three ranks, as ``rank_round``, rank 2 ``droppable`` and its device away from
    ``leave`` to 10 s, under ``drop``; then a second round. Each rank's all-reduce ends
    (round 1, round 2), and the timeline."""
    trace = Trace({"d-2": Presence(((0.0, leave), (10.0, math.inf)))})
    tl, _ = new_timeline(availability=trace, on_leave="drop")
    for r in range(3):
        tl.add_device(r, f"d-{r}", profile(bw=10 * MB, lat=0.001))
        tl.open_job(r + 1, f"rank-{r}", device=r, rank=r, droppable=droppable and r == 2)
    ended: dict[int, list[float]] = {r: [] for r in range(3)}
    for round_ in (1, 2):
        op = Operation(("world", round_), "allreduce", 4_000_000, (0, 1, 2))
        for r in range(3):
            tl.collective(r + 1, r, round_, op, after=0, host_s=0.5,
                          done=lambda issue, end, r=r: ended[r].append(end))  # fmt: skip
    return ended, tl


def ring_s(n: int) -> float:
    """``ALLREDUCE_S``'s ring of ``n`` members."""
    return 2 * (n - 1) / n * 4_000_000 / (10 * MB) + 2 * (n - 1) * 2 * 0.001


def test_a_dropped_rank_leaves_the_run_and_the_others_go_on_without_it() -> None:
    """Its device leaves at 0.2 s, in its own work before the all-reduce: the others start
    it at 0.5 s, the two of them, and then their second round."""
    ended, tl = drop_round(0.2)
    first = 0.5 + ring_s(2)
    assert ended[0] == ended[1] == [pytest.approx(first), pytest.approx(first + 0.5 + ring_s(2))]
    assert ended[2] == [] and tl.ranks_dropped == {2: 0.2}


def test_a_collective_a_dropped_rank_leaves_under_way_starts_again_without_it() -> None:
    leave = 0.5 + ring_s(3) / 2  # in the middle of the three ranks' all-reduce
    ended, tl = drop_round(leave)
    assert ended[0] == ended[1] == [pytest.approx(leave + ring_s(2)),
                                    pytest.approx(leave + ring_s(2) + 0.5 + ring_s(2))]  # fmt: skip
    assert ended[2] == [] and tl.ranks_dropped == {2: leave}


def test_a_rank_that_cannot_be_dropped_waits_under_drop() -> None:
    """A computed rank (not ``droppable``) takes part in every collective for real: under
    ``drop`` it waits for its device, as under ``wait``."""
    ended, tl = drop_round(0.2, droppable=False)
    first = 10.0 + 0.3 + ring_s(3)  # its last 0.3 s of work once back
    assert ended[2] == [pytest.approx(first), pytest.approx(first + 0.5 + ring_s(3))]
    assert tl.ranks_dropped == {}


def test_on_leave_must_be_known() -> None:
    with pytest.raises(ValueError, match="on_leave 'leave': not one of wait, restart, drop"):
        new_timeline(on_leave="leave")


def test_a_gemm_issued_while_every_device_is_away_starts_when_one_is_back() -> None:
    trace = Trace({f"d-{d}": Presence(((0.0, 0.5), (5.0, math.inf))) for d in range(2)})
    tl, _ = new_timeline("greedy", availability=trace)
    for d in range(2):
        tl.add_device(d, f"d-{d}", profile(flops=1e9, bw=100 * MB))
    rec, closed = Recorder(), []
    tl.open_job(1, "job")
    submit(tl, rec, 1, task(1, 512, 512, 256), block=256, host_s=1.0)  # issued at 1 s
    tl.mark_step(1, 1, host_s=0.0, done=closed.append)
    assert rec.ended[1][0] == 1.0 and rec.ended[1][1] > 5.0 and len(closed) == 1


def test_every_gemm_of_a_long_run_on_a_churning_fleet_ends() -> None:
    tl, _ = new_timeline("greedy", availability=Churn(0.05, 0.02, 1))
    for d in range(2):
        tl.add_device(d, f"d-{d}", profile(flops=1e9, bw=100 * MB))
    rec = Recorder()
    tl.open_job(1, "job")
    for g in range(1, 201):
        submit(tl, rec, 1, task(g, 256, 256, 64), block=128, after=g - 1, host_s=0.001)
    assert len(rec.ended) == 200 and tl.stalled == 0


def test_a_fedscale_trace_of_ids_binds_to_an_embedded_fleet_and_a_bad_seed_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "behave.json"
    path.write_text(json.dumps({"5": {"active": [1], "inactive": [1], "finish_time": 3}}))
    config = EmulatorConfig(availability=str(path))  # parses; binds once the fleet is known
    trace = availability_of(config, ["rpi4-0"])
    assert first(trace.absences("rpi4-0"), 2) == [(0.0, math.inf)]  # (an instant: never)
    with pytest.raises(ConfigError, match="numeric ids"):
        availability_of(config, None)
    with pytest.raises(ValueError, match="seed='-1' is not an integer >= 0"):
        parse_churn("mtbf=1,mttr=1,seed=-1")
    csv = tmp_path / "t.csv"
    csv.write_text("\ufeff# boards\nDevice, Start, End\nrpi4-0,1,2\n")
    assert first(read_trace(csv)["rpi4-0"].absences(), 2) == [(0.0, 1.0), (2.0, math.inf)]


@pytest.mark.parametrize(
    ("second", "end", "lost"),
    [
        # 0.1 s into doing it again from 1.2 s: from 1.5 s it does the whole 0.5 s
        ((1.3, 1.5), 2.0, 0.3),
        # 0.05 s into it: from 1.35 s it does it all (0.2 + 0.05 s lost)
        ((1.25, 1.35), 1.85, 0.25),
    ],
)
def test_a_restarting_rank_away_again_while_it_redoes_its_work_does_it_all_again(
    second: tuple[float, float], end: float, lost: float
) -> None:
    """Away from 0.2 to 1.2 s with 0.2 s of its work done, and away again as it does it
    again."""
    trace = Trace({"d-1": Presence(((0.0, 0.2), (1.2, second[0]), (second[1], math.inf)))})
    tl, _ = new_timeline(availability=trace, on_leave="restart")
    for r in range(2):
        tl.add_device(r, f"d-{r}", profile(bw=10 * MB, lat=0.001))
        tl.open_job(r + 1, f"rank-{r}", device=r, rank=r)
    steps = {}
    for r in range(2):
        tl.mark_step(r + 1, 1, host_s=0.5, done=lambda t, r=r: steps.__setitem__(r, t))
    assert steps[1].t1 == pytest.approx(end)
    assert steps[1].interruptions == 2 and steps[1].lost_s == pytest.approx(lost)
    assert steps[0].t1 == pytest.approx(0.5) and steps[0].interruptions == 0


def test_a_collective_longer_than_every_window_pauses_instead_of_waiting_for_ever() -> None:
    trace = Trace({"d-1": Presence(((0.0, 0.1),), 0.2)})  # there 0.1 s of every 0.2 s
    tl, _ = new_timeline(availability=trace)
    for r in range(2):
        tl.add_device(r, f"d-{r}", profile(bw=10 * MB, lat=0.001))
        tl.open_job(r + 1, f"rank-{r}", device=r, rank=r)
    op = Operation(("world", 1), "allreduce", 4_000_000, (0, 1))  # 0.404 s on the network
    ended = {}
    for r in range(2):
        tl.collective(r + 1, r, 7, op, after=0, host_s=0.05,
                      done=lambda issue, end, r=r: ended.__setitem__(r, end))  # fmt: skip
    # from 0.05 s: 0.05 there, then 0.1 of each 0.2 s period: done in the fifth window
    assert ended[0] == ended[1] == pytest.approx(0.854)


def test_a_ranks_time_away_is_no_coordinator_time() -> None:
    trace = Trace({"d-1": Presence(((0.0, 0.2), (1.2, math.inf)))})
    tl, sink = new_timeline(availability=trace)
    for r in range(2):
        tl.add_device(r, f"d-{r}", profile(bw=10 * MB, lat=0.001))
        tl.open_job(r + 1, f"rank-{r}", device=r, rank=r)
    op = Operation(("world", 1), "allreduce", 1000, (0, 1))
    steps = {}
    for r in range(2):  # a collective at once opens the step; then 0.5 s of own work
        tl.collective(r + 1, r, 7, op, after=0, host_s=0.0, done=lambda *_: None)
    start = records(sink, "collective")[0]["end"]
    for r in range(2):
        tl.mark_step(r + 1, 1, host_s=0.5, host_split={"elementwise": 5},
                     done=lambda t, r=r: steps.__setitem__(r, t))  # fmt: skip
    assert steps[1].t1 == pytest.approx(start + 0.5 + 1.0)  # the second away in between
    assert steps[1].coord_s == pytest.approx(0.5)
    assert steps[1].coord_split == {"elementwise": pytest.approx(0.5)}
    spans = [(c["t0"], c["t1"]) for c in records(sink, "coord") if c["job"] == 2]
    assert spans == [(start, 0.2), (1.2, pytest.approx(start + 1.5))]


def test_a_ranks_device_is_away_for_the_other_jobs_once_its_rank_has_left() -> None:
    trace = Trace({"d-0": Presence(((0.0, 1e-9), (1e6, math.inf)))})  # away from 1 ns
    tl, sink = new_timeline(availability=trace)
    for d in range(2):
        tl.add_device(d, f"d-{d}", profile(flops=1e9, bw=100 * MB))
    tl.open_job(1, "rank-0", device=0, rank=0)  # its absences: its own time's
    tl.close_job(1)
    rec = Recorder()
    tl.open_job(2, "job")
    submit(tl, rec, 2, task(1, 512, 512, 256), block=256)
    assert {t["device"] for t in records(sink, "tile")} == {1}


def test_only_devices_without_absences_of_their_own_are_timed_alike():
    """``timed_by``: replay mirrors a rank only on a device timed as another is; one a
    trace takes away is timed by nothing another shares."""
    tl, _ = new_timeline(availability=Trace({"d-1": Presence(((0.0, 1.0),))}))
    for d, p in enumerate([profile("a"), profile("a"), profile("a"), profile("b")]):
        tl.add_device(d, f"d-{d}", p, placed=False)
    keys = [tl.timed_by(d) for d in range(4)]
    assert keys[0] == keys[2] is not None and keys[1] is None and keys[3] not in (None, keys[0])


def test_churn_under_drop_drops_each_replayed_rank_at_its_devices_first_leave() -> None:
    """Six ranks on a churning fleet, 1 to 5 droppable: each round the ranks still there
    all-reduce; a rank leaves at its device's first leave if that comes before its last
    round is done, and the run is the same when run again."""
    churn = Churn(mtbf_s=2.0, mttr_s=1.0, seed=3)

    def run() -> tuple[dict[int, float], list[float]]:
        tl, _ = new_timeline(availability=churn, on_leave="drop")
        for r in range(6):
            tl.add_device(r, f"d-{r}", profile(bw=10 * MB, lat=0.001))
            tl.open_job(r + 1, f"rank-{r}", device=r, rank=r, droppable=r > 0)
        ended: list[float] = []
        for round_ in range(1, 4):
            op = Operation(("world", round_), "allreduce", 4_000_000, tuple(range(6)))
            tl.collective(1, 0, round_, op, after=0, host_s=0.5,
                          done=lambda i, e: ended.append(e))  # fmt: skip
            for r in range(1, 6):
                tl.collective(r + 1, r, round_, op, after=0, host_s=0.5,
                              done=lambda i, e: None)  # fmt: skip
        return dict(tl.ranks_dropped), ended

    dropped, ended = run()
    assert (dropped, ended) == run() and len(ended) == 3  # rank 0 (it waits) ends all three
    first = {r: next(churn.absences(f"d-{r}"))[0] for r in range(1, 6)}
    assert dropped == {r: first[r] for r in dropped} and 0 < len(dropped) < 5
    assert all(first[r] > ended[-1] for r in range(1, 6) if r not in dropped)

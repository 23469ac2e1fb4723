"""The virtual clock: FIFOs per device and link, placement, residency, jobs in virtual time.

Every expected time here is worked out by hand from the analytic model
(2·m·n·k / flops; latency + bytes / bandwidth), so a wrong queueing rule
shows up as a wrong number, not as a vague inequality.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import BUILTIN
from morphling.proxy.emulator.partition import GemmTask, make_task
from morphling.proxy.vtime.engine import Clock, Fifo
from morphling.proxy.vtime.held import HeldTime
from morphling.proxy.vtime.placement import Placement
from morphling.proxy.vtime.timeline import Bottleneck
from morphling.proxy.wire.messages import Gemm
from timeline_driver import (
    MB,
    Recorder,
    new_timeline,
    profile,
    records,
    submit,
    sustained,
    task,
)

# --- the core ------------------------------------------------------------------------------


def test_clock_runs_events_in_time_then_device_then_tile_order():
    clock, ran = Clock(), []
    for time, device, tile in [(2.0, 0, 1), (1.0, 5, 1), (1.0, 2, 9), (1.0, 2, 3), (0.5, 9, 9)]:
        clock.at(time, ran.append, (time, device, tile), device=device, tile=tile)
    clock.run()
    assert ran == [(0.5, 9, 9), (1.0, 2, 3), (1.0, 2, 9), (1.0, 5, 1), (2.0, 0, 1)]
    assert clock.now == 2.0


def test_clock_stops_before_the_horizon_and_never_runs_the_past():
    clock, ran = Clock(), []
    clock.at(1.0, ran.append, "a")
    clock.at(2.0, ran.append, "b")
    clock.run(lambda: 2.0)
    assert ran == ["a"]
    clock.at(0.5, ran.append, "late")  # the past is settled: it runs now, not at 0.5
    clock.run()
    assert ran == ["a", "late", "b"] and clock.now == 2.0


def test_clock_refuses_a_nan_time_and_runs_an_infinite_one_last():
    clock, ran = Clock(), []
    with pytest.raises(ValueError, match="event time is NaN"):
        clock.at(math.nan, ran.append, "never")
    clock.at(math.inf, ran.append, "last")
    clock.at(1.0, ran.append, "first")
    assert clock.run() == 2 and ran == ["first", "last"]


def test_fifo_serves_in_arrival_order():
    fifo = Fifo()
    assert fifo.serve(0.0, 2.0) == (0.0, 2.0)
    assert fifo.serve(1.0, 1.0) == (2.0, 3.0)  # waits for the first
    assert fifo.serve(5.0, 1.0) == (5.0, 6.0)  # idle in between
    assert fifo.busy_s == 4.0


# --- one device, by hand ----------------------------------------------------------------


def test_one_tile_crosses_downlink_compute_uplink():
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile())
    tl.open_job(1, "job")
    rec = Recorder()
    submit(tl, rec, 1, task(1, 100, 100, 100), block=256)
    down = 0.001 + 2 * 100 * 100 * 4 / MB  # A's rows and B's columns: 80 kB
    compute = 2 * 100**3 / 1e9
    up = 0.001 + 100 * 100 * 4 / MB
    (tile,) = records(sink, "tile")
    assert tile["down"] == pytest.approx([0, down])
    assert tile["compute"] == pytest.approx([down, down + compute])
    assert tile["up"] == pytest.approx([down + compute, down + compute + up])
    assert rec.ended[1] == pytest.approx((0.0, down + compute + up))
    assert [device for _, device in rec.placed] == [0]


def test_tiles_on_one_device_pipeline_through_its_fifos():
    """Tile 2 downloads while tile 1 computes, and computes when both are done. It shares
    its B block with tile 1, which the device holds by then: it downloads its A alone."""
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile(flops=1e7))  # compute-bound: 0.2 s per 100³ tile, 81 ms down
    tl.open_job(1, "job")
    submit(tl, Recorder(), 1, task(1, 200, 100, 100), block=100)  # two tiles, one B block
    t1, t2 = records(sink, "tile")
    down = 0.001 + 2 * 100 * 100 * 4 / MB
    compute = 2 * 100**3 / 1e7
    assert (t1["bytes_down"], t2["bytes_down"]) == (2 * 100 * 100 * 4, 100 * 100 * 4)
    assert t2["down"] == pytest.approx([down, down + 0.001 + 100 * 100 * 4 / MB])
    assert t2["compute"] == pytest.approx([down + compute, down + 2 * compute])  # behind it
    assert t1["up"][0] == pytest.approx(down + compute)


def test_greedy_places_on_the_earliest_finish_and_round_robin_cycles():
    # fast links: compute decides (on a slow link, greedy rightly spreads the transfers)
    fast, slow = profile("fast", flops=1e10, bw=1e9), profile("slow", flops=1e8, bw=1e9)
    for policy, expect in [("greedy", [1, 1, 1, 1]), ("round-robin", [0, 1, 0, 1])]:
        tl, _ = new_timeline(policy)
        tl.add_device(0, "slow", slow)
        tl.add_device(1, "fast", fast)
        tl.open_job(1, "job")
        rec = Recorder()
        submit(tl, rec, 1, task(1, 200, 200, 64), block=100)  # four small tiles
        assert [device for _, device in rec.placed] == expect, policy


def test_load_balanced_spreads_by_outstanding_tiles():
    tl, _ = new_timeline("load-balanced")
    for i in range(3):
        tl.add_device(i, f"d{i}", profile())
    tl.open_job(1, "job")
    rec = Recorder()
    submit(tl, rec, 1, task(1, 300, 200, 64), block=100)  # six tiles
    assert [device for _, device in rec.placed] == [0, 1, 2, 0, 1, 2]


def test_resident_weight_blocks_do_not_travel_again():
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile())
    tl.open_job(1, "job")
    rec = Recorder()
    submit(tl, rec, 1, task(1, 100, 100, 100, weight_b=(4096, 1)), block=256)
    submit(tl, rec, 1, task(2, 100, 100, 100, weight_b=(4096, 1)), block=256, after=1)
    submit(tl, rec, 1, task(3, 100, 100, 100, weight_b=(4096, 2)), block=256, after=2)
    first, again, updated = (t["bytes_down"] for t in records(sink, "tile"))
    assert first == updated == 2 * 100 * 100 * 4  # A's rows + the weight block
    assert again == 100 * 100 * 4  # only A's rows: the block is resident, same version


def test_a_block_that_is_both_operands_is_not_held_before_it_was_sent():
    """The diagonal tiles of W·Wᵀ: A and B are one weight block. The first time, both go
    (a board that holds nothing yet would get two references to nothing); then neither."""
    m, k = 100, 1000
    w = memoryview(np.ones((m, k), np.float32)).cast("B")
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile())
    tl.open_job(1, "job")
    admissions = []
    for gemm in (1, 2):
        t = make_task(Gemm(gemm=gemm, dtype="float32", ta=False, tb=True, m=m, n=m, k=k,
                           lda=k, ldb=k, segments=(w, w)))  # fmt: skip
        t.weights["a"] = t.weights["b"] = (0, 1)
        tl.submit(1, t, t.tiles(256), after=gemm - 1, host_s=0.0, place=admissions.extend,
                  done=lambda issue, end: None)  # fmt: skip
    (tile, _, first), (_, _, again) = admissions
    a, b = tile.operands()
    assert a.key == b.key
    assert not first.held and again.held == {a.key}
    assert [t["bytes_down"] for t in records(sink, "tile")] == [2 * m * k * 4, 0]


def test_a_gemm_id_used_again_before_the_first_ended_in_virtual_time():
    """Ids are unique among a job's GEMMs in flight, and a RESULT may go out before its
    GEMM ends in virtual time (another job holds the clock): an id may then come again.
    What waited on the first GEMM of that id still runs when it ends."""
    tl, _ = new_timeline()
    tl.add_device(0, "d0", profile(lat=0.0))
    tl.open_job(1, "one")
    tl.open_job(2, "two")
    times: dict[str, tuple[float, float]] = {}
    steps: list = []

    def send(job: int, label: str, t: GemmTask, after: int, host_s: float = 0.0) -> None:
        tl.submit(job, t, t.tiles(256), after=after, host_s=host_s, place=lambda placed: None,
                  done=lambda issue, end: times.__setitem__(label, (issue, end)))  # fmt: skip

    send(2, "other", task(9, 10, 10, 10), 0)  # job 2 then computes on the host
    send(1, "first 1", task(1, 100, 100, 100), 0)
    send(1, "2 after 1", task(2, 100, 100, 100), 1, host_s=0.1)
    send(1, "second 1", task(1, 100, 100, 100), 0)  # id 1 again
    tl.mark_step(1, 1, host_s=0.0, done=steps.append)
    tl.close_job(2)  # nothing holds the clock back any more
    assert [s.gemms for s in steps] == [3], "the step never closed"
    assert times["2 after 1"][0] == pytest.approx(times["first 1"][1] + 0.1)


def test_a_tile_without_weights_makes_room_by_evicting_resident_blocks():
    """A tile with no weight blocks changes the emulated memory only when it does not fit
    beside the blocks resident: then the least recently used go."""
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile(memory=200_000))
    tl.open_job(1, "job")
    admissions = []
    tasks = [task(1, 100, 100, 100, weight_b=(4096, 1)),  # B's 40 kB block stays
             task(2, 100, 100, 100),  # 120 kB: fits beside it
             task(3, 100, 100, 100, weight_b=(4096, 1)),  # B is resident
             task(4, 130, 130, 100),  # 171.6 kB: fits only without it
             task(5, 100, 100, 100, weight_b=(4096, 1))]  # fmt: skip
    for t in tasks:
        tl.submit(1, t, t.tiles(256), after=t.id - 1, host_s=0.0, done=lambda issue, end: None,
                  place=lambda placed: admissions.extend(adm for _, _, adm in placed))  # fmt: skip
    assert all(adm.fits for adm in admissions)
    assert [list(adm.evicted) for adm in admissions] == [[], [], [], [[4096, 100, 100, 100, 1]], []]
    assert [t["bytes_down"] for t in records(sink, "tile")] == [80_000, 80_000, 40_000,
                                                                104_000, 80_000]  # fmt: skip


def test_a_tile_that_does_not_fit_is_an_emulated_oom():
    tl, sink = new_timeline()
    tl.add_device(0, "tiny", profile(memory=50_000))
    tl.open_job(1, "job")
    t = task(1, 100, 100, 100)
    submit(tl, Recorder(), 1, t, block=256)
    (oom,) = records(sink, "oom")
    assert oom["need_bytes"] == 3 * 100 * 100 * 4 and oom["capacity_bytes"] == 50_000
    assert t.oom == 1 and len(records(sink, "tile")) == 1  # still computed


def test_shared_bottleneck_serialises_transfers_of_different_devices():
    with_nic, sink = new_timeline("round-robin", bottleneck=Bottleneck(MB, MB))
    alone, sink_alone = new_timeline("round-robin")
    for tl in (with_nic, alone):
        tl.add_device(0, "d0", profile(lat=0.0))
        tl.add_device(1, "d1", profile(lat=0.0))
        tl.open_job(1, "job")
        submit(tl, Recorder(), 1, task(1, 200, 100, 100), block=100)  # a tile each
    each = 2 * 100 * 100 * 4 / MB
    assert [t["down"][1] for t in records(sink_alone, "tile")] == pytest.approx([each, each])
    tiles = records(sink, "tile")
    assert [t["down"][1] for t in tiles] == pytest.approx([each, 2 * each])
    # the shared FIFO's spans are logged: one transfer after the other, each way
    nic_down = [t for tile in tiles for t in tile["nic_down"]]
    assert nic_down == pytest.approx([0, each, each, 2 * each])
    up = 100 * 100 * 4 / MB
    assert tiles[1]["nic_up"][0] == pytest.approx(
        max(tiles[0]["nic_up"][1], tiles[1]["compute"][1])
    )
    assert [t["nic_up"][1] - t["nic_up"][0] for t in tiles] == pytest.approx([up, up])
    assert all("nic_down" not in t for t in records(sink_alone, "tile"))


class EveryTileAfresh(Placement):
    """Greedy as the reference: every device's finish predicted afresh for every tile."""

    def placed(self, index: int) -> None:
        super().placed(index)
        self._kept = None


class Forgetful(dict):
    """Keeps nothing: as the timeline's ``Work`` cache, a new ``Work`` for every tile."""

    def __setitem__(self, key, value) -> None:
        pass


def test_greedy_places_as_it_would_predicting_every_device_afresh():
    """Greedy keeps its predictions while tiles ask the same and updates only the device
    that took one, and tiles alike share one ``Work`` across GEMMs; the log is the same,
    bit for bit, as predicting the whole fleet for a new ``Work`` for every tile: through
    throttling (speeds change), edge tiles and several GEMMs."""
    logs, placed = [], []
    for reference in (False, True):
        tl, sink = new_timeline()
        if reference:
            tl.placement = EveryTileAfresh("greedy")
            tl._works = Forgetful()
        # Pi 4s on three links: the sustained GEMM's operands stay on each device once
        # there (one broadcast block), so only the work's length decides who heats
        for i, link in enumerate(["ideal", "lan", "wifi"]):
            tl.add_device(i, f"rpi4-{i}", LINKS[link].apply(BUILTIN["rpi4"]))
        tl.open_job(1, "job")
        rec = Recorder()
        submit(tl, rec, 1, sustained(1, 4500), block=64)
        for g in (2, 3):
            submit(tl, rec, 1, task(g, 300, 500, 200), block=128, after=g - 1, host_s=0.01)
        tl.close_job(1)
        assert records(sink, "freq"), "the Pi 4s throttle"
        logs.append(sink.getvalue())
        placed.append([device for _, device in rec.placed])
    assert placed[0] == placed[1] and logs[0] == logs[1]


# --- jobs in virtual time --------------------------------------------------------------------


def test_coordinator_time_and_steps():
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile(lat=0.0))
    tl.open_job(1, "job")
    rec, steps = Recorder(), []
    submit(tl, rec, 1, task(1, 100, 100, 100), block=256)
    submit(tl, rec, 1, task(2, 100, 100, 100), block=256, after=1, host_s=0.5)
    tl.mark_step(1, 1, host_s=0.25, done=steps.append)
    submit(tl, rec, 1, task(3, 100, 100, 100), block=256, host_s=0.125)
    tl.mark_step(1, 2, host_s=0.0, done=steps.append)
    g = rec.ended[1][1] - rec.ended[1][0]  # each GEMM takes the same time here
    assert rec.ended[2] == pytest.approx((g + 0.5, 2 * g + 0.5))
    first, second = steps
    assert (first.t0, first.t1) == pytest.approx((0.0, 2 * g + 0.75))
    assert first.coord_s == pytest.approx(0.75) and first.gemms == 2
    assert (second.t0, second.t1) == pytest.approx((first.t1, first.t1 + 0.125 + g))
    assert second.coord_s == pytest.approx(0.125)
    coord = records(sink, "coord")
    assert [c["step"] for c in coord] == [1, 1, 2]


@pytest.mark.parametrize("one_first", [True, False])
def test_two_jobs_interleave_by_virtual_time_not_by_arrival(one_first):
    """Each GEMM here takes 0.86 s on the one device (0.8 s down, 20 ms compute, 40 ms
    up). Job 1 starts at 0, job 2 when it first issues (0.86). Job 1's second GEMM
    comes 1 s after its first (at 1.86), job 2's right after its own first (at 1.72):
    job 2's goes first on the device, whichever request reaches the emulator first."""
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile(lat=0.0))
    tl.open_job(1, "one")
    tl.open_job(2, "two")
    rec = Recorder()
    submit(tl, rec, 1, task(1, 100, 100, 1000), block=256)
    submit(tl, rec, 2, task(1, 100, 100, 1000), block=256)
    calls = [
        lambda: submit(tl, rec, 1, task(2, 100, 100, 1000), block=256, after=1, host_s=1.0),
        lambda: submit(tl, rec, 2, task(2, 100, 100, 1000), block=256, after=1),
    ]
    for call in calls if one_first else reversed(calls):
        call()
    for job in (1, 2):  # an open job could still issue before the last tiles
        tl.close_job(job)
    tiles = {(t["job"], t["gemm"]): t for t in records(sink, "tile")}
    each = 0.8 + 0.02 + 0.04
    assert tiles[1, 1]["down"] == pytest.approx([0.0, 0.8])
    assert tiles[2, 1]["down"][0] == pytest.approx(each)
    assert tiles[2, 2]["down"][0] == pytest.approx(2 * each)
    assert tiles[1, 2]["down"][0] == pytest.approx(2 * each + 0.8)  # queued behind job 2's
    assert tiles[1, 2]["down"][0] > each + 1.0


def test_two_jobs_issuing_at_the_same_time_tie_by_job_not_by_arrival():
    """Both jobs' GEMM 1 issue at the same virtual time: job 1's goes first however their
    messages arrived, so the log is the same bit for bit."""

    def run(first: int) -> str:
        tl, _ = new_timeline()
        tl.add_device(0, "d0", profile(lat=0.0))
        for job in (1, 2, 3):
            tl.open_job(job, f"job-{job}")
        rec = Recorder()
        submit(tl, rec, 3, task(5, 10, 10, 10), block=256)  # then job 3 holds the clock
        for job in (first, 3 - first):
            submit(tl, rec, job, task(1, 100, 100, 100), block=256, host_s=0.5)
        for job in (3, 1, 2):
            tl.close_job(job)
        return tl.log.digest()

    assert run(1) == run(2)


def test_a_job_that_has_not_issued_yet_holds_nobody_back():
    tl, _ = new_timeline()
    tl.add_device(0, "d0", profile())
    tl.open_job(1, "busy")
    tl.open_job(2, "loading its model")
    rec = Recorder()
    submit(tl, rec, 1, task(1, 100, 100, 100), block=256)
    assert 1 in rec.ended


def test_the_wall_seconds_the_clock_is_held_are_counted():
    tl, _ = new_timeline()
    wall = [100.0]
    tl.held_time = HeldTime(wall=lambda: wall[0])
    tl.add_device(0, "d0", profile())
    tl.open_job(1, "busy")
    tl.open_job(2, "idle")
    rec = Recorder()
    submit(tl, rec, 2, task(7, 10, 10, 10), block=256)
    wall[0] += 1.0
    assert not tl.held_time.held and tl.held_time.seconds() == 0.0
    submit(tl, rec, 1, task(1, 100, 100, 100), block=256)  # due, and job 2 holds it back
    assert tl.held_time.held
    wall[0] += 2.5
    assert tl.held_time.seconds() == pytest.approx(2.5)  # the wait so far
    tl.release_idle()
    wall[0] += 10.0
    assert not tl.held_time.held and tl.held_time.seconds() == pytest.approx(2.5)
    submit(tl, rec, 2, task(8, 100, 100, 100), block=256, after=7)
    assert tl.held_time.seconds() == pytest.approx(2.5)


def test_an_open_idle_job_holds_others_back_until_released():
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile())
    tl.open_job(1, "busy")
    tl.open_job(2, "idle")
    rec = Recorder()
    submit(tl, rec, 2, task(7, 10, 10, 10), block=256)  # job 2 starts, then computes
    submit(tl, rec, 1, task(1, 100, 100, 100), block=256)
    assert 1 not in rec.ended and len(rec.placed) == 1  # job 2 may still issue before it
    assert tl.blocked()
    assert tl.release_idle() == [2]
    assert 1 in rec.ended and not tl.blocked()
    end = rec.ended[1][1]
    submit(tl, rec, 2, task(8, 100, 100, 100), block=256, after=7)  # starts at the clock
    tl.close_job(1)
    late = records(sink, "gemm")[-1]
    assert late["job"] == 2 and late["issue"] == pytest.approx(end)


def test_same_calls_give_the_same_log_bit_for_bit():
    digests = set()
    for _ in range(2):
        tl, _sink = new_timeline()
        for i, name in enumerate(["rpi4", "orin-nano", "rpi4", "rpi5"]):
            tl.add_device(i, f"{name}-{i}", BUILTIN[name])
        tl.open_job(1, "job")
        rec = Recorder()
        for g in range(1, 6):
            submit(tl, rec, 1, task(g, 300, 500, 200), block=128, after=g - 1, host_s=0.01)
        digests.add(tl.log.digest())
    assert len(digests) == 1


def test_thermal_throttling_stretches_compute_and_is_logged():
    rpi4 = LINKS["ideal"].apply(BUILTIN["rpi4"])  # all compute: the board heats fastest
    assert rpi4.thermal, "the built-in rpi4 carries its thermal model"
    tl, sink = new_timeline()
    tl.add_device(0, "rpi4-0", rpi4)
    tl.open_job(1, "job")
    submit(tl, Recorder(), 1, sustained(1, 2000), block=64)  # 45 s of full load
    tiles = records(sink, "tile")
    durations = [x["compute"][1] - x["compute"][0] for x in tiles]
    freqs = [x["freq_mhz"] for x in tiles]
    assert freqs[0] == 1500 and min(freqs) < 1500
    slow = durations[freqs.index(min(freqs))]
    assert slow == pytest.approx(durations[0] * 1500 / min(freqs))
    changes = records(sink, "freq")
    assert changes and changes[0]["temp_c"] >= 80 and changes[0]["freq_mhz"] == 1000

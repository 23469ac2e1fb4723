"""The virtual clock: FIFOs per device and link, placement, residency, jobs in virtual time.

Every expected time here is worked out by hand from the analytic model
(2·m·n·k / flops; latency + bytes / bandwidth), so a wrong queueing rule
shows up as a wrong number, not as a vague inequality.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from morphling.devices.models.compute import GemmShape
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import BUILTIN, DeviceProfile
from morphling.proxy.emulator.partition import GemmTask, make_task
from morphling.proxy.vtime.engine import Clock, Fifo
from morphling.proxy.vtime.eventlog import EventLog, Tile
from morphling.proxy.vtime.placement import Placement
from morphling.proxy.vtime.timeline import Bottleneck, Timeline
from morphling.proxy.vtime.vdevice import Work
from morphling.proxy.wire.messages import Gemm

MB = 1e6


def profile(name: str = "t", *, flops: float = 1e9, bw: float = MB, lat: float = 0.001,
            memory: int = 1 << 30, thermal: dict | None = None) -> DeviceProfile:  # fmt: skip
    return DeviceProfile(
        name=name, flops=flops, memory_bytes=memory, dl_bw=bw, ul_bw=bw, dl_lat_s=lat,
        ul_lat_s=lat, kind="cpu", blas="test", source="test", thermal=thermal or {},
    )  # fmt: skip


def task(gemm: int, m: int, n: int, k: int, *, weight_b: tuple[int, int] | None = None
         ) -> GemmTask:  # fmt: skip
    a = np.ones((m, k), np.float32)
    b = np.ones((k, n), np.float32)
    request = Gemm(gemm=gemm, dtype="float32", ta=False, tb=False, m=m, n=n, k=k, lda=k, ldb=n,
                   segments=(memoryview(a).cast("B"), memoryview(b).cast("B")))  # fmt: skip
    t = make_task(request)
    if weight_b is not None:  # as if B lay in the shared weights at this offset, version
        t.weights["b"] = weight_b
    return t


def sustained(gemm: int, batch: int) -> GemmTask:
    """``batch`` pivots of one 64×64×65536 GEMM (22.6 ms on a Pi 4): a load that heats."""
    m = n = 64
    k = 65536
    a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
    segments = (memoryview(a).cast("B"), memoryview(b).cast("B"))
    return make_task(Gemm(gemm=gemm, dtype="float32", ta=False, tb=False, m=m, n=n, k=k, lda=k,
                          ldb=n, batch=batch, segments=segments))  # fmt: skip


class Recorder:
    """Collects what the timeline hands out: placements and GEMM ends."""

    def __init__(self) -> None:
        self.placed: list[tuple[int, int]] = []  # (tile id, device id)
        self.ended: dict[int, tuple[float, float]] = {}

    def place(self, placed):
        self.placed.extend((tile.id, device) for tile, device, _ in placed)

    def done_for(self, gemm_id: int):
        return lambda issue, end: self.ended.__setitem__(gemm_id, (issue, end))


def submit(tl: Timeline, rec: Recorder, job: int, t: GemmTask, block: int, *, after: int = 0,
           host_s: float = 0.0) -> None:  # fmt: skip
    tl.submit(job, t, t.tiles(block), after=after, host_s=host_s, place=rec.place,
              done=rec.done_for(t.id))  # fmt: skip


def records(sink: io.BytesIO, kind: str) -> list[dict]:
    return [r for r in map(json.loads, sink.getvalue().splitlines()) if r["ev"] == kind]


def new_timeline(policy: str = "greedy", level: str = "full", detail_steps: int = 1000,
                 **kw) -> tuple[Timeline, io.BytesIO]:  # fmt: skip
    sink = io.BytesIO()
    return Timeline(policy, log=EventLog(sink, level=level, detail_steps=detail_steps), **kw), sink


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
    """Tile 2 downloads while tile 1 computes, and computes when both are done."""
    tl, sink = new_timeline()
    tl.add_device(0, "d0", profile(flops=1e7))  # compute-bound: 0.2 s per 100³ tile, 81 ms down
    tl.open_job(1, "job")
    submit(tl, Recorder(), 1, task(1, 200, 100, 100), block=100)  # two tiles
    t1, t2 = records(sink, "tile")
    down = 0.001 + 2 * 100 * 100 * 4 / MB
    compute = 2 * 100**3 / 1e7
    assert t2["down"] == pytest.approx([down, 2 * down])  # behind tile 1 on the downlink
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
    assert [adm.evicted for adm in admissions] == [[], [], [], [[4096, 100, 100, 100, 1]], []]
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
        for i, (name, link) in enumerate([("rpi4", "ideal"), ("rpi4", "lan"),
                                          ("orin-nano", "lan"), ("rpi5", "wifi")]):  # fmt: skip
            tl.add_device(i, f"{name}-{i}", LINKS[link].apply(BUILTIN[name]))
        tl.open_job(1, "job")
        rec = Recorder()
        submit(tl, rec, 1, sustained(1, 1500), block=64)
        for g in (2, 3):
            submit(tl, rec, 1, task(g, 300, 500, 200), block=128, after=g - 1, host_s=0.01)
        tl.close_job(1)
        assert records(sink, "freq"), "the rpi4 on the ideal link throttles"
        logs.append(sink.getvalue())
        placed.append([device for _, device in rec.placed])
    assert placed[0] == placed[1] and logs[0] == logs[1]


def test_tile_records_are_what_write_would_give():
    """``EventLog.tile`` formats by hand and reuses the text of times it wrote before,
    matched by identity; every line is still exactly ``write``'s JSON of its ``Tile``."""
    t = [i / 7 + 1e-3 for i in range(12)]  # distinct floats
    gemm, other = (1, 7, 2), (2, 1, 1)  # job, GEMM, step
    work = Work(300, 40, GemmShape(10, 10, 10, False, False, 10, 10, "float32"))
    calls = [  # gemm, device, down, compute, up, MHz, °C
        (gemm, 0, (t[0], t[1]), (t[1], t[2]), (t[2], t[3]), 1500.0, 40.25),
        (gemm, 0, (t[1], t[4]), (t[5], t[6]), (t[7], t[8]), 1500.0, 41.0),  # after its last
        (gemm, 1, (t[0], t[9]), (t[9], t[10]), (t[10], t[11]), None, None),  # at the start
        (gemm, 0, (t[2], t[5]), (t[5], t[6]), (t[6], t[7]), 1000.0, 80.5),  # neither
        (other, 1, (float(repr(t[11])), t[3]), (t[3], t[4]), (t[4], t[5]), None, None),
    ]  # fmt: skip
    # spans on a shared bottleneck: none; both; none down (the operands were resident)
    nics = [(None, None), (None, None), ((t[0], t[9]), (t[10], t[11])), (None, (t[6], t[7]))]
    sink, reference = io.BytesIO(), io.BytesIO()
    log, written = EventLog(sink), EventLog(reference)
    for seq, (g, device, down, compute, up, mhz, temp) in enumerate(calls, 1):
        nic = nics[seq - 1] if seq <= len(nics) else (None, None)
        log.tile(log.tile_head(*g), seq, device, work, (down, compute, up), (mhz, temp), nic)
        job, number, step = g
        record = Tile(job, number, step, seq, device, 300, 40, down, compute, up, mhz, temp, *nic)
        written.write(record)
    assert sink.getvalue() == reference.getvalue()
    assert log.digest() == written.digest() and log.count == len(calls)


def test_every_record_of_a_run_is_what_write_would_give():
    """Tile, coordinator and GEMM records are formatted by hand; through steps, two jobs,
    throttling and an OOM, every line is still exactly ``write``'s JSON of its record."""
    tl, sink = new_timeline("round-robin")
    tl.add_device(0, "rpi4-0", LINKS["ideal"].apply(BUILTIN["rpi4"]))
    tl.add_device(1, "small", profile(memory=100_000))
    for job in (1, 2):
        tl.open_job(job, f"job-{job}")
    rec, steps = Recorder(), []
    submit(tl, rec, 1, sustained(1, 3000), block=64)  # heats the rpi4; the other is too small
    submit(tl, rec, 2, task(1, 300, 500, 200), block=128, host_s=0.01)
    tl.mark_step(1, 1, host_s=0.25, done=steps.append)
    submit(tl, rec, 1, task(2, 100, 100, 100), block=256, host_s=1 / 3)
    submit(tl, rec, 2, task(2, 300, 500, 200), block=128, after=1, host_s=0.02)
    for job in (1, 2):
        tl.close_job(job)
    lines = sink.getvalue().decode().splitlines()
    kinds = {json.loads(line)["ev"] for line in lines}
    assert kinds == {"tile", "coord", "gemm", "step", "freq", "oom"}
    for line in lines:
        assert line == json.dumps(json.loads(line), separators=(",", ":"))


def logged_run(level: str, **kw) -> tuple[EventLog, io.BytesIO]:
    """Two steps of one job on two devices at ``level``: the log and what it wrote."""
    tl, sink = new_timeline(level=level, **kw)
    tl.add_device(0, "rpi4-0", LINKS["ideal"].apply(BUILTIN["rpi4"]))
    tl.add_device(1, "d1", profile())
    tl.open_job(1, "job")
    rec, steps = Recorder(), []
    submit(tl, rec, 1, sustained(1, 3000), block=64)  # heats the rpi4: it throttles
    tl.mark_step(1, 1, host_s=0.25, done=steps.append)
    submit(tl, rec, 1, task(2, 300, 500, 200), block=128, host_s=0.125)
    submit(tl, rec, 1, task(3, 300, 500, 200), block=128, after=2, host_s=0.125)
    tl.mark_step(1, 2, host_s=0.0, done=steps.append)
    tl.close_job(1)
    return tl.log, sink


def test_levels_keep_what_they_say():
    """The same run at each level. ``steps`` keeps the step records as ``full`` writes
    them, and each device's totals per step: those of its tiles in the full log. ``off``
    keeps nothing, but counts the records: they tell the emulator the clock moved on."""
    (full, full_sink), (steps, steps_sink), (off, off_sink) = map(
        logged_run, ("full", "steps", "off")
    )
    assert records(steps_sink, "freq") and records(steps_sink, "freq") == records(full_sink, "freq")
    assert records(steps_sink, "step") == records(full_sink, "step")
    kinds = {r["ev"] for r in map(json.loads, steps_sink.getvalue().splitlines())}
    assert kinds == {"step", "device_step", "freq"}
    tiles, gemms = records(full_sink, "tile"), records(full_sink, "gemm")
    totals = records(steps_sink, "device_step")
    assert {(d["step"], d["device"]) for d in totals} == {(t["step"], t["device"]) for t in tiles}
    for d in totals:
        mine = [t for t in tiles if (t["step"], t["device"]) == (d["step"], d["device"])]
        assert d["tiles"] == len(mine)
        assert d["bytes_down"] == sum(t["bytes_down"] for t in mine)
        assert d["compute_s"] == pytest.approx(sum(t["compute"][1] - t["compute"][0] for t in mine))
        assert d["last_in"] == sum(
            1 for g in gemms if (g["step"], g["last_device"]) == (d["step"], d["device"])
        )
        last = max(mine, key=lambda t: t["compute"][0])
        assert (d["t"], d["freq_mhz"], d["temp_c"]) == (
            last["compute"][0], last["freq_mhz"], last["temp_c"])  # fmt: skip
    assert steps.count < full.count / 4
    assert off_sink.getvalue() == b"" and off.count == 0 and off.records == full.count


def test_auto_keeps_each_jobs_first_steps_whole_then_their_totals():
    """``auto`` keeps every record of a job's first ``detail_steps`` steps, as ``full``
    writes them, and of the later steps what ``steps`` keeps, the same records."""
    _, full = logged_run("full")
    _, steps = logged_run("steps")
    auto_log, auto = logged_run("auto", detail_steps=1)
    assert auto_log.detail(1) and not auto_log.detail(2)

    def lines(sink: io.BytesIO, keep) -> list[str]:
        return [line for line in sink.getvalue().decode().splitlines() if keep(json.loads(line))]

    # step 1 as full has it, step 2 as steps has it; the thermal steps of both
    expected = lines(full, lambda r: r.get("step") == 1 or r["ev"] == "freq")
    expected += lines(steps, lambda r: r.get("step") == 2)
    assert sorted(lines(auto, lambda r: True)) == sorted(expected)
    step_2 = {json.loads(line)["ev"] for line in lines(auto, lambda r: r.get("step") == 2)}
    assert step_2 == {"step", "device_step"}
    # every step in detail: auto is full
    assert logged_run("auto", detail_steps=2)[1].getvalue() == full.getvalue()


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

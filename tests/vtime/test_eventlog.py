"""The event log: its lines are the records ``vtime.eventlog`` defines, written as
``EventLog.write`` would (the hand-formatted ones too), the levels keep what they say, and
the report reads back exactly what the timeline wrote."""

from __future__ import annotations

import gzip
import io
import json
import math

import pytest
from morphling.devices.models.compute import GemmShape
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import BUILTIN
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.load import StepRange, load_run
from morphling.proxy.report.records import parse
from morphling.proxy.vtime.availability import Presence, Trace
from morphling.proxy.vtime.eventlog import (
    COMPONENTS,
    COMPRESSED_EVENTS_FILE,
    KINDS,
    RUN_FILE,
    RUN_FORMAT,
    EventLog,
    Gemm,
    Record,
    Tile,
    open_event_file,
    to_json,
)
from morphling.proxy.vtime.timeline import Bottleneck, Operation, Timeline
from morphling.proxy.vtime.vdevice import Work
from timeline_driver import (
    Recorder,
    conv_task,
    new_timeline,
    profile,
    records,
    submit,
    sustained,
    task,
)


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
    saved = [0, 0, 0, 300, 120]  # operand bytes held already: all of the fourth tile's, some
    sink, reference = io.BytesIO(), io.BytesIO()
    log, written = EventLog(sink), EventLog(reference)
    for seq, (g, device, down, compute, up, mhz, temp) in enumerate(calls, 1):
        nic = nics[seq - 1] if seq <= len(nics) else (None, None)
        held = Work(300 - saved[seq - 1], 40, work.shape, saved[seq - 1])
        log.tile(log.tile_head(*g), seq, device, held, (down, compute, up), (mhz, temp), nic)
        job, number, step = g
        record = Tile(
            job, number, step, seq, device, held.bytes_down, 40, down, compute, up, mhz, temp,
            *nic, bytes_saved=held.bytes_saved,
        )  # fmt: skip
        written.write(record)
    assert sink.getvalue() == reference.getvalue()
    assert log.digest() == written.digest() and log.count == len(calls)


def test_records_say_which_product_they_were_and_old_lines_were_gemms():
    """A convolution's tile and GEMM records carry its ``op``, formatted by hand exactly as
    ``write`` gives it; a GEMM's carry none, and a line without one (every run before
    convolutions) reads back as a GEMM's."""
    span = ((0.25, 0.5), (0.5, 0.75), (0.75, 1.0))
    work = Work(300, 40, GemmShape(10, 10, 10, False, False, 10, 10, "float32"))
    sink, reference = io.BytesIO(), io.BytesIO()
    log, written = EventLog(sink), EventLog(reference)
    for op in ("conv_grad_input", "gemm"):
        log.tile(log.tile_head(1, 7, 1, op), 3, 0, work, span, (None, None), (None, span[2]))
        written.write(Tile(1, 7, 1, 3, 0, 300, 40, *span, None, None, None, span[2], op=op))
        log.gemm(1, 7, 1, 0.25, 1.0, 1, (3, 0), (8, 512, 72, 1), op)
        written.write(Gemm(1, 7, 1, 0.25, 1.0, 1, 3, 0, 8, 512, 72, 1, op=op))
    assert sink.getvalue() == reference.getvalue()
    conv_tile, conv_gemm, gemm_tile, gemm_gemm = map(json.loads, sink.getvalue().splitlines())
    assert conv_tile["op"] == conv_gemm["op"] == "conv_grad_input"
    assert "op" not in gemm_tile and "op" not in gemm_gemm
    assert parse(Tile, gemm_tile).op == parse(Gemm, gemm_gemm).op == "gemm"


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


# --- the log read back by the report ---------------------------------------------------------

LINE_KINDS = ("tile", "gemm", "coord", "oom")  # the records a loaded run keeps


def line(record: Record) -> str:
    return json.dumps(to_json(record), separators=(",", ":"))


def test_the_report_reads_back_what_the_timeline_wrote(tmp_path):
    """A timeline writes a full log of two jobs on two devices behind a shared bottleneck
    (one throttles, the other is too small for a tile: OOMs) through the engine's file
    writer, and ``load_run`` reads it back through every check the report makes. Each line
    parses to the record of its kind and writes back to the same line; the records the
    report keeps are those lines; and what it computes from them is what the timeline said
    as it ran: each GEMM's issue and end, each tile's device, each step's times and totals,
    the busy time of each device's compute and of the shared FIFO."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sink = open_event_file(run_dir / COMPRESSED_EVENTS_FILE)
    # "small" is away for its first microsecond (an ``away`` record)
    away = Trace({"small": Presence(((1e-6, math.inf),))})
    tl = Timeline(
        "round-robin", log=EventLog(sink), bottleneck=Bottleneck(1e12, 5e11), availability=away
    )
    fleet = [("rpi4-0", LINKS["ideal"].apply(BUILTIN["rpi4"])), ("small", profile(memory=100_000))]
    for device, (name, p) in enumerate(fleet):
        tl.add_device(device, name, p)
    recorders, closed = {1: Recorder(), 2: Recorder()}, {}

    def mark(job: int, step: int, host_s: float) -> None:
        tl.mark_step(job, step, host_s=host_s, done=lambda t: closed.setdefault((job, t.step), t))

    for job in recorders:
        tl.open_job(job, f"job-{job}")
    submit(tl, recorders[1], 1, sustained(1, 3000), block=64)  # heats the rpi4
    submit(tl, recorders[2], 2, task(1, 300, 500, 200), block=128, host_s=0.01)
    mark(1, 1, host_s=0.25)
    submit(tl, recorders[1], 1, task(2, 100, 100, 100), block=256, host_s=1 / 3)
    submit(tl, recorders[2], 2, task(2, 300, 500, 200), block=128, after=1, host_s=0.02)
    submit(
        tl,
        recorders[2],
        2,
        conv_task(3, "forward", (2, 8, 12, 12), (8, 4, 3, 3), groups=2),
        block=8,
        after=2,
    )
    for job in recorders:  # the jobs as ranks 0 and 1 (on no device) in an all-reduce
        allreduce = Operation(("world", 1), "allreduce", 4096, (0, 1))
        tl.collective(job, job - 1, 9, allreduce, after=0, host_s=0.001, done=lambda *_: None)
    mark(2, 1, host_s=0.0)
    mark(1, 2, host_s=0.0)
    for job in recorders:
        tl.close_job(job)
    sink.close()
    devices = [
        {"id": i, **p.to_wire(), "name": name, "profile": p.name}
        for i, (name, p) in enumerate(fleet)
    ]
    meta = {"format": RUN_FORMAT, "version": 1, "policy": "round-robin", "block": 128,
            "coordinator_time": "model", "bottleneck": {"dl_bw": 1e12, "ul_bw": 5e11},
            "fleet": devices, "jobs": tl.job_names(), "event_log": "full",
            "event_file": COMPRESSED_EVENTS_FILE, "events": tl.log.count,
            "digest": tl.log.digest()}  # fmt: skip
    (run_dir / RUN_FILE).write_text(json.dumps(meta))

    lines = gzip.decompress((run_dir / COMPRESSED_EVENTS_FILE).read_bytes()).decode().splitlines()
    objects = [json.loads(text) for text in lines]
    assert {o["ev"] for o in objects} == set(KINDS) - {"device_step"}  # as a full log has
    for text, obj in zip(lines, objects, strict=True):
        assert line(parse(KINDS[obj["ev"]], obj)) == text
    run = load_run(run_dir, StepRange())
    kept = [*run.tiles, *run.gemms, *run.coords, *run.ooms]
    assert sorted(map(line, kept)) == sorted(
        t for t, o in zip(lines, objects, strict=True) if o["ev"] in LINE_KINDS
    )

    for job, rec in recorders.items():
        gemms = {g.gemm: (g.issue, g.end) for g in run.gemms if g.job == job}
        assert gemms == rec.ended
        tiles = sorted((t for t in run.tiles if t.job == job), key=lambda t: t.tile)
        assert [t.device for t in tiles] == [device for _, device in rec.placed]
    figures = {(s.job, s.step): s for s in run.steps}
    assert figures.keys() == closed.keys() == {(1, 1), (1, 2), (2, 1)}
    for key, times in closed.items():
        f = figures[key]
        assert (f.t0, f.t1, f.coord_s, f.gemm_s, f.gemms, f.tiles, f.oom) == (
            times.t0, times.t1, times.coord_s, times.gemm_s, times.gemms, times.tiles, times.oom
        )  # fmt: skip
        assert (f.bytes_down, f.bytes_up) == (times.link_down, times.link_up)
        assert f.critical == tuple(times.critical[c] for c in COMPONENTS)
    assert run.ooms and min(mhz for _, mhz, _ in run.thermal[0]) < 1500  # both happened

    summary = summarize(run)
    span = summary["totals"]["span_s"]
    assert span == tl.clock.now
    shared = summary["run"]["bottleneck"]
    assert shared["downlink_utilisation"] == pytest.approx(tl.nic_down.busy_s / span, rel=1e-12)
    assert shared["uplink_utilisation"] == pytest.approx(tl.nic_up.busy_s / span, rel=1e-12)
    for d in summary["devices"]:  # the FIFO summed durations, the report ends - starts
        assert d["busy_s"] == pytest.approx(tl.devices[d["id"]].compute.busy_s, rel=1e-9)


# --- op classes: what the coordinator did, and what the devices computed --------------------


def classified_run(run_dir, level: str) -> dict[int, object]:
    """Two steps of a job that splits its host time by op class, on two devices: a GEMM, a
    convolution, a step mark; then a GEMM issued after step 1's GEMM (so its coordinator
    span starts before step 2 and is cut at its start), a mark whose split is all GEMM.
    Written as a run directory at ``level``; its closed steps' times."""
    run_dir.mkdir()
    sink = open_event_file(run_dir / COMPRESSED_EVENTS_FILE)
    tl = Timeline("round-robin", log=EventLog(sink, level=level))
    fleet = [("d0", profile()), ("d1", profile())]
    for device, (name, p) in enumerate(fleet):
        tl.add_device(device, name, p)
    tl.open_job(1, "job")
    rec, closed = Recorder(), {}
    submit(tl, rec, 1, task(1, 300, 500, 200), block=128)
    submit(
        tl,
        rec,
        1,
        conv_task(2, "forward", (2, 8, 12, 12), (8, 8, 3, 3)),
        block=8,
        after=1,
        host_s=0.004,
        host_split={"elementwise": 3_000_000, "conv": 1_000_000},
    )
    tl.mark_step(1, 1, host_s=0.01, host_split={"optimizer": 9_000_000, "other": 1_000_000},
                 done=lambda t: closed.setdefault(t.step, t))  # fmt: skip
    submit(tl, rec, 1, task(3, 300, 500, 200), block=128, after=1, host_s=0.5,
           host_split={"normalization": 1, "softmax": 3})  # fmt: skip
    tl.mark_step(1, 2, host_s=0.002, host_split={"gemm": 2_000_000},
                 done=lambda t: closed.setdefault(t.step, t))  # fmt: skip
    tl.close_job(1)
    sink.close()
    devices = [
        {"id": i, **p.to_wire(), "name": name, "profile": p.name}
        for i, (name, p) in enumerate(fleet)
    ]
    meta = {"format": RUN_FORMAT, "version": 1, "policy": "round-robin", "block": 128,
            "coordinator_time": "model", "bottleneck": None, "fleet": devices,
            "jobs": tl.job_names(), "event_log": level, "event_file": COMPRESSED_EVENTS_FILE,
            "events": tl.log.count, "digest": tl.log.digest()}  # fmt: skip
    (run_dir / RUN_FILE).write_text(json.dumps(meta))
    return closed


def test_coordinator_time_by_op_class_and_device_work_by_op(tmp_path):
    """The engine divides each coordinator span among the job's op classes in proportion
    (a span cut at the step's start keeps its shares), sums them per step, and logs them
    on the span (``full``) or the step record (``steps``); the report reads the same
    figures to the bit from either, and each device's GEMM and convolution compute."""
    closed = classified_run(tmp_path / "full", "full")
    steps_closed = classified_run(tmp_path / "steps", "steps")
    one, two = closed[1], closed[2]
    # step 1: the convolution's 4 ms (3:1) and the mark's 10 ms (9:1), all classified
    assert one.coord_split == pytest.approx(
        {"elementwise": 0.003, "conv": 0.001, "optimizer": 0.009, "other": 0.001}, rel=1e-9
    )
    assert one.coord_s == pytest.approx(0.014) and one.product_s.keys() == {"gemm", "conv_forward"}
    # step 2: GEMM 3 is issued 0.5 s after GEMM 1 ended, in step 1: only the part after
    # step 2 starts is step 2's, divided 1:3 all the same; then the mark's 2 ms, all GEMM
    cut = two.coord_s - 0.002
    assert 0 < cut < 0.5
    assert two.coord_split["normalization"] == pytest.approx(cut / 4, rel=1e-12)
    assert two.coord_split["softmax"] == pytest.approx(3 * cut / 4, rel=1e-12)
    assert two.coord_split["gemm"] == pytest.approx(0.002, rel=1e-9)
    assert two.product_s.keys() == {"gemm"}
    coords = records(io.BytesIO(gzip.decompress((tmp_path / "full" / COMPRESSED_EVENTS_FILE)
                                                .read_bytes())), "coord")  # fmt: skip
    assert [c.get("split") for c in coords] == [
        {"elementwise": 3_000_000, "conv": 1_000_000},
        {"optimizer": 9_000_000, "other": 1_000_000},
        {"normalization": 1, "softmax": 3},
        {"gemm": 2_000_000},
    ]

    runs = {level: load_run(tmp_path / level, StepRange()) for level in ("full", "steps")}
    for level, times in (("full", closed), ("steps", steps_closed)):
        for f in runs[level].steps:
            assert f.coord_split == times[f.step].coord_split  # to the bit
            assert f.product_s == times[f.step].product_s
    full_run, steps_run = runs["full"], runs["steps"]
    assert [s.work for s in full_run.steps] == [s.work for s in steps_run.steps]
    (d0, d1) = (full_run.devices[0], full_run.devices[1])
    conv_tiles = [t for t in full_run.tiles if t.op == "conv_forward"]
    assert conv_tiles and {t.device for t in conv_tiles} == {0, 1}
    for device in (d0, d1):
        assert 0 < device.conv_s < device.busy_s
    for d, figures in full_run.devices.items():
        mine = [t for t in conv_tiles if t.device == d]
        assert figures.conv_s == sum(t.compute[1] - t.compute[0] for t in mine)
        assert steps_run.devices[d].conv_s == pytest.approx(figures.conv_s, rel=1e-12)
    step1 = {d: (gemm, conv, link) for d, gemm, conv, link, *_ in full_run.steps[0].work}
    assert all(gemm > 0 and conv > 0 and link > 0 for gemm, conv, link in step1.values())

"""What the reports show of a loaded run: steps, devices, stragglers, critical paths.

``summarize`` computes the figures that ``summary.json``, the text, the trace and the plots
all share (``docs/REPORTS.md`` has their definitions), as JSON-ready data shaped as
``summary`` says.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import cast, get_args

from morphling.proxy.vtime.eventlog import (
    COMPONENTS,
    GEMM_OP,
    Coord,
    Gemm,
    attribute,
    critical_breakdown,
)

from .load import DeviceFigures, Run, Sample, StepFigures, segment_span
from .records import FORMAT_VERSION
from .summary import (
    Bottleneck,
    ByClass,
    CollectiveRow,
    Collectives,
    CriticalPath,
    Detail,
    DeviceBytes,
    DeviceRow,
    DeviceTime,
    JobRow,
    OomRow,
    Ooms,
    PathSegment,
    RunInfo,
    Shown,
    StepRow,
    Straggler,
    Stragglers,
    Summary,
    Summed,
    Sums,
    Totals,
    Untimed,
    VerificationInfo,
)

# A device straggles when, over the GEMMs it takes part in, it finishes on average this
# fraction of the GEMM's duration after the median device: each such GEMM would have been
# that much shorter had it kept pace with the median.
STRAGGLER_LATENESS = 0.2
STRAGGLER_DEFINITION = (
    "mean over the GEMMs a device takes part in (with at least one other device) of "
    "(its last tile back - the median device's last tile back) / the GEMM's duration, "
    f">= {STRAGGLER_LATENESS}"
)
BREAKDOWN = ("coordinator_s", *COMPONENTS, "unattributed_s")
_SUMMED: tuple[Summed, ...] = get_args(Summed)
OTHER_STEPS = (
    "morphling report RUN_DIR --detail-steps A:B (or all): other steps the log has tiles for"
)
# The coordinator's op classes for the products it computed itself; any other is "other".
COORD_GEMM, COORD_CONV = "gemm", "conv"
BY_CLASS = tuple(ByClass.__annotations__)
# Why coordinator time has no op class: it was measured, or the job did not say.
MEASURED = "measured coordinator time: --coordinator-time measured"
UNSPLIT = "the job sent no op classes for it: no host_split"
LOCAL_NOTE = (
    "products the script kept on the host (too small, an unsupported dtype, ...) are in its "
    "coordinator time, by class where it splits it; the run's per-step table says why each "
    "was kept"
)


def summarize(run: Run) -> Summary:
    """Everything the reports show, as JSON-ready data (``summary.json``)."""
    jobs = _jobs(run)
    devices = _devices(run)
    totals = Totals(
        **_sums(jobs),
        by_class=_class_sums([cast(dict[str, float], j["by_class"]) for j in jobs]),
        span_s=run.span_s,
        steps=sum(len(j["steps"]) for j in jobs),
        devices=len(devices),
        mean_utilisation=statistics.fmean(d["utilisation"] for d in devices),
    )
    names = {d.id: d.name for d in run.fleet}
    bottleneck = None
    if run.bottleneck is not None:
        every = run.every_step_logged  # the bottleneck's busy time needs every tile
        bottleneck = Bottleneck(
            parameters=run.bottleneck,
            downlink_utilisation=_share(run.nic_busy_s[0], run) if every else None,
            uplink_utilisation=_share(run.nic_busy_s[1], run) if every else None,
        )
    info = RunInfo(
        path=str(run.path),
        policy=run.policy,
        block=run.block,
        auto_block=run.auto_block,
        coordinator_time=run.coordinator_time,
        event_log=run.level,
        detail=_detail(run),
        bottleneck=bottleneck,
        command=list(run.command),
        incomplete=run.incomplete,
        verification=None
        if (v := run.verification) is None
        else VerificationInfo(
            mode=v.mode,
            checked=v.checked,
            wrong=v.wrong,
            screened_out=v.screened_out,
            sampled_out=v.sampled_out,
            check_errors=v.check_errors,
            quarantines=[dict(q) for q in v.quarantines],
        ),
    )
    ooms = [
        OomRow(
            job=o.job,
            step=o.step,
            gemm=o.gemm,
            tile=o.tile,
            device=o.device,
            device_name=names[o.device],
            t=o.t,
            need_bytes=o.need_bytes,
            capacity_bytes=o.capacity_bytes,
        )
        for o in sorted(run.ooms, key=lambda o: (o.t, o.device, o.tile))
    ]
    return Summary(
        version=FORMAT_VERSION,
        run=info,
        totals=totals,
        untimed=_untimed(run, jobs, totals),
        jobs=jobs,
        devices=devices,
        stragglers=Stragglers(
            definition=STRAGGLER_DEFINITION,
            threshold=STRAGGLER_LATENESS,
            # a steps log has no device's finish within a GEMM
            devices=None if run.logged is None else _stragglers(run, devices),
        ),
        ooms=Ooms(count=len(run.ooms), events=ooms),
        collectives=Collectives(algorithm=run.collective, rows=_collectives(run)),
    )


def _collectives(run: Run) -> list[CollectiveRow]:
    """Each rank's collectives over the steps shown, summed by kind."""
    names = {j.id: j.name for j in run.jobs}
    rows: dict[tuple[int, str], CollectiveRow] = {}
    for c in run.collectives:
        row = rows.get((c.job, c.op))
        if row is None:
            row = rows[c.job, c.op] = CollectiveRow(
                job=c.job, name=names[c.job], op=c.op, count=0, bytes=0, network_s=0.0,
                waited_s=0.0,
            )  # fmt: skip
        row["count"] += 1
        row["bytes"] += c.nbytes
        row["network_s"] += c.end - c.ready
        row["waited_s"] += c.ready - c.t
    return [rows[key] for key in sorted(rows)]


def _stragglers(run: Run, devices: list[DeviceRow]) -> list[Straggler]:
    """The devices late by ``STRAGGLER_LATENESS`` or more, latest first; ``last_in`` over
    the GEMMs whose tiles the log has, as ``gemms`` is."""
    late = []
    for d in devices:
        lateness, gemms, expected = d["lateness"], d["gemms"], d["expected_last"]
        if lateness is not None and lateness >= STRAGGLER_LATENESS:
            assert gemms is not None and expected is not None  # a log with tiles: they are
            last_in = run.devices[d["id"]].last_in_detail
            late.append(
                Straggler(
                    id=d["id"],
                    name=d["name"],
                    lateness=lateness,
                    gemms=gemms,
                    last_in=last_in,
                    expected_last=expected,
                )
            )
    return sorted(late, key=lambda d: -d["lateness"])


def _detail(run: Run) -> Detail:
    """Which steps the log has tiles for, which the trace, the timeline and the segments
    show, and how to see others."""
    shown: dict[int, list[int]] = defaultdict(list)
    for s in run.steps:
        if run.shows(s.step):
            shown[s.job].append(s.step)
    return Detail(
        logged=None if run.logged is None else str(run.logged),
        every_step_logged=run.every_step_logged,
        window=str(run.window),
        shown=[
            Shown(job=job, first=min(steps), last=max(steps), steps=len(steps))
            for job, steps in sorted(shown.items())
        ],
        others=OTHER_STEPS,
    )


def _untimed(run: Run, jobs: list[JobRow], totals: Totals) -> Untimed:
    """The coordinator time no op class accounts for, and why; the products kept local."""
    steps = [s for j in jobs for s in j["steps"]]
    unclassified = totals["by_class"]["coordinator_unclassified_s"]
    reason = None
    if unclassified > 0:
        reason = MEASURED if run.coordinator_time == "measured" else UNSPLIT
    return Untimed(
        coordinator_unclassified_s=unclassified,
        steps=sum(1 for s in steps if s["critical_path"]["by_class"]["coordinator_unclassified_s"]),
        reason=reason,
        local_gemms=totals["local_gemms"],
        local_note=LOCAL_NOTE,
    )


def _share(busy_s: float, run: Run) -> float:
    return busy_s / run.span_s if run.span_s > 0 else 0.0


def _sums(rows: Sequence[Sums]) -> Sums:
    """Each summed figure (``Summed``) over ``rows``: a job's steps, or the run's jobs."""
    return cast(Sums, {key: sum(row[key] for row in rows) for key in _SUMMED})


def _class_sums(rows: Sequence[dict[str, float]]) -> ByClass:
    """Each ``ByClass`` figure over ``rows``: a job's steps, or the run's jobs."""
    return cast(ByClass, {key: math.fsum(row[key] for row in rows) for key in BY_CLASS})


def _residue(seconds: float, of: float) -> float:
    """``seconds``, or 0 when it is a rounding residue of a difference within ``of``: not
    a "-0.0000 s" in the text."""
    return 0.0 if abs(seconds) <= 1e-9 * abs(of) else seconds


def _by_class(s: StepFigures) -> ByClass:
    """A step's time by op class: its products' by ``op`` (GEMM, or a convolution's), its
    coordinator's by the job's classes (``COORD_GEMM``, ``COORD_CONV``, the rest other),
    and what the job did not split."""
    split = s.coord_split
    others = (seconds for op, seconds in split.items() if op not in (COORD_GEMM, COORD_CONV))
    return ByClass(
        fleet_gemm_s=s.product_s.get(GEMM_OP, 0.0),
        fleet_conv_s=math.fsum(sec for op, sec in s.product_s.items() if op != GEMM_OP),
        coordinator_gemm_s=split.get(COORD_GEMM, 0.0),
        coordinator_conv_s=split.get(COORD_CONV, 0.0),
        coordinator_other_s=math.fsum(others),
        coordinator_unclassified_s=_residue(s.coord_s - math.fsum(split.values()), s.coord_s),
    )


def _device_time(gemm_s: float, conv_s: float, link_s: float, span_s: float) -> DeviceTime:
    """A device's time over ``span_s``; its links overlap its compute when it downloads a
    tile while computing another, so ``waiting_s`` (the rest) is a lower bound, at least 0."""
    waiting = _residue(span_s - gemm_s - conv_s - link_s, span_s)
    return DeviceTime(gemm_s=gemm_s, conv_s=conv_s, link_s=link_s, waiting_s=max(0.0, waiting))


def _fleet_time(times: Iterable[DeviceTime]) -> DeviceTime:
    """Devices' times summed: device-seconds."""
    rows = [cast(dict[str, float], t) for t in times]
    return cast(
        DeviceTime, {key: math.fsum(t[key] for t in rows) for key in DeviceTime.__annotations__}
    )


def _jobs(run: Run) -> list[JobRow]:
    """Per job, its steps (with their critical paths) and their sums."""
    names = {d.id: d.name for d in run.fleet}
    segments = _segments(run, names)
    rows: dict[int, list[StepRow]] = defaultdict(list)
    for s in run.steps:
        emulated_s = s.t1 - s.t0
        breakdown = {"coordinator_s": s.coord_s, **dict(zip(COMPONENTS, s.critical, strict=True))}
        # step time no GEMM or coordinator span covers: 0 unless the step is incomplete (a
        # rounding residue of the sum is 0 too, not a "-0.0000 s" in the text)
        unattributed = emulated_s - sum(breakdown.values())
        breakdown["unattributed_s"] = 0.0 if abs(unattributed) < 1e-9 else unattributed
        by_class = _by_class(s)
        times = {
            names[d]: _device_time(gemm, conv, link, emulated_s)
            for d, gemm, conv, link, *_ in s.work
        }
        moved = {
            names[d]: DeviceBytes(down=down, up=up, saved=saved)
            for d, _, _, _, down, up, saved in s.work
            if down or up or saved
        }
        path = CriticalPath(
            breakdown=breakdown,
            by_class={
                **cast(dict[str, float], by_class),
                "unattributed_s": breakdown["unattributed_s"],
            },
            ops={"fleet": s.product_s, "coordinator": s.coord_split},
            devices={names[d]: n for d, n in s.last_in},
            segments=segments.get((s.job, s.step)) if run.shows(s.step) else None,
        )
        row = StepRow(
            job=s.job,
            step=s.step,
            complete=s.complete,
            t0=s.t0,
            t1=s.t1,
            emulated_s=emulated_s,
            coordinator_s=s.coord_s,
            gemm_s=s.gemm_s,
            gemms=s.gemms,
            local_gemms=s.local_gemms,
            tiles=s.tiles,
            bytes_down=s.bytes_down,
            bytes_up=s.bytes_up,
            oom=s.oom,
            bytes_saved=s.bytes_saved,
            bytes_bound=s.bytes_bound,
            critical_path=path,
            device_time=_fleet_time(times.values()),
            devices=times if run.shows(s.step) else None,
            device_bytes=moved,
        )
        rows[s.job].append(row)
    return [
        JobRow(
            id=job.id,
            name=job.name,
            **_sums(rows[job.id]),
            by_class=_class_sums([s["critical_path"]["by_class"] for s in rows[job.id]]),
            steps=rows[job.id],
        )
        for job in run.jobs
    ]


def _segments(run: Run, names: dict[int, str]) -> dict[tuple[int, int], list[PathSegment]]:
    """The critical path of each step shown tile by tile: its coordinator spans and its
    GEMMs (each followed along its critical tile), in order."""
    tiles = {(t.job, t.gemm, t.tile): t for t in run.tiles}
    paths: dict[tuple[int, int], list[PathSegment]] = defaultdict(list)
    segments: list[Gemm | Coord] = [*run.gemms, *run.coords]
    for seg in sorted(segments, key=segment_span):
        path = paths[seg.job, seg.step]
        if isinstance(seg, Coord):
            span: PathSegment = {"kind": "coordinator", "t0": seg.t0, "t1": seg.t1}
            if seg.split is not None:
                span["ops"] = attribute(seg.t1 - seg.t0, seg.split)
            path.append(span)
        elif seg.last_tile is not None:  # an empty GEMM takes no time on the fleet
            tile = tiles[seg.job, seg.gemm, seg.last_tile]
            segment: PathSegment = {
                "kind": "gemm" if seg.op == GEMM_OP else "conv",
                "op": seg.op,
                "gemm": seg.gemm,
                "t0": seg.issue,
                "t1": seg.end,
                "tile": tile.tile,
                "device": tile.device,
                "device_name": names[tile.device],
            }
            segment.update(critical_breakdown(seg.issue, tile.down, tile.compute, tile.up))
            path.append(segment)
    return paths


def _devices(run: Run) -> list[DeviceRow]:
    """Per device: work, utilisation of compute and links, thermal state; and, over the
    steps whose tiles the log has (none in a ``steps`` log), GEMMs and lateness."""
    tiled = run.logged is not None
    rows = []
    for d in run.fleet:
        f = run.devices.get(d.id, DeviceFigures())
        samples = run.thermal.get(d.id, [])
        temps = [temp for _, _, temp in samples if temp is not None]
        top, below = _below_top(samples, f.top_freq_mhz, run.span_s)
        rows.append(
            DeviceRow(
                id=d.id,
                name=d.name,
                profile=d.profile,
                kind=d.kind,
                tiles=f.tiles,
                busy_s=f.busy_s,
                utilisation=_share(f.busy_s, run),
                downlink_utilisation=_share(f.down_s, run),
                uplink_utilisation=_share(f.up_s, run),
                bytes_down=f.bytes_down,
                bytes_up=f.bytes_up,
                bytes_saved=f.bytes_saved,
                time=_device_time(f.busy_s - f.conv_s, f.conv_s, f.down_s + f.up_s, run.span_s),
                final_temp_c=temps[-1] if temps else None,
                top_freq_mhz=top,
                below_top_s=below,
                gemms=f.gemms if tiled else None,
                last_in=f.last_in,
                expected_last=f.expected_last if tiled else None,
                lateness=f.lateness,
            )
        )
    return rows


def _below_top(
    samples: list[Sample], top: float | None, span_s: float
) -> tuple[float | None, float | None]:
    """(top MHz, seconds below it): the device starts at its top (highest logged) frequency
    and holds each logged frequency until the next one."""
    if top is None:
        return None, None
    below, now, mhz_now = 0.0, 0.0, top
    for t, mhz in [*((t, mhz) for t, mhz, _ in samples if mhz is not None), (span_s, top)]:
        if mhz_now < top:
            below += t - now
        now, mhz_now = t, mhz
    return top, below

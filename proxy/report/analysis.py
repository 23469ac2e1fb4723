"""What the reports show of a loaded run: steps, devices, stragglers, critical paths.

``summarize`` computes the figures that ``summary.json``, the text, the trace and the plots
all share (``docs/REPORTS.md`` has their definitions), as JSON-ready data.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from morphling.proxy.vtime.eventlog import COMPONENTS, Coord, Gemm, critical_breakdown

from .load import DeviceFigures, Run, Sample, segment_span
from .records import FORMAT_VERSION

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
_SUMMED = (
    "emulated_s",
    "coordinator_s",
    "gemm_s",
    "gemms",
    "local_gemms",
    "tiles",
    "bytes_down",
    "bytes_up",
    "oom",
)
OTHER_STEPS = (
    "morphling report RUN_DIR --detail-steps A:B (or all): other steps the log has tiles for"
)


def summarize(run: Run) -> dict[str, Any]:
    """Everything the reports show, as JSON-ready data (``summary.json``)."""
    jobs = _jobs(run)
    devices = _devices(run)
    totals = _sum_rows(jobs, _SUMMED)
    totals.update(
        span_s=run.span_s,
        steps=sum(len(j["steps"]) for j in jobs),
        devices=len(devices),
        mean_utilisation=statistics.fmean(d["utilisation"] for d in devices),
    )
    names = {d.id: d.name for d in run.fleet}
    info: dict[str, Any] = {
        "path": str(run.path),
        "policy": run.policy,
        "block": run.block,
        "coordinator_time": run.coordinator_time,
        "event_log": run.level,
        "detail": _detail(run),
        "bottleneck": run.bottleneck,
        "command": list(run.command),
        "incomplete": run.incomplete,
    }
    every = run.every_step_logged  # the bottleneck's busy time needs every tile
    if run.bottleneck is not None:
        info["bottleneck"] = {
            "parameters": run.bottleneck,
            "downlink_utilisation": _share(run.nic_busy_s[0], run) if every else None,
            "uplink_utilisation": _share(run.nic_busy_s[1], run) if every else None,
        }
    return {
        "version": FORMAT_VERSION,
        "run": info,
        "totals": totals,
        "jobs": jobs,
        "devices": devices,
        "stragglers": {
            "definition": STRAGGLER_DEFINITION,
            "threshold": STRAGGLER_LATENESS,
            # a steps log has no device's finish within a GEMM
            "devices": None if run.logged is None else _stragglers(run, devices),
        },
        "ooms": {
            "count": len(run.ooms),
            "events": [
                {
                    "job": o.job,
                    "step": o.step,
                    "gemm": o.gemm,
                    "tile": o.tile,
                    "device": o.device,
                    "device_name": names[o.device],
                    "t": o.t,
                    "need_bytes": o.need_bytes,
                    "capacity_bytes": o.capacity_bytes,
                }
                for o in sorted(run.ooms, key=lambda o: (o.t, o.device, o.tile))
            ],
        },
    }


def _stragglers(run: Run, devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The devices late by ``STRAGGLER_LATENESS`` or more, latest first; ``last_in`` over
    the GEMMs whose tiles the log has, as ``gemms`` is."""
    late = [d for d in devices if (d["lateness"] or 0.0) >= STRAGGLER_LATENESS]
    return [
        {"id": d["id"], "name": d["name"], "lateness": d["lateness"], "gemms": d["gemms"],
         "last_in": run.devices[d["id"]].last_in_detail, "expected_last": d["expected_last"]}
        for d in sorted(late, key=lambda d: -d["lateness"])
    ]  # fmt: skip


def _detail(run: Run) -> dict[str, Any]:
    """Which steps the log has tiles for, which the trace, the timeline and the segments
    show, and how to see others."""
    shown: dict[int, list[int]] = defaultdict(list)
    for s in run.steps:
        if run.shows(s.step):
            shown[s.job].append(s.step)
    return {
        "logged": None if run.logged is None else str(run.logged),
        "every_step_logged": run.every_step_logged,
        "window": str(run.window),
        "shown": [
            {"job": job, "first": min(steps), "last": max(steps), "steps": len(steps)}
            for job, steps in sorted(shown.items())
        ],
        "others": OTHER_STEPS,
    }


def _share(busy_s: float, run: Run) -> float:
    return busy_s / run.span_s if run.span_s > 0 else 0.0


def _sum_rows(rows: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    return {k: sum(r[k] for r in rows) for k in keys}


def _jobs(run: Run) -> list[dict[str, Any]]:
    """Per job, its steps (with their critical paths) and their sums."""
    names = {d.id: d.name for d in run.fleet}
    segments = _segments(run, names)
    rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in run.steps:
        breakdown = {"coordinator_s": s.coord_s, **dict(zip(COMPONENTS, s.critical, strict=True)),
                     "unattributed_s": 0.0}  # fmt: skip
        # step time no GEMM or coordinator span covers: 0 unless the step is incomplete
        breakdown["unattributed_s"] = (s.t1 - s.t0) - sum(breakdown.values())
        rows[s.job].append({
            "job": s.job, "step": s.step, "complete": s.complete, "t0": s.t0, "t1": s.t1,
            "emulated_s": s.t1 - s.t0, "coordinator_s": s.coord_s, "gemm_s": s.gemm_s,
            "gemms": s.gemms, "local_gemms": s.local_gemms, "tiles": s.tiles,
            "bytes_down": s.bytes_down, "bytes_up": s.bytes_up, "oom": s.oom,
            "critical_path": {
                "breakdown": breakdown,
                "devices": {names[d]: n for d, n in s.last_in},
                "segments": segments.get((s.job, s.step)) if run.shows(s.step) else None,
            },
        })  # fmt: skip
    return [
        {"id": job.id, "name": job.name, **_sum_rows(rows[job.id], _SUMMED),
         "steps": rows[job.id]}
        for job in run.jobs
    ]  # fmt: skip


def _segments(run: Run, names: dict[int, str]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The critical path of each step shown tile by tile: its coordinator spans and its
    GEMMs (each followed along its critical tile), in order."""
    tiles = {(t.job, t.gemm, t.tile): t for t in run.tiles}
    paths: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    segments: list[Gemm | Coord] = [*run.gemms, *run.coords]
    for seg in sorted(segments, key=segment_span):
        path = paths[seg.job, seg.step]
        if isinstance(seg, Coord):
            path.append({"kind": "coordinator", "t0": seg.t0, "t1": seg.t1})
        elif seg.last_tile is not None:  # an empty GEMM takes no time on the fleet
            tile = tiles[seg.job, seg.gemm, seg.last_tile]
            path.append({
                "kind": "gemm", "gemm": seg.gemm, "t0": seg.issue, "t1": seg.end,
                "tile": tile.tile, "device": tile.device, "device_name": names[tile.device],
                **critical_breakdown(seg.issue, tile.down, tile.compute, tile.up),
            })  # fmt: skip
    return paths


def _devices(run: Run) -> list[dict[str, Any]]:
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
            {
                "id": d.id,
                "name": d.name,
                "profile": d.profile,
                "kind": d.kind,
                "tiles": f.tiles,
                "busy_s": f.busy_s,
                "utilisation": _share(f.busy_s, run),
                "downlink_utilisation": _share(f.down_s, run),
                "uplink_utilisation": _share(f.up_s, run),
                "bytes_down": f.bytes_down,
                "bytes_up": f.bytes_up,
                "final_temp_c": temps[-1] if temps else None,
                "top_freq_mhz": top,
                "below_top_s": below,
                "gemms": f.gemms if tiled else None,
                "last_in": f.last_in,
                "expected_last": f.expected_last if tiled else None,
                "lateness": f.lateness,
            }
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

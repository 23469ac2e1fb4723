"""A run as a Chrome trace (the JSON Perfetto and chrome://tracing open).

One process per job (tracks: steps, GEMMs, coordinator; a rank's also its collectives,
with a flow from the part of the member that started each to every other member's)
listed first, then one per device (tracks: downlink, compute, uplink; counters for
temperature and frequency; OOMs as instant events), then the shared bottleneck when the
run had one. Complete
("X") events carry ts and dur in microseconds of virtual time. The trace covers the
steps the run was loaded for (``Run.window``: by default each job's first 50): their
tiles, GEMMs and coordinator spans where the log has them, and the OOMs and thermal
states of their time. Events are generated one at a time and streamed to the file.
From a ``steps`` log there are no tiles, GEMMs or coordinator spans: the header says so.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

from morphling.proxy.vtime.engine import Span
from morphling.proxy.vtime.eventlog import CollectivePart, attribute

from .load import Run, StepFigures, steps_text

US_PER_S = 1e6
DOWNLINK, COMPUTE, UPLINK = 1, 2, 3
STEPS, GEMMS, COORDINATOR, COLLECTIVES = 1, 2, 3, 4
JOB_THREADS = {STEPS: "steps", GEMMS: "GEMMs", COORDINATOR: "coordinator"}
RANK_THREADS = JOB_THREADS | {COLLECTIVES: "collectives"}
DEVICE_THREADS = {DOWNLINK: "downlink", COMPUTE: "compute", UPLINK: "uplink"}
NIC_THREADS = {DOWNLINK: "downlink", UPLINK: "uplink"}
Event = dict[str, object]  # a trace event, as JSON


def _x(
    name: str, cat: str, thread: tuple[int, int], span: Span, args: Mapping[str, object]
) -> Event:
    """A complete event on ``thread`` (pid, tid) over ``span``."""
    (pid, tid), (t0, t1) = thread, span
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": t0 * US_PER_S,
        "dur": (t1 - t0) * US_PER_S,
        "args": args,
    }


def _process(pid: int, name: str, order: int, threads: dict[int, str]) -> Iterator[Event]:
    """Metadata naming a process and its threads, and its place in the list."""
    yield {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
    yield {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": order}}
    for tid, thread in threads.items():
        yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}


def _pids(run: Run) -> tuple[dict[int, int], dict[int, int], int]:
    """(job id -> pid, device id -> pid, bottleneck pid): jobs first, in log order."""
    jobs = {j.id: i for i, j in enumerate(run.jobs, 1)}
    devices = {d.id: i for i, d in enumerate(run.fleet, len(jobs) + 1)}
    return jobs, devices, len(jobs) + len(devices) + 1


def trace_events(run: Run) -> Iterator[Event]:
    """Every trace event of the run, metadata first."""
    job_pid, device_pid, nic_pid = _pids(run)
    ranks = {c.job for c in run.collectives}
    for job in run.jobs:
        pid = job_pid[job.id]
        threads = RANK_THREADS if job.id in ranks else JOB_THREADS
        yield from _process(pid, f"job {job.id}: {job.name}", pid, threads)
    # a replayed rank's device that mirrors a timed one's has its times: shown once, there
    mirrored = {m for mirrors in run.mirrors.values() for m in mirrors}
    for d in run.fleet:
        if d.id in mirrored:
            continue
        pid = device_pid[d.id]
        yield from _process(pid, f"device {d.id}: {d.name} ({d.profile})", pid, DEVICE_THREADS)
    if run.bottleneck is not None:
        yield from _process(nic_pid, "shared bottleneck", nic_pid, NIC_THREADS)

    steps = _steps(run)
    for s in steps:
        counts = {"gemms": s.gemms, "local_gemms": s.local_gemms}
        yield _x(f"step {s.step}", "step", (job_pid[s.job], STEPS), (s.t0, s.t1), counts)
    for g in run.gemms:
        name = f"{g.op} {g.gemm} ({g.m}×{g.n}×{g.k}, batch {g.batch})"  # gemm or conv_*
        last = {"last_tile": g.last_tile, "last_device": g.last_device}
        about = {"step": g.step, "tiles": g.tiles} | last
        yield _x(name, "gemm", (job_pid[g.job], GEMMS), (g.issue, g.end), about)
    for c in run.coords:
        thread = (job_pid[c.job], COORDINATOR)
        args: dict[str, object] = {"step": c.step}
        if c.split is not None:  # the job's op classes, seconds of this span
            args["ops"] = attribute(c.t1 - c.t0, c.split)
        yield _x("coordinator", "coordinator", thread, (c.t0, c.t1), args)
    yield from _collectives(run, job_pid)

    for t in run.tiles:
        pid, name = device_pid[t.device], f"{t.op} {t.gemm} tile {t.tile}"
        ids = {"job": t.job, "step": t.step, "gemm": t.gemm, "tile": t.tile}
        stages: list[tuple[str, int, int, Span | None, dict[str, object]]] = [
            ("download", pid, DOWNLINK, t.down, {"bytes": t.bytes_down, "saved": t.bytes_saved}),
            ("compute", pid, COMPUTE, t.compute, {"freq_mhz": t.freq_mhz, "temp_c": t.temp_c}),
            ("upload", pid, UPLINK, t.up, {"bytes": t.bytes_up}),
            ("download", nic_pid, DOWNLINK, t.nic_down, {"device": t.device}),
            ("upload", nic_pid, UPLINK, t.nic_up, {"device": t.device}),
        ]
        for cat, process, tid, span, args in stages:
            # A download of [t, t] moved nothing (the operands were resident): no event.
            if span is not None and (cat != "download" or span[1] > span[0]):
                yield _x(name, cat, (process, tid), span, args | ids)

    if not steps:
        return
    start, end = min(s.t0 for s in steps), max(s.t1 for s in steps)
    for o in run.ooms:
        if not start <= o.t <= end:
            continue
        which = {"job": o.job, "step": o.step, "gemm": o.gemm, "tile": o.tile}
        need = {"need_bytes": o.need_bytes, "capacity_bytes": o.capacity_bytes}
        pid = device_pid[o.device]
        oom = {"name": "OOM", "cat": "oom", "ph": "i", "s": "t", "pid": pid, "tid": COMPUTE}
        yield oom | {"ts": o.t * US_PER_S, "args": which | need}
    for device, samples in run.thermal.items():
        if device in mirrored:
            continue
        pid = device_pid[device]
        for when, mhz, temp in samples:
            if not start <= when <= end:
                continue
            ts = when * US_PER_S
            if temp is not None:
                yield _counter("temperature (°C)", pid, ts, {"temp_c": temp})
            if mhz is not None:
                yield _counter("frequency (MHz)", pid, ts, {"freq_mhz": mhz})


def _collectives(run: Run, job_pid: Mapping[int, int]) -> Iterator[Event]:
    """Each rank's part in each collective, from when it reached it to the end, and a flow
    from the part of the member that came last (which started it) to each other's."""
    together: dict[tuple[str, int, float, float], list[CollectivePart]] = defaultdict(list)
    for c in run.collectives:
        args = {"step": c.step, "bytes": c.nbytes, "members": c.members,
                "algorithm": run.collective, "waited_s": c.ready - c.t,
                "queued_s": c.start - c.ready, "network_s": c.end - c.start}  # fmt: skip
        yield _x(c.op, "collective", (job_pid[c.job], COLLECTIVES), (c.t, c.end), args)
        together[c.op, c.members, c.start, c.end].append(c)
    flow = 0
    for parts in together.values():
        last = max(parts, key=lambda c: c.t)
        for other in parts:
            if other is last:
                continue
            flow += 1
            for phase, part in (("s", last), ("f", other)):
                yield {"name": part.op, "cat": "collective", "ph": phase, "id": flow, "bp": "e",
                       "pid": job_pid[part.job], "tid": COLLECTIVES,
                       "ts": part.start * US_PER_S}  # fmt: skip


def _counter(name: str, pid: int, ts: float, args: dict[str, float]) -> Event:
    return {"name": name, "ph": "C", "pid": pid, "ts": ts, "args": args}


def _steps(run: Run) -> list[StepFigures]:
    """The steps the trace covers."""
    return [s for s in run.steps if s.step in run.window]


def _header(run: Run) -> dict[str, object]:
    return {
        "displayTimeUnit": "ms",
        "otherData": {
            "run": str(run.path),
            "clock": "virtual seconds from the run's start, as µs",
            "policy": run.policy,
            "command": " ".join(run.command),
            "event_log": run.level
            if run.logged is not None
            else f"{run.level}: no tiles, GEMMs or coordinator spans (--events full has them)",
            "steps": f"{steps_text(run.window)} of each job, tile by tile where the log has "
            f"them ({steps_text(run.logged)}); morphling report --detail-steps A:B|all "
            "for others",
            **(
                {
                    "mirrored": f"{sum(map(len, run.mirrors.values()))} devices of replayed "
                    "ranks timed as another's are shown by that one's (run.json)"
                }
                if run.mirrors
                else {}
            ),
        },
    }


def chrome_trace(run: Run) -> dict[str, object]:
    """The whole trace as one object (small runs, tests); ``write_trace`` streams it."""
    return {**_header(run), "traceEvents": list(trace_events(run))}


def write_trace(run: Run, path: Path) -> None:
    """Write the trace JSON to ``path`` one event at a time."""
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(_header(run))[:-1] + ', "traceEvents": [\n')
        for i, event in enumerate(trace_events(run)):
            f.write((",\n" if i else "") + json.dumps(event, ensure_ascii=False))
        f.write("\n]}\n")

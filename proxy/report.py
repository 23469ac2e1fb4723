"""Read a run directory the engine wrote and reduce it to what a researcher reads.

The engine logs every tile, GEMM, coordinator span, step, OOM and thermal step in virtual
time (``docs/REPORTS.md`` has the format and the definitions); a ``steps`` log keeps only
each step's and each device's totals per step, and the report leaves out (and says so) what
needs the rest. ``load_run`` checks the log as a whole, not line by line only: a report
built on an inconsistent log would be quietly wrong, so a contradiction is an error naming
the line. ``summarize`` computes the figures that ``summary.json``, the text table, the
trace and the plots all share.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

RUN_FILE, EVENTS_FILE = "run.json", "events.jsonl"
RUN_FORMAT = "morphling-run"  # run.json's "format"; older runs lack it
COMPRESSED_EVENTS_FILE = EVENTS_FILE + ".gz"  # what the engine writes; older runs: EVENTS_FILE
# What the engine logs: every record; each step's and each device's totals per step; nothing.
EVENT_LEVELS = ("full", "steps", "off")
STEPS_LOG_LACKS = (
    "per-GEMM critical path segments, stragglers and lateness, and the per-tile trace and "
    "timeline plot"
)
SUMMARY_FILE, TRACE_FILE = "summary.json", "trace.json"
PLOT_FILES = {"timeline": "timeline.png", "utilisation": "utilisation.png",
              "thermal": "thermal.png", "steps": "steps.png"}  # fmt: skip
# Every file ``write_report_files`` may write: a run directory holding any other is not
# replaced by ``morphling run --force``.
REPORT_FILES = (SUMMARY_FILE, TRACE_FILE, *PLOT_FILES.values())
FORMAT_VERSION = 1
# A device straggles when, over the GEMMs it takes part in, it finishes on average this
# fraction of the GEMM's duration after the median device: each such GEMM would have been
# that much shorter had it kept pace with the median.
STRAGGLER_LATENESS = 0.2
STRAGGLER_DEFINITION = (
    "mean over the GEMMs a device takes part in (with at least one other device) of "
    "(its last tile back - the median device's last tile back) / the GEMM's duration, "
    f">= {STRAGGLER_LATENESS}"
)
# The critical tile of a GEMM, from issue to its result back: these sum to the GEMM's time.
COMPONENTS = (
    "link_queue_s",
    "download_s",
    "compute_queue_s",
    "compute_s",
    "upload_queue_s",
    "upload_s",
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

Interval = tuple[float, float]
Rate = float  # bytes/s: the ``ideal`` link preset's is infinite


class RunError(ValueError):
    """A directory that is not a run, or a run whose files are garbled or inconsistent."""


# -- the log's records -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Device:
    id: int
    name: str
    profile: str
    kind: str
    flops: float
    memory_bytes: int
    dl_bw: Rate
    ul_bw: Rate
    dl_lat_s: float
    ul_lat_s: float
    cooling: str
    source: str


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    name: str


@dataclass(frozen=True, slots=True)
class Tile:
    line: int
    job: int
    gemm: int
    step: int
    tile: int
    device: int
    bytes_down: int
    bytes_up: int
    down: Interval
    compute: Interval
    up: Interval
    freq_mhz: float | None
    temp_c: float | None
    nic_down: Interval | None = None
    nic_up: Interval | None = None


@dataclass(frozen=True, slots=True)
class Gemm:
    line: int
    job: int
    gemm: int
    step: int
    issue: float
    end: float
    tiles: int
    last_tile: int
    last_device: int
    m: int
    n: int
    k: int
    batch: int


@dataclass(frozen=True, slots=True)
class Coord:
    line: int
    job: int
    step: int
    t0: float
    t1: float


@dataclass(frozen=True, slots=True)
class Step:
    line: int
    job: int
    step: int
    t0: float
    t1: float
    gemms: int
    local_gemms: int
    # The step's totals: what a ``steps`` log has instead of its tiles, GEMMs and
    # coordinator spans (older engines did not write them).
    tiles: int | None = None
    coord_s: float | None = None
    gemm_s: float | None = None
    bytes_down: int | None = None
    bytes_up: int | None = None
    link_queue_s: float | None = None
    download_s: float | None = None
    compute_queue_s: float | None = None
    compute_s: float | None = None
    upload_queue_s: float | None = None
    upload_s: float | None = None


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """A device's tiles of one step, summed (a ``steps`` log), and its state at the compute
    start ``t`` of the last of them."""

    line: int
    job: int
    step: int
    device: int
    tiles: int
    bytes_down: int
    bytes_up: int
    down_s: float
    compute_s: float
    up_s: float
    last_in: int
    t: float
    freq_mhz: float | None
    temp_c: float | None


@dataclass(frozen=True, slots=True)
class Oom:
    line: int
    job: int
    gemm: int
    step: int
    tile: int
    device: int
    t: float
    need_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Freq:
    line: int
    device: int
    t: float
    freq_mhz: float | None
    temp_c: float | None


@dataclass(frozen=True, slots=True)
class Run:
    """A loaded, checked run directory. Times are virtual seconds from the run's start."""

    path: Path
    policy: str
    block: int
    coordinator_time: str
    level: str  # "full" or "steps" (``EVENT_LEVELS``)
    bottleneck: dict[str, float] | None
    command: tuple[str, ...]
    fleet: tuple[Device, ...]
    jobs: tuple[Job, ...]
    tiles: tuple[Tile, ...]
    gemms: tuple[Gemm, ...]
    coords: tuple[Coord, ...]
    steps: tuple[Step, ...]
    ooms: tuple[Oom, ...]
    freqs: tuple[Freq, ...]
    device_steps: tuple[DeviceStep, ...]
    span_s: float  # the last thing that happened
    incomplete: str | None = None  # why the run ended early (SIGTERM, ...), None when it did not


# -- field checks: one per field type, shared by every record ------------------------------


def _finite(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"field {name!r} must be a finite number, got {value!r}")
    return float(value)


def _nonnegative(value: object, name: str) -> float:
    number = _finite(value, name)
    if number < 0:
        raise ValueError(f"field {name!r} must be >= 0, got {value!r}")
    return number


def _rate(value: object, name: str) -> float:
    if value == math.inf:
        return math.inf
    return _nonnegative(value, name)


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"field {name!r} must be an integer >= 0, got {value!r}")
    return value


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {value!r}")
    return value


def _interval(value: object, name: str) -> Interval:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"field {name!r} must be [start, end], got {value!r}")
    t0, t1 = (_nonnegative(v, name) for v in value)
    if t1 < t0:
        raise ValueError(f"field {name!r} ends before it starts: {value!r}")
    return t0, t1


def _nullable(check: Callable[[object, str], Any]) -> Callable[[object, str], Any]:
    return lambda value, name: None if value is None else check(value, name)


# By the field's annotation (a string, under ``from __future__ import annotations``).
_CHECKS: dict[str, Callable[[object, str], Any]] = {
    "int": _count,
    "str": _text,
    "float": _nonnegative,
    "Rate": _rate,
    "Interval": _interval,
    "Interval | None": _nullable(_interval),
    "float | None": _nullable(_finite),
    "int | None": _nullable(_count),
}


def _record(cls: type, obj: object, line: int | None = None) -> Any:
    """``cls`` from a JSON object: each field checked; fields with a default may be absent."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {obj!r}")
    values: dict[str, Any] = {} if line is None else {"line": line}
    for f in fields(cls):
        if f.name == "line":
            continue
        if f.name in obj:
            values[f.name] = _CHECKS[str(f.type)](obj[f.name], f.name)
        elif f.default is MISSING:
            raise ValueError(f"missing field {f.name!r}")
    return cls(**values)


# -- loading ---------------------------------------------------------------------------------

_KINDS: dict[str, type] = {
    "tile": Tile,
    "gemm": Gemm,
    "coord": Coord,
    "step": Step,
    "oom": Oom,
    "freq": Freq,
    "device_step": DeviceStep,
}
# What a ``steps`` log's step records must have: the totals that stand for its other records.
STEP_TOTALS = tuple(f.name for f in fields(Step) if f.default is None)


def load_run(path: str | Path) -> Run:
    """The run in directory ``path``, checked; RunError (a ValueError) says what is wrong."""
    root = Path(path)
    meta_file = root / RUN_FILE
    if not root.is_dir():
        raise RunError(f"{root}: not a directory")
    if not meta_file.is_file():
        raise RunError(f"{root} is not a Morphling run directory: it has no {RUN_FILE}")
    meta = _read_meta(meta_file)
    if meta["event_log"] == "off":
        raise RunError(
            f"{root} was run with --events off: it has no event log to report on (run it "
            "with --events full or --events steps for a report)"
        )
    events_file = root / meta["event_file"]
    if not events_file.is_file():
        raise RunError(f"{root} is not a complete run directory: it has no {events_file.name}")
    try:
        fleet = tuple(_record(Device, d) for d in _list(meta, "fleet"))
        jobs = tuple(_record(Job, j) for j in _list(meta, "jobs"))
        for what, ids in (("fleet", [d.id for d in fleet]), ("jobs", [j.id for j in jobs])):
            if len(set(ids)) != len(ids):
                raise ValueError(f"field {what!r} repeats an id: {ids}")
    except ValueError as exc:
        raise RunError(f"{meta_file}: {exc}") from exc
    records = _read_events(events_file, meta)
    ends = [t.up[1] for t in records[Tile]] + [g.end for g in records[Gemm]]
    ends += [e.t1 for e in (*records[Coord], *records[Step])]
    ends += [e.t for e in (*records[Oom], *records[Freq])]
    run = Run(
        path=root,
        policy=meta["policy"],
        block=meta["block"],
        coordinator_time=meta["coordinator_time"],
        level=meta["event_log"],
        bottleneck=meta["bottleneck"],
        command=tuple(meta["command"]),
        fleet=fleet,
        jobs=jobs,
        tiles=tuple(records[Tile]),
        gemms=tuple(records[Gemm]),
        coords=tuple(records[Coord]),
        steps=tuple(records[Step]),
        ooms=tuple(records[Oom]),
        freqs=tuple(records[Freq]),
        device_steps=tuple(records[DeviceStep]),
        span_s=max(ends, default=0.0),
        incomplete=meta.get("incomplete"),
    )
    try:
        _check(run)
    except ValueError as exc:
        raise RunError(f"{events_file} {exc}") from exc
    return run


def _list(meta: dict[str, Any], key: str) -> list[Any]:
    value = meta.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {key!r} must be a non-empty list, got {value!r}")
    return value


def _read_meta(meta_file: Path) -> dict[str, Any]:
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{meta_file}: cannot read it as JSON: {exc}") from exc
    try:
        if not isinstance(meta, dict):
            raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
        if meta.get("format", RUN_FORMAT) != RUN_FORMAT:
            raise ValueError(f"field 'format' is {meta['format']!r}, not {RUN_FORMAT!r}")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"field 'version' is {meta.get('version')!r}; this reader knows {FORMAT_VERSION}"
            )
        for key, check in (("policy", _text), ("coordinator_time", _text), ("block", _count)):
            if key not in meta:
                raise ValueError(f"missing field {key!r}")
            check(meta[key], key)
        level = meta.setdefault("event_log", "full")  # older engines logged everything
        if level not in EVENT_LEVELS:
            raise ValueError(f"field 'event_log' must be one of {EVENT_LEVELS}, got {level!r}")
        # older engines wrote it uncompressed; a name, not a path: the log is in the run
        name = meta.setdefault("event_file", EVENTS_FILE)
        if level != "off" and name not in (EVENTS_FILE, COMPRESSED_EVENTS_FILE):
            raise ValueError(
                f"field 'event_file' must be {EVENTS_FILE!r} or {COMPRESSED_EVENTS_FILE!r}, "
                f"got {name!r}"
            )
        command = meta.setdefault("command", [])  # descriptive only: may be left out
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
            raise ValueError(f"field 'command' must be a list of strings, got {command!r}")
        incomplete = meta.get("incomplete")
        if incomplete is not None and not isinstance(incomplete, str):
            raise ValueError(f"field 'incomplete' must be null or a string, got {incomplete!r}")
        if "bottleneck" not in meta:
            raise ValueError("missing field 'bottleneck' (null when there is none)")
        bottleneck = meta["bottleneck"]
        if bottleneck is not None:  # its parameters, shown as they are: numbers
            if not isinstance(bottleneck, dict):
                raise ValueError(
                    f"field 'bottleneck' must be null or an object, got {bottleneck!r}"
                )
            meta["bottleneck"] = {k: _rate(v, f"bottleneck.{k}") for k, v in bottleneck.items()}
    except ValueError as exc:
        raise RunError(f"{meta_file}: {exc}") from exc
    return meta


def _read_events(events_file: Path, meta: dict[str, Any]) -> dict[type, list[Any]]:
    """Every known event, by record type; unknown kinds are skipped (newer engines). When
    run.json has the log's line count (``events``) and sha256 (``digest``, of the lines
    uncompressed), they must match: a log cut short by a crash or edited afterwards is not
    silently reported on. A compressed log is read as a stream, as it was written."""
    records: dict[type, list[Any]] = {cls: [] for cls in _KINDS.values()}
    digest, line = hashlib.sha256(), 0
    steps = meta["event_log"] == "steps"
    opener = gzip.open if events_file.name.endswith(".gz") else open
    try:
        with opener(events_file, "rb") as f:
            for line, raw in enumerate(f, 1):
                digest.update(raw)
                _read_event(raw, f"{events_file} line {line}", line, records, steps)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:  # EOFError: a stream cut short
        raise RunError(f"{events_file}: cannot read it: {exc}") from exc
    if meta.get("events", line) != line:
        raise RunError(
            f"{events_file} has {line} lines but run.json says {meta['events']}: "
            "the log is incomplete or was appended to"
        )
    if meta.get("digest", digest.hexdigest()) != digest.hexdigest():
        raise RunError(f"{events_file} does not match run.json's digest: it changed after the run")
    return records


def _read_event(
    raw: bytes, where: str, line: int, records: dict[type, list[Any]], steps: bool
) -> None:
    if not raw.strip():
        return
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RunError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    except UnicodeDecodeError as exc:
        raise RunError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("ev"), str):
        raise RunError(f"{where}: not an event (a JSON object with an 'ev' string)")
    cls = _KINDS.get(obj["ev"])
    if cls is None:
        return
    try:
        if steps and cls is Step:
            missing = [name for name in STEP_TOTALS if name not in obj]
            if missing:
                raise ValueError(f"a steps log's step needs its totals: missing {missing}")
        records[cls].append(_record(cls, obj, line))
    except ValueError as exc:
        raise RunError(f"{where}: {obj['ev']} event: {exc}") from exc


def _check(run: Run) -> None:
    """Cross-event consistency; each error starts with ``line N:``."""
    devices, jobs = {d.id for d in run.fleet}, {j.id for j in run.jobs}
    for e in (*run.tiles, *run.ooms, *run.freqs, *run.device_steps):
        if e.device not in devices:
            raise ValueError(f"line {e.line}: device {e.device} is not in run.json's fleet")
    for e in (*run.tiles, *run.gemms, *run.coords, *run.steps, *run.ooms, *run.device_steps):
        if e.job not in jobs:
            raise ValueError(f"line {e.line}: job {e.job} is not in run.json's jobs")
    for t in run.tiles:
        if t.compute[0] < t.down[1] or t.up[0] < t.compute[1]:
            raise ValueError(
                f"line {t.line}: tile {t.tile} of gemm {t.gemm} is out of order: down {t.down}, "
                f"compute {t.compute}, up {t.up}"
            )
    tiles = _unique(run.tiles, lambda t: (t.job, t.gemm, t.tile), "tile")
    _unique(run.gemms, lambda g: (g.job, g.gemm), "gemm")
    steps = _unique(run.steps, lambda s: (s.job, s.step), "step")
    _unique(run.device_steps, lambda d: (d.job, d.step, d.device), "device_step")
    for d in run.device_steps:
        if (d.job, d.step) not in steps:
            raise ValueError(f"line {d.line}: device_step of job {d.job} step {d.step}, "
                             "which is not logged")  # fmt: skip
    for g in run.gemms:
        last = tiles.get((g.job, g.gemm, g.last_tile))
        if last is None:
            raise ValueError(
                f"line {g.line}: gemm {g.gemm}'s last_tile {g.last_tile} is not logged"
            )
        if last.device != g.last_device or last.up[1] != g.end or last.down[0] < g.issue:
            raise ValueError(
                f"line {g.line}: gemm {g.gemm} (issue {g.issue}, end {g.end}, last_device "
                f"{g.last_device}) disagrees with its last tile on line {last.line}"
            )
    for job in jobs:
        _no_overlap([s for s in run.steps if s.job == job], lambda s: (s.t0, s.t1), "step")
        spans = [*(g for g in run.gemms if g.job == job), *(c for c in run.coords if c.job == job)]
        _no_overlap(spans, _span, "gemm or coord")
        for e in spans:
            step = steps.get((e.job, e.step))
            if step is not None and not step.t0 <= _span(e)[0] <= _span(e)[1] <= step.t1:
                raise ValueError(
                    f"line {e.line}: {_span(e)} lies outside step {e.step} {step.t0, step.t1} "
                    f"(line {step.line})"
                )


def _span(e: Gemm | Coord) -> Interval:
    return (e.issue, e.end) if isinstance(e, Gemm) else (e.t0, e.t1)


def _unique(events: Iterable[Any], key: Callable[[Any], tuple], what: str) -> dict[tuple, Any]:
    seen: dict[tuple, Any] = {}
    for e in events:
        if key(e) in seen:
            raise ValueError(f"line {e.line}: repeats the {what} of line {seen[key(e)].line}")
        seen[key(e)] = e
    return seen


def _no_overlap(events: list[Any], span: Callable[[Any], Interval], what: str) -> None:
    """One job does one thing at a time: its steps, and its GEMMs and coordinator spans."""
    ordered = sorted(events, key=span)
    for before, after in itertools.pairwise(ordered):
        if span(after)[0] < span(before)[1]:
            raise ValueError(
                f"line {after.line}: {what} {span(after)} overlaps line {before.line}'s "
                f"{span(before)} of the same job"
            )


# -- summarising -----------------------------------------------------------------------------


def union_s(intervals: Iterable[Interval]) -> float:
    """Seconds covered by at least one interval: a FIFO's busy time."""
    total, end = 0.0, -math.inf
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def thermal_samples(run: Run) -> dict[int, list[tuple[float, float | None, float | None]]]:
    """Per device with a thermal model, (t, MHz, °C) in time order: the frequency changes,
    and each tile's state at its compute start (a ``steps`` log: the last tile's of each
    step); a later sample wins a tie."""
    samples: dict[int, list[tuple[float, float | None, float | None]]] = defaultdict(list)
    for f in run.freqs:
        samples[f.device].append((f.t, f.freq_mhz, f.temp_c))
    for t in (*run.tiles, *run.device_steps):  # a DeviceStep's ``t`` is its compute start
        start = t.compute[0] if isinstance(t, Tile) else t.t
        if t.freq_mhz is not None or t.temp_c is not None:
            samples[t.device].append((start, t.freq_mhz, t.temp_c))
    return {d: sorted(s, key=lambda x: x[0]) for d, s in sorted(samples.items())}


def critical_breakdown(
    issue: float, down: Interval, compute: Interval, up: Interval
) -> dict[str, float]:
    """Where a GEMM's time went, following its last tile (its stages ``down``, ``compute``,
    ``up``) from the GEMM's issue to its end. The engine sums these per step for a
    ``steps`` log, as ``summarize`` does from a full one."""
    return {
        "link_queue_s": down[0] - issue,
        "download_s": down[1] - down[0],
        "compute_queue_s": compute[0] - down[1],
        "compute_s": compute[1] - compute[0],
        "upload_queue_s": up[0] - compute[1],
        "upload_s": up[1] - up[0],
    }


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
    detail = run.level == "full"  # every tile, GEMM and coordinator span is logged
    info: dict[str, Any] = {
        "path": str(run.path),
        "policy": run.policy,
        "block": run.block,
        "coordinator_time": run.coordinator_time,
        "event_log": run.level,
        "bottleneck": run.bottleneck,
        "command": list(run.command),
        "incomplete": run.incomplete,
    }
    if run.bottleneck is not None:
        nic_down = union_s(t.nic_down for t in run.tiles if t.nic_down)
        nic_up = union_s(t.nic_up for t in run.tiles if t.nic_up)
        info["bottleneck"] = {  # from the tiles: not known from a steps log
            "parameters": run.bottleneck,
            "downlink_utilisation": _share(nic_down, run) if detail else None,
            "uplink_utilisation": _share(nic_up, run) if detail else None,
        }
    stragglers = [d for d in devices if (d["lateness"] or 0.0) >= STRAGGLER_LATENESS]
    return {
        "version": FORMAT_VERSION,
        "run": info,
        "totals": totals,
        "jobs": jobs,
        "devices": devices,
        "stragglers": {
            "definition": STRAGGLER_DEFINITION,
            "threshold": STRAGGLER_LATENESS,
            "devices": [
                {k: d[k] for k in ("id", "name", "lateness", "gemms", "last_in", "expected_last")}
                for d in sorted(stragglers, key=lambda d: -d["lateness"])
            ]
            if detail
            else None,  # a steps log has no device's finish within a GEMM
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


def _share(busy_s: float, run: Run) -> float:
    return busy_s / run.span_s if run.span_s > 0 else 0.0


def _sum_rows(rows: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    return {k: sum(r[k] for r in rows) for k in keys}


def _jobs(run: Run) -> list[dict[str, Any]]:
    """Per job, its steps (with their critical paths) and their sums."""
    if run.level == "steps":
        return _jobs_from_totals(run)
    by_step: dict[tuple[int, int], dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for kind, events in (
        ("tiles", run.tiles),
        ("gemms", run.gemms),
        ("coords", run.coords),
        ("steps", run.steps),
        ("ooms", run.ooms),
    ):
        for e in events:
            by_step[e.job, e.step][kind].append(e)
    tiles = {(t.job, t.gemm, t.tile): t for t in run.tiles}
    names = {d.id: d.name for d in run.fleet}
    jobs = []
    for job in run.jobs:
        steps = [
            _step(job.id, step, by_step[job.id, step], tiles, names)
            for (j, step) in sorted(by_step)
            if j == job.id
        ]
        jobs.append({"id": job.id, "name": job.name, **_sum_rows(steps, _SUMMED), "steps": steps})
    return jobs


def _jobs_from_totals(run: Run) -> list[dict[str, Any]]:
    """``_jobs`` from a ``steps`` log: each step's totals as the engine summed them, its
    critical path without its segments."""
    names = {d.id: d.name for d in run.fleet}
    critical: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    for d in run.device_steps:
        critical[d.job, d.step][names[d.device]] += d.last_in
    ooms = Counter((o.job, o.step) for o in run.ooms)
    jobs = []
    for job in run.jobs:
        steps = []
        for s in sorted((s for s in run.steps if s.job == job.id), key=lambda s: s.step):
            breakdown = {"coordinator_s": s.coord_s, **{k: getattr(s, k) for k in COMPONENTS}}
            breakdown["unattributed_s"] = 0.0  # as ``_step`` sums it: over every part
            breakdown["unattributed_s"] = (s.t1 - s.t0) - sum(breakdown.values())
            devices = critical[job.id, s.step]
            steps.append({
                "job": job.id, "step": s.step, "complete": True, "t0": s.t0, "t1": s.t1,
                "emulated_s": s.t1 - s.t0, "coordinator_s": s.coord_s, "gemm_s": s.gemm_s,
                "gemms": s.gemms, "local_gemms": s.local_gemms, "tiles": s.tiles,
                "bytes_down": s.bytes_down, "bytes_up": s.bytes_up,
                "oom": ooms[job.id, s.step],
                "critical_path": {"breakdown": breakdown,
                                  "devices": {n: c for n, c in devices.most_common() if c},
                                  "segments": None},
            })  # fmt: skip
        jobs.append({"id": job.id, "name": job.name, **_sum_rows(steps, _SUMMED), "steps": steps})
    return jobs


def _step(
    job: int,
    step: int,
    events: dict[str, list[Any]],
    tiles: dict[tuple[int, int, int], Tile],
    names: dict[int, str],
) -> dict[str, Any]:
    """One step's row. A step the engine did not close (the script stopped inside it) spans
    its logged events and is marked incomplete."""
    segments = sorted((*events["gemms"], *events["coords"]), key=_span)
    if events["steps"]:
        (closed,) = events["steps"]
        t0, t1, local = closed.t0, closed.t1, closed.local_gemms
    else:
        spans = [_span(s) for s in segments] + [(t.down[0], t.up[1]) for t in events["tiles"]]
        spans += [(o.t, o.t) for o in events["ooms"]]
        t0, t1, local = min(s[0] for s in spans), max(s[1] for s in spans), 0
    breakdown = dict.fromkeys(BREAKDOWN, 0.0)
    path, critical = [], Counter[str]()
    for seg in segments:
        if isinstance(seg, Coord):
            breakdown["coordinator_s"] += seg.t1 - seg.t0
            path.append({"kind": "coordinator", "t0": seg.t0, "t1": seg.t1})
            continue
        tile = tiles[seg.job, seg.gemm, seg.last_tile]
        parts = critical_breakdown(seg.issue, tile.down, tile.compute, tile.up)
        for k, v in parts.items():
            breakdown[k] += v
        critical[names[tile.device]] += 1
        path.append(
            {
                "kind": "gemm",
                "gemm": seg.gemm,
                "t0": seg.issue,
                "t1": seg.end,
                "tile": tile.tile,
                "device": tile.device,
                "device_name": names[tile.device],
                **parts,
            }
        )
    breakdown["unattributed_s"] = (t1 - t0) - sum(breakdown.values())
    return {
        "job": job,
        "step": step,
        "complete": bool(events["steps"]),
        "t0": t0,
        "t1": t1,
        "emulated_s": t1 - t0,
        "coordinator_s": breakdown["coordinator_s"],
        "gemm_s": sum(g.end - g.issue for g in events["gemms"]),
        "gemms": len(events["gemms"]),
        "local_gemms": local,
        "tiles": len(events["tiles"]),
        "bytes_down": sum(t.bytes_down for t in events["tiles"]),
        "bytes_up": sum(t.bytes_up for t in events["tiles"]),
        "oom": len(events["ooms"]),
        "critical_path": {
            "breakdown": breakdown,
            "devices": dict(critical.most_common()),
            "segments": path,
        },
    }


def _devices(run: Run) -> list[dict[str, Any]]:
    """Per device: work, utilisation of compute and links, thermal state, lateness (not
    from a ``steps`` log: it needs each tile)."""
    work = _work(run) if run.level == "full" else _work_from_totals(run)
    thermal = thermal_samples(run)
    lateness, last_in, expected, gemms = _lateness(run)
    if run.level == "steps":
        last_in = Counter[int]()
        for ds in run.device_steps:
            last_in[ds.device] += ds.last_in
    rows = []
    for d in run.fleet:
        tiles, busy, down, up, bytes_down, bytes_up = work.get(d.id, (0, 0.0, 0.0, 0.0, 0, 0))
        temps = [temp for _, _, temp in thermal.get(d.id, []) if temp is not None]
        top, below = _below_top(thermal.get(d.id, []), run.span_s)
        rows.append(
            {
                "id": d.id,
                "name": d.name,
                "profile": d.profile,
                "kind": d.kind,
                "tiles": tiles,
                "busy_s": busy,
                "utilisation": _share(busy, run),
                "downlink_utilisation": _share(down, run),
                "uplink_utilisation": _share(up, run),
                "bytes_down": bytes_down,
                "bytes_up": bytes_up,
                "final_temp_c": temps[-1] if temps else None,
                "top_freq_mhz": top,
                "below_top_s": below,
                "gemms": gemms[d.id] if run.level == "full" else None,
                "last_in": last_in[d.id],
                "expected_last": expected[d.id] if run.level == "full" else None,
                "lateness": statistics.fmean(lateness[d.id]) if lateness[d.id] else None,
            }
        )
    return rows


# A device's tiles, compute, downlink and uplink busy seconds, bytes down and up.
Work = tuple[int, float, float, float, int, int]


def _work(run: Run) -> dict[int, Work]:
    """Per device, from its tiles: busy seconds are the union of their stages' intervals."""
    mine: dict[int, list[Tile]] = defaultdict(list)
    for t in run.tiles:
        mine[t.device].append(t)
    return {
        device: (
            len(tiles),
            union_s(t.compute for t in tiles),
            union_s(t.down for t in tiles),
            union_s(t.up for t in tiles),
            sum(t.bytes_down for t in tiles),
            sum(t.bytes_up for t in tiles),
        )
        for device, tiles in mine.items()
    }


def _work_from_totals(run: Run) -> dict[int, Work]:
    """Per device, from its totals per step: a device's stages are FIFOs, so its tiles'
    intervals never overlap and their union is their sum (up to float rounding)."""
    mine: dict[int, list[DeviceStep]] = defaultdict(list)
    for d in run.device_steps:
        mine[d.device].append(d)
    return {
        device: (
            sum(d.tiles for d in steps),
            math.fsum(d.compute_s for d in steps),
            math.fsum(d.down_s for d in steps),
            math.fsum(d.up_s for d in steps),
            sum(d.bytes_down for d in steps),
            sum(d.bytes_up for d in steps),
        )
        for device, steps in mine.items()
    }


def _below_top(
    samples: list[tuple[float, float | None, float | None]], span_s: float
) -> tuple[float | None, float | None]:
    """(top MHz, seconds below it): the device starts at its top (highest logged) frequency
    and holds each logged frequency until the next one."""
    changes = [(t, mhz) for t, mhz, _ in samples if mhz is not None]
    if not changes:
        return None, None
    top = max(mhz for _, mhz in changes)
    below, now, mhz_now = 0.0, 0.0, top
    for t, mhz in [*changes, (span_s, top)]:
        if mhz_now < top:
            below += t - now
        now, mhz_now = t, mhz
    return top, below


def _lateness(
    run: Run,
) -> tuple[dict[int, list[float]], Counter[int], dict[int, float], Counter[int]]:
    """Per device: its lateness in each shared GEMM, how often it was last, how often it
    would be last by chance (1/participants per GEMM), and how many GEMMs it took part in."""
    finish: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for t in run.tiles:
        mine = finish[t.job, t.gemm]
        mine[t.device] = max(mine.get(t.device, 0.0), t.up[1])
    lateness: dict[int, list[float]] = defaultdict(list)
    last_in, gemms = Counter[int](), Counter[int]()
    expected: dict[int, float] = defaultdict(float)
    for g in run.gemms:
        done = finish[g.job, g.gemm]
        last_in[g.last_device] += 1
        for device in done:
            gemms[device] += 1
            expected[device] += 1 / len(done)
        if len(done) >= 2 and g.end > g.issue:
            median = statistics.median(done.values())
            for device, t in done.items():
                lateness[device].append((t - median) / (g.end - g.issue))
    return lateness, last_in, expected, gemms


# -- text ------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': binary units, as memory and link sizes are quoted."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _maybe(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _percent(x: float | None) -> str:
    return _maybe(None if x is None else 100 * x, ".1f")


TOP_DEVICES = 10


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as text: steps, busiest devices, stragglers, the slowest step's critical
    path, OOMs."""
    run, totals = summary["run"], summary["totals"]
    out = [
        f"run {run['path']}: policy {run['policy']}, block {run['block']}, coordinator time "
        f"{run['coordinator_time']}, {totals['devices']} devices, "
        f"{totals['span_s']:.4f} s emulated in all",
    ]
    if run["event_log"] == "steps":
        out.append(
            f"event log: steps (each step's and each device's totals), so this report has no "
            f"{STEPS_LOG_LACKS}: run with --events full for them"
        )
    if run["incomplete"] is not None:
        out.append(f"incomplete: the run ended early ({run['incomplete']}); this is what it "
                   "logged until then")  # fmt: skip
    if run["bottleneck"]:
        b = run["bottleneck"]
        parameters = ", ".join(f"{k} {v:.4g}" for k, v in b["parameters"].items())
        out.append(
            f"shared bottleneck ({parameters}): downlink {_percent(b['downlink_utilisation'])}%, "
            f"uplink {_percent(b['uplink_utilisation'])}% busy"
        )
    out += ["", *_steps_table(summary), "", *_devices_table(summary), ""]
    out += _stragglers_text(summary)
    steps = [s for j in summary["jobs"] for s in j["steps"]]
    if steps:
        out += ["", *_critical_text(max(steps, key=lambda s: s["emulated_s"]))]
    ooms = summary["ooms"]
    out += ["", f"OOM events: {ooms['count']}"]
    out += [
        f"  job {o['job']} step {o['step']} gemm {o['gemm']} tile {o['tile']} on "
        f"{o['device_name']} at {o['t']:.4f} s: needs {format_bytes(o['need_bytes'])} of "
        f"{format_bytes(o['capacity_bytes'])}"
        for o in ooms["events"][:TOP_DEVICES]
    ]
    if ooms["count"] > TOP_DEVICES:
        out.append(f"  ... and {ooms['count'] - TOP_DEVICES} more (summary.json lists all)")
    return "\n".join(out)


def _steps_table(summary: dict[str, Any]) -> list[str]:
    head = (
        f"{'job':>4} {'step':>5} {'emulated s':>11} {'coord s':>9} {'GEMM s':>9} "
        f"{'GEMMs':>6} {'local':>6} {'tiles':>7} {'down':>10} {'up':>10} {'OOM':>4}"
    )
    rows = [head, "-" * len(head)]
    for job in summary["jobs"]:
        for s in job["steps"]:
            mark = "" if s["complete"] else "  (incomplete)"
            rows.append(
                f"{s['job']:>4} {s['step']:>5} {s['emulated_s']:>11.4f} "
                f"{s['coordinator_s']:>9.4f} {s['gemm_s']:>9.4f} {s['gemms']:>6} "
                f"{s['local_gemms']:>6} {s['tiles']:>7} {format_bytes(s['bytes_down']):>10} "
                f"{format_bytes(s['bytes_up']):>10} {s['oom']:>4}{mark}"
            )
    t = summary["totals"]
    rows.append(
        f"{'all':>10} {t['emulated_s']:>11.4f} {t['coordinator_s']:>9.4f} {t['gemm_s']:>9.4f} "
        f"{t['gemms']:>6} {t['local_gemms']:>6} {t['tiles']:>7} "
        f"{format_bytes(t['bytes_down']):>10} {format_bytes(t['bytes_up']):>10} {t['oom']:>4}"
    )
    return rows


def _devices_table(summary: dict[str, Any]) -> list[str]:
    devices = sorted(summary["devices"], key=lambda d: (-d["utilisation"], d["id"]))
    shown = devices[:TOP_DEVICES]
    rows = [
        f"devices by compute utilisation ({len(shown)} of {len(devices)}; mean "
        f"{_percent(summary['totals']['mean_utilisation'])}%):",
        f"{'id':>5} {'name':<16} {'profile':<12} {'tiles':>7} {'compute%':>9} {'down%':>6} "
        f"{'up%':>6} {'°C end':>7} {'MHz top':>8} {'below s':>8} {'lateness':>9} {'last in':>9}",
    ]
    for d in shown:
        rows.append(
            f"{d['id']:>5} {d['name']:<16} {d['profile']:<12} {d['tiles']:>7} "
            f"{_percent(d['utilisation']):>9} {_percent(d['downlink_utilisation']):>6} "
            f"{_percent(d['uplink_utilisation']):>6} {_maybe(d['final_temp_c'], '.1f'):>7} "
            f"{_maybe(d['top_freq_mhz'], '.0f'):>8} {_maybe(d['below_top_s'], '.3f'):>8} "
            f"{_maybe(d['lateness'], '+.3f'):>9} {_last_in(d):>9}"
        )
    return rows


def _last_in(device: dict[str, Any]) -> str:
    """Critical tiles of GEMMs taken part in; their count alone from a ``steps`` log."""
    if device["gemms"] is None:
        return str(device["last_in"])
    return f"{device['last_in']}/{device['gemms']}"


def _stragglers_text(summary: dict[str, Any]) -> list[str]:
    stragglers = summary["stragglers"]["devices"]
    head = f"stragglers (lateness >= {STRAGGLER_LATENESS} of a GEMM's duration):"
    if stragglers is None:
        return [f"{head} not known from a steps log"]
    if not stragglers:
        return [f"{head} none"]
    return [head] + [
        f"  {s['name']}: {s['lateness']:+.3f}, last in {s['last_in']} of its {s['gemms']} "
        f"GEMMs ({s['expected_last']:.1f} expected by chance)"
        for s in stragglers
    ]


def _critical_text(step: dict[str, Any]) -> list[str]:
    total = step["emulated_s"]
    path = step["critical_path"]
    rows = [
        f"critical path of the slowest step (job {step['job']} step {step['step']}, {total:.4f} s):"
    ]
    for key, seconds in path["breakdown"].items():
        share = f"{100 * seconds / total:6.1f}%" if total > 0 else ""
        rows.append(f"  {key.removesuffix('_s').replace('_', ' '):<16} {seconds:>10.4f} s {share}")
    devices = ", ".join(f"{name} ({n})" for name, n in list(path["devices"].items())[:TOP_DEVICES])
    rows.append(f"  last tile on: {devices or 'no GEMM'}")
    return rows


# -- files -----------------------------------------------------------------------------------


def write_reports(run_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Load and summarise the run in ``run_dir`` and write its reports there; their paths."""
    run = load_run(run_dir)
    return write_report_files(run, summarize(run), plots=plots)


def write_report_files(run: Run, summary: dict[str, Any], *, plots: bool = True) -> list[Path]:
    """``summary.json``, ``trace.json`` and (with ``plots``) the PNGs, in the run directory."""
    from .chrome_trace import write_trace

    summary_path, trace_path = run.path / SUMMARY_FILE, run.path / TRACE_FILE
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    write_trace(run, trace_path)
    paths = [summary_path, trace_path]
    if plots:
        from .plots import write_plots

        paths += write_plots(run, summary, run.path)
    return paths

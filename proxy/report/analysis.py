"""Read a run directory the engine wrote and reduce it to what a researcher reads.

The engine logs every tile, GEMM, coordinator span, step, OOM and thermal step in virtual
time (``docs/REPORTS.md`` has the format and the definitions), for every step (``full``),
for each job's first steps and then each step's and each device's totals (``auto``), or
totals only (``steps``); the report leaves out, and says so, what needs tiles it lacks.

``load_run`` reads the log once, as a stream, and reduces each record as it comes to the
figures of its step and its device; it keeps the records themselves only for the steps
the reports show tile by tile (``StepRange``: by default each job's first
``DETAIL_WINDOW``), so a long run costs memory per step, not per tile. It checks the log as
a whole, not line by line only: a report built on an inconsistent log would be quietly
wrong, so a contradiction is an error naming the line. ``summarize`` computes the figures
that ``summary.json``, the text table, the trace and the plots all share.
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
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from morphling.proxy.vtime.eventlog import (
    COMPONENTS,
    COMPRESSED_EVENTS_FILE,
    EVENT_LEVELS,
    EVENTS_FILE,
    RUN_FILE,
    RUN_FORMAT,
    STEP_TOTALS,
    critical_breakdown,
)

from morphling.text import elide, elided_line, format_bytes

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
# The steps of each job the trace, timeline.png and the critical-path segments show by
# default: what one looks at, in files that stay small however long the run.
DETAIL_WINDOW = 50
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
# A device's lateness values are summed (math.fsum) into one past this many: its mean then
# costs memory per device, not per GEMM, for a rounding error per this many values.
LATENESS_KEPT = 4096

Interval = tuple[float, float]
Rate = float  # bytes/s: the ``ideal`` link preset's is infinite
Sample = tuple[float, float | None, float | None]  # a device's (t, MHz, °C)


class RunError(ValueError):
    """A directory that is not a run, or a run whose files are garbled or inconsistent."""


@dataclass(frozen=True, slots=True)
class StepRange:
    """Steps ``first`` to ``last`` of each job, both included; None: unbounded."""

    first: int | None = None
    last: int | None = None

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """``A:B``, ``A:``, ``:B``, ``N`` or ``all``; ValueError saying what is wrong."""
        if text == "all":
            return cls()
        first, colon, last = text.partition(":")
        try:
            a = int(first) if first else None
            b = (int(last) if last else None) if colon else a
        except ValueError:
            a = b = -1
        if (a is None and not colon) or (a is not None and a < 0) or (b is not None and b < 0):
            raise ValueError(f"{text!r} is not A:B, A:, :B, N or all (step numbers >= 0)")
        if a is not None and b is not None and b < a:
            raise ValueError(f"{text!r} ends before it starts")
        return cls(a, b)

    def __contains__(self, step: int) -> bool:
        return (self.first is None or step >= self.first) and (
            self.last is None or step <= self.last
        )

    def __str__(self) -> str:
        if self.first is None and self.last is None:
            return "all"
        if self.first == self.last:
            return str(self.first)
        return (
            f"{'' if self.first is None else self.first}:{'' if self.last is None else self.last}"
        )


DEFAULT_DETAIL = StepRange(None, DETAIL_WINDOW)


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
    last_tile: int | None  # None: an empty GEMM (no output, no tiles)
    last_device: int | None
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


# -- what the log reduces to -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepFigures:
    """One step of one job: from its tiles, GEMMs and coordinator spans where the log
    keeps them, else from its step record's totals. A step with no step record (the
    script stopped inside it) spans its logged events and is ``complete`` False."""

    job: int
    step: int
    complete: bool
    t0: float
    t1: float
    coord_s: float
    gemm_s: float
    gemms: int  # on the fleet (an empty GEMM, with no tiles, is not)
    local_gemms: int
    tiles: int
    bytes_down: int
    bytes_up: int
    oom: int
    critical: tuple[float, ...]  # its GEMMs' critical paths summed, as ``COMPONENTS``
    last_in: tuple[tuple[int, int], ...]  # (device, GEMMs whose critical tile it ran)
    detail: bool  # the log has its tiles, GEMMs and coordinator spans


@dataclass(frozen=True, slots=True)
class DeviceFigures:
    """One device over the run. ``gemms``, ``expected_last``, ``lateness`` and
    ``last_in_detail`` are over the GEMMs of the steps whose tiles the log has."""

    tiles: int = 0
    busy_s: float = 0.0  # compute; a device's stages are FIFOs: its tiles' durations, summed
    down_s: float = 0.0
    up_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    top_freq_mhz: float | None = None  # the highest frequency logged
    last_in: int = 0  # GEMMs whose critical tile it ran, every step
    gemms: int = 0  # GEMMs it took part in
    expected_last: float = 0.0  # sum of 1/participants over them
    lateness: float | None = None  # mean, over those it shared with another device
    last_in_detail: int = 0


@dataclass(frozen=True, slots=True)
class Run:
    """A loaded, checked run directory. Times are virtual seconds from the run's start.

    ``tiles``, ``gemms`` and ``coords`` are the records of the steps the reports show tile
    by tile (``shows``): those in ``window`` that the log has tiles for (``logged``)."""

    path: Path
    policy: str
    block: int
    coordinator_time: str
    level: str  # ``EVENT_LEVELS`` but off
    logged: StepRange | None  # the steps whose tiles the log has (None: none)
    window: StepRange  # the steps asked for in detail
    bottleneck: dict[str, float] | None
    command: tuple[str, ...]
    fleet: tuple[Device, ...]
    jobs: tuple[Job, ...]
    steps: tuple[StepFigures, ...]  # every step, by job and step
    devices: dict[int, DeviceFigures]  # by id, those that did something
    thermal: dict[int, list[Sample]]  # by device with a thermal model, in time order
    nic_busy_s: Interval | None  # the shared bottleneck's (down, up), when every tile is logged
    tiles: tuple[Tile, ...]
    gemms: tuple[Gemm, ...]
    coords: tuple[Coord, ...]
    ooms: tuple[Oom, ...]
    span_s: float  # the last thing that happened
    incomplete: str | None = None  # why the run ended early (SIGTERM, ...), None when it did not

    def shows(self, step: int) -> bool:
        """Whether the reports show this step tile by tile."""
        return step in self.window and self.logged is not None and step in self.logged

    @property
    def every_step_logged(self) -> bool:
        """The log has the tiles of every step (``full``; ``auto`` for a short run)."""
        return self.logged is not None and all(s.detail for s in self.steps)


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


def load_run(path: str | Path, detail: StepRange = DEFAULT_DETAIL) -> Run:
    """The run in directory ``path``, checked, with the records of the steps in ``detail``
    that the log has tiles for; RunError (a ValueError) says what is wrong."""
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
            "with --events auto, full or steps for a report)"
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
    reader = _Reader(fleet, jobs, meta["event_log"], logged_steps(meta), detail)
    _read_events(events_file, meta, reader)
    try:
        return reader.run(root, meta)
    except ValueError as exc:
        raise RunError(f"{events_file} {exc}") from exc


def logged_steps(meta: dict[str, Any]) -> StepRange | None:
    """The steps of each job whose tiles a log at run.json's level has (None: none)."""
    level = meta["event_log"]
    if level == "auto":
        return StepRange(None, meta["event_detail_steps"])
    return StepRange() if level == "full" else None


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
        if level == "auto" and _count(meta.get("event_detail_steps"), "event_detail_steps") < 1:
            raise ValueError("field 'event_detail_steps' must be >= 1")
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


def _read_events(events_file: Path, meta: dict[str, Any], reader: _Reader) -> None:
    """Hand every known event to ``reader``, in log order; unknown kinds are skipped (newer
    engines). When run.json has the log's line count (``events``) and sha256 (``digest``,
    of the lines uncompressed), they must match: a log cut short by a crash or edited
    afterwards is not silently reported on. A compressed log is read as a stream, as it
    was written."""
    digest, line = hashlib.sha256(), 0
    opener = gzip.open if events_file.name.endswith(".gz") else open
    try:
        with opener(events_file, "rb") as f:
            for line, raw in enumerate(f, 1):
                digest.update(raw)
                record = _read_event(raw, f"{events_file} line {line}", line)
                if record is None:
                    continue
                try:
                    reader.add(record)
                except ValueError as exc:
                    raise RunError(f"{events_file} {exc}") from exc
    except (OSError, EOFError, gzip.BadGzipFile) as exc:  # EOFError: a stream cut short
        raise RunError(f"{events_file}: cannot read it: {exc}") from exc
    if meta.get("events", line) != line:
        raise RunError(
            f"{events_file} has {line} lines but run.json says {meta['events']}: "
            "the log is incomplete or was appended to"
        )
    if meta.get("digest", digest.hexdigest()) != digest.hexdigest():
        raise RunError(f"{events_file} does not match run.json's digest: it changed after the run")


def _read_event(raw: bytes, where: str, line: int) -> Any:
    """The record on this line, checked field by field; None for a blank line or a kind
    this reader does not know."""
    if not raw.strip():
        return None
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
        return None
    try:
        return _record(cls, obj, line)
    except ValueError as exc:
        raise RunError(f"{where}: {obj['ev']} event: {exc}") from exc


# -- reducing the records as they come -------------------------------------------------------

Segment = tuple[float, float, int]  # a GEMM's or a coordinator span's (start, end, line)


@dataclass(slots=True)
class _StepSums:
    """One step of one job, as its records come (in any order)."""

    record: Step | None = None
    coord_s: float = 0.0
    gemm_s: float = 0.0
    gemms: int = 0
    tiles: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    oom: int = 0
    critical: list[float] | None = None  # ``COMPONENTS``, summed over its GEMMs
    last_in: Counter[int] = field(default_factory=Counter)  # device → critical tiles
    t0: float = math.inf  # the span of its records: an unclosed step's
    t1: float = -math.inf
    first: Segment | None = None  # its GEMM or coordinator span that starts first
    last: Segment | None = None  # ... and the one that ends last
    devices: dict[int, int] | None = None  # device → the line of its device_step
    samples: dict[int, Sample] | None = None  # device → its last tile's state, when not shown

    def spans(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = min(self.t0, t0), max(self.t1, t1)

    def segment(self, t0: float, t1: float, line: int) -> None:
        """A GEMM or coordinator span: it must lie inside the step."""
        self.spans(t0, t1)
        if self.first is None or t0 < self.first[0]:
            self.first = (t0, t1, line)
        if self.last is None or t1 > self.last[1]:
            self.last = (t0, t1, line)


@dataclass(slots=True)
class _DeviceSums:
    """One device, as its records come: ``DeviceFigures`` in the making."""

    tiles: int = 0
    busy_s: float = 0.0
    down_s: float = 0.0
    up_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    top: float | None = None
    last_in: int = 0
    gemms: int = 0
    expected_last: float = 0.0
    lateness: list[float] = field(default_factory=list)  # summed in part past LATENESS_KEPT
    late_gemms: int = 0
    last_in_detail: int = 0

    def frequency(self, mhz: float | None) -> None:
        if mhz is not None and (self.top is None or mhz > self.top):
            self.top = mhz

    def late(self, lateness: float) -> None:
        self.lateness.append(lateness)
        self.late_gemms += 1
        if len(self.lateness) > LATENESS_KEPT:
            self.lateness = [math.fsum(self.lateness)]

    def figures(self) -> DeviceFigures:
        return DeviceFigures(
            self.tiles, self.busy_s, self.down_s, self.up_s, self.bytes_down, self.bytes_up,
            self.top, self.last_in, self.gemms, self.expected_last,
            math.fsum(self.lateness) / self.late_gemms if self.late_gemms else None,
            self.last_in_detail,
        )  # fmt: skip


@dataclass(slots=True)
class _GemmTiles:
    """A GEMM's record and its tiles, kept until all have come (the engine logs the tiles
    first): its critical tile and every device's finish need them all."""

    record: Gemm | None = None
    tiles: dict[int, Tile] = field(default_factory=dict)


class _Reader:
    """Reduces a log's records, given in any order, to a ``Run`` (see ``load_run``).

    Errors are ValueErrors starting ``line N:``. Each record is checked as it comes
    (its device and job exist, its step keeps tiles or totals as the level says, no step
    or device_step twice, no tile or GEMM twice while its GEMM is read), each GEMM once
    its tiles are in, each step at the end (its GEMMs and coordinator spans inside it, the
    steps of a job apart); GEMMs and coordinator spans are checked for overlaps among the
    records kept (the steps shown)."""

    def __init__(self, fleet: tuple[Device, ...], jobs: tuple[Job, ...], level: str,
                 logged: StepRange | None, window: StepRange) -> None:  # fmt: skip
        self.fleet, self.jobs = fleet, jobs
        self.device_ids, self.job_ids = {d.id for d in fleet}, {j.id for j in jobs}
        self.level, self.logged, self.window = level, logged, window
        self.steps: dict[tuple[int, int], _StepSums] = {}
        self.devices: dict[int, _DeviceSums] = defaultdict(_DeviceSums)
        self.gemm_tiles: dict[tuple[int, int], _GemmTiles] = {}
        self.samples: dict[int, list[Sample]] = defaultdict(list)
        self.nic: tuple[list[Interval], list[Interval]] = ([], [])
        self.tiles: list[Tile] = []
        self.gemms: list[Gemm] = []
        self.coords: list[Coord] = []
        self.ooms: list[Oom] = []
        self.span_s = 0.0
        self._add: dict[type, Callable[[Any], None]] = {
            Tile: self._tile, Gemm: self._gemm, Coord: self._coord, Step: self._step,
            DeviceStep: self._device_step, Oom: self._oom, Freq: self._freq,
        }  # fmt: skip

    def add(self, record: Any) -> None:
        self._add[type(record)](record)

    # -- records ------------------------------------------------------------------------

    def _tile(self, t: Tile) -> None:
        self._known(t.line, job=t.job, device=t.device)
        if t.compute[0] < t.down[1] or t.up[0] < t.compute[1]:
            raise ValueError(
                f"line {t.line}: tile {t.tile} of gemm {t.gemm} is out of order: down {t.down}, "
                f"compute {t.compute}, up {t.up}"
            )
        shown = self._detailed(t.line, "tile", t.job, t.step)
        step = self._sums(t.job, t.step)
        step.tiles += 1
        step.bytes_down += t.bytes_down
        step.bytes_up += t.bytes_up
        step.spans(t.down[0], t.up[1])
        device = self.devices[t.device]
        device.tiles += 1
        device.bytes_down += t.bytes_down
        device.bytes_up += t.bytes_up
        device.busy_s += t.compute[1] - t.compute[0]
        device.down_s += t.down[1] - t.down[0]
        device.up_s += t.up[1] - t.up[0]
        device.frequency(t.freq_mhz)
        if t.freq_mhz is not None or t.temp_c is not None:
            sample = (t.compute[0], t.freq_mhz, t.temp_c)
            if shown:  # every tile's state
                self.samples[t.device].append(sample)
            else:  # the step's last tile's, as a steps log has it
                step.samples = step.samples or {}
                if sample[0] >= step.samples.get(t.device, sample)[0]:
                    step.samples[t.device] = sample
        for nic, span in zip(self.nic, (t.nic_down, t.nic_up), strict=True):
            if span is not None:
                nic.append(span)
        mine = self.gemm_tiles.setdefault((t.job, t.gemm), _GemmTiles())
        if t.tile in mine.tiles:
            raise ValueError(f"line {t.line}: repeats the tile of line {mine.tiles[t.tile].line}")
        mine.tiles[t.tile] = t
        if shown:
            self.tiles.append(t)
        self.span_s = max(self.span_s, t.up[1])
        self._gemm_done(t.job, t.gemm, mine)

    def _gemm(self, g: Gemm) -> None:
        self._known(g.line, job=g.job)
        if g.end < g.issue:
            raise ValueError(f"line {g.line}: gemm {g.gemm} ends at {g.end}, before its issue")
        shown = self._detailed(g.line, "gemm", g.job, g.step)
        step = self._sums(g.job, g.step)
        step.gemm_s += g.end - g.issue
        if g.tiles:  # an empty GEMM (no output) is not on the fleet
            step.gemms += 1
        step.segment(g.issue, g.end, g.line)
        mine = self.gemm_tiles.setdefault((g.job, g.gemm), _GemmTiles())
        if mine.record is not None:
            raise ValueError(f"line {g.line}: repeats the gemm of line {mine.record.line}")
        mine.record = g
        if shown:
            self.gemms.append(g)
        self.span_s = max(self.span_s, g.end)
        self._gemm_done(g.job, g.gemm, mine)

    def _coord(self, c: Coord) -> None:
        self._known(c.line, job=c.job)
        if c.t1 < c.t0:
            raise ValueError(f"line {c.line}: coord ends at {c.t1}, before it starts")
        shown = self._detailed(c.line, "coord", c.job, c.step)
        step = self._sums(c.job, c.step)
        step.coord_s += c.t1 - c.t0
        step.segment(c.t0, c.t1, c.line)
        if shown:
            self.coords.append(c)
        self.span_s = max(self.span_s, c.t1)

    def _step(self, s: Step) -> None:
        self._known(s.line, job=s.job)
        if s.t1 < s.t0:
            raise ValueError(f"line {s.line}: step {s.step} ends at {s.t1}, before it starts")
        step = self._sums(s.job, s.step)
        if step.record is not None:
            raise ValueError(f"line {s.line}: repeats the step of line {step.record.line}")
        if not self._logs_tiles(s.step):
            missing = [name for name in STEP_TOTALS if getattr(s, name) is None]
            if missing:
                raise ValueError(f"line {s.line}: step event: a step whose tiles the log does "
                                 f"not keep needs its totals: missing {missing}")  # fmt: skip
        step.record = s
        self.span_s = max(self.span_s, s.t1)

    def _device_step(self, d: DeviceStep) -> None:
        self._known(d.line, job=d.job, device=d.device)
        if self._logs_tiles(d.step):
            raise ValueError(f"line {d.line}: device_step of job {d.job} step {d.step}, whose "
                             "tiles the log keeps")  # fmt: skip
        step = self._sums(d.job, d.step)
        step.devices = step.devices or {}
        if d.device in step.devices:
            raise ValueError(
                f"line {d.line}: repeats the device_step of line {step.devices[d.device]}"
            )
        step.devices[d.device] = d.line
        step.last_in[d.device] += d.last_in
        device = self.devices[d.device]
        device.tiles += d.tiles
        device.bytes_down += d.bytes_down
        device.bytes_up += d.bytes_up
        device.busy_s += d.compute_s
        device.down_s += d.down_s
        device.up_s += d.up_s
        device.last_in += d.last_in
        device.frequency(d.freq_mhz)
        if d.freq_mhz is not None or d.temp_c is not None:  # its last tile's state
            self.samples[d.device].append((d.t, d.freq_mhz, d.temp_c))

    def _oom(self, o: Oom) -> None:
        self._known(o.line, job=o.job, device=o.device)
        step = self._sums(o.job, o.step)
        step.oom += 1
        step.spans(o.t, o.t)
        self.ooms.append(o)
        self.span_s = max(self.span_s, o.t)

    def _freq(self, f: Freq) -> None:
        self._known(f.line, device=f.device)
        self.devices[f.device].frequency(f.freq_mhz)
        self.samples[f.device].append((f.t, f.freq_mhz, f.temp_c))
        self.span_s = max(self.span_s, f.t)

    # -- helpers ------------------------------------------------------------------------

    def _known(self, line: int, *, job: int | None = None, device: int | None = None) -> None:
        if device is not None and device not in self.device_ids:
            raise ValueError(f"line {line}: device {device} is not in run.json's fleet")
        if job is not None and job not in self.job_ids:
            raise ValueError(f"line {line}: job {job} is not in run.json's jobs")

    def _logs_tiles(self, step: int) -> bool:
        return self.logged is not None and step in self.logged

    def _detailed(self, line: int, kind: str, job: int, step: int) -> bool:
        """Whether the records of this step are kept (shown); an error where the log keeps
        only the step's totals."""
        if not self._logs_tiles(step):
            raise ValueError(
                f"line {line}: {kind} of job {job} step {step}, but a log at level {self.level} "
                f"keeps tiles, GEMMs and coordinator spans for {steps_text(self.logged)}"
            )
        return step in self.window

    def _sums(self, job: int, step: int) -> _StepSums:
        sums = self.steps.get((job, step))
        if sums is None:
            sums = self.steps[job, step] = _StepSums()
        return sums

    def _gemm_done(self, job: int, gemm: int, mine: _GemmTiles) -> None:
        if mine.record is not None and len(mine.tiles) >= mine.record.tiles:
            del self.gemm_tiles[job, gemm]
            self._settle(mine)

    def _settle(self, mine: _GemmTiles) -> None:
        """A GEMM whose record and tiles are in: its critical tile, its devices' finishes."""
        g = mine.record
        assert g is not None
        if g.last_tile is None:  # empty: nothing ran
            return
        last = mine.tiles.get(g.last_tile)
        if last is None:
            raise ValueError(
                f"line {g.line}: gemm {g.gemm}'s last_tile {g.last_tile} is not logged"
            )
        if last.device != g.last_device or last.up[1] != g.end or last.down[0] < g.issue:
            raise ValueError(
                f"line {g.line}: gemm {g.gemm} (issue {g.issue}, end {g.end}, last_device "
                f"{g.last_device}) disagrees with its last tile on line {last.line}"
            )
        step = self.steps[g.job, g.step]
        step.critical = step.critical or [0.0] * len(COMPONENTS)
        for i, seconds in enumerate(critical_breakdown(g.issue, last.down, last.compute,
                                                       last.up).values()):  # fmt: skip
            step.critical[i] += seconds
        step.last_in[last.device] += 1
        self.devices[last.device].last_in += 1
        self.devices[last.device].last_in_detail += 1
        finish: dict[int, float] = {}  # each device's last tile back
        for t in mine.tiles.values():
            finish[t.device] = max(finish.get(t.device, 0.0), t.up[1])
        for device in finish:
            self.devices[device].gemms += 1
            self.devices[device].expected_last += 1 / len(finish)
        if len(finish) >= 2 and g.end > g.issue:
            median = statistics.median(finish.values())
            for device, t in finish.items():
                self.devices[device].late((t - median) / (g.end - g.issue))

    # -- the end ------------------------------------------------------------------------

    def run(self, root: Path, meta: dict[str, Any]) -> Run:
        """The run, once every record is in: the checks that need them all, the figures."""
        for mine in self.gemm_tiles.values():
            if mine.record is not None:  # fewer tiles than it says; those of a GEMM that
                self._settle(mine)  # never ended (the run stopped) have no record
        by_job: dict[int, list[Step]] = defaultdict(list)
        for (job, number), step in self.steps.items():
            if step.record is None:
                if step.devices:
                    raise ValueError(f"line {min(step.devices.values())}: device_step of job "
                                     f"{job} step {number}, which is not logged")  # fmt: skip
                continue
            by_job[job].append(step.record)
        kept: dict[int, list[Gemm | Coord]] = defaultdict(list)
        for e in (*self.gemms, *self.coords):
            kept[e.job].append(e)
        for job in self.job_ids:
            _no_overlap(by_job[job], lambda s: (s.t0, s.t1), "step")
            _no_overlap(kept[job], _span, "gemm or coord")
        for (_, number), step in self.steps.items():
            s = step.record
            for span in (step.first, step.last):
                if s is not None and span is not None and not s.t0 <= span[0] <= span[1] <= s.t1:
                    raise ValueError(f"line {span[2]}: {span[:2]} lies outside step {number} "
                                     f"{s.t0, s.t1} (line {s.line})")  # fmt: skip
            for device, sample in (step.samples or {}).items():
                self.samples[device].append(sample)
        return Run(
            path=root, policy=meta["policy"], block=meta["block"],
            coordinator_time=meta["coordinator_time"], level=self.level, logged=self.logged,
            window=self.window, bottleneck=meta["bottleneck"], command=tuple(meta["command"]),
            fleet=self.fleet, jobs=self.jobs,
            steps=tuple(self._figures(key, self.steps[key]) for key in sorted(self.steps)),
            devices={d: sums.figures() for d, sums in sorted(self.devices.items())},
            thermal={d: sorted(s, key=lambda x: x[0]) for d, s in sorted(self.samples.items())},
            nic_busy_s=(union_s(self.nic[0]), union_s(self.nic[1])),
            tiles=tuple(self.tiles), gemms=tuple(self.gemms), coords=tuple(self.coords),
            ooms=tuple(self.ooms), span_s=self.span_s, incomplete=meta.get("incomplete"),
        )  # fmt: skip

    def _figures(self, key: tuple[int, int], sums: _StepSums) -> StepFigures:
        """A step's figures: from its records where the log has them (and for a step never
        closed, from what it logged), else from its step record's totals."""
        job, number = key
        s, detail = sums.record, self._logs_tiles(number)
        last_in = tuple((d, n) for d, n in sums.last_in.most_common() if n)
        t0, t1, local = (sums.t0, sums.t1, 0) if s is None else (s.t0, s.t1, s.local_gemms)
        if s is None or detail:
            critical = tuple(sums.critical or [0.0] * len(COMPONENTS))
            return StepFigures(job, number, s is not None, t0, t1, sums.coord_s, sums.gemm_s,
                               sums.gemms, local, sums.tiles, sums.bytes_down, sums.bytes_up,
                               sums.oom, critical, last_in, detail)  # fmt: skip
        assert s.coord_s is not None and s.gemm_s is not None and s.tiles is not None
        assert s.bytes_down is not None and s.bytes_up is not None  # checked: ``_step``
        return StepFigures(job, number, True, t0, t1, s.coord_s, s.gemm_s, s.gemms, local,
                           s.tiles, s.bytes_down, s.bytes_up, sums.oom,
                           tuple(getattr(s, c) for c in COMPONENTS), last_in, False)  # fmt: skip


def _span(e: Gemm | Coord) -> Interval:
    return (e.issue, e.end) if isinstance(e, Gemm) else (e.t0, e.t1)


def _no_overlap(events: list[Any], span: Callable[[Any], Interval], what: str) -> None:
    """One job does one thing at a time: its steps, and its GEMMs and coordinator spans."""
    ordered = sorted(events, key=span)
    for before, after in itertools.pairwise(ordered):
        if span(after)[0] < span(before)[1]:
            raise ValueError(
                f"line {after.line}: {what} {span(after)} overlaps line {before.line}'s "
                f"{span(before)} of the same job"
            )


def steps_text(steps: StepRange | None) -> str:
    """A range of steps in words: 'every step', 'steps 1-50', 'steps up to 1000'."""
    if steps is None:
        return "no step"
    first, last = steps.first, steps.last
    if first is None and last is None:
        return "every step"
    if first == last:
        return f"step {first}"
    if first is None:
        return f"steps up to {last}"
    return f"steps from {first}" if last is None else f"steps {first}-{last}"


# -- summarising -----------------------------------------------------------------------------


def union_s(intervals: Iterable[Interval]) -> float:
    """Seconds covered by at least one interval: a FIFO's busy time."""
    total, end = 0.0, -math.inf
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


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
    for seg in sorted((*run.gemms, *run.coords), key=_span):
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


# -- text ------------------------------------------------------------------------------------


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
            f"{STEPS_LOG_LACKS}: run with --events auto or full for them"
        )
    else:
        out += _detail_text(summary)
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
        first, left_out, last = elide(job["steps"])
        rows += [_step_row(s) for s in first]
        if left_out:
            rows.append(elided_line(left_out, "summary.json or --json has every step"))
            rows += [_step_row(s) for s in last]
    t = summary["totals"]
    rows.append(
        f"{'all':>10} {t['emulated_s']:>11.4f} {t['coordinator_s']:>9.4f} {t['gemm_s']:>9.4f} "
        f"{t['gemms']:>6} {t['local_gemms']:>6} {t['tiles']:>7} "
        f"{format_bytes(t['bytes_down']):>10} {format_bytes(t['bytes_up']):>10} {t['oom']:>4}"
    )
    return rows


def _step_row(s: dict[str, Any]) -> str:
    mark = "" if s["complete"] else "  (incomplete)"
    return (
        f"{s['job']:>4} {s['step']:>5} {s['emulated_s']:>11.4f} "
        f"{s['coordinator_s']:>9.4f} {s['gemm_s']:>9.4f} {s['gemms']:>6} "
        f"{s['local_gemms']:>6} {s['tiles']:>7} {format_bytes(s['bytes_down']):>10} "
        f"{format_bytes(s['bytes_up']):>10} {s['oom']:>4}{mark}"
    )


def _devices_table(summary: dict[str, Any]) -> list[str]:
    devices = sorted(summary["devices"], key=lambda d: (-d["utilisation"], d["id"]))
    shown = devices[:TOP_DEVICES]
    every = summary["run"]["detail"]["every_step_logged"]
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
            f"{_maybe(d['lateness'], '+.3f'):>9} {_last_in(d, every):>9}"
        )
    return rows


def _last_in(device: dict[str, Any], every: bool) -> str:
    """Critical tiles of GEMMs taken part in; their count alone where the log lacks the
    tiles of some steps (``every`` False), which the GEMMs taken part in need."""
    if not every:
        return str(device["last_in"])
    return f"{device['last_in']}/{device['gemms']}"


def _detail_text(summary: dict[str, Any]) -> list[str]:
    """Which steps the trace, timeline.png and the critical-path segments show, when that
    is not every step, and how to see others."""
    detail, steps = summary["run"]["detail"], summary["totals"]["steps"]
    shown = sum(s["steps"] for s in detail["shown"])
    if shown == steps:
        return []
    which = "; ".join(
        f"job {s['job']} steps {s['first']}-{s['last']}" if s["first"] != s["last"]
        else f"job {s['job']} step {s['first']}"
        for s in detail["shown"]
    ) or "no step"  # fmt: skip
    logged = StepRange.parse(detail["logged"])
    return [
        f"detail: trace.json, timeline.png and the critical-path segments show {which} of "
        f"{steps} steps (--detail-steps {detail['window']}); the log has every tile of "
        f"{steps_text(logged)}"
        + ("" if logged == StepRange() else " of each job, and each step's totals after them"),
        f"  {OTHER_STEPS.replace('RUN_DIR', summary['run']['path'])}",
    ]


def _stragglers_text(summary: dict[str, Any]) -> list[str]:
    stragglers = summary["stragglers"]["devices"]
    head = f"stragglers (lateness >= {STRAGGLER_LATENESS} of a GEMM's duration):"
    if stragglers is None:
        return [f"{head} not known from a steps log"]
    if not summary["run"]["detail"]["every_step_logged"]:
        head = head[:-2] + ", over the steps whose tiles the log has):"
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


def write_reports(
    run_dir: str | Path, *, plots: bool = True, detail: StepRange = DEFAULT_DETAIL
) -> list[Path]:
    """Load and summarise the run in ``run_dir`` and write its reports there; their paths."""
    run = load_run(run_dir, detail)
    return write_report_files(run, summarize(run), plots=plots)


def write_report_files(run: Run, summary: dict[str, Any], *, plots: bool = True) -> list[Path]:
    """``summary.json``, ``trace.json`` and (with ``plots``) the PNGs, in the run directory."""
    from .trace import write_trace

    summary_path, trace_path = run.path / SUMMARY_FILE, run.path / TRACE_FILE
    with summary_path.open("w") as f:  # written as it is encoded: a long run has many steps
        json.dump(summary, f, indent=1)
        f.write("\n")
    write_trace(run, trace_path)
    paths = [summary_path, trace_path]
    if plots:
        from .plots import write_plots

        paths += write_plots(run, summary, run.path)
    return paths

"""The records of a run directory, checked: run.json's and the event log's, line by line.

A report built on a garbled record would be quietly wrong, so every field is checked
against its type as it is read (``docs/REPORTS.md`` has the format), and an error names
the file and the line. The log is streamed: ``read_events`` yields its records one at a
time, and checks its line count and digest against run.json's once it is read.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from morphling.proxy.vtime.eventlog import (
    COMPRESSED_EVENTS_FILE,
    EVENT_LEVELS,
    EVENTS_FILE,
    RUN_FORMAT,
)

FORMAT_VERSION = 1
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


_KINDS: dict[str, type] = {
    "tile": Tile,
    "gemm": Gemm,
    "coord": Coord,
    "step": Step,
    "oom": Oom,
    "freq": Freq,
    "device_step": DeviceStep,
}


def _list(meta: dict[str, Any], key: str) -> list[Any]:
    value = meta.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {key!r} must be a non-empty list, got {value!r}")
    return value


def read_fleet(meta_file: Path, meta: dict[str, Any]) -> tuple[tuple[Device, ...], tuple[Job, ...]]:
    """run.json's devices and jobs, each checked, their ids unique."""
    try:
        fleet = tuple(_record(Device, d) for d in _list(meta, "fleet"))
        jobs = tuple(_record(Job, j) for j in _list(meta, "jobs"))
        for what, ids in (("fleet", [d.id for d in fleet]), ("jobs", [j.id for j in jobs])):
            if len(set(ids)) != len(ids):
                raise ValueError(f"field {what!r} repeats an id: {ids}")
    except ValueError as exc:
        raise RunError(f"{meta_file}: {exc}") from exc
    return fleet, jobs


def read_meta(meta_file: Path) -> dict[str, Any]:
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


def read_events(events_file: Path, meta: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    """Every known event with its line number, in log order; unknown kinds are skipped
    (newer engines). When run.json has the log's line count (``events``) and sha256
    (``digest``, of the lines uncompressed), they must match: a log cut short by a crash or
    edited afterwards is not silently reported on. A compressed log is read as a stream, as
    it was written."""
    digest, line = hashlib.sha256(), 0
    opener = gzip.open if events_file.name.endswith(".gz") else open
    try:
        with opener(events_file, "rb") as f:
            for line, raw in enumerate(f, 1):
                digest.update(raw)
                record = _read_event(raw, f"{events_file} line {line}", line)
                if record is not None:
                    yield line, record
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

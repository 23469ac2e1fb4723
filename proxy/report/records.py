"""The records of a run directory, checked: run.json's and the event log's, line by line.

A report built on a garbled record would be quietly wrong, so every field is checked
against its type as it is read (``docs/REPORTS.md`` has the format), and an error names
the file and the line. The log's records are the engine's own (``vtime.eventlog``: one
class per kind), built here from each line by their fields' types. The log is streamed:
``read_events`` yields its records one at a time, and checks its line count and digest
against run.json's once it is read.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, NewType, TypeVar, cast, get_type_hints

from morphling.proxy.vtime.collectives import ALGORITHMS
from morphling.proxy.vtime.engine import Span
from morphling.proxy.vtime.eventlog import (
    COMPRESSED_EVENTS_FILE,
    EVENT_LEVELS,
    EVENTS_FILE,
    KINDS,
    RUN_FORMAT,
    Record,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FORMAT_VERSION = 1
Rate = NewType("Rate", float)  # bytes/s: the ``ideal`` link preset's is infinite


class RunError(ValueError):
    """A directory that is not a run, or a run whose files are garbled or inconsistent."""


# -- run.json --------------------------------------------------------------------------------


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
class Meta:
    """run.json, checked: the run's settings and what it says of its log. Its fleet and
    jobs are checked apart (``read_fleet``), once the run is known to have a log."""

    policy: str
    block: int
    auto_block: bool  # greedy chose each GEMM's tile edge, up to ``block``
    coordinator_time: str
    level: str  # what the log keeps: ``EVENT_LEVELS``
    detail_steps: int | None  # ``auto``: the steps of each job whose tiles the log has
    event_file: str
    command: tuple[str, ...]
    incomplete: str | None  # why the run ended early
    bottleneck: dict[str, float] | None  # its parameters
    collective: str | None  # the ranks' collectives' algorithm (None: a run before ranks)
    lines: int | None  # the log's line count and sha256, when the engine wrote them
    digest: str | None
    fleet: object  # as read, for ``read_fleet``
    jobs: object
    verification: Verification | None = None  # None: an engine before tile verification
    # replay's classes: each timed replayed rank's device → the devices of the ranks
    # mirroring it, which have its figures and no records of their own
    mirrors: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Verification:
    """run.json's ``verification``: which tiles were checked, and the devices quarantined."""

    mode: str
    checked: int
    wrong: int
    screened_out: int  # those the screen sent to the float64 recomputation
    sampled_out: int  # tiles ``sample:P`` left unchecked
    check_errors: int  # tiles whose check could not run (taken unchecked, logged)
    quarantines: tuple[dict[str, object], ...]  # each: device, name, request, tile, evidence


# -- field checks: one per field type, shared by every record ------------------------------

Check = Callable[[object, str], object]


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


def _interval(value: object, name: str) -> Span:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"field {name!r} must be [start, end], got {value!r}")
    t0, t1 = (_nonnegative(v, name) for v in value)
    if t1 < t0:
        raise ValueError(f"field {name!r} ends before it starts: {value!r}")
    return t0, t1


def _nullable(check: Check) -> Check:
    return lambda value, name: None if value is None else check(value, name)


def _by_op(check: Check) -> Check:
    """An object of op class → a value ``check`` takes (a coordinator span's split)."""

    def checked(value: object, name: str) -> dict[str, object]:
        if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
            raise ValueError(f"field {name!r} must be an object of op classes, got {value!r}")
        return {op: check(v, f"{name}.{op}") for op, v in value.items()}

    return checked


# By the field's type. A time, a byte count or a duration is never negative.
_CHECKS: dict[object, Check] = {
    int: _count,
    str: _text,
    float: _nonnegative,
    Rate: _rate,
    Span: _interval,
    Span | None: _nullable(_interval),
    float | None: _nullable(_finite),
    int | None: _nullable(_count),
    dict[str, int] | None: _nullable(_by_op(_count)),
    dict[str, float] | None: _nullable(_by_op(_nonnegative)),
}
D = TypeVar("D", bound="DataclassInstance")


@cache
def _fields(cls: type[DataclassInstance]) -> list[tuple[str, Check, bool]]:
    """Each field of a record class: its name, its check and whether it is required."""
    hints = get_type_hints(cls)
    return [(f.name, _CHECKS[hints[f.name]], f.default is MISSING) for f in fields(cls)]


def parse(cls: type[D], obj: object) -> D:
    """A ``cls`` from a JSON object: each field checked; fields with a default may be
    absent, fields it does not know are ignored."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {obj!r}")
    values: dict[str, object] = {}
    for name, check, required in _fields(cls):
        if name in obj:
            values[name] = check(obj[name], name)
        elif required:
            raise ValueError(f"missing field {name!r}")
    return cast(Callable[..., D], cls)(**values)


# -- reading ---------------------------------------------------------------------------------


def read_meta(meta_file: Path) -> Meta:
    """run.json, checked but for its fleet and jobs."""
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{meta_file}: cannot read it as JSON: {exc}") from exc
    try:
        return _meta(meta)
    except ValueError as exc:
        raise RunError(f"{meta_file}: {exc}") from exc


def _meta(meta: object) -> Meta:
    if not isinstance(meta, dict):
        raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
    if meta.get("format", RUN_FORMAT) != RUN_FORMAT:
        raise ValueError(f"field 'format' is {meta['format']!r}, not {RUN_FORMAT!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"field 'version' is {meta.get('version')!r}; this reader knows {FORMAT_VERSION}"
        )
    for key in ("policy", "coordinator_time", "block"):
        if key not in meta:
            raise ValueError(f"missing field {key!r}")
    level = meta.get("event_log", "full")  # older engines logged everything
    if level not in EVENT_LEVELS:
        raise ValueError(f"field 'event_log' must be one of {EVENT_LEVELS}, got {level!r}")
    detail_steps = None
    if level == "auto":
        detail_steps = _count(meta.get("event_detail_steps"), "event_detail_steps")
        if detail_steps < 1:
            raise ValueError("field 'event_detail_steps' must be >= 1")
    # older engines wrote it uncompressed; a name, not a path: the log is in the run
    name = meta.get("event_file", EVENTS_FILE)
    if level != "off" and name not in (EVENTS_FILE, COMPRESSED_EVENTS_FILE):
        raise ValueError(
            f"field 'event_file' must be {EVENTS_FILE!r} or {COMPRESSED_EVENTS_FILE!r}, "
            f"got {name!r}"
        )
    command = meta.get("command", [])  # descriptive only: may be left out
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
            raise ValueError(f"field 'bottleneck' must be null or an object, got {bottleneck!r}")
        bottleneck = {k: _rate(v, f"bottleneck.{k}") for k, v in bottleneck.items()}
    collective = meta.get("collective")
    if collective is not None and collective not in ALGORITHMS:
        raise ValueError(f"field 'collective' must be one of {ALGORITHMS}, got {collective!r}")
    auto_block = meta.get("auto_block", False)  # older engines had one edge
    if not isinstance(auto_block, bool):
        raise ValueError(f"field 'auto_block' must be a bool, got {auto_block!r}")
    lines, digest = meta.get("events"), meta.get("digest")
    verification = meta.get("verification")
    return Meta(
        policy=_text(meta["policy"], "policy"),
        block=_count(meta["block"], "block"),
        auto_block=auto_block,
        coordinator_time=_text(meta["coordinator_time"], "coordinator_time"),
        level=level,
        detail_steps=detail_steps,
        event_file=_text(name, "event_file"),
        command=tuple(command),
        incomplete=incomplete,
        bottleneck=bottleneck,
        collective=collective,
        lines=None if lines is None else _count(lines, "events"),
        digest=None if digest is None else _text(digest, "digest"),
        fleet=meta.get("fleet"),
        jobs=meta.get("jobs"),
        verification=None if verification is None else _verification(verification),
        mirrors=_mirrors(meta.get("replay")),
    )


def _mirrors(replay: object) -> dict[int, tuple[int, ...]]:
    """run.json's ``replay.mirrors``, as ``Meta.mirrors``."""
    if replay is None:
        return {}
    if not isinstance(replay, dict) or not isinstance(replay.get("mirrors", []), list):
        raise ValueError("field 'replay' must be an object whose 'mirrors' is a list")
    mirrors = {}
    for m in replay.get("mirrors", []):
        if not isinstance(m, dict):
            raise ValueError(f"field 'replay.mirrors': {m!r:.80} is not an object")
        devices = m.get("devices")
        if not isinstance(devices, list):
            raise ValueError(f"field 'replay.mirrors': {m!r:.80} lacks a list 'devices'")
        timed = _count(m.get("device"), "replay.mirrors.device")
        mirrors[timed] = tuple(_count(d, "replay.mirrors.devices") for d in devices)
    return mirrors


def _verification(value: object) -> Verification:
    if not isinstance(value, dict):
        raise ValueError(f"field 'verification' must be null or an object, got {value!r}")
    quarantines = value.get("quarantines", [])
    if not isinstance(quarantines, list):
        raise ValueError("field 'verification.quarantines' must be a list")
    for q in quarantines:
        if not isinstance(q, dict) or not {"device", "name", "tile", "evidence"} <= q.keys():
            raise ValueError(f"field 'verification.quarantines': {q!r:.80} lacks a field")
    return Verification(
        mode=_text(value.get("mode"), "verification.mode"),
        checked=_count(value.get("checked"), "verification.checked"),
        wrong=_count(value.get("wrong"), "verification.wrong"),
        screened_out=_count(value.get("screened_out", 0), "verification.screened_out"),
        sampled_out=_count(value.get("sampled_out", 0), "verification.sampled_out"),
        check_errors=_count(value.get("check_errors", 0), "verification.check_errors"),
        quarantines=tuple(quarantines),
    )


def read_fleet(meta_file: Path, meta: Meta) -> tuple[tuple[Device, ...], tuple[Job, ...]]:
    """run.json's devices and jobs, each checked, their ids unique."""
    try:
        fleet = tuple(parse(Device, d) for d in _listed(meta.fleet, "fleet"))
        jobs = tuple(parse(Job, j) for j in _listed(meta.jobs, "jobs"))
        for what, ids in (("fleet", [d.id for d in fleet]), ("jobs", [j.id for j in jobs])):
            if len(set(ids)) != len(ids):
                raise ValueError(f"field {what!r} repeats an id: {ids}")
    except ValueError as exc:
        raise RunError(f"{meta_file}: {exc}") from exc
    return fleet, jobs


def _listed(value: object, key: str) -> list[object]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {key!r} must be a non-empty list, got {value!r}")
    return value


def read_events(events_file: Path, meta: Meta) -> Iterator[tuple[int, Record]]:
    """Every known record with its line number, in log order; unknown kinds are skipped
    (newer engines). When run.json has the log's line count (``events``) and sha256
    (``digest``, of the lines uncompressed), they must match: a log cut short by a crash or
    edited afterwards is not silently reported on. A compressed log is read as a stream, as
    it was written."""
    digest, line = hashlib.sha256(), 0
    try:
        with _open(events_file) as f:
            for line, raw in enumerate(f, 1):
                digest.update(raw)
                record = _read_event(raw, f"{events_file} line {line}")
                if record is not None:
                    yield line, record
    except (OSError, EOFError, gzip.BadGzipFile) as exc:  # EOFError: a stream cut short
        raise RunError(f"{events_file}: cannot read it: {exc}") from exc
    if meta.lines is not None and meta.lines != line:
        raise RunError(
            f"{events_file} has {line} lines but run.json says {meta.lines}: "
            "the log is incomplete or was appended to"
        )
    if meta.digest is not None and meta.digest != digest.hexdigest():
        raise RunError(f"{events_file} does not match run.json's digest: it changed after the run")


def _open(events_file: Path) -> gzip.GzipFile | io.BufferedReader:
    """The log's lines, uncompressed (older engines wrote them so)."""
    if events_file.name.endswith(".gz"):
        return gzip.open(events_file, "rb")
    return events_file.open("rb")


def _read_event(raw: bytes, where: str) -> Record | None:
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
    kind = KINDS.get(obj["ev"])
    if kind is None:
        return None
    try:
        return parse(kind, obj)
    except ValueError as exc:
        raise RunError(f"{where}: {obj['ev']} event: {exc}") from exc

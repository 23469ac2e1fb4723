"""When each device is there, in virtual time: availability traces and a churn model.

A device that leaves takes no more tiles until it is back; the tiles it had not sent
back by then are placed again on the devices that are there (``Timeline``). This module
only says when: each device's *absences*, (leave, back) pairs in order, ``back`` being
infinity for one that never returns.

Three sources, each a clear error naming the file, line and field before anything runs:

- a CSV of ``device,start,end`` lines (a header line is allowed, ``#`` starts a comment):
  the device is there from ``start`` to ``end`` seconds of virtual time (``end`` empty or
  ``inf``: to the end). A device may have several lines; outside them it is away. A
  device the file does not name is always there.
- FedScale's ``client_behave_trace`` shape, as JSON: ``{client: {"active": [...],
  "inactive": [...], "finish_time": T, ...}}``, the client there from ``active[i]`` to
  ``inactive[i]``, the whole repeating every ``finish_time`` seconds as FedScale reads it.
  FedScale ships it as a pickle, which Morphling does not load (a pickle runs code):
  ``json.dump(pickle.load(f), out)`` converts it. Clients are fleet device names, or
  FedScale's numeric ids, bound in ascending order to the fleet's devices in fleet order
  (the first N clients for a fleet of N; a trace of ids needs the fleet's names up front,
  which ``morphling run --embedded`` has).
- ``--churn mtbf=S,mttr=S[,seed=N]``: each device up for an exponential time of mean
  ``mtbf`` seconds, then away for one of mean ``mttr``, and so on, drawn from a generator
  seeded by ``seed`` and the device's name (a device's churn does not depend on when it
  joined or on the other devices).
"""

from __future__ import annotations

import csv
import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

Absence = tuple[float, float]  # (leave, back) in virtual seconds; back: inf, never
Span = tuple[float, float]  # (start, end) of a time it is there


class Availability(Protocol):
    """Each device's absences, by its name, in order of time."""

    def absences(self, name: str) -> Iterator[Absence]: ...


@dataclass(frozen=True)
class Presence:
    """When one device is there: ``spans`` in order, not overlapping, repeated every
    ``period`` seconds (None: once)."""

    spans: tuple[Span, ...]
    period: float | None = None

    def absences(self) -> Iterator[Absence]:
        if not self.spans:  # never there
            yield 0.0, math.inf
            return
        here_until, offset = 0.0, 0.0
        while True:
            away = False  # in this period
            for start, end in self.spans:
                if start + offset > here_until:
                    away = True
                    yield here_until, start + offset
                here_until = end + offset
            if self.period is None:
                if here_until < math.inf:
                    yield here_until, math.inf
                return
            if not away and here_until >= offset + self.period:  # there all the time
                return
            offset += self.period


@dataclass(frozen=True)
class Trace:
    """Absences from a trace file: its devices' ``Presence`` by name (the rest: there)."""

    devices: Mapping[str, Presence]

    def absences(self, name: str) -> Iterator[Absence]:
        presence = self.devices.get(name)
        return iter(()) if presence is None else presence.absences()


@dataclass(frozen=True)
class Churn:
    """Absences drawn at random: see the module docstring."""

    mtbf_s: float
    mttr_s: float
    seed: int = 0

    def absences(self, name: str) -> Iterator[Absence]:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        t = 0.0
        while True:
            leave = t + float(rng.exponential(self.mtbf_s))
            t = leave + float(rng.exponential(self.mttr_s))
            yield leave, t


def parse_churn(spec: str) -> Churn:
    """``mtbf=S,mttr=S[,seed=N]``; ValueError naming what does not parse."""
    form = "expected mtbf=SECONDS,mttr=SECONDS[,seed=N]"
    values: dict[str, str] = {}
    for part in spec.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or key not in ("mtbf", "mttr", "seed"):
            raise ValueError(f"--churn {spec!r}: {part.strip()!r} is not a setting: {form}")
        if key in values:
            raise ValueError(f"--churn {spec!r}: {key} is given twice")
        values[key] = value
    missing = [key for key in ("mtbf", "mttr") if key not in values]
    if missing:
        raise ValueError(f"--churn {spec!r}: {' and '.join(missing)} missing: {form}")
    seconds = {}
    for key in ("mtbf", "mttr"):
        try:
            seconds[key] = float(values[key])
        except ValueError:
            seconds[key] = math.nan
        if not 0 < seconds[key] < math.inf:
            raise ValueError(f"--churn {spec!r}: {key}={values[key]!r} is not seconds > 0")
    try:
        seed = int(values.get("seed", "0"))
    except ValueError:
        seed = -1
    if seed < 0:
        raise ValueError(f"--churn {spec!r}: seed={values['seed']!r} is not an integer >= 0")
    return Churn(seconds["mtbf"], seconds["mttr"], seed)


def _seconds(text: str, where: str, field: str, *, end: bool = False) -> float:
    value = text.strip()
    if end and value in ("", "inf"):
        return math.inf
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{where}: {field} {text!r} is not a time in seconds >= 0")
    return seconds


def _spans(spans: list[Span], where: str) -> tuple[Span, ...]:
    """Sorted, touching or overlapping ones merged; ValueError for one that ends first."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if end < start:
            raise ValueError(f"{where}: ends at {end} before it starts at {start}")
        if end == start:  # (there for an instant: FedScale's windows are closed)
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return tuple(merged)


def _read_csv(path: Path, text: str) -> dict[str, Presence]:
    spans: dict[str, list[Span]] = {}
    for number, row in enumerate(csv.reader(text.splitlines()), start=1):
        where = f"{path}:{number}"
        if not row or row[0].strip().startswith("#"):
            continue
        if [c.strip().lower() for c in row] == ["device", "start", "end"]:
            continue  # the header
        if len(row) != 3 or not row[0].strip():
            raise ValueError(f"{where}: expected device,start,end, got {','.join(row)!r}")
        start = _seconds(row[1], where, "start")
        end = _seconds(row[2], where, "end", end=True)
        if end <= start:
            raise ValueError(f"{where}: end {row[2].strip()!r} is not after start {start}")
        spans.setdefault(row[0].strip(), []).append((start, end))
    return {name: Presence(_spans(s, f"{path}: device {name!r}")) for name, s in spans.items()}


def _read_fedscale(path: Path, data: object) -> dict[str, Presence]:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of clients (FedScale's client_behave_trace)")
    devices = {}
    for client, trace in data.items():
        where = f"{path}: client {client!r}"
        if not isinstance(trace, dict):
            raise ValueError(f"{where}: expected an object with active, inactive, finish_time")
        for key in ("active", "inactive", "finish_time"):
            if key not in trace:
                raise ValueError(f"{where}: no {key!r}")
        active, inactive = trace["active"], trace["inactive"]
        if not isinstance(active, list) or not isinstance(inactive, list):
            raise ValueError(f"{where}: active and inactive must be lists of seconds")
        if len(active) != len(inactive) or not active:
            raise ValueError(
                f"{where}: {len(active)} active and {len(inactive)} inactive times: expected "
                "as many of each, at least one"
            )
        period = _number(trace["finish_time"], where, "finish_time")
        if period <= 0:
            raise ValueError(f"{where}: finish_time {period} must be > 0")
        spans = [
            (_number(a, where, f"active[{i}]"), _number(b, where, f"inactive[{i}]"))
            for i, (a, b) in enumerate(zip(active, inactive, strict=True))
        ]
        merged = _spans(spans, where)
        if merged and merged[-1][1] > period:
            raise ValueError(f"{where}: inactive time {merged[-1][1]} past finish_time {period}")
        devices[str(client)] = Presence(merged, period)
    return devices


def _number(value: object, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"{where}: {field} {value!r} is not a time in seconds >= 0")
    return float(value)


def read_trace(path: Path) -> dict[str, Presence]:
    """The devices a trace file names, with when each is there (by content: a JSON object
    is FedScale's shape, anything else the CSV); ValueError naming the file, line and field."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a spreadsheet's BOM too)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"availability trace {path}: cannot read it: {exc}") from None
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
        return _read_fedscale(path, data)
    return _read_csv(path, text)


def bind(devices: Mapping[str, Presence], fleet: Sequence[str] | None, path: Path) -> Trace:
    """The trace for a fleet of these names (in fleet order; None: not known, devices join
    as they come): by name, or, for a trace of FedScale's numeric client ids, by position;
    ValueError for names the fleet lacks."""
    if fleet is None:
        if devices and all(name.isdigit() for name in devices):
            raise ValueError(
                f"availability trace {path}: its clients are numeric ids, which bind to a "
                "fleet's devices in order: that needs the fleet (morphling run --embedded), "
                "or name the devices in the trace"
            )
        return Trace(devices)
    if devices and all(name.isdigit() for name in devices) and not set(devices) & set(fleet):
        ids = sorted(devices, key=int)
        return Trace({name: devices[client] for name, client in zip(fleet, ids, strict=False)})
    unknown = sorted(set(devices) - set(fleet))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(
            f"availability trace {path}: names devices the fleet lacks: "
            f"{', '.join(unknown[:5])}{more} (the fleet's "
            f"are {', '.join(fleet[:3])}{', ...' if len(fleet) > 3 else ''})"
        )
    return Trace(devices)

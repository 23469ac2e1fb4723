"""The SM-count trace a green-context GPU follows: the ``# greenctx_trace v2`` format.

A trace is a CSV of ``timestamp,num_sms,tag`` lines after a version line and optional
``# key=value`` directives; the SM count is a step function of the timestamp, which is a
step index or a time since the first GEMM. Every fault names the line and the problem.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

TIME_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}  # microseconds per unit
_VERSION_LINE = "# greenctx_trace v2"
_DIRECTIVES = {"time_unit": tuple(TIME_UNITS), "semantics": ("step_function",)}
_DIRECTIVE = re.compile(r"([A-Za-z_]\w*)\s*=\s*(\S*)")
_COLUMNS = ("timestamp", "num_sms", "tag")


class TraceError(ValueError):
    """A trace that does not follow the format; the message names the line and the problem."""


@dataclass(frozen=True, slots=True)
class TracePoint:
    timestamp: float  # in the trace's time unit, or a step index
    num_sms: int
    tag: str
    line: int


@dataclass(frozen=True, slots=True)
class GreenTrace:
    """SM count as a step function: each point holds until the next one's timestamp."""

    points: tuple[TracePoint, ...]
    time_unit: str = "us"
    source: str = "<trace>"

    @classmethod
    def load(cls, path: str | Path) -> GreenTrace:
        return cls.parse(Path(path).read_text(), source=str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<trace>") -> GreenTrace:
        """Parse and validate a ``# greenctx_trace v2`` trace; ``TraceError`` on any fault."""
        versioned = False
        directives: dict[str, str] = {}
        points: list[TracePoint] = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            where = f"{source}, line {number}"
            if not line:
                continue
            if not versioned:
                if " ".join(line.lstrip("#").split()) != _VERSION_LINE.lstrip("# "):
                    raise TraceError(f"{where}: expected {_VERSION_LINE!r} first, got {line!r}")
                versioned = True
            elif line.startswith("#"):
                _directive(line, where, directives, bool(points))
            elif tuple(f.strip() for f in line.split(",")) in (_COLUMNS, _COLUMNS[:2]):
                if points:
                    raise TraceError(f"{where}: column header after data lines")
            else:
                points.append(_point(line, number, where, points))
        if not versioned:
            raise TraceError(f"{source}: empty; expected {_VERSION_LINE!r}, then data lines")
        if not points:
            raise TraceError(f"{source}: no data lines (timestamp,num_sms,tag)")
        return cls(tuple(points), directives.get("time_unit", "us"), source)

    def at_step(self, step: int) -> TracePoint:
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        return self._at(step)

    def at_us(self, elapsed_us: float) -> TracePoint:
        """The point in force ``elapsed_us`` microseconds after the start."""
        return self._at(elapsed_us / TIME_UNITS[self.time_unit])

    def _at(self, t: float) -> TracePoint:
        return self.points[max(0, bisect_right(self.points, t, key=_timestamp) - 1)]

    def check_steps(self) -> None:
        """In ``clock_mode="step"`` timestamps are step indices: they must be whole numbers."""
        for p in self.points:
            if p.timestamp != int(p.timestamp):
                raise TraceError(
                    f"{self.source}, line {p.line}: timestamp {p.timestamp:g} is not a whole "
                    "step index (clock_mode=step)"
                )


def _timestamp(point: TracePoint) -> float:
    return point.timestamp


def _directive(line: str, where: str, seen: dict[str, str], after_data: bool) -> None:
    """Record a ``# key=value`` line in ``seen``; other ``#`` lines are comments."""
    match = _DIRECTIVE.fullmatch(line[1:].strip())
    if match is None:
        return
    key, value = match.groups()
    if key not in _DIRECTIVES:
        known = ", ".join(sorted(_DIRECTIVES))
        raise TraceError(f"{where}: unknown directive {key!r} (known: {known})")
    if after_data:
        raise TraceError(f"{where}: directive {key!r} after data lines; put it before them")
    if key in seen:
        raise TraceError(f"{where}: {key} given twice")
    if value not in _DIRECTIVES[key]:
        allowed = "|".join(_DIRECTIVES[key])
        raise TraceError(f"{where}: {key}={value!r} is not one of {allowed}")
    seen[key] = value


def _point(line: str, number: int, where: str, before: list[TracePoint]) -> TracePoint:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) not in (2, 3):
        raise TraceError(f"{where}: expected timestamp,num_sms,tag; got {len(fields)} fields")
    try:
        timestamp = float(fields[0])
    except ValueError:
        raise TraceError(f"{where}: timestamp {fields[0]!r} is not a number") from None
    if not math.isfinite(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: timestamp {fields[0]} must be a finite number >= 0")
    try:
        num_sms = int(fields[1])
    except ValueError:
        raise TraceError(f"{where}: num_sms {fields[1]!r} is not an integer") from None
    if num_sms < 1:
        raise TraceError(f"{where}: num_sms {num_sms} must be >= 1")
    if not before and timestamp != 0:
        raise TraceError(
            f"{where}: the first timestamp is {fields[0]}; it must be 0, so that the SM count "
            "is defined from the start"
        )
    if before and timestamp <= before[-1].timestamp:
        prev = before[-1]
        raise TraceError(
            f"{where}: timestamp {fields[0]} does not come after {prev.timestamp:g} "
            f"(line {prev.line}); timestamps must increase"
        )
    return TracePoint(timestamp, num_sms, fields[2] if len(fields) == 3 else "", number)

"""How sizes and long tables read in a terminal: shared by the reports and the commands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# A table longer than this shows its first and last rows, and says how many it left out.
FIRST_ROWS, LAST_ROWS = 20, 10


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': binary units, as memory and link sizes are quoted."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size(nbytes: int) -> str:
    """The shortest exact binary spelling, as sizes are given on command lines: ``64KiB``,
    ``4MiB``, ``1000B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def elide(rows: Sequence[T]) -> tuple[Sequence[T], int, Sequence[T]]:
    """(first rows, how many are left out, last rows) of a table: a 60,000-step run's
    table is no use on a terminal; every row stays in the JSON."""
    if len(rows) <= FIRST_ROWS + LAST_ROWS + 1:
        return rows, 0, ()
    return rows[:FIRST_ROWS], len(rows) - FIRST_ROWS - LAST_ROWS, rows[-LAST_ROWS:]


def elided_line(left_out: int, where: str) -> str:
    """The row that stands for the rows ``elide`` left out."""
    return f"  ... {left_out} more rows ({where}) ..."

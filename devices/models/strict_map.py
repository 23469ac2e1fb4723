"""Strict parsing of the maps profiles and models arrive as (TOML files, HELLO frames).

A key nobody reads is a typo or a version mismatch, and a missing one must not
quietly become a default, so both are errors that name the keys; values are
quoted short, since they may come from an untrusted peer.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

REPR_LIMIT = 60


def short(value: object) -> str:
    """``repr`` cut to a length fit for an error message about untrusted input."""
    text = repr(value)
    return text if len(text) <= REPR_LIMIT else text[: REPR_LIMIT - 3] + "..."


def check_keys(
    what: str, d: object, known: Collection[str], required: Collection[str] | None = None
) -> dict[str, Any]:
    """``d`` itself once it is a map with only ``known`` keys and every ``required``
    one (default: all known); a ValueError naming ``what`` and the keys otherwise."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a map, got {type(d).__name__}")
    unknown = sorted(short(key) for key in d if key not in known)
    if unknown:
        raise ValueError(f"{what} has unknown key(s): {', '.join(unknown)}")
    missing = [key for key in (known if required is None else required) if key not in d]
    if missing:
        raise ValueError(f"{what} is missing key(s): {', '.join(map(repr, missing))}")
    return d


def positive(what: str, name: str, value: object) -> float:
    """``value`` as a finite float > 0; a ValueError naming ``what``'s field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} field {name!r} must be a number, got {short(value)}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{what} field {name!r} must be finite and > 0, got {short(value)}")
    return number


def floats(what: str, name: str, value: object, length: int) -> tuple[float, ...]:
    """``value`` as ``length`` finite floats; a ValueError naming ``what``'s field otherwise."""
    if not isinstance(value, (list, tuple)) or len(value) != length:
        raise ValueError(f"{what} field {name!r} must be a list of {length} numbers")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ValueError(f"{what} field {name!r} holds a non-number {short(item)}")
        if not math.isfinite(float(item)):
            raise ValueError(f"{what} field {name!r} holds a non-finite {short(item)}")
        out.append(float(item))
    return tuple(out)

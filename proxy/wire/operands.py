"""Where an operand of a GEMM or of a tile, or its C, lives: one type for every side.

An operand's bytes reach the emulator (GEMM) or a device (TILE) in one of six
places: the message's own segment; the shared weights, by reference (``ref_*``);
bytes the device kept from an earlier tile, named by them (a TILE's ``panel_*``);
the operand arena, at a byte offset (a TILE's ``arena_*``); the job's slab of it,
at a byte offset (a GEMM's ``slab_*``); or arrays handed over inside the emulator's
process (``local``). C, likewise, comes back in the reply or is written where its
reader finds it: the slab, the arena, the handed array (it is then *in place*).

The job client writes a GEMM's locations and the emulator reads them; the
emulator writes a TILE's and the device reads them. Both ends of each message go
through this module, so what one writes the other reads, with the same checks of
the fields; each side then resolves a ``Location`` against what it holds. The
fields themselves are ``messages``'s (docs/PROTOCOL.md); nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any, NamedTuple, TypedDict

from .messages import Gemm, Tile, TileResult

GEMM_REF = ("byte offset", "version")  # a GEMM's ``ref_*``: the whole operand
TILE_REF = ("offset", "rows", "cols", "ld", "version")  # a TILE's: one block of it


class OperandError(ValueError):
    """Location fields that contradict each other or the segments; the text names the field."""


class Place(Enum):
    """Where the bytes are; see the module docstring."""

    FRAME = "frame"  # the message's own segment
    WEIGHTS = "weights"  # the shared weights, by reference: mapped, or kept from an earlier TILE
    KEPT = "kept"  # a panel the device kept from an earlier tile (TILE)
    ARENA = "arena"  # the operand arena, at a byte offset (TILE)
    SLAB = "slab"  # the job's slab of the arena, at a byte offset (GEMM)
    LOCAL = "local"  # arrays handed over in the emulator's process


class Location(NamedTuple):
    """Where one operand, or C, is."""

    place: Place
    offset: int = -1  # WEIGHTS, ARENA, SLAB: the byte offset there
    # A weight's reference as its message carries it (``GEMM_REF`` or ``TILE_REF``): with
    # WEIGHTS, where to read it; with FRAME (a TILE only), the bytes the device keeps under it.
    ref: tuple[int, ...] = ()
    # A TILE's panel id: with KEPT, the one to read; with FRAME, the bytes to keep under it.
    panel: int = 0
    # KEPT, or WEIGHTS kept (not mapped): the operand lies within the block kept, from this
    # element of it (-1: it is that block).
    within: int = -1

    @property
    def in_place(self) -> bool:
        """Said of C: written where its reader takes it, so the reply carries none."""
        return self.place is not Place.FRAME


class GemmFields(TypedDict):
    """A GEMM's fields that say where its operands and C are."""

    ref_a: list[int]
    ref_b: list[int]
    slab_a: int
    slab_b: int
    slab_c: int
    local: bool


class TileFields(TypedDict):
    """A TILE's fields that say where its operands and C are."""

    ref_a: list[int]
    ref_b: list[int]
    panel_a: int
    panel_b: int
    within_a: int
    within_b: int
    arena_a: int
    arena_b: int
    arena_c: int
    local: bool


IN_FRAME = Location(Place.FRAME)
HANDED = Location(Place.LOCAL)


def in_frame(ref: Sequence[int] = (), panel: int = 0) -> Location:
    """Bytes in the segment; with ``ref`` (a TILE's weight block) or ``panel`` (a TILE's
    other block), kept under it."""
    return Location(Place.FRAME, ref=tuple(ref), panel=panel) if ref or panel else IN_FRAME


def kept(panel: int, within: int = -1) -> Location:
    """A panel the device kept from an earlier tile (from its element ``within``)."""
    return Location(Place.KEPT, panel=panel, within=within)


def in_weights(ref: Sequence[int], within: int = -1) -> Location:
    """A weight block by reference (``within``: from that element of the block kept)."""
    return Location(Place.WEIGHTS, ref[0], tuple(ref), within=within)


def in_arena(offset: int) -> Location:
    return Location(Place.ARENA, offset)


def in_slab(offset: int) -> Location:
    return Location(Place.SLAB, offset)


# -- GEMM: the job writes, the emulator reads ------------------------------------------


def gemm_fields(a: Location, b: Location, c: Location = IN_FRAME) -> GemmFields:
    """The GEMM fields that place A, B and C. ``local`` is one flag for the message: with
    C handed over, A and B are too, but for weights, which still go by reference."""
    local = c.place is Place.LOCAL
    if c.place in (Place.ARENA, Place.WEIGHTS, Place.KEPT):
        raise OperandError(f"C of a GEMM cannot be in {c.place.value}")
    for name, at in (("a", a), ("b", b)):
        if at.place in (Place.ARENA, Place.KEPT) or (at.place is Place.FRAME and at.ref):
            raise OperandError(f"operand {name} of a GEMM cannot be in {at.place.value}")
        if (at.place is Place.LOCAL) != local and at.place is not Place.WEIGHTS:
            raise OperandError(
                f"operand {name} is in {at.place.value}, C in {c.place.value}: "
                "a GEMM hands over C and every operand but weights, or none"
            )
    return GemmFields(
        ref_a=list(a.ref) if a.place is Place.WEIGHTS else [],
        ref_b=list(b.ref) if b.place is Place.WEIGHTS else [],
        slab_a=a.offset if a.place is Place.SLAB else -1,
        slab_b=b.offset if b.place is Place.SLAB else -1,
        slab_c=c.offset if c.place is Place.SLAB else -1,
        local=local,
    )


def stored_shape(msg: Gemm | Tile, which: str) -> tuple[int, int]:
    """The rows and columns operand ``which`` ("a" or "b") of ``C = op(A)·op(B)`` is
    stored as, one pivot of it: op() transposes what ``ta`` / ``tb`` say is transposed."""
    if which == "a":
        return (msg.k, msg.m) if msg.ta else (msg.m, msg.k)
    return (msg.n, msg.k) if msg.tb else (msg.k, msg.n)


def gemm_locations(msg: Gemm) -> tuple[Location, Location, Location]:
    """Where a GEMM's A, B and C are, from its fields (``OperandError`` naming the field)."""
    a = _gemm_operand("a", msg.ref_a, msg.slab_a, msg.segments[0], msg.local)
    b = _gemm_operand("b", msg.ref_b, msg.slab_b, msg.segments[1], msg.local)
    if msg.slab_c == -1:
        return a, b, HANDED if msg.local else IN_FRAME
    if msg.local:
        raise OperandError("slab_c: local operands cannot be in the slab too")
    return a, b, in_slab(_offset("slab_c", msg.slab_c))


def _gemm_operand(
    name: str, ref: Sequence[object], slab: int, segment: Any, local: bool
) -> Location:
    if ref:
        if slab != -1:
            raise OperandError(f"operand {name} is both a reference and in the slab")
        at = in_weights(_ref(f"ref_{name}", ref, GEMM_REF))
    elif slab != -1:
        if local:
            raise OperandError(f"slab_{name}: local operands cannot be in the slab too")
        at = in_slab(_offset(f"slab_{name}", slab))
    elif local:
        at = HANDED
    else:
        return IN_FRAME
    return _empty(name, at, segment)


# -- TILE: the emulator writes, the device reads ----------------------------------------


def tile_fields(a: Location, b: Location, c: Location = IN_FRAME) -> TileFields:
    """The TILE fields that place A, B and C (``ldc``, C's row stride in place, is the
    caller's). ``local`` is one flag for the message: all three are handed over, or none."""
    local = c.place is Place.LOCAL
    if c.place in (Place.SLAB, Place.WEIGHTS, Place.KEPT):
        raise OperandError(f"C of a tile cannot be in {c.place.value}")
    for name, at in (("a", a), ("b", b)):
        if at.place is Place.SLAB or (at.place is Place.LOCAL) != local:
            raise OperandError(
                f"operand {name} of a tile cannot be in {at.place.value} (C: {c.place.value})"
            )
    return TileFields(
        ref_a=list(a.ref),
        ref_b=list(b.ref),
        panel_a=a.panel,
        panel_b=b.panel,
        within_a=a.within,
        within_b=b.within,
        arena_a=a.offset if a.place is Place.ARENA else -1,
        arena_b=b.offset if b.place is Place.ARENA else -1,
        arena_c=c.offset if c.place is Place.ARENA else -1,
        local=local,
    )


def tile_locations(msg: Tile) -> tuple[Location, Location, Location]:
    """Where a tile's A, B and C are, from its fields (``OperandError`` naming the field)."""
    a = _tile_operand("a", msg.ref_a, msg.panel_a, msg.arena_a, msg.segments[0], msg.local)
    b = _tile_operand("b", msg.ref_b, msg.panel_b, msg.arena_b, msg.segments[1], msg.local)
    a, b = _within("a", msg.within_a, a), _within("b", msg.within_b, b)
    if msg.local:
        if msg.arena_c != -1:
            raise OperandError("arena_c: C was handed over (local), it cannot be in the arena")
        c = HANDED
    elif msg.arena_c == -1:
        return a, b, IN_FRAME
    else:
        c = in_arena(_offset("arena_c", msg.arena_c))
    if msg.ldc < max(1, msg.n):
        raise OperandError(f"ldc={msg.ldc} is smaller than the tile's n={msg.n}")
    return a, b, c


def _tile_operand(
    name: str, ref: Sequence[object], panel: int, arena: int, segment: Any, local: bool
) -> Location:
    if local:
        if ref or panel or arena != -1:
            raise OperandError(
                f"local: operand {name} was handed over, yet ref_{name}, panel_{name} or "
                f"arena_{name} is set"
            )
        return _empty(name, HANDED, segment)
    if panel:
        return panel_operand(name, panel, ref, arena, segment)
    if arena != -1:
        if ref:
            raise OperandError(f"operand {name} is both a reference and in the arena")
        return _empty(name, in_arena(_offset(f"arena_{name}", arena)), segment)
    if not ref:
        return IN_FRAME
    checked = _ref(f"ref_{name}", ref, TILE_REF)
    return in_frame(checked) if memoryview(segment).nbytes else in_weights(checked)


def _within(name: str, within: int, at: Location) -> Location:
    """``at`` read from element ``within`` of the block it names; ``OperandError`` unless
    that block is one kept (a panel, or a weight block by reference) or ``within`` is -1."""
    if within == -1:
        return at
    if within < 0:
        raise OperandError(f"within_{name}={within}: expected an element offset >= 0, or -1")
    if at.place not in (Place.KEPT, Place.WEIGHTS):
        raise OperandError(
            f"within_{name}={within}: operand {name} is not a kept panel or a weight "
            "block by reference (its segment must be empty)"
        )
    return at._replace(within=within)


def panel_operand(
    name: str, panel: int, ref: Sequence[object] = (), arena: int = -1, segment: Any = b""
) -> Location:
    """Where a tile's operand that names ``panel_{name}`` is: its bytes, kept under the
    panel, or (an empty segment) the panel kept before; ``OperandError`` for a panel that
    is no id, or one named beside a weight's reference or an arena offset. A CONV_TILE's
    operands are here or in the frame."""
    if isinstance(panel, bool) or not isinstance(panel, int) or panel < 0:
        raise OperandError(f"panel_{name}={panel!r:.60}: expected a panel id >= 1, or 0 (none)")
    if ref or arena != -1:
        raise OperandError(f"operand {name} is a panel, yet ref_{name} or arena_{name} is set")
    return in_frame(panel=panel) if memoryview(segment).nbytes else kept(panel)


def check_tile_result(msg: TileResult, c: Location, shape: Sequence[int], itemsize: int) -> None:
    """``OperandError`` unless the TILE_RESULT carries C as its TILE (or CONV_TILE) asked:
    in place (``c`` not in the frame: ``in_place`` set, the segment empty), else the
    elements of ``shape``."""
    nbytes = memoryview(msg.segments[0]).nbytes
    if msg.in_place != c.in_place or nbytes != (0 if c.in_place else math.prod(shape) * itemsize):
        asked = "in place" if c.in_place else "×".join(map(str, [*shape, itemsize])) + " bytes"
        raise OperandError(
            f"TILE_RESULT {msg.tile}: {nbytes} bytes, in_place={msg.in_place}; expected {asked}"
        )


# -- the checks both messages share ------------------------------------------------------

_NOT_EMPTY = {  # what an operand not in the frame with bytes in its segment is told
    Place.WEIGHTS: "ref_{}: an operand sent by reference must have an empty segment",
    Place.ARENA: "arena_{}: an operand in the arena must have an empty segment",
    Place.SLAB: "slab_{}: an operand in the slab must have an empty segment",
    Place.LOCAL: "local: operand {} was handed over, so its segment must be empty",
}


def _empty(name: str, at: Location, segment: Any) -> Location:
    """``at``, an operand not in the frame, whose segment must then be empty."""
    if memoryview(segment).nbytes:
        raise OperandError(_NOT_EMPTY[at.place].format(name))
    return at


def _ref(field: str, ref: Sequence[object], form: tuple[str, ...]) -> tuple[int, ...]:
    ints = tuple(v for v in ref if isinstance(v, int) and not isinstance(v, bool))
    if len(ints) != len(ref) or len(ref) != len(form):
        raise OperandError(f"{field}={ref!r:.60}: expected [{', '.join(form)}]")
    return ints


def _offset(field: str, offset: int) -> int:
    if offset < 0:
        raise OperandError(f"{field}={offset}: expected a byte offset >= 0, or -1 (none)")
    return offset

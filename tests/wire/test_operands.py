"""Where an operand lives: written into GEMM and TILE fields, through the codec, read back.

Every place a GEMM or a TILE can name survives encoding and decoding unchanged (the
reader sees what the writer meant), a writer cannot name a place its message has no
field for, and fields that contradict each other or the segments are refused with a
reason naming the field.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from morphling.proxy.wire.codec import Decoder, encode_bytes
from morphling.proxy.wire.messages import Gemm, Message, Tile, TileResult
from morphling.proxy.wire.operands import (
    HANDED,
    IN_FRAME,
    Location,
    OperandError,
    Place,
    check_tile_result,
    gemm_fields,
    gemm_locations,
    in_arena,
    in_frame,
    in_slab,
    in_weights,
    kept,
    tile_fields,
    tile_locations,
)

BYTES = np.arange(16, dtype=np.float32)  # an operand's bytes, when they are in the frame
NONE = BYTES[:0]


def through_the_wire(msg: Message) -> Message:
    """``msg`` as the other end decodes it."""
    decoder = Decoder()
    decoder.receive_data(encode_bytes(msg))
    received = decoder.next_message()
    assert received is not None
    return received


def named(at: Location) -> str:
    """A test id: the place, and where in it."""
    return at.place.value + (f"@{at.offset}" if at.offset >= 0 else "") + ("+ref" if at.ref else "")


def segment(at: Location) -> np.ndarray:
    return BYTES if at.place is Place.FRAME else NONE


def gemm(fields: dict[str, Any], a: np.ndarray = NONE, b: np.ndarray = NONE) -> Gemm:
    shape = {"gemm": 1, "dtype": "float32", "ta": False, "tb": False, "m": 4, "n": 4, "k": 4}
    return Gemm(**shape, lda=4, ldb=4, **fields, segments=(a, b))


def tile(fields: dict[str, Any], a: np.ndarray = NONE, b: np.ndarray = NONE) -> Tile:
    shape = {"tile": 7, "dtype": "float32", "ta": False, "tb": True, "m": 4, "n": 4, "k": 4}
    return Tile(**shape, lda=4, ldb=4, **{"ldc": 4, **fields}, segments=(a, b))


# -- GEMM ------------------------------------------------------------------------------

GEMM_OPERANDS = [IN_FRAME, in_weights([4096, (3 << 32) + 2]), in_slab(8192)]
GEMM_CASES = [
    (a, b, c)
    for a, b in itertools.product(GEMM_OPERANDS, repeat=2)
    for c in (IN_FRAME, in_slab(65536))
] + [
    (HANDED, HANDED, HANDED),
    (in_weights([0, 1]), HANDED, HANDED),
    (HANDED, in_weights([64, 0]), HANDED),
]


@pytest.mark.parametrize("a, b, c", GEMM_CASES, ids=named)
def test_a_gemms_locations_survive_the_wire(a: Location, b: Location, c: Location):
    sent = gemm(dict(gemm_fields(a, b, c)), segment(a), segment(b))
    assert gemm_locations(through_the_wire(sent)) == (a, b, c)


def test_a_gemm_with_no_location_fields_has_everything_in_the_frame():
    assert gemm_locations(gemm({}, BYTES, BYTES)) == (IN_FRAME, IN_FRAME, IN_FRAME)


@pytest.mark.parametrize(
    "a, b, c",
    [
        (in_arena(0), IN_FRAME, IN_FRAME),  # a GEMM has no arena fields
        (in_frame([0, 1, 1, 1, 0]), IN_FRAME, IN_FRAME),  # bytes to keep: a TILE's
        (IN_FRAME, kept(3), IN_FRAME),  # a panel kept: a TILE's
        (IN_FRAME, IN_FRAME, kept(3)),
        (IN_FRAME, IN_FRAME, in_arena(0)),
        (HANDED, IN_FRAME, IN_FRAME),  # ``local`` is one flag: C too, or no operand
        (IN_FRAME, IN_FRAME, HANDED),
        (in_slab(0), IN_FRAME, HANDED),
    ],
    ids=named,
)
def test_a_gemm_cannot_name_what_it_has_no_field_for(a, b, c):
    with pytest.raises(OperandError):
        gemm_fields(a, b, c)


GEMM_REFUSED = {
    # name: (fields, A's segment, B's segment, text the reason must contain)
    "ref_and_slab": ({"ref_a": [0, 0], "slab_a": 0}, NONE, BYTES, "operand a is both"),
    "ref_short": ({"ref_a": [0]}, NONE, BYTES, "ref_a=[0]: expected [byte offset, version]"),
    "ref_not_ints": ({"ref_b": [0, 1.5]}, BYTES, NONE, "ref_b=[0, 1.5]: expected"),
    "ref_bool": ({"ref_b": [0, True]}, BYTES, NONE, "ref_b=[0, True]: expected"),
    "ref_with_bytes": ({"ref_a": [0, 0]}, BYTES, BYTES, "ref_a: an operand sent by reference"),
    "slab_with_bytes": ({"slab_b": 0}, BYTES, BYTES, "slab_b: an operand in the slab must"),
    "slab_negative": ({"slab_a": -5}, NONE, BYTES, "slab_a=-5: expected a byte offset"),
    "slab_c_negative": ({"slab_c": -2}, BYTES, BYTES, "slab_c=-2: expected a byte offset"),
    "local_and_slab": ({"local": True, "slab_a": 0}, NONE, NONE, "slab_a: local operands"),
    "local_and_slab_c": ({"local": True, "slab_c": 0}, NONE, NONE, "slab_c: local operands"),
    "local_with_bytes": ({"local": True}, NONE, BYTES, "local: operand b was handed over"),
}


@pytest.mark.parametrize("case", sorted(GEMM_REFUSED))
def test_contradictory_gemm_fields_are_refused_naming_the_field(case):
    fields, a, b, text = GEMM_REFUSED[case]
    with pytest.raises(OperandError) as info:
        gemm_locations(through_the_wire(gemm(fields, a, b)))
    assert text in str(info.value)


# -- TILE ------------------------------------------------------------------------------

WEIGHT_BLOCK = (4096, 4, 4, 16, (1 << 32) + 5)  # offset, rows, cols, ld, version
TILE_OPERANDS = [
    IN_FRAME,
    in_frame(WEIGHT_BLOCK),
    in_weights(WEIGHT_BLOCK),
    in_frame(panel=7),
    kept(7),
    kept(7, within=96),  # a block within the panel kept, from its 96th element
    in_weights(WEIGHT_BLOCK, within=5),
    in_arena(12288),
]
TILE_CASES = [
    (a, b, c)
    for a, b in itertools.product(TILE_OPERANDS, repeat=2)
    for c in (IN_FRAME, in_arena(0))
] + [(HANDED, HANDED, HANDED)]


@pytest.mark.parametrize("a, b, c", TILE_CASES, ids=named)
def test_a_tiles_locations_survive_the_wire(a: Location, b: Location, c: Location):
    sent = tile(dict(tile_fields(a, b, c)), segment(a), segment(b))
    assert tile_locations(through_the_wire(sent)) == (a, b, c)


def test_bytes_to_keep_and_a_block_kept_differ_only_by_their_segment():
    """The same ref: with bytes the device keeps them under it, without it reads it."""
    fields = dict(tile_fields(in_frame(WEIGHT_BLOCK), IN_FRAME))
    assert fields == dict(tile_fields(in_weights(WEIGHT_BLOCK), IN_FRAME))
    assert tile_locations(tile(fields, BYTES, BYTES))[0] == in_frame(WEIGHT_BLOCK)
    assert tile_locations(tile(fields, NONE, BYTES))[0] == in_weights(WEIGHT_BLOCK)


def test_a_panel_to_keep_and_a_panel_kept_differ_only_by_their_segment():
    fields = dict(tile_fields(IN_FRAME, in_frame(panel=9)))
    assert fields == dict(tile_fields(IN_FRAME, kept(9))) and fields["panel_b"] == 9
    assert tile_locations(tile(fields, BYTES, BYTES))[1] == in_frame(panel=9)
    assert tile_locations(tile(fields, BYTES, NONE))[1] == kept(9)


@pytest.mark.parametrize(
    "a, b, c",
    [
        (in_slab(0), IN_FRAME, IN_FRAME),  # a TILE has no slab fields
        (IN_FRAME, IN_FRAME, in_slab(0)),
        (HANDED, IN_FRAME, IN_FRAME),  # ``local`` is one flag: all three or none
        (IN_FRAME, HANDED, HANDED),
        (HANDED, HANDED, in_arena(0)),
    ],
    ids=named,
)
def test_a_tile_cannot_name_what_it_has_no_field_for(a, b, c):
    with pytest.raises(OperandError):
        tile_fields(a, b, c)


TILE_REFUSED = {
    "arena_and_ref": ({"arena_a": 0, "ref_a": list(WEIGHT_BLOCK)}, NONE, BYTES, "operand a is"),
    "ref_short": ({"ref_b": [0, 4, 4, 4]}, BYTES, NONE, "ref_b=[0, 4, 4, 4]: expected [offset, "),
    "arena_with_bytes": ({"arena_b": 64}, BYTES, BYTES, "arena_b: an operand in the arena"),
    "arena_negative": ({"arena_a": -7}, NONE, BYTES, "arena_a=-7: expected a byte offset"),
    "arena_c_negative": ({"arena_c": -3}, BYTES, BYTES, "arena_c=-3: expected a byte offset"),
    "ldc_short": ({"arena_c": 0, "ldc": 3}, BYTES, BYTES, "ldc=3 is smaller than the tile's n=4"),
    "local_with_ref": ({"local": True, "ref_a": list(WEIGHT_BLOCK)}, NONE, NONE, "ref_a, panel_a"),
    "local_with_panel": ({"local": True, "panel_b": 3}, NONE, NONE, "ref_b, panel_b or arena_b"),
    "panel_and_ref": ({"panel_a": 2, "ref_a": list(WEIGHT_BLOCK)}, BYTES, BYTES, "is a panel, yet"),
    "panel_and_arena": ({"panel_b": 2, "arena_b": 0}, BYTES, NONE, "operand b is a panel"),
    "panel_negative": ({"panel_a": -1}, BYTES, BYTES, "panel_a=-1: expected a panel id"),
    "local_with_bytes": ({"local": True}, BYTES, NONE, "local: operand a was handed over"),
    "local_and_arena_c": ({"local": True, "arena_c": 0}, NONE, NONE, "arena_c: C was handed"),
    "within_bytes": ({"panel_a": 2, "within_a": 4}, BYTES, BYTES, "within_a=4: operand a is not"),
    "within_frame": ({"within_b": 0}, BYTES, BYTES, "within_b=0: operand b is not a kept"),
    "within_arena": ({"arena_a": 0, "within_a": 3}, NONE, BYTES, "within_a=3: operand a is"),
    "within_negative": ({"panel_b": 2, "within_b": -2}, BYTES, NONE, "within_b=-2: expected an"),
}


@pytest.mark.parametrize("case", sorted(TILE_REFUSED))
def test_contradictory_tile_fields_are_refused_naming_the_field(case):
    fields, a, b, text = TILE_REFUSED[case]
    with pytest.raises(OperandError) as info:
        tile_locations(through_the_wire(tile(fields, a, b)))
    assert text in str(info.value)


# -- C comes back, or is in place --------------------------------------------------------


def test_c_is_in_place_wherever_it_is_but_in_the_frame():
    assert not IN_FRAME.in_place
    assert all(at.in_place for at in (in_arena(0), in_slab(0), HANDED))


@pytest.mark.parametrize(
    "c, in_place, nbytes, refused",
    [
        (IN_FRAME, False, 4 * 3 * 4, ""),
        (in_arena(0), True, 0, ""),
        (HANDED, True, 0, ""),
        (IN_FRAME, False, 4 * 3 * 4 - 4, "TILE_RESULT 9: 44 bytes, in_place=False; expected 4×3×4"),
        (IN_FRAME, True, 0, "TILE_RESULT 9: 0 bytes, in_place=True; expected 4×3×4 bytes"),
        (in_arena(0), False, 4 * 3 * 4, "in_place=False; expected in place"),
        (in_arena(0), True, 4, "TILE_RESULT 9: 4 bytes, in_place=True; expected in place"),
    ],
)
def test_a_tile_result_must_carry_c_as_its_tile_asked(c, in_place, nbytes, refused):
    result = TileResult(tile=9, compute_ns=1, in_place=in_place, segments=(bytes(nbytes),))
    result = through_the_wire(result)
    if not refused:
        check_tile_result(result, c, (4, 3), 4)
        return
    with pytest.raises(OperandError) as info:
        check_tile_result(result, c, (4, 3), 4)
    assert refused in str(info.value)

"""A device's emulated memory: which blocks it keeps, which it holds within others, and
what does not fit."""

from __future__ import annotations

from morphling.proxy.vtime.memory import DeviceMemory, Region


def test_device_memory_keeps_recent_blocks_and_forgets_stale_ones():
    mem = DeviceMemory(1000)
    a, b, c = (0, 1, 100, 100), (400, 1, 100, 100), (800, 1, 100, 100)
    assert mem.admit([(a, 0, 400, None), (b, 0, 400, None)], 100).held == set()
    assert mem.admit([(a, 0, 400, None)], 100).held == {a}
    third = mem.admit([(c, 0, 400, None)], 100)  # a is newer than b: b goes
    assert third.evicted == [[*b, 0]] and set(mem.resident) == {a, c}
    newer = mem.admit([(a, 1, 400, None)], 100)  # a changed: the old copy is useless
    assert newer.held == set() and [*a, 0] in newer.evicted
    assert not mem.admit([(a, 1, 400, None)], 700).fits and mem.oom_events == 1


def block(row: int, col: int, rows: int, cols: int, ld: int, matrix: str = "x") -> Region:
    return (matrix, row, col, rows, cols, ld)


def test_a_block_inside_one_held_is_held_at_its_offset_and_keeps_it_from_eviction():
    """A 64×64 matrix sent whole (panel 1): its column block 16:32 (panel 2) and its row
    block 40:48 (panel 3) are held within it, at the element offset of their first element
    in the kept bytes; a block reaching outside it, or of another matrix, or of another
    version, is not. The whole is then in use, so the least recently used block goes
    instead of it, and a sweep keeps it (it was read); once it goes, what lay in it does."""
    mem = DeviceMemory(64 * 64 * 4 + 8 * 64 * 4 + 1024)
    whole = mem.admit([(1, 0, 64 * 64 * 4, block(0, 0, 64, 64, 64))], 0)
    assert whole.held == set() and mem.regions[1] == block(0, 0, 64, 64, 64)
    other = mem.admit([(9, 0, 8 * 64 * 4, block(0, 0, 8, 64, 64, "y"))], 0)
    assert other.held == set() and mem.covers(9, 0, None)
    mem.sweep()  # (both used in this step: both stay)
    column = mem.admit([(2, 0, 64 * 16 * 4, block(0, 16, 64, 16, 64))], 0)
    assert column.held == {2} and column.within == {2: (1, 16, 64)}
    assert 2 not in mem.resident, "a block within another is not kept twice"
    rows = mem.admit([(3, 0, 8 * 64 * 4, block(40, 0, 8, 64, 64))], 0)
    assert rows.within == {3: (1, 40 * 64, 64)}
    assert mem.covers(3, 0, block(40, 0, 8, 64, 64))
    assert not mem.covers(3, 1, block(40, 0, 8, 64, 64)), "another version lies in nothing"
    assert not mem.covers(4, 0, block(60, 0, 8, 64, 64)), "rows 60:68 reach outside"
    assert not mem.covers(5, 0, block(0, 0, 8, 64, 64, "z")), "another matrix"
    # y's block was used last before x's: making room for one more evicts it, not x
    more = mem.admit([(6, 0, 8 * 64 * 4, block(0, 0, 8, 64, 64, "w"))], 0)
    assert list(more.evicted_panels) == [9] and mem.keeps("x")
    assert mem.sweep() == [], "x was read through its blocks in this step: it stays"
    assert mem.sweep() == [1, 6] and not mem.keeps("x")
    assert not mem.covers(2, 0, block(0, 16, 64, 16, 64))

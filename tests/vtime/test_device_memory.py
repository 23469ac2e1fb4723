"""A device's emulated memory: which weight blocks it keeps, and what does not fit."""

from __future__ import annotations

from morphling.proxy.vtime.memory import DeviceMemory


def test_device_memory_keeps_recent_blocks_and_forgets_stale_ones():
    mem = DeviceMemory(1000)
    a, b, c = (0, 1, 100, 100), (400, 1, 100, 100), (800, 1, 100, 100)
    assert mem.admit([(a, 0, 400), (b, 0, 400)], 100).held == set()
    assert mem.admit([(a, 0, 400)], 100).held == {a}
    third = mem.admit([(c, 0, 400)], 100)  # a is newer than b: b goes
    assert third.evicted == [[*b, 0]] and set(mem.resident) == {a, c}
    newer = mem.admit([(a, 1, 400)], 100)  # a changed: the old copy is useless
    assert newer.held == set() and [*a, 0] in newer.evicted
    assert not mem.admit([(a, 1, 400)], 700).fits and mem.oom_events == 1

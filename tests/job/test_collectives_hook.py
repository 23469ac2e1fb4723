"""``Collectives`` under real gloo ranks: every operation reported, none deadlocked."""

from __future__ import annotations

from processes import rank_objects, succeeded, torchrun

OPERATIONS = 2000


def test_collectives_of_tensors_python_lets_go_neither_deadlock_nor_go_unreported() -> None:
    proc = succeeded(torchrun("collectives_let_go.py", str(OPERATIONS)))
    printed = rank_objects(proc.stdout)
    assert sorted(r["rank"] for r in printed) == [0, 1]
    assert all(r["reported"] == OPERATIONS + 1 for r in printed)  # and the barrier

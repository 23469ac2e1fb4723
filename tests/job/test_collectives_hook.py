"""``Collectives`` under real gloo ranks: every operation reported, none deadlocked."""

from __future__ import annotations

import sys

from processes import SCRIPTS, WITHOUT_FINALIZING, _child, rank_objects, succeeded

OPERATIONS = 2000


def test_collectives_of_tensors_python_lets_go_neither_deadlock_nor_go_unreported() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(WITHOUT_FINALIZING),
               str(SCRIPTS / "collectives_let_go.py"), str(OPERATIONS)]  # fmt: skip
    proc = succeeded(_child(command, None, None))
    printed = rank_objects(proc.stdout)
    assert sorted(r["rank"] for r in printed) == [0, 1]
    assert all(r["reported"] == OPERATIONS + 1 for r in printed)  # and the barrier

"""``Collectives`` under real gloo ranks: every operation reported, none deadlocked."""

from __future__ import annotations

import json
import sys

from processes import SCRIPTS, _child, succeeded

OPERATIONS = 2000


def test_collectives_of_tensors_python_lets_go_neither_deadlock_nor_go_unreported() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(SCRIPTS / "_without_finalizing.py"),
               str(SCRIPTS / "collectives_let_go.py"), str(OPERATIONS)]  # fmt: skip
    proc = succeeded(_child(command, None, None))
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert all(r["reported"] == OPERATIONS + 1 for r in lines)  # and the barrier

"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from processes import Procs


@pytest.fixture
def procs(tmp_path: Path):
    group = Procs(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()

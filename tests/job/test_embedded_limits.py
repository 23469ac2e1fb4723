"""An embedded fleet's open files: two loopback sockets a device. The soft limit is raised
to what the fleet needs; past the hard limit the fleet is refused before it starts, naming
both numbers. Each case runs in a child whose limits it sets (a hard limit lowered stays
lowered)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """\
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (100, int(sys.argv[2])))
from morphling.proxy.job.embedded import EmbeddedFleet
try:
    EmbeddedFleet(f"rpi4:{sys.argv[1]}")
except ValueError as exc:
    print("refused:", exc)
print("soft:", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def child(devices: int, hard: int) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(devices), str(hard)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize(("devices", "soft"), [(10, 276), (200, 656)])
def test_the_open_file_limit_is_raised_to_what_the_fleet_needs(devices: int, soft: int) -> None:
    assert child(devices, 4096) == f"soft: {soft}\n"


def test_a_fleet_past_the_hard_limit_is_refused_naming_both_numbers() -> None:
    out = child(2000, 1024)
    assert "refused: a fleet of 2000 embedded devices needs about 4256 open files" in out
    assert "this process may open 1024 (RLIMIT_NOFILE's hard limit)" in out

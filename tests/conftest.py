"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
from processes import Procs

# A shell starts a background job (``make test &``, nohup) with SIGINT ignored, and an
# ignored signal stays ignored across exec: every process a test starts would ignore the
# SIGINT the signal tests send it (``morphling`` keeps an inherited SIG_IGN, as Python
# does). A handler, unlike SIG_IGN, is reset to the default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every worker imports the heavy libraries once, up front, as building the whole
# ``morphling`` parser used to: imported first inside an async test (a lazy import on the
# emulator's or a device's path), seconds of import hold the GIL and stall that test's
# event loop past its peers' heartbeat timeouts.
for _heavy in ("torch", "scipy.optimize", "matplotlib"):
    with contextlib.suppress(ImportError):  # (the tests that need it skip, saying why)
        importlib.import_module(_heavy)


# The files that take longest (minutes each, most of it child processes), run first: the
# two workers take whole files (``--dist loadfile``) in collection order, and one of these
# started last kept one worker busy long after the other had run out of files.
SLOWEST_FIRST = (
    "commands/test_ranks.py",
    "commands/test_run.py",
    "devices/test_profiler.py",
    "vtime/test_vtime_runs.py",
    "commands/test_replay.py",
    "checkpoint/test_checkpoint.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def order(item: pytest.Item) -> int:
        name = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=order)  # (stable: each file's tests keep their order)


@pytest.fixture
def procs(tmp_path: Path):
    group = Procs(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


class Namespace(NamedTuple):
    """A network namespace (``ip netns exec NAME``) and the veth pair joining it to ours."""

    name: str
    host_ip: str  # our end's address
    ip: str  # its end's
    host_interface: str
    interface: str


@pytest.fixture
def namespace():
    """A network namespace joined to ours by a veth pair: another host, as far as the
    network goes (skipped without root)."""
    tag = os.getpid() % 10000
    name, ours, theirs = f"morphling-{tag}", f"mphh{tag}", f"mphd{tag}"
    subnet = f"10.231.{tag % 250}"
    host_ip, device_ip = f"{subnet}.1", f"{subnet}.2"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", ours, "type", "veth", "peer", "name", theirs],
        ["ip", "link", "set", theirs, "netns", name],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", ours],
        ["ip", "link", "set", ours, "up"],
        ["ip", "-n", name, "addr", "add", f"{device_ip}/30", "dev", theirs],
        ["ip", "-n", name, "link", "set", theirs, "up"],
        ["ip", "-n", name, "link", "set", "lo", "up"],
    ]

    def clean() -> None:
        for cmd in (["ip", "netns", "del", name], ["ip", "link", "del", ours]):
            subprocess.run(cmd, capture_output=True, check=False)

    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        except FileNotFoundError:
            pytest.skip("no `ip` command (iproute2) to create a network namespace")
        if done.returncode != 0:
            clean()
            pytest.skip(f"cannot create a network namespace ({' '.join(cmd)}: "
                        f"{done.stderr.strip()}); needs root or CAP_NET_ADMIN")  # fmt: skip
    try:
        yield Namespace(name, host_ip, device_ip, ours, theirs)
    finally:
        clean()

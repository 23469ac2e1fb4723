"""What a profile records about the host it was measured on: its CPU and its memory."""

from __future__ import annotations

import os
from pathlib import Path


def memory_bytes() -> int:
    """The host's memory (``MemTotal``): the profile's declared memory."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # kB
    raise ValueError("/proc/meminfo has no MemTotal line")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type: another CPU computes
    at another speed, so a cached profile is keyed by it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine

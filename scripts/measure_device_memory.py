#!/usr/bin/env python3
"""What one virtual device costs in host memory: the figure ``devices/models/capacity.py`` bounds
fleets by.

Starts an emulator (``--no-probe``), then a ``morphling fleet`` of ``--small`` devices and
a second one of ``--large`` devices beside it, waits until every device is ready, and
reads the settled VmRSS of each process. The fleet side's cost per device is the RSS
difference of the two fleets over the difference of their sizes; the emulator side's is
its RSS growth from the first fleet to both, per device added. Under ``morphling run
--embedded`` both sides live in one process, so a device costs their sum. The kernel's
memory for the two ends of each device's connection is not in any RSS: the growth of
the host's slab (``/proc/meminfo``) over the second fleet estimates it, with whatever
else the host allocated meanwhile. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_net import (
    ChildFailed,
    Children,
    morphling_cmd,
    ready_devices,
    settled_rss_mib,
    sigterm_unwinds,
    start_emulator,
    wait_for,
)


def slab_kib() -> int:
    """The kernel's slab allocations, host-wide (``Slab`` of ``/proc/meminfo``), in KiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Slab:"):
            return int(line.split()[1])
    raise RuntimeError("no Slab in /proc/meminfo")


def measure(small: int, large: int, logdir: Path) -> dict:
    children = Children(logdir)
    try:
        _, port = start_emulator(children, "emulator", "--no-probe")
        emulator = children.procs[0][1]
        rss: dict[str, float] = {}
        slab: dict[str, int] = {}
        total = 0
        for name, count in (("small", small), ("large", large)):
            slab[name] = slab_kib()
            fleet = children.start(name, morphling_cmd(
                "fleet", "--server", f"127.0.0.1:{port}", "--devices", str(count),
                "--threads", "1", "--workers", "1", log_level="warning",
            ))  # fmt: skip
            total += count
            wait_for(f"{total} devices", lambda n=total: ready_devices(children, "emulator") >= n,
                     children, 600)  # fmt: skip
            rss[f"fleet_{name}_mib"] = settled_rss_mib(fleet.pid)
            rss[f"emulator_{name}_mib"] = settled_rss_mib(emulator.pid)
        slab["end"] = slab_kib()
    finally:
        children.close()
    fleet_kib = (rss["fleet_large_mib"] - rss["fleet_small_mib"]) * 1024 / (large - small)
    emulator_kib = (rss["emulator_large_mib"] - rss["emulator_small_mib"]) * 1024 / large
    return {
        "devices": [small, large],
        **{k: round(v, 1) for k, v in rss.items()},
        "fleet_per_device_kib": round(fleet_kib, 2),
        "emulator_per_device_kib": round(emulator_kib, 2),
        "embedded_per_device_kib": round(fleet_kib + emulator_kib, 2),
        "kernel_slab_per_device_kib": round((slab["end"] - slab["large"]) / large, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=200, help="devices of the first fleet")
    parser.add_argument("--large", type=int, default=2000, help="devices of the second fleet")
    args = parser.parse_args()
    if not 0 < args.small < args.large:
        parser.error("need 0 < --small < --large")
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="device-memory-") as logdir:
        try:
            print(json.dumps(measure(args.small, args.large, Path(logdir)), indent=1))
        except ChildFailed as exc:
            print(f"measure_device_memory: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

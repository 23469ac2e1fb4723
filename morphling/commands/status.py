"""``morphling status``: the fleet an emulator serves, as tables or ``--json``.

A probe peer asks STATUS (docs/PROTOCOL.md) and prints what comes back: each device
with its profile, state and probe results, the devices refused for wrong tiles, the
jobs, and the counters. Exit status: 0, or 2 when the emulator cannot be reached or
refuses us.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import uvloop

from morphling import config as configuration
from morphling.config import option as _opt
from morphling.devices.bench import BenchError, ProbeClient
from morphling.runtime import parse_server
from morphling.text import elide, elided_line, format_bytes

PEER_NAME = "morphling-status"  # its HELLO name: the one a --device-tokens file may list


@dataclass(frozen=True)
class StatusConfig:
    """``morphling status`` settings."""

    server: str = _opt("127.0.0.1:39000", "the emulator, HOST:PORT")
    token: str = _opt("", "shared secret, if the emulator requires one", secret=True)
    json: bool = _opt(False, "print the emulator's answer as JSON instead of tables")
    timeout_s: float = _opt(10.0, "how long to wait for the emulator", min=0.01)


def add_parser(sub: argparse._SubParsersAction) -> None:
    configuration.add_command(
        sub,
        "status",
        StatusConfig,
        run,
        help="print the fleet an emulator serves: devices, probes, states, quarantines",
        description="Ask a running emulator for its devices (profiles, probe results, "
        "states), the devices it refuses for wrong tiles, its jobs and its counters.",
    )


async def ask(host: str, port: int, token: str, timeout_s: float) -> dict[str, Any]:
    client = await ProbeClient.connect(host, port, token=token, name=PEER_NAME, timeout=timeout_s)
    try:
        return await client.status()
    finally:
        await client.close()


def _rate(value: float | None, scale: float, unit: str) -> str:
    return "-" if value is None else f"{value / scale:.4g} {unit}"


def device_rows(devices: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["id", "name", "peer", "profile", "state", "in flight", "done", "latency",
             "down", "up", "FLOPS"]]  # fmt: skip
    for d in devices:
        probe = d["probe"]
        rows.append([
            str(d["id"]), d["name"], d["peer"],
            d["profile"] + (" (virtual)" if d["virtual"] else ""),
            d["state"], str(d["in_flight"]), str(d["completed"]),
            _rate(probe.get("latency_s"), 1e-3, "ms"),
            _rate(probe.get("dl_bw"), 1e6, "MB/s"), _rate(probe.get("ul_bw"), 1e6, "MB/s"),
            _rate(probe.get("flops"), 1e9, "GFLOP/s"),
        ])  # fmt: skip
    return rows


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip


def render(status: dict[str, Any]) -> str:
    devices = status["devices"]
    tiles, wire, checks = status["tiles"], status["bytes"], status["verification"]
    lines = [
        f"{len(devices)} devices, {len(status['jobs'])} jobs; up {status['uptime_s']:.0f} s; "
        f"virtual time {status['clock']['virtual_s']:.3f} s"
        + (" (held by a job computing on the host)" if status["clock"]["held"] else "")
        + f", held {status['clock']['held_s']:.1f} s in all",
        f"tiles: {tiles['sent']} sent, {tiles['returned']} returned, {tiles['queued']} queued; "
        f"{format_bytes(wire['down'])} down, {format_bytes(wire['up'])} up",
        f"verification (--verify {status['verify']}): {checks['checked']} checked, "
        f"{checks['wrong']} wrong",
        "",
    ]
    if devices:
        header, *rows = device_rows(devices)
        first, left_out, last = elide(rows)
        shown = table([header, *first, *last])
        lines += shown[: 1 + len(first)]
        if left_out:
            lines.append(elided_line(left_out, "--json lists every device"))
        lines += shown[1 + len(first) :]
    else:
        lines.append("no devices connected")
    for q in status["quarantines"]:
        lines.append(f"quarantined: {q['device']} for {q['left_s']:.0f} s more "
                     f"(caught {q['caught']} times)")  # fmt: skip
    for job in status["jobs"]:
        lines.append(f"job {job['id']} {job['name'] or '-'} from {job['peer']}: "
                     f"{job['steps']} steps, {job['tiles_in_flight']} tiles in flight")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        cfg, _ = configuration.load(StatusConfig, args, section="status")
        host, port = parse_server(cfg.server)
    except (configuration.ConfigError, ValueError) as exc:
        print(f"morphling status: {exc}", file=sys.stderr)
        return 2
    try:
        status = uvloop.run(ask(host, port, cfg.token, cfg.timeout_s))
    except BenchError as exc:
        print(f"morphling status: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(status, indent=1) if cfg.json else render(status))
    return 0

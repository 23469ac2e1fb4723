"""Prometheus metrics (``--metrics-port``): the ``status`` snapshot as gauges and counters.

prometheus_client serves them from its own HTTP thread. A scrape asks the event loop for
the snapshot and waits for it, so it never reads the emulator's state while the loop
changes it, and a scrape that times out says the loop is stuck. Rates (tiles and bytes
per second) are the counters' ``rate()`` in Prometheus.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .status import DEVICE_STATES, snapshot

if TYPE_CHECKING:
    from .server import Emulator

SCRAPE_TIMEOUT_S = 5.0


def families(snap: dict[str, Any]) -> Iterator[Metric]:
    """The metrics of one ``status.snapshot``."""
    tiles, clock = snap["tiles"], snap["clock"]
    states = collections.Counter(d["state"] for d in snap["devices"])
    labelled = (  # (family, name, help, label, {label value: value})
        (GaugeMetricFamily, "morphling_devices", "Devices connected, by state", "state",
         {state: states[state] for state in DEVICE_STATES}),
        (CounterMetricFamily, "morphling_tile_bytes",
         "Tile bytes on sockets (not those devices on this host read in place)", "direction",
         snap["bytes"]),
        (CounterMetricFamily, "morphling_verification_tiles",
         "Tiles by what verification did: checked, screened_out (recomputed in float64), "
         "wrong, sampled_out, check_errors", "outcome", snap["verification"]),
    )  # fmt: skip
    for family, name, text, label, values in labelled:
        metric = family(name, text, labels=[label])
        for key, value in values.items():
            metric.add_metric([key], value)
        yield metric
    plain = (  # (family, name, help, value)
        (CounterMetricFamily, "morphling_tiles_sent", "Tiles sent to devices", tiles["sent"]),
        (CounterMetricFamily, "morphling_tiles_returned", "Tile results received from devices",
         tiles["returned"]),
        (GaugeMetricFamily, "morphling_jobs", "Jobs connected", len(snap["jobs"])),
        (GaugeMetricFamily, "morphling_tiles_queued", "Tiles placed on a device and not yet "
         "sent", tiles["queued"]),
        (GaugeMetricFamily, "morphling_tiles_in_flight", "Tiles sent and not yet answered",
         sum(d["in_flight"] for d in snap["devices"])),
        (GaugeMetricFamily, "morphling_in_flight_bytes", "Tile operand bytes on the wire",
         tiles["in_flight_bytes"]),
        (GaugeMetricFamily, "morphling_quarantined_devices", "Devices refused now for wrong "
         "tiles", len(snap["quarantines"])),
        (GaugeMetricFamily, "morphling_unwelcomed_connections", "Connections whose HELLO is "
         "not yet accepted", snap["unwelcomed"]),
        (GaugeMetricFamily, "morphling_virtual_time_seconds", "The virtual clock",
         clock["virtual_s"]),
        (GaugeMetricFamily, "morphling_virtual_clock_held", "1 while events are due that a "
         "job computing on the host holds back", int(clock["held"])),
        (CounterMetricFamily, "morphling_virtual_clock_held_seconds", "Wall seconds the "
         "virtual clock has waited on jobs computing on the host", clock["held_s"]),
        (GaugeMetricFamily, "morphling_uptime_seconds", "Seconds since the emulator started",
         snap["uptime_s"]),
    )  # fmt: skip
    for family, name, text, value in plain:
        yield family(name, text, value=value)


class _Snapshots(Collector):
    def __init__(self, emulator: Emulator, loop: asyncio.AbstractEventLoop) -> None:
        self.emulator, self.loop = emulator, loop

    def collect(self) -> Iterator[Metric]:
        future = asyncio.run_coroutine_threadsafe(self._take(), self.loop)
        yield from families(future.result(SCRAPE_TIMEOUT_S))

    async def _take(self) -> dict[str, Any]:
        return snapshot(self.emulator)


def serve(emulator: Emulator, ip: str, port: int) -> WSGIServer:
    """Serve ``emulator``'s metrics on ``ip:port`` (OSError when it cannot listen); call
    from its event loop. ``shutdown()`` on the server stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshots(emulator, asyncio.get_running_loop()))
    server, _ = start_http_server(port, addr=ip, registry=registry)
    return server

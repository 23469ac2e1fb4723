"""What an operator sees: STATUS (``morphling status``) and the Prometheus metrics give the
same state: devices by state with their probe results, the tiles and bytes that moved,
verification's counts and the devices quarantined."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import numpy as np
from morphling.devices.bench import ProbeClient
from morphling.kernels import WorkerPool
from morphling.proxy.emulator import metrics
from processes import free_port
from prometheus_client.parser import text_string_to_metric_families
from serving import wait_for_condition
from test_verify import CorruptingBackend, honest_gemm


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_status_and_metrics_show_the_fleet_its_work_and_a_quarantine(fleet):
    f = await fleet(block_size=16, quarantine_s=60.0, probe=True)
    armed = threading.Event()
    bad_workers = WorkerPool([CorruptingBackend(armed)])
    port = free_port()
    server = metrics.serve(f.emu, "127.0.0.1", port)
    try:
        await f.add_device(name="honest")
        await f.add_device(name="liar", workers=bad_workers)
        armed.set()
        client = await f.client(name="trainer")
        await honest_gemm(client, np.random.default_rng(6), (64, 64, 64))
        await wait_for_condition(lambda: f.emu.verifier.quarantines, 5, "a quarantine")
        probe = await ProbeClient.connect(f.host, f.port, timeout=10)
        status = await probe.status()
        await probe.close()
        samples = await asyncio.to_thread(scrape, port)
    finally:
        server.shutdown()
        server.server_close()
        bad_workers.close()

    [device] = status["devices"]  # the liar was dropped
    assert (device["name"], device["state"], device["profile"]) == ("honest", "idle", "rpi4")
    assert device["completed"] > 0 and device["probe"]["flops"] > 0
    assert device["probe"]["latency_s"] > 0 and device["probe"]["dl_bw"] > 0
    assert [j["name"] for j in status["jobs"]] == ["trainer"]  # the probe peer is no job
    [refused] = status["quarantines"]
    assert refused["device"] == "liar@127.0.0.1" and refused["caught"] == 1
    assert 0 < refused["left_s"] <= 60
    tiles, checks = status["tiles"], status["verification"]
    assert tiles["sent"] >= tiles["returned"] >= 16  # a 64² output in 16² tiles, and retries
    assert checks["wrong"] >= 1 and checks["checked"] == tiles["returned"]
    assert status["bytes"]["down"] > 0 and status["bytes"]["up"] >= 64 * 64 * 4

    def sample(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert sample("morphling_devices", state="idle") == 1
    assert sample("morphling_devices", state="busy") == 0
    assert sample("morphling_jobs") == 1
    assert sample("morphling_quarantined_devices") == 1
    assert sample("morphling_verification_tiles_total", outcome="wrong") == checks["wrong"]
    assert sample("morphling_tiles_returned_total") == tiles["returned"]
    assert sample("morphling_tile_bytes_total", direction="up") == status["bytes"]["up"]
    assert sample("morphling_uptime_seconds") > 0
    held = sample("morphling_virtual_clock_held_seconds_total")  # (scraped after STATUS)
    assert held >= status["clock"]["held_s"] >= 0

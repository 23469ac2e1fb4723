"""Measure a device on arrival, and decide which profile the scheduler trusts.

Latency is the best RTT/2 of a few small echoes. Bandwidth is timed per
direction: downlink from sending a PROBE_PUSH to its PROBE_ACK, uplink from
sending a PROBE_PULL to the whole PROBE_PULLED, each less one small-message
RTT. FLOPS come from the device's own compute time for the seeded challenge
(so network time does not pollute them), and only count once its result
matches a reference computed here, off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ..devices.profiles import DeviceProfile
from ..kernels import gemm
from . import challenge
from .messages import Message, ProbeEcho, ProbeFlops, ProbePull, ProbePush
from .settings import EmulatorConfig

log = logging.getLogger(__name__)

_probe_ids = itertools.count(1)
LATENCY_ROUNDS = 5


class Asker(Protocol):
    async def ask(self, msg: Message, timeout: float) -> Message: ...


@dataclass(frozen=True)
class Measurement:
    """What the probes found; ``flops`` only if the challenge result verified."""

    latency_s: float
    dl_bw: float
    ul_bw: float
    flops: float
    flops_verified: bool
    reason: str = ""


def next_probe_id() -> int:
    return next(_probe_ids)


async def measure_latency(peer: Asker, nbytes: int, timeout: float) -> float:
    payload = np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(LATENCY_ROUNDS):
        start = time.perf_counter()
        await peer.ask(ProbeEcho(probe=next_probe_id(), segments=(payload,)), timeout)
        best = min(best, time.perf_counter() - start)
    return best / 2


async def measure_push(peer: Asker, nbytes: int, rtt: float, timeout: float) -> float:
    """Bytes/s from us to the peer."""
    payload = np.zeros(nbytes, np.uint8)
    start = time.perf_counter()
    await peer.ask(ProbePush(probe=next_probe_id(), segments=(payload,)), timeout)
    return nbytes / max(time.perf_counter() - start - rtt, 1e-9)


async def measure_pull(peer: Asker, nbytes: int, rtt: float, timeout: float) -> float:
    """Bytes/s from the peer to us."""
    start = time.perf_counter()
    await peer.ask(ProbePull(probe=next_probe_id(), nbytes=nbytes), timeout)
    return nbytes / max(time.perf_counter() - start - rtt, 1e-9)


async def flops_challenge(
    peer: Asker, seed: int, dim: int, tolerance: float, timeout: float
) -> tuple[float, str]:
    """(FLOP/s from the peer's own compute time, "" or why the result is wrong)."""
    reply = await peer.ask(ProbeFlops(probe=next_probe_id(), seed=seed, dim=dim), timeout)
    a, b = challenge.matrices(seed, dim)
    reference = await asyncio.to_thread(gemm, a, b)
    got = reply.segments[0]
    if got.nbytes != dim * dim * 4:
        return 0.0, f"result has {got.nbytes} bytes, expected {dim * dim * 4}"
    problem = challenge.verify(
        np.frombuffer(got, np.float32).reshape(dim, dim), reference, tolerance
    )
    flops = 2 * dim**3 / max(reply.compute_ns, 1) * 1e9
    return (0.0, problem) if problem else (flops, "")


async def probe(peer: Asker, cfg: EmulatorConfig, seed: int) -> Measurement:
    """All three probes in order; raises TimeoutError when one runs out of time."""
    timeout = cfg.probe_timeout_s
    latency = await measure_latency(peer, cfg.probe_latency_bytes, timeout)
    dl = await measure_push(peer, cfg.probe_bandwidth_bytes, 2 * latency, timeout)
    ul = await measure_pull(peer, cfg.probe_bandwidth_bytes, 2 * latency, timeout)
    flops, problem = await flops_challenge(
        peer, seed, cfg.probe_flops_dim, cfg.probe_tolerance, timeout
    )
    return Measurement(latency, dl, ul, flops, not problem, problem)


def choose_profile(
    declared: DeviceProfile, measured: Measurement | None, source: str, virtual: bool
) -> tuple[DeviceProfile, str]:
    """The profile to schedule with, and why (for the log).

    ``auto`` trusts measurements of physical devices and the declared profile
    of virtual ones: a virtual Pi measured on this host would look like the host.
    """
    if measured is None:
        return declared, "declared (not probed)"
    if source == "declared" or (source == "auto" and virtual):
        why = (
            "declared (profile_source=declared)"
            if source == "declared"
            else ("declared (auto: virtual device, its host is not the board it models)")
        )
        return declared, why
    model = replace(
        declared,
        dl_lat_s=measured.latency_s,
        ul_lat_s=measured.latency_s,
        dl_bw=measured.dl_bw,
        ul_bw=measured.ul_bw,
        flops=measured.flops if measured.flops_verified else declared.flops,
        source="measured",
    )
    return model, f"measured (profile_source={source})"


def describe(declared: DeviceProfile, measured: Measurement) -> str:
    """One PROFILE_DELTA-style line: declared, measured, ratio per figure."""

    def row(name: str, unit: str, scale: float, dec: float, meas: float) -> str:
        ratio = f"×{meas / dec:.3g}" if dec else "declared zero"  # an ideal link's latency
        return f"{name} {dec * scale:.4g}→{meas * scale:.4g} {unit} ({ratio})"

    parts = [
        row("latency", "ms", 1e3, declared.dl_lat_s, measured.latency_s),
        row("down", "MB/s", 1e-6, declared.dl_bw, measured.dl_bw),
        row("up", "MB/s", 1e-6, declared.ul_bw, measured.ul_bw),
    ]
    if measured.flops_verified:
        parts.append(row("flops", "GFLOP/s", 1e-9, declared.flops, measured.flops))
    else:
        parts.append(f"flops unverified ({measured.reason})")
    return "; ".join(parts)

"""Measure a device on arrival, and decide which profile the scheduler trusts.

Latency is the best RTT/2 of a few small echoes. Bandwidth is timed per
direction: downlink from sending a PROBE_PUSH to its PROBE_ACK, uplink from
sending a PROBE_PULL to the whole PROBE_PULLED, each less one small-message
RTT. FLOPS come from the device's own compute time for the seeded challenge
(so network time does not pollute them), and only count once its result
matches a reference computed here, off the event loop, a few checks at a time
(at the largest size a check takes seconds and hundreds of MB).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Protocol, TypeVar

import numpy as np
from morphling.devices.models.profiles import DeviceProfile
from morphling.kernels import gemm
from morphling.proxy.wire import challenge
from morphling.proxy.wire.messages import (
    Message,
    ProbeAck,
    ProbeEcho,
    ProbeFlops,
    ProbeFlopsResult,
    ProbePull,
    ProbePulled,
    ProbePush,
)

from .settings import EmulatorConfig

log = logging.getLogger(__name__)

_probe_ids = itertools.count(1)
LATENCY_ROUNDS = 5


Question = ProbeEcho | ProbePush | ProbePull | ProbeFlops  # what the emulator asks a peer
R = TypeVar("R", bound=Message)


class Asker(Protocol):
    """A peer asked: ``ask`` sends a probe and waits for its ``reply``, the message of that
    type with the same probe id."""

    async def ask(self, msg: Question, reply: type[R], timeout: float) -> R: ...


@dataclass(frozen=True)
class Link:
    """What the network probes found."""

    latency_s: float
    dl_bw: float
    ul_bw: float


@dataclass(frozen=True)
class Measurement:
    """What the probes found: ``link`` None when the network probes ran out of time (the
    declared figures stand); ``flops`` only if the challenge result verified."""

    link: Link | None
    flops: float
    flops_verified: bool
    reason: str = ""


def measured_figures(measured: Measurement | None) -> dict[str, float]:
    """What ``morphling status`` shows of ``measured``: the link's figures, if the probes
    ran in time, and the FLOPS, if its challenge checked."""
    if measured is None:
        return {}
    figures = {} if measured.link is None else asdict(measured.link)
    if measured.flops_verified:
        figures["flops"] = measured.flops
    return figures


def next_probe_id() -> int:
    return next(_probe_ids)


async def measure_latency(peer: Asker, nbytes: int, timeout: float) -> float:
    payload = np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(LATENCY_ROUNDS):
        start = time.perf_counter()
        await peer.ask(ProbeEcho(probe=next_probe_id(), segments=(payload,)), ProbeEcho, timeout)
        best = min(best, time.perf_counter() - start)
    return best / 2


async def measure_push(peer: Asker, nbytes: int, rtt: float, timeout: float) -> float:
    """Bytes/s from us to the peer."""
    payload = np.zeros(nbytes, np.uint8)
    start = time.perf_counter()
    await peer.ask(ProbePush(probe=next_probe_id(), segments=(payload,)), ProbeAck, timeout)
    return nbytes / max(time.perf_counter() - start - rtt, 1e-9)


async def measure_pull(peer: Asker, nbytes: int, rtt: float, timeout: float) -> float:
    """Bytes/s from the peer to us."""
    start = time.perf_counter()
    await peer.ask(ProbePull(probe=next_probe_id(), nbytes=nbytes), ProbePulled, timeout)
    return nbytes / max(time.perf_counter() - start - rtt, 1e-9)


def check_result(seed: int, dim: int, got: memoryview, tolerance: float) -> str:
    """Empty, or why ``got`` is not the challenge's C. Rebuilds A and B and computes the
    reference, which blocks for up to seconds: call it off the event loop."""
    if got.nbytes != dim * dim * 4:
        return f"result has {got.nbytes} bytes, expected {dim * dim * 4}"
    a, b = challenge.matrices(seed, dim)
    result = np.frombuffer(got, np.float32).reshape(dim, dim)
    return challenge.verify(result, gemm(a, b), tolerance)


async def flops_challenge(
    peer: Asker,
    seed: int,
    dim: int,
    tolerance: float,
    timeout: float,
    checking: asyncio.Semaphore,
) -> tuple[float, str]:
    """(FLOP/s from the peer's own compute time, "" or why the result is wrong or late).
    ``checking`` bounds how many results are checked at once."""
    try:
        question = ProbeFlops(probe=next_probe_id(), seed=seed, dim=dim)
        reply = await peer.ask(question, ProbeFlopsResult, timeout)
    except TimeoutError:
        return 0.0, f"no result within {timeout:.3g} s"
    problem = await _checked(checking, seed, dim, reply.segments[0], tolerance)
    flops = 2 * dim**3 / max(reply.compute_ns, 1) * 1e9
    return (0.0, problem) if problem else (flops, "")


async def _checked(
    checking: asyncio.Semaphore, seed: int, dim: int, got: memoryview, tolerance: float
) -> str:
    """``check_result`` in a thread, holding a ``checking`` slot until the thread
    is done, even when the peer that asked goes meanwhile (its task is cancelled, the
    thread runs on): else a peer that leaves mid-check could start any number."""
    async with checking:
        done = asyncio.ensure_future(asyncio.to_thread(check_result, seed, dim, got, tolerance))
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            await asyncio.wait([done])
            raise


async def measure_link(peer: Asker, cfg: EmulatorConfig) -> Link | None:
    """Latency, then bandwidth each way; None when one of them runs out of time."""
    timeout = cfg.probe_timeout_s
    try:
        latency = await measure_latency(peer, cfg.probe_latency_bytes, timeout)
        dl = await measure_push(peer, cfg.probe_bandwidth_bytes, 2 * latency, timeout)
        ul = await measure_pull(peer, cfg.probe_bandwidth_bytes, 2 * latency, timeout)
    except TimeoutError:
        return None
    return Link(latency, dl, ul)


async def probe(
    peer: Asker,
    cfg: EmulatorConfig,
    seed: int,
    declared: DeviceProfile,
    checking: asyncio.Semaphore,
) -> Measurement:
    """The network probes, then the FLOPS challenge. The challenge runs even when the
    network probes ran out of time: otherwise a device could skip its check (and take
    tiles it computes wrongly) just by leaving a PROBE_PUSH unanswered. Then the bytes of
    the probes that ran out may still be ahead of the challenge on the link, so it gets
    the time they take at the device's declared bandwidth on top (at most 60 time limits
    more: a hostile device could declare a bandwidth near zero)."""
    link = await measure_link(peer, cfg)
    timeout = cfg.probe_timeout_s
    if link is None:
        late = 2 * cfg.probe_bandwidth_bytes / min(declared.dl_bw, declared.ul_bw)
        timeout += min(late, 60 * cfg.probe_timeout_s)
    flops, problem = await flops_challenge(
        peer, seed, cfg.probe_flops_dim, cfg.probe_tolerance, timeout, checking
    )
    return Measurement(link, flops, not problem, problem)


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
    flops = measured.flops if measured.flops_verified else declared.flops
    link = measured.link
    if link is None:
        return replace(declared, flops=flops, source="measured FLOPS, declared link"), (
            f"measured FLOPS and declared link (profile_source={source}; "
            "the network probes ran out of time)"
        )
    model = replace(
        declared,
        dl_lat_s=link.latency_s,
        ul_lat_s=link.latency_s,
        dl_bw=link.dl_bw,
        ul_bw=link.ul_bw,
        flops=flops,
        source="measured",
    )
    return model, f"measured (profile_source={source})"


def describe(declared: DeviceProfile, measured: Measurement) -> str:
    """One PROFILE_DELTA-style line: declared, measured, ratio per figure."""

    def row(name: str, unit: str, scale: float, dec: float, meas: float) -> str:
        ratio = f"×{meas / dec:.3g}" if dec else "declared zero"  # an ideal link's latency
        return f"{name} {dec * scale:.4g}→{meas * scale:.4g} {unit} ({ratio})"

    link = measured.link
    parts = (
        [
            row("latency", "ms", 1e3, declared.dl_lat_s, link.latency_s),
            row("down", "MB/s", 1e-6, declared.dl_bw, link.dl_bw),
            row("up", "MB/s", 1e-6, declared.ul_bw, link.ul_bw),
        ]
        if link
        else ["link not measured (its probes ran out of time)"]
    )
    if measured.flops_verified:
        parts.append(row("flops", "GFLOP/s", 1e-9, declared.flops, measured.flops))
    else:
        parts.append(f"flops unverified ({measured.reason})")
    return "; ".join(parts)

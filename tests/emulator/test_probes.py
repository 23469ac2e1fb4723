"""Probes on arrival: which profile the scheduler trusts, the FLOPS challenge through a
raw device, and the challenges peers ask for, one at a time, checked without
stalling the server."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
from morphling.devices.models.profiles import BUILTIN
from morphling.proxy.emulator import probes
from morphling.proxy.wire import challenge
from morphling.proxy.wire.messages import (
    Error,
    MsgType,
    ProbeAck,
    ProbeEcho,
    ProbeFlops,
    ProbeFlopsRequest,
    ProbeFlopsResult,
    ProbePulled,
)
from raw_peer import RawPeer
from serving import (
    TIMEOUT,
    assert_gemm_close,
    check_serving,
    wait_for_condition,
)


@pytest.mark.parametrize(
    ("source", "virtual", "measured"),
    [
        ("measured", True, True),
        ("declared", True, False),
        ("auto", True, False),
        ("auto", False, True),
    ],
)
async def test_probed_device_profile_source(fleet, caplog, source, virtual, measured):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(probe=True, profile_source=source)
    agent = await f.add_device("rpi4", virtual=virtual, name="probed")
    record = f.record(agent)
    deltas = [r.getMessage() for r in caplog.records if "PROFILE_DELTA" in r.getMessage()]
    assert len(deltas) == 1 and "device 0 (probed)" in deltas[0], deltas
    assert "latency" in deltas[0] and "GFLOP/s" in deltas[0]
    if measured:
        assert record.model.source == "measured"
        assert record.model.dl_bw != BUILTIN["rpi4"].dl_bw
    else:
        assert record.model == BUILTIN["rpi4"]
        assert record.model.source.startswith("derived from published figures")
    assert record.declared == BUILTIN["rpi4"]
    client = await f.client()
    await check_serving(client)


async def raw_device(peer: RawPeer, flops_reply: Any, *, ack_push: bool = True) -> dict[str, Any]:
    """Speak the device side by hand, answering the FLOPS challenge with ``flops_reply``
    (not at all if None) and PROBE_PUSH only if ``ack_push``."""
    seen: dict[str, Any] = {"tiles": 0, "verdict": None, "error": None, "types": []}
    while (msg := await peer.recv(timeout=10)) is not None:
        seen["types"].append(msg.TYPE.name)
        t = msg.TYPE
        if t == MsgType.PROBE_ECHO and not msg.reply:
            peer.send(ProbeEcho(probe=msg.probe, reply=True, segments=(bytes(msg.segments[0]),)))
        elif t == MsgType.PROBE_PUSH and ack_push:
            peer.send(ProbeAck(probe=msg.probe, nbytes=msg.segments[0].nbytes))
        elif t == MsgType.PROBE_PULL:
            peer.send(ProbePulled(probe=msg.probe, segments=(np.zeros(msg.nbytes, np.uint8),)))
        elif t == MsgType.PROBE_FLOPS and flops_reply is not None:
            c = flops_reply(msg.seed, msg.dim)
            peer.send(ProbeFlopsResult(probe=msg.probe, compute_ns=10_000, segments=(c,)))
        elif t == MsgType.PROBE_VERDICT:
            seen["verdict"] = msg
            if msg.ok:
                break
        elif t == MsgType.ERROR:
            seen["error"] = msg
        elif t == MsgType.TILE:
            seen["tiles"] += 1
    return seen


def _right(seed: int, dim: int) -> np.ndarray:
    a, b = challenge.matrices(seed, dim)
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


FLOPS_REPLIES = {
    "right": (_right, None),
    "zeros": (lambda seed, dim: np.zeros((dim, dim), np.float32), "flops_failed"),
    "wrong_size": (lambda seed, dim: np.zeros((dim, dim + 1), np.float32), "flops_failed"),
    "nan": (lambda seed, dim: np.full((dim, dim), np.nan, np.float32), "flops_failed"),
}


@pytest.mark.parametrize("reply", sorted(FLOPS_REPLIES))
async def test_flops_challenge_through_a_raw_device(fleet, caplog, reply):
    caplog.set_level(logging.INFO, logger="morphling")
    flops_reply, code = FLOPS_REPLIES[reply]
    # Heartbeats of 1 s, not FAST's 0.25: the job and the honest device share this test's
    # loop, and in the whole suite (never alone, nor beside two other heavy files) a stall
    # of it outlasted their 3 × 0.25 s timeout, twice in a row at ce098d2. Heartbeats are
    # not what this test checks.
    f = await fleet(probe=True, block_size=8, heartbeat_s=1.0, heartbeat_timeout_s=4.0)
    await f.add_device(name="honest")
    client = await f.client()
    rng = np.random.default_rng(15)
    a = rng.standard_normal((4, 64, 16), dtype=np.float32)
    b = rng.standard_normal((16, 64), dtype=np.float32)
    running = asyncio.create_task(client.matmul(a, b, timeout=TIMEOUT))  # tiles to steal

    peer = await f.raw_peer()
    welcome = await peer.hello(
        "device",
        name=f"raw-{reply}",
        uuid="raw",
        profile=BUILTIN["rpi4"].to_wire(),
        caps={"virtual": True},
    )
    seen = await asyncio.wait_for(raw_device(peer, flops_reply), 15)
    assert seen["verdict"] is not None, seen["types"]
    if code is None:
        assert seen["verdict"].ok and seen["verdict"].flops > 0
        await wait_for_condition(
            lambda: f.emu.registry.devices[welcome.peer_id].ready, 5, "the raw device ready"
        )
    else:
        assert not seen["verdict"].ok and seen["verdict"].reason
        assert seen["error"] is not None and seen["error"].code == code, seen
        assert seen["tiles"] == 0, "a device that failed its FLOPS challenge got tiles"
        assert welcome.peer_id not in f.emu.registry.devices
        assert "TILE" not in seen["types"]
    peer.close()
    assert_gemm_close(await running, a, b)
    await check_serving(client)


@pytest.mark.parametrize("answers", [True, False], ids=["answers", "silent"])
async def test_a_device_that_leaves_a_push_unanswered_is_still_challenged(fleet, answers):
    """A network probe that runs out of time keeps the declared link but never skips the
    FLOPS check: a device that answers no challenge gets no tiles."""
    # The raw device never heartbeats: the emulator must not drop it for silence before
    # its two probes (1 s each) have timed out.
    f = await fleet(
        probe=True,
        profile_source="measured",
        probe_timeout_s=1.0,
        block_size=8,
        heartbeat_timeout_s=6.0,
    )
    peer = await f.raw_peer()
    welcome = await peer.hello(
        "device",
        name="no-ack",
        uuid="raw",
        profile=BUILTIN["rpi4"].to_wire(),
        caps={"virtual": False},
    )
    flops_reply = _right if answers else None
    seen = await asyncio.wait_for(raw_device(peer, flops_reply, ack_push=False), 15)
    assert "PROBE_FLOPS" in seen["types"], seen["types"]
    assert seen["verdict"] is not None and seen["verdict"].ok is answers, seen
    if answers:
        await wait_for_condition(
            lambda: f.emu.registry.devices[welcome.peer_id].ready, 5, "the raw device ready"
        )
        model = f.emu.registry.devices[welcome.peer_id].model
        assert model.source == "measured FLOPS, declared link"
        assert model.flops == pytest.approx(seen["verdict"].flops)
        declared = BUILTIN["rpi4"]
        assert (model.dl_bw, model.ul_bw, model.dl_lat_s) == (
            declared.dl_bw,
            declared.ul_bw,
            declared.dl_lat_s,
        )
    else:
        assert seen["error"].code == "flops_failed" and "no result within" in seen["error"].reason
        assert seen["tiles"] == 0 and welcome.peer_id not in f.emu.registry.devices
    peer.close()


async def test_a_peer_asks_for_one_challenge_at_a_time(fleet):
    f = await fleet()
    await f.add_device()
    peer = await f.raw_peer()
    await peer.hello("probe", name="eager")
    for _ in range(2):  # one after the other: each verdict frees the next
        peer.send(ProbeFlopsRequest(dim=16))
        challenge_msg = await peer.recv_skipping_heartbeats()
        assert isinstance(challenge_msg, ProbeFlops) and challenge_msg.dim == 16
        c = _right(challenge_msg.seed, 16)
        peer.send(ProbeFlopsResult(probe=challenge_msg.probe, compute_ns=1000, segments=(c,)))
        verdict = await peer.recv_skipping_heartbeats()
        assert verdict.TYPE == MsgType.PROBE_VERDICT and verdict.ok, verdict
    peer.send(ProbeFlopsRequest(dim=16))
    assert isinstance(await peer.recv_skipping_heartbeats(), ProbeFlops)
    peer.send(ProbeFlopsRequest(dim=16))  # before the first one's verdict
    refused = await peer.recv_skipping_heartbeats()
    assert isinstance(refused, Error) and refused.code == "overload", refused
    assert "PROBE_VERDICT" in refused.reason
    assert await peer.recv_skipping_heartbeats() is None
    await check_serving(await f.client())


async def test_a_check_keeps_its_slot_until_done_though_its_peer_left(fleet, monkeypatch):
    """The check of a challenge a peer asked for runs on after the peer leaves, and holds
    its slot until it ends: else a peer could start any number by leaving mid-check. The
    checks of arriving devices have a slot of their own meanwhile."""
    release = threading.Event()
    check = probes.check_result

    def held(seed: int, dim: int, got: memoryview, tolerance: float) -> str:
        if dim == 16:  # the peer's; an arriving device's is FAST's 32
            release.wait(30)
        return check(seed, dim, got, tolerance)

    monkeypatch.setattr(probes, "check_result", held)
    f = await fleet(probe=True)
    peer = await f.raw_peer()
    welcome = await peer.hello("probe", name="leaver")
    peer.send(ProbeFlopsRequest(dim=16))
    asked = await peer.recv_skipping_heartbeats()
    assert isinstance(asked, ProbeFlops)
    c = _right(asked.seed, 16)
    peer.send(ProbeFlopsResult(probe=asked.probe, compute_ns=1000, segments=(c,)))
    slot = f.emu.checking_asked
    await wait_for_condition(slot.locked, 5, "the check to start")
    peer.close()
    await wait_for_condition(
        lambda: all(p.job is None or p.job.id != welcome.peer_id for p in f.emu.peers),
        5,
        "the peer to go",
    )
    assert slot.locked(), "the slot was given back while its check still runs"
    device = await asyncio.wait_for(f.add_device(name="arriving"), 10)  # checked meanwhile
    assert f.record(device).ready and slot.locked()
    release.set()
    await wait_for_condition(lambda: not slot.locked(), 5, "the check to end")


async def test_checking_the_largest_challenge_does_not_stall_the_server(fleet):
    """The reference for dim 4096 (its operands rebuilt, a 137 GFLOP GEMM, the check) is
    computed off the event loop: on it, this stalled every peer for seconds."""
    f = await fleet(heartbeat_s=2.0, heartbeat_timeout_s=30.0)  # a stall must not trip these
    peer = await f.raw_peer()
    await peer.hello("probe", name="big")
    peer.send(ProbeFlopsRequest(dim=4096))
    challenge_msg = await peer.recv_skipping_heartbeats()
    assert isinstance(challenge_msg, ProbeFlops)
    c = np.zeros((4096, 4096), np.float32)  # wrong, but checked in full all the same
    peer.send(ProbeFlopsResult(probe=challenge_msg.probe, compute_ns=1000, segments=(c,)))
    gaps: list[float] = []
    last = time.monotonic()
    verdict = asyncio.create_task(peer.recv_skipping_heartbeats(timeout=60))
    while not verdict.done():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    assert verdict.result().TYPE == MsgType.PROBE_VERDICT and not verdict.result().ok
    assert "elements off" in verdict.result().reason
    assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s"


@pytest.mark.parametrize(
    ("source", "virtual", "probed"),
    [("auto", True, 1), ("declared", True, 1), ("measured", True, 3), ("auto", False, 3)],
)
async def test_devices_in_the_emulators_process_are_challenged_once(
    fleet, caplog, source, virtual, probed
):
    """Devices in the emulator's process compute on the kernels it shares with them: once
    one passed its FLOPS challenge, the next virtual ones whose measurements would not be
    used (their declared profiles are) are ready without probes; one whose measurements
    count (a physical board's, or any with profile_source=measured) is still probed."""
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(probe=True, profile_source=source)
    agents = [await f.add_device("rpi4", virtual=virtual) for _ in range(3)]
    records = [f.record(agent) for agent in agents]
    assert all(r.local for r in records)
    deltas = [r.getMessage() for r in caplog.records if "PROFILE_DELTA" in r.getMessage()]
    assert len(deltas) == probed, deltas
    if probed == 1:
        assert [r.model for r in records] == [BUILTIN["rpi4"]] * 3
    await check_serving(await f.client())

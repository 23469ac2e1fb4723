"""Devices as the emulator serves them: probed on arrival, ready, lost; and probes.

A device that joins is measured (``probes``) unless probing is off, and gets tiles
once its FLOPS challenge checks; the profile the timeline schedules it with is
chosen then (``probes.choose_profile``). A device lost has its tiles re-queued on
the others; where it may still write into an output in the operand arena, that
output is kept from reuse a while, and a tile no device could compute is given up
(``Scheduler.give_up_on``). ``Prober`` is each connection's side of the probes: the
emulator's questions waiting for their replies, and the FLOPS challenges a peer (a
device, or ``morphling-bench``) asks for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from typing import TYPE_CHECKING, TypeVar

from morphling.proxy.shm import handover as local
from morphling.proxy.wire import challenge
from morphling.proxy.wire.errors import RemoteProtocolError
from morphling.proxy.wire.messages import (
    Message,
    ProbeAck,
    ProbeEcho,
    ProbeFlopsRequest,
    ProbeFlopsResult,
    ProbePulled,
    ProbeVerdict,
)
from morphling.proxy.wire.operands import Place

from . import probes
from .registry import DeviceRecord

if TYPE_CHECKING:
    from .peer import PeerConnection
    from .server import Emulator

log = logging.getLogger(__name__)

Reply = ProbeEcho | ProbeAck | ProbePulled | ProbeFlopsResult  # what answers a probe of ours
R = TypeVar("R", bound=Message)


def arrived(conn: PeerConnection, device: DeviceRecord, uuid: str) -> None:
    """``device`` was welcomed: probe it, or (probing off) schedule on it at once."""
    if conn.emulator.config.probe:
        conn.spawn(_probe(conn, device, uuid))
    else:
        ready(conn.emulator, device, None)


async def _probe(conn: PeerConnection, device: DeviceRecord, uuid: str) -> None:
    emulator = conn.emulator
    seed = zlib.crc32(f"{uuid}:{device.id}".encode())
    try:
        async with emulator.probing:
            if _vouched_for(emulator, device):
                ready(emulator, device, None)
                return
            measured = await probes.probe(
                conn.prober, emulator.config, seed, device.declared, emulator.checking
            )
    except ConnectionError:
        return  # it left while being probed, and is forgotten
    delta = probes.describe(device.declared, measured)
    log.info("device %d (%s) PROFILE_DELTA %s", device.id, device.name, delta)
    verdict = ProbeVerdict(
        probe=0, ok=measured.flops_verified, reason=measured.reason, flops=measured.flops
    )
    conn.send(verdict)
    if not measured.flops_verified:
        conn.fail("flops_failed", f"FLOPS challenge failed: {measured.reason}")
        return
    if device.local:
        emulator.local_kernels_verified = True
    if conn.device is device:
        ready(emulator, device, measured)


def _vouched_for(emulator: Emulator, device: DeviceRecord) -> bool:
    """A virtual device in the emulator's own process, once another there passed its FLOPS
    challenge, is not probed: it computes on the same kernel workers (an embedded fleet
    shares them), and its measurements would not be used (its declared profile is, unless
    ``profile_source=measured``). A fleet of thousands starts without thousands of
    challenges and bandwidth probes over loopback."""
    return (
        device.local
        and device.virtual
        and emulator.local_kernels_verified
        and emulator.config.profile_source != "measured"
    )


def ready(emulator: Emulator, device: DeviceRecord, measured: probes.Measurement | None) -> None:
    """Schedule on ``device``, with the profile ``measured`` (None: not probed) says."""
    source = emulator.config.profile_source
    device.model, why = probes.choose_profile(device.declared, measured, source, device.virtual)
    device.probed = probes.measured_figures(measured)
    device.ready = True
    log.info("device %d (%s) ready; scheduling with the %s profile", device.id, device.name, why)
    emulator.timeline.add_device(device.id, device.name, device.model, convolutions=device.conv)
    if emulator.waiting:  # told before their tiles' results come
        emulator.watch_waits(time.monotonic())
    emulator.scheduler.dispatch()


def lost(emulator: Emulator, device: DeviceRecord, why: str) -> None:
    """``device``'s connection is gone (``why``): forget it, and send its tiles to the
    others, but for those no device could compute (``Scheduler.give_up_on``)."""
    held = list(device.outstanding.values())
    emulator.registry.remove(device.id)
    emulator.timeline.remove_device(device.id)
    in_flight, queued = len(device.outstanding), len(device.queue)
    _hold_late_writes(emulator, device)
    for tile_id in device.outstanding:  # arrays offered to it it never took (``local``)
        local.take_tile((emulator.token, device.id, tile_id))
    requeued = emulator.scheduler.requeue(device)
    if requeued:
        ids = [t.id for t in requeued]
        log.warning(
            "device %d (%s) lost with %d tiles in flight and %d queued; re-queued tiles %s",
            device.id,
            device.name,
            in_flight,
            queued,
            ids,
        )
    else:
        log.info("device %d (%s) disconnected", device.id, device.name)
    for tile in held:
        emulator.scheduler.give_up_on(tile, device, why)
    emulator.scheduler.dispatch()


def _hold_late_writes(emulator: Emulator, device: DeviceRecord) -> None:
    """The outputs in the operand arena that lost ``device`` may still be writing stay
    alive a while, and out of their jobs' use where they are in a job's slab."""
    tasks = {id(t.gemm): t.gemm for t in device.outstanding.values() if t.c_at.place is Place.ARENA}
    for task in tasks.values():
        if task.c_at.place is Place.SLAB and task.owner is not None:
            task.owner.retire_slab(task)
    if tasks:
        emulator.hold_late_writes([task.out for task in tasks.values()])


class Prober:
    """One connection's probes: see the module docstring."""

    def __init__(self, conn: PeerConnection) -> None:
        self.conn = conn
        self._waiting: dict[int, tuple[type[Message], asyncio.Future[Message]]] = {}
        self._challenged = False  # a FLOPS challenge the peer asked for is running

    async def ask(self, msg: probes.Question, reply: type[R], timeout: float) -> R:
        """Send a probe and wait for its ``reply``: the message of that type with the same
        probe id (the peer may send others meanwhile)."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[msg.probe] = (reply, future)
        try:
            self.conn.send(msg)
            answer = await asyncio.wait_for(future, timeout)
        finally:
            self._waiting.pop(msg.probe, None)
        assert isinstance(answer, reply)  # (``replied`` sees to it)
        return answer

    def replied(self, msg: Reply) -> None:
        """A reply to one of our probes; one to none waiting is ignored."""
        waiting = self._waiting.get(msg.probe)
        if waiting is not None and isinstance(msg, waiting[0]) and not waiting[1].done():
            waiting[1].set_result(msg)

    def gone(self, peer: str) -> None:
        """The connection is lost: nothing will answer."""
        for _, future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError(f"{peer} disconnected"))

    def challenge_requested(self, msg: ProbeFlopsRequest) -> None:
        """One at a time per peer: each holds the peer's result (up to 64 MiB) until it is
        checked, and a peer asking faster than the checks run would pile them up."""
        challenge.check_dim(msg.dim, "PROBE_FLOPS_REQUEST.dim")
        if self._challenged:
            raise RemoteProtocolError(
                "PROBE_FLOPS_REQUEST while the one asked for earlier is still "
                "running: wait for its PROBE_VERDICT",
                "overload",
            )
        self._challenged = True
        self.conn.spawn(self._challenge(msg.dim))

    async def _challenge(self, dim: int) -> None:
        emulator = self.conn.emulator
        cfg = emulator.config
        seed = int.from_bytes(os.urandom(4), "little")
        try:
            flops, problem = await probes.flops_challenge(
                self, seed, dim, cfg.probe_tolerance, cfg.probe_timeout_s, emulator.checking_asked
            )
        except ConnectionError:
            return  # the peer that asked has gone
        finally:
            self._challenged = False
        self.conn.send(ProbeVerdict(probe=0, ok=not problem, reason=problem, flops=flops))

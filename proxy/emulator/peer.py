"""The emulator's side of one connection: each message goes to its role's handler.

Before HELLO a connection has no role (``handshake``); then it serves a device
(``devices``; its TILE_RESULTs go to ``tiles``) or a job or probe peer (``jobs``).
Probes go either way on any connection (``devices.Prober``). Which messages may
arrive in which state is the wire's state table, checked before they get here.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from morphling.proxy.net.flow import undelivered_bytes
from morphling.proxy.net.protocol import FrameConnection
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.errors import RemoteProtocolError
from morphling.proxy.wire.messages import (
    Bye,
    Close,
    Collective,
    Conv,
    Error,
    Gemm,
    Hello,
    Message,
    Open,
    ProbeAck,
    ProbeEcho,
    ProbeFlopsRequest,
    ProbeFlopsResult,
    ProbePulled,
    Slab,
    Status,
    StatusAsk,
    Step,
    TileMissing,
    TileResult,
    Wait,
)
from morphling.proxy.wire.states import Party

from . import devices, handshake, status, tiles
from .jobs import Job
from .registry import DeviceRecord

if TYPE_CHECKING:
    from .server import Emulator

log = logging.getLogger(__name__)


class PeerConnection(FrameConnection):
    """One connection; see the module docstring."""

    def __init__(self, emulator: Emulator) -> None:
        # No payload until HELLO is accepted (see ``handshake``)
        wire = Connection(Party.EMULATOR, max_payload=0, allocate=self._payload_memory)
        super().__init__(wire, high_water=emulator.config.high_water_bytes)
        self.emulator = emulator
        self.nonce = os.urandom(16)
        self.connected_at = time.monotonic()
        self.device: DeviceRecord | None = None  # its role, once HELLO said which
        self.job: Job | None = None  # likewise
        self.prober = devices.Prober(self)
        self._unread: tuple[int, float] | None = None  # (undelivered, since): ``unread_for``
        self._gated = False  # counted by the emulator's ``Gate`` until welcomed

    def connected(self) -> None:
        self.connected_at = time.monotonic()
        gate = self.emulator.gate
        if not gate.admit(self.peerhost):
            self.fail(
                "busy", f"{self.peerhost} already holds {gate.limit} connections not yet "
                "welcomed (--max-unwelcomed)"
            )  # fmt: skip
            return
        self._gated = True
        self.emulator.peers.add(self)
        self.send(handshake.greeting(self.emulator, self.nonce))

    def leave_gate(self) -> None:
        """Welcomed or gone: no longer counted against its address."""
        if self._gated:
            self._gated = False
            self.emulator.gate.leave(self.peerhost)

    def disconnected(self, exc: Exception | None) -> None:
        self.leave_gate()
        self.emulator.peers.discard(self)
        self.prober.gone(self.peername)
        if self.job is not None:
            self.job.left()
        if self.device is not None:
            device, self.device = self.device, None
            devices.lost(self.emulator, device, self.ended_with)

    def _payload_memory(self, nbytes: int) -> memoryview:
        """Where a received payload goes: a job's operands where devices on this host can
        read them, the rest into the buffer pool."""
        emulator = self.emulator
        return (emulator.allocate if self.job is None else emulator.shared_memory)(nbytes)

    def message_received(self, msg: Message) -> None:
        if isinstance(msg, TileResult):
            tiles.take_result(self.emulator.scheduler, self.emulator.verifier, self._device(), msg)
        elif isinstance(msg, TileMissing):
            self.emulator.scheduler.resend(self._device(), msg.tile, msg.reason)
        elif isinstance(msg, Gemm):
            self._job().gemm(msg)
        elif isinstance(msg, Hello):
            handshake.hello(self, msg)
        elif isinstance(msg, StatusAsk):
            self.send(Status(segments=(status.packed(self.emulator),)))
        elif self.answer_probe(msg):
            pass
        elif isinstance(msg, (ProbeEcho, ProbeAck, ProbePulled, ProbeFlopsResult)):
            self.prober.replied(msg)
        elif isinstance(msg, ProbeFlopsRequest):
            self.prober.challenge_requested(msg)
        elif isinstance(msg, Conv):
            self._job().conv(msg)
        elif isinstance(msg, Collective):
            self._job().collective(msg)
        elif isinstance(msg, Wait):
            self._job().wait(msg)
        elif isinstance(msg, Open):
            self._job().open(msg)
        elif isinstance(msg, Slab):
            self._job().slab_asked(msg)
        elif isinstance(msg, Step):
            self._job().step(msg)
        elif isinstance(msg, Close):
            self._job().close()
        elif isinstance(msg, Error):
            log.warning("%s reported an error: %s: %s", self.peername, msg.code, msg.reason)
            self.ending(msg.code, msg.reason)
            self.close()
        elif isinstance(msg, Bye):
            log.info("%s said goodbye: %s", self.peername, msg.reason or "(no reason)")
            self.close()
        # HEARTBEAT: receiving it was the point.

    def _job(self) -> Job:
        if self.job is None:  # (the state table lets only jobs send what asks for one)
            raise RemoteProtocolError("a job's message from a peer that is no job", "out_of_order")
        return self.job

    def _device(self) -> DeviceRecord:
        if self.device is None:
            raise RemoteProtocolError("TILE_RESULT before registration", "out_of_order")
        return self.device

    # -- flow control -----------------------------------------------------------------

    def writability_changed(self) -> None:
        if self.writable:
            self._unread, self.appended = None, 0  # it read enough to empty the buffer
        if self.job is not None:
            self.job.regulate()
        elif self.device is not None and self.writable:
            self.emulator.scheduler.dispatch()

    def unread_for(self, now: float) -> float:
        """Seconds the peer has read nothing we sent while the send buffer is past its
        high-water mark (0 otherwise). Called now and then, it compares what the peer has
        still to take with what it was at the last call plus what was queued since: less
        means the peer read, which tells one that stopped reading from one that reads
        slower than RESULTs come."""
        if self.writable or self.transport is None:
            return 0.0
        size = undelivered_bytes(self.transport)
        appended, self.appended = self.appended, 0
        if self._unread is None or size < self._unread[0] + appended:
            self._unread = (size, now)
        else:
            self._unread = (size, self._unread[1])
        return now - self._unread[1]

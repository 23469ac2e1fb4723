"""The asyncio layer under every connection: bytes in and out, nothing else.

``FrameConnection`` is an ``asyncio.BufferedProtocol``: the event loop reads
straight into the decoder's buffer (for large payloads, the payload's own
pool memory), complete messages are checked against the conversation's
state table and handed to ``message_received``, and outgoing messages go to
``transport.writelines`` as the codec's buffers. A protocol error is answered
with an ERROR frame naming it, then the connection is closed; other
connections never notice. Subclasses (the emulator's peers, the device
agent, the job client) implement the ``message_received`` hook.

Two ends of one connection in the same process and on the same event loop (the
embedded emulator and its fleet) may be *paired* (``pair_in_process``): then a
TILE or TILE_RESULT that carries no payload bytes (its operands and C were handed
over as arrays, ``local``, or lie in the operand arena) is handed to the other
end's ``message_received`` on the loop instead of being encoded, written, read
and decoded again. That round through the kernel's loopback cost the loop's
thread 60 of its 165 µs per tile, and the training benchmark's step a fifth of
its time (1.53 s, now 1.19 s, with 8 devices on 2 cores).
Everything else, bytes included, still goes through the socket; the messages
that skip it are independent of each other and of the rest (each TILE names all
it needs, each TILE_RESULT its tile), so nothing depends on their order against
the socket's.
"""

from __future__ import annotations

import abc
import asyncio
import fcntl
import logging
import struct
import termios
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from morphling.proxy.wire.codec import DEFAULT_MAX_PAYLOAD, Decoder, ProtocolError, encode
from morphling.proxy.wire.messages import (
    Error,
    Heartbeat,
    Message,
    MsgType,
    ProbeAck,
    ProbeEcho,
    ProbePulled,
)
from morphling.proxy.wire.states import Conversation

log = logging.getLogger(__name__)

DEFAULT_HIGH_WATER = 4 << 20
SMALL_PAYLOAD = 64 * 1024  # below this a received payload is a plain bytearray
_IN_PROCESS = (MsgType.TILE, MsgType.TILE_RESULT)  # what paired ends hand over directly
_NO_BYTES = memoryview(b"")
_PROBE_REQUESTS = (MsgType.PROBE_ECHO, MsgType.PROBE_PUSH, MsgType.PROBE_PULL)
# Connection ends that asked to be paired, by (own address, peer's address): each end's
# partner is filed under the same two addresses the other way round.
_ends: dict[tuple[Any, Any], FrameConnection] = {}


def pool_allocator(pool: Any) -> Callable[[int], memoryview]:
    """Receive buffers from ``pool`` (``acquire_buffer``) for payloads worth receiving in place."""

    def allocate(nbytes: int) -> memoryview:
        if nbytes < SMALL_PAYLOAD:
            return memoryview(bytearray(nbytes))
        return pool.acquire_buffer(nbytes)

    return allocate


def undelivered_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to ``transport`` that the peer's end has not taken yet: those in its
    buffer, and those in the kernel's send queue (SIOCOUTQ, where there is one). Only
    together do they shrink as a peer reads: the kernel's queue (megabytes, on a fast
    link) drains first."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    try:
        unsent = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
    except (AttributeError, OSError):  # no socket (a pipe, a test double), or not Linux
        return queued
    return queued + struct.unpack("i", unsent)[0]


class FrameConnection(asyncio.BufferedProtocol, abc.ABC):
    """One framed connection; see the module docstring."""

    def __init__(
        self,
        conversation: Conversation,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        allocate: Callable[[int], memoryview] | None = None,
        high_water: int = DEFAULT_HIGH_WATER,
    ) -> None:
        kwargs = {} if allocate is None else {"allocate": allocate}
        self.decoder = Decoder(max_payload=max_payload, **kwargs)
        self.conversation = conversation
        self.high_water = high_water
        self.max_pull = max_payload  # the largest PROBE_PULL answered
        self.transport: asyncio.Transport | None = None
        self.peername = "?"
        self.last_received = self.last_sent = time.monotonic()
        self.writable = True
        self.reading = True  # False: see ``pause_reading``
        self.appended = 0  # bytes queued behind the high-water mark (see ``send``)
        self._closing_since: float | None = None  # see ``abort_if_lingering``
        self.partner: FrameConnection | None = None  # the other end, in this process
        self._end: tuple[Any, Any] | None = None  # this end's key in ``_ends``
        self._loop: asyncio.AbstractEventLoop | None = None  # where it was paired
        self._drained: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()  # cancelled when the connection goes

    # -- asyncio.BufferedProtocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # uvloop: not a subclass
        self.transport = transport
        transport.set_write_buffer_limits(high=self.high_water)
        peer = transport.get_extra_info("peername")
        self.peername = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.last_received = self.last_sent = time.monotonic()
        self.connected()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = time.monotonic()
        self._safely(self._decode, nbytes)

    def _handed(self, msg: Message) -> None:
        """A message the paired other end handed over (``send``), as if decoded here."""
        if self.transport is None:  # closed since: as lost as bytes on a closed socket
            return
        self.last_received = time.monotonic()
        msg.segments = (_NO_BYTES,) * len(msg.segments)  # what the decoder gives for none
        self._safely(self._take, msg)

    def _decode(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        self._take_decoded()

    def _take_decoded(self) -> None:
        while self.transport is not None and self.reading and (msg := self.decoder.next_message()):
            self._take(msg)

    def _take(self, msg: Message) -> None:
        self.conversation.received(msg)
        self.message_received(msg)

    def _safely(self, step: Callable[..., None], *args: Any) -> None:
        """``step(*args)``; a protocol error, or a bug, fails only this connection."""
        try:
            step(*args)
        except ProtocolError as exc:
            self.fail(exc.code, exc.reason)
        except Exception:
            log.exception("%s: internal error while handling a message", self.peername)
            self.fail("internal", "internal error (see the other side's log)")

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._unpair()
        for task in list(self._tasks):
            task.cancel()
        if self._drained is not None:
            self._drained.set()
        self.disconnected(exc)

    def pause_writing(self) -> None:
        self.writable = False
        self.writability_changed()

    def resume_writing(self) -> None:
        self.writable = True
        if self._drained is not None:
            self._drained.set()
        self.writability_changed()

    # -- flow control ----------------------------------------------------------------

    def pause_reading(self) -> None:
        """Take no more messages until ``resume_reading``: the socket is left unread, so
        TCP holds the peer back, and messages already decoded wait in the decoder. (Not
        what a paired end hands over: only jobs are paused, and jobs are never paired.)"""
        if self.reading:
            self.reading = False
            if self.transport is not None:
                self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Take messages again: those that waited first, on the loop's next turn (not
        inside whatever handler decided to resume)."""
        if self.reading or not self.open:
            return
        self.reading = True
        self.last_received = time.monotonic()  # the silence while paused was ours
        self.transport.resume_reading()
        asyncio.get_running_loop().call_soon(self._safely, self._take_decoded)

    # -- sending -------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, msg: Message) -> None:
        """Queue ``msg``; its segments are referenced, not copied, until written. To a
        paired end, a TILE or TILE_RESULT without bytes is handed over on the loop."""
        if not self.open:
            raise ConnectionError(f"{self.peername}: connection is closed")
        partner = self.partner
        if partner is not None and msg.TYPE in _IN_PROCESS and not any(map(len, msg.segments)):
            asyncio.get_running_loop().call_soon(partner._handed, msg)
        elif self.writable:
            self.transport.writelines(encode(msg))
        else:  # all of it waits in the buffer: counted, to tell a reader from a deaf peer
            before = self.transport.get_write_buffer_size()
            self.transport.writelines(encode(msg))
            self.appended += self.transport.get_write_buffer_size() - before
        self.last_sent = time.monotonic()

    def pair_in_process(self) -> None:
        """This end is in the other end's process: once both have said so, and they run on
        the same event loop, they are paired (see the module docstring)."""
        if self._end is not None or self.transport is None:
            return
        here = self.transport.get_extra_info("sockname")
        there = self.transport.get_extra_info("peername")
        if not isinstance(here, tuple) or not isinstance(there, tuple):
            return
        self._end, self._loop = (here, there), asyncio.get_running_loop()
        other = _ends.pop((there, here), None)
        if other is None:
            _ends[self._end] = self
        elif other._loop is self._loop:
            self.partner, other.partner = other, self

    def _unpair(self) -> None:
        if self._end is not None and _ends.get(self._end) is self:
            del _ends[self._end]
        if self.partner is not None:
            self.partner.partner = None
            self.partner = None

    async def drain(self) -> None:
        """Wait until the transport's buffer is below the high-water mark."""
        while self.open and not self.writable:
            self._drained = self._drained or asyncio.Event()
            self._drained.clear()
            await self._drained.wait()

    def answer_probe(self, msg: Message) -> bool:
        """Answer the probes either side may send (PROBE_ECHO, PROBE_PUSH, PROBE_PULL);
        False when ``msg`` is not one of them (or is a reply to one of ours).

        A request while earlier replies still fill the send buffer past its high-water
        mark is refused: a peer that asks without reading would grow it without bound."""
        t = msg.TYPE
        if t not in _PROBE_REQUESTS or (t == MsgType.PROBE_ECHO and msg.reply):
            return False
        if not self.writable:
            unsent = self.transport.get_write_buffer_size()
            raise ProtocolError(f"{t.name} while {unsent} bytes of replies to earlier probes are "
                                "still unsent: read each reply before asking again",
                                "overload")  # fmt: skip
        if t == MsgType.PROBE_ECHO:
            self.send(ProbeEcho(probe=msg.probe, reply=True, segments=msg.segments))
        elif t == MsgType.PROBE_PUSH:
            self.send(ProbeAck(probe=msg.probe, nbytes=msg.segments[0].nbytes))
        else:
            if not 0 <= msg.nbytes <= self.max_pull:
                raise ProtocolError(
                    f"PROBE_PULL.nbytes={msg.nbytes} is outside 0..{self.max_pull}", "bad_probe"
                )
            self.send(ProbePulled(probe=msg.probe, segments=(np.zeros(msg.nbytes, np.uint8),)))
        return True

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` for this connection; it is cancelled when the connection goes."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start_heartbeats(self, period_s: float, silence_s: float) -> None:
        """Peer side: send HEARTBEAT after ``period_s`` without sending, and give up on
        an emulator silent for ``silence_s`` (the emulator keeps its own clock)."""

        async def beat() -> None:
            while self.open:
                await asyncio.sleep(period_s / 2)
                now = time.monotonic()
                if now - self.last_received > silence_s:
                    self.fail("timeout", f"nothing from the emulator for {silence_s:.3g} s")
                elif self.open and now - self.last_sent >= period_s:
                    self.send(Heartbeat())

        self.spawn(beat())

    def fail(self, code: str, reason: str, *, abort: bool = False) -> None:
        """Tell the peer what went wrong (if it is still there) and close; ``abort``: drop
        the connection at once, unsent bytes and all (a peer that reads nothing would
        never take them)."""
        log.warning("%s: %s: %s; closing the connection", self.peername, code, reason)
        if self.open:
            self.transport.writelines(encode(Error(code=code, reason=reason)))
            self.close()
        if abort and self.transport is not None:
            self.transport.abort()
        self.conversation.state = "closed"

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort_if_lingering(self, now: float, grace_s: float) -> None:
        """Called now and then once the connection is closing: abort it if it is still
        writing out its last bytes ``grace_s`` after it was first seen so, since a peer
        that reads nothing would keep it, and all it holds, open for ever."""
        if self.transport is None:
            return
        if self._closing_since is None:
            self._closing_since = now
        elif now - self._closing_since > grace_s:
            log.warning("%s: still unread %.3g s after closing; dropped", self.peername, grace_s)
            self.transport.abort()

    # -- hooks for subclasses ------------------------------------------------------

    def connected(self) -> None:
        """The transport is up."""

    @abc.abstractmethod
    def message_received(self, msg: Message) -> None:
        """A legal message arrived (already checked against the state table)."""

    def disconnected(self, exc: Exception | None) -> None:
        """The connection is gone, for whatever reason."""

    def writability_changed(self) -> None:
        """``writable`` flipped (the send buffer crossed the high-water mark)."""

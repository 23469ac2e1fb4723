"""The asyncio layer under every connection: bytes in and out, nothing else.

``FrameConnection`` is an ``asyncio.BufferedProtocol`` around a sans-IO
``wire.Connection``: the event loop reads straight into the connection's receive
buffer (for large payloads, the payload's own pool memory), the messages it completes
(already checked against the conversation's state) go to ``message_received``, and
each message sent goes to ``transport.writelines`` as the codec's buffers. A protocol
error is answered with an ERROR frame naming it, then the connection is closed; other
connections never notice. Subclasses (the emulator's peers, the device agent, the job
client, ``morphling-bench``) implement ``message_received``.

Two ends of one connection in one process may be paired (``pair_in_process``, see
``pairing``): then what ``pairing.skips_socket`` names is handed to the other end on
the loop instead of crossing the socket.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, cast

from morphling.proxy.wire import probing
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from morphling.proxy.wire.messages import Heartbeat, Message

from . import pairing

log = logging.getLogger(__name__)

DEFAULT_HIGH_WATER = 4 << 20
SMALL_PAYLOAD = 64 * 1024  # below this a received payload is a plain bytearray


class Pool(Protocol):
    def acquire_buffer(self, nbytes: int) -> memoryview: ...


def pool_allocator(pool: Pool) -> Callable[[int], memoryview]:
    """Receive buffers from ``pool`` for payloads worth receiving in place."""

    def allocate(nbytes: int) -> memoryview:
        if nbytes < SMALL_PAYLOAD:
            return memoryview(bytearray(nbytes))
        return pool.acquire_buffer(nbytes)

    return allocate


class FrameConnection(asyncio.BufferedProtocol, abc.ABC):
    """One framed connection; see the module docstring."""

    def __init__(self, wire: Connection, *, high_water: int = DEFAULT_HIGH_WATER) -> None:
        self.wire = wire
        self.high_water = high_water
        self.transport: asyncio.Transport | None = None
        self.peername = self.peerhost = "?"  # "host:port", and its host
        self.last_received = self.last_sent = time.monotonic()
        self.writable = True
        self.reading = True  # False: see ``pause_reading``
        self.appended = 0  # bytes queued behind the high-water mark (see ``send``)
        self.partner: FrameConnection | None = None  # the other end, in this process
        self._pairing: pairing.Key | None = None  # this end's offer to pair
        self._closing_since: float | None = None  # see ``abort_if_lingering``
        self.failure = ""  # why it ended ("code: reason"): ``fail``, or the peer's ERROR
        self._drained: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # cancelled when the connection goes

    # -- asyncio.BufferedProtocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass, hence the cast)
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(high=self.high_water)
        peer = transport.get_extra_info("peername")
        self.peername = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.peerhost = str(peer[0]) if isinstance(peer, tuple) else self.peername
        self.last_received = self.last_sent = time.monotonic()
        self.connected()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.wire.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = time.monotonic()
        self._safely(self._decode, nbytes)

    def _handed(self, msg: Message) -> None:
        """A message the paired other end handed over (``send``), as if decoded here."""
        if self.transport is None:  # closed since: as lost as bytes on a closed socket
            return
        self.last_received = time.monotonic()
        self._safely(self._take_handed, msg)

    def _take_handed(self, msg: Message) -> None:
        self.wire.receive_message(msg)
        self.message_received(msg)

    def _decode(self, nbytes: int) -> None:
        self.wire.buffer_updated(nbytes)
        self._take_decoded()

    def _take_decoded(self) -> None:
        while self.transport is not None and self.reading:
            msg = self.wire.next_message()
            if msg is None:
                return
            self.message_received(msg)

    def _safely(self, step: Callable[..., None], *args: Any) -> None:
        """``step(*args)``; the other side's protocol error, or a bug here, fails only
        this connection."""
        try:
            step(*args)
        except LocalProtocolError:
            log.exception("%s: this side broke the protocol", self.peername)
            self.fail("internal", "internal error (see the other side's log)")
        except ProtocolError as exc:
            self.fail(exc.code, exc.reason)
        except Exception:
            log.exception("%s: internal error while handling a message", self.peername)
            self.fail("internal", "internal error (see the other side's log)")

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.wire.close()
        if self._pairing is not None:
            pairing.withdraw(self, self._pairing)
        if self.partner is not None:
            self.partner.partner = None
            self.partner = None
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
        TCP holds the peer back, and messages already decoded wait in the connection.
        (Not what a paired end hands over: only jobs are paused, and jobs are never
        paired.)"""
        if self.reading:
            self.reading = False
            if self.transport is not None:
                self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Take messages again: those that waited first, on the loop's next turn (not
        inside whatever handler decided to resume)."""
        if self.reading or self.transport is None or self.transport.is_closing():
            return
        self.reading = True
        self.last_received = time.monotonic()  # the silence while paused was ours
        self.transport.resume_reading()
        asyncio.get_running_loop().call_soon(self._safely, self._take_decoded)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below the high-water mark."""
        while self.open and not self.writable:
            self._drained = self._drained or asyncio.Event()
            self._drained.clear()
            await self._drained.wait()

    # -- sending -------------------------------------------------------------------

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, msg: Message) -> None:
        """Queue ``msg``; its segments are referenced, not copied, until written. To a
        paired end, what ``pairing.skips_socket`` names is handed over on the loop."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionError(f"{self.peername}: connection is closed")
        partner = self.partner
        if partner is not None and pairing.skips_socket(msg):
            self.wire.hand_over(msg)
            asyncio.get_running_loop().call_soon(partner._handed, msg)
        elif self.writable:
            transport.writelines(self.wire.send(msg))
        else:  # all of it waits in the buffer: counted, to tell a reader from a deaf peer
            before = transport.get_write_buffer_size()
            transport.writelines(self.wire.send(msg))
            self.appended += transport.get_write_buffer_size() - before
        self.last_sent = time.monotonic()

    def pair_in_process(self) -> None:
        """This end is in the other end's process (see ``pairing``)."""
        if self._pairing is not None or self.transport is None:
            return
        here = self.transport.get_extra_info("sockname")
        there = self.transport.get_extra_info("peername")
        if isinstance(here, tuple) and isinstance(there, tuple):
            self._pairing, partner = pairing.offer(self, here, there)
            if partner is not None:
                self.partner, partner.partner = partner, self

    def answer_probe(self, msg: Message) -> bool:
        """Answer a probe request (``probing``); False when ``msg`` is not one.

        A request while earlier replies still fill the send buffer past its high-water
        mark is refused: a peer that asks without reading would grow it without bound."""
        if not probing.is_request(msg):
            return False
        if not self.writable and self.transport is not None:
            unsent = self.transport.get_write_buffer_size()
            raise RemoteProtocolError(
                f"{msg.TYPE.name} while {unsent} bytes of replies to earlier probes are still "
                "unsent: read each reply before asking again",
                "overload",
            )
        self.send(probing.answer(msg, self.wire.max_payload))
        return True

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
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

    def ending(self, code: str, reason: str) -> None:
        """Note why the connection ends (``fail``'s error, or the peer's ERROR), unless a
        reason is noted already: the first is the cause."""
        self.failure = self.failure or f"{code}: {reason}"

    @property
    def ended_with(self) -> str:
        """Why it ended, as logs and reports say it."""
        return self.failure or "its connection closed"

    def fail(self, code: str, reason: str, *, abort: bool = False) -> None:
        """Tell the peer what went wrong (if it is still there) and close; ``abort``: drop
        the connection at once, unsent bytes and all (a peer that reads nothing would
        never take them)."""
        log.warning("%s: %s: %s; closing the connection", self.peername, code, reason)
        self.ending(code, reason)
        if self.open:
            assert self.transport is not None
            self.transport.writelines(self.wire.send_error(code, reason))
            self.close()
        if abort and self.transport is not None:
            self.transport.abort()
        self.wire.close()

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

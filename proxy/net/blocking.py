"""A connection driven by the calling thread: a non-blocking socket, polled.

The blocking job client (a training script's thread) does its own socket I/O, so a GEMM
costs no hop to an event-loop thread and back. Two threads share the channel: the
caller, and a heartbeat thread that only sends. Every wait is a poll, so a send that
cannot go on reads what arrives meanwhile: an emulator reads no more of a job that
leaves its replies unread, and a send that only waited could wait for ever.

Failures end the channel for good and raise ``ChannelError`` with the code a job's
error reports (``disconnected``, ``timeout``, or the protocol error's own).
"""

from __future__ import annotations

import math
import select
import socket
import threading
import time

from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.errors import ProtocolError
from morphling.proxy.wire.messages import Message


class ChannelError(Exception):
    """The channel is unusable; ``code`` and ``reason`` say why."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class BlockingChannel:
    """``wire``'s messages over ``sock``, which it makes non-blocking and owns."""

    def __init__(self, sock: socket.socket, wire: Connection) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.wire = wire
        self.silence_s = math.inf  # an emulator silent this long is gone (it heartbeats)
        self.last_sent = self.last_received = time.monotonic()
        self.failure: ChannelError | None = None
        self._readable = select.poll()  # for the thread that holds ``_recv_lock``
        self._readable.register(sock, select.POLLIN)
        self._send_lock = threading.Lock()  # the caller and the heartbeat thread
        self._recv_lock = threading.Lock()  # the connection's receive side: the caller,
        # or a send that waits for room

    def send(self, msg: Message) -> None:
        """Write ``msg``'s whole frame. A send cut short (Ctrl-C, say) once part of the
        frame went out leaves the stream unusable: the channel closes."""
        with self._send_lock:
            self._check()
            buffers = self.wire.send(msg)  # bytes and byte views: ``len`` is their size
            started = False
            try:
                while True:
                    try:
                        sent = self.sock.sendmsg(buffers)
                    except BlockingIOError:
                        sent = 0
                    started = started or sent > 0
                    while buffers and sent >= len(buffers[0]):
                        sent -= len(buffers[0])
                        buffers.pop(0)
                    if not buffers:
                        break
                    buffers[0] = buffers[0][sent:]
                    self._await_room()
            except BaseException:
                if started and buffers and self.failure is None:
                    reason = "a request was cut off while being sent; the connection is closed"
                    self._end(ChannelError("disconnected", reason))
                raise
            self.last_sent = time.monotonic()

    def receive(self, deadline: float | None) -> Message:
        """The next message; ``TimeoutError`` at ``deadline`` (monotonic), ``ChannelError``
        when the emulator is gone (closed, silent for ``silence_s``) or broke the
        protocol."""
        with self._recv_lock:
            self._check()
            while (msg := self._next()) is None:
                if self._read_some():
                    continue
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError("no reply from the emulator in time")
                if now - self.last_received > self.silence_s:
                    silent = f"nothing from the emulator for {self.silence_s:.3g} s"
                    self._fail(ChannelError("timeout", silent))
                until = min(self.last_received + self.silence_s, deadline or math.inf)
                wait_ms = None if until == math.inf else math.ceil(max(until - now, 0.0) * 1000)
                self._readable.poll(wait_ms)
        return msg

    def fail(self, error: ChannelError) -> None:
        """End the channel with ``error`` (the other side refused, say) and raise it."""
        self._fail(error)

    def close(self) -> None:
        self.wire.close()
        self.sock.close()

    def _next(self) -> Message | None:
        try:
            return self.wire.next_message()
        except ProtocolError as exc:
            self._fail(ChannelError(exc.code, f"bad frame from the emulator: {exc.reason}"))
            raise AssertionError("unreachable") from None

    def _read_some(self) -> bool:
        """Take what has arrived; False if nothing has (the socket does not block)."""
        try:
            nbytes = self.sock.recv_into(self.wire.get_buffer())
            if nbytes == 0:
                self._fail(ChannelError("disconnected", "the emulator closed the connection"))
            self.last_received = time.monotonic()
            self.wire.buffer_updated(nbytes)
        except BlockingIOError:
            return False
        except ProtocolError as exc:
            self._fail(ChannelError(exc.code, f"bad frame from the emulator: {exc.reason}"))
        except ConnectionError as exc:
            self._fail(ChannelError("disconnected", f"connection lost ({exc})"))
        return True

    def _await_room(self) -> None:
        """Wait until the socket takes more, reading what arrives meanwhile (unless the
        caller's thread is reading already)."""
        reading = self._recv_lock.acquire(blocking=False)
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLOUT | (select.POLLIN if reading else 0))
            [(_, events)] = poller.poll()
            if reading and events & ~select.POLLOUT:  # data, or the end of the connection
                self._read_some()
        finally:
            if reading:
                self._recv_lock.release()

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _end(self, error: ChannelError) -> None:
        self.failure = error
        self.close()

    def _fail(self, error: ChannelError) -> None:
        self._end(error)
        raise error

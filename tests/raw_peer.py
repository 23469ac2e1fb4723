"""A hand-driven peer: frames built and read with the codec alone, to speak (or break)
the protocol as no agent or client would; and a TILE's operands read straight from the
wire format. The emulator tests' misbehaving peers, and those of the arena and in-process
tests; and a hand-driven emulator, answering as no emulator would, for the clients' tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import numpy as np
from morphling.proxy.wire import codec
from morphling.proxy.wire.handshake import expected_mac
from morphling.proxy.wire.messages import (
    Error,
    Greeting,
    Hello,
    Message,
    MsgType,
    Welcome,
)

Answer = Callable[[Message], Message | None]


def prefix(
    msg_type: int,
    header_len: int,
    payload_len: int,
    *,
    magic: int = codec.MAGIC,
    version: int = codec.VERSION,
) -> bytes:
    return codec.PREFIX.pack(magic, version, msg_type, header_len, payload_len)


def raw_frame(msg_type: int, header: Any, payload_len: int = 0) -> bytes:
    """A frame's prefix and an arbitrary msgpack header (the payload is the caller's)."""
    packed = msgpack.packb(header)
    return prefix(msg_type, len(packed), payload_len) + packed


class RawPeer:
    """A hand-driven asyncio connection: send frames or bytes, read decoded messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder()
        self.greeting: Greeting | None = None

    @classmethod
    async def connect(cls, host: str, port: int, *, rcvbuf: int = 0) -> RawPeer:
        """``rcvbuf``: a small kernel receive buffer, so that not reading soon backs up."""
        if not rcvbuf:
            return cls(*await asyncio.open_connection(host, port))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        return cls(*await asyncio.open_connection(sock=sock))

    def stop_reading(self) -> None:
        """Read nothing more from the socket until ``recv`` is called."""
        self.writer.transport.pause_reading()

    def send(self, msg: Message) -> None:
        self.writer.write(codec.encode_bytes(msg))

    def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self, timeout: float = 5.0) -> Message | None:
        """The next message, or None at EOF (or a reset)."""
        self.writer.transport.resume_reading()
        while (msg := self.decoder.next_message()) is None:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 20), timeout)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.decoder.receive_data(data)
        return msg

    async def recv_skipping_heartbeats(self, timeout: float = 5.0) -> Message | None:
        """The next message but HEARTBEATs and NOTICEs (which only inform a job's user)."""
        skipped = (MsgType.HEARTBEAT, MsgType.NOTICE)
        while (msg := await self.recv(timeout)) is not None and msg.TYPE in skipped:
            pass
        return msg

    async def hello(self, role: str = "job", *, token: str = "", **fields: Any) -> Welcome:
        greeting = await self.recv()
        assert isinstance(greeting, Greeting), greeting
        self.greeting = greeting
        mac = expected_mac(token, greeting.nonce) if token else b""
        self.send(Hello(role=role, mac=mac, **fields))
        welcome = await self.recv_skipping_heartbeats()
        assert isinstance(welcome, Welcome), welcome
        return welcome

    async def expect_error(self, code: str | tuple[str, ...], timeout: float = 5.0) -> Error:
        """The next message is an ERROR with ``code`` (or one of them), then EOF."""
        msg = await self.recv_skipping_heartbeats(timeout)
        assert isinstance(msg, Error), f"expected ERROR {code}, got {msg!r}"
        assert msg.code in ((code,) if isinstance(code, str) else code), msg
        assert await self.recv(timeout) is None, "the server should close after an ERROR"
        return msg

    def close(self) -> None:
        self.writer.close()


def blocking_exchange(
    host: str, port: int, data: bytes, *, wait_s: float = 5.0
) -> tuple[list[Message], bool, float]:
    """A plain blocking socket: send ``data``, read to EOF; (messages, got EOF, seconds)."""
    decoder = codec.Decoder()
    messages: list[Message] = []
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=wait_s) as sock:
        if data:
            sock.sendall(data)
        eof = False
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                break
            except ConnectionResetError:
                eof = True
                break
            if not chunk:
                eof = True
                break
            decoder.receive_data(chunk)
            while (msg := decoder.next_message()) is not None:
                messages.append(msg)
    return messages, eof, time.monotonic() - start


def tile_operand(seg: Any, dtype: str, trans: bool, rows: int, cols: int, ld: int) -> np.ndarray:
    """op(X), [rows, cols], from a TILE segment as the protocol defines it (checked bounds)."""
    flat = np.frombuffer(seg, dtype)
    srows, scols = (cols, rows) if trans else (rows, cols)
    assert ld >= scols and len(flat) >= (srows - 1) * ld + scols, "TILE span too short"
    stored = np.lib.stride_tricks.as_strided(
        flat, (srows, scols), (ld * flat.itemsize, flat.itemsize), writeable=False
    )
    return stored.T if trans else stored


@contextlib.asynccontextmanager
async def fake_emulator(answer: Answer) -> AsyncIterator[int]:
    """An emulator on loopback that greets, welcomes any HELLO, then answers each message
    with ``answer`` (None: not at all) until the peer hangs up; yields its port."""
    served: set[asyncio.Task[None]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.add(asyncio.current_task())
        writers.add(writer)
        decoder = codec.Decoder()

        async def receive() -> Message | None:
            while (msg := decoder.next_message()) is None:
                data = await reader.read(1 << 16)
                if not data:  # the peer hung up
                    return None
                decoder.receive_data(data)
            return msg

        writer.write(codec.encode_bytes(Greeting(version=codec.VERSION, nonce=b"n", auth=False)))
        if isinstance(await receive(), Hello):
            writer.write(codec.encode_bytes(Welcome(peer_id=7, heartbeat_s=60.0)))
            while (msg := await receive()) is not None:
                if (reply := answer(msg)) is not None:
                    writer.write(codec.encode_bytes(reply))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await asyncio.wait_for(asyncio.gather(*served), 10.0)

"""Frames to bytes and bytes to frames, sans-IO (``connection`` adds the state; no sockets).

A frame is a 16-byte little-endian prefix ``magic u16 | version u8 | type u8 |
header_len u32 | payload_len u64``, a msgpack map (the message's fields plus
``seg``, the payload's segment descriptors ``[dtype, shape, nbytes]``), then
``payload_len`` raw bytes: the segments back to back.

``encode`` returns a list of buffers for ``transport.writelines`` (tensor
memory is referenced, never copied). ``Decoder`` takes bytes in any chunking,
enforces the limits from the prefix before allocating anything, and can hand
out the payload's own memory as the receive buffer (``get_buffer`` /
``buffer_updated``, the ``asyncio.BufferedProtocol`` calls) so large payloads
land where they stay, without a copy.
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from .errors import RemoteProtocolError
from .messages import DTYPES, MESSAGES, Message, from_wire

MAGIC = 0x4D47  # "GM" on the wire
VERSION = 1
PREFIX = struct.Struct("<HBBIQ")
MAX_HEADER = 1 << 20
DEFAULT_MAX_PAYLOAD = 1 << 30
_ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}
_NAMES = {np.dtype(name).newbyteorder("<"): name for name in DTYPES}
_SCRATCH_BYTES = 256 * 1024
_TYPE_NAMES = {t: cls.TYPE.name for t, cls in MESSAGES.items()}  # an enum .name is slow


def _segment(seg: Any) -> tuple[list[Any], memoryview]:
    """(descriptor, bytes view) of one outgoing segment, without copying."""
    if isinstance(seg, np.ndarray):
        name = _NAMES.get(seg.dtype)  # a dict lookup: dtype.name costs microseconds
        if name is None:
            if seg.dtype.newbyteorder("<") in _NAMES:
                raise ValueError(
                    f"segment dtype {seg.dtype.str} is not little-endian, as the wire is"
                )
            raise ValueError(f"segment dtype {seg.dtype} is not one of {DTYPES}")
        if not seg.flags.c_contiguous:
            raise ValueError(f"segment of shape {seg.shape} is not C-contiguous")
        # a C-contiguous view casts to bytes whatever its shape, unless a dimension is 0
        view = seg.data.cast("B") if seg.size else memoryview(b"")
        return [name, list(seg.shape), seg.nbytes], view
    view = memoryview(seg)
    if not view.c_contiguous:
        raise ValueError("segment buffer is not contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return ["uint8", [view.nbytes], view.nbytes], view


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frame for ``msg`` as buffers for ``writelines``: prefix+header, then segments."""
    segments = msg.segments
    if len(segments) != msg.SEGMENTS:
        raise ValueError(
            f"{msg.TYPE.name}: {len(segments)} segments given, expected {msg.SEGMENTS}"
        )
    header = msg.header()
    buffers: list[bytes | memoryview] = [b""]
    payload_len = 0
    if segments:
        header["seg"] = described = []
        for seg in segments:
            desc, view = _segment(seg)
            described.append(desc)
            buffers.append(view)
            payload_len += desc[2]
    packed = _packer().pack(header)
    buffers[0] = PREFIX.pack(MAGIC, VERSION, msg.TYPE, len(packed), payload_len) + packed
    return buffers


def encode_bytes(msg: Message) -> bytes:
    """The whole frame as one bytes object (tests, blocking sockets)."""
    return b"".join(encode(msg))


_local = threading.local()


def _scratch() -> memoryview:
    """This thread's receive buffer for prefixes, headers and small payloads.

    Shared by every connection on the thread's event loop: ``get_buffer`` and
    ``buffer_updated`` run back to back, and the decoder copies out what it
    keeps, so per-connection memory stays small however many peers connect.
    """
    view = getattr(_local, "scratch", None)
    if view is None:
        view = _local.scratch = memoryview(bytearray(_SCRATCH_BYTES))
    return view


def _packer() -> msgpack.Packer:
    """This thread's msgpack packer (``msgpack.packb`` makes a new one, buffer and all,
    for every call; a packer is not safe to share between threads)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


def _bytearray_view(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


class Decoder:
    """Incremental frame decoder. Feed bytes, take messages; raises ``RemoteProtocolError``.

    ``allocate(nbytes)`` supplies each payload's memory (a writable memoryview;
    a pool's ``acquire_buffer`` for zero-copy receives). After a
    ``RemoteProtocolError`` the decoder stays failed.
    """

    def __init__(
        self,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_header: int = MAX_HEADER,
        allocate: Callable[[int], memoryview] | None = None,
    ) -> None:
        self.max_payload = max_payload
        self.max_header = max_header
        self._allocate = allocate or _bytearray_view
        self._pending = bytearray()  # a partial prefix or header
        self._prefix: tuple[int, int, int, int, int] | None = None
        self._header: dict[str, Any] | None = None
        self._payload: memoryview | None = None
        self._filled = 0
        self._direct = False
        self._failed: RemoteProtocolError | None = None
        self._messages: deque[Message] = deque()

    # -- feeding ---------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Consume ``data`` (copied where it must be kept)."""
        self._feed(memoryview(data).cast("B") if data else memoryview(b""))

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should go: the payload itself, or scratch."""
        if self._failed is not None:
            raise self._failed
        if self._payload is not None:
            self._direct = True
            return self._payload[self._filled :]
        self._direct = False
        return _scratch()

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the buffer ``get_buffer`` returned."""
        if self._direct:
            self._direct = False
            self._filled += nbytes
            assert self._payload is not None  # ``_direct``: get_buffer gave the payload
            if self._filled == len(self._payload):
                try:
                    self._finish()
                except RemoteProtocolError as exc:
                    self._failed = exc
                    raise
            return
        self._feed(_scratch()[:nbytes])

    def _feed(self, data: memoryview) -> None:
        """Consume bytes; a ``RemoteProtocolError`` fails the decoder for good."""
        if self._failed is not None:
            raise self._failed
        try:
            self._consume(data)
        except RemoteProtocolError as exc:
            self._failed = exc
            raise

    def next_message(self) -> Message | None:
        """The next complete message, or ``None`` until more bytes arrive."""
        return self._messages.popleft() if self._messages else None

    @property
    def idle(self) -> bool:
        """No partial frame is buffered (a peer may stop here without losing anything)."""
        return self._prefix is None and not self._pending

    # -- parsing -----------------------------------------------------------------

    def _consume(self, data: memoryview) -> None:
        while data:
            if self._payload is not None:
                take = min(len(data), len(self._payload) - self._filled)
                self._payload[self._filled : self._filled + take] = data[:take]
                self._filled += take
                data = data[take:]
                if self._filled == len(self._payload):
                    self._finish()
                continue
            want = PREFIX.size if self._prefix is None else self._prefix[3]
            if self._pending or len(data) < want:  # a part: gather the rest first
                take = min(len(data), want - len(self._pending))
                self._pending += data[:take]
                data = data[take:]
                if len(self._pending) < want:
                    return
                block: bytes | memoryview = bytes(self._pending)
                self._pending = bytearray()
            else:  # all here: parsed where it lies (what is kept of it is copied)
                block, data = data[:want], data[want:]
            if self._prefix is None:
                self._parse_prefix(block)
            else:
                self._parse_header(block)

    def _parse_prefix(self, block: bytes | memoryview) -> None:
        magic, version, msg_type, header_len, payload_len = PREFIX.unpack(block)
        if magic != MAGIC:
            raise RemoteProtocolError(
                f"bad magic 0x{magic:04x} (expected 0x{MAGIC:04x})", "bad_magic"
            )
        if version != VERSION:
            raise RemoteProtocolError(
                f"protocol version {version} is not supported (this side speaks {VERSION})",
                "bad_version",
            )
        if msg_type not in MESSAGES:
            raise RemoteProtocolError(f"unknown message type {msg_type}", "unknown_type")
        if not 0 < header_len <= self.max_header:
            raise RemoteProtocolError(
                f"header length {header_len} outside 1..{self.max_header}", "too_large"
            )
        if payload_len > self.max_payload:
            raise RemoteProtocolError(
                f"payload length {payload_len} exceeds the limit of {self.max_payload} bytes",
                "too_large",
            )
        if payload_len and not MESSAGES[msg_type].SEGMENTS:
            raise RemoteProtocolError(
                f"{MESSAGES[msg_type].TYPE.name} carries no payload, but payload_len is "
                f"{payload_len}",
                "bad_frame",
            )
        self._prefix = (magic, version, msg_type, header_len, payload_len)

    def _parse_header(self, block: bytes | memoryview) -> None:
        assert self._prefix is not None
        msg_type, payload_len = self._prefix[2], self._prefix[4]
        name = _TYPE_NAMES[msg_type]
        try:
            header = msgpack.unpackb(block, raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise RemoteProtocolError(f"{name}: header is not valid msgpack ({exc})") from None
        if not isinstance(header, dict):
            raise RemoteProtocolError(f"{name}: header is a {type(header).__name__}, not a map")
        total = _segments_total(header.get("seg", []), name)
        if total != payload_len:
            raise RemoteProtocolError(
                f"{name}: segments add up to {total} bytes, payload_len is {payload_len}"
            )
        self._header = header
        if payload_len:
            self._payload = self._allocate(payload_len)
            self._filled = 0
        else:
            self._finish()

    def _finish(self) -> None:
        assert self._prefix is not None and self._header is not None
        msg_type = self._prefix[2]
        header, payload = self._header, self._payload
        self._prefix = self._header = self._payload = None
        if payload is None:
            payload = memoryview(b"")
        segments = []
        offset = 0
        for _dtype, _shape, nbytes in header.pop("seg", ()):
            segments.append(payload[offset : offset + nbytes])
            offset += nbytes
        try:
            message = from_wire(msg_type, header, tuple(segments))
        except ValueError as exc:
            raise RemoteProtocolError(str(exc), "bad_header") from None
        self._messages.append(message)


def _segments_total(seg: Any, name: str) -> int:
    """Validate the segment descriptors; their total byte length."""
    if not isinstance(seg, list):
        raise RemoteProtocolError(f"{name}: 'seg' must be a list of [dtype, shape, nbytes]")
    total = 0
    for i, desc in enumerate(seg):
        if not (isinstance(desc, list) and len(desc) == 3):
            raise RemoteProtocolError(f"{name}: seg[{i}] must be [dtype, shape, nbytes]")
        dtype, shape, nbytes = desc
        item = _ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
        if item is None:
            raise RemoteProtocolError(
                f"{name}: seg[{i}] dtype {dtype!r:.40} is not one of {DTYPES}"
            )
        count = _count(shape)
        if count is None:
            raise RemoteProtocolError(
                f"{name}: seg[{i}] shape {shape!r} is not a list of sizes >= 0"
            )
        if type(nbytes) is not int or nbytes != count * item:
            raise RemoteProtocolError(
                f"{name}: seg[{i}] nbytes {nbytes!r} does not match {dtype} of shape {shape}"
            )
        total += nbytes
    return total


def _count(shape: Any) -> int | None:
    """The elements of ``shape``; None unless it is a list of sizes >= 0 (plain ints, as
    msgpack gives them: a bool is not one)."""
    if not isinstance(shape, list):
        return None
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        count *= d
    return count


def segment_array(msg: Message, index: int, dtype: str, count: int | None = None) -> np.ndarray:
    """Segment ``index`` of a received message as a 1-D numpy array of ``dtype`` (no copy)."""
    view = msg.segments[index]
    item = _ITEMSIZE[dtype]
    if view.nbytes % item:
        raise RemoteProtocolError(
            f"{msg.TYPE.name}: segment {index} of {view.nbytes} bytes is not whole {dtype}s",
            "bad_shape",
        )
    return np.frombuffer(view, dtype=dtype, count=-1 if count is None else count)

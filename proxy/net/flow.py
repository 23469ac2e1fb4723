"""Flow control's measurements: what a peer has not taken of what was written to it."""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios


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
    queued_in_kernel: int = struct.unpack("i", unsent)[0]
    return queued + queued_in_kernel

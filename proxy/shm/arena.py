"""The operand arena: a job's GEMM operands where devices on the emulator's host read them.

A tile needs one block of A and one of B, and a row of tiles shares its A
block: sent as bytes, an operand crosses loopback once per tile that uses it,
gigabytes per training step of a small model, to devices that share the
emulator's memory anyway. So the emulator receives a job's operand payloads
straight into this shared file (announced in GREETING as ``arena``); a device
that maps it (HELLO ``caps.arena``) gets each block as a byte offset
(``TILE.arena_a``/``arena_b``) and reads it in place, and writes its result
tile straight into the GEMM's output there (``arena_c``) instead of sending
it back. Devices elsewhere get bytes, as before.

The file is sparse. Its pages are reserved (``posix_fallocate``) the first
time an allocation reaches them, so a /dev/shm too small for the arena (64 MiB
in a default Docker container) means a payload that does not fit goes to the
ordinary buffer pool, never a SIGBUS. An extent returns to the free list when
the last view of it is gone; extents are page-aligned, so every dtype is
aligned.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import threading
import weakref
from pathlib import Path

from .files import SharedFile

log = logging.getLogger(__name__)

PAGE = 4096


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // PAGE) * PAGE


class OperandArena(SharedFile):
    """The emulator's arena: ``allocate`` hands out memory in it; see the module docstring."""

    KIND = "arena"
    PEERS_WRITE = True  # devices write their result tiles into GEMM outputs here

    def __init__(self, path: Path, *, writable: bool, owner: bool) -> None:
        super().__init__(path, writable=writable, owner=owner)
        self._fd: int | None = None  # the creator's, for posix_fallocate
        self._free = [(0, self.nbytes)]  # (offset, size) extents, by offset, coalesced
        self._reserved = 0  # pages below this are backed
        self._lock = threading.Lock()  # a view's last reference may go in any thread
        self.full = 0  # allocations that did not fit (went to the pool)

    @classmethod
    def create(cls, nbytes: int) -> OperandArena:
        """A new arena of ``nbytes`` (rounded up to pages), nothing reserved yet."""
        fd, path = cls.new_file()
        try:
            os.ftruncate(fd, pages(nbytes))
            arena = cls(path, writable=True, owner=True)
        except BaseException:
            os.close(fd)
            path.unlink()
            raise
        arena._fd = fd
        log.info("operand arena of %d MiB at %s", arena.nbytes >> 20, path)
        return arena

    def allocate(self, nbytes: int) -> memoryview | None:
        """``nbytes`` of the arena, or None when they do not fit (or /dev/shm is full)."""
        size = max(PAGE, pages(nbytes))
        with self._lock:
            i = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if i is None or not self._reserve(self._free[i][0] + size):
                self.full += 1
                return None
            offset, free = self._free[i]
            if free == size:
                del self._free[i]
            else:
                self._free[i] = (offset + size, free - size)
        view = self.array[offset : offset + nbytes]
        weakref.finalize(view, self._release, offset, size)
        return view.data

    def _reserve(self, end: int) -> bool:
        """Back the pages up to ``end``; False when the file system has no room."""
        if end <= self._reserved:
            return True
        assert self._fd is not None, "only the arena's creator allocates"
        try:
            os.posix_fallocate(self._fd, self._reserved, end - self._reserved)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EOPNOTSUPP):
                raise
            log.warning(
                "operand arena: %s has no room for %d more bytes (%s); operands "
                "that do not fit go as bytes",
                self.path.parent,
                end - self._reserved,
                exc.strerror,
            )
            return False
        self._reserved = end
        return True

    def _release(self, offset: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect(self._free, (offset, size))
            if i < len(self._free) and offset + size == self._free[i][0]:  # join the next
                size += self._free.pop(i)[1]
            if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous
                offset, prev = self._free[i - 1]
                self._free[i - 1] = (offset, prev + size)
            else:
                self._free.insert(i, (offset, size))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def close(self) -> None:
        super().close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

"""Python face of the C buffer pool: leases that expose pool memory without copies.

A ``Lease`` is the only handle to a pool buffer, and the pool hands a buffer
out again only after its lease is released. Its memory is reachable as
``Lease.view`` (a memoryview), ``Lease.array()`` or ``Lease.export()`` (what
GEMM plans point at); ``release()`` refuses while any of those, or anything
derived from them (slices, numpy or torch views, a plan, a transport's
queued write), is still alive, so a buffer is never reused under a reader.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sys
import threading
from dataclasses import dataclass, fields
from types import TracebackType

import numpy as np

from ._native import ffi, lib

log = logging.getLogger(__name__)


class MlockError(MemoryError):
    """A buffer could not be locked in RAM and the pool requires locking."""


class LeaseError(RuntimeError):
    """A lease was used after release, or released while its memory is still exported."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Byte and event counters of one pool (a snapshot)."""

    locked_bytes: int
    unlocked_bytes: int
    leased_bytes: int
    free_bytes: int
    leased_count: int
    free_count: int
    allocations: int
    reuses: int
    releases: int
    frees: int
    lock_failures: int
    memlock_limit: int


_STAT_FIELDS = tuple(f.name for f in fields(PoolStats))


class Lease:
    """One leased pool buffer of ``nbytes`` (its bucket, ``capacity``, may be larger).

    All memory handed out derives from one cached export (a cffi buffer) and
    one cached pointer over it, so "is anything still using this buffer?" is
    two reference counts, however many views or plans were made.
    """

    __slots__ = ("_buf", "_export", "_pointer", "_pool", "nbytes")

    def __init__(self, pool: BufferPool, buf: object, nbytes: int) -> None:
        self._pool = pool
        self._buf = buf
        self._export: object = None
        self._pointer: object = None
        self.nbytes = nbytes

    def _live(self):
        if self._buf is None:
            raise LeaseError("lease already released")
        return self._buf

    def export(self) -> object:
        """The buffer object over the lease's bytes that ``release()`` tracks.

        Every memoryview, slice, array or cffi pointer made from it keeps it
        referenced (through the managed buffer or the cdata), and ``release()``
        refuses while it is referenced from outside the lease.
        """
        exported = self._export
        if exported is None:
            exported = self._export = ffi.buffer(self._live().ptr, self.nbytes)
        return exported

    def pointer(self) -> object:
        """A cffi ``char[]`` over the lease's bytes, for GEMM plans (tracked like ``export``)."""
        pointer = self._pointer
        if pointer is None:
            pointer = self._pointer = ffi.from_buffer(self.export())
        return pointer

    @property
    def capacity(self) -> int:
        return self._live().capacity

    @property
    def locked(self) -> bool:
        return bool(self._live().locked)

    @property
    def address(self) -> int:
        return int(ffi.cast("uintptr_t", self._live().ptr))

    @property
    def view(self) -> memoryview:
        """A writable memoryview of the first ``nbytes`` bytes (shared, not copied)."""
        return memoryview(self.export())

    def array(self, dtype: np.typing.DTypeLike, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over the lease's memory; must fit in ``nbytes``."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(
                f"shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, "
                f"lease has {self.nbytes}"
            )
        return np.frombuffer(self.export(), dtype=dtype, count=count).reshape(shape)

    def _referenced(self) -> bool:
        if self._export is None:
            return False
        if self._pointer is None:
            return sys.getrefcount(self._export) > _UNSHARED_EXPORT
        return (
            sys.getrefcount(self._pointer) > _UNSHARED_POINTER
            or sys.getrefcount(self._export) > _UNSHARED_EXPORT_AND_POINTER
        )

    def release(self) -> None:
        """Give the buffer back. Raises ``LeaseError`` while a view of it is alive."""
        with self._pool._release_lock:  # one release wins, even from two threads
            self._live()
            if self._referenced():
                raise LeaseError(
                    f"lease of {self.nbytes} bytes is still referenced (a memoryview, array, "
                    "plan or transport holds its memory); drop those references first"
                )
            buf, self._buf = self._buf, None
            self._export = self._pointer = None
            self._pool._give_back(buf)

    def __del__(self) -> None:
        # A lease dropped without release() gives its buffer back, unless memory
        # derived from it is still alive elsewhere (then it is leaked, not reused).
        if getattr(self, "_buf", None) is not None and not self._referenced():
            with contextlib.suppress(Exception):  # interpreter shutdown
                self._pool._give_back(self._buf)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _unshared_counts() -> tuple[int, int, int]:
    """What ``Lease._referenced`` counts on an export (alone, then with the cached
    pointer) and the pointer when nothing else holds them.

    Measured with the same expressions on a probe rather than assumed, since
    CPython versions and cffi count arguments and internal references differently.
    """
    probe = Lease.__new__(Lease)
    probe._export = ffi.buffer(ffi.new("char[1]"), 1)
    probe._pointer = None
    alone = sys.getrefcount(probe._export)
    probe._pointer = ffi.from_buffer(probe._export)
    return alone, sys.getrefcount(probe._export), sys.getrefcount(probe._pointer)


_UNSHARED_EXPORT, _UNSHARED_EXPORT_AND_POINTER, _UNSHARED_POINTER = _unshared_counts()


class BufferPool:
    """Page-aligned, power-of-two bucketed buffers (4 KiB minimum), ``mlock``ed.

    Where ``RLIMIT_MEMLOCK`` is too small, buffers beyond it are handed out
    unlocked, counted in ``stats().unlocked_bytes``, and a warning is logged
    once; ``require_mlock=True`` raises ``MlockError`` instead. Thread-safe.
    """

    def __init__(self, *, max_free_per_bucket: int = 32, require_mlock: bool = False) -> None:
        if max_free_per_bucket < 0:
            raise ValueError(f"max_free_per_bucket={max_free_per_bucket}: must be >= 0")
        self.require_mlock = require_mlock
        pool = lib.mg_pool_create(max_free_per_bucket, int(require_mlock))
        if pool == ffi.NULL:
            raise MemoryError("could not create buffer pool")
        # The C pool locks itself and outlives close(): it is freed only when
        # this object (which every lease references) is collected.
        self._pool = ffi.gc(pool, lib.mg_pool_free)
        # Makes the check-and-clear of a lease atomic, so a lease released from
        # two threads at once goes back to the pool once.
        self._release_lock = threading.Lock()
        self._warned = False

    @staticmethod
    def bucket_size(nbytes: int) -> int:
        """The capacity a request of ``nbytes`` is served from."""
        return lib.mg_pool_bucket_size(nbytes)

    def acquire(self, nbytes: int) -> Lease:
        """Lease a buffer of at least ``nbytes``."""
        return Lease(self, self._acquire(nbytes), nbytes)

    def acquire_buffer(self, nbytes: int) -> memoryview:
        """A writable memoryview of pool memory that goes back to the pool by itself.

        For buffers whose users cannot be enumerated (received frames whose
        segments are sliced, viewed as arrays and queued on transports): the
        buffer returns when the last view derived from it is collected, so it
        is never reused under a reader and never leaked.
        """
        buf = self._acquire(nbytes)
        owner = ffi.gc(ffi.cast("char *", buf.ptr), lambda _: self._give_back(buf))
        return memoryview(ffi.buffer(owner, nbytes))

    def _acquire(self, nbytes: int) -> object:
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: must be >= 0")
        buf = lib.mg_pool_acquire(self._pool, nbytes)
        if not buf:
            raise self._error(ffi.errno, nbytes)
        if not self._warned and not buf.locked:
            self._warned = True
            log.warning(
                "buffer pool: RLIMIT_MEMLOCK (%s bytes) exhausted; further buffers are not "
                "locked in RAM (raise the limit, e.g. LimitMEMLOCK=infinity, to lock them)",
                self.stats().memlock_limit,
            )
        return buf

    def _error(self, err: int, nbytes: int) -> Exception:
        if err == errno.EBADF:
            return LeaseError("pool is closed")
        if err == errno.EAGAIN:
            limit = self.stats().memlock_limit
            return MlockError(
                f"cannot lock {self.bucket_size(nbytes)} bytes: RLIMIT_MEMLOCK is {limit} bytes "
                "and require_mlock is set"
            )
        if err == errno.EINVAL:
            return ValueError(f"nbytes={nbytes}: larger than the largest bucket")
        return MemoryError(f"cannot allocate {self.bucket_size(nbytes)} bytes")

    def _give_back(self, buf: object) -> None:
        if lib.mg_pool_release(self._pool, buf) != lib.MG_POOL_OK:
            raise LeaseError("buffer is not leased")

    def stats(self) -> PoolStats:
        st = ffi.new("mg_pool_stats *")
        lib.mg_pool_get_stats(self._pool, st)
        return PoolStats(*(int(getattr(st, name)) for name in _STAT_FIELDS))

    def close(self) -> None:
        """Free the cached buffers and refuse new leases; refuses while leases are outstanding."""
        if lib.mg_pool_close(self._pool) != lib.MG_POOL_OK:
            raise LeaseError(f"{self.stats().leased_count} buffers are still leased")

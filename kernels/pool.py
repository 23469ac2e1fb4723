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


def _own_refs() -> int:
    """References ``Lease._referenced`` sees for an export nobody else holds.

    Measured with the same expression rather than assumed, since CPython
    versions count the list slot, the loop variable and the argument differently.
    """
    owner = ffi.new("char[1]")
    probe = [ffi.buffer(owner, 1)]
    return max(sys.getrefcount(e) for e in probe)


_OWN_REFS = _own_refs()


class Lease:
    """One leased pool buffer of ``nbytes`` (its bucket, ``capacity``, may be larger)."""

    __slots__ = ("_buf", "_exports", "_pool", "nbytes")

    def __init__(self, pool: BufferPool, buf: object, nbytes: int) -> None:
        self._pool = pool
        self._buf = buf
        self._exports: list[object] = []
        self.nbytes = nbytes

    def _live(self):
        if self._buf is None:
            raise LeaseError("lease already released")
        return self._buf

    def export(self) -> object:
        """A buffer object over the lease's bytes that ``release()`` tracks.

        Every memoryview, slice, array or cffi pointer made from it keeps it
        referenced (through the managed buffer or the cdata), and ``release()``
        refuses while any export is referenced from outside.
        """
        exported = ffi.buffer(self._live().ptr, self.nbytes)
        self._exports.append(exported)
        return exported

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
        return any(sys.getrefcount(e) > _OWN_REFS for e in self._exports)

    def release(self) -> None:
        """Give the buffer back. Raises ``LeaseError`` while a view of it is alive."""
        with self._pool._lock:  # one release wins, even from two threads
            self._live()
            if self._referenced():
                raise LeaseError(
                    f"lease of {self.nbytes} bytes is still referenced (a memoryview, array, "
                    "plan or transport holds its memory); drop those references first"
                )
            buf, self._buf = self._buf, None
            self._exports.clear()
            self._pool._release_locked(buf)

    def __del__(self) -> None:
        # A lease dropped without release() gives its buffer back, unless memory
        # derived from it is still alive elsewhere (then it is leaked, not reused).
        if getattr(self, "_buf", None) is not None and not self._referenced():
            with contextlib.suppress(Exception):  # interpreter shutdown
                self._pool._release(self._buf)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


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
        self._pool = lib.mg_pool_create(max_free_per_bucket, int(require_mlock))
        if self._pool == ffi.NULL:
            raise MemoryError("could not create buffer pool")
        self._out = ffi.new("mg_buffer **")  # reused: acquire is serialised below
        # Serialises every call into the C pool with close(), so the C object is
        # never freed under a caller (cffi releases the GIL during C calls).
        self._lock = threading.RLock()
        self._warned = False

    @staticmethod
    def bucket_size(nbytes: int) -> int:
        """The capacity a request of ``nbytes`` is served from."""
        return lib.mg_pool_bucket_size(nbytes)

    def acquire(self, nbytes: int) -> Lease:
        """Lease a buffer of at least ``nbytes``."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: must be >= 0")
        with self._lock:
            if self._pool is None:
                raise LeaseError("pool is closed")
            rc = lib.mg_pool_acquire(self._pool, nbytes, self._out)
            buf = self._out[0]
        if rc < 0:
            raise self._error(rc, nbytes)
        if rc == lib.MG_POOL_UNLOCKED and not self._warned:
            self._warned = True
            log.warning(
                "buffer pool: RLIMIT_MEMLOCK (%s bytes) exhausted; further buffers are not "
                "locked in RAM (raise the limit, e.g. LimitMEMLOCK=infinity, to lock them)",
                self.stats().memlock_limit,
            )
        return Lease(self, buf, nbytes)

    def _error(self, rc: int, nbytes: int) -> Exception:
        if rc == lib.MG_POOL_EMLOCK:
            limit = self.stats().memlock_limit
            return MlockError(
                f"cannot lock {self.bucket_size(nbytes)} bytes: RLIMIT_MEMLOCK is {limit} bytes "
                "and require_mlock is set"
            )
        if rc == lib.MG_POOL_EINVAL:
            return ValueError(f"nbytes={nbytes}: larger than the largest bucket")
        return MemoryError(f"cannot allocate {self.bucket_size(nbytes)} bytes")

    def _release(self, buf: object) -> None:
        with self._lock:
            self._release_locked(buf)

    def _release_locked(self, buf: object) -> None:
        # The caller holds _lock; a lease keeps its pool open, so _pool is set.
        if lib.mg_pool_release(self._pool, buf) != lib.MG_POOL_OK:
            raise LeaseError("buffer is not leased")

    def stats(self) -> PoolStats:
        st = ffi.new("mg_pool_stats *")
        with self._lock:
            if self._pool is None:
                raise LeaseError("pool is closed")
            lib.mg_pool_get_stats(self._pool, st)
        return PoolStats(*(int(getattr(st, name)) for name in _STAT_FIELDS))

    def close(self) -> None:
        """Free the pool; refuses while leases are outstanding."""
        with self._lock:
            if self._pool is None:
                return
            if lib.mg_pool_destroy(self._pool) != lib.MG_POOL_OK:
                raise LeaseError(f"{self.stats().leased_count} buffers are still leased")
            self._pool = None

    def __del__(self) -> None:
        # Best effort; outstanding leases keep the pool object alive.
        if getattr(self, "_pool", None) is not None:
            lib.mg_pool_destroy(self._pool)

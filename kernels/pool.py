"""Python face of the C buffer pool: leases that expose pool memory without copies.

A ``Lease`` is the only handle to a pool buffer, and the pool hands a buffer
out again only after its lease is released. Its memory is reachable as
``Lease.view`` (a memoryview), ``Lease.array()`` or ``Lease.export()`` (what
GEMM plans point at); ``release()`` refuses while any of those, or anything
derived from them (slices, numpy or torch views, a plan, a transport's
queued write), is still alive, so a buffer is never reused under a reader.

On a GPU host the pool also pins its buffers for CUDA (``cuMemHostRegister``), so
tiles received into them go to and from the GPU without a staging copy; where CUDA
is absent or registration fails the pool works as without it, and ``stats()`` says why.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from . import cuda
from ._native import ffi, lib

if TYPE_CHECKING:
    from _cffi_backend import FFI

log = logging.getLogger(__name__)


class MlockError(MemoryError):
    """A buffer could not be locked in RAM and the pool requires locking."""


class LeaseError(RuntimeError):
    """A lease was used after release, or released while its memory is still exported."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Byte and event counters of one pool (a snapshot), and whether it is pinned for CUDA."""

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
    pinned_bytes: int  # registered with CUDA (page-locked for GPU transfers)
    pin_failures: int  # buffers whose registration failed (they are used unpinned)
    pin_status: str  # "pinned: <how>", "pinned except N buffers: <why>" or "not pinned: <why>"


_C_STAT_FIELDS = tuple(name for name, _ in ffi.typeof("mg_pool_stats").fields)


def _c_stats(pool: FFI.CData) -> dict[str, int]:
    """The C pool's counters (``mg_pool_stats``), by field."""
    st = ffi.new("mg_pool_stats *")
    lib.mg_pool_get_stats(pool, st)
    return {name: int(getattr(st, name)) for name in _C_STAT_FIELDS}


class CBuffer(Protocol):
    """A C ``mg_buffer *`` (or NULL, which is false): the fields read here, which cffi's
    stubs cannot see."""

    @property
    def ptr(self) -> FFI.CData: ...
    @property
    def capacity(self) -> int: ...
    @property
    def locked(self) -> int: ...


class HostPinner(Protocol):
    """Pins pool memory for a GPU: ``kernels.cuda.CudaHostPinner`` on a CUDA host."""

    description: str

    def register(self, address: int, nbytes: int) -> str | None:
        """Pin the range; ``None`` on success, else why it stays unpinned."""
        ...

    def unregister(self, address: int) -> None: ...


class Lease:
    """One leased pool buffer of ``nbytes`` (its bucket, ``capacity``, may be larger).

    All memory handed out derives from one cached export (a cffi buffer) and
    one cached pointer over it, so "is anything still using this buffer?" is
    two reference counts, however many views or plans were made.
    """

    __slots__ = ("_buf", "_export", "_pointer", "_pool", "nbytes")

    def __init__(self, pool: BufferPool, buf: CBuffer, nbytes: int) -> None:
        self._pool = pool
        self._buf: CBuffer | None = buf
        self._export: FFI.buffer | None = None
        self._pointer: FFI.CData | None = None
        self.nbytes = nbytes

    def _live(self) -> CBuffer:
        if self._buf is None:
            raise LeaseError("lease already released")
        return self._buf

    def export(self) -> FFI.buffer:
        """The buffer object over the lease's bytes that ``release()`` tracks.

        Every memoryview, slice, array or cffi pointer made from it keeps it
        referenced (through the managed buffer or the cdata), and ``release()``
        refuses while it is referenced from outside the lease.
        """
        exported = self._export
        if exported is None:
            exported = self._export = ffi.buffer(self._live().ptr, self.nbytes)
        return exported

    def pointer(self) -> FFI.CData:
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
    def pinned(self) -> bool:
        """Registered with CUDA, so GPU transfers use it directly."""
        pins = self._pool._pins
        return pins is not None and self.address in pins.registered

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
        # numpy's stubs before Python 3.12 list the buffers frombuffer takes: a cffi one is not
        return np.frombuffer(self.export(), dtype=dtype, count=count).reshape(shape)  # type: ignore[call-overload]

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
            buf = self._live()
            if self._referenced():
                raise LeaseError(
                    f"lease of {self.nbytes} bytes is still referenced (a memoryview, array, "
                    "plan or transport holds its memory); drop those references first"
                )
            self._buf = self._export = self._pointer = None
            self._pool._give_back(buf)

    def __del__(self) -> None:
        # A lease dropped without release() gives its buffer back, unless memory
        # derived from it is still alive elsewhere (then it is leaked, not reused).
        buf = getattr(self, "_buf", None)
        if buf is not None and not self._referenced():
            with contextlib.suppress(Exception):  # interpreter shutdown
                self._pool._give_back(buf)

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


def _address(buf: CBuffer) -> int:
    return int(ffi.cast("uintptr_t", buf.ptr))


class _Pins:
    """A pinned pool's CUDA registrations, kept in step with its C free lists.

    The C pool frees buffers by itself: on release when the bucket's free list is
    full, and when it drains (close, collection). A registered buffer must be
    unregistered before its memory is freed, so a pinned pool makes every C call
    here under one lock, tracking which buffers sit on each free list and so knowing
    beforehand which release frees. A release from a finalizer on the thread that
    holds the lock (a view collected mid-acquire) waits until the lock is let go.
    """

    def __init__(self, pool: FFI.CData, pinner: HostPinner, max_free: int) -> None:
        self.pool = pool  # the raw pointer: the pool's gc'd owner holds a reference to us
        self.pinner = pinner
        self.max_free = max_free
        self.registered: dict[int, int] = {}  # address -> capacity
        self.free: dict[int, set[int]] = {}  # capacity -> addresses on the C free list
        self.pinned_bytes = 0
        self.failures = 0
        self.last_error = ""
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._deferred: list[CBuffer] = []
        self._orphaned = False  # free_pool ran: the C pool frees every buffer released now

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                while self._deferred:
                    self._release(self._deferred.pop())
                self._owner = None

    def status(self) -> str:
        if self.failures:
            return f"pinned except {self.failures} buffers: {self.last_error}"
        return f"pinned: {self.pinner.description}"

    def acquire(self, nbytes: int) -> tuple[CBuffer, int]:
        """(buffer or NULL, errno) from the C pool; a fresh buffer is registered."""
        with self._locked():
            buf = lib.mg_pool_acquire(self.pool, nbytes)
            if not buf:
                return buf, ffi.errno
            address = _address(buf)
            free = self.free.get(buf.capacity)
            if free is not None and address in free:
                free.discard(address)  # reused: registered (or refused) when it was made
            else:
                self._register(address, buf.capacity)
        return buf, 0

    def release(self, buf: CBuffer) -> int:
        if self._owner == threading.get_ident():
            self._deferred.append(buf)
            return lib.MG_POOL_OK
        with self._locked():
            return self._release(buf)

    def _release(self, buf: CBuffer) -> int:
        address = _address(buf)
        free = self.free.setdefault(buf.capacity, set())
        if address in free:
            return lib.MG_POOL_ENOTLEASED
        if len(free) < self.max_free and not self._orphaned:
            rc = lib.mg_pool_release(self.pool, buf)
            if rc == lib.MG_POOL_OK:
                free.add(address)
            return rc
        self._unregister(address)  # the C pool frees it: its free list is full
        return lib.mg_pool_release(self.pool, buf)

    def close(self) -> int:
        with self._locked():
            if _c_stats(self.pool)["leased_count"]:
                return lib.MG_POOL_EBUSY
            self._drain()
            return lib.mg_pool_close(self.pool)

    def free_pool(self, pool: FFI.CData) -> None:
        """The C pool's destructor: only the finalizers of its own leases can still reach
        the pool, and they release through ``release``, which takes the lock."""
        with self._locked():
            self._drain()
            self._orphaned = True
            lib.mg_pool_free(pool)

    def _drain(self) -> None:
        """Unregister everything on the free lists, which the C pool is about to free."""
        for free in self.free.values():
            for address in free:
                self._unregister(address)
            free.clear()

    def _register(self, address: int, capacity: int) -> None:
        error = self.pinner.register(address, capacity)
        if error is None:
            self.registered[address] = capacity
            self.pinned_bytes += capacity
            return
        if not self.failures:
            log.warning(
                "buffer pool: cannot pin a %d-byte buffer for GPU transfers (%s); such buffers "
                "are used unpinned, and transfers from them are staged by the driver",
                capacity,
                error,
            )
        self.failures += 1
        self.last_error = error

    def _unregister(self, address: int) -> None:
        capacity = self.registered.pop(address, None)
        if capacity is not None:
            self.pinned_bytes -= capacity
            self.pinner.unregister(address)


def _pinner_for(pin: bool | HostPinner) -> tuple[HostPinner | None, str]:
    """The pinner a pool uses, or ``None`` and why it is not pinned."""
    if pin is False:
        return None, "not pinned: pin=False"
    if pin is not True:
        return pin, ""
    status = cuda.cuda_status()
    if status != "available":
        return None, f"not pinned: CUDA {status}"
    try:
        return cuda.host_pinner(), ""
    except (cuda.CudaError, ValueError) as exc:
        return None, f"not pinned: {exc}"


class BufferPool:
    """Page-aligned, power-of-two bucketed buffers (4 KiB minimum), ``mlock``ed.

    Where ``RLIMIT_MEMLOCK`` is too small, buffers beyond it are handed out
    unlocked, counted in ``stats().unlocked_bytes``, and a warning is logged
    once; ``require_mlock=True`` raises ``MlockError`` instead. Thread-safe.

    ``pin=True`` (the default) also registers each new buffer with CUDA where a
    GPU is usable, and unregisters it before it is freed; this initialises CUDA
    in the process, so pools of processes that never use a GPU may pass
    ``pin=False``. A ``HostPinner`` may be passed instead to pin some other way.
    Registration is independent of ``mlock`` and its limit: a buffer may be
    pinned and not locked, or the reverse, and either failure only counts.
    """

    def __init__(
        self,
        *,
        max_free_per_bucket: int = 32,
        require_mlock: bool = False,
        pin: bool | HostPinner = True,
    ) -> None:
        if max_free_per_bucket < 0:
            raise ValueError(f"max_free_per_bucket={max_free_per_bucket}: must be >= 0")
        self.require_mlock = require_mlock
        pool = lib.mg_pool_create(max_free_per_bucket, int(require_mlock))
        if pool == ffi.NULL:
            raise MemoryError("could not create buffer pool")
        pinner, self._unpinned_reason = _pinner_for(pin)
        self._pins = None if pinner is None else _Pins(pool, pinner, max_free_per_bucket)
        # The C pool locks itself and outlives close(): it is freed only when
        # this object (which every lease references) is collected.
        self._pool = ffi.gc(pool, lib.mg_pool_free if self._pins is None else self._pins.free_pool)
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

    def _acquire(self, nbytes: int) -> CBuffer:
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: must be >= 0")
        if self._pins is None:
            buf = lib.mg_pool_acquire(self._pool, nbytes)
            err = ffi.errno
        else:
            buf, err = self._pins.acquire(nbytes)
        if not buf:
            raise self._error(err, nbytes)
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

    def _give_back(self, buf: CBuffer) -> None:
        pins = self._pins
        rc = lib.mg_pool_release(self._pool, buf) if pins is None else pins.release(buf)
        if rc != lib.MG_POOL_OK:
            raise LeaseError("buffer is not leased")

    def stats(self) -> PoolStats:
        pins = self._pins
        return PoolStats(
            **_c_stats(self._pool),
            pinned_bytes=0 if pins is None else pins.pinned_bytes,
            pin_failures=0 if pins is None else pins.failures,
            pin_status=self._unpinned_reason if pins is None else pins.status(),
        )

    def close(self) -> None:
        """Free the cached buffers and refuse new leases; refuses while leases are outstanding."""
        pins = self._pins
        if (lib.mg_pool_close(self._pool) if pins is None else pins.close()) != lib.MG_POOL_OK:
            raise LeaseError(f"{self.stats().leased_count} buffers are still leased")

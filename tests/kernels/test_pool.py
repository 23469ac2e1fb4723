"""The buffer pool under the machine's real memlock limit: locking, leases, threads."""

from __future__ import annotations

import gc
import logging
import resource
import subprocess
import sys
import threading

import numpy as np
import pytest
from morphling.kernels import BufferPool, LeaseError, MlockError, cuda_status
from morphling.kernels._native import ffi

MIB = 1 << 20
LIMIT = 8 * MIB  # this machine's RLIMIT_MEMLOCK, and the default in containers


@pytest.fixture
def memlock_8mib():
    """Hold RLIMIT_MEMLOCK at 8 MiB (lowering a soft limit is always allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < LIMIT:
        pytest.skip(f"RLIMIT_MEMLOCK is {soft} bytes, below the 8 MiB this test assumes")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (LIMIT, hard))
    yield
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


@pytest.mark.parametrize(
    ("request_bytes", "bucket"),
    [(0, 4096), (1, 4096), (4096, 4096), (4097, 8192), (65536, 65536), (3 * MIB, 4 * MIB)],
)
def test_power_of_two_buckets_from_4kib(request_bytes, bucket):
    pool = BufferPool()
    assert pool.bucket_size(request_bytes) == bucket
    with pool.acquire(request_bytes) as lease:
        assert lease.capacity == bucket
        assert lease.nbytes == request_bytes
        assert lease.address % 4096 == 0


def test_beyond_memlock_buffers_are_unlocked_counted_and_warned_once(memlock_8mib, caplog):
    pool = BufferPool()
    caplog.set_level(logging.WARNING, logger="morphling.kernels.pool")
    leases = [pool.acquire(MIB) for _ in range(16)]  # 16 MiB against an 8 MiB limit
    stats = pool.stats()
    assert stats.memlock_limit == LIMIT
    assert stats.locked_bytes + stats.unlocked_bytes == 16 * MIB
    assert 0 < stats.locked_bytes <= LIMIT
    assert stats.unlocked_bytes >= 8 * MIB
    assert stats.lock_failures == sum(not lease.locked for lease in leases) > 0
    assert stats.leased_bytes == 16 * MIB and stats.leased_count == 16
    warnings = [r for r in caplog.records if "RLIMIT_MEMLOCK" in r.getMessage()]
    assert len(warnings) == 1
    for lease in leases:  # every buffer is usable memory, locked or not
        lease.array(np.uint8, (MIB,))[:] = 7
    for lease in leases:
        lease.release()
    after = pool.stats()
    assert after.leased_bytes == 0 and after.leased_count == 0
    pool.close()


def test_require_mlock_refuses_clearly(memlock_8mib):
    pool = BufferPool(require_mlock=True)
    held = [pool.acquire(2 * MIB), pool.acquire(2 * MIB)]
    assert all(lease.locked for lease in held)
    with pytest.raises(MlockError, match=r"RLIMIT_MEMLOCK is 8388608 bytes and require_mlock"):
        for _ in range(8):
            held.append(pool.acquire(2 * MIB))
    stats = pool.stats()
    assert stats.unlocked_bytes == 0
    assert stats.leased_count == len(held)
    for lease in held:
        lease.release()


def test_leased_buffer_is_never_reissued():
    pool = BufferPool()
    first = [pool.acquire(5000) for _ in range(8)]
    addresses = {lease.address for lease in first}
    assert len(addresses) == 8
    released = first.pop()
    freed_address = released.address
    released.release()
    again = pool.acquire(5000)
    assert again.address == freed_address  # reuse comes only from released buffers
    assert pool.stats().reuses == 1
    assert again.address not in {lease.address for lease in first}
    for lease in [*first, again]:
        lease.release()


def test_release_refuses_while_memory_is_referenced():
    pool = BufferPool()
    lease = pool.acquire(4096)
    arr = lease.array(np.float32, (32, 32))
    column = arr[:, 3]
    del arr
    with pytest.raises(LeaseError, match="still referenced"):
        lease.release()  # a slice of the array still points into the buffer
    del column
    view = lease.view[100:200]
    with pytest.raises(LeaseError):
        lease.release()
    del view
    lease.release()
    with pytest.raises(LeaseError, match="already released"):
        lease.release()
    with pytest.raises(LeaseError, match="already released"):
        lease.export()


def test_free_lists_are_bounded():
    pool = BufferPool(max_free_per_bucket=2)
    leases = [pool.acquire(10_000) for _ in range(5)]
    for lease in leases:
        lease.release()
    stats = pool.stats()
    assert stats.free_count == 2
    assert stats.free_bytes == 2 * 16384
    assert stats.frees == 3
    assert stats.allocations == 5


def test_close_refuses_outstanding_leases():
    pool = BufferPool()
    lease = pool.acquire(1)
    with pytest.raises(LeaseError, match="1 buffers are still leased"):
        pool.close()
    lease.release()
    pool.close()
    with pytest.raises(LeaseError, match="closed"):
        pool.acquire(1)


def test_bad_requests():
    pool = BufferPool()
    with pytest.raises(ValueError, match="nbytes=-1"):
        pool.acquire(-1)
    with pytest.raises(ValueError, match="largest bucket"):
        pool.acquire(1 << 60)
    with pytest.raises(ValueError, match="max_free_per_bucket"):
        BufferPool(max_free_per_bucket=-1)
    with pool.acquire(64) as lease, pytest.raises(ValueError, match="needs 400 bytes"):
        lease.array(np.float32, (10, 10))


def test_concurrent_threads_never_share_a_buffer():
    """Each thread stamps its buffer and checks nobody else wrote it before release."""
    pool = BufferPool(max_free_per_bucket=4)
    errors: list[str] = []
    rounds = 3000

    def work(tag: int) -> None:
        size = 4096 * (1 + tag % 3)
        for i in range(rounds):
            lease = pool.acquire(size)
            arr = lease.array(np.uint8, (size,))
            arr[:] = tag
            if i % 64 == 0:
                threading.Event().wait(0.0001)  # let the others interleave
            if not (arr == tag).all():
                errors.append(f"thread {tag}: buffer rewritten while leased")
            del arr
            lease.release()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = pool.stats()
    assert stats.leased_count == 0
    assert stats.releases == 6 * rounds
    assert stats.allocations + stats.reuses == 6 * rounds


def test_plans_pin_a_lease_until_the_last_one_goes():
    """Every plan over a lease shares its one tracked pointer, however many are made."""
    from morphling.kernels import plan_explicit, run_plan

    pool = BufferPool()
    la, lb, lc = (pool.acquire(16 * 16 * 4) for _ in range(3))
    for lease in (la, lb):
        lease.array(np.float32, (16, 16))[:] = 1.0
    plans = [
        plan_explicit(np.float32, False, False, 16, 16, 16, la, 16, lb, 16, lc, 16)
        for _ in range(1000)
    ]
    run_plans = plans[::100]
    for plan in run_plans:
        run_plan(plan)
    assert (lc.array(np.float32, (16, 16)) == 16.0).all()
    del plans, plan
    with pytest.raises(LeaseError, match="still referenced"):
        la.release()  # run_plans still point at it
    del run_plans
    for lease in (la, lb, lc):
        lease.release()
    assert pool.stats().leased_count == 0


def test_a_lease_released_from_two_threads_goes_back_once():
    pool = BufferPool()
    for _ in range(200):
        lease = pool.acquire(4096)
        outcomes: list[str] = []

        def release(lease=lease, outcomes=outcomes) -> None:
            try:
                lease.release()
                outcomes.append("released")
            except LeaseError:
                outcomes.append("refused")

        threads = [threading.Thread(target=release) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["refused", "released"]
    stats = pool.stats()
    assert stats.releases == 200
    assert stats.leased_count == 0


def test_close_racing_acquire_never_crashes():
    """close() and acquire() in two threads: each acquire either leases or says closed."""
    for _ in range(50):
        pool = BufferPool()
        results: list[str] = []

        def grab(pool=pool, results=results) -> None:
            for _ in range(200):
                try:
                    pool.acquire(4096).release()
                    results.append("ok")
                except LeaseError as exc:
                    results.append(str(exc))

        thread = threading.Thread(target=grab)
        thread.start()
        while True:
            try:
                pool.close()
                break
            except LeaseError:  # a lease was out at that moment
                continue
        thread.join()
        assert set(results) <= {"ok", "pool is closed"}
        assert pool.stats().leased_count == 0
        with pytest.raises(LeaseError, match="closed"):
            pool.acquire(1)


def test_acquire_buffer_returns_when_the_last_view_goes():
    pool = BufferPool()
    view = pool.acquire_buffer(100_000)
    arr = np.frombuffer(view[8:], dtype=np.uint8)
    del view
    arr[:] = 7
    tail = arr[-10:]
    del arr
    assert pool.stats().leased_count == 1  # a slice of a slice still reads it
    assert (tail == 7).all()
    del tail
    stats = pool.stats()
    assert (stats.leased_count, stats.releases) == (0, 1)
    again = pool.acquire_buffer(100_000)  # the freed buffer is reused
    assert pool.stats().reuses == 1
    del again


CYCLES = """
import gc
from morphling.kernels import BufferPool

for _ in range(200):
    pool = BufferPool(pin=False)
    view = pool.acquire_buffer(4096)
    cycle = [pool, view]
    cycle.append(cycle)  # the pool and its buffer die in one collection, in any order
    del pool, view, cycle
    gc.collect()
print("done")
"""


def test_a_pool_collected_with_its_buffers_in_one_cycle_is_freed_last():
    """The garbage collector finalizes a cycle's objects in no set order: the pool's own
    finalizer may come before its buffers', whose release must still find the pool (it
    once locked a freed mutex and hung at interpreter exit)."""
    done = subprocess.run(
        [sys.executable, "-c", CYCLES], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"


# -- pinning for CUDA ----------------------------------------------------------------

CUDA = cuda_status()


class RecordingPinner:
    """Stands in for ``cuMemHostRegister`` where no GPU exists (the real ``CudaHostPinner``
    is tested below on GPU hosts). Records each call with the pool's free count at that
    moment, so a test can tell an unregistration came before the C pool freed the memory."""

    description = "recording pinner"

    def __init__(self, refuse_from: int | None = None) -> None:
        self.pool: BufferPool | None = None
        self.refuse_from = refuse_from
        self.live: dict[int, int] = {}
        self.events: list[tuple[str, int, int]] = []  # (what, address, frees so far)

    def _frees(self) -> int:
        return self.pool.stats().frees if self.pool is not None else -1

    def register(self, address: int, nbytes: int) -> str | None:
        assert address not in self.live, "registered twice"
        if self.refuse_from is not None and nbytes >= self.refuse_from:
            return "cuMemHostRegister: CUDA_ERROR_OUT_OF_MEMORY (2)"
        self.live[address] = nbytes
        self.events.append(("register", address, self._frees()))
        return None

    def unregister(self, address: int) -> None:
        assert address in self.live, "unregistered without registration"
        del self.live[address]
        self.events.append(("unregister", address, self._frees()))


def pinned_pool(pinner: RecordingPinner, **kwargs) -> BufferPool:
    pool = BufferPool(pin=pinner, **kwargs)
    pinner.pool = pool
    return pool


@pytest.mark.skipif(CUDA == "available", reason="this host has a usable GPU")
def test_without_cuda_the_pool_is_unpinned_and_says_why():
    pool = BufferPool()
    with pool.acquire(10_000) as lease:
        assert not lease.pinned
        stats = pool.stats()
    assert stats.pin_status == f"not pinned: CUDA {CUDA}"
    assert (stats.pinned_bytes, stats.pin_failures) == (0, 0)
    assert BufferPool(pin=False).stats().pin_status == "not pinned: pin=False"


def test_fresh_buffers_are_registered_once_and_reuse_keeps_them():
    pinner = RecordingPinner()
    pool = pinned_pool(pinner)
    leases = [pool.acquire(5000) for _ in range(3)]
    assert all(lease.pinned for lease in leases)
    assert pool.stats().pinned_bytes == 3 * 8192
    for lease in leases:
        lease.release()
    for _ in range(3):
        pool.acquire(5000).release()  # reused from the free list: no new registration
    assert [e[0] for e in pinner.events] == ["register"] * 3
    stats = pool.stats()
    assert stats.pin_status == "pinned: recording pinner"
    assert (stats.pinned_bytes, stats.reuses) == (3 * 8192, 3)


def test_buffers_are_unregistered_before_the_pool_frees_them():
    pinner = RecordingPinner()
    pool = pinned_pool(pinner, max_free_per_bucket=1)
    first, second = pool.acquire(4096), pool.acquire(4096)
    first.release()  # kept on the free list
    address = second.address
    second.release()  # the free list is full: freed, after being unregistered
    assert pinner.events[-1] == ("unregister", address, 0)
    assert pool.stats().frees == 1
    assert pool.stats().pinned_bytes == 4096
    pool.close()  # drains the free list: unregistered first again
    assert pinner.events[-1][0] == "unregister" and pinner.events[-1][2] == 1
    assert pool.stats().frees == 2
    assert pinner.live == {} and pool.stats().pinned_bytes == 0


def test_collecting_a_pinned_pool_unregisters_its_free_buffers():
    pinner = RecordingPinner()
    pool = BufferPool(pin=pinner)
    for size in (4096, 70_000, 1 << 20):
        pool.acquire(size).release()
    assert len(pinner.live) == 3
    del pool
    gc.collect()
    assert pinner.live == {}


def test_refused_registrations_are_counted_warned_once_and_still_served(caplog):
    caplog.set_level(logging.WARNING, logger="morphling.kernels.pool")
    pinner = RecordingPinner(refuse_from=MIB)
    pool = pinned_pool(pinner)
    small, big, bigger = pool.acquire(4096), pool.acquire(MIB), pool.acquire(2 * MIB)
    assert small.pinned and not big.pinned and not bigger.pinned
    big.array(np.uint8, (MIB,))[:] = 3  # an unpinned buffer is ordinary memory
    stats = pool.stats()
    assert (stats.pinned_bytes, stats.pin_failures) == (4096, 2)
    assert stats.pin_status == (
        "pinned except 2 buffers: cuMemHostRegister: CUDA_ERROR_OUT_OF_MEMORY (2)"
    )
    warnings = [r for r in caplog.records if "cannot pin" in r.getMessage()]
    assert len(warnings) == 1
    for lease in (small, big, bigger):
        lease.release()
    pool.close()
    assert pinner.live == {}


def test_memlock_rules_hold_for_a_pinned_pool(memlock_8mib):
    pool = pinned_pool(RecordingPinner())
    leases = [pool.acquire(MIB) for _ in range(12)]
    stats = pool.stats()
    assert 0 < stats.locked_bytes <= LIMIT and stats.unlocked_bytes >= 4 * MIB
    assert stats.pinned_bytes == 12 * MIB  # pinning does not depend on mlock
    for lease in leases:
        lease.release()
    strict_pinner = RecordingPinner()
    strict = pinned_pool(strict_pinner, require_mlock=True)
    held = []
    with pytest.raises(MlockError, match="require_mlock"):
        for _ in range(8):
            held.append(strict.acquire(2 * MIB))
    assert strict.stats().unlocked_bytes == 0
    assert len(strict_pinner.live) == len(held)  # the refused buffer was never registered
    for lease in held:
        lease.release()


def test_views_collected_inside_the_pool_lock_are_released_later():
    """A received buffer's last view may be collected while the same thread holds the
    pinned pool's lock (here: during a registration); its release waits, not deadlocks."""
    pinner = RecordingPinner()
    pool = pinned_pool(pinner, max_free_per_bucket=0)
    held = [pool.acquire_buffer(4096)]
    register = pinner.register

    def register_and_drop(address: int, nbytes: int) -> str | None:
        held.clear()  # the view's finalizer releases its buffer, on this thread, now
        return register(address, nbytes)

    pinner.register = register_and_drop
    lease = pool.acquire(8192)
    stats = pool.stats()
    assert (stats.leased_count, stats.releases, stats.frees) == (1, 1, 1)
    assert [e[0] for e in pinner.events] == ["register", "register", "unregister"]
    lease.release()
    assert pinner.live == {}


def test_concurrent_threads_on_a_pinned_pool_keep_registrations_exact():
    pinner = RecordingPinner()
    pool = BufferPool(pin=pinner, max_free_per_bucket=2)
    rounds = 1000

    def work(tag: int) -> None:
        for i in range(rounds):
            size = 4096 * (1 + (tag + i) % 4)
            if i % 3:
                pool.acquire(size).release()
            else:
                view = pool.acquire_buffer(size)
                view[0] = tag
                del view

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = pool.stats()
    assert stats.leased_count == 0
    assert stats.pinned_bytes == sum(pinner.live.values()) == stats.free_bytes
    pool.close()
    assert pinner.live == {}


needs_cuda = pytest.mark.skipif(CUDA != "available", reason=f"CUDA {CUDA}")


@needs_cuda
def test_a_gpu_host_pins_with_cuda_and_unpins_before_freeing():
    from morphling.kernels import cuda

    drv = cuda.driver()
    flags = cuda.ffi.new("unsigned int *")

    def host_flags(address: int) -> int | None:
        rc = drv.cuMemHostGetFlags(flags, cuda.ffi.cast("void *", address))
        return flags[0] if rc == 0 else None

    pool = BufferPool(max_free_per_bucket=1)
    assert pool.stats().pin_status.startswith("pinned: cuMemHostRegister (portable)")
    first, second = pool.acquire(3 * MIB), pool.acquire(3 * MIB)
    assert first.pinned and second.pinned
    assert host_flags(first.address) & drv.CU_MEMHOSTREGISTER_PORTABLE
    kept, freed = first.address, second.address
    first.release()
    second.release()  # freed: unregistered first
    assert host_flags(freed) is None
    assert host_flags(kept) is not None
    pool.close()
    assert host_flags(kept) is None
    assert pool.stats().pinned_bytes == 0


def test_a_pinned_pool_finalized_before_its_buffer_unregisters_it_when_it_returns():
    """The owner's finalizer first (as in a collected cycle): the buffer still out stays
    registered and alive, and is unregistered when it comes back, before C frees it."""
    pinner = RecordingPinner()
    pool = pinned_pool(pinner)
    view = pool.acquire_buffer(4096)
    address = next(iter(pinner.live))
    ffi.release(pool._pool)  # runs the pool's finalizer now
    assert pinner.live == {address: 4096}
    view[:4] = b"live"  # its memory is still the pool's
    del view
    gc.collect()
    assert pinner.live == {}
    assert pinner.events[-1][:2] == ("unregister", address)

"""The GEMM worker pool: correct results under concurrency, policies as specified."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from morphling.kernels import (
    BufferPool,
    CpuBackend,
    LeaseError,
    WorkerLoad,
    WorkerPool,
    choose_worker,
    cublasxt_status,
    plan_explicit,
)
from morphling.kernels.workers import GpuBackend


def random_case(rng):
    m, n, k = (int(x) for x in rng.integers(1, 96, 3))
    batch = int(rng.choice([0, 0, 2]))
    lead = (batch,) if batch else ()
    a = rng.standard_normal((*lead, m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    if rng.random() < 0.5:
        b = np.ascontiguousarray(b.T).T  # column-major operand
    return a, b


@pytest.mark.parametrize("policy", ["round-robin", "greedy", "load-balanced"])
async def test_concurrent_results_are_correct(policy):
    rng = np.random.default_rng(7)
    cases = [random_case(rng) for _ in range(150)]
    with WorkerPool([CpuBackend(1) for _ in range(3)], policy=policy) as pool:
        results = await asyncio.gather(*(pool.submit(a, b) for a, b in cases))
        stats = pool.stats()
    for (a, b), res in zip(cases, results, strict=True):
        np.testing.assert_allclose(res.out, a @ b, rtol=1e-4, atol=1e-4)
        assert res.kind == "cpu" and res.compute_ns > 0
    assert sum(s.completed for s in stats) == len(cases)
    assert all(s.outstanding == 0 for s in stats)


async def test_round_robin_takes_turns():
    with WorkerPool([CpuBackend(1) for _ in range(3)], policy="round-robin", steal=False) as pool:
        a = np.ones((8, 8), np.float32)
        results = await asyncio.gather(*(pool.submit(a, a) for _ in range(9)))
    assert [r.worker for r in results] == [0, 1, 2] * 3


async def test_load_balanced_spreads_outstanding_work():
    """Four slow tasks submitted at once land on alternating workers."""
    a = np.random.default_rng(0).standard_normal((700, 700)).astype(np.float32)
    with WorkerPool([CpuBackend(1), CpuBackend(1)], policy="load-balanced", steal=False) as pool:
        results = await asyncio.gather(*(pool.submit(a, a) for _ in range(4)))
    assert [r.worker for r in results] == [0, 1, 0, 1]


@pytest.mark.parametrize("steal", [True, False])
async def test_an_idle_worker_takes_a_twins_backlog(steal):
    """Round-robin puts both long tasks on worker 0 and both short ones on worker 1; worker 1,
    done with its own, takes a long one instead of idling (unless told not to), so the two
    run side by side."""
    rng = np.random.default_rng(4)
    long = rng.standard_normal((900, 900)).astype(np.float32)
    short = np.ones((8, 8), np.float32)
    with WorkerPool([CpuBackend(1), CpuBackend(1)], policy="round-robin", steal=steal) as pool:
        results = await asyncio.gather(*(pool.submit(x, x) for x in (long, short, long, short)))
        stats = pool.stats()
    long_ran_on = {results[0].worker, results[2].worker}
    assert long_ran_on == ({0, 1} if steal else {0})
    np.testing.assert_allclose(results[2].out, long @ long, rtol=1e-3, atol=1e-2)
    assert [s.outstanding for s in stats] == [0, 0], "the move is accounted for"


async def test_greedy_keeps_an_idle_pool_on_one_worker():
    """Awaiting each task leaves no queue anywhere, so every wait is zero: lowest index wins."""
    a = np.ones((16, 16), np.float32)
    with WorkerPool([CpuBackend(1), CpuBackend(1)], policy="greedy") as pool:
        workers = [(await pool.submit(a, a)).worker for _ in range(5)]
        stats = pool.stats()
    assert workers == [0] * 5
    assert stats[0].completed == 5 and stats[0].avg_duration_s < 0.005  # measured, not prior


async def test_greedy_unmeasured_twin_borrows_its_siblings_average():
    """After worker 0 alone has measured tiny tasks, its idle twin must not look like the
    5 ms prior: a burst of equal tasks alternates between the two."""
    tiny = np.ones((16, 16), np.float32)
    a = np.random.default_rng(2).standard_normal((500, 500)).astype(np.float32)
    with WorkerPool([CpuBackend(1), CpuBackend(1)], policy="greedy", steal=False) as pool:
        assert (await pool.submit(tiny, tiny)).worker == 0
        results = await asyncio.gather(*(pool.submit(a, a) for _ in range(6)))
    assert [r.worker for r in results] == [0, 1, 0, 1, 0, 1]


def test_greedy_picks_the_shortest_expected_wait():
    loads = [
        WorkerLoad(outstanding=2, avg_s=0.010, is_gpu=False),  # 20 ms
        WorkerLoad(outstanding=5, avg_s=0.002, is_gpu=False),  # 10 ms
        WorkerLoad(outstanding=1, avg_s=0.015, is_gpu=False),  # 15 ms
    ]
    assert choose_worker("greedy", loads, 0) == 1
    assert choose_worker("load-balanced", loads, 0) == 2


def test_greedy_counts_the_task_itself():
    """An idle CPU 100× slower than a GPU with one task queued loses to the GPU."""
    slow_idle, fast_busy = WorkerLoad(0, 0.100, False), WorkerLoad(1, 0.001, True)
    assert choose_worker("greedy", [slow_idle, fast_busy], 0) == 1


def test_ties_go_to_the_gpu_then_the_lowest_index():
    cpu, gpu = WorkerLoad(1, 0.003, False), WorkerLoad(2, 0.002, True)
    assert choose_worker("greedy", [cpu, gpu], 0) == 1  # 6 ms each: GPU
    assert choose_worker("load-balanced", [WorkerLoad(0, 1, False), WorkerLoad(0, 1, True)], 0) == 1
    assert choose_worker("greedy", [cpu, cpu, cpu], 0) == 0
    assert [choose_worker("round-robin", [cpu, gpu], t) for t in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="policy='fastest'"):
        choose_worker("fastest", [cpu], 0)


async def test_futures_complete_on_the_loop_and_errors_propagate():
    loop_thread = threading.get_ident()
    with WorkerPool([CpuBackend(1)]) as pool:
        future = pool.submit(np.ones((4, 4)), np.ones((4, 4)))
        seen = []
        future.add_done_callback(lambda f: seen.append(threading.get_ident()))
        await future
        await asyncio.sleep(0)
        assert seen == [loop_thread]
        # A plan that lies about its buffers fails in the worker and reaches the awaiter.
        bad = plan_explicit(
            np.float32, False, False, 64, 64, 64, b"", 64, b"", 64, bytearray(4), 64
        )
        with pytest.raises(ValueError, match="A does not fit"):
            await pool.submit_plan(bad)
        [stats] = pool.stats()
        assert (stats.outstanding, stats.completed) == (0, 2)
        with pytest.raises(ValueError, match="inner dimensions"):
            pool.submit(np.ones((2, 3)), np.ones((2, 3)))  # raised at submit, not later


class FailingBackend(CpuBackend):
    """A build whose GEMM raises (a device's broken kernel)."""

    def run(self, plan):
        raise RuntimeError("broken kernel")


async def test_a_failed_call_holds_no_frames_and_so_none_of_its_operands():
    """The error an awaiter gets has no traceback: its frames would hold the plan, whose
    cffi pointers export the operands' memoryviews, in a reference cycle, and CPython's
    collector crashed clearing those (the emulator test of a tile no device can compute
    segfaulted). Nothing of the failed call outlives it but the error."""
    a, b = memoryview(bytearray(64)), memoryview(bytearray(64))
    plan = plan_explicit(np.float32, False, False, 4, 4, 4, a, 4, b, 4, bytearray(64), 4)
    with WorkerPool([FailingBackend(1)]) as pool, pytest.raises(RuntimeError) as info:
        await pool.submit_plan(plan)
    assert str(info.value) == "broken kernel"
    assert info.value.__traceback__.tb_next is None, "only the awaiting frame"
    del plan
    a.release()  # refused while anything still exports it (the plan's pointers)
    b.release()


async def test_host_functions_run_on_the_workers_timed_like_gemms():
    """``submit_call`` runs a function on a worker's thread (not the loop's): its value is
    the result's ``out``, its run time ``compute_ns``, and what it raises the awaiter's; the
    worker counts it as it counts a GEMM."""
    loop_thread = threading.get_ident()
    with WorkerPool([CpuBackend(1)]) as pool:
        ran_on = []

        def product() -> np.ndarray:
            ran_on.append(threading.get_ident())
            return np.full((3, 3), 7.0)

        res = await pool.submit_call(product)
        np.testing.assert_array_equal(res.out, np.full((3, 3), 7.0))
        assert res.compute_ns > 0 and res.kind == "cpu"
        assert ran_on and ran_on[0] != loop_thread

        def broken() -> None:
            raise ValueError("w: kernel 3x3 does not match")

        with pytest.raises(ValueError, match="kernel 3x3"):
            await pool.submit_call(broken)
        [stats] = pool.stats()
        assert (stats.outstanding, stats.completed) == (0, 2)


async def test_explicit_plans_on_leases():
    pool_mem = BufferPool()
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 24, 16)).astype(np.float32)
    with (
        WorkerPool([CpuBackend(1), CpuBackend(1)]) as pool,
        pool_mem.acquire(a.nbytes) as la,
        pool_mem.acquire(b.nbytes) as lb,
        pool_mem.acquire(24 * 24 * 4) as lc,
    ):
        la.array(np.float32, a.shape)[:] = a
        lb.array(np.float32, b.shape)[:] = b
        plan = plan_explicit(np.float32, False, True, 24, 24, 16, la, 16, lb, 16, lc, 24)
        res = await pool.submit_plan(plan, out=lc, keep=(la, lb))
        assert res.out is lc
        np.testing.assert_allclose(lc.array(np.float32, (24, 24)), a @ b.T, rtol=1e-5, atol=1e-5)
        with pytest.raises(LeaseError, match="still referenced"):
            la.release()  # our plan still points into it
        del plan  # the worker has already let go: release now succeeds


def test_blocking_compute_and_close():
    pool = WorkerPool([CpuBackend(1)], policy="round-robin")
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    res = pool.compute(a, a.T)
    np.testing.assert_allclose(res.out, a @ a.T)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.compute(a, a.T)


def test_bad_pool_configuration():
    with pytest.raises(ValueError, match="policy='fifo'"):
        WorkerPool([CpuBackend(1)], policy="fifo")
    with pytest.raises(ValueError, match="at least one backend"):
        WorkerPool([])
    with pytest.raises(ValueError, match="threads=0"):
        CpuBackend(0)


GPU_STATUS = cublasxt_status()


@pytest.mark.skipif(GPU_STATUS == "available", reason="this host has a usable GPU")
def test_gpu_worker_says_why_it_is_unavailable():
    assert GPU_STATUS.startswith("unavailable: ")
    with pytest.raises(RuntimeError, match="GPU worker: cuBLASXt unavailable: "):
        GpuBackend()


@pytest.mark.skipif(GPU_STATUS != "available", reason=f"cuBLASXt {GPU_STATUS}")
async def test_mixed_gpu_and_cpu_pool_prefers_the_gpu_when_idle():
    rng = np.random.default_rng(11)
    cases = [random_case(rng) for _ in range(40)]
    with WorkerPool([CpuBackend(1), GpuBackend(block_dim=512)], policy="greedy") as pool:
        first = await pool.submit(*cases[0])
        assert first.kind == "gpu"
        results = await asyncio.gather(*(pool.submit(a, b) for a, b in cases))
        kinds = {s.kind for s in pool.stats()}
    assert kinds == {"cpu", "gpu"}
    for (a, b), res in zip(cases, results, strict=True):
        np.testing.assert_allclose(res.out, a @ b, rtol=1e-4, atol=1e-4)

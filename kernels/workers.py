"""A pool of GEMM worker threads that completes asyncio futures.

They run host functions too (``submit_call``: a convolution tile's kernels), timed the same.

Kernels release the GIL, so plain threads give real parallelism and keep the
event loop free. Each worker owns one backend — a CPU BLAS with its own
thread count, a cuBLASXt handle, or cuBLAS under green contexts that follow
an SM-count trace — behind the same interface, so one pool can mix them. A
task goes to one worker, chosen at submit time by a policy:

- ``round-robin``: workers in turn;
- ``greedy``: the earliest expected completion, ``(outstanding + 1) ×
  moving-average duration`` (a 64-sample window): the wait of upstream's
  ``queue depth × average`` plus the task itself, so an idle but 100× slower
  CPU does not beat a GPU with one task queued. A worker with no samples yet
  borrows the mean of its measured siblings of the same kind, so an idle twin
  is not shunned; with none measured, 1 ms for GPUs and 5 ms for CPUs as
  upstream;
- ``load-balanced``: the fewest outstanding tasks.

Ties go to a GPU, then to the lowest index. A choice made at submit time can be
wrong (a burst of long tasks split 4 to 2 because one worker's average came
from short ones), so a CPU worker that runs out of tasks takes the oldest
queued one of a twin (a CPU worker with as many threads) before it waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from . import blas
from .cublasxt import CublasXt, cublasxt_status
from .cuda import cuda_status
from .green_context import GreenContextConfig, GreenContextController
from .layout import GemmPlan, plan_gemm

log = logging.getLogger(__name__)

POLICIES = ("round-robin", "greedy", "load-balanced")


class Backend(Protocol):
    """What a worker computes with. ``start``/``stop`` run on the worker's thread; ``call``
    runs a host function there (a convolution's kernels: CPU BLAS and numpy, whatever the
    backend)."""

    kind: str
    prior_s: float  # expected duration before any task has been measured

    def start(self) -> None: ...

    def run(self, plan: GemmPlan) -> None: ...

    def call(self, fn: Callable[[], Any]) -> Any: ...

    def stop(self) -> None: ...


class _HostCalls:
    """``Backend.call``: the function, on the worker's thread."""

    def call(self, fn: Callable[[], Any]) -> Any:
        return fn()


class CpuBackend(_HostCalls):
    """MKL/OpenBLAS with ``threads`` threads for this worker's calls."""

    kind = "cpu"
    prior_s = 5e-3

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads}: must be >= 1")
        self.threads = threads
        blas.blas_info()  # fail here, not on the worker thread

    def start(self) -> None:
        blas.set_threads(self.threads)  # per thread with MKL; logged once if unsupported

    def run(self, plan: GemmPlan) -> None:
        blas.run_plan(plan)

    def stop(self) -> None:
        pass


class GpuBackend(_HostCalls):
    """cuBLASXt over ``devices`` with tiles of ``block_dim``; raises where no GPU is usable."""

    kind = "gpu"
    prior_s = 1e-3

    def __init__(self, devices: list[int] | None = None, block_dim: int = 1024) -> None:
        status = cublasxt_status()
        if status != "available":
            raise RuntimeError(f"GPU worker: cuBLASXt {status}")
        self.devices = devices
        self.block_dim = block_dim
        self._xt: CublasXt | None = None

    def start(self) -> None:
        self._xt = CublasXt(self.devices, self.block_dim)

    def run(self, plan: GemmPlan) -> None:
        assert self._xt is not None, "GpuBackend.run before start"
        self._xt.run_plan(plan)

    def stop(self) -> None:
        if self._xt is not None:
            self._xt.close()
            self._xt = None


class GreenGpuBackend(_HostCalls):
    """A GPU throttled to the SM counts of a trace (``green_context``); raises where no GPU is.

    The controller, and with it the green contexts, is made on the worker's thread,
    where its contexts are current, and torn down there. ``controller.set_step`` (from
    any thread) moves a step-clocked trace on; ``controller.stats()`` has the switches.
    """

    kind = "gpu"
    prior_s = 1e-3

    def __init__(self, config: GreenContextConfig) -> None:
        status = cuda_status()
        if status != "available":
            raise RuntimeError(f"GPU worker: CUDA {status}")
        self.config = config
        self.controller: GreenContextController | None = None

    def start(self) -> None:
        self.controller = GreenContextController.from_config(self.config)

    def run(self, plan: GemmPlan) -> None:
        assert self.controller is not None, "GreenGpuBackend.run before start"
        self.controller.run_plan(plan)

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.close()
            self.controller = None


@dataclass(frozen=True, slots=True)
class GemmResult:
    """A finished task: the output, the kernel's own time, and who ran it."""

    out: Any
    compute_ns: int
    worker: int
    kind: str


@dataclass(frozen=True, slots=True)
class WorkerStats:
    index: int
    kind: str
    outstanding: int
    completed: int
    avg_duration_s: float
    expected_wait_s: float


Done = Callable[[GemmResult | None, BaseException | None], None]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a policy sees of one worker."""

    outstanding: int
    avg_s: float
    is_gpu: bool


def choose_worker(policy: str, loads: Sequence[WorkerLoad], turn: int) -> int:
    """Index of the worker that gets the next task; ``turn`` counts earlier choices."""
    if policy == "round-robin":
        return turn % len(loads)
    if policy == "greedy":
        cost = [((w.outstanding + 1) * w.avg_s, not w.is_gpu, i) for i, w in enumerate(loads)]
    elif policy == "load-balanced":
        cost = [(w.outstanding, not w.is_gpu, i) for i, w in enumerate(loads)]
    else:
        raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
    return min(cost)[2]


def _twins(a: _Worker, b: _Worker) -> bool:
    """Whether either may run the other's tasks without changing what is measured: CPU
    workers with the same thread count (GPU workers differ in device and throttling)."""
    x, y = a.backend, b.backend
    return isinstance(x, CpuBackend) and isinstance(y, CpuBackend) and x.threads == y.threads


@dataclass(slots=True)
class _Task:
    plan: GemmPlan | Callable[[], Any] | None  # a GEMM, or a host function (``submit_call``)
    out: Any
    keep: tuple[Any, ...] | None  # operands kept alive until the kernel has run
    done: Done


class _Worker:
    def __init__(
        self,
        index: int,
        backend: Backend,
        window: int,
        on_finished: Callable[[_Worker, int | None], None],
        steal: Callable[[_Worker], _Task | None],
    ) -> None:
        self.index = index
        self.backend = backend
        self.on_finished = on_finished
        self.steal = steal
        self.queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.outstanding = 0
        self.completed = 0
        self.durations: deque[float] = deque(maxlen=window)
        self.duration_sum = 0.0
        self.started = threading.Event()
        self.start_error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._main, name=f"morphling-gemm-{backend.kind}-{index}", daemon=True
        )

    @property
    def measured_avg_s(self) -> float | None:
        return self.duration_sum / len(self.durations) if self.durations else None

    def record(self, seconds: float | None) -> None:
        """Called under the pool lock; ``None`` for a failed task, which says nothing of speed."""
        self.outstanding -= 1
        self.completed += 1
        if seconds is None:
            return
        if len(self.durations) == self.durations.maxlen:
            self.duration_sum -= self.durations[0]
        self.durations.append(seconds)
        self.duration_sum += seconds

    def _main(self) -> None:
        try:
            self.backend.start()
        except BaseException as exc:  # reported by WorkerPool.__init__
            self.start_error = exc
            self.started.set()
            return
        self.started.set()
        try:
            while (task := self._next()) is not None:
                self._run(task)
                del task  # do not pin the last task's operands (leases) while idle
        finally:
            self.backend.stop()

    def _next(self) -> _Task | None:
        """Its own next task, else a sibling's, else wait for one (None: stop)."""
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            pass
        return self.steal(self) or self.queue.get()

    def _run(self, task: _Task) -> None:
        error: BaseException | None = None
        plan, out = task.plan, task.out
        assert plan is not None, "a task runs once"
        t0 = time.perf_counter_ns()
        try:
            if isinstance(plan, GemmPlan):
                self.backend.run(plan)
            else:
                out = self.backend.call(plan)
        except Exception as exc:
            # Without its traceback: the frames would keep the plan's buffers in a reference
            # cycle, and CPython's collector can crash clearing a memoryview a cffi pointer
            # still exports (the plan's operands are often memoryviews of received frames).
            log.debug("worker %d: the call failed", self.index, exc_info=True)
            error = exc.with_traceback(None)
        elapsed = time.perf_counter_ns() - t0
        task.plan = task.keep = plan = None  # unpin leases before anyone is told we are done
        self.on_finished(self, None if error else elapsed)
        result = None if error else GemmResult(out, elapsed, self.index, self.backend.kind)
        try:
            task.done(result, error)
        except Exception:  # a broken callback must not take the worker down with it
            log.exception("GEMM completion callback failed")


class WorkerPool:
    """GEMM workers off the event loop; see the module docstring for policies."""

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        *,
        policy: str = "greedy",
        window: int = 64,
        steal: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
        if window < 1:
            raise ValueError(f"window={window}: must be >= 1")
        if backends is None:
            backends = [CpuBackend(threads=os.cpu_count() or 1)]
        if not backends:
            raise ValueError("a worker pool needs at least one backend")
        self.policy = policy
        self.steal = steal  # False: the policy's choice is final (to study a policy alone)
        self._lock = threading.Lock()
        self._rr = 0
        self._closed = False
        self._workers = [
            _Worker(i, b, window, self._finished, self._steal) for i, b in enumerate(backends)
        ]
        for w in self._workers:
            w.thread.start()
        for w in self._workers:
            w.started.wait()
        failed = [w for w in self._workers if w.start_error is not None]
        if failed:
            self.close()
            raise RuntimeError(
                f"worker {failed[0].index} ({failed[0].backend.kind}) failed to start: "
                f"{failed[0].start_error}"
            ) from failed[0].start_error

    def __len__(self) -> int:
        return len(self._workers)

    # -- choosing a worker -------------------------------------------------

    def _avg_durations(self) -> list[float]:
        """Each worker's moving average, or its stand-in before it has one. Under the lock."""
        peers: dict[str, list[float]] = {}
        for w in self._workers:
            if (avg := w.measured_avg_s) is not None:
                peers.setdefault(w.backend.kind, []).append(avg)
        result = []
        for w in self._workers:
            avg = w.measured_avg_s
            if avg is None:
                same_kind = peers.get(w.backend.kind)
                avg = sum(same_kind) / len(same_kind) if same_kind else w.backend.prior_s
            result.append(avg)
        return result

    def _choose(self) -> _Worker:
        """Called under the lock."""
        loads = [
            WorkerLoad(w.outstanding, avg, w.backend.kind == "gpu")
            for w, avg in zip(self._workers, self._avg_durations(), strict=True)
        ]
        index = choose_worker(self.policy, loads, self._rr)
        self._rr += 1
        return self._workers[index]

    def _finished(self, worker: _Worker, elapsed_ns: int | None) -> None:
        with self._lock:
            worker.record(None if elapsed_ns is None else elapsed_ns / 1e9)

    def _steal(self, thief: _Worker) -> _Task | None:
        """The oldest queued task of the twin with the longest queue, moved to
        ``thief``; None when there is none (a sibling's stop sentinel stays where it is)."""
        if not self.steal:
            return None
        with self._lock:
            siblings = [w for w in self._workers if w is not thief and _twins(w, thief)]
            victim = max(siblings, key=lambda w: w.queue.qsize(), default=None)
            if victim is None:
                return None
            try:
                task = victim.queue.get_nowait()
            except queue.Empty:  # it took its task itself meanwhile
                return None
            if task is None:  # closing: the sentinel was last in its queue, and is again
                victim.queue.put(None)
                return None
            victim.outstanding -= 1
            thief.outstanding += 1
            return task

    def _enqueue(
        self, plan: GemmPlan | Callable[[], Any], out: Any, keep: tuple[Any, ...], done: Done
    ) -> None:
        task = _Task(plan, out, keep, done)
        with self._lock:  # put under the lock, so close()'s sentinel always comes last
            if self._closed:
                raise RuntimeError("worker pool is closed")
            worker = self._choose()
            worker.outstanding += 1
            worker.queue.put(task)

    # -- submitting ----------------------------------------------------------

    def submit_plan(
        self, plan: GemmPlan, out: Any = None, keep: tuple[Any, ...] = ()
    ) -> asyncio.Future[GemmResult]:
        """Queue a prepared plan; the future completes on the running loop.

        ``out`` is handed back in the result; ``keep`` holds whatever the
        plan's pointers borrow (arrays, leases) until the kernel has run.
        """
        return self._submit(plan, out, keep)

    def submit_call(self, fn: Callable[[], Any]) -> asyncio.Future[GemmResult]:
        """Queue a host function (``Backend.call``): its return value is the result's
        ``out``, its run time the result's ``compute_ns``; what it raises, the future's."""
        return self._submit(fn, None, ())

    def _submit(
        self, plan: GemmPlan | Callable[[], Any], out: Any, keep: tuple[Any, ...]
    ) -> asyncio.Future[GemmResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GemmResult] = loop.create_future()

        def done(res: GemmResult | None, exc: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                loop.call_soon_threadsafe(_settle, future, res, exc)

        self._enqueue(plan, out, keep, done)
        return future

    def submit(
        self, a: Any, b: Any, out: Any = None, *, alpha: float = 1.0, beta: float = 0.0
    ) -> asyncio.Future[GemmResult]:
        """Queue ``out = alpha·a@b + beta·out`` for numpy/torch views.

        Shapes, dtypes and strides are checked here, so a bad request raises
        ``ValueError`` at once rather than through the future.
        """
        plan, result = plan_gemm(a, b, out, alpha=alpha, beta=beta)
        return self.submit_plan(plan, result, (a, b, out))

    def compute(
        self, a: Any, b: Any, out: Any = None, *, alpha: float = 1.0, beta: float = 0.0
    ) -> GemmResult:
        """Blocking form of ``submit`` for code without an event loop."""
        future: concurrent.futures.Future[GemmResult] = concurrent.futures.Future()
        plan, result = plan_gemm(a, b, out, alpha=alpha, beta=beta)

        def done(res: GemmResult | None, exc: BaseException | None) -> None:
            if exc is not None:
                future.set_exception(exc)
            else:
                assert res is not None, "a task ends in a result or an error"
                future.set_result(res)

        self._enqueue(plan, result, (a, b, out), done)
        return future.result()

    # -- introspection and shutdown -----------------------------------------

    def stats(self) -> list[WorkerStats]:
        with self._lock:
            return [
                WorkerStats(
                    index=w.index,
                    kind=w.backend.kind,
                    outstanding=w.outstanding,
                    completed=w.completed,
                    avg_duration_s=avg,
                    expected_wait_s=w.outstanding * avg,
                )
                for w, avg in zip(self._workers, self._avg_durations(), strict=True)
            ]

    def close(self) -> None:
        """Finish queued tasks, then stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            w.queue.put(None)
        for w in self._workers:
            if w.thread.is_alive():
                w.thread.join()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _settle(future: asyncio.Future, res: GemmResult | None, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(res)

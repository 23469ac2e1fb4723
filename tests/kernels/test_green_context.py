"""Green contexts: trace format, the controller's switching and off switch, the CUDA backend.

The trace parser and the controller are the real code. The controller drives SM
partitions through a small interface; here, without a GPU, ``RecordingPartitions``
stands in for ``CudaGreenContexts`` and runs the GEMMs on the CPU kernels. The real
``CudaGreenContexts`` is also run over ``StandInDriver``/``StandInCublas``, Python
stand-ins for libcuda and libcublas (which cannot exist without a GPU), for its GEMM
layout and teardown order; the tests against the real driver skip, saying why.
"""

from __future__ import annotations

import ctypes
import re
import textwrap
import time

import numpy as np
import pytest
from morphling.kernels import (
    BufferPool,
    CudaGreenContexts,
    GreenContextConfig,
    GreenContextController,
    GreenGpuBackend,
    GreenTrace,
    TraceError,
    WorkerPool,
    cuda_status,
    green_context_status,
    plan_gemm,
    run_plan,
)
from morphling.kernels.cuda import ffi as cuda_ffi
from morphling.kernels.green_context.cuda_partitions import OFF_ENV, round_sm_count, sm_granularity

EXAMPLE = """\
# greenctx_trace v2
# time_unit=ms
# semantics=step_function
timestamp,num_sms,tag
0,8,warmup
1,32,ramp
3,16,throttle
"""


def trace(body: str, header: str = "# greenctx_trace v2\n") -> GreenTrace:
    return GreenTrace.parse(header + textwrap.dedent(body), source="t.csv")


# -- the trace format ------------------------------------------------------------


def test_parses_the_example_with_units_tags_and_header():
    t = GreenTrace.parse(EXAMPLE)
    assert t.time_unit == "ms"
    assert [(p.timestamp, p.num_sms, p.tag) for p in t.points] == [
        (0, 8, "warmup"),
        (1, 32, "ramp"),
        (3, 16, "throttle"),
    ]
    assert [p.line for p in t.points] == [5, 6, 7]


def test_comments_blank_lines_missing_tags_and_default_unit():
    t = trace("""
        # made by hand: a comment, not a directive

        0, 8
        2.5, 64, full
        """)
    assert t.time_unit == "us"
    assert [(p.timestamp, p.num_sms, p.tag) for p in t.points] == [(0, 8, ""), (2.5, 64, "full")]


def test_step_lookup_is_a_step_function():
    t = GreenTrace.parse(EXAMPLE)
    assert [t.at_step(s).num_sms for s in range(6)] == [8, 32, 32, 16, 16, 16]
    assert t.at_step(10**9).tag == "throttle"
    with pytest.raises(ValueError, match="step=-1"):
        t.at_step(-1)


@pytest.mark.parametrize(("unit", "scale_us"), [("us", 1), ("ms", 1e3), ("s", 1e6)])
def test_wall_lookup_converts_the_time_unit(unit, scale_us):
    t = trace(f"# time_unit={unit}\n0,8,a\n1,32,b\n3,16,c\n")
    assert t.at_us(0).num_sms == 8
    assert t.at_us(0.999 * scale_us).num_sms == 8
    assert t.at_us(1.0 * scale_us).num_sms == 32
    assert t.at_us(2.999 * scale_us).num_sms == 32
    assert t.at_us(3.0 * scale_us).num_sms == 16


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", r"t\.csv: empty; expected '# greenctx_trace v2'"),
        ("0,8,a\n", r"line 1: expected '# greenctx_trace v2' first, got '0,8,a'"),
        ("# greenctx_trace v1\n0,8\n", r"line 1: expected '# greenctx_trace v2' first"),
        ("# greenctx_trace v2\n# time_unit=min\n0,8\n", r"line 2: time_unit='min' is not one of"),
        ("# greenctx_trace v2\n# semantics=linear\n0,8\n", r"line 2: semantics='linear'"),
        ("# greenctx_trace v2\n# clock=wall\n0,8\n", r"line 2: unknown directive 'clock'"),
        ("# greenctx_trace v2\n# time_unit=s\n# time_unit=s\n0,8\n", r"line 3: time_unit given"),
        ("# greenctx_trace v2\n0,8\n# time_unit=s\n", r"line 3: directive 'time_unit' after"),
        ("# greenctx_trace v2\n# only comments\n", r"t\.csv: no data lines"),
        ("# greenctx_trace v2\n0,8,a,b\n", r"line 2: expected timestamp,num_sms,tag; got 4"),
        ("# greenctx_trace v2\n0\n", r"line 2: expected timestamp,num_sms,tag; got 1"),
        ("# greenctx_trace v2\nsoon,8\n", r"line 2: timestamp 'soon' is not a number"),
        ("# greenctx_trace v2\n0,8\ninf,8\n", r"line 3: timestamp inf must be a finite"),
        ("# greenctx_trace v2\n0,8\n-1,8\n", r"line 3: timestamp -1 must be a finite number >= 0"),
        ("# greenctx_trace v2\n0,eight\n", r"line 2: num_sms 'eight' is not an integer"),
        ("# greenctx_trace v2\n0,0\n", r"line 2: num_sms 0 must be >= 1"),
        ("# greenctx_trace v2\n1,8\n", r"line 2: the first timestamp is 1; it must be 0"),
        ("# greenctx_trace v2\n0,8\n2,16\n2,32\n", r"line 4: timestamp 2 does not come after 2 "),
        ("# greenctx_trace v2\n0,8\n2,16\n1,32\n", r"\(line 3\); timestamps must increase"),
        ("# greenctx_trace v2\n0,8\ntimestamp,num_sms,tag\n", r"line 3: column header after"),
    ],
)
def test_bad_traces_name_the_line_and_the_problem(text, problem):
    with pytest.raises(TraceError, match=problem):
        GreenTrace.parse(text, source="t.csv")


def test_load_names_the_file(tmp_path):
    path = tmp_path / "throttle.csv"
    path.write_text("# greenctx_trace v2\n0,8\n0,16\n")
    with pytest.raises(TraceError, match=re.escape(f"{path}, line 3: timestamp 0 does not")):
        GreenTrace.load(path)
    path.write_text(EXAMPLE)
    assert GreenTrace.load(path).source == str(path)


def test_step_mode_needs_whole_step_indices():
    t = trace("0,8\n1.5,16\n")
    t.at_us(2.0)  # fine as times
    with pytest.raises(TraceError, match=r"line 3: timestamp 1\.5 is not a whole step index"):
        GreenContextController(t, None, clock_mode="step")
    GreenContextController(t, None, clock_mode="wall")


# -- SM counts ---------------------------------------------------------------------


def test_sm_granularity_by_compute_capability():
    assert sm_granularity(9) == (8, 8)  # H100/H200 and later
    assert sm_granularity(10) == (8, 8)
    assert sm_granularity(8) == (4, 2)  # A100, L4, RTX 30xx/40xx
    assert sm_granularity(7) == (2, 2)
    assert sm_granularity(6) == (1, 1)


@pytest.mark.parametrize(
    ("requested", "minimum", "multiple", "expected"),
    [
        (8, 8, 8, 8),
        (1, 8, 8, 8),  # below the minimum: the minimum
        (9, 8, 8, 16),  # rounded up to the step
        (33, 4, 2, 34),
        (3, 4, 2, 4),
        (131, 8, 8, 132),  # rounds past the device: the whole device
        (500, 8, 8, 132),
        (5, 1, 1, 5),
    ],
)
def test_round_sm_count(requested, minimum, multiple, expected):
    assert round_sm_count(requested, 132, minimum, multiple) == expected


# -- the controller, over stand-in partitions -------------------------------------


class RecordingPartitions:
    """Stands in for ``CudaGreenContexts`` where no GPU exists: same interface, records
    what the controller asks for, and computes GEMMs with the CPU kernels. Like the
    driver, it may give a partition more SMs than asked (``extra``)."""

    def __init__(self, total: int = 132, minimum: int = 8, multiple: int = 8, extra: int = 0):
        self.total_sms, self.min_sms, self.sm_multiple = total, minimum, multiple
        self.extra = extra
        self.calls: list[tuple[str, int | None]] = []
        self.prepared: set[int] = set()
        self.active: int | None = None
        self.closed = False

    def prepare(self, sm_count: int) -> int:
        assert sm_count % self.sm_multiple == 0 and self.min_sms <= sm_count < self.total_sms
        self.calls.append(("prepare", sm_count))
        self.prepared.add(sm_count + self.extra)
        return sm_count + self.extra

    def activate(self, sm_count: int) -> None:
        assert sm_count in self.prepared or sm_count == self.total_sms
        self.calls.append(("activate", sm_count))
        self.active = sm_count

    def run_plan(self, plan) -> None:
        assert self.active is not None
        run_plan(plan)

    def close(self) -> None:
        self.calls.append(("close", None))
        self.closed = True


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_partitions_are_made_up_front_once_per_valid_count():
    t = trace("0,8\n1,9\n2,16\n3,32\n4,64\n5,200\n6,16\n")
    parts = RecordingPartitions()
    controller = GreenContextController(t, parts)
    # 9 rounds to 16, 200 is the whole device: neither makes another partition.
    assert parts.calls == [("prepare", 8), ("prepare", 16), ("prepare", 32), ("prepare", 64)]
    assert controller.enabled
    assert controller.stats().switch_count == 0


def test_switches_only_when_the_count_changes_and_counts_them():
    parts = RecordingPartitions()
    controller = GreenContextController(GreenTrace.parse(EXAMPLE), parts, clock_mode="step")
    seen = []
    for step in range(6):
        controller.set_step(step)
        for _ in range(3):  # three GEMMs a step
            seen.append(controller.activate())
    assert seen == [8] * 3 + [32] * 6 + [16] * 9
    assert [c for c in parts.calls if c[0] == "activate"] == [
        ("activate", 8),
        ("activate", 32),
        ("activate", 16),
    ]
    stats = controller.stats()
    assert stats.switch_count == 3
    assert stats.active_sms == 16
    assert stats.gemms_by_sms == {8: 3, 32: 6, 16: 9}
    assert stats.total_overhead_us >= stats.max_overhead_us >= 0
    assert stats.status == "available" and stats.enabled


def test_the_switch_cost_is_measured_around_the_switch_alone():
    clock = FakeClock()
    parts = RecordingPartitions()
    slow = parts.activate

    def activate(sm_count: int) -> None:
        clock.ns += 7_000  # 7 µs per context switch
        slow(sm_count)

    parts.activate = activate
    controller = GreenContextController(GreenTrace.parse(EXAMPLE), parts, clock_ns=clock)
    for step in (0, 0, 1, 3, 3):
        controller.set_step(step)
        controller.activate()
    stats = controller.stats()
    assert (stats.switch_count, stats.total_overhead_us, stats.max_overhead_us) == (3, 21.0, 7.0)


def test_wall_clock_counts_from_the_first_gemm():
    clock = FakeClock()
    clock.ns = 123_456_789  # an arbitrary epoch: only differences matter
    parts = RecordingPartitions()
    controller = GreenContextController(
        GreenTrace.parse(EXAMPLE), parts, clock_mode="wall", clock_ns=clock
    )
    got = []
    for elapsed_ms in (0, 0.5, 1.0, 2.9, 3.0, 50):
        clock.ns = 123_456_789 + int(elapsed_ms * 1e6)
        got.append(controller.activate())
    assert got == [8, 8, 32, 32, 16, 16]
    assert controller.stats().switch_count == 3


def test_partitions_that_come_out_larger_are_used_as_they_are():
    parts = RecordingPartitions(minimum=4, multiple=2, extra=2)
    controller = GreenContextController(GreenTrace.parse(EXAMPLE), parts)
    assert controller.activate() == 10  # asked 8, the split gave 10
    controller.set_step(1)
    assert controller.activate() == 34


def test_off_switch_goes_back_to_the_whole_device_once_and_stays_there():
    parts = RecordingPartitions()
    controller = GreenContextController(GreenTrace.parse(EXAMPLE), parts)
    assert controller.activate() == 8
    controller.disable("throttling study over")
    for step in range(5):
        controller.set_step(step)
        assert controller.activate() == 132
    stats = controller.stats()
    assert stats.status == "off: throttling study over" and not stats.enabled
    assert stats.switch_count == 2  # to 8, then back to the whole device
    assert stats.gemms_by_sms == {8: 1, 132: 5}
    assert not parts.closed


def test_gemms_run_on_the_partition_and_close_tears_down():
    parts = RecordingPartitions()
    controller = GreenContextController(GreenTrace.parse(EXAMPLE), parts)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((40, 30)).astype(np.float32)
    b = rng.standard_normal((30, 20)).astype(np.float32)
    plan, out = plan_gemm(a, b)
    controller.run_plan(plan)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
    assert parts.active == 8
    controller.close()
    assert parts.calls[-1] == ("close", None)
    assert controller.partitions is None and controller.stats().status == "off: closed"
    with pytest.raises(RuntimeError, match="no GPU to run GEMMs on"):
        controller.run_plan(plan)


def test_a_failed_prepare_tears_down_what_was_made():
    parts = RecordingPartitions()

    def prepare(sm_count: int) -> int:
        if sm_count == 32:
            raise RuntimeError("cuGreenCtxCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
        return RecordingPartitions.prepare(parts, sm_count)

    parts.prepare = prepare
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        GreenContextController(GreenTrace.parse(EXAMPLE), parts)
    assert parts.closed


def test_without_a_trace_or_with_a_reason_it_runs_unthrottled():
    parts = RecordingPartitions()
    reason = "unavailable: driver 12.4 (12040) is older than 12.5; running without green contexts"
    old = GreenContextController(GreenTrace.parse(EXAMPLE), parts, status=reason)
    assert not old.enabled
    assert [old.activate() for _ in range(3)] == [132] * 3
    assert parts.calls == [("activate", 132)]  # no partitions made, one bind of the device
    assert old.stats().status.endswith("running without green contexts")
    assert GreenContextController(None, RecordingPartitions()).stats().status == "off: no trace"


# -- configuration and the real loaders ---------------------------------------------


def test_config_is_validated():
    with pytest.raises(ValueError, match="backend='cpp'"):
        GreenContextConfig(backend="cpp")
    with pytest.raises(ValueError, match="clock_mode='epoch'"):
        GreenContextConfig(clock_mode="epoch")
    with pytest.raises(ValueError, match="enabled=True needs trace_path"):
        GreenContextConfig(enabled=True)
    with pytest.raises(ValueError, match="device=-1"):
        GreenContextConfig(device=-1)


def test_environment_off_switch(monkeypatch, tmp_path):
    monkeypatch.setenv(OFF_ENV, "1")
    assert green_context_status() == f"off: {OFF_ENV}=1"
    path = tmp_path / "t.csv"
    path.write_text(EXAMPLE)
    config = GreenContextConfig(enabled=True, trace_path=str(path), strict=True)
    controller = GreenContextController.from_config(config)  # a choice: strict does not object
    assert controller.stats().status == f"off: {OFF_ENV}=1" and not controller.enabled
    controller.close()
    monkeypatch.setenv(OFF_ENV, "0")
    assert not green_context_status().startswith("off:")


CUDA = cuda_status()
GREEN = green_context_status()
no_gpu_here = pytest.mark.skipif(CUDA == "available", reason="this host has a usable GPU")
needs_green = pytest.mark.skipif(GREEN != "available", reason=f"green contexts {GREEN}")


@no_gpu_here
def test_statuses_say_why_nothing_runs_here():
    assert CUDA.startswith("unavailable: ")
    assert GREEN == CUDA
    if "not found" in CUDA:
        assert "libcuda.so.1 not found" in CUDA
    with pytest.raises(RuntimeError, match=re.escape(f"CUDA {CUDA}")):
        CudaGreenContexts()
    with pytest.raises(RuntimeError, match=re.escape(f"GPU worker: CUDA {CUDA}")):
        GreenGpuBackend(GreenContextConfig())


@no_gpu_here
def test_from_config_without_a_gpu(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(EXAMPLE)
    auto = GreenContextController.from_config(
        GreenContextConfig(enabled=True, trace_path=str(path))
    )
    assert auto.partitions is None and not auto.enabled
    assert auto.stats().status == CUDA
    assert auto.activate() is None
    for strict in (
        GreenContextConfig(enabled=True, trace_path=str(path), strict=True),
        GreenContextConfig(enabled=True, trace_path=str(path), backend="cuda"),
    ):
        with pytest.raises(RuntimeError, match=re.escape(f"green contexts {CUDA}")):
            GreenContextController.from_config(strict)
    off = GreenContextController.from_config(GreenContextConfig(trace_path=str(path)))
    assert off.stats().status == "off: disabled in the configuration"


# -- on a GPU (skipped here, with the reason) ----------------------------------------


@needs_green
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemms_under_green_contexts_match_numpy(dtype):
    parts = CudaGreenContexts()
    try:
        rounded = {
            round_sm_count(n, parts.total_sms, parts.min_sms, parts.sm_multiple)
            for n in (8, 16, 32)
        }
        counts = [parts.prepare(n) for n in sorted(rounded) if n < parts.total_sms]
        assert all(n % parts.sm_multiple == 0 for n in counts)
        rng = np.random.default_rng(7)
        tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == np.float32 else {"rtol": 1e-10}
        for sms in [*counts, parts.total_sms]:
            parts.activate(sms)
            a = rng.standard_normal((300, 200 + 5)).astype(dtype)[:, :200]  # padded rows
            b = np.ascontiguousarray(rng.standard_normal((150, 200)).astype(dtype)).T
            plan, out = plan_gemm(a, b)
            parts.run_plan(plan)
            np.testing.assert_allclose(out, a @ b, **tol)
            batched = rng.standard_normal((3, 300, 200)).astype(dtype)
            acc = rng.standard_normal((3, 300, 150)).astype(dtype)
            expected = 2.0 * (batched @ b) + 0.5 * acc
            plan, out = plan_gemm(batched, b, acc, alpha=2.0, beta=0.5)
            parts.run_plan(plan)
            np.testing.assert_allclose(out, expected, **tol)
    finally:
        parts.close()
    parts.close()  # twice is harmless


@needs_green
def test_fewer_sms_take_longer():
    parts = CudaGreenContexts()
    try:
        few = parts.prepare(parts.min_sms)
        n = 4096
        a = np.ones((n, n), np.float32)
        plan, _ = plan_gemm(a, a)
        times = {}
        for sms in (few, parts.total_sms):
            parts.activate(sms)
            parts.run_plan(plan, repeat=2)  # warm up
            start = time.perf_counter()
            parts.run_plan(plan, repeat=5)
            times[sms] = time.perf_counter() - start
        assert times[few] > 2 * times[parts.total_sms], times
    finally:
        parts.close()


@needs_green
async def test_green_gpu_worker_follows_the_trace(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(EXAMPLE)
    backend = GreenGpuBackend(GreenContextConfig(enabled=True, trace_path=str(path)))
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 48)).astype(np.float32)
    b = rng.standard_normal((48, 32)).astype(np.float32)
    with WorkerPool([backend]) as pool:
        for step in range(5):
            backend.controller.set_step(step)
            res = await pool.submit(a, b)
            np.testing.assert_allclose(res.out, a @ b, rtol=1e-4, atol=1e-4)
        stats = backend.controller.stats()
    assert stats.switch_count == 3 and sum(stats.gemms_by_sms.values()) == 5
    assert backend.controller is None  # torn down on the worker thread


# -- the CUDA backend over a stand-in driver ------------------------------------------


class StandInDriver:
    """The few libcuda entry points ``CudaGreenContexts`` and ``CudaHostPinner`` call, in
    Python, for hosts without a GPU: "device memory" is host memory, and every call that
    matters to the teardown order is logged. It checks the rules the real driver has
    (a context pushed around registration, the flags green contexts require)."""

    CU_STREAM_NON_BLOCKING = 1
    CU_DEV_RESOURCE_TYPE_SM = 1
    CU_GREEN_CTX_DEFAULT_STREAM = 1
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75

    def __init__(self, version: int = 12080) -> None:
        self.version = version
        self.log: list[str] = []
        self.memory: list[object] = []
        self.stack: list[object] = [None]
        self.handles = 0x1000

    def _handle(self, ctype: str):
        self.handles += 0x10
        return cuda_ffi.cast(ctype, self.handles)

    def cuDriverGetVersion(self, out):
        out[0] = self.version
        return 0

    def cuDeviceGetCount(self, out):
        out[0] = 1
        return 0

    def cuDeviceGet(self, out, ordinal):
        out[0] = ordinal
        return 0

    def cuDeviceGetAttribute(self, out, attribute, device):
        out[0] = {16: 132, 75: 9}[attribute]  # an H100: 132 SMs, compute capability 9.0
        return 0

    def cuDevicePrimaryCtxRetain(self, out, device):
        out[0] = cuda_ffi.cast("CUcontext", 0x8)
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device):
        self.log.append("release primary")
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.stack.append(ctx)
        return 0

    def cuCtxPopCurrent_v2(self, out):
        self.stack.pop()
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.stack[-1] = ctx
        if ctx == cuda_ffi.NULL:
            self.log.append("unbind current")
        return 0

    def cuStreamCreateWithPriority(self, out, flags, priority):
        out[0] = self._handle("CUstream")
        return 0

    def cuGreenCtxStreamCreate(self, out, green, flags, priority):
        assert flags == self.CU_STREAM_NON_BLOCKING
        out[0] = self._handle("CUstream")
        return 0

    def cuStreamSynchronize(self, stream):
        return 0

    def cuStreamDestroy_v2(self, stream):
        self.log.append("destroy stream")
        return 0

    def cuDeviceGetDevResource(self, device, out, kind):
        out[0].type, out[0].sm.smCount = kind, 132
        return 0

    def cuDevSmResourceSplitByCount(self, result, groups, source, remaining, flags, count):
        assert source.sm.smCount == 132 and groups[0] == 1
        result[0].type, result[0].sm.smCount = 1, count
        return 0

    def cuDevResourceGenerateDesc(self, out, resources, count):
        out[0] = self._handle("CUdevResourceDesc")
        return 0

    def cuGreenCtxCreate(self, out, desc, device, flags):
        assert flags == self.CU_GREEN_CTX_DEFAULT_STREAM
        out[0] = self._handle("CUgreenCtx")
        return 0

    def cuCtxFromGreenCtx(self, out, green):
        out[0] = cuda_ffi.cast("CUcontext", green)
        return 0

    def cuGreenCtxDestroy(self, green):
        self.log.append("destroy green context")
        return 0

    def cuMemAlloc_v2(self, out, nbytes):
        block = cuda_ffi.new("char[]", nbytes)
        self.memory.append(block)
        out[0] = int(cuda_ffi.cast("uintptr_t", block))
        return 0

    def cuMemFree_v2(self, pointer):
        self.log.append("free device memory")
        return 0

    def cuMemcpyHtoDAsync_v2(self, device, host, nbytes, stream):
        ctypes.memmove(device, int(cuda_ffi.cast("uintptr_t", host)), nbytes)
        return 0

    def cuMemcpyDtoHAsync_v2(self, host, device, nbytes, stream):
        ctypes.memmove(int(cuda_ffi.cast("uintptr_t", host)), device, nbytes)
        return 0

    def cuMemHostRegister_v2(self, pointer, nbytes, flags):
        assert self.stack[-1] is not None, "registration needs a current context"
        assert flags == self.CU_MEMHOSTREGISTER_PORTABLE
        self.log.append(f"register {nbytes}")
        return 0

    def cuMemHostUnregister(self, pointer):
        assert self.stack[-1] is not None, "unregistration needs a current context"
        self.log.append("unregister")
        return 0

    def cuGetErrorName(self, code, out):
        return 1


class StandInCublas:
    """Column-major GEMMs as cuBLAS computes them, on the stand-in's "device" memory."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def cublasCreate_v2(self, out):
        out[0] = cuda_ffi.cast("cublasHandle_t", 0x40)
        return 0

    def cublasSetStream_v2(self, handle, stream):
        return 0

    def cublasDestroy_v2(self, handle):
        self.log.append("destroy cuBLAS handle")
        return 0

    @staticmethod
    def _matrix(pointer, rows, cols, ld, dtype):
        """A column-major rows x cols view of memory at ``pointer`` (leading dimension ld)."""
        if rows == 0 or cols == 0:
            return np.zeros((rows, cols), dtype)
        item = np.dtype(dtype).itemsize
        count = (cols - 1) * ld + rows
        raw = (ctypes.c_char * (count * item)).from_address(
            int(cuda_ffi.cast("uintptr_t", pointer))
        )
        flat = np.frombuffer(raw, dtype=dtype)
        return np.lib.stride_tricks.as_strided(flat, (rows, cols), (item, ld * item))

    def _gemm(self, dtype, handle, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        op_a = self._matrix(a, *((k, m) if ta else (m, k)), lda, dtype)
        op_b = self._matrix(b, *((n, k) if tb else (k, n)), ldb, dtype)
        out = self._matrix(c, m, n, ldc, dtype)
        product = alpha[0] * ((op_a.T if ta else op_a) @ (op_b.T if tb else op_b))
        out[...] = product + beta[0] * out if beta[0] else product
        return 0

    def cublasSgemm_v2(self, *args):
        return self._gemm(np.float32, *args)

    def cublasDgemm_v2(self, *args):
        return self._gemm(np.float64, *args)


@pytest.fixture
def stand_in(monkeypatch):
    """Install the stand-in driver and cuBLAS where the real ones would be loaded."""
    from morphling.kernels import cuda
    from morphling.kernels.green_context import cuda_partitions

    driver = StandInDriver()
    monkeypatch.setattr(cuda, "_driver", driver)
    monkeypatch.setattr(cuda, "_status", "available")
    monkeypatch.setattr(cuda, "_pinner", None)
    monkeypatch.setattr(cuda_partitions, "_blas", StandInCublas(driver.log))
    monkeypatch.delenv(OFF_ENV, raising=False)
    return driver


def test_cuda_backend_gemms_follow_the_row_major_contract(stand_in):
    parts = CudaGreenContexts()
    assert (parts.total_sms, parts.min_sms, parts.sm_multiple) == (132, 8, 8)
    assert [parts.prepare(n) for n in (8, 16)] == [8, 16]
    rng = np.random.default_rng(11)
    for dtype in (np.float32, np.float64):
        for sms in (8, 16, 132):
            parts.activate(sms)
            a = rng.standard_normal((30, 23)).astype(dtype)[:, :20]  # padded rows
            b = np.ascontiguousarray(rng.standard_normal((15, 20)).astype(dtype)).T
            plan, out = plan_gemm(np.ascontiguousarray(a.T).T, b)  # a column-major a too
            parts.run_plan(plan, repeat=3)
            np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
            batched = rng.standard_normal((3, 30, 20)).astype(dtype)
            acc = rng.standard_normal((3, 30, 15)).astype(dtype)
            expected = 2.0 * (batched @ b) + 0.5 * acc
            parts.run_plan(plan_gemm(batched, b, acc, alpha=2.0, beta=0.5)[0])
            np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-5)
            wide = np.full((30, 40), 7.0, dtype)  # an output with gaps between its rows
            parts.run_plan(plan_gemm(a, b, wide[:, 5:20])[0])
            np.testing.assert_allclose(wide[:, 5:20], a @ b, rtol=1e-5, atol=1e-5)
            assert (wide[:, :5] == 7).all() and (wide[:, 20:] == 7).all()
    with pytest.raises(ValueError, match="repeat=2"):
        parts.run_plan(plan_gemm(a, b, wide[:, 5:20], beta=1.0)[0], repeat=2)
    parts.close()


def test_cuda_backend_tears_down_in_order(stand_in):
    parts = CudaGreenContexts()
    parts.prepare(8)
    parts.prepare(32)
    parts.activate(8)
    a = np.ones((4, 4), np.float32)
    parts.run_plan(plan_gemm(a, a)[0])
    stand_in.log.clear()
    parts.close()
    parts.close()
    assert stand_in.log == [
        *["destroy cuBLAS handle", "destroy stream"] * 3,  # the whole device, 8 and 32 SMs
        *["free device memory"] * 3,
        *["destroy green context"] * 2,
        "unbind current",
        "release primary",
    ]


def test_an_old_driver_runs_without_green_contexts(stand_in, tmp_path):
    stand_in.version = 12040
    status = green_context_status()
    assert status == (
        "unavailable: driver 12.4 (12040) is older than 12.5; running without green contexts"
    )
    path = tmp_path / "t.csv"
    path.write_text(EXAMPLE)
    controller = GreenContextController.from_config(
        GreenContextConfig(enabled=True, trace_path=str(path))
    )
    assert controller.stats().status == status and not controller.enabled
    a = np.ones((8, 8), np.float32)
    plan, out = plan_gemm(a, a)
    controller.run_plan(plan)  # on the whole device
    assert (out == 8).all() and controller.stats().gemms_by_sms == {132: 1}
    controller.close()
    assert "destroy green context" not in stand_in.log
    with pytest.raises(RuntimeError, match=r"older than 12\.5"):
        GreenContextController.from_config(
            GreenContextConfig(enabled=True, trace_path=str(path), backend="cuda")
        )


def test_pool_pins_through_the_driver_with_a_context_pushed(stand_in):
    pool = BufferPool(max_free_per_bucket=0)
    assert pool.stats().pin_status == "pinned: cuMemHostRegister (portable) on CUDA device 0"
    pool.acquire(5000).release()
    assert stand_in.log == ["register 8192", "unregister"]

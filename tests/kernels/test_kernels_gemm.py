"""The CPU GEMM kernels against numpy: layouts, batches, dtypes and every error path."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from morphling.kernels import (
    BufferPool,
    gemm,
    plan_explicit,
    plan_gemm,
    run_plan,
    set_threads,
)
from morphling.kernels._native import ffi, lib
from morphling.kernels.blas import _AVX512, _openblas_core, _x86_cpu

DTYPES = [np.float32, np.float64]


def tolerance(dtype, k: int) -> dict:
    eps = 1e-5 if dtype == np.float32 else 1e-12
    return {"rtol": eps * 10, "atol": eps * max(k, 1) * 4}


def operand(rng, rows, cols, *, dtype, transposed, pad, batch=None):
    """A [rows, cols] (or [batch, rows, cols]) view: padded rows, optionally a transpose."""
    lead = () if batch is None else (batch,)
    if transposed:
        base = rng.standard_normal((*lead, cols, rows + pad)).astype(dtype)
        return np.swapaxes(base[..., :rows], -1, -2)
    base = rng.standard_normal((*lead, rows, cols + pad)).astype(dtype)
    return base[..., :cols]


@st.composite
def gemm_cases(draw):
    return {
        "m": draw(st.integers(0, 33)),
        "n": draw(st.integers(0, 33)),
        "k": draw(st.integers(0, 33)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "ta": draw(st.booleans()),
        "tb": draw(st.booleans()),
        "pad_a": draw(st.integers(0, 3)),
        "pad_b": draw(st.integers(0, 3)),
        "batch": draw(st.sampled_from([None, 1, 3])),
        "b_shared": draw(st.booleans()),  # a 2-D b broadcast across a batch
        "out_colmajor": draw(st.booleans()),
        "alpha": draw(st.sampled_from([1.0, -0.5, 2.0])),
        "beta": draw(st.sampled_from([0.0, 1.0, 0.25])),
        "torch_inputs": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gemm_cases())
def test_gemm_matches_numpy(case):
    rng = np.random.default_rng(case["seed"])
    m, n, k, dtype, batch = case["m"], case["n"], case["k"], case["dtype"], case["batch"]
    a = operand(rng, m, k, dtype=dtype, transposed=case["ta"], pad=case["pad_a"], batch=batch)
    b_batch = None if case["b_shared"] else batch
    b = operand(rng, k, n, dtype=dtype, transposed=case["tb"], pad=case["pad_b"], batch=b_batch)
    shape = (m, n) if batch is None else (batch, m, n)
    out = rng.standard_normal(shape).astype(dtype)
    if case["out_colmajor"]:
        out = np.swapaxes(np.ascontiguousarray(np.swapaxes(out, -1, -2)), -1, -2)
    expected = case["alpha"] * np.matmul(a.astype(np.float64), b.astype(np.float64))
    expected += case["beta"] * out
    if case["torch_inputs"]:
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    result = gemm(a, b, out, alpha=case["alpha"], beta=case["beta"])
    assert result is out
    np.testing.assert_allclose(out, expected, **tolerance(dtype, k))


def test_views_are_not_copied():
    """The plan points at the operands' own memory: strided views go to BLAS as they are."""
    a = np.ones((8, 20), np.float32)[:, 2:10]  # row stride 20, starts 2 elements in
    b = np.ones((10, 8), np.float32).T  # column-major: BLAS transpose, ld 8
    out = np.empty((24, 10), np.float32)[::3]  # 8 rows, row stride 30
    plan, result = plan_gemm(a, b, out)
    assert result is out

    def address(ptr):
        return int(ffi.cast("uintptr_t", ptr))

    assert address(plan.a) == a.ctypes.data
    assert address(plan.b) == b.ctypes.data
    assert address(plan.c) == out.ctypes.data
    assert (plan.trans_a, plan.lda, plan.trans_b, plan.ldb, plan.ldc) == (0, 20, 1, 8, 30)


def test_torch_views_including_grad_tensors():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(3, 7)
    out = gemm(x, w.T)  # like F.linear: x @ W^T, W^T passed as a view
    np.testing.assert_allclose(out, (x @ w.T).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_torch_operands_can_still_be_resized():
    """``Tensor.numpy()`` would mark their storage never to be resized again, and FSDP
    frees its all-gather buffers by resizing them to 0 (it failed under --ranks)."""
    x, w, out = torch.randn(5, 7), torch.randn(7, 3), torch.empty(5, 3)
    gemm(x, w, out)
    for t in (x, w, out):
        t.untyped_storage().resize_(0)


def test_explicit_contract_on_pool_buffers():
    """The wire-level contract: explicit m, n, k, ld, transposes and batch strides."""
    rng = np.random.default_rng(0)
    pool = BufferPool()
    m, n, k, batch = 5, 6, 7, 3
    a = rng.standard_normal((batch, k, m)).astype(np.float32)  # stored transposed
    b = rng.standard_normal((k, n + 2)).astype(np.float32)  # padded rows, shared
    with (
        pool.acquire(a.nbytes) as la,
        pool.acquire(b.nbytes) as lb,
        pool.acquire(batch * m * n * 4) as lc,
    ):
        la.array(np.float32, a.shape)[:] = a
        lb.array(np.float32, b.shape)[:] = b
        operands = (la, m, lb, n + 2, lc, n)  # A, lda, B, ldb (rows padded), C, ldc
        strides = {"stride_a": k * m, "stride_b": 0, "stride_c": m * n}
        plan = plan_explicit(np.float32, True, False, m, n, k, *operands, batch=batch, **strides)
        run_plan(plan)
        got = lc.array(np.float32, (batch, m, n)).copy()
        del plan  # the plan points into the leases: they cannot be released before it goes
    expected = np.swapaxes(a, 1, 2) @ b[:, :n]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: gemm(np.ones((2, 3), np.int64), np.ones((3, 2), np.int64)), "dtype int64"),
        (lambda: gemm(np.ones((2, 3), np.float32), np.ones((3, 2))), "b: dtype float64"),
        (lambda: gemm(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32)), "inner"),
        (lambda: gemm(np.ones((2, 2, 3)), np.ones((3, 3, 2))), "batch sizes differ"),
        (lambda: gemm(np.ones((1, 2, 2, 3)), np.ones((3, 2))), "2 or 3 dimensions"),
        (lambda: gemm(np.ones((4, 6))[:, ::2], np.ones((3, 2))), "not a BLAS layout"),
        (lambda: gemm(np.ones((4, 3))[::-1], np.ones((3, 2))), "non-negative"),
        (lambda: gemm(np.ones((2, 3)), np.ones((3, 2)), np.ones((3, 2))), "out: shape"),
        (lambda: gemm(np.ones((2, 3)), np.ones((3, 2)), beta=1.0), "beta is nonzero"),
        (lambda: gemm([[1.0]], np.ones((1, 1))), "numpy array or torch tensor"),
        (lambda: gemm(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2), np.float32)), "out: dtype"),
    ],
)
def test_bad_arrays_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_out_overlap_readonly_and_unaligned():
    a = np.ones((4, 4))
    with pytest.raises(ValueError, match="overlaps"):
        gemm(a, np.ones((4, 4)), a)
    ro = np.zeros((4, 4))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        gemm(a, np.ones((4, 4)), ro)
    raw = np.zeros(4 * 4 * 4 + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(4, 4)
    with pytest.raises(ValueError, match="not aligned"):
        gemm(unaligned, np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        gemm(
            np.ones((3, 2, 2)),
            np.ones((2, 2)),
            np.lib.stride_tricks.as_strided(np.zeros((2, 2)), (3, 2, 2), (0, 16, 8)),
        )


def test_gpu_tensor_is_refused_with_its_device():
    meta = torch.empty((2, 2), device="meta")
    with pytest.raises(ValueError, match="meta"):
        gemm(meta, np.ones((2, 2), np.float32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lda": 2}, "lda=2"),
        ({"ldb": 1}, "ldb=1"),
        ({"ldc": 3}, "ldc=3"),
        ({"m": -1}, "must be >= 0"),
        ({"m": 9}, "A does not fit"),
        ({"n": 9, "ldb": 9, "ldc": 9}, "B does not fit"),
        ({"batch": 2, "stride_a": 0, "stride_b": 0, "stride_c": 16}, "C does not fit"),
        ({"stride_c": -16, "batch": 2}, "stride_c < 0"),
    ],
)
def test_explicit_contract_errors_name_the_field(kwargs, message):
    args = {"m": 4, "n": 4, "k": 4, "lda": 4, "ldb": 4, "ldc": 4}
    args.update(kwargs)
    extra = {
        key: args.pop(key) for key in ("batch", "stride_a", "stride_b", "stride_c") if key in args
    }
    a, b, c = bytearray(64), bytearray(64), bytearray(64)
    sizes = (args["m"], args["n"], args["k"])
    operands = (a, args["lda"], b, args["ldb"], c, args["ldc"])
    plan = plan_explicit(np.float32, False, False, *sizes, *operands, **extra)
    with pytest.raises(ValueError, match=message):
        run_plan(plan)


def test_explicit_unsupported_dtype():
    with pytest.raises(ValueError, match="float16"):
        plan_explicit(np.float16, False, False, 1, 1, 1, b"", 1, b"", 1, bytearray(4), 1)


@settings(max_examples=400, deadline=None)
@given(
    st.tuples(*[st.integers(-3, 40)] * 3),
    st.tuples(*[st.integers(-2, 60)] * 3),
    st.tuples(*[st.integers(-50, 400)] * 3),
    st.integers(-1, 4),
    st.tuples(st.booleans(), st.booleans(), st.sampled_from([np.float32, np.float64])),
)
def test_explicit_contract_never_reads_or_writes_out_of_bounds(dims, lds, strides, batch, flags):
    """Arbitrary (often lying) arguments over 1 KiB buffers compute or raise ValueError.

    Guard bytes around the output buffer must survive: a crash or an
    overwrite would fail the test.
    """
    ta, tb, dtype = flags
    a, b = bytearray(1024), bytearray(1024)
    guarded = bytearray(b"\xab" * 3072)
    c = memoryview(guarded)[1024:2048]
    operands = (a, lds[0], b, lds[1], c, lds[2])
    named = dict(zip(("stride_a", "stride_b", "stride_c"), strides, strict=True))
    plan = plan_explicit(dtype, ta, tb, *dims, *operands, batch=batch, **named)
    with contextlib.suppress(ValueError):
        run_plan(plan)
    assert guarded[:1024] == b"\xab" * 1024
    assert guarded[2048:] == b"\xab" * 1024


def test_gil_is_released_during_the_call():
    """Another Python thread keeps running while a large GEMM computes."""
    a = np.random.default_rng(1).standard_normal((1200, 1200)).astype(np.float32)
    out = np.empty_like(a)
    done = threading.Event()
    ticks_during = 0

    def worker():
        set_threads(1)
        for _ in range(3):
            gemm(a, a, out)
        done.set()

    thread = threading.Thread(target=worker)
    start = time.perf_counter()
    thread.start()
    while not done.is_set():
        ticks_during += 1
    elapsed = time.perf_counter() - start
    thread.join()
    # With the GIL held, this loop would only run in 5 ms switch intervals.
    assert elapsed > 0.01
    assert ticks_during > 10_000


def test_mkl_runs_on_gnu_openmp_beside_torch():
    """One OpenMP runtime: MKL on libgomp (as torch), no libiomp5 in the process."""
    code = (
        "import numpy as np, torch\n"
        "from morphling.kernels import blas_info, gemm\n"
        "info = blas_info()\n"
        "torch.mm(torch.ones(64, 64), torch.ones(64, 64))\n"
        "gemm(np.ones((256, 256), np.float32), np.ones((256, 256), np.float32))\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(info.name, info.threading, 'libgomp' in maps, 'libiomp5' in maps)\n"
    )
    proc = _run_isolated(code, MORPHLING_BLAS="mkl")
    if "MKL requested but not loadable" in proc.stderr:
        pytest.skip("MKL is not installed here (an ARM host)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["mkl", "gnu", "True", "False"]


def test_auto_takes_mkl_on_intel_and_openblas_elsewhere():
    """MKL runs its AVX2 code on other vendors' CPUs: there ``auto`` takes OpenBLAS,
    opened, where the CPU has AVX-512 and nobody said otherwise, as its AVX-512 kernels if
    the CPU's 512-bit units are full width and as its AVX2 ones if not."""
    vendor, flags = _x86_cpu()
    if not vendor:
        pytest.skip("/proc/cpuinfo names no x86 vendor here")
    code = (
        "from morphling.kernels import blas_info; i = blas_info()\n"
        "print(i.name, '|', i.version, '|', i.why_not_mkl)"
    )
    proc = _run_isolated(code, unset=("MORPHLING_BLAS", "OPENBLAS_CORETYPE"))
    assert proc.returncode == 0, proc.stderr
    name, version, why = proc.stdout.strip().split(" | ")
    if vendor == "GenuineIntel":
        assert name == "mkl"
        return
    assert name == "openblas", proc.stderr
    assert why == f"{vendor} CPU: MKL would run its AVX2 code"
    if flags >= _AVX512:
        assert ("SkylakeX" if _openblas_core() == "SkylakeX" else "Haswell") in version
    told = _run_isolated(code, OPENBLAS_CORETYPE="Haswell", MORPHLING_BLAS="openblas")
    assert told.returncode == 0, told.stderr
    assert "Haswell" in told.stdout  # a core named by the user is kept


def test_the_vector_width_probe_tells_half_from_full_width():
    """512-bit multiply-adds run at the 256-bit FLOP rate where each is split in two halves
    and at twice it at full width; nothing else (0 without AVX-512)."""
    _, flags = _x86_cpu()
    ratio = lib.mg_fma_512_over_256()
    if not flags >= {"avx512f", "avx2", "fma"}:
        assert ratio == 0.0
        return
    assert 0.7 < ratio < 1.3 or 1.7 < ratio < 2.3, ratio


def test_openblas_takes_the_first_thread_count_for_the_process():
    code = (
        "from morphling.kernels import blas\n"
        "from threadpoolctl import threadpool_info\n"
        "blas.set_threads(1)\n"
        "blas.set_threads(2)\n"
        "own = blas.blas_info().path\n"
        "print([i['num_threads'] for i in threadpool_info() if i['filepath'] == own])\n"
    )
    proc = _run_isolated(code, MORPHLING_BLAS="openblas")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[1]"
    assert "one thread count per process: threads=2 ignored, 1 kept" in proc.stderr


def _run_isolated(
    code: str, unset: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**{k: v for k, v in os.environ.items() if k not in unset}, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_openblas_fallback_computes_and_says_why():
    code = (
        "import logging, numpy as np\n"
        "logging.basicConfig(level='INFO')\n"
        "from morphling.kernels import gemm, blas_info\n"
        "a = np.random.rand(37, 19).astype(np.float32)\n"
        "b = np.random.rand(19, 23).astype(np.float32)\n"
        "assert np.allclose(gemm(a, b.T.copy().T), a @ b, rtol=1e-5, atol=1e-5)\n"
        "i = blas_info(); print(i.name, '|', i.why_not_mkl)\n"
    )
    proc = _run_isolated(code, MORPHLING_BLAS="openblas")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("openblas | MORPHLING_BLAS=openblas")
    assert "BLAS: using openblas" in proc.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MORPHLING_BLAS": "atlas"}, "MORPHLING_BLAS='atlas'"),
        ({"MORPHLING_MKL_THREADING": "pthreads"}, "MORPHLING_MKL_THREADING='pthreads'"),
        ({"MORPHLING_BLAS_THREADS": "zero"}, "MORPHLING_BLAS_THREADS='zero'"),
    ],
)
def test_bad_blas_settings_are_named(env, message):
    proc = _run_isolated("from morphling.kernels import blas_info; blas_info()", **env)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_review_regressions_layouts():
    # A batch of 0 is an empty result, not a layout error.
    assert gemm(np.ones((0, 2, 3)), np.ones((3, 4))).shape == (0, 2, 4)
    # Row-interleaved pivots (per-head results in one [m, batch, n] array) are disjoint.
    a, b = np.random.rand(3, 4, 5), np.random.rand(3, 5, 6)
    out = np.empty((4, 3, 6)).transpose(1, 0, 2)
    gemm(a, b, out)
    np.testing.assert_allclose(out, a @ b)
    # With a column-major out, a bad `a` is still reported as `a`.
    with pytest.raises(ValueError, match=r"^a: "):
        gemm(np.ones((4, 6))[:, ::2], np.ones((3, 2)), np.empty((2, 4)).T)


def test_review_regressions_explicit_contract():
    a, b = bytearray(64), bytearray(64)
    with pytest.raises(ValueError, match="c: bytes is not a writable contiguous buffer"):
        plan_explicit(np.float32, False, False, 2, 2, 2, a, 2, b, 2, bytes(64), 2)
    overlapping = plan_explicit(
        np.float32, False, False, 2, 2, 2, a, 2, b, 2, bytearray(64), 2, batch=10**9
    )
    with pytest.raises(ValueError, match="overlap"):
        run_plan(overlapping)  # stride_c 0 with many pivots: refused, not a hang
    # trans flags other than 0/1 mean "transposed", never another BLAS operation.
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    c = bytearray(16)
    run_plan(plan_explicit(np.float32, 2, False, 2, 2, 2, x.tobytes(), 2, x.tobytes(), 2, c, 2))
    np.testing.assert_allclose(np.frombuffer(c, np.float32).reshape(2, 2), x.T @ x)


def test_blas_path_setting_keeps_its_case(tmp_path):
    lib_dir = tmp_path / "BlasDir"
    lib_dir.mkdir()
    proc = _run_isolated(
        "from morphling.kernels import blas_info; blas_info()",
        MORPHLING_BLAS=str(lib_dir / "libNotABlas.so"),
    )
    assert "libNotABlas.so" in proc.stderr and "BlasDir" in proc.stderr

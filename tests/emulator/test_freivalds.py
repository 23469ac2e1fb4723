"""Freivalds' check of a GEMM tile: honest kernels pass, one corrupted element does not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from morphling.kernels.blas import gemm
from morphling.proxy.emulator import freivalds
from morphling.proxy.emulator.freivalds import RequestCheck, confirm

BLOCK = 64


def operands(rng: np.random.Generator, kind: str, m: int, k: int, n: int, dtype: type):
    """Operands as training makes them: of either sign, rectified activations, all
    positive with an offset, or heavily cancelling (large terms that sum to little)."""
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    if kind == "relu":
        a, b = np.maximum(a, 0), b * 0.02
    elif kind == "positive":
        a, b = a + 10, b + 3
    elif kind == "cancelling":
        a[:, : k // 2] *= 1e3
        b[: k // 2] *= 1e-3
    return a.astype(dtype), b.astype(dtype)


def kernels(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """The same product by honest kernels of different blockings: MKL, numpy's BLAS, K
    summed in two halves, and float64 rounded."""
    half = a.shape[1] // 2
    return {
        "mkl": gemm(a, b),
        "numpy": a @ b,
        "split-k": (a[:, :half] @ b[:half]) + (a[:, half:] @ b[half:]),
        "float64": (a.astype(np.float64) @ b.astype(np.float64)).astype(a.dtype),
    }


def screened(a: np.ndarray, b: np.ndarray, c: np.ndarray, rng: np.random.Generator) -> list[int]:
    """The tiles (by index) of ``c`` the screen flags, tiles of BLOCK × BLOCK."""
    m, n = c.shape
    check = RequestCheck(a, b, list(range(0, n, BLOCK)), rng)
    flagged = []
    tiles = [(r, j) for r in range(0, m, BLOCK) for j in range(0, n, BLOCK)]
    for index, (r, j) in enumerate(tiles):
        rows, cols = slice(r, min(r + BLOCK, m)), slice(j, min(j + BLOCK, n))
        if check.screen(rows, cols, c[rows, cols]) is not None:
            flagged.append(index)
    return flagged


@pytest.mark.parametrize("kind", ["normal", "relu", "positive", "cancelling"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_honest_kernels_pass_screen_and_confirmation(kind, dtype):
    rng = np.random.default_rng(0)
    a, b = operands(rng, kind, 130, 1500, 200, dtype)
    for name, c in kernels(a, b).items():
        assert screened(a, b, c, rng) == [], (kind, name)
        assert confirm(a, b, c) == "", (kind, name)


@pytest.mark.parametrize("kind", ["normal", "relu", "positive", "cancelling"])
def test_a_corrupted_element_is_flagged_and_confirmed_wrong(kind):
    rng = np.random.default_rng(1)
    a, b = operands(rng, kind, 128, 2048, 192, np.float32)
    c = gemm(a, b)
    rms = float(np.sqrt(np.mean(c.astype(np.float64) ** 2)))
    for i, j in [(0, 0), (77, 150), (127, 191)]:
        bad = c.copy()
        bad[i, j] += 0.05 * rms  # a twentieth of a typical element
        tile = (i // BLOCK) * 3 + j // BLOCK
        assert screened(a, b, bad, rng) == [tile]
        why = confirm(a, b, bad)
        assert why.startswith("1 of 24576 elements wrong, the first at"), why
        assert f"({i}, {j})" in why


def test_non_finite_results_are_wrong_only_where_the_product_is_finite():
    rng = np.random.default_rng(2)
    a, b = operands(rng, "normal", 64, 64, 64, np.float32)
    c = gemm(a, b)
    bad = c.copy()
    bad[3, 4] = np.nan
    assert screened(a, b, bad, rng) == [0]
    assert "(3, 4)" in confirm(a, b, bad)
    a[5, 0] = np.inf  # the product's row 5 is not finite: nothing there to check
    c = gemm(a, b)
    assert confirm(a, b, c) == ""


def test_transposed_views_are_checked_as_the_product_they_describe():
    rng = np.random.default_rng(3)
    a, b = operands(rng, "normal", 96, 300, 80, np.float32)
    at, bt = np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T  # same values, strided
    c = gemm(a, b)
    assert screened(at, bt, c, rng) == []
    bad = c.copy()
    bad[10, 70] *= 1.5
    assert screened(at, bt, bad, rng) == [1]


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 150),
    k=st.integers(1, 700),
    n=st.integers(1, 150),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_shape_passes_honest_and_fails_corrupted(m, k, n, seed):
    rng = np.random.default_rng(seed)
    a, b = operands(rng, "normal", m, k, n, np.float32)
    c = gemm(a, b)
    assert screened(a, b, c, rng) == []
    i, j = int(rng.integers(m)), int(rng.integers(n))
    bad = c.copy()
    bad[i, j] += np.float32(0.05 * max(1.0, float(np.sqrt(np.mean(c.astype(np.float64) ** 2)))))
    assert screened(a, b, bad, rng) == [(i // BLOCK) * -(-n // BLOCK) + j // BLOCK]
    assert confirm(a, b, bad)


def test_the_screens_reach_at_a_long_k():
    """At K = 4096 the screen's tolerance is a small part of a typical element: what it
    flags, the confirmation then judges element by element."""
    rng = np.random.default_rng(4)
    a, b = operands(rng, "normal", 64, 4096, 64, np.float32)
    c = gemm(a, b)
    check = RequestCheck(a, b, [0], rng)
    u = freivalds.unit_roundoff(np.dtype(np.float32))
    rows = slice(0, 64)
    size = np.linalg.norm(c, axis=1) + check.scale[rows, 0]
    tolerance = freivalds.LAMBDA * u * np.sqrt(4096) * size
    rms = float(np.sqrt(np.mean(c.astype(np.float64) ** 2)))
    assert float(np.median(tolerance)) < 0.025 * rms

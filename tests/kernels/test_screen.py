"""The screen's one pass over a product (``kernels.screen``) against numpy in float64:
its sums, its norms, and which rows' blocks fail, over shapes, blocks and dtypes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from morphling.kernels.screen import screen_blocks


def by_numpy(c: np.ndarray, w: np.ndarray, edge: int, ref: np.ndarray, unit: float, floor: float):
    """The pass written out: float64 sums and norms per block, and the failing count."""
    c64, w64 = c.astype(np.float64), w.astype(np.float64)
    starts = range(0, c.shape[-1], edge)
    sums = np.stack([c64[..., j : j + edge] @ w64[j : j + edge] for j in starts], -1)
    norms = np.stack([np.sqrt((c64[..., j : j + edge] ** 2).sum(-1)) for j in starts], -1)
    want = ref.astype(np.float64)
    with np.errstate(invalid="ignore"):
        fail = ~(np.abs(sums - want) <= unit * 2 * norms + floor)
    fail |= ~np.isfinite(sums) & np.isfinite(want)
    return sums, norms, int(fail.sum())


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 40),
    n=st.integers(1, 300),
    edge=st.integers(1, 130),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sums_norms_and_failures_are_numpys(batch, rows, n, edge, dtype, seed):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((batch, rows, n)).astype(dtype)
    w = rng.standard_normal(n).astype(dtype)
    blocks = -(-n // edge)
    exact, _, _ = by_numpy(c, w, edge, np.zeros((batch, rows, blocks)), 0.0, 0.0)
    # a reference off the exact sums by a random amount, about the tolerance's size
    ref = (exact + rng.standard_normal(exact.shape) * 1e-3).astype(dtype)
    unit = 1e-3 / (2 * max(1.0, float(np.abs(c).max())))
    got = screen_blocks(c, w, edge, ref, unit, 1e-9)
    sums, norms, failed = by_numpy(c, w, edge, ref, unit, 1e-9)
    np.testing.assert_allclose(got[0], sums, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], norms, rtol=1e-12)
    assert got[2] == failed  # (both in float64: only a pair on the edge could differ)


def test_a_non_finite_element_fails_its_block_only():
    c = np.ones((1, 3, 8), np.float32)
    w = np.ones(8, np.float32)
    ref = np.full((1, 3, 2), 4.0, np.float32)
    assert screen_blocks(c, w, 4, ref, 1e-6, 0.0)[2] == 0
    c[0, 1, 5] = np.inf  # row 1, block 1: its norm is infinite too, which must not cover it
    c[0, 2, 0] = np.nan
    _, norms, failed = screen_blocks(c, w, 4, ref, 1e-6, 0.0)
    assert failed == 2 and np.isinf(norms[0, 1, 1])
    ref[0, 0, 0] = np.nan  # a reference that is not a number fails its block
    assert screen_blocks(c, w, 4, ref, 1e-6, 0.0)[2] == 3


def test_strided_products_are_read_as_they_are():
    rng = np.random.default_rng(1)
    c = rng.standard_normal((2, 50, 64)).astype(np.float32).transpose(0, 2, 1)  # [2, 64, 50]
    w = rng.standard_normal(50).astype(np.float32)
    ref = np.zeros((2, 64, 4), np.float32)
    np.testing.assert_allclose(screen_blocks(c, w, 16, ref, 0.0, 0.0)[0],
                               by_numpy(c, w, 16, ref, 0.0, 0.0)[0], rtol=1e-12)  # fmt: skip


@pytest.mark.parametrize(
    ("c", "w", "edge", "ref", "message"),
    [
        (np.ones((2, 4), np.float16), np.ones(4, np.float16), 2, np.ones((2, 2), np.float16),
         "dtype float16"),
        (np.ones((2, 4)), np.ones(5), 2, np.ones((2, 2)), "weights (5,)"),
        (np.ones((2, 4)), np.ones(4), 0, np.ones((2, 2)), "edge 0"),
        (np.ones((2, 4)), np.ones(4), 2, np.ones((2, 3)), "reference (2, 3)"),
    ],
)  # fmt: skip
def test_arguments_that_do_not_fit_are_refused(c, w, edge, ref, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        screen_blocks(c, w, edge, ref, 1e-6, 0.0)

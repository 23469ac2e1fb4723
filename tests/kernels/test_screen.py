"""The screen's one pass over a block of a product (``kernels.screen``) against numpy in
float64: its sums, its norms, and which rows' blocks fail, over shapes, blocks, tiles and
dtypes."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from morphling.kernels.screen import ProductScreen


def by_numpy(c: np.ndarray, w: np.ndarray, edge: int, ref: np.ndarray, unit: float, floor: float):
    """The pass written out over a block c [rows, n] (its weights w, its reference
    [rows, blocks]): float64 sums and norms per column block, and where it fails."""
    c64, w64 = c.astype(np.float64), w.astype(np.float64)
    starts = range(0, c.shape[-1], edge)
    sums = np.stack([c64[..., j : j + edge] @ w64[j : j + edge] for j in starts], -1)
    norms = np.stack([np.sqrt((c64[..., j : j + edge] ** 2).sum(-1)) for j in starts], -1)
    want = ref.astype(np.float64)
    with np.errstate(invalid="ignore"):
        fail = ~(np.abs(sums - want) <= unit * 2 * norms + floor)
    fail |= ~np.isfinite(sums) & np.isfinite(want)
    return sums, norms, fail


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    m=st.integers(1, 40),
    n=st.integers(1, 300),
    edge=st.integers(1, 130),
    dtype=st.sampled_from([np.float32, np.float64]),
    data=st.data(),
)
def test_each_blocks_sums_norms_and_failures_are_numpys(batch, m, n, edge, dtype, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    c = rng.standard_normal((batch, m, n)).astype(dtype)
    w = rng.standard_normal(n).astype(dtype)
    blocks = -(-n // edge)
    exact, _, _ = by_numpy(c, w, edge, np.zeros((batch, m, blocks)), 0.0, 0.0)
    # a reference off the exact sums by a random amount, about the tolerance's size
    ref = (exact + rng.standard_normal(exact.shape) * 1e-3).astype(dtype)
    unit = 1e-3 / (2 * max(1.0, float(np.abs(c).max())))
    screen = ProductScreen(c, w, edge, ref, unit, 1e-9)
    pivot = data.draw(st.integers(0, batch - 1))
    r0 = data.draw(st.integers(0, m - 1))
    r1 = data.draw(st.integers(r0 + 1, m))
    j0 = data.draw(st.integers(0, blocks - 1))
    c1 = data.draw(st.integers(j0 * edge + 1, n))
    rows, cols = slice(r0, r1), slice(j0 * edge, c1)
    width = -(-(c1 - j0 * edge) // edge)
    sums, norms, fail = by_numpy(c[pivot, rows, cols], w[cols], edge,
                                 ref[pivot, rows, j0 : j0 + width], unit, 1e-9)  # fmt: skip
    got = screen.tile(pivot, rows, cols)
    # (both in float64: only a pair on the edge could differ)
    assert (got is None) == (not fail.any())
    if got is not None:
        np.testing.assert_allclose(got[0], sums, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1], norms, rtol=1e-12)


def test_a_non_finite_element_fails_its_block_only():
    c = np.ones((1, 3, 8), np.float32)
    w = np.ones(8, np.float32)
    ref = np.full((1, 3, 2), 4.0, np.float32)
    screen = ProductScreen(c, w, 4, ref, 1e-6, 0.0)
    assert screen.tile(0, slice(0, 3), slice(0, 8)) is None
    c[0, 1, 5] = np.inf  # row 1, block 1: its norm is infinite too, which must not cover it
    c[0, 2, 0] = np.nan  # (the screen reads the product in place, as tiles come in)
    assert screen.tile(0, slice(0, 1), slice(0, 8)) is None  # row 0 still passes
    assert screen.tile(0, slice(0, 3), slice(0, 4)) is not None  # the NaN's block
    sums, norms = screen.tile(0, slice(1, 2), slice(4, 8))
    assert np.isinf(sums[0, 0]) and np.isinf(norms[0, 0])
    ref[0, 0, 0] = np.nan  # a reference that is not a number fails its block
    assert ProductScreen(c, w, 4, ref, 1e-6, 0.0).tile(0, slice(0, 1), slice(0, 4)) is not None


@pytest.mark.parametrize(
    ("c", "w", "edge", "ref", "message"),
    [
        (np.ones((1, 2, 4), np.float16), np.ones(4, np.float16), 2,
         np.ones((1, 2, 2), np.float16), "dtype float16"),
        (np.ones((1, 2, 4)), np.ones(5), 2, np.ones((1, 2, 2)), "weights (5,)"),
        (np.ones((1, 2, 4)), np.ones(4), 0, np.ones((1, 2, 2)), "edge 0"),
        (np.ones((1, 2, 4)), np.ones(4), 2, np.ones((1, 2, 3)), "reference (1, 2, 3)"),
        (np.ones((1, 4, 2)).transpose(0, 2, 1), np.ones(4), 2, np.ones((1, 2, 2)),
         "is not a C-contiguous"),
    ],
)  # fmt: skip
def test_arguments_that_do_not_fit_are_refused(c, w, edge, ref, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        ProductScreen(c, w, edge, ref, 1e-6, 0.0)


@pytest.mark.parametrize(
    ("pivot", "rows", "cols"),
    [(1, slice(0, 2), slice(0, 4)), (0, slice(0, 3), slice(0, 4)), (0, slice(1, 1), slice(0, 4)),
     (0, slice(0, 2), slice(1, 4)), (0, slice(0, 2), slice(0, 5))],
)  # fmt: skip
def test_a_block_outside_the_product_is_refused(pivot, rows, cols):
    screen = ProductScreen(np.ones((1, 2, 4)), np.ones(4), 2, np.ones((1, 2, 2)), 1e-6, 0.0)
    with pytest.raises(ValueError, match="is not in"):
        screen.tile(pivot, rows, cols)

"""Freivalds' check of a GEMM or convolution tile: honest kernels pass, one corrupted element
does not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from morphling.kernels.blas import gemm
from morphling.kernels.conv import ConvGeometry, conv_forward, conv_grad_input
from morphling.proxy.emulator import freivalds
from morphling.proxy.emulator.conv_partition import make_conv_task
from morphling.proxy.emulator.freivalds import RequestCheck, confirm, weights
from morphling.proxy.job.client import conv_request

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
    check = RequestCheck(a[None], b[None], c[None], BLOCK, weights(rng, n, c.dtype))
    tiles = [(r, j) for r in range(0, m, BLOCK) for j in range(0, n, BLOCK)]
    blocks = [(slice(r, min(r + BLOCK, m)), slice(j, min(j + BLOCK, n))) for r, j in tiles]
    return [index for index, (rows, cols) in enumerate(blocks) if check.fails(0, rows, cols)]


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
    check = RequestCheck(a[None], b[None], c[None], 64, weights(rng, 64, c.dtype))
    u = freivalds.unit_roundoff(np.dtype(np.float32))
    size = np.linalg.norm(c, axis=1) + check.scale[0, :, 0]
    tolerance = freivalds.LAMBDA * u * np.sqrt(4096) * size
    rms = float(np.sqrt(np.mean(c.astype(np.float64) ** 2)))
    assert float(np.median(tolerance)) < 0.025 * rms


# -- convolution tiles -----------------------------------------------------------------------

# (N, C, H, W, OC, kernel, stride, padding (top, bottom, left, right), dilation, groups)
CONV_CASES = {
    "3x3 pad 1": (2, 16, 8, 7, 12, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    "stride 2": (2, 3, 9, 8, 5, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1),
    "dilation 2, asymmetric padding": (2, 12, 11, 10, 4, (3, 2), (2, 3), (2, 0, 0, 3), (2, 1), 1),
    "groups 3, stride 2": (1, 6, 8, 8, 3, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 3),
    "depthwise": (2, 5, 8, 7, 5, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 5),
    "depthwise, multiplier 2, stride 2, dilation 2": (
        2,
        3,
        11,
        9,
        6,
        (3, 3),
        (2, 2),
        (2, 1, 2, 1),
        (2, 2),
        3,
    ),
    "1x1": (2, 32, 6, 6, 24, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    "1-D": (3, 4, 1, 20, 6, (1, 5), (1, 2), (0, 0, 2, 2), (1, 1), 1),
    "resnet stage": (4, 64, 14, 14, 64, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
}


def conv_task(case: tuple, kind: str, block: int, rng: np.random.Generator):
    """The convolution ``kind`` of ``case`` cut into tiles as the emulator cuts it, its
    product as honest devices compute it (each tile by the kernels' own call)."""
    n, c, h, w, oc, kernel, stride, padding, dilation, groups = case
    geom = ConvGeometry(kernel, stride, dilation, padding, groups)
    oh, ow = geom.output_size(h, w)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = (rng.standard_normal((oc, c // groups, *kernel)) * 0.1).astype(np.float32)
    dy = rng.standard_normal((n, oc, oh, ow)).astype(np.float32)
    a, b = {"forward": (x, weight), "grad_input": (dy, weight), "grad_weight": (x, dy)}[kind]
    shapes = {"input_shape": x.shape, "weight_shape": weight.shape}
    geometry = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    request, _ = conv_request(1, kind, a, b, **shapes, **geometry)
    task = make_conv_task(request)
    tiles = task.tiles(block, 1 << 20)
    for tile in tiles:
        call, _, _ = freivalds.conv_call(tile)
        task.out[tile.index] = call(np.ascontiguousarray(tile.a), np.ascontiguousarray(tile.b))
    return task, tiles


@pytest.mark.parametrize("kind", ["forward", "grad_input", "grad_weight"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_convolution_requests_honest_pass_and_one_corrupted_element_flags_its_tile(case, kind):
    rng = np.random.default_rng(7)

    def draw(n, dtype):
        return freivalds.weights(rng, n, dtype)

    for block in (4, 16, 256):
        task, tiles = conv_task(CONV_CASES[case], kind, block, rng)
        flags = screen(task, draw)
        assert not flags.any(), block
        assert all(freivalds.confirm_conv(t, task.out[t.index]) == "" for t in tiles), block
        for _ in range(3):
            flat = task.out.reshape(-1)
            at = int(rng.integers(flat.size))
            honest = flat[at]
            rms = float(np.sqrt(np.mean(task.out.astype(np.float64) ** 2)))
            flat[at] += 0.05 * max(1e-3, rms)
            where = np.unravel_index(at, task.out.shape)
            (tile,) = [t for t in tiles if task.out[t.index].size and _holds(t.index, where)]
            flags = screen(task, draw)
            assert [t for t in tiles if freivalds.conv_flagged(flags, t)] == [tile], (block, at)
            why = freivalds.confirm_conv(tile, task.out[tile.index])
            inside = tuple(int(i) - (s.start or 0) for i, s in zip(where, tile.index, strict=True))
            assert why.startswith("1 of") and f"({', '.join(map(str, inside))})" in why, why
            flat[at] = honest


def screen(task, draw):
    """``ConvScreen``'s flags for ``task``'s product as it is now."""
    check = freivalds.ConvScreen(task, draw)
    return check.flags(check.reference())


def _holds(index: tuple[slice, ...], where: tuple) -> bool:
    return all(s.start is None or s.start <= i < s.stop for s, i in zip(index, where, strict=True))


def test_an_infinite_or_huge_element_is_caught_where_the_product_is_finite():
    rng = np.random.default_rng(9)
    a, b = operands(rng, "normal", 64, 300, 64, np.float32)
    c = gemm(a, b)
    for value in (np.inf, -np.inf, 1e20, 3e38):
        bad = c.copy()
        bad[5, 7] = value
        assert screened(a, b, bad, rng) == [0], value
        assert "(5, 7)" in confirm(a, b, bad), value


def test_honest_overflow_and_subnormal_results_are_not_refused():
    rng = np.random.default_rng(10)
    a, b = operands(rng, "normal", 32, 64, 32, np.float32)
    big = (a * np.float32(3e19), b * np.float32(3e19))  # products past float32's range: ±inf
    with np.errstate(over="ignore", invalid="ignore"):
        c = big[0] @ big[1]
    assert not np.isfinite(c).all()
    assert confirm(*big, c) == ""
    tiny = (a * np.float32(1e-21), b * np.float32(1e-21))  # products in the subnormal range
    c = tiny[0] @ tiny[1]
    assert screened(*tiny, c, rng) == [] and confirm(*tiny, c) == ""
    assert confirm(*tiny, np.zeros_like(c)) == ""  # flushed to zero (FTZ): not refused


def test_two_columns_swapped_are_caught_every_time():
    """The weights are signed magnitudes in [1, 2): no two columns cancel, as ±1 signs
    would for half the pairs."""
    rng = np.random.default_rng(11)
    a, b = operands(rng, "normal", 64, 128, 64, np.float32)
    c = gemm(a, b)
    for _ in range(50):
        i, j = rng.choice(64, 2, replace=False)
        bad = c.copy()
        bad[:, [i, j]] = bad[:, [j, i]]
        assert screened(a, b, bad, rng) == [0]


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_the_screens_few_channel_references_are_the_kernels_calls(case):
    """The screen's own forward and grad input for a few channels per group (a matmul per
    tap, then shifted adds) equal ``conv_forward``'s and ``conv_grad_input``'s."""
    n, c, h, w, oc, kernel, stride, padding, dilation, groups = CONV_CASES[case]
    geom = ConvGeometry(kernel, stride, dilation, padding, groups)
    oh, ow = geom.output_size(h, w)
    rng = np.random.default_rng(12)
    for few in (1, 2):
        x = rng.standard_normal((n, c, h, w))
        probe = rng.standard_normal((groups * few, c // groups, *kernel))
        got = freivalds._one_channel_forward(x, probe, geom)
        np.testing.assert_allclose(got, conv_forward(x, probe, geom), rtol=1e-12, atol=1e-12)
        dy = rng.standard_normal((n, oc, oh, ow))
        probe = rng.standard_normal((oc, few, *kernel))
        want = conv_grad_input(dy, probe, geom, input_size=(h, w))
        got = freivalds._one_channel_grad_input(dy, probe, geom, (h, w))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(few))

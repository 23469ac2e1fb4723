"""The device-side convolution kernels against torch: whole, in bands, and on bad input.

The reference is torch's autograd in float64 over the same inputs. A result is within
RTOL of it relative to the element's magnitude, the same convolution over absolute
values (the sum of the absolute products it adds up), so elements built from large
cancelling terms get their honest rounding and exact zeros must stay exact.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from morphling.kernels import (
    ConvGeometry,
    conv,
    conv_flops,
    conv_forward,
    conv_grad_input,
    conv_grad_weight,
)
from torch.utils.flop_counter import FlopCounterMode

RTOL = {np.float32: 1e-5, np.float64: 1e-12}


def torch_reference(x, w, dy, geom: ConvGeometry):
    """(y, dx, dw) by torch's autograd in float64, the region padded as the geometry says."""
    top, bottom, left, right = geom.padding
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(
        F.pad(xt, (left, right, top, bottom)),
        wt,
        stride=geom.stride,
        dilation=geom.dilation,
        groups=geom.groups,
    )
    y.backward(torch.tensor(dy, dtype=torch.float64))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def assert_matches(got, want, scale, dtype):
    assert got.dtype == dtype
    assert got.shape == want.shape
    excess = np.abs(got.astype(np.float64) - want) - RTOL[dtype] * scale
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess.max() <= 0, f"at {worst}: got {got[worst]}, want {want[worst]}"


def inputs(rng, n, channels, height, width, w_shape, dtype):
    x = rng.standard_normal((n, channels, height, width)).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    return x, w


def check_all(x, w, geom, rng):
    """Forward, grad input and grad weight of the whole convolution against torch."""
    dtype = x.dtype.type
    y = conv_forward(x, w, geom)
    dy = rng.standard_normal(y.shape).astype(dtype)
    want = torch_reference(x, w, dy, geom)
    scale = torch_reference(np.abs(x), np.abs(w), np.abs(dy), geom)
    dx = conv_grad_input(dy, w, geom, input_size=x.shape[2:])
    dw = conv_grad_weight(x, dy, geom)
    for got, ref, mag in zip((y, dx, dw), want, scale, strict=True):
        assert_matches(got, ref, mag, dtype)


# name: (N, C, H, W, OC, geometry)
CASES = {
    "3x3 pad 1": (2, 3, 8, 7, 4, ConvGeometry((3, 3), padding=(1, 1, 1, 1))),
    "stride 2": (2, 3, 9, 8, 5, ConvGeometry((3, 3), stride=(2, 2), padding=(1, 1, 1, 1))),
    "dilation 2": (1, 4, 9, 9, 3, ConvGeometry((3, 3), dilation=(2, 2), padding=(2, 2, 2, 2))),
    "stride, dilation, asymmetric padding": (
        2,
        3,
        11,
        10,
        4,
        ConvGeometry((3, 2), stride=(2, 3), dilation=(2, 1), padding=(2, 0, 0, 3)),
    ),
    "groups 2": (2, 4, 7, 6, 6, ConvGeometry((3, 3), padding=(1, 1, 1, 1), groups=2)),
    "groups 3, stride 2": (1, 6, 8, 8, 3, ConvGeometry((2, 2), stride=(2, 2), groups=3)),
    "depthwise": (2, 5, 8, 7, 5, ConvGeometry((3, 3), padding=(1, 1, 1, 1), groups=5)),
    "depthwise, multiplier 2, stride 2, dilation 2": (
        2,
        3,
        11,
        9,
        6,
        ConvGeometry((3, 3), stride=(2, 2), dilation=(2, 2), padding=(2, 1, 2, 1), groups=3),
    ),
    "one input channel": (2, 1, 7, 7, 4, ConvGeometry((3, 3), padding=(1, 1, 1, 1))),
    # The depthwise C kernels: rows wide enough for their vector loops and a remainder,
    # strides past the kernel, padding past its reach, one image, one column.
    "depthwise 7x7, multiplier 3, 37 wide": (
        3,
        4,
        20,
        37,
        12,
        ConvGeometry((7, 7), padding=(3, 3, 3, 3), groups=4),
    ),
    "depthwise, stride 4 past a 2x2 kernel": (
        2,
        3,
        13,
        29,
        3,
        ConvGeometry((2, 2), stride=(4, 4), padding=(1, 0, 0, 1), groups=3),
    ),
    "depthwise, padding 5 around a 3x3 dilated 2": (
        1,
        2,
        4,
        6,
        4,
        ConvGeometry((3, 3), dilation=(2, 2), padding=(5, 5, 5, 5), groups=2),
    ),
    "depthwise, one column": (2, 3, 9, 1, 3, ConvGeometry((3, 1), padding=(1, 1, 0, 0), groups=3)),
    "depthwise 1-D, stride 2, dilation 3": (
        1,
        5,
        1,
        61,
        10,
        ConvGeometry((1, 7), stride=(1, 2), dilation=(1, 3), padding=(0, 0, 9, 9), groups=5),
    ),
    "1x1": (2, 6, 5, 4, 3, ConvGeometry((1, 1))),
    "1x1 stride 2 (rows and columns never read)": (
        1,
        4,
        6,
        7,
        5,
        ConvGeometry((1, 1), stride=(2, 2)),
    ),
    "1-D": (3, 4, 1, 17, 5, ConvGeometry((1, 5), stride=(1, 2), padding=(0, 0, 2, 2))),
    "kernel as large as the padded input": (
        2,
        2,
        3,
        3,
        2,
        ConvGeometry((5, 5), padding=(1, 1, 1, 1)),
    ),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch(name, dtype):
    n, channels, height, width, oc, geom = CASES[name]
    rng = np.random.default_rng(len(name))
    x, w = inputs(
        rng, n, channels, height, width, (oc, channels // geom.groups, *geom.kernel), dtype
    )
    check_all(x, w, geom, rng)


@pytest.mark.parametrize("columns", [1, 40])  # runs of one image (y written in place), of 3
@pytest.mark.parametrize("groups", [1, 2])
def test_runs_of_images_match_torch(monkeypatch, columns, groups):
    """The unfold is made a run of images at a time, the grad weight summed over the runs:
    with runs far smaller than the batch (the last one short), every call is torch's."""
    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(conv, "_CHUNK_COLUMNS", columns)
    geom = ConvGeometry((3, 3), padding=(1, 1, 1, 1), groups=groups)
    rng = np.random.default_rng(groups)
    x, w = inputs(rng, 7, 4, 4, 4, (6, 4 // groups, 3, 3), np.float32)  # 16 positions
    cgeom = conv._c_geometry(geom, x.shape, 6, (4, 4))
    assert conv._images_per_run(cgeom, x.itemsize) == (1 if columns == 1 else 3)
    check_all(x, w, geom, rng)


def test_symmetric_padding_is_torchs_padding_argument():
    """top = bottom = p, left = right = q is torch's padding=(p, q), in all three calls."""
    rng = np.random.default_rng(1)
    x, w = inputs(rng, 2, 4, 9, 8, (6, 2, 3, 2), np.float64)
    torch_args = {"stride": (2, 1), "padding": (2, 1), "dilation": (1, 2), "groups": 2}
    geom = ConvGeometry((3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 2, 1, 1), groups=2)
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    y = conv_forward(x, w, geom)
    np.testing.assert_allclose(y, F.conv2d(xt, wt, **torch_args).numpy(), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dyt = torch.from_numpy(dy)
    np.testing.assert_allclose(
        conv_grad_input(dy, w, geom, input_size=(9, 8)),
        torch.nn.grad.conv2d_input(x.shape, wt, dyt, **torch_args).numpy(),
        rtol=1e-12,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        conv_grad_weight(x, dy, geom),
        torch.nn.grad.conv2d_weight(xt, w.shape, dyt, **torch_args).numpy(),
        rtol=1e-12,
        atol=1e-12,
    )


def test_one_dimensional_is_conv1d():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 20))
    w = rng.standard_normal((4, 3, 3))
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    yt = F.conv1d(xt, wt, stride=2, padding=1, dilation=2)
    dy = rng.standard_normal(yt.shape)
    yt.backward(torch.from_numpy(dy))
    geom = ConvGeometry((1, 3), stride=(1, 2), dilation=(1, 2), padding=(0, 0, 1, 1))
    y = conv_forward(x[:, :, None], w[:, :, None], geom)
    dx = conv_grad_input(dy[:, :, None], w[:, :, None], geom, input_size=(1, 20))
    dw = conv_grad_weight(x[:, :, None], dy[:, :, None], geom)
    np.testing.assert_allclose(y[:, :, 0], yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx[:, :, 0], xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw[:, :, 0], wt.grad.numpy(), rtol=1e-12, atol=1e-12)


@st.composite
def convolutions(draw):
    """A small convolution of any kind: dense, grouped or depthwise (with a multiplier)."""
    kind = draw(st.sampled_from(["dense", "grouped", "depthwise"]))
    if kind == "dense":
        groups, per_group, oc_per_group = 1, draw(st.integers(1, 4)), draw(st.integers(1, 4))
    elif kind == "grouped":
        groups, per_group, oc_per_group = (draw(st.integers(2, 3)) for _ in range(3))
    else:
        groups, per_group, oc_per_group = draw(st.integers(1, 4)), 1, draw(st.integers(1, 3))
    geom, height, width = draw(_geometry(groups, kernel=3, stride=3, padding=3, width=9))
    (kh, kw) = geom.kernel
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    channels, oc = groups * per_group, groups * oc_per_group
    x, w = inputs(
        rng, draw(st.integers(1, 2)), channels, height, width, (oc, per_group, kh, kw), dtype
    )
    return x, w, geom, rng


@st.composite
def _geometry(draw, groups, *, kernel, stride, padding, width):
    """A geometry of ``groups`` (kernel, stride and padding up to the bounds given, dilation
    up to 3) and an input height and width its dilated kernel fits."""
    geom = ConvGeometry(
        kernel=(draw(st.integers(1, kernel)), draw(st.integers(1, kernel))),
        stride=(draw(st.integers(1, stride)), draw(st.integers(1, stride))),
        dilation=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        padding=tuple(draw(st.integers(0, padding)) for _ in range(4)),
        groups=groups,
    )
    (kh, kw), (dh, dw) = geom.kernel, geom.dilation
    top, bottom, left, right = geom.padding
    height = max(draw(st.integers(1, 12)), dh * (kh - 1) + 1 - top - bottom)
    return geom, height, max(draw(st.integers(1, width)), dw * (kw - 1) + 1 - left - right)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convolutions())
def test_any_convolution_matches_torch(case):
    check_all(*case)


@st.composite
def depthwise_convolutions(draw):
    """A depthwise convolution with the C kernels' edges: rows from 1 column to past their
    vector width, a multiplier, strides beyond the kernel, padding beyond its reach."""
    channels, multiplier = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    geom, height, width = draw(_geometry(channels, kernel=5, stride=4, padding=6, width=40))
    (kh, kw) = geom.kernel
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (channels * multiplier, 1, kh, kw)
    x, w = inputs(rng, draw(st.integers(1, 3)), channels, height, width, shape, dtype)
    return x, w, geom, rng


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depthwise_convolutions(), st.data())
def test_any_depthwise_convolution_matches_torch(case, data):
    """Whole and in bands of one row (regions of padding alone, bands no output reaches)."""
    x, w, geom, rng = case
    check_all(x, w, geom, rng)
    height = x.shape[2]
    out_rows = geom.output_size(height, x.shape[3])[0]
    check_bands(x, w, geom, rng, list(range(out_rows + 1)), list(range(height + 1)))


def test_depthwise_reads_views_as_their_elements():
    """The C kernels read memory: a strided or transposed view must give what its copy does."""
    rng = np.random.default_rng(8)
    geom = ConvGeometry((3, 3), stride=(2, 1), padding=(1, 1, 1, 1), groups=4)
    x = rng.standard_normal((2, 9, 4, 11))[:, ::2].transpose(0, 2, 1, 3)  # [2, 4, 5, 11]
    w = rng.standard_normal((8, 1, 3, 3, 2))[..., 0]
    y = conv_forward(x, w, geom)
    np.testing.assert_array_equal(y, conv_forward(x.copy(), w.copy(), geom))
    dy = np.asfortranarray(rng.standard_normal(y.shape))
    np.testing.assert_array_equal(
        conv_grad_input(dy, w, geom, input_size=(5, 11)),
        conv_grad_input(dy.copy(), w.copy(), geom, input_size=(5, 11)),
    )
    np.testing.assert_array_equal(
        conv_grad_weight(x, dy, geom), conv_grad_weight(x.copy(), dy.copy(), geom)
    )


@pytest.mark.parametrize("columns", [1, 512])  # runs of one image (BLAS writes y in place), more
@pytest.mark.parametrize("groups", [1, 2])
def test_implicit_gemm_reads_and_writes_views(monkeypatch, columns, groups):
    """The implicit GEMM's C call reads x and dy and writes y and dw at their own strides:
    views of every kind (channels picked, axes exchanged, Fortran order, a band of a larger
    array) give what their copies do, and nothing around an output band is written."""
    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(conv, "_CHUNK_COLUMNS", columns)
    rng = np.random.default_rng(groups)
    geom = ConvGeometry((3, 2), stride=(1, 2), padding=(1, 0, 1, 1), groups=groups)
    x = rng.standard_normal((3, 9, 4, 7))[:, ::2].transpose(0, 2, 1, 3)  # [3, 4, 5, 7]
    w = np.asfortranarray(rng.standard_normal((6, 4 // groups, 3, 2)))
    oh, ow = geom.output_size(5, 7)
    whole = np.full((3, 8, oh + 3, ow), np.nan)
    y = whole[:, 1:7, 2 : 2 + oh]
    assert conv_forward(x, w, geom, out=y) is y
    np.testing.assert_allclose(y, conv_forward(x.copy(), w.copy(), geom), rtol=1e-12, atol=1e-12)
    assert np.isnan(whole[:, [0, 7]]).all() and np.isnan(whole[:, :, :2]).all()
    dy = np.asfortranarray(rng.standard_normal(y.shape))
    for dw in (
        np.full(w.shape, np.nan, order="F"),
        np.full((6, 8, 3, 2), np.nan)[:, 2 : 2 + w.shape[1]],
    ):
        assert conv_grad_weight(x, dy, geom, out=dw) is dw
        want = conv_grad_weight(x.copy(), dy.copy(), geom)
        np.testing.assert_allclose(dw, want, rtol=1e-12, atol=1e-12)
    # negative strides (rows reversed): read and written through contiguous copies
    flipped, out = x[:, :, ::-1], np.full((3, 6, oh, ow), np.nan)[:, :, ::-1]
    assert conv_forward(flipped, w, geom, out=out) is out
    want = conv_forward(flipped.copy(), w.copy(), geom)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # a stride-1 grad input is the forward convolution of a view of dy, into a band of dx
    unit = ConvGeometry((3, 2), padding=(1, 1, 1, 0), groups=groups)
    dy = np.asfortranarray(rng.standard_normal((3, 6, *unit.output_size(5, 7))))
    dx = np.full((3, 4, 9, 7), np.nan)[:, :, 3:6]
    got = conv_grad_input(dy, w, unit, input_size=(5, 7), rows=(1, 4), out=dx)
    want = conv_grad_input(dy.copy(), w.copy(), unit, input_size=(5, 7))[:, :, 1:4]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --- bands ----------------------------------------------------------------------------------


def forward_in_bands(x, w, geom, cuts):
    """The output rows band by band, each from only the input rows its region names."""
    bands = []
    for o0, o1 in itertools.pairwise(cuts):
        r0, r1, region = geom.forward_band(x.shape[2], o0, o1)
        bands.append(conv_forward(x[:, :, r0:r1], w, region))
    return np.concatenate(bands, axis=2)


def grad_input_in_bands(dy, w, geom, input_size, cuts):
    """dX band by band, each from only the grad-output rows that reach it."""
    bands = []
    for i0, i1 in itertools.pairwise(cuts):
        lo, hi = geom.grad_output_rows(input_size[0], i0, i1)
        bands.append(
            conv_grad_input(
                dy[:, :, lo:hi], w, geom, input_size=input_size, oh_lo=lo, rows=(i0, i1)
            )
        )
    return np.concatenate(bands, axis=2)


def check_bands(x, w, geom, rng, out_cuts, in_cuts):
    dtype = x.dtype.type
    y = conv_forward(x, w, geom)
    dy = rng.standard_normal(y.shape).astype(dtype)
    want_y, want_dx, _ = torch_reference(x, w, dy, geom)
    scale_y, scale_dx, _ = torch_reference(np.abs(x), np.abs(w), np.abs(dy), geom)
    assert_matches(forward_in_bands(x, w, geom, out_cuts), want_y, scale_y, dtype)
    assert_matches(grad_input_in_bands(dy, w, geom, x.shape[2:], in_cuts), want_dx, scale_dx, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "geom",
    [
        ConvGeometry((3, 3), padding=(1, 1, 1, 1)),
        ConvGeometry((3, 3), stride=(2, 2), dilation=(2, 2), padding=(2, 3, 1, 1)),
        ConvGeometry((3, 2), stride=(3, 1), dilation=(2, 1), padding=(0, 4, 0, 0), groups=2),
        ConvGeometry((3, 3), stride=(2, 1), dilation=(2, 1), padding=(2, 2, 1, 1), groups=4),
        ConvGeometry((1, 1), stride=(2, 2)),
    ],
    ids=["3x3", "stride 2 dilation 2", "grouped stride 3", "depthwise", "1x1 stride 2"],
)
def test_bands_of_every_size_stack_to_the_whole(geom, dtype):
    """Single rows, the top and bottom edges, uneven bands: all stack to torch's whole."""
    rng = np.random.default_rng(3)
    height = 13
    x, w = inputs(rng, 2, 4, height, 6, (4, 4 // geom.groups, *geom.kernel), dtype)
    out_rows = geom.output_size(height, 6)[0]
    for out_cuts, in_cuts in [
        (list(range(out_rows + 1)), list(range(height + 1))),  # one row each
        ([0, 1, out_rows], [0, 1, height - 1, height]),  # thin edges
        ([0, out_rows // 2, out_rows], [0, 5, 6, height]),
        ([0, out_rows], [0, height]),
    ]:
        check_bands(x, w, geom, rng, sorted(set(out_cuts)), in_cuts)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convolutions(), st.data())
def test_any_banding_stacks_to_the_whole(case, data):
    x, w, geom, rng = case
    height = x.shape[2]
    out_rows = geom.output_size(height, x.shape[3])[0]

    def cuts(total):
        inner = data.draw(st.sets(st.integers(1, total - 1), max_size=4)) if total > 1 else set()
        return [0, *sorted(inner), total]

    check_bands(x, w, geom, rng, cuts(out_rows), cuts(height))


def test_forward_band_regions():
    """The rule of the module docstring, worked for a 3-row kernel, padding 1, 8 rows."""
    geom = ConvGeometry((3, 3), padding=(1, 1, 2, 2))
    assert geom.forward_band(8, 0, 3) == (0, 4, ConvGeometry((3, 3), padding=(1, 0, 2, 2)))
    assert geom.forward_band(8, 3, 5) == (2, 6, ConvGeometry((3, 3), padding=(0, 0, 2, 2)))
    assert geom.forward_band(8, 5, 8) == (4, 8, ConvGeometry((3, 3), padding=(0, 1, 2, 2)))
    assert geom.forward_band(8, 0, 8) == (0, 8, geom)


def test_a_band_of_padding_only_gets_an_empty_region():
    """Padding wider than the kernel: the first and last output rows read only zeros."""
    rng = np.random.default_rng(4)
    geom = ConvGeometry((2, 2), padding=(3, 3, 0, 0))
    x, w = inputs(rng, 1, 2, 4, 5, (3, 2, 2, 2), np.float64)
    out_rows = geom.output_size(4, 5)[0]
    for o0, o1 in [(0, 1), (out_rows - 1, out_rows)]:
        r0, r1, region = geom.forward_band(4, o0, o1)
        assert r0 == r1
        assert region.padding[0] + region.padding[1] == geom.dilation[0] * (geom.kernel[0] - 1) + 1
        assert not conv_forward(x[:, :, r0:r1], w, region).any()
    np.testing.assert_allclose(
        forward_in_bands(x, w, geom, list(range(out_rows + 1))),
        conv_forward(x, w, geom),
        rtol=1e-12,
        atol=0,
    )


def test_grad_input_band_no_output_reaches_is_zero():
    """1x1 stride 2 over 7 rows: row 6 is read, and the band [5, 6) by no output at all."""
    geom = ConvGeometry((1, 1), stride=(2, 2))
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 2, 1, 1))
    assert geom.grad_output_rows(7, 5, 6) == (3, 3)
    dx = conv_grad_input(np.zeros((2, 3, 0, 4)), w, geom, input_size=(7, 7), oh_lo=3, rows=(5, 6))
    assert dx.shape == (2, 2, 1, 7)
    assert not dx.any()


@pytest.mark.parametrize(
    ("stride", "dy_size", "reach"),
    [(2, (5, 4), (2, 4)), (1, (10, 8), (3, 8))],  # the fold; the forward convolution of dy
    ids=["stride 2", "stride 1"],
)
def test_grad_input_takes_extra_grad_output_rows(stride, dy_size, reach):
    """Rows beyond those that reach the band contribute nothing to it."""
    rng = np.random.default_rng(6)
    geom = ConvGeometry((3, 3), stride=(stride, stride), padding=(1, 1, 1, 1))
    w = rng.standard_normal((4, 3, 3, 3))
    dy = rng.standard_normal((2, 4, *dy_size))
    whole = conv_grad_input(dy, w, geom, input_size=(10, 8))
    lo, hi = geom.grad_output_rows(10, 4, 7)
    assert (lo, hi) == reach
    exact = conv_grad_input(dy[:, :, lo:hi], w, geom, input_size=(10, 8), oh_lo=lo, rows=(4, 7))
    extra = conv_grad_input(dy, w, geom, input_size=(10, 8), rows=(4, 7))
    np.testing.assert_allclose(exact, whole[:, :, 4:7], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(extra, whole[:, :, 4:7], rtol=1e-12, atol=1e-12)


# --- out, flops, no torch on devices ------------------------------------------------------


def test_results_go_into_out():
    rng = np.random.default_rng(7)
    for groups in (1, 3):  # the GEMM path and the depthwise one
        geom = ConvGeometry((3, 3), padding=(1, 1, 1, 1), groups=groups)
        x, w = inputs(rng, 2, 3, 5, 5, (3, 3 // groups, 3, 3), np.float32)
        y = np.full((2, 3, 5, 5), np.nan, np.float32)
        assert conv_forward(x, w, geom, out=y) is y
        np.testing.assert_array_equal(y, conv_forward(x, w, geom))
        dx = np.full((2, 3, 2, 5), np.nan, np.float32)
        assert conv_grad_input(y, w, geom, input_size=(5, 5), rows=(1, 3), out=dx) is dx
        np.testing.assert_array_equal(dx, conv_grad_input(y, w, geom, input_size=(5, 5))[:, :, 1:3])
        dw = np.full(w.shape, np.nan, np.float32)
        assert conv_grad_weight(x, y, geom, out=dw) is dw
        np.testing.assert_array_equal(dw, conv_grad_weight(x, y, geom))


def test_results_go_into_a_strided_out():
    """A tile's output is a view of the job's (a band of rows, a block of channels): each
    path writes into it in place, what lies around it untouched."""
    rng = np.random.default_rng(9)
    for stride, groups in ((1, 1), (2, 1), (1, 3)):  # GEMM (grad input: forward, fold), depthwise
        geom = ConvGeometry((3, 3), (stride, stride), padding=(1, 1, 1, 1), groups=groups)
        x, w = inputs(rng, 2, 3, 5, 5, (3, 3 // groups, 3, 3), np.float32)
        oh, ow = geom.output_size(5, 5)
        whole = np.full((2, 3, oh + 4, ow), np.nan, np.float32)
        y = whole[:, :, 2 : 2 + oh]
        assert conv_forward(x, w, geom, out=y) is y
        np.testing.assert_array_equal(y, conv_forward(x, w, geom))
        assert np.isnan(whole[:, :, :2]).all() and np.isnan(whole[:, :, 2 + oh :]).all()
        dx = np.full((2, 3, 6, 5), np.nan, np.float32)[:, :, 1:3]
        assert conv_grad_input(y, w, geom, input_size=(5, 5), rows=(1, 3), out=dx) is dx
        np.testing.assert_array_equal(dx, conv_grad_input(y, w, geom, input_size=(5, 5))[:, :, 1:3])
        dw = np.full((3, 2 * w.shape[1], 3, 3), np.nan, np.float32)[:, : w.shape[1]]
        assert conv_grad_weight(x, y, geom, out=dw) is dw
        np.testing.assert_array_equal(dw, conv_grad_weight(x, y, geom))


def _read_only(shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, np.float32)
    out.flags.writeable = False
    return out


def test_threads_unfold_into_their_own_buffers():
    """Each thread unfolds into a buffer it keeps (grown for a larger convolution, reused
    for a smaller one): two threads computing different convolutions at once, larger and
    smaller in turn, each get torch's results (one buffer shared would mix them)."""
    rng = np.random.default_rng(11)
    cases = []
    for size, channels in ((40, 16), (20, 8), (56, 12), (12, 4)):
        geom = ConvGeometry((3, 3), padding=(1, 1, 1, 1))
        x, w = inputs(rng, 2, channels, size, size, (5, channels, 3, 3), np.float64)
        dy = rng.standard_normal((2, 5, size, size))
        cases.append((x, w, dy, geom, torch_reference(x, w, dy, geom)))

    def compute(order: list[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        got = []
        for i in order * 5:
            x, w, dy, geom, _ = cases[i]
            got.append((i, conv_forward(x, w, geom), conv_grad_weight(x, dy, geom)))
        return got

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(compute, order) for order in ([0, 1, 2, 3], [3, 2, 1, 0])]
        results = [r for run in runs for r in run.result()]
    for i, y, dw in results:
        *_, (want_y, _, want_dw) = cases[i]
        assert_matches(y, want_y, np.abs(want_y).max(), np.float64)
        assert_matches(dw, want_dw, np.abs(want_dw).max(), np.float64)


def test_flops_are_torchs_count():
    """torch's FLOP counter: forward and grad input, and grad weight (it ignores groups there)."""
    rng = np.random.default_rng(8)
    for groups in (1, 2):
        geom = ConvGeometry(
            (3, 2), stride=(2, 1), dilation=(2, 1), padding=(1, 1, 0, 0), groups=groups
        )
        x = torch.tensor(rng.standard_normal((2, 4, 9, 7)), requires_grad=True)
        w = torch.tensor(rng.standard_normal((6, 4 // groups, 3, 2)), requires_grad=True)
        args = {"stride": (2, 1), "padding": (1, 0), "dilation": (2, 1), "groups": groups}
        with FlopCounterMode(display=False) as forward:
            y = F.conv2d(x, w, **args)
        assert conv_flops(y.shape, w.shape) == forward.get_total_flops()
        with FlopCounterMode(display=False) as grad_input:
            torch.autograd.grad(y, [x], torch.ones_like(y), retain_graph=True)
        assert conv_flops(y.shape, w.shape) == grad_input.get_total_flops()
        if groups == 1:
            with FlopCounterMode(display=False) as grad_weight:
                torch.autograd.grad(y, [w], torch.ones_like(y))
            assert conv_flops(y.shape, w.shape) == grad_weight.get_total_flops()
        assert geom.output_size(9, 7) == tuple(y.shape[2:])


def test_devices_compute_without_torch():
    """A device has no torch: the kernels import and run with it unimportable."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from morphling.kernels import ConvGeometry, conv_forward\n"
        "from morphling.kernels import conv_grad_input, conv_grad_weight\n"
        "g = ConvGeometry((3, 3), padding=(1, 1, 1, 1))\n"
        "x = np.ones((1, 2, 4, 4), np.float32); w = np.ones((3, 2, 3, 3), np.float32)\n"
        "y = conv_forward(x, w, g)\n"
        "conv_grad_input(y, w, g, input_size=(4, 4)); conv_grad_weight(x, y, g)\n"
        "print(y[0, 0, 1, 1], 'torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["18.0", "False"]


# --- bad input ----------------------------------------------------------------------------

GEOM = ConvGeometry((3, 3), padding=(1, 1, 1, 1), groups=2)
X = np.zeros((2, 4, 6, 6), np.float32)
W = np.zeros((6, 2, 3, 3), np.float32)
DY = np.zeros((2, 6, 6, 6), np.float32)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kernel": (0, 3)}, r"kernel=\(0, 3\): expected 2 integers >= 1"),
        ({"kernel": (3, 3, 3)}, "kernel=.*expected 2 integers"),
        ({"kernel": (3, 3), "stride": (1, 0)}, r"stride=\(1, 0\)"),
        ({"kernel": (3, 3), "dilation": (1.0, 1)}, "dilation=.*integers"),
        ({"kernel": (3, 3), "padding": (1, 1)}, "padding=.*expected 4 integers >= 0"),
        ({"kernel": (3, 3), "padding": (1, -1, 0, 0)}, r"padding=\(1, -1, 0, 0\)"),
        ({"kernel": (3, 3), "groups": 0}, "groups=0: expected an integer >= 1"),
        ({"kernel": (3, 3), "groups": True}, "groups=True"),
        ({"kernel": "33"}, "kernel='33'"),
    ],
)
def test_bad_geometry(fields, message):
    with pytest.raises(ValueError, match=message):
        ConvGeometry(**fields)


def test_geometry_takes_lists_as_msgpack_gives_them():
    assert ConvGeometry([3, 3], [2, 1], [1, 1], [1, 0, 1, 1], np.int64(1)) == ConvGeometry(
        (3, 3), (2, 1), (1, 1), (1, 0, 1, 1), 1
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: conv_forward(X[0], W, GEOM), r"x: expected 4 dimensions .* shape \(4, 6, 6\)"),
        (lambda: conv_forward(X.tolist(), W, GEOM), "x: expected a numpy array, got list"),
        (lambda: conv_forward(X.astype(np.float16), W, GEOM), "x: dtype float16 is not supported"),
        (
            lambda: conv_forward(X, W.astype(np.float64), GEOM),
            "w: dtype float64 does not match x's float32",
        ),
        (lambda: conv_forward(X, W[:, :, :2], GEOM), r"w: kernel 2x3 does not match .* \(3, 3\)"),
        (lambda: conv_forward(X, W[:5], GEOM), "w: 5 output channels do not split into 2 groups"),
        (
            lambda: conv_forward(X[:, :3], W, GEOM),
            "x: 3 channels, but w's 2 per group × 2 groups read 4",
        ),
        (
            lambda: conv_forward(X[:, :, :1], W, ConvGeometry((3, 3), groups=2)),
            "padded input 1x6 is smaller than the dilated kernel 3x3",
        ),
        (
            lambda: conv_forward(X, W, GEOM, out=np.empty((2, 6, 6, 5), np.float32)),
            "out: expected a float32 array of shape",
        ),
        (
            lambda: conv_forward(X, W, GEOM, out=np.empty((2, 6, 6, 6))),
            "out: expected a float32 array",
        ),
        (lambda: conv_forward(X, W, GEOM, out=_read_only((2, 6, 6, 6))), "out: must be writable"),
        (lambda: conv_forward(X, W[:4], GEOM, out=X), "out: overlaps an input"),
        (
            lambda: conv_grad_input(DY[:, :, :, :5], W, GEOM, input_size=(6, 6)),
            r"dy: shape .* expected \[N, 6, R, 6\]",
        ),
        (lambda: conv_grad_input(DY[:, :4], W, GEOM, input_size=(6, 6)), "dy: shape"),
        (
            lambda: conv_grad_input(
                DY[:, :, 1:3], W, GEOM, input_size=(6, 6), oh_lo=1, rows=(1, 3)
            ),
            r"grad-output rows \[1, 3\) must lie in \[0, 6\) and cover \[0, 4\)",
        ),
        (
            lambda: conv_grad_input(DY, W, GEOM, input_size=(6, 6), oh_lo=1),
            r"grad-output rows \[1, 7\) must lie in \[0, 6\)",
        ),
        (
            lambda: conv_grad_input(DY, W, GEOM, input_size=(6, 6), rows=(3, 3)),
            r"input rows \[3, 3\) are not a band",
        ),
        (
            lambda: conv_grad_input(DY, W, GEOM, input_size=(6, 6), rows=(0, 7)),
            r"input rows \[0, 7\)",
        ),
        (lambda: conv_grad_weight(X, DY[:, :, :5], GEOM), r"dy: shape .* expected \[2, OC, 6, 6\]"),
        (lambda: conv_grad_weight(X[:1], DY, GEOM), "dy: shape"),
        (lambda: conv_grad_weight(X[:, :3], DY, GEOM), "x: 3 channels do not split into 2 groups"),
        (lambda: conv_grad_weight(X, DY[:, :5], GEOM), "dy: 5 channels do not split into 2 groups"),
        (lambda: GEOM.forward_band(6, 2, 7), r"output rows \[2, 7\) are not a band of \[0, 6\)"),
        (lambda: GEOM.output_size(-1, 6), "input size -1x6 is negative"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()

"""A real device agent computing CONV_TILEs sent by a hand-driven emulator on loopback.

The tiles are built as docs/PROTOCOL.md says (*Convolution tiles*), from the whole
convolution's geometry: a forward tile's input region and its padding from its output
rows, a grad_input tile's output-gradient rows from its input rows, a grad_weight tile's
channels. Its results are torch's products of the whole convolution, cut to the tile. A
tile that describes no convolution is refused with ERROR ``bad_tile`` naming the problem.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hand_driven import serve_agent
from morphling.kernels import ConvGeometry
from morphling.proxy.wire.messages import (
    ConvTile,
    Error,
    TileResult,
)

# The whole convolution: x [2, 4, 9, 7], w [6, 2, 3, 3] in 2 groups.
GEOM = ConvGeometry((3, 3), stride=(2, 1), dilation=(1, 2), padding=(1, 2, 0, 1), groups=2)
H, W = 9, 7


def operands() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 4, H, W))
    w = rng.standard_normal((6, 2, 3, 3))
    dy = rng.standard_normal((2, 6, *GEOM.output_size(H, W)))
    return x, w, dy


def torch_products(x: np.ndarray, w: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, ...]:
    """y, dx, dw of the whole convolution, by torch's autograd."""
    top, bottom, left, right = GEOM.padding
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    y = F.conv2d(
        F.pad(xt, (left, right, top, bottom)),
        wt,
        stride=GEOM.stride,
        dilation=GEOM.dilation,
        groups=GEOM.groups,
    )
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def tile(tile_id: int, kind: str, a: np.ndarray, b: np.ndarray, **fields: Any) -> ConvTile:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    geometry = {
        "kernel": list(GEOM.kernel),
        "stride": list(GEOM.stride),
        "dilation": list(GEOM.dilation),
        "padding": list(GEOM.padding),
        "groups": GEOM.groups,
    }
    return ConvTile(
        tile=tile_id,
        kind=kind,
        dtype=a.dtype.name,
        a_shape=list(a.shape),
        b_shape=list(b.shape),
        **{**geometry, **fields},
        segments=(a.reshape(-1), b.reshape(-1)),
    )


async def test_agent_computes_every_kind_of_conv_tile():
    x, w, dy = operands()
    y, dx, dw = torch_products(x, w, dy)
    # forward: output rows [1, 3), all channels; its region and padding by the band rule
    r0, r1, region = GEOM.forward_band(H, 1, 3)
    forward = tile(1, "forward", x[:, :, r0:r1], w, padding=list(region.padding))
    # grad_input: input rows [2, 6) of the second group's input channels [2, 4), from the
    # rows that reach them of the output channels reading them, [3, 6); the whole
    # convolution's padding; one group, so groups 1
    lo, hi = GEOM.grad_output_rows(H, 2, 6)
    grad_input = tile(
        2,
        "grad_input",
        dy[:, 3:6, lo:hi],
        w[3:6],
        groups=1,
        input_size=[H, W],
        oh_lo=lo,
        rows=[2, 6],
    )
    # grad_weight: output channels [0, 2) of group 0, its input channel 1: the weight
    # gradient's block [0:2, 1:2], summed over the batch and every position
    grad_weight = tile(3, "grad_weight", x[:, 1:2], dy[:, 0:2], groups=1)
    hello, answers = await serve_agent([forward, grad_input, grad_weight])
    assert hello.caps.get("conv") == 1
    want = {1: y[:, :, 1:3], 2: dx[:, 2:4, 2:6], 3: dw[0:2, 1:2]}
    assert sorted(a.tile for a in answers) == [1, 2, 3]
    for answer in answers:
        assert isinstance(answer, TileResult) and not answer.in_place
        expected = want[answer.tile]
        got = np.frombuffer(answer.segments[0], np.float64)
        assert got.size == math.prod(expected.shape), answer.tile
        np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"kind": "sideways"}, "CONV_TILE 1: kind 'sideways' is not one of"),
        ({"a_shape": [2, 4, 4, 7]}, "CONV_TILE 1: operand a: 2240 bytes, but a_shape [2, 4, 4, 7]"),
        ({"stride": [0, 1]}, "CONV_TILE 1: ConvGeometry: stride=[0, 1]: expected 2 integers"),
        ({"dtype": "int8"}, "CONV_TILE 1: dtype 'int8' is not supported"),
        ({"groups": 3}, "CONV_TILE 1: x: 4 channels, but w's 2 per group × 3 groups read 6"),
    ],
    ids=["kind", "segment", "stride", "dtype", "groups"],
)
async def test_agent_refuses_a_conv_tile_that_describes_no_convolution(change, named):
    x, w, _ = operands()
    r0, r1, region = GEOM.forward_band(H, 1, 3)
    good = tile(1, "forward", x[:, :, r0:r1], w, padding=list(region.padding))
    fields = {name: getattr(good, name) for name in good.FIELDS}
    bad = ConvTile(**{**fields, **change}, segments=good.segments)
    _, answers = await serve_agent([bad])
    (error,) = answers
    assert isinstance(error, Error) and error.code == "bad_tile", error
    assert named in error.reason, error.reason

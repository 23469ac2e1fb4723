"""Timing convolutions with the real kernels (``kernels.conv``), as a device computes its tiles.

The same interleaved rounds on fresh buffers as GEMMs (``timing.measure_calls``): each call's
operands are laid out contiguous in fresh pages, as a device gets them off the wire, and its
output is written into a fresh buffer too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from morphling.kernels.conv import (
    ConvGeometry,
    conv_forward,
    conv_grad_input,
    conv_grad_weight,
)
from numpy.typing import NDArray

from ..models.conv_shape import ConvShape
from .timing import Call, Progress, fresh_pages, measure_calls

Dims = tuple[int, ...]
# The first operand (x, or dy for the input gradient), the second (w, or dy for the weight
# gradient) and the output: byte buffers a call's arrays are laid out in.
ConvBuffers = tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8]]


def geometry(shape: ConvShape) -> ConvGeometry:
    """The kernels' geometry of ``shape``."""
    return ConvGeometry(shape.kernel, shape.stride, shape.dilation, shape.padding, shape.groups)


def operand_dims(shape: ConvShape) -> tuple[Dims, Dims, Dims]:
    """The dimensions of the first operand, the second and the output of ``shape``'s call."""
    n, c, h, w, oc = shape.n, shape.c, shape.h, shape.w, shape.oc
    weight = (oc, c // shape.groups, *shape.kernel)
    out_h, out_w = shape.out_size
    if shape.kind == "forward":
        return (n, c, h, w), weight, (n, oc, out_h, out_w)
    if shape.kind == "grad_input":
        return (n, oc, shape.dy_rows, out_w), weight, (n, c, shape.rows, w)
    return (n, c, h, w), (n, oc, out_h, out_w), weight


def band_placement(shape: ConvShape) -> tuple[int, int]:
    """(i0, oh_lo): a band of ``shape.rows`` input rows that needs all the ``shape.dy_rows``
    grad-output rows given, as the emulator's tiles do (the first such band; else the first
    they cover); ValueError if there is none."""
    geom, out_h = geometry(shape), shape.out_size[0]
    covered = None
    for i0 in range(shape.h - shape.rows + 1):
        lo, hi = geom.grad_output_rows(shape.h, i0, i0 + shape.rows)
        if hi - lo == shape.dy_rows:
            return i0, lo
        if covered is None and lo < hi < lo + shape.dy_rows:
            covered = i0, min(lo, out_h - shape.dy_rows)
    if covered is not None:
        return covered
    raise ValueError(f"no band of {shape.rows} input rows is reached by {shape.dy_rows} dy rows")


def fresh_conv_buffers(shapes: Sequence[ConvShape]) -> ConvBuffers:
    """Fresh buffers for the operands and output, each large enough for every shape."""
    sizes = [[math.prod(d) * s.itemsize for d in operand_dims(s)] for s in shapes]
    first, second, out = (max(column) for column in zip(*sizes, strict=True))
    return fresh_pages(first), fresh_pages(second), fresh_pages(out)


def _view(buffer: NDArray[np.uint8], dims: Dims, dtype: str) -> NDArray[Any]:
    return np.ndarray(dims, dtype, buffer=buffer)


def conv_call(shape: ConvShape, buffers: ConvBuffers) -> Call:
    """A zero-argument function that makes ``shape``'s call on ``buffers``."""
    geom = geometry(shape)
    first, second, out = (
        _view(buffer, dims, shape.dtype)
        for buffer, dims in zip(buffers, operand_dims(shape), strict=True)
    )
    if shape.kind == "forward":
        return lambda: conv_forward(first, second, geom, out=out)
    if shape.kind == "grad_input":
        i0, oh_lo = band_placement(shape)
        rows = (i0, i0 + shape.rows)
        size = (shape.h, shape.w)
        return lambda: conv_grad_input(
            first, second, geom, input_size=size, oh_lo=oh_lo, rows=rows, out=out
        )
    return lambda: conv_grad_weight(first, second, geom, out=out)


def measure_conv(
    shapes: Sequence[ConvShape],
    *,
    threads: int = 1,
    rounds: int = 5,
    min_batch_s: float = 2e-4,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[tuple[ConvShape, float]]:
    """Seconds per call of each shape, timed with the real kernels (``measure_calls``)."""
    return measure_calls(
        shapes,
        fresh_conv_buffers,
        conv_call,
        threads=threads,
        rounds=rounds,
        min_batch_s=min_batch_s,
        seed=seed,
        progress=progress,
    )

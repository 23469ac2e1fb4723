"""The convolution calls a profile is measured on: a grid to fit, a held-out set to score it.

Both are drawn from the layers of common CNNs and 1-D convolutional models — 3×3 and 1×1
convolutions (strided too), 5×5 and 7×7 stems, dilated, grouped (ResNeXt) and depthwise
(MobileNet, ConvNeXt, Conformer) layers, 1-D convolutions over sequences — as a device gets
them: a forward tile is a band of output rows (its input region and padding cut as
``ConvGeometry.forward_band`` cuts them), a grad-input tile a band of input rows with the
grad-output rows that reach it, a grad-weight tile the whole input. Sizes on the grid are
snapped to a few levels per octave; held-out sizes lie between them, so a score on the
held-out set says how the fit predicts calls it never saw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from morphling.kernels.conv import ConvGeometry

from ..models.conv_shape import KINDS, ConvShape
from .shapes import MN_LEVELS

# Layer families: (name, share). Each draws its kernel, stride, dilation and groups below.
FAMILIES = (
    ("3x3", 0.22),
    ("1x1", 0.14),
    ("stem", 0.05),
    ("dilated", 0.06),
    ("grouped", 0.1),
    ("depthwise", 0.18),
    ("1d", 0.25),
)
FLOAT64_SHARE = 0.25
SAME_PADDING_SHARE = 0.75  # the rest are 'valid' (unpadded)
WHOLE_SHARE = 0.35  # tiles that are the whole convolution; the rest are bands of rows
BATCH_RANGE = (1, 32)
CHANNEL_RANGE = (8, 512)
# Channel counts of real networks are multiples of 8 (stems' 1-4 input channels and
# grouped convolutions' few channels per group aside): the grid's are these, two per
# octave; held-out counts are the multiples of 8 between them.
CHANNEL_LEVELS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
GROUP_CHANNELS = (2, 4, 8, 16, 32, 64)  # channels per group of a grouped convolution
IMAGE_RANGE = (4, 128)  # height = width of a 2-D input
SEQUENCE_RANGE = (16, 4096)  # length of a 1-D input
# A device's tile: at most this many FLOPs and elements in any operand or unfolded copy.
MAX_FLOPS = 3e8
MAX_ELEMENTS = 1 << 22
LEVELS = MN_LEVELS  # four per octave, as for GEMM sizes; every size up to 8 is one
Padding = tuple[int, int, int, int]  # top, bottom, left, right


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


class _Sizes:
    """Draws sizes: snapped to ``LEVELS`` on the grid; held out, off them where a size can
    be (from 9 up), and always for the input's width (``off``), so no held-out call is on
    the grid."""

    def __init__(self, rng: np.random.Generator, grid: bool) -> None:
        self.rng, self.grid = rng, grid

    def __call__(self, lo: int, hi: int, *, off: bool = False) -> int:
        while True:
            value = _log_uniform(self.rng, lo, hi)
            if self.grid:
                return min(LEVELS, key=lambda level: abs(math.log(level / value)))
            if value not in LEVELS or (value < 9 and not off):
                return value

    def channels(self, lo: int, hi: int) -> int:
        """A multiple of 8: on ``CHANNEL_LEVELS`` on the grid, between them held out."""
        while True:
            value = 8 * max(round(_log_uniform(self.rng, lo, hi) / 8), 1)
            if self.grid:
                return min(CHANNEL_LEVELS, key=lambda level: abs(math.log(level / value)))
            if value not in CHANNEL_LEVELS:
                return value


@dataclass(frozen=True, slots=True)
class _Layer:
    """A convolution layer: its geometry over the whole input, channels and input size."""

    geom: ConvGeometry
    c: int
    oc: int
    height: int
    width: int


def _layer(rng: np.random.Generator, size: _Sizes) -> _Layer:
    """A layer of one of the ``FAMILIES``, 'same' padded (or not) and of a drawn size."""
    names = [name for name, _ in FAMILIES]
    family = names[rng.choice(len(FAMILIES), p=[share for _, share in FAMILIES])]
    k, stride, dilation, groups = 3, 1, 1, 1
    c, oc = size.channels(*CHANNEL_RANGE), size.channels(*CHANNEL_RANGE)
    if family in ("3x3", "1x1"):
        k = 3 if family == "3x3" else 1
        stride = 2 if rng.random() < 0.2 else 1
    elif family == "stem":
        k, stride = int(rng.choice([5, 7])), int(rng.choice([1, 2]))
        c = int(rng.choice([1, 3, 4]))
    elif family == "dilated":
        dilation = int(rng.choice([2, 4]))
    elif family == "grouped":
        k, stride = (3 if rng.random() < 0.8 else 1), (2 if rng.random() < 0.2 else 1)
        groups = int(rng.choice([2, 4, 8, 32]))
        c, oc = (groups * int(rng.choice(GROUP_CHANNELS)) for _ in range(2))
    elif family == "depthwise":
        k, stride = int(rng.choice([3, 5, 7])), (2 if rng.random() < 0.25 else 1)
        c = groups = size.channels(8, 1024)
        oc = c * (2 if rng.random() < 0.2 else 1)
    if family == "1d":
        k = int(rng.choice([1, 3, 5, 7, 11, 31]))
        stride = int(rng.choice([1, 2, 4])) if k > 1 else 1
        dilation = int(rng.choice([1, 2, 4])) if k > 1 and stride == 1 else 1
        if k > 1 and rng.random() < 0.3:
            oc = groups = c
        kernel, strides, dilations = (1, k), (1, stride), (1, dilation)
        height, width = 1, size(*SEQUENCE_RANGE, off=True)
    else:
        kernel, strides, dilations = (k, k), (stride, stride), (dilation, dilation)
        height = width = size(*IMAGE_RANGE, off=True)
    same = [
        d * (kk - 1) // 2 if rng.random() < SAME_PADDING_SHARE else 0
        for d, kk in zip(dilations, kernel, strict=True)
    ]
    padding = (same[0], same[0], same[1], same[1])
    return _Layer(ConvGeometry(kernel, strides, dilations, padding, groups), c, oc, height, width)


def _draw(rng: np.random.Generator, grid: bool) -> ConvShape | None:
    """One call of interest: a whole layer's or a band's; None when the draw is too large
    or has no work."""
    size = _Sizes(rng, grid)
    layer = _layer(rng, size)
    geom, height = layer.geom, layer.height
    try:
        out_h, out_w = geom.output_size(height, layer.width)
    except ValueError:  # the input is smaller than the dilated kernel
        return None
    n = size(*BATCH_RANGE)
    dtype = "float64" if rng.random() < FLOAT64_SHARE else "float32"
    kind = KINDS[int(rng.integers(len(KINDS)))]

    def call(h: int, padding: Padding, rows: int = 0, dy_rows: int = 0) -> ConvShape:
        return ConvShape(
            kind,
            n,
            layer.c,
            h,
            layer.width,
            layer.oc,
            geom.kernel,
            geom.stride,
            geom.dilation,
            padding,
            geom.groups,
            dtype,
            rows,
            dy_rows,
        )

    whole = rng.random() < WHOLE_SHARE
    if kind == "forward":
        o0, o1 = (0, out_h) if whole else _band(rng, size, out_h)
        r0, r1, region = geom.forward_band(height, o0, o1)
        shape = call(r1 - r0, region.padding)
    elif kind == "grad_input":
        i0, i1 = (0, height) if whole else _band(rng, size, height)
        lo, hi = geom.grad_output_rows(height, i0, i1)
        if lo == hi:  # no grad-output row reaches the band: nothing to compute
            return None
        shape = call(height, geom.padding, rows=i1 - i0, dy_rows=hi - lo)
    else:
        shape = call(height, geom.padding)
    unfolded = n * layer.c * shape.kernel[0] * shape.kernel[1] * out_h * out_w
    largest = max(n * layer.c * height * layer.width, n * layer.oc * out_h * out_w, unfolded)
    if shape.flops > MAX_FLOPS or largest > MAX_ELEMENTS:
        return None
    return shape


def _band(rng: np.random.Generator, size: _Sizes, rows: int) -> tuple[int, int]:
    """A band of ``rows``: its height drawn like other sizes, its start uniform."""
    height = min(size(1, rows) if rows > 1 else 1, rows)
    start = int(rng.integers(0, rows - height + 1))
    return start, start + height


def _distinct(count: int, seed: int, grid: bool) -> list[ConvShape]:
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = np.random.default_rng(seed)
    shapes: dict[ConvShape, None] = {}
    while len(shapes) < count:
        shape = _draw(rng, grid)
        if shape is not None:
            shapes[shape] = None
    return list(shapes)


def conv_grid_shapes(count: int, *, seed: int = 0) -> list[ConvShape]:
    """``count`` distinct calls of interest, sizes snapped to the grid levels."""
    return _distinct(count, seed, grid=True)


def conv_heldout_shapes(count: int, *, seed: int = 1) -> list[ConvShape]:
    """``count`` distinct calls from the same distribution, sizes off the grid levels."""
    return _distinct(count, seed, grid=False)


def describe(shapes: Sequence[ConvShape]) -> dict[str, int]:
    """How many calls of each kind (for the log and the provenance)."""
    return {kind: sum(s.kind == kind for s in shapes) for kind in KINDS}

"""Cut a convolution's product into tiles, and find the operands each tile needs.

A CONV (``Conv`` message) names a 2-D convolution's shapes and geometry and carries its two
operands, contiguous. ``make_conv_task`` checks them against each other (refusing, naming
the field, what does not fit) and ``ConvTask.tiles`` cuts the product, in
``morphling.kernels.conv``'s geometry:

- forward: y [N, OC, OH, OW] into output-channel blocks × output-row bands (all N, all
  columns). A tile gets its weight block and, of the input channels its block reads, the
  input rows its band reads, halo included (``ConvGeometry.forward_band``): links carry
  activations, never the unfolded matrix;
- grad_input: dx [N, C, H, W] into input-channel blocks × input-row bands. A tile gets the
  output-gradient rows that reach its band (``ConvGeometry.grad_output_rows``) of the output
  channels that read its channels, and their weights;
- grad_weight: dw [OC, C/groups, kh, kw] into output-channel × input-channel blocks. A tile
  gets those channels of the whole input and output gradient and reduces over the batch and
  every position itself: no tile's result is summed with another's, so the result does not
  depend on which device computed what.

A block's channels are whole groups or lie inside one group (a depthwise convolution's
are whole groups). Tiles hold about block² outputs, as a GEMM's do (grad_weight: up to
block output channels × block unfolded columns, as its implicit GEMM's tile), or one row
of their channels where that is more. A strided grad_input off the depthwise path folds:
its tile computes the whole of every grad-output row that reaches its band, so its band has
at least twice the kernel's halo (dh·(kh − 1)) rows, and at most a third of that work falls
outside it (with bands of one row, a 3×3 kernel's tile would compute three times its
share); every other tile computes its share alone. The block doubles until the convolution
has at most ``max_job_tiles`` tiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple, cast

import numpy as np
from morphling.devices.models.conv_shape import ConvShape
from morphling.kernels.conv import ConvGeometry
from morphling.proxy.shm.handover import JobOperands, Writers
from morphling.proxy.vtime.eventlog import conv_op
from morphling.proxy.vtime.memory import Key
from morphling.proxy.vtime.work import implicit_gemm
from morphling.proxy.wire.messages import CONV_KINDS, GEMM_DTYPES, Conv
from morphling.proxy.wire.operands import HANDED, IN_FRAME, Location

from .partition import GemmTask, TileTask, output, taken
from .task import (
    GemmError,
    Task,
    TaskTile,
    address,
    carries_nothing,
    panel_names,
    tile_ids,
    unsent,
)

# Each kind's two operands, in segment order, and its product.
OPERANDS = {
    "forward": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("input", "grad_output"),
}
PRODUCT = {"forward": "output", "grad_input": "input", "grad_weight": "weight"}
_LAYOUTS = {  # how each array's dimensions are named in refusals
    "input": "[N, C, H, W]",
    "weight": "[OC, C/groups, kh, kw]",
    "grad_output": "[N, OC, OH, OW]",
}

Shape4 = tuple[int, int, int, int]
ChannelBlock = tuple[int, int, int]  # first channel, end, how many groups it spans


class Header(NamedTuple):
    """A convolution as one GEMM (its implicit GEMM), as the event log records it."""

    m: int
    n: int
    k: int
    batch: int
    ta: bool
    tb: bool
    dtype: str


@dataclass(frozen=True)
class ConvOperand:
    """One operand of a convolution tile: a view of the request's array, sent contiguous,
    which is a ``panel`` of ``task`` (never a block of the shared weights)."""

    array: np.ndarray
    task: Task = field(repr=False, compare=False)
    whole: np.ndarray = field(repr=False, compare=False)  # the request's array it is a view of
    offset = None
    version = 0
    region = None  # (a convolution's operand lies within no other)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def sent_ld(self) -> int:
        return int(self.array.shape[-1])

    @cached_property
    def contiguous(self) -> np.ndarray:
        """The bytes it is sent as."""
        return np.ascontiguousarray(self.array)

    @cached_property
    def panel(self) -> int:
        """Its panel id: where it lies in the request's array, whose bytes are hashed once
        for all its tiles (only residency asks), never a copy of each view to hash."""
        view, whole = self.array, self.whole
        start = address(whole)
        where = (start, *whole.shape, *whole.strides)
        matrix = self.task.named(where, lambda: np.ascontiguousarray(whole))
        return panel_names.view(matrix, address(view) - start, view.shape, view.strides)

    @property
    def key(self) -> Key:
        return self.panel


@dataclass(eq=False)
class ConvTileTask(TaskTile):
    """One block of a convolution's product, ``out[out_index]``: its operands ``a`` and
    ``b`` (views of the request's), the geometry its CONV_TILE carries (``padding``,
    ``groups``; grad_input: the dy rows' first ``oh_lo`` and its ``rows``) and what it
    computes (``conv``, which the clock prices)."""

    gemm: ConvTask
    out_index: tuple[slice, ...]
    out_shape: tuple[int, ...]
    a: np.ndarray
    b: np.ndarray
    padding: tuple[int, int, int, int]
    groups: int
    conv: ConvShape
    oh_lo: int = 0
    rows: tuple[int, int] = (0, 0)
    _operands: tuple[ConvOperand, ConvOperand] | None = field(default=None, repr=False)

    @property
    def index(self) -> tuple[int | slice, ...]:
        return self.out_index

    @property
    def shape(self) -> tuple[int, ...]:
        return self.out_shape

    @property
    def geometry(self) -> ConvGeometry:
        """The convolution's geometry with the tile's padding and groups, as its device
        computes it."""
        return self.gemm.tile_geometry(self.padding, self.groups)

    def operands(self) -> tuple[ConvOperand, ConvOperand]:
        """Its two operands, each a panel: the tiles of one output-channel
        block share their weight block, those of one row band their input region."""
        if self._operands is None:
            self._operands = (
                ConvOperand(self.a, self.gemm, self.gemm.a),
                ConvOperand(self.b, self.gemm, self.gemm.b),
            )
        return self._operands


AnyTile = TileTask | ConvTileTask  # every tile the emulator sends


@dataclass(eq=False, kw_only=True)
class ConvTask(Task):
    """A validated convolution: its operands (``a``, ``b``: the segments, shaped), its
    geometry and shapes, and its product (``out``)."""

    request: Conv
    a: np.ndarray
    b: np.ndarray
    geometry: ConvGeometry
    input_shape: Shape4
    weight_shape: Shape4
    output_shape: Shape4  # y's (and dy's)
    # its tiles' geometries: few differ (the bands at the edges), and each checks every field
    _geometries: dict[tuple[tuple[int, int, int, int], int], ConvGeometry] = field(
        default_factory=dict, repr=False
    )
    # its tiles' channel blocks within a group (grad_weight: of each group's input channels),
    # which the screen sums over (``freivalds.ConvScreen``), once cut
    screen_pieces: tuple[tuple[int, int], ...] = ()

    def tile_geometry(self, padding: tuple[int, int, int, int], groups: int) -> ConvGeometry:
        """The geometry with a tile's ``padding`` and ``groups``."""
        geom = self._geometries.get((padding, groups))
        if geom is None:
            geom = replace(self.geometry, padding=padding, groups=groups)
            self._geometries[padding, groups] = geom
        return geom

    @property
    def op(self) -> str:
        return conv_op(self.request.kind)

    @property
    def header(self) -> Header:
        """The whole convolution's implicit GEMM."""
        n, c, h, _ = self.input_shape
        oc, oh = self.output_shape[1], self.output_shape[2]
        rows = (h, oh) if self.request.kind == "grad_input" else (0, 0)
        whole = self._work(n, c, oc, self.geometry.groups, h, self.geometry.padding, rows)
        g = implicit_gemm(whole)
        return Header(g.m, g.n, g.k, 1, g.ta, g.tb, g.dtype)

    def tiles(self, block: int, limit: int) -> list[ConvTileTask]:
        """The tiles (see the module docstring), from ``block`` doubled until at most
        ``limit`` of them."""
        while True:
            firsts, seconds = self._layout(block)
            if sum(len(seconds(first)) for first in firsts) <= limit:
                break
            block *= 2
        make = {"forward": self._forward, "grad_input": self._grad_input}.get(
            self.request.kind, self._grad_weight
        )
        tiles = [make(first, second) for first in firsts for second in seconds(first)]
        self.remaining = len(tiles)
        if self.request.kind == "grad_weight":
            self.screen_pieces = tuple(seconds(firsts[0]))
        else:
            per = firsts[-1][1] // self.geometry.groups  # (the last block ends the channels)
            self.screen_pieces = tuple((lo, min(hi, per)) for lo, hi, _ in firsts if lo < per)
        return tiles

    def _layout(
        self, block: int
    ) -> tuple[list[ChannelBlock], Callable[[ChannelBlock], list[tuple[int, int]]]]:
        """The channel blocks, and for each the blocks of the second axis (row bands;
        grad_weight: the input channels of its groups)."""
        n, c, h, w = self.input_shape
        oc, per_group, kh, kw = self.weight_shape
        groups, oh, ow = self.geometry.groups, self.output_shape[2], self.output_shape[3]
        target, kind = block * block, self.request.kind
        if kind == "grad_weight":
            firsts = _channel_blocks(oc, groups, block)
            width = max(1, block // (kh * kw))
            split = _spans(per_group, width)
            return firsts, lambda first: split if first[2] == 1 else [(0, per_group)]
        total, rows, cols = (oc, oh, ow) if kind == "forward" else (c, h, w)
        firsts = _channel_blocks(total, groups, block)
        widest = max(hi - lo for lo, hi, _ in firsts)
        folds = kind == "grad_input" and self.geometry.stride != (1, 1) and per_group > 1
        least = 2 * self.geometry.dilation[0] * (kh - 1) if folds else 1
        bands = _spans(rows, max(1, least, target // (widest * n * cols)))
        return firsts, lambda first: bands

    def _work(
        self,
        batch: int,
        channels: int,
        out_channels: int,
        groups: int,
        height: int,
        padding: tuple[int, int, int, int],
        rows: tuple[int, int] = (0, 0),
    ) -> ConvShape:
        """What a tile's call computes, as the device's convolution model prices it: over
        ``height`` input rows (forward: its region's, with the region's padding; else the
        whole input's); grad_input: ``rows`` = (its band's rows, the dy rows it gets)."""
        geom = self.geometry
        return ConvShape(
            self.request.kind,
            batch,
            channels,
            height,
            self.input_shape[3],
            out_channels,
            geom.kernel,
            geom.stride,
            geom.dilation,
            padding,
            groups,
            self.request.dtype,
            *rows,
        )

    def _forward(self, block: ChannelBlock, band: tuple[int, int]) -> ConvTileTask:
        (o0, o1, groups), (p0, p1) = block, band
        n, _, height, _ = self.input_shape
        oc_per, c_per = self.weight_shape[0] // self.geometry.groups, self.weight_shape[1]
        c0 = o0 // oc_per * c_per  # the input channels its output channels read
        c1 = c0 + groups * c_per
        r0, r1, region = self.geometry.forward_band(height, p0, p1)
        ow = self.output_shape[3]
        conv = self._work(n, c1 - c0, o1 - o0, groups, r1 - r0, region.padding)
        return ConvTileTask(
            next(tile_ids),
            self,
            (slice(None), slice(o0, o1), slice(p0, p1), slice(None)),
            (n, o1 - o0, p1 - p0, ow),
            self.a[:, c0:c1, r0:r1],
            self.b[o0:o1],
            region.padding,
            groups,
            conv,
        )

    def _grad_input(self, block: ChannelBlock, band: tuple[int, int]) -> ConvTileTask:
        (c0, c1, groups), (i0, i1) = block, band
        n, _, height, width = self.input_shape
        oc_per, c_per = self.weight_shape[0] // self.geometry.groups, self.weight_shape[1]
        first = c0 // c_per  # its first group
        oc0, oc1 = first * oc_per, (first + groups) * oc_per  # the output channels reading it
        w0 = c0 - first * c_per  # its channels among each group's
        w1 = w0 + (c1 - c0) if groups == 1 else c_per
        lo, hi = self.geometry.grad_output_rows(height, i0, i1)
        # (a band no output row reaches is priced as one dy row: its product is zeros)
        conv = self._work(
            n, c1 - c0, oc1 - oc0, groups, height, self.geometry.padding, (i1 - i0, max(hi - lo, 1))
        )
        return ConvTileTask(
            next(tile_ids),
            self,
            (slice(None), slice(c0, c1), slice(i0, i1), slice(None)),
            (n, c1 - c0, i1 - i0, width),
            self.a[:, oc0:oc1, lo:hi],
            self.b[oc0:oc1, w0:w1],
            self.geometry.padding,
            groups,
            conv,
            oh_lo=lo,
            rows=(i0, i1),
        )

    def _grad_weight(self, block: ChannelBlock, inputs: tuple[int, int]) -> ConvTileTask:
        (o0, o1, groups), (w0, w1) = block, inputs
        n, _, height, _ = self.input_shape
        oc_per, c_per, kh, kw = self.weight_shape
        oc_per //= self.geometry.groups
        c0 = o0 // oc_per * c_per + w0  # the input channels it reads
        c1 = c0 + (w1 - w0 if groups == 1 else groups * c_per)
        conv = self._work(n, c1 - c0, o1 - o0, groups, height, self.geometry.padding)
        return ConvTileTask(
            next(tile_ids),
            self,
            (slice(o0, o1), slice(w0, w1), slice(None), slice(None)),
            (o1 - o0, w1 - w0, kh, kw),
            self.a[:, c0:c1],
            self.b[:, o0:o1],
            self.geometry.padding,
            groups,
            conv,
        )


AnyTask = GemmTask | ConvTask  # every request the emulator serves


def _channel_blocks(total: int, groups: int, want: int) -> list[ChannelBlock]:
    """``total`` channels in ``groups`` groups, in blocks of about ``want``: whole groups
    when a group has no more, else pieces of one group."""
    per = total // groups
    if want >= per:
        spans = _spans(groups, want // per)
        return [(g0 * per, g1 * per, g1 - g0) for g0, g1 in spans]
    return [
        (g * per + c, g * per + min(c + want, per), 1)
        for g in range(groups)
        for c in range(0, per, want)
    ]


def _spans(total: int, width: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + width, total)) for lo in range(0, total, width)]


def make_conv_task(
    request: Conv,
    *,
    handed: JobOperands | None = None,
    memory: Callable[[int], memoryview] | None = None,
) -> ConvTask:
    """Validate a CONV request against its operands; the task and its product's memory.

    The operands are its segments, or the arrays a job in this process ``handed`` over
    (``local``, with C: then the product is written there). A product that goes back in
    RESULT gets ``memory(nbytes)`` (new memory without it), not initialised.
    """
    c = request
    if c.kind not in CONV_KINDS:
        raise GemmError(f"kind {c.kind!r} is not one of {', '.join(CONV_KINDS)}")
    if c.dtype not in GEMM_DTYPES:
        raise GemmError(f"dtype {c.dtype!r} is not supported ({', '.join(GEMM_DTYPES)})")
    shapes = {"input": _shape("input", c.input), "weight": _shape("weight", c.weight)}
    try:  # (ConvGeometry checks the lists' lengths and values)
        geom = ConvGeometry(
            shapes["weight"][2:],
            cast("tuple[int, int]", c.stride),
            cast("tuple[int, int]", c.dilation),
            cast("tuple[int, int, int, int]", c.padding),
            c.groups,
        )
    except ValueError as exc:
        raise GemmError(str(exc).removeprefix("ConvGeometry: ")) from None
    n, channels, height, width = shapes["input"]
    out_channels, per_group = shapes["weight"][:2]
    groups = geom.groups
    if channels % groups or out_channels % groups:
        raise GemmError(
            f"groups={groups} does not divide the input's {channels} channels and the "
            f"weight's {out_channels} output channels"
        )
    if per_group != channels // groups:
        raise GemmError(
            f"weight: {per_group} input channels per group, but the input's {channels} "
            f"channels in {groups} groups are {channels // groups} each"
        )
    try:
        oh, ow = geom.output_size(height, width)
    except ValueError as exc:
        raise GemmError(f"input {height}x{width}: {exc}") from None
    shapes["grad_output"] = (n, out_channels, oh, ow)
    product = PRODUCT[c.kind]
    out_shape = shapes["grad_output" if product == "output" else product]
    if c.by_rank:  # computed by the rank itself: priced, never sent
        carries_nothing(c, {"local": c.local})
        a, b = (unsent(shapes[name], c.dtype) for name in OPERANDS[c.kind])
        return _conv_task(c, geom, shapes, unsent(out_shape, c.dtype), a, b)
    mine = taken(handed) if c.local else None
    arrays = []
    for i, name in enumerate(OPERANDS[c.kind]):
        segment = c.segments[i]
        if mine is not None:
            if memoryview(segment).nbytes:
                raise GemmError(f"local: operand {name} was handed over, its segment must be empty")
            segment = mine.a if i == 0 else mine.b
        arrays.append(_operand(i, name, shapes[name], c.dtype, segment))
    out, writers = output(out_shape, c.dtype, mine, memory)
    c_at = HANDED if mine is not None else IN_FRAME
    return _conv_task(c, geom, shapes, out, arrays[0], arrays[1], c_at, writers)


def _conv_task(
    c: Conv, geom: ConvGeometry, shapes: dict[str, Shape4], out: np.ndarray, a: np.ndarray,
    b: np.ndarray, c_at: Location = IN_FRAME, writers: Writers | None = None,
) -> ConvTask:  # fmt: skip
    return ConvTask(
        request=c,
        out=out,
        c_at=c_at,
        writers=writers,
        a=a,
        b=b,
        geometry=geom,
        input_shape=shapes["input"],
        weight_shape=shapes["weight"],
        output_shape=shapes["grad_output"],
    )


def _shape(name: str, value: list[int]) -> Shape4:
    """A CONV's ``input`` or ``weight``: four integers >= 1."""
    if len(value) != 4 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise GemmError(f"{name}={value!r:.60}: expected 4 integers, {_LAYOUTS[name]}")
    if min(value) < 1:
        raise GemmError(f"{name}={value}: every dimension must be >= 1 ({_LAYOUTS[name]})")
    return value[0], value[1], value[2], value[3]


def _operand(index: int, name: str, shape: Shape4, dtype: str, segment: Any) -> np.ndarray:
    """Segment ``index``, the operand ``name`` of ``shape``, as an array."""
    need = math.prod(shape) * np.dtype(dtype).itemsize
    got = memoryview(segment).nbytes
    if got != need:
        raise GemmError(
            f"segment {index} ({name} {list(shape)} {_LAYOUTS[name]}, {dtype}, contiguous): "
            f"{got} bytes, expected {need}"
        )
    return np.frombuffer(segment, dtype).reshape(shape)

"""How long one convolution call takes on a device: measured shapes exactly, the rest fitted.

The virtual clock asks a device's ``ConvModel`` for every convolution tile, as it asks the
``ComputeModel`` for GEMM tiles: shapes the profiler measured come from an exact cache,
others from a model fitted to those measurements, or, for built-in profiles with only
published figures, from ``work_flops / flops`` (plus the kernel's memory traffic over
``mem_bw`` where one is given).

Why the fitted model has the form it has: it is a sum of work terms
(``work_terms``: ``t = Σ_j W_j · exp(X_j · θ_j)``), one or two per stage of the kernel
``kernels/conv.py`` runs, and each stage's work is what that stage does. A shape is priced
as the call the kernels make for it (``ConvShape.computed``: a stride-1 grad input is a
forward convolution of dy, after a copy of its weight with the taps flipped), so the
grad-input terms below are a strided one's:

- calls: a constant per call for each kind and path (general or depthwise), and per kernel
  tap on the general path, by kind: the strided grad input's fold makes numpy calls from
  Python per tap (the others none since the unfolding is C, so theirs fit to about 0);
- copies and adds — the unfolding (``c/unfold.c``: per tap and output row, a copy of the
  columns it reads in the input and zeros where it reads the padding), the output's or
  dy's channel-major transpose, the grad-input fold (one scatter-add per tap) and its
  zeroed buffers, the flipped weight — cost per element moved and per inner loop (the
  unfolding's: a row; numpy's: the innermost run its operands share, so 7-wide rows cost
  several times 56-wide ones for the same bytes). Element costs depend on dtype, a stride
  over the source (``sw > 1``) and where the pass's bytes fit in the cache hierarchy (a
  piecewise-linear efficiency in log bytes); a strided pass (the unfolding's reads, the
  fold's scatter-adds) moves the cache lines it touches, ``sw`` elements' bytes for each
  it uses, up to a line;
- the GEMM over the unfolded input, one per group: m = OC/g, n = N·OH·OW, k = (C/g)·kh·kw
  (forward), with the roles exchanged for the gradients. As in the GEMM model, compute
  counts the columns the micro-kernel really computes (panels of ``vector_bytes``, a
  remainder split into power-of-two kernels where ``popcount``), and efficiency depends on
  kind, dtype and log m, n, k; A, B and C traffic are bytes at an efficiency by kind and
  cache level. Convolution GEMMs are skinnier than the GEMM grid's tiles (n or k in the
  tens of thousands), so this model fits its own GEMM terms on convolution timings rather
  than borrow the GEMM model's;
- the depthwise path is one C call (``c/depthwise.c``) that walks the output (the input,
  for the grad input) row by row, and for each row the taps that reach the array, each tap
  a loop over the columns it reaches: work per row (growing with the kh tap rows it
  checks), per such loop, per multiply-add (a strided loop's at its own rate, growing with
  log sw, and the grad input's sums of a multiplier's channels at theirs; at an efficiency
  by where a row's working set fits), per
  element of the grad input's one strided scatter of a multiplier's summed channels, and
  per byte of the operands streamed once (at an efficiency by where they fit). Taps that
  fall in the padding are skipped, so the counts are the taps' reach, not kh·kw.

The panel width and whether the remainder splits are chosen by comparing fits on the
host's own measurements, as the GEMM model chooses its structure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .conv_shape import KINDS, SHAPE_FIELDS, ConvShape
from .strict_map import check_keys, floats, positive
from .work_terms import (
    ShapeModel,
    Terms,
    exact_from,
    hats,
    least_squares,
    one_hot,
    popcount,
    predict,
    theta_by_term,
)
from .work_terms import heldout_error as heldout_error  # scores a ConvModel too

_KIND = {kind: i for i, kind in enumerate(KINDS)}
_ROUTES = 2 * len(KINDS)  # kind × path (general, depthwise)

# Reference magnitudes: the work measures are scaled so that θ = 0 is a plausible CPU.
_REF_CALL_S = 1e-6
_REF_LOOP_S = 1e-8
_REF_FLOPS = 1e11
_REF_BYTES_PER_S = 1e10

# Knots of the piecewise-linear efficiencies: log2 of a pass's bytes (4 KiB to 16 MiB:
# L1, L2 and beyond), and log2 of the GEMM's m, n and k.
_MEM_KNOTS = np.array([12.0, 15.0, 18.0, 21.0, 24.0])
_M_KNOTS = np.array([0.0, 2.0, 4.0, 6.0, 8.0, 10.0])
_N_KNOTS = np.array([0.0, 4.0, 8.0, 12.0, 16.0])
_K_KNOTS = np.array([0.0, 3.0, 6.0, 9.0, 12.0, 15.0])
_MEM = len(_MEM_KNOTS)
_LINE_BYTES = 64  # a cache line, on the x86 and Arm cores boards and hosts have

# What the work terms count: θ fitted under one form prices another's terms wrongly, so a
# fitted model of another form is refused (5: a strided pass counts the cache lines it
# reads, and the depthwise rates grow with the stride and tell a multiplier's sums apart;
# 4: the channel-major copies of y and dy are C's,
# row by row, none for runs of one image, the kernels' revision 5; 3: a depthwise row's
# cost grows with its tap rows, and a grad-input band's pairs are bounded by its dy rows;
# 2: the unfolding's terms count the rows of ``c/unfold.c``, the kernels' revision 3; 1,
# the form of a table without ``form``: numpy's runs).
FORM = 5

# Parameter vector layout: term name → width (see ``_Form.terms`` for each design).
_TERMS = {
    "calls": _ROUTES,
    "taps": len(KINDS),
    "border_loops": 1,
    "border_bytes": 2 + _MEM,
    "unfold_loops": 3,
    "unfold_bytes": 3 + _MEM,
    "transpose_loops": 2,
    "transpose_bytes": 2 + _MEM,
    "gemm_compute": len(KINDS) * (2 + len(_M_KNOTS) + len(_N_KNOTS) + len(_K_KNOTS)),
    "gemm_a": len(KINDS) + 1 + _MEM,
    "gemm_b": len(KINDS) + 1 + _MEM,
    "gemm_c": len(KINDS) + 1 + _MEM,
    "zero_loops": 1,
    "zero_bytes": 2 + _MEM,
    "fold_loops": 3,
    "fold_bytes": 3 + _MEM,
    "flip_call": 1,
    "flip_loops": 1,
    "flip_bytes": 2 + _MEM,
    "direct_rows": len(KINDS) + 1,
    "direct_loops": 5 * len(KINDS),
    "direct_macs": 5 * len(KINDS) + _MEM,
    "direct_scatter": 3,
    "direct_bytes": len(KINDS) + 1 + _MEM,
}

VECTOR_BYTES_CANDIDATES = (16, 32, 64)
_SEARCH_SAMPLES = 800  # structure is chosen on at most this many samples
_SEARCH_NFEV = 60
_FINAL_NFEV = 400


class _Columns:
    """The fields of the calls the kernels make for the shapes (``ConvShape.computed``) as
    float arrays, so a design is built for thousands at once."""

    def __init__(self, shapes: Sequence[ConvShape]) -> None:
        computed = [s.computed() for s in shapes]
        rows = [
            (
                _KIND[s.kind],
                s is not asked,  # a grad input computed as a forward convolution
                s.direct,
                s.n,
                s.c,
                s.h,
                s.w,
                s.oc,
                *s.kernel,
                *s.stride,
                *s.dilation,
                *s.padding,
                s.groups,
                s.itemsize,
                s.rows,
                s.out_rows,
                *s.out_size,
            )
            for s, asked in zip(computed, shapes, strict=True)
        ]
        table = np.array(rows, dtype=np.float64).reshape(-1, 24)
        (
            self.kind,
            self.flipped,
            self.direct,
            self.n,
            self.c,
            self.h,
            self.w,
            self.oc,
            self.kh,
            self.kw,
            self.sh,
            self.sw,
            self.dh,
            self.dw,
            self.top,
            self.bottom,
            self.left,
            self.right,
            self.groups,
            self.item,
            self.rows,
            self.out_rows,
            self.out_h,
            self.out_w,
        ) = table.T
        self.size = table.shape[0]


def _log2(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.log2(np.maximum(x, 1.0))
    return out


def _mem(nbytes: np.ndarray) -> np.ndarray:
    return hats(_log2(nbytes), _MEM_KNOTS)


def _lines(x: _Columns) -> np.ndarray:
    """Bytes a pass along rows at column stride ``sw`` brings into cache per byte it uses:
    ``sw``, until the stride passes a cache line and every element costs a line."""
    out: np.ndarray = np.minimum(x.sw, _LINE_BYTES / x.item)
    return out


def _images_per_run(x: _Columns) -> np.ndarray:
    """Images the implicit GEMM unfolds at a time, as ``kernels/conv.py`` chooses them: an
    unfold of about 4 MiB, and at least 512 columns where there are images enough."""
    positions = x.out_rows * x.out_w
    per_image = x.c * x.kh * x.kw * positions * x.item
    least = np.ceil(512 / np.maximum(positions, 1))
    run = np.maximum(np.maximum(1.0, np.floor((4 << 20) / np.maximum(per_image, 1))), least)
    return np.minimum(run, x.n)


def _per_kind(by_kind: np.ndarray, *covariates: np.ndarray) -> np.ndarray:
    """Each covariate once per kind (zero in the other kinds' columns)."""
    stacked = np.stack(covariates, axis=1)
    out: np.ndarray = (by_kind[:, :, None] * stacked[:, None, :]).reshape(stacked.shape[0], -1)
    return out


class _Stages:
    """What each stage of the kernel does for each shape: the arrays the terms are built of.

    Each stage method gives its terms; in them ``x`` is the shapes' columns and ``c`` this.
    """

    def __init__(self, c: _Columns) -> None:
        self.cols = c
        self.ones = np.ones(c.size)
        kind = c.kind.astype(np.int64)
        self.forward, self.grad_input, self.grad_weight = (kind == i for i in range(len(KINDS)))
        self.direct = c.direct == 1
        self.general = ~self.direct
        self.fp64 = (c.item == 8).astype(np.float64)
        self.strided = (c.sw > 1).astype(np.float64)
        self.by_kind = one_hot(kind, len(KINDS))
        self.route = one_hot(kind * 2 + self.direct, _ROUTES)
        self.taps = c.kh * c.kw
        self.wp = c.left + c.w + c.right
        # The rows a tap touches are one run when nothing lies between them (stride 1 and
        # the full width) or there is one row.
        self.rows_run = (c.out_rows == 1) | ((c.sh == 1) & (c.sw == 1) & (c.out_w == self.wp))
        self.run = c.out_w * np.where(self.rows_run, c.out_rows, 1)
        self.side_pad = (c.left + c.right) > 0
        # Which taps reach the array, once for the stages that count them (``_row_taps``,
        # ``_column_taps``).
        self.row_taps = _row_taps(c)
        self.column_taps, self.pairs = _column_taps(c)

    def moved(self, flag: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Work of moving ``nbytes`` where ``flag`` holds."""
        return np.where(flag, nbytes, 0.0) / _REF_BYTES_PER_S

    def loops(self, flag: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Work of ``count`` inner loops where ``flag`` holds."""
        return np.where(flag, count, 0.0) * _REF_LOOP_S

    def efficiency(self, *covariates: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """A design: a constant, the covariates, and where ``nbytes`` fit in the caches."""
        return np.concatenate([np.stack([self.ones, *covariates], axis=1), _mem(nbytes)], axis=1)

    def calls(self) -> Terms:
        """A constant per call, by kind and path, and per tap on the general path, by kind."""
        return [
            (self.ones * _REF_CALL_S, self.route),
            (np.where(self.general, self.taps, 0.0) * _REF_CALL_S, self.by_kind),
        ]

    def border(self) -> Terms:
        """The unfolding's zeros (forward, grad weight): the positions that read the
        padding, zeroed as ``c/unfold.c`` walks each tap's output rows: a whole row where
        the tap's row is padding, else the columns either side (a memset each, however
        few)."""
        c, x = self, self.cols
        unfolds = c.general & ~c.grad_input
        rows, pairs = c.row_taps, c.pairs
        zeros = x.n * x.c * (c.taps * x.out_h * x.out_w - rows * pairs) * x.item
        loops = x.n * x.c * c.taps * x.out_h
        return [
            (c.loops(unfolds, loops), c.ones[:, None]),
            (c.moved(unfolds, zeros), c.efficiency(c.fp64, nbytes=zeros)),
        ]

    def unfold(self) -> Terms:
        """The unfolding (general path, forward and grad weight): ``c/unfold.c`` copies,
        for each tap row inside the input and each output row, the columns the tap reaches
        (a memcpy, or a strided gather where ``sw > 1``)."""
        c, x = self, self.cols
        unfolds = c.general & ~c.grad_input
        rows = c.row_taps
        elements = x.n * x.c * rows * c.pairs
        runs = x.n * x.c * rows * c.column_taps
        return [
            (c.loops(unfolds, runs), np.stack([c.ones, c.fp64, c.strided], axis=1)),
            (
                c.moved(unfolds, (1 + _lines(x)) * elements * x.item),
                c.efficiency(c.fp64, c.strided, nbytes=elements * x.item),
            ),
        ]

    def transpose(self) -> Terms:
        """The channel-major copies: of y (forward) and dy (grad weight) in
        ``c/implicit_gemm.c``, a row of OW at a time, none where a run is one image (its
        GEMM reads or writes the array in place); of dy for a strided grad input's fold
        (numpy), a run of OH·OW per image and channel, none for one image."""
        c, x = self, self.cols
        rows = x.n * x.oc * x.out_rows
        in_c = c.general & ~c.grad_input & (_images_per_run(x) > 1)
        folds = c.general & c.grad_input & (x.n > 1)
        nbytes = 2 * x.n * x.oc * x.out_rows * x.out_w * x.item
        return [
            (c.loops(in_c, rows) + c.loops(folds, x.n * x.oc), np.stack([in_c, folds], axis=1)),
            (c.moved(in_c | folds, nbytes), c.efficiency(c.fp64, nbytes=nbytes)),
        ]

    def gemm(self, vector_bytes: int, split: bool) -> Terms:
        """The GEMM per group (general path): compute on the columns the micro-kernel
        computes, A, B and C traffic."""
        c, x = self, self.cols
        cg, ocg, positions = x.c / x.groups, x.oc / x.groups, x.n * x.out_rows * x.out_w
        m = np.where(c.grad_input, cg * c.taps, ocg)
        n = np.where(c.grad_weight, cg * c.taps, positions)
        k = np.where(c.forward, cg * c.taps, np.where(c.grad_input, ocg, positions))
        per_panel = np.maximum(vector_bytes // x.item.astype(np.int64), 1)
        full, rest = np.divmod(n.astype(np.int64), per_panel)
        panels = full + (popcount(rest) if split else (rest > 0))
        compute = _per_kind(
            c.by_kind,
            1 - c.fp64,
            c.fp64,
            *hats(_log2(m), _M_KNOTS).T,
            *hats(_log2(n), _N_KNOTS).T,
            *hats(_log2(k), _K_KNOTS).T,
        )
        traffic = np.concatenate(
            [c.by_kind, c.fp64[:, None], _mem((m * k + k * n + m * n) * x.item)], axis=1
        )
        flops = 2 * x.groups * m * panels * per_panel * k
        return [
            (np.where(c.general, flops, 0.0) / _REF_FLOPS, compute),
            (c.moved(c.general, x.groups * m * k * x.item), traffic),
            (c.moved(c.general, x.groups * k * n * x.item), traffic),
            (c.moved(c.general, x.groups * m * n * x.item), traffic),
        ]

    def fold(self) -> Terms:
        """A strided grad input (general path): the zeroed fold buffer, the band zeroed and
        copied out of it, and per tap a scatter-add of [N, C, R, OW] into the buffer."""
        c, x = self, self.cols
        folds = c.general & c.grad_input
        reach = (x.out_rows - 1) * x.sh + x.dh * (x.kh - 1) + 1
        buffer = x.n * x.c * reach * c.wp * x.item
        zeroed = buffer + 2 * x.n * x.c * x.rows * x.w * x.item
        whole = c.rows_run & (reach * c.wp == x.out_rows * x.out_w) & (c.taps == 1) & (x.n == 1)
        elements = c.taps * x.n * x.c * x.out_rows * x.out_w
        runs = elements / (c.run * np.where(whole, x.c, 1))
        return [
            (c.loops(folds, x.n * x.c * np.where(c.side_pad, x.rows, 1)), c.ones[:, None]),
            (c.moved(folds, zeroed), c.efficiency(c.fp64, nbytes=buffer)),
            (c.loops(folds, runs), np.stack([c.ones, c.fp64, c.strided], axis=1)),
            (
                c.moved(folds, (1 + 2 * _lines(x)) * elements * x.item),
                c.efficiency(c.fp64, c.strided, nbytes=buffer),
            ),
        ]

    def flip(self) -> Terms:
        """A stride-1 grad input's weight, its taps flipped and its channel axes exchanged:
        the Python around it (a call) and a copy in runs of kh·kw."""
        c, x = self, self.cols
        flips = x.flipped == 1
        weights = x.oc * x.c / x.groups * c.taps
        return [
            (np.where(flips, _REF_CALL_S, 0.0), c.ones[:, None]),
            (c.loops(flips, weights / c.taps), c.ones[:, None]),
            (c.moved(flips, 2 * weights * x.item), c.efficiency(c.fp64, nbytes=weights * x.item)),
        ]

    def depthwise(self) -> Terms:
        """The depthwise C kernel: per row, per tap loop over a row, per multiply-add, per
        element of the grad input's scatter (with a multiplier), per operand byte."""
        c, x = self, self.cols
        many = x.oc > x.c  # the grad input sums the multiplier's channels, then scatters once
        # Output rows (the grad input: input rows) and, per row, the taps' loops and their
        # multiply-adds: the taps that reach the input and the columns each reaches.
        rows = np.where(c.grad_input, x.c * x.rows, x.oc * x.out_rows) * x.n
        whole = c.row_taps
        # A grad-input band of R input rows meets at most R·min(ceil(kh/sh), R') of the
        # pairs (each input row the tap rows a stride lets reach it, among the R' dy rows
        # given), at most the dy rows' R'·kh and the whole's.
        per_row = np.minimum(np.ceil(x.kh / x.sh), x.out_rows)  # dy rows an input row meets
        band = np.minimum(np.minimum(x.rows * per_row, x.out_rows * x.kh), whole)
        reach = np.where(c.grad_input, band, whole)
        column_taps, columns = c.column_taps, c.pairs
        passes = np.where(c.grad_input & many, x.oc / x.c + 1, x.oc / x.c)
        loops = x.n * x.c * reach * column_taps * passes
        macs = x.n * x.oc * reach * columns
        scattered = np.where(c.grad_input & many, x.n * x.c * reach * columns, 0.0)
        summed = c.grad_input & many  # the multiplier's sums: a contiguous pass each
        strided = c.strided * ~summed
        rate = (c.ones, c.fp64, strided, strided * _log2(x.sw), summed)
        row_set = x.kh * (x.w + x.out_w) * x.item
        operands = np.where(
            c.grad_input,
            x.oc * x.out_rows * x.out_w + x.c * x.rows * x.w,
            x.c * x.h * x.w + x.oc * x.out_h * x.out_w,
        )
        operands = x.n * operands * x.item
        return [
            (c.loops(c.direct, rows), np.concatenate([c.by_kind, _log2(x.kh)[:, None]], axis=1)),
            (c.loops(c.direct, loops), _per_kind(c.by_kind, *rate)),
            (
                np.where(c.direct, 2 * macs, 0.0) / _REF_FLOPS,
                np.concatenate([_per_kind(c.by_kind, *rate), _mem(row_set)], axis=1),
            ),
            (c.moved(c.direct, 3 * scattered * x.item), np.stack([c.ones, c.fp64, c.strided], 1)),
            (
                c.moved(c.direct, operands),
                np.concatenate([c.by_kind, c.fp64[:, None], _mem(operands)], axis=1),
            ),
        ]


def _row_taps(x: _Columns) -> np.ndarray:
    """Per output plane, the (output row, tap row) pairs whose input row is in the array:
    0 <= oh·sh + a·dh − top < h, for oh < OH (the whole output's rows) and a < kh."""
    count = np.zeros(x.size)
    for a in range(int(x.kh.max(initial=1))):
        start = x.top - a * x.dh  # the output row oh reads input row oh·sh − start
        lo = np.maximum(-np.floor_divide(-start, x.sh), 0)
        hi = np.minimum(np.floor_divide(x.h - 1 + start, x.sh) + 1, x.out_h)
        count += np.where(a < x.kh, np.maximum(hi - lo, 0), 0)
    return count


def _column_taps(x: _Columns) -> tuple[np.ndarray, np.ndarray]:
    """Per output row, the tap columns that reach the input's columns, and the (output
    column, tap column) pairs that do (the C kernels' ``mg_conv_columns``)."""
    taps, pairs = np.zeros(x.size), np.zeros(x.size)
    for b in range(int(x.kw.max(initial=1))):
        start = x.left - b * x.dw
        lo = np.maximum(-np.floor_divide(-start, x.sw), 0)
        hi = np.minimum(np.floor_divide(x.w - 1 + start, x.sw) + 1, x.out_w)
        reached = np.where(b < x.kw, np.maximum(hi - lo, 0), 0)
        taps += reached > 0
        pairs += reached
    return taps, pairs


@dataclass(frozen=True, slots=True)
class _Form:
    """The structural choices; everything but θ."""

    vector_bytes: int
    popcount: bool

    def terms(self, columns: _Columns) -> Terms:
        """(work, design) per term, in ``_TERMS`` order."""
        s = _Stages(columns)
        return [
            *s.calls(),
            *s.border(),
            *s.unfold(),
            *s.transpose(),
            *s.gemm(self.vector_bytes, self.popcount),
            *s.fold(),
            *s.flip(),
            *s.depthwise(),
        ]


def work_flops(shape: ConvShape) -> float:
    """FLOPs of the call the kernels make for ``shape`` (``ConvShape.computed``), as
    ``ConvShape.flops`` counts them but for a grad input's band on the direct path: the
    direct kernel computes only the band's share of the whole, where the dense count is of every
    dy row given. The analytic model's compute term."""
    shape = shape.computed()
    if shape.kind == "grad_input" and shape.direct:
        return shape.flops * shape.out_size[0] / shape.dy_rows * shape.rows / shape.h
    return float(shape.flops)


def traffic_bytes(shape: ConvShape) -> int:
    """Bytes the kernel moves at least for the call it makes (``ConvShape.computed``): its
    operands and output, and for the general path the unfolded copy written and read
    (forward, grad weight) or the fold's scatter-adds (strided grad input); the direct
    path's passes are over rows held in the cache, so it moves its operands and output once.
    The analytic model's memory term."""
    shape = shape.computed()
    kh, kw = shape.kernel
    out_h, out_w = shape.out_size
    n, c, oc, item = shape.n, shape.c, shape.oc, shape.itemsize
    weights = oc * (c // shape.groups) * kh * kw
    if shape.kind == "grad_input":
        operands = n * oc * shape.dy_rows * out_w + weights + n * c * shape.rows * shape.w
        passes = 2 * kh * kw * n * c * shape.dy_rows * out_w
    else:
        operands = n * c * shape.h * shape.w + weights + n * oc * out_h * out_w
        passes = 2 * kh * kw * n * c * out_h * out_w
    return (operands + (0 if shape.direct else passes)) * item


# --- the model -------------------------------------------------------------------------------

_Trial = tuple[float, _Form, np.ndarray]  # robust cost, structure, θ

_ANALYTIC_KEYS = ("kind", "flops", "depthwise_flops", "fp64_ratio", "mem_bw", "exact")
_FITTED_KEYS = ("kind", "form", "vector_bytes", "popcount", *_TERMS, "native", "exact")
# ``native``'s keys: each kind, for a k×k convolution on the general path, a pointwise (1×1)
# one, and a depthwise one: PyTorch's algorithms and the kernels' differ most between these.
NATIVE_CLASSES = ("", "_pointwise", "_depthwise")
NATIVE_KEYS = tuple(f"{kind}{cls}" for cls in NATIVE_CLASSES for kind in KINDS)


def native_class(kernel: tuple[int, int], depthwise: bool) -> str:
    """The class of a convolution of ``kernel`` (one of ``NATIVE_CLASSES``)."""
    return "_depthwise" if depthwise else "_pointwise" if kernel == (1, 1) else ""


def native_key(shape: ConvShape) -> str:
    """``shape``'s key in ``native``."""
    return shape.kind + native_class(shape.kernel, shape.depthwise)


NO_MEM_BW = 0.0  # ``mem_bw`` value meaning "no memory term"


def _positive(name: str, value: object) -> float:
    return positive("conv", name, value)


def _bandwidth(value: object) -> float:
    """``mem_bw``: bytes/s, or 0 for none."""
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value == NO_MEM_BW:
        return NO_MEM_BW
    return _positive("mem_bw", value)


def _exact(records: object) -> dict[ConvShape, float]:
    return exact_from("conv", records, SHAPE_FIELDS, ConvShape.from_dict)


class ConvModel(ShapeModel[ConvShape]):
    """Seconds per convolution call at the device's top clock: exact cache first, then the
    model. Build one with ``fit`` (measurements), ``analytic`` (published figures) or
    ``from_dict``.

    A fitted model describes the device's own kernels (``kernels/conv.py``), which compute
    the numerics; the board itself would run the script's convolutions with PyTorch's,
    faster or slower. ``native`` (by ``NATIVE_KEYS``: kind and class) is PyTorch's time over
    the kernels' on this board, measured by ``morphling profile``
    (``profiler/conv_native.py``); predictions are multiplied by it, so the clock prices a
    convolution as the board's PyTorch runs it. Analytic models are of PyTorch's already."""

    def __init__(
        self,
        exact: Mapping[ConvShape, float],
        *,
        form: _Form | None = None,
        theta: Sequence[float] | np.ndarray | None = None,
        flops: float | None = None,
        depthwise_flops: float | None = None,
        fp64_ratio: float = 0.5,
        mem_bw: float = NO_MEM_BW,
        native: Mapping[str, float] | None = None,
    ) -> None:
        if (form is None) == (flops is None) or (form is None) != (theta is None):
            raise ValueError("a ConvModel is either fitted (form, theta) or analytic (flops)")
        if native is not None and form is None:
            raise ValueError("only a fitted ConvModel has a native scale")
        super().__init__(exact)
        native = dict.fromkeys(NATIVE_KEYS, 1.0) if native is None else native
        check_keys("conv field 'native'", native, NATIVE_KEYS)
        self.native = {key: _positive(f"native.{key}", native[key]) for key in NATIVE_KEYS}
        self._form = form
        self._theta = None if theta is None else np.array(theta, dtype=np.float64)
        self.flops = None if flops is None else _positive("flops", flops)
        rate = self.flops if depthwise_flops is None else depthwise_flops
        self.depthwise_flops = None if rate is None else _positive("depthwise_flops", rate)
        self.fp64_ratio = _positive("fp64_ratio", fp64_ratio)
        self.mem_bw = _bandwidth(mem_bw)

    # construction

    @classmethod
    def analytic(
        cls, flops: float, *, depthwise_flops: float | None = None, fp64_ratio: float = 0.5,
        mem_bw: float = NO_MEM_BW,
    ) -> ConvModel:  # fmt: skip
        """``work_flops / flops`` (``depthwise_flops`` for a depthwise convolution, default
        ``flops``; fp64 at ``fp64_ratio`` of the rate), plus, with a memory bandwidth
        ``mem_bw`` in bytes/s, ``traffic_bytes / mem_bw``: published figures."""
        return cls({}, flops=flops, depthwise_flops=depthwise_flops, fp64_ratio=fp64_ratio,
                   mem_bw=mem_bw)  # fmt: skip

    @classmethod
    def fit(cls, samples: Iterable[tuple[ConvShape, float]]) -> ConvModel:
        """Fit to measured (shape, seconds); the samples also become the exact cache.

        The panel width and the remainder's split are chosen by the lowest robust cost of
        fits on (a spread subset of) the samples; θ is then fitted on all of them.
        """
        exact: dict[ConvShape, float] = {}
        for shape, measured_s in samples:
            if not isinstance(shape, ConvShape):
                raise ValueError(f"sample shape must be a ConvShape, got {shape!r:.60}")
            value = _positive("seconds", measured_s)
            exact[shape] = min(value, exact.get(shape, math.inf))
        least = sum(_TERMS.values()) // 4
        if len(exact) < least:
            raise ValueError(f"fit needs at least {least} distinct shapes")
        shapes = list(exact)
        seconds = np.array([exact[s] for s in shapes])
        step = -(-len(shapes) // _SEARCH_SAMPLES)
        subset = _Columns(shapes[::step])
        sub_seconds = seconds[::step]
        zero = np.zeros(sum(_TERMS.values()))

        def trial(form: _Form) -> _Trial:
            theta, cost = least_squares(form.terms(subset), sub_seconds, zero, _SEARCH_NFEV)
            return cost, form, theta

        trials = [
            trial(_Form(vector_bytes, split))
            for vector_bytes in VECTOR_BYTES_CANDIDATES
            for split in (False, True)
        ]
        _, form, start = min(trials, key=lambda t: t[0])
        theta, _ = least_squares(form.terms(_Columns(shapes)), seconds, start, _FINAL_NFEV)
        return cls(exact, form=form, theta=theta)

    def with_native(self, native: Mapping[str, float]) -> ConvModel:
        """This fitted model, its predictions scaled to the board's PyTorch by ``native``."""
        return ConvModel(self.exact, form=self._form, theta=self._theta, native=native)

    # prediction

    def predict_s(self, shape: ConvShape) -> float:
        return super().predict_s(shape) * self.native[native_key(shape)]

    def predict_many(self, shapes: Sequence[ConvShape]) -> np.ndarray:
        scale = np.array([self.native[native_key(s)] for s in shapes], dtype=np.float64)
        return super().predict_many(shapes) * scale

    def _model(self, shapes: Sequence[ConvShape]) -> np.ndarray:
        if self._form is None:
            shapes = [s.computed() for s in shapes]
            assert self.flops is not None and self.depthwise_flops is not None
            rate = np.array(
                [
                    (self.depthwise_flops if s.depthwise else self.flops)
                    * (self.fp64_ratio if s.dtype == "float64" else 1.0)
                    for s in shapes
                ]
            )
            seconds: np.ndarray = np.array([work_flops(s) for s in shapes], np.float64) / rate
            if self.mem_bw != NO_MEM_BW:
                seconds += np.array([traffic_bytes(s) for s in shapes], np.float64) / self.mem_bw
            return seconds
        assert self._theta is not None
        return predict(self._form.terms(_Columns(shapes)), self._theta)

    # serialisation

    def to_dict(self) -> dict[str, Any]:
        """A TOML- and msgpack-friendly map (the exact cache as a list of records)."""
        exact = [{**s.to_dict(), "seconds": t} for s, t in self.exact.items()]
        if self._form is None:
            analytic = {
                "kind": "analytic",
                "flops": self.flops,
                "depthwise_flops": self.depthwise_flops,
                "fp64_ratio": self.fp64_ratio,
                "mem_bw": self.mem_bw,
            }
            return {**analytic, "exact": exact}
        assert self._theta is not None
        out: dict[str, Any] = {
            "kind": "fitted",
            "form": FORM,
            "vector_bytes": self._form.vector_bytes,
            "popcount": self._form.popcount,
        }
        terms = theta_by_term(self._theta, _TERMS)
        return {**out, **terms, "native": dict(self.native), "exact": exact}

    @classmethod
    def from_dict(cls, d: object) -> ConvModel:
        """Parse ``to_dict``'s map strictly: unknown or missing keys are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"conv model must be a map, got {type(d).__name__}")
        kind = d.get("kind")
        if kind == "analytic":
            check_keys("conv model", d, _ANALYTIC_KEYS)
            return cls(
                _exact(d["exact"]),
                flops=_positive("flops", d["flops"]),
                depthwise_flops=_positive("depthwise_flops", d["depthwise_flops"]),
                fp64_ratio=_positive("fp64_ratio", d["fp64_ratio"]),
                mem_bw=_bandwidth(d["mem_bw"]),
            )
        if kind != "fitted":
            raise ValueError(f"conv field 'kind' must be 'analytic' or 'fitted', got {kind!r:.60}")
        form = d.get("form", 1)
        if form != FORM:
            raise ValueError(
                f"conv field 'form' is {form!r:.20} (absent: 1), this Morphling's is {FORM}: "
                "the model was fitted to other kernels' work terms; measure the device again "
                "(morphling profile)"
            )
        check_keys("conv model", d, _FITTED_KEYS)
        vector_bytes, split = d["vector_bytes"], d["popcount"]
        if isinstance(vector_bytes, bool) or not isinstance(vector_bytes, int) or vector_bytes < 1:
            raise ValueError(
                f"conv field 'vector_bytes' must be an integer >= 1, got {vector_bytes!r:.60}"
            )
        if not isinstance(split, bool):
            raise ValueError(f"conv field 'popcount' must be a bool, got {split!r:.60}")
        theta = [x for name, width in _TERMS.items() for x in floats("conv", name, d[name], width)]
        form = _Form(vector_bytes, split)
        return cls(_exact(d["exact"]), form=form, theta=theta, native=d["native"])

"""Convolutions on a device: one tile of a 2-D convolution, computed for real.

A device receives the input region its tile needs, halo included, never the unfolded
(im2col) matrix, so links carry activations. It unfolds the region locally and multiplies
with this package's BLAS: an implicit GEMM, a run of images at a time, so that each unfold
is read while it is still in cache, in one C call (``c/implicit_gemm.c``) that reads and
writes the arrays at their own strides (a tile's are bands of larger ones).
Depthwise convolutions (each output channel reads one input channel) take direct C kernels
instead (``c/depthwise.c``): row by row, kh·kw vectorised multiply-adds per row,
the padding skipped rather than copied, and never the kh·kw times larger unfolded copy.
Bias is the caller's: it is added, and its gradient summed, where the whole output is.

Layout
------
NCHW arrays, float32 or float64, one dtype per call: x [N, C, H, W], w [OC, C/groups,
kh, kw], y and dy [N, OC, OH, OW]. A 1-D convolution is the 2-D one with H = 1, kh = 1.

Geometry
--------
``ConvGeometry`` holds kernel (kh, kw), stride (sh, sw), dilation (dh, dw), groups and
padding (top, bottom, left, right): the zero rows and columns around the array the call
indexes — the region received for ``conv_forward``, the whole input for the gradients.
Input row i is padded row i + top (columns alike, with left). In the padded array of
Hp = top + H + bottom rows and Wp = left + W + right columns, output (oh, ow) reads the
padded rows oh·sh + a·dh and columns ow·sw + b·dw, for the taps 0 <= a < kh, 0 <= b < kw:

    OH = (Hp − dh·(kh−1) − 1) // sh + 1        OW = (Wp − dw·(kw−1) − 1) // sw + 1

(torch's rule; torch's symmetric padding p is top = bottom = p). Padded rows past the
last output's reach are never read.

Groups: output channel oc is in group oc // (OC/groups) and reads the input channels
[g·C/groups, (g+1)·C/groups). A tile's channels are whole groups (``groups`` = how
many), or lie inside one group (``groups`` = 1).

Tiles
-----
Forward, output rows [o0, o1) of a convolution over H input rows with padding
(top, bottom, left, right): the tile reads input rows
[o0·sh − top, (o1−1)·sh + dh·(kh−1) + 1 − top). Clipped to [0, H) these are the region's
rows [r0, r1); what the clip cut off above is the region's top padding, below its bottom
padding; left and right stay. ``ConvGeometry.forward_band`` computes them. A band that
sees only padding gets r0 == r1 (an empty region) and all its padding on top.

Grad input, input rows [i0, i1) (all columns): the grad-output rows that touch them are
[lo, hi) with lo = max(0, ceil((i0 + top − dh·(kh−1)) / sh)) and
hi = min(OH, (i1 − 1 + top) // sh + 1) (``ConvGeometry.grad_output_rows``; when none
does, the empty (m, m) with m = min(lo, OH), and the band's gradient is zero). The tile
receives dy rows [oh_lo, oh_lo + R) covering [lo, hi) and the whole convolution's
geometry; extra rows are allowed and contribute nothing to the band. With stride 1 (off
the depthwise path) the band is the forward convolution of those dy rows, zero-padded by
the kernel's reach, through the weight with its taps flipped and its channel axes
exchanged: only the band's rows are computed. A strided one multiplies each dy row given
by the weight and folds (scatter-adds) every tap's share, then keeps the band's rows.

Grad weight, an output-channel block × an input-channel block (whole channels: all kh·kw
taps of each): x is the block's input channels, all rows, with the whole convolution's
padding; dy is the block's output channels, all rows. The reduction over batch and positions is
complete, so tiles need no summing across devices.

FLOPs (``conv_flops``): 2·N·OC·OH·OW·(C/groups)·kh·kw, the multiply-adds of the dense
formulation, padding zeros included, for y (forward), the dy rows given (grad input: rows
whose share falls outside the band are counted, though only a strided one computes them) or
dy (grad weight). The scatter-adds of the grad input's fold (1/(OC/groups) of that) are not
counted.
"""

from __future__ import annotations

import errno
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ._native import ffi, lib
from .blas import blas_info, gemm
from .layout import _pointer

Array = npt.NDArray[Any]
# The kernels' algorithm, as a profile records it: a model fitted to one revision's timings
# does not describe another's (2: a stride-1 grad input is a forward convolution; the
# unfolding reads the input itself, never a padded copy; 3: the unfolding is C, row by row,
# into a buffer each thread keeps; 4: a run of images at a time, ``_images_per_run``;
# 5: the unfold and the GEMMs of a call in one C call, at the arrays' strides).
REVISION = 5
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _ints(name: str, value: Any, count: int, least: int) -> tuple[int, ...]:
    """``value`` as a tuple of ``count`` ints >= ``least`` (lists too: msgpack decodes to lists)."""
    if type(value) is tuple and len(value) == count and all(type(v) is int for v in value):
        if min(value) >= least:  # (the common case, a geometry's own fields: a tile's)
            return value
    elif (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and len(value) == count
        and all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in value)
        and min(value) >= least
    ):
        return tuple(int(v) for v in value)
    raise ValueError(f"ConvGeometry: {name}={value!r}: expected {count} integers >= {least}")


def _out_len(padded: int, kernel: int, stride: int, dilation: int) -> int:
    return (padded - dilation * (kernel - 1) - 1) // stride + 1


@dataclass(frozen=True)
class ConvGeometry:
    """How a convolution walks the array it is given (see the module docstring)."""

    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, bottom, left, right
    groups: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "kernel", _ints("kernel", self.kernel, 2, 1))
        set_(self, "stride", _ints("stride", self.stride, 2, 1))
        set_(self, "dilation", _ints("dilation", self.dilation, 2, 1))
        set_(self, "padding", _ints("padding", self.padding, 4, 0))
        groups = self.groups
        if not isinstance(groups, int | np.integer) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"ConvGeometry: groups={groups!r}: expected an integer >= 1")
        set_(self, "groups", int(groups))

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(OH, OW) over a height × width array; ValueError if the kernel does not fit."""
        if height < 0 or width < 0:
            raise ValueError(f"input size {height}x{width} is negative")
        top, bottom, left, right = self.padding
        hp, wp = height + top + bottom, width + left + right
        oh = _out_len(hp, self.kernel[0], self.stride[0], self.dilation[0])
        ow = _out_len(wp, self.kernel[1], self.stride[1], self.dilation[1])
        if oh < 1 or ow < 1:
            reach = [d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel, strict=True)]
            raise ValueError(
                f"padded input {hp}x{wp} is smaller than the dilated kernel {reach[0]}x{reach[1]}"
            )
        return oh, ow

    def _out_rows(self, height: int) -> int:
        return self.output_size(height, self.dilation[1] * (self.kernel[1] - 1) + 1)[0]

    def forward_band(self, height: int, o0: int, o1: int) -> tuple[int, int, ConvGeometry]:
        """Input rows [r0, r1) and the region's geometry for output rows [o0, o1).

        ``self`` is the whole convolution's geometry over ``height`` input rows.
        """
        out_rows = self._out_rows(height)
        if not 0 <= o0 < o1 <= out_rows:
            raise ValueError(f"output rows [{o0}, {o1}) are not a band of [0, {out_rows})")
        (kh, _), (sh, _), (dh, _) = self.kernel, self.stride, self.dilation
        top, _, left, right = self.padding
        start, stop = o0 * sh - top, (o1 - 1) * sh + dh * (kh - 1) + 1 - top
        r0, r1 = max(start, 0), min(stop, height)
        if r0 >= r1:  # the band reads only padding
            r0 = r1 = min(r0, height)
            return r0, r1, replace(self, padding=(stop - start, 0, left, right))
        return r0, r1, replace(self, padding=(r0 - start, stop - r1, left, right))

    def grad_output_rows(self, height: int, i0: int, i1: int) -> tuple[int, int]:
        """The grad-output rows [lo, hi) whose gradient reaches input rows [i0, i1).

        Every row that does lies in the range; with stride and dilation some inside
        it may reach none of the band's rows.
        """
        out_rows = self._out_rows(height)
        if not 0 <= i0 < i1 <= height:
            raise ValueError(f"input rows [{i0}, {i1}) are not a band of [0, {height})")
        (kh, _), (sh, _), (dh, _) = self.kernel, self.stride, self.dilation
        top = self.padding[0]
        lo = max(0, -(-(i0 + top - dh * (kh - 1)) // sh))
        hi = min(out_rows, (i1 - 1 + top) // sh + 1)
        return (lo, hi) if lo < hi else (min(lo, out_rows), min(lo, out_rows))


def conv_flops(out_shape: Sequence[int], weight_shape: Sequence[int]) -> int:
    """2 × the dense multiply-adds: y's shape (forward) or dy's (grad input, grad weight)."""
    return 2 * math.prod(out_shape) * math.prod(weight_shape[1:])


def conv_forward(x: Array, w: Array, geom: ConvGeometry, out: Array | None = None) -> Array:
    """y [N, OC, OH, OW] of the region x [N, C, Hr, Wr] padded by ``geom.padding``."""
    dtype = _dtype(x=x, w=w)
    n, channels, height, width = x.shape
    _check_weight(w, geom, channels, "x")
    oh, ow = geom.output_size(height, width)
    y = _output(out, (n, w.shape[0], oh, ow), dtype, x, w)
    cgeom = _c_geometry(geom, x.shape, w.shape[0], (oh, ow))
    if w.shape[1] == 1:
        _filled(y, lambda dst: _direct("forward", cgeom, x, w, dst))
    else:
        _implicit_gemm("forward", cgeom, geom.groups, x, np.ascontiguousarray(w), y)
    return y


def conv_grad_input(
    dy: Array,
    w: Array,
    geom: ConvGeometry,
    *,
    input_size: tuple[int, int],
    oh_lo: int = 0,
    rows: tuple[int, int] | None = None,
    out: Array | None = None,
) -> Array:
    """dX [N, C, i1 − i0, W] for input rows ``rows`` = [i0, i1) (default: all).

    ``dy`` holds grad-output rows [oh_lo, oh_lo + R), covering ``grad_output_rows``;
    ``geom`` and ``input_size`` (H, W) are the whole convolution's.
    """
    dtype = _dtype(dy=dy, w=w)
    height, width = input_size
    i0, i1 = (0, height) if rows is None else rows
    need = geom.grad_output_rows(height, i0, i1)
    oh, ow = geom.output_size(height, width)
    n, oc, r, _ = dy.shape
    channels = geom.groups * w.shape[1]
    _check_weight(w, geom, channels, "dx")
    if oc != w.shape[0] or dy.shape[3] != ow:
        raise ValueError(f"dy: shape {dy.shape}, expected [N, {w.shape[0]}, R, {ow}]")
    if (
        oh_lo < 0
        or oh_lo + r > oh
        or (need[0] < need[1] and not oh_lo <= need[0] < need[1] <= oh_lo + r)
    ):
        raise ValueError(
            f"dy: grad-output rows [{oh_lo}, {oh_lo + r}) must lie in [0, {oh}) and cover "
            f"[{need[0]}, {need[1]}), the rows reaching input rows [{i0}, {i1})"
        )
    dx = _output(out, (n, channels, i1 - i0, width), dtype, dy, w)
    if w.shape[1] == 1:
        shape = (n, channels, height, width)
        band = (i0, i1 - i0, oh_lo, r)
        cgeom = _c_geometry(geom, shape, oc, (oh, ow))
        _filled(dx, lambda dst: _direct("grad_input", cgeom, dy, w, dst, *band))
        return dx
    if geom.stride == (1, 1):
        return _grad_input_forward(
            dy[:, :, need[0] - oh_lo : need[1] - oh_lo], w, geom, need, (i0, i1), dx
        )
    share = _shares_gemm(dy, w, geom)
    (kh, _), (sh, _), (dh, _) = geom.kernel, geom.stride, geom.dilation
    top, _, left, right = geom.padding
    # The fold: padded rows from oh_lo·sh on, as far down as the taps of dy's last row reach.
    reach = (r - 1) * sh + dh * (kh - 1) + 1 if r else 0
    buf = np.zeros((n, channels, reach, left + width + right), dtype)
    for a, b, window in _taps(geom, r, ow):
        buf[(slice(None), slice(None), *window)] += share(a, b)
    first = i0 + top - oh_lo * sh  # the band's first row in buf
    lo, hi = max(first, 0), min(first + i1 - i0, reach)
    dx[...] = 0
    if lo < hi:
        dx[:, :, lo - first : hi - first] = buf[:, :, lo:hi, left : left + width]
    return dx


def conv_grad_weight(x: Array, dy: Array, geom: ConvGeometry, out: Array | None = None) -> Array:
    """dW [OC, C/groups, kh, kw] from x [N, C, H, W] and dy [N, OC, OH, OW], fully reduced."""
    dtype = _dtype(x=x, dy=dy)
    n, channels, height, width = x.shape
    oh, ow = geom.output_size(height, width)
    groups = geom.groups
    for name, count in (("x", channels), ("dy", dy.shape[1])):
        if count % groups:
            raise ValueError(f"{name}: {count} channels do not split into {groups} groups")
    if dy.shape != (n, dy.shape[1], oh, ow):
        raise ValueError(f"dy: shape {dy.shape}, expected [{n}, OC, {oh}, {ow}]")
    dw = _output(out, (dy.shape[1], channels // groups, *geom.kernel), dtype, x, dy)
    cgeom = _c_geometry(geom, x.shape, dy.shape[1], (oh, ow))
    if channels == groups:
        _filled(dw, lambda dst: _direct("grad_weight", cgeom, x, dy, dst))
    else:
        _implicit_gemm("grad_weight", cgeom, groups, x, dy, dw)
    return dw


# --- checks -------------------------------------------------------------------------------


def _dtype(**arrays: Any) -> np.dtype[Any]:
    """The call's one dtype, after checking each operand is a 4-D float32/float64 array."""
    first = ""
    dtype: np.dtype[Any] | None = None
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{name}: expected a numpy array, got {type(arr).__name__}")
        if arr.ndim != 4:
            raise ValueError(f"{name}: expected 4 dimensions (NCHW / OIHW), got shape {arr.shape}")
        if arr.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {arr.dtype} is not supported (float32, float64)")
        if dtype is None:
            first, dtype = name, arr.dtype
        elif arr.dtype != dtype:
            raise ValueError(f"{name}: dtype {arr.dtype} does not match {first}'s {dtype}")
    assert dtype is not None
    return dtype


def _check_weight(w: Array, geom: ConvGeometry, channels: int, side: str) -> None:
    """w [OC, C/groups, kh, kw] against the geometry and the input's C channels."""
    oc, per_group, kh, kw = w.shape
    if (kh, kw) != geom.kernel:
        raise ValueError(f"w: kernel {kh}x{kw} does not match the geometry's {geom.kernel}")
    if oc % geom.groups:
        raise ValueError(f"w: {oc} output channels do not split into {geom.groups} groups")
    if channels != geom.groups * per_group:
        raise ValueError(
            f"{side}: {channels} channels, but w's {per_group} per group × {geom.groups} "
            f"groups read {geom.groups * per_group}"
        )


def _output(
    out: Array | None, shape: tuple[int, ...], dtype: np.dtype[Any], *inputs: Array
) -> Array:
    """``out`` checked (writable, apart from the inputs; any strides, as a band of a larger
    output has), or a new array."""
    if out is None:
        return np.empty(shape, dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        got = f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}"
        raise ValueError(f"out: expected a {dtype} array of shape {shape}, got {got.strip()}")
    if not out.flags.writeable:
        raise ValueError("out: must be writable")
    if any(np.may_share_memory(out, arr) for arr in inputs):
        raise ValueError("out: overlaps an input")
    return out


def _filled(out: Array, fill: Callable[[Array], object]) -> None:
    """``fill`` writes a C-contiguous array (a C kernel's, a GEMM's output): ``out`` itself
    where it is one, else a scratch array copied into it."""
    if out.flags.c_contiguous:
        fill(out)
        return
    scratch = np.empty(out.shape, out.dtype)
    fill(scratch)
    out[...] = scratch


# --- shared pieces ------------------------------------------------------------------------


_unfolds = threading.local()  # ``_scratch``'s buffer, one per worker thread
_ALIGN = 64
_CHUNK_BYTES = 4 << 20  # an unfold of about this many bytes at a time (``_images_per_run``)
_CHUNK_COLUMNS = 512
_C_TYPES = {np.dtype(np.float32): ("f32", "float[]"), np.dtype(np.float64): ("f64", "double[]")}


def _c_geometry(
    geom: ConvGeometry,
    x_shape: tuple[int, ...],
    oc: int,
    out_size: tuple[int, int],
) -> Any:
    """The C kernels' ``mg_conv_geom`` for x of ``x_shape`` (the region, or the whole input
    for the gradients), ``oc`` output channels and the output's (OH, OW)."""
    n, channels, height, width = x_shape
    (kh, kw), (sh, sw), (dh, dw) = geom.kernel, geom.stride, geom.dilation
    top, _, left, _ = geom.padding
    fields = {"n": n, "c": channels, "multiplier": oc // channels, "h": height, "w": width}
    out = {"oh": out_size[0], "ow": out_size[1]}
    taps = {"kh": kh, "kw": kw, "sh": sh, "sw": sw, "dh": dh, "dw": dw}
    return ffi.new("mg_conv_geom *", {**fields, **out, **taps, "top": top, "left": left})


def _taps(geom: ConvGeometry, oh: int, ow: int) -> Iterator[tuple[int, int, tuple[slice, slice]]]:
    """Each tap (a, b) and the padded rows and columns it meets, one per output position."""
    (kh, kw), (sh, sw), (dh, dw) = geom.kernel, geom.stride, geom.dilation
    for a in range(kh):
        for b in range(kw):
            rows = slice(a * dh, a * dh + (oh - 1) * sh + 1, sh) if oh else slice(0, 0)
            cols = slice(b * dw, b * dw + (ow - 1) * sw + 1, sw)
            yield a, b, (rows, cols)


def _scratch(shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """An uninitialised array of ``shape`` in this thread's unfold buffer, grown as needed
    and kept: an unfold is often larger than the allocator keeps for reuse, and a fresh
    one's page faults cost as much as filling it. One call uses it per thread at a time."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer: Array | None = getattr(_unfolds, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        raw = np.empty(nbytes + _ALIGN, np.uint8)  # aligned for the BLAS that reads it
        start = -raw.ctypes.data % _ALIGN
        buffer = _unfolds.buffer = raw[start : start + nbytes]
    return buffer[:nbytes].view(dtype).reshape(shape)


def _images_per_run(cgeom: Any, itemsize: int) -> int:
    """Images to unfold at a time: a run whose unfold is about ``_CHUNK_BYTES`` (so that it
    is read by the GEMM while still in cache, not written out to memory and read back), and
    at least ``_CHUNK_COLUMNS`` columns (an efficient GEMM's) where there are images enough."""
    positions = cgeom.oh * cgeom.ow
    per_image = cgeom.c * cgeom.kh * cgeom.kw * positions * itemsize
    return max(1, _CHUNK_BYTES // max(1, per_image), -(-_CHUNK_COLUMNS // max(1, positions)))


def _address(arr: Array) -> tuple[Array, Any, Any]:
    """``arr`` (or a contiguous copy where its strides are negative or not whole elements),
    a C pointer to its first element (``layout``'s) and its ``mg_strides4``."""
    item = arr.itemsize
    if any(s < 0 or s % item for s in arr.strides):
        arr = np.ascontiguousarray(arr)
    return arr, _pointer(arr)[0], ffi.new("mg_strides4 *", [s // item for s in arr.strides])


def _implicit_gemm(kind: str, cgeom: Any, groups: int, x: Array, second: Array, out: Array) -> None:
    """``c/implicit_gemm.c``'s forward (``second`` the weight [OC, C/G, kh, kw], C-contiguous;
    ``out`` y) or grad weight (``second`` dy; ``out`` dw), into ``out`` at its strides (a dw
    whose rows are not each contiguous: into a new array, copied into it)."""
    blas_info()  # (the library loaded)
    oc = out.shape[0] if kind == "grad_weight" else out.shape[1]
    chunk = _images_per_run(cgeom, x.itemsize)
    # The scratch the call asks for (``mg_conv_scratch``, which it checks against), reckoned
    # here: every C call lets go of the interpreter lock, and a worker waits to have it back.
    columns = cgeom.oh * cgeom.ow * chunk * x.itemsize
    unfold = -(-cgeom.c * cgeom.kh * cgeom.kw * columns // _ALIGN) * _ALIGN
    scratch = ffi.from_buffer(_scratch((unfold + oc * columns,), np.dtype(np.uint8)).data)
    size, (x, xp, xs), (second, sp, ss) = x.itemsize, _address(x), _address(second)
    if kind == "forward":
        target, tp, ts = _address(out)
        rc = lib.mg_conv_forward(cgeom, size, groups, oc, xp, xs, sp, tp, ts, scratch,
                                 len(scratch), chunk)  # fmt: skip
    else:
        rows = _row_stride(out)
        target, tp, _ = _address(out if rows else np.empty(out.shape, out.dtype))
        rc = lib.mg_conv_grad_weight(cgeom, size, groups, oc, xp, xs, sp, ss, tp,
                                     rows or out[0].size, scratch, len(scratch), chunk)  # fmt: skip
    if rc == -errno.ENOMEM:
        raise MemoryError(f"{kind}: no memory for the unfold's column spans")
    if rc:
        raise ValueError(f"{kind}: a dimension is past the BLAS's int range")  # (or a bug)
    if target is not out:
        out[...] = target


def _row_stride(dw: Array) -> int:
    """dw's row stride in elements, as a GEMM's leading dimension, where each of its rows
    [C/G, kh, kw] is contiguous; else 0."""
    item, inner = dw.itemsize, dw[0].size
    want = (dw.shape[2] * dw.shape[3], dw.shape[3], 1)
    if any(
        n > 1 and s != e * item for n, s, e in zip(dw.shape[1:], dw.strides[1:], want, strict=True)
    ):
        return 0
    if dw.shape[0] == 1:
        return max(1, inner)
    stride = dw.strides[0]
    return stride // item if stride >= inner * item and stride % item == 0 else 0


def _grouped(w: Array, groups: int) -> Array:
    """w as [G, OC/G, (C/G)·kh·kw]."""
    return np.ascontiguousarray(w).reshape(groups, w.shape[0] // groups, -1)


def _channel_major(dy: Array, groups: int) -> Array:
    """dy as [G, OC/G, N·OH·OW], columns as the unfold's (a copy unless N == 1)."""
    return np.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(groups, dy.shape[1] // groups, -1)


# --- GEMM path ----------------------------------------------------------------------------


def _grad_input_forward(
    dy: Array,
    w: Array,
    geom: ConvGeometry,
    reached: tuple[int, int],
    rows: tuple[int, int],
    dx: Array,
) -> Array:
    """A stride-1 grad input as the forward convolution it is: ``dy`` (the grad-output rows
    ``reached`` that reach the band ``rows``, never none at stride 1; all columns),
    zero-padded by the kernel's reach, through ``w`` with its taps flipped and its two
    channel axes exchanged. Only the band's rows are computed, so a band costs its share of
    the whole and no more (the fold below computes every row its dy rows reach)."""
    (kh, kw), (dh, dw) = geom.kernel, geom.dilation
    top, _, left, _ = geom.padding
    width, out_w = dx.shape[3], dy.shape[3]
    # dX row i reads dy rows i + top − dh·(kh−1) .. i + top; columns alike.
    start, stop = rows[0] + top - dh * (kh - 1), rows[1] + top
    first, last = left - dw * (kw - 1), width + left
    c0, c1 = max(first, 0), min(last, out_w)
    groups, (oc, per_group) = geom.groups, w.shape[:2]
    # (both taps reversed: the flattened taps reversed)
    flipped = (
        w.reshape(groups, oc // groups, per_group, kh * kw)
        .transpose(0, 2, 1, 3)[..., ::-1]
        .reshape(groups * per_group, oc // groups, kh, kw)
    )
    padding = (reached[0] - start, stop - reached[1], c0 - first, last - c1)
    reverse = ConvGeometry(geom.kernel, (1, 1), geom.dilation, padding, groups)
    return conv_forward(dy[:, :, :, c0:c1], flipped, reverse, out=dx)


def _shares_gemm(dy: Array, w: Array, geom: ConvGeometry) -> Callable[[int, int], Array]:
    """Tap (a, b)'s share of dX at its positions, [N, C, R, OW], from one Wᵀ·dy per group."""
    n, _, r, ow = dy.shape
    kh, kw = geom.kernel
    dcols = gemm(_grouped(w, geom.groups).transpose(0, 2, 1), _channel_major(dy, geom.groups))
    taps = dcols.reshape(geom.groups * w.shape[1], kh, kw, n, r, ow)
    return lambda a, b: taps[:, a, b].transpose(1, 0, 2, 3)


# --- depthwise path: each output channel reads one input channel --------------------------


def _direct(name: str, cgeom: Any, first: Array, second: Array, out: Array, *band: int) -> None:
    """Run ``mg_dw_<name>`` on C-contiguous copies of the operands (the arrays themselves
    when they are, as a tile's operands off the wire are), writing into ``out``."""
    suffix, ctype = _C_TYPES[out.dtype]
    # .data: numpy's stubs give an array the buffer protocol only from Python 3.12 (PEP 688)
    operands = (ffi.from_buffer(ctype, np.ascontiguousarray(a).data) for a in (first, second))
    result = ffi.from_buffer(ctype, out.data, require_writable=True)
    if getattr(lib, f"mg_dw_{name}_{suffix}")(cgeom, *operands, result, *band):
        raise MemoryError(f"depthwise {name}: no memory for its scratch row buffers")

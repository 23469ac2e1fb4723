"""A device's tile checked, not believed: Freivalds' check and its tolerance rule.

A GEMM tile C = A·B ([m, n]: op(A)'s rows, op(B)'s columns, all K) is checked with random signs
r ∈ {±1}ⁿ: C·r against A·(B·r), O(mK + Kn + mn) work instead of the product's O(mnK). The
signs are drawn per request and per column block of tiles, from a generator the devices
never see; ``RequestCheck`` computes B·R and A·(B·R) for every column block of a pivot at
once (one pass over A and one over B per request, not per tile), so a tile costs one
pass over its own C.

A convolution tile is checked through its GEMM view (an implicit GEMM: y = W·unfold(x)),
never unfolding x: its product's channels within each group are summed with random signs
u (forward: output channels; grad input: input channels), and the same sum is computed
from the operands with one channel per group — Σu·W applied to x (each tap's sum over the
channels one matmul over x, then the taps' shifted sums) or to dy (the kernel's own call).
A grad-weight tile dW [OC, C·kh·kw] = dy·unfold(x)ᵀ takes signs r over each row: dW·r
against dy·(unfold(x)ᵀ·r), where unfold(x)ᵀ·r is x convolved with r, one output channel.
K is then the length of the tile's dot products (C/groups·kh·kw, OC/groups·kh·kw or
N·OH·OW), and the tolerance's second term is the reference's own size, |want|.

Two stages (docs/PROTOCOL.md, *Verification*):

1. **Screen** (every tile checked). Row i passes when

       |(C·r − A·(B·r))ᵢ| ≤ λ·u·√K·(‖ĉᵢ‖ + |aᵢ|·|B·r|)

   u being the unit roundoff (2⁻²⁴ float32, 2⁻⁵³ float64) and λ = ``LAMBDA``. The two terms
   are the sizes of the rounding errors of a K-term dot product summed in any order (the
   device's, ‖ĉᵢ‖ scaled as Higham and Mary's probabilistic bound scales a dot product's,
   SIAM J. Sci. Comput. 2019) and of the check's own A·(B·r). On operands of either sign,
   all positive, or cancelling, MKL's and OpenBLAS's results stay below 0.3 of that scale
   (``tests/emulator/test_freivalds.py``), so λ leaves a wide margin. A corrupted element
   is flagged when it exceeds the tolerance: for operands of one scale, about
   2·λ·u·K·√n of the tile's RMS element (1 % at K = 2048 and n = 256).
2. **Confirm** (a tile the screen flags). The tile is recomputed in float64 and compared
   element by element with Higham and Mary's probabilistic bound itself,

       |ĉᵢⱼ − cᵢⱼ| ≤ λ₂·√K·u·(|aᵢ|·|bⱼ|),   λ₂ = ``CONFIRM_LAMBDA``,

   which a dot product summed in any order, with or without FMA, meets with probability
   at least 1 − 2K·exp(−λ₂²/2) (their Theorem 2.8): below 10⁻¹⁶ for K up to 10⁵. Only an
   element beyond it (or a non-finite one where the product is finite) makes the tile
   wrong; the screen decides only which tiles are recomputed. (The worst-case bound,
   γ_K·|A|·|B| with γ_K = K·u / (1 − K·u), is √K/λ₂ times wider: at a vocabulary's K it
   would pass an element off by most of its size.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from morphling.kernels.conv import ConvGeometry, conv_forward, conv_grad_input, conv_grad_weight

if TYPE_CHECKING:
    from .conv_partition import ConvTileTask

Array = npt.NDArray[Any]
LAMBDA = 8.0  # the screen's multiple of the rounding errors' scale (module docstring)
CONFIRM_LAMBDA = 10.0  # the confirmation's λ₂: its bound holds but with odds below 1e-16


def unit_roundoff(dtype: np.dtype[Any]) -> float:
    """u: half the machine epsilon of ``dtype``."""
    return float(np.finfo(dtype).eps) / 2


@dataclass
class RequestCheck:
    """The screen's figures for one GEMM, found at its first checked tile: the signs r_J
    of each column block J (``starts``: each block's first column), and for every pivot
    and row A·(B_J·r_J) and |A|·|B_J·r_J| (two passes over A and one over B however many
    tiles and pivots there are)."""

    a: Array  # op(A) [batch, m, K]
    b: Array  # op(B) [batch, K, n]
    starts: list[int]
    rng: np.random.Generator
    signs: Array = field(init=False)  # [n]: r_J in each block's columns
    x: Array = field(init=False)  # [batch, K, blocks]: each B_J·r_J
    reference: Array = field(init=False)  # [batch, m, blocks]: A·(B_J·r_J)

    def __post_init__(self) -> None:
        a, b = self.a, self.b
        dtype = np.result_type(a, b)
        self.signs = (self.rng.integers(0, 2, b.shape[-1]) * 2 - 1).astype(dtype)
        self.x = _block_products(b, self.signs, self.starts)
        self.reference = a @ self.x

    @cached_property
    def scale(self) -> Array:
        """[batch, m, blocks]: |A|·|B_J·r_J|, the size of the check's own rounding errors:
        asked only for a tile whose device term alone does not cover its difference."""
        return _abs_product(self.a, np.abs(self.x))

    def screen(self, pivot: int, rows: slice, cols: slice, c: Array) -> int | None:
        """The first of ``c``'s rows (C[pivot, rows, cols] as the device returned it)
        outside the screen's tolerance, or None when all are within it."""
        block = self.starts.index(cols.start)
        off = np.abs(c @ self.signs[cols] - self.reference[pivot, rows, block])
        unit = LAMBDA * unit_roundoff(c.dtype) * math.sqrt(self.a.shape[-1])
        size = np.sqrt(np.einsum("ij,ij->i", c, c))
        with np.errstate(invalid="ignore"):  # NaN is bad
            if (off <= unit * size).all():  # the device's term covers it: done
                return None
            bad = ~(off <= unit * (size + self.scale[pivot, rows, block]))
        return int(bad.argmax()) if bad.any() else None


def confirm(a: Array, b: Array, c: Array) -> str:
    """Why ``c`` is not op(A)·op(B) for ``a`` [m, K] and ``b`` [K, n] within the
    confirmation's bound (see the module docstring), or empty when it is."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    u = unit_roundoff(c.dtype)
    bound = CONFIRM_LAMBDA * math.sqrt(a.shape[1]) * u * (np.abs(a64) @ np.abs(b64))
    return _wrong(c, exact, bound)


def _wrong(c: Array, exact: Array, bound: Array) -> str:
    """Why ``c`` is off ``exact`` by more than ``bound`` somewhere the product is finite (a
    NaN or an infinity there counts), or empty."""
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, which counts
        bad = np.isfinite(exact) & ~(np.abs(c.astype(np.float64) - exact) <= bound)
    if not bad.any():
        return ""
    at = tuple(int(i) for i in np.unravel_index(int(bad.argmax()), bad.shape))
    where = ", ".join(map(str, at))
    return (
        f"{int(bad.sum())} of {bad.size} elements wrong, the first at ({where}): "
        f"{c[at]!r} where the product is {exact[at]:.9g} ± {bound[at]:.3g}"
    )


def _block_products(b: Array, signs: Array, starts: list[int]) -> Array:
    """[..., K, blocks]: each column block B_J of ``b`` [..., K, n] times its signs, one
    batched product over B's whole blocks and one for a narrower last block."""
    n = b.shape[-1]
    width = starts[1] - starts[0] if len(starts) > 1 else n
    whole = (n // width) * width
    out = np.empty((*b.shape[:-1], len(starts)), np.result_type(b, signs))
    if whole:
        blocks = b[..., :whole].reshape(*b.shape[:-1], whole // width, width)
        out[..., : whole // width] = np.einsum("...kjw,jw->...kj", blocks,
                                               signs[:whole].reshape(-1, width))  # fmt: skip
    if whole < n:
        out[..., -1] = b[..., whole:] @ signs[whole:]
    return out


def _abs_product(a: Array, x: Array) -> Array:
    """|a|·x for a [..., m, K] and x >= 0, |a| made a slice at a time along a's contiguous
    axis (rows, or K for a transposed operand), so each slice's copy stays in cache."""
    if a.strides[-1] > a.strides[-2]:  # K is the slow axis: sum over slices of K
        step = max(1, (1 << 20) // max(1, a.itemsize * math.prod(a.shape[:-1])))
        return sum(np.abs(a[..., k : k + step]) @ x[..., k : k + step, :]
                   for k in range(0, a.shape[-1], step))  # fmt: skip
    step = max(1, (1 << 20) // max(1, a.itemsize * math.prod(a.shape[:-2]) * a.shape[-1]))
    parts = [np.abs(a[..., i : i + step, :]) @ x for i in range(0, a.shape[-2], step)]
    return np.concatenate(parts, axis=-2)


# -- convolution tiles -----------------------------------------------------------------------


def conv_call(tile: ConvTileTask) -> tuple[Callable[[Array, Array], Array], int, ConvGeometry]:
    """The ``kernels.conv`` call that computes ``tile``'s product from its two operands (the
    call its device makes: ``devices/conv_tile.py``), the dot products' length K, and the
    tile's geometry."""
    task = tile.gemm
    whole = task.geometry
    geom = replace(whole, padding=tile.padding, groups=tile.groups)
    kind, taps = task.request.kind, whole.kernel[0] * whole.kernel[1]
    if kind == "forward":
        return (lambda x, w: conv_forward(x, w, geom)), tile.b.shape[1] * taps, geom
    if kind == "grad_input":
        size = (task.input_shape[2], task.input_shape[3])

        def grad_input(dy: Array, w: Array) -> Array:
            return conv_grad_input(dy, w, geom, input_size=size, oh_lo=tile.oh_lo, rows=tile.rows)

        return grad_input, tile.b.shape[0] // tile.groups * taps, geom
    n, _, oh, ow = tile.b.shape
    return (lambda x, dy: conv_grad_weight(x, dy, geom)), n * oh * ow, geom


def screen_conv(tile: ConvTileTask, c: Array, rng: np.random.Generator) -> int | None:
    """The screen for a convolution tile's product ``c`` (module docstring): the first
    element of its check outside the tolerance, or None when all are within it."""
    kind = tile.gemm.request.kind
    call, k, geom = conv_call(tile)
    a, b, groups = tile.a, tile.b, tile.groups
    signs = rng.integers(0, 2, c.shape[1] if kind != "grad_weight" else c[0].size) * 2 - 1
    signs = signs.astype(c.dtype)
    if kind == "grad_weight":  # dW [OC, Cg, kh, kw]: signs over each row's Cg·kh·kw
        rows = c.reshape(c.shape[0], -1)
        got, size = rows @ signs, _norms(rows, 1)
        n, _, oh, ow = b.shape
        probe = np.broadcast_to(signs.reshape(1, *c.shape[1:]), (groups, *c.shape[1:]))
        v = _one_channel_forward(a, np.ascontiguousarray(probe), geom)
        want = np.einsum("ngop,ngp->go", b.reshape(n, groups, -1, oh * ow),
                         v.reshape(n, groups, oh * ow)).reshape(-1)  # fmt: skip
    else:  # forward or grad_input: signs over each group's channels of the product
        n, channels = c.shape[:2]
        per = channels // groups
        flat = c.reshape(n, groups, per, -1)
        u = signs.reshape(groups, per)
        got, size = np.einsum("ngcp,gc->ngp", flat, u), _norms(flat, 2)
        w = b.reshape(groups, b.shape[0] // groups, b.shape[1], -1)
        if kind == "forward":  # Σ u·W over each group's output channels: [G, Cg, kh, kw]
            probe = np.einsum("gokt,go->gkt", w, u).reshape(groups, *b.shape[1:])
            want = _one_channel_forward(a, probe, geom)
        else:  # over each group's input channels: [OC, 1, kh, kw]
            probe = np.einsum("gokt,gk->got", w, u).reshape(b.shape[0], 1, *b.shape[2:])
            want = call(a, probe)
        want = want.reshape(got.shape)
    tolerance = LAMBDA * unit_roundoff(c.dtype) * math.sqrt(k) * (size + np.abs(want))
    bad = ~(np.abs(got - want) <= tolerance)  # NaN is bad
    return int(bad.argmax()) if bad.any() else None


def confirm_conv(tile: ConvTileTask, c: Array) -> str:
    """The confirmation for a convolution tile (module docstring): its product recomputed
    in float64 by the same call, and the same call over absolute values for the bound."""
    call, k, _ = conv_call(tile)
    a64, b64 = tile.a.astype(np.float64), tile.b.astype(np.float64)
    exact = call(a64, b64)
    bound = CONFIRM_LAMBDA * math.sqrt(k) * unit_roundoff(c.dtype) * call(abs(a64), abs(b64))
    return _wrong(c, exact, bound)


def _norms(x: Array, axis: int) -> Array:
    return np.sqrt(np.einsum("...i,...i->...", np.moveaxis(x, axis, -1), np.moveaxis(x, axis, -1)))


def _one_channel_forward(x: Array, probe: Array, geom: ConvGeometry) -> Array:
    """``conv_forward(x, probe, geom)`` for ``probe`` [G, Cg, kh, kw], one output channel
    per group. Where a group has at least as many channels as taps, each tap's sum over
    the channels is one matmul over x, and the output is the taps' shifted sums: x is read
    once and never unfolded. Otherwise (few channels: depthwise, an RGB stem) the kernel
    is cheaper."""
    n, _, height, width = x.shape
    groups, per, kh, kw = probe.shape
    if per < kh * kw:
        return conv_forward(x, probe, geom)
    oh, ow = geom.output_size(height, width)
    (sh, sw), (dh, dw) = geom.stride, geom.dilation
    top, _, left, _ = geom.padding
    taps = np.matmul(
        probe.reshape(groups, per, kh * kw).transpose(0, 2, 1),
        x.reshape(n, groups, per, height * width),
    ).reshape(n, groups, kh, kw, height, width)
    out = np.zeros((n, groups, oh, ow), taps.dtype)
    for i in range(kh):
        r0, r1, rows = _reach(i * dh - top, sh, oh, height)
        for j in range(kw):
            c0, c1, cols = _reach(j * dw - left, sw, ow, width)
            if r0 < r1 and c0 < c1:
                out[:, :, r0:r1, c0:c1] += taps[:, :, i, j, rows, cols]
    return out


def _reach(offset: int, stride: int, out_len: int, in_len: int) -> tuple[int, int, slice]:
    """The outputs [lo, hi) whose input index o·stride + offset lies in [0, in_len), and
    those inputs."""
    lo = max(0, -(offset // stride))
    hi = min(out_len, (in_len - 1 - offset) // stride + 1)
    if hi <= lo:
        return 0, 0, slice(0, 0)
    return lo, hi, slice(lo * stride + offset, (hi - 1) * stride + offset + 1, stride)

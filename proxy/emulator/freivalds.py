"""A device's tile checked, not believed: Freivalds' check and its tolerance rule.

A GEMM tile C = A·B ([m, n]: op(A)'s rows, op(B)'s columns, all K) is checked with random weights
r: C·r against A·(B·r), O(mK + Kn + mn) work instead of the product's O(mnK). The
weights are drawn per request and per column block of tiles, from a generator the devices
never see; ``RequestCheck`` computes B·r and A·(B·r) for every column block of every pivot
at once, then screens each tile as it comes in: one pass over each of A and B per request,
and over C as its tiles arrive.

A convolution is checked through its GEMM view (an implicit GEMM: y = W·unfold(x)), never
unfolding x, all its tiles at once (``ConvScreen``): its product's channels in each of
its tiles' channel blocks within a group are summed with random weights u (forward:
output channels; grad input: input channels), and the same sums are computed from the
request's operands with one channel per block — Σu·W applied to x or to dy, each tap's
sum over the channels one matmul over x (dy), then the taps' sums added where they land
(where a group has fewer channels than taps, a depthwise convolution of x summed over
each group's channels, or the kernel's own grad input of dy). A failing position flags
the tile holding its block and row.
A grad-weight dW [OC, C·kh·kw] = dy·unfold(x)ᵀ takes weights r over each row's input-channel
blocks: dW·r against dy·(unfold(x)ᵀ·r), where unfold(x)ᵀ·r is x convolved with r, one
output channel. K is then the length of the dot products (C/groups·kh·kw,
OC/groups·kh·kw or N·OH·OW), and the tolerance's second term the same reference over
absolute values.

Two stages (docs/PROTOCOL.md, *Verification*):

1. **Screen** (every tile checked). Row i passes when

       |(C·r − A·(B·r))ᵢ| ≤ λ·u·√K·(2·‖ĉᵢ‖ + |aᵢ|·|B·r|)

   u being the unit roundoff (2⁻²⁴ float32, 2⁻⁵³ float64) and λ = ``LAMBDA``. The two terms
   are the sizes of the rounding errors of a K-term dot product summed in any order (the
   device's, ‖ĉᵢ‖ scaled as Higham and Mary's probabilistic bound scales a dot product's,
   SIAM J. Sci. Comput. 2019) and of the check's own A·(B·r), the latter made only for a
   request whose tile the former does not cover. The weights r are random signs times
   magnitudes in [1, 2) (so two columns swapped never cancel), hence the 2 in the device's
   term. A non-finite element where the reference is finite is always flagged. Honest
   results of operands of either sign, all positive, or badly scaled stay far inside it
   (``tests/emulator/test_freivalds.py``); BENCHMARKS.md has the measured detection of one
   element changed by a few percent.
2. **Confirm** (a tile the screen flags). The tile is recomputed in float64 and compared
   element by element with Higham and Mary's probabilistic bound itself,

       |ĉᵢⱼ − cᵢⱼ| ≤ λ₂·√K·u·(|aᵢ|·|bⱼ|),   λ₂ = ``CONFIRM_LAMBDA``,

   which a dot product summed in any order, with or without FMA, meets with probability
   at least 1 − 2K·exp(−λ₂²/2) (their Theorem 2.8): below 10⁻¹⁶ for K up to 10⁵. Only an
   element beyond it (or a non-finite one where the product is finite) makes the tile
   wrong; the screen decides only which tiles are recomputed. An element whose exact value
   overflows the dtype is not judged (an honest kernel returns ±inf there), and both stages
   add (K + 1) times the dtype's smallest normal number, so results in the subnormal range
   (or flushed to zero) are not refused. (The worst-case bound,
   γ_K·|A|·|B| with γ_K = K·u / (1 − K·u), is √K/λ₂ times wider: at a vocabulary's K it
   would pass an element off by most of its size.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from morphling.kernels.conv import ConvGeometry, conv_forward, conv_grad_input, conv_grad_weight
from morphling.kernels.screen import ProductScreen

if TYPE_CHECKING:
    from .conv_partition import ConvTask, ConvTileTask

Array = npt.NDArray[Any]
Draw = Callable[[int, np.dtype[Any]], Array]  # n fresh screen weights of a dtype (``weights``)
LAMBDA = 8.0  # the screen's multiple of the rounding errors' scale (module docstring)
CONFIRM_LAMBDA = 10.0  # the confirmation's λ₂: its bound holds but with odds below 1e-16
CHUNK_BYTES = 32 << 20  # a convolution's screen takes images in groups of about this many
# bytes of tap sums


def unit_roundoff(dtype: np.dtype[Any]) -> float:
    """u: half the machine epsilon of ``dtype``."""
    return float(np.finfo(dtype).eps) / 2


@dataclass
class RequestCheck:
    """The screen of one GEMM's product ``c``: the weights r_J of each column block J
    (blocks of ``edge`` columns), and for every pivot and row A·(B_J·r_J) (one pass over
    A and one over B however many tiles and pivots there are; |A|·|B_J·r_J| too, a second
    pass over A, for a request whose device term falls short); then each tile judged as it
    comes in, a pass over its block of C (``fails``)."""

    a: Array  # op(A) [batch, m, K]
    b: Array  # op(B) [batch, K, n]
    c: Array  # its product [batch, m, n], C-contiguous, as the tiles come in
    edge: int  # the tiles' width (the last may be narrower)
    signs: Array  # [n]: r_J in each block's columns (``weights``), of the product's dtype
    x: Array = field(init=False)  # [batch, K, blocks]: each B_J·r_J
    reference: Array = field(init=False)  # [batch, m, blocks]: A·(B_J·r_J)

    def __post_init__(self) -> None:
        self.x = _block_products(self.b, self.signs, self.edge)
        self.reference = self.a @ self.x
        unit, floor = _screen_terms(self.a.shape[-1], self.c.dtype)
        self._pass = ProductScreen(self.c, self.signs, self.edge, self.reference, unit, floor)

    @cached_property
    def scale(self) -> Array:
        """[batch, m, blocks]: |A|·|B_J·r_J|, the size of the check's own rounding errors:
        asked only for a tile whose device term alone does not cover its difference."""
        return _abs_product(self.a, np.abs(self.x))

    def fails(self, pivot: int, rows: slice, cols: slice) -> bool:
        """Whether the tile ``c[pivot, rows, cols]`` (whole column blocks, from a block's
        first column; the last may be narrower) falls outside the screen's tolerance
        somewhere: one pass over it (``kernels.screen``), the check's own term only where
        the device's does not cover the difference."""
        off = self._pass.tile(pivot, rows, cols)
        if off is None:
            return False
        got, norms = off
        blocks = slice(cols.start // self.edge, -(-cols.stop // self.edge))
        want = self.reference[pivot, rows, blocks]

        def own() -> Array:
            return self.scale[pivot, rows, blocks]

        return bool(_off(got, want, norms, own, self.a.shape[-1], self.c.dtype).any())


def confirm(a: Array, b: Array, c: Array) -> str:
    """Why ``c`` is not op(A)·op(B) for ``a`` [m, K] and ``b`` [K, n] within the
    confirmation's bound (see the module docstring), or empty when it is."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    return _wrong(c, exact, np.abs(a64) @ np.abs(b64), a.shape[1])


def weights(rng: np.random.Generator, n: int, dtype: np.dtype[Any]) -> Array:
    """n random weights: a random sign times a magnitude in [1, 2)."""
    signs = rng.integers(0, 2, n) * 2 - 1
    return (signs * (1 + rng.random(n))).astype(dtype)


def _floor(k: int, dtype: np.dtype[Any]) -> float:
    """(K + 1)·the smallest normal number: what subnormal results (or their flushing to
    zero) may be off, below every relative bound."""
    return (k + 1) * float(np.finfo(dtype).tiny)


def _screen_terms(k: int, dtype: np.dtype[Any]) -> tuple[float, float]:
    """The screen's λ·u·√K, the unit its tolerance's terms are scaled by, and its floor."""
    return LAMBDA * unit_roundoff(dtype) * math.sqrt(k), _floor(k, dtype)


def _outside(got: Array, want: Array, tolerance: Array) -> Array:
    """Where ``got`` is off ``want`` by more than ``tolerance``, or non-finite where ``want``
    is finite (NaN counts as off)."""
    with np.errstate(invalid="ignore"):
        off: Array = ~(np.abs(got - want) <= tolerance) | (~np.isfinite(got) & np.isfinite(want))
    return off


def _wrong(c: Array, exact: Array, magnitude: Array, k: int) -> str:
    """Why ``c`` is off ``exact`` by more than the confirmation's bound (``magnitude``: the
    sum of the terms' absolute values, in float64) somewhere that sum stays within the
    dtype's range (a NaN or an infinity there counts), or empty. Where it does not, an
    honest kernel's partial sums may overflow: nothing is judged there."""
    u = unit_roundoff(c.dtype)
    bound = CONFIRM_LAMBDA * math.sqrt(k) * u * magnitude + _floor(k, c.dtype)
    judged = magnitude <= float(np.finfo(c.dtype).max)  # (False for NaN)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, which counts
        bad = judged & ~(np.abs(c.astype(np.float64) - exact) <= bound)
    if not bad.any():
        return ""
    at = tuple(int(i) for i in np.unravel_index(int(bad.argmax()), bad.shape))
    where = ", ".join(map(str, at))
    return (
        f"{int(bad.sum())} of {bad.size} elements wrong, the first at ({where}): "
        f"{float(c[at]):.9g} where the product is {exact[at]:.9g} ± {bound[at]:.3g}"
    )


def _block_products(b: Array, signs: Array, width: int) -> Array:
    """[..., K, blocks]: each column block B_J (``width`` columns) of ``b`` [..., K, n] times
    its weights. Where b's columns are strided (a transposed operand), a matrix-vector
    product per block: BLAS reads that layout, numpy's blockwise dot products crawl on it."""
    dtype = np.result_type(b, signs)
    n = b.shape[-1]
    if n > width and b.strides[-1] != b.itemsize:
        out = np.empty((*b.shape[:-1], -(-n // width)), dtype)
        for j, start in enumerate(range(0, n, width)):
            cols = slice(start, start + width)
            out[..., j] = b[..., cols] @ signs[cols]
        return out

    def times_weights(part: Array, cols: slice) -> Array:
        w = signs[cols]
        if w.size == part.shape[-1]:  # one block's columns: a matrix-vector product
            product: Array = part @ w
            return product
        blocks: Array = np.vecdot(part, w.reshape(-1, part.shape[-1]))
        return blocks

    return _by_block(b, width, dtype, times_weights)


def _by_block(
    x: Array, width: int, dtype: np.dtype[Any], each: Callable[[Array, slice], Array]
) -> Array:
    """[..., rows, blocks]: ``each(part, its columns)`` for the column blocks of ``x``
    (``width`` wide, the last maybe narrower), a row's figure per block: one call for x's
    whole blocks (as [..., rows, blocks, width]) and one for a narrower last."""
    n = x.shape[-1]
    if n <= width:
        one: Array = each(x, slice(0, n))[..., None]
        return one
    whole = (n // width) * width
    out = np.empty((*x.shape[:-1], -(-n // width)), dtype)
    out[..., : whole // width] = each(x[..., :whole].reshape(*x.shape[:-1], -1, width),
                                      slice(0, whole))  # fmt: skip
    if whole < n:
        out[..., -1] = each(x[..., whole:], slice(whole, n))
    return out


def _abs_product(a: Array, x: Array) -> Array:
    """|a|·x for a [..., m, K] and x >= 0, |a| made a slice at a time along a's contiguous
    axis (rows, or K for a transposed operand), so each slice's copy stays in cache."""
    if a.strides[-1] > a.strides[-2]:  # K is the slow axis: sum over slices of K
        step = max(1, (1 << 20) // max(1, a.itemsize * math.prod(a.shape[:-1])))
        total = np.zeros((*a.shape[:-1], x.shape[-1]), np.result_type(a, x))
        for k in range(0, a.shape[-1], step):
            total += np.abs(a[..., k : k + step]) @ x[..., k : k + step, :]
        return total
    step = max(1, (1 << 20) // max(1, a.itemsize * math.prod(a.shape[:-2]) * a.shape[-1]))
    parts = [np.abs(a[..., i : i + step, :]) @ x for i in range(0, a.shape[-2], step)]
    return np.concatenate(parts, axis=-2)


# -- convolution tiles -----------------------------------------------------------------------


def conv_call(tile: ConvTileTask) -> tuple[Callable[[Array, Array], Array], int, ConvGeometry]:
    """The ``kernels.conv`` call that computes ``tile``'s product from its two operands (the
    call its device makes: ``devices/conv_tile.py``), the dot products' length K, and the
    tile's geometry."""
    task, geom = tile.gemm, tile.geometry
    kind, taps = task.request.kind, geom.kernel[0] * geom.kernel[1]
    if kind == "forward":
        return (lambda x, w: conv_forward(x, w, geom)), tile.b.shape[1] * taps, geom
    if kind == "grad_input":
        size = (task.input_shape[2], task.input_shape[3])

        def grad_input(dy: Array, w: Array) -> Array:
            return conv_grad_input(dy, w, geom, input_size=size, oh_lo=tile.oh_lo, rows=tile.rows)

        return grad_input, tile.b.shape[0] // tile.groups * taps, geom
    n, _, oh, ow = tile.b.shape
    return (lambda x, dy: conv_grad_weight(x, dy, geom)), n * oh * ow, geom


class ConvScreen:
    """The screen of a convolution's whole product (module docstring): its weights drawn
    (from ``draw``) and its reference computed from the operands alone (``reference``,
    which may run while devices compute the tiles), then the product judged (``flags``).
    Each of the request's channel pieces (``ConvTask.screen_pieces``: its tiles' channel
    blocks within a group) is summed with its own weights, as a tile's would be."""

    def __init__(self, task: ConvTask, draw: Draw) -> None:
        self.task = task
        c, geom, kind = task.out, task.geometry, task.request.kind
        self.pieces, groups = task.screen_pieces, geom.groups
        self.widths = [hi - lo for lo, hi in self.pieces]
        taps = geom.kernel[0] * geom.kernel[1]
        if kind == "grad_weight":  # r over each row's Cg·kh·kw
            self.r = draw(c[0].size, c.dtype).reshape(c.shape[1:])
            self.k = task.b[:, 0].size
            return
        channels = c.shape[1]
        self.u = draw(channels, c.dtype).reshape(groups, 1, channels // groups)
        w = task.b.reshape(groups, task.b.shape[0] // groups, task.b.shape[1], taps)
        if kind == "forward":  # Σ u·W over each piece's output channels
            self.k = w.shape[2] * taps
            sums = [np.matmul(self.u[..., lo:hi], w[:, lo:hi].reshape(groups, hi - lo, -1))
                    for lo, hi in self.pieces]  # fmt: skip
            self.probe = np.concatenate(sums, axis=1).reshape(-1, *task.b.shape[1:])
            self.call: Callable[[Array, Array], Array] = partial(_one_channel_forward, geom=geom)
        else:  # over each piece's input channels: [OC, pieces, kh, kw]
            self.k = w.shape[1] * taps
            sums = [np.matmul(self.u[:, None, :, lo:hi], w[:, :, lo:hi]) for lo, hi in self.pieces]
            self.probe = np.concatenate(sums, axis=2).reshape(task.b.shape[0], -1, *geom.kernel)
            size = (c.shape[2], c.shape[3])
            self.call = partial(_one_channel_grad_input, geom=geom, size=size)
        image = groups * len(self.pieces) * taps * task.a[0, 0].size * task.a.itemsize
        self.step = max(1, CHUNK_BYTES // max(1, image))  # images at a time (tap sums' bytes)

    def reference(self) -> Array:
        """The sums computed from the operands: forward, grad_input: [N, G, pieces, rows·
        columns]; grad_weight: [OC, pieces]."""
        task = self.task
        if task.request.kind == "grad_weight":
            return self._grad_weight_reference()
        n, _, rows, cols = task.out.shape
        want = np.empty((n, self.u.shape[0], len(self.pieces), rows * cols), task.out.dtype)
        for n0 in range(0, n, self.step):
            part = self.call(task.a[n0 : n0 + self.step], self.probe)
            want[n0 : n0 + self.step] = part.reshape(want[n0 : n0 + self.step].shape)
        return want

    def flags(self, want: Array) -> Array:
        """Where the product fails against ``want`` (``reference``'s), per channel of the
        product and row of it (forward, grad_input: any image or column) or per output and
        input channel (grad_weight: any tap)."""
        task, c = self.task, self.task.out
        if task.request.kind == "grad_weight":
            return self._grad_weight_flags(want)
        n, channels, rows, cols = c.shape
        groups = self.u.shape[0]
        flat = c.reshape(n, groups, channels // groups, rows * cols)
        bad = np.zeros((groups, len(self.pieces), rows), bool)
        for n0 in range(0, n, self.step):
            part, chunk = flat[n0 : n0 + self.step], slice(n0, n0 + self.step)
            got = np.stack([np.matmul(self.u[..., lo:hi], part[:, :, lo:hi])[:, :, 0]
                            for lo, hi in self.pieces], 2)  # fmt: skip
            norms = np.stack([_norms(part[:, :, lo:hi], 2) for lo, hi in self.pieces], 2)
            own = partial(_absolute, self.call, (task.a[chunk], self.probe), got.shape)
            off = _off(got, want[chunk], norms, own, self.k, c.dtype)
            bad |= off.reshape(*off.shape[:3], rows, cols).any(axis=(0, 4))
        return np.repeat(bad, self.widths, axis=1).reshape(channels, rows)

    def _grad_weight_reference(self) -> Array:
        """dW·r's reference, dy·(x ⋆ r) for each piece (one output channel per group)."""
        task, geom, r = self.task, self.task.geometry, self.r
        x, dy, groups = task.a, task.b, geom.groups
        n, oc, oh, ow = dy.shape
        per = x.shape[1] // groups
        x_g = x.reshape(n, groups, per, *x.shape[2:])
        self.v = np.empty((n, groups, oh * ow, len(self.pieces)), task.out.dtype)
        for p, (lo, hi) in enumerate(self.pieces):
            probe = np.ascontiguousarray(np.broadcast_to(r[lo:hi], (groups, *r[lo:hi].shape)))
            inputs = x_g[:, :, lo:hi].reshape(n, groups * (hi - lo), *x.shape[2:])
            self.v[..., p] = _one_channel_forward(inputs, probe, geom).reshape(n, groups, -1)
        self.dy = dy.reshape(n, groups, oc // groups, oh * ow)
        want: Array = np.matmul(self.dy, self.v).sum(axis=0).reshape(oc, -1)  # Σ images, positions
        return want

    def _grad_weight_flags(self, want: Array) -> Array:
        c, r = self.task.out, self.r
        oc = c.shape[0]
        got, norms = np.empty((oc, len(self.pieces)), c.dtype), np.empty((oc, len(self.pieces)))
        for p, (lo, hi) in enumerate(self.pieces):
            rows = c[:, lo:hi].reshape(oc, -1)
            got[:, p], norms[:, p] = rows @ r[lo:hi].reshape(-1), _norms(rows, 1)

        def own() -> Array:  # its sums' errors over N·OH·OW terms (x ⋆ r's: smaller)
            terms: Array = np.matmul(np.abs(self.dy), np.abs(self.v)).sum(axis=0)
            return terms.reshape(oc, -1)

        bad = _off(got, want, norms, own, self.k, c.dtype)
        return np.repeat(bad, self.widths, axis=1)


def _absolute(reference: Callable[[Array, Array], Array], operands: tuple[Array, Array],
              shape: tuple[int, ...]) -> Array:  # fmt: skip
    """``reference`` over the operands' absolute values: the size of its own errors."""
    return reference(*(np.abs(x) for x in operands)).reshape(shape)


def conv_flagged(flags: Array, tile: ConvTileTask) -> bool:
    """Whether ``ConvScreen.flags`` touch ``tile``'s part of the product."""
    at = tile.out_index
    first = 0 if tile.gemm.request.kind == "grad_weight" else 1
    return bool(flags[at[first], at[first + 1]].any())


def _off(
    got: Array, want: Array, size: Array, own: Callable[[], Array], k: int, dtype: np.dtype[Any]
) -> Array:
    """Where the screen fails: outside the device's term alone, and then also outside it
    plus the reference's own errors' size (``own()``, made only then)."""
    unit, floor = _screen_terms(k, dtype)
    bad = _outside(got, want, unit * 2 * size + floor)
    if bad.any():
        bad &= _outside(got, want, unit * (2 * size + own()) + floor)
    return bad


def confirm_conv(tile: ConvTileTask, c: Array) -> str:
    """The confirmation for a convolution tile (module docstring): its product recomputed
    in float64 by the same call, and the same call over absolute values for the bound."""
    call, k, _ = conv_call(tile)
    a64, b64 = tile.a.astype(np.float64), tile.b.astype(np.float64)
    exact = call(a64, b64)
    return _wrong(c, exact, call(abs(a64), abs(b64)), k)


def _norms(x: Array, axis: int) -> Array:
    """The 2-norms of ``x`` along ``axis``, in float64. Summed in ``x``'s dtype (a float64
    sum is four times slower over float32), again in float64 where that overflowed or
    met a non-finite element. (Squares that underflow can only make a norm smaller: a
    tile sent to the confirmation, never one refused.) An inner axis is summed by einsum
    in x's own layout: dot products along it, as a moved axis's, stride through memory."""
    with np.errstate(over="ignore"):  # (summed again below)
        if axis in (-1, x.ndim - 1):
            sums = np.vecdot(x, x)
        else:
            subscripts = "abcdefgh"[: x.ndim]
            kept = subscripts.replace(subscripts[axis], "")
            sums = np.einsum(f"{subscripts},{subscripts}->{kept}", x, x)
        squares = sums.astype(np.float64)
    spilled = ~np.isfinite(squares)
    if spilled.any():
        wide = np.moveaxis(x, axis, -1)[spilled].astype(np.float64)
        squares[spilled] = np.vecdot(wide, wide)
    norms: Array = np.sqrt(squares)
    return norms


def _one_channel_forward(x: Array, probe: Array, geom: ConvGeometry) -> Array:
    """``conv_forward(x, probe, geom)`` for ``probe`` [G·P, Cg, kh, kw], few (P) output
    channels per group. Where a group has at least as many channels as taps, each tap's
    sum over the channels is one matmul over x, and the output is the taps' shifted sums:
    x is read once and never unfolded. Otherwise (few channels: depthwise, an RGB stem)
    each channel is convolved with its own taps (a depthwise convolution: the C kernel,
    which unfolds nothing either), and a group's channels are summed."""
    n, _, height, width = x.shape
    outputs, per, kh, kw = probe.shape
    groups = geom.groups
    if per < kh * kw:
        few = outputs // groups  # probes per group: channel c·few + p has probe p's taps
        taps = probe.reshape(groups, few, per, kh, kw).transpose(0, 2, 1, 3, 4)
        each = conv_forward(x, np.ascontiguousarray(taps).reshape(-1, 1, kh, kw),
                            replace(geom, groups=groups * per))  # fmt: skip
        oh, ow = each.shape[2:]
        summed: Array = each.reshape(n, groups, per, few, oh, ow).sum(axis=2)
        return summed.reshape(n, outputs, oh, ow)
    taps = probe.reshape(groups, outputs // groups, per, kh * kw).transpose(0, 1, 3, 2)
    sums = _tap_sums(taps.reshape(groups, -1, per), x, geom.kernel)
    oh, ow = geom.output_size(height, width)
    (sh, sw), (dh, dw) = geom.stride, geom.dilation
    top, _, left, _ = geom.padding
    out = np.zeros((*sums.shape[:3], oh, ow), sums.dtype)
    for i in range(kh):
        r0, r1, rows = _reach(i * dh - top, sh, oh, height)
        for j in range(kw):
            c0, c1, cols = _reach(j * dw - left, sw, ow, width)
            if r0 < r1 and c0 < c1:
                out[..., r0:r1, c0:c1] += sums[:, :, :, i, j, rows, cols]
    return out.reshape(n, outputs, oh, ow)


def _one_channel_grad_input(
    dy: Array, probe: Array, geom: ConvGeometry, size: tuple[int, int]
) -> Array:
    """``conv_grad_input(dy, probe, geom)`` for ``probe`` [OC, P, kh, kw], few (P) input
    channels per group, of an input of ``size``. Where a group has at least as many output
    channels as taps, each tap's sum over them is one matmul over dy, and the taps' sums
    are added where they land: dy is read once. Otherwise (depthwise) the kernel is cheaper."""
    n, out_channels, r, ow = dy.shape
    groups, (kh, kw), (height, width) = geom.groups, probe.shape[2:], size
    per, inputs = out_channels // groups, probe.shape[1]
    if per < kh * kw:
        return conv_grad_input(dy, probe, geom, input_size=size)
    taps = probe.reshape(groups, per, inputs * kh * kw).transpose(0, 2, 1)
    sums = _tap_sums(taps, dy, geom.kernel)
    (sh, sw), (dh, dw) = geom.stride, geom.dilation
    top, _, left, _ = geom.padding
    out = np.zeros((n, groups, inputs, height, width), sums.dtype)
    for i in range(kh):  # dy's row o reaches input row o·sh + i·dh − top
        r0, r1, at_rows = _reach(i * dh - top, sh, r, height)
        for j in range(kw):
            c0, c1, at_cols = _reach(j * dw - left, sw, ow, width)
            if r0 < r1 and c0 < c1:
                out[..., at_rows, at_cols] += sums[:, :, :, i, j, r0:r1, c0:c1]
    return out.reshape(n, groups * inputs, height, width)


def _tap_sums(taps: Array, x: Array, kernel: tuple[int, int]) -> Array:
    """[N, G, P, kh, kw, H, W]: each of ``taps`` [G, P·kh·kw, channels per group] (P probes'
    taps) as a weighted sum of its group's channels of ``x`` [N, C, H, W], one matmul for
    them all."""
    n, channels, height, width = x.shape
    groups = taps.shape[0]
    sums: Array = np.matmul(taps, x.reshape(n, groups, channels // groups, height * width))
    return sums.reshape(n, groups, -1, *kernel, height, width)


def _reach(offset: int, stride: int, out_len: int, in_len: int) -> tuple[int, int, slice]:
    """The outputs [lo, hi) whose input index o·stride + offset lies in [0, in_len), and
    those inputs."""
    lo = max(0, -(offset // stride))
    hi = min(out_len, (in_len - 1 - offset) // stride + 1)
    if hi <= lo:
        return 0, 0, slice(0, 0)
    return lo, hi, slice(lo * stride + offset, (hi - 1) * stride + offset + 1, stride)

"""What the virtual clock reads of a GEMM or a convolution and its tiles: the shapes of
its work, no more; and how a convolution tile's compute is priced.

The emulator's partition (``proxy.emulator.partition``, ``conv_partition``) builds the
requests and tiles the clock places; these protocols name what the clock needs of them, so
that the clock depends on nothing of the emulator's (any object with these attributes will
do) and the emulator may change what else a tile carries without the clock knowing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from morphling.devices.models.compute import ComputeModel, GemmShape

from .eventlog import conv_op
from .memory import Key


@dataclass(frozen=True, slots=True)
class ConvWork:
    """What one convolution tile computes, in ``morphling.kernels.conv``'s terms: ``kind``
    (forward, grad_input, grad_weight), over ``batch`` images, ``channels`` input channels
    and ``out_channels`` output channels in ``groups`` groups; ``in_size`` the input rows ×
    columns the tile reads (forward: its region; grad_weight: all) or produces (grad_input:
    its band), ``out_size`` the output (-gradient) rows × columns it computes or reads."""

    kind: str
    dtype: str
    batch: int
    channels: int
    out_channels: int
    groups: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    in_size: tuple[int, int]
    out_size: tuple[int, int]

    @property
    def op(self) -> str:
        return conv_op(self.kind)


def implicit_gemm(conv: ConvWork) -> GemmShape:
    """The GEMM a convolution tile comes to as the device computes it (unfold, then one
    product per group, summed here into one): forward W·cols, grad_input Wᵀ·dy, grad_weight
    dy·colsᵀ, each with the dense formulation's FLOPs (``kernels.conv.conv_flops``).
    Depthwise tiles run a direct kernel; they are priced as this GEMM all the same. An
    empty dimension (a band no output row reaches) is priced as 1, as a GEMM's k = 0 is."""
    kh, kw = conv.kernel
    per_group = conv.channels // conv.groups * kh * kw  # the unfolded rows of one group
    positions = conv.batch * conv.out_size[0] * conv.out_size[1]
    if conv.kind == "forward":
        m, n, k, ta, tb = conv.out_channels, positions, per_group, False, False
    elif conv.kind == "grad_input":
        m, n, k = conv.channels * kh * kw, positions, conv.out_channels // conv.groups
        ta, tb = True, False
    else:  # grad_weight
        m, n, k, ta, tb = conv.out_channels, per_group, positions, False, True
    m, n, k = max(m, 1), max(n, 1), max(k, 1)
    lda, ldb = (m if ta else k), (k if tb else n)
    return GemmShape(m, n, k, ta, tb, lda, ldb, conv.dtype)


def conv_seconds(model: ComputeModel, conv: ConvWork) -> float:
    """A convolution tile's seconds at the top clock on a device whose GEMMs ``model``
    prices: its implicit GEMM's, until a fitted convolution model replaces this."""
    return model.predict_s(implicit_gemm(conv))


class GemmHeader(Protocol):
    """A GEMM's shape as the job declared it: C = op(A)·op(B), ``[batch, m, n]``."""

    @property
    def m(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def k(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def ta(self) -> bool: ...
    @property
    def tb(self) -> bool: ...
    @property
    def dtype(self) -> str: ...


class Operand(Protocol):
    """One operand block of a tile as it would travel: its bytes, its leading dimension as
    sent, and, for a block of the shared weights, where it lies and which version it is
    (what a device's memory keeps it under)."""

    @property
    def offset(self) -> int | None: ...  # in the shared weights; None: the job's own bytes
    @property
    def version(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def sent_ld(self) -> int: ...
    @property
    def key(self) -> Key: ...


class TileWork(Protocol):
    """One tile: the two operand blocks it needs and, for a GEMM's, its output block's
    shape; for a convolution's, ``conv`` says what it computes (None: a GEMM tile)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def conv(self) -> ConvWork | None: ...
    @property
    def out_bytes(self) -> int: ...
    def operands(self) -> tuple[Operand, Operand]: ...


class GemmWork(Protocol):
    """A GEMM or a convolution the clock issues. ``header`` is the GEMM (a convolution's:
    its whole implicit GEMM, which the event log records), ``op`` which it is
    (``GEMM_OP``, ``conv_op``). ``oom`` counts its tiles that did not fit on their device
    (emulated OOMs): the clock adds to it, the emulator reports it to the job."""

    oom: int

    @property
    def id(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def header(self) -> GemmHeader: ...

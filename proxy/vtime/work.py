"""What the virtual clock reads of a GEMM or a convolution and its tiles: the shapes of
its work, no more.

The emulator's partition (``proxy.emulator.partition``, ``conv_partition``) builds the
requests and tiles the clock places; these protocols name what the clock needs of them, so
that the clock depends on nothing of the emulator's (any object with these attributes will
do) and the emulator may change what else a tile carries without the clock knowing.
"""

from __future__ import annotations

from typing import Protocol

from morphling.devices.models.compute import GemmShape
from morphling.devices.models.conv_shape import ConvShape

from .memory import Key, Region


def implicit_gemm(conv: ConvShape) -> GemmShape:
    """The GEMM a convolution comes to as the device computes it (unfold, then one product
    per group, summed here into one): forward W·cols, grad_input Wᵀ·dy, grad_weight
    dy·colsᵀ, with the dense formulation's FLOPs (a stride-1 grad input is computed as a
    forward convolution: ``ConvShape.computed``). What the event log records of a whole
    convolution; its tiles are priced by the device's convolution model."""
    conv = conv.computed()
    kh, kw = conv.kernel
    per_group = conv.c // conv.groups * kh * kw  # the unfolded rows of one group
    positions = conv.n * conv.out_rows * conv.out_size[1]
    if conv.kind == "forward":
        m, n, k, ta, tb = conv.oc, positions, per_group, False, False
    elif conv.kind == "grad_input":
        m, n, k = conv.c * kh * kw, positions, conv.oc // conv.groups
        ta, tb = True, False
    else:  # grad_weight
        m, n, k, ta, tb = conv.oc, per_group, positions, False, True
    lda, ldb = (m if ta else k), (k if tb else n)
    return GemmShape(m, n, k, ta, tb, lda, ldb, conv.dtype)


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
    sent, and what a device's memory keeps it under (``key``): for a block of the shared
    weights, where it lies and which version it is; for the job's own bytes, its
    panel id (named by its bytes)."""

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
    @property
    def region(self) -> Region | None: ...  # where it lies, for a block within one held


class TileWork(Protocol):
    """One tile: the two operand blocks it needs and, for a GEMM's, its output block's
    shape; for a convolution's, ``conv`` says what it computes (None: a GEMM tile)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def conv(self) -> ConvShape | None: ...
    @property
    def out_bytes(self) -> int: ...
    def operands(self) -> tuple[Operand, Operand]: ...


class GemmWork(Protocol):
    """A GEMM or a convolution the clock issues. ``header`` is the GEMM (a convolution's:
    its whole implicit GEMM, which the event log records), ``op`` which it is
    (``GEMM_OP``, ``conv_op``). ``oom`` counts its tiles that did not fit on their device
    (emulated OOMs): the clock adds to it, the emulator reports it to the job. ``sent``:
    its tiles go to devices (False: a rank's own product, which they only time)."""

    oom: int

    @property
    def id(self) -> int: ...
    @property
    def sent(self) -> bool: ...
    @property
    def op(self) -> str: ...
    @property
    def header(self) -> GemmHeader: ...

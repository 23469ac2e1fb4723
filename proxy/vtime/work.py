"""What the virtual clock reads of a GEMM and its tiles: the shapes of its work, no more.

The emulator's partition (``proxy.emulator.partition``) builds the GEMMs and tiles the
clock places; these protocols name what the clock needs of them, so that the clock
depends on nothing of the emulator's (any object with these attributes will do) and the
emulator may change what else a tile carries without the clock knowing.
"""

from __future__ import annotations

from typing import Protocol

from .memory import Key


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


class Output(Protocol):
    """The GEMM's output array: only the size of its elements matters here."""

    @property
    def itemsize(self) -> int: ...


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
    """One tile: its output block's shape and the two operand blocks it needs."""

    @property
    def shape(self) -> tuple[int, int]: ...
    def operands(self) -> tuple[Operand, Operand]: ...


class GemmWork(Protocol):
    """A GEMM the clock issues. ``oom`` counts its tiles that did not fit on their
    device (emulated OOMs): the clock adds to it, the emulator reports it to the job."""

    oom: int

    @property
    def id(self) -> int: ...
    @property
    def request(self) -> GemmHeader: ...
    @property
    def out(self) -> Output: ...

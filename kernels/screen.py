"""Stage one of the emulator's Freivalds screen, one pass over a block of a product
(``c/screen.c``).

``proxy/emulator/freivalds.py`` has the rule and why; this is its arithmetic, bound once
to a product, its weights and its reference (``ProductScreen``), then run in place on
each tile's block as the tile comes in: in one call, where numpy made it a dozen passes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._native import ffi, lib

Array = npt.NDArray[Any]
_C_TYPES = {np.dtype(np.float32): ("f32", "float[]"), np.dtype(np.float64): ("f64", "double[]")}


class ProductScreen:
    """The pass over the blocks of one product C [batch, m, n] (C-contiguous): for each
    row of a block and each of its column blocks of ``edge`` columns (the last maybe
    narrower), the sum weighted by ``weights`` [n] and the 2-norm, both in float64, and
    whether ``|sum − reference| <= unit·2·norm + subnormal`` fails (a NaN fails) or the
    sum is not finite where ``reference`` [batch, m, blocks] is."""

    def __init__(
        self, c: Array, weights: Array, edge: int, reference: Array, unit: float,
        subnormal: float,
    ) -> None:  # fmt: skip
        if c.dtype not in _C_TYPES:
            raise TypeError(f"screen: dtype {c.dtype} is not float32 or float64")
        if c.ndim != 3 or not c.flags.c_contiguous:
            raise ValueError(f"screen: product {c.shape} is not a C-contiguous [batch, m, n]")
        batch, m, n = c.shape
        blocks = -(-n // edge) if edge > 0 else 0
        if edge <= 0 or weights.shape != (n,) or reference.shape != (batch, m, blocks):
            raise ValueError(
                f"screen: product {c.shape}, weights {weights.shape}, edge {edge} and "
                f"reference {reference.shape} do not fit"
            )
        suffix, ctype = _C_TYPES[c.dtype]
        self.shape, self.edge, self.blocks = c.shape, edge, blocks
        self._unit, self._subnormal = unit, subnormal
        self._pass = getattr(lib, f"mg_screen_{suffix}")
        # .data: numpy's stubs give an array the buffer protocol only from Python 3.12
        self._arrays = [np.ascontiguousarray(x, c.dtype) for x in (c, weights, reference)]
        self._c, self._w, self._ref = (ffi.from_buffer(ctype, x.data) for x in self._arrays)
        self._figures = np.empty((2, m * blocks))  # a block's sums and norms, each [rows, blocks]
        out = ffi.from_buffer("double[]", self._figures.data, require_writable=True)
        self._sums_out, self._norms_out = out, out + m * blocks

    def tile(self, pivot: int, rows: slice, cols: slice) -> tuple[Array, Array] | None:
        """None when the block ``c[pivot, rows, cols]`` (``cols`` whole column blocks from
        a block's first; the last may be narrower) passes; else its sums and norms
        [rows, its blocks]."""
        batch, m, n = self.shape
        r0, r1, c0, c1 = rows.start, rows.stop, cols.start, cols.stop
        if not (0 <= pivot < batch and 0 <= r0 < r1 <= m and 0 <= c0 < c1 <= n
                and c0 % self.edge == 0):  # fmt: skip
            raise ValueError(f"screen: block {pivot}, {rows}, {cols} is not in {self.shape}")
        j0, height = c0 // self.edge, r1 - r0
        width = -(-(c1 - c0) // self.edge)
        start = (pivot * m + r0) * n + c0
        reference = (pivot * m + r0) * self.blocks + j0
        failed = self._pass(
            self._c + start, height, c1 - c0, n, self.edge, self._w + c0, self._ref + reference,
            self.blocks, self._unit, self._subnormal, self._sums_out, self._norms_out,
        )  # fmt: skip
        if not failed:
            return None
        sums, norms = self._figures[:, : height * width].reshape(2, height, width).copy()
        return sums, norms

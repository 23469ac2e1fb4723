"""A device's GEMM tile checked, not believed: Freivalds' check and its tolerance rule.

A tile C = A·B ([m, n]: op(A)'s rows, op(B)'s columns, all K) is checked with random signs
r ∈ {±1}ⁿ: C·r against A·(B·r), O(mK + Kn + mn) work instead of the product's O(mnK). The
signs are drawn per request and per column block of tiles, from a generator the devices
never see; ``RequestCheck`` computes B·R and A·(B·R) for every column block of a pivot at
once (one pass over A and one over B per request, not per tile), so a tile costs one
pass over its own C.

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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
LAMBDA = 8.0  # the screen's multiple of the rounding errors' scale (module docstring)
CONFIRM_LAMBDA = 10.0  # the confirmation's λ₂: its bound holds but with odds below 1e-16


def unit_roundoff(dtype: np.dtype[Any]) -> float:
    """u: half the machine epsilon of ``dtype``."""
    return float(np.finfo(dtype).eps) / 2


@dataclass
class RequestCheck:
    """The screen's figures for one pivot of one GEMM, found at its first checked tile:
    the signs r_J of each column block J (``starts``: each block's first column), and for
    every row A·(B_J·r_J) and |A|·|B_J·r_J| (two passes over A and one over B however many
    tiles there are)."""

    a: Array  # op(A) [m, K]
    b: Array  # op(B) [K, n]
    starts: list[int]
    rng: np.random.Generator
    signs: Array = field(init=False)  # [n]: r_J in each block's columns
    reference: Array = field(init=False)  # [m, blocks]: A·(B_J·r_J)
    scale: Array = field(init=False)  # [m, blocks]: |A|·|B_J·r_J|

    def __post_init__(self) -> None:
        a, b = self.a, self.b
        n = b.shape[1]
        dtype = np.result_type(a, b)
        self.signs = (self.rng.integers(0, 2, n) * 2 - 1).astype(dtype)
        # every B_J·r_J in one pass over B: B's columns times their signs, summed by block
        x = np.add.reduceat(b * self.signs, self.starts, axis=1)  # [K, blocks]
        self.reference = a @ x
        self.scale = np.abs(a) @ np.abs(x)

    def screen(self, rows: slice, cols: slice, c: Array) -> int | None:
        """The first of ``c``'s rows (C[rows, cols] as the device returned it) outside the
        screen's tolerance, or None when all are within it."""
        block = self.starts.index(cols.start)
        got = c @ self.signs[cols]
        want = self.reference[rows, block]
        size = np.sqrt(np.einsum("ij,ij->i", c, c)) + self.scale[rows, block]
        tolerance = LAMBDA * unit_roundoff(c.dtype) * math.sqrt(self.a.shape[1]) * size
        bad = ~(np.abs(got - want) <= tolerance)  # NaN is bad
        return int(bad.argmax()) if bad.any() else None


def confirm(a: Array, b: Array, c: Array) -> str:
    """Why ``c`` is not op(A)·op(B) for ``a`` [m, K] and ``b`` [K, n] within the
    confirmation's bound (see the module docstring), or empty when it is."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    u = unit_roundoff(c.dtype)
    bound = CONFIRM_LAMBDA * math.sqrt(a.shape[1]) * u * (np.abs(a64) @ np.abs(b64))
    got = c.astype(np.float64)
    bad = np.isfinite(exact) & ~(np.abs(got - exact) <= bound)  # NaN or Inf where finite
    if not bad.any():
        return ""
    i, j = np.unravel_index(int(bad.argmax()), bad.shape)
    return (
        f"{int(bad.sum())} of {bad.size} elements wrong, the first at ({i}, {j}): "
        f"{c[i, j]!r} where the product is {exact[i, j]:.9g} ± {bound[i, j]:.3g}"
    )

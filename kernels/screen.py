"""Stage one of the emulator's Freivalds screen, one pass over a product (``c/screen.c``).

``proxy/emulator/freivalds.py`` has the rule and why; this is its arithmetic for a GEMM's
whole output, in one call instead of a dozen numpy passes per request: the screen runs
on the event loop before each job is answered, for every request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._native import ffi, lib

Array = npt.NDArray[Any]
_C_TYPES = {np.dtype(np.float32): ("f32", "float[]"), np.dtype(np.float64): ("f64", "double[]")}


def screen_blocks(
    c: Array, weights: Array, edge: int, reference: Array, unit: float, subnormal: float
) -> tuple[Array, Array, int]:
    """For each row of ``c`` [..., rows, n] and each block of ``edge`` columns (the last
    maybe narrower): the block's sum weighted by ``weights`` [n] and its 2-norm, both summed
    in float64 ([..., rows, blocks] each), and how many of the rows' blocks fail
    ``|sum − reference| <= unit·2·norm + subnormal`` (a NaN fails) or are not finite
    where ``reference`` [..., rows, blocks] is."""
    if c.dtype not in _C_TYPES:
        raise TypeError(f"screen: dtype {c.dtype} is not float32 or float64")
    n = c.shape[-1]
    blocks = -(-n // edge) if edge > 0 else 0
    if edge <= 0 or weights.shape != (n,) or reference.shape != (*c.shape[:-1], blocks):
        raise ValueError(
            f"screen: product {c.shape}, weights {weights.shape}, edge {edge} and reference "
            f"{reference.shape} do not fit"
        )
    suffix, ctype = _C_TYPES[c.dtype]
    sums = np.empty(reference.shape, np.float64)
    norms = np.empty(reference.shape, np.float64)
    # .data: numpy's stubs give an array the buffer protocol only from Python 3.12 (PEP 688)
    product, w, want = (ffi.from_buffer(ctype, np.ascontiguousarray(x, c.dtype).data)
                        for x in (c, weights, reference))  # fmt: skip
    sums_out, norms_out = (ffi.from_buffer("double[]", x.data, require_writable=True)
                           for x in (sums, norms))  # fmt: skip
    rows = c.size // n if n else 0
    screen = getattr(lib, f"mg_screen_{suffix}")
    failed = screen(product, rows, n, edge, w, want, unit, subnormal, sums_out, norms_out)
    return sums, norms, int(failed)

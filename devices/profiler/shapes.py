"""The GEMM shapes a profile is measured on: a grid to fit, a held-out set to score the fit.

Both are drawn from the tiles a transformer training step issues; the grid's sizes are
snapped to a few levels per octave, the held-out set's sizes lie between them, so a score on
the held-out set says how the fit predicts shapes it never saw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..models.compute import GemmShape

# Shapes of interest: the tiles a transformer training step issues. A tile is at most
# block × block (blocks of 64-512), an edge tile any size below; K is the full inner
# dimension; an operand is contiguous or a block of a wider matrix, whose width is a model
# dimension (GPT-2: 768, 2304, 3072; BERT-large, GPT-2 medium: 1024, 4096).
WIDTHS = (768, 1024, 2048, 2304, 3072, 4096)
# (ta, tb): a transformer step issues x·Wᵀ (forward), g·W (input gradient) and gᵀ·x (weight
# gradient), in attention too; both operands transposed comes only from user code.
TRANSPOSES = ((False, True), (False, False), (True, False), (True, True))
TRANSPOSE_SHARES = (0.3, 0.3, 0.3, 0.1)
MN_RANGE = (1, 512)
BLOCK_RANGE = (64, 512)
K_RANGE = (16, 4096)
FLOAT64_SHARE = 0.25

# Grid levels: four per octave, rounded, so sizes fall on many residues modulo the vector
# width (the fit must see edge tiles); held-out shapes use only sizes between the levels.
MN_LEVELS = tuple(sorted({round(2 ** (i / 4)) for i in range(37)}))
K_LEVELS = tuple(sorted({round(2 ** (i / 4)) for i in range(16, 49)}))


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _tile_size(rng: np.random.Generator) -> int:
    """A full block (log-uniform in BLOCK_RANGE) or an edge tile (uniform in MN_RANGE)."""
    if rng.random() < 0.5:
        return _log_uniform(rng, *BLOCK_RANGE)
    return int(rng.integers(MN_RANGE[0], MN_RANGE[1] + 1))


def _leading(rng: np.random.Generator, row: int) -> int:
    """Contiguous half the time, else the width of a wider matrix the operand is a block of."""
    wider = [w for w in WIDTHS if w >= row]
    if rng.random() < 0.5 or not wider:
        return row
    return int(rng.choice(wider))


def _snap(value: int, levels: Sequence[int]) -> int:
    return min(levels, key=lambda level: abs(math.log(level / value)))


def _draw(rng: np.random.Generator, grid: bool) -> GemmShape:
    while True:
        m, n, k = _tile_size(rng), _tile_size(rng), _log_uniform(rng, *K_RANGE)
        if grid:
            m, n, k = _snap(m, MN_LEVELS), _snap(n, MN_LEVELS), _snap(k, K_LEVELS)
            break
        if m not in MN_LEVELS and n not in MN_LEVELS and k not in K_LEVELS:
            break
    ta, tb = TRANSPOSES[rng.choice(len(TRANSPOSES), p=TRANSPOSE_SHARES)]
    dtype = "float64" if rng.random() < FLOAT64_SHARE else "float32"
    return GemmShape(
        m, n, k, ta, tb, _leading(rng, m if ta else k), _leading(rng, k if tb else n), dtype
    )


def _distinct(count: int, seed: int, grid: bool) -> list[GemmShape]:
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = np.random.default_rng(seed)
    shapes: dict[GemmShape, None] = {}
    while len(shapes) < count:
        shapes[_draw(rng, grid)] = None
    return list(shapes)


def grid_shapes(count: int, *, seed: int = 0) -> list[GemmShape]:
    """``count`` distinct shapes of interest, sizes snapped to the grid levels."""
    return _distinct(count, seed, grid=True)


def heldout_shapes(count: int, *, seed: int = 1) -> list[GemmShape]:
    """``count`` distinct shapes from the same distribution with no size on a grid level."""
    return _distinct(count, seed, grid=False)

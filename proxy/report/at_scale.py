"""The figures behind the plots of a fleet too large for a row or a bar per device.

A bar per device stops reading well before a thousand devices, and stops drawing in
reasonable time before ten thousand. Past that the plots summarise the fleet instead:
devices ranked (busiest first) and gathered into consecutive groups, a heat map of each
group's compute occupancy over virtual time, and the groups' means of per-device figures.
Nothing here draws: ``plots`` does, from these arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rank_groups(count: int, groups: int) -> np.ndarray:
    """Where each of at most ``groups`` groups of ``count`` ranked items starts (for
    ``np.add.reduceat``): consecutive ranks, as equal in size as they can be."""
    groups = max(1, min(groups, count))
    return np.linspace(0, count, groups, endpoint=False).astype(np.int64)


def group_means(values: Sequence[float] | np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The mean of ``values`` (in rank order) over each group ``starts`` begins."""
    array = np.asarray(values, dtype=np.float64)
    sizes = np.diff(np.append(starts, len(array)))
    return np.add.reduceat(array, starts) / sizes


def occupancy(
    spans: np.ndarray, rows: np.ndarray, row_count: int, start: float, end: float, bins: int
) -> np.ndarray:
    """Seconds of ``spans`` ([n, 2] start and end, virtual seconds) that lie in each of
    ``bins`` equal bins of [``start``, ``end``), per row (``rows``: each span's, in
    [0, ``row_count``)): a [row_count, bins] array. A span crossing bins is shared among
    them exactly; what lies outside [start, end) is left out."""
    out = np.zeros((row_count, bins))
    if not len(spans) or end <= start:
        return out
    width = (end - start) / bins
    t0 = np.clip(spans[:, 0], start, end)
    t1 = np.clip(spans[:, 1], start, end)
    b0 = np.minimum(((t0 - start) // width).astype(np.int64), bins - 1)
    b1 = np.minimum(((t1 - start) // width).astype(np.int64), bins - 1)
    flat = out.reshape(-1)
    stride = bins
    same = b0 == b1
    np.add.at(flat, rows[same] * stride + b0[same], t1[same] - t0[same])
    cross = ~same
    r, first, last = rows[cross], b0[cross], b1[cross]
    np.add.at(flat, r * stride + first, start + (first + 1) * width - t0[cross])
    np.add.at(flat, r * stride + last, t1[cross] - (start + last * width))
    # the bins strictly between: ``width`` each, as a difference summed along the row
    full = np.zeros_like(out)
    full_flat = full.reshape(-1)
    np.add.at(full_flat, r * stride + first + 1, width)
    np.add.at(full_flat, r * stride + last, -width)
    out += np.cumsum(full, axis=1)
    return out

"""Offloaded products computed on this host, a sample of their tiles on devices
(``--sample-tiles K``, ``morphling run --numerics sample:K`` without ``--ranks``).

A what-if of a thousand virtual devices spends its wall time moving tiles through the
protocol to kernels that run on this host anyway. With ``sample_tiles`` K, each request
of more than K tiles is computed here, on a thread, and only K of its tiles, spread over
its output, go to their devices (which are then the ones that compute those blocks of
C, checked as any tile is): a GEMM whole, in one call; a convolution tile by tile, each
by the ``kernels.conv`` call its device would make. Every tile is placed and timed on
its device all the same: the timeline, the links' bytes and the reports do not change,
only who computes the numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from .conv_partition import AnyTask, AnyTile
from .freivalds import conv_call
from .partition import GemmTask, TileTask

Blocks = list[tuple[tuple[int | slice, ...], np.ndarray]]  # blocks of C, by where they go


class HostProducts:
    """Which products this host computes, and how many tiles went where."""

    def __init__(self, sample_tiles: int) -> None:
        self.sample_tiles = sample_tiles  # 0: every tile on its device
        self.on_host = 0  # tiles whose blocks this host computed
        self.on_devices = 0  # tiles of those products sent to their devices

    def takes(self, tiles: Sequence[AnyTile]) -> bool:
        """Whether the request of ``tiles`` is computed here: more tiles than the sample."""
        return 0 < self.sample_tiles < len(tiles)

    def sample(self, tiles: Sequence[AnyTile]) -> set[int]:
        """The ids of the tiles that go to their devices: ``sample_tiles`` of them, spread
        evenly over the request's tiles (the first among them)."""
        k, n = self.sample_tiles, len(tiles)
        return {tiles[j * n // k].id for j in range(k)}

    def compute(
        self, task: AnyTask, tiles: Sequence[AnyTile], sent: set[int]
    ) -> asyncio.Future[Blocks]:
        """What this host computes of ``task`` (``blocks``), on a thread into new memory:
        the caller copies it into the task's output once it is still wanted (a job that
        left may have given its slab back)."""
        return asyncio.ensure_future(asyncio.to_thread(blocks, task, tiles, sent))

    def count(self, host: int, devices: int) -> None:
        self.on_host += host
        self.on_devices += devices

    def summary(self) -> dict[str, int]:
        return {"sample_tiles": self.sample_tiles, "tiles_on_host": self.on_host,
                "tiles_on_devices": self.on_devices}  # fmt: skip


def blocks(task: AnyTask, tiles: Sequence[AnyTile], sent: set[int]) -> Blocks:
    """A GEMM's whole C (op(A)·op(B) of every pivot; the tiles ``sent`` are then
    overwritten by their devices'), or a convolution's tiles but those ``sent``."""
    if isinstance(task, GemmTask):
        a, b = task.op_views()
        return [((slice(None),), np.matmul(a, b))]
    here: Blocks = []
    for tile in tiles:
        if tile.id not in sent:
            assert not isinstance(tile, TileTask), "a convolution's tiles"
            call, _, _ = conv_call(tile)
            here.append((tile.index, call(tile.a, tile.b).reshape(tile.shape)))
    return here

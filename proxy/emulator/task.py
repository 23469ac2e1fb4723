"""What every request the emulator serves keeps while its tiles are out: a GEMM's
(``partition``) or a convolution's (``conv_partition``).

A ``Task`` owns the request's output and counts its tiles in and out, the devices and
bytes they took, and what virtual time said of it; each ``TaskTile`` is one block of that
output, with where its device writes it. The scheduler, the tile messages and the job read
no more than these, so a GEMM's tiles and a convolution's travel the same path.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from morphling.proxy.shm.handover import Writers
from morphling.proxy.wire.messages import Conv, Gemm
from morphling.proxy.wire.operands import IN_FRAME, Location

tile_ids = itertools.count(1)  # every tile's, a GEMM's or a convolution's: one id space
panel_ids = itertools.count(1)  # every request's operand panels: one id space


class GemmError(ValueError):
    """A GEMM or CONV request whose header does not describe its operands."""


class Owner(Protocol):
    """Who asked (the emulator's side of its job): what its tiles' results reach it through."""

    def finish(self, task: Task) -> None:
        """Every tile is in: answer the job."""

    def retire_slab(self, task: Task) -> None:
        """A device lost while writing ``task``'s C (in the job's slab) may still write."""

    def give_up(self, reason: str) -> None:
        """No device could compute one of its tiles: end the job, saying why."""


@dataclass(eq=False)
class Task:
    """A validated request, its output and its bookkeeping."""

    request: Gemm | Conv
    out: np.ndarray
    c_at: Location = IN_FRAME  # where C goes: back in RESULT, or in place
    owner: Owner | None = None  # None: a task no job asked for (the timeline's tests)
    remaining: int = 0
    done: set[int] = field(default_factory=set)
    devices: set[int] = field(default_factory=set)
    requeued: int = 0
    cancelled: bool = False
    oom: int = 0
    virtual_ns: int = 0  # issue to end in virtual time, once the timeline settled it
    bytes_down: int = 0
    bytes_up: int = 0
    in_slab: bool = False  # an operand or C is in the job's slab
    slab_retired: bool = False  # its C is in a slab a lost device may still write into
    writers: Writers | None = None  # kernels writing into C, a job's own array (``local``)
    # Its operand panels (blocks that are not weights), by where their bytes lie: one id
    # each, under which a device keeps a panel for the request's other tiles.
    _panels: dict[tuple[int, ...], int] = field(default_factory=dict)
    kept: dict[int, set[int]] = field(default_factory=dict)  # device → panels sent to keep
    resent: int = 0  # tiles sent again with their bytes: their device had lost a panel

    @property
    def id(self) -> int:
        return self.request.gemm

    def panel(self, where: tuple[int, ...]) -> int:
        """The id of the operand panel whose bytes lie at ``where`` (first byte's address,
        then the shape and strides that place the rest): the same bytes, the same panel,
        whichever tiles need them (a row of tiles shares its A block, a broadcast operand
        is one block for every pivot)."""
        panel = self._panels.get(where)
        if panel is None:
            panel = self._panels[where] = next(panel_ids)
        return panel

    @property
    def in_place(self) -> bool:
        """C is where the job reads it (its slab, or its own array): RESULT carries none."""
        return self.c_at.in_place

    def settled(self, issue: float, end: float) -> None:
        """The timeline's word that the request ran from ``issue`` to ``end`` in virtual time."""
        self.virtual_ns = round((end - issue) * 1e9)

    def put(self, tile: TaskTile, values: np.ndarray | None) -> bool:
        """Store a tile's result (its elements, or None when the device wrote them into
        ``out`` itself); False when it was already stored (a duplicate)."""
        if tile.id in self.done:
            return False
        if values is not None:
            self.out[tile.index] = values.reshape(tile.shape)
        self.done.add(tile.id)
        self.remaining -= 1
        return True


@dataclass(eq=False)
class TaskTile(ABC):
    """One block of a task's output (``out[index]``, of ``shape``), and how it last went."""

    id: int
    gemm: Task  # the request it is a tile of (a GEMM's, or a convolution's)
    attempts: int = field(default=0, kw_only=True)
    wire_bytes: int = field(default=0, kw_only=True)  # its operand bytes on the wire, last sent
    c_at: Location = field(default=IN_FRAME, kw_only=True)  # where that device writes its C

    @property
    @abstractmethod
    def index(self) -> tuple[int | slice, ...]:
        """Where the block lies in its task's output."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The block's shape, as its device returns it."""

    @property
    def out_bytes(self) -> int:
        """The block's bytes, as its device returns them."""
        return math.prod(self.shape) * self.gemm.out.itemsize

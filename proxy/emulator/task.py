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
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import xxhash
from morphling.proxy.shm.handover import Writers
from morphling.proxy.wire.messages import Conv, Gemm
from morphling.proxy.wire.operands import IN_FRAME, Location

tile_ids = itertools.count(1)  # every tile's, a GEMM's or a convolution's: one id space


class PanelNames:
    """Operand bytes named by their content: the same bytes get the same id in every
    request, so a device that kept them (an activation in its forward and grad-weight
    products, a weight in its forward and grad-input products) is sent the id instead.

    ``matrix`` names an array's bytes (its 128-bit xxh3 digest) and shape; ``panel`` a
    block of a named matrix, so that the emulator knows one panel to lie within another
    (a column block of a matrix sent whole); ``view`` any view of a named array (a
    convolution's region). The newest ``capacity`` names are remembered, and ids are
    never given twice, so a name forgotten costs a resend under a new id, never a wrong
    block."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[Hashable, int] = OrderedDict()
        self._next = itertools.count(1)

    def matrix(self, data: np.ndarray) -> int:
        """The id of the bytes of ``data`` (C-contiguous) in its shape."""
        return self._id((xxhash.xxh3_128_intdigest(data.data), data.shape))

    def panel(self, matrix: Hashable, row: int, col: int, rows: int, cols: int) -> int:
        """The id of rows ``row:row+rows`` and columns ``col:col+cols`` of ``matrix``."""
        return self._id((matrix, row, col, rows, cols))

    def view(
        self, matrix: Hashable, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> int:
        """The id of the view of ``matrix`` at byte ``offset`` with ``shape`` and ``strides``
        (a convolution's input region or weight block: no block of a 2-D matrix)."""
        return self._id((matrix, offset, shape, strides))

    def _id(self, key: Hashable) -> int:
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = next(self._next)
            if len(self._ids) > self.capacity:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return got


panel_names = PanelNames()  # the process's: its emulators' devices keep panels by these ids


def address(arr: np.ndarray) -> int:
    """Where ``arr``'s first element is, as the panel names' keys hold it (``ctypes.data``
    builds a ctypes object each time it is asked)."""
    return int(arr.__array_interface__["data"][0])


class GemmError(ValueError):
    """A GEMM or CONV request whose header does not describe its operands."""


def unsent(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An operand, or the output, of a product a rank computed itself (``by_rank``), of
    ``shape``: one zero broadcast, no memory, so that the request is cut into tiles and
    priced as it would be were its bytes here. GemmError for a shape numpy cannot index."""
    try:
        return np.broadcast_to(np.zeros(1, dtype), shape)
    except ValueError as exc:  # ("array is too big")
        raise GemmError(f"by_rank: a product of shape {list(shape)}: {exc}") from None


def carries_nothing(request: Gemm | Conv, fields: dict[str, bool]) -> None:
    """A ``by_rank`` request's operands stayed with the rank: no segment, and none of its
    operand-placing ``fields`` (name → whether set) set; else GemmError."""
    if any(memoryview(seg).nbytes for seg in request.segments):
        raise GemmError("by_rank: a rank's own product carries no operand bytes")
    for name, value in fields.items():
        if value:
            raise GemmError(f"by_rank: {name} is set, but a rank's own product has no operands")


class Owner(Protocol):
    """Who asked (the emulator's side of its job): what its tiles' results reach it through."""

    def finish(self, task: Task) -> None:
        """Every tile is in: answer the job."""

    def retire_slab(self, task: Task) -> None:
        """A device lost while writing ``task``'s C (in the job's slab) may still write."""

    def give_up(self, reason: str) -> None:
        """No device could compute one of its tiles: end the job, saying why."""


class Judge(Protocol):
    """A request's screen, its reference made (``verify``): whether a tile's result fails."""

    at_arrival: bool  # it judges each tile as it comes in (else only once all are in)

    def fails(self, tile: TaskTile) -> bool: ...


@dataclass(eq=False)
class Task:
    """A validated request, its output and its bookkeeping."""

    request: Gemm | Conv
    out: np.ndarray
    c_at: Location = IN_FRAME  # where C goes: back in RESULT, or in place
    owner: Owner | None = None  # None: a task no job asked for (the timeline's tests)
    remaining: int = 0
    done: set[int] = field(default_factory=set)
    # tiles stored but not yet verified (``verify``), each with its device and whether the
    # screen flagged it (None: not judged yet), and the request's screen, made or being
    # made: on the task, so that they go with it however it ends
    unchecked: dict[int, tuple[TaskTile, Any, bool | None]] = field(default_factory=dict)
    screen: Judge | Future[Judge] | None = None
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
    # Its operands' bytes named so far (``PanelNames.matrix``), by where they lie: each is
    # hashed once however many tiles need them.
    _names: dict[tuple[int, ...], int] = field(default_factory=dict)
    resent: int = 0  # tiles sent again with their bytes: their device had lost a panel

    @property
    def id(self) -> int:
        return self.request.gemm

    def named(self, where: tuple[int, ...], data: Callable[[], np.ndarray]) -> int:
        """The ``PanelNames.matrix`` id of the bytes ``data()`` gives (C-contiguous, as
        sent), found at ``where``: asked once per place, whichever tiles need them. Never
        for a rank's own product (``by_rank``): it has no bytes, and the clock keeps none of
        its operands on a device (``sent``)."""
        assert self.request.by_rank is False, "a rank's own operands are never named"
        name = self._names.get(where)
        if name is None:
            name = self._names[where] = panel_names.matrix(data())
        return name

    @property
    def sent(self) -> bool:
        """Its tiles go to devices: all but a rank's own product's (``by_rank``)."""
        return not self.request.by_rank

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

    def take_back(self, tile: TaskTile) -> None:
        """A stored tile found wrong (``verify``): it is to be computed again."""
        self.done.discard(tile.id)
        self.remaining += 1


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

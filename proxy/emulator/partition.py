"""Cut a GEMM's output into tiles, and find the operand bytes each tile needs.

A job's GEMM arrives as two flat operand spans plus BLAS-style layout
(``Gemm`` message). ``GemmTask`` checks that layout against the spans (a
header that lies about shapes or strides is refused, naming the field), owns
the output and produces ``TileTask``s: output blocks of at most ``block ×
block`` of one batch pivot, each with full K (no split-K, no reduction).

The bytes a tile needs are sent as they are stored (the span from its first
to its last element, with the leading dimension) unless that span is more
than twice the elements used, in which case the block is packed: a column
block of a row-major matrix, for instance, would otherwise drag the whole
matrix along. Packed blocks are cached per GEMM, since every tile in the
same block row or column needs the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
from morphling.devices.models.compute import GemmShape
from morphling.proxy.shm.handover import JobOperands, Writers
from morphling.proxy.shm.weights import SharedWeights
from morphling.proxy.vtime.eventlog import GEMM_OP
from morphling.proxy.vtime.memory import Key, Region
from morphling.proxy.vtime.vdevice import Work
from morphling.proxy.wire.messages import GEMM_DTYPES, Gemm
from morphling.proxy.wire.operands import (
    Location,
    OperandError,
    Place,
    gemm_locations,
    stored_shape,
)

from .task import (
    GemmError,
    Task,
    TaskTile,
    address,
    carries_nothing,
    panel_names,
    tile_ids,
    unsent,
)

if TYPE_CHECKING:
    from morphling.proxy.vtime.placement import Placement

MIN_AUTO_EDGE = 32  # ``auto_edge``'s smallest: below it a tile's fixed costs dominate


@dataclass(eq=False)
class TileTask(TaskTile):
    """One output block of one pivot."""

    gemm: GemmTask
    pivot: int
    r0: int
    r1: int
    c0: int
    c1: int
    _operands: tuple[Block, Block] | None = field(default=None, repr=False)
    conv = None  # (what the clock reads of a convolution's tile: this is none)

    @property
    def index(self) -> tuple[int | slice, ...]:
        return self.pivot, slice(self.r0, self.r1), slice(self.c0, self.c1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.r1 - self.r0, self.c1 - self.c0

    @property
    def out_bytes(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0) * self.gemm.out.itemsize

    @property
    def out_start(self) -> int:
        """The element of the GEMM's output ``[batch, m, n]`` where this tile starts."""
        _, m, n = self.gemm.out.shape
        return int((self.pivot * m + self.r0) * n + self.c0)

    def operands(self) -> tuple[Block, Block]:
        """Op(A)'s rows and op(B)'s columns that this tile needs (found once: the timeline
        costs them and the server sends them)."""
        if self._operands is None:
            a = self.gemm.block("a", self.pivot, self.r0, self.r1)
            self._operands = (a, self.gemm.block("b", self.pivot, self.c0, self.c1))
        return self._operands


@dataclass(frozen=True)
class Block:
    """One operand block of a tile: ``rows × cols`` stored with leading dimension ``ld``.

    ``span`` is its memory as stored; ``offset`` is where that lies in the shared
    weights (None for a job's own bytes) and ``version`` the weight's version; a job's
    own block is a ``panel`` of its operand's matrix (``task``'s, ``which`` of pivot
    ``pivot``, named by its bytes), from stored row ``row`` and column ``col``.
    """

    span: np.ndarray
    rows: int
    cols: int
    ld: int
    offset: int | None = None
    version: int = 0
    task: GemmTask | None = field(default=None, repr=False, compare=False)
    which: str = "a"
    pivot: int = 0
    row: int = 0
    col: int = 0

    @property
    def packs(self) -> bool:
        """Sending the span would more than double the bytes: pack the block instead."""
        return self.span.size > 2 * self.rows * self.cols

    @property
    def sent_ld(self) -> int:
        """The leading dimension of the bytes ``GemmTask.packed`` sends for this block."""
        return self.cols if self.packs else self.ld

    @cached_property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.span.itemsize

    @cached_property
    def region(self) -> Region:
        """Where the block lies (``memory.Region``), so that a device holding a block
        around it is known to hold it: in its operand's matrix (named by its bytes when
        first asked: only residency asks), or in the shared weights, rows ``ld`` apart."""
        if self.offset is not None:
            item = self.span.itemsize
            first, ld = self.offset // item, self.ld
            space = ("weights", ld, item)
            return (space, first // ld, first % ld, self.rows, self.cols, self.sent_ld)
        assert self.task is not None, "a job's own block knows its task"
        matrix = self.task.matrix(self.which, self.pivot)
        return (matrix, self.row, self.col, self.rows, self.cols, self.sent_ld)

    @cached_property
    def panel(self) -> int:
        """A job's own block's panel id."""
        assert self.offset is None, "a weight block is no panel"
        matrix, row, col, rows, cols, _ = self.region
        return panel_names.panel(matrix, row, col, rows, cols)

    @cached_property
    def key(self) -> Key:
        """What a device's emulated memory keeps the block under: a weight block's place in
        the shared weights, or the panel's id."""
        if self.offset is None:
            return self.panel
        return (self.offset, self.rows, self.cols, self.ld)

    @property
    def ref(self) -> tuple[int, ...]:
        """A weight block's ``TILE.ref_*`` (``operands.TILE_REF``)."""
        assert self.offset is not None, "only a weight block has a reference"
        return (self.offset, self.rows, self.cols, self.ld, self.version)


@dataclass(eq=False, kw_only=True)
class GemmTask(Task):
    """A validated GEMM, its operands' spans and its output."""

    request: Gemm
    a: np.ndarray
    b: np.ndarray
    weights: dict[str, tuple[int, int]] = field(default_factory=dict)  # operand → (offset, ver.)
    _packed: dict[tuple[int, int, int, int], tuple[np.ndarray, int]] = field(default_factory=dict)
    # A row of tiles shares its A block and a column its B block: made once each.
    _blocks: dict[tuple[str, int, int, int], Block] = field(default_factory=dict)
    block_edge: int = 0  # the tiles' edge (``tiles``)
    op = GEMM_OP

    @property
    def header(self) -> Gemm:
        """What the clock reads of the GEMM."""
        return self.request

    def block(self, which: str, pivot: int, lo: int, hi: int) -> Block:
        """Rows ``lo:hi`` of op(A) (``which="a"``) or columns of op(B), as stored."""
        key = (which, pivot, lo, hi)
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = self._make_block(which, pivot, lo, hi)
        return block

    def _stored(self, which: str) -> tuple[np.ndarray, int, int, bool, int, int]:
        """Operand ``which`` as stored: its elements, leading dimension, pivot stride,
        whether op() transposes it (op(B)'s columns are B's rows when B is stored
        transposed), and one pivot's stored rows and columns."""
        g = self.request
        rows, cols = stored_shape(g, which)
        if which == "a":
            return self.a, g.lda, g.stride_a, g.ta, rows, cols
        return self.b, g.ldb, g.stride_b, not g.tb, rows, cols

    def _make_block(self, which: str, pivot: int, lo: int, hi: int) -> Block:
        flat, ld, stride, trans, stored_rows, stored_cols = self._stored(which)
        base = pivot * stride
        if not trans:  # the block is whole stored rows lo:hi
            row, col, rows, cols = lo, 0, hi - lo, stored_cols
        else:  # the block is stored columns lo:hi of every row
            row, col, rows, cols = 0, lo, stored_rows, hi - lo
        start = base + row * ld + col
        weight = self.weights.get(which)
        if rows == 0 or cols == 0:
            span, ld, weight = flat[:0], max(1, cols), None
        else:
            span = flat[start : start + (rows - 1) * ld + cols]
        if weight is None:
            return Block(
                span, rows, cols, ld, task=self, which=which, pivot=pivot, row=row, col=col
            )
        offset, version = weight
        return Block(span, rows, cols, ld, offset + start * flat.itemsize, version)

    def op_views(self) -> tuple[np.ndarray, np.ndarray]:
        """op(A) [batch, m, K] and op(B) [batch, K, n]: read-only views of the operands
        (a pivot stride of 0 broadcasts one)."""
        g = self.request
        views = []
        for which, trans in (("a", g.ta), ("b", g.tb)):
            flat, ld, stride, _, rows, cols = self._stored(which)
            item = flat.itemsize
            stored = np.ndarray(  # (as_strided's way costs ten times more)
                (g.batch, rows, cols), flat.dtype, flat, strides=(stride * item, ld * item, item)
            )
            stored.flags.writeable = False
            views.append(stored.swapaxes(1, 2) if trans else stored)
        return views[0], views[1]

    def matrix(self, which: str, pivot: int) -> int:
        """The ``PanelNames.matrix`` id of pivot ``pivot`` of operand ``which`` as stored."""
        flat, ld, stride, _, rows, cols = self._stored(which)
        start = pivot * stride
        where = (address(flat) + start * flat.itemsize, rows, cols, ld)
        return self.named(where, lambda: _packed(flat[start:], rows, cols, ld))

    def packed(self, block: Block) -> tuple[np.ndarray, int]:
        """The bytes to send for ``block`` and their leading dimension: the span, or the
        block packed when the span would more than double them (cached per GEMM, by what
        fixes the packed bytes: one span may hold A's block and B's, or a broadcast
        operand's for every pivot)."""
        if not block.packs:
            return block.span, block.ld
        key = (address(block.span), block.rows, block.cols, block.ld)
        if key not in self._packed:
            packed = _packed(block.span, block.rows, block.cols, block.ld).reshape(-1)
            self._packed[key] = (packed, block.sent_ld)
        return self._packed[key]

    def tile_count(self, block: int) -> int:
        g = self.request
        return g.batch * -(-g.m // block) * -(-g.n // block)

    def tiles(self, block: int) -> list[TileTask]:
        """Cut the output into tiles of at most ``block × block`` per pivot."""
        g = self.request
        self.block_edge = block
        if self.tile_count(block) == 0:  # an empty output: nothing to walk, however large
            self.remaining = 0
            return []
        tiles = [
            TileTask(next(tile_ids), self, p, r, min(r + block, g.m), c, min(c + block, g.n))
            for p in range(g.batch)
            for r in range(0, g.m, block)
            for c in range(0, g.n, block)
        ]
        self.remaining = len(tiles)
        return tiles


def auto_edge(request: Gemm, block: int, placement: Placement) -> int:
    """The tile edge for ``request`` among ``block``, its half and its quarter (none below
    ``MIN_AUTO_EDGE``) whose tiles greedy predicts end it soonest on the fleet as it stands
    (``Placement.span``); the larger of equals, whose fewer tiles cost the emulator less.
    Large tiles keep a fast device's BLAS busy; small ones spread a request's bytes over
    more links, which a fleet on a slow network needs."""
    g = request
    item = np.dtype(g.dtype).itemsize
    edges = [e for e in (block, block // 2, block // 4) if e >= MIN_AUTO_EDGE] or [block]
    best, best_s = edges[0], math.inf
    for edge in edges:
        m, n = min(edge, g.m), min(edge, g.n)
        shape = GemmShape(max(m, 1), max(n, 1), max(g.k, 1), g.ta, g.tb, g.lda, g.ldb, g.dtype)
        rows, cols = -(-g.m // edge), -(-g.n // edge)
        work = Work((m + n) * g.k * item, m * n * item, shape)
        seconds = placement.span(work, g.batch * rows * cols, rows, cols)
        if seconds < best_s:
            best, best_s = edge, seconds
    return best


def _packed(flat: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
    """``rows × cols`` stored from ``flat[0]`` with leading dimension ``ld``, C-contiguous
    (a view where they are already)."""
    if ld == cols or rows <= 1:
        return flat[: rows * cols].reshape(rows, cols)
    item = flat.itemsize
    view = np.lib.stride_tricks.as_strided(flat, shape=(rows, cols), strides=(ld * item, item))
    return np.ascontiguousarray(view)


def _extent(name: str, rows: int, cols: int, ld: int, stride: int, batch: int) -> int:
    """Elements an operand addresses: its last pivot's last element + 1."""
    if ld < max(1, cols):
        raise GemmError(f"ld{name}={ld} is smaller than the stored row length {cols}")
    if stride < 0:
        raise GemmError(f"stride_{name}={stride} is negative")
    if rows == 0 or cols == 0:
        return 0
    return (batch - 1) * stride + (rows - 1) * ld + cols


def make_task(
    request: Gemm,
    *,
    weights: SharedWeights | None = None,
    slab: np.ndarray | None = None,
    handed: JobOperands | None = None,
    memory: Callable[[int], memoryview] | None = None,
) -> GemmTask:
    """Validate a GEMM request against its operands; the task and its output.

    Each operand and C are where the request places them (``operands``): its
    segments; ``weights``, for an operand sent by reference; ``slab``, the bytes of
    the arena the job was given; the arrays it ``handed`` over in this process. A C
    that goes back in RESULT gets ``memory(nbytes)`` (new memory without it), not
    initialised: RESULT waits for every tile, and filling C first (to show a tile
    that never came) cost the emulator's thread a pass over every output.
    """
    g = request
    if g.dtype not in GEMM_DTYPES:
        raise GemmError(f"dtype {g.dtype!r} is not supported ({', '.join(GEMM_DTYPES)})")
    for name in ("m", "n", "k"):
        if getattr(g, name) < 0:
            raise GemmError(f"{name}={getattr(g, name)} is negative")
    if g.batch < 1:
        raise GemmError(f"batch={g.batch} must be >= 1")
    if g.by_rank:
        return _rank_task(g)
    try:
        a_at, b_at, c_at = gemm_locations(g)
    except OperandError as exc:
        raise GemmError(str(exc)) from None
    (a_rows, a_cols), (b_rows, b_cols) = stored_shape(g, "a"), stored_shape(g, "b")
    item = np.dtype(g.dtype).itemsize
    arrays, refs, in_slab = [], {}, []
    for name, at, seg, rows, cols, ld, stride in (
        ("a", a_at, g.segments[0], a_rows, a_cols, g.lda, g.stride_a),
        ("b", b_at, g.segments[1], b_rows, b_cols, g.ldb, g.stride_b),
    ):
        need = _extent(name, rows, cols, ld, stride, g.batch)
        if at.place is Place.WEIGHTS:
            seg = _referenced(name, at, need, g.dtype, weights)
            refs[name] = (at.offset, at.ref[1])
        elif at.place is Place.SLAB:
            seg = _slab_range(f"slab_{name}", at.offset, need * item, item, slab)
            in_slab.append((name, at.offset, need * item))
        elif at.place is Place.LOCAL:
            seg = taken(handed).a if name == "a" else taken(handed).b
        if len(seg) % item or len(seg) // item < need:
            raise GemmError(
                f"operand {name}: {len(seg)} bytes, but its layout (rows {rows}, cols {cols}, "
                f"ld {ld}, stride {stride}, batch {g.batch}) addresses {need} {g.dtype} elements"
            )
        arrays.append(np.frombuffer(seg, dtype=g.dtype))
    shape = (g.batch, g.m, g.n)
    if c_at.place is Place.SLAB:
        nbytes = g.batch * g.m * g.n * item
        c = _slab_range("slab_c", c_at.offset, nbytes, item, slab)
        out, writers = np.frombuffer(c, g.dtype).reshape(shape), None
        for name, start, size in in_slab:  # devices write C while others still read A and B
            if start < c_at.offset + nbytes and c_at.offset < start + size:
                raise GemmError(
                    f"slab_c [{c_at.offset}, {c_at.offset + nbytes}) overlaps "
                    f"operand {name} at [{start}, {start + size}) in the slab"
                )
    else:
        mine = taken(handed) if c_at.place is Place.LOCAL else None
        out, writers = output(shape, g.dtype, mine, memory)
    task = GemmTask(
        request=g, out=out, c_at=c_at, a=arrays[0], b=arrays[1], weights=refs, writers=writers
    )
    task.in_slab = bool(in_slab) or c_at.place is Place.SLAB
    return task


def _rank_task(g: Gemm) -> GemmTask:
    """A GEMM its rank computed itself (``by_rank``): its operands and C ``unsent``."""
    carries_nothing(g, {"ref_a": bool(g.ref_a), "ref_b": bool(g.ref_b), "slab_a": g.slab_a != -1,
                        "slab_b": g.slab_b != -1, "slab_c": g.slab_c != -1,
                        "local": g.local})  # fmt: skip
    a, b = (
        unsent((_extent(name, *stored_shape(g, name), ld, stride, g.batch),), g.dtype)
        for name, ld, stride in (("a", g.lda, g.stride_a), ("b", g.ldb, g.stride_b))
    )
    return GemmTask(request=g, out=unsent((g.batch, g.m, g.n), g.dtype), a=a, b=b)


def _slab_range(
    field: str, offset: int, nbytes: int, item: int, slab: np.ndarray | None
) -> memoryview:
    """``nbytes`` at ``offset`` of the job's slab, for the GEMM field that names them."""
    if slab is None:
        raise GemmError(f"{field}={offset}: this job has no slab (SLAB)")
    if offset % item or offset + nbytes > len(slab):
        raise GemmError(
            f"{field}: [{offset}, {offset + nbytes}) is not an aligned range "
            f"inside the job's slab ({len(slab)} bytes)"
        )
    return slab[offset : offset + nbytes].data


def _referenced(
    name: str, at: Location, need: int, dtype: str, weights: SharedWeights | None
) -> memoryview:
    """The operand a GEMM sent by reference, as a view of the shared weights."""
    if weights is None:
        raise GemmError(f"ref_{name}: this emulator has no shared weights (--ckpt-path)")
    try:
        return weights.region(at.offset, need, dtype).data.cast("B")
    except ValueError as exc:
        raise GemmError(f"ref_{name}: {exc}") from None


def output(
    shape: tuple[int, ...],
    dtype: str,
    handed: JobOperands | None,
    memory: Callable[[int], memoryview] | None,
) -> tuple[np.ndarray, Writers | None]:
    """A request's C, of ``shape``, and who writes into it: the job's own array where it
    ``handed`` one over (counting the kernels that write there), else ``memory(nbytes)``
    (new memory without it)."""
    if handed is not None:
        out = handed.out
        if out.shape != shape or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise GemmError(
                f"local: the output is {out.dtype} {out.shape}, expected a "
                f"C-contiguous {dtype} {shape}"
            )
        return out, Writers()
    if memory is None:
        return np.empty(shape, dtype), None
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return np.frombuffer(memory(nbytes), dtype).reshape(shape), None


def taken(handed: JobOperands | None) -> JobOperands:
    """The arrays a job in this process handed over for its ``local`` GEMM or CONV."""
    if handed is None:
        raise GemmError("local: no operands were handed over in this emulator's process")
    return handed

"""Each device's emulated memory: what it holds, and whether a tile fits.

A device's declared memory bounds what it can hold at once: the output of the
tile it computes, plus the operand blocks it keeps so that they are not sent
again. ``DeviceMemory`` is that model, kept by the emulator for every device. It
decides which blocks a device already holds (a physical board then gets a
reference instead of the bytes), evicts the least recently used blocks to make
room, and reports a tile whose operands cannot fit at all: an emulated
out-of-memory event, logged and counted, never a failure of the host (the tile
is still computed).

Two kinds of block are kept. A weight block's key is where it lies in the shared
weights; its version changes when the optimizer updates the weight, so a stale
block is never treated as held. Versions are a job's own (they start again with
each job), and the working copy may be restored from the checkpoint: then nothing
a device kept is trusted any more (``distrust``). Any other operand block (an
activation's, a gradient's: a *panel*) is keyed by an id that names its bytes, so any
request that needs the same bytes reuses it. A training step's panels are of no use
to the next (its activations and weights are new), so at each step's end ``sweep``
lets go of those no tile used since the last sweep; those used (a frozen weight
sent as bytes, say) stay.

A block may also be held *within* another: a column block of a weight whose row block
the device holds whole, a grad-weight product's block of an activation sent whole for
the forward one. Each kept block may come with its ``Region``: the matrix it is a block
of (a panel's: the matrix named by its bytes; a weight's: the shared weights, rows ``ld``
elements apart) and where in it. A block inside one the device holds at its version is
held: the tile reads it at an element offset into the kept bytes (``Admission.within``),
and nothing crosses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

WeightKey = tuple[int, int, int, int]  # offset, rows, cols, ld
Key = WeightKey | int  # a weight block's, or a panel's id
# Where a block lies: its matrix, first row and column there, rows, cols, and the leading
# dimension of its bytes as the device keeps them.
Region = tuple[Hashable, int, int, int, int, int]
Block = tuple[Key, int, int, Region | None]  # key, version, bytes, region (None: not known)
Within = Mapping[Key, tuple[Key, int, int]]  # block → the kept block's key, element offset, ld


@dataclass(slots=True)
class Admission:
    """The outcome of placing one tile in a device's memory. (Nothing is evicted, and no
    block held within another, for most tiles: the eviction lists start as one shared
    empty tuple and ``within`` as None, replaced when there is one.)"""

    fits: bool
    held: AbstractSet[Key] = frozenset()  # blocks already resident, current
    kept: AbstractSet[Key] = frozenset()  # blocks resident once it is placed
    evicted: Sequence[list[int]] = ()  # weight refs the device may drop
    evicted_panels: Sequence[int] = ()  # panels the device may drop
    within: Within | None = None  # blocks held within another


class DeviceMemory:
    """LRU residency of operand blocks within ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # → (version, bytes)
        self.distrusted: set[Key] = set()  # kept, but perhaps not what is there now
        self.touched: set[Key] = set()  # panels placed or read since the last ``sweep``
        self.regions: dict[Key, Region] = {}  # the resident blocks' regions, where known
        self._by_matrix: dict[Hashable, set[Key]] = {}  # resident blocks by their matrix
        self.used = 0
        self.oom_events = 0

    def admit(self, blocks: Sequence[Block], transient: int) -> Admission:
        """Place a tile: its operand ``blocks`` as (key, version, bytes, region), plus
        ``transient`` bytes (its output) that live only while it runs. A and B may be one
        block (the diagonal tiles of W·Wᵀ): it is held once, and is held already only if
        it was before this tile. A block inside one held (``within``) is held, and keeps
        that one from eviction. (Every tile the clock places comes through here: it is
        written for speed.)"""
        if len(blocks) == 2 and blocks[0][0] == blocks[1][0]:
            blocks = blocks[:1]
        need = transient
        for block in blocks:
            need += block[2]
        if need > self.capacity:
            self.oom_events += 1
            return Admission(fits=False)
        resident, distrusted, touched = self.resident, self.distrusted, self.touched
        held: set[Key] = set()
        kept = {block[0] for block in blocks}
        admission = Admission(True, held, kept)
        for key, version, nbytes, region in blocks:
            if isinstance(key, int):
                touched.add(key)
            have = resident.get(key)
            if have is not None and have[0] == version and key not in distrusted:  # ``holds``
                resident.move_to_end(key)
                held.add(key)
                continue
            if have is not None:  # another version, or distrusted: useless now
                self._evict(key, admission)
            inside = self._inside(region, version)
            if inside is not None:
                container = inside[0]
                resident.move_to_end(container)
                if isinstance(container, int):
                    touched.add(container)
                held.add(key)
                kept.add(container)
                admission.within = {**(admission.within or {}), key: inside}
                continue
            resident[key] = (version, nbytes)
            self.used += nbytes
            if region is not None:
                self.regions[key] = region
                self._by_matrix.setdefault(region[0], set()).add(key)
        if self.used + transient > self.capacity:  # least recently used first, to fit
            victims = []
            room = self.used + transient - self.capacity
            for key, (_, nbytes) in resident.items():
                if room <= 0:
                    break
                if key not in kept:
                    victims.append(key)
                    room -= nbytes
            for key in victims:
                self._evict(key, admission)
        return admission

    def _inside(self, region: Region | None, version: int) -> tuple[Key, int, int] | None:
        """A resident block at ``version`` that ``region`` lies within: its key, the
        element offset of ``region``'s first element in its bytes, and their ld."""
        if region is None or region[0] not in self._by_matrix:
            return None
        matrix, row, col, rows, cols, _ = region
        for key in self._by_matrix[matrix]:
            _, r0, c0, rows0, cols0, ld = self.regions[key]
            if (
                r0 <= row
                and row + rows <= r0 + rows0
                and c0 <= col
                and col + cols <= c0 + cols0
                and self.holds(key, version)
            ):
                return key, (row - r0) * ld + (col - c0), ld
        return None

    def covers(self, key: Key, version: int, region: Region | None) -> bool:
        """Whether the block is held at ``version``: itself, or within one held."""
        return self.holds(key, version) or self._inside(region, version) is not None

    def keeps(self, anchor: Hashable) -> bool:
        """Whether any resident block is ``anchor`` (a key) or a block of it (a matrix)."""
        return anchor in self._by_matrix or anchor in self.resident

    def holds(self, key: Key, version: int) -> bool:
        """Whether the block is resident at ``version``, and trusted."""
        have = self.resident.get(key)
        return have is not None and have[0] == version and key not in self.distrusted

    def sweep(self) -> list[int]:
        """Let go of the panels no tile placed or read since the last sweep (a step ended):
        their ids, for the device to drop."""
        touched = self.touched
        stale = [key for key in self.resident if isinstance(key, int) and key not in touched]
        for key in stale:
            self._forget(key)
        self.touched = set()
        return stale

    def distrust(self) -> None:
        """Hold no block kept so far as current: the bytes under its version may have
        changed (a new job's versions start again; the weights were restored). Each is
        sent again, and dropped under its old ref, when next used."""
        self.distrusted = set(self.resident)

    def _forget(self, key: Key) -> int:
        """Take ``key`` out of the memory; its version."""
        self.distrusted.discard(key)
        version, nbytes = self.resident.pop(key)
        self.used -= nbytes
        region = self.regions.pop(key, None)
        if region is not None:
            blocks = self._by_matrix[region[0]]
            blocks.discard(key)
            if not blocks:
                del self._by_matrix[region[0]]
        return version

    def _evict(self, key: Key, admission: Admission) -> None:
        version = self._forget(key)
        if isinstance(key, int):
            admission.evicted_panels = [*admission.evicted_panels, key]
        else:
            admission.evicted = [*admission.evicted, [*key, version]]

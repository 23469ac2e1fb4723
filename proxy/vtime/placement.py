"""Which virtual device computes which tile: the scheduling policies.

A policy reads virtual-time state only (FIFO free times, tiles outstanding in
virtual time, the device models), never which socket answered first, so the
same script on the same fleet places every tile the same way on every run.
Ties go to the lowest device id. A convolution tile goes only to a device that computes
convolutions (``VirtualDevice.convolutions``); the policies choose among those.

- ``round-robin`` cycles through the devices from where it last stopped;
- ``load-balanced`` picks the fewest tiles outstanding;
- ``greedy`` picks the earliest predicted finish: the device's downlink,
  compute and uplink queues (everything placed on it so far) plus this
  tile's transfer and compute under the device's models at its current
  frequency. The prediction counts every operand byte, but for a device that
  holds some of the tile's blocks already (sent by an earlier request): its
  prediction leaves them out, so the data draws its tiles where that pays.

A device keeps the operand blocks it is sent for any later tile that needs them
(``memory``), so where a request's tiles go decides how many bytes cross: tiles of one
row of the output share their A block, tiles of one column their B block. Tile by
tile, greedy spreads a row over the fleet and sends its A block to every device. So
greedy places a request of many tiles as a whole (``plan``): it shares the tiles out by
when each device would be free and how fast it would get through them (water-filling
on its predicted rate), then gives each device a block of rows × columns of the tile
grid of its share's size (recursive bisection, as SUMMA's 2-D distribution): a device
then needs the A blocks of its rows and the B blocks of its columns, once each.

The tile edge is the job's, or with ``auto_block`` the one ``partition.auto_edge`` picks by
``span``: what greedy predicts a request takes on the fleet, each device free and at its top
clock, so that the same fleet cuts the same request the same way whenever it arrives.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from morphling.devices.models.conv_shape import ConvShape

from .vdevice import VirtualDevice, Work

POLICIES = ("round-robin", "greedy", "load-balanced")
SPANS_KEPT = 4096  # ``span``'s answers kept (a run repeats few request shapes)

Floats = npt.NDArray[np.float64]
# ``_finish`` computes on one device's floats or on the whole fleet's arrays
F = TypeVar("F", float, Floats)
F_co = TypeVar("F_co", covariant=True)


class _Row(Protocol[F_co]):
    """Four values by index: ``_free``'s, or a row of ``_links`` (floats, or arrays)."""

    def __getitem__(self, index: int, /) -> F_co: ...


class Placement:
    """A policy over the fleet's devices, kept ordered by id.

    Greedy predicts every device's finish on arrays: each device's FIFO free
    times and link figures, and its compute time for the tile's shape from one
    device per distinct profile. They are rebuilt when the fleet has changed, at
    the next placement: a fleet of a thousand joining devices costs one rebuild,
    not a thousand.

    A device away (``away``: its availability) keeps its row, masked, so a fleet coming
    and going costs no rebuilds.

    A GEMM's tiles mostly share one shape and one issue time, and a placement
    changes only the device that took the tile. So greedy keeps the predictions
    it made, with the time and the ``Work`` object they are for (the timeline
    gives a GEMM's tiles of one shape the same one), and ``placed`` brings the
    device that took a tile up to date: while tiles ask the same, each costs one
    device's prediction, not the fleet's. Both are ``_finish``, so a kept
    prediction is the very float a fresh one would be.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.devices: list[VirtualDevice] = []
        self._ids: list[int] = []
        self._conv_ids: list[int] = []  # those that compute convolutions
        self._kinds: dict[int, str] = {}  # device id → its profile, as a grouping key
        self._stale = True
        self._cursor = -1  # round-robin: the id of the device served last
        self._kept: _Predicted | None = None  # greedy's predictions, while they hold
        # devices away (availability): placed among the others, with no tile for them
        self._absent: set[int] = set()
        self._absent_mask = np.zeros(0, dtype=bool)  # by index, as the arrays
        # ``span``'s answers while the fleet stays as it is: a step repeats its requests
        self._spans: dict[tuple[Work, int, int, int], float] = {}

    def add(self, device: VirtualDevice) -> None:
        index = bisect.bisect(self._ids, device.id)
        self._ids.insert(index, device.id)
        self.devices.insert(index, device)
        if device.convolutions:
            bisect.insort(self._conv_ids, device.id)
        self._kinds[device.id] = repr(device.profile)
        self._stale, self._kept = True, None
        self._spans.clear()

    def away(self, device_id: int) -> None:
        """No tiles for it until ``back``: cheaper than ``remove`` and ``add``, which a
        fleet of thousands coming and going would make at every placement."""
        if device_id in self._kinds and device_id not in self._absent:
            self._absent.add(device_id)
            self._mark(device_id, True)

    def back(self, device_id: int) -> None:
        if device_id in self._absent:
            self._absent.discard(device_id)
            self._mark(device_id, False)

    def _mark(self, device_id: int, absent: bool) -> None:
        self._kept = None
        self._spans.clear()
        if not self._stale:
            self._absent_mask[bisect.bisect_left(self._ids, device_id)] = absent

    def remove(self, device_id: int) -> None:
        """No more tiles for it (what it has placed stays placed)."""
        self._absent.discard(device_id)
        if self._kinds.pop(device_id, None) is not None:
            index = self._ids.index(device_id)
            del self._ids[index], self.devices[index]
            if device_id in self._conv_ids:
                self._conv_ids.remove(device_id)
            self._stale, self._kept = True, None
            self._spans.clear()

    def can_place(self, conv: bool, device: int | None = None) -> bool:
        """Whether some device (``device``, if given) can take a tile (a convolution's,
        ``conv``: one that computes them)."""
        ids = self._conv_ids if conv else self._ids
        if device is None:
            absent = self._absent
            return len(ids) > len(absent) or any(i not in absent for i in ids)
        at = bisect.bisect_left(ids, device)
        return at < len(ids) and ids[at] == device and device not in self._absent

    def index(self, device: int) -> int:
        """Device ``device``'s index in ``devices`` (one that is there), for a tile that
        goes there whatever the policy says (``placed`` follows)."""
        if self._stale:
            self._rebuild()
        return bisect.bisect_left(self._ids, device)

    def _rebuild(self) -> None:
        devices = self.devices
        self._conv_mask = np.array([d.convolutions for d in devices], dtype=bool)
        kinds: dict[str, int] = {}
        self._groups = [kinds.setdefault(self._kinds[d.id], len(kinds)) for d in devices]
        self._group = np.array(self._groups, dtype=np.intp)
        self._models = [devices[self._groups.index(g)] for g in range(len(kinds))]
        # latency and seconds per byte each way (0 on an ideal link), a row per device
        profiles = [d.profile for d in devices]
        self._links = [(p.dl_lat_s, 1.0 / p.dl_bw, p.ul_lat_s, 1.0 / p.ul_bw) for p in profiles]
        self._link_columns = np.array(self._links).reshape(-1, 4).T
        self._free = np.empty((len(devices), 4))  # ``_free`` of each device, a row each
        self._changed = set(range(len(devices)))  # rows to read again before they are used
        self._absent_mask = np.array([d.id in self._absent for d in devices], dtype=bool)
        self._stale = False

    def placed(self, index: int) -> None:
        """Device ``index`` took a tile: refresh what greedy knows of it."""
        if self.policy != "greedy":
            return
        self._changed.add(index)
        kept = self._kept
        if kept is not None:
            nominal = kept.nominal[self._groups[index]]
            free, link = _free(self.devices[index]), self._links[index]
            kept.finish[index] = _finish(kept.now, kept.work, nominal, free, link, max)

    def choose(self, now: float, work: Work, held: Mapping[int, int] | None = None) -> int:
        """The index (in ``devices``) of the device for one tile, which one can take
        (``can_place``). ``held`` (greedy's only): the tile's operand bytes each device (by
        index) holds already, which greedy leaves out of that device's prediction."""
        best = self._choose(now, work)
        return self._holder(now, work, best, held) if held else best

    def _holder(self, now: float, work: Work, best: int, held: Mapping[int, int]) -> int:
        """``best``, or a device holding some of the tile's operands that would finish
        first without them (ties to the lowest index)."""
        kept = self._kept
        if kept is None or kept.work is not work:  # one device: no choice
            return best
        finish = float(kept.finish[best])
        conv = isinstance(work.shape, ConvShape)
        for index in sorted(held):
            device = self.devices[index]
            if (conv and not device.convolutions) or device.id in self._absent:
                continue
            lighter = Work(work.bytes_down - held[index], work.bytes_up, work.shape)
            nominal = kept.nominal[self._groups[index]]
            then = _finish(now, lighter, nominal, _free(device), self._links[index], max)
            if then < finish or (then == finish and index < best):
                best, finish = index, then
        return best

    def _choose(self, now: float, work: Work) -> int:
        kept = self._kept
        if kept is not None and kept.now == now and kept.work is work:
            return int(kept.finish.argmin())
        devices = self.devices
        if self._stale:
            self._rebuild()
        # a convolution's tile, and some device cannot compute it: choose among the others
        some = isinstance(work.shape, ConvShape) and len(self._conv_ids) < len(devices)
        if self.policy == "greedy":
            return self._greedy(now, work, some) if len(devices) > 1 else 0  # one: no choice
        absent = self._absent
        if self.policy == "load-balanced":
            counts = [
                d.outstanding(now) if (d.convolutions or not some) and d.id not in absent
                else math.inf
                for d in devices
            ]  # fmt: skip
            return counts.index(min(counts))
        ids = self._conv_ids if some else self._ids
        if absent:
            ids = [i for i in ids if i not in absent]
        self._cursor = ids[bisect.bisect_right(ids, self._cursor) % len(ids)]
        return bisect.bisect_left(self._ids, self._cursor)

    def _greedy(self, now: float, work: Work, some: bool) -> int:
        """The earliest predicted finish (among the devices that compute convolutions, for
        one's tile, ``some``); argmin keeps the first of equals (lowest id)."""
        for index in self._changed:
            self._free[index] = _free(self.devices[index])
        self._changed.clear()
        nominal = [d.nominal_s(work.shape) for d in self._models]
        nominals: Floats = np.array(nominal)[self._group]
        finish = _finish(now, work, nominals, self._free.T, self._link_columns, np.maximum)
        if some:
            finish = np.where(self._conv_mask, finish, np.inf)
        if self._absent:
            finish = np.where(self._absent_mask, np.inf, finish)
        self._kept = _Predicted(now, work, nominal, finish)
        return int(finish.argmin())

    def plan(
        self, now: float, work: Work, cells: Sequence[tuple[Hashable, Hashable]]
    ) -> list[int] | None:
        """Greedy's devices (indices in ``devices``) for a request's tiles placed at ``now``,
        each tile named by its ``cell``: the keys of its A block and its B block (tiles
        that share a key share that block). ``work`` is a typical tile's. None where the
        tiles are not a whole grid (a batched GEMM whose pivots share no block: each pivot
        its own grid) or fewer than two devices can take them: then greedy places tile by
        tile."""
        rows = _ranks(cell[0] for cell in cells)
        cols = _ranks(cell[1] for cell in cells)
        if len(rows) * len(cols) != len(cells):
            return None
        if self._stale:
            self._rebuild()
        able = self._able(isinstance(work.shape, ConvShape))
        if len(able) < 2:
            return None
        self._kept = None  # (its tiles change the devices' queues: predict afresh after)
        shares = self._shares(now, work, able, len(cells), len(rows), len(cols))
        owner = np.empty((len(rows), len(cols)), dtype=np.intp)
        _bisect((0, len(rows), 0, len(cols)), [(i, n) for i, n in shares if n], owner)
        at_row = [rows[a] for a, _ in cells]
        at_col = [cols[b] for _, b in cells]
        placed: list[int] = owner[at_row, at_col].tolist()
        return placed

    def span(self, work: Work, tiles: int, rows: int, cols: int) -> float:
        """Seconds greedy predicts a request of ``tiles`` tiles like ``work`` (a grid of
        ``rows`` × ``cols``, per pivot) takes on the devices that can take them, each as if
        it were free and at its top clock: the fleet, not its state, so that the same fleet
        gives the same answer whenever asked (``auto_block`` compares tile edges by it)."""
        key = (work, tiles, rows, cols)
        seconds = self._spans.get(key)
        if seconds is None:
            if self._stale:
                self._rebuild()
            able = self._able(isinstance(work.shape, ConvShape))
            seconds = (
                self._fill(0.0, work, able, tiles, rows, cols, idle=True)[2] if able else math.inf
            )
            if len(self._spans) >= SPANS_KEPT:
                self._spans.clear()
            self._spans[key] = seconds
        return seconds

    def _able(self, conv: bool) -> list[int]:
        """The indices of the devices present that can take a tile (a convolution's)."""
        absent = self._absent
        return [
            i for i, d in enumerate(self.devices)
            if (d.convolutions or not conv) and d.id not in absent
        ]  # fmt: skip

    def _shares(
        self, now: float, work: Work, able: list[int], tiles: int, rows: int, cols: int
    ) -> list[tuple[int, int]]:
        """How many of ``tiles`` each device of ``able`` takes: the counts that would end
        them together (``_fill``). Integers by largest remainder, ties to the lowest
        index."""
        starts, seconds, end = self._fill(now, work, able, tiles, rows, cols, idle=False)
        exact = [max(0.0, (end - starts[j]) / seconds[j]) for j in range(len(able))]
        counts = [int(x) for x in exact]
        by_remainder = sorted(range(len(able)), key=lambda j: (counts[j] - exact[j], j))
        for j in by_remainder[: tiles - sum(counts)]:
            counts[j] += 1
        return list(zip(able, counts, strict=True))

    def _fill(
        self, now: float, work: Work, able: list[int], tiles: int, rows: int, cols: int,
        *, idle: bool,
    ) -> tuple[list[float], list[float], float]:  # fmt: skip
        """Water-filling: each device of ``able`` takes a tile per its predicted seconds
        (compute at its current speed, or its link's share of a tile's operands as a block
        of the grid sends them, whichever is longer) from when its first would be back
        (greedy's prediction, behind everything placed on it; from ``now``, at the top
        clock, when ``idle``) less one tile's seconds; devices join while they start before
        the end.
        Each device's start and seconds, and the end of ``tiles``."""
        # A device's block of about tiles/devices, as square as the grid lets it be: a tile
        # sends its A block once per row of it and its B block once per column, and only
        # the first row's tiles and each row's first tile send anything (pay the latency).
        side = math.sqrt(tiles / len(able))
        h = min(float(rows), max(1.0, side))
        w = min(float(cols), max(1.0, tiles / len(able) / h))
        down = work.bytes_down / 2 * (1 / w + 1 / h)
        sending = min(1.0, (h + w - 1) / (h * w))
        starts, seconds = [], []
        nominals = [model.nominal_s(work.shape) for model in self._models]  # per profile
        for i in able:
            free, links = _free(self.devices[i]), self._links[i]
            if idle:  # (and at its top clock: what heat does depends on when it is asked)
                free = (now, now, now, 1.0)
            nominal = nominals[self._groups[i]]
            compute = nominal / free[3]
            link = max(sending * links[0] + down * links[1], links[2] + work.bytes_up * links[3])
            seconds.append(max(compute, link, 1e-12))
            # when its first tile would be back (greedy's prediction), less one tile's time
            starts.append(_finish(now, work, nominal, free, links, max) - seconds[-1])
        order = sorted(range(len(able)), key=lambda j: (starts[j], j))
        rate = weighted = 0.0
        end = math.inf
        if idle:  # (``span``'s: no more devices than tiles, each computed whole on one)
            order = order[:tiles]
        for j in order:  # water-filling: add devices while they start before the end
            if starts[j] >= end:
                break
            rate += 1 / seconds[j]
            weighted += starts[j] / seconds[j]
            end = (tiles + weighted) / rate
        return starts, seconds, end


def _ranks(keys: Iterable[Hashable]) -> dict[Hashable, int]:
    """Each distinct key's rank in order of first appearance."""
    ranks: dict[Hashable, int] = {}
    for key in keys:
        ranks.setdefault(key, len(ranks))
    return ranks


def _bisect(
    rect: tuple[int, int, int, int],
    members: list[tuple[int, int]],
    owner: npt.NDArray[np.intp],
) -> None:
    """Give each device of ``members`` (index, tiles) a block of ``rect`` (rows r0:r1 ×
    columns c0:c1 of the grid) of about its tiles: split the devices in two halves of
    about equal tiles, and the rectangle in that proportion."""
    r0, r1, c0, c1 = rect
    if len(members) == 1 or (r1 - r0) * (c1 - c0) == 1:
        owner[r0:r1, c0:c1] = max(members, key=lambda m: (m[1], -m[0]))[0]
        return
    total = sum(n for _, n in members)
    half = cut = 0  # the cut whose left half is nearest to half the tiles
    left = 0
    for k in range(1, len(members)):
        left += members[k - 1][1]
        if not cut or abs(2 * left - total) < abs(2 * half - total):
            half, cut = left, k
    # across rows or columns: whichever gives the first half nearer its share of the cells
    # (the longer side on a tie, for blocks as square as they can be)
    share = half / total
    best: tuple[float, int, bool, int] | None = None
    for by_columns, lo, hi, across in ((False, r0, r1, c1 - c0), (True, c0, c1, r1 - r0)):
        if hi - lo >= 2:
            at = min(max(lo + round(share * (hi - lo)), lo + 1), hi - 1)
            error = abs((at - lo) * across - share * (r1 - r0) * (c1 - c0))
            cut_here = (error, lo - hi, by_columns, at)
            if best is None or cut_here < best:
                best = cut_here
    assert best is not None  # (a rectangle of two cells or more has a side of two)
    _, _, by_columns, at = best
    first, second = (
        ((r0, r1, c0, at), (r0, r1, at, c1)) if by_columns else ((r0, at, c0, c1), (at, r1, c0, c1))
    )
    _bisect(first, members[:cut], owner)
    _bisect(second, members[cut:], owner)


@dataclass(slots=True)
class _Predicted:
    """Greedy's predicted finish of every device for ``work`` placed at ``now``."""

    now: float
    work: Work
    nominal: list[float]  # the shape's seconds at the top clock, per device group
    finish: Floats


def _free(device: VirtualDevice) -> tuple[float, float, float, float]:
    """What greedy reads of a device's state: its FIFOs' free times and its speed."""
    return device.down.free_at, device.compute.free_at, device.up.free_at, device.speed()


def _finish(
    now: float,
    work: Work,
    nominal: F,
    free: _Row[F],
    link: _Row[F],
    maximum: Callable[[F, F | float], F],
) -> F:
    """When ``work`` placed at ``now`` would be back: for the whole fleet on arrays
    (``maximum`` = ``np.maximum``), or for one device on floats (``max``). ``free`` is
    ``_free``'s four values, ``link`` a row of ``_links``. The same IEEE operations in
    the same order either way (and no NaN, where the two maxima would differ), so both
    give the same numbers."""
    down = maximum(free[0], now)
    if work.bytes_down:
        down = down + (link[0] + work.bytes_down * link[1])
    comp = maximum(down, free[1]) + nominal / free[3]
    return maximum(comp, free[2]) + link[2] + work.bytes_up * link[3]

"""Replay (``--numerics sample:K``): K ranks computed for real, every other rank timed by
replaying the work of the computed rank it copies.

The script runs as K processes (a world of K for torch and gloo: its numerics are those
of K ranks). Rank s ≥ K copies computed rank ``s mod K``: whatever that rank asks the
timeline (its products by shape, its collectives, its waits, its step marks), the timeline
is asked again for s, on s's own device (profile, thermal state, link), which has no
agent: it is timed, never given tiles. A collective of the computed world is one of all
N ranks, its bytes per member as the computed rank said.

Copies whose devices the timeline cannot tell apart (the same profile, so the same
model, link and cooling, and no absences) would be timed alike, event for event: nothing
they share tells them apart, a collective ending for all its members at once. So of each
such *class* one copy is timed and the others *mirror* it (``classes``): they take
their part in each collective with it, on their own links, and have its times. That
makes a what-if of thousands of ranks on a few kinds of board cost a few timed ranks.

That is right when every rank does the same work whatever its data, as data-parallel
and federated training do with a fixed batch per rank; it is wrong where control flow
depends on the rank or its data (a pipeline's stages, early exits, variable-length
batches). Collectives over part of the world and point-to-point ones cannot be mapped
onto the N ranks and are refused; computed ranks whose work differs in a step are
logged and counted in ``summary`` (with K ≥ 2 they are compared).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence

from morphling.proxy.vtime.collectives import PAIR
from morphling.proxy.wire.errors import RemoteProtocolError

log = logging.getLogger(__name__)

DIVERGED_KEPT = 16  # the first steps whose computed ranks differed, kept for the report
NUMERICS_HELP = (
    "'all' computes everything on the devices; 'sample:K': with --ranks, computes ranks "
    "0..K-1 for real and times every other rank s by replaying rank s mod K's work on s's "
    "own device; without, computes K tiles of each offloaded GEMM or convolution on their "
    "devices and the rest of it on this host, every tile timed on its device all the same"
)


def parse_numerics(spec: str, ranks: int) -> int | None:
    """``--numerics``: None for ``all``, else K of ``sample:K`` (K >= 1, and with
    ``ranks``, K <= ``ranks``)."""
    if spec == "all":
        return None
    kind, _, count = spec.partition(":")
    if kind != "sample" or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--numerics {spec!r}: give 'all' or 'sample:K' with K >= 1")
    if ranks and int(count) > ranks:
        raise ValueError(f"--numerics {spec}: {count} computed ranks, but --ranks is {ranks}")
    return int(count)


class Replay:
    """Which ranks are computed, which replayed and on which devices, and whether the
    computed ranks did the same work."""

    def __init__(self, world: int, computed: int, devices: Mapping[int, int]) -> None:
        """``devices``: each replayed rank's device id in the timeline."""
        if not 1 <= computed <= world:
            raise ValueError(f"{computed} computed ranks of {world}: need 1 <= K <= ranks")
        self.world, self.computed = world, computed
        self.devices = dict(devices)
        self.members = tuple(range(world))  # the whole world's collectives' (one tuple)
        # the classes of copies timed alike (``classes``): the timed copy's rank and device,
        # and its mirrors', by rank
        self.mirrored: list[tuple[int, int, dict[int, int]]] = []
        self._work: dict[int, Hashable] = {}  # step → the first computed rank's work
        self.diverged: list[dict[str, int]] = []
        self.diverged_steps = 0

    def copies(self, rank: int) -> list[int]:
        """The replayed ranks that copy computed ``rank``."""
        return list(range(rank + self.computed, self.world, self.computed))

    def classes(
        self, rank: int, alike: Callable[[int], Hashable | None]
    ) -> list[tuple[int, dict[int, int]]]:
        """The copies of computed ``rank`` in classes timed alike, each (the copy timed,
        the devices of those that mirror it, by rank); ``alike(device)``: what a copy on
        ``device`` is timed by, equal for devices timed alike (None: its own)."""
        found: dict[Hashable, tuple[int, dict[int, int]]] = {}
        classes = []
        for copy in self.copies(rank):
            device = self.devices[copy]
            key = alike(device)
            same = found.get(key) if key is not None else None
            if same is None:
                same = found[key if key is not None else ("own", copy)] = (copy, {})
                classes.append(same)
            else:
                same[1][copy] = device
        self.mirrored += [(t, self.devices[t], m) for t, m in classes if m]
        return classes

    def group(self, op: str, ranks: Sequence[int], what: str) -> tuple[int, ...]:
        """The members, among all ranks, of collective ``op`` over computed ``ranks``: all
        of them when it is the computed world's; refused otherwise (a point-to-point one
        too: which replayed rank would be its peer?)."""
        if op not in PAIR and sorted(ranks) == list(range(self.computed)):
            return self.members
        raise RemoteProtocolError(
            f"{what}: {op} over ranks={list(ranks)!r:.80}: replay maps only collectives of "
            "the whole world onto the replayed ranks (not point-to-point ones, nor those of "
            "part of the world); run this script with --numerics all",
            "bad_collective",
        )

    def check(self, rank: int, step: int, work: Hashable) -> None:
        """Computed ``rank``'s ``work`` in ``step`` (a digest of its shapes): one that
        differs from the first computed rank's to report it is logged and counted."""
        first = self._work.setdefault(step, work)
        if first == work:
            return
        self.diverged_steps += 1
        if len(self.diverged) < DIVERGED_KEPT:
            self.diverged.append({"step": step, "rank": rank})
        if self.diverged_steps == 1:
            log.warning(
                "replay: computed rank %d did other work than another computed rank in "
                "step %d (its shapes differ): the ranks replaying them may be timed wrong",
                rank,
                step,
            )

    def summary(self) -> dict[str, object]:
        return {
            "world": self.world,
            "computed": list(range(self.computed)),
            "replayed": self.world - self.computed,
            "copies": f"rank s replays rank s mod {self.computed}",
            "timed": self.world - self.computed - sum(len(m) for _, _, m in self.mirrored),
            "mirrors": [
                {"rank": rank, "device": device, "ranks": list(m), "devices": list(m.values())}
                for rank, device, m in self.mirrored
            ],
            "diverged_steps": self.diverged_steps,
            "diverged": self.diverged,
        }

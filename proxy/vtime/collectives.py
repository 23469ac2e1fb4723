"""How long a rank's collective takes on the emulated network, once its last member is there.

Each member is a device with its links (the profile's latency and bandwidth each way); a
transfer of b bytes from member i to member j takes ``ul_lat_i + dl_lat_j + b /
min(ul_bw_i, dl_bw_j)``: i's uplink and j's downlink carry it at the slower one's rate. A
shared bottleneck (an access point, ``--bottleneck-bw``) carries every transfer of a round
besides: a round takes at least its bytes over the bottleneck's rate.

S is the bytes each member holds (the ``nbytes`` its COLLECTIVE says; the largest, should
they differ). One member: no transfer, no time. Three algorithms (``--collective``):

``ring`` (gloo's) for the operations every member contributes to, the root's own link for
the rooted ones:

- all-reduce: 2(n−1) rounds, each member sending S/n to the next (reduce-scatter, then
  all-gather); over n equal links, 2(n−1)/n·S/bw plus 2(n−1) latencies each way: the
  closed form the tests check;
- reduce-scatter (S each member's input) and all-to-all: n−1 rounds of S/n; all-gather
  (S each member's input): n−1 rounds of S; barrier: an all-reduce of nothing;
- broadcast and scatter: the root sends S to each other member in turn, over its uplink;
  reduce and gather: each sends S to the root, in turn over its downlink.

``tree``: a binary tree rooted at the root (member 0 for the unrooted operations), member
p's children 2p+1 and 2p+2 counted from the root in group order. Data goes up the tree a
level at a time (a parent receives from its children in turn), then down it (a parent
sends to its children in turn): all-reduce reduces S up and broadcasts S down; an
all-gather sends each subtree's share up and the rest of the result down; a
reduce-scatter reduces S up and sends each subtree its chunks down; the rooted ones go
one way. All-to-all has no tree: it is priced as ``ring``.

``star``: a parameter server on the emulator's host, whose own link is the bottleneck (if
any): every member that sends sends at once over its uplink, then every member that
receives receives at once over its downlink, each phase as long as its slowest transfer
(or its bytes over the bottleneck). The server reduces and gathers; an all-reduce sends S
up and S down, an all-gather S up and (n−1)·S down.

Whatever the algorithm, a pair's send/recv is one transfer of S from the source to the
destination.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

RING = frozenset({"allreduce", "reduce_scatter", "alltoall", "allgather", "barrier"})
FROM_ROOT = frozenset({"broadcast", "scatter"})
TO_ROOT = frozenset({"reduce", "gather"})
PAIR = frozenset({"send", "recv"})
ALGORITHMS = ("ring", "tree", "star")


def _tree_bytes(op: str, size: float, n: int, s: int) -> tuple[float | None, float | None]:
    """What a tree member whose subtree has ``s`` members sends its parent, and what its
    parent sends it (None: nothing that way)."""
    match op:
        case "allreduce":
            return size, size
        case "barrier":
            return 0.0, 0.0
        case "reduce":
            return size, None
        case "broadcast":
            return None, size
        case "allgather":
            return s * size, (n - s) * size
        case "reduce_scatter":
            return size, s * size / n
        case "gather":
            return s * size, None
        case "scatter":
            return None, s * size
    raise ValueError(f"collective {op!r}: no tree")


def _star_bytes(op: str, size: float, n: int, root: bool) -> tuple[float | None, float | None]:
    """What a star member (the ``root`` or not) sends the server, and what the server sends
    it (None: nothing that way). Every member is a leaf of the server: in the operations
    every member contributes to, it moves what a tree's leaf does."""
    match op:
        case "reduce":
            return size, size if root else None
        case "broadcast":
            return (size, None) if root else (None, size)
        case "alltoall":
            return (n - 1) / n * size, (n - 1) / n * size
        case "gather":
            return (None, (n - 1) * size) if root else (size, None)
        case "scatter":
            return ((n - 1) * size, None) if root else (None, size)
    return _tree_bytes(op, size, n, 1)


class Link(NamedTuple):
    """A member's links: latency (s) and bandwidth (bytes/s), up and down."""

    ul_lat_s: float
    ul_bw: float
    dl_lat_s: float
    dl_bw: float


def _hop(src: Link, dst: Link, nbytes: float) -> float:
    return src.ul_lat_s + dst.dl_lat_s + nbytes / min(src.ul_bw, dst.dl_bw)


def collective_s(
    op: str,
    nbytes: int,
    links: Sequence[Link],
    root: int = 0,
    bottleneck_bw: float = math.inf,
    algorithm: str = "ring",
) -> float:
    """Seconds operation ``op`` of ``nbytes`` per member takes among ``links`` (one per
    member, in group order; ``root``: the root's or source's index) by ``algorithm``."""
    if op not in RING | FROM_ROOT | TO_ROOT | PAIR:
        raise ValueError(f"collective {op!r}: not one Morphling prices")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"collective algorithm {algorithm!r}: not one of {', '.join(ALGORITHMS)}")
    if len(links) < 2:
        return 0.0
    if op in PAIR:
        return max(_hop(links[0], links[1], nbytes), nbytes / bottleneck_bw)
    if algorithm == "star":
        return _star(op, nbytes, links, root, bottleneck_bw)
    if algorithm == "tree" and op != "alltoall":
        return _tree(op, nbytes, links, root, bottleneck_bw)
    return _ring(op, nbytes, links, root, bottleneck_bw)


def _ring(op: str, nbytes: int, links: Sequence[Link], root: int, bottleneck_bw: float) -> float:
    n = len(links)
    if op in RING:
        chunk, rounds = {
            "allreduce": (nbytes / n, 2 * (n - 1)),
            "barrier": (0.0, 2 * (n - 1)),
            "allgather": (float(nbytes), n - 1),
        }.get(op, (nbytes / n, n - 1))
        hop = max(_hop(links[i], links[(i + 1) % n], chunk) for i in range(n))
        return rounds * max(hop, n * chunk / bottleneck_bw)
    others = [i for i in range(n) if i != root]
    if op in FROM_ROOT:
        return sum(max(_hop(links[root], links[j], nbytes), nbytes / bottleneck_bw) for j in others)
    return sum(max(_hop(links[j], links[root], nbytes), nbytes / bottleneck_bw) for j in others)


def _tree(op: str, nbytes: int, links: Sequence[Link], root: int, bottleneck_bw: float) -> float:
    n = len(links)
    member = [(root + p) % n for p in range(n)]  # tree position → index in the group
    size = [1] * n  # each position's subtree
    for p in range(n - 1, 0, -1):
        size[(p - 1) // 2] += size[p]
    levels = n.bit_length() - 1  # positions 2^L − 1 ... 2^(L+1) − 2 are level L
    seconds = 0.0
    for way, order in ((0, range(levels, 0, -1)), (1, range(1, levels + 1))):  # up, down
        for level in order:
            busy: dict[int, float] = {}  # parent position → its transfers, in turn
            moved = 0.0
            for p in range(2**level - 1, min(2 ** (level + 1) - 1, n)):
                b = _tree_bytes(op, float(nbytes), n, size[p])[way]
                if b is None:
                    continue
                parent = (p - 1) // 2
                child, mine = links[member[p]], links[member[parent]]
                busy[parent] = busy.get(parent, 0.0) + (
                    _hop(child, mine, b) if way == 0 else _hop(mine, child, b)
                )
                moved += b
            if busy:
                seconds += max(max(busy.values()), moved / bottleneck_bw)
    return seconds


def _star(op: str, nbytes: int, links: Sequence[Link], root: int, bottleneck_bw: float) -> float:
    n = len(links)
    seconds = 0.0
    for way in (0, 1):  # up to the server, then down from it
        slowest: float | None = None
        moved = 0.0
        for i, link in enumerate(links):
            b = _star_bytes(op, float(nbytes), n, i == root)[way]
            if b is None:
                continue
            lat, bw = (link.ul_lat_s, link.ul_bw) if way == 0 else (link.dl_lat_s, link.dl_bw)
            slowest = max(slowest or 0.0, lat + b / bw)
            moved += b
        if slowest is not None:
            seconds += max(slowest, moved / bottleneck_bw)
    return seconds

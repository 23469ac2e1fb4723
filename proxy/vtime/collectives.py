"""How long a rank's collective takes on the emulated network, once its last member is there.

Each member is a device with its links (the profile's latency and bandwidth each way); a
transfer of b bytes from member i to member j takes ``ul_lat_i + dl_lat_j + b /
min(ul_bw_i, dl_bw_j)``: i's uplink and j's downlink carry it at the slower one's rate. A
shared bottleneck (an access point, ``--bottleneck-bw``) carries every transfer of a round
besides: a round takes at least its bytes over the bottleneck's rate.

The algorithms are gloo's ring for the operations every member contributes to, and the
root's own link for the rooted ones:

- all-reduce: 2(n−1) rounds, each member sending S/n to the next (reduce-scatter, then
  all-gather); over n equal links, 2(n−1)/n·S/bw plus 2(n−1) latencies each way: the
  closed form the tests check;
- reduce-scatter (S each member's input) and all-to-all: n−1 rounds of S/n; all-gather
  (S each member's input): n−1 rounds of S; barrier: an all-reduce of nothing;
- broadcast and scatter: the root sends S to each other member in turn, over its uplink;
  reduce and gather: each sends S to the root, in turn over its downlink;
- send/recv: one transfer of S from the source to the destination.

Bytes each member holds are the ``nbytes`` its COLLECTIVE says (the largest, should they
differ). One member: no transfer, no time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

RING = frozenset({"allreduce", "reduce_scatter", "alltoall", "allgather", "barrier"})
FROM_ROOT = frozenset({"broadcast", "scatter"})
TO_ROOT = frozenset({"reduce", "gather"})
PAIR = frozenset({"send", "recv"})


class Link(NamedTuple):
    """A member's links: latency (s) and bandwidth (bytes/s), up and down."""

    ul_lat_s: float
    ul_bw: float
    dl_lat_s: float
    dl_bw: float


def _hop(src: Link, dst: Link, nbytes: float) -> float:
    return src.ul_lat_s + dst.dl_lat_s + nbytes / min(src.ul_bw, dst.dl_bw)


def collective_s(
    op: str, nbytes: int, links: Sequence[Link], root: int = 0, bottleneck_bw: float = math.inf
) -> float:
    """Seconds operation ``op`` of ``nbytes`` per member takes among ``links`` (one per
    member, in group order; ``root``: the root's or source's index)."""
    n = len(links)
    if n < 2:
        return 0.0
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
    if op in TO_ROOT:
        return sum(max(_hop(links[j], links[root], nbytes), nbytes / bottleneck_bw) for j in others)
    if op in PAIR:
        return max(_hop(links[0], links[1], nbytes), nbytes / bottleneck_bw)
    raise ValueError(f"collective {op!r}: not one Morphling prices")

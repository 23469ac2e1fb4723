"""Two ends of one connection in one process, paired so some messages skip the socket.

The embedded emulator and its fleet share a process and an event loop. Each end of such
a connection says so (``offer``); once both have, they are partners, and a TILE (or
CONV_TILE) or TILE_RESULT that carries no payload bytes (its operands and C were handed
over as arrays, or lie in the operand arena) is handed to the other end on the loop instead of
being encoded, written, read and decoded again. That round through the kernel's
loopback was a fifth of an embedded training step (BENCHMARKS.md has the figures).
Everything else, bytes included, still goes through the socket; the messages that skip
it are independent of each other and of the rest (each such TILE names all it needs,
each TILE_RESULT its tile), so nothing depends on their order against the socket's. A
TILE that names a panel or a weight block by reference is not: it may read what an
earlier TILE, with bytes, left on the device, so it goes through the socket behind it.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar, cast

from morphling.proxy.wire.messages import ConvTile, Message, MsgType, Tile

HANDED_OVER = frozenset({MsgType.TILE, MsgType.CONV_TILE, MsgType.TILE_RESULT})

Key = tuple[object, object]  # (this end's socket address, the other end's)
End = TypeVar("End")

# Ends that offered, by their key: each end's partner is filed under the same two
# addresses the other way round.
_offers: dict[Key, tuple[object, asyncio.AbstractEventLoop]] = {}


def offer(end: End, here: object, there: object) -> tuple[Key, End | None]:
    """``end`` (at socket address ``here``, connected to ``there``) is in its other end's
    process: the key to ``withdraw`` the offer with, and the other end if it offered
    already, on the same event loop (the two are partners now), else None."""
    loop = asyncio.get_running_loop()
    other = _offers.pop((there, here), None)
    if other is None:
        _offers[here, there] = (end, loop)
        return (here, there), None
    partner, partner_loop = other
    return (here, there), cast(End, partner) if partner_loop is loop else None


def withdraw(end: object, key: Key) -> None:
    """``end`` is closing: forget its offer, if it still stands."""
    if _offers.get(key, (None,))[0] is end:
        del _offers[key]


def skips_socket(msg: Message) -> bool:
    """A paired end hands ``msg`` over instead of sending it: a TILE, CONV_TILE or
    TILE_RESULT with no payload bytes that reads nothing an earlier message left."""
    if msg.TYPE not in HANDED_OVER or any(map(len, msg.segments)):
        return False
    return not isinstance(msg, (Tile, ConvTile)) or not _by_reference(msg)


def _by_reference(msg: Tile | ConvTile) -> bool:
    """``msg`` names a panel, or a weight block the device may hold rather than map."""
    if msg.panel_a or msg.panel_b:
        return True
    return isinstance(msg, Tile) and bool(msg.ref_a or msg.ref_b)

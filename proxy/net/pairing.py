"""Two ends of one connection in one process, paired so some messages skip the socket.

The embedded emulator and its fleet share a process and an event loop. Each end of such
a connection says so (``offer``); once both have, they are partners, and a TILE or
TILE_RESULT that carries no payload bytes (its operands and C were handed over as
arrays, or lie in the operand arena) is handed to the other end on the loop instead of
being encoded, written, read and decoded again. That round through the kernel's
loopback was a fifth of an embedded training step (BENCHMARKS.md has the figures).
Everything else, bytes included, still goes through the socket; the messages that skip
it are independent of each other and of the rest (each TILE names all it needs, each
TILE_RESULT its tile), so nothing depends on their order against the socket's.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from morphling.proxy.wire.messages import Message, MsgType

HANDED_OVER = frozenset({MsgType.TILE, MsgType.TILE_RESULT})

Key = tuple[object, object]  # (this end's socket address, the other end's)


class End(Protocol):
    """What pairing needs of a connection's end: a place for its partner."""

    partner: End | None


# Ends that offered, by their key: each end's partner is filed under the same two
# addresses the other way round.
_offers: dict[Key, tuple[End, asyncio.AbstractEventLoop]] = {}


def offer(end: End, here: object, there: object) -> Key:
    """``end`` (at socket address ``here``, connected to ``there``) is in its other end's
    process: pair them once both have offered, on the same event loop. The key to
    ``withdraw`` the offer with."""
    loop = asyncio.get_running_loop()
    other = _offers.pop((there, here), None)
    if other is None:
        _offers[here, there] = (end, loop)
    elif other[1] is loop:
        end.partner, other[0].partner = other[0], end
    return (here, there)


def withdraw(end: End, key: Key) -> None:
    """``end`` is closing: forget its offer and part it from its partner."""
    if _offers.get(key, (None,))[0] is end:
        del _offers[key]
    if end.partner is not None:
        end.partner.partner = None
        end.partner = None


def skips_socket(msg: Message) -> bool:
    """A paired end hands ``msg`` over instead of sending it: a TILE or TILE_RESULT with
    no payload bytes."""
    return msg.TYPE in HANDED_OVER and not any(map(len, msg.segments))

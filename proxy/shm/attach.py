"""A peer attaching to what the emulator shares, from its GREETING, and saying so in HELLO.

GREETING announces the emulator's shared weights and operand arena (files in shared
memory) and its in-process token. A peer on the emulator's host maps the files it can;
one in the emulator's own process may hand arrays over instead of bytes. HELLO's
``caps`` tell the emulator what the peer attached, so it knows what it may send by
reference. Devices and jobs attach to different things; both do it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from morphling.proxy.wire.messages import Greeting

from . import handover
from .arena import OperandArena
from .weights import SharedWeights


@dataclass
class Attachment:
    """What a peer attached to; ``caps`` is what its HELLO says of it."""

    weights: SharedWeights | None = None
    arena: OperandArena | None = None
    process: str = ""  # the emulator's token, when it runs in this process
    caps: dict[str, object] = field(default_factory=dict)


def attach(
    greeting: Greeting, *, weights: bool = False, arena: bool = False, in_process: bool = False
) -> Attachment:
    """Map the shared weights and the operand arena (where asked and announced) and note
    the emulator's process (where asked and it is this one); what could not be mapped
    (another host, no room) is left out, and that peer gets bytes instead."""
    got = Attachment()
    if weights and greeting.weights:
        got.weights = SharedWeights.shared(greeting.weights)
        if got.weights is not None:
            got.caps["weights"] = str(got.weights.path)
    if arena and greeting.arena:
        got.arena = OperandArena.shared(greeting.arena)
        if got.arena is not None:
            got.caps["arena"] = str(got.arena.path)
    if in_process and handover.in_this_process(greeting.process):
        got.process = got.caps["process"] = greeting.process
    return got

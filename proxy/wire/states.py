"""Which messages each side may receive in each state, and where they lead.

The legal conversation as two tables (in the manner of h11's ``_state.py``):
``SERVER`` for what the emulator accepts from a peer, ``PEER`` for what a
device, job or probe client accepts from the emulator. ``Conversation`` checks
every received message against them; anything else is ``out_of_order``.
"""

from __future__ import annotations

from .codec import ProtocolError
from .messages import Message, MsgType

M = MsgType
_ALWAYS = frozenset({M.HEARTBEAT, M.BYE, M.ERROR})
_ANSWER_PROBES = frozenset({M.PROBE_ECHO, M.PROBE_PUSH, M.PROBE_PULL})
_PROBE_REPLIES = frozenset({M.PROBE_ECHO, M.PROBE_ACK, M.PROBE_PULLED})

SERVER: dict[str, frozenset[MsgType]] = {
    "hello": frozenset({M.HELLO}),
    "device": _ALWAYS
    | _ANSWER_PROBES
    | _PROBE_REPLIES
    | {M.PROBE_FLOPS_RESULT, M.PROBE_FLOPS_REQUEST, M.TILE_RESULT},
    "probe": _ALWAYS | _ANSWER_PROBES | {M.PROBE_FLOPS_REQUEST, M.PROBE_FLOPS_RESULT},
    "job_open": _ALWAYS | {M.OPEN},
    "job_restoring": _ALWAYS,  # OPEN asked for fresh weights: until OPEN answers
    "job": _ALWAYS | {M.GEMM, M.STEP, M.CLOSE, M.SLAB},
    "closed": frozenset(),
}

PEER: dict[str, frozenset[MsgType]] = {
    "greeting": frozenset({M.GREETING}),
    "hello_sent": frozenset({M.WELCOME, M.ERROR}),
    "device": _ALWAYS | _ANSWER_PROBES | _PROBE_REPLIES | {M.PROBE_FLOPS, M.PROBE_VERDICT, M.TILE},
    "probe": _ALWAYS | _ANSWER_PROBES | _PROBE_REPLIES | {M.PROBE_FLOPS, M.PROBE_VERDICT},
    # OPEN: the answer to an OPEN with ``fresh_weights``
    "job": _ALWAYS | {M.RESULT, M.STEP, M.CLOSE, M.SLAB, M.NOTICE, M.OPEN},
    "closed": frozenset(),
}


class Conversation:
    """The state of one connection, seen from ``side`` ("server" or "peer").

    A peer names its ``role`` ("device", "job" or "probe") up front; the
    server learns it from the peer's HELLO.
    """

    def __init__(self, side: str, role: str | None = None) -> None:
        if side not in ("server", "peer"):
            raise ValueError(f"side={side!r}: expected 'server' or 'peer'")
        self.side = side
        self.role = role
        self.table = SERVER if side == "server" else PEER
        self.state = "hello" if side == "server" else "greeting"

    def received(self, msg: Message) -> None:
        """Check ``msg`` is legal now and move to the state it leads to."""
        if msg.TYPE not in self.table[self.state]:
            raise ProtocolError(
                f"{msg.TYPE.name} is not allowed in state {self.state!r}", "out_of_order"
            )
        t = msg.TYPE
        if t in (M.BYE, M.ERROR):
            self.state = "closed"
        elif self.side == "server":
            if t == M.HELLO:
                self.role = msg.role
                self.state = "job_open" if msg.role == "job" else msg.role
            elif t == M.OPEN:
                self.state = "job"
            elif t == M.CLOSE:
                self.state = "closed"
        elif t == M.GREETING:
            self.state = "hello_sent"  # a peer answers the greeting with its HELLO at once
        elif t == M.WELCOME:
            self.state = self.role
        elif t == M.CLOSE:
            self.state = "closed"

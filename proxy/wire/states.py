"""The legal conversation, as a transition table (in the manner of h11's ``_state.py``).

Each end of a connection tracks two states: the emulator's and the peer's. A message
is legal if its sender's state allows it (``TRANSITIONS``), and it moves the sender
to the state the table names. A few messages move the *other* party too (GREETING
lets the peer say HELLO, HELLO makes the emulator answer, WELCOME moves the peer into
its role, the emulator's OPEN ends a job's wait for fresh weights): ``REACTIONS``
says from which of the receiver's states and to which; a message whose reaction finds
the receiver in none of them is illegal, so neither side can answer what was not
asked. ERROR and BYE, from either side, close both.

The same tables check what an end sends (a bug here: ``LocalProtocolError``) and what
it receives (the other side's fault: ``RemoteProtocolError``, answered with ERROR
``out_of_order``), so both ends agree on the state without ever exchanging it.
"""

from __future__ import annotations

from enum import Enum

from .messages import Hello, Message, MsgType, Open


class Party(Enum):
    EMULATOR = "emulator"
    PEER = "peer"

    # Members are singletons, so identity is their hash: Enum's own hashes the name in
    # Python, and every message sent and received looks its parties and states up.
    __hash__ = object.__hash__

    @property
    def other(self) -> Party:
        return Party.PEER if self is Party.EMULATOR else Party.EMULATOR


class State(Enum):
    """A party's state: what it may send next."""

    GREETING = "greeting"  # emulator: about to greet
    HELLO_WAIT = "hello_wait"  # emulator: greeted, waiting for HELLO
    ANSWER = "answer"  # emulator: has a HELLO to answer (WELCOME or ERROR)
    START = "start"  # peer: connected, waiting for GREETING
    HELLO = "hello"  # peer: greeted, to say HELLO
    WELCOME_WAIT = "welcome_wait"  # peer: waiting for WELCOME
    DEVICE = "device"
    PROBE = "probe"
    JOB_OPEN = "job_open"  # job: welcomed, to send OPEN
    JOB_RESTORING = "job_restoring"  # job: OPEN asked for fresh weights; waits for OPEN
    JOB = "job"
    CLOSED = "closed"

    __hash__ = object.__hash__  # as Party's


M = MsgType
S = State
E, P = Party.EMULATOR, Party.PEER

_ALWAYS = frozenset({M.HEARTBEAT, M.BYE, M.ERROR})
_PROBE_REQUESTS = frozenset({M.PROBE_ECHO, M.PROBE_PUSH, M.PROBE_PULL})
_PROBE_REPLIES = frozenset({M.PROBE_ECHO, M.PROBE_ACK, M.PROBE_PULLED})

_DEVICE_SENDS = _PROBE_REQUESTS | _PROBE_REPLIES | {M.PROBE_FLOPS_RESULT, M.PROBE_FLOPS_REQUEST}
_TO_DEVICE = (
    _PROBE_REQUESTS | _PROBE_REPLIES | {M.PROBE_FLOPS, M.PROBE_VERDICT, M.TILE, M.CONV_TILE}
)
_TO_JOB = {M.RESULT, M.STEP, M.CLOSE, M.SLAB, M.NOTICE, M.OPEN}

# What each party may send in each state; a message not named in MOVES keeps the state.
SENDS: dict[Party, dict[State, frozenset[MsgType]]] = {
    E: {
        S.GREETING: frozenset({M.GREETING, M.ERROR, M.BYE}),
        S.HELLO_WAIT: frozenset({M.ERROR, M.BYE}),
        S.ANSWER: frozenset({M.WELCOME, M.ERROR, M.BYE}),
        S.DEVICE: _ALWAYS | _TO_DEVICE,
        S.PROBE: _ALWAYS | _PROBE_REPLIES | {M.PROBE_FLOPS, M.PROBE_VERDICT, M.STATUS},
        S.JOB: _ALWAYS | _TO_JOB,
        S.CLOSED: frozenset(),
    },
    P: {
        S.START: frozenset({M.ERROR, M.BYE}),
        S.HELLO: frozenset({M.HELLO, M.ERROR, M.BYE}),
        S.WELCOME_WAIT: frozenset({M.ERROR, M.BYE}),
        S.DEVICE: _ALWAYS | _DEVICE_SENDS | {M.TILE_RESULT, M.TILE_MISSING},
        S.PROBE: _ALWAYS
        | _PROBE_REQUESTS
        | {M.PROBE_FLOPS_REQUEST, M.PROBE_FLOPS_RESULT, M.STATUS_ASK},
        S.JOB_OPEN: _ALWAYS | {M.OPEN},
        S.JOB_RESTORING: _ALWAYS,
        S.JOB: _ALWAYS | {M.GEMM, M.CONV, M.COLLECTIVE, M.WAIT, M.STEP, M.CLOSE, M.SLAB},
        S.CLOSED: frozenset(),
    },
}

# Where a message moves its sender: (party, state, type) → state.
MOVES: dict[tuple[Party, State, MsgType], State] = {
    (E, S.GREETING, M.GREETING): S.HELLO_WAIT,
    (P, S.HELLO, M.HELLO): S.WELCOME_WAIT,
    (E, S.JOB, M.CLOSE): S.CLOSED,
    (P, S.JOB, M.CLOSE): S.CLOSED,
}

# Where a message moves the other party: (sender, type) → {receiver's state: new state}.
REACTIONS: dict[tuple[Party, MsgType], dict[State, State]] = {
    (E, M.GREETING): {S.START: S.HELLO},
    (P, M.HELLO): {S.HELLO_WAIT: S.ANSWER},
    (E, M.WELCOME): {S.WELCOME_WAIT: S.WELCOME_WAIT},  # to the role's state: see ``ROLES``
    (E, M.OPEN): {S.JOB_RESTORING: S.JOB},
}

# A role's states once welcomed: (the emulator's, the peer's).
ROLES: dict[str, tuple[State, State]] = {
    "device": (S.DEVICE, S.DEVICE),
    "probe": (S.PROBE, S.PROBE),
    "job": (S.JOB, S.JOB_OPEN),
}


# What each party may send in each state that moves nobody (most of a conversation: GEMM,
# TILE, RESULT, HEARTBEAT, ...): checked with one lookup before the general rules.
_SPECIAL = frozenset({M.HELLO, M.WELCOME, M.OPEN, M.ERROR, M.BYE})
_STAYS: dict[Party, dict[State, frozenset[MsgType]]] = {
    party: {
        state: frozenset(
            t
            for t in types
            if t not in _SPECIAL and (party, state, t) not in MOVES and (party, t) not in REACTIONS
        )
        for state, types in states.items()
    }
    for party, states in SENDS.items()
}


class IllegalMessage(Exception):
    """``sender`` may not send this message now; the text says why."""


class ConversationState:
    """Both parties' states on one connection; ``role`` once the peer has named it."""

    def __init__(self, role: str | None = None) -> None:
        self.states = {E: S.GREETING, P: S.START}
        self.role = role

    def advance(self, sender: Party, msg: Message) -> None:
        """Move both parties as ``msg``, sent by ``sender``, moves them; ``IllegalMessage``
        (nothing changes) if it is not legal now."""
        t = msg.TYPE
        mine = self.states[sender]
        if t in _STAYS[sender][mine]:
            return
        receiver = sender.other
        theirs = self.states[receiver]
        if t not in SENDS[sender][mine]:
            who = f"the {sender.value}"
            raise IllegalMessage(f"{who} may not send {t.name} in state {mine.value!r}")
        reaction = REACTIONS.get((sender, t))
        if reaction is not None and theirs not in reaction:
            now = f"the {receiver.value} is in state {theirs.value!r}"
            raise IllegalMessage(f"{t.name} from the {sender.value} while {now}")
        new_mine = MOVES.get((sender, mine, t), mine)
        new_theirs = theirs if reaction is None else reaction[theirs]
        if isinstance(msg, Hello):  # an unknown role is the handshake's to refuse (bad_hello)
            if self.role is not None and msg.role != self.role:
                raise IllegalMessage(f"HELLO.role {msg.role!r}, but this peer is a {self.role}")
            self.role = msg.role if msg.role in ROLES else None
        elif t == M.WELCOME:
            if self.role is None:
                raise IllegalMessage("WELCOME to a peer whose HELLO named no known role")
            new_mine, new_theirs = ROLES[self.role]
        elif isinstance(msg, Open) and sender is P:
            new_mine = S.JOB_RESTORING if msg.fresh_weights else S.JOB
        elif t in (M.ERROR, M.BYE):
            new_mine = new_theirs = S.CLOSED
        # Only what changes is written: the blocking client's heartbeat thread sends while
        # its caller receives, and neither must write back a state it read before the other
        # moved it.
        if new_mine is not mine:
            self.states[sender] = new_mine
        if new_theirs is not theirs:
            self.states[receiver] = new_theirs

    def close(self) -> None:
        self.states = {E: S.CLOSED, P: S.CLOSED}

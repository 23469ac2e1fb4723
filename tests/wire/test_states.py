"""The conversation's transition table, and ``Connection`` checking both directions."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from morphling.proxy.wire import messages as m
from morphling.proxy.wire.codec import encode
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.errors import LocalProtocolError, RemoteProtocolError
from morphling.proxy.wire.states import (
    MOVES,
    REACTIONS,
    ROLES,
    SENDS,
    ConversationState,
    IllegalMessage,
    Party,
    State,
)

E, P = Party.EMULATOR, Party.PEER


VALUES = {"int": 0, "float": 0.0, "str": "x", "bytes": b"", "bool": False, "dict": {}, "list": []}


def header_fields(cls: type[m.Message]) -> list[dataclasses.Field[object]]:
    return [f for f in dataclasses.fields(cls) if f.name != "segments"]


def sample(msg_type: m.MsgType) -> m.Message:
    """A well-formed message of ``msg_type`` (its fields' values do not matter here)."""
    cls = m.MESSAGES[msg_type]
    fields = {f.name: VALUES[m.wire_type(f)] for f in header_fields(cls)}
    if msg_type == m.MsgType.HELLO:
        fields["role"] = "job"
    return cls(**fields, segments=(memoryview(b""),) * cls.SEGMENTS)


def handshake(role: str) -> Connection:
    """A peer's connection through GREETING, HELLO and WELCOME."""
    conn = Connection(P, role)
    conn.receive_message(m.Greeting(version=1, nonce=b"n", auth=False))
    conn.send(m.Hello(role=role))
    conn.receive_message(m.Welcome(peer_id=1, heartbeat_s=1.0))
    return conn


def test_every_state_of_each_party_is_in_the_table() -> None:
    peer_only = {State.START, State.HELLO, State.WELCOME_WAIT, State.JOB_OPEN, State.JOB_RESTORING}
    emulator_only = {State.GREETING, State.HELLO_WAIT, State.ANSWER}
    assert set(SENDS[E]) == set(State) - peer_only
    assert set(SENDS[P]) == set(State) - emulator_only
    for party, state, _ in MOVES:
        assert state in SENDS[party]
    for (sender, _), reaction in REACTIONS.items():
        assert set(reaction) <= set(SENDS[sender.other])


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_reaches_its_states_from_both_ends(role: str) -> None:
    """Both ends, fed the same handshake from their own side, agree on both states."""
    emulator = Connection(E)
    peer = Connection(P, role)
    for sender, receiver, msg in (
        (emulator, peer, m.Greeting(version=1, nonce=b"n", auth=False)),
        (peer, emulator, m.Hello(role=role)),
        (emulator, peer, m.Welcome(peer_id=1, heartbeat_s=1.0)),
    ):
        sender.hand_over(msg)
        receiver.receive_message(msg)
        assert sender.conversation.states == receiver.conversation.states
    assert (emulator.our_state, peer.our_state) == ROLES[role]
    assert emulator.role == peer.role == role


def test_a_job_opens_and_a_fresh_weights_open_waits_for_the_emulators_answer() -> None:
    job = handshake("job")
    with pytest.raises(LocalProtocolError, match="may not send GEMM in state 'job_open'"):
        job.send(sample(m.MsgType.GEMM))
    job.send(m.Open(fresh_weights=True))
    assert job.our_state is State.JOB_RESTORING
    with pytest.raises(LocalProtocolError):
        job.send(sample(m.MsgType.GEMM))
    job.receive_message(m.Open())  # the emulator's answer: the weights are restored
    assert job.our_state is State.JOB
    job.send(sample(m.MsgType.GEMM))
    with pytest.raises(RemoteProtocolError, match="OPEN from the emulator while the peer is"):
        job.receive_message(m.Open())  # nothing asked for it now


def test_a_result_crossing_the_jobs_close_is_legal() -> None:
    """The emulator may have sent RESULTs before it read the job's CLOSE."""
    job = handshake("job")
    job.send(m.Open())
    job.send(m.Close())
    assert job.our_state is State.CLOSED
    job.receive_message(sample(m.MsgType.RESULT))
    job.receive_message(m.Close())
    assert job.their_state is State.CLOSED
    with pytest.raises(RemoteProtocolError):
        job.receive_message(sample(m.MsgType.RESULT))


def test_error_or_bye_from_either_side_ends_the_conversation_for_both() -> None:
    for closing in (m.Error(code="x", reason="y"), m.Bye()):
        peer = handshake("device")
        peer.receive_message(closing)
        assert peer.our_state is peer.their_state is State.CLOSED
        with pytest.raises(LocalProtocolError):
            peer.send(m.Heartbeat())
        assert peer.send_error("late", "nobody to tell") == []


def test_what_the_table_forbids_is_refused_both_ways_and_changes_nothing() -> None:
    """Every (party, state, message) the table leaves out: refused as sent (a bug here)
    and as received (the other side's fault), the states as they were."""
    states = [s for s in State if s is not State.CLOSED]
    for party, state, msg_type in itertools.product(Party, states, m.MsgType):
        if state not in SENDS[party] or msg_type in SENDS[party][state]:
            continue
        conv = ConversationState("job")
        conv.states[party] = state
        before = dict(conv.states)
        with pytest.raises(IllegalMessage):
            conv.advance(party, sample(msg_type))
        assert conv.states == before


def test_a_hello_that_names_another_role_than_the_peers_own_is_refused() -> None:
    peer = Connection(P, "device")
    peer.receive_message(m.Greeting(version=1, nonce=b"n", auth=False))
    with pytest.raises(LocalProtocolError, match="this peer is a device"):
        peer.send(m.Hello(role="job"))


def test_welcome_after_a_hello_of_no_known_role_is_a_bug() -> None:
    """The emulator refuses such a HELLO (bad_hello); welcoming it is a local error."""
    emulator = Connection(E)
    emulator.send(m.Greeting(version=1, nonce=b"n", auth=False))
    emulator.receive_message(m.Hello(role="toaster"))
    with pytest.raises(LocalProtocolError, match="no known role"):
        emulator.send(m.Welcome(peer_id=1, heartbeat_s=1.0))
    assert emulator.send_error("bad_hello", "unknown role")  # refusing it is legal


def test_bytes_in_messages_out() -> None:
    """The decoder's messages come out checked: an out-of-order frame is refused."""
    emulator, peer = Connection(E), Connection(P, "probe")
    for buf in emulator.send(m.Greeting(version=1, nonce=b"n", auth=False)):
        peer.receive_data(buf)
    assert isinstance(peer.next_message(), m.Greeting)
    assert peer.next_message() is None
    for buf in peer.send(m.Hello(role="probe")) + peer.send(m.Bye()):
        emulator.receive_data(buf)
    assert isinstance(emulator.next_message(), m.Hello)
    assert isinstance(emulator.next_message(), m.Bye)
    stray = Connection(E)
    stray.send(m.Greeting(version=1, nonce=b"n", auth=False))
    for buf in encode(m.Heartbeat()):  # before HELLO
        stray.receive_data(buf)
    with pytest.raises(RemoteProtocolError, match="may not send HEARTBEAT in state 'hello'"):
        stray.next_message()

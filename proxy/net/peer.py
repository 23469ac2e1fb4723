"""The peer's side of a connection (a device, a job, ``morphling-bench``), on asyncio.

Every peer answers the emulator's GREETING with a HELLO, starts heartbeats on WELCOME
(giving up on an emulator silent for ``handshake.silence_s``), answers probe requests,
and ends on ERROR or BYE: that is done here, once, and each kind of peer says only what
differs (what its HELLO says, what it does once welcomed, refused or dismissed, and the
messages of its role).
"""

from __future__ import annotations

import abc

from morphling.proxy.wire import handshake
from morphling.proxy.wire.messages import Bye, Error, Greeting, Hello, Message, MsgType, Welcome

from .protocol import FrameConnection


class PeerProtocol(FrameConnection):
    """A peer's connection; subclasses implement the hooks below."""

    peer_id: int | None = None  # the emulator's id for this peer, once welcomed

    def message_received(self, msg: Message) -> None:
        t = msg.TYPE
        if t == MsgType.GREETING:
            assert isinstance(msg, Greeting)
            hello = self.greeted(msg)
            if hello is not None:
                self.send(hello)
        elif t == MsgType.WELCOME:
            assert isinstance(msg, Welcome)
            self.peer_id = msg.peer_id
            self.start_heartbeats(msg.heartbeat_s, handshake.silence_s(msg))
            self.welcomed(msg)
        elif t == MsgType.ERROR:
            assert isinstance(msg, Error)
            self.refused(msg.code, msg.reason)
            self.close()
        elif t == MsgType.BYE:
            assert isinstance(msg, Bye)
            self.dismissed(msg.reason)
            self.close()
        elif not self.answer_probe(msg) and t != MsgType.HEARTBEAT:
            self.received(msg)

    @abc.abstractmethod
    def greeted(self, greeting: Greeting) -> Hello | None:
        """The HELLO to answer with (``handshake.hello``); None when this peer cannot go on
        (it closed the connection, saying why)."""

    def welcomed(self, welcome: Welcome) -> None:
        """The emulator accepted this peer (``peer_id`` is set, heartbeats run)."""

    def refused(self, code: str, reason: str) -> None:
        """The emulator sent ERROR; the connection closes after this."""

    def dismissed(self, reason: str) -> None:
        """The emulator said goodbye (BYE); the connection closes after this."""

    @abc.abstractmethod
    def received(self, msg: Message) -> None:
        """A message of this peer's role (legal now: checked against the state table)."""

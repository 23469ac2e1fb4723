"""One end of a Morphling connection, sans-IO: bytes in, messages out; messages in, bytes out.

In the manner of h11's ``Connection``: it never touches a socket. The caller feeds
received bytes (``get_buffer``/``buffer_updated`` to receive large payloads where they
stay, or ``receive_data``), takes the messages they complete (``next_message``), and
turns each message it wants to send into buffers for its transport (``send``). Both
directions are checked against the conversation's transition table (``states``): a
message the other side may not send now is a ``RemoteProtocolError`` (answer it with
ERROR and close), one this side may not send a ``LocalProtocolError`` (a bug here).

Every peer uses it: the emulator's side of each connection, the device agent, the
asyncio and blocking job clients and ``morphling-bench``; byte movement (asyncio
protocols, a blocking socket loop, in-process hand-over) lives in ``proxy.net``.
"""

from __future__ import annotations

from collections.abc import Callable

from .codec import DEFAULT_MAX_PAYLOAD, Decoder, encode
from .errors import LocalProtocolError, RemoteProtocolError
from .messages import Error, Message
from .states import ConversationState, IllegalMessage, Party, State

Buffers = list[bytes | memoryview]


class Connection:
    """The protocol state of one connection, seen from ``party`` (see the module docstring).

    A peer names its ``role`` ("device", "job" or "probe") up front; the emulator
    learns it from the peer's HELLO.
    """

    def __init__(
        self,
        party: Party,
        role: str | None = None,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        allocate: Callable[[int], memoryview] | None = None,
    ) -> None:
        self.party = party
        self.conversation = ConversationState(role)
        self._decoder = Decoder(max_payload=max_payload, allocate=allocate)

    @property
    def role(self) -> str | None:
        return self.conversation.role

    @property
    def our_state(self) -> State:
        return self.conversation.states[self.party]

    @property
    def their_state(self) -> State:
        return self.conversation.states[self.party.other]

    @property
    def max_payload(self) -> int:
        """The largest payload a received frame may announce (checked before allocating)."""
        return self._decoder.max_payload

    @max_payload.setter
    def max_payload(self, nbytes: int) -> None:
        self._decoder.max_payload = nbytes

    @property
    def idle(self) -> bool:
        """No partial frame is buffered."""
        return self._decoder.idle

    # -- bytes in, messages out ------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go (a large payload's own memory, or scratch)."""
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the buffer ``get_buffer`` gave."""
        self._decoder.buffer_updated(nbytes)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take received bytes (copied where they must be kept)."""
        self._decoder.receive_data(data)

    def next_message(self) -> Message | None:
        """The next message the bytes completed, checked against the state; None until
        more bytes come. ``RemoteProtocolError`` when the other side broke the protocol."""
        msg = self._decoder.next_message()
        if msg is not None:
            self.receive_message(msg)
        return msg

    def receive_message(self, msg: Message) -> None:
        """Take ``msg`` as received (checked, the state moved): a message the other end,
        in this process, handed over instead of sending its bytes."""
        try:
            self.conversation.advance(self.party.other, msg)
        except IllegalMessage as exc:
            raise RemoteProtocolError(str(exc), "out_of_order") from None

    # -- messages in, bytes out --------------------------------------------------------

    def send(self, msg: Message) -> Buffers:
        """The buffers of ``msg``'s frame (its segments referenced, not copied), once it is
        checked legal and the state moved; ``LocalProtocolError`` if it is not legal."""
        self.hand_over(msg)
        return encode(msg)

    def hand_over(self, msg: Message) -> None:
        """Check ``msg`` and move the state as ``send`` does, without encoding it: the other
        end, in this process, takes the message itself (``receive_message``)."""
        try:
            self.conversation.advance(self.party, msg)
        except IllegalMessage as exc:
            raise LocalProtocolError(str(exc)) from None

    def send_error(self, code: str, reason: str) -> Buffers:
        """ERROR's frame, or nothing when the conversation is over already: an error found
        on a closed conversation has nobody left to tell."""
        if self.our_state is State.CLOSED:
            return []
        return self.send(Error(code=code, reason=reason))

    def close(self) -> None:
        """The transport is gone: nothing more may be sent or received."""
        self.conversation.close()

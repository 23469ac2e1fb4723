"""Protocol errors, the other side's apart from this side's (as h11 keeps them).

``RemoteProtocolError``: what arrived breaks the protocol (a malformed frame, a message
out of order, a request no emulator could serve); ``code`` is the ERROR frame's code,
and the connection is closed after it. ``LocalProtocolError``: this side tried to send
what the protocol does not allow now: a bug here, never the peer's fault.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Either kind; ``reason`` says what, ``code`` is the ERROR code to answer with."""

    def __init__(self, reason: str, code: str = "bad_frame") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class RemoteProtocolError(ProtocolError):
    """The other side broke the protocol."""


class LocalProtocolError(ProtocolError):
    """This side tried to break the protocol."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, "internal")

"""The handshake, both sides: GREETING, HELLO with the token's proof, WELCOME.

The emulator greets every connection with a nonce; a peer holding the shared token
answers with HMAC-SHA256(token, nonce) in its HELLO, so the token itself never crosses
the network. WELCOME gives the heartbeat period, and with it how long a peer waits on a
silent emulator before giving it up.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .errors import RemoteProtocolError
from .messages import Greeting, Hello, Welcome

# An emulator heartbeats every quiet peer; one silent this many periods is gone.
SILENT_PERIODS = 3


def expected_mac(token: str, nonce: bytes) -> bytes:
    """What a peer holding ``token`` answers to the emulator's ``nonce``."""
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def check_token(hello: Hello, token: str, nonce: bytes) -> None:
    """Emulator side: refuse (ERROR ``auth``) a HELLO without the proof ``token`` asks for."""
    if not token:
        return
    if not hello.mac:
        raise RemoteProtocolError("this emulator requires a token; HELLO had none", "auth")
    if not hmac.compare_digest(hello.mac, expected_mac(token, nonce)):
        raise RemoteProtocolError("token does not match (HMAC of the nonce differs)", "auth")


def token_missing(greeting: Greeting, token: str) -> bool:
    """Peer side: the emulator asks for a token this peer does not have."""
    return greeting.auth and not token


def hello(greeting: Greeting, token: str, role: str, **fields: Any) -> Hello:
    """Peer side: the HELLO answering ``greeting``, with the proof when we hold a token."""
    mac = expected_mac(token, greeting.nonce) if token else b""
    return Hello(role=role, mac=mac, **fields)


def silence_s(welcome: Welcome) -> float:
    """Peer side: how long the emulator may say nothing before the peer gives it up."""
    return SILENT_PERIODS * welcome.heartbeat_s

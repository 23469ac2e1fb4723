"""Token authentication: the peer proves it holds the token without sending it."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .messages import Greeting, Hello


def expected_mac(token: str, nonce: bytes) -> bytes:
    """What a peer holding ``token`` answers to the server's ``nonce``: HMAC-SHA256."""
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def mac_matches(token: str, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(mac, expected_mac(token, nonce))


def hello(greeting: Greeting, token: str, role: str, **fields: Any) -> Hello:
    """The HELLO answering ``greeting``, with the MAC when we hold a token."""
    mac = expected_mac(token, greeting.nonce) if token else b""
    return Hello(role=role, mac=mac, **fields)

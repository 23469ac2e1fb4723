"""Token authentication: the peer proves it holds the token without sending it."""

from __future__ import annotations

import hashlib
import hmac


def expected_mac(token: str, nonce: bytes) -> bytes:
    """What a peer holding ``token`` answers to the server's ``nonce``: HMAC-SHA256."""
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def mac_matches(token: str, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(mac, expected_mac(token, nonce))

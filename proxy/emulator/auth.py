"""Who may connect: the secrets peers must prove, and a bound on those yet to prove one.

A peer proves a secret with HELLO's MAC (``wire.handshake``). Which secret: the one
the per-peer tokens file gives its name, else the shared token. A name the file lists
must prove its own secret (the shared one does not do), so one board's secret can be
revoked without touching the others'. The file is re-read on SIGHUP (``reload``);
a file that does not parse then leaves the secrets as they were.

Until HELLO is accepted a connection costs the emulator a socket and a timer;
``Gate`` bounds how many of those one address holds.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from morphling.proxy.wire.errors import RemoteProtocolError
from morphling.proxy.wire.handshake import check_token
from morphling.proxy.wire.messages import Hello

from morphling.config import ConfigError, read_text


def read_tokens(path: str) -> dict[str, str]:
    """A tokens file: one ``NAME SECRET`` per line; blank lines and comments (from a word
    that starts with ``#``) are skipped. ConfigError naming the file, the line and what
    is wrong with it."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(read_text(path, "device_tokens").splitlines(), 1):
        words = line.split()
        comment = next((i for i, w in enumerate(words) if w.startswith("#")), len(words))
        words = words[:comment]  # (a '#' within a secret is the secret's)
        if not words:
            continue
        where = f"{path}:{number}"
        if len(words) != 2:
            raise ConfigError(f"{where}: expected NAME SECRET, got {len(words)} field(s)")
        name, secret = words
        if name in tokens:
            raise ConfigError(f"{where}: {name!r} is listed twice")
        tokens[name] = secret
    if not tokens:  # an empty file would quietly let only the shared token in
        raise ConfigError(f"device_tokens: {path} names no peer")
    return tokens


def needs_token(listen_ip: str) -> bool:
    """Whether an emulator listening on ``listen_ip`` can be reached from other machines."""
    return not ipaddress.ip_address(listen_ip).is_loopback


@dataclass
class Credentials:
    """The secrets HELLO is checked against; see the module docstring."""

    shared: str = ""
    per_peer: dict[str, str] = field(default_factory=dict)
    tokens_file: str = ""

    @classmethod
    def load(cls, shared: str, tokens_file: str) -> Credentials:
        return cls(shared, read_tokens(tokens_file) if tokens_file else {}, tokens_file)

    @property
    def required(self) -> bool:
        return bool(self.shared or self.per_peer)

    def check(self, hello: Hello, nonce: bytes) -> None:
        """Refuse (ERROR ``auth``) a HELLO without the proof its name asks for."""
        secret = self.per_peer.get(hello.name)
        if secret is None and self.per_peer and not self.shared:
            raise RemoteProtocolError(
                f"no token for {hello.name or 'an unnamed peer'!r} in this emulator's tokens "
                "file", "auth"
            )  # fmt: skip
        check_token(hello, self.shared if secret is None else secret, nonce)

    def reload(self) -> str:
        """Re-read the tokens file; what changed, for the log. ConfigError leaves them."""
        if not self.tokens_file:
            return "no tokens file to re-read"
        fresh = read_tokens(self.tokens_file)
        added = fresh.keys() - self.per_peer.keys()
        removed = self.per_peer.keys() - fresh.keys()
        changed = {n for n in fresh.keys() & self.per_peer.keys() if fresh[n] != self.per_peer[n]}
        self.per_peer = fresh
        return (
            f"{self.tokens_file}: {len(fresh)} peers ({len(added)} added, {len(removed)} "
            f"removed, {len(changed)} secrets changed)"
        )


class Gate:
    """How many connections each address holds that have not yet been welcomed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: Counter[str] = Counter()

    def admit(self, host: str) -> bool:
        """Count one more from ``host``, unless it already holds ``limit``."""
        if self._waiting[host] >= self.limit:
            return False
        self._waiting[host] += 1
        return True

    def leave(self, host: str) -> None:
        """One from ``host`` was welcomed or went away."""
        self._waiting[host] -= 1
        if self._waiting[host] <= 0:
            del self._waiting[host]

    def waiting(self) -> int:
        return self._waiting.total()

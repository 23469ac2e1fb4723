"""Running an asyncio service from a subcommand: uvloop, signals, exit codes."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import uvloop

log = logging.getLogger(__name__)

DEFAULT_PORT = 39000


def parse_server(text: str, what: str = "--server") -> tuple[str, int]:
    """``HOST:PORT``, ``HOST`` (port 39000), ``[v6]:PORT`` or a bare IPv6 address.

    Hostnames are kept as given and resolved when connecting. ``what`` names the
    setting in error messages.
    """
    port = str(DEFAULT_PORT)
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{what} {text!r}: expected [ADDRESS]:PORT")
        if rest:
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host = text
    if not host:
        raise ValueError(f"{what} {text!r}: no host")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r}: port {port!r} is not 1..65535")
    return host, int(port)


class Stop(asyncio.Event):
    """Set by SIGINT or SIGTERM; ``exit_code`` is the conventional one for that signal
    (128 + its number), for a service stopped before it was up."""

    signum = 0

    def received(self, signum: int) -> None:
        self.signum = signum
        self.set()

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def format_address(host: str, port: int) -> str:
    """``HOST:PORT`` as ``parse_server`` reads it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve(main: Callable[[Stop], Awaitable[int]]) -> int:
    """Run ``main(stop)`` on uvloop; SIGINT/SIGTERM set ``stop`` for a clean shutdown."""

    async def wrapper() -> int:
        stop = Stop()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.received, sig)
        return await main(stop)

    return uvloop.run(wrapper())

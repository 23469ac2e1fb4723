"""sd_notify(3) over ``$NOTIFY_SOCKET``: tell systemd a service is ready, alive, stopping.

A ``Type=notify`` unit waits for ``READY=1``; with ``WatchdogSec=`` systemd
passes ``$WATCHDOG_USEC`` and restarts the service unless ``WATCHDOG=1``
arrives at least that often. Outside systemd (no ``$NOTIFY_SOCKET``) every
call does nothing, so services call it unconditionally. The protocol is one
datagram of ``KEY=VALUE`` lines on a Unix socket (``@`` starts an abstract
name), small enough not to need libsystemd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class Notifier:
    """The service's line to systemd; inert when not started by it."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        address = environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        if self.address and not self.address.startswith(("/", "\0")):
            log.warning("NOTIFY_SOCKET=%r is not a Unix socket; not notifying systemd", address)
            self.address = ""
        if self.address:
            # Non-blocking: a receiver that stops reading (its queue holds a handful of
            # datagrams) must cost a dropped beat, not an event loop stalled in sendto.
            self._socket = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
            )
        self._dropping = False  # the last notification was dropped (warned once)
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())  # a watchdog meant for our parent is not ours
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines (``READY=1``, ``STATUS=...``); False if not delivered."""
        if self._socket is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            self._socket.sendto(message.encode(), self.address)
        except BlockingIOError:
            if not self._dropping:
                log.warning(
                    "systemd is not reading %r; dropping notifications until it does", self.address
                )
            self._dropping = True
            return False
        except OSError as exc:
            log.warning("cannot notify systemd at %r: %s", self.address, exc)
            return False
        self._dropping = False
        return True

    async def keep_alive(
        self, healthy: Callable[[], bool], status: Callable[[], str] = lambda: ""
    ) -> None:
        """Send ``WATCHDOG=1`` (and the current status) every half watchdog period while
        ``healthy()``; an unhealthy service stays silent and systemd restarts it."""
        if self.watchdog_s is None or self._socket is None:
            return
        while True:
            await asyncio.sleep(self.watchdog_s / 2)
            if healthy():
                self.notify(WATCHDOG=1, STATUS=status())
            else:
                log.error("unhealthy: withholding the systemd watchdog")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

"""Ending a command cleanly on SIGTERM or SIGINT (Ctrl-C).

Python's default SIGTERM kills the process on the spot: a run's ``run.json`` is never
written, its shared memory stays in /dev/shm, and the processes it started live on.
``Signals`` catches both while a command runs, so the command can stop what it started,
keep what it measured, and exit 128 + the signal (143, 130), as a shell expects.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What ``signal.signal`` takes and gives back: a function, SIG_DFL or SIG_IGN, or None (a
# handler not installed from Python)
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM or SIGINT: a training script unwinds as on
    Ctrl-C (its own ``except KeyboardInterrupt`` and ``finally`` run), then the run ends."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Signals:
    """SIGTERM and SIGINT handled while in use (``with``): the first one is kept
    (``received``, at ``since``), ``action(signum)`` runs on each, and while ``raising``
    each raises ``Interrupted``. A signal the process inherited as ignored (SIGINT in a
    shell's background job) stays ignored, as Python itself does."""

    def __init__(self, action: Callable[[int], None] | None = None) -> None:
        self.action = action
        self.raising = False
        self.received: int | None = None
        self.since: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> Signals:
        for sig in SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.since = signum, time.monotonic()
        if self.action is not None:
            self.action(signum)
        if self.raising:
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise ``Interrupted`` for a signal already received (one a script caught as
        KeyboardInterrupt and went on from still ends the run as interrupted)."""
        if self.received is not None:
            raise Interrupted(self.received)

    @property
    def exit_code(self) -> int | None:
        return None if self.received is None else 128 + self.received

"""Wall seconds the virtual clock has been held back: how far virtual time waits on real work.

Virtual time runs ahead of the wall clock until an event is due that a job still computing
on the host could precede (``Timeline.blocked``); from then until the job issues its next
request, virtual time waits on real work. Operators watch how much (``--metrics-port``:
``morphling_virtual_clock_held_seconds_total``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class HeldTime:
    """The seconds held so far; ``note`` after each change that may hold or free the clock."""

    def __init__(self, wall: Callable[[], float] = time.monotonic) -> None:
        self._wall = wall
        self._total = 0.0
        self._since: float | None = None  # when the clock was last held, while it is

    def note(self, held: bool) -> None:
        if held == (self._since is not None):
            return
        now = self._wall()
        if self._since is None:
            self._since = now
        else:
            self._total += now - self._since
            self._since = None

    @property
    def held(self) -> bool:
        return self._since is not None

    def seconds(self) -> float:
        """Wall seconds held, the current wait included."""
        return self._total + (self._wall() - self._since if self._since is not None else 0.0)

"""The discrete-event core of the virtual clock: an event queue and FIFO resources.

Small on purpose (the shape of ``simpy``'s core, without processes): events
are callbacks at a virtual time, run in order of ``(time, device, job, tile,
sequence)``, so ties break the same way on every run, whichever job's
message came first; a ``Fifo`` serves
requests one at a time in the order they arrive. Nothing here reads a wall
clock: the same calls give the same timeline however loaded the host is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Any, TypeVar

NO_DEVICE = -1  # the tie-break key of events that belong to no device (a job's)
Span = tuple[float, float]  # (start, end) in virtual seconds
A = TypeVar("A")
# An event: (time, device, job, tile, sequence) orders it, then what it does: action(arg).
# (The action and its argument apart, not a ``partial``: building one per event costs more
# than the push.)
_Event = tuple[float, int, int, int, int, Callable[[Any], None], Any]


class Clock:
    """A queue of timed callbacks and the virtual time of the one running."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[_Event] = []
        self._seq = itertools.count()

    def at(
        self,
        time: float,
        action: Callable[[A], None],
        arg: A,
        *,
        device: int = NO_DEVICE,
        job: int = 0,
        tile: int = 0,
    ) -> None:
        """Run ``action(arg)`` at virtual ``time`` (never before now: the past is settled)."""
        if time < self.now:
            time = self.now
        elif time != time:
            raise ValueError("event time is NaN")
        heappush(self._queue, (time, device, job, tile, next(self._seq), action, arg))

    def next_time(self) -> float:
        """When the next event is due (infinity when none is)."""
        return self._queue[0][0] if self._queue else math.inf

    def run(self, before: Callable[[], float] | None = None) -> int:
        """Run events in order while the next is due before ``before()`` (None: all of
        them); how many ran.

        ``before`` is asked again after every event, since an event may move the
        horizon (a job whose GEMM just ended may issue the next one from there).
        """
        count = 0
        queue = self._queue
        if before is None:
            while queue:
                time, _, _, _, _, action, arg = heappop(queue)
                self.now = time
                action(arg)
                count += 1
            return count
        while queue and queue[0][0] < before():
            time, _, _, _, _, action, arg = heappop(queue)
            self.now = time
            action(arg)
            count += 1
        return count


@dataclass(slots=True)
class Fifo:
    """A server that does one thing at a time, first come first served.

    ``serve`` must be called in arrival order, which the clock guarantees when
    each arrival is its own event.
    """

    free_at: float = 0.0
    busy_s: float = 0.0

    def serve(self, arrival: float, duration: float) -> Span:
        """(start, end) of a request arriving at ``arrival`` that takes ``duration``."""
        start = max(arrival, self.free_at)
        self.free_at = end = start + duration
        self.busy_s += duration
        return start, end

"""Who trained the shared weights, and restoring them from the checkpoint.

A job that maps the emulator's shared weights trains them in place, so the next
job starts from whatever the earlier ones left. GREETING says which jobs those
were (``weights.trained``: the latest, with their step counts, and how many in
all), and a job may have the working copy restored first (``OPEN.fresh_weights``).
Either way the weights' versions start again from 0, so the blocks devices keep
are no longer trusted (``distrust_kept``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, TypedDict

from morphling.proxy.shm.weights import SharedWeights
from morphling.proxy.vtime.timeline import Timeline

from .conv_partition import AnyTile

ANNOUNCED = 8  # GREETING.weights.trained: the latest jobs that trained the weights


class Trained(TypedDict):
    """One job in GREETING.weights.trained."""

    job: str
    steps: int
    running: bool


class Trainers:
    """The jobs that mapped the shared weights and marked steps since they were loaded or
    restored (they may have trained them), and a restore under way."""

    def __init__(self, timeline: Timeline[AnyTile]) -> None:
        self.timeline = timeline  # whose devices' kept weight blocks go stale
        self.latest: deque[Trained] = deque(maxlen=ANNOUNCED)
        self.count = 0  # all of them, not only the latest
        self.restoring: asyncio.Future[None] | None = None

    def add(self, job: str, steps: int) -> Trained:
        """Job ``job`` maps the weights and has marked ``steps``: its entry, which it
        keeps up to date."""
        trained = Trained(job=job, steps=steps, running=True)
        self.latest.append(trained)
        self.count += 1
        return trained

    def announce(self, weights: SharedWeights) -> dict[str, Any]:
        """GREETING.weights: the working copy, and which jobs trained it."""
        trained = [Trained(**t) for t in self.latest]
        return {**weights.announce(), "trained": trained, "trained_jobs": self.count}

    def distrust_kept(self) -> None:
        """The weights' versions start again: no weight block a device keeps is trusted."""
        for device in self.timeline.devices.values():
            device.memory.distrust()

    def restore(self, weights: SharedWeights) -> asyncio.Future[None]:
        """Copy the checkpoint over the working copy (in a thread); done even should the
        job that asked leave meanwhile."""
        restoring = self.restoring = asyncio.ensure_future(asyncio.to_thread(weights.restore))

        def done(future: asyncio.Future[None]) -> None:
            self.restoring = None
            if future.cancelled() or future.exception() is not None:
                return  # (the job that asked is told)
            self.latest.clear()
            self.count = 0
            self.distrust_kept()

        restoring.add_done_callback(done)
        return restoring

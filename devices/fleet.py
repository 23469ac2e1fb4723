"""Many virtual devices in one process, over real sockets.

Every device has its own connection, profile and registration, but they
share one kernel worker pool and one buffer pool, so host memory grows with
the number of devices only by a connection's small cost. Devices register
one after another, in the fleet's order, so the emulator gives them the
same ids on every run: the virtual timeline breaks ties by device id.
"""

from __future__ import annotations

import asyncio
import logging

from ..kernels import BufferPool, WorkerPool
from .agent import DeviceAgent, Tls
from .profiles import DeviceProfile

log = logging.getLogger(__name__)

CONNECT_CONCURRENCY = 64


class Fleet:
    """Virtual devices named ``<profile>-<index>``; ``run()`` until ``stop()``."""

    def __init__(
        self,
        profiles: list[DeviceProfile],
        workers: WorkerPool,
        pool: BufferPool,
        *,
        token: str = "",
        tls: Tls | None = None,
    ) -> None:
        self.agents = [
            DeviceAgent(p, workers, pool, name=f"{p.name}-{i}", token=token, virtual=True, tls=tls)
            for i, p in enumerate(profiles)
        ]

    async def run(self, host: str, port: int) -> int:
        """Run every device; the worst exit code among them."""
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        log.info("fleet: %d virtual devices connecting to %s:%d", len(self.agents), host, port)
        previous: asyncio.Event | None = None
        runs = []
        for agent in self.agents:
            runs.append(agent.run(host, port, gate=gate, after=previous))
            previous = agent.joined
        codes = await asyncio.gather(*runs)
        return max(codes, default=0)

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()

    @property
    def registered(self) -> int:
        return sum(a.device_id is not None for a in self.agents)

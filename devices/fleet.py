"""Many virtual devices in one process, over real sockets.

Every device has its own connection, profile and registration, but they
share one kernel worker pool and one buffer pool, so host memory grows with
the number of devices only by a connection's small cost (``capacity.py``
bounds how many a host may run). Devices register one after another, in the
fleet's order, so the emulator gives them the same ids on every run: the
virtual timeline breaks ties by device id.
"""

from __future__ import annotations

import asyncio
import logging

from morphling.kernels import BufferPool, WorkerPool

from .agent import DeviceAgent, Tls
from .models.profiles import DeviceProfile, device_names

log = logging.getLogger(__name__)

CONNECT_CONCURRENCY = 64
# Devices made, or started, between two turns of the event loop: a fleet of many takes
# a while to start, and a signal is acted on only when the loop runs.
BATCH = 1000


class Fleet:
    """Virtual devices named as ``device_names`` says: ``await Fleet.build(...)``, then
    ``run()`` until ``stop()``."""

    def __init__(self, agents: list[DeviceAgent]) -> None:
        self.agents = agents
        self._stopping = False

    @classmethod
    async def build(
        cls,
        profiles: list[DeviceProfile],
        workers: WorkerPool,
        pool: BufferPool,
        *,
        token: str = "",
        tls: Tls | None = None,
        names: list[str] | None = None,
    ) -> Fleet:
        """A device per profile, made ``BATCH`` at a time with the event loop run between;
        ``names``: theirs (by default, ``device_names``')."""
        log.info("fleet: making %d virtual devices", len(profiles))
        agents = []
        names = device_names(profiles) if names is None else names
        for i, (p, name) in enumerate(zip(profiles, names, strict=True)):
            agents.append(
                DeviceAgent(p, workers, pool, name=name, token=token, virtual=True, tls=tls)
            )
            if i % BATCH == BATCH - 1:
                await asyncio.sleep(0)
        return cls(agents)

    async def run(self, host: str, port: int) -> int:
        """Run every device (those not started when ``stop()`` comes never are); the worst
        exit code among them."""
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        log.info("fleet: %d virtual devices connecting to %s:%d", len(self.agents), host, port)
        previous: asyncio.Event | None = None
        runs = []
        for i, agent in enumerate(self.agents):
            if self._stopping:
                break
            runs.append(asyncio.ensure_future(agent.run(host, port, gate=gate, after=previous)))
            previous = agent.joined
            if i % BATCH == BATCH - 1:
                await asyncio.sleep(0)
        codes = await asyncio.gather(*runs)
        return max(codes, default=0)

    def stop(self) -> None:
        self._stopping = True
        for agent in self.agents:
            agent.stop()

    @property
    def registered(self) -> int:
        return sum(a.device_id is not None for a in self.agents)

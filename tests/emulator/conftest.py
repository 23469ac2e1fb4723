"""The ``fleet`` fixture of the emulator tests (``serving``)."""

from __future__ import annotations

from typing import Any

import pytest
from morphling.kernels import CpuBackend, WorkerPool
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from serving import (
    FAST,
    Fleet,
)


@pytest.fixture
async def fleet():
    """``await fleet(**config)``: a started emulator (``FAST`` plus overrides), torn down after."""
    fleets: list[Fleet] = []
    workers = WorkerPool([CpuBackend(1), CpuBackend(1)])

    async def make(**overrides: Any) -> Fleet:
        emu = Emulator(EmulatorConfig(**{**FAST, **overrides}))
        host, port = await emu.start()
        made = Fleet(emu, host, port, workers)
        fleets.append(made)
        return made

    try:
        yield make
    finally:
        for made in fleets:
            await made.close()
        workers.close()

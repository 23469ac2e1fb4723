"""An emulator and a fleet of virtual devices inside the calling process.

``morphling run --embedded`` and ``morphling.emulate(devices=...)`` need a
whole fleet without starting services. ``EmbeddedFleet`` runs the real
emulator and real virtual devices on one uvloop thread, talking over
loopback sockets as separate processes would (except that arrays are handed
over, ``local``, and TILE / TILE_RESULT without bytes skip the socket between
paired ends: see ``connection``); the job connects to it like to any emulator.
The training script keeps the main thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import resource
import threading
from collections.abc import Sequence

import uvloop
from morphling.devices.fleet import Fleet
from morphling.devices.models.profiles import device_names, expand_fleet
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig

log = logging.getLogger(__name__)

SOCKETS_PER_DEVICE = 2  # its end of the loopback connection, and the emulator's
SPARE_FILES = 256  # the job's connection, the listener, the arena, the script's own files


def open_files_for(devices: int) -> None:
    """Raise this process's open-file limit to what ``devices`` loopback connections need,
    up to the hard limit; a ValueError naming both numbers when even that is too few."""
    need = SOCKETS_PER_DEVICE * devices + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise ValueError(
            f"a fleet of {devices} embedded devices needs about {need} open files (two "
            f"sockets each), and this process may open {hard} (RLIMIT_NOFILE's hard limit): "
            "raise it (ulimit -Hn, LimitNOFILE=), or run fewer devices"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("open-file limit raised from %d to %d for %d devices", soft, need, devices)


class EmbeddedFleet:
    """``start()`` returns the emulator's (host, port) once every device is ready."""

    def __init__(
        self,
        devices: str,
        config: EmulatorConfig | None = None,
        *,
        workers: int | None = None,
        link: str | None = None,
        cooling: str | None = None,
        run_info: dict | None = None,
        max_devices: int = 0,
        replay: tuple[int, Sequence[str]] | None = None,
    ) -> None:
        """``replay``: (K, the device of each rank, in rank order): ranks K and up are
        replayed (``proxy.emulator.replay``), so their devices are timed without agents."""
        # ValueError for a bad SPEC, link or cooling, or more devices than the host can
        # hold (``max_devices``: see ``expand_fleet``), before any thread starts
        self.profiles = expand_fleet(
            devices, link_name=link, cooling=cooling, max_devices=max_devices
        )
        self.replay = replay
        named = dict(zip(device_names(self.profiles), self.profiles, strict=True))
        replayed = list(replay[1][replay[0] :]) if replay is not None else []
        self._timed_only = [(name, named.pop(name)) for name in replayed]
        self._agents = named  # the devices that run: all but replayed ranks'
        open_files_for(len(self._agents))
        self.run_info = run_info or {}  # extra keys for the run directory's run.json
        self.config = dataclasses.replace(
            config or EmulatorConfig(), listen_ip="127.0.0.1", listen_port=0
        )
        self.workers = workers or os.cpu_count() or 1  # single-threaded, as morphling fleet's
        self.emulator: Emulator | None = None
        self.address: tuple[str, int] | None = None
        self._ready = threading.Event()  # set when ready, or when starting failed
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._halt = threading.Event()  # stop() was called

    def start(self, timeout: float = 120.0) -> tuple[str, int]:
        """Start the thread and wait for every device. A bad checkpoint is its own
        ``CheckpointError`` (a ValueError: bad input); any other failure a RuntimeError
        (TimeoutError when the devices are not ready in time)."""
        self._thread = threading.Thread(
            target=uvloop.run, args=(self._serve(),), name="morphling-embedded", daemon=True
        )
        self._thread.start()
        try:
            ready = self._ready.wait(timeout)
        except BaseException:  # Ctrl-C: the emulator's shared memory must not outlive us
            self.stop()
            raise
        if self._error is not None or not ready:
            self.stop()
            if isinstance(self._error, ValueError):
                raise self._error
            if self._error is not None:
                raise RuntimeError(f"embedded fleet failed to start: {self._error}")
            raise TimeoutError(f"embedded fleet: devices not ready within {timeout} s")
        assert self.address is not None, "set before ready"
        return self.address

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._halt.is_set():  # stop() came before the loop ran
            self._stop.set()
        try:
            with WorkerPool([CpuBackend(1) for _ in range(self.workers)]) as workers:
                pool = BufferPool(pin=False)  # one pool (and memlock budget) for both sides
                names = device_names(self.profiles)
                emulator = self.emulator = Emulator(self.config, pool=pool, fleet=names)
                emulator.run_info.update(self.run_info)
                if self.replay is not None:
                    ranks = len(self.replay[1])
                    emulator.replay_ranks(ranks, self.replay[0], self._timed_only)
                host, port = await emulator.start()
                agents = self._agents
                fleet = await Fleet.build(list(agents.values()), workers, pool,
                                          token=self.config.token, names=list(agents))  # fmt: skip
                running = asyncio.ensure_future(fleet.run(host, port))
                try:
                    while len(emulator.registry.ready()) < len(self._agents):
                        if running.done() or self._stop.is_set():
                            raise RuntimeError("the fleet stopped before every device was ready")
                        await asyncio.sleep(0.01)
                    log.info(
                        "embedded emulator on %s:%d with %d ready devices",
                        host,
                        port,
                        len(self._agents),
                    )
                    self.address = (host, port)
                    self._ready.set()
                    await self._stop.wait()
                finally:
                    fleet.stop()
                    emulator.run_info.update(self.run_info)  # what the caller added since
                    await emulator.stop()
                    await running
        except BaseException as exc:
            self._error = exc  # start() reports a failure to start, in one line
            if self._ready.is_set():  # it ran: nobody else will say what ended it
                log.exception("the embedded fleet failed")
        finally:
            self._ready.set()

    def stop(self) -> None:
        """Stop the devices and the emulator and join the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._halt.set()  # before the loop exists, ``_serve`` sees this instead
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended (a failed start)
                self._loop.call_soon_threadsafe(self._stop.set)
        thread.join()

    def __enter__(self) -> tuple[str, int]:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

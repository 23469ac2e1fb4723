"""``morphling device`` (one physical board) and ``morphling fleet`` (many virtual ones)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from morphling import config as configuration
from morphling.config import option as _opt
from morphling.devices.agent import DeviceAgent, Tls
from morphling.devices.fleet import Fleet
from morphling.devices.models.capacity import MAX_DEVICES_HELP
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import DEFAULT_PROFILE, expand_fleet, load_profile
from morphling.devices.models.thermal import COOLING
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.runtime import Stop, parse_server, serve
from morphling.sdnotify import Notifier

log = logging.getLogger("morphling.devices")


_SERVER = "emulator address, HOST:PORT (hostnames are resolved)"


@dataclass(frozen=True)
class ConnectConfig:
    """How a device process reaches the emulator (directly, or through nginx)."""

    server: str = _opt("127.0.0.1:39000", _SERVER, aliases=("--proxy_host",))
    token: str = _opt("", "shared secret, if the emulator requires one", secret=True)
    tls: bool = _opt(False, "connect with TLS (to an nginx that terminates it)")
    tls_ca: str = _opt("", "CA certificates (PEM) to trust with --tls; empty: the system's")
    tls_server_name: str = _opt("", "name the certificate must carry; empty: the --server host")


@dataclass(frozen=True)
class DeviceConfig(ConnectConfig):
    profile: str = _opt(DEFAULT_PROFILE, "built-in profile name or a profile TOML file")
    # A board computes one tile at a time with all its cores, as its FLOPS probe measured.
    workers: int = _opt(1, "kernel workers (tiles computed at once)", min=1)
    threads: int = _opt(os.cpu_count() or 1, "BLAS threads per kernel worker", min=1)
    name: str = _opt("", "device name in the emulator's logs (default: the host name)")
    reconnect: bool = _opt(
        True,
        "reconnect with backoff when the connection is lost "
        "(off: an emulator it cannot reach ends it with exit 1)",
    )
    share_memory: bool = _opt(
        True,
        "read the emulator's shared weights and operands from memory "
        "when on its host (off: receive them as bytes, like a remote board)",
    )


@dataclass(frozen=True)
class FleetConfig(ConnectConfig):
    devices: str = _opt("4", "fleet SPEC: NAME:COUNT,... (e.g. rpi4:12,orin-nano:4) or a count")
    max_devices: int = _opt(0, MAX_DEVICES_HELP, min=0)
    # Virtual devices' tiles are independent: one single-threaded worker per core keeps
    # every core busy with no BLAS thread ever waiting at a barrier for a core the event
    # loop holds (a two-thread MKL call then takes 20x longer).
    workers: int = _opt(os.cpu_count() or 1, "kernel workers (tiles computed at once)", min=1)
    threads: int = _opt(1, "BLAS threads per kernel worker", min=1)
    link: str = _opt(
        "", "link preset for every device (empty: the profiles' own)", choices=("", *LINKS)
    )
    cooling: str = _opt(
        "", "cooling of every device (empty: the profiles' own)", choices=("", *COOLING)
    )


def add_device_parser(sub: argparse._SubParsersAction) -> None:
    configuration.add_command(
        sub,
        "device",
        DeviceConfig,
        run_device,
        help="run a device agent (on a Jetson, a Pi, ...)",
        description="Register with the emulator and compute tiles on the local kernels.",
    )


def add_fleet_parser(sub: argparse._SubParsersAction) -> None:
    configuration.add_command(
        sub,
        "fleet",
        FleetConfig,
        run_fleet,
        help="run many virtual devices in one process",
        description="Virtual devices over real sockets, sharing one worker pool.",
    )


Connecting = TypeVar("Connecting", bound=ConnectConfig)


def _load(
    schema: type[Connecting], args: argparse.Namespace, section: str
) -> tuple[Connecting, str, int, Tls | None]:
    cfg, sources = configuration.load(schema, args, section=section)
    host, port = parse_server(cfg.server)
    log.info("effective configuration:\n%s", configuration.describe(cfg, sources))
    return cfg, host, port, _tls(cfg, host)


def _tls(cfg: ConnectConfig, host: str) -> Tls | None:
    """The client TLS settings ``cfg`` asks for; ValueError for an unreadable CA file."""
    if not cfg.tls:
        if cfg.tls_ca or cfg.tls_server_name:
            raise ValueError("--tls-ca and --tls-server-name need --tls")
        return None
    try:
        context = ssl.create_default_context(cafile=cfg.tls_ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-ca {cfg.tls_ca}: {exc}") from None
    return Tls(context, cfg.tls_server_name or host)


def run_device(args: argparse.Namespace) -> int:
    try:
        cfg, host, port, tls = _load(DeviceConfig, args, "device")
        profile = load_profile(cfg.profile)
    except ValueError as exc:
        print(f"morphling device: {exc}", file=sys.stderr)
        return 2

    async def make(workers: WorkerPool) -> DeviceAgent:
        name = cfg.name or os.uname().nodename
        return DeviceAgent(
            profile,
            workers,
            BufferPool(),
            name=name,
            token=cfg.token,
            share_memory=cfg.share_memory,
            tls=tls,
        )

    return _run_until_stopped(
        cfg.workers, cfg.threads, make, lambda a: a.run(host, port, reconnect=cfg.reconnect)
    )


def run_fleet(args: argparse.Namespace) -> int:
    try:
        cfg, host, port, tls = _load(FleetConfig, args, "fleet")
        profiles = expand_fleet(
            cfg.devices,
            link_name=cfg.link or None,
            cooling=cfg.cooling or None,
            max_devices=cfg.max_devices,
        )
    except ValueError as exc:
        print(f"morphling fleet: {exc}", file=sys.stderr)
        return 2

    return _run_until_stopped(
        cfg.workers,
        cfg.threads,
        lambda workers: Fleet.build(profiles, workers, BufferPool(), token=cfg.token, tls=tls),
        lambda fleet: fleet.run(host, port),
    )


def _run_until_stopped(
    workers: int,
    threads: int,
    make: Callable[[WorkerPool], Awaitable[DeviceAgent | Fleet]],
    run: Callable[[Any], Awaitable[int]],
) -> int:
    """Run devices on one worker pool until they end or SIGINT/SIGTERM stops them.

    Under systemd the service is ready once its kernels are up and its devices made,
    when it starts connecting (an emulator that is down must not fail the unit's
    start), and its status line says how many devices are registered. A signal while
    the devices are being made ends it at once, with 128 + the signal's number.
    """

    async def main(stop: Stop) -> int:
        systemd = Notifier()
        with WorkerPool([CpuBackend(threads) for _ in range(workers)]) as pool:
            making = asyncio.ensure_future(make(pool))
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([making, stopper], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                making.cancel()
                log.info("%s while making the devices: stopping", signal.Signals(stop.signum).name)
                return stop.exit_code
            devices = making.result()
            task = asyncio.ensure_future(run(devices))

            def status() -> str:
                return f"{devices.registered} registered with the emulator"

            systemd.notify(READY=1, STATUS=status())
            watchdog = asyncio.ensure_future(systemd.keep_alive(lambda: True, status))
            await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
            systemd.notify(STOPPING=1)
            watchdog.cancel()
            devices.stop()
            stopper.cancel()
            return await task

    return serve(main)

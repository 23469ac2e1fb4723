"""``morphling emulator`` (alias ``morphling-emulator``): run the emulator until stopped."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from morphling import config as configuration
from morphling.proxy.emulator import metrics
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.runtime import format_address, serve
from morphling.sdnotify import Notifier

log = logging.getLogger("morphling.emulator")


def add_parser(sub: argparse._SubParsersAction) -> None:
    configuration.add_command(
        sub,
        "emulator",
        EmulatorConfig,
        run,
        help="run the emulator (devices and jobs connect to it)",
        description="Accept devices and jobs, tile GEMMs and schedule them on the devices.",
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg, sources = configuration.load(EmulatorConfig, args, section="emulator")
    except configuration.ConfigError as exc:
        print(f"morphling emulator: {exc}", file=sys.stderr)
        return 2
    log.info("effective configuration:\n%s", configuration.describe(cfg, sources))

    async def main(stop: asyncio.Event) -> int:
        try:
            emulator = Emulator(cfg)
        except configuration.ConfigError as exc:  # the per-peer tokens file
            print(f"morphling emulator: {exc}", file=sys.stderr)
            return 2
        systemd = Notifier()
        # Neither a missing checkpoint nor an address it cannot listen on is fixed by
        # starting again: exit 2, which the unit does not restart.
        try:
            host, port = await emulator.start()
        except ValueError as exc:  # CheckpointError: missing or corrupt
            print(
                f"morphling emulator: cannot share the checkpoint's weights: {exc}", file=sys.stderr
            )
            return 2
        except OSError as exc:  # asyncio's message repeats the address: the errno's alone
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            where = format_address(cfg.listen_ip, cfg.listen_port)
            print(f"morphling emulator: cannot listen on {where}: {reason}", file=sys.stderr)
            return 2
        if not emulator.credentials.required:  # (loopback: the config allowed it)
            log.warning("no token: any peer that reaches %s, through nginx too, may join as "
                        "a device or run jobs (--token-file, --device-tokens)",
                        format_address(host, port))  # fmt: skip
        scraped, metrics_at = None, format_address(cfg.metrics_ip, cfg.metrics_port)
        if cfg.metrics_port:
            try:
                scraped = metrics.serve(emulator, cfg.metrics_ip, cfg.metrics_port)
            except OSError as exc:
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                print(f"morphling emulator: cannot serve metrics on {metrics_at}: {reason}",
                      file=sys.stderr)  # fmt: skip
                await emulator.stop()
                return 2
            log.info("metrics on http://%s/metrics", metrics_at)
        # What is alive now (modules, torch, the shared weights) lives as long as the
        # process: frozen, it is no longer walked by every full collection of the run.
        gc.collect()
        gc.freeze()
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, emulator.reload_tokens)
        systemd.notify(READY=1, STATUS=f"listening on {format_address(host, port)}")
        watchdog = asyncio.ensure_future(systemd.keep_alive(emulator.healthy, emulator.status))
        await stop.wait()
        log.info("stopping: saying goodbye to %d peers", len(emulator.peers))
        systemd.notify(STOPPING=1, STATUS="saying goodbye to peers")
        watchdog.cancel()
        if scraped is not None:
            await asyncio.to_thread(scraped.shutdown)
            scraped.server_close()
        await emulator.stop()
        systemd.close()
        return 0

    return serve(main)

"""The emulator: accepts devices and jobs, tiles GEMMs, schedules and reassembles them.

The ``Emulator`` holds what its connections share (the registry of devices, the
virtual timeline, the scheduler, the buffer pool, the shared weights and operand
arena) and runs the server's life: start and stop, a housekeeping task for
heartbeats and timeouts, virtual time kept moving, ``run.json`` at the end. Each
connection is a ``PeerConnection`` (``peer``), which hands every message to its
role: ``handshake`` until HELLO, then ``devices`` and ``tiles`` for a device,
``jobs`` for a job. A misbehaving peer is answered with an ERROR and dropped; its
tiles go back to the queue, and everyone else carries on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
from morphling.devices.models.profiles import DeviceProfile
from morphling.kernels import BufferPool
from morphling.proxy.net.protocol import SMALL_PAYLOAD, pool_allocator
from morphling.proxy.shm import handover as local
from morphling.proxy.shm.arena import OperandArena
from morphling.proxy.shm.weights import SharedWeights
from morphling.proxy.vtime.eventlog import (
    COMPRESSED_EVENTS_FILE,
    RUN_FILE,
    RUN_FORMAT,
    EventLog,
    open_event_file,
)
from morphling.proxy.vtime.timeline import Bottleneck, Timeline
from morphling.proxy.vtime.vdevice import VirtualDevice
from morphling.proxy.wire.messages import Bye, Heartbeat
from morphling.proxy.wire.states import State

from morphling.config import ConfigError

from .auth import Credentials, Gate
from .conv_partition import AnyTile
from .host_products import HostProducts
from .jobs import Job
from .peer import PeerConnection
from .registry import Registry
from .replay import Replay
from .scheduler import Scheduler
from .settings import EmulatorConfig, availability_of
from .tiles import TileMessages
from .trainers import Trainers
from .verify import Verifier

log = logging.getLogger(__name__)

# A device lost while computing into a GEMM's output in the operand arena may still
# write there for a while: the output's memory is not reused for this long.
LATE_WRITE_GRACE_S = 60.0


class Emulator:
    """The server: listen, accept, schedule. ``start()`` then ``serve_forever()`` or ``stop()``."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        pool: BufferPool | None = None,
        fleet: Sequence[str] | None = None,
    ) -> None:
        """``fleet``: the names of the devices that will join, where known (an embedded
        fleet's), which a trace of numeric client ids binds to."""
        self.config = config
        self.started_at = time.monotonic()
        self.pool = pool or BufferPool(pin=False)  # it never hands buffers to a GPU
        self.registry = Registry()
        self.token = local.new_emulator()  # peers in this process hand over arrays under it
        self.tiles = TileMessages(self.token)
        self.scheduler = Scheduler(
            self.registry, self.tiles, window=config.window, inflight_bytes=config.inflight_bytes
        )
        self.verifier = Verifier(config.verify, config.quarantine_s)
        self.host_products = HostProducts(config.sample_tiles)
        # ConfigError: a tokens file that cannot be read or parsed
        self.credentials = Credentials.load(config.token, config.device_tokens)
        self.gate = Gate(config.max_unwelcomed)
        self._events: IO[bytes] | None = None
        if config.run_dir:
            Path(config.run_dir).mkdir(parents=True, exist_ok=True)
            if config.events != "off":
                self._events = open_event_file(Path(config.run_dir) / COMPRESSED_EVENTS_FILE)
        bottleneck = None
        if config.bottleneck_dl_bw:
            up = config.bottleneck_ul_bw or config.bottleneck_dl_bw
            bottleneck = Bottleneck(config.bottleneck_dl_bw, up)
        events = EventLog(
            self._events, level=config.events, detail_steps=config.events_detail_steps
        )
        self.timeline: Timeline[AnyTile] = Timeline(
            config.policy,
            log=events,
            bottleneck=bottleneck,
            algorithm=config.collective,
            residency=config.residency,
            dropped=self.scheduler.drop_panels,
            availability=availability_of(config, fleet),  # (read and checked: the config's)
            on_leave=config.on_leave,
        )
        self.run_info: dict[str, Any] = {}  # extra keys for run.json (the command, settings)
        self.allocate = pool_allocator(self.pool)
        self.peers: set[PeerConnection] = set()
        self.waiting: set[Job] = set()  # jobs whose tiles wait for a device
        # ranks whose job ended without CLOSE, and why: a launcher stops a rank process
        # that outlives its job (stuck where it can neither heartbeat nor notice)
        self.ranks_lost: dict[int, str] = {}
        self.trainers = Trainers(self.timeline)  # of the shared weights
        self.replay: Replay | None = None  # ranks computed and replayed (``replay_ranks``)
        self.weights: SharedWeights | None = None  # the checkpoint's, once started
        self.arena: OperandArena | None = None  # jobs' operands, once started
        self._late_writes: deque[tuple[float, list[np.ndarray]]] = deque()  # (until, outputs)
        self.probing = asyncio.Semaphore(config.probe_concurrency)
        # FLOPS results checked at once: each check is a reference GEMM (up to 4096³, on
        # every core) and its operands, so more at once only share the cores and add memory.
        # Those of arriving devices apart from those peers ask for (``morphling-bench``):
        # a peer asking for large ones cannot hold up devices joining.
        self.checking = asyncio.Semaphore(1)
        # a device in this process passed its FLOPS challenge: the kernels they share are
        # checked (``devices._vouched_for``)
        self.local_kernels_verified = False
        self.checking_asked = asyncio.Semaphore(1)
        self._client_ids = 0
        self._server: asyncio.Server | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._sync: asyncio.Task[None] | None = None

    def replay_ranks(
        self, world: int, computed: int, devices: Sequence[tuple[str, DeviceProfile]]
    ) -> None:
        """``--numerics sample:K``: of ``world`` ranks, ranks 0..``computed``-1 will join;
        every other rank's work is replayed (``replay``) on its device of ``devices`` (the
        name and profile of each replayed rank's, in rank order), which the timeline times
        and no agent serves."""
        ids = {}
        for rank, (name, profile) in enumerate(devices, computed):
            ids[rank] = self.registry.reserve()
            self.timeline.add_device(ids[rank], name, profile, placed=False)
        self.replay = Replay(world, computed, ids)
        log.info("%d ranks computed, %d replayed on their own devices", computed, len(ids))

    def next_client_id(self) -> int:
        self._client_ids += 1
        return self._client_ids

    def shared_memory(self, nbytes: int) -> memoryview:
        """Memory devices on this host reach too: the operand arena for ``nbytes`` worth it
        that fit there, else the buffer pool."""
        if self.arena is not None and nbytes >= SMALL_PAYLOAD:
            view = self.arena.allocate(nbytes)
            if view is not None:
                return view
        return self.allocate(nbytes)

    def hold_late_writes(self, outputs: list[np.ndarray]) -> None:
        """A device lost while writing into ``outputs`` (in the operand arena) may still
        write: their memory is not reused for ``LATE_WRITE_GRACE_S``."""
        self._late_writes.append((time.monotonic() + LATE_WRITE_GRACE_S, outputs))

    # -- serving ---------------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Bind and start accepting; the (host, port) actually bound.

        With ``ckpt_path``, the checkpoint is verified and its weights shared first
        (``CheckpointError`` when it is missing or corrupt). When it cannot listen
        (OSError), the shared files it made are removed before the error goes on.
        """
        loop = asyncio.get_running_loop()
        try:
            if self.config.ckpt_path and self.weights is None:
                self.weights = await asyncio.to_thread(SharedWeights.create, self.config.ckpt_path)
            if self.config.arena_bytes and self.arena is None:
                self.arena = OperandArena.create(self.config.arena_bytes)
            self.tiles.arena = self.arena
            self._server = await loop.create_server(
                lambda: PeerConnection(self),
                self.config.listen_ip,
                self.config.listen_port,
                reuse_address=True,
                backlog=1024,
            )
        except BaseException:
            self._remove_shared()
            raise
        self._housekeeping = loop.create_task(self._keep_house())
        self._sync = loop.create_task(self._keep_time())
        host, port = self._server.sockets[0].getsockname()[:2]
        cfg = self.config
        how = f"policy {cfg.policy}, block {cfg.block_size}, window {cfg.window}"
        log.info("emulator listening on %s:%d (%s)", host, port, how)
        return host, port

    def healthy(self) -> bool:
        """Accepting connections, with housekeeping (heartbeats) and virtual time running."""
        tasks = (self._housekeeping, self._sync)
        return (
            self._server is not None
            and self._server.is_serving()
            and all(t is not None and not t.done() for t in tasks)
        )

    def reload_tokens(self) -> None:
        """SIGHUP: re-read the per-peer tokens file; one that does not parse is logged and
        the secrets stay as they were."""
        try:
            log.info("tokens re-read: %s", self.credentials.reload())
        except ConfigError as exc:
            log.error("tokens not re-read, the old ones stay: %s", exc)

    def status(self) -> str:
        """One line for ``systemctl status``."""
        clients = sum(1 for p in self.peers if p.job is not None)
        return f"{len(self.registry.ready())} devices ready, {clients} jobs and probes"

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def stop(self) -> None:
        """Stop accepting, say goodbye to every peer, close."""
        if self._server is not None:
            self._server.close()
        for task in (self._housekeeping, self._sync):
            if task is not None:
                task.cancel()
        for peer in list(self.peers):
            if peer.open:
                peer.send(Bye(reason="emulator shutting down"))
                peer.close()
        if self._server is not None:
            await self._server.wait_closed()
        self._remove_shared()
        self.verifier.close()
        local.end_emulator(self.token)
        if self._events is not None:
            self._events.close()  # the end of the compressed stream: then run.json
            self._events = None
        self.write_run()
        await asyncio.sleep(0)

    def _remove_shared(self) -> None:
        """Remove the shared files (checkpoint weights, operand arena) this emulator made."""
        for shared in (self.weights, self.arena):
            if shared is not None:
                shared.close()

    def write_run(self) -> None:
        """Write ``run.json`` beside the event log: the fleet, the jobs, the settings."""
        if not self.config.run_dir:
            return
        cfg, timeline = self.config, self.timeline
        shared = timeline.bottleneck
        bottleneck = None if shared is None else {"dl_bw": shared.dl_bw, "ul_bw": shared.ul_bw}
        devices = sorted(timeline.devices.values(), key=lambda d: d.id)
        info: dict[str, Any] = {
            "format": RUN_FORMAT,
            "version": 1,
            "policy": cfg.policy,
            "block": cfg.block_size,
            "auto_block": cfg.auto_block,
            "bottleneck": bottleneck,
            "collective": timeline.algorithm,
            "fleet": [_run_entry(device) for device in devices],
            "jobs": timeline.job_names(),
            "event_log": cfg.events,
        }
        if cfg.events != "off":
            log = timeline.log
            info.update(event_file=COMPRESSED_EVENTS_FILE, events=log.count, digest=log.digest())
        if cfg.events == "auto":
            info["event_detail_steps"] = cfg.events_detail_steps
        # each job of a standalone emulator chose its own (``morphling run`` says which)
        info["coordinator_time"] = "per job"
        info["verification"] = self.verifier.summary()
        if self.replay is not None:
            info["replay"] = self.replay.summary()
            if timeline.on_leave == "drop":
                dropped = timeline.ranks_dropped.items()
                info["replay"]["dropped"] = [{"rank": r, "at": t} for r, t in dropped]
        if self.host_products.sample_tiles:
            info["host_products"] = self.host_products.summary()
        info.update(self.run_info)
        path = Path(cfg.run_dir) / RUN_FILE
        path.write_text(json.dumps(info, indent=1) + "\n")

    async def _keep_time(self) -> None:
        """Release idle jobs that have held the virtual clock back for ``sync_timeout_s``."""
        timeline = self.timeline
        seen = -1
        while True:
            await asyncio.sleep(self.config.sync_timeout_s)
            held = timeline.blocked() and timeline.log.records == seen
            seen = timeline.log.records
            if held:
                timeline.release_idle()

    def watch_waits(self, now: float) -> None:
        """Each job's wait for a ready device (``Job.watch_wait``)."""
        registry = self.registry
        ready, ready_conv = len(registry.ready()), len(registry.ready(conv=True))
        for peer in list(self.peers):
            if peer.job is not None and peer.open:
                peer.job.watch_wait(now, ready, ready_conv, len(registry.devices))

    async def _keep_house(self) -> None:
        """Heartbeats and timeouts (a HELLO that does not come, a peer silent, or one that
        reads nothing), jobs' waits for devices, late writes forgotten."""
        cfg = self.config
        silence = cfg.heartbeat_timeout_s
        period = min(cfg.heartbeat_s, cfg.hello_timeout_s, silence, cfg.device_wait_notice_s) / 2
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.watch_waits(now)
            while self._late_writes and self._late_writes[0][0] <= now:
                self._late_writes.popleft()
            for peer in list(self.peers):
                if not peer.open:
                    peer.abort_if_lingering(now, silence)
                    continue
                if peer.wire.our_state is State.HELLO_WAIT:
                    if now - peer.connected_at > cfg.hello_timeout_s:
                        peer.fail("timeout", f"no HELLO within {cfg.hello_timeout_s} s")
                elif not peer.reading and peer.unread_for(now) > silence:
                    peer.fail("timeout", f"read nothing sent to it for {silence} s", abort=True)
                elif peer.reading and now - peer.last_received > silence:
                    peer.fail("timeout", f"nothing received for {silence} s")
                elif now - peer.last_sent >= cfg.heartbeat_s:
                    peer.send(Heartbeat())


def _run_entry(device: VirtualDevice) -> dict[str, Any]:
    """A device in ``run.json``'s fleet: its profile's figures (not its GEMM, convolution
    and thermal models, which are long), its names, and whether it heats up."""
    profile = device.profile
    figures = {
        k: v for k, v in profile.to_wire().items() if k not in ("compute", "conv", "thermal")
    }
    return {
        "id": device.id,
        **figures,
        "name": device.name,
        "profile": profile.name,
        "thermal": bool(profile.thermal),
    }

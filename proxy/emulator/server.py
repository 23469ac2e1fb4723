"""The emulator: accepts devices and jobs, tiles GEMMs, schedules and reassembles them.

One ``PeerConnection`` per TCP connection speaks the protocol for whichever
role the peer announces in its HELLO; the ``Emulator`` holds what they share
(registry, scheduler, buffer pool) and a housekeeping task for heartbeats
and timeouts. A misbehaving peer is answered with an ERROR and dropped; its
tiles go back to the queue, and everyone else carries on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
from morphling.devices.models.profiles import DeviceProfile
from morphling.kernels import BufferPool
from morphling.proxy.checkpoint.format import CheckpointError
from morphling.proxy.net.flow import undelivered_bytes
from morphling.proxy.net.protocol import SMALL_PAYLOAD, FrameConnection, pool_allocator
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
from morphling.proxy.vtime.memory import Admission
from morphling.proxy.vtime.timeline import Bottleneck, StepTimes, Timeline
from morphling.proxy.wire import challenge, handshake
from morphling.proxy.wire.codec import ProtocolError
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.messages import (
    Bye,
    Close,
    Gemm,
    Greeting,
    Heartbeat,
    Hello,
    Message,
    MsgType,
    Notice,
    Open,
    ProbeFlopsRequest,
    ProbeVerdict,
    Result,
    Slab,
    Step,
    Tile,
    TileResult,
    Welcome,
)
from morphling.proxy.wire.states import Party, State

from . import probes
from .partition import GemmError, GemmTask, TileTask, make_task
from .registry import DeviceRecord, Registry
from .scheduler import Scheduler
from .settings import EmulatorConfig

log = logging.getLogger(__name__)

# A device lost while computing into a GEMM's output in the operand arena may still
# write there for a while: the output's memory is not reused for this long.
LATE_WRITE_GRACE_S = 60.0
TRAINERS_ANNOUNCED = 8  # GREETING.weights.trained: the latest jobs that trained the weights
_REPLIES = (MsgType.PROBE_ACK, MsgType.PROBE_PULLED, MsgType.PROBE_FLOPS_RESULT)


class PeerConnection(FrameConnection):
    """The emulator's side of one connection."""

    def __init__(self, emulator: Emulator) -> None:
        cfg = emulator.config
        # Until HELLO is accepted no frame may carry a payload, so a peer that has not
        # authenticated cannot make the emulator allocate anything sizeable.
        wire = Connection(Party.EMULATOR, max_payload=0, allocate=self._payload_memory)
        super().__init__(wire, high_water=cfg.high_water_bytes)
        self.emulator = emulator
        self.nonce = os.urandom(16)
        self.connected_at = time.monotonic()
        self.device: DeviceRecord | None = None
        self.job_id = 0  # a job's or probe peer's id (HELLO), the job's in the timeline
        self.name = ""  # a job's (OPEN)
        self.block = cfg.block_size
        self.device_wait_s = 0.0  # a job's limit on waiting for a device (OPEN; 0: none)
        self.waiting_since: float | None = None  # its tiles wait, no device being ready
        self._noticed = 0.0  # when it was last told so
        self.maps_weights = False  # a job that maps the shared weights (and may train them)
        self.steps = 0  # a job's step marks
        self.trained: dict | None = None  # its entry in GREETING.weights.trained, once it is
        self.gemms: dict[int, GemmTask] = {}
        self.tiles_in_flight = 0  # of the GEMMs in ``gemms`` (see ``_regulate``)
        self.bytes_in_flight = 0  # the memory they hold: operands received, outputs
        self._unread: tuple[int, float] | None = None  # (undelivered, since): ``unread_for``
        self.maps_arena = False  # a job that maps the operand arena may ask for a slab
        self.local = False  # a peer in this process, which may hand over arrays (``local``)
        self.slab: np.ndarray | None = None  # the job's bytes of the arena (SLAB)
        self.slab_gemm = 0  # the GEMM in flight that uses the slab (one at a time)
        self.totals = dict.fromkeys(
            ("gemms", "tiles", "model_ns", "bytes_down", "bytes_up", "oom"), 0
        )
        self._wire_at_step = (0, 0)  # totals' bytes at the last STEP
        self._waiters: dict[int, asyncio.Future[Message]] = {}
        self._challenged = False  # a FLOPS challenge this peer asked for is running

    # -- lifecycle -------------------------------------------------------------------

    def connected(self) -> None:
        self.connected_at = time.monotonic()
        self.emulator.peers.add(self)
        weights = self.emulator.weights
        arena = self.emulator.arena
        self.send(Greeting(version=1, nonce=self.nonce, auth=bool(self.emulator.config.token),
                           weights=self.emulator.announce_weights() if weights else {},
                           arena=arena.announce() if arena else {},
                           process=self.emulator.token))  # fmt: skip

    def disconnected(self, exc: Exception | None) -> None:
        self.emulator.peers.discard(self)
        self.emulator.waiting.discard(self)
        if self.trained is not None:
            self.trained["running"] = False
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"{self.peername} disconnected"))
        scheduler = self.emulator.scheduler
        if self.job_id:
            self.emulator.timeline.close_job(self.job_id)
            self.slab = None
        if self.device is not None:
            device, self.device = self.device, None
            self.emulator.registry.remove(device.id)
            self.emulator.timeline.remove_device(device.id)
            in_flight, queued = len(device.outstanding), len(device.queue)
            self.emulator.hold_late_writes(device)
            for tile_id in device.outstanding:  # arrays offered to it it never took (``local``)
                local.take_tile((self.emulator.token, device.id, tile_id))
            requeued = scheduler.requeue(device)
            if requeued:
                log.warning(
                    "device %d (%s) lost with %d tiles in flight and %d queued; re-queued "
                    "tiles %s", device.id, device.name, in_flight, queued,
                    [t.id for t in requeued],
                )  # fmt: skip
            else:
                log.info("device %d (%s) disconnected", device.id, device.name)
            scheduler.dispatch()
        for task in self.gemms.values():
            scheduler.cancel(task)
        self.gemms.clear()

    def _payload_memory(self, nbytes: int) -> memoryview:
        """Where a received payload goes: a job's operands where devices on this host can
        read them, the rest into the buffer pool."""
        emulator = self.emulator
        return (emulator.shared_memory if self.job_id else emulator.allocate)(nbytes)

    def writability_changed(self) -> None:
        if self.writable:
            self._unread, self.appended = None, 0  # it read enough to empty the buffer
        if self.device is None:
            self._regulate()
        elif self.writable:
            self.emulator.scheduler.dispatch()

    async def ask(self, msg: Message, timeout: float) -> Message:
        """Send a probe and wait for the reply with the same probe id."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters[msg.probe] = future
        try:
            self.send(msg)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiters.pop(msg.probe, None)

    # -- messages ----------------------------------------------------------------------

    def message_received(self, msg: Message) -> None:
        t = msg.TYPE
        if t == MsgType.HELLO:
            self._hello(msg)
        elif t == MsgType.TILE_RESULT:
            self.emulator.tile_result(self.device, msg)
        elif t == MsgType.GEMM:
            self._gemm(msg)
        elif self.answer_probe(msg):
            pass
        elif t == MsgType.PROBE_ECHO or t in _REPLIES:
            waiter = self._waiters.get(msg.probe)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif t == MsgType.PROBE_FLOPS_REQUEST:
            self._challenge_requested(msg)
        elif t == MsgType.OPEN:
            self._open(msg)
        elif t == MsgType.SLAB:
            self._slab(msg)
        elif t == MsgType.STEP:
            self.steps += 1
            if self.trained is not None:
                self.trained["steps"] = self.steps
            elif self.maps_weights:
                self.emulator.trained_by(self)
            self.emulator.timeline.mark_step(
                self.job_id,
                msg.step,
                host_s=msg.host_ns / 1e9,
                local_gemms=msg.local_gemms,
                done=self._step_done,
            )
        elif t == MsgType.CLOSE:
            self.send(Close(**self.totals))
            self.close()
        elif t == MsgType.ERROR:
            log.warning("%s reported an error: %s: %s", self.peername, msg.code, msg.reason)
            self.close()
        elif t == MsgType.BYE:
            log.info("%s said goodbye: %s", self.peername, msg.reason or "(no reason)")
            self.close()
        # HEARTBEAT: receiving it was the point.

    def _hello(self, msg: Hello) -> None:
        cfg = self.emulator.config
        handshake.check_token(msg, cfg.token, self.nonce)
        self.local = msg.caps.get("process") == self.emulator.token
        if msg.role == "device":
            try:
                declared = DeviceProfile.from_wire(msg.profile)
            except ValueError as exc:
                raise ProtocolError(f"HELLO.profile: {exc}", "bad_hello") from None
            weights, arena = self.emulator.weights, self.emulator.arena
            self.device = self.emulator.registry.add(
                msg.name or self.peername, declared, self,
                virtual=bool(msg.caps.get("virtual", False)),
                colocated=weights is not None and msg.caps.get("weights") == str(weights.path),
                arena=arena is not None and msg.caps.get("arena") == str(arena.path),
                local=self.local,
            )  # fmt: skip
            peer_id = self.device.id
            if self.local:  # TILE and TILE_RESULT without bytes may skip the socket
                self.pair_in_process()
        elif msg.role in ("job", "probe"):
            peer_id = self.job_id = self.emulator.next_client_id()
            arena, weights = self.emulator.arena, self.emulator.weights
            self.maps_arena = arena is not None and msg.caps.get("arena") == str(arena.path)
            if msg.role == "job" and weights is not None and \
                    msg.caps.get("weights") == str(weights.path):  # fmt: skip
                self.emulator.weights_mapped(self)
        else:
            raise ProtocolError(f"HELLO.role {msg.role!r} is not device, job or probe", "bad_hello")
        self.wire.max_payload = cfg.max_payload_bytes
        self.send(Welcome(peer_id=peer_id, heartbeat_s=cfg.heartbeat_s))
        log.info("%s joined as %s %d (%s)", self.peername, msg.role, peer_id, msg.name or "-")
        if self.device is not None:
            if cfg.probe:
                self.spawn(self._probe_device(msg.uuid))
            else:
                self._device_ready(None)

    async def _probe_device(self, uuid: str) -> None:
        device = self.device
        seed = zlib.crc32(f"{uuid}:{device.id}".encode())
        emulator = self.emulator
        try:
            async with emulator.probing:
                measured = await probes.probe(
                    self, emulator.config, seed, device.declared, emulator.checking
                )
        except ConnectionError:
            return  # it left while being probed, and disconnected() has forgotten it
        log.info("device %d (%s) PROFILE_DELTA %s", device.id, device.name,
                 probes.describe(device.declared, measured))  # fmt: skip
        self.send(ProbeVerdict(probe=0, ok=measured.flops_verified, reason=measured.reason,
                               flops=measured.flops))  # fmt: skip
        if not measured.flops_verified:
            self.fail("flops_failed", f"FLOPS challenge failed: {measured.reason}")
            return
        self._device_ready(measured)

    def _device_ready(self, measured: probes.Measurement | None) -> None:
        device = self.device
        if device is None:
            return
        cfg = self.emulator.config
        device.model, why = probes.choose_profile(
            device.declared, measured, cfg.profile_source, device.virtual
        )
        device.ready = True
        log.info("device %d (%s) ready; scheduling with the %s profile",
                 device.id, device.name, why)  # fmt: skip
        self.emulator.timeline.add_device(device.id, device.name, device.model)
        if self.emulator.waiting:  # told before their tiles' results come
            self.emulator.watch_waits(time.monotonic())
        self.emulator.scheduler.dispatch()

    def _challenge_requested(self, msg: ProbeFlopsRequest) -> None:
        """One at a time per peer: each holds the peer's result (up to 64 MiB) until it is
        checked, and a peer asking faster than the checks run would pile them up."""
        challenge.check_dim(msg.dim, "PROBE_FLOPS_REQUEST.dim")
        if self._challenged:
            raise ProtocolError("PROBE_FLOPS_REQUEST while the one asked for earlier is still "
                                "running: wait for its PROBE_VERDICT", "overload")  # fmt: skip
        self._challenged = True
        self.spawn(self._challenge(msg.dim))

    async def _challenge(self, dim: int) -> None:
        emulator, cfg = self.emulator, self.emulator.config
        seed = int.from_bytes(os.urandom(4), "little")
        try:
            flops, problem = await probes.flops_challenge(
                self, seed, dim, cfg.probe_tolerance, cfg.probe_timeout_s, emulator.checking_asked
            )
        except ConnectionError:
            return  # the peer that asked has gone
        finally:
            self._challenged = False
        self.send(ProbeVerdict(probe=0, ok=not problem, reason=problem, flops=flops))

    def _open(self, msg: Open) -> None:
        if msg.block < 0:
            raise ProtocolError(f"OPEN.block={msg.block} is negative", "bad_open")
        if not msg.device_wait_s >= 0:  # NaN too
            raise ProtocolError(f"OPEN.device_wait_s={msg.device_wait_s} is not >= 0", "bad_open")
        self.block = msg.block or self.emulator.config.block_size
        self.device_wait_s = msg.device_wait_s
        self.name = msg.name or f"job-{self.job_id}"
        emulator = self.emulator
        if msg.fresh_weights:
            self._restore_weights()
        elif self.maps_weights and emulator.restoring is not None:
            raise ProtocolError("the shared weights are being restored from the checkpoint "
                                "for another job: try again when it has started",
                                "weights_busy")  # fmt: skip
        elif self.maps_weights and emulator.trainers:
            log.info("job %d (%s) continues from the shared weights as trained by %s",
                     self.job_id, self.name, ", ".join(f"{t['job']!r} ({t['steps']} steps)"
                                                       for t in emulator.trainers))  # fmt: skip
        emulator.timeline.open_job(self.job_id, self.name)

    def _restore_weights(self) -> None:
        """OPEN.fresh_weights: copy the checkpoint over the working copy before the job
        starts; refused while another job maps it, since that would change its weights
        under it. The job may send nothing else until OPEN answers."""
        emulator = self.emulator
        if emulator.weights is None:
            raise ProtocolError("OPEN.fresh_weights: this emulator shares no weights "
                                "(--ckpt-path)", "bad_open")  # fmt: skip
        users = [p for p in emulator.peers if p is not self and p.maps_weights and p.open]
        if users or emulator.restoring is not None:
            who = (f"job {users[0].job_id} ({users[0].name or 'opening'}) maps them" if users
                   else "another job is restoring them")  # fmt: skip
            raise ProtocolError(f"OPEN.fresh_weights: the shared weights are in use ({who}); "
                                "restoring them now would change them under it",
                                "weights_busy")  # fmt: skip
        emulator.weights_mapped(self)
        self.spawn(self._restored(emulator.restore_weights()))

    async def _restored(self, restoring: asyncio.Future[None]) -> None:
        try:
            await asyncio.shield(restoring)
        except (CheckpointError, OSError) as exc:
            self.fail("bad_open", f"OPEN.fresh_weights: cannot restore the weights: {exc}")
            return
        except Exception:
            log.exception("job %d: restoring the shared weights failed", self.job_id)
            self.fail("internal", "restoring the shared weights failed (see the emulator's log)")
            return
        log.info("job %d (%s) starts from the checkpoint's weights, restored",
                 self.job_id, self.name)  # fmt: skip
        self.send(Open(name=self.name, block=self.block, device_wait_s=self.device_wait_s,
                       fresh_weights=True))  # fmt: skip

    def watch_wait(self, now: float, ready: int, connected: int) -> None:
        """Tell the job when its tiles start waiting for want of a ready device, every
        ``device_wait_notice_s`` while they do, and when one is back; fail it once they
        have waited its ``device_wait_s``. Without this a job whose fleet vanished waited
        for ever, in silence."""
        count = sum(task.remaining for task in self.gemms.values())
        tiles = f"{count} tile{'s' if count != 1 else ''}"
        limit, since = self.device_wait_s, self.waiting_since
        if since is None:
            if ready or not count:
                return
            self.waiting_since = self._noticed = now
            self.emulator.waiting.add(self)
            end = f"fails after {limit:g} s" if limit else "waits for ever"
            self._notice("no_devices", f"no device is ready ({connected} connected): the job "
                         f"waits with {tiles} queued; it {end} (device_wait_s)", connected,
                         count, 0.0, logging.WARNING)  # fmt: skip
            return
        waited = now - since
        if ready or not count:
            self.waiting_since = None
            self.emulator.waiting.discard(self)
            if ready:
                self._notice("devices", f"devices are back: {ready} ready after {waited:.3g} s; "
                             f"sending the job's {tiles} queued", connected, count,
                             waited)  # fmt: skip
        elif limit and waited >= limit:
            self.fail("no_devices", f"no device was ready for {limit:g} s (device_wait_s); the "
                      f"job had {tiles} queued")  # fmt: skip
        elif now - self._noticed >= self.emulator.config.device_wait_notice_s:
            self._noticed = now
            text = f"waiting for devices: {connected} connected, {tiles} queued, waited " \
                f"{waited:.3g} s" + (f" of {limit:g}" if limit else "")  # fmt: skip
            self._notice("no_devices", text, connected, count, waited)

    def _notice(self, code: str, text: str, devices: int, tiles: int, waited_s: float,
                level: int = logging.INFO) -> None:  # fmt: skip
        """Say ``text`` to the job (NOTICE ``code``) and in the log."""
        log.log(level, "job %d (%s): %s", self.job_id, self.name, text)
        self.send(Notice(code=code, text=text, devices=devices, tiles=tiles, waited_s=waited_s,
                         limit_s=self.device_wait_s))  # fmt: skip

    def _slab(self, msg: Slab) -> None:
        """Give the job the slab of the arena it asks for, when there is room (at most half
        the arena, and one slab at a time: no job can take it all); answer with the slab it
        has now."""
        arena = self.emulator.arena
        if not self.maps_arena:
            raise ProtocolError("SLAB from a job that does not map the operand arena (HELLO "
                                "caps.arena)", "bad_slab")  # fmt: skip
        if msg.nbytes < 0:
            raise ProtocolError(f"SLAB.nbytes={msg.nbytes} is negative", "bad_slab")
        if self.slab_gemm:  # it holds on to the slab it uses: a new one would be a second
            raise ProtocolError(f"SLAB while GEMM {self.slab_gemm}, which uses the slab, is "
                                "in flight", "bad_slab")  # fmt: skip
        # The old slab goes first, so the new one may reuse its pages; the job has none
        # until this is answered.
        self.slab = None
        view = arena.allocate(msg.nbytes) if 0 < msg.nbytes <= arena.nbytes // 2 else None
        if view is not None:
            self.slab = np.frombuffer(view, np.uint8)
        elif msg.nbytes:
            log.info("job %d: no room for a slab of %d bytes in the operand arena",
                     self.job_id, msg.nbytes)  # fmt: skip
        slab = self.slab
        self.send(Slab(nbytes=0, offset=-1) if slab is None else
                  Slab(nbytes=len(slab), offset=arena.offset_of(slab)))  # fmt: skip

    def retire_slab(self, task: GemmTask) -> None:
        """A device lost while writing ``task``'s C may still write: if that is in the job's
        slab, the job gets no more use of it (RESULT.slab_retired says so)."""
        if self.slab is not None and np.shares_memory(self.slab, task.out):
            self.slab = None  # held by ``task`` until it is done, and then for late writes
            task.slab_retired = True

    def _gemm(self, msg: Gemm) -> None:
        if msg.gemm in self.gemms:
            raise ProtocolError(f"GEMM id {msg.gemm} is already in flight", "bad_gemm")
        in_slab = msg.slab_a != -1 or msg.slab_b != -1 or msg.slab_c != -1
        if in_slab and self.slab_gemm:
            raise ProtocolError(f"GEMM {msg.gemm} uses the slab while GEMM {self.slab_gemm}, "
                                "which uses it too, is in flight", "bad_gemm")  # fmt: skip
        try:
            task = self._task(msg)
        except GemmError as exc:
            raise ProtocolError(f"GEMM {msg.gemm}: {exc}", "bad_gemm") from None
        task.owner = self
        if not self.maps_weights and (msg.ref_a or msg.ref_b):
            self.emulator.weights_mapped(self)
        count, limit = task.tile_count(self.block), self.emulator.config.max_job_tiles
        if count > limit:
            raise ProtocolError(f"GEMM {msg.gemm}: {count} tiles of {self.block}² exceed "
                                f"max_job_tiles={limit}; use a larger block",
                                "bad_gemm")  # fmt: skip
        tiles = task.tiles(self.block)
        self.tiles_in_flight += len(tiles)
        self.bytes_in_flight += _held_bytes(task)
        self.totals["gemms"] += 1
        self.totals["tiles"] += len(tiles)
        if tiles:
            self.gemms[task.id] = task
            if in_slab:
                self.slab_gemm = task.id
        self.emulator.timeline.submit(  # an empty one too: its host_ns is coordinator time
            self.job_id, task, tiles, after=msg.after, host_s=msg.host_ns / 1e9,
            place=self.emulator.scheduler.submit, done=_settled(task),
        )  # fmt: skip
        if not tiles:
            self.finish(task)  # (which regulates)
            return
        self._regulate()

    def _task(self, msg: Gemm) -> GemmTask:
        """The GEMM's task: operands from its segments, the weights or the job's slab, or
        the arrays the job handed over (``local``)."""
        if not msg.local:
            out = None if msg.slab_c != -1 else self.emulator.output(msg)
            return make_task(msg, out, self.emulator.weights, self.slab)
        if msg.slab_a != -1 or msg.slab_b != -1 or msg.slab_c != -1:
            raise GemmError("local operands cannot be in the slab too")
        key = (self.emulator.token, self.job_id, msg.gemm)
        handed = local.take_gemm(key) if self.local else None
        if handed is None:
            raise GemmError("local: no operands were handed over in this emulator's process")
        shape = (msg.batch, msg.m, msg.n)
        out = handed.out
        if out.shape != shape or out.dtype != np.dtype(msg.dtype) or not out.flags.c_contiguous:
            raise GemmError(f"local: the output is {out.dtype} {out.shape}, expected a "
                            f"C-contiguous {msg.dtype} {shape}")  # fmt: skip
        a = msg.segments[0] if msg.ref_a else handed.a  # a weight still goes by its ref
        b = msg.segments[1] if msg.ref_b else handed.b
        task = make_task(dataclasses.replace(msg, segments=(a, b)), out, self.emulator.weights)
        task.writers = local.Writers()
        return task

    def _step_done(self, times: StepTimes) -> None:
        """The step is settled in virtual time: answer the job's STEP."""
        wire = (self.totals["bytes_down"], self.totals["bytes_up"])
        (down0, up0), self._wire_at_step = self._wire_at_step, wire
        if self.open:
            self.send(Step(
                step=times.step, emulated_ns=round(times.emulated_s * 1e9),
                coord_ns=round(times.coord_s * 1e9), gemms=times.gemms, tiles=times.tiles,
                link_down=times.link_down, link_up=times.link_up, bytes_down=wire[0] - down0,
                bytes_up=wire[1] - up0, oom=times.oom,
            ))  # fmt: skip

    def finish(self, task: GemmTask) -> None:
        """All tiles are in: send C to the job, once no kernel writes into it any more (a
        lost device's, into a job's own array, see ``local``)."""
        if task.writers is not None and task.writers.count:
            task.writers.then(lambda: self.finish(task))
            return
        self.gemms.pop(task.id, None)
        self.tiles_in_flight -= len(task.done)  # all its tiles, now in
        self.bytes_in_flight -= _held_bytes(task)
        if task.id == self.slab_gemm:
            self.slab_gemm = 0
        totals = self.totals
        totals["model_ns"] += task.virtual_ns
        totals["bytes_down"] += task.bytes_down
        totals["bytes_up"] += task.bytes_up
        totals["oom"] += task.oom
        if self.open:
            self.send(Result(
                gemm=task.id, tiles=len(task.done), devices=sorted(task.devices),
                requeued=task.requeued, model_ns=task.virtual_ns, bytes_down=task.bytes_down,
                bytes_up=task.bytes_up, oom=task.oom, slab_retired=task.slab_retired,
                segments=(task.out.reshape(-1)[:0] if task.in_place else task.out,),
            ))  # fmt: skip
        self._regulate()

    def _regulate(self) -> None:
        """Read a job's (or probe peer's) requests only while it reads the replies and its
        GEMMs in flight stay below ``max_job_tiles`` and ``max_job_bytes``: otherwise one
        that sends without reading would grow the emulator's memory without bound. Never a
        device's: its TILE_RESULTs are what a pause would wait for."""
        if not self.job_id:
            return
        cfg = self.emulator.config
        if (
            self.writable
            and self.tiles_in_flight < cfg.max_job_tiles
            and self.bytes_in_flight < cfg.max_job_bytes
        ):
            self.resume_reading()
        else:
            self.pause_reading()

    def unread_for(self, now: float) -> float:
        """Seconds the peer has read nothing we sent while the send buffer is past its
        high-water mark (0 otherwise). Called now and then, it compares what the peer has
        still to take with what it was at the last call plus what was queued since: less
        means the peer read, which tells one that stopped reading from one that reads
        slower than RESULTs come."""
        if self.writable or self.transport is None:
            return 0.0
        size = undelivered_bytes(self.transport)
        appended, self.appended = self.appended, 0
        if self._unread is None or size < self._unread[0] + appended:
            self._unread = (size, now)
        else:
            self._unread = (size, self._unread[1])
        return now - self._unread[1]


def _held_bytes(task: GemmTask) -> int:
    """The emulator's memory ``task`` holds: the operand bytes it arrived with, and its C
    unless C is the job's own (in place)."""
    if task.request.local:
        return 0  # its operands and C are the job's own arrays, handed over
    received = sum(memoryview(s).nbytes for s in task.request.segments)
    return received + (0 if task.in_place else task.out.nbytes)


def _settled(task: GemmTask) -> Callable[[float, float], None]:
    """What the timeline calls when ``task`` ends in virtual time."""

    def done(issue: float, end: float) -> None:
        task.virtual_ns = round((end - issue) * 1e9)

    return done


class Emulator:
    """The server: listen, accept, schedule. ``start()`` then ``serve_forever()`` or ``stop()``."""

    def __init__(self, config: EmulatorConfig, *, pool: BufferPool | None = None) -> None:
        self.config = config
        self.pool = pool or BufferPool(pin=False)  # it never hands buffers to a GPU
        self.registry = Registry()
        self.scheduler = Scheduler(
            self.registry, self._tile_message, self._send_tile, window=config.window,
            inflight_bytes=config.inflight_bytes,
        )  # fmt: skip
        self._events: IO[bytes] | None = None
        if config.run_dir:
            Path(config.run_dir).mkdir(parents=True, exist_ok=True)
            if config.events != "off":
                self._events = open_event_file(Path(config.run_dir) / COMPRESSED_EVENTS_FILE)
        bottleneck = None
        if config.bottleneck_dl_bw:
            up = config.bottleneck_ul_bw or config.bottleneck_dl_bw
            bottleneck = Bottleneck(config.bottleneck_dl_bw, up)
        log = EventLog(self._events, level=config.events, detail_steps=config.events_detail_steps)
        self.timeline: Timeline[TileTask] = Timeline(config.policy, log=log, bottleneck=bottleneck)
        self.run_info: dict = {}  # extra keys for run.json (the command, the job's settings)
        self.allocate = pool_allocator(self.pool)
        self.peers: set[PeerConnection] = set()
        self.waiting: set[PeerConnection] = set()  # jobs whose tiles wait for a device
        # The latest jobs that mapped the shared weights and marked steps since they were
        # loaded or restored (they may have trained them), how many in all, and a restore
        # under way.
        self.trainers: deque[dict] = deque(maxlen=TRAINERS_ANNOUNCED)
        self.trainer_count = 0
        self.restoring: asyncio.Future[None] | None = None
        self.weights: SharedWeights | None = None  # the checkpoint's, once started
        self.arena: OperandArena | None = None  # jobs' operands, once started
        self.token = local.new_emulator()  # peers in this process hand over arrays under it
        self._late_writes: deque[tuple[float, list[np.ndarray]]] = deque()  # (until, outputs)
        self.probing = asyncio.Semaphore(config.probe_concurrency)
        # FLOPS results checked at once: each check is a reference GEMM (up to 4096³, on
        # every core) and its operands, so more at once only share the cores and add memory.
        # Those of arriving devices apart from those peers ask for (``morphling-bench``):
        # a peer asking for large ones cannot hold up devices joining.
        self.checking = asyncio.Semaphore(1)
        self.checking_asked = asyncio.Semaphore(1)
        self._client_ids = 0
        self._server: asyncio.Server | None = None
        self._housekeeping: asyncio.Task | None = None
        self._sync: asyncio.Task | None = None

    def announce_weights(self) -> dict:
        """GREETING.weights: the working copy, and which jobs trained it (``trained``)."""
        return {**self.weights.announce(), "trained": [dict(t) for t in self.trainers],
                "trained_jobs": self.trainer_count}  # fmt: skip

    def weights_mapped(self, job: PeerConnection) -> None:
        """``job`` maps the shared weights. Its weights' versions start again from 0, so
        a block a device kept for another job may carry the same version and other
        bytes: no kept block is trusted any more."""
        job.maps_weights = True
        self.trained_by(job)
        self._distrust_kept_weights()

    def trained_by(self, job: PeerConnection) -> None:
        """Count ``job`` among those that trained the weights, once it maps them and has
        marked a step."""
        if job.maps_weights and job.steps and job.trained is None:
            job.trained = {"job": job.name, "steps": job.steps, "running": True}
            self.trainers.append(job.trained)
            self.trainer_count += 1

    def restore_weights(self) -> asyncio.Future[None]:
        """Copy the checkpoint over the working copy (in a thread); done even should the
        job that asked leave meanwhile."""
        restoring = self.restoring = asyncio.ensure_future(asyncio.to_thread(self.weights.restore))

        def done(future: asyncio.Future[None]) -> None:
            self.restoring = None
            if future.cancelled() or future.exception() is not None:
                return  # (the job that asked is told)
            self.trainers.clear()
            self.trainer_count = 0
            self._distrust_kept_weights()

        restoring.add_done_callback(done)
        return restoring

    def _distrust_kept_weights(self) -> None:
        for device in self.timeline.devices.values():
            device.memory.distrust()

    def next_client_id(self) -> int:
        self._client_ids += 1
        return self._client_ids

    def output(self, msg: Gemm) -> np.ndarray | None:
        """Memory for a GEMM's output (in the operand arena, where devices on this host
        write their tiles, when it fits), or None for an invalid request (refused later)."""
        if msg.dtype not in ("float32", "float64") or min(msg.m, msg.n, msg.batch) < 0:
            return None
        shape = (msg.batch, msg.m, msg.n)
        nbytes = msg.batch * msg.m * msg.n * np.dtype(msg.dtype).itemsize
        if nbytes > self.config.max_payload_bytes:
            raise ProtocolError(
                f"GEMM {msg.gemm}: output of {nbytes} bytes exceeds max_payload_bytes", "bad_gemm"
            )
        return np.frombuffer(self.shared_memory(nbytes), dtype=msg.dtype).reshape(shape)

    def shared_memory(self, nbytes: int) -> memoryview:
        """Memory devices on this host reach too: the operand arena for ``nbytes`` worth it
        that fit there, else the buffer pool."""
        if self.arena is not None and nbytes >= SMALL_PAYLOAD:
            view = self.arena.allocate(nbytes)
            if view is not None:
                return view
        return self.allocate(nbytes)

    def _out_offset(self, device: DeviceRecord, tile: TileTask) -> int | None:
        """Where in the operand arena ``device`` writes ``tile``'s result, or None when it
        sends it back as bytes."""
        if not device.arena:
            return None
        out = self.arena.offset_of(tile.gemm.out)
        if out is None:
            return None
        return out + tile.out_start * tile.gemm.out.itemsize

    def hold_late_writes(self, device: DeviceRecord) -> None:
        """``device`` is lost: keep the arena outputs it may still be writing alive a while,
        and out of their jobs' use where they are in a job's slab."""
        tasks = {id(t.gemm): t.gemm for t in device.outstanding.values()
                 if self._out_offset(device, t) is not None}  # fmt: skip
        for task in tasks.values():
            if task.request.slab_c != -1:
                task.owner.retire_slab(task)
        if tasks:
            until = time.monotonic() + LATE_WRITE_GRACE_S
            self._late_writes.append((until, [task.out for task in tasks.values()]))

    # -- tiles ---------------------------------------------------------------------------

    def _tile_message(
        self, device: DeviceRecord, tile: TileTask, admission: Admission | None
    ) -> Tile:
        """A tile's TILE for ``device``: blocks of the operand arena or of weights the device
        can map, or weight blocks it already holds, go by reference, everything else as
        bytes. ``admission`` is the device's emulated memory's say (from the timeline);
        None for a tile moved off a lost device: all bytes but what it maps."""
        task = tile.gemm
        drop = admission.evicted if admission is not None and not device.colocated else []
        if task.writers is not None and device.local:
            return self._local_tile(device, tile, drop)
        g = task.request
        rows, cols = tile.shape
        arena = self.arena if device.arena else None
        sent: list[tuple[np.ndarray, int, list[int], int]] = []
        for block in tile.operands():
            at = arena.offset_of(block.span) if arena is not None else None
            if at is not None:  # it reads the span from its mapping of the arena
                sent.append((block.span[:0], block.ld, [], at))
            elif block.offset is None:
                sent.append((*task.packed(block), [], -1))
            elif device.colocated:  # it reads the span from its mapping of the weights
                sent.append((block.span[:0], block.ld, block.ref, -1))
            elif admission is None:
                sent.append((*task.packed(block), [], -1))
            elif block.key in admission.held:  # it holds the bytes sent before
                sent.append((block.span[:0], block.sent_ld, block.ref, -1))
            else:  # bytes, to be kept under the ref if they fit
                sent.append((*task.packed(block), block.ref if admission.fits else [], -1))
        (a, lda, ref_a, at_a), (b, ldb, ref_b, at_b) = sent
        at_c = self._out_offset(device, tile)
        return Tile(
            tile=tile.id, dtype=g.dtype, ta=g.ta, tb=g.tb, m=rows, n=cols, k=g.k, lda=lda,
            ldb=ldb, ref_a=ref_a, ref_b=ref_b, drop=drop, arena_a=at_a, arena_b=at_b,
            arena_c=-1 if at_c is None else at_c, ldc=0 if at_c is None else task.out.shape[2],
            segments=(a, b),
        )  # fmt: skip

    def _local_tile(self, device: DeviceRecord, tile: TileTask, drop: list) -> Tile:
        """A TILE whose blocks and C go to ``device``, in this process, as arrays."""
        task, g = tile.gemm, tile.gemm.request
        rows, cols = tile.shape
        (a, b), n = tile.operands(), task.out.shape[2]
        start = tile.out_start
        c = task.out.reshape(-1)[start : start + (rows - 1) * n + cols if rows and cols else start]
        local.offer_tile((self.token, device.id, tile.id),
                         local.TileOperands(a.span, b.span, c, task.writers))  # fmt: skip
        return Tile(tile=tile.id, dtype=g.dtype, ta=g.ta, tb=g.tb, m=rows, n=cols, k=g.k,
                    lda=a.ld, ldb=b.ld, ldc=n, drop=drop, local=True,
                    segments=(a.span[:0], b.span[:0]))  # fmt: skip

    def _send_tile(self, device: DeviceRecord, tile: TileTask, message: Tile) -> None:
        tile.gemm.bytes_down += tile.wire_bytes
        tile.in_place = message.in_place
        device.conn.send(message)

    def tile_result(self, device: DeviceRecord | None, msg: TileResult) -> None:
        if device is None:
            raise ProtocolError("TILE_RESULT before registration", "out_of_order")
        tile = self.scheduler.finished(device, msg.tile)
        if tile is None:
            log.debug("device %d: result for tile %d not expected (late or duplicate); "
                      "ignored", device.id, msg.tile)  # fmt: skip
        elif not tile.gemm.cancelled:
            rows, cols = tile.shape
            item = tile.gemm.out.itemsize
            seg = msg.segments[0]
            in_place = tile.in_place  # as its TILE asked of this device
            expected = 0 if in_place else rows * cols * item
            if msg.in_place != in_place or seg.nbytes != expected:
                self.scheduler.retry(tile)
                asked = "in place" if in_place else f"{rows}×{cols}×{item} bytes"
                raise ProtocolError(
                    f"TILE_RESULT {msg.tile}: {seg.nbytes} bytes, in_place={msg.in_place}; "
                    f"expected {asked} (the tile goes to another device)", "bad_result",
                )  # fmt: skip
            tile.gemm.bytes_up += seg.nbytes
            values = None if in_place else np.frombuffer(seg, dtype=tile.gemm.out.dtype)
            if tile.gemm.put(tile, values) and tile.gemm.remaining == 0:
                tile.gemm.owner.finish(tile.gemm)
        self.scheduler.dispatch()

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
                self.weights = await asyncio.to_thread(SharedWeights.create,
                                                       self.config.ckpt_path)  # fmt: skip
            if self.config.arena_bytes and self.arena is None:
                self.arena = OperandArena.create(self.config.arena_bytes)
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
        log.info("emulator listening on %s:%d (policy %s, block %d, window %d)",
                 host, port, self.config.policy, self.config.block_size,
                 self.config.window)  # fmt: skip
        return host, port

    def healthy(self) -> bool:
        """Accepting connections, with housekeeping (heartbeats) and virtual time running."""
        tasks = (self._housekeeping, self._sync)
        return (self._server is not None and self._server.is_serving()
                and all(t is not None and not t.done() for t in tasks))  # fmt: skip

    def status(self) -> str:
        """One line for ``systemctl status``."""
        clients = sum(1 for p in self.peers if p.job_id)
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
        cfg = self.config
        bottleneck = self.timeline.bottleneck
        fleet = [
            {"id": d.id, **{k: v for k, v in d.profile.to_wire().items()
                            if k not in ("compute", "thermal")},
             "name": d.name, "profile": d.profile.name, "thermal": bool(d.profile.thermal)}
            for d in sorted(self.timeline.devices.values(), key=lambda d: d.id)
        ]  # fmt: skip
        info = {
            "format": RUN_FORMAT, "version": 1, "policy": cfg.policy, "block": cfg.block_size,
            "bottleneck": None if bottleneck is None
            else {"dl_bw": bottleneck.dl_bw, "ul_bw": bottleneck.ul_bw},
            "fleet": fleet, "jobs": self.timeline.job_names(), "event_log": cfg.events,
            **({} if cfg.events == "off" else {
                "event_file": COMPRESSED_EVENTS_FILE, "events": self.timeline.log.count,
                "digest": self.timeline.log.digest()}),
            **({"event_detail_steps": cfg.events_detail_steps} if cfg.events == "auto" else {}),
            # each job of a standalone emulator chose its own (``morphling run`` says which)
            "coordinator_time": "per job",
            **self.run_info,
        }  # fmt: skip
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
        """Each job's wait for a ready device (``PeerConnection.watch_wait``)."""
        ready, connected = len(self.registry.ready()), len(self.registry.devices)
        for peer in list(self.peers):
            if peer.job_id and peer.open:
                peer.watch_wait(now, ready, connected)

    async def _keep_house(self) -> None:
        cfg = self.config
        period = min(cfg.heartbeat_s, cfg.hello_timeout_s, cfg.heartbeat_timeout_s,
                     cfg.device_wait_notice_s) / 2  # fmt: skip
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.watch_waits(now)
            while self._late_writes and self._late_writes[0][0] <= now:
                self._late_writes.popleft()
            for peer in list(self.peers):
                if not peer.open:
                    peer.abort_if_lingering(now, cfg.heartbeat_timeout_s)
                    continue
                if peer.wire.our_state is State.HELLO_WAIT:
                    if now - peer.connected_at > cfg.hello_timeout_s:
                        peer.fail("timeout", f"no HELLO within {cfg.hello_timeout_s} s")
                elif not peer.reading and peer.unread_for(now) > cfg.heartbeat_timeout_s:
                    peer.fail("timeout", f"read nothing sent to it for {cfg.heartbeat_timeout_s} s",
                              abort=True)  # fmt: skip
                elif peer.reading and now - peer.last_received > cfg.heartbeat_timeout_s:
                    peer.fail("timeout", f"nothing received for {cfg.heartbeat_timeout_s} s")
                elif now - peer.last_sent >= cfg.heartbeat_s:
                    peer.send(Heartbeat())

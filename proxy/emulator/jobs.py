"""A job as the emulator serves it: OPEN, its GEMMs and convolutions from intake to RESULT,
STEP, CLOSE.

A GEMM arrives (``Job.gemm``), is checked and becomes a task over operands found
where the job placed them (``partition.make_task``), and is cut into tiles (a CONV,
``Job.conv``, likewise: ``conv_partition.make_conv_task``); the
virtual timeline places them on devices (``Timeline.submit``), the scheduler sends
them, and each TILE_RESULT goes into the output (``tiles.take_result``) until the
last one has the task's owner, this job, answer with RESULT (``Job.finish``).

The emulator reads a job's requests only while it reads the replies and its GEMMs
in flight stay within ``max_job_tiles`` and ``max_job_bytes`` (``regulate``). A job
whose tiles wait for want of a ready device is told so (NOTICE) and, past its
``device_wait_s``, failed. The job may have a slab of the operand arena (SLAB)
and may map the shared weights, which it may ask to have restored first.
A probe peer (``morphling-bench``) is served as a job that never opens: its id, its
flow control, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, TypedDict

import numpy as np
from morphling.devices.models.profiles import fleet_order
from morphling.proxy.checkpoint.errors import CheckpointError
from morphling.proxy.shm import handover as local
from morphling.proxy.vtime.collectives import PAIR
from morphling.proxy.vtime.eventlog import GEMM_OP
from morphling.proxy.vtime.memory import Admission
from morphling.proxy.vtime.timeline import Operation, StepTimes
from morphling.proxy.wire.errors import RemoteProtocolError
from morphling.proxy.wire.messages import (
    COLLECTIVE_OPS,
    Close,
    Collective,
    Conv,
    Gemm,
    Notice,
    Open,
    Result,
    Slab,
    Step,
    Wait,
)

from .conv_partition import AnyTask, AnyTile, make_conv_task
from .host_products import Blocks
from .partition import auto_edge, make_task
from .task import GemmError, Task
from .tiles import settle
from .trainers import Trained

if TYPE_CHECKING:
    from .peer import PeerConnection
    from .server import Emulator

log = logging.getLogger(__name__)

RANK_BLOCK = 1 << 16  # a rank's tile edge, unless its OPEN says: its products whole
REPLAY_CHUNK = 256  # timeline calls for a rank's copies between two turns of the event loop


class Totals(TypedDict):
    """A job's totals so far, as CLOSE gives them."""

    gemms: int
    tiles: int
    model_ns: int
    bytes_down: int
    bytes_up: int
    oom: int


class Job:
    """The emulator's side of one job (or probe peer); see the module docstring."""

    def __init__(self, conn: PeerConnection, job_id: int, *, maps_arena: bool, local: bool) -> None:
        emulator = conn.emulator
        self.conn = conn
        self.emulator: Emulator = emulator
        self.id = job_id  # its peer id (WELCOME), and its id in the timeline
        self.name = ""  # OPEN's
        self.block = emulator.config.block_size
        self.auto_block = False  # (OPEN decides)
        self.device_wait_s = 0.0  # its limit on waiting for a device (OPEN; 0: none)
        self.waiting_since: float | None = None  # its tiles wait, no device being ready
        self._noticed = 0.0  # when it was last told so
        self.maps_weights = False  # it maps the shared weights (and may train them)
        self.steps = 0  # step marks
        self.trained: Trained | None = None  # its entry among the trainers, once it is one
        self.gemms: dict[int, AnyTask] = {}  # GEMMs and convolutions in flight, by id
        self.tiles_in_flight = 0  # of the GEMMs in ``gemms`` (see ``regulate``)
        self.bytes_in_flight = 0  # the memory they hold: operands received, outputs
        self.maps_arena = maps_arena  # it may ask for a slab
        self.local = local  # it runs in this process and may hand over arrays (``local``)
        self.slab: np.ndarray | None = None  # its bytes of the arena (SLAB)
        self.slab_gemm = 0  # the GEMM in flight that uses the slab (one at a time)
        self.totals = Totals(gemms=0, tiles=0, model_ns=0, bytes_down=0, bytes_up=0, oom=0)
        self.rank: int | None = None  # OPEN's, for a rank of a distributed script
        self.copies: list[_Timed] = []  # a computed rank's replayed ones (``replay``)
        # what its copies have yet to do (``_replay``): each a call per copy, in order
        self._backlog: deque[Callable[[_Timed], None]] = deque()
        self._replayed = 0  # the copies the first of them has been called for
        self._work = 0  # a digest of a computed rank's shapes in its step under way
        self._wire_at_step = (0, 0)  # totals' bytes at the last STEP
        self.closed = False  # it said CLOSE

    # -- OPEN, and the shared weights -------------------------------------------------

    def open(self, msg: Open) -> None:
        if msg.block < 0:
            raise RemoteProtocolError(f"OPEN.block={msg.block} is negative", "bad_open")
        if not msg.device_wait_s >= 0:  # NaN too
            raise RemoteProtocolError(
                f"OPEN.device_wait_s={msg.device_wait_s} is not >= 0", "bad_open"
            )
        emulator = self.emulator
        rank = self._rank(msg)
        device = self._pinned_device(msg.device) if msg.device else None
        if device is None and rank is not None:
            device = self._rank_device(rank)
        # a rank computes each product whole on its own board: one tile, as one op
        self.block = msg.block or (RANK_BLOCK if rank is not None else emulator.config.block_size)
        # greedy picks each GEMM's edge (a rank's products stay whole)
        self.auto_block = emulator.config.auto_block and rank is None
        self.device_wait_s = msg.device_wait_s
        self.name = msg.name or f"job-{self.id}"
        trainers = emulator.trainers
        if msg.fresh_weights:
            self._restore_weights()
        elif self.maps_weights and trainers.restoring is not None:
            raise RemoteProtocolError(
                "the shared weights are being restored from the checkpoint for another job: "
                "try again when it has started",
                "weights_busy",
            )
        elif self.maps_weights and trainers.latest:
            who = ", ".join(f"{t['job']!r} ({t['steps']} steps)" for t in trainers.latest)
            log.info(
                "job %d (%s) continues from the shared weights as trained by %s",
                self.id,
                self.name,
                who,
            )
        emulator.timeline.open_job(self.id, self.name, device=device, rank=rank)
        self.rank = rank
        if rank is not None:
            emulator.ranks_lost.pop(rank, None)
            self._open_copies(rank, msg.world, device)

    def _open_copies(self, rank: int, world: int, device: int | None) -> None:
        """Under replay, the replayed ranks that copy this computed one join with it."""
        replay = self.emulator.replay
        if replay is None:
            return
        if world != replay.world or rank >= replay.computed:
            raise RemoteProtocolError(
                f"OPEN.rank={rank} of world={world}: this emulator computes ranks 0 to "
                f"{replay.computed - 1} of {replay.world} and replays the others",
                "bad_open",
            )
        timeline = self.emulator.timeline
        own = timeline.devices[device].profile.name if device is not None else ""
        for copy, mirrors in replay.classes(rank, timeline.timed_by):
            job_id, device_id = self.emulator.next_client_id(), replay.devices[copy]
            timeline.open_job(job_id, f"rank {copy}, replaying {self.name}", device=device_id,
                              rank=copy, mirrors=mirrors, droppable=True)  # fmt: skip
            profile = timeline.devices[device_id].profile.name
            self.copies.append(_Timed(job_id, copy, "" if profile == own else profile))

    def _timed(self) -> _Timed:
        return _Timed(self.id, -1 if self.rank is None else self.rank, "")

    def _each(self, call: Callable[[_Timed], None]) -> None:
        """``call`` for this job's timeline job now, and for its copies (``_each_copy``)."""
        call(self._timed())
        self._each_copy(call)

    def _each_copy(self, call: Callable[[_Timed], None]) -> None:
        """``call`` for each of a rank's copies in turn (``_replay``)."""
        if self.copies:
            self._backlog.append(call)
            if len(self._backlog) == 1:
                self.conn.spawn(self._replay())

    async def _replay(self) -> None:
        """Make the backlog's calls for every copy, ``REPLAY_CHUNK`` at a time with the
        event loop run between: one request of a rank that thousands replay is thousands of
        timeline calls, and the loop must go on serving (heartbeats, other peers). Each
        copy's calls stay in order; across jobs the timeline needs none."""
        while self._backlog:
            try:
                self._replay_calls(REPLAY_CHUNK)
            except Exception:  # a bug of ours: the job cannot be timed, and says so
                log.exception("job %d (%s): replaying its work failed", self.id, self.name)
                self.conn.fail("internal", "replaying this rank's work on its copies failed")
                return
            await asyncio.sleep(0)

    def _replay_calls(self, limit: int) -> None:
        """Up to ``limit`` of the backlog's calls, in order (copy by copy, call by call)."""
        backlog, copies = self._backlog, self.copies
        while backlog and limit > 0:
            start = self._replayed
            end = min(start + limit, len(copies))
            for copy in copies[start:end]:
                backlog[0](copy)
            limit -= end - start
            if end == len(copies):
                backlog.popleft()
                end = 0
            self._replayed = end

    def _rank(self, msg: Open) -> int | None:
        """OPEN's ``rank``, checked: None for a job that is no rank."""
        if msg.rank == -1:
            return None
        if not 0 <= msg.rank < msg.world:
            raise RemoteProtocolError(
                f"OPEN.rank={msg.rank} is not a rank of world={msg.world}", "bad_open"
            )
        for peer in self.emulator.peers:
            job = peer.job
            if job is not None and job is not self and job.rank == msg.rank and peer.open:
                raise RemoteProtocolError(
                    f"OPEN.rank={msg.rank}: rank {msg.rank} is open already ({job.name})",
                    "bad_open",
                )
        return msg.rank

    def _rank_device(self, rank: int) -> int:
        """The device of a rank that names none (OPEN.rank without OPEN.device): device
        ``rank`` of the ready fleet in ``fleet_order``, as ``morphling run --ranks`` gives
        rank r device r of its SPEC."""
        ready = sorted(self.emulator.registry.ready(), key=lambda r: fleet_order(r.name))
        if not 0 <= rank < len(ready):
            names = ", ".join(r.name for r in ready[:8]) or "none"
            raise RemoteProtocolError(
                f"OPEN.rank={rank} without OPEN.device runs on device {rank} of the fleet, and "
                f"{len(ready)} are ready ({names}): start more devices or name one",
                "bad_open",
            )
        return ready[rank].id

    def _pinned_device(self, name: str) -> int:
        """The id of the ready device named ``name`` (OPEN.device: a rank's own board)."""
        ready = self.emulator.registry.ready()
        for record in ready:
            if record.name == name:
                return record.id
        known = ", ".join(sorted(r.name for r in ready)) or "none"
        raise RemoteProtocolError(
            f"OPEN.device={name!r}: no such device is ready (ready: {known})", "bad_open"
        )

    def map_weights(self) -> None:
        """The job maps the shared weights. Its weights' versions start again from 0, so a
        block a device kept for another job may carry the same version and other bytes:
        no kept block is trusted any more."""
        self.maps_weights = True
        self._count_as_trainer()
        self.emulator.trainers.distrust_kept()

    def _count_as_trainer(self) -> None:
        """Count the job among those that trained the weights, once it maps them and has
        marked a step."""
        if self.maps_weights and self.steps and self.trained is None:
            self.trained = self.emulator.trainers.add(self.name, self.steps)

    def _restore_weights(self) -> None:
        """OPEN.fresh_weights: copy the checkpoint over the working copy before the job
        starts; refused while another job maps it, since that would change its weights
        under it. The job may send nothing else until OPEN answers."""
        emulator = self.emulator
        weights = emulator.weights
        if weights is None:
            raise RemoteProtocolError(
                "OPEN.fresh_weights: this emulator shares no weights (--ckpt-path)", "bad_open"
            )
        users = [
            p.job
            for p in emulator.peers
            if p.job is not None and p.job is not self and p.job.maps_weights and p.open
        ]
        if users or emulator.trainers.restoring is not None:
            who = (
                f"job {users[0].id} ({users[0].name or 'opening'}) maps them"
                if users
                else "another job is restoring them"
            )
            raise RemoteProtocolError(
                f"OPEN.fresh_weights: the shared weights are in use ({who}); "
                "restoring them now would change them under it",
                "weights_busy",
            )
        self.map_weights()
        self.conn.spawn(self._restored(emulator.trainers.restore(weights)))

    async def _restored(self, restoring: asyncio.Future[None]) -> None:
        try:
            await asyncio.shield(restoring)
        except (CheckpointError, OSError) as exc:
            self.conn.fail("bad_open", f"OPEN.fresh_weights: cannot restore the weights: {exc}")
            return
        except Exception:
            log.exception("job %d: restoring the shared weights failed", self.id)
            self.conn.fail(
                "internal", "restoring the shared weights failed (see the emulator's log)"
            )
            return
        log.info("job %d (%s) starts from the checkpoint's weights, restored", self.id, self.name)
        self.conn.send(
            Open(
                name=self.name,
                block=self.block,
                device_wait_s=self.device_wait_s,
                fresh_weights=True,
            )
        )

    # -- a GEMM, from intake to RESULT ---------------------------------------------------

    def gemm(self, msg: Gemm) -> None:
        """Take a GEMM: its task, whose tiles the timeline places (``submit``), whence the
        scheduler sends them; ``finish`` answers once every tile is back."""
        emulator = self.emulator
        handed = self._handed(msg)
        try:
            task = make_task(
                msg,
                weights=emulator.weights,
                slab=self.slab,
                handed=handed,
                memory=self._output_memory,
            )
        except GemmError as exc:
            raise RemoteProtocolError(f"GEMM {msg.gemm}: {exc}", "bad_gemm") from None
        if task.in_slab and self.slab_gemm:
            raise RemoteProtocolError(
                f"GEMM {msg.gemm} uses the slab while GEMM {self.slab_gemm}, "
                "which uses it too, is in flight",
                "bad_gemm",
            )
        task.owner = self
        if task.weights and not self.maps_weights:
            self.map_weights()
        block = self.block
        if self.auto_block:
            block = auto_edge(msg, block, emulator.timeline.placement)
        count, limit = task.tile_count(block), emulator.config.max_job_tiles
        if count > limit:
            raise RemoteProtocolError(
                f"GEMM {msg.gemm}: {count} tiles of {block}² exceed "
                f"max_job_tiles={limit}; use a larger block",
                "bad_gemm",
            )
        self._start(task, task.tiles(block), msg)

    def conv(self, msg: Conv) -> None:
        """Take a CONV, as ``gemm`` takes a GEMM: its tiles hold about ``block``² outputs,
        and are no more than ``max_job_tiles``."""
        handed = self._handed(msg)
        try:
            task = make_conv_task(msg, handed=handed, memory=self._output_memory)
        except GemmError as exc:
            raise RemoteProtocolError(f"CONV {msg.gemm}: {exc}", "bad_gemm") from None
        task.owner = self
        tiles = task.tiles(self.block, self.emulator.config.max_job_tiles)
        self._start(task, tiles, msg)

    def collective(self, msg: Collective) -> None:
        """A rank's COLLECTIVE: its part issued in virtual time (no answer)."""
        name = f"COLLECTIVE {msg.gemm}"
        if self.rank is None:
            raise RemoteProtocolError(f"{name}: the job is no rank (OPEN.rank)", "bad_collective")
        if msg.op not in COLLECTIVE_OPS:
            raise RemoteProtocolError(
                f"{name}: op {msg.op!r} is not one of {', '.join(COLLECTIVE_OPS)}",
                "bad_collective",
            )
        ranks = msg.ranks
        if (
            not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
            or len(set(ranks)) != len(ranks)
            or self.rank not in ranks
        ):
            raise RemoteProtocolError(
                f"{name}: ranks={ranks!r:.80} must be distinct ranks including the sender's "
                f"({self.rank})",
                "bad_collective",
            )
        if msg.nbytes < 0 or msg.seq < 1 or (msg.root != -1 and msg.root not in ranks):
            raise RemoteProtocolError(
                f"{name}: nbytes={msg.nbytes} (>= 0), seq={msg.seq} (>= 1) and root="
                f"{msg.root} (-1 or one of ranks) out of range",
                "bad_collective",
            )
        group = tuple(ranks)
        kind = "p2p" if msg.op in PAIR else "group"  # numbered apart (PROTOCOL.md)
        key: tuple[object, ...] = (kind, group, msg.seq)
        replay = self.emulator.replay
        if replay is not None:  # the world's: its members all ranks, named by its size
            group = replay.group(msg.op, ranks, name)
            key = (kind, len(group), msg.seq)
            self._work = hash((self._work, msg.op, msg.nbytes))
        op = Operation(
            key, msg.op, msg.nbytes, group,
            root=group.index(msg.root) if msg.root != -1 else 0, blocking=msg.blocking,
        )  # fmt: skip
        timeline = self.emulator.timeline

        def part(timed: _Timed) -> None:
            host_s, split = _host(msg, timed.profile)
            timeline.collective(
                timed.job, timed.rank, msg.gemm, op, after=msg.after, host_s=host_s,
                host_split=split, done=lambda issue, end: None,
            )  # fmt: skip

        self._each(part)

    def wait(self, msg: Wait) -> None:
        """A rank's WAIT: it waits for its earlier COLLECTIVE ``msg.wait`` here (no answer)."""
        if self.rank is None:
            raise RemoteProtocolError(f"WAIT {msg.gemm}: the job is no rank (OPEN.rank)",
                                      "bad_collective")  # fmt: skip
        if not 0 < msg.wait < msg.gemm:
            raise RemoteProtocolError(
                f"WAIT {msg.gemm}: wait={msg.wait} is not an earlier request's id",
                "bad_collective",
            )
        timeline = self.emulator.timeline

        def wait(timed: _Timed) -> None:
            host_s, split = _host(msg, timed.profile)
            timeline.wait(timed.job, msg.wait, msg.gemm, after=msg.after, host_s=host_s,
                          host_split=split)  # fmt: skip

        self._each(wait)

    def _handed(self, msg: Gemm | Conv) -> local.JobOperands | None:
        """A new request's id checked (a ``by_rank`` one: from a rank), and the arrays it
        handed over in this process."""
        name = msg.TYPE.name
        if msg.gemm in self.gemms:
            raise RemoteProtocolError(f"{name} id {msg.gemm} is already in flight", "bad_gemm")
        if msg.by_rank and self.rank is None:
            raise RemoteProtocolError(
                f"{name} {msg.gemm}: by_rank, but the job is no rank (OPEN.rank)", "bad_gemm"
            )
        return local.take_gemm((self.emulator.token, self.id, msg.gemm)) if self.local else None

    def _start(self, task: AnyTask, tiles: Sequence[AnyTile], msg: Gemm | Conv) -> None:
        """Count the task in flight and have the timeline issue it as ``msg`` places it (a
        rank's own product: ``_time_only``, and again for each of its copies)."""
        if msg.by_rank:
            self._time_only(self._timed(), task, tiles, msg)
            if self.emulator.replay is not None:
                self._work = hash((self._work, _shape(msg)))
            if self.copies:  # one task for them all: nothing reads what the clock writes
                again, again_tiles = self._again(msg)  # into a copy's (its ``oom``)
                self._each_copy(lambda copy: self._time_only(copy, again, again_tiles, msg,
                                                             counted=False))  # fmt: skip
            return
        emulator = self.emulator
        here, scheduler = emulator.host_products.takes(tiles), emulator.scheduler
        self.tiles_in_flight += len(tiles)
        self.bytes_in_flight += _held_bytes(task)
        self.totals["gemms"] += 1
        self.totals["tiles"] += len(tiles)
        if tiles:
            self.gemms[task.id] = task
            emulator.verifier.prepare(task)
            if task.in_slab:
                self.slab_gemm = task.id
        emulator.timeline.submit(  # an empty one too: its host_ns is coordinator time
            self.id,
            task,
            tiles,
            after=msg.after,
            host_s=msg.host_ns / 1e9,
            host_split=msg.host_split,
            place=self._on_host(task, tiles) if here else scheduler.submit,
            done=task.settled,
        )
        if not tiles:
            self.finish(task)  # (which regulates)
            return
        self.regulate()

    def _on_host(self, task: AnyTask, tiles: Sequence[AnyTile]) -> Callable[[list[_Placed]], None]:
        """The placer of a product this host computes (``host_products``): once C is
        computed, its sampled tiles go to their devices (their blocks of C then theirs) and
        the others are in."""
        emulator = self.emulator
        host = emulator.host_products
        sent = host.sample(tiles)
        computed = host.compute(task, tiles, sent)

        def place(placed: list[_Placed]) -> None:
            def go(future: asyncio.Future[Blocks]) -> None:
                if task.cancelled or not self.conn.open:
                    return
                try:
                    for index, values in future.result():
                        task.out[index] = values
                except Exception:  # a bug of ours, or memory: the job says so
                    what = f"{task.request.TYPE.name} {task.id}"
                    log.exception("job %d: %s on this host failed", self.id, what)
                    self.conn.fail("internal", f"{what} failed on the host")
                    return
                to_devices = [p for p in placed if p[0].id in sent]
                done_here = [p[0] for p in placed if p[0].id not in sent]
                host.count(len(done_here), len(to_devices))
                for tile in done_here:
                    task.put(tile, None)
                emulator.scheduler.submit(to_devices)
                if task.remaining == 0:
                    settle(emulator.scheduler, emulator.verifier, task)

            computed.add_done_callback(go)

        return place

    def _again(self, msg: Gemm | Conv) -> tuple[AnyTask, Sequence[AnyTile]]:
        """A rank's own product (``by_rank``: its layout only) made again, with its tiles,
        for a replayed copy (the rank's own was made from the same message)."""
        if isinstance(msg, Gemm):
            task = make_task(msg)
            return task, task.tiles(self.block)
        conv = make_conv_task(msg)
        return conv, conv.tiles(self.block, self.emulator.config.max_job_tiles)

    def _time_only(
        self, timed: _Timed, task: AnyTask, tiles: Sequence[AnyTile], msg: Gemm | Conv,
        *, counted: bool = True,
    ) -> None:  # fmt: skip
        """A product the rank computed itself: its tiles placed on the device of ``timed``
        (the rank's job, or a copy's) in virtual time and sent nowhere; no RESULT answers
        it. ``counted``: in this job's totals (a copy's is not)."""
        totals = self.totals
        if counted:
            totals["gemms"] += 1
            totals["tiles"] += len(tiles)

        def settled(issue: float, end: float) -> None:
            task.settled(issue, end)
            if counted:
                totals["model_ns"] += task.virtual_ns
                totals["oom"] += task.oom

        host_s, split = _host(msg, timed.profile)
        self.emulator.timeline.submit(
            timed.job, task, tiles, after=msg.after, host_s=host_s, host_split=split,
            place=_place_nowhere, done=settled,
        )  # fmt: skip

    def _output_memory(self, nbytes: int) -> memoryview:
        """Memory for a C that goes back in RESULT: in the operand arena (where devices on
        this host write their tiles) when it fits there."""
        if nbytes > self.emulator.config.max_payload_bytes:
            raise GemmError(f"output of {nbytes} bytes exceeds max_payload_bytes")
        return self.emulator.shared_memory(nbytes)

    def finish(self, task: Task) -> None:
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
        if self.conn.open:
            self.conn.send(
                Result(
                    gemm=task.id,
                    tiles=len(task.done),
                    devices=sorted(task.devices),
                    requeued=task.requeued,
                    resent=task.resent,
                    model_ns=task.virtual_ns,
                    bytes_down=task.bytes_down,
                    bytes_up=task.bytes_up,
                    oom=task.oom,
                    slab_retired=task.slab_retired,
                    segments=(task.out.reshape(-1)[:0] if task.in_place else task.out,),
                )
            )
        self.regulate()

    def regulate(self) -> None:
        """Read the job's requests only while it reads the replies and its GEMMs in flight
        stay below ``max_job_tiles`` and ``max_job_bytes``: otherwise one that sends
        without reading would grow the emulator's memory without bound."""
        cfg, conn = self.emulator.config, self.conn
        if (
            conn.writable
            and self.tiles_in_flight < cfg.max_job_tiles
            and self.bytes_in_flight < cfg.max_job_bytes
        ):
            conn.resume_reading()
        else:
            conn.pause_reading()

    # -- STEP, CLOSE, and the end --------------------------------------------------------

    def step(self, msg: Step) -> None:
        self.steps += 1
        if self.trained is not None:
            self.trained["steps"] = self.steps
        else:
            self._count_as_trainer()
        replay = self.emulator.replay
        if replay is not None and self.rank is not None:
            replay.check(self.rank, msg.step, self._work)
            self._work = 0
        timeline = self.emulator.timeline

        def mark(timed: _Timed) -> None:
            host_s, split = _host(msg, timed.profile)
            timeline.mark_step(
                timed.job,
                msg.step,
                host_s=host_s,
                host_split=split,
                local_gemms=msg.local_gemms,
                done=self._step_done if timed.job == self.id else _copied,
            )

        self._each(mark)

    def _step_done(self, times: StepTimes) -> None:
        """The step is settled in virtual time: answer the job's STEP."""
        wire = (self.totals["bytes_down"], self.totals["bytes_up"])
        (down0, up0), self._wire_at_step = self._wire_at_step, wire
        if self.conn.open:
            self.conn.send(
                Step(
                    step=times.step,
                    emulated_ns=round(times.emulated_s * 1e9),
                    coord_ns=round(times.coord_s * 1e9),
                    coord_split={op: round(s * 1e9) for op, s in times.coord_split.items()},
                    gemms=times.gemms,
                    tiles=times.tiles,
                    link_down=times.link_down,
                    link_up=times.link_up,
                    link_saved=times.link_saved,
                    link_bound=times.link_bound,
                    bytes_down=wire[0] - down0,
                    bytes_up=wire[1] - up0,
                    oom=times.oom,
                    comm_ns=round(times.comm_s * 1e9),
                    comm_wait_ns=round(times.comm_wait_s * 1e9),
                    interruptions=times.interruptions,
                    lost_ns=round(times.lost_s * 1e9),
                )
            )

    def close(self) -> None:
        """CLOSE: the job's totals, and goodbye."""
        self.closed = True
        self.conn.send(Close(**self.totals))
        self.conn.close()

    def left(self) -> None:
        """The connection is gone: its GEMMs are dropped, its slab goes back (once no tile
        still out uses it), and it no longer counts as training the weights."""
        emulator = self.emulator
        emulator.waiting.discard(self)
        if self.rank is not None and not self.closed:
            emulator.ranks_lost[self.rank] = self.conn.ended_with
        if self.trained is not None:
            self.trained["running"] = False
        emulator.timeline.close_job(self.id)
        if self.closed:  # its copies do what it did to the end (the end of its last step)
            self._replay_calls(len(self._backlog) * len(self.copies))
        self._backlog.clear()  # (else what they had yet to do is void)
        self._replayed = 0
        for copy in self.copies:
            emulator.timeline.close_job(copy.job)
        self.slab = None
        for task in self.gemms.values():
            emulator.scheduler.cancel(task)
        self.gemms.clear()

    # -- the slab --------------------------------------------------------------------------

    def slab_asked(self, msg: Slab) -> None:
        """Give the job the slab of the arena it asks for, when there is room (at most half
        the arena, and one slab at a time: no job can take it all); answer with the slab it
        has now."""
        arena = self.emulator.arena
        if not self.maps_arena or arena is None:
            raise RemoteProtocolError(
                "SLAB from a job that does not map the operand arena (HELLO caps.arena)", "bad_slab"
            )
        if msg.nbytes < 0:
            raise RemoteProtocolError(f"SLAB.nbytes={msg.nbytes} is negative", "bad_slab")
        if self.slab_gemm:  # it holds on to the slab it uses: a new one would be a second
            raise RemoteProtocolError(
                f"SLAB while GEMM {self.slab_gemm}, which uses the slab, is in flight", "bad_slab"
            )
        # The old slab goes first, so the new one may reuse its pages; the job has none
        # until this is answered.
        self.slab = None
        view = arena.allocate(msg.nbytes) if 0 < msg.nbytes <= arena.nbytes // 2 else None
        if view is None:
            if msg.nbytes:
                log.info("job %d: no room for a slab of %d bytes in the arena", self.id, msg.nbytes)
            self.conn.send(Slab(nbytes=0, offset=-1))
            return
        slab = self.slab = np.frombuffer(view, np.uint8)
        offset = arena.offset_of(slab)
        assert offset is not None  # (the arena gave it)
        self.conn.send(Slab(nbytes=len(slab), offset=offset))

    def retire_slab(self, task: Task) -> None:
        """A device lost while writing ``task``'s C may still write: if that is in the job's
        slab, the job gets no more use of it (RESULT.slab_retired says so)."""
        if self.slab is not None and np.shares_memory(self.slab, task.out):
            self.slab = None  # held by ``task`` until it is done, and then for late writes
            task.slab_retired = True

    def give_up(self, reason: str) -> None:
        """One of the job's tiles lost its device every time it was sent (``devices.lost``):
        the job is told why, and its requests are dropped as it goes."""
        self.conn.fail("tile_failed", reason)

    # -- waiting for devices -------------------------------------------------------------

    def watch_wait(self, now: float, ready: int, ready_conv: int, connected: int) -> None:
        """Tell the job when its tiles start waiting for want of a ready device (one that
        computes convolutions, for a convolution's: ``ready_conv``), every
        ``device_wait_notice_s`` while they do, and when one is back; fail it once they
        have waited its ``device_wait_s``. Without this a job whose fleet vanished waited
        for ever, in silence."""
        counts = [0, 0]  # tiles not done: of GEMMs, of convolutions
        for task in self.gemms.values():
            counts[task.op != GEMM_OP] += task.remaining
        count = sum(counts)
        stuck = (0 if ready else counts[0]) + (0 if ready_conv else counts[1])
        tiles = f"{count} tile{'s' if count != 1 else ''}"
        limit, since = self.device_wait_s, self.waiting_since
        if since is None:
            if not stuck:
                return
            self.waiting_since = self._noticed = now
            self.emulator.waiting.add(self)
            end = f"fails after {limit:g} s" if limit else "waits for ever"
            what = "device" if not ready else "device that computes convolutions (HELLO caps.conv)"
            self._notice(
                "no_devices",
                f"no {what} is ready ({connected} connected): the job "
                f"waits with {tiles} queued; it {end} (device_wait_s)",
                connected,
                count,
                0.0,
                logging.WARNING,
            )
            return
        waited = now - since
        if not stuck:
            self.waiting_since = None
            self.emulator.waiting.discard(self)
            if ready:
                self._notice(
                    "devices",
                    f"devices are back: {ready} ready after {waited:.3g} s; "
                    f"sending the job's {tiles} queued",
                    connected,
                    count,
                    waited,
                )
        elif limit and waited >= limit:
            self.conn.fail(
                "no_devices",
                f"no device was ready for {limit:g} s (device_wait_s); the job had {tiles} queued",
            )
        elif now - self._noticed >= self.emulator.config.device_wait_notice_s:
            self._noticed = now
            text = (
                f"waiting for devices: {connected} connected, {tiles} queued, waited "
                f"{waited:.3g} s" + (f" of {limit:g}" if limit else "")
            )
            self._notice("no_devices", text, connected, count, waited)

    def _notice(
        self,
        code: str,
        text: str,
        devices: int,
        tiles: int,
        waited_s: float,
        level: int = logging.INFO,
    ) -> None:
        """Say ``text`` to the job (NOTICE ``code``) and in the log."""
        log.log(level, "job %d (%s): %s", self.id, self.name, text)
        self.conn.send(
            Notice(
                code=code,
                text=text,
                devices=devices,
                tiles=tiles,
                waited_s=waited_s,
                limit_s=self.device_wait_s,
            )
        )


_Placed = tuple[AnyTile, int, Admission]  # a tile, its device, what its memory took in


class _Timed(NamedTuple):
    """A timeline job that does what a rank asks: the rank's own, or a replayed copy's."""

    job: int
    rank: int
    profile: str  # its coordinator profile, where not the rank's own (``host_alt``'s key)


def _host(
    msg: Gemm | Conv | Collective | Wait | Step, profile: str
) -> tuple[float, dict[str, int]]:
    """A request's coordinator time (seconds, by op class) on ``profile`` (``host_alt``), or
    as the rank priced it for itself (``profile`` empty, or not among ``host_alt``'s)."""
    split = msg.host_alt.get(profile) if profile else None
    if split is None:
        return msg.host_ns / 1e9, msg.host_split
    return sum(split.values()) / 1e9, split


def _shape(msg: Gemm | Conv) -> tuple[object, ...]:
    """What a rank's product is, for comparing computed ranks' work (``Replay.check``)."""
    if isinstance(msg, Gemm):
        return ("gemm", msg.dtype, msg.ta, msg.tb, msg.m, msg.n, msg.k, msg.batch)
    return ("conv", msg.kind, msg.dtype, *msg.input, *msg.weight, *msg.stride,
            *msg.dilation, *msg.padding, msg.groups)  # fmt: skip


def _copied(times: StepTimes) -> None:
    """A replayed copy's step: logged by the timeline, answered to nobody."""


def _place_nowhere(placed: Sequence[object]) -> None:
    """A rank's own product's placed tiles: computed already, so sent nowhere."""


def _held_bytes(task: Task) -> int:
    """The emulator's memory ``task`` holds: the operand bytes it arrived with, and its C
    unless C is the job's own (in place)."""
    received = sum(memoryview(s).nbytes for s in task.request.segments)
    return received + (0 if task.in_place else task.out.nbytes)

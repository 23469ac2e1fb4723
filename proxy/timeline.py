"""The virtual clock of a fleet: where every tile of every job would be, and when.

A job issues GEMM g at job time t (the end of the GEMM it last waited on,
plus the coordinator time the script spent since). At t every tile is placed
on a device (``placement``) and charged to its emulated memory; it waits for
and crosses the device's downlink (only the bytes not already resident),
waits for and runs on its compute queue (the device's model at its thermal
state), and crosses the uplink. The GEMM ends when its last tile is back,
an event in virtual time, and the job's clock moves there.

The real work follows the virtual placement: ``submit`` hands each placed
tile to the caller, which sends it to that device's connection. Numerics
never depend on time, so the virtual timeline may run ahead of the real
tiles or behind them.

Several jobs share one fleet in virtual time: the clock only runs events
due before every open job's horizon — the time of its last settled event
while it computes between GEMMs, unbounded while it waits on one — so a job
that issues its next GEMM late in wall time still lands in the right place.
A job enters virtual time with its first GEMM, at the clock's time then
(setting a script up is not emulated), and holds nobody back before it. A
job that stays open and idle later would hold the others back for ever, so
the emulator calls ``release_idle`` when the clock has been held for a
while: the idle jobs stop counting until they issue again, and what they
issue then starts no earlier than the clock (a warning says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from ..devices.compute_model import GemmShape
from ..devices.profiles import DeviceProfile
from .engine import Clock, Fifo, Span
from .memory import Admission
from .partition import Block, GemmTask, TileTask
from .placement import Placement
from .vdevice import VirtualDevice, Work

log = logging.getLogger(__name__)

ENDS_KEPT = 4096  # GEMM end times a job remembers for GEMMs issued "after" them


@dataclass(frozen=True)
class Bottleneck:
    """A FIFO every transfer also crosses: the access point, or the emulator's NIC."""

    dl_bw: float
    ul_bw: float

    def __post_init__(self) -> None:
        for name in ("dl_bw", "ul_bw"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"bottleneck {name}={value!r}: must be > 0 bytes/s")


class EventLog:
    """The timeline's records, one JSON object per line, hashed as written.

    The hash is what the determinism tests compare; ``sink`` (a text file)
    is what ``morphling report`` reads.
    """

    def __init__(self, sink: IO[str] | None = None) -> None:
        self.sink = sink
        self.count = 0
        self._hash = hashlib.sha256()

    def write(self, record: dict[str, Any]) -> None:
        self._line(json.dumps(record, separators=(",", ":")))

    def tile(self, run: _Run) -> None:
        """A tile record, formatted by hand: there is one per tile, and ``json.dumps``
        would be a third of the engine's time. The same JSON ``write`` would give."""
        g, w = run.gemm, run.work
        self._line(
            f'{{"ev":"tile","job":{g.job.id},"gemm":{g.task.id},"step":{g.step},'
            f'"tile":{run.seq},"device":{run.device.id},"bytes_down":{w.bytes_down},'
            f'"bytes_up":{w.bytes_up},"down":[{run.down[0]!r},{run.down[1]!r}],'
            f'"compute":[{run.compute[0]!r},{run.compute[1]!r}],'
            f'"up":[{run.up[0]!r},{run.up[1]!r}],"freq_mhz":{_number(run.freq)},'
            f'"temp_c":{_number(run.temp)}}}'
        )

    def digest(self) -> str:
        return self._hash.hexdigest()

    def _line(self, text: str) -> None:
        line = text + "\n"
        self._hash.update(line.encode())
        self.count += 1
        if self.sink is not None:
            self.sink.write(line)


def _number(value: float | None) -> str:
    return "null" if value is None else repr(value)


@dataclass
class StepTimes:
    """A closed step of one job, in virtual seconds."""

    step: int
    t0: float
    t1: float
    coord_s: float
    gemms: int
    tiles: int
    link_down: int  # bytes the fleet's links would carry
    link_up: int
    oom: int

    @property
    def emulated_s(self) -> float:
        return self.t1 - self.t0


@dataclass(eq=False)
class _Job:
    id: int
    name: str
    clock: float  # the time of its last settled event
    waiting: int = 0  # GEMMs and step marks submitted and not yet settled
    inflight: dict[int, list[Callable[[float], None]]] = field(default_factory=dict)
    barrier: list[Callable[[float], None]] = field(default_factory=list)  # after all of them
    ends: dict[int, float] = field(default_factory=dict)
    step: StepTimes | None = None  # the step under way
    steps: int = 0  # steps closed
    step_end: float = 0.0  # when the last one closed
    released: bool = True  # not started, or idle too long: holds the clock back no more
    started: bool = False


@dataclass(eq=False, slots=True)
class _Run:
    """One tile on its way through a device's FIFOs."""

    tile: TileTask
    seq: int  # the tile's number in this timeline: ids of its own, the same on every run
    device: VirtualDevice
    gemm: _Gemm
    work: Work
    down: Span = (0.0, 0.0)
    compute: Span = (0.0, 0.0)
    up: Span = (0.0, 0.0)
    freq: float | None = None
    temp: float | None = None


@dataclass(eq=False)
class _Gemm:
    job: _Job
    task: GemmTask
    tiles: list[TileTask]
    issue: float
    step: int
    place: Callable[[list[tuple[TileTask, int, Admission]]], None]
    done: Callable[[float, float], None]


class Timeline:
    """A fleet's virtual clock; see the module docstring."""

    def __init__(
        self, policy: str, *, log: EventLog | None = None, bottleneck: Bottleneck | None = None
    ) -> None:
        self.clock = Clock()
        self.placement = Placement(policy)
        self.log = log or EventLog()
        self.bottleneck = bottleneck
        self.nic_down, self.nic_up = Fifo(), Fifo()
        self.devices: dict[int, VirtualDevice] = {}
        self.jobs: dict[int, _Job] = {}  # open ones
        self._names: dict[int, str] = {}  # every job ever opened
        self._stalled: list[_Gemm] = []  # issued while no device was there
        self._tiles = 0  # tiles placed so far: their numbers in the log

    # -- fleet and jobs ----------------------------------------------------------------

    def add_device(self, device_id: int, name: str, profile: DeviceProfile) -> VirtualDevice:
        device = self.devices[device_id] = VirtualDevice(device_id, name, profile)
        self.placement.add(device)
        stalled, self._stalled = self._stalled, []
        for gemm in stalled:
            self._issue(gemm)
        self._advance()
        return device

    @property
    def stalled(self) -> int:
        """GEMMs issued while no device was there, waiting for one."""
        return len(self._stalled)

    def remove_device(self, device_id: int) -> None:
        """No more tiles go to it; those it already has finish in virtual time."""
        self.placement.remove(device_id)

    def open_job(self, job_id: int, name: str) -> None:
        self.jobs[job_id] = _Job(job_id, name, clock=self.clock.now)
        self._names[job_id] = name
        self._advance()

    def job_names(self) -> list[dict[str, object]]:
        return [{"id": job_id, "name": name} for job_id, name in self._names.items()]

    def close_job(self, job_id: int) -> None:
        self.jobs.pop(job_id, None)
        self._advance()

    # -- what jobs do ------------------------------------------------------------------

    def submit(
        self,
        job_id: int,
        task: GemmTask,
        tiles: list[TileTask],
        *,
        after: int,
        host_s: float,
        place: Callable[[list[tuple[TileTask, int, Admission]]], None],
        done: Callable[[float, float], None],
    ) -> None:
        """Issue ``task`` ``host_s`` after GEMM ``after`` ended (0: after the job's last
        settled event). ``place`` gets the tiles with their devices once they are
        placed; ``done(issue, end)`` is called when the GEMM ends in virtual time."""
        job = self._active(job_id)
        job.waiting += 1
        job.inflight[task.id] = []

        def issue(base: float) -> None:
            at = max(base + host_s, self.clock.now)  # later only for a released job
            times = self._step_of(job, at)
            self._coordinator(job, times, base, at)
            gemm = _Gemm(job, task, tiles, at, times.step, place, done)
            self.clock.at(at, self._issue, gemm, tile=task.id)

        waits = job.inflight.get(after) if after != task.id else None
        if waits is not None:
            waits.append(issue)
        else:
            issue(job.ends.get(after, job.clock))
        self._advance()

    def mark_step(self, job_id: int, step: int, *, host_s: float, local_gemms: int = 0,
                  done: Callable[[StepTimes], None]) -> None:  # fmt: skip
        """The job's step ``step`` ended ``host_s`` after its GEMMs in flight all ended;
        ``done`` gets its times."""
        job = self._active(job_id)
        job.waiting += 1

        def close(base: float) -> None:
            at = base + host_s
            times = self._step_of(job, at)
            self._coordinator(job, times, base, at)
            times.t1, times.step = at, step
            job.steps += 1
            job.step, job.step_end = None, at
            job.clock = max(job.clock, at)
            job.waiting -= 1
            self.log.write({"ev": "step", "job": job.id, "step": step, "t0": times.t0,
                            "t1": times.t1, "gemms": times.gemms, "local_gemms": local_gemms,
                            "tiles": times.tiles,
                            "coord_s": times.coord_s, "oom": times.oom})  # fmt: skip
            done(times)

        if job.inflight:
            job.barrier.append(close)
        else:
            close(job.clock)
        self._advance()

    # -- the clock ---------------------------------------------------------------------

    def _horizon(self) -> float:
        """Events before this time are settled: no open job can issue anything earlier."""
        return min(
            (j.clock for j in self.jobs.values() if not j.waiting and not j.released),
            default=math.inf,
        )

    def blocked(self) -> bool:
        """Events are due that an open job computing on the host holds back."""
        return self.clock.next_time() < math.inf and self.clock.next_time() >= self._horizon()

    def release_idle(self) -> list[int]:
        """Stop waiting for the jobs that hold the clock back; their ids."""
        horizon = self._horizon()
        idle = [j for j in self.jobs.values() if not j.waiting and j.clock <= horizon]
        for job in idle:
            job.released = True
            log.warning("job %d (%s) has issued nothing since virtual time %.6f s: virtual "
                        "time goes on without it, and its next GEMM starts no earlier than "
                        "the clock", job.id, job.name, job.clock)  # fmt: skip
        self._advance()
        return [j.id for j in idle]

    def _active(self, job_id: int) -> _Job:
        job = self.jobs[job_id]
        if job.released:
            job.released = False
            job.clock = max(job.clock, self.clock.now)
            if not job.started:
                job.started = True
                job.step_end = job.clock
        return job

    def _advance(self) -> None:
        self.clock.run(self._horizon)

    def _step_of(self, job: _Job, at: float) -> StepTimes:
        """The step under way; a new one starts where the last closed (the first at its
        first event: setting up the script is not a training step)."""
        if job.step is None:
            t0 = job.step_end if job.steps else at
            job.step = StepTimes(job.steps + 1, t0, t0, 0.0, 0, 0, 0, 0, 0)
        return job.step

    def _coordinator(self, job: _Job, times: StepTimes, base: float, at: float) -> None:
        """The script computed on the host from ``base`` to ``at``: coordinator time."""
        start = max(base, times.t0)
        if at > start:
            times.coord_s += at - start
            self.log.write({"ev": "coord", "job": job.id, "step": times.step,
                            "t0": start, "t1": at})  # fmt: skip

    def _issue(self, gemm: _Gemm) -> None:
        """Place every tile at the issue time and run it through its device's FIFOs.

        A device's compute queue is fed only by its own downlink, and its uplink only
        by its compute, each first come first served: so, placing tiles in issue-time
        order, each tile's whole passage is known when it is placed. Only the GEMM's
        end is an event of its own.
        """
        if not gemm.tiles:
            self._finish(gemm, None)
            return
        if not self.placement.devices:
            self._stalled.append(gemm)
            return
        now = self.clock.now
        job, task = gemm.job, gemm.task
        times = self._step_of(job, now)
        times.gemms += 1
        g = task.request
        item = task.out.itemsize
        placed = []
        last: _Run | None = None
        for tile in gemm.tiles:
            rows, cols = tile.shape
            a, b = tile.operands()
            # k = 0 (C is zeros) is costed as k = 1: the models start at one product
            shape = GemmShape(rows, cols, max(g.k, 1), g.ta, g.tb, a.sent_ld, b.sent_ld, g.dtype)
            work = Work(a.nbytes + b.nbytes, rows * cols * item, shape)
            index = self.placement.choose(now, work)
            device = self.placement.devices[index]
            self._tiles += 1
            admission, work = self._admit(gemm, times, device, a, b, work)
            run = self._run(now, _Run(tile, self._tiles, device, gemm, work))
            self.placement.placed(index)
            times.tiles += 1
            times.link_down += work.bytes_down
            times.link_up += work.bytes_up
            if last is None or run.up[1] > last.up[1]:
                last = run
            placed.append((tile, device.id, admission))
        gemm.place(placed)
        self.clock.at(last.up[1], self._returned, last, tile=last.seq)

    def _admit(self, gemm: _Gemm, times: StepTimes, device: VirtualDevice, a: Block, b: Block,
               work: Work) -> tuple[Admission, Work]:  # fmt: skip
        """Charge the tile to the device's emulated memory: the admission, and the work
        without the weight blocks it already holds. One that cannot fit is an OOM."""
        weights = [blk for blk in (a, b) if blk.offset is not None]
        transient = work.bytes_up + sum(blk.nbytes for blk in (a, b) if blk.offset is None)
        admission = device.memory.admit(
            [(blk.key, blk.version, blk.nbytes) for blk in weights], transient
        )
        if not admission.fits:
            job, task = gemm.job, gemm.task
            times.oom += 1
            task.oom += 1
            log.warning("emulated OOM: device %d (%s, %d bytes) cannot hold tile %d of GEMM %d",
                        device.id, device.name, device.memory.capacity, self._tiles,
                        task.id)  # fmt: skip
            self.log.write({"ev": "oom", "job": job.id, "gemm": task.id, "step": gemm.step,
                            "tile": self._tiles, "device": device.id, "t": self.clock.now,
                            "need_bytes": transient + sum(blk.nbytes for blk in weights),
                            "capacity_bytes": device.memory.capacity})  # fmt: skip
        resident = sum(blk.nbytes for blk in weights if blk.key in admission.held)
        if resident:
            work = Work(work.bytes_down - resident, work.bytes_up, work.shape)
        return admission, work

    def _run(self, now: float, run: _Run) -> _Run:
        """The tile's passage: down the link (and the shared FIFO), compute, up."""
        device, work = run.device, run.work
        if not work.bytes_down:
            run.down = (now, now)
        else:
            run.down = self._transfer(now, device.down, device.download_s(work.bytes_down),
                                      self.nic_down, work.bytes_down, device.profile.dl_lat_s,
                                      None if self.bottleneck is None
                                      else self.bottleneck.dl_bw)  # fmt: skip
        changes = len(device.thermal.changes) if device.thermal is not None else 0
        run.compute, run.freq, run.temp = device.compute_after(run.down[1], work.shape)
        if device.thermal is not None:
            for t, mhz, temp in device.thermal.changes[changes:]:
                self.log.write({"ev": "freq", "device": device.id, "t": t, "freq_mhz": mhz,
                                "temp_c": temp})  # fmt: skip
        run.up = self._transfer(run.compute[1], device.up, device.upload_s(work.bytes_up),
                                self.nic_up, work.bytes_up, device.profile.ul_lat_s,
                                None if self.bottleneck is None
                                else self.bottleneck.ul_bw)  # fmt: skip
        device.returns_at(run.up[1])
        self.log.tile(run)
        return run

    @staticmethod
    def _transfer(arrival: float, link: Fifo, seconds: float, nic: Fifo, nbytes: int,
                  latency: float, nic_bw: float | None) -> Span:  # fmt: skip
        """A transfer on ``link``; with a shared FIFO (``nic_bw``) it also crosses that,
        and cannot end before the shared FIFO has passed its last byte."""
        if nic_bw is None:
            return link.serve(arrival, seconds)
        shared = nic.serve(arrival, nbytes / nic_bw)
        start, end = link.serve(shared[0], seconds)
        link.free_at = end = max(end, shared[1] + latency)
        return start, end

    def _returned(self, run: _Run) -> None:
        self._finish(run.gemm, run)

    def _finish(self, gemm: _Gemm, last: _Run | None) -> None:
        """The GEMM's last tile is back (``last``; None for an empty GEMM)."""
        now, job, task = self.clock.now, gemm.job, gemm.task
        self.log.write({"ev": "gemm", "job": job.id, "gemm": task.id, "step": gemm.step,
                        "issue": gemm.issue, "end": now, "tiles": len(gemm.tiles),
                        "last_tile": last.seq if last else None,
                        "last_device": last.device.id if last else None,
                        "m": task.request.m, "n": task.request.n, "k": task.request.k,
                        "batch": task.request.batch})  # fmt: skip
        job.clock = max(job.clock, now)
        job.waiting -= 1
        job.ends[task.id] = now
        if len(job.ends) > ENDS_KEPT:
            del job.ends[next(iter(job.ends))]
        gemm.done(gemm.issue, now)
        for action in job.inflight.pop(task.id, []):
            action(now)
        if not job.inflight:
            barrier, job.barrier = job.barrier, []
            for action in barrier:
                action(job.clock)

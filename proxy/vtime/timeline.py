"""The virtual clock of a fleet: where every tile of every job would be, and when.

A job issues GEMM g at job time t (the end of the GEMM it last waited on,
plus the coordinator time the script spent since). At t every tile is placed
on a device (``placement``; a convolution's, on one that computes them: until one
has joined, the convolution waits) and charged to its emulated memory; it waits for
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

A rank of a distributed script (``open_job(rank=...)``) runs on its own device, which
serves it alone, and shares nothing with the other jobs but its collectives: its time is
its own. Its events carry their own times, so it never holds the clock back and is never
released; a collective starts when its last member reaches it (``collective``) and the
members' links are done with the collectives each reached before it (one at a time, in
each rank's order: DDP's buckets queue behind each other), and takes its transfers' time
on the members' links by the timeline's algorithm (``collectives``).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Generic, NamedTuple, TypeVar

from morphling.devices.models.compute import GemmShape
from morphling.devices.models.conv_shape import ConvShape
from morphling.devices.models.profiles import DeviceProfile

from .availability import Absence, Availability
from .collectives import ALGORITHMS, Link, collective_s
from .engine import Clock, Fifo, Span
from .eventlog import (
    COMPONENTS,
    GEMM_OP,
    Away,
    CollectivePart,
    DeviceStep,
    EventLog,
    Freq,
    Oom,
    Stages,
    Step,
    TileHead,
    attribute,
    critical_breakdown,
)
from .held import HeldTime
from .memory import Admission, Key
from .placement import Placement
from .vdevice import VirtualDevice, Work
from .work import GemmWork, Operand, TileWork

log = logging.getLogger(__name__)

# What a rank does when its device leaves (``--on-leave``): ``wait``, its work pauses until
# the device is back (a tile being computed starts again then); ``restart``, it starts its
# step again once back (what the step had done until the leave is done again); ``drop``, a
# rank ``open_job`` calls droppable (a replayed one) leaves the run for good when its
# device first leaves, and the collectives that start after that go on without it (the
# others wait, as with ``wait``).
ON_LEAVE = ("wait", "restart", "drop")
WINDOW_TRIES = 64  # absences a rank's work that starts again may skip to find its window
ENDS_KEPT = 4096  # GEMM end times a job remembers for GEMMs issued "after" them
WORKS_KEPT = 4096  # distinct tile ``Work``s kept for reuse (a run has few)

T = TypeVar("T", bound=TileWork)  # the caller's tiles, handed back to it placed
Placed = list[tuple[T, int, Admission]]  # tiles with their devices and admissions
# A tile's passage (``Timeline._run``): its stages, the MHz and °C it computes at, and its
# spans on the shared FIFO (down, up; None without one)
_Passage = tuple[Stages, tuple[float | None, float | None], tuple[Span | None, Span | None]]
# What a tile's ``Work`` depends on (``Timeline._work``): its rows and columns, its operands'
# leading dimensions as sent and their bytes, and its GEMM's k, transposes and dtype.
_GemmKey = tuple[int, int, int, int, int, int, bool, bool, str]
# A convolution tile's depends on what it computes and its operands' bytes.
_WorkKey = _GemmKey | tuple[ConvShape, int]


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


@dataclass(slots=True)
class DeviceTotals:
    """What one device did for one step of a job whose log keeps totals (the ``steps``
    level, ``auto`` after its first steps): its tiles' totals, and its state at its last
    tile's compute start (the thermal report's sample)."""

    tiles: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_saved: int = 0  # operand bytes it held already (residency)
    down_s: float = 0.0
    compute_s: float = 0.0
    conv_s: float = 0.0  # of ``compute_s``, convolutions' tiles
    up_s: float = 0.0
    last_in: int = 0  # the step's GEMMs whose last tile back was its
    t: float = 0.0
    freq_mhz: float | None = None
    temp_c: float | None = None

    def add(self, work: Work, stages: Stages, state: tuple[float | None, float | None]) -> None:
        down, compute, up = stages
        self.tiles += 1
        self.bytes_down += work.bytes_down
        self.bytes_up += work.bytes_up
        self.bytes_saved += work.bytes_saved
        self.down_s += down[1] - down[0]
        self.compute_s += compute[1] - compute[0]
        if isinstance(work.shape, ConvShape):
            self.conv_s += compute[1] - compute[0]
        self.up_s += up[1] - up[0]
        if compute[0] >= self.t:
            self.t, (self.freq_mhz, self.temp_c) = compute[0], state


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
    link_saved: int = 0  # bytes its devices held already, so not carried (residency)
    # the least its GEMMs' partitions send: each device's distinct operand blocks, once
    link_bound: int = 0
    gemm_s: float = 0.0  # its GEMMs' issue to end, summed
    product_s: dict[str, float] = field(default_factory=dict)  # ... by ``op``
    # its coordinator time by op class, where the job split it (``attribute``); the rest
    # of ``coord_s`` was not split (measured time)
    coord_split: dict[str, float] = field(default_factory=dict)
    # its GEMMs' critical paths (``eventlog.critical_breakdown``), summed
    critical: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    # its devices' totals, when the log keeps them instead of its tiles (``EventLog.detail``)
    totals: bool = False
    devices: dict[int, DeviceTotals] = field(default_factory=dict)
    comm_s: float = 0.0  # its collectives' time on the network (a rank's)
    comm_wait_s: float = 0.0  # ... and waiting for their other members
    interruptions: int = 0  # its tiles placed again, their device having left
    lost_s: float = 0.0  # ... and the time their passages had run when it did

    @property
    def emulated_s(self) -> float:
        return self.t1 - self.t0


@dataclass(eq=False)
class _Job:
    id: int
    name: str
    clock: float  # the time of its last settled event
    waiting: int = 0  # GEMMs and step marks submitted and not yet settled
    # GEMMs not yet ended, by submission number (a GEMM id may come again once its RESULT
    # is out, before its GEMM ended in virtual time), each with what waits for its end
    inflight: dict[int, list[Callable[[float], None]]] = field(default_factory=dict)
    barrier: list[Callable[[float], None]] = field(default_factory=list)  # after all of them
    submitted: int = 0  # submission numbers given
    latest: dict[int, int] = field(default_factory=dict)  # GEMM id → its last, in flight
    # GEMM id → (submission number, end) of the last GEMM of that id to end
    ends: dict[int, tuple[int, float]] = field(default_factory=dict)
    step: StepTimes | None = None  # the step under way
    steps: int = 0  # steps closed
    step_end: float = 0.0  # when the last one closed
    released: bool = True  # not started, or idle too long: holds the clock back no more
    started: bool = False
    device: int | None = None  # the one device its tiles go to (a rank's), or any
    resident: bool = False  # it runs on ``device`` itself (a rank): its tiles cross no link
    ranks: tuple[int, ...] = ()  # a rank's: its own, then those that mirror it (``open_job``)
    drop_at: float = math.inf  # when it leaves the run (``drop``: its device's first leave)
    dropped: bool = False  # its work has reached ``drop_at``: it does nothing more
    counted: float = 0.0  # its coordinator time is counted up to here
    overlapped: float = 0.0  # the end of its latest collective it did not wait for at once
    # a rank's absences met since its step's times last took them (``_rank_away``)
    interruptions: int = 0
    lost_s: float = 0.0


class _Back(NamedTuple, Generic[T]):
    """The tile of a GEMM that comes back last, and when: the GEMM's end."""

    gemm: _Gemm[T]
    time: float
    tile: int  # its number in this timeline: ids of its own, the same on every run
    device: int
    stages: Stages


@dataclass(eq=False)
class _Gemm(Generic[T]):
    job: _Job
    task: GemmWork
    tiles: Sequence[T]
    issue: float
    step: int
    place: Callable[[Placed[T]], None]
    done: Callable[[float, float], None]
    seq: int  # its submission number in its job
    pending: int = 0  # its tiles to place again (their device left before they were back)
    last: _Back[T] | None = None  # its tile back last, of those placed for good


class _Absences:
    """A rank's device's absences, listed from the availability as far as asked."""

    def __init__(self, source: Iterator[Absence]) -> None:
        self._source = source
        self._known: list[Absence] = []
        self._backs: list[float] = []
        self.goes_on: dict[float, float] = {}  # leave → when the rank went on after it
        self.redoing = False  # ``restart``: it is doing its step again
        self.redos = 0  # redos cut short in a row
        self._warned = False

    def warn(self, job: _Job, why: str) -> None:
        """A warning about its rank's job, once."""
        if not self._warned:
            self._warned = True
            log.warning("rank job %d (%s): %s", job.id, job.name, why)

    def next_after(self, t: float, job: _Job) -> Absence:
        """The first absence not over by ``t`` ((inf, inf): none). One for good is none:
        a rank cannot wait for ever (a warning says so, once)."""
        while not self._backs or self._backs[-1] <= t:
            absence = next(self._source, None)
            if absence is None:
                return math.inf, math.inf
            if absence[1] == math.inf:
                self.warn(job, f"its device leaves for good at {absence[0]:.6f} s, and a rank "
                          "cannot wait for ever: it stays")  # fmt: skip
                self._source = iter(())
                return math.inf, math.inf
            self._known.append(absence)
            self._backs.append(absence[1])
        return self._known[bisect.bisect_right(self._backs, t)]


@dataclass(eq=False)
class _Requeue(Generic[T]):
    """A tile whose passage its device leaves before it is back: placed again then."""

    gemm: _Gemm[T]
    tile: T
    operands: tuple[Operand, Operand]
    start: float  # when its passage started: what ran until the leave is lost
    times: StepTimes
    head: TileHead | None


@dataclass(frozen=True)
class Operation:
    """A collective as one rank issues it: ``key`` names it among every member's (its
    group and number), ``members`` the group's ranks in group order, ``root`` the root's or
    source's index among them."""

    key: tuple[object, ...]
    op: str
    nbytes: int
    members: tuple[int, ...]
    root: int = 0
    blocking: bool = True


@dataclass(eq=False)
class _Part:
    """A rank's part in a collective, from when it reaches it."""

    job: _Job
    rank: int
    request: int
    seq: int  # its submission number in its job
    op: Operation
    at: float
    step: int
    done: Callable[[float, float], None]


class Timeline(Generic[T]):
    """A fleet's virtual clock; see the module docstring. ``T``: the caller's tiles, which
    ``submit`` hands back to it placed."""

    def __init__(
        self,
        policy: str,
        *,
        log: EventLog | None = None,
        bottleneck: Bottleneck | None = None,
        algorithm: str = "ring",
        residency: bool = True,
        dropped: Callable[[int, list[int]], None] | None = None,
        availability: Availability | None = None,
        on_leave: str = "wait",
    ) -> None:
        """``algorithm``: how collectives move their bytes (``collectives.ALGORITHMS``);
        ``residency``: devices keep the panels they are sent for any later tile that needs
        the same bytes, until a step ends without using them (``DeviceMemory.sweep``:
        ``dropped`` hears of each device's), greedy prefers a device that holds a tile's
        blocks (or blocks around them) where that pays, and plans as a whole a request
        none of whose blocks any device holds (off: each tile carries its panels, and
        greedy places tile by tile); ``availability``: when devices leave and come back
        (``availability``; None: they stay); ``on_leave``: what a rank whose device leaves
        does (``ON_LEAVE``)."""
        if on_leave not in ON_LEAVE:
            raise ValueError(f"on_leave {on_leave!r}: not one of {', '.join(ON_LEAVE)}")
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"collective algorithm {algorithm!r}: not one of {', '.join(ALGORITHMS)}"
            )
        self.algorithm = algorithm
        self.residency = residency
        self.dropped = dropped
        # the devices that took each block in to keep (some may have let it go since)
        self._holders: dict[Hashable, dict[int, VirtualDevice]] = {}
        self.clock = Clock()
        self.held_time = HeldTime()  # wall seconds the clock has waited for jobs on the host
        self.placement = Placement(policy)
        self.log = log or EventLog()
        self.bottleneck = bottleneck
        self.nic_down, self.nic_up = Fifo(), Fifo()
        self.devices: dict[int, VirtualDevice] = {}
        self.jobs: dict[int, _Job] = {}  # open ones
        self._holding: dict[int, _Job] = {}  # those that may hold the clock back: no ranks
        self._names: dict[int, str] = {}  # every job ever opened
        self._stalled: list[_Gemm[T]] = []  # issued while no device could take them
        self._tiles = 0  # tiles placed so far: their numbers in the log
        self._gathering: dict[tuple[object, ...], dict[int, _Part]] = {}  # collectives, by key
        self._reached: dict[int, deque[tuple[object, ...]]] = {}  # each rank's, not started
        self._comm_free: dict[int, float] = {}  # when each rank's links are done with them
        self._rank_epoch: float | None = None  # when the open ranks started
        self._rank_jobs: dict[int, _Job] = {}  # each rank's job (a mirror's: the one it mirrors)
        self._mirror_devices: dict[int, int] = {}  # each mirroring rank's device
        self.ranks_dropped: dict[int, float] = {}  # ranks dropped (``drop``), when
        self._droppable = 0  # ranks that will be (``drop``: their devices leave)
        self._works: dict[_WorkKey, Work] = {}  # see ``_work``
        self.availability = availability
        self._absences: dict[int, Iterator[Absence]] = {}  # each device's, those to come
        self._transitions: list[tuple[float, int]] = []  # (time, device): leaves and returns
        self._away: set[int] = set()  # devices away now
        self._waking = math.nan  # the return the clock has an event for (``_wake_later``)
        self._never_back = False  # said that nothing waiting can be placed for good
        self._doomed: dict[int, list[_Requeue[T]]] = {}  # tiles its leave will interrupt
        self._orphans: list[_Requeue[T]] = []  # interrupted, waiting for a device to take them
        self._gone: set[int] = set()  # devices whose connection left (they come back no more)
        self.on_leave = on_leave
        self._rank_absences: dict[int, _Absences] = {}  # a rank's device's, by its id
        self._unplaced: set[int] = set()  # devices only their ranks' work runs on
        self._in_memory: dict[int, VirtualDevice] = {}  # those that may hold panels (``_sweep``)

    # -- fleet and jobs ----------------------------------------------------------------

    def add_device(
        self,
        device_id: int,
        name: str,
        profile: DeviceProfile,
        *,
        convolutions: bool = True,
        placed: bool = True,
    ) -> VirtualDevice:
        """A device joins; ``convolutions``: it computes convolution tiles; not ``placed``:
        it takes no tiles, only its rank's own work (a replayed rank's: it has no agent).
        (One its availability has away now takes tiles once it is back.)"""
        device = VirtualDevice(device_id, name, profile, convolutions=convolutions)
        self.devices[device_id] = device
        if placed:
            self.placement.add(device)
        else:
            self._unplaced.add(device_id)
        if self.availability is not None:
            self._absences[device_id] = self.availability.absences(name)
            self._next_absence(device)
            self._catch_up()
        self._unstall()
        self._advance()
        return device

    def timed_by(self, device_id: int) -> Hashable | None:
        """What a rank's work on the device is timed by: equal for two devices only when
        their ranks' work is timed alike (the same profile, neither with absences; None:
        by nothing another device shares)."""
        device = self.devices[device_id]
        if self.availability is not None and next(self.availability.absences(device.name), None):
            return None
        return repr(device.profile)

    # -- availability: devices away and back ---------------------------------------------
    #
    # A device's leaves and returns are kept in ``_transitions`` and applied when the
    # timeline next places a tile (``_catch_up``): a fleet of thousands churning puts no
    # event on the clock for them. Only a leave that interrupts tiles is an event (at its
    # time their passages stop, and they are placed again from there, in order with the
    # other arrivals), and so is the next return while something waits for a device.

    def _next_absence(self, device: VirtualDevice) -> None:
        """Its next absence that is not over by now, as its next transition."""
        now = self.clock.now
        for leave, back in self._absences.get(device.id, ()):
            if back > now:
                device.leaves_at, device.back_at = leave, back
                heappush(self._transitions, (leave, device.id))
                return
        device.leaves_at = device.back_at = math.inf
        self._absences.pop(device.id, None)

    def _catch_up(self) -> None:
        """Apply every leave and return due by now, in order of time."""
        transitions, now = self._transitions, self.clock.now
        while transitions and transitions[0][0] <= now:
            t, device_id = heappop(transitions)
            device = self.devices[device_id]
            if device_id in self._rank_absences:  # a rank's: its own time (``_rank_time``)
                continue
            if t == device.leaves_at and device.id not in self._away:
                if device_id in self._gone and device_id not in self._doomed:
                    continue  # (its connection left: nothing of it to place again)
                self._leave(device)
            elif t == device.back_at and device.id in self._away:
                self._away.discard(device_id)
                if device_id not in self._gone:
                    self.placement.back(device_id)
                    self._next_absence(device)

    def _leave(self, device: VirtualDevice) -> None:
        """It leaves: no more tiles for it until it is back, and what it would have done
        from now is void (its queues wait for its return); the tiles it had not sent back
        (``_doomed``: the clock is at their leave) are placed again, on the devices there.
        It comes back having lost what it held."""
        leave, back = device.leaves_at, device.back_at
        self._away.add(device.id)
        self.placement.away(device.id)
        device.memory.distrust()
        device.down.free_at = device.compute.free_at = device.up.free_at = back
        device.outstanding(math.inf)  # (forgets every return it expected)
        doomed = self._doomed.pop(device.id, [])
        lost = 0.0
        for requeue in doomed:
            ran = max(0.0, leave - requeue.start)
            requeue.times.interruptions += 1
            requeue.times.lost_s += ran
            lost += ran
        self.log.write(Away(device.id, leave, back if back < math.inf else None, len(doomed), lost))
        self._orphans += doomed
        if back < math.inf:
            heappush(self._transitions, (back, device.id))

    def _own_device(self, device: VirtualDevice) -> None:
        """A rank runs on ``device``: its absences apply to the rank's own time, not the
        clock's (``_rank_time``), and no tile of another job waits for it."""
        absences = self.availability.absences(device.name) if self.availability else iter(())
        self._rank_absences[device.id] = _Absences(absences)
        self._absences.pop(device.id, None)
        device.leaves_at = device.back_at = math.inf
        self._orphans += self._doomed.pop(device.id, [])  # (other jobs' tiles: placed again)
        if device.id in self._away:  # (its queues wait no more for a return)
            self._away.discard(device.id)
            self.placement.back(device.id)
            now = self.clock.now
            device.down.free_at = device.compute.free_at = device.up.free_at = now

    def _absences_of(self, job: _Job) -> _Absences | None:
        """A rank's device's absences (None: it has none, the job is no rank's, or one that
        is dropped when its device leaves, whose work never pauses)."""
        if job.device is None or job.drop_at < math.inf:
            return None
        return self._rank_absences.get(job.device)

    def _host_work(self, job: _Job, base: float, seconds: float) -> tuple[float, list[Span]]:
        """When the job's ``seconds`` of coordinator work from ``base`` are done, and the
        spans in between its rank's device was away (or redoing its step), which are no
        coordinator time."""
        away: list[Span] = []
        if not job.resident:
            return base + seconds, away
        return self._rank_time(job, base, seconds, away=away), away

    def _release_device(self, device_id: int) -> None:
        """A rank's device whose rank left: its absences are the clock's again."""
        device = self.devices.get(device_id)
        if self._rank_absences.pop(device_id, None) is not None and device is not None:
            assert self.availability is not None
            self._absences[device_id] = self.availability.absences(device.name)
            self._next_absence(device)
            self._catch_up()

    def _rank_time(
        self,
        job: _Job,
        start: float,
        seconds: float,
        *,
        redo: bool = False,
        away: list[Span] | None = None,
    ) -> float:
        """When ``seconds`` of a rank's own work begun at ``start`` (its coordinator work)
        is done, its device's absences skipped: the work pauses while it is away (``away``
        gets those spans). (``redo``: it is the step done again after an absence, which
        another absence starts again.)"""
        absences = self._absences_of(job)
        if absences is None:
            return start + seconds
        t, left = start, seconds
        while True:
            leave, back = absences.next_after(t, job)
            if t + left <= leave:
                return t + left
            went = max(t, leave)
            if self.on_leave != "restart":  # (``drop``: one that is not dropped waits)
                left -= went - t  # (done: it goes on from there)
            elif redo:
                left = 0.0  # (the redo after this absence does it all again)
            t = self._rank_away(job, absences, t, leave, back)
            if away is not None:
                away.append((went, t))

    def _rank_span(self, job: _Job, start: float, seconds: float) -> Span:
        """(start, end) from ``start`` of ``seconds`` of a rank's work that starts again
        if its device leaves (a tile's computation, its part in a collective): in the first
        window its device is there throughout, or, where its absences leave none among the
        next ``WINDOW_TRIES``, from ``start``, pausing while it is away."""
        absences = self._absences_of(job)
        if absences is None:
            return start, start + seconds
        t, skipped = start, []
        for _ in range(WINDOW_TRIES):
            leave, back = absences.next_after(t, job)
            if t + seconds <= leave:
                break
            skipped.append((leave, back))
            t = absences.goes_on.get(leave, back)
        else:
            return start, self._rank_time(job, start, seconds)
        if not skipped:
            return start, start + seconds
        for leave, back in skipped:  # counted; ``restart`` redoes the step, which moves it
            t = self._rank_away(job, absences, start, leave, back)
        return self._rank_span(job, t, seconds)

    def _rank_away(
        self, job: _Job, absences: _Absences, t: float, leave: float, back: float
    ) -> float:
        """The rank's device is away from ``leave`` to ``back`` as its work from ``t``
        reaches it: when the rank goes on. With ``wait``, once back; with ``restart``, once
        back and its step's work so far is done again (its coordinator, GEMM and collective
        seconds, itself work an absence cuts short), the work from ``t`` lost. Each
        absence is counted, and logged, once."""
        goes_on = absences.goes_on.get(leave)
        if goes_on is not None:
            return goes_on
        redo = lost = 0.0
        times = job.step
        if self.on_leave == "restart":
            if times is not None:
                redo = times.coord_s + times.gemm_s + times.comm_s
            if absences.redoing:
                absences.redos += 1
                if absences.redos > WINDOW_TRIES:  # its device never stays for so long
                    cut = f"its step's {redo:.6f} s were cut short {WINDOW_TRIES} times"
                    absences.warn(job, f"{cut}: it goes on as with --on-leave wait")
                    redo = 0.0
            lost = redo + max(0.0, leave - t)
        absences.goes_on[leave] = back  # (while the redo runs: an absence met again)
        job.interruptions += 1
        job.lost_s += lost
        self.log.write(Away(job.device or 0, leave, back, 1, lost))
        goes_on = back
        if redo:
            outer, absences.redoing = absences.redoing, True
            goes_on = self._rank_time(job, back, redo, redo=True)
            absences.redoing = outer
            if not outer:
                absences.redos = 0
        absences.goes_on[leave] = goes_on
        return goes_on

    def _rank_tile(self, job: _Job, device: VirtualDevice, passage: _Passage) -> _Passage:
        """A rank's tile computes while its device is there: one its device leaves during
        starts again once it is back (``_rank_span``)."""
        (c0, c1) = passage[0][1]
        start, end = self._rank_span(job, c0, c1 - c0)
        if (start, end) == (c0, c1):
            return passage
        device.compute.free_at = end
        return ((start, start), (start, end), (end, end)), passage[1], passage[2]

    def _interrupt(self, device: VirtualDevice, requeue: _Requeue[T]) -> None:
        """``requeue``'s tile will not be back before its device leaves: an event then."""
        doomed = self._doomed.setdefault(device.id, [])
        if not doomed:
            self.clock.at(device.leaves_at, self._wake, None, device=device.id)
        doomed.append(requeue)

    def _wake(self, _: None) -> None:
        self._catch_up()
        self._unstall()

    def _unstall(self) -> None:
        """Place what waited for a device: interrupted tiles, then whole GEMMs; while
        something still waits, the next return is an event."""
        orphans, self._orphans = self._orphans, []
        for requeue in orphans:
            self._requeue(requeue)
        stalled, self._stalled = self._stalled, []
        for gemm in stalled:
            self._issue(gemm)
        self._wake_later()

    def _wake_later(self) -> None:
        """While tiles or GEMMs wait for a device and some device is away, the next
        return is an event (an error is logged once if none of them comes back)."""
        if not (self._orphans or self._stalled) or not self._away:
            return
        back = min(self.devices[d].back_at for d in self._away)
        if back == math.inf:
            if not self._never_back:
                self._never_back = True
                log.error(
                    "tiles wait for a device, and every device away has left for good "
                    "(its availability ends): virtual time cannot go on until one joins"
                )
        elif back != self._waking:
            self._waking = back
            self.clock.at(back, self._wake, None)

    @property
    def stalled(self) -> int:
        """GEMMs issued while no device that can take their tiles was there, waiting."""
        return len(self._stalled)

    def remove_device(self, device_id: int) -> None:
        """No more tiles go to it; those it already has finish in virtual time (but those
        its availability's next leave interrupts), and it does not come back."""
        self._gone.add(device_id)
        self.placement.remove(device_id)
        self._away.discard(device_id)

    def open_job(
        self,
        job_id: int,
        name: str,
        *,
        device: int | None = None,
        rank: int | None = None,
        mirrors: Mapping[int, int] | None = None,
        droppable: bool = False,
    ) -> None:
        """A job joins; ``device``: all its tiles go to that device. A ``rank`` runs on
        ``device`` itself, so its tiles cross no link, and its time is its own: it starts
        with the other ranks, whenever it joins, and never holds the clock back, since
        nothing of it is shared but its collectives (each event of it carries its own time:
        events of the past do not move the clock back, and need not).

        ``mirrors`` (rank → device): ranks whose time is this rank's, each on a device the
        timeline cannot tell from its own (the same profile, no absences): each reaches
        every collective as it does and takes its part on its own device's links, and
        has no job, requests nor events of its own (replay's classes). A ``droppable``
        rank leaves the run when its device first leaves, under ``drop``."""
        job = _Job(job_id, name, clock=self.clock.now, device=device, resident=rank is not None)
        if rank is not None:
            if self._rank_epoch is None or not self._rank_jobs:
                self._rank_epoch = self.clock.now
            job.clock = job.step_end = self._rank_epoch
            job.released, job.started = False, True
            job.ranks = (rank, *(mirrors or {}))
            for r in job.ranks:
                self._rank_jobs[r] = job
            self._mirror_devices.update(mirrors or {})
            if device is not None and self.availability is not None:
                self._own_device(self.devices[device])
                if droppable and self.on_leave == "drop":
                    leaves = self.availability.absences(self.devices[device].name)
                    job.drop_at = next((leave for leave, _ in leaves), math.inf)
                    self._droppable += job.drop_at < math.inf
        else:
            self._holding[job_id] = job
        self.jobs[job_id] = job
        self._names[job_id] = name
        self._advance()

    def job_names(self) -> list[dict[str, object]]:
        return [{"id": job_id, "name": name} for job_id, name in self._names.items()]

    def close_job(self, job_id: int) -> None:
        job = self.jobs.pop(job_id, None)
        self._holding.pop(job_id, None)
        for rank in job.ranks if job is not None else ():
            del self._rank_jobs[rank]
            self._mirror_devices.pop(rank, None)
            self._reached.pop(rank, None)  # what it reached and left will never start
            self._comm_free.pop(rank, None)
        if job is not None and job.resident and job.device is not None and self.availability:
            self._release_device(job.device)
        self._stalled = [gemm for gemm in self._stalled if gemm.job.id != job_id]  # its memory
        self._advance()

    # -- what jobs do ------------------------------------------------------------------

    def submit(
        self,
        job_id: int,
        task: GemmWork,
        tiles: Sequence[T],
        *,
        after: int,
        host_s: float,
        place: Callable[[Placed[T]], None],
        done: Callable[[float, float], None],
        host_split: Mapping[str, int] | None = None,
    ) -> None:
        """Issue ``task`` ``host_s`` after GEMM ``after`` ended (0: after the job's last
        settled event); ``host_split`` divides ``host_s`` among op classes (the job's
        nanoseconds; None or empty: not divided). ``place`` gets the tiles with their
        devices once they are placed; ``done(issue, end)`` is called when the GEMM ends
        in virtual time."""
        job = self._active(job_id)

        def issue(at: float, times: StepTimes, seq: int) -> None:
            gemm = _Gemm(job, task, tiles, at, times.step, place, done, seq)
            self.clock.at(at, self._issue, gemm, job=job.id, tile=task.id)

        self._request(job, task.id, after, host_s, host_split, issue)

    def collective(
        self,
        job_id: int,
        rank: int,
        request_id: int,
        op: Operation,
        *,
        after: int,
        host_s: float,
        done: Callable[[float, float], None],
        host_split: Mapping[str, int] | None = None,
    ) -> None:
        """The rank's part in collective ``op``, issued as ``submit`` issues a GEMM. It
        starts when its last member has issued its part and takes ``collectives``' time
        over the members' devices' links; then each member's part ends (``done(issue,
        end)``). A ``blocking`` part holds its rank until then; another lets it compute on,
        and only its step's end waits for it."""
        job = self._active(job_id)

        def issue(at: float, times: StepTimes, seq: int) -> None:
            part = _Part(job, rank, request_id, seq, op, at, times.step, done)
            self.clock.at(at, self._arrive, part, job=job.id, tile=request_id)

        self._request(job, request_id, after, host_s, host_split, issue, blocking=op.blocking)

    def wait(
        self,
        job_id: int,
        awaited: int,
        request_id: int,
        *,
        after: int,
        host_s: float,
        host_split: Mapping[str, int] | None = None,
    ) -> None:
        """The job waits, ``host_s`` after ``after`` ended, for its earlier request
        ``awaited`` (a collective it did not wait for at once): this request ends when that
        one has, or at once if it has, and holds the job until then."""
        job = self._active(job_id)

        def issue(at: float, times: StepTimes, seq: int) -> None:
            def end(then: float) -> None:
                over = max(at, then)  # a rank's own time, which may be the clock's past
                self.clock.at(over, self._waited, (job, request_id, seq, over),
                              job=job.id, tile=request_id)  # fmt: skip

            pending = job.latest.get(awaited)
            if pending is not None and pending in job.inflight:
                job.inflight[pending].append(end)
            else:  # over already (or never known: nothing to wait for)
                end(job.ends.get(awaited, (0, at))[1])

        self._request(job, request_id, after, host_s, host_split, issue)

    def _waited(self, waited: tuple[_Job, int, int, float]) -> None:
        job, request_id, seq, now = waited
        if self.jobs.get(job.id) is job:
            self._settle(job, request_id, seq, now, blocking=True)

    def _request(
        self,
        job: _Job,
        request_id: int,
        after: int,
        host_s: float,
        host_split: Mapping[str, int] | None,
        issue: Callable[[float, StepTimes, int], None],
        *,
        blocking: bool = True,
    ) -> None:
        """A GEMM's or collective's bookkeeping: in flight until it ends, issued ``host_s``
        after ``after`` ended (``issue(at, step, seq)``, once it has). A ``blocking`` one
        holds the job: while it is in flight, the job is not computing on the host."""
        if blocking:
            job.waiting += 1
        waits = job.inflight.get(job.latest.get(after, 0))  # ``after`` as it was until now
        job.submitted += 1
        seq = job.latest[request_id] = job.submitted
        job.inflight[seq] = []

        def start(base: float) -> None:
            at, away = self._host_work(job, base, host_s)
            if at >= job.drop_at:  # it left the run first: this does nothing, at once
                self._rank_leaves(job)
                self._settle(job, request_id, seq, job.drop_at, blocking=blocking)
                return
            if not job.resident:  # a released job's starts no earlier than the clock
                at = max(at, self.clock.now)
            times = self._step_of(job, at)
            self._coordinator(job, times, base, at, host_split, away)
            issue(at, times, seq)

        if waits is not None:
            waits.append(start)
        else:
            start(job.ends[after][1] if after in job.ends else job.clock)
        self._advance()

    def mark_step(
        self,
        job_id: int,
        step: int,
        *,
        host_s: float,
        local_gemms: int = 0,
        host_split: Mapping[str, int] | None = None,
        done: Callable[[StepTimes], None],
    ) -> None:
        """The job's step ``step`` ended ``host_s`` (divided among op classes as
        ``host_split`` says, as in ``submit``) after its GEMMs in flight all ended;
        ``done`` gets its times."""
        job = self._active(job_id)
        job.waiting += 1

        def close(base: float) -> None:
            at, away = self._host_work(job, base, host_s)
            if at >= job.drop_at:  # (it left the run first: the step never ends)
                self._rank_leaves(job)
                job.waiting -= 1
                return
            times = self._step_of(job, at)
            self._coordinator(job, times, base, at, host_split, away)
            times.t1, times.step = at, step
            job.steps += 1
            job.step, job.step_end = None, at
            job.clock = max(job.clock, at)
            job.waiting -= 1
            self._log_step(job, times, local_gemms)
            if self.residency:
                self._sweep()
            done(times)

        if job.inflight:
            job.barrier.append(close)
        else:
            close(max(job.clock, job.overlapped))
        self._advance()

    def _sweep(self) -> None:
        """A step ended: each device lets go of the panels no tile used since the last
        step's end, and forgets it held them."""
        for device in list(self._in_memory.values()):
            memory = device.memory
            dropped = memory.sweep()
            if dropped and self.dropped is not None:
                self.dropped(device.id, dropped)
            if not memory.resident:
                del self._in_memory[device.id]
        self._holders = {
            key: still
            for key, devices in self._holders.items()
            if (still := {i: d for i, d in devices.items() if d.memory.keeps(key)})
        }

    def _log_step(self, job: _Job, times: StepTimes, local_gemms: int) -> None:
        """A closed step's record: its times and totals (all a ``steps`` log has of its
        GEMMs), and its devices' totals when the log keeps them instead of its tiles."""
        self.log.write(
            Step(
                job.id,
                times.step,
                times.t0,
                times.t1,
                times.gemms,
                local_gemms,
                tiles=times.tiles,
                coord_s=times.coord_s,
                coord_split=times.coord_split or None,
                oom=times.oom,
                gemm_s=times.gemm_s,
                product_s=times.product_s if set(times.product_s) - {GEMM_OP} else None,
                bytes_down=times.link_down,
                bytes_up=times.link_up,
                bytes_saved=times.link_saved,
                bytes_bound=times.link_bound,
                **times.critical,
                comm_s=times.comm_s if job.resident else None,
                comm_wait_s=times.comm_wait_s if job.resident else None,
                interruptions=times.interruptions or None,
                lost_s=times.lost_s if times.interruptions else None,
            )
        )
        for device, t in sorted(times.devices.items()):
            self.log.write(
                DeviceStep(
                    job.id,
                    times.step,
                    device,
                    t.tiles,
                    t.bytes_down,
                    t.bytes_up,
                    t.down_s,
                    t.compute_s,
                    t.up_s,
                    t.last_in,
                    t.t,
                    t.freq_mhz,
                    t.temp_c,
                    conv_s=t.conv_s,
                    bytes_saved=t.bytes_saved,
                )
            )

    # -- the clock ---------------------------------------------------------------------

    def _horizon(self) -> float:
        """Events before this time are settled: no open job can issue anything earlier.
        (Asked before every event: a loop, as ``min`` over a generator costs six times more;
        over the jobs that are no ranks, since a rank holds nothing back.)"""
        horizon = math.inf
        for job in self._holding.values():
            if not job.waiting and not job.released and job.clock < horizon:
                horizon = job.clock
        return horizon

    def blocked(self) -> bool:
        """Events are due that an open job computing on the host holds back."""
        return self.clock.next_time() < math.inf and self.clock.next_time() >= self._horizon()

    def release_idle(self) -> list[int]:
        """Stop waiting for the jobs that hold the clock back; their ids (never a rank's: a
        rank holds nothing back)."""
        horizon = self._horizon()
        idle = [j for j in self._holding.values() if not j.waiting and j.clock <= horizon]
        for job in idle:
            job.released = True
            log.warning(
                "job %d (%s) has issued nothing since virtual time %.6f s: virtual time goes "
                "on without it, and its next GEMM starts no earlier than the clock",
                job.id,
                job.name,
                job.clock,
            )
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
        self.clock.run(self._horizon if self._holding else None)  # (ranks alone: every event)
        self.held_time.note(self.blocked())

    def _step_of(self, job: _Job, at: float) -> StepTimes:
        """The step under way; a new one starts where the last closed (the first at its
        first event: setting up the script is not a training step)."""
        if job.step is None:
            t0 = job.step_end if job.steps else at
            step = job.steps + 1
            totals = self.log.steps and not self.log.detail(step)
            job.step = StepTimes(step, t0, t0, 0.0, 0, 0, 0, 0, 0, totals=totals)
        if job.interruptions:  # a rank's, met since
            job.step.interruptions += job.interruptions
            job.step.lost_s += job.lost_s
            job.interruptions, job.lost_s = 0, 0.0
        return job.step

    def _coordinator(
        self,
        job: _Job,
        times: StepTimes,
        base: float,
        at: float,
        split: Mapping[str, int] | None,
        away: Sequence[Span] = (),
    ) -> None:
        """The script computed on the host from ``base`` to ``at``, but for the spans
        ``away`` (its rank's device was): coordinator time, by op class as ``split``
        divides it. The part before the step's start, or already counted
        (a rank's time before a collective it did not wait for is the next request's too),
        is left out, and the split with it in proportion (``attribute``)."""
        start = max(base, times.t0, job.counted)
        job.counted = max(job.counted, at)
        kept = split if split and any(split.values()) else None
        for t0, t1 in _between(start, at, away):
            seconds = t1 - t0
            times.coord_s += seconds
            if kept is not None:
                by_op = times.coord_split
                for op, part in attribute(seconds, kept).items():
                    by_op[op] = by_op.get(op, 0.0) + part
            self.log.coord(job.id, times.step, t0, t1, kept)

    def _issue(self, gemm: _Gemm[T]) -> None:
        """Place every tile at the issue time and run it through its device's FIFOs.

        A device's compute queue is fed only by its own downlink, and its uplink only
        by its compute, each first come first served: so, placing tiles in issue-time
        order, each tile's whole passage is known when it is placed. Only the GEMM's
        end is an event of its own.
        """
        if self.jobs.get(gemm.job.id) is not gemm.job:  # its job left before its issue
            return
        if not gemm.tiles:
            self._finish(gemm, None)
            return
        if self._transitions:
            self._catch_up()
        placement, task, pinned = self.placement, gemm.task, gemm.job.device
        unplaced = pinned in self._unplaced  # (its rank's own device: always there for it)
        if not unplaced and not placement.can_place(task.op != GEMM_OP, pinned):
            self._stalled.append(gemm)
            self._wake_later()
            return
        now = gemm.issue if gemm.job.resident else self.clock.now  # (a stalled one's: later)
        times = self._step_of(gemm.job, now)
        times.gemms += 1
        head = self.log.tile_head(gemm.job.id, task.id, gemm.step, task.op)
        placed: Placed[T] = []
        end: float | None = None  # of the tile back last (``_Back``)
        end_tile = end_device = 0
        end_stages: Stages | None = None
        link_down = link_up = 0
        needs: set[tuple[int, Key]] = set()  # (device, block) pairs: the partition's bound
        operands = [tile.operands() for tile in gemm.tiles]
        planned = None
        # greedy, free to choose, weighs where blocks are: a device holding some (or blocks
        # around them) draws the tiles that need them; with none held, the request's grid
        follows_data = self.residency and pinned is None and placement.policy == "greedy"
        held_somewhere = follows_data and any(self._held(a, b) for a, b in operands)
        if follows_data and len(gemm.tiles) > 1 and not held_somewhere:
            typical = self._work(task, gemm.tiles[0], *operands[0])
            planned = placement.plan(now, typical, [(a.key, b.key) for a, b in operands])
        for i, tile in enumerate(gemm.tiles):
            a, b = operands[i]
            work = self._work(task, tile, a, b)
            index = -1
            if planned is not None:
                index = planned[i]
            elif pinned is None:
                index = placement.choose(now, work, self._held(a, b) if follows_data else None)
            elif not unplaced:
                index = placement.index(pinned)
            if index >= 0:
                device = placement.devices[index]
            else:
                assert pinned is not None, "an unplaced device is its rank's"
                device = self.devices[pinned]
            for x in (a, b) if not gemm.job.resident else ():
                if (device.id, x.key) not in needs:
                    needs.add((device.id, x.key))
                    times.link_bound += x.nbytes
            self._tiles += 1
            admission, work = self._admit(gemm, times, device, a, b, work)
            if gemm.job.resident:  # its operands are on the device already, its output stays
                work = Work(0, 0, work.shape)
            passage = self._run(now, device, work)
            if gemm.job.resident and device.id in self._rank_absences:
                passage = self._rank_tile(gemm.job, device, passage)
            if index >= 0:
                placement.placed(index)
            placed.append((tile, device.id, admission))
            stages = passage[0]
            back = stages[2][1]
            if back > device.leaves_at:  # the device leaves first: placed again then
                times.link_saved -= work.bytes_saved  # (its last passage's count)
                gemm.pending += 1
                self._interrupt(device, _Requeue(gemm, tile, (a, b), stages[0][0], times, head))
                continue
            self._record(head, device, work, passage, times)
            link_down += work.bytes_down
            link_up += work.bytes_up
            if end is None or back > end:
                end, end_tile, end_device, end_stages = back, self._tiles, device.id, stages
        times.tiles += len(placed) - gemm.pending
        times.link_down += link_down
        times.link_up += link_up
        if end is not None and end_stages is not None:
            gemm.last = _Back(gemm, end, end_tile, end_device, end_stages)
        if not gemm.pending:
            self._end_at_last(gemm)
        gemm.place(placed)  # last: should it raise, the GEMM still ends in virtual time

    def _end_at_last(self, gemm: _Gemm[T]) -> None:
        """Every tile is placed for good: the GEMM ends when the last is back."""
        last = gemm.last
        assert last is not None  # there was a tile
        self.clock.at(last.time, self._returned, last, job=gemm.job.id, tile=last.tile)

    def _requeue(self, requeue: _Requeue[T]) -> None:
        """Place an interrupted tile again, now, on a device that is there (or wait for
        one). Its first device's real tile stands (numerics never depend on time), so the
        device that takes it over keeps none of its blocks: its link carries those it does
        not hold already."""
        gemm, times, placement = requeue.gemm, requeue.times, self.placement
        if self.jobs.get(gemm.job.id) is not gemm.job:  # its job left
            return
        pinned = gemm.job.device
        if not placement.can_place(gemm.task.op != GEMM_OP, pinned):
            self._orphans.append(requeue)
            self._wake_later()
            return
        now = self.clock.now
        a, b = requeue.operands
        work = self._work(gemm.task, requeue.tile, a, b)
        index = placement.choose(now, work) if pinned is None else placement.index(pinned)
        device = placement.devices[index]
        memory = device.memory
        saved = sum(x.nbytes for x in (a, b) if memory.covers(x.key, x.version, x.region))
        if saved and not gemm.job.resident:
            times.link_saved += saved
            work = Work(work.bytes_down - saved, work.bytes_up, work.shape, saved)
        elif gemm.job.resident:
            work = Work(0, 0, work.shape)
        self._tiles += 1
        passage = self._run(now, device, work)
        placement.placed(index)
        stages = passage[0]
        back = stages[2][1]
        if back > device.leaves_at:  # interrupted again
            requeue.start = stages[0][0]
            self._interrupt(device, requeue)
            return
        self._record(requeue.head, device, work, passage, times)
        times.tiles += 1
        times.link_down += work.bytes_down
        times.link_up += work.bytes_up
        if gemm.last is None or back > gemm.last.time:
            gemm.last = _Back(gemm, back, self._tiles, device.id, stages)
        gemm.pending -= 1
        if not gemm.pending:
            self._end_at_last(gemm)

    def _work(self, task: GemmWork, tile: TileWork, a: Operand, b: Operand) -> Work:
        """What ``tile`` asks of a device: its operands' bytes down, its output's up, and
        what it computes. Tiles that agree on everything that depends on share one, across
        requests (``_works``): a run repeats few shapes, building a ``GemmShape`` checks
        every field, and a device's model keeps its last one."""
        down, conv = a.nbytes + b.nbytes, tile.conv
        key: _WorkKey
        if conv is not None:
            key = (conv, down)
        else:
            g = task.header
            rows, cols = tile.shape
            key = gemm = (rows, cols, a.sent_ld, b.sent_ld, down, g.k, g.ta, g.tb, g.dtype)
        work = self._works.get(key)
        if work is None:
            if len(self._works) >= WORKS_KEPT:
                self._works.clear()
            shape = conv if conv is not None else _gemm_shape(gemm)
            work = self._works[key] = Work(down, tile.out_bytes, shape)
        return work

    def _held(self, a: Operand, b: Operand) -> dict[int, int] | None:
        """The bytes of ``a`` and ``b`` that each device (by index in the placement) holds
        at their current version; None when none does (always, with residency off)."""
        if not self._holders:  # (only residency fills it)
            return None
        held: dict[int, int] = {}
        placement = self.placement
        for x in (a,) if a.key == b.key else (a, b):
            for device in self._holders.get(_anchor(x), {}).values():
                # it still holds the block (or one around it), and has not left
                covered = device.memory.covers(x.key, x.version, x.region)
                if covered and placement.can_place(False, device.id):
                    index = placement.index(device.id)
                    held[index] = held.get(index, 0) + x.nbytes
        return held or None

    def _admit(
        self,
        gemm: _Gemm[T],
        times: StepTimes,
        device: VirtualDevice,
        a: Operand,
        b: Operand,
        work: Work,
    ) -> tuple[Admission, Work]:
        """Charge the tile to the device's emulated memory: the admission, and the work
        without the operand blocks it already holds (weight blocks and panels from any
        request, or blocks lying within them). One that cannot fit is an OOM."""
        memory = device.memory
        if self.residency and gemm.task.sent:
            kept: Sequence[Operand] = (a, b)
            transient = work.bytes_up
        else:  # panels live only while their tile runs (a rank's own: none is sent to keep)
            kept = [x for x in (a, b) if x.offset is not None]
            transient = work.bytes_up + sum(x.nbytes for x in (a, b) if x.offset is None)
        admission = memory.admit([(x.key, x.version, x.nbytes, x.region) for x in kept], transient)
        self._in_memory[device.id] = device
        if not admission.fits:
            job, task = gemm.job, gemm.task
            times.oom += 1
            task.oom += 1
            log.warning(
                "emulated OOM: device %d (%s, %d bytes) cannot hold tile %d of GEMM %d",
                device.id,
                device.name,
                memory.capacity,
                self._tiles,
                task.id,
            )
            need = transient + sum({blk.key: blk.nbytes for blk in kept}.values())
            self.log.write(
                Oom(
                    job.id,
                    task.id,
                    gemm.step,
                    self._tiles,
                    device.id,
                    gemm.issue,
                    need,
                    memory.capacity,
                )
            )
            return admission, work
        held = admission.held
        if self.residency:
            for x in kept:
                if x.key not in held:
                    self._holders.setdefault(_anchor(x), {})[device.id] = device
        if held and not gemm.job.resident:  # (a rank's operands cross no link: none saved)
            resident = (a.nbytes if a.key in held else 0) + (b.nbytes if b.key in held else 0)
            times.link_saved += resident
            work = Work(work.bytes_down - resident, work.bytes_up, work.shape, resident)
        return admission, work

    def _run(self, now: float, device: VirtualDevice, work: Work) -> _Passage:
        """The tile's passage: down the link (and the shared FIFO), compute, up; with the
        state it computes at and its spans on the shared FIFO (``_record`` logs them)."""
        bottleneck, thermal, profile = self.bottleneck, device.thermal, device.profile
        nic_down = nic_up = None  # its spans on the shared FIFO, which the report reads
        if not work.bytes_down:
            down = (now, now)
        elif bottleneck is None:
            down = device.down.serve(now, profile.download_s(work.bytes_down))
        else:
            seconds = profile.download_s(work.bytes_down)
            nic_down = self.nic_down.serve(now, work.bytes_down / bottleneck.dl_bw)
            down = _behind(nic_down, device.down, seconds, profile.dl_lat_s)
        changes = len(thermal.changes) if thermal is not None else 0
        compute, freq, temp = device.compute_after(down[1], work.shape)
        if thermal is not None and len(thermal.changes) > changes:
            for t, mhz, temp_c in thermal.changes[changes:]:
                self.log.write(Freq(device.id, t, mhz, temp_c))
        if not work.bytes_up:  # a rank's own tile: its output stays on the device
            up = (compute[1], compute[1])
        elif bottleneck is None:
            up = device.up.serve(compute[1], profile.upload_s(work.bytes_up))
        else:
            nic_up = self.nic_up.serve(compute[1], work.bytes_up / bottleneck.ul_bw)
            up = _behind(nic_up, device.up, profile.upload_s(work.bytes_up), profile.ul_lat_s)
        device.returns_at(up[1])
        return (down, compute, up), (freq, temp), (nic_down, nic_up)

    def _record(
        self,
        head: TileHead | None,
        device: VirtualDevice,
        work: Work,
        passage: _Passage,
        times: StepTimes,
    ) -> None:
        """A tile's passage, logged (``head``: ``EventLog.tile_head``; when the log keeps
        its step's totals, added to its device's in ``times``)."""
        stages, state, nic = passage
        self.log.tile(head, self._tiles, device.id, work, stages, state, nic)
        if times.totals:
            totals = times.devices.get(device.id)
            if totals is None:
                totals = times.devices[device.id] = DeviceTotals()
            totals.add(work, stages, state)

    def _returned(self, last: _Back[T]) -> None:
        self._finish(last.gemm, last)

    def _finish(self, gemm: _Gemm[T], last: _Back[T] | None) -> None:
        """The GEMM's last tile is back (``last``; None for an empty GEMM)."""
        job, task = gemm.job, gemm.task
        now = self.clock.now if last is None or not job.resident else last.time
        g = task.header
        back = None if last is None else (last.tile, last.device)
        shape = (g.m, g.n, g.k, g.batch)
        self.log.gemm(
            job.id, task.id, gemm.step, gemm.issue, now, len(gemm.tiles), back, shape, task.op
        )
        times = job.step  # its step: a step closes only once its GEMMs have ended
        if times is not None:
            times.gemm_s += now - gemm.issue
            times.product_s[task.op] = times.product_s.get(task.op, 0.0) + (now - gemm.issue)
            if last is not None:  # as the report sums a full log's, GEMM by GEMM
                for part, seconds in critical_breakdown(gemm.issue, *last.stages).items():
                    times.critical[part] += seconds
                if last.device in times.devices:
                    times.devices[last.device].last_in += 1
        gemm.done(gemm.issue, now)
        self._settle(job, task.id, gemm.seq, now, blocking=True)

    def _arrive(self, part: _Part) -> None:
        """A rank reached a collective; once its last member has, it starts when every
        member's links are done with the collectives each reached before it."""
        op = part.op
        parts = self._gathering.setdefault(op.key, {})
        for rank in part.job.ranks or (part.rank,):  # (its mirrors reach it with it)
            self._reached.setdefault(rank, deque()).append(op.key)
            parts[rank] = part
        if len(parts) == len(op.members) or self._droppable:  # (``drop``: or its last there)
            self._start_ready([op.key])

    def _start_ready(self, keys: list[tuple[object, ...]]) -> None:
        """Start each collective of ``keys`` whose members are all there and have started
        every collective they reached before it, and then those that waited on them: a
        member's links carry its collectives one at a time, in the order it reached them
        (the same on every run, whatever the order the ranks' messages came in)."""
        while keys:
            key = keys.pop()
            parts = self._gathering.get(key)
            if parts is None:
                continue
            op = next(iter(parts.values())).op
            taking = self._taking_part(op.members, parts)
            if taking is None:
                continue
            members, ready = taking  # ``ready``: its last member there
            # (a member that reached it and left since has no queue: it holds nothing up)
            queues = {r: q for r in members if (q := self._reached.get(r)) is not None}
            if any(q[0] != key for q in queues.values()):
                continue
            del self._gathering[key]
            nbytes = max(p.op.nbytes for p in parts.values())
            bottleneck = self.bottleneck.dl_bw if self.bottleneck is not None else math.inf
            start = max(ready, *(self._comm_free.get(r, 0.0) for r in members))
            while True:  # (``drop``: a member that leaves under way has it start again without it)
                root = op.members[op.root]
                root = members.index(root) if root in members else 0  # (it may be gone)
                links = [_link(self._member_device(rank)) for rank in members]
                seconds = collective_s(op.op, nbytes, links, root, bottleneck, self.algorithm)
                start, end = self._members_there(members, start, seconds)
                leaving = [
                    parts[r].job.drop_at for r in members if start < parts[r].job.drop_at < end
                ]
                if not leaving:
                    break
                start = max(leaving)
                members = [r for r in members if parts[r].job.drop_at > start]
            for rank, queue in queues.items():
                self._comm_free[rank] = end
                queue.popleft()
                if queue:
                    keys.append(queue[0])
            if len(members) < len(parts):  # (``drop``: those that reached it and left)
                kept = set(members)
                for job in {p.job.id: p.job for r, p in parts.items() if r not in kept}.values():
                    self._drop(job)
                keys += self._gathering  # (they hold up those they had not reached no more)
            jobs_parts = list({parts[r].job.id: parts[r] for r in members}.values())  # (mirrors)
            self.clock.at(end, self._collective_end, (jobs_parts, ready, start, end, len(members)))

    def _taking_part(
        self, members: Sequence[int], parts: Mapping[int, _Part]
    ) -> tuple[Sequence[int], float] | None:
        """The members that take part in a collective, and when the last of them is there;
        None while a member may still come. Without ``drop``, all of them, once all are
        there. Under ``drop``, a member dropped before it reached the collective holds the
        others until it leaves, and then takes no part, nor does one that reached it but
        leaves before it starts: it starts at the first time from which every member has
        either reached it or left."""
        if len(parts) == len(members) and not self._droppable:
            return members, max(p.at for p in parts.values())
        if len(parts) + len(self.ranks_dropped) < len(members):  # (one may yet come)
            return None
        gone = -math.inf  # when the last member that will not come left
        for rank in members:
            if rank not in parts:
                job = self._rank_jobs.get(rank)
                if job is None or not job.dropped:
                    return None
                gone = max(gone, job.drop_at)
        there = [(p.at, p.job.drop_at) for p in parts.values()]
        for t in sorted({gone, *(at for at, _ in there), *(d for _, d in there if d < math.inf)}):
            if t >= gone and all(at <= t for at, drop_at in there if drop_at > t):
                return [r for r in members if r in parts and parts[r].job.drop_at > t], t
        return None  # (no member left: nothing can start it)

    def _rank_leaves(self, job: _Job) -> None:
        """``job``'s work reached its ``drop_at``: it is dropped, and the collectives that
        waited for it start without it."""
        if self._drop(job):
            self._start_ready(list(self._gathering))

    def _drop(self, job: _Job) -> bool:
        """``job`` leaves the run at its ``drop_at`` (its work reached it, or a collective
        it reached starts after it): it does nothing more, and the collectives that waited
        for it may start without it (the caller starts them). False: it had left."""
        if job.dropped:
            return False
        job.dropped = True
        for rank in job.ranks:
            self.ranks_dropped[rank] = job.drop_at
            self._reached.pop(rank, None)
        log.info("%s leaves the run at %.6f s (--on-leave drop)", job.name, job.drop_at)
        return True

    def _members_there(self, members: Sequence[int], start: float, seconds: float) -> Span:
        """(start, end) of a collective of ``seconds`` from ``start``: once every member's
        device is there throughout (``_rank_span``: or pausing while one is away)."""
        if not self._rank_absences:
            return start, start + seconds
        jobs = list(
            {job.id: job for rank in members if (job := self._rank_jobs.get(rank))}.values()
        )
        for _ in range(WINDOW_TRIES):
            spans = [self._rank_span(job, start, seconds) for job in jobs]
            later = max((s for s, _ in spans), default=start)
            if later == start:
                return start, max((e for _, e in spans), default=start + seconds)
            start = later
        return start, start + seconds

    def _member_device(self, rank: int) -> VirtualDevice | None:
        mirror = self._mirror_devices.get(rank)
        if mirror is not None:
            return self.devices.get(mirror)
        job = self._rank_jobs.get(rank)
        return None if job is None or job.device is None else self.devices.get(job.device)

    def _collective_end(self, ended: tuple[list[_Part], float, float, float, int]) -> None:
        """Every member's part ends: logged, counted in its step (waiting for the other
        members; then on the network, queued behind earlier collectives included), settled.
        (``taking``: how many members took part.)"""
        parts, ready, start, now, taking = ended
        for part in parts:
            job = part.job
            times = job.step
            if times is not None:
                times.comm_s += now - ready
                times.comm_wait_s += ready - part.at
            op = part.op
            self.log.write(CollectivePart(job.id, part.request, part.step, op.op, op.nbytes,
                                          taking, part.at, start, now, ready))  # fmt: skip
            part.done(part.at, now)
            if self.jobs.get(job.id) is job:  # (a member that left has nothing to settle)
                self._settle(job, part.request, part.seq, now, blocking=op.blocking)

    def _settle(self, job: _Job, request_id: int, seq: int, now: float, *, blocking: bool) -> None:
        """Request ``request_id`` (submission ``seq``) of ``job`` ended at ``now``: what
        waited for it goes on, and once nothing is in flight, its step's end. A
        ``blocking`` one held the job, whose clock moves here; another ran beside its
        computing."""
        if blocking:
            job.clock = max(job.clock, now)
            job.waiting -= 1
        else:
            job.overlapped = max(job.overlapped, now)
        if job.latest.get(request_id) == seq:
            del job.latest[request_id]
        if job.ends.get(request_id, (0, 0.0))[0] < seq:  # not an earlier request of its id
            job.ends[request_id] = (seq, now)
            if len(job.ends) > ENDS_KEPT:
                del job.ends[next(iter(job.ends))]
        for action in job.inflight.pop(seq):
            action(now)
        if not job.inflight:
            barrier, job.barrier = job.barrier, []
            for action in barrier:
                action(max(job.clock, job.overlapped))


def _between(start: float, end: float, gaps: Sequence[Span]) -> Iterator[Span]:
    """[start, end) without ``gaps`` (in order, apart), as its non-empty spans."""
    for gap_start, gap_end in gaps:
        if gap_start >= end:
            break
        if gap_start > start:
            yield start, gap_start
        start = max(start, gap_end)
    if end > start:
        yield start, end


def _link(device: VirtualDevice | None) -> Link:
    """A member's links: its device's, or none (a job on no one device: the host's own)."""
    if device is None:
        return Link(0.0, math.inf, 0.0, math.inf)
    p = device.profile
    return Link(p.ul_lat_s, p.ul_bw, p.dl_lat_s, p.dl_bw)


def _anchor(x: Operand) -> Hashable:
    """What the timeline finds the devices holding ``x`` by: the matrix it is a block of
    (a holder may keep a block around it), or its key."""
    region = x.region
    return x.key if region is None else region[0]


def _gemm_shape(key: _GemmKey) -> GemmShape:
    """A GEMM tile's shape from its ``_WorkKey``."""
    rows, cols, lda, ldb, _, k, ta, tb, dtype = key
    # k = 0 (C is zeros) is costed as k = 1: the models start at one product
    return GemmShape(rows, cols, max(k, 1), ta, tb, lda, ldb, dtype)


def _behind(shared: Span, link: Fifo, seconds: float, latency: float) -> Span:
    """A transfer of ``seconds`` on ``link`` that also crossed the shared FIFO over
    ``shared``: it starts on the link once it starts there, and cannot end before the
    shared FIFO has passed its last byte (plus the link's latency)."""
    start, end = link.serve(shared[0], seconds)
    link.free_at = end = max(end, shared[1] + latency)
    return start, end

"""Read a run directory the engine wrote into a ``Run``: each step's and device's figures.

The engine logs every tile, GEMM, coordinator span, step, OOM and thermal step in virtual
time (``docs/REPORTS.md`` has the format and the definitions), for every step (``full``),
for each job's first steps and then each step's and each device's totals (``auto``), or
totals only (``steps``); the report leaves out, and says so, what needs tiles it lacks.

``load_run`` reads the log once, as a stream, and reduces each record as it comes to the
figures of its step and its device; it keeps the records themselves only for the steps
the reports show tile by tile (``StepRange``: by default each job's first
``DETAIL_WINDOW``), so a long run costs memory per step, not per tile. It checks the log as
a whole, not line by line only (``records`` checks each line): a contradiction is an error
naming the line.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from morphling.proxy.vtime.engine import Span
from morphling.proxy.vtime.eventlog import (
    COMPONENTS,
    GEMM_OP,
    RUN_FILE,
    STEP_TOTALS,
    CollectivePart,
    Coord,
    DeviceStep,
    Freq,
    Gemm,
    Oom,
    Record,
    Step,
    Tile,
    attribute,
    critical_breakdown,
)

from .records import (
    Device,
    Job,
    Meta,
    RunError,
    Verification,
    read_events,
    read_fleet,
    read_meta,
)

# The steps of each job the trace, timeline.png and the critical-path segments show by
# default: what one looks at, in files that stay small however long the run.
DETAIL_WINDOW = 50
# A device's lateness values are summed (math.fsum) into one past this many: its mean then
# costs memory per device, not per GEMM, for a rounding error per this many values.
LATENESS_KEPT = 4096
Sample = tuple[float, float | None, float | None]  # a device's (t, MHz, °C)
# A device's work in a step: (device, GEMM compute s, convolution compute s, link s, bytes
# down, bytes up, bytes saved).
DeviceWork = tuple[int, float, float, float, int, int, int]


@dataclass(frozen=True, slots=True)
class StepRange:
    """Steps ``first`` to ``last`` of each job, both included; None: unbounded."""

    first: int | None = None
    last: int | None = None

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """``A:B``, ``A:``, ``:B``, ``N`` or ``all``; ValueError saying what is wrong."""
        if text == "all":
            return cls()
        first, colon, last = text.partition(":")
        try:
            a = int(first) if first else None
            b = (int(last) if last else None) if colon else a
        except ValueError:
            a = b = -1
        if (a is None and not colon) or (a is not None and a < 0) or (b is not None and b < 0):
            raise ValueError(f"{text!r} is not A:B, A:, :B, N or all (step numbers >= 0)")
        if a is not None and b is not None and b < a:
            raise ValueError(f"{text!r} ends before it starts")
        return cls(a, b)

    def __contains__(self, step: int) -> bool:
        return (self.first is None or step >= self.first) and (
            self.last is None or step <= self.last
        )

    def __str__(self) -> str:
        if self.first is None and self.last is None:
            return "all"
        if self.first == self.last:
            return str(self.first)
        return (
            f"{'' if self.first is None else self.first}:{'' if self.last is None else self.last}"
        )


DEFAULT_DETAIL = StepRange(None, DETAIL_WINDOW)


# -- what the log reduces to -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepFigures:
    """One step of one job: from its tiles, GEMMs and coordinator spans where the log
    keeps them, else from its step record's totals. A step with no step record (the
    script stopped inside it) spans its logged events and is ``complete`` False."""

    job: int
    step: int
    complete: bool
    t0: float
    t1: float
    coord_s: float
    gemm_s: float
    gemms: int  # on the fleet (an empty GEMM, with no tiles, is not)
    local_gemms: int
    tiles: int
    bytes_down: int
    bytes_up: int
    bytes_saved: int  # operand bytes its devices held already (0: a log from before residency)
    bytes_bound: int  # the least its GEMMs' partitions send (0: a log from before the bound)
    oom: int
    critical: tuple[float, ...]  # its GEMMs' critical paths summed, as ``COMPONENTS``
    last_in: tuple[tuple[int, int], ...]  # (device, GEMMs whose critical tile it ran)
    detail: bool  # the log has its tiles, GEMMs and coordinator spans
    product_s: dict[str, float]  # ``gemm_s`` by the products' ``op``
    coord_split: dict[str, float]  # of ``coord_s``, by the job's op classes (the rest: unsplit)
    work: tuple[DeviceWork, ...]  # each device's that did any, by id


@dataclass(frozen=True, slots=True)
class DeviceFigures:
    """One device over the run. ``gemms``, ``expected_last``, ``lateness`` and
    ``last_in_detail`` are over the GEMMs of the steps whose tiles the log has."""

    tiles: int = 0
    busy_s: float = 0.0  # compute; a device's stages are FIFOs: its tiles' durations, summed
    conv_s: float = 0.0  # of ``busy_s``, convolutions' tiles
    down_s: float = 0.0
    up_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_saved: int = 0  # operand bytes it held already, which its link did not carry
    top_freq_mhz: float | None = None  # the highest frequency logged
    last_in: int = 0  # GEMMs whose critical tile it ran, every step
    gemms: int = 0  # GEMMs it took part in
    expected_last: float = 0.0  # sum of 1/participants over them
    lateness: float | None = None  # mean, over those it shared with another device
    last_in_detail: int = 0


@dataclass(frozen=True, slots=True)
class Run:
    """A loaded, checked run directory. Times are virtual seconds from the run's start.

    ``tiles``, ``gemms`` and ``coords`` are the records of the steps the reports show tile
    by tile (``shows``): those in ``window`` that the log has tiles for (``logged``)."""

    path: Path
    policy: str
    block: int
    auto_block: bool  # greedy chose each GEMM's tile edge, up to ``block``
    coordinator_time: str
    level: str  # ``EVENT_LEVELS`` but off
    logged: StepRange | None  # the steps whose tiles the log has (None: none)
    window: StepRange  # the steps asked for in detail
    bottleneck: dict[str, float] | None
    collective: str | None  # the ranks' collectives' algorithm, when the run says
    command: tuple[str, ...]
    fleet: tuple[Device, ...]
    jobs: tuple[Job, ...]
    steps: tuple[StepFigures, ...]  # every step, by job and step
    devices: dict[int, DeviceFigures]  # by id, those that did something
    thermal: dict[int, list[Sample]]  # by device with a thermal model, in time order
    nic_busy_s: Span  # the shared bottleneck's (down, up) busy seconds, from the tiles logged
    tiles: tuple[Tile, ...]
    gemms: tuple[Gemm, ...]
    coords: tuple[Coord, ...]
    ooms: tuple[Oom, ...]
    collectives: tuple[CollectivePart, ...]  # ranks' parts in them, of the steps in ``window``
    span_s: float  # the last thing that happened
    incomplete: str | None = None  # why the run ended early (SIGTERM, ...), None when it did not
    verification: Verification | None = None  # run.json's (None: an engine before it)
    # replay's: a timed rank's device → those of the ranks mirroring it, in ``devices``
    # and ``thermal`` with its figures (``Meta.mirrors``)
    mirrors: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def devices_of(self, tile: Tile) -> tuple[int, ...]:
        """The devices ``tile`` is the work of: its own, and those mirroring it."""
        return (tile.device, *self.mirrors.get(tile.device, ()))

    def shows(self, step: int) -> bool:
        """Whether the reports show this step tile by tile."""
        return step in self.window and self.logged is not None and step in self.logged

    @property
    def every_step_logged(self) -> bool:
        """The log has the tiles of every step (``full``; ``auto`` for a short run)."""
        return self.logged is not None and all(s.detail for s in self.steps)


def load_run(path: str | Path, detail: StepRange = DEFAULT_DETAIL) -> Run:
    """The run in directory ``path``, checked, with the records of the steps in ``detail``
    that the log has tiles for; RunError (a ValueError) says what is wrong."""
    root = Path(path)
    meta_file = root / RUN_FILE
    if not root.is_dir():
        raise RunError(f"{root}: not a directory")
    if not meta_file.is_file():
        raise RunError(f"{root} is not a Morphling run directory: it has no {RUN_FILE}")
    meta = read_meta(meta_file)
    if meta.level == "off":
        raise RunError(
            f"{root} was run with --events off: it has no event log to report on (run it "
            "with --events auto, full or steps for a report)"
        )
    events_file = root / meta.event_file
    if not events_file.is_file():
        raise RunError(f"{root} is not a complete run directory: it has no {events_file.name}")
    fleet, jobs = read_fleet(meta_file, meta)
    reader = _Reader(fleet, jobs, meta, detail)
    for line, record in read_events(events_file, meta):
        try:
            reader.add(line, record)
        except ValueError as exc:
            raise RunError(f"{events_file} {exc}") from exc
    try:
        return reader.run(root)
    except ValueError as exc:
        raise RunError(f"{events_file} {exc}") from exc


def logged_steps(meta: Meta) -> StepRange | None:
    """The steps of each job whose tiles a log at run.json's level has (None: none)."""
    if meta.level == "auto":
        return StepRange(None, meta.detail_steps)
    return StepRange() if meta.level == "full" else None


# -- reducing the records as they come -------------------------------------------------------

Segment = tuple[float, float, int]  # a GEMM's or a coordinator span's (start, end, line)


@dataclass(slots=True)
class _StepSums:
    """One step of one job, as its records come (in any order)."""

    record: Step | None = None
    line: int = 0  # its record's
    coord_s: float = 0.0
    coord_split: dict[str, float] = field(default_factory=dict)
    gemm_s: float = 0.0
    product_s: dict[str, float] = field(default_factory=dict)
    gemms: int = 0
    tiles: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    oom: int = 0
    critical: list[float] | None = None  # ``COMPONENTS``, summed over its GEMMs
    last_in: Counter[int] = field(default_factory=Counter)  # device → critical tiles
    t0: float = math.inf  # the span of its records: an unclosed step's
    t1: float = -math.inf
    first: Segment | None = None  # its GEMM or coordinator span that starts first
    last: Segment | None = None  # ... and the one that ends last
    devices: dict[int, int] | None = None  # device → the line of its device_step
    samples: dict[int, Sample] | None = None  # device → its last tile's state, when not shown
    # device → its compute, convolution compute, down and up seconds, and its bytes down, up
    # and saved, summed as a ``device_step`` sums them (so a ``steps`` log gives the same
    # figures to the bit)
    work: dict[int, list[float]] = field(default_factory=dict)

    def worked(
        self, device: int, seconds: tuple[float, float, float, float],
        nbytes: tuple[int, int, int],
    ) -> None:  # fmt: skip
        """A device's tile (or its step's tiles) in this step: its compute, convolution
        compute, down and up ``seconds``, and its bytes down, up and saved."""
        sums = self.work.get(device)
        if sums is None:
            self.work[device] = [*seconds, *nbytes]
            return
        sums[0] += seconds[0]
        sums[1] += seconds[1]
        sums[2] += seconds[2]
        sums[3] += seconds[3]
        sums[4] += nbytes[0]
        sums[5] += nbytes[1]
        sums[6] += nbytes[2]

    def spans(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = min(self.t0, t0), max(self.t1, t1)

    def segment(self, t0: float, t1: float, line: int) -> None:
        """A GEMM or coordinator span: it must lie inside the step."""
        self.spans(t0, t1)
        if self.first is None or t0 < self.first[0]:
            self.first = (t0, t1, line)
        if self.last is None or t1 > self.last[1]:
            self.last = (t0, t1, line)


@dataclass(slots=True)
class _DeviceSums:
    """One device, as its records come: ``DeviceFigures`` in the making."""

    tiles: int = 0
    busy_s: float = 0.0
    conv_s: float = 0.0
    down_s: float = 0.0
    up_s: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_saved: int = 0
    top: float | None = None
    last_in: int = 0
    gemms: int = 0
    expected_last: float = 0.0
    lateness: list[float] = field(default_factory=list)  # summed in part past LATENESS_KEPT
    late_gemms: int = 0
    last_in_detail: int = 0

    def frequency(self, mhz: float | None) -> None:
        if mhz is not None and (self.top is None or mhz > self.top):
            self.top = mhz

    def late(self, lateness: float) -> None:
        self.lateness.append(lateness)
        self.late_gemms += 1
        if len(self.lateness) > LATENESS_KEPT:
            self.lateness = [math.fsum(self.lateness)]

    def figures(self) -> DeviceFigures:
        mean = math.fsum(self.lateness) / self.late_gemms if self.late_gemms else None
        return DeviceFigures(
            tiles=self.tiles,
            busy_s=self.busy_s,
            conv_s=self.conv_s,
            down_s=self.down_s,
            up_s=self.up_s,
            bytes_down=self.bytes_down,
            bytes_up=self.bytes_up,
            bytes_saved=self.bytes_saved,
            top_freq_mhz=self.top,
            last_in=self.last_in,
            gemms=self.gemms,
            expected_last=self.expected_last,
            lateness=mean,
            last_in_detail=self.last_in_detail,
        )


@dataclass(slots=True)
class _GemmTiles:
    """A GEMM's record and its tiles, with their lines, kept until all have come (the
    engine logs the tiles first): its critical tile and every device's finish need them."""

    record: Gemm | None = None
    line: int = 0  # its record's
    tiles: dict[int, tuple[Tile, int]] = field(default_factory=dict)  # number → (tile, line)


class _Reader:
    """Reduces a log's records, given in any order, to a ``Run`` (see ``load_run``).

    Errors are ValueErrors starting ``line N:``. Each record is checked as it comes
    (its device and job exist, its step keeps tiles or totals as the level says, no step
    or device_step twice, no tile or GEMM twice while its GEMM is read), each GEMM once
    its tiles are in, each step at the end (its GEMMs and coordinator spans inside it, the
    steps of a job apart); GEMMs and coordinator spans are checked for overlaps among the
    records kept (the steps shown)."""

    def __init__(
        self, fleet: tuple[Device, ...], jobs: tuple[Job, ...], meta: Meta, window: StepRange
    ) -> None:
        self.fleet, self.jobs, self.meta = fleet, jobs, meta
        self.device_ids, self.job_ids = {d.id for d in fleet}, {j.id for j in jobs}
        self.logged, self.window = logged_steps(meta), window
        self.steps: dict[tuple[int, int], _StepSums] = {}
        self.devices: dict[int, _DeviceSums] = defaultdict(_DeviceSums)
        self.gemm_tiles: dict[tuple[int, int], _GemmTiles] = {}
        self.samples: dict[int, list[Sample]] = defaultdict(list)
        self.nic: tuple[list[Span], list[Span]] = ([], [])
        self.tiles: list[Tile] = []
        self.gemms: list[tuple[Gemm, int]] = []  # with their lines
        self.coords: list[tuple[Coord, int]] = []
        self.ooms: list[Oom] = []
        self.collectives: list[CollectivePart] = []
        self.span_s = 0.0

    def add(self, line: int, record: Record) -> None:
        """Reduce the record on this line."""
        match record:
            case Tile():
                self._tile(record, line)
            case Gemm():
                self._gemm(record, line)
            case Coord():
                self._coord(record, line)
            case Step():
                self._step(record, line)
            case DeviceStep():
                self._device_step(record, line)
            case Oom():
                self._oom(record, line)
            case Freq():
                self._freq(record, line)
            case CollectivePart():
                self._collective(record, line)

    # -- records ------------------------------------------------------------------------

    def _tile(self, t: Tile, line: int) -> None:
        self._known(line, job=t.job, device=t.device)
        if t.compute[0] < t.down[1] or t.up[0] < t.compute[1]:
            raise ValueError(
                f"line {line}: tile {t.tile} of gemm {t.gemm} is out of order: down {t.down}, "
                f"compute {t.compute}, up {t.up}"
            )
        shown = self._detailed(line, "tile", t.job, t.step)
        step = self._sums(t.job, t.step)
        step.tiles += 1
        step.bytes_down += t.bytes_down
        step.bytes_up += t.bytes_up
        step.spans(t.down[0], t.up[1])
        device = self.devices[t.device]
        device.tiles += 1
        device.bytes_down += t.bytes_down
        device.bytes_up += t.bytes_up
        device.bytes_saved += t.bytes_saved
        compute_s = t.compute[1] - t.compute[0]
        down_s, up_s = t.down[1] - t.down[0], t.up[1] - t.up[0]
        conv_s = 0.0 if t.op == GEMM_OP else compute_s
        device.busy_s += compute_s
        device.conv_s += conv_s
        device.down_s += down_s
        device.up_s += up_s
        step.worked(t.device, (compute_s, conv_s, down_s, up_s),
                    (t.bytes_down, t.bytes_up, t.bytes_saved))  # fmt: skip
        device.frequency(t.freq_mhz)
        if t.freq_mhz is not None or t.temp_c is not None:
            sample = (t.compute[0], t.freq_mhz, t.temp_c)
            if shown:  # every tile's state
                self.samples[t.device].append(sample)
            else:  # the step's last tile's, as a steps log has it
                step.samples = step.samples or {}
                if sample[0] >= step.samples.get(t.device, sample)[0]:
                    step.samples[t.device] = sample
        for nic, span in zip(self.nic, (t.nic_down, t.nic_up), strict=True):
            if span is not None:
                nic.append(span)
        mine = self.gemm_tiles.setdefault((t.job, t.gemm), _GemmTiles())
        if t.tile in mine.tiles:
            raise ValueError(f"line {line}: repeats the tile of line {mine.tiles[t.tile][1]}")
        mine.tiles[t.tile] = (t, line)
        if shown:
            self.tiles.append(t)
        self.span_s = max(self.span_s, t.up[1])
        self._gemm_done(t.job, t.gemm, mine)

    def _gemm(self, g: Gemm, line: int) -> None:
        self._known(line, job=g.job)
        if g.end < g.issue:
            raise ValueError(f"line {line}: gemm {g.gemm} ends at {g.end}, before its issue")
        shown = self._detailed(line, "gemm", g.job, g.step)
        step = self._sums(g.job, g.step)
        step.gemm_s += g.end - g.issue
        step.product_s[g.op] = step.product_s.get(g.op, 0.0) + (g.end - g.issue)
        if g.tiles:  # an empty GEMM (no output) is not on the fleet
            step.gemms += 1
        step.segment(g.issue, g.end, line)
        mine = self.gemm_tiles.setdefault((g.job, g.gemm), _GemmTiles())
        if mine.record is not None:
            raise ValueError(f"line {line}: repeats the gemm of line {mine.line}")
        mine.record, mine.line = g, line
        if shown:
            self.gemms.append((g, line))
        self.span_s = max(self.span_s, g.end)
        self._gemm_done(g.job, g.gemm, mine)

    def _coord(self, c: Coord, line: int) -> None:
        self._known(line, job=c.job)
        if c.t1 < c.t0:
            raise ValueError(f"line {line}: coord ends at {c.t1}, before it starts")
        shown = self._detailed(line, "coord", c.job, c.step)
        step = self._sums(c.job, c.step)
        step.coord_s += c.t1 - c.t0
        if c.split is not None:
            if not any(c.split.values()):
                raise ValueError(f"line {line}: coord split {c.split} has no time to share")
            for op, seconds in attribute(c.t1 - c.t0, c.split).items():
                step.coord_split[op] = step.coord_split.get(op, 0.0) + seconds
        step.segment(c.t0, c.t1, line)
        if shown:
            self.coords.append((c, line))
        self.span_s = max(self.span_s, c.t1)

    def _step(self, s: Step, line: int) -> None:
        self._known(line, job=s.job)
        if s.t1 < s.t0:
            raise ValueError(f"line {line}: step {s.step} ends at {s.t1}, before it starts")
        step = self._sums(s.job, s.step)
        if step.record is not None:
            raise ValueError(f"line {line}: repeats the step of line {step.line}")
        if not self._logs_tiles(s.step):
            missing = [name for name in STEP_TOTALS if getattr(s, name) is None]
            if missing:
                raise ValueError(
                    f"line {line}: step event: a step whose tiles the log does not keep needs "
                    f"its totals: missing {missing}"
                )
        step.record, step.line = s, line
        self.span_s = max(self.span_s, s.t1)

    def _device_step(self, d: DeviceStep, line: int) -> None:
        self._known(line, job=d.job, device=d.device)
        if self._logs_tiles(d.step):
            raise ValueError(
                f"line {line}: device_step of job {d.job} step {d.step}, whose tiles the log keeps"
            )
        step = self._sums(d.job, d.step)
        step.devices = step.devices or {}
        if d.device in step.devices:
            raise ValueError(
                f"line {line}: repeats the device_step of line {step.devices[d.device]}"
            )
        step.devices[d.device] = line
        step.last_in[d.device] += d.last_in
        device = self.devices[d.device]
        device.tiles += d.tiles
        device.bytes_down += d.bytes_down
        device.bytes_up += d.bytes_up
        device.bytes_saved += d.bytes_saved
        if d.conv_s > d.compute_s:
            raise ValueError(
                f"line {line}: device_step conv_s {d.conv_s} exceeds its compute_s {d.compute_s}"
            )
        device.busy_s += d.compute_s
        device.conv_s += d.conv_s
        device.down_s += d.down_s
        device.up_s += d.up_s
        step.worked(d.device, (d.compute_s, d.conv_s, d.down_s, d.up_s),
                    (d.bytes_down, d.bytes_up, d.bytes_saved))  # fmt: skip
        device.last_in += d.last_in
        device.frequency(d.freq_mhz)
        if d.freq_mhz is not None or d.temp_c is not None:  # its last tile's state
            self.samples[d.device].append((d.t, d.freq_mhz, d.temp_c))

    def _oom(self, o: Oom, line: int) -> None:
        self._known(line, job=o.job, device=o.device)
        step = self._sums(o.job, o.step)
        step.oom += 1
        step.spans(o.t, o.t)
        self.ooms.append(o)
        self.span_s = max(self.span_s, o.t)

    def _freq(self, f: Freq, line: int) -> None:
        self._known(line, device=f.device)
        self.devices[f.device].frequency(f.freq_mhz)
        self.samples[f.device].append((f.t, f.freq_mhz, f.temp_c))
        self.span_s = max(self.span_s, f.t)

    def _collective(self, c: CollectivePart, line: int) -> None:
        self._known(line, job=c.job)
        if not c.t <= c.ready <= c.start <= c.end:
            raise ValueError(
                f"line {line}: collective {c.request} of job {c.job} is out of order: reached "
                f"at {c.t}, its last member at {c.ready}, started at {c.start}, ended at {c.end}"
            )
        if c.step in self.window:
            self.collectives.append(c)
        self.span_s = max(self.span_s, c.end)

    # -- helpers ------------------------------------------------------------------------

    def _known(self, line: int, *, job: int | None = None, device: int | None = None) -> None:
        if device is not None and device not in self.device_ids:
            raise ValueError(f"line {line}: device {device} is not in run.json's fleet")
        if job is not None and job not in self.job_ids:
            raise ValueError(f"line {line}: job {job} is not in run.json's jobs")

    def _logs_tiles(self, step: int) -> bool:
        return self.logged is not None and step in self.logged

    def _detailed(self, line: int, kind: str, job: int, step: int) -> bool:
        """Whether the records of this step are kept (shown); an error where the log keeps
        only the step's totals."""
        if not self._logs_tiles(step):
            raise ValueError(
                f"line {line}: {kind} of job {job} step {step}, but a log at level "
                f"{self.meta.level} keeps tiles, GEMMs and coordinator spans for "
                f"{steps_text(self.logged)}"
            )
        return step in self.window

    def _sums(self, job: int, step: int) -> _StepSums:
        sums = self.steps.get((job, step))
        if sums is None:
            sums = self.steps[job, step] = _StepSums()
        return sums

    def _gemm_done(self, job: int, gemm: int, mine: _GemmTiles) -> None:
        if mine.record is not None and len(mine.tiles) >= mine.record.tiles:
            del self.gemm_tiles[job, gemm]
            self._settle(mine)

    def _settle(self, mine: _GemmTiles) -> None:
        """A GEMM whose record and tiles are in: its critical tile, its devices' finishes."""
        g, line = mine.record, mine.line
        assert g is not None
        if g.last_tile is None:  # empty: nothing ran
            return
        if g.last_tile not in mine.tiles:
            raise ValueError(f"line {line}: gemm {g.gemm}'s last_tile {g.last_tile} is not logged")
        last, last_line = mine.tiles[g.last_tile]
        if last.device != g.last_device or last.up[1] != g.end or last.down[0] < g.issue:
            raise ValueError(
                f"line {line}: gemm {g.gemm} (issue {g.issue}, end {g.end}, last_device "
                f"{g.last_device}) disagrees with its last tile on line {last_line}"
            )
        step = self.steps[g.job, g.step]
        step.critical = step.critical or [0.0] * len(COMPONENTS)
        breakdown = critical_breakdown(g.issue, last.down, last.compute, last.up)
        for i, seconds in enumerate(breakdown.values()):
            step.critical[i] += seconds
        step.last_in[last.device] += 1
        self.devices[last.device].last_in += 1
        self.devices[last.device].last_in_detail += 1
        finish: dict[int, float] = {}  # each device's last tile back
        for t, _ in mine.tiles.values():
            finish[t.device] = max(finish.get(t.device, 0.0), t.up[1])
        for device in finish:
            self.devices[device].gemms += 1
            self.devices[device].expected_last += 1 / len(finish)
        if len(finish) >= 2 and g.end > g.issue:
            median = statistics.median(finish.values())
            for device, t_back in finish.items():
                self.devices[device].late((t_back - median) / (g.end - g.issue))

    # -- the end ------------------------------------------------------------------------

    def run(self, root: Path) -> Run:
        """The run, once every record is in: the checks that need them all, the figures."""
        for mine in self.gemm_tiles.values():
            if mine.record is not None:  # fewer tiles than it says; those of a GEMM that
                self._settle(mine)  # never ended (the run stopped) have no record
        steps: dict[int, list[tuple[Span, int]]] = defaultdict(list)  # by job, with lines
        for (job, number), step in self.steps.items():
            if step.record is None:
                if step.devices:
                    raise ValueError(
                        f"line {min(step.devices.values())}: device_step of job {job} step "
                        f"{number}, which is not logged"
                    )
                continue
            steps[job].append(((step.record.t0, step.record.t1), step.line))
        kept: dict[int, list[tuple[Span, int]]] = defaultdict(list)
        segments: list[tuple[Gemm | Coord, int]] = [*self.gemms, *self.coords]
        for e, line in segments:
            kept[e.job].append((segment_span(e), line))
        for job in self.job_ids:
            _no_overlap(steps[job], "step")
            _no_overlap(kept[job], "gemm or coord")
        for (_, number), step in self.steps.items():
            s = step.record
            for span in (step.first, step.last):
                if s is not None and span is not None and not s.t0 <= span[0] <= span[1] <= s.t1:
                    raise ValueError(
                        f"line {span[2]}: {span[:2]} lies outside step {number} "
                        f"{s.t0, s.t1} (line {step.line})"
                    )
            for device, sample in (step.samples or {}).items():
                self.samples[device].append(sample)
        meta = self.meta
        devices = {d: sums.figures() for d, sums in sorted(self.devices.items())}
        thermal = {d: sorted(s, key=lambda x: x[0]) for d, s in sorted(self.samples.items())}
        for timed, mirrors in meta.mirrors.items():  # (they have its times: replay.py)
            if timed in devices:
                devices.update(dict.fromkeys(mirrors, devices[timed]))
            if timed in thermal:
                thermal.update(dict.fromkeys(mirrors, thermal[timed]))
        return Run(
            path=root,
            policy=meta.policy,
            block=meta.block,
            auto_block=meta.auto_block,
            coordinator_time=meta.coordinator_time,
            level=meta.level,
            logged=self.logged,
            window=self.window,
            bottleneck=meta.bottleneck,
            collective=meta.collective,
            command=meta.command,
            fleet=self.fleet,
            jobs=self.jobs,
            steps=tuple(self._figures(key, self.steps[key]) for key in sorted(self.steps)),
            devices=devices,
            thermal=thermal,
            nic_busy_s=(union_s(self.nic[0]), union_s(self.nic[1])),
            tiles=tuple(self.tiles),
            gemms=tuple(g for g, _ in self.gemms),
            coords=tuple(c for c, _ in self.coords),
            ooms=tuple(self.ooms),
            collectives=tuple(self.collectives),
            span_s=self.span_s,
            incomplete=meta.incomplete,
            verification=meta.verification,
            mirrors=meta.mirrors,
        )

    def _figures(self, key: tuple[int, int], sums: _StepSums) -> StepFigures:
        """A step's figures: from its records where the log has them (and for a step never
        closed, from what it logged), else from its step record's totals."""
        job, number = key
        s, detail = sums.record, self._logs_tiles(number)
        last_in = tuple((d, n) for d, n in sums.last_in.most_common() if n)
        t0, t1, local = (sums.t0, sums.t1, 0) if s is None else (s.t0, s.t1, s.local_gemms)
        work = tuple(
            (d, compute - conv, conv, down + up, int(sent), int(back), int(held))
            for d, (compute, conv, down, up, sent, back, held) in sorted(sums.work.items())
        )
        if s is None or detail:
            return StepFigures(
                job,
                number,
                s is not None,
                t0,
                t1,
                sums.coord_s,
                sums.gemm_s,
                sums.gemms,
                local,
                sums.tiles,
                sums.bytes_down,
                sums.bytes_up,
                # (a step never closed: what its tiles held, as its devices' sums have it)
                (s.bytes_saved or 0) if s is not None else sum(w[6] for w in work),
                (s.bytes_bound or 0) if s is not None else 0,
                sums.oom,
                tuple(sums.critical or [0.0] * len(COMPONENTS)),
                last_in,
                detail,
                sums.product_s,
                sums.coord_split,
                work,
            )
        # a step without its tiles has its totals (``_step``)
        assert s.coord_s is not None and s.gemm_s is not None and s.tiles is not None
        assert s.bytes_down is not None and s.bytes_up is not None
        critical = tuple(getattr(s, c) for c in COMPONENTS)
        return StepFigures(
            job,
            number,
            True,
            t0,
            t1,
            s.coord_s,
            s.gemm_s,
            s.gemms,
            local,
            s.tiles,
            s.bytes_down,
            s.bytes_up,
            s.bytes_saved or 0,
            s.bytes_bound or 0,
            sums.oom,
            critical,
            last_in,
            False,
            # (a log written before convolutions: every product was a GEMM)
            s.product_s if s.product_s is not None else {GEMM_OP: s.gemm_s},
            s.coord_split or {},
            work,
        )


def segment_span(e: Gemm | Coord) -> Span:
    """A GEMM's or a coordinator span's (start, end)."""
    return (e.issue, e.end) if isinstance(e, Gemm) else (e.t0, e.t1)


def _no_overlap(spans: list[tuple[Span, int]], what: str) -> None:
    """One job does one thing at a time: its steps, and its GEMMs and coordinator spans
    (each with its line)."""
    ordered = sorted(spans, key=lambda s: s[0])
    for (before, line_before), (after, line) in itertools.pairwise(ordered):
        if after[0] < before[1]:
            raise ValueError(
                f"line {line}: {what} {after} overlaps line {line_before}'s {before} of the "
                "same job"
            )


def steps_text(steps: StepRange | None) -> str:
    """A range of steps in words: 'every step', 'steps 1-50', 'steps up to 1000'."""
    if steps is None:
        return "no step"
    first, last = steps.first, steps.last
    if first is None and last is None:
        return "every step"
    if first == last:
        return f"step {first}"
    if first is None:
        return f"steps up to {last}"
    return f"steps from {first}" if last is None else f"steps {first}-{last}"


def union_s(intervals: Iterable[Span]) -> float:
    """Seconds covered by at least one interval: a FIFO's busy time."""
    total, end = 0.0, -math.inf
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total

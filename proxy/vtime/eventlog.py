"""The event log's format and its writer: what the engine records of a run, and how.

The engine (``timeline``) writes it and ``report`` reads it, so what both must agree on
lives here, with the engine: the files, the levels, the critical-path components of a
GEMM (which the engine sums per step and the report derives from a GEMM's last tile), the
records themselves (one dataclass per kind: its fields and their types, which the writer
writes and the report's reader checks and builds), and ``EventLog``, which formats and
hashes the lines. ``docs/REPORTS.md`` has the format.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .engine import Span

if TYPE_CHECKING:  # the report imports this module: it need not load the device models
    from .vdevice import Work

RUN_FILE, EVENTS_FILE = "run.json", "events.jsonl"
RUN_FORMAT = "morphling-run"  # run.json's "format"; older runs lack it
# The critical tile of a GEMM, from issue to its result back: these sum to the GEMM's time.
COMPONENTS = (
    "link_queue_s",
    "download_s",
    "compute_queue_s",
    "compute_s",
    "upload_queue_s",
    "upload_s",
)
COMPRESSED_EVENTS_FILE = EVENTS_FILE + ".gz"  # what the engine writes; older runs: EVENTS_FILE
# What the engine logs: every record of each job's first ``DETAIL_STEPS`` steps and the
# totals of the others; every record; each step's and each device's totals per step; nothing.
EVENT_LEVELS = ("auto", "full", "steps", "off")
# With ``auto``: enough steps for the trace, the timeline and the stragglers of a run's
# start, a bounded log however long the run (docs/REPORTS.md has the sizes).
DETAIL_STEPS = 1000
# What a step record carries beside its times: what stands for its tiles, GEMMs and
# coordinator spans where the log does not keep them.
STEP_TOTALS = ("tiles", "coord_s", "gemm_s", "bytes_down", "bytes_up", *COMPONENTS)
# gzip's fastest level: the engine writes a line per tile, and higher levels cost several
# times the time of formatting the line for a fifth less size (docs/REPORTS.md).
COMPRESS_LEVEL = 1
WRITE_BUFFER = 1 << 16  # bytes gathered before each compression call

# What a tile's or a GEMM record's work was (``op``): a GEMM, or a convolution's product,
# ``conv_op(kind)``. Logs written before convolutions have none: every record was a GEMM.
GEMM_OP = "gemm"


def conv_op(kind: str) -> str:
    """The ``op`` of a convolution's records: ``conv_`` and its kind (``CONV_KINDS``)."""
    return f"conv_{kind}"


def attribute(seconds: float, split: Mapping[str, int]) -> dict[str, float]:
    """``seconds`` of coordinator time divided among op classes in proportion to the job's
    ``split`` (op class → nanoseconds, not all 0): its interval may have been cut at the
    step's start, or moved later, so the shares are what the split gives. The engine sums
    these per step, as the report does from a log's coordinator spans: one expression, so
    the two agree to the bit."""
    total = sum(split.values())
    return {op: seconds * ns / total for op, ns in split.items() if ns}


Stages = tuple[Span, Span, Span]  # a tile's down, compute and up
TileHead = tuple[str, str]  # the start and the end of a request's tile records (``tile_head``)
NicSpans = tuple[Span | None, Span | None]  # its down and up on the shared bottleneck


def critical_breakdown(issue: float, down: Span, compute: Span, up: Span) -> dict[str, float]:
    """Where a GEMM's time went, following its last tile (its stages ``down``, ``compute``,
    ``up``) from the GEMM's issue to its end. The engine sums these per step for its step
    records, as the report does from a log's tiles."""
    return {
        "link_queue_s": down[0] - issue,
        "download_s": down[1] - down[0],
        "compute_queue_s": compute[0] - down[1],
        "compute_s": compute[1] - compute[0],
        "upload_queue_s": up[0] - compute[1],
        "upload_s": up[1] - up[0],
    }


# -- the records, one class per kind (``KINDS``) ------------------------------------------
# A field with a default may be absent from a line (older engines, or nothing to say): the
# writer leaves it out when it has that value.


@dataclass(frozen=True, slots=True)
class Tile:
    """One tile's passage: its occupancy (start, end) of its device's downlink FIFO
    (latency included; ``[t, t]`` when every operand was resident), compute queue and
    uplink FIFO, and of the shared bottleneck's (``nic_*``) when the run has one; the
    device's clock and temperature for it (None without a thermal model)."""

    job: int
    gemm: int
    step: int
    tile: int
    device: int
    bytes_down: int
    bytes_up: int
    down: Span
    compute: Span
    up: Span
    freq_mhz: float | None
    temp_c: float | None
    nic_down: Span | None = None  # None: no bottleneck, or nothing crossed it
    nic_up: Span | None = None
    bytes_saved: int = 0  # operand bytes its device held already, not in ``bytes_down``
    op: str = GEMM_OP  # what the tile computed (a convolution's: ``conv_op``)


@dataclass(frozen=True, slots=True)
class Gemm:
    """One GEMM: issued at ``issue``, over when its tile ``last_tile`` (its critical tile,
    on ``last_device``) is back. None for both: an empty GEMM, with no tiles. A convolution
    (``op``, ``conv_op``) is one too: ``m``, ``n``, ``k`` are its implicit GEMM's."""

    job: int
    gemm: int
    step: int
    issue: float
    end: float
    tiles: int
    last_tile: int | None
    last_device: int | None
    m: int
    n: int
    k: int
    batch: int
    op: str = GEMM_OP


@dataclass(frozen=True, slots=True)
class Coord:
    """Time the script spent on the host between GEMMs (coordinator time); ``split``: what
    it did then, op class → the job's nanoseconds (``attribute`` makes them seconds of
    this span). None: not said (measured time, or logs written before the split)."""

    job: int
    step: int
    t0: float
    t1: float
    split: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """A closed training step and its totals (``STEP_TOTALS``): what stands for its tiles,
    GEMMs and coordinator spans where the log does not keep them (older engines did not
    write them)."""

    job: int
    step: int
    t0: float
    t1: float
    gemms: int
    local_gemms: int
    tiles: int | None = None
    coord_s: float | None = None
    coord_split: dict[str, float] | None = None  # of ``coord_s``, by op class (None: none)
    oom: int | None = None
    gemm_s: float | None = None
    # of ``gemm_s``, by ``op``; None: all GEMMs (or a log without steps' totals)
    product_s: dict[str, float] | None = None
    bytes_down: int | None = None
    bytes_up: int | None = None
    bytes_saved: int | None = None  # operand bytes its devices held already (None: older logs)
    # the least its GEMMs' partitions send: each device's distinct operand blocks, once
    bytes_bound: int | None = None
    link_queue_s: float | None = None
    download_s: float | None = None
    compute_queue_s: float | None = None
    compute_s: float | None = None
    upload_queue_s: float | None = None
    upload_s: float | None = None
    # its rank's collectives: their time on the network, and the time it waited for the
    # other members to reach them (None: a job that is no rank, or a log from before ranks)
    comm_s: float | None = None
    comm_wait_s: float | None = None
    # its tiles placed again because their device left (availability), and the time their
    # passages had run by then (None: none, or a log from before availability)
    interruptions: int | None = None
    lost_s: float | None = None


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """A device's tiles of one step, summed (for a step whose tiles the log does not keep),
    and its state at the compute start ``t`` of the last of them."""

    job: int
    step: int
    device: int
    tiles: int
    bytes_down: int
    bytes_up: int
    down_s: float
    compute_s: float
    up_s: float
    last_in: int  # the step's GEMMs whose critical tile it ran
    t: float
    freq_mhz: float | None
    temp_c: float | None
    conv_s: float = 0.0  # of ``compute_s``, convolutions' tiles (older logs: none)
    bytes_saved: int = 0  # operand bytes the device held already (older logs: none)


@dataclass(frozen=True, slots=True)
class Oom:
    """A tile that did not fit its device's declared memory: an emulated OOM."""

    job: int
    gemm: int
    step: int
    tile: int
    device: int
    t: float
    need_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class CollectivePart:
    """A rank's part in a collective: when it reached it (``t``), when its last member
    had (``ready``), when it started on the network (once the members' links were done
    with their earlier collectives) and ended."""

    job: int
    request: int
    step: int
    op: str
    nbytes: int
    members: int
    t: float
    start: float
    end: float
    ready: float


@dataclass(frozen=True, slots=True)
class Freq:
    """A device's thermal frequency change."""

    device: int
    t: float
    freq_mhz: float | None
    temp_c: float | None


@dataclass(frozen=True, slots=True)
class Away:
    """A device left at ``t0`` (its availability) and is back at ``t1`` (None: never);
    ``tiles`` of its tiles were placed again, ``lost_s`` the time their passages had run."""

    device: int
    t0: float
    t1: float | None
    tiles: int
    lost_s: float


Record = Tile | Gemm | Coord | Step | DeviceStep | Oom | Freq | CollectivePart | Away
# Each kind by its ``ev``, the name a line carries.
KINDS: dict[str, type[Record]] = {
    "tile": Tile,
    "gemm": Gemm,
    "coord": Coord,
    "step": Step,
    "device_step": DeviceStep,
    "oom": Oom,
    "freq": Freq,
    "collective": CollectivePart,
    "away": Away,
}
_EV = {kind: ev for ev, kind in KINDS.items()}
# Each kind's fields, in order, with their default (``MISSING``: required).
_FIELDS = {kind: [(f.name, f.default) for f in fields(kind)] for kind in KINDS.values()}


def to_json(record: Record) -> dict[str, object]:
    """The line's object for ``record``: its ``ev``, then its fields in order, less those
    at their default."""
    obj: dict[str, object] = {"ev": _EV[type(record)]}
    for name, default in _FIELDS[type(record)]:
        value = getattr(record, name)
        if default is MISSING or value != default:
            obj[name] = value
    return obj


class EventLog:
    """The timeline's records, one JSON object per line, hashed as written.

    ``level`` (``EVENT_LEVELS``) says which records are kept: ``full``, every one;
    ``steps``, those of steps, devices' totals per step, OOMs and frequency changes;
    ``auto``, every one of each job's first ``detail_steps`` steps and, of later steps, what
    ``steps`` keeps; ``off``, none. ``detail`` says which steps keep their tiles, GEMMs and
    coordinator spans; ``Timeline`` writes the devices' totals of the others. The hash of
    the lines kept is what the determinism tests compare and run.json records; ``sink`` (a
    binary file: the server's is compressed) is what ``morphling report`` reads.
    """

    def __init__(
        self,
        sink: IO[bytes] | None = None,
        *,
        level: str = "full",
        detail_steps: int = DETAIL_STEPS,
    ) -> None:
        if level not in EVENT_LEVELS:
            raise ValueError(f"event log level {level!r}: one of {', '.join(EVENT_LEVELS)}")
        if detail_steps < 1:
            raise ValueError(f"event log detail_steps {detail_steps}: must be >= 1")
        self.sink = sink
        self.level = level
        self.detail_steps = detail_steps
        self.steps = level != "off"  # step, device_step, OOM and frequency records
        self.count = 0  # lines written
        self.records = 0  # records offered, kept or not: how far the timeline has got
        self._hash = hashlib.sha256()
        # texts ``tile`` made already (see there)
        self._levels: dict[float | None, str] = {None: "null"}  # clock levels
        self._ends: dict[int, tuple[float, str]] = {}  # device → its last download's end
        self._start: tuple[float | None, str] = (None, "")  # the last new download start

    def detail(self, step: int) -> bool:
        """Whether a job's ``step``-th step keeps its tile, GEMM and coordinator records
        (else the step's and its devices' totals stand for them, as at ``steps``)."""
        return self.level == "full" or (self.level == "auto" and step <= self.detail_steps)

    def write(self, record: Record) -> None:
        """A record kept at the ``steps`` level and above, as ``to_json`` has it."""
        self.records += 1
        if self.steps:
            self._line(json.dumps(to_json(record), separators=(",", ":")))

    def tile_head(self, job: int, gemm: int, step: int, op: str = GEMM_OP) -> TileHead | None:
        """The start and the end of the records of a request's tiles, for ``tile``: the
        fields they share; None when their step keeps no tile records."""
        if not self.detail(step):
            return None
        end = "}" if op == GEMM_OP else f',"op":{json.dumps(op)}}}'
        return f'{{"ev":"tile","job":{job},"gemm":{gemm},"step":{step},', end

    def tile(
        self,
        head: TileHead | None,
        seq: int,
        device: int,
        work: Work,
        stages: Stages,
        state: tuple[float | None, float | None],
        nic: NicSpans = (None, None),
    ) -> None:
        """A ``Tile`` record (its stages down, compute and up; its device's MHz and °C; its
        spans on the shared bottleneck, ``nic``), formatted by hand: there is one per tile,
        and ``json.dumps`` would be a third of the engine's time. The same JSON ``write``
        would give.

        ``repr`` of the times is most of what is left, so a time written already is not
        formatted again. A stage that starts when the one before it ends starts at that
        very float object (``Fifo.serve`` returns it), and so does a download that starts
        when the device's last one ended, or at the time the GEMM's other downloads
        started; matched by identity, the text is the one ``repr`` gives. Clock levels and
        the fields a GEMM's tiles share (``head``, from ``tile_head``) are written once too."""
        self.records += 1
        if head is None:
            return
        (down0, down1), (compute0, compute1), (up0, up1) = stages
        freq, temp = state
        end = self._ends.get(device)
        if end is not None and end[0] is down0:
            down_start = end[1]
        elif self._start[0] is down0:
            down_start = self._start[1]
        else:
            down_start = repr(down0)
            self._start = (down0, down_start)
        down_end, compute_end = repr(down1), repr(compute1)
        self._ends[device] = (down1, down_end)
        compute_start = down_end if compute0 is down1 else repr(compute0)
        up_start = compute_end if up0 is compute1 else repr(up0)
        mhz = self._levels.get(freq)
        if mhz is None:
            mhz = self._levels[freq] = repr(freq)
        nic_down, nic_up = nic
        saved = f',"bytes_saved":{work.bytes_saved}' if work.bytes_saved else ""
        shared = "" if nic_down is None else f',"nic_down":[{nic_down[0]!r},{nic_down[1]!r}]'
        if nic_up is not None:
            shared += f',"nic_up":[{nic_up[0]!r},{nic_up[1]!r}]'
        self._line(
            f'{head[0]}"tile":{seq},"device":{device},"bytes_down":{work.bytes_down},'
            f'"bytes_up":{work.bytes_up},"down":[{down_start},{down_end}],'
            f'"compute":[{compute_start},{compute_end}],"up":[{up_start},{up1!r}],'
            f'"freq_mhz":{mhz},"temp_c":{"null" if temp is None else repr(temp)}'
            f"{shared}{saved}{head[1]}"
        )

    def coord(
        self, job: int, step: int, t0: float, t1: float, split: Mapping[str, int] | None = None
    ) -> None:
        """A ``Coord`` record, formatted by hand as ``tile``'s (one per GEMM)."""
        self.records += 1
        if self.detail(step):
            end = "}" if split is None else f',"split":{json.dumps(split, separators=(",", ":"))}}}'
            self._line(f'{{"ev":"coord","job":{job},"step":{step},"t0":{t0!r},"t1":{t1!r}{end}')

    def gemm(
        self,
        job: int,
        gemm: int,
        step: int,
        issue: float,
        end: float,
        tiles: int,
        last: tuple[int, int] | None,
        shape: tuple[int, int, int, int],
        op: str = GEMM_OP,
    ) -> None:
        """A ``Gemm`` record, formatted by hand as ``tile``'s (one per GEMM): its issue and
        end, and the tile back last and its device (``last``; None for an empty GEMM)."""
        self.records += 1
        if not self.detail(step):
            return
        last_tile, last_device = ("null", "null") if last is None else last
        m, n, k, batch = shape
        self._line(
            f'{{"ev":"gemm","job":{job},"gemm":{gemm},"step":{step},"issue":{issue!r},'
            f'"end":{end!r},"tiles":{tiles},"last_tile":{last_tile},'
            f'"last_device":{last_device},"m":{m},"n":{n},"k":{k},"batch":{batch}'
            + ("}" if op == GEMM_OP else f',"op":{json.dumps(op)}}}')
        )

    def digest(self) -> str:
        """The sha256 of the lines kept, uncompressed."""
        return self._hash.hexdigest()

    def _line(self, text: str) -> None:
        line = (text + "\n").encode()
        self._hash.update(line)
        self.count += 1
        if self.sink is not None:
            self.sink.write(line)


def open_event_file(path: Path) -> IO[bytes]:
    """A gzip stream for an ``EventLog``'s lines, in memory only its buffer and the
    compressor's window. Modification time 0: the same run gives the same bytes."""
    return io.BufferedWriter(gzip.GzipFile(path, "wb", COMPRESS_LEVEL, mtime=0), WRITE_BUFFER)

"""The event log's format and its writer: what the engine records of a run, and how.

The engine (``timeline``) writes it and ``report`` reads it, so the names both must agree
on live here, with the engine: the files, the levels, the critical-path components of a
GEMM (which the engine sums per step and the report derives from a GEMM's last tile), and
``EventLog``, which formats and hashes the lines. ``docs/REPORTS.md`` has the format.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the report imports this module: it need not load the engine
    from .engine import Span
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

    def __init__(self, sink: IO[bytes] | None = None, *, level: str = "full",
                 detail_steps: int = DETAIL_STEPS) -> None:  # fmt: skip
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

    def write(self, record: dict[str, Any]) -> None:
        """A record kept at the ``steps`` level and above."""
        self.records += 1
        if self.steps:
            self._line(json.dumps(record, separators=(",", ":")))

    def tile_head(self, job: int, gemm: int, step: int) -> str | None:
        """The start of the records of a GEMM's tiles, for ``tile``: the fields they share;
        None when their step keeps no tile records."""
        if not self.detail(step):
            return None
        return f'{{"ev":"tile","job":{job},"gemm":{gemm},"step":{step},'

    def tile(self, head: str | None, seq: int, device: int, work: Work, down: Span, compute: Span,
             up: Span, freq: float | None, temp: float | None) -> None:  # fmt: skip
        """A tile record, formatted by hand: there is one per tile, and ``json.dumps``
        would be a third of the engine's time. The same JSON ``write`` would give.

        ``repr`` of the times is most of what is left, so a time written already is not
        formatted again. A stage that starts when the one before it ends starts at that
        very float object (``Fifo.serve`` returns it), and so does a download that starts
        when the device's last one ended, or at the time the GEMM's other downloads
        started; matched by identity, the text is the one ``repr`` gives. Clock levels and
        the fields a GEMM's tiles share (``head``, from ``tile_head``) are written once too."""
        self.records += 1
        if head is None:
            return
        (down0, down1), (compute0, compute1), (up0, up1) = down, compute, up
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
        self._line(
            f'{head}"tile":{seq},"device":{device},"bytes_down":{work.bytes_down},'
            f'"bytes_up":{work.bytes_up},"down":[{down_start},{down_end}],'
            f'"compute":[{compute_start},{compute_end}],"up":[{up_start},{up1!r}],'
            f'"freq_mhz":{mhz},"temp_c":{"null" if temp is None else repr(temp)}}}'
        )

    def coord(self, job: int, step: int, t0: float, t1: float) -> None:
        """A coordinator-time record, formatted by hand as ``tile``'s (one per GEMM)."""
        self.records += 1
        if self.detail(step):
            self._line(f'{{"ev":"coord","job":{job},"step":{step},"t0":{t0!r},"t1":{t1!r}}}')

    def gemm(self, job: int, gemm: int, step: int, issue: float, end: float, tiles: int,
             last: tuple[int, int] | None, shape: tuple[int, int, int, int]) -> None:  # fmt: skip
        """A GEMM's record, formatted by hand as ``tile``'s (one per GEMM): its issue and
        end, and the tile back last and its device (``last``; None for an empty GEMM)."""
        self.records += 1
        if not self.detail(step):
            return
        last_tile, last_device = ("null", "null") if last is None else last
        m, n, k, batch = shape
        self._line(
            f'{{"ev":"gemm","job":{job},"gemm":{gemm},"step":{step},"issue":{issue!r},'
            f'"end":{end!r},"tiles":{tiles},"last_tile":{last_tile},'
            f'"last_device":{last_device},"m":{m},"n":{n},"k":{k},"batch":{batch}}}'
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

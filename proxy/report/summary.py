"""The shape of a run's summary (``summary.json``): one typed dict per JSON object.

``analysis.summarize`` builds it; the text, the plots and ``morphling sweep`` read it.
``docs/REPORTS.md`` says what each field means; the keys here are in the order written.
"""

from __future__ import annotations

from typing import Literal, TypedDict

# The figures a step has that its job's and the run's totals sum.
Summed = Literal[
    "emulated_s",
    "coordinator_s",
    "gemm_s",
    "gemms",
    "local_gemms",
    "tiles",
    "bytes_down",
    "bytes_up",
    "oom",
]


class Sums(TypedDict):
    emulated_s: float
    coordinator_s: float
    gemm_s: float
    gemms: int
    local_gemms: int
    tiles: int
    bytes_down: int
    bytes_up: int
    oom: int


# A step of the critical path: a coordinator span, or a GEMM followed along its critical
# tile (its device, and ``eventlog.COMPONENTS``' seconds).
PathSegment = dict[str, str | int | float]


class CriticalPath(TypedDict):
    breakdown: dict[str, float]  # ``analysis.BREAKDOWN``'s seconds
    devices: dict[str, int]  # device name → the step's GEMMs whose critical tile it ran
    segments: list[PathSegment] | None  # None: a step not shown tile by tile


class StepRow(Sums):
    job: int
    step: int
    complete: bool
    t0: float
    t1: float
    critical_path: CriticalPath


class JobRow(Sums):
    id: int
    name: str
    steps: list[StepRow]


class Totals(Sums):
    span_s: float
    steps: int
    devices: int
    mean_utilisation: float


class DeviceRow(TypedDict):
    id: int
    name: str
    profile: str
    kind: str
    tiles: int
    busy_s: float
    utilisation: float
    downlink_utilisation: float
    uplink_utilisation: float
    bytes_down: int
    bytes_up: int
    final_temp_c: float | None
    top_freq_mhz: float | None
    below_top_s: float | None
    gemms: int | None  # None: from a log without tiles
    last_in: int
    expected_last: float | None
    lateness: float | None


class Straggler(TypedDict):
    id: int
    name: str
    lateness: float
    gemms: int
    last_in: int
    expected_last: float


class Stragglers(TypedDict):
    definition: str
    threshold: float
    devices: list[Straggler] | None  # None: a steps log has no device's finish in a GEMM


class OomRow(TypedDict):
    job: int
    step: int
    gemm: int
    tile: int
    device: int
    device_name: str
    t: float
    need_bytes: int
    capacity_bytes: int


class Ooms(TypedDict):
    count: int
    events: list[OomRow]


class Shown(TypedDict):
    """A job's steps that the trace, the timeline and the segments show."""

    job: int
    first: int
    last: int
    steps: int


class Detail(TypedDict):
    logged: str | None  # ``load.StepRange`` as text; None: no step
    every_step_logged: bool
    window: str
    shown: list[Shown]
    others: str


class Bottleneck(TypedDict):
    parameters: dict[str, float]
    downlink_utilisation: float | None  # None: the log lacks the tiles of some steps
    uplink_utilisation: float | None


class RunInfo(TypedDict):
    path: str
    policy: str
    block: int
    coordinator_time: str
    event_log: str
    detail: Detail
    bottleneck: Bottleneck | None
    command: list[str]
    incomplete: str | None


class Summary(TypedDict):
    version: int
    run: RunInfo
    totals: Totals
    jobs: list[JobRow]
    devices: list[DeviceRow]
    stragglers: Stragglers
    ooms: Ooms

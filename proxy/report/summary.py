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


# A step of the critical path: a coordinator span (with its op classes' seconds, when the
# job split it), or a GEMM or convolution product (``op``) followed along its critical
# tile (its device, and ``eventlog.COMPONENTS``' seconds).
PathSegment = dict[str, str | int | float | dict[str, float]]


class ByClass(TypedDict):
    """Time by op class: the products on the fleet (issue to end), and the coordinator's
    time by the classes its job gave (``unclassified_s``: time it did not split)."""

    fleet_gemm_s: float
    fleet_conv_s: float
    coordinator_gemm_s: float
    coordinator_conv_s: float
    coordinator_other_s: float
    coordinator_unclassified_s: float


class Ops(TypedDict):
    """The fine classes: the products' ``op`` and the coordinator's op classes, seconds."""

    fleet: dict[str, float]
    coordinator: dict[str, float]


class CriticalPath(TypedDict):
    breakdown: dict[str, float]  # ``analysis.BREAKDOWN``'s seconds
    by_class: dict[str, float]  # ``ByClass`` and ``unattributed_s``: the step's time
    ops: Ops
    devices: dict[str, int]  # device name → the step's GEMMs whose critical tile it ran
    segments: list[PathSegment] | None  # None: a step not shown tile by tile


class DeviceTime(TypedDict):
    """A device's time in a step or over the run: computing GEMMs, convolutions, its links
    busy (down + up), and the rest of the span (``waiting_s``, at least 0)."""

    gemm_s: float
    conv_s: float
    link_s: float
    waiting_s: float


class DeviceBytes(TypedDict):
    """A device's bytes in a step: operands down its link, results up, and operand bytes
    it held already (which its link did not carry)."""

    down: int
    up: int
    saved: int


class StepRow(Sums):
    job: int
    step: int
    complete: bool
    t0: float
    t1: float
    bytes_saved: int  # operand bytes its devices held already, so the links did not carry
    bytes_bound: int  # the least its GEMMs' partitions send: each device's blocks once
    critical_path: CriticalPath
    # the devices that computed or moved anything in it: their times summed (device-seconds),
    # and each one's by name (None: a step not shown tile by tile, as ``segments``)
    device_time: DeviceTime
    devices: dict[str, DeviceTime] | None
    # each device's bytes, by name: of every step (a ``steps`` log's too), those that moved
    # or held any
    device_bytes: dict[str, DeviceBytes]


class JobRow(Sums):
    id: int
    name: str
    by_class: ByClass  # over its steps
    steps: list[StepRow]


class Totals(Sums):
    by_class: ByClass
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
    bytes_saved: int  # operand bytes it held already, which its link did not carry
    time: DeviceTime  # over the run span
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
    auto_block: bool
    coordinator_time: str
    event_log: str
    detail: Detail
    bottleneck: Bottleneck | None
    command: list[str]
    incomplete: str | None
    verification: VerificationInfo | None  # None: a run before tile verification


class VerificationInfo(TypedDict):
    """Which tiles were checked before they reached a job, and the devices quarantined."""

    mode: str
    checked: int
    wrong: int
    screened_out: int
    sampled_out: int
    check_errors: int
    quarantines: list[dict[str, object]]


class Untimed(TypedDict):
    """What the run could not attribute to an op class, and why."""

    coordinator_unclassified_s: float  # coordinator time the jobs did not split
    steps: int  # the steps with some
    reason: str | None  # why (None: there is none)
    local_gemms: int  # products the script kept on the host: in its coordinator time
    local_note: str


class CollectiveRow(TypedDict):
    """A rank's collectives of one kind over the steps shown: how many, their bytes, their
    time on the network (queued behind earlier ones included) and its time waiting in them
    for the other members, as its steps' ``comm_s`` and ``comm_wait_s`` count them."""

    job: int
    name: str
    op: str
    count: int
    bytes: int
    network_s: float
    waited_s: float


class Collectives(TypedDict):
    algorithm: str | None  # None: a run before ranks, or one that does not say
    rows: list[CollectiveRow]  # by job, then op


class Summary(TypedDict):
    version: int
    run: RunInfo
    totals: Totals
    untimed: Untimed
    jobs: list[JobRow]
    devices: list[DeviceRow]
    stragglers: Stragglers
    ooms: Ooms
    collectives: Collectives

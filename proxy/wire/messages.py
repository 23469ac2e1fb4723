"""The messages of the Morphling wire protocol: one small class per message.

A message is a dataclass whose fields are its msgpack header; its raw
payload travels beside the header as ``segments`` (numpy arrays or byte
buffers out, read-only-agnostic memoryviews in). ``docs/PROTOCOL.md`` is the
specification; this module is its executable form. Nothing here does I/O.

Messages are values: never change one once built. They are not frozen
dataclasses only because those set every field through ``object.__setattr__``,
which triples the cost of building one, and every frame sent or received
builds one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, NamedTuple


class MsgType(IntEnum):
    """The frame ``type`` byte."""

    GREETING = 1
    HELLO = 2
    WELCOME = 3
    ERROR = 4
    BYE = 5
    HEARTBEAT = 6
    PROBE_ECHO = 10
    PROBE_PUSH = 11
    PROBE_ACK = 12
    PROBE_PULL = 13
    PROBE_PULLED = 14
    PROBE_FLOPS = 15
    PROBE_FLOPS_RESULT = 16
    PROBE_VERDICT = 17
    PROBE_FLOPS_REQUEST = 18
    TILE = 20
    TILE_RESULT = 21
    CONV_TILE = 22
    TILE_MISSING = 23
    OPEN = 30
    GEMM = 31
    RESULT = 32
    STEP = 33
    CLOSE = 34
    SLAB = 35
    NOTICE = 36
    CONV = 37
    COLLECTIVE = 38
    WAIT = 39
    STATUS_ASK = 40
    STATUS = 41


ROLES = ("device", "job", "probe")
# ERROR codes that retrying the same connection cannot fix.
REFUSALS = frozenset({"auth", "bad_hello", "bad_version"})
GEMM_DTYPES = ("float32", "float64")  # what a GEMM or a convolution (and its tiles) computes in
# A convolution's product: the output (forward), the input's gradient, the weight's gradient.
CONV_KINDS = ("forward", "grad_input", "grad_weight")
# What a rank's COLLECTIVE may be (torch.distributed's operations, by their c10d names).
COLLECTIVE_OPS = (
    "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather", "scatter",
    "alltoall", "barrier", "send", "recv",
)  # fmt: skip
DTYPES = (*GEMM_DTYPES, "uint8")  # a payload segment's: an operand's, or plain bytes
# ``host_split``: at most this many op classes, so a header stays small whatever the job sends.
MAX_SPLIT_CLASSES = 32
MAX_ALT_PROFILES = 16  # ``host_alt``: at most this many other profiles


@dataclass(slots=True)
class Message:
    """Base of all messages. ``SEGMENTS`` is how many payload segments it carries;
    ``FIELDS`` names its header fields in order (set for every class in ``MESSAGES``)."""

    TYPE: ClassVar[MsgType]
    SEGMENTS: ClassVar[int] = 0
    FIELDS: ClassVar[tuple[str, ...]] = ()
    segments: tuple[Any, ...] = field(default=(), kw_only=True, repr=False, compare=False)

    def header(self) -> dict[str, Any]:
        """The msgpack header fields (everything but the segments)."""
        return {name: getattr(self, name) for name in self.FIELDS}


@dataclass(slots=True)
class Greeting(Message):
    """Server → peer, first frame on every connection: what to authenticate against."""

    TYPE = MsgType.GREETING
    version: int
    nonce: bytes
    auth: bool
    weights: dict[str, Any] = field(
        default_factory=dict
    )  # the shared weights: path, digest, nbytes
    arena: dict[str, Any] = field(default_factory=dict)  # the operand arena: path, nbytes
    process: str = ""  # the emulator's token (``local``): peers in its process hand over arrays


@dataclass(slots=True)
class Hello(Message):
    """Peer → server: who I am. ``mac`` is HMAC-SHA256(token, nonce), empty without a token."""

    TYPE = MsgType.HELLO
    role: str
    name: str = ""
    uuid: str = ""
    mac: bytes = b""
    profile: dict[str, Any] = field(default_factory=dict)
    caps: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Welcome(Message):
    """Server → peer: accepted; the server-assigned id and the heartbeat period."""

    TYPE = MsgType.WELCOME
    peer_id: int
    heartbeat_s: float


@dataclass(slots=True)
class Error(Message):
    """Either way: what went wrong. The sender closes the connection after it."""

    TYPE = MsgType.ERROR
    code: str
    reason: str


@dataclass(slots=True)
class Bye(Message):
    """Either way: an orderly goodbye; the sender closes after it."""

    TYPE = MsgType.BYE
    reason: str = ""


@dataclass(slots=True)
class Heartbeat(Message):
    """Either way, when nothing else was sent for a heartbeat period."""

    TYPE = MsgType.HEARTBEAT


@dataclass(slots=True)
class ProbeEcho(Message):
    """Either way, with a payload: the receiver sends it back with ``reply`` set."""

    TYPE = MsgType.PROBE_ECHO
    SEGMENTS = 1
    probe: int
    reply: bool = False


@dataclass(slots=True)
class ProbePush(Message):
    """Either way: bytes to time the sender → receiver direction; answered by PROBE_ACK."""

    TYPE = MsgType.PROBE_PUSH
    SEGMENTS = 1
    probe: int


@dataclass(slots=True)
class ProbeAck(Message):
    """The PROBE_PUSH payload arrived whole."""

    TYPE = MsgType.PROBE_ACK
    probe: int
    nbytes: int


@dataclass(slots=True)
class ProbePull(Message):
    """Either way: send ``nbytes`` back in a PROBE_PULLED, to time the other direction."""

    TYPE = MsgType.PROBE_PULL
    probe: int
    nbytes: int


@dataclass(slots=True)
class ProbePulled(Message):
    """The payload a PROBE_PULL asked for."""

    TYPE = MsgType.PROBE_PULLED
    SEGMENTS = 1
    probe: int


@dataclass(slots=True)
class ProbeFlops(Message):
    """Server → peer: regenerate A and B from ``seed`` (``challenge.py``) and compute A·B."""

    TYPE = MsgType.PROBE_FLOPS
    probe: int
    seed: int
    dim: int


@dataclass(slots=True)
class ProbeFlopsResult(Message):
    """Peer → server: C = A·B (float32, dim×dim) and the peer's own compute time."""

    TYPE = MsgType.PROBE_FLOPS_RESULT
    SEGMENTS = 1
    probe: int
    compute_ns: int


@dataclass(slots=True)
class ProbeVerdict(Message):
    """Server → peer: whether C was right, and the FLOPS it stands for."""

    TYPE = MsgType.PROBE_VERDICT
    probe: int
    ok: bool
    reason: str
    flops: float


@dataclass(slots=True)
class ProbeFlopsRequest(Message):
    """Peer → server: challenge me (``morphling-bench``); answered by PROBE_FLOPS."""

    TYPE = MsgType.PROBE_FLOPS_REQUEST
    dim: int


@dataclass(slots=True)
class StatusAsk(Message):
    """Probe peer → server: the fleet's state (``morphling status``); answered by STATUS."""

    TYPE = MsgType.STATUS_ASK


@dataclass(slots=True)
class Status(Message):
    """Server → probe peer: devices, jobs, quarantines and counters, a msgpack map in the
    payload (docs/PROTOCOL.md): a fleet of thousands outgrows any header."""

    TYPE = MsgType.STATUS
    SEGMENTS = 1


@dataclass(slots=True)
class Tile(Message):
    """Server → device: compute the [m, n] tile ``op(A)·op(B)``; segments are A and B.

    A is op(A)'s rows as stored: [m, k] row-major with leading dimension
    ``lda`` (``ta`` false) or [k, m] with ``lda`` (``ta`` true); B likewise
    [k, n] or [n, k] with ``ldb``.

    A weight block carries ``ref_a``/``ref_b`` = [offset, rows, cols, ld,
    version]: where it lies in the shared weights. With an empty segment the
    device reads it from its mapping of the shared weights, or else from its
    cache; with bytes, it caches them under the ref. ``drop`` lists refs the
    device may forget.

    ``panel_a``/``panel_b`` > 0 names any other operand block (a *panel*) by its
    bytes: with bytes, the device keeps them under that id for any later tile; with an
    empty segment, it reads the ones it kept (none kept: TILE_MISSING). ``drop_panels``
    lists panels the device may forget.

    ``within_a``/``within_b`` >= 0 (segment empty, ``panel_*`` or ``ref_*`` given): the
    operand lies within the block kept under that panel or ref, its first element that
    many elements into it, rows ``lda``/``ldb`` apart (-1: it is the block itself).

    ``arena_a``/``arena_b`` >= 0 (segment empty): the operand's first element
    is at that byte offset in the emulator's operand arena, which the device
    maps; -1: it is not there. ``arena_c`` >= 0: write C there instead, rows
    ``ldc`` elements apart, and answer with an empty TILE_RESULT ``in_place``.
    """

    TYPE = MsgType.TILE
    SEGMENTS = 2
    tile: int
    dtype: str
    ta: bool
    tb: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ref_a: list[int] = field(default_factory=list)
    ref_b: list[int] = field(default_factory=list)
    drop: list[list[int]] = field(default_factory=list)
    panel_a: int = 0
    panel_b: int = 0
    drop_panels: list[int] = field(default_factory=list)
    within_a: int = -1
    within_b: int = -1
    arena_a: int = -1
    arena_b: int = -1
    arena_c: int = -1
    ldc: int = 0
    # The emulator, in this device's process, handed over the blocks and where C goes as
    # arrays (``local``), under its token, this device's id and ``tile``: segments empty,
    # TILE_RESULT ``in_place``.
    local: bool = False


@dataclass(slots=True)
class ConvTile(Message):
    """Server → device: one tile of a convolution (``kind``); segments are its two operands,
    contiguous NCHW / OIHW arrays of ``a_shape`` and ``b_shape``. Sent only to devices whose
    HELLO ``caps`` has ``conv``.

    The geometry (``kernel``, ``stride``, ``dilation``, ``padding`` = [top, bottom, left,
    right], ``groups``) is ``morphling.kernels.conv.ConvGeometry``'s, for this call:

    - ``forward``: a = the input region [N, C, Hr, W] the tile's output rows read, ``padding``
      the zeros around that region; b = the weight block [OC', C/groups, kh, kw]. C is the
      output block [N, OC', OH', OW].
    - ``grad_input``: a = the output gradient's rows [``oh_lo``, ``oh_lo`` + R) [N, OC', R,
      OW]; b = the weight block; ``padding`` and ``input_size`` = [H, W] are the whole
      convolution's. C is the input gradient's rows ``rows`` = [i0, i1) [N, C', i1 − i0, W].
    - ``grad_weight``: a = the input [N, C', H, W] (all rows, whole padding); b = the output
      gradient [N, OC', OH, OW]. C is the weight gradient block [OC', C'/groups, kh, kw],
      summed over the batch and every position.

    The device answers with TILE_RESULT, C contiguous, as for a TILE. ``local``,
    ``panel_a``/``panel_b`` and ``drop_panels``: as TILE's.
    """

    TYPE = MsgType.CONV_TILE
    SEGMENTS = 2
    tile: int
    kind: str
    dtype: str
    a_shape: list[int]
    b_shape: list[int]
    kernel: list[int]
    stride: list[int]
    dilation: list[int]
    padding: list[int]
    groups: int = 1
    input_size: list[int] = field(default_factory=list)  # grad_input: [H, W]
    oh_lo: int = 0  # grad_input: the first output-gradient row in a
    rows: list[int] = field(default_factory=list)  # grad_input: [i0, i1]
    local: bool = False
    panel_a: int = 0
    panel_b: int = 0
    drop_panels: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TileResult(Message):
    """Device → server: the tile, [m, n] row-major; measured and modelled compute time.
    ``in_place``: the segment is empty, C was written where the TILE said (``arena_c``, or
    the span handed over with a ``local`` tile; ``operands`` has the rule)."""

    TYPE = MsgType.TILE_RESULT
    SEGMENTS = 1
    tile: int
    compute_ns: int
    model_ns: int = 0
    in_place: bool = False


@dataclass(slots=True)
class TileMissing(Message):
    """Device → server: a TILE or CONV_TILE named a panel or weight block (``reason`` says
    which) that this device does not hold (evicted, or it restarted). Not an error: the
    emulator sends the tile again with its bytes."""

    TYPE = MsgType.TILE_MISSING
    tile: int
    reason: str = ""


@dataclass(slots=True)
class Open(Message):
    """Job → server: start a job. ``block`` overrides the tile size (0: server default).

    ``device_wait_s``: fail the job (ERROR ``no_devices``) once its tiles have waited this
    long with no device ready (0: wait for ever). ``fresh_weights``: restore the shared
    weights from the checkpoint before the job starts; the server answers with OPEN once
    they are (until then the job sends nothing but HEARTBEAT), or refuses with ERROR
    ``weights_busy`` while another job maps them. ``device``: the name of the one device
    all the job's tiles go to (empty: any); ERROR ``bad_open`` when no such device has
    joined. ``rank`` (-1: none) of ``world``: the job is a rank of a distributed script
    running on ``device`` itself, so its tiles cross no link, and it may send COLLECTIVE.
    """

    TYPE = MsgType.OPEN
    name: str = ""
    block: int = 0
    device_wait_s: float = 0.0
    fresh_weights: bool = False
    device: str = ""
    rank: int = -1
    world: int = 0


@dataclass(slots=True)
class Gemm(Message):
    """Job → server: C = op(A)·op(B), [batch, m, n]; segments are A's and B's spans.

    Each operand is ``batch`` pivots (``stride_*`` elements apart; 0 shares
    one pivot) of a row-major matrix with leading dimension ``ld*``, stored
    transposed when ``t*`` is set, exactly as BLAS takes it. An operand that
    lies in the shared weights is sent as ``ref_*`` = [byte offset, version]
    with an empty segment.

    Virtual time: the GEMM is issued ``host_ns`` (coordinator time on the host)
    after GEMM ``after`` of the same job ended — the one whose result the job
    last waited for; 0: after the job's last settled event. ``host_split`` says what
    the host did in that time: op class → nanoseconds, summing to ``host_ns`` (empty:
    not said, as for measured time). ``host_alt``: a rank whose work other ranks replay
    (``--numerics sample:K``) says what that time comes to on each of their coordinator
    profiles (name → a ``host_split``; empty: none).
    """

    TYPE = MsgType.GEMM
    SEGMENTS = 2
    gemm: int
    dtype: str
    ta: bool
    tb: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    batch: int = 1
    stride_a: int = 0
    stride_b: int = 0
    ref_a: list[int] = field(default_factory=list)
    ref_b: list[int] = field(default_factory=list)
    after: int = 0
    host_ns: int = 0
    host_split: dict[str, int] = field(default_factory=dict)  # see ``check_host_split``
    host_alt: dict[str, dict[str, int]] = field(default_factory=dict)  # ``check_host_alt``
    # Byte offsets in the job's slab (see ``Slab``): where it wrote A and B (their segments
    # are then empty) and where the emulator is to put C (then RESULT carries none); -1: not.
    slab_a: int = -1
    slab_b: int = -1
    slab_c: int = -1
    # A job in the emulator's process handed over its operands (those without a ref) and C
    # as arrays (``local``), under the emulator's token, this job's id and ``gemm``: segments
    # empty, RESULT's too.
    local: bool = False
    # A rank computed the product itself (``by_rank``): segments empty, no ref, slab or
    # local; the emulator times it on the rank's device and sends no RESULT. Like a blocking
    # COLLECTIVE, it is what the rank's next request comes after.
    by_rank: bool = False


@dataclass(slots=True)
class Collective(Message):
    """Job → server: a rank's torch.distributed operation, priced on the emulated network.

    ``ranks`` are the sender's group's global ranks (in group order; send and recv:
    [source, destination]), ``seq`` its number among that group's operations as this
    rank counts them, from 1 (every member's n-th is the same operation), ``root`` the
    root's or peer's global rank where the operation has one (else -1), and ``nbytes``
    what the sender's tensors hold. It starts in virtual time when its last member reaches
    it and ends when the algorithm's transfers are over. ``gemm`` is its id, from the same
    ids as GEMMs: a job that waited for it names it as the next request's ``after``
    (``blocking``: the rank waits for it at once, as a synchronous operation; otherwise it
    computes on, and its step ends no earlier than the operation). No answer.
    ``after``, ``host_ns`` and ``host_split`` are as in GEMM.
    """

    TYPE = MsgType.COLLECTIVE
    gemm: int
    op: str
    nbytes: int
    ranks: list[int]
    seq: int
    root: int = -1
    blocking: bool = True
    after: int = 0
    host_ns: int = 0
    host_split: dict[str, int] = field(default_factory=dict)
    host_alt: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(slots=True)
class Wait(Message):
    """Job → server: a rank waits here for its earlier COLLECTIVE ``wait``, one it did not
    wait for at once (``blocking`` false): it first uses the operation's tensors now. It is
    issued as a GEMM is (``gemm`` its id, ``after``, ``host_ns``, ``host_split`` as in GEMM)
    and ends when that operation has, or at once if it has: the next request names it as
    ``after``. No answer."""

    TYPE = MsgType.WAIT
    gemm: int
    wait: int
    after: int = 0
    host_ns: int = 0
    host_split: dict[str, int] = field(default_factory=dict)
    host_alt: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(slots=True)
class Conv(Message):
    """Job → server: a 2-D convolution's product (``kind``); RESULT answers it as a GEMM.

    ``input`` = [N, C, H, W] and ``weight`` = [OC, C/groups, kh, kw] are the convolution's
    shapes; ``stride`` = [sh, sw], ``dilation`` = [dh, dw], ``padding`` = [top, bottom,
    left, right] and ``groups`` its geometry (``morphling.kernels.conv``); a 1-D
    convolution has H = kh = 1. The segments, contiguous, are:

    - ``forward``: the input and the weight; C is the output [N, OC, OH, OW];
    - ``grad_input``: the output gradient [N, OC, OH, OW] and the weight; C is the input
      gradient [N, C, H, W];
    - ``grad_weight``: the input and the output gradient; C is the weight gradient [OC,
      C/groups, kh, kw].

    No bias: the job adds it (and sums its gradient). ``gemm`` is the request's id, from
    the same ids as GEMMs; ``after``, ``host_ns``, ``host_split``, ``local`` and ``by_rank``
    are as in GEMM.
    """

    TYPE = MsgType.CONV
    SEGMENTS = 2
    gemm: int
    kind: str
    dtype: str
    input: list[int]
    weight: list[int]
    stride: list[int]
    dilation: list[int]
    padding: list[int]
    groups: int = 1
    after: int = 0
    host_ns: int = 0
    host_split: dict[str, int] = field(default_factory=dict)
    host_alt: dict[str, dict[str, int]] = field(default_factory=dict)
    local: bool = False
    by_rank: bool = False


@dataclass(slots=True)
class Result(Message):
    """Server → job: C of GEMM ``gemm``, [batch, m, n] row-major, and how it was computed.

    ``model_ns`` is the GEMM's duration in virtual time, from its issue to its
    last tile back (0 when the timeline has not settled it yet: other jobs may
    still issue GEMMs before its end); ``bytes_down``/``bytes_up`` are the tile
    bytes sent to and received from devices over this emulator's sockets.
    """

    TYPE = MsgType.RESULT
    SEGMENTS = 1
    gemm: int
    tiles: int
    devices: list[int] = field(default_factory=list)
    requeued: int = 0
    resent: int = 0  # tiles sent again with their bytes: a device lacked a block (TILE_MISSING)
    model_ns: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    oom: int = 0  # tiles whose operands did not fit a device's emulated memory
    # The job's slab is gone: a device lost while writing into it might still do so. C is
    # there all the same (the emulator keeps that memory a while); ask for a new slab.
    slab_retired: bool = False


@dataclass(slots=True)
class Step(Message):
    """Job → server: training step ``step`` ended ``host_ns`` after the job's last GEMM
    result. The server answers, once the step is settled in virtual time, with the
    same message describing it: its emulated span (``emulated_ns``) and the part
    that was coordinator time, its GEMMs and tiles, the bytes the fleet's links
    would carry (``link_*``, not counting weight blocks resident on devices),
    the bytes that crossed this emulator's sockets since the last STEP
    (``bytes_*``), and its emulated out-of-memory events. ``host_split`` is as in GEMM;
    ``coord_split`` is the step's coordinator time by op class, as the jobs' splits
    attribute it (the rest of ``coord_ns`` was not split). A rank's ``comm_ns`` is the time
    its collectives took on the network, ``comm_wait_ns`` the time it waited in them for
    the other members. ``interruptions`` counts its tiles placed again because their
    device left (availability), ``lost_ns`` the time their passages had run by then.
    """

    TYPE = MsgType.STEP
    step: int
    host_ns: int = 0
    host_split: dict[str, int] = field(default_factory=dict)
    host_alt: dict[str, dict[str, int]] = field(default_factory=dict)
    local_gemms: int = 0  # job → server: GEMMs it computed itself in the step (reported)
    emulated_ns: int = 0
    coord_ns: int = 0
    coord_split: dict[str, int] = field(default_factory=dict)
    gemms: int = 0
    tiles: int = 0
    link_down: int = 0
    link_up: int = 0
    link_saved: int = 0  # operand bytes the links did not carry: the devices held them
    # the least the step's partitions send: each device's distinct operand blocks, once
    link_bound: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    oom: int = 0  # tiles whose operands did not fit a device's emulated memory
    comm_ns: int = 0
    comm_wait_ns: int = 0
    interruptions: int = 0
    lost_ns: int = 0


@dataclass(slots=True)
class Close(Message):
    """Job → server: the job is over; the server answers with totals and closes."""

    TYPE = MsgType.CLOSE
    gemms: int = 0
    tiles: int = 0
    model_ns: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    oom: int = 0  # tiles whose operands did not fit a device's emulated memory


@dataclass(slots=True)
class Slab(Message):
    """Job → server: give me a slab of ``nbytes`` in the operand arena (0: none); server →
    job: the job's slab now, ``nbytes`` at byte ``offset`` of the arena (0 bytes: none).

    A job on the emulator's host that maps the arena (HELLO ``caps.arena``) writes its
    operands into its slab and has C put there (``Gemm.slab_*``), so neither crosses the
    socket. A request gives the old slab back first; one the emulator cannot grant leaves
    the job without a slab.
    """

    TYPE = MsgType.SLAB
    nbytes: int
    offset: int = -1


@dataclass(slots=True)
class Notice(Message):
    """Server → job: something the job's user should know, as one line (``text``).

    ``no_devices``: the job's tiles wait because no device is ready (sent when the wait
    begins and then every ``device_wait_notice_s``); ``devices``: a device is ready again
    and they go out. ``devices`` is how many devices are connected, ``tiles`` how many of
    the job's tiles are not done, ``waited_s`` how long they have waited, ``limit_s`` the
    job's ``device_wait_s`` (0: none).
    """

    TYPE = MsgType.NOTICE
    code: str
    text: str
    devices: int = 0
    tiles: int = 0
    waited_s: float = 0.0
    limit_s: float = 0.0


MESSAGES: dict[int, type[Message]] = {cls.TYPE: cls for cls in Message.__subclasses__()}

# A field's wire type is its annotation's name (``list[int]``: "list"), with the Python
# types it may arrive as: an int is taken where a float is due (a peer written in another
# language may send 3 for 3.0).
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float, int),
    "str": (str,),
    "bytes": (bytes,),
    "bool": (bool,),
    "dict": (dict,),
    "list": (list,),
}


class _Schema(NamedTuple):
    """What ``from_wire`` checks a class's header against, worked out once per class."""

    names: frozenset[str]
    types: tuple[type, ...]  # each field's own type, in field order
    # (name, wire type, the Python types it may arrive as, required), in field order
    fields: tuple[tuple[str, str, tuple[type, ...], bool], ...]


def wire_type(f: dataclasses.Field[Any]) -> str:
    """A header field's wire type: its annotation's name (annotations are strings here)."""
    return str(f.type).split("[", 1)[0]


def _schema(cls: type[Message]) -> _Schema:
    fields = [f for f in dataclasses.fields(cls) if f.name != "segments"]
    cls.FIELDS = tuple(f.name for f in fields)
    kinds = [wire_type(f) for f in fields]
    required = [
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in fields
    ]
    return _Schema(
        frozenset(cls.FIELDS),
        tuple(_WIRE_TYPES[kind][0] for kind in kinds),
        tuple(
            (f.name, kind, _WIRE_TYPES[kind], need)
            for f, kind, need in zip(fields, kinds, required, strict=True)
        ),
    )


_SCHEMAS = {msg_type: _schema(cls) for msg_type, cls in MESSAGES.items()}
_ABSENT = object()
_SPLIT = frozenset(
    {MsgType.GEMM, MsgType.CONV, MsgType.COLLECTIVE, MsgType.WAIT, MsgType.STEP}
)  # the messages with a host_split


def check_host_split(name: str, split: dict[str, Any], host_ns: int) -> None:
    """``split`` (``name``'s ``host_split``) is op class → nanoseconds: at most
    ``MAX_SPLIT_CLASSES`` non-empty names, integers >= 0 that sum to ``host_ns``; else
    ``ValueError`` naming the field. The class names are the job's: any string will do."""
    where = f"{name}.host_split"
    _check_split(where, split)
    total = sum(split.values())
    if total != host_ns:
        raise ValueError(f"{where}: sums to {total} ns, not host_ns={host_ns}")


def _check_split(where: str, split: dict[str, Any]) -> None:
    """``split`` (the field ``where``) is at most ``MAX_SPLIT_CLASSES`` non-empty names,
    each to an integer >= 0; else ``ValueError`` naming it."""
    if len(split) > MAX_SPLIT_CLASSES:
        raise ValueError(f"{where}: {len(split)} op classes, at most {MAX_SPLIT_CLASSES}")
    for op, ns in split.items():
        if not isinstance(op, str) or not op:
            raise ValueError(f"{where}: op class {op!r:.40} is not a non-empty string")
        if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
            raise ValueError(f"{where}[{op!r:.40}]: {ns!r:.40} is not an integer >= 0")


def check_host_alt(name: str, alt: dict[str, Any]) -> None:
    """``alt`` (``name``'s ``host_alt``) is profile name → a ``host_split`` (which sums to
    that profile's host time): at most ``MAX_ALT_PROFILES``; else ``ValueError``."""
    where = f"{name}.host_alt"
    if len(alt) > MAX_ALT_PROFILES:
        raise ValueError(f"{where}: {len(alt)} profiles, at most {MAX_ALT_PROFILES}")
    for profile, split in alt.items():
        if not isinstance(profile, str) or not profile or not isinstance(split, dict):
            raise ValueError(f"{where}: {profile!r:.40} → {split!r:.40} is not a profile's "
                             "name and its host_split")  # fmt: skip
        _check_split(f"{where}[{profile!r:.40}]", split)


def from_wire(msg_type: int, header: dict[str, Any], segments: tuple[Any, ...]) -> Message:
    """Build a message from a decoded header, or raise ``ValueError`` naming the field.

    A header as ``Message.header`` writes it (every field, in order, each of its own
    type) passes in two tuple comparisons; any other is checked field by field. A
    ``host_split``'s contents are checked too (``check_host_split``).
    """
    cls = MESSAGES[msg_type]
    if len(segments) != cls.SEGMENTS:
        raise ValueError(
            f"{cls.TYPE.name}: {len(segments)} payload segments, expected {cls.SEGMENTS}"
        )
    schema = _SCHEMAS[msg_type]
    if tuple(header) != cls.FIELDS or tuple(map(type, header.values())) != schema.types:
        header = _checked(cls, schema, header)
    if msg_type in _SPLIT and header.get("host_split"):
        check_host_split(cls.TYPE.name, header["host_split"], header.get("host_ns", 0))
    if msg_type in _SPLIT and header.get("host_alt"):
        check_host_alt(cls.TYPE.name, header["host_alt"])
    return cls(**header, segments=segments)


def _checked(cls: type[Message], schema: _Schema, header: dict[str, Any]) -> dict[str, Any]:
    """``header`` checked field by field (unknown fields first, then the first problem in
    field order is the one named), with ints given for floats made floats."""
    if not header.keys() <= schema.names:
        unknown = header.keys() - schema.names
        raise ValueError(f"{cls.TYPE.name}: unknown header field(s) {sorted(map(repr, unknown))}")
    values = header
    for name, kind, allowed, required in schema.fields:
        value = header.get(name, _ABSENT)
        if value is _ABSENT:
            if required:
                raise ValueError(f"{cls.TYPE.name}: missing header field {name!r}")
            continue
        if not isinstance(value, allowed) or (kind != "bool" and isinstance(value, bool)):
            got = f"{type(value).__name__} {value!r:.40}"
            raise ValueError(f"{cls.TYPE.name}.{name}: expected {kind}, got {got}")
        if kind == "float" and isinstance(value, int):
            values = {**values, name: float(value)}
    return values

"""The job API: submit ``C = op(A)·op(B)``, or a convolution's product, to an emulator
and get C back.

``AsyncClient`` is the asyncio form. ``Client`` is the blocking form for
ordinary code (a training script): the calling thread does its own socket
I/O through the same sans-IO codec, so a GEMM costs no hop to an event-loop
thread and back; a small daemon thread only sends HEARTBEATs. Operands are
numpy arrays or CPU torch tensors of any BLAS-readable layout — transposed,
padded, batched, a 2-D operand broadcast over a batch — and go on the wire as
the memory they span, with their layout, never made contiguous first.

A convolution (``conv``: forward, grad_input or grad_weight, ``kernels.conv``'s
geometry) takes C-contiguous float32/float64 numpy arrays, which go as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import socket
import threading
import time
from collections import deque
from typing import Any, TypeVar

import numpy as np
from morphling.kernels import ConvGeometry, blas_operand
from morphling.kernels.layout import as_array
from morphling.proxy.net.blocking import BlockingChannel, ChannelError
from morphling.proxy.net.peer import PeerProtocol
from morphling.proxy.net.protocol import SMALL_PAYLOAD
from morphling.proxy.shm import handover as local
from morphling.proxy.shm.arena import OperandArena, pages
from morphling.proxy.shm.attach import attach
from morphling.proxy.wire import handshake
from morphling.proxy.wire.connection import Connection
from morphling.proxy.wire.messages import (
    CONV_KINDS,
    GEMM_DTYPES,
    Bye,
    Close,
    Collective,
    Conv,
    Error,
    Gemm,
    Greeting,
    Heartbeat,
    Hello,
    Message,
    Notice,
    Open,
    Result,
    Slab,
    Step,
    Wait,
    Welcome,
)
from morphling.proxy.wire.operands import (
    HANDED,
    IN_FRAME,
    Location,
    Place,
    gemm_fields,
    gemm_locations,
    in_slab,
    in_weights,
)
from morphling.proxy.wire.states import Party

log = logging.getLogger("morphling.job")
M = TypeVar("M", bound=Message)
Reply = TypeVar("Reply", Step, Close)  # what the emulator answers in kind, in order
_DTYPE_NAMES = {np.dtype(name): name for name in GEMM_DTYPES}


def gemm_request(
    gemm: int,
    a: Any,
    b: Any,
    shared: tuple[int, int] | None = None,
    *,
    after: int = 0,
    host_ns: int = 0,
    host_split: dict[str, int] | None = None,
    epoch: int = 0,
    by_rank: bool = False,
    host_alt: dict[str, dict[str, int]] | None = None,
) -> tuple[Gemm, tuple[int, ...]]:
    """The GEMM message for ``a @ b`` and the shape of its result.

    An operand inside ``shared`` (the address and size of this process's mapping of
    the emulator's shared weights) goes by reference, with a version made of its
    tensor's and ``epoch`` (see ``_location``). ``after`` and ``host_ns`` place it
    in virtual time, ``host_split`` says what the host did then (see ``Gemm``).
    ``by_rank``: the rank computed it itself, and sends its layout only; ``host_alt``:
    its host time on the profiles of the ranks replaying it (see ``Gemm``).
    """
    oa, ob = blas_operand(a, "a"), blas_operand(b, "b")
    dtype = _dtype_name(oa.span.dtype)
    if dtype not in GEMM_DTYPES or _dtype_name(ob.span.dtype) != dtype:
        raise ValueError(f"dtypes {dtype} and {ob.span.dtype.name}: need one of {GEMM_DTYPES}")
    if oa.cols != ob.rows:
        shapes = f"a is {oa.rows}×{oa.cols}, b is {ob.rows}×{ob.cols}"
        raise ValueError(f"inner dimensions differ: {shapes}")
    if oa.batch >= 0 and ob.batch >= 0 and oa.batch != ob.batch:
        raise ValueError(f"batch sizes differ: {oa.batch} and {ob.batch}")
    batch = max(oa.batch, ob.batch)
    if by_rank:  # its operands stay here
        at_a = at_b = IN_FRAME
        segments = (oa.span[:0], ob.span[:0])
    else:
        at_a, at_b = (_location(x, o.span, shared, epoch) for x, o in ((a, oa), (b, ob)))
        segments = (_segment(at_a, oa.span), _segment(at_b, ob.span))
    request = Gemm(
        gemm=gemm,
        dtype=dtype,
        ta=bool(oa.trans),
        tb=bool(ob.trans),
        m=oa.rows,
        n=ob.cols,
        k=oa.cols,
        lda=oa.ld,
        ldb=ob.ld,
        batch=max(batch, 1),
        stride_a=oa.stride if oa.batch >= 0 else 0,
        stride_b=ob.stride if ob.batch >= 0 else 0,
        after=after,
        host_ns=host_ns,
        host_split=host_split or {},
        host_alt=host_alt or {},
        **gemm_fields(at_a, at_b),
        by_rank=by_rank,
        segments=segments,
    )
    shape = (oa.rows, ob.cols) if batch < 0 else (batch, oa.rows, ob.cols)
    return request, shape


Pair = tuple[int, int]
Padding = tuple[int, int, int, int]  # top, bottom, left, right


def conv_request(
    conv: int,
    kind: str,
    a: np.ndarray,
    b: np.ndarray,
    *,
    input_shape: tuple[int, ...],
    weight_shape: tuple[int, ...],
    stride: Pair,
    padding: Padding,
    dilation: Pair,
    groups: int,
    after: int = 0,
    host_ns: int = 0,
    host_split: dict[str, int] | None = None,
) -> tuple[Conv, tuple[int, ...]]:
    """The CONV message for a convolution's product ``kind`` (``CONV_KINDS``) of ``a`` and
    ``b``, and the product's shape; ValueError naming what does not fit.

    The convolution has the input ``input_shape`` [N, C, H, W] and the weight
    ``weight_shape`` [OC, C/groups, kh, kw] (a 1-D one: H = kh = 1), ``stride`` (sh, sw),
    ``padding`` (top, bottom, left, right), ``dilation`` (dh, dw) and ``groups``. ``a`` and
    ``b`` are C-contiguous numpy arrays of one dtype, float32 or float64: forward, the
    input and the weight, product the output [N, OC, OH, OW]; grad_input, the output's
    gradient [N, OC, OH, OW] and the weight, product the input's gradient [N, C, H, W];
    grad_weight, the input and the output's gradient, product the weight's gradient
    [OC, C/groups, kh, kw]. No bias: its addition and gradient are the caller's.
    """
    geom, shapes = _conv_shapes(kind, input_shape, weight_shape, stride, padding, dilation,
                                groups)  # fmt: skip
    (first, second), product = {
        "forward": (("input", "weight"), "output"),
        "grad_input": (("output", "weight"), "input"),
        "grad_weight": (("input", "output"), "weight"),
    }[kind]
    dtype = ""
    for name, role, x in (("a", first, a), ("b", second, b)):
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
            raise ValueError(f"{kind}: {name} must be a C-contiguous numpy array")
        if _dtype_name(x.dtype) not in GEMM_DTYPES or dtype not in ("", x.dtype.name):
            raise ValueError(f"{kind}: {name} is {x.dtype}; a and b are one of {GEMM_DTYPES}")
        if x.shape != shapes[role]:
            raise ValueError(f"{kind}: {name} has shape {x.shape}, the {role} is {shapes[role]}")
        dtype = x.dtype.name
    request = _conv_message(conv, kind, dtype, geom, shapes, after, host_ns, host_split,
                            segments=(a.reshape(-1), b.reshape(-1)))  # fmt: skip
    return request, shapes[product]


def rank_conv_request(
    conv: int, kind: str, dtype: str, *, input_shape: tuple[int, ...],
    weight_shape: tuple[int, ...], stride: Pair, padding: Padding, dilation: Pair, groups: int,
    after: int = 0, host_ns: int = 0, host_split: dict[str, int] | None = None,
    host_alt: dict[str, dict[str, int]] | None = None,
) -> Conv:  # fmt: skip
    """The CONV message for a convolution's product ``kind`` that the rank computed itself
    (``by_rank``: its shapes and ``dtype``, no operands); the arguments as ``conv_request``
    takes them, ValueError naming what does not fit."""
    if dtype not in GEMM_DTYPES:
        raise ValueError(f"{kind}: dtype {dtype}; one of {GEMM_DTYPES}")
    geom, shapes = _conv_shapes(kind, input_shape, weight_shape, stride, padding, dilation,
                                groups)  # fmt: skip
    return _conv_message(conv, kind, dtype, geom, shapes, after, host_ns, host_split,
                         segments=(b"", b""), by_rank=True, host_alt=host_alt)  # fmt: skip


Shapes = dict[str, tuple[int, ...]]  # a convolution's input, weight and output, by name


def _conv_shapes(
    kind: str, input_shape: tuple[int, ...], weight_shape: tuple[int, ...], stride: Pair,
    padding: Padding, dilation: Pair, groups: int,
) -> tuple[ConvGeometry, Shapes]:  # fmt: skip
    """A convolution's geometry and the shapes of its input, weight and output, checked;
    ValueError naming what does not fit."""
    if kind not in CONV_KINDS:
        raise ValueError(f"convolution kind {kind!r}: one of {', '.join(CONV_KINDS)}")
    for name, shape in (("input_shape", input_shape), ("weight_shape", weight_shape)):
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError(f"{name}={tuple(shape)}: expected 4 dimensions, each >= 1")
    geom = ConvGeometry((weight_shape[2], weight_shape[3]), stride, dilation, padding, groups)
    n, channels, height, width = input_shape
    out_channels, per_group = weight_shape[:2]
    if channels % groups or out_channels % groups or per_group * groups != channels:
        raise ValueError(
            f"groups={groups}: the input's {channels} channels and the weight "
            f"{tuple(weight_shape)} do not make {groups} groups"
        )
    output = (n, out_channels, *geom.output_size(height, width))
    return geom, {"input": tuple(input_shape), "weight": tuple(weight_shape), "output": output}


def _conv_message(
    conv: int, kind: str, dtype: str, geom: ConvGeometry, shapes: Shapes, after: int,
    host_ns: int, host_split: dict[str, int] | None, *, segments: tuple[Any, Any],
    by_rank: bool = False, host_alt: dict[str, dict[str, int]] | None = None,
) -> Conv:  # fmt: skip
    """The CONV of ``_conv_shapes``' checked geometry and shapes."""
    return Conv(
        gemm=conv,
        kind=kind,
        dtype=dtype,
        input=list(shapes["input"]),
        weight=list(shapes["weight"]),
        stride=list(geom.stride),
        dilation=list(geom.dilation),
        padding=list(geom.padding),
        groups=geom.groups,
        after=after,
        host_ns=host_ns,
        host_split=host_split or {},
        host_alt=host_alt or {},
        by_rank=by_rank,
        segments=segments,
    )


def product_array(request: Conv, result: Result, shape: tuple[int, ...]) -> np.ndarray:
    """A convolution's product from its RESULT: a view of the segment."""
    return np.frombuffer(result.segments[0], dtype=request.dtype).reshape(shape)


def slab_bytes(request: Gemm) -> int:
    """The slab ``into_slab`` needs for ``request``: its operand segments and C, each
    starting on a page."""
    a, b = request.segments
    c = request.batch * request.m * request.n * np.dtype(request.dtype).itemsize
    return pages(a.nbytes) + pages(b.nbytes) + pages(c)


def into_slab(request: Gemm, slab: np.ndarray) -> Gemm:
    """``request`` with its operand segments copied into ``slab`` (the job's bytes of the
    operand arena, at least ``slab_bytes`` long) and C to be put there after them."""
    a, b, _ = gemm_locations(request)
    where, segments, at = [], [], 0
    for was, seg in zip((a, b), request.segments, strict=True):
        if seg.nbytes:  # (a weight's segment is empty: it stays a reference)
            slab[at : at + seg.nbytes] = seg.view(np.uint8)
            was = in_slab(at)
            at += pages(seg.nbytes)
        where.append(was)
        segments.append(seg[:0])
    fields = gemm_fields(where[0], where[1], in_slab(at))
    return dataclasses.replace(request, **fields, segments=tuple(segments))


def handed_over(request: Gemm | Conv) -> Gemm | Conv:
    """``request`` as sent when its operands (all but weights) and C are handed over to
    the emulator in this process (``local``) instead of crossing the socket."""
    segments = tuple(seg.view(np.uint8)[:0] for seg in request.segments)
    if isinstance(request, Conv):
        return dataclasses.replace(request, local=True, segments=segments)
    a, b, _ = gemm_locations(request)
    a, b = (HANDED if at.place is Place.FRAME else at for at in (a, b))
    return dataclasses.replace(request, **gemm_fields(a, b, HANDED), segments=segments)


def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, looked up for the usual ones: the attribute costs microseconds."""
    return _DTYPE_NAMES.get(dtype) or dtype.name


def _location(x: Any, span: np.ndarray, shared: tuple[int, int] | None, epoch: int) -> Location:
    """Where the operand ``x`` (whose memory is ``span``) goes: by reference, as [byte
    offset, version], when it lies in the shared weights; else in the frame.

    Torch bumps a tensor's ``_version`` on in-place updates, but not those through
    ``.data`` nor those of fused optimizers (``AdamW(fused=True)``): ``epoch``, the
    steps marked so far, is in the version too, so no block a step may have changed
    is taken for the one a device holds."""
    if shared is None or span.size == 0:
        return IN_FRAME
    start = span.ctypes.data - shared[0]
    if start < 0 or start + span.nbytes > shared[1]:
        return IN_FRAME
    return in_weights([start, (epoch << 32) + getattr(x, "_version", 0)])


def _segment(at: Location, span: np.ndarray) -> np.ndarray:
    """What the frame carries of an operand: its span, or none when it goes elsewhere."""
    return span if at.place is Place.FRAME else span[:0]


def result_array(
    request: Gemm,
    result: Result,
    shape: tuple[int, ...],
    out: Any,
    slab: np.ndarray | None = None,
) -> Any:
    """C from a RESULT: a view of its segment, or of the job's ``slab`` copied (it is
    reused) where the request had it put there; copied into ``out`` when given."""
    _, _, at = gemm_locations(request)
    if at.place is not Place.SLAB:
        c = np.frombuffer(result.segments[0], dtype=request.dtype).reshape(shape)
    elif slab is None:
        raise ValueError(f"GEMM {request.gemm}: C is in the job's slab, but no slab was given")
    else:
        nbytes = np.dtype(request.dtype).itemsize * math.prod(shape)
        c = slab[at.offset : at.offset + nbytes].view(request.dtype).reshape(shape)
        if out is None:
            return c.copy()
    return _into(c, out)


def _into(c: np.ndarray, out: Any) -> Any:
    """``c``, or ``out`` (an array or a tensor) with ``c`` copied in when given."""
    if out is None:
        return c
    np.copyto(as_array(out, "out"), c)
    return out


def tell(notice: Notice) -> None:
    """Log what the emulator tells the job's user (its tiles wait for devices, or no longer
    do): a job that only waited would look hung."""
    level = logging.INFO if notice.code == "devices" else logging.WARNING
    log.log(level, "emulator: %s", notice.text)


class EmulatorError(RuntimeError):
    """The emulator refused a request or the connection; ``code`` says why."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class JobConnection(PeerProtocol):
    """The job's side of its one connection."""

    def __init__(
        self, token: str, name: str, block: int, device_wait_s: float, device: str = ""
    ) -> None:
        super().__init__(Connection(Party.PEER, "job"))
        loop = asyncio.get_running_loop()
        self.token, self.name, self.block = token, name, block
        self.device_wait_s = device_wait_s
        self.device = device
        self.welcomed_as: asyncio.Future[int] = loop.create_future()
        self.results: dict[int, asyncio.Future[Result]] = {}
        self.replies: deque[asyncio.Future[Step | Close]] = deque()  # STEP and CLOSE, in order
        self.error: EmulatorError | None = None

    def greeted(self, greeting: Greeting) -> Hello:
        return handshake.hello(greeting, self.token, "job", name=self.name)

    def welcomed(self, welcome: Welcome) -> None:
        self.send(Open(name=self.name, block=self.block, device_wait_s=self.device_wait_s,
                       device=self.device))  # fmt: skip
        self.welcomed_as.set_result(welcome.peer_id)

    def refused(self, code: str, reason: str) -> None:
        self.error = EmulatorError(code, reason)

    def dismissed(self, reason: str) -> None:
        self.error = EmulatorError("bye", reason)

    def received(self, msg: Message) -> None:
        if isinstance(msg, Result):
            future = self.results.pop(msg.gemm, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, Step | Close):
            if self.replies:
                self.replies.popleft().set_result(msg)
        elif isinstance(msg, Notice):
            tell(msg)

    def disconnected(self, exc: Exception | None) -> None:
        why = (
            f"connection to the emulator lost ({exc})"
            if exc
            else (
                "the emulator closed the connection without a goodbye (it stopped or crashed, "
                "or something between cut the connection)"
            )
        )
        error = self.error or EmulatorError("disconnected", why)
        waiting: list[asyncio.Future[Any]] = [
            self.welcomed_as,
            *self.results.values(),
            *self.replies,
        ]
        for future in waiting:
            if not future.done():
                future.set_exception(error)
        self.results.clear()
        self.replies.clear()


class AsyncClient:
    """A job connected to an emulator. Use ``await AsyncClient.connect(...)``."""

    def __init__(self, conn: JobConnection, job_id: int) -> None:
        self._conn = conn
        self.job_id = job_id
        self._ids = itertools.count(1)

    @classmethod
    async def connect(
        cls, host: str, port: int, *, token: str = "", name: str = "", block: int = 0,
        timeout: float = 30.0, device_wait_s: float = 0.0, device: str = "",
    ) -> AsyncClient:  # fmt: skip
        """Connect and open the job. ``device_wait_s``: the emulator fails it (EmulatorError
        ``no_devices``) once its tiles have waited that long with no device ready (0: never);
        ``device``: the one device (a name) that computes its tiles."""
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(
                lambda: JobConnection(token, name, block, device_wait_s, device), host, port),
            timeout,
        )  # fmt: skip
        job_id = await asyncio.wait_for(conn.welcomed_as, timeout)
        return cls(conn, job_id)

    async def matmul(
        self, a: Any, b: Any, out: Any = None, *, timeout: float | None = None
    ) -> np.ndarray:
        """``a @ b`` for 2-D or batched ([batch, m, k]) views, computed by the fleet.

        Returns ``out`` (filled) when given, else a new array of shape
        ``[m, n]`` or ``[batch, m, n]``.
        """
        request, shape = gemm_request(next(self._ids), a, b)
        return result_array(request, await self.submit(request, timeout=timeout), shape, out)

    async def conv(
        self,
        kind: str,
        a: np.ndarray,
        b: np.ndarray,
        *,
        input_shape: tuple[int, ...],
        weight_shape: tuple[int, ...],
        stride: Pair,
        padding: Padding,
        dilation: Pair,
        groups: int,
        timeout: float | None = None,
    ) -> np.ndarray:
        """A convolution's product ``kind`` of ``a`` and ``b``, computed by the fleet (the
        arguments: ``conv_request``): a new array, the output, the input's gradient or the
        weight's gradient. Operands go as bytes."""
        request, shape = conv_request(
            next(self._ids),
            kind,
            a,
            b,
            input_shape=input_shape,
            weight_shape=weight_shape,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
        )
        return product_array(request, await self.submit(request, timeout=timeout), shape)

    async def submit(self, request: Gemm | Conv, *, timeout: float | None = None) -> Result:
        """Send an explicit GEMM or CONV request (the wire contract) and wait for its
        RESULT."""
        conn = self._conn
        if conn.error is not None:
            raise conn.error
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        conn.results[request.gemm] = future
        conn.send(request)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            conn.results.pop(request.gemm, None)

    async def _ask(self, msg: Reply) -> Reply:
        future: asyncio.Future[Step | Close] = asyncio.get_running_loop().create_future()
        self._conn.replies.append(future)
        self._conn.send(msg)
        reply = await future
        if not isinstance(reply, type(msg)):
            raise EmulatorError("bad_reply", f"{reply.TYPE.name} in reply to {msg.TYPE.name}")
        return reply

    async def step(self, step: int) -> Step:
        """Mark the end of a training step; the emulator's account of it."""
        return await self._ask(Step(step=step))

    async def close(self) -> Close | None:
        """End the job; its totals (None when the connection was already gone)."""
        if not self._conn.open:
            return None
        try:
            return await self._ask(Close())
        except EmulatorError:
            return None
        finally:
            self._conn.close()


class Client:
    """Blocking job client; the caller's thread reads and writes the socket itself.

    One request is in flight at a time (calls from several threads are
    serialised). A daemon thread sends HEARTBEAT whenever the caller has sent
    nothing for a heartbeat period, so a script busy elsewhere stays connected.

    On the emulator's host (and unless ``share_memory`` is off) it maps the
    operand arena and asks for a slab of it, grown to the largest GEMM's needs:
    ``matmul`` copies the operands into the slab and reads C from it, so neither
    crosses the socket. In the emulator's own process (``morphling run
    --embedded``) it copies nothing: it hands the emulator the operands and a
    new output array (``local``; ``hand_over=False`` uses the slab instead).

    Each GEMM and step mark says how long the caller computed on the host since
    its last result (``elapsed_ns``, or the ``host_ns`` it passes): the
    coordinator time between GEMMs in the emulator's virtual timeline. The job's
    first GEMM counts none (setting up the script is not emulated).

    While its tiles wait because no device is ready, the emulator says so, and the
    client logs it; past ``device_wait_s`` (0: never) the emulator fails the job and the
    call raises EmulatorError ``no_devices``.

    ``map_weights`` says (HELLO ``caps.weights``) that the job will map the emulator's
    shared weights (``Session.share_weights``) and may train them; ``fresh_weights``
    has the emulator restore them from the checkpoint before the job starts (refused,
    EmulatorError ``weights_busy``, while another job maps them). ``device`` (a name) pins
    every tile of the job to that device; ``rank`` (of ``world``) says the job is a rank
    running on it.
    """

    def __init__(
        self, host: str, port: int, *, token: str = "", name: str = "", block: int = 0,
        timeout: float = 30.0, share_memory: bool = True, hand_over: bool = True,
        device_wait_s: float = 0.0, map_weights: bool = False, fresh_weights: bool = False,
        device: str = "", rank: int = -1, world: int = 0,
    ) -> None:  # fmt: skip
        sock = socket.create_connection((host, port), timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._channel = BlockingChannel(sock, Connection(Party.PEER, "job"))
        self._call_lock = threading.Lock()  # one request and its reply at a time
        self._ids = itertools.count(1)
        self._stopped = threading.Event()
        self.error: EmulatorError | None = None
        self.shared: tuple[int, int] | None = None  # see gemm_request
        self._after = 0  # the GEMM whose result came last (0: a step mark, or none yet)
        self.steps = 0  # step marks made
        self._since_ns: int | None = None  # when it came (perf_counter_ns)
        self._arena: OperandArena | None = None  # this process's mapping of the arena
        self._slab: np.ndarray | None = None  # the job's bytes of it (SLAB)
        self._slab_refused = 1 << 62  # the smallest slab the emulator did not give
        self._slab_busy = 0  # a GEMM using the slab whose RESULT has not come (timed out)
        self._local = ""  # in the emulator's process, its token: operands go as arrays
        try:
            greeting = self._expect(Greeting, timeout)
            self.weights: dict[str, Any] = greeting.weights  # what the emulator shares
            got = attach(greeting, arena=share_memory, in_process=share_memory and hand_over)
            self._arena, self._local = got.arena, got.process
            caps = got.caps
            if (map_weights or fresh_weights) and greeting.weights:  # the session maps them
                caps["weights"] = greeting.weights["path"]
            self._send(handshake.hello(greeting, token, "job", name=name, caps=caps))
            welcome = self._expect(Welcome, timeout)
            self.job_id: int = welcome.peer_id
            self._channel.silence_s = handshake.silence_s(welcome)
            threading.Thread(target=self._beat, args=(welcome.heartbeat_s,), daemon=True,
                             name=f"morphling-heartbeat-{self.job_id}").start()  # fmt: skip
            self._send(Open(name=name, block=block, device_wait_s=device_wait_s,
                            fresh_weights=fresh_weights, device=device, rank=rank,
                            world=world))  # fmt: skip
            if fresh_weights:  # restored once OPEN answers: however long that takes
                self._expect(Open, None)
                self.weights = {**self.weights, "trained": [], "trained_jobs": 0}
        except BaseException:
            self._stopped.set()
            self._channel.close()
            raise

    def elapsed_ns(self) -> int:
        """Host time since the last result (0 before the first GEMM)."""
        return 0 if self._since_ns is None else time.perf_counter_ns() - self._since_ns

    def matmul(
        self, a: Any, b: Any, out: Any = None, *, timeout: float | None = None,
        host_ns: int | None = None, host_split: dict[str, int] | None = None,
    ) -> Any:  # fmt: skip
        """``a @ b`` as in ``AsyncClient.matmul``; ``host_ns`` overrides the measured
        coordinator time since the last result, ``host_split`` divides it among op classes
        (see ``Gemm``)."""
        with self._call_lock:
            request, shape = gemm_request(
                next(self._ids), a, b, self.shared, after=self._after, epoch=self.steps,
                host_ns=self.elapsed_ns() if host_ns is None else host_ns,
                host_split=host_split,
            )  # fmt: skip
            if self._local:
                c = np.empty((request.batch, request.m, request.n), request.dtype)
                self._hand_over(request, c, timeout)
                return _into(c.reshape(shape), out)
            slab = self._slab_for(request)
            if slab is not None:
                request = into_slab(request, slab)
            return result_array(request, self._call(request, timeout), shape, out, slab)

    def conv(
        self,
        kind: str,
        a: np.ndarray,
        b: np.ndarray,
        *,
        input_shape: tuple[int, ...],
        weight_shape: tuple[int, ...],
        stride: Pair,
        padding: Padding,
        dilation: Pair,
        groups: int,
        host_ns: int | None = None,
        host_split: dict[str, int] | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """A convolution's product ``kind`` of ``a`` and ``b``, computed by the fleet:
        ``conv_request`` says what the arguments are and which array comes back (a new
        one: the output, the input's gradient or the weight's gradient). ``host_ns`` and
        ``host_split``, as in ``matmul``: the coordinator time since the last result
        (measured without it) and its op classes.

        In the emulator's process the operands are handed over, not copied; elsewhere
        they go as bytes (never through the slab). ValueError for arguments that do not
        make a convolution; EmulatorError when the emulator refuses it."""
        with self._call_lock:
            request, shape = conv_request(
                next(self._ids),
                kind,
                a,
                b,
                input_shape=input_shape,
                weight_shape=weight_shape,
                stride=stride,
                padding=padding,
                dilation=dilation,
                groups=groups,
                after=self._after,
                host_ns=self.elapsed_ns() if host_ns is None else host_ns,
                host_split=host_split,
            )
            if self._local:
                c = np.empty(shape, request.dtype)
                self._hand_over(request, c, timeout)
                return c
            return product_array(request, self._call(request, timeout), shape)

    def rank_matmul(
        self, a: Any, b: Any, *, host_ns: int, host_split: dict[str, int] | None = None,
        host_alt: dict[str, dict[str, int]] | None = None,
    ) -> None:  # fmt: skip
        """``a @ b``, which this rank computed itself, to be timed on its device (GEMM
        ``by_rank``: its layout only), sent without waiting; ``host_ns`` and ``host_split``
        as in ``matmul``, ``host_alt`` as in ``gemm_request``."""
        with self._call_lock:
            request, _ = gemm_request(next(self._ids), a, b, after=self._after, host_ns=host_ns,
                                      host_split=host_split, by_rank=True,
                                      host_alt=host_alt)  # fmt: skip
            self._send_blocking(request)

    def rank_conv(
        self, kind: str, dtype: str, *, input_shape: tuple[int, ...],
        weight_shape: tuple[int, ...], stride: Pair, padding: Padding, dilation: Pair,
        groups: int, host_ns: int, host_split: dict[str, int] | None = None,
        host_alt: dict[str, dict[str, int]] | None = None,
    ) -> None:  # fmt: skip
        """A convolution's product ``kind``, which this rank computed itself, to be timed
        on its device (CONV ``by_rank``, ``rank_conv_request``), sent without waiting."""
        with self._call_lock:
            request = rank_conv_request(
                next(self._ids), kind, dtype, input_shape=input_shape, weight_shape=weight_shape,
                stride=stride, padding=padding, dilation=dilation, groups=groups,
                after=self._after, host_ns=host_ns, host_split=host_split, host_alt=host_alt,
            )  # fmt: skip
            self._send_blocking(request)

    def _send_blocking(self, request: Gemm | Conv | Collective | Wait) -> None:
        """Send ``request``, which nothing answers, as the one the next comes after (it
        holds the rank in virtual time, as a product whose result it waits for would)."""
        self._send(request)
        self._after, self._since_ns = request.gemm, time.perf_counter_ns()

    def _hand_over(self, request: Gemm | Conv, c: np.ndarray, timeout: float | None) -> None:
        """``request`` with its operands and C handed to the emulator in this process
        (``local``), C written once it returns. C must be new: should the call time out,
        a device may still write into it later, so it must be nobody's yet."""
        a, b = (seg.view(np.uint8) for seg in request.segments)
        key = (self._local, self.job_id, request.gemm)
        local.offer_gemm(key, local.JobOperands(a, b, c))
        try:
            self._call(handed_over(request), timeout)
        except TimeoutError:  # sent: the emulator takes them when it reads the request
            raise
        except BaseException:  # perhaps never sent, or the emulator is gone
            local.take_gemm(key)
            raise

    def submit(self, request: Gemm | Conv, *, timeout: float | None = None) -> Result:
        """Send an explicit GEMM or CONV request (its ``after``/``host_ns`` as the caller
        set them) and wait for its RESULT."""
        with self._call_lock:
            return self._call(request, timeout)

    def _call(self, request: Gemm | Conv, timeout: float | None) -> Result:
        self._send(request)
        if isinstance(request, Gemm) and request.slab_c != -1:
            self._slab_busy = request.gemm
        while True:  # a RESULT for an abandoned (timed-out) request is dropped
            result = self._expect(Result, timeout)
            if result.gemm == request.gemm:
                self._after, self._since_ns = result.gemm, time.perf_counter_ns()
                return result

    def _slab_for(self, request: Gemm) -> np.ndarray | None:
        """The job's slab, grown as ``request`` needs, or None when it goes as bytes: too
        small to be worth it, no arena here, no room there (asked again after the next
        step mark), or the slab still in use by a GEMM that timed out."""
        arena = self._arena
        if arena is None or self._slab_busy:
            return None
        need, most = slab_bytes(request), arena.nbytes // 2  # the emulator gives no more
        have = 0 if self._slab is None else len(self._slab)
        if need < SMALL_PAYLOAD:
            return None
        if need <= have:
            return self._slab
        if need > most or need >= self._slab_refused:
            return None
        for ask in dict.fromkeys((min(max(need, 2 * have), most), need)):  # doubled, or just
            if self._ask_slab(arena, ask) >= need:
                return self._slab
        self._slab_refused = need
        return None

    def _ask_slab(self, arena: OperandArena, nbytes: int) -> int:
        """Ask for a slab of ``nbytes`` of ``arena`` (the old one goes back); the size of
        the one given.

        Should the exchange be cut short (a timeout, Ctrl-C), this job stops using the
        arena: the reply, when it comes, would be read as nothing, and the emulator may
        already have reused the old slab."""
        self._arena = self._slab = None
        self._send(Slab(nbytes=nbytes))
        reply = self._expect(Slab, 30.0)
        if reply.nbytes:
            try:
                self._slab = arena.region(reply.offset, reply.nbytes, "uint8")
            except ValueError as exc:
                self._fail(EmulatorError("bad_slab", f"SLAB from the emulator: {exc}"))
        self._arena = arena
        return reply.nbytes

    def collective(
        self, op: str, nbytes: int, *, ranks: list[int], seq: int, root: int = -1,
        blocking: bool = True, host_ns: int | None = None,
        host_split: dict[str, int] | None = None, host_alt: dict[str, dict[str, int]] | None = None,
    ) -> int:  # fmt: skip
        """A rank's part in collective ``op`` (the fields: ``Collective``), sent without
        waiting: the emulator does not answer. A ``blocking`` one is what the next request
        comes after, as a GEMM's result is; ``host_ns`` and ``host_split`` as in
        ``matmul``. Its id, for ``wait``."""
        with self._call_lock:
            request_id = next(self._ids)
            host = self.elapsed_ns() if host_ns is None else host_ns
            request = Collective(
                gemm=request_id, op=op, nbytes=nbytes, ranks=ranks, seq=seq, root=root,
                blocking=blocking, after=self._after, host_ns=host, host_split=host_split or {},
                host_alt=host_alt or {},
            )  # fmt: skip
            if blocking:
                self._send_blocking(request)
            else:
                self._send(request)
            return request_id

    def wait(
        self, request: int, *, host_ns: int | None = None,
        host_split: dict[str, int] | None = None, host_alt: dict[str, dict[str, int]] | None = None,
    ) -> None:  # fmt: skip
        """The rank waits here for its earlier non-blocking collective ``request`` (WAIT;
        no answer): what the next request comes after."""
        with self._call_lock:
            host = self.elapsed_ns() if host_ns is None else host_ns
            self._send_blocking(Wait(gemm=next(self._ids), wait=request, after=self._after,
                                     host_ns=host, host_split=host_split or {},
                                     host_alt=host_alt or {}))  # fmt: skip

    def step(
        self, step: int, *, host_ns: int | None = None, local_gemms: int = 0,
        host_split: dict[str, int] | None = None, host_alt: dict[str, dict[str, int]] | None = None,
    ) -> Step:  # fmt: skip
        """Mark the end of a training step (``local_gemms`` computed on the host in it;
        ``host_ns`` and ``host_split`` as in ``matmul``); the emulator's account of it,
        once the step is settled in virtual time (``coord_split``: its coordinator time
        by op class)."""
        with self._call_lock:
            host = self.elapsed_ns() if host_ns is None else host_ns
            split = host_split or {}
            self._send(Step(step=step, host_ns=host, host_split=split, local_gemms=local_gemms,
                            host_alt=host_alt or {}))  # fmt: skip
            reply = self._expect(Step, None)
            self.steps += 1  # the optimizer may have changed any weight (``_weight_ref``)
            self._after, self._since_ns = 0, time.perf_counter_ns()
            self._slab_refused = 1 << 62  # the arena may have room again
            return reply

    def close(self) -> Close | None:
        """End the job; its totals (None when the connection was already gone)."""
        if self._stopped.is_set():
            return None
        try:
            with self._call_lock:
                self._send(Close())
                return self._expect(Close, 30.0)
        except (EmulatorError, OSError):
            return None
        finally:
            self._stopped.set()
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- I/O -------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        if self.error is not None:
            raise self.error
        try:
            self._channel.send(msg)
        except ChannelError as exc:
            raise self._lost(exc) from None

    def _receive(self, deadline: float | None) -> Message:
        try:
            return self._channel.receive(deadline)
        except ChannelError as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: ChannelError) -> EmulatorError:
        """The channel ended: the job's error, the first reason it ended for."""
        if self.error is None:
            self.error = EmulatorError(exc.code, exc.reason)
            self._stopped.set()
        return self.error

    def _expect(self, kind: type[M], timeout: float | None) -> M:
        """The next message of type ``kind``; HEARTBEATs are skipped, NOTICEs logged, ERROR
        and BYE raise, and a RESULT says whether the slab is free again (whatever was
        expected)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self._receive(deadline)
            if isinstance(msg, Result) and msg.gemm == self._slab_busy:
                self._slab_busy = 0
                if msg.slab_retired:  # C is still there to read, but no more
                    self._slab = None
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, Notice):
                tell(msg)
            elif isinstance(msg, Error):
                self._fail(EmulatorError(msg.code, msg.reason))
            elif isinstance(msg, Bye):
                self._fail(EmulatorError("bye", msg.reason))

    def _fail(self, error: EmulatorError) -> None:
        """The emulator refused (ERROR, BYE) or sent what cannot be used: the job ends."""
        self.error = error
        self._stopped.set()
        self._channel.close()
        raise error

    def _beat(self, period_s: float) -> None:
        while not self._stopped.wait(period_s / 2):
            if time.monotonic() - self._channel.last_sent >= period_s:
                try:
                    self._send(Heartbeat())
                except (EmulatorError, OSError):
                    return

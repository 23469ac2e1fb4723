"""Catch a PyTorch program's GEMMs and convolutions at the aten level and send them to
the fleet.

``Interceptor`` works below autograd, so it sees the products of the forward
*and* the backward pass after PyTorch has decomposed them. ``matmul``,
``linear``, ``nn.Linear`` and GPT-2's ``Conv1D`` become ``mm``, ``addmm``,
``bmm`` and ``baddbmm``. Fused attention is not a GEMM here: the job runtime
selects PyTorch's math attention backend, whose decomposition is two ``bmm``
forward and four backward, so attention reaches the devices too. Every
convolution (``conv1d``, ``conv2d``, ``nn.Conv*``, transposed or not) becomes
``aten.convolution``, a thin wrapper of ``aten._convolution`` (which autograd's
double backward also calls directly), and autograd computes its gradients with
one ``aten.convolution_backward`` (the products its ``output_mask`` asks for:
input gradient, weight gradient, bias gradient). A recurrent layer (``nn.LSTM``,
``nn.GRU``, ``nn.RNN``) is computed without oneDNN while a job runs, so that its gate
products are GEMMs too (``_rnns_as_gemms``).

It has two ways in. By default it replaces the CPU kernels of ``mm``,
``addmm``, ``bmm``, ``baddbmm`` (and their ``out=`` forms, which torch.compile's code
calls), ``_convolution`` and ``convolution_backward``
(``torch.library``, process-wide while active; the original kernel computes
what stays local), so only GEMMs and convolutions enter Python and every other
op runs at native speed: the wall time the script spends between them, the
measured coordinator time, is then the script's own. A ``TorchDispatchMode``
routes every aten op through Python instead (a few microseconds per op, a
sizeable share of a small model's step); that is the price of counting every
op, paid only when a ``HostWork`` is given (modelled coordinator time, which
does not read the clock).

A GEMM or a convolution goes to the fleet when it is worth it and the kernels
can compute it (float32/float64 CPU tensors, at least ``min_flops``; for a
convolution, 1-D or 2-D and not transposed); everything else runs locally and
is counted with the reason. GEMM operands go as they are laid out (transposed
views included); only a layout BLAS cannot read (a broadcast with stride 0,
say) is copied first, and that is counted too. Convolution operands go
NCHW-contiguous: any other layout (channels_last, a slice, an expanded
gradient) is copied and counted. This module does no I/O: it calls
``remote(a, b)`` and ``remote_conv(kind, a, b, call)``, and adds the bias terms
(and sums the bias gradient) itself. A rank whose device is a model (an embedded,
virtual one, which would compute on this host too) computes its products itself: given
a ``Timer``, the interceptor runs torch's own kernel for each and tells the timer what
it would have sent, which the rank's device then only times.

Given a ``HostWork``, it also counts the work that stays on the host (every
other aten op by class, the bytes it moves, its arithmetic, the FLOPs of local GEMMs and
convolutions): what the modelled coordinator time is made of.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from morphling.devices.models.op_count import count_op
from morphling.devices.models.ops import CONV, GEMM
from morphling.kernels import LayoutError, blas_operand
from morphling.proxy.wire.messages import CONV_KINDS, GEMM_DTYPES
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from .collectives import Pending

from .conv import ConvCall, conv_call, laid_out_like
from .coordinator import HostWork

aten = torch.ops.aten
R = TypeVar("R")

REMOTE_DTYPES = tuple(getattr(torch, name) for name in GEMM_DTYPES)  # what the fleet computes
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # other subclasses may mean anything: run locally
_forked = False  # this is a child forked from the script (a DataLoader worker): all local


def _in_forked_child() -> None:
    global _forked
    _forked = True  # the job's connection is the parent's: a child must not use it


os.register_at_fork(after_in_child=_in_forked_child)

Remote = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# kind ("forward", "grad_input", "grad_weight"), its two NCHW-contiguous operands, the call
RemoteConv = Callable[[str, torch.Tensor, torch.Tensor, ConvCall], torch.Tensor]


class Timer(Protocol):
    """Where a rank that computes its fleet products itself has them timed on its device
    (``Interceptor``'s ``timer``): given what ``remote`` and ``remote_conv`` would be."""

    def time_gemm(self, a: torch.Tensor, b: torch.Tensor) -> None: ...

    def time_conv(self, kind: str, call: ConvCall, dtype: torch.dtype) -> None: ...


@dataclass
class ProductCounts:
    """What the interceptor did with one kind of product (GEMMs, or convolutions: each
    of a convolution's forward, input-gradient and weight-gradient products is one), for
    per-step reports."""

    remote: int = 0
    remote_flops: int = 0
    copied: int = 0  # remote products whose operand had to be laid out anew first
    local: collections.Counter = field(default_factory=collections.Counter)  # by reason

    def snapshot(self) -> ProductCounts:
        return ProductCounts(self.remote, self.remote_flops, self.copied, self.local.copy())

    def since(self, earlier: ProductCounts) -> ProductCounts:
        return ProductCounts(
            self.remote - earlier.remote,
            self.remote_flops - earlier.remote_flops,
            self.copied - earlier.copied,
            self.local - earlier.local,
        )


class Interceptor:
    """Route eligible ``mm``/``addmm``/``bmm``/``baddbmm`` calls to ``remote`` and
    eligible convolution products to ``remote_conv`` while active (a context manager);
    with ``host_work``, count every other op in it. With a ``timer``, eligible products
    are computed here by torch's own kernel instead, and only timed (``Timer``): a rank
    whose device is a model computing on this host anyway.

    ``remote`` and ``remote_conv`` must not compute with torch: it would come back here.
    """

    def __init__(
        self, remote: Remote, remote_conv: RemoteConv, *, min_flops: int = 0,
        host_work: HostWork | None = None, timer: Timer | None = None,
    ) -> None:  # fmt: skip
        self.remote = remote
        self.remote_conv = remote_conv
        self.min_flops = min_flops
        if timer is not None and host_work is None:  # its products' host time is modelled
            raise ValueError("a timer needs host_work: a rank's coordinator time is modelled")
        self.host_work = host_work
        self.timer = timer
        self.counts = ProductCounts()  # GEMMs
        self.conv_counts = ProductCounts()
        gemms = {  # each GEMM's handler, with its rank
            aten.mm: functools.partial(self._mm, 2),
            aten.bmm: functools.partial(self._mm, 3),
            aten.addmm: functools.partial(self._addmm, 2),
            aten.baddbmm: functools.partial(self._addmm, 3),
        }
        self._handlers: dict[Any, Callable[..., Any]] = {
            **{op.default: handler for op, handler in gemms.items()},
            # ``torch.mm(a, b, out=c)``, and what torch.compile's code calls
            **{op.out: functools.partial(self._into, handler) for op, handler in gemms.items()},
            aten._convolution.default: self._convolution,
            aten.convolution_backward.default: self._convolution_backward,
        }
        # Under the counting mode, aten.convolution itself: its kernel, which calls
        # _convolution (a thin wrapper: it adds backend flags), then runs with the mode off.
        self._counted = {**self._handlers, aten.convolution.default: self._convolution}
        self._active: contextlib.ExitStack | None = None
        # Where the script's own time between fleet products ends and starts again (kernel
        # way in only; perf_counter_ns): when the latest product reached the interceptor,
        # and when the latest fleet product went back to the script, result, alpha and
        # bias applied.
        self.entered_ns = 0
        self.returned_ns = 0
        self.pending: Pending | None = None  # a rank's operations it has not waited for

    @property
    def sent(self) -> int:
        """Fleet products so far (sent, or with a timer timed), GEMMs and convolutions."""
        return self.counts.remote + self.conv_counts.remote

    def __enter__(self) -> Interceptor:
        if self._active is not None:
            raise RuntimeError("this Interceptor is already active")
        with contextlib.ExitStack() as stack:
            stack.enter_context(_rnns_as_gemms())
            if self.host_work is None:
                stack.callback(self._kernels()._destroy)  # torch's own scoped form does this
            else:
                stack.enter_context(_CountingMode(self, self.host_work))
            self._active = stack.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.close()

    def _kernels(self) -> torch.library.Library:
        """CPU kernels of the intercepted ops that call the handlers, each handler given
        the original kernel (``torch.library.get_kernel``) for what stays local."""
        originals = {op: torch.library.get_kernel(op, "CPU") for op in self._handlers}
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant
            warnings.simplefilter("ignore", UserWarning)
            for op, handler in self._handlers.items():
                library.impl(op, self._kernel(handler, originals[op]), "CPU", with_keyset=True)
        return library

    def _kernel(self, handler: Callable[..., Any], original: Any) -> Callable[..., Any]:
        """A boxed CPU kernel (``with_keyset``) that hands ``handler`` the original one and
        stamps ``entered_ns`` and ``returned_ns``."""

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            if _forked:
                return original.call_boxed(keyset, *args, **kwargs)
            self.entered_ns = time.perf_counter_ns()
            sent = self.sent
            out = handler(functools.partial(original.call_boxed, keyset), *args, **kwargs)
            if self.sent != sent:
                self.returned_ns = time.perf_counter_ns()
            return out

        return kernel

    def dispatch(self, func: Any, args: tuple, kwargs: dict[str, Any], work: HostWork) -> Any:
        """One aten op under ``_CountingMode``: a GEMM or a convolution to its handler, the
        rest run and counted in ``work`` (the host's)."""
        if self.pending and func.namespace != "c10d":  # a rank waits where it uses their data
            self.pending.used(args, kwargs)
        handler = self._counted.get(func)
        if handler is not None and not _forked:
            return handler(func, *args, **kwargs)
        out = func(*args, **kwargs)
        if func.namespace == "c10d":  # a rank's collective: the network's time, not the host's
            return out
        work.op(*count_op(func, args, kwargs, out, in_optimizer=work.in_optimizer))
        return out

    # -- handlers: ``func`` computes the op locally; torch ops in them do not come back
    # here (the mode is off inside them; a kernel's own ops are neither GEMMs nor
    # convolutions) ------------------------------------------------------------------------

    def _mm(self, rank: int, func: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not (_well_formed(rank, a, b) and self._eligible(a, b)):
            return func(a, b)
        if self.timer is not None:
            return self._timed(func(a, b), a, b)
        return self._product(a, b, self.remote)

    def _addmm(
        self, rank: int, func: Any, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
        beta: float = 1, alpha: float = 1,
    ) -> torch.Tensor:  # fmt: skip
        if (
            alpha == 0  # a·b is not even read
            or not _well_formed(rank, a, b)
            or not self._eligible(a, b)
            or c.dtype != a.dtype
        ):
            return func(c, a, b, beta=beta, alpha=alpha)
        if self.timer is not None:
            return self._timed(func(c, a, b, beta=beta, alpha=alpha), a, b)
        ab = self._product(a, b, self.remote)
        if alpha != 1:
            ab.mul_(alpha)
        if beta == 0:  # BLAS semantics: C is not read, so NaN in it does not propagate
            return ab
        return ab.add_(c if beta == 1 else c * beta)

    def _into(
        self, handler: Callable[..., torch.Tensor], func: Any, *args: torch.Tensor,
        out: torch.Tensor, **kwargs: Any,
    ) -> torch.Tensor:  # fmt: skip
        """A GEMM's ``out=`` form: the product as its plain form makes it (``handler``),
        written into ``out``, resized as torch resizes it. Where torch would refuse (``out``
        of another dtype) or ``out`` shares memory with an operand, the original kernel."""
        storages = {t.untyped_storage().data_ptr() for t in args}
        if out.dtype != args[-1].dtype or out.untyped_storage().data_ptr() in storages:
            return func(*args, out=out, **kwargs)
        result = handler(lambda *a, **k: func(*a, out=out, **k), *args, **kwargs)
        if result is not out:
            if out.shape != result.shape:
                out.resize_(result.shape)
            out.copy_(result)
        return out

    def _eligible(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        flops = 2 * a.numel() * b.shape[-1]
        reason = _operands_reason(a, b)
        if reason is None and (a.numel() == 0 or b.numel() == 0):
            reason = "empty"
        return self._goes_remote(self.counts, reason or self._size_reason(flops), flops)

    def _size_reason(self, flops: int) -> str | None:
        return "small" if flops < self.min_flops else None

    def _goes_remote(
        self, counts: ProductCounts, reason: str | None, flops: int, products: int = 1
    ) -> bool:
        """True without a ``reason`` to stay local; else False, ``products`` counted local."""
        if reason is None:
            return True
        counts.local[reason] += products
        if self.host_work is not None:
            self.host_work.product(GEMM if counts is self.counts else CONV, products * flops)
        return False

    def _product(
        self, a: torch.Tensor, b: torch.Tensor, send: Callable[[torch.Tensor, torch.Tensor], R],
        values: bool = True,
    ) -> R:  # fmt: skip
        """``send(a, b)``, counted: ``remote``, or the timer's (``_timed``, which needs the
        operands' layout only, not their ``values``)."""
        self.counts.remote += 1
        self.counts.remote_flops += 2 * a.numel() * b.shape[-1]
        try:  # the layout is checked once, where the request is built
            return send(a, b)
        except LayoutError:  # raised before anything was sent: copy what BLAS cannot read
            return send(self._readable(a, values), self._readable(b, values))

    def _timed(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``out``, the product of ``a`` and ``b`` computed here, timed as ``_product``
        would have sent it."""
        assert self.timer is not None, "only with a timer"
        self._product(a, b, self.timer.time_gemm, values=False)
        return out

    def _readable(self, x: torch.Tensor, values: bool) -> torch.Tensor:
        """``x``, or where BLAS cannot read its layout (counted) a contiguous copy: of its
        ``values``, or of its shape alone."""
        try:
            blas_operand(x, "operand")
        except LayoutError:
            self.counts.copied += 1
            return x.contiguous() if values else torch.empty(x.shape, dtype=x.dtype)
        return x

    def _convolution(
        self, func: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
        stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
        output_padding: list[int], groups: int, *flags: bool,
    ) -> torch.Tensor:  # fmt: skip
        """The forward product, plus the bias (added here: the fleet computes none).
        ``output_padding`` only shapes a transposed convolution, which stays local;
        ``_convolution``'s ``flags`` only choose among GPU backends."""
        args = (x, w, bias, stride, padding, dilation, transposed, output_padding, groups, *flags)
        call = self._conv_route(x, w, (stride, padding, dilation, transposed, groups),
                                bias=bias)  # fmt: skip
        if call is None:
            return func(*args)
        if self.timer is not None:
            return self._conv_timed(func(*args), call, x.dtype, ["forward"])
        y = self._conv_product("forward", call, self._operand(call, x), self._operand(call, w))
        if bias is not None:
            y.add_(bias.view(-1, *[1] * (y.dim() - 2)))
        return laid_out_like(y, x, w)

    def _convolution_backward(
        self, func: Any, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
        bias_sizes: list[int] | None, stride: list[int], padding: list[int],
        dilation: list[int], transposed: bool, output_padding: list[int], groups: int,
        output_mask: list[bool],
    ) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        """The products ``output_mask`` asks for: the input and weight gradients from the
        fleet, the bias gradient summed here."""
        args = (dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                groups, output_mask)  # fmt: skip
        products = sum(map(bool, output_mask[:2]))
        if not products:  # the bias gradient alone: no convolution
            return func(*args)
        call = self._conv_route(x, w, (stride, padding, dilation, transposed, groups),
                                dy=dy, products=products)  # fmt: skip
        if call is None:
            return func(*args)
        if self.timer is not None:
            kinds = [k for k, want in zip(CONV_KINDS[1:], output_mask[:2], strict=True) if want]
            return self._conv_timed(func(*args), call, x.dtype, kinds)
        dx = dw = db = None
        dy2 = self._operand(call, dy)  # laid out once for both products
        if output_mask[0]:
            dx = self._conv_product("grad_input", call, dy2, self._operand(call, w))
            dx = laid_out_like(dx, x, w)
            # until the next product, the time is Morphling's own, not the script's
            self.entered_ns = self.returned_ns = time.perf_counter_ns()
        if output_mask[1]:
            dw = self._conv_product("grad_weight", call, self._operand(call, x), dy2)
            dw = laid_out_like(dw, x, w)
        if output_mask[2]:
            db = dy.sum([0, *range(2, dy.dim())])
        return dx, dw, db

    def _conv_route(
        self, x: torch.Tensor, w: torch.Tensor, params: tuple[Any, ...], *,
        bias: torch.Tensor | None = None, dy: torch.Tensor | None = None, products: int = 1,
    ) -> ConvCall | None:  # fmt: skip
        """The convolution as the fleet computes it, or None to run it locally: counted
        (``products`` of it) with its reason, unless PyTorch rejects its arguments (its
        kernel raises its own error then).
        ``params`` are aten's stride, padding, dilation, transposed and groups."""
        stride, padding, dilation, transposed, groups = params
        call = None
        if transposed:
            reason: str | None = "transposed"
        elif x.dim() == w.dim() == 5:
            reason = "3-D"
        else:
            call = conv_call(x, w, stride, padding, dilation, groups)
            if (
                call is None
                or (bias is not None and tuple(bias.shape) != call.weight[:1])
                or (dy is not None and (dy.dim() != x.dim()
                                        or tuple(call.as_2d(dy).shape) != call.output))
            ):  # fmt: skip
                return None
            operands = [t for t in (x, w, bias, dy) if t is not None]
            reason = _operands_reason(*operands)
            if reason is None and (x.numel() == 0 or w.numel() == 0):
                reason = "empty"
            reason = reason or self._size_reason(call.flops)
        flops = call.flops if call is not None else 0
        return call if self._goes_remote(self.conv_counts, reason, flops, products) else None

    def _conv_product(
        self, kind: str, call: ConvCall, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        """One product of ``call`` from the fleet, its operands given by ``_operand``."""
        self._count_conv(call)
        return call.from_2d(self.remote_conv(kind, a, b, call))

    def _conv_timed(self, out: R, call: ConvCall, dtype: torch.dtype, kinds: list[str]) -> R:
        """``out``, computed here: ``call``'s products ``kinds``, timed in that order."""
        assert self.timer is not None, "only with a timer"
        for kind in kinds:
            self._count_conv(call)
            self.timer.time_conv(kind, call, dtype)
        return out

    def _count_conv(self, call: ConvCall) -> None:
        """One of ``call``'s products on the fleet (sent, or timed)."""
        self.conv_counts.remote += 1
        self.conv_counts.remote_flops += call.flops

    def _operand(self, call: ConvCall, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the fleet takes it: 2-D, NCHW-contiguous (a copy, counted, if not)."""
        t = call.as_2d(t)
        if t.is_contiguous():
            return t
        self.conv_counts.copied += 1
        return t.contiguous()


def _operands_reason(*tensors: torch.Tensor) -> str | None:
    """Why operands the fleet cannot take stay local: not CPU, a subclass, a dtype."""
    if any(t.device.type != "cpu" for t in tensors):
        return "device"
    if any(type(t) not in _PLAIN for t in tensors):
        return "tensor subclass"
    for t in tensors:
        if t.dtype not in REMOTE_DTYPES or t.dtype != tensors[0].dtype:
            return f"dtype {t.dtype}".replace("torch.", "")
    return None


def _well_formed(rank: int, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Operands the op takes (both ``rank``-D, inner and batch sizes that agree); others
    go to torch's own kernel, which raises its own error for them."""
    return (a.dim() == b.dim() == rank and a.shape[-1] == b.shape[-2]
            and (rank == 2 or a.shape[0] == b.shape[0]))  # fmt: skip


_RNNS = ("lstm", "gru", "rnn_tanh", "rnn_relu")  # what nn.LSTM, nn.GRU and nn.RNN call


@contextlib.contextmanager
def _rnns_as_gemms() -> Iterator[None]:
    """PyTorch's recurrent layers computed without oneDNN while a job runs. With it, a
    layer is one opaque call (``mkldnn_rnn_layer``) that neither the fleet nor the clock
    sees; without it (as on the boards: their aarch64 wheels have no oneDNN, REFERENCE.md)
    each time step's gate products are GEMMs. Only these calls: oneDNN's convolutions and
    bfloat16 products that stay local keep their native results."""
    vf = torch._VF
    kept = {name: vars(vf)[name] for name in _RNNS if name in vars(vf)}
    for name in _RNNS:
        setattr(vf, name, _without_onednn(getattr(vf, name)))
    try:
        yield
    finally:
        for name in _RNNS:
            delattr(vf, name)  # (back to torch's own, or to what was set before)
        for name, fn in kept.items():
            setattr(vf, name, fn)


def _without_onednn(fn: Callable[..., R]) -> Callable[..., R]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> R:
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)  # (a plain switch: the flags() context warns)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_mkldnn_enabled(enabled)

    return call


class _CountingMode(TorchDispatchMode):
    """Every aten op through Python, for ``Interceptor.dispatch`` to count."""

    def __init__(self, interceptor: Interceptor, work: HostWork) -> None:
        super().__init__()
        self.interceptor = interceptor
        self.work = work

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return self.interceptor.dispatch(func, args, kwargs or {}, self.work)

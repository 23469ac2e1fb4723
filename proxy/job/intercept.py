"""Catch a PyTorch program's GEMMs at the aten level and send them to the fleet.

``GemmInterceptor`` works below autograd, so it sees the GEMMs of the forward
*and* the backward pass after PyTorch has decomposed ``matmul``, ``linear``,
``nn.Linear`` and GPT-2's ``Conv1D`` into ``mm``, ``addmm``, ``bmm`` and
``baddbmm``. Fused attention is not a GEMM here: the job runtime selects
PyTorch's math attention backend, whose decomposition is two ``bmm`` forward
and four backward, so attention reaches the devices too.

It has two ways in. By default it replaces the CPU kernels of those four ops
(``torch.library``, process-wide while active; the original kernel computes
what stays local), so only GEMMs enter Python and every other op runs at
native speed: the wall time the script spends between GEMMs, the measured
coordinator time, is then the script's own. A ``TorchDispatchMode`` routes
every aten op through Python instead (a few microseconds per op, a sizeable
share of a small model's step); that is the price of
counting every op, paid only when a ``HostWork`` is given (modelled
coordinator time, which does not read the clock).

A GEMM goes to the fleet when it is worth it and the kernels can compute it
(float32/float64 CPU tensors, at least ``min_flops``); everything else runs
locally and is counted with the reason. Operands go as they are laid out
(transposed views included); only a layout BLAS cannot read (a broadcast
with stride 0, say) is copied first, and that is counted too. This module
does no I/O: it calls ``remote(a, b)`` and adds the bias terms itself.

Given a ``HostWork``, it also counts the work that stays on the host (every
other aten op, the bytes it writes, local GEMMs' FLOPs): what the modelled
coordinator time is made of.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from morphling.kernels import LayoutError, blas_operand
from morphling.proxy.wire.messages import GEMM_DTYPES
from torch.utils._python_dispatch import TorchDispatchMode

from .coordinator import HostWork

aten = torch.ops.aten

REMOTE_DTYPES = tuple(getattr(torch, name) for name in GEMM_DTYPES)  # what the fleet computes
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # other subclasses may mean anything: run locally
_forked = False  # this is a child forked from the script (a DataLoader worker): all local


def _in_forked_child() -> None:
    global _forked
    _forked = True  # the job's connection is the parent's: a child must not use it


os.register_at_fork(after_in_child=_in_forked_child)

Remote = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GemmCounts:
    """What the interceptor did, for per-step reports."""

    remote: int = 0
    remote_flops: int = 0
    copied: int = 0  # remote GEMMs whose operand had to be made BLAS-readable first
    local: collections.Counter = field(default_factory=collections.Counter)  # by reason

    def snapshot(self) -> GemmCounts:
        return GemmCounts(self.remote, self.remote_flops, self.copied, self.local.copy())

    def since(self, earlier: GemmCounts) -> GemmCounts:
        return GemmCounts(
            self.remote - earlier.remote,
            self.remote_flops - earlier.remote_flops,
            self.copied - earlier.copied,
            self.local - earlier.local,
        )


class GemmInterceptor:
    """Route eligible ``mm``/``addmm``/``bmm``/``baddbmm`` calls to ``remote`` while
    active (a context manager); with ``host_work``, count every other op in it.

    ``remote`` must not compute a GEMM with torch: it would come back here.
    """

    def __init__(
        self, remote: Remote, *, min_flops: int = 0, host_work: HostWork | None = None
    ) -> None:
        self.remote = remote
        self.min_flops = min_flops
        self.host_work = host_work
        self.counts = GemmCounts()
        self._handlers: dict[Any, Callable[..., torch.Tensor]] = {  # each with its rank
            aten.mm.default: functools.partial(self._mm, 2),
            aten.bmm.default: functools.partial(self._mm, 3),
            aten.addmm.default: functools.partial(self._addmm, 2),
            aten.baddbmm.default: functools.partial(self._addmm, 3),
        }
        self._active: contextlib.ExitStack | None = None
        # Where the script's own time between fleet GEMMs ends and starts again (kernel way
        # in only; perf_counter_ns): when the latest GEMM reached the interceptor, and when
        # the latest fleet GEMM went back to the script, result, alpha and bias applied.
        self.entered_ns = 0
        self.returned_ns = 0

    def __enter__(self) -> GemmInterceptor:
        if self._active is not None:
            raise RuntimeError("this GemmInterceptor is already active")
        with contextlib.ExitStack() as stack:
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
        """CPU kernels of the GEMM ops that call the handlers, each handler given the
        original kernel (``torch.library.get_kernel``) for what stays local."""
        originals = {op: torch.library.get_kernel(op, "CPU") for op in self._handlers}
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant
            warnings.simplefilter("ignore", UserWarning)
            for op, handler in self._handlers.items():
                library.impl(op, self._kernel(handler, originals[op]), "CPU", with_keyset=True)
        return library

    def _kernel(self, handler: Callable[..., torch.Tensor], original: Any) -> Callable[..., Any]:
        """A boxed CPU kernel (``with_keyset``) that hands ``handler`` the original one and
        stamps ``entered_ns`` and ``returned_ns``."""

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if _forked:
                return original.call_boxed(keyset, *args, **kwargs)
            self.entered_ns = time.perf_counter_ns()
            remote = self.counts.remote
            out = handler(functools.partial(original.call_boxed, keyset), *args, **kwargs)
            if self.counts.remote != remote:
                self.returned_ns = time.perf_counter_ns()
            return out

        return kernel

    def dispatch(self, func: Any, args: tuple, kwargs: dict[str, Any], work: HostWork) -> Any:
        """One aten op under ``_CountingMode``: a GEMM to its handler, the rest run and
        counted in ``work`` (the host's)."""
        handler = self._handlers.get(func)
        if handler is not None and not _forked:
            return handler(func, *args, **kwargs)
        out = func(*args, **kwargs)
        work.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                work.bytes += t.numel() * t.element_size()
        return out

    # -- handlers: ``func`` computes the op locally; torch ops in them do not come back
    # here (the mode is off inside them; a kernel's own ops are not GEMMs) ---------------

    def _mm(self, rank: int, func: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if _well_formed(rank, a, b) and self._eligible(a, b):
            return self._product(a, b)
        return func(a, b)

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
        ab = self._product(a, b)
        if alpha != 1:
            ab.mul_(alpha)
        if beta == 0:  # BLAS semantics: C is not read, so NaN in it does not propagate
            return ab
        return ab.add_(c if beta == 1 else c * beta)

    def _eligible(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        reason = self._local_reason(a, b)
        if reason is None:
            return True
        self.counts.local[reason] += 1
        if self.host_work is not None:
            self.host_work.ops += 1
            self.host_work.flops += 2 * a.numel() * b.shape[-1]
        return False

    def _local_reason(self, a: torch.Tensor, b: torch.Tensor) -> str | None:
        if a.device.type != "cpu" or b.device.type != "cpu":
            return "device"
        if type(a) not in _PLAIN or type(b) not in _PLAIN:
            return "tensor subclass"
        if a.dtype not in REMOTE_DTYPES or b.dtype != a.dtype:
            return f"dtype {a.dtype}".replace("torch.", "")
        if a.numel() == 0 or b.numel() == 0:
            return "empty"
        if 2 * a.numel() * b.shape[-1] < self.min_flops:
            return "small"
        return None

    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.counts.remote += 1
        self.counts.remote_flops += 2 * a.numel() * b.shape[-1]
        try:  # the layout is checked once, where the request is built
            return self.remote(a, b)
        except LayoutError:  # raised before anything was sent: copy what BLAS cannot read
            return self.remote(self._readable(a), self._readable(b))

    def _readable(self, x: torch.Tensor) -> torch.Tensor:
        try:
            blas_operand(x, "operand")
        except LayoutError:
            self.counts.copied += 1
            return x.contiguous()
        return x


def _well_formed(rank: int, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Operands the op takes (both ``rank``-D, inner and batch sizes that agree); others
    go to torch's own kernel, which raises its own error for them."""
    return (a.dim() == b.dim() == rank and a.shape[-1] == b.shape[-2]
            and (rank == 2 or a.shape[0] == b.shape[0]))  # fmt: skip


class _CountingMode(TorchDispatchMode):
    """Every aten op through Python, for ``GemmInterceptor.dispatch`` to count."""

    def __init__(self, interceptor: GemmInterceptor, work: HostWork) -> None:
        super().__init__()
        self.interceptor = interceptor
        self.work = work

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return self.interceptor.dispatch(func, args, kwargs or {}, self.work)

"""A rank's torch.distributed operations, seen where every one of them passes.

DDP's reducer calls the process group from C++, so wrapping ``torch.distributed``'s Python
functions would miss its gradient all-reduces. Every operation, from Python or C++, is a
``c10d`` op of the dispatcher, though: ``Collectives`` puts a kernel of its own in front
of them, at ``BackendSelect`` (the dispatch key every call passes just before its
backend's), tells ``report`` what each CPU one is (its op, the bytes its tensors hold, its
group's global ranks, its root, whether the rank waits for it at once), and redispatches
to the backend's kernel: gloo computes it for real.

It must not replace the CPU kernel and call the original from Python, as the interceptor
does the GEMMs': that call holds the GIL, and gloo's enqueue waits for the lock under
which a worker thread frees a finished operation, which takes the GIL when a tensor it
frees is one Python has let go of. A redispatch releases the GIL first.

``async_op`` tells blocking from not: ``dist.all_reduce(t)`` waits at once, DDP's buckets
and ``async_op=True`` do not. Their wait, in ``Work.wait``, is not seen (DDP's is in
C++), but the data it guards is: ``Pending`` has the rank wait for such an operation
where an op first uses one of its tensors (DDP copying a reduced bucket back into the
gradients), and its step ends no earlier than the operations it never used. Send and
receive are taken as blocking, as their blocking forms are. A receive from any source
cannot be paired with its send in virtual time: it is run and counted as untimed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from morphling.devices.models.op_count import tensors_in
from morphling.proxy.vtime.collectives import PAIR
from torch._C import DispatchKey
from torch._C._distributed_c10d import ProcessGroup

log = logging.getLogger(__name__)


class _Reader(NamedTuple):
    """Where a c10d op's schema (positional arguments) has what the report needs."""

    op: str  # COLLECTIVE_OPS
    data: int  # the argument whose tensors' bytes count (each member's part)
    group: int  # the process group
    root: int | None = None  # the root's (or peer's) group rank
    async_op: int | None = None  # None: blocking


_READERS = {
    "allreduce_": _Reader("allreduce", 0, 1, async_op=4),
    "allreduce_coalesced_": _Reader("allreduce", 0, 1, async_op=3),
    "broadcast_": _Reader("broadcast", 0, 1, root=2, async_op=4),
    "reduce_": _Reader("reduce", 0, 1, root=3, async_op=5),
    "allgather_": _Reader("allgather", 1, 2, async_op=3),
    "_allgather_base_": _Reader("allgather", 1, 2, async_op=3),
    "allgather_coalesced_": _Reader("allgather", 1, 2, async_op=3),
    "allgather_into_tensor_coalesced_": _Reader("allgather", 1, 2, async_op=3),
    "reduce_scatter_": _Reader("reduce_scatter", 1, 2, async_op=4),
    "_reduce_scatter_base_": _Reader("reduce_scatter", 1, 2, async_op=4),
    "reduce_scatter_tensor_coalesced_": _Reader("reduce_scatter", 1, 2, async_op=4),
    "gather_": _Reader("gather", 1, 2, root=3, async_op=4),
    "scatter_": _Reader("scatter", 0, 2, root=3, async_op=4),
    "alltoall_": _Reader("alltoall", 1, 2, async_op=3),
    "alltoall_base_": _Reader("alltoall", 1, 2, async_op=5),
    "barrier": _Reader("barrier", 0, 1, async_op=3),
    "monitored_barrier_": _Reader("barrier", 0, 1),
    "send": _Reader("send", 0, 1, root=2),
    "recv_": _Reader("recv", 0, 1, root=2),
}
UNPAIRED = "recv_any_source_"  # run, and counted as untimed
_KEY = DispatchKey.BackendSelect
_BELOW = torch._C._dispatch_keyset_full_after(_KEY)  # the backends' keys

# report(op, nbytes, ranks, root, blocking, tensors): ``ranks`` the group's global ranks
# (send and recv: [source, destination]), ``root`` a global rank or -1, ``tensors`` every
# tensor the operation reads or writes
Report = Callable[[str, int, list[int], int, bool, list[torch.Tensor]], None]


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in((value,)))


def _storage(tensor: torch.Tensor) -> int:
    """Its storage's address (0: none, as a sparse tensor's or a freed one's)."""
    return tensor.untyped_storage().data_ptr() if tensor.layout == torch.strided else 0


class Collectives:
    """While active (a context manager), every c10d op of this process is reported to
    ``report`` before it runs; ``untimed`` counts those that cannot be."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.untimed = 0
        self._library: torch.library.Library | None = None

    def __enter__(self) -> Collectives:
        library = torch.library.Library("c10d", "IMPL")
        for name, reader in _READERS.items():
            op = getattr(torch.ops.c10d, name).default
            library.impl(name, self._kernel(reader, op), _KEY.name, with_keyset=True)
        op = getattr(torch.ops.c10d, UNPAIRED).default
        library.impl(UNPAIRED, self._unpaired(op), _KEY.name, with_keyset=True)
        self._library = library
        return self

    def __exit__(self, *exc_info: object) -> None:
        library, self._library = self._library, None
        if library is not None:
            library._destroy()

    def _kernel(self, reader: _Reader, op: Any) -> Callable[..., Any]:
        schema = op._schema

        def kernel(keyset: Any, *given: Any, **named: Any) -> Any:
            if not keyset.has(DispatchKey.CPU):  # (a sparse tensor's, a fake one's)
                return op.redispatch(keyset & _BELOW, *given, **named)
            args = (
                [*given]
                + [  # the arguments not given positionally: named, or defaults
                    named.get(a.name, a.default_value) for a in schema.arguments[len(given) :]
                ]
            )
            ranks = self._group_ranks(args[reader.group])
            root = -1 if reader.root is None else ranks[args[reader.root]]
            if reader.op in PAIR:
                me = dist.get_rank()
                ranks = [me, root] if reader.op == "send" else [root, me]
            blocking = reader.async_op is None or not args[reader.async_op]
            tensors = [] if blocking else list(tensors_in(args))
            self.report(reader.op, _nbytes(args[reader.data]), ranks, root, blocking, tensors)
            return op.redispatch(keyset & _BELOW, *given, **named)

        return kernel

    def _unpaired(self, op: Any) -> Callable[..., Any]:
        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            if keyset.has(DispatchKey.CPU):
                self.untimed += 1
                if self.untimed == 1:
                    log.warning("a receive from any source is not timed: its sender is unknown")
            return op.redispatch(keyset & _BELOW, *args, **kwargs)

        return kernel

    @staticmethod
    def _group_ranks(boxed: Any) -> list[int]:
        return dist.get_process_group_ranks(ProcessGroup.unbox(boxed))


class Pending:
    """A rank's operations it did not wait for at once, by the storages of their tensors,
    until an op uses one of them: ``wait(request)`` then, and it is no longer pending."""

    def __init__(self, wait: Callable[[int], None]) -> None:
        self._wait = wait
        self._storages: dict[int, int] = {}  # a storage's address → the request using it

    def __bool__(self) -> bool:
        return bool(self._storages)

    def add(self, request: int, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if address := _storage(tensor):  # (FSDP frees some)
                self._storages[address] = request

    def used(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An op's arguments: the rank waits for each pending operation they use."""
        for tensor in tensors_in((*args, *kwargs.values())):
            request = self._storages.get(_storage(tensor))
            if request is not None:
                self._storages = {a: r for a, r in self._storages.items() if r != request}
                self._wait(request)

    def wait_all(self) -> None:
        """A step ends: it waits for those it never used, in the order it issued them."""
        for request in sorted(set(self._storages.values())):
            self._wait(request)
        self._storages.clear()

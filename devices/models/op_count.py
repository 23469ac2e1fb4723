"""What one aten op costs to run, as the op model counts it: its class, bytes and FLOPs.

The job's interceptor counts every op a coordinator runs with this, and the profiler counts
the ops it times with it, so a measured op model prices exactly what it was fitted on. It
needs torch, which the rest of the device models do not import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .ops import FRESH_MIN_BYTES, op_class, op_flops


def tensors_in(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among an op's arguments, in lists too (_foreach_* ops, cat, stack; a
    collective's lists of lists)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from tensors_in(value)


def count_op(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
    *,
    in_optimizer: bool = False,
) -> tuple[str, int, int, float]:
    """The class of aten op ``func`` called with ``args``/``kwargs`` that returned ``out``,
    the bytes it moved (its tensor operands read, its outputs written), those of its outputs
    in new memory from the OS (over ``FRESH_MIN_BYTES``, not an operand's, as an in-place
    op's is) and its FLOPs."""
    name = func.overloadpacket.__name__
    cls = op_class(name, is_view=func.is_view, in_optimizer=in_optimizer)
    if cls == "other":
        return cls, 0, 0, 0.0
    inputs = [*tensors_in(args), *tensors_in(kwargs.values())]
    outs = list(tensors_in(out if isinstance(out, (list, tuple)) else (out,)))
    out_sizes = [t.numel() * t.element_size() for t in outs]
    nbytes = sum(t.numel() * t.element_size() for t in inputs) + sum(out_sizes)
    large = [t for t, size in zip(outs, out_sizes, strict=True) if size > FRESH_MIN_BYTES]
    fresh = 0
    if large:  # rare: only then are the storages looked up
        read = {t.untyped_storage().data_ptr() for t in inputs}
        fresh = sum(t.numel() * t.element_size() for t in large
                    if t.untyped_storage().data_ptr() not in read)  # fmt: skip
    largest = max((t.numel() for t in (*inputs, *outs)), default=0)
    elements = max(largest, sum(t.numel() for t in outs))  # a _foreach_ op's, summed
    return cls, nbytes, fresh, op_flops(name, cls, elements)
